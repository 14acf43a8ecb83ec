"""``import --schema megatron``: the HF tensors as megatron-core ``torch_dist`` tensors, and megatron's side files.

The element plan is the ``megatron-gpt`` adapter's (:func:`~ckpttool.model.adapters.megatron.megatron_from_hf`):
one megatron tensor per stacked layer tensor, each layer row made of byte runs of the HF
safetensors files (``q/k/v_proj`` interleaved per query group, ``gate_proj`` then ``up_proj``).
Beside the DCP files it writes what ``megatron.core.dist_checkpointing.save`` writes
(``megatron/core/dist_checkpointing/serialization.py``, ``strategies/common.py``):

- ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1,
  "common_backend": "torch", "common_backend_version": 1}``;
- ``common.pt``: ``torch.save`` of the non-sharded values, ``{"checkpoint_version": 3.0, "iteration": 0}``
  (Megatron-LM's trainer keys; no optimizer: load it with ``--finetune`` / ``--no-load-optim``);
- one ``_extra_state`` byte item per linear layer (and expert), ``torch.save([None])`` as
  megatron's own linear layers save it.

``docs/import.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import ExportError
from ckpttool.format.metadata import DType
from ckpttool.model.adapters import AdapterConfig
from ckpttool.model.adapters.megatron import megatron_from_hf
from ckpttool.model.hfconfig import config_value, tie_word_embeddings

__all__ = ["EXTRA_STATE_VALUE", "MegatronTensor", "megatron_natives", "write_megatron_files"]

#: the value megatron-core's own ``ColumnParallelLinear`` / ``RowParallelLinear`` keep as ``_extra_state``
EXTRA_STATE_VALUE: list[None] = [None]
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
COMMON = {"checkpoint_version": 3.0, "iteration": 0}


@dataclass(frozen=True)
class MegatronTensor:
    """One tensor to write: ``rows`` are per dim-0 row its ``(file, byte offset, bytes)`` runs; ``flat``: stored as is."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    rows: list[list[tuple[str, int, int]]]
    flat: tuple[str, int] | None


def megatron_natives(
    sources: dict[str, Any], config: Any, acfg: AdapterConfig
) -> tuple[list[MegatronTensor], dict[str, list[str]], tuple[str, ...]]:
    """The megatron tensors to write (byte runs per layer row), the HF keys skipped, the ``_extra_state`` keys.

    ``sources``: HF key -> its stored tensor (``file``, data ``offset``, ``dtype`` name, ``shape``).

    Raises:
        ExportError (E601): as :func:`~ckpttool.model.adapters.megatron.megatron_from_hf`; the
            HF tensors gathered into one megatron tensor differ in dtype.
    """
    n_layers = config_value(config, "num_hidden_layers")
    tie = tie_word_embeddings(config) is True
    plan = megatron_from_hf(
        {k: s.shape for k, s in sources.items()},
        acfg,
        n_layers if isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers >= 0 else None,
        tie,
    )
    out: list[MegatronTensor] = []
    for t in plan.tensors:
        dtypes = {sources[k].dtype for row in t.rows for k, _, _ in row}
        if len(dtypes) != 1:
            raise ExportError(
                f"{t.key}: gathers HF tensors of dtypes {sorted(dtypes)}; one megatron tensor has one dtype",
                fqn=t.key,
                hint="convert the HF model to one dtype first",
            )
        dtype = dtypes.pop()
        item = DType(dtype).itemsize
        rows = [
            [(sources[k].file, sources[k].offset + first * item, n * item) for k, first, n in row] for row in t.rows
        ]
        if len(t.rows) == 1 and not t.key.startswith("decoder.layers."):  # a top-level tensor: stored as is
            (k, _, _) = t.rows[0][0]
            out.append(MegatronTensor(t.key, dtype, t.shape, [], (sources[k].file, sources[k].offset)))
        else:
            out.append(MegatronTensor(t.key, dtype, t.shape, rows, None))
    return out, plan.skipped, plan.extra_state


def write_megatron_files(tmp: Path, fsync: bool) -> list[str]:
    """Write ``metadata.json`` and ``common.pt`` into the output directory ``tmp``; their names.

    Raises:
        OutputError: a write failed.
    """
    import os

    from ckpttool.errors import OutputError
    from ckpttool.format.writer import torch_save_bytes

    names = []
    for name, data in (
        ("metadata.json", json.dumps(METADATA_JSON).encode()),
        ("common.pt", torch_save_bytes(dict(COMMON))),
    ):
        path = tmp / name
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{path}: cannot write ({e.strerror})", path=path) from e
        names.append(name)
    return names
