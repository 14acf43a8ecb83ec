"""Hostile inputs against this session's new readers (torchtune ``optimizer_in_bwd`` key detection, D009/D010's
byte check, ...): folders written by torch's own ``dcp.save``, then given keys or bytes an adversary chooses.
Contract: the documented finding or E-code, one line, no traceback, no hang (each run under a 60 s guard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[2]


def _ckpttool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_a_per_parameter_optimizer_key_of_100k_dots_is_named_by_k002(tmp_path: Path) -> None:
    """A torchtune ``optimizer_in_bwd`` key ``optimizer.x.x...x.layers.0.w.state.0.exp_avg`` (10^5 dots): K002 names it
    as per-parameter optimizer state. Was: each of its 10^5 tails joined anew, per K002/K012/... call (20 s at 2*10^4
    dots, minutes at 10^5)."""
    ck = tmp_path / "ck"
    w = torch.randn(4, 4)
    state = {"layers.0.w": {"state": {0: {"exp_avg": torch.zeros(4, 4)}}}}
    state["x." * 100_000 + "layers.0.w"] = {"state": {0: {"exp_avg": torch.zeros(2)}}}
    dcp.save({"model": {"layers.0.w": w}, "optimizer": state}, checkpoint_id=str(ck), no_dist=True)
    res = _ckpttool("validate", str(ck), "--json")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    k002 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K002"]
    assert len(k002) == 1 and "2 of them are the state of one optimizer per parameter" in k002[0]["message"]
