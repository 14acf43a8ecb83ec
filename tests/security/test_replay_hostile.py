"""``replay-step`` over hostile optimizer state and param groups: one E5xx line naming the parameter, exit 2.

Inputs are the real ``full_fp32_adamw`` replay save (``dcp.save``), rewritten with one damaged value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build
from tests.fixtures.replay import builder, resave

runner = CliRunner()
FQN = "model.layers.0.self_attn.q_proj.weight"
GROUP = "optimizer.param_groups.0."


@pytest.fixture(scope="session")
def full_fx(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "replay_full_fp32_adamw", builder("full_fp32_adamw"))


def _replay(path: Path, *args: str) -> Any:
    return runner.invoke(app, ["replay-step", str(path), "--device", "cpu", "--filter", "*q_proj*", *args])


def _assert_one_error(res: Any, code: str, needle: str) -> None:
    assert res.exit_code == 2, res.stderr
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0].startswith(f"error: [{code}] "), res.stderr
    assert needle in lines[0], res.stderr
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr


@pytest.mark.parametrize("value, shown", [(float("inf"), "inf"), (float("nan"), "nan"), (-5.0, "-5")])
def test_saved_step_that_is_not_a_count_is_named_not_an_internal_error(
    full_fx: Path, tmp_path: Path, value: float, shown: str
) -> None:
    # was E999: int(inf) in the update bound, NaN likewise; a negative step made a complex bias correction
    key = f"optimizer.state.{FQN}.step"
    bad = resave(full_fx / "ckpt", tmp_path / "bad", lambda d: d.__setitem__(key, torch.tensor(value)))
    _assert_one_error(_replay(bad), "E511", f"optimizer state {FQN}.step is {shown}, not a count of steps taken")


@pytest.mark.parametrize(
    "entry, value, needle",
    [
        ("lr", -1.0, "lr is -1.0; the optimizer needs lr >= 0"),
        ("betas", (1.5, 0.9), "betas[0] is 1.5; the optimizer needs 0 <= betas[0] < 1"),
        ("betas", (0.9, 1.0), "betas[1] is 1.0; the optimizer needs 0 <= betas[1] < 1"),
        ("eps", -1e-8, "eps is -1e-08; the optimizer needs eps >= 0"),
        ("weight_decay", -0.1, "weight_decay is -0.1; the optimizer needs weight_decay >= 0"),
    ],
)
def test_hyperparameter_outside_adamw_domain_names_the_param_group(
    full_fx: Path, tmp_path: Path, entry: str, value: Any, needle: str
) -> None:
    # was E100 "invalid learning rate -1.0" (a bad-option code naming no group, key or file)
    bad = resave(full_fx / "ckpt", tmp_path / "bad", lambda d: d.__setitem__(GROUP + entry, value))
    # the first parameter of the group that `--filter` selects (its group holds embed_tokens too, not replayed)
    _assert_one_error(_replay(bad), "E514", "param group of model.layers.0.self_attn.q_proj.weight: " + needle)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_gradient_file_with_non_finite_values_is_e120_not_blamed_on_the_state(
    full_fx: Path, tmp_path: Path, value: float
) -> None:
    # was exit 1, E700 "parameter differs from master_weight.to(bfloat16) in 1 element(s)" (NaN != NaN) with the
    # hint that the saved optimizer state does not reproduce the next step: the checkpoint blamed for the gradients
    from safetensors.torch import load_file, save_file

    grads = load_file(str(full_fx / "grads.safetensors"))
    grads[FQN][3, 5] = value
    save_file(grads, str(tmp_path / "bad.safetensors"))
    res = _replay(full_fx / "ckpt", "--grads", str(tmp_path / "bad.safetensors"))
    _assert_one_error(
        res,
        "E120",
        f"--grads {tmp_path / 'bad.safetensors'}: gradient {FQN} holds 1 of 1024 value(s) that are not finite",
    )


def test_many_unknown_group_switches_are_named_in_one_short_line(full_fx: Path, tmp_path: Path) -> None:
    """A param group tagged with 5,000 switches set True that AdamW has not: E514 listed every one of them in its one
    line (an unbounded message from the checkpoint's own keys); now the first three and how many more."""

    def tag(d: dict[str, Any]) -> None:
        for i in range(5000):
            d[f"{GROUP}use_trick_{i:04d}"] = True

    bad = resave(full_fx / "ckpt", tmp_path / "bad", tag)
    res = _replay(bad)
    _assert_one_error(
        res,
        "E514",
        "was saved with use_trick_0000=True, use_trick_0001=True, use_trick_0002=True (+4,997 more), which "
        "torch.optim.AdamW has not",
    )
    assert len(res.stderr.splitlines()[0]) < 400, len(res.stderr)
