"""A diffusion run's export as a diffusers pipeline folder. `model_index.json` names the pipeline that
samples it where one does (DDPMPipeline: an unconditional pixel-space UNet; DiTPipeline: a class-
conditional latent DiT; PixArtAlphaPipeline: a text-conditional latent DiT, PixArtSigmaPipeline for flow,
and with PixArt-alpha's size conditions Alpha at sample_size 128 only; the others none, see `pipeline_for`),
so `Pipeline.from_pretrained(export)` needs nothing else. Beside it:

  unet/ or transformer/   the weights to sample: the EMA when the run kept one, the live weights then
                          as the `non_ema` variant (Stable Diffusion's repositories' layout)
  scheduler/              the sampler FID measured: DDIM (eta 0) from the training schedule, or for flow
                          Euler as DPMSolverMultistepScheduler at first order (sampler.flow_sampler)
  vae/ text_encoder/ tokenizer/   the run's frozen parts, as relative links to their folders (`copy`: copies)
  autoencoder.json        the latent scaling and the image pixels per latent pixel, for prunepipe's own sampler
  text_encoder.json       the text encoder's identity (folders relative to the export, digest)
  README.md               what loads it and how to call it

Writes files only; never downloads, never trains.
"""

from __future__ import annotations

import os
import shutil

import diffusers
from diffusers import AutoencoderKL, DDIMScheduler

from prunepipe.pipelines.data.side_tables import write_json
from prunepipe.pipelines.tasks.diffusion.autoencoder import autoencoder_folder, load_autoencoder
from prunepipe.pipelines.tasks.diffusion.stock_call import StockCall, stock_call
from prunepipe.pipelines.tasks.diffusion.text import TextEncoder, quiet_transformers
from prunepipe.pipelines.tasks.wrappers import unwrap, weights_module

MODEL_FOLDERS = {"unet": "unet", "dit": "transformer"}  # as diffusers pipelines name them
RAW_VARIANT = "non_ema"  # the live weights beside the EMA: diffusion_pytorch_model.non_ema.safetensors
AUTOENCODER_INFO = "autoencoder.json"
TEXT_ENCODER_INFO = "text_encoder.json"
PIPELINE_INDEX = "model_index.json"
PIXART_SIZE_CONDITIONED = 128  # the one sample_size PixArtAlphaPipeline passes size conditions to


def export_diffusion(task, model, ema_model, out_dir: str, *, copy: bool = False) -> list[str]:
    """Write `task`'s export into `out_dir` (its entries replaced, anything else there kept); returns
    the paths written. `model` holds the live weights, `ema_model` the EMA (or None)."""
    os.makedirs(out_dir, exist_ok=True)
    scheduler_folder, scheduler_class = _write_scheduler(task, out_dir)
    written = [_write_model(task, model, ema_model, out_dir), scheduler_folder]
    scale, shift, vae_folder, vae_note = _place_vae(task, out_dir, copy)
    written.append(
        _write_json(
            out_dir,
            AUTOENCODER_INFO,
            {
                "space": task.cfg.space,
                "vae": task.cfg.vae,
                "vae_subfolder": task.cfg.vae_subfolder,
                "cache_dir": task.cfg.cache_dir,
                "scaling_factor": scale,
                "shift_factor": shift,
                # image pixels per latent pixel, as the run counted them (its size conditions, if any)
                "downsampling": task.downsampling,
            },
        )
    )
    if vae_folder:
        written.append(vae_folder)
    text, text_note = (None, "")
    if task.text_encoder is not None:
        text, text_note = _place_text_encoder(task, out_dir, copy)
        written += text["written"] if text else []
        written.append(
            _write_json(out_dir, TEXT_ENCODER_INFO, _relative_identity(task.text_encoder.identity(), out_dir))
        )
    pipeline, reason = pipeline_for(
        task, vae=bool(vae_folder), shift=shift, vae_note=vae_note, text=text, text_note=text_note
    )
    index_path = os.path.join(out_dir, PIPELINE_INDEX)
    _remove(index_path)  # an earlier export's pipeline may not fit this one
    if pipeline is not None:
        components = {
            "scheduler": ["diffusers", scheduler_class],
            MODEL_FOLDERS[task.cfg.backbone]: ["diffusers", type(unwrap(model)).__name__],
        }
        if vae_folder:
            components["vae"] = ["diffusers", "AutoencoderKL"]
        if text:
            components.update(text["components"])
        written.append(
            _write_json(
                out_dir,
                PIPELINE_INDEX,
                {"_class_name": pipeline, "_diffusers_version": diffusers.__version__, **components},
            )
        )
    readme = os.path.join(out_dir, "README.md")
    buckets = [tuple(b["image"]) for b in task.bucket_table or () if b.get("image")]
    call = stock_call(out_dir, buckets) if pipeline is not None else None
    with open(readme, "w") as f:
        f.write(export_readme(task, pipeline, reason, ema=ema_model is not None, call=call))
    written.append(readme)
    return written


def pipeline_for(
    task, *, vae: bool, shift: float, vae_note: str, text: dict | None, text_note: str
) -> tuple[str | None, str]:
    """(the diffusers pipeline class that samples this export, "") or (None, why none does)."""
    cfg = task.cfg
    latent = cfg.space != "pixel"
    if latent and not vae:
        return None, f"no VAE to decode its latents with: {vae_note}"
    if latent and shift:
        return None, (
            f"its latents are shifted by {shift} before scaling (the VAE's shift_factor); diffusers' "
            f"pipelines decode latents / scaling_factor only"
        )
    if task.text_encoder is not None:
        if text is None:
            return None, text_note
        if task.size_conditions is not None:
            # PixArtSigmaPipeline passes no size conditions; PixArtAlphaPipeline passes them to a transformer
            # of sample_size 128 only (its 1024 px models), None to any other, which then cannot run
            if task.sample_size != PIXART_SIZE_CONDITIONED:
                return None, (
                    f"its transformer takes PixArt-alpha's size conditions (ldm.dit.size_conditions), which "
                    f"PixArtSigmaPipeline never passes and PixArtAlphaPipeline passes only to a transformer of "
                    f"sample_size {PIXART_SIZE_CONDITIONED} (1024 px at 8x VAE downsampling); this one's "
                    f"sample_size is {task.sample_size}"
                )
            name = "PixArtAlphaPipeline"
        else:
            # flow: Sigma, since PixArtAlphaPipeline called with one step reads the step's second output
            # (pred_original_sample), which DPMSolverMultistepScheduler (flow's sampler) does not return
            name = "PixArtSigmaPipeline" if cfg.objective == "flow" else "PixArtAlphaPipeline"
        return (name, "") if latent else (None, f"{name} decodes latents with a VAE; this run trained in pixel space")
    if cfg.backbone == "dit":
        if not latent:
            return None, "DiTPipeline decodes latents with a VAE; this run trained in pixel space"
        if not cfg.num_classes:
            return None, "DiTPipeline samples class-conditional DiTs; this one is unconditional"
        return "DiTPipeline", ""
    if latent or cfg.num_classes:
        return None, "diffusers' DDPMPipeline samples unconditional pixel-space UNets only"
    return "DDPMPipeline", ""


# -------------------------------------------------------------------- the parts
def _write_model(task, model, ema_model, out_dir: str) -> str:
    folder = os.path.join(out_dir, MODEL_FOLDERS[task.cfg.backbone])
    _remove(folder)
    if ema_model is None:
        unwrap(model).save_pretrained(folder)
    else:
        weights_module(ema_model, model).save_pretrained(folder)
        unwrap(model).save_pretrained(folder, variant=RAW_VARIANT)
    return folder


def _write_scheduler(task, out_dir: str) -> tuple[str, str]:
    """(the folder, the scheduler's class): the sampling scheduler, not the training one: what `sample()`
    and FID step with, so a pipeline's default call draws what FID measured. Its config carries the
    training schedule (betas, T, prediction; for flow T and the velocity prediction)."""
    folder = os.path.join(out_dir, "scheduler")
    _remove(folder)
    scheduler = task.sampler() if task.cfg.objective == "flow" else DDIMScheduler.from_config(task.scheduler.config)
    scheduler.save_pretrained(folder)
    return folder, type(scheduler).__name__


def _place_vae(task, out_dir: str, copy: bool) -> tuple[float, float, str, str]:
    """(scaling factor, shift, the vae/ written or "", why none was). A run on precomputed latents finds
    its VAE in the latent shards' index.json. A VAE whose config scales otherwise than the run did is
    copied with the run's factor in its config, which is what pipelines divide by."""
    cfg, target = task.cfg, os.path.join(out_dir, "vae")
    _remove(target)
    if cfg.space == "pixel":
        return task.scaling_factor, 0.0, "", "pixel space"
    if cfg.space == "latents":
        vae_record = task.records.vae
        if vae_record is None:
            return (
                task.scaling_factor or 0.0,
                0.0,
                "",
                ("the latent shards' index.json names no VAE (pass vae= to sample())"),
            )
        name, subfolder = vae_record.name, vae_record.subfolder
        try:  # its config alone: rank 0 exports while the other ranks wait at the end of training
            config = AutoencoderKL.load_config(
                autoencoder_folder(name, subfolder, cfg.cache_dir), local_files_only=True
            )
        except (OSError, ValueError) as e:
            return task.scaling_factor or 0.0, 0.0, "", f"the latent shards' vae {name!r}: {str(e).splitlines()[0]}"
        scale = task.scaling_factor or float(vae_record.scaling_factor or config["scaling_factor"])
        shift = float(vae_record.shift_factor or config.get("shift_factor") or 0.0)
    else:
        name, subfolder, config = cfg.vae, cfg.vae_subfolder, task.autoencoder.config
        scale, shift = task.scaling_factor, task.shift_factor
    if scale != float(config["scaling_factor"]):
        vae = task.autoencoder or load_autoencoder(name, subfolder, cfg.cache_dir, setting="the latent shards' vae")
        vae.register_to_config(scaling_factor=scale)
        vae.save_pretrained(target)
    else:
        _link_or_copy(autoencoder_folder(name, subfolder, cfg.cache_dir), target, copy)
    return scale, shift, target, ""


def _place_text_encoder(task, out_dir: str, copy: bool) -> tuple[dict | None, str]:
    """text_encoder/ and tokenizer/ from the folders the run's encoder was read from (for precomputed
    features: the folders `latents encode` recorded); ({"components", "written"}, "") or (None, why not)."""
    info = task.text_encoder.identity()
    folders = {"text_encoder": info["text_encoder"], "tokenizer": info["tokenizer"]}
    missing = [f"{name} {path!r}" for name, path in folders.items() if not os.path.isdir(path)]
    if missing:
        return None, (
            f"the text encoder that made its features is not on this machine ({', '.join(missing)}, as "
            f"`latents encode` recorded them)"
        )
    if isinstance(task.text_encoder, TextEncoder):
        tokenizer = task.text_encoder.tokenizer
    else:  # the tokenizer alone names its class: rank 0 exports while the others wait, so no T5-XXL load
        import transformers

        with quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(info["tokenizer"], local_files_only=True)
    tokenizer_class = type(tokenizer).__name__
    written = []
    for name, folder in folders.items():
        target = os.path.join(out_dir, name)
        _remove(target)
        if name == "tokenizer" and os.path.realpath(folder) == os.path.realpath(info["text_encoder"]):
            # one folder holds both, as most hub repositories' do: a link to text_encoder/, or for a copy
            # the tokenizer's own files (not the encoder's weights a second time)
            if copy:
                tokenizer.save_pretrained(target)
            else:
                os.symlink("text_encoder", target)
        else:
            _link_or_copy(folder, target, copy)
        written.append(target)
    components = {
        "text_encoder": ["transformers", info["class"]],
        "tokenizer": ["transformers", tokenizer_class],
    }
    return {"components": components, "written": written}, ""


def _relative_identity(identity: dict, out_dir: str) -> dict:
    """The encoder's identity with its folders relative to the export: it is sampled from anywhere the
    export and the encoder move together."""
    relative = dict(identity)
    for key in ("text_encoder", "tokenizer"):
        relative[key] = os.path.relpath(identity[key], os.path.abspath(out_dir))
    return relative


def _sizes_note(task) -> list[str]:
    """README lines on the sizes the model trained at (aspect-ratio buckets) and samples at, [] for one size."""
    if not task.bucket_table:
        return []
    names = ", ".join(str(b["name"]) for b in task.bucket_table)
    side = task.sample_size
    base = f"{side}x{side} px" if task.cfg.space == "pixel" else f"{side}x{side} latents"
    if task.cfg.space != "pixel" and task.downsampling:
        base += f", {side * task.downsampling}x{side * task.downsampling} px"
    return [
        f"It trained on aspect-ratio buckets ({names}), each batch at its own size. prunepipe's FID and "
        f"`prunepipe sample` draw at the square base size ({base}).",
        "",
    ]


def _stock_lines(call: StockCall, pixart_call: str) -> tuple[list[str], list[str]]:
    """(the python lines, the prose after them) of a PixArt export: the plain call or the one with the
    arguments it needs, prunepipe's own sampler's call, and a bucket's size where the run trained on buckets."""
    code = [f"images = {call.call()}.images"]
    prose = []
    if call.plain:
        binned = (
            f" Resolution binning draws a square at PixArt's own {call.binned_side} px and resizes it to the "
            f"run's {call.side} px; `use_resolution_binning=False` draws at {call.side} px."
            if call.binned_side != call.side
            else ""
        )
        prose.append(f"`{call.call()}` draws from it with the pipeline's defaults.{binned}")
    else:
        prose.append(
            f"`pipe(prompt)` alone does not draw from it: {'; '.join(call.reasons)}. So the call names "
            f"{', '.join(f'`{k}`' for k in call.arguments)}."
        )
    code += ["# prunepipe's samples (its sampler, 50 steps, prompts as written):", f"images = {pixart_call}.images"]
    if call.buckets:
        height, width = call.buckets[-1]
        code += [
            "# a bucket's size (height, width in px; any bucket listed below):",
            f"images = {call.call(height=str(height), width=str(width))}.images",
        ]
        prose.append(
            f"The pipeline draws at each bucket's size it trained on, with `height=` and `width=` in pixels and "
            f"`use_resolution_binning=False`: {', '.join(f'{h}x{w}' for h, w in call.buckets)} (height x width)."
        )
    if call.refused:
        prose.append(
            f"It refuses the buckets {', '.join(f'{h}x{w}' for h, w in call.refused)}: the pipeline takes sides "
            f"of multiples of 8 px only (`prunepipe sample` draws the square base size)."
        )
    return code, prose


# -------------------------------------------------------------------- files
def _link_or_copy(source: str, target: str, copy: bool) -> None:
    """A relative symlink to `source` (the export and the model move together), or a copy of its files."""
    if copy:
        shutil.copytree(source, target, symlinks=False)  # a hub snapshot's files are links into its blobs
    else:
        os.symlink(os.path.relpath(os.path.realpath(source), os.path.dirname(os.path.abspath(target))), target)


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _write_json(out_dir: str, name: str, content: dict) -> str:
    path = os.path.join(out_dir, name)
    write_json(path, content)
    return path


def export_readme(task, pipeline: str | None, reason: str, *, ema: bool, call: StockCall | None = None) -> str:
    """The export's README: what loads it and the call that reproduces prunepipe's samples."""
    cfg = task.cfg
    weights = (
        "the EMA weights (the live ones as the `non_ema` variant)" if ema else "the run's weights (it kept no EMA)"
    )
    kind = (
        "text-conditional"
        if task.text_encoder is not None
        else "class-conditional"
        if cfg.num_classes
        else "unconditional"
    )
    lines = [
        f"# A prunepipe export: {kind} {type(unwrap(task.model)).__name__}, {cfg.objective}",
        "",
        f"`{MODEL_FOLDERS[cfg.backbone]}/` holds {weights}.",
        "",
    ]
    lines += _sizes_note(task)
    if pipeline is None:
        lines += [
            f"No diffusers pipeline samples it: {reason}.",
            "",
            "Sample it with `prunepipe sample EXPORT` (or `sample()` in pipelines/tasks/diffusion/from_export.py).",
            "",
        ]
        return "\n".join(lines)
    pixart_call = (
        f"pipe(prompt, num_inference_steps=50, max_sequence_length="
        f"{getattr(task.text_encoder, 'max_length', cfg.text.max_length)}, "
        f"use_resolution_binning=False, clean_caption=False)"
    )
    pipeline_call = {
        "DDPMPipeline": "pipe(batch_size=4, num_inference_steps=50)",
        "DiTPipeline": "pipe(class_labels=[0, 1, 2, 3], num_inference_steps=50, guidance_scale=1.0)",
        "PixArtAlphaPipeline": pixart_call,
        "PixArtSigmaPipeline": pixart_call,
    }[pipeline]
    model, folder = type(unwrap(task.model)).__name__, MODEL_FOLDERS[cfg.backbone]
    lines += ["```python", f"from diffusers import {pipeline}", "", f'pipe = {pipeline}.from_pretrained("EXPORT")']
    if ema:
        lines += [
            f'# the live weights instead: pipe.{folder} = {model}.from_pretrained("EXPORT", '
            f'subfolder="{folder}", variant="{RAW_VARIANT}")'
        ]
    if call is not None:
        code, prose = _stock_lines(call, pixart_call)
        lines += ['prompt = "a photograph"', *code, "```", "", *(f"{line}\n" for line in prose)]
    else:
        lines += [f"images = {pipeline_call}.images", "```", ""]
    if pipeline.startswith("PixArt"):
        lines += [
            "For prunepipe's samples, `max_sequence_length` is the caption length the run trained with and "
            "resolution binning is off (it knows PixArt's own sizes only). The pipeline lowercases prompts; "
            "`prunepipe sample` reads them as written, as the run did (they differ for a case-sensitive "
            "tokenizer such as T5's).",
            "",
        ]
    if pipeline == "PixArtAlphaPipeline" and task.size_conditions is not None:
        lines += [
            "The transformer takes PixArt-alpha's size conditions: PixArtAlphaPipeline passes the image's "
            "(height, width) and height / width for the size it draws."
            + (
                " Call it with num_inference_steps of 2 or more: at 1 it reads the scheduler step's second "
                "output, which flow's DPMSolverMultistepScheduler does not return."
                if cfg.objective == "flow"
                else ""
            ),
            "",
        ]
    if cfg.objective == "flow":
        lines += [
            "`scheduler/` is DPMSolverMultistepScheduler in its flow mode at first order: the Euler step "
            "x + (s' - s) v on the straight path, over s = (1 - 1/T)(1 - k/N), k < N, then 0, the model fed "
            "timestep floor(s T): the sampler prunepipe's FID and `prunepipe sample` use. "
            "`pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, solver_order=2)` "
            "samples with DPM-Solver++(2M) instead (fewer steps for the same quality, other images).",
            "",
        ]
    if pipeline == "DiTPipeline":
        lines += [
            f"DiTPipeline takes the null class as label 1000: guidance (guidance_scale > 1) is right only for "
            f"a 1000-class run (this one has {cfg.num_classes}); `prunepipe sample --guidance-scale` guides "
            f"any.",
            "",
        ]
    return "\n".join(lines)
