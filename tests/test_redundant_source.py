"""The redundant source closer to web data (tools/commands/sources.py:redundant_splits): heavy-tailed copy
counts that still sum to the stated fraction, exact, re-encoded, near and cropped copies made as
named, keys that lead every copy to its original, val_mix and train_dedup by the same rules, flags
that name themselves when wrong, and the default set unchanged, bit for bit."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import Counter

import numpy as np
import PIL
import pytest
from PIL import Image

from prunepipe.launch.cli import build_parser, main
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.tools.benchmarks.dedup_quality import check_written_as_asked, found_with_original, known_families
from prunepipe.tools.commands.sources import COPY_KEY, copies_by_kind, copy_kind, heavy_copy_counts, redundant_splits
from prunepipe.tools.fixtures.known_groups import known_groups, original_key, split_keys

WEB_KINDS = {"exact": 0.25, "jpeg": 0.25, "near": 0.25, "crop": 0.25}


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def copy_counts_of(keys) -> Counter:
    """Copies per original, read from the keys."""
    return Counter(COPY_KEY.match(key)["original"] for key in keys if COPY_KEY.match(key))


@pytest.fixture(scope="module")
def web_splits() -> dict:
    """16 px, 300 crops: 270 train copies of 100 originals, heavy-tailed, a quarter of each kind."""
    return redundant_splits(16, crops_per_photo=20, originals=100, copy_counts="heavy", copy_kinds=WEB_KINDS)


def test_default_set_is_the_first_versions_bit_for_bit():
    # sha256 of every split's keys, labels and pixels at the default copy counts and kinds (even, all
    # near); a Pillow or numpy release that changes resampling or the generators would move it too
    digest = hashlib.sha256()
    for split, items in sorted(redundant_splits(size=16, crops_per_photo=8, originals=16).items()):
        digest.update(split.encode())
        for key, image, label in items:
            digest.update(key.encode())
            digest.update(str(label).encode())
            digest.update(np.asarray(image).tobytes())
    assert digest.hexdigest() == "60ec4ee95461eb27ad5c247714a81e99c58cd9adcf91538d720ffa8500d658d0", (
        f"the default redundant set changed (Pillow {PIL.__version__}, numpy {np.__version__})"
    )
    explicit = redundant_splits(size=16, crops_per_photo=8, originals=16, copy_counts="even", copy_kinds={"near": 1.0})
    assert [k for k, _, _ in explicit["train"]] == [
        k for k, _, _ in redundant_splits(16, crops_per_photo=8, originals=16)["train"]
    ]


def test_heavy_copy_counts_follow_zipfs_law_and_sum_to_the_duplicates():
    counts = heavy_copy_counts(3375, 1000)  # the default set's 3,375 copies over 1,000 originals
    assert counts.sum() == 3375 and counts.min() == 1
    assert np.all(np.diff(counts) <= 0), "rank 1 is copied most"
    assert abs(counts[0] / counts[1] - 2.0) < 0.05 and abs(counts[0] / counts[3] - 4.0) < 0.1  # k^-1 at the head
    assert counts[0] >= 100 * np.median(counts)  # a few copied very often
    assert (counts == 1).sum() >= 500  # most once
    assert heavy_copy_counts(50, 50).tolist() == [1] * 50


def test_heavy_split_is_heavy_tailed_with_the_stated_fraction(web_splits):
    train = [key for key, _, _ in web_splits["train"]]
    counts = copy_counts_of(train)
    assert sum(counts.values()) == 270 and len(counts) == 100  # fraction 0.5 of 540; every original copied
    assert abs(sum(counts.values()) / len(train) - 0.5) < 1e-9
    sizes = sorted(counts.values(), reverse=True)
    assert sizes[0] >= 20 * np.median(sizes) and sum(s == 1 for s in sizes) >= 50
    assert sizes == heavy_copy_counts(270, 100).tolist()


def test_copies_are_made_as_their_kind_names(web_splits):
    train = web_splits["train"]
    image_of = {key: image for key, image, _ in train}
    assert copies_by_kind(image_of) == {"exact": 68, "jpeg": 68, "near": 67, "crop": 67}  # 270 in quarters
    differences = {kind: [] for kind in WEB_KINDS}
    for key, image in image_of.items():
        kind = copy_kind(key)
        if kind is not None:
            differences[kind].append(np.abs(pixels(image) - pixels(image_of[original_key(key)])).mean())
    others = [
        np.abs(pixels(a) - pixels(b)).mean()
        for a, b in zip(list(image_of.values())[::2], list(image_of.values())[1::2])
    ]
    assert max(differences["exact"]) == 0.0, "an exact copy has its original's pixels"
    assert min(differences["jpeg"]) > 0 and np.median(differences["jpeg"]) < 0.1 * np.median(others), (
        "a re-encoded copy differs, slightly"
    )
    for kind in ("near", "crop"):
        assert min(differences[kind]) > 0 and np.median(differences[kind]) < 0.5 * np.median(others)


def test_val_mix_and_train_dedup_follow_the_same_rules(web_splits):
    train_counts = copy_counts_of(key for key, _, _ in web_splits["train"])
    mix = [key for key, _, _ in web_splits["val_mix"]]
    mix_counts = copy_counts_of(mix)
    assert all("_heldoutdup" in key for key in mix if COPY_KEY.match(key))
    assert set(mix_counts) <= set(train_counts) and sum(mix_counts.values()) == 30  # 0.5 of 60 held out
    assert mix_counts.most_common(1)[0][0] == train_counts.most_common(1)[0][0], "drawn from the train mix"
    assert sum(copies_by_kind(mix).values()) == 30 and min(copies_by_kind(mix).values()) == 7
    train = [key for key, _, _ in web_splits["train"]]
    dedup = [key for key, _, _ in web_splits["train_dedup"]]
    assert [key for key in dedup if not copy_kind(key)] == [key for key in train if not copy_kind(key)]
    kept = [key for key in dedup if copy_kind(key)]
    assert kept == [key for key in train if copy_kind(key) and int(key[-5:]) % 5 < 2]  # copies 0 and 1 of each 5
    assert len(kept) == 108 and min(copies_by_kind(kept).values()) > 0


@pytest.fixture(scope="module")
def web_shards(tmp_path_factory) -> str:
    """`prunepipe shards write --source redundant` at --resolution 32 with heavy counts and mixed kinds."""
    out = str(tmp_path_factory.mktemp("redundant_web"))
    assert (
        main(
            [
                "shards",
                "write",
                "--source",
                "redundant",
                "--out",
                out,
                "--resolution",
                "32",
                "--crops-per-photo",
                "8",
                "--redundant-originals",
                "40",
                "--redundant-copies",
                "heavy",
                "--redundant-exact",
                "0.2",
                "--redundant-jpeg",
                "0.3",
                "--redundant-crop",
                "0.25",
            ]
        )
        == 0
    )
    return out


def test_shards_write_records_the_copy_rules_and_keys_lead_to_every_original(web_shards):
    train = os.path.join(web_shards, "train")
    meta = ShardIndex.load(train).meta
    assert meta["size"] == 32 and meta["redundant_copies"] == "heavy" and meta["redundant_originals"] == 40
    assert meta["redundant_kinds"] == pytest.approx({"exact": 0.2, "jpeg": 0.3, "near": 0.25, "crop": 0.25})
    keys = split_keys(train)
    assert meta["copies_by_kind"] == copies_by_kind(keys) == {"exact": 22, "jpeg": 32, "near": 27, "crop": 27}
    with open(os.path.join(web_shards, "val_mix", "index.json")) as f:
        assert sum(json.load(f)["copies_by_kind"].values()) == 12
    groups, families = known_groups(train), known_families(keys)
    id_of = {key: i for i, key in enumerate(keys)}
    for i, key in enumerate(keys):
        assert groups[i] == groups[id_of[original_key(key)]] and families[i] == id_of[original_key(key)]
    assert len(set(groups)) == len(keys) - 108  # every copy joins its original's group, nothing else merges
    decoded = {
        s["__key__"]: np.asarray(Image.open(io.BytesIO(s["png"])).convert("RGB"))
        for url in ShardIndex.load(train).urls
        for _, s in read_shard(url)
    }
    exact = [key for key in keys if copy_kind(key) == "exact"]
    assert all(np.array_equal(decoded[key], decoded[original_key(key)]) for key in exact), "PNG keeps them exact"


def test_dedup_quality_counts_each_kind_of_copy_found_with_its_original(web_shards):
    keys = split_keys(os.path.join(web_shards, "train"))
    families, kinds = known_families(keys), np.array([copy_kind(key) or "" for key in keys])
    assert found_with_original(families, families, kinds) == {
        "all": 1.0,
        "exact": 1.0,
        "jpeg": 1.0,
        "near": 1.0,
        "crop": 1.0,
    }
    alone = np.arange(len(keys))
    exact_only = np.where(kinds == "exact", families, alone)  # only the exact copies joined to their original
    assert found_with_original(exact_only, families, kinds) == {
        "all": round(22 / 108, 4),
        "exact": 1.0,
        "jpeg": 0.0,
        "near": 0.0,
        "crop": 0.0,
    }


def test_dedup_quality_refuses_a_folder_written_with_other_flags(web_shards):
    train = os.path.join(web_shards, "train")
    check_written_as_asked(
        train,
        {
            "size": 32,
            "redundant_copies": "heavy",
            "redundant_kinds": {"exact": 0.2, "jpeg": 0.3, "crop": 0.25, "near": 0.25},
        },
    )
    with pytest.raises(ValueError, match="--redundant-copies asks for even"):
        check_written_as_asked(train, {"redundant_copies": "even"})
    with pytest.raises(ValueError, match="--redundant-exact"):
        check_written_as_asked(train, {"redundant_kinds": {"near": 1.0}})


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--redundant-copies", "zipf"], "--redundant-copies"),
        (["--redundant-exact", "1.5"], "--redundant-exact"),
        (["--redundant-jpeg", "x"], "--redundant-jpeg"),
        (["--redundant-crop", "-0.1"], "--redundant-crop"),
        (["--redundant-fraction", "1"], "--redundant-fraction"),
        (["--redundant-originals", "0"], "--redundant-originals"),
    ],
)
def test_bad_flag_values_are_refused_naming_the_flag(flags, named, tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["shards", "write", "--source", "redundant", "--out", str(tmp_path), *flags])
    assert f"argument {named}" in capsys.readouterr().err


def test_shares_over_one_and_impossible_heavy_counts_are_refused_naming_the_flags(tmp_path, capsys):
    write = ["shards", "write", "--source", "redundant", "--out", str(tmp_path), "--crops-per-photo", "8"]
    assert main([*write, "--redundant-exact", "0.6", "--redundant-jpeg", "0.6"]) == 2
    assert "--redundant-exact 0.6, --redundant-jpeg 0.6" in capsys.readouterr().err
    assert (
        main([*write, "--redundant-copies", "heavy", "--redundant-originals", "100", "--redundant-fraction", "0.3"])
        == 2
    )  # 46 copies of 108 unique crops cannot copy 100 of them
    assert "--redundant-originals" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "train"), "nothing written"


def test_library_errors_name_the_field():
    with pytest.raises(ValueError, match="copy_counts 'zipf'; accepted: even, heavy"):
        redundant_splits(16, crops_per_photo=4, originals=4, copy_counts="zipf")
    with pytest.raises(ValueError, match="copy_kinds names \\['blur'\\]"):
        redundant_splits(16, crops_per_photo=4, originals=4, copy_kinds={"near": 0.5, "blur": 0.5})
    with pytest.raises(ValueError, match="copy_kinds shares must sum to 1"):
        redundant_splits(16, crops_per_photo=4, originals=4, copy_kinds={"near": 0.5, "exact": 0.4})
