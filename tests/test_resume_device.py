"""What a checkpoint brings back lands on the model's device (accelerate loads registered objects
with map_location="cpu": left there, after a resume on a GPU the EMA would sit on the host and its
first step would raise). Without a GPU, the `meta` device stands in for it: any tensor left on the
CPU shows."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from prunepipe.pipelines.training.ema import PassProgressEMA


def test_a_resumed_ema_stays_on_the_device_of_the_weights_it_follows(tmp_path):
    saver = Accelerator(cpu=True)
    trained = torch.nn.Linear(4, 3)
    ema = PassProgressEMA(list(trained.parameters()), decay=0.9, warmup="passes", full_steps_per_pass=10)
    ema.step(list(trained.parameters()), progress=0.1)
    saver.register_for_checkpointing(ema)
    saver.save_state(str(tmp_path / "ckpt"))

    resumer = Accelerator(cpu=True)
    on_device = torch.nn.Linear(4, 3, device="meta")  # the weights of a run on an accelerator
    resumed = PassProgressEMA(list(on_device.parameters()), decay=0.9, warmup="passes", full_steps_per_pass=10)
    resumer.register_for_checkpointing(resumed)
    resumer.load_state(str(tmp_path / "ckpt"))

    assert [p.device.type for p in resumed.shadow_params] == ["meta", "meta"]
    assert resumed.optimization_step == ema.optimization_step
    resumed.step(list(on_device.parameters()), progress=0.2)  # mixing devices raised here
