"""Resolve the EP layout of a checkpoint: embedded record, sidecar, command-line declaration.

Authority, in order: the embedded byte item ``layout``, the sidecar ``layout.json`` (``ckpttool
stamp``), a declaration (``--source-layout --ep-size --ep-fsdp-size``). Embedded and sidecar
must agree (``E403``); a declaration must agree with a record and the chunk geometry
(``E404``). Without a record EP tensors are detected by name and geometry; those whose EP-FSDP
dim is the expert dim stay ambiguous until declared
(:meth:`ResolvedLayout.require_unambiguous`, ``E405``). ``open_checkpoint`` resolves it once
(``ckpt.layout``). ``docs/layouts.md``; ``docs/design.md`` §4.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from ckpttool.errors import (
    AmbiguousLayoutError,
    DataFileError,
    LayoutConflictError,
    LayoutContradictionError,
    LayoutError,
    LayoutSizeError,
    TrustRequiredError,
    UsageError,
)
from ckpttool.format import limits
from ckpttool.layouts.geometry import (
    STRIDED_HINT,
    EPGeometry,
    dim_intervals,
    ep_split_candidates,
    infer_fsdp_dim,
    is_strided_order,
    nested_shard_intervals,
    tensor_geometry,
)
from ckpttool.layouts.permute import legacy_to_canonical_perm
from ckpttool.layouts.record import (
    LAYOUT_KEY,
    SIDECAR_NAME,
    EPTensorSpec,
    LayoutRecord,
    is_own_record,
    parse_layout_record,
)

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader
    from ckpttool.model.catalog import Catalog, TensorEntry

__all__ = [
    "split_per_expert_vector",
    "LayoutDeclaration",
    "ResolvedLayout",
    "resolve_layout",
    "detect_ep_tensors",
    "load_layout_record",
    "read_layout_records",
    "check_declaration_against_record",
    "LayoutRecords",
    "EP_NAME_RE",
    "LAYOUT_VERSIONS",
]

LAYOUT_VERSIONS = {"legacy": 1, "canonical": 2}
# Fused expert tensors (HF transformers v5 Qwen3-MoE / gpt-oss / DeepSeek-V3 naming; torchtitan's
# `moe.experts.w1` and `moe.routed_experts.inner_experts.w1_EFD`): the component after `experts.`
# is a parameter name, not a per-expert module index. Shared experts are not expert-parallel.
EP_NAME_RE = re.compile(r"(?:^|\.)(?:inner_|routed_|grouped_|local_)?experts\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")


def split_per_expert_vector(key: str, entry: TensorEntry, counts: Collection[int]) -> bool:
    """Whether ``key`` is a 1-D ``...experts.<name>`` tensor ``[E]`` (a per-expert bias or scale; ``E`` in ``counts``)
    split over ranks along its expert dim: EP tensors are fused weights of at least 2 dims, so a change of the
    experts' order (reshard, export's un-permutation) would leave it in the stored order."""
    shape = entry.shape
    return (
        len(shape) == 1
        and shape[0] in counts
        and EP_NAME_RE.search(key) is not None
        and len(dim_intervals(entry, 0)) > 1
    )


@dataclass(frozen=True)
class LayoutDeclaration:
    """An EP layout declared on the command line.

    Attributes:
        source_layout: ``"legacy"`` or ``"canonical"``.
        ep_size: EP size ``P`` of the saving mesh.
        ep_fsdp_size: EP-FSDP size ``F`` of the saving mesh (``None`` with ``no_ep``).
        no_ep: the checkpoint was saved without expert parallelism (``--no-ep``): expert tensors
            are plain FSDP-sharded tensors, stored in true order whatever their chunks.
    """

    source_layout: str | None
    ep_size: int | None
    ep_fsdp_size: int | None
    no_ep: bool = False

    @property
    def version(self) -> int | None:
        return LAYOUT_VERSIONS.get(self.source_layout) if self.source_layout else None

    @classmethod
    def from_options(
        cls, source_layout: Any, ep_size: int | None, ep_fsdp_size: int | None, no_ep: bool = False
    ) -> LayoutDeclaration | None:
        """Build a declaration from ``--source-layout/--ep-size/--ep-fsdp-size`` or ``--no-ep``.

        Args:
            source_layout: ``"legacy"``/``"canonical"`` (str or the CLI enum) or ``None``.
            ep_size, ep_fsdp_size: positive ints or ``None``.
            no_ep: saved without expert parallelism (excludes the three others).

        Returns:
            ``None`` when none is given.

        Raises:
            UsageError: a layout without both sizes, sizes without a layout, bad values, or
                ``no_ep`` with any of the three.
        """
        if isinstance(source_layout, Enum):
            source_layout = source_layout.value
        if no_ep:
            if source_layout is not None or ep_size is not None or ep_fsdp_size is not None:
                raise UsageError(
                    "`no_ep` excludes `source_layout`/`ep_size`/`ep_fsdp_size`",
                    param="no_ep",
                    hint="`no_ep` says the save used no expert parallelism; the sizes say it did",
                )
            return cls("canonical", 1, None, no_ep=True)
        if source_layout is None and ep_size is None and ep_fsdp_size is None:
            return None
        if source_layout is None:
            raise UsageError(
                "`ep_size`/`ep_fsdp_size` given without `source_layout`",
                param="source_layout",
                hint="add `source_layout` legacy|canonical (the mesh order the checkpoint was saved with)",
            )
        if source_layout not in LAYOUT_VERSIONS:
            raise UsageError(
                f"`source_layout` must be legacy or canonical, got {source_layout!r}",
                param="source_layout",
                hint="legacy: mesh (EP-FSDP, EP); canonical: mesh (EP, EP-FSDP)",
            )
        if ep_size is None or ep_fsdp_size is None:
            missing = " and ".join(
                f"`{n}`" for n, v in (("ep_size", ep_size), ("ep_fsdp_size", ep_fsdp_size)) if v is None
            )
            raise UsageError(
                f"`source_layout` {source_layout} needs {missing}",
                param="source_layout",
                hint="declare the saving mesh: `source_layout` L `ep_size` P `ep_fsdp_size` F",
            )
        for name, v in (("ep_size", ep_size), ("ep_fsdp_size", ep_fsdp_size)):
            if type(v) is not int or v < 1:
                raise UsageError(f"`{name}` must be an integer >= 1, got {v!r}", param=name)
        return cls(source_layout, ep_size, ep_fsdp_size)


@dataclass(frozen=True)
class ResolvedLayout:
    """The EP layout a command works with.

    Attributes:
        version: 2 canonical, 1 legacy, ``None`` unversioned (no record, no declaration).
        source: ``"embedded"`` | ``"sidecar"`` | ``"declared"`` | ``"none"``.
        record: the layout record, if any.
        ep_size, ep_fsdp_size: ``P`` and ``F`` (``None`` when unknown).
        ep_tensors: checkpoint key -> :class:`EPTensorSpec` (model keys).
        declaration: the command-line declaration, if one was given.
        candidates: unversioned EP key -> the saving meshes ``(ep_size, ep_fsdp_size)``, both
            > 1, its chunks fit (:func:`~ckpttool.layouts.geometry.ep_split_candidates`); a
            same-dim tensor with none is stored in true order and not ambiguous.
        model_prefix, state_prefix: the key schema's prefixes (for :meth:`spec_for`).
        foreign_item: the checkpoint's byte item ``layout`` is the trainer's own, not a layout record
            (:func:`~ckpttool.layouts.record.is_own_record`): an item like any other.
    """

    version: int | None
    source: str
    record: LayoutRecord | None
    ep_size: int | None
    ep_fsdp_size: int | None
    ep_tensors: dict[str, EPTensorSpec]
    declaration: LayoutDeclaration | None = None
    candidates: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    model_prefix: str = "model."
    state_prefix: str | None = "optimizer.state."
    foreign_item: bool = False

    @property
    def layout_name(self) -> str | None:
        """``"canonical"``, ``"legacy"`` or ``None``."""
        return {2: "canonical", 1: "legacy"}.get(self.version) if self.version else None

    @property
    def ambiguous(self) -> list[str]:
        """Unversioned EP keys whose expert dim may be split by EP > 1 and EP-FSDP > 1 (order unknown)."""
        if self.version is not None:
            return []
        return [
            k
            for k, s in self.ep_tensors.items()
            if s.fsdp_dim is not None and s.fsdp_dim == s.ep_dim and self.candidates.get(k, ((0, 0),))
        ]

    def ambiguity_hint(self) -> str:
        """The fix for :attr:`ambiguous` tensors: declare the mesh (candidates listed) or ``no_ep``."""
        pairs = sorted({pf for k in self.ambiguous for pf in self.candidates.get(k, ())})
        shown = ", ".join(f"ep_size {p} x ep_fsdp_size {f}" for p, f in pairs[:6])
        return (
            "declare it with `source_layout` legacy|canonical `ep_size` P `ep_fsdp_size` F (or record it once with "
            "`ckpttool stamp`)" + (f"; the chunks fit {shown}" if shown else "") + ", or pass `no_ep` if the "
            "checkpoint was saved without expert parallelism (plain FSDP)"
        )

    def require_unambiguous(self) -> None:
        """Raise unless every EP tensor's stored order is known.

        Raises:
            LayoutError (E405): unversioned EP tensors whose expert dim EP and EP-FSDP may both split.
        """
        amb = self.ambiguous
        if amb:
            more = f" (and {len(amb) - 1} more)" if len(amb) > 1 else ""
            raise AmbiguousLayoutError(
                f"{amb[0]}{more}: its expert dim is split into blocks that EP and EP-FSDP may both have sharded, and "
                "the checkpoint has no layout record, so the expert order (legacy or canonical) is unknown",
                fqn=amb[0],
                hint=self.ambiguity_hint(),
            )

    def require_geometry(self, cat: Catalog, hint: str) -> None:
        """Raise unless the chunks of every EP tensor this layout names agree with it (metadata only).

        Args:
            cat: the checkpoint's catalog.
            hint: what the user should do about a contradiction (the caller's operation).

        Raises:
            LayoutContradictionError (E404): the first tensor whose chunk geometry contradicts the layout
                (expert count, ``ep_size`` divisibility, block boundaries) or that the checkpoint lacks.
        """
        for geo in self.geometry(cat):
            if geo.problems:
                raise LayoutContradictionError(
                    f"{geo.key}: the chunk geometry contradicts the {self.source} layout: {geo.problems[0]}",
                    fqn=geo.key,
                    hint=STRIDED_HINT if is_strided_order(geo.problems[0]) else hint,
                )

    def spec_for(self, key: str) -> EPTensorSpec | None:
        """EP spec of a model key, or of an ``optimizer.state.<fqn>.<field>`` key of an EP parameter."""
        spec = self.ep_tensors.get(key)
        if spec is not None:
            return spec
        sp = self.state_prefix
        if sp is not None and key.startswith(sp):
            head, _, fld = key[len(sp) :].rpartition(".")
            model_key = f"{self.model_prefix}{head}"
            if fld and model_key in self.ep_tensors:
                return self.ep_tensors[model_key]
        return None

    def is_permuted(self, key: str) -> bool:
        """The stored global tensor of ``key`` is block-transposed (legacy, EP and FSDP on one dim, F > 1, P > 1)."""
        spec = self.spec_for(key)
        return (
            spec is not None
            and self.version == 1
            and spec.fsdp_dim == spec.ep_dim
            and (self.ep_size or 1) > 1
            and (self.ep_fsdp_size or 1) > 1
        )

    def spec_key(self, key: str) -> str | None:
        """The model key whose EP spec applies to ``key`` (itself, or the parameter of a state key)."""
        if key in self.ep_tensors:
            return key
        sp = self.state_prefix
        if sp is not None and key.startswith(sp):
            head = key[len(sp) :].rpartition(".")[0]
            mk = f"{self.model_prefix}{head}"
            return mk if mk in self.ep_tensors else None
        return None

    def canonical_perm(self, key: str) -> list[int] | None:
        """Slab-level gather permutation from stored to true expert order, or ``None`` (already true order).

        Raises:
            LayoutError (E405): ``key`` is ambiguous (unversioned, same-dim).
        """
        spec = self.spec_for(key)
        if spec is None:
            return None
        if key in self.ambiguous or (self.spec_key(key) or "") in self.ambiguous:
            self.require_unambiguous()
        if not self.is_permuted(key):
            return None
        assert self.ep_size is not None and self.ep_fsdp_size is not None
        p, f = self.ep_size, self.ep_fsdp_size
        if spec.num_experts % (p * f):  # before a list of P*F entries is built (a record's ep_size 2**62)
            raise LayoutSizeError(
                f"{key}: {spec.num_experts} experts do not divide into ep_size*ep_fsdp_size = {p}*{f} = {p * f} "
                "equal slabs",
                fqn=key,
                hint="fix the layout record (layout.json, or declare --ep-size/--ep-fsdp-size) to the saving mesh",
            )
        return legacy_to_canonical_perm(p * f, p, f)

    def geometry(self, cat: Catalog) -> list[EPGeometry]:
        """Chunk geometry of every EP tensor of this layout, checked against its sizes (metadata only).

        Returns:
            One :class:`~ckpttool.layouts.geometry.EPGeometry` per key of :attr:`ep_tensors`, in order.
        """
        return [
            tensor_geometry(cat.model.get(key) or cat.other_tensors.get(key), key, spec, self)
            for key, spec in self.ep_tensors.items()
        ]


def detect_ep_tensors(cat: Catalog) -> dict[str, EPTensorSpec]:
    """EP tensors recognised by name: fused ``...experts.<name>`` with a leading expert dim.

    ``ep_dim`` is 0, ``num_experts`` is ``shape[0]``, ``fsdp_dim`` is inferred from the
    chunks: the other dim split into several intervals, else dim 0 when only dim 0 is
    split (EP and FSDP on one dim, or EP alone: undecidable from metadata), else ``None``.
    """
    out: dict[str, EPTensorSpec] = {}
    for key, entry in cat.model.items():
        if "experts." in key and EP_NAME_RE.search(key) and len(entry.shape) >= 2 and entry.shape[0] >= 1:
            out[key] = EPTensorSpec(ep_dim=0, fsdp_dim=infer_fsdp_dim(entry, 0), num_experts=entry.shape[0])
    return out


def _refuse_uneven_legacy_slabs(
    entry: TensorEntry, key: str, spec: EPTensorSpec, declaration: LayoutDeclaration
) -> None:
    """E406 when ``entry``'s chunks are exactly what the declared legacy mesh saves but its pieces are unequal.

    A legacy ``(ep_fsdp=F, ep=P)`` save with FSDP on the expert dim and ``num_experts`` not divisible by
    ``P*F`` (10 experts over ``P=2, F=3``: pieces ``2, 2, 2, 2, 1, 1`` block-transposed) fits the
    declaration; only equal slabs are un-permuted, so it is refused as unsupported, not as a contradiction.

    Raises:
        LayoutSizeError (E406): the declaration fits the chunks, the slabs are unequal.
    """
    p, f = declaration.ep_size, declaration.ep_fsdp_size
    if declaration.version != 1 or p is None or f is None or p < 2 or f < 2 or spec.fsdp_dim != spec.ep_dim:
        return
    n = entry.shape[spec.ep_dim] if 0 <= spec.ep_dim < len(entry.shape) else 0
    if not n or spec.num_experts != n or n % p or not n % (p * f):
        return
    if set(dim_intervals(entry, spec.ep_dim)) != {iv for iv in nested_shard_intervals(n, (f, p)) if iv[1]}:
        return
    raise LayoutSizeError(
        f"{key}: the chunks fit the declared legacy mesh (ep_size {p}, ep_fsdp_size {f}), but its "
        f"{n} experts are stored as pieces of unequal size (ep_size*ep_fsdp_size = {p * f} does not "
        "divide them) and block-transposed; ckpttool un-permutes only equal slabs, so it cannot read "
        "their true order",
        fqn=key,
        hint=f"load it with the saving mesh (ep_fsdp={f}, ep={p}) and save it again from a canonical "
        "(ep, ep_fsdp) mesh; declaring other sizes or --no-ep would read the experts out of order",
    )


def _check_record_lists_ep_tensors(cat: Catalog, rec: LayoutRecord, where: str) -> None:
    """A record of an EP mesh lists every fused expert tensor split on its expert dim.

    Only the tensors a record lists are un-permuted or re-chunked (``export``, ``reshard``); an expert
    tensor it leaves out would be copied in the saved order while the output claims another.

    Raises:
        LayoutError (E400): a record with ``ep_size * ep_fsdp_size > 1`` and a fused expert tensor
            (by name, as :func:`detect_ep_tensors`) whose expert dim is split into several blocks,
            not in its ``extra_parallel``.
    """
    if rec.ep_size * rec.ep_fsdp_size <= 1:
        return
    missing = [
        k
        for k, spec in detect_ep_tensors(cat).items()
        if k not in rec.extra_parallel and len(dim_intervals(cat.model[k], spec.ep_dim)) > 1
    ]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LayoutError(
            f"{where}: the layout record (ep_size {rec.ep_size}, ep_fsdp_size {rec.ep_fsdp_size}) does not list "
            f"the expert tensor {missing[0]!r} in extra_parallel{more}, whose experts are split over ranks: "
            "their order is not known",
            fqn=missing[0],
            hint="list every expert tensor in the record's extra_parallel (or delete layout.json and "
            "`ckpttool stamp` the checkpoint again)",
        )


def check_declaration_against_record(decl: LayoutDeclaration, rec: LayoutRecord, where: str) -> None:
    """Refuse a declaration that the layout record ``rec`` (read from ``where``) contradicts.

    Raises:
        LayoutContradictionError (E404): another layout name, ``ep_size`` or ``ep_fsdp_size``; ``no_ep`` over a
            record of ``ep_size`` > 1.
    """
    diffs = []
    if decl.no_ep:
        if (rec.ep_size or 1) != 1:
            raise LayoutContradictionError(
                f"{where}: `no_ep` contradicts the layout record (ep_size {rec.ep_size})",
                param="no_ep",
                hint="drop `no_ep`: the record says the checkpoint was saved with expert parallelism",
            )
        return
    if decl.version != rec.version:
        diffs.append(f"layout {decl.source_layout} vs recorded {rec.layout_name} (version {rec.version})")
    if decl.ep_size != rec.ep_size:
        diffs.append(f"`ep_size` {decl.ep_size} vs recorded ep_size {rec.ep_size}")
    if decl.ep_fsdp_size != rec.ep_fsdp_size:
        diffs.append(f"`ep_fsdp_size` {decl.ep_fsdp_size} vs recorded ep_fsdp_size {rec.ep_fsdp_size}")
    if diffs:
        raise LayoutContradictionError(
            f"{where}: the declaration contradicts the layout record: {'; '.join(diffs)}",
            param="source_layout",
            hint="drop `source_layout`/`ep_size`/`ep_fsdp_size` (the record is authoritative) or fix them",
        )


@dataclass(frozen=True)
class LayoutRecords:
    """The records a checkpoint holds: ``embedded`` (its byte item ``layout``), ``sidecar`` (``layout.json``),
    and ``foreign``: the byte item ``layout`` is the trainer's own, not a record (:func:`is_own_record`)."""

    embedded: LayoutRecord | None
    sidecar: LayoutRecord | None
    foreign: bool = False

    @property
    def record(self) -> LayoutRecord | None:
        return self.embedded or self.sidecar


def _read_embedded(cat: Catalog, reader: CheckpointReader) -> tuple[LayoutRecord | None, bool]:
    """The embedded record, or ``(None, True)`` where the byte item ``layout`` is the trainer's own."""
    if not cat.has_layout_item:
        return None, False
    try:
        value = reader.read_object(LAYOUT_KEY)
    except TrustRequiredError:  # ckpttool's record is a plain string: an object needing pickle is the trainer's
        return None, True
    if not is_own_record(value):
        return None, True
    # a malformed record is read whatever is declared: the hint says what to do with the record itself
    try:
        return parse_layout_record(value, f"{cat.path}: byte item 'layout'"), False
    except LayoutError as e:
        if e.code == "E400":
            e.hint = (
                "ckpttool reads the byte item 'layout' as its layout record (docs/layouts.md) and a declaration "
                "does not replace it; save the checkpoint again without a 'layout' item or with a valid record"
            )
        raise


def read_layout_records(cat: Catalog, reader: CheckpointReader) -> LayoutRecords:
    """Read and validate the embedded record and the sidecar, and reconcile them.

    Raises:
        LayoutError (E400-E402): an invalid record; LayoutConflictError (E403): embedded and
            sidecar records disagree.
    """
    embedded, foreign = _read_embedded(cat, reader)
    sidecar = None
    if cat.has_layout_sidecar:
        p = cat.path / SIDECAR_NAME
        # the declaration alone does not help while the file is there: it is read first (stamp's own too)
        hint = (
            f"fix or delete {SIDECAR_NAME}, then declare the layout (--source-layout legacy|canonical "
            "--ep-size P --ep-fsdp-size F) or record it again with `ckpttool stamp`"
        )
        try:
            text = reader.read_file(SIDECAR_NAME, limits.current().max_object_bytes, what="layout record")
        except DataFileError as e:  # unreadable: a symbolic link to a missing file, no permission
            raise LayoutError(e.message, path=p, hint=hint) from e
        try:
            sidecar = parse_layout_record(text, str(p))
        except LayoutError as e:
            if e.code == "E400":
                e.hint = hint
            raise
    if embedded is not None and sidecar is not None and embedded.raw != sidecar.raw:
        raise LayoutConflictError(
            f"{cat.path}: embedded layout record and {SIDECAR_NAME} disagree",
            hint=f"remove the stale {SIDECAR_NAME} (the embedded record was written with the save)",
        )
    return LayoutRecords(embedded, sidecar, foreign)


def load_layout_record(cat: Catalog, reader: CheckpointReader) -> LayoutRecord | None:
    """Read, validate and reconcile the layout record (embedded item and sidecar).

    A byte item ``layout`` that is not ckpttool's record (the trainer's own, by content) is no record.

    Returns:
        The record, or ``None`` when the checkpoint has none (unversioned).

    Raises:
        LayoutError (E400-E402): an invalid record; LayoutConflictError (E403): embedded and
            sidecar records disagree.
    """
    return read_layout_records(cat, reader).record


def resolve_layout(
    cat: Catalog, reader: CheckpointReader, declaration: LayoutDeclaration | None = None
) -> ResolvedLayout:
    """Reconcile the embedded record, the sidecar and a declaration into one layout.

    Args:
        cat: the catalog.
        reader: a reader of the same checkpoint (reads the small ``layout`` byte item only).
        declaration: from :meth:`LayoutDeclaration.from_options`, or ``None``.

    Returns:
        The :class:`ResolvedLayout`.

    Raises:
        LayoutError: invalid record (E400-E402), embedded and sidecar disagree (E403), the
            declaration contradicts the record or the chunk geometry (E404).
    """
    recs = read_layout_records(cat, reader)
    rec, foreign = recs.record, recs.foreign
    where = str(cat.path)
    mp, sp = cat.schema.model_prefix or "", cat.schema.state_prefix
    if rec is not None:
        if declaration is not None:
            check_declaration_against_record(declaration, rec, where)
        source = "embedded" if recs.embedded is not None else "sidecar"
        _check_record_lists_ep_tensors(
            cat, rec, f"{where}: byte item 'layout'" if source == "embedded" else str(cat.path / SIDECAR_NAME)
        )
        ep = dict(rec.extra_parallel)
        return ResolvedLayout(
            rec.version,
            source,
            rec,
            rec.ep_size,
            rec.ep_fsdp_size,
            ep,
            declaration,
            model_prefix=mp,
            state_prefix=sp,
            foreign_item=foreign,
        )
    ep = detect_ep_tensors(cat)
    if declaration is None:
        candidates = {k: tuple(ep_split_candidates(cat.model[k], s)) for k, s in ep.items() if s.fsdp_dim == s.ep_dim}
        return ResolvedLayout(
            None, "none", None, None, None, ep, None, candidates, model_prefix=mp, state_prefix=sp, foreign_item=foreign
        )
    if declaration.no_ep:
        return ResolvedLayout(
            2, "declared", None, 1, None, ep, declaration, model_prefix=mp, state_prefix=sp, foreign_item=foreign
        )
    for key, spec in ep.items():
        geo = tensor_geometry(cat.model[key], key, spec, declaration)
        if geo.problems:
            _refuse_uneven_legacy_slabs(cat.model[key], key, spec, declaration)
            raise LayoutContradictionError(
                f"{key}: the declared layout ({declaration.source_layout}, ep_size {declaration.ep_size}, "
                f"ep_fsdp_size {declaration.ep_fsdp_size}) contradicts the chunk geometry: {geo.problems[0]}",
                fqn=key,
                param="source_layout",
                **({"hint": STRIDED_HINT} if is_strided_order(geo.problems[0]) else {}),
            )
    return ResolvedLayout(
        declaration.version,
        "declared",
        None,
        declaration.ep_size,
        declaration.ep_fsdp_size,
        ep,
        declaration,
        model_prefix=mp,
        state_prefix=sp,
        foreign_item=foreign,
    )
