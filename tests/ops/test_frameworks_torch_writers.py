"""torch's own ``dcp.save`` writer options (tests/fixtures/torch_writers.py, 2 gloo ranks, FSDP2).

Every option's checkpoint is read by every command and checked against the independent
reference: the full state gathered by ``get_state_dict(full_state_dict=True)`` in the saving job
(``expected.pt``), and ``torch.distributed.checkpoint.load`` where torch can load the format
(the SAFETENSORS serialization it cannot: its ``FileSystemReader`` ``torch.load``\\ s every window;
those files are checked with the ``safetensors`` library instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow  # one 2-rank gloo job writes every variant

runner = CliRunner()
READABLE = ("safetensors", "no_collectives", "dedup_lowest", "one_file_threads", "async")


@pytest.fixture(scope="module")
def tw_root(fixture_root: Path) -> Path:
    from tests.fixtures.torch_writers import build_torch_writers

    return cached_build(fixture_root, "torch_writers", build_torch_writers)


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def _expected(root: Path) -> dict:
    import torch

    return torch.load(root / "expected.pt", weights_only=True)


@pytest.mark.parametrize("variant", READABLE)
def test_validate_deep_replay_diff(tw_root: Path, variant: str) -> None:
    src = str(tw_root / variant)
    doc = json.loads(cli("validate", src, "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["stats"]["bytes_read"] == 25364  # every model and optimizer value
    doc = json.loads(cli("inspect", src, "--json"))
    assert doc["key_schema"]["id"] == "torch-native" and doc["summary"]["model_tensor_count"] == 5
    assert doc["summary"]["ranks"] == [0, 1]
    doc = json.loads(cli("replay-step", src, "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 5
    doc = json.loads(cli("diff", str(tw_root / "default"), src, "--what", "all", "--json"))
    assert doc["equal"] and doc["counts"]["compared"] == doc["counts"]["equal"] == 75


@pytest.mark.parametrize("variant", READABLE)
def test_export_matches_full_state(tw_root: Path, variant: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    cli("export", str(tw_root / variant), str(out))
    got: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    want = _expected(tw_root)["model"]
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].equal(v), k


def test_safetensors_serialization_files(tw_root: Path, tmp_path: Path) -> None:
    """The SAFETENSORS format's data files: byte items, then one safetensors blob with DCP_SHARDING_INFO."""
    import pickle

    import torch
    from safetensors.torch import load

    src = tw_root / "safetensors"
    md = pickle.loads((src / ".metadata").read_bytes())
    blobs = {}
    for idx, info in md.storage_data.items():
        if idx.offset is not None:
            blobs[info.relative_path] = info.offset
    assert len(blobs) == 2  # one blob per rank file
    cli("manifest", str(src), "-o", str(tmp_path / "m.json"))
    man = json.loads((tmp_path / "m.json").read_text())
    n = 0
    for rel, at in blobs.items():
        data = (src / rel).read_bytes()
        tensors = load(data[at:])  # the safetensors library reads the blob as is
        for fqn, t in tensors.items():
            (e,) = [e for e in man["entries"] if e["key"] == fqn and e["file"] == rel]
            assert e["length"] == t.numel() * t.element_size() and e["covers"] == "window"
            assert data[e["offset"] : e["offset"] + e["length"]] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
            n += 1
    assert n == sum(1 for e in man["entries"] if e["offsets"] is not None)


def test_rank_local_metadata_is_one_checkpoint(tw_root: Path, tmp_path: Path) -> None:
    """Both ranks' __R.metadata read as one: every chunk of both ranks, replicated items once."""
    src = tw_root / "no_collectives"
    assert not (src / ".metadata").exists() and (src / "__1.metadata").is_file()
    ref = json.loads(cli("inspect", str(tw_root / "default"), "--json"))
    doc = json.loads(cli("inspect", str(src), "--json"))
    assert doc["summary"]["tensor_count"] == ref["summary"]["tensor_count"]
    assert doc["summary"]["byte_item_count"] == ref["summary"]["byte_item_count"]
    cli("manifest", str(src), "-o", str(tmp_path / "m.json"))
    cli("manifest", str(src), "--verify", "--output", str(tmp_path / "m.json"))


def test_rank_local_missing_rank_is_incomplete(tw_root: Path, tmp_path: Path) -> None:
    from tests.fixtures.cache import copy_checkpoint

    bad = copy_checkpoint(tw_root / "no_collectives", tmp_path / "c")
    (bad / "__1.metadata").unlink()
    res = runner.invoke(app, ["validate", str(bad)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E202]") and "rank(s) [1]" in res.stderr


def test_rank_local_found_below_run_root(tw_root: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(tw_root / "no_collectives", tmp_path / "run" / "step-7")
    doc = json.loads(cli("inspect", str(tmp_path / "run"), "--json"))
    assert doc["location"]["model"].endswith("step-7")


def test_nested_state_is_named_not_passed(tw_root: Path) -> None:
    src = str(tw_root / "nested")
    res = runner.invoke(app, ["validate", src, "--strict", "--json"])
    assert res.exit_code == 1
    codes = [f["code"] for f in json.loads(res.stdout)["findings"]]
    assert "K010" in codes and "K001" not in codes
    doc = json.loads(cli("inspect", src, "--json"))
    assert any("flatten_state_dict=False" in r for r in doc["key_schema"]["reasons"])
    res = runner.invoke(app, ["diff", src, src])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E611]") and "byte item" in res.stderr
    res = runner.invoke(app, ["export", src, str(tw_root / "never")])
    assert res.exit_code == 2 and not (tw_root / "never").exists()


def test_partial_async_save_is_incomplete(tw_root: Path, tmp_path: Path) -> None:
    """An async save cut before ``.metadata`` (torch's own data files left): E202, and ``--step latest`` on a
    run root picks the complete step below it (R001 names the newer one)."""
    import shutil

    src = tw_root / "async_partial"
    assert not (src / ".metadata").exists() and any(src.glob("__*_*.distcp"))
    res = runner.invoke(app, ["inspect", str(src)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E202]")
    shutil.copytree(tw_root / "async", tmp_path / "run" / "step-4")
    shutil.copytree(src, tmp_path / "run" / "step-6")
    doc = json.loads(cli("inspect", str(tmp_path / "run"), "--step", "latest", "--json"))
    assert doc["location"]["model"].endswith("step-4")
    res = runner.invoke(app, ["validate", str(tmp_path / "run"), "--step", "latest", "--json"])
    assert [f["code"] for f in json.loads(res.stdout)["findings"]] == ["R001"]


def test_dcp_load_reference(tw_root: Path) -> None:
    """torch's own reader loads the variants it can; the values equal the gathered full state."""
    import torch
    import torch.distributed.checkpoint as dcp

    want = _expected(tw_root)["model"]
    for variant in ("dedup_lowest", "one_file_threads", "async"):
        sd = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
        dcp.load(sd, checkpoint_id=str(tw_root / variant))
        assert all(sd["model"][k].equal(v) for k, v in want.items())


def test_safetensors_blob_damage_is_refused(tw_root: Path, tmp_path: Path) -> None:
    """A data file whose safetensors header is damaged: one coded error naming the file, nothing read as OK."""
    import pickle

    from tests.fixtures.cache import copy_checkpoint

    bad = copy_checkpoint(tw_root / "safetensors", tmp_path / "c")
    md = pickle.loads((bad / ".metadata").read_bytes())
    rel, at = next((i.relative_path, i.offset) for x, i in md.storage_data.items() if x.offset is not None)
    data = bytearray((bad / rel).read_bytes())
    data[at + 8 : at + 9] = b"["  # the header is no longer a JSON object
    (bad / rel).write_bytes(bytes(data))
    for cmd in (["validate", str(bad), "--deep"], ["export", str(bad), str(tmp_path / "out")]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and res.stderr.startswith("error: [E2"), res.stderr
        assert rel in res.stderr and "safetensors" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant", ["default", "safetensors"])
def test_data_file_cut_short_is_s003_in_either_serialization(tw_root: Path, tmp_path: Path, variant: str) -> None:
    """A data file cut in half (a crashed or still-running save): S003 / E300 naming the file, exit 1, the other rules
    run. The SAFETENSORS serialization said "not a valid safetensors file" (S001 E200, exit 2, everything skipped)."""
    import os

    from tests.fixtures.cache import copy_checkpoint

    ck = copy_checkpoint(tw_root / variant, tmp_path / "c")
    size = (ck / "__0_0.distcp").stat().st_size
    os.truncate(ck / "__0_0.distcp", size // 2)
    res = runner.invoke(app, ["validate", str(ck), "--strict", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and not res.stderr, res.stderr
    assert [(f["code"], f["error_code"], f["key"]) for f in doc["findings"]] == [("S003", "E300", "__0_0.distcp")]
    assert f"end past the end of the file ({size // 2} bytes, needs {size})" in doc["findings"][0]["message"]
