"""Settings of the evaluators (`prunepipe eval`, periodic evaluation): dataclasses loaded like the run
config, by the one loader (pipelines/config_schema.py: `base:` files, overrides, one error format).
Imports nothing else of the project, so the run config can embed `EvalConfig` as its `eval:` section
without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, get_args

from prunepipe.pipelines.config_schema import check_choices, check_ranges, load_structured, not_accepted

Precision = Literal["fp32", "bf16"]
PRECISIONS = get_args(Precision)
MODULE_FEATURE = "module:package.module:factory"  # a feature net of one's own: factory(weights) -> nn.Module
FID_FEATURES = ("inception", "classifier")  # or MODULE_FEATURE
# Inception is not offered: its pool features judge what an image shows, not whether it is a copy
REPLICATION_FEATURES = ("", "classifier")  # or MODULE_FEATURE


@dataclass
class FIDConfig:
    """FID of DDIM samples of the (EMA) UNet against reference statistics of real images."""

    enabled: bool = True
    num_samples: int = 1000  # generated images, over all ranks (published numbers use 50,000)
    sampler_steps: int = 50  # DDIM steps, eta = 0 (flow: Euler steps)
    guidance_scale: float = 1.0  # classifier-free guidance of class- and text-conditional models; 1 = none
    batch_size: int = 64  # images per generation and feature batch, per rank
    # inception: Inception-v3 (torch-fidelity's port of the TF FID graph) from `weights`;
    # classifier: a small-domain classifier written by `python -m prunepipe.tools.commands.feature_net` (not
    # comparable to Inception FID); module:pkg.mod:factory: factory(weights) -> nn.Module mapping
    # float images in [0, 1] to [N, D] features
    feature: str = "inception"
    weights: str = ""  # the feature network's file; "" = its default place (docs/evaluation.md)
    inception_dim: Literal[64, 192, 768, 2048] = 2048
    resize: Literal["tf1", "antialias"] = (
        "tf1"  # to 299 px: tf1 (as TF FID and torch-fidelity, published numbers) | antialias
    )
    # train | val (the run's shards) | a folder of image shards. Text-conditional runs compare with the
    # held-out images of the captions they sampled: the val shards, or this folder when it names the
    # image shards (in the same order) that latent val shards were encoded from
    reference: str = "train"
    reference_samples: int = 50000  # real images in the reference statistics (0 = all)
    stats_dir: str = ""  # reference-statistics cache; "" = fid_stats/ beside the reference shards
    vae: str = ""  # runs on precomputed latents: the VAE that encoded them ("" = the latent index's)
    vae_subfolder: str = ""


@dataclass
class ProbeConfig:
    """Linear probe of the MAE encoder: logistic regression on frozen features, accuracy on val."""

    enabled: bool = True
    pool: Literal["token", "avg"] = (
        "token"  # token: the class token (MAE's protocol, timm's export) | avg: mean of the patch tokens
    )
    train_samples: int = 20000  # labelled train images read, in index order (0 = all)
    # > 0: a few-shot probe fitted on the first `per_class` of them of each class. On easy domains
    # (digits) random encoder features are already ~90% linearly separable with all labels; 10 per
    # class leaves room to see pretraining (docs/evaluation.md has the measurements)
    per_class: int = 0
    C: float = 1.0  # inverse L2 strength of sklearn's LogisticRegression
    max_iter: int = 2000


@dataclass
class ReplicationConfig:
    """Replication (memorisation) of diffusion samples: how close they come to their nearest train
    images, against held-out images as the baseline (pipelines/evaluation/replication.py). Off by default."""

    enabled: bool = False
    # generated samples, over all ranks; drawn like FID's (fid.sampler_steps, fid.guidance_scale, seed),
    # and FID's own first samples when FID runs and draws at least this many
    num_samples: int = 1000
    max_train: int = 10000  # train images searched, the first in index order (0 = all)
    held_out_samples: int = 1000  # held-out images of the baseline, the first in index order (0 = all)
    neighbours: int = 50  # k of the ratio d_1 / mean(d_1..d_k) (Carlini et al.'s n = 50)
    threshold: float = 0.2  # flagged as a copy when that ratio is at most this
    pixel_size: int = 64  # the pixel search works at this side at most (area-downsampled)
    # "": pixels only; classifier: the small-domain classifier (as fid.feature=classifier); or
    # module:package.module:factory, factory(weights) -> nn.Module mapping float [0, 1] images to [N, D]
    # (a copy detector such as SSCD, or DINO, from a local file)
    feature: str = ""
    weights: str = ""  # the feature network's file; "" = its default place
    train: str = ""  # "" = the run's data.train; runs on latents name the image shards they were encoded from
    held_out: str = ""  # "" = eval.val, else data.val; image shards the model never trained on
    picture_pairs: int = 32  # flagged pairs drawn side by side beside the eval record (0 = no picture)


@dataclass
class ClipScoreConfig:
    """CLIPScore (torchmetrics) of a text-conditional run's samples against the captions they were
    drawn from: the FID samples (fid.num_samples, fid.sampler_steps, fid.guidance_scale)."""

    # a local folder of a transformers CLIPModel and its processor (`hf download openai/clip-vit-large-patch14`
    # on a connected machine); "" = off. Read with local_files_only: nothing is downloaded
    model: str = ""


@dataclass
class PreviewConfig:
    """Pictures while training (pipelines/training/previews.py): every `every_steps` optimizer steps a fixed
    grid into RUN/previews/step_XXXXXX.png and the trackers, and a fixed-timestep validation loss on held-out
    samples. Diffusion draws `classes` (class-conditional), `prompts` (text-to-image) or `num_images`
    unconditional samples; MAE shows `num_images` held-out images as original | masked | reconstruction.
    The noise, masks and samples are fixed by `seed`, so a picture changes only with the weights. Off by default."""

    every_steps: int = 0  # optimizer steps between previews (0 = off)
    # class-conditional: one image per entry ([] = classes 0, 1, .. of the first num_images, cycling)
    classes: List[int] = field(default_factory=list)
    # text-to-image: one image per prompt ([] = the first num_images held-out captions; on precomputed text
    # features their stored features, else prompts are encoded by the encoder that wrote the features)
    prompts: List[str] = field(default_factory=list)
    num_images: int = 8  # images when neither list is given (MAE: held-out images, three columns each)
    seed: int = 0  # the start noise of image i, MAE's masks: (seed, i) alone
    guidance_scale: float = 4.0  # classifier-free guidance of class- and text-conditional models; unconditional: none
    num_steps: int = 25  # sampler steps (DDIM, eta 0; flow: Euler)
    # held-out samples of the validation loss (the task's held-out loss at its fixed timesteps or masks
    # and fixed noise), the first in index order of eval.val or data.val; 0 = no validation loss
    val_samples: int = 64


@dataclass
class EvalConfig:
    every_passes: int = 0  # evaluate during training every E passes (0 = only `prunepipe eval`)
    weights: Literal["ema", "raw"] = "ema"  # which weights of a checkpoint are evaluated
    # Masks, noise and sample seeds: fixed and independent of the run's seed, so runs with
    # different seeds are measured on the very same inputs.
    seed: int = 0
    val: str = ""  # held-out shards to evaluate on; "" = the run's data.val (e.g. val_mix of redundant shards)
    val_samples: int = 10000  # held-out images for reconstruction / denoising loss (0 = all)
    batch_size: int = 64
    # fp32: an evaluation is the judge, the same numbers whatever precision the run trained in;
    # bf16: the evaluated model's forwards under bf16 autocast, in training and in `prunepipe eval`
    # alike. Written into every eval record; `prunepipe compare` refuses to mix the two.
    precision: Precision = "fp32"
    fid: FIDConfig = field(default_factory=FIDConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    clip_score: ClipScoreConfig = field(default_factory=ClipScoreConfig)
    preview: PreviewConfig = field(default_factory=PreviewConfig)  # training only: `prunepipe eval` ignores it


# every_passes, counts and sizes: a count of 0 means all where its comment says so
RANGES = {
    "every_passes": ">= 0",
    "batch_size": ">= 1",
    "val_samples": ">= 0",
    "fid.num_samples": ">= 2",
    "fid.sampler_steps": ">= 1",
    "fid.batch_size": ">= 1",
    "fid.reference_samples": ">= 0",
    "probe.train_samples": ">= 0",
    "probe.per_class": ">= 0",
    "probe.C": "> 0",
    "replication.num_samples": ">= 1",
    "replication.max_train": ">= 0",
    "replication.held_out_samples": ">= 0",
    "replication.neighbours": ">= 2",
    "replication.threshold": ("(0, 1)", "a ratio of distances"),
    "replication.pixel_size": ">= 1",
    "replication.picture_pairs": ">= 0",
    "preview.every_steps": (">= 0", "0 = no previews"),
    "preview.num_images": ">= 1",
    "preview.num_steps": ">= 1",
    "preview.guidance_scale": ">= 0",
    "preview.val_samples": (">= 0", "0 = no validation loss"),
}


def load_eval_config(base: EvalConfig | None = None, path: str | None = None, overrides: list[str] = ()) -> EvalConfig:
    """`base` (e.g. a run config's `eval:` section) <- YAML file (and its `base:` files) <- `key=value`
    overrides, validated; as the run config is loaded."""
    cfg: EvalConfig = load_structured(base if base is not None else EvalConfig, path, overrides)
    validate_eval_config(cfg)
    return cfg


def _names_a_feature(value: str, accepted: tuple[str, ...]) -> bool:
    """One of `accepted`, or module:package.module:factory."""
    return value in accepted or (value.startswith("module:") and value.count(":") == 2)


def validate_eval_config(cfg: EvalConfig, prefix: str = "") -> None:
    """Values the type system cannot check; `prefix` is where the section sits (`eval.` in a run config)."""
    check_choices(cfg, prefix)
    for key, value, accepted in (
        ("fid.feature", cfg.fid.feature, FID_FEATURES),
        ("replication.feature", cfg.replication.feature, REPLICATION_FEATURES),
    ):
        if not _names_a_feature(value, accepted):
            raise not_accepted(prefix + key, value, (*accepted, MODULE_FEATURE))
    check_ranges(cfg, RANGES, prefix)
