"""Previews while training (eval.preview; what is drawn: pipelines/evaluation/previews.py). Every
`every_steps` optimizer steps the grid of the weights the run evaluates (eval.weights: the EMA's by
default) goes to RUN/previews/step_XXXXXX.png, written atomically, and to the trackers; the validation
loss to a `preview` record of metrics.jsonl and the trackers.

Who draws: every rank, the whole grid and the whole validation set, with the same weights. Under
fsdp and hsdp a forward all-gathers each block's shards, which takes every rank; under ddp it keeps
any rank from waiting in the next step's collective while rank 0 alone draws. The ranks start and end
the draw together, so no collective waits on it longer than the drawing takes everywhere. Rank 0 writes.
The EMA's weights are copied into the model's own parameters (each rank's shards under fsdp) for the
draw and the live ones copied back bit for bit: training goes on as if no preview had been drawn.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from prunepipe.pipelines.atomic_write import atomic_write_bytes
from prunepipe.pipelines.evaluation.previews import Preview, png_bytes
from prunepipe.pipelines.ranks import on_every_rank
from prunepipe.pipelines.training.trackers import log_picture

PREVIEW_DIR = "previews"


def preview_path(run_dir: str, step: int) -> str:
    """RUN/previews/step_XXXXXX.png, named as checkpoints and eval records are."""
    return os.path.join(run_dir, PREVIEW_DIR, f"step_{step:06d}.png")


@contextmanager
def weights_in_place(parameters: list, ema=None):
    """`parameters` holding `ema`'s shadow weights until the block ends, then their own again, exactly
    (nothing when `ema` is None). In place: a sharded parameter takes its shard of the EMA's."""
    if ema is None:
        yield
        return
    live = [p.detach().clone() for p in parameters]
    with torch.no_grad():
        for param, shadow in zip(parameters, ema.shadow_params):
            param.copy_(shadow)
    try:
        yield
    finally:
        with torch.no_grad():
            for param, saved in zip(parameters, live):
                param.copy_(saved)


class Previews:
    """The run's previews: `due(step)` after each optimizer step, `draw(step)` on every rank when due."""

    def __init__(self, cfg, task, accelerator, model, trained: list, ema, metrics):
        self.every = cfg.eval.preview.every_steps
        self.run_dir, self.accelerator, self.metrics = cfg.run_dir, accelerator, metrics
        self.model, self.trained = model, trained  # the bare module, and the parameters the EMA follows
        self.ema = ema if cfg.eval.weights == "ema" else None
        # what it draws, read by each rank from its own node: one that cannot stops every rank here
        self.preview = on_every_rank(lambda: Preview(cfg, task, accelerator.device)) if self.every else None
        if self.preview is not None:
            self.preview.encode_prompts()  # given prompts on precomputed text features: rank 0 encodes them

    def due(self, step: int) -> bool:
        return self.preview is not None and step % self.every == 0

    def draw(self, step: int) -> float:
        """The preview at optimizer step `step` (every rank); rank 0 writes it. Returns the seconds it took."""
        start = time.perf_counter()
        with weights_in_place(self.trained, self.ema):
            picture = self.preview.picture(self.model)
            loss = self.preview.validation_loss(self.model)
        seconds = time.perf_counter() - start
        if not self.accelerator.is_main_process:
            return seconds
        path = preview_path(self.run_dir, step)
        record = {"kind": "preview", "optimizer_steps": step, "picture": os.path.relpath(path, self.run_dir)}
        if loss:  # the task's headline held-out loss first (denoise_mse, masked_mse), then the rest
            record.update({"val_loss": next(iter(loss.values())), "val": loss})
        if self.preview.captions:
            record["prompts"] = self.preview.captions
        record["seconds"] = seconds
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write_bytes(path, png_bytes(picture))
        except OSError as e:  # a preview is not worth the run: say so and train on
            print(f"prunepipe: preview at step {step} not written: {e}", flush=True)
        self.metrics.write(record)
        log_picture(self.accelerator, "preview", picture, step)
        return seconds
