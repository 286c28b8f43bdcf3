"""Many sources, one id space: `data.train` as a list of shard folders, each with a weight, a repeat
factor or a fixed count per pass, and each pass's draw of them as a pure function of (seed, pass).

Ids stay dense and global: a source's offset plus its local id, sources in the order listed. A pass
takes each source `full` times whole and once more in part: the `partial` samples whose place in a
seeded permutation of the source (a Feistel network, cycle-walked onto [0, n)) is below `partial`.
So the counts are exact, every rank and loader worker tells membership from (seed, pass, id) alone,
and nothing per sample is stored. Reads index.json files only; never a shard, never a model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from prunepipe.pipelines.data.shards import ShardIndex, index_file
from prunepipe.pruning.splitmix import uniform_coin

RULES = ("weight", "repeat", "count")
MAX_SOURCES = 1024  # the draw keys a source into 10 bits of its stream
# index.json keys every source of a mixture must share: they say what a sample is (latents of which
# VAE and shape, text features of which encoder), and the task is built from the first source's
AGREED_META = ("latent_shape", "vae", "scaling_factor", "shift_factor", "text_encoder", "text_width")
_DRAW_SALT = 0x6D6978  # "mix": the draw's stream is neither the keep coin's nor an augmentation's
_FEISTEL_ROUNDS = 4
# A sample walked w > 0 times already in a pass draws its noise, mask, crop and flip by the key
# id + (w << WALK_SHIFT), not by its id: each walk of an upsampled source is another augmentation.
# Walk 0's key is the id itself, so a source taken once draws as it always did.
WALK_SHIFT = 40
MAX_SAMPLES = 1 << WALK_SHIFT


@dataclass(frozen=True)
class Source:
    """One entry of `data.train` (or `data.val`): a shard folder, its name, and how much of it a pass takes."""

    name: str
    path: str
    weight: float | None = None  # share of a pass's samples (all sources weighted, or none)
    repeat: float | None = None  # passes over this source per pass; fractional allowed
    count: int | None = None  # samples of this source per pass
    named: bool = False  # the name was given, not taken from the folder (which moves with the shards)

    @property
    def rule(self) -> str:
        return next(r for r in RULES if getattr(self, r) is not None)


def parse_sources(value: Any, key: str = "data.train", *, rules: bool = True) -> tuple[Source, ...]:
    """`value` as sources: a folder (one source taken whole each pass, as a single-folder run always
    was) or a list of {name, path, weight | repeat | count}. `rules=False` (held-out splits) accepts
    no rule: each source is read whole."""
    if isinstance(value, str):
        if not value:
            return ()
        return (Source(_folder_name(value), value, repeat=1.0),)
    if not isinstance(value, Sequence) or isinstance(value, (bytes, dict)) or not value:
        raise ValueError(f"{key}: a shard folder or a non-empty list of sources {{name, path, {' | '.join(RULES)}}}")
    if len(value) > MAX_SOURCES:
        raise ValueError(f"{key}: {len(value)} sources; at most {MAX_SOURCES}")
    sources = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(entry, str):  # a bare folder in a list: taken whole
            entry = {"path": entry}
        if not hasattr(entry, "keys"):
            raise ValueError(f"{where}: expected {{name, path, {' | '.join(RULES)}}}, got {entry!r}")
        entry = dict(entry)
        unknown = sorted(set(entry) - {"name", "path", *RULES})
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; accepted: name, path, {', '.join(RULES)}")
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}.path: a shard folder (with index.json) is required")
        named = bool(entry.get("name"))
        name = str(entry.get("name") or _folder_name(path))
        given = [r for r in RULES if entry.get(r) is not None]
        if not rules and given:
            raise ValueError(f"{where}.{given[0]}: held-out sources are read whole; give name and path only")
        if rules and len(given) > 1:
            raise ValueError(f"{where}: give one of {', '.join(RULES)}, not {' and '.join(given)}")
        rule = given[0] if given else "repeat"
        amount = entry.get(rule, 1.0)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount):
            raise ValueError(f"{where}.{rule}: a number, got {amount!r}")
        if rule == "count" and (amount != int(amount) or amount < 0):
            raise ValueError(f"{where}.count: a whole number of samples >= 0, got {amount!r}")
        if rule != "count" and amount < 0 or rule == "weight" and amount == 0:
            raise ValueError(f"{where}.{rule}: must be {'> 0' if rule == 'weight' else '>= 0'}, got {amount!r}")
        sources.append(
            Source(name, path, named=named, **{rule: int(amount) if rule == "count" else float(amount)})  # type: ignore[arg-type]
        )
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{key}: source name {twice[0]!r} is given twice; names must be unique")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ValueError(
            f"{key}: weights share a pass among the weighted sources; give every source a weight, "
            f"or each a repeat or count"
        )
    return tuple(sources)


def source_paths(value: Any, key: str = "data.train") -> list[str]:
    """The shard folders `value` names (a folder, or a list of sources), in order; [] for ""."""
    return [s.path for s in parse_sources(value, key, rules=key == "data.train")]


def check_pass_length(sources: tuple[Source, ...], samples_per_pass: int, key: str = "data.train") -> None:
    """data.samples_per_pass: >= 0, and only for a weighted mixture (repeat and count fix a pass themselves)."""
    if samples_per_pass < 0:
        raise ValueError(f"data.samples_per_pass must be >= 0, got {samples_per_pass}")
    if samples_per_pass and not all(s.weight is not None for s in sources):
        raise ValueError(
            f"data.samples_per_pass={samples_per_pass} sets a weighted mixture's pass length; {key} gives no "
            f"weights (repeat and count fix each source's share themselves)"
        )


def first_path(value: Any, key: str = "data.train") -> str:
    """The first folder of `value` ("" for none): where a run reads what all its sources share."""
    paths = source_paths(value, key)
    return paths[0] if paths else ""


def _folder_name(path: str) -> str:
    folder = os.path.dirname(index_file(path)) if path.endswith(".json") else path
    parts = [p for p in os.path.normpath(folder).split(os.sep) if p not in ("", ".")]
    return "/".join(parts[-2:]) if parts else "train"


@dataclass(frozen=True)
class PassDraw:
    """How often pass `pass_index` takes each source: `full` times whole, then `partial` samples more.
    Small (a few numbers a source): it travels to every loader worker with the pass."""

    seed: int
    pass_index: int
    offsets: tuple[int, ...]  # K + 1 global id offsets
    full: tuple[int, ...]
    partial: tuple[int, ...]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    @property
    def drawn(self) -> np.ndarray:
        """int64 [K]: samples each source gives the pass (before pruning)."""
        return np.asarray(self.full, dtype=np.int64) * self.sizes + np.asarray(self.partial, dtype=np.int64)

    @property
    def copies(self) -> np.ndarray:
        """int64 [K]: how many times a source is walked in the pass (the last walk partial)."""
        return np.asarray(self.full, dtype=np.int64) + (np.asarray(self.partial) > 0)

    @property
    def whole(self) -> bool:
        """Every source exactly once: the pass a single folder always had."""
        return all(f == 1 for f in self.full) and not any(self.partial)

    def in_copy(self, source: int, copy: int, ids: np.ndarray) -> np.ndarray:
        """bool per global id of `source`: taken by walk `copy` of it this pass."""
        ids = np.asarray(ids, dtype=np.int64)
        if copy < self.full[source]:
            return np.ones(len(ids), dtype=bool)
        if copy > self.full[source] or self.partial[source] == 0:
            return np.zeros(len(ids), dtype=bool)
        local = ids - self.offsets[source]
        size = self.offsets[source + 1] - self.offsets[source]
        return permuted(local, size, self.seed, self.pass_index, source) < self.partial[source]


def permuted(local: np.ndarray, size: int, seed: int, pass_index: int, source: int) -> np.ndarray:
    """Each local id's place in a seeded permutation of [0, size): a Feistel network on the fewest bits
    covering `size` (halves of unequal width when the count is odd), walked again while it lands
    outside (under 2 walks on average, as the domain is less than twice `size`). A bijection, so
    taking the places below k takes exactly k samples."""
    x = np.asarray(local, dtype=np.int64).copy()
    if size <= 1:
        return x
    bits = max(2, (size - 1).bit_length())
    outside = np.ones(len(x), dtype=bool)
    while outside.any():
        x[outside] = _feistel(x[outside], bits, seed, pass_index, source)
        outside = x >= size
    return x


def _feistel(x: np.ndarray, bits: int, seed: int, pass_index: int, source: int) -> np.ndarray:
    """One pass of an unbalanced Feistel network over `bits`-bit numbers: the halves (widths a and b)
    trade places each round, so after an even number of rounds they are back at their widths."""
    wide, narrow = bits - bits // 2, bits // 2
    left, right = x >> narrow, x & ((1 << narrow) - 1)  # `left` is `wide` bits, `right` `narrow`
    widths = (wide, narrow)
    for round_ in range(_FEISTEL_ROUNDS):
        key = ((pass_index * MAX_SOURCES + source) * _FEISTEL_ROUNDS + round_) & ((1 << 62) - 1)
        width = widths[round_ % 2]  # the width of `left`, which the round function's output is folded into
        f = (uniform_coin(seed ^ _DRAW_SALT, key, right) * (1 << width)).astype(np.int64)
        left, right = right, left ^ f
    return (left << narrow) | right


@dataclass(frozen=True)
class Mixture:
    """The sources of one split as one index: shard i of the combined index is a shard of source
    `shard_source[i]`, and the ids of source k are offsets[k] .. offsets[k+1]-1."""

    sources: tuple[Source, ...]
    index: ShardIndex
    offsets: np.ndarray  # int64 [K + 1]
    shard_source: np.ndarray  # int64 [S]
    samples_per_pass: int  # weights only: the pass's length (0: every source's samples once)

    @classmethod
    def load(cls, value: Any, *, samples_per_pass: int = 0, key: str = "data.train") -> "Mixture":
        """Read every source's index.json and lay the sources end to end."""
        sources = parse_sources(value, key)
        if not sources:
            raise ValueError(f"{key}: no shards to train on")
        return cls.of(sources, [ShardIndex.load(s.path) for s in sources], samples_per_pass=samples_per_pass, key=key)

    @classmethod
    def of(
        cls,
        sources: tuple[Source, ...],
        indexes: list[ShardIndex],
        *,
        samples_per_pass: int = 0,
        key: str = "data.train",
    ) -> "Mixture":
        """The sources laid end to end, from their indexes (read already, in the order listed)."""
        if len(indexes) == 1:
            index = indexes[0]
        else:
            _check_alike(sources, indexes, key)
            meta, buckets = _merged_buckets(sources, indexes, key)
            index = ShardIndex(
                tuple(u for i in indexes for u in i.urls),
                np.concatenate([i.counts for i in indexes]),
                " + ".join(i.path for i in indexes),
                meta,
                np.concatenate([i.sizes for i in indexes]),
                np.concatenate([i.crcs for i in indexes]),
                buckets,
            )
        sizes = np.array([i.num_samples for i in indexes], dtype=np.int64)
        if int(sizes.sum()) >= MAX_SAMPLES:
            raise ValueError(f"{key}: {int(sizes.sum()):,} samples; ids must stay below 2**{WALK_SHIFT}")
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        shard_source = np.repeat(np.arange(len(sources), dtype=np.int64), [len(i) for i in indexes])
        check_pass_length(sources, samples_per_pass, key)
        return cls(sources, index, offsets, shard_source, int(samples_per_pass))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """int64 per global id: the index of its source."""
        return np.searchsorted(self.offsets, np.asarray(ids, dtype=np.int64), side="right") - 1

    def per_pass(self) -> np.ndarray:
        """int64 [K]: samples each source gives every pass, by its rule; the same each pass."""
        sizes = self.sizes
        if self.sources[0].weight is not None:
            length = self.samples_per_pass or int(sizes.sum())
            weights = np.array([s.weight for s in self.sources], dtype=np.float64)
            return apportion(length, weights)
        counts = []
        for source, size in zip(self.sources, sizes):
            if source.count is not None:
                counts.append(source.count)
            else:
                counts.append(int(round(source.repeat * int(size))))
        return np.array(counts, dtype=np.int64)

    def draw(self, seed: int, pass_index: int) -> PassDraw:
        counts, sizes = self.per_pass(), self.sizes
        empty = [s.name for s, n, c in zip(self.sources, sizes, counts) if n == 0 and c > 0]
        if empty:
            raise ValueError(f"source {empty[0]!r} holds no samples but its rule asks for some each pass")
        full = np.where(sizes > 0, counts // np.maximum(sizes, 1), 0)
        partial = counts - full * sizes
        return PassDraw(
            int(seed),
            int(pass_index),
            tuple(int(o) for o in self.offsets),
            tuple(map(int, full)),
            tuple(map(int, partial)),
        )

    def record(self) -> dict:
        """What a resume must find again: sizes, offsets, rules and the names given (not paths, nor
        names taken from folders: shards move between clusters and scratch disks)."""
        return {
            "sources": [
                {
                    "name": s.name if s.named else None,
                    "samples": int(n),
                    "offset": int(o),
                    "rule": s.rule,
                    s.rule: getattr(s, s.rule),
                }
                for s, n, o in zip(self.sources, self.sizes, self.offsets)
            ],
            "samples_per_pass": self.samples_per_pass,
        }

    def changed_from(self, recorded: dict) -> str:
        """ "" when `recorded` (a checkpoint's `record()`) is this mixture, else what changed, said plainly.
        Sources are matched by position; an unnamed one matches any name."""
        was, now = recorded.get("sources", []), self.record()["sources"]
        said = []
        if len(was) != len(now):
            said.append(f"{len(was)} source(s) then, {len(now)} now")
        for i, (a, b) in enumerate(zip(was, now)):
            label = repr(b["name"] or a["name"] or f"#{i + 1}")
            for field in sorted(set(a) | set(b)):
                if field == "name" and (a["name"] is None or b["name"] is None):
                    continue
                if a.get(field) != b.get(field):
                    said.append(f"source {label}: {field} {a.get(field)!r} -> {b.get(field)!r}")
        if recorded.get("samples_per_pass") != self.samples_per_pass:
            said.append(f"data.samples_per_pass {recorded.get('samples_per_pass')} -> {self.samples_per_pass}")
        return "; ".join(said)

    def describe(self) -> str:
        """One line per source: name, samples, rule, samples a pass."""
        per_pass = self.per_pass()
        lines = [
            f"  {s.name}: {int(n)} samples (ids {int(o)}..{int(o + n) - 1}), {s.rule} {getattr(s, s.rule):g} "
            f"-> {int(k)} a pass ({k / max(per_pass.sum(), 1):.1%})"
            for s, n, o, k in zip(self.sources, self.sizes, self.offsets, per_pass)
        ]
        return "\n".join(lines)


def integer_counts(real: np.ndarray, total: int) -> np.ndarray:
    """int64 counts summing to `total` from real ones summing to at most `total`: each rounded down,
    then the largest remainders (ties to the first) rounded up."""
    counts = np.floor(real).astype(np.int64)
    short = int(total - counts.sum())
    counts[np.argsort(-(real - counts), kind="stable")[:short]] += 1
    return counts


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """int64 counts that sum to `total`, in proportion to `weights`."""
    weights = np.asarray(weights, dtype=np.float64)
    return integer_counts(total * weights / weights.sum(), total)


def draw_keys(ids, walks):
    """The keys a batch's per-sample draws are made by: the id for a sample's first walk of the pass,
    id + (walk << WALK_SHIFT) for a later one (numpy arrays, torch tensors or ints alike)."""
    return ids + (walks << WALK_SHIFT)


def _merged_buckets(sources: tuple[Source, ...], indexes: list[ShardIndex], key: str) -> tuple[dict, np.ndarray | None]:
    """The combined index's meta and per-shard buckets: one table of every source's buckets, a bucket
    being its stored shape (two sources' 512x256 buckets batch together)."""
    meta = dict(indexes[0].meta)
    bucketed = [i.buckets is not None for i in indexes]
    if not any(bucketed):
        return meta, None
    if not all(bucketed):
        plain = sources[bucketed.index(False)]
        raise ValueError(
            f"{key}: source {plain.name!r} ({plain.path}) is not bucketed by aspect ratio but "
            f"{sources[bucketed.index(True)].name!r} is; encode every source with the same --buckets"
        )
    table: list[dict] = []
    where: dict[tuple, int] = {}
    remapped = []
    for index in indexes:
        mine = []
        for entry, shape in zip(index.bucket_table, index.bucket_shapes):
            if shape not in where:
                where[shape] = len(table)
                table.append(entry)
            mine.append(where[shape])
        remapped.append(np.asarray(mine, dtype=np.int64)[index.buckets])
    meta["buckets"] = table
    return meta, np.concatenate(remapped)


def _check_alike(sources: tuple[Source, ...], indexes: list[ShardIndex], key: str) -> None:
    """Sources of one run hold the same kind of sample; a difference names both sources."""
    first = indexes[0].meta
    for source, index in zip(sources[1:], indexes[1:]):
        for name in AGREED_META:
            a, b = first.get(name), index.meta.get(name)
            if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
                raise ValueError(
                    f"{key}: sources {sources[0].name!r} ({indexes[0].path}) and {source.name!r} ({index.path}) "
                    f"differ in {name} ({a!r} vs {b!r}); every source of a run must hold the same kind of sample"
                )


# ----------------------------------------------------------------------------- a pass's walks over shards
@dataclass(frozen=True)
class PassUnits:
    """The walks over shards one pass makes: unit u reads shard `shard[u]` for walk `copy[u]` of its
    source and keeps `kept[u]` of its samples. A pass of whole sources has one unit per shard, in
    shard order, so a single folder lays out as it always did."""

    shard: np.ndarray  # int64 [U]
    copy: np.ndarray  # int64 [U]
    kept: np.ndarray  # int64 [U]


def pass_units(index: ShardIndex, shard_source: np.ndarray, draw: PassDraw | None, kept_per_shard, kept_between):
    """The units of a pass: each shard once per walk of its source. `kept_per_shard` (int64 [S]) counts a
    whole walk's kept samples; `kept_between(start, stop)` (bool per id, the plan's) is asked only for
    the shards of a partial walk."""
    if draw is None or draw.whole:
        shards = np.arange(len(index), dtype=np.int64)
        return PassUnits(shards, np.zeros(len(index), dtype=np.int64), np.asarray(kept_per_shard, dtype=np.int64))
    copies = draw.copies[shard_source]
    shard = np.repeat(np.arange(len(index), dtype=np.int64), copies)
    starts = np.concatenate([[0], np.cumsum(copies)[:-1]])
    copy = np.arange(len(shard), dtype=np.int64) - np.repeat(starts, copies)
    kept = np.asarray(kept_per_shard, dtype=np.int64)[shard].copy()
    first_ids = index.first_ids
    partial = np.flatnonzero(copy == np.asarray(draw.full, dtype=np.int64)[shard_source[shard]])
    for u in partial:
        s = int(shard[u])
        start, stop = int(first_ids[s]), int(first_ids[s] + index.counts[s])
        mask = kept_between(start, stop) & draw.in_copy(int(shard_source[s]), int(copy[u]), np.arange(start, stop))
        kept[u] = int(np.count_nonzero(mask))
    return PassUnits(shard, copy, kept)
