"""The cluster rehearsal (tools/benchmarks/rehearse_cluster.py): two emulated nodes of two ranks each on gloo, one
node SIGKILLed after a mid-pass checkpoint, a requeue with checkpoint.resume=latest, against a run
never interrupted. Slow: three runs of four processes and their start-ups, about 1.5 minutes on 2
cores; `make test-slow` runs it."""

from __future__ import annotations

import pytest

from prunepipe.tools.benchmarks.rehearse_cluster import rehearse


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict:
    return rehearse(str(tmp_path_factory.mktemp("rehearsal")))


@pytest.mark.slow
def test_surviving_node_exits_by_itself_and_the_requeue_resumes_mid_pass(rehearsal):
    assert rehearsal["survivor_exit_code"] not in (None, 0), "the surviving node failed fast instead of hanging"
    assert rehearsal["resume_checkpoint"]["batch_in_pass"] > 0, "resumed inside a pass"
    assert rehearsal["killed_after_step"] > rehearsal["resume_checkpoint"]["step"], "the kill lost steps"
    counted = ("steps_in_pass", "kept_samples", "samples_forwarded", "optimizer_steps", "tail")
    assert not [p for p in rehearsal["problems"] if any(f" {field}:" in p for field in counted)], rehearsal["problems"]
    assert any(
        r["kept_samples"] < rehearsal["pass_summaries"][0]["kept_samples"] for r in rehearsal["pass_summaries"][1:]
    ), "InfoBatch pruned"


@pytest.mark.slow
def test_requeued_run_ends_bitwise_equal_to_the_uninterrupted_one(rehearsal):
    assert rehearsal["pass"], rehearsal["problems"]


@pytest.mark.slow  # three runs of four processes on the tiny bucketed PixArt, about a minute on 2 cores
def test_a_bucketed_text_to_image_run_requeued_mid_pass_ends_bitwise_equal(tmp_path):
    """The same node death and requeue on aspect-ratio buckets: four latent shapes, batches of one bucket."""
    verdict = rehearse(str(tmp_path), buckets=True)
    assert verdict["pass"], verdict["problems"]
    assert verdict["resume_checkpoint"]["batch_in_pass"] > 0, "resumed inside a pass"
    assert "buckets" in verdict["compared"]["pass_fields"]


@pytest.mark.slow  # three runs of four processes, about 2 minutes on 2 cores
def test_a_fsdp_run_requeued_mid_pass_ends_bitwise_equal_optimizer_included(tmp_path):
    """The same node death and requeue with the model, AdamW and the EMA sharded over the four ranks."""
    verdict = rehearse(str(tmp_path), strategy="fsdp")
    assert verdict["pass"], verdict["problems"]
    assert verdict["resume_checkpoint"]["batch_in_pass"] > 0, "resumed inside a pass"
    assert verdict["compared"]["optimizer_tensors"] > 0, "AdamW's moments compared"
