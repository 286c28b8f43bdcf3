"""The run's records in its folder: RUN/config.yaml as the run was started, and the metric log, one
JSON line per record in RUN/metrics.jsonl on rank 0, its numbers mirrored to the run's trackers (log_with:
pipelines/training/trackers.py). Train lines every `log_every` steps, pass summaries, eval records, previews'
validation losses, and a resume marker each time a run resumes from a checkpoint.

Every record has `kind` (train | pass | eval | preview | resume) and `optimizer_steps` (the steps done when it
was written). `pass_index` is the 0-based index of the pass: data, as in checkpoints and eval records,
while every line a user reads names that pass 1-based, "pass pass_index+1/N" (pipelines/progress.py).
An eval record's `pass` is that line's words ("after pass 5/40").

A resumed run trains again, and logs again, the steps between its checkpoint and the point the
earlier process was stopped at. So that the file holds one record per pass (and per step), the resumed
process first moves what the stopped one logged past its checkpoint into RUN/metrics_superseded.jsonl
(as written, a line cut by the kill too): every record with optimizer_steps > S, and the pass and eval
records of the pass it resumes inside (when S closed that pass, they were written after the checkpoint
and are written again). Then the marker {"kind": "resume", "event": "resume", "from_step": S,
"superseded": n, ...} says where. `pipelines/report/runs.py:read_metrics` reads files of older runs,
which kept both, as if they had been cleaned so: at each marker the later record wins.
"""

from __future__ import annotations

import json
import os
import re
import time

from prunepipe.pipelines.atomic_write import atomic_open
from prunepipe.pipelines.config import RunConfig, latent_shard_notes, to_yaml
from prunepipe.pipelines.data.description import DataDescription
from prunepipe.pipelines.progress import pass_label
from prunepipe.pipelines.training.trackers import log_record

RESUME = "resume"  # the `kind` (and `event`) of a resume marker
SUPERSEDED_FILE = "metrics_superseded.jsonl"  # what a stopped process logged past its checkpoint
PASS_RECORDS = ("pass", "eval")  # written at a pass's end: again by a run resumed inside that pass


def write_run_config(cfg: RunConfig, data: DataDescription | None = None) -> None:
    """RUN/config.yaml as given (on the main process), and the settings latent shards leave unused, said once
    (from `data`, the run's data description, where given)."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    for note in latent_shard_notes(cfg, data):
        print(f"prunepipe: note: {note}", flush=True)


class MetricsLog:
    """metrics.jsonl on rank 0, each record's numbers also to `accelerator`'s trackers (started by
    trackers.start_trackers; none when the run logs with none)."""

    def __init__(self, run_dir: str, enabled: bool, accelerator=None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.accelerator = accelerator

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._append(record)
        log_record(self.accelerator, record)

    def train_line(
        self, optimizer_steps: int, pass_index: int, loss: float, lr: float, samples_forwarded: int, rates: dict
    ):
        """A train record: the loss of the last batch consumed at step `optimizer_steps`, its lr, and the
        throughput since the previous one (pipelines/training/throughput.py)."""
        record = {"kind": "train", "optimizer_steps": optimizer_steps, "pass_index": pass_index, "loss": loss}
        self.write({**record, "lr": lr, "samples_forwarded": samples_forwarded, **rates})

    def resumed(self, checkpoint: str, *, optimizer_steps: int, pass_index: int, batch_in_pass: int) -> None:
        """The resume marker: this process continues from `checkpoint`, at step `optimizer_steps`,
        `batch_in_pass` batches into pass `pass_index` (0-based, as in every record)."""
        if not self.enabled:
            return
        superseded = self._move_superseded(int(optimizer_steps), int(pass_index), int(batch_in_pass))
        self._append(
            {
                "kind": RESUME,
                "event": RESUME,
                "from_step": int(optimizer_steps),
                "superseded": superseded,
                "optimizer_steps": int(optimizer_steps),
                "pass_index": int(pass_index),
                "batch_in_pass": int(batch_in_pass),
                "checkpoint": os.path.abspath(checkpoint),
                "time": time.time(),
            }
        )

    def _move_superseded(self, step: int, pass_index: int, batch_in_pass: int) -> int:
        """Move what the stopped process logged after the checkpoint at `step` (see the module's
        docstring) from metrics.jsonl to SUPERSEDED_FILE, the rest rewritten in place atomically;
        returns how many lines moved."""
        if not os.path.exists(self.path):
            return 0
        kept, moved = [], []
        with open(self.path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                line = line if line.endswith(b"\n") else line + b"\n"
                (moved if _superseded(line, step, pass_index, batch_in_pass) else kept).append(line)
        if not moved:
            return 0
        with open(os.path.join(os.path.dirname(self.path), SUPERSEDED_FILE), "ab") as f:
            f.writelines(moved)
        with atomic_open(self.path, "wb") as f:
            f.writelines(kept)
        return len(moved)

    def _append(self, record: dict) -> None:
        with open(self.path, "ab+") as f:  # appends always go to the end, wherever a read left off
            # a process killed mid-write leaves a line without its newline: end it, so that this
            # record starts a line of its own and only the cut one fails to parse
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(record) + "\n").encode())


def _superseded(line: bytes, step: int, pass_index: int, batch_in_pass: int) -> bool:
    """Whether a metrics.jsonl line is the stopped process's past a checkpoint at `step`, `batch_in_pass`
    batches into pass `pass_index`: a record after the step, a pass or eval record of that pass (written
    at its end, after the checkpoint), or a line the kill cut. Resume markers stay."""
    try:
        record = json.loads(line)
    except ValueError:
        return True
    if not isinstance(record, dict):
        return True
    if record.get("kind") == RESUME:
        return False
    if int(record.get("optimizer_steps", 0)) > step:
        return True
    inside = batch_in_pass > 0 and record.get("pass_index") == pass_index
    return inside and record.get("kind") in PASS_RECORDS


def open_metrics(run_dir: str, enabled: bool, resumed_from: str | None, position, accelerator=None) -> MetricsLog:
    """The run's MetricsLog (mirrored to `accelerator`'s trackers); on a resume, its marker first (the steps
    after the checkpoint, at `position`, are logged again: it says from where)."""
    metrics = MetricsLog(run_dir, enabled, accelerator)
    if resumed_from is not None:
        metrics.resumed(
            resumed_from,
            optimizer_steps=position.optimizer_steps,
            pass_index=position.pass_index,
            batch_in_pass=position.batch_in_pass,
        )
    return metrics


GRID_POINT = re.compile(r"_(s\d{3}|t\d{4})$")  # flow_mse_s005, denoise_mse_t0999: in metrics.jsonl, not the line


def format_pass(summary: dict, passes: int) -> str:
    """The printed line of a pass summary: kept share, steps, train loss, held-out means, time."""
    held = " ".join(
        f"{k} {v:.4f}"
        for k, v in summary.get("held_out", {}).items()
        if isinstance(v, float) and not GRID_POINT.search(k)
    )  # denoise_mse is the grid's mean
    kept = f"kept {summary['kept_fraction']:.1%}"
    lost = summary.get("lost_samples", 0)
    if lost:  # what trained, beside what the plan kept
        trained = (summary["kept_samples"] - lost) / max(1, summary["pass_length"])
        kept = f"kept {trained:.1%} ({summary['kept_fraction']:.1%} planned, {lost} lost to bad input)"
    return (
        f"{pass_label(summary['pass_index'], passes)}: {kept}, "
        f"{summary['steps_in_pass']} steps, train loss {summary['train_loss']:.4f}"
        f"{', held-out ' + held if held else ''}, {summary['wall_seconds']:.1f} s total"
    )
