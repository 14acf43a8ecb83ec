"""Keys, shapes and dtypes against the model class transformers builds from config.json (meta device).

Each case that used to export with exit 0 and fail (or load a random model) in `from_pretrained`
is refused by `export --model-assets` (E605) and found by `validate --config` (M010).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.fixtures import hf_models
from tests.fixtures.special_files import SPECIAL_KINDS, fails_instead_of_hanging, make_special
from tests.ops.export.test_export import assert_clean_failure, export_cli
from tests.ops.export.test_export_consumers import llama_ckpt  # noqa: F401  (session fixture)
from tests.ops.validate.test_validate_model import run as validate


def _resave(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    md = dcp.FileSystemReader(str(src)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    dcp.load(sd, checkpoint_id=str(src), no_dist=True)
    model = edit({k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")})
    dcp.save({"model": model}, checkpoint_id=str(dst))
    return dst


def _rank_local(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    emb = sd["model.embed_tokens.weight"]
    sd["model.embed_tokens.weight"] = emb.reshape(-1)[: emb.numel() // 4].clone()  # one rank's flat shard
    sd["model.norm.weight"] = torch.empty(0)
    return sd


def test_rank_local_embedding_and_empty_norm_are_refused(llama_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    src = _resave(llama_ckpt, tmp_path / "ck", _rank_local)
    assets = llama_ckpt / "model_assets"
    res = export_cli(str(src), str(tmp_path / "o"), "--model-assets", str(assets))
    assert_clean_failure(res, "E605", "LlamaForCausalLM", "model.embed_tokens.weight: [768]", "model.norm.weight: [0]")
    assert not (tmp_path / "o").exists()
    rc, doc = validate(src, "--config", assets / "config.json")
    m010 = [f for f in doc["findings"] if f["code"] == "M010"]
    assert rc == 1 and {f["key"] for f in m010} == {"model.embed_tokens.weight", "model.norm.weight"}, m010
    # explicitly allowed: written, reported
    res = export_cli(
        str(src), str(tmp_path / "o"), "--model-assets", str(assets), "--allow-mismatch", "shape", "--json"
    )
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["model_check"]["findings"]["shape"]


def _two_of_four_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for j in range(2):
                g, u = v[j].chunk(2, dim=0)
                out[f"{p}{j}.gate_proj.weight"], out[f"{p}{j}.up_proj.weight"] = g.clone(), u.clone()
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for j in range(2):
                out[f"{p}{j}.down_proj.weight"] = v[j].clone()
        elif k.endswith("mlp.gate.weight"):
            out[k] = v[:4].clone()
        else:
            out[k] = v
    return out


def test_per_expert_keys_for_two_of_four_experts_are_refused(fixture_root: Path, tmp_path: Path) -> None:
    from tests.fixtures.cache import cached_build

    qwen = cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)
    src = _resave(qwen, tmp_path / "ck", _two_of_four_experts)
    cfg = json.loads((qwen / "model_assets" / "config.json").read_text())
    cfg["num_experts"] = 4
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    res = export_cli(str(src), str(tmp_path / "o"), "--model-assets", str(tmp_path / "a"))
    # folded as transformers loads per-expert keys: a fused experts tensor of 2 experts, not the class's
    assert_clean_failure(res, "E605", "Qwen3MoeForCausalLM", "shape", "mlp.experts.gate_up_proj: [2, 32, 32]")
    rc, doc = validate(src, "--config", tmp_path / "a" / "config.json")
    assert rc == 1 and any(f["code"] == "M010" for f in doc["findings"])


def test_without_transformers_the_check_is_reported_not_silent(
    llama_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.setenv("CKPTTOOL_NO_CACHE", "1")  # no model-shape cache entry of an earlier test
    res = export_cli(str(llama_ckpt), str(tmp_path / "o"), "--model-assets", str(llama_ckpt / "model_assets"), "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (
        doc["model_check"]["checked"] is False and "transformers is not installed" in doc["model_check"]["not_checked"]
    )
    assert any("not checked against the model class" in w for w in doc["warnings"])
    _, vdoc = validate(llama_ckpt, "--config", llama_ckpt / "model_assets" / "config.json")
    assert any(f["code"] == "M011" and "transformers is not installed" in f["message"] for f in vdoc["findings"])


def test_good_export_is_checked_and_clean(llama_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    res = export_cli(str(llama_ckpt), str(tmp_path / "o"), "--model-assets", str(llama_ckpt / "model_assets"), "--json")
    assert res.exit_code == 0, res.stderr
    check = json.loads(res.stdout)["model_check"]
    assert check == {"checked": True, "model_class": "LlamaForCausalLM", "not_checked": None, "findings": {}}


_SMALL_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


@pytest.mark.heavy  # CI time: fresh processes importing transformers
def test_model_shapes_are_cached_and_a_hit_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import json, sys\n"
        "from ckpttool.ops.export.expected import expected_state_dict\n"
        f"got = expected_state_dict({_SMALL_LLAMA!r})\n"
        "print(json.dumps([sorted((k, list(v[0]), v[1]) for k, v in got[0].items()), sorted(got[1]), got[2],"
        " sorted(got[3]),"
        " 'torch' in sys.modules, 'transformers' in sys.modules]))\n"
    )
    env = {**__import__("os").environ, "CKPTTOOL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CKPTTOOL_NO_CACHE", None)
    first, second = (
        json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout)
        for _ in range(2)
    )
    assert first[:4] == second[:4] and first[2] == "LlamaForCausalLM" and "lm_head.weight" in first[1]
    assert first[3] == ["model.embed_tokens.weight"], "the one 2-D weight of a module that is no nn.Linear"
    assert first[4:] == [True, True], "a miss builds the model with transformers"
    assert second[4:] == [False, False], "a hit reads the entry only"
    assert len(list((tmp_path / "cache" / "model-shapes-v1").glob("*.json"))) == 1


@pytest.mark.parametrize(
    "bad",
    [
        b"garbage",
        b"[" * 100000,
        b'{"format": 2, "key": "another", "model_class": "X", "tensors": {}, "optional": [], "not_linear": []}',
        b'{"format": 2, "key": "@", "model_class": "X", "tensors": {"a": [[-1], "float32"]}, "optional": [], "not_linear": []}',
        b'{"format": 2, "key": "@", "model_class": "X", "tensors": {"a": [[2], "evil"]}, "optional": [], "not_linear": []}',
        b'{"format": 2, "key": "@", "model_class": "X", "tensors": {"a": [[2], "float32"]}, "optional": ["b"], "not_linear": []}',
        b'{"format": 2, "key": "@", "model_class": "os.system", "tensors": {}, "optional": [], "not_linear": []}',
        b'{"format": 2, "key": "@", "model_class": "X", "tensors": {"a": [[true], "float32"]}, "optional": [], "not_linear": []}',
        b'{"format": 1, "key": "@", "model_class": "X", "tensors": {}, "optional": []}',  # before not_linear
        b'{"format": 2, "key": "@", "model_class": "X", "tensors": {"a": [[2, 2], "float32"]}, "optional": [], "not_linear": ["b"]}',
        b'{"format": 2, "key": "@", "model_class": "X", "tensors": {}, "optional": [], "not_linear": "a"}',
        b'{"format": 4, "key": "@", "model_class": "X", "tensors": {}, "optional": [], "not_linear": []}',
        b'{"format": 4, "key": "@", "model_class": "X", "tensors": {}, "optional": [], "not_linear": [], "ignored": ["("]}',
        b'{"format": 4, "key": "@", "model_class": "X", "tensors": {}, "optional": [], "not_linear": [], "ignored": [1]}',
    ],
)
def test_a_broken_or_hostile_cache_entry_is_ignored_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: bytes
) -> None:
    from ckpttool.ops.export import expected as ex

    monkeypatch.setenv("CKPTTOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CKPTTOOL_NO_CACHE", "1")
    want = ex.expected_state_dict(dict(_SMALL_LLAMA))
    monkeypatch.delenv("CKPTTOOL_NO_CACHE")
    versions = ex._versions()
    assert versions is not None and not isinstance(want, str)
    key = ex._entry_key(dict(_SMALL_LLAMA), versions)
    assert key is not None
    path = ex.shapes_entry_path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(bad.replace(b'"@"', json.dumps(key).encode()))
    assert ex.expected_state_dict(dict(_SMALL_LLAMA)) == want
    assert ex._load_entry(path, key) == want, "the entry was written again, valid"


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("special", SPECIAL_KINDS)
def test_a_special_file_as_cache_entry_neither_blocks_nor_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, special: str
) -> None:
    from ckpttool.ops.export import expected as ex

    monkeypatch.setenv("CKPTTOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CKPTTOOL_NO_CACHE", raising=False)
    versions = ex._versions()
    assert versions is not None
    key = ex._entry_key(dict(_SMALL_LLAMA), versions)
    assert key is not None
    path = ex.shapes_entry_path(key)
    path.parent.mkdir(parents=True)
    make_special(path, special)
    with fails_instead_of_hanging():
        assert ex._load_entry(path, key) is None


class _ByteStateLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose ``get_extra_state`` is Transformer Engine's (>= 2.0) form: its state pickled into a
    ``uint8`` tensor, which ``state_dict`` saves as ``<module>._extra_state``."""

    def get_extra_state(self) -> torch.Tensor:
        import pickle

        return torch.frombuffer(
            bytearray(pickle.dumps({"scale_fwd": [1.0, 2.0], "recipe": "delayed"})), dtype=torch.uint8
        )

    def set_extra_state(self, state: torch.Tensor) -> None:
        pass


def test_a_module_extra_state_saved_as_a_tensor_is_listed_not_written(tmp_path: Path) -> None:
    """Transformer Engine (>= 2.0) saves a module's FP8 state as a pickled uint8 tensor ``<module>._extra_state``,
    which torch's state_dict puts among the model's tensors. Before, `export` wrote it into model.safetensors as a
    weight (no word said) and, with `--model-assets`, refused the export (E605 "unexpected"), although docs/export.md
    says extra state is never exported. Now it is listed under "not exported" with its reason and the export loads
    in transformers with the model's logits."""
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(7)
    cfg = hf_models.llama_config()
    model = LlamaForCausalLM(cfg).eval()
    old = model.model.layers[0].mlp.down_proj
    te = _ByteStateLinear(old.in_features, old.out_features, bias=False)
    te.weight = old.weight
    model.model.layers[0].mlp.down_proj = te
    sd = dict(model.state_dict())
    key = "model.layers.0.mlp.down_proj._extra_state"
    assert sd[key].dtype == torch.uint8 and sd[key].numel() > 0
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"))
    cfg.save_pretrained(tmp_path / "assets")

    for out, extra in (("plain", ()), ("checked", ("--model-assets", str(tmp_path / "assets")))):
        res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / out), "--json", *extra)
        assert res.exit_code == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["skipped"] == {
            "a module's extra state (`_extra_state`: Transformer Engine's FP8 scaling state), not weights": {
                "count": 1,
                "keys": ["model." + key],
            }
        }
        written = json.loads((tmp_path / out / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(written) == sorted(k for k in sd if k != key)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "checked").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_rotary_inv_freq_buffers_from_pretrained_drops_are_exported_not_refused(tmp_path: Path) -> None:
    """Llama checkpoints saved by transformers < 4.31 hold each layer's ``self_attn.rotary_emb.inv_freq`` buffer (now
    a non-persistent ``model.rotary_emb.inv_freq``); ``from_pretrained`` drops such keys without a word. Before,
    `export --model-assets` refused them (E605 "unexpected", although the export without a config wrote them);
    now they are exported, the model check passes and transformers loads the export with the model's logits. A key
    transformers would not drop stays E605."""
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(8)
    cfg = hf_models.llama_config()
    model = LlamaForCausalLM(cfg).eval()
    sd = dict(model.state_dict())
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    sd.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq for i in range(cfg.num_hidden_layers)})
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"))
    cfg.save_pretrained(tmp_path / "assets")

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "o"), "--model-assets", str(tmp_path / "assets"), "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model_check"]["checked"] and doc["model_check"]["findings"] == {}
    assert doc["tensors"] == len(sd) and doc["skipped"] == {}
    loaded, info = LlamaForCausalLM.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)

    sd["model.layers.0.self_attn.rotary_emb.scale"] = inv_freq
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt2"))
    res = export_cli(str(tmp_path / "ckpt2"), str(tmp_path / "o2"), "--model-assets", str(tmp_path / "assets"))
    assert_clean_failure(res, "E605", "unexpected 1: model.layers.0.self_attn.rotary_emb.scale")
