"""Gradient accumulation under DDP: one gradient all-reduce per optimizer step, not per micro-batch.

DDP decides at the forward whether the backward all-reduces, so a micro-batch that does not end an
optimizer step runs its forward *and* backward under `no_sync` (wrapping the backward alone would still
all-reduce every micro-batch). When the policy `on_nonfinite_loss=skip` drops the backward of the
micro-batch that ends a step (every rank agrees: the decision reads the all-gathered losses), DDP was
told at that forward to expect a synchronised backward, and the gradients the group accumulated are
not averaged yet: a backward of zero through every parameter completes that reduction, so every
replica applies the same update and DDP expects nothing more (else the next `no_sync` backward
would all-reduce, and a run resumed after the skip would sum in another order).

DDP also regroups its gradient buckets after a process's first synchronised backward (in the order
the gradients became ready), and beyond two ranks a reduction's sums depend on that layout: a
resumed process would sum the step after a resume in another order than the uninterrupted run, and
its weights would drift in the last bits (the cluster rehearsal checks it, docs/multinode.md).
`rebuild_buckets` makes every process regroup before its first real step.

Under fsdp and hsdp (parallel.py) each micro-batch's gradients are reduce-scattered as its backward runs,
so nothing waits for a group's last micro-batch and a skipped one needs no repair; FSDP2 has no buckets.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from prunepipe.pipelines.training.parallel import ModelParallel


def accumulation_group(micro: int, total: int, accum: int) -> tuple[bool, int]:
    """(does micro-batch `micro` of a pass of `total` end an optimizer step, how many micro-batches
    its step averages). The last group of a pass may be short: its loss is divided by its own size,
    not by `accum`, so its step is as large as any other."""
    start = micro - micro % accum
    size = min(accum, total - start)
    return micro + 1 == start + size, size


class GradientAccumulation:
    """Which micro-batches synchronise gradients, and the repair for a skipped step-ending one."""

    def __init__(self, accelerator, model: torch.nn.Module, accum: int, parallel: ModelParallel):
        self.accelerator, self.model, self.accum, self.parallel = accelerator, model, accum, parallel
        self.backwards_in_group = 0  # micro-batches of the current group whose backward ran
        # one process has no buckets to regroup, nor FSDP2 any
        self.buckets_rebuilt = accelerator.num_processes == 1 or parallel.sharded

    def rebuild_buckets(self, loss_of_a_batch) -> None:
        """Once per process, before its first real micro-batch (at a step boundary: a fresh start or
        a checkpoint), one synchronised backward of `loss_of_a_batch()` times zero, its gradients then
        dropped: DDP regroups its buckets at the next forward, so a fresh run and a resumed one reduce
        every step with the same layout. Costs one forward, backward and all-reduce per process start;
        changes no weight and no optimizer state (a model with batch-norm statistics would see one
        more forward: the tasks here have none)."""
        if self.buckets_rebuilt:
            return
        self.accelerator.backward(loss_of_a_batch().sum() * 0.0)
        for param in self.model.parameters():
            param.grad = None
        self.buckets_rebuilt = True

    def group(self, micro: int, total: int) -> tuple[bool, int]:
        return accumulation_group(micro, total, self.accum)

    def sync_context(self, is_step: bool):
        """Around forward and backward: `no_sync` unless this micro-batch ends an optimizer step (ddp)."""
        if self.parallel.sharded:
            self.parallel.before_forward(is_step)
            return nullcontext()
        return nullcontext() if is_step else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)
        self.backwards_in_group += 1

    def skipped(self, is_step: bool) -> None:
        """This micro-batch's backward did not run (on every rank alike). If it ended a step, finish
        the synchronised backward its forward announced with a zero loss through every parameter: DDP
        averages what the group accumulated. Gradients nobody computed stay None (`has_gradients`)."""
        if not (is_step and self.accelerator.num_processes > 1) or self.parallel.sharded:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.accelerator.backward(torch.stack([p.sum() for p in params]).sum() * 0.0)
        if not self.backwards_in_group:
            for param in params:
                param.grad = None

    @property
    def has_gradients(self) -> bool:
        """Whether any micro-batch of the current group reached its backward: a step with none has
        nothing to apply (and an fp16 GradScaler refuses to step without it)."""
        return self.backwards_in_group > 0

    def stepped(self) -> None:
        self.backwards_in_group = 0
