"""`validate --deep` of a ``dcp.save(use_collectives=False)`` save (each rank wrote its own copy of everything and its
``dcp.load`` reads that copy) whose rank-1 archive of one chunk is damaged (its zip header overwritten). The rank-0
copy is intact, so every other rule passes; D014's comparison passed the copy it could not read over, and validate
said OK while rank 1's resume fails on that archive. D014 names it now; the clean save stays OK."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow  # a 2-rank gloo job (cached)

runner = CliRunner()


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.ops.validate.test_rank_local_replicas import _build

    root = Path(os.environ.get("CKPTTOOL_FIXTURE_CACHE") or tmp_path_factory.mktemp("fx"))
    return cached_build(root, "rank_local_replicated", _build) / "ckpt"


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_damaged_higher_rank_copy_is_d014(
    replicated: Path, tmp_path: Path, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTTOOL_NATIVE", native)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(replicated, ckpt)
    clean = json.loads(runner.invoke(app, ["validate", "--deep", "--json", str(ckpt)]).stdout)
    assert clean["ok"] is True, clean["findings"]
    with open(ckpt / "__1.metadata", "rb") as f:  # torch's own metadata of rank 1 (a test's trusted file)
        md = pickle.load(f)
    info = next(s for i, s in md.storage_data.items() if i.fqn == "model.0.weight")
    data = bytearray((ckpt / info.relative_path).read_bytes())
    data[info.offset : info.offset + 4] = b"XXXX"  # the local header's signature
    (ckpt / info.relative_path).write_bytes(bytes(data))
    r = runner.invoke(app, ["validate", "--deep", "--json", str(ckpt)])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False, r.output
    (d014,) = [f for f in doc["findings"] if f["severity"] == "error"]
    assert d014["code"] == "D014" and d014["key"] == "model.0.weight", d014
    assert d014["message"].startswith(f"model.0.weight at [0, 0]: {info.relative_path}'s copy cannot be read (")
    assert d014["message"].endswith("), so that rank's dcp.load fails on it")
