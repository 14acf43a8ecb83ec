"""`ckpttool diff` on checkpoints written by real writers: DCP (single process and multi-rank), HF exports, LoRA."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from ckpttool.errors import UsageError
from ckpttool.format import CheckpointReader
from ckpttool.model.checkpoint import OpenOptions
from ckpttool.ops.diff import DiffOptions, diff_checkpoints
from ckpttool.ops.export import ExportOptions
from ckpttool.ops.export.execute import export_checkpoint
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()
DOWN = "model.model.layers.1.mlp.down_proj.weight"


def cli(*args: object) -> Any:
    return runner.invoke(app, ["diff", *map(str, args)])


def diff_json(*args: object, code: int) -> dict[str, Any]:
    res = cli(*args, "--json")
    assert res.exit_code == code, res.stderr + res.stdout
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("diff"))
    return doc


@pytest.fixture(scope="session")
def llama_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama", hf_models.build_llama)


@pytest.fixture(scope="session")
def llama_tied_differ_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama_tied_differ", hf_models.build_llama_tied_differ)


@pytest.fixture(scope="session")
def llama_tied_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_llama_tied", hf_models.build_llama_tied)


@pytest.fixture(scope="session")
def qwen_legacy_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_qwen_moe_legacy", hf_models.build_qwen_moe_legacy)


@pytest.fixture(scope="session")
def lora_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_lora", hf_models.build_lora)


def resave(src: Path, out: Path, change: tuple[str, tuple[int, ...]] | None = None) -> Path:
    """The model of ``src`` saved again by a single-process ``dcp.save`` (optionally one element changed)."""
    with CheckpointReader(src) as r:
        sd = {
            k.removeprefix("model."): r.read_tensor(k)
            for k, m in r.metadata.entries.items()
            if k.startswith("model.") and hasattr(m, "chunks")
        }
    if change is not None:
        key, idx = change
        sd[key.removeprefix("model.")][idx] += 1
    dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    return out


# ------------------------------------------------------------------------------------------ DCP vs DCP


def test_same_checkpoint_is_equal_and_compared_as_raw_records(dense_ckpt: Path) -> None:
    doc = diff_json(dense_ckpt, dense_ckpt, "--what", "all", code=0)
    assert doc["equal"] and doc["naming"] == "torch-native" and doc["differences"] == []
    c = doc["counts"]
    assert c["different"] == 0 and c["raw"] > 0 and c["compared"] > c["raw"]  # + hyperparameters, byte items


def test_four_rank_fsdp_save_equals_its_single_process_resave(fsdp_ckpt: Path, tmp_path: Path) -> None:
    one = resave(fsdp_ckpt, tmp_path / "one")
    res = diff_checkpoints(fsdp_ckpt, one)
    assert res.equal and res.compared > 0
    # dim-0 row blocks (uneven and zero-size chunks too) are compared as byte streams, undecoded
    assert res.raw_compared == res.compared
    # as decoded tensors (a cast to the stored dtype is a no-op that disables the byte path): equal too
    assert diff_checkpoints(fsdp_ckpt, one, DiffOptions(rtol=0.0)).equal


def test_one_element_of_one_chunk_is_found_and_named_with_its_global_index(fsdp_ckpt: Path, tmp_path: Path) -> None:
    with CheckpointReader(fsdp_ckpt) as r:
        key = next(
            k
            for k, m in r.metadata.entries.items()
            if k.startswith("model.") and hasattr(m, "chunks") and len(m.chunks) > 1 and len(m.size) == 2
        )
        size = r.metadata.entries[key].size
    idx = (size[0] - 1, size[1] // 2)  # in the last rank's chunk
    b = resave(fsdp_ckpt, tmp_path / "b", (key, idx))
    doc = diff_json(fsdp_ckpt, b, code=1)
    assert doc["equal"] is False and doc["counts"]["different"] == 1
    (d,) = doc["differences"]
    assert d["kind"] == "values" and d["name"] == key and d["index"] == list(idx) and d["mismatched"] == 1
    assert d["max_abs_error"] > 0
    human = cli(fsdp_ckpt, b)
    assert (
        human.exit_code == 1 and f"first at {list(idx)}" in human.stdout and "DIFFERENT: 1 difference" in human.stdout
    )


def test_same_chunking_with_one_element_changed_skips_the_raw_path_by_crc(dense_ckpt: Path, tmp_path: Path) -> None:
    a, b = resave(dense_ckpt, tmp_path / "a"), resave(dense_ckpt, tmp_path / "b", (DOWN, (2, 3)))
    res = diff_checkpoints(a, b)
    assert not res.equal and [d.index for d in res.differences] == [[2, 3]]
    assert res.raw_compared == res.compared - 1


def test_keys_on_one_side_and_shapes_are_differences(dense_ckpt: Path, tmp_path: Path) -> None:
    with CheckpointReader(dense_ckpt) as r:
        sd = {
            k.removeprefix("model."): r.read_tensor(k)
            for k, m in r.metadata.entries.items()
            if k.startswith("model.") and hasattr(m, "chunks")
        }
    sd.pop("model.norm.weight")
    sd[DOWN.removeprefix("model.")] = sd[DOWN.removeprefix("model.")][:-1].clone()
    sd["extra.weight"] = torch.ones(2)
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    doc = diff_json(dense_ckpt, tmp_path / "b", code=1)
    kinds = {d["name"]: d["kind"] for d in doc["differences"]}
    assert kinds == {"model.model.norm.weight": "only_a", DOWN: "shape", "model.extra.weight": "only_b"}


class _WithExtraState(torch.nn.Module):
    """A ``Linear`` whose module keeps extra state (``get_extra_state``: how TransformerEngine saves its FP8 scaling
    metadata), so that ``state_dict()`` holds ``lin._extra_state`` beside the tensors."""

    def __init__(self, meta: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.meta = meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> dict[str, int]:
        return {"fp8_meta": self.meta}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.meta = state["fp8_meta"]


def _save_with_extra_state(out: Path, meta: int, extra: dict[str, Any] | None = None) -> Path:
    torch.manual_seed(0)
    model = _WithExtraState(meta)
    dcp.save({"model": {**model.state_dict(), **(extra or {})}}, checkpoint_id=str(out), no_dist=True)
    return out


def test_a_models_byte_items_are_compared_with_its_tensors(tmp_path: Path) -> None:
    """A byte item under the model's prefix (a module's extra state, ``model._extra_state.fp8_meta``) is part of what
    the model's ``load_state_dict`` gets back, yet the default `diff` (``--what model``) left it out: two models whose
    extra state differs, or with a byte item on one side only, were "equal as models" (exit 0). It is compared (and
    paired) like the model's tensors now; torch's reader sees the two values differ."""
    a = _save_with_extra_state(tmp_path / "a", 1)
    b = _save_with_extra_state(tmp_path / "b", 2)
    c = _save_with_extra_state(tmp_path / "c", 1, {"other_extra": {"calibrated": True}})
    got_a: dict[str, Any] = {"model": {"_extra_state": {"fp8_meta": 0}}}
    got_b: dict[str, Any] = {"model": {"_extra_state": {"fp8_meta": 0}}}
    dcp.load(got_a, checkpoint_id=str(a), no_dist=True)
    dcp.load(got_b, checkpoint_id=str(b), no_dist=True)
    assert got_a["model"]["_extra_state"] == {"fp8_meta": 1} and got_b["model"]["_extra_state"] == {"fp8_meta": 2}

    doc = diff_json(a, b, code=1)
    assert [(d["name"], d["kind"]) for d in doc["differences"]] == [("model._extra_state.fp8_meta", "object")]
    res = cli(a, b)
    assert res.exit_code == 1 and "object: model._extra_state.fp8_meta: 1 in A, 2 in B" in res.stdout, res.stdout
    doc = diff_json(a, c, code=1)
    assert [(d["name"], d["kind"]) for d in doc["differences"]] == [("model.other_extra.calibrated", "only_b")]
    doc = diff_json(a, _save_with_extra_state(tmp_path / "a2", 1), code=0)  # a second save of the same model
    assert doc["equal"] and doc["counts"]["tensors"] == 2
    doc = diff_json(a, b, "--what", "all", code=1)
    assert [(d["name"], d["kind"]) for d in doc["differences"]] == [("model._extra_state.fp8_meta", "object")]
    # the same model saved as torch's DCP tutorial saves it ({"app": {"model": ...}}): its byte item is named by the
    # model's fqn as its tensors are; `--what all` called it 'app.model._extra_state.fp8_meta', only in B
    torch.manual_seed(0)
    app = tmp_path / "app"
    dcp.save({"app": {"model": _WithExtraState(1).state_dict()}}, checkpoint_id=str(app), no_dist=True)
    for what in ("model", "all"):
        doc = diff_json(a, app, "--what", what, code=0)
        assert doc["b"]["schema"] == "app-state" and doc["equal"] and doc["differences"] == []


# ------------------------------------------------------------------------------------------ DCP vs HF export


def test_a_model_assets_config_json_symlinked_out_is_refused_not_read(llama_ckpt: Path, tmp_path: Path) -> None:
    """Against a safetensors folder without a ``config.json``, diff reads the adapter's dimensions from the DCP
    side's ``model_assets``; a ``config.json`` there that is a symlink out of its folder is E101, not followed, as
    every other reading of a folder's own config (``docs/errors.md``)."""
    import shutil

    export_checkpoint(llama_ckpt, tmp_path / "hf", ExportOptions())
    assert not (tmp_path / "hf" / "config.json").exists()
    ck = shutil.copytree(llama_ckpt, tmp_path / "ck")
    outside = (ck / "model_assets" / "config.json").rename(tmp_path / "elsewhere.json")
    (ck / "model_assets" / "config.json").symlink_to(outside)
    res = cli(ck, tmp_path / "hf", "--json")
    assert res.exit_code == 2, res.stdout + res.stderr
    assert "[E101]" in res.stderr and "config.json" in res.stderr and res.stdout == ""


def test_a_model_assets_folder_symlinked_out_is_refused_not_read(llama_ckpt: Path, tmp_path: Path) -> None:
    """As its ``config.json``, the DCP side's ``model_assets`` folder itself symlinked out of the checkpoint folder is
    E101: the config read from it was the one of the folder the link points at, outside the checkpoint."""
    import shutil

    export_checkpoint(llama_ckpt, tmp_path / "hf", ExportOptions())
    ck = shutil.copytree(llama_ckpt, tmp_path / "ck")
    outside = (ck / "model_assets").rename(tmp_path / "elsewhere")
    (ck / "model_assets").symlink_to(outside, target_is_directory=True)
    res = cli(ck, tmp_path / "hf", "--json")
    assert res.exit_code == 2, res.stdout + res.stderr
    assert "[E101]" in res.stderr and "model_assets" in res.stderr and res.stdout == ""


def test_sharded_hf_export_equals_its_checkpoint(llama_ckpt: Path, tmp_path: Path) -> None:
    export_checkpoint(llama_ckpt, tmp_path / "hf", ExportOptions(shard_size=20_000))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    doc = diff_json(llama_ckpt, tmp_path / "hf", code=0)
    assert (
        doc["naming"] == "export"
        and doc["b"]["kind"] == "safetensors"
        and doc["counts"]["raw"] == doc["counts"]["compared"]
    )
    # either order, and one file of the export against the checkpoint: only that file's tensors, the rest missing
    assert diff_checkpoints(tmp_path / "hf", llama_ckpt).equal
    one = sorted((tmp_path / "hf").glob("model-*.safetensors"))[0]
    res = diff_checkpoints(llama_ckpt, one)
    assert {d.kind for d in res.differences} == {"only_a"} and res.compared > 0


def test_bf16_export_of_fp32_weights_equals_with_as_dtype(llama_ckpt: Path, tmp_path: Path) -> None:
    export_checkpoint(llama_ckpt, tmp_path / "hf", ExportOptions(save_dtype="bfloat16"))
    doc = diff_json(llama_ckpt, tmp_path / "hf", code=1)
    assert {d["kind"] for d in doc["differences"]} == {"dtype"}
    doc = diff_json(llama_ckpt, tmp_path / "hf", "--as-dtype", "bf16", code=0)
    assert doc["comparison"]["as_dtype"] == "bfloat16"
    # a tolerance: BF16 keeps 8 bits of mantissa, so every element is within rtol 2^-8 and most are not within 1e-5
    doc = diff_json(llama_ckpt, tmp_path / "hf", "--rtol", "0.0040", code=0)
    assert doc["comparison"]["mode"] == "tolerance"
    doc = diff_json(llama_ckpt, tmp_path / "hf", "--rtol", "1e-5", code=1)
    d = doc["differences"][0]
    assert d["mismatched"] > d["numel"] // 2 and 0 < d["max_rel_error"] <= 2**-8


def test_tied_head_is_compared_with_the_embedding(
    llama_tied_ckpt: Path, llama_tied_differ_ckpt: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    export_checkpoint(llama_tied_ckpt, tmp_path / "tied", ExportOptions(model_assets=llama_tied_ckpt / "model_assets"))
    with safe_open(tmp_path / "tied" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    res = diff_checkpoints(llama_tied_ckpt, tmp_path / "tied")
    assert res.equal and any("tied" in n for n in res.notes)
    # a checkpoint whose lm_head differs from its embedding in one element, against an HF directory with a
    # tied config and no lm_head
    export_checkpoint(llama_tied_differ_ckpt, tmp_path / "differ", ExportOptions(filter_glob="model.model.*"))
    (tmp_path / "differ" / "config.json").write_bytes(
        (llama_tied_differ_ckpt / "model_assets" / "config.json").read_bytes()
    )
    res = diff_checkpoints(llama_tied_differ_ckpt, tmp_path / "differ")
    assert [(d.name, d.a_key, d.b_key, d.index) for d in res.differences] == [
        ("lm_head.weight", "model.lm_head.weight", "model.embed_tokens.weight", [0, 0])
    ]


def test_tied_master_export_equals_its_checkpoint_with_weights_master(fixture_root: Path, tmp_path: Path) -> None:
    """A tied parameter has one FP32 master (under the embedding's fqn); export writes the embedding from it and
    omits lm_head: diff --weights master compares A's lm_head from that master too, not the BF16 parameter."""
    from safetensors.torch import load_file, save_file

    src = cached_build(fixture_root, "export_master_tied", hf_models.build_master_tied)
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(weights="master", model_assets=src / "model_assets"))
    doc = diff_json(src, hf, "--weights", "master", code=0)
    assert doc["counts"]["compared"] == doc["b"]["tensors"] + 1  # B's embedding stands for both
    assert any("lm_head.weight has no master_weight of its own" in n for n in doc["notes"])
    doc = diff_json(hf, src, "--weights", "master", code=0)  # the DCP side as B
    # one element of the exported embedding changed: both A tensors it stands for differ there
    tensors = load_file(hf / "model.safetensors")
    tensors["model.embed_tokens.weight"][3, 1] += 0.5
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    doc = diff_json(src, hf, "--weights", "master", code=1)
    assert sorted((d["name"], d["index"]) for d in doc["differences"]) == [
        ("lm_head.weight", [3, 1]),
        ("model.embed_tokens.weight", [3, 1]),
    ]


def test_a_master_export_compared_without_weights_master_says_how(fixture_root: Path, tmp_path: Path) -> None:
    """BF16 parameters with FP32 masters against `export --weights master`: without --weights master every
    parameter is a dtype difference and the hint offered only --as-dtype / --rtol (which then compare the BF16
    parameters with the masters); a note names --weights master. Not against a params export."""
    src = cached_build(fixture_root, "export_master", hf_models.build_master)
    export_checkpoint(src, tmp_path / "m", ExportOptions(weights="master"))
    export_checkpoint(src, tmp_path / "p", ExportOptions())
    doc = diff_json(src, tmp_path / "m", code=1)
    (note,) = [n for n in doc["notes"] if "master weights" in n]
    assert note.startswith("A keeps FP32 master weights, and B holds float32 where A's parameters are stored")
    assert "20 tensor(s)" in note and note.endswith("with --weights master")
    assert not [n for n in diff_json(src, tmp_path / "p", code=0)["notes"] if "master weights" in n]
    assert not [n for n in diff_json(src, tmp_path / "m", "--weights", "master", code=0)["notes"] if "master" in n]


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_legacy_ep_checkpoint_equals_its_export(qwen_legacy_ckpt: Path, tmp_path: Path, experts: str) -> None:
    from ckpttool.layouts.declaration import LayoutDeclaration

    decl = LayoutDeclaration("legacy", hf_models.MOE_P, hf_models.MOE_F)
    export_checkpoint(
        qwen_legacy_ckpt, tmp_path / "hf", ExportOptions(experts=experts), opening=OpenOptions(declaration=decl)
    )
    layout = ["--source-layout", "legacy", "--ep-size", hf_models.MOE_P, "--ep-fsdp-size", hf_models.MOE_F]
    doc = diff_json(qwen_legacy_ckpt, tmp_path / "hf", *layout, code=0)
    if experts == "per-expert":
        assert any("per expert" in n for n in doc["notes"])
        assert doc["counts"]["compared"] > 3 * hf_models.MOE_EXPERTS
    # without the declaration the expert order is unknown: refused, not guessed
    res = cli(qwen_legacy_ckpt, tmp_path / "hf")
    assert res.exit_code == 2 and res.stderr.startswith("error: [E405]") and res.stdout == ""
    # declared the wrong way round, the experts are out of order: found
    wrong = ["--source-layout", "canonical", "--ep-size", hf_models.MOE_P, "--ep-fsdp-size", hf_models.MOE_F]
    doc = diff_json(qwen_legacy_ckpt, tmp_path / "hf", *wrong, code=1)
    assert all(".experts." in d["name"] for d in doc["differences"])


def test_lora_adapter_export_equals_its_checkpoint(lora_ckpt: Path, tmp_path: Path) -> None:
    export_checkpoint(lora_ckpt, tmp_path / "lora", ExportOptions(fmt="lora", lora_alpha=hf_models.LORA_ALPHA))
    doc = diff_json(lora_ckpt, tmp_path / "lora", code=0)
    assert doc["naming"] == "lora" and doc["b"]["kind"] == "lora" and doc["counts"]["compared"] > 0
    assert doc["excluded"] and all(e["reason"] == "not a LoRA adapter tensor" for e in doc["excluded"])
    # the adapter of another run differs
    with CheckpointReader(lora_ckpt) as r:
        key = next(k for k in r.metadata.entries if ".lora_B." in k)
    b = resave(lora_ckpt, tmp_path / "b", (key, (0, 0)))
    res = diff_checkpoints(b, tmp_path / "lora")
    assert [d.index for d in res.differences] == [[0, 0]] and "lora_B" in res.differences[0].name


def test_a_peft_checkpoint_against_a_safetensors_model_names_the_adapter_to_compare(
    lora_ckpt: Path, tmp_path: Path
) -> None:
    # diff of a PEFT LoRA checkpoint against its hf-merged export (or its base) was export's E601, its hint naming
    # export's `fmt` (an option diff does not have): now diff's own E610, naming the adapter export to compare with
    export_checkpoint(lora_ckpt, tmp_path / "merged", ExportOptions(fmt="hf-merged", lora_alpha=hf_models.LORA_ALPHA))
    for a, b, side in ((lora_ckpt, tmp_path / "merged", "A"), (lora_ckpt / "base", lora_ckpt, "B")):
        res = cli(a, b)
        assert res.exit_code == 2 and res.stdout == "" and "Traceback" not in res.stderr
        first, hint = res.stderr.splitlines()
        assert first.startswith(f"error: [E610] {side} ({lora_ckpt}): a PEFT LoRA checkpoint (") and ".lora_" in first
        assert hint == (
            f"hint: compare it with its adapter: `ckpttool export {lora_ckpt} ADAPTER --format lora`, then "
            f"`ckpttool diff {lora_ckpt} ADAPTER`; a merged export against another merged export"
        )


def test_a_peft_checkpoint_with_a_huge_lora_key_is_named_in_one_short_line(tmp_path: Path) -> None:
    # E610 printed the LoRA key whole: a key of 100,000 characters was an error line of 100 kB
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    key = "layers.0.q_proj." + "x" * 100_000 + ".lora_A.default.weight"
    model = {key: torch.ones(2, 2), "layers.0.q_proj.base_layer.weight": torch.ones(2, 2)}
    dcp.save({"model": model}, checkpoint_id=str(tmp_path / "peft"), no_dist=True)
    (tmp_path / "hf").mkdir()
    save_file({"layers.0.q_proj.weight": torch.ones(2, 2)}, str(tmp_path / "hf" / "model.safetensors"))
    res = cli(tmp_path / "peft", tmp_path / "hf")
    assert res.exit_code == 2 and res.stdout == "" and "Traceback" not in res.stderr
    first, _hint = res.stderr.splitlines()
    assert first.startswith("error: [E610] A (") and "'model.layers.0.q_proj.xxx" in first and len(first) < 800, first


# ------------------------------------------------------------------------------------------ unusable input


def test_unusable_inputs_exit_2_with_one_error(dense_ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "f.txt").write_text("x")
    for args in ([dense_ckpt, tmp_path / "empty"], [dense_ckpt, tmp_path / "f.txt"], [dense_ckpt, tmp_path / "nope"]):
        res = cli(*args)
        assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith("error: [E"), res.stderr
        assert "Traceback" not in res.stderr
    res = cli(dense_ckpt, dense_ckpt, "--as-dtype", "int8")
    assert res.exit_code == 2 and "--as-dtype" in res.stderr


def test_a_file_inside_a_checkpoint_is_sent_to_its_directory(dense_ckpt: Path, tmp_path: Path) -> None:
    """``diff A A/.metadata`` hinted the kinds of input diff takes; like every other command, it names the
    directory to pass instead. A file in a folder that holds no checkpoint keeps the general hint."""
    for name in (".metadata", "__0_0.distcp"):
        res = cli(dense_ckpt, dense_ckpt / name)
        assert res.exit_code == 2 and res.stdout == "", res.stderr
        err, hint = res.stderr.splitlines()
        assert err == f"error: [E610] {dense_ckpt / name}: a file that is not a .safetensors file", err
        assert hint == f"hint: pass the checkpoint directory, not a file in it: {dense_ckpt}", hint
    (tmp_path / "f.txt").write_text("x")
    res = cli(dense_ckpt, tmp_path / "f.txt")
    assert res.stderr.splitlines()[1].startswith("hint: pass a DCP checkpoint directory, a safetensors"), res.stderr


@pytest.mark.parametrize("flag, value", [("--rtol", "inf"), ("--atol", "1e400"), ("--atol", "nan")])
def test_a_tolerance_that_is_not_finite_is_refused(dense_ckpt: Path, flag: str, value: str) -> None:
    """An infinite tolerance passes any values (1.0 vs 200.0 'equal') and --json died on it with E999 (JSON has no
    inf): refused as replay-step refuses it."""
    res = cli(dense_ckpt, dense_ckpt, flag, value, "--json")
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.startswith(f"error: [E100] {flag} must be a finite number >= 0"), res.stderr


def test_short_read_of_a_raw_block_is_the_data_file_error_it_always_was(tmp_path: Path) -> None:
    import os
    from types import SimpleNamespace

    from ckpttool.engine.crc import crc32
    from ckpttool.errors import DataFileError
    from ckpttool.ops.diff.run import _run_equal

    f = tmp_path / "__0_0.distcp"
    f.write_bytes(bytes(range(100)))
    fd = os.open(f, os.O_RDONLY)
    counted: list[int] = []
    checked: list[int] = []
    side = SimpleNamespace(reader=SimpleNamespace(fd=lambda rel: fd, count_read=counted.append))

    def loc(start: int, n: int) -> SimpleNamespace:
        where = f"__0_0.distcp: 'model.w' chunk at ({start},)"
        info = SimpleNamespace(relative_path=f.name)
        return SimpleNamespace(
            where=where, info=info, data_start=start, nbytes=n, key="model.w", check_crc=checked.append
        )

    try:
        assert _run_equal(side, [loc(10, 40)], side, [loc(10, 25), loc(35, 15)])  # type: ignore[arg-type]
        assert counted == [40, 40] and checked == [crc32(bytes(range(10, 50)))] + [
            crc32(bytes(range(10, 35))),
            crc32(bytes(range(35, 50))),
        ]
        assert not _run_equal(side, [loc(10, 40)], side, [loc(11, 40)])  # type: ignore[arg-type]
        with pytest.raises(DataFileError) as ei:
            _run_equal(side, [loc(0, 64)], side, [loc(50, 64)])  # type: ignore[arg-type]
    finally:
        os.close(fd)
    e = ei.value
    assert e.message == "__0_0.distcp: 'model.w' chunk at (50,): short read" and e.fqn == "model.w"
    assert e.path == f.name and e.__cause__ is None and counted == [40, 40, 40, 40]


def test_a_directory_that_is_neither_or_holds_a_damaged_safetensors_file(tmp_path: Path, dense_ckpt: Path) -> None:
    """An empty directory is neither kind (E610); one whose weight file is damaged names that file's own error."""
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(app, ["diff", str(empty), str(dense_ckpt)])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E610] {empty}: neither a DCP checkpoint")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((2**63 - 1).to_bytes(8, "little") + b"{}")
    res = CliRunner().invoke(app, ["diff", str(bad), str(dense_ckpt)])
    assert res.exit_code == 2 and res.stderr.startswith(
        f"error: [E200] {bad / 'model.safetensors'}: not a valid safetensors"
    )


def test_a_url_side_is_read_at_its_prefix_and_named_by_its_url(dense_ckpt: Path) -> None:
    """diff reads a URL side as every command reads one (docs/storage.md): a prefix without objects is E141 naming
    the URL (was E610 'diff compares local checkpoints only'; before that a URL was folded into the local path
    's3:/bucket/...'); a step below a URL is refused, as step discovery is for local directories."""
    url = "memory://ckpttool-diff-empty/ckpt"
    for args in ((url, dense_ckpt), (dense_ckpt, url)):
        res = cli(*args)
        assert res.exit_code == 2 and res.stdout == "", res.output
        err, hint = res.stderr.splitlines()
        assert err == f"error: [E141] {url}: no object below this prefix", err
    res = cli(url, dense_ckpt, "--a-step", "3")
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E100] --a-step 3 given, but {url} is a URL"), (
        res.output
    )


def test_a_file_url_side_is_its_local_path(dense_ckpt: Path) -> None:
    """``file://PATH`` is the local path, as for every command that takes a URL (docs/storage.md)."""
    assert diff_json(f"file://{dense_ckpt}", dense_ckpt, code=0)["equal"] is True


def test_a_run_root_whose_step_has_a_damaged_metadata_names_it(tmp_path: Path, dense_ckpt: Path) -> None:
    """A run root (an OLMo-core ``stepN/``, a NeMo ``epoch_E_step_S/``) holds no ``.metadata`` itself: the
    error of the damaged ``.metadata`` found below it was replaced by E610 "neither a DCP checkpoint nor a
    safetensors directory"; inspect and export name the file. diff now names it too."""
    import shutil

    step = tmp_path / "run" / "step-1"
    shutil.copytree(dense_ckpt, step)
    md = step / ".metadata"
    md.write_bytes(md.read_bytes()[: md.stat().st_size // 2])
    res = CliRunner().invoke(app, ["diff", str(tmp_path / "run"), str(dense_ckpt)])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E200] {md} is not a readable pickle"), res.stderr


@pytest.mark.parametrize("atol", [None, "0.1"])
def test_packed_fp4_tensors_are_compared_by_their_codes(tmp_path: Path, atol: str | None) -> None:
    # float4_e2m1fn_x2 (two E2M1 codes per byte): torch converts it to nothing, so values are compared as codes
    import torch
    import torch.distributed.checkpoint as dcp

    codes = torch.arange(16, dtype=torch.uint8)
    for name, c in (("a", codes), ("b", codes + 1), ("c", codes.clone())):
        dcp.save({"model": {"w": c.view(torch.float4_e2m1fn_x2)}}, checkpoint_id=str(tmp_path / name), no_dist=True)
    tol = [] if atol is None else ["--atol", atol]
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json", *tol])
    assert res.exit_code == 1, res.stderr
    doc = json.loads(res.stdout)
    assert doc["equal"] is False and doc["tensors"][0]["mismatched"] == 16
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), *tol])
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("atol", [None, "0.01"])
def test_complex_tensors_differing_in_the_imaginary_part_differ(tmp_path: Path, atol: str | None) -> None:
    # torchtitan saves RoPE's complex64 freqs_cis; a cast to float64 dropped the imaginary parts (--atol: "equal")
    import torch
    import torch.distributed.checkpoint as dcp

    a = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)
    b = torch.tensor([1 + 5j, 2 + 2j], dtype=torch.complex64)
    for name, t in (("a", a), ("b", b)):
        dcp.save({"model": {"freqs_cis": t}}, checkpoint_id=str(tmp_path / name), no_dist=True)
    tol = [] if atol is None else ["--atol", atol]
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json", *tol])
    assert res.exit_code == 1, res.stderr
    (t,) = json.loads(res.stdout)["tensors"]
    assert t["mismatched"] == 1 and t["max_abs"] == 4.0
    want_rel = float(
        torch.linalg.vector_norm((a - b).to(torch.complex128)) / torch.linalg.vector_norm(b.to(torch.complex128))
    )
    assert abs(t["rel_l2"] - want_rel) < 1e-12
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "5"])
    assert res.exit_code == 0, res.stderr


def test_a_complex_element_is_within_the_tolerance_by_its_modulus_as_torch_isclose(tmp_path: Path) -> None:
    # each part of 0.0008+0.0008j is within --atol 1e-3 of 0, its modulus 0.00113 is not: diff said "equal within
    # tolerance" (exit 0, max abs 0.0008) where torch.allclose / numpy.allclose say not close
    import torch
    import torch.distributed.checkpoint as dcp

    b = torch.tensor([0j, 1 + 1j, 2 - 1j, 0.5j], dtype=torch.complex64)
    a = b.clone()
    a[0] = complex(0.0008, 0.0008)
    for name, t in (("a", a), ("b", b)):
        dcp.save({"model": {"freqs_cis": t}}, checkpoint_id=str(tmp_path / name), no_dist=True)
    modulus = float((a[0].to(torch.complex128) - b[0].to(torch.complex128)).abs())
    for atol, close in (("1e-3", False), ("1.2e-3", True)):
        assert bool(torch.allclose(a, b, rtol=0, atol=float(atol))) is close
        res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--atol", atol])
        assert res.exit_code == (0 if close else 1), (atol, res.stdout)
        (t,) = json.loads(res.stdout)["tensors"]
        assert t["mismatched"] == (0 if close else 1) and abs(t["max_abs"] - modulus) < 1e-12, t


def test_a_complex_element_with_an_infinite_part_is_within_only_when_equal_as_torch_isclose(tmp_path: Path) -> None:
    # inf+0j against inf+1j: |b| is inf, so atol + rtol*|b| let the imaginary parts 1 apart compare "within
    # tolerance" (exit 0); torch.isclose / numpy.isclose take a non-finite element as close only when equal
    import torch
    import torch.distributed.checkpoint as dcp

    inf = float("inf")
    b = torch.tensor([complex(inf, 1), complex(1, inf), complex(inf, 0), 1 + 1j], dtype=torch.complex64)
    a = torch.tensor([complex(inf, 0), complex(1, -inf), complex(inf, 0), 1 + 1j], dtype=torch.complex64)
    for name, t in (("a", a), ("b", b)):
        dcp.save({"model": {"freqs_cis": t}}, checkpoint_id=str(tmp_path / name), no_dist=True)
    close = torch.isclose(a, b, rtol=1e-5, atol=1e-8)
    assert close.tolist() == [False, False, True, True]
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--rtol", "1e-5"])
    assert res.exit_code == 1, res.stdout
    (t,) = json.loads(res.stdout)["tensors"]
    assert t["mismatched"] == int((~close).sum()) and t["status"] == "differ", t


def test_what_optimizer_against_a_safetensors_side_is_refused_not_equal(dense_ckpt: Path, tmp_path: Path) -> None:
    # it compared the model tensors and said "equal" although only the optimizer was asked for
    export_checkpoint(dense_ckpt, tmp_path / "hf", ExportOptions())
    for args in ([dense_ckpt, tmp_path / "hf"], [tmp_path / "hf", dense_ckpt]):
        res = cli(*args, "--what", "optimizer")
        assert res.exit_code == 2 and res.stdout == "", res.stdout
        err = res.stderr.splitlines()
        assert len(err) == 2 and err[0].startswith(f"error: [E610] {tmp_path / 'hf'}: --what optimizer but "), err
        assert "no optimizer state" in err[0] and err[1].startswith("hint: ")
    assert diff_json(dense_ckpt, tmp_path / "hf", "--what", "all", code=0)["counts"]["compared"] > 0


def test_an_opened_checkpoint_is_compared_as_its_path_is_and_left_open(dense_ckpt: Path, tmp_path: Path) -> None:
    """Every operation takes an opened Checkpoint (docs/design.md §5); diff raised a TypeError on one."""
    from ckpttool.model.checkpoint import open_checkpoint

    changed = resave(dense_ckpt, tmp_path / "changed", (DOWN, (0, 0)))

    def doc(a: Any, b: Any) -> dict[str, Any]:
        d = diff_checkpoints(a, b, DiffOptions(what="all")).to_dict()
        d.pop("seconds")
        return json.loads(json.dumps(d))

    want_same, want_changed = doc(dense_ckpt, dense_ckpt), doc(dense_ckpt, changed)
    with open_checkpoint(dense_ckpt) as ckpt:
        assert doc(ckpt, dense_ckpt) == want_same
        both = doc(ckpt, ckpt)  # one reader for both sides
        assert {**both, "bytes_read": 0} == {**want_same, "bytes_read": 0} and 0 < both["bytes_read"]
        got = doc(ckpt, changed)  # bytes_read: this diff's reads (items loaded once are not read again), not the
        assert {**got, "bytes_read": 0} == {**want_changed, "bytes_read": 0}  # handle's earlier reads as well
        assert 0 < got["bytes_read"] <= want_changed["bytes_read"]
        assert ckpt.reader.read_tensor(DOWN).shape == ckpt.metadata.entries[DOWN].size  # still open
        with pytest.raises(UsageError, match="a_step"):
            diff_checkpoints(ckpt, changed, DiffOptions(a_step="latest"))


@pytest.mark.parametrize("field", ["rtol", "atol"])
def test_a_tolerance_of_another_type_is_a_usage_error(dense_ckpt: Path, field: str) -> None:
    with pytest.raises(UsageError, match=f"`{field}` must be a finite number"):
        diff_checkpoints(dense_ckpt, dense_ckpt, DiffOptions(**{field: "1e-3"}))  # type: ignore[arg-type]


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_side_that_is_a_symlink_loop_is_one_coded_line(side: str, dense_ckpt: Path, tmp_path: Path) -> None:
    """``diff loop/a ckpt`` where ``loop/a -> b -> a``: the reader's error was compared with the side by
    ``Path.resolve()``, which raises ``RuntimeError: Symlink loop`` there, and diff ended with E999 internal error.
    It is the reader's coded error (exit 2) naming the side, as stats says of the same path."""
    import errno
    import os

    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OSError) as raised:  # what the system says of it
        os.stat(tmp_path / "a")
    assert raised.value.errno == errno.ELOOP
    loop = str(tmp_path / "a")
    res = CliRunner().invoke(app, ["diff", *([loop, str(dense_ckpt)] if side == "a" else [str(dense_ckpt), loop])])
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    err, hint = res.stderr.splitlines()
    assert re.match(r"error: \[E1\d\d\] ", err) and loop in err and "E999" not in err, err
    stats = CliRunner().invoke(app, ["stats", loop])
    assert stats.exit_code == 2 and stats.stderr.splitlines()[0] == err, (stats.stderr, err)


def test_export_mapping_options_between_two_dcp_sides_are_said_unused(dense_ckpt: Path, tmp_path: Path) -> None:
    """``diff ckpt ckpt --rules rules.yaml`` (or ``--adapter``, ``--weights master``): they map a DCP side to the
    names of a safetensors side, and between two DCP checkpoints they were dropped without a word, even a --rules
    file that does not exist: the user believed the comparison used them. A warning now names them as unused."""
    missing = tmp_path / "nope.yaml"
    for extra, named in (
        (["--rules", str(missing)], "--rules"),
        (["--adapter", "hf"], "--adapter"),
        (["--weights", "master"], "--weights master"),
    ):
        for json_flag in ([], ["--json"]):
            res = CliRunner().invoke(app, ["diff", str(dense_ckpt), str(dense_ckpt), *extra, *json_flag])
            assert res.exit_code == 0, res.stderr
            assert res.stderr.splitlines() == [
                f"warning: {named} maps a DCP checkpoint to a safetensors side's names: both sides are DCP "
                "checkpoints, compared by their own keys without it"
            ], res.stderr
    res = CliRunner().invoke(app, ["diff", str(dense_ckpt), str(dense_ckpt)])
    assert res.exit_code == 0 and "warning" not in res.stderr


def test_an_undeclared_ep_layout_of_b_names_b_and_its_options(qwen_legacy_ckpt: Path, tmp_path: Path) -> None:
    """A legacy EP checkpoint without a layout record as B, A declared: E405 named neither side nor path, and its
    hint said `--source-layout ... --ep-size ... --ep-fsdp-size`, A's options, which were given already: following
    it changed nothing. The error now names B and its path and the hint B's options; following it compares."""
    import shutil

    b = Path(shutil.copytree(qwen_legacy_ckpt, tmp_path / "b"))
    p, f = str(hf_models.MOE_P), str(hf_models.MOE_F)
    declared = ["--source-layout", "legacy", "--ep-size", p, "--ep-fsdp-size", f]
    res = cli(qwen_legacy_ckpt, b, *declared)
    assert res.exit_code == 2 and res.stdout == "", res.output
    error, hint = res.stderr.splitlines()
    assert error.startswith(f"error: [E405] B ({b}): model."), error
    assert hint.startswith("hint: declare it with --b-source-layout legacy|canonical --b-ep-size P --b-ep-fsdp-size F")
    assert "--b-no-ep" in hint and " --source-layout" not in hint and " --no-ep" not in hint, hint
    res = cli(qwen_legacy_ckpt, b)  # both undeclared: A is named first, with A's options
    assert res.stderr.startswith(f"error: [E405] A ({qwen_legacy_ckpt}): model."), res.stderr
    assert "hint: declare it with --source-layout legacy|canonical --ep-size P" in res.stderr, res.stderr
    doc = diff_json(
        qwen_legacy_ckpt, b, *declared, "--b-source-layout", "legacy", "--b-ep-size", p, "--b-ep-fsdp-size", f, code=0
    )
    assert doc["equal"] and doc["counts"]["tensors"] > 0


def test_an_undeclared_ep_layout_of_b_names_opening_b_in_the_library(qwen_legacy_ckpt: Path) -> None:
    """Through ``diff_checkpoints``, B's E405 hint named `b_source_layout`, `b_ep_size`, ...: the CLI's options, no
    parameter of the library, where B is declared by ``opening_b``'s declaration. The hint now says so, with the
    parameters of that declaration; following it compares (the CLI's hint, ``--b-source-layout``: the test above)."""
    from ckpttool.errors import AmbiguousLayoutError
    from ckpttool.layouts.declaration import LayoutDeclaration

    declared = LayoutDeclaration.from_options("legacy", hf_models.MOE_P, hf_models.MOE_F)
    with pytest.raises(AmbiguousLayoutError) as info:
        diff_checkpoints(qwen_legacy_ckpt, qwen_legacy_ckpt, opening_a=OpenOptions(declaration=declared))
    e = info.value
    assert e.message.startswith(f"B ({qwen_legacy_ckpt}): model.") and e.param == "opening_b", e.message
    assert e.hint.startswith(
        "B's layout is declared by the declaration of `opening_b`: declare it with `source_layout` legacy|canonical "
        "`ep_size` P `ep_fsdp_size` F"
    ), e.hint
    assert "b_" not in e.hint, e.hint
    res = diff_checkpoints(
        qwen_legacy_ckpt,
        qwen_legacy_ckpt,
        opening_a=OpenOptions(declaration=declared),
        opening_b=OpenOptions(declaration=declared),
    )
    assert res.equal and len(res.tensors) > 0


def test_a_bad_declaration_of_b_names_b_options(qwen_legacy_ckpt: Path, tmp_path: Path) -> None:
    """``--b-source-layout legacy --b-ep-size 2`` said "--source-layout legacy needs --ep-fsdp-size" (A's options,
    which were not given), and a declaration of B that contradicts its chunks said E404 without naming B."""
    p, f = str(hf_models.MOE_P), str(hf_models.MOE_F)
    a = ["--source-layout", "legacy", "--ep-size", p, "--ep-fsdp-size", f]
    res = cli(qwen_legacy_ckpt, qwen_legacy_ckpt, *a, "--b-source-layout", "legacy", "--b-ep-size", p)
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        "error: [E100] --b-source-layout legacy needs --b-ep-fsdp-size",
        "hint: declare the saving mesh: --b-source-layout L --b-ep-size P --b-ep-fsdp-size F",
    ], res.stderr
    res = cli(qwen_legacy_ckpt, qwen_legacy_ckpt, *a, "--b-no-ep", "--b-ep-size", p)
    assert res.stderr.startswith("error: [E100] --b-no-ep excludes --b-source-layout/--b-ep-size/--b-ep-fsdp-size")
    wrong = ["--b-source-layout", "legacy", "--b-ep-size", str(hf_models.MOE_EXPERTS + 1), "--b-ep-fsdp-size", "1"]
    res = cli(qwen_legacy_ckpt, qwen_legacy_ckpt, *a, *wrong)
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E404] B ({qwen_legacy_ckpt}): model."), res.stderr
    res = cli(qwen_legacy_ckpt, qwen_legacy_ckpt, "--source-layout", "legacy", "--ep-size", p)  # A's: as it was
    assert res.stderr.startswith("error: [E100] --source-layout legacy needs --ep-fsdp-size"), res.stderr


def test_rules_that_leave_out_every_key_say_so(tmp_path: Path) -> None:
    """``diff ckpt hf --rules r.yaml`` whose rules skip every model key said "no name in common (0 in A, 2 in B)" and
    hinted "pass its rules (--rules)": the rules given were the cause, and the "not compared" lines that say so are
    never printed with an error. The E611 line now says every key of A was left out, and why."""
    from safetensors.torch import save_file

    sd = {"w": torch.arange(4.0), "v": torch.ones(2)}
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "hf").mkdir()
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    rules = tmp_path / "r.yaml"
    rules.write_text("format: ckpttool.export-rules\nversion: 1\nkeys:\n  - {match: '^model\\.(.+)$', to: null}\n")
    assert cli(tmp_path / "ckpt", tmp_path / "hf").exit_code == 0  # without the rules: the same tensors
    res = cli(tmp_path / "ckpt", tmp_path / "hf", "--rules", rules)
    assert res.exit_code == 2 and res.stdout == "", res.output
    error, hint = res.stderr.splitlines()
    assert error.startswith(
        "error: [E611] nothing compared, so no verdict: no name in common (0 in A, 2 in B); every key of A was left "
        "out (2 skipped by a key rule); "
    ), error
    assert hint == f"hint: the rules of --rules ({rules}) leave out every key of A: check their `to: null` rules"


def test_a_layout_item_of_the_trainers_own_is_compared(tmp_path: Path) -> None:
    """``--what all`` left every byte item named ``layout`` out as "the layout record", so two saves whose
    trainer's own ``layout`` item differs ('bshd' vs 'sbhd') were reported equal (exit 0). Only ckpttool's record
    is left out now; the trainer's item is compared like any object."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for name, item in (("a", "bshd"), ("b", "sbhd"), ("c", "bshd")):
        dcp.save({"model": {"w": w}, "layout": item}, checkpoint_id=tmp_path / name, no_dist=True)
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--what", "all", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 1, res.stdout
    assert [(d["name"], d["kind"], d["a_value"], d["b_value"]) for d in doc["differences"]] == [
        ("layout", "object", "'bshd'", "'sbhd'")
    ]
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--what", "all"])
    assert res.exit_code == 0, res.stdout


def test_notes_name_diffs_own_options_not_the_librarys_parameters(tmp_path: Path) -> None:
    """A DCP checkpoint of a model outside the HF naming against its export: the note on its fqn-named keys printed
    the library's parameter names (`` `rules` ``, `` `adapter` ``) and export's `` `model_assets` ``, which diff
    has no option for (its config.json is the one in the safetensors folder)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    dcp.save({"model": net.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", ExportOptions())
    res = cli(tmp_path / "ckpt", tmp_path / "hf")
    assert res.exit_code == 0, res.output
    (note,) = [line for line in res.stdout.splitlines() if "exported as their fqn" in line]
    assert "--rules" in note and "--adapter" in note and "config.json in the safetensors folder" in note, note
    assert not re.search(r"`[a-z_]+`", note), note
