"""A small image classifier whose penultimate features stand in for Inception-v3 in FID on the
bundled small domains (32 px digits), where Inception's ImageNet features say little and its
weights cannot be downloaded. FID in these features is NOT comparable to Inception FID or to any
published number. Trained by `python -m prunepipe.tools.commands.feature_net`; nothing here trains or downloads.
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

FORMAT = "prunepipe-small-classifier"


class SmallClassifier(nn.Module):
    """Three conv stages and a global average pool: float images [N, C, H, W] in [0, 1] -> features
    [N, num_features] (`forward`, what FID uses) or class logits (`classify`). Inputs are resized to
    `resolution` (16 px: the digits are 8x8 scans, and it keeps training to seconds on a CPU)."""

    def __init__(
        self, in_channels: int = 3, resolution: int = 16, widths: tuple[int, ...] = (16, 32, 64), num_classes: int = 10
    ):
        super().__init__()
        self.config = dict(in_channels=in_channels, resolution=resolution, widths=list(widths), num_classes=num_classes)
        self.in_channels, self.resolution = in_channels, resolution
        stages, channels = [], in_channels
        for k, width in enumerate(widths):
            # batch norm makes the short, fixed-seed training converge from any initialisation
            stages += [
                nn.Conv2d(channels, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
            ]
            if k < len(widths) - 1:
                stages.append(nn.MaxPool2d(2))
            channels = width
        self.stages = nn.Sequential(*stages)
        self.num_features = channels  # torchmetrics' FID reads this instead of probing with a dummy image
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] in [0, 1] -> [N, num_features]; other sizes are resized to the trained one."""
        x = images.float()
        if x.shape[1] != self.in_channels:
            if x.shape[1] == 1:  # grey images for a colour network: repeat, as Inception FID does
                x = x.expand(-1, self.in_channels, -1, -1)
            elif self.in_channels == 1:
                x = x.mean(dim=1, keepdim=True)
            else:
                raise ValueError(f"SmallClassifier expects {self.in_channels} channels, got {x.shape[1]}")
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = F.interpolate(
                x, size=(self.resolution, self.resolution), mode="bilinear", antialias=True, align_corners=False
            )
        x = self.stages(x * 2.0 - 1.0)  # the [-1, 1] range the training shards decode to
        return x.mean(dim=(2, 3))

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self(images))


def save_classifier(model: SmallClassifier, path: str, **info) -> None:
    """One safetensors file: the weights, and the architecture plus `info` (how it was trained) as metadata."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, path, metadata={"format": FORMAT, "config": json.dumps(model.config), "info": json.dumps(info)})


def load_classifier(path: str) -> SmallClassifier:
    """The classifier saved by `save_classifier`, in eval mode, frozen."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not a classifier written by `python -m prunepipe.tools.commands.feature_net` (metadata format "
            f"{metadata.get('format')!r}, expected {FORMAT!r})"
        )
    model = SmallClassifier(**json.loads(metadata["config"]))
    model.load_state_dict(load_file(path), strict=True)
    return model.eval().requires_grad_(False)
