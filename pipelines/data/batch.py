"""What the stream hands the loop: a `Batch` of global sample ids, pruning weights and tensors, and
`real_samples` to drop its weight-0 padding. Plain data; knows nothing of shards, models or pruners.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch

from pipelines.data.shards import BadInput

PADDING_ID = -1  # id of a padding sample: weight 0, never recorded by a pruner


@dataclass
class Batch:
    """One training batch; `ids` are global sample ids (int64), -1 marks weight-0 padding."""

    ids: torch.Tensor  # int64 [B]
    weights: torch.Tensor  # float32 [B]
    images: torch.Tensor  # float32 [B, C, H, W] in [-1, 1] (or latents)
    labels: torch.Tensor  # int64 [B], -1 where the shards carry no class
    bad: tuple[BadInput, ...] = ()  # bad-input events met while filling this batch
    worker: int = 0  # the part of this rank's slice it came from (for resuming exactly)
    captions: tuple[str, ...] = ()  # one per sample ("" for padding) when the task reads them, else empty

    def to(self, device, non_blocking: bool = False) -> "Batch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return dataclasses.replace(self, ids=move(self.ids), weights=move(self.weights), images=move(self.images),
                                   labels=move(self.labels))

    def pin_memory(self) -> "Batch":
        """The DataLoader's pin_memory=True calls this: pinned tensors copy to CUDA without a host wait."""
        return dataclasses.replace(self, ids=self.ids.pin_memory(), weights=self.weights.pin_memory(),
                                   images=self.images.pin_memory(), labels=self.labels.pin_memory())

    def __reduce__(self):
        # From a loader worker: the small per-sample fields travel inside the message as numpy
        # arrays; only the images take a shared-memory segment, which the receiver must map.
        small = [t.numpy() if t.device.type == "cpu" else t for t in (self.ids, self.weights, self.labels)]
        return _rebuild, (small[0], small[1], self.images, small[2], self.bad, self.worker, self.captions)

    def undecodable(self) -> int:
        """Samples read for this batch but not decodable."""
        return sum(e.samples_lost for e in self.bad if e.undecodable)

    def __len__(self) -> int:
        return len(self.ids)


def _rebuild(ids, weights, images, labels, bad, worker, captions=()) -> Batch:
    return Batch(torch.as_tensor(ids), torch.as_tensor(weights), images, torch.as_tensor(labels), bad, worker,
                 captions)


def real_samples(batches) -> Iterator[Batch]:
    """The batches without their weight-0 padding (id -1); batches of padding only are left out."""
    for batch in batches:
        keep = batch.ids >= 0
        if bool(keep.all()):
            yield batch
        elif bool(keep.any()):
            captions = tuple(c for c, k in zip(batch.captions, keep.tolist()) if k)
            yield dataclasses.replace(batch, ids=batch.ids[keep], weights=batch.weights[keep],
                                      images=batch.images[keep], labels=batch.labels[keep], captions=captions)
