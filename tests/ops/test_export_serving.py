"""Serving-ready exports: ``config.json`` follows the weights written (docs/export.md, "`--model-assets DIR`").

The model assets are what transformers' own ``save_pretrained`` writes for the FP32 model (``"dtype":
"float32"``); exported with ``--save-dtype bf16``, ``AutoModelForCausalLM.from_pretrained(out,
dtype="auto")`` must build BF16 parameters holding the exported bytes, not FP32 copies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format.safetensors import HeaderEntry
from ckpttool.ops.export.serving import dominant_dtype, rounded_on_load, serving_config
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()


@pytest.fixture(scope="module")
def llama_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama", hf_models.build_llama)


@pytest.fixture(scope="module")
def saved_assets(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json as ``LlamaForCausalLM.save_pretrained`` writes it for the FP32 model."""
    from transformers import AutoConfig, LlamaForCausalLM

    hf_models._quiet()
    base = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(AutoConfig.from_pretrained(llama_ckpt / "model_assets")).save_pretrained(base / "model")
    assets = base / "assets"
    assets.mkdir()
    shutil.copy(base / "model" / "config.json", assets / "config.json")
    return assets


def export(*args: object):  # type: ignore[no-untyped-def]
    res = runner.invoke(app, ["export", *map(str, args)])
    assert res.exit_code == 0, res.stderr
    return res


def test_bf16_export_loads_as_bf16_with_dtype_auto(llama_ckpt: Path, saved_assets: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    given = json.loads((saved_assets / "config.json").read_text())
    assert given["dtype"] == "float32"  # what save_pretrained wrote
    out = tmp_path / "bf16"
    res = export(llama_ckpt, out, "--model-assets", saved_assets, "--save-dtype", "bf16", "--json")
    doc = json.loads(res.stdout)
    assert doc["config_edits"] == {"torch_dtype": [None, "bfloat16"], "dtype": ["float32", "bfloat16"]}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in given.items() if k not in ("dtype", "torch_dtype")
    }
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    written = load_file(out / "model.safetensors")
    for name, p in model.state_dict().items():
        assert torch.equal(p, written[name]), name  # the exported bytes, not a re-cast
    # the note: these assets have no tokenizer
    assert "holds no tokenizer files" in res.stderr and doc["notes"]


def test_preserve_keeps_a_config_that_is_already_right(llama_ckpt: Path, saved_assets: Path, tmp_path: Path) -> None:
    """FP32 weights and a config saying float32 in both keys: copied byte for byte."""
    assets = tmp_path / "assets"
    shutil.copytree(saved_assets, assets)
    cfg = json.loads((assets / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (assets / "config.json").write_text(json.dumps(cfg))
    (assets / "tokenizer.json").write_text("{}")
    res = export(llama_ckpt, tmp_path / "out", "--model-assets", assets, "--json")
    assert json.loads(res.stdout)["config_edits"] == {} and "tokenizer" not in res.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == (assets / "config.json").read_bytes()


def test_tie_word_embeddings_is_made_explicit(llama_ckpt: Path, saved_assets: Path, tmp_path: Path) -> None:
    """A config that leaves tie_word_embeddings to the class default: the written lm_head must be loaded."""
    assets = tmp_path / "assets"
    shutil.copytree(saved_assets, assets)
    cfg = json.loads((assets / "config.json").read_text())
    del cfg["tie_word_embeddings"]
    del cfg["dtype"]
    cfg["torch_dtype"] = "float32"  # an older transformers' key only
    (assets / "config.json").write_text(json.dumps(cfg, indent=2))
    res = export(llama_ckpt, tmp_path / "out", "--model-assets", assets, "--save-dtype", "fp16", "--json")
    assert json.loads(res.stdout)["config_edits"] == {
        "torch_dtype": ["float32", "float16"],
        "tie_word_embeddings": [None, False],
    }
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "dtype" not in got and got["torch_dtype"] == "float16" and got["tie_word_embeddings"] is False
    assert list(got)[: len(cfg)] == list(cfg)  # key order kept


def test_dominant_dtype_and_text_config() -> None:
    entries = [
        HeaderEntry("a", "float32", (4,)),  # 16 bytes
        HeaderEntry("b", "bfloat16", (16,)),  # 32 bytes
        HeaderEntry("s", "float8_e4m3fn", (1000,)),  # quantized: not counted
        HeaderEntry("i", "int64", (100,)),
    ]
    assert dominant_dtype(entries) == "bfloat16"
    assert dominant_dtype([HeaderEntry("i", "int64", (3,))]) is None
    data = json.dumps({"model_type": "x", "text_config": {"dtype": "float32", "tie_word_embeddings": True}}).encode()
    new, edits = serving_config(data, "c", dtype="bfloat16", lm_head_written=False, embedding_written=True)
    assert edits == {"torch_dtype": [None, "bfloat16"], "text_config.dtype": ["float32", "bfloat16"]}
    assert json.loads(new)["text_config"] == {"dtype": "bfloat16", "tie_word_embeddings": True}


def test_a_config_without_architectures_gets_the_checked_class(llama_ckpt: Path, tmp_path: Path) -> None:
    """A config saved from a bare ``LlamaConfig`` (no ``architectures``, no dtype key): vLLM refuses it ("No model
    architectures are specified"), so the copy names the class the tensors were checked against, as
    ``save_pretrained`` would; the human summary says the keys it adds were unset (not ``null``)."""
    assets = llama_ckpt / "model_assets"
    assert "architectures" not in json.loads((assets / "config.json").read_text())
    res = export(llama_ckpt, tmp_path / "out", "--model-assets", assets, "--json")
    assert json.loads(res.stdout)["config_edits"]["architectures"] == [None, ["LlamaForCausalLM"]]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    human = export(llama_ckpt, tmp_path / "h", "--model-assets", assets)
    assert 'architectures (unset) -> ["LlamaForCausalLM"]' in human.stdout and "null" not in human.stdout
    # an export `--allow-mismatch` accepted with findings names the class too (vLLM refuses a config without one)
    more = tmp_path / "more_layers"
    more.mkdir()
    cfg = json.loads((assets / "config.json").read_text())
    (more / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    res = export(llama_ckpt, tmp_path / "m", "--model-assets", more, "--json", "--allow-mismatch", "missing")
    doc = json.loads(res.stdout)
    assert doc["model_check"]["findings"] and doc["config_edits"]["architectures"] == [None, ["LlamaForCausalLM"]]
    # a config that names its class keeps it (a saved model's config: nothing about architectures changes)
    data = json.dumps({"model_type": "llama", "architectures": ["MyLlama"]}).encode()
    _, edits = serving_config(data, "c", dtype=None, lm_head_written=True, embedding_written=True, architecture="X")
    assert "architectures" not in edits


def test_a_mixed_export_says_which_tensors_dtype_auto_rounds(llama_ckpt: Path, tmp_path: Path) -> None:
    """BF16 matrices beside FP32 norms (a real dcp.save): config.json can name one dtype (the dominant, bfloat16),
    and ``from_pretrained(dtype="auto")`` rounds the FP32 norms to it; the export says so (a config naming
    bfloat16 itself is refused E605 ``dtype`` for the same tensors). Widening (BF16 beside FP32) needs no note."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(5)
    cfg = hf_models.llama_config()
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.01)  # values BF16 cannot hold
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            mod.to(torch.bfloat16)
    src = tmp_path / "mixed"
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(src))
    cfg.save_pretrained(tmp_path / "assets")
    res = export(src, tmp_path / "out", "--model-assets", tmp_path / "assets", "--json")
    doc = json.loads(res.stdout)
    assert doc["config_edits"]["torch_dtype"] == [None, "bfloat16"]
    (note,) = [n for n in doc["notes"] if "config.json names bfloat16" in n]
    assert "5 float32 tensor(s) (model.layers.0.input_layernorm.weight" in note and "dtype=torch.float32" in note
    assert "note: config.json names bfloat16" in res.stderr
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").state_dict()
    norm = "model.norm.weight"
    assert loaded[norm].dtype == torch.bfloat16 and not torch.equal(loaded[norm].float(), model.state_dict()[norm])
    # one dtype (or BF16 widened exactly into an FP32 config): no such note
    res = export(llama_ckpt, tmp_path / "one", "--model-assets", llama_ckpt / "model_assets", "--json")
    assert not [n for n in json.loads(res.stdout)["notes"] if "config.json names" in n]
    res = export(src, tmp_path / "f32", "--model-assets", tmp_path / "assets", "--save-dtype", "fp32", "--json")
    assert not [n for n in json.loads(res.stdout)["notes"] if "config.json names" in n]
    assert rounded_on_load("float32", [HeaderEntry("n", "bfloat16", (4,)), HeaderEntry("w", "float32", (9,))]) is None
    assert rounded_on_load("bfloat16", [HeaderEntry("n", "float16", (4,))]) is not None  # F16 -> BF16 rounds


def test_a_filter_leaving_out_the_lm_head_does_not_declare_it_tied(llama_ckpt: Path, tmp_path: Path) -> None:
    """An untied Llama (its stored ``lm_head.weight`` differs from the embedding) whose config leaves
    ``tie_word_embeddings`` to the class default, exported with ``--filter`` that leaves the head out: the copy
    must not say ``tie_word_embeddings: true``, or ``from_pretrained`` ties the embedding in as the head and
    reports nothing missing (a head that was never trained as one); left as given, transformers names
    ``lm_head.weight`` missing (the partial export's own warning says so too)."""
    import torch
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    assets = tmp_path / "assets"
    assets.mkdir()
    cfg = json.loads((llama_ckpt / "model_assets" / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)  # left to LlamaConfig's default (untied)
    (assets / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    res = export(llama_ckpt, out, "--model-assets", assets, "--filter", "model.model.*", "--json")
    doc = json.loads(res.stdout)
    assert doc["skipped"]["excluded by `filter_glob`"]["keys"] == ["model.lm_head.weight"]
    assert "tie_word_embeddings" not in doc["config_edits"]
    assert json.loads((out / "config.json").read_text()).get("tie_word_embeddings") is None
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"} or list(info["missing_keys"]) == ["lm_head.weight"]
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    # without the filter the whole model is written and the untied config says so explicitly
    res = export(llama_ckpt, tmp_path / "all", "--model-assets", assets, "--json")
    assert json.loads(res.stdout)["config_edits"]["tie_word_embeddings"] == [None, False]
