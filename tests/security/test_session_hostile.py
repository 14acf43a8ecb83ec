"""Hostile inputs against this session's new readers (torchtune ``optimizer_in_bwd`` key detection, D009/D010's
byte check, ...): folders written by torch's own ``dcp.save``, then given keys or bytes an adversary chooses.
Contract: the documented finding or E-code, one line, no traceback, no hang (each run under a 60 s guard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[2]


def _ckpttool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", *args], env=full, capture_output=True, text=True, timeout=60, check=False
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


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("overflowed", [False, True], ids=["finite", "exp_avg_sq-inf"])
def test_a_complex_exp_avg_beside_a_real_exp_avg_sq_is_no_adam_pair(
    tmp_path: Path, native: str, overflowed: bool
) -> None:
    """``exp_avg`` complex64 (read as its real and imaginary parts, twice the values) beside a real ``exp_avg_sq`` of
    the same chunks: no update size, said in a note. Was: E999 (numpy broadcast) in the pure-Python path and in the
    element-by-element read of an overflowed ``exp_avg_sq``; the native kernels paired values of the two at
    random (an update rms of 163)."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(8, 8, generator=g) * 1e-3
    v = torch.rand(8, 8, generator=g) * 1e-6
    if overflowed:
        v[0, 0] = float("inf")
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": ["w"]}]
    state = {"w": {"step": torch.tensor(5.0), "exp_avg": torch.complex(m, m), "exp_avg_sq": v}}
    sd = {"model": {"w": torch.randn(8, 8, generator=g)}, "optimizer": {"state": state, "param_groups": groups}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    res = _ckpttool("stats", str(tmp_path / "ck"), "--json", env={"CKPTTOOL_NATIVE": native})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "one moment complex and the other real, not AdamW's pair" in res.stdout, res.stdout[-3000:]


def test_a_newer_step_whose_metadata_is_a_fifo_is_said_incomplete_not_passed_over(tmp_path: Path) -> None:
    """``run/checkpoint_2/.metadata`` a FIFO (its data file beside it): no checkpoint, and not a finished save. Was:
    passed over in silence (``--step latest`` opened checkpoint_1 as the newest save, R001 silent, ``--step 2`` said
    no such step); now an incomplete step, as one with no ``.metadata``. Nothing reads the FIFO (no hang)."""
    run_root = tmp_path / "run"
    w = {"model": {"w": torch.randn(4, 4)}}
    dcp.save(w, checkpoint_id=str(run_root / "checkpoint_1"), no_dist=True)
    newer = run_root / "checkpoint_2"
    newer.mkdir()
    (newer / "__0_0.distcp").write_bytes((run_root / "checkpoint_1" / "__0_0.distcp").read_bytes())
    os.mkfifo(newer / ".metadata")
    res = _ckpttool("inspect", str(run_root), "--step", "latest")
    assert res.returncode == 0, res.stderr
    assert "step 2 is incomplete: .metadata that is not a regular file" in res.stdout, res.stdout[:1000]
    res = _ckpttool("validate", str(run_root), "--step", "latest", "--json")
    r001 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "R001"]
    assert len(r001) == 1 and "checkpoint_2" in r001[0]["message"], r001
    res = _ckpttool("inspect", str(run_root), "--step", "2")
    assert res.returncode == 2 and res.stderr.startswith("error: [E202] "), res.stderr


def test_accelerate_latest_past_an_incomplete_save_says_save_indexes(tmp_path: Path) -> None:
    """Accelerate's ``checkpoints/checkpoint_N`` with the newest save unfinished (its data file, no ``.metadata``):
    ``--step latest`` names both as save indexes. Was: 'step 0 (the highest complete step; step 1 is incomplete'
    (the save-index wording only matched a latest with nothing skipped)."""
    saves = tmp_path / "run" / "checkpoints"
    dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(saves / "checkpoint_0"), no_dist=True)
    # the RNG states every save_state writes (last, after the model and optimizer): what marks an Accelerate save
    torch.save({"torch_manual_seed": torch.get_rng_state()}, saves / "checkpoint_0" / "random_states_0.pkl")
    (saves / "checkpoint_1").mkdir()
    (saves / "checkpoint_1" / "__0_0.distcp").write_bytes((saves / "checkpoint_0" / "__0_0.distcp").read_bytes())
    res = _ckpttool("inspect", str(tmp_path / "run"), "--step", "latest")
    assert res.returncode == 0, res.stderr
    assert (
        "--step latest: save 0 (checkpoint_0, the highest complete save index: Accelerate numbers its saves, not steps;"
        " save 1 is incomplete: " in " ".join(res.stdout.split())
    ), res.stdout[:1000]
