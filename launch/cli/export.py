"""`prunepipe export | sample`: a run's export written from a checkpoint (a diffusers pipeline folder, or
MAE's timm encoder; pipelines/trained.py), and images drawn from a diffusion run's export with the sampler
FID uses (pipelines/tasks/diffusion/from_export.py)."""

from __future__ import annotations

import os

from prunepipe.launch.cli.options import add_run_arguments


def add_commands(sub, argv: list[str]) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's export from a checkpoint: a diffusers pipeline folder "
        "(model_index.json) or MAE's timm encoder",
    )
    add_run_arguments(export)
    export.add_argument("--checkpoint", default="latest", help="latest or a checkpoint folder")
    export.add_argument("--out", help="the export folder (default: RUN/export, what the run writes when it ends)")
    export.add_argument(
        "--copy",
        action="store_true",
        help="copy the VAE and text encoder into the export instead of linking them (relative links)",
    )
    export.set_defaults(func=_export)

    sample = sub.add_parser("sample", help="draw images from a diffusion run's export with the sampler FID uses")
    sample.add_argument("run", help="run folder or name (its export/), or an export folder")
    sample.add_argument("--prompt", action="append", help="a caption (text-conditional runs; repeat for several)")
    sample.add_argument(
        "--class-label",
        type=int,
        action="append",
        help="a class (class-conditional runs; repeat for several; -1 = the null class)",
    )
    sample.add_argument(
        "--num-images",
        type=int,
        help="images to draw (default: one per prompt or class label, else 4); prompts and labels repeat to fill it",
    )
    sample.add_argument("--steps", type=int, default=50, help="DDIM steps (Euler for flow runs)")
    sample.add_argument(
        "--guidance-scale",
        type=float,
        default=1.0,
        help="classifier-free guidance against the null class or the empty caption (1 = none)",
    )
    sample.add_argument("--seed", type=int, default=0, help="the starting noise")
    sample.add_argument("--raw", action="store_true", help="the live weights instead of the EMA")
    sample.add_argument(
        "--vae", help="decode with this VAE (folder or hub repo id in the cache) instead of the export's"
    )
    sample.add_argument(
        "--text-encoder",
        help="encode prompts with this folder instead of the export's (its digest must match the run's)",
    )
    sample.add_argument("--out", help="folder for the PNGs (default: samples/ beside the export)")
    sample.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    sample.add_argument("--runs-dir", default="runs")
    sample.set_defaults(func=_sample)


def _export(args) -> None:
    """A run's export from a checkpoint: a diffusers pipeline folder (diffusion) or the timm encoder (MAE)."""
    from prunepipe.pipelines.trained import export_run

    out, written = export_run(args.run, args.checkpoint, out=args.out or "", runs_dir=args.runs_dir, copy=args.copy)
    for path in written:
        print(f"written: {path}")
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        with open(readme) as f:
            print(f.read().rstrip())


def _sample(args) -> None:
    """Images from a run's export (or an export folder), as PNG files."""
    import torch
    from PIL import Image

    from prunepipe.pipelines.tasks.diffusion.from_export import sample

    export = args.run
    if not os.path.exists(os.path.join(export, "autoencoder.json")):
        from prunepipe.pipelines.evaluation.records import resolve_run_dir

        export = os.path.join(resolve_run_dir(args.run, args.runs_dir), "export")
        if not os.path.isdir(export):
            raise FileNotFoundError(
                f"run {args.run}: no export/ yet (a run writes it when it finishes): write one from "
                f"its newest checkpoint with `prunepipe export {args.run}`"
            )
    prompts = list(args.prompt or [])
    count = args.num_images or len(prompts) or len(args.class_label or []) or 4
    if prompts:
        prompts = [prompts[i % len(prompts)] for i in range(count)]
    labels = None
    if args.class_label:
        labels = torch.tensor([args.class_label[i % len(args.class_label)] for i in range(count)])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    images = sample(
        export,
        count,
        args.steps,
        torch.Generator(device).manual_seed(args.seed),
        ema=not args.raw,
        class_labels=labels,
        vae=args.vae,
        guidance_scale=args.guidance_scale,
        prompts=prompts or None,
        text_encoder=args.text_encoder,
    )
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(export)), "samples")
    os.makedirs(out, exist_ok=True)
    pixels = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype("uint8")
    for i, image in enumerate(pixels):
        path = os.path.join(out, f"sample_{args.seed:04d}_{i:03d}.png")
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)
        caption = f"  {prompts[i]!r}" if prompts else f"  class {int(labels[i])}" if labels is not None else ""
        print(f"written: {path}{caption}")
    from prunepipe.pipelines.tasks.diffusion.stock_call import stock_call

    call = stock_call(export)
    if call is not None:  # the same export in diffusers, as its README.md says
        why = f" ({'; '.join(call.reasons)})" if call.reasons else ""
        print(f"in diffusers: {call.pipeline}.from_pretrained({export!r}), then {call.call()}{why}")
