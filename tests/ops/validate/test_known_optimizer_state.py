"""The state of the optimizers users run, built and stepped by torch (and OLMo-core) and saved with
``dcp.save(get_state_dict(...))``: ``validate --strict --deep`` failed every healthy save of SGD, Adagrad, RMSprop,
Adamax, NAdam, Adadelta, Muon, Lion, Adafactor, Rprop and ASGD with O008 "unknown state field", OLMo-core's
SkipStepLion (its lone ``exp_avg``) with O001 "lacks step, exp_avg_sq", and SparseAdam with P001 "missing
weight_decay" (its group has none). Their fields are known
(``ckpttool.optim_state.known``); a field no known optimizer saves, or known fields no one optimizer saves
together, are still O008."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()

#: id -> (factory over the parameters, the fields torch's own state_dict must hold for the first weight)
OPTIMIZERS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], set[str]]] = {
    "SGD-momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"momentum_buffer"}),
    "Adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.1), {"step", "sum"}),
    "RMSprop": (lambda p: torch.optim.RMSprop(p, lr=0.01), {"step", "square_avg"}),
    "RMSprop-centered-momentum": (
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
        {"step", "square_avg", "momentum_buffer", "grad_avg"},
    ),
    "Adam-amsgrad": (
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    ),
    "AdamW-amsgrad": (
        lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
        {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    ),
    "Adamax": (lambda p: torch.optim.Adamax(p, lr=0.01), {"step", "exp_avg", "exp_inf"}),
    "NAdam": (lambda p: torch.optim.NAdam(p, lr=0.01), {"step", "mu_product", "exp_avg", "exp_avg_sq"}),
    "RAdam": (lambda p: torch.optim.RAdam(p, lr=0.01), {"step", "exp_avg", "exp_avg_sq"}),
    "Adadelta": (lambda p: torch.optim.Adadelta(p), {"step", "square_avg", "acc_delta"}),
    "Muon": (lambda p: torch.optim.Muon(p, lr=0.01), {"momentum_buffer"}),
    "Adafactor": (lambda p: torch.optim.Adafactor(p, lr=0.01), {"step", "row_var", "col_var"}),
    "Rprop": (lambda p: torch.optim.Rprop(p, lr=0.01), {"step", "prev", "step_size"}),
    "ASGD": (lambda p: torch.optim.ASGD(p, lr=0.01), {"step", "eta", "mu", "ax"}),
    "Lion": (
        lambda p: pytest.importorskip("olmo_core.optim.lion").Lion(p, lr=1e-3, weight_decay=0.1),
        {"exp_avg", "step_factor"},
    ),
    "SkipStepLion": (  # no step_factor: Lion's lone exp_avg was O001 "lacks step, exp_avg_sq"
        lambda p: pytest.importorskip("olmo_core.optim.lion").SkipStepLion(p, lr=1e-3, weight_decay=0.1),
        {"exp_avg"},
    ),
}


def _save(out: Path, name: str, change: Callable[[dict[str, Any]], None] | None = None) -> None:
    """A two-layer model (Muon steps 2-D parameters only: no biases) stepped twice by the optimizer ``name``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    factory, fields = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
    opt = factory(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    assert set(opt.state_dict()["state"][0]) == fields  # what the optimizer saves, independently of ckpttool
    msd, osd = get_state_dict(model, opt)
    if change is not None:
        change(osd["state"])
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


def _validate(ckpt: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", str(ckpt), "--strict", "--deep", "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)["findings"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_of_a_known_optimizer_passes_strict(tmp_path: Path, name: str) -> None:
    _save(tmp_path / "ck", name)
    rc, findings = _validate(tmp_path / "ck")
    assert [f for f in findings if f["severity"] != "info"] == [] and rc == 0, findings


def test_a_lone_exp_avg_beside_eps_is_adamw_state_that_lost_a_moment(tmp_path: Path) -> None:
    """Lion's state is told by its group (``betas`` without ``eps``): an AdamW save that kept only ``exp_avg``
    is still O001."""

    def lose(state: dict[str, Any]) -> None:
        for s in state.values():
            del s["step"], s["exp_avg_sq"]

    _save(tmp_path / "ck", "RAdam", change=lose)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and {f["code"] for f in findings} == {"O001"}, findings


def test_an_invented_field_is_still_unknown(tmp_path: Path) -> None:
    def add(state: dict[str, Any]) -> None:
        state["0.weight"]["ghost"] = torch.zeros_like(state["0.weight"]["momentum_buffer"])

    _save(tmp_path / "ck", "SGD-momentum", change=add)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and [(f["code"], f["message"]) for f in findings] == [
        ("O008", "1 parameter(s) have unknown state field 'ghost' (e.g. 0.weight)")
    ]


def test_known_fields_no_one_optimizer_saves_together_are_unknown_state(tmp_path: Path) -> None:
    """Adagrad's ``sum`` beside Adamax's ``exp_inf``: each field is some optimizer's, the pair no optimizer's."""

    def add(state: dict[str, Any]) -> None:
        for s in state.values():
            s["exp_inf"] = torch.zeros_like(s["sum"])

    _save(tmp_path / "ck", "Adagrad", change=add)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and [(f["code"], f["message"]) for f in findings] == [
        (
            "O008",
            "2 parameter(s) have state fields exp_inf, step, sum, which no known optimizer saves together "
            "(e.g. 0.weight)",
        )
    ]


@pytest.mark.parametrize(("other", "field"), [("Adamax", "exp_inf"), ("SGD-momentum", "momentum_buffer")])
def test_one_param_group_holding_two_optimizers_state_is_O008(tmp_path: Path, other: str, field: str) -> None:
    """AdamW state for one weight and Adamax's (or SGD's) for the other weight of the same param group (state merged
    from another run's optimizer): each parameter's fields are a known optimizer's, and validate --strict passed,
    but torch's AdamW, resuming, raises KeyError on the other's state at its first step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
    stepper = OPTIMIZERS[other][0]([model[1].weight])
    model(torch.randn(3, 4)).pow(2).mean().backward()
    stepper.step()
    foreign = stepper.state_dict()["state"][0]
    assert field in foreign  # what torch's own optimizer saved

    def merge(state: dict[str, Any]) -> None:
        state["1.weight"] = foreign

    _save(tmp_path / "ck", "AdamW-amsgrad", change=merge)
    rc, findings = _validate(tmp_path / "ck")
    two = [f for f in findings if f["code"] == "O008"]
    assert rc == 1 and len(two) == 1 and two[0]["key"] == "1.weight", findings
    assert "param group 0: 1.weight's state" in two[0]["message"] and "0.weight's" in two[0]["message"], two
    assert "torch.optim.AdamW" in two[0]["message"]

    # torch's own resume of such state raises on the state the other optimizer saved (loading or stepping it)
    resumed = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    model(torch.randn(3, 4)).pow(2).mean().backward()
    resumed.step()
    msd, osd = get_state_dict(model, resumed)
    osd["state"]["1.weight"] = foreign
    with pytest.raises(KeyError):
        set_state_dict(model, resumed, model_state_dict=msd, optim_state_dict=osd)
        resumed.step()


@pytest.mark.parametrize(
    ("name", "field", "message"),
    [
        ("Muon", "momentum_buffer", "shape [4, 8] differs from the parameter's [8, 4]"),
        ("RMSprop-centered-momentum", "grad_avg", "shape [4, 8] differs from the parameter's [8, 4]"),
        ("NAdam", "mu_product", "mu_product has shape [2], expected a 0-d tensor"),
        ("Rprop", "step_size", "shape [4, 8] differs from the parameter's [8, 4]"),
        ("ASGD", "eta", "eta has shape [2], expected a 0-d tensor"),
        ("ASGD", "ax", "shape [4, 8] differs from the parameter's [8, 4]"),
        (
            "Adafactor",
            "row_var",
            "shape [1, 8] differs from [8, 1], the row_var torch saves for a parameter of shape [8, 4]",
        ),
        (
            "Adafactor",
            "col_var",
            "shape [4, 1] differs from [1, 4], the col_var torch saves for a parameter of shape [8, 4]",
        ),
    ],
)
def test_a_known_optimizer_field_of_another_shape_is_O004(tmp_path: Path, name: str, field: str, message: str) -> None:
    """Knowing an optimizer's fields must not pass them unread: a field of another shape than torch gives it
    (``zeros_like(p)``; ``mu_product`` one number) was O008's unknown field, and is now O004."""

    def reshape(state: dict[str, Any]) -> None:
        t = state["0.weight"][field]
        state["0.weight"][field] = t.repeat(2) if t.dim() == 0 else t.t().contiguous()

    _save(tmp_path / "ck", name, change=reshape)
    rc, findings = _validate(tmp_path / "ck")
    key = f"optimizer.state.0.weight.{field}"
    assert rc == 1 and [(f["code"], f["message"]) for f in findings] == [("O004", f"{key}: {message}")], findings


@pytest.mark.parametrize(("momentum", "fails"), [(0.0, False), (0.9, True)])
def test_a_none_momentum_buffer_is_sgds_own_only_without_momentum(tmp_path: Path, momentum: float, fails: bool) -> None:
    """Older torch SGD stored ``state['momentum_buffer'] = None`` for every stepped parameter at momentum 0: its
    own state, not a lost tensor. With momentum the buffer is a tensor, and a ``None`` one is O004."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    osd["state"] = {fqn: {"momentum_buffer": None} for fqn in msd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    rc, findings = _validate(tmp_path / "ck")
    assert (rc, {f["code"] for f in findings}) == ((1, {"O004"}) if fails else (0, set())), findings


def _save_model(
    out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Callable[[], Any], steps: int = 2
) -> dict[str, Any]:
    """``model`` stepped ``steps`` times by ``opt`` on ``batch()``, saved to ``out``; its optimizer state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for _ in range(steps):
        opt.zero_grad()
        model(batch()).float().pow(2).mean().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))
    return osd


def test_adafactor_state_of_a_bias_is_its_one_variance(tmp_path: Path) -> None:
    """torch's Adafactor factors the second moment of a 2-D weight (``row_var`` [rows, 1], ``col_var`` [1, cols])
    and keeps a bias's whole (``variance``): both forms pass, and a ``variance`` of another shape is O004."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 8)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    _save_model(tmp_path / "ck", model, opt, lambda: torch.randn(3, 4))
    assert {k: set(v) for k, v in opt.state_dict()["state"].items()} == {
        0: {"step", "row_var", "col_var"},
        1: {"step", "variance"},
    }
    assert _validate(tmp_path / "ck") == (0, [])

    opt.state[model.bias]["variance"] = torch.zeros(4)  # as saved from another configuration
    _save_model(tmp_path / "bad", model, opt, lambda: torch.randn(3, 4), steps=0)
    rc, findings = _validate(tmp_path / "bad")
    assert rc == 1 and [(f["code"], f["message"]) for f in findings] == [
        ("O004", "optimizer.state.bias.variance: shape [4] differs from the parameter's [8]")
    ], findings


def test_sparse_adam_state_and_group_pass_strict(tmp_path: Path) -> None:
    """torch's SparseAdam saves AdamW's fields (its ``step`` a Python int) in a group of ``lr``, ``betas``,
    ``eps``, ``maximize``: no ``weight_decay`` to miss (P001 failed every healthy save)."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.01)
    _save_model(tmp_path / "ck", model, opt, lambda: torch.randint(0, 10, (3,)))
    assert set(opt.state_dict()["param_groups"][0]) == {"lr", "betas", "eps", "maximize", "params"}
    assert _validate(tmp_path / "ck") == (0, [])


def test_a_factored_adafactor_moment_of_a_one_dimensional_parameter_is_O004(tmp_path: Path) -> None:
    """torch's Adafactor factors only parameters of 2+ dimensions (a bias keeps ``variance``): a bias saved with
    ``row_var``/``col_var`` fits the parameter's shape rule of no field and would not step (``variance`` is None)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 8)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    _save_model(tmp_path / "ck", model, opt, lambda: torch.randn(3, 4))
    s = opt.state[model.bias]
    s["row_var"], s["col_var"] = s.pop("variance").reshape(8), torch.zeros(8)  # as from a lying converter
    _save_model(tmp_path / "bad", model, opt, lambda: torch.randn(3, 4), steps=0)
    rc, findings = _validate(tmp_path / "bad")
    assert rc == 1 and sorted((f["code"], f["message"]) for f in findings) == [
        ("O004", f"optimizer.state.bias.{f}: {f} of shape [8], which torch saves for no parameter of shape [8]")
        for f in ("col_var", "row_var")
    ], findings


@pytest.mark.parametrize(("field", "when"), [("momentum_buffer", "momentum > 0"), ("grad_avg", "centered=True")])
def test_rmsprop_state_lacking_a_field_its_group_needs_is_O001(tmp_path: Path, field: str, when: str) -> None:
    """RMSprop with momentum (or centered) saves momentum_buffer (grad_avg) for every stepped parameter and its step
    reads them as ``state["momentum_buffer"]``. A save that lost one passed validate --strict (the other fields are a
    known RMSprop's); torch's own resume fails on it (the references here): ``dcp.load`` into
    ``get_state_dict``'s keys misses the key, and ``load_state_dict`` of the saved state raises KeyError at the
    first step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def lose(state: dict[str, Any]) -> None:
        del state["1.weight"][field]

    _save(tmp_path / "ck", "RMSprop-centered-momentum", change=lose)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and [(f["code"], f["key"]) for f in findings if f["severity"] != "info"] == [("O001", "1.weight")]
    has = ", ".join(sorted({"step", "square_avg", "momentum_buffer", "grad_avg"} - {field}))
    assert findings[0]["message"] == (
        f"1.weight: optimizer state lacks {field}, which torch.optim.RMSprop reads in a param group with {when} "
        f"(has {has}): a resume fails on it (dcp.load: missing key; load_state_dict: KeyError at the first step)"
    ), findings

    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
    resumed = OPTIMIZERS["RMSprop-centered-momentum"][0](model.parameters())
    msd, osd = get_state_dict(model, resumed)
    with warnings.catch_warnings(), pytest.raises(BaseException, match=f"Missing key .*1.weight.{field}"):
        warnings.simplefilter("ignore")
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    model(torch.randn(3, 4)).pow(2).mean().backward()
    resumed.step()
    saved = resumed.state_dict()
    del saved["state"][1][field]  # the state as this checkpoint holds it, through torch's own load_state_dict
    resumed.load_state_dict(saved)
    with pytest.raises(KeyError, match=field):
        resumed.step()


def test_a_negative_amsgrad_max_exp_avg_sq_is_D002(tmp_path: Path) -> None:
    """``max_exp_avg_sq`` is the running maximum of ``exp_avg_sq`` (a mean of squares): a negative value is no
    state Adam's amsgrad makes. D002 read ``exp_avg_sq`` only, and the save passed ``--strict --deep``."""

    def negate(state: dict[str, Any]) -> None:
        state["0.weight"]["max_exp_avg_sq"] = -state["0.weight"]["max_exp_avg_sq"]

    _save(tmp_path / "ck", "AdamW-amsgrad", change=negate)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and [(f["code"], f["key"]) for f in findings] == [
        ("D002", "optimizer.state.0.weight.max_exp_avg_sq")
    ]
    assert "32 of 32 values are negative" in findings[0]["message"], findings


def test_a_zeroed_amsgrad_max_exp_avg_sq_is_D006(tmp_path: Path) -> None:
    """``max_exp_avg_sq`` all zero beside a non-zero ``exp_avg`` (a resume that made the amsgrad maximum afresh):
    the maximum of ``exp_avg_sq`` is non-zero wherever ``exp_avg`` is. It passed ``--strict --deep``."""

    def zero(state: dict[str, Any]) -> None:
        state["0.weight"]["max_exp_avg_sq"] = torch.zeros_like(state["0.weight"]["max_exp_avg_sq"])

    _save(tmp_path / "ck", "AdamW-amsgrad", change=zero)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and [(f["code"], f["key"]) for f in findings] == [
        ("D006", "optimizer.state.0.weight.max_exp_avg_sq")
    ]
    assert "the whole tensor is 0" in findings[0]["message"], findings


def _fp16_adamw_save(out: Path, change: Callable[[dict[str, Any]], None] | None = None) -> None:
    """The tiny dense LM in FP16 stepped three times by ``torch.optim.AdamW`` (its moments FP16 too)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import DENSE, dense_model, save_quiet

    torch.manual_seed(1)
    model = dense_model(torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        opt.zero_grad()
        model.loss(torch.randint(0, DENSE["vocab"], (2, 8), generator=gen)).backward()
        opt.step()
    state = opt.state_dict()["state"]
    assert any(bool(((s["exp_avg_sq"] == 0) & (s["exp_avg"] != 0)).any()) for s in state.values())  # underflow
    msd, osd = get_state_dict(model, opt)
    if change is not None:
        change(osd["state"])
    save_quiet({"model": msd, "optimizer": osd}, out)


def test_fp16_adamw_moments_whose_exp_avg_sq_underflowed_pass_strict(tmp_path: Path) -> None:
    """FP16 AdamW state: ``(1 - beta2) * g**2`` of a small gradient underflows FP16 (below 2**-25) while
    ``(1 - beta1) * g`` does not, and subnormal second moments are rounded far from their value. torch's own
    save was 20 D006 errors ("values are 0 where exp_avg is not") and 11 D007 warnings."""
    _fp16_adamw_save(tmp_path / "ck")
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 0 and [f for f in findings if f["code"] != "M009"] == [], findings


def test_fp16_adamw_exp_avg_sq_zeroed_is_still_D006(tmp_path: Path) -> None:
    """A zeroed FP16 ``exp_avg_sq`` beside ``exp_avg`` values larger than any an underflowed one leaves."""

    def zero(state: dict[str, Any]) -> None:
        s = state["lm_head.weight"]
        assert float(s["exp_avg"].abs().max()) > 0.0173  # FP16_UNDERFLOW_EXP_AVG
        s["exp_avg_sq"] = torch.zeros_like(s["exp_avg_sq"])

    _fp16_adamw_save(tmp_path / "ck", change=zero)
    rc, findings = _validate(tmp_path / "ck")
    assert rc == 1 and [(f["code"], f["key"]) for f in findings if f["code"] != "M009"] == [
        ("D006", "optimizer.state.lm_head.weight.exp_avg_sq")
    ], findings
