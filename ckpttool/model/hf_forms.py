"""HF checkpoint forms of fused MoE experts: the per-expert names ``save_pretrained`` writes -> the model's own keys.

transformers v5 models hold their routed experts fused (``<p>.experts.gate_up_proj`` ``[E, 2I, H]``, gate
rows first, ``<p>.experts.down_proj`` ``[E, H, I]``), but ``save_pretrained`` writes (and ``from_pretrained``
reads) the legacy per-expert names of the family, which transformers' ``conversion_mapping.py`` converts on
load (``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=1)`` puts the gate before the up
projection; no transpose). One :class:`ExpertForm` per such convention, registered with
:func:`register_form`; the import (``ops/import_hf.py``) fuses through them and refuses keys of a form it
cannot apply. Torch-free (names only).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["FORMS", "ExpertForm", "forms_for", "register_form"]


@dataclass(frozen=True)
class ExpertForm:
    """One checkpoint form of per-expert tensors and the renames transformers applies with it.

    Attributes:
        name: the form's name (reported in errors).
        model_types: the config ``model_type`` values it applies to (``None``: any, also without a config).
        module: the regex of the path before ``.experts`` as stored (group ``p``).
        gate, up, down: the per-expert projection names (``<p>.experts.<j>.<name>.weight``).
        renames: ``(old, new)`` substrings replaced in every key of the model (transformers' ``WeightRenaming``),
            applied to the fused keys too.
        reference: where transformers defines it.
    """

    name: str
    model_types: tuple[str, ...] | None
    gate: str
    up: str
    down: str
    module: str = r".+"
    renames: tuple[tuple[str, str], ...] = ()
    reference: str = ""

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        """``<p>.experts.<j>.<proj>.weight`` (groups ``p``, ``j``, ``proj``)."""
        projs = "|".join(re.escape(p) for p in (self.gate, self.up, self.down))
        return re.compile(rf"^(?P<p>{self.module})\.experts\.(?P<j>\d+)\.(?P<proj>{projs})\.weight$")

    def applies(self, model_type: str | None) -> bool:
        return self.model_types is None or model_type in self.model_types

    def rename(self, key: str) -> str:
        """``key`` with the form's renames applied (the model's own name of a stored key)."""
        for old, new in self.renames:
            key = key.replace(old, new)
        return key

    def saved_name(self, key: str) -> str:
        """The name ``save_pretrained`` writes for the model's own ``key``: the renames reversed, last first
        (transformers' ``revert_weight_conversion``; Mixtral's ``.mlp.gate.weight`` -> ``.block_sparse_moe.gate.weight``)."""
        for old, new in reversed(self.renames):
            key = key.replace(new, old)
        return key

    def fused(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The fused tensors and their per-expert parts, in concatenation order (dim 1 of ``[E, ., .]``)."""
        return (("gate_up_proj", (self.gate, self.up)), ("down_proj", (self.down,)))


#: name -> form, in registration order (the order the import tries them in).
FORMS: dict[str, ExpertForm] = {}


def register_form(form: ExpertForm) -> ExpertForm:
    assert form.name not in FORMS, f"expert form {form.name!r} registered twice"
    FORMS[form.name] = form
    return form


def forms_for(model_type: str | None) -> list[ExpertForm]:
    """The forms that apply to a model of ``model_type`` (``None``: no config)."""
    return [f for f in FORMS.values() if f.applies(model_type)]


# transformers' "qwen2_moe" conversion (Qwen2/3-MoE, DeepSeek, ...): per-expert gate_proj / up_proj / down_proj,
# under the same module path as the fused tensors.
register_form(
    ExpertForm(
        "per-expert",
        None,
        "gate_proj",
        "up_proj",
        "down_proj",
        reference="transformers/conversion_mapping.py 'qwen2_moe'",
    )
)
# transformers' "mixtral" conversion (also MiniMax's, `_MODEL_TO_CONVERSION_PATTERN`): `.block_sparse_moe.` ->
# `.mlp.` (the router `gate.weight` too), w1 = gate, w3 = up, w2 = down.
register_form(
    ExpertForm(
        "mixtral",
        ("mixtral", "minimax", "minimax_m2"),
        "w1",
        "w3",
        "w2",
        module=r".+\.block_sparse_moe",
        renames=((".block_sparse_moe.", ".mlp."),),
        reference="transformers/conversion_mapping.py 'mixtral'",
    )
)
# transformers' "phimoe" conversion: Mixtral's, and the router `gate.weight` is the model's `router.weight`.
register_form(
    ExpertForm(
        "phimoe",
        ("phimoe",),
        "w1",
        "w3",
        "w2",
        module=r".+\.block_sparse_moe",
        renames=((".block_sparse_moe.", ".mlp."), (".gate.weight", ".router.weight")),
        reference="transformers/conversion_mapping.py 'phimoe'",
    )
)
