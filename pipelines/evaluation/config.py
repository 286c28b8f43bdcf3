"""Settings of the evaluators (`prunepipe eval`, periodic evaluation): plain dataclasses with
OmegaConf overrides, like the run config. Imports nothing else of the project, so the run config
can embed `EvalConfig` as its `eval:` section without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

FID_FEATURES = ("inception", "classifier")  # or "module:package.module:factory"
# Inception is not offered: its pool features judge what an image shows, not whether it is a copy
REPLICATION_FEATURES = ("", "classifier")  # or "module:package.module:factory"
INCEPTION_DIMS = (64, 192, 768, 2048)
INCEPTION_RESIZE = ("tf1", "antialias")
WEIGHTS = ("ema", "raw")
PROBE_POOLS = ("token", "avg")
PRECISIONS = ("fp32", "bf16")


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
    inception_dim: int = 2048  # 64 | 192 | 768 | 2048
    resize: str = "tf1"  # to 299 px: tf1 (as TF FID and torch-fidelity, published numbers) | antialias
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
    pool: str = "token"  # token: the class token (MAE's protocol, timm's export) | avg: mean of the patch tokens
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
class EvalConfig:
    every_passes: int = 0  # evaluate during training every E passes (0 = only `prunepipe eval`)
    weights: str = "ema"  # ema | raw: which weights of a checkpoint are evaluated
    # Masks, noise and sample seeds: fixed and independent of the run's seed, so runs with
    # different seeds are measured on the very same inputs.
    seed: int = 0
    val: str = ""  # held-out shards to evaluate on; "" = the run's data.val (e.g. val_mix of redundant shards)
    val_samples: int = 10000  # held-out images for reconstruction / denoising loss (0 = all)
    batch_size: int = 64
    # fp32: an evaluation is the judge, the same numbers whatever precision the run trained in;
    # bf16: the evaluated model's forwards under bf16 autocast, in training and in `prunepipe eval`
    # alike. Written into every eval record; `prunepipe compare` refuses to mix the two.
    precision: str = "fp32"
    fid: FIDConfig = field(default_factory=FIDConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    clip_score: ClipScoreConfig = field(default_factory=ClipScoreConfig)


def load_eval_config(base: EvalConfig | None = None, path: str | None = None, overrides: list[str] = ()) -> EvalConfig:
    """`base` (e.g. a run config's `eval:` section) <- YAML file <- `key=value` overrides, validated."""
    try:
        merged = OmegaConf.structured(base if base is not None else EvalConfig)
        if path is not None:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"eval overrides must look like key=value (e.g. fid.num_samples=5000), got {bad[0]!r}")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg: EvalConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(f"eval config: {key}: {str(e).splitlines()[0]}") from None
    validate_eval_config(cfg)
    return cfg


def _names_a_feature(value: str, accepted: tuple[str, ...]) -> bool:
    """One of `accepted`, or module:package.module:factory."""
    return value in accepted or (value.startswith("module:") and value.count(":") == 2)


def validate_eval_config(cfg: EvalConfig) -> None:
    """Values the type system cannot check; each message names the field and what it accepts."""

    def choice(name, value, accepted):
        if value not in accepted:
            raise ValueError(
                f"eval config: {name}={value!r} is not accepted; accepted: {', '.join(map(str, accepted))}"
            )

    choice("weights", cfg.weights, WEIGHTS)
    choice("precision", cfg.precision, PRECISIONS)
    choice("fid.inception_dim", cfg.fid.inception_dim, INCEPTION_DIMS)
    choice("fid.resize", cfg.fid.resize, INCEPTION_RESIZE)
    choice("probe.pool", cfg.probe.pool, PROBE_POOLS)
    if not _names_a_feature(cfg.fid.feature, FID_FEATURES):
        raise ValueError(
            f"eval config: fid.feature={cfg.fid.feature!r} is not accepted; accepted: "
            f"{', '.join(FID_FEATURES)}, module:package.module:factory"
        )
    rep = cfg.replication
    if not _names_a_feature(rep.feature, REPLICATION_FEATURES):
        raise ValueError(
            f"eval config: replication.feature={rep.feature!r} is not accepted; accepted: '' (pixels "
            f"only), classifier, module:package.module:factory"
        )
    if not 0 < rep.threshold < 1:
        raise ValueError(f"eval config: replication.threshold is a ratio of distances, in (0, 1); got {rep.threshold}")
    at_least = {
        "fid.num_samples": (cfg.fid.num_samples, 2),
        "fid.sampler_steps": (cfg.fid.sampler_steps, 1),
        "fid.batch_size": (cfg.fid.batch_size, 1),
        "batch_size": (cfg.batch_size, 1),
        "every_passes": (cfg.every_passes, 0),
        "val_samples": (cfg.val_samples, 0),
        "fid.reference_samples": (cfg.fid.reference_samples, 0),
        "probe.train_samples": (cfg.probe.train_samples, 0),
        "probe.per_class": (cfg.probe.per_class, 0),
        "replication.num_samples": (rep.num_samples, 1),
        "replication.max_train": (rep.max_train, 0),
        "replication.held_out_samples": (rep.held_out_samples, 0),
        "replication.neighbours": (rep.neighbours, 2),
        "replication.pixel_size": (rep.pixel_size, 1),
        "replication.picture_pairs": (rep.picture_pairs, 0),
    }
    for name, (value, low) in at_least.items():
        if value < low:
            raise ValueError(f"eval config: {name} must be >= {low}, got {value}")
    if cfg.probe.C <= 0:
        raise ValueError(f"eval config: probe.C must be > 0, got {cfg.probe.C}")
