"""``ckpttool stats``: streaming per-tensor, per-layer and per-expert statistics of checkpoints
(model weights, FP32 masters, Adam moments, the last update's size) and their change along a run.

The result records are declared once, in :mod:`ckpttool.ops.stats.result` (its ``__all__``)."""

from ckpttool.ops.stats import result
from ckpttool.ops.stats.result import *  # noqa: F403  (the result records, ``result.__all__``)
from ckpttool.ops.stats.run import MAX_CHECKPOINTS, StatsOptions, collect_stats, layer_of, module_of

__all__ = ["MAX_CHECKPOINTS", "StatsOptions", "collect_stats", "layer_of", "module_of"]
__all__ += result.__all__
