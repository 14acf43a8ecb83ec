"""torch-checkpointing per-rank checkpoints (tests/fixtures/perrank.py: its own CheckpointManager, 1 and 2 gloo ranks).

Answers are checked against what torch gathers from the live FSDP2 model and optimizer
(``DTensor.full_tensor``).
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.checkpoint import open_checkpoint
from tests.fixtures import damage
from tests.fixtures.cache import cached_build

runner = CliRunner()


@pytest.fixture(scope="session")
def tc_root(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed (pip install --no-deps torch-checkpointing==0.1.1)")
    return cached_build(fixture_root, "perrank_torch_checkpointing", perrank.build_torch_checkpointing)


@pytest.mark.parametrize(("name", "world"), [("w1", 1), ("w1plain", 1), ("w2", 2), ("w2st", 2)])
def test_assembled_tensors_equal_torch_gathered(tc_root: Path, name: str, world: int) -> None:
    import torch

    ref = torch.load(tc_root / f"w{world}" / "reference.pt", weights_only=False)
    with open_checkpoint(tc_root / name / "step-2") as ck:
        assert ck.catalog.schema.id == "torch-checkpointing"
        assert set(ck.catalog.model) == {f"model.{k}" for k in ref["model"]}
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["names"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg_sq"), ref["exp_avg_sq"][k]), k
            assert float(ck.reader.read_tensor(f"optimizer.state.{k}.step")) == ref["step"][k]
            assert ck.reader.read_object(f"optimizer.param_groups.{k}.lr") == ref["lr"]
        assert ck.reader.read_object("lr_scheduler.last_epoch") == 2  # the scheduler file was read
        assert "lr_scheduler" in ck.located.described and "optimizer" in ck.located.described


@pytest.mark.parametrize("name", ["w2", "w2st"])
def test_equal_to_torch_checkpointings_own_load(tc_root: Path, name: str) -> None:
    import torch

    loaded = torch.load(tc_root / "w2" / f"loaded_{name}.pt", weights_only=False)
    with open_checkpoint(tc_root / name / "step-2") as ck:
        assert set(ck.catalog.model) == {f"model.{k}" for k in loaded}
        for k, t in loaded.items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k


@pytest.mark.parametrize("name", ["w2st", "w1plain"])
def test_validate_strict_deep_ok(tc_root: Path, name: str) -> None:
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(tc_root / name)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True


def test_safetensors_items_are_not_called_damaged(tc_root: Path) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(tc_root / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output
    assert "torch-checkpointing" in json.loads(res.output)["location"]["how"]


def test_staging_dir_of_an_unfinished_save_is_incomplete(tc_root: Path) -> None:
    """w1/tmp_step-3: the save torch-checkpointing's own writer left when it failed before its rename."""
    res = runner.invoke(app, ["validate", str(tc_root / "w1" / "tmp_step-3")])
    assert res.exit_code == 2, res.output
    assert "E202" in res.output and "did not finish" in res.output


def test_run_root_skips_the_staging_dir_and_reports_it(tc_root: Path) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(tc_root / "w1")])
    assert res.exit_code == 0, res.output
    loc = json.loads(res.output)["location"]
    assert loc["model"] == str(tc_root / "w1" / "step-2")
    assert [(i["step"], i["path"]) for i in loc["newer_incomplete"]] == [(3, str(tc_root / "w1" / "tmp_step-3"))]
    res = runner.invoke(app, ["validate", "--strict", str(tc_root / "w1")])
    assert res.exit_code == 1 and "R001" in res.output
    res = runner.invoke(app, ["inspect", "--step", "3", str(tc_root / "w1")])
    assert res.exit_code == 2 and "E202" in res.output and "tmp_step-3" in res.output


def test_export_of_the_run_root_names_the_step_it_exported_and_the_unfinished_newer_save(
    tc_root: Path, tmp_path: Path
) -> None:
    """``export RUN`` below a staging dir of a failed save exports step-2; it said neither which step it had taken
    nor that a newer save did not finish (validate's R001), and looked like the run's latest. The exported
    tensors equal those of step-2 exported by name."""
    import torch
    from safetensors.torch import load_file

    res = runner.invoke(app, ["export", str(tc_root / "w1"), str(tmp_path / "a"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["warnings"] == [
        f"a newer step's save did not finish: step 3 ({tc_root / 'w1' / 'tmp_step-3'}: torch-checkpointing's "
        "staging files, not renamed) is newer than the exported step 2; `ckpttool validate` reports it (R001)"
    ]
    assert doc["notes"][0].startswith(f"source {tc_root / 'w1' / 'step-2'} (")
    res = runner.invoke(app, ["export", str(tc_root / "w1" / "step-2"), str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    assert not json.loads(res.stdout)["warnings"] and not any(
        n.startswith("source ") for n in json.loads(res.stdout)["notes"]
    )
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_diff_of_the_run_root_notes_the_unfinished_newer_save(tc_root: Path) -> None:
    """``diff RUN --step latest`` compares step-2 below a failed save's staging dir: a note says the compared step
    is not the run's newest (validate's R001); the step directory given itself has no such note."""
    run = tc_root / "w1"
    res = runner.invoke(app, ["diff", str(run), str(run / "step-2"), "--step", "latest", "--json"])
    assert res.exit_code == 0, res.output
    notes = [n for n in json.loads(res.stdout)["notes"] if "(R001)" in n]
    assert notes == [
        f"A: a newer step's save did not finish: step 3 ({run / 'tmp_step-3'}: torch-checkpointing's staging "
        "files, not renamed) is newer than the compared step 2; `ckpttool validate` reports it (R001)"
    ]


def test_metadata_version_1_0_reads_as_2_0(tc_root: Path) -> None:
    """w2v1: w2's metadata.pkl in the "1.0" form (the package's own from_dict reads it back equal,
    tests/fixtures/perrank.py); torch-checkpointing's own load of it is the reference."""
    import torch

    loaded = torch.load(tc_root / "w2" / "loaded_w2v1.pt", weights_only=False)
    with open_checkpoint(tc_root / "w2v1" / "step-2") as ck:
        assert "metadata.pkl version 1.0" in ck.located.described
        assert set(ck.catalog.model) == {f"model.{k}" for k in loaded}
        for k, t in loaded.items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
    res = runner.invoke(app, ["diff", str(tc_root / "w2" / "step-2"), str(tc_root / "w2v1" / "step-2")])
    assert res.exit_code == 0 and "equal" in res.output, res.output


def test_layout_paths_json_and_raw_items(tc_root: Path) -> None:
    """w2x: the model at ``shards/rank-{rank}/weights.safetensors`` (named by metadata.pkl), a JSON and a
    raw item per rank; the values each rank saved come back per rank (they differ by rank)."""
    import torch

    from tests.fixtures.perrank import tc_extra_items

    loaded = torch.load(tc_root / "w2" / "loaded_w2x.pt", weights_only=False)
    with open_checkpoint(tc_root / "w2x" / "step-2") as ck:
        for k, t in loaded.items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for r in (0, 1):
            want = tc_extra_items(r)
            for k, v in want["config"].items():
                assert ck.reader.read_object(f"config.rank_{r}.{k}") == v
            assert ck.reader.read_object(f"blob.rank_{r}") == want["blob"]
        assert not any(k.startswith("notes") for k in ck.metadata.entries)


def test_files_no_item_names_fail_validate(tc_root: Path) -> None:
    """w2x's ``notes`` item (a custom path, no resharder: metadata.pkl does not record it) is not read: K020."""
    res = runner.invoke(app, ["validate", "--json", str(tc_root / "w2x" / "step-2")])
    assert res.exit_code == 1, res.output
    found = [f for f in json.loads(res.output)["findings"] if f["code"] == "K020"]
    assert len(found) == 1 and "extra/notes-0.json, extra/notes-1.json" in found[0]["message"]


@pytest.mark.parametrize(
    ("layout", "code", "text"),
    [
        ({"file_path": "model_0.pt", "serialization_format": {"type": "Pickle9"}}, "E280", "'Pickle9'"),
        ({"file_path": "../outside_0.pt", "serialization_format": {"type": "TorchSerialization"}}, "E", "outside"),
        (
            {"file_path": "gone/model_{rank}.pt", "serialization_format": {"type": "TorchSerialization"}},
            "E202",
            "gone/model_0.pt",
        ),
    ],
)
def test_bad_layout_in_metadata_is_refused(tc_root: Path, tmp_path: Path, layout: dict, code: str, text: str) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    md = pickle.loads((d / "metadata.pkl").read_bytes())
    md["metadata"]["model"]["rank_to_layout_info"][0] = layout
    (d / "metadata.pkl").write_bytes(pickle.dumps(md))
    res = runner.invoke(app, ["inspect", str(d)])
    assert res.exit_code == 2, res.output
    assert f"[{code}" in res.output and text in res.output


def test_unknown_metadata_version_is_refused_by_name(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    md = pickle.loads((d / "metadata.pkl").read_bytes())
    md["version"] = "3.7"
    (d / "metadata.pkl").write_bytes(pickle.dumps(md))
    res = runner.invoke(app, ["inspect", str(d)])
    assert res.exit_code != 0
    assert "E281" in res.output and "'3.7'" in res.output


def test_rank_file_copied_over_another_is_refused(tc_root: Path, tmp_path: Path) -> None:
    """model_0.pt copied over model_1.pt: rank 1's rows are in no file; every reader says so (E280),
    validate lists the tensors (S004)."""
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    shutil.copyfile(d / "model_0.pt", d / "model_1.pt")
    for cmd in (["inspect"], ["manifest"], ["stats"], ["export", str(tmp_path / "out")]):
        res = runner.invoke(app, [cmd[0], str(d), *cmd[1:]])
        assert res.exit_code == 2 and res.stdout == "", (cmd, res.output)
        assert res.stderr.startswith(
            f"error: [E280] {d}: the rank files' shards do not tile 21 tensor(s): model.model.embed_tokens.weight: "
            "gap: no chunk covers [32, 64) of dim 0 (and 20 more); model_0.pt and model_1.pt hold the same shards\n"
        ), res.stderr
    assert not (d / "manifest.json").exists() and not (tmp_path / "out").exists()
    res = runner.invoke(app, ["validate", str(d), "--json"])
    assert res.exit_code == 1
    assert len([f for f in json.loads(res.stdout)["findings"] if f["code"] == "S004"]) == 21


def test_missing_rank_file_is_incomplete(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    (d / "lr_scheduler_1.pt").unlink()
    res = runner.invoke(app, ["validate", str(d)])
    assert res.exit_code != 0 and "E202" in res.output


@pytest.mark.parametrize(
    ("copy_to", "text"),
    [
        ("model_2.pt", "item 'model': files of ranks [2] past world size 2 (from metadata.pkl)"),
        ("model_1.bin", "item 'model': more than one file of rank(s) [1]"),
    ],
)
def test_a_rank_file_of_another_save_is_named_as_extra(tc_root: Path, tmp_path: Path, copy_to: str, text: str) -> None:
    """A rank file past metadata.pkl's world size, or a second file of one rank: E280 naming the extra rank and
    saying another save's files are mixed in (it said E202 'missing e.g. []' with the hint 'the save did not finish')."""
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    shutil.copyfile(d / "model_1.pt", d / copy_to)
    for cmd in (["inspect"], ["validate", "--strict", "--deep"], ["export", str(tmp_path / "out")]):
        res = runner.invoke(app, [*cmd[:1], str(d), *cmd[1:]])
        assert res.exit_code == 2, res.output
        assert f"error: [E280] {d}: {text}" in res.output.replace("\n", "")
        assert "another save" in res.output and "missing e.g. []" not in res.output
    assert not (tmp_path / "out").exists()


def test_metadata_shape_disagreeing_with_the_shards_is_refused(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    md = pickle.loads((d / "metadata.pkl").read_bytes())
    entry = md["metadata"]["model"]["nested_path_to_metadata"]['["model.norm.weight"]'][0]
    entry["sharding_metadata"]["data"]["global_shape"] = [17]
    (d / "metadata.pkl").write_bytes(pickle.dumps(md))
    res = runner.invoke(app, ["validate", str(d)])
    assert res.exit_code != 0 and "E280" in res.output


def test_metadata_with_a_global_is_refused(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w1" / "step-2", tmp_path / "step-2")
    (d / "metadata.pkl").write_bytes(pickle.dumps({"version": "2.0", "metadata": {}, "world_size": 1, "p": Path("/")}))
    res = runner.invoke(app, ["inspect", str(d)])
    assert res.exit_code != 0 and "E201" in res.output


def test_replay_step_matches_reference(tc_root: Path) -> None:
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(tc_root / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output


def test_found_from_the_run_root(tc_root: Path) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(tc_root / "w2st")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["location"]["model"] == str(tc_root / "w2st" / "step-2")


def test_diff_pt_and_safetensors_saves_of_one_state_are_equal(tc_root: Path) -> None:
    res = runner.invoke(app, ["diff", str(tc_root / "w2" / "step-2"), str(tc_root / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output
    assert "equal" in res.output
    # each side says what it is once: the per-rank format is also the key schema's name
    assert "(torch-checkpointing)" in res.output and "torch-checkpointing, torch-checkpointing" not in res.output


def test_diff_schema_override_applies_to_a_safetensors_rank_file_save(tc_root: Path) -> None:
    # model_{rank}.safetensors rank files made the side look like a Hugging Face folder: the
    # --schema override was dropped for it (torch-checkpointing) and kept for the .pt save
    a, b = tc_root / "w2st" / "step-2", tc_root / "w2" / "step-2"
    res = runner.invoke(app, ["diff", "--json", "--schema", "torch-native", str(a), str(b)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert (doc["a"]["schema"], doc["b"]["schema"]) == ("torch-native", "torch-native"), (doc["a"], doc["b"])


@pytest.mark.parametrize(("what", "prefix"), [("model", "model."), ("optimizer", "optimizer.")])
def test_diff_what_compares_the_model_or_the_optimizer_state(tc_root: Path, what: str, prefix: str) -> None:
    # a per-rank save was taken for a safetensors folder: --what model compared its optimizer state too
    # (stored names), --what optimizer was E610 'neither side is a DCP checkpoint with optimizer state'
    a, b = tc_root / "w2" / "step-2", tc_root / "w2st" / "step-2"
    res = runner.invoke(app, ["diff", "--what", what, "--json", str(a), str(b)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    names = [t["name"] for t in doc["tensors"]]
    assert names and all(n.startswith(prefix) for n in names), names
    assert doc["naming"] == "torch-native" and doc["equal"] is True


def test_manifest_then_validate_names_a_changed_shard(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["manifest", str(d), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert runner.invoke(app, ["validate", "--manifest", str(out), str(d)]).exit_code == 0
    with open_checkpoint(d) as ck:
        meta = ck.metadata.entries["model.model.norm.weight"]
        info = ck.metadata.storage_for("model.model.norm.weight", meta.chunks[1])  # type: ignore[union-attr]
    assert info is not None and info.relative_path == "model_1.pt"
    with open(d / info.relative_path, "r+b") as f:
        f.seek(info.offset + 4)
        b = f.read(1)
        f.seek(info.offset + 4)
        f.write(bytes([b[0] ^ 0x40]))
    res = runner.invoke(app, ["validate", "--manifest", str(out), str(d)])
    assert res.exit_code != 0 and "model.model.norm.weight" in res.output


def test_manifest_names_a_changed_json_or_raw_item(tc_root: Path, tmp_path: Path) -> None:
    """w2x's JSON item (``config_R.json``) and raw item (``blob_R.bin``) are read as values, with an empty storage
    window: the manifest digested that empty window, so an edited seed or one flipped byte of the blob verified OK.
    Each is now a ``value`` entry, and the edit a ``changed`` one naming the item; the unedited copy still matches."""
    d = shutil.copytree(tc_root / "w2x" / "step-2", tmp_path / "step-2")
    assert runner.invoke(app, ["manifest", str(d)]).exit_code == 0
    assert runner.invoke(app, ["manifest", "--verify", str(d)]).exit_code == 0
    cfg = json.loads((d / "config_1.json").read_text())
    (d / "config_1.json").write_text(json.dumps({**cfg, "seed": cfg["seed"] + 1}))
    blob = bytearray((d / "blob_0.bin").read_bytes())
    blob[len(blob) // 2] ^= 1
    (d / "blob_0.bin").write_bytes(bytes(blob))
    res = runner.invoke(app, ["manifest", "--verify", "--json", str(d)])
    assert res.exit_code == 1, res.output
    problems = json.loads(res.stdout)["problems"]
    assert sorted((p["kind"], p["key"]) for p in problems) == [
        ("changed", "blob.rank_0"),
        ("changed", "config.rank_1.seed"),
    ]
    assert "its value differs from the manifest" in problems[0]["message"]
    by_key = {e["key"]: e for e in json.loads((d / "manifest.json").read_text())["entries"]}
    assert by_key["blob.rank_0"]["covers"] == by_key["config.rank_1.seed"]["covers"] == "value"


def test_an_item_file_that_is_no_longer_json_is_named(tc_root: Path, tmp_path: Path) -> None:
    """A damaged ``config_R.json`` (metadata.pkl says a JSON item) was E999 "internal error: JSONDecodeError"."""
    d = shutil.copytree(tc_root / "w2x" / "step-2", tmp_path / "step-2")
    (d / "config_0.json").write_text('{"name": "llama-tiny", "seed": ')
    for cmd in (["inspect"], ["manifest"]):
        res = runner.invoke(app, [*cmd, str(d)])
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines() == [
            f"error: [E280] {d / 'config_0.json'}: not readable JSON (JSONDecodeError), but the save's metadata "
            "says a JSON item",
            "hint: the item file changed after the save: restore it from a good copy of the checkpoint",
        ]
    assert not (d / "manifest.json").exists()


def test_manifest_written_beside_the_rank_files_is_not_a_file_left_unread(tc_root: Path, tmp_path: Path) -> None:
    """`ckpttool manifest DIR` writes DIR/manifest.json; `validate --strict --manifest DIR/manifest.json` then
    failed on K020 '1 file(s) not read: manifest.json' (the walk for files no item names took the tool's own
    manifest for the save's state). Another manifest.json (not ckpttool's) is still reported."""
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    assert runner.invoke(app, ["manifest", str(d)]).exit_code == 0
    res = runner.invoke(app, ["validate", "--strict", "--json", "--manifest", str(d / "manifest.json"), str(d)])
    assert res.exit_code == 0, res.output
    assert "K020" not in {f["code"] for f in json.loads(res.stdout)["findings"]}
    (d / "manifest.json").write_text('{"files": []}\n')
    res = runner.invoke(app, ["validate", "--strict", "--json", str(d)])
    assert res.exit_code == 1
    k020 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K020"]
    assert [f["message"] for f in k020] == ["1 file(s) not read: manifest.json"], k020


def test_torchtitan_torch_checkpointing_step_dirs(tc_root: Path) -> None:
    """titan/: torchtitan's TorchCheckpointingManager layout (<dump>/checkpoint/step-N; its save is a stub
    in torchtitan 0.3.0, see tests/fixtures/perrank.py _titan_tc_save) found from the dump folder like
    its DCP step directories: the steps listed (E204), --step latest the newest complete one with
    tmp_step-3 reported, --step 1 step-1, --step 3 the incomplete save (E202)."""
    import torch

    from ckpttool.model.discovery import CheckpointSelection

    dump = tc_root / "titan"
    if not dump.is_dir():
        pytest.skip("torchtitan is not installed (pip install --no-deps torchtitan==0.3.0)")
    ref = torch.load(dump / "reference.pt", weights_only=False)
    res = runner.invoke(app, ["inspect", str(dump)])
    assert res.exit_code == 2 and "E204" in res.output and "checkpoint/step-1; checkpoint/step-2" in res.output
    res = runner.invoke(app, ["inspect", "--json", "--step", "latest", str(dump)])
    assert res.exit_code == 0, res.output
    loc = json.loads(res.output)["location"]
    assert loc["model"] == str(dump / "checkpoint" / "step-2") and loc["step"] == 2
    assert [i["step"] for i in loc["newer_incomplete"]] == [3]
    res = runner.invoke(app, ["inspect", "--step", "3", str(dump)])
    assert res.exit_code == 2 and "E202" in res.output and "tmp_step-3" in res.output
    with open_checkpoint(dump, selection=CheckpointSelection.from_options("latest")) as ck:
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["names"]:  # torchtitan's flat optimizer state dict: state.<fqn>.<field>
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
            assert ck.reader.read_object(f"optimizer.param_groups.{k}.lr") == ref["lr"]
        assert ck.reader.read_object("train_state.step") == 2
        assert ck.reader.read_object("lr_scheduler.last_epoch") == 2
    res = runner.invoke(app, ["inspect", "--json", "--step", "1", str(dump)])
    assert res.exit_code == 0 and json.loads(res.output)["location"]["model"] == str(dump / "checkpoint" / "step-1")
    res = runner.invoke(app, ["validate", "--deep", "--json", "--step", "latest", str(dump)])
    assert res.exit_code == 0, res.output
    assert [f["code"] for f in json.loads(res.output)["findings"] if f["severity"] == "warning"] == ["R001"]


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_on_s3_is_refused_by_name(tc_root: Path, s3_server: Any, command: str) -> None:
    """A per-rank checkpoint below an s3:// prefix (moto server): a coded refusal naming the format and
    what is unsupported, never "no .metadata, not a checkpoint" and never an OK."""
    import uuid

    url = s3_server.upload_dir(tc_root / "w2st" / "step-2", "ckpts", f"tc-{uuid.uuid4().hex[:8]}")
    res = runner.invoke(app, [*s3_server.cli_options(), command, url])
    assert res.exit_code == 2, res.output
    assert "E280" in res.output and "torch-checkpointing per-rank checkpoint" in res.output
    assert "read from a local directory only, not from a URL" in res.output


def _edit_rank_file(src: Path, tmp_path: Path, edit: Any) -> Path:
    """``w2/step-2`` with ``edit(state_dict)`` applied to ``model_1.pt`` (loaded and saved again by torch)."""
    import torch

    d = shutil.copytree(src / "w2" / "step-2", tmp_path / "step-2")
    sd = torch.load(d / "model_1.pt", weights_only=False)
    edit(sd)
    torch.save(sd, d / "model_1.pt")
    return d


def _shard_dim(dim: int) -> Any:
    def edit(sd: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Shard

        v = sd["model.embed_tokens.weight"]
        spec = copy.copy(v._spec)
        object.__setattr__(spec, "placements", (Shard(dim),))
        sd["model.embed_tokens.weight"] = DTensor(v._local_tensor, spec, requires_grad=False)

    return edit


@pytest.mark.parametrize(
    ("edit", "text"),
    [
        # rank 0 saves a DTensor, rank 1 a string / an int / a list under the same key
        (lambda sd: sd.__setitem__("model.embed_tokens.weight", "hello"), "a tensor in one rank file"),
        (lambda sd: sd.__setitem__("model.embed_tokens.weight", 7), "a tensor in one rank file"),
        (lambda sd: sd.__setitem__("model.embed_tokens.weight", [1, 2]), "a tensor in one rank file"),
        # Shard(5) of a 2-d tensor
        (_shard_dim(5), "Shard(5) of a 2-d tensor"),
    ],
)
def test_rank_files_that_disagree_on_a_key_are_refused(tc_root: Path, tmp_path: Path, edit: Any, text: str) -> None:
    d = _edit_rank_file(tc_root, tmp_path, edit)
    for cmd in (["inspect", str(d)], ["export", str(d), str(tmp_path / "out")], ["validate", "--deep", str(d)]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2, res.output
        line = next(x for x in res.output.splitlines() if "[E" in x)
        assert "[E280]" in line and "model.embed_tokens.weight" in line and text in line, res.output
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_in_a_rank_file_fails_its_crc(tc_root: Path, tmp_path: Path) -> None:
    """A shard that is its whole torch.save storage record is checked against the record's zip CRC-32, as a
    DCP chunk is: one byte changed inside it is S014 in validate --deep and E308 where a command reads it."""
    ckpt = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    with open_checkpoint(ckpt) as ck:
        members = ck.reader.assembled.members  # type: ignore[attr-defined]
    (rel, off), m = next((k, v) for k, v in members.items() if k[0].startswith("model_1"))
    data = bytearray((ckpt / rel).read_bytes())
    data[off + m.size // 2] ^= 0x01
    (ckpt / rel).write_bytes(bytes(data))
    res = runner.invoke(app, ["validate", "--deep", "--json", str(ckpt)])
    assert res.exit_code == 1, res.output
    assert "S014" in {f["code"] for f in json.loads(res.stdout)["findings"]}
    res = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "hf")])
    assert res.exit_code == 2 and "[E308]" in res.stderr and "fails its CRC-32 check" in res.stderr, res.output
    assert not (tmp_path / "hf").exists()


def test_a_flipped_byte_in_a_rank_files_pickle_is_a_crc_error_not_a_misfit(tc_root: Path, tmp_path: Path) -> None:
    """A changed byte in a rank file's ``data.pkl`` (read when the checkpoint opens) fails its zip CRC-32: E308
    naming the file, not E280's "the per-rank files do not fit together" (whose hint is to re-save)."""
    import zipfile

    ckpt = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    rank_file = next(p for p in sorted(ckpt.iterdir()) if p.name.startswith("model_1") and p.suffix == ".pt")
    with zipfile.ZipFile(rank_file) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    damage.flip_member_byte(rank_file, info.filename, info.file_size // 2)  # inside the pickle
    for cmd in (["inspect", str(ckpt)], ["export", str(ckpt), str(tmp_path / "hf")]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and res.stderr.startswith(f"error: [E308] {rank_file}: "), res.output
        assert "data.pkl does not match its CRC-32" in res.stderr and "Traceback" not in res.output, res.output
    assert not (tmp_path / "hf").exists()


def test_manifest_records_each_shards_zip_crc(tc_root: Path, tmp_path: Path) -> None:
    """A per-rank shard's manifest entry carries its torch.save record's CRC-32 (as zipfile reads it), and a
    changed byte in a record gets no manifest (E308)."""
    import zipfile

    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    res = runner.invoke(app, ["manifest", str(d), "-o", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    entries = json.loads((tmp_path / "m.json").read_text())["entries"]
    crcs = {}
    for name in ("model_0.pt", "model_1.pt", "optimizer_0.pt", "optimizer_1.pt"):
        with zipfile.ZipFile(d / name) as z:
            crcs[name] = {f"{i.CRC:08x}" for i in z.infolist() if "/data/" in i.filename}
    recorded = [e for e in entries if e["crc32"] is not None]
    assert len(recorded) >= 42 and all(e["crc32"] in crcs[e["file"]] for e in recorded)
    e = next(e for e in recorded if e["file"] == "model_1.pt" and e["length"] >= 64)
    data = bytearray((d / "model_1.pt").read_bytes())
    data[e["offset"] + 8] ^= 0x01
    (d / "model_1.pt").write_bytes(data)
    res = runner.invoke(app, ["manifest", str(d), "-o", str(tmp_path / "m2.json")])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E308] {d / 'model_1.pt'}"), res.output
    assert not (tmp_path / "m2.json").exists()


def test_manifest_verify_names_a_dtype_changed_in_the_rank_files(tc_root: Path, tmp_path: Path) -> None:
    """A per-rank manifest had no metadata digest: a parameter relabelled float32 -> int32 in every rank file
    (the same bytes in each shard's window) verified as 'matches', exit 0."""
    import warnings

    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    res = runner.invoke(app, ["manifest", str(d)])
    assert res.exit_code == 0, res.output
    assert json.loads((d / "manifest.json").read_text())["metadata"]["file"] == "per-rank tensor metadata"
    res = runner.invoke(app, ["manifest", "--verify", str(d)])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"{d} (torch-checkpointing) matches its manifest ")  # was "(dcp)"
    for name in ("model_0.pt", "model_1.pt"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DeviceMesh unpickled without a process group
            sd = torch.load(d / name, weights_only=False)
        key = next(k for k, v in sd.items() if isinstance(v, DTensor) and v.dtype == torch.float32)
        s = sd[key]._spec
        spec = DTensorSpec(s.mesh, s.placements, TensorMeta(s.tensor_meta.shape, s.tensor_meta.stride, torch.int32))
        sd[key] = DTensor(sd[key]._local_tensor.view(torch.int32), spec, requires_grad=False)
        torch.save(sd, d / name)
    res = runner.invoke(app, ["manifest", "--verify", str(d)])
    assert res.exit_code == 1, res.output
    assert "metadata the rank files' tensor dtypes, shapes or chunks differ" in res.stdout, res.stdout


def test_a_per_rank_save_beside_a_dcp_checkpoint_is_named(tc_root: Path, tmp_path: Path) -> None:
    """Two trainers' saves in one folder: a DCP checkpoint with torch-checkpointing's rank files beside it
    opens as the DCP checkpoint; of the other save only ``optimizer_R.pt`` (an Accelerate-like name) was
    named, and ``model_R.pt``, ``lr_scheduler_R.pt`` and ``metadata.pkl`` were passed over in silence. Now
    ``inspect`` and ``validate`` (K012) name every one; the per-rank save itself names none of its own."""
    import torch
    import torch.distributed.checkpoint as dcp

    mixed = tmp_path / "mixed"
    dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(mixed))
    for f in (tc_root / "w2" / "step-2").iterdir():
        shutil.copy(f, mixed / f.name)
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(mixed)]).stdout)
    assert doc["unread_beside"] == [
        "lr_scheduler_0.pt",
        "lr_scheduler_1.pt",
        "metadata.pkl",
        "model_0.pt",
        "model_1.pt",
        "optimizer_0.pt",
        "optimizer_1.pt",
    ]
    res = runner.invoke(app, ["validate", "--strict", "--json", str(mixed)])
    assert res.exit_code == 1, res.output
    (k012,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K012"]
    assert "metadata.pkl, model_0.pt, model_1.pt, optimizer_0.pt (+1 more)" in k012["message"]
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(tc_root / "w2")]).stdout)
    assert doc["unread_beside"] == []


@pytest.mark.parametrize("name", ["w2", "w2x"])
def test_inspect_reports_the_ranks_that_saved_the_files(tc_root: Path, name: str) -> None:
    """``inspect`` of a per-rank save showed ``ranks: []`` (summary, files and tensors: ranks were read from
    ``__R_N.distcp`` names only) although each file is one rank's. Now the rank each file was saved by:
    from its name (``model_1.pt``) or from the path ``metadata.pkl`` gives it (``shards/rank-1/...``)."""
    import re

    step = tc_root / name / "step-2"
    res = runner.invoke(app, ["inspect", "--json", str(step)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["summary"]["ranks"] == [0, 1]
    files = {f["path"]: f["rank"] for f in doc["files"]}
    assert any("/" in p for p in files) == (name == "w2x")
    for path, rank in files.items():
        m = re.search(r"_(\d+)\.\w+$", path) or re.search(r"rank-(\d+)/", path)
        assert m is not None and rank == int(m.group(1)), (path, rank)
    sharded = [t for t in doc["model"] if t["chunks"] == 2]
    assert sharded and all(t["ranks"] == [0, 1] for t in sharded)
    out = runner.invoke(app, ["inspect", str(step)]).stdout
    assert f"files       {len(files)} data files from ranks 0,1, " in out


def test_stats_of_a_step_directory_given_itself_names_its_step(tc_root: Path) -> None:
    """stats of step-2/ given itself had step null (no trainer counter saved) while stats of the run root
    said step 2; the step the trainer named the directory by is the step now. torchtune's dist_epoch_0 counts
    epochs: no step is made of it."""
    for path in (tc_root / "w2x" / "step-2", tc_root / "w2x"):
        r = runner.invoke(app, ["stats", "--json", str(path)])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["checkpoints"][0]["step"] == 2, path
    tune = Path(__file__).resolve().parents[1] / "fixtures" / "torchtune_data" / "run_fsdp2" / "dist_epoch_0"
    r = runner.invoke(app, ["stats", "--json", str(tune)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["checkpoints"][0]["step"] is None


def test_stats_takes_no_step_from_torchtunes_epoch_directory() -> None:
    """stats of torchtune's run root (--step latest, or its one checkpoint found below it) said step 0: the 0 of
    dist_epoch_0, an epoch (the optimizer took steps in it); the step is unknown (null) now."""
    run = Path(__file__).resolve().parents[1] / "fixtures" / "torchtune_data" / "run_fsdp2"
    for extra in ([], ["--step", "latest"]):
        r = runner.invoke(app, ["stats", "--json", str(run), *extra])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["checkpoints"][0]["step"] is None, extra


def test_a_step_lost_on_one_rank_is_refused(tc_root: Path, tmp_path: Path) -> None:
    """rank 1's optimizer file without the step of one parameter (rank 0's read in its place as a replica):
    replay-step said OK, 21 of 21; that rank's optimizer fails on its first step after the resume. Now E280 naming
    the file, the parameter and the fields of both ranks."""
    import torch

    step = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    sd = torch.load(step / "optimizer_1.pt", weights_only=False)
    del sd["state"]["model.embed_tokens.weight"]["step"]
    torch.save(sd, step / "optimizer_1.pt")
    res = runner.invoke(app, ["replay-step", "--device", "cpu", str(step)])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines()[0] == (
        "error: [E280] optimizer_1.pt: optimizer state of 'model.embed_tokens.weight' has field(s) exp_avg, "
        "exp_avg_sq, optimizer_0.pt has exp_avg, exp_avg_sq, step"
    )


def test_manifest_verify_json_names_the_folder_as_the_text_does(tc_root: Path, tmp_path: Path) -> None:
    """`manifest --verify` printed "(torch-checkpointing)" while its --json said only ``"kind": "dcp"`` (the
    manifest's kind): the document now carries the text's label as ``folder``, ``kind`` keeps the manifest's."""
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    assert runner.invoke(app, ["manifest", str(d)]).exit_code == 0
    text = runner.invoke(app, ["manifest", "--verify", str(d)])
    assert text.exit_code == 0 and f"{d} (torch-checkpointing) matches" in text.stdout, text.output
    res = runner.invoke(app, ["manifest", "--verify", "--json", str(d)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["kind"], doc["folder"]) == ("dcp", "torch-checkpointing")


def test_an_older_manifests_empty_window_of_a_value_item_is_warned_of(tc_root: Path, tmp_path: Path) -> None:
    """A manifest written before per-rank JSON, raw and pickled items were digested by value lists each as a
    ``window`` entry of its empty storage window: it vouches for nothing of the value, yet ``manifest --verify`` of a
    flipped blob byte (or an edited lr) said OK in silence. It still verifies (the manifest is what it is), with a
    warning naming the items it cannot vouch for, as for an older manifest's other gaps; ``validate --manifest``
    says so as S016."""
    from ckpttool.format.digest import digest_bytes

    d = shutil.copytree(tc_root / "w2x" / "step-2", tmp_path / "step-2")
    assert runner.invoke(app, ["manifest", str(d)]).exit_code == 0
    man = json.loads((d / "manifest.json").read_text())
    for e in man["entries"]:
        if e["covers"] == "value":  # what the older ckpttool wrote: the digest of the empty window
            e["covers"], e["digest"] = "window", digest_bytes(b"", man["algorithm"])
    (d / "manifest.json").write_text(json.dumps(man))
    blob = bytearray((d / "blob_0.bin").read_bytes())
    blob[len(blob) // 2] ^= 1
    (d / "blob_0.bin").write_bytes(bytes(blob))
    res = runner.invoke(app, ["manifest", "--verify", "--json", str(d)])
    assert res.exit_code == 0, res.output
    warnings = json.loads(res.stdout)["warnings"]
    said = [w for w in warnings if "read as values" in w]
    assert len(said) == 1 and "blob.rank_0" in said[0] and "it cannot vouch for them" in said[0], warnings
    res = runner.invoke(app, ["validate", "--json", "--manifest", str(d / "manifest.json"), str(d)])
    s016 = [f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "S016"]
    assert any("read as values" in m and "blob.rank_0" in m for m in s016), s016


def test_hf_consolidation_beside_the_shards_is_the_hf_copy(tc_root: Path, tmp_path: Path) -> None:
    """torch-checkpointing's own ``consolidate_hf_safetensors_checkpoint`` writes the full model beside the rank
    files (its default output: ``model-00001-of-00001.safetensors`` + ``model.safetensors.index.json``). Before:
    ``validate --strict --deep`` failed the save, K020 '2 file(s) not read' (move them out); now they are the HF copy,
    compared with the assembled shards (D012): OK as saved, one changed element named."""
    from safetensors.torch import load_file, save_file
    from torch_checkpointing.hf.consolidation import consolidate_hf_safetensors_checkpoint
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    step = tmp_path / "step-2"
    shutil.copytree(tc_root / "w2st" / "step-2", step)
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    consolidate_hf_safetensors_checkpoint(str(step), storage_config=storage)
    hf = step / "model-00001-of-00001.safetensors"
    assert hf.is_file() and (step / "model.safetensors.index.json").is_file()
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(step)])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["ok"], doc["findings"]
    assert not [f for f in doc["findings"] if f["code"] in ("K020", "D012")], doc["findings"]
    r = runner.invoke(app, ["inspect", str(step)])
    assert r.exit_code == 0 and "model-00001-of-00001.safetensors beside it" in " ".join(r.stdout.split()), r.stdout
    tensors = load_file(hf)
    tensors["model.norm.weight"][3] += 1.0
    save_file(tensors, hf, metadata={"format": "pt"})
    r = runner.invoke(app, ["validate", "--deep", "--json", str(step)])
    found = [(f["code"], f["key"]) for f in json.loads(r.stdout)["findings"] if f["code"] == "D012"]
    assert r.exit_code == 1 and found == [("D012", "model.model.norm.weight")], r.stdout


@pytest.fixture(scope="module")
def tc_no_model(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed (pip install --no-deps torch-checkpointing==0.1.1)")
    return cached_build(fixture_root, "perrank_tc_no_model", perrank.build_torch_checkpointing_no_model) / "run"


def test_a_staging_dir_without_the_model_item_is_an_unfinished_save(tc_no_model: Path) -> None:
    """torch-checkpointing's own writer failed a save at its model item (safetensors refuses the tied lm_head) after
    writing the optimizer and scheduler items: tmp_step-3 holds optimizer_0.pt and lr_scheduler_0.pt, no model file,
    no metadata.pkl. Opened, it was E200 "no .metadata" with a hint to re-save the .pt file with transformers'
    save_pretrained; from the run root step-2 was validated OK with no word of the newer unfinished save. It is
    torch-checkpointing's staging directory of a save that did not finish (E202), and the run root's R001 names it."""
    res = runner.invoke(app, ["validate", str(tc_no_model / "tmp_step-3")])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[0] == (
        f"error: [E202] {tc_no_model / 'tmp_step-3'}: torch-checkpointing's staging directory of a save that did not "
        "finish (a finished save is renamed to 'step-3')"
    )
    res = runner.invoke(app, ["inspect", "--json", str(tc_no_model)])
    assert res.exit_code == 0, res.output
    loc = json.loads(res.output)["location"]
    assert loc["model"] == str(tc_no_model / "step-2")
    assert [(i["step"], i["path"]) for i in loc["newer_incomplete"]] == [(3, str(tc_no_model / "tmp_step-3"))]
    res = runner.invoke(app, ["validate", "--strict", "--json", str(tc_no_model)])
    assert res.exit_code == 1, res.output
    assert [f["key"] for f in json.loads(res.output)["findings"] if f["code"] == "R001"] == [
        str(tc_no_model / "tmp_step-3")
    ]
