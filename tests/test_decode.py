"""The decoder: torchvision's fast path gives PIL's pixels for every mode shards carry, falls back
to PIL where it does not apply, names bad bytes, and a batch decoded in two stages equals the
samples decoded one by one; a caption is the txt field, else img2dataset's json caption."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from prunepipe.pipelines.data.decode import FAST_FIELDS, SampleDecoder, _fast_rgb, caption
from prunepipe.pipelines.data.resize import resize_center_crop
from prunepipe.pipelines.data.shards import BadInputError

CASES = [
    ("RGB", "PNG"),
    ("L", "PNG"),
    ("P", "PNG"),
    ("RGBA", "PNG"),
    ("LA", "PNG"),
    ("1", "PNG"),
    ("I;16", "PNG"),
    ("RGB", "JPEG"),
    ("L", "JPEG"),
    ("CMYK", "JPEG"),
    ("RGB", "WEBP"),
    ("RGB", "BMP"),
]


def encoded(mode: str, fmt: str, size=(24, 24), seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    if mode == "I;16":
        image = Image.fromarray((rng.random(size[::-1]) * 65535).astype(np.uint16))
    else:
        image = Image.fromarray((rng.random((*size[::-1], 3)) * 255).astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def pil_reference(data: bytes, resolution: int, mode: str = "RGB") -> torch.Tensor:
    """The reference decode the fast path must equal: PIL's convert, resize and crop, in [-1, 1]."""
    with Image.open(io.BytesIO(data)) as image:
        array = np.asarray(resize_center_crop(image.convert(mode), resolution), dtype=np.uint8)
    array = array[:, :, None] if array.ndim == 2 else array
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 127.5 - 1.0


@pytest.mark.parametrize("mode,fmt", CASES, ids=[f"{m}-{f}" for m, f in CASES])
@pytest.mark.parametrize("size", [(24, 24), (40, 30)], ids=["at-resolution", "resized"])
def test_decoded_pixels_are_pils_for_every_mode(mode, fmt, size):
    data = encoded(mode, fmt, size)
    field = {"JPEG": "jpg"}.get(fmt, fmt.lower())
    image, label = SampleDecoder(resolution=24)({"__key__": "k", field: data, "cls": b"7"}, 0, 0)
    assert label == 7
    if field in FAST_FIELDS and mode != "I;16":  # torchvision decoded it (16-bit PNG is left to PIL)
        assert _fast_rgb(data) is not None
    assert image.dtype == torch.float32 and image.shape == (3, 24, 24)
    torch.testing.assert_close(image, pil_reference(data, 24), rtol=0, atol=0)


def test_one_channel_decodes_with_pils_luma():
    data = encoded("RGB", "JPEG")
    image, _ = SampleDecoder(resolution=24, channels=1)({"__key__": "k", "jpg": data}, 0, 0)
    torch.testing.assert_close(image, pil_reference(data, 24, "L"), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_cut_off_image_names_its_shard_key_and_field(fmt):
    data = encoded("RGB", fmt)
    sample = {"__key__": "s00042", "__url__": "a.tar", fmt.lower(): data[: len(data) // 2]}
    with pytest.raises(BadInputError, match=rf"shard a\.tar key 's00042': cannot decode field '{fmt.lower()}'"):
        SampleDecoder(resolution=24)(sample, 0, 0)


def test_an_empty_txt_falls_back_to_the_json_caption_and_no_caption_anywhere_is_named():
    where = {"__key__": "000000007", "__url__": "00000.tar"}
    assert caption({**where, "txt": b"  a red kite  \n"}) == "a red kite"
    assert caption({**where, "txt": b"", "json": b'{"caption": " a red kite "}'}) == "a red kite"
    assert caption({**where, "json": b'{"caption": "a red kite"}'}) == "a red kite"
    with pytest.raises(BadInputError, match=r"key '000000007': no caption \(field 'txt' empty, and no 'caption'"):
        caption({**where, "txt": b" ", "json": b'{"caption": ""}'})
    with pytest.raises(BadInputError, match=r"no caption \(field 'txt' missing"):
        caption({**where, "json": b'{"url": "x"}'})


def test_a_batch_finished_at_once_equals_samples_decoded_one_by_one():
    decoder = SampleDecoder(resolution=24, hflip=True, seed=5)
    samples = [{"__key__": f"k{i}", "png": encoded("RGB", "PNG", seed=i)} for i in range(16)]
    ids = np.arange(100, 116)
    one_by_one = torch.stack([decoder(s, int(i), 3)[0] for s, i in zip(samples, ids)])
    stacked = torch.stack([decoder.decode(s, int(i))[0] for s, i in zip(samples, ids)])
    assert stacked.dtype == torch.uint8  # pixels travel as bytes until the batch is finished
    torch.testing.assert_close(decoder.finish(stacked, ids, 3), one_by_one, rtol=0, atol=0)
    unflipped = SampleDecoder(resolution=24).finish(stacked, ids, 3)
    flipped = [bool((a != b).any()) for a, b in zip(one_by_one, unflipped)]
    assert 0 < sum(flipped) < 16, "the coin flips some samples and not others"
    for a, b, f in zip(one_by_one, unflipped, flipped):
        torch.testing.assert_close(a, b.flip(-1) if f else b, rtol=0, atol=0)


def test_labels_are_checked_against_the_class_count_on_the_host():
    decoder = SampleDecoder(resolution=24, num_classes=5)
    sample = {"__key__": "s7", "__url__": "a.tar", "png": encoded("RGB", "PNG")}
    assert decoder({**sample, "cls": b"4"}, 0, 0)[1] == 4
    assert decoder({**sample, "cls": b"-1"}, 0, 0)[1] == -1  # no label: the null class
    with pytest.raises(BadInputError, match=r"shard a\.tar key 's7': label 5 is out of range for 5 classes"):
        decoder({**sample, "cls": b"5"}, 0, 0)
    assert SampleDecoder(resolution=24)({**sample, "cls": b"5"}, 0, 0)[1] == 5, "no class count: any label"
