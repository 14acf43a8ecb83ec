"""Megatron-core's ``DistributedOptimizer`` saved ``fully_reshardable`` (``tests/fixtures/megatron.py``,
``dense_dp2_distopt``: data parallel 2, bf16, built and saved by megatron-core's own code).

Its state is ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``, ``param`` the FP32 main parameter (what the
``Float16Optimizer`` calls ``fp32_param``). References: megatron's own forward of the saved weights (``model.json``)
for the export, torch's AdamW step for ``replay-step``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.megatron import assert_r002, megatron_run

pytestmark = pytest.mark.heavy  # megatron-core's training and save on 2 gloo ranks: about 25 s

runner = CliRunner()


@pytest.fixture(scope="module")
def distopt() -> Path:
    return megatron_run("megatron-distopt", "dense_dp2_distopt")


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def test_main_params_are_master_weights_validate_and_replay(distopt: Path) -> None:
    """Before: validate --strict failed on the clean save (O008: unknown state field 'param' on 9 parameters) and
    replay-step refused it (E510); now ``param`` is the master weight, as ``fp32_param`` is."""
    doc = json.loads(cli("validate", str(distopt), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["error"] == doc["counts"]["warning"] == 0, doc["findings"]
    doc = json.loads(cli("replay-step", str(distopt), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 9 and all(p["step_before"] == 2 for p in doc["params"])


def test_export_of_params_and_masters_gives_megatrons_logits(distopt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.ops.test_megatron_export import _assets

    doc = json.loads((distopt / "model.json").read_text())
    assets = _assets(tmp_path, False, doc)
    ref = torch.tensor(doc["logits"])
    for weights in ("params", "master"):
        out = tmp_path / weights
        cli("export", str(distopt), str(out), "--model-assets", str(assets), "--weights", weights)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor(doc["input_ids"])).logits.float()
        assert torch.allclose(logits, ref, atol=2e-2, rtol=0), (weights, (logits - ref).abs().max())


@pytest.fixture(scope="module")
def distopt_dp() -> Path:
    return megatron_run("megatron-distopt-dp", "dense_dp2_distopt_dp")


def test_dp_reshardable_buckets_are_listed_not_called_corrupt(distopt_dp: Path) -> None:
    """Megatron-LM's default DistributedOptimizer save stores flat bucket buffers whose intra-parameter padding
    megatron saves unwritten (torch.empty). Before: validate --deep failed the clean save with D002 ('the state is
    corrupt') on that padding; now the buffers are K002 (not mapped to parameters) and no value rule reads them."""
    res = runner.invoke(app, ["validate", str(distopt_dp), "--deep", "--json"])
    doc = json.loads(res.stdout)
    codes = sorted({f["code"] for f in doc["findings"]})
    assert res.exit_code == 0 and doc["ok"] and codes == ["K002"], doc["findings"]
    k002 = next(f for f in doc["findings"] if f["code"] == "K002")
    assert "bucket_idx_0.exp_avg_sq" in k002["message"] and "bucket_idx_0.param" in k002["message"]
    res = runner.invoke(app, ["validate", str(distopt_dp), "--deep", "--strict", "--json"])
    assert res.exit_code == 1  # not understood: never OK under --strict


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (5.0, "common.pt: optimizer common_step 5 is ahead of iteration 2"),
        (1.0, None),  # behind the iteration: a step skipped for a loss-scale overflow or a NaN, --no-load-optim
    ],
)
def test_param_group_step_against_the_iteration(
    distopt: Path, tmp_path: Path, step: float, message: str | None
) -> None:
    """The DistributedOptimizer saves its shared step in each param group of common.pt (``state_dict()``:
    ``param_group["step"]``), not as ``state.common_step``: validate --deep passed a step ahead of the iteration.
    Now R002 names it; a step behind the iteration stays legitimate."""
    import shutil

    run = shutil.copytree(distopt, tmp_path / "run")
    path = run / "iter_0000002" / "common.pt"
    common = torch.load(path, weights_only=False)
    for g in common["optimizer"]["optimizer"]["param_groups"]:
        g["step"] = step
    torch.save(common, path)
    assert_r002(run, message)


def _with_group_steps(distopt: Path, tmp_path: Path, steps: list[object]) -> Path:
    """A copy of the run whose common.pt param groups hold ``steps`` (one per group), saved by torch.save as
    megatron-core saves common.pt."""
    import shutil

    run = shutil.copytree(distopt, tmp_path / "run")
    path = run / "iter_0000002" / "common.pt"
    common = torch.load(path, weights_only=False)
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert len(groups) == len(steps) and all(g["step"] == 2.0 for g in groups)  # megatron's own: one shared step
    for g, step in zip(groups, steps):
        g["step"] = step
        if step is ...:  # a group without its step
            del g["step"]
    torch.save(common, path)
    return run


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([float("nan")] * 2, "common.pt: optimizer param group 0 step is nan, not a count of steps taken"),
        ([float("inf")] * 2, "common.pt: optimizer param group 0 step is inf, not a count of steps taken"),
        ([2.5, 2.5], "common.pt: optimizer param group 0 step is 2.5, not a count of steps taken"),
        ([None, None], "common.pt: optimizer param group 0 step is a NoneType, not a number"),
        ([True, True], "common.pt: optimizer param group 0 step is a bool, not a number"),
    ],
)
def test_param_group_step_that_is_no_count(distopt: Path, tmp_path: Path, steps: list[object], message: str) -> None:
    """The DistributedOptimizer's shared step lies in common.pt's param groups, which megatron-core loads into every
    parameter's ``step`` (``torch.tensor(step, dtype=torch.float)``): replay-step refused a NaN, infinite, fractional,
    None or bool step (E511, hint: ``validate --strict --deep``), which passed validate --strict --deep. D003 names
    it."""
    run = _with_group_steps(distopt, tmp_path, steps)
    assert runner.invoke(app, ["replay-step", str(run), "--device", "cpu"]).exit_code == 2
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(run)])
    found = [(f["key"], f["message"]) for f in json.loads(r.stdout)["findings"] if f["code"] == "D003"]
    assert r.exit_code == 1 and found, r.stdout
    assert found[0][0] == "common.pt:optimizer" and found[0][1].startswith(message), found


@pytest.mark.parametrize("steps", [[2.0, 1.0], [1.0, 2.0], [float("nan"), 2.0], [..., 2.0], [2.0, ...]])
def test_param_groups_with_different_steps(distopt: Path, tmp_path: Path, steps: list[object]) -> None:
    """megatron-core's DistributedOptimizer loads one step into every parameter and asserts that its param groups
    hold one (``assert len(steps) == 1``; a group without it is a KeyError there): groups at different steps, none
    ahead of the iteration, or one group without a step, passed validate."""
    run = _with_group_steps(distopt, tmp_path, steps)
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(run)])
    found = [f["message"] for f in json.loads(r.stdout)["findings"] if f["code"] == "R002"]
    assert r.exit_code == 1, r.stdout
    assert any("param groups' step differ" in m for m in found), found
