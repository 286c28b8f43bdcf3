"""What a checkpoint brings back lands on the model's device (its named parts are read with
map_location="cpu", pipelines/checkpoint/parts.py: left there, after a resume on a GPU the EMA would sit on the host and its
first step would raise). Without a GPU, the `meta` device stands in for it: any tensor left on the
CPU shows."""

from __future__ import annotations

import torch

from prunepipe.pipelines.checkpoint.parts import CheckpointParts
from prunepipe.pipelines.training.ema import PassProgressEMA


def test_a_resumed_ema_stays_on_the_device_of_the_weights_it_follows(tmp_path):
    trained = torch.nn.Linear(4, 3)
    ema = PassProgressEMA(list(trained.parameters()), decay=0.9, warmup="passes", full_steps_per_pass=10)
    ema.step(list(trained.parameters()), progress=0.1)
    CheckpointParts(ema=ema).save(str(tmp_path))

    on_device = torch.nn.Linear(4, 3, device="meta")  # the weights of a run on an accelerator
    resumed = PassProgressEMA(list(on_device.parameters()), decay=0.9, warmup="passes", full_steps_per_pass=10)
    CheckpointParts(ema=resumed).load(str(tmp_path))

    assert [p.device.type for p in resumed.shadow_params] == ["meta", "meta"]
    assert resumed.optimization_step == ema.optimization_step
    resumed.step(list(on_device.parameters()), progress=0.2)  # mixing devices raised here
