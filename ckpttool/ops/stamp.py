"""``stamp``: record a declared EP layout as a sidecar ``layout.json``.

For checkpoints saved without a layout record: the declaration (layout name, ``ep_size``,
``ep_fsdp_size``) is checked against the chunk geometry of every EP tensor
(:func:`~ckpttool.layouts.declaration.resolve_layout`), then written atomically
(temp file, then linked) as ``layout.json`` beside ``.metadata``, only where none is:
a record another stamp wrote after this one opened the checkpoint is checked like one
found at open, never replaced. Only that file is added; nothing of the checkpoint
itself changes.

Refusals: a record (embedded, or an earlier sidecar) that the declaration
contradicts (``E404``; a wrong sidecar must be removed by hand first), a
declaration that contradicts the chunk geometry (``E404``), and a declaration
that nothing in the checkpoint can verify (``E400``): no EP tensors, only empty
ones, or EP tensors written by fewer ranks than ``ep_size * ep_fsdp_size``.
Stamping what is already recorded is a no-op.
"""

from __future__ import annotations

import dataclasses
import errno
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, DataFileError, LayoutContradictionError, LayoutError, OutputError, UsageError
from ckpttool.format import limits
from ckpttool.format.atomic import atomic_write_text, unwritable_reason
from ckpttool.format.manifest_file import MANIFEST_NAME, is_manifest_head
from ckpttool.format.marker import recording
from ckpttool.format.outputs import remote_recording
from ckpttool.layouts.declaration import (
    LayoutDeclaration,
    LayoutRecords,
    check_declaration_against_record,
    read_layout_records,
)
from ckpttool.layouts.geometry import STRIDED_HINT, EPGeometry, dim_intervals, is_strided_order
from ckpttool.layouts.record import SIDECAR_NAME, parse_layout_record
from ckpttool.model.catalog import Catalog
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, OpenOptions, open_source
from ckpttool.ops.fields import options_of
from ckpttool.ops.reshard.plan import implied_optimizer, make_record

__all__ = ["StampOptions", "StampResult", "stamp"]


@dataclass(frozen=True)
class StampOptions:
    """What ``stamp`` writes.

    Attributes:
        declaration: the declared layout (all three fields set); default: the one the checkpoint
            is (or, for a path, ``opening`` says it is to be) opened with.
    """

    declaration: LayoutDeclaration | None = None


@dataclass(frozen=True)
class StampResult:
    """Outcome of :func:`stamp` (``ckpttool stamp --json``, schema ``ckpttool.stamp/1``).

    Attributes:
        path: the sidecar path (written, or found); the checkpoint directory when the record is embedded.
        written: ``False`` when the same record was already there (embedded or sidecar).
        record: the record (as written, or as found).
        ep_tensors: EP tensors it names; same_dim: those sharded by EP and FSDP on one dim.
        recorded_in: ``"sidecar"`` (``layout.json``, written now or before) or ``"embedded"`` (the
            ``layout`` byte item of the checkpoint).
        warnings: what the new ``layout.json`` leaves out of date: a ckpttool ``manifest.json`` in the checkpoint,
            made before it (its ``--verify`` reports the record as an extra file until it is made again); a newer
            step below the run root whose save did not finish (validate's ``R001``).
    """

    path: str
    written: bool
    record: dict[str, Any]
    ep_tensors: int
    same_dim: int
    recorded_in: str = "sidecar"
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON view (``--json``), schema ``ckpttool.stamp/1``."""
        return {"schema": "ckpttool.stamp/1", **self.__dict__, "warnings": list(self.warnings)}


def stamp(
    source: CheckpointOrPath, options: StampOptions | None = None, *, opening: OpenOptions | None = None
) -> StampResult:
    """Write ``layout.json`` for a declared layout after checking it against the chunk geometry.

    Args:
        source: the checkpoint path, opened with ``opening`` (its declaration replaced by
            ``options.declaration`` when given, and ``record_problems=True`` for stamp's own E404
            hints), or a :class:`~ckpttool.model.checkpoint.Checkpoint` opened so.
        options: see :class:`StampOptions`.

    Returns:
        A :class:`StampResult`.

    Raises:
        UsageError: no declaration.
        LayoutError: contradiction with a record or the geometry (E404), embedded record and
            sidecar disagreeing (E403), an invalid record (E400-E402), nothing to verify (E400).
        OutputError: the directory is not writable.
    """
    declaration = options_of(options, StampOptions).declaration
    if isinstance(source, Checkpoint):
        with open_source(source, opening) as ckpt:
            return _newer_incomplete(ckpt, _stamp(ckpt, declaration or ckpt.declaration))
    o = opening or OpenOptions()
    if declaration is not None:
        o = dataclasses.replace(o, declaration=declaration)
    with open_source(source, o, record_problems=True) as ckpt:
        return _newer_incomplete(ckpt, _stamp(ckpt, o.declaration))


def _newer_incomplete(ckpt: Checkpoint, res: StampResult) -> StampResult:
    """``res`` with validate's ``R001`` in its warnings where the step stamped was chosen below a run root whose
    newer step's save did not finish (``--step latest`` passed over it)."""
    newer = ckpt.located.newer_incomplete_note("stamped")
    return dataclasses.replace(res, warnings=(*res.warnings, newer)) if newer else res


def _stamp(ckpt: Checkpoint, declaration: LayoutDeclaration | None) -> StampResult:
    if declaration is None or declaration.no_ep:
        raise UsageError(
            "stamp needs a layout declaration (`source_layout`, `ep_size`, `ep_fsdp_size`)", param="source_layout"
        )
    for problem in (ckpt.replica_error, ckpt.tiling_error):
        if problem is not None:
            raise problem
    p, cat = ckpt.path, ckpt.catalog
    sidecar = p / SIDECAR_NAME
    err = ckpt.layout_error
    if isinstance(err, LayoutContradictionError):
        err.hint = _contradiction_hint(ckpt, err, sidecar)
    layout = ckpt.require_layout()
    geo = layout.geometry(cat)
    same = sum(1 for g in geo if g.same_dim)
    bad = [g for g in geo if g.problems]
    if layout.record is not None:
        # The record already says what was declared (resolve_layout refuses contradictions); "already
        # recorded" is said only of a record the chunks confirm, as a new one would be (reshard refuses the rest)
        if bad:
            where = "the checkpoint's embedded layout item" if layout.source == "embedded" else str(sidecar)
            raise LayoutContradictionError(
                f"{bad[0].key}: the chunk geometry contradicts the layout record in {where}: {bad[0].problems[0]}",
                fqn=bad[0].key,
                path=sidecar if layout.source != "embedded" else p,
                hint=(
                    "the embedded record cannot be replaced; write a new checkpoint with `ckpttool reshard`"
                    if layout.source == "embedded"
                    else f"the record is wrong: delete {sidecar} and stamp again with the right declaration"
                ),
            )
        if layout.source == "embedded":
            return StampResult(str(p), False, layout.record.raw, len(layout.ep_tensors), same, "embedded")
        return StampResult(str(sidecar), False, layout.record.raw, len(layout.ep_tensors), same, "sidecar")
    if bad:  # resolve_layout checked the declaration already; a programmer error if this fires
        raise LayoutContradictionError(f"{bad[0].key}: {bad[0].problems[0]}", fqn=bad[0].key)
    assert declaration.version is not None and declaration.ep_size is not None and declaration.ep_fsdp_size is not None
    _require_verifiable(p, cat, geo, declaration)
    record = make_record(
        declaration.version,
        declaration.ep_size,
        declaration.ep_fsdp_size,
        layout.ep_tensors,
        optimizer=implied_optimizer(cat),
        extra={"stamped": True},
    )
    parse_layout_record(record, "new layout record")
    text = json.dumps(record, sort_keys=True, indent=2) + "\n"
    if ckpt.reader.remote is not None:  # object storage: one PUT of the sidecar (docs/storage.md)
        with remote_recording(ckpt.reader.remote, SIDECAR_NAME, text.encode()):  # a ckpttool output's marker lists it
            ckpt.reader.remote.write_bytes(SIDECAR_NAME, text.encode())
    else:
        why = unwritable_reason(sidecar.parent)
        if why is not None:  # a checkpoint on a read-only mount or of another user: the declaration still works
            raise OutputError(
                f"{sidecar}: cannot write ({p} is not writable: {why}); nothing was written",
                path=sidecar,
                hint=_declare_instead(declaration),
            )
        try:
            with recording(sidecar.parent, sidecar.name):  # an output of ckpttool: its marker lists the sidecar
                atomic_write_text(sidecar, text, replace=False)  # never over a record written since the open
        except FileExistsError:
            return _found_meanwhile(ckpt, sidecar, declaration, len(layout.ep_tensors), same)
        except OutputError as e:
            cause = e.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                e.hint = _declare_instead(declaration)
            raise
    stale = _stale_manifest(p) if ckpt.reader.remote is None else ()  # object storage: not looked for
    return StampResult(str(sidecar), True, record, len(layout.ep_tensors), same, warnings=stale)


def _stale_manifest(p: Path) -> tuple[str, ...]:
    """The warning of a ckpttool ``manifest.json`` in the local checkpoint ``p``, made before the ``layout.json``
    just written (it cannot list it), or ``()``."""
    try:
        with open(p / MANIFEST_NAME, "rb") as f:  # the first bytes say whose it is (format/manifest_file.py)
            head = f.read(256)
    except OSError:  # none there (or unreadable: not ours to judge)
        return ()
    if not is_manifest_head(head):
        return ()
    return (
        f"{p / MANIFEST_NAME} was made before {SIDECAR_NAME}: its --verify reports {SIDECAR_NAME} as an extra file; "
        f"make it again (`ckpttool manifest {p}`) to cover the record",
    )


def _found_meanwhile(
    ckpt: Checkpoint, sidecar: Path, decl: LayoutDeclaration, ep_tensors: int, same: int
) -> StampResult:
    """The ``layout.json`` another run (a second ``stamp``) wrote after this one opened the checkpoint: checked
    as a record found at open is. The same declaration is "already recorded"; another is refused and kept.

    Raises:
        LayoutContradictionError (E404): it records another layout or mesh; LayoutError (E400-E402): it is not a
            valid layout record, or not a regular file inside the checkpoint.
    """
    where = f"{sidecar} (written meanwhile, by another run)"
    try:
        text = ckpt.reader.read_file(SIDECAR_NAME, limits.current().max_object_bytes, what="layout record")
    except DataFileError as e:
        raise LayoutError(e.message, path=sidecar) from e
    rec = parse_layout_record(text, where)
    try:
        check_declaration_against_record(decl, rec, where)
    except LayoutContradictionError as e:
        e.hint = f"it is kept; if that record is wrong, delete {sidecar} and stamp again with the right declaration"
        raise
    return StampResult(str(sidecar), False, rec.raw, ep_tensors, same, "sidecar")


def _declare_instead(decl: LayoutDeclaration) -> str:
    """The hint where ``layout.json`` cannot be written: the same declaration on each command does what it would."""
    return (
        f"the checkpoint's folder cannot be written; declare the layout on each command instead "
        f"({_decl_text(decl)}), or stamp a writable copy of the checkpoint"
    )


def _decl_text(decl: LayoutDeclaration) -> str:
    return f"`source_layout` {decl.source_layout} `ep_size` {decl.ep_size} `ep_fsdp_size` {decl.ep_fsdp_size}"


def _require_verifiable(p: Path, cat: Catalog, geo: list[EPGeometry], decl: LayoutDeclaration) -> None:
    """Refuse a declaration that no chunk of the checkpoint can confirm (E400): stamp records only checked facts.

    Raises:
        LayoutError (E400): no EP tensors, only empty ones, EP tensors of no rank (a safetensors model folder), or
            written by fewer ranks than ``ep_size * ep_fsdp_size`` (a mesh of that size saves every EP tensor from
            all its ranks).
    """
    assert decl.ep_size is not None and decl.ep_fsdp_size is not None
    world = decl.ep_size * decl.ep_fsdp_size
    nothing = f"{p}: nothing to stamp: {_decl_text(decl)} cannot be verified"
    no_write = "nothing was written"
    if not geo:
        raise LayoutError(
            f"{nothing}, because the checkpoint has no EP tensors (fused `...experts.<name>` model tensors with a "
            "leading expert dim) whose chunk geometry could be checked",
            path=p,
            hint=f"a checkpoint without expert tensors needs no EP layout record; {no_write} "
            "(`ckpttool inspect` lists the model tensors)",
        )
    present = [g for g in geo if g.shape and any(g.shape) and all(g.shape)]
    if not present:
        raise LayoutError(
            f"{nothing}, because all {len(geo)} EP tensor(s) are empty (no chunk holds any element)",
            path=p,
            hint=f"{no_write}; stamp a checkpoint whose expert tensors hold data",
        )
    ranks = sorted({r for g in present for r in g.ranks})
    if not ranks:  # a safetensors model folder: whole tensors, no rank files (not "written by 0 rank(s) []")
        raise LayoutError(
            f"{nothing}: its EP tensors name no saving rank (a safetensors model folder stores each tensor whole, "
            "in files of no rank), so no chunk can confirm the declared sizes",
            path=p,
            hint=f"{no_write}; stamp the DCP checkpoint the job saved (the directory holding .metadata and "
            "__R_N.distcp files)",
        )
    if len(ranks) < world:
        raise LayoutError(
            f"{nothing}: its EP tensors were written by {len(ranks)} rank(s) {ranks[:16]}, but a mesh of ep_size "
            f"{decl.ep_size} x ep_fsdp_size {decl.ep_fsdp_size} = {world} ranks saves every EP tensor from all "
            f"{world} ranks, so the chunks cannot confirm the declared sizes",
            path=p,
            hint=f"{no_write}; declare the mesh that saved this checkpoint (its EP tensors come from "
            f"{len(ranks)} rank(s); `ckpttool inspect --json` shows layout.geometry)",
        )


def _contradiction_hint(ckpt: Checkpoint, err: LayoutError, sidecar: Path) -> str:
    """A stamp-specific hint for E404: stamp needs the declaration, so "drop the options" does not apply."""
    cat = ckpt.catalog
    try:
        recs = read_layout_records(cat, ckpt.reader)
    except CkptError:
        recs = LayoutRecords(None, None)
    rec = recs.record
    if rec is not None:
        recorded = f"`source_layout` {rec.layout_name} `ep_size` {rec.ep_size} `ep_fsdp_size` {rec.ep_fsdp_size}"
        if recs.embedded is not None:
            return (
                "the layout is recorded inside the checkpoint (byte item 'layout', written with the save) and "
                f"stamp cannot replace it; it needs no stamp (it says {recorded}); to store the experts in "
                "another layout or mesh write a new checkpoint with `ckpttool reshard`"
            )
        return (
            f"{sidecar} already records {recorded}; if that record is wrong, delete {sidecar} and stamp "
            "again with the right declaration"
        )
    if is_strided_order(err.message):
        return STRIDED_HINT
    suggestion = _geometry_suggestion(cat, err.fqn)
    return (
        f"{suggestion}check the mesh of the job that saved the checkpoint "
        "(`ckpttool inspect --json` shows layout.geometry)"
    )


def _geometry_suggestion(cat: Catalog, key: str | None) -> str:
    """What the chunks of ``key`` say about the sizes (``""`` when they say nothing useful)."""
    entry = cat.model.get(key) if key else None
    if entry is None or not entry.shape:
        return ""
    blocks = [len(dim_intervals(entry, d)) for d in range(len(entry.shape))]
    others = [(d, b) for d, b in enumerate(blocks) if d != 0 and b > 1]
    if others:
        d, b = others[0]
        return (
            f"the chunks of {key} split the expert dim into {blocks[0]} and dim {d} into {b} piece(s), which "
            f"fits `ep_size` {blocks[0]} `ep_fsdp_size` {b}; "
        )
    if blocks[0] > 1:
        return (
            f"the chunks of {key} split the expert dim into {blocks[0]} piece(s): ep_size x ep_fsdp_size must "
            f"be {blocks[0]} (e.g. `ep_size` {blocks[0]} `ep_fsdp_size` 1 when EP alone splits it, `ep_size` 1 "
            f"`ep_fsdp_size` {blocks[0]} when FSDP alone does, a save without expert parallelism); "
        )
    return f"the chunks of {key} do not split it, which fits `ep_size` 1 `ep_fsdp_size` 1; "
