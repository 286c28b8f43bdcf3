"""A text encoder's folder that cannot be loaded is named as the user gave it: by the flag of
`prunepipe latents encode` (--text-encoder, --tokenizer), or by the config key (ldm.text.encoder,
ldm.text.tokenizer) in a run; and transformers' reason is given whole, on one line."""

from __future__ import annotations

import os
import shutil

import pytest
from eval_runs import tiny_vae

from prunepipe.pipelines.tasks.diffusion.text import TextEncoder
from prunepipe.tools.commands.latents import encode_shards
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder


@pytest.fixture(scope="module")
def model_only(tmp_path_factory) -> str:
    """A tiny CLIP text model's folder without its tokenizer (as a repo's text_encoder/ is)."""
    full = write_tiny_text_encoder(
        str(tmp_path_factory.mktemp("encoder")), ["a digit"], hidden_size=16, layers=1, max_length=8
    )
    folder = str(tmp_path_factory.mktemp("text_encoder"))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(full, name), folder)
    return folder


def transformers_reason(folder: str) -> str:
    from transformers import AutoTokenizer

    with pytest.raises((OSError, ValueError)) as error:
        AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return [line.strip() for line in str(error.value).splitlines() if line.strip()][-1]


def test_latents_encode_names_its_flags_and_gives_the_whole_reason(digits_shards, model_only, tmp_path):
    vae = str(tmp_path / "vae")
    tiny_vae(3, 32).save_pretrained(vae)
    images = os.path.join(digits_shards, "val")
    with pytest.raises(FileNotFoundError) as error:
        encode_shards(images, vae, str(tmp_path / "out"), text_encoder=model_only)
    said = str(error.value)
    assert said.startswith(f"--text-encoder {model_only!r}: no tokenizer beside the encoder")
    assert "give its folder with --tokenizer" in said and "ldm." not in said
    assert transformers_reason(model_only) in said and "\n" not in said

    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with pytest.raises(FileNotFoundError, match=r"^--tokenizer '.*empty': no tokenizer there") as error:
        encode_shards(images, vae, str(tmp_path / "out"), text_encoder=model_only, tokenizer=empty)
    assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match=r"^--tokenizer '.*missing': no such folder"):
        encode_shards(images, vae, str(tmp_path / "out"), text_encoder=model_only, tokenizer=str(tmp_path / "missing"))


def test_a_run_names_its_config_keys(model_only):
    with pytest.raises(
        FileNotFoundError,
        match=r"^ldm\.text\.encoder='.*': no tokenizer beside the encoder.*"
        r"give its folder with ldm\.text\.tokenizer",
    ):
        TextEncoder(model_only, max_length=8)
