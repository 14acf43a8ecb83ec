"""Checkpoints written by torch's ``HuggingFaceStorageWriter``: safetensors files as DCP storage.

Source: ``torch/distributed/checkpoint/hf_storage.py`` and ``_hf_utils.py`` (no ``.metadata``;
files ``model-0000K-of-0000N.safetensors`` with an index, or per-rank
``shard-0000R-model-...`` files whose ``__metadata__["DCP_SHARDING_INFO"]`` gives each
tensor's ``saved_offsets``; table in ``docs/design.md`` §1). :func:`load_hf_storage_metadata`
builds the :class:`CheckpointMetadata` torch's ``HuggingFaceStorageReader.read_metadata``
builds (one chunk per stored tensor) from headers read by the bounded
:func:`ckpttool.format.safetensors.read_header`; ``serialization`` is ``"safetensors"``, so
the chunk locator treats a window as the raw record. Torch-free.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ckpttool.errors import MetadataError
from ckpttool.format.files import resolve_inside
from ckpttool.format.jsonfile import unique_pairs
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta
from ckpttool.format.safetensors import SAFETENSORS_TAGS, HeaderError, read_header

__all__ = [
    "HF_INDEX_NAME",
    "hf_storage_files",
    "load_hf_storage_metadata",
    "read_safetensors_header",
    "shard_rank",
]

HF_INDEX_NAME = "model.safetensors.index.json"
_SHARDING_KEY = "DCP_SHARDING_INFO"
_OFFSETS_KEY = "saved_offsets"
_SHARD_RE = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")


def _bad(path: Path, what: str) -> MetadataError:
    return MetadataError(
        f"{path}: not a valid safetensors file ({what})",
        path=path,
        hint="the file is damaged or was not written by safetensors / HuggingFaceStorageWriter",
    )


def _header_error(path: Path, e: HeaderError) -> MetadataError:
    if e.kind == "short":
        return _bad(path, f"{e.size} bytes, shorter than the 8-byte header length")
    if e.kind in ("too_long", "past_end"):
        return _bad(path, f"header length {e.length} exceeds the file ({e.size} bytes) or {e.cap} bytes")
    if e.kind == "truncated":
        return _bad(path, "header truncated")
    if e.kind == "not_json":
        return _bad(path, f"header is not JSON: {str(e.cause)[:80]}")
    return _bad(path, "header is not a JSON object")


def read_safetensors_header(path: Path, size: int | None = None) -> tuple[dict[str, Any], int]:
    """:func:`ckpttool.format.safetensors.read_header` of a checkpoint's safetensors file, refusals as :class:`MetadataError`.

    Args:
        path: the file.
        size: its size in bytes (``stat`` when ``None``).

    Returns:
        ``(header, data_start)``: the parsed header (a dict, duplicate keys refused) and the
        absolute offset of the data region (``8 + N``).

    Raises:
        MetadataError: unreadable, a header length past the file or above
            :func:`~ckpttool.format.safetensors.header_cap`, not UTF-8 JSON, or not a JSON object.
        JsonDepthError, IntegerRangeError: a header past the JSON bounds.
        NotRegularFileError: ``path`` is a FIFO, device, socket or directory.
    """
    try:
        return read_header(path, size)
    except HeaderError as e:
        raise _header_error(path, e) from None
    except OSError as e:
        raise MetadataError(f"{path}: cannot read ({e.strerror})", path=path) from e


#: The DCP path's bounds (``format/unpickler.py``): at most 64 dims, each at most 2^62.
MAX_NDIM = 64
MAX_DIM_SIZE = 2**62
_INT64_MAX = 2**63 - 1


def _int_list(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape or offsets tuple: a list of at most 64 ints in ``[0, 2^62]``; ``None`` otherwise."""
    if (
        not isinstance(value, list)
        or len(value) > MAX_NDIM
        or not all(type(v) is int and 0 <= v <= MAX_DIM_SIZE for v in value)
    ):
        return None
    return tuple(value)


def _extent_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why a tensor of ``shape`` cannot exist in torch (its strides or bytes past int64), else ``None``.

    Checked on the non-zero dims: a ``[0, 2**70]`` tensor holds no bytes, but torch cannot
    describe it (``dcp.load`` overflows on its strides).
    """
    n = itemsize
    for d in shape:
        if d:
            n *= d
            if n > _INT64_MAX:
                return f"shape {list(shape)} spans more than 2^63 bytes"
    return None


def hf_storage_files(path: Path) -> list[str]:
    """The safetensors files that make up the checkpoint in ``path`` (names, sorted).

    Consolidated ``model-*.safetensors`` files win over per-rank ``shard-*`` files in the
    same directory (the consolidation's inputs are in ``sharded/``, which is not read).
    Symlinks are listed like files; reading one that leaves the directory is refused
    (:func:`ckpttool.format.files.resolve_inside`).
    """
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") and not n.startswith("."))
    except OSError:
        return []
    consolidated = [n for n in names if not _SHARD_RE.match(n)]
    return consolidated or names


def shard_rank(name: str) -> int | None:
    """Writing rank of a ``shard-0000R-model-...safetensors`` file (``R - 1``), else ``None``."""
    m = _SHARD_RE.match(os.path.basename(name))
    return int(m.group(1)) - 1 if m else None


def load_hf_storage_metadata(path: Path) -> CheckpointMetadata:
    """Build the DCP metadata of a ``HuggingFaceStorageWriter`` checkpoint from its safetensors headers.

    Args:
        path: the directory holding the ``*.safetensors`` files.

    Returns:
        A :class:`CheckpointMetadata` with ``serialization="safetensors"``: one chunk per
        stored tensor (offsets from ``DCP_SHARDING_INFO``, else zeros), its storage window
        the tensor's ``data_offsets`` made absolute; no byte items, no planner data.

    Raises:
        MetadataError: no safetensors file, a malformed header (unknown dtype, a negative or
            non-integer shape, ``data_offsets`` outside the file or not matching the shape,
            bad sharding info, two tensors whose ``data_offsets`` overlap), or two files storing
            the same chunk of a key.
    """
    files = hf_storage_files(path)
    if not files:
        raise MetadataError(f"{path}: no .metadata and no .safetensors files", path=path)
    found = _Found()
    for name in files:
        _read_file(path, name, found)
    entries: dict[str, TensorMeta | BytesMeta] = {}
    for key, cs in found.chunks.items():
        ndim = len(cs[0].sizes)
        if any(len(c.sizes) != ndim for c in cs):
            raise MetadataError(f"{path}: chunks of {key!r:.80} have different numbers of dims", path=path, fqn=key)
        size_ = tuple(max(c.offsets[d] + c.sizes[d] for c in cs) for d in range(ndim))
        entries[key] = TensorMeta(DType(found.dtypes[key]), size_, tuple(cs))
    return CheckpointMetadata(entries=entries, storage=found.storage, serialization="safetensors")


class _Found:
    """What the files read so far hold: chunks and dtype per key, the storage window per chunk."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[ChunkMeta]] = {}
        self.dtypes: dict[str, str] = {}
        self.storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}


def _read_file(path: Path, name: str, found: _Found) -> None:
    """Add the tensors of the safetensors file ``name`` in ``path`` to ``found`` (checks in header order)."""
    p = path / name
    try:
        size = resolve_inside(path, name, what="safetensors file").stat().st_size
    except OSError as e:
        raise MetadataError(f"{p}: cannot read ({e.strerror})", path=p) from e
    header, data_start = read_safetensors_header(p, size)
    sharding = _sharding_info(p, header.pop("__metadata__", None))
    data_len = size - data_start
    spans: list[tuple[int, int, str]] = []
    for key, rec in header.items():
        dtype, shape, begin, end = _tensor_entry(p, key, rec, data_len)
        if end > begin:
            spans.append((begin, end, key))
        offsets: tuple[int, ...] = (0,) * len(shape)
        if key in sharding:
            info = sharding[key]
            got = _int_list(info.get(_OFFSETS_KEY)) if isinstance(info, dict) else None
            if got is None or len(got) != len(shape) or any(o + d > MAX_DIM_SIZE for o, d in zip(got, shape)):
                raise _bad(p, f"{_SHARDING_KEY} of {key!r:.80} is not a list of {len(shape)} offsets below 2^62")
            offsets = got
        if found.dtypes.setdefault(key, dtype) != dtype:
            raise _bad(p, f"{key!r:.80} is {dtype} here but {found.dtypes[key]} in another file")
        if (key, offsets) in found.storage:
            raise _bad(p, f"{key!r:.80} chunk at {list(offsets)} is stored in two files")
        found.chunks.setdefault(key, []).append(ChunkMeta(offsets, shape))
        found.storage[(key, offsets)] = StorageInfo(name, data_start + begin, end - begin)
    spans.sort()
    for (_, prev_end, prev_key), (begin, _, key) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise _bad(p, f"{key!r:.80} data_offsets overlap those of {prev_key!r:.80}")


def _sharding_info(p: Path, meta: Any) -> dict[str, Any]:
    """``DCP_SHARDING_INFO`` of a header's ``__metadata__`` (``{}`` without it), parsed and checked."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(p, "__metadata__ is not a string map")
    text = meta.get(_SHARDING_KEY)
    if text is None:
        return {}
    try:
        sharding = json.loads(text, object_pairs_hook=unique_pairs)
    except (ValueError, RecursionError):
        raise _bad(p, f"{_SHARDING_KEY} is not JSON") from None
    if not isinstance(sharding, dict):
        raise _bad(p, f"{_SHARDING_KEY} is not a JSON object")
    return sharding


def _tensor_entry(p: Path, key: str, rec: Any, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of header entry ``key``, checked against the ``data_len``-byte data region."""
    if not isinstance(rec, dict):
        raise _bad(p, f"entry {key!r:.80} is not an object")
    tag = rec.get("dtype")
    dtype = SAFETENSORS_TAGS.get(tag) if isinstance(tag, str) else None
    if dtype is None:
        raise _bad(p, f"{key!r:.80} has dtype {rec.get('dtype')!r:.20} unknown to ckpttool")
    shape = _int_list(rec.get("shape"))
    span = _int_list(rec.get("data_offsets"))
    if shape is None or span is None or len(span) != 2:
        raise _bad(p, f"{key!r:.80} has a malformed shape or data_offsets (at most {MAX_NDIM} dims of at most 2^62)")
    begin, end = span
    problem = _extent_problem(shape, DType(dtype).itemsize)
    if problem is not None:
        raise _bad(p, f"{key!r:.80}: {problem}")
    nbytes = DType(dtype).itemsize * math.prod(shape)
    if begin > end or end > data_len or end - begin != nbytes:
        raise _bad(
            p,
            f"{key!r:.80} data_offsets [{begin}, {end}) do not hold {dtype}{list(shape)} "
            f"({nbytes} bytes) inside the {data_len}-byte data region",
        )
    return dtype, shape, begin, end
