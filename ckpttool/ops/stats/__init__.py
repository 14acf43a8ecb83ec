"""``ckpttool stats``: streaming per-tensor, per-layer and per-expert statistics of checkpoints
(model weights, FP32 masters, Adam moments, the next update's size) and their change along a run."""

from ckpttool.ops.stats.result import (
    CheckpointStats,
    ExpertNorms,
    GroupStats,
    LayerChange,
    StatsResult,
    TensorValueStats,
    UpdateStats,
)
from ckpttool.ops.stats.run import MAX_CHECKPOINTS, StatsOptions, collect_stats, layer_of, module_of

__all__ = [
    "MAX_CHECKPOINTS",
    "CheckpointStats",
    "ExpertNorms",
    "GroupStats",
    "LayerChange",
    "StatsOptions",
    "StatsResult",
    "TensorValueStats",
    "UpdateStats",
    "collect_stats",
    "layer_of",
    "module_of",
]
