"""``nemo-automodel``: NeMo Automodel's ``Checkpointer`` (``nemo_automodel/components/checkpoint/checkpointing.py``, 0.7).

Its default save (``model_save_format="safetensors"``) writes ``epoch_E_step_S/model/`` with torch's
``HuggingFaceStorageWriter`` (per-rank ``shard-*.safetensors``, no ``.metadata``; beside them
``.hf_metadata/`` with ``config.json`` and, when consolidated, ``consolidated/``) and
``epoch_E_step_S/optim/`` with ``dcp.save`` of its ``OptimizerState``: ``optim.state.<hf fqn>.<field>``,
``optim.param_groups.<hf fqn>.<hyper>`` (flattened) and the LR scheduler under ``sched.``. The
step directory is opened as the ``model``/``optim`` folder pair (safetensors model windows read
raw, the optimizer's ``.distcp`` archives as archives). Model keys are HF names at the top level.

``model/consolidated/`` (``save_consolidated``) is an HF copy of the same weights (``model-*.safetensors``
+ index + config), consolidated from the shards: validate ``--deep`` compares it with them (D012
``hf-copy-differs``), ``inspect`` names it. ``.hf_metadata/`` holds the HF ``config.json`` (the model
assets export uses). Step directories are ``epoch_<E>_step_<S>`` (ordered by step, then epoch);
With ``is_peft`` (LoRA), ``model/`` holds PEFT's files instead (``adapter_model.safetensors`` with PEFT's saved names
``base_model.model.<hf fqn>.lora_A.weight``, ``adapter_config.json``): the model prefix is ``base_model.model.``, so
that the model fqns are the optimizer's.
``LATEST`` (a relative symlink, or ``LATEST.txt``) names the last published one and ``.incomplete``
marks a save that has not finished (``nemo_automodel/components/checkpoint/utils.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckpttool.model.schemas.base import Detected, Discovery, SchemaSpec

__all__ = ["CONSOLIDATED", "HF_METADATA", "INCOMPLETE_MARKER", "ITEMS", "SPEC", "STEP_RE", "hf_copies"]

CONSOLIDATED = "consolidated"
HF_METADATA = ".hf_metadata"
#: NeMo Automodel's in-progress marker in a step directory (``mark_checkpoint_incomplete``)
INCOMPLETE_MARKER = ".incomplete"
#: ``epoch_<E>_step_<S>`` (``recipes/base_recipe.py``)
STEP_RE = re.compile(r"epoch_(?P<epoch>[0-9]+)_step_(?P<step>[0-9]+)\Z")


def hf_copies(root: Path, model_dir: Path | None) -> list[str]:
    """The consolidated HF copy's safetensors files beside a model folder, relative to ``root`` (sorted).

    ``model_dir/consolidated/*.safetensors`` (regular files only); ``[]`` when there is none or
    ``model_dir`` is not below ``root``.
    """
    if model_dir is None:
        return []
    d = model_dir / CONSOLIDATED
    try:
        rel = d.relative_to(root)
        names = sorted(
            e.name for e in os.scandir(d) if e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False)
        )
    except (OSError, ValueError):
        return []
    return [str(rel / n) for n in names]


#: The training-state items NeMo Automodel's ``OptimizerState`` saves beside the optimizer.
ITEMS = ("sched",)


#: The model prefix of its PEFT save: ``model/adapter_model.safetensors`` holds PEFT's saved names
#: (``base_model.model.<hf fqn>.lora_A.weight``) while ``optim/`` names the parameters ``<hf fqn>``.
PEFT_MODEL_PREFIX = "base_model.model."


def _claims(d: Detected) -> bool:
    return (
        d.optimizer_prefix == "optim."
        and d.model_prefix in ("", None, PEFT_MODEL_PREFIX)
        and "sched" in d.training_state
    )


SPEC = SchemaSpec(
    name="nemo-automodel",
    model_prefix="",
    optimizer_prefix="optim.",
    claims=_claims,
    priority=25,
    optimizer_heads=("optim",),
    training_state_items=ITEMS,
    discovery=Discovery(
        step_words=("step",),
        latest_files=("LATEST", "LATEST.txt"),
        # find_latest_checkpoint: a LATEST whose target is no directory is passed over for the highest complete step
        latest_fallback=("LATEST", "LATEST.txt"),
        step_patterns=(STEP_RE,),
        incomplete_markers=(INCOMPLETE_MARKER,),
    ),
    # recipes/llm/train_ft.py (and vlm, kd, seq_cls, bi-encoder): save_checkpoint(epoch, step_scheduler.step) in the
    # loop body, after the optimizer step and before StepScheduler.__iter__ increments its step (from 0): the save
    # after N optimizer steps is epoch_E_step_{N-1}, its step_scheduler.pt holding step N (state_dict: step + 1);
    # the speculative-decoding recipes (train_eagle*, train_dflash) name it by runtime.global_step, N: N or N + 1
    step_dir_is_trainer_step=True,
    step_dir_range=(0, 1),
    doc_model="`<hf fqn>` (top level; `model/` safetensors; a PEFT save: `base_model.model.<hf fqn>`)",
    doc_optimizer="`optim.state.<hf fqn>.<field>` (flattened; `optim/` DCP)",
    doc_written_by="NeMo Automodel's `Checkpointer` (`epoch_E_step_S/model/` + `optim/`, `sched`)",
)
