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


def test_a_config_naming_trainable_tokens_the_checkpoint_lacks_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """An adapter config with trainable_token_indices over a checkpoint that trained none was written as given
    (exit 0), and PeftModel.from_pretrained of the result fails (KeyError on the missing trainable_tokens_delta):
    now E601 names the setting, nothing written."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    given = _peft_config(tmp_path, trainable_token_indices=[1, 2])
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(given))
    assert_clean_failure(res, "E601", "trainable_token_indices [1, 2]", "holds no trainable tokens")
    assert not (tmp_path / "o").exists()
    # the reference: PEFT's own load of such an adapter (the factors, and that config)
    res = export_cli(
        str(lora_ckpt), str(tmp_path / "ok"), "--format", "lora", "--adapter-config", str(_peft_config(tmp_path))
    )
    assert res.exit_code == 0, res.stderr
    cfg = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    (tmp_path / "ok" / "adapter_config.json").write_text(json.dumps({**cfg, "trainable_token_indices": [1, 2]}))
    with pytest.raises(KeyError, match="trainable_tokens_delta"):
        PeftModel.from_pretrained(load_hf(lora_ckpt / "base", LlamaForCausalLM), tmp_path / "ok")


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


# ------------------------------------------------------------------------------------------ LoRA factors


@pytest.fixture(scope="module")
def peft_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    """A PEFT LoRA model (q_proj, v_proj, r=4) trained 2 AdamW steps: its state dict and the saved base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(5)
    root = tmp_path_factory.mktemp("peft_state")
    cfg = hf_models.llama_config()
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(root / "base"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, root


_Q = "base_model.model.model.layers.0.self_attn.q_proj."


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"drop": _Q + "lora_A.default.weight"}, "has lora_B but no lora_A"),
        ({"drop": _Q + "lora_B.default.weight"}, "has lora_A but no lora_B"),
        ({_Q + "lora_B.default.weight": torch.zeros(32, 8)}, "lora_B [32, 8] and lora_A [4, 32] do not form"),
        ({_Q + "lora_A.default.weight": torch.zeros(4, 16)}, "lora_A [4, 16] do not form a LoRA pair"),
        ({_Q + "lora_A.default.weight": torch.zeros(4, 32, 1)}, "lora_A [4, 32, 1] do not form"),
    ],
)
def test_lora_factors_that_do_not_fit_are_refused(
    peft_state: tuple[dict[str, torch.Tensor], Path],
    tmp_path: Path,
    edit: dict[str, Any],
    needle: str,
) -> None:
    """Before, `--format lora` wrote these: PEFT refused the mismatched shapes only when loading, and loaded an
    adapter without its lora_A (or lora_B) silently, with that factor freshly initialised. Now E601, nothing written."""
    import torch.distributed.checkpoint as dcp

    sd = dict(peft_state[0])
    for k, v in edit.items():
        if k == "drop":
            del sd[v]
        else:
            sd[k] = v
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"))
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8")
    assert_clean_failure(res, "E601", _Q.rstrip("."), needle)
    assert not (tmp_path / "o").exists()


def test_peft_loads_an_adapter_without_a_lora_a_silently_and_wrong(
    peft_state: tuple[dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    """The reference for the refusal above: the complete adapter loads with the trained model's logits; PEFT loads
    the same adapter without one lora_A with no error, and its logits differ."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    sd, root = peft_state
    dcp.save({"model": dict(sd)}, checkpoint_id=str(tmp_path / "ckpt"))
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))

    def logits(adapter: Path) -> torch.Tensor:
        model = PeftModel.from_pretrained(load_hf(root / "base", LlamaForCausalLM), adapter).eval()
        with torch.no_grad():
            return model(ids).logits

    want = logits(tmp_path / "o")
    trained = load_hf(root / "base", LlamaForCausalLM)
    from peft import LoraConfig, get_peft_model

    trained = get_peft_model(trained, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).eval()
    trained.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(want, trained(ids).logits, rtol=0, atol=1e-5)
    tensors = load_file(tmp_path / "o" / "adapter_model.safetensors")
    del tensors[_Q + "lora_A.weight"]
    save_file(tensors, tmp_path / "o" / "adapter_model.safetensors")
    assert not torch.allclose(logits(tmp_path / "o"), want, atol=1e-3)


# ------------------------------------------------------------------------------------------ lora_bias


def _trained_peft(
    tmp_path: Path,
    seed: int,
    lcfg: Any,
    *,
    tied: bool = False,
    adapter_name: str = "default",
    attention_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny Llama (``base/``, ``save_pretrained``; ``tied`` embeddings, ``attention_bias``: q/k/v/o biases) wrapped
    by PEFT with ``lcfg``, trained 2
    AdamW steps, saved with ``dcp.save`` into ``ckpt/`` and by PEFT's own ``save_pretrained`` into ``peft/``:
    ``(input ids, its logits)``."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(seed)
    cfg = hf_models.llama_config(tied=tied)
    cfg.attention_bias = attention_bias
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    model = get_peft_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), lcfg, adapter_name=adapter_name)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    want = hf_models.train_peft(model, ids, ids, tmp_path)
    return ids, want


def test_lora_bias_is_exported_as_peft_saves_it_and_its_merge_is_refused(tmp_path: Path) -> None:
    """LoraConfig(lora_bias=True) trains a bias on each lora_B. Before, `--format lora` left the biases out (reported
    only as "not a LoRA adapter tensor") and PEFT loaded the adapter without them (other logits), and `hf-merged`
    failed with E605 "unexpected" keys. Now the adapter holds what PEFT's own save_pretrained writes (lora_bias in the
    inferred config) and loads with the trained logits; a given config without lora_bias and the merge are E601."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True, task_type="CAUSAL_LM")
    ids, want = _trained_peft(tmp_path, 11, lcfg)

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    ours = load_file(tmp_path / "o" / "adapter_model.safetensors")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(k.endswith(".lora_B.bias") for k in peft)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    assert json.loads((tmp_path / "o" / "adapter_config.json").read_text())["lora_bias"] is True
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "o").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)

    given = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "o2"),
        "--format",
        "lora",
        "--adapter-config",
        str(tmp_path / "peft" / "adapter_config.json"),
    )
    assert res.exit_code == 0, res.stderr
    given["lora_bias"] = False
    (tmp_path / "nobias.json").write_text(json.dumps(given))
    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "o3"),
        "--format",
        "lora",
        "--adapter-config",
        str(tmp_path / "nobias.json"),
    )
    assert_clean_failure(res, "E601", "lora_B.bias", "does not set lora_bias")
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o4"), "--format", "hf-merged", "--lora-alpha", "8")
    assert_clean_failure(res, "E601", "lora_B.default.bias", "merge is not implemented")
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o4").exists()


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_biases_peft_trains_with_its_bias_option_are_exported_as_peft_saves_them(tmp_path: Path, bias: str) -> None:
    """LoraConfig(bias="all" | "lora_only") trains the model's biases (all of them, or the adapted layers') beside the
    factors, and PEFT's save_pretrained writes them into the adapter. Before, `--format lora` with that run's
    adapter_config.json left them out (listed only as "not a LoRA adapter tensor") and PEFT loaded the adapter
    over the base model's biases: other logits. Now the adapter holds PEFT's own keys and bytes and loads with the
    trained logits; without a config (which alone says the biases were trained) a warning says so; a `bias` PEFT has
    no such option for is E100."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias=bias, task_type="CAUSAL_LM")
    ids, want = _trained_peft(tmp_path, 12, lcfg, attention_bias=True)
    given = str(tmp_path / "peft" / "adapter_config.json")
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--adapter-config", given)
    assert res.exit_code == 0, res.stderr
    ours = load_file(tmp_path / "o" / "adapter_model.safetensors")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(k.endswith(".base_layer.bias") for k in peft)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    written = json.loads((tmp_path / "o" / "adapter_config.json").read_text())
    assert written["bias"] == bias and not written.get("modules_to_save")
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o3"), "--format", "lora", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr  # the tensors cannot tell a trained bias from the base's: said, not guessed
    assert "base_layer.bias" in res.stderr and "bias 'all' or 'lora_only'" in res.stderr, res.stderr
    (tmp_path / "odd.json").write_text(json.dumps({**json.loads(Path(given).read_text()), "bias": "some"}))
    res = export_cli(
        str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--format", "lora", "--adapter-config", str(tmp_path / "odd.json")
    )
    assert_clean_failure(res, "E100", "bias 'some'")
    assert not (tmp_path / "o2").exists()


def test_trainable_tokens_are_exported_as_peft_saves_them_or_refused(tmp_path: Path) -> None:
    """LoraConfig(trainable_token_indices=[...]) trains new rows of the embedding beside the factors. Before,
    `--format lora` left the `trainable_tokens_delta` out with exit 0 and no warning, and PeftModel.from_pretrained
    of the result failed (KeyError); `hf-merged` wrote `embed_tokens.token_adapter.*` names and no
    `model.embed_tokens.weight` (transformers would initialise the embedding at random). Now the adapter holds
    PEFT's own keys and bytes and loads with the trained logits; without the run's config (the token ids are not
    in the tensors), with a count of ids that does not fit, and for the merge it is E601, nothing written."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    lcfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[1, 2, 3], task_type="CAUSAL_LM"
    )
    ids, want = _trained_peft(tmp_path, 13, lcfg)
    given = tmp_path / "peft" / "adapter_config.json"
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(given))
    assert res.exit_code == 0, res.stderr
    ours = load_file(tmp_path / "o" / "adapter_model.safetensors")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(k.endswith(".trainable_tokens_delta") for k in peft)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    assert not json.loads((tmp_path / "o" / "adapter_config.json").read_text()).get("modules_to_save")
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--format", "lora", "--lora-alpha", "8")
    assert_clean_failure(res, "E601", "trainable_tokens_delta", "no adapter config is given")
    (tmp_path / "two.json").write_text(json.dumps({**json.loads(given.read_text()), "trainable_token_indices": [1, 2]}))
    res = export_cli(
        str(tmp_path / "ckpt"), str(tmp_path / "o3"), "--format", "lora", "--adapter-config", str(tmp_path / "two.json")
    )
    assert_clean_failure(res, "E601", "3 trainable token row(s)", "lists 2")
    res = export_cli(
        str(tmp_path / "ckpt"), str(tmp_path / "o4"), "--format", "hf-merged", "--adapter-config", str(given)
    )
    assert_clean_failure(res, "E601", "trainable_tokens_delta", "merge is not implemented")
    assert not any((tmp_path / o).exists() for o in ("o2", "o3", "o4"))


def test_lora_on_expert_parameters_is_refused_by_name(tmp_path: Path) -> None:
    """LoraConfig(target_parameters=[...]) puts LoRA on nn.Parameters (Qwen3-MoE's fused experts, PEFT's
    ParamWrapper: r rows per expert, the base under `experts.base_layer.base_layer.<name>`). Before, `--format lora`
    with PEFT's own config failed on a misleading rank check ("r=4 but ... rank 32"), and without one wrote exit 0 an
    adapter config targeting `experts` that PEFT cannot load; `hf-merged` said the checkpoint was an adapter only.
    Now both name LoRA on parameters (E601), nothing written."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeForCausalLM

    hf_models._quiet()
    torch.manual_seed(14)
    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    model = get_peft_model(Qwen3MoeForCausalLM(hf_models.qwen_moe_config()), lcfg)
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(tmp_path / "ckpt"))
    model.save_pretrained(tmp_path / "peft")
    given = str(tmp_path / "peft" / "adapter_config.json")
    ck = str(tmp_path / "ckpt")
    res = export_cli(ck, str(tmp_path / "o"), "--format", "lora", "--adapter-config", given)
    assert_clean_failure(res, "E601", "layers.0.mlp.experts", "LoRA on a parameter", "target_parameters")
    res = export_cli(ck, str(tmp_path / "o2"), "--format", "lora", "--lora-alpha", "8")
    assert_clean_failure(res, "E601", "LoRA on a parameter")
    res = export_cli(ck, str(tmp_path / "o3"), "--format", "hf-merged", "--adapter-config", given)
    assert_clean_failure(res, "E601", "layers.0.mlp.experts", "no base layer weight")
    assert "target_parameters" in res.stderr.strip().splitlines()[-1]
    assert not any((tmp_path / o).exists() for o in ("o", "o2", "o3"))


def test_lora_on_a_moe_router_weight_exports_with_peft_s_own_config(tmp_path: Path) -> None:
    """LoRA on Qwen3-MoE's router (`target_modules=["q_proj", "gate"]`: the router is no layer PEFT knows, so PEFT
    wraps its `weight` parameter and saves `target_parameters: ["gate.weight"]`). Before, `--format lora` with PEFT's
    own adapter_config.json was refused (E601 "mlp.gate (not matched by the adapter config)"), although the same
    export with an inferred config loads. Now the module a `target_parameters` entry names the weight of is matched:
    the adapter holds PEFT's keys and bytes and loads with the trained logits, and the merge equals
    `merge_and_unload()`."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    hf_models._quiet()
    torch.manual_seed(15)
    Qwen3MoeForCausalLM(hf_models.qwen_moe_config()).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate"], task_type="CAUSAL_LM")
    model = get_peft_model(load_hf(tmp_path / "base", Qwen3MoeForCausalLM), lcfg)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(15))
    want = hf_models.train_peft(model, ids, ids, tmp_path)
    given = tmp_path / "peft" / "adapter_config.json"
    assert json.loads(given.read_text())["target_parameters"] == ["gate.weight"]

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(given))
    assert res.exit_code == 0, res.stderr
    ours = load_file(tmp_path / "o" / "adapter_model.safetensors")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(".mlp.gate.lora_B" in k for k in peft)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", Qwen3MoeForCausalLM), tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    res = export_cli(
        str(tmp_path / "ckpt"), str(tmp_path / "m"), "--format", "hf-merged", "--adapter-config", str(given)
    )
    assert res.exit_code == 0, res.stderr
    ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", Qwen3MoeForCausalLM), tmp_path / "peft")
    ref_sd = ref.merge_and_unload().state_dict()
    got = load_file(tmp_path / "m" / "model.safetensors")
    for k in ("model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_proj.weight"):
        torch.testing.assert_close(got[k], ref_sd[k], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ adapter config files


def _assets_with(tmp_path: Path, lora_ckpt: Path, make: Any) -> Path:  # noqa: F811
    import shutil

    assets = tmp_path / "assets"
    shutil.copytree(lora_ckpt / "model_assets", assets)
    make(assets / "adapter_config.json")
    return assets


def test_a_model_assets_adapter_config_symlinked_out_of_the_folder_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """Before, `--model-assets DIR` with `DIR/adapter_config.json -> <outside>` read the file outside (config.json and
    every other assets file were refused, E101); now the same E101."""
    outside = _peft_config(tmp_path)  # a valid config, so that only the place is wrong
    assets = _assets_with(tmp_path, lora_ckpt, lambda p: p.symlink_to(outside))
    for fmt in ("lora", "hf-merged"):
        res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--format", fmt, "--model-assets", str(assets))
        assert_clean_failure(res, "E101", "adapter_config.json", "resolves outside")
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_model_assets_adapter_config_that_is_not_a_file_is_refused_not_skipped(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    kind: str,
) -> None:
    """Before, a FIFO or folder named adapter_config.json in `--model-assets` was skipped: the export went on with an
    inferred config (here: E601 asking for --lora-alpha, or with it an adapter config other than the user's)."""
    import os

    assets = _assets_with(tmp_path, lora_ckpt, os.mkfifo if kind == "fifo" else Path.mkdir)
    res = export_cli(
        str(lora_ckpt), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8", "--model-assets", str(assets)
    )
    assert_clean_failure(res, "E102", "adapter_config.json")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ DoRA


def test_a_given_config_whose_use_dora_disagrees_with_the_tensors_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """Before, a DoRA checkpoint exported with an adapter config without use_dora was written and PEFT loaded it as
    plain LoRA (the magnitudes ignored: other logits); a plain LoRA checkpoint with use_dora true loaded with
    magnitudes computed from the base weights. Now E601; PEFT's own config of the DoRA model still exports and loads
    with the trained logits, under the keys PEFT's own save writes (before: `lora_magnitude_vector.weight`, the
    DoraLayer's name, which PEFT releases before the DoraLayer refactor do not load)."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True, task_type="CAUSAL_LM")
    ids, want = _trained_peft(tmp_path, 13, lcfg)
    peft_cfg = tmp_path / "peft" / "adapter_config.json"
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(peft_cfg))
    assert res.exit_code == 0, res.stderr
    ours = load_file(tmp_path / "o" / "adapter_model.safetensors")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(k.endswith(".lora_magnitude_vector") for k in peft)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "o").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)

    no_dora = _peft_config(tmp_path)
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--format", "lora", "--adapter-config", str(no_dora))
    assert_clean_failure(res, "E601", "use_dora False", "lora_magnitude_vector")
    dora = _peft_config(tmp_path, use_dora=True)
    res = export_cli(str(lora_ckpt), str(tmp_path / "o3"), "--format", "lora", "--adapter-config", str(dora))
    assert_clean_failure(res, "E601", "use_dora True", "no DoRA magnitude vector")
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


# ------------------------------------------------------------------------------------------ tied lm_head


def test_a_merge_into_a_tied_lm_head_is_refused_and_exports_untied(tmp_path: Path) -> None:
    """A tied Llama with LoRA on lm_head (target_modules includes lm_head). Before, `hf-merged` with the tied
    config.json omitted the merged lm_head as "bitwise equal to the embedding" (the unmerged weights were compared):
    the export lost the lm_head adapter (other logits). Now E601; with tie_word_embeddings false the merged lm_head
    is written beside the embedding and the logits are the trained PEFT model's."""
    from peft import LoraConfig
    from transformers import LlamaForCausalLM

    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], task_type="CAUSAL_LM")
    ids, want = _trained_peft(tmp_path, 17, lcfg, tied=True, adapter_name="sft")
    cfg = hf_models.llama_config(tied=True)
    cfg.save_pretrained(tmp_path / "tied")
    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "o"),
        "--merge-lora",
        "--lora-alpha",
        "8",
        "--model-assets",
        str(tmp_path / "tied"),
    )
    assert_clean_failure(res, "E601", "lm_head", "tie_word_embeddings: true")
    assert not (tmp_path / "o").exists()
    cfg.tie_word_embeddings = False
    cfg.save_pretrained(tmp_path / "untied")
    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "o"),
        "--merge-lora",
        "--lora-alpha",
        "8",
        "--model-assets",
        str(tmp_path / "untied"),
    )
    assert res.exit_code == 0, res.stderr
    merged = load_hf(tmp_path / "o", LlamaForCausalLM).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ which modules PEFT adapts


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"layers_to_transform": [0]}, "model.layers.1.self_attn.q_proj (not matched"),
        ({"exclude_modules": ["v_proj"]}, "model.layers.0.self_attn.v_proj (not matched"),
        ({"exclude_modules": ".*layers\\.1\\..*"}, "model.layers.1.self_attn.q_proj (not matched"),
        ({"layers_to_transform": [0, 1], "layers_pattern": "blocks"}, "layers_pattern 'blocks'"),
    ],
)
def test_a_given_config_that_leaves_adapted_modules_out_is_refused(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    change: dict[str, Any],
    needle: str,
) -> None:
    """Before, only target_modules was compared with the adapted modules: a config with layers_to_transform [0],
    exclude_modules or another layers_pattern was written, and PEFT loaded the adapter without the modules it leaves
    out (no error; other logits) or failed (no target module found). Now E601 naming the modules and the settings."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    given = _peft_config(tmp_path, **change)
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(given))
    assert_clean_failure(res, "E601", "would not be loaded by PEFT", needle)
    assert not (tmp_path / "o").exists()
    # PEFT's own reading of the same config: the complete adapter with this config does not give the trained logits
    res = export_cli(str(lora_ckpt), str(tmp_path / "ok"), "--format", "lora", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    cfg = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    cfg.update(change)
    (tmp_path / "ok" / "adapter_config.json").write_text(json.dumps(cfg))
    ref = torch.load(lora_ckpt / "reference.pt", weights_only=True)
    try:
        model = PeftModel.from_pretrained(load_hf(lora_ckpt / "base", LlamaForCausalLM), tmp_path / "ok").eval()
    except ValueError:  # peft.utils.error.NoMatchingPeftModuleError: no module matched at all
        return
    with torch.no_grad():
        assert not torch.allclose(model(ref["ids"]).logits, ref["logits"], atol=1e-4)


def test_all_linear_target_modules_are_taken_as_peft_takes_them(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """target_modules "all-linear" (PEFT's shorthand: every linear layer but the output layer) was matched as a
    regex and refused; it matches the adapted modules now, and PEFT loads the adapter with the trained logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    given = _peft_config(tmp_path, target_modules="all-linear")
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(given))
    assert res.exit_code == 0, res.stderr
    model = PeftModel.from_pretrained(load_hf(lora_ckpt / "base", LlamaForCausalLM), tmp_path / "o")
    assert_same_logits(model, lora_ckpt)


@pytest.mark.parametrize("fmt", ["lora", "hf-merged"])
def test_lora_alpha_beside_an_alpha_pattern_is_refused(lora_ckpt: Path, tmp_path: Path, fmt: str) -> None:  # noqa: F811
    """Before, `--lora-alpha 8` with a config whose alpha_pattern is {"v_proj": 32} gave two models: `lora` kept the
    pattern (PEFT scales v_proj by 32/r), the merge scaled every module by 8/r. Now E100; without `--lora-alpha` the
    merge applies the pattern as PEFT does (logits of PEFT's model over the exported adapter)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    given = _peft_config(tmp_path, alpha_pattern={"v_proj": 32})
    res = export_cli(
        str(lora_ckpt), str(tmp_path / "o"), "--format", fmt, "--adapter-config", str(given), "--lora-alpha", "8"
    )
    assert_clean_failure(res, "E100", "--lora-alpha", "alpha_pattern")
    assert not (tmp_path / "o").exists()
    res = export_cli(str(lora_ckpt), str(tmp_path / "a"), "--format", "lora", "--adapter-config", str(given))
    assert res.exit_code == 0, res.stderr
    res = export_cli(
        str(lora_ckpt),
        str(tmp_path / "m"),
        "--format",
        "hf-merged",
        "--adapter-config",
        str(given),
        "--model-assets",
        str(lora_ckpt / "model_assets"),
    )
    assert res.exit_code == 0, res.stderr
    ids = torch.load(lora_ckpt / "reference.pt", weights_only=True)["ids"]
    peft = PeftModel.from_pretrained(load_hf(lora_ckpt / "base", LlamaForCausalLM), tmp_path / "a").eval()
    merged = load_hf(tmp_path / "m", LlamaForCausalLM).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft(ids).logits, rtol=0, atol=1e-5)


def test_a_merge_of_fp32_masters_is_refused_in_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    """A BF16 PEFT model trained with FP32 masters (ckpttool's FullFP32AdamW, get_state_dict). Before, `hf-merged
    --weights auto` said "--weights master is not supported" (the user gave auto) and pointed at --help; now it says
    the masters are not merged and how to export them. `--format lora --weights master` writes the FP32 masters."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaForCausalLM

    from ckpttool.optim_state import FullFP32AdamW

    hf_models._quiet()
    torch.manual_seed(19)
    cfg = hf_models.llama_config()
    base = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = FullFP32AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    for weights in ("auto", "master"):
        res = export_cli(
            str(tmp_path / "ckpt"), str(tmp_path / "o"), "--merge-lora", "--lora-alpha", "8", "--weights", weights
        )
        assert_clean_failure(res, "E601", "FP32 master_weight", "auto on a checkpoint that has them")
        assert "--weights params" in res.stderr and not (tmp_path / "o").exists()
    res = export_cli(
        str(tmp_path / "ckpt"), str(tmp_path / "a"), "--format", "lora", "--lora-alpha", "8", "--weights", "master"
    )
    assert res.exit_code == 0, res.stderr
    got = load_file(tmp_path / "a" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert torch.equal(got[key.replace(".default", "")], osd["state"][key]["master_weight"])


@pytest.mark.parametrize("fmt", ["lora", "hf-merged"])
def test_an_rslora_run_exported_with_lora_alpha_alone_is_warned_about(tmp_path: Path, fmt: str) -> None:
    """rsLoRA (scaling alpha / sqrt(r)) leaves no trace in the tensors: an export with `--lora-alpha` alone wrote an
    adapter (or merge) with PEFT's alpha / r scaling and other logits, without a word. It now warns that the scaling
    was taken from `--lora-alpha`; with the run's adapter_config.json the logits are the trained model's, no warning."""
    from peft import LoraConfig, PeftModel
    from transformers import LlamaForCausalLM

    lcfg = LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    ids, want = _trained_peft(tmp_path, 12, lcfg)
    assets = ("--model-assets", str(tmp_path / "base")) if fmt == "hf-merged" else ()

    def logits(out: Path) -> torch.Tensor:
        if fmt == "lora":
            loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), out)
        else:
            loaded = load_hf(out, LlamaForCausalLM)
        with torch.no_grad():
            return loaded.eval()(ids).logits

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "alpha"), "--format", fmt, "--lora-alpha", "8", *assets)
    assert res.exit_code == 0, res.stderr
    assert "warning: no adapter config given: the LoRA scaling is --lora-alpha / r" in res.stderr, res.stderr
    assert not torch.allclose(logits(tmp_path / "alpha"), want, atol=1e-3)  # what the warning is about
    given = str(tmp_path / "peft" / "adapter_config.json")
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "cfg"), "--format", fmt, "--adapter-config", given, *assets)
    assert res.exit_code == 0 and "no adapter config given" not in res.stderr, res.stderr
    torch.testing.assert_close(logits(tmp_path / "cfg"), want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ PEFT's saved names


@pytest.mark.parametrize("adapter", ["default", "mine"])
def test_an_adapter_saved_with_peft_names_keeps_its_modules_to_save_copy(tmp_path: Path, adapter: str) -> None:
    """A training loop that saves the adapter alone, as PEFT names it (``get_peft_model_state_dict``: no adapter name,
    ``modules_to_save`` copies as ``base_model.model.lm_head.weight``), beside its optimizer. Before, `--format lora`
    wrote the LoRA factors but left the trained lm_head copy out ('not a LoRA adapter tensor'), exit 0: PEFT loaded
    the base lm_head in its place and computed other logits. Reference: PEFT's own ``from_pretrained`` of the export
    gives the trained model's logits and its ``modules_to_save`` weight."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(7)
    cfg = hf_models.llama_config()
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(load_hf(tmp_path / "base", LlamaForCausalLM), lcfg, adapter_name=adapter)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    opt, want = hf_models.train_two_steps(model, ids, ids)
    saved = get_peft_model_state_dict(model, adapter_name=adapter)
    assert "base_model.model.lm_head.weight" in saved  # PEFT's name of the modules_to_save copy
    dcp.save({"model": saved, "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "ckpt"))

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    got = load_file(str(tmp_path / "o" / "adapter_model.safetensors"))
    assert set(got) == set(saved)
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
    loaded = PeftModel.from_pretrained(
        load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "o", adapter_name=adapter
    )
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("bias", "top_level", "copy"), [("all", False, False), ("lora_only", False, False), ("all", True, True)]
)
def test_an_adapter_saved_with_peft_names_keeps_the_biases_its_bias_option_trained(
    tmp_path: Path, bias: str, top_level: bool, copy: bool
) -> None:
    """A training loop that saves the adapter alone, as PEFT names it (``get_peft_model_state_dict``, under
    ``model`` beside the optimizer or at the top level), with LoraConfig(bias="all" | "lora_only") on layers with
    biases: the trained biases are in it (``q_proj.base_layer.bias``, with "all" also ``k_proj.bias``). Before,
    `--format lora` refused it with a misleading E601 "LoRA on a parameter (LoraConfig target_parameters...)", with
    or without the run's adapter_config.json; with a ``modules_to_save`` copy of a layer with a bias (PEFT saves
    ``o_proj.weight`` beside ``o_proj.original_module.bias``) it dropped the trained copy ('not a LoRA adapter
    tensor'), and PEFT loaded the base o_proj in its place. Now the adapter holds PEFT's own save_pretrained keys and bytes, its
    config the run's ``bias`` (inferred from the biases when no config is given), and PEFT's ``from_pretrained``
    gives the trained logits."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(17)
    cfg = hf_models.llama_config()
    cfg.attention_bias = True
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        bias=bias,
        modules_to_save=["o_proj"] if copy else None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_hf(tmp_path / "base", LlamaForCausalLM), lcfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(17))
    opt, want = hf_models.train_two_steps(model, ids, ids)
    saved = get_peft_model_state_dict(model)
    assert any(k.endswith(".base_layer.bias") for k in saved)
    assert any(k.endswith("k_proj.bias") for k in saved) == (bias == "all")
    assert any(k.endswith("o_proj.original_module.bias") for k in saved) == copy
    state = saved if top_level else {"model": saved, "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    model.save_pretrained(tmp_path / "peft")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")

    given = str(tmp_path / "peft" / "adapter_config.json")
    for out, opts in (("o", ("--adapter-config", given)), ("o2", ("--lora-alpha", "8"))):
        res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / out), "--format", "lora", *opts)
        assert res.exit_code == 0, res.stderr
        ours = load_file(tmp_path / out / "adapter_model.safetensors")
        assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
        written = json.loads((tmp_path / out / "adapter_config.json").read_text())
        assert written["bias"] == bias and bool(written.get("modules_to_save")) == copy, written
        loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / out).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)

    # a config that does not say these biases were trained (bias 'none'; 'lora_only' beside k_proj.bias) is refused
    key = next(k for k in sorted(peft) if k.endswith("k_proj.bias" if bias == "all" else ".base_layer.bias"))
    odd = {"all": "lora_only", "lora_only": "none"}[bias]
    (tmp_path / "odd.json").write_text(json.dumps({**json.loads(Path(given).read_text()), "bias": odd}))
    res = export_cli(
        str(tmp_path / "ckpt"), str(tmp_path / "o3"), "--format", "lora", "--adapter-config", str(tmp_path / "odd.json")
    )
    assert_clean_failure(res, "E601", key, f"sets bias {odd!r}")
    assert not (tmp_path / "o3").exists()


@pytest.mark.parametrize("tied_part", ["modules_to_save", "target_modules"])
def test_an_adapter_peft_ties_to_the_embedding_exports_with_peft_s_own_config(tmp_path: Path, tied_part: str) -> None:
    """LoraConfig(ensure_weight_tying=True) on a model whose lm_head is tied to the embedding: PEFT gives the lm_head a
    copy (``modules_to_save``) or a LoRA (``target_modules``) tied to the embedding's, and saves a config that names
    the embedding alone (it ties the head again when it loads). Before, `--format lora` with that run's own
    adapter_config.json was refused (E601: "does not name 'lm_head'" / "lm_head (not matched by the adapter config)"),
    although PEFT loads it; now it exports PEFT's tensors and loads with the trained logits. Without the base model's
    config.json (the tie unknown) the refusal names ensure_weight_tying and asks for it."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    if tied_part == "modules_to_save":
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    else:
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    lcfg.ensure_weight_tying = True
    ids, want = _trained_peft(tmp_path, 13, lcfg, tied=True)
    given = str(tmp_path / "peft" / "adapter_config.json")
    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "o"),
        "--format",
        "lora",
        "--adapter-config",
        given,
        "--model-assets",
        str(tmp_path / "base"),
    )
    assert res.exit_code == 0, res.stderr
    ours = load_file(tmp_path / "o" / "adapter_model.safetensors")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(k.startswith("base_model.model.lm_head.") for k in ours)
    # PEFT's own save also stores the embedding matrices (`save_embedding_layers`); ckpttool does not (docs/export.md)
    assert sorted(ours) == sorted(k for k in peft if not k.endswith(".base_layer.weight"))
    assert all(torch.equal(ours[k], peft[k]) for k in ours)
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)

    # without the base model's config.json, whether PEFT ties the head (and so loads it) is unknown: said so
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--format", "lora", "--adapter-config", given)
    assert_clean_failure(res, "E601", "ensure_weight_tying", "'lm_head'")
    assert "--model-assets" in res.stderr.splitlines()[-1] and not (tmp_path / "o2").exists()


def test_an_adapter_config_targeting_modules_without_factors_is_refused(
    lora_partial_ckpt: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The checkpoint holds adapters on layer 0 only; a given config without its ``layers_to_transform`` targets
    layer 1's q_proj / v_proj too. Before, it was written beside the factors: PEFT then gives those modules fresh
    adapters (random ``lora_B`` with ``init_lora_weights: false``) and computes other logits than the trained
    model's. Now E601 names the modules, nothing written."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    wrong = _peft_config(tmp_path, rank_pattern={"v_proj": 2}, init_lora_weights=False)
    res = export_cli(str(lora_partial_ckpt), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(wrong))
    assert_clean_failure(res, "E601", "holds no LoRA adapter for", "model.layers.1.self_attn.q_proj")
    assert not (tmp_path / "o").exists()
    wrong_text = wrong.read_text()  # (_peft_config writes one given.json)
    # the reference: PEFT's own load of the same factors with that config is not the trained model
    right = _peft_config(tmp_path, rank_pattern={"v_proj": 2}, layers_to_transform=[0], init_lora_weights=False)
    res = export_cli(str(lora_partial_ckpt), str(tmp_path / "ok"), "--format", "lora", "--adapter-config", str(right))
    assert res.exit_code == 0, res.stderr
    assert_same_logits(
        PeftModel.from_pretrained(load_hf(lora_partial_ckpt / "base", LlamaForCausalLM), tmp_path / "ok"),
        lora_partial_ckpt,
    )
    (tmp_path / "ok" / "adapter_config.json").write_text(wrong_text)
    with pytest.raises(AssertionError):
        assert_same_logits(
            PeftModel.from_pretrained(load_hf(lora_partial_ckpt / "base", LlamaForCausalLM), tmp_path / "ok"),
            lora_partial_ckpt,
        )
