"""The shard stream: WebDataset shards -> pre-decode pruning -> decode -> Batch(ids, weights, ...).

A pass is laid out before any byte is read (`pass_layout`): the shard order is a pure function of
(seed, epoch), and the *kept* samples of that order are cut into equal contiguous slices, one per
(rank, loader worker). Every rank derives every rank's batch count from the plan and the index, so
all ranks stop at the same step with no collective (docs/design.md, principle 3). Pruned samples are read
as bytes and dropped before decoding (principle 2). Nothing here knows about models or pruners.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipelines.decode import NO_LABEL, SampleDecoder
from pipelines.shards import BadInput, BadInputError, ShardIndex, read_shard
from pruning.stream import PassPlan

log = logging.getLogger(__name__)

BAD_SAMPLE_POLICIES = ("skip", "stop")
PADDING_ID = -1  # id of a padding sample: weight 0, never recorded by a pruner


@dataclass
class Batch:
    """One training batch; `ids` are global sample ids (int64), -1 marks weight-0 padding."""

    ids: torch.Tensor  # int64 [B]
    weights: torch.Tensor  # float32 [B]
    images: torch.Tensor  # float32 [B, C, H, W] in [-1, 1] (or latents)
    labels: torch.Tensor  # int64 [B], -1 where the shards carry no class
    bad: tuple[BadInput, ...] = ()  # bad-input events met while filling this batch
    worker: int = 0  # the part of this rank's slice it came from (for resuming exactly)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return dataclasses.replace(self, ids=move(self.ids), weights=move(self.weights), images=move(self.images),
                                   labels=move(self.labels))

    def undecodable(self) -> int:
        """Samples read for this batch but not decodable."""
        return sum(e.samples_lost for e in self.bad if e.undecodable)

    def __len__(self) -> int:
        return len(self.ids)


def real_samples(batches) -> Iterator[Batch]:
    """The batches without their weight-0 padding (id -1); batches of padding only are left out."""
    for batch in batches:
        keep = batch.ids >= 0
        if bool(keep.all()):
            yield batch
        elif bool(keep.any()):
            yield dataclasses.replace(batch, ids=batch.ids[keep], weights=batch.weights[keep],
                                      images=batch.images[keep], labels=batch.labels[keep])


@dataclass(frozen=True)
class SliceOfShard:
    """Kept samples `[kept_start, kept_end)` (ordinals among the shard's kept samples) of one shard."""

    shard: int
    kept_start: int
    kept_end: int
    to_shard_end: bool  # the slice ends with the shard: read to its end, checking its length


@dataclass(frozen=True)
class PassLayout:
    """Who reads what in one pass, identical on every rank and worker."""

    shard_order: np.ndarray  # int64 [S]
    slices: tuple[tuple[SliceOfShard, ...], ...]  # per slot = rank * workers + worker
    batches: np.ndarray  # int64 [world, workers]: batches each worker yields
    kept: int  # kept samples in the pass
    batch_size: int

    @property
    def steps(self) -> int:
        """Batches per rank in this pass: the same on every rank."""
        return int(self.batches[0].sum())

    @property
    def tail(self) -> int:
        """Kept samples that no rank trains on this pass (at most (world * (workers + 1)) * batch)."""
        return self.kept - self.steps * self.batches.shape[0] * self.batch_size


def pass_layout(
    index: ShardIndex,
    kept: np.ndarray | None,
    *,
    seed: int,
    epoch: int,
    world_size: int,
    num_workers: int,
    batch_size: int,
) -> PassLayout:
    """Deterministic shard order, split of kept samples over ranks then workers, batch counts."""
    workers = max(1, num_workers)
    if kept is None:
        kept_per_shard = index.counts.copy()
    else:
        if len(kept) != index.num_samples:
            raise ValueError(f"plan covers {len(kept)} samples but {index.path} indexes {index.num_samples}")
        cum = np.concatenate([[0], np.cumsum(kept, dtype=np.int64)])
        first = index.first_ids
        kept_per_shard = cum[first + index.counts] - cum[first]
    order = np.random.default_rng([seed, epoch]).permutation(len(index)).astype(np.int64)
    ordered_cum = np.concatenate([[0], np.cumsum(kept_per_shard[order])])
    total = int(ordered_cum[-1])
    slots = world_size * workers
    bounds = [t * total // slots for t in range(slots + 1)]
    slices = []
    for t in range(slots):
        lo, hi = bounds[t], bounds[t + 1]
        mine = []
        j = int(np.searchsorted(ordered_cum, lo, side="right")) - 1
        while j < len(order) and ordered_cum[j] < hi:
            start = max(lo, ordered_cum[j]) - ordered_cum[j]
            end = min(hi, ordered_cum[j + 1]) - ordered_cum[j]
            if end > start:
                to_end = bool(end == ordered_cum[j + 1] - ordered_cum[j])
                mine.append(SliceOfShard(int(order[j]), int(start), int(end), to_end))
            j += 1
        slices.append(tuple(mine))
    sizes = np.diff(bounds).reshape(world_size, workers)
    batches = sizes // batch_size
    steps = int(batches.sum(axis=1).min())
    for rank in range(world_size):  # trim the ranks above the minimum, largest worker first
        while batches[rank].sum() > steps:
            batches[rank, int(np.argmax(batches[rank]))] -= 1
    return PassLayout(order, tuple(slices), batches.astype(np.int64), total, batch_size)


def batches_taken_per_worker(batches: np.ndarray, taken: int) -> tuple[np.ndarray, int]:
    """How many of each worker's batches the first `taken` loader batches were, and which worker
    yields the next one.

    torch's DataLoader hands out an IterableDataset's batches cyclically over its workers, passing
    over exhausted ones. A resumed loader starts its cycle at its worker 0, so that worker must play
    the part of the worker that was next in line: the rest of the cycle is then the same.
    """
    per_worker = np.zeros(len(batches), dtype=np.int64)
    left, last = taken, -1
    while left > 0:
        active = np.flatnonzero(per_worker < batches)
        if len(active) == 0:
            raise ValueError(f"cannot skip {taken} batches: the pass has only {int(batches.sum())}")
        step = active[:left]
        per_worker[step] += 1
        left -= len(step)
        last = int(step[-1])
    return per_worker, (last + 1) % len(batches)


class ShardStream(IterableDataset):
    """Batches of one rank for one pass at a time; call `pass_loader(epoch, plan)` per pass."""

    def __init__(
        self,
        index: ShardIndex,
        *,
        batch_size: int,
        decoder: SampleDecoder | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 1000,
        on_bad_sample: str = "stop",
    ):
        if on_bad_sample not in BAD_SAMPLE_POLICIES:
            raise ValueError(f"data.on_bad_sample: got {on_bad_sample!r}, accepted: {', '.join(BAD_SAMPLE_POLICIES)}")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, {rank}, {world_size}")
        self.index = index
        self.batch_size = batch_size
        self.decoder = decoder or SampleDecoder()
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle_buffer = shuffle_buffer
        self.on_bad_sample = on_bad_sample
        self._pass: _PassState | None = None

    # -------------------------------------------------------------- the main-process side
    def layout(self, epoch: int, plan: PassPlan | None, num_workers: int) -> PassLayout:
        return pass_layout(
            self.index,
            None if plan is None else plan.kept,
            seed=self.seed,
            epoch=epoch,
            world_size=self.world_size,
            num_workers=num_workers,
            batch_size=self.batch_size,
        )

    def pass_loader(
        self,
        epoch: int,
        plan: PassPlan | None = None,
        *,
        num_workers: int = 0,
        skip_batches: int = 0,
        skip_undecodable: np.ndarray | None = None,
        pin_memory: bool = False,
    ) -> "PassLoader":
        """This rank's batches of pass `epoch`, after skipping its first `skip_batches` undecoded.

        `skip_undecodable[w]`: the undecodable samples worker part w met in those batches (what
        `Batch.undecodable()` counted), which the skip passes over too, so that the order goes on
        exactly where it stopped."""
        if plan is not None and plan.epoch != epoch:
            raise ValueError(f"plan is for pass {plan.epoch}, not pass {epoch}")
        layout = self.layout(epoch, plan, num_workers)
        workers = max(1, num_workers)
        mine = layout.batches[self.rank]
        skipped, first_worker = batches_taken_per_worker(mine, skip_batches)
        extra = np.zeros(workers, dtype=np.int64) if skip_undecodable is None else np.asarray(skip_undecodable)
        if len(extra) != workers:
            raise ValueError(f"skip_undecodable has {len(extra)} entries for {workers} worker parts")
        self._pass = _PassState(epoch, plan, layout, workers, skipped, extra, first_worker)
        loader = DataLoader(self, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)
        return PassLoader(loader, layout, layout.steps - skip_batches)

    # -------------------------------------------------------------- the worker side
    def __iter__(self) -> Iterator[Batch]:
        state = self._pass
        if state is None:
            raise RuntimeError("iterate a ShardStream through pass_loader(epoch, plan)")
        info = get_worker_info()
        worker = ((0 if info is None else info.id) + state.first_worker) % state.workers
        slot = self.rank * state.workers + worker
        n_batches = int(state.layout.batches[self.rank, worker])
        skip = int(state.skipped[worker])
        rng = np.random.default_rng([self.seed, state.epoch, self.rank, worker])
        events: list[BadInput] = []
        raw = self._kept_raw_samples(state.layout.slices[slot], state.plan, events)
        samples = _shuffled(raw, self.shuffle_buffer, rng)
        replayed = collections.deque(maxlen=8)
        for _ in range(min(skip, n_batches) * self.batch_size + int(state.undecodable[worker])):
            replayed.append(next(samples, None))  # resume: replay the order without decoding
        events.clear()  # met while replaying: counted by the run that trained those batches
        template: list[torch.Tensor] = []  # the last decoded sample, to shape padding
        for k in range(skip, n_batches):
            yield self._next_batch(samples, state.epoch, events, template, replayed, worker, last=k == n_batches - 1)

    def _kept_raw_samples(self, slices, plan: PassPlan | None, events: list) -> Iterator[tuple[int, float, dict]]:
        """(id, weight, undecoded sample) of this slot's kept samples; the pre-decode stage."""
        first_ids = self.index.first_ids
        for piece in slices:
            url, first = self.index.urls[piece.shard], int(first_ids[piece.shard])
            count = int(self.index.counts[piece.shard])
            weights = np.ones(count) if plan is None else plan.weights[first:first + count]
            mine = np.flatnonzero(weights)[piece.kept_start:piece.kept_end]  # positions this slot delivers
            want = np.zeros(count, dtype=bool)
            want[mine] = True
            if len(mine) == 0 and not piece.to_shard_end:
                continue
            delivered, seen = 0, 0
            try:
                # Pruned samples and other slots' samples are skipped inside the tar reader: their
                # bytes are seeked past (read and dropped on a pipe), never decoded. A sample past
                # the index's count is read so that the error can name it.
                for position, sample in read_shard(url, lambda p: p >= count or bool(want[p])):
                    seen = position + 1
                    if position >= count:
                        raise BadInputError(
                            f"shard {url}: holds more than the {count} samples {self.index.path} lists "
                            f"(key {sample['__key__']!r}); re-index with `prunepipe shards index`"
                        )
                    if sample is None:
                        continue
                    delivered += 1
                    yield first + position, float(weights[position]), sample
                    if delivered == len(mine) and not piece.to_shard_end:
                        break  # the rest of this shard is another slot's
            except BadInputError as e:
                self._bad(events, BadInput(str(e), len(mine) - delivered))
                continue
            if delivered < len(mine) or (piece.to_shard_end and seen < count):
                message = f"shard {url}: ended after {seen} samples, {self.index.path} lists {count}"
                self._bad(events, BadInput(message, len(mine) - delivered))

    def _next_batch(self, samples, epoch: int, events: list, template: list, replayed, worker: int,
                    last: bool) -> Batch:
        ids, weights, images, labels = [], [], [], []
        while len(ids) < self.batch_size:
            item = next(samples, None)
            if item is None:
                break
            sample_id, weight, sample = item
            try:
                image, label = self.decoder(sample, sample_id, epoch)
            except BadInputError as e:
                self._bad(events, BadInput(str(e), undecodable=True))
                continue
            ids.append(sample_id)
            weights.append(weight)
            images.append(image)
            labels.append(label)
            template[:] = [image]
        if len(ids) < self.batch_size:
            # Bad samples left this worker short: pad with weight 0 so every rank still takes the
            # same number of steps; padding has id -1 and never reaches a pruner.
            if not template:  # a resumed worker that has decoded nothing yet: shape it like a replayed sample
                template[:] = self._first_decodable(reversed(replayed), epoch)
            if not template:
                raise BadInputError(f"rank {self.rank}: no decodable sample in pass {epoch} to shape padding")
            missing = self.batch_size - len(ids)
            ids += [PADDING_ID] * missing
            weights += [0.0] * missing
            images += [torch.zeros_like(template[0])] * missing
            labels += [NO_LABEL] * missing
        if last:  # read (never decode) this worker's tail, so a shard's bad end is still reported
            for _ in samples:
                pass
        bad = tuple(events)
        events.clear()  # the same list keeps collecting for the next batch
        return Batch(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(weights, dtype=torch.float32),
            torch.stack(images),
            torch.tensor(labels, dtype=torch.int64),
            bad,
            worker,
        )

    def _first_decodable(self, items, epoch: int) -> list[torch.Tensor]:
        """[the first of these (id, weight, raw sample) items that decodes, decoded], or []."""
        for item in items:
            if item is None:
                continue
            try:
                return [self.decoder(item[2], item[0], epoch)[0]]
            except BadInputError:
                continue
        return []

    def _bad(self, events: list, event: BadInput) -> None:
        if self.on_bad_sample == "stop":
            raise BadInputError(event.message + " (data.on_bad_sample=stop; set it to skip to go on)")
        log.warning("skipping %d sample(s): %s", event.samples_lost, event.message)
        events.append(event)


@dataclass
class _PassState:
    epoch: int
    plan: PassPlan | None
    layout: PassLayout
    workers: int
    skipped: np.ndarray  # int64 [workers]: batches each worker skips (resume)
    undecodable: np.ndarray  # int64 [workers]: undecodable samples among them, skipped too
    first_worker: int  # the worker whose part loader worker 0 plays (resume)


class PassLoader:
    """The loader of one pass: iterable of Batch with a known length (equal on all ranks)."""

    def __init__(self, loader: DataLoader, layout: PassLayout, length: int):
        self.loader, self.layout, self.length = loader, layout, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


def _shuffled(items: Iterator, buffer_size: int, rng: np.random.Generator) -> Iterator:
    """A shuffle buffer: hold up to `buffer_size` items, emit a random one as each new one arrives."""
    if buffer_size <= 1:
        yield from items
        return
    buffer: list = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        k = int(rng.integers(len(buffer)))
        buffer[k], item = item, buffer[k]
        yield item
    while buffer:
        k = int(rng.integers(len(buffer)))
        buffer[k], buffer[-1] = buffer[-1], buffer[k]
        yield buffer.pop()
