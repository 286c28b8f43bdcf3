"""The `prunepipe` command line: one subcommand per job, each a thin call into the library."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import TYPE_CHECKING

from prunepipe.tools.commands.redundant_options import add_redundant_arguments, redundant_options

if TYPE_CHECKING:  # imported where used: a subcommand's startup pays only for what it runs
    from prunepipe.pipelines.data.remote import ReadRetry

DEFAULT_DATA = "data/digits"


class DefaultsShown(argparse.HelpFormatter):
    """--help names each option's default where it has one and its help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = (
            action.default is None
            or action.default is False
            or action.default == []
            or action.default is argparse.SUPPRESS
        )
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """The parser of every (sub)command: argparse's, with the defaults shown (subparsers take their parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("help") is None and kwargs.get("default") not in (None, False):
            kwargs["help"] = "(default: %(default)s)"  # argparse prints no help line for an option without help
        return super().add_argument(*args, **kwargs)


def _shards_write(args) -> None:
    from prunepipe.tools.commands.shards import write_shards

    paths = write_shards(
        args.source,
        args.out,
        size=args.resolution,
        shard_size=args.shard_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        folder=args.folder,
        crops_per_photo=args.crops_per_photo,
        workers=args.workers,
        **(redundant_options(args) if args.source == "redundant" else {}),
        captions=args.captions,
        aspects=args.aspects,
        square=args.square,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


def _text_encoder_tiny(args) -> None:
    from prunepipe.pipelines.data.shards import BadInputError
    from prunepipe.pipelines.data.splits import read_captions
    from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

    hint = "write them with `prunepipe shards write --captions`"
    try:
        captions = [text for folder in args.shards for text in read_captions(folder)]
    except BadInputError as e:  # a sample without a caption
        raise SystemExit(f"{e}: {hint}") from None
    if not captions:
        raise SystemExit(f"no captions (txt fields) in {', '.join(args.shards)}: {hint}")
    path = write_tiny_text_encoder(
        args.out, captions, hidden_size=args.hidden_size, layers=args.layers, max_length=args.max_length, seed=args.seed
    )
    print(
        f"{path}: a tiny CLIP text model (random weights) and the tokenizer of {len(captions)} captions' words; "
        f"set ldm.text.encoder={path} ldm.text.max_length={args.max_length}"
    )


def _vae_tiny(args) -> None:
    from prunepipe.tools.fixtures.tiny_vae import write_tiny_vae

    path = write_tiny_vae(args.out, channels=args.channels, levels=args.levels, seed=args.seed)
    print(f"{path}: a tiny AutoencoderKL (random weights, {2 ** (args.levels - 1)}x downsampling); --vae {path}")


def _shards_index(args) -> None:
    from prunepipe.pipelines.data.shards import ShardIndex
    from prunepipe.tools.commands.shards import index_shards

    path = index_shards(
        args.shards, args.out, workers=args.workers, verify=args.verify, checksums=not args.no_checksums
    )
    index = ShardIndex.load(path)
    counted = index.meta["counted"]
    print(
        f"{path}: {len(index)} shards, {index.num_samples} samples; "
        f"{counted['img2dataset_stats']} shard(s) counted from img2dataset's *_stats.json"
        + (" (--verify to count their tar headers too)" if counted["img2dataset_stats"] and not args.verify else "")
        + f", {counted['tar_headers_read']} from their tar headers"
        + ("; sizes recorded, no CRC-32 (--no-checksums)" if args.no_checksums else "; sizes and CRC-32s recorded")
    )
    if args.aspect or args.buckets:
        from prunepipe.tools.commands.aspect_buckets import histogram_lines, load_buckets
        from prunepipe.tools.commands.shards import aspect_counts

        table = load_buckets(args.buckets) if args.buckets else None
        histogram = aspect_counts(args.shards, table, workers=args.workers)
        print(f"aspect ratios of {histogram.total} samples, from their json's width and height:")
        print("\n".join(histogram_lines(histogram, table)))


def _shards_verify(args) -> int:
    """Each shard's bytes against index.json: a line per bad shard, a summary, exit 1 when any is bad."""
    from prunepipe.tools.commands.shards import verify_shards

    checked, bad, read = {"size and crc32": 0, "size": 0, "nothing": 0}, 0, 0
    for check in verify_shards(args.location, workers=args.workers, retry=read_retry(args)):
        checked[check.checked] += 1
        read += check.bytes_read
        if check.problem is not None:
            bad += 1
            print(f"shard {check.url}: {check.problem}", flush=True)
    shards = sum(checked.values())
    hint = " (index.json records neither size nor CRC-32: index them again with `prunepipe shards index`)"
    print(
        f"{args.location}: {shards} shard(s), {bad} bad; {checked['size and crc32']} checked by size and CRC-32, "
        f"{checked['size']} by size alone, {checked['nothing']} not checked"
        + (hint if checked["nothing"] else "")
        + f"; {read / 2**20:.1f} MiB read"
    )
    return 1 if bad else 0


def _shards_inspect(args) -> None:
    from prunepipe.tools.commands.shards import inspect_shards

    print(json.dumps(inspect_shards(args.location, args.grid), indent=1))


def _shards_embed(args) -> None:
    from prunepipe.pipelines.data.side_tables import open_embeddings
    from prunepipe.tools.commands.embed import embed_shards

    path = embed_shards(
        args.location,
        args.model,
        weights=args.weights,
        name=args.out,
        batch_size=args.batch_size,
        image_size=args.image_size,
        device=args.device,
        on_bad_sample=args.on_bad_sample,
        rank=args.rank,
        world=args.world,
        wait_hours=args.wait_hours,
        retry=read_retry(args),
    )
    if path is None:
        return
    table = open_embeddings(args.location, os.path.basename(path)[: -len(".npy")])
    print(
        f"{path}: {len(table)} x {table.dim} float16 rows by {table.header['model']}; "
        f"{table.header['missing']['count']} sample(s) without an embedding"
    )


def _shards_import_embeddings(args) -> None:
    from prunepipe.tools.commands.embedding_import import import_embeddings

    summary = import_embeddings(
        args.location,
        args.source,
        format=args.format,
        name=args.out,
        embedding=args.embedding,
        sample_key=args.sample_key,
    )
    print(
        f"{summary['path']}: {summary['matched']} of {summary['samples']} samples joined by key; "
        f"{summary['missing']} without an embedding"
        + (f" (first keys: {', '.join(map(repr, summary['missing_first_keys']))})" if summary["missing"] else "")
        + f"; {summary['rows_matching_no_sample']} imported row(s) named no sample of this split"
    )


def _shards_dedup(args) -> None:
    from prunepipe.tools.commands.dedup import dedup_shards, report_lines

    report = dedup_shards(
        args.location,
        args.embeddings,
        args.threshold,
        clusters=args.clusters,
        report_thresholds=args.report_thresholds,
        out=args.out,
        picture=not args.no_picture,
        spill=not args.no_spill,
        seed=args.seed,
    )
    print("\n".join(report_lines(report)))


def _train(args) -> None:
    from prunepipe.pipelines.config import load_config

    cfg = load_config(args.config, args.overrides)  # a mistake in it is told before torch is imported
    from prunepipe.pipelines.training.loop import train

    train(cfg)  # which checks the data the config names first, on every rank
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run folder: {cfg.run_dir}")


def _configs(args) -> None:
    from prunepipe.launch.configs import CONFIGS

    print(CONFIGS)


def _latents_encode(args) -> None:
    from prunepipe.tools.commands.latents import encode_shards

    path = encode_shards(
        args.shards,
        args.vae,
        args.out,
        resolution=args.resolution,
        batch_size=args.batch_size,
        subfolder=args.subfolder,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        flip=args.flip,
        text_encoder=args.text_encoder,
        tokenizer=args.tokenizer,
        text_max_length=args.text_max_length,
        on_bad_sample=args.on_bad_sample,
        rank=args.rank,
        world=args.world,
        wait_hours=args.wait_hours,
        retry=read_retry(args),
        buckets=args.buckets,
    )
    if path:
        print(path)


def add_read_retry_arguments(parser: argparse.ArgumentParser) -> None:
    """How a `pipe:`, http(s) or object-store shard's failed read is retried: the run config's
    `data.remote` fields (pipelines/data/remote.py:ReadRetry), with its defaults."""
    from prunepipe.pipelines.data.remote import ReadRetry

    default = ReadRetry()
    parser.add_argument(
        "--read-retries",
        type=int,
        default=default.retries,
        help="reopens of a remote shard within one stall of its read, as data.remote.retries (0: fail at once)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=default.timeout_seconds,
        help="seconds without a byte that fail an attempt, as data.remote.timeout_seconds",
    )
    parser.add_argument(
        "--read-deadline",
        type=float,
        default=default.deadline_seconds,
        help="the most seconds one stall may block the reader, as data.remote.deadline_seconds",
    )


def read_retry(args) -> ReadRetry:
    """The ReadRetry the --read-* flags give (`add_read_retry_arguments`), checked."""
    from prunepipe.pipelines.data.remote import ReadRetry

    retry = ReadRetry(retries=args.read_retries, timeout_seconds=args.read_timeout, deadline_seconds=args.read_deadline)
    try:
        retry.check()
    except ValueError as e:
        raise ValueError(f"--read-retries/--read-timeout/--read-deadline: {e}") from None
    return retry


def add_job_arguments(parser: argparse.ArgumentParser, on_bad_sample: str, skip_means: str, bad: str) -> None:
    """The options of a preprocessing job split over processes (tools/commands/shard_jobs.py)."""
    parser.add_argument(
        "--rank",
        type=int,
        help="this process's share without torchrun, e.g. a SLURM array's "
        "$SLURM_ARRAY_TASK_ID (default: torchrun's RANK, then SLURM's)",
    )
    parser.add_argument("--world", type=int, help="the number of shares, with --rank")
    parser.add_argument(
        "--on-bad-sample",
        choices=("stop", "skip"),
        default=on_bad_sample,
        help=f"a sample that {bad}: stop naming shard and key, or skip ({skip_means}) (default: %(default)s)",
    )
    parser.add_argument(
        "--wait-hours",
        type=float,
        default=6.0,
        help="under torchrun: how long the ranks wait for the slowest one's shards before the index "
        "is written (default: %(default)s)",
    )


def _demo(args) -> None:
    """A pruned run, its full baseline and a full run of equal compute on the digits; the verdicts."""
    from prunepipe.launch.demo import run_demo

    run_demo(args.data, args.name, passes=args.passes, overrides=args.overrides, seeds=args.seeds)


def _checkpoints_verify(args) -> int:
    """Each checkpoint of a run, newest first: ok, or what is wrong with which file."""
    from prunepipe.pipelines.checkpoint.manifest import verify
    from prunepipe.pipelines.checkpoint.store import TMP_PREFIX, checkpoints_dir, complete_checkpoints
    from prunepipe.pipelines.evaluation.records import resolve_run_dir

    run_dir = resolve_run_dir(args.run, args.runs_dir)
    found = complete_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"run {run_dir}: no checkpoint in {checkpoints_dir(run_dir)}")
    verdicts = [verify(folder) for folder in reversed(found)]
    for verdict in verdicts:
        print(verdict.describe())
    folder = checkpoints_dir(run_dir)
    for name in sorted(os.listdir(folder)):
        if name.startswith(TMP_PREFIX):
            print(f"{name}: an interrupted save (never resumed from; the next save removes it)")
    damaged = [v for v in verdicts if v.problem is not None]
    intact = [v for v in verdicts if v.problem is None]
    print(
        f"{len(found)} checkpoint(s), {len(damaged)} damaged; checkpoint.resume=latest takes "
        + (os.path.basename(intact[0].folder) if intact else "none (no intact checkpoint)")
    )
    return 1 if damaged else 0


def _eval(args) -> None:
    """Evaluate a checkpoint of a run; writes RUN/eval/step_XXXXXX.json."""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.evaluation.config import EvalConfig, load_eval_config
    from prunepipe.pipelines.evaluation.needs import plan_evaluation
    from prunepipe.pipelines.evaluation.records import resolve_run_dir

    overrides = list(args.overrides)
    for option, key in (
        ("fid_samples", "fid.num_samples"),
        ("fid_steps", "fid.sampler_steps"),
        ("fid_feature", "fid.feature"),
        ("fid_weights", "fid.weights"),
        ("weights", "weights"),
    ):
        if getattr(args, option) is not None:
            overrides.append(f"{key}={getattr(args, option)}")
    # the settings and what they need, checked before torch and the model load: a typo or every missing
    # piece is told at once
    run_dir = resolve_run_dir(args.run, args.runs_dir)
    run_cfg = load_config(os.path.join(run_dir, "config.yaml"))
    eval_cfg = load_eval_config(getattr(run_cfg, "eval", None) or EvalConfig(), args.eval_config, overrides)
    plan_evaluation(run_cfg, eval_cfg, run_dir if args.checkpoint == "latest" else "")
    from prunepipe.pipelines.evaluation.runner import evaluate_checkpoint

    record = evaluate_checkpoint(
        run_dir,
        args.checkpoint,
        eval_cfg,
        runs_dir=args.runs_dir,
        device=args.device,
        overwrite=args.overwrite,
    )
    print(json.dumps(record["metrics"], indent=1))
    for key, reason in record["details"].items():
        if key.endswith("_skipped"):
            print(f"{key.removesuffix('_skipped')} skipped: {reason}")
    at = f" ({record['pass']})" if record.get("pass") else ""
    print(
        f"evaluated the {record['weights']} weights of {record.get('checkpoint', 'the checkpoint')}{at} "
        f"at {record['precision']}"
    )
    print(f"written: {record.get('path')}")


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


def _compare(args) -> None:
    """Losslessness report of pruned runs against a baseline (one or several seed runs)."""
    import glob

    from prunepipe.pipelines.evaluation.records import resolve_run_dir
    from prunepipe.pipelines.report.compare import compare_runs

    def runs(specs):
        found = []
        for spec in specs:
            for part in filter(None, spec.split(",")):
                matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
                found += [resolve_run_dir(m, args.runs_dir) for m in matches]
        return found

    report = compare_runs(
        runs([args.baseline]),
        runs(args.pruned),
        same_compute=runs(args.same_compute),
        frontier=runs(args.frontier),
        tolerances=args.tolerance,
        k=args.k,
        out=args.out,
        weights=args.weights,
        plots=not args.no_plots,
    )
    print(report["markdown"])
    print(
        f"written: {report['out']}/report.md, report.json"
        + "".join(f", {os.path.basename(p)}" for p in report["plots"])
    )


# `prunepipe bench NAME`: the module in tools/benchmarks/ (its add_arguments and run_from_args) and the help line
BENCHES = {
    "lossless": (
        "prunepipe.tools.benchmarks.lossless.run",
        "is pruning lossless, and better than training less? writes docs/benchmarks/lossless_MODE.md",
    ),
    "scores": (
        "prunepipe.tools.benchmarks.score_noise",
        "how much of a run's per-sample scores is the sample, and how much the "
        "mask or timestep drawn; what its pruner skips",
    ),
    "throughput": (
        "prunepipe.tools.benchmarks.throughput",
        "samples/s of the project loop against a bare loop, same model and batch, for mae, ldm and dit",
    ),
    "scale": (
        "prunepipe.tools.benchmarks.scale",
        "pruning at 1e8-1e9 samples: bytes per sample per node and per rank, plan + "
        "layout time for a simulated world, pruner state save/load",
    ),
    "buckets": (
        "prunepipe.tools.benchmarks.bucket_layout",
        "a bucketed pass at scale beside the same samples unbucketed: tars, index bytes, layout time and tail",
    ),
    "dedup-quality": (
        "prunepipe.tools.benchmarks.dedup_quality",
        "precision and recall of shards dedup's duplicate pairs on the bundled redundant set, whose copies are known",
    ),
    "encode": (
        "prunepipe.tools.benchmarks.encode_ranks",
        "latents encode on one process and on two torchrun ranks, side by side; a SIGKILLed encode's rerun",
    ),
    "remote": (
        "prunepipe.tools.benchmarks.remote_reads",
        "pipe: shards through the retrying reader against webdataset's "
        "gopen; a command failing once per shard; a hanging one",
    ),
    "memory": (
        "prunepipe.tools.benchmarks.memory",
        "per GPU under ddp and fsdp, with and without activation checkpointing: weights, grads, AdamW, EMA, text "
        "encoder, activations per sample (models built on `meta`) and the largest batch that fits",
    ),
    "compile": (
        "prunepipe.tools.benchmarks.compile_check",
        "cuda.compile (inductor, per DiT block) beside eager: compilation time, step time, and whether a compiled "
        "run repeats and resumes bit for bit",
    ),
    "datapath": (
        "prunepipe.tools.benchmarks.datapath",
        "MAE's 224 px crop and flip from JPEG shards, img/s a core: the project's path, the MAE "
        "repository's, torchvision uint8 and decode alone; the cores a GPU needs",
    ),
    "dedup-scale": (
        "prunepipe.tools.benchmarks.dedup_scale",
        "shards dedup at 1e6 planted embeddings of 512 dims: wall time, peak RSS, precision and recall",
    ),
}


def _bench(args) -> int:
    """The benchmark named on the command line (tools/benchmarks/)."""
    return importlib.import_module(BENCHES[args.bench_command][0]).run_from_args(args) or 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line; a benchmark's own options are imported only when `argv` names it (some
    import torch and diffusers, seconds that every other command would pay)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="prunepipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    shards = sub.add_parser(
        "shards", help="write, index and inspect WebDataset shards; embed them and find near-duplicates"
    )
    shards_sub = shards.add_subparsers(dest="shards_command", required=True)
    write = shards_sub.add_parser("write", help="write train/val shards from bundled data or a folder")
    write.add_argument(
        "--source",
        choices=("digits", "photos", "redundant", "folder"),
        default="digits",
        help="redundant: photo crops of which a fraction are copies (near, exact, re-encoded, "
        "cropped; evenly or heavy-tailed over the originals), with a clean val and an "
        "in-distribution val_mix",
    )
    write.add_argument("--out", required=True, help="output folder (gets train/ and val/)")
    write.add_argument("--folder", help="image folder, for --source folder")
    write.add_argument(
        "--resolution",
        type=int,
        default=32,
        help="image side in pixels, as in `latents encode --resolution` and data.resolution",
    )
    write.add_argument("--shard-size", type=int, default=500, help="samples per shard")
    write.add_argument("--val-fraction", type=float, default=0.1)
    write.add_argument("--crops-per-photo", type=int, default=250, help="for --source photos and redundant")
    add_redundant_arguments(write)
    write.add_argument(
        "--seed", type=int, default=0, help="the val split, the photo crops, and the sample order of --source folder"
    )
    write.add_argument(
        "--workers",
        type=int,
        default=None,
        help="for --source folder --square: processes decoding and resizing images (default: the usable "
        "cores; 0 or 1: this process)",
    )
    write.add_argument(
        "--square",
        action="store_true",
        help="for --source folder: decode each image and write its centre square at --resolution as PNG; "
        "without it each file's bytes are written as they are (a JPEG stays a JPEG, uncropped, as "
        "img2dataset writes them) and training crops the whole image",
    )
    write.add_argument(
        "--captions",
        action="store_true",
        help="for --source digits and photos: img2dataset-style image-text pairs (jpg, txt, json), "
        "captioned from the digit or the photograph and the crop's place",
    )
    write.add_argument(
        "--aspects",
        action="store_true",
        help="with --source photos --captions: crops at 1:1, 2:1, 1:2 and 4:3 (width:height), shorter side "
        "--resolution, each kept at its own aspect ratio (data for `latents encode --buckets`)",
    )
    write.set_defaults(func=_shards_write)
    index = shards_sub.add_parser("index", help="write index.json for shards written elsewhere")
    index.add_argument("shards", nargs="+", help="folders, globs, brace patterns or urls of .tar shards")
    index.add_argument("--out", required=True, help="folder for index.json")
    index.add_argument(
        "--workers",
        type=int,
        default=None,
        help="shards read at a time, in threads (default: the usable cores; more for remote "
        "storage, where waiting dominates)",
    )
    index.add_argument(
        "--verify",
        action="store_true",
        help="count the tar headers of shards that have img2dataset's *_stats.json too; they must agree",
    )
    index.add_argument(
        "--no-checksums",
        action="store_true",
        help="record each shard's size (a stat) but not its CRC-32, which reads every byte of a shard "
        "whose count did not (large local members, img2dataset's stats files): for huge local folders",
    )
    index.add_argument(
        "--aspect",
        action="store_true",
        help="also print the samples' aspect-ratio histogram (count, share) from each sample's img2dataset json "
        "width/height (else original_width/original_height), no image decoded; without them: unknown",
    )
    index.add_argument(
        "--buckets",
        default="",
        metavar="NAME|FILE",
        help="count the histogram per bucket of this table (implies --aspect; as `latents encode --buckets`), "
        "not per common ratio",
    )
    index.set_defaults(func=_shards_index)
    check = shards_sub.add_parser(
        "verify",
        help="read every shard and check its size and CRC-32 against index.json (exit 1 when any is bad)",
    )
    check.add_argument("location", help="folder with index.json (or the index file)")
    check.add_argument(
        "--workers",
        type=int,
        default=None,
        help="shards read at a time, in threads (default: the usable cores; more for remote storage)",
    )
    add_read_retry_arguments(check)
    check.set_defaults(func=_shards_verify)
    inspect = shards_sub.add_parser("inspect", help="counts, fields, labels and a PNG grid")
    inspect.add_argument("location", help="folder with index.json")
    inspect.add_argument("--grid", help="write a PNG grid of the first images here")
    inspect.set_defaults(func=_shards_inspect)
    embed = shards_sub.add_parser(
        "embed", help="one L2-normalised float16 embedding per sample, beside index.json (resumable)"
    )
    embed.add_argument("location", help="split folder with index.json (gets embeddings/NAME.npy and NAME.json)")
    embed.add_argument(
        "--model",
        required=True,
        help="timm:ARCH (with --weights FILE), timm:FOLDER (config.json + weights), mae:RUN_OR_EXPORT_DIR, "
        "feature-net[:FILE], or phash[:SIDE] (the model-free perceptual hash: SIDE x SIDE bits, "
        "8 by default)",
    )
    embed.add_argument("--weights", help="for timm:ARCH: a local .safetensors or .pth file (nothing is downloaded)")
    embed.add_argument("--batch-size", type=int, default=64)
    embed.add_argument("--image-size", type=int, help="decode side (default: the model's input size)")
    embed.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    embed.add_argument(
        "--out", help="the embeddings' name (default from the model: phash, feature-net, timm-ARCH, ...)"
    )
    add_job_arguments(embed, "skip", "a zero row, listed as missing; no id moves", "cannot be read or decoded")
    add_read_retry_arguments(embed)
    embed.set_defaults(func=_shards_embed)
    imports = shards_sub.add_parser(
        "import-embeddings",
        help="embeddings a web dataset ships (clip-retrieval, DataComp), joined to the samples by key",
    )
    imports.add_argument("location", help="split folder with index.json")
    imports.add_argument("--format", required=True, choices=("clip-retrieval", "datacomp"))
    imports.add_argument(
        "--from",
        dest="source",
        required=True,
        help="clip-retrieval: the folder holding img_emb/ and metadata/; datacomp: the folder of "
        "STEM.parquet + STEM.npz",
    )
    imports.add_argument("--embedding", default="l14_img", choices=("l14_img", "b32_img"), help="for datacomp")
    imports.add_argument(
        "--sample-key",
        help="what a sample is joined by: key (its WebDataset key; clip-retrieval's "
        "default) or json:FIELD (a field of its .json; datacomp's default "
        "json:uid)",
    )
    imports.add_argument("--out", help="the embeddings' name (default: the format's)")
    imports.set_defaults(func=_shards_import_embeddings)
    dedup = shards_sub.add_parser(
        "dedup",
        help="near-duplicate groups from embeddings: spherical k-means, exact "
        "inner-product pairs per cluster, connected components",
    )
    dedup.add_argument("location", help="split folder with index.json and embeddings/")
    dedup.add_argument("--embeddings", required=True, help="name of the embeddings (embeddings/NAME.npy)")
    dedup.add_argument(
        "--threshold",
        type=float,
        required=True,
        help="inner product of normalised rows at or above which two samples are near-duplicates "
        "(phash: 1 - 2 * hamming / 64, so 0.74 keeps hamming <= 8)",
    )
    dedup.add_argument("--clusters", type=int, help="k-means clusters (default: sqrt of the samples)")
    dedup.add_argument(
        "--report-thresholds",
        type=float,
        nargs="+",
        default=[0.8, 0.85, 0.9, 0.95, 0.98],
        help="thresholds the report also counts groups at (the same pairwise similarities)",
    )
    dedup.add_argument("--out", help="the groups' name (default: EMBEDDINGS_THRESHOLD)")
    dedup.add_argument("--no-picture", action="store_true", help="skip the PNG of a few groups")
    dedup.add_argument(
        "--no-spill",
        action="store_true",
        help="search each cluster alone (SemDeDup); by default a cluster's search also holds the rows "
        "whose second-nearest centroid it is, which finds pairs split across two clusters",
    )
    dedup.add_argument("--seed", type=int, default=0, help="k-means and the picture's random groups")
    dedup.set_defaults(func=_shards_dedup)

    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config", help="YAML config (`prunepipe configs` prints the folder of the shipped ones)")
    train.add_argument("overrides", nargs="*", help="key=value, e.g. pruner.prune_ratio=0.3 data.batch_size=64")
    train.set_defaults(func=_train)

    configs = sub.add_parser(
        "configs", help="print the folder of the shipped YAML configs: prunepipe train $(prunepipe configs)/NAME.yaml"
    )
    configs.set_defaults(func=_configs)

    latents = sub.add_parser("latents", help="precompute VAE latents (and text features) of image shards")
    latents_sub = latents.add_subparsers(dest="latents_command", required=True)
    encode = latents_sub.add_parser("encode", help="image shards -> latent shards with the same ids")
    encode.add_argument("shards", help="image shard folder (with index.json)")
    encode.add_argument("--vae", required=True, help="local AutoencoderKL folder or a hub repo id in the cache")
    encode.add_argument("--out", required=True, help="output folder for the latent shards")
    encode.add_argument(
        "--resolution",
        type=int,
        help="image side fed to the VAE (default: the size the image shards' index.json records); with --buckets, "
        "the square base side latent_shape records (default: a named table's, e.g. 512 for pixart512)",
    )
    encode.add_argument("--subfolder", default="", help="e.g. vae, inside a Stable Diffusion repo")
    encode.add_argument("--cache-dir", default="", help="hub cache holding --vae (default: HF_HUB_CACHE)")
    encode.add_argument("--batch-size", type=int, default=32, help="images a VAE call (default: %(default)s)")
    encode.add_argument(
        "--dtype",
        default="float16",
        choices=("float16", "float32"),
        help="of the stored latents and text features (default: %(default)s)",
    )
    encode.add_argument(
        "--flip",
        action="store_true",
        help="also store each mirrored image's latent, for data.hflip runs (twice the encoding)",
    )
    encode.add_argument(
        "--text-encoder",
        default="",
        help="local CLIP text or T5 encoder folder: also store each caption's features (text.npy, "
        "real tokens only) for ldm.text.features=precomputed",
    )
    encode.add_argument("--tokenizer", default="", help="its tokenizer's folder (default: the encoder's)")
    encode.add_argument(
        "--text-max-length",
        type=int,
        help="tokens per caption, as ldm.text.max_length (default: the encoder's, CLIP 77; PixArt-alpha's T5 uses 120)",
    )
    encode.add_argument(
        "--buckets",
        default="",
        metavar="NAME|FILE",
        help="cut each image to its nearest aspect-ratio bucket, not the square: diffusers' PixArt table "
        "pixart256|pixart512|pixart1024|pixart2048 (or 256|512|1024|2048), or a file of sizes (HxW a line, or a "
        "JSON list of [h, w]); one tar per bucket of each shard, its latents [C, H/f, W/f] (docs/data.md)",
    )
    add_job_arguments(
        encode,
        "stop",
        "left out and listed in OUT/skipped.json; every later sample's id moves "
        "down, so embeddings or groups made on the image shards no longer line up",
        "cannot be read or decoded, or has no caption (txt, or json's 'caption') where one is needed",
    )
    add_read_retry_arguments(encode)
    encode.set_defaults(func=_latents_encode)

    text = sub.add_parser("text-encoder", help="text encoders for ldm.conditioning=text")
    text_sub = text.add_subparsers(dest="text_encoder_command", required=True)
    tiny = text_sub.add_parser(
        "tiny",
        help="a tiny random CLIP text model and a word-level tokenizer of the "
        "shards' captions, for CPU tests and demos",
    )
    tiny.add_argument("shards", nargs="+", help="captioned shard folders (with index.json) whose words it knows")
    tiny.add_argument("--out", required=True, help="output folder (ldm.text.encoder)")
    tiny.add_argument("--hidden-size", type=int, default=32)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--max-length", type=int, default=16, help="tokens per caption (ldm.text.max_length)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_text_encoder_tiny)

    vae = sub.add_parser("vae", help="autoencoders for ldm.space=vae and latents encode")
    vae_sub = vae.add_subparsers(dest="vae_command", required=True)
    tiny_vae = vae_sub.add_parser("tiny", help="a tiny random AutoencoderKL folder, for CPU tests and recipes")
    tiny_vae.add_argument("--out", required=True, help="output folder (ldm.vae, latents encode --vae)")
    tiny_vae.add_argument("--channels", type=int, default=3, help="image channels (default: %(default)s)")
    tiny_vae.add_argument(
        "--levels", type=int, default=2, help="resolution levels: downsampling 2**(levels-1) (default: %(default)s)"
    )
    tiny_vae.add_argument("--seed", type=int, default=0)
    tiny_vae.set_defaults(func=_vae_tiny)

    checkpoints = sub.add_parser("checkpoints", help="check a run's checkpoints against their manifests")
    checkpoints_sub = checkpoints.add_subparsers(dest="checkpoints_command", required=True)
    verify = checkpoints_sub.add_parser(
        "verify", help="each checkpoint: ok, or which file is damaged and how (exit 1 when any is)"
    )
    verify.add_argument("run", help="run folder (holding config.yaml) or run name under --runs-dir")
    verify.add_argument("--runs-dir", default="runs")
    verify.set_defaults(func=_checkpoints_verify)

    demo = sub.add_parser("demo", help="pruned vs full vs equal-compute full on the bundled digits, on CPU")
    demo.add_argument("--data", default=DEFAULT_DATA)
    demo.add_argument(
        "--name",
        default="demo_mae",
        help="run name prefix: NAME_infobatch[_sN], NAME_full_sN, NAME_full_short[_sN], NAME_full_half[_sN]",
    )
    demo.add_argument(
        "--passes",
        type=int,
        default=25,
        help="passes of the full schedule (0: the tiny config's 40; 12 runs of it take about 6 "
        "minutes on 2 cores, 25 passes about 3)",
    )
    demo.add_argument(
        "--seeds", type=int, default=3, help="seeds of the pruned run and its Full runs (>= 2 for an interval)"
    )
    demo.add_argument("overrides", nargs="*", help="key=value config overrides")
    demo.set_defaults(func=_demo)

    evaluate = sub.add_parser("eval", help="evaluate a run's checkpoint: reconstruction, probe, denoising loss, FID")
    evaluate.add_argument("run", help="run folder (holding config.yaml) or run name under --runs-dir")
    evaluate.add_argument("--checkpoint", default="latest", help="latest (default) or a checkpoint folder")
    evaluate.add_argument("--fid-samples", type=int, help="generated images for FID (fid.num_samples)")
    evaluate.add_argument("--fid-steps", type=int, help="DDIM steps (fid.sampler_steps)")
    evaluate.add_argument("--fid-feature", help="inception | classifier | module:pkg.mod:factory (fid.feature)")
    evaluate.add_argument("--fid-weights", help="the FID feature network's weights file (fid.weights)")
    evaluate.add_argument("--weights", choices=("ema", "raw"), help="evaluate the EMA (default) or raw weights")
    evaluate.add_argument("--eval-config", help="YAML with evaluation settings (see pipelines/evaluation/config.py)")
    evaluate.add_argument("--runs-dir", default="runs")
    evaluate.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    evaluate.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier evaluation of the same checkpoint and weights "
        "(RUN/eval/step_XXXXXX[_raw].json); without it such a file stops the evaluation "
        "before it starts",
    )
    evaluate.add_argument(
        "overrides",
        nargs="*",
        help="key=value evaluation settings right after RUN, e.g. fid.reference=val probe.pool=avg",
    )
    evaluate.set_defaults(func=_eval)

    export = sub.add_parser(
        "export",
        help="write a run's export from a checkpoint: a diffusers pipeline folder "
        "(model_index.json) or MAE's timm encoder",
    )
    export.add_argument("run", help="run folder (holding config.yaml) or run name under --runs-dir")
    export.add_argument("--checkpoint", default="latest", help="latest or a checkpoint folder")
    export.add_argument("--out", help="the export folder (default: RUN/export, what the run writes when it ends)")
    export.add_argument(
        "--copy",
        action="store_true",
        help="copy the VAE and text encoder into the export instead of linking them (relative links)",
    )
    export.add_argument("--runs-dir", default="runs")
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

    compare = sub.add_parser(
        "compare",
        help="was a pruned run lossless, and how much compute did it save at equal "
        "quality? tables, verdicts, cost, PNG plots",
    )
    compare.add_argument(
        "baseline", help="baseline run(s): a folder or name; several seeds comma-separated or as a glob"
    )
    compare.add_argument("pruned", nargs="+", help="pruned run(s) to judge")
    compare.add_argument(
        "--same-compute",
        nargs="*",
        default=[],
        help="full runs trained for about the pruned runs' samples forwarded (the equal-compute reference)",
    )
    compare.add_argument(
        "--frontier",
        nargs="*",
        default=[],
        help="Full runs of other schedule lengths (e.g. 'runs/full_p*_s*'): with the baseline and "
        "--same-compute runs, each seed's quality-vs-compute curve, from which the compute "
        "saved at equal quality is read (paired by seed)",
    )
    compare.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="METRIC=VALUE[%]",
        help="e.g. fid=0.5 or masked_mse=2%%; default k x seed std, or a per-metric default",
    )
    compare.add_argument("--k", type=float, default=2.0, help="tolerance = k x baseline seed std (default 2)")
    compare.add_argument("--weights", choices=("ema", "raw"), default="ema", help="which evaluations to read")
    compare.add_argument("--out", help="output folder (default: FIRST_PRUNED_RUN/report)")
    compare.add_argument("--runs-dir", default="runs")
    compare.add_argument("--no-plots", action="store_true")
    compare.set_defaults(func=_compare)

    bench = sub.add_parser("bench", help="benchmarks: pruned against full runs, side by side")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    named = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    for name, (module, help_line) in BENCHES.items():
        parser_of = bench_sub.add_parser(name, help=help_line)
        if name == named:
            importlib.import_module(module).add_arguments(parser_of)
        parser_of.set_defaults(func=_bench)
    return parser


# errors a user can act on, printed as one line; a class not yet imported cannot have been raised, so
# these are looked up after the fact instead of importing their modules (and torch) before every command
ACTIONABLE = (
    ("prunepipe.pipelines.checkpoint.store", "CheckpointError"),
    ("prunepipe.pipelines.data.shards", "BadInputError"),
)


def _actionable(error: BaseException) -> bool:
    """Whether `error` is one the user can act on: ValueError (a config's ConfigError too), a missing file,
    bad input or a bad checkpoint."""
    kinds = [ValueError, FileNotFoundError]
    kinds += [getattr(sys.modules[module], name) for module, name in ACTIONABLE if module in sys.modules]
    return isinstance(error, tuple(kinds))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`eval RUN --weights raw probe.pool=avg`) are overrides too
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        code = args.func(args)
    except Exception as e:
        if not _actionable(e):
            raise
        print(f"prunepipe: error: {e}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
