"""Where a run is, saved in every checkpoint beside the model: pass, batch in the pass, counters, and
for a pass resumed under another layout the samples already consumed (packed bitmaps).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from prunepipe.pruning.bitmap import Bitmap

COUNT_TABLES = ("undecodable", "forwarded_by_source", "forwarded_by_bucket")  # int64 arrays, saved as lists


@dataclass
class TrainingPosition:
    """Where the run is: enough, with the pruner's frozen plan, to continue the pass exactly."""

    pass_index: int = 0
    batch_in_pass: int = 0  # micro-batches of this rank already trained in the pass (or segment)
    optimizer_steps: int = 0
    samples_forwarded: int = 0  # over all ranks, padding excluded
    skipped_nonfinite: int = 0
    bad_samples: int = 0
    bad_samples_at_pass_start: int = 0  # bad_samples when this pass began: the pass's own losses are the rest
    wall_seconds: float = 0.0
    world_size: int = 1  # the layout the pass was running under
    num_workers: int = 0
    # A pass resumed under another world size continues as a "segment" over the samples no rank
    # had trained on: `excluded` marks those already consumed when it began, `pass_offset` is
    # the fraction of the pass they were (for the LR schedule).
    pass_offset: float = 0.0
    excluded: Bitmap | None = None  # 1 bit per sample, or None
    consumed: Bitmap | None = None  # 1 bit per sample: ids trained on in this pass, on every rank
    # int64 [world * workers * max(1, buckets)]: undecodable samples each rank's worker part met in this
    # pass so far, per sample stream: entry (rank * workers + worker) * max(1, buckets) + bucket, where
    # buckets is the index's aspect-ratio buckets (0 when unbucketed: one entry per worker part, as
    # before buckets); a resume under the same layout skips them with the batches they were read for.
    undecodable: np.ndarray | None = None
    # text-conditional runs: the text encoder's files and caption length (pipelines/tasks/diffusion/text.py
    # identity_key), in the loop or behind precomputed features; a resume refuses others (other features)
    text_identity: str = ""
    # the sources of data.train as pipelines/data/mixture.py records them (JSON: names, sizes, offsets,
    # rules); a resume refuses another mixture
    mixture: str = ""
    forwarded_by_source: np.ndarray | None = None  # int64 [K]: samples each source forwarded so far, all ranks
    # the aspect-ratio buckets of data.train (JSON: each bucket's name and shape; "" unbucketed); a resume
    # refuses others
    buckets: str = ""
    forwarded_by_bucket: np.ndarray | None = None  # int64 [B]: the same per aspect-ratio bucket (bucketed shards)

    def state_dict(self) -> dict:
        state = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in COUNT_TABLES and value is not None:
                state[f.name] = [int(v) for v in value]
            elif isinstance(value, Bitmap):  # packed bits as in memory: N / 8 bytes, no unpacked copy
                state[f.name] = torch.from_numpy(value.packed)
                state[f.name + "_len"] = len(value)
            elif value is not None:
                state[f.name] = value
        return state

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in ("excluded", "consumed"):
                packed = state.get(f.name)  # np.packbits order, as state_dict writes it
                if isinstance(packed, torch.Tensor):
                    packed = packed.numpy()
                value = (
                    None if packed is None else Bitmap(np.array(packed, dtype=np.uint8), int(state[f.name + "_len"]))
                )
                setattr(self, f.name, value)
            elif f.name in COUNT_TABLES:
                value = state.get(f.name)
                setattr(self, f.name, None if value is None else np.asarray(value, dtype=np.int64))
            elif f.name in state:
                setattr(self, f.name, type(f.default)(state[f.name]))
