"""`--format lora` / `hf-merged` inputs that would give a wrong adapter or merge: a given adapter config's values,
`--lora-alpha`, and LoRA factors that do not fit each other. Each is one coded line, nothing written; the
reference is what PEFT itself writes (`LoraConfig.save_pretrained`) and loads (`PeftModel.from_pretrained`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures import hf_models
from tests.ops.export.test_export import assert_clean_failure, export_cli
from tests.ops.export.test_export_consumers import (  # noqa: F401  (session fixtures)
    assert_same_logits,
    load_hf,
    lora_ckpt,
    lora_partial_ckpt,
)


def _peft_config(tmp_path: Path, **changes: Any) -> Path:
    """PEFT's own adapter_config.json of the ``lora_ckpt`` fixture's LoraConfig, with ``changes`` applied."""
    from peft import LoraConfig

    LoraConfig(
        r=hf_models.LORA_R,
        lora_alpha=hf_models.LORA_ALPHA,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    ).save_pretrained(str(tmp_path / "peft"))
    data = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    data.update(changes)
    path = tmp_path / "given.json"
    path.write_text(json.dumps(data))  # NaN / Infinity as Python's json (and PEFT's to_json) write them
    return path


@pytest.mark.parametrize("fmt", ["lora", "hf-merged"])
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"lora_alpha": math.nan}, "lora_alpha nan"),
        ({"lora_alpha": math.inf}, "lora_alpha inf"),
        ({"lora_alpha": 0}, "lora_alpha 0"),
        ({"lora_alpha": -8}, "lora_alpha -8"),
        ({"lora_alpha": "8"}, "lora_alpha '8'"),
        ({"lora_alpha": True}, "lora_alpha True"),
        ({"r": "4"}, "r '4'"),
        ({"r": 4.0}, "r 4.0"),
        ({"alpha_pattern": {"q_proj": math.nan}}, "alpha_pattern['q_proj'] nan"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj'] 0"),
        ({"target_modules": 5}, "target_modules 5"),
        ({"target_modules": "(q_proj"}, "not a regular expression"),
    ],
)
def test_adapter_config_values_peft_would_take_unchecked_are_refused(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    fmt: str,
    change: dict[str, Any],
    needle: str,
) -> None:
    """Before: a NaN / infinite alpha was written (lora) or merged (hf-merged) and every logit PEFT computed was NaN;
    0 or a negative alpha gave an adapter that does nothing or the opposite; a string r / alpha was written as is;
    target_modules 5 was an internal error (E999). Now each is E100 naming the file and key."""
    given = _peft_config(tmp_path, **change)
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--format", fmt, "--adapter-config", str(given))
    assert_clean_failure(res, "E100", str(given), needle)
    assert not (tmp_path / "o").exists()


def test_a_nan_alpha_peft_would_load_gives_nan_logits_so_it_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """The reference for the refusal above: PEFT loads the adapter with lora_alpha NaN and computes NaN logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    res = export_cli(str(lora_ckpt), str(tmp_path / "ok"), "--format", "lora", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    cfg = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    cfg["lora_alpha"] = math.nan
    (tmp_path / "ok" / "adapter_config.json").write_text(json.dumps(cfg))
    model = PeftModel.from_pretrained(load_hf(lora_ckpt / "base", LlamaForCausalLM), tmp_path / "ok").eval()
    with torch.no_grad():
        logits = model(torch.load(lora_ckpt / "reference.pt", weights_only=True)["ids"]).logits
    assert torch.isnan(logits).all()


@pytest.mark.parametrize("fmt", ["lora", "hf-merged"])
@pytest.mark.parametrize("alpha", ["nan", "inf", "0", "-8"])
def test_lora_alpha_option_must_be_a_finite_number_above_zero(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    fmt: str,
    alpha: str,
) -> None:
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--format", fmt, f"--lora-alpha={alpha}")
    assert_clean_failure(res, "E100", "--lora-alpha", "not a finite number above 0")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["lora", "hf-merged"])
def test_a_rank_pattern_that_disagrees_with_the_tensors_is_refused(
    lora_partial_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    fmt: str,
) -> None:
    """Before, any rank_pattern turned the rank check off: rank_pattern {"v_proj": 3} over a rank-2 v_proj was
    written, and PEFT refused to load it (size mismatch). PEFT's own pattern lookup is used now, per module."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    right = {"rank_pattern": {"v_proj": 2}, "layers_to_transform": [0]}
    given = _peft_config(tmp_path, **right)
    res = export_cli(str(lora_partial_ckpt), str(tmp_path / "ok"), "--format", "lora", "--adapter-config", str(given))
    assert res.exit_code == 0, res.stderr
    assert_same_logits(
        PeftModel.from_pretrained(load_hf(lora_partial_ckpt / "base", LlamaForCausalLM), tmp_path / "ok"),
        lora_partial_ckpt,
    )
    given = _peft_config(tmp_path, rank_pattern={"v_proj": 3}, layers_to_transform=[0])
    args = ["--adapter-config", str(given)] + (
        ["--model-assets", str(lora_partial_ckpt / "model_assets")] if fmt != "lora" else []
    )
    res = export_cli(str(lora_partial_ckpt), str(tmp_path / "o"), "--format", fmt, *args)
    assert_clean_failure(res, "E601", "rank_pattern['v_proj']=3", "rank 2")
    assert not (tmp_path / "o").exists()
