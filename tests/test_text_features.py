"""Precomputed text features as a specification: `prunepipe latents encode --text-encoder`
stores each caption's real tokens' features beside its latent (and the empty caption's beside the
index), and a run with ldm.text.features=precomputed, which loads no encoder, conditions, samples,
resumes and exports as a run that encodes the captions in the loop does."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from eval_runs import one_torch_thread, tiny_vae
from test_distributed import passes_of
from test_text_eval import clip, settings  # noqa: F401 (fixture)
from test_text_to_image import CONFIG, captioned, encoder, tiny  # noqa: F401 (fixtures)
from test_trainer import straight_and_resumed

from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.batch import real_samples
from prunepipe.pipelines.data.decode import TEXT_FEATURES_FIELD, SampleDecoder
from prunepipe.pipelines.data.shards import TEXT_NULL_FILE, BadInputError, ShardIndex, read_shard
from prunepipe.pipelines.data.splits import read_captions, read_split
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.sampling import generate_images
from prunepipe.pipelines.tasks.build import build_task, text_reading
from prunepipe.pipelines.tasks.diffusion.text import TextEncoder
from prunepipe.pipelines.tasks.randomness import SampleRandomness
from prunepipe.pipelines.trained import evaluate_checkpoint
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.latents import encode_shards
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

# after tiny(encoder): no encoder is loaded, its features are read from the shards
PRECOMPUTED = ("ldm.text.features=precomputed", "ldm.text.encoder=")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def encode_splits(captioned, encoder, root, dtype: str) -> str:  # noqa: F811
    vae = os.path.join(root, "vae")
    if not os.path.isdir(vae):
        tiny_vae(1, 8).save_pretrained(vae)
    for split in ("train", "val"):
        encode_shards(
            f"{captioned}/{split}",
            vae,
            os.path.join(root, split),
            resolution=8,
            batch_size=64,
            dtype=dtype,
            text_encoder=encoder,
            text_max_length=8,
        )
    return str(root)


@pytest.fixture(scope="module")
def features16(captioned, encoder, tmp_path_factory) -> str:  # noqa: F811
    """Latent shards of the captioned digits with their captions' features, float16 as by default."""
    return encode_splits(captioned, encoder, tmp_path_factory.mktemp("features16"), "float16")


@pytest.fixture(scope="module")
def features32(captioned, encoder, tmp_path_factory) -> str:  # noqa: F811
    """The same in float32: what encoding in the loop computes, to the last bit of the real tokens."""
    return encode_splits(captioned, encoder, tmp_path_factory.mktemp("features32"), "float32")


def latent_config(root, tmp_path, name, *extra):
    return load_config(
        CONFIG,
        [
            f"data.train={root}/train",
            f"data.val={root}/val",
            f"runs_dir={tmp_path}",
            f"name={name}",
            "ldm.space=latents",
            *extra,
        ],
    )


def test_latents_encode_stores_each_captions_real_tokens_and_the_empty_captions(features16, encoder):  # noqa: F811
    text = TextEncoder(encoder, max_length=8)
    index = ShardIndex.load(f"{features16}/train")
    assert index.meta["text_encoder"] == text.identity() and index.meta["text_width"] == text.hidden_size
    assert TEXT_FEATURES_FIELD in index.meta["keys"]
    stored, padded, tokens = 0, 0, []
    for url in index.urls:
        for _, sample in read_shard(url):
            caption = sample["txt"].decode()
            rows = np.load(__import__("io").BytesIO(sample[TEXT_FEATURES_FIELD]))
            expected = text.encode([caption])
            real = int(expected.mask.sum())
            assert rows.dtype == np.float16 and rows.shape == (real, text.hidden_size)
            torch.testing.assert_close(
                torch.from_numpy(rows.astype(np.float32)), expected.features[0, :real], rtol=1e-3, atol=1e-3
            )
            stored += len(sample[TEXT_FEATURES_FIELD])
            padded += 128 + 8 * text.hidden_size * 2  # a .npy of all 8 tokens, float16
            tokens.append(real)
    null = np.load(f"{features16}/train/{TEXT_NULL_FILE}")
    torch.testing.assert_close(
        torch.from_numpy(null.astype(np.float32)),
        text.null().features[0, : int(text.null().mask.sum())],
        rtol=1e-3,
        atol=1e-3,
    )
    print(
        f"text.npy: {stored / len(tokens):.0f} bytes a sample for {np.mean(tokens):.2f} real tokens of 8 "
        f"(padded: {padded / len(tokens):.0f})"
    )
    assert max(tokens) < 8 and stored < padded


def test_precomputed_features_condition_the_model_as_encoding_in_the_loop_does(
    features32,
    encoder,  # noqa: F811
    tmp_path,
):
    in_loop = build_task(latent_config(features32, tmp_path, "loop", *tiny(encoder)))
    stored = build_task(latent_config(features32, tmp_path, "stored", *tiny(encoder), *PRECOMPUTED))
    assert (
        not stored.text.captions and stored.text.features == (16, 8) and stored.text.identity == in_loop.text.identity
    )
    stored.model.load_state_dict(in_loop.model.state_dict())
    batches, results = {}, {}
    for name, task in (("loop", in_loop), ("stored", stored)):
        batch = batches[name] = next(
            read_split(f"{features32}/val", resolution=8, channels=4, batch_size=64, **text_reading(task))
        )
        condition = task.condition(batch, "cpu")
        with torch.no_grad():
            losses = task.per_sample(task.model, batch, SampleRandomness(0, 1, batch.ids))
        results[name] = (condition.features[condition.mask.bool()], condition.mask, losses.loss, losses.stratum)
    assert batches["stored"].captions == () and batches["stored"].text_tokens.dtype == torch.float32
    (loop_f, loop_mask, loop_loss, loop_stratum), (stored_f, stored_mask, stored_loss, stored_stratum) = (
        results["loop"],
        results["stored"],
    )
    assert torch.equal(loop_mask, stored_mask) and torch.equal(loop_f, stored_f)
    # the same captions dropped (per-sample draws), the same strata, the same losses
    assert torch.equal(loop_stratum, stored_stratum) and (stored_stratum >= in_loop.cfg.num_train_timesteps).any()
    torch.testing.assert_close(stored_loss, loop_loss, rtol=1e-6, atol=0)
    held = [task.held_out(task.model, [batches[name]]) for name, task in (("loop", in_loop), ("stored", stored))]
    assert held[1]["denoise_mse"] == pytest.approx(held[0]["denoise_mse"], rel=1e-6)

    # sampling from held-out prompts: their features, as the evaluators pass them, give the same images
    captions = read_captions(f"{features32}/val", 4)
    features = [
        np.load(__import__("io").BytesIO(sample[TEXT_FEATURES_FIELD]))
        for url in ShardIndex.load(f"{features32}/val").urls
        for _, sample in read_shard(url)
    ][:4]
    images = [
        torch.cat(
            list(
                generate_images(
                    task,
                    task.model,
                    num_images=4,
                    steps=2,
                    seed=0,
                    guidance_scale=2.0,
                    decode=lambda x: x,
                    captions=prompts,
                )
            )
        )
        for task, prompts in ((in_loop, captions), (stored, features))
    ]
    torch.testing.assert_close(images[1], images[0], rtol=1e-5, atol=1e-6)


def test_text_features_cross_from_loader_workers_and_padding_holds_none():
    from prunepipe.pipelines.data.batch import Batch, text_fields

    rows = [np.full((n, 4), n, np.float16) for n in (2, 5, 1)]
    batch = Batch(
        torch.tensor([7, 8, 9, -1]),
        torch.ones(4),
        torch.zeros(4, 1, 2, 2),
        torch.full((4,), -1),
        **text_fields([*rows, None], width=4),
    )
    assert batch.text_tokens.shape == (8, 4) and batch.text_lengths.tolist() == [2, 5, 1, 0]
    back = pickle.loads(pickle.dumps(batch))  # what a loader worker's message does
    assert torch.equal(back.text_tokens, batch.text_tokens) and torch.equal(back.text_lengths, batch.text_lengths)
    (real,) = list(real_samples([back]))
    assert real.text_lengths.tolist() == [2, 5, 1] and torch.equal(real.text_tokens, batch.text_tokens)


def test_the_training_stream_carries_each_samples_own_features_through_workers_and_a_bad_sample(features16, tmp_path):  # noqa: F811
    import shutil

    import webdataset as wds

    from prunepipe.pipelines.data.splits import read_text_features
    from prunepipe.pipelines.data.stream import ShardStream

    folder = tmp_path / "train"
    shutil.copytree(f"{features16}/train", folder)
    index = ShardIndex.load(str(folder))
    first = index.urls[0]
    samples = [sample for _, sample in read_shard(first)]
    with wds.TarWriter(first) as sink:  # the sixth sample of the first shard lost its features
        for position, sample in enumerate(samples):
            kept = {
                k: v for k, v in sample.items() if k != "__url__" and not (position == 5 and k == TEXT_FEATURES_FIELD)
            }
            sink.write(kept)
    stored = read_text_features(f"{features16}/train", range(index.num_samples), 16, 8)
    decoder = SampleDecoder(8, 4, text_width=16, text_max_length=8)
    seen, padding, bad = [], 0, 0
    for rank in range(2):
        stream = ShardStream(
            index,
            batch_size=32,
            seed=1,
            rank=rank,
            world_size=2,
            decoder=decoder,
            shuffle_buffer=32,
            on_bad_sample="skip",
        )
        for batch in stream.pass_loader(0, num_workers=1):
            bad += batch.undecodable()
            ends = np.cumsum(batch.text_lengths.numpy())
            for i, sample_id in enumerate(batch.ids.tolist()):
                rows = batch.text_tokens[ends[i] - batch.text_lengths[i] : ends[i]]
                if sample_id < 0:
                    assert len(rows) == 0
                    padding += 1
                else:
                    assert torch.equal(rows, torch.from_numpy(stored[sample_id])), sample_id
                    seen.append(sample_id)
    # 256 samples a rank in batches of 32: the bad sample (id 5) was skipped, counted and padded for;
    # the others came each with its own rows
    assert bad == 1 and padding == 1 and 5 not in seen
    assert sorted(seen) == sorted(set(range(index.num_samples)) - {5})


def test_a_sample_without_features_is_bad_input_named_by_its_field():
    decoder = SampleDecoder(8, 4, text_width=16, text_max_length=8)
    sample = {"__key__": "000000007", "__url__": "shard-000003.tar", "latent.npy": b"", "txt": b"a digit"}
    with pytest.raises(BadInputError, match=r"shard-000003.tar key '000000007': no text features \(field 'text.npy'"):
        decoder.text(sample)
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.zeros((9, 16), np.float16))
    with pytest.raises(BadInputError, match=r"holds float16 \[9, 16\]; expected .* 1 to 8 tokens"):
        decoder.text({**sample, TEXT_FEATURES_FIELD: buffer.getvalue()})


def test_precomputed_text_is_refused_where_a_split_holds_no_features_or_another_encoders(
    features16, captioned, encoder, tmp_path
):  # noqa: F811
    with pytest.raises(ConfigError, match=r"data check: .*data.val=.* holds no text features"):
        check_data(
            load_config(
                CONFIG,
                [
                    f"data.train={features16}/train",
                    f"data.val={captioned}/val",
                    f"runs_dir={tmp_path}",
                    "ldm.space=latents",
                    *tiny(encoder),
                    *PRECOMPUTED,
                ],
            )
        )
    other = write_tiny_text_encoder(
        str(tmp_path / "other"), ["a different vocabulary"], hidden_size=16, layers=1, max_length=8
    )
    encode_shards(
        f"{captioned}/val",
        f"{features16}/vae",
        str(tmp_path / "val_other"),
        resolution=8,
        text_encoder=other,
        text_max_length=8,
    )
    encode_shards(
        f"{captioned}/val",
        f"{features16}/vae",
        str(tmp_path / "val_shorter"),
        resolution=8,
        text_encoder=encoder,
        text_max_length=6,
    )
    for val in ("val_other", "val_shorter"):  # another encoder; the same one, captions cut at another length
        with pytest.raises(ConfigError, match="data check: .*different encoders or caption lengths"):
            check_data(
                load_config(
                    CONFIG,
                    [
                        f"data.train={features16}/train",
                        f"data.val={tmp_path}/{val}",
                        f"runs_dir={tmp_path}",
                        "ldm.space=latents",
                        *tiny(encoder),
                        *PRECOMPUTED,
                    ],
                )
            )


@pytest.fixture(scope="module")
def stored_run(features16, encoder, tmp_path_factory):  # noqa: F811
    runs = tmp_path_factory.mktemp("runs")
    cfg = latent_config(features16, runs, "stored", *tiny(encoder), *PRECOMPUTED, "num_passes=2")
    train(cfg)
    return cfg


def test_a_run_on_precomputed_features_trains_exports_and_is_evaluated_offline(
    stored_run,
    captioned,
    clip,  # noqa: F811
    encoder,
    tmp_path,
):
    records = passes_of(stored_run.run_dir)
    assert records[-1]["bad_samples"] == 0 and math.isfinite(records[-1]["held_out"]["denoise_mse"])
    export = os.path.join(stored_run.run_dir, "export")
    with open(os.path.join(export, "text_encoder.json")) as f:
        recorded, identity = json.load(f), TextEncoder(encoder, max_length=8).identity()
    folders = ("text_encoder", "tokenizer")  # relative to the export: it moves with its encoder
    assert {k: v for k, v in recorded.items() if k not in folders} == {
        k: v for k, v in identity.items() if k not in folders
    }
    assert all(os.path.realpath(os.path.join(export, recorded[k])) == os.path.realpath(encoder) for k in folders)
    from diffusers import PixArtSigmaPipeline

    from prunepipe.pipelines.tasks.diffusion.from_export import pixart_pipeline

    # a flow export: PixArtSigmaPipeline, stepped by Euler as DPMSolverMultistepScheduler (tests/test_export.py)
    assert isinstance(pixart_pipeline(export), PixArtSigmaPipeline)
    eval_cfg = load_eval_config(
        overrides=settings(
            clip,
            str(tmp_path),
            f"fid.reference={captioned}/val",
            f"fid.vae={os.path.dirname(stored_run.data.train)}/vae",
        )
    )
    record = evaluate_checkpoint(stored_run.run_dir, eval_cfg=eval_cfg)
    assert all(math.isfinite(v) for v in record["metrics"].values()) and {"fid", "clip_score"} <= set(record["metrics"])
    assert record["details"]["held_out_captions"] == record["details"]["clip_score_samples"]

    # Never evaluated on another encoder's features: held-out shards named by the eval setting val=DIR,
    # or a run config whose splits were encoded again since (a copy of the run pointed at them).
    other = write_tiny_text_encoder(
        str(tmp_path / "other"), ["a different vocabulary"], hidden_size=16, layers=1, max_length=8
    )
    encode_shards(
        f"{captioned}/val",
        os.path.join(os.path.dirname(stored_run.data.train), "vae"),
        str(tmp_path / "val_other"),
        resolution=8,
        text_encoder=other,
        text_max_length=8,
    )
    quick = ["fid.enabled=false"]
    with pytest.raises(ValueError, match=r"trained with text encoder .*, but the held-out shards .*val_other is"):
        evaluate_checkpoint(
            stored_run.run_dir, eval_cfg=load_eval_config(overrides=[f"val={tmp_path}/val_other", *quick]), write=False
        )
    moved = tmp_path / "moved"
    shutil.copytree(stored_run.run_dir, moved)
    config = moved / "config.yaml"
    config.write_text(
        config.read_text()
        .replace(stored_run.data.train, f"{tmp_path}/val_other")
        .replace(stored_run.data.val, f"{tmp_path}/val_other")
    )
    with pytest.raises(ValueError, match=r"trained with text encoder .*, but the task's text encoder is"):
        evaluate_checkpoint(str(moved), eval_cfg=load_eval_config(overrides=quick), write=False)


def test_a_run_on_precomputed_features_resumes_bitwise_and_refuses_another_encoder(
    features16,
    encoder,  # noqa: F811
    tmp_path,
):
    base = [
        *tiny(encoder),
        *PRECOMPUTED,
        "ldm.space=latents",
        "num_passes=3",
        "checkpoint.every_steps=5",
        "pruner.name=infobatch",
        "score.normalise=stratum_mean",
    ]
    (_, straight, _), (_, resumed, _) = straight_and_resumed(CONFIG, features16, tmp_path, base, stop_at=20, end_at=25)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    other = write_tiny_text_encoder(
        str(tmp_path / "other"), ["a different vocabulary"], hidden_size=16, layers=1, max_length=8
    )
    cfg = latent_config(
        features16,
        tmp_path,
        "resumed",
        *[o for o in base if o not in PRECOMPUTED],
        f"ldm.text.encoder={other}",
        "checkpoint.resume=latest",
    )
    with pytest.raises(ValueError, match="the features of text encoder"):
        train(cfg)


def test_diffusers_pixart_alpha_pipeline_loads_a_ddpm_export_and_samples_its_images(
    features16,
    encoder,  # noqa: F811
    tmp_path,
):
    from test_text_to_image import PROMPTS

    from prunepipe.pipelines.tasks.diffusion.from_export import pixart_pipeline, sample

    cfg = latent_config(
        features16,
        tmp_path,
        "ddpm",
        *tiny(encoder),
        *PRECOMPUTED,
        "ldm.objective=ddpm",
        "ldm.ddpm.prediction_type=epsilon",
        "ldm.ddpm.timestep_sampling=uniform",
        "ldm.flow.weighting=uniform",
    )
    task = build_task(cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random weights: PixArt's init zeroes the cross-attention outputs
        for parameter in task.model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    export, vae = str(tmp_path / "export"), f"{features16}/vae"
    task.export(task.model, None, export)
    ours = sample(
        export, 2, 4, torch.Generator().manual_seed(7), ema=False, prompts=PROMPTS, guidance_scale=2.0, vae=vae
    )
    pipe = pixart_pipeline(export, ema=False, vae=vae)
    assert pipe._text_preprocessing(" A Photo of Paris ") == ["A Photo of Paris"]  # as written, not lowercased
    start = torch.randn((2, 4, 4, 4), generator=torch.Generator().manual_seed(7))  # what sample() draws first
    images = pipe(
        prompt=PROMPTS,
        num_inference_steps=4,
        guidance_scale=2.0,
        latents=start,
        height=8,
        width=8,
        output_type="pt",
        use_resolution_binning=False,
        clean_caption=False,
        max_sequence_length=8,
    ).images
    torch.testing.assert_close(images, ours, rtol=0, atol=1e-5)
    assert not torch.equal(ours[0], ours[1]), "the prompt chooses the image"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_on_precomputed_text_never_wait_for_the_device(features16, encoder, tmp_path):  # noqa: F811
    # the tokens placed by index on the device, the padding and dropped rows picked there: no host sync
    cfg = latent_config(
        features16,
        tmp_path,
        "strict",
        *tiny(encoder),
        *PRECOMPUTED,
        "num_passes=1",
        "max_steps=6",
        "checkpoint.every_steps=1000",
        "debug_device_sync=true",
        "data.num_workers=2",
        "data.val=",
    )
    try:
        summary = train(cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary == {} or summary["optimizer_steps"] == 6
