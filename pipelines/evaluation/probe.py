"""Linear probe of an MAE encoder: frozen features of unmasked images (mean of the patch tokens, or
the class token), standardised, a scikit-learn LogisticRegression with a fixed seed fitted on
labelled train images and scored on val. Never fine-tunes the encoder; reads no files itself.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn as nn
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from pipelines.evaluation.config import ProbeConfig


@torch.no_grad()
def encoder_features(encoder: nn.Module, batches: Iterable, pool: str = "avg") -> tuple[np.ndarray, np.ndarray]:
    """(features float64 [N, D], labels int64 [N]) of a timm VisionTransformer (MaskedAutoencoder.encoder
    or the exported encoder) on every image, no masking. `pool`: avg = mean of the patch tokens after
    the final norm, token = the class token. Padding (id < 0) is dropped."""
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device
    prefix = getattr(encoder, "num_prefix_tokens", 1)
    features, labels = [], []
    try:
        for batch in batches:
            keep = batch.ids >= 0
            tokens = encoder.forward_features(batch.images[keep].to(device))  # [N, prefix + L, D]
            pooled = tokens[:, 0] if pool == "token" else tokens[:, prefix:].mean(dim=1)
            features.append(pooled.double().cpu().numpy())
            labels.append(batch.labels[keep].numpy())
    finally:
        encoder.train(was_training)
    return np.concatenate(features), np.concatenate(labels).astype(np.int64)


def linear_probe(encoder: nn.Module, train_batches: Iterable, val_batches: Iterable, cfg: ProbeConfig | None = None,
                 seed: int = 0) -> dict:
    """Accuracy on val of a logistic regression on the encoder's standardised train features (all of
    them, or `cfg.per_class` per class). Samples without a class label (-1) are left out; with fewer
    than two classes the probe is skipped and says why."""
    cfg = cfg or ProbeConfig()
    train_x, train_y = encoder_features(encoder, train_batches, cfg.pool)
    val_x, val_y = encoder_features(encoder, val_batches, cfg.pool)
    train_x, train_y = train_x[train_y >= 0], train_y[train_y >= 0]
    val_x, val_y = val_x[val_y >= 0], val_y[val_y >= 0]
    classes = np.unique(train_y)
    if len(classes) < 2 or len(val_y) == 0:  # most web data: an image folder without class subfolders
        return {"probe_skipped": f"the train shards carry {len(classes)} class(es) and the val shards {len(val_y)} "
                                 f"labelled image(s) (fields cls/label/class); the probe needs two classes and "
                                 f"labelled val images (set probe.enabled=false to leave it out)"}
    if cfg.per_class > 0:  # few-shot: the first `per_class` images of each class, in index order
        pick = np.sort(np.concatenate([np.flatnonzero(train_y == c)[:cfg.per_class] for c in classes]))
        train_x, train_y = train_x[pick], train_y[pick]
    classifier = make_pipeline(StandardScaler(), LogisticRegression(C=cfg.C, max_iter=cfg.max_iter, random_state=seed))
    classifier.fit(train_x, train_y)
    return {
        "probe_accuracy": float(classifier.score(val_x, val_y)),
        "probe_train_accuracy": float(classifier.score(train_x, train_y)),
        "probe_train_samples": int(len(train_y)),
        "probe_val_samples": int(len(val_y)),
        "probe_pool": cfg.pool,
        "probe_per_class": cfg.per_class,
        "probe_feature_dim": int(train_x.shape[1]),
    }
