"""Models at any size, as a specification (docs/diffusion.md, "Aspect-ratio buckets: models at any
size"): a class-conditional DiT, a text-conditional PixArt transformer and a UNet train on batches of
three shapes around an 8x8 base (8x16, 16x8, 12x8), each predicting at its input's shape with each
sample's noise drawn at that shape and keyed by its id alone; the held-out loss reads batches of
several shapes; sampling at the base size draws what diffusers' own models draw; PixArt-alpha's size
conditions (ldm.dit.size_conditions) reach the model, export as PixArtAlphaPipeline where it passes
them, and are refused where nothing embeds them; a bucket the backbone cannot take is refused, named."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
from diffusers import DiTTransformer2DModel as DiffusersDiT
from diffusers import PixArtTransformer2DModel
from eval_runs import ROOT, diffusion_config, one_torch_thread

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.config_schema import ConfigError
from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.data.description import SplitRecords
from prunepipe.pipelines.data.shards import ShardEntry, ShardIndex
from prunepipe.pipelines.evaluation.config import EvalConfig
from prunepipe.pipelines.evaluation.runner import Evaluator, aligned_held_out
from prunepipe.pipelines.evaluation.sampling import generate_images
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.diffusion.dit import transformer_shape
from prunepipe.pipelines.tasks.diffusion.flow import draw_s, interpolate
from prunepipe.pipelines.tasks.diffusion.from_export import sample
from prunepipe.pipelines.tasks.diffusion.pixart import SizeConditions
from prunepipe.pipelines.tasks.diffusion.sampler import denoise, predict
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.pipelines.tasks.randomness import SampleRandomness, per_sample_seeded
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder
from prunepipe.tools.fixtures.tiny_vae import write_tiny_vae

BASE, CHANNELS = 8, 4
SHAPES = [(8, 16), (16, 8), (12, 8)]
PROMPTS = ["a handwritten digit three", "a handwritten digit eight"]
TINY_DIT = dict(backbone="dit", objective="flow", dit__depth=1, dit__width=48, dit__heads=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> str:
    """A tiny random CLIP text model and a word-level tokenizer of the prompts' words, saved by path."""
    folder = str(tmp_path_factory.mktemp("encoder"))
    return write_tiny_text_encoder(folder, PROMPTS, hidden_size=16, layers=1, max_length=8)


def make_task(kind: str, encoder: str = "", **overrides) -> DiffusionTask:
    """A tiny task on 4-channel inputs of base side 8 (pixel space: latents stand-ins), every weight moved
    off its zero initialisation so outputs depend on inputs, time and condition."""
    settings = {
        "class": dict(TINY_DIT, num_classes=3),
        "text": dict(TINY_DIT, conditioning="text", text__encoder=encoder, text__max_length=8),
        "unet": dict(objective="flow", unet__block_out_channels=[16, 32]),
    }[kind]
    torch.manual_seed(0)
    task = DiffusionTask(diffusion_config(**{**settings, **overrides}), image_size=BASE, channels=CHANNELS)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in task.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return task


def batch_of(shape: tuple[int, int], ids, kind: str = "class") -> Batch:
    ids = torch.as_tensor(ids)
    images = torch.randn(len(ids), CHANNELS, *shape, generator=torch.Generator().manual_seed(int(ids[0]) + 1))
    labels = ids % 3 if kind == "class" else torch.full((len(ids),), -1)
    captions = tuple(PROMPTS[int(i) % 2] for i in ids) if kind == "text" else ()
    return Batch(ids, torch.ones(len(ids)), images, labels, captions=captions)


# ----------------------------------------------------------------------------- training at any size
@pytest.mark.parametrize("kind", ["class", "text", "unet"])
def test_each_backbone_trains_on_batches_of_three_shapes_predicting_at_each(kind, encoder):
    task = make_task(kind, encoder)
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(2):
        for k, shape in enumerate(SHAPES):
            batch = batch_of(shape, range(4 * k, 4 * k + 4), kind)
            losses = task.per_sample(model, batch, SampleRandomness(0, step, batch.ids)).loss
            assert losses.shape == (4,) and torch.isfinite(losses).all(), (shape, losses)
            optimizer.zero_grad()
            losses.mean().backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)
            assert sum(float(g.abs().sum()) for g in grads) > 0, shape
            optimizer.step()
            x = batch.images
            condition = task.condition(batch, "cpu")
            with torch.no_grad():
                assert predict(model, x, torch.full((4,), 500.0), condition).shape == x.shape
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, first[name])]
    assert len(moved) > len(first) // 2, "most weights trained"


def test_a_samples_noise_is_drawn_at_its_batchs_shape_from_its_id_alone():
    """Per-sample draws at a non-square shape: the loss is the velocity MSE with noise [C, h, w] and s
    drawn in that order from the sample's own stream, so a sample's loss does not depend on its batch."""
    task = make_task("class", label_dropout=0.0)
    model = task.model
    for shape in SHAPES[1:]:
        batch = batch_of(shape, [5, 6])
        with torch.no_grad():
            losses = task.per_sample(model, batch, SampleRandomness(3, 1, batch.ids)).loss
            draws = SampleRandomness(3, 1, batch.ids)
            noise = draws.randn(CHANNELS, *shape)
            s = draw_s(draws, task.cfg.flow.weighting, device="cpu")
            x_s, velocity = interpolate(batch.images, noise, s)
            pred = predict(model, x_s, s * task.cfg.num_train_timesteps, task.class_labels(batch.labels))
            torch.testing.assert_close(losses, (pred - velocity).pow(2).flatten(1).mean(1), rtol=0, atol=1e-6)
            # sample 5 beside another batch-mate at another place
            other = Batch(torch.tensor([9, 5]), torch.ones(2), batch.images.flip(0), torch.tensor([0, 2]))
            again = task.per_sample(model, other, SampleRandomness(3, 1, other.ids)).loss
        torch.testing.assert_close(again[1], losses[0], rtol=0, atol=1e-6)


def test_the_held_out_loss_reads_batches_of_several_shapes_with_noise_fixed_at_each():
    task = make_task("class")
    batches = [batch_of(SHAPES[0], [0, 1, 2]), batch_of(SHAPES[2], [3, 4])]
    both = task.held_out(task.model, batches, seed=4)
    alone = [task.held_out(task.model, [b], seed=4) for b in batches]
    assert both["num_samples"] == 5
    for key in both:
        if key != "num_samples":
            expected = (3 * alone[0][key] + 2 * alone[1][key]) / 5
            assert abs(both[key] - expected) < 1e-5 * max(1.0, abs(expected)), key
    # the fixed noise of a sample is per_sample_seeded at its batch's shape
    batch = batches[1]
    s = torch.tensor([0.55, 0.55])
    with torch.no_grad():
        noise = per_sample_seeded((CHANNELS, *SHAPES[2]), batch.ids.numpy(), 4, normal=True)
        mse = task._flow_mse(task.model.eval(), batch.images, noise, s, task.condition(batch, "cpu"))
    assert abs(float(mse.mean()) - alone[1]["flow_mse_s055"]) < 1e-6


# ----------------------------------------------------------------------------- sampling at the base size
def test_sampling_at_the_base_size_draws_what_diffusers_own_models_draw(encoder):
    """The DiT's forward is ours (diffusers' unpatchifies every input as a square) and the PixArt
    transformer names its interpolation scale: at the base size both compute exactly what diffusers'
    own models compute, so sampling is unchanged."""
    task = make_task("class")
    stock = DiffusersDiT(**{k: v for k, v in task.model.config.items() if not k.startswith("_")})
    stock.load_state_dict(task.model.state_dict())
    start = torch.randn(2, CHANNELS, BASE, BASE, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 2])
    ours = denoise(task.model.eval(), start, task.sampler(), 3, labels, null_label=3, guidance_scale=2.0)
    theirs = denoise(stock.eval(), start, task.sampler(), 3, labels, null_label=3, guidance_scale=2.0)
    assert torch.equal(ours, theirs)
    images = torch.cat(list(generate_images(task, task.model, num_images=3, steps=2, seed=0, batch_size=2)))
    assert images.shape == (3, CHANNELS, BASE, BASE)
    # diffusers' DiT at a non-square input: a wrong answer where ours gives the input's shape
    x = torch.randn(2, CHANNELS, 12, 8)
    with torch.no_grad():
        assert stock(x, torch.ones(2), class_labels=labels).sample.shape != x.shape
        assert task.model(x, torch.ones(2), class_labels=labels).sample.shape == x.shape

    text = make_task("text", encoder)
    shape = transformer_shape("DiT-S/2", BASE, CHANNELS, depth=1, width=48, heads=2)
    before = PixArtTransformer2DModel(  # as pixart.py built it before interpolation_scale was named
        **shape, cross_attention_dim=48, caption_channels=16, use_additional_conditions=False
    )
    before.load_state_dict(text.model.state_dict())
    assert text.model.config.interpolation_scale == 1 and before.pos_embed.interpolation_scale == 1
    prompts, null = text.text_encoder.encode(PROMPTS), text.text_encoder.null()
    ours = denoise(text.model.eval(), start, text.sampler(), 3, prompts, null_label=null, guidance_scale=2.0)
    theirs = denoise(before.eval(), start, text.sampler(), 3, prompts, null_label=null, guidance_scale=2.0)
    assert torch.equal(ours, theirs)


# ----------------------------------------------------------------------------- size conditions
def test_size_conditions_reach_the_pixart_transformer_and_change_its_output(encoder):
    task = make_task("text", encoder, dit__size_conditions=True)
    model = task.model
    assert model.use_additional_conditions and task.size_conditions == SizeConditions(1)
    x = torch.randn(2, CHANNELS, 12, 8, generator=torch.Generator().manual_seed(0))
    assert task.size_conditions.of(x)["resolution"].tolist() == [[12.0, 8.0]] * 2
    assert task.size_conditions.of(x)["aspect_ratio"].tolist() == [[1.5]] * 2
    prompts, t = task.text_encoder.encode(PROMPTS), torch.full((2,), 300.0)
    with torch.no_grad():
        here = predict(model, x, t, prompts, task.size_conditions)
        larger = predict(model, x, t, prompts, SizeConditions(8))  # the same latents, said to be 96x64 px
        listed = predict(model, x, t, prompts, SizeConditions(1, {(12, 8): (100, 64)}))  # a bucket's own size
    assert here.shape == x.shape
    assert (here - larger).abs().max() > 1e-3 and (here - listed).abs().max() > 1e-3
    with pytest.raises(ValueError, match="size conditions"):
        predict(model, x, t, prompts, None)
    for k, shape in enumerate(SHAPES):  # training and the held-out loss pass them at every shape
        batch = batch_of(shape, [2 * k, 2 * k + 1], "text")
        assert torch.isfinite(task.per_sample(model, batch, SampleRandomness(0, 0, batch.ids)).loss).all()
    assert task.held_out(model, [batch_of(SHAPES[0], [0, 1], "text")])["num_samples"] == 2
    off = make_task("text", encoder)
    with torch.no_grad():  # a model built without them ignores the sizes it is handed
        assert torch.equal(predict(off.model, x, t, prompts, SizeConditions(1)), predict(off.model, x, t, prompts))


def test_size_conditions_are_refused_where_no_model_embeds_them(encoder):
    with pytest.raises(ConfigError, match=r"ldm\.dit\.size_conditions.*dit backbone of conditioning class"):
        make_task("class", dit__size_conditions=True)
    with pytest.raises(ValueError, match=r"ldm\.dit\.width=64 must be a multiple of 3"):
        make_task("text", encoder, dit__size_conditions=True, dit__width=64)


def tiny_vae_without_attention(folder: str) -> str:
    """A tiny AutoencoderKL (3 -> 4 channels, 2x downsampling) with no mid-block attention, so that
    decoding 128x128 latents is cheap on a CPU."""
    return write_tiny_vae(folder, attention=False)


def test_size_conditions_export_as_pixart_alpha_at_its_1024_px_size_and_say_why_not_elsewhere(encoder, tmp_path):
    """PixArtAlphaPipeline passes size conditions to a transformer of sample_size 128 only: there it
    loads the export alone and draws prunepipe's images; at any other size the README says why not."""
    from diffusers import PixArtAlphaPipeline

    vae = tiny_vae_without_attention(str(tmp_path / "vae"))
    settings = dict(
        TINY_DIT,
        objective="ddpm",
        conditioning="text",
        text__encoder=encoder,
        text__max_length=8,
        dit__size_conditions=True,
        dit__patch_size=8,
        space="vae",
        vae=vae,
    )
    task = DiffusionTask(diffusion_config(**settings), image_size=256, channels=3)
    assert task.sample_size == 128 and task.size_conditions == SizeConditions(2)
    with torch.no_grad():
        for parameter in task.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    export = str(tmp_path / "export")
    task.export(task.model, None, export)
    with open(os.path.join(export, "model_index.json")) as f:
        assert json.load(f)["_class_name"] == "PixArtAlphaPipeline"
    pipe = PixArtAlphaPipeline.from_pretrained(export)
    drawn = pipe(
        PROMPTS,
        num_inference_steps=2,
        guidance_scale=2.0,
        generator=torch.Generator().manual_seed(7),
        use_resolution_binning=False,
        max_sequence_length=8,
        output_type="pt",
    ).images
    ours = sample(export, 2, 2, torch.Generator().manual_seed(7), ema=False, prompts=PROMPTS, guidance_scale=2.0)
    assert ours.shape == (2, 3, 256, 256)
    torch.testing.assert_close(drawn, ours, rtol=0, atol=1e-5)

    small = DiffusionTask(diffusion_config(**{**settings, "dit__patch_size": 2}), image_size=16, channels=3)
    small.export(small.model, None, str(tmp_path / "small"))
    assert not os.path.exists(tmp_path / "small" / "model_index.json")
    with open(tmp_path / "small" / "README.md") as f:
        assert "PixArtAlphaPipeline passes only to a transformer of sample_size 128" in f.read()
    assert sample(str(tmp_path / "small"), 1, 2, torch.Generator().manual_seed(0), ema=False).shape == (1, 3, 16, 16)


# ----------------------------------------------------------------------------- the bucket check
BUCKETS = [
    {"name": "64x128", "image": [64, 128], "shape": [4, 8, 16]},
    {"name": "72x40", "image": [72, 40], "shape": [4, 9, 5]},
]


def test_a_bucket_the_backbone_cannot_take_is_refused_naming_it_and_the_setting():
    with pytest.raises(
        ValueError, match=r"bucket '72x40' \(shape \[4, 9, 5\]\).*9x5.*patch size 2.*ldm\.dit\.patch_size"
    ):
        DiffusionTask(
            diffusion_config(**TINY_DIT), image_size=BASE, channels=CHANNELS, records=SplitRecords(buckets=BUCKETS)
        )
    with pytest.raises(ValueError, match=r"bucket '72x40'.*UNet's downsampling 2.*block_out_channels"):
        DiffusionTask(diffusion_config(), image_size=BASE, channels=CHANNELS, records=SplitRecords(buckets=BUCKETS))
    task = DiffusionTask(
        diffusion_config(**TINY_DIT), image_size=BASE, channels=CHANNELS, records=SplitRecords(buckets=BUCKETS[:1])
    )
    assert task.bucket_table == BUCKETS[:1] and task.bucket_sizes == {(8, 16): (64, 128)}


def test_build_task_reads_the_train_splits_buckets_and_checks_them(tmp_path):
    folder = tmp_path / "latents"
    folder.mkdir()
    ShardIndex.write(
        str(folder),
        [ShardEntry("a.tar", 4, bucket=0), ShardEntry("b.tar", 4, bucket=1)],
        latent_shape=[CHANNELS, BASE, BASE],
        resolution=64,
        buckets=BUCKETS,
    )
    overrides = [f"data.train={folder}", "data.val=", "ldm.space=latents", f"runs_dir={tmp_path}"]
    config = os.path.join(ROOT, "configs", "ldm_dit_tiny_full.yaml")
    with pytest.raises(ValueError, match=r"bucket '72x40' \(shape \[4, 9, 5\]\)"):
        build_task(load_config(config, overrides))
    task = build_task(load_config(config, [*overrides, "ldm.dit.patch_size=1"]))
    assert task.bucket_table == BUCKETS and task.downsampling == 8 and task.sample_size == BASE


# ----------------------------------------------------------------------------- evaluation on bucketed latents
def write_shards(folder, shards: list[list[str]], bucket_of: list[int] | None = None, **meta) -> str:
    """Tar shards of samples keyed as listed (a caption `txt` each, named after its key, and a stand-in
    payload), indexed with each shard's bucket `bucket_of` and `meta`."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    entries = []
    for k, keys in enumerate(shards):
        url = os.path.join(folder, f"{k:05d}.tar")
        with wds.TarWriter(url) as sink:
            for key in keys:
                sink.write({"__key__": key, "txt": f"caption of {key}".encode(), "bin": b"x"})
        entries.append(ShardEntry(url, len(keys), bucket=None if bucket_of is None else bucket_of[k]))
    ShardIndex.write(str(folder), entries, **meta)
    return str(folder)


def test_held_out_captions_of_bucketed_latents_are_those_of_the_reference_images_in_their_order(tmp_path):
    """`latents encode --buckets` groups each input shard's samples by bucket, so held-out sample i is
    not reference image i: FID's samples are drawn from the captions of the reference's first images."""
    images = [[f"{i:03d}" for i in range(0, 4)], [f"{i:03d}" for i in range(4, 8)]]
    reference = write_shards(tmp_path / "images", images)
    # input shard 0 -> buckets 0: 001, 003 and 1: 000, 002; input shard 1 -> bucket 0: 004..007
    latents = [["001", "003"], ["000", "002"], ["004", "005", "006", "007"]]
    held_out = write_shards(tmp_path / "latents", latents, [0, 1, 0], latent_shape=[4, 8, 8], buckets=BUCKETS)
    captions, ids = aligned_held_out(held_out, reference, 5)
    assert captions == [f"caption of {i:03d}" for i in range(5)]
    assert ids == [2, 0, 3, 1, 4]  # the held-out ids of images 000..004
    short = write_shards(tmp_path / "short", [["001", "003", "000", "004"]], [0], buckets=BUCKETS)
    with pytest.raises(ValueError, match=r"1 of its first 5 images have no latent there \(key '002'\)"):
        aligned_held_out(short, reference, 5)
    # the evaluator samples from them where fid.reference names the image shards
    eval_cfg = EvalConfig(val=held_out)
    eval_cfg = dataclasses.replace(eval_cfg, fid=dataclasses.replace(eval_cfg.fid, reference=reference))
    run_cfg = SimpleNamespace(name="run", run_dir=str(tmp_path / "run"), data=SimpleNamespace(val="", train=""))
    evaluator = Evaluator(run_cfg, eval_cfg)
    assert evaluator._held_out_captions(3) == captions[:3] and evaluator._caption_ids == ids[:3]
    plain = Evaluator(run_cfg, dataclasses.replace(eval_cfg, val=reference))  # images: their own order
    assert plain._held_out_captions(3) == captions[:3] and plain._caption_ids is None
