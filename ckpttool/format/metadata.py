"""Typed, torch-free model of a DCP ``.metadata`` file, and dtype names.

These frozen dataclasses mirror torch's ``torch/distributed/checkpoint/metadata.py``
(``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
``BytesStorageMetadata``, ``MetadataIndex``) and ``filesystem._StorageInfo``, but
hold only validated plain values: shapes are ``tuple[int, ...]``, dtypes are
:class:`DType` (a name, no torch import needed). The native column reader
(:mod:`ckpttool.format.mdscan`) or the safe unpickler in :mod:`ckpttool.format.unpickler`
produces them; nothing else in ckpttool reads the pickle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckpttool.errors import UsageError

__all__ = [
    "FLOAT8_DTYPES",
    "FLOATING_DTYPES",
    "TRAINABLE_DTYPES",
    "dtype_name",
    "DType",
    "ChunkMeta",
    "TensorMeta",
    "BytesMeta",
    "StorageInfo",
    "CheckpointMetadata",
    "RankShards",
    "DTYPE_ITEMSIZE",
]

# torch dtype name -> bytes per element (torch/_tensor_str and c10/core/ScalarType.h).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    # bit-packed, quantized and sub-byte shell dtypes (itemsize as torch reports it)
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    **{f"int{n}": 1 for n in range(1, 8)},
    **{f"uint{n}": 1 for n in range(1, 8)},
}
#: The float8 dtype names torch has (``torch.float8_*``), in torch's order.
FLOAT8_DTYPES: tuple[str, ...] = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
#: Floating-point dtype names (what a ``--save-dtype`` cast applies to).
FLOATING_DTYPES: frozenset[str] = frozenset({"float64", "float32", "float16", "bfloat16", *FLOAT8_DTYPES})
#: Dtypes a tensor that requires grad can have (torch refuses ``requires_grad`` on any other): what an
#: optimizer steps. A model tensor stored in another dtype while it has optimizer state is misrecorded.
TRAINABLE_DTYPES: frozenset[str] = FLOATING_DTYPES | {"complex32", "complex64", "complex128"}


@dataclass(frozen=True, slots=True)
class DType:
    """A torch dtype by name (``"bfloat16"``), usable without importing torch."""

    name: str

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.name]

    @property
    def is_floating_point(self) -> bool:
        return self.name in FLOATING_DTYPES

    def to_torch(self) -> Any:
        """The ``torch.dtype`` of this name (imports torch)."""
        import torch

        return getattr(torch, self.name)

    @classmethod
    def from_torch(cls, dtype: Any) -> DType:
        return cls(str(dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return self.name


class ChunkMeta(NamedTuple):
    """One stored chunk of a tensor: its ``offsets`` into and ``sizes`` within the global tensor.

    A ``NamedTuple`` (immutable, and cheap to build for 10^5-10^6 chunks).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor entry: global ``size``, ``dtype`` and its stored ``chunks``."""

    dtype: DType
    size: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class BytesMeta:
    """A byte item: a ``torch.save``'d Python object."""


class StorageInfo(NamedTuple):
    """Where one chunk or byte item lives: ``relative_path`` and ``[offset, offset+length)``."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankShards:
    """What the file names of a ``HuggingFaceStorageWriter(save_distributed=True)`` folder say of its completeness.

    torch records no world size and no global shape there (``hf_storage.py``, ``_hf_utils.py``): a tensor's size is
    the largest extent of the pieces present, so a last rank's files deleted leave a smaller model that tiles.

    Attributes:
        ranks: the writing ranks (0-based, ``shard-0000R`` is rank ``R - 1``) whose files are present, sorted.
        verified_by: the folder of torch's consolidated copy (``enable_consolidation``) whose keys and full shapes
            the shards were found to equal; ``None``: not proven.
        index_gaps: ``(rank, file index)`` of a model file index some ranks wrote and this rank did not.
    """

    ranks: tuple[int, ...]
    verified_by: str | None = None
    index_gaps: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "verified_by": self.verified_by,
            "index_gaps": [list(g) for g in self.index_gaps],
        }


@dataclass(frozen=True)
class CheckpointMetadata:
    """The validated content of ``.metadata``.

    Attributes:
        entries: flattened key -> :class:`TensorMeta` or :class:`BytesMeta`, in file order.
        storage: ``(fqn, chunk offsets or None)`` -> :class:`StorageInfo`: a dict, or (native column reader,
            parsed-metadata cache) a read-only :class:`~ckpttool.format.mdstorage.StorageTable` over columns.
        planner_data: flattened key -> tuple path in the original nested state dict, or ``{}``.
        version: DCP metadata version string (``"1.0.0"``) or ``None``.
        checkpoint_id: the path the checkpoint was saved to, as a string, if recorded.
        save_id: the save's UUID, if recorded.
        serialization: how chunks are stored: ``"torch_save"`` (``FileSystemWriter``: each chunk
            a ``torch.save`` archive) or ``"safetensors"`` (``HuggingFaceStorageWriter``: each
            chunk's window is its raw little-endian C-order bytes, :mod:`ckpttool.format.hf_storage`).
        replicas: ``(fqn, chunk offsets or None, storage)`` of the copies a ``use_collectives=False`` save's
            higher ranks wrote of a chunk or byte item a lower rank wrote too (:mod:`.rank_local`): not read
            (``storage`` names the lowest rank's), but each rank's ``dcp.load`` reads its own, so they are
            data files of the checkpoint all the same.
        shards: a ``HuggingFaceStorageWriter(save_distributed=True)`` folder's per-rank files (:class:`RankShards`:
            the ranks present, and the consolidated copy that proved the shapes, if any); ``None`` otherwise.
        writer: the storage writer the pickle names when not torch's: ``"olmo-core"`` where it resolves
            OLMo-core's ``olmo_core.distributed.checkpoint.filesystem._StorageInfo`` (its
            ``RemoteFileSystemWriter``, which every OLMo-core save goes through); ``None``: torch's own.
    """

    entries: dict[str, TensorMeta | BytesMeta]
    storage: Mapping[tuple[str, tuple[int, ...] | None], StorageInfo]
    planner_data: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    version: str | None = None
    checkpoint_id: str | None = None
    save_id: str | None = None
    serialization: str = "torch_save"
    replicas: tuple[tuple[str, tuple[int, ...] | None, StorageInfo], ...] = ()
    writer: str | None = None
    shards: RankShards | None = None

    def storage_for(self, fqn: str, chunk: ChunkMeta | None = None) -> StorageInfo | None:
        """Storage info of a tensor chunk (``chunk`` given) or of a byte item."""
        return self.storage.get((fqn, chunk.offsets if chunk is not None else None))


_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float64": "float64",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}


def dtype_aliases(name: str) -> tuple[str, ...]:
    """The other names :func:`dtype_name` reads as the canonical ``name`` (``"float16"`` -> ``("fp16", "f16",
    "half")``), in the alias table's order; ``()`` for a name not in the table."""
    return tuple(k for k, v in _DTYPE_ALIASES.items() if v == name and k != name)


def dtype_name(dtype: Any) -> str:
    """Canonical name (``"float32"``, ``"bfloat16"``, ...) of a dtype given as ``torch.dtype`` or string.

    Args:
        dtype: ``torch.bfloat16``, ``"torch.bfloat16"``, ``"bfloat16"`` or ``"bf16"`` (any case).

    Returns:
        The canonical name; names not in the alias table are returned without a ``torch.`` prefix.

    Raises:
        UsageError: ``dtype`` is neither a string nor a dtype-like object.
    """
    text = str(dtype).strip().lower()
    if not text:
        raise UsageError(f"empty dtype name {dtype!r}", hint="use float32 or bfloat16")
    text = text.removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)
