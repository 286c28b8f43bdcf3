"""What the stream hands the loop: a `Batch` of global sample ids, pruning weights and tensors, and
`real_samples` to drop its weight-0 padding. Plain data; knows nothing of shards, models or pruners.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from prunepipe.pipelines.data.mixture import draw_keys
from prunepipe.pipelines.data.shards import BadInput

PADDING_ID = -1  # id of a padding sample: weight 0, never recorded by a pruner


@dataclass
class Batch:
    """One training batch; `ids` are global sample ids (int64), -1 marks weight-0 padding."""

    ids: torch.Tensor  # int64 [B]
    weights: torch.Tensor  # float32 [B]
    # float32 [B, C, H, W] in [-1, 1] (or latents); uint8 pixels [B, C, H, W] where the decoder leaves
    # them for the device (SampleDecoder.pixels_on_device), which `to` turns into those floats
    images: torch.Tensor
    labels: torch.Tensor  # int64 [B], -1 where the shards carry no class
    bad: tuple[BadInput, ...] = ()  # bad-input events met while filling this batch
    worker: int = 0  # the part of this rank's slice it came from (for resuming exactly)
    captions: tuple[str, ...] = ()  # one per sample ("" for padding) when the task reads them, else empty
    # precomputed text features, when the task reads them: every sample's real tokens, one after the
    # other [T, D] (a padded [B, L, D] would be mostly padding: T5's 120 tokens against ~30 real), and
    # each sample's count [B] (0 for padding); the task pads them on its device
    text_tokens: torch.Tensor | None = None
    text_lengths: torch.Tensor | None = None
    # its aspect-ratio bucket (every sample of a batch has the one shape); -1 for an unbucketed index. With
    # `worker` it names the sample stream the batch was read from: worker part `worker`'s stream of `bucket`
    bucket: int = -1
    # int64 [B]: each sample's walk of its source in this pass (a mixture's repeat), where one is past its
    # first; None when every sample is on its first walk. Draws are keyed by `draw_ids`, never by a walk
    walks: torch.Tensor | None = None
    # bool [B] beside uint8 images: mirror this sample when `to` brings its pixels to float
    flips: torch.Tensor | None = None

    def _tensors(self) -> tuple[str, ...]:
        return (
            ("ids", "weights", "images", "labels")
            + (("text_tokens", "text_lengths") if self.text_tokens is not None else ())
            + (("walks",) if self.walks is not None else ())
            + (("flips",) if self.flips is not None else ())
        )

    @property
    def draw_ids(self) -> torch.Tensor:
        """int64 [B]: the keys of the samples' per-sample draws (noise, timestep, mask): each id, moved
        past every id for a later walk of the same sample in the pass (pipelines/data/mixture.py)."""
        return self.ids if self.walks is None else draw_keys(self.ids, self.walks)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """The batch on `device`; uint8 pixels arrive as uint8 (a quarter of float32's bytes) and become
        float32 in [-1, 1] there, mirrored where `flips` says, padding all zeros (`float_pixels`)."""
        moved = dataclasses.replace(
            self, **{name: getattr(self, name).to(device, non_blocking=non_blocking) for name in self._tensors()}
        )
        if moved.images.dtype != torch.uint8:
            return moved
        return dataclasses.replace(moved, images=float_pixels(moved.images, moved.flips, moved.ids), flips=None)

    def pin_memory(self) -> "Batch":
        """The DataLoader's pin_memory=True calls this: pinned tensors copy to CUDA without a host wait."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory() for name in self._tensors()})

    def __reduce__(self):
        # From a loader worker: the small per-sample fields travel inside the message as numpy
        # arrays; only the images and text features take shared-memory segments, which the receiver maps.
        small = [
            t.numpy() if t is not None and t.device.type == "cpu" else t
            for t in (self.ids, self.weights, self.labels, self.text_lengths, self.walks, self.flips)
        ]
        return _rebuild, (
            small[0],
            small[1],
            self.images,
            small[2],
            self.bad,
            self.worker,
            self.captions,
            self.text_tokens,
            small[3],
            self.bucket,
            small[4],
            small[5],
        )

    def undecodable(self) -> int:
        """Samples read for this batch but not decodable."""
        return sum(e.samples_lost for e in self.bad if e.undecodable)

    def __len__(self) -> int:
        return len(self.ids)


def _rebuild(
    ids,
    weights,
    images,
    labels,
    bad,
    worker,
    captions=(),
    text_tokens=None,
    text_lengths=None,
    bucket=-1,
    walks=None,
    flips=None,
) -> Batch:
    return Batch(
        torch.as_tensor(ids),
        torch.as_tensor(weights),
        images,
        torch.as_tensor(labels),
        bad,
        worker,
        captions,
        text_tokens,
        None if text_lengths is None else torch.as_tensor(text_lengths),
        bucket,
        None if walks is None else torch.as_tensor(walks),
        None if flips is None else torch.as_tensor(flips),
    )


def float_pixels(pixels: torch.Tensor, flips: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """float32 [B, C, H, W] in [-1, 1] of uint8 `pixels`, on their device: x / 127.5 - 1 (what
    SampleDecoder.finish computes on the host: the same bits on a CPU), mirrored where `flips` is set, and zero
    where the id is padding's (as padding is on the host path)."""
    images = pixels.float().div_(127.5).sub_(1.0).contiguous()  # a channels-last batch (stack_pixels) too
    if flips is not None:
        images = torch.where(flips[:, None, None, None], images.flip(-1), images)
    return images.masked_fill_((ids == PADDING_ID)[:, None, None, None], 0.0)


def text_fields(texts: list, *, captions: bool = False, width: int = 0) -> dict:
    """Batch's text fields for the samples' texts as the decoder gives them (None for padding): the
    captions ("" for padding), precomputed features ([n, D] arrays of width `width`), or {} for none."""
    if captions:
        return {"captions": tuple("" if t is None else t for t in texts)}
    if not width:
        return {}
    lengths = [0 if t is None else len(t) for t in texts]
    real = [t for t in texts if t is not None]
    tokens = np.concatenate(real) if real else np.zeros((0, width), np.float16)
    return {"text_tokens": torch.from_numpy(tokens), "text_lengths": torch.tensor(lengths, dtype=torch.int64)}


def real_samples(batches) -> Iterator[Batch]:
    """The batches without their weight-0 padding (id -1); batches of padding only are left out."""
    for batch in batches:
        keep = batch.ids >= 0
        if bool(keep.all()):
            yield batch
        elif bool(keep.any()):
            captions = tuple(c for c, k in zip(batch.captions, keep.tolist()) if k)
            lengths = batch.text_lengths[keep] if batch.text_lengths is not None else None  # padding holds no tokens
            yield dataclasses.replace(
                batch,
                ids=batch.ids[keep],
                weights=batch.weights[keep],
                images=batch.images[keep],
                labels=batch.labels[keep],
                captions=captions,
                text_lengths=lengths,
                walks=None if batch.walks is None else batch.walks[keep],
                flips=None if batch.flips is None else batch.flips[keep],
            )
