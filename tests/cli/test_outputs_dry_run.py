"""``--dry-run`` of export, import and reshard: the plan of the very run, checked, nothing written.

The dry run goes through the same planning as the run (export plan, reshard plan, import placement)
and stops before the output directory: OUT (and its missing parents) never appear. Its numbers are
compared with a real run of the same command; ``--json`` is the command's own document (its JSON
Schema) with ``dry_run: true``; what the real run would refuse (a foreign OUT) it refuses the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


def cli(*args: object):  # type: ignore[no-untyped-def]
    return runner.invoke(app, [str(a) for a in args])


def valid(name: str, doc: dict) -> dict:  # type: ignore[type-arg]
    errors = list(jsonschema.Draft202012Validator(load_schema(name)).iter_errors(doc))
    assert not errors, [(list(e.path), e.message[:200]) for e in errors[:5]]
    return doc


@pytest.fixture(scope="module")
def hf_export(sample_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    assert cli("export", sample_ckpt, out, "--shard-size", "60KB").exit_code == 0
    return out


def test_export_dry_run_is_the_plan_of_the_export(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "sub" / "hf"
    args = ["--save-dtype", "bf16", "--shard-size", "40KB", "--model-assets", sample_ckpt / "model_assets"]
    res = cli("export", sample_ckpt, out, *args, "--filter", "*layers*", "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.startswith("dry run: would export ") and "nothing was written" in res.stdout
    assert "casts: float32->bfloat16" in res.stdout and 'config.json torch_dtype "float32" -> "bfloat16"' in res.stdout
    assert not (tmp_path / "new").exists()
    res = cli("export", sample_ckpt, out, *args, "--filter", "*layers*", "--dry-run", "--json")
    assert res.exit_code == 0, res.stderr
    plan = valid("export", json.loads(res.stdout))
    assert plan["dry_run"] is True and plan["bytes_read"] == 0 and plan["skipped"]
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path) == []
    real = json.loads(cli("export", sample_ckpt, out, *args, "--filter", "*layers*", "--json").stdout)
    assert real["dry_run"] is False
    for k in ("tensors", "bytes", "casts", "skipped", "config_edits", "tied_embeddings", "assets"):
        assert plan[k] == real[k], k
    assert [(f["name"], f["tensors"]) for f in plan["files"]] == [(f["name"], f["tensors"]) for f in real["files"]]
    assert all(p["bytes"] < r["bytes"] for p, r in zip(plan["files"], real["files"]))  # real ones add the header


def test_reshard_dry_run_is_the_plan_of_the_reshard(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "rs"
    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    res = cli("reshard", sample_ckpt, out, *args, "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert "dry run: nothing was written" in res.stdout and "would also copy extra_state, model_assets" in res.stdout
    res = cli("reshard", sample_ckpt, out, *args, "--dry-run", "--json")
    assert res.exit_code == 0, res.stderr
    plan = valid("reshard", json.loads(res.stdout))
    assert not (tmp_path / "new").exists()
    real = json.loads(cli("reshard", sample_ckpt, out, *args, "--json").stdout)
    assert plan["dry_run"] is True and real["dry_run"] is False
    for k in ("ep_size", "ep_fsdp_size", "permuted", "ep_tensors", "chunks_copied", "chunks_rewritten", "extra_files"):
        assert plan[k] == real[k], k
    assert [f["path"] for f in plan["files"]] == [f["path"] for f in real["files"]]
    assert all(0 < p["bytes"] < r["bytes"] for p, r in zip(plan["files"], real["files"]))  # archives add headers


def test_import_dry_run_is_the_plan_of_the_import(hf_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "dcp"
    res = cli("import", hf_export, out, "--world-size", "2", "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.startswith("dry run: would import ") and "nothing was written" in res.stdout
    plan = valid("import", json.loads(cli("import", hf_export, out, "--world-size", "2", "--dry-run", "--json").stdout))
    assert not (tmp_path / "new").exists()
    real = json.loads(cli("import", hf_export, out, "--world-size", "2", "--json").stdout)
    assert plan["dry_run"] is True and real["dry_run"] is False
    for k in ("tensors", "bytes", "skipped", "world_size"):
        assert plan[k] == real[k], k
    assert [f["name"] for f in plan["files"]] == ["__0_0.distcp", "__1_0.distcp"]
    assert {f["name"] for f in plan["files"]} < {f["name"] for f in real["files"]}


@pytest.mark.parametrize("name", ["export", "import", "reshard"])
def test_dry_run_refuses_what_the_run_would_refuse(
    name: str, sample_ckpt: Path, dense_ckpt: Path, hf_export: Path, tmp_path: Path
) -> None:
    """A real checkpoint as OUT: the dry run says E606 as the run would, and touches nothing."""
    out = copy_checkpoint(dense_ckpt, tmp_path / "ckpt")
    before = sorted(os.listdir(out))
    argv = {
        "export": ["export", sample_ckpt, out],
        "import": ["import", hf_export, out],
        "reshard": ["reshard", sample_ckpt, out, "--to", "canonical", "--with-optimizer"],
    }[name]
    res = cli(*argv, "--dry-run", "--overwrite")
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-2].startswith("error: [E606] "), res.stderr
    res = cli(*argv, "--dry-run")
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-2].startswith("error: [E600] "), res.stderr
    assert sorted(os.listdir(out)) == before and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_dry_run_for_a_large_mesh_names_the_first_files_and_counts_the_rest(
    hf_export: Path, ep_suite: Path, tmp_path: Path
) -> None:
    """A dry run for 1,000 ranks printed all 1,000 ``__R_0.distcp SIZE`` on one line (~25 KB); the plan line names
    the first 8 and ``(+992 more)``; ``--json`` still lists every file."""
    res = cli("import", hf_export, tmp_path / "i", "--world-size", "1000", "--dry-run")
    assert res.exit_code == 0, res.stderr
    line = res.stdout.splitlines()[0]
    assert "__7_0.distcp" in line and "__8_0.distcp" not in line and ", ... (+992 more); nothing was written" in line
    assert len(line) < 600, len(line)
    doc = json.loads(cli("import", hf_export, tmp_path / "i", "--world-size", "1000", "--dry-run", "--json").stdout)
    assert len(doc["files"]) == 1000
    decl = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]
    args = ["reshard", ep_suite / "legacy", tmp_path / "r", "--to", "canonical", "--with-optimizer", *decl,
            "--target-ep-size", "8", "--target-ep-fsdp-size", "64", "--dry-run"]  # fmt: skip
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    plan = next(x for x in res.stdout.splitlines() if x.startswith("plan "))
    assert "__7_0.distcp" in plan and "__8_0.distcp" not in plan and ", ... (+504 more))" in plan, plan
    assert len(json.loads(cli(*args, "--json").stdout)["files"]) == 512
    assert not (tmp_path / "i").exists() and not (tmp_path / "r").exists()
