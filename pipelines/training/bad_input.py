"""Bad input during training, counted as a cluster must count it: each rank tallies the samples it lost
(corrupt shards, undecodable samples) and what each of its loader workers' parts could not decode; at
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


def undecodable_of_rank(position: TrainingPosition, rank: int, world: int, workers: int) -> np.ndarray:
    """int64 [workers]: this rank's undecodable samples per worker part in the pass so far (zeros
    at a pass start, or when the pass resumes under another layout and starts a segment)."""
    table = position.undecodable
    if position.batch_in_pass == 0 or table is None or len(table) != world * workers:
        return np.zeros(workers, dtype=np.int64)
    return table[rank * workers : (rank + 1) * workers].astype(np.int64)


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
        self.undecodable = np.zeros(1, dtype=np.int64)  # int64 [workers]: this rank's, in the pass so far

    def begin_pass(self, position: TrainingPosition, rank: int, world: int, workers: int) -> np.ndarray:
        """This rank's undecodable counts per worker part at the pass (or resumed pass) start: what its
        loader skips with the batches they were read for."""
        self.undecodable = undecodable_of_rank(position, rank, world, max(1, workers))
        return self.undecodable.copy()

    def saw(self, batch, position: TrainingPosition) -> None:
        """Count a batch's bad input; stop past data.max_bad_samples."""
        self.lost += sum(e.samples_lost for e in batch.bad)
        check_bad_sample_budget(self.cfg, position, self.lost, batch.bad)
        self.undecodable[batch.worker] += batch.undecodable()

    def sum_over_ranks(self, accelerator, position: TrainingPosition) -> None:
        """Bring the checkpointed counts up to date over all ranks (one all-reduce; every rank calls it
        at the same point): `bad_samples` += the samples each rank lost since the last call,
        `undecodable` = every rank's per-worker counts, in rank order."""
        workers = len(self.undecodable)
        counts = torch.zeros(1 + accelerator.num_processes * workers, dtype=torch.int64, device=accelerator.device)
        counts[0] = self.lost
        start = 1 + accelerator.process_index * workers
        counts[start : start + workers] = torch.from_numpy(self.undecodable)
        if accelerator.num_processes > 1:
            counts = accelerator.reduce(counts, reduction="sum")
        counts = counts.cpu().numpy()
        position.bad_samples += int(counts[0])
        position.undecodable = counts[1:]
        self.lost = 0
