"""The one training loop, for MAE and latent diffusion alike (docs/design.md, principle 4).

Per pass: freeze the pruner's plan, stream the kept samples, and per step compute per-sample
losses, take mean(w * loss), step the optimizer and EMA, and feed the globally gathered
(ids, losses) back to the pruner. Checkpoints are atomic; a resumed run continues bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import time
from datetime import timedelta

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.checkpoint.pruner_state import CheckpointedPruner
from prunepipe.pipelines.checkpoint.store import choose_resume, load_resume, save_checkpoint
from prunepipe.pipelines.config import RunConfig, latent_shard_notes, pruner_hparams, to_yaml
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.mixture import Mixture, first_path, parse_sources
from prunepipe.pipelines.data.shards import BadInputError
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.data.workers import agreed_loader_workers
from prunepipe.pipelines.evaluation.runner import Evaluator, held_out_over_ranks, weights_for_eval
from prunepipe.pipelines.progress import EveryFewSeconds, pass_label, position_label, progress
from prunepipe.pipelines.ranks import on_every_rank, same_on_every_rank
from prunepipe.pipelines.tasks.build import build_task, text_reading
from prunepipe.pipelines.tasks.randomness import SampleRandomness
from prunepipe.pipelines.training.accumulation import GradientAccumulation
from prunepipe.pipelines.training.deferred import DeferredRecords, StepRecord, to_host
from prunepipe.pipelines.training.device import build_optimizer, place_model, set_backend_flags
from prunepipe.pipelines.training.ema import PassProgressEMA
from prunepipe.pipelines.training.groups import use_group_table
from prunepipe.pipelines.training.init_weights import init_from_weights
from prunepipe.pipelines.training.metrics import MetricsLog
from prunepipe.pipelines.training.node_tables import NodeTables, local_rank_and_size, run_token
from prunepipe.pipelines.training.sources import (
    SourceStrata,
    check_same_mixture,
    combine_held_out,
    forwarded_by_source,
    pass_accounting,
)
from prunepipe.pipelines.training.sync_check import SyncDebug
from prunepipe.pruning import ScoreNormaliser, build_pruner, gather_tensors
from prunepipe.pruning.bitmap import Bitmap
from prunepipe.pruning.pass_plan import PassPlan


class NonFiniteLossError(ValueError):
    """A batch produced a NaN or infinite loss; the message names the step and sample ids."""


# Step k's scores reach the pruner after step k+1 is enqueued, so the step never waits for the
# device; checkpoints and pass ends drain the queue (pipelines/training/deferred.py).
SCORE_LAG = 1


# ----------------------------------------------------------------------------- helpers
def learning_rate(cfg: RunConfig, progress: float) -> float:
    """Linear warmup then cosine or constant (optim.schedule), driven by pass progress (pass_index +
    fraction of the pass), so a pass shortened by pruning keeps the schedule aligned with the full
    run's (docs/design.md, principle 6)."""
    o = cfg.optim
    if progress < o.warmup_passes:
        return o.lr * progress / o.warmup_passes
    if o.schedule == "constant":  # DiT's recipe: AdamW at 1e-4, no decay (Peebles & Xie 2023, Sec. 4)
        return o.lr
    span = max(cfg.passes - o.warmup_passes, 1e-12)
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


def mixed_precision(cfg: RunConfig) -> str:
    if cfg.mixed_precision == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return cfg.mixed_precision


def load_held_out(cfg: RunConfig, task, rank: int = 0, world: int = 1) -> dict[str, list] | None:
    """Per held-out source (data.val: one folder, or a list of sources), this rank's share of the first
    `data.val_batches` batches of its shards in index order, decoded once (possibly empty), with the text
    `task` reads for a text-conditional run; None when the run has no val shards."""
    sources = parse_sources(cfg.data.val, "data.val", rules=False)
    if not sources:
        return None
    return {
        source.name: list(
            read_split(
                source.path,
                resolution=cfg.data.resolution,
                channels=cfg.data.channels,
                batch_size=cfg.data.batch_size,
                max_samples=cfg.data.val_batches * cfg.data.batch_size,
                rank=rank,
                world_size=world,
                desc=f"held-out samples{' of ' + source.name if len(sources) > 1 else ''}",
                **text_reading(task),
            )
        )
        for source in sources
    }


# ----------------------------------------------------------------------------- the loop
def train(cfg: RunConfig) -> dict:
    """Train `cfg` to the end (or `max_steps`); returns the last pass summary."""
    # A collective that waits longer than dist_timeout_seconds fails the job instead of holding it
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout_seconds))
    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg), cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout]
    )
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    run_dir = cfg.run_dir
    if main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        for note in latent_shard_notes(cfg):  # settings the latents make unused, once at the start
            print(f"prunepipe: note: {note}", flush=True)
    cfg = with_peak_learning_rate(cfg, world, announce=main)  # config.yaml keeps optim.blr as given

    torch.manual_seed(cfg.seed)  # model initialisation only; per-step randomness is derived
    # each rank loads its model's parts (a text encoder, the shards' records) from its own node: one
    # that cannot stops every rank here, not only itself while the others wait in the next collective
    task = on_every_rank(lambda: build_task(cfg))
    if task.text_identity:  # each rank loaded the encoder (or its features' record) from its node
        same_on_every_rank(
            task.text_identity,
            f"{task.text_encoder.identity()['text_encoder']}: {task.text_identity}",
            "text encoders (files and caption length)",
        )
    # every source's index.json from each rank's node: one that cannot read it stops every rank here
    mixture = on_every_rank(lambda: Mixture.load(cfg.data.train, samples_per_pass=cfg.data.samples_per_pass))
    index = mixture.index
    pass_length = int(mixture.per_pass().sum())  # samples the sources' rules draw a pass, before pruning
    if main and len(mixture.sources) > 1:
        print(f"data.train: {len(mixture.sources)} sources, ids laid end to end\n{mixture.describe()}", flush=True)
    pruner = build_pruner(
        cfg.pruner["name"], index.num_samples, cfg.passes, seed=cfg.seed, **pruner_hparams(cfg.pruner)
    )
    set_backend_flags(cfg, device)
    place_model(cfg, task.model, device)  # before the optimizer: the fused kernel checks the parameters' device
    optimizer = build_optimizer(cfg, task.model, device)
    model, optimizer = accelerator.prepare(task.model, optimizer)
    trained = list(accelerator.unwrap_model(model).parameters())  # what the EMA follows (unwrapped once)
    ema = PassProgressEMA(
        trained,
        decay=cfg.ema_decay,
        warmup=cfg.ema_warmup,
        full_steps_per_pass=pass_length / (world * cfg.data.batch_size * cfg.optim.grad_accum),
    )
    ema.to(device)
    local_rank, local_size = local_rank_and_size() if world > 1 else (0, 1)
    token = run_token() if world > 1 else ""
    node_tables = NodeTables(pruner, rank, local_rank, local_size, token)
    if main and node_tables.shared:
        print(
            f"pruner tables: one copy per node in shared memory, written by local rank 0 ({local_size} ranks per node)"
        )
    if cfg.pruner.get("groups"):  # side data, before a resume: the checkpoint names the table it needs
        path, digest = use_group_table(
            pruner,
            cfg.pruner["groups"],
            first_path(cfg.data.train),  # one source: the config refuses groups over a mixture
            index,
            rank=rank,
            local_rank=local_rank,
            local_size=local_size,
            token=token,
        )
        if main:
            stats = pruner.stats()
            print(
                f"near-duplicate groups: {path} (digest {digest}), {stats['grouped_samples']} "
                f"samples in groups of 2 or more, about {stats['per_group']:.3g} of each group a pass"
            )
    position = TrainingPosition()
    checkpointed = CheckpointedPruner(pruner)  # its tables as files of their own, written once
    accelerator.register_for_checkpointing(checkpointed, ema, position)
    source_strata = SourceStrata(mixture, task.num_strata, cfg.score.per_source)
    scorer = ScoreNormaliser(
        cfg.score.normalise,
        source_strata.num_strata,
        buckets=source_strata.buckets(cfg.score.buckets),
        momentum=cfg.score.momentum,
    )
    if cfg.score.normalise != "none":  # registered only when used: custom_checkpoint_3.pkl
        accelerator.register_for_checkpointing(scorer)
    if task.timestep_sampler is not None:
        accelerator.register_for_checkpointing(task.timestep_sampler)

    resume_from = choose_resume(accelerator, cfg.checkpoint.resume, run_dir)  # the newest intact checkpoint
    if resume_from is not None:
        load_resume(accelerator, resume_from)
        checkpointed.finish_load(resume_from)
        if main:
            print(
                f"resumed from {resume_from}: {position_label(position.pass_index, position.batch_in_pass, cfg.passes)}, "
                f"step {position.optimizer_steps}"
            )
    # a stage's first start: another run's weights and EMA (init.weights); a resume wins (docs/recipes.md, "Stages")
    init_from_weights(cfg, accelerator.unwrap_model(model), ema, resumed_from=resume_from, main=main)
    text_identity = task.text_identity  # "" unless text-conditional
    if position.text_identity and position.text_identity != text_identity:  # alike on every rank (agreed above)
        raise ValueError(
            f"{resume_from}: the run trained on the features of text encoder {position.text_identity}; "
            f"this config's (ldm.text.encoder={cfg.ldm.text.encoder}) is {text_identity or 'none'}. "
            f"Resume with the run's encoder (or its features), or start a new run"
        )
    position.text_identity = text_identity
    position.mixture = check_same_mixture(mixture, position.mixture, resume_from)
    if position.forwarded_by_source is None:
        position.forwarded_by_source = np.zeros(len(mixture.sources), dtype=np.int64)

    stream = ShardStream(
        index,
        batch_size=cfg.data.batch_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
        decoder=SampleDecoder(
            cfg.data.resolution,
            cfg.data.channels,
            hflip=cfg.data.hflip,
            seed=cfg.seed,
            num_classes=task.label_classes,
            crop=cfg.data.crop,
            crop_scale=tuple(cfg.data.crop_scale),
            **text_reading(task),
        ),
        shuffle_buffer=cfg.data.shuffle_buffer,
        on_bad_sample=cfg.data.on_bad_sample,
        retry=cfg.data.remote,
        mixture=mixture,
    )
    held_out = load_held_out(cfg, task, rank, world)  # every rank evaluates its share at each pass end
    debug = SyncDebug(accelerator, run_dir) if cfg.debug_sync else None
    evaluator = Evaluator(cfg, cfg.eval, run_dir=run_dir, device=device) if cfg.eval.every_passes else None
    # every pass; the printed pass lines are thinned in a log file
    metrics = MetricsLog(run_dir, main, resumed_from_step=position.optimizer_steps if resume_from else None)
    if resume_from is not None:  # the steps after the checkpoint are logged again: say from where
        metrics.resumed(
            resume_from,
            optimizer_steps=position.optimizer_steps,
            pass_index=position.pass_index,
            batch_in_pass=position.batch_in_pass,
        )
    pass_lines = EveryFewSeconds()
    accumulation = GradientAccumulation(accelerator, model, cfg.optim.grad_accum)
    # decoding beside the step; one count for the whole job, since it shapes every rank's pass layout
    workers = agreed_loader_workers(cfg.data.num_workers, device_type=device.type)
    summary: dict = {}
    last_saved = position.optimizer_steps if resume_from else -1
    stop = False
    lost_here = 0  # samples this rank lost to bad input since position.bad_samples was last summed
    # debug_device_sync: from the second micro-batch of this process on (the first may wait: lazy setup)
    device_waits = DeviceWaitCheck(cfg.debug_device_sync)
    if cfg.debug_device_sync and device.type != "cuda":
        raise ValueError("debug_device_sync=true checks CUDA synchronisation; this run has no CUDA device")

    while position.pass_index < cfg.passes and not stop:
        pass_index = position.pass_index
        node_tables.settle()  # the node's writer has recorded every update (or loaded the state) first
        plan = begin_pass(position, pruner, stream, world, workers)
        if debug is not None:
            debug.begin_pass(plan, pruner)
        undecodable_here = undecodable_of_rank(position, rank, world, max(1, workers))
        loader = stream.pass_loader(
            pass_index,
            plan,
            num_workers=workers,
            skip_batches=position.batch_in_pass,
            skip_undecodable=undecodable_here.copy(),
            pin_memory=device.type == "cuda",
        )
        total = loader.layout.steps
        pass_start, pass_losses = time.perf_counter(), []
        kept_fraction = loader.layout.kept / pass_length
        # Counted in batches, shown in samples over all ranks: the rate reads as samples/s.
        bar = progress(
            total,
            initial=position.batch_in_pass,
            disable=not main,
            desc=pass_label(pass_index, cfg.passes),
            unit="sample",
            unit_scale=cfg.data.batch_size * world,
        )

        def consume(record: StepRecord) -> None:
            """What the host does with a step's gathered batch, in step order: the non-finite
            check, the pruner's and the score statistics' updates, the pass loss and the log line."""
            if record.ids is not None:
                ids, gathered, strata = record.host()
                real = ids >= 0
                if not np.isfinite(gathered[real]).all():  # on_nonfinite_loss=stop; skip never gets here
                    report_nonfinite(cfg, accelerator, ids, gathered, record.step, record.pass_index, record.micro)
                position.consumed.set(ids[real])
                position.forwarded_by_source += forwarded_by_source(mixture, ids[real])
                pruner.update(ids, scorer(ids, gathered, source_strata(ids, strata)))
                task.observe(ids, strata, gathered)
                position.samples_forwarded += int(real.sum())
                if real.any():  # a batch of padding only has no loss to report
                    pass_losses.append(float(gathered[real].mean()))
            if record.is_step:
                pruner.on_step(record.lr)
                steps = record.step + 1
                if main and steps % cfg.log_every == 0 and pass_losses:
                    metrics.write(
                        {
                            "kind": "train",
                            "optimizer_steps": steps,
                            "pass_index": record.pass_index,
                            "loss": pass_losses[-1],
                            "lr": record.lr,
                            "samples_forwarded": position.samples_forwarded,
                        }
                    )
                    bar.set_postfix(loss=f"{pass_losses[-1]:.4f}", kept=f"{kept_fraction:.0%}")

        deferred = DeferredRecords(consume, lag=SCORE_LAG)
        for batch in loader:
            device_waits.step()
            micro = position.batch_in_pass
            is_step, group_size = accumulation.group(micro, total)
            lr = learning_rate(cfg, pass_progress(pass_index, position.pass_offset, micro, total))
            if debug is not None:
                debug.saw(batch.ids)
            lost_here += sum(e.samples_lost for e in batch.bad)
            check_bad_sample_budget(cfg, position, lost_here, batch.bad)
            undecodable_here[batch.worker] += batch.undecodable()
            step_at = position.optimizer_steps
            batch = batch.to(device, non_blocking=True)
            randomness = SampleRandomness(cfg.seed, pass_index, batch.ids)
            if not accumulation.buckets_settled:  # DDP's bucket layout, the same in fresh and resumed processes
                accumulation.settle_buckets(
                    lambda: fresh_forward_losses(accelerator, task, model, batch, cfg.seed, pass_index)
                )
            with accumulation.sync_context(is_step):  # DDP decides at the forward whether backward syncs
                with accelerator.autocast():
                    out = task.per_sample(model, batch, randomness)
                losses = out.loss.float()
                # Gathered on the device and copied to the host without waiting: consumed a step later.
                ids, gathered, strata = gather_tensors(batch.ids, out.for_pruner(), out.stratum)
                host, ready = to_host(ids, gathered, strata)
                if cfg.on_nonfinite_loss == "skip" and not bool(torch.isfinite(gathered[ids >= 0]).all()):
                    # skipping needs the answer before backward: one host read per step, under this policy only
                    report_nonfinite(
                        cfg, accelerator, *[t.cpu().numpy() for t in (ids, gathered)], step_at, pass_index, micro
                    )
                    position.skipped_nonfinite += 1
                    host = [None, None, None]
                    accumulation.skipped(is_step)  # every rank skips alike: average what the group holds
                else:
                    # mean(w * loss), InfoBatch's rescaling, averaged over this step's micro-batches
                    accumulation.backward((losses * batch.weights).mean() / group_size)
            if is_step:
                if accumulation.has_gradients:  # every micro-batch of the step skipped: nothing to apply
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    if cfg.optim.grad_clip > 0:
                        accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ema.step(trained, pass_progress(pass_index, position.pass_offset, micro + 1, total))
                accumulation.stepped()
                position.optimizer_steps += 1
            position.batch_in_pass += 1
            bar.update(1)
            deferred.push(StepRecord(step_at, pass_index, micro, lr, is_step, *host, ready=ready))
            if is_step:
                if position.optimizer_steps % cfg.checkpoint.every_steps == 0:
                    device_waits.pause()
                    deferred.drain()  # the checkpoint holds every update, as if none had waited
                    settle_bad_input(accelerator, position, lost_here, undecodable_here)
                    lost_here = 0
                    position.wall_seconds += time.perf_counter() - pass_start
                    pass_start = time.perf_counter()
                    save_checkpoint(
                        accelerator, run_dir, position.optimizer_steps, cfg.checkpoint.keep, checkpointed.write_tables
                    )
                    last_saved = position.optimizer_steps
                if cfg.max_steps and position.optimizer_steps >= cfg.max_steps:
                    stop = True
                    break
        device_waits.pause()
        deferred.drain()
        bar.close()
        position.wall_seconds += time.perf_counter() - pass_start
        settle_bad_input(accelerator, position, lost_here, undecodable_here)
        lost_here = 0
        if debug is not None:
            debug.end_pass(pass_index)
        if stop and position.batch_in_pass < total:
            break
        summary = end_of_pass(
            cfg, task, accelerator, model, pruner, plan, loader.layout, position, held_out, pass_losses
        )
        if len(mixture.sources) > 1:
            summary["kept_fraction"] = loader.layout.kept / pass_length  # of what the sources' rules drew
            summary["sources"] = pass_accounting(mixture, loader.layout.kept_per_source, position.forwarded_by_source)
        summary["ema_decay"] = ema.cur_decay_value  # at the pass end: pruned and full runs alike
        metrics.write(summary)
        if main and pass_lines.due(force=position.pass_index + 1 == cfg.passes):
            print(format_pass(summary, cfg.passes), flush=True)
        if evaluator is not None and (pass_index + 1) % cfg.eval.every_passes == 0:  # outside the pass timer
            at = {k: summary[k] for k in ("pass_index", "optimizer_steps", "samples_forwarded", "wall_seconds")}
            at["pass"] = f"after {pass_label(pass_index, cfg.passes)}"
            metrics.write(evaluator.evaluate(task, weights_for_eval(model, ema, cfg.eval.weights), at=at))
        position.pass_index += 1
        position.batch_in_pass, position.pass_offset, position.excluded, position.undecodable = 0, 0.0, None, None

    stream.close()  # the loader workers, kept from pass to pass
    if position.optimizer_steps != last_saved:
        save_checkpoint(accelerator, run_dir, position.optimizer_steps, cfg.checkpoint.keep, checkpointed.write_tables)
    if main and position.pass_index >= cfg.passes:
        ema_model = copy.deepcopy(accelerator.unwrap_model(model))
        ema.copy_to(ema_model.parameters())
        task.export(accelerator.unwrap_model(model), ema_model, os.path.join(run_dir, "export"))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def fresh_forward_losses(accelerator, task, model, batch, seed: int, pass_index: int) -> torch.Tensor:
    """The batch's per-sample losses from a forward of its own draws (a task's draws come in a fixed
    order per SampleRandomness, so the real step keeps its own)."""
    with accelerator.autocast():
        return task.per_sample(model, batch, SampleRandomness(seed, pass_index, batch.ids)).loss.float()


class DeviceWaitCheck:
    """debug_device_sync: any device-to-host synchronisation inside a step is an error on CUDA; off
    between steps that must read the host (checkpoints, pass ends). Nothing at all when not asked for."""

    def __init__(self, on: bool):
        self.on, self.steps = on and torch.cuda.is_available(), 0

    def step(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("error" if self.steps else "default")
            self.steps += 1

    def pause(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")


def report_nonfinite(
    cfg: RunConfig, accelerator, ids: np.ndarray, losses: np.ndarray, step: int, pass_index: int, micro: int
) -> None:
    """Stop with the step and the sample ids (on_nonfinite_loss=stop), or say which batch is skipped."""
    bad_ids = ids[(ids >= 0) & ~np.isfinite(losses)].tolist()
    where = f"step {step} ({pass_label(pass_index, cfg.passes)}, batch {micro})"
    if cfg.on_nonfinite_loss == "stop":
        raise NonFiniteLossError(
            f"non-finite loss at {where} for sample ids {bad_ids}; set on_nonfinite_loss=skip to skip such batches"
        )
    accelerator.print(f"skipping batch with non-finite loss at {where}, sample ids {bad_ids}")


def undecodable_of_rank(position: TrainingPosition, rank: int, world: int, workers: int) -> np.ndarray:
    """int64 [workers]: this rank's undecodable samples per worker part in the pass so far (zeros
    at a pass start, or when the pass resumes under another layout and starts a segment)."""
    table = position.undecodable
    if position.batch_in_pass == 0 or table is None or len(table) != world * workers:
        return np.zeros(workers, dtype=np.int64)
    return table[rank * workers : (rank + 1) * workers].astype(np.int64)


def check_bad_sample_budget(cfg, position: TrainingPosition, lost_here: int, bad: tuple) -> None:
    """Stop once the run has lost more samples to bad input than data.max_bad_samples (the settled
    count of every rank, plus this rank's since): skipping is for a few bad samples, not for a store
    that lost a tenth of the data. This rank raises at once; the launcher stops the others."""
    budget = cfg.data.max_bad_samples
    if budget < 0 or position.bad_samples + lost_here <= budget:
        return
    last = bad[-1].message if bad else "see the warnings above"
    raise BadInputError(
        f"{position.bad_samples + lost_here} samples lost to bad input by "
        f"{pass_label(position.pass_index, cfg.passes)} "
        f"(this rank: {lost_here} since the last checkpoint or pass end), more than "
        f"data.max_bad_samples={budget}; the latest: {last}"
    )


def settle_bad_input(accelerator, position: TrainingPosition, lost_here: int, undecodable_here: np.ndarray) -> None:
    """Bring the checkpointed bad-input counts up to date over all ranks (one all-reduce; every rank
    calls it at the same point): `bad_samples` += the samples each rank lost since the last call,
    `undecodable` = every rank's per-worker `undecodable_of_rank` counts, in rank order."""
    workers = len(undecodable_here)
    counts = torch.zeros(1 + accelerator.num_processes * workers, dtype=torch.int64, device=accelerator.device)
    counts[0] = lost_here
    start = 1 + accelerator.process_index * workers
    counts[start : start + workers] = torch.from_numpy(undecodable_here)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    counts = counts.cpu().numpy()
    position.bad_samples += int(counts[0])
    position.undecodable = counts[1:]


def end_of_pass(cfg, task, accelerator, model, pruner, plan, layout, position, held_out, pass_losses) -> dict:
    steps = layout.steps
    summary = {
        "kind": "pass",
        "pass_index": position.pass_index,
        "optimizer_steps": position.optimizer_steps,
        "steps_in_pass": steps,
        "kept_fraction": layout.kept / plan.num_samples,
        "kept_samples": layout.kept,
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


GRID_POINT = re.compile(r"_(s\d{3}|t\d{4})$")  # flow_mse_s005, denoise_mse_t0999: in metrics.jsonl, not the line


def format_pass(summary: dict, passes: int) -> str:
    held = " ".join(
        f"{k} {v:.4f}"
        for k, v in summary.get("held_out", {}).items()
        if isinstance(v, float) and not GRID_POINT.search(k)
    )  # denoise_mse is the grid's mean
    return (
        f"{pass_label(summary['pass_index'], passes)}: kept {summary['kept_fraction']:.1%}, "
        f"{summary['steps_in_pass']} steps, train loss {summary['train_loss']:.4f}"
        f"{', held-out ' + held if held else ''}, {summary['wall_seconds']:.1f} s total"
    )
