"""Replication (memorisation) of a diffusion model: how close its samples are to their nearest training
images, judged against held-out images, which are by construction not copies (duplicated
training images are what diffusion models memorise and regurgitate). Reads the train and held-out
splits with the split reader; never generates, never trains, never downloads.

Two measures, each computed for the generated samples and for the held-out images alike:

- Relative pixel distance (Carlini et al. 2023, "Extracting training data from diffusion models",
  Sec. 5): ratio = d_1 / mean(d_1 .. d_k), the l2 distance to the nearest train image over the mean
  distance to the k nearest (their l(x, x'; S) with alpha = 0.5 is 2 * ratio). The ratio asks whether
  one train image is far closer than the neighbourhood, so it needs no absolute scale: a new image of
  a dense domain has near neighbours too, but no single one stands out. k = 50 is theirs. A sample is
  flagged (a copy) when ratio <= 0.2 (their l <= 0.4): on the bundled digits, a dense low-dimensional
  domain, no real digit comes that close to another (held-out against train: smallest ratio 0.24;
  train leave-one-out: 0.21), while train images under Gaussian noise of 2% of the range came to
  0.08-0.19 (200 of them; tests/test_replication.py copies 40). Pixels are 8-bit (as a saved PNG) and area-downsampled to at
  most `pixel_size` px so the search fits in memory; copies survive that. Its limit: a shift by one
  pixel already defeats l2, so it counts near-exact copies only. A copy of an image that has about k
  or more near-duplicates in train is not flagged either (the k nearest are all close): k must
  exceed the largest duplicate group, which the feature measure does not need.
- Nearest cosine similarity in a feature space (Somepalli et al. 2023, "Diffusion art or digital
  forgery?", "Understanding and mitigating copying in diffusion models"): a feature function passed
  in (SSCD or DINO from a local file for real images, pHash or the bundled classifier on small
  domains), L2-normalised rows, faiss inner-product search. A similarity means little on its own, so
  it is read against the held-out images' nearest similarities: the fraction of samples more similar
  to train than the held-out 95th / 99th percentile (5% / 1% for samples that copy no more than new
  images do). The pixel ratio gets the same comparison against the held-out 5th / 1st percentile.

Both searches are exact (faiss flat indexes) and stream the train split a chunk at a time, keeping each
query's k best: memory does not grow with `max_train`. On several ranks each rank reads its share of
both splits; the queries (samples and held-out images) are gathered to every rank, each rank searches
its share of train, and the per-rank k best are merged, so every rank ends with the same result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from prunepipe.pipelines.data.shards import index_metadata
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.fid import to_uint8
from prunepipe.pipelines.ranks import gather_in_index_order, gather_rows, rank_and_world

NEIGHBOURS = 50  # Carlini et al.'s n
THRESHOLD = 0.2  # flagged when d_1 / mean(d_1..d_k) <= this (their l <= 0.4 at alpha = 0.5)
PIXEL_SIZE = 64  # side the pixel search works at: 12,288 floats a colour image
TRAIN_ROWS_AT_ONCE = 4096  # train rows indexed per search: bounds memory whatever max_train is

# float images [N, C, H, W] in [0, 1] -> [N, D] rows (any array-like); L2-normalised here
FeatureFunction = Callable[[torch.Tensor], "np.ndarray | torch.Tensor"]


@dataclass
class Flagged:
    """A generated sample flagged as a copy of a train image."""

    sample: int  # the generated sample's index (its noise is keyed by it: sampling.py)
    train_id: int  # its nearest train image
    ratio: float  # d_1 / mean(d_1..d_k)
    distance: float  # d_1: l2 over the pixels in [0, 1] at the search's side


@dataclass
class Replication:
    """What `measure_replication` found: plain numbers, the flagged samples, per-query arrays."""

    numbers: dict
    flagged: list[Flagged]
    sample_ids: np.ndarray  # int64 [G]: the generated samples' indices, ascending
    ratios: np.ndarray  # float32 [G]
    nearest_train: np.ndarray  # int64 [G]: each sample's nearest train id in pixels
    held_out_ratios: np.ndarray  # float32 [H]
    similarities: np.ndarray | None = None  # float32 [G]: nearest cosine similarity in features
    held_out_similarities: np.ndarray | None = None
    similar_train: np.ndarray | None = None  # int64 [G]: the most similar train id in features
    pairs: torch.Tensor | None = field(default=None, repr=False)  # float [P, 2, C, s, s]: flagged, nearest

    def details(self) -> dict:
        """The numbers and the flagged samples, for an eval record (JSON)."""
        return {
            **self.numbers,
            "replication_flagged_samples": [
                {
                    "sample": f.sample,
                    "train_id": f.train_id,
                    "ratio": round(f.ratio, 6),
                    "distance": round(f.distance, 6),
                }
                for f in self.flagged
            ],
        }


# ----------------------------------------------------------------------------- rows
def check_images(images: torch.Tensor, what: str) -> None:
    """Float images [N, C, H, W], C = 1 or 3, square, in [0, 1]; the message names `what` and the fault."""
    if images.ndim != 4:
        raise ValueError(f"{what}: expected images [N, C, H, W], got a tensor of shape {list(images.shape)}")
    n, c, h, w = images.shape
    if c not in (1, 3):
        raise ValueError(f"{what}: images have {c} channels; accepted: 1 (grey) or 3 (RGB)")
    if h != w:
        raise ValueError(
            f"{what}: images are {h}x{w}; the splits are read as squares (data.resolution), "
            f"so the samples must be square too"
        )
    if n and (not images.is_floating_point() or float(images.min()) < 0 or float(images.max()) > 1):
        low, high = float(images.min()), float(images.max())
        raise ValueError(
            f"{what}: expected float images in [0, 1] (what generate_images yields), got values in "
            f"[{low:.3g}, {high:.3g}]; map [-1, 1] images with (x + 1) / 2"
        )


def eight_bit(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] -> the same on the CPU at 8 bits (as a saved PNG), still float in [0, 1]:
    what both searches measure, as FID feeds its networks."""
    return to_uint8(images.cpu()).float() / 255.0


def pixel_rows(pixels: torch.Tensor, side: int) -> np.ndarray:
    """float32 [N, C * s * s], s = min(side, H): `eight_bit` pixels area-downsampled, in memory of their
    own (the feature function is handed the same pixels next)."""
    x = pixels
    if x.shape[-1] > side:
        x = F.interpolate(x, size=(side, side), mode="area")
    return x.reshape(len(x), -1).numpy().astype(np.float32)


def feature_rows(feature: FeatureFunction, images: torch.Tensor) -> np.ndarray:
    """float32 [N, D] unit rows of `feature` on `eight_bit` images."""
    with torch.no_grad():
        out = feature(images)
    rows = np.asarray(out.detach().cpu().float() if isinstance(out, torch.Tensor) else out, dtype=np.float32)
    if rows.ndim != 2 or len(rows) != len(images):
        raise ValueError(
            f"replication feature {getattr(feature, '__name__', type(feature).__name__)}: expected "
            f"[{len(images)}, D] rows for {len(images)} images, got shape {list(rows.shape)}"
        )
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def _query_rows(
    batches: Iterable[tuple[np.ndarray, torch.Tensor]], side: int, feature: FeatureFunction | None, channels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(ids, pixel rows, feature rows or None) of every rank's images, in index order on every rank."""
    ids, pixels, features = [np.zeros(0, dtype=np.int64)], [np.zeros((0, channels * side * side), np.float32)], []
    for batch_ids, images in batches:
        ids.append(np.asarray(batch_ids, dtype=np.int64))
        images = eight_bit(images)
        pixels.append(pixel_rows(images, side))
        if feature is not None:
            features.append(feature_rows(feature, images))
    ids, pixels = np.concatenate(ids), np.concatenate(pixels)
    if feature is None:
        ids, pixels = gather_in_index_order(ids, pixels)
        return ids, pixels, None
    if not features:  # this rank has no images; the gather needs the rows' width all the same
        features = [feature_rows(feature, torch.zeros(1, channels, side, side))[:0]]
    return gather_in_index_order(ids, pixels, np.concatenate(features))


# ----------------------------------------------------------------------------- the search
class NearestTrain:
    """Each query's k nearest train rows in pixels (l2) and most similar one in features (cosine),
    exactly, over train rows added a chunk at a time (faiss flat indexes)."""

    def __init__(self, pixel_queries: np.ndarray, feature_queries: np.ndarray | None, k: int, keep_rows_of: int = 0):
        self.pixel_queries, self.feature_queries, self.k = pixel_queries, feature_queries, k
        q = len(pixel_queries)
        self.distances = np.full((q, k), np.inf, dtype=np.float32)  # l2, ascending
        self.ids = np.full((q, k), -1, dtype=np.int64)
        self.similarity = np.full(q, -np.inf, dtype=np.float32)
        self.similar_ids = np.full(q, -1, dtype=np.int64)
        # the nearest train row itself, for the first `keep_rows_of` queries (the pairs picture)
        self.nearest_rows = np.zeros((keep_rows_of, pixel_queries.shape[1]), dtype=np.float32)
        self.count = 0

    def add(self, ids: np.ndarray, pixels: np.ndarray, features: np.ndarray | None) -> None:
        """Train rows (ids [n], pixel rows [n, D], unit feature rows [n, E] or None) searched and merged in."""
        import faiss

        if pixels.shape[1] != self.pixel_queries.shape[1]:
            raise ValueError(
                f"train rows have {pixels.shape[1]} pixel values, the queries "
                f"{self.pixel_queries.shape[1]}: train and generated images differ in size or channels"
            )
        self.count += len(ids)
        index = faiss.IndexFlatL2(pixels.shape[1])
        index.add(np.ascontiguousarray(pixels))
        squared, where = index.search(self.pixel_queries, min(self.k, len(ids)))
        found = np.sqrt(np.maximum(squared, 0))  # faiss gives squared l2, a hair below 0 for equal rows
        distances = np.concatenate([self.distances, found], axis=1)
        candidates = np.concatenate([self.ids, ids[where]], axis=1)
        best = _nearest_first(distances, candidates)[:, : self.k]
        self.distances = np.take_along_axis(distances, best, axis=1)
        self.ids = np.take_along_axis(candidates, best, axis=1)
        if len(self.nearest_rows):
            kept = len(self.nearest_rows)
            moved = np.flatnonzero(best[:kept, 0] >= self.k)  # the nearest now comes from this chunk
            self.nearest_rows[moved] = pixels[where[moved, best[moved, 0] - self.k]]
        if self.feature_queries is not None:
            index = faiss.IndexFlatIP(features.shape[1])
            index.add(np.ascontiguousarray(features))
            similarity, where = index.search(self.feature_queries, 1)
            closer = similarity[:, 0] > self.similarity  # a tie keeps the earlier chunk's, smaller, id
            self.similarity[closer] = similarity[closer, 0]
            self.similar_ids[closer] = ids[where[closer, 0]]

    def merge_ranks(self) -> None:
        """Every rank's k best merged into the k best over all train rows, on every rank."""
        _, world = rank_and_world()
        if world == 1:
            return
        q, k = self.distances.shape
        distances = gather_rows(torch.from_numpy(self.distances)).numpy().reshape(world, q, k)
        ids = gather_rows(torch.from_numpy(self.ids)).numpy().reshape(world, q, k)
        distances = distances.transpose(1, 0, 2).reshape(q, world * k)
        ids = ids.transpose(1, 0, 2).reshape(q, world * k)
        best = _nearest_first(distances, ids)[:, :k]
        self.distances = np.take_along_axis(distances, best, axis=1)
        self.ids = np.take_along_axis(ids, best, axis=1)
        if self.feature_queries is not None:
            similarity = gather_rows(torch.from_numpy(self.similarity)).numpy().reshape(world, q)
            similar_ids = gather_rows(torch.from_numpy(self.similar_ids)).numpy().reshape(world, q)
            winner = np.lexsort((similar_ids, -similarity), axis=0)[0]  # most similar; a tie: the smaller id
            self.similarity = similarity[winner, np.arange(q)]
            self.similar_ids = similar_ids[winner, np.arange(q)]
        if len(self.nearest_rows):
            # read_split gives rank r the ids congruent to r: the nearest row lives on rank id % world
            rows = gather_rows(torch.from_numpy(self.nearest_rows)).numpy().reshape(world, len(self.nearest_rows), -1)
            owner = self.ids[: len(self.nearest_rows), 0] % world
            self.nearest_rows = rows[owner, np.arange(len(self.nearest_rows))]
        self.count = int(gather_rows(torch.tensor([self.count])).sum())

    def ratios(self) -> np.ndarray:
        """float32 [Q]: d_1 / mean(d_1..d_k); 0 where all k are at distance 0 (an exact copy, duplicated)."""
        finite = np.where(np.isfinite(self.distances), self.distances, np.nan)
        mean = np.nanmean(finite, axis=1)
        return np.divide(finite[:, 0], mean, out=np.zeros(len(mean), dtype=np.float32), where=mean > 0)


def _nearest_first(distances: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Column order of each row by distance, ties by train id: one process and several ranks, which
    see duplicates in another order, pick the same neighbours."""
    return np.lexsort((ids, distances), axis=1)


# ----------------------------------------------------------------------------- the measure
def _split_batches(folder: str, what: str, *, size: int, channels: int, max_samples: int, batch_size: int):
    """(ids, images in [0, 1]) of this rank's share of the first `max_samples` images of `folder`."""
    if "latent_shape" in index_metadata(folder):
        raise ValueError(
            f"replication {what} split {folder} holds latents; replication compares images: name "
            f"the image shards the latents were encoded from"
        )
    rank, world = rank_and_world()
    for batch in read_split(
        folder,
        resolution=size,
        channels=channels,
        batch_size=batch_size,
        max_samples=max_samples,
        rank=rank,
        world_size=world,
        desc=f"replication {what}",
    ):
        yield batch.ids.numpy(), (batch.images.float() + 1) / 2


def _chunks(batches, rows_at_once: int):
    """Batches of (ids, images) joined into chunks of about `rows_at_once` rows."""
    held, count = [], 0
    for ids, images in batches:
        held.append((ids, images))
        count += len(ids)
        if count >= rows_at_once:
            yield np.concatenate([i for i, _ in held]), torch.cat([x for _, x in held])
            held, count = [], 0
    if held:
        yield np.concatenate([i for i, _ in held]), torch.cat([x for _, x in held])


def _quantiles(values: np.ndarray, prefix: str, at: dict[str, float]) -> dict:
    return {f"{prefix}_{name}": float(np.quantile(values, q)) for name, q in at.items()} if len(values) else {}


def measure_replication(
    generated: torch.Tensor,
    train: str,
    held_out: str,
    *,
    feature: FeatureFunction | None = None,
    sample_ids: np.ndarray | None = None,
    max_train: int = 10000,
    held_out_samples: int = 1000,
    neighbours: int = NEIGHBOURS,
    threshold: float = THRESHOLD,
    pixel_size: int = PIXEL_SIZE,
    batch_size: int = 64,
    picture_pairs: int = 0,
) -> Replication:
    """How close `generated` (float [N, C, H, W] in [0, 1]: this rank's samples, with their indices
    `sample_ids`, default 0..N-1) come to the first `max_train` images of the `train` split (0 = all),
    against the first `held_out_samples` images of the `held_out` split (0 = all) as the baseline.
    Both splits are read at the samples' size and channels. Every rank calls it with its own samples
    and gets the same result. `picture_pairs` > 0 keeps that many flagged pairs' pixels for a picture."""
    check_images(generated, "generated samples")
    if os.path.abspath(train.rstrip("/")) == os.path.abspath(held_out.rstrip("/")):
        raise ValueError(
            f"replication: the held-out split {held_out} is the train split; the baseline needs "
            f"images the model never saw (data.val)"
        )
    if neighbours < 2:
        raise ValueError(
            f"replication: neighbours must be >= 2 (the ratio compares the nearest with the k nearest), "
            f"got {neighbours}"
        )
    size, channels = generated.shape[-1], generated.shape[1]
    indices = np.arange(len(generated)) if sample_ids is None else np.asarray(sample_ids, dtype=np.int64)
    if len(indices) != len(generated):
        raise ValueError(f"replication: {len(indices)} sample_ids for {len(generated)} generated images")
    side = min(pixel_size, size)

    mine = [(indices[i : i + batch_size], generated[i : i + batch_size]) for i in range(0, len(generated), batch_size)]
    sample_ids, sample_pixels, sample_features = _query_rows(mine, side, feature, channels)
    if len(sample_ids) == 0:
        raise ValueError("replication: no generated samples on any rank")
    held = _split_batches(
        held_out, "held-out", size=size, channels=channels, max_samples=held_out_samples, batch_size=batch_size
    )
    held_ids, held_pixels, held_features = _query_rows(held, side, feature, channels)
    if len(held_ids) == 0:
        raise ValueError(f"replication: the held-out split {held_out} holds no images; the baseline needs some")
    g = len(sample_ids)

    queries = np.concatenate([sample_pixels, held_pixels])
    feature_queries = None if feature is None else np.concatenate([sample_features, held_features])
    search = NearestTrain(queries, feature_queries, neighbours, keep_rows_of=g if picture_pairs else 0)
    train_batches = _split_batches(
        train, "train", size=size, channels=channels, max_samples=max_train, batch_size=batch_size
    )
    for chunk_ids, images in _chunks(train_batches, TRAIN_ROWS_AT_ONCE):
        images = eight_bit(images)
        search.add(chunk_ids, pixel_rows(images, side), None if feature is None else feature_rows(feature, images))
    search.merge_ranks()
    if search.count < 2:
        raise ValueError(
            f"replication: the train split {train} gave {search.count} images (max_train={max_train}); "
            f"the nearest-neighbour ratio needs at least 2"
        )
    k = min(neighbours, search.count)
    search.distances, search.ids = search.distances[:, :k], search.ids[:, :k]

    ratios = search.ratios()
    sample_ratios, held_ratios = ratios[:g], ratios[g:]
    copies = np.flatnonzero(sample_ratios <= threshold)
    flagged = sorted(
        (
            Flagged(int(sample_ids[i]), int(search.ids[i, 0]), float(sample_ratios[i]), float(search.distances[i, 0]))
            for i in copies
        ),
        key=lambda f: (f.ratio, f.sample),
    )
    numbers = {
        "replication_rate": len(copies) / g,
        "replication_rate_held_out": float(np.mean(held_ratios <= threshold)),
        "replication_flagged": len(copies),
        "replication_samples": g,
        "replication_held_out_samples": len(held_ids),
        "replication_train_samples": search.count,
        "replication_neighbours": k,
        "replication_threshold": threshold,
        "replication_pixel_size": side,
        # closer to train than 95% / 99% of the held-out images are
        "replication_closer_than_held_out_p95": float(np.mean(sample_ratios < np.quantile(held_ratios, 0.05))),
        "replication_closer_than_held_out_p99": float(np.mean(sample_ratios < np.quantile(held_ratios, 0.01))),
        **_quantiles(sample_ratios, "replication_ratio", {"q01": 0.01, "q05": 0.05, "q50": 0.5}),
        **_quantiles(held_ratios, "replication_ratio_held_out", {"q01": 0.01, "q05": 0.05, "q50": 0.5}),
    }
    result = Replication(numbers, flagged, sample_ids, sample_ratios, search.ids[:g, 0].copy(), held_ratios)
    if feature is not None:
        similarity, held_similarity = search.similarity[:g], search.similarity[g:]
        at = {"q50": 0.5, "q95": 0.95, "q99": 0.99, "max": 1.0}
        numbers.update(
            {
                "replication_feature_above_held_out_p95": float(
                    np.mean(similarity > np.quantile(held_similarity, 0.95))
                ),
                "replication_feature_above_held_out_p99": float(
                    np.mean(similarity > np.quantile(held_similarity, 0.99))
                ),
                **_quantiles(similarity, "replication_similarity", at),
                **_quantiles(held_similarity, "replication_similarity_held_out", at),
            }
        )
        result.similarities, result.held_out_similarities = similarity, held_similarity
        result.similar_train = search.similar_ids[:g].copy()
    if picture_pairs and len(copies):
        shown = [int(np.searchsorted(sample_ids, f.sample)) for f in flagged[:picture_pairs]]
        shape = (len(shown), channels, side, side)
        result.pairs = torch.stack(
            [
                torch.from_numpy(sample_pixels[shown]).reshape(shape),
                torch.from_numpy(search.nearest_rows[shown]).reshape(shape),
            ],
            dim=1,
        )
    return result


def save_pairs_picture(result: Replication, path: str) -> str | None:
    """A PNG of the flagged pairs, each sample beside its nearest train image (people check copies by
    eye), two pairs a row; None when nothing was flagged or no pairs were kept."""
    from torchvision.utils import save_image

    if result.pairs is None or not len(result.pairs):
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pairs = result.pairs
    save_image(pairs.reshape(-1, *pairs.shape[2:]), path, nrow=4, padding=1, pad_value=1.0)
    return path
