"""`debug_sync: true`: check at every pass start that all ranks hold the same plan and score
tables (fail loudly otherwise), and save what each rank trained on, for coverage checks.

Costs O(N) per pass and a file per rank and pass: for debugging, not for production runs.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from prunepipe.pipelines.ranks import same_on_every_rank
from prunepipe.pruning.pass_plan import PassPlan


def plan_digest(plan: PassPlan, pruner) -> str:
    """A hash of the pass plan and the pruner's tables: equal on every rank when in sync."""
    frozen = plan.frozen  # the plan's compact form: equal compact forms give equal weights everywhere
    digest = hashlib.sha256(
        repr((plan.pass_index, frozen.seed, frozen.keep_prob, frozen.rescale, frozen.group_rescale)).encode()
    )
    for array in (
        frozen.candidates and frozen.candidates.packed,
        frozen.keep_probs,
        frozen.group_probs,
        plan.excluded and plan.excluded.packed,
    ):
        digest.update(b"-" if array is None else np.asarray(array).tobytes())
    for name, table in sorted(pruner.tables().items()):
        digest.update(name.encode() + np.ascontiguousarray(table).tobytes())
    return digest.hexdigest()[:16]


class SyncDebug:
    def __init__(self, accelerator, run_dir: str):
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.is_main = accelerator.is_main_process
        self.folder = os.path.join(run_dir, "debug")
        os.makedirs(self.folder, exist_ok=True)
        self.seen: list[np.ndarray] = []

    def _path(self, what: str, pass_index: int, rank: bool = True) -> str:
        name = f"{what}_pass{pass_index:04d}_world{self.world}" + (f"_rank{self.rank}" if rank else "")
        return os.path.join(self.folder, name)

    def begin_pass(self, plan: PassPlan, pruner) -> None:
        mine = plan_digest(plan, pruner)
        with open(self._path("digest", plan.pass_index) + ".txt", "w") as f:
            f.write(mine)
        if self.is_main:  # the frozen plan itself, before any resume segment excludes samples
            np.save(self._path("plan", plan.pass_index, rank=False) + ".npy", PassPlan.from_pruner(pruner).kept_mask())
        # a disagreement means the pruner state is no longer in sync
        same_on_every_rank(mine, f"digest {mine}", f"pass {plan.pass_index + 1} plans or pruner scores")
        self.seen = []

    def saw(self, ids: torch.Tensor) -> None:
        self.seen.append(ids.detach().cpu().numpy().copy())

    def end_pass(self, pass_index: int) -> None:
        ids = np.concatenate(self.seen) if self.seen else np.zeros(0, np.int64)
        np.save(self._path("ids", pass_index) + ".npy", ids)
