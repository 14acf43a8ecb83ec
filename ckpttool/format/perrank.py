"""Per-rank checkpoints: local DTensor shards saved by each rank, assembled into DCP metadata (torch-free).

Some trainers save one ``torch.save`` file (or safetensors file) per rank holding that rank's
local DTensor shards under their full names, not DCP (verl's FSDP checkpoint manager,
torch-checkpointing). A :class:`RankLayout` plug-in (:func:`register_layout`) recognises such a
directory and names its rank files; :func:`assemble` reads each file's pickle with the
allow-list unpickler (:mod:`ckpttool.format.perrank_pickle`; no torch import) and places each
local shard in its global tensor from the DTensor's mesh and placements (``Shard(d)``,
``_StridedShard(d, split_factor)``, ``Replicate``; the offsets torch's
``compute_local_shape_and_global_offset`` gives). Every shard becomes a chunk of a
:class:`~ckpttool.format.metadata.CheckpointMetadata` whose storage window is the shard's raw
bytes inside the rank file (``serialization="safetensors"``: the chunk locator reads a window as
the raw little-endian C-order record, checked against the ``torch.save`` record's zip CRC-32: on the
bytes read where the window is the whole record, the whole record read once where it is part of it:
:meth:`PerRankReader.record_member`), so every command reads, streams
and checks it through the one engine like a DCP chunk. Replicated shards (a ``Replicate`` mesh dim, optimizer ``step``
scalars) are one chunk; the copies of the other ranks are compared with it byte for byte
(:meth:`PerRankReader.check_replicas`). Non-tensor values (param-group hyperparameters, the
scheduler) become byte items served from memory (:class:`PerRankReader`).
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.engine.io import ShortReadError
from ckpttool.errors import ChecksumError, CkptError, DataFileError, PerRankError
from ckpttool.format import limits
from ckpttool.format.archive import (
    STORED,
    ArchiveChecksumError,
    ArchiveError,
    FileWindow,
    Member,
    check_torch_records,
    parse_archive,
)
from ckpttool.format.files import open_regular, resolve_inside
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta
from ckpttool.format.perrank_pickle import DTensorRec, LocalTensor, Opaque, Placement, Record, unpickle_rank
from ckpttool.format.pickleframes import PickleBombError
from ckpttool.format.reader import CheckpointReader
from ckpttool.format.unpickler import UNREADABLE_PICKLE, check_object_graph

__all__ = [
    "PerRankError",
    "checked_pickle",
    "Placed",
    "PerRankReader",
    "RankFile",
    "RankLayout",
    "Assembled",
    "assemble",
    "registered_layouts",
    "local_ranges",
    "read_rank_file",
    "register_layout",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- layouts (plug-ins)
@dataclass(frozen=True)
class RankFile:
    """One per-rank file: ``role`` (``model``, ``optimizer``, ``extra``, ``scheduler``), its rank and name."""

    role: str
    rank: int
    relative_path: str


@dataclass(frozen=True)
class RankLayout:
    """A per-rank checkpoint format (a plug-in: :func:`register_layout`).

    Attributes:
        name: the format's name (``verl-fsdp``), shown by ``inspect``.
        schema: the key schema (``model/schemas/``) its assembled keys are read with.
        claims: ``claims(directory, names)`` -> the rank files, or ``None`` when not this format.
        assemble: builds the :class:`Assembled` checkpoint from the directory and its rank files.
        unfinished: ``unfinished(directory, rank files)`` -> why the save did not finish, from the file
            names alone (a rank's file missing), else ``None``; discovery passes such a step over.
    """

    name: str
    schema: str
    claims: Callable[[Path, list[str]], list[RankFile] | None]
    assemble: Callable[[Path, list[RankFile]], Assembled]
    unfinished: Callable[[Path, list[RankFile]], str | None] | None = None


_LAYOUTS: list[RankLayout] = []


def register_layout(layout: RankLayout) -> None:
    """Add a per-rank format (asked in registration order).

    Raises:
        ValueError: one of that name is registered already.
    """
    if any(x.name == layout.name for x in _LAYOUTS):
        raise ValueError(f"per-rank layout {layout.name!r} is registered already")
    _LAYOUTS.append(layout)


def registered_layouts() -> tuple[RankLayout, ...]:
    """The registered per-rank formats, in order (the built-in ones register in
    :mod:`ckpttool.format.perrank_formats`, whose :func:`~ckpttool.format.perrank_formats.detect_layout` asks them)."""
    return tuple(_LAYOUTS)


# --------------------------------------------------------------------------- reading one rank file
@dataclass
class RankObject:
    """One rank file read: its top-level object and where each storage record's bytes lie."""

    file: RankFile
    obj: Any
    records: dict[str, tuple[int, int]]  # storage key -> (absolute data offset, bytes)
    members: dict[str, Member] = field(default_factory=dict)  # storage key -> its zip member (torch.save files)


def read_rank_file(root: Path, f: RankFile) -> RankObject:
    """Read ``f``'s ``data.pkl`` with the allow-list unpickler and map its storage records (no tensor bytes read).

    Raises:
        PerRankError: not a ``torch.save`` archive torch reads the same way, a compressed or
            big-endian record, an unreadable pickle.
        UnsafePickleError: a global off the allow-list.
        DataFileError, PathEscapeError, NotRegularFileError: the file cannot be opened inside ``root``.
    """
    where = str(root / f.relative_path)
    try:
        fd = open_regular(resolve_inside(root, f.relative_path, what="per-rank file"), shown=where)
    except OSError as e:
        raise DataFileError(f"{where}: cannot read ({e.strerror})", path=where) from e
    try:
        size = os.fstat(fd).st_size
        window = FileWindow(fd, 0, size)
        try:
            archive = parse_archive(window)
            bo = check_torch_records(archive, window)
            cap = limits.current().max_metadata_bytes
            pkl = archive.read(window, "data.pkl", cap, what=f"{where}: data.pkl")
        except ArchiveChecksumError as e:  # bit rot in a member read here (data.pkl, a small record): not a misfit
            raise ChecksumError(f"{where}: {e}: the bytes changed after they were saved", path=where) from e
        except ArchiveError as e:
            raise PerRankError(
                f"{where}: not a torch.save archive torch reads the same way ({e})",
                path=where,
                hint="the file is truncated or damaged (an interrupted save or copy): copy it again, or use an earlier step",
            ) from e
        except ShortReadError:
            raise DataFileError(f"{where}: short read", path=where) from None
        if bo == b"big":
            raise PerRankError(f"{where}: a big-endian archive (not read)", path=where)
        assert pkl is not None
        obj = checked_pickle(lambda: unpickle_rank(pkl, where), where, "data.pkl ")
        records: dict[str, tuple[int, int]] = {}
        members: dict[str, Member] = {}
        for name, m in archive.members.items():
            if name.startswith("data/"):
                if m.method != STORED:
                    raise PerRankError(f"{where}: record {name} is compressed (torch.save stores records)", path=where)
                records[name[5:]] = (m.data_offset, m.size)
                members[name[5:]] = m
        return RankObject(f, obj, records, members)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- placements -> global ranges
def placements_of(spec: Any, where: str) -> tuple[tuple[Placement, ...], tuple[int, ...], tuple[int, ...], Any]:
    """``(placements, mesh shape, this rank's mesh coordinate, shard order)`` of a pickled ``DTensorSpec``.

    Raises:
        PerRankError: a spec without a mesh, placements or coordinate, or a placement ckpttool does not read.
    """
    if not isinstance(spec, Record):
        raise PerRankError(f"{where}: a DTensor without a DTensorSpec", path=where)
    mesh = spec.get("mesh")
    raw = spec.get("placements")
    if not isinstance(mesh, Record) or not isinstance(raw, tuple):
        raise PerRankError(f"{where}: a DTensorSpec without mesh or placements", path=where)
    shape = _mesh_shape(mesh)
    coord = mesh.get("_coordinate_on_dim")
    if shape is None or not _int_tuple(coord) or len(coord) != len(shape) or len(raw) != len(shape):
        raise PerRankError(f"{where}: a DeviceMesh whose shape or this rank's coordinate cannot be read", path=where)
    out: list[Placement] = []
    for p in raw:
        kind = type(p).__name__ if isinstance(p, Record) else ""
        dim, sf = (
            p.get("dim") if isinstance(p, Record) else None,
            p.get("split_factor", 1) if isinstance(p, Record) else 1,
        )
        if kind == "Shard" and type(dim) is int:
            out.append(Placement("shard", dim))
        elif kind == "StridedShard" and type(dim) is int and type(sf) is int and sf >= 1:
            out.append(Placement("strided_shard", dim, sf))
        elif kind == "Replicate":
            out.append(Placement("replicate"))
        elif kind in ("Partial",):
            raise PerRankError(f"{where}: a Partial placement (pending reduction) cannot be assembled", path=where)
        else:
            raise PerRankError(f"{where}: placement {kind or type(p).__name__!r} is not read by ckpttool", path=where)
    return tuple(out), shape, tuple(coord), spec.get("shard_order")


def _int_tuple(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(type(x) is int and x >= 0 for x in v)


def _mesh_shape(mesh: Record) -> tuple[int, ...] | None:
    layout = mesh.get("_layout")
    if isinstance(layout, Record):
        shape = layout.get("shape")
        if _int_tuple(shape):
            return tuple(shape)
        axes = layout.get("axes")  # torch >= 2.10: one _FlatLayout per mesh dim (shape: an int or a tuple)
        if isinstance(axes, tuple) and all(isinstance(x, Record) for x in axes):
            dims = [x.get("shape") for x in axes]
            dims = [(d,) if type(d) is int else d for d in dims]
            if all(_int_tuple(d) for d in dims):
                return tuple(math.prod(d) for d in dims)
    m = mesh.get("mesh")
    if isinstance(m, LocalTensor):
        return m.size
    return None


Ranges = list[tuple[int, int]]  # (global start, length), in local order


def _take(ranges: Ranges, start: int, length: int) -> Ranges:
    """The global ranges of local elements ``[start, start+length)`` of a dim held as ``ranges``."""
    out: Ranges = []
    pos = 0
    for g, n in ranges:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
    return out


def _chunk_span(total: int, parts: int, i: int) -> tuple[int, int]:
    """Piece ``i`` of ``torch.chunk(total, parts)`` (ceil-sized pieces, empty past the end): ``(start, length)``."""
    size = -(-total // parts) if parts else 0
    lo = min(i * size, total)
    return lo, min(lo + size, total) - lo


def local_ranges(
    size: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
    order: dict[int, tuple[int, ...]] | None = None,
) -> list[Ranges]:
    """Per tensor dim, the global ``(start, length)`` ranges a rank's local shard holds, in local order.

    torch's semantics (``placement_types.py``): ``Shard(d)`` gives mesh coordinate ``c`` piece
    ``c`` of ``torch.chunk`` over the current local extent of dim ``d``; ``_StridedShard(d, sf)``
    splits that extent into ``sf`` pieces (``torch.chunk``) and gives ``c`` piece ``c`` of each;
    ``Replicate`` keeps the dim whole. Mesh dims apply left to right, or per tensor dim in
    ``order`` (a ``DTensorSpec.shard_order``).
    """
    ranges: list[Ranges] = [[(0, n)] for n in size]
    steps: list[int] = list(range(len(placements)))
    if order:
        steps = [m for d in sorted(order) for m in order[d]] + [
            m for m, p in enumerate(placements) if p.kind == "replicate"
        ]
    for m in steps:
        p, n, c = placements[m], mesh_shape[m], coord[m]
        if p.kind == "replicate" or n == 1:
            continue
        cur = ranges[p.dim]
        total = sum(k for _, k in cur)
        if p.kind == "shard":
            lo, k = _chunk_span(total, n, c)
            ranges[p.dim] = _take(cur, lo, k)
        else:
            pieces = []
            for j in range(p.split_factor):  # split_factor pieces, each sharded n ways: piece c of each
                lo, k = _chunk_span(total, p.split_factor, j)
                sub_lo, sub_k = _chunk_span(k, n, c)
                pieces.append((lo + sub_lo, sub_k))
            ranges[p.dim] = [r for lo, k in pieces for r in _take(cur, lo, k)]
    return [_merge(r) for r in ranges]


def _merge(r: Ranges) -> Ranges:
    out: Ranges = []
    for g, n in r:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((g, n))
    return out


def _shard_order(raw: Any, placements: tuple[Placement, ...]) -> dict[int, tuple[int, ...]] | None:
    """``DTensorSpec.shard_order`` as tensor dim -> mesh dims (``None``: left to right)."""
    if any(p.kind == "strided_shard" for p in placements) or not isinstance(raw, tuple) or not raw:
        return None
    out: dict[int, tuple[int, ...]] = {}
    for e in raw:
        args = e.get("_args") if isinstance(e, Record) else None
        if not (isinstance(args, tuple) and len(args) == 2 and type(args[0]) is int and _int_tuple(args[1])):
            return None
        out[args[0]] = tuple(args[1])
    used = sorted(m for ms in out.values() for m in ms)
    shards = [m for m, p in enumerate(placements) if p.kind == "shard"]
    return out if used == shards else None


# --------------------------------------------------------------------------- assembly
@dataclass(frozen=True)
class Placed:
    """Where a rank's local tensor lies: global ``size``, ``placements`` over ``mesh`` at ``coord``, shard ``order``."""

    size: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh: tuple[int, ...]
    coord: tuple[int, ...]
    order: dict[int, tuple[int, ...]] | None = None


@dataclass
class Assembled:
    """What the rank files hold, as DCP metadata plus what a report needs.

    Attributes:
        format: the per-rank format's name; schema: the key schema to read the keys with.
        entries, storage: as :class:`CheckpointMetadata`.
        objects: byte-item key -> its value (served from memory by :class:`PerRankReader`).
        replicas: ``(key, offsets, first storage, other rank's storage)`` pairs to compare.
        members: ``(rank file, window offset)`` -> the ``torch.save`` zip member whose record holds a
            chunk's window: the whole record (its CRC-32 is checked as a DCP record's, on the bytes
            read) or a part of it (a padded FSDP shard, a piece of a strided shard: the whole record
            is read and checked once, :meth:`PerRankReader.record_member`).
        files: the rank files read (relative paths); meshes: mesh shapes seen; placements: placement strings seen.
        file_ranks: rank file (relative path) -> the rank that saved it (:meth:`read_files`).
        notes: one line each: what was read and decided (``inspect`` shows them).
        companions: full-model safetensors files saved beside the shards (relative paths), which
            ``validate --deep`` compares with the assembled tensors (rule ``D006``).
        unread: files in the checkpoint directory that no item names, so not read (relative
            paths; rule ``K020`` reports them: never an OK over state that was not read).
        frozen: parameter fqns in the optimizer's param groups that have no optimizer state on
            any rank (``requires_grad=False``, or never given a gradient): torch's optimizer keeps
            state only for parameters it stepped, so in a whole ``optimizer.state_dict()`` saved
            per rank this is not lost state (rule ``O009`` and ``replay-step`` skip them, rule
            ``K021`` lists them).
        partial: rank files holding state that no entry covers (verl's RNG state in each
            ``extra_state`` file: described, never assembled); ``manifest`` digests them whole.
    """

    format: str
    schema: str
    members: dict[tuple[str, int], Member] = field(default_factory=dict)
    entries: dict[str, TensorMeta | BytesMeta] = field(default_factory=dict)
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    replicas: list[tuple[str, tuple[int, ...], StorageInfo, StorageInfo]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    file_ranks: dict[str, int] = field(default_factory=dict)
    meshes: set[tuple[int, ...]] = field(default_factory=set)
    placements: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    companions: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    _chunks: dict[str, list[ChunkMeta]] = field(default_factory=dict)
    _meta: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def read_files(self, files: list[RankFile]) -> None:
        """Record the rank files read: :attr:`files` and :attr:`file_ranks`."""
        self.files = [f.relative_path for f in files]
        self.file_ranks = {f.relative_path: f.rank for f in files}

    def add_tensor(
        self, key: str, value: LocalTensor | DTensorRec, ro: RankObject, placed: Placed | None = None
    ) -> None:
        """Add one tensor of rank file ``ro`` under ``key``: a DTensor's local shard, a plain tensor
        placed by ``placed`` (a format's own sharding metadata), or a whole plain tensor."""
        where = f"{ro.file.relative_path}: {key!r:.100}"
        if key in self.objects:
            raise PerRankError(f"{where}: a tensor in one rank file, {_kind_of(self.objects[key])} in another", fqn=key)
        if isinstance(value, DTensorRec):
            if value.local is None:
                raise PerRankError(f"{where}: a DTensor without its local tensor", fqn=key)
            local, gsize, dtype = value.local, value.size, value.dtype
            placements, mesh, coord, order = placements_of(value.spec, where)
            placed = Placed(gsize, placements, mesh, coord, _shard_order(order, placements))
        else:
            local, gsize, dtype = value, value.size, value.dtype
        if placed is not None:
            gsize = placed.size
            self.meshes.add(placed.mesh)
            self.placements.add("(" + ", ".join(map(str, placed.placements)) + ")")
            for p in placed.placements:
                if p.kind != "replicate" and not -len(gsize) <= p.dim < len(gsize):  # torch: Shard(-1) is the last dim
                    raise PerRankError(f"{where}: {p} of a {len(gsize)}-d tensor", fqn=key)
            ranges = local_ranges(gsize, placed.placements, placed.mesh, placed.coord, placed.order)
        else:
            ranges = [[(0, n)] if n else [] for n in gsize]
        if local.dtype != dtype:
            raise PerRankError(f"{where}: local tensor is {local.dtype}, the DTensor {dtype}", fqn=key)
        want = tuple(sum(k for _, k in r) for r in ranges)
        if local.size != want:
            raise PerRankError(
                f"{where}: local shard is {list(local.size)}, its placements give {list(want)} of {list(gsize)}",
                fqn=key,
                hint="the shard does not match its DTensor spec: the file is damaged or was edited",
            )
        prev = self._meta.setdefault(key, (dtype, gsize))
        if prev != (dtype, gsize):
            raise PerRankError(
                f"{where}: {dtype}{list(gsize)} here, {prev[0]}{list(prev[1])} in another rank file", fqn=key
            )
        self.entries[key] = TensorMeta(DType(dtype), gsize, ())
        for offsets, sizes, start in _blocks(ranges, local, where, key):
            self._add_chunk(key, ChunkMeta(offsets, sizes), ro, local, start, where)

    def _add_chunk(
        self, key: str, chunk: ChunkMeta, ro: RankObject, local: LocalTensor, start: int, where: str
    ) -> None:
        item = DType(local.dtype).itemsize
        rec = ro.records.get(local.key)
        nbytes = chunk.numel * item
        if rec is None and nbytes:
            raise PerRankError(f"{where}: its storage record data/{local.key} is missing", fqn=key)
        off, rec_bytes = rec if rec is not None else (0, 0)
        begin = (local.storage_offset + start) * item
        if begin + nbytes > rec_bytes or local.storage_numel * item != rec_bytes and rec is not None:
            raise PerRankError(f"{where}: the shard reaches past its storage record data/{local.key}", fqn=key)
        info = StorageInfo(ro.file.relative_path, off + begin, nbytes)
        member = ro.members.get(local.key)
        if member is not None and nbytes > 0:  # the record holding the window: its CRC-32 applies
            self.members[(info.relative_path, info.offset)] = member
        have = self.storage.get((key, chunk.offsets))
        if have is not None:
            known = next(c for c in self._chunks[key] if c.offsets == chunk.offsets)
            if known.sizes != chunk.sizes:
                raise PerRankError(f"{where}: two ranks hold overlapping shards at {list(chunk.offsets)}", fqn=key)
            self.replicas.append((key, chunk.offsets, have, info))
            return
        self.storage[(key, chunk.offsets)] = info
        self._chunks.setdefault(key, []).append(chunk)

    def add_object(self, key: str, value: Any, ro: RankObject) -> None:
        """A non-tensor value of rank file ``ro`` served as a byte item (compared across ranks when several save it).

        Its storage entry names the rank file it was read from with an empty window: the bytes
        are served from memory (:meth:`PerRankReader.raw_bytes`), never read from that window.
        """
        if key in self._meta:
            raise PerRankError(
                f"{ro.file.relative_path}: {key!r:.100}: a tensor in one rank file, {_kind_of(value)} here", fqn=key
            )
        if key in self.objects and not _same(self.objects[key], value):
            raise PerRankError(
                f"{key!r:.100} differs between rank files ({ro.file.relative_path})",
                fqn=key,
                hint="a replicated value must be equal on every rank",
            )
        if key not in self.objects:
            self.storage[(key, None)] = StorageInfo(ro.file.relative_path, 0, 0)
        self.objects[key] = value
        self.entries[key] = BytesMeta()

    def describe_placements(self) -> None:
        """Add the meshes and placements seen to :attr:`notes` (what ``inspect`` shows)."""
        if self.meshes:
            meshes = ", ".join("x".join(map(str, m)) for m in sorted(self.meshes))
            self.notes.append(f"DTensor mesh {meshes}; placements {', '.join(sorted(self.placements))}")
        else:
            self.notes.append("no DTensors: plain tensors, whole on every rank")

    def metadata(self) -> CheckpointMetadata:
        """The assembled :class:`CheckpointMetadata` (chunks sorted by offsets)."""
        for key, cs in self._chunks.items():
            meta = self.entries[key]
            assert isinstance(meta, TensorMeta)
            self.entries[key] = TensorMeta(meta.dtype, meta.size, tuple(sorted(cs)))
        for key, meta in list(self.entries.items()):
            if isinstance(meta, TensorMeta) and not meta.chunks and meta.numel == 0:
                z = ChunkMeta((0,) * len(meta.size), meta.size)
                self.entries[key] = TensorMeta(meta.dtype, meta.size, (z,))
                self.storage[(key, z.offsets)] = StorageInfo(self.files[0] if self.files else "", 0, 0)
        return CheckpointMetadata(entries=self.entries, storage=self.storage, serialization="safetensors")


def _kind_of(value: Any) -> str:
    """``a str`` / ``an int``: what a rank file holds instead of a tensor (for messages)."""
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (a != a and b != b)
    except (TypeError, ValueError, RecursionError):
        return False


def _blocks(
    ranges: list[Ranges], local: LocalTensor, where: str, key: str
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """``(global offsets, sizes, local element start)`` of the contiguous blocks of a local shard.

    A shard whose dims hold several global ranges is split into one block per range of the one
    dim that has several; each block must be contiguous in the local storage.

    Raises:
        PerRankError: a non-contiguous local tensor, or ranges that split more than one dim.
    """
    shape = tuple(sum(k for _, k in r) for r in ranges)
    if math.prod(shape) == 0:
        return []
    expect: list[int] = []
    acc = 1
    for n in reversed(shape):
        expect.append(acc)
        acc *= n
    expect.reverse()
    if any(n > 1 and s != e for n, s, e in zip(shape, local.stride, expect)):
        raise PerRankError(f"{where}: a non-contiguous local shard (stride {list(local.stride)})", fqn=key)
    split = [d for d, r in enumerate(ranges) if len(r) > 1]
    if not split:
        return [(tuple(r[0][0] for r in ranges), shape, 0)]
    d = split[0]
    if len(split) > 1 or any(n > 1 for n in shape[:d]):
        raise PerRankError(
            f"{where}: a strided shard whose pieces are not contiguous in the local tensor (not read)", fqn=key
        )
    row = math.prod(shape[d + 1 :])
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    pos = 0
    for g, n in ranges[d]:
        offsets = tuple(g if i == d else r[0][0] for i, r in enumerate(ranges))
        sizes = tuple(n if i == d else s for i, s in enumerate(shape))
        out.append((offsets, sizes, pos * row))
        pos += n
    return out


def assemble(
    root: Path, files: list[RankFile], build: Callable[[Assembled, list[RankObject]], None], *, name: str, schema: str
) -> Assembled:
    """Read every rank file and let the format's ``build`` place what they hold.

    Raises:
        PerRankError, UnsafePickleError, DataFileError: from reading a rank file or assembling.
    """
    objs = [read_rank_file(root, f) for f in files]
    a = Assembled(name, schema)
    a.read_files(files)
    build(a, objs)
    a.describe_placements()
    log.info("%s: %s", root, "; ".join(a.notes))
    return a


def flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    """DCP's flattening of nested dicts (``a.b.c``); lists and other values are leaves."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = obj


def is_tensor(v: Any) -> bool:
    return isinstance(v, (LocalTensor, DTensorRec))


def describe(v: Any) -> str:
    """A short description of a value read but not assembled (an RNG state)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}" for k in list(v)[:8]) + "}"
    if isinstance(v, LocalTensor):
        return f"tensor {v.dtype}{list(v.size)}"
    if isinstance(v, Opaque):
        return "numpy value"
    return type(v).__name__


# --------------------------------------------------------------------------- reader
def _saved(value: Any, where: str) -> bytes:
    """``value`` (plain Python values only) as a ``torch.save`` archive, the shape of a DCP byte item."""
    try:
        pkl = pickle.dumps(value, protocol=2)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
        raise PerRankError(f"{where}: not a plain value ({type(e).__name__})") from e
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


class PerRankReader(CheckpointReader):
    """A :class:`CheckpointReader` over assembled per-rank files: chunks are windows of the rank
    files, byte items the values read from them (served as ``torch.save`` bytes of the plain value).

    Args:
        path: the directory holding the rank files.
        assembled: what :func:`assemble` built.
        trust_pickle: as :class:`CheckpointReader`.
    """

    def __init__(self, path: str | os.PathLike[str], assembled: Assembled, *, trust_pickle: bool = False) -> None:
        super().__init__(path, trust_pickle=trust_pickle, metadata=assembled.metadata())
        self.assembled = assembled
        self._saved: dict[str, bytes] = {}
        self._verified: set[tuple[str, int]] = set()  # (rank file, record offset) whose CRC-32 passed

    def record_member(self, info: StorageInfo, fqn: str | None = None) -> Member | None:
        """The zip member whose whole record ``info``'s window is (its CRC-32 checked on the bytes read).

        A window that is part of its record (a padded FSDP shard, a piece of a strided shard) gets
        ``None`` once the whole record has passed its CRC-32 here (read once per record, on the
        engine); a window of no ``torch.save`` record (a safetensors rank file) gets ``None``.

        Raises:
            ChecksumError: the record holding the window fails its CRC-32 (E308, naming ``fqn``).
            DataFileError: the rank file is shorter than the record.
        """
        m = self.assembled.members.get((info.relative_path, info.offset))
        if m is None:
            return None
        if m.data_offset == info.offset and m.size == info.length:
            return m
        done = (info.relative_path, m.data_offset)
        if done not in self._verified:
            self._check_record(info.relative_path, m, fqn)
            self._verified.add(done)
        return None

    def _check_record(self, rel: str, m: Member, fqn: str | None) -> None:
        from ckpttool.engine.execute import run_item  # the engine's thread pool: loaded by the commands that read data
        from ckpttool.engine.plan import Crc32, Item

        where = f"{Path(self.path) / rel}: storage record data/{m.name.rpartition('/')[2]}"
        try:
            (crc,) = run_item(Item.of(self.fd(rel), m.data_offset, m.size, Crc32()))
        except ShortReadError:
            raise DataFileError(f"{where}: short read", path=rel, fqn=fqn) from None
        if crc != m.crc32:
            raise ChecksumError(
                f"{where}{f' (of {fqn!r})' if fqn else ''} fails its CRC-32 check (stored {m.crc32:08x}, "
                f"read {crc:08x}): the bytes changed after they were saved",
                path=rel,
                fqn=fqn,
            )

    def raw_bytes(self, fqn: str, chunk: ChunkMeta | None = None) -> bytes | bytearray:
        if chunk is None and fqn in self.assembled.objects:
            data = self._saved.get(fqn)
            if data is None:
                data = self._saved[fqn] = _saved(self.assembled.objects[fqn], f"{self.path}: {fqn!r}")
            return data
        return super().raw_bytes(fqn, chunk)

    def reads_as_value(self, fqn: str) -> bool:
        """Whether byte item ``fqn`` is read as a value from its rank file (:meth:`item_value` gives its bytes)."""
        return fqn in self.assembled.objects

    def item_value(self, fqn: str) -> bytes | None:
        """The pickle (protocol 2) of byte item ``fqn``'s value as read from its rank file (a JSON or raw item, an
        LR scheduler's state, a param group's hyperparameter): the same bytes for an equal value, so a manifest
        digests it for an item whose storage window is empty. ``None`` for a key not read as such a value.

        Raises:
            PerRankError: the value is not plain Python data.
        """
        if not self.reads_as_value(fqn):
            return None
        try:
            return pickle.dumps(self.assembled.objects[fqn], protocol=2)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
            raise PerRankError(f"{self.path}: {fqn!r}: not a plain value ({type(e).__name__})", fqn=fqn) from e

    def check_replicas(self) -> list[str]:
        """Compare every replicated shard with its first copy, byte for byte, on the engine.

        Returns:
            One line per copy that differs (``key at offsets: rank file A != rank file B``).

        Raises:
            DataFileError: a file shorter than its records.
        """
        from ckpttool.engine.execute import run_item  # the engine's thread pool: loaded by the commands that read data
        from ckpttool.engine.plan import Compare, Item

        bad: list[str] = []
        for key, offsets, first, other in self.assembled.replicas:
            if first.length != other.length:
                bad.append(f"{key} at {list(offsets)}: {first.relative_path} and {other.relative_path} differ in size")
                continue
            if not first.length:
                continue
            a, b = self.fd(first.relative_path), self.fd(other.relative_path)
            try:
                (diff,) = run_item(Item.of(a, first.offset, first.length, Compare(b, other.offset)))
            except ShortReadError:
                raise DataFileError(f"{self.path}: short read of {key!r}", fqn=key) from None
            if diff is not None:
                bad.append(f"{key} at {list(offsets)}: {first.relative_path} != {other.relative_path} (byte {diff})")
        return bad


def checked_pickle(load: Callable[[], Any], where: Any, member: str = "") -> Any:
    """``check_object_graph(load())``, the pickle's own failures as :class:`PerRankError` (E280) naming ``where``
    (and ``member``, the archive member it read): a memo bomb, or a pickle the unpickler fails on.

    Raises:
        PerRankError: as above; CkptError: as ``load`` and the object-graph check raise it.
    """
    try:
        return check_object_graph(load(), str(where))
    except CkptError:
        raise
    except PickleBombError as e:
        raise PerRankError(f"{where}: {member}{e}", path=where) from e
    except UNREADABLE_PICKLE as e:
        what = f"{member}is not" if member else "not"
        raise PerRankError(f"{where}: {what} a readable pickle ({type(e).__name__})", path=where) from e
