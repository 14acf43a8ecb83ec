"""Reshard planning: which bytes of the source go where in the target (pure, metadata only).

A plan lists every output tensor's chunks (one per target rank holding a piece) and the
pieces of source chunks that fill each. Along the expert dim, *stored* rows are positions as
saved and *true* rows the true expert order; :func:`row_runs` turns the source and target slab
maps into runs ``(target_row, source_row, length)``, and a target chunk is cut along them and
intersected with the source chunks. An output chunk that is one whole source chunk is copied
verbatim (:attr:`OutChunk.raw_source`). Target ranks follow ``init_device_mesh`` (row-major):
canonical ``(ep, ep_fsdp)``, legacy ``(ep_fsdp, ep)``; non-EP tensors and byte items keep
their chunks, in the file of ``source rank % world``. ``docs/layouts.md``; ``docs/design.md`` §4.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import (
    ChunkError,
    IndexedOptimizerStateError,
    LayoutContradictionError,
    LayoutError,
    LayoutSizeError,
    ReshardError,
    UsageError,
    at_least,
)
from ckpttool.format.directory import CheckpointDir, rank_of_file
from ckpttool.format.metadata import BytesMeta, ChunkMeta, DType, TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.layouts.declaration import EP_NAME_RE, LAYOUT_VERSIONS, ResolvedLayout, split_per_expert_vector
from ckpttool.layouts.geometry import dim_intervals, nested_shard_intervals, tensor_geometry
from ckpttool.layouts.permute import canonical_to_legacy_perm, legacy_to_canonical_perm
from ckpttool.layouts.record import LAYOUT_FORMAT, LAYOUT_KEY, SIDECAR_NAME, EPTensorSpec, parse_layout_record
from ckpttool.model.catalog import Catalog
from ckpttool.ops.fields import OutputOptions, check_output_ranks

__all__ = [
    "Piece",
    "OutChunk",
    "TensorPlan",
    "BytesPlan",
    "ReshardOptions",
    "ReshardPlan",
    "plan_reshard",
    "row_runs",
    "target_rank_coords",
    "make_record",
    "implied_optimizer",
]


@dataclass(frozen=True)
class ReshardOptions(OutputOptions):
    """What ``reshard`` writes: the options of every writing operation
    (:class:`~ckpttool.ops.fields.OutputOptions`: ``overwrite``, ``manifest``, ``algorithm``, ``dry_run``) and
    its own. Here the manifest digests every chunk's raw storage record as it is written (``covers:
    record``) and the layout record names the source identity (``converted_from.source``); a dry run checks
    the layout, the target mesh and the byte-item caps, and its file ``bytes`` are the tensor data planned
    for each target rank file.

    Attributes:
        to: ``"canonical"`` (layout version 2) or ``"legacy"`` (version 1).
        target_ep_size, target_ep_fsdp_size: target ``P``/``F`` (default: the source's).
        with_optimizer: permute optimizer state of EP parameters too (required when there is some).
        fsync: ``fsync`` the output files before renaming the directory into place (default);
            ``False`` is as durable as ``cp -r`` (the page cache decides when data reaches disk).
        threads: copy threads (default: CPU count, at most the number of target files).
        verify_crc: check every source record's CRC-32: while copying archives verbatim, and by
            one read before a record is streamed in pieces (default on: docs/performance.md).
    """

    to: str = "canonical"
    target_ep_size: int | None = field(default=None, metadata=at_least(1))
    target_ep_fsdp_size: int | None = field(default=None, metadata=at_least(1))
    with_optimizer: bool = False
    fsync: bool = True
    threads: int | None = field(default=None, metadata=at_least(1))
    verify_crc: bool = True


@dataclass(frozen=True)
class Piece:
    """A box copied from a source chunk into an output chunk.

    Attributes:
        src_chunk: the source chunk.
        src_start: start of the box inside the source chunk (per dim).
        dst_start: start of the box inside the output chunk (per dim).
        sizes: extent of the box (per dim).
    """

    src_chunk: ChunkMeta
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class OutChunk:
    """One chunk of an output tensor, written by target ``rank``."""

    chunk: ChunkMeta
    rank: int
    pieces: tuple[Piece, ...]

    @property
    def raw_source(self) -> ChunkMeta | None:
        """The source chunk whose archive can be copied verbatim (same data, same shape), else ``None``."""
        if len(self.pieces) != 1:
            return None
        p = self.pieces[0]
        if p.sizes == p.src_chunk.sizes == self.chunk.sizes and not any(p.src_start) and not any(p.dst_start):
            return p.src_chunk
        return None


@dataclass(frozen=True)
class TensorPlan:
    """How one tensor is written.

    Attributes:
        key: checkpoint key; dtype, shape: as stored (unchanged).
        kind: ``"ep"`` (EP parameter), ``"ep_state"`` (optimizer state of one) or ``"passthrough"``.
        permuted: the expert order changes between source and target.
        chunks: output chunks in writing order.
    """

    key: str
    dtype: DType
    shape: tuple[int, ...]
    kind: str
    permuted: bool
    chunks: tuple[OutChunk, ...]


@dataclass(frozen=True)
class BytesPlan:
    """A byte item: copied verbatim (``value is None``) or written anew (the layout record)."""

    key: str
    rank: int
    value: Any = None


@dataclass
class ReshardPlan:
    """Everything :func:`~ckpttool.ops.reshard.execute.reshard` writes (see module docstring)."""

    source: Path
    layout: ResolvedLayout
    to_version: int
    ep_size: int
    ep_fsdp_size: int
    world: int
    tensors: list[TensorPlan] = field(default_factory=list)
    byte_items: list[BytesPlan] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    planner_data: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # the source's byte item 'layout' is the trainer's own: copied like any item, the record goes to layout.json
    record_in_sidecar: bool = False

    @property
    def permuted_keys(self) -> list[str]:
        return [t.key for t in self.tensors if t.permuted]


def row_runs(
    n: int, src_slabs: int, src_true_pos: list[int], tgt_slabs: int, tgt_true_of: list[int]
) -> list[tuple[int, int, int]]:
    """Runs ``(target_row, source_row, length)`` mapping target stored rows to source stored rows.

    Args:
        n: rows along the expert dim.
        src_slabs: equal slabs the source permutation acts on (1: identity).
        src_true_pos: for true slab ``i`` of the source cut, its stored position
            (``legacy_to_canonical_perm``; ``[0]`` for identity).
        tgt_slabs: equal slabs of the target cut (1: identity).
        tgt_true_of: for stored target position ``j``, the true slab it holds
            (``canonical_to_legacy_perm``; ``[0]`` for identity).

    Returns:
        Runs covering ``[0, n)`` of the target exactly once, adjacent runs merged.
    """
    if n == 0:
        return []
    ss, st = n // src_slabs, n // tgt_slabs
    assert ss * src_slabs == n and st * tgt_slabs == n
    runs: list[tuple[int, int, int]] = []
    for j in range(tgt_slabs):
        true_lo = tgt_true_of[j] * st
        x = true_lo
        while x < true_lo + st:
            i, within = divmod(x, ss)
            length = min(true_lo + st - x, ss - within)
            t_row, s_row = j * st + (x - true_lo), src_true_pos[i] * ss + within
            if runs and runs[-1][0] + runs[-1][2] == t_row and runs[-1][1] + runs[-1][2] == s_row:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
            else:
                runs.append((t_row, s_row, length))
            x += length
    return runs


def target_rank_coords(version: int, rank: int, ep_size: int, ep_fsdp_size: int) -> tuple[int, int]:
    """``(e, f)`` of target ``rank`` for the canonical (2) or legacy (1) mesh order."""
    if version == 2:
        return divmod(rank, ep_fsdp_size)
    f, e = divmod(rank, ep_size)
    return e, f


def _target_boxes(
    spec: EPTensorSpec, shape: tuple[int, ...], version: int, p: int, f: int
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``(rank, offsets, sizes)`` of every target chunk of an EP tensor (replicas once)."""
    out = []
    ndim = len(shape)
    same = spec.fsdp_dim == spec.ep_dim
    # the intervals once per tensor, not once per rank (P*F ranks times P or F intervals each)
    if same:
        mesh = (p, f) if version == 2 else (f, p)
        ivs = nested_shard_intervals(shape[spec.ep_dim], mesh)
    else:
        ep_ivs = nested_shard_intervals(shape[spec.ep_dim], (p,))
        if spec.fsdp_dim is not None:
            fsdp_ivs = nested_shard_intervals(shape[spec.fsdp_dim], (f,))
    for r in range(p * f):
        e, ff = target_rank_coords(version, r, p, f)
        offs, sizes = [0] * ndim, list(shape)
        if same:
            offs[spec.ep_dim], sizes[spec.ep_dim] = ivs[r]
        else:
            offs[spec.ep_dim], sizes[spec.ep_dim] = ep_ivs[e]
            if spec.fsdp_dim is None:
                if ff:
                    continue  # replicated over EP-FSDP: DCP keeps one copy
            else:
                offs[spec.fsdp_dim], sizes[spec.fsdp_dim] = fsdp_ivs[ff]
        out.append((r, tuple(offs), tuple(sizes)))
    return out


class _ChunkIndex:
    """Source chunks grouped by their interval along the expert dim, for range lookups."""

    def __init__(self, chunks: list[ChunkMeta], ep_dim: int) -> None:
        groups: dict[tuple[int, int], list[ChunkMeta]] = {}
        for c in chunks:
            groups.setdefault((c.offsets[ep_dim], c.offsets[ep_dim] + c.sizes[ep_dim]), []).append(c)
        self.intervals = sorted(groups)
        self.groups = groups
        self.starts = [lo for lo, _ in self.intervals]
        self.disjoint = all(a[1] <= b[0] for a, b in zip(self.intervals, self.intervals[1:]))
        self.all = chunks

    def overlapping(self, lo: int, hi: int) -> list[ChunkMeta]:
        """Chunks whose expert-dim interval meets ``[lo, hi)`` (all chunks when intervals overlap)."""
        if not self.disjoint:
            return self.all
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        out: list[ChunkMeta] = []
        while i < len(self.intervals) and self.intervals[i][0] < hi:
            if self.intervals[i][1] > lo:
                out.extend(self.groups[self.intervals[i]])
            i += 1
        return out


def _pieces(
    box_offs: tuple[int, ...],
    box_sizes: tuple[int, ...],
    ep_dim: int,
    runs: list[tuple[int, int, int]],
    index: _ChunkIndex,
) -> tuple[Piece, ...]:
    if math.prod(box_sizes) == 0:
        return ()
    ndim = len(box_offs)
    lo, hi = box_offs[ep_dim], box_offs[ep_dim] + box_sizes[ep_dim]
    pieces = []
    for t_row, s_row, length in runs:
        a, b = max(t_row, lo), min(t_row + length, hi)
        if a >= b:
            continue
        shift = s_row - t_row  # source row = target row + shift
        s_lo = [box_offs[d] for d in range(ndim)]
        s_hi = [box_offs[d] + box_sizes[d] for d in range(ndim)]
        s_lo[ep_dim], s_hi[ep_dim] = a + shift, b + shift
        for c in index.overlapping(s_lo[ep_dim], s_hi[ep_dim]):
            o_lo = [max(s_lo[d], c.offsets[d]) for d in range(ndim)]
            o_hi = [min(s_hi[d], c.offsets[d] + c.sizes[d]) for d in range(ndim)]
            if any(o_hi[d] <= o_lo[d] for d in range(ndim)):
                continue
            dst = [o_lo[d] - box_offs[d] for d in range(ndim)]
            dst[ep_dim] = o_lo[ep_dim] - shift - box_offs[ep_dim]
            pieces.append(
                Piece(
                    c,
                    tuple(o_lo[d] - c.offsets[d] for d in range(ndim)),
                    tuple(dst),
                    tuple(o_hi[d] - o_lo[d] for d in range(ndim)),
                )
            )
    return tuple(pieces)


def _source_rank(ckpt: CheckpointDir, key: str, chunk: ChunkMeta | None) -> int:
    info = ckpt.metadata.storage_for(key, chunk)
    r = rank_of_file(info.relative_path) if info is not None else None
    return r or 0


def make_record(
    version: int,
    ep_size: int,
    ep_fsdp_size: int,
    ep_tensors: dict[str, EPTensorSpec],
    *,
    base: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
    global_step: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A layout record (``docs/layouts.md``), validated by :func:`parse_layout_record`.

    Args:
        version: 2 canonical, 1 legacy.
        ep_size, ep_fsdp_size: mesh sizes ``P``, ``F``.
        ep_tensors: checkpoint key -> spec.
        base: a previous record whose other ``parallel`` sizes, ``optimizer`` and
            ``global_step`` are kept.
        optimizer, global_step: override those of ``base``.
        extra: additional top-level fields (e.g. ``converted_from``).

    Returns:
        The record as a JSON-ready dict.
    """
    base = base or {}
    parallel = dict(base.get("parallel", {}))
    old_world = parallel.get("ep_size", 1) * parallel.get("ep_fsdp_size", 1)
    if "dp_shard_size" in parallel and parallel["dp_shard_size"] == old_world:
        parallel["dp_shard_size"] = ep_size * ep_fsdp_size
    parallel.update(ep_size=ep_size, ep_fsdp_size=ep_fsdp_size)
    rec: dict[str, Any] = {
        "format": LAYOUT_FORMAT,
        "version": version,
        "parallel": parallel,
        "extra_parallel": {
            k: {"ep_dim": s.ep_dim, "fsdp_dim": s.fsdp_dim, "num_experts": s.num_experts} for k, s in ep_tensors.items()
        },
        "optimizer": optimizer if optimizer is not None else dict(base.get("optimizer", {})),
    }
    step = global_step if global_step is not None else base.get("global_step")
    if step is not None:
        rec["global_step"] = step
    if extra:
        rec.update(extra)
    parse_layout_record(rec, "new layout record")
    return rec


def implied_optimizer(cat: Catalog) -> dict[str, Any]:
    """``{"type": ...}`` implied by the saved state dtypes (empty when there is no state)."""
    kinds = set()
    for ps in cat.optimizer_state.values():
        kind = ps.implied_type
        if kind:
            kinds.add(kind)
    return {"type": kinds.pop()} if len(kinds) == 1 else {}


def _target_mesh(
    cat: Catalog,
    layout: ResolvedLayout,
    to: str,
    target_ep_size: int | None,
    target_ep_fsdp_size: int | None,
) -> tuple[int, int, int]:
    """``(to_version, P2, F2)``: the target layout version and mesh sizes, checked against the source."""
    if to not in LAYOUT_VERSIONS:
        raise UsageError(f"`to` must be canonical or legacy, got {to!r}", param="to")
    to_version = LAYOUT_VERSIONS[to]
    layout.require_unambiguous()
    layout.require_geometry(
        cat, "the record or declaration does not describe how this checkpoint was saved; fix it before resharding"
    )
    if not layout.ep_tensors and not _has_expert_state(cat):
        # target sizes do not change that: the output's record would claim an EP mesh for a model without experts
        raise UsageError(
            f"{cat.path}: no expert-parallel tensor (a dense model): there is no EP layout to reshard",
            hint="`ckpttool inspect` lists the tensors; reshard applies to MoE checkpoints with stacked experts",
        )
    if (target_ep_size is None) != (target_ep_fsdp_size is None):
        given, missing, keep = (
            ("target_ep_size", "target_ep_fsdp_size", layout.ep_fsdp_size)
            if target_ep_size is not None
            else ("target_ep_fsdp_size", "target_ep_size", layout.ep_size)
        )
        raise UsageError(
            f"give both `target_ep_size` and `target_ep_fsdp_size`, or neither (keep the source sizes): `{given}` "
            f"alone does not say the other size of the target mesh",
            param=missing,
            hint=f"add `{missing}` {keep} to keep the source's"
            if keep is not None
            else f"add `{missing}`, the size of the job that will load the output",
        )
    p2 = target_ep_size if target_ep_size is not None else layout.ep_size
    f2 = target_ep_fsdp_size if target_ep_fsdp_size is not None else layout.ep_fsdp_size
    if p2 is None or f2 is None:
        raise UsageError(
            f"{cat.path}: the source EP sizes are unknown (no layout record, no declaration)",
            hint="pass `target_ep_size` P `target_ep_fsdp_size` F, or declare the source with `source_layout`/`ep_size`/`ep_fsdp_size`",
        )
    for name, v in (("target_ep_size", p2), ("target_ep_fsdp_size", f2)):
        if type(v) is not int or v < 1:
            raise UsageError(f"`{name}` must be an integer >= 1, got {v!r}", param=name)
    check_output_ranks(p2 * f2, f"`target_ep_size` {p2} x `target_ep_fsdp_size` {f2}", "target_ep_fsdp_size")
    for key, spec in layout.ep_tensors.items():
        e = spec.num_experts
        if e % p2:
            raise LayoutSizeError(
                f"{key}: {e} experts do not divide over target ep_size {p2}",
                fqn=key,
                hint="choose a `target_ep_size` that divides the expert count",
            )
        if spec.fsdp_dim == spec.ep_dim and to_version == 1 and p2 > 1 and f2 > 1 and e % (p2 * f2):
            raise LayoutSizeError(
                f"{key}: the legacy layout needs {e} experts to split into ep_size*ep_fsdp_size = {p2 * f2} equal slabs",
                fqn=key,
                hint="choose target sizes whose product divides the expert count",
            )
    return to_version, p2, f2


def _has_expert_state(cat: Catalog) -> bool:
    """Whether the checkpoint holds optimizer state of fused expert parameters (with or without them)."""
    return any("experts." in ps.fqn and EP_NAME_RE.search(ps.fqn) for ps in cat.optimizer_state.values())


def _ep_state(cat: Catalog, layout: ResolvedLayout, with_optimizer: bool) -> dict[str, str]:
    """Optimizer state of EP parameters (state key -> model key): migrate (``with_optimizer``) or refuse."""
    ep_state: dict[str, str] = {}  # state key -> model key
    for fqn, ps in cat.optimizer_state.items():
        model_key = cat.model_key(fqn)
        if model_key not in layout.ep_tensors:
            continue
        for t in ps.fields.values():
            if t is None or not t.shape:
                continue  # byte items and 0-d `step` are not sharded by expert
            if t.shape != cat.model[model_key].shape:
                raise ReshardError(
                    f"{t.key}: shape {list(t.shape)} differs from its parameter's {list(cat.model[model_key].shape)}; "
                    "cannot permute it like the parameter",
                    fqn=t.key,
                )
            ep_state[t.key] = model_key
    if ep_state and not with_optimizer:
        first = next(iter(ep_state))
        n_params = len(set(ep_state.values()))
        raise ReshardError(
            f"{cat.path}: the checkpoint holds optimizer state for {n_params} expert-parallel parameter(s) "
            f"(e.g. {first}); resharding only the parameters would leave it in the old order",
            fqn=first,
            hint="pass `with_optimizer` to permute the optimizer state with the parameters",
        )
    for skey, mkey in ep_state.items():
        spec = layout.ep_tensors[mkey]
        geo = tensor_geometry(cat.tensor(skey), skey, spec, layout)
        if layout.version is not None and layout.ep_size is not None and geo.problems:
            raise LayoutContradictionError(
                f"{skey}: the chunk geometry contradicts the layout: {geo.problems[0]}",
                fqn=skey,
                hint="the optimizer state is not sharded like its parameter; it cannot be migrated",
            )
    return ep_state


def _plan_entries(plan: ReshardPlan, ckpt: CheckpointDir, ep_state: dict[str, str]) -> None:
    """Add every source entry to ``plan``: byte items and non-EP tensors pass through, EP tensors are cut
    (in ``plan.layout``)."""
    layout = plan.layout
    to_version, p2, f2 = plan.to_version, plan.ep_size, plan.ep_fsdp_size
    md = ckpt.metadata
    for key, meta in md.entries.items():
        if key in md.planner_data:
            plan.planner_data[key] = md.planner_data[key]
        if isinstance(meta, BytesMeta):
            if key != LAYOUT_KEY or layout.foreign_item:
                plan.byte_items.append(BytesPlan(key, _source_rank(ckpt, key, None) % plan.world))
            continue
        assert isinstance(meta, TensorMeta)
        ep_model_key = key if key in layout.ep_tensors else ep_state.get(key)
        if ep_model_key is None:
            chunks = tuple(
                OutChunk(
                    c,
                    _source_rank(ckpt, key, c) % plan.world,
                    (Piece(c, (0,) * len(c.sizes), (0,) * len(c.sizes), c.sizes),),
                )
                for c in meta.chunks
            )
            plan.tensors.append(TensorPlan(key, meta.dtype, meta.size, "passthrough", False, chunks))
            continue
        plan.tensors.append(
            _plan_ep_tensor(
                key,
                meta,
                layout,
                layout.ep_tensors[ep_model_key],
                ep_model_key,
                to_version,
                p2,
                f2,
                "ep" if key == ep_model_key else "ep_state",
            )
        )


def _converted_record(plan: ReshardPlan, cat: Catalog, source: dict[str, Any] | None) -> None:
    """The output's layout record (``converted_from`` the source, ``plan.layout``) and its byte item, into ``plan``."""
    layout = plan.layout
    to_version, p2, f2 = plan.to_version, plan.ep_size, plan.ep_fsdp_size
    src_rec = layout.record.raw if layout.record is not None else None
    converted_from: dict[str, Any] = {
        "version": layout.version,
        "ep_size": layout.ep_size,
        "ep_fsdp_size": layout.ep_fsdp_size,
        "layout_source": layout.source,
        # ranks that wrote the source's data files, and of the mesh that wrote the per-rank files beside
        # the checkpoint (extra_state/), which reshard copies unchanged (validate's S007 reads these)
        "world": len(cat.ranks),
        "origin_world": origin_world(cat, layout),
    }
    if source is not None:
        converted_from["source"] = source
    plan.record = make_record(
        to_version,
        p2,
        f2,
        layout.ep_tensors,
        base=src_rec,
        optimizer=None if src_rec is not None else implied_optimizer(cat),
        extra={"converted_from": converted_from},
    )
    if layout.foreign_item:
        plan.record_in_sidecar = True
        return
    plan.byte_items.append(BytesPlan(LAYOUT_KEY, 0, json.dumps(plan.record, sort_keys=True)))
    plan.planner_data[LAYOUT_KEY] = (LAYOUT_KEY,)


def plan_reshard(
    cat: Catalog,
    ckpt: CheckpointDir,
    layout: ResolvedLayout,
    options: ReshardOptions | None = None,
    *,
    source: dict[str, Any] | None = None,
) -> ReshardPlan:
    """Plan a reshard from metadata alone (no tensor data is read).

    ``source`` (:func:`ckpttool.ops.manifest.source_identity` of the source) is recorded as
    ``converted_from.source`` in the output's layout record.

    Args:
        cat: catalog of the source.
        ckpt: the source directory (its metadata names each chunk's file).
        layout: the checkpoint's resolved layout.
        options: its ``to``, ``target_ep_size``, ``target_ep_fsdp_size`` and ``with_optimizer`` (default:
            :class:`ReshardOptions`).
        source: recorded as ``converted_from.source``.

    Returns:
        The :class:`ReshardPlan`.

    Raises:
        UsageError: bad ``to``; no expert tensor and no expert optimizer state (a dense model), whatever the
            target sizes; target sizes missing where the source's are unknown.
        LayoutError: ambiguous source (E405), geometry contradicting the layout (E404),
            target sizes that do not divide the expert count (E406).
        ReshardError: optimizer state of EP parameters without ``with_optimizer`` (E602).
        ChunkError: source chunks that do not tile the size ``.metadata`` gives a tensor (checked first).
    """
    o = options or ReshardOptions()
    _refuse_untiled(ckpt)
    _refuse_foreign_layout_item(cat, layout)
    to_version, p2, f2 = _target_mesh(cat, layout, o.to, o.target_ep_size, o.target_ep_fsdp_size)
    # Optimizer state of EP parameters: migrate (with_optimizer) or refuse.
    ep_state = _ep_state(cat, layout, o.with_optimizer)
    plan = ReshardPlan(ckpt.path, layout, to_version, p2, f2, p2 * f2)
    _plan_entries(plan, ckpt, ep_state)
    for refuse in _REFUSALS:  # state the plan would leave in the old expert order, or could not place
        refuse(cat, plan)
    _converted_record(plan, cat, source)
    return plan


def _refuse_foreign_layout_item(cat: Catalog, layout: ResolvedLayout) -> None:
    """A byte item ``layout`` of the trainer's own (not ckpttool's record) is copied like any item, so the output's
    record goes to its ``layout.json``; the source's layout must be recorded the same way (``ckpttool stamp``).

    Raises:
        LayoutError (E400): no ``layout.json`` records the source's layout.
    """
    if layout.foreign_item and layout.source != "sidecar":
        raise LayoutError(
            f"{cat.path}: the byte item 'layout' is the trainer's own, not a ckpttool layout record, and no "
            f"{SIDECAR_NAME} records the layout; nothing was written",
            path=cat.path,
            hint=f"record the layout beside it with `ckpttool stamp {cat.path} --source-layout legacy|canonical "
            "--ep-size P --ep-fsdp-size F` (reshard keeps the trainer's item and writes its own record to the "
            f"output's {SIDECAR_NAME})",
        )


def _refuse_untiled(ckpt: CheckpointDir) -> None:
    """A tensor whose chunks do not tile the global size ``.metadata`` gives it, checked before anything compares
    shapes (an optimizer state tensor against its parameter, the chunks against the layout): the metadata itself is
    inconsistent, and that is the error to name.

    Raises:
        ChunkError: naming the first such tensor.
    """
    for key, meta in ckpt.metadata.entries.items():
        if isinstance(meta, TensorMeta):
            problem = tiling_problem(meta)
            if problem is not None:
                raise ChunkError(
                    f"{ckpt.path}: chunks of {key!r} do not tile the size {list(meta.size)} that .metadata gives it "
                    f"({problem})",
                    fqn=key,
                )


def _refuse_unknown_expert_tensors(cat: Catalog, plan: ReshardPlan) -> None:
    """A tensor outside the model and its optimizer state (an EMA copy, a custom optimizer's state) that is a fused
    expert tensor, by name or by naming a permuted parameter, shaped like one and split over ranks along its expert
    dim: it would pass through in the old expert order while the parameters get the new one.

    Raises:
        ReshardError (E602): naming the first such tensor.
    """
    if not plan.permuted_keys:
        return
    prefix = cat.schema.model_prefix or ""
    permuted = {k: cat.model[k].shape for k in plan.permuted_keys if k in cat.model}
    fqns = [k[len(prefix) :] for k in permuted if k.startswith(prefix)]
    shapes = set(permuted.values())
    for key in cat.uncategorized_tensors():
        entry = cat.tensor(key)
        if entry.shape not in shapes or len(dim_intervals(entry, 0)) < 2:
            continue
        if EP_NAME_RE.search(key) or any(f and f in key for f in fqns):
            raise ReshardError(
                f"{key}: an expert tensor outside the model and its optimizer state (an EMA copy, a custom "
                f"optimizer's state?), split over ranks along its expert dim; the experts of "
                f"{len(plan.permuted_keys)} tensor(s) get a new order, and this one would keep the old order",
                fqn=key,
                hint="reshard a checkpoint without it, or save it under the model or the optimizer state "
                "(`model_prefix` / `optimizer_prefix` name where they are)",
            )


def _refuse_unpermuted_per_expert_tensors(cat: Catalog, plan: ReshardPlan) -> None:
    """A 1-D ``...experts.<name>`` tensor of the model (a per-expert scale or bias ``[E]``), or its optimizer state, split
    over ranks along its expert dim like the EP tensors whose expert order changes: EP tensors are fused weights
    of at least 2 dims, so it would pass through in the old expert order while they get the new one.

    Raises:
        ReshardError (E602): naming the first such tensor.
    """
    counts = {plan.layout.ep_tensors[k].num_experts for k in plan.permuted_keys if k in plan.layout.ep_tensors}
    if not counts:
        return
    handled = {t.key for t in plan.tensors if t.kind != "passthrough"}
    keys = [k for k in cat.model if EP_NAME_RE.search(k)]
    for ps in cat.optimizer_state.values():
        if EP_NAME_RE.search(ps.fqn):
            keys.extend(t.key for t in ps.fields.values() if t is not None)
    for key in keys:
        entry = cat.tensor(key)  # a model tensor or a state field: always a tensor of the checkpoint
        if key not in handled and split_per_expert_vector(key, entry, counts):
            raise ReshardError(
                f"{key}: a per-expert tensor [{entry.shape[0]}] split over ranks along its expert dim; the experts of "
                f"{len(plan.permuted_keys)} tensor(s) get a new order, and this one would keep the old order",
                fqn=key,
                hint="reshard a checkpoint without it, or reshard to the layout and mesh it was saved with",
            )


def _refuse_orphan_expert_state(cat: Catalog, plan: ReshardPlan) -> None:
    """Optimizer state of fused expert parameters the checkpoint does not hold (an optimizer saved on its own):
    the layout has no EP tensor to permute, so that state would keep its order under a record that names
    another (a legacy source with both sizes above 1, or a legacy target with both above 1).

    Raises:
        ReshardError (E602): naming the first such state tensor split over ranks along its expert dim.
    """
    layout = plan.layout
    src_perm = layout.version == 1 and (layout.ep_size or 1) > 1 and (layout.ep_fsdp_size or 1) > 1
    dst_perm = plan.to_version == 1 and plan.ep_size > 1 and plan.ep_fsdp_size > 1
    same = src_perm and dst_perm and (layout.ep_size, layout.ep_fsdp_size) == (plan.ep_size, plan.ep_fsdp_size)
    if layout.ep_tensors or not (src_perm or dst_perm) or same:
        return
    for ps in cat.optimizer_state.values():
        if ps.in_model or not ("experts." in ps.fqn and EP_NAME_RE.search(ps.fqn)):
            continue
        for t in ps.fields.values():
            if t is not None and len(t.shape) >= 2 and len(dim_intervals(t, 0)) > 1:
                raise ReshardError(
                    f"{t.key}: optimizer state of the expert parameter {ps.fqn!r}, which the checkpoint does not "
                    "hold: without the parameter reshard cannot permute it, and it would keep the old expert order "
                    "under a record that names another",
                    fqn=t.key,
                    hint="reshard the checkpoint that holds the model with its optimizer state",
                )


def _refuse_indexed_state(cat: Catalog, plan: ReshardPlan) -> None:
    """State keyed by parameter index (a plain ``optimizer.state_dict()``) names no parameter, so the state of
    the EP parameters whose expert order changes cannot be found: it would pass through in the old order.

    Raises:
        IndexedOptimizerStateError (E251): a state tensor shaped like a permuted EP parameter.
    """
    if cat.schema.optimizer_keying != "index" or not plan.permuted_keys:
        return
    shapes = {cat.model[k].shape for k in plan.permuted_keys if k in cat.model}
    for ps in cat.optimizer_state.values():
        for t in ps.fields.values():
            if t is not None and t.shape and t.shape in shapes:
                raise IndexedOptimizerStateError(
                    f"{t.key}: the optimizer state under {cat.schema.optimizer_prefix!r} is keyed by parameter "
                    f"index (a plain optimizer.state_dict()), so the state of the {len(plan.permuted_keys)} "
                    "tensor(s) whose expert order changes cannot be found; it would keep the old order",
                    fqn=t.key,
                    hint="re-save the optimizer with torch.distributed.checkpoint.state_dict."
                    "get_optimizer_state_dict(model, optimizer) (state keyed by parameter name)",
                )


def origin_world(cat: Catalog, layout: ResolvedLayout) -> int:
    """Ranks of the mesh that wrote the per-rank files beside the checkpoint (``extra_state/``).

    The source's writing ranks, or, when the source is itself a reshard output, the
    ``origin_world`` (else ``world``) its record names: reshard copies those files unchanged.
    """
    cf = layout.record.raw.get("converted_from") if layout.record is not None else None
    if isinstance(cf, dict):
        for k in ("origin_world", "world"):
            if type(cf.get(k)) is int and cf[k] >= 1:
                return int(cf[k])
    return len(cat.ranks)


def _plan_ep_tensor(
    key: str,
    meta: TensorMeta,
    layout: ResolvedLayout,
    spec: EPTensorSpec,
    model_key: str,
    to_version: int,
    p2: int,
    f2: int,
    kind: str,
) -> TensorPlan:
    n = meta.size[spec.ep_dim]
    if layout.is_permuted(model_key):
        assert layout.ep_size is not None and layout.ep_fsdp_size is not None
        bs = layout.ep_size * layout.ep_fsdp_size
        src_true_pos = legacy_to_canonical_perm(bs, layout.ep_size, layout.ep_fsdp_size)
    else:
        bs, src_true_pos = 1, [0]
    if to_version == 1 and spec.fsdp_dim == spec.ep_dim and p2 > 1 and f2 > 1:
        bt = p2 * f2
        tgt_true_of = canonical_to_legacy_perm(bt, p2, f2)
    else:
        bt, tgt_true_of = 1, [0]
    runs = row_runs(n, bs, src_true_pos, bt, tgt_true_of)
    permuted = any(t != s for t, s, _ in runs)
    index = _ChunkIndex([c for c in meta.chunks if c.numel], spec.ep_dim)
    chunks = []
    for rank, offs, sizes in _target_boxes(spec, meta.size, to_version, p2, f2):
        if not math.prod(sizes):
            continue  # an empty piece (torch.chunk's short tail) is not stored: several would share one storage key
        pieces = _pieces(offs, sizes, spec.ep_dim, runs, index)
        assert sum(pc.numel for pc in pieces) == math.prod(sizes), (key, offs, sizes)
        chunks.append(OutChunk(ChunkMeta(offs, sizes), rank, pieces))
    return TensorPlan(key, meta.dtype, meta.size, kind, permuted, tuple(chunks))


#: The checks :func:`plan_reshard` runs on a finished plan, in order; each raises ReshardError (E602).
_REFUSALS = (
    _refuse_indexed_state,
    _refuse_unknown_expert_tensors,
    _refuse_unpermuted_per_expert_tensors,
    _refuse_orphan_expert_state,
)
