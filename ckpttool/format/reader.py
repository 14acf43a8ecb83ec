"""Reading tensors, chunks and byte items of a DCP checkpoint (imports torch when reading tensors).

:class:`CheckpointReader` reads each chunk through the chunk locator
(:func:`ckpttool.format.locator.locate_chunk`): an archive that the locator maps is read
straight into the destination (:func:`ckpttool.engine.io.read_into`: one read, no unpickling of tensor data,
no intermediate copy); archives it does not map (stream transforms, torch's newer tensor
encoding) are loaded with ``torch.load(weights_only=True)`` and checked against the
metadata all the same. Nothing here ever calls ``pickle.load`` or
``torch.load(weights_only=False)`` on checkpoint content unless the caller passes
``trust_pickle=True``.

Thread safety: reads are positional (:mod:`ckpttool.engine.io`) on shared descriptors and are safe from
several threads.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ckpttool.engine.crc import crc32
from ckpttool.engine.io import ShortReadError, read_into
from ckpttool.errors import (
    AllocationError,
    ChecksumError,
    ChunkError,
    CkptError,
    DataFileError,
    SizeLimitError,
    TrustRequiredError,
    UnsafePickleError,
    UsageError,
    check_bool,
)
from ckpttool.format import limits
from ckpttool.format.archive import (
    STORAGE_DTYPES,
    ArchiveChecksumError,
    ArchiveError,
    ArchiveTemplate,
    BytesWindow,
    PrereadWindow,
    archive_template,
    check_torch_records,
    inflate_into,
    match_template,
    parse_archive,
)
from ckpttool.format.directory import CheckpointDir
from ckpttool.format.locator import ChunkLocation, decode_transforms, locate_chunk, tensor_meta
from ckpttool.format.mdstorage import storage_infos
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, StorageInfo, TensorMeta
from ckpttool.format.pickleframes import PickleBombError, pickle_input
from ckpttool.format.tiling import tiling_problem
from ckpttool.format.unpickler import UNREADABLE_PICKLE, PlainGlobalsUnpickler, PrimitiveUnpickler, check_object_graph

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointReader", "SavedTensor", "load_saved_object", "check_saved_archive", "SMALL_SPAN"]

#: The most bytes :meth:`CheckpointReader.read_small_chunks` reads at once, and the largest gap
#: between neighbouring archives it reads through (docs/performance.md, export of 10^6 tensors).
SMALL_SPAN = 1 << 20
_SMALL_GAP = 64 << 10
_FQN = itemgetter(0)  # the fqn of an (fqn, chunk) item
#: The most archive layouts (length, dtype, shape) :meth:`CheckpointReader.read_small_chunks` keeps a template of.
_MAX_TEMPLATES = 256
# unless numpy is imported already, calls with fewer chunks check each archive one by one: the
# template's byte compares need numpy, whose import (~0.1 s) outweighs them below this (a small
# export stays numpy-free)
_TEMPLATE_MIN_ITEMS = 256


class CheckpointReader(CheckpointDir):
    """Reads tensors, chunks and byte items of a checkpoint (imports torch for tensors).

    Args:
        path: the checkpoint directory.
        trust_pickle: allow ``torch.load(weights_only=False)`` for byte items that need it.
            Dangerous on untrusted input (runs arbitrary code).
        metadata, parts: a composed checkpoint (see :class:`~ckpttool.format.directory.CheckpointDir`).
        verify_crc: check each storage record's CRC-32 as its bytes are read or copied
            (``ChecksumError`` on a mismatch; cost: docs/performance.md).

    Raises:
        as :class:`~ckpttool.format.directory.CheckpointDir`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        trust_pickle: bool = False,
        verify_crc: bool = True,
        metadata: CheckpointMetadata | None = None,
        parts: dict[str, Path] | None = None,
    ) -> None:
        check_bool(trust_pickle, "trust_pickle")  # "no" is truthy: it would run the checkpoint's pickles
        super().__init__(path, metadata=metadata, parts=parts)
        self.trust_pickle = trust_pickle
        self.verify_crc = verify_crc
        self.bytes_read = 0
        #: :meth:`read_small_chunks`' checked archives by layout ``(length, dtype, shape)`` (``False``: none usable).
        self._templates: dict[tuple[int, str, tuple[int, ...]], ArchiveTemplate | Literal[False]] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    # ------------------------------------------------------------------ raw bytes
    def pread_into(self, info: StorageInfo, start: int, buf: Any, fqn: str) -> None:
        """Fill ``buf`` with the bytes at ``info.offset + start`` of ``info``'s data file.

        Raises:
            DataFileError: the file ends first (it changed since it was checked).
        """
        fd = self.fd(info.relative_path)
        try:
            n = read_into(fd, buf, info.offset + start)
        except ShortReadError:
            raise DataFileError(
                f"{self.path / info.relative_path}: short read of {fqn!r}", path=info.relative_path, fqn=fqn
            ) from None
        self.count_read(n)

    def count_read(self, nbytes: int) -> None:
        """Add ``nbytes`` to :attr:`bytes_read` (thread-safe)."""
        with self._lock:
            self.bytes_read += nbytes

    def raw_bytes(self, fqn: str, chunk: ChunkMeta | None = None) -> bytes | bytearray:
        """The stored bytes of a byte item (or a chunk's archive), decoded through its transforms.

        Byte items are capped (:attr:`~ckpttool.format.limits.Limits.max_object_bytes`) before
        anything is read or decoded; a chunk's decoded archive by what its metadata allows.

        Raises:
            SizeLimitError: a byte item larger than the cap.
            TransformError, ChunkError: an undecodable transform, or one that decodes too much.
        """
        from ckpttool.format.locator import ARCHIVE_OVERHEAD

        info = self.storage_info(fqn, chunk)
        if chunk is None:
            cap, is_limit = limits.current().max_object_bytes, True
        else:
            meta = self.tensor_meta(fqn)
            cap = chunk.numel * meta.dtype.itemsize + limits.current().max_tensor_pickle_bytes + ARCHIVE_OVERHEAD
            is_limit = False
        if info.transform_descriptors:
            self.fetch(info)
            return decode_transforms(self, info, fqn, cap, cap_is_limit=is_limit)
        if info.length > cap:
            if is_limit:
                raise SizeLimitError(
                    f"{self.path / info.relative_path}: byte item {fqn!r} is {info.length} bytes, over the cap of "
                    f"{limits.human(cap)}",
                    path=info.relative_path,
                    fqn=fqn,
                )
            raise ChunkError(
                f"{self.path / info.relative_path}: {fqn!r} chunk at {chunk.offsets if chunk else ()} has a "
                f"{info.length}-byte window for {cap - ARCHIVE_OVERHEAD} bytes of archive",
                path=info.relative_path,
                fqn=fqn,
            )
        self.fetch(info)  # a remote checkpoint: requested only now, after the cap check
        buf = bytearray(info.length)
        self.pread_into(info, 0, buf, fqn)
        return buf  # bytes-like: no second copy of a large item

    # ------------------------------------------------------------------ tensors
    def tensor_meta(self, fqn: str) -> TensorMeta:
        """The tensor entry of ``fqn``.

        Raises:
            UsageError: ``fqn`` is not a tensor entry.
        """
        return tensor_meta(self, fqn)

    def locate(self, fqn: str, chunk: ChunkMeta) -> ChunkLocation:
        """The validated location of one chunk (:func:`~ckpttool.format.locator.locate_chunk`)."""
        return locate_chunk(self, fqn, chunk)

    def read_small_chunks(
        self, items: list[tuple[str, ChunkMeta]], *, span_cap: int = SMALL_SPAN
    ) -> list[memoryview | None]:
        """Locate and read many small chunks with one read per run of neighbouring archives.

        The archives are taken in file order (data file, offset) whatever the order of ``items``;
        those that lie together (gaps under 64 KiB, runs up to ``span_cap`` bytes) are read at
        once into one buffer (:func:`ckpttool.engine.io.read_into`) that the values returned view.
        Each archive is then checked as :meth:`locate` checks it, from its slice: the first archive
        of a layout (length, dtype, shape) by :func:`~ckpttool.format.locator.locate_chunk`, the next ones of that layout
        by byte compares against it (:func:`~ckpttool.format.archive.match_template`, vectorised
        over the run), and its values' CRC-32 checked. For a million one-chunk tensors this
        replaces ~4 system calls, a thread-pool task and a zip parse per chunk by one read per
        ~1 MiB and a few array operations (docs/performance.md).

        Args:
            items: ``(fqn, chunk)`` pairs.
            span_cap: the most bytes read at once.

        Returns:
            Per item, the chunk's raw values in C order (a view of the bytes read), or ``None``
            for a chunk this path does not take: a remote or safetensors-stored checkpoint, a
            stream transform, a record that is not the plain values, a run the file cannot serve
            whole, or anything a check refuses. Copy those with :meth:`copy_chunk_to_file` /
            :meth:`read_chunk`, which report the error (so errors are raised in the caller's
            order, exactly as one by one).
        """
        out: list[memoryview | None] = [None] * len(items)
        if self.remote is not None or self.metadata.serialization != "torch_save":
            return out
        # storage_for(fqn, chunk) of every item, in bulk (one C lookup per item for a column table)
        infos = storage_infos(self.metadata.storage, map(_FQN, items), (chunk.offsets for _, chunk in items))
        order = [  # (file, offset, length, item index)
            (info.relative_path, info.offset, info.length, k)
            for k, info in enumerate(infos)
            if info is not None and not info.transform_descriptors
        ]
        order.sort()
        templates = len(items) >= _TEMPLATE_MIN_ITEMS or "numpy" in sys.modules
        i = 0
        while i < len(order):
            path, first, length, _ = order[i]
            j, end = i + 1, first + length
            while j < len(order):
                p, offset, n, _ = order[j]
                if p != path or not end <= offset <= end + _SMALL_GAP or offset + n - first > span_cap:
                    break
                end = offset + n
                j += 1
            self._read_run(items, order[i:j], out, templates=templates)
            i = j
        return out

    def _read_run(
        self,
        items: list[tuple[str, ChunkMeta]],
        run: list[tuple[str, int, int, int]],
        out: list[memoryview | None],
        *,
        templates: bool,
    ) -> None:
        """Fill ``out`` for the neighbouring windows ``run`` from one read (see :meth:`read_small_chunks`);
        ``templates``: keep new layouts' first archives as templates for byte compares."""
        path, start = run[0][0], run[0][1]
        span = run[-1][1] + run[-1][2] - start
        try:
            if start + span > self.file_size(path):
                return  # the per-chunk path names the short file
            fd = self.fd(path)
            buf = bytearray(span)  # read in place: the values handed out are views of it
            read_into(fd, buf, start)
            data = memoryview(buf)
        except (EOFError, CkptError):  # the file shrank or is unreadable: the per-chunk path names it
            return
        entries_get = self.metadata.entries.get
        groups: dict[tuple[int, str, tuple[int, ...]], list[tuple[int, int]]] = {}
        last: tuple[object, int, tuple[int, ...]] | None = None  # (meta, length, sizes) of the last layout seen
        members: list[tuple[int, int]] = []
        for _, offset, length, k in run:
            fqn, chunk = items[k]
            meta = entries_get(fqn)
            if last is not None and last[0] is meta and last[1] == length and last[2] == chunk.sizes:
                members.append((offset - start, k))  # the layout of the item before (10^6 tensors of a few layouts)
                continue
            if not isinstance(meta, TensorMeta):
                continue
            layout = (length, meta.dtype.name, chunk.sizes)
            tmpl = self._templates.get(layout)
            last = None
            if tmpl is None:  # the first archive of its layout: checked one by one, kept as the template
                keep = layout if templates and len(self._templates) < _MAX_TEMPLATES else None
                out[k] = self._locate_preread(fd, data, offset - start, length, fqn, chunk, keep)
                continue
            if tmpl is not False:
                members = groups.setdefault(layout, [])
                members.append((offset - start, k))
                last = (meta, length, chunk.sizes)
            else:
                out[k] = self._locate_preread(fd, data, offset - start, length, fqn, chunk, None)
        for layout, members in groups.items():
            self._match_group(fd, data, members, layout, items, out)

    def _locate_preread(
        self,
        fd: int,
        data: memoryview,
        at: int,
        length: int,
        fqn: str,
        chunk: ChunkMeta,
        layout: tuple[int, str, tuple[int, ...]] | None,
    ) -> memoryview | None:
        """One archive of a run located and checked by :func:`locate_chunk` (its values' CRC-32 too);
        ``layout``: keep it as that layout's template. ``None``: not raw, or refused (named later)."""
        info = self.metadata.storage_for(fqn, chunk)
        assert info is not None
        window = PrereadWindow(fd, info.offset, data[at : at + length])
        try:
            loc = locate_chunk(self, fqn, chunk, preread=window)
            if not loc.raw:
                return None
            values = window.view(loc.record.data_offset, loc.nbytes)
            if self.verify_crc:
                loc.check_crc(crc32(values, 0))
        except CkptError:
            return None  # the caller's one-by-one copy reports it, in its order
        if layout is not None:
            self._templates[layout] = archive_template(bytes(window.view(0, length)), loc.record) or False
        self.count_read(loc.nbytes)
        return values

    def _match_group(
        self,
        fd: int,
        data: memoryview,
        members: list[tuple[int, int]],
        layout: tuple[int, str, tuple[int, ...]],
        items: list[tuple[str, ChunkMeta]],
        out: list[memoryview | None],
    ) -> None:
        """Check the archives ``members`` (``(offset in data, item)``) of one layout against its template at once."""
        import numpy as np

        tmpl = self._templates[layout]
        assert tmpl
        n = tmpl.length
        at = np.array([a for a, _ in members], dtype=np.int64)
        flat = np.frombuffer(data, dtype=np.uint8)
        if len(at) == 1 or bool((np.diff(at) == n).all()):
            rows = flat[at[0] : at[0] + n * len(at)].reshape(len(at), n)  # neighbours: a view, no copy
        else:
            rows = flat[at[:, None] + np.arange(n)]
        ok = match_template(tmpl, rows, verify_crc=self.verify_crc).tolist()
        first, nbytes = tmpl.record.data_offset, tmpl.values.size
        if all(ok):  # every archive matches (the common case): one slice each, nothing else per item
            for a, k in members:
                out[k] = data[a + first : a + first + nbytes]
            self.count_read(nbytes * len(members))
            return
        taken = 0
        for (a, k), good in zip(members, ok):
            if good:
                out[k] = data[a + first : a + first + nbytes]
                taken += nbytes
            else:  # another layout, or something a check refuses: one by one
                fqn, chunk = items[k]
                out[k] = self._locate_preread(fd, data, a, n, fqn, chunk, None)
        self.count_read(taken)

    def _check_out(self, fqn: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
        """Refuse a destination the stored values do not fit: its bytes would be filled as they are (another dtype of
        the same width reinterprets them, another shape reads a part) and checked against the CRC-32 of the whole.

        Raises:
            UsageError: ``out`` of another shape or dtype than ``shape`` / ``dtype``; on the meta device (no storage to
                fill); an expanded view (elements sharing memory: ``expand``), which no value can be written to.
        """
        bad = (
            "on the meta device, which holds no values"
            if out.device.type == "meta"
            else "an expanded view whose elements share memory"
            if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape))
            else None
        )
        if bad is not None:
            raise UsageError(
                f"{self.path}: `out` for {fqn!r} is {bad}",
                fqn=fqn,
                hint="pass a tensor with storage of its own (torch.empty of the stored shape and dtype), or none",
            )
        if tuple(out.shape) == tuple(shape) and out.dtype == dtype:
            return
        want = "x".join(map(str, shape)) or "scalar"
        got = "x".join(map(str, out.shape)) or "scalar"
        raise UsageError(
            f"{self.path}: `out` is {got} {str(out.dtype).removeprefix('torch.')}, but {fqn!r} {what} is {want} "
            f"{str(dtype).removeprefix('torch.')}",
            fqn=fqn,
            hint="pass a tensor of the stored shape and dtype, or none (a new one is returned); cast it afterwards",
        )

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
            UsageError: ``out`` of another shape or dtype.
        """
        import torch

        loc = self.locate(fqn, chunk)
        meta = loc.meta
        dtype = getattr(torch, meta.dtype.name, None)
        if not isinstance(dtype, torch.dtype):
            raise ChunkError(f"{self.path}: {fqn!r} has dtype {meta.dtype} unknown to this torch", fqn=fqn)
        if out is not None:
            self._check_out(fqn, out, chunk.sizes, dtype, f"chunk at {chunk.offsets}")
        record = loc.record
        if loc.raw:
            # read into ``out`` itself where it is host memory laid out as stored; else (a view, a GPU tensor) copied
            direct = out is not None and out.is_contiguous() and out.device.type == "cpu"
            dest = out if out is not None and direct else torch.empty(chunk.sizes, dtype=dtype)
            if chunk.numel:
                view = _byte_view(dest)
                self.pread_into(loc.info, record.data_offset, view, fqn)
                if self.verify_crc:
                    loc.check_crc(crc32(view, 0))
            if out is not None and dest is not out:
                out.copy_(dest)
                return out
            return dest
        storage = torch.empty(record.storage_numel, dtype=dtype)
        if record.storage_numel:
            view = _byte_view(storage)
            if record.deflated or not loc.in_file:
                assert record.member is not None
                try:
                    inflate_into(loc.window, record.member, memoryview(view))
                except ArchiveError as e:
                    raise ChunkError(f"{loc.where}: {e}", path=loc.info.relative_path, fqn=fqn) from e
                self.count_read(record.compressed_size)
            else:
                self.pread_into(loc.info, record.data_offset, view, fqn)
            if self.verify_crc:
                loc.check_crc(crc32(view, 0))
            if record.big_endian:
                storage.untyped_storage().byteswap(dtype)  # type: ignore[no-untyped-call]
        t = storage.as_strided(record.size, record.stride, record.storage_offset)
        if out is not None:
            out.copy_(t)
            return out
        return t

    def copy_chunk_to_file(
        self,
        fqn: str,
        chunk: ChunkMeta,
        out_fd: int,
        out_offset: int,
        *,
        sink: Callable[[memoryview], object] | None = None,
    ) -> bool:
        """Copy one chunk's raw bytes into another file (torch-free).

        The chunk is located and checked (:meth:`locate`) and, when its record holds exactly
        its values in C order, copied from the data file to ``out_fd`` at ``out_offset``
        through the engine's cache-sized block buffer (:func:`ckpttool.format.copy.copy_range`); ``sink``
        (a digest's ``update``) sees the copied bytes in order as they pass.

        Returns:
            ``True`` when copied; ``False`` when nothing was copied because the chunk
            needs :meth:`read_chunk` (stream transform, strided storage, torch's newer encoding).

        Raises:
            DataFileError, PathEscapeError, ChunkError: as :meth:`read_chunk`.
            OSError: writing ``out_fd`` failed (e.g. ``ENOSPC``).
        """
        from ckpttool.format.copy import copy_range  # on the engine: loaded by the commands that copy data

        loc = self.locate(fqn, chunk)
        if not loc.raw:
            return False
        try:
            crc = copy_range(
                self.fd(loc.info.relative_path),
                out_fd,
                loc.data_start,
                out_offset,
                loc.nbytes,
                crc_span=(0, loc.nbytes) if self.verify_crc else None,
                sink=(0, loc.nbytes, sink) if sink is not None else None,
            )
        except EOFError:
            raise DataFileError(
                f"{self.path / loc.info.relative_path}: short read of {fqn!r}", path=loc.info.relative_path, fqn=fqn
            ) from None
        if crc is not None:
            loc.check_crc(crc)
        self.count_read(loc.nbytes)
        return True

    def verify_record(self, loc: ChunkLocation) -> None:
        """Read a located record once and check its CRC-32 (for copies that pass its bytes on in pieces).

        Raises:
            ChecksumError: the record's bytes do not match its CRC-32.
            ChunkError, DataFileError: unreadable.
        """
        if loc.record.member is None:
            return
        if not loc.in_file or loc.record.deflated:
            self.read_chunk(loc.key, loc.chunk)
            return
        from ckpttool.engine.execute import run_item  # the engine's thread pool: loaded by the commands that read data
        from ckpttool.engine.plan import Crc32, Item

        fd = self.fd(loc.info.relative_path)
        try:
            (crc,) = run_item(Item.of(fd, loc.data_start, loc.record.compressed_size, Crc32()))
        except ShortReadError:
            raise DataFileError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=loc.key) from None
        loc.check_crc(crc)

    def read_tensor(self, fqn: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reassemble the global tensor ``fqn`` from its chunks (each read once).

        Args:
            fqn: flattened key (``model.lm_head.weight``).
            out: optional destination with the global ``size`` and the stored dtype; filled in place.

        Returns:
            Tensor with the global ``size`` and stored dtype (``out`` if given).

        Raises:
            UsageError: ``fqn`` is not a tensor entry; ``out`` of another shape or dtype.
            ChunkError: chunks leave a gap or overlap.
            AllocationError: the declared size cannot be held by the stored bytes.
            plus those of :meth:`read_chunk`.
        """
        import torch

        meta = self.tensor_meta(fqn)
        if out is not None:
            self._check_out(fqn, out, meta.size, meta.dtype.to_torch(), "tensor")
        self.check_tiled(fqn, meta)
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

    def read_scalar(self, fqn: str) -> int | float | bool | None:
        """The value of the one-element tensor ``fqn`` decoded from its stored bytes without torch.

        ``None`` where that needs torch: more than one element, a dtype :mod:`struct` does not decode
        (complex, FP8), or a record that is not the plain value in the data file (compressed, big-endian,
        a view into a larger storage, a stream transform): :meth:`read_tensor` reads those.

        Raises:
            UsageError: ``fqn`` is not a tensor entry.
            as :meth:`read_chunk` (a record disagreeing with the metadata, a CRC-32 mismatch).
        """
        meta = self.tensor_meta(fqn)
        fmt = _SCALAR_FORMATS.get(meta.dtype.name)
        chunk = next((c for c in meta.chunks if c.numel), None)
        if meta.numel != 1 or fmt is None or chunk is None:
            return None
        loc = self.locate(fqn, chunk)
        if not loc.raw:
            return None
        buf = bytearray(meta.dtype.itemsize)
        self.pread_into(loc.info, loc.record.data_offset, buf, fqn)
        if self.verify_crc:
            loc.check_crc(crc32(buf, 0))
        if meta.dtype.name == "bfloat16":  # the upper half of a float32
            return float(struct.unpack("<f", b"\0\0" + bytes(buf))[0])
        return struct.unpack(fmt, buf)[0]  # type: ignore[no-any-return]

    def check_tiled(self, fqn: str, meta: TensorMeta) -> None:
        """:meth:`check_allocation`, then that the chunks tile the tensor: what a reader of each chunk on its own
        (statistics) checks first, or it would measure a tensor with a hole, or count values twice.

        Raises:
            AllocationError: see :meth:`check_allocation`.
            ChunkError: the chunks leave a gap or overlap.
        """
        self.check_allocation(fqn, meta)
        problem = tiling_problem(meta)
        if problem is not None:
            raise self.tiling_error(fqn, meta, problem)

    def tiling_error(self, fqn: str, meta: TensorMeta, problem: str) -> ChunkError:
        """The ``E301`` of chunks of ``fqn`` that leave a gap or overlap (``problem``: :func:`tiling_problem`'s words).

        A checkpoint whose metadata ckpttool built from safetensors headers (a Hugging Face folder,
        ``HuggingFaceStorageWriter`` output: no ``.metadata``) names the files that hold the chunks, and a hint
        about them; the others keep the ``.metadata`` hint of ``E301``.
        """
        if self.metadata.serialization != "safetensors":
            return ChunkError(f"{self.path}: chunks of {fqn!r} do not tile the tensor ({problem})", fqn=fqn)
        files = sorted({info.relative_path for c in meta.chunks if (info := self.metadata.storage_for(fqn, c))})
        shown = ", ".join(files[:4]) + (f" (+{len(files) - 4} more)" if len(files) > 4 else "")
        return ChunkError(
            f"{self.path}: chunks of {fqn!r} in its safetensors files ({shown}) do not tile the tensor ({problem})",
            path=files[0] if files else None,
            fqn=fqn,
            hint="the files place the tensor's pieces with a gap or an overlap (a file damaged, or from another "
            "save): copy the checkpoint again or use an earlier one",
        )

    def check_allocation(self, fqn: str, meta: TensorMeta) -> None:
        """Refuse sizes that the stored bytes cannot hold, before allocating.

        Raises:
            AllocationError: a chunk claims more bytes than its archive has.
        """
        itemsize = meta.dtype.itemsize
        stored = 0
        storage_get = self.metadata.storage.get
        sizes = self._sizes  # files already sized (file_size): the common case needs no call per chunk
        for chunk in meta.chunks:
            n = math.prod(chunk.sizes)
            stored += n
            if n == 0:
                continue
            info = storage_get((fqn, chunk.offsets))
            known = sizes.get(info.relative_path) if info is not None else None
            if known is None or info is None or info.offset + info.length > known:
                info = self.storage_info(fqn, chunk)  # sizes the file, or raises the error that names it
            need = n * itemsize
            if info.transform_descriptors and need > _physical_memory():
                # a compressed chunk may legitimately be tiny (zeros), but never larger than memory
                raise AllocationError(
                    f"{self.path}: {fqn!r} chunk at {chunk.offsets} claims {need} bytes, more than this "
                    "machine's memory, behind a stream transform",
                    fqn=fqn,
                )
            if need > info.length and not info.transform_descriptors:
                raise AllocationError(
                    f"{self.path}: {fqn!r} chunk at {chunk.offsets} claims {need} bytes "
                    f"({math.prod(chunk.sizes)} x {meta.dtype}) but its record has {info.length}",
                    fqn=fqn,
                )
        # Chunks must cover the tensor, so the global size is bounded by the chunks' bytes.
        if meta.numel > stored:
            raise AllocationError(
                f"{self.path}: {fqn!r} declares {meta.numel} elements but its chunks hold {stored}", fqn=fqn
            )

    def allocation_spans(self, meta: TensorMeta) -> tuple[tuple[tuple[int, ...], int], ...] | None:
        """``(offsets, bytes needed)`` of each non-empty chunk of ``meta``, for :meth:`allocation_fits`.

        ``None`` when the chunks hold fewer elements than the tensor declares: only
        :meth:`check_allocation` reports that (entries of one layout share one ``TensorMeta``, so
        this is computed once per layout).
        """
        itemsize = meta.dtype.itemsize
        stored = 0
        spans = []
        for chunk in meta.chunks:
            n = math.prod(chunk.sizes)
            stored += n
            if n:
                spans.append((chunk.offsets, n * itemsize))
        return None if meta.numel > stored else tuple(spans)

    def allocation_fits(self, fqn: str, spans: tuple[tuple[tuple[int, ...], int], ...]) -> bool:
        """``True`` when :meth:`check_allocation` of ``fqn`` would pass without a call of its own.

        That is: every span's storage record exists, has no stream transform, lies inside a file
        already sized and holds the bytes needed. ``False`` says nothing wrong: ask
        :meth:`check_allocation`, which sizes the file or raises the error that names the chunk.
        Never raises, never reads.
        """
        storage_get = self.metadata.storage.get
        sizes = self._sizes
        for offsets, need in spans:
            info = storage_get((fqn, offsets))
            if info is None or info.transform_descriptors or need > info.length:
                return False
            known = sizes.get(info.relative_path)
            if known is None or info.offset + info.length > known:
                return False
        return True

    # ------------------------------------------------------------------ byte items
    def read_object(self, fqn: str) -> Any:
        """Load a byte item (a ``torch.save``'d Python object).

        Plain values (numbers, strings, lists, dicts) are read with a no-globals
        unpickler; anything else with ``torch.load(weights_only=True)``; if that
        refuses, only ``trust_pickle=True`` allows ``weights_only=False``.

        Raises:
            UsageError: ``fqn`` is not a byte item.
            TrustRequiredError: needs ``--trust-pickle``.
            ChunkError: not a readable archive.
        """
        meta = self.metadata.entries.get(fqn)
        if not isinstance(meta, BytesMeta):
            raise UsageError(f"{self.path}: {fqn!r} is not a byte item of the checkpoint", fqn=fqn)
        data = self.raw_bytes(fqn)
        return load_saved_object(data, f"{self.path}: byte item {fqn!r}", trust_pickle=self.trust_pickle, fqn=fqn)


class SavedTensor(NamedTuple):
    """A tensor inside a ``torch.save`` payload, described but not loaded (``load_saved_object(tensors="describe")``)."""

    dtype: str
    shape: tuple[int, ...]


#: :mod:`struct` formats of the dtypes :meth:`CheckpointReader.read_scalar` decodes (little-endian records;
#: bfloat16 as the upper half of a float32).
_SCALAR_FORMATS = {
    "float64": "<d",
    "float32": "<f",
    "float16": "<e",
    "bfloat16": "<f",
    "int64": "<q",
    "int32": "<i",
    "int16": "<h",
    "int8": "<b",
    "uint8": "<B",
    "bool": "<?",
}


def _describe_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> SavedTensor:
    dtype = storage[1] if isinstance(storage, tuple) and len(storage) == 2 else "?"
    shape = tuple(size) if isinstance(size, tuple) and all(type(x) is int for x in size) else ()
    return SavedTensor(str(dtype), shape)


class _StructureUnpickler(PrimitiveUnpickler):
    """Plain values plus tensors as :class:`SavedTensor` stand-ins (``_rebuild_tensor_v2`` of a typed storage).

    Nothing is imported or called but the stand-in builder; any other global is refused
    (:class:`UnsafePickleError`), so the caller falls back to ``torch.load(weights_only=True)``.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _describe_tensor
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage_type", STORAGE_DTYPES[name])
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], tuple):
            if len(pid[1]) == 2 and pid[1][0] == "storage_type":
                return ("storage", pid[1][1])
        return super().persistent_load(pid)


def load_saved_object(
    data: bytes | bytearray,
    where: str,
    *,
    trust_pickle: bool = False,
    fqn: str | None = None,
    tensors: str = "load",
    plain_globals: Mapping[tuple[str, str], Any] | None = None,
) -> Any:
    """Load ``torch.save`` bytes safely (see :meth:`CheckpointReader.read_object`).

    The archive's zip structure is checked first as for tensor chunks
    (:func:`~ckpttool.format.archive.parse_archive`: exact member names, no duplicates, local
    headers agreeing with the central directory), every member's size is capped and its CRC-32
    checked, so that torch, if it is asked to decode the objects, reads the same bytes. The
    result is walked with node, depth and integer bounds
    (:func:`~ckpttool.format.unpickler.check_object_graph`) before anyone else walks it.

    Args:
        data: the ``torch.save`` archive.
        where: how to name it in errors.
        trust_pickle: allow ``torch.load(weights_only=False)`` when ``weights_only=True`` refuses.
        fqn: the byte item's key, for errors.
        tensors: ``"load"`` (tensors are loaded, which imports torch) or ``"describe"``: tensors
            saved the classic way (``_rebuild_tensor_v2`` of a typed storage) come back as
            :class:`SavedTensor` (dtype, shape) without importing torch; payloads with any other
            global still go to ``torch.load(weights_only=True)``.
        plain_globals: ``(module, name)`` -> inert stand-in of the globals a trainer's own plain objects name
            (Megatron's ``args``, an ``argparse.Namespace``: :class:`~ckpttool.format.unpickler.AttributeBag`),
            resolved without ``trust_pickle`` by :class:`~ckpttool.format.unpickler.PlainGlobalsUnpickler` where the
            payload holds no tensor; ``None``: plain values only.

    Raises:
        ChunkError: not a readable ``torch.save`` archive.
        ChecksumError: a member fails its CRC-32.
        SizeLimitError: the members add up to more than the object cap.
        TrustRequiredError: needs ``trust_pickle``.
        ObjectGraphError, IntegerRangeError: a pickle bomb or an impossible number.
    """
    members = check_saved_archive(data, where, fqn=fqn)
    pkl = members["data.pkl"]
    assert pkl is not None
    try:
        return check_object_graph(_load_plain(pkl, where, tensors, plain_globals), where)
    except UnsafePickleError as e:
        if e.path is None:  # a stand-in refused how the pickle builds it; torch's unpickler would call it alike
            raise _stand_in_refusal(e, where, fqn) from None
        # else a global off the table or a tensor: needs torch's weights_only unpickler
    except CkptError:
        raise
    except PickleBombError as e:
        raise ChunkError(f"{where}: data.pkl {e}", fqn=fqn) from e  # before torch.load would run it
    except UNREADABLE_PICKLE as e:
        raise ChunkError(f"{where}: data.pkl is not a readable pickle ({type(e).__name__})", fqn=fqn) from e
    return _torch_load(data, pkl, where, fqn, trust_pickle, plain_globals)


def check_saved_archive(
    data: bytes | bytearray, where: str, *, fqn: str | None = None, verify_crc: bool = True
) -> dict[str, bytes | None]:
    """Check ``torch.save`` bytes (a byte item) as :func:`load_saved_object` does before it unpickles anything.

    The zip structure is parsed as torch reads it (:func:`~ckpttool.format.archive.parse_archive`: exact member
    names, no duplicates, local headers agreeing with the central directory), the members are size-capped in all
    and each is read (CRC-32 checked unless ``verify_crc`` is false), and the small records torch's loader reads
    are checked (:func:`~ckpttool.format.archive.check_torch_records`). Nothing is unpickled: what passes is an
    archive torch opens and reads the same way, whatever its objects are. ``reshard`` copies byte items verbatim
    after this check.

    Args:
        data: the ``torch.save`` archive.
        where: how to name it in errors.
        fqn: the byte item's key, for errors.
        verify_crc: check each member's CRC-32 (``False``: a mismatch is not an error, the member's bytes are kept).

    Returns:
        Member name (without the archive's folder) -> its uncompressed bytes (``data.pkl`` among them).

    Raises:
        ChunkError: not a readable ``torch.save`` archive (E301).
        ChecksumError: a member fails its CRC-32, with ``verify_crc`` (E308).
        SizeLimitError: the members add up to more than the object cap (E307).
    """
    window = BytesWindow(data)
    cap = limits.current().max_object_bytes
    members: dict[str, bytes | None] = {}
    try:
        archive = parse_archive(window)
        total = sum(m.size for m in archive.members.values())
        if total > cap:
            raise SizeLimitError(f"{where}: its members unpack to {total} bytes, over the cap of {limits.human(cap)}")
        for name in archive.members:  # every CRC-32
            try:
                members[name] = archive.read(window, name, cap)
            except ArchiveChecksumError:
                if verify_crc:
                    raise
                members[name] = None
        check_torch_records(archive, window)
    except ArchiveChecksumError as e:
        raise ChecksumError(f"{where}: {e}", fqn=fqn) from e
    except ArchiveError as e:
        raise ChunkError(
            f"{where} is not a torch.save archive torch reads the same way ({str(e)[:160]})", fqn=fqn
        ) from e
    return members


def _torch_load(
    data: bytes | bytearray,
    pkl: bytes,
    where: str,
    fqn: str | None,
    trust_pickle: bool,
    plain_globals: Mapping[tuple[str, str], Any] | None,
) -> Any:
    """``torch.load(weights_only=True)`` of a checked archive (:func:`load_saved_object`; ``plain_globals`` resolved
    to their stand-ins), else with ``trust_pickle`` ``weights_only=False``.

    Raises:
        ChunkError: torch cannot read it; TrustRequiredError: needs ``trust_pickle``.
    """
    import torch

    try:
        with _safe_globals(plain_globals):
            return check_object_graph(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), where)
    except UnsafePickleError as e:
        raise (_stand_in_refusal(e, where, fqn) if e.path is None else e) from None
    except CkptError:
        raise
    except Exception as e:
        weights_only_refusal = "weights_only" in str(e) or "Unsupported global" in str(e)
        if not weights_only_refusal:
            raise ChunkError(f"{where} is not a readable torch.save archive ({type(e).__name__})", fqn=fqn) from e
        if not trust_pickle:
            raise TrustRequiredError(
                f"{where} holds objects that torch.load(weights_only=True) refuses{_refused_globals(pkl)}", fqn=fqn
            ) from e
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:
        raise ChunkError(f"{where} failed to load even with `trust_pickle` ({type(e).__name__})", fqn=fqn) from e


def _load_plain(pkl: bytes, where: str, tensors: str, plain_globals: Mapping[tuple[str, str], Any] | None) -> Any:
    """``data.pkl`` by ckpttool's own unpicklers (:func:`load_saved_object`): plain values (and the stand-ins of
    ``plain_globals``), else with ``tensors="describe"`` plain values and tensors described.

    Raises:
        UnsafePickleError: it needs torch's weights-only unpickler.
    """
    try:
        if plain_globals:
            return PlainGlobalsUnpickler(pickle_input(pkl), source=where, allowed=plain_globals).load()
        return PrimitiveUnpickler(pickle_input(pkl), source=where).load()
    except UnsafePickleError as e:
        if tensors != "describe" or e.path is None:  # a stand-in's refusal is final (:func:`_stand_in_refusal`)
            raise
        return _StructureUnpickler(pickle_input(pkl), source=where).load()


def _stand_in_refusal(e: UnsafePickleError, where: str, fqn: str | None) -> UnsafePickleError:
    """The refusal of a stand-in of ``plain_globals`` (an enum rebuilt from ``None``, an ``argparse.Namespace`` from
    a state that is not a dict: raised without a file, where the unpicklers' own refusals of a global or a tensor name
    theirs), named for the file ``where``: final, the bytes are not handed on to another unpickler."""
    return UnsafePickleError(f"{where}: {e.message}", hint=e.hint, path=where, fqn=fqn)


#: held around a ``torch.load`` with :func:`_safe_globals`: torch keeps its safe globals in one process-wide set that
#: its context manager replaces by a union on entry and a difference on exit, so two readers' loads at once lost
#: each other's stand-ins (a spurious ``E304``) or left them registered after the call
_SAFE_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def _safe_globals(plain_globals: Mapping[tuple[str, str], Any] | None) -> Iterator[None]:
    """``torch.serialization.safe_globals`` of the stand-ins of :func:`load_saved_object`'s ``plain_globals`` (each as
    ``(stand-in, "module.name")``: torch's weights-only unpickler resolves the name to the stand-in, never imports the
    class), for a payload that also holds tensors, one such load at a time (:data:`_SAFE_GLOBALS_LOCK`); nothing
    without any. A real class registered under one of those names (``import megatron.core`` registers
    ``pathlib.PosixPath``, ...) is set aside for the load, so the stand-ins, not the class, are built; the process's
    safe globals are restored exactly after it."""
    import torch

    if not plain_globals:
        yield
        return
    ours = [(v, f"{m}.{n}") for (m, n), v in plain_globals.items()]
    names = {name for _, name in ours}
    ser = torch.serialization
    with _SAFE_GLOBALS_LOCK:
        saved = ser.get_safe_globals()
        ser.clear_safe_globals()
        try:
            ser.add_safe_globals([*(g for g in saved if _global_name(g) not in names), *ours])
            yield
        finally:
            ser.clear_safe_globals()
            ser.add_safe_globals(saved)


def _global_name(g: Any) -> str:
    """The ``module.name`` torch's weights-only unpickler resolves a safe-globals entry by (``(obj, name)`` or obj)."""
    if isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], str):
        return g[1]
    return f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"


def _refused_globals(pkl: bytes) -> str:
    """`` (classes: a.B, ...)``: what a refused pickle names (opcodes only, nothing run); a known tensor subclass said."""
    import torch

    from ckpttool.format.pickle_globals import TENSOR_SUBCLASS_HINTS, pickle_globals

    allowed = {
        f"{g.__module__}.{getattr(g, '__qualname__', '')}"
        for g in torch.serialization.get_safe_globals()
        if not isinstance(g, tuple)  # (callable, "module.name") entries: named by their string
    }
    allowed.update(g[1] for g in torch.serialization.get_safe_globals() if isinstance(g, tuple))
    names = [n for n in pickle_globals(pkl) if not n.startswith(("torch._utils.", "collections.")) and n not in allowed]
    if not names:
        return ""
    sub = [n for n in names if n.startswith(TENSOR_SUBCLASS_HINTS) or "Tensor" in n.rsplit(".", 1)[-1]]
    what = f"a tensor subclass {sub[0]} (not loaded)" if sub else "classes " + ", ".join(names[:4])
    return f": {what}"


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def _byte_view(t: torch.Tensor) -> Any:
    import torch

    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()
