"""Export of Megatron-core ``torch_dist`` checkpoints to HF (adapter ``megatron-gpt``), checked by logits.

The checkpoints are written by megatron-core's own code (``tests/fixtures/megatron.py``: device-call
shims only), which also stored megatron's own forward (``GPTModel``, the saved weights, gathered
over TP) of a fixed input in ``model.json``. The export is loaded by transformers as the
equivalent ``LlamaForCausalLM`` (dense) / ``MixtralForCausalLM`` (MoE: the same softmax-top-k
router) and must give the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.adapters import AdapterConfig, get_adapter

DATA = Path(__file__).parent.parent / "fixtures" / "megatron_data"
runner = CliRunner()


def _assets(tmp: Path, moe: bool, doc: dict) -> Path:
    from transformers import LlamaConfig, MixtralConfig

    m = doc["model"]
    common = {
        "vocab_size": doc["vocab"],
        "hidden_size": m["hidden"],
        "intermediate_size": m["ffn"],
        "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["groups"],
        "head_dim": m["hidden"] // m["heads"],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    cfg = (
        MixtralConfig(num_local_experts=m["experts"], num_experts_per_tok=m["topk"], **common)
        if moe
        else LlamaConfig(**common)
    )
    out = tmp / "assets"
    cfg.save_pretrained(out)
    return out


@pytest.mark.parametrize(("run", "atol"), [("dense1", 1e-5), ("dense_tp2", 1e-2), ("moe_ep2", 1e-5)])
def test_export_logits_equal_megatron(tmp_path: Path, run: str, atol: float) -> None:
    from transformers import AutoModelForCausalLM

    doc = json.loads((DATA / run / "model.json").read_text())
    assets = _assets(tmp_path, doc["run"]["moe"], doc)
    out = tmp_path / "hf"
    r = runner.invoke(app, ["export", str(DATA / run), str(out), "--model-assets", str(assets)])
    assert r.exit_code == 0, r.output
    assert "megatron-gpt" in r.output
    dtype = torch.bfloat16 if doc["run"]["bf16"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(torch.tensor(doc["input_ids"])).logits.float()
    ref = torch.tensor(doc["logits"])
    assert logits.shape == ref.shape
    assert torch.allclose(logits, ref, atol=atol, rtol=0), (logits - ref).abs().max()


def test_qkv_split_follows_the_gqa_layout() -> None:
    # 2 query groups of 2 query heads, head_dim 1: rows q0 q1 k0 v0 | q2 q3 k1 v1
    ad = get_adapter("megatron-gpt")
    cfg = AdapterConfig(n_heads=4, n_kv_heads=2, head_dim=1, hidden_size=1)
    hf = ad.to_hf("decoder.layers.self_attention.linear_qkv.weight", (1, 8, 1), cfg)
    assert [p[0].rsplit(".", 2)[-2] for p in hf.pieces] == ["q_proj", "k_proj", "v_proj"]
    src = list(range(8))
    outs: list[list[int | None]] = [[None] * p[1][0] for p in hf.pieces]
    for s, n, piece, d in hf.runs:
        outs[piece][d : d + n] = src[s : s + n]
    assert outs == [[0, 1, 4, 5], [2, 6], [3, 7]]


def test_linear_qkv_needs_the_heads(tmp_path: Path) -> None:
    r = runner.invoke(app, ["export", str(DATA / "dense1"), str(tmp_path / "o")])
    assert r.exit_code != 0
    assert "linear_qkv" in r.output and "config.json" in r.output
    assert not (tmp_path / "o").exists()


def test_diff_against_the_export(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    doc = json.loads((DATA / "moe_ep2" / "model.json").read_text())
    out = tmp_path / "hf"
    r = runner.invoke(
        app, ["export", str(DATA / "moe_ep2"), str(out), "--model-assets", str(_assets(tmp_path, True, doc))]
    )
    assert r.exit_code == 0, r.output
    same = runner.invoke(app, ["diff", str(DATA / "moe_ep2"), str(out)])
    assert same.exit_code == 0 and "equal" in same.output, same.output
    f = out / "model.safetensors"
    sd = load_file(f)
    key = "model.layers.1.self_attn.k_proj.weight"  # a piece of the stacked, GQA-fused linear_qkv
    sd[key] = sd[key].clone()
    sd[key][3, 5] += 1.0
    save_file(sd, f, metadata={"format": "pt"})
    differ = runner.invoke(app, ["diff", str(DATA / "moe_ep2"), str(out)])
    assert differ.exit_code == 1, differ.output
    assert key in differ.output


def test_per_expert_export_of_stacked_experts_loads_as_the_fused_export(tmp_path: Path) -> None:
    """``--experts per-expert`` of megatron's stacked experts ``[L, E, 2I, H]`` was refused (E601 "this model adapter
    writes fused expert tensors only"), so an HF model imported with ``--schema megatron`` never came back as the
    per-expert files ``save_pretrained`` wrote. It now writes each expert under the names a Mixtral ``save_pretrained``
    gives (``block_sparse_moe.experts.{j}.w1/w3/w2.weight``): transformers loads the same weights as from the fused
    export (its own key conversion), and ``diff`` finds it equal to the megatron checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    doc = json.loads((DATA / "moe_ep2" / "model.json").read_text())
    assets = _assets(tmp_path, True, doc)
    fused, split = tmp_path / "fused", tmp_path / "split"
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(fused), "--model-assets", str(assets)])
    assert r.exit_code == 0, r.output
    args = ["--model-assets", str(assets), "--experts", "per-expert"]
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(split), *args])
    assert r.exit_code == 0, r.output
    got = load_file(split / "model.safetensors")
    n, e = doc["model"]["layers"], doc["model"]["experts"]
    names = {
        f"model.layers.{i}.block_sparse_moe.experts.{j}.w{w}.weight"
        for i in range(n)
        for j in range(e)
        for w in (1, 2, 3)
    }
    assert names <= set(got) and not any(".mlp.experts." in k for k in got), sorted(got)
    want = load_file(fused / "model.safetensors")
    for i in range(n):
        up, down = want[f"model.layers.{i}.mlp.experts.gate_up_proj"], want[f"model.layers.{i}.mlp.experts.down_proj"]
        half = up.shape[1] // 2
        for j in range(e):
            x = f"model.layers.{i}.block_sparse_moe.experts.{j}."
            assert torch.equal(got[x + "w1.weight"], up[j, :half]) and torch.equal(got[x + "w3.weight"], up[j, half:])
            assert torch.equal(got[x + "w2.weight"], down[j])
    a = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(split, dtype=torch.float32).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    same = runner.invoke(app, ["diff", str(DATA / "moe_ep2"), str(split)])
    assert same.exit_code == 0 and "equal" in same.output, same.output


def test_quantized_fused_experts_warning_gives_advice_that_works(tmp_path: Path) -> None:
    """``--quantize`` of megatron's stacked experts writes fused FP8 experts (the adapter has no per-expert split);
    the warning that vLLM refuses them told the user to export with ``--experts per-expert``, which this adapter
    refuses (E601 "fused expert tensors only"). It now names ``--quantize-skip '*.experts.*'``, which exports
    the experts unquantized, with no warning, and lists their modules in ``modules_to_not_convert``. The default
    128 blocks hold all 96 rows of a fused ``gate_up_proj`` in one (E100: transformers' FP8Experts takes a scale row
    per half); the hint names a block, without ``--experts per-expert``, and the export with it is written."""
    from safetensors import safe_open

    doc = json.loads((DATA / "moe_ep2" / "model.json").read_text())
    assets = _assets(tmp_path, True, doc)
    args = ["--model-assets", str(assets), "--quantize", "fp8-block", "--json"]
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(tmp_path / "fp8"), *args])
    assert r.exit_code == 2 and "[E100] --quantize-block 128: fused" in r.stderr, r.output
    assert r.stderr.splitlines()[-1] == "hint: quantize with --quantize-block 16 (blocks within each half)"
    args += ["--quantize-block", "16"]
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(tmp_path / "fp8"), *args])
    assert r.exit_code == 0, r.output
    (w,) = [w for w in json.loads(r.stdout)["warnings"] if "fused expert tensor(s) quantized" in w]
    assert "`experts` per-expert (the default" not in w and "`quantize_skip` '*.experts.*'" in w, w
    r = runner.invoke(
        app, ["export", str(DATA / "moe_ep2"), str(tmp_path / "skip"), *args, "--quantize-skip", "*.experts.*"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["warnings"] == []
    with safe_open(str(tmp_path / "skip" / "model.safetensors"), "pt") as f:
        experts = {k: f.get_tensor(k).dtype for k in f.keys() if ".experts." in k}
    assert experts and set(experts.values()) == {torch.bfloat16}, experts
    qc = json.loads((tmp_path / "skip" / "config.json").read_text())["quantization_config"]
    assert {f"model.layers.{n}.mlp.experts" for n in range(doc["model"]["layers"])} <= set(qc["modules_to_not_convert"])


def test_compressed_tensors_refusal_of_fused_experts_gives_advice_that_works(tmp_path: Path) -> None:
    """``--quant-format compressed-tensors`` has no fused-expert layout, and megatron's stacked experts export fused
    only: the refusal's hint named ``--experts per-expert``, which this adapter refuses in turn. It names what works
    here: ``--quant-format fp8`` or ``--quantize-skip '*.experts.*'`` (followed, the export is written)."""
    doc = json.loads((DATA / "moe_ep2" / "model.json").read_text())
    assets = _assets(tmp_path, True, doc)
    args = ["--model-assets", str(assets), "--quantize", "fp8-block", "--quant-format", "compressed-tensors"]
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(tmp_path / "ct"), *args])
    assert r.exit_code == 2 and not (tmp_path / "ct").exists(), r.output
    err, hint = r.stderr.splitlines()[:2]
    assert err.startswith("error: [E601]") and "no fused-expert layout" in err, err
    assert hint == "hint: export with --quant-format fp8, or leave the experts unquantized with --quantize-skip " + (
        "'*.experts.*'"
    ), hint
    r = runner.invoke(
        app, ["export", str(DATA / "moe_ep2"), str(tmp_path / "skip"), *args, "--quantize-skip", "*.experts.*"]
    )
    assert r.exit_code == 0, r.output


@pytest.mark.heavy  # CI time: the same band path runs in test_export_quant_experts
def test_fused_experts_quantized_from_stacked_layers(tmp_path: Path) -> None:
    """``--quantize fp8-block``: the stacked ``linear_fc1 [L, E, 2I, H]`` becomes each layer's fused
    ``experts.gate_up_proj [E, 2I, H]`` quantized per expert (blocks of 20 rows: a block holds gate and up rows);
    bytes equal torch's quantization of the plain export's experts; logits vs megatron's within the MoE tolerance."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.ops.export.test_export_fp8 import _file_tensors, _torch_reader_load
    from tests.ops.export.test_export_quant_experts import _assert_experts

    doc = json.loads((DATA / "moe_ep2" / "model.json").read_text())
    assets = _assets(tmp_path, True, doc)
    plain, out = tmp_path / "plain", tmp_path / "fp8"
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(plain), "--model-assets", str(assets)])
    assert r.exit_code == 0, r.output
    args = ["--model-assets", str(assets), "--quantize", "fp8-block", "--quantize-block", "20", "--json"]
    r = runner.invoke(app, ["export", str(DATA / "moe_ep2"), str(out), *args])
    assert r.exit_code == 0, r.output
    src, files = _file_tensors(plain), _file_tensors(out)
    quantized = json.loads(r.stdout)["quantization"]["tensors"]
    sd = {k: v.float() for k, v in files.items() if not k.endswith("_scale_inv") and k + "_scale_inv" not in files}
    sd |= _torch_reader_load(out, {k: files[k] for k in quantized if k.endswith(".weight")}, 20)
    for layer in range(doc["model"]["layers"]):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            assert key in quantized
            sd[key] = _assert_experts(files, key, src[key], 20)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    with torch.no_grad():
        got = model(torch.tensor(doc["input_ids"])).logits.float()
    want = torch.tensor(doc["logits"])
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert cos >= 0.9 and 0 < rel <= 0.5, (cos, rel)  # the MoE tolerance of test_export_quant_ct


def test_extra_state_items_left_out_are_named(tmp_path: Path) -> None:
    """The 8 modules' _extra_state items of a real torch_dist save were left out of the export without a word
    (neither written nor named); a note names them now."""
    doc = json.loads((DATA / "dense_tp2" / "model.json").read_text())
    assets = _assets(tmp_path, False, doc)
    r = runner.invoke(
        app,
        [
            "export",
            "--json",
            str(DATA / "dense_tp2" / "iter_0000003"),
            str(tmp_path / "hf"),
            "--model-assets",
            str(assets),
        ],
    )
    assert r.exit_code == 0, r.output
    (note,) = [n for n in json.loads(r.stdout)["notes"] if n.startswith("8 module _extra_state item(s) not exported")]
    assert "(e.g. decoder.layers." in note and "not weights" in note, note
