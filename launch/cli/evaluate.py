"""`prunepipe eval`: a run's checkpoint judged by its evaluators (pipelines/evaluation/), its settings
the run's eval: section with key=value overrides, checked with what they need before torch loads."""

from __future__ import annotations

import json
import os

from prunepipe.launch.cli.options import add_run_arguments

# Flags that set an eval key, shorthands of `KEY=VALUE`: the config checks their values as it checks the key's.
KEY_FLAGS = {
    "--fid-samples": ("fid.num_samples", "generated images for FID"),
    "--fid-steps": ("fid.sampler_steps", "sampler steps of the FID samples (DDIM; Euler for flow runs)"),
    "--fid-feature": ("fid.feature", "inception | classifier | module:pkg.mod:factory"),
    "--fid-weights": ("fid.weights", "the FID feature network's weights file"),
    "--weights": ("weights", "ema (default) or raw: which weights are evaluated"),
}


def add_commands(sub, argv: list[str]) -> None:
    evaluate = sub.add_parser("eval", help="evaluate a run's checkpoint: reconstruction, probe, denoising loss, FID")
    add_run_arguments(evaluate)
    evaluate.add_argument("--checkpoint", default="latest", help="latest (default) or a checkpoint folder")
    for flag, (key, text) in KEY_FLAGS.items():
        evaluate.add_argument(
            flag,
            dest="key_flags",
            action="append",
            type=lambda value, key=key: f"{key}={value}",
            metavar="VALUE",
            help=f"{text}; the same as {key}=VALUE",
        )
    evaluate.add_argument("--eval-config", help="YAML with evaluation settings (see pipelines/evaluation/config.py)")
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
    evaluate.set_defaults(func=_eval, key_flags=[])


def _eval(args) -> None:
    """Evaluate a checkpoint of a run; writes RUN/eval/step_XXXXXX.json."""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.evaluation.config import EvalConfig, load_eval_config
    from prunepipe.pipelines.evaluation.needs import plan_evaluation
    from prunepipe.pipelines.evaluation.records import resolve_run_dir

    overrides = [*args.overrides, *args.key_flags]  # the flags last: they win over KEY=VALUE, as they always have
    # the settings and what they need, checked before torch and the model load: a typo or every missing
    # piece is told at once
    run_dir = resolve_run_dir(args.run, args.runs_dir)
    run_cfg = load_config(os.path.join(run_dir, "config.yaml"))
    eval_cfg = load_eval_config(getattr(run_cfg, "eval", None) or EvalConfig(), args.eval_config, overrides)
    plan_evaluation(run_cfg, eval_cfg, run_dir if args.checkpoint == "latest" else "")
    from prunepipe.pipelines.trained import evaluate_checkpoint

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
