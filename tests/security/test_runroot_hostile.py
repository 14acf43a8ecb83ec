"""Hostile inputs to today's run-root, shard-config and import checks (tests/security conventions: real saves, damaged
copies, one line naming the file, the documented exit code, the source never modified)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _damage_config(folder: Path, how: str) -> None:
    cfg = folder / "config.json"
    cfg.unlink()
    if how == "malformed":
        cfg.write_text("{")
    elif how == "fifo":
        os.mkfifo(cfg)
    else:  # a link out of the folder
        outside = folder.parent / "outside.json"
        outside.write_text(json.dumps({"model_type": "llama"}))
        cfg.symlink_to(outside)


@pytest.mark.parametrize("how", ["malformed", "fifo", "link_out"])
def test_unreadable_config_beside_shards_is_not_named_as_the_proof(
    hf_shards_root: Path, tmp_path: Path, how: str
) -> None:
    """A save_distributed folder's config.json that cannot be read: validate and export passed it over in silence,
    and S017 / export's warning told the user to check the shards against that very config.json ("`ckpttool
    validate` and `export` do"), which neither had read. Now the warning says it was not read and why."""
    src = tmp_path / "shards"
    shutil.copytree(hf_shards_root / "w2" / "with_config", src)
    _damage_config(src, how)
    before = _digest(src)
    res = runner.invoke(app, ["validate", str(src), "--json"])
    assert res.exit_code == 0, res.output
    (f,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "S017"]
    assert "the config.json beside them was not read" in f["message"], f["message"]
    assert "`ckpttool validate` and `export` do" not in f["message"]
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    warnings = "\n".join(json.loads(res.stdout)["warnings"])
    assert "the config.json beside them was not read" in warnings and "`export` do" not in warnings
    assert "Traceback" not in res.output and _digest(src) == before
