"""A pass's two ends: the plan it runs under (frozen at its start, or the rest of a resumed one) and its
summary (kept samples, loss, counters, held-out metrics), the record metrics.jsonl keeps per pass.
Every rank computes both alike from agreed values; the held-out evaluation is collective.
"""

from __future__ import annotations

import numpy as np

from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.config import RunConfig
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.evaluation.runner import held_out_over_ranks
from prunepipe.pipelines.progress import pass_label
from prunepipe.pipelines.training.schedule import learning_rate
from prunepipe.pipelines.training.sources import combine_held_out, pass_accounting
from prunepipe.pruning.bitmap import Bitmap
from prunepipe.pruning.pass_plan import PassPlan


def begin_pass(position: TrainingPosition, pruner, stream: ShardStream, world: int, num_workers: int) -> PassPlan:
    """The plan this pass (or the rest of it) runs under.

    A fresh pass freezes the pruner's plan. A pass resumed under the layout it ran under skips
    its consumed batches exactly. A pass resumed under another world size or worker count goes
    on as a segment over the kept samples no rank had trained on, with the same frozen plan; the
    consumed samples are known by id, so a mixture pass that walks a source twice cannot (refused).
    """
    num_samples = stream.index.num_samples
    if position.batch_in_pass == 0 and position.excluded is None:
        pruner.plan(position.pass_index)
        position.consumed = Bitmap.zeros(num_samples)
        position.pass_offset = 0.0
        position.bad_samples_at_pass_start = position.bad_samples
    plan = PassPlan.from_pruner(pruner)
    if position.batch_in_pass > 0 and (position.world_size, position.num_workers) != (world, num_workers):
        draw = stream.draw(position.pass_index)
        if draw is not None and int(draw.copies.max()) > 1:
            raise ValueError(
                f"{pass_label(position.pass_index, pruner.num_passes)} was checkpointed mid-pass on "
                f"{position.world_size} rank(s) x {position.num_workers} loader worker(s), resumed on {world} x "
                f"{num_workers}: a pass that walks a source more than once (repeat above 1) cannot be split "
                f"into segments, as its trained samples are known by id only. Resume on the checkpoint's ranks "
                f"and data.num_workers, or from a checkpoint at a pass end"
            )
        position.excluded = position.consumed.copy()
        # the share of the pass's samples (what its walks keep, on any layout) trained before the segment
        kept_in_pass = stream.layout(position.pass_index, plan, num_workers).kept
        position.pass_offset = float(plan.count_kept(among=position.consumed) / max(kept_in_pass, 1))
        position.batch_in_pass = 0
    position.world_size, position.num_workers = world, num_workers
    if position.excluded is not None:
        plan = plan.excluding(position.excluded)
    return plan


def open_pass(
    stream: ShardStream,
    plan: PassPlan,
    position: TrainingPosition,
    bad_input,
    rank: int,
    world: int,
    workers: int,
    device,
):
    """This rank's loader for the pass under `plan`: past the batches already trained, and past the samples
    found undecodable in them before (they are counted once)."""
    skip_undecodable = bad_input.begin_pass(position, rank, world, workers, buckets=stream.num_buckets)
    return stream.pass_loader(
        position.pass_index,
        plan,
        num_workers=workers,
        skip_batches=position.batch_in_pass,
        skip_undecodable=skip_undecodable,
        pin_memory=device.type == "cuda",  # pinned host memory lets the copy to the GPU overlap the step
    )


def pass_summary(
    cfg: RunConfig, task, model, pruner, plan: PassPlan, layout, position: TrainingPosition, held_out, pass_losses
) -> dict:
    """The pass's record: what it kept and trained, its counters, and (collective) each held-out
    source's metrics; `held_out` None when the run has no val shards. A run's loop adds its sources'
    and buckets' accounting (`with_accounting`)."""
    summary = {
        "kind": "pass",
        "pass_index": position.pass_index,
        "optimizer_steps": position.optimizer_steps,
        "steps_in_pass": layout.steps,
        # of the pass's length: a source taken twice (repeat: 2) is 2N samples long, not N
        "kept_fraction": layout.kept / max(1, layout.length or plan.num_samples),
        "kept_samples": layout.kept,
        "pass_length": layout.length or plan.num_samples,
        # kept samples this pass lost to bad input (damaged shards, undecodable samples), every rank's
        "lost_samples": position.bad_samples - position.bad_samples_at_pass_start,
        "tail": layout.tail,
        "peak_lr": cfg.optim.lr,
        "lr_at_pass_start": learning_rate(cfg, float(position.pass_index)),
        "samples_forwarded": position.samples_forwarded,
        "train_loss": float(np.mean(pass_losses)) if pass_losses else float("nan"),
        "wall_seconds": position.wall_seconds,
        "skipped_nonfinite": position.skipped_nonfinite,
        "bad_samples": position.bad_samples,
        "pruner": {k: v for k, v in pruner.stats().items() if isinstance(v, (int, float, str))},
    }
    if held_out is not None:  # not `if held_out`: a rank's share may be empty, and every rank must join
        by_source = {name: held_out_over_ranks(task, model, batches, cfg.eval) for name, batches in held_out.items()}
        summary["held_out"] = next(iter(by_source.values())) if len(by_source) == 1 else combine_held_out(by_source)
        if len(by_source) > 1:  # each held-out source on its own too
            summary["held_out_by_source"] = by_source
    return summary


def with_accounting(summary: dict, layout, position: TrainingPosition, mixture, pass_length: int, buckets, ema) -> dict:
    """`summary` with each source's and each aspect-ratio bucket's kept and trained samples (where the
    run has several), and the EMA's decay at the pass end (pruned and full runs alike)."""
    if len(mixture.sources) > 1:
        summary["kept_fraction"] = layout.kept / pass_length  # of what the sources' rules drew
        summary["sources"] = pass_accounting(mixture, layout.kept_per_source, position.forwarded_by_source)
    if buckets.active:
        summary["buckets"] = buckets.pass_accounting(layout.kept_per_bucket, position.forwarded_by_bucket)
    summary["ema_decay"] = ema.cur_decay_value
    return summary
