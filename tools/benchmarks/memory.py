"""`prunepipe bench memory`: what one GPU holds for each preset, per GPU at N GPUs, under ddp and fsdp, with
and without activation checkpointing. Each model is built with the project's own builders on the `meta`
device (no memory, no weights, seconds); parameters are counted, activations are what autograd saves in a
bf16 forward, per sample (batch 2 minus batch 1, so that the saved weights cancel), plus, under
checkpointing, each checkpointed block's input, which is all it keeps. Attention is counted as a CUDA GPU
runs it, through the fused kernels' own meta functions (flash, or memory-efficient under a mask: O(L)
kept a head); on `meta` torch's dispatcher would take the math path, which keeps the L x L matrices in fp32.

Bytes a trained parameter, per GPU: ddp 26 (fp32 weights 4, gradients 4, DDP's bucket copy 4, AdamW 8, fp32
EMA 4, bf16 autocast copies 2); fsdp 20 / N (weights, gradients, AdamW and EMA sharded) plus the bf16 working
set of the largest unit, gathered for the forward and its prefetch and its unsharded gradient (3 x 2 bytes a
parameter of that unit). The frozen text encoder sits whole in bf16 on every GPU (or nowhere with
precomputed features). A CUDA context, the allocator's slack and workspaces: CONTEXT_GIB.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

from prunepipe.pipelines.tasks.diffusion.dit import build_dit
from prunepipe.pipelines.tasks.diffusion.pixart import build_text_dit
from prunepipe.pipelines.tasks.mae import MaskedAutoencoder
from prunepipe.pipelines.training.parallel import checkpoint_activations, model_blocks

GIB = 1024**3
CONTEXT_GIB = 3.0
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, vocab_size=32128)
T5_TOKENS = 120  # PixArt-alpha's caption length


def dit(preset: str, latent: int):
    def build():
        return build_dit(preset, sample_size=latent, in_channels=4, num_classes=1000)

    def forward(model, batch):
        x = torch.zeros(batch, 4, latent, latent, dtype=torch.bfloat16)
        t, y = torch.zeros(batch), torch.zeros(batch, dtype=torch.long)
        return model(x, timestep=t, class_labels=y).sample

    return build, forward


def pixart(latent: int):
    def build():
        return build_text_dit("DiT-XL/2", sample_size=latent, in_channels=4, caption_channels=T5_XXL["d_model"])

    def forward(model, batch):
        x = torch.zeros(batch, 4, latent, latent, dtype=torch.bfloat16)
        text = torch.zeros(batch, T5_TOKENS, T5_XXL["d_model"], dtype=torch.bfloat16)
        mask = torch.ones(batch, T5_TOKENS)
        none = {"resolution": None, "aspect_ratio": None}
        return model(
            x,
            encoder_hidden_states=text,
            encoder_attention_mask=mask,
            timestep=torch.zeros(batch),
            added_cond_kwargs=none,
        ).sample

    return build, forward


def mae(embed: int, depth: int, heads: int, patch: int):
    def build():
        return MaskedAutoencoder(
            img_size=224, in_chans=3, patch_size=patch, embed_dim=embed, depth=depth, num_heads=heads, mlp_ratio=4.0,
            decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mask_ratio=0.75, norm_pix_loss=True,
        )  # fmt: skip

    def forward(model, batch):
        images = torch.zeros(batch, 3, 224, 224, dtype=torch.bfloat16)
        return model(images, torch.rand(batch, (224 // patch) ** 2))

    return build, forward


# row -> (builder, forward, the frozen text encoder it needs, its parameters)
PRESETS = {
    "DiT-XL/2 256 px": (*dit("DiT-XL/2", 32), None),
    "PixArt-XL/2 512 px + T5-XXL": (*pixart(64), "t5-xxl"),
    "PixArt-XL/2 512 px, precomputed text": (*pixart(64), None),
    "MAE ViT-L/16 224 px": (*mae(1024, 24, 16, 16), None),
    "MAE ViT-H/14 224 px": (*mae(1280, 32, 16, 14), None),
    "DiT-8B/2 256 px": (*dit("DiT-8B/2", 32), None),
}


def text_encoder_parameters() -> int:
    """T5-XXL's encoder (PixArt's and SD3's), built on `meta` from its configuration: 4.76 B."""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        return sum(p.numel() for p in T5EncoderModel(T5Config(**T5_XXL, feed_forward_proj="gated-gelu")).parameters())


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """scaled_dot_product_attention as CUDA runs it: flash attention, or the memory-efficient kernel where
    a mask is given (a text's padding), called by name so that their meta functions say what they keep."""
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[
            0
        ]
    bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale
    )[0]


def saved_bytes(model: nn.Module, forward, batch: int, checkpointed: bool) -> int:
    """Bytes autograd keeps for backward after a forward of `batch` (and, checkpointed, the blocks' inputs)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    def keep_input(module, args, kwargs):
        nonlocal total
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                total += value.numel() * value.element_size()

    hooks = (
        [b.register_forward_pre_hook(keep_input, with_kwargs=True) for b in model_blocks(model)] if checkpointed else []
    )
    fused = mock.patch.object(F, "scaled_dot_product_attention", fused_attention)
    with fused, torch.device("meta"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(model, batch)
    for hook in hooks:
        hook.remove()
    return total


def measure(name: str) -> dict:
    """Parameters, the largest unit and activations per sample (with and without checkpointing) of a preset."""
    build, forward, text = PRESETS[name]
    row = {"preset": name}
    for checkpointed in (False, True):
        with torch.device("meta"):
            model = nn.Module.to(
                build(), torch.bfloat16
            )  # diffusers' own .to warns of modules it keeps in fp32: none here
        if checkpointed:
            checkpoint_activations(model, "full")
        per_sample = saved_bytes(model, forward, 2, checkpointed) - saved_bytes(model, forward, 1, checkpointed)
        row["activations_ac" if checkpointed else "activations"] = per_sample
    row["parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row["largest_unit"] = max(sum(p.numel() for p in block.parameters()) for block in model_blocks(model))
    row["text_encoder"] = text_encoder_parameters() if text else 0
    return row


def per_gpu(row: dict, strategy: str, gpus: int, checkpointed: bool, gpu_gib: float) -> dict:
    """GiB per GPU of each kind, and the largest batch a GPU of `gpu_gib` fits."""
    p = row["parameters"]
    if strategy == "ddp":
        state = {"weights": 4 * p + 2 * p, "grads": 4 * p + 4 * p, "optimizer": 8 * p, "ema": 4 * p}
    else:
        working = 3 * 2 * row["largest_unit"]
        state = {
            "weights": 4 * p / gpus + working,
            "grads": 4 * p / gpus,
            "optimizer": 8 * p / gpus,
            "ema": 4 * p / gpus,
        }
    state["text_encoder"] = 2 * row["text_encoder"]
    fixed = sum(state.values()) / GIB + CONTEXT_GIB
    activations = row["activations_ac" if checkpointed else "activations"] / GIB
    fits = max(0, int((gpu_gib - fixed) / activations)) if activations else 0
    return {k: v / GIB for k, v in state.items()} | {"per_sample": activations, "fixed": fixed, "max_batch": fits}


def measured(name: str, batch: int, checkpointed: bool, steps: int = 3) -> dict:
    """On one CUDA GPU, fsdp at world 1 (FSDP2's bf16 policy, fused AdamW, an fp32 EMA): the peak that
    torch.cuda.max_memory_allocated reads over `steps` steps, beside this benchmark's prediction for it
    (which leaves out the context: the allocator does not count it)."""
    from prunepipe.pipelines.training.device import ensure_process_group
    from prunepipe.pipelines.training.parallel import device_mesh, shard_model

    build, forward, _ = PRESETS[name]
    device = torch.device("cuda")
    ensure_process_group(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = build()
    if checkpointed:
        checkpoint_activations(model, "full")
    shard_model(model, device_mesh("fsdp", 0, 1, 1, "cuda"), bf16=True, reshard_after_forward=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    shadow = [p.detach().clone() for p in params]
    with torch.device(device):
        for _ in range(steps):
            forward(model, batch).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch._foreach_lerp_(shadow, [p.detach() for p in params], 1e-3)
    torch.cuda.synchronize()
    row = measure(name)
    cell = per_gpu(row, "fsdp", 1, checkpointed, 80.0)
    predicted = cell["fixed"] - CONTEXT_GIB - cell["text_encoder"] + cell["per_sample"] * batch
    peak = torch.cuda.max_memory_allocated() / GIB
    return {"preset": name, "batch": batch, "activation_checkpointing": checkpointed, "predicted_gib": predicted,
            "measured_gib": peak, "measured_over_predicted": peak / predicted}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=8, help="GPUs the model is sharded over (default: %(default)s)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (default: %(default)s)")
    parser.add_argument("--presets", nargs="*", default=list(PRESETS), choices=list(PRESETS), metavar="PRESET")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the markdown table")
    parser.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="BATCH",
        help="on a CUDA GPU: train each preset at this batch under fsdp at world 1 and print the peak memory "
        "beside the prediction (JSON lines)",
    )


def run_from_args(args) -> int:
    if args.measure:
        if not torch.cuda.is_available():
            print(json.dumps({"measure": "skipped: no CUDA device"}))
            return 0
        for name in args.presets:
            for checkpointed in (False, True):
                print(json.dumps(measured(name, args.measure, checkpointed)), flush=True)
        return 0
    rows = [measure(name) for name in args.presets]
    out = []
    for row in rows:
        for strategy in ("ddp", "fsdp"):
            for checkpointed in (False, True):
                cell = per_gpu(row, strategy, args.gpus, checkpointed, args.gpu_gib)
                out.append({"preset": row["preset"], "params_B": row["parameters"] / 1e9, "strategy": strategy,
                            "activation_checkpointing": checkpointed, **cell})  # fmt: skip
    if args.json:
        for line in out:
            print(json.dumps(line))
        return 0
    print(
        f"Per GPU at {args.gpus} GPUs of {args.gpu_gib:g} GiB (GiB; activations per sample in bf16, counted from what "
        f"autograd saves on `meta`; context {CONTEXT_GIB:g} GiB):\n"
    )
    print("| preset | params | strategy | AC | weights | grads | AdamW | EMA | text enc. | act./sample | max batch |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out:
        print(
            f"| {r['preset']} | {r['params_B']:.2f} B | {r['strategy']} | {'full' if r['activation_checkpointing'] else 'none'} "
            f"| {r['weights']:.1f} | {r['grads']:.1f} | {r['optimizer']:.1f} | {r['ema']:.1f} | {r['text_encoder']:.1f} "
            f"| {r['per_sample']:.3f} | {r['max_batch']} |"
        )
    return 0
