"""`prunepipe compare`: was a pruned run lossless against its Full baseline, and how much compute did it
save at equal quality (pipelines/report/compare.py): tables, verdicts, cost, PNG plots."""

from __future__ import annotations

import os


def add_commands(sub, argv: list[str]) -> None:
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
