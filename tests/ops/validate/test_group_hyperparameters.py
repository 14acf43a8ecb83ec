"""Param-group hyperparameters torch cannot step with: ``torch.optim`` checks ``lr``, ``eps``, ``weight_decay`` and
``betas`` when an optimizer is built, not when ``load_state_dict`` restores them, so a group saved with ``lr`` as a
list, ``weight_decay`` as a string or ``betas`` of one number passed ``validate --strict`` and the resume raised on
its first step. ``P006`` names them; the tensor ``lr``/``betas`` torch accepts, and Adafactor's ``eps`` pair, are
numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _save(path: Path, make: Any, edit: Any = None, *, flatten: bool = False) -> None:
    """Step ``make(params)`` twice on a real model, optionally edit its param groups, ``dcp.save(get_state_dict)``."""
    model = _model()
    opt = make(model.parameters())
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    if edit is not None:
        for g in opt.param_groups:
            edit(g)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)


def _p006(path: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", "--strict", "--json", str(path)])
    doc = json.loads(res.stdout)
    return res.exit_code, [f for f in doc["findings"] if f["code"] == "P006"]


@pytest.mark.parametrize(
    ("hyper", "value", "said"),
    [
        ("lr", [1e-3], "lr is [0.001], not a number"),
        ("weight_decay", "0.01", "weight_decay is '0.01', not a number"),
        ("betas", [0.9], "betas is [0.9], not two numbers"),
        ("lr", -1e-3, "lr is -0.001; the optimizer needs lr >= 0"),
        ("betas", (0.9, 1.0), "betas[1] is 1.0; the optimizer needs 0 <= betas[1] < 1"),
        ("eps", float("nan"), "eps is nan, not a finite number"),
        ("eps", float("inf"), "eps is inf, not a finite number"),
    ],
)
def test_a_group_torch_cannot_step_with_is_p006(tmp_path: Path, hyper: str, value: Any, said: str) -> None:
    _save(tmp_path / "ck", lambda p: torch.optim.AdamW(p, lr=1e-3), lambda g: g.__setitem__(hyper, value))
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and found, found
    assert [f["message"] for f in found] == [f"param group 0: {said}"]


def test_a_flattened_save_gets_one_finding_for_its_per_parameter_groups(tmp_path: Path) -> None:
    edit = lambda g: g.__setitem__("weight_decay", "0.01")  # noqa: E731
    _save(tmp_path / "ck", lambda p: torch.optim.AdamW(p, lr=1e-3), edit, flatten=True)
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and len(found) == 1, found
    assert found[0]["message"].endswith(" and 3 more: weight_decay is '0.01', not a number"), found


def test_torch_fails_the_first_step_after_resuming_such_a_group(tmp_path: Path) -> None:
    """The independent reference: the saved state loads into a fresh AdamW and its first step raises."""
    _save(tmp_path / "ck", lambda p: torch.optim.AdamW(p, lr=1e-3), lambda g: g.__setitem__("lr", [1e-3]))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(TypeError):
        opt.step()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3)), id="tensor-lr"),
        pytest.param(
            lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.999))), id="tensor-betas"
        ),
        pytest.param(lambda p: torch.optim.Adafactor(p, lr=1e-2), id="adafactor-eps-pair"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0), id="sgd-int-decay"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), id="sgd-nesterov"),
        pytest.param(lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True), id="rmsprop"),
        pytest.param(lambda p: torch.optim.Rprop(p, lr=0.01), id="rprop-etas-step-sizes"),
        pytest.param(lambda p: torch.optim.ASGD(p, lr=0.01), id="asgd"),
        pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.01), id="adagrad"),
        pytest.param(lambda p: torch.optim.Adadelta(p), id="adadelta"),
        pytest.param(lambda p: torch.optim.NAdam(p), id="nadam"),
        pytest.param(lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, foreach=True), id="adamw-amsgrad-foreach"),
        pytest.param(
            lambda p: __import__("transformers").optimization.Adafactor(p, lr=None, relative_step=True),
            id="transformers-adafactor-relative-step-lr-none",
        ),
    ],
)
def test_values_torch_steps_with_are_no_finding(tmp_path: Path, make: Any) -> None:
    _save(tmp_path / "ck", make)
    code, found = _p006(tmp_path / "ck")
    assert found == []


def _resume_step(path: Path, make: Any) -> None:
    """torch's own resume: a fresh optimizer, ``dcp.load`` + ``set_state_dict``, one step."""
    model = _model()
    opt = make(model.parameters())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model(torch.randn(5, 4)).sum().backward()
    opt.step()


OPT = torch.optim


@pytest.mark.parametrize(
    ("cls", "kwargs", "hyper", "value", "said"),
    [
        (OPT.SGD, {"momentum": 0.9}, "momentum", "0.9", "momentum is '0.9', not a number"),
        (OPT.SGD, {"momentum": 0.9}, "dampening", "0", "dampening is '0', not a number"),
        (OPT.AdamW, {}, "amsgrad", "no", "amsgrad is 'no', not True, False or None"),
        (OPT.AdamW, {}, "eps", (None, 1e-3), "eps is (None, 0.001), not a number"),
        (OPT.RMSprop, {}, "alpha", "0.99", "alpha is '0.99', not a number"),
        (OPT.RMSprop, {}, "centered", "False", "centered is 'False', not True, False or None"),
        (OPT.Adagrad, {}, "lr_decay", "0", "lr_decay is '0', not a number"),
        (OPT.NAdam, {}, "momentum_decay", [4e-3], "momentum_decay is [0.004], not a number"),
        (OPT.Adadelta, {}, "rho", "0.9", "rho is '0.9', not a number"),
        (OPT.Adafactor, {}, "eps", (None, 1e-3, 1.0), "eps is (None, 0.001, 1.0), not a number or a pair"),
        (OPT.Adafactor, {}, "d", "1.0", "d is '1.0', not a number"),
        (OPT.ASGD, {}, "lambd", "1e-4", "lambd is '1e-4', not a number"),
        (OPT.Rprop, {}, "etas", "0.5,1.2", "etas is '0.5,1.2', not two numbers"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_a_hyperparameter_of_any_optimizer_its_resume_raises_on_is_p006(
    tmp_path: Path, cls: Any, kwargs: dict[str, Any], hyper: str, value: Any, said: str
) -> None:
    """Only lr, eps, weight_decay and betas were checked: SGD's momentum as a string, AdamW's amsgrad as a string
    (torch reads it as True and looks for max_exp_avg_sq), RMSprop's alpha, Adadelta's rho, Adafactor's eps of three
    numbers, Rprop's etas as a string, ... passed validate --strict and torch's first step after the resume raised."""
    make = lambda p: cls(p, lr=1e-2, **kwargs)  # noqa: E731
    _save(tmp_path / "ck", make, lambda g: g.__setitem__(hyper, value))
    with pytest.raises((TypeError, ValueError, KeyError, RuntimeError)):
        _resume_step(tmp_path / "ck", make)
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and [f["message"] for f in found] == [f"param group 0: {said}"], found


@pytest.mark.parametrize(
    ("cls", "kwargs", "hyper", "value", "said"),
    [
        (OPT.SGD, {"momentum": 0.9}, "momentum", -0.5, "momentum is -0.5; the optimizer needs momentum >= 0"),
        (
            OPT.SGD,
            {"momentum": 0.9, "nesterov": True},
            "dampening",
            0.1,
            "nesterov is True with momentum 0.9 and dampening 0.1; the optimizer needs momentum > 0 and dampening 0",
        ),
        (OPT.RMSprop, {"momentum": 0.9}, "alpha", -1.0, "alpha is -1.0; the optimizer needs alpha >= 0"),
        (
            OPT.Adagrad,
            {},
            "initial_accumulator_value",
            -1.0,
            "initial_accumulator_value is -1.0; the optimizer needs initial_accumulator_value >= 0",
        ),
        (OPT.NAdam, {}, "momentum_decay", -1.0, "momentum_decay is -1.0; the optimizer needs momentum_decay >= 0"),
        (OPT.Adadelta, {}, "rho", 2.0, "rho is 2.0; the optimizer needs 0 <= rho <= 1"),
        (OPT.Adafactor, {}, "beta2_decay", 0.5, "beta2_decay is 0.5; the optimizer needs beta2_decay <= 0"),
        (OPT.Adafactor, {}, "d", 0.5, "d is 0.5; the optimizer needs d >= 1"),
        (OPT.Rprop, {}, "etas", (1.5, 1.2), "etas is (1.5, 1.2); the optimizer needs 0 < etas[0] < 1 < etas[1]"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_a_hyperparameter_torchs_constructor_refuses_is_p006(
    tmp_path: Path, cls: Any, kwargs: dict[str, Any], hyper: str, value: Any, said: str
) -> None:
    """A negative momentum, nesterov with dampening, Adadelta's rho of 2, Rprop's etas the wrong way round: torch's
    constructor refuses each (the reference here), load_state_dict does not check and the resume steps with it
    (uphill, or growing); validate --strict said OK."""
    with pytest.raises(ValueError):
        cls(_model().parameters(), lr=1e-2, **{**kwargs, hyper: value})
    make = lambda p: cls(p, lr=1e-2, **kwargs)  # noqa: E731
    _save(tmp_path / "ck", make, lambda g: g.__setitem__(hyper, value))
    _resume_step(tmp_path / "ck", make)  # no word from torch on the resume
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and [f["message"] for f in found] == [f"param group 0: {said}"], found


def test_a_string_maximize_steps_uphill_on_resume_and_is_p006(tmp_path: Path) -> None:
    """maximize saved as the string 'False' is true to torch: the resumed AdamW steps as maximize=True, uphill."""
    make = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    _save(tmp_path / "ck", make, lambda g: g.__setitem__("maximize", "False"))
    _save(tmp_path / "up", make, lambda g: g.__setitem__("maximize", True))
    after = []
    for ck in ("ck", "up"):
        torch.manual_seed(1)
        model = _model()
        opt = make(model.parameters())
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path / ck), no_dist=True)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model(torch.ones(5, 4)).sum().backward()
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*after, strict=True))  # stepped as maximize=True
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and [f["message"] for f in found] == [
        "param group 0: maximize is 'False', not True, False or None"
    ]


def _prodigy(p: Any) -> Any:
    return pytest.importorskip("prodigyopt").Prodigy(p, lr=1.0)


def _came(p: Any) -> Any:
    return pytest.importorskip("came_pytorch").CAME(p, lr=2e-4)


@pytest.mark.parametrize("make", [_prodigy, _came], ids=["prodigy-d-below-1", "came-eps-pair-three-betas"])
def test_another_optimizers_own_hyperparameters_are_no_finding(tmp_path: Path, make: Any) -> None:
    """Prodigy (its D estimate ``d`` starts at 1e-6) and CAME (``eps`` a pair beside three ``betas``), saved by their
    own packages: P006 took their keys for torch's Adafactor ``d`` (>= 1), an AdamW ``eps`` and ``betas`` of two, and
    failed validate --strict with 'the optimizer needs d >= 1' on a healthy run. A value no optimizer steps with (an
    lr saved as a string) is still P006 for them."""
    _save(tmp_path / "ck", make)
    assert _p006(tmp_path / "ck")[1] == []
    _save(tmp_path / "bad", make, lambda g: g.__setitem__("lr", "1.0"))
    code, found = _p006(tmp_path / "bad")
    assert code == 1 and [f["message"] for f in found] == ["param group 0: lr is '1.0', not a number"], found


def test_a_torch_group_an_lr_scheduler_added_keys_to_keeps_torchs_bounds(tmp_path: Path) -> None:
    """OneCycleLR adds initial_lr, max_lr, min_lr, max_momentum and base_momentum to AdamW's group: it is still
    torch's AdamW, whose constructor refuses one beta (and the resume raises)."""

    def make(p: Any) -> Any:
        opt = torch.optim.AdamW(p, lr=1e-3)
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        return opt

    _save(tmp_path / "ck", make, lambda g: g.__setitem__("betas", (0.9,)))
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and [f["message"] for f in found] == ["param group 0: betas is (0.9,), not two numbers"], found
