"""Expected keys, shapes and dtypes from the real model class: transformers builds it from ``config.json`` on the meta device.

No weights are allocated (``torch.device("meta")``); every architecture transformers knows
works, with no hand-written shape table. The export plan (or a checkpoint's model tensors,
``validate --config``) is compared with the meta model's ``state_dict()``:

- ``missing``: a key the model has that the export does not write (tied weights that
  ``tie_word_embeddings`` / ``_tied_weights_keys`` make optional excepted, as ``save_pretrained`` does);
- ``unexpected``: a key the export writes that the model does not have (``from_pretrained``
  ignores it with a warning and initialises the missing ones at random);
- ``shape``: the same key with another shape (``from_pretrained`` fails);
- ``dtype``: a floating tensor whose dtype differs from the config's ``dtype`` / ``torch_dtype``
  (checked only when the config names one).

Fused expert tensors are compared in their fused form (a per-expert export writes what
transformers' loading-time conversion fuses back).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelCheck", "MISMATCH_KINDS", "expected_state_dict", "compare_with_model"]

#: the kinds of difference, each allowed with ``allow_mismatch`` (``--allow-mismatch``).
MISMATCH_KINDS = ("missing", "unexpected", "shape", "dtype")


@dataclass
class ModelCheck:
    """Result of comparing tensors with the model class built from a config.

    Attributes:
        checked: whether the comparison ran.
        model_class: e.g. ``LlamaForCausalLM``.
        not_checked: why it did not run (transformers missing, unknown ``model_type``), else ``None``.
        findings: kind -> one line per key.
    """

    checked: bool
    model_class: str | None = None
    not_checked: str | None = None
    findings: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "model_class": self.model_class,
            "not_checked": self.not_checked,
            "findings": self.findings,
        }


def expected_state_dict(
    config: dict[str, Any],
) -> tuple[dict[str, tuple[tuple[int, ...], str]], set[str], str] | str:
    """The model's state dict as ``key -> (shape, dtype name)``, its optional (tied) keys, and the class name.

    Returns:
        the triple, or a string saying why it cannot be built (transformers not installed, a
        ``model_type`` it does not know, a config it rejects).
    """
    mt = config.get("model_type")
    if not isinstance(mt, str):
        return "config.json has no model_type"
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        return "transformers is not installed (pip install 'ckpttool[hf]')"
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        fields = {k: v for k, v in config.items() if k != "model_type"}
        cfg = AutoConfig.for_model(mt, **fields)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    except Exception as e:  # a model_type transformers does not know, a config its class rejects
        return f"transformers cannot build a causal LM from this config ({type(e).__name__}: {str(e)[:160]})"
    sd = model.state_dict()
    out = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
    optional: set[str] = set()
    if getattr(cfg, "tie_word_embeddings", False) or getattr(cfg.get_text_config(), "tie_word_embeddings", False):
        tied = getattr(model, "_tied_weights_keys", None) or {}
        optional.update(tied if isinstance(tied, (dict, list, tuple, set)) else [])
        for name, mod in model.named_modules():
            t = getattr(mod, "_tied_weights_keys", None)
            if t:
                optional.update(f"{name}.{k}" if name else k for k in t)
    return out, {k for k in optional if k in out}, type(model).__name__


def _floating(dtype: str) -> bool:
    return dtype in ("float32", "float16", "bfloat16", "float64")


def compare_with_model(
    written: dict[str, tuple[tuple[int, ...], str]],
    config: dict[str, Any],
) -> ModelCheck:
    """Compare ``written`` (key -> (shape, dtype)) with the model class of ``config`` (see the module docstring)."""
    got = expected_state_dict(config)
    if isinstance(got, str):
        return ModelCheck(False, not_checked=got)
    expected, optional, cls = got
    want_dtype = config.get("dtype") or config.get("torch_dtype")
    findings: dict[str, list[str]] = {}
    for k, (shape, _) in expected.items():
        if k not in written and k not in optional:
            findings.setdefault("missing", []).append(f"{k} {list(shape)}")
    for k, (shape, dtype) in written.items():
        if k not in expected:
            findings.setdefault("unexpected", []).append(f"{k} {list(shape)}")
            continue
        if shape != expected[k][0]:
            findings.setdefault("shape", []).append(f"{k}: {list(shape)}, {cls} has {list(expected[k][0])}")
        if isinstance(want_dtype, str) and _floating(dtype) and _floating(want_dtype) and dtype != want_dtype:
            findings.setdefault("dtype", []).append(f"{k}: {dtype}, config dtype {want_dtype}")
    return ModelCheck(True, model_class=cls, findings=findings)
