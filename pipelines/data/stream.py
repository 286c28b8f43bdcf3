"""The shard stream: WebDataset shards -> pre-decode pruning -> decode -> Batch(ids, weights, ...).

Each (rank, loader worker) reads the slice of kept samples `pipelines/data/layout.py` gives it.
Pruned samples are seeked past or read as bytes and dropped before decoding (docs/design.md,
principle 2). Over a bucketed index (aspect-ratio buckets) a worker reads each bucket's pieces as a
sample stream of its own and emits batches of one bucket each, in a seeded random interleaving of its
per-bucket batch counts. Nothing here knows about models, tasks or pruners beyond the frozen `PassPlan`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import queue as queue_module
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from prunepipe.pipelines.data.batch import PADDING_ID, Batch, text_fields
from prunepipe.pipelines.data.decode import NO_LABEL, SampleDecoder, stack_pixels
from prunepipe.pipelines.data.layout import (
    PassLayout,
    SliceOfShard,
    batches_taken_per_worker,
    pass_layout,
)
from prunepipe.pipelines.data.mixture import Mixture, PassDraw, draw_keys, pass_units
from prunepipe.pipelines.data.remote import ReadRetry
from prunepipe.pipelines.data.shards import (
    DEFAULT_RETRY,
    BadInput,
    BadInputError,
    ShardCursor,
    ShardIndex,
    read_shard,
    resumable,
)
from prunepipe.pruning.pass_plan import PassPlan

log = logging.getLogger(__name__)

BAD_SAMPLE_POLICIES = ("skip", "stop")


class ShardStream:
    """Batches of one rank for one pass at a time; call `pass_loader(pass_index, plan)` per pass.

    Loader workers persist across passes: each pass hands every worker its part through a mailbox
    instead of starting new processes (a start and a shutdown cost about a tenth of a second, a
    large share of a short pass). `close()` stops them; so does dropping the stream."""

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
        retry: ReadRetry = DEFAULT_RETRY,
        mixture: Mixture | None = None,
    ):
        """`mixture`: the sources `index` was laid out from (pipelines/data/mixture.py); each pass then
        walks them by its draw. None: `index` is one source, taken whole each pass."""
        if mixture is not None and mixture.index is not index:
            raise ValueError("a mixture's stream reads the mixture's own index (Mixture.index)")
        if on_bad_sample not in BAD_SAMPLE_POLICIES:
            raise ValueError(f"data.on_bad_sample: got {on_bad_sample!r}, accepted: {', '.join(BAD_SAMPLE_POLICIES)}")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, {rank}, {world_size}")
        self.index = index
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.mixture = mixture
        self._reader = _PartReader(
            index,
            batch_size,
            decoder or SampleDecoder(),
            seed,
            rank,
            shuffle_buffer,
            on_bad_sample,
            retry,
            None if mixture is None else mixture.shard_source,
        )
        self._loader: DataLoader | None = None
        self._loader_settings: tuple | None = None
        self._passes_posted = 0

    @property
    def num_buckets(self) -> int:
        """The index's aspect-ratio buckets (0: not bucketed): undecodable counts are kept per worker part
        and bucket, `max(1, num_buckets)` a part."""
        return self.index.num_buckets

    def draw(self, pass_index: int) -> PassDraw | None:
        """How pass `pass_index` takes each source (None: one source, whole)."""
        return None if self.mixture is None else self.mixture.draw(self.seed, pass_index)

    def layout(self, pass_index: int, plan: PassPlan | None, num_workers: int) -> PassLayout:
        if plan is not None and plan.num_samples != self.index.num_samples:
            raise ValueError(
                f"plan covers {plan.num_samples} samples but {self.index.path} indexes {self.index.num_samples}"
            )
        kept = None if plan is None else plan.kept_per_shard(self.index.first_ids, self.index.counts)
        draw = self.draw(pass_index)
        units = None
        if draw is not None:
            everything = self.index.counts if kept is None else kept
            units = pass_units(
                self.index,
                self.mixture.shard_source,
                draw,
                everything,
                (lambda a, b: np.ones(b - a, dtype=bool)) if plan is None else plan.kept_between,
            )
        layout = pass_layout(
            self.index,
            kept,
            seed=self.seed,
            pass_index=pass_index,
            world_size=self.world_size,
            num_workers=num_workers,
            batch_size=self.batch_size,
            units=units if draw is not None and not draw.whole else None,
        )
        length = self.index.num_samples if draw is None else int(draw.drawn.sum())
        layout = dataclasses.replace(layout, length=length)
        if units is not None:
            sources = self.mixture.shard_source[units.shard]
            per_source = np.bincount(sources, weights=units.kept, minlength=len(self.mixture.sources))
            layout = dataclasses.replace(layout, kept_per_source=per_source.astype(np.int64))
        return layout

    def pass_loader(
        self,
        pass_index: int,
        plan: PassPlan | None = None,
        *,
        num_workers: int = 0,
        skip_batches: int = 0,
        skip_undecodable: np.ndarray | None = None,
        pin_memory: bool = False,
        start_method: str | None = None,
    ) -> "PassLoader":
        """This rank's batches of pass `pass_index`, after skipping its first `skip_batches` undecoded.

        `skip_undecodable[w * max(1, B) + b]`: the undecodable samples worker part w met in its stream
        of bucket b in those batches (what `Batch.undecodable()` counted; B = `num_buckets`, 0 and
        b = 0 when the index is not bucketed), which the skip passes over too, so that the order goes
        on exactly where it stopped. `start_method` (fork, spawn, forkserver; None: the platform's)
        starts the loader workers; under each they read the plan without a copy of it. Iterate
        one pass's loader before asking for the next: the workers serve the latest pass."""
        if plan is not None and plan.pass_index != pass_index:
            raise ValueError(f"plan is for pass {plan.pass_index + 1}, not pass {pass_index + 1} (counted from 1)")
        layout = self.layout(pass_index, plan, num_workers)
        workers = max(1, num_workers)
        streams = max(1, self.num_buckets)  # sample streams per worker part
        mine = layout.batches[self.rank]
        skipped, first_worker = batches_taken_per_worker(mine, skip_batches)
        extra = (
            np.zeros(workers * streams, dtype=np.int64)
            if skip_undecodable is None
            else np.asarray(skip_undecodable, dtype=np.int64)
        )
        if len(extra) != workers * streams:
            raise ValueError(
                f"skip_undecodable has {len(extra)} entries for {workers} worker parts x {streams} bucket stream(s)"
            )
        if plan is not None and num_workers > 0:
            plan = plan.share()  # spawn-started workers map the plan's bitmaps instead of copying them
        self._passes_posted += 1
        parts = []
        for loader_worker in range(workers):  # resuming rotates which part loader worker 0 plays
            part = (loader_worker + first_worker) % workers
            slot = self.rank * workers + part
            parts.append(
                PartOfPass(
                    self._passes_posted,
                    pass_index,
                    plan,
                    self.draw(pass_index),
                    part,
                    layout.slices[slot],
                    int(mine[part]),
                    int(skipped[part]),
                    tuple(int(v) for v in extra[part * streams : (part + 1) * streams]),
                    None if layout.bucket_batches is None else tuple(int(v) for v in layout.bucket_batches[slot]),
                )
            )
        loader = self._loader_for(num_workers, pin_memory, start_method)
        self._reader.post(parts, self._passes_posted)
        return PassLoader(loader, layout, layout.steps - skip_batches)

    def _loader_for(self, num_workers: int, pin_memory: bool, start_method: str | None) -> DataLoader:
        """The DataLoader for these settings: the same one (and its workers) pass after pass."""
        settings = (num_workers, pin_memory, start_method)
        if self._loader is not None and self._loader_settings == settings:
            return self._loader
        self.close()
        if num_workers > 0:
            context = multiprocessing.get_context(start_method)
            self._reader.open_mailbox(num_workers, context)
            self._loader = DataLoader(
                self._reader,
                batch_size=None,
                num_workers=num_workers,
                pin_memory=pin_memory,
                multiprocessing_context=context,
                persistent_workers=True,
                worker_init_fn=_start_worker,
            )
        else:
            self._reader.close_mailbox()
            self._loader = DataLoader(self._reader, batch_size=None, pin_memory=pin_memory)
        self._loader_settings = settings
        return self._loader

    def close(self) -> None:
        """Stop the loader workers (a later pass starts new ones)."""
        loader, self._loader, self._loader_settings = self._loader, None, None
        # torch stops persistent workers when their iterator is collected; this is what that calls
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def _start_worker(worker: int) -> None:
    """A loader worker hands its batches over by shared-memory file name. The default, a file
    descriptor per tensor, costs the training process a socket round trip to this worker for each
    batch it receives (about 0.4 ms more per batch, docs/throughput.md)."""
    torch.multiprocessing.set_sharing_strategy("file_system")


@dataclass(frozen=True)
class PartOfPass:
    """What one loader worker reads in one pass: its part of this rank's slice."""

    token: int  # which posted pass this is: a worker drops parts of passes abandoned before it read them
    pass_index: int
    plan: PassPlan | None
    draw: PassDraw | None  # how the pass takes each source of a mixture (None: one source, whole)
    part: int  # the worker part it plays (resume may rotate them)
    slices: tuple[SliceOfShard, ...]
    batches: int
    skip: int  # batches to replay without decoding (resume)
    undecodable: tuple[int, ...]  # undecodable samples among them, replayed too: one count per bucket (one if none)
    bucket_batches: tuple[int, ...] | None = None  # a bucketed index: this part's batches of each bucket


class _Mailbox:
    """The latest pass's parts, from the training process to its persistent loader workers: one
    queue per worker, and the token of the current pass."""

    WAIT_SECONDS = 600.0

    def __init__(self, workers: int, context):
        self.queues = [context.Queue() for _ in range(workers)]
        self.current = context.Value("q", 0)

    def post(self, parts: list[PartOfPass], token: int) -> None:
        self.current.value = token
        for queue, part in zip(self.queues, parts):
            queue.put(part)

    def receive(self, worker: int) -> PartOfPass:
        while True:
            try:
                part = self.queues[worker].get(timeout=self.WAIT_SECONDS)
            except queue_module.Empty:
                raise RuntimeError(f"loader worker {worker} got no pass to read in {self.WAIT_SECONDS:.0f} s") from None
            if part.token == self.current.value:
                return part


class _PartReader(IterableDataset):
    """The worker side: reads, prunes before decoding, decodes and batches one part of one pass."""

    def __init__(
        self,
        index: ShardIndex,
        batch_size: int,
        decoder: SampleDecoder,
        seed: int,
        rank: int,
        shuffle_buffer: int,
        on_bad_sample: str,
        retry: ReadRetry,
        shard_source: np.ndarray | None = None,
    ):
        self.index = index
        self.shard_source = shard_source  # int64 [S]: each shard's source in a mixture
        self.batch_size = batch_size
        self.decoder = decoder
        self.seed = seed
        self.rank = rank
        self.shuffle_buffer = shuffle_buffer
        self.on_bad_sample = on_bad_sample
        self.retry = retry  # how a pipe: or http(s) shard's failed read is retried
        self._mailbox: _Mailbox | None = None
        self._in_process: PartOfPass | None = None

    def open_mailbox(self, workers: int, context) -> None:
        self._mailbox = _Mailbox(workers, context)  # before the workers start: they inherit it

    def close_mailbox(self) -> None:
        self._mailbox = None

    def post(self, parts: list[PartOfPass], token: int) -> None:
        if self._mailbox is None:
            self._in_process = parts[0]
        else:
            self._mailbox.post(parts, token)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        part = self._in_process if info is None else self._mailbox.receive(info.id)
        if part is None:
            raise RuntimeError("iterate a ShardStream through pass_loader(pass_index, plan)")
        if part.bucket_batches is not None:
            yield from self._bucketed_batches(part)
            return
        rng = np.random.default_rng([self.seed, part.pass_index, self.rank, part.part])
        events: list[BadInput] = []
        raw = self._kept_raw_samples(part.slices, part.plan, events, part.draw)
        samples = _shuffled(raw, self.shuffle_buffer, rng)
        replayed = collections.deque(maxlen=8)
        for _ in range(min(part.skip, part.batches) * self.batch_size + part.undecodable[0]):
            replayed.append(next(samples, None))  # resume: replay the order without decoding
        events.clear()  # met while replaying: counted by the run that trained those batches
        template: list[torch.Tensor] = []  # the last decoded sample, to shape padding
        for k in range(part.skip, part.batches):
            yield self._next_batch(
                samples,
                part.pass_index,
                events,
                template,
                replayed,
                part.part,
                drain=[samples] if k == part.batches - 1 else [],
            )

    def _bucketed_batches(self, part: PartOfPass) -> Iterator[Batch]:
        """A part of a bucketed pass: each bucket's pieces a sample stream of its own (pre-decode pruning
        as ever, a share of the shuffle buffer in proportion to its kept samples, its own seeded
        shuffle), and the batches in a random interleaving of the per-bucket batch counts drawn from
        (seed, pass, rank, part). Resuming replays the first `skip` entries of that order, each taking a
        batch of samples from its bucket's stream, and then each stream's undecodable samples."""
        counts = np.asarray(part.bucket_batches, dtype=np.int64)
        buckets = self.index.buckets
        order = np.random.default_rng([self.seed, part.pass_index, self.rank, part.part]).permutation(
            np.repeat(np.arange(len(counts)), counts)
        )
        pieces: dict[int, list[SliceOfShard]] = {}
        for piece in part.slices:
            pieces.setdefault(int(buckets[piece.shard]), []).append(piece)
        kept = {b: sum(p.kept_end - p.kept_start for p in mine) for b, mine in pieces.items()}
        total = max(1, sum(kept.values()))
        events: list[BadInput] = []
        streams = {}
        for b, mine in sorted(pieces.items()):
            share = self.shuffle_buffer * kept[b] // total if self.shuffle_buffer > 1 else self.shuffle_buffer
            rng = np.random.default_rng([self.seed, part.pass_index, self.rank, part.part, 1 + b])
            # read a batch at a time, its shard closed in between: a worker holds at most one shard open
            # whatever the number of buckets (each stream's reader would stay open between its turns)
            raw = self._kept_raw_samples(mine, part.plan, events, part.draw, chunk=self.batch_size)
            streams[b] = _shuffled(raw, share, rng)
        skip = min(part.skip, len(order))
        replayed: dict[int, collections.deque] = {b: collections.deque(maxlen=8) for b in streams}
        taken = np.bincount(order[:skip], minlength=len(counts)) * self.batch_size
        for b, samples in streams.items():  # resume: replay each bucket's order without decoding
            undecodable = part.undecodable[b]
            for _ in range(int(taken[b]) + undecodable):
                replayed[b].append(next(samples, None))
        events.clear()  # met while replaying: counted by the run that trained those batches
        last_of = {int(b): int(np.flatnonzero(order == b)[-1]) for b in np.unique(order)}
        idle = [streams[b] for b in streams if b not in last_of]  # pieces but no batch: read at the part's end
        templates: dict[int, list[torch.Tensor]] = {b: [] for b in streams}
        shapes = self.index.bucket_shapes
        for k in range(skip, len(order)):
            b = int(order[k])
            drain = ([streams[b]] if k == last_of[b] else []) + (idle if k == len(order) - 1 else [])
            yield self._next_batch(
                streams[b],
                part.pass_index,
                events,
                templates[b],
                replayed[b],
                part.part,
                drain=drain,
                bucket=b,
                shape=shapes[b],
            )

    def _kept_raw_samples(
        self, slices, plan: PassPlan | None, events: list, draw: PassDraw | None = None, chunk: int = 0
    ) -> Iterator[tuple[int, float, dict, int]]:
        """(id, weight, undecoded sample, its walk of its source this pass) of this slot's kept samples;
        the pre-decode stage. `chunk` > 0: each shard is open only while `chunk` of them are read
        (`_shard_samples`), so that many such streams read in turns hold no shard open between turns."""
        first_ids = self.index.first_ids
        for piece in slices:
            url, first = self.index.urls[piece.shard], int(first_ids[piece.shard])
            count = int(self.index.counts[piece.shard])
            weights = np.ones(count) if plan is None else plan.weights_between(first, first + count)
            source = None if draw is None or draw.whole else int(self.shard_source[piece.shard])
            if source is not None and piece.copy >= draw.full[source]:  # a partial walk takes the draw's samples
                weights = weights * draw.in_copy(source, piece.copy, np.arange(first, first + count))
            mine = np.flatnonzero(weights)[piece.kept_start : piece.kept_end]  # positions this slot delivers
            want = np.zeros(count, dtype=bool)
            want[mine] = True
            if len(mine) == 0 and not piece.to_shard_end:
                continue
            delivered, seen = 0, 0
            try:
                # Pruned samples and other slots' samples are skipped inside the tar reader: their
                # bytes are seeked past (read and dropped on a pipe), never decoded. A sample past
                # the index's count is read so that the error can name it. A local shard of another
                # size than its index records is refused at open (a shard replaced since indexing),
                # unless it was cut short: its samples before the cut are delivered, the rest lost.
                expected = self.index.expected(piece.shard)
                last = None if piece.to_shard_end or len(mine) == 0 else int(mine[-1])
                for position, sample in self._shard_samples(
                    url, lambda p: p >= count or bool(want[p]), expected, chunk, last
                ):
                    seen = position + 1
                    if position >= count:
                        raise BadInputError(
                            f"shard {url}: holds more than the {count} samples {self.index.path} lists "
                            f"(key {sample['__key__']!r}); re-index with `prunepipe shards index`"
                        )
                    if sample is None:
                        continue
                    delivered += 1
                    yield first + position, float(weights[position]), sample, piece.copy
                    if delivered == len(mine) and not piece.to_shard_end:
                        break  # the rest of this shard is another slot's
            except BadInputError as e:
                self._bad(events, BadInput(str(e) + _lost(first + mine[delivered:]), len(mine) - delivered))
                continue
            if delivered < len(mine) or (piece.to_shard_end and seen < count):
                message = f"shard {url}: ended after {seen} samples, {self.index.path} lists {count}"
                self._bad(events, BadInput(message + _lost(first + mine[delivered:]), len(mine) - delivered))

    def _shard_samples(
        self, url: str, select, expected, chunk: int, last: int | None = None
    ) -> Iterator[tuple[int, dict | None]]:
        """read_shard's (position, sample) of one shard; with `chunk` > 0 read `chunk` selected samples
        at a time, the shard closed in between: a local tar opened again at the byte where the last read
        stopped (`ShardCursor`), any other shard read whole at its first turn (a tar of one bucket of
        one input shard: hundreds of samples), up to position `last` where the rest is another slot's.
        The same samples in the same order either way; an error comes after the samples read before it."""
        if chunk <= 0:
            yield from read_shard(url, select, retry=self.retry, expected=expected)
            return
        cursor = ShardCursor() if resumable(url) else None
        while True:
            got: list = []
            taken = 0
            failed: BadInputError | None = None
            ended = True
            try:
                with contextlib.closing(
                    read_shard(url, select, retry=self.retry, expected=expected, cursor=cursor)
                ) as reader:
                    for position, sample in reader:
                        got.append((position, sample))
                        taken += sample is not None
                        if last is not None and position >= last:
                            break
                        if cursor is not None and taken == chunk:
                            ended = False
                            break
            except BadInputError as e:
                failed = e
            yield from got
            if failed is not None:
                raise failed
            if ended:
                return

    def _next_batch(
        self,
        samples,
        pass_index: int,
        events: list,
        template: list,
        replayed,
        worker: int,
        drain: list,
        bucket: int = -1,
        shape: tuple[int, ...] | None = None,
    ) -> Batch:
        """The next batch of `samples`; then `drain`'s streams are read to their ends (never decoded).
        Padding is shaped like the last decoded sample (`template`), else a replayed one, else `shape`
        (a bucket's recorded shape; float32, as `decoder.finish` gives every batch)."""
        ids, keys, walks, weights, pixels, labels, texts = [], [], [], [], [], [], []
        while len(ids) < self.batch_size:
            item = next(samples, None)
            if item is None:
                break
            sample_id, weight, sample, walk = item
            key = draw_keys(sample_id, walk)  # a later walk of the sample draws its crop and flip anew
            try:
                text = self.decoder.text(sample)  # before the pixels: cheap to refuse
                decoded, label = self.decoder.decode(sample, key, pass_index)
            except BadInputError as e:
                self._bad(events, BadInput(str(e), undecodable=True))
                continue
            ids.append(sample_id)
            keys.append(key)
            walks.append(walk)
            weights.append(weight)
            pixels.append(decoded)
            labels.append(label)
            texts.append(text)
        flips = None
        if pixels:
            images, flips = self.decoder.batch_images(stack_pixels(pixels), np.array(keys, dtype=np.int64), pass_index)
            template[:] = [images[0]]
        if len(ids) < self.batch_size:
            # Bad samples left this worker short: pad with weight 0 so every rank still takes the
            # same number of steps; padding has id -1 and never reaches a pruner.
            if not template:  # a resumed worker that has decoded nothing yet: shape it like a replayed sample
                template[:] = self._first_decodable(reversed(replayed), pass_index)
            if not template and shape is not None:  # nothing of this bucket decodes: its recorded shape
                template[:] = [torch.zeros(shape, dtype=torch.float32)]
            if not template:
                raise BadInputError(
                    f"rank {self.rank}: no decodable sample in pass {pass_index + 1} (counted from 1) to shape padding"
                )
            missing = self.batch_size - len(ids)
            padding = torch.zeros((missing, *template[0].shape), dtype=template[0].dtype)
            images = torch.cat([images, padding]) if pixels else padding
            if flips is not None:  # padding is never mirrored (and is zeros on any path)
                flips = torch.cat([flips, torch.zeros(missing, dtype=torch.bool)])
            ids += [PADDING_ID] * missing
            walks += [0] * missing
            weights += [0.0] * missing
            labels += [NO_LABEL] * missing
            texts += [None] * missing
        for stream in drain:  # read (never decode) this stream's tail, so a shard's bad end is still reported
            for _ in stream:
                pass
        bad = tuple(events)
        events.clear()  # the same list keeps collecting for the next batch
        return Batch(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(weights, dtype=torch.float32),
            images,
            torch.tensor(labels, dtype=torch.int64),
            bad,
            worker,
            bucket=bucket,
            walks=torch.tensor(walks, dtype=torch.int64) if any(walks) else None,
            flips=flips,
            **text_fields(texts, captions=self.decoder.captions, width=self.decoder.text_width),
        )

    def _first_decodable(self, items, pass_index: int) -> list[torch.Tensor]:
        """[the first of these (id, weight, raw sample) items that decodes, decoded], or []."""
        for item in items:
            if item is None:
                continue
            try:
                key = draw_keys(item[0], item[3])
                pixels = self.decoder.decode(item[2], key, pass_index)[0]
                return [self.decoder.batch_images(pixels[None], np.array([key]), pass_index)[0][0]]
            except BadInputError:
                continue
        return []

    def _bad(self, events: list, event: BadInput) -> None:
        if self.on_bad_sample == "stop":
            raise BadInputError(event.message + " (data.on_bad_sample=stop; set it to skip to go on)")
        log.warning("skipping %d sample(s): %s", event.samples_lost, event.message)
        events.append(event)


def _lost(ids: np.ndarray) -> str:
    """The ids a damaged shard kept from this slot, for the message that counts them."""
    if len(ids) == 0:
        return ""
    span = f"id {ids[0]}" if len(ids) == 1 else f"ids {ids[0]} to {ids[-1]}"
    return f"; lost {len(ids)} sample(s) of this slot, {span}"


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
