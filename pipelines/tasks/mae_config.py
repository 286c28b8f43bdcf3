"""The mae: section of a run config: the model's sizes (or one of the paper's presets) and the loss
settings. Plain values only, so that loading a config imports no torch (pipelines/tasks/mae.py builds
the model from them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from prunepipe.pipelines.config_schema import not_accepted

# The paper's ViT-B/L/H encoders (MAE Appendix A.1) with its default 512-d, 8-block decoder (Table 1a/b).
PRESETS = {
    "vit_base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_large": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
    "vit_huge": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16),
}
PAPER_DECODER = dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mlp_ratio=4.0)


@dataclass
class MAEConfig:
    """Model and loss settings; a non-empty `preset` overrides the size fields with the paper's."""

    preset: Literal["", "vit_base", "vit_large", "vit_huge"] = ""  # PRESETS; "": the size fields
    patch_size: int = 4
    embed_dim: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    decoder_embed_dim: int = 64
    decoder_depth: int = 2
    decoder_num_heads: int = 4
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False

    def resolved(self) -> "MAEConfig":
        """A copy with the preset's sizes applied (the preset wins over the size fields)."""
        if not self.preset:
            return dataclasses.replace(self)
        if self.preset not in PRESETS:
            raise not_accepted("mae.preset", self.preset, ("", *PRESETS))
        return dataclasses.replace(self, **PRESETS[self.preset], **PAPER_DECODER)
