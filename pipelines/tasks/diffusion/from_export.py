"""Sampling an export (export.py's folder): its model, its VAE and text encoder, prunepipe's own sampler
(`sample`, the loop the FID evaluator runs) and the diffusers pipelines it loads as. Reads files only;
never downloads.
"""

from __future__ import annotations

import json
import os

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    DiffusionPipeline,
    PixArtTransformer2DModel,
    UNet2DModel,
)

from prunepipe.pipelines.tasks.diffusion.autoencoder import load_autoencoder, vae_factor
from prunepipe.pipelines.tasks.diffusion.dit import DiTTransformer2DModel, dit_null_label
from prunepipe.pipelines.tasks.diffusion.export import (
    AUTOENCODER_INFO,
    MODEL_FOLDERS,
    PIPELINE_INDEX,
    RAW_VARIANT,
    TEXT_ENCODER_INFO,
)
from prunepipe.pipelines.tasks.diffusion.pixart import SizeConditions
from prunepipe.pipelines.tasks.diffusion.sampler import denoise, sampling_scheduler
from prunepipe.pipelines.tasks.diffusion.text import TextEncoder


def read_info(export_dir: str, name: str = AUTOENCODER_INFO) -> dict:
    """One of the export's json records; a folder that is no export says so."""
    path = os.path.join(export_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{export_dir}: no {name}: not a prunepipe diffusion export (a run writes RUN/export "
            f"at its end; `prunepipe export RUN` writes one from its newest checkpoint)"
        )
    with open(path) as f:
        return json.load(f)


def load_model(export_dir: str, ema: bool = True) -> UNet2DModel | DiTTransformer2DModel | PixArtTransformer2DModel:
    """The export's unet/ or transformer/: its EMA weights (`ema`), else the live ones (the non_ema variant
    where the run kept an EMA). A transformer/ is a PixArt transformer where text_encoder.json says the run
    was text-conditional, else a DiT (dit.py's, which takes any size, as in training)."""
    read_info(export_dir)
    dit = os.path.isdir(os.path.join(export_dir, MODEL_FOLDERS["dit"]))
    subfolder = MODEL_FOLDERS["dit" if dit else "unet"]
    folder = os.path.join(export_dir, subfolder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{export_dir}: no {subfolder}/ (written by the run's export)")
    has_ema = any(RAW_VARIANT in name for name in os.listdir(folder))
    if ema and not has_ema:
        raise ValueError(
            f"{export_dir}: the run kept no EMA (no {RAW_VARIANT} variant beside it in {subfolder}/): "
            f"sample its weights with ema=False (`prunepipe sample --raw`)"
        )
    text = os.path.exists(os.path.join(export_dir, TEXT_ENCODER_INFO))
    model_class = (PixArtTransformer2DModel if text else DiTTransformer2DModel) if dit else UNet2DModel
    return model_class.from_pretrained(
        export_dir, subfolder=subfolder, variant=None if ema or not has_ema else RAW_VARIANT
    )


def _null_label(model: UNet2DModel | DiTTransformer2DModel) -> int | None:
    """The null label of a class-conditional model, None for an unconditional UNet."""
    if isinstance(model, PixArtTransformer2DModel):
        return None
    if isinstance(model, DiTTransformer2DModel):
        return dit_null_label(model)
    return model.config.num_class_embeds - 1 if model.config.num_class_embeds else None


def export_autoencoder(export_dir: str, vae: str | None = None, vae_subfolder: str = "") -> AutoencoderKL | None:
    """The VAE that decodes an export's samples: `vae` (with `vae_subfolder`) when given, else the export's
    vae/, else the one autoencoder.json names; None in pixel space."""
    info = read_info(export_dir)
    if vae is None and os.path.isdir(os.path.join(export_dir, "vae")):
        return load_autoencoder(os.path.join(export_dir, "vae"), setting=f"{export_dir}/vae")
    name = vae or info["vae"]
    if not vae and info["space"] == "pixel":
        return None
    if not vae and info["space"] == "latents":
        raise ValueError(
            f"{export_dir}: this run trained on precomputed latents and its export holds no vae/ (the "
            f"latent shards' VAE was not found when it was written): pass vae= (`prunepipe sample "
            f"--vae`), the folder or repo id recorded as 'vae' in the latent shards' index.json"
        )
    return load_autoencoder(name, info["vae_subfolder"] if vae is None else vae_subfolder, info.get("cache_dir", ""))


def load_text_encoder(export_dir: str, path: str | None = None) -> TextEncoder:
    """The run's text encoder: `path` (a folder, its tokenizer beside it), else the export's text_encoder/ and
    tokenizer/, else the folders text_encoder.json records (relative to the export). Refused when its files
    differ from the run's (the digest of TextEncoder.identity): other features, other images."""
    info = read_info(export_dir, TEXT_ENCODER_INFO)
    if path is not None:
        encoder = TextEncoder(path, "", info["max_length"], setting="text_encoder")
    else:
        placed = os.path.join(export_dir, "text_encoder")
        # a run whose tokenizer sat in its encoder's folder reads it from text_encoder/ (a copied export's
        # tokenizer/ holds the tokenizer's files for diffusers; the digest is of the run's one folder)
        shared = info["tokenizer"] == info["text_encoder"]
        model, tokenizer = (
            (placed, placed if shared else os.path.join(export_dir, "tokenizer"))
            if os.path.exists(placed)
            else (os.path.join(export_dir, info["text_encoder"]), os.path.join(export_dir, info["tokenizer"]))
        )
        encoder = TextEncoder(
            model, tokenizer, info["max_length"], setting=f"{export_dir}/{TEXT_ENCODER_INFO} text_encoder"
        )
    found = encoder.identity()["digest"]
    if found != info["digest"]:
        raise ValueError(
            f"{export_dir}/{TEXT_ENCODER_INFO}: the run's text encoder had digest {info['digest']}, "
            f"the one at {encoder.path!r} has {found} (another model or tokenizer): pass "
            f"text_encoder= the folder the run used"
        )
    return encoder


@torch.no_grad()
def sample(
    export_dir: str,
    num_images: int,
    steps: int,
    generator: torch.Generator,
    *,
    ema: bool = True,
    class_labels: torch.Tensor | None = None,
    vae: str | None = None,
    vae_subfolder: str = "",
    guidance_scale: float = 1.0,
    prompts: list[str] | None = None,
    text_encoder: str | None = None,
) -> torch.Tensor:
    """[num_images, C, H, W] float images in [0, 1] from an export: DDIM (eta 0), or Euler for flow,
    over `steps` steps from torch.randn(generator), then the VAE decoder for latent runs. Runs on
    generator.device. The same loop as the FID evaluator's (sampler.py), stepped by the export's scheduler/,
    as its pipeline steps.

    class_labels [N] for class-conditional models (default: the null class), with classifier-free
    guidance when guidance_scale != 1. Text-conditional models take `prompts` (one per image; the
    empty caption when None), read as written, guided against the empty caption's features, encoded by
    the export's text encoder or by `text_encoder` (a folder; its tokenizer beside it). `vae` overrides
    the export's VAE (with `vae_subfolder`).
    """
    info = read_info(export_dir)
    device = generator.device
    model = load_model(export_dir, ema).to(device)
    config = DDPMScheduler.load_config(export_dir, subfolder="scheduler")
    scheduler = sampling_scheduler(config.get("_class_name", ""), config)
    labels, null = None, _null_label(model)
    if isinstance(model, PixArtTransformer2DModel):
        encoder = load_text_encoder(export_dir, text_encoder)
        labels = encoder.encode([""] * num_images if prompts is None else list(prompts), device)
        if len(labels) != num_images:
            raise ValueError(f"prompts: {len(labels)} given for num_images={num_images}")
        null = encoder.null(device)
    elif null is not None and (null > 0 or isinstance(model, UNet2DModel)):  # a DiT of 0 classes is unconditional
        labels = torch.full((num_images,), null, dtype=torch.long) if class_labels is None else class_labels.long()
        labels = torch.where(labels < 0, torch.full_like(labels, null), labels).to(device)
    autoencoder = export_autoencoder(export_dir, vae, vae_subfolder)
    size = model.config.sample_size
    shape = (num_images, model.config.in_channels, *((size, size) if isinstance(size, int) else size))
    x = torch.randn(shape, generator=generator, device=device)
    x = denoise(
        model,
        x,
        scheduler,
        steps,
        labels,
        null_label=null,
        guidance_scale=guidance_scale,
        sizes=export_size_conditions(model, info, autoencoder),
    )

    if autoencoder is None:
        images = x / (info["scaling_factor"] or 1.0)
    else:
        autoencoder.to(device)
        scale = info["scaling_factor"] or float(autoencoder.config.scaling_factor)
        shift = float(info.get("shift_factor") or getattr(autoencoder.config, "shift_factor", None) or 0.0)
        images = autoencoder.decode(x / scale + shift).sample
    return (images / 2 + 0.5).clamp(0, 1).float()


def export_size_conditions(model, info: dict, autoencoder: AutoencoderKL | None) -> SizeConditions | None:
    """The size conditions of a PixArt transformer built with them (ldm.dit.size_conditions), else None:
    image pixels per latent pixel as the run counted them (autoencoder.json's `downsampling`), else the
    VAE's, as PixArtAlphaPipeline counts them (1 in pixel space)."""
    if not getattr(model, "use_additional_conditions", False):
        return None
    factor = info.get("downsampling") or (vae_factor(autoencoder) if autoencoder is not None else 1)
    return SizeConditions(int(factor))


def load_pipeline(export_dir: str, ema: bool = True) -> DiffusionPipeline:
    """The diffusers pipeline model_index.json names (DDPMPipeline, DiTPipeline, PixArtAlphaPipeline or, for
    flow, PixArtSigmaPipeline), with the live weights in place of the EMA when not `ema`. Text-conditional
    exports load through `pixart_pipeline`, which reads prompts as the run did."""
    _check_pipeline_index(export_dir)
    if os.path.exists(os.path.join(export_dir, TEXT_ENCODER_INFO)):
        return pixart_pipeline(export_dir, ema=ema)
    pipe = DiffusionPipeline.from_pretrained(export_dir)
    return _with_weights(pipe, export_dir, ema)


def pixart_pipeline(
    export_dir: str,
    *,
    ema: bool = True,
    vae: str | None = None,
    vae_subfolder: str = "",
    text_encoder: str | None = None,
):
    """The PixArt pipeline a text-conditional export's model_index.json names (PixArtAlphaPipeline, or
    PixArtSigmaPipeline for flow), reading prompts as written (the run saw the captions stripped only,
    never lowercased); `vae` and `text_encoder` override the export's. Call it with
    `max_sequence_length=` the run's text length and `use_resolution_binning=False` (binning knows
    PixArt's own sizes only)."""
    import diffusers

    read_info(export_dir, TEXT_ENCODER_INFO)
    _check_pipeline_index(export_dir)
    with open(os.path.join(export_dir, PIPELINE_INDEX)) as f:
        named = getattr(diffusers, json.load(f)["_class_name"])

    class CaptionsAsWritten(named):
        """The PixArt pipelines lowercase every prompt, clean_caption=False included (diffusers 0.42), and
        T5's tokenizer is case-sensitive: the run trained on captions as written, stripped only."""

        def _text_preprocessing(self, text, clean_caption=False):
            if clean_caption:
                return super()._text_preprocessing(text, clean_caption)
            return [t.strip() for t in (text if isinstance(text, (tuple, list)) else [text])]

    parts = {}
    if vae is not None:
        parts["vae"] = load_autoencoder(vae, vae_subfolder, setting="vae")
    if text_encoder is not None:
        encoder = load_text_encoder(export_dir, text_encoder)
        parts.update(text_encoder=encoder.model, tokenizer=encoder.tokenizer)
    return _with_weights(CaptionsAsWritten.from_pretrained(export_dir, **parts), export_dir, ema)


def _check_pipeline_index(export_dir: str) -> None:
    """Raises, with the export README's reason, when no diffusers pipeline samples the export."""
    if os.path.exists(os.path.join(export_dir, PIPELINE_INDEX)):
        return
    readme, why = os.path.join(export_dir, "README.md"), ""
    if os.path.exists(readme):
        with open(readme) as f:
            why = next((line.strip() for line in f if line.startswith("No diffusers pipeline")), "")
    raise ValueError(
        f"{export_dir}: no {PIPELINE_INDEX}. {why or 'No diffusers pipeline samples it.'} "
        f"Sample it with prunepipe: use sample() (`prunepipe sample`)"
    )


def _with_weights(pipe, export_dir: str, ema: bool):
    """`pipe` with the export's live weights in place of the EMA when not `ema`."""
    if not ema:
        name = "transformer" if hasattr(pipe, "transformer") else "unet"
        pipe.register_modules(**{name: load_model(export_dir, ema=False)})  # sets the attribute too
    return pipe
