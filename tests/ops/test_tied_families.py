"""A tied ``lm_head.weight`` of the model families transformers ties to an embedding other than Llama's
``model.embed_tokens.weight`` (GPT-2 ``transformer.wte.weight``, OPT ``model.decoder.embed_tokens.weight``,
GPT-NeoX ``gpt_neox.embed_in.weight``): real models built from tiny configs and saved by ``save_pretrained``,
imported, then exported, diffed and validated; checked against transformers' own ``from_pretrained`` and torch's
``dcp.load``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models

runner = CliRunner()


def _cli(*args: str) -> dict[str, Any]:
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def _saved(family: str, tmp_path: Path) -> tuple[Any, Path, Path]:
    """The model, its ``save_pretrained`` folder and its import (a DCP checkpoint)."""
    hf_models._quiet()
    torch.manual_seed(7)
    model = hf_models.tiny_tied_model(family).eval()
    assert model.config.tie_word_embeddings is True
    model.save_pretrained(tmp_path / "hf")
    _cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    return model, tmp_path / "hf", tmp_path / "dcp"


def _keys(d: Path) -> set[str]:
    out: set[str] = set()
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            out |= set(s.keys())
    return out


FAMILIES = [
    ("gpt2", "transformer.wte.weight"),
    ("opt", "model.decoder.embed_tokens.weight"),
    ("gpt_neox", "gpt_neox.embed_in.weight"),
]


@pytest.mark.parametrize(("family", "embedding"), FAMILIES)
def test_an_export_of_a_tied_model_leaves_the_head_out_as_save_pretrained_does(
    tmp_path: Path, family: str, embedding: str
) -> None:
    """Before, the export wrote lm_head.weight beside the embedding (the rules knew only model.embed_tokens.weight);
    transformers' save_pretrained leaves the tied head out. Now the export's tensors are save_pretrained's, and
    from_pretrained of it loads with nothing missing and gives the model's logits."""
    import transformers

    model, hf, ckpt = _saved(family, tmp_path)
    want = model.state_dict()
    sd = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)  # torch's own reader: the import holds every tensor
    assert all(torch.equal(sd["model"][k], v) for k, v in want.items())

    doc = _cli("export", str(ckpt), str(tmp_path / "out"), "--model-assets", str(hf), "--save-dtype", "float32")
    assert doc["tied_embeddings"] == "omitted", doc
    assert _keys(tmp_path / "out") == _keys(hf)
    assert "lm_head.weight" not in _keys(tmp_path / "out") and embedding in _keys(tmp_path / "out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    ids = torch.arange(12).reshape(2, 6) % 96
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


@pytest.mark.parametrize(("family", "embedding"), FAMILIES)
def test_diff_of_a_save_pretrained_folder_and_its_import_compares_the_tied_head(
    tmp_path: Path, family: str, embedding: str
) -> None:
    """Before, `diff HF_DIR IMPORTED` listed lm_head.weight only in B for these families; now B's head is compared
    with A's embedding (what save_pretrained leaves out is the embedding) and the two are equal."""
    _, hf, ckpt = _saved(family, tmp_path)
    res = runner.invoke(app, ["diff", str(hf), str(ckpt), "--json"])
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    text = json.dumps(doc)
    assert f"is compared with A's {embedding}" in text, text[:2000]
    assert "lm_head.weight" not in json.dumps(doc.get("only_b", [])), text[:2000]


@pytest.mark.parametrize(("family", "embedding"), FAMILIES)
def test_validate_against_the_save_pretrained_folder_passes_the_tied_head(
    tmp_path: Path, family: str, embedding: str
) -> None:
    """The import holds lm_head.weight, the folder does not: a tied head (M006 passes it over), equal to the
    embedding (M003 with --deep)."""
    _, hf, ckpt = _saved(family, tmp_path)
    res = runner.invoke(
        app,
        ["validate", str(ckpt), "--config", str(hf / "config.json"), "--against", str(hf), "--deep", "--json"],
    )
    codes = {f["code"] for f in json.loads(res.stdout)["findings"]}
    assert not codes & {"M003", "M004", "M005", "M006"}, res.stdout


@pytest.mark.parametrize(("family", "embedding"), FAMILIES)
def test_validate_config_rules_find_the_embedding_of_each_family(tmp_path: Path, family: str, embedding: str) -> None:
    """M003 (a head that differs from the embedding under tie_word_embeddings true) and M004 (no head under false)
    find these families' embeddings: before, GPT-NeoX's gpt_neox.embed_in.weight was not one, and neither fired."""
    hf_models._quiet()
    torch.manual_seed(11)
    model = hf_models.tiny_tied_model(family)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = sd[embedding] + 1  # an untied head: differs everywhere
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "differs"), no_dist=True)
    model.config.save_pretrained(tmp_path / "tied")
    model.config.tie_word_embeddings = False
    model.config.save_pretrained(tmp_path / "untied")
    res = runner.invoke(
        app, ["validate", str(tmp_path / "differs"), "--config", str(tmp_path / "tied/config.json"), "--deep", "--json"]
    )
    m003 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "M003"]
    assert [f["key"] for f in m003] == ["model.lm_head.weight"] and embedding in m003[0]["message"], res.stdout
    del sd["lm_head.weight"]
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "headless"), no_dist=True)
    res = runner.invoke(
        app, ["validate", str(tmp_path / "headless"), "--config", str(tmp_path / "untied/config.json"), "--json"]
    )
    m004 = [f["key"] for f in json.loads(res.stdout)["findings"] if f["code"] == "M004"]
    assert m004 == ["model.lm_head.weight"], res.stdout


def test_a_rules_file_names_the_tied_pair_or_leaves_the_embedding_to_the_model_classes(tmp_path: Path) -> None:
    """The default rules' embedding is transformers' list (one of them exported); a `--rules` file's `embedding`
    replaces it (the one key), and one without `embedding` keeps the list; a non-string is refused."""
    from ckpttool.errors import UsageError
    from ckpttool.ops.export.rules import load_rules

    default = load_rules(None)
    assert default.tied_embedding_in({"transformer.wte.weight", "lm_head.weight"}) == "transformer.wte.weight"
    assert default.tied_embedding_in({"gpt_neox.embed_in.weight"}) == "gpt_neox.embed_in.weight"
    assert default.tied_embedding_in({"model.embed_tokens.weight", "transformer.wte.weight"}) is None  # which one?
    given = tmp_path / "r.yaml"
    given.write_text("tied_embeddings: {embedding: tok.weight, lm_head: out.weight}\n")
    rules = load_rules(given)
    assert (rules.tied_embedding_in({"tok.weight", "model.embed_tokens.weight"}), rules.tied_lm_head) == (
        "tok.weight",
        "out.weight",
    )
    assert rules.tied_embedding_in({"model.embed_tokens.weight"}) is None
    given.write_text("tied_embeddings: {lm_head: out.weight}\n")
    assert load_rules(given).tied_embedding_in({"model.decoder.embed_tokens.weight"}) is not None
    given.write_text("tied_embeddings: {embedding: [a], lm_head: out.weight}\n")
    with pytest.raises(UsageError, match="'embedding', if given, a string"):
        load_rules(given)


LAYER_FAMILIES = [
    *FAMILIES,
    ("falcon", "transformer.word_embeddings.weight"),
    ("bloom", "transformer.word_embeddings.weight"),
]


@pytest.mark.parametrize(("family", "embedding"), LAYER_FAMILIES)
def test_validate_config_counts_the_decoder_layers_of_each_family(tmp_path: Path, family: str, embedding: str) -> None:
    """M001 reads GPT-2's / Falcon's / BLOOM's transformer.h.<N> as it reads layers.<N>: before, a correct GPT-2
    checkpoint failed `validate --config` with "no model key has a layers.<N> component". A layer dropped from the
    save is still found, under the family's own container."""
    hf_models._quiet()
    model = hf_models.tiny_tied_model(family)
    sd = dict(model.state_dict())
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    model.config.save_pretrained(tmp_path / "cfg")
    cfg = str(tmp_path / "cfg/config.json")
    res = runner.invoke(app, ["validate", str(tmp_path / "ok"), "--config", cfg, "--select", "M001", "--json"])
    assert res.exit_code == 0 and not json.loads(res.stdout)["findings"], res.stdout
    last = model.config.num_hidden_layers - 1
    container = next(k for k in sd if f".{last}." in k).split(f".{last}.")[0]
    lost = {k: v for k, v in sd.items() if not k.startswith(f"{container}.{last}.")}
    dcp.save({"model": lost}, checkpoint_id=str(tmp_path / "lost"), no_dist=True)
    res = runner.invoke(app, ["validate", str(tmp_path / "lost"), "--config", cfg, "--select", "M001", "--json"])
    m001 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "M001"]
    assert res.exit_code == 1 and [f["key"] for f in m001] == [f"model.{container}"], res.stdout
    assert f"missing {last}" in m001[0]["message"], m001


@pytest.mark.parametrize(("family", "embedding"), FAMILIES)
def test_an_export_does_not_call_the_model_classs_own_names_outside_the_hf_naming(
    tmp_path: Path, family: str, embedding: str
) -> None:
    """Before, an export of GPT-2 / GPT-NeoX warned that its keys (transformer.h.0.attn.c_attn.weight,
    gpt_neox.embed_in.weight, ...) were "outside the HF naming": they are the names of the config's model class.
    Now only a key the class does not hold is listed, and the export's keys are the class's own (OPT's
    model.decoder.* never was listed)."""
    model, hf, ckpt = _saved(family, tmp_path)
    doc = _cli("export", str(ckpt), str(tmp_path / "out"), "--model-assets", str(hf))
    assert not [w for w in doc["warnings"] if "exported as their fqn" in w], doc["warnings"]
    assert _keys(tmp_path / "out") <= set(model.state_dict())
    if family == "opt":
        return  # model.decoder.* is written by the model.model.* rule: nothing to list
    one = json.loads((hf / "config.json").read_text())
    one["n_layer" if family == "gpt2" else "num_hidden_layers"] = 1  # layer 1 is no name of this class
    (tmp_path / "one").mkdir()
    (tmp_path / "one/config.json").write_text(json.dumps(one))
    doc = _cli(
        "export",
        str(ckpt),
        str(tmp_path / "out1"),
        "--model-assets",
        str(tmp_path / "one"),
        "--allow-mismatch",
        "unexpected",
    )
    named = [w for w in doc["warnings"] if "exported as their fqn" in w]
    assert len(named) == 1 and ".1." in named[0] and ".0." not in named[0].split(":", 1)[1], named


@pytest.mark.parametrize(("family", "embedding"), [f for f in LAYER_FAMILIES if f[0] != "gpt2"])  # Conv1D: below
def test_a_quantized_export_of_a_tied_model_keeps_its_embedding_and_head_unconverted(
    tmp_path: Path, family: str, embedding: str
) -> None:
    """`--quantize` leaves every family's embedding in BF16 (DEFAULT_SKIP's *embed*, *wte*), and the tied lm_head the
    export omits is listed in modules_to_not_convert: before, only an embed_tokens / wte embedding told the tie, so
    GPT-NeoX's embed_in and Falcon's / BLOOM's word_embeddings left lm_head out of it, and transformers' FP8 quantizer
    made it an FP8Linear with no weight or scale in the folder."""
    from transformers import AutoConfig

    _, hf, ckpt = _saved(family, tmp_path)
    out = tmp_path / "q"
    doc = _cli(
        "export", str(ckpt), str(out), "--model-assets", str(hf), "--quantize", "fp8-block", "--quantize-block", "16"
    )
    assert doc["tied_embeddings"] == "omitted", doc
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor(embedding).dtype == torch.bfloat16
        assert any(f.get_tensor(k).dtype == torch.float8_e4m3fn for k in f.keys())
    model = hf_models.fp8_meta_model(AutoConfig.from_pretrained(str(out)))
    assert type(model.get_output_embeddings()).__name__ == "Linear"
    assert type(model.get_input_embeddings()).__name__ == "Embedding"


def test_a_tied_export_holding_two_candidate_embeddings_ties_the_head_to_the_model_classs(tmp_path: Path) -> None:
    """A tied Llama saved beside a second embedding named as another class names its own
    (model.language_model.embed_tokens.weight): before, the export wrote both embeddings and lm_head, said
    "embedding not exported", and never compared the head. Now the embedding is the model class's own (what
    from_pretrained ties the head to): the head is compared with it and omitted, and the export loads with the
    model's logits. Where the class does not tell (transformers cannot build it), E601 names both, nothing written."""
    import transformers

    hf_models._quiet()
    torch.manual_seed(5)
    cfg = hf_models.llama_config(tied=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    sd = dict(model.state_dict())
    sd["model.language_model.embed_tokens.weight"] = torch.randn_like(sd["model.embed_tokens.weight"])
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    cfg.save_pretrained(tmp_path / "cfg")
    args = ["--model-assets", str(tmp_path / "cfg"), "--allow-mismatch", "unexpected"]
    doc = _cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), *args)
    assert doc["tied_embeddings"] == "omitted", doc
    assert "lm_head.weight" not in _keys(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.arange(12).reshape(2, 6) % 96
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    bad = json.loads((tmp_path / "cfg/config.json").read_text()) | {"model_type": "no_such_model"}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/config.json").write_text(json.dumps(bad))
    res = runner.invoke(
        app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out2"), "--model-assets", str(tmp_path / "bad")]
    )
    assert res.exit_code == 2 and "[E601]" in res.stderr, res.stderr
    assert "model.embed_tokens.weight, model.language_model.embed_tokens.weight" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out2").exists()


def test_a_quantized_export_refuses_fp8_weights_of_gpt2s_conv1d_modules(tmp_path: Path) -> None:
    """GPT-2's attention and MLP weights are Conv1D modules, which transformers' FP8 quantizer does not convert
    ("no linear modules were found"): before, `export --quantize` wrote them FP8 with scales, which from_pretrained
    would load as FP8 values without the scales. Now it is E601 naming them and the --quantize-skip globs, nothing
    written; with those globs the export writes them in BF16, equal to the model's weights."""
    from transformers import AutoConfig

    model, hf, ckpt = _saved("gpt2", tmp_path)
    cfg = AutoConfig.from_pretrained(str(hf))
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    meta = hf_models.fp8_meta_model(cfg)
    assert type(meta.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # what transformers would load into

    args = ["--model-assets", str(hf), "--quantize", "fp8-block", "--quantize-block", "16"]
    res = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "q"), *args])
    assert res.exit_code == 2 and not (tmp_path / "q").exists(), res.output
    err = res.stderr.splitlines()
    assert err[0].startswith("error: [E601]") and "transformer.h.0.attn.c_attn.weight" in err[0], err
    assert err[1] == (
        "hint: keep them in the save dtype with --quantize-skip '*.c_attn.weight' --quantize-skip '*.c_fc.weight' "
        "--quantize-skip '*.c_proj.weight' (or export without --quantize)"
    ), err
    skips = [
        "--quantize-skip",
        "*.c_attn.weight",
        "--quantize-skip",
        "*.c_fc.weight",
        "--quantize-skip",
        "*.c_proj.weight",
    ]
    _cli("export", str(ckpt), str(tmp_path / "q"), *args, *skips)
    with safe_open(str(tmp_path / "q/model.safetensors"), "pt") as f:
        got = f.get_tensor("transformer.h.0.attn.c_attn.weight")
    assert got.dtype == torch.bfloat16 and torch.equal(got, model.transformer.h[0].attn.c_attn.weight.bfloat16())


@pytest.mark.parametrize(
    ("family", "embedding"),
    [
        ("llama", "model.embed_tokens.weight"),
        ("opt", "model.decoder.embed_tokens.weight"),
        ("gpt2", "transformer.wte.weight"),
        ("bloom", "transformer.word_embeddings.weight"),
        ("falcon", "transformer.word_embeddings.weight"),
    ],
)
def test_a_tied_folder_that_stores_only_the_head_imports_its_embedding_from_it(
    tmp_path: Path, family: str, embedding: str
) -> None:
    """safetensors' own ``save_model`` keeps one name of shared tensors, the first in sorted order: ``lm_head.weight``,
    the embedding left out. transformers' ``from_pretrained`` loads such a folder (the embedding tied from the head);
    import refused it (E605, the embedding missing). Now the embedding is written from the head, with a warning,
    and ``dcp.load`` into the model gives ``from_pretrained``'s tensors bit for bit. GPT-2's ``transformer.wte`` and
    BLOOM's / Falcon's ``transformer.word_embeddings`` lie equally deep: the config's ``model_type`` names the one
    (before, E605 refused those folders, which ``from_pretrained`` loads)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    hf_models._quiet()
    torch.manual_seed(5)
    if family == "llama":
        model = LlamaForCausalLM(hf_models.llama_config(tied=True))
    else:
        model = hf_models.tiny_tied_model(family)
    (tmp_path / "hf").mkdir()
    save_model(model, str(tmp_path / "hf" / "model.safetensors"))
    model.config.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" in _keys(tmp_path / "hf") and embedding not in _keys(tmp_path / "hf")
    r = _cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert any(embedding in w and "lm_head.weight" in w for w in r["warnings"]), r["warnings"]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    sd = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert sd.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k


@pytest.mark.parametrize("model_type", [["gpt2"], {"gpt2": 1}, 5])
def test_a_head_only_folder_whose_model_type_is_not_a_string_imports_as_one_without_model_type(
    tmp_path: Path, model_type: Any
) -> None:
    """An untrusted config.json whose ``model_type`` is a list or an object (not a string): the tied head-only
    folder's embedding is picked by no model_type, as where it is a number or missing (the same keys written, the
    same warning that the keys were not checked). Before, a list or object was ``E999 internal error: TypeError:
    unhashable type`` (the embedding looked up by ``model_type`` in a dict)."""
    from safetensors.torch import save_model
    from torch.distributed.checkpoint import FileSystemReader

    hf_models._quiet()
    torch.manual_seed(5)
    model = hf_models.tiny_tied_model("gpt2")
    (tmp_path / "hf").mkdir()
    save_model(model, str(tmp_path / "hf" / "model.safetensors"))
    model.config.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    cfg["model_type"] = model_type
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    del cfg["model_type"]
    (tmp_path / "none").mkdir()
    (tmp_path / "none/model.safetensors").write_bytes((tmp_path / "hf/model.safetensors").read_bytes())
    (tmp_path / "none/config.json").write_text(json.dumps(cfg))
    got = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--json"])
    want = runner.invoke(app, ["import", str(tmp_path / "none"), str(tmp_path / "dcp-none"), "--json"])
    assert got.exit_code == want.exit_code == 0 and "E999" not in got.stderr, got.stderr
    assert json.loads(got.stdout)["warnings"] == json.loads(want.stdout)["warnings"]
    keys = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata.keys()
    assert keys == FileSystemReader(str(tmp_path / "dcp-none")).read_metadata().state_dict_metadata.keys()
