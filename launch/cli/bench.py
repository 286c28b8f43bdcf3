"""`prunepipe bench NAME`: the benchmarks of tools/benchmarks/, each module owning its flags
(`add_arguments`) and its run (`run_from_args`). A benchmark's module is imported only when the command
line names it: some import torch and diffusers, seconds that every other command would pay."""

from __future__ import annotations

import importlib

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
    "stream": (
        "prunepipe.tools.benchmarks.stream",
        "what a pruned sample costs in the stream: every sample decoded, half dropped before decode, bytes "
        "read only, every sample skipped",
    ),
    "shard-tools": (
        "prunepipe.tools.benchmarks.shard_tools",
        "shards write and shards index on a generated image folder at scale: wall time, peak memory, what "
        "the checksums cost, against another checkout",
    ),
    "pruners": (
        "prunepipe.tools.benchmarks.pruners",
        "pruner overhead: plan over N samples, weights for 1M ids, update per batch, state bytes per sample",
    ),
    "coverage": (
        "prunepipe.tools.benchmarks.interval_coverage",
        "how often the saving intervals of the frontier cover the truth, on simulated experiments",
    ),
    "rehearse": (
        "prunepipe.tools.benchmarks.rehearse_cluster",
        "two emulated nodes of two ranks, one killed and requeued, against a run never interrupted: bit for "
        "bit (exit 1 on FAIL)",
    ),
    "resume": (
        "prunepipe.tools.benchmarks.resume_check",
        "kill-and-resume on this machine's device: a run SIGKILLed after a checkpoint and resumed against "
        "one trained straight through, bit for bit",
    ),
    "allreduce": (
        "prunepipe.tools.benchmarks.allreduce_count",
        "gradient all-reduces DDP runs per optimizer step under gradient accumulation (one process, or N "
        "under torchrun)",
    ),
}


def add_commands(sub, argv: list[str]) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks: pruned against full runs; the data path, the pruners and the loop measured; cluster checks",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    named = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    for name, (module, help_line) in BENCHES.items():
        parser_of = bench_sub.add_parser(name, help=help_line)
        if name == named:
            importlib.import_module(module).add_arguments(parser_of)
        parser_of.set_defaults(func=_bench)


def _bench(args) -> int:
    """The benchmark named on the command line (tools/benchmarks/)."""
    return importlib.import_module(BENCHES[args.bench_command][0]).run_from_args(args) or 0
