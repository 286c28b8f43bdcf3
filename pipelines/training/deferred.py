"""Step k's gathered (ids, scores, strata), handed to the host one step late, so the step never waits
for the device.

The loop gathers on the device and starts a non-blocking copy into pinned host memory; the record
is consumed `lag` steps later, when that copy has long finished behind the next step's work. The
loop drains every record before a checkpoint and at a pass end, so what a checkpoint holds is what
immediate updates would have left. Nothing here knows about pruners or tasks: the loop's `consume`
does, in the order the records were made.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass
class StepRecord:
    """One micro-batch's gathered batch and what its consumer needs to know about the step."""

    step: int  # optimizer steps before this micro-batch
    pass_index: int
    micro: int  # micro-batch within the pass
    lr: float
    is_step: bool  # the optimizer stepped after this micro-batch
    ids: torch.Tensor | None  # int64 [world * B] on the host (None: the batch was skipped)
    scores: torch.Tensor | None  # float32 [world * B]
    strata: torch.Tensor | None  # int64 [world * B] or None
    ready: torch.cuda.Event | None = None  # recorded after the copies were enqueued

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids, scores, strata) as numpy, once the copies have landed."""
        if self.ready is not None:
            self.ready.synchronize()  # a step old: finished unless the host runs far ahead
        strata = None if self.strata is None else self.strata.numpy()
        return self.ids.numpy(), self.scores.numpy(), strata


def to_host(*tensors: torch.Tensor | None) -> tuple[list[torch.Tensor | None], torch.cuda.Event | None]:
    """Copies of `tensors` on the host (pinned, non-blocking from CUDA) and the event that marks them done."""
    if not any(t is not None and t.device.type == "cuda" for t in tensors):
        return [None if t is None else t.detach() for t in tensors], None
    copies = []
    for t in tensors:
        if t is None:
            copies.append(None)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        copies.append(host)
    event = torch.cuda.Event()
    event.record()
    return copies, event


class DeferredRecords:
    """A queue of StepRecords consumed `lag` records after they were pushed (0: at once)."""

    def __init__(self, consume: Callable[[StepRecord], None], lag: int = 1):
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.consume, self.lag = consume, lag
        self.pending: collections.deque[StepRecord] = collections.deque()

    def push(self, record: StepRecord) -> None:
        self.pending.append(record)
        while len(self.pending) > self.lag:
            self.consume(self.pending.popleft())

    def drain(self) -> None:
        """Consume everything pending: before a checkpoint, at a pass end, before the run stops."""
        while self.pending:
            self.consume(self.pending.popleft())
