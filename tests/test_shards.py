"""Shards from other writers (plain `tar`, webdataset's TarWriter), other url schemes, and every
kind of bad input: each names the shard and key, and every lost sample is counted."""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from prunepipe.pipelines.checkpoint.manifest import file_crc32
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.shards import BadInputError, ShardIndex, count_samples, read_shard, survey_shard
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.tools.commands.shards import describe_counting, index_shards, inspect_shards, png_bytes


def jpeg_bytes(seed: int, size: int = 16) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def write_tarwriter_shard(path: str, n: int, start: int = 0, broken: dict | None = None) -> str:
    """n samples written by webdataset's TarWriter; `broken` maps a position to a replacement sample."""
    with wds.TarWriter(path) as sink:
        for i in range(start, start + n):
            sample = {"__key__": f"s{i:05d}", "jpg": jpeg_bytes(i), "cls": str(i % 3)}
            if broken and i - start in broken:
                sample = {"__key__": f"s{i:05d}", **broken[i - start]}
            sink.write(sample)
    return path


def read_all(index: ShardIndex, policy: str, batch_size: int = 1):
    stream = ShardStream(
        index, batch_size=batch_size, decoder=SampleDecoder(resolution=16), on_bad_sample=policy, shuffle_buffer=1
    )
    return list(stream.pass_loader(0))


def test_plain_tar_in_img2dataset_layout_is_indexed_and_read(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    names = []
    for i in range(7):
        (files / f"{i:09d}.jpg").write_bytes(jpeg_bytes(i))
        (files / f"{i:09d}.txt").write_text(f"caption {i}")
        (files / f"{i:09d}.json").write_text('{"width": 16}')
        names += [f"{i:09d}.jpg", f"{i:09d}.txt", f"{i:09d}.json"]
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    subprocess.run(["tar", "-cf", str(shard_dir / "00000.tar"), "-C", str(files), *names], check=True)
    write_tarwriter_shard(str(shard_dir / "00001.tar"), 5, start=100)
    index = ShardIndex.load(index_shards([str(shard_dir)], str(shard_dir)))
    assert index.counts.tolist() == [7, 5]
    batches = read_all(index, "stop")
    assert sorted(int(b.ids[0]) for b in batches) == list(range(12))
    labels = sorted(int(b.labels[0]) for b in batches)
    assert labels.count(-1) == 7, "img2dataset shards carry no class; tarwriter ones do"
    report = inspect_shards(str(shard_dir), str(tmp_path / "grid.png"))
    assert report["samples"] == 12 and report["fields"]["jpg"] == 12
    assert os.path.getsize(tmp_path / "grid.png") > 0


def test_pipe_and_http_urls_are_read(tmp_path):
    shard = write_tarwriter_shard(str(tmp_path / "a.tar"), 6)
    assert [p for p, _ in read_shard(f"pipe:cat {shard}")] == list(range(6))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.tar"
        assert [s["__key__"] for _, s in read_shard(url)] == [f"s{i:05d}" for i in range(6)]
    finally:
        server.shutdown()


def make_case(tmp_path, case: str):
    """One good shard of 10 and one shard with the named defect; returns (index, bad url, key or None)."""
    good = write_tarwriter_shard(str(tmp_path / "good.tar"), 10)
    bad = str(tmp_path / f"{case}.tar")
    key = None
    if case == "truncated":
        write_tarwriter_shard(bad, 10, start=10)
        data = open(bad, "rb").read()
        open(bad, "wb").write(data[: len(data) // 2])
        key = "after key"
    elif case == "corrupt":
        open(bad, "wb").write(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif case == "not_an_image":
        write_tarwriter_shard(bad, 10, start=10, broken={3: {"jpg": b"this is text, not a JPEG"}})
        key = "s00013"
    elif case == "no_image_field":
        write_tarwriter_shard(bad, 10, start=10, broken={5: {"cls": "1"}})
        key = "s00015"
    elif case == "missing":
        pass  # listed in the index, never written
    index = ShardIndex((good, bad), np.array([10, 10]), path=str(tmp_path / "index.json"))
    return index, bad, key


LOST = {"truncated": None, "corrupt": 10, "not_an_image": 1, "no_image_field": 1, "missing": 10}


@pytest.mark.parametrize("case", list(LOST))
def test_bad_input_stops_with_a_message_naming_shard_and_key(tmp_path, case):
    index, bad_url, key = make_case(tmp_path, case)
    with pytest.raises(BadInputError) as error:
        read_all(index, "stop")
    message = str(error.value)
    assert bad_url in message
    if key:
        assert key in message
    assert "on_bad_sample" in message, "the message says how to go on"


@pytest.mark.parametrize("case", list(LOST))
def test_bad_input_skipped_is_counted_never_silent(tmp_path, case):
    index, bad_url, _ = make_case(tmp_path, case)
    batches = read_all(index, "skip")
    assert len(batches) == 20, "equal steps: short workers pad instead of stopping early"
    delivered = [int(b.ids[0]) for b in batches if int(b.ids[0]) >= 0]
    lost = sum(e.samples_lost for b in batches for e in b.bad)
    assert all(bad_url in e.message for b in batches for e in b.bad)
    assert len(delivered) + lost == index.num_samples, "every sample is delivered or counted as lost"
    padding = [b for b in batches if int(b.ids[0]) < 0]
    assert len(padding) == lost and all(float(b.weights[0]) == 0.0 for b in padding)
    if LOST[case] is not None:
        assert lost == LOST[case]
    else:
        assert 0 < lost < 10


def test_index_that_undercounts_a_shard_is_an_error(tmp_path):
    shard = write_tarwriter_shard(str(tmp_path / "a.tar"), 6)
    index = ShardIndex((shard,), np.array([4]), path="idx.json")
    with pytest.raises(BadInputError, match="re-index"):
        read_all(index, "stop")


def test_written_digits_shards_have_dense_ids_and_both_splits(digits_shards):
    train = ShardIndex.load(os.path.join(digits_shards, "train"))
    val = ShardIndex.load(os.path.join(digits_shards, "val"))
    assert train.num_samples + val.num_samples == 1797
    assert abs(val.num_samples - 180) <= 1
    assert train.first_ids[0] == 0 and (np.diff(train.first_ids) == train.counts[:-1]).all()
    moved = os.path.join(digits_shards, "..", "moved_copy")
    shutil.copytree(os.path.join(digits_shards, "train"), moved, dirs_exist_ok=True)
    assert ShardIndex.load(moved).num_samples == train.num_samples, "urls are stored relative to the index"


def write_tar(path: str, members: list[tuple[str, bytes | None]], fmt=tarfile.PAX_FORMAT, mode: str = "w") -> str:
    """A tar written by Python's tarfile in `fmt`; a None payload is a directory."""
    with tarfile.open(path, mode, format=fmt) as archive:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            if payload is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
    return path


def webdataset_samples(url: str) -> list[dict]:
    """The reference: webdataset's own tar reading and grouping."""
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    with open(url, "rb") as stream:
        return [dict(s) for s in group_by_keys({**m, "__url__": url} for m in tar_file_iterator(stream))]


# Long names (GNU long-name members, ustar's prefix field, pax paths), non-ASCII names, multi-block
# and empty payloads, directories, webdataset's __meta__ members and names without an extension.
DEEP = "d" * 60 + "/" + "e" * 60
MEMBERS = [
    ("__meta__", b"skipped"),
    ("dir", None),
    (f"{DEEP}/a.JPG", jpeg_bytes(1, 40)),
    (f"{DEEP}/a.cls", b"3"),
    ("noext", b"x"),
    ("b.jpg", b""),
    ("b.json", b'{"k": 1}'),
    ("ümlaut/c.tar.gz", bytes(range(256)) * 7),
    ("ümlaut/c.txt", b"t" * 511),
    ("d.png", b"p" * 512),
    ("d.seg.png", b"q" * 513),
]


@pytest.mark.parametrize(
    "fmt,mode",
    [(tarfile.PAX_FORMAT, "w"), (tarfile.GNU_FORMAT, "w"), (tarfile.USTAR_FORMAT, "w"), (tarfile.PAX_FORMAT, "w:gz")],
)
def test_shards_are_read_exactly_as_webdataset_reads_them(tmp_path, fmt, mode):
    members = MEMBERS if fmt != tarfile.USTAR_FORMAT else [(n.replace("ü", "u"), p) for n, p in MEMBERS]
    url = write_tar(str(tmp_path / "s.tar"), members, fmt, mode)
    ours = [sample for _, sample in read_shard(url)]
    assert ours == webdataset_samples(url)
    assert [s["__key__"] for s in ours][:2] == [f"{DEEP}/a", "b"] and ours[0]["jpg"] == jpeg_bytes(1, 40)


@pytest.mark.parametrize("scheme", ["file", "pipe"])
def test_unwanted_samples_are_skipped_unread_and_still_counted(tmp_path, scheme):
    path = write_tarwriter_shard(str(tmp_path / "a.tar"), 9)
    url = path if scheme == "file" else f"pipe:cat {path}"
    everything = dict(read_shard(url))
    asked = []

    def wanted(position):
        asked.append(position)
        return position % 3 == 1

    got = list(read_shard(url, wanted))
    assert asked == list(range(9)), "asked once per sample, in order"
    assert [p for p, _ in got] == list(range(9))
    assert {p: s for p, s in got if s is not None} == {p: everything[p] for p in (1, 4, 7)}
    assert all(s is None for p, s in got if p % 3 != 1)


@pytest.mark.parametrize("skip_last", [False, True])
@pytest.mark.parametrize("damage", ["checksum", "inside_member", "inside_header"])
def test_damaged_headers_and_members_name_the_shard(tmp_path, damage, skip_last):
    path = write_tarwriter_shard(str(tmp_path / "a.tar"), 4)
    data = bytearray(open(path, "rb").read())
    if damage == "checksum":
        data[1024 + 3] ^= 0xFF  # inside a later member's header
    elif damage == "inside_member":
        with tarfile.open(path) as archive:
            last_image = [m for m in archive.getmembers() if m.name.endswith(".jpg")][-1]
        data = data[: last_image.offset_data + last_image.size // 2]
    else:
        data = data[: 512 * 9 + 100]
    open(path, "wb").write(bytes(data))
    with pytest.raises(BadInputError, match=r"a\.tar: corrupt or truncated tar"):
        list(read_shard(path, lambda position: position != (3 if skip_last else 1)))


def test_archives_that_end_early_or_hold_what_shards_cannot_are_errors(tmp_path):
    # Cut right after a member's pax header: its sample would arrive without that field.
    path = write_tarwriter_shard(str(tmp_path / "cut.tar"), 2)
    with tarfile.open(path) as archive:
        last = archive.getmembers()[-1]
    data = open(path, "rb").read()
    assert last.offset_data - 512 > last.offset, "TarWriter gave the member a pax header"
    open(path, "wb").write(data[: last.offset_data - 512])  # cut between the pax header and its member
    with pytest.raises(BadInputError, match="ends after an extended header"):
        list(read_shard(path))
    # Cut at a header boundary inside the last sample (before its second member): no header is
    # broken, but the end-of-archive blocks are missing, so the sample is not handed out partial.
    open(path, "wb").write(data[: last.offset])
    with pytest.raises(BadInputError, match="without its end-of-archive blocks"):
        list(read_shard(path))
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    with pytest.raises(BadInputError, match="empty file"):
        list(read_shard(str(empty)))
    sparse = tmp_path / "sparse.tar"
    header = bytearray(tarfile.TarInfo("a.jpg").tobuf(tarfile.USTAR_FORMAT))
    header[156:157] = b"S"
    header[148:156] = b"%06o\0 " % (sum(header[:148]) + sum(header[156:]) + 8 * 32)
    sparse.write_bytes(bytes(header) + bytes(1024))
    with pytest.raises(BadInputError, match="sparse"):
        list(read_shard(str(sparse)))


def test_pax_records_that_name_or_size_a_member_are_read_and_sparse_ones_refused(tmp_path):
    # The header walk parses a pax header only when it holds path=, size= or GNU.sparse: a member
    # renamed by pax, or sized only there, must still read as webdataset reads it.
    url = str(tmp_path / "pax.tar")
    with tarfile.open(url, "w", format=tarfile.PAX_FORMAT) as archive:
        for name, payload, records in [
            ("s1.jpg", b"j" * 700, {"comment": "no size= nor path= here"}),
            ("ignored.txt", b"t" * 30, {"path": "s1.txt"}),
            ("s2.jpg", b"k" * 1500, {"size": "1500"}),
        ]:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(payload), records
            archive.addfile(info, io.BytesIO(payload))
    with tarfile.open(url) as archive:
        last = archive.getmembers()[-1].offset_data - 512  # s2.jpg's own header, after its pax header
    data = bytearray(open(url, "rb").read())
    data[last + 124 : last + 136] = b"00000000000\0"  # its ustar size field now says 0: pax alone sizes it
    data[last + 148 : last + 156] = b"        "
    data[last + 148 : last + 156] = b"%06o\0 " % sum(data[last : last + 512])
    open(url, "wb").write(bytes(data))
    ours = [sample for _, sample in read_shard(url)]
    assert ours == webdataset_samples(url)
    assert [s["__key__"] for s in ours] == ["s1", "s2"]
    assert ours[0]["txt"] == b"t" * 30 and ours[1]["jpg"] == b"k" * 1500
    assert count_samples(url) == (2, ["jpg", "txt"])

    sparse = str(tmp_path / "pax_sparse.tar")
    with tarfile.open(sparse, "w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("a.jpg")
        info.size, info.pax_headers = 3, {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
        archive.addfile(info, io.BytesIO(b"abc"))
    for read in (lambda: list(read_shard(sparse)), lambda: count_samples(sparse)):
        with pytest.raises(BadInputError, match="sparse"):
            read()


def test_a_size_on_a_link_or_directory_header_is_ignored_as_tarfile_does(tmp_path):
    path = str(tmp_path / "links.tar")
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        for name, kind in (
            ("a.jpg", tarfile.REGTYPE),
            ("dir", tarfile.DIRTYPE),
            ("b.lnk", tarfile.SYMTYPE),
            ("b.jpg", tarfile.REGTYPE),
            ("b.cls", tarfile.REGTYPE),
        ):
            info = tarfile.TarInfo(name)
            info.type = kind
            payload = name.encode() * 3 if kind == tarfile.REGTYPE else b""
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    data = bytearray(open(path, "rb").read())
    for offset in range(0, len(data), 512):  # give the directory and link headers a size
        block = data[offset : offset + 512]
        if block[156:157] in (b"5", b"2"):
            block[124:136] = b"%011o\0" % 700
            block[148:156] = b"%06o\0 " % (sum(block[:148]) + sum(block[156:]) + 8 * 32)
            data[offset : offset + 512] = block
    open(path, "wb").write(bytes(data))
    assert [sample for _, sample in read_shard(path)] == webdataset_samples(path)
    assert [sorted(k for k in s if not k.startswith("__")) for _, s in read_shard(path)] == [["jpg"], ["cls", "jpg"]]


def test_redundant_shards_hold_the_stated_fraction_of_near_duplicates_and_a_clean_val(tmp_path):
    from prunepipe.pipelines.data.splits import read_split
    from prunepipe.tools.commands.shards import write_shards

    paths = write_shards(
        "redundant",
        str(tmp_path),
        size=16,
        shard_size=200,
        crops_per_photo=20,
        redundant_fraction=0.5,
        redundant_originals=8,
    )
    assert set(paths) == {"train", "val", "val_mix", "train_dedup"}
    train, val, mix = (ShardIndex.load(str(tmp_path / split)) for split in ("train", "val", "val_mix"))
    assert train.meta["redundant_fraction"] == 0.5 and train.meta["redundant_originals"] == 8
    keys = {
        split: [s["__key__"] for url in ShardIndex.load(str(tmp_path / split)).urls for _, s in read_shard(url)]
        for split in ("train", "val", "val_mix", "train_dedup")
    }
    duplicates = [k for k in keys["train"] if "_dup" in k]
    kept = [k for k in keys["train_dedup"] if "_dup" in k]  # the oracle keeps 2 in 5 copies, every unique crop
    assert set(keys["train_dedup"]) - set(kept) == {k for k in keys["train"] if "_dup" not in k}
    assert set(kept) < set(duplicates) and abs(len(kept) / len(duplicates) - 0.4) < 0.01
    assert abs(len(duplicates) / len(keys["train"]) - 0.5) < 0.01  # the stated fraction
    originals = {k.split("_dup")[0] for k in duplicates}
    assert len(originals) == 8 and originals <= set(keys["train"])  # copies of 8 train crops, which stay in train
    assert not any("dup" in k for k in keys["val"])  # clean: no duplicates at all
    assert not set(keys["val"]) & set(keys["train"])  # and held out
    assert {k.split("_heldoutdup")[0] for k in keys["val_mix"] if "dup" in k} <= originals  # the train mix
    assert abs(mix.num_samples - 2 * val.num_samples) <= 1

    # a near-duplicate is near its original, and unlike another crop
    images = {
        b.ids[i].item(): b.images[i]
        for b in read_split(str(tmp_path / "train"), resolution=16, channels=3, batch_size=500)
        for i in range(len(b.ids))
    }
    ids = {k: i for i, k in enumerate(keys["train"])}
    first = duplicates[0]
    original = ids[first.split("_dup")[0]]
    other = next(ids[k] for k in keys["train"] if "_dup" not in k and k != first.split("_dup")[0])
    near = (images[ids[first]] - images[original]).abs().mean()
    assert near < 0.5 * (images[other] - images[original]).abs().mean()


# ---------------------------------------------------------------------------- writing an image folder
def make_image_folder(root, classes: int = 6, per_class: int = 20) -> dict[str, int]:
    """Class subfolders of small real PNGs (each image distinct); returns file name -> class."""
    made = {}
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = np.random.default_rng(c * 1000 + i).integers(0, 256, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{i:03d}.png")
            made[f"class_{c}/{i:03d}.png"] = c
    return made


def written_samples(out) -> dict[str, list[tuple[str, int]]]:
    """(key, class) of every sample of each split, in id order."""
    return {
        split: [
            (s["__key__"], int(s["cls"])) for url in ShardIndex.load(str(out / split)).urls for _, s in read_shard(url)
        ]
        for split in ("train", "val")
    }


def test_folder_is_written_in_a_seeded_global_shuffle_with_every_image_once(tmp_path):
    from prunepipe.tools.commands.shards import write_shards
    from prunepipe.tools.commands.sources import folder_key, list_image_folder

    made = make_image_folder(tmp_path / "images")
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        write_shards(
            "folder",
            str(tmp_path / name),
            folder=str(tmp_path / "images"),
            size=8,
            shard_size=25,
            val_fraction=0.25,
            seed=seed,
            workers=0,
            chunk=7,
        )
        runs[name] = written_samples(tmp_path / name)
    a = runs["a"]
    keys = [k for split in ("train", "val") for k, _ in a[split]]
    assert sorted(keys) == sorted(folder_key(i) for i in range(len(made))), "every image exactly once"
    assert len(a["val"]) == 30
    paths, labels = list_image_folder(str(tmp_path / "images"))
    assert [made[os.path.relpath(p, tmp_path / "images")] for p in paths] == labels.tolist()
    label_of = {folder_key(i): int(label) for i, label in enumerate(labels)}
    assert all(label_of[k] == c for split in a.values() for k, c in split), "each key keeps its image's class"
    first_shard = [c for _, c in a["train"][:25]]
    assert len(set(first_shard)) >= 5, f"classes interleave within a shard, not one class after another: {first_shard}"
    assert runs["b"] == a, "the same seed writes the same order"
    assert runs["c"]["train"] != a["train"] and set(runs["c"]["val"]) != set(a["val"]), "another seed, another order"


def test_folder_writing_holds_one_chunk_of_decoded_images(tmp_path, monkeypatch):
    """What write_folder holds at once: at any time at most `chunk` images are decoded and not yet
    handed to the shard writer (with every image in memory, all 120 would be)."""
    import prunepipe.tools.commands.shards
    from prunepipe.tools.commands.shards import write_shards

    make_image_folder(tmp_path / "images")
    decoded, handed, waiting = [0], [0], []
    load_image, shard_sample = prunepipe.tools.commands.shards.load_image, prunepipe.tools.commands.shards.shard_sample

    def counting_load(path, size):
        decoded[0] += 1
        waiting.append(decoded[0] - handed[0])
        return load_image(path, size)

    def counting_sample(key, png, label):
        handed[0] += 1
        return shard_sample(key, png, label)

    monkeypatch.setattr(prunepipe.tools.commands.shards, "load_image", counting_load)
    monkeypatch.setattr(prunepipe.tools.commands.shards, "shard_sample", counting_sample)
    write_shards(
        "folder",
        str(tmp_path / "out"),
        folder=str(tmp_path / "images"),
        size=8,
        shard_size=50,
        val_fraction=0.1,
        workers=0,
        chunk=16,
        square=True,
    )
    assert decoded[0] == handed[0] == 120
    assert max(waiting) == 16, "decoded but not yet written: one chunk at most"


def test_folder_writing_in_worker_processes_writes_the_same_shards(tmp_path):
    from prunepipe.tools.commands.shards import write_shards

    make_image_folder(tmp_path / "images", classes=3, per_class=10)
    for name, workers in (("one", 0), ("two", 2)):
        write_shards(
            "folder",
            str(tmp_path / name),
            folder=str(tmp_path / "images"),
            size=8,
            shard_size=8,
            val_fraction=0.2,
            seed=1,
            workers=workers,
            chunk=5,
            square=True,
        )
    one, two = (written_samples(tmp_path / name) for name in ("one", "two"))
    assert one == two
    for split in ("train", "val"):
        for url_one, url_two in zip(
            ShardIndex.load(str(tmp_path / "one" / split)).urls, ShardIndex.load(str(tmp_path / "two" / split)).urls
        ):
            assert [s["png"] for _, s in read_shard(url_one)] == [s["png"] for _, s in read_shard(url_two)]


def test_a_folder_is_written_as_its_files_bytes_unless_a_square_is_asked_for(tmp_path):
    """img2dataset's way: a JPEG stays the same JPEG (every byte, the whole photograph), a PNG the
    same PNG, each under its format's field; --square decodes and centre-crops to PNG at --resolution."""
    from prunepipe.tools.commands.shards import write_shards
    from prunepipe.tools.commands.sources import bundled_photos

    folder = tmp_path / "images" / "class_0"
    folder.mkdir(parents=True)
    originals = {}
    for i, (_, name, photo) in enumerate(list(bundled_photos())[:3]):
        path = folder / f"{i}_{name}.jpg"
        photo.crop((0, 0, 200, 150)).save(path, format="JPEG", quality=90)
        originals[path.read_bytes()] = (200, 150)
    (folder / "grey.png").write_bytes(png_bytes(Image.new("L", (40, 30), 128)))
    originals[(folder / "grey.png").read_bytes()] = (40, 30)
    (folder / "named_png_but_jpeg.png").write_bytes(next(iter(originals)))  # the header decides the field

    write_shards("folder", str(tmp_path / "kept"), folder=str(tmp_path / "images"), val_fraction=0.0, size=32)
    index = ShardIndex.load(str(tmp_path / "kept" / "train"))
    samples = [s for url in index.urls for _, s in read_shard(url)]
    assert index.meta["keys"] == ["cls", "jpg", "png"] and "size" not in index.meta
    fields = sorted(next(k for k in s if k in ("jpg", "png")) for s in samples)
    assert fields == ["jpg"] * 4 + ["png"]
    for s in samples:
        data = s.get("jpg", s.get("png"))
        assert data in originals, "the file's bytes, unchanged"
        assert Image.open(io.BytesIO(data)).size == originals[data], "the whole image, uncropped"

    write_shards(
        "folder", str(tmp_path / "square"), folder=str(tmp_path / "images"), val_fraction=0.0, size=32, square=True
    )
    index = ShardIndex.load(str(tmp_path / "square" / "train"))
    assert index.meta["size"] == 32 and sorted(index.meta["keys"]) == ["cls", "png"]
    for url in index.urls:
        for _, s in read_shard(url):
            assert Image.open(io.BytesIO(s["png"])).size == (32, 32)


def test_class_folders_linked_in_are_followed_once_and_a_link_loop_ends(tmp_path):
    from prunepipe.tools.commands.shards import write_shards
    from prunepipe.tools.commands.sources import list_image_folder

    made = make_image_folder(tmp_path / "storage", classes=3, per_class=4)
    (tmp_path / "images").mkdir()
    for c in range(3):  # the cluster's way: class folders linked in from shared storage
        os.symlink(tmp_path / "storage" / f"class_{c}", tmp_path / "images" / f"class_{c}")
    os.symlink(tmp_path / "images", tmp_path / "storage" / "class_0" / "back_up")  # a link back up the tree
    paths, labels = list_image_folder(str(tmp_path / "images"))
    assert (
        [made[os.path.relpath(p, tmp_path / "images")] for p in paths] == labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    )
    write_shards("folder", str(tmp_path / "out"), folder=str(tmp_path / "images"), size=8, val_fraction=0.25, workers=0)
    assert sum(len(split) for split in written_samples(tmp_path / "out").values()) == 12


def test_an_unreadable_folder_image_names_the_file(tmp_path):
    from prunepipe.tools.commands.shards import write_shards

    make_image_folder(tmp_path / "images", classes=2, per_class=3)
    (tmp_path / "images" / "class_1" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"class_1/broken\.png: not a readable image"):
        write_shards("folder", str(tmp_path / "out"), folder=str(tmp_path / "images"), size=8, workers=0)


def test_shards_write_and_latents_encode_take_resolution(tmp_path):
    from prunepipe.launch.cli import build_parser

    args = build_parser().parse_args(["shards", "write", "--out", str(tmp_path), "--resolution", "24"])
    assert args.resolution == 24
    encode = build_parser().parse_args(
        ["latents", "encode", "shards", "--vae", "v", "--out", "o", "--resolution", "24"]
    )
    assert encode.resolution == 24


# ---------------------------------------------------------------------------- indexing from headers
def full_read_index(urls: list[str]) -> list[tuple[int, list[str]]]:
    """The reference for indexing from headers: every sample read whole."""
    counted = []
    for url in urls:
        samples = [s for _, s in read_shard(url)]
        counted.append((len(samples), sorted({k for s in samples for k in s if not k.startswith("__")})))
    return counted


@pytest.mark.parametrize(
    "fmt,mode",
    [(tarfile.PAX_FORMAT, "w"), (tarfile.GNU_FORMAT, "w"), (tarfile.USTAR_FORMAT, "w"), (tarfile.PAX_FORMAT, "w:gz")],
)
def test_header_only_count_equals_a_full_read(tmp_path, fmt, mode):
    from prunepipe.pipelines.data.shards import count_samples

    members = MEMBERS if fmt != tarfile.USTAR_FORMAT else [(n.replace("ü", "u"), p) for n, p in MEMBERS]
    urls = [write_tar(str(tmp_path / "s.tar"), members, fmt, mode), write_tarwriter_shard(str(tmp_path / "w.tar"), 7)]
    assert [count_samples(url) for url in urls] == full_read_index(urls)
    index = ShardIndex.load(index_shards(urls, str(tmp_path), workers=2))
    assert index.counts.tolist() == [n for n, _ in full_read_index(urls)]
    assert index.meta["keys"] == sorted({f for _, fields in full_read_index(urls) for f in fields})


@pytest.mark.parametrize("damage", ["truncated", "duplicate_field"])
def test_header_only_count_refuses_what_a_full_read_refuses(tmp_path, damage):
    from prunepipe.pipelines.data.shards import count_samples

    path = str(tmp_path / "bad.tar")
    if damage == "truncated":
        write_tarwriter_shard(path, 10)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    else:
        write_tar(path, [("a.jpg", b"1"), ("a.cls", b"2"), ("b.jpg", b"3"), ("b.JPG", b"4")])
    with pytest.raises(BadInputError, match="corrupt or truncated tar") as full:
        full_read_index([path])
    with pytest.raises(BadInputError, match="corrupt or truncated tar") as headers:
        count_samples(path)
    assert path in str(full.value) and path in str(headers.value)
    with pytest.raises(BadInputError, match=re.escape(path)):
        index_shards([write_tarwriter_shard(str(tmp_path / "good.tar"), 3), path], str(tmp_path / "idx"), workers=2)


def test_index_of_a_pipe_url_streams_the_shard(tmp_path):
    shard = write_tarwriter_shard(str(tmp_path / "a.tar"), 6)
    index = ShardIndex.load(index_shards([f"pipe:cat {shard}"], str(tmp_path / "idx")))
    assert index.urls == (f"pipe:cat {shard}",) and index.counts.tolist() == [6]


def write_img2dataset_shard(folder, shard_id: int, n: int, successes: int | None = None) -> str:
    """A shard as img2dataset writes one: NNNNN.tar of jpg/txt/json samples through webdataset's
    TarWriter, and NNNNN_stats.json beside it (img2dataset/logger.py:write_stats)."""
    tar = folder / f"{shard_id:05d}.tar"
    with wds.TarWriter(str(tar)) as sink:
        for i in range(n):
            key = f"{shard_id:05d}{i:04d}"
            sink.write(
                {
                    "__key__": key,
                    "jpg": jpeg_bytes(i),
                    "txt": f"caption {i}",
                    "json": json.dumps({"key": key, "status": "success", "width": 16}),
                }
            )
    stats = {
        "count": n + 3,
        "successes": n if successes is None else successes,
        "failed_to_download": 2,
        "failed_to_resize": 1,
        "duration": 1.5,
        "start_time": 1700000000.0,
        "end_time": 1700000001.5,
        "status_dict": {"success": n, "failed to download": 2, "failed to resize": 1},
    }
    (folder / f"{shard_id:05d}_stats.json").write_text(json.dumps(stats, indent=4))
    return str(tar)


def test_img2dataset_stats_give_the_counts_and_verify_checks_them(tmp_path):
    shards = tmp_path / "laion"
    shards.mkdir()
    for shard_id, n in enumerate((5, 4, 6)):
        write_img2dataset_shard(shards, shard_id, n)
    write_tarwriter_shard(str(shards / "00003.tar"), 3)  # no stats beside it: its headers are read
    index = ShardIndex.load(index_shards([str(shards)], str(shards), workers=2))
    assert index.counts.tolist() == [5, 4, 6, 3]
    # the first shard's count is its headers' (checked against its stats), the last has no stats
    assert index.meta["counted"] == {
        "shards": 4,
        "img2dataset_stats": 2,
        "tar_headers_read": 2,
        "checked_against_stats": 1,
    }
    assert index.meta["keys"] == ["cls", "jpg", "json", "txt"]

    # A stats file that disagrees is believed without --verify (only the first shard is checked) ...
    (shards / "00002_stats.json").write_text(json.dumps({"count": 9, "successes": 2}))
    assert ShardIndex.load(index_shards([str(shards)], str(shards))).counts.tolist() == [5, 4, 2, 3]
    # ... and caught with it, naming the shard and the stats file.
    with pytest.raises(BadInputError, match=r"00002\.tar: its tar headers hold 6 samples, but .*00002_stats\.json"):
        index_shards([str(shards)], str(shards), verify=True)
    # img2dataset records no tar size: a tar cut short is told by its end, which lacks the two zero blocks
    whole = (shards / "00001.tar").read_bytes()
    (shards / "00001.tar").write_bytes(whole[: len(whole) // 1024 * 512])  # half, in whole blocks
    with pytest.raises(BadInputError, match=r"00001\.tar"):
        index_shards([str(shards)], str(shards))
    (shards / "00001.tar").write_bytes(whole)
    (shards / "00002_stats.json").write_text(json.dumps({"count": 9}))
    with pytest.raises(ValueError, match=r"00002_stats\.json: expected img2dataset's stats.*'successes'"):
        index_shards([str(shards)], str(shards))


def test_written_shards_carry_their_counts_and_are_indexed_again_without_being_opened(tmp_path, monkeypatch):
    """shards write leaves img2dataset's NNNNN_stats.json beside each tar: a copy of the folder is indexed
    again from them, reading only the first shard's headers, unless a tar's size says it changed."""
    from prunepipe.tools.commands import shards as shard_tools

    make_image_folder(tmp_path / "images")
    shard_tools.write_shards(
        "folder",
        str(tmp_path / "out"),
        folder=str(tmp_path / "images"),
        size=8,
        shard_size=25,
        val_fraction=0.25,
        seed=0,
        workers=0,
    )
    train = tmp_path / "out" / "train"
    written = ShardIndex.load(str(train))
    assert sorted(p.name for p in train.glob("*_stats.json")) == [
        os.path.basename(url)[:-4] + "_stats.json" for url in written.urls
    ]

    moved = tmp_path / "moved"
    shutil.copytree(train, moved)
    (moved / "index.json").unlink()
    opened = []
    monkeypatch.setattr(shard_tools, "survey_shard", lambda url, **kw: opened.append(url) or survey_shard(url, **kw))
    monkeypatch.setattr(shard_tools, "file_crc32", lambda path: opened.append(path) or file_crc32(path))
    again = ShardIndex.load(index_shards([str(moved)], str(moved), workers=2))
    assert again.counts.tolist() == written.counts.tolist() and again.meta["keys"] == ["cls", "png"]
    assert [os.path.basename(u) for u in opened] == [os.path.basename(written.urls[0])], "only the first is read"

    # A tar cut short in a copy, or written again since, no longer has the size its stats file records:
    # its headers are read, and name the damage or the other count.
    last = moved / os.path.basename(written.urls[-1])
    whole = last.read_bytes()
    last.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(BadInputError, match=re.escape(last.name)):
        index_shards([str(moved)], str(moved))
    write_tarwriter_shard(str(last), 2)
    with pytest.raises(BadInputError, match=re.escape(last.name) + r": its tar headers hold 2 samples"):
        index_shards([str(moved)], str(moved))


def test_cli_index_says_how_it_counted(tmp_path, capsys):
    from prunepipe.launch.cli import main

    for shard_id, n in enumerate((4, 2, 3)):
        write_img2dataset_shard(tmp_path, shard_id, n)
    assert main(["shards", "index", str(tmp_path), "--out", str(tmp_path), "--workers", "1"]) == 0
    said = capsys.readouterr().out
    # each shard counted once, by one source: the first by its headers (which name the fields)
    assert "3 shards, 9 samples" in said and "2 shard(s) counted from img2dataset's *_stats.json" in said
    assert ", 1 from their tar headers" in said and "--verify" in said
    counted = ShardIndex.load(str(tmp_path)).meta["counted"]
    assert counted["img2dataset_stats"] + counted["tar_headers_read"] == counted["shards"] == 3
    assert describe_counting(counted) == (
        "of 3 shard(s), 2 counted from img2dataset's *_stats.json (--verify reads "
        "their tar headers too), 1 from their tar headers (1 of them checked "
        "against their *_stats.json)"
    )

    assert main(["shards", "index", str(tmp_path), "--out", str(tmp_path), "--workers", "1", "--verify"]) == 0
    counted = ShardIndex.load(str(tmp_path)).meta["counted"]
    assert (counted["img2dataset_stats"], counted["tar_headers_read"], counted["checked_against_stats"]) == (0, 3, 3)
    assert describe_counting(counted, verify=True) == (
        "of 3 shard(s), 3 from their tar headers (3 of them checked against their *_stats.json)"
    )
