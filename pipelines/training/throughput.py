"""Samples a second per GPU and, on CUDA, model FLOPs utilisation (MFU) for the train records.

The training FLOPs of a sample (forward and backward, activation checkpointing's recomputation
included) are counted once a process, by torch.utils.flop_counter from the ops a forward and backward of
its first micro-batch dispatch: exactly what the task runs (MAE's masking, a bucket's shape, the text
path), with no second description of each task's batch on `meta`. Bucketed shapes differ in cost: the
first batch's bucket stands for all, which the docs say.
"""

from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

# Dense bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets (without sparsity). Matched in order
# against torch.cuda.get_device_name: the PCIe H100 before the SXM/NVL name it contains.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named `device_name`, or None (not in the table: no MFU is claimed)."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


class Throughput:
    """FLOPs a sample, counted once; samples/s per GPU and MFU between two train records."""

    def __init__(self, world: int, device: torch.device):
        self.world = world
        self.peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.flops_per_sample: float | None = None
        self.last: tuple[float, int] | None = None  # (time, samples forwarded) at the previous record

    def count_once(self, loss_of_a_batch, model: torch.nn.Module, rows: int) -> None:
        """At the process's first micro-batch: a forward and backward of `loss_of_a_batch()` times zero
        under the counter, its gradients dropped, the FLOPs over its `rows` (padding included: it is
        computed). Apart, not the step's own: ops seen by the counter may round differently, and a
        resumed process would count at another step than the straight run did. Every rank calls it,
        so the collectives of a sharded backward stay in step."""
        if self.flops_per_sample is not None:
            return
        counter = FlopCounterMode(display=False)
        with counter:
            (loss_of_a_batch().sum() * 0.0).backward()
        for param in model.parameters():
            param.grad = None
        self.flops_per_sample = counter.get_total_flops() / max(1, rows)

    def rates(self, samples_forwarded: int) -> dict:
        """samples/s per GPU since the previous call (every rank's samples over the world), the FLOPs of a
        sample and, where the device's peak is known, MFU. Empty at the first call."""
        now, last = time.perf_counter(), self.last
        self.last = (now, samples_forwarded)
        if last is None or now <= last[0] or samples_forwarded < last[1]:
            return {}
        per_gpu = (samples_forwarded - last[1]) / (now - last[0]) / self.world
        out = {"samples_per_s_per_gpu": per_gpu}
        if self.flops_per_sample:
            out["flops_per_sample"] = self.flops_per_sample
            if self.peak:
                out["mfu"] = per_gpu * self.flops_per_sample / self.peak
        return out


def rate_words(rates: dict) -> dict:
    """The progress bar's words for `rates`: samples/s a GPU, and MFU where known."""
    words = {}
    if "samples_per_s_per_gpu" in rates:
        words["per_gpu"] = f"{rates['samples_per_s_per_gpu']:.1f}/s"
    if "mfu" in rates:
        words["mfu"] = f"{rates['mfu']:.1%}"
    return words
