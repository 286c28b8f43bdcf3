"""Progress of long work, readable where it is written: a redrawn tqdm bar on a terminal; in a file
(every rank-0 log of a cluster job) a plain line at most every `every_seconds`, because a bar's
carriage-return frames would fill the log. Imports nothing of the project.

Passes are named one way wherever a user reads them, on screen and in logs: 1-based, "pass k/N"
(`pass_label`, `position_label`). Records (metrics.jsonl, eval records, checkpoints) store the
0-based index `pass_index`, which is data.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, TextIO

PLAIN_EVERY_SECONDS = 30.0


def writes_to_terminal(stream: TextIO | None = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class PlainProgress:
    """tqdm's update / set_postfix / close, printed as one line every `every_seconds` (none when the
    work finishes sooner: the caller prints its own summary)."""

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        unit: str = "it",
        unit_scale: float = 1,
        initial: int = 0,
        stream: TextIO | None = None,
        every_seconds: float = PLAIN_EVERY_SECONDS,
    ):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n, self.postfix = initial, ""
        self.stream = stream
        self.every_seconds = every_seconds
        self.start = self.last = time.monotonic()
        self.start_n = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_seconds:
            self.last = now
            print(self.line(now), file=self.stream or sys.stderr, flush=True)

    def line(self, now: float) -> str:
        done = self.n * self.unit_scale
        of = f"/{self.total * self.unit_scale:g}" if self.total else ""
        rate = (self.n - self.start_n) * self.unit_scale / max(now - self.start, 1e-9)
        return f"{self.desc}: {done:g}{of} {self.unit} ({rate:.1f} {self.unit}/s){self.postfix}"

    def set_postfix(self, **values) -> None:
        self.postfix = "".join(f", {key} {value}" for key, value in values.items())

    def close(self) -> None:
        pass


def pass_label(pass_index: int, passes: int) -> str:
    """The pass of 0-based index `pass_index` as a user reads it: "pass k/N", k from 1."""
    return f"pass {pass_index + 1}/{passes}"


def position_label(pass_index: int, batch_in_pass: int, passes: int) -> str:
    """A run's position (a checkpoint's `pass_index` and `batch_in_pass`: batches done in the pass) as a
    user reads it: "pass k/N, batch b" inside a pass, "after pass k/N" between passes."""
    if batch_in_pass > 0:
        return f"{pass_label(pass_index, passes)}, batch {batch_in_pass}"
    if pass_index == 0:
        return f"before {pass_label(0, passes)}"
    return f"after {pass_label(pass_index - 1, passes)}"


class EveryFewSeconds:
    """For lines a loop prints (one per pass): always on a terminal; in a file the first, then at most
    one every `seconds`, and those the caller forces (the last pass)."""

    def __init__(self, seconds: float = PLAIN_EVERY_SECONDS, stream: TextIO | None = None):
        self.seconds = seconds
        self.terminal = writes_to_terminal(stream if stream is not None else sys.stdout)
        self.last: float | None = None

    def due(self, force: bool = False) -> bool:
        now = time.monotonic()
        if self.terminal or force or self.last is None or now - self.last >= self.seconds:
            self.last = now
            return True
        return False


class _Silent(PlainProgress):
    def update(self, n: int = 1) -> None:
        self.n += n


def progress(
    total: int | None = None,
    *,
    desc: str = "",
    unit: str = "it",
    unit_scale: float = 1,
    initial: int = 0,
    disable: bool = False,
    every_seconds: float = PLAIN_EVERY_SECONDS,
):
    """A tqdm bar when stderr is a terminal, else a `PlainProgress`; nothing when `disable` (other
    ranks) or TQDM_DISABLE is set."""
    if disable or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
        return _Silent(total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial)
    if writes_to_terminal():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial, leave=False)
    return PlainProgress(
        total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial, every_seconds=every_seconds
    )


def pass_bar(total: int, initial: int, pass_index: int, passes: int, samples_a_batch: int, disable: bool):
    """A pass's bar, counted in batches and shown in samples over all ranks: the rate reads as samples/s."""
    desc = pass_label(pass_index, passes)
    return progress(total, initial=initial, disable=disable, desc=desc, unit="sample", unit_scale=samples_a_batch)


def tracked(items: Iterable, *, total: int | None = None, desc: str = "", unit: str = "it") -> Iterator:
    """`items`, counted on a `progress` as they are consumed."""
    bar = progress(total if total is not None else _length(items), desc=desc, unit=unit)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()


def _length(items) -> int | None:
    try:
        return len(items)
    except TypeError:
        return None
