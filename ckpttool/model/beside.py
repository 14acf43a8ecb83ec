"""Training state a trainer saves beside the DCP checkpoint that was opened.

OLMo-core's ``Checkpointer`` (``olmo_core/train/checkpoint.py``) writes ``stepN/model_and_optim/``
(the DCP checkpoint) and, beside it, ``stepN/train/rank{R}.pt`` (``torch.save`` of the trainer's
``state_dict()`` on each rank: ``global_step``, ``global_train_tokens_seen``, RNG, data loader) and
``stepN/.metadata.json``. :func:`read_training_state_beside` reads the rank files with ckpttool's
safe loader (the zip checked, the pickle by the allow-list unpickler, tensors described, never
loaded; OLMo-core never imported): ``inspect`` shows their counters, rule ``R002`` compares
``global_step`` with the optimizer's step, rule ``K011`` names a file that could not be read.
Torch-free.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.format.jsonview import json_fields

__all__ = ["TrainerState", "read_training_state_beside", "training_state_beside"]

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


@dataclass(frozen=True)
class TrainerState:
    """One rank's trainer-state file beside the checkpoint.

    Attributes:
        file: its path relative to the step directory (``train/rank0.pt``).
        values: its top-level numbers (``global_step``, ``global_train_tokens_seen``, ``epoch``...).
        keys: its top-level keys (``rng``, ``data_loader``... included).
        error: why it could not be read (``None``: read).
    """

    file: str
    values: dict[str, int | float] = field(default_factory=dict)
    keys: tuple[str, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self, values=dict(self.values))


def read_training_state_beside(model_dir: Path) -> list[TrainerState]:
    """Read every :func:`training_state_beside` file (a file that cannot be read gets its ``error``).

    Each file is read whole up to the object cap (``--max-object-size``) and loaded by
    :func:`ckpttool.format.reader.load_saved_object` with ``tensors="describe"``: a pickle that
    needs a global outside the allow-list is not run (its ``error`` says so).
    """
    from ckpttool.errors import CkptError
    from ckpttool.format import limits
    from ckpttool.format.files import read_regular
    from ckpttool.format.reader import load_saved_object

    out = []
    for rel in training_state_beside(model_dir):
        path = model_dir.parent / rel
        try:
            obj = load_saved_object(
                read_regular(path, limits.current().max_object_bytes, what="trainer state"),
                str(path),
                tensors="describe",
            )
        except CkptError as e:
            out.append(TrainerState(rel, error=str(e).splitlines()[0][:300]))
            continue
        if not isinstance(obj, dict):
            out.append(TrainerState(rel, error=f"holds a {type(obj).__name__}, not the trainer's state dict"))
            continue
        values = {str(k): v for k, v in obj.items() if type(v) in (int, float)}
        out.append(TrainerState(rel, values, tuple(str(k) for k in obj)))
    return out
