"""The EMA of the trained weights: diffusers' EMAModel, kept on the device of the weights it follows.

accelerate loads registered objects with map_location="cpu" and EMAModel.load_state_dict adopts the
loaded tensors as they are, so after a resume on a GPU the shadow weights would sit on the host and
the first `step` would mix devices (issue 21). Loading here puts them back where they were.
"""

from __future__ import annotations

from diffusers.training_utils import EMAModel


class DeviceEMA(EMAModel):
    """EMAModel whose `load_state_dict` leaves the shadow weights on the device they had."""

    def load_state_dict(self, state_dict: dict) -> None:
        placed = self.shadow_params[0] if self.shadow_params else None
        super().load_state_dict(state_dict)
        if placed is not None:
            self.to(device=placed.device)
