"""``replay-step``: replay the next optimizer step from a checkpoint and compare with a reference.

Public API (``docs/replay.md``): :func:`replay_step` returns a :class:`ReplayResult`.
Modules: :mod:`.plan` (what to replay, torch-free), :mod:`.grads` (gradient file and
seeded generator), :mod:`.compare` (tolerance), :mod:`.run` (the replay).
"""

from __future__ import annotations

from ckpttool.ops.replay.run import (
    DEVICE_CHOICES,
    ParamResult,
    ReplayOptions,
    ReplayResult,
    check_tolerance,
    replay_step,
    resolve_device,
)

__all__ = [
    "DEVICE_CHOICES",
    "ParamResult",
    "ReplayOptions",
    "ReplayResult",
    "check_tolerance",
    "replay_step",
    "resolve_device",
]
