"""The one config system: typed dataclasses, a YAML file, `key=value` overrides (OmegaConf), loaded
by the loader every section shares (pipelines/config_schema.py).

`load_config` checks the config itself and reads no data file, so a config can be checked away from
the cluster; `check_data` reads the data it names (each split's index.json, a group table, a CLIPScore
model's folder) at the start of a run. Every mistake becomes one `ConfigError` line naming the field and
what it accepts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal

from omegaconf import MISSING, OmegaConf

from prunepipe.pipelines.config_schema import (
    ConfigError,
    check_choices,
    check_ranges,
    load_structured,
    not_accepted,
)
from prunepipe.pipelines.data.description import DataDescription, SplitRecords
from prunepipe.pipelines.data.group_table import group_table_path
from prunepipe.pipelines.data.mixture import check_pass_length, first_path, parse_sources, source_paths
from prunepipe.pipelines.data.remote import ReadRetry, is_retried
from prunepipe.pipelines.data.shards import ShardIndex, index_file
from prunepipe.pipelines.data.workers import check_num_workers
from prunepipe.pipelines.evaluation.config import EvalConfig, validate_eval_config
from prunepipe.pipelines.tasks.diffusion.config import (
    DiffusionConfig,
    check_config,
    resolved_conditioning,
)
from prunepipe.pipelines.tasks.mae_config import MAEConfig

PRUNER_SIDE_DATA = ("groups",)  # pruner keys the loop reads as data, not hyper-parameters
# log_with: accelerate's trackers (accelerate.utils.LoggerType, less "all": a run names what it writes to);
# tensorboard is installed with the project, wandb with its `wandb` extra, the others by hand
TRACKERS = ("tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab", "aim")


@dataclass
class DataConfig:
    # a folder with index.json (or the index file), or a mixture: a list of sources {name, path, weight |
    # repeat | count}, ids laid end to end in the order listed (pipelines/data/mixture.py, docs/data.md)
    train: Any = MISSING
    # held-out shards: a folder, or a list of sources {name, path} each judged on its own as well; ""
    # (the override `data.val=`) = no held-out evaluation
    val: Any = ""
    samples_per_pass: int = 0  # a weighted mixture's pass length (0: every source's samples once)
    resolution: int = 32
    channels: int = 3
    batch_size: int = 32  # per rank and micro-batch
    num_workers: Any = "auto"  # loader workers per rank: an integer >= 0, or auto (pipelines/data/workers.py)
    shuffle_buffer: int = 1000
    hflip: bool = False  # mirror with probability 1/2, a coin of (seed, pass, id) of its own (docs/data.md)
    # random_resized: MAE's RandomResizedCrop, on the image before resizing (augment.py's CROPS)
    crop: Literal["center", "random_resized"] = "center"
    crop_scale: List[float] = field(default_factory=lambda: [0.2, 1.0])  # random_resized: share of the area
    on_bad_sample: Literal["stop", "skip"] = "stop"  # stream.py's BAD_SAMPLE_POLICIES
    # under skip: the run stops once more samples than this were lost to bad input (-1: no limit)
    max_bad_samples: int = 1000
    # remote shards (pipe:, http(s), s3, gs, hf): a failed read reopens the shard at the byte reached (pipelines/data/remote.py)
    remote: ReadRetry = field(default_factory=ReadRetry)
    val_batches: int = 8  # held-out batches per evaluation


@dataclass
class CudaConfig:
    """What users expect on CUDA (docs/gpu.md); each is ignored on a CPU run."""

    tf32: bool = True  # TF32 matmuls and convolutions (Ampere and newer): ~fp32 accuracy at tensor-core speed
    fused_adamw: bool = True  # AdamW's fused kernel: one launch per step instead of several per tensor
    channels_last: bool = True  # the UNet (task ldm) in channels_last memory format; MAE has no convs to speed up
    compile: bool = False  # torch.compile each block; off: untimed on a GPU, untried in the loop (docs/diffusion.md)


@dataclass
class ParallelConfig:
    """How the model is spread over the ranks (pipelines/training/parallel.py, docs/multinode.md)."""

    # ddp: every rank holds the whole model (26 bytes a parameter) | fsdp: parameters, gradients, AdamW and EMA
    # sharded over every rank (FSDP2) | hsdp: sharded within a group of ranks, the groups replicated
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    replicas: int = 0  # hsdp: how many copies (each sharded over world / replicas ranks); 0 = one per node
    reshard_after_forward: bool = True  # fsdp: free each block's gathered weights after its forward (less memory)
    # recompute each block's activations in backward instead of keeping them: none | full | N (every Nth block)
    activation_checkpointing: Any = "none"


@dataclass
class OptimConfig:
    lr: float = 1e-3  # the peak rate; unused when blr > 0
    blr: float = 0.0  # > 0: peak rate = blr x effective batch / 256, MAE's rule (world x batch_size x grad_accum)
    weight_decay: float = 0.05
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    # after the warmup: cosine (to min_lr by the last pass) | constant (DiT's)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_passes: float = 1.0  # linear warmup, in passes (pass progress, docs/design.md, principle 6)
    min_lr: float = 0.0  # cosine decays to this by the last pass
    grad_clip: float = 1.0  # 0 = off
    grad_accum: int = 1  # micro-batches per optimizer step


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # optimizer steps between checkpoints; the run's end always saves
    keep: int = 3  # newest complete checkpoints kept
    resume: str = ""  # "" | latest | path of a checkpoint folder


@dataclass
class InitConfig:
    """A new run started from another run's weights (a stage: 256 px, then 512 from its weights, as
    PixArt-alpha trains): the live weights and the EMA are loaded, nothing else; the optimizer, the
    schedule, the pruner's scores and the data position are the new run's (pipelines/training/init_weights.py).
    The key is `init.weights`, not `init.from`: `from` is a Python keyword and cannot be a dataclass field
    that OmegaConf maps; what it names is where the weights come from."""

    weights: str = ""  # "" (a fresh model) | a RUN folder (its newest intact checkpoint) | a CHECKPOINT | an EXPORT
    strict: bool = True  # false: load the tensors that match, name the ones skipped, start those afresh


@dataclass
class ScoreConfig:
    """What the pruner is told about each sample (pruning/scores.py): its loss, or its loss made
    comparable within its stratum (ldm: the timestep bucket). The training loss is never changed."""

    # stratum_mean: loss / its bucket's running mean (pruning/scores.py's NORMALISATIONS)
    normalise: Literal["none", "stratum_mean", "stratum_zscore"] = "none"
    buckets: int = 20  # equal-width strata buckets (ldm: of the T timesteps)
    momentum: float = 0.99  # per-sample momentum of the buckets' running statistics
    # a mixture's sources as strata too (beside the task's): each source's losses are normalised within
    # it, so that a source of larger losses does not leave the other below every mean threshold
    per_source: bool = False


@dataclass
class RunConfig:
    name: str = "run"
    runs_dir: str = "runs"
    task: Literal["mae", "ldm"] = "mae"
    seed: int = 0
    num_passes: int = 10
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    ema_decay: float = 0.999
    # passes: the decay warms up with pass progress | none: ema_decay from step 1 (DiT)
    ema_warmup: Literal["passes", "none"] = "passes"
    on_nonfinite_loss: Literal["stop", "skip"] = "stop"  # skipped steps are counted
    log_every: int = 10  # optimizer steps between metric lines
    max_steps: int = 0  # stop after this many optimizer steps (0 = run all passes)
    debug_sync: bool = False  # check each pass that all ranks hold the same plan; save ids per rank
    # CUDA only: raise at any device-to-host synchronisation inside a training step (from the run's
    # second step on; checkpoints and pass ends may wait). on_nonfinite_loss=skip waits by design.
    debug_device_sync: bool = False
    # How long a collective may wait for the slowest rank before the job fails (the process group's
    # timeout; torch's NCCL default is 10 minutes). Long enough for rank 0's checkpoint writes, short
    # enough that a hung job frees its nodes.
    dist_timeout_seconds: int = 1800
    # where scalars, previews and the run's config go besides metrics.jsonl (which the report reads): accelerate's
    # trackers (TRACKERS), started on rank 0; tensorboard writes RUN/tensorboard/, wandb RUN/wandb/ ([] = none)
    log_with: List[str] = field(default_factory=lambda: ["tensorboard"])
    tracker_project: str = "prunepipe"  # the W&B project (and comet / mlflow experiment); TensorBoard's subfolder
    data: DataConfig = field(default_factory=DataConfig)
    # name, the pruner's hyper-parameters, and `groups` (dedup's group table: NAME for
    # groups/NAME.npy beside data.train's index, or a path; side data the loop reads, not a hyper-parameter)
    pruner: Dict[str, Any] = field(default_factory=lambda: {"name": "full"})
    score: ScoreConfig = field(default_factory=ScoreConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)  # another run's weights, unless the run resumes
    mae: MAEConfig = field(default_factory=MAEConfig)
    ldm: DiffusionConfig = field(default_factory=DiffusionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluators; eval.every_passes > 0 runs them in training

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.name)


def load_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    """Schema <- YAML file (after the files its `base:` names) <- `key=value` overrides, then validated.
    Reads no data file: `check_data` does, at the start of a run."""
    cfg: RunConfig = load_structured(RunConfig, path, overrides)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- the config itself
RANGES = {
    "num_passes": ">= 1",
    "log_every": ">= 1",
    "dist_timeout_seconds": ">= 1",
    "ema_decay": "[0, 1)",
    "data.batch_size": ">= 1",
    "data.resolution": ">= 1",
    "data.max_bad_samples": (">= -1", "-1 = no limit"),
    "optim.lr": "> 0",
    "optim.blr": (">= 0", "0 = use optim.lr"),
    "optim.grad_accum": ">= 1",
    "checkpoint.every_steps": ">= 1",
    "checkpoint.keep": ">= 1",
    "score.buckets": ">= 1",
    "score.momentum": "[0, 1)",
    "parallel.replicas": (">= 0", "0 = one per node"),
}


def validate(cfg: RunConfig) -> None:
    """Every check of the config itself (choices, ranges, settings that need each other); reads no file."""
    from prunepipe.pruning import PRUNERS, build_pruner

    check_choices(cfg)  # every Literal field, the ldm:, mae: and eval: sections' too
    try:
        cfg.data.num_workers = check_num_workers(cfg.data.num_workers)
        cfg.data.remote.check()
        parse_sources(cfg.data.val, "data.val", rules=False)
        check_pass_length(parse_sources(cfg.data.train), cfg.data.samples_per_pass)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    check_ranges(cfg, RANGES)
    scale = cfg.data.crop_scale
    if len(scale) != 2 or not 0.0 < scale[0] <= scale[1] <= 1.0:
        raise ConfigError(f"config: data.crop_scale={list(scale)} must be [low, high] with 0 < low <= high <= 1")
    if cfg.data.crop != "center" and cfg.task == "ldm" and cfg.ldm.space == "latents":
        raise ConfigError(
            f"config: data.crop={cfg.data.crop} crops images, but ldm.space=latents trains on "
            f"precomputed latents, which cannot be cropped; use data.crop=center"
        )
    if cfg.debug_device_sync and cfg.on_nonfinite_loss == "skip":
        raise ConfigError(
            "config: debug_device_sync=true forbids waiting on the device, but on_nonfinite_loss=skip "
            "reads each step's losses before backward; use on_nonfinite_loss=stop with it"
        )
    if cfg.score.per_source and cfg.score.normalise == "none":
        raise ConfigError(
            "config: score.per_source=true normalises each source's scores within it; choose how with "
            "score.normalise=stratum_mean or stratum_zscore"
        )
    _validate_init(cfg)
    _validate_parallel(cfg)
    if cfg.task == "ldm":
        _validate_conditioning(cfg)
    for tracker in cfg.log_with:
        if tracker not in TRACKERS:
            raise not_accepted("log_with", tracker, TRACKERS)
    _validate_previews(cfg)
    if cfg.eval.every_passes and not cfg.data.val:
        raise ConfigError(
            f"config: eval.every_passes={cfg.eval.every_passes} evaluates on held-out data, but data.val "
            f"is empty; set data.val=DIR or eval.every_passes=0"
        )
    validate_eval_config(cfg.eval, "eval.")
    name = cfg.pruner.get("name")
    if name not in PRUNERS:
        raise not_accepted("pruner.name", name, sorted(PRUNERS))
    try:
        build_pruner(name, 10, cfg.num_passes, seed=cfg.seed, **pruner_hparams(cfg.pruner))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config: pruner: {str(e).splitlines()[0]}") from None
    _validate_groups(cfg, name)


def _validate_init(cfg: RunConfig) -> None:
    """init.weights names another run's weights: this run's own are checkpoint.resume's. Whether the
    folder holds weights is checked where they are read (at the start of training): a stage's config
    is written before the stage it starts from has run."""
    weights = cfg.init.weights
    if not weights:
        return
    own = os.path.abspath(cfg.run_dir)
    if os.path.abspath(weights) == own or os.path.abspath(weights).startswith(own + os.sep):
        raise ConfigError(
            f"config: init.weights={weights!r} is inside this run's own folder {cfg.run_dir!r}; a run continues "
            f"from its own checkpoints with checkpoint.resume=latest, init.weights names another run"
        )


def _validate_parallel(cfg: RunConfig) -> None:
    """The sharded strategies' settings: what activation checkpointing accepts, bf16 rather than fp16 (FSDP2
    reduces in fp32 and keeps fp32 master weights: no loss scaler), no in-loop evaluators (they sample
    with rank-dependent counts; `prunepipe eval` judges a sharded run's checkpoint on one process)."""
    par = cfg.parallel
    try:
        par.activation_checkpointing = checkpointed_every(par.activation_checkpointing)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    if par.strategy == "ddp":
        return
    if cfg.mixed_precision == "fp16":
        raise ConfigError(
            f"config: parallel.strategy={par.strategy} trains in bf16 with fp32 reductions and master weights; "
            f"mixed_precision=fp16 needs a loss scaler it does not have: use mixed_precision=bf16 (or auto)"
        )


def checkpointed_every(setting) -> str | int:
    """parallel.activation_checkpointing in one spelling: none, full (every block), or N >= 2 (every Nth)."""
    if setting in ("none", 0, "0"):
        return "none"
    if setting in ("full", 1, "1"):
        return "full"
    try:
        every = int(setting)
    except (TypeError, ValueError):
        every = 0
    if every < 1:
        raise ValueError(
            f"parallel.activation_checkpointing={setting!r} is not accepted; accepted: none, full, or N >= 1 "
            f"(every Nth block)"
        )
    return "full" if every == 1 else every


def pruner_hparams(pruner: dict) -> dict:
    """The pruner section without its name and side data: what `build_pruner` takes."""
    return {k: v for k, v in pruner.items() if k not in ("name", *PRUNER_SIDE_DATA)}


def _validate_groups(cfg: RunConfig, name: str) -> None:
    """pruner.groups is dedup's, and dedup needs it, beside one shard folder (the table: `check_data`)."""
    groups = cfg.pruner.get("groups")
    if groups and name != "dedup":
        raise ConfigError(f"config: pruner.groups={groups!r} is read by pruner.name=dedup only, not {name}")
    if name == "dedup" and not groups:
        raise ConfigError(
            "config: pruner.name=dedup needs pruner.groups: a near-duplicate group table beside "
            "data.train (NAME for groups/NAME.npy there, or a path)"
        )
    if groups and len(source_paths(cfg.data.train)) > 1:
        raise ConfigError(
            f"config: pruner.groups={groups!r} reads one group table beside one shard folder; data.train is a "
            f"mixture of {len(source_paths(cfg.data.train))} sources (near-duplicate groups across sources: "
            f"write one folder, or group each source and train them apart)"
        )


def _validate_conditioning(cfg: RunConfig) -> None:
    """ldm.conditioning and what it needs: labels or text for guidance, a text encoder; held-out captions
    for the evaluators that sample a text-conditional model, and CLIPScore only where there are captions,
    refused here, not after the first pass."""
    conditioning = check_config(cfg.ldm)
    if cfg.eval.fid.guidance_scale != 1.0 and conditioning == "none":
        raise ConfigError(
            f"config: eval.fid.guidance_scale={cfg.eval.fid.guidance_scale} guides class- or "
            f"text-conditional models; ldm.conditioning is none (ldm.num_classes is 0): use 1.0"
        )
    clip = cfg.eval.clip_score.model
    if conditioning != "text":  # the encoder's folder is checked where it is loaded (pipelines/tasks/diffusion/text.py)
        if clip:
            raise ConfigError(
                f"config: eval.clip_score.model={clip!r} scores samples against the captions they "
                f"were drawn from; ldm.conditioning is {conditioning}: leave it empty"
            )
        return
    sampled = [
        name
        for name, on in (
            ("eval.fid", cfg.eval.fid.enabled),
            ("eval.replication", cfg.eval.replication.enabled),
            ("eval.clip_score", bool(clip)),
        )
        if on
    ]
    if cfg.eval.every_passes and sampled and not (cfg.eval.val or cfg.data.val):
        raise ConfigError(
            f"config: {' and '.join(sampled)} sample a text-conditional model from held-out captions "
            f"and data.val is empty: set data.val (or eval.val) to captioned held-out shards"
        )


def _validate_previews(cfg: RunConfig) -> None:
    """eval.preview against the task: classes for a class-conditional model, prompts for a text-conditional
    one, held-out shards for MAE's reconstructions, held-out captions and the validation loss."""
    preview = cfg.eval.preview
    if not preview.every_steps:
        return
    held_out = bool(cfg.eval.val or cfg.data.val)
    conditioning = resolved_conditioning(cfg.ldm) if cfg.task == "ldm" else "none"
    if preview.classes and conditioning != "class":
        raise ConfigError(
            f"config: eval.preview.classes={list(preview.classes)} draws classes of a class-conditional model; "
            f"this run is {'MAE' if cfg.task == 'mae' else f'ldm.conditioning={conditioning}'}: leave it empty"
        )
    bad = [c for c in preview.classes if not 0 <= c < cfg.ldm.num_classes]
    if bad:
        raise ConfigError(
            f"config: eval.preview.classes holds {bad[0]}; classes are 0 to ldm.num_classes-1 = {cfg.ldm.num_classes - 1}"
        )
    if preview.prompts and conditioning != "text":
        raise ConfigError(
            "config: eval.preview.prompts draws a text-conditional model; this run is "
            f"{'MAE' if cfg.task == 'mae' else f'ldm.conditioning={conditioning}'}: leave it empty"
        )
    why = ""
    if cfg.task == "mae":
        why = "MAE's preview reconstructs held-out images"
    elif conditioning == "text" and not preview.prompts:
        why = "with no eval.preview.prompts a text-conditional model is drawn from held-out captions"
    elif preview.val_samples:
        why = f"eval.preview.val_samples={preview.val_samples} computes a validation loss on held-out samples"
    if why and not held_out:
        raise ConfigError(
            f"config: eval.preview.every_steps={preview.every_steps}: {why}, and data.val is empty; set data.val=DIR"
            + (" or eval.preview.val_samples=0" if why.startswith("eval.preview.val_samples") else "")
        )


# ----------------------------------------------------------------------------- the data it names
def check_data(cfg: RunConfig, data: DataDescription | None = None) -> DataDescription:
    """The checks that read the data a (validated) config names: each split's index.json, the shards'
    latents and text features against the settings that need them, dedup's group table, remote shards'
    read deadline, the CLIPScore model's folder. Run at the start of a run (`train`) and by `prunepipe
    train` before it launches; `load_config` never reads these files. Errors begin `data check:`.
    Returns the data description checked: `data`, or every source's index.json read once here."""
    _check_indexes(cfg)
    if data is None:
        data = DataDescription.load(cfg.data)
    _check_buckets(cfg, data)
    _check_remote_deadline(cfg, data)
    _check_latent_augmentations(cfg, data)
    _check_group_table(cfg)
    if cfg.task == "ldm" and resolved_conditioning(cfg.ldm) == "text":
        if cfg.ldm.text.features == "precomputed":
            _check_precomputed_text(cfg, data)
        clip = cfg.eval.clip_score.model
        if cfg.eval.every_passes and clip and not os.path.isdir(os.path.expanduser(clip)):
            raise ConfigError(
                f"data check: eval.clip_score.model={clip!r}: no such folder (a local transformers CLIPModel "
                f"and its processor; nothing is downloaded)"
            )
    return data


def _check_buckets(cfg: RunConfig, data: DataDescription) -> None:
    """Shards bucketed by aspect ratio hold latents of their bucket's shape (`latents encode --buckets`):
    only a latent-diffusion run on precomputed latents reads them."""
    if cfg.task == "ldm" and cfg.ldm.space == "latents":
        return
    for setting, source, index in data.indexes():
        if "buckets" in index.meta:
            got = "task=mae" if cfg.task == "mae" else f"ldm.space={cfg.ldm.space}"
            raise ConfigError(
                f"data check: {setting}={source.path!r} holds latents bucketed by aspect ratio "
                f"(`latents encode --buckets`), which only ldm.space=latents reads; got {got}"
            )


def _check_indexes(cfg: RunConfig) -> None:
    """data.train and data.val: each source's folder holds its index.json."""
    for name in ("train", "val"):
        key = f"data.{name}"
        for i, source in enumerate(parse_sources(getattr(cfg.data, name), key, rules=name == "train")):
            if not os.path.exists(index_file(source.path)):
                where = key if isinstance(getattr(cfg.data, name), str) else f"{key}[{i}].path"
                raise ConfigError(
                    f"data check: {where}={source.path!r} holds no index.json; write shards with "
                    f"`prunepipe shards write --out DIR` (then {where}=DIR/{name}) or index yours with "
                    f"`prunepipe shards index`"
                )


def _check_remote_deadline(cfg: RunConfig, data: DataDescription) -> None:
    """A remote shard's retries end before a collective's timeout: while one loader retries, its rank
    reaches no collective, and the others would fail on the process group's timeout first, without
    the read's own message."""
    deadline = cfg.data.remote.deadline_seconds
    remote = any(any(map(is_retried, index.urls)) for _, _, index in data.indexes())  # pipe:, http(s), s3, gs, hf
    if deadline >= cfg.dist_timeout_seconds and remote:
        raise ConfigError(
            f"data check: data.remote.deadline_seconds={deadline:g} lets one shard read stall that long, not "
            f"less than dist_timeout_seconds={cfg.dist_timeout_seconds}: the other ranks would time out in "
            f"their next collective before the read failed with its own message; lower "
            f"data.remote.deadline_seconds or raise dist_timeout_seconds"
        )


def _check_group_table(cfg: RunConfig) -> None:
    """pruner.groups: the table exists where it points (beside data.train, or a path)."""
    groups = cfg.pruner.get("groups")
    train = first_path(cfg.data.train)
    if groups and train and os.path.exists(index_file(train)):
        path = group_table_path(str(groups), train)
        if not os.path.exists(path):
            raise ConfigError(f"data check: pruner.groups={groups!r}: no group table at {path}")


def _check_precomputed_text(cfg: RunConfig, data: DataDescription) -> None:
    """ldm.text.features=precomputed: the train shards record their text features, and held-out shards
    hold features of the same encoder (a held-out loss of other features measures nothing)."""
    from prunepipe.pipelines.tasks.diffusion.text import stored_identity  # torch: the data check's

    made_by = {}
    splits = [(setting, source.path, index) for setting, source, index in data.indexes()]
    if cfg.eval.val and os.path.exists(index_file(cfg.eval.val)):  # a missing split is named where it is read
        splits.append(("eval.val", cfg.eval.val, ShardIndex.load(cfg.eval.val)))
    for setting, folder, index in splits:
        identity = stored_identity(index.meta)
        if not identity:
            raise ConfigError(
                f"data check: ldm.text.features=precomputed, but {setting}={folder!r} holds no text "
                f"features ({index.path} records no text_encoder); write them with `prunepipe latents "
                f"encode ... --text-encoder PATH`"
            )
        made_by[setting if setting not in made_by else f"{setting} ({folder})"] = (
            f"{identity}, width {index.meta.get('text_width')}"
        )
    if len(set(made_by.values())) > 1:
        listed = "; ".join(f"{setting}: {made}" for setting, made in made_by.items())
        raise ConfigError(
            f"data check: the splits' text features come from different encoders or caption lengths "
            f"({listed}); encode every split with the same --text-encoder and --text-max-length"
        )


def _check_latent_augmentations(cfg: RunConfig, data: DataDescription) -> None:
    """Augmentations the decoder can apply where the shard index tells: a crop on images only, a flip
    on latents only where the mirrored images' latents are stored."""
    from prunepipe.pipelines.data.decode import FLIPPED_LATENT_FIELD  # torch: the data check's

    cropped = cfg.data.crop != "center"
    records = data.records  # a mixture's sources hold one kind of sample (pipelines/data/mixture.py)
    if not (cropped or cfg.data.hflip) or "latent_shape" not in records.meta:  # what `latents encode` records
        return
    train = first_path(cfg.data.train)
    if cropped:
        raise ConfigError(
            f"data check: data.crop={cfg.data.crop} crops images, but data.train={train!r} holds "
            f"latents ({records.index_path} records latent_shape); use data.crop=center"
        )
    keys = records.meta.get("keys", [FLIPPED_LATENT_FIELD])
    if cfg.data.hflip and FLIPPED_LATENT_FIELD not in keys:
        raise ConfigError(
            f"data check: data.hflip=true, but the latent shards of data.train={train!r} hold no latents "
            f"of mirrored images ({records.index_path} lists keys {keys}); encode them with "
            f"`prunepipe latents encode --flip`, or set data.hflip=false"
        )


def latent_shard_notes(cfg: RunConfig, data: DataDescription | None = None) -> list[str]:
    """What to tell a run on precomputed latents (ldm.space=latents) at its start: there the run
    trains at the latent_shape of data.train's index.json, and data.resolution and data.channels go
    unused. Each may name the latents (their side, their channels) or the images they were encoded
    from (index.json's resolution, the VAE's in_channels); a value that names neither is a recipe
    meant for other latents (a 256 px recipe on latents of 512 px images), said plainly, once.
    `data`: the run's data description, else data.train's index.json is read here."""
    train = first_path(cfg.data.train)
    if cfg.task != "ldm" or cfg.ldm.space != "latents" or not train:
        return []
    if data is None:
        if not os.path.exists(index_file(train)):
            return []
        records = SplitRecords.of(ShardIndex.load(train))
    else:
        records = data.records
    shape, meta = records.meta.get("latent_shape"), records.meta
    if not isinstance(shape, list) or len(shape) != 3:
        return []
    channels, height, width = (int(n) for n in shape)
    latents = f"data.train={train!r} holds {channels}x{height}x{width} latents"
    vae = _vae_config(meta)
    source = meta.get("resolution")
    if not isinstance(source, int) and vae and height == width:  # shards encoded before index.json said
        source = height * 2 ** (len(vae.get("block_out_channels", [0])) - 1)
    by = f" by {meta['vae']!r}" if meta.get("vae") else ""
    notes = []
    resolution = cfg.data.resolution
    # the sides data.resolution may name: the images' the latents were encoded from, the latents' own
    sides = list(
        dict.fromkeys(
            side for side in (source if isinstance(source, int) else None, height if height == width else None) if side
        )
    )
    if resolution not in sides:
        encoded = (
            f"encoded from {source} px images{by}"
            if isinstance(source, int)
            else f"encoded{by} from images of a side it does not record"
        )
        said = " or ".join(f"data.resolution={side}" for side in sides)
        notes.append(
            f"data.resolution={resolution} is not what this run trains on: {latents}, {encoded} "
            f"({records.index_path}); on precomputed latents (ldm.space=latents) a run trains at the "
            f"latents' size and data.resolution is unused. To train at {resolution} px, encode the images at "
            f"that side (`prunepipe latents encode IMAGES --vae VAE --resolution {resolution} --out DIR`)"
            + (f"; to say what it trains on, set {said}" if said else "")
        )
    image_channels = vae.get("in_channels") if vae else None
    if isinstance(image_channels, int) and cfg.data.channels not in (channels, image_channels):
        notes.append(
            f"data.channels={cfg.data.channels} is unused on precomputed latents: {latents}, encoded from "
            f"{image_channels}-channel images{by}; set data.channels={image_channels} (the images') or "
            f"{channels} (the latents')"
        )
    return notes


def _vae_config(meta: dict) -> dict:
    """The config.json of the VAE a latent index names, where it is a local folder ({} elsewhere)."""
    vae = meta.get("vae")
    if not isinstance(vae, str) or not os.path.isdir(vae):
        return {}
    try:
        with open(os.path.join(vae, meta.get("subfolder") or "", "config.json")) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
