"""A checkpoint's parts are files named for what they hold, whichever options are on, and a part
the run keeps and the checkpoint lacks (or the reverse) is refused by name, never loaded into
another part as accelerate's numbered custom_checkpoint_N.pkl files could be."""

from __future__ import annotations

import os

import pytest
import torch

from prunepipe.pipelines.checkpoint.parts import CheckpointParts, is_part_file, read_part


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state: dict) -> None:
        self.value = int(state["value"])


def test_each_part_is_a_file_of_its_own_name_and_loads_back_by_name(tmp_path):
    CheckpointParts(position=Counter(3), timestep_sampler=Counter(7), score_normaliser=None).save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["position.pt", "timestep_sampler.pt"]
    assert all(is_part_file(name) for name in os.listdir(tmp_path)) and not is_part_file("optimizer.bin")
    position, sampler = Counter(), Counter()
    CheckpointParts(position=position, timestep_sampler=sampler).load(str(tmp_path))
    assert (position.value, sampler.value) == (3, 7)
    assert int(read_part(str(tmp_path), "position")["value"]) == 3 and read_part(str(tmp_path), "ema") is None


def test_a_part_the_run_keeps_and_the_checkpoint_lacks_is_refused_by_name(tmp_path):
    CheckpointParts(position=Counter(3), timestep_sampler=Counter(7)).save(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"holds no score_normaliser.pt, which this run keeps; holds timestep_sampler.pt"
    ):
        CheckpointParts(position=Counter(), score_normaliser=Counter()).load(str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint parts \['optimiser'\]"):
        CheckpointParts(optimiser=Counter())
