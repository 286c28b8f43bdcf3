"""The one numeric precision of an evaluation (`eval.precision`), applied alike by the training loop
and by `prunepipe eval`. A bf16 run's model comes out of accelerate's `prepare` with an autocast
forward that `unwrap_model` keeps (keep_fp32_wrapper=True), so in-loop numbers were bf16 where the
offline ones were fp32. Here that wrapper is set aside while the evaluation runs, and an explicit
autocast surrounds the evaluated model's forwards only when bf16 is asked. Never changes weights.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

from prunepipe.pipelines.evaluation.config import PRECISIONS


@contextmanager
def without_autocast_wrappers(model: nn.Module):
    """`model` with the autocast forward accelerate's `prepare` installed (on the prepared module,
    which the bare model or the EMA's deep copy of it is) set aside until the block ends. accelerate
    keeps the forward it replaced as `_original_forward` (Accelerator.prepare_model; its own
    `extract_model_from_parallel(keep_fp32_wrapper=False)` strips the same wrapper, but for good)."""
    replaced = []
    for module in model.modules():
        state = vars(module)
        if "_original_forward" in state and "forward" in state:
            replaced.append((module, state["forward"]))
            state["forward"] = state["_original_forward"]
    try:
        yield model
    finally:
        for module, forward in replaced:
            vars(module)["forward"] = forward


def forward_precision(precision: str, device: torch.device | str):
    """The context for the evaluated model's forwards: nothing for fp32, bf16 autocast on the
    device's type for bf16. Metrics (PSNR, SSIM, FID features) stay outside it, in fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"eval config: precision={precision!r} is not accepted; accepted: {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
