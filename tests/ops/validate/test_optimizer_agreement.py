"""``validate --strict --deep`` and ``replay-step`` agree on the optimizer state of a ``torch.optim.AdamW`` saved with
``dcp.save`` (``tests/ops/replay/test_replay.py``'s builder), damaged as bad merges and edits of the state do it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.ops.replay.test_replay import _adamw_linear_with

runner = CliRunner()


def validate(ck: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", str(ck), "--strict", "--deep", "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)["findings"]


def replay(ck: Path, grads: Path) -> Any:
    return runner.invoke(app, ["replay-step", str(ck), "--device", "cpu", "--grads", str(grads)])


def test_a_parameter_listed_twice_is_p005_as_replay_step_refuses_it_e514(tmp_path: Path) -> None:
    """Param groups listing a parameter twice in one group, or in two groups with equal or different
    hyperparameters: replay-step refused them (E514) while validate --strict --deep said 'OK: 0 errors'. validate now
    reports P005 (error) with replay-step's own message."""

    def twice_in_group(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["params"].append("weight")

    def in_two_equal_groups(osd: dict[str, Any]) -> None:
        osd["param_groups"].append({**osd["param_groups"][0], "params": ["weight"]})

    def in_two_groups(osd: dict[str, Any]) -> None:
        osd["param_groups"].append({**osd["param_groups"][0], "params": ["weight"], "lr": 0.5})

    for mutate in (twice_in_group, in_two_equal_groups, in_two_groups):
        ck, grads, _, _ = _adamw_linear_with(tmp_path / mutate.__name__, mutate)
        code, findings = validate(ck)
        p005 = [f for f in findings if f["code"] == "P005"]
        assert code == 1 and len(p005) == 1 and p005[0]["severity"] == "error", findings
        res = replay(ck, grads)
        assert res.exit_code == 2 and res.stderr.startswith(f"error: [E514] {p005[0]['message']}\n"), (
            res.stderr,
            p005,
        )


def test_an_all_zero_exp_avg_beside_a_non_zero_exp_avg_sq_is_d015_and_a_replay_note(tmp_path: Path) -> None:
    """exp_avg zeroed (exp_avg_sq kept) at step 3 said OK with no note in validate --deep and replay-step, though
    AdamW's exp_avg is zero only where every gradient was (exp_avg_sq would be too). validate now warns D015 (as D008
    warns of both moments zero) and replay-step notes it; with betas (0, 0.999), where exp_avg is the last gradient
    alone, neither does."""

    def zero_exp_avg(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["exp_avg"].zero_()

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "zeroed", zero_exp_avg)
    code, findings = validate(ck)
    assert code == 1 and [(f["code"], f["severity"], f["message"]) for f in findings] == [
        ("D015", "warning", "weight: exp_avg is all zero but exp_avg_sq is not at step 3")
    ], findings
    res = replay(ck, grads)
    assert res.exit_code == 0, res.output
    assert (
        "warning: 1 parameter(s) have an all-zero exp_avg beside a non-zero exp_avg_sq at a saved step of 2 or more"
        in " ".join(res.stdout.split())
    ), res.stdout
    assert "validate --deep` reports D015" in " ".join(res.stdout.split()), res.stdout

    ck, grads, _, _ = _adamw_linear_with(
        tmp_path / "beta1_0", zero_exp_avg, lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.0, 0.999))
    )
    code, findings = validate(ck)
    assert "D015" not in {f["code"] for f in findings}, findings
    res = replay(ck, grads)
    assert "D015" not in res.stdout, res.stdout


def test_gradients_that_overflow_when_squared_are_named_not_the_saved_state(tmp_path: Path) -> None:
    """--grads finite in float32 but ~1e27 (their square overflows float32) failed E700 'exp_avg_sq: 4 element(s)
    beyond tolerance (max abs inf ...)', blaming the saved state. It is now E120 (exit 2) naming the gradient that
    overflows when squared."""
    from safetensors.torch import load_file, save_file

    ck, grads, _, _ = _adamw_linear_with(tmp_path, lambda osd: None)
    g = load_file(str(grads))
    save_file({k: v / v.abs().max() * 1e27 for k, v in g.items()}, str(tmp_path / "big.safetensors"))
    res = replay(ck, tmp_path / "big.safetensors")
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines()[0] == (
        f"error: [E120] --grads {tmp_path / 'big.safetensors'}: gradient weight overflows float32 when squared "
        "(max |g| 1e+27, beyond 1.84e+19): exp_avg_sq of the step would be infinite"
    ), res.stderr
    assert "E700" not in res.output


def test_params_with_none_entries_or_saved_as_a_string_are_refused_naming_the_group(tmp_path: Path) -> None:
    """A group's params list with a None entry was read as a parameter 'None' and ignored (replay-step and validate
    said OK); params saved as a string replayed as 'E514 none of the 0 parameter(s) of the param groups ...'. Both are
    now one line naming the group: E514 from replay-step (exit 2), the same message as validate's S011."""

    def none_entry(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["params"].append(None)

    def as_string(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["params"] = "weight"

    def long_entry(osd: dict[str, Any]) -> None:  # an entry from the checkpoint is shown cut to 40 characters
        osd["param_groups"][0]["params"].append(["w" * 20] * 50)

    for mutate, says in (
        (none_entry, "param group 0: params entry 2 of 3 is None, not a parameter name"),
        (as_string, "param group 0: params is a str ('weight'), not a list of parameter names"),
        (
            long_entry,
            "param group 0: params entry 2 of 3 is " + repr(["w" * 20] * 50)[:37] + "..., not a parameter name",
        ),
    ):
        ck, grads, _, _ = _adamw_linear_with(tmp_path / mutate.__name__, mutate)
        res = replay(ck, grads)
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines()[0] == f"error: [E514] {ck}: {says}", res.stderr
        assert "Traceback" not in res.output
        code, findings = validate(ck)
        assert code == 1 and [(f["code"], f["message"]) for f in findings] == [("S011", f"{ck}: {says}")], findings


def test_a_saved_step_is_judged_by_one_check_in_validate_and_replay_step(tmp_path: Path) -> None:
    """A step of 2^25 (a float32 tensor, or a Python number, which torch.optim.AdamW loads as float32) was refused by
    replay-step (E511: a float32 counter stops at 2^24) while validate --strict --deep said OK. Both now use
    state_checks.step_not_count: validate reports D003 with replay-step's words; a Python-number step of 3 passes
    both, as torch loads it."""
    for name, value in (("tensor", torch.tensor(float(1 << 25))), ("number", 1 << 25), ("three", 3)):

        def mutate(osd: dict[str, Any], v: Any = value) -> None:
            for st in osd["state"].values():
                st["step"] = v

        ck, grads, _, _ = _adamw_linear_with(tmp_path / name, mutate)
        code, findings = validate(ck)
        res = replay(ck, grads)
        if name == "three":
            assert code == 0 and findings == [], findings
            assert res.exit_code == 0, res.output
            continue
        says = (
            "is 3.35544e+07, beyond what a float32 step counter reaches by adding 1.0 (16,777,216: 2^24 + 1 rounds "
            "back to 2^24), so not a count of steps taken"
        )
        assert code == 1 and ("D003", f"optimizer.state.weight.step: step {says}") in {
            (f["code"], f["message"]) for f in findings
        }, findings
        assert res.exit_code == 2 and res.stderr.startswith(f"error: [E511] optimizer state weight.step {says}\n")


def test_a_param_group_value_is_judged_by_one_check_in_validate_and_replay_step(tmp_path: Path) -> None:
    """replay-step checked lr, betas, eps and weight_decay with its own copy of P006's domain checks, in other words,
    and not the switches: amsgrad saved as the string 'no' (torch reads it as True and its resume raises KeyError
    max_exp_avg_sq) passed validate --strict while replay-step said 'saved with amsgrad=True'. Both now take
    hyperparameter_problems' answer: replay-step's E514 line is validate's P006 message."""

    def setter(name: str, value: Any) -> Any:
        return lambda osd: osd["param_groups"][0].__setitem__(name, value)

    for name, value in (("amsgrad", "no"), ("lr", "0.01"), ("betas", (float("nan"), 0.999)), ("foreach", "yes")):
        ck, grads, _, _ = _adamw_linear_with(tmp_path / name, setter(name, value))
        code, findings = validate(ck)
        p006 = [f["message"] for f in findings if f["code"] == "P006"]
        assert code == 1 and len(p006) == 1, findings
        problem = p006[0].removeprefix("param group 0: ")
        res = replay(ck, grads)
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines()[0] == f"error: [E514] param group of weight: {problem}", res.stderr
        assert "Traceback" not in res.output
