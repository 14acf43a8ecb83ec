"""Training state a trainer saves beside the DCP checkpoint that was opened (files ckpttool does not read).

OLMo-core's ``Checkpointer`` (``olmo_core/train/checkpoint.py``) writes ``stepN/model_and_optim/``
(the DCP checkpoint) and, beside it, ``stepN/train/rank{R}.pt`` (the trainer state of each rank:
step, tokens seen, RNG, data loader) and ``stepN/.metadata.json``. Rule ``K011`` names them, so a
check of the model and optimizer never reads as a check of the whole training state. Torch-free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["training_state_beside"]

_RANK_PT = re.compile(r"^rank(\d+)\.pt$")


def training_state_beside(model_dir: Path) -> list[str]:
    """Paths (relative to the opened directory's parent) of training-state files saved beside it.

    ``train/rank{R}.pt`` files (OLMo-core), by rank; ``[]`` when there are none or the parent
    cannot be listed.
    """
    train = model_dir.parent / "train"
    try:
        names = os.listdir(train)
    except OSError:
        return []
    ranks = sorted((int(m.group(1)), n) for n in names if (m := _RANK_PT.match(n)))
    return [f"train/{n}" for _, n in ranks]
