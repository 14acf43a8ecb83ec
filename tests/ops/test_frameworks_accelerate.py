"""A run saved by Accelerate's own ``Accelerator.save_state`` (FSDP2, ``SHARDED_STATE_DICT``, automatic checkpoint
naming; tests/fixtures/writers.py :func:`build_accelerate_save_state`).

``checkpoints/checkpoint_0`` and ``checkpoint_1``: Accelerate numbers its saves (``checkpoint_<save index>``), the
optimizer took 2 and 4 steps. Each holds ``pytorch_model_fsdp_0/`` + ``optimizer_0/`` (DCP) and the training state
Accelerate pickles beside them (``scheduler.bin``, ``random_states_R.pkl``). References: the model's and
optimizer's full ``state_dict()`` after step 4, and transformers' ``from_pretrained`` of the export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

pytestmark = pytest.mark.slow

runner = CliRunner()


def cli(*args: str, code: int = 0) -> Any:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return json.loads(res.stdout) if "--json" in args else res.stdout


def test_export_of_the_latest_save_loads_in_transformers_as_saved(acc_state_root: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.fixtures.writers import hf_llama

    hf_llama().config.save_pretrained(tmp_path / "assets")
    run = acc_state_root / "checkpoints"
    cli("export", str(run), "--step", "latest", str(tmp_path / "hf"), "--model-assets", str(tmp_path / "assets"))
    want = torch.load(acc_state_root / "expected.pt", weights_only=True)["model"]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert sorted(got) == sorted(want) and all(got[k].equal(v) for k, v in want.items())
    doc = cli("replay-step", str(run / "checkpoint_1"), "--device", "cpu", "--json")
    assert doc["ok"] and len(doc["params"]) == 21 and {p["step_before"] for p in doc["params"]} == {4}


def test_stats_takes_no_step_from_accelerates_save_index(acc_state_root: Path) -> None:
    """stats said step 1 for checkpoint_1, Accelerate's second save (``checkpoint_<save index>``, saved after the
    optimizer's step 4): the step is unknown (null) now, as for torchtune's epoch directories."""
    run = acc_state_root / "checkpoints"
    for given, extra in ((run / "checkpoint_1", []), (run, ["--step", "latest"]), (run, ["--step", "0"])):
        doc = cli("stats", "--json", str(given), *extra)
        assert doc["checkpoints"][0]["step"] is None, (given, extra)


def test_training_state_beside_is_named_without_an_optimizer_hint(acc_state_root: Path) -> None:
    """K012 names scheduler.bin and random_states_R.pkl; its hint told to save the optimizer state with dcp.save or
    pass --optimizer-dir, while the optimizer state (optimizer_0/) was read and checked: now it says only what
    checks those files."""
    run = str(acc_state_root / "checkpoints")
    doc = cli("validate", run, "--step", "latest", "--strict", "--deep", "--json", code=1)  # --strict: K012 fails
    codes = {f["code"]: f for f in doc["findings"] if f["severity"] in ("error", "warning")}
    assert set(codes) == {"K012"}, codes
    k012 = codes["K012"]
    for name in ("scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"):
        assert name in k012["message"]
    assert "dcp.save" not in k012["hint"] and "--optimizer-dir" not in k012["hint"], k012["hint"]
    assert "trainer's own loader" in k012["hint"]


def test_latest_is_said_as_accelerates_save_index(acc_state_root: Path) -> None:
    """--step latest said 'step 1 (the highest step)' for checkpoint_1, saved after step 4: now the choice is said
    as Accelerate's save index, as torchtune's dist_epoch_N is said as an epoch."""
    doc = cli("inspect", "--json", str(acc_state_root / "checkpoints"), "--step", "latest")
    assert doc["location"]["model"].endswith("checkpoints/checkpoint_1/pytorch_model_fsdp_0")
    assert doc["location"]["how"].startswith("`step` latest: save 1 (checkpoint_1, the highest save index"), doc


def test_a_loop_of_its_own_naming_checkpoints_by_step_keeps_the_step(dense_ckpt: Path, tmp_path: Path) -> None:
    """``checkpoints/checkpoint_1000`` written by a loop's own ``dcp.save`` (no ``random_states_0.pkl``, which every
    ``save_state`` writes) was read as Accelerate's save index: stats said step null and --step latest 'save 1000
    (... Accelerate numbers its saves ...)'; its name's step is the step."""
    import shutil

    run = tmp_path / "checkpoints"
    for step in (500, 1000):
        shutil.copytree(dense_ckpt, run / f"checkpoint_{step}")
    assert cli("stats", "--json", str(run / "checkpoint_1000"))["checkpoints"][0]["step"] == 1000
    assert cli("stats", "--json", str(run), "--step", "latest")["checkpoints"][0]["step"] == 1000
    doc = cli("inspect", "--json", str(run), "--step", "latest")
    assert doc["location"]["how"].startswith("`step` latest: step 1000 (the highest step)"), doc
