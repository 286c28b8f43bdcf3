"""The run's metric log: one JSON line per record in RUN/metrics.jsonl on rank 0, mirrored to
TensorBoard when it is installed. Train lines every `log_every` steps, pass summaries, eval records.
"""

from __future__ import annotations

import json
import os


class MetricsLog:
    """metrics.jsonl on rank 0 (and TensorBoard when it is installed)."""

    def __init__(self, run_dir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tensorboard = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:
                pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            step = record.get("optimizer_steps", 0)
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "optimizer_steps":
                    self.tensorboard.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)
