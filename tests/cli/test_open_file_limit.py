"""An output with a data file per target rank keeps them all open while it is written: `import --world-size 1024`
under the common soft limit of 1024 open files was E600 'cannot create (Too many open files)' with the hint
'choose another output directory or pass --overwrite'. Now the soft limit is raised to the hard one; where that
is not enough the error says why and how to raise the limit. Run as real processes: the limit is per process."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

_REPO = Path(__file__).resolve().parents[2]
_LIMIT = 48
_RANKS = 64


@pytest.fixture
def hf(tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.arange(_RANKS * 4, dtype=torch.float32).reshape(_RANKS, 4)},
        str(d / "model.safetensors"),
    )
    return d


def _import(hf: Path, out: Path, *, hard: int | None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        _, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (_LIMIT, hard if hard is not None else hard_now))

    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", "import", str(hf), str(out), "--world-size", str(_RANKS), "--no-fsync"],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
        timeout=300,
        check=False,
    )


def test_import_for_more_ranks_than_the_soft_open_file_limit_succeeds(hf: Path, tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < _RANKS + 32:
        pytest.skip(f"hard open-file limit {hard} is too low for this test")
    res = _import(hf, tmp_path / "out", hard=None)
    assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "out").glob("__*_0.distcp"))) == _RANKS


def test_import_beyond_the_hard_open_file_limit_says_so_and_leaves_nothing(hf: Path, tmp_path: Path) -> None:
    res = _import(hf, tmp_path / "out", hard=_LIMIT)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 2, res.stderr
    assert lines[0].startswith("error: [E600] ") and "Too many open files" in lines[0]
    assert "one per target rank" in lines[0]
    assert lines[1].startswith("hint: raise the open-file limit") and "--overwrite" not in lines[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
