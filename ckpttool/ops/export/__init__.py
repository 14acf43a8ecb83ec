"""Export DCP checkpoints to Hugging Face safetensors or PEFT LoRA adapters (``docs/export.md``).

Public API::

    from ckpttool.ops.export import ExportOptions, export_checkpoint
    result = export_checkpoint("ckpt/step_1000", "hf_out", ExportOptions(save_dtype="preserve"))

Modules: :mod:`.rules` (YAML key/expert/LoRA rules), :mod:`.plan` (pure planning),
:mod:`.experts` (EP expert order), :mod:`.lora` (adapter config),
:mod:`.execute` (the export).
"""

from ckpttool.ops.export.execute import ExportOptions, ExportResult, ProgressFn, export_checkpoint
from ckpttool.ops.export.plan import SAVE_DTYPES, ExportPlan, build_plan, select_sources
from ckpttool.ops.export.rules import ExportRules, load_rules

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
    "select_sources",
]
