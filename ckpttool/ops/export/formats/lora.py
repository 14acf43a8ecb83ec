"""``--format lora``: a PEFT LoRA adapter, ``adapter_model.safetensors`` + ``adapter_config.json``.

Selection by the rules' ``lora`` pattern (``base_model.model.<module>.lora_A.weight``, the
adapter name removed) and PEFT's ``modules_to_save`` copies (``base_model.model.<module>.weight``, as
``get_peft_model_state_dict`` saves them); one file, never sharded; ``adapter_config.json`` given or inferred
(:mod:`ckpttool.ops.export.lora`); the base model's ``config.json`` /
``generation_config.json`` are not copied.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ckpttool.errors import ExportError, UsageError
from ckpttool.ops.export.formats.base import ModelFormat
from ckpttool.ops.export.formats.hf import refuse_torchtitan_names
from ckpttool.ops.export.outputs import PrepareRequest, SelectRequest, register_format

if TYPE_CHECKING:
    from ckpttool.model.adapters import ModelAdapter
    from ckpttool.model.catalog import Catalog
    from ckpttool.ops.export.plan import ExportPlan, SelectResult

__all__ = ["LoraFormat", "ADAPTER_FILE", "ADAPTER_CONFIG"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_BASE_CONFIG_FILES = ("config.json", "generation_config.json")


class LoraFormat(ModelFormat):
    """A PEFT LoRA adapter (the LoRA factors only; one file)."""

    name = "lora"
    help = "PEFT adapter"
    tensors_noun = "LoRA adapter tensors"
    reads_adapter_config = True

    def check_options(self, experts: str) -> None:
        """Raises UsageError: ``experts`` per-expert (a LoRA adapter has no expert tensors to split)."""
        if experts != "fused":
            raise UsageError(
                "`experts` per-expert applies to the hf format only",
                param="experts",
                hint="a LoRA adapter has no expert tensors to split: leave `experts` out, or export with `fmt` hf",
            )

    def check_model_adapter(self, adapter: ModelAdapter) -> None:
        """Raises UsageError: a non-identity model adapter (LoRA names are PEFT's)."""
        if not adapter.identity:
            raise UsageError(
                f"`adapter` {adapter.name} applies to the hf format only",
                param="adapter",
                hint="a LoRA adapter keeps PEFT's names: leave `adapter` out, or export with `fmt` hf",
            )

    def check_names(self, cat: Catalog, adapter: ModelAdapter | None) -> None:
        """Raises ExportNamingError (E603): torchtitan names; ExportError: no model tensor."""
        from ckpttool.ops.export.plan import require_model_tensors

        require_model_tensors(cat)
        refuse_torchtitan_names(
            cat,
            "no LoRA adapter export exists for torchtitan models",
            "merge the adapters into the weights in torchtitan and export the merged model with `fmt` hf",
        )

    def select(self, req: SelectRequest) -> SelectResult:
        """The LoRA adapter tensors, tagged with their adapter names, and the biases a given config's ``bias`` trains."""
        from ckpttool.ops.export.select import LoraKeys, peft_saved_form, select_model

        bias = (req.peft_config or {}).get("bias", "none")
        saved = peft_saved_form(req.cat, req.rules)
        keys = LoraKeys(req.rules, bias=bias if isinstance(bias, str) else "none", saved_form=saved)
        return select_model(req.cat, keys, weights=req.weights, filter_glob=req.filter_glob)

    def check_selection(self, cat: Catalog, tags: dict[str, str], warnings: list[str]) -> None:
        """Raises ExportError: several adapters selected."""
        names = sorted(set(tags.values()))
        if len(names) > 1:
            raise ExportError(
                f"{cat.path}: the checkpoint holds several LoRA adapters {names}",
                param="filter_glob",
                hint="export one of them: `filter_glob` '*.<adapter name>.*'",
            )

    def starts_file(self, packed: int, nbytes: int, shard_size: int) -> bool:
        return False

    def file_names(self, n: int) -> list[str]:
        return [ADAPTER_FILE]

    def prepare(self, req: PrepareRequest) -> dict[str, Any] | None:
        """The ``adapter_config.json`` content (:func:`ckpttool.ops.export.lora.adapter_config`)."""
        from ckpttool.ops.export.lora import adapter_config

        return adapter_config(
            req.plan,
            req.cat,
            given=req.given,
            lora_alpha=req.lora_alpha,
            model_config=req.model_config,
            beside=req.config_beside,
        )

    def documents(self, plan: ExportPlan, prepared: dict[str, Any] | None) -> dict[str, bytes]:
        return {ADAPTER_CONFIG: (json.dumps(prepared, indent=2, sort_keys=True) + "\n").encode("utf-8")}

    def skips_asset(self, name: str) -> bool:
        """``adapter_*`` and the base model's ``config.json`` / ``generation_config.json``."""
        return name.startswith("adapter_") or name in _BASE_CONFIG_FILES


register_format(LoraFormat())
