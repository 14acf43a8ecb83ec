"""``replay-step`` on an accelerator (cuda / npu); every test skips cleanly without one.

Run by ``scripts/device_check.sh``. Checks: each optimizer variant replays on the device within
tolerance of the FP64 reference; with CPU offload the master and moments stay on the CPU,
the parameter on the device, and the offloaded parameters' results equal the uninterrupted
CPU run bitwise (their arithmetic runs on the CPU through the staging path).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.replay import ReplayOptions, replay_step
from ckpttool.optim_state.device import accelerator_type
from tests.fixtures.cache import cached_build
from tests.fixtures.replay import TRAIN_STEPS, VARIANTS, builder, load_recorded, variant_type

DEVICE_TYPE = accelerator_type()
pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(DEVICE_TYPE is None, reason="needs an accelerator (cuda/npu)"),
]


@pytest.fixture(scope="module", params=VARIANTS)
def fx(request: pytest.FixtureRequest, fixture_root: Path) -> tuple[str, Path]:
    return request.param, cached_build(fixture_root, f"replay_{request.param}", builder(request.param))


def test_each_variant_replays_on_the_device_within_tolerance(fx: tuple[str, Path]) -> None:
    variant, root = fx
    res = CliRunner().invoke(
        app, ["replay-step", str(root / "ckpt"), "--device", DEVICE_TYPE, "--json", "--steps", "2"]
    )
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["ok"] and d["optimizer"]["type"] == variant_type(variant) and d["device"].startswith(DEVICE_TYPE)
    for p in d["params"]:
        assert p["placement"]["param"].startswith(DEVICE_TYPE)
        want = "cpu" if p["offloaded"] else DEVICE_TYPE
        for f in ("master_weight", "exp_avg", "exp_avg_sq"):
            if f in p["placement"]:
                assert p["placement"][f].startswith(want), (p["fqn"], f)
        assert p["step_after"] == TRAIN_STEPS + 2


def test_offloaded_parameters_match_the_uninterrupted_cpu_run_bitwise(fixture_root: Path) -> None:
    root = cached_build(fixture_root, "replay_cpu_offload_adamw", builder("cpu_offload_adamw"))
    got: dict[str, dict[str, torch.Tensor]] = {}
    result = replay_step(
        root / "ckpt",
        ReplayOptions(device=DEVICE_TYPE, grads=root / "grads.safetensors", chunk_size=300),
        on_param=lambda fqn, t: got.__setitem__(fqn, t),
    )
    assert result.ok, [p.problems for p in result.failed]
    assert result.timing["offload_seconds"] > 0 and result.timing["d2h_bytes"] > 0
    recorded = load_recorded(root, 1)
    offloaded = [p.fqn for p in result.params if p.offloaded]
    assert len(offloaded) == 2
    for fqn in offloaded:
        for what in ("param", "master_weight", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[fqn][what], recorded[fqn][what]), (fqn, what)
