"""The format layer: DCP and safetensors files, read safely and written atomically.

Modules: :mod:`.metadata` (typed ``.metadata`` model, dtype names), :mod:`.unpickler`
(allow-list unpickling, object-graph bounds), :mod:`.archive` (``torch.save`` zip archives,
read as strictly as torch reads them), :mod:`.files` (confined, regular, capped file opening),
:mod:`.limits` (the caps), :mod:`.jsonfile` (bounded JSON),
:mod:`.directory` (the checkpoint directory and its data files), :mod:`.locator` (the one chunk
check), :mod:`.reader` (tensors and byte items), :mod:`.tiling` (chunk boxes), :mod:`.copy`
(verbatim byte copies), :mod:`.writer` (DCP output), :mod:`.safetensors` (safetensors headers
and shards), :mod:`.atomic` (atomic output directories). Nothing here imports torch at import
time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool._lazy import lazy_attributes

# Names load lazily: the CLI imports only what a command needs (start-up time).
_WHERE = {
    "DATA_FILE_RE": "ckpttool.format.directory",
    "METADATA_NAME": "ckpttool.format.directory",
    "CheckpointDir": "ckpttool.format.directory",
    "rank_of_file": "ckpttool.format.directory",
    "ChunkLocation": "ckpttool.format.locator",
    "locate_chunk": "ckpttool.format.locator",
    "BytesMeta": "ckpttool.format.metadata",
    "CheckpointMetadata": "ckpttool.format.metadata",
    "ChunkMeta": "ckpttool.format.metadata",
    "DType": "ckpttool.format.metadata",
    "StorageInfo": "ckpttool.format.metadata",
    "TensorMeta": "ckpttool.format.metadata",
    "CheckpointReader": "ckpttool.format.reader",
    "load_saved_object": "ckpttool.format.reader",
    "tiling_problem": "ckpttool.format.tiling",
    "load_metadata": "ckpttool.format.unpickler",
    "parse_metadata_bytes": "ckpttool.format.unpickler",
}

__all__ = [
    "BytesMeta",
    "CheckpointDir",
    "CheckpointMetadata",
    "CheckpointReader",
    "ChunkLocation",
    "ChunkMeta",
    "DATA_FILE_RE",
    "DType",
    "METADATA_NAME",
    "StorageInfo",
    "TensorMeta",
    "load_metadata",
    "load_saved_object",
    "locate_chunk",
    "parse_metadata_bytes",
    "rank_of_file",
    "tiling_problem",
]

if TYPE_CHECKING:
    from ckpttool.format.directory import DATA_FILE_RE, METADATA_NAME, CheckpointDir, rank_of_file
    from ckpttool.format.locator import ChunkLocation, locate_chunk
    from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta
    from ckpttool.format.reader import CheckpointReader, load_saved_object
    from ckpttool.format.tiling import tiling_problem
    from ckpttool.format.unpickler import load_metadata, parse_metadata_bytes


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
