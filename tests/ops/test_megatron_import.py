"""``ckpttool import --schema megatron``: HF -> megatron-core ``torch_dist``, loaded by megatron-core itself.

References: ``save_pretrained`` directories of tiny transformers models (Llama with GQA, Qwen3-MoE
with q/k norms and fused experts, ``tests/fixtures/hf_models.py``); megatron-core 0.16.1's own
``dist_checkpointing.load`` of a ``GPTModel``'s full ``sharded_state_dict()`` (every tensor and
``_extra_state`` object) then ``load_state_dict(strict=True)``, on one gloo rank on the CPU with
the device-call shims of ``tests/fixtures/megatron.py`` (no checkpoint code replaced); the
expected megatron tensors built here from the HF tensors with torch ops; megatron's forward of
the loaded model against transformers' logits of the HF model; and the round trip back through
``ckpttool export`` (bitwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.test_import import hf_tensors

pytest.importorskip("megatron.core")
runner = CliRunner()


@pytest.fixture(scope="session")
def hf_dirs(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "import_hf_dirs", hf_models.build_hf_dirs)


_hf = hf_tensors


def _fused(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF keys (``mlp.experts.{j}.gate_proj.weight``, as ``save_pretrained`` writes them) as
    transformers v5's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate first) / ``down_proj [E, H, I]``."""
    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    prefixes = sorted({k.split(".mlp.experts.")[0] for k in hf if ".mlp.experts." in k})
    for p in prefixes:
        n = 1 + max(int(k.split(".mlp.experts.")[1].split(".")[0]) for k in hf if k.startswith(p + ".mlp.experts."))
        e = f"{p}.mlp.experts."
        out[e + "gate_up_proj"] = torch.stack(
            [torch.cat([hf[f"{e}{j}.gate_proj.weight"], hf[f"{e}{j}.up_proj.weight"]]) for j in range(n)]
        )
        out[e + "down_proj"] = torch.stack([hf[f"{e}{j}.down_proj.weight"] for j in range(n)])
    return out


def _load_rank(rank: int, world: int, ckpt: str, hf_dir: str, out: str) -> None:
    """Build the GPTModel the HF config describes, load ``ckpt`` with megatron's own code, save its state and logits."""
    from tests.fixtures.megatron import _device_shims

    _device_shims()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = json.loads((Path(hf_dir) / "config.json").read_text())
    experts = c.get("num_local_experts") or c.get("num_experts")
    moe = {}
    if experts:
        moe = {
            "num_moe_experts": experts,
            "moe_router_topk": c["num_experts_per_tok"],
            "moe_ffn_hidden_size": c["moe_intermediate_size"],
            "moe_token_dispatcher_type": "allgather",
            "moe_aux_loss_coeff": 0.0,
            "moe_router_pre_softmax": not c.get("norm_topk_prob", True),  # softmax, top-k, no renormalisation
        }
    ps.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"],
        kv_channels=c["head_dim"],
        ffn_hidden_size=c["intermediate_size"],
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=c["rms_norm_eps"],
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        qk_layernorm=c["model_type"].startswith("qwen3"),
        **moe,
    )
    tied = bool(c.get("tie_word_embeddings"))
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(num_experts=experts or None, qk_layernorm=cfg.qk_layernorm),
        vocab_size=c["vocab_size"],
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=int(c["rope_parameters"]["rope_theta"]),
        share_embeddings_and_output_weights=tied,
    )
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)  # default strict handling: all must be there
    assert loaded["iteration"] == 0 and loaded["checkpoint_version"] == 3.0
    model.load_state_dict({k: v for k, v in loaded.items() if k not in ("iteration", "checkpoint_version")})
    ref = torch.load(Path(hf_dir) / "reference.pt", weights_only=True)
    ids = ref["ids"]
    seq = ids.shape[1]
    pos = torch.arange(seq).unsqueeze(0).expand(ids.shape[0], seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    model.eval()
    with torch.no_grad():
        logits = model(ids, pos, mask).float()
    sd = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"state": sd, "logits": logits}, Path(out) / "megatron.pt")
    ps.destroy_model_parallel()


def _expected(hf: dict[str, torch.Tensor], c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The megatron GPTModel ``state_dict()`` (local spec) the HF tensors make, built with torch ops."""
    nq, ng, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not c.get("tie_word_embeddings"):
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(c["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[h + "self_attn.q_proj.weight"].view(ng, nq // ng * hd, -1)
        k = hf[h + "self_attn.k_proj.weight"].view(ng, hd, -1)
        v = hf[h + "self_attn.v_proj.weight"].view(ng, hd, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, q.shape[-1])
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if h + "self_attn.q_norm.weight" in hf:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        if h + "mlp.gate.weight" in hf:
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            for e in range(hf[h + "mlp.gate.weight"].shape[0]):
                x = f"{m}mlp.experts.local_experts.{e}."
                out[x + "linear_fc1.weight"] = hf[h + "mlp.experts.gate_up_proj"][e]
                out[x + "linear_fc2.weight"] = hf[h + "mlp.experts.down_proj"][e]
        else:
            gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
            out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
            out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


@pytest.mark.heavy  # a spawned rank importing megatron-core: ~25 s each
@pytest.mark.parametrize(("name", "world"), [("llama", 2), ("llama_tied", 1), ("qwen_moe", 1)])
def test_import_megatron_loads_with_megatron_core(hf_dirs: Path, tmp_path: Path, name: str, world: int) -> None:
    """megatron-core loads every tensor and ``_extra_state`` (strict), equal to the HF tensors; same logits."""
    from tests.fixtures.distributed import run_ranks

    src = hf_dirs / name
    out = tmp_path / "mg"
    r = runner.invoke(app, ["import", str(src), str(out), "--schema", "megatron", "--world-size", str(world), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["key_schema"] == "megatron" and doc["adapter"] == "megatron-gpt"
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    run_ranks(1, _load_rank, str(out), str(src), str(tmp_path))
    got = torch.load(tmp_path / "megatron.pt", weights_only=True)
    c = json.loads((src / "config.json").read_text())
    want = _expected(_fused(_hf(src)), c)
    assert set(got["state"]) == set(want)
    for k, v in want.items():
        assert torch.equal(got["state"][k], v), k
    ref = torch.load(src / "reference.pt", weights_only=True)["logits"]
    torch.testing.assert_close(got["logits"], ref, atol=1e-4, rtol=1e-4)


def test_import_megatron_round_trips_through_export(hf_dirs: Path, tmp_path: Path) -> None:
    """HF -> megatron -> HF (the adapter's export direction) gives back the HF tensors bitwise."""
    src = hf_dirs / "qwen_moe"
    out = tmp_path / "mg"
    assert runner.invoke(app, ["import", str(src), str(out), "--schema", "megatron"]).exit_code == 0
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0 and "megatron" in r.output
    r = runner.invoke(app, ["validate", str(out), "--strict", "--deep"])
    assert r.exit_code == 0, r.output
    back = tmp_path / "hf"
    r = runner.invoke(app, ["export", str(out), str(back), "--model-assets", str(src)])
    assert r.exit_code == 0, r.output
    a, b = _fused(_hf(src)), _hf(back)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_import_megatron_then_per_expert_export_gives_the_saved_files_back(hf_dirs: Path, tmp_path: Path) -> None:
    """transformers saves Qwen3-MoE's experts per expert (``mlp.experts.{j}.gate_proj.weight``); HF -> megatron -> HF
    came back fused only (``export --experts per-expert`` was E601 for megatron's stacked experts). Now the export
    with ``--experts per-expert`` is the source's safetensors bitwise, every key and dtype, from a 3-rank import."""
    src = hf_dirs / "qwen_moe"
    out = tmp_path / "mg"
    r = runner.invoke(app, ["import", str(src), str(out), "--schema", "megatron", "--world-size", "3"])
    assert r.exit_code == 0, r.output
    back = tmp_path / "hf"
    args = ["--model-assets", str(src), "--experts", "per-expert"]
    r = runner.invoke(app, ["export", str(out), str(back), *args])
    assert r.exit_code == 0, r.output
    a, b = _hf(src), _hf(back)
    assert any(".mlp.experts.0.gate_proj." in k for k in a) and set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    # diff splits the stacked experts as that export does: every value of the source compared (was 52 "differences")
    r = runner.invoke(app, ["diff", str(out), str(src), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)["summary"]
    assert summary["tensors"] == summary["equal"] == len(a) and summary["differ"] == 0, summary


def test_validate_config_counts_megatrons_stacked_layers_and_its_head(hf_dirs: Path, tmp_path: Path) -> None:
    """``validate --config`` of a megatron checkpoint (an import's, and megatron-core's own save) with the model's
    config.json failed: M001 "no model key has a layers.<N> component" (the layers are stacked, ``decoder.layers.*``
    ``[L, ...]``) and M004 "lm_head.weight is missing" (the head is ``output_layer.weight``). Both now read the
    layers and the head ``export`` writes through the megatron-gpt adapter: clean with the right config, and still
    reported with a config of 3 layers or an untied head."""
    from tests.ops.test_megatron_export import DATA, _assets

    src = hf_dirs / "qwen_moe"
    out = tmp_path / "mg"
    assert (
        runner.invoke(app, ["import", str(src), str(out), "--schema", "megatron", "--world-size", "3"]).exit_code == 0
    )
    r = runner.invoke(app, ["validate", str(out), "--strict", "--config", str(src / "config.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((DATA / "moe_ep2" / "model.json").read_text())
    assets = _assets(tmp_path, True, doc)
    r = runner.invoke(app, ["validate", str(DATA / "moe_ep2"), "--strict", "--config", str(assets / "config.json")])
    assert r.exit_code == 0, r.output

    def findings(ckpt: Path, cfg: dict[str, Any]) -> list[tuple[str, str]]:
        (tmp_path / "c.json").write_text(json.dumps(cfg))
        args = ["--config", str(tmp_path / "c.json"), "--select", "M001,M004", "--json"]
        r = runner.invoke(app, ["validate", str(ckpt), *args])
        assert r.exit_code == 1, r.output
        return [(f["code"], f["message"]) for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"]

    c = json.loads((src / "config.json").read_text())
    assert findings(out, {**c, "num_hidden_layers": 3}) == [
        (
            "M001",
            "model.layers: has layers 0..1 (the layers export writes through megatron-gpt), config num_hidden_layers 3: "
            "missing 2 (indices restart at 0: stage-local numbering of one pipeline stage?)",
        )
    ]
    tied = tmp_path / "tied"
    assert runner.invoke(app, ["import", str(hf_dirs / "llama_tied"), str(tied), "--schema", "megatron"]).exit_code == 0
    c = json.loads((hf_dirs / "llama_tied" / "config.json").read_text())
    assert findings(tied, {**c, "tie_word_embeddings": False}) == [
        ("M004", "lm_head.weight is missing and tie_word_embeddings is not true")
    ]


def test_import_megatron_refuses_what_megatron_has_no_place_for(hf_dirs: Path, tmp_path: Path) -> None:
    """An HF tensor megatron's GPTModel has no key for, or a missing layer: E601, nothing written."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    hf = _hf(hf_dirs / "llama")
    (src / "config.json").write_text((hf_dirs / "llama" / "config.json").read_text())
    bad = dict(hf, **{"model.layers.0.mlp.shared_expert.weight": torch.zeros(2, 2)})
    save_file(bad, str(src / "model.safetensors"))
    r = runner.invoke(app, ["import", str(src), str(tmp_path / "o1"), "--schema", "megatron"])
    assert r.exit_code != 0 and "E601" in r.output and "shared_expert" in r.output
    assert not (tmp_path / "o1").exists()
    partial = {k: v for k, v in hf.items() if not k.startswith("model.layers.1.mlp.up_proj")}
    save_file(partial, str(src / "model.safetensors"))
    r = runner.invoke(app, ["import", str(src), str(tmp_path / "o2"), "--schema", "megatron"])
    assert r.exit_code != 0 and "E601" in r.output and "model.layers.1.mlp.up_proj.weight" in r.output
    assert not (tmp_path / "o2").exists()


def test_import_megatron_of_dense_layers_beside_moe_layers_names_them(tmp_path: Path) -> None:
    """A Qwen3-MoE whose layer 0 is dense (``mlp_only_layers``, saved by ``save_pretrained``): ``import --schema
    megatron`` said "model.layers.0.mlp.experts.0.gate_proj.weight: missing from the HF model", the hint "the HF
    checkpoint is incomplete", of a complete folder. Now the one E601 line names the dense layer and the MoE layer;
    the import its hint names (torch-native) loads into the model with torch's dcp.load, every tensor bitwise."""
    import torch.distributed.checkpoint as dcp
    from transformers import Qwen3MoeForCausalLM

    cfg = hf_models.qwen_moe_config()
    cfg.mlp_only_layers = [0]
    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    r = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "mg"), "--schema", "megatron"])
    assert r.exit_code == 2 and not (tmp_path / "mg").exists(), r.output
    err, hint = r.stderr.strip().splitlines()
    assert err.startswith(
        "error: [E601] model.layers.0.mlp.gate_proj.weight: layer 0 has a dense MLP while layer 1 has experts"
    ), err
    assert hint.startswith("hint: import it with --schema torch-native"), hint
    r = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "native")])
    assert r.exit_code == 0, r.output
    want = model.state_dict()
    sd = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "native"), no_dist=True)
    assert all(torch.equal(sd["model"][k], v) for k, v in want.items())


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_import_megatron_of_a_model_tied_to_another_embedding_is_refused_by_key(tmp_path: Path, family: str) -> None:
    """GPT-2 (`transformer.wte.weight`) and OPT (`model.decoder.embed_tokens.weight`) saved by save_pretrained, their
    tied head left out: `import --schema megatron` stopped with `[E999] internal error: ValueError: list.remove(x)`
    (it dropped the tied head's note as written from `model.embed_tokens.weight` only). Now the one line E601 names
    the first tensor megatron's GPTModel has no key for; nothing is written."""
    hf_models.tiny_tied_model(family).save_pretrained(tmp_path / "hf")
    r = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "mg"), "--schema", "megatron"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: [E601] ") and "not a tensor of a megatron-core GPTModel" in lines[0], lines
    assert lines[1].startswith("hint: ") and len(lines) == 2, lines
    assert not (tmp_path / "mg").exists()


def test_import_megatron_of_a_mixtral_saved_by_transformers(tmp_path: Path) -> None:
    """transformers 5 saves Mixtral's experts as `block_sparse_moe.experts.{j}.w1/w3/w2.weight`: `import --schema
    megatron` refused them (E601 'not a tensor of a megatron-core GPTModel') though its hint names Mixtral. Now
    read through the registered per-expert form: HF -> megatron -> HF (the megatron adapter's export) is the
    model's own state_dict bitwise, and transformers loads it with identical logits."""
    from transformers import AutoModelForCausalLM

    from tests.ops.test_import import _mixtral

    _, want, ids, logits = _mixtral(tmp_path / "src")
    out = tmp_path / "mg"
    r = runner.invoke(app, ["import", str(tmp_path / "src"), str(out), "--schema", "megatron"])
    assert r.exit_code == 0, r.output
    back = tmp_path / "hf"
    r = runner.invoke(app, ["export", str(out), str(back), "--model-assets", str(tmp_path / "src")])
    assert r.exit_code == 0, r.output
    got = _hf(back)
    assert set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    model = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
