"""Safe reading of PyTorch Distributed Checkpoint directories (see DESIGN.md sections 1, 6, 7)."""

from .model import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta
from .reader import CheckpointDir, CheckpointReader, load_saved_object, rank_of_file, tiling_problem
from .unpickler import load_metadata, parse_metadata_bytes

__all__ = [
    "BytesMeta",
    "CheckpointDir",
    "CheckpointMetadata",
    "CheckpointReader",
    "ChunkMeta",
    "DType",
    "StorageInfo",
    "TensorMeta",
    "load_metadata",
    "load_saved_object",
    "parse_metadata_bytes",
    "rank_of_file",
    "tiling_problem",
]
