"""Chunk geometry of expert-parallel (EP) tensors, from ``.metadata`` alone.

From the chunks ``dcp.save`` recorded: the distinct intervals per dim, the writing ranks and
whether EP and EP-FSDP shard the same dim, compared with what the recorded or declared mesh
sizes imply (:attr:`EPGeometry.problems`). Intervals follow DTensor's ``Shard`` rule
(``torch/distributed/tensor/placement_types.py``, ``torch.chunk`` sizes, several mesh axes
nested left to right); zero-size chunks are ignored and a rank's piece may be refined into
several chunks. :func:`ep_split_candidates` lists the meshes with both sizes above 1 that an
unversioned tensor fits. ``docs/layouts.md``, "Chunk geometry".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ckpttool.format.jsonview import json_fields
from ckpttool.layouts.record import EPTensorSpec

if TYPE_CHECKING:
    from ckpttool.model.catalog import TensorEntry

__all__ = [
    "EPGeometry",
    "MeshSizes",
    "infer_fsdp_dim",
    "tensor_geometry",
    "dim_intervals",
    "shard_interval",
    "nested_shard_intervals",
    "nonempty_shard_intervals",
    "expected_ep_intervals",
    "ep_split_candidates",
    "refines",
    "STRIDED_HINT",
    "is_strided_order",
]

# What to do about a legacy declaration or record contradicted by the writing order of FSDP2 over EP
# (:func:`_strided_order`); the problem text names ``_StridedShard`` (:func:`is_strided_order`).
STRIDED_HINT = (
    "FSDP2 over EP (_StridedShard) saves the experts in true order from its (ep_fsdp, ep) mesh: declare it "
    "`source_layout` canonical with the same `ep_size` and `ep_fsdp_size`"
)


#: The words of :func:`_strided_order`'s problem that :func:`is_strided_order` finds in it (one string, not two copies).
_STRIDED_WORDS = "(FSDP2 over EP, _StridedShard, as torchtitan saves)"


def is_strided_order(problem: str) -> bool:
    """Whether a geometry problem (or a message quoting one) is the FSDP2-over-EP writing order."""
    return _STRIDED_WORDS in problem


@dataclass(frozen=True)
class EPGeometry:
    """How the chunks of one EP tensor split it, and whether that fits the layout."""

    key: str
    """Checkpoint key."""
    shape: tuple[int, ...]
    """Global shape (``()`` when the key is not in the checkpoint)."""
    ep_dim: int
    """The expert dim."""
    fsdp_dim: int | None
    """Dim split by EP-FSDP besides/with the EP dim (``None``: not FSDP-sharded)."""
    num_experts: int
    """Expert count (record/declaration, else ``shape[ep_dim]``)."""
    blocks_per_dim: tuple[int, ...]
    """Number of distinct non-empty chunk intervals along each dim."""
    ranks: tuple[int, ...]
    """Ranks whose files hold the chunks."""
    same_dim: bool
    """EP and EP-FSDP both shard ``ep_dim`` (legacy/canonical differ; ambiguous without a record or
    declaration)."""
    problems: tuple[str, ...]
    """Disagreements with the declared/recorded ``ep_size``/``ep_fsdp_size``/``num_experts`` (empty =
    consistent)."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready row (``inspect --json`` ``layout.geometry``)."""
        return json_fields(self)


def dim_intervals(entry: TensorEntry, dim: int) -> list[tuple[int, int]]:
    """Sorted distinct ``(offset, size)`` intervals of the non-empty chunks along ``dim``."""
    return sorted({(c.offsets[dim], c.sizes[dim]) for c in entry.chunks if c.numel > 0})


def shard_interval(n: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``index`` when a dim of size ``n`` is split ``num_chunks`` ways.

    ``torch.chunk`` rule as DTensor ``Shard`` applies it: pieces of ``ceil(n/num_chunks)``;
    an empty piece sits at offset ``n``.
    """
    if n % num_chunks == 0:
        size = n // num_chunks
        return index * size, size
    full = -(-n // num_chunks)
    start = min(n, full * index)
    size = max(0, min(n, start + full) - start)
    return (start, size) if size else (n, 0)


def nested_shard_intervals(n: int, mesh_sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """Intervals of one dim sharded by several mesh axes, outermost first, for every rank.

    Args:
        n: dim size.
        mesh_sizes: sizes of the mesh axes that shard this dim, in placement order.

    Returns:
        ``(offset, size)`` per mesh coordinate in row-major order (``len == prod(mesh_sizes)``);
        an empty piece sits at offset ``n`` (DTensor's ``zero_global_offset``).
    """
    pieces = [(0, n)]
    for k in mesh_sizes:
        nxt = []
        for off, size in pieces:
            for i in range(k):
                o, s = shard_interval(size, k, i)
                nxt.append((off + o, s) if s else (n, 0))
        pieces = nxt
    return pieces


def nonempty_shard_intervals(n: int, mesh_sizes: tuple[int, ...]) -> set[tuple[int, int]]:
    """The non-empty intervals of :func:`nested_shard_intervals` (the same set), without one entry per rank.

    At most ``n`` pieces are non-empty at every level, so the work is bounded by ``n`` times the number of
    mesh axes whatever the sizes: a record or declaration naming a mesh of ``10**12`` ranks costs no more
    than one of 8.
    """
    pieces = [(0, n)] if n else []
    for k in mesh_sizes:
        nxt = []
        for off, size in pieces:
            for i in range(min(k, size)):  # pieces past the first `size` are empty (torch.chunk sizes)
                o, s = shard_interval(size, k, i)
                if s:
                    nxt.append((off + o, s))
        pieces = nxt
    return set(pieces)


def expected_ep_intervals(
    spec: EPTensorSpec, shape: tuple[int, ...], version: int, ep_size: int, ep_fsdp_size: int
) -> dict[int, set[tuple[int, int]]]:
    """Non-empty chunk intervals per dim that a save with these sizes produces.

    Args:
        spec: the tensor's EP dims.
        shape: global shape.
        version: 2 canonical (mesh EP, EP-FSDP) or 1 legacy (mesh EP-FSDP, EP).
        ep_size, ep_fsdp_size: ``P`` and ``F``.

    Returns:
        dim -> set of ``(offset, size)``; dims absent are unsplit.
    """
    out: dict[int, set[tuple[int, int]]] = {}
    n_ep = shape[spec.ep_dim]
    if spec.fsdp_dim == spec.ep_dim:
        order = (ep_size, ep_fsdp_size) if version == 2 else (ep_fsdp_size, ep_size)
        out[spec.ep_dim] = nonempty_shard_intervals(n_ep, order)
    else:
        out[spec.ep_dim] = nonempty_shard_intervals(n_ep, (ep_size,))
        if spec.fsdp_dim is not None:
            out[spec.fsdp_dim] = nonempty_shard_intervals(shape[spec.fsdp_dim], (ep_fsdp_size,))
    return out


def refines(
    got: set[tuple[int, int]], want: set[tuple[int, int]], owners: dict[tuple[int, int], set[int | None]] | None = None
) -> bool:
    """The stored intervals ``got`` are the expected ``want`` ones, or a subdivision of them
    made by single ranks: each stored interval lies inside one expected interval, every expected
    one holds some, and an expected interval stored as several pieces has all of them written by
    one rank (``owners``: stored interval -> writing ranks; without it no subdivision is accepted).

    (Whether the stored chunks tile the tensor is checked elsewhere: ``S004``.)
    """
    if got == want:
        return True
    if owners is None:
        return False
    ordered = sorted(want)
    pieces: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for o, s in got:
        hit = next((w for w in ordered if w[0] <= o and o + s <= w[0] + w[1]), None)
        if hit is None:
            return False
        pieces.setdefault(hit, []).append((o, s))
    if set(pieces) != want:
        return False
    for ivs in pieces.values():
        if len(ivs) > 1:
            ranks = set().union(*(owners.get(iv, {None}) for iv in ivs))
            if len(ranks) != 1 or None in ranks:
                return False
    return True


def _owners(entry: TensorEntry, dim: int) -> dict[tuple[int, int], set[int | None]]:
    out: dict[tuple[int, int], set[int | None]] = {}
    for i, c in enumerate(entry.chunks):
        if c.numel > 0:
            out.setdefault((c.offsets[dim], c.sizes[dim]), set()).add(entry.chunk_rank(i))
    return out


def ep_split_candidates(entry: TensorEntry, spec: EPTensorSpec) -> list[tuple[int, int]]:
    """Saving meshes ``(ep_size, ep_fsdp_size)``, both > 1, whose EP and EP-FSDP sharding of the
    expert dim produce exactly the stored chunk intervals (metadata only), in either mesh order:
    canonical (EP outer) or legacy (EP-FSDP outer). The two orders give the same intervals when
    ``P*F`` divides the expert count, and different ones otherwise (10 experts over ``P=2, F=3``:
    canonical ``2, 2, 1, 2, 2, 1``, legacy ``2, 2, 2, 2, 1, 1``).

    Empty for a tensor whose expert dim is not split by both (e.g. plain FSDP2 ``Shard(0)`` over a
    prime number of ranks): its stored order is the true order whatever the mesh order was.
    """
    if spec.fsdp_dim != spec.ep_dim or not 0 <= spec.ep_dim < len(entry.shape):
        return []
    got = set(dim_intervals(entry, spec.ep_dim))
    blocks = len(got)
    n = entry.shape[spec.ep_dim]
    out = []
    for p in range(2, blocks // 2 + 1):
        if blocks % p:
            continue
        f = blocks // p
        if f < 2 or spec.num_experts % p:
            continue
        for order in ((p, f), (f, p)):  # canonical mesh (EP, EP-FSDP), legacy mesh (EP-FSDP, EP)
            want = {iv for iv in nested_shard_intervals(n, order) if iv[1]}
            if want == got and not _one_block_per_rank(entry, spec.ep_dim, want):  # p*f ranks wrote p*f blocks
                out.append((p, f))
                break
    return out


def infer_fsdp_dim(entry: TensorEntry, ep_dim: int) -> int | None:
    """The EP-FSDP dim the chunks suggest: another dim split into several intervals, else
    ``ep_dim`` when only it is split (EP and FSDP on one dim, or EP alone), else ``None``."""
    blocks = [len(dim_intervals(entry, d)) for d in range(len(entry.shape))]
    others = [d for d, b in enumerate(blocks) if d != ep_dim and b > 1]
    if others:
        return others[0]
    if blocks and blocks[ep_dim] > 1:
        return ep_dim
    return None


class MeshSizes(Protocol):
    """What :func:`tensor_geometry` reads of a layout (a record, a declaration, a resolved layout)."""

    @property
    def version(self) -> int | None: ...
    @property
    def ep_size(self) -> int | None: ...
    @property
    def ep_fsdp_size(self) -> int | None: ...


def tensor_geometry(entry: TensorEntry | None, key: str, spec: EPTensorSpec, layout: MeshSizes) -> EPGeometry:
    """Geometry of one EP tensor checked against a layout (see :class:`EPGeometry`).

    Args:
        entry: the catalog entry (``None``: the layout names a key the checkpoint lacks).
        key: checkpoint key.
        spec: EP dims and expert count (from the record, or detected).
        layout: its ``version`` (``None``: unversioned, sizes unknown) and the recorded/declared
            ``ep_size``/``ep_fsdp_size`` ``P``/``F`` (``None``: unknown).
    """
    version, ep_size, ep_fsdp_size = layout.version, layout.ep_size, layout.ep_fsdp_size
    if entry is None:
        return EPGeometry(
            key,
            (),
            spec.ep_dim,
            spec.fsdp_dim,
            spec.num_experts,
            (),
            (),
            False,
            ("named by the layout but not in the checkpoint",),
        )
    shape = entry.shape
    ndim = len(shape)
    problems: list[str] = []
    blocks = tuple(max(1, len(dim_intervals(entry, d))) for d in range(ndim))
    for name, d in (("ep_dim", spec.ep_dim), ("fsdp_dim", spec.fsdp_dim)):
        if d is not None and not 0 <= d < ndim:
            problems.append(f"{name} {d} is not a dim of shape {list(shape)}")
    if problems:
        return EPGeometry(
            key, shape, spec.ep_dim, spec.fsdp_dim, spec.num_experts, blocks, entry.ranks, False, tuple(problems)
        )
    same_dim = spec.fsdp_dim == spec.ep_dim
    if shape[spec.ep_dim] != spec.num_experts:
        problems.append(f"dim {spec.ep_dim} has {shape[spec.ep_dim]} entries but num_experts is {spec.num_experts}")
    if ep_size is not None and spec.num_experts % ep_size:
        problems.append(f"num_experts {spec.num_experts} is not divisible by ep_size {ep_size}")
    if version is not None and ep_size is not None and ep_fsdp_size is not None and not problems:
        problems.extend(_mesh_problems(entry, spec, version, ep_size, ep_fsdp_size))
    elif spec.fsdp_dim is None and any(b > 1 for d, b in enumerate(blocks) if d != spec.ep_dim):
        problems.append("chunks split a dim other than ep_dim but the layout names no fsdp_dim")
    return EPGeometry(
        key, shape, spec.ep_dim, spec.fsdp_dim, spec.num_experts, blocks, entry.ranks, same_dim, tuple(problems)
    )


def _mesh_problems(entry: TensorEntry, spec: EPTensorSpec, version: int, ep_size: int, ep_fsdp_size: int) -> list[str]:
    """What contradicts a save by mesh ``ep_size`` x ``ep_fsdp_size`` of layout ``version`` in ``entry``'s chunks."""
    shape = entry.shape
    # block-transposed (legacy, both sizes above 1, FSDP on the expert dim): equal slabs; else stored in true order
    permuted = version == 1 and spec.fsdp_dim == spec.ep_dim and ep_size > 1 and ep_fsdp_size > 1
    if permuted and spec.num_experts % (ep_size * ep_fsdp_size):
        return [
            f"legacy layout with FSDP on the expert dim needs num_experts {spec.num_experts} divisible by "
            f"ep_size*ep_fsdp_size = {ep_size * ep_fsdp_size}"
        ]
    problems = []
    expected = expected_ep_intervals(spec, shape, version, ep_size, ep_fsdp_size)
    for d in range(len(shape)):
        want = expected.get(d, {(0, shape[d])} if shape[d] else set())
        got = set(dim_intervals(entry, d))
        if entry.numel and not refines(got, want, _owners(entry, d)):
            problems.append(
                f"dim {d} is split into {len(got)} chunk interval(s) {sorted(got)[:4]}, "
                f"ep_size {ep_size} x ep_fsdp_size {ep_fsdp_size} gives {len(want)} {sorted(want)[:4]}"
            )
    want_ep = expected.get(spec.ep_dim, set())
    if problems:
        return problems
    return _one_block_per_rank(entry, spec.ep_dim, want_ep) or (
        _strided_order(entry, spec.ep_dim, want_ep, ep_size, ep_fsdp_size) if permuted else []
    )


def _strided_order(entry: TensorEntry, ep_dim: int, want: set[tuple[int, int]], p: int, f: int) -> list[str]:
    """A legacy (block-transposed) layout whose slabs were written in the order of a true-order save by a
    ``(ep_fsdp, ep)`` mesh: rank ``f*P + e`` wrote slab ``e*F + f`` (FSDP2 over EP, ``_StridedShard``, as
    torchtitan saves). A block-transposed save has rank ``f*P + e`` write slab ``f*P + e``, as a canonical save
    does; the chunk offsets of all three are equal, only the writing ranks tell this one apart. Each slab's lowest
    writing rank is compared (a slab may be split by TP ranks), in the order of the ranks and of the ranks modulo
    ``P*F`` (the mesh position under outer replicas, whose slabs dcp.save's deduplication may take from several
    replicas); said only where one of the two is that order and neither is the slab order, never where a rank is
    unknown or two slabs share one."""
    slabs = sorted(want)
    lowest: dict[tuple[int, int], int] = {}
    for i, c in enumerate(entry.chunks):
        if not c.numel:
            continue
        rank = entry.chunk_rank(i)
        if rank is None:
            return []
        o = c.offsets[ep_dim]
        slab = next((w for w in slabs if w[0] <= o < w[0] + w[1]), None)
        if slab is None:
            return []
        lowest[slab] = min(rank, lowest.get(slab, rank))
    if len(lowest) != len(slabs):
        return []
    strided, plain = [(k % p) * f + k // p for k in range(p * f)], list(range(p * f))
    orders = []
    for ranks in ([lowest[s] for s in slabs], [lowest[s] % (p * f) for s in slabs]):
        if len(set(ranks)) == len(slabs):
            orders.append(sorted(plain, key=ranks.__getitem__))
    if strided not in orders or plain in orders:
        return []
    return [
        f"rank {lowest[slabs[1]]} wrote slab 1 of {len(slabs)} along dim {ep_dim}: the slabs were written in true "
        f"expert order by an (ep_fsdp {f}, ep {p}) mesh {_STRIDED_WORDS}, not block-transposed; its layout is canonical"
    ]


def _one_block_per_rank(entry: TensorEntry, ep_dim: int, want: set[tuple[int, int]]) -> list[str]:
    """A rank that stored experts of two expected blocks of the expert dim (``want``): no mesh of these sizes
    does that (each rank saves its own block, one piece of it per EP-FSDP rank), so the declaration is wrong
    (e.g. 2 EP ranks that each saved their 4 experts as 2 chunks, declared as a 2 x 2 mesh of 4 ranks)."""
    if len(want) < 2:
        return []
    ordered = sorted(want)
    seen: dict[int, tuple[int, int]] = {}
    for i, c in enumerate(entry.chunks):
        rank = entry.chunk_rank(i)
        if not c.numel or rank is None:
            continue
        o, n = c.offsets[ep_dim], c.sizes[ep_dim]
        block = next((w for w in ordered if w[0] <= o and o + n <= w[0] + w[1]), None)
        if block is None:
            continue  # a chunk across blocks: refines() said so already
        first = seen.setdefault(rank, block)
        if first != block:
            return [
                f"rank {rank} stored experts of two blocks of dim {ep_dim}, {first} and {block} "
                f"(offset, size), but each rank of that mesh saves one"
            ]
    return []
