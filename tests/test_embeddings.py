"""Embeddings beside the shards: made by a feature network or the perceptual hash, imported from
clip-retrieval and DataComp by key, resumed after an interruption to the same bytes, and refused when
they do not describe the index beside them."""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from prunepipe.pipelines.data.group_table import open_groups
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.data.side_tables import open_embeddings
from prunepipe.tools.commands.embed import embed_shards
from prunepipe.tools.commands.embedding_import import import_embeddings
from prunepipe.tools.commands.perceptual_hash import PerceptualHash, bits_to_rows, phash_bits
from prunepipe.tools.commands.sources import near_duplicate, photo_crops


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def noise_image(seed: int, side: int = 32) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def write_split(folder, samples: list[dict], shard_size: int) -> str:
    """`samples` (webdataset dicts) as shards of `shard_size` with their index.json; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    entries = []
    for start in range(0, len(samples), shard_size):
        path = os.path.join(folder, f"shard-{start // shard_size:06d}.tar")
        with wds.TarWriter(path) as sink:
            for sample in samples[start : start + shard_size]:
                sink.write(sample)
        entries.append((path, len(samples[start : start + shard_size])))
    ShardIndex.write(str(folder), entries)
    return str(folder)


def noise_split(folder, n: int = 40, shard_size: int = 15) -> str:
    return write_split(folder, [{"__key__": f"s{i:04d}", "png": png(noise_image(i))} for i in range(n)], shard_size)


@pytest.fixture(scope="module")
def tiny_timm_weights(tmp_path_factory) -> str:
    """A randomly initialised timm test model, saved to a local file (nothing is downloaded)."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=10)  # with a head: the loader must drop it
    path = str(tmp_path_factory.mktemp("timm") / "test_resnet.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


class Interrupted(Exception):
    pass


class StopsAfter:
    """A feature model that raises on its `calls`-th batch, as a killed process stops."""

    def __init__(self, model, calls: int):
        self.model, self.calls, self.made = model, calls, 0
        for name in ("spec", "image_size", "channels", "dim", "describe"):
            setattr(self, name, getattr(model, name))

    def __call__(self, pixels):
        self.made += 1
        if self.made == self.calls:
            raise Interrupted
        return self.model(pixels)


def test_embed_resumes_after_an_interruption_to_the_same_bytes(tmp_path, tiny_timm_weights):
    from prunepipe.tools.commands.feature_models import load_feature_model

    split = noise_split(tmp_path / "split")  # shards of 15, 15 and 10: 4, 4 and 3 batches of 4
    spec = "timm:test_resnet"
    model = load_feature_model(spec, weights=tiny_timm_weights, image_size=32, device="cpu")
    whole = embed_shards(split, spec, name="whole", batch_size=4, model=model)

    cut = StopsAfter(model, calls=6)  # shard 0 is sealed, shard 1 is not
    with pytest.raises(Interrupted):
        embed_shards(split, spec, name="cut", batch_size=4, model=cut)
    parts = os.path.join(split, "embeddings", "cut.parts")
    assert sorted(f for f in os.listdir(parts) if f.endswith("_stats.json")) == ["shard-000000_stats.json"]
    assert not os.path.exists(os.path.join(split, "embeddings", "cut.json"))  # unreadable until finished

    resumed = StopsAfter(model, calls=-1)
    path = embed_shards(split, spec, name="cut", batch_size=4, model=resumed)
    assert resumed.made == 4 + 3  # only the unsealed shards were embedded again
    assert open(path, "rb").read() == open(whole, "rb").read()
    assert not os.path.exists(parts), "the parts go once the table is whole"

    table = open_embeddings(split, "cut")
    assert table.rows.dtype == np.float16 and table.rows.shape == (40, 96)
    np.testing.assert_allclose(np.linalg.norm(table.rows.astype(np.float32), axis=1), 1.0, atol=2e-3)
    header = table.header
    assert header["model"] == spec and header["count"] == 40 and header["dim"] == 96
    assert header["weights_sha256"] == hashlib.sha256(open(tiny_timm_weights, "rb").read()).hexdigest()
    assert header["image_size"] == 32 and header["missing"]["count"] == 0
    assert header["index"]["num_samples"] == 40


def test_a_resume_with_other_settings_is_refused(tmp_path):
    split = noise_split(tmp_path / "split")
    with pytest.raises(Interrupted):
        embed_shards(split, "phash", name="h", batch_size=4, model=StopsAfter(PerceptualHash(), 6))
    with pytest.raises(ValueError, match=r"h.parts/shard-000000_stats.json: sealed .* other settings \(batch_size"):
        embed_shards(split, "phash", name="h", batch_size=8)


def test_timm_folder_and_weights_file_give_the_same_rows(tmp_path, tiny_timm_weights):
    import timm
    from safetensors.torch import load_file
    from timm.models import save_for_hf

    split = noise_split(tmp_path / "split", n=12, shard_size=5)
    model = timm.create_model("test_resnet", num_classes=10)
    model.load_state_dict(load_file(tiny_timm_weights))
    save_for_hf(model, str(tmp_path / "folder"), safe_serialization=True)
    by_file = embed_shards(split, "timm:test_resnet", weights=tiny_timm_weights, image_size=32, device="cpu")
    by_folder = embed_shards(split, f"timm:{tmp_path / 'folder'}", image_size=32, device="cpu")
    assert os.path.basename(by_file) == "timm-test_resnet.npy" and os.path.basename(by_folder) == "timm-folder.npy"
    np.testing.assert_array_equal(np.load(by_file), np.load(by_folder))


def test_the_mae_export_embeds_with_its_encoder(tmp_path):
    from prunepipe.pipelines.tasks.mae import MAEConfig, MAETask

    torch.manual_seed(0)
    task = MAETask(
        MAEConfig(
            patch_size=8, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2
        ),
        image_size=32,
        channels=3,
    )
    task.export(task.model, None, str(tmp_path / "runs" / "tiny" / "export"))
    split = noise_split(tmp_path / "split", n=6, shard_size=6)
    path = embed_shards(split, f"mae:{tmp_path / 'runs' / 'tiny'}", batch_size=4, device="cpu")
    assert os.path.basename(path) == "mae-tiny.npy"
    rows = np.load(path)
    assert rows.shape == (6, 32)
    assert np.abs(rows[0].astype(np.float32) - rows[1]).max() > 1e-3  # different images, different rows


def test_a_sample_that_does_not_decode_is_missing_not_guessed(tmp_path):
    samples = [{"__key__": f"s{i:04d}", "png": png(noise_image(i))} for i in range(10)]
    samples[6] = {"__key__": "s0006", "png": b"not an image"}
    split = write_split(tmp_path / "split", samples, shard_size=4)
    embed_shards(split, "phash", batch_size=4)
    table = open_embeddings(split, "phash")
    assert table.missing_ids().tolist() == [6]
    assert not table.rows[6].any() and table.rows[5].any()
    assert table.header["missing"]["count"] == 1 and "s0006" in table.header["missing"]["first_reasons"][0]


def test_the_header_check_refuses_a_mismatched_index(tmp_path):
    split = noise_split(tmp_path / "split", n=12, shard_size=5)
    embed_shards(split, "phash")
    index_path = os.path.join(split, "index.json")
    original = json.load(open(index_path))

    with pytest.raises(FileNotFoundError, match=r"embeddings/clip\.json.*there: phash"):
        open_embeddings(split, "clip")
    with pytest.raises(FileNotFoundError, match="groups/phash.json"):
        open_groups(split, "phash")

    longer = json.loads(json.dumps(original))
    longer["shards"][0]["num_samples"] += 1
    json.dump(longer, open(index_path, "w"))
    with pytest.raises(ValueError, match=r"phash\.npy: 12 rows.*lists 13"):
        open_embeddings(split, "phash")

    reordered = json.loads(json.dumps(original))
    reordered["shards"][0], reordered["shards"][1] = reordered["shards"][1], reordered["shards"][0]
    json.dump(reordered, open(index_path, "w"))
    with pytest.raises(ValueError, match=r"phash\.json: made for another shard list"):
        open_embeddings(split, "phash")

    json.dump({**original, "note": "keys other than the shard list move no id"}, open(index_path, "w"))
    assert len(open_embeddings(split, "phash")) == 12
    array = os.path.join(split, "embeddings", "phash.npy")
    np.save(array, np.load(array).astype(np.float32))
    with pytest.raises(ValueError, match=r"phash\.npy: dtype float32"):
        open_embeddings(split, "phash")


def test_the_perceptual_hash_keeps_near_duplicates_closer_than_other_crops():
    crops = [np.asarray(image).transpose(2, 0, 1) for _, image, _ in photo_crops(32, crops_per_photo=2, seed=0)]
    rng = np.random.default_rng(1)
    copies = [np.asarray(near_duplicate(Image.fromarray(c.transpose(1, 2, 0)), rng)).transpose(2, 0, 1) for c in crops]
    bits, copy_bits = phash_bits(np.stack(crops)), phash_bits(np.stack(copies))
    assert bits.shape == (30, 64) and np.all(np.abs(bits.sum(axis=1) - 32) <= 1)  # a median split of 64
    near = (bits != copy_bits).sum(axis=1)
    far = (bits != np.roll(bits, 2, axis=0)).sum(axis=1)  # two crops a photograph: each against another one's
    assert np.median(near) < far.min() and (near <= 12).mean() >= 0.25 and (far <= 12).sum() == 0
    rows = bits_to_rows(bits)
    assert float(rows[0] @ rows[2]) == pytest.approx(1 - 2 * far[2] / 64)  # what dedup's threshold means
    assert PerceptualHash(12)(np.stack(crops)).shape == (30, 144)


def keyed_split(folder, n: int, uids: bool = False) -> str:
    samples = []
    for i in range(n):
        sample = {"__key__": f"{i:09d}", "png": png(noise_image(i, 8))}
        if uids and i != 4:  # sample 4 carries no uid
            sample["json"] = json.dumps({"uid": f"{i * 7919:032x}", "caption": "x"}).encode()
        samples.append(sample)
    return write_split(folder, samples, shard_size=7)


def test_a_clip_retrieval_import_joins_by_key_and_reports_missing_samples(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = keyed_split(tmp_path / "split", 20)
    rng = np.random.default_rng(0)
    vectors = {f"{i:09d}": rng.standard_normal(16).astype(np.float32) for i in range(20) if i not in (3, 11, 17)}
    vectors["elsewhere_1"] = vectors["elsewhere_2"] = rng.standard_normal(16).astype(np.float32)  # no such samples
    keys = list(vectors)
    rng.shuffle(keys)  # the metadata's order is not the shards' order
    source = tmp_path / "clip"
    (source / "img_emb").mkdir(parents=True)
    (source / "metadata").mkdir()
    for part, chunk in enumerate((keys[:9], keys[9:])):
        np.save(source / "img_emb" / f"img_emb_{part}.npy", np.stack([vectors[k] for k in chunk]).astype(np.float16))
        pq.write_table(
            pa.table({"image_path": chunk, "caption": ["a photo"] * len(chunk)}),
            source / "metadata" / f"metadata_{part}.parquet",
        )

    summary = import_embeddings(split, str(source), format="clip-retrieval", name="clip")
    assert summary["missing"] == 3 and summary["missing_first_keys"] == ["000000003", "000000011", "000000017"]
    assert summary["rows_matching_no_sample"] == 2
    table = open_embeddings(split, "clip")
    assert table.missing_ids().tolist() == [3, 11, 17] and not table.rows[[3, 11, 17]].any()
    assert table.header["missing"]["first_keys"] == ["000000003", "000000011", "000000017"]
    for i in (0, 5, 19):
        expected = vectors[f"{i:09d}"].astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(table.rows[i], expected / np.linalg.norm(expected), atol=2e-3)

    np.save(source / "img_emb" / "img_emb_2.npy", np.stack([vectors[keys[0]]]))  # a key given twice
    pq.write_table(pa.table({"image_path": [keys[0]]}), source / "metadata" / "metadata_2.parquet")
    with pytest.raises(ValueError, match=r"has a row in .*metadata_\d\.parquet and again in .*metadata_2\.parquet"):
        import_embeddings(split, str(source), format="clip-retrieval", name="clip")


def test_a_datacomp_import_joins_by_uid_and_reports_missing_samples(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = keyed_split(tmp_path / "split", 15, uids=True)
    rng = np.random.default_rng(1)
    uids = [f"{i * 7919:032x}" for i in range(15) if i not in (4, 9)]  # 4 has no uid, 9 has no row
    rng.shuffle(uids)
    l14 = rng.standard_normal((len(uids), 24)).astype(np.float16)
    b32 = rng.standard_normal((len(uids), 8)).astype(np.float16)
    source = tmp_path / "datacomp"
    source.mkdir()
    stem = "0123456789abcdef0123456789abcdef"  # DataComp names a metadata part by a hex stem
    pq.write_table(
        pa.table({"uid": [u.upper() for u in uids], "url": ["http://x"] * len(uids)}), source / f"{stem}.parquet"
    )
    np.savez(source / f"{stem}.npz", l14_img=l14, b32_img=b32)

    summary = import_embeddings(split, str(source), format="datacomp", embedding="b32_img")
    assert summary["matched"] == 13 and summary["missing"] == 2
    assert summary["missing_first_keys"] == ["<sample 4: no json:uid>", f"{9 * 7919:032x}"]
    table = open_embeddings(split, "datacomp")
    assert table.dim == 8 and table.missing_ids().tolist() == [4, 9]
    for row, uid in enumerate(uids):
        sample_id = int(uid, 16) // 7919
        expected = b32[row].astype(np.float32)
        np.testing.assert_allclose(table.rows[sample_id], expected / np.linalg.norm(expected), atol=2e-3)
    assert table.header["model"] == "import:datacomp:b32_img" and table.header["join_column"] == "uid"
