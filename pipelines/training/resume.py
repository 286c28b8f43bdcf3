"""Where a run starts: its newest intact checkpoint (checkpoint.resume), else a stage's first start from
another run's weights (init.weights), else afresh; and what a resume refuses because the run would
no longer be the one it continues: another text encoder behind the features, another mixture.
Every rank reaches the same answer (rank 0 chooses the folder; the checks read agreed values).
"""

from __future__ import annotations

import json

import numpy as np

from prunepipe.pipelines.checkpoint.parts import EMA, POSITION, CheckpointParts
from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.checkpoint.sharded import TrainingState
from prunepipe.pipelines.checkpoint.store import abandon_newer, choose_resume, load_resume
from prunepipe.pipelines.config import RunConfig
from prunepipe.pipelines.data.mixture import Mixture
from prunepipe.pipelines.progress import position_label
from prunepipe.pipelines.ranks import same_on_every_rank
from prunepipe.pipelines.training.init_weights import init_from_weights
from prunepipe.pipelines.training.sources import check_same_mixture


def agree_on_text(task) -> None:
    """Every rank loaded the same text encoder (or its features' record) from its node, or every rank
    raises naming them all (collective for a text-conditional task only, which every rank builds alike)."""
    text = task.text
    if text is not None and text.identity:
        same_on_every_rank(
            text.identity, f"{text.encoder}: {text.identity}", "text encoders (files and caption length)"
        )


def resume_or_start(
    cfg: RunConfig,
    accelerator,
    state: TrainingState,
    parts: CheckpointParts,
    model,
    task,
    mixture: Mixture,
    *,
    announce: bool,
) -> str | None:
    """Load the newest intact checkpoint (or checkpoint.resume's) into the model, optimizer and EMA weights
    (`state`) and `parts`, or on a stage's first start init.weights into the bare `model` and the EMA;
    then check the resumed position (the position part) against this run's text encoder and mixture.
    A rollback (resuming from a checkpoint that is not the newest) sets the newer ones aside. Returns the
    checkpoint resumed from, None on a fresh start."""
    position, ema = parts.parts[POSITION], parts.parts[EMA].ema
    resume_from = choose_resume(accelerator, cfg.checkpoint.resume, cfg.run_dir)  # the newest intact checkpoint
    if resume_from is not None:
        load_resume(resume_from, state, parts)
        if accelerator.is_main_process:
            abandon_newer(cfg.run_dir, resume_from)
        if announce:
            print(
                f"resumed from {resume_from}: {position_label(position.pass_index, position.batch_in_pass, cfg.num_passes)}, "
                f"step {position.optimizer_steps}"
            )
    # a stage's first start: another run's weights and EMA (init.weights); a resume wins (docs/recipes.md, "Stages")
    init_from_weights(cfg, accelerator.unwrap_model(model), ema, resumed_from=resume_from, announce=announce)
    check_same_text(cfg, position, task, resume_from)
    position.mixture = check_same_mixture(mixture, position.mixture, resume_from)
    if position.forwarded_by_source is None:
        position.forwarded_by_source = np.zeros(len(mixture.sources), dtype=np.int64)
    check_same_buckets(position, mixture, resume_from)
    return resume_from


def check_same_buckets(position: TrainingPosition, mixture: Mixture, resume_from: str | None) -> None:
    """A resumed run trains on the aspect-ratio buckets it trained on: shards encoded with another
    `--buckets` table hold other ids (each input shard's samples are grouped by bucket), so the pruner's
    scores would follow other samples. The position records the table (names and shapes, "" unbucketed)
    and counts each bucket's forwarded samples."""
    index = mixture.index
    table = [[name, list(shape)] for name, shape in zip(index.bucket_names, index.bucket_shapes)]
    record = json.dumps(table) if table else ""
    if resume_from is not None and position.buckets != record:
        raise ValueError(
            f"{resume_from} trained on aspect-ratio buckets {position.buckets or 'none'}, data.train "
            f"({index.path}) has {record or 'none'}: latents encoded with another --buckets table (or none) "
            f"hold other ids; resume on the shards the run trained on, or start a new run"
        )
    position.buckets = record
    if position.forwarded_by_bucket is None and table:
        position.forwarded_by_bucket = np.zeros(len(table), dtype=np.int64)


def check_same_text(cfg: RunConfig, position: TrainingPosition, task, resume_from: str | None) -> None:
    """A resumed text-conditional run trains on the features of the encoder it trained on (alike on
    every rank: agreed by `agree_on_text`); the position records this run's."""
    text_identity = task.text.identity if task.text is not None else ""  # "" unless text-conditional
    if position.text_identity and position.text_identity != text_identity:
        raise ValueError(
            f"{resume_from}: the run trained on the features of text encoder {position.text_identity}; "
            f"this config's ({task.text.encoder if task.text is not None else 'none'}) is {text_identity or 'none'}. "
            f"Resume with the run's encoder (or its features), or start a new run"
        )
    position.text_identity = text_identity
