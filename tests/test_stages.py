"""Staged pretraining as a specification (init.weights): a stage at twice the resolution starts from
the last stage's export (its non_ema weights live, its default weights as the EMA) and says what it
loaded and that the sin-cos position table was recomputed, not copied; a requeued stage resumes from its
own checkpoint and never loads the last stage again; a tensor of another shape stops the run naming it
and both shapes (init.strict=false loads the rest and names it); an MAE starts from a RUN or a CHECKPOINT."""

from __future__ import annotations

import json
import os

import pytest
import torch
from eval_runs import one_torch_thread
from safetensors.torch import load_file
from test_trainer import ROOT, TINY_MAE, final_state, overrides, straight_and_resumed

from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.config import ConfigError, load_config
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.mae import sincos_pos_embed
from prunepipe.pipelines.tasks.wrappers import weights_module
from prunepipe.pipelines.trained import load_trained
from prunepipe.pipelines.training.ema import PassProgressEMA
from prunepipe.pipelines.training.init_weights import InitWeightsError, init_from_weights
from prunepipe.pipelines.training.loop import train

STAGE1 = os.path.join(ROOT, "configs", "ldm_dit_tiny_stage1.yaml")
STAGE2 = os.path.join(ROOT, "configs", "ldm_dit_tiny_stage2.yaml")
MAE = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
FAST = ["data.val_batches=1", "log_every=1"]
CLASS_TABLE = "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def stage1(digits_shards, tmp_path_factory):
    """One pass of the tiny DiT at 8 px: its run folder holds a checkpoint and the export."""
    cfg = load_config(
        STAGE1, overrides(digits_shards, tmp_path_factory.mktemp("stage1"), "stage1", [*FAST, "num_passes=1"])
    )
    train(cfg)
    return cfg


def stage2(digits_shards, tmp_path, stage1, name="stage2", *extra):
    export = os.path.join(stage1.run_dir, "export")
    return load_config(STAGE2, overrides(digits_shards, tmp_path, name, [*FAST, f"init.weights={export}", *extra]))


def initialised(cfg):
    """The run's model and EMA as init.weights leaves them before the first step."""
    task = build_task(cfg)
    ema = PassProgressEMA(list(task.model.parameters()), decay=0.99, warmup="none", full_steps_per_pass=1.0)
    init_from_weights(cfg, task.model, ema, resumed_from=None, announce=True)
    return task.model, dict(zip([n for n, _ in task.model.named_parameters()], ema.shadow_params))


def test_a_stage_at_twice_the_resolution_starts_from_the_last_stages_export(stage1, digits_shards, tmp_path, capsys):
    cfg = stage2(digits_shards, tmp_path, stage1, "stage2", "max_steps=3")
    transformer = os.path.join(stage1.run_dir, "export", "transformer")
    ema_weights = load_file(os.path.join(transformer, "diffusion_pytorch_model.safetensors"))
    live_weights = load_file(os.path.join(transformer, "diffusion_pytorch_model.non_ema.safetensors"))
    assert any(not torch.equal(ema_weights[k], live_weights[k]) for k in ema_weights), "the EMA is not the live weights"

    model, ema = initialised(cfg)
    state = model.state_dict()
    assert state.keys() == live_weights.keys()  # every stored tensor loaded: no new ones at another size
    assert all(torch.equal(state[k], live_weights[k]) for k in live_weights), "live weights: the non_ema variant"
    assert all(torch.equal(ema[k], ema_weights[k]) for k in ema), "EMA: the export's default weights"
    # the sin-cos table is the one a 16 px model computes (64 patches), not stage 1's 8 px one (16)
    fresh = build_task(cfg).model.pos_embed.pos_embed
    assert model.pos_embed.pos_embed.shape == (1, 64, 64) and torch.equal(model.pos_embed.pos_embed, fresh)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("init: from export")][0]
    assert f"{len(live_weights)} tensors loaded" in line and "non_ema variant" in line
    assert "recomputed for this model's size, not copied: pos_embed.pos_embed" in line

    train(cfg)  # the stage trains from there
    out = capsys.readouterr().out
    assert "init: from export" in out and "pos_embed.pos_embed" in out
    records = [json.loads(x) for x in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    trained = load_checkpoint_states(latest_checkpoint(cfg.run_dir))["model"]
    assert not torch.equal(trained["proj_out_2.weight"], live_weights["proj_out_2.weight"])


def test_a_requeued_stage_resumes_from_its_own_checkpoint_and_never_loads_the_last_stage_again(
    stage1, digits_shards, tmp_path, capsys
):
    export = os.path.join(stage1.run_dir, "export")
    base = [*FAST, f"init.weights={export}", "checkpoint.every_steps=4"]
    (_, straight, straight_pruner), (checkpoint, resumed, resumed_pruner) = straight_and_resumed(
        STAGE2, digits_shards, tmp_path, base, stop_at=4, end_at=8
    )
    out = capsys.readouterr().out
    # the straight run and the first start of the stopped one load stage 1; the resumed start does not
    assert out.count("init: from export") == 2
    assert "not applied: the run resumed from its own checkpoint" in out and "step_000004" in out
    # had the resumed start loaded stage 1 again, its weights would be stage 1's trained 4 steps, not 8
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert checkpoint.endswith("step_000008")


@pytest.mark.parametrize(
    "setting, tensor, theirs, ours",
    [
        ("ldm.num_classes=5", CLASS_TABLE, [11, 64], [6, 64]),
        ("ldm.dit.patch_size=4", "pos_embed.proj.weight", [64, 1, 2, 2], [64, 1, 4, 4]),
    ],
    ids=["class-count", "patch-size"],
)
def test_a_tensor_of_another_shape_stops_the_stage_naming_it_and_both_shapes(
    stage1, digits_shards, tmp_path, setting, tensor, theirs, ours
):
    with pytest.raises(InitWeightsError, match="init.strict=false") as error:
        train(stage2(digits_shards, tmp_path, stage1, "strict", setting, "max_steps=1"))
    assert f"{tensor}: {theirs} in the source, {ours} in this model" in str(error.value)
    assert not os.path.exists(os.path.join(tmp_path, "strict", "checkpoints")), "stopped before any step"


def test_init_strict_false_loads_what_fits_and_names_what_it_skipped(stage1, digits_shards, tmp_path, capsys):
    cfg = stage2(digits_shards, tmp_path, stage1, "loose", "ldm.num_classes=5", "init.strict=false")
    live = load_file(
        os.path.join(stage1.run_dir, "export", "transformer", "diffusion_pytorch_model.non_ema.safetensors")
    )
    torch.manual_seed(0)
    fresh = build_task(cfg).model.state_dict()
    torch.manual_seed(0)  # the same draws: the initialisation `fresh` holds
    model, _ = initialised(cfg)
    state = model.state_dict()
    skipped = [k for k in live if "class_embedder" in k]
    assert skipped and all(torch.equal(state[k], fresh[k]) for k in skipped), "skipped: as initialised"
    assert all(torch.equal(state[k], live[k]) for k in live if k not in skipped)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("init: from export")][0]
    assert f"skipped (init.strict=false), as initialised: {CLASS_TABLE} [11, 64] here [6, 64]" in line


@pytest.fixture(scope="module")
def mae_stage1(digits_shards, tmp_path_factory):
    """One pass of the tiny MAE at 16 px (4 patches of 8 px)."""
    runs = tmp_path_factory.mktemp("mae_stage1")
    cfg = load_config(
        MAE, overrides(digits_shards, runs, "mae16", [*TINY_MAE, *FAST, "data.resolution=16", "num_passes=1"])
    )
    train(cfg)
    return cfg


@pytest.mark.parametrize("source", ["run", "checkpoint"])
def test_an_mae_stage_starts_from_a_run_or_a_checkpoint(mae_stage1, digits_shards, tmp_path, source, capsys):
    weights = mae_stage1.run_dir if source == "run" else latest_checkpoint(mae_stage1.run_dir)
    extra = [*TINY_MAE, *FAST, "data.resolution=32", f"init.weights={weights}", "max_steps=2", "ema_warmup=none"]
    cfg = load_config(MAE, overrides(digits_shards, tmp_path, "mae32", extra))
    before = load_trained(mae_stage1.run_dir)  # how eval reads a run: live weights and EMA, by name
    before_ema = weights_module(before.ema, before.model).state_dict()
    model, ema = initialised(cfg)
    state, learned = model.state_dict(), {n for n, p in model.named_parameters() if p.requires_grad}
    assert learned and all(torch.equal(state[k], before.model.state_dict()[k]) for k in learned)
    assert all(torch.equal(ema[k], before_ema[k]) for k in learned), "the EMA from the checkpoint's EMA"
    # the fixed sin-cos tables follow the new size: 1 + 16 patches, not 1 + 4
    assert torch.equal(state["encoder.pos_embed"], sincos_pos_embed(4, 32))
    assert torch.equal(ema["encoder.pos_embed"], sincos_pos_embed(4, 32))
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("init: from")][0]
    named = f"run {weights}, its newest intact checkpoint" if source == "run" else f"checkpoint {weights}"
    assert named in line and "encoder.pos_embed [1, 5, 32] -> [1, 17, 32]" in line

    train(cfg)
    assert "init: from" in capsys.readouterr().out
    assert final_state(cfg.run_dir)[0].endswith("step_000002")


def test_init_weights_naming_the_runs_own_folder_is_refused_for_checkpoint_resume(digits_shards, tmp_path):
    own = os.path.join(tmp_path, "stage2", "checkpoints", "step_000004")
    with pytest.raises(ConfigError, match=r"init.weights=.*this run's own folder.*checkpoint.resume=latest"):
        load_config(STAGE2, overrides(digits_shards, tmp_path, "stage2", [f"init.weights={own}"]))


def test_an_mae_stage_from_an_export_loads_the_ema_encoder_and_starts_the_decoder_afresh(
    mae_stage1, digits_shards, tmp_path, capsys
):
    export = os.path.join(mae_stage1.run_dir, "export")
    cfg = load_config(
        MAE, overrides(digits_shards, tmp_path, "mae32", [*TINY_MAE, "data.resolution=32", f"init.weights={export}"])
    )
    encoder = load_file(os.path.join(export, "encoder.safetensors"))  # the EMA encoder
    torch.manual_seed(0)
    fresh = build_task(cfg).model.state_dict()
    torch.manual_seed(0)
    model, ema = initialised(cfg)
    state = model.state_dict()
    learned = [n for n, p in model.named_parameters() if p.requires_grad]
    for name in learned:
        if name.startswith("encoder."):  # live and EMA both start from the export's EMA encoder
            assert torch.equal(state[name], encoder[name[len("encoder.") :]]) and torch.equal(ema[name], state[name])
        else:  # the decoder: the export holds none
            assert torch.equal(state[name], fresh[name]), name
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("init: from MAE export")][0]
    assert "new, as initialised (outside what the source holds, encoder.*): mask_token, decoder" in line
    assert "encoder.pos_embed [1, 5, 32] -> [1, 17, 32]" in line
