"""The chunk locator: where a tensor chunk's raw bytes lie, checked against ``.metadata``.

:func:`locate_chunk` is the only place that checks a chunk's archive (``torch/distributed/
checkpoint/filesystem.py``, ``_write_item``) against the metadata; the reader, export's
verbatim copy, reshard and ``validate --deep`` read chunk bytes through the
:class:`ChunkLocation` it returns. In order: a tensor entry with a ``storage_data`` entry; a
confined regular data file holding the window; a stream transform (zstd) decoded with its
output capped; the zip structure (:func:`ckpttool.format.archive.parse_archive`); ``data.pkl``
by the restricted tensor unpickler; dtype and shape equal to the metadata's. safetensors
storage (:mod:`ckpttool.format.hf_storage`): the window must hold exactly ``numel * itemsize``
bytes and has no CRC-32. Readers check the record's CRC-32 as bytes pass
(:meth:`ChunkLocation.check_crc`). ``docs/design.md`` §5, "One chunk locator".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import (
    ChecksumError,
    ChunkError,
    SizeLimitError,
    StorageTupleError,
    TransformError,
    UnsafePickleError,
    UsageError,
)
from ckpttool.format import limits
from ckpttool.format.archive import (
    ArchiveChecksumError,
    ArchiveError,
    BytesWindow,
    FileWindow,
    PrereadWindow,
    TensorRecord,
    Window,
    parse_tensor_archive,
)
from ckpttool.format.metadata import ChunkMeta, StorageInfo, TensorMeta
from ckpttool.format.tiling import row_major_stride

if TYPE_CHECKING:
    from ckpttool.format.directory import CheckpointDir

__all__ = ["ChunkLocation", "locate_chunk", "tensor_meta", "decode_transforms", "ARCHIVE_OVERHEAD"]

#: Bytes a ``torch.save`` archive of one tensor may hold besides the record (members, padding, directory).
ARCHIVE_OVERHEAD = 64 << 10


@dataclass(frozen=True)
class ChunkLocation:
    """A validated chunk: its storage window and its raw storage record.

    Attributes:
        key: the tensor's checkpoint key.
        chunk: the chunk (``offsets``, ``sizes``).
        meta: the tensor entry (dtype, global size).
        info: the storage entry, bounds-checked against its data file.
        record: the parsed archive.
        file: the data file as named to the user (checkpoint path / ``relative_path``).
        window: where the archive's bytes are: the data file's window, or the decoded bytes of a
            stream transform (``record`` offsets are relative to it).
    """

    key: str
    chunk: ChunkMeta
    meta: TensorMeta
    info: StorageInfo
    record: TensorRecord
    file: Path
    window: Window

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's values (``numel * itemsize``)."""
        return self.chunk.numel * self.meta.dtype.itemsize

    @property
    def in_file(self) -> bool:
        """The archive's bytes are the data file's (no stream transform): they can be read or copied by offset."""
        return isinstance(self.window, FileWindow)

    @property
    def raw(self) -> bool:
        """The record holds exactly the chunk's values in C order, as stored bytes in the data file: copyable as is."""
        r = self.record
        return (
            self.in_file
            and not r.deflated
            and not r.big_endian
            and r.storage_offset == 0
            and r.storage_numel == self.chunk.numel
            and r.stride == row_major_stride(r.size)
        )

    @property
    def has_crc(self) -> bool:
        """The record is a zip entry of a ``torch.save`` archive (what ``dcp.save`` writes per chunk), which
        stores the CRC-32 of its bytes (:meth:`check_crc` compares it); a safetensors-stored chunk (torch's
        Hugging Face storage writer, NeMo Automodel) and an empty storage have none."""
        return self.record.member is not None

    @property
    def data_start(self) -> int:
        """Absolute offset in the data file of the raw storage record's first byte (``in_file`` locations)."""
        return self.info.offset + self.record.data_offset

    @property
    def where(self) -> str:
        """``'<file>: '<key>' chunk at <offsets>'`` for messages."""
        return f"{self.file}: {self.key!r} chunk at {self.chunk.offsets}"

    def check_crc(self, crc: int | None) -> None:
        """Compare the CRC-32 of the record's bytes as read with the one its zip entry holds (``crc``
        ``None``: not computed, for a record without one: :attr:`has_crc` false).

        Raises:
            ChecksumError: they differ (the stored values are not the ones that were saved).
        """
        assert crc is not None or not self.has_crc, "a record with a stored CRC-32 read without computing one"
        if self.has_crc and crc != self.record.crc32:
            raise ChecksumError(
                f"{self.where}: storage record fails its CRC-32 check (stored {self.record.crc32:08x}, "
                f"read {crc:08x}): the bytes changed after they were saved",
                path=self.info.relative_path,
                fqn=self.key,
            )


def tensor_meta(ckpt: CheckpointDir, key: str) -> TensorMeta:
    """The tensor entry of ``key``.

    Raises:
        UsageError: ``key`` is not a tensor entry of the checkpoint.
    """
    meta = ckpt.metadata.entries.get(key)
    if not isinstance(meta, TensorMeta):
        raise UsageError(f"{ckpt.path}: {key!r} is not a tensor entry of the checkpoint", fqn=key)
    return meta


def _raw_record(
    key: str, meta: TensorMeta, chunk: ChunkMeta, info: StorageInfo, where: str, ckpt: Any = None
) -> TensorRecord:
    """The record of a safetensors-stored chunk: its whole window, C order; with the zip member and CRC-32
    of a per-rank ``torch.save`` record the window is whole (``ckpt.record_member``), checked as a DCP record's
    (a window that is part of its record: the whole record checked by ``record_member``).

    Raises:
        ChunkError: the window does not hold exactly the chunk's bytes.
        ChecksumError: the per-rank record holding a partial window fails its CRC-32.
    """
    need = chunk.numel * meta.dtype.itemsize
    if info.length != need:
        raise ChunkError(
            f"{where}: stored window is {info.length} bytes, {meta.dtype}{list(chunk.sizes)} needs {need}",
            path=info.relative_path,
            fqn=key,
        )
    raw = TensorRecord(
        meta.dtype.name, chunk.sizes, row_major_stride(chunk.sizes), 0, chunk.numel, 0, compressed_size=need
    )
    member = ckpt.record_member(info, key) if hasattr(ckpt, "record_member") else None
    return raw if member is None else replace(raw, crc32=member.crc32, member=member)


def decode_transforms(ckpt: CheckpointDir, info: StorageInfo, fqn: str, cap: int, *, cap_is_limit: bool) -> bytes:
    """The bytes of ``info``'s window decoded through its stream transforms, at most ``cap`` bytes.

    torch's ``FileSystemReader`` decodes with ``ExtensionRegistry`` (``zstd`` needs
    ``zstandard`` or ``pyzstd``); the stream is read piece by piece and abandoned as soon
    as it passes ``cap``.

    Raises:
        TransformError: unknown or undecodable transform.
        ChunkError: the decoded stream is longer than the metadata allows (``cap_is_limit`` false).
        SizeLimitError: the decoded stream is longer than ``cap`` (``cap_is_limit``: a user-raisable cap).
    """

    where = f"{ckpt.path / info.relative_path}: {fqn!r}"
    try:
        from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

        exts = ExtensionRegistry().from_descriptor_list(list(info.transform_descriptors))
        stream: Any = FileWindow(ckpt.fd(info.relative_path), info.offset, info.length)
        for ex in exts:  # in the listed order, as FileSystemReader.transform_load_stream does
            if not isinstance(ex, StreamTransformExtension):
                raise ValueError(f"{ex.registry_name()} is not a stream transform")
            stream = ex.transform_from(stream)
        out = bytearray()
        while True:
            piece = stream.read(min(1 << 20, cap + 1 - len(out)))
            if not piece:
                break
            out += piece
            if len(out) > cap:
                if cap_is_limit:
                    raise SizeLimitError(
                        f"{where} decodes to more than the cap of {limits.human(cap)}", path=info.relative_path, fqn=fqn
                    )
                raise ChunkError(
                    f"{where} decodes to more than the {cap} bytes its metadata allows (a decompression bomb?)",
                    path=info.relative_path,
                    fqn=fqn,
                )
        return bytes(out)
    except (SizeLimitError, ChunkError):
        raise
    except Exception as e:
        raise TransformError(
            f"{where} uses transform {list(info.transform_descriptors)} that cannot be decoded "
            f"({type(e).__name__}: {str(e)[:80]})",
            path=info.relative_path,
            fqn=fqn,
        ) from e


def locate_chunk(
    ckpt: CheckpointDir, key: str, chunk: ChunkMeta, *, preread: PrereadWindow | None = None
) -> ChunkLocation:
    """Locate and check one stored chunk of tensor ``key`` (see the module docstring).

    Args:
        ckpt: the opened checkpoint directory.
        key: flattened checkpoint key (``model.model.layers.0.mlp.down_proj.weight``).
        chunk: one of the entry's chunks.
        preread: the storage window's bytes, already read: the archive is parsed from them (a
            local ``torch.save`` archive without a stream transform).

    Returns:
        The :class:`ChunkLocation`.

    Raises:
        UsageError: ``key`` is not a tensor entry.
        MetadataError: the chunk has no storage entry.
        PathEscapeError, NotRegularFileError, DataFileError: the data file escapes, is not a
            regular file, is missing, or is too short.
        TransformError: an undecodable stream transform.
        ChecksumError: a small member of the archive fails its CRC-32.
        StorageTupleError: ``data.pkl`` rebuilds the tensor from fields of the wrong types.
        ChunkError: the archive is corrupt, unsafe, read differently by torch, or disagrees
            with the metadata (dtype, shape).
    """
    meta = tensor_meta(ckpt, key)
    info = ckpt.storage_info(key, chunk)
    ckpt.fetch(info)  # a remote checkpoint: one range request of exactly this window (cached)
    file = ckpt.path / info.relative_path
    where = f"{file}: {key!r} chunk at {chunk.offsets}"
    serialization = ckpt.metadata.serialization
    if serialization in ("safetensors", "dcp_safetensors") or (
        serialization == "mixed" and info.relative_path.endswith(".safetensors")  # a safetensors model + DCP optimizer
    ):
        raw = _raw_record(key, meta, chunk, info, where, ckpt)
        return ChunkLocation(
            key, chunk, meta, info, raw, file, FileWindow(ckpt.fd(info.relative_path), info.offset, info.length)
        )
    window: Window
    if info.transform_descriptors:
        cap = chunk.numel * meta.dtype.itemsize + limits.current().max_tensor_pickle_bytes + ARCHIVE_OVERHEAD
        window = BytesWindow(decode_transforms(ckpt, info, key, cap, cap_is_limit=False))
    elif preread is not None:
        assert (preread.start, preread.length) == (info.offset, info.length), "preread window of another chunk"
        window = preread
    else:
        window = FileWindow(ckpt.fd(info.relative_path), info.offset, info.length)
    try:
        record = parse_tensor_archive(window)
    except StorageTupleError as e:
        raise StorageTupleError(f"{where}: {e.message}", path=info.relative_path, fqn=key) from e
    except UnsafePickleError as e:
        raise ChunkError(f"{where}: {e.message}", path=info.relative_path, fqn=key) from e
    except ArchiveChecksumError as e:
        raise ChecksumError(f"{where}: {e}", path=info.relative_path, fqn=key) from e
    except SizeLimitError as e:
        raise ChunkError(f"{where}: {e.message}", path=info.relative_path, fqn=key) from e
    except (ArchiveError, OSError) as e:
        raise ChunkError(
            f"{where}: stored archive is corrupt or not one torch reads the same way ({str(e)[:160]})",
            path=info.relative_path,
            fqn=key,
        ) from e
    if record.deflated and record.storage_numel > chunk.numel:
        # torch's DCP writer saves each chunk with its own storage (it clones views); a compressed
        # record declaring more is inflated into memory only up to what the metadata allows
        raise ChunkError(
            f"{where}: compressed storage record declares {record.storage_numel} elements for a chunk of {chunk.numel}",
            path=info.relative_path,
            fqn=key,
        )
    if record.dtype != meta.dtype.name or record.size != chunk.sizes:
        raise ChunkError(
            f"{where}: stored tensor is {record.dtype}{list(record.size)}, metadata says "
            f"{meta.dtype}{list(chunk.sizes)}",
            path=info.relative_path,
            fqn=key,
        )
    return ChunkLocation(key, chunk, meta, info, record, file, window)
