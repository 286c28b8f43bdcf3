"""Linear probe of an MAE encoder: frozen features of unmasked images (mean of the patch tokens, or
the class token), standardised, a scikit-learn LogisticRegression with a fixed seed fitted on
labelled train images and scored on val. Never fine-tunes the encoder; reads no files itself. The
features may come from several ranks (pipelines/ranks.py gathers them in index order);
the fit itself is deterministic, so every rank can run it on the same arrays.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn as nn
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from prunepipe.pipelines.evaluation.config import ProbeConfig
from prunepipe.pipelines.evaluation.precision import forward_precision


@torch.no_grad()
def encoder_features(
    encoder: nn.Module, batches: Iterable, pool: str = "avg", precision: str = "fp32"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int64 [N], features float64 [N, D], labels int64 [N]) of a timm VisionTransformer
    (MaskedAutoencoder.encoder or the exported encoder) on every image, no masking. `pool`: avg = mean
    of the patch tokens after the final norm, token = the class token. Padding (id < 0) is dropped.
    `precision`: that of the encoder's forward (pipelines/evaluation/precision.py)."""
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device
    prefix = getattr(encoder, "num_prefix_tokens", 1)
    ids, features, labels = [np.zeros(0, dtype=np.int64)], [], [np.zeros(0, dtype=np.int64)]
    try:
        for batch in batches:
            keep = batch.ids >= 0
            with forward_precision(precision, device):
                tokens = encoder.forward_features(batch.images[keep].to(device))  # [N, prefix + L, D]
            pooled = tokens[:, 0] if pool == "token" else tokens[:, prefix:].mean(dim=1)
            features.append(pooled.double().cpu().numpy())
            ids.append(batch.ids[keep].numpy())
            labels.append(batch.labels[keep].numpy())
    finally:
        encoder.train(was_training)
    # a rank whose share is empty still returns [0, D] features, so the gather sees one shape
    dim = features[0].shape[1] if features else int(getattr(encoder, "num_features", getattr(encoder, "embed_dim", 0)))
    return (
        np.concatenate(ids).astype(np.int64),
        np.concatenate([np.zeros((0, dim)), *features]),
        np.concatenate(labels).astype(np.int64),
    )


def fit_probe(
    train_x: np.ndarray,
    train_y: np.ndarray,
    val_x: np.ndarray,
    val_y: np.ndarray,
    cfg: ProbeConfig | None = None,
    seed: int = 0,
) -> dict:
    """The probe on features in index order (train [N, D], val [M, D]) and their labels. Samples
    without a class label (-1) are left out; with fewer than two classes the probe is skipped and
    says why. Deterministic: the same arrays give the same numbers on every rank."""
    cfg = cfg or ProbeConfig()
    train_x, train_y = train_x[train_y >= 0], train_y[train_y >= 0]
    val_x, val_y = val_x[val_y >= 0], val_y[val_y >= 0]
    classes = np.unique(train_y)
    if len(classes) < 2 or len(val_y) == 0:  # most web data: an image folder without class subfolders
        return {
            "probe_skipped": f"the train shards carry {len(classes)} class(es) and the val shards {len(val_y)} "
            f"labelled image(s) (fields cls/label/class); the probe needs two classes and "
            f"labelled val images (set probe.enabled=false to leave it out)"
        }
    if cfg.per_class > 0:  # few-shot: the first `per_class` images of each class, in index order
        pick = np.sort(np.concatenate([np.flatnonzero(train_y == c)[: cfg.per_class] for c in classes]))
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
