"""What an evaluation needs, checked before it starts (`prunepipe eval`, and a run's periodic evaluation
when the loop builds it): every missing piece said in one message; FID's reference read from the latent
index that records the image shards it was encoded from; and a metric that cannot be computed here with
the default settings (FID without Inception weights, or without the images behind latents) left out with
its reason, as the linear probe is without labels, while the rest is written. A piece asked for by name
(fid.weights=FILE, a fid.reference folder, clip_score.model) that is not there stops the evaluation
instead. Reads config and index files only: no model, no torch until FID's weights are looked for.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from prunepipe.pipelines.data.mixture import first_path
from prunepipe.pipelines.data.shards import ShardIndex, index_file
from prunepipe.pipelines.evaluation.config import EvalConfig
from prunepipe.pipelines.tasks.diffusion.config import resolved_conditioning

CHECKPOINTS = "checkpoints"  # pipelines/checkpoint/store.py's folder, looked into without importing torch
SPLITS = ("train", "val")  # fid.reference's names for the run's own shards


class EvalNeedsError(FileNotFoundError, ValueError):
    """Pieces an evaluation needs are missing (a ValueError too: the CLI prints such errors as they are)."""


@dataclass
class EvalPlan:
    """The settings an evaluation runs with and what it leaves out: `cfg` with fid.reference naming the
    image shards found for it and fid.enabled false where FID is skipped; `skipped` the details' keys
    (`fid_skipped`) and their reasons."""

    cfg: EvalConfig
    skipped: dict = field(default_factory=dict)


def plan_evaluation(run_cfg, eval_cfg: EvalConfig, run_dir: str = "") -> EvalPlan:
    """The EvalPlan of evaluating a run of `run_cfg` with `eval_cfg`; with `run_dir`, its checkpoints are
    looked for too. Raises EvalNeedsError naming every missing piece at once."""
    missing: list[str] = []
    skipped: dict[str, str] = {}
    if run_dir and not _has_checkpoint(run_dir):
        missing.append(
            f"a checkpoint: {os.path.join(run_dir, CHECKPOINTS)} holds none yet (checkpoints are written every "
            f"checkpoint.every_steps and at the end of training)"
        )
    held_out = eval_cfg.val or first_path(run_cfg.data.val, "data.val")
    if not held_out:
        missing.append(
            f"held-out shards: data.val is empty and the eval setting val too (run {run_cfg.name}'s held-out "
            f"metrics read them); set val=DIR"
        )
    elif not os.path.exists(index_file(held_out)):
        missing.append(f"held-out shards: {held_out!r} holds no index.json (set val=DIR to a split folder)")
        held_out = ""
    cfg = eval_cfg
    if eval_cfg.replication.enabled and run_cfg.task != "ldm":
        missing.append(
            f"replication.enabled measures copies among diffusion samples; run {run_cfg.name} is a "
            f"{run_cfg.task} run (set replication.enabled=false)"
        )
    if run_cfg.task == "ldm":
        text = resolved_conditioning(run_cfg.ldm) == "text"
        clip = eval_cfg.clip_score.model
        if clip and not text:
            missing.append(
                f"eval.clip_score.model scores samples against the captions they were drawn from; run "
                f"{run_cfg.name} is not text-conditional (set clip_score.model=)"
            )
        elif clip and not os.path.isdir(os.path.expanduser(clip)):
            missing.append(f"eval.clip_score.model={clip!r}: no such folder (a local transformers CLIPModel)")
        if eval_cfg.fid.enabled:
            cfg = _plan_fid(run_cfg, eval_cfg, held_out if text else "", missing, skipped)
    if missing:
        listed = "\n".join(f"  - {piece}" for piece in missing)
        raise EvalNeedsError(
            f"eval of run {run_cfg.name}: {len(missing)} missing piece(s), none yet evaluated:\n{listed}"
        )
    return EvalPlan(cfg, skipped)


def _plan_fid(run_cfg, eval_cfg: EvalConfig, captions_at: str, missing: list, skipped: dict) -> EvalConfig:
    """eval_cfg with FID's reference image shards resolved, or FID off with `skipped["fid_skipped"]`; a
    piece named in the settings that is not there goes to `missing`. `captions_at`: a text run's held-out
    shards (its samples are drawn from their captions and compared with their images)."""
    fid = eval_cfg.fid
    reference, why_not, derived = _fid_reference(run_cfg, fid.reference, captions_at, missing)
    if fid.feature == "inception":  # read from its file wherever the reference is
        from prunepipe.pipelines.evaluation.fid import inception_weights, missing_inception

        path = inception_weights(fid)
        if not os.path.isfile(path):
            if fid.weights:
                missing.append(missing_inception(fid, path))
            else:
                why_not = why_not or missing_inception(fid, path)
    elif fid.feature == "classifier" and (reference or fid.weights):  # by default beside the reference shards
        from prunepipe.pipelines.evaluation.fid import classifier_weights, missing_classifier, shards_root_of

        root = shards_root_of(reference) if reference else ""
        path = classifier_weights(fid, root)
        if not os.path.isfile(path):
            missing.append(missing_classifier(fid, path, root))
    # a module of one's own (module:pkg.mod:factory) reads what it reads when it is built
    if why_not:
        skipped["fid_skipped"] = why_not
        return dataclasses.replace(eval_cfg, fid=dataclasses.replace(fid, enabled=False))
    if derived:  # the images behind latents, as the eval record then states
        return dataclasses.replace(eval_cfg, fid=dataclasses.replace(fid, reference=reference))
    return eval_cfg


def _fid_reference(run_cfg, setting: str, captions_at: str, missing: list) -> tuple[str, str, bool]:
    """(the image shards FID compares with, "", whether they were found from a latent index) or ("", why
    FID is skipped, False); all empty when a piece named in the settings is missing (appended to `missing`). A text run compares with its held-out captions'
    images: `captions_at` itself, or where it holds latents, fid.reference naming image shards, else the
    images its index.json records (`source`). Other runs: fid.reference, train or val naming the run's
    own shards, and where those hold latents the images their index records."""
    named = setting not in SPLITS
    if named and not os.path.exists(index_file(setting)):
        missing.append(f"fid.reference={setting!r}: no index.json there (image shards, or train / val)")
        return "", "", False
    if named and _holds_latents(setting):
        missing.append(
            f"fid.reference={setting!r} holds latents; FID needs real images: set fid.reference to the image "
            f"shards the latents were encoded from"
        )
        return "", "", False
    if captions_at:
        if not _holds_latents(captions_at):
            return captions_at, "", False
        return (setting, "", False) if named else _encoded_from(captions_at, "the held-out latents")
    if named:
        return setting, "", False
    folder = first_path(getattr(run_cfg.data, setting), f"data.{setting}")
    if not folder:
        missing.append(f"fid.reference={setting}: data.{setting} is empty; set fid.reference=DIR to image shards")
        return "", "", False
    if not os.path.exists(index_file(folder)):
        return "", "", False  # the data check names a missing split
    return _encoded_from(folder, f"data.{setting}") if _holds_latents(folder) else (folder, "", False)


def _encoded_from(latents: str, what: str) -> tuple[str, str, bool]:
    """(the image shards the latent shards at `latents` were encoded from, "", True) as their index.json
    records them (`latents encode` writes `source`), or ("", why FID is skipped, False)."""
    source = ShardIndex.load(latents).meta.get("source") or ""
    if source and os.path.exists(index_file(source)):
        return source, "", True
    where = f"records {source!r}, which is not on this machine" if source else "records no image shards"
    return (
        "",
        f"FID compares samples with real images, and {what} {latents} hold latents whose index.json {where}: "
        f"set fid.reference to the image shards they were encoded from (in the same order)",
        False,
    )


def _holds_latents(folder: str) -> bool:
    return "latent_shape" in ShardIndex.load(folder).meta


def _has_checkpoint(run_dir: str) -> bool:
    folder = os.path.join(run_dir, CHECKPOINTS)
    return os.path.isdir(folder) and any(name.startswith("step_") for name in os.listdir(folder))
