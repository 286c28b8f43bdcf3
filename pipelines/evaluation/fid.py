"""FID with torchmetrics' FrechetInceptionDistance: the feature network (Inception-v3 from a local
weights file, the small-domain classifier, or any module), reference statistics of real images
cached once beside their shards, and feature statistics summed over ranks. It never downloads and
never generates images (evaluate_sampling.py does).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torchmetrics.image.fid import FrechetInceptionDistance

from prunepipe.pipelines.atomic_write import atomic_open
from prunepipe.pipelines.data.shards import index_file
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.config import FIDConfig
from prunepipe.pipelines.ranks import decided_on_rank0, on_every_rank, rank_and_world

# torch-fidelity's Inception-v3 (the TF FID graph of 2015-12-05, converted); torchmetrics loads it.
INCEPTION_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
)
INCEPTION_FILE = os.path.basename(INCEPTION_URL)
# pytorch-fid's name for the same file (the same sha256 prefix, 6726825d, that torch.hub names carry)
INCEPTION_FILE_PYTORCH_FID = "pt_inception-2015-12-05-6726825d.pth"
CLASSIFIER_FILE = "feature_net.safetensors"  # tools/commands/feature_net.py's default output


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] -> uint8 by rounding, as writing them to PNG would (torchmetrics'
    `normalize=True` truncates instead, which turns a decoded 255 into 254 after float error)."""
    return (images.float() * 255).round_().clamp_(0, 255).to(torch.uint8)


def uint8_rgb(images: torch.Tensor) -> torch.Tensor:
    """Float images [N, C, H, W] in [0, 1] -> uint8 RGB [N, 3, H, W] (`to_uint8`, grey repeated), as
    saved to PNG: what Inception and CLIP's processor are fed."""
    pixels = to_uint8(images)
    return pixels.expand(-1, 3, -1, -1) if pixels.shape[1] == 1 else pixels


def file_digest(path: str) -> str:
    """First 12 hex digits of the file's sha256: feature networks are told apart by their weights."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


@dataclass
class FeatureNet:
    """What FrechetInceptionDistance is built from, and a name that identifies its features."""

    feature: int | nn.Module  # an Inception feature size, or a module: float [0, 1] images -> [N, D]
    identity: str  # cache key: which network with which weights (and resize)
    weights_path: str | None = None
    antialias: bool = False  # Inception resize to 299 px: False = TF1-compatible bilinear

    @property
    def is_inception(self) -> bool:
        return isinstance(self.feature, int)

    def metric(self) -> FrechetInceptionDistance:
        """A fresh metric whose real statistics survive `reset()` (they are installed once)."""
        if self.is_inception:
            return FrechetInceptionDistance(
                feature=self.feature,
                feature_extractor_weights_path=self.weights_path,
                antialias=self.antialias,
                normalize=False,
                reset_real_features=False,
            )
        return FrechetInceptionDistance(feature=self.feature, normalize=True, reset_real_features=False)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """Float images [N, C, H, W] in [0, 1] -> the network's input, quantised to 8 bits for every
        network so generated images are measured as if saved to PNG, like the real ones were."""
        if self.is_inception:
            return uint8_rgb(images)
        return to_uint8(images).float() / 255.0


def inception_weights(cfg: FIDConfig) -> str:
    """Where the Inception-v3 weights are read from: fid.weights, else torch hub's checkpoints folder under
    either name the file goes by (the first name when neither is there)."""
    hub = os.path.join(torch.hub.get_dir(), "checkpoints")
    found = [
        os.path.join(hub, n)
        for n in (INCEPTION_FILE, INCEPTION_FILE_PYTORCH_FID)
        if os.path.isfile(os.path.join(hub, n))
    ]
    return cfg.weights or (found[0] if found else os.path.join(hub, INCEPTION_FILE))


def missing_inception(cfg: FIDConfig, path: str) -> str:
    """Why FID cannot be computed without the Inception weights at `path`, and how to bring them."""
    return (
        f"fid.weights={cfg.weights!r}: no Inception-v3 weights at {path}. This machine never downloads: "
        f"fetch {INCEPTION_URL} on a connected machine, copy it here and pass fid.weights=PATH (or put it "
        f"at {path}); see docs/evaluation.md. For small domains use fid.feature=classifier"
    )


def feature_net_from_config(cfg: FIDConfig, shards_root: str = "") -> FeatureNet:
    """The network `fid.feature` names, loaded from local files only. `shards_root` is where the
    classifier is looked for when `fid.weights` is empty (the folder holding train/ and val/)."""
    if cfg.feature == "inception":
        path = inception_weights(cfg)
        if not os.path.isfile(path):
            raise FileNotFoundError(missing_inception(cfg, path))
        return FeatureNet(
            cfg.inception_dim,
            f"inception{cfg.inception_dim}-{cfg.resize}-{file_digest(path)}",
            path,
            antialias=cfg.resize == "antialias",
        )
    if cfg.feature == "classifier":
        from prunepipe.pipelines.evaluation.features import load_classifier

        path = classifier_weights(cfg, shards_root)
        if not os.path.isfile(path):
            raise FileNotFoundError(missing_classifier(cfg, path, shards_root))
        return FeatureNet(load_classifier(path), f"classifier-{file_digest(path)}", path)
    _, module_name, factory_name = cfg.feature.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"fid.feature={cfg.feature!r}: cannot import {factory_name} from {module_name}: {e}") from e
    module = factory(cfg.weights or None)
    if not isinstance(module, nn.Module):
        raise TypeError(f"fid.feature={cfg.feature!r}: the factory returned {type(module).__name__}, not an nn.Module")
    weights_id = file_digest(cfg.weights) if cfg.weights else "noweights"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{module_name}.{factory_name}")
    return FeatureNet(module.eval().requires_grad_(False), f"module-{name}-{weights_id}", cfg.weights or None)


def classifier_weights(cfg: FIDConfig, shards_root: str) -> str:
    """Where the small-domain classifier is read from: fid.weights, else beside the shards."""
    return cfg.weights or os.path.join(shards_root, CLASSIFIER_FILE)


def missing_classifier(cfg: FIDConfig, path: str, shards_root: str) -> str:
    return (
        f"fid.weights={cfg.weights!r}: no small-domain classifier at {path}; write one with "
        f"`python -m prunepipe.tools.commands.feature_net --shards {shards_root or 'SHARDS'}` (seconds on a CPU, "
        f"labelled shards) or pass fid.weights=PATH"
    )


def shards_root_of(folder: str) -> str:
    """The folder holding a split's folder (train/, val/): where the classifier is looked for."""
    return os.path.dirname(os.path.abspath(folder.rstrip("/")))


def load_feature_net(cfg: FIDConfig, folder: str) -> FeatureNet:
    """`feature_net_from_config` for images of the shards in `folder` (the classifier is looked for
    beside it), loaded by every rank from its node's disk: a node without the file stops every rank."""
    shards_root = shards_root_of(folder)
    return on_every_rank(lambda: feature_net_from_config(cfg, shards_root))


# ----------------------------------------------------------------------------- reference statistics
@dataclass
class ReferenceStats:
    """Sums of real features over all ranks, in the form torchmetrics' FID accumulates."""

    features_sum: torch.Tensor  # float64 [D]
    cov_sum: torch.Tensor  # float64 [D, D]: sum of outer products
    num_samples: int


def reference_cache_path(folder: str, net: FeatureNet, resolution: int, count: int, stats_dir: str = "") -> str:
    """`fid_stats/<network>_<resolution>px_<count>_<index digest>.npz` beside the shards (or in
    `stats_dir`): a changed index.json, network, resolution or count is a different file."""
    index = index_file(folder)
    name = f"{net.identity}_{resolution}px_{count}_{file_digest(index)}.npz"
    return os.path.join(stats_dir or os.path.join(os.path.dirname(os.path.abspath(index)), "fid_stats"), name)


def reference_statistics(
    folder: str,
    net: FeatureNet,
    metric: FrechetInceptionDistance,
    *,
    resolution: int,
    channels: int,
    max_samples: int,
    batch_size: int,
    stats_dir: str = "",
) -> tuple[ReferenceStats, str, bool]:
    """(statistics, cache path, whether they came from the cache). Computed once, split over ranks,
    summed, and written by rank 0 atomically; every rank returns the global statistics. Rank 0 alone
    looks for the cache and hands what it read to every rank: ranks that looked for themselves could
    disagree (a file written between their checks, a node-local `stats_dir`) and then one would wait
    in the all-reduce below that another never joins."""
    from prunepipe.pipelines.data.shards import ShardIndex

    count = ShardIndex.load(folder).num_samples
    count = count if max_samples <= 0 else min(count, max_samples)
    path = reference_cache_path(folder, net, resolution, count, stats_dir)
    cached = decided_on_rank0(lambda: _read_cache(path))
    if cached is not None:
        return cached, path, True
    rank, world = rank_and_world()
    extractor = metric.inception  # the network torchmetrics built (for Inception: from the weights file)
    dim = int(metric.real_features_sum.shape[0])
    sums = [
        torch.zeros(dim, dtype=torch.float64, device=metric.device),
        torch.zeros(dim, dim, dtype=torch.float64, device=metric.device),
        torch.zeros((), dtype=torch.int64, device=metric.device),
    ]
    with torch.no_grad():
        for batch in read_split(
            folder,
            resolution=resolution,
            channels=channels,
            batch_size=batch_size,
            max_samples=count,
            rank=rank,
            world_size=world,
            desc=f"FID reference {folder}",
        ):
            # the same sums FrechetInceptionDistance.update accumulates
            features = extractor(net.prepare((batch.images.to(metric.device) + 1) / 2)).double()
            sums[0] += features.sum(dim=0)
            sums[1] += features.T @ features
            sums[2] += len(features)
    if world > 1:
        for tensor in sums:
            dist.all_reduce(tensor)
    stats = ReferenceStats(sums[0].cpu(), sums[1].cpu(), int(sums[2]))
    if stats.num_samples != count:
        raise RuntimeError(f"{folder}: FID reference read {stats.num_samples} images, expected {count}")
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_open(path, "wb") as f:  # a file, not a name: np.savez would add `.npz` to a name
            np.savez(
                f,
                features_sum=stats.features_sum.numpy(),
                cov_sum=stats.cov_sum.numpy(),
                num_samples=stats.num_samples,
                identity=net.identity,
                resolution=resolution,
                folder=os.path.abspath(folder),
            )
    return stats, path, False


def _read_cache(path: str) -> ReferenceStats | None:
    """The statistics cached at `path`, or None when there is no such file."""
    if not os.path.isfile(path):
        return None
    with np.load(path) as saved:
        return ReferenceStats(
            torch.from_numpy(saved["features_sum"]), torch.from_numpy(saved["cov_sum"]), int(saved["num_samples"])
        )


# ----------------------------------------------------------------------------- the evaluator
class FIDEvaluator:
    """FID of image batches against one real set; build once, `score()` at every evaluation.

    Every rank scores its own share of the generated images; torchmetrics sums the feature
    statistics over ranks in `compute()`. The real statistics live on rank 0 only, so that sum
    counts them once.
    """

    def __init__(
        self,
        net: FeatureNet,
        reference_folder: str,
        *,
        resolution: int,
        channels: int,
        max_reference: int = 0,
        batch_size: int = 64,
        stats_dir: str = "",
        device: str | torch.device = "cpu",
    ):
        self.net = net
        self.metric = net.metric().to(device)
        self.reference, self.cache_path, self.cached = reference_statistics(
            reference_folder,
            net,
            self.metric,
            resolution=resolution,
            channels=channels,
            max_samples=max_reference,
            batch_size=batch_size,
            stats_dir=stats_dir,
        )
        self._install_reference()

    @classmethod
    def from_config(
        cls,
        cfg: FIDConfig,
        reference_folder: str,
        *,
        resolution: int,
        channels: int,
        device: str | torch.device = "cpu",
    ) -> "FIDEvaluator":
        net = load_feature_net(cfg, reference_folder)
        return cls(
            net,
            reference_folder,
            resolution=resolution,
            channels=channels,
            max_reference=cfg.reference_samples,
            batch_size=cfg.batch_size,
            stats_dir=cfg.stats_dir,
            device=device,
        )

    def _install_reference(self) -> None:
        rank, _ = rank_and_world()
        m, ref = self.metric, self.reference
        keep = 1.0 if rank == 0 else 0.0
        m.real_features_sum = (ref.features_sum * keep).to(m.device, torch.float64)
        m.real_features_cov_sum = (ref.cov_sum * keep).to(m.device, torch.float64)
        m.real_features_num_samples = torch.tensor(ref.num_samples if rank == 0 else 0, device=m.device)

    def score(self, image_batches: Iterable[torch.Tensor]) -> dict:
        """FID of the images (float [N, C, H, W] in [0, 1]) of every rank against the reference."""
        self.metric.reset()  # the fake statistics only: reset_real_features is False
        self._install_reference()
        for images in image_batches:
            self.metric.update(self.net.prepare(images.to(self.metric.device)), real=False)
        fid = float(self.metric.compute())
        fake = self.metric.fake_features_num_samples.clone()
        rank, world = rank_and_world()
        if world > 1:
            dist.all_reduce(fake)
        return {
            "fid": fid,
            "fid_samples": int(fake),
            "fid_reference_samples": self.reference.num_samples,
            "fid_feature": self.net.identity,
            "fid_reference_cache": self.cache_path,
        }
