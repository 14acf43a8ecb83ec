"""OLMo-core 3.0 checkpoints written by its own ``Checkpointer`` (tests/fixtures/olmo_core_writer.py).

References: the full state gathered in the saving job (``get_*_state_dict(full_state_dict=True)``)
and OLMo-core's own reader (``olmo_core.distributed.checkpoint.load_keys``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow  # a 2-rank gloo job of OLMo-core's trainer checkpointer

runner = CliRunner()


@pytest.fixture(scope="module")
def olmo_root(fixture_root: Path) -> Path:
    from tests.fixtures.writers import missing

    why = missing("olmo_core.train.checkpoint", "olmo_core.nn.transformer")
    if why:
        pytest.skip(why)
    from tests.fixtures.olmo_core_writer import build_olmo_core

    return cached_build(fixture_root, "writers_olmo_core", build_olmo_core)


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def test_found_from_run_root_and_step_dir(olmo_root: Path) -> None:
    for given in (olmo_root / "run", olmo_root / "run" / "step2", olmo_root / "run" / "step2" / "model_and_optim"):
        doc = json.loads(cli("inspect", str(given), "--json"))
        assert doc["location"]["model"].endswith("step2/model_and_optim")
        ks = doc["key_schema"]
        assert ks["id"] == "olmo-core" and ks["optimizer_prefix"] == "optim." and ks["optimizer_keying"] == "fqn"
        assert any("under 'optim.', keyed by parameter fqn" in r for r in ks["reasons"])
        assert doc["summary"]["model_tensor_count"] == 21


def test_validate_names_training_state_beside(olmo_root: Path) -> None:
    res = runner.invoke(app, ["validate", str(olmo_root / "run"), "--deep", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["ok"], res.stdout
    assert [f["code"] for f in doc["findings"]] == ["K011"]
    assert "train/rank0.pt" in doc["findings"][0]["message"] and "train/rank1.pt" in doc["findings"][0]["message"]
    res = runner.invoke(app, ["validate", str(olmo_root / "run"), "--strict", "--json"])
    assert res.exit_code == 1  # --strict fails on what was not read
    res = runner.invoke(app, ["validate", str(olmo_root / "run"), "--strict", "--deep", "--ignore", "K011"])
    assert res.exit_code == 0, res.stdout


def test_export_and_reference(olmo_root: Path, tmp_path: Path) -> None:
    import torch
    from olmo_core.distributed.checkpoint import load_keys
    from safetensors.torch import load_file

    cli("export", str(olmo_root / "run"), str(tmp_path / "hf"))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = torch.load(olmo_root / "expected.pt", weights_only=True)
    assert sorted(got) == sorted(want["model"])
    assert all(got[k].equal(v) for k, v in want["model"].items())
    # OLMo-core's own reader of its checkpoints agrees with the optimizer state ckpttool reads
    some = "blocks.0.attention.w_q.weight"
    (exp_avg,) = load_keys(olmo_root / "run" / "step2" / "model_and_optim", [f"optim.state.{some}.exp_avg"])
    assert exp_avg.equal(want["optim"][f"state.{some}.exp_avg"])


def test_replay_diff_manifest(olmo_root: Path, tmp_path: Path) -> None:
    doc = json.loads(cli("replay-step", str(olmo_root / "run" / "step2"), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 21 and all(p["step_before"] == 2 for p in doc["params"])
    doc = json.loads(cli("diff", str(olmo_root / "run"), str(olmo_root / "run" / "step2"), "--what", "all", "--json"))
    assert doc["equal"] and doc["counts"]["compared"] == doc["counts"]["equal"] > 84
    cli("manifest", str(olmo_root / "run"), "-o", str(tmp_path / "m.json"))
    cli("manifest", str(olmo_root / "run"), "--verify", "--output", str(tmp_path / "m.json"))


def test_olmo_storage_info_is_never_imported(olmo_root: Path) -> None:
    """The .metadata pickles OLMo-core's _StorageInfo; the allow-list reads it by field, importing nothing."""
    import subprocess
    import sys

    md = olmo_root / "run" / "step2" / "model_and_optim" / ".metadata"
    assert b"olmo_core.distributed.checkpoint.filesystem" in md.read_bytes()
    code = (
        "import sys; from ckpttool.format.unpickler import load_metadata; "
        f"m = load_metadata({str(md)!r}); "
        "assert not any(k.startswith('olmo_core') for k in sys.modules), 'imported'; print(len(m.entries))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 84
