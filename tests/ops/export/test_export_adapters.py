"""Model adapters (torchtitan -> HF): logits of `from_pretrained` and bitwise against torchtitan's own adapter.

Fixtures: HF models saved under torchtitan 0.3 names (``hf_models.build_titan_named``: the q/k
rows permuted back with torchtitan's own ``_reverse_permute``), so the export must restore the
HF model exactly; and the real torchtitan ``CheckpointManager`` saves (``titan_root``), whose
export is compared tensor by tensor with torchtitan's ``state_dict_adapter.to_hf`` on the
state dict torch's ``dcp.load`` reads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from ckpttool.model.adapters import AdapterConfig, get_adapter, rope_from_hf_rows, rope_to_hf_rows
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.export.test_export import assert_clean_failure, export_cli, read_export, torch_load
from tests.ops.export.test_export_consumers import assert_same_logits, load_hf

warnings.filterwarnings("ignore", category=FutureWarning)
torchtitan = pytest.importorskip("torchtitan.models.llama3.state_dict_adapter", reason="torchtitan not installed")


@pytest.fixture(scope="session")
def titan_named(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_titan_named", hf_models.build_titan_named)


def export(src: Path, out: Path, *args: str) -> dict:
    res = export_cli(str(src), str(out), "--model-assets", str(src / "model_assets"), "--json", *args)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def test_rope_rows_match_the_view_transpose_permutation() -> None:
    n, hd, dim = 3, 8, 5
    w = torch.arange(n * hd * dim, dtype=torch.float32).reshape(n * hd, dim)
    want = w.view(n, hd // 2, 2, dim).transpose(1, 2).reshape(n * hd, dim)
    dst = rope_to_hf_rows(n, hd)
    got = torch.empty_like(w)
    got[torch.tensor(dst)] = w
    assert torch.equal(got, want)
    back = torch.empty_like(w)
    back[torch.tensor(rope_from_hf_rows(n, hd))] = got
    assert torch.equal(back, w)


def test_rope_run_map_is_a_row_permutation_gathered_per_block() -> None:
    """The export's fast path: a slab of whole heads is permuted by one gather; a slab cutting a head is not."""
    import numpy as np

    from ckpttool.ops.export.transform import Run, RunMap

    n, hd, dim = 3, 8, 5
    w = torch.arange(n * hd * dim, dtype=torch.int16).reshape(n * hd, dim)
    want = w.view(n, hd // 2, 2, dim).transpose(1, 2).reshape(n * hd, dim)
    rm = RunMap([Run(r * dim, dim, 0, d * dim) for r, d in enumerate(rope_to_hf_rows(n, hd))])
    assert rm.rows is not None and rm.rows.block == hd and rm.rows.row == dim
    src = memoryview(w.numpy().tobytes())
    rb = dim * 2
    got = rm.rows.gather(src[hd * rb : 3 * hd * rb], hd, 2 * hd, np.empty(2 * hd * rb, dtype=np.uint8))
    assert got is not None and got[0] == hd
    assert got[1].tobytes() == want[hd:].numpy().tobytes()
    assert rm.rows.gather(src[4 * rb : 12 * rb], 4, 8, np.empty(8 * rb, dtype=np.uint8)) is None
    assert RunMap([Run(0, 5, 0, 5), Run(5, 5, 0, 0)]).rows is not None
    assert RunMap([Run(0, 5, 0, 5), Run(5, 5, 1, 0)]).rows is None  # two pieces: not a row permutation
    assert RunMap([Run(0, 5, 0, 0), Run(10, 5, 0, 5)]).rows is None  # rows left out


@pytest.mark.parametrize(("name", "slab"), [("llama_gqa", None), ("llama_tied", None), ("llama_gqa", "64")])
def test_llama_gqa_through_the_adapter_loads_with_identical_logits(
    titan_named: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, slab: str | None
) -> None:
    from transformers import LlamaForCausalLM

    if slab is not None:  # slabs smaller than one head: widened to whole heads
        monkeypatch.setenv("CKPTTOOL_SLAB_BYTES", slab)
    src = titan_named / name
    doc = export(src, tmp_path / "hf")
    assert doc["model_adapter"] == "torchtitan-llama3"
    assert_same_logits(load_hf(tmp_path / "hf", LlamaForCausalLM), src)
    if name == "llama_tied":
        assert "lm_head.weight" not in read_export(tmp_path / "hf")[0]


def test_llama_rules_only_export_gives_wrong_logits(titan_named: Path, tmp_path: Path) -> None:
    """Why the adapter exists: HF names without the q/k permutation load, but compute another model."""
    from transformers import LlamaForCausalLM

    src = titan_named / "llama_gqa"
    export(src, tmp_path / "hf")
    got, _ = read_export(tmp_path / "hf")
    ref = torch_load(src)
    wq = ref["layers.0.attention.qkv_linear.wq.weight"]
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], wq)  # rows moved
    model = load_hf(tmp_path / "hf", LlamaForCausalLM)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.copy_(wq)
        model.model.layers[0].self_attn.k_proj.weight.copy_(ref["layers.0.attention.qkv_linear.wk.weight"])
    r = torch.load(src / "reference.pt", weights_only=True)
    with torch.no_grad():
        diff = (model(r["ids"]).logits - r["logits"]).abs().max().item()
    assert diff > 1e-3


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_qwen3_moe_through_the_adapter_loads_with_identical_logits(
    titan_named: Path, tmp_path: Path, experts: str
) -> None:
    from transformers import Qwen3MoeForCausalLM

    src = titan_named / "qwen_moe"
    doc = export(src, tmp_path / "hf", "--experts", experts)
    assert doc["model_adapter"] == "torchtitan-qwen3"
    assert "torchtitan load-balancing expert_bias buffer (no HF counterpart)" in doc["skipped"]
    keys = set(read_export(tmp_path / "hf")[0])
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == (experts == "fused")
    assert_same_logits(load_hf(tmp_path / "hf", Qwen3MoeForCausalLM), src)


def test_adapter_without_config_is_refused_naming_the_fields(titan_named: Path, tmp_path: Path) -> None:
    """Refused without --model-assets; the hint names the model_assets/ folder holding the config.json saved with
    the checkpoint (it said only "pass the model's config.json with --model-assets")."""
    res = export_cli(str(titan_named / "llama_gqa"), str(tmp_path / "o"), "--adapter", "torchtitan-llama3")
    assert_clean_failure(res, "E601", "RoPE row permutation", "num_attention_heads")
    assert res.stderr.splitlines()[1] == (
        "hint: pass the model's config.json with --model-assets: the checkpoint holds one, --model-assets "
        f"{titan_named / 'llama_gqa' / 'model_assets'}"
    ), res.stderr


def test_torchtitan_lora_tensors_are_refused_not_dropped(titan_named: Path, tmp_path: Path) -> None:
    """torchtitan `LoRALinear` adapters (`wq.lora_a` / `lora_b`): an HF export would lose the fine-tune."""
    import shutil

    import torch.distributed.checkpoint as dcp

    src = titan_named / "llama_gqa"
    sd = torch_load(src)
    w = sd["layers.0.attention.qkv_linear.wq.weight"]
    sd["layers.0.attention.qkv_linear.wq.lora_a.weight"] = torch.randn(4, w.shape[1])
    sd["layers.0.attention.qkv_linear.wq.lora_b.weight"] = torch.randn(w.shape[0], 4)
    ckpt = tmp_path / "lora"
    dcp.save(sd, checkpoint_id=str(ckpt), no_dist=True)
    shutil.copytree(src / "model_assets", ckpt / "model_assets")
    res = export_cli(str(ckpt), str(tmp_path / "o"), "--model-assets", str(ckpt / "model_assets"))
    assert_clean_failure(res, "E603", "wq.lora_a.weight", "without the fine-tune")
    assert not (tmp_path / "o").exists()
    res = export_cli(str(ckpt), str(tmp_path / "o"), "--format", "lora", "--lora-alpha", "8")
    assert_clean_failure(res, "E603", "no LoRA adapter export exists for torchtitan models")
    assert "--format hf" in res.stderr.strip().splitlines()[-1]


def test_unknown_adapter_is_a_usage_error(titan_named: Path, tmp_path: Path) -> None:
    res = export_cli(str(titan_named / "llama_gqa"), str(tmp_path / "o"), "--adapter", "nope")
    assert res.exit_code == 2 and "torchtitan-llama3" in res.stderr


# ------------------------------------------------------------------------------------------ torchtitan's own adapter


def _titan_to_hf(adapter_cls: type, model_cfg: object, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ad = adapter_cls.__new__(adapter_cls)
    adapter_cls.__init__(ad, model_cfg, None)
    return ad.to_hf(dict(sd))


@pytest.mark.slow
def test_llama3_export_equals_torchtitans_adapter_bitwise(titan_root: Path, tmp_path: Path) -> None:
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from tests.fixtures.writers import LLAMA_CFG, _titan_llama

    src = titan_root / "llama3_fresh" / "checkpoint" / "step-1"
    c = LLAMA_CFG
    ffn = torch_load(src, ["layers.0.feed_forward.w1.weight"])["layers.0.feed_forward.w1.weight"].shape[0]
    cfg = {
        "model_type": "llama",
        "hidden_size": c["dim"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["heads"],
        "vocab_size": c["vocab"],
        "num_hidden_layers": c["layers"],
        "intermediate_size": ffn,
        "tie_word_embeddings": False,
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    res = export_cli(str(src), str(tmp_path / "hf"), "--model-assets", str(tmp_path / "a"))
    assert res.exit_code == 0, res.stderr
    got, _ = read_export(tmp_path / "hf")
    ref = torch_load(src)
    want = _titan_to_hf(
        Llama3StateDictAdapter,
        _titan_llama(),
        {
            k: v
            for k, v in ref.items()
            if "." in k and not k.startswith(("optimizer.", "lr_scheduler", "dataloader", "train_state"))
        },
    )
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.slow
def test_qwen3_moe_export_equals_torchtitans_adapter_bitwise(titan_root: Path, tmp_path: Path) -> None:
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from tests.fixtures.writers import MOE_CFG, _titan_moe

    src = titan_root / "moe" / "checkpoint" / "step-1"
    c = MOE_CFG
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": c["dim"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"],
        "head_dim": c["head_dim"],
        "num_experts": c["experts"],
        "num_experts_per_tok": c["top_k"],
        "moe_intermediate_size": c["hidden"],
        "vocab_size": c["vocab"],
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    ref = torch_load(src)
    model_sd = {
        k: v for k, v in ref.items() if not k.startswith(("optimizer.", "lr_scheduler", "dataloader", "train_state"))
    }
    want = _titan_to_hf(Qwen3StateDictAdapter, _titan_moe(), model_sd)
    for experts in ("per-expert", "fused"):
        out = tmp_path / experts
        res = export_cli(str(src), str(out), "--model-assets", str(tmp_path / "a"), "--experts", experts)
        assert res.exit_code == 0, res.stderr
        got, _ = read_export(out)
        if experts == "per-expert":
            assert set(got) == set(want)
            for k, v in want.items():
                assert torch.equal(got[k], v), k
        else:
            for layer in range(2):
                p = f"model.layers.{layer}.mlp.experts."
                e = c["experts"]
                gate = torch.stack([want[f"{p}{j}.gate_proj.weight"] for j in range(e)])
                up = torch.stack([want[f"{p}{j}.up_proj.weight"] for j in range(e)])
                down = torch.stack([want[f"{p}{j}.down_proj.weight"] for j in range(e)])
                assert torch.equal(got[p + "gate_up_proj"], torch.cat([gate, up], dim=1))
                assert torch.equal(got[p + "down_proj"], down)


def test_adapter_api_is_torch_free_and_invertible() -> None:
    ad = get_adapter("torchtitan-qwen3")
    cfg = AdapterConfig(n_heads=4, n_kv_heads=2, head_dim=8, hidden_size=32, num_experts=8)
    hf = ad.to_hf("layers.3.moe.routed_experts.inner_experts.w3_EFD", (8, 16, 32), cfg)
    assert hf is not None and not isinstance(hf, type(None))
    back = ad.from_hf("model.layers.3.mlp.experts.gate_up_proj", (8, 32, 32), cfg)
    assert isinstance(back, list) and [b.key for b in back] == [
        "layers.3.moe.routed_experts.inner_experts.w1_EFD",
        "layers.3.moe.routed_experts.inner_experts.w3_EFD",
    ]
