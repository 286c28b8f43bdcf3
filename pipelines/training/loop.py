"""The one training loop, for MAE and latent diffusion alike (docs/design.md, principle 4).

Per pass: freeze the pruner's plan, stream the kept samples, and per step compute per-sample
losses, take mean(w * loss), step the optimizer and EMA, and feed the globally gathered
(ids, losses) back to the pruner. Checkpoints are atomic; a resumed run continues bit for bit.
Laid out as torchtitan's trainer: `Trainer.__init__` sets the run up once, `train` runs pass after
pass, `train_pass` one pass, `train_step` one micro-batch, `consume` the host's share of a step one
step late, `end_pass` the pass's record. Every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from prunepipe.pipelines.checkpoint.parts import CheckpointParts
from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.checkpoint.pruner_state import CheckpointedPruner
from prunepipe.pipelines.checkpoint.sharded import TrainingState
from prunepipe.pipelines.checkpoint.store import save_checkpoint
from prunepipe.pipelines.config import RunConfig, check_data, pruner_hparams
from prunepipe.pipelines.data.workers import agreed_loader_workers
from prunepipe.pipelines.evaluation.runner import Evaluator, weights_for_eval
from prunepipe.pipelines.progress import EveryFewSeconds, pass_bar
from prunepipe.pipelines.ranks import on_every_rank
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.randomness import SampleRandomness
from prunepipe.pipelines.training.accumulation import GradientAccumulation
from prunepipe.pipelines.training.bad_input import BadInputTally
from prunepipe.pipelines.training.buckets import BucketTally
from prunepipe.pipelines.training.data import load_held_out, train_stream
from prunepipe.pipelines.training.deferred import DeferredRecords, StepRecord, to_host
from prunepipe.pipelines.training.device import DeviceWaitCheck, prepare_model, start_accelerator
from prunepipe.pipelines.training.ema import EMASettings, PassProgressEMA
from prunepipe.pipelines.training.groups import use_configured_groups
from prunepipe.pipelines.training.metrics import format_pass, open_metrics, write_run_config
from prunepipe.pipelines.training.node_tables import NodeTables, node_place
from prunepipe.pipelines.training.nonfinite import NonFiniteLossError, nonfinite_to_skip, report_nonfinite  # noqa: F401
from prunepipe.pipelines.training.passes import begin_pass, open_pass, pass_summary, with_accounting
from prunepipe.pipelines.training.previews import Previews
from prunepipe.pipelines.training.resume import agree_on_text, resume_or_start
from prunepipe.pipelines.training.schedule import learning_rate, pass_progress, with_peak_learning_rate
from prunepipe.pipelines.training.sources import SourceStrata, count_forwarded
from prunepipe.pipelines.training.sync_check import SyncDebug
from prunepipe.pipelines.training.throughput import Throughput, rate_words
from prunepipe.pipelines.training.trackers import start_trackers
from prunepipe.pruning import build_pruner, gather_tensors

# Step k's scores reach the pruner after step k+1 is enqueued, so the step never waits for the
# device; checkpoints and pass ends drain the queue (pipelines/training/deferred.py).
SCORE_LAG = 1


def train(cfg: RunConfig) -> dict:
    """Train `cfg` to the end (or `max_steps`); returns the last pass summary."""
    return Trainer(cfg).train()


class Trainer:
    """One run: set up once, then pass after pass, step after step."""

    def __init__(self, cfg: RunConfig):
        accelerator = self.accelerator = start_accelerator(cfg)
        self.device, self.rank, self.world = accelerator.device, accelerator.process_index, accelerator.num_processes
        is_main = self.is_main = accelerator.is_main_process
        # every source's index.json from each rank's node, read once here: one that cannot stops every rank
        data = self.data = on_every_rank(lambda: check_data(cfg))
        if is_main:
            write_run_config(cfg, data)
        cfg = self.cfg = with_peak_learning_rate(cfg, self.world, announce=is_main)  # config.yaml keeps optim.blr

        # ------------------------------------------------------------ the task, the data, the pruner
        torch.manual_seed(cfg.seed)  # model initialisation only; per-step randomness is derived
        mixture = self.mixture = data.train
        # each rank loads its model's parts (a text encoder, the shards' records) from its own node: one that
        # cannot stops every rank here, not only itself while the others wait in the next collective
        task = self.task = on_every_rank(lambda: build_task(cfg, data=data))
        agree_on_text(task)
        self.pass_length = int(mixture.per_pass().sum())  # samples the sources' rules draw a pass, before pruning
        if is_main and len(mixture.sources) > 1:
            print(f"data.train: {len(mixture.sources)} sources, ids laid end to end\n{mixture.describe()}", flush=True)
        name, hparams = cfg.pruner["name"], pruner_hparams(cfg.pruner)
        pruner = self.pruner = build_pruner(name, mixture.index.num_samples, cfg.num_passes, seed=cfg.seed, **hparams)

        # ------------------------------------------------------------ the model, its optimizer and EMA
        self.model, self.optimizer, self.parallel = prepare_model(cfg, accelerator, task.model)
        bare = self.bare = accelerator.unwrap_model(self.model)
        names = [name for name, _ in bare.named_parameters()]  # sharded in place under fsdp
        self.trained = [param for _, param in bare.named_parameters()]  # what the EMA follows
        self.ema = PassProgressEMA.for_run(cfg, self.trained, self.pass_length, self.world, self.device)
        self.state = TrainingState(self.model, self.optimizer, self.ema, names)  # every rank saves its share
        # ------------------------------------------------------------ the pruner's tables and groups per node
        place = node_place(self.rank, self.world)
        self.node_tables = NodeTables(pruner, *place.as_tuple(), announce=is_main)
        use_configured_groups(cfg, pruner, mixture.index, place, announce=is_main)  # before a resume: it names them

        # ------------------------------------------------------------ the state a checkpoint keeps, and the start
        self.position = TrainingPosition()
        self.source_strata = SourceStrata(mixture, task.num_strata, cfg.score.per_source)
        self.buckets = BucketTally(mixture.index)  # aspect-ratio buckets: none unless the shards are bucketed
        self.scorer = self.source_strata.normaliser(cfg.score)
        self.parts = CheckpointParts(
            ema=EMASettings(self.ema, names),
            pruner=CheckpointedPruner(pruner),  # its tables as files of their own, written once
            position=self.position,
            score_normaliser=self.scorer if cfg.score.normalise != "none" else None,
            timestep_sampler=task.timestep_sampler,
        )
        self.resumed_from = resume_or_start(
            cfg, accelerator, self.state, self.parts, self.model, task, mixture, announce=is_main
        )

        # ------------------------------------------------------------ the stream, the judges, the log
        self.stream = train_stream(cfg, mixture, task, self.rank, self.world)
        self.held_out = load_held_out(cfg, task, self.rank, self.world, data)  # every rank evaluates its share
        self.debug = SyncDebug(accelerator, cfg.run_dir) if cfg.debug_sync else None
        self.evaluator = Evaluator.for_run(cfg, self.device, announce=is_main)
        start_trackers(accelerator, cfg, self.position.optimizer_steps if self.resumed_from else None)
        self.metrics = open_metrics(cfg.run_dir, is_main, self.resumed_from, self.position, accelerator)
        self.previews = Previews(cfg, task, accelerator, bare, self.trained, self.ema, self.metrics)  # eval.preview
        self.pass_lines = EveryFewSeconds()  # every pass in metrics.jsonl; the printed lines thinned in a log file
        self.accumulation = GradientAccumulation(accelerator, self.model, cfg.optim.grad_accum, self.parallel)
        # decoding beside the step; one count for the whole job, since it shapes every rank's pass layout
        self.workers = agreed_loader_workers(cfg.data.num_workers, device_type=self.device.type)
        self.last_saved = self.saved_at() if self.resumed_from else None
        self.stopped = False  # max_steps reached
        self.bad_input = BadInputTally(cfg)
        self.device_waits = DeviceWaitCheck(cfg.debug_device_sync, self.device)
        self.throughput = Throughput(self.world, self.device)  # samples/s a GPU and MFU in the train records

    # ---------------------------------------------------------------- the run
    def train(self) -> dict:
        """Pass after pass to cfg.num_passes (or max_steps), the last checkpoint, and after the last pass the export."""
        cfg, position = self.cfg, self.position
        summary: dict = {}
        while position.pass_index < cfg.num_passes and not self.stopped:
            plan, layout = self.train_pass()
            if self.stopped and position.batch_in_pass < layout.steps:
                break
            summary = self.end_pass(plan, layout)
        self.stream.close()  # the loader workers, kept from pass to pass
        if self.saved_at() != self.last_saved:  # a checkpoint at a pass's last step predates its end
            self.save()
        if position.pass_index >= cfg.num_passes:
            self.parallel.export(self.task, self.ema, cfg.run_dir)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        return summary

    def train_pass(self):
        """One pass (or the rest of a resumed one), every update drained at its end: (its plan, its layout)."""
        cfg, position = self.cfg, self.position
        pass_index = position.pass_index
        self.node_tables.wait_for_writer()  # the node's writer has recorded every update (or loaded the state)
        plan = begin_pass(position, self.pruner, self.stream, self.world, self.workers)
        if self.debug is not None:
            self.debug.begin_pass(plan, self.pruner)
        loader = open_pass(
            self.stream, plan, position, self.bad_input, self.rank, self.world, self.workers, self.device
        )
        total = loader.layout.steps
        self.pass_start, self.pass_losses = time.perf_counter(), []
        self.kept_fraction = loader.layout.kept / self.pass_length
        samples_a_batch = cfg.data.batch_size * self.world
        self.bar = pass_bar(
            total, position.batch_in_pass, pass_index, cfg.num_passes, samples_a_batch, not self.is_main
        )
        self.deferred = DeferredRecords(self.consume, lag=SCORE_LAG)
        for batch in loader:
            if not self.train_step(batch, total):  # the optimizer did not step
                continue
            if position.optimizer_steps % cfg.checkpoint.every_steps == 0:
                self.catch_up()  # the checkpoint holds every update, as if none had waited
                self.save()
            if self.previews.due(position.optimizer_steps):  # every rank draws; outside the pass timer
                self.device_waits.pause()
                self.pass_start += self.previews.draw(position.optimizer_steps)
            if cfg.max_steps and position.optimizer_steps >= cfg.max_steps:
                self.stopped = True
                break
        self.catch_up()
        self.bar.close()
        if self.debug is not None:
            self.debug.end_pass(pass_index)
        return plan, loader.layout

    # ---------------------------------------------------------------- one micro-batch
    def train_step(self, batch, total: int) -> bool:
        """Forward, gather and backward of one micro-batch of a pass of `total`, and the optimizer and EMA
        step when it ends one; its gathered losses queued for the host. Returns whether the optimizer stepped."""
        cfg, position, accumulation = self.cfg, self.position, self.accumulation
        self.device_waits.step()
        pass_index, micro, step_at = position.pass_index, position.batch_in_pass, position.optimizer_steps
        is_step, group_size = accumulation.group(micro, total)
        lr = learning_rate(cfg, pass_progress(pass_index, position.pass_offset, micro, total))
        if self.debug is not None:
            self.debug.saw(batch.ids)
        self.bad_input.saw(batch, position)
        batch = batch.to(self.device, non_blocking=True)
        randomness = SampleRandomness(cfg.seed, pass_index, batch.draw_ids)

        def aside() -> torch.Tensor:  # the batch's losses on draws of their own: the step keeps its own
            return self.forward(batch, SampleRandomness(cfg.seed, pass_index, batch.draw_ids)).loss.float()

        if not accumulation.buckets_rebuilt:  # DDP's bucket layout, the same in fresh and resumed processes
            accumulation.rebuild_buckets(aside)
        self.throughput.count_once(aside, self.model, len(batch.ids))  # FLOPs a sample, on the first batch
        with accumulation.sync_context(is_step):  # DDP decides at the forward whether backward syncs
            out = self.forward(batch, randomness)
            losses = out.loss.float()
            # Gathered on the device and copied to the host without waiting: consumed a step later.
            ids, gathered, strata = gather_tensors(batch.ids, out.for_pruner(), out.stratum)
            host, ready = to_host(ids, gathered, strata)
            if nonfinite_to_skip(cfg, self.accelerator, ids, gathered, step_at, pass_index, micro):
                position.skipped_nonfinite += 1
                host = [None, None, None]
                accumulation.skipped(is_step)  # every rank skips alike: average what the group holds
            else:
                # mean(w * loss), InfoBatch's rescaling, averaged over this step's micro-batches
                accumulation.backward((losses * batch.weights).mean() / group_size)
        if is_step:
            self.optimizer_step(lr, pass_progress(pass_index, position.pass_offset, micro + 1, total))
        position.batch_in_pass += 1
        self.bar.update(1)
        self.deferred.push(StepRecord(step_at, pass_index, micro, lr, is_step, *host, ready=ready))
        return is_step

    def optimizer_step(self, lr: float, progress: float) -> None:
        """Apply the accumulated gradients at `lr` (nothing if every micro-batch of the step was skipped)
        and average the weights reached at pass progress `progress` into the EMA."""
        if self.accumulation.has_gradients:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.cfg.optim.grad_clip > 0:
                self.parallel.clip_gradients(self.cfg.optim.grad_clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.step(self.trained, progress)
        self.accumulation.stepped()
        self.position.optimizer_steps += 1

    def forward(self, batch, randomness: SampleRandomness):
        """The task's per-sample losses of `batch` through the wrapped model, under mixed precision."""
        with self.parallel.autocast():
            return self.task.per_sample(self.model, batch, randomness)

    def consume(self, record: StepRecord) -> None:
        """What the host does with a step's gathered batch, in step order: the non-finite check, the
        pruner's and the score statistics' updates, the pass loss and the log line."""
        position = self.position
        if record.ids is not None:
            ids, gathered, strata = record.host()
            real = ids >= 0
            if not np.isfinite(gathered[real]).all():  # on_nonfinite_loss=stop; skip never gets here
                report_nonfinite(
                    self.cfg, self.accelerator, ids, gathered, record.step, record.pass_index, record.micro
                )
            count_forwarded(position, self.mixture, self.buckets, ids[real], gathered[real])
            self.pruner.update(ids, self.scorer(ids, gathered, self.source_strata(ids, strata)))
            self.task.observe(ids, strata, gathered)
            if real.any():  # a batch of padding only has no loss to report
                self.pass_losses.append(float(gathered[real].mean()))
        if not record.is_step:
            return
        self.pruner.on_step(record.lr)
        steps = record.step + 1
        if self.is_main and steps % self.cfg.log_every == 0 and self.pass_losses:
            loss = self.pass_losses[-1]
            rates = self.throughput.rates(position.samples_forwarded)
            self.metrics.train_line(steps, record.pass_index, loss, record.lr, position.samples_forwarded, rates)
            self.bar.set_postfix(loss=f"{loss:.4f}", kept=f"{self.kept_fraction:.0%}", **rate_words(rates))

    # ---------------------------------------------------------------- pass ends and checkpoints
    def end_pass(self, plan, layout) -> dict:
        """The pass's record (held-out metrics over every rank), the evaluators when due, the next pass."""
        cfg, position = self.cfg, self.position
        pass_index = position.pass_index
        held_out_model = self.evaluated("raw") if self.held_out is not None else None
        summary = pass_summary(
            cfg, self.task, held_out_model, self.pruner, plan, layout, position, self.held_out, self.pass_losses
        )
        with_accounting(summary, layout, position, self.mixture, self.pass_length, self.buckets, self.ema)
        self.metrics.write(summary)
        if self.is_main and self.pass_lines.due(force=pass_index + 1 == cfg.num_passes):
            print(format_pass(summary, cfg.num_passes), flush=True)
        if self.evaluator is not None and (pass_index + 1) % cfg.eval.every_passes == 0:  # outside the pass timer
            self.metrics.write(
                self.evaluator.after_pass(self.task, self.evaluated(cfg.eval.weights), summary, cfg.num_passes)
            )
        position.pass_index += 1
        position.batch_in_pass, position.pass_offset, position.excluded, position.undecodable = 0, 0.0, None, None
        return summary

    def evaluated(self, which: str):
        """The weights to evaluate ("ema" or "raw"): under fsdp a whole copy gathered on every rank."""
        if not self.parallel.sharded:
            return weights_for_eval(self.model, self.ema, which)
        return self.parallel.whole(self.ema.shadow_params if which == "ema" else None)

    def catch_up(self) -> None:
        """Before a checkpoint and at a pass end (on every rank at the same step): every deferred update
        consumed, the bad input summed over ranks, the pass's time so far counted."""
        self.device_waits.pause()
        self.deferred.drain()
        self.bad_input.sum_over_ranks(self.accelerator, self.position)
        self.position.wall_seconds += time.perf_counter() - self.pass_start
        self.pass_start = time.perf_counter()

    def save(self) -> None:
        """A checkpoint at the current step: every rank writes its shards, rank 0 seals it."""
        step = self.position.optimizer_steps
        save_checkpoint(self.accelerator, self.cfg.run_dir, step, self.cfg.checkpoint.keep, self.parts, self.state)
        self.last_saved = self.saved_at()

    def saved_at(self) -> tuple[int, int]:
        return self.position.optimizer_steps, self.position.pass_index
