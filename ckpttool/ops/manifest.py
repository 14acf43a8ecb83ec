"""Integrity manifests: a digest of every stored chunk, written beside a checkpoint and verified later.

``manifest.json`` (``ckpttool.manifest`` version 2, xxh3-128): one entry per chunk of every
tensor and per byte item, with its key, offsets/sizes, storage window, the zip CRC-32 of the raw
record and the digest (:mod:`ckpttool.format.digest`) of what ``covers`` names: the whole
``window`` (``ckpttool manifest``'s default, every version-1 entry) or the raw ``record``
(what ``reshard --manifest`` computes while it writes). A manifest read back is untrusted
input: size-capped (``--max-object-size``), bounded JSON reader, checked field by field.
Format: ``docs/diff.md``, "Integrity manifests".
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckpttool.engine.io import ShortReadError, read_upto
from ckpttool.engine.pool import imap_ordered, worker_count
from ckpttool.errors import (
    CkptError,
    DataFileError,
    ManifestError,
    MetadataError,
    OutputError,
    UsageError,
    check_path,
    shell_arg,
)
from ckpttool.format import limits
from ckpttool.format.atomic import atomic_write_bytes, check_file_target, nearest_unwritable
from ckpttool.format.digest import ALGORITHMS, DEFAULT_ALGORITHM, digest_bytes, new_hasher
from ckpttool.format.files import UNREADABLE_HINT, hub_repository, read_regular, unexpanded_tilde_hint
from ckpttool.format.jsonfile import DuplicateKeyError, check_json_graph, json_error, unique_pairs
from ckpttool.format.jsonview import JsonView
from ckpttool.format.locator import ChunkLocation
from ckpttool.format.manifest_file import MANIFEST_FORMAT, MANIFEST_NAME, is_manifest_head
from ckpttool.format.marker import MARKER_NAME, recording
from ckpttool.format.metadata import BytesMeta, ChunkMeta, StorageInfo, TensorMeta
from ckpttool.format.outputs import remote_recording
from ckpttool.format.perrank import PerRankReader
from ckpttool.format.rank_local import rank_metadata_names
from ckpttool.format.reader import CheckpointReader
from ckpttool.format.unpickler import short_repr
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, OpenOptions, check_source, open_source
from ckpttool.ops.fields import Hooks, PhaseFn, ProgressFn, Unpack, hooks_of, options_of

if TYPE_CHECKING:
    from ckpttool.format.storage import RemoteStore
    from ckpttool.model.discovery import Located

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "own_manifest",
    "ManifestEntry",
    "Manifest",
    "ManifestProblem",
    "ManifestOptions",
    "ManifestResult",
    "build_manifest",
    "write_manifest",
    "load_manifest",
    "verify_manifest",
    "manifest_digest",
    "source_identity",
    "record_span",
    "record_view",
    "canonical_view",
    "sidecar_digests",
    "SOURCE_METADATA_KEY",
    "safetensors_manifest",
    "verify_safetensors_manifest",
    "ManifestCheck",
    "check_against_manifest",
    "check_manifest_kind",
    "unchecked_sizes",
    "unchecked_values",
    "write_output_manifest",
    "safetensors_source_identity",
]

MANIFEST_VERSION = 2
COVERS = ("window", "record")
#: ``covers`` of a per-rank save's byte item read as a value (JSON, raw, a pickled object in a rank file): its
#: storage window is empty, so the entry digests the value (:meth:`PerRankReader.item_value`).
VALUE = "value"
#: safetensors ``__metadata__`` key holding the source identity (a JSON string) of an export.
SOURCE_METADATA_KEY = "ckpttool.source"
METADATA_NAME = ".metadata"
#: the ``metadata.file`` of a manifest of safetensors storage without ``.metadata``: the digest is
#: of its data files' headers (names, dtypes, shapes, offsets, ``__metadata__``), in name order.
HEADERS_NAME = "safetensors headers"
#: the ``metadata.file`` of a manifest of a per-rank save (no ``.metadata``; dtypes, shapes and placements are in
#: each rank file's pickle): the digest is of the assembled tensors' dtypes, shapes and chunks, in key order.
PERRANK_NAME = "per-rank tensor metadata"
#: the ``metadata.file`` of a manifest of a rank-local DCP save in object storage (``dcp.save(...,
#: use_collectives=False)``: ``__R.metadata`` files, no ``.metadata``; locally they are ``sidecars``, which are not
#: digested through object storage): the digest of each ``__R.metadata`` object's name, size and bytes, by rank.
RANKLOCAL_NAME = "rank-local .metadata files"
_WORKERS = 2  # reader/digest threads of build_manifest
log = logging.getLogger(__name__)
#: ``on_entry(length)``: called with the bytes of each entry once it is hashed or checked (progress).
OnEntry = Callable[[int], None] | None


@dataclass(frozen=True)
class ManifestOptions:
    """How ``write_manifest`` hashes and where it writes.

    Attributes:
        out: the manifest file (default ``<checkpoint>/manifest.json``).
        algorithm: digest algorithm (:data:`ckpttool.format.digest.ALGORITHMS`).
        covers: ``window`` or ``record`` (see the module docstring).
    """

    out: str | os.PathLike[str] | None = None
    algorithm: str = DEFAULT_ALGORITHM
    covers: str = "window"


@dataclass(frozen=True)
class ManifestEntry:
    """One stored chunk (or byte item) and its digest; ``offsets`` is ``None`` for a byte item."""

    key: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    file: str
    offset: int
    length: int
    crc32: str | None
    digest: str
    covers: str = "window"
    #: ``record`` entries: the view ``data.pkl`` puts on the record (:func:`record_view`); ``None``:
    #: the view ckpttool writes (:func:`canonical_view` of the ``.metadata`` dtype and the chunk's sizes).
    view: str | None = None

    @property
    def ident(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.key, self.offsets)

    def where(self) -> str:
        """The entry as messages name it (its key at most ~200 characters: a hostile manifest's key may be huge)."""
        return short_repr(self.key, 200) + (
            f" chunk at {short_repr(list(self.offsets), 200)}" if self.offsets is not None else " (byte item)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "offsets": list(self.offsets) if self.offsets is not None else None,
            "sizes": list(self.sizes) if self.sizes is not None else None,
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
            "covers": self.covers,
            "digest": self.digest,
            **({"view": self.view} if self.view is not None else {}),
        }


@dataclass(frozen=True)
class Manifest:
    """A parsed or freshly built manifest (see the module docstring)."""

    algorithm: str
    entries: tuple[ManifestEntry, ...]
    metadata_digest: str | None = None
    metadata_size: int | None = None
    source: dict[str, Any] | None = None
    kind: str = "dcp"
    #: kind ``safetensors``: ``{"file", "header_length", "header_digest"}`` per output file.
    files: tuple[dict[str, Any], ...] = ()
    #: ``{"file", "size", "digest"}`` of every other file in the directory (``layout.json``,
    #: ``extra_state/``, ``model_assets/``, an index, ``config.json``); ``None``: not recorded
    #: (a manifest of an older ckpttool: sidecars and added files are then not checked).
    sidecars: tuple[dict[str, Any], ...] | None = None
    #: the file it was read from (:func:`load_manifest`), left out of the sidecars checked.
    path: str | None = None
    #: what ``metadata_digest`` digests: ``.metadata``, or :data:`HEADERS_NAME`.
    metadata_file: str = METADATA_NAME
    #: ``{"file", "size", "digest"}`` of the training-state files the trainer saved beside the checkpoint
    #: (OLMo-core's ``train/rankR.pt`` and ``.metadata.json``, NeMo Automodel's ``step_scheduler.pt``; names
    #: relative to the step directory); ``None``: none were there (or an older ckpttool): such files are then not checked.
    training_state: tuple[dict[str, Any], ...] | None = None
    #: kind ``dcp``: ``{"file", "size"}`` of every data file the entries' windows lie in, as it was when digested:
    #: bytes appended after the last window (which no entry covers) are ``changed``; ``None``: not recorded (an
    #: older ckpttool, a remote checkpoint): file sizes are then not checked.
    data_files: tuple[dict[str, Any], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "kind": self.kind,
            "algorithm": self.algorithm,
            "metadata": (
                {"file": self.metadata_file, "size": self.metadata_size, "digest": self.metadata_digest}
                if self.metadata_digest is not None
                else None
            ),
            "entries": [e.to_dict() for e in self.entries],
        }
        if self.kind == "safetensors":
            out["files"] = [dict(f) for f in self.files]
        if self.data_files is not None:
            out["data_files"] = [dict(f) for f in self.data_files]
        if self.sidecars is not None:
            out["sidecars"] = [dict(f) for f in self.sidecars]
        if self.training_state is not None:
            out["training_state"] = [dict(f) for f in self.training_state]
        if self.source is not None:
            out["source"] = self.source
        return out

    def to_bytes(self) -> bytes:
        import json

        return (json.dumps(self.to_dict(), indent=None, separators=(",", ":")) + "\n").encode("utf-8")


@dataclass(frozen=True)
class ManifestProblem:
    """A difference between a checkpoint and its manifest.

    Attributes:
        kind: ``missing`` (in the manifest, not in the checkpoint), ``extra`` (stored, not in the
            manifest), ``changed`` (digest differs), ``moved`` (same digest, other window: informational
            only when the digest matches), ``metadata`` (``.metadata`` differs).
        key: the checkpoint key (``.metadata`` for a metadata problem).
        offsets: the chunk's offsets (``None``: a byte item or the metadata).
        message: one line naming the chunk.
    """

    kind: str
    key: str
    offsets: tuple[int, ...] | None
    message: str


#: The ``--json`` document of :class:`ManifestResult`: its keys in order.
_MANIFEST_VIEW = JsonView(
    "ckpttool.manifest/1",
    "checkpoint path algorithm entries bytes_hashed seconds:6 hash_seconds:6 gb_per_s:3 digest metadata_digest covers"
    " warnings",
)


@dataclass(frozen=True)
class ManifestResult:
    """What ``ckpttool manifest`` wrote (``--json``: schema ``ckpttool.manifest/1``).

    ``bytes_hashed``: every byte digested, the entries' windows and the files beside the data (``sidecars``,
    ``training_state``) alike; ``hash_seconds``: the time of that hashing; ``seconds``: the whole run;
    ``warnings``: a newer step below the run root whose save did not finish (validate's ``R001``).
    """

    checkpoint: str
    path: str
    algorithm: str
    entries: int
    bytes_hashed: int
    seconds: float
    digest: str
    metadata_digest: str | None
    warnings: list[str] = field(default_factory=list)
    covers: str = "window"
    hash_seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        """Bytes hashed per second of the hashing phase (``hash_seconds``), in GB/s (10^9)."""
        return self.bytes_hashed / self.hash_seconds / 1e9 if self.hash_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return _MANIFEST_VIEW.render(self, warnings=list(self.warnings))


def check_algorithm(algorithm: str) -> None:
    """Refuse a digest ``algorithm`` that is not a key of :data:`~ckpttool.format.digest.ALGORITHMS`
    (``xxh3-128``, ``blake3``, ``blake2b-256``), before any work: the ``hash`` of manifest, export, reshard
    and import, a dry run's too.

    Raises:
        UsageError: ``algorithm`` is not one of them (E100, not a ``KeyError``).
    """
    if type(algorithm) is not str or algorithm not in ALGORITHMS:  # a list or object is no dict key
        raise UsageError(
            f"`algorithm` {algorithm!r} is not one of {', '.join(ALGORITHMS)}",
            param="algorithm",
            hint=f"{DEFAULT_ALGORITHM} is the fast default; blake3 is cryptographic",
        )


def _read_into(h: Any, fd: int, offset: int, length: int, crc_span: tuple[int, int] | None = None) -> int | None:
    """Feed ``[offset, offset+length)`` of ``fd`` to ``h.update`` through the engine (imported here: an export,
    which imports this module for :func:`source_identity`, does not need the engine's executor at start-up);
    with ``crc_span`` ``(start, end)`` (relative to ``offset``) also the CRC-32 of those bytes, from the same read.

    Raises:
        ShortReadError: the file ends inside the window.
    """
    from ckpttool.engine.execute import run_item
    from ckpttool.engine.plan import Crc32, Feed, Item

    if crc_span is None:
        run_item(Item.of(fd, offset, length, Feed(h.update)))
        return None
    return int(run_item(Item.of(fd, offset, length, Feed(h.update), Crc32(*crc_span)))[1])


def _hash_range(
    reader: CheckpointReader,
    rel: str,
    offset: int,
    length: int,
    fqn: str,
    algorithm: str,
    loc: ChunkLocation | None = None,
) -> str:
    """Digest of ``[offset, offset+length)`` of data file ``rel``; with ``loc`` (a chunk whose storage record
    lies in that range and has a zip CRC-32) the record's CRC-32 is checked on the same read.

    Raises:
        DataFileError: the file ends inside the range.
        ChecksumError: the record fails its CRC-32 (E308: a manifest is never written over damaged bytes).
    """
    h = new_hasher(algorithm)
    span = None
    if loc is not None and loc.record.member is not None and not loc.record.deflated:
        start = loc.data_start - offset
        span = (start, start + loc.record.compressed_size)
    try:
        crc = _read_into(h, reader.fd(rel), offset, length, span)
    except ShortReadError:
        raise DataFileError(
            f"{reader.path / rel}: short read of {fqn!r} (the file ends inside its window)",
            path=rel,
            fqn=fqn,
        ) from None
    reader.count_read(length)
    if crc is not None and loc is not None:
        loc.check_crc(crc)
    return h.hexdigest()


def record_span(reader: CheckpointReader, key: str, chunk: ChunkMeta) -> tuple[int, int] | None:
    """``(start, length)`` of a chunk's raw storage record in its data file (``None``: not in the file as is).

    ``None`` for a chunk behind a stream transform (its archive is decoded, not stored) or
    in safetensors storage (the window is the record). A storage without a record (zero
    elements) is ``(window start, 0)``.

    Raises:
        the chunk locator's errors for a damaged archive.
    """
    if reader.metadata.serialization != "torch_save":
        return None
    info = reader.storage_info(key, chunk)
    loc = reader.locate(key, chunk)
    if not loc.in_file:
        return None
    rec = loc.record
    if rec.member is None:
        return (info.offset, 0)
    return (info.offset + rec.data_offset, rec.compressed_size)


def record_view(reader: CheckpointReader, key: str, chunk: ChunkMeta) -> str:
    """The view ``data.pkl`` puts on a chunk's storage record: ``dtype;size;stride;storage_offset;byteorder``.

    What a reader gets from the record's bytes (a stride swapped from ``(32, 1)`` to ``(1, 32)``
    gives the transpose from the same bytes), so a ``record`` entry digests it beside the bytes.

    Raises:
        the chunk locator's errors for a damaged archive.
    """
    rec = reader.locate(key, chunk).record
    return _view(rec.dtype, rec.size, rec.stride, rec.storage_offset, rec.big_endian)


def canonical_view(dtype: str, sizes: tuple[int, ...]) -> str:
    """The view ckpttool's writer gives every chunk it writes: contiguous, offset 0, little-endian."""
    stride, n = [], 1
    for d in reversed(sizes):
        stride.append(n)
        n *= max(d, 1)
    return _view(dtype, tuple(sizes), tuple(reversed(stride)), 0, False)


def _view(dtype: str, size: tuple[int, ...], stride: tuple[int, ...], offset: int, big: bool) -> str:
    dims = ",".join(map(str, size))
    return f"{dtype};{dims};{','.join(map(str, stride))};{offset};{'big' if big else 'little'}"


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` is C order for ``size`` (dims of 1 may have any stride, as torch's is_contiguous)."""
    n = 1
    for d, st in zip(reversed(size), reversed(stride)):
        if d != 1 and st != n:
            return False
        n *= max(d, 1)  # torch's contiguous strides treat an empty dim as 1
    return True


def _view_problem(reader: CheckpointReader, e: ManifestEntry, chunk: ChunkMeta) -> str | None:
    """How the chunk's record view differs from the one its ``record`` entry pins (``None``: it does not)."""
    rec = reader.locate(e.key, chunk).record
    got = _view(rec.dtype, rec.size, rec.stride, rec.storage_offset, rec.big_endian)
    if e.view is not None:
        return None if got == e.view else f"the view in data.pkl is {got}, the manifest says {e.view}"
    meta = reader.metadata.entries.get(e.key)
    dtype = meta.dtype.name if isinstance(meta, TensorMeta) else rec.dtype
    ok = (
        rec.dtype == dtype
        and tuple(rec.size) == tuple(chunk.sizes)
        and _contiguous(tuple(rec.size), tuple(rec.stride))
        and rec.storage_offset == 0
        and not rec.big_endian
    )
    return None if ok else f"the view in data.pkl is {got}, not the {canonical_view(dtype, chunk.sizes)} written"


def _hash_entry(
    reader: CheckpointReader,
    key: str,
    chunk: ChunkMeta | None,
    covers: str,
    algorithm: str,
    loc: ChunkLocation | None = None,
) -> tuple[str, str]:
    """``(covers, digest)`` of one entry; ``record`` falls back to ``window`` where a chunk has no stored record.
    ``loc``: the chunk's location when it lies in its data file as is (its record's CRC-32 checked on the read)."""
    info = reader.storage_info(key, chunk)
    if covers == VALUE:
        value = reader.item_value(key) if isinstance(reader, PerRankReader) and chunk is None else None
        if value is not None:
            reader.count_read(len(value))
            return VALUE, digest_bytes(value, algorithm)
    reader.fetch(info)  # a remote checkpoint: its window into the spool (read unfetched, it is zeros); local: nothing
    if covers == "record" and chunk is not None:
        span = record_span(reader, key, chunk)
        if span is not None:
            return "record", _hash_range(reader, info.relative_path, span[0], span[1], key, algorithm, loc)
    return "window", _hash_range(reader, info.relative_path, info.offset, info.length, key, algorithm, loc)


def _release(reader: CheckpointReader, key: str, chunk: ChunkMeta | None) -> None:
    """A remote checkpoint: give a chunk's window back to the spool once digested, so it holds the entries being
    hashed, not every one (docs/storage.md); byte items stay (small, capped). A local one: nothing. A window past
    its object's listed end (the object cut short: the entry's problem, said already) was never fetched."""
    if chunk is not None and chunk.numel and getattr(reader, "spool", None) is not None:
        try:
            info = reader.storage_info(key, chunk)
        except DataFileError:
            return
        reader.evict([info])


def _items(reader: CheckpointReader) -> list[tuple[str, ChunkMeta | None]]:
    out: list[tuple[str, ChunkMeta | None]] = []
    for key, meta in reader.metadata.entries.items():
        if isinstance(meta, TensorMeta):
            out.extend((key, c) for c in meta.chunks)
        elif isinstance(meta, BytesMeta):
            out.append((key, None))
    return out


def _metadata_file(reader: CheckpointReader) -> str:
    """What :func:`_metadata_digest` digests for ``reader``: ``.metadata``, :data:`PERRANK_NAME` or :data:`HEADERS_NAME`."""
    if isinstance(reader, PerRankReader):
        return PERRANK_NAME
    if _has_metadata(reader):
        return METADATA_NAME
    return RANKLOCAL_NAME if _remote_rank_metadata(reader) else HEADERS_NAME


def _remote_rank_metadata(reader: CheckpointReader) -> list[str]:
    """The ``__R.metadata`` objects of a remote rank-local save, by rank (``[]``: local, or not one)."""
    if reader.remote is None or reader.parts:
        return []
    return [name for _, name in rank_metadata_names(set(reader.remote.sizes()))]


def _ranklocal_digest(reader: CheckpointReader, names: list[str], algorithm: str) -> tuple[str, int]:
    """Digest and total size of a remote rank-local save's ``__R.metadata`` objects (each read whole, capped by
    ``--max-metadata-size``, pinned to the listing): their names, sizes and bytes, by rank.

    Raises:
        DataFileError: (E300) an object changed since the listing; the storage errors (``E140``-``E144``).
    """
    assert reader.remote is not None
    h = new_hasher(algorithm)
    total = 0
    for name in names:
        data = reader.remote.read_whole(name, limits.current().max_metadata_bytes, what="rank metadata")
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
        total += len(data)
    return h.hexdigest(), total


def _has_metadata(reader: CheckpointReader) -> bool:
    """Whether the checkpoint has a ``.metadata`` file (a remote one: in the prefix's listing)."""
    if reader.remote is not None:
        return reader.remote.size(METADATA_NAME) is not None
    return (Path(reader.path) / METADATA_NAME).exists()


def _perrank_digest(reader: CheckpointReader, algorithm: str) -> tuple[str, int]:
    """Digest and size of a per-rank save's assembled tensor metadata: each tensor's key, dtype, shape and
    chunks, in key order (what ``.metadata`` records for DCP; the shards' windows do not show a dtype changed
    in a rank file's pickle)."""
    rows = [
        [key, meta.dtype.name, list(meta.size), [[list(c.offsets), list(c.sizes)] for c in meta.chunks]]
        for key, meta in sorted(reader.metadata.entries.items())
        if isinstance(meta, TensorMeta)
    ]
    data = json.dumps(rows, separators=(",", ":")).encode()
    return digest_bytes(data, algorithm), len(data)


def _metadata_digest(reader: CheckpointReader, algorithm: str) -> tuple[str | None, int | None]:
    if reader.parts:
        return None, None  # a composed model/optimizer pair has two
    if isinstance(reader, PerRankReader):
        return _perrank_digest(reader, algorithm)
    if not _has_metadata(reader):
        ranks = _remote_rank_metadata(reader)  # locally the sidecars cover them: not digested through storage
        if ranks:
            return _ranklocal_digest(reader, ranks, algorithm)
        return _headers_digest(reader, algorithm)  # (None, None) for a remote one: not digested, as its sidecars
    known = reader.metadata_file_digest(algorithm)  # digested as read at open: no second read
    if known is not None:
        return known
    return _reread_metadata_digest(reader, algorithm)


def _headers_digest(reader: CheckpointReader, algorithm: str) -> tuple[str | None, int | None]:
    """Digest and size of the headers of a local safetensors storage's data files (``(None, None)``: not one).

    The headers hold what ``.metadata`` holds for DCP (dtypes, shapes, offsets): a dtype changed
    in a header leaves every data window's bytes as they were.
    """
    if reader.metadata.serialization == "torch_save" or reader.remote is not None:
        return None, None
    files = sorted(
        name
        for name in {reader.storage_info(k, c).relative_path for k, c in _items(reader) if _has_storage(reader, k, c)}
        if name.endswith(".safetensors")  # a per-rank checkpoint's torch.save rank files have no such header
    )
    if not files:
        return None, None
    h = new_hasher(algorithm)
    size = _digest_headers(Path(reader.path), files, h)
    return h.hexdigest(), size


def _digest_headers(directory: Path, files: list[str], h: Any) -> int:
    """Feed the header (length prefix and JSON) of each of ``files`` to ``h``, in name order; their bytes.

    Raises:
        MetadataError, NotRegularFileError, PathEscapeError: unreadable files.
    """
    from ckpttool.format.files import open_regular, resolve_inside
    from ckpttool.format.hf_storage import read_safetensors_header

    size = 0
    for name in sorted(files):
        path = resolve_inside(directory, name, what="safetensors file")
        _, data_start = read_safetensors_header(path)
        fd = open_regular(path)
        try:
            head = read_upto(fd, data_start, 0)
        finally:
            os.close(fd)
        h.update(head)
        size += len(head)
    return size


def _reread_metadata_digest(reader: CheckpointReader, algorithm: str) -> tuple[str, int]:
    """Digest (``algorithm``) and size of ``.metadata`` read again, when they are not known from the open.

    Raises:
        DataFileError: the bytes differ from those parsed at open (the digest would name
            another ``.metadata`` than the one the output was made from).
    """

    data = reader.read_file(METADATA_NAME, limits.current().max_metadata_bytes, what=".metadata")
    at_open = reader.metadata_file_digest(DEFAULT_ALGORITHM)
    if at_open is not None and (len(data), digest_bytes(data, DEFAULT_ALGORITHM)) != (at_open[1], at_open[0]):
        raise DataFileError(
            f"{reader.path / METADATA_NAME}: changed since it was read at open",
            path=reader.path / METADATA_NAME,
            hint="the checkpoint is being written to; rerun when the save is complete",
        )
    return digest_bytes(data, algorithm), len(data)


def build_manifest(
    reader: CheckpointReader,
    algorithm: str = DEFAULT_ALGORITHM,
    *,
    covers: str = "window",
    on_entry: Callable[[int], None] | None = None,
    exclude: tuple[str, ...] = (),
    beside_of: Path | None = None,
) -> Manifest:
    """Digest every chunk window and byte item of an open checkpoint (each byte read once).

    Args:
        reader: the checkpoint's reader.
        algorithm: a key of :data:`ckpttool.format.digest.ALGORITHMS`.
        covers: ``window`` (whole chunk windows) or ``record`` (chunks' raw storage records;
            byte items and chunks without a stored record are still ``window`` entries).
        on_entry: called with the bytes of each entry as it is hashed (progress).
        beside_of: the checkpoint's model folder: the training-state files saved beside it
            (:func:`~ckpttool.model.beside.training_state_beside`) are digested too.

    Raises:
        UsageError: unknown ``algorithm``.
        DataFileError, ChunkError: a window outside its file, a damaged archive (chunk locator); a data file
            written to or replaced while it was read (E300: :meth:`~ckpttool.format.directory.CheckpointDir.check_unchanged`).
    """
    check_algorithm(algorithm)
    _check_covers(covers)

    def one(item: tuple[str, ChunkMeta | None]) -> ManifestEntry:
        key, chunk = item
        info = reader.storage_info(key, chunk)
        crc: str | None = None
        loc = None
        if chunk is not None and chunk.numel > 0:
            loc = reader.locate(key, chunk)  # a per-rank shard's record member too (its CRC-32 checked)
            if loc.record.member is not None:  # a torch.save record's (DCP, per-rank), not a safetensors window
                crc = f"{loc.record.crc32:08x}"
            if not loc.in_file:
                loc = None  # behind a stream transform: the locator checked the decoded record
        as_value = chunk is None and not info.length and isinstance(reader, PerRankReader)
        kind, digest = _hash_entry(reader, key, chunk, VALUE if as_value else covers, algorithm, loc)
        view = None
        if kind == "record" and chunk is not None:  # recorded when not the view ckpttool writes (checked then)
            view = record_view(reader, key, chunk)
            meta = reader.metadata.entries[key]
            if isinstance(meta, TensorMeta) and view == canonical_view(meta.dtype.name, chunk.sizes):
                view = None
        _release(reader, key, chunk)
        return ManifestEntry(
            key,
            chunk.offsets if chunk is not None else None,
            chunk.sizes if chunk is not None else None,
            info.relative_path,
            info.offset,
            info.length,
            crc,
            digest,
            kind,
            view,
        )

    # Reads and the digests release the GIL: two workers overlap one entry's read with
    # another's hashing. Entries keep the checkpoint's order.
    entries: list[ManifestEntry] = []
    workers = worker_count(_WORKERS, os.cpu_count() or 1)
    items = _items(reader)
    for start in range(0, len(items), 1024):  # bounded number of items in flight
        for entry in imap_ordered(one, items[start : start + 1024], workers=workers):
            entries.append(entry)
            if on_entry is not None:
                on_entry(entry.length)
    md, size = _metadata_digest(reader, algorithm)
    md_file = METADATA_NAME if md is None else _metadata_file(reader)
    beside = _files_beside(reader, entries, algorithm, exclude, beside_of)
    reader.check_unchanged()  # a data file written meanwhile: its digests name no state the checkpoint had
    return Manifest(algorithm, tuple(entries), md, size, metadata_file=md_file, **beside)


def _files_beside(
    reader: CheckpointReader,
    entries: list[ManifestEntry],
    algorithm: str,
    exclude: tuple[str, ...],
    beside_of: Path | None,
) -> dict[str, Any]:
    """The :class:`Manifest` fields on the files of a local checkpoint: ``sidecars``, ``training_state`` and
    ``data_files``; of a remote one ``data_files`` alone (the sizes its listing gave)."""
    if reader.remote is not None:
        return {"data_files": tuple(_data_file_sizes_of(reader, (e.file for e in entries)))}
    sidecars = None
    if _parts_below(reader):
        skip = {
            METADATA_NAME,
            *_own_manifest(Path(reader.path), placed=exclude),
            *(e.file for e in entries),
            *(exclude or ()),
        }
        skip -= set(_partial_files(reader))  # state in no entry (verl's RNG): the whole file is digested
        sidecars = tuple(sidecar_digests(Path(reader.path), skip, algorithm))
    training = tuple(training_state_digests(beside_of, algorithm)) if beside_of else ()
    return {
        "sidecars": sidecars,
        "training_state": training or None,
        "data_files": tuple(data_file_sizes(Path(reader.path), (e.file for e in entries))),
    }


def data_file_sizes(root: Path, files: Iterable[str]) -> list[dict[str, Any]]:
    """``{"file", "size"}`` of each data file named in ``files`` (once, in name order) that is a regular file
    below ``root``: what ``data_files`` records (the bytes after the last window are in no entry)."""
    out = []
    for name in sorted(set(files)):
        try:
            st = os.lstat(root / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append({"file": name, "size": st.st_size})
    return out


def _data_file_sizes_of(reader: CheckpointReader, files: Iterable[str]) -> list[dict[str, Any]]:
    """:func:`data_file_sizes` of ``reader``'s checkpoint: of a remote one, the objects' sizes from its listing."""
    store = reader.remote
    if store is None:
        return data_file_sizes(Path(reader.path), files)
    sizes = ((name, store.size(name)) for name in sorted(set(files)))
    return [{"file": name, "size": size} for name, size in sizes if size is not None]


def training_state_digests(model_dir: Path, algorithm: str) -> list[dict[str, Any]]:
    """``{"file", "size", "digest"}`` of each file a trainer saved beside ``model_dir`` (OLMo-core's
    ``train/rankR.pt`` and ``.metadata.json``, NeMo Automodel's ``step_scheduler.pt``:
    :func:`~ckpttool.model.beside.files_beside`), named relative to the step directory; a symlink is
    listed (``"digest": "symlink:<digest of its target>"``), never followed.

    Raises:
        DataFileError: a file that cannot be read.
    """
    import stat

    from ckpttool.model.beside import files_beside

    out: list[dict[str, Any]] = []
    for rel in files_beside(model_dir):
        full = model_dir.parent / rel
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            out.append(_link_or_special(full, rel, st.st_mode, algorithm))
            continue
        fd = _open_beside(full)
        try:
            out.append({"file": rel, "size": st.st_size, "digest": _hash_fd(fd, 0, st.st_size, algorithm, full, rel)})
        finally:
            os.close(fd)
    return out


def _parts_below(reader: CheckpointReader) -> bool:
    """Whether every folder of a model/optimizer pair lies directly in the reader's directory (NeMo's
    ``model/`` + ``optim/``, Accelerate's ``pytorch_model_fsdp_0/`` + ``optimizer_0/``): its sidecars are
    then the step directory's other files, the folders' ``.metadata`` included. Always for one checkpoint."""
    root = Path(reader.path).resolve()
    return all(p.resolve().parent == root for p in reader.parts.values())


def _partial_files(reader: CheckpointReader) -> list[str]:
    """Data files holding state that no entry covers (a per-rank save's RNG state): digested whole as sidecars."""
    return list(getattr(getattr(reader, "assembled", None), "partial", ()))


#: Files a manifest's ``sidecars`` may list; a directory holding more is refused (``E307``).
MAX_SIDECARS = 1 << 16


def sidecar_digests(root: Path, skip: set[str], algorithm: str) -> list[dict[str, Any]]:
    """``{"file", "size", "digest"}`` of every file below ``root`` but ``skip`` (relative names) and
    ckpttool's output marker (:data:`~ckpttool.format.marker.MARKER_NAME`: no reader uses it, and
    ``manifest``/``stamp`` update it when they add their file), in name order.

    Symlinks and special files are listed with ``digest`` ``"symlink:<digest of the link's target text>"`` /
    ``"special"`` (never followed or read). Refused past :data:`MAX_SIDECARS` files.

    Raises:
        SizeLimitError: more than :data:`MAX_SIDECARS` files; DataFileError: a file that cannot be read.
    """
    import stat

    from ckpttool.errors import SizeLimitError

    out: list[dict[str, Any]] = []
    for full, rel in _files_below(root, skip):
        if len(out) >= MAX_SIDECARS:
            raise SizeLimitError(f"{root}: more than {MAX_SIDECARS:,} files beside the checkpoint's data", path=root)
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            out.append(_link_or_special(full, rel, st.st_mode, algorithm))
            continue
        fd = _open_beside(Path(full))
        try:
            digest = _hash_fd(fd, 0, st.st_size, algorithm, Path(full), rel)
        finally:
            os.close(fd)
        out.append({"file": rel, "size": st.st_size, "digest": digest})
    return out


#: The hint of a file or folder beside the data that cannot be read (a manifest vouches for every one).
_UNREADABLE_HINT = f"{UNREADABLE_HINT}: a manifest digests every file below the checkpoint"


def _open_beside(full: Path) -> int:
    """A read descriptor of ``full``, a regular file beside the data (a sidecar, a training-state file).

    Raises:
        DataFileError (E300): it cannot be opened (permissions), naming it: no manifest or verdict leaves it out.
        NotRegularFileError (E102): it is no longer a regular file.
    """
    from ckpttool.format.files import open_regular

    try:
        return open_regular(full)
    except OSError as e:
        raise DataFileError(f"{full}: cannot read ({e.strerror})", path=full, hint=_UNREADABLE_HINT) from e


def _unlistable(e: OSError) -> None:
    """``os.walk``'s ``onerror``: a folder below the checkpoint that cannot be listed is ``E300`` naming it (the
    walk would skip it, and its files would be neither digested nor checked)."""
    where = e.filename if e.filename is not None else "a folder below the checkpoint"
    raise DataFileError(f"{where}: cannot list the folder ({e.strerror})", path=where, hint=_UNREADABLE_HINT) from e


#: The ``digest`` of a symlink listed by a manifest of an older ckpttool (its target not recorded).
_LINK = "symlink"


def _link_or_special(full: str | Path, rel: str, mode: int, algorithm: str) -> dict[str, Any]:
    """The ``sidecars`` / ``training_state`` item of a file that is not read: a symlink as ``"symlink:"`` and the
    digest of its target (the link's own text, never followed; ``size`` its length), so that a link pointed
    elsewhere is ``changed``; anything else ``"special"``."""
    import stat

    if not stat.S_ISLNK(mode):
        return {"file": rel, "size": 0, "digest": "special"}
    target = os.fsencode(os.readlink(full))
    return {"file": rel, "size": len(target), "digest": f"{_LINK}:{digest_bytes(target, algorithm)}"}


def _files_below(root: Path, skip: set[str]) -> Iterator[tuple[str, str]]:
    """``(path, name relative to root)`` of every file below ``root`` (a symlinked folder as one file, never
    followed) but ``skip`` and ckpttool's output marker, in name order: what ``sidecars`` lists."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_unlistable):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel not in skip and rel != MARKER_NAME:
                yield full, rel


def unchecked_beside(reader: CheckpointReader, manifest: Manifest) -> list[str]:
    """Files beside a local checkpoint's data that ``manifest`` cannot vouch for because it has no ``sidecars``
    list (written by an older ckpttool): ``layout.json``, ``extra_state/``, added files (at most 1,000 names)."""
    if manifest.sidecars is not None or reader.remote is not None or not _parts_below(reader):
        return []
    root = Path(reader.path)
    held = {reader.storage_info(k, c).relative_path for k, c in _items(reader) if _has_storage(reader, k, c)}
    skip = {
        METADATA_NAME,
        *_own_manifest(root, manifest),
        *held,
        *(e.file for e in manifest.entries),
        *_inside(root, manifest.path),
    }
    return [rel for _, rel in islice(_files_below(root, skip), 1000)]


def remote_beside(reader: CheckpointReader, exclude: Iterable[str] = ()) -> list[str]:
    """Objects beside a remote checkpoint's data (its prefix's listing but ``.metadata``, the data files, a rank-local
    save's ``__R.metadata``, ``manifest.json``, ckpttool's marker and ``exclude``): ``extra_state/``, a config, which
    no manifest of it digests (they are not fetched through object storage), in name order, at most 1,000.
    ``[]`` for a local checkpoint."""
    store = reader.remote
    if store is None:
        return []
    held = {reader.storage_info(k, c).relative_path for k, c in _items(reader) if _has_storage(reader, k, c)}
    skip = {METADATA_NAME, MANIFEST_NAME, MARKER_NAME, *held, *_remote_rank_metadata(reader), *exclude}
    return [name for name in sorted(store.sizes()) if name not in skip][:1000]


def _remote_beside_warning(where: str, names: list[str], done: str) -> list[str]:
    """The ``warning:`` line of :func:`remote_beside`'s ``names`` (none when there are none)."""
    if not names:
        return []
    more = ", ..." if len(names) > 5 else ""
    return [
        f"{where}: {_plural_files(len(names))} beside the data of a remote checkpoint {done} "
        f"({', '.join(names[:5])}{more}): they are not fetched through object storage; copy the checkpoint to a "
        "local directory to cover them"
    ]


def unchecked_sizes(reader: CheckpointReader, manifest: Manifest) -> list[str]:
    """Data files of a checkpoint whose size ``manifest`` cannot vouch for because it has no ``data_files`` list
    (written by an older ckpttool, or edited), or because its ``data_files`` leaves them out (edited: this ckpttool
    records every regular data file the entries' windows lie in; a symlinked one is digested whole as the sidecar
    it points to): bytes appended after their last chunk, which no entry covers, are not checked (at most 1,000
    names, in name order)."""
    if manifest.kind != "dcp":
        return []
    held = {reader.storage_info(k, c).relative_path for k, c in _items(reader) if _has_storage(reader, k, c)}
    if manifest.data_files is None:
        return sorted(held)[:1000]
    listed = {f["file"] for f in manifest.data_files}
    return [f["file"] for f in _data_file_sizes_of(reader, held - listed)][:1000]


def unchecked_values(reader: CheckpointReader, manifest: Manifest) -> list[str]:
    """Byte items of a per-rank save read as values (a JSON or raw item, a pickled LR scheduler state or param-group
    hyperparameter: :meth:`~ckpttool.format.perrank.PerRankReader.item_value`) that ``manifest`` lists as ``window``
    entries of their empty storage window (written by an older ckpttool, or edited): the digest of no bytes, which
    vouches for nothing of the value (at most 1,000 keys, in manifest order)."""
    if not isinstance(reader, PerRankReader):
        return []
    keys = (
        e.key
        for e in manifest.entries
        if e.covers == "window" and e.offsets is None and not e.length and reader.reads_as_value(e.key)
    )
    return list(islice(keys, 1000))


def unchecked_training_state(reader: CheckpointReader, manifest: Manifest, model_dir: Path) -> list[str]:
    """Training-state files a trainer saved beside a local checkpoint's model folder ``model_dir``
    (:func:`~ckpttool.model.beside.files_beside`: OLMo-core's ``train/rankR.pt``, NeMo Automodel's
    ``step_scheduler.pt``) that ``manifest`` cannot vouch for because it has no ``training_state`` list."""
    from ckpttool.model.beside import files_beside

    if manifest.kind != "dcp" or manifest.training_state is not None or reader.remote is not None:
        return []
    return files_beside(model_dir)


def _sidecar_problems(
    root: Path, listed: tuple[dict[str, Any], ...] | None, skip: set[str], algorithm: str
) -> list[ManifestProblem]:
    """Sidecars missing, changed or added since the manifest (none when it lists none: an older manifest)."""
    if listed is None:
        return []
    return _file_problems(listed, {f["file"]: f for f in sidecar_digests(root, skip, algorithm)})


def _file_problems(listed: tuple[dict[str, Any], ...], now: dict[str, dict[str, Any]]) -> list[ManifestProblem]:
    """Files of ``listed`` missing from ``now`` or different there, and files of ``now`` not listed."""
    problems: list[ManifestProblem] = []
    for f in listed:
        got = now.pop(f["file"], None)
        if got is None:
            shown = f["file"] if len(f["file"]) <= 200 else f["file"][:197] + "..."  # a hostile manifest's name
            problems.append(ManifestProblem("missing", f["file"], None, f"{shown}: in the manifest, not on disk"))
        elif (got["size"], got["digest"]) != (f["size"], f["digest"]) and not _older_link(f, got):
            problems.append(ManifestProblem("changed", f["file"], None, f"{f['file']}: differs from the manifest"))
    for name in sorted(now):
        problems.append(ManifestProblem("extra", name, None, f"{name}: a file the manifest does not list (added)"))
    return problems


def _older_link(listed: dict[str, Any], now: dict[str, Any]) -> bool:
    """A symlink listed by an older manifest (``"symlink"``, size 0: its target not recorded) that is a symlink now."""
    return listed["digest"] == _LINK and listed["size"] == 0 and str(now["digest"]).startswith(_LINK + ":")


def _check_covers(covers: str) -> None:
    if covers not in COVERS:
        raise UsageError(
            f"`covers` {covers!r} is not one of {', '.join(COVERS)}",
            param="covers",
            hint="window digests whole chunk windows; record only the raw storage records",
        )


def manifest_digest(data: bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The digest of a manifest file's bytes (how outputs name the manifest of their source)."""
    return digest_bytes(data, algorithm)


def source_identity(reader: CheckpointReader, algorithm: str = DEFAULT_ALGORITHM) -> dict[str, Any]:
    """The identity of a checkpoint an output is made from (``converted_from.source``, safetensors metadata).

    ``{"checkpoint": path, "algorithm": ..., "metadata_digest": <digest of .metadata>,
    "metadata_size": bytes, "manifest_digest": <digest of its manifest.json> | null}``: the
    ``.metadata`` digest equals the ``metadata.digest`` of ``ckpttool manifest`` of the source
    (a ``HuggingFaceStorageWriter`` checkpoint without ``.metadata``: the digest of its files'
    headers, as :func:`safetensors_source_identity`),
    the manifest digest that of the source's ``manifest.json`` file (``null`` when it has none).
    The ``.metadata`` digest is the one taken as the reader read it at open
    (:meth:`~ckpttool.format.directory.CheckpointDir.metadata_file_digest`, default algorithm);
    another algorithm reads ``.metadata`` again. Reads ``manifest.json``, never a data file. Outputs
    record it without ``checkpoint`` (content only: the same source exported or resharded from
    another place gives the same bytes); manifests and ``--json`` results keep the path.

    Raises:
        the reader's errors for an unreadable ``.metadata``; SizeLimitError: an oversized manifest.
    """

    check_algorithm(algorithm)  # `hash` of export/reshard: E100, not a KeyError
    md: str | None = None
    size: int | None = None
    if not reader.parts:  # a model/optimizer pair has two: named by neither alone
        try:
            known = reader.metadata_file_digest(algorithm)  # the bytes read at open: no second read
            if known is None:
                known = _reread_metadata_digest(reader, algorithm)
            md, size = known
        except DataFileError:
            if reader.metadata.serialization != "safetensors" or reader.remote is not None:
                raise
            # HuggingFaceStorageWriter output without .metadata: its headers play that part
            from ckpttool.format.hf_storage import hf_storage_files

            headers = safetensors_source_identity(Path(reader.path), hf_storage_files(Path(reader.path)), algorithm)
            md, size = headers["metadata_digest"], headers["metadata_size"]
    man: str | None = None
    try:
        man = manifest_digest(
            reader.read_file(MANIFEST_NAME, limits.current().max_object_bytes, what="manifest"), algorithm
        )
    except DataFileError:
        man = None  # the source has no manifest
    return {
        "checkpoint": str(reader.path),
        "algorithm": algorithm,
        "metadata_digest": md,
        "metadata_size": size,
        "manifest_digest": man,
    }


def write_manifest(
    source: CheckpointOrPath, options: ManifestOptions | None = None, **hooks: Unpack[Hooks]
) -> ManifestResult:
    """Write ``manifest.json`` for a checkpoint (beside ``.metadata`` unless ``out`` names a file).

    The file is written to a temporary name and renamed into place (never half written);
    nothing else in the checkpoint changes.

    Args:
        source: an opened :class:`Checkpoint` or its path, opened with ``opening``.
        options: see :class:`ManifestOptions`.
        progress: ``progress(done_bytes, total_bytes)``: ``(0, total)`` once planned, then after each entry.
        phase: ``phase(text)`` as each step starts: ``planning``, ``hashing`` (the bytes of
            ``progress``), ``writing FILE``.

    Raises:
        UsageError: unknown ``algorithm`` or ``covers``; OutputError: ``out`` cannot be written;
        plus the reader's errors for damaged checkpoints.
    """
    opening, progress, phase = hooks_of("write_manifest", hooks)
    opts = options_of(options, ManifestOptions)
    algorithm, covers, out = opts.algorithm, opts.covers, opts.out
    check_algorithm(algorithm)
    _check_covers(covers)
    t0 = time.perf_counter()
    say = phase or (lambda text: None)
    with open_source(source, opening) as ckpt:
        reader = ckpt.reader
        say("planning")
        total = sum(reader.storage_info(k, c).length for k, c in _items(reader))
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        remote = reader.remote if out is None else None  # beside .metadata on the prefix: one PUT
        if remote is not None:
            target = cast(Path, remote.path / MANIFEST_NAME)  # a UrlPath: named, never opened locally
            _check_remote_target(remote)
        else:
            target = Path(out) if out is not None else Path(ckpt.located.model) / MANIFEST_NAME
            _check_writable(target)  # before hashing every byte: a read-only checkpoint is told at once
            _check_target(target, ckpt)
        say("hashing")
        t_hash = time.perf_counter()
        step(0)
        man = build_manifest(
            reader,
            algorithm,
            covers=covers,
            on_entry=step,
            exclude=_inside(Path(reader.path), target),
            beside_of=Path(ckpt.located.model),
        )
        hash_seconds = time.perf_counter() - t_hash
        hashed = done[0] + _bytes_read(man.sidecars) + _bytes_read(man.training_state)  # digested whole too
        say(f"writing {target}")
        data = man.to_bytes()
        _put_manifest(remote, target, data)
        seconds = time.perf_counter() - t0
        log.info("manifest: %d entries, %d bytes hashed in %.3f s (%s)", len(man.entries), hashed, seconds, algorithm)
        return ManifestResult(
            str(ckpt.path),
            str(target),
            algorithm,
            len(man.entries),
            hashed,
            seconds,
            manifest_digest(data, algorithm),
            man.metadata_digest,
            warnings=[n for n in [ckpt.located.newer_incomplete_note("digested")] if n]
            + _remote_beside_warning(str(target), remote_beside(reader), "not digested"),
            covers=covers,
            hash_seconds=hash_seconds,
        )


def _bytes_read(files: tuple[dict[str, Any], ...] | None) -> int:
    """Bytes of the regular files of a ``sidecars`` or ``training_state`` list (a symlink or special file is not read)."""
    return sum(f["size"] for f in files or () if not str(f["digest"]).startswith((_LINK, "special")))


def _inside(root: Path, target: Path | str | None) -> tuple[str, ...]:
    """``target``'s name relative to ``root`` when it lies inside it (a manifest written into the checkpoint)."""
    if target is None:
        return ()
    try:
        rel = os.path.relpath(os.path.abspath(target), os.path.abspath(root))
    except ValueError:
        return ()
    return () if rel.startswith("..") else (rel.replace(os.sep, "/"),)


def _own_manifest(root: Path, checked: Manifest | None = None, placed: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``(manifest.json,)`` when ``root/manifest.json`` is left out of the files beside the data: the manifest
    written or ``checked`` itself (``placed``, its path), or a manifest ckpttool reads (the checkpoint's own, which
    ``manifest`` rewrites: no file of the checkpoint) that ``checked`` does not list (it lists what was there
    when it was made: compared then). ``()`` for anything else under that name: a file added there is ``extra``,
    not skipped unread beside a manifest kept outside the checkpoint (``--output``)."""
    if MANIFEST_NAME in placed or (checked is not None and MANIFEST_NAME in _inside(root, checked.path)):
        return (MANIFEST_NAME,)
    if checked is not None and any(f["file"] == MANIFEST_NAME for f in checked.sidecars or ()):
        return ()
    here = root / MANIFEST_NAME
    if not os.path.lexists(here) or (checked is not None and _same_file(here, checked.path)):
        return (MANIFEST_NAME,)  # nothing there, or the manifest checked itself (a link to the one named)
    try:
        load_manifest(own_manifest(here))
    except CkptError:
        return ()
    return (MANIFEST_NAME,)


def _same_file(a: Path, b: str | None) -> bool:
    try:
        return b is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _below(path: Path, folder: Path) -> bool:
    """``path`` (its folder resolved, the name kept) lies in ``folder`` (resolved) or below it."""
    try:
        return path.parent.resolve().joinpath(path.name).is_relative_to(folder.resolve())
    except OSError:
        return False


def _check_target(target: Path, ckpt: Checkpoint) -> None:
    """Refuse a manifest path that would replace or add what ckpttool must not (``check_file_target``): inside
    the directories read (the one given, the checkpoint's model and optimizer folders) only the manifest's own
    place, ``manifest.json`` beside ``.metadata``, new or a manifest ckpttool wrote.

    Raises:
        OutputError (E600): as above.
    """
    hint = "write the manifest beside .metadata (no --output) or to a file outside the checkpoint"
    located = ckpt.located
    root = Path(located.model)
    sources = (Path(located.given), root, *((Path(located.optimizer),) if located.optimizer is not None else ()))
    try:
        own_place = target.name == MANIFEST_NAME and os.path.samefile(target.parent, root)
    except OSError:
        own_place = False
    if own_place:  # the default place itself is taken: "no --output" is what was run
        hint = (
            f"the checkpoint's {MANIFEST_NAME} was not written by ckpttool and is kept; write this manifest to a "
            "file outside the checkpoint with --output FILE (verify with --verify --output FILE)"
        )
    elif os.path.lexists(target) and not any(_below(target, s) for s in sources):  # a file of the user's, outside
        hint = "choose a new file for --output (or a manifest ckpttool wrote, which it replaces): this one is kept"
    check_file_target(
        target, option="manifest", hint=hint, sources=sources, inside_ok=own_place, owned=is_manifest_head
    )
    if not own_place and target.name == MANIFEST_NAME and _a_checkpoint_folder(target.parent):
        # another checkpoint's own manifest place: its manifest (or none) replaced by this one's, it would no
        # longer match "its manifest" (`validate --manifest`, `manifest --verify` of it)
        raise OutputError(
            f"manifest {target}: is the place of the manifest of another checkpoint ({target.parent}, beside its "
            f"{METADATA_NAME} or safetensors files); this manifest of {root} is not written there",
            path=target,
            hint=f"write it beside {root}'s {METADATA_NAME} (no --output) or to a file outside any checkpoint, "
            "e.g. --output manifest-of-CKPT.json",
        )
    if own_place and MANIFEST_NAME in ckpt.reader.data_files():
        raise OutputError(
            f"manifest {target}: is a file of the checkpoint (named by its .metadata); it is left as it is",
            path=target,
            hint=hint,
        )


def _a_checkpoint_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint whose own manifest is ``folder/manifest.json``: a ``.metadata``, or
    safetensors files (a Hugging Face folder, an export)."""
    if os.path.lexists(folder / METADATA_NAME):
        return True
    try:
        with os.scandir(folder) as it:
            return any(e.name.endswith(".safetensors") for e in it)
    except OSError:
        return False


def _put_manifest(remote: RemoteStore | None, target: Path, data: bytes) -> None:
    """Write the manifest: one PUT beside ``.metadata`` on the prefix of ``remote``, else the local file ``target``
    (temporary name, renamed into place). In an output of ckpttool, its marker lists the manifest either way.

    Raises:
        OutputError: the local file cannot be written; the storage errors (``E140``-``E144``).
    """
    if remote is not None:
        with remote_recording(remote, MANIFEST_NAME, data):
            remote.write_bytes(MANIFEST_NAME, data)
    else:
        with recording(target.parent, target.name):
            _replace_file(target, data)


def _check_remote_target(store: RemoteStore) -> None:
    """Refuse to replace a ``manifest.json`` on the prefix that ckpttool did not write (its head read).

    Raises:
        OutputError (E600): as above.
    """
    size = store.size(MANIFEST_NAME)
    if size is None:
        return
    head = store.read_range(MANIFEST_NAME, 0, min(size, 4096)) if size else b""
    if not is_manifest_head(head):
        where = store.path / MANIFEST_NAME
        raise OutputError(
            f"{where}: exists and is not a manifest ckpttool wrote; nothing was hashed",
            path=where,
            hint=f"the checkpoint's {MANIFEST_NAME} is kept; write this manifest to a local file with --output FILE "
            "(verify with --verify --output FILE)",
        )


#: The hint of a manifest that cannot be written where it was to go (manifest has no --overwrite to suggest).
UNWRITABLE_HINT = (
    "write it to a writable place with --output FILE (check the checkpoint against it later with "
    "`ckpttool manifest DIR --verify --output FILE`)"
)


def _check_writable(target: Path) -> None:
    """Refuse a manifest path whose nearest existing folder cannot be written (a read-only mount or folder).

    Raises:
        OutputError (E600): as above.
    """
    found = nearest_unwritable(target)
    if found is not None:
        raise OutputError(
            f"{target}: cannot write the manifest ({found[0]} is not writable: {found[1]}); nothing was hashed",
            path=target,
            hint=UNWRITABLE_HINT,
        )


def _replace_file(target: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``target``, ``fsync`` it, rename it into place.

    Parents of ``target`` this call creates are removed again when it fails or is interrupted.

    Raises:
        OutputError: the file cannot be written.
        KeyboardInterrupt: (or ``Terminated``: SIGTERM, SIGHUP) a signal arrived before the file was in place.
    """
    created: list[Path] = []  # parents of `out` this run made: removed again if it fails
    try:
        missing = [p for p in target.parents if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            created.append(p)
        atomic_write_bytes(target, data)
    except BaseException as e:  # interrupted too (Ctrl-C, SIGTERM): no folder of this run is left
        for p in reversed(created):
            try:
                p.rmdir()
            except OSError:
                pass
        if not isinstance(e, (OSError, OutputError)):
            raise
        cause = e if isinstance(e, OSError) else e.__cause__
        why = cause.strerror if isinstance(cause, OSError) else str(e)
        raise OutputError(f"{target}: cannot write the manifest ({why})", path=target, hint=UNWRITABLE_HINT) from e


# ---------------------------------------------------------------------------------------------- reading back
def _bad(path: str, what: str) -> ManifestError:
    return ManifestError(f"{path}: not a ckpttool manifest ({what})", path=path)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def _entry(
    d: Any, i: int, path: str, hexlen: int | None, version: int = MANIFEST_VERSION, kind: str = "dcp"
) -> ManifestEntry:
    if not isinstance(d, dict):
        raise _bad(path, f"entries[{i}] is not an object")
    key, file, off, length = d.get("key"), d.get("file"), d.get("offset"), d.get("length")
    offsets, sizes, crc, digest = d.get("offsets"), d.get("sizes"), d.get("crc32"), d.get("digest")
    if not isinstance(key, str) or not isinstance(file, str):
        raise _bad(path, f"entries[{i}]: key and file must be strings")
    if _leaves_folder(file):  # hostile: never joined to the checkpoint's path, never compared as a place
        raise _bad(path, f"entries[{i}] ({key[:200]!a}): file {file[:200]!a} is not a file name inside the directory")
    covers = d.get("covers", "window") if version >= 2 else "window"
    view = d.get("view")
    problem = _entry_problem(off, length, offsets, sizes, crc, digest, hexlen) or _covers_problem(
        covers, kind, offsets, sizes
    )
    if (
        problem is None
        and view is not None
        and not (isinstance(view, str) and len(view) <= 4096 and covers == "record")
    ):
        problem = "view must be a string, on a record entry"
    if problem is not None:
        raise _bad(path, f"entries[{i}] ({key!a}): {problem}")
    return ManifestEntry(
        key,
        tuple(offsets) if offsets is not None else None,
        tuple(sizes) if sizes is not None else None,
        file,
        cast(int, off),
        cast(int, length),
        crc,
        cast(str, digest),
        covers,
        view,
    )


def _entry_problem(
    off: Any, length: Any, offsets: Any, sizes: Any, crc: Any, digest: Any, hexlen: int | None
) -> str | None:
    """What is wrong with an entry's window, chunk, CRC-32 and digest fields (``None``: nothing)."""
    if type(off) is not int or type(length) is not int or off < 0 or length < 0:
        return "offset and length must be non-negative integers"
    if (offsets is None) != (sizes is None) or (offsets is not None and not (_ints(offsets) and _ints(sizes))):
        return "offsets/sizes must both be lists of non-negative integers or null"
    if offsets is not None and sizes is not None and len(offsets) != len(sizes):
        return "offsets and sizes differ in length"
    if crc is not None and not (isinstance(crc, str) and len(crc) == 8 and _is_hex(crc)):
        return "crc32 must be 8 hex digits or null"
    if not isinstance(digest, str) or not _is_hex(digest) or (hexlen is not None and len(digest) != hexlen):
        return "digest must be a hex string of the algorithm's length"
    return None


def _covers_problem(covers: Any, kind: str, offsets: Any, sizes: Any) -> str | None:
    """What is wrong with an entry's ``covers`` for the manifest's kind (``None``: nothing)."""
    if kind == "safetensors":
        if covers != "extent" or offsets is None or sizes is None or len(offsets) != 1:
            return "a safetensors manifest lists extents (covers 'extent')"
    elif (
        covers not in (*COVERS, VALUE)
        or (covers == "record" and offsets is None)
        or (covers == VALUE and offsets is not None)
    ):
        return "covers must be 'window', (for a chunk) 'record' or (for a byte item) 'value'"
    return None


def _leaves_folder(name: str) -> bool:
    """Whether an entry's ``file`` is empty, absolute or climbs out of the checkpoint's folder (a ``..`` part)."""
    return not name or "\0" in name or name.startswith("/") or ".." in name.split("/")


_HEX = frozenset("0123456789abcdef")


def _is_hex(s: str) -> bool:
    return _HEX.issuperset(s)


def _read_doc(p: Path, shown: str, data: bytes | None = None) -> dict[str, Any]:
    """The manifest file's JSON object (``data``: its bytes, already read), capped and bounded (a key given twice in
    one object refused); its ``format`` checked."""
    if data is None:
        try:
            data = read_regular(p, limits.current().max_object_bytes, what="manifest")
        except OSError as e:
            raise ManifestError(f"{p}: cannot read the manifest ({e.strerror})", path=p) from e
    try:
        doc = json.loads(data.decode("utf-8"), parse_int=_bounded_int, object_pairs_hook=unique_pairs)
    except DuplicateKeyError as e:  # never last-one-wins: another reader would take the first
        raise _bad(shown, str(e)) from None
    except (ValueError, RecursionError) as e:  # not JSON / UTF-8, nested past the recursion limit, a long number
        mapped = json_error(e, shown)
        if mapped is not None:
            raise mapped from None
        raise _bad(shown, f"not JSON: {str(e)[:80]}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise _bad(shown, f"format is not {MANIFEST_FORMAT!r}")
    # The entry lists are checked field by field (never walked as a whole: 10^5 entries in one pass each);
    # everything else is held to the JSON bounds.
    check_json_graph({k: v for k, v in doc.items() if k not in _LISTS}, shown)
    return doc


_LISTS = ("entries", "sidecars", "files", "training_state", "data_files")


def _bounded_int(text: str) -> int:
    """``json.loads``' ``parse_int``: numbers of a manifest are offsets and sizes (int64), never 4,000 digits."""
    if len(text) > 20:
        raise ValueError(f"number of {len(text)} digits")
    return int(text)


def _manifest_files(doc: dict[str, Any], shown: str) -> list[dict[str, Any]]:
    """The ``files`` list of a safetensors manifest (each file's header length and digest), checked."""
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise _bad(shown, "files must be a list")
    out = _objects(raw_files, "files", _FILE_FIELDS, shown, lambda f: _is_hex(f["header_digest"]))
    _check_file_names(out, "files", shown)
    return out


def _check_file_names(items: list[dict[str, Any]], name: str, shown: str) -> None:
    """Each item's ``file`` of list ``name`` is a file name inside the directory, listed once.

    Raises:
        ManifestError (E260): naming the item and why.
    """
    seen: set[str] = set()
    for j, f in enumerate(items):
        if _leaves_folder(f["file"]):
            raise _bad(shown, f"{name}[{j}] ({f['file'][:200]!a}) is not a file name inside the directory")
        if f["file"] in seen:
            raise _bad(shown, f"{name}[{j}] ({f['file'][:200]!a}) is listed twice")
        seen.add(f["file"])


def _manifest_sidecars(doc: dict[str, Any], shown: str, name: str = "sidecars") -> tuple[dict[str, Any], ...] | None:
    """The ``sidecars`` (or ``training_state``) list (``None``: absent, a manifest of an older ckpttool), checked."""
    raw = doc.get(name)
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_SIDECARS:
        raise _bad(shown, f"{name} must be a list of at most {MAX_SIDECARS} files")
    out = _objects(raw, name, _SIDECAR_FIELDS, shown)
    seen: set[str] = set()
    for j, f in enumerate(out):  # names as sidecar_digests writes them: relative, '/'-separated, each part a name
        file = f["file"]
        if "\0" in file or any(part in ("", ".", "..") for part in file.split("/")):
            raise _bad(shown, f"{name}[{j}] ({file[:200]!a}) is not a file name inside the directory")
        if file in seen:
            raise _bad(shown, f"{name}[{j}] ({file[:200]!a}) is listed twice")
        seen.add(file)
    return tuple(out)


def _manifest_data_files(
    doc: dict[str, Any], shown: str, entries: tuple[ManifestEntry, ...]
) -> tuple[dict[str, Any], ...] | None:
    """The ``data_files`` list (``None``: absent, a manifest of an older ckpttool), checked, also against ``entries``:
    ckpttool records the size of each file an entry's window lies in, so a file no entry names is a manifest that
    contradicts itself (edited): nothing of it could be verified. (A size that ends before an entry's window is
    left to the verify, which names the entry or the file as ``changed``.)"""
    raw = doc.get("data_files")
    if raw is None:
        return None
    cap = limits.metadata_record_cap()
    if not isinstance(raw, list) or len(raw) > cap:
        raise _bad(shown, f"data_files must be a list of at most {cap:,} files")
    out = _objects(raw, "data_files", _DATA_FILE_FIELDS, shown, lambda f: f["size"] >= 0)
    _check_file_names(out, "data_files", shown)
    stored_in = {e.file for e in entries}
    for i, f in enumerate(out):
        if f["file"] not in stored_in:
            raise _bad(shown, f"data_files[{i}] ({f['file'][:200]!a}) is a file no entry is stored in")
    return tuple(out)


#: The fields of an item of a manifest's ``files`` and ``sidecars`` lists, with their JSON types.
_FILE_FIELDS: dict[str, type] = {"file": str, "header_length": int, "header_digest": str}
_SIDECAR_FIELDS: dict[str, type] = {"file": str, "size": int, "digest": str}
_DATA_FILE_FIELDS: dict[str, type] = {"file": str, "size": int}


def _objects(
    raw: list[Any],
    name: str,
    fields: dict[str, type],
    shown: str,
    valid: Callable[[dict[str, Any]], bool] | None = None,
) -> list[dict[str, Any]]:
    """Each item of the list ``name``: an object holding ``fields`` of exactly their types (and ``valid``), as a
    dict of just those fields; the first item that is not, a :class:`ManifestError` naming it."""
    out = []
    for j, f in enumerate(raw):
        if not (
            isinstance(f, dict) and all(type(f.get(k)) is t for k, t in fields.items()) and (valid is None or valid(f))
        ):
            *head, last = fields
            raise _bad(shown, f"{name}[{j}] must be an object with {', '.join(head)} and {last}")
        out.append({k: f[k] for k in fields})
    return out


def _missing_manifest_hint(missing: Path, written_by: str) -> str:
    """The hint for a manifest file that does not exist: the command that writes it (outside a hub cache)."""
    return unexpanded_tilde_hint(missing) or _in_hub_cache_hint(missing) or f"write one with `{written_by}`"


def _in_hub_cache_hint(missing: Path) -> str | None:
    """The hint for a manifest looked for inside a Hugging Face hub cache repository folder (a snapshot's default
    ``manifest.json``), where ckpttool writes none (``refuse_hub_cache_output``); else ``None``."""
    if hub_repository(missing) is None:
        return None
    folder = shell_arg(missing.parent)
    return (
        "ckpttool writes no manifest into the Hugging Face hub cache: write one outside it, `ckpttool manifest "
        f"{folder} --output FILE`, and check against that FILE (`--verify --output FILE`, `validate --manifest FILE`)"
    )


def load_manifest(
    path: str | os.PathLike[str], data: bytes | None = None, *, written_by: str = "ckpttool manifest DIR"
) -> Manifest:
    """Read and check a ``manifest.json`` (untrusted: capped, bounded JSON, every field checked).

    ``data``: its bytes, already read (a remote manifest; ``path`` then only names it). ``written_by``: the
    command line that writes it, named by the hint when it does not exist.

    Raises:
        UsageError: the file does not exist.
        SizeLimitError: larger than ``--max-object-size``.
        JsonDepthError, IntegerRangeError: a JSON bomb.
        ManifestError (E260): not JSON, another format, a newer version, a malformed entry, duplicates.
    """
    p = Path(path) if data is None else cast(Path, path)
    shown = str(p)
    if data is None and not p.exists():
        raise UsageError(
            f"{p}: no such manifest file",
            path=p,
            param="manifest",
            hint=_missing_manifest_hint(p, written_by),
        )
    doc = _read_doc(p, shown, data)
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise _bad(shown, "version must be a positive integer")
    if version > MANIFEST_VERSION:
        raise ManifestError(
            f"{shown}: manifest version {version} is newer than this ckpttool reads ({MANIFEST_VERSION})",
            path=p,
            hint="upgrade ckpttool",
        )
    algorithm = doc.get("algorithm")
    if type(algorithm) is not str or algorithm not in ALGORITHMS:  # a list or object is no dict key
        raise _bad(shown, f"unknown digest algorithm {str(algorithm)[:40]!a} (known: {', '.join(ALGORITHMS)})")
    hexlen = len(digest_bytes(b"", algorithm))
    kind = doc.get("kind", "dcp") if version >= 2 else "dcp"
    if kind not in ("dcp", "safetensors"):
        raise _bad(shown, f"kind must be 'dcp' or 'safetensors', not {str(kind)[:40]!a}")
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise _bad(shown, "entries must be a list")
    cap = limits.metadata_record_cap()
    if len(raw_entries) > cap:
        raise _bad(shown, f"{len(raw_entries):,} entries, more than the {cap:,} a checkpoint's .metadata may hold")
    entries = tuple(_entry(d, i, shown, hexlen, version, kind) for i, d in enumerate(raw_entries))
    files = _manifest_files(doc, shown) if kind == "safetensors" else []
    if kind == "safetensors":  # an extent of a file not listed would never be read: the manifest contradicts itself
        names = {f["file"] for f in files}
        for i, ent in enumerate(entries):
            if ent.file not in names:
                raise _bad(shown, f"entries[{i}] ({ent.key[:200]!a}): file {ent.file[:200]!a} is not in its files")
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    for ent in entries:
        if ent.ident in seen:
            raise _bad(shown, f"{ent.where()} is listed twice")
        seen.add(ent.ident)
    md_digest, md_size, md_file = _manifest_metadata(doc, shown)
    source = doc.get("source")
    if source is not None and not isinstance(source, dict):
        raise _bad(shown, "source must be an object")
    sidecars = _manifest_sidecars(doc, shown)
    training = _manifest_sidecars(doc, shown, "training_state")
    data_files = _manifest_data_files(doc, shown, entries) if kind == "dcp" else None
    return Manifest(
        algorithm,
        entries,
        md_digest,
        md_size,
        source,
        kind,
        tuple(files),
        sidecars,
        shown,
        metadata_file=md_file,
        training_state=training,
        data_files=data_files,
    )


def _manifest_metadata(doc: dict[str, Any], shown: str) -> tuple[str | None, int | None, str]:
    """``(digest, size, file)`` of a manifest's ``metadata`` (``None`` digest and size: null), checked."""
    md = doc.get("metadata")
    if md is None:
        return None, None, METADATA_NAME
    if not isinstance(md, dict) or not isinstance(md.get("digest"), str) or type(md.get("size")) is not int:
        raise _bad(shown, "metadata must be an object with digest and size, or null")
    md_file = md.get("file", METADATA_NAME)  # every ckpttool wrote it; absent: taken as .metadata
    if type(md_file) is not str or md_file not in _DESCRIBED:
        raise _bad(shown, f"metadata.file must be one of {', '.join(map(repr, _DESCRIBED))}")
    return md["digest"], md["size"], md_file


#: What a manifest was made of, by its ``metadata.file`` (kind ``dcp``), as named in messages.
_DESCRIBED = {
    METADATA_NAME: "a DCP checkpoint (its .metadata digested)",
    HEADERS_NAME: "a safetensors model folder (its headers digested)",
    PERRANK_NAME: "a per-rank save (its rank files' tensor metadata digested)",
    RANKLOCAL_NAME: "a rank-local DCP save in object storage (its __R.metadata objects digested)",
}
_EXPORT = "a safetensors export (export --manifest)"


def _manifest_made_of(manifest: Manifest) -> tuple[str, str] | None:
    """``(what, as named)`` a manifest was made of: ``dcp``, ``safetensors`` (a model folder or an export),
    ``per-rank``; ``None``: it does not say (``metadata`` null: a model/optimizer pair's, a rank-local save's)."""
    if manifest.kind == "safetensors":
        return "safetensors", _EXPORT
    if manifest.metadata_digest is None:
        return None
    what = {METADATA_NAME: "dcp", HEADERS_NAME: "safetensors", PERRANK_NAME: "per-rank", RANKLOCAL_NAME: "rank-local"}[
        manifest.metadata_file
    ]
    return what, _DESCRIBED[manifest.metadata_file]


def _checkpoint_is(reader: CheckpointReader) -> tuple[str, str] | None:
    """``(what, as named)`` an opened checkpoint is, in the terms of :func:`_manifest_made_of` (``pair`` for a
    model/optimizer pair); ``None``: a rank-local DCP save (``__R.metadata``, no ``.metadata``), not compared."""
    if isinstance(reader, PerRankReader):
        return "per-rank", f"a per-rank save ({reader.assembled.format})"
    if reader.parts:
        return "pair", f"a model/optimizer pair ({folder_kind(reader)})"
    if _metadata_file(reader) == METADATA_NAME:
        return "dcp", "a DCP checkpoint (with .metadata)"
    if reader.metadata.serialization == "torch_save":
        return None
    return "safetensors", "a safetensors model folder (no .metadata)"


def check_manifest_kind(reader: CheckpointReader, manifest: Manifest) -> None:
    """Refuse a manifest made of another kind of checkpoint than ``reader``'s (a DCP checkpoint's manifest on a
    safetensors export, an export's on a DCP checkpoint): one error, not a problem for every entry.

    Raises:
        ManifestError (E260): naming both kinds.
    """
    made_of, now = _manifest_made_of(manifest), _checkpoint_is(reader)
    if made_of is not None and now is not None and made_of[0] != now[0]:
        raise _other_kind(manifest, made_of[1], str(reader.path), now[1])


def _other_kind(manifest: Manifest, made_of: str, directory: str, now: str) -> ManifestError:
    shown = manifest.path or "the manifest"
    return ManifestError(
        f"{shown} is the manifest of {made_of}, but {directory} is {now}",
        path=shown,
        hint=f"verify {shell_arg(directory)} against a manifest made of it (`ckpttool manifest {shell_arg(directory)}` "
        "writes one; an export's is written by `export --manifest`), and this manifest against the checkpoint it was made of",
    )


def verify_manifest(
    reader: CheckpointReader, manifest: Manifest, *, on_entry: OnEntry = None, beside_of: Path | None = None
) -> list[ManifestProblem]:
    """Check every chunk and byte item of a checkpoint against a manifest (each window read once; ``on_entry``: progress).

    ``beside_of`` (the checkpoint's model folder): the training-state files the manifest lists are
    checked against the ones saved beside it now.

    Returns:
        The problems, in manifest order then checkpoint order: ``missing``, ``extra``,
        ``changed`` chunks and a changed ``.metadata``; empty when the checkpoint matches.

    Raises:
        the reader's errors for a damaged archive (a data file missing or cut short is a problem);
        DataFileError (E300): a data file written to or replaced while it was read (no verdict).
    """
    check_manifest_kind(reader, manifest)
    problems: list[ManifestProblem] = []
    stored = {(k, c.offsets if c is not None else None): c for k, c in _items(reader)}
    listed = {e.ident: e for e in manifest.entries}
    meta = _metadata_problems(reader, manifest)
    beside = _beside_problems(reader, manifest, stored)
    # Each entry's storage window must be the one the checkpoint's metadata holds, unless that metadata is itself
    # reported changed (a re-save moves every chunk after a changed one: their bytes are then compared where they are).
    strict = not meta and not any(p.kind != "extra" and _is_metadata_file(p.key) for p in beside)
    for e in _counted(manifest.entries, on_entry):
        if e.ident not in stored:
            problems.append(
                ManifestProblem(
                    "missing", e.key, e.offsets, f"{e.where()} is in the manifest but not in the checkpoint"
                )
            )
            continue
        problem = _stored_entry_problem(reader, e, stored[e.ident], manifest.algorithm, strict)
        _release(reader, e.key, stored[e.ident])
        if problem is not None:
            problems.append(problem)
    for ident in stored:
        if ident not in listed:
            key, offs = ident
            where = f"{key!r}" + (f" chunk at {list(offs)}" if offs is not None else " (byte item)")
            problems.append(ManifestProblem("extra", key, offs, f"{where} is stored but not in the manifest"))
    problems.extend(meta)
    problems.extend(beside)
    if strict:  # a re-save (its .metadata changed) rewrote the files: the entries and the metadata name it
        problems.extend(_grown_data_files(reader, manifest))
    if manifest.training_state is not None and beside_of is not None and reader.remote is None:
        now = {f["file"]: f for f in training_state_digests(beside_of, manifest.algorithm)}
        said = {(p.kind, p.key) for p in problems}  # a pair's step_scheduler.pt is a sidecar too
        problems.extend(p for p in _file_problems(manifest.training_state, now) if (p.kind, p.key) not in said)
    reader.check_unchanged()  # a data file written meanwhile: no verdict on bytes of two states
    return problems


def _grown_data_files(reader: CheckpointReader, manifest: Manifest) -> list[ManifestProblem]:
    """Data files longer than when the manifest was made (bytes appended after the last window, in no entry), or
    shorter with every window still in them (bytes after the last window removed): ``changed``. A file cut into a
    window is named by the entries whose windows it no longer holds."""
    if manifest.data_files is None:
        return []
    now = {f["file"]: f["size"] for f in _data_file_sizes_of(reader, (f["file"] for f in manifest.data_files))}
    ends: dict[str, int] = {}
    for e in manifest.entries:
        if e.covers != "value":  # a value read from the file (a per-rank save's JSON item) has no window in it
            ends[e.file] = max(ends.get(e.file, 0), e.offset + e.length)
    shrunk = [
        ManifestProblem(
            "changed",
            f["file"],
            None,
            f"{f['file']}: {f['size'] - size:,} byte(s) after the data removed since the manifest was made (the "
            f"file has {size:,} bytes, the manifest recorded {f['size']:,}); every entry's window is still in it",
        )
        for f in manifest.data_files
        if f["file"] in ends and (size := now.get(f["file"])) is not None and ends[f["file"]] <= size < f["size"]
    ]
    return _grown_sizes(manifest.data_files, now) + shrunk


def _grown_files(root: Path, data_files: tuple[dict[str, Any], ...]) -> list[ManifestProblem]:
    """:func:`_grown_data_files` of the files ``data_files`` lists below ``root``."""
    return _grown_sizes(
        data_files, {f["file"]: f["size"] for f in data_file_sizes(root, (f["file"] for f in data_files))}
    )


def _grown_sizes(data_files: tuple[dict[str, Any], ...], now: dict[str, int]) -> list[ManifestProblem]:
    """The files of ``data_files`` whose size ``now`` (a regular file's, a listed object's; absent: missing, its
    entries say so) is larger than recorded."""
    out = []
    for f in data_files:
        size = now.get(f["file"])
        if size is not None and size > f["size"]:
            out.append(
                ManifestProblem(
                    "changed",
                    f["file"],
                    None,
                    f"{f['file']}: {size - f['size']:,} byte(s) after the data the manifest was made of (the file "
                    f"has {size:,} bytes, the manifest recorded {f['size']:,}); no entry covers them",
                )
            )
    return out


def _beside_problems(
    reader: CheckpointReader, manifest: Manifest, stored: dict[tuple[str, tuple[int, ...] | None], ChunkMeta | None]
) -> list[ManifestProblem]:
    """The sidecars (files beside the data) missing, changed or added since the manifest (none when it lists none)."""
    if manifest.sidecars is None or reader.remote is not None or not _parts_below(reader):
        return []
    root = Path(reader.path)
    held = {
        (k, offs): reader.storage_info(k, c).relative_path
        for (k, offs), c in stored.items()
        if _has_storage(reader, k, c)
    }
    # An entry's own ``file`` is trusted only for a chunk the checkpoint no longer stores (reported as missing):
    # a stored chunk's file is the one the checkpoint names, so a manifest cannot hide a file by naming it.
    unheld = (e.file for e in manifest.entries if e.ident not in held)
    skip = {METADATA_NAME, *_own_manifest(root, manifest), *unheld, *held.values(), *_inside(root, manifest.path)}
    listed_files = {f["file"] for f in manifest.sidecars}
    skip -= {f for f in _partial_files(reader) if f in listed_files}  # an older manifest did not list them
    return _sidecar_problems(root, manifest.sidecars, skip, manifest.algorithm)


def _is_metadata_file(name: str) -> bool:
    """A sidecar that holds a checkpoint's storage records: a pair's ``model/.metadata``, a rank-local ``__0.metadata``."""
    return name.rsplit("/", 1)[-1].endswith(METADATA_NAME)


def _stored_entry_problem(
    reader: CheckpointReader, e: ManifestEntry, chunk: ChunkMeta | None, algorithm: str, strict: bool = True
) -> ManifestProblem | None:
    """What differs between a manifest entry and the chunk (or byte item) stored under its key, if anything:
    other sizes, another storage window than the checkpoint's metadata holds (``strict``: that metadata is the
    one the manifest vouches for), its data file deleted (``missing``) or cut short, another digest, a record's view."""
    if chunk is not None and e.sizes is not None and tuple(chunk.sizes) != e.sizes:
        return ManifestProblem(
            "changed", e.key, e.offsets, f"{e.where()}: sizes {list(chunk.sizes)}, the manifest says {list(e.sizes)}"
        )
    stored = reader.metadata.storage_for(e.key, chunk)  # where the checkpoint's own metadata puts it (no I/O)
    if stored is not None and strict:
        moved = _location_problem(e, stored)
        if moved is not None:
            return ManifestProblem("changed", e.key, e.offsets, moved)
    try:
        info = reader.storage_info(e.key, chunk)
        kind, digest = _hash_entry(reader, e.key, chunk, e.covers, algorithm)
    except DataFileError as err:  # a data file deleted or cut short since: this entry's bytes are not there
        if isinstance(err.__cause__, PermissionError):
            raise  # one this user may not read is not a changed one: no verdict (E300 naming it)
        rel = stored.relative_path if stored is not None else e.file
        store = reader.remote  # a remote one: its listing says whether the object is there
        gone = store.size(rel) is None if store is not None else not (Path(reader.path) / rel).exists()
        said = f"{e.where()} in {rel}: " + ("its data file is missing" if gone else err.message)
        return ManifestProblem("missing" if gone else "changed", e.key, e.offsets, said)
    if kind != e.covers:
        return ManifestProblem(
            "changed",
            e.key,
            e.offsets,
            f"{e.where()} in {info.relative_path}: the manifest digests its storage record, but the chunk "
            "has no stored record now (stream transform)",
        )
    if digest != e.digest:
        return ManifestProblem(
            "changed",
            e.key,
            e.offsets,
            f"{e.where()} in {info.relative_path}: {'its value' if kind == VALUE else 'stored bytes'} differ"
            f"{'s' if kind == VALUE else ''} from the manifest ({algorithm} {digest[:16]}..., manifest {e.digest[:16]}...)",
        )
    if kind == "record" and chunk is not None:
        view = _view_problem(reader, e, chunk)
        if view is not None:
            return ManifestProblem("changed", e.key, e.offsets, f"{e.where()}: {view}")
    crc = _crc_problem(reader, e, chunk)
    return None if crc is None else ManifestProblem("changed", e.key, e.offsets, f"{e.where()}: {crc}")


def _crc_problem(reader: CheckpointReader, e: ManifestEntry, chunk: ChunkMeta | None) -> str | None:
    """How an entry's recorded ``crc32`` differs from the one its storage record's zip entry holds (``None``: it
    does not, the entry records none (an older manifest may leave it out), or the record cannot be located)."""
    if e.crc32 is None or chunk is None or chunk.numel == 0:
        return None
    try:
        rec = reader.locate(e.key, chunk).record
    except CkptError:  # the record no longer fits a .metadata that changed (reported): the digest said the rest
        return None
    got = f"{rec.crc32:08x}" if rec.member is not None else None
    return None if got == e.crc32 else f"the manifest says crc32 {e.crc32}; its storage record's zip entry {got}"


def _location_problem(e: ManifestEntry, stored: StorageInfo) -> str | None:
    """How an entry's ``file``, ``offset`` and ``length`` differ from the storage record the checkpoint's metadata
    holds for its chunk (``None``: they agree). Every manifest ckpttool writes records that window, whatever its
    ``covers``: another one is a manifest of another checkpoint, or one edited."""
    said: dict[str, str | int] = {"file": e.file, "offset": e.offset, "length": e.length}
    there: dict[str, str | int] = {"file": stored.relative_path, "offset": stored.offset, "length": stored.length}
    differ = [name for name in said if said[name] != there[name]]
    if not differ:
        return None
    says = ", ".join(f"{name} {_shown(said[name])}" for name in differ)
    holds = ", ".join(_shown(there[name]) for name in differ)
    return f"{e.where()}: the manifest says {says}; the checkpoint's metadata {holds}"


def _shown(value: str | int) -> str:
    return f"{value[:200]!a}" if isinstance(value, str) else str(value)


def _metadata_problems(reader: CheckpointReader, manifest: Manifest) -> list[ManifestProblem]:
    """A changed ``.metadata`` (or, for safetensors storage, changed headers): one problem, else none.

    A manifest without a ``.metadata`` digest (``null``: a model/optimizer pair's, whose two are sidecars) over a
    checkpoint that has one cannot vouch for it (every manifest ckpttool wrote of such a checkpoint holds its
    digest): a ``metadata`` problem, not a silent pass over dtypes and chunks it never saw.
    """
    if manifest.metadata_digest is None:
        if reader.parts or reader.remote is not None or _metadata_file(reader) != METADATA_NAME:
            return []  # no .metadata to digest (a pair), or headers/rank files an older manifest did not digest
        return [
            ManifestProblem(
                "metadata", METADATA_NAME, None, "the manifest records no digest of .metadata: it was not checked"
            )
        ]
    md, size = _metadata_digest(reader, manifest.algorithm)
    name = _metadata_file(reader)
    if md is not None and md == manifest.metadata_digest and size != manifest.metadata_size:
        return [
            ManifestProblem(
                "metadata", name, None, f"the manifest says {name} is {manifest.metadata_size} bytes, not {size}"
            )
        ]
    if md is None or md == manifest.metadata_digest:
        return []
    if name == METADATA_NAME:
        return [
            ManifestProblem("metadata", METADATA_NAME, None, ".metadata differs from the one the manifest was made of")
        ]
    if name == PERRANK_NAME:
        return [
            ManifestProblem(
                "metadata",
                name,
                None,
                f"the rank files' tensor dtypes, shapes or chunks differ from the manifest's ({name})",
            )
        ]
    if name == RANKLOCAL_NAME:
        return [ManifestProblem("metadata", name, None, f"the {name} (__R.metadata) differ from the manifest's")]
    return [
        ManifestProblem("metadata", HEADERS_NAME, None, f"{HEADERS_NAME} differ from the ones the manifest was made of")
    ]


def _counted(entries: Iterable[ManifestEntry], on_entry: OnEntry) -> Iterator[ManifestEntry]:
    """``entries``; each one's ``length`` passed to ``on_entry`` once the loop over it is done (``continue`` too)."""
    for e in entries:
        yield e
        if on_entry is not None:
            on_entry(e.length)


def _has_storage(reader: CheckpointReader, key: str, chunk: ChunkMeta | None) -> bool:
    try:
        reader.storage_info(key, chunk)
    except CkptError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- safetensors outputs
def safetensors_manifest(
    files: list[tuple[str, int, str | None, list[tuple[str, int, int, int, str]]]],
    algorithm: str,
    source: dict[str, Any] | None,
    *,
    sidecars_of: Path | None = None,
) -> bytes:
    """The ``manifest.json`` bytes (kind ``safetensors``) of an export, from the digests taken while writing.

    With ``sidecars_of`` (the output directory, its other files written), every file there but the
    listed safetensors files (the index, ``config.json``, copied assets) is digested into ``sidecars``.

    Args:
        files: per output file ``(name, header length, header digest, extents)``; the header
            length counts the 8-byte length prefix (the data region's start); an extent is
            ``(tensor name, byte offset in the tensor's data, file offset, length, digest)`` of one write.
        algorithm: the digest algorithm used.
        source: the source identity (:func:`source_identity`).

    Entries are sorted by file and offset. Each is ``{"key": tensor, "offsets": [byte offset in
    the tensor's data], "sizes": [length in bytes], "file", "offset": absolute file offset,
    "length", "crc32": null, "covers": "extent", "digest"}``; a tensor's extents tile its data.
    """
    entries: list[ManifestEntry] = []
    meta: list[dict[str, Any]] = []
    for name, data_start, header_digest, extents in files:
        meta.append({"file": name, "header_length": data_start, "header_digest": header_digest})
        for tensor, at, start, length, digest in extents:
            entries.append(ManifestEntry(tensor, (at,), (length,), name, start, length, None, digest, "extent"))
    entries.sort(key=lambda e: (e.file, e.offset))
    sidecars = None
    if sidecars_of is not None:
        sidecars = tuple(sidecar_digests(sidecars_of, {MANIFEST_NAME, *(f[0] for f in files)}, algorithm))
    return Manifest(algorithm, tuple(entries), None, None, source, "safetensors", tuple(meta), sidecars).to_bytes()


def verify_safetensors_manifest(
    directory: str | os.PathLike[str], manifest: Manifest, *, on_entry: Callable[[int], None] | None = None
) -> list[ManifestProblem]:
    """Check a safetensors directory (an ``export`` output) against its kind ``safetensors`` manifest.

    ``on_entry(length)``: called with each extent's ``length`` once it is checked (progress).

    Every listed file's header is digested and compared; every extent is read once and digested;
    the extents of each tensor must tile its ``data_offsets`` range exactly, and every tensor of
    every listed file must be covered. Files are confined to ``directory`` and read as regular files.

    Returns:
        The problems: ``missing`` (a listed file or tensor absent), ``extra`` (a tensor not
        covered), ``changed`` (a digest differs, or the extents do not tile the tensor), and
        ``metadata`` (a header differs). Empty when the directory matches.

    Raises:
        UsageError: ``manifest`` is not a safetensors manifest.
        ManifestError (E260): ``directory`` is a DCP checkpoint (a ``.metadata``), not an export.
        MetadataError, NotRegularFileError, PathEscapeError: unreadable files.
    """
    from ckpttool.format.files import open_regular, resolve_inside
    from ckpttool.format.hf_storage import read_safetensors_header

    if manifest.kind != "safetensors":
        raise UsageError(
            "`manifest` is a DCP checkpoint manifest, not one of a safetensors export",
            param="manifest",
            hint="verify a DCP checkpoint with `ckpttool validate DIR --manifest FILE`",
        )
    root = Path(directory)
    if (root / METADATA_NAME).exists():  # what an export never writes: a DCP checkpoint (or a DCP-written folder)
        raise _other_kind(manifest, _EXPORT, str(directory), "a DCP checkpoint (with .metadata)")
    problems: list[ManifestProblem] = []
    by_file: dict[str, list[ManifestEntry]] = {}
    for e in manifest.entries:
        by_file.setdefault(e.file, []).append(e)
    for f in manifest.files:
        name = f["file"]
        path = resolve_inside(root, name, what="safetensors file")
        if not path.exists():
            problems.append(ManifestProblem("missing", name, None, f"{name}: listed in the manifest, not in {root}"))
            if on_entry is not None:
                on_entry(sum(e.length for e in by_file.get(name, [])))
            continue
        header, data_start = read_safetensors_header(path)
        fd = open_regular(path)
        try:
            prefix = read_upto(fd, data_start, 0)
            if data_start != f["header_length"] or digest_bytes(prefix, manifest.algorithm) != f["header_digest"]:
                problems.append(
                    ManifestProblem(
                        "metadata", name, None, f"{name}: the header differs from the one the manifest was made of"
                    )
                )
            tensors = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
            spans = _check_extents(
                fd, path, name, tensors, by_file.get(name, []), manifest.algorithm, problems, on_entry, data_start
            )
            _check_tiling(name, data_start, tensors, spans, problems)
            trailing = _trailing_problem(name, os.fstat(fd).st_size, data_start, tensors)
            if trailing is not None:
                problems.append(trailing)
        finally:
            os.close(fd)
    skip = {*_own_manifest(root, manifest), *(f["file"] for f in manifest.files), *_inside(root, manifest.path)}
    problems.extend(_sidecar_problems(root, manifest.sidecars, skip, manifest.algorithm))
    return problems


def _check_extents(
    fd: int,
    path: Path,
    name: str,
    tensors: dict[str, Any],
    entries: list[ManifestEntry],
    algorithm: str,
    problems: list[ManifestProblem],
    on_entry: Callable[[int], None] | None = None,
    data_start: int = 0,
) -> dict[str, list[tuple[int, int]]]:
    """Digest every listed extent of one safetensors file; the ``(offset, length)`` extents of each tensor.

    More extents than an export writes (:func:`_extent_budget`) are one problem, none of them read. An
    extent outside its tensor's bytes (``data_start``: where the file's data begins) is ``changed``, not read.
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    budget = _extent_budget(tensors)
    if len(entries) > budget:
        problems.append(
            ManifestProblem(
                "changed",
                name,
                None,
                f"{name}: the manifest lists {len(entries):,} extents for {len(tensors):,} tensors "
                f"(an export writes at most {budget:,}); not read",
            )
        )
        if on_entry is not None:
            on_entry(sum(e.length for e in entries))
        return {k: [(-1, 0)] for k in tensors}  # every tensor reported once as not tiled
    size = os.fstat(fd).st_size
    for e in _counted(entries, on_entry):
        t = tensors.get(e.key)
        if t is None:
            problems.append(
                ManifestProblem(
                    "missing", e.key, None, f"{short_repr(e.key, 200)} in {name}: in the manifest, not in the file"
                )
            )
            continue
        spans.setdefault(e.key, []).append((e.offset, e.length))
        unread = _unread_extent(e, name, t, data_start, size)
        if unread is not None:
            problems.append(unread)
            continue
        digest = _hash_fd(fd, e.offset, e.length, algorithm, path, e.key)
        if digest != e.digest:
            problems.append(
                ManifestProblem(
                    "changed",
                    e.key,
                    None,
                    f"{e.key!r} in {name}, bytes {e.offsets[0] if e.offsets else 0}+{e.length}: stored bytes "
                    f"differ from the manifest ({algorithm} {digest[:16]}..., manifest {e.digest[:16]}...)",
                )
            )
    return spans


def _unread_extent(
    e: ManifestEntry, name: str, t: dict[str, Any], data_start: int, size: int
) -> ManifestProblem | None:
    """The ``changed`` problem of an extent not read: outside its tensor's bytes, or past the end of a file cut short
    (each extent the file no longer holds, as for a DCP data file cut short); ``None`` for one to read."""
    offs = t.get("data_offsets")
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(type(x) is int for x in offs)
        and data_start + offs[0] <= e.offset
        and e.offset + e.length <= data_start + offs[1]
    ):
        return ManifestProblem(
            "changed",
            e.key,
            None,
            f"{e.key!r} in {name}: the manifest's extent at byte {e.offset}+{e.length} lies outside the "
            "tensor's bytes; not read",
        )
    if e.offset + e.length > size:
        return ManifestProblem(
            "changed",
            e.key,
            None,
            f"{e.key!r} in {name}, bytes {e.offsets[0] if e.offsets else 0}+{e.length}: the file ({size:,} bytes) "
            "ends before them (cut short)",
        )
    return None


def _trailing_problem(name: str, size: int, data_start: int, tensors: dict[str, Any]) -> ManifestProblem | None:
    """A file longer than its header and its tensors' data (bytes appended after the last tensor): ``changed``.

    No extent covers such bytes, and safetensors' loader refuses the file (``MetadataIncompleteBuffer``).
    """
    end = data_start
    for t in tensors.values():
        offs = t.get("data_offsets")
        if isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs):
            end = max(end, data_start + offs[1])
    if size <= end:  # a file cut short is named by the extents it no longer holds
        return None
    return ManifestProblem(
        "changed",
        name,
        None,
        f"{name}: {size - end:,} byte(s) after the last tensor's data (the file has {size:,} bytes, its header and "
        f"tensors end at byte {end:,}); safetensors refuses such a file",
    )


def _extent_budget(tensors: dict[str, Any]) -> int:
    """The most extents an export writes for a file holding ``tensors``: a few per tensor, one per 64 KiB."""
    nbytes = 0
    for t in tensors.values():
        offs = t.get("data_offsets")
        if isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs):
            nbytes += max(0, offs[1] - offs[0])
    return 1024 + 16 * len(tensors) + nbytes // (64 << 10)


def _check_tiling(
    name: str,
    data_start: int,
    tensors: dict[str, Any],
    spans: dict[str, list[tuple[int, int]]],
    problems: list[ManifestProblem],
) -> None:
    """Each tensor of a file: its listed extents tile its ``data_offsets`` range, or it is ``extra``."""
    for key, t in tensors.items():
        offs = t.get("data_offsets")
        if isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs):
            begin, nbytes = data_start + offs[0], offs[1] - offs[0]
        else:
            begin, nbytes = 0, -1
        if key not in spans:
            if nbytes > 0:
                problems.append(
                    ManifestProblem("extra", key, None, f"{key!r} in {name}: stored but not in the manifest")
                )
            continue
        at = begin  # the extents must tile [begin, begin + nbytes) exactly: no gap, no overlap
        for off, length in sorted(spans[key]):
            if off != at:
                at = -1
                break
            at += length
        if at != begin + nbytes:
            problems.append(
                ManifestProblem(
                    "changed",
                    key,
                    None,
                    f"{key!r} in {name}: the manifest's extents do not tile its {nbytes} bytes",
                )
            )


def _hash_fd(fd: int, offset: int, length: int, algorithm: str, path: Path, key: str) -> str:
    h = new_hasher(algorithm)
    try:
        _read_into(h, fd, offset, length)
    except ShortReadError:
        raise DataFileError(f"{path}: short read of {key!r} (the file ends inside it)", path=path, fqn=key) from None
    return h.hexdigest()


#: Problems a check lists one by one (``--json``); the rest are counted by kind.
LISTED_PROBLEMS = 1000


#: The ``--json`` document of :class:`ManifestCheck`: its keys in order.
_CHECK_VIEW = JsonView(
    "ckpttool.manifest-check/1",
    "path manifest kind folder algorithm entries ok problems problems_omitted problem_counts source warnings",
)


@dataclass(frozen=True)
class ManifestCheck:
    """What ``ckpttool manifest DIR --verify`` found (``--json``: schema ``ckpttool.manifest-check/1``)."""

    path: str
    manifest: str
    kind: str
    algorithm: str
    entries: int
    problems: list[ManifestProblem]
    source: dict[str, Any] | None = None
    #: What the directory is (the text output's label; ``--json`` ``folder``): ``dcp``, ``safetensors`` (a Hugging
    #: Face folder, or an export), a per-rank format's name (``verl-fsdp``), or a model/optimizer pair's parts
    #: (``safetensors + dcp``: NeMo's). ``None``: ``kind``.
    folder: str | None = None
    #: Files the verdict does not cover (a manifest without ``sidecars``), and a newer step of the run root whose save
    #: did not finish (validate's ``R001``, last): ``warning:`` lines on stderr.
    warnings: list[str] = field(default_factory=list)
    #: The last of ``warnings`` is ``R001``'s.
    newer_incomplete: bool = False

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return _CHECK_VIEW.render(
            self,
            problems=[
                {"kind": p.kind, "key": p.key, "offsets": list(p.offsets) if p.offsets else None, "message": p.message}
                for p in self.problems[:LISTED_PROBLEMS]
            ],
            folder=self.folder or self.kind,
            warnings=list(self.warnings),
            problems_omitted=max(0, len(self.problems) - LISTED_PROBLEMS),
            problem_counts=self.counts(),
        )

    def counts(self) -> dict[str, int]:
        """Problems by kind."""
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.kind] = out.get(p.kind, 0) + 1
        return out


def _manifest_of(
    directory: CheckpointOrPath,
    manifest_path: str | os.PathLike[str] | None,
    opening: OpenOptions | None,
    say: Callable[[str], None],
) -> tuple[Path, Manifest, OpenOptions | None]:
    """The manifest :func:`check_against_manifest` checks against (named, loaded): ``manifest_path``, else the
    directory's own; a URL's is the one ``manifest URL`` PUT beside its ``.metadata``; an opened checkpoint's the
    one :func:`write_manifest` writes for it. Also ``opening`` to open the checkpoint with: where the default
    manifest was found by locating ``--step latest``, pinned to the step located (a save finishing in between would
    otherwise open a newer step than the manifest's)."""
    from ckpttool.format.storage import is_url

    if manifest_path is not None:
        check_path(manifest_path, "manifest_path")
    if isinstance(directory, Checkpoint):
        if manifest_path is None and directory.reader.remote is not None:
            return _manifest_of(directory.path, None, opening, say)
        writes = _manifest_command(directory.path, manifest_path, opening)
        if manifest_path is not None:
            target = Path(manifest_path)
        else:
            target = own_manifest(Path(directory.located.model) / MANIFEST_NAME)
        say(f"reading manifest {target}")
        return target, load_manifest(target, written_by=writes), opening
    if manifest_path is None and is_url(directory):
        target, data = remote_manifest(directory)
        say(f"reading manifest {target}")
        return target, load_manifest(target, data), opening
    writes = _manifest_command(directory, manifest_path, opening)
    if manifest_path is not None:
        target = Path(manifest_path)
    else:
        target, located = _default_manifest(directory, opening)
        opening = _pinned_to(opening, located)
    say(f"reading manifest {target}")
    return target, load_manifest(target, written_by=writes), opening


def _manifest_command(
    directory: str | os.PathLike[str], manifest_path: str | os.PathLike[str] | None, opening: OpenOptions | None
) -> str:
    """The ``ckpttool manifest`` command line that writes the manifest ``--verify`` reads (a hint to paste)."""
    from ckpttool.errors import shell_arg

    step = opening.selection.step if opening is not None and opening.selection is not None else None
    return (
        f"ckpttool manifest {shell_arg(directory)}"
        + (f" --step {step}" if step is not None else "")
        + (f" --output {shell_arg(manifest_path)}" if manifest_path is not None else "")
    )


def _pinned_to(opening: OpenOptions | None, located: Located | None) -> OpenOptions | None:
    """``opening`` with ``--step latest`` replaced by the step ``located`` found, so that the checkpoint opened is
    the one located (not a newer step saved since); else ``opening`` unchanged."""
    import dataclasses

    sel = opening.selection if opening is not None else None
    if opening is None or sel is None or sel.step != "latest" or located is None or located.step is None:
        return opening
    return dataclasses.replace(opening, selection=dataclasses.replace(sel, step=located.step))


def remote_manifest(url: str | os.PathLike[str], name: str = MANIFEST_NAME) -> tuple[Path, bytes]:
    """``URL/name`` (named as a UrlPath) and its bytes, capped by ``--max-object-size``. Where no object
    ``URL/name`` exists but the prefix ``URL/name/`` holds a ``manifest.json`` (``--manifest s3://b/run``, the
    checkpoint's prefix), that one, as ``--manifest DIR`` reads ``DIR/manifest.json``.

    Raises:
        UsageError: no such object; the storage errors (``E140``-``E144``).
    """
    from ckpttool.format.storage import RemoteStore

    store = RemoteStore(url)
    if name != MANIFEST_NAME and store.size(name) is None:
        inner = RemoteStore(store.path / name, store.config)
        if inner.size(MANIFEST_NAME) is not None:
            store, name = inner, MANIFEST_NAME
    where = cast(Path, store.path / name)
    if store.size(name) is None:
        raise UsageError(
            f"{where}: no such manifest file",
            path=where,
            param="manifest",
            hint="write one with `ckpttool manifest URL`",
        )
    return where, store.read_whole(name, limits.current().max_object_bytes, what="manifest")


def _default_manifest(directory: str | os.PathLike[str], opening: OpenOptions | None) -> tuple[Path, Located | None]:
    """``directory/manifest.json``, else the one :func:`write_manifest` writes by default: beside the ``.metadata``
    of the checkpoint ``directory`` resolves to (a run root's step, a pair's model folder), with that checkpoint
    (``None`` where none was located)."""
    here = Path(directory) / MANIFEST_NAME
    if here.is_file():
        return own_manifest(here), None
    from ckpttool.format.storage import is_url

    if not is_url(directory) and not Path(directory).exists():  # not "DIR/manifest.json: no such manifest file"
        from ckpttool.format.files import missing_path_hint

        raise UsageError(
            f"{directory}: no such directory",
            path=directory,
            hint=missing_path_hint(Path(directory), "the checkpoint directory"),
        )
    if not is_url(directory) and not Path(directory).is_dir():  # not "FILE/manifest.json: no such manifest file"
        from ckpttool.format.directory import not_a_directory_error

        raise not_a_directory_error(Path(directory))
    from ckpttool.model.discovery import locate

    try:
        located = locate(directory, opening.selection if opening is not None else None)
    except CkptError:
        if not os.path.lexists(here):  # a run root of several steps, a step not found: say that (with its hint),
            raise  # not "no such manifest file, write one" (`ckpttool manifest DIR` would refuse the same way)
        return own_manifest(here), None
    return own_manifest(Path(located.model) / MANIFEST_NAME), located


def own_manifest(path: Path) -> Path:
    """``path``, a checkpoint's own ``manifest.json`` (part of the untrusted checkpoint, not named by the user),
    unchanged; refused when it is a symlink that leaves its folder, as a symlinked ``layout.json`` is.

    Raises:
        PathEscapeError (E101): the manifest resolves outside the checkpoint's folder.
    """
    from ckpttool.format.files import resolve_inside

    if os.path.lexists(path):
        resolve_inside(path.parent, path.name, what="manifest")
    return path


def check_against_manifest(
    directory: CheckpointOrPath,
    manifest_path: str | os.PathLike[str] | None = None,
    *,
    opening: OpenOptions | None = None,
    progress: ProgressFn | None = None,
    phase: PhaseFn | None = None,
) -> ManifestCheck:
    """Verify a DCP checkpoint or a safetensors export directory against its manifest.

    Args:
        directory: the checkpoint or export directory, or an opened :class:`Checkpoint` (verified as it was
            opened, against the manifest :func:`write_manifest` writes for it by default).
        manifest_path: the manifest (default ``directory/manifest.json``).
        opening: how to open a DCP checkpoint (``trust_pickle``, ``selection``); not with an opened one.
        progress: ``progress(bytes done, bytes total)`` of the entries the manifest lists: ``(0, total)``, then each.
        phase: ``phase(text)`` as each step starts: ``reading manifest FILE``, ``opening DIR`` (a DCP
            checkpoint), then the bytes of ``progress``.

    Raises:
        UsageError: no manifest; a closed :class:`Checkpoint` or one with ``opening``. ManifestError: malformed.
    """
    say = phase or (lambda text: None)
    source: CheckpointOrPath = directory
    if isinstance(directory, Checkpoint):
        check_source(directory, opening)  # closed, or opened already: E100
        directory = directory.path
    target, man, opening = _manifest_of(source, manifest_path, opening, say)
    total, done = sum(e.length for e in man.entries), [0]

    def step(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    folder: str | None = None
    unchecked: list[str] = []
    untracked: list[str] = []
    unsized: list[str] = []
    unvalued: list[str] = []
    remote: list[str] = []  # files beside the data of a remote checkpoint (not fetched): not checked
    newer: str | None = None  # validate's R001: a newer step of the run root whose save did not finish
    if man.kind == "safetensors":
        step(0)
        problems = verify_safetensors_manifest(directory, man, on_entry=step)
        shown = str(directory)
    else:
        say(f"opening {directory}")
        try:
            with open_source(source, opening, record_problems=True) as ckpt:  # a data file gone: entries say so
                for err in (ckpt.replica_error, ckpt.tiling_error):  # per-rank files that do not fit: raised as
                    if err is not None:  # every command but validate does (a rank's replica is in no entry)
                        raise err
                step(0)
                problems = verify_manifest(ckpt.reader, man, on_entry=step, beside_of=Path(ckpt.located.model))
                shown = str(ckpt.path)
                folder = folder_kind(ckpt.reader)
                unchecked = unchecked_beside(ckpt.reader, man)
                remote = _remote_beside_warning(str(target), remote_beside(ckpt.reader), "not checked")
                unsized = unchecked_sizes(ckpt.reader, man)
                unvalued = unchecked_values(ckpt.reader, man)
                untracked = unchecked_training_state(ckpt.reader, man, Path(ckpt.located.model))
                newer = ckpt.located.newer_incomplete_note("verified")
        except MetadataError as e:  # a safetensors file the reader refuses (bytes appended): checked byte by byte
            problems = _verify_refused_folder(directory, man, e, step)
            shown, folder = str(directory), "safetensors"
    unchecked = unchecked if man.kind == "dcp" else []
    warnings = _unchecked_warnings(target, unchecked, untracked, unsized, unvalued, listed=man.data_files is not None)
    return ManifestCheck(
        shown,
        str(target),
        man.kind,
        man.algorithm,
        len(man.entries),
        problems,
        man.source,
        folder=folder,
        warnings=warnings + remote + ([newer] if newer else []),
        newer_incomplete=newer is not None,
    )


def _unchecked_warnings(
    target: Path,
    unchecked: list[str],
    untracked: list[str],
    unsized: list[str],
    unvalued: list[str],
    *,
    listed: bool = False,
) -> list[str]:
    """The ``warning:`` lines of what a manifest cannot vouch for: files beside the data it lists no ``sidecars`` of,
    a trainer's files without ``training_state``, data files without ``data_files`` sizes (``listed``: the
    manifest has a ``data_files`` list that leaves them out), a per-rank save's items read as values digested as
    their empty window (:func:`unchecked_values`)."""
    warnings = []
    older = "written by an older ckpttool, or edited"
    sizes = ("leaves data files out of its data_files", "edited") if listed else ("records no data file sizes", older)
    for files, (lacks, why), what in (
        (unchecked, ("lists no files beside the checkpoint's data", older), "there not checked"),
        (
            untracked,
            ("lists no training_state (the trainer's files beside the checkpoint)", older),
            "there not checked",
        ),
        (unsized, sizes, "not checked after their last chunk"),
    ):
        if files:
            more = ", ..." if len(files) > 5 else ""
            warnings.append(
                f"{target} {lacks} ({why}): "
                f"{_plural_files(len(files))} {what} ({', '.join(files[:5])}{more}); it cannot vouch for them"
            )
    if unvalued:
        more = ", ..." if len(unvalued) > 5 else ""
        warnings.append(
            f"{target} digests the empty storage window of {len(unvalued):,} byte item(s) read as values "
            f"(written by an older ckpttool, or edited): their values not checked ({', '.join(unvalued[:5])}{more}); "
            "it cannot vouch for them"
        )
    return warnings


def _verify_refused_folder(
    directory: str | os.PathLike[str], man: Manifest, refused: MetadataError, on_entry: OnEntry
) -> list[ManifestProblem]:
    """Check a safetensors model folder that the reader refuses against the manifest ``ckpttool manifest`` made of
    it (kind ``dcp``, its headers digested), without the reader: each entry's window (a tensor's raw bytes) read
    and digested where the manifest says, the data files' sizes and headers, the sidecars.

    A file grown since the manifest (a byte appended after the last tensor, which safetensors' loader refuses and
    so does the reader) is then ``changed``, beside every entry checked, as an export's manifest reports it.

    Raises:
        ``refused``: the manifest is not of a local safetensors folder, or no data file grew (the reader's
            refusal is then the answer: not a change the manifest can name).
    """
    from ckpttool.format.files import open_regular, resolve_inside
    from ckpttool.format.storage import is_url

    if man.metadata_file != HEADERS_NAME or man.data_files is None or is_url(directory):
        raise refused
    root = Path(directory)
    grown = _grown_files(root, man.data_files)
    if not grown:
        raise refused
    problems: list[ManifestProblem] = []
    for e in _counted(man.entries, on_entry):
        path = resolve_inside(root, e.file, what="data file")
        if not path.is_file():
            problems.append(
                ManifestProblem("missing", e.key, e.offsets, f"{e.where()}: its data file {e.file} is gone")
            )
            continue
        fd = open_regular(path)
        try:
            if e.offset + e.length > os.fstat(fd).st_size:
                problems.append(ManifestProblem("changed", e.key, e.offsets, f"{e.where()}: {e.file} is cut short"))
            elif _hash_fd(fd, e.offset, e.length, man.algorithm, path, e.key) != e.digest:
                problems.append(
                    ManifestProblem("changed", e.key, e.offsets, f"{e.where()}: stored bytes differ from the manifest")
                )
        finally:
            os.close(fd)
    problems.extend(grown)
    names = [f["file"] for f in man.data_files]
    h = new_hasher(man.algorithm)
    if _digest_headers(root, names, h) != man.metadata_size or h.hexdigest() != man.metadata_digest:
        problems.append(
            ManifestProblem(
                "metadata", HEADERS_NAME, None, f"{HEADERS_NAME} differ from the ones the manifest was made of"
            )
        )
    skip = {METADATA_NAME, *_own_manifest(root, man), *names, *(e.file for e in man.entries), *_inside(root, man.path)}
    problems.extend(_sidecar_problems(root, man.sidecars, skip, man.algorithm))
    return problems


def _plural_files(n: int) -> str:
    return f"{n:,} file" + ("" if n == 1 else "s") + (" or more" if n >= 1000 else "")


def folder_kind(reader: CheckpointReader) -> str:
    """What the opened directory is (the label of ``manifest --verify`` and ``diff``): ``dcp`` (a ``.metadata``), ``safetensors`` (a Hugging Face folder: its
    headers are its metadata), the per-rank format's name, or a model/optimizer pair's parts (``dcp`` for
    Accelerate's two DCP folders, ``safetensors + dcp`` for NeMo's safetensors model and DCP optimizer)."""
    if isinstance(reader, PerRankReader):
        return reader.assembled.format
    if reader.parts:
        kinds = ["dcp" if (part / METADATA_NAME).exists() else "safetensors" for part in reader.parts.values()]
        return " + ".join(dict.fromkeys(sorted(kinds, reverse=True)))
    if _metadata_file(reader) == METADATA_NAME or reader.metadata.serialization == "torch_save":
        return "dcp"  # torch.save archives: rank-local __R.metadata (use_collectives=False) have no .metadata
    return "safetensors"


def write_output_manifest(writer: Any, out: Path, algorithm: str, identity: dict[str, Any] | None) -> None:
    """``out/manifest.json`` (kind ``dcp``) of a finished :class:`~ckpttool.format.writer.DCPWriter` made with
    ``digest``: its records' digests as they were written, its ``.metadata`` digest, the source identity.

    Raises:
        OutputError: the file cannot be written.
    """
    from ckpttool.errors import OutputError

    md = writer.metadata_digest
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "kind": "dcp",
        "algorithm": algorithm,
        "metadata": {"file": METADATA_NAME, "size": md[1], "digest": md[0]} if md is not None else None,
        "entries": writer.manifest_entries(),
    }
    skip = {METADATA_NAME, MANIFEST_NAME, *(e["file"] for e in doc["entries"])}
    doc["data_files"] = data_file_sizes(out, (e["file"] for e in doc["entries"]))  # complete: the writer finished
    doc["sidecars"] = sidecar_digests(out, skip, algorithm)  # layout.json, extra_state/, copied files
    if identity is not None:
        doc["source"] = identity
    import json

    path = out / MANIFEST_NAME
    try:
        with open(path, "wb") as f:
            f.write((json.dumps(doc, separators=(",", ":")) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OutputError(f"{path}: cannot write the manifest ({e.strerror})", path=path) from e


def safetensors_source_identity(
    directory: Path, files: list[str], algorithm: str = DEFAULT_ALGORITHM
) -> dict[str, Any]:
    """The identity of a Hugging Face safetensors directory an ``import`` reads.

    ``{"checkpoint", "algorithm", "metadata_digest": <digest of every file's header, in name order>,
    "metadata_size": <their bytes>, "manifest_digest": <digest of its manifest.json> | null}``: a
    safetensors model has no ``.metadata``; its headers (names, dtypes, shapes, offsets and
    ``__metadata__``) play that part. An ``export --manifest`` output's manifest digest is the one
    ``export`` printed, so an imported checkpoint traces back through the export to its source.

    Raises:
        MetadataError, NotRegularFileError, PathEscapeError: unreadable files.
    """
    from ckpttool.format.files import resolve_inside

    check_algorithm(algorithm)  # `hash` of import: E100, not a KeyError
    h = new_hasher(algorithm)
    size = _digest_headers(directory, files, h)
    man: str | None = None
    mpath = directory / MANIFEST_NAME
    if mpath.is_file():
        man = manifest_digest(
            read_regular(
                resolve_inside(directory, MANIFEST_NAME, what="manifest"),
                limits.current().max_object_bytes,
                what="manifest",
            ),
            algorithm,
        )
    return {
        "checkpoint": str(directory),
        "algorithm": algorithm,
        "metadata_digest": h.hexdigest(),
        "metadata_size": size,
        "manifest_digest": man,
    }
