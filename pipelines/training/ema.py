"""The moving average of the trained weights: diffusers' EMAModel with its warmup counted in pass
progress, or none, never in the run's own optimizer steps, and kept on the weights' device when a
checkpoint is loaded. Holds no model.

- A pruned run takes fewer steps per pass; with a step-counted warmup its EMA at pass p would average
  over a shorter horizon than the full run's at pass p, a confound in every EMA comparison of the two.
- a checkpoint's parts are read on the host (pipelines/checkpoint/parts.py) and EMAModel.load_state_dict adopts
  the loaded tensors as they are, so, left there, after a resume on a GPU the shadow weights would
  sit on the host and the first `step` would mix devices.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from diffusers.training_utils import EMAModel


class PassProgressEMA(EMAModel):
    """EMAModel (foreach updates; its state_dict is what checkpoints hold) whose decay depends on
    the pass progress each `step` is given.

    warmup="passes": diffusers' warmup 1 - (1 + n)^(-2/3), capped at `decay`, where n is not this
    run's step count but `progress x full_steps_per_pass`, the optimizer steps a full-data run has
    taken at the same progress: pruned and full runs share the decay pass for pass, and a full run
    gets diffusers' step-counted decay (0.999 after about 31,600 steps, 0.9999 after 1M).
    warmup="none": `decay` from the first step, DiT's constant 0.9999 (its train.py)."""

    def __init__(self, parameters, *, decay: float, warmup: str, full_steps_per_pass: float):
        super().__init__(parameters, decay=decay, use_ema_warmup=warmup == "passes", foreach=True)
        self.warmup, self.full_steps_per_pass = warmup, full_steps_per_pass
        self._progress = 0.0

    @classmethod
    def for_run(cls, cfg, parameters, samples_a_pass: int, world: int, device) -> PassProgressEMA:
        """The run's EMA of `parameters` on `device`, its warmup counted in the steps of a full pass of
        `samples_a_pass` samples over `world` ranks."""
        full_steps = samples_a_pass / (world * cfg.data.batch_size * cfg.optim.grad_accum)
        ema = cls(parameters, decay=cfg.ema_decay, warmup=cfg.ema_warmup, full_steps_per_pass=full_steps)
        ema.to(device)
        return ema

    @torch.no_grad()
    def step(self, parameters, progress: float) -> None:
        """Average in the weights reached at pass progress `progress` (pass_index + fraction of the pass):
        diffusers' foreach update, with frozen parameters (MAE's fixed positional tables) copied one by one,
        since DTensor has no sharding rule for the foreach copy diffusers uses."""
        self._progress = progress
        self.optimization_step += 1
        decay = self.cur_decay_value = self.get_decay(self.optimization_step)
        shadows, trained = [], []
        for shadow, param in zip(self.shadow_params, parameters, strict=True):
            if param.requires_grad:
                shadows.append(shadow)
                trained.append(param)
            else:
                shadow.copy_(param)
        if shadows:
            torch._foreach_sub_(shadows, torch._foreach_sub(shadows, trained), alpha=1 - decay)

    def get_decay(self, optimization_step: int) -> float:
        if self.warmup == "none":
            return self.decay
        full_run_steps = self._progress * self.full_steps_per_pass
        return min(self.decay, 1.0 - (1.0 + full_run_steps) ** -self.power)

    def load_state_dict(self, state_dict: dict) -> None:
        """diffusers' load, then the shadow weights back on the device they were on before it."""
        placed = self.shadow_params[0] if self.shadow_params else None
        super().load_state_dict(state_dict)
        if placed is not None:
            self.to(device=placed.device)


class EMASettings:
    """The EMA's checkpoint part beside its weights (which torch.distributed.checkpoint saves sharded as
    they are: pipelines/checkpoint/sharded.py): decay, step count and warmup, and the names of the
    parameters its weights follow, in order, so that one process can rebuild diffusers' state."""

    def __init__(self, ema: EMAModel, names: list[str]):
        self.ema, self.names = ema, names

    def state_dict(self) -> dict:
        state = {key: value for key, value in self.ema.state_dict().items() if key != "shadow_params"}
        return {**state, "names": list(self.names)}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        names = state.pop("names", None)
        if names is not None and list(names) != list(self.names):
            raise ValueError(
                f"the checkpoint's EMA follows {len(names)} parameters, this model has {len(self.names)} "
                f"(first difference: {next((a, b) for a, b in zip(names + [None], self.names + [None]) if a != b)})"
            )
        state.pop("shadow_params", None)
        self.ema.load_state_dict(state)


def with_ema_weights(model: nn.Module, ema: EMAModel) -> nn.Module:
    """A copy of `model` (the bare module) holding `ema`'s weights: what an export writes beside the live ones."""
    ema_model = copy.deepcopy(model)
    ema.copy_to(ema_model.parameters())
    return ema_model
