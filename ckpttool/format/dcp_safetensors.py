"""DCP checkpoints written with ``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)``.

Source: ``torch/distributed/checkpoint/filesystem.py`` (``_write_files_from_queue``): each
``__R_N.distcp`` holds the byte items first (``torch.save`` archives, as in the default
format), then one safetensors blob with every tensor chunk of the file under its fqn and
``__metadata__["DCP_SHARDING_INFO"]`` giving each tensor's ``saved_offsets``. ``.metadata``
does not say which format was used: every tensor chunk's ``_StorageInfo`` has the blob's start
as ``offset`` and ``numel * itemsize`` as ``length`` (a ``torch.save`` archive is always longer
than its values, so the two formats cannot be confused). torch's own ``FileSystemReader``
cannot load these files (it ``torch.load``\\ s the window).

:func:`resolve_safetensors_windows` reads each file's blob header (bounded as
:func:`ckpttool.format.safetensors.read_header`), checks every chunk against it (dtype, shape,
``saved_offsets``, one entry per chunk) and rewrites each chunk's storage to the exact window of
its values, with ``serialization="dcp_safetensors"``: the chunk locator then reads the window as
the raw record, as for ``HuggingFaceStorageWriter`` storage. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.engine.io import ShortReadError, read_exact
from ckpttool.errors import MetadataError, TransformError
from ckpttool.format.hf_storage import _OFFSETS_KEY, _sharding_info, _tensor_entry
from ckpttool.format.jsonfile import check_json_graph, unique_pairs
from ckpttool.format.metadata import CheckpointMetadata, StorageInfo, TensorMeta
from ckpttool.format.safetensors import header_cap

if TYPE_CHECKING:
    from ckpttool.format.directory import CheckpointDir

__all__ = ["DCP_SAFETENSORS", "is_safetensors_serialized", "resolve_safetensors_windows"]

#: ``CheckpointMetadata.serialization`` of a resolved checkpoint.
DCP_SAFETENSORS = "dcp_safetensors"

_Key = tuple[str, tuple[int, ...] | None]
#: The data region's length for header checks: any window the header's offsets give (2^62, torch's size limit).
_UNBOUNDED = 1 << 62


def is_safetensors_serialized(md: CheckpointMetadata) -> bool:
    """Whether ``.metadata``'s tensor storage is that of the SAFETENSORS serialization format.

    True when there is at least one tensor chunk with values and every tensor chunk's window is
    exactly ``numel * itemsize`` bytes (a ``torch.save`` archive never is).
    """
    if md.serialization != "torch_save":
        return False
    seen = False
    for key, meta in md.entries.items():
        if not isinstance(meta, TensorMeta):
            continue
        isz = meta.dtype.itemsize
        for c in meta.chunks:
            info = md.storage.get((key, c.offsets))
            if info is None:
                continue
            if info.length != c.numel * isz:
                return False
            seen = seen or c.numel > 0
    return seen


def _bad(ckpt: CheckpointDir, rel: str, what: str) -> MetadataError:
    return MetadataError(
        f"{ckpt.path / rel}: safetensors-serialized DCP data file: {what}",
        path=rel,
        hint="the data file is damaged or belongs to another .metadata; use an earlier checkpoint",
    )


def _transformed(ckpt: CheckpointDir, key: str, info: StorageInfo) -> TransformError:
    """A tensor chunk of a safetensors blob that names a stream transform: torch's writer passes no tensor byte of
    this format through its ``_extensions`` (it writes an empty stream per tensor, then the blob as it is), and no
    torch reader loads the result."""
    return TransformError(
        f"{ckpt.path / info.relative_path}: {key!r:.80} is safetensors-serialized with stream transform "
        f"{list(info.transform_descriptors)}, which torch's writer applies to no tensor data in that format "
        "(torch's readers cannot load it either)",
        path=info.relative_path,
        fqn=key,
        hint="save it again without FileSystemWriter(_extensions=...), or with the default serialization (torch.save archives)",
    )


def _blob_header(ckpt: CheckpointDir, rel: str, at: int) -> tuple[dict[str, Any], int, int]:
    """``(header, data_start, data_len)`` of the safetensors blob starting at ``at`` in data file ``rel``."""
    size = ckpt.file_size(rel)
    fd = ckpt.fd(rel)
    if at + 8 > size:
        raise _bad(ckpt, rel, f"the safetensors blob at byte {at} is past the file's end ({size} bytes)")
    ckpt.fetch(StorageInfo(rel, at, 8))
    try:
        (n,) = struct.unpack("<Q", read_exact(fd, 8, at))
        if n > header_cap() or at + 8 + n > size:
            raise _bad(ckpt, rel, f"safetensors header length {n} at byte {at} is past the file or the cap")
        ckpt.fetch(StorageInfo(rel, at + 8, n))
        raw = read_exact(fd, n, at + 8)
    except ShortReadError:
        raise _bad(ckpt, rel, "the file ended inside the safetensors header") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
    except (ValueError, RecursionError):
        raise _bad(ckpt, rel, f"no safetensors header at byte {at} (not UTF-8 JSON)") from None
    check_json_graph(header, str(ckpt.path / rel))
    if not isinstance(header, dict):
        raise _bad(ckpt, rel, f"the safetensors header at byte {at} is not a JSON object")
    return header, at + 8 + n, size - (at + 8 + n)


def _file_windows(
    ckpt: CheckpointDir, rel: str, keys: list[tuple[str, TensorMeta, StorageInfo, tuple[int, ...]]]
) -> dict[_Key, StorageInfo]:
    """The exact value window of every chunk ``keys`` stores in data file ``rel``."""
    starts = {info.offset for _, _, info, _ in keys}
    if len(starts) != 1:
        raise _bad(ckpt, rel, f"tensor chunks point at {len(starts)} different offsets, expected one safetensors blob")
    header, data_start, _ = _blob_header(ckpt, rel, starts.pop())
    shown = Path(ckpt.path / rel)
    sharding = _sharding_info(shown, header.pop("__metadata__", None))
    out: dict[_Key, StorageInfo] = {}
    used: set[str] = set()
    for key, meta, info, offsets in keys:
        rec = header.get(key)
        if rec is None or key in used:
            raise _bad(ckpt, rel, f"{key!r:.80} chunk at {list(offsets)} is not in the file's safetensors header")
        used.add(key)
        # not bounded by the file's size: a file cut short after its header (a crashed or still-running save) has
        # windows past its end, which the readers and validate's S003 name as such (E300), not as a bad header
        dtype, shape, begin, end = _tensor_entry(shown, key, rec, _UNBOUNDED)
        saved = sharding.get(key, {}).get(_OFFSETS_KEY) if isinstance(sharding.get(key), dict) else None
        if dtype != meta.dtype.name:
            raise _bad(ckpt, rel, f"{key!r:.80} is {dtype} in the file, .metadata says {meta.dtype}")
        chunk_sizes = next(c.sizes for c in meta.chunks if c.offsets == offsets)
        if shape != chunk_sizes or (saved is not None and tuple(saved) != offsets):
            raise _bad(
                ckpt,
                rel,
                f"{key!r:.80} is {list(shape)} at {saved} in the file, .metadata's chunk is "
                f"{list(chunk_sizes)} at {list(offsets)}",
            )
        out[(key, offsets)] = StorageInfo(rel, data_start + begin, end - begin, info.transform_descriptors)
    return out


def resolve_safetensors_windows(ckpt: CheckpointDir, md: CheckpointMetadata) -> CheckpointMetadata:
    """``md`` with each tensor chunk's storage the exact window of its values (see the module docstring).

    Args:
        ckpt: the opened directory (its data files are read: one header per file).
        md: the parsed ``.metadata`` (:func:`is_safetensors_serialized` true).

    Returns:
        A copy with the chunk windows rewritten and ``serialization="dcp_safetensors"``;
        byte items keep their windows (``torch.save`` archives).

    Raises:
        MetadataError: a file without a safetensors blob where ``.metadata`` puts it, or a
            chunk the blob's header does not hold as ``.metadata`` says (dtype, shape, offsets).
        TransformError: a tensor chunk names a stream transform (``_extensions``), which this format cannot hold.
        DataFileError, PathEscapeError: a missing, short or escaping data file.
    """
    per_file: dict[str, list[tuple[str, TensorMeta, StorageInfo, tuple[int, ...]]]] = {}
    for key, meta in md.entries.items():
        if not isinstance(meta, TensorMeta):
            continue
        for c in meta.chunks:
            info = md.storage.get((key, c.offsets))
            if info is not None and info.transform_descriptors:
                raise _transformed(ckpt, key, info)
            if info is not None:
                per_file.setdefault(info.relative_path, []).append((key, meta, info, c.offsets))
    for key, offsets, info in md.replicas:  # a use_collectives=False save: the higher ranks' copies, in their blobs
        replicated = md.entries.get(key)
        if isinstance(replicated, TensorMeta) and offsets is not None:
            per_file.setdefault(info.relative_path, []).append((key, replicated, info, offsets))
    windows = {rel: _file_windows(ckpt, rel, keys) for rel, keys in per_file.items()}
    storage = dict(md.storage)
    for k, info in storage.items():
        storage[k] = windows.get(info.relative_path, {}).get(k, info)
    replicas = tuple(
        (key, offsets, windows.get(info.relative_path, {}).get((key, offsets), info))
        for key, offsets, info in md.replicas
    )
    return dataclasses.replace(md, storage=storage, replicas=replicas, serialization=DCP_SAFETENSORS)
