"""What the loop keeps per aspect-ratio bucket of a bucketed index (index.json's `buckets`): each sample's
bucket from its shard, the samples each bucket forwarded, and the pass's per-bucket accounting (kept by
the layout, forwarded, mean training loss). Without buckets all of it is absent.
"""

from __future__ import annotations

import numpy as np

from prunepipe.pipelines.data.shards import ShardIndex


class BucketTally:
    """Per-bucket counts of one run; the pass's loss sums restart each pass (a resumed pass reports the
    part it trained, as train_loss does)."""

    def __init__(self, index: ShardIndex):
        self.names = index.bucket_names
        self.index = index
        self.loss_sum = np.zeros(len(self.names), dtype=np.float64)
        self.loss_count = np.zeros(len(self.names), dtype=np.int64)

    @property
    def active(self) -> bool:
        return bool(self.names)

    def bucket_of(self, ids: np.ndarray) -> np.ndarray:
        """int64 per (real) global id: its bucket, the bucket of the shard that holds it."""
        return self.index.buckets[self.index.shard_of(ids)]

    def saw(self, ids: np.ndarray, losses: np.ndarray) -> np.ndarray:
        """Count a step's real samples (every rank's, as gathered); returns int64 [B]: each bucket's."""
        buckets = self.bucket_of(ids)
        self.loss_sum += np.bincount(buckets, weights=losses, minlength=len(self.names))
        counts = np.bincount(buckets, minlength=len(self.names)).astype(np.int64)
        self.loss_count += counts
        return counts

    def pass_accounting(self, kept: np.ndarray | None, forwarded: np.ndarray | None) -> dict:
        """Per bucket: samples the pass kept (the layout's), forwarded so far in the run (all ranks,
        padding excluded), and the mean training loss of the pass's samples of it (None when none)."""
        zeros = np.zeros(len(self.names), dtype=np.int64)
        kept = zeros if kept is None else kept
        forwarded = zeros if forwarded is None else forwarded
        record = {}
        for b, name in enumerate(self.names):
            mean = float(self.loss_sum[b] / self.loss_count[b]) if self.loss_count[b] else None
            record[name] = {"kept": int(kept[b]), "forwarded": int(forwarded[b]), "train_loss": mean}
        self.loss_sum[:] = 0.0
        self.loss_count[:] = 0
        return record
