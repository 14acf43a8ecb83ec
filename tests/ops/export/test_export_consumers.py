"""Real consumers load `ckpttool export` output: transformers `from_pretrained` and PEFT `PeftModel.from_pretrained`.

Each fixture is a tiny model built from a config (no hub access), saved through a real
``dcp.save`` under ``model.<hf key>``; the exported model's logits must equal the
original model's (``reference.pt`` beside the checkpoint).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build, copy_checkpoint

runner = CliRunner()
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def llama_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama", hf_models.build_llama)


@pytest.fixture(scope="session")
def llama_tied_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama_tied", hf_models.build_llama_tied)


@pytest.fixture(scope="session")
def llama_tied_differ_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama_tied_differ", hf_models.build_llama_tied_differ)


@pytest.fixture(scope="session")
def qwen_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)


@pytest.fixture(scope="session")
def qwen_legacy_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_qwen_moe_legacy", hf_models.build_qwen_moe_legacy)


@pytest.fixture(scope="session")
def lora_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_lora", hf_models.build_lora)


@pytest.fixture(scope="session")
def lora_partial_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_lora_partial", hf_models.build_lora_partial)


def export(src: Path, out: Path, *args: str) -> dict:
    res = runner.invoke(
        app, ["export", str(src), str(out), "--model-assets", str(src / "model_assets"), "--json", *args]
    )
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def assert_same_logits(model: torch.nn.Module, src: Path) -> None:
    ref = torch.load(src / "reference.pt", weights_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(ref["ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def load_hf(out: Path, cls: type) -> torch.nn.Module:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return cls.from_pretrained(out, dtype=torch.float32)


def weight_keys(out: Path) -> set[str]:
    return set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])


# ------------------------------------------------------------------------------------------ dense / tied


def test_llama_untied_loads_with_identical_logits(llama_ckpt: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    summary = export(llama_ckpt, out, "--shard-size", "20KB")
    assert len(summary["files"]) > 1 and summary["tied_embeddings"] is None
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= weight_keys(out)  # untied: both written
    assert (out / "config.json").is_file()
    assert_same_logits(load_hf(out, LlamaForCausalLM), llama_ckpt)


def test_llama_tied_writes_the_embedding_once(llama_tied_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    summary = export(llama_tied_ckpt, out)
    assert summary["tied_embeddings"] == "omitted"
    keys = weight_keys(out)
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert set(load_file(out / "model.safetensors")) == keys
    model = load_hf(out, LlamaForCausalLM)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert_same_logits(model, llama_tied_ckpt)
    # --filter leaving the lm_head out: "absent" said "the checkpoint has no lm_head", which it has
    args = ["--filter", "*embed*", "--model-assets", str(llama_tied_ckpt / "model_assets")]
    res = runner.invoke(app, ["export", str(llama_tied_ckpt), str(tmp_path / "f"), *args])
    assert res.exit_code == 0, res.stderr
    assert "embeddings  tied: no lm_head exported (none selected; from_pretrained ties it to" in res.stdout, res.stdout


def test_tied_config_with_differing_lm_head_is_refused(llama_tied_differ_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        [
            "export",
            str(llama_tied_differ_ckpt),
            str(tmp_path / "o"),
            "--model-assets",
            str(llama_tied_differ_ckpt / "model_assets"),
        ],
    )
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E601] model.lm_head.weight differs from model.model.embed_tokens.weight")
    assert "hint: " in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []
    # without the tied config both tensors are written, as stored
    res = runner.invoke(app, ["export", str(llama_tied_differ_ckpt), str(tmp_path / "o")])
    assert res.exit_code == 0, res.stderr
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= weight_keys(tmp_path / "o")


# ------------------------------------------------------------------------------------------ MoE


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_qwen3_moe_loads_with_identical_logits(qwen_ckpt: Path, tmp_path: Path, experts: str) -> None:
    from transformers import Qwen3MoeForCausalLM

    out = tmp_path / experts
    export(qwen_ckpt, out, "--experts", experts)
    keys = weight_keys(out)
    if experts == "fused":
        assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    else:
        assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
        assert {
            f"model.layers.1.mlp.experts.{j}.{p}.weight"
            for j in range(hf_models.MOE_EXPERTS)
            for p in ("gate_proj", "up_proj", "down_proj")
        } <= keys
    assert_same_logits(load_hf(out, Qwen3MoeForCausalLM), qwen_ckpt)


def test_default_fused_experts_export_notes_the_per_expert_names(qwen_ckpt: Path, tmp_path: Path) -> None:
    """Without --experts the fused tensors are written as stored; transformers' own save_pretrained of the model
    writes per-expert names (what vLLM reads): a note says so, and not when --experts is given."""
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    hf_models._quiet()
    Qwen3MoeForCausalLM(AutoConfig.from_pretrained(qwen_ckpt / "model_assets")).save_pretrained(tmp_path / "sp")
    with safe_open(str(tmp_path / "sp" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in f.keys()
    doc = export(qwen_ckpt, tmp_path / "default")
    (note,) = [n for n in doc["notes"] if "fused expert tensor(s)" in n]
    assert note.startswith("4 fused expert tensor(s) written as stored") and "per-expert writes those" in note
    for experts in ("fused", "per-expert"):
        doc = export(qwen_ckpt, tmp_path / experts, "--experts", experts)
        assert not [n for n in doc["notes"] if "fused expert tensor(s)" in n]


def test_per_expert_filter_names_the_fused_tensor(qwen_ckpt: Path, tmp_path: Path) -> None:
    """--filter is matched before the per-expert split: a glob naming one expert matches nothing (E601), and the
    hint says which name selects the expert tensors; that glob writes every expert of the layer."""
    res = runner.invoke(
        app, ["export", str(qwen_ckpt), str(tmp_path / "one"), "--experts", "per-expert", "--filter", "*.experts.0.*"]
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: [E601]")
    assert "before fused experts are split" in res.stderr and "'*.layers.0.mlp.experts.*'" in res.stderr
    assert not (tmp_path / "one").exists()
    doc = export(qwen_ckpt, tmp_path / "layer0", "--experts", "per-expert", "--filter", "*.layers.0.mlp.experts.*")
    assert doc["tensors"] == 3 * hf_models.MOE_EXPERTS
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weight_keys(tmp_path / "layer0")


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_unversioned_legacy_ep_checkpoint_is_refused(qwen_legacy_ckpt: Path, tmp_path: Path, experts: str) -> None:
    res = runner.invoke(app, ["export", str(qwen_legacy_ckpt), str(tmp_path / "o"), "--experts", experts])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E405] model.model.layers.0.mlp.experts.")
    assert "--source-layout" in res.stderr.splitlines()[1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_declared_legacy_layout_is_unpermuted(qwen_legacy_ckpt: Path, tmp_path: Path, experts: str) -> None:
    from transformers import Qwen3MoeForCausalLM

    out = tmp_path / "hf"
    summary = export(
        qwen_legacy_ckpt,
        out,
        "--experts",
        experts,
        "--source-layout",
        "legacy",
        "--ep-size",
        str(hf_models.MOE_P),
        "--ep-fsdp-size",
        str(hf_models.MOE_F),
    )
    assert len(summary["layout"]["unpermuted"]) == 4
    assert_same_logits(load_hf(out, Qwen3MoeForCausalLM), qwen_legacy_ckpt)


def test_declared_canonical_keeps_the_stored_order(qwen_legacy_ckpt: Path, tmp_path: Path) -> None:
    """Declaring the wrong (canonical) layout writes the stored, block-transposed order: logits differ."""
    from transformers import Qwen3MoeForCausalLM

    out = tmp_path / "hf"
    summary = export(
        qwen_legacy_ckpt,
        out,
        "--source-layout",
        "canonical",
        "--ep-size",
        str(hf_models.MOE_P),
        "--ep-fsdp-size",
        str(hf_models.MOE_F),
    )
    assert summary["layout"]["unpermuted"] == []
    with pytest.raises(AssertionError):
        assert_same_logits(load_hf(out, Qwen3MoeForCausalLM), qwen_legacy_ckpt)


def test_legacy_record_in_sidecar_needs_no_declaration(qwen_legacy_ckpt: Path, tmp_path: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    ck = copy_checkpoint(qwen_legacy_ckpt, tmp_path / "ck")
    (ck / "layout.json").write_text(json.dumps(hf_models.moe_layout_record(1, hf_models.MOE_P, hf_models.MOE_F)))
    out = tmp_path / "hf"
    summary = export(ck, out, "--experts", "per-expert")
    assert summary["layout"]["version"] == 1 and summary["layout"]["source"] == "sidecar"
    assert_same_logits(load_hf(out, Qwen3MoeForCausalLM), qwen_legacy_ckpt)


def test_declaration_contradicting_chunk_geometry_is_refused(qwen_legacy_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        [
            "export",
            str(qwen_legacy_ckpt),
            str(tmp_path / "o"),
            "--source-layout",
            "legacy",
            "--ep-size",
            "4",
            "--ep-fsdp-size",
            "2",
        ],
    )
    assert res.exit_code == 2
    assert res.stderr.startswith("error: [E404]")


def test_layout_record_expert_count_must_match(qwen_legacy_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(qwen_legacy_ckpt, tmp_path / "ck")
    record = hf_models.moe_layout_record(1, hf_models.MOE_P, hf_models.MOE_F)
    for spec in record["extra_parallel"].values():
        spec["num_experts"] = 4
    (ck / "layout.json").write_text(json.dumps(record))
    res = runner.invoke(app, ["export", str(ck), str(tmp_path / "o"), "--experts", "per-expert"])
    assert res.exit_code == 2 and res.stdout == ""
    first = res.stderr.splitlines()[0]
    assert first.startswith("error: [E404] model.model.layers.0.mlp.experts.") and "num_experts is 4" in first
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ LoRA


def test_lora_adapter_loads_in_peft_with_identical_logits(lora_ckpt: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    out = tmp_path / "adapter"
    summary = export(lora_ckpt, out, "--format", "lora", "--lora-alpha", str(hf_models.LORA_ALPHA))
    assert sorted(p.name for p in out.iterdir()) == [
        ".ckpttool-output.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == hf_models.LORA_R and cfg["lora_alpha"] == hf_models.LORA_ALPHA
    assert cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["task_type"] == "CAUSAL_LM"
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == {
        f"base_model.model.model.layers.{n}.self_attn.{m}.lora_{ab}.weight"
        for n in range(2)
        for m in ("q_proj", "v_proj")
        for ab in ("A", "B")
    }
    assert summary["tensors"] == 8
    base = load_hf(lora_ckpt / "base", LlamaForCausalLM)
    assert_same_logits(PeftModel.from_pretrained(base, out), lora_ckpt)


def _trained_lora_with_head(tmp_path: Path, seed: int, **lora: Any) -> tuple[Any, Any, Any, Path]:
    """A PEFT LoRA Llama (``q_proj``, ``v_proj``, r 4, lora_alpha 8; ``lora``: more LoraConfig fields) whose
    ``modules_to_save`` copy of ``lm_head`` is trained: the base model saved in ``tmp_path/base``, PEFT's own adapter
    in ``tmp_path/peft``, ``dcp.save`` of the PEFT model's state dict in ``tmp_path/ckpt``. Returns
    ``(model, ids, logits of ids, the checkpoint)``."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(seed)
    cfg = hf_models.llama_config()
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
        init_lora_weights=False,
        **lora,
    )
    model = get_peft_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), lcfg)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)  # the trained head
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    src = tmp_path / "ckpt"
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(src))
    model.save_pretrained(tmp_path / "peft")  # PEFT's own adapter, the reference
    return model, ids, want, src


def test_lora_adapter_keeps_a_modules_to_save_copy(tmp_path: Path) -> None:
    """A PEFT model with a fully trained ``lm_head`` (``modules_to_save``), saved with dcp.save: the adapter exported
    holds what PEFT's own ``save_pretrained`` writes (the copy as ``base_model.model.lm_head.weight``, listed in
    ``modules_to_save``) and loads with the original logits; before, the copy was left out with a warning and the
    adapter loaded the base model's lm_head."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    _, ids, want, src = _trained_lora_with_head(tmp_path, 7)
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "out"), "--format", "lora", "--lora-alpha", "8"])
    assert res.exit_code == 0, res.stderr
    assert "modules_to_save" not in res.stderr
    ours, peft = load_file(tmp_path / "out" / "adapter_model.safetensors"), load_file(tmp_path / "peft" / ADAPTER)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)
    # PEFT's adapter_config.json (it lists lm_head) is taken as is; one without modules_to_save is refused
    given = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    res = runner.invoke(
        app,
        [
            "export",
            str(src),
            str(tmp_path / "o2"),
            "--format",
            "lora",
            "--adapter-config",
            str(tmp_path / "peft" / "adapter_config.json"),
        ],
    )
    assert res.exit_code == 0, res.stderr
    given["modules_to_save"] = None
    (tmp_path / "bad.json").write_text(json.dumps(given))
    res = runner.invoke(
        app,
        ["export", str(src), str(tmp_path / "o3"), "--format", "lora", "--adapter-config", str(tmp_path / "bad.json")],
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: [E601]") and "'lm_head'" in res.stderr
    assert not (tmp_path / "o3").exists()


def test_lora_filter_with_the_runs_adapter_config_never_names_modules_it_left_out(tmp_path: Path) -> None:
    """An rsLoRA adapter (``q_proj``, ``v_proj``, a trained ``lm_head`` in ``modules_to_save``) exported with PEFT's own
    ``adapter_config.json`` and a ``--filter`` keeping ``q_proj`` only: the config, written as is, named ``v_proj`` and
    ``lm_head`` whose tensors were not written, and ``PeftModel.from_pretrained`` of the export failed
    (``KeyError: 'base_model.model.lm_head.weight'``; without the copy, ``v_proj`` got a random, untrained adapter).
    Now E601 names them and nothing is written; a filter keeping every adapter tensor, or a config naming only the
    modules kept, exports an adapter PEFT loads with the trained model's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model, ids, want, src = _trained_lora_with_head(tmp_path, 9, use_rslora=True)
    given = tmp_path / "peft" / "adapter_config.json"

    def run(out: str, glob: str, config: Path) -> Any:
        args = ["export", str(src), str(tmp_path / out), "--format", "lora", "--adapter-config", str(config)]
        return runner.invoke(app, [*args, "--filter", glob])

    res = run("part", "*q_proj*", given)
    assert res.exit_code == 2 and res.stderr.startswith("error: [E601] --filter left out 3 module(s)"), res.stderr
    assert "lm_head, model.layers.0.self_attn.v_proj" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == "" and not (tmp_path / "part").exists()
    res = run("all", "*base_model*", given)  # every adapter tensor kept: PEFT's adapter, bit for bit
    assert res.exit_code == 0, res.stderr
    # the summary says what PEFT's scaling reads from the adapter_config.json written (before: nothing about it)
    want_line = "lora config r 4; lora_alpha 8; use_rslora true; use_dora false; target_modules "
    assert want_line in res.stdout and "; modules_to_save lm_head\n" in res.stdout, res.stdout
    ours, peft = load_file(tmp_path / "all" / ADAPTER), load_file(tmp_path / "peft" / ADAPTER)
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "all").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)
    # a config naming only the modules kept is written as given and loads: q_proj's adapter, rsLoRA-scaled
    narrow = {**json.loads(given.read_text()), "target_modules": ["q_proj"], "modules_to_save": None}
    (tmp_path / "q.json").write_text(json.dumps(narrow))
    res = run("q", "*q_proj*", tmp_path / "q.json")
    assert res.exit_code == 0, res.stderr
    assert json.loads((tmp_path / "q" / "adapter_config.json").read_text())["use_rslora"] is True
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "q").eval()
    with torch.no_grad():  # the trained model with v_proj's adapter and the lm_head copy switched off
        model.base_model.model.lm_head.modules_to_save["default"].weight.copy_(
            model.base_model.model.lm_head.original_module.weight
        )
        for layer in model.base_model.model.model.layers:
            layer.self_attn.v_proj.lora_B["default"].weight.zero_()
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


ADAPTER = "adapter_model.safetensors"


def test_lora_needs_alpha_or_adapter_config(lora_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(lora_ckpt), str(tmp_path / "o"), "--format", "lora"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E601]") and "--lora-alpha" in res.stderr
    given = tmp_path / "adapter_config.json"
    given.write_text(
        json.dumps(
            {"peft_type": "LORA", "r": hf_models.LORA_R, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        )
    )
    res = runner.invoke(
        app, ["export", str(lora_ckpt), str(tmp_path / "o"), "--format", "lora", "--adapter-config", str(given)]
    )
    assert res.exit_code == 0, res.stderr
    assert json.loads((tmp_path / "o" / "adapter_config.json").read_text())["lora_alpha"] == 16
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    res = runner.invoke(
        app, ["export", str(lora_ckpt), str(tmp_path / "o2"), "--format", "lora", "--adapter-config", str(wrong)]
    )
    assert res.exit_code == 2 and "r=8" in res.stderr


def test_lora_format_without_adapters_is_refused(llama_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(llama_ckpt), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E601]") and "LoRA adapter tensors" in res.stderr


def test_lora_config_inferred_for_partial_adapters(lora_partial_ckpt: Path, tmp_path: Path) -> None:
    """Adapters on layer 0 only, v_proj at rank 2: exact module paths and rank_pattern are inferred."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out = tmp_path / "adapter"
    export(lora_partial_ckpt, out, "--format", "lora", "--lora-alpha", str(hf_models.LORA_ALPHA))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] in (hf_models.LORA_R, 2)
    assert (
        cfg["target_modules"] == "^(?:model\\.layers\\.0\\.self_attn\\.q_proj|model\\.layers\\.0\\.self_attn\\.v_proj)$"
    )
    other = 2 if cfg["r"] == hf_models.LORA_R else hf_models.LORA_R
    assert list(cfg["rank_pattern"].values()) == [other]
    base = load_hf(lora_partial_ckpt / "base", LlamaForCausalLM)
    model = PeftModel.from_pretrained(base, out)
    assert_same_logits(model, lora_partial_ckpt)
    adapted = {n for n, _ in model.named_modules() if n.endswith(("q_proj", "v_proj")) and hasattr(_, "lora_A")}
    assert all(".layers.0." in n for n in adapted) and len(adapted) == 2
