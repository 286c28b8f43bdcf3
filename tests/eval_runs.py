"""Tiny runs, models and a feature network shared by several test modules, each made once per
test session (memoised here: pytest would otherwise build a session fixture once per module)."""

from __future__ import annotations

import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Seconds per pass on 2 CPU cores. Checkpoints every 10 steps so the score histograms have passes.
TINY_MAE = (
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.batch_size=64",
    "data.val_batches=2",
    "checkpoint.every_steps=10",
    "checkpoint.keep=10",
    "log_every=5",
)
TINY_LDM = (
    "ldm.unet.block_out_channels=[16,32]",
    "ldm.unet.norm_num_groups=8",
    "data.batch_size=64",
    "data.val_batches=1",
    "data.resolution=16",
    "log_every=5",
)


@functools.lru_cache(maxsize=None)
def tiny_run(shards: str, runs_dir: str, config: str, name: str, extra: tuple[str, ...] = ()) -> str:
    """Train configs/`config` on the digits shards into runs_dir/name; returns the run folder."""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.training.loop import train

    tiny = TINY_MAE if config.startswith("mae") else TINY_LDM
    cfg = load_config(
        os.path.join(ROOT, "configs", config),
        [f"data.train={shards}/train", f"data.val={shards}/val", f"runs_dir={runs_dir}", f"name={name}", *tiny, *extra],
    )
    train(cfg)
    return cfg.run_dir


@functools.lru_cache(maxsize=None)
def feature_net(shards: str, out: str) -> str:
    """The digits classifier for FID (tools/commands/feature_net.py), written to `out`."""
    from prunepipe.tools.commands.feature_net import train_feature_net

    path, _ = train_feature_net(shards, out)
    return path


def session_dir(tmp_path_factory, name: str) -> str:
    """A folder shared by every test module of the session."""
    path = tmp_path_factory.getbasetemp() / name
    path.mkdir(exist_ok=True)
    return str(path)


def one_torch_thread():
    """Generator for a module fixture: torch on one thread while the module runs. These models are
    tiny, and on a shared 2-core machine two threads spin-waiting on each other cost far more than
    they gain."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def trained_task(run_dir: str):
    """(task, model with the run's last checkpoint's raw weights in eval mode, run config)."""
    from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.tasks.build import build_task

    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    task = build_task(cfg)
    task.model.load_state_dict(load_checkpoint_states(latest_checkpoint(run_dir))["model"])
    return task, task.model.eval(), cfg


def tiny_vae(channels: int = 3, size: int = 32):
    """A tiny randomly initialised AutoencoderKL (seed 0): size x size x channels -> size/2 x size/2 x 4."""
    from prunepipe.tools.fixtures.tiny_vae import tiny_vae as fixture

    return fixture(channels, sample_size=size)


def digit_shards(digits_shards: str, out, shards: int, per_shard: int, broken=None) -> str:
    """`shards` tar shards of `per_shard` digits each, the session's train digits in index order;
    where `broken(shard, position)` is true the image is replaced by bytes that are not a PNG.
    Indexed; returns the folder."""
    import webdataset as wds

    from prunepipe.pipelines.data.shards import ShardIndex, read_shard
    from prunepipe.tools.commands.shards import index_shards

    def digits():
        for url in ShardIndex.load(f"{digits_shards}/train").urls:
            for _, sample in read_shard(url):
                yield {k: v for k, v in sample.items() if k in ("__key__", "png", "cls")}

    os.makedirs(out, exist_ok=True)
    source = digits()
    for shard in range(shards):
        with wds.TarWriter(os.path.join(out, f"{shard}.tar")) as sink:
            for position in range(per_shard):
                sample = next(source)
                sink.write({**sample, "png": b"not a png"} if broken and broken(shard, position) else sample)
    index_shards([str(out)], str(out))
    return str(out)


def diffusion_config(**settings):
    """A DiffusionConfig from keywords: an ldm field by its name, a group's as GROUP__FIELD (dit__depth=2).
    Built in Python, unchecked: the task's check_config checks it as it would a loaded one."""
    import dataclasses

    from prunepipe.pipelines.tasks.diffusion.config import DiffusionConfig

    cfg, fields = DiffusionConfig(), {}
    for key, value in settings.items():
        group, _, name = key.rpartition("__")
        if group:
            setattr(cfg, group, dataclasses.replace(getattr(cfg, group), **{name: value}))
        else:
            fields[name] = value
    return dataclasses.replace(cfg, **fields)
