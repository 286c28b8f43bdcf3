"""The learning-rate schedule, driven by pass progress (pass_index + fraction of the pass) rather than
by optimizer steps, so that a pass shortened by pruning keeps the schedule aligned with the full run's
(docs/design.md, principle 6); and the peak rate from optim.blr once the world size is known.
"""

from __future__ import annotations

import dataclasses
import math

from prunepipe.pipelines.config import RunConfig


def learning_rate(cfg: RunConfig, progress: float) -> float:
    """Linear warmup then cosine or constant (optim.schedule) at pass progress `progress`."""
    o = cfg.optim
    if progress < o.warmup_passes:
        return o.lr * progress / o.warmup_passes
    if o.schedule == "constant":  # DiT's recipe: AdamW at 1e-4, no decay (Peebles & Xie 2023, Sec. 4)
        return o.lr
    span = max(cfg.num_passes - o.warmup_passes, 1e-12)
    t = min(1.0, (progress - o.warmup_passes) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * t))


def pass_progress(pass_index: int, pass_offset: float, batches_done: int, total: int) -> float:
    """Pass progress after `batches_done` of this pass's (or resumed segment's) `total` batches: pass_index
    + fraction of the pass, where a segment starts at the fraction `pass_offset` already trained."""
    return pass_index + pass_offset + (1 - pass_offset) * batches_done / max(total, 1)


def with_peak_learning_rate(cfg: RunConfig, world: int, announce: bool) -> RunConfig:
    """`cfg` with optim.lr resolved from optim.blr, once per run where the world size is known: MAE's
    linear scaling rule, lr = blr x effective batch / 256 with effective batch = world x
    data.batch_size x optim.grad_accum (He et al. 2022, Sec. A.1; main_pretrain.py). blr = 0: as is."""
    o = cfg.optim
    if o.blr <= 0:
        return cfg
    batch = world * cfg.data.batch_size * o.grad_accum
    peak = o.blr * batch / 256
    if announce:
        print(
            f"peak lr {peak:.4g} = optim.blr {o.blr:g} x effective batch {batch} ({world} ranks x "
            f"{cfg.data.batch_size} x {o.grad_accum} accumulated) / 256; optim.lr is not used",
            flush=True,
        )
    return dataclasses.replace(cfg, optim=dataclasses.replace(o, lr=peak))
