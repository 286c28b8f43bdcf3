"""The lossless benchmark's runs as the records `prunepipe compare` reads (RunSummary), so that the
benchmark's verdicts come from pipelines/report/ and nothing of its own: a recorded run (a result
dict of lossless_MODE.json) is what a run folder is to `compare`."""

from __future__ import annotations

from prunepipe.pipelines.report.runs import EVALUATED, LOGGED, RunSummary

FULL_ROLES = ("full", "frontier", "equal_compute")  # Full runs of some schedule length: frontier points
PRUNED_ROLES = ("pruned", "ablation")


def run_name(result: dict) -> str:
    """A pruned run's name as `compare` groups seeds of one setting (`LABEL_sSEED`); a Full run's
    its key, which one run keeps whatever roles it serves (a frontier point that is also an arm's
    equal-compute Full is one run)."""
    if result["role"] in FULL_ROLES:
        return result["key"]
    return f"{result['label']}_s{result['seed']}"


def summary(result: dict) -> RunSummary:
    """One recorded run as a RunSummary: its setting is its label, its quality the recorded metrics."""
    source = result.get("metrics_source", "")
    return RunSummary(
        path=result["key"],
        name=run_name(result),
        task=result["task"],
        pruner=str(result["pruner"].get("name", "?")),
        seed=int(result["seed"]),
        passes=int(result["passes"]),
        passes_done=int(result["passes"]),
        samples_forwarded=int(result["samples_forwarded"]),
        optimizer_steps=int(result["optimizer_steps"]),
        wall_seconds=float(result["wall_seconds"]),
        metrics={m: float(v) for m, v in result["metrics"].items() if v is not None},
        metrics_source=source,
        quality_from=EVALUATED if source.startswith("evaluators") else LOGGED,
        setting=result["label"] if result["role"] in PRUNED_ROLES else "full",
    )


def full_summaries(group: list[dict]) -> list[RunSummary]:
    """The group's Full runs of every schedule length, each run once (by key)."""
    found = {}
    for result in group:
        if result["role"] in FULL_ROLES:
            found.setdefault(result["key"], summary(result))
    return list(found.values())
