"""``ckpttool validate``: layout rules (L) on real EP saves and model rules (M) with --config / --against."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import CheckpointReader
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
SAMPLE_EXPERT = "model.model.layers.0.mlp.experts.down_proj"


def run(*args: Any) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def codes(doc: dict[str, Any]) -> set[str]:
    return {f["code"] for f in doc["findings"] if f["severity"] != "info"}


def only(path: Path, code: str, *extra: Any) -> dict[str, Any]:
    rc, doc = run(path, "--strict", *extra)
    assert codes(doc) == {code}, doc["findings"]
    assert rc == 1
    return doc


@pytest.fixture
def ck(sample_ckpt: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(sample_ckpt, tmp_path / "ckpt")


def sample_record(path: Path) -> dict[str, Any]:
    with CheckpointReader(path) as r:
        return json.loads(r.read_object("layout"))


def write_config(path: Path, **over: Any) -> Path:
    cfg = json.loads((path / "model_assets" / "config.json").read_text()) if (path / "model_assets").is_dir() else {}
    cfg.update(over)
    out = path.parent / "config.json"
    out.write_text(json.dumps(cfg))
    return out


# ------------------------------------------------------------------------------------------ layout
def test_L001_newer_record_version(ck: Path) -> None:
    rec = sample_record(ck)
    rec["version"] = 3
    damage.set_byte_item(ck, "layout", json.dumps(rec))
    doc = only(ck, "L001")
    assert doc["findings"][0]["error_code"] == "E402" and "upgrade" in doc["findings"][0]["hint"]


def test_L001_unknown_format_in_sidecar(multi_optim_ckpt: Path, tmp_path: Path) -> None:
    c = copy_checkpoint(multi_optim_ckpt, tmp_path / "c")
    damage.drop_keys(c, lambda k: k == "layout")
    (c / "layout.json").write_text(json.dumps({"format": "someone.else", "version": 1}))
    doc = only(c, "L001")
    assert doc["findings"][0]["error_code"] == "E401"


def test_L002_sidecar_disagrees_with_embedded(ck: Path) -> None:
    rec = sample_record(ck)
    rec["global_step"] = 99
    (ck / "layout.json").write_text(json.dumps(rec))
    doc = only(ck, "L002")
    assert doc["findings"][0]["error_code"] == "E403"


def test_L003_unversioned_same_dim_ep_is_ambiguous(ep_suite: Path) -> None:
    path = ep_suite / "legacy"
    rc, doc = run(path)
    assert rc == 0 and codes(doc) == {"L003"} and not doc["findings"][0]["fails"]
    doc = only(path, "L003")
    assert "--source-layout" in doc["findings"][0]["hint"] and "3 more" in doc["findings"][0]["message"]
    rc, doc = run(path, "--strict", "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2")
    assert rc == 0 and codes(doc) == set()
    rc, doc = run(ep_suite / "legacy_dim1", "--strict")  # FSDP on dim 1: unambiguous
    assert rc == 0 and codes(doc) == set()


def test_L004_num_experts_disagrees_with_shape(ck: Path) -> None:
    rec = sample_record(ck)
    rec["extra_parallel"][SAMPLE_EXPERT]["num_experts"] = 6
    damage.set_byte_item(ck, "layout", json.dumps(rec))
    doc = only(ck, "L004")
    assert doc["findings"][0]["key"] == SAMPLE_EXPERT and "num_experts is 6" in doc["findings"][0]["message"]


def test_L005_record_ep_size_contradicts_chunks(ck: Path) -> None:
    rec = sample_record(ck)
    rec["parallel"]["ep_size"] = 2
    damage.set_byte_item(ck, "layout", json.dumps(rec))
    rc, doc = run(ck, "--strict")
    assert rc == 1 and codes(doc) == {"L005"} and len(doc["findings"]) - 1 == 4  # 4 EP tensors (+P002 info)


def test_L005_declaration_contradicts_geometry(ep_suite: Path) -> None:
    doc = only(ep_suite / "legacy", "L005", "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "1")
    assert doc["findings"][0]["error_code"] == "E404"


def test_layout_declaration_without_sizes_is_a_usage_error(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--source-layout", "legacy"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E100]")


def test_clean_ep_record_fixture(ep_suite: Path) -> None:
    rc, doc = run(ep_suite / "p4f1", "--strict", "--deep")
    assert rc == 0 and codes(doc) == set()


# ------------------------------------------------------------------------------------------ --config
def test_sample_with_its_config_is_clean(sample_ckpt: Path) -> None:
    rc, doc = run(sample_ckpt, "--strict", "--deep", "--config", sample_ckpt / "model_assets" / "config.json")
    assert rc == 0 and codes(doc) == set()


@pytest.mark.parametrize("over", [{"model_type": None}, {"model_type": "no-such-model"}])
def test_M010_that_could_not_compare_is_skipped_not_passed(ck: Path, over: dict[str, Any]) -> None:
    """`--select M010` with a config transformers cannot build said OK, M010 "passed": no comparison was made."""
    cfg = write_config(ck, **over)
    if over["model_type"] is None:
        cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "model_type"}))
    rc, doc = run(ck, "--strict", "--config", cfg, "--select", "M001,M010")
    status = {r["code"]: r for r in doc["rules"]}["M010"]
    assert status["status"] == "skipped" and status["reason"].startswith("model class not checked: "), status
    res = runner.invoke(app, ["validate", str(ck), "--config", str(cfg), "--select", "M001,M010"])
    assert "1 skipped (model class not checked: " in res.stdout
    rc, doc = run(ck, "--config", cfg, "--select", "M011")  # M011 still says why
    assert [f["code"] for f in doc["findings"]] == ["M011"]
    res = runner.invoke(app, ["validate", str(ck), "--config", str(cfg), "--select", "M010"])  # nothing asked ran
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith(f"error: [E100] --select M010: the selected rules (M010) could not run on {ck}: ")
    assert res.stderr.splitlines()[0].endswith("; nothing was checked")


def test_M001_layers_missing_stage_local(ck: Path) -> None:
    rc, doc = run(ck, "--strict", "--config", write_config(ck, num_hidden_layers=4))
    assert rc == 1 and codes(doc) == {"M001", "M010"}  # M010: the model class has layers 2..3 too
    msg = next(f["message"] for f in doc["findings"] if f["code"] == "M001")
    assert "missing 2..3" in msg and "stage-local" in msg


def test_M001_M002_missing_ranges_are_computed_not_built() -> None:
    """The missing indices of ``0..n-1`` (``n`` from config.json) as ranges, equal to the set difference."""
    import random

    from ckpttool.ops.validate.rules.model import _missing, _ranges

    rng = random.Random(0)
    for _ in range(3000):
        n, got = rng.randint(0, 40), set(rng.sample(range(50), rng.randint(0, 20)))
        want = sorted(set(range(n)) - got)
        assert _missing(got, n) == (_ranges(want) if want else "")
    assert _missing({0, 1, 5}, 99_999_999_999) == "2..4, 6..99999999998"


def test_config_with_10_to_11_layers_is_bounded(ck: Path, tmp_path: Path) -> None:
    """A hostile config.json (10^11 layers and experts) ends in one E307 line, in bounded memory (RLIMIT_AS 3 GiB):
    the layer rules never build ``range(num_hidden_layers)``."""
    import resource
    import subprocess
    import sys

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 99_999_999_999, "num_experts": 99_999_999_999}))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    p = subprocess.run(
        [sys.executable, "-m", "ckpttool", "validate", str(ck), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=cap,
        env={**os.environ, "CKPTTOOL_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert p.returncode == 2 and p.stderr.startswith("error: [E307] config.json: num_hidden_layers"), p.stderr
    assert "Traceback" not in p.stderr and "E999" not in p.stderr


def test_M002_fused_experts_rows(ck: Path) -> None:
    rc, doc = run(ck, "--strict", "--config", write_config(ck, num_experts=16))
    assert rc == 1 and codes(doc) == {"M002"}
    assert {f["key"] for f in doc["findings"] if f["code"] == "M002"} == {
        f"model.model.layers.{n}.mlp.experts.{p}" for n in range(2) for p in ("gate_up_proj", "down_proj")
    }


def test_M002_without_an_expert_count_in_the_config_is_skipped_not_passed(ck: Path) -> None:
    """A dense config for a MoE checkpoint: M002 "passed" over experts it had no count to check against."""
    cfg = write_config(ck)
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "n_routed_experts"}))
    rc, doc = run(ck, "--config", cfg, "--select", "M001,M002")
    status = {r["code"]: r for r in doc["rules"]}["M002"]
    assert status["status"] == "skipped", status
    assert "no num_experts" in status["reason"] and "experts" in status["reason"].rsplit(" has ", 1)[1]


def test_M002_renumbered_local_experts(per_expert_ckpt: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 1, "num_experts": 8, "vocab_size": 16}))
    rc, doc = run(per_expert_ckpt, "--strict", "--config", cfg)
    assert rc == 1 and codes(doc) == {"M002"}
    assert "experts 0..3 of num_experts 8: missing 4..7" in doc["findings"][0]["message"]


def test_M003_tied_config_but_head_differs(dense_ckpt: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 64, "tie_word_embeddings": True}))
    rc, doc = run(dense_ckpt, "--strict", "--config", cfg)
    assert rc == 0 and {r["code"]: r["status"] for r in doc["rules"]}["M003"] == "skipped"
    doc = only(dense_ckpt, "M003", "--config", cfg, "--deep")
    assert "differs from model.model.embed_tokens.weight in" in doc["findings"][0]["message"]


def test_M003_a_nan_in_the_tied_head_is_named_not_max_diff_0(dense_ckpt: Path, tmp_path: Path) -> None:
    """A tied head equal to the embedding but for one NaN said "in 1 of N elements (max |diff| 0)"; the NaN is
    named now."""
    import torch

    c = copy_checkpoint(dense_ckpt, tmp_path / "c")

    def ones(t: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(t)

    def ones_but_a_nan(t: torch.Tensor) -> torch.Tensor:
        t = torch.ones_like(t)
        t[3, 2] = float("nan")
        return t

    damage.rewrite_tensor(c, "model.model.embed_tokens.weight", ones)
    damage.rewrite_tensor(c, "model.lm_head.weight", ones_but_a_nan)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 64, "tie_word_embeddings": True}))
    rc, doc = run(c, "--strict", "--config", cfg, "--deep")
    m003 = [f["message"] for f in doc["findings"] if f["code"] == "M003"]
    assert rc == 1 and len(m003) == 1, doc["findings"]
    assert m003[0].endswith("in 1 of 1024 elements (1 NaN against a number) although tie_word_embeddings is true")


def test_M004_untied_head_missing_and_tied_head_missing_is_fine(dense_ckpt: Path, tmp_path: Path) -> None:
    c = copy_checkpoint(dense_ckpt, tmp_path / "c")
    assert damage.drop_keys(c, lambda k: "lm_head" in k)
    untied = tmp_path / "untied.json"
    untied.write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 64, "tie_word_embeddings": False}))
    only(c, "M004", "--config", untied)
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 64, "tie_word_embeddings": True}))
    rc, doc = run(c, "--strict", "--deep", "--config", tied)
    assert rc == 0 and codes(doc) == set()


@pytest.mark.parametrize(("model_type", "tied"), [("gpt2", True), ("gemma", True), ("llama", False), ("qwen3", False)])
def test_M004_config_without_tie_word_embeddings_uses_the_model_types_default(
    dense_ckpt: Path, tmp_path: Path, model_type: str, tied: bool
) -> None:
    """An older hub config.json (no tie_word_embeddings) of a model type transformers ties by default (GPT-2, Gemma)
    was M004 on a checkpoint without lm_head; the default of transformers' own config class decides."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    c = copy_checkpoint(dense_ckpt, tmp_path / "c")
    assert damage.drop_keys(c, lambda k: "lm_head" in k)
    doc = CONFIG_MAPPING[model_type](vocab_size=64, num_hidden_layers=2).to_dict()
    doc.pop("tie_word_embeddings", None)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(doc))
    rc, out = run(c, "--strict", "--config", cfg, "--select", "M004")
    if tied:
        assert rc == 0 and codes(out) == set(), out["findings"]
    else:
        assert rc == 1 and codes(out) == {"M004"}
        assert out["findings"][0]["key"] == "model.lm_head.weight"


def test_bad_config_is_a_usage_error(sample_ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--config", str(bad)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E100] --config")


# ------------------------------------------------------------------------------------------ --against
def reference(src: Path, out: Path, edit: Any = None, tie: bool | None = None) -> Path:
    """An HF-style model directory (safetensors + config) from the model tensors of ``src``."""
    from safetensors.torch import save_file

    with CheckpointReader(src) as r:
        sd = {k[len("model.") :]: r.read_tensor(k) for k in r.metadata.entries if k.startswith("model.")}
    if edit is not None:
        edit(sd)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tie is not None:
        (out / "config.json").write_text(json.dumps({"tie_word_embeddings": tie}))
    return out


def test_M005_M006_unreadable_reference_config_that_decides_the_head_is_reported(
    dense_ckpt: Path, tmp_path: Path
) -> None:
    """The reference's config.json could not be read, so whether lm_head is tied was not known: the head was passed
    over silently (OK); it is now reported, naming the config and why it could not be read."""
    c = copy_checkpoint(dense_ckpt, tmp_path / "c")
    assert damage.drop_keys(c, lambda k: "lm_head" in k)
    ref = reference(dense_ckpt, tmp_path / "ref")  # holds lm_head.weight
    (ref / "config.json").write_text("{not json")
    rc, doc = run(c, "--against", ref)
    assert rc == 1 and codes(doc) == {"M005"}, doc["findings"]
    f = doc["findings"][0]
    assert f["key"] == "model.lm_head.weight"
    assert f"{ref / 'config.json'}: not valid JSON" in f["message"] and "config.json" in f["hint"]

    no_head = reference(dense_ckpt, tmp_path / "ref2", edit=lambda sd: sd.pop("lm_head.weight"))
    (no_head / "config.json").write_text("[]")
    rc, doc = run(dense_ckpt, "--against", no_head)
    assert codes(doc) == {"M006"} and rc == 0, doc["findings"]
    assert "not a JSON object" in doc["findings"][0]["message"]
    (no_head / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))  # a readable one decides
    rc, doc = run(dense_ckpt, "--against", no_head)
    assert codes(doc) == set() and rc == 0


def test_against_its_own_weights_is_clean(sample_ckpt: Path, tmp_path: Path) -> None:
    rc, doc = run(sample_ckpt, "--strict", "--against", reference(sample_ckpt, tmp_path / "ref"))
    assert rc == 0 and codes(doc) == set()


def test_M005_lost_persistent_buffer(ck: Path, sample_ckpt: Path, tmp_path: Path) -> None:
    key = "model.model.layers.0.mlp.gate.e_score_correction_bias"
    assert damage.drop_keys(ck, lambda k: k == key)
    doc = only(ck, "M005", "--against", reference(sample_ckpt, tmp_path / "ref"))
    assert doc["findings"][0]["key"] == key


def test_M006_M007_M008(sample_ckpt: Path, tmp_path: Path) -> None:
    def edit(sd: dict[str, torch.Tensor]) -> None:
        del sd["model.norm.weight"]
        sd["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(16)
        sd["model.layers.0.self_attn.k_norm.weight"] = sd["model.layers.0.self_attn.k_norm.weight"].bfloat16()

    rc, doc = run(sample_ckpt, "--against", reference(sample_ckpt, tmp_path / "ref", edit))
    by = {f["code"]: f for f in doc["findings"] if f["code"].startswith("M")}
    assert set(by) == {"M006", "M007", "M008"} and rc == 1
    assert by["M006"]["key"] == "model.model.norm.weight" and by["M006"]["severity"] == "warning"
    assert "reference [16]" in by["M007"]["message"] and "reference bfloat16" in by["M008"]["message"]


@pytest.mark.parametrize("form", ["list", "index"])
def test_M007_M008_against_names_only_are_skipped_not_passed(sample_ckpt: Path, tmp_path: Path, form: str) -> None:
    """A key list, or an index copied without its shards, gives no shapes: M007/M008 "passed" over nothing."""
    with CheckpointReader(sample_ckpt) as r:
        names = [k[len("model.") :] for k in r.metadata.entries if k.startswith("model.")]
    ref = tmp_path / "ref.json"
    body: Any = names if form == "list" else {"weight_map": dict.fromkeys(names, "model.safetensors")}
    ref.write_text(json.dumps(body))
    rc, doc = run(sample_ckpt, "--strict", "--against", ref, "--select", "M005,M007,M008")
    status = {r["code"]: r for r in doc["rules"]}
    assert status["M005"]["status"] == "passed"
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(ref), "--select", "M007"])
    assert res.exit_code == 2 and "the selected rules (M007) could not run" in res.stderr  # nothing asked was checked
    for code, what in (("M007", "shapes"), ("M008", "dtypes")):
        assert status[code]["status"] == "skipped", status[code]
        assert (
            status[code]["reason"]
            == f"the reference {ref} gives no {what} (a key list, or an index without its safetensors)"
        )


@pytest.mark.parametrize("body", ["[]", "{}", '{"keys": []}', '{"weight_map": {}}'])
def test_against_a_reference_of_no_tensor_is_refused(sample_ckpt: Path, tmp_path: Path, body: str) -> None:
    """An empty reference passed M005/M007/M008 (exit 0) with every key a mere M006 warning."""
    ref = tmp_path / "ref.json"
    ref.write_text(body)
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(ref)])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == f"error: [E100] --against {ref}: names no tensor"
    assert res.stderr.splitlines()[1].startswith("hint: pass an HF model directory")


def test_against_a_dcp_checkpoint_points_to_diff(sample_ckpt: Path, dense_ckpt: Path) -> None:
    """--against OTHER_CKPT said only "directory holds no model.safetensors.index.json": now it names diff/export."""
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(dense_ckpt)])
    assert res.exit_code == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert err[0] == f"error: [E100] --against {dense_ckpt}: a DCP checkpoint (.metadata), not a reference model; " + (
        "--against reads the names, shapes and dtypes of an HF model folder"
    )
    assert err[1] == f"hint: compare two checkpoints with `ckpttool diff CHECKPOINT {dense_ckpt}`, " + (
        f"or pass --against an export of it (`ckpttool export {dense_ckpt} OUT`)"
    )


def test_symlinks_out_of_config_and_against_folders_get_their_own_hint(sample_ckpt: Path, tmp_path: Path) -> None:
    """The E101 hint said "the checkpoint references files outside its directory" of a --config / --against folder."""
    ref = reference(sample_ckpt, tmp_path / "ref")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").symlink_to(sample_ckpt / "model_assets" / "config.json")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").symlink_to(ref / "model.safetensors")
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--config", str(tmp_path / "cfg")])
    assert res.exit_code == 2 and res.stderr.splitlines()[1] == (
        f"hint: a folder's config.json is read only inside it; name the file you mean: --config {tmp_path}/cfg/config.json"
    )
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(tmp_path / "snap")])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E101]")
    assert res.stderr.splitlines()[1].startswith("hint: a reference folder's files are read only inside it")
    for good in (["--config", str(tmp_path / "cfg" / "config.json")], ["--against", str(ref / "model.safetensors")]):
        assert runner.invoke(app, ["validate", str(sample_ckpt), *good]).exit_code == 0  # what the hints say works


def test_against_an_index_with_some_shards_missing_is_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    """An HF folder with one of its two shards missing passed M007/M008 over the tensors of the missing one."""
    from safetensors.torch import load_file, save_file

    ref = reference(sample_ckpt, tmp_path / "ref")
    sd = load_file(str(ref / "model.safetensors"))
    (ref / "model.safetensors").unlink()
    names = sorted(sd)
    half = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    save_file(
        {k: sd[k] for k in half["model-00001-of-00002.safetensors"]}, str(ref / "model-00001-of-00002.safetensors")
    )
    wm = {k: f for f, ks in half.items() for k in ks}
    (ref / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(ref)])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == (
        f"error: [E100] --against {ref / 'model.safetensors.index.json'}: weight_map names 1 of 2 shards that are not "
        f"in {ref} (model-00002-of-00002.safetensors): an incomplete download or copy"
    )


@pytest.mark.parametrize("spell", ["safetensors", "torch"])
def test_against_json_dtypes_in_safetensors_tags_are_understood(sample_ckpt: Path, tmp_path: Path, spell: str) -> None:
    """{key: {"shape", "dtype": "F32"}} (the safetensors header's spelling) gave one false M008 warning per key."""
    from safetensors import safe_open

    src = reference(sample_ckpt, tmp_path / "ref") / "model.safetensors"
    with safe_open(str(src), "pt") as f:
        body = {k: {"shape": list(f.get_slice(k).get_shape()), "dtype": f.get_slice(k).get_dtype()} for k in f.keys()}
    if spell == "torch":
        body = {k: {**v, "dtype": "torch.float32" if v["dtype"] == "F32" else v["dtype"]} for k, v in body.items()}
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(body))
    rc, doc = run(sample_ckpt, "--strict", "--against", ref, "--select", "M")
    assert rc == 0 and codes(doc) == set(), doc["findings"][:3]
    assert {r["code"]: r["status"] for r in doc["rules"]}["M008"] == "passed"


def test_tied_head_is_not_reported_missing(dense_ckpt: Path, tmp_path: Path) -> None:
    c = copy_checkpoint(dense_ckpt, tmp_path / "c")
    assert damage.drop_keys(c, lambda k: "lm_head" in k)
    rc, doc = run(c, "--strict", "--against", reference(dense_ckpt, tmp_path / "tied", tie=True))
    assert rc == 0 and codes(doc) == set()
    rc, doc = run(c, "--strict", "--against", reference(dense_ckpt, tmp_path / "untied", tie=False))
    assert codes(doc) == {"M005"}


def test_per_expert_reference_matches_fused_tensors(sample_ckpt: Path, tmp_path: Path) -> None:
    with CheckpointReader(sample_ckpt) as r:
        keys = {
            k[len("model.") :]: {"shape": list(m.size), "dtype": m.dtype.name}
            for k, m in r.metadata.entries.items()
            if k.startswith("model.") and ".experts." not in k
        }
    for n in range(2):
        for j in range(8):
            p = f"model.layers.{n}.mlp.experts.{j}"
            keys[f"{p}.gate_proj.weight"] = {"shape": [16, 32], "dtype": "float32"}
            keys[f"{p}.up_proj.weight"] = {"shape": [16, 32], "dtype": "float32"}
            keys[f"{p}.down_proj.weight"] = {"shape": [32, 16], "dtype": "float32"}
    ref = tmp_path / "keys.json"
    ref.write_text(json.dumps(keys))
    rc, doc = run(sample_ckpt, "--strict", "--against", ref)
    assert rc == 0 and codes(doc) == set()
    keys["model.layers.1.mlp.experts.3.down_proj.weight"]["shape"] = [32, 8]
    ref.write_text(json.dumps(keys))
    rc, doc = run(sample_ckpt, "--strict", "--against", ref)
    assert codes(doc) == {"M007"} and doc["findings"][0]["key"] == "model.model.layers.1.mlp.experts.down_proj"


def test_K006_planner_path_changed_in_place(tmp_path: Path) -> None:
    """torch's ``dcp.save`` of a nested state dict, then one path component of ``planner_data`` changed in the
    ``.metadata`` bytes (same length: the pickle stays valid): K006 names the key; the healthy save is clean."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "ckpt"
    state = {"model": {"layers": {str(i): {"w": torch.ones(4, 4) * i} for i in range(2)}, "norm": torch.ones(4)}}
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    assert "K006" not in codes(run(src, "--strict")[1])
    md = src / ".metadata"
    data = md.read_bytes()
    old = b"\x8c\x06layers"  # SHORT_BINUNICODE 'layers' (memoized: the one object every path refers to)
    assert data.count(old) == 1
    md.write_bytes(data.replace(old, b"\x8c\x06layerz"))
    rc, doc = run(src, "--strict")
    assert rc == 1 and "K006" in codes(doc), doc["findings"]
    f = next(f for f in doc["findings"] if f["code"] == "K006")
    assert (
        f["key"] == "model.layers.0.w"
        and "2 planner_data path(s) lead to no key" in f["message"]
        and "layerz" in f["message"]
    )


def _mixtral_dcp(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """transformers' own ``MixtralForCausalLM.save_pretrained`` (Mixtral's hub names:
    ``block_sparse_moe.experts.<j>.w1/w2/w3.weight``, router ``block_sparse_moe.gate.weight``) saved with
    ``dcp.save({"model": ...})``, the state dict of a trainer that keeps those names; and its config."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in sd and "model.layers.0.mlp.gate.weight" not in sd
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "ck", no_dist=True)
    return tmp_path / "ck", json.loads((tmp_path / "hf" / "config.json").read_text())


def test_M010_folds_experts_of_one_shape_but_several_dtypes(tmp_path: Path) -> None:
    """One Mixtral expert's w3 saved in float16 beside float32 ones: transformers loads the folder (it casts as it
    fuses), every shape right, but the fold wanted one (shape, dtype) and left the layer's experts as stored: 9 M010
    errors calling right shapes "unexpected" and the fused tensor "missing". The experts fold now and the one finding
    is the dtype, named on the fused tensor."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from transformers import MixtralForCausalLM

    _, cfg = _mixtral_dcp(tmp_path)
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    k = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    sd[k] = sd[k].half()
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    _, info = MixtralForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "mixed", no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "dtype": "float32"}))
    rc, doc = run(tmp_path / "mixed", "--config", tmp_path / "config.json", "--select", "M010")
    assert [f["message"] for f in doc["findings"]] == [
        "dtype: model.layers.0.mlp.experts.gate_up_proj: float16, config dtype float32 (MixtralForCausalLM)"
    ], doc["findings"]


def test_M010_folds_mixtral_per_expert_weights(tmp_path: Path) -> None:
    """Mixtral's per-expert ``block_sparse_moe.experts.<j>.w1/w3/w2`` (what transformers' own save_pretrained
    writes, and loads by folding them into ``mlp.experts.gate_up_proj``/``down_proj``) were compared as stored:
    M010 failed the model's own weights with 32 errors (every expert "unexpected", the fused tensors and the
    renamed router "missing"). Mixtral's form (model/hf_forms.py) is folded and renamed now as transformers'
    conversion does; a wrong expert size is still named, on the fused tensor."""
    ck, cfg = _mixtral_dcp(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, doc = run(ck, "--strict", "--config", tmp_path / "config.json", "--select", "M010")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    assert {r["code"]: r["status"] for r in doc["rules"]}["M010"] == "passed"
    (tmp_path / "wrong.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    rc, doc = run(ck, "--config", tmp_path / "wrong.json", "--select", "M010")
    got = sorted(f["message"] for f in doc["findings"])
    assert rc == 1 and len(got) == 4, got
    assert got[0] == (
        "shape: model.layers.0.mlp.experts.down_proj: [4, 16, 32], MixtralForCausalLM has [4, 16, 48] "
        "(MixtralForCausalLM)"
    )


def test_tied_head_of_an_older_multimodal_save_is_not_reported_missing(tmp_path: Path) -> None:
    """A tied ``lm_head.weight`` beside an embedding that transformers' classes name otherwise today (an older Llava
    save's ``language_model.model.embed_tokens.weight``) is the embedding, as beside ``model.embed_tokens.weight``:
    ``--against`` its reference (head left out of the checkpoint, tie in the config) reports no missing head."""
    import torch.distributed.checkpoint as dcp

    emb, norm = "language_model.model.embed_tokens.weight", "language_model.model.norm.weight"
    sd = {emb: torch.ones(8, 4), norm: torch.ones(4)}
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "keys.json").write_text(json.dumps([emb, norm, "language_model.lm_head.weight"]))
    (ref / "config.json").write_text(json.dumps({"model_type": "llava", "tie_word_embeddings": True}))
    res = runner.invoke(app, ["validate", str(tmp_path / "ckpt"), "--against", str(ref / "keys.json"), "--json"])
    assert res.exit_code == 0, res.stdout
    assert json.loads(res.stdout)["findings"] == []
    (ref / "config.json").write_text(json.dumps({"model_type": "llava", "tie_word_embeddings": False}))
    res = runner.invoke(app, ["validate", str(tmp_path / "ckpt"), "--against", str(ref / "keys.json"), "--json"])
    assert res.exit_code == 1, res.stdout
    assert [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"]] == [
        ("M005", "model.language_model.lm_head.weight")
    ]


@pytest.mark.parametrize("family", ["gpt_neox", "granitemoe"])
def test_a_save_pretrained_folder_of_names_from_pretrained_renames_is_clean_against_its_config(
    tmp_path: Path, family: str
) -> None:
    """GPT-NeoX's embed_out.weight and Granite MoE's block_sparse_moe.input_linear / output_linear / router.layer,
    what transformers' own save_pretrained writes and from_pretrained loads (no missing or unexpected key): validate
    --config reported M004 (lm_head.weight missing) and M010 (those keys unexpected, the model's missing). They are
    compared under the model's names now: no finding."""
    import transformers

    dims = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}
    if family == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**dims, intermediate_size=32))
    else:
        cfg = transformers.GraniteMoeConfig(**dims, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.GraniteMoeForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    _, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    rc, doc = run(tmp_path / "hf", "--strict", "--config", tmp_path / "hf" / "config.json")
    assert codes(doc) == set() and rc == 0, doc["findings"]
