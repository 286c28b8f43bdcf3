"""The shard stream: WebDataset shards -> pre-decode pruning -> decode -> Batch(ids, weights, ...).

Each (rank, loader worker) reads the slice of kept samples `pipelines/data/layout.py` gives it.
Pruned samples are seeked past or read as bytes and dropped before decoding (docs/design.md,
principle 2). Nothing here knows about models, tasks or pruners beyond the frozen `PassPlan`.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipelines.data.batch import PADDING_ID, Batch
from pipelines.data.decode import NO_LABEL, SampleDecoder
from pipelines.data.layout import PassLayout, batches_taken_per_worker, pass_layout
from pipelines.data.shards import BadInput, BadInputError, ShardIndex, read_shard
from pruning.pass_plan import PassPlan

log = logging.getLogger(__name__)

BAD_SAMPLE_POLICIES = ("skip", "stop")


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
        if plan is not None and plan.num_samples != self.index.num_samples:
            raise ValueError(f"plan covers {plan.num_samples} samples but {self.index.path} indexes "
                             f"{self.index.num_samples}")
        return pass_layout(
            self.index,
            None if plan is None else plan.kept_per_shard(self.index.first_ids, self.index.counts),
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
        start_method: str | None = None,
    ) -> "PassLoader":
        """This rank's batches of pass `epoch`, after skipping its first `skip_batches` undecoded.

        `skip_undecodable[w]`: the undecodable samples worker part w met in those batches (what
        `Batch.undecodable()` counted), which the skip passes over too, so that the order goes on
        exactly where it stopped. `start_method` (fork, spawn, forkserver; None: the platform's)
        starts the loader workers; under each they read the plan without a copy of it."""
        if plan is not None and plan.epoch != epoch:
            raise ValueError(f"plan is for pass {plan.epoch}, not pass {epoch}")
        layout = self.layout(epoch, plan, num_workers)
        workers = max(1, num_workers)
        mine = layout.batches[self.rank]
        skipped, first_worker = batches_taken_per_worker(mine, skip_batches)
        extra = np.zeros(workers, dtype=np.int64) if skip_undecodable is None else np.asarray(skip_undecodable)
        if len(extra) != workers:
            raise ValueError(f"skip_undecodable has {len(extra)} entries for {workers} worker parts")
        if plan is not None and num_workers > 0:
            plan = plan.share()  # spawn-started workers map the plan's bitmaps instead of copying them
        self._pass = _PassState(epoch, plan, layout, workers, skipped, extra, first_worker)
        loader = DataLoader(self, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                            multiprocessing_context=start_method if num_workers > 0 else None)
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
            weights = np.ones(count) if plan is None else plan.weights_between(first, first + count)
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
