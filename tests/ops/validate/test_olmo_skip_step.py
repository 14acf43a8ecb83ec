"""OLMo-core's ``SkipStepAdamW`` leaves a step whose loss spikes out of its ``step`` while the trainer's
``global_step`` counts it: a save by OLMo-core's own ``Checkpointer`` after a skipped step resumes correctly
(the bias correction is the optimizer's own), so ``R002`` and ``replay-step`` must not call it another save's
state; torch's AdamW under the same trainer never skips, and a lag there stays an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _olmo_save(root: Path, *, skip_step: bool, global_step: int, moment_dtype: object = None) -> int:
    """Train a small model 5 steps (step 5 a loss spike), save ``root/run/stepN`` with OLMo-core's ``Checkpointer``
    (one process) and return the optimizer's saved ``step`` as OLMo-core counts it."""
    import torch
    import torch.distributed.checkpoint.state_dict as sd

    adamw = pytest.importorskip("olmo_core.optim.adamw")
    checkpoint = pytest.importorskip("olmo_core.train.checkpoint")

    class TrainModule:  # the one method OLMo-core's Checkpointer calls (its TransformerTrainModule's defaults)
        def state_dict_to_save(self, *, optim: bool | None = None) -> dict:
            opts = sd.StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
            return {
                "model": sd.get_model_state_dict(model, options=opts),
                "optim": sd.get_optimizer_state_dict(model, opt, options=opts),
            }

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    if skip_step:
        opt = adamw.SkipStepAdamW(
            model.parameters(), lr=1e-3, weight_decay=0.1, rolling_interval_length=4, dtype=moment_dtype
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for s in range(1, 6 if skip_step else 4):
        opt.zero_grad()
        loss = model(torch.randn(3, 8)).pow(2).mean()
        loss.backward()
        if skip_step:
            opt.latest_loss = loss.detach() * (1e6 if s == 5 else 1)
        opt.step()
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        checkpoint.Checkpointer(work_dir=root / "work", process_group=None).save(
            root / "run" / f"step{global_step}", TrainModule(), {"global_step": global_step}
        )
    return int(next(iter(opt.state.values()))["step"])


def _cli(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.filterwarnings("ignore:std_mean")
def test_skipped_steps_of_skip_step_adamw_are_not_another_saves_state(tmp_path: Path) -> None:
    step = _olmo_save(tmp_path, skip_step=True, global_step=5)
    assert step < 5  # OLMo-core skipped the spike (and any step it judged one): its own count, independently
    report = json.loads(_cli("inspect", str(tmp_path / "run"), "--step", "latest", "--json")[1])
    assert report["key_schema"]["id"] == "olmo-core", report["key_schema"]
    # its groups hold lr, betas, eps, weight_decay alone (no amsgrad): OLMo-core's optimizer, not torch's AdamW
    assert report["optimizer"]["saved_by_counts"] == {"olmo_core.optim.SkipStepAdamW": 6}
    assert "saved by    olmo_core.optim.SkipStepAdamW\n" in _cli("inspect", str(tmp_path / "run"), "--step", "5")[1]

    code, out, err = _cli("validate", str(tmp_path / "run"), "--step", "latest", "--deep", "--strict", "--json")
    report = json.loads(out)
    assert not [f for f in report["findings"] if f["code"] == "R002"], out
    assert code == 0, (out, err)

    code, out, err = _cli("replay-step", str(tmp_path / "run"), "--step", "latest", "--device", "cpu")
    assert code == 0, (out, err)
    assert "OK: 6 of 6 parameters match" in out


def test_torch_adamw_behind_the_trainer_is_still_named(tmp_path: Path) -> None:
    step = _olmo_save(tmp_path, skip_step=False, global_step=5)
    assert step == 3
    report = json.loads(_cli("inspect", str(tmp_path / "run"), "--step", "latest", "--json")[1])
    assert report["optimizer"]["saved_by_counts"] == {"torch.optim.AdamW": 6}  # its groups hold amsgrad

    code, out, _ = _cli("validate", str(tmp_path / "run"), "--step", "latest", "--deep", "--json")
    assert code == 1
    assert any(
        f["code"] == "R002" and "optimizer step 3" in f["message"] and "global_step = 5" in f["message"]
        for f in json.loads(out)["findings"]
    ), out


@pytest.mark.filterwarnings("ignore:std_mean")
def test_moments_in_skip_step_adamws_own_dtype_are_its_configuration(tmp_path: Path) -> None:
    """``SkipStepAdamW(dtype=torch.bfloat16)`` keeps bf16 moments for float32 parameters: validate passes them (no
    O005 'dtype policy'), replay-step refuses them naming the optimizer's moment dtype, in one coded line."""
    import torch

    _olmo_save(tmp_path, skip_step=True, global_step=5, moment_dtype=torch.bfloat16)
    state = json.loads(_cli("inspect", str(tmp_path / "run"), "--step", "latest", "--json")[1])["optimizer"]["fields"]
    assert state["exp_avg"] == state["exp_avg_sq"] == {"bfloat16": 6}  # as OLMo-core saved them

    code, out, err = _cli("validate", str(tmp_path / "run"), "--step", "latest", "--deep", "--strict", "--json")
    findings = json.loads(out)["findings"]
    assert not [f for f in findings if f["code"] == "O005"], findings
    assert code == 0, (out, err)

    code, out, err = _cli("replay-step", str(tmp_path / "run"), "--step", "latest", "--device", "cpu")
    assert code == 2
    assert "[E511]" in err and "keeps both moments in bfloat16 for a float32 parameter" in err
    assert "policy violated" not in err and len(err.strip().splitlines()) == 2
