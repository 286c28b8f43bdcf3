"""CLIPScore of generated images against the captions they were sampled from: torchmetrics'
`CLIPScore` (100 x the cosine of CLIP's image and text embeddings, the mean over samples, floored at
0), with a transformers CLIP read from a local folder (`eval.clip_score.model`), never downloaded.

torchmetrics 1.9 loads a CLIP only by a hub name (it would download), or takes a callable returning
(model, processor): that is how the local one is handed over. With transformers 5 its
`get_image_features` / `get_text_features` return a BaseModelOutputWithPooling, which torchmetrics
1.9 divides by its norm and fails (torchmetrics issue 3407, fixed after 1.9.0 by unwrapping
`pooler_output`); `TensorFeatures` does that unwrapping in front of the model and is a pass-through
with transformers 4 or a fixed torchmetrics.

Every rank scores its own share of the samples; the metric's sums add over ranks in `compute()`.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn as nn
from torchmetrics.multimodal.clip_score import CLIPScore

from prunepipe.pipelines.evaluation.fid import uint8_rgb
from prunepipe.pipelines.tasks.diffusion.text import quiet_transformers, said_missing

SETTING = "eval.clip_score.model"


class TensorFeatures(nn.Module):
    """A CLIPModel whose get_image_features / get_text_features return the projected embeddings as a
    tensor, as torchmetrics 1.9 expects (transformers 5 wraps them in a ModelOutput)."""

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip
        self.config = clip.config  # torchmetrics reads text_config.max_position_embeddings to truncate captions

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return _tensor(self.clip.get_image_features(pixel_values=pixel_values))

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return _tensor(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask))


def _tensor(features) -> torch.Tensor:
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def load_clip(path: str) -> tuple[TensorFeatures, object]:
    """(model, processor) of the CLIP in the local folder `path`, in eval mode; errors name the setting."""
    import transformers

    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"{SETTING}={path!r}: no such folder. Give the local folder of a transformers "
            f"CLIPModel and its processor; this machine never downloads (on a connected machine "
            f"`hf download openai/clip-vit-large-patch14` and copy the folder)"
        )
    with quiet_transformers():  # its bar and load report would sit among the evaluation's own lines
        try:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"{SETTING}={path!r}: no transformers config.json there: {str(e).splitlines()[0]}"
            ) from None
        if config.model_type != "clip":
            raise ValueError(
                f"{SETTING}={path!r} holds a {config.model_type!r} model; CLIPScore needs a CLIPModel "
                f"(vision and text towers)"
            )
        try:
            model, info = transformers.CLIPModel.from_pretrained(
                folder, config=config, local_files_only=True, output_loading_info=True
            )
            processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"{SETTING}={path!r}: cannot load the CLIP and its processor (tokenizer and "
                f"image processor files) there: {str(e).splitlines()[0]}"
            ) from None
    said_missing(SETTING, path, "CLIPModel", info)
    return TensorFeatures(model.eval().requires_grad_(False)), processor


def clip_score_metric(path: str, device: str | torch.device = "cpu") -> CLIPScore:
    """torchmetrics' CLIPScore on the local CLIP at `path`."""
    model, processor = load_clip(path)
    return CLIPScore(model_name_or_path=lambda: (model, processor)).to(device)


def scoring(batches: Iterable[torch.Tensor], metric: CLIPScore, captions: Sequence[str]) -> Iterator[torch.Tensor]:
    """`batches` passed on unchanged after adding each to `metric` with its captions: the i-th image
    of the stream against captions[i], as uint8 RGB (as saved to PNG, as FID measures them; CLIP's
    processor rescales by 1/255 and resizes to its own side)."""
    seen = 0
    for images in batches:
        metric.update(uint8_rgb(images.to(metric.device)), list(captions[seen : seen + len(images)]))
        seen += len(images)
        yield images
    if seen != len(captions):
        raise ValueError(f"CLIPScore: {seen} images for {len(captions)} captions")
