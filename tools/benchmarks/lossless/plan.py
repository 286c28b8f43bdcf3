"""What the lossless benchmark runs: per task a `TaskPlan` (config, data size, schedules, pruners,
ablations) and the `RunSpec` of every run, including the equal-compute Full each pruned run earns.
Plain data; trains nothing (run.py does)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

SEEDS = (0, 1, 2)


@dataclass
class TaskPlan:
    """One task's benchmark: its config, data size, schedules, pruners and extra settings to try."""

    task: str  # mae | ldm | dit (latent diffusion with the DiT + flow recipe) | t2i (text-conditional DiT)
    config: str  # configs/bench_*.yaml
    main: str  # the metric the verdicts use
    train_samples: int  # the first N digits train; the val split is all of val
    long: int  # passes of the long schedule (the "converged" candidate)
    short: int  # passes of the short schedule (0 = none)
    pruners: dict  # label -> pruner config, run on both schedules and given an equal-compute Full
    ablations: dict = field(default_factory=dict)  # label -> pruner config, long schedule only
    fid_samples: int = 0  # > 0: small-domain FID of DDIM samples (ldm)
    fid_steps: int = 20
    overrides: list = field(default_factory=list)
    timing_rounds: int = 1  # sequential, interleaved reruns of Full and the pruners for wall-clock
    data: str = (
        "digits"  # digits | photos | redundant (prunepipe shards write --source) | captioned (digits, --captions)
    )
    crops_per_photo: int = 0  # photos and redundant: crops of each of the 15 bundled photographs
    pruned_seeds: tuple = (0,)  # seeds of every pruned run and of its equal-compute Full
    full_seeds: tuple = SEEDS  # seeds of Full at the full schedule
    extra_splits: tuple = ()  # held-out splits evaluated besides val, e.g. ("val_mix",) of redundant data
    # Full's frontier: besides the full schedule, Full at these fractions of its passes (each its own
    # schedule, every Full seed), so that each seed has its own quality-vs-compute curve
    frontier: tuple = ()
    # diffusion: samples measured for copies of train images (eval.replication, pixels) at the end of each run
    replication_samples: int = 0


PRUNERS = {
    "Random": {"name": "random", "keep": 0.7, "delta": 0.875},
    "InfoBatch": {"name": "infobatch", "prune_ratio": 0.5, "delta": 0.875},
    "TED": {"name": "ted", "target": 0.7, "ramp": 0.25, "explore": 0.1, "momentum": 0.5, "delta": 0.875},
}
MAE_ABLATIONS = {
    "InfoBatch r=0.3": {"name": "infobatch", "prune_ratio": 0.3, "delta": 0.875},
    "InfoBatch delta=0.7": {"name": "infobatch", "prune_ratio": 0.5, "delta": 0.7},
    "TED momentum=0.8": {**PRUNERS["TED"], "momentum": 0.8},
    "TED explore=0.3": {**PRUNERS["TED"], "explore": 0.3},
}
LDM_ABLATIONS = {
    "InfoBatch r=0.3": {"name": "infobatch", "prune_ratio": 0.3, "delta": 0.875},
    "TED momentum=0.8": {**PRUNERS["TED"], "momentum": 0.8},
}


def task_plans(
    mode: str, tasks: list[str], arms: tuple[str, ...] = (), frontier: tuple[float, ...] = ()
) -> list[TaskPlan]:
    """full: the measurement (26 minutes on 2 cores under load, docs/BENCHMARKS.md); quick: the same
    pipeline in 1-5 minutes; micro: the harness test (seconds, not a measurement). `arms`: only
    these pruned settings (labels) beside Full; `frontier`: Full also at these fractions of the passes."""
    plans = _mode_plans(mode, tasks, arms)
    return [dataclasses.replace(p, frontier=check_frontier(frontier)) for p in plans] if frontier else plans


def check_frontier(fractions) -> tuple[float, ...]:
    """Sorted positive fractions of the passes other than 1 (Full itself always runs). Above 1: Full
    trained longer, so that a setting better than Full at the full schedule gets a saving, not a bound."""
    bad = [f for f in fractions if not 0 < f or f == 1]
    if bad:
        raise ValueError(
            f"bench --frontier: fractions of the passes must be > 0 and not 1 (Full at 1 always runs), got {bad}"
        )
    return tuple(sorted(set(float(f) for f in fractions)))


def frontier_passes(plan: TaskPlan, passes: int) -> list[int]:
    """The frontier's schedule lengths other than `passes` (distinct, at least 1)."""
    return sorted({max(1, int(round(f * passes))) for f in plan.frontier} - {passes})


def _mode_plans(mode: str, tasks: list[str], arms: tuple[str, ...]) -> list[TaskPlan]:
    suite = re.fullmatch(r"pays_(micro_)?(\w+?)(?:_p(\d+))?(?:_s(\d+))?(?:_(\w+))?", mode)
    if suite:  # pays_DATA[_pPASSES][_sSEEDS][_TAG]; pays_micro_DATA: the harness test
        seeds = int(suite.group(4) or len(SEEDS))
        plans = [p for p in pays_plans(suite.group(2), micro=bool(suite.group(1)), seeds=seeds) if p.task in tasks]
        plans = [dataclasses.replace(p, long=int(suite.group(3))) for p in plans] if suite.group(3) else plans
        return [only_arms(p, arms) for p in plans] if arms else plans
    if mode == "full":
        plans = [
            TaskPlan(
                "mae", "configs/bench_mae.yaml", "masked_mse", 500, 80, 20, PRUNERS, MAE_ABLATIONS, timing_rounds=2
            ),
            TaskPlan(
                "ldm",
                "configs/bench_ldm.yaml",
                "denoise_mse",
                500,
                32,
                10,
                PRUNERS,
                LDM_ABLATIONS,
                fid_samples=256,
                timing_rounds=1,
            ),
        ]
    elif mode == "quick":
        plans = [
            TaskPlan("mae", "configs/bench_mae.yaml", "masked_mse", 500, 6, 3, PRUNERS),
            TaskPlan(
                "ldm",
                "configs/bench_ldm.yaml",
                "denoise_mse",
                500,
                4,
                2,
                PRUNERS,
                fid_samples=64,
                fid_steps=10,
                timing_rounds=0,
            ),
        ]
    elif mode.startswith("dit"):
        plans = [dit_plan(mode)]
    elif mode.startswith("t2i"):
        plans = [t2i_plan(mode)]
    elif mode == "micro":
        tiny = ["mae.embed_dim=16", "mae.decoder_embed_dim=16", "mae.depth=1", "data.val_batches=1"]
        plans = [TaskPlan("mae", "configs/bench_mae.yaml", "masked_mse", 96, 2, 0, PRUNERS, overrides=tiny)]
    else:
        raise ValueError(f"bench mode {mode!r}: accepted: full, quick, micro, pays_DATA, dit, dit_quick, dit_micro")
    return [p for p in plans if p.task in tasks]


def dit_plan(mode: str) -> TaskPlan:
    """The DiT + flow task, InfoBatch against Full at 3 seeds: dit (the measurement),
    dit_quick (the same in a few minutes), dit_micro (the harness test)."""
    infobatch = {"InfoBatch": PRUNERS["InfoBatch"]}
    if mode == "dit":
        return TaskPlan(
            "dit",
            "configs/bench_dit.yaml",
            "denoise_mse",
            500,
            16,
            0,
            infobatch,
            fid_samples=128,
            fid_steps=10,
            timing_rounds=0,
        )
    if mode == "dit_quick":
        return TaskPlan(
            "dit",
            "configs/bench_dit.yaml",
            "denoise_mse",
            500,
            4,
            0,
            infobatch,
            fid_samples=32,
            fid_steps=5,
            timing_rounds=0,
        )
    if mode == "dit_micro":
        return TaskPlan("dit", "configs/bench_dit.yaml", "denoise_mse", 96, 2, 0, infobatch, timing_rounds=0)
    raise ValueError(f"bench mode {mode!r}: accepted: dit, dit_quick, dit_micro")


def t2i_plan(mode: str) -> TaskPlan:
    """The text-to-image task (a text-conditional DiT on captioned digits, a tiny text encoder the
    bench writes beside them), InfoBatch against Full at 3 seeds: t2i (the measurement), t2i_quick
    (the same in a few minutes), t2i_micro (the harness test)."""
    infobatch = {"InfoBatch": PRUNERS["InfoBatch"]}
    text = ["ldm.text.encoder={data}/text_encoder"]  # written by prepare_data
    samples, passes = {"t2i": (500, 16), "t2i_quick": (500, 4), "t2i_micro": (96, 2)}.get(mode, (0, 0))
    if not samples:
        raise ValueError(f"bench mode {mode!r}: accepted: t2i, t2i_quick, t2i_micro")
    return TaskPlan(
        "t2i",
        "configs/bench_t2i.yaml",
        "denoise_mse",
        samples,
        passes,
        0,
        infobatch,
        overrides=text,
        timing_rounds=0,
        data="captioned",
    )


@dataclass
class RunSpec:
    key: str  # unique folder name
    task: str
    schedule: str  # long | short
    label: str  # Full s0, InfoBatch, Full @ InfoBatch, ...
    role: str  # full | frontier | pruned | ablation | equal_compute
    pruner: dict
    seed: int
    passes: int
    compute_of: str = ""  # equal_compute: the label of the pruned run it matches


# Arms of the "pays" suite: where selection might be worth more than stopping early. A pruner dict
# may carry `run`: other settings of the run (timestep-normalised scores, importance-sampled timesteps).
PAYS_MAE = {
    "Random": {"name": "random", "keep": 0.7, "delta": 0.875},
    "InfoBatch": {"name": "infobatch", "prune_ratio": 0.5, "delta": 0.875},
    "InfoBatch no rescale": {"name": "infobatch", "prune_ratio": 0.5, "delta": 0.875, "rescale": False},
    "Importance": {"name": "importance", "keep": 0.7, "alpha": 1.0, "p_min": 0.1, "delta": 0.875},
    # scores averaged over visits: one noisy mask draw weighs less (hypothesis 2 for MAE)
    "InfoBatch smoothed": {"name": "infobatch", "prune_ratio": 0.5, "delta": 0.875, "momentum": 0.5},
    "Importance smoothed": {
        "name": "importance",
        "keep": 0.7,
        "alpha": 1.0,
        "p_min": 0.1,
        "delta": 0.875,
        "momentum": 0.5,
    },
    # scores normalised within the share of the image the mask hid (the mask draw, hypothesis 2 for MAE)
    "InfoBatch mask-norm": {
        "name": "infobatch",
        "prune_ratio": 0.5,
        "delta": 0.875,
        "run": {"score.normalise": "stratum_mean"},
    },
    "Importance mask-norm": {
        "name": "importance",
        "keep": 0.7,
        "alpha": 1.0,
        "p_min": 0.1,
        "delta": 0.875,
        "run": {"score.normalise": "stratum_mean"},
    },
    # what the model already learns through the other samples: the loss-side signal of redundancy
    "TED": PRUNERS["TED"],
}
PAYS_LDM = {
    "Random": {"name": "random", "keep": 0.7, "delta": 0.875},
    "InfoBatch": {"name": "infobatch", "prune_ratio": 0.5, "delta": 0.875},
    "InfoBatch t-norm": {
        "name": "infobatch",
        "prune_ratio": 0.5,
        "delta": 0.875,
        "run": {"score.normalise": "stratum_mean"},
    },
    "Importance t-norm": {
        "name": "importance",
        "keep": 0.7,
        "alpha": 1.0,
        "p_min": 0.1,
        "delta": 0.875,
        "run": {"score.normalise": "stratum_mean"},
    },
    # the other axis: which timesteps, not which samples (all data, so its equal compute is Full itself)
    "Full, sampled t": {"name": "full", "run": {"ldm.ddpm.timestep_sampling": "loss_second_moment"}},
    "InfoBatch t-norm, sampled t": {
        "name": "infobatch",
        "prune_ratio": 0.5,
        "delta": 0.875,
        "run": {"score.normalise": "stratum_mean", "ldm.ddpm.timestep_sampling": "loss_second_moment"},
    },
    "TED": PRUNERS["TED"],
}
# DiT + flow (today's diffusion recipe, bench_dit.yaml) on the same data: the loss pruners, timestep-normalised
PAYS_DIT = {label: PAYS_LDM[label] for label in ("InfoBatch", "InfoBatch t-norm", "Importance t-norm", "TED")}


# The dedup pruner on the redundant set's known groups (tools/fixtures/known_groups.py, written by the bench's
# data preparation): at keep 0.7, the oracle's compute, each of the 64 groups (about 13.7 members)
# gives about 6 members a pass in turn, and the scores prune nothing more; once with the deduplicated expectation (weight 1),
# once with the duplicated one (weight 1/share). Every near-duplicate is still seen, unlike the oracle's.
DEDUP_ARMS = {
    "Dedup known": {
        "name": "dedup",
        "groups": "known",
        "keep": 0.7,
        "per_group": 1,
        "then": "importance",
        "delta": 0.875,
        "group_rescale": False,
    },
    "Dedup known rescaled": {
        "name": "dedup",
        "groups": "known",
        "keep": 0.7,
        "per_group": 1,
        "then": "importance",
        "delta": 0.875,
        "group_rescale": True,
    },
    # the control: the same groups, the same share of each kept, but always the same members and no
    # full passes at the end, as if the others had been removed from the shards once before training
    "Static dedup known": {
        "name": "dedup",
        "groups": "known",
        "keep": 0.7,
        "per_group": 1,
        "then": "importance",
        "delta": 1.0,
        "group_rescale": False,
        "static": True,
    },
}


def only_arms(plan: TaskPlan, arms: tuple[str, ...]) -> TaskPlan:
    """The plan with only the pruned settings labelled `arms` (Full and its seeds stay)."""
    unknown = [a for a in arms if a not in plan.pruners]
    if unknown:
        raise ValueError(
            f"bench --arms: {plan.task} has no setting {', '.join(map(repr, unknown))}; accepted: "
            f"{', '.join(plan.pruners)}"
        )
    return dataclasses.replace(plan, pruners={a: plan.pruners[a] for a in arms})


def pays_plans(data: str, micro: bool = False, seeds: int = len(SEEDS)) -> list[TaskPlan]:
    """Every arm at `seeds` seeds (Full too), each with an equal-compute Full at the same seeds, on `data`."""
    if data not in ("digits", "photos", "redundant"):
        raise ValueError(f"bench data {data!r}: accepted: digits, photos, redundant")
    if seeds < 2:
        raise ValueError(f"bench --seeds must be >= 2 (verdicts need a seed spread), got {seeds}")
    each = tuple(range(seeds))
    extra = ("val_mix",) if data == "redundant" else ()
    # on redundant data, the settings that know its near-duplicates: the ceiling of selection (Full on
    # what an oracle deduplication leaves) and the dedup pruner on the same known groups
    known = (
        {"Dedup oracle": {"name": "full", "run": {"data.train": "{data}/train_dedup"}}, **DEDUP_ARMS}
        if data == "redundant"
        else {}
    )
    photos = 60 if data != "digits" else 0  # 900 crops: 810 unique train (+ as many duplicates), 90 val
    channels = ["data.channels=3"] if data != "digits" else []
    if micro:
        tiny = ["mae.embed_dim=16", "mae.decoder_embed_dim=16", "mae.depth=1", "data.val_batches=1", *channels]
        return [
            TaskPlan(
                "mae",
                "configs/bench_mae.yaml",
                "masked_mse",
                96,
                2,
                0,
                {**{k: PAYS_MAE[k] for k in ("InfoBatch", "Importance")}, **known},
                overrides=tiny,
                timing_rounds=0,
                data=data,
                crops_per_photo=8 if photos else 0,
                pruned_seeds=each,
                full_seeds=each,
                extra_splits=extra,
            )
        ]
    return [
        TaskPlan(
            "mae",
            "configs/bench_mae.yaml",
            "masked_mse",
            500,
            60,
            0,
            {**PAYS_MAE, **known},
            overrides=channels,
            timing_rounds=0,
            data=data,
            crops_per_photo=photos,
            pruned_seeds=each,
            full_seeds=each,
            extra_splits=extra,
        ),
        TaskPlan(
            "ldm",
            "configs/bench_ldm.yaml",
            "denoise_mse",
            500,
            24,
            0,
            {**PAYS_LDM, **known},
            overrides=channels,
            timing_rounds=0,
            data=data,
            crops_per_photo=photos,
            pruned_seeds=each,
            full_seeds=each,
            extra_splits=extra,
        ),
        # labels: the photograph (15) on photos and redundant data, the digit on digits
        TaskPlan(
            "dit",
            "configs/bench_dit.yaml",
            "denoise_mse",
            500,
            24,
            0,
            {**PAYS_DIT, **known},
            overrides=[*channels, f"ldm.num_classes={15 if photos else 10}"],
            timing_rounds=0,
            data=data,
            crops_per_photo=photos,
            pruned_seeds=each,
            full_seeds=each,
            extra_splits=extra,
            fid_steps=20,
            replication_samples=256,
        ),
    ]


def first_specs(plan: TaskPlan) -> list[RunSpec]:
    """Every run that does not depend on another's result."""
    specs = []
    for schedule, passes in (("long", plan.long), ("short", plan.short)):
        if passes <= 0:
            continue
        for seed in plan.full_seeds:
            specs.append(
                RunSpec(
                    f"{plan.task}_{schedule}_full_s{seed}",
                    plan.task,
                    schedule,
                    f"Full s{seed}",
                    "full",
                    {"name": "full"},
                    seed,
                    passes,
                )
            )
            for shorter in frontier_passes(plan, passes):  # named as equal-compute runs: one run serves both
                specs.append(
                    RunSpec(
                        full_key(plan.task, schedule, shorter, seed),
                        plan.task,
                        schedule,
                        f"Full {shorter} passes",
                        "frontier",
                        {"name": "full"},
                        seed,
                        shorter,
                    )
                )
        groups = [("pruned", plan.pruners)] + ([("ablation", plan.ablations)] if schedule == "long" else [])
        for role, pruners in groups:
            for label, pruner in pruners.items():
                for seed in plan.pruned_seeds:
                    specs.append(
                        RunSpec(
                            f"{plan.task}_{schedule}_{slug(label)}{seed_suffix(seed)}",
                            plan.task,
                            schedule,
                            label,
                            role,
                            dict(pruner),
                            seed,
                            passes,
                        )
                    )
    return specs


def seed_suffix(seed: int) -> str:
    """Seed 0 keeps the key runs had before pruned runs had seeds (recorded benchmarks re-render)."""
    return f"_s{seed}" if seed else ""


def equal_compute_spec(pruned: dict, full_per_pass: int) -> RunSpec:
    """Full (the pruned run's seed) for as many passes as its samples forwarded buy, its own schedule."""
    passes = max(1, int(round(pruned["samples_forwarded"] / full_per_pass)))
    seed = int(pruned.get("seed", 0))
    return RunSpec(
        full_key(pruned["task"], pruned["schedule"], passes, seed),
        pruned["task"],
        pruned["schedule"],
        f"Full @ {pruned['label']}",
        "equal_compute",
        {"name": "full"},
        seed,
        passes,
        compute_of=pruned["label"],
    )


def full_key(task: str, schedule: str, passes: int, seed: int) -> str:
    """The folder of Full at `passes` of its own schedule (a frontier point or an equal-compute run)."""
    return f"{task}_{schedule}_full_p{passes}{seed_suffix(seed)}"


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_")
