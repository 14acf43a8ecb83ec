"""Safe reading of a DCP checkpoint directory.

:class:`CheckpointDir` opens a directory, reads ``.metadata`` with the allow-list
unpickler (no torch import) and confines every ``relative_path`` to the
directory. Tensor data is read by :class:`CheckpointReader` (imports torch):
each chunk's ``torch.save`` archive is validated against the metadata (dtype,
shape, byte length) and its raw storage bytes are read straight into the
destination with ``os.preadv`` (DESIGN.md section 7); archives that the fast
path does not understand are loaded with ``torch.load(weights_only=True)``.
Nothing here ever calls ``pickle.load`` or ``torch.load(weights_only=False)``
on checkpoint content unless the caller passes ``trust_pickle=True``.

Thread safety: reads use ``os.preadv`` on shared descriptors and are safe from
several threads.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    AllocationError,
    ChunkError,
    CkptError,
    DataFileError,
    IncompleteCheckpointError,
    MetadataError,
    PathEscapeError,
    TransformError,
    TrustRequiredError,
    UnsafePickleError,
    UsageError,
)
from .copy import copy_range
from .archive import FileWindow, TensorRecord, parse_tensor_archive, read_archive_pickle
from .model import BytesMeta, CheckpointMetadata, ChunkMeta, StorageInfo, TensorMeta
from .unpickler import PrimitiveUnpickler, load_metadata

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointDir",
    "CheckpointReader",
    "DATA_FILE_RE",
    "rank_of_file",
    "tiling_problem",
]

DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
METADATA_NAME = ".metadata"


def rank_of_file(relative_path: str) -> int | None:
    """Writing rank encoded in a ``__{rank}_{n}.distcp`` file name, else ``None``."""
    m = DATA_FILE_RE.match(os.path.basename(relative_path))
    return int(m.group(1)) if m else None


def tiling_problem(meta: TensorMeta) -> str | None:
    """Check that the chunks of ``meta`` tile the global tensor exactly.

    Returns:
        ``None`` when they do, else a short description (``"gap: ..."`` or
        ``"overlap: ..."``). Zero-size chunks are valid and ignored.
    """
    total = meta.numel
    chunks = [c for c in meta.chunks if c.numel > 0]
    covered = sum(c.numel for c in chunks)
    if not meta.size:  # 0-d
        if len(meta.chunks) == 0:
            return "gap: 0-d tensor has no chunk"
        return None
    if total == 0:
        return None
    # Fast path: chunks differ along a single dim and form contiguous intervals there.
    ndim = len(meta.size)
    if chunks:
        varying = [d for d in range(ndim) if len({(c.offsets[d], c.sizes[d]) for c in chunks}) > 1]
        if len(varying) <= 1:
            d = varying[0] if varying else 0
            fixed_ok = all(
                c.offsets[k] == 0 and c.sizes[k] == meta.size[k]
                for c in (chunks[0],) for k in range(ndim) if k != d
            )
            if fixed_ok:
                iv = sorted((c.offsets[d], c.offsets[d] + c.sizes[d]) for c in chunks)
                pos = 0
                for lo, hi in iv:
                    if lo < pos:
                        return f"overlap: chunks overlap at index {lo} of dim {d}"
                    if lo > pos:
                        return f"gap: no chunk covers [{pos}, {lo}) of dim {d}"
                    pos = hi
                if pos != meta.size[d]:
                    return f"gap: no chunk covers [{pos}, {meta.size[d]}) of dim {d}"
                return None
    # General path: pairwise disjoint boxes whose volumes add up to the tensor's.
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if all(
                a.offsets[k] < b.offsets[k] + b.sizes[k] and b.offsets[k] < a.offsets[k] + a.sizes[k]
                for k in range(ndim)
            ):
                return f"overlap: chunks at {a.offsets} and {b.offsets} overlap"
    if covered != total:
        return f"gap: chunks cover {covered} of {total} elements"
    return None


class CheckpointDir:
    """A DCP checkpoint directory with its validated metadata (torch-free).

    Args:
        path: the checkpoint directory.

    Raises:
        UsageError: ``path`` does not exist or is not a directory.
        IncompleteCheckpointError: data files but no ``.metadata``.
        MetadataError / UnsafePickleError: ``.metadata`` missing or unusable.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if not p.exists():
            raise UsageError(f"{p}: no such directory", path=p, hint="pass the checkpoint directory")
        if not p.is_dir():
            raise UsageError(
                f"{p} is not a directory", path=p,
                hint="pass the checkpoint directory (the one holding .metadata), not a file in it",
            )
        self.path = p
        self.root = p.resolve()
        md = p / METADATA_NAME
        if not md.is_file():
            if any(DATA_FILE_RE.match(n) for n in os.listdir(p)):
                raise IncompleteCheckpointError(
                    f"{p}: has .distcp data files but no .metadata (incomplete save)", path=md
                )
            raise MetadataError(
                f"{p}: no .metadata file; not a DCP checkpoint", path=md,
                hint="pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files)",
            )
        self.metadata: CheckpointMetadata = load_metadata(md)
        self._resolved: dict[str, Path] = {}
        self._sizes: dict[str, int] = {}

    # ------------------------------------------------------------------ files
    def resolve(self, relative_path: str) -> Path:
        """Absolute path of a data file, confined to the checkpoint directory.

        Raises:
            PathEscapeError: absolute, ``..`` or symlink escapes.
        """
        hit = self._resolved.get(relative_path)
        if hit is not None:
            return hit
        if not relative_path or "\x00" in relative_path or os.path.isabs(relative_path):
            raise PathEscapeError(
                f"{self.path}: storage path {relative_path!r} is absolute or empty", path=relative_path
            )
        target = (self.root / relative_path).resolve()
        if target != self.root and self.root not in target.parents:
            raise PathEscapeError(
                f"{self.path}: storage path {relative_path!r} resolves outside the checkpoint ({target})",
                path=relative_path,
            )
        self._resolved[relative_path] = target
        return target

    def file_size(self, relative_path: str) -> int:
        """Size in bytes of a data file.

        Raises:
            PathEscapeError, DataFileError: escaping or missing file.
        """
        size = self._sizes.get(relative_path)
        if size is None:
            target = self.resolve(relative_path)
            try:
                st = target.stat()
            except OSError as e:
                raise DataFileError(
                    f"{self.path / relative_path}: data file missing ({e.strerror})", path=relative_path
                ) from e
            if not target.is_file():
                raise DataFileError(f"{self.path / relative_path}: not a regular file", path=relative_path)
            size = st.st_size
            self._sizes[relative_path] = size
        return size

    def data_files(self) -> list[str]:
        """Relative paths referenced by ``storage_data`` (sorted, unique)."""
        return sorted({s.relative_path for s in self.metadata.storage.values()})

    def storage_info(self, fqn: str, chunk: ChunkMeta | None = None) -> StorageInfo:
        """Storage info of a chunk (or byte item), bounds-checked against its file.

        Raises:
            MetadataError: no storage entry for it.
            PathEscapeError, DataFileError: bad path, missing or too-short file.
        """
        info = self.metadata.storage_for(fqn, chunk)
        if info is None:
            where = f" chunk at {chunk.offsets}" if chunk is not None else ""
            raise MetadataError(f"{self.path}: no storage entry for {fqn!r}{where}", fqn=fqn)
        size = self.file_size(info.relative_path)
        if info.offset + info.length > size:
            raise DataFileError(
                f"{self.path / info.relative_path}: {fqn!r} needs bytes [{info.offset}, "
                f"{info.offset + info.length}) but the file has {size} (truncated?)",
                path=info.relative_path, fqn=fqn,
            )
        return info


class CheckpointReader(CheckpointDir):
    """Reads tensors, chunks and byte items of a checkpoint (imports torch).

    Args:
        path: the checkpoint directory.
        trust_pickle: allow ``torch.load(weights_only=False)`` for byte items that
            need it. Dangerous on untrusted input (runs arbitrary code).
    """

    def __init__(self, path: str | os.PathLike[str], *, trust_pickle: bool = False) -> None:
        super().__init__(path)
        self.trust_pickle = trust_pickle
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fd(self, relative_path: str) -> int:
        fd = self._fds.get(relative_path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(relative_path)
                if fd is None:
                    target = self.resolve(relative_path)
                    try:
                        fd = os.open(target, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as e:
                        raise DataFileError(
                            f"{self.path / relative_path}: cannot open data file ({e.strerror})",
                            path=relative_path,
                        ) from e
                    self._fds[relative_path] = fd
        return fd

    def _window(self, info: StorageInfo) -> FileWindow:
        return FileWindow(self._fd(info.relative_path), info.offset, info.length)

    def _pread_into(self, info: StorageInfo, start: int, buf: Any, fqn: str) -> None:
        mv = memoryview(buf).cast("B")
        fd = self._fd(info.relative_path)
        pos, n = 0, len(mv)
        while pos < n:
            got = os.preadv(fd, [mv[pos:]], info.offset + start + pos)
            if got <= 0:
                raise DataFileError(
                    f"{self.path / info.relative_path}: short read of {fqn!r}", path=info.relative_path, fqn=fqn
                )
            pos += got
        with self._lock:
            self.bytes_read += n

    def raw_bytes(self, fqn: str, chunk: ChunkMeta | None = None) -> bytes:
        """The stored bytes of a chunk/byte item, decoded through its transforms."""
        info = self.storage_info(fqn, chunk)
        buf = bytearray(info.length)
        self._pread_into(info, 0, buf, fqn)
        if not info.transform_descriptors:
            return bytes(buf)
        return self._untransform(info, bytes(buf), fqn)

    def _untransform(self, info: StorageInfo, data: bytes, fqn: str) -> bytes:
        try:
            from torch.distributed.checkpoint._extension import (
                ExtensionRegistry,
                StreamTransformExtension,
            )

            exts = ExtensionRegistry().from_descriptor_list(list(info.transform_descriptors))
            stream: Any = io.BytesIO(data)
            for ex in exts:
                if isinstance(ex, StreamTransformExtension):
                    stream = ex.transform_from(stream)
            return stream.read()
        except Exception as e:  # noqa: BLE001 - torch raises ValueError/various for unknown/corrupt
            raise TransformError(
                f"{self.path / info.relative_path}: {fqn!r} uses transform "
                f"{list(info.transform_descriptors)} that cannot be decoded ({type(e).__name__}: {str(e)[:80]})",
                path=info.relative_path, fqn=fqn,
            ) from e

    # ------------------------------------------------------------------ tensors
    def tensor_meta(self, fqn: str) -> TensorMeta:
        meta = self.metadata.entries.get(fqn)
        if not isinstance(meta, TensorMeta):
            raise UsageError(f"{self.path}: {fqn!r} is not a tensor entry of the checkpoint", fqn=fqn)
        return meta

    def read_chunk(self, fqn: str, chunk: ChunkMeta, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read one stored chunk of tensor ``fqn``.

        Args:
            fqn: flattened key (``model.model.layers.0.mlp.down_proj.weight``).
            chunk: one of ``tensor_meta(fqn).chunks``.
            out: optional destination with shape ``chunk.sizes`` and the stored
                dtype (may be a view of a larger tensor); filled in place.

        Returns:
            Tensor of shape ``chunk.sizes`` and the stored dtype (``out`` if given).

        Raises:
            DataFileError, PathEscapeError: file missing/short/escaping.
            ChunkError: archive corrupt or disagreeing with the metadata.
            TransformError: undecodable stream transform.
        """
        import torch

        meta = self.tensor_meta(fqn)
        info = self.storage_info(fqn, chunk)
        dtype = meta.dtype.to_torch() if hasattr(torch, meta.dtype.name) else None
        if dtype is None:
            raise ChunkError(f"{self.path}: {fqn!r} has dtype {meta.dtype} unknown to this torch", fqn=fqn)
        where = f"{self.path / info.relative_path}: {fqn!r} chunk at {chunk.offsets}"
        record = self._validated_record(fqn, chunk, meta, info, where)
        if record is not None:
            contiguous = record.storage_offset == 0 and record.stride == _contiguous_stride(record.size)
            if contiguous and record.storage_numel == chunk.numel:
                dest = out if out is not None and out.is_contiguous() else torch.empty(chunk.sizes, dtype=dtype)
                if chunk.numel:
                    self._pread_into(info, record.data_offset, _byte_view(dest), fqn)
                if out is not None and dest is not out:
                    out.copy_(dest)
                    return out
                return dest
            storage = torch.empty(record.storage_numel, dtype=dtype)
            if record.storage_numel:
                self._pread_into(info, record.data_offset, _byte_view(storage), fqn)
            t = storage.as_strided(record.size, record.stride, record.storage_offset)
        else:
            t = self._torch_load_chunk(info, fqn, where)
            if t.dtype != dtype or tuple(t.shape) != chunk.sizes:
                raise ChunkError(
                    f"{where}: stored tensor is {t.dtype}{list(t.shape)}, metadata says {meta.dtype}{list(chunk.sizes)}",
                    path=info.relative_path, fqn=fqn,
                )
        if out is not None:
            out.copy_(t)
            return out
        return t

    def _validated_record(self, fqn: str, chunk: ChunkMeta, meta: TensorMeta, info: StorageInfo,
                          where: str) -> TensorRecord | None:
        """Parse a chunk's archive and check it against the metadata (dtype and shape).

        Returns:
            The record, or ``None`` for a chunk the fast path cannot map (stream
            transform, an archive format it does not understand).

        Raises:
            ChunkError: corrupt archive, unsafe ``data.pkl``, or dtype/shape disagreeing with the metadata.
        """
        if info.transform_descriptors:
            return None
        try:
            record = parse_tensor_archive(self._window(info))
        except UnsafePickleError as e:
            raise ChunkError(f"{where}: {e.message}", path=info.relative_path, fqn=fqn) from e
        except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as e:
            raise ChunkError(
                f"{where}: stored archive is corrupt ({type(e).__name__}: {str(e)[:80]})",
                path=info.relative_path, fqn=fqn,
            ) from e
        if record is not None and (record.dtype != meta.dtype.name or record.size != chunk.sizes):
            raise ChunkError(
                f"{where}: stored tensor is {record.dtype}{list(record.size)}, metadata says "
                f"{meta.dtype}{list(chunk.sizes)}",
                path=info.relative_path, fqn=fqn,
            )
        return record

    def _raw_record(self, fqn: str, chunk: ChunkMeta) -> tuple[StorageInfo, int, int] | None:
        """Validated location of a chunk's raw C-order bytes: ``(info, offset in the record, nbytes)``.

        ``None`` when the chunk needs :meth:`read_chunk` (stream transform, strided or
        shared storage, an archive the fast path does not understand).

        Raises:
            DataFileError, PathEscapeError, ChunkError: as :meth:`read_chunk`.
        """
        meta = self.tensor_meta(fqn)
        info = self.storage_info(fqn, chunk)
        where = f"{self.path / info.relative_path}: {fqn!r} chunk at {chunk.offsets}"
        record = self._validated_record(fqn, chunk, meta, info, where)
        if record is None:
            return None
        if not (record.storage_offset == 0 and record.stride == _contiguous_stride(record.size)
                and record.storage_numel == chunk.numel):
            return None
        return info, record.data_offset, chunk.numel * meta.dtype.itemsize

    def copy_chunk_to_file(self, fqn: str, chunk: ChunkMeta, out_fd: int, out_offset: int) -> bool:
        """Copy one chunk's raw bytes into another file (torch-free).

        The fast path of :meth:`read_chunk` (DESIGN.md section 7) for a caller that
        writes the bytes to a file as they are: the chunk's archive is validated against
        the metadata (dtype, shape, contiguous storage holding exactly the chunk) and
        its raw storage record goes from the data
        file to ``out_fd`` at ``out_offset`` through a cache-sized bounce buffer
        (:func:`ckpttool.dcp.copy.copy_range`, faster here than ``copy_file_range``).

        Returns:
            ``True`` when copied; ``False`` when nothing was copied because the chunk
            needs :meth:`read_chunk`.

        Raises:
            DataFileError, PathEscapeError, ChunkError: as :meth:`read_chunk`.
            OSError: writing ``out_fd`` failed (e.g. ``ENOSPC``).
        """
        found = self._raw_record(fqn, chunk)
        if found is None:
            return False
        info, data_offset, nbytes = found
        try:
            copy_range(self._fd(info.relative_path), out_fd, info.offset + data_offset, out_offset, nbytes)
        except EOFError:
            raise DataFileError(
                f"{self.path / info.relative_path}: short read of {fqn!r}", path=info.relative_path, fqn=fqn
            ) from None
        with self._lock:
            self.bytes_read += nbytes
        return True

    def _torch_load_chunk(self, info: StorageInfo, fqn: str, where: str) -> torch.Tensor:
        import torch

        data = self.raw_bytes(fqn, _chunk_for(self.tensor_meta(fqn), info, self.metadata, fqn))
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types on corrupt archives
            raise ChunkError(
                f"{where}: stored archive is corrupt or unsafe ({type(e).__name__}: {str(e)[:80]})",
                path=info.relative_path, fqn=fqn,
            ) from e
        if not isinstance(t, torch.Tensor):
            raise ChunkError(f"{where}: stored object is {type(t).__name__}, not a tensor", fqn=fqn)
        return t

    def read_tensor(self, fqn: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reassemble the global tensor ``fqn`` from its chunks (each read once).

        Returns:
            Tensor with the global ``size`` and stored dtype.

        Raises:
            ChunkError: chunks leave a gap or overlap.
            AllocationError: the declared size cannot be held by the stored bytes.
            plus those of :meth:`read_chunk`.
        """
        import torch

        meta = self.tensor_meta(fqn)
        self.check_allocation(fqn, meta)
        problem = tiling_problem(meta)
        if problem is not None:
            raise ChunkError(f"{self.path}: chunks of {fqn!r} do not tile the tensor ({problem})", fqn=fqn)
        if out is None:
            out = torch.empty(meta.size, dtype=meta.dtype.to_torch())
        for chunk in meta.chunks:
            if chunk.numel == 0:
                continue
            view = out
            for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
                if o != 0 or s != meta.size[d]:
                    view = view.narrow(d, o, s)
            self.read_chunk(fqn, chunk, out=view)
        return out

    def check_allocation(self, fqn: str, meta: TensorMeta) -> None:
        """Refuse sizes that the stored bytes cannot hold, before allocating.

        Raises:
            AllocationError: a chunk claims more bytes than its archive has.
        """
        for chunk in meta.chunks:
            if chunk.numel == 0:
                continue
            info = self.storage_info(fqn, chunk)
            need = chunk.numel * meta.dtype.itemsize
            if need > info.length and not info.transform_descriptors:
                raise AllocationError(
                    f"{self.path}: {fqn!r} chunk at {chunk.offsets} claims {need} bytes "
                    f"({math.prod(chunk.sizes)} x {meta.dtype}) but its record has {info.length}",
                    fqn=fqn,
                )
        # Chunks must cover the tensor, so the global size is bounded by the chunks' bytes.
        stored = sum(c.numel for c in meta.chunks)
        if meta.numel > stored:
            raise AllocationError(
                f"{self.path}: {fqn!r} declares {meta.numel} elements but its chunks hold {stored}", fqn=fqn
            )

    def iter_tensors(self, fqns: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(fqn, global tensor)`` for the given (default: all) tensor entries."""
        keys = fqns if fqns is not None else [k for k, v in self.metadata.entries.items() if isinstance(v, TensorMeta)]
        for k in keys:
            yield k, self.read_tensor(k)

    # ------------------------------------------------------------------ byte items
    def read_object(self, fqn: str) -> Any:
        """Load a byte item (a ``torch.save``'d Python object).

        Plain values (numbers, strings, lists, dicts) are read with a no-globals
        unpickler; anything else with ``torch.load(weights_only=True)``; if that
        refuses, only ``trust_pickle=True`` allows ``weights_only=False``.

        Raises:
            TrustRequiredError: needs ``--trust-pickle``.
            ChunkError: not a readable archive.
        """
        meta = self.metadata.entries.get(fqn)
        if not isinstance(meta, BytesMeta):
            raise UsageError(f"{self.path}: {fqn!r} is not a byte item of the checkpoint", fqn=fqn)
        data = self.raw_bytes(fqn)
        return load_saved_object(data, f"{self.path}: byte item {fqn!r}", trust_pickle=self.trust_pickle, fqn=fqn)


def load_saved_object(data: bytes, where: str, *, trust_pickle: bool = False, fqn: str | None = None) -> Any:
    """Load ``torch.save`` bytes safely (see :meth:`CheckpointReader.read_object`)."""
    try:
        pkl = read_archive_pickle(io.BytesIO(data))
        return PrimitiveUnpickler(io.BytesIO(pkl), source=where).load()
    except UnsafePickleError:
        pass  # needs torch's weights_only unpickler (tensors, ...)
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, pickle.UnpicklingError):
        pass  # legacy (non-zip) format or corrupt: let torch decide below
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError/RuntimeError/...
        weights_only_refusal = "weights_only" in str(e) or "Unsupported global" in str(e)
        if not weights_only_refusal:
            raise ChunkError(f"{where} is not a readable torch.save archive ({type(e).__name__})", fqn=fqn) from e
        if not trust_pickle:
            raise TrustRequiredError(
                f"{where} holds objects that torch.load(weights_only=True) refuses", fqn=fqn
            ) from e
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise ChunkError(f"{where} failed to load even with --trust-pickle ({type(e).__name__})", fqn=fqn) from e


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _byte_view(t: torch.Tensor) -> Any:
    import torch

    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _chunk_for(meta: TensorMeta, info: StorageInfo, md: CheckpointMetadata, fqn: str) -> ChunkMeta:
    for c in meta.chunks:
        if md.storage_for(fqn, c) is info:
            return c
    raise CkptError(f"internal: no chunk for {fqn!r}")  # pragma: no cover
