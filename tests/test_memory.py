"""What a GPU holds: parallel.activation_checkpointing (the blocks of every backbone recompute their activations in backward,
which changes no loss and no gradient by a bit, keeps the module's names and far fewer bytes) and `prunepipe bench memory`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from diffusers import UNet2DModel

from prunepipe.pipelines.tasks.diffusion.dit import build_dit
from prunepipe.pipelines.tasks.diffusion.pixart import build_text_dit
from prunepipe.pipelines.tasks.mae import MaskedAutoencoder
from prunepipe.pipelines.training.parallel import checkpoint_activations, model_blocks
from prunepipe.tools.benchmarks.memory import measure


def tiny(kind: str):
    """(a tiny model of `kind`, a loss of it on a fixed batch)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, 8)
    t = torch.tensor([1.0, 300.0, 700.0])
    if kind == "dit":
        model = build_dit("DiT-S/2", sample_size=8, in_channels=4, num_classes=3, depth=3, width=32, heads=2)
        torch.nn.init.normal_(model.proj_out_2.weight)  # DiT starts at zero output: give the gradients a path
        return model, lambda m: m(x, timestep=t, class_labels=torch.tensor([0, 1, 3])).sample.square().mean()
    if kind == "pixart":
        model = build_text_dit("DiT-S/2", sample_size=8, in_channels=4, caption_channels=16, depth=3, width=32, heads=2)
        torch.nn.init.normal_(model.proj_out.weight)
        text, mask = torch.randn(3, 5, 16), torch.ones(3, 5)
        none = {"resolution": None, "aspect_ratio": None}
        return (
            model,
            lambda m: (
                m(x, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t, added_cond_kwargs=none)
                .sample.square()
                .mean()
            ),
        )
    if kind == "unet":
        model = UNet2DModel(
            sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), norm_num_groups=8,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        )  # fmt: skip
        return model, lambda m: m(x, t).sample.square().mean()
    model = MaskedAutoencoder(
        img_size=16, in_chans=3, patch_size=4, embed_dim=32, depth=3, num_heads=2, mlp_ratio=4.0,
        decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2, mask_ratio=0.75, norm_pix_loss=True,
    )  # fmt: skip
    images, noise = torch.randn(3, 3, 16, 16), torch.rand(3, 16)
    return model, lambda m: m(images, noise).mean()


@pytest.mark.parametrize("setting", ["full", 2])
@pytest.mark.parametrize("kind", ["dit", "pixart", "unet", "mae"])
def test_checkpointed_blocks_give_bitwise_the_same_loss_and_gradients(kind, setting):
    model, loss_of = tiny(kind)
    checkpointed = copy.deepcopy(model)
    blocks = checkpoint_activations(checkpointed, setting)
    assert blocks == len(model_blocks(model)[:: 1 if setting == "full" else setting]) > 0
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert checkpointed.state_dict().keys() == model.state_dict().keys()
    plain, recomputed = loss_of(model), loss_of(checkpointed)
    plain.backward()
    recomputed.backward()
    assert torch.equal(plain, recomputed)
    for (name, a), b in zip(model.named_parameters(), checkpointed.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


def test_checkpointing_keeps_a_fifth_or_less_of_dit_xl_activations():
    row = measure("DiT-XL/2 256 px")  # built on `meta`: no memory, no arithmetic
    assert 0.6e9 < row["parameters"] < 0.8e9  # DiT-XL/2: 675 M in the paper, more with diffusers' per-block embedders
    assert row["activations"] >= 5 * row["activations_ac"] > 0


def test_bench_memory_prints_every_preset_and_the_8b_dit_fits_eight_gpus_under_fsdp(capsys):
    from prunepipe.launch.cli import main

    assert main(["bench", "memory", "--json", "--presets", "DiT-8B/2 256 px", "PixArt-XL/2 512 px + T5-XXL"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cell = {(r["preset"], r["strategy"], r["activation_checkpointing"]): r for r in rows}
    assert len(cell) == 8
    big = "DiT-8B/2 256 px"
    assert 7.5 < cell[big, "ddp", False]["params_B"] < 9.5
    assert cell[big, "ddp", True]["max_batch"] == 0, "26 bytes a parameter do not fit 80 GB"
    assert cell[big, "fsdp", True]["max_batch"] >= 8
    assert cell[big, "fsdp", True]["per_sample"] * 5 <= cell[big, "fsdp", False]["per_sample"]
    text = cell["PixArt-XL/2 512 px + T5-XXL", "fsdp", True]["text_encoder"]
    assert 8.5 < text < 9.5, "T5-XXL's 4.76 B parameters in bf16 on every GPU"


@pytest.mark.slow  # inductor compiles the blocks: about a minute on 2 cores with a cold cache
def test_a_compiled_dit_repeats_and_resumes_bit_for_bit_on_cpu():
    import argparse

    from prunepipe.tools.benchmarks.compile_check import add_arguments, check

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = check(parser.parse_args(["--device", "cpu", "--steps", "4"]))
    for name in ("eager", "compiled"):
        assert result[name]["repeat_bitwise"] and result[name]["resume_bitwise"], (name, result)
