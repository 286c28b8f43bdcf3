"""The contract every pruner keeps (docs/design.md, "Pruners"), the counter-based coin and the frozen plan.

Decisions are pure functions of (seed, pass_index, id, plan frozen at the pass start): no global RNG is
ever seeded or drawn from. pruning/ never imports a model, opens a file or talks to other ranks
(except pruning/sync.py).
"""

from __future__ import annotations

import abc
import inspect
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .bitmap import Bitmap
from .splitmix import uniform_coin

# ----------------------------------------------------------------------------------------------
# Counter-based coin (pruning/splitmix.py)
# ----------------------------------------------------------------------------------------------

_ROTATION_SALT = 0x67726F7570  # "group": a stream of its own for each sample's phase on its rotation


def rotation_keeps(seed: int, pass_index: int, ids: np.ndarray, share: np.ndarray) -> np.ndarray:
    """bool per id: kept in pass `pass_index` by a rotation that keeps each id a `share` (in (0, 1]) of the passes.

    Sample i has a phase u_i, a coin of (seed, id) that is the same in every pass, and moves by its
    share s_i each pass: it is kept when frac(u_i + pass_index * s_i) < s_i. In any one pass that happens
    with probability s_i (u_i is uniform), so weighting by 1/s_i is unbiased as with an independent
    coin; unlike one, it keeps the sample at least once in any ceil(1/s_i) consecutive passes (steps
    of s_i cannot jump the window [0, s_i)), and in exactly a share s_i of passes in the long run.
    """
    share = np.asarray(share, dtype=np.float64)
    position = uniform_coin(seed ^ _ROTATION_SALT, 0, ids) + int(pass_index) * share
    return position - np.floor(position) < share


# ----------------------------------------------------------------------------------------------
# Annealing: the last passes train on full data
# ----------------------------------------------------------------------------------------------


def first_full_pass(num_passes: int, delta: float | str | Fraction) -> int:
    """The first pass trained on full data: the smallest integer >= num_passes * delta.

    Pass `pass_index` is pruned iff pass_index < num_passes * delta (InfoBatch's "annealing": prune during
    the first delta fraction of training), so exactly num_passes - ceil(num_passes * delta)
    passes are full. The product is taken in exact rational arithmetic on delta as written
    (str(0.55) == "0.55"), so 100 * 0.55 is 55 and not 55.00000000000001. The reference code
    compares a pass counter with the float product, so its boundary moves by a pass with rounding
    (90 * 0.7 == 62.99999999999999) and with how its sampler's counter is driven.
    """
    return math.ceil(num_passes * Fraction(str(delta)))


# ----------------------------------------------------------------------------------------------
# Input conversion
# ----------------------------------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    """Whether `value` is a torch tensor, without importing torch: none exists before torch is imported
    (a config check builds pruners without it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_ids(ids: Any) -> np.ndarray:
    """Ids as a 1-D int64 numpy array (from numpy, torch or a list); never via floats."""
    if _is_tensor(ids):
        if ids.is_floating_point():
            raise TypeError(f"sample ids must be integers, got a {ids.dtype} tensor")
        return ids.detach().to("cpu", sys.modules["torch"].int64).numpy().reshape(-1)
    array = np.asarray(ids)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"sample ids must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False).reshape(-1)


def as_losses(losses: Any) -> np.ndarray:
    """Losses as a 1-D float32 numpy array; torch half/bfloat16 go through `.float()` (numpy has no bf16)."""
    if _is_tensor(losses):
        return losses.detach().float().cpu().numpy().reshape(-1)
    return np.asarray(losses, dtype=np.float32).reshape(-1)


def unique_last(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop repeated ids, keeping each id's last value (numpy leaves repeated assignment unspecified)."""
    reversed_ids = ids[::-1]
    unique_ids, first_in_reversed = np.unique(reversed_ids, return_index=True)
    if len(unique_ids) == len(ids):
        return ids, values
    return unique_ids, values[::-1][first_in_reversed]


# ----------------------------------------------------------------------------------------------
# The frozen plan of one pass
# ----------------------------------------------------------------------------------------------


_COUNT_CHUNK = 1 << 20


@dataclass(frozen=True)
class FrozenPlan:
    """The decisions of one pass, frozen at its start: a candidate bitmap, one keep probability and
    the coin; nothing dense per sample.

    Samples outside `candidates` are kept with weight 1. A candidate is kept with probability
    `keep_prob` (the coin of (seed, pass_index, id) decides) and then weighted 1/keep_prob, so each
    sample's expected weight is 1 and the expected gradient equals the full-data one.
    `candidates is None` means every sample is a candidate; keep_prob == 1 means full data.
    `keep_probs` (per sample, float32 or float16: Importance's and Dedup's plans, the ones that need
    them) replaces the one keep_prob by a probability per sample.
    `rescale=False` keeps the kept ones at weight 1: the expectation then leans away from what is
    skipped (a choice to measure on redundant data, not a default).
    `group_probs` (float16 per sample, with `keep_probs`: Dedup's plan) adds a second, independent
    decision, each sample's share of its near-duplicate group: a sample is kept when its coin is below
    its keep_prob and its group rotation (`rotation_keeps`) keeps it; its weight gains 1/group_prob
    only with `group_rescale`. Decisions and weights read the same stored probabilities, so the
    quantisation to float16 moves no expectation. `rotate=False` turns the rotation at pass 0 in every
    pass: the same members of each group every pass, the others never (a static deduplication).
    """

    seed: int
    pass_index: int
    num_samples: int
    keep_prob: float
    candidates: Bitmap | None  # 1 bit per sample, read-only
    rescale: bool = True
    keep_probs: np.ndarray | None = None  # float32 or float16 [num_samples] in (0, 1], read-only
    group_probs: np.ndarray | None = None  # float16 [num_samples] in (0, 1], read-only; needs keep_probs
    group_rescale: bool = True
    rotate: bool = True

    def __post_init__(self):
        if self.group_probs is not None and self.keep_probs is None:
            raise ValueError("a plan with group_probs needs keep_probs (1.0 where the score prunes nothing)")

    @property
    def candidate_weight(self) -> np.float32:
        return np.float32(1.0 / self.keep_prob) if self.rescale else np.float32(1.0)

    @property
    def keeps_all(self) -> bool:
        return self.keep_prob >= 1.0 and self.keep_probs is None

    def _per_sample(
        self, ids: np.ndarray, probs: np.ndarray, groups: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(kept, weight if kept) of `ids`, whose keep_probs are `probs` and group_probs `groups`."""
        kept = uniform_coin(self.seed, self.pass_index, ids) < probs
        weight = np.float32(1.0) / probs if self.rescale else np.ones(len(ids), dtype=np.float32)
        if groups is not None:
            kept &= rotation_keeps(self.seed, self.pass_index if self.rotate else 0, ids, groups)
            if self.group_rescale:
                weight = weight / groups
        return kept, weight.astype(np.float32, copy=False)

    def weights(self, ids: np.ndarray) -> np.ndarray:
        ids = as_ids(ids)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            bad = ids[(ids < 0) | (ids >= self.num_samples)][0]
            raise ValueError(f"sample id {bad} is outside 0..{self.num_samples - 1} (num_samples of this pruner)")
        weights = np.ones(len(ids), dtype=np.float32)
        if self.keep_probs is not None:
            groups = None if self.group_probs is None else self.group_probs[ids]
            kept, kept_weight = self._per_sample(ids, self.keep_probs[ids], groups)
            weights[:] = np.where(kept, kept_weight, np.float32(0.0))
            return weights
        if self.keep_prob >= 1.0:
            return weights
        if self.candidates is None:
            weights[:] = np.where(
                uniform_coin(self.seed, self.pass_index, ids) < self.keep_prob, self.candidate_weight, 0.0
            )
            return weights
        is_candidate = self.candidates.test(ids)
        coin = uniform_coin(self.seed, self.pass_index, ids[is_candidate])
        weights[is_candidate] = np.where(coin < self.keep_prob, self.candidate_weight, 0.0)
        return weights

    def kept_between(self, start: int, stop: int) -> np.ndarray:
        """bool per id of [start, stop): kept this pass (the same coins `weights` draws)."""
        if self.keeps_all:
            return np.ones(stop - start, dtype=bool)
        if self.keep_probs is not None:
            ids = np.arange(start, stop, dtype=np.int64)
            groups = None if self.group_probs is None else self.group_probs[start:stop]
            return self._per_sample(ids, self.keep_probs[start:stop], groups)[0]
        kept = np.ones(stop - start, dtype=bool)
        if self.candidates is None:
            candidate_ids = np.arange(start, stop, dtype=np.int64)
        else:
            candidate_ids = start + np.flatnonzero(self.candidates.between(start, stop))
        kept[candidate_ids - start] = uniform_coin(self.seed, self.pass_index, candidate_ids) < self.keep_prob
        return kept

    def count_skipped(self) -> int:
        """Exactly how many samples this pass skips (the same coins `weights` draws)."""
        if self.keeps_all:
            return 0
        skipped = 0
        for start in range(0, self.num_samples, _COUNT_CHUNK):  # chunks bound the temporaries at 1e8+ samples
            stop = min(start + _COUNT_CHUNK, self.num_samples)
            skipped += (stop - start) - int(np.count_nonzero(self.kept_between(start, stop)))
        return skipped

    def to_state(self) -> dict:
        import torch

        # copies: torch refuses to wrap the read-only arrays of a frozen plan
        bits = None if self.candidates is None else torch.from_numpy(self.candidates.packed.copy())
        keep_probs = None if self.keep_probs is None else torch.from_numpy(np.array(self.keep_probs))
        group_probs = None if self.group_probs is None else torch.from_numpy(np.array(self.group_probs))
        return {
            "pass_index": self.pass_index,
            "keep_prob": self.keep_prob,
            "candidate_bits": bits,
            "rescale": self.rescale,
            "keep_probs": keep_probs,
            "group_probs": group_probs,
            "group_rescale": self.group_rescale,
            "rotate": self.rotate,
        }

    @classmethod
    def from_state(cls, state: dict, seed: int, num_samples: int) -> "FrozenPlan":
        keep_probs = _per_sample_probs(state, "keep_probs", num_samples, (np.float32, np.float16))
        group_probs = _per_sample_probs(state, "group_probs", num_samples, (np.float16,))
        candidates = None
        if state["candidate_bits"] is not None:
            packed = np.array(state["candidate_bits"].numpy(), dtype=np.uint8, copy=True)
            if packed.shape != ((num_samples + 7) // 8,):
                raise ValueError(
                    f"plan candidate_bits have shape {tuple(packed.shape)}, "
                    f"expected ({(num_samples + 7) // 8},) for {num_samples} samples"
                )
            candidates = Bitmap(packed, num_samples)
            candidates.packed.flags.writeable = False
        return cls(
            seed,
            int(state["pass_index"]),
            num_samples,
            float(state["keep_prob"]),
            candidates,
            bool(state["rescale"]),
            keep_probs,
            group_probs,
            bool(state["group_rescale"]),
            bool(state["rotate"]),
        )


def _per_sample_probs(state: dict, name: str, num_samples: int, dtypes: tuple) -> np.ndarray | None:
    """A plan's per-sample probabilities from its state (None for a plan without them), a read-only
    copy in the dtype they were saved in."""
    saved = state[name]
    if saved is None:
        return None
    probs = saved.numpy()
    if probs.shape != (num_samples,) or probs.dtype not in [np.dtype(d) for d in dtypes]:
        raise ValueError(
            f"plan {name} are {probs.dtype}{list(probs.shape)}, expected "
            f"{' or '.join(np.dtype(d).name for d in dtypes)}[{num_samples}]"
        )
    probs = np.array(probs, copy=True)
    probs.flags.writeable = False
    return probs


# ----------------------------------------------------------------------------------------------
# The contract
# ----------------------------------------------------------------------------------------------


class Pruner(abc.ABC):
    """Per-sample ids and losses in, keep/skip decisions and weights out (docs/design.md, "Pruners").

    Subclasses declare their hyper-parameters as keyword-only `__init__` arguments with defaults,
    keep per-sample state in numpy tables made by `np.zeros` (untouched pages cost no memory),
    and implement `_freeze(pass_index) -> FrozenPlan`, `_record(ids, losses)` and the table lists.
    """

    name: str = "pruner"

    def __init__(self, num_samples: int, num_passes: int, *, seed: int = 0, **hparams: Any):
        if int(num_samples) < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if int(num_passes) < 1:
            raise ValueError(f"num_passes must be >= 1, got {num_passes}")
        self.num_samples = int(num_samples)
        self.num_passes = int(num_passes)
        self.seed = int(seed)
        self.hparams: dict[str, Any] = dict(hparams)
        self._plan: FrozenPlan | None = None
        self._nonfinite_losses = 0  # losses refused by update(): NaN would poison every threshold
        self._recorded_losses = 0
        self._skipped_in_earlier_passes = 0
        self._skipped_this_pass = 0
        self._writes_tables = True  # False on a node's other ranks once its tables are shared

    # -- what subclasses provide ---------------------------------------------------------------

    @abc.abstractmethod
    def _freeze(self, pass_index: int) -> FrozenPlan:
        """This pass's decisions from the current scores."""

    def _record(self, ids: np.ndarray, losses: np.ndarray) -> None:
        """Record finite losses at unique, in-range ids (default: nothing to record)."""

    def _tables(self) -> dict[str, np.ndarray]:
        """The per-sample numpy tables that make up the state (default: none)."""
        return {}

    def _scalars(self) -> dict[str, Any]:
        """Plain numbers beyond the tables that make up the state (default: none)."""
        return {}

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        pass

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    # -- the contract --------------------------------------------------------------------------

    @property
    def frozen_plan(self) -> FrozenPlan | None:
        """The plan of the current pass (None before the first `plan`): what the data stream reads."""
        return self._plan

    @property
    def pass_index(self) -> int | None:
        """The pass whose plan is frozen (None before the first `plan`)."""
        return None if self._plan is None else self._plan.pass_index

    def plan(self, pass_index: int) -> None:
        """Freeze the decisions of pass `pass_index` from the current scores; `weights` reads only this."""
        pass_index = int(pass_index)
        if pass_index < 0:
            raise ValueError(f"pass_index must be >= 0, got {pass_index}")
        if self._plan is not None and self._plan.pass_index != pass_index:
            self._skipped_in_earlier_passes += self._skipped_this_pass  # re-planning a pass replaces it
        self._plan = self._freeze(pass_index)
        self._skipped_this_pass = self._plan.count_skipped()

    def weights(self, ids: np.ndarray) -> np.ndarray:
        """float32 weight per id for the planned pass; 0.0 = skip (no decode, forward or backward)."""
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__}.weights() before plan(pass_index): freeze a pass first")
        return self._plan.weights(ids)

    def update(self, ids: Any, losses: Any) -> None:
        """Record per-sample losses (already gathered over ranks). Ids < 0 are padding and ignored;
        non-finite losses are not recorded and are counted in `stats()["nonfinite_losses"]`."""
        ids, losses = as_ids(ids), as_losses(losses)
        if ids.shape != losses.shape:
            raise ValueError(f"update() got {len(ids)} ids and {len(losses)} losses; they must pair up")
        real = ids >= 0
        if len(ids) and ids.max() >= self.num_samples:
            raise ValueError(
                f"sample id {int(ids.max())} is outside 0..{self.num_samples - 1} (num_samples of this pruner)"
            )
        finite = np.isfinite(losses)
        self._nonfinite_losses += int(np.count_nonzero(real & ~finite))
        keep = real & finite
        if not keep.any():
            return
        ids, losses = unique_last(ids[keep], losses[keep])
        self._recorded_losses += len(ids)
        if self._writes_tables:  # a node's shared tables are written by one rank
            self._record(ids, losses)

    def tables(self) -> dict[str, np.ndarray]:
        """The per-sample tables themselves, not copies (checkpoints write them, debug_sync hashes them)."""
        return self._tables()

    def table_specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of each per-sample table: what a shared copy of the tables must hold."""
        return {name: (table.shape, table.dtype) for name, table in self.tables().items()}

    def share_tables(self, tables: dict[str, np.ndarray], writes: bool) -> None:
        """Use `tables` (arrays mapped from memory the node's ranks share) in place of this pruner's
        own, still all zero. The rank that `writes` records every update in them; the others keep
        counting but leave the tables alone, so that the gathered updates are written once per node.
        Their readers must wait for the writer before `plan()` (the loop's barrier does)."""
        mine = self._tables()
        if set(tables) != set(mine):
            raise ValueError(f"shared tables {sorted(tables)} are not this pruner's {sorted(mine)}")
        for name, table in tables.items():
            if table.shape != mine[name].shape or table.dtype != mine[name].dtype:
                raise ValueError(
                    f"shared table {name!r} is {table.dtype}{list(table.shape)}, "
                    f"expected {mine[name].dtype}{list(mine[name].shape)}"
                )
            setattr(self, "_" + name, table)  # every table `x` of `_tables()` is the attribute `_x`
        if set(map(id, self._tables().values())) != set(map(id, tables.values())):
            raise TypeError(f"{type(self).__name__}: each table `x` of _tables() must be the attribute `_x`")
        self._writes_tables = bool(writes)

    def on_step(self, lr: float) -> None:
        """Called after each optimizer step with that step's learning rate (default: unused)."""

    def stats(self) -> dict[str, Any]:
        """Numbers for the run log: kept fraction of the planned pass, skipped counts, refused losses."""
        plan = self._plan
        kept = self.num_samples - self._skipped_this_pass if plan is not None else self.num_samples
        stats = {
            "pruner": self.name,
            "pass_index": self.pass_index,
            "kept_fraction": kept / self.num_samples,
            "kept_this_pass": kept,
            "skipped_this_pass": self._skipped_this_pass,
            "pruned_so_far": self._skipped_in_earlier_passes + self._skipped_this_pass,
            "candidate_keep_prob": 1.0 if plan is None else plan.keep_prob,
            "recorded_losses": self._recorded_losses,
            "nonfinite_losses": self._nonfinite_losses,
        }
        stats.update(self._extra_stats())
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain numbers only (loads with `torch.load(weights_only=True)`).

        Like `nn.Module.state_dict()`, the tensors share memory with the pruner: copy them if the
        save runs while training continues.
        """
        import torch

        return {
            "pruner": self.name,
            "num_samples": self.num_samples,
            "num_passes": self.num_passes,
            "seed": self.seed,
            "hparams": dict(self.hparams),
            "plan": None if self._plan is None else self._plan.to_state(),
            "tables": {name: torch.from_numpy(table) for name, table in self._tables().items()},
            "counters": {
                "nonfinite_losses": self._nonfinite_losses,
                "recorded_losses": self._recorded_losses,
                "skipped_in_earlier_passes": self._skipped_in_earlier_passes,
                "skipped_this_pass": self._skipped_this_pass,
            },
            "scalars": self._scalars(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by the same pruner with the same config (a mismatch raises)."""
        mine = {
            "pruner": self.name,
            "num_samples": self.num_samples,
            "num_passes": self.num_passes,
            "seed": self.seed,
            "hparams": self.hparams,
        }
        differing = [
            f"{key}: saved {state.get(key)!r}, configured {value!r}"
            for key, value in mine.items()
            if state.get(key) != value
        ]
        if differing:
            raise ValueError("pruner state does not match this pruner's config (" + "; ".join(differing) + ")")
        tables = self._tables()
        if set(state["tables"]) != set(tables):
            raise ValueError(f"pruner state has tables {sorted(state['tables'])}, expected {sorted(tables)}")
        for name, table in tables.items():
            saved = state["tables"][name]
            if callable(saved):  # a reader that streams the saved table into ours (pipelines/checkpoint)
                if self._writes_tables:
                    saved(table)
                continue
            saved = saved.numpy()
            if saved.shape != table.shape or saved.dtype != table.dtype:
                raise ValueError(
                    f"pruner state table {name!r} is {saved.dtype}{list(saved.shape)}, "
                    f"expected {table.dtype}{list(table.shape)}"
                )
            if self._writes_tables:  # a node's other ranks see what its writer copies
                table[...] = saved  # copy: two pruners loaded from one state must not share tables
        counters = state["counters"]
        self._nonfinite_losses = int(counters["nonfinite_losses"])
        self._recorded_losses = int(counters["recorded_losses"])
        self._skipped_in_earlier_passes = int(counters["skipped_in_earlier_passes"])
        self._skipped_this_pass = int(counters["skipped_this_pass"])
        plan = state["plan"]
        self._plan = None if plan is None else FrozenPlan.from_state(plan, self.seed, self.num_samples)
        self._load_scalars(state["scalars"])

    @classmethod
    def hparam_defaults(cls) -> dict[str, Any]:
        """The keyword-only hyper-parameters of `__init__` with their defaults."""
        parameters = inspect.signature(cls.__init__).parameters.values()
        return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "seed"}

    # -- helpers for subclasses ----------------------------------------------------------------

    def _full_plan(self, pass_index: int) -> FrozenPlan:
        return FrozenPlan(self.seed, pass_index, self.num_samples, 1.0, None)

    def _candidate_plan(
        self, pass_index: int, keep_prob: float, candidates: Bitmap | None, rescale: bool = True
    ) -> FrozenPlan:
        if candidates is not None:
            candidates.packed.flags.writeable = False  # the plan is frozen: nothing may edit it mid-pass
        return FrozenPlan(self.seed, pass_index, self.num_samples, float(keep_prob), candidates, bool(rescale))

    def _per_sample_plan(self, pass_index: int, keep_probs: np.ndarray, rescale: bool = True) -> FrozenPlan:
        keep_probs.flags.writeable = False
        return FrozenPlan(
            self.seed,
            pass_index,
            self.num_samples,
            float(keep_probs.mean(dtype=np.float64)),
            None,
            bool(rescale),
            keep_probs,
        )

    def __repr__(self) -> str:
        hparams = ", ".join(f"{key}={value!r}" for key, value in self.hparams.items())
        return (
            f"{type(self).__name__}(num_samples={self.num_samples}, num_passes={self.num_passes}, "
            f"seed={self.seed}, {hparams})"
        )


def check_flag(pruner: str, name: str, value: Any) -> bool:
    """A true/false hyper-parameter, or a ValueError naming the field."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{pruner}: {name} must be true or false, got {value!r}")
    return bool(value)


def check_range(
    pruner: str, name: str, value: float, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> float:
    """A hyper-parameter in its interval, or a ValueError naming the field and the accepted range."""
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high or not math.isfinite(value):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{pruner}: {name} must be in {interval}, got {value}")
    return value
