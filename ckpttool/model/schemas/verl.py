"""``verl``: verl's FSDP checkpoint manager (per-rank ``torch.save`` files, not DCP).

``global_step_<N>/actor/{model,optim,extra_state}_world_size_W_rank_R.pt`` assembled by
:mod:`ckpttool.format.perrank_formats` into torch's flattened keys: ``model.<fqn>``,
``optimizer.state.<fqn>.<field>`` (verl saves the index-keyed ``optimizer.state_dict()``; index
``i`` is the model's ``i``-th parameter), ``lr_scheduler.<field>``. Chosen by the per-rank
format, never by key detection.
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Discovery, per_rank_spec

__all__ = ["SPEC"]


SPEC = per_rank_spec(
    "verl",
    priority=90,
    # ray_trainer._save_checkpoint: global_step_N/actor/, global_step_N/critic/ (each a checkpoint of its
    # own), then global_step_N/data.pt (torch.save of the data loader's state_dict, loaded on resume).
    discovery=Discovery(
        step_words=("global_step",),
        step_folders=(("actor", ("critic",)), ("critic", ("actor",))),
        # ray_trainer._load_checkpoint: find_latest_ckpt_path reads only the tracker (written after each save,
        # not with async_save); without it resume_mode auto prints "Training from scratch" and loads no step.
        # SkyRL (derived from verl) saves the same per-rank files in global_step_N/policy/ and resumes
        # (resume_mode latest) from its own tracker, latest_ckpt_global_step.txt: a root holding it is SkyRL's run
        # SkyRL's load_checkpoints (resume_mode latest) loads global_step_<int(file)>
        latest_files=("latest_ckpt_global_step.txt",),
        latest_required=(
            (
                "latest_checkpointed_iteration.txt",
                "verl's resume (resume_mode auto: find_latest_ckpt_path) loads no step and trains from scratch; "
                "resume_mode resume_path with resume_from_path set to the step directory loads it",
            ),
            (
                "latest_ckpt_global_step.txt",
                "SkyRL's resume (resume_mode latest) loads no step and trains from scratch",
            ),
        ),
    ),
    # ray_trainer.fit saves global_step_N after the N-th training step; the actor's LR scheduler steps once per
    # update_actor (engine_workers.train_mini_batch: update_lr_scheduler on its last mini-batch), which skips the
    # critic_warmup steps, and the optimizer once per mini-batch, ppo_epochs times (a non-finite grad norm skips one):
    # last_epoch is N, or behind it, never ahead; the optimizer's step is not a count of training steps
    step_dir_is_trainer_step=True,
    step_dir_range=(None, 0),
    several_optimizer_steps_per_step=True,
    doc_optimizer="`optimizer.state.<fqn>.<field>` (assembled; index -> fqn)",
    doc_written_by="verl's `FSDPCheckpointManager`: per-rank `{model,optim,extra_state}_world_size_W_rank_R.pt`",
)
