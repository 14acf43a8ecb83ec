"""``ckpttool stamp``'s library function: record a declared EP layout as a sidecar ``layout.json``.

For checkpoints saved without a layout record: the declaration (``--source-layout``,
``--ep-size``, ``--ep-fsdp-size``) is checked against the chunk geometry of every EP
tensor (:func:`~ckpttool.layouts.declare.resolve_layout`), then written atomically
(temp file + rename) as ``layout.json`` beside ``.metadata``. Only that file is
added; nothing of the checkpoint itself changes.

Refusals: a record (embedded, or an earlier sidecar) that the declaration
contradicts (``E404``; a wrong sidecar must be removed by hand first), a
declaration that contradicts the chunk geometry (``E404``). Stamping what is
already recorded is a no-op.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import build_catalog
from ..dcp.reader import CheckpointReader
from ..errors import LayoutError
from ..output import atomic_write_text
from .declare import LayoutDeclaration, resolve_layout
from .geometry import ep_geometry
from .plan import implied_optimizer, make_record
from .record import SIDECAR_NAME, parse_layout_record

__all__ = ["StampResult", "stamp"]


@dataclass
class StampResult:
    """Outcome of :func:`stamp` (``ckpttool stamp --json``, schema ``ckpttool.stamp/1``).

    Attributes:
        path: the sidecar path.
        written: ``False`` when the same record was already there (embedded or sidecar).
        record: the record (as written, or as found).
        ep_tensors: EP tensors it names; same_dim: those sharded by EP and FSDP on one dim.
    """

    path: str
    written: bool
    record: dict[str, Any]
    ep_tensors: int
    same_dim: int

    def to_json(self) -> dict[str, Any]:
        return {"schema": "ckpttool.stamp/1", **self.__dict__}


def stamp(path: str | os.PathLike[str], declaration: LayoutDeclaration, *, trust_pickle: bool = False) -> StampResult:
    """Write ``layout.json`` for a declared layout after checking it against the chunk geometry.

    Args:
        path: checkpoint directory.
        declaration: the declared layout (all three fields set).
        trust_pickle: allow ``weights_only=False`` for byte items that need it.

    Returns:
        A :class:`StampResult`.

    Raises:
        LayoutError: contradiction with a record or the geometry (E404), embedded record and
            sidecar disagreeing (E403), an invalid record (E400-E402).
        OutputError: the directory is not writable.
    """
    p = Path(path)
    with CheckpointReader(p, trust_pickle=trust_pickle) as reader:
        cat = build_catalog(reader)
        layout = resolve_layout(cat, reader, declaration)
    sidecar = p / SIDECAR_NAME
    geo = ep_geometry(cat, layout)
    same = sum(1 for g in geo if g.same_dim)
    if layout.record is not None:
        # The record already says what was declared (resolve_layout refuses contradictions).
        return StampResult(str(sidecar), False, layout.record.raw, len(layout.ep_tensors), same)
    bad = [g for g in geo if g.problems]
    if bad:  # resolve_layout checked the declaration already; a programmer error if this fires
        raise LayoutError(f"{bad[0].key}: {bad[0].problems[0]}", fqn=bad[0].key, code="E404")
    assert declaration.version is not None and declaration.ep_size is not None and declaration.ep_fsdp_size is not None
    record = make_record(
        declaration.version, declaration.ep_size, declaration.ep_fsdp_size, layout.ep_tensors,
        optimizer=implied_optimizer(cat), extra={"stamped": True},
    )
    parse_layout_record(record, "new layout record")
    atomic_write_text(sidecar, json.dumps(record, sort_keys=True, indent=2) + "\n")
    return StampResult(str(sidecar), True, record, len(layout.ep_tensors), same)
