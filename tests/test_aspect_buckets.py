"""Aspect-ratio buckets as a specification: real photographs cropped at 1:1, 1:2, 2:1 and 4:3 (w:h) and
written as img2dataset shards are encoded by `latents encode --buckets` into one tar per bucket of each
input shard, every latent at its nearest bucket's shape, with the crop and the original size beside
it; the index lists the bucket tars and the whole table; a rerun skips sealed shards and redoes one
whose bucket tar is gone. `shards index --aspect` counts the same folder from the json alone."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from eval_runs import tiny_vae
from PIL import Image

from prunepipe.launch.cli import main
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.resize import resize_center_crop, resize_cover_crop
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.tools.commands.aspect_buckets import BUCKET_FIELD, load_buckets, nearest_buckets
from prunepipe.tools.commands.latents import LATENT_FIELD, encode_shards
from prunepipe.tools.commands.shards import aspect_counts, write_samples

BUCKETS = "# height x width, multiples of the tiny VAE's factor 2\n32x32\n32x64\n64x32\n24x32\n16x64\n"
# (height, width) of each kind of image, its bucket (by the table above) and the crop's (top, left) there:
# 45x100 covers 32x64 at 32x71 (left (71-64)//2 = 3), 100x48 covers 64x32 at 67x32 (top 1)
KINDS = {
    "square": ((40, 40), 0, [0, 0]),
    "wide": ((45, 100), 1, [0, 3]),
    "tall": ((100, 48), 2, [1, 0]),
    "four_three": ((36, 48), 3, [0, 0]),
}
PER_KIND, UNKNOWN = 5, 2  # and two more square images whose json gives no size


def photo_crop(index: int, height: int, width: int) -> Image.Image:
    """A crop of one of scikit-image's photographs at height:width, resized to height x width."""
    from skimage import data

    photo = [data.astronaut, data.coffee, data.chelsea][index % 3]()
    top, left = 5 * index, 7 * index
    return Image.fromarray(photo[top : top + 3 * height, left : left + 3 * width]).resize((width, height))


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """22 photographs in 2 img2dataset shards of 11 (jpg, txt, json): the four kinds in turn, then two
    squares whose json has no size; two squares give only original_width/original_height. Returns the
    folder and each key's kind."""
    kinds, samples = {}, []
    names = list(KINDS)
    for i in range(4 * PER_KIND + UNKNOWN):
        kind = names[i % 4] if i < 4 * PER_KIND else "square"
        (height, width), _, _ = KINDS[kind]
        key = f"{i:05d}"
        meta = {"key": key, "caption": f"a {kind} photograph", "status": "success"}
        if i < 4 * PER_KIND:
            meta.update(
                {"width": width, "height": height}
                if i not in (4, 8)
                else {"original_width": width, "original_height": height}
            )
        image = photo_crop(i, height, width)
        samples.append({"__key__": key, "jpg": jpeg(image), "txt": meta["caption"], "json": json.dumps(meta)})
        kinds[key] = kind
    folder = str(tmp_path_factory.mktemp("aspect") / "images")
    write_samples(
        folder, samples, source="aspect-test", size=32, shard_size=11, keys=["jpg", "json", "txt"], desc="aspect"
    )
    assert ShardIndex.load(folder).counts.tolist() == [11, 11]
    return folder, kinds


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("vae"))
    tiny_vae(3, 32).save_pretrained(folder)  # factor 2, 4 latent channels
    return folder


@pytest.fixture(scope="module")
def table_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("table") / "buckets.txt"
    path.write_text(BUCKETS)
    return str(path)


@pytest.fixture(scope="module")
def bucketed(images, vae, table_file, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("latents") / "bucketed")
    assert encode_shards(images[0], vae, out, buckets=table_file, batch_size=3, dtype="float32") == os.path.join(
        out, "index.json"
    )
    return out


def samples_of(url: str) -> list[dict]:
    return [sample for _, sample in read_shard(url)]


def latent(sample: dict) -> np.ndarray:
    return np.load(io.BytesIO(sample[LATENT_FIELD]))


def test_each_image_is_encoded_at_its_nearest_bucket_with_its_crop_and_original_size(images, bucketed):
    folder, kinds = images
    index = ShardIndex.load(bucketed)
    assert [os.path.basename(url) for url in index.urls] == [
        f"shard-00000{shard}.b0{bucket}.tar" for shard in (0, 1) for bucket in range(4)
    ], "each input shard's bucket tars, in input-shard order then bucket order"
    assert index.buckets.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    shapes = set()
    for url, bucket in zip(index.urls, index.buckets.tolist()):
        for sample in samples_of(url):
            (height, width), expected_bucket, top_left = KINDS[kinds[sample["__key__"]]]
            assert bucket == expected_bucket, f"{sample['__key__']} ({kinds[sample['__key__']]}) in bucket {bucket}"
            assert latent(sample).shape == index.bucket_shapes[bucket]
            shapes.add(latent(sample).shape)
            where = json.loads(sample[BUCKET_FIELD])
            assert where == {
                "bucket": index.bucket_table[bucket]["name"],
                "original_size": [height, width],
                "crop_top_left": top_left,
            }
            assert "txt" in sample and "json" in sample, "the caption and metadata travel with the latent"
    assert shapes == {(4, 16, 16), (4, 16, 32), (4, 32, 16), (4, 12, 16)}, "exactly four latent shapes"

    # ids: a permutation of the image shards' ids, grouped by bucket within each input shard, input order kept
    before = [s["__key__"] for url in ShardIndex.load(folder).urls for s in samples_of(url)]
    after = [s["__key__"] for url in index.urls for s in samples_of(url)]
    assert sorted(after) == sorted(before) and after != before
    for shard in (0, 1):
        mine = before[11 * shard : 11 * (shard + 1)]
        grouped = sorted(mine, key=lambda key: KINDS[kinds[key]][1])  # a stable sort: input order within a bucket
        assert after[11 * shard : 11 * (shard + 1)] == grouped


def test_the_index_lists_the_whole_table_and_the_square_base_shape(bucketed, table_file):
    index = ShardIndex.load(bucketed)
    assert [b["name"] for b in index.bucket_table] == ["32x32", "32x64", "64x32", "24x32", "16x64"]
    assert [b["image"] for b in index.bucket_table] == [[32, 32], [32, 64], [64, 32], [24, 32], [16, 64]]
    assert index.bucket_shapes == [(4, 16, 16), (4, 16, 32), (4, 32, 16), (4, 12, 16), (4, 8, 32)]
    assert 4 not in index.buckets.tolist(), "an empty bucket is listed in the table, with no shard"
    assert index.meta["latent_shape"] == [4, 16, 16], "the base: --resolution 32 (the image index's size) / 2"
    assert index.meta["bucket_table"] == {"name": "buckets.txt", "source": os.path.abspath(table_file)}
    assert BUCKET_FIELD in index.meta["keys"] and LATENT_FIELD in index.meta["keys"]
    assert index.counts.tolist() == [len(samples_of(url)) for url in index.urls] and index.num_samples == 22
    for url, size in zip(index.urls, index.sizes.tolist()):
        assert os.path.getsize(url) == size
    with open(os.path.join(bucketed, "shard-000001_stats.json")) as f:
        seal = json.load(f)
    assert seal["successes"] == 11 and set(seal["files"]) == {f"shard-000001.b0{b}.tar" for b in range(4)}


def test_a_bucket_latent_is_the_vae_mean_of_the_uncropped_image_cut_to_its_bucket(images, bucketed, vae):
    folder, kinds = images
    originals = {s["__key__"]: s for url in ShardIndex.load(folder).urls for s in samples_of(url)}
    wide = next(s for s in samples_of(ShardIndex.load(bucketed).urls[1]) if kinds[s["__key__"]] == "wide")
    image, _ = SampleDecoder().decode_original(originals[wide["__key__"]])
    cut, _ = resize_cover_crop(image, 32, 64)
    pixels = torch.from_numpy(np.asarray(cut, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
    model = AutoencoderKL.from_pretrained(vae)
    with torch.no_grad():
        expected = model.encode(pixels[None]).latent_dist.mean[0] * model.config.scaling_factor
    torch.testing.assert_close(torch.from_numpy(latent(wide)), expected, rtol=1e-4, atol=1e-5)
    # the rectangular cut is the square one's generalisation, pixel for pixel
    assert np.array_equal(np.asarray(resize_cover_crop(image, 32, 32)[0]), np.asarray(resize_center_crop(image, 32)))


def test_a_rerun_skips_sealed_shards_and_redoes_one_whose_bucket_tar_is_gone(images, vae, bucketed, table_file, capsys):
    tars = {
        name: open(os.path.join(bucketed, name), "rb").read() for name in os.listdir(bucketed) if name.endswith(".tar")
    }
    capsys.readouterr()
    encode_shards(images[0], vae, bucketed, buckets=table_file, batch_size=3, dtype="float32")
    assert "sealed (" not in capsys.readouterr().out, "every shard was sealed: none encoded again"

    os.remove(os.path.join(bucketed, "shard-000001.b02.tar"))
    encode_shards(images[0], vae, bucketed, buckets=table_file, batch_size=3, dtype="float32")
    out = capsys.readouterr().out
    assert out.count("sealed (") == 1 and "shard-000001.tar sealed" in out, "only the shard that lost a tar"
    assert tars == {n: open(os.path.join(bucketed, n), "rb").read() for n in os.listdir(bucketed) if n.endswith(".tar")}

    other = table_file + ".other.txt"
    with open(other, "w") as f:
        f.write("32x32\n32x64\n64x32\n")
    with pytest.raises(ValueError, match=r"other settings \(buckets differ\)"):
        encode_shards(images[0], vae, bucketed, buckets=other, batch_size=3, dtype="float32")


def test_a_bucket_the_vae_cannot_encode_exactly_is_named(images, vae, tmp_path):
    odd = tmp_path / "odd.txt"
    odd.write_text("32x32\n33x64\n")
    with pytest.raises(
        ValueError, match=r"odd\.txt: bucket 33x64 is not a multiple of the VAE's downsampling factor 2"
    ):
        encode_shards(images[0], vae, str(tmp_path / "out"), buckets=str(odd))


def test_the_nearest_bucket_is_nearest_in_log_ratio_and_a_tie_goes_to_the_first_listed():
    table = [(32, 32), (32, 64), (64, 32)]

    def nearest(height, width, sizes=table):
        return int(nearest_buckets(np.array([height]), np.array([width]), sizes)[0])

    assert [nearest(10, 10), nearest(10, 19), nearest(1000, 10), nearest(30, 80)] == [0, 1, 2, 1]
    # h/w 0.72: linearly nearer 0.5 (0.22 against 0.28), in log space nearer 1 (0.329 against 0.365)
    assert nearest(72, 100) == 0
    assert nearest(70, 100) == 1  # 0.357 against 0.336
    # a square image is as far from 1:2 as from 2:1: the bucket listed first, whichever it is
    assert nearest(50, 50, [(32, 64), (64, 32)]) == 0 and nearest(50, 50, [(64, 32), (32, 64)]) == 0
    assert nearest(3, 3, [(16, 64), (64, 64), (32, 32)]) == 1, "the same ratio twice: the first listed"


def test_named_diffusers_tables_resolve_and_bad_files_are_named(tmp_path):
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

    pixart = load_buckets("pixart512")
    assert pixart.sizes == tuple((int(h), int(w)) for h, w in ASPECT_RATIO_512_BIN.values())
    assert pixart.base == 512 and load_buckets("512") == pixart and pixart.names[0] == "256x1024"
    assert pixart.sizes[pixart.nearest(600, 800)] == (448, 576), "diffusers' 0.78 bucket for a 4:3 (w:h) photograph"
    assert load_buckets("2048").sizes == tuple((int(h), int(w)) for h, w in ASPECT_RATIO_2048_BIN.values())

    text = tmp_path / "sizes.txt"
    text.write_text("32x32\n\n# comment\n32by64\n")
    with pytest.raises(ValueError, match=r"sizes\.txt: line 4: '32by64' is not HEIGHTxWIDTH"):
        load_buckets(str(text))
    text.write_text("32x32\n64 x 32  # tall\n32x32\n")
    with pytest.raises(ValueError, match=r"line 3: bucket 32x32 is listed twice \(first at line 1\)"):
        load_buckets(str(text))
    listed = tmp_path / "sizes.json"
    listed.write_text("[[32, 32],\n [64, 32.0],\n [32, -4]]\n")
    with pytest.raises(ValueError, match=r"sizes\.json: entry 2 \(line 3\): \[32, -4\] is not \[height, width\]"):
        load_buckets(str(listed))
    listed.write_text("[[32, 32], [64, 32.0]]")
    assert load_buckets(str(listed)).sizes == ((32, 32), (64, 32))
    with pytest.raises(ValueError, match=r"--buckets 'pixart300': neither a table name \(pixart256, "):
        load_buckets("pixart300")


def test_shards_index_aspect_counts_each_bucket_from_the_json_alone(images, table_file, tmp_path, capsys):
    folder = images[0]
    by_ratio = aspect_counts([folder])
    assert dict(zip(by_ratio.labels, by_ratio.counts.tolist())) == {
        **{label: 0 for label in by_ratio.labels},
        "1:1": PER_KIND,
        "1:2": PER_KIND,
        "2:1": PER_KIND,
        "4:3": PER_KIND,  # width:height, as ratios are said everywhere; sizes are HxW (24x32)
    }
    assert by_ratio.unknown == UNKNOWN, "samples whose json gives no size are counted, as unknown"

    assert main(["shards", "index", folder, "--out", str(tmp_path / "index"), "--buckets", table_file]) in (0, None)
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines()[2:]}
    assert "aspect ratios of 22 samples" in printed
    assert rows["32x32"] == ["5", "22.7%"] and rows["32x64"] == ["5", "22.7%"] and rows["64x32"] == ["5", "22.7%"]
    assert rows["24x32"] == ["5", "22.7%"] and rows["unknown"] == ["2", "9.1%"] and "16x64" not in rows
    assert "(1 of 5 buckets of buckets.txt hold no sample)" in printed


def test_indexing_bucketed_latent_shards_again_is_refused(bucketed, tmp_path):
    """An index without each shard's bucket would stack two shapes in one batch: keep the encode's."""
    from prunepipe.tools.commands.shards import index_shards

    with pytest.raises(ValueError, match=r"latents encode --buckets.*keep it"):
        index_shards([bucketed], str(tmp_path / "again"))
