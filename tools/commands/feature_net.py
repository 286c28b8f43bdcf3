"""Train the small classifier whose features FID uses on small labelled domains (the bundled
digits): deterministic (fixed seed, CPU, seconds), written to one local file that
`fid.feature=classifier fid.weights=PATH` loads. Small domains only; it never downloads.

    python -m prunepipe.tools.commands.feature_net --shards data/digits [--out data/digits/feature_net.safetensors]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F

from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.features import SmallClassifier, save_classifier
from prunepipe.pipelines.progress import progress

DEFAULT_NAME = "feature_net.safetensors"  # beside train/ and val/: where fid.feature=classifier looks


def load_labelled(folder: str, resolution: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All images of a split in [0, 1] and their labels; refuses shards without class labels."""
    images, labels = [], []
    for batch in read_split(folder, resolution=resolution, channels=channels, batch_size=256):
        images.append((batch.images + 1) / 2)
        labels.append(batch.labels)
    x, y = torch.cat(images), torch.cat(labels)
    if bool((y < 0).any()):
        raise ValueError(
            f"{folder}: {int((y < 0).sum())} samples carry no class label (field cls/label/class); "
            f"the feature network is a classifier and needs them"
        )
    return x, y


def train_feature_net(
    shards: str,
    out: str | None = None,
    *,
    image_size: int = 32,
    channels: int = 3,
    net_resolution: int = 16,
    epochs: int = 5,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> tuple[str, dict]:
    """Fit SmallClassifier on `shards`/train (decoded at `image_size`, seen by the net at
    `net_resolution`), score it on `shards`/val; returns (path, info)."""
    train_x, train_y = load_labelled(os.path.join(shards, "train"), image_size, channels)
    val_x, val_y = load_labelled(os.path.join(shards, "val"), image_size, channels)
    num_classes = int(max(train_y.max(), val_y.max())) + 1
    with torch.random.fork_rng(devices=[]):  # the initialisation is seeded without touching the caller's RNG
        torch.manual_seed(seed)
        model = SmallClassifier(channels, net_resolution, num_classes=num_classes)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    steps = epochs * ((len(train_x) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    bar = progress(steps, desc="feature net", unit="step")
    for _ in range(epochs):
        permutation = torch.randperm(len(train_x), generator=order)
        for start in range(0, len(train_x), batch_size):
            pick = permutation[start : start + batch_size]
            loss = F.cross_entropy(model.classify(train_x[pick]), train_y[pick])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    model.eval()
    with torch.no_grad():
        accuracy = float((model.classify(val_x).argmax(1) == val_y).float().mean())
    info = dict(
        shards=os.path.abspath(shards),
        seed=seed,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        train_samples=len(train_x),
        val_samples=len(val_x),
        val_accuracy=accuracy,
        class_counts=np.bincount(train_y.numpy(), minlength=num_classes).tolist(),
    )
    out = out or os.path.join(shards, DEFAULT_NAME)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_classifier(model, out, **info)
    return out, info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m prunepipe.tools.commands.feature_net",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shards", required=True, help="folder with train/ and val/ labelled image shards")
    parser.add_argument("--out", help=f"output file (default: SHARDS/{DEFAULT_NAME})")
    parser.add_argument("--image-size", type=int, default=32, help="size the shards are decoded to")
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--net-resolution", type=int, default=16, help="size the network sees")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path, info = train_feature_net(
        args.shards,
        args.out,
        image_size=args.image_size,
        channels=args.channels,
        net_resolution=args.net_resolution,
        epochs=args.epochs,
        seed=args.seed,
    )
    print(
        f"{path}: val accuracy {info['val_accuracy']:.3f} on {info['val_samples']} images "
        f"(features for FID on this domain only; not comparable to Inception FID)"
    )


if __name__ == "__main__":
    main()
