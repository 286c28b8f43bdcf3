"""The call that a stock diffusers PixArt pipeline draws from an export with, as the export's README and
`prunepipe sample` say it: a plain `pipe(prompt)` where the pipeline's defaults fit the export, else the
arguments it needs and why; and which of the run's aspect-ratio buckets the pipeline accepts.

The defaults that may not fit (diffusers' pipeline_pixart_sigma.py / pipeline_pixart_alpha.py):
resolution binning, on by default, knows transformers of sample_size 32, 64, 128 (and 256 for Sigma) only
and raises for any other; captions are padded to max_sequence_length tokens (300 for Sigma, 120 for Alpha),
more than a CLIP-style encoder's position table holds (77, a tiny one 16), while a T5 encoder's relative
positions take any length; and every height and width must be a multiple of 8 px. Reads the export's
json files only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

BINNED_SAMPLE_SIZES = {  # sample_size -> the side (px) of the bin table's square size
    "PixArtSigmaPipeline": {32: 256, 64: 512, 128: 1024, 256: 2048},
    "PixArtAlphaPipeline": {32: 256, 64: 512, 128: 1024},
}
DEFAULT_SEQUENCE_LENGTH = {"PixArtSigmaPipeline": 300, "PixArtAlphaPipeline": 120}
SIDE_MULTIPLE = 8  # check_inputs: `height` and `width` have to be divisible by 8
RELATIVE_POSITIONS = ("t5", "umt5", "mt5")  # encoders whose attention takes any caption length


@dataclass
class StockCall:
    """What a stock PixArt pipeline needs to draw from one export."""

    pipeline: str
    arguments: dict = field(default_factory=dict)  # argument -> its value, as Python source
    reasons: list = field(default_factory=list)  # why each argument is needed
    side: int = 0  # the square size (px) the run samples at
    binned_side: int = 0  # the size (px) resolution binning draws a square at, then resizes to `side`
    buckets: list = field(default_factory=list)  # (height, width) px the pipeline accepts
    refused: list = field(default_factory=list)  # (height, width) px it refuses (not multiples of 8)

    @property
    def plain(self) -> bool:
        """Whether `pipe(prompt)` draws from the export as it is."""
        return not self.arguments

    def call(self, **more: str) -> str:
        """`pipe(prompt, ...)` with the arguments it needs and `more` (argument -> Python source)."""
        given = {**more, **{k: v for k, v in self.arguments.items() if k not in more}}
        if "height" in more and "use_resolution_binning" not in given:
            given["use_resolution_binning"] = "False"  # binning would draw at PixArt's nearest size instead
        return "pipe(" + ", ".join(["prompt", *(f"{k}={v}" for k, v in given.items())]) + ")"


def stock_call(export_dir: str, buckets: list | tuple = ()) -> StockCall | None:
    """The StockCall of the export in `export_dir` (None when no PixArt pipeline loads it); `buckets`: the
    (height, width) px sizes the run trained at, where it trained on aspect-ratio buckets."""
    index = _read(export_dir, "model_index.json")
    pipeline = index.get("_class_name", "")
    if pipeline not in BINNED_SAMPLE_SIZES:
        return None
    sample_size = int(_read(export_dir, "transformer/config.json")["sample_size"])
    blocks = _read(export_dir, "vae/config.json").get("block_out_channels", [0] * 4)
    scale = 2 ** (len(blocks) - 1)  # diffusers' vae_scale_factor
    found = StockCall(pipeline, side=sample_size * scale)
    binned = BINNED_SAMPLE_SIZES[pipeline]
    if sample_size in binned:
        found.binned_side = binned[sample_size]
    else:
        found.arguments["use_resolution_binning"] = "False"
        found.reasons.append(
            f"resolution binning (on by default) knows transformers of sample_size "
            f"{', '.join(map(str, binned))} only and raises for this one's, {sample_size}"
        )
    encoder = _read(export_dir, "text_encoder/config.json")
    trained_length = int(_read(export_dir, "text_encoder.json").get("max_length", 0))
    positions = encoder.get("max_position_embeddings") or encoder.get("text_config", {}).get("max_position_embeddings")
    default = DEFAULT_SEQUENCE_LENGTH[pipeline]
    if encoder.get("model_type") not in RELATIVE_POSITIONS and positions and int(positions) < default:
        found.arguments["max_sequence_length"] = str(trained_length or positions)
        found.reasons.append(
            f"the pipeline pads captions to {default} tokens by default, and this encoder's positions "
            f"({encoder.get('model_type')}) end at {positions}; the run trained on {trained_length}"
        )
    if found.side % SIDE_MULTIPLE and not found.binned_side:  # binning would draw at its table's sizes
        found.reasons.append(
            f"its own size, {found.side} px a side, is not a multiple of {SIDE_MULTIPLE}, which the pipeline "
            f"refuses: no call draws it at that size"
        )
    for height, width in buckets:
        fits = height % SIDE_MULTIPLE == 0 and width % SIDE_MULTIPLE == 0
        (found.buckets if fits else found.refused).append((int(height), int(width)))
    return found


def _read(export_dir: str, name: str) -> dict:
    path = os.path.join(export_dir, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
