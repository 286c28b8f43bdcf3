"""The DiT backbone and the flow objective as a specification: the paper's sizes and initialisation,
labels dropped once per sample (never by diffusers' blocks), the flow loss is the velocity MSE on the
straight path with s from compute_density_for_timestep_sampling's densities, guided sampling, and
exports that reload in diffusers and sample the same images."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel, DPMSolverMultistepScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling
from eval_runs import diffusion_config

from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.evaluation.sampling import generate_images
from prunepipe.pipelines.tasks.diffusion.dit import DIT_SIZES, build_dit, dit_shape
from prunepipe.pipelines.tasks.diffusion.flow import HELD_OUT_S, draw_s
from prunepipe.pipelines.tasks.diffusion.from_export import sample
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.pipelines.tasks.randomness import GeneratorDraws, SampleRandomness

SIZE, CHANNELS = 8, 4
TINY = dict(backbone="dit", dit__depth=2, dit__width=32, dit__heads=2)


def make_task(**overrides) -> DiffusionTask:
    torch.manual_seed(0)
    return DiffusionTask(diffusion_config(**{**TINY, **overrides}), image_size=SIZE, channels=CHANNELS)


def random_batch(n: int = 4, labels=None, first_id: int = 0) -> Batch:
    images = torch.randn(n, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(first_id + 1))
    labels = torch.full((n,), -1) if labels is None else torch.as_tensor(labels)
    return Batch(torch.arange(first_id, first_id + n), torch.ones(n), images, labels)


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every weight off its initialisation, so outputs depend on labels and time (zero-init
    makes a fresh DiT predict 0 everywhere)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


# ----------------------------------------------------------------------------- the backbone
def test_presets_are_the_papers_sizes_and_their_parameter_counts_are_documented():
    assert {name: dit_shape(f"DiT-{name}/2")["num_layers"] for name in DIT_SIZES} == {
        "S": 12,
        "B": 12,
        "L": 24,
        "XL": 28,
        "8B": 48,
    }
    assert dit_shape("DiT-XL/2") == {"num_layers": 28, "width": 1152, "heads": 16, "patch_size": 2}
    assert dit_shape("DiT-B/4", depth=2, width=64, heads=2)["patch_size"] == 4
    with torch.device("meta"):  # the real S/2 without allocating it
        model = build_dit("DiT-S/2", sample_size=32, in_channels=4, num_classes=1000)
    total = sum(p.numel() for p in model.parameters())
    per_block_embedder = sum(p.numel() for p in model.transformer_blocks[0].norm1.emb.parameters())
    # docs/design.md: every block carries its own timestep MLP and label table (the paper shares one)
    assert total == 39_798_928
    assert round((total - 11 * per_block_embedder) / 1e6, 1) == 32.9
    with pytest.raises(ValueError, match=r"ldm\.dit\.preset='DiT-M/2'.*DiT-S/2"):
        dit_shape("DiT-M/2")
    with pytest.raises(ValueError, match=r"ldm\.sample_size=9 .*patch size 2"):
        build_dit("DiT-S/2", sample_size=9, in_channels=4, num_classes=0, depth=1, width=32, heads=2)


def test_initialisation_is_the_papers_adaln_zero_so_a_fresh_dit_predicts_zero():
    task = make_task(num_classes=10)
    model = task.model
    for block in model.transformer_blocks:
        assert not block.norm1.linear.weight.any() and not block.norm1.linear.bias.any()
        table = block.norm1.emb.class_embedder.embedding_table.weight
        assert (
            table.shape[0] == 11 and 0.01 < float(table.detach().std()) < 0.03
        )  # N(0, 0.02), not nn.Embedding's N(0, 1)
    assert not model.proj_out_2.weight.any() and not model.proj_out_1.weight.any()
    attention = model.transformer_blocks[0].attn1.to_q
    assert not attention.bias.any() and float(attention.weight.detach().abs().max()) <= (6 / (32 + 32)) ** 0.5  # xavier
    out = model(torch.randn(2, CHANNELS, SIZE, SIZE), torch.tensor([10.0, 500.0]), class_labels=torch.tensor([1, 10]))
    assert not out.sample.any()


def test_unconditional_dit_is_trained_and_sampled_on_the_null_label():
    task = make_task()  # num_classes = 0: a table of one row, the null label 0
    assert task.model.config.num_embeds_ada_norm == 0
    seen = []
    task.model.transformer_blocks[0].norm1.emb.class_embedder.embedding_table.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].clone())
    )
    task.per_sample(task.model, random_batch(labels=[3, -1, 5, 7]), torch.Generator().manual_seed(0))
    assert all(s.tolist() == [0, 0, 0, 0] for s in seen)
    with pytest.raises(Exception):  # the diffusers trap the task steps around
        task.model(torch.randn(1, CHANNELS, SIZE, SIZE), torch.tensor([1.0]), class_labels=None)


def test_labels_are_dropped_once_per_sample_from_its_draws_and_never_by_the_blocks():
    n, p = 64, 0.5
    task = make_task(num_classes=10, label_dropout=p)
    task.model.train()
    tables = [b.norm1.emb.class_embedder.embedding_table for b in task.model.transformer_blocks]
    seen: list[list[torch.Tensor]] = [[] for _ in tables]
    for k, table in enumerate(tables):
        table.register_forward_pre_hook(lambda module, args, k=k: seen[k].append(args[0].clone()))
    labels = torch.arange(n) % 10
    batch = random_batch(n, labels=labels)
    task.per_sample(task.model, batch, SampleRandomness(3, 1, batch.ids))
    # block 0's table is read twice (its block and the final layer), block 1's once: all the same labels
    assert [len(s) for s in seen] == [2, 1]
    got = seen[0][0]
    assert all(torch.equal(got, s) for calls in seen for s in calls)
    # the drop is the 3rd per-sample draw (noise, s, drop): reproduce it from the sample's own stream
    draws = SampleRandomness(3, 1, batch.ids)
    draws.randn(CHANNELS, SIZE, SIZE), draws.randn()
    expected = torch.where(draws.rand() < p, torch.full_like(labels, 10), labels)
    assert torch.equal(got, expected) and 10 < int((got == 10).sum()) < 54
    # a sample's drop does not depend on its batch-mates
    seen[0].clear()
    alone = Batch(batch.ids[5:6], batch.weights[5:6], batch.images[5:6], batch.labels[5:6])
    task.per_sample(task.model, alone, SampleRandomness(3, 1, alone.ids))
    assert seen[0][0].tolist() == [int(expected[5])]

    # what the task steps around: diffusers' own dropout, a fresh mask in every block
    for block in task.model.transformer_blocks:
        block.norm1.emb.class_embedder.dropout_prob = 0.1
    for s in seen:
        s.clear()
    torch.manual_seed(1)
    task.cfg.label_dropout = 0.0
    task.per_sample(task.model, batch, SampleRandomness(3, 1, batch.ids))
    assert not torch.equal(seen[0][0], seen[1][0])


# ----------------------------------------------------------------------------- the flow objective
@pytest.mark.parametrize("weighting", ["logit_normal", "uniform", "mode"])
def test_s_follows_compute_density_for_timestep_sampling(weighting):
    kw = dict(logit_mean=0.3, logit_std=1.2, mode_scale=1.29)
    ours = draw_s(GeneratorDraws(torch.Generator().manual_seed(4), 4096), weighting, **kw)
    theirs = compute_density_for_timestep_sampling(weighting, 4096, generator=torch.Generator().manual_seed(4), **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert ours.dtype == torch.float32 and ((ours > 0) & (ours < 1)).all()


def test_flow_loss_is_the_velocity_mse_on_the_straight_path_at_the_samples_s():
    task = make_task(objective="flow")
    perturb(task.model)
    batch = random_batch()
    out = task.per_sample(task.model, batch, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # the documented order: noise, then s (logit-normal: a normal)
    noise = torch.randn(batch.images.shape, generator=g)
    s = torch.sigmoid(torch.randn(4, generator=g))
    x_s = (1 - s.view(-1, 1, 1, 1)) * batch.images + s.view(-1, 1, 1, 1) * noise
    pred = task.model(x_s, s * 1000, class_labels=torch.zeros(4, dtype=torch.long)).sample
    torch.testing.assert_close(out.loss.mean(), F.mse_loss(pred, noise - batch.images), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.stratum, (s * 1000).long()) and task.num_strata == 1000


def test_flow_held_out_is_a_fixed_grid_of_s_and_repeats_exactly():
    task = make_task(objective="flow")
    perturb(task.model)
    batches = [random_batch(2), random_batch(2, first_id=2)]
    first = task.held_out(task.model, batches, seed=0)
    assert first == task.held_out(task.model, batches, seed=0)
    per_s = {k: v for k, v in first.items() if k.startswith("flow_mse_s")}
    assert list(per_s) == [f"flow_mse_s{round(s * 100):03d}" for s in HELD_OUT_S] and "flow_mse_s095" in per_s
    assert first["denoise_mse"] == pytest.approx(sum(per_s.values()) / 10) and first["num_samples"] == 4


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(backbone="vit"), r"ldm\.backbone='vit' is not accepted; accepted: unet, dit"),
        (dict(objective="edm"), r"ldm\.objective='edm' is not accepted; accepted: ddpm, flow"),
        (
            dict(objective="flow", flow__weighting="cosmap"),
            r"ldm\.flow\.weighting='cosmap' is not accepted; accepted: logit_normal",
        ),
        (dict(objective="flow", ddpm__min_snr_gamma=5.0), r"ldm\.objective='flow'.*ldm\.ddpm\.min_snr_gamma"),
        (dict(label_dropout=1.0), r"ldm\.label_dropout must be in \[0, 1\)"),
        (dict(dit__preset="DiT-XXL/2"), r"ldm\.dit\.preset='DiT-XXL/2' is not accepted; accepted: DiT-S/2"),
    ],
)
def test_config_mistakes_name_the_field_and_accepted_values(setting, message):
    with pytest.raises(ValueError, match=message):
        make_task(**setting)


# ----------------------------------------------------------------------------- sampling and export
@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_fid_sampler_draws_from_the_dit_with_and_without_guidance(objective):
    task = make_task(objective=objective, num_classes=10, space="latents", scaling_factor=1.0)
    perturb(task.model)
    decode = lambda x: x.clamp(-1, 1)  # noqa: E731 (latents as images: what is sampled, not a VAE, is tested)
    kw = dict(num_images=4, steps=3, seed=0, batch_size=2, decode=decode)
    plain = torch.cat(list(generate_images(task, task.model, **kw)))
    again = torch.cat(list(generate_images(task, task.model, **kw, guidance_scale=1.0)))
    guided = torch.cat(list(generate_images(task, task.model, **kw, guidance_scale=4.0)))
    assert plain.shape == (4, CHANNELS, SIZE, SIZE) and 0 <= float(plain.min()) and float(plain.max()) <= 1
    assert torch.equal(plain, again) and not torch.allclose(plain, guided, atol=1e-3)
    unconditional = make_task(objective=objective)
    with pytest.raises(ValueError, match="guidance_scale=4.0 needs a class- or text-conditional model"):
        next(generate_images(unconditional, unconditional.model, **kw, guidance_scale=4.0))


@pytest.mark.parametrize("objective, scheduler", [("flow", "DPMSolverMultistepScheduler"), ("ddpm", "DDIMScheduler")])
def test_export_reloads_in_diffusers_and_samples_the_same_images(objective, scheduler, tmp_path):
    task = make_task(objective=objective, num_classes=10, scaling_factor=1.0)
    perturb(task.model)
    task.export(task.model, None, str(tmp_path))
    reloaded = DiTTransformer2DModel.from_pretrained(str(tmp_path), subfolder="transformer")
    assert json.load(open(tmp_path / "scheduler" / "scheduler_config.json"))["_class_name"] == scheduler
    state = task.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reloaded.state_dict().items())
    if objective == "flow":
        assert (
            DPMSolverMultistepScheduler.from_pretrained(str(tmp_path), subfolder="scheduler").config.solver_order == 1
        )

    labels = torch.tensor([1, 7, -1])
    exported = sample(
        str(tmp_path), 3, 4, torch.Generator().manual_seed(5), ema=False, class_labels=labels, guidance_scale=2.0
    )
    # the same start noise through the in-memory model and the task's sampler
    noise = torch.randn((3, CHANNELS, SIZE, SIZE), generator=torch.Generator().manual_seed(5))
    from prunepipe.pipelines.tasks.diffusion.sampler import denoise

    x = denoise(
        task.model.eval(), noise, task.sampler(), 4, task.class_labels(labels), null_label=10, guidance_scale=2.0
    )
    torch.testing.assert_close(exported, (x / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)
    assert os.path.isdir(tmp_path / "transformer") and not os.path.exists(tmp_path / "unet")
