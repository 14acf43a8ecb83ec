"""The format layer: DCP and safetensors files, read safely and written atomically.

Modules: :mod:`.metadata` (typed ``.metadata`` model, dtype names), :mod:`.unpickler`
(allow-list unpickling), :mod:`.archive` (``torch.save`` zip archives), :mod:`.directory`
(confined data files), :mod:`.locator` (the one chunk check), :mod:`.reader` (tensors and
byte items), :mod:`.tiling` (chunk boxes), :mod:`.copy` (verbatim byte copies),
:mod:`.writer` (DCP output), :mod:`.safetensors` (safetensors headers and shards),
:mod:`.atomic` (atomic output directories). Nothing here imports torch at import time.
"""

from ckpttool.format.directory import DATA_FILE_RE, METADATA_NAME, CheckpointDir, rank_of_file
from ckpttool.format.locator import ChunkLocation, locate_chunk
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta
from ckpttool.format.reader import CheckpointReader, load_saved_object
from ckpttool.format.tiling import tiling_problem
from ckpttool.format.unpickler import load_metadata, parse_metadata_bytes

__all__ = [
    "DATA_FILE_RE",
    "METADATA_NAME",
    "BytesMeta",
    "CheckpointDir",
    "CheckpointMetadata",
    "CheckpointReader",
    "ChunkLocation",
    "ChunkMeta",
    "DType",
    "StorageInfo",
    "TensorMeta",
    "load_metadata",
    "load_saved_object",
    "locate_chunk",
    "parse_metadata_bytes",
    "rank_of_file",
    "tiling_problem",
]
