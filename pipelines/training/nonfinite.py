"""on_nonfinite_loss: a NaN or infinite loss stops the run naming its step and sample ids (stop), or
its batch is skipped with a line saying which (skip); either way it never reaches the optimizer.
"""

from __future__ import annotations

import numpy as np
import torch

from prunepipe.pipelines.progress import pass_label


class NonFiniteLossError(ValueError):
    """A batch produced a NaN or infinite loss; the message names the step and sample ids."""


def report_nonfinite(
    cfg, accelerator, ids: np.ndarray, losses: np.ndarray, step: int, pass_index: int, micro: int
) -> None:
    """Stop with the step and the sample ids (on_nonfinite_loss=stop), or say which batch is skipped."""
    bad_ids = ids[(ids >= 0) & ~np.isfinite(losses)].tolist()
    where = f"step {step} ({pass_label(pass_index, cfg.num_passes)}, batch {micro})"
    if cfg.on_nonfinite_loss == "stop":
        raise NonFiniteLossError(
            f"non-finite loss at {where} for sample ids {bad_ids}; set on_nonfinite_loss=skip to skip such batches"
        )
    accelerator.print(f"skipping batch with non-finite loss at {where}, sample ids {bad_ids}")


def nonfinite_to_skip(cfg, accelerator, ids, gathered, step: int, pass_index: int, micro: int) -> bool:
    """Under on_nonfinite_loss=skip, whether a micro-batch's gathered losses hold a NaN or infinity (said
    with its ids; every rank answers alike). Reading the answer before backward costs one host read a
    step, under this policy only; under stop the host checks a step late, without waiting."""
    if cfg.on_nonfinite_loss != "skip" or bool(torch.isfinite(gathered[ids >= 0]).all()):
        return False
    report_nonfinite(cfg, accelerator, ids.cpu().numpy(), gathered.cpu().numpy(), step, pass_index, micro)
    return True
