"""Counting a plain local shard from all its headers at once (`count_plain_archive`) gives exactly
what the header walk gives, or declines and leaves the shard to the walk: the same count and fields
for every writer's tars, the walk's own error for damaged ones, and never a count from a shard the
array check does not cover."""

from __future__ import annotations

import io
import random
import tarfile

import pytest
from test_shards import jpeg_bytes, write_tar, write_tarwriter_shard  # pytest puts tests/ on the path

import prunepipe.pipelines.data.shards as shards
import prunepipe.pipelines.data.tar_reader as tar_reader
from prunepipe.pipelines.data.shards import BadInputError, count_plain_archive, count_samples, read_shard


def at_once(path: str):
    """The count from all headers at once, or None where it declines."""
    with open(path, "rb") as stream:
        return count_plain_archive(stream)


def outcome(path: str):
    """What `count_samples` answers: (count, fields), or the error it raises."""
    try:
        return count_samples(path)
    except BadInputError as error:
        return f"BadInputError: {error}"


def walked(path: str, monkeypatch):
    """What `count_samples` answers by the header walk alone."""
    with monkeypatch.context() as patch:
        patch.setattr(shards, "count_plain_archive", lambda stream, seen=None: None)
        return outcome(path)


def read_whole(path: str):
    """The count and fields of every sample read whole (`read_shard`)."""
    samples = [sample for _, sample in read_shard(path)]
    return len(samples), sorted({key for sample in samples for key in sample if not key.startswith("__")})


def ordinary(n: int = 12, prefix: str = "n") -> list[tuple[str, bytes]]:
    """Small members of `n` two-field samples: enough headers that the shard is read whole."""
    return [
        member
        for i in range(n)
        for member in ((f"{prefix}{i:03d}.jpg", b"j" * (40 + i)), (f"{prefix}{i:03d}.cls", str(i % 3).encode()))
    ]


def with_pax_records(path: str, members: list[tuple[str, bytes, dict]]) -> str:
    """A PAX-format tar whose members carry the given pax records."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for name, payload, records in members:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(payload), records
            archive.addfile(info, io.BytesIO(payload))
    return path


# ---------------------------------------------------------------------------- what writers write
MIXED = [
    (f"train/a/k{i:03d}.{field}", payload)
    for i in range(10)
    for field, payload in (
        ("jpg", jpeg_bytes(i)),
        ("seg.png", b"s" * 512),
        ("JSON", b'{"i": %d}' % i),
        ("txt", b""),
        ("bin", b"b" * 513),
        ("annotation.json", b"{}"),
    )
]


@pytest.mark.parametrize("writer", ["tarwriter", "ustar", "gnu", "pax"])
def test_writers_shards_are_counted_at_once_as_the_walk_counts_them(tmp_path, monkeypatch, writer):
    path = str(tmp_path / "s.tar")
    if writer == "tarwriter":  # a pax header with a float mtime before every member
        write_tarwriter_shard(path, 40)
    else:
        write_tar(
            path, MIXED, {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}[writer]
        )
    counted = at_once(path)
    assert counted is not None, "a plain shard of small members is counted at once"
    assert counted == walked(path, monkeypatch) == read_whole(path) == count_samples(path)
    if writer != "tarwriter":
        assert counted == (10, ["annotation.json", "bin", "jpg", "json", "seg.png", "txt"])


def test_a_shard_of_large_members_is_walked_so_that_their_data_is_seeked_past(tmp_path, monkeypatch):
    path = write_tar(str(tmp_path / "large.tar"), [(f"k{i}.jpg", b"j" * 100_000) for i in range(6)])
    assert at_once(path) is None
    assert count_samples(path) == walked(path, monkeypatch) == (6, ["jpg"])


@pytest.mark.parametrize("chunk_kib", [8, 32])
def test_a_shard_larger_than_a_chunk_is_counted_across_chunks(tmp_path, monkeypatch, chunk_kib):
    # 60 samples of 7 blocks: some pax header's records start the next chunk
    path = write_tarwriter_shard(str(tmp_path / "s.tar"), 60)
    whole = at_once(path)
    monkeypatch.setattr(tar_reader, "CHUNK", chunk_kib * 1024)
    assert whole is not None and at_once(path) == whole == walked(path, monkeypatch)
    # a member larger than a chunk, and a fake header inside it
    big = write_tar(str(tmp_path / "big.tar"), ordinary(10) + [("n005.png", b"p" * 40_000)] + ordinary(10, "m"))
    assert at_once(big) == walked(big, monkeypatch) == read_whole(big) == (21, ["cls", "jpg", "png"])
    fake = write_tar(str(tmp_path / "fake.tar"), ordinary(10) + [("n005.png", bytes(20_480) + fake_header("f.jpg", 3))])
    assert at_once(fake) is None
    assert count_samples(fake) == walked(fake, monkeypatch) == read_whole(fake)


# ---------------------------------------------------------------------------- what the arrays leave to the walk
def fake_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.USTAR_FORMAT)


UNUSUAL = {
    # member data holding a valid tar header, at its first block and at a later one
    "header_inside_data": [("n005.bin", fake_header("fake.jpg", 100) + b"x" * 600)],
    "header_later_in_data": [("n005.bin", b"y" * 1024 + fake_header("fake.jpg", 0) + bytes(1024))],
    "ustar_name_prefix": [("d" * 60 + "/" + "e" * 60 + "/n005.txt", b"t")],
    "webdataset_metadata": [("__meta__", b"m"), ("n005.__key__", b"k")],
    "no_extension": [("noext", b"x"), ("dir/.hidden.txt", b"h")],
    "newline": [("n00\n5.txt", b"t")],
    "a_field_twice": [("n005.JPG", b"again")],
    "directory": [("dir", None)],
}


@pytest.mark.parametrize("case", list(UNUSUAL))
def test_members_the_arrays_do_not_cover_are_left_to_the_walk(tmp_path, monkeypatch, case):
    fmt = tarfile.USTAR_FORMAT if case == "ustar_name_prefix" else tarfile.GNU_FORMAT
    control = write_tar(str(tmp_path / "control.tar"), ordinary(12), fmt)
    assert at_once(control) is not None, "the same shard without the unusual member is counted at once"
    path = write_tar(str(tmp_path / "s.tar"), ordinary(12)[:11] + UNUSUAL[case] + ordinary(12)[11:], fmt)
    assert at_once(path) is None
    assert outcome(path) == walked(path, monkeypatch)
    if case == "a_field_twice":
        assert "duplicate file name" in outcome(path)
    elif case == "webdataset_metadata":
        assert "duplicate file name" in outcome(path), "a field named __key__ is one webdataset refuses"
    else:
        assert outcome(path) == read_whole(path)


@pytest.mark.parametrize("records", [{"path": "n003.txt"}, {"size": "40"}, {"comment": "a path=elsewhere"}])
def test_pax_records_that_may_name_or_size_a_member_are_left_to_the_walk(tmp_path, monkeypatch, records):
    members = [(name, payload, {"mtime": "1700000000.25"}) for name, payload in ordinary(12)]
    path = with_pax_records(str(tmp_path / "pax.tar"), members)
    assert at_once(path) is not None, "mtime records alone change nothing: counted at once"
    members[5] = (members[5][0], b"j" * 40, records)
    path = with_pax_records(str(tmp_path / "pax.tar"), members)
    assert at_once(path) is None
    assert count_samples(path) == walked(path, monkeypatch) == read_whole(path)
    non_ascii = with_pax_records(str(tmp_path / "name.tar"), members[:5] + [("ü005.jpg", b"u", {})] + members[6:])
    assert at_once(non_ascii) is None, "tarfile names a non-ASCII member in a pax path record"
    assert count_samples(non_ascii) == walked(non_ascii, monkeypatch) == read_whole(non_ascii)


def test_a_number_written_otherwise_is_left_to_the_walk(tmp_path, monkeypatch):
    path = write_tar(str(tmp_path / "s.tar"), ordinary(12), tarfile.GNU_FORMAT)
    with tarfile.open(path) as archive:
        at = archive.getmember("n001.jpg").offset
    data = bytearray(open(path, "rb").read())
    header = data[at : at + 512]
    assert header[124:136] == b"%011o\0" % 41
    header[124:136] = b"%11o\0" % 41  # leading spaces, as some writers pad: the walk reads it
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    data[at : at + 512] = header
    open(path, "wb").write(bytes(data))
    assert at_once(path) is None
    assert count_samples(path) == walked(path, monkeypatch) == read_whole(path) == (12, ["cls", "jpg"])


# ---------------------------------------------------------------------------- damaged shards: the walk's error
def damaged(tmp_path, damage: str) -> str:
    path = write_tarwriter_shard(str(tmp_path / "bad.tar"), 30)
    data = open(path, "rb").read()
    with tarfile.open(path) as archive:
        last = archive.getmembers()[-1]
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "no_end_blocks":  # cut at a header boundary: no header is broken
        data = data[: last.offset]
    elif damage == "after_a_pax_header":  # the last member's pax header, and nothing after
        data = data[: last.offset_data - 512]
    elif damage == "checksum":
        data = data[: 512 * 9 + 3] + bytes([data[512 * 9 + 3] ^ 0xFF]) + data[512 * 9 + 4 :]
    elif damage == "ends_inside_a_member":
        data = data[: last.offset_data + 1]
    open(path, "wb").write(data)
    return path


@pytest.mark.parametrize(
    "damage", ["truncated", "no_end_blocks", "after_a_pax_header", "checksum", "ends_inside_a_member"]
)
def test_a_damaged_shard_is_left_to_the_walk_and_raises_its_error(tmp_path, monkeypatch, damage):
    path = damaged(tmp_path, damage)
    assert at_once(path) is None
    said = outcome(path)
    assert said == walked(path, monkeypatch)
    assert said.startswith("BadInputError") and "bad.tar: corrupt or truncated tar" in said


def test_compressed_and_piped_shards_are_walked(tmp_path, monkeypatch):
    path = write_tar(str(tmp_path / "s.tar.gz"), ordinary(12), tarfile.PAX_FORMAT, "w:gz")
    assert at_once(path) is None
    assert count_samples(path) == walked(path, monkeypatch) == (12, ["cls", "jpg"])
    plain = write_tar(str(tmp_path / "s.tar"), ordinary(12))
    assert count_samples(f"pipe:cat {plain}") == count_samples(plain) == (12, ["cls", "jpg"])


# ---------------------------------------------------------------------------- random shards, random damage
def random_shard(path: str, rng: random.Random) -> str:
    """A tar in a random format with random names (now and then an odd one, a field twice, a tar
    header inside a member's data), then now and then damaged: bytes of a block changed where the
    header fields lie, cut anywhere or at a block boundary, bytes appended."""
    fmt = rng.choice([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
    with tarfile.open(path, "w", format=fmt) as archive:
        for i in range(rng.randint(4, 40)):
            key = f"k{i // 2:03d}" if rng.random() > 0.01 else rng.choice(["a/", "__", ".", "\n", "d" * 90]) + str(i)
            field = ["jpg", "cls"][i % 2] if rng.random() > 0.02 else rng.choice(["JPG", "a.b", "", "__key__"])
            payload = rng.randbytes(rng.choice([0, 3, 512, 600, 1100]))
            if rng.random() < 0.01:
                payload = fake_header("f.jpg", 3) + payload
            info = tarfile.TarInfo(f"{key}.{field}" if rng.random() > 0.01 else key)
            info.size = len(payload)
            try:
                archive.addfile(info, io.BytesIO(payload))
            except ValueError:  # a name this format cannot hold
                pass
    data = bytearray(open(path, "rb").read())
    damage = rng.random()
    if damage < 0.3:
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data) // 512) * 512 + rng.choice([0, 100, 124, 135, 148, 155, 156, 257, 345])] = (
                rng.getrandbits(8)
            )
    elif damage < 0.45:
        data = data[: rng.randrange(len(data))]
    elif damage < 0.5:
        data = data[: rng.randrange(len(data)) // 512 * 512]
    elif damage < 0.55:
        data += rng.randbytes(rng.randint(1, 2000))
    open(path, "wb").write(bytes(data))
    return path


def test_random_shards_are_counted_as_the_walk_counts_them_or_left_to_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tar_reader, "SMALL_MEMBERS", 1)  # every shard is tried at once
    rng, answered = random.Random(0), 0
    for case in range(120):
        path = random_shard(str(tmp_path / f"{case}.tar"), rng)
        counted = at_once(path)
        if counted is not None:
            answered += 1
            assert counted == walked(path, monkeypatch), f"case {case}"
    assert answered >= 20, "the check answered for many of them"


def test_an_empty_pax_header_at_a_chunks_end_is_read_across_chunks(tmp_path, monkeypatch):
    blocks = []
    for i in range(7):  # blocks 0..13
        info = tarfile.TarInfo(f"k{i:03d}.jpg")
        info.size = 5
        blocks += [info.tobuf(tarfile.USTAR_FORMAT), b"jpeg!".ljust(512, b"\0")]
    blocks.append(tarfile.TarInfo("k006.cls").tobuf(tarfile.USTAR_FORMAT))  # block 14, no data
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    blocks.append(pax.tobuf(tarfile.USTAR_FORMAT))  # block 15: no records, the last block of an 8 KiB chunk
    info = tarfile.TarInfo("k007.jpg")
    info.size = 5
    blocks += [info.tobuf(tarfile.USTAR_FORMAT), b"jpeg!".ljust(512, b"\0"), bytes(1024)]
    path = tmp_path / "s.tar"
    path.write_bytes(b"".join(blocks))
    monkeypatch.setattr(tar_reader, "CHUNK", 8192)
    assert at_once(str(path)) == walked(str(path), monkeypatch) == (8, ["cls", "jpg"])
