"""ckpttool: inspect, validate, export, reshard and replay PyTorch Distributed Checkpoints.

Public API (names load lazily, so ``import ckpttool`` does not import torch)::

    import ckpttool
    with ckpttool.open_checkpoint("ckpt/") as ckpt:                 # .metadata, catalog, layout
        ov = ckpttool.inspect(ckpt)                                  # inspect
        out = ckpttool.export_checkpoint(ckpt, "hf/", ckpttool.ExportOptions())
        w = ckpt.reader.read_tensor("model.lm_head.weight")          # reassembled from its chunks
    res = ckpttool.validate("ckpt/", ckpttool.ValidateOptions(strict=True))  # damage -> findings

Layers (``docs/design.md`` §5, held by import-linter): :mod:`ckpttool.cli` >
:mod:`ckpttool.commands` > :mod:`ckpttool.ui` > :mod:`ckpttool.ops` > :mod:`ckpttool.model` >
:mod:`ckpttool.optim_state` | :mod:`ckpttool.layouts` > :mod:`ckpttool.format` > :mod:`ckpttool.engine` >
:mod:`ckpttool.errors`.
"""

from __future__ import annotations

from ckpttool._lazy import lazy_attributes

__version__ = "0.1.0"

_WHERE = {
    "CheckpointDir": "ckpttool.format",
    "CheckpointReader": "ckpttool.format",
    "Catalog": "ckpttool.model",
    "Checkpoint": "ckpttool.model",
    "build_catalog": "ckpttool.model",
    "open_checkpoint": "ckpttool.model",
    "OpenOptions": "ckpttool.model.checkpoint",
    "LayoutDeclaration": "ckpttool.layouts",
    "ResolvedLayout": "ckpttool.layouts",
    "LayoutRecord": "ckpttool.layouts.record",
    "InspectOptions": "ckpttool.ops.inspect",
    "InspectResult": "ckpttool.ops.inspect",
    "inspect": "ckpttool.ops.inspect",
    "ValidateOptions": "ckpttool.ops.validate",
    "ValidationResult": "ckpttool.ops.validate",
    "validate": "ckpttool.ops.validate",
    "ExportOptions": "ckpttool.ops.export",
    "ExportResult": "ckpttool.ops.export",
    "export_checkpoint": "ckpttool.ops.export",
    "ReshardOptions": "ckpttool.ops.reshard",
    "ReshardResult": "ckpttool.ops.reshard",
    "DiffOptions": "ckpttool.ops.diff",
    "DiffResult": "ckpttool.ops.diff",
    "diff_checkpoints": "ckpttool.ops.diff",
    "ManifestOptions": "ckpttool.ops.manifest",
    "ManifestResult": "ckpttool.ops.manifest",
    "write_manifest": "ckpttool.ops.manifest",
    "check_against_manifest": "ckpttool.ops.manifest",
    "ManifestCheck": "ckpttool.ops.manifest",
    "ImportOptions": "ckpttool.ops.import_hf",
    "ImportResult": "ckpttool.ops.import_hf",
    "import_hf": "ckpttool.ops.import_hf",
    "reshard": "ckpttool.ops.reshard",
    "StampOptions": "ckpttool.ops.stamp",
    "StampResult": "ckpttool.ops.stamp",
    "stamp": "ckpttool.ops.stamp",
    "ReplayOptions": "ckpttool.ops.replay",
    "ReplayResult": "ckpttool.ops.replay",
    "replay_step": "ckpttool.ops.replay",
    "StatsOptions": "ckpttool.ops.stats",
    "StatsResult": "ckpttool.ops.stats",
    "collect_stats": "ckpttool.ops.stats",
    "SampleOptions": "ckpttool.ops.sample",
    "SampleResult": "ckpttool.ops.sample",
    "write_sample": "ckpttool.ops.sample",
    "CkptError": "ckpttool.errors",
}

__all__ = sorted(_WHERE) + ["__version__"]


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
