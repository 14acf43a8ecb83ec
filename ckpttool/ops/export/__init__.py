"""Export DCP checkpoints to Hugging Face safetensors or PEFT LoRA adapters (``docs/export.md``).

Public API::

    from ckpttool.ops.export import ExportOptions, export_checkpoint
    result = export_checkpoint("ckpt/step_1000", "hf_out", ExportOptions(save_dtype="preserve"))

Modules: :mod:`.rules` (YAML key/expert/LoRA rules), :mod:`.select` (which tensors, which names),
:mod:`.plan` (pure planning), :mod:`.formats` (the output formats, registered plug-ins),
:mod:`.experts` (EP expert order), :mod:`.lora` (adapter config), :mod:`.execute` (the export).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# the built-in output formats register themselves (light: their planning imports come on use)
from ckpttool.ops.export import formats  # noqa: F401

if TYPE_CHECKING:
    from ckpttool.ops.export.execute import ExportOptions, ExportResult, ProgressFn, export_checkpoint, masters_note
    from ckpttool.ops.export.plan import SAVE_DTYPES, ExportPlan, build_plan, select_sources
    from ckpttool.ops.export.rules import ExportRules, load_rules

#: public name -> its module, imported on first use (the CLI imports the light ``formats`` registry only)
_LAZY = {
    "ExportOptions": "execute",
    "ExportResult": "execute",
    "ProgressFn": "execute",
    "export_checkpoint": "execute",
    "masters_note": "execute",
    "SAVE_DTYPES": "plan",
    "ExportPlan": "plan",
    "build_plan": "plan",
    "select_sources": "plan",
    "ExportRules": "rules",
    "load_rules": "rules",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "SAVE_DTYPES",
    "ExportOptions",
    "ExportPlan",
    "ExportResult",
    "ExportRules",
    "ProgressFn",
    "build_plan",
    "export_checkpoint",
    "load_rules",
    "masters_note",
    "select_sources",
]
