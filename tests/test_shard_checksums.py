"""Every index records each shard's size and CRC-32, and every reader checks a shard against it: a
local shard replaced since it was indexed is refused at open, naming it and both sizes; one cut short
yields its samples before the cut, then stops naming the cut and both sizes; `prunepipe shards verify` reads every byte and finds what a size check cannot (a flipped
byte); an index without the fields (img2dataset's tools, a hand-written one) still reads."""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import zlib

import pytest
import webdataset as wds
from test_shards import read_all, write_img2dataset_shard, write_tar, write_tarwriter_shard  # tests/ is on the path

from prunepipe.pipelines.data.remote import NOTHING_EXPECTED, Expected
from prunepipe.pipelines.data.shards import BadInputError, ShardIndex, count_samples, read_keys, read_shard
from prunepipe.tools.commands.shards import index_shards


def entries(folder: str) -> list[dict]:
    """index.json's shard entries as written."""
    with open(os.path.join(folder, "index.json")) as f:
        return json.load(f)["shards"]


def file_of(url: str) -> str:
    return url.rsplit(" ", 1)[-1] if url.startswith("pipe:cat ") else url


def assert_records_its_files(folder: str) -> None:
    """Each entry's bytes and crc32 are the file's, computed here from the whole file."""
    index = ShardIndex.load(folder)
    for shard, (entry, url) in enumerate(zip(entries(folder), index.urls)):
        with open(file_of(url), "rb") as f:
            data = f.read()
        assert entry["bytes"] == len(data), url
        assert entry["crc32"] == f"{zlib.crc32(data):08x}", url
        assert index.expected(shard) == Expected(size=len(data), crc32=zlib.crc32(data))


def flip_a_byte(path: str) -> None:
    """One byte in the middle of a member's data changed: the same size, other bytes, a tar that
    still reads."""
    with tarfile.open(path) as archive:
        member = max(archive.getmembers(), key=lambda m: m.size)
    with open(path, "r+b") as f:
        f.seek(member.offset_data + member.size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def large_member_shard(path: str, samples: int = 3) -> str:
    """Members of 64 KiB: the count walks the headers (seeking past the data, or reading it in order
    for the CRC-32), not reading the file whole at once."""
    with wds.TarWriter(path) as sink:
        for i in range(samples):
            sink.write({"__key__": f"big{i:03d}", "bin": os.urandom(64 * 1024), "cls": str(i)})
    return path


def test_shards_write_records_each_shards_bytes_and_crc32(digits_shards):
    for split in ("train", "val"):
        assert_records_its_files(os.path.join(digits_shards, split))


def test_shards_index_records_bytes_and_crc32_however_it_counts(tmp_path):
    small = write_tarwriter_shard(str(tmp_path / "small.tar"), 20)  # read whole, its headers at once
    large = large_member_shard(str(tmp_path / "large.tar"))  # walked, data seeked past
    packed = write_tar(str(tmp_path / "packed.tar.gz"), [("a.jpg", b"1" * 3000), ("a.cls", b"2")], mode="w:gz")
    piped = write_tarwriter_shard(str(tmp_path / "piped.tar"), 5)
    urls = [small, large, packed, f"pipe:cat {piped}"]
    index = ShardIndex.load(index_shards(urls, str(tmp_path / "index"), workers=2))
    assert index.counts.tolist() == [20, 3, 1, 5]
    assert_records_its_files(str(tmp_path / "index"))

    # img2dataset's stats record no CRC-32: the tar is read for it, though its count comes from the stats
    laion = tmp_path / "laion"
    laion.mkdir()
    for shard_id, n in enumerate((4, 6)):
        write_img2dataset_shard(laion, shard_id, n)
    laion_index = ShardIndex.load(index_shards([str(laion)], str(laion), workers=1))
    assert laion_index.meta["counted"]["img2dataset_stats"] == 1
    assert_records_its_files(str(laion))

    # --no-checksums: the sizes alone, and readers check those
    ShardIndex.load(index_shards(urls, str(tmp_path / "sizes"), workers=2, checksums=False))
    for entry, url in zip(entries(str(tmp_path / "sizes")), urls):
        assert entry["bytes"] == os.path.getsize(file_of(url)) and "crc32" not in entry


def test_a_copied_folder_is_indexed_again_with_the_crc32s_its_stats_files_record(digits_shards, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(os.path.join(digits_shards, "train"), moved)
    (moved / "index.json").unlink()
    stats = json.loads(next(moved.glob("*_stats.json")).read_text())
    assert re.fullmatch(r"[0-9a-f]{8}", stats["tar_crc32"]), "shards write records it beside each tar"
    index_shards([str(moved)], str(moved), workers=2)
    assert_records_its_files(str(moved))
    # a stats file whose CRC-32 is not its tar's is caught where the tar is read (the first, or --verify)
    first = sorted(moved.glob("*_stats.json"))[0]
    first.write_text(json.dumps({**json.loads(first.read_text()), "tar_crc32": "00000000"}))
    with pytest.raises(BadInputError, match=r"shard-000000\.tar: its bytes have CRC-32 [0-9a-f]{8}, but .*00000000"):
        index_shards([str(moved)], str(moved), workers=2)


@pytest.mark.parametrize("change", ["cut short", "replaced"])
def test_a_local_shard_changed_since_indexing_is_refused_or_read_to_its_cut_naming_both_sizes(tmp_path, change):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_tarwriter_shard(str(folder / "a.tar"), 6)
    changed = write_tarwriter_shard(str(folder / "b.tar"), 6, start=6)
    index = ShardIndex.load(index_shards([str(folder)], str(folder), workers=1))
    indexed = os.path.getsize(changed)
    if change == "cut short":
        with open(changed, "r+b") as f:
            f.truncate(indexed // 2)
    else:
        write_tarwriter_shard(changed, 9, start=100)  # another shard under the same name
    now = os.path.getsize(changed)
    assert now != indexed
    sizes = re.escape(f"the file is {now} bytes but its index records {indexed}")
    if change == "cut short":  # read to the cut: the samples before it are the indexed ones
        sizes = ".*" + re.escape(f"the file cut short at {now} of the {indexed} bytes its index records")
        before = []
        with pytest.raises(BadInputError, match=re.escape(f"shard {changed}: ") + sizes):
            for _, sample in read_shard(changed, expected=index.expected(1)):
                before.append(sample["__key__"])
        assert 0 < len(before) < 6 and before == [f"s{i:05d}" for i in range(6, 6 + len(before))]
    for read in (
        lambda: list(read_shard(changed, expected=index.expected(1))),
        lambda: count_samples(changed, expected=index.expected(1)),
        lambda: read_keys(changed, expected=index.expected(1)),
    ):
        with pytest.raises(BadInputError, match=re.escape(f"shard {changed}: ") + sizes):
            read()
    with pytest.raises(BadInputError, match=re.escape(changed) + ".*" + sizes):
        read_all(index, "stop")  # the training stream passes what the index knows
    # the untouched shard reads as before, and so does any shard read without what its index knows
    assert len(list(read_shard(index.urls[0], expected=index.expected(0)))) == 6
    if change == "replaced":
        assert len(list(read_shard(changed))) == 9


def test_shards_verify_finds_a_flipped_byte_and_names_the_shard(digits_shards, tmp_path, capsys):
    from prunepipe.launch.cli import main

    folder = tmp_path / "train"
    shutil.copytree(os.path.join(digits_shards, "train"), folder)
    assert main(["shards", "verify", str(folder), "--workers", "2"]) == 0
    said = capsys.readouterr().out
    assert "11 shard(s), 0 bad; 11 checked by size and CRC-32" in said

    flipped = folder / "shard-000003.tar"
    flip_a_byte(str(flipped))
    cut = folder / "shard-000007.tar"
    whole = cut.read_bytes()
    cut.write_bytes(whole[:-512])
    # the training reader checks a local shard's size only: the flipped shard still opens
    index = ShardIndex.load(str(folder))
    list(read_shard(str(flipped), lambda _: False, expected=index.expected(3)))

    assert main(["shards", "verify", str(folder), "--workers", "2"]) == 1
    lines = capsys.readouterr().out.splitlines()
    bad = [line for line in lines if line.startswith("shard ")]
    assert len(bad) == 2
    assert re.fullmatch(
        re.escape(f"shard {flipped}: has CRC-32 ")
        + r"[0-9a-f]{8}, .*index\.json records [0-9a-f]{8} \(its bytes changed\)",
        bad[0],
    )
    assert f"shard {cut}: is {len(whole) - 512} bytes" in bad[1] and f"records {len(whole)}" in bad[1]
    assert "11 shard(s), 2 bad" in lines[-1]


def test_shards_verify_reads_a_pipe_shard_through_its_stream(tmp_path, capsys):
    from prunepipe.launch.cli import main

    shard = write_tarwriter_shard(str(tmp_path / "a.tar"), 6)
    index_shards([f"pipe:cat {shard}"], str(tmp_path / "index"))
    assert main(["shards", "verify", str(tmp_path / "index"), "--read-retries", "0"]) == 0
    flip_a_byte(shard)
    assert main(["shards", "verify", str(tmp_path / "index"), "--read-retries", "0"]) == 1
    said = capsys.readouterr().out
    assert f"shard pipe:cat {shard}: " in said and "(its bytes changed)" in said


def test_an_index_without_sizes_or_checksums_still_reads(tmp_path, capsys):
    from prunepipe.launch.cli import main

    write_tarwriter_shard(str(tmp_path / "a.tar"), 6)
    (tmp_path / "index.json").write_text(json.dumps({"shards": [{"url": "a.tar", "num_samples": 6}]}))
    index = ShardIndex.load(str(tmp_path))
    assert index.expected(0) == NOTHING_EXPECTED
    assert index.sizes.tolist() == index.crcs.tolist() == [-1]
    assert len(read_all(index, "stop")) == 6
    assert main(["shards", "verify", str(tmp_path)]) == 0
    assert "1 not checked (index.json records neither size nor CRC-32" in capsys.readouterr().out
    # an entry without them is written without them
    ShardIndex.write(str(tmp_path), [(str(tmp_path / "a.tar"), 6)])
    assert entries(str(tmp_path)) == [{"url": "a.tar", "num_samples": 6}]


@pytest.mark.parametrize(
    "field,value",
    [("bytes", "20480"), ("bytes", -1), ("bytes", True), ("bytes", 1.5), ("crc32", "1234567"), ("crc32", 305419896)],
)
def test_an_index_with_a_malformed_size_or_checksum_names_the_file_and_the_shard(tmp_path, field, value):
    path = tmp_path / "index.json"
    path.write_text(json.dumps({"shards": [{"url": "a.tar", "num_samples": 6, field: value}]}))
    with pytest.raises(ValueError, match=re.escape(f"{path}: shard a.tar: '{field}' must be")):
        ShardIndex.load(str(tmp_path))


def test_latents_encode_index_records_each_output_shards_bytes_and_crc32(digits_shards, tmp_path):
    from eval_runs import tiny_vae

    from prunepipe.tools.commands.latents import encode_shards

    vae = str(tmp_path / "vae")
    tiny_vae(3, 32).save_pretrained(vae)
    out = str(tmp_path / "latents")
    encode_shards(os.path.join(digits_shards, "val"), vae, out, resolution=32, batch_size=64, device="cpu")
    assert len(entries(out)) == 2
    assert_records_its_files(out)
    for entry in entries(out):  # the seals carry them too: `shards index` of the folder takes them from there
        with open(os.path.join(out, entry["url"][: -len(".tar")] + "_stats.json")) as f:
            seal = json.load(f)
        assert (seal["tar_bytes"], seal["tar_crc32"]) == (entry["bytes"], entry["crc32"])


def test_index_write_takes_sizes_and_checksums_per_entry_and_refuses_others(tmp_path):
    path = write_tarwriter_shard(str(tmp_path / "a.tar"), 2)
    data = open(path, "rb").read()
    ShardIndex.write(str(tmp_path), [(path, 2, len(data), zlib.crc32(data))])
    assert entries(str(tmp_path)) == [
        {"url": "a.tar", "num_samples": 2, "bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    ]
    with pytest.raises(ValueError, match=r"shard .*a\.tar: its CRC-32 must be an integer in \[0, 2\*\*32\)"):
        ShardIndex.write(str(tmp_path), [(path, 2, len(data), "0a1b2c3d")])
    with pytest.raises(ValueError, match=r"shard .*a\.tar: its size must be a non-negative integer"):
        ShardIndex.write(str(tmp_path), [(path, 2, -5, None)])


def test_a_compressed_local_shard_is_checked_by_its_size_too(tmp_path):
    packed = write_tar(str(tmp_path / "p.tar.gz"), [("a.jpg", b"1" * 3000), ("a.cls", b"2")], mode="w:gz")
    index = ShardIndex.load(index_shards([packed], str(tmp_path), workers=1))
    with tarfile.open(packed, "w:gz") as archive:  # written again, other bytes
        info = tarfile.TarInfo("b.jpg")
        info.size = 0
        archive.addfile(info)
    with pytest.raises(BadInputError, match=re.escape(packed) + ".*its index records"):
        list(read_shard(packed, expected=index.expected(0)))
