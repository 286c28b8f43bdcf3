"""`prunepipe checkpoints verify`: each checkpoint of a run against its manifest
(pipelines/checkpoint/manifest.py), and which one `checkpoint.resume=latest` takes."""

from __future__ import annotations

import os

from prunepipe.launch.cli.options import add_run_arguments


def add_commands(sub, argv: list[str]) -> None:
    checkpoints = sub.add_parser("checkpoints", help="check a run's checkpoints against their manifests")
    checkpoints_sub = checkpoints.add_subparsers(dest="checkpoints_command", required=True)
    verify = checkpoints_sub.add_parser(
        "verify", help="each checkpoint: ok, or which file is damaged and how (exit 1 when any is)"
    )
    add_run_arguments(verify)
    verify.set_defaults(func=_verify)


def _verify(args) -> int:
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
