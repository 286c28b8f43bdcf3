"""Bad input during training, counted as a cluster must count it: each rank tallies the samples it lost
(corrupt shards, undecodable samples) and what each of its loader workers' parts could not decode (per
sample stream: a part reads one stream per aspect-ratio bucket of a bucketed index, else one); at
every checkpoint and pass end the tallies are summed over ranks into the training position (one
all-reduce, at the same point on every rank), so that a resume skips exactly what was skipped and
data.max_bad_samples counts the whole run. Never decides what a rank reads.
"""

from __future__ import annotations

import numpy as np
import torch

from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.data.shards import BadInputError
from prunepipe.pipelines.progress import pass_label


def undecodable_of_rank(
    position: TrainingPosition, rank: int, world: int, workers: int, buckets: int = 0
) -> np.ndarray:
    """int64 [workers * max(1, buckets)]: this rank's undecodable samples per worker part and bucket
    stream in the pass so far, entry worker * max(1, buckets) + bucket (zeros at a pass start, or when
    the pass resumes under another layout and starts a segment). `buckets`: the index's aspect-ratio
    buckets (ShardStream.num_buckets), 0 when it is not bucketed: one stream a part, as ever."""
    streams = workers * max(1, buckets)
    table = position.undecodable
    if position.batch_in_pass == 0 or table is None or len(table) != world * streams:
        return np.zeros(streams, dtype=np.int64)
    return table[rank * streams : (rank + 1) * streams].astype(np.int64)


def check_bad_sample_budget(cfg, position: TrainingPosition, lost_here: int, bad: tuple) -> None:
    """Stop once the run has lost more samples to bad input than data.max_bad_samples (the summed
    count of every rank, plus this rank's since): skipping is for a few bad samples, not for a store
    that lost a tenth of the data. This rank raises at once; the launcher stops the others."""
    budget = cfg.data.max_bad_samples
    if budget < 0 or position.bad_samples + lost_here <= budget:
        return
    last = bad[-1].message if bad else "see the warnings above"
    raise BadInputError(
        f"{position.bad_samples + lost_here} samples lost to bad input by "
        f"{pass_label(position.pass_index, cfg.num_passes)} "
        f"(this rank: {lost_here} since the last checkpoint or pass end), more than "
        f"data.max_bad_samples={budget}; the latest: {last}"
    )


class BadInputTally:
    """This rank's bad input since the position's counts were last summed over ranks."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.lost = 0  # samples this rank lost to bad input since position.bad_samples was last summed
        # int64 [workers * max(1, buckets)]: this rank's, per worker part and bucket stream, in the pass so far
        self.undecodable = np.zeros(1, dtype=np.int64)
        self.buckets = 0

    def begin_pass(
        self, position: TrainingPosition, rank: int, world: int, workers: int, buckets: int = 0
    ) -> np.ndarray:
        """This rank's undecodable counts per worker part and bucket stream at the pass (or resumed pass)
        start: what its loader skips with the batches they were read for (`skip_undecodable`).
        `buckets`: ShardStream.num_buckets (0: not bucketed)."""
        self.buckets = buckets
        self.undecodable = undecodable_of_rank(position, rank, world, max(1, workers), buckets)
        return self.undecodable.copy()

    def saw(self, batch, position: TrainingPosition) -> None:
        """Count a batch's bad input; stop past data.max_bad_samples."""
        self.lost += sum(e.samples_lost for e in batch.bad)
        check_bad_sample_budget(self.cfg, position, self.lost, batch.bad)
        if batch.bucket >= 0 and batch.bucket >= self.buckets:
            raise ValueError(
                f"a batch of aspect-ratio bucket {batch.bucket}, but the pass began with {self.buckets} bucket(s): "
                f"pass begin_pass(..., buckets=stream.num_buckets)"
            )
        self.undecodable[batch.worker * max(1, self.buckets) + max(batch.bucket, 0)] += batch.undecodable()

    def sum_over_ranks(self, accelerator, position: TrainingPosition) -> None:
        """Bring the checkpointed counts up to date over all ranks (one all-reduce; every rank calls it
        at the same point): `bad_samples` += the samples each rank lost since the last call,
        `undecodable` = every rank's per-stream counts (worker part, then bucket), in rank order."""
        streams = len(self.undecodable)
        counts = torch.zeros(1 + accelerator.num_processes * streams, dtype=torch.int64, device=accelerator.device)
        counts[0] = self.lost
        start = 1 + accelerator.process_index * streams
        counts[start : start + streams] = torch.from_numpy(self.undecodable)
        if accelerator.num_processes > 1:
            counts = accelerator.reduce(counts, reduction="sum")
        counts = counts.cpu().numpy()
        position.bad_samples += int(counts[0])
        position.undecodable = counts[1:]
        self.lost = 0
