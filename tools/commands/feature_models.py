"""Feature networks named by a spec, for `prunepipe shards embed`: decoded images in (uint8 [B, C, S, S]),
one vector per image out. Every model comes from a local path; nothing is downloaded.

    timm:ARCH --weights FILE   a timm architecture with its weights (.safetensors, or .pth/.pt/.bin)
    timm:FOLDER                a folder with timm's config.json and weights (timm's `save_for_hf`, or a
                               Hugging Face hub cache snapshot: .../models--timm--NAME/snapshots/REV)
    mae:PATH                   this project's MAE encoder: a run folder (runs/NAME) or its export/ folder
    feature-net[:FILE]         the bundled small-domain classifier (tools/commands/feature_net.py); default FILE:
                               feature_net.safetensors beside the split, where that tool writes it
    phash[:SIDE]               the perceptual hash, model-free (tools/commands/perceptual_hash.py): SIDE x SIDE bits, 8 by
                               default (imagehash's 64-bit pHash)
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Protocol

import numpy as np
import torch

from prunepipe.tools.commands.perceptual_hash import PerceptualHash

SPECS = ("timm:ARCH --weights FILE", "timm:FOLDER", "mae:RUN_OR_EXPORT_DIR", "feature-net[:FILE]", "phash[:SIDE]")
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


class FeatureModel(Protocol):
    spec: str
    image_size: int
    channels: int
    dim: int

    def __call__(self, pixels: torch.Tensor) -> np.ndarray: ...  # uint8 [B, C, S, S] -> float32 [B, dim]

    def describe(self) -> dict: ...  # what made the rows, for the embeddings' header


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TorchFeatures:
    """A torch feature network: pixels scaled as it was trained, forward without gradients, float32 out."""

    def __init__(
        self,
        spec: str,
        network: Callable[[torch.Tensor], torch.Tensor],
        module: torch.nn.Module,
        *,
        image_size: int,
        channels: int,
        scale: str,
        weights: str | None,
        features: str,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        device: str = "cpu",
    ):
        self.spec, self.network, self.image_size, self.channels = spec, network, image_size, channels
        self.module = module.eval().requires_grad_(False).to(device)
        self.scale, self.weights, self.features, self.device = scale, weights, features, device
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        with torch.no_grad():
            probe = torch.zeros(1, channels, image_size, image_size, dtype=torch.uint8)
            self.dim = int(self(probe).shape[1])

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor) -> np.ndarray:
        x = pixels.to(self.device, torch.float32)
        x = x / 127.5 - 1.0 if self.scale == "[-1, 1]" else x / 255.0
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return self.network(x).float().reshape(len(x), -1).cpu().numpy()

    def describe(self) -> dict:
        normalised = (
            "" if self.mean is None else f", then (x - {self.mean.flatten().tolist()}) / {self.std.flatten().tolist()}"
        )
        return {
            "model": self.spec,
            "weights": self.weights,
            "weights_sha256": file_sha256(self.weights) if self.weights else None,
            "dim": self.dim,
            "image_size": self.image_size,
            "channels": self.channels,
            "preprocessing": f"decoded with the shorter side to {self.image_size} px (bicubic), centre square; "
            f"pixels to {self.scale}{normalised}",
            "features": self.features,
        }


def load_feature_model(
    spec: str,
    *,
    weights: str | None = None,
    image_size: int | None = None,
    shards_dir: str = ".",
    device: str | None = None,
) -> FeatureModel:
    """The feature model a spec names (module docstring); `image_size` overrides the decode side."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, target = spec.partition(":")
    if kind == "phash":
        if weights:
            raise ValueError("--weights: phash is model-free and takes none")
        if target and not target.isdigit():
            raise ValueError(f"--model {spec!r}: phash or phash:SIDE (the side of the frequency block, 8 by default)")
        return PerceptualHash(int(target) if target else 8)
    if kind == "feature-net":
        return _feature_net(
            target or os.path.join(os.path.dirname(os.path.abspath(shards_dir)), _feature_net_name()),
            spec,
            image_size,
            device,
        )
    if kind == "mae" and target:
        return _mae_encoder(target, spec, image_size, device)
    if kind == "timm" and target:
        return _timm_model(target, spec, weights, image_size, device)
    raise ValueError(f"--model {spec!r}: accepted: {', '.join(SPECS)}")


def _feature_net_name() -> str:
    from prunepipe.tools.commands.feature_net import DEFAULT_NAME

    return DEFAULT_NAME


def _feature_net(path: str, spec: str, image_size: int | None, device: str) -> TorchFeatures:
    from prunepipe.pipelines.evaluation.features import load_classifier

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: no feature net there; train one with `python -m prunepipe.tools.commands.feature_net "
            f"--shards DIR` (DIR holds train/ and val/) or name its file: feature-net:FILE"
        )
    model = load_classifier(path)
    return TorchFeatures(
        spec,
        model,
        model,
        image_size=image_size or 32,
        channels=model.in_channels,
        scale="[0, 1]",
        weights=os.path.abspath(path),
        device=device,
        features=f"SmallClassifier's pooled features ({model.resolution} px inside the network)",
    )


def _mae_encoder(path: str, spec: str, image_size: int | None, device: str) -> TorchFeatures:
    from prunepipe.pipelines.tasks.mae import ENCODER_CONFIG, ENCODER_WEIGHTS, load_exported_encoder

    folder = os.path.join(path, "export") if os.path.isfile(os.path.join(path, "export", ENCODER_WEIGHTS)) else path
    if not os.path.isfile(os.path.join(folder, ENCODER_WEIGHTS)):
        raise FileNotFoundError(
            f"{folder}: no {ENCODER_WEIGHTS} (an MAE run writes RUN/export/{ENCODER_WEIGHTS} and "
            f"{ENCODER_CONFIG} when it ends)"
        )
    encoder = load_exported_encoder(folder)
    prefix = getattr(encoder, "num_prefix_tokens", 1)
    side = encoder.patch_embed.img_size[0]
    if image_size not in (None, side):
        raise ValueError(f"--image-size {image_size}: the MAE encoder in {folder} was trained at {side} px")

    def mean_of_patch_tokens(x: torch.Tensor) -> torch.Tensor:  # the linear probe's default pooling
        return encoder.forward_features(x)[:, prefix:].mean(dim=1)

    return TorchFeatures(
        spec,
        mean_of_patch_tokens,
        encoder,
        image_size=side,
        channels=encoder.patch_embed.proj.in_channels,
        scale="[-1, 1]",
        weights=os.path.abspath(os.path.join(folder, ENCODER_WEIGHTS)),
        device=device,
        features="mean of the patch tokens after the final norm (the linear probe's pool=avg)",
    )


def _timm_model(target: str, spec: str, weights: str | None, image_size: int | None, device: str) -> TorchFeatures:
    import timm
    from timm.data import resolve_data_config

    if os.path.isdir(target):
        if weights:
            raise ValueError(f"--weights: {target} is a folder that holds its weights; give one or the other")
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise FileNotFoundError(
                f"{target}: a timm model folder needs config.json beside its weights (timm's save_for_hf writes both)"
            )
        model = timm.create_model(f"local-dir:{os.path.abspath(target)}", pretrained=True, num_classes=0)
        weights = next(
            (
                os.path.join(target, f)
                for f in ("model.safetensors", "pytorch_model.bin")
                if os.path.isfile(os.path.join(target, f))
            ),
            None,
        )
    else:
        if not weights:
            raise ValueError(
                f"--model {spec}: give the weights file with --weights FILE (.safetensors, .pth); nothing is downloaded"
            )
        if not os.path.isfile(weights) or not weights.endswith(WEIGHT_SUFFIXES):
            raise FileNotFoundError(f"--weights {weights}: not a file of {', '.join(WEIGHT_SUFFIXES)}")
        try:
            model = timm.create_model(target, pretrained=False, num_classes=0)
        except RuntimeError as e:
            raise ValueError(f"--model {spec}: {e}") from e
        _load_weights(model, weights, spec)
    config = resolve_data_config({}, model=model)
    side = image_size or int(config["input_size"][-1])
    return TorchFeatures(
        spec,
        model,
        model,
        image_size=side,
        channels=int(config["input_size"][0]),
        scale="[0, 1]",
        mean=tuple(config["mean"]),
        std=tuple(config["std"]),
        device=device,
        weights=os.path.abspath(weights) if weights else None,
        features="timm's pooled pre-logits features (num_classes=0)",
    )


def _load_weights(model: torch.nn.Module, path: str, spec: str) -> None:
    """Load a state dict into `model` (built without its classifier): every weight of the network must
    be in the file; only the classifier's may be left over."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("state_dict", "model", "state_dict_ema"):  # training checkpoints nest the weights
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
                break
    result = model.load_state_dict(state, strict=False)
    classifier = model.pretrained_cfg.get("classifier") or "head"
    classifiers = classifier if isinstance(classifier, (list, tuple)) else [classifier]
    leftover = [k for k in result.unexpected_keys if not any(k.startswith(c + ".") for c in classifiers)]
    if result.missing_keys or leftover:
        raise ValueError(f"{path}: does not fit {spec}: missing {result.missing_keys[:5]}, unexpected {leftover[:5]}")
