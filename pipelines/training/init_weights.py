"""A new run started from another run's weights (`init.weights`): the live weights and the EMA of a RUN
folder (its newest intact checkpoint), a CHECKPOINT folder or an EXPORT folder, copied into the freshly
built model before its first step. A stage of staged pretraining (PixArt-alpha: 256 px, then 512, then
1024, each from the last one's weights) brings its own data, size, schedule, optimizer and pruner: only
weights travel. Never applied when the run resumes (its own checkpoint wins). Reads files and copies
tensors; never builds the source's model, never touches the optimizer or the pruner.

On a cluster rank 0 decides which folder is read (a RUN's newest intact checkpoint, as `choose_resume`
does), every rank reads it from its own node (a shared file system or a copy per node: the weights go
no further than to the device beside them, no broadcast holds a second copy of the model in memory),
a failure on any rank stops every rank, and the ranks compare a digest of the bytes they read before
anything trains.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from prunepipe.pipelines.checkpoint.manifest import MANIFEST
from prunepipe.pipelines.checkpoint.store import checked, checkpoints_dir, load_checkpoint_states, newest_intact
from prunepipe.pipelines.ranks import decided_on_rank0, on_every_rank, same_on_every_rank
from prunepipe.pipelines.tasks.diffusion.export import MODEL_FOLDERS, RAW_VARIANT
from prunepipe.pipelines.tasks.mae import ENCODER_WEIGHTS

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"  # what save_pretrained names a model's weights
SHOWN = 6  # names listed per kind in the log line and in errors; the rest are counted
FRESH = "optimizer, learning-rate schedule, pruner scores and data position start afresh"


class InitWeightsError(ValueError):
    """init.weights cannot be loaded into this run's model: names the folder, the tensors and their shapes."""


@dataclass
class Source:
    """The weights one init.weights folder holds, keyed as the model's state dict is."""

    folder: str  # the folder read
    described: str  # where, for the log line
    live: dict[str, torch.Tensor]
    live_from: str
    ema: dict[str, torch.Tensor] | list[torch.Tensor] | None  # a checkpoint's EMA: a list in parameter order
    ema_from: str
    scope: str = ""  # the model's tensors it holds: those under this prefix ("" = all; an MAE export: "encoder.")
    notes: list[str] = field(default_factory=list)


@dataclass
class Matched:
    """The model's state dict against a source's: what loads, what the model computes itself, what is new."""

    load: dict[str, torch.Tensor]
    recomputed: list[str]  # not learned, of another size or never stored: left as this model computed them
    new: list[str]  # learned tensors of the model the source does not hold
    mismatched: list[tuple[str, tuple, tuple]]  # (name, the source's shape, this model's)
    unexpected: list[str]  # the source's tensors this model has not


# ----------------------------------------------------------------------------- the hook
def init_from_weights(cfg, model: nn.Module, ema, *, resumed_from: str | None, announce: bool) -> None:
    """Load cfg.init.weights into `model` (the bare module, on its device) and `ema` (a diffusers
    EMAModel of its parameters), on every rank, unless the run resumed from `resumed_from`."""
    init = cfg.init
    if not init.weights:
        return
    if resumed_from is not None:
        if announce:
            print(
                f"init: init.weights={init.weights} not applied: the run resumed from its own checkpoint "
                f"{resumed_from} (a resume wins; init starts a stage once)",
                flush=True,
            )
        return
    kind, folder, described = decided_on_rank0(lambda: find_source(init.weights))

    def load() -> tuple[str, list[str]]:
        source = read_source(cfg, model, kind, folder, described)
        return digest(source), load_source(model, ema, source, strict=init.strict, warmup=cfg.ema_warmup)

    read_digest, lines = on_every_rank(load)
    same_on_every_rank(read_digest, f"{folder} (digest {read_digest[:16]})", f"init.weights files ({init.weights})")
    if announce:
        for line in lines:
            print(line, flush=True)


# ----------------------------------------------------------------------------- finding and reading
def find_source(weights: str) -> tuple[str, str, str]:
    """(kind, folder, description) of init.weights: ("checkpoint", a CHECKPOINT folder or a RUN's newest
    intact one, verified against its manifest), ("export", a diffusion EXPORT folder) or ("mae_export",
    an MAE EXPORT folder)."""
    if not os.path.isdir(weights):
        raise FileNotFoundError(
            f"init.weights={weights!r}: no such folder; expected a run folder (runs/NAME), a checkpoint "
            f"folder (runs/NAME/checkpoints/step_N) or an export folder (runs/NAME/export)"
        )
    if os.path.isfile(os.path.join(weights, MANIFEST)):
        folder = checked(weights, "init.weights")
        return "checkpoint", folder, f"checkpoint {folder}"
    if os.path.isdir(checkpoints_dir(weights)):
        folder = newest_intact(weights, doing="initialising from")
        if folder is None:
            raise FileNotFoundError(
                f"init.weights={weights!r}: the run has no checkpoint yet (checkpoints are written every "
                f"checkpoint.every_steps and at the end of training)"
            )
        return "checkpoint", folder, f"run {weights}, its newest intact checkpoint {os.path.basename(folder)}"
    if any(os.path.isdir(os.path.join(weights, sub)) for sub in MODEL_FOLDERS.values()):
        return "export", weights, f"export {weights}"
    if os.path.isfile(os.path.join(weights, ENCODER_WEIGHTS)):
        return "mae_export", weights, f"MAE export {weights}"
    raise FileNotFoundError(
        f"init.weights={weights!r} holds neither checkpoints/ (a run), {MANIFEST} (a checkpoint), "
        f"{'/ or '.join(sorted(set(MODEL_FOLDERS.values())))}/ (a diffusion export) nor {ENCODER_WEIGHTS} (an MAE export)"
    )


def read_source(cfg, model: nn.Module, kind: str, folder: str, described: str) -> Source:
    """The weights of `folder` (a `find_source` answer) on the host, checked against this run's task."""
    if kind == "checkpoint":
        trained = _source_task(folder)
        if trained and trained != cfg.task:
            raise InitWeightsError(f"init.weights: {described} trained task {trained}; this run trains {cfg.task}")
        states = load_checkpoint_states(folder, read_tables=False)  # a billion samples' scores stay on disk
        ema = states["ema"]["shadow_params"] if states["ema"] is not None else None
        return Source(folder, described, states["model"], "the checkpoint's model", ema, "the checkpoint's EMA")
    if kind == "mae_export":
        if cfg.task != "mae":
            raise InitWeightsError(f"init.weights: {described} holds an MAE encoder; this run trains {cfg.task}")
        encoder = {f"encoder.{k}": v for k, v in load_file(os.path.join(folder, ENCODER_WEIGHTS)).items()}
        held = f"{ENCODER_WEIGHTS} (the EMA encoder; an MAE export holds no live weights nor a decoder)"
        return Source(folder, described, encoder, held, encoder, ENCODER_WEIGHTS, scope="encoder.")
    if cfg.task != "ldm":
        raise InitWeightsError(f"init.weights: {described} is a diffusion export; this run trains {cfg.task}")
    sub = MODEL_FOLDERS[cfg.ldm.backbone]
    path = os.path.join(folder, sub)
    if not os.path.isdir(path):
        raise InitWeightsError(
            f"init.weights: {described} has no {sub}/, what ldm.backbone={cfg.ldm.backbone} reads "
            f"(it holds {', '.join(sorted(os.listdir(folder)))})"
        )
    _check_model_class(path, model)
    default, raw = _diffusers_weights(path, None), _diffusers_weights(path, RAW_VARIANT)
    if default is None:
        raise FileNotFoundError(f"init.weights: {path} holds no {DIFFUSERS_WEIGHTS}.safetensors (nor its index)")
    if raw is None:  # a run that kept no EMA exported its live weights alone: both start from them
        return Source(folder, described, default, f"{sub}/ (its one set of weights)", default, f"{sub}/, the same")
    return Source(folder, described, raw, f"{sub}/ {RAW_VARIANT} variant", default, f"{sub}/ default weights")


def _source_task(checkpoint: str) -> str:
    """The task of the run a checkpoint folder belongs to (RUN/checkpoints/step_N), "" when unknown."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.yaml")
    if not os.path.isfile(path):
        return ""
    return str(OmegaConf.load(path).get("task", ""))


def _check_model_class(path: str, model: nn.Module) -> None:
    """The export's model class (its config.json) is this run's: a UNet's weights never meet a DiT's names."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            exported = json.load(f).get("_class_name", "")
    except (OSError, ValueError):
        return
    if exported and exported != type(model).__name__:
        raise InitWeightsError(
            f"init.weights: {path} holds a {exported}; this run builds a {type(model).__name__} "
            f"(ldm.backbone, ldm.conditioning)"
        )


def _diffusers_weights(path: str, variant: str | None) -> dict[str, torch.Tensor] | None:
    """What save_pretrained wrote in `path` (one file, or shards and their index), None when absent."""
    infix = f".{variant}" if variant else ""
    single = os.path.join(path, f"{DIFFUSERS_WEIGHTS}{infix}.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(path, f"{DIFFUSERS_WEIGHTS}.safetensors.index{infix}.json")  # diffusers' _add_variant
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(os.path.join(path, shard)))
    return state


# ----------------------------------------------------------------------------- matching and loading
def match(model: nn.Module, tensors: dict[str, torch.Tensor], scope: str = "") -> Matched:
    """`tensors` (a state dict) against `model`'s: learned tensors (parameters that train) load when
    their shapes agree; tensors that are not learned (buffers, frozen parameters: sin-cos position tables)
    are copied when their shapes agree and otherwise left as this model computed them for its size."""
    own = model.state_dict()
    learned = {name for name, p in model.named_parameters() if p.requires_grad}
    never_stored = [name for name, _ in model.named_buffers() if name not in own]  # non-persistent buffers
    found = Matched({}, [f"{name} (never stored)" for name in never_stored], [], [], [])
    for name, tensor in tensors.items():
        if name not in own:
            found.unexpected.append(name)
        elif tuple(tensor.shape) == tuple(own[name].shape):
            found.load[name] = tensor
        elif name in learned:
            found.mismatched.append((name, tuple(tensor.shape), tuple(own[name].shape)))
        else:
            found.recomputed.append(f"{name} {list(tensor.shape)} -> {list(own[name].shape)}")
    found.new = [n for n in own if n.startswith(scope) and n in learned and n not in tensors]
    return found


def copy_whole(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """`tensor` into `target`, or under fsdp into this rank's shard of it: every rank read the same whole
    tensor from its own node, so each keeps its part without any communication."""
    if isinstance(target, DTensor):
        tensor = distribute_tensor(
            tensor.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
    target.copy_(tensor)


def load_source(model: nn.Module, ema, source: Source, *, strict: bool, warmup: str = "none") -> list[str]:
    """Copy `source` into `model` and `ema` (onto their devices, in their dtypes); returns the log lines.
    Strict: a learned tensor of another shape, one the model has not, or one of the model's that the source
    should hold and does not, raises naming each; not strict: what matches loads and the rest is named."""
    found = match(model, source.live, source.scope)
    if strict and (found.mismatched or found.unexpected or found.new):
        raise InitWeightsError(_strict_refusal(source, found))
    ema_named, ema_note = _ema_by_name(model, source, found)
    state = model.state_dict()  # shares the parameters' storage: copy_ writes the model
    with torch.no_grad():
        for name, tensor in found.load.items():
            copy_whole(state[name], tensor)
        parameters = list(model.named_parameters())
        if len(parameters) != len(ema.shadow_params):
            raise InitWeightsError(
                f"init: the EMA follows {len(ema.shadow_params)} tensors, the model has {len(parameters)} parameters"
            )
        for shadow, (name, parameter) in zip(ema.shadow_params, parameters):
            loaded = ema_named.get(name) if name in found.load else None
            fits = loaded is not None and tuple(loaded.shape) == tuple(shadow.shape)
            copy_whole(shadow, loaded) if fits else shadow.copy_(parameter.detach())
    outside = [n for n in state if not n.startswith(source.scope)]
    parts = [
        f"init: from {source.described}: {len(found.load)} tensors loaded; live weights from {source.live_from}, "
        f"EMA from {ema_note or source.ema_from}",
        _listed("recomputed for this model's size, not copied", found.recomputed),
        _listed("new, as initialised (not in the source)", found.new),
        _listed(f"new, as initialised (outside what the source holds, {source.scope}*)", outside),
        _listed(
            "skipped (init.strict=false), as initialised",
            [f"{n} {list(a)} here {list(b)}" for n, a, b in found.mismatched] + found.unexpected,
        ),
        FRESH,
    ]
    lines = ["; ".join(p for p in parts if p)]
    if warmup == "passes":  # PassProgressEMA's decay starts at 0: the loaded EMA would be gone after one step
        lines.append(
            "init: note: ema_warmup=passes starts the EMA decay at 0, so the loaded EMA gives way to the live "
            "weights within the first steps; ema_warmup=none keeps averaging from it (a stage's usual setting)"
        )
    return lines


def _ema_by_name(model: nn.Module, source: Source, found: Matched) -> tuple[dict[str, torch.Tensor], str]:
    """The source's EMA by tensor name, and a note when it cannot be used. A checkpoint's EMA is a list in
    its model's parameter order: the same names in the same module tree come in the same order, so it is
    named after this model's parameters that the checkpoint holds, each checked against the live tensor's shape."""
    if source.ema is None:
        return {}, "the loaded live weights (the source kept no EMA)"
    if isinstance(source.ema, dict):
        return source.ema, ""
    names = [name for name, _ in model.named_parameters() if name in source.live]
    fits = not found.unexpected and len(names) == len(source.ema)
    fits = fits and all(tuple(t.shape) == tuple(source.live[n].shape) for n, t in zip(names, source.ema))
    if not fits:
        return {}, (
            f"the loaded live weights: the checkpoint's EMA lists {len(source.ema)} tensors in its model's "
            f"parameter order, which this model's parameters do not name ({len(names)} of them in the checkpoint)"
        )
    return dict(zip(names, source.ema)), ""


def _strict_refusal(source: Source, found: Matched) -> str:
    problems = [
        _listed(
            "shapes differ",
            [
                f"{name}: {list(theirs)} in the source, {list(ours)} in this model"
                for name, theirs, ours in found.mismatched
            ],
        ),
        _listed("not in this model", found.unexpected),
        _listed("not in the source", found.new),
    ]
    return (
        f"init.weights: {source.described} does not fit this run's model (init.strict=true): "
        + "; ".join(p for p in problems if p)
        + ". Match the model's settings to the source's, or set init.strict=false to load what fits and "
        "start the rest afresh"
    )


def _listed(what: str, names: list[str]) -> str:
    if not names:
        return ""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{what}: {', '.join(names[:SHOWN])}{more}"


def digest(source: Source) -> str:
    """blake2b of every tensor read (name, dtype, shape, bytes): equal on every rank that read the same files."""
    h = hashlib.blake2b(digest_size=16)
    ema = source.ema if isinstance(source.ema, dict) else dict(enumerate(source.ema or []))
    for prefix, tensors in (("live", source.live), ("ema", ema)):
        for name in sorted(tensors, key=str):
            tensor = tensors[name].detach().cpu().contiguous()
            h.update(f"{prefix}:{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            h.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()
