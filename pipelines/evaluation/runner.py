"""The evaluators of a run: MAE reconstruction (masked MSE, PSNR, SSIM) and linear probe; diffusion
held-out denoising loss, FID of DDIM samples and (eval.replication) how close those samples come to
training images; for text-conditional runs the samples are drawn from held-out captions, FID compares
them with those captions' images, and CLIPScore (eval.clip_score) with the captions. `Evaluator` is
built once per run (feature network, cached reference statistics, CLIP) and called with the weights to
evaluate, from `prunepipe eval` on a checkpoint or from the training loop every E passes. It never
trains and never downloads.

Every rank takes part: each evaluates its share of the held-out images, the probe's train and val
images and the FID samples, and the shares are combined (pipelines/ranks.py), so no rank
works alone while the others wait in a collective. The model is evaluated at `eval.precision`
(pipelines/evaluation/precision.py), the same in training and in `prunepipe eval`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn

from prunepipe.pipelines.data.decode import caption
from prunepipe.pipelines.data.mixture import first_path
from prunepipe.pipelines.data.shards import ShardIndex, index_file, index_metadata, read_keys, read_shard
from prunepipe.pipelines.data.splits import read_captions, read_split, read_text_features
from prunepipe.pipelines.evaluation.config import EvalConfig, FIDConfig
from prunepipe.pipelines.evaluation.fid import FIDEvaluator, load_feature_net
from prunepipe.pipelines.evaluation.needs import plan_evaluation
from prunepipe.pipelines.evaluation.precision import forward_precision, without_autocast_wrappers
from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS, record_path, write_record
from prunepipe.pipelines.evaluation.replication import save_pairs_picture
from prunepipe.pipelines.progress import pass_label
from prunepipe.pipelines.ranks import (
    counts_by_rank,
    decided_on_rank0,
    gather_in_index_order,
    mean_over_ranks,
    on_every_rank,
    rank0_value,
    rank_and_world,
)
from prunepipe.pipelines.tasks.build import text_reading
from prunepipe.pipelines.tasks.diffusion.text import stored_identity
from prunepipe.pipelines.tasks.protocol import Task
from prunepipe.pipelines.tasks.wrappers import unwrap, weights_module

# why a text-conditional run's evaluation needs the held-out shards
SAMPLED_FROM_CAPTIONS = "a text-conditional model is sampled from held-out captions for FID, CLIPScore and replication"


def eval_config_of(run_cfg) -> EvalConfig:
    """The run config's `eval:` section when it has one, else the defaults."""
    section = getattr(run_cfg, "eval", None)
    return section if isinstance(section, EvalConfig) else EvalConfig()


def weights_for_eval(model: nn.Module, ema=None, which: str = "ema") -> nn.Module:
    """The module to evaluate: the bare model ("raw", or no EMA kept), or a copy holding the EMA
    weights (a diffusers EMAModel or an nn.Module copy) — the trained model is left untouched."""
    if which == "raw" or ema is None:
        return unwrap(model)
    return weights_module(ema, model)


def held_out_over_ranks(task: Task, model: nn.Module, batches, cfg: EvalConfig) -> dict:
    """The task's held-out loss (MAE masked MSE, diffusion denoising MSE) of `model` on this rank's
    share of the held-out batches, combined over ranks, at `cfg.precision`. Every rank calls it (an
    empty share included); the training loop's per-pass `held_out` and the evaluators use it alike."""
    bare = unwrap(model)
    with without_autocast_wrappers(bare), forward_precision(cfg.precision, next(bare.parameters()).device):
        local = task.held_out(bare, batches, seed=cfg.seed)
    return mean_over_ranks(local)


class Evaluator:
    """Every evaluator of one run's task; `evaluate(task, model, at=...)` on all ranks, each doing its share."""

    def __init__(
        self,
        run_cfg,
        eval_cfg: EvalConfig | None = None,
        *,
        run_dir: str | None = None,
        device: str | torch.device | None = None,
    ):
        self.run_cfg = run_cfg
        self.cfg = eval_cfg or eval_config_of(run_cfg)
        self.run_dir = run_dir or run_cfg.run_dir
        self.device = torch.device(device) if device is not None else None
        self._fid: FIDEvaluator | None = None
        self._clip = None  # torchmetrics' CLIPScore on eval.clip_score.model, loaded once
        self._replication_net = None  # replication.feature's network, loaded once
        self._captions, self._captions_read = [], None  # the held-out captions, and (folder, reference, count) read
        self._caption_ids: list[int] | None = None  # caption i's held-out sample id, where it is not i
        self._replication = None  # the last evaluation's replication result (its pairs go into a picture)
        self._said_capped: set[str] = set()  # settings told they were capped at the held-out captions
        self.skipped: dict[str, str] | None = None  # what `prepare` left out, and why (None: not prepared yet)

    def prepare(self) -> dict[str, str]:
        """Check what the evaluation needs (pipelines/evaluation/needs.py), decided on rank 0 for every rank:
        EvalNeedsError naming every missing piece, or the settings to run with and the metrics left out
        ({"fid_skipped": why}), returned and written into every record. Once; `evaluate` calls it first."""
        if self.skipped is None:
            plan = decided_on_rank0(lambda: plan_evaluation(self.run_cfg, self.cfg))
            self.cfg, self.skipped = plan.cfg, plan.skipped
        return dict(self.skipped)

    @classmethod
    def for_run(cls, cfg, device, announce: bool) -> Evaluator | None:
        """The training loop's evaluator (None without eval.every_passes), what it needs checked at the
        run's start rather than after the first eval.every_passes passes; what it skips said once."""
        if not cfg.eval.every_passes:
            return None
        evaluator = cls(cfg, cfg.eval, run_dir=cfg.run_dir, device=device)
        for key, why in evaluator.prepare().items():
            if announce:
                print(f"prunepipe: eval: {key.removesuffix('_skipped')} skipped: {why}", flush=True)
        return evaluator

    # ------------------------------------------------------------------ per task
    def _val_batches(self, task, max_samples: int, rank: int, world: int):
        data = self.run_cfg.data
        folder = self._held_out_folder("the held-out evaluators need val shards")
        return read_split(
            folder,
            resolution=data.resolution,
            channels=data.channels,
            batch_size=self.cfg.batch_size,
            max_samples=max_samples,
            rank=rank,
            world_size=world,
            desc="val",
            **text_reading(task),
        )

    def _mae(self, task, model: nn.Module, rank: int, world: int) -> dict:
        from prunepipe.pipelines.evaluation.probe import encoder_features, fit_probe
        from prunepipe.pipelines.evaluation.reconstruction import reconstruction_metrics

        cfg = self.cfg
        results = mean_over_ranks(
            reconstruction_metrics(
                task,
                model,
                self._val_batches(task, cfg.val_samples, rank, world),
                seed=cfg.seed,
                precision=cfg.precision,
            )
        )
        if cfg.probe.enabled:
            data = self.run_cfg.data
            train = read_split(
                first_path(data.train),
                resolution=data.resolution,
                channels=data.channels,
                batch_size=cfg.batch_size,
                max_samples=cfg.probe.train_samples,
                rank=rank,
                world_size=world,
                desc="probe train",
            )
            # the probe's val set is all of val, whatever val_samples caps reconstruction at
            val = self._val_batches(task, 0, rank, world)
            mine = [encoder_features(model.encoder, split, cfg.probe.pool, cfg.precision) for split in (train, val)]
            (_, train_x, train_y), (_, val_x, val_y) = [gather_in_index_order(*features) for features in mine]
            # every rank fits the same arrays at the same time (a deterministic fit): nobody waits
            results.update(rank0_value(fit_probe(train_x, train_y, val_x, val_y, cfg.probe, seed=cfg.seed)))
            results["probe_images_by_rank"] = counts_by_rank(sum(len(ids) for ids, _, _ in mine))
        return results

    def _diffusion(self, task, model: nn.Module, rank: int, world: int) -> dict:
        from prunepipe.pipelines.evaluation.clip_score import scoring
        from prunepipe.pipelines.evaluation.sampling import generate_images, latent_decoder

        fid_cfg, rep_cfg = self.cfg.fid, self.cfg.replication
        clip_on = bool(self.cfg.clip_score.model)
        if clip_on and not task.text_conditional:
            raise ValueError(
                f"eval config: clip_score.model scores samples against the captions they were drawn "
                f"from; run {self.run_cfg.name} is not text-conditional (set clip_score.model=)"
            )
        # CLIPScore measures FID's samples: it draws fid.num_samples of them with FID off too
        fid_count, rep_count = fid_cfg.num_samples, rep_cfg.num_samples
        self._check_counts(fid_cfg.enabled or clip_on, fid_count, rep_cfg.enabled, rep_count, world)
        results = held_out_over_ranks(task, model, self._val_batches(task, self.cfg.val_samples, rank, world), self.cfg)
        if not (fid_cfg.enabled or rep_cfg.enabled or clip_on):
            return results
        data = self.run_cfg.data
        latent_index = index_metadata(first_path(data.train)) if task.cfg.space == "latents" else None
        decode = latent_decoder(task, fid_cfg.vae, fid_cfg.vae_subfolder, latent_index)
        captions = prompts = None
        if task.text_conditional:  # sample i is drawn from held-out caption i; a short val set caps the counts
            captions = prompts = self._held_out_captions(
                max(fid_count if fid_cfg.enabled or clip_on else 0, rep_count if rep_cfg.enabled else 0)
            )
            self._say_capped(
                len(captions),
                {
                    "fid.num_samples": fid_count if fid_cfg.enabled or clip_on else 0,
                    "replication.num_samples": rep_count if rep_cfg.enabled else 0,
                },
            )
            if fid_cfg.enabled or clip_on:
                results["fid_samples_requested"] = fid_count
            fid_count, rep_count = min(fid_count, len(captions)), min(rep_count, len(captions))
            self._check_counts(fid_cfg.enabled or clip_on, fid_count, rep_cfg.enabled, rep_count, world)
            results["held_out_captions"] = len(captions)
            if task.text.precomputed:  # the model reads their precomputed features: this rank's share
                prompts = self._held_out_features(task, len(captions), rank, world)

        def samples(count: int):
            return generate_images(
                task,
                model,
                num_images=count,
                steps=fid_cfg.sampler_steps,
                seed=self.cfg.seed,
                batch_size=fid_cfg.batch_size,
                rank=rank,
                world_size=world,
                decode=decode,
                guidance_scale=fid_cfg.guidance_scale,
                precision=self.cfg.precision,
                captions=prompts,
            )

        # sample i is keyed by (seed, i): FID's first replication.num_samples are the ones replication
        # would draw, so they are kept as FID streams past instead of being drawn twice
        reuse = rep_cfg.enabled and (fid_cfg.enabled or clip_on) and rep_count <= fid_count
        kept: list[torch.Tensor] = []
        if fid_cfg.enabled or clip_on:
            images = samples(fid_count)
            if reuse:
                images = _keeping(images, kept, len(range(rank, rep_count, world)))
            if clip_on:
                clip = self._clip_metric()
                images = scoring(images, clip, [captions[i] for i in range(rank, fid_count, world)])
            if fid_cfg.enabled:
                first = next(images)  # the generated size decides the reference resolution; every rank has one
                fid = self._fid_evaluator(first.shape[-1], first.shape[1], fid_count if captions else 0)
                results.update(fid.score(_chain(first, images)))
                results["fid_sampler_steps"] = fid_cfg.sampler_steps
                results["fid_guidance_scale"] = fid_cfg.guidance_scale
            else:
                for _ in images:  # CLIPScore alone: its metric sees every sample as they stream past
                    pass
            if clip_on:
                results.update(
                    {
                        "clip_score": float(clip.compute()),
                        "clip_score_samples": fid_count,
                        "clip_score_model": os.path.abspath(self.cfg.clip_score.model),
                        "clip_score_sampler_steps": fid_cfg.sampler_steps,
                        "clip_score_guidance_scale": fid_cfg.guidance_scale,
                    }
                )
        if rep_cfg.enabled:
            generated = torch.cat(kept) if reuse else torch.cat([x.cpu() for x in samples(rep_count)])
            results.update(self._replication_of(generated, rep_count, rank, world))
            results["replication_reused_fid_samples"] = reuse
        return results

    def _say_capped(self, captions: int, asked: dict) -> None:
        """Once per run and setting, on rank 0: a text-conditional model draws one sample per held-out
        caption, so a setting asking for more samples than there are captions gets that many."""
        capped = {name: count for name, count in asked.items() if count > captions and name not in self._said_capped}
        self._said_capped.update(capped)
        if not capped or rank_and_world()[0] != 0:
            return
        folder = self._held_out_folder(SAMPLED_FROM_CAPTIONS)
        asks = " and ".join(f"{name}={count}" for name, count in capped.items())
        print(
            f"prunepipe: eval: {asks} asked for more samples than the {captions} held-out captions of {folder}: a "
            f"text-conditional model draws sample i from caption i, so {captions} samples are drawn and scored (FID "
            f"against those captions' own images). For more, point data.val (or the eval setting val=DIR) at "
            f"captioned held-out shards with at least {max(capped.values())} samples; set "
            f"{' and '.join(f'{name}={captions}' for name in capped)} to ask for what there is",
            flush=True,
        )

    @staticmethod
    def _check_counts(fid_on: bool, fid_count: int, rep_on: bool, rep_count: int, world: int) -> None:
        """Decided alike on every rank, before any collective: each rank generates num_samples / world images."""
        for name, enabled, count in (
            ("fid.num_samples", fid_on, fid_count),
            ("replication.num_samples", rep_on, rep_count),
        ):
            if enabled and count < world:
                raise ValueError(
                    f"eval config: {name}={count} is fewer than the {world} ranks evaluating (each "
                    f"rank generates num_samples / world images); use at least {world}"
                )

    def _held_out_folder(self, why: str) -> str:
        """The held-out shards (the eval setting val, else data.val); none is an error saying `why` they are needed."""
        folder = self.cfg.val or first_path(self.run_cfg.data.val, "data.val")
        if not folder:
            raise ValueError(
                f"run {self.run_cfg.name}: {why}, and data.val is empty; set data.val=DIR or the eval setting val=DIR"
            )
        return folder

    def _held_out_captions(self, count: int) -> list[str]:
        """The first `count` captions of the held-out shards in index order, read by rank 0 and handed
        to every rank (each rank samples from its share of them); read once a run, not each evaluation.
        Held-out latents bucketed by aspect ratio are not in their images' order (`aligned_held_out`): the
        captions are then those of the first `count` images of fid.reference, in its order."""
        folder = self._held_out_folder(SAMPLED_FROM_CAPTIONS)
        reference = self._aligning_reference(folder)
        if self._captions_read != (folder, reference, count):
            if reference:
                self._captions, self._caption_ids = decided_on_rank0(lambda: aligned_held_out(folder, reference, count))
            else:
                self._captions, self._caption_ids = decided_on_rank0(lambda: read_captions(folder, count)), None
            self._captions_read = (folder, reference, count)
        return self._captions

    def _aligning_reference(self, folder: str) -> str:
        """fid.reference where the held-out shards are latents bucketed by aspect ratio and it names image
        shards (those the latents were encoded from); "" otherwise (the held-out order is the images')."""
        reference = self.cfg.fid.reference
        if reference in ("train", "val") or not os.path.exists(index_file(reference or "-")):
            return ""
        if "buckets" not in index_metadata(folder) or "latent_shape" in index_metadata(reference):
            return ""
        return reference

    def _held_out_features(self, task, count: int, rank: int, world: int) -> list:
        """The precomputed text features of held-out captions rank, rank + world, ... < count (None at
        the other ranks' places): each rank reads only what it samples from (T5 features are ~250 KB a caption)."""
        # a rank that cannot read its share stops every rank, not only itself
        folder = self._held_out_folder(SAMPLED_FROM_CAPTIONS)
        ids = self._caption_ids or range(count)  # caption i's held-out sample
        wanted = [ids[i] for i in range(rank, count, world)]
        found = on_every_rank(lambda: read_text_features(folder, wanted, *task.text.features))
        return [found.get(ids[i]) for i in range(count)]

    def _clip_metric(self):
        """torchmetrics' CLIPScore on eval.clip_score.model, loaded once per run by every rank from its
        node's disk (a node without the folder stops every rank); reset for each evaluation."""
        if self._clip is None:
            from prunepipe.pipelines.evaluation.clip_score import clip_score_metric

            path, device = self.cfg.clip_score.model, self.device or "cpu"
            self._clip = on_every_rank(lambda: clip_score_metric(path, device))
        self._clip.reset()
        return self._clip

    def _replication_of(self, generated: torch.Tensor, count: int, rank: int, world: int) -> dict:
        """Replication numbers of this rank's samples (indices rank, rank + world, ... < count: the
        replication.num_samples drawn, fewer for a text run with fewer held-out captions) against train."""
        from prunepipe.pipelines.evaluation.replication import measure_replication

        rep, data = self.cfg.replication, self.run_cfg.data
        train = rep.train or first_path(data.train)
        held_out = rep.held_out or self._held_out_folder(
            "replication needs held-out image shards as its baseline (or replication.held_out=DIR)"
        )
        feature, feature_name = self._replication_feature(train)
        self._replication = measure_replication(
            generated,
            train,
            held_out,
            feature=feature,
            sample_ids=np.arange(rank, count, world),
            max_train=rep.max_train,
            held_out_samples=rep.held_out_samples,
            neighbours=rep.neighbours,
            threshold=rep.threshold,
            pixel_size=rep.pixel_size,
            batch_size=self.cfg.batch_size,
            picture_pairs=rep.picture_pairs,
        )
        return {**self._replication.details(), "replication_feature": feature_name}

    def _replication_feature(self, train: str):
        """(feature function or None, its name) for `replication.feature`, loaded once per run."""
        rep = self.cfg.replication
        if not rep.feature:
            return None, "pixels only"
        if self._replication_net is None:
            try:
                net = load_feature_net(FIDConfig(feature=rep.feature, weights=rep.weights), train)
            except (FileNotFoundError, ValueError, TypeError) as e:
                raise type(e)(
                    f"eval config: replication.feature={rep.feature!r} replication.weights={rep.weights!r} "
                    f"(loaded as fid.feature / fid.weights would be): {e}"
                ) from e
            self._replication_net = net
        net, device = self._replication_net, self.device or torch.device("cpu")
        module = net.feature.to(device)
        return (lambda images: module(images.to(device))), net.identity

    def _fid_evaluator(self, size: int, channels: int, captioned: int = 0) -> FIDEvaluator:
        """FID against fid.reference, or with `captioned` > 0 (a text-conditional run's samples of the
        first `captioned` held-out captions) against those captions' own images."""
        if self._fid is None:
            data, fid_cfg = self.run_cfg.data, self.cfg.fid
            if captioned:
                folder = self._captioned_images()
                fid_cfg = dataclasses.replace(fid_cfg, reference_samples=captioned)
            else:
                sources = {"train": first_path(data.train), "val": first_path(data.val, "data.val")}
                folder = sources.get(fid_cfg.reference, fid_cfg.reference)
            if not folder:
                raise ValueError(
                    f"eval config: fid.reference={fid_cfg.reference!r} names no shards (data.val is empty)"
                )
            if "latent_shape" in index_metadata(folder):
                raise ValueError(
                    f"eval config: fid.reference={fid_cfg.reference!r} ({folder}) holds latents; FID needs "
                    f"real images: set fid.reference to the image shards the latents were encoded from"
                )
            self._fid = FIDEvaluator.from_config(
                fid_cfg, folder, resolution=size, channels=channels, device=self.device or "cpu"
            )
        return self._fid

    def _captioned_images(self) -> str:
        """The image shards of the held-out captions: the held-out shards themselves, or where they hold
        latents, fid.reference naming the image shards they were encoded from (in the same order)."""
        folder, reference = self._held_out_folder(SAMPLED_FROM_CAPTIONS), self.cfg.fid.reference
        if "latent_shape" in index_metadata(folder):
            if reference in ("train", "val"):
                raise ValueError(
                    f"eval config: the held-out shards {folder} hold latents; FID of a text-conditional "
                    f"run compares with its captions' images: set fid.reference to the image shards "
                    f"those latents were encoded from (in the same order)"
                )
            return reference
        return folder

    # ------------------------------------------------------------------ entry point
    def after_pass(self, task: Task, model: nn.Module, summary: dict, num_passes: int) -> dict:
        """`evaluate` at the end of the pass `summary` records, the record saying where in the run it is."""
        at = {key: summary[key] for key in ("pass_index", "optimizer_steps", "samples_forwarded", "wall_seconds")}
        at["pass"] = f"after {pass_label(summary['pass_index'], num_passes)}"
        return self.evaluate(task, model, at=at)

    def evaluate(self, task: Task, model: nn.Module, *, at: dict | None = None, write: bool = True) -> dict:
        """Metrics of `model` (the weights to evaluate: see `weights_for_eval`) at `eval.precision`.
        Every rank calls this and evaluates its share; every rank returns the same record, which rank
        0 writes to eval/step_XXXXXX.json."""
        rank, world = rank_and_world()
        skipped = self.prepare()
        if self.cfg.replication.enabled and self.run_cfg.task != "ldm":
            raise ValueError(
                f"eval config: replication.enabled measures copies among diffusion samples; run "
                f"{self.run_cfg.name} is a {self.run_cfg.task} run (set replication.enabled=false)"
            )
        self._replication = None
        bare = unwrap(model)
        if self.device is None:
            self.device = next(bare.parameters()).device
        start = time.perf_counter()
        at = dict(at or {})
        with without_autocast_wrappers(bare):  # a bf16 run's prepared model would autocast every forward
            if self.run_cfg.task == "mae":
                details = self._mae(task, bare, rank, world)
            else:
                details = self._diffusion(task, bare, rank, world)
        details.update(skipped)
        metrics = {k: v for k, v in details.items() if k in PRIMARY_METRICS}
        record = {
            "kind": "eval",
            "run": self.run_cfg.name,
            "task": self.run_cfg.task,
            **at,
            "weights": self.cfg.weights,
            "precision": self.cfg.precision,
            "ranks": world,
            "metrics": metrics,
            "details": details,
            "eval_seconds": time.perf_counter() - start,
            "eval_config": dataclasses.asdict(self.cfg),
        }
        if write and rank == 0:
            if self._replication is not None:
                picture = save_pairs_picture(self._replication, record_path(self.run_dir, record, "_replication.png"))
                if picture:
                    details["replication_picture"] = picture
            record["path"] = write_record(self.run_dir, record)
        return record


def aligned_held_out(held_out: str, reference: str, count: int) -> tuple[list[str], list[int]]:
    """(captions, held-out ids) of the first `count` images of `reference`, in its order, found by key in
    `held_out`. Latents encoded into aspect-ratio buckets (`latents encode --buckets`) are not in their
    images' order: each input shard's samples are grouped by bucket, so the first `count` held-out
    captions are not those of the first `count` reference images that FID compares their samples with.
    Sample i is drawn from reference image i's caption instead; the latent shards are read up to the
    last of those keys (the order changes within an input shard only). A reference image with no latent
    (left out when encoding) stops the evaluation, naming it."""
    keys: list[str] = []
    index = ShardIndex.load(reference)
    for shard, url in enumerate(index.urls):
        for key, _ in read_keys(url, expected=index.expected(shard)):  # tar headers only: no image is read
            if len(keys) == count:
                break
            keys.append(key)
        if len(keys) == count:
            break
    place = {key: i for i, key in enumerate(keys)}
    captions, ids = [""] * len(keys), [-1] * len(keys)
    found, held = 0, ShardIndex.load(held_out)
    for shard, url in enumerate(held.urls):
        first = int(held.first_ids[shard])
        for position, sample in read_shard(url, expected=held.expected(shard)):
            i = place.get(sample["__key__"])
            if i is not None and ids[i] < 0:
                captions[i], ids[i] = caption(sample), first + position
                found += 1
        if found == len(keys):
            break
    if found < len(keys):
        missing = [key for key, i in place.items() if ids[i] < 0]
        raise ValueError(
            f"eval: the held-out latents {held_out} are bucketed by aspect ratio, so sample i is drawn from "
            f"the caption of fid.reference's image i ({reference}); {len(missing)} of its first {len(keys)} "
            f"images have no latent there (key {missing[0]!r}): set fid.reference to the image shards these "
            f"latents were encoded from"
        )
    return captions, ids


def _chain(first, rest):
    yield first
    yield from rest


def _keeping(batches, kept: list, count: int):
    """`batches` passed on unchanged, their first `count` images appended to `kept` (on the CPU)."""
    held = sum(len(x) for x in kept)
    for images in batches:
        if held < count:
            kept.append(images[: count - held].cpu())
            held += len(kept[-1])
        yield images


def check_text_identity(checkpoint: str, trained_on: str, task, held_out: str) -> None:
    """A text run is evaluated with the encoder it trained with (`trained_on`, its checkpoint's record):
    the task's, and for precomputed features the held-out shards' too (an eval setting val=DIR may
    name shards the run config never saw). A model fed another encoder's features scores nothing."""
    if not trained_on:
        return
    found = {"the task's text encoder": task.text.identity if task.text is not None else ""}
    if task.text is not None and task.text.precomputed and held_out:
        found[f"the held-out shards {held_out}"] = stored_identity(index_metadata(held_out))
    for what, identity in found.items():
        if identity != trained_on:
            raise ValueError(
                f"{checkpoint}: the run trained with text encoder {trained_on}, but {what} is "
                f"{identity or 'none'}: evaluate on shards encoded with the run's --text-encoder and "
                f"--text-max-length"
            )


class EvalRecordExistsError(FileExistsError, ValueError):
    """An eval record is already there and was not to be replaced (a ValueError too: the CLI prints
    such errors as one line)."""


def refuse_to_overwrite(run_dir: str, optimizer_steps: int, weights: str) -> None:
    """EvalRecordExistsError naming the eval record of `weights` at `optimizer_steps` when one is there
    already, with what it measured and how to replace it."""
    path = record_path(run_dir, {"optimizer_steps": optimizer_steps, "weights": weights})
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            earlier = json.load(f)
        what = (
            f" (the {earlier.get('weights', weights)} weights at {earlier.get('precision', '?')}: "
            f"{', '.join(f'{k} {v:.4g}' for k, v in earlier.get('metrics', {}).items())})"
        )
    except (OSError, ValueError, TypeError):
        what = ""
    raise EvalRecordExistsError(
        f"{path} already holds an evaluation of this checkpoint{what}; `prunepipe eval` does "
        f"not replace it: add --overwrite to replace it, or move the file away to keep it"
    )
