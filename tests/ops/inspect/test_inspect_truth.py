"""`ckpttool inspect` checked against what torch itself saved and reads (the optimizer's own ``state_dict()``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.builders import build_linear_stepped

runner = CliRunner()


def inspect_json(path: Path) -> dict:
    res = runner.invoke(app, ["inspect", "--json", str(path)])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize(
    "name",
    ["SGD", "SGD-momentum", "RMSprop", "Adagrad", "AdamW"],
)
def test_param_group_missing_names_only_what_the_optimizer_has(tmp_path: Path, name: str) -> None:
    """A torch SGD/RMSprop/Adagrad group (no betas, eps: those optimizers have none) was shown by inspect as
    `missing betas, eps` (json `missing`), while `validate` (P001) found nothing missing; `missing` now names only
    hyperparameters the torch optimizer's own param group has and the checkpoint lacks: none here."""
    import torch

    makers = {
        "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
        "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
        "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
        "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
        "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
    }
    ref = build_linear_stepped(tmp_path / "ck", makers[name], steps=2)
    (group,) = inspect_json(tmp_path / "ck")["optimizer"]["param_groups"]
    (ref_group,) = ref["param_groups"]
    assert group["missing"] == []
    for h in ("lr", "weight_decay", "eps"):
        assert group[h] == ref_group.get(h)
    assert group["betas"] == (list(ref_group["betas"]) if "betas" in ref_group else None)
    human = runner.invoke(app, ["inspect", str(tmp_path / "ck")], env={"COLUMNS": "200"})
    assert human.exit_code == 0
    header = next(line for line in human.stdout.splitlines() if " group " in line and " lr " in line)
    assert "missing" not in header


def test_plain_sgd_that_stepped_is_not_shown_never_stepped(tmp_path: Path) -> None:
    """torch's SGD with momentum 0 keeps no per-parameter state however many steps it takes (its own
    ``state_dict()['state']`` is empty after 3 steps): inspect showed its group `no state (never stepped)` and listed
    every parameter in `never_stepped_with_hyperparameters`; now `keeps_no_state`, `none kept (SGD, momentum 0)`,
    and no parameter is claimed never stepped (a never-stepped leaf: test_inspect's multi_optim tests)."""
    import torch

    ref = build_linear_stepped(tmp_path / "plain", lambda p: torch.optim.SGD(p, lr=0.1), steps=3)
    assert ref["state"] == {}  # torch: stepped 3 times, no state
    opt = inspect_json(tmp_path / "plain")["optimizer"]
    (group,) = opt["param_groups"]
    assert group["has_state"] is False and group["keeps_no_state"] is True
    assert opt["params_with_state"] == len(ref["state"]) == 0
    assert opt["params_without_state"] == ["bias", "weight"]
    assert opt["never_stepped_with_hyperparameters"] == []
    human = runner.invoke(app, ["inspect", str(tmp_path / "plain")], env={"COLUMNS": "200"})
    assert human.exit_code == 0
    assert "none kept (SGD, momentum 0)" in human.stdout and "never stepped" not in human.stdout


def test_tensor_hyperparameters_are_counted_as_torch_reads_them(tmp_path: Path) -> None:
    """``AdamW(lr=torch.tensor(...))`` with a scheduler: ``dcp.save`` stores the group's ``lr`` and ``initial_lr`` as
    0-d tensors. inspect's summary left them out (8 tensors, float32 128 B, where torch's metadata has 10 tensors and
    136 B); now every tensor torch's ``read_metadata()`` lists is counted (in ``other``), and the values still shown."""
    import math

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    ref = build_linear_stepped(
        tmp_path / "ck",
        lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3), weight_decay=0.05),
        steps=2,
        make_sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
    )
    md = FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    assert isinstance(tensors["optimizer.param_groups.0.lr"], TensorStorageMetadata)  # torch stored it as a tensor
    by_dtype: dict[str, int] = {}
    for v in tensors.values():
        name = str(v.properties.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + math.prod(v.size) * v.properties.dtype.itemsize
    doc = inspect_json(tmp_path / "ck")
    s = doc["summary"]
    assert s["tensor_count"] == len(tensors) == 10
    assert s["byte_item_count"] == sum(isinstance(v, BytesStorageMetadata) for v in md.values())
    assert s["bytes_by_dtype"] == by_dtype
    assert sum(s["bytes_by_category"].values()) == sum(by_dtype.values())
    assert s["bytes_by_category"]["other"] == 8  # lr, initial_lr: 0-d float32
    (group,) = doc["optimizer"]["param_groups"]
    (ref_group,) = ref["param_groups"]
    assert group["lr"] == pytest.approx(ref_group["lr"].item()) and group["initial_lr"] == pytest.approx(1e-3)
    assert doc["other_tensors"] == [] and doc["uncategorized_tensors"] == []


def test_other_keys_and_tensors_are_what_the_docs_say(tmp_path: Path) -> None:
    """docs/inspect.md said `other_keys` / `other_tensors` are keys and tensors 'outside the schema', but they hold
    the training-state items' keys and tensors too (a scheduler's, a train state's 0-d step), which the key schema
    lists as understood and `uncategorized_tensors` leaves out; the rows now say what the JSON holds."""
    import re

    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {
                "model": model.state_dict(),
                "lr_scheduler": sched.state_dict(),
                "train_state": {"step": torch.tensor(3)},
                "extra": torch.zeros(2),
            },
            checkpoint_id=str(tmp_path / "ck"),
        )
    doc = inspect_json(tmp_path / "ck")
    training = {k for keys in doc["training_state"].values() for k in keys}
    assert {f"lr_scheduler.{k}" for k in sched.state_dict()} | {"train_state.step"} == training
    assert set(doc["other_keys"]) == training | {"extra"}
    assert {t["key"] for t in doc["other_tensors"]} == {"train_state.step", "extra"}
    assert doc["uncategorized_tensors"] == ["extra"]
    text = (Path(__file__).parents[3] / "docs" / "inspect.md").read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(other_keys|other_tensors\[\])` \|[^|]*\| ([^\n]*)$", text, re.M)}
    assert "training-state" in rows["other_keys"] and "training-state tensors" in rows["other_tensors[]"]


@pytest.mark.parametrize("name", ["AdamW", "Adam", "RAdam", "AdamW-amsgrad", "SGD-momentum", "Adagrad", "SGD"])
def test_implied_type_is_one_the_docs_name(tmp_path: Path, name: str) -> None:
    """docs/inspect.md named the implied types `adamw`, `full_fp32_adamw`, `master_fp32_adamw`; inspect also prints
    `unknown` (torch's SGD momentum, Adagrad, AdamW with amsgrad) and null (no state: SGD with momentum 0). Every
    value inspect gives for these torch optimizers is now one the row names, and torch's Adam/RAdam, which save
    AdamW's fields, are named there as reading `adamw`."""
    import re

    import torch

    makers = {
        "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "Adam": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1),
        "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-3),
        "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True),
        "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
        "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    }
    ref = build_linear_stepped(tmp_path / "ck", makers[name], steps=2)
    opt = inspect_json(tmp_path / "ck")["optimizer"]
    text = (Path(__file__).parents[3] / "docs" / "inspect.md").read_text()
    (row,) = re.findall(r"^\| `optimizer\.implied_type` / `implied_types` \|([^\n]*)$", text, re.M)
    named = set(re.findall(r"`(\w+)`", row))
    if not ref["state"]:
        assert opt["implied_type"] is None and "null" in row
        return
    assert opt["implied_type"] in named and set(opt["implied_types"]) <= named
    fields = {f for st in ref["state"].values() for f in st}
    assert (opt["implied_type"] == "adamw") == (fields == {"step", "exp_avg", "exp_avg_sq"})
    if name in ("Adam", "RAdam"):
        assert name in row


def test_state_keyed_by_sequential_fqns_is_not_read_as_by_index(tmp_path: Path) -> None:
    """An nn.Sequential's optimizer state from ``get_state_dict`` (keys '0.weight', ...) saved beside model keys
    under another prefix (``_orig_mod.``, a compiled model's state_dict) was read as a plain
    ``optimizer.state_dict()`` keyed by index: inspect said 'keyed by index ... re-save with
    get_optimizer_state_dict' and validate K003, though torch's planner_data holds the state's own string keys.
    Now by fqn, and the leading wrapper segment is part of the model prefix (``model._orig_mod.``): the state
    belongs to the model's tensors, no orphan, and validate reports neither K003 nor O003."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-3)
    seq(torch.randn(3, 4)).sum().backward()
    opt.step()
    _, osd = get_state_dict(seq, opt)
    wrapper = torch.nn.Module()
    wrapper._orig_mod = seq
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": wrapper.state_dict(), "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    assert sorted(osd["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]  # torch keyed it by name
    paths = FileSystemReader(str(tmp_path / "ck")).read_metadata().planner_data
    assert paths["optimizer.state.0.weight.exp_avg"] == ("optimizer", "state", "0.weight", "exp_avg")
    doc = inspect_json(tmp_path / "ck")
    assert doc["key_schema"]["optimizer_keying"] == "fqn" and doc["key_schema"]["model_prefix"] == "model._orig_mod."
    assert doc["optimizer"]["orphan_state"] == []
    res = runner.invoke(app, ["validate", "--json", str(tmp_path / "ck")])
    codes = {f["code"] for f in json.loads(res.stdout)["findings"]}
    assert res.exit_code == 0 and not codes & {"O003", "K003"}, res.stdout


@pytest.mark.parametrize("container", [(), ("state",)])
def test_a_plain_optimizer_state_dict_is_still_by_index(tmp_path: Path, container: tuple[str, ...]) -> None:
    """The other side: ``optimizer.state_dict()`` saved as is (state keys the ints 0, 1, ..., '0' in planner_data),
    at the top level or inside an app dict itself named ``state``."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-3)
    seq(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd: dict[str, Any] = {"model": seq.state_dict(), "optimizer": opt.state_dict()}
        for name in container:
            sd = {name: sd}
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    assert inspect_json(tmp_path / "ck")["key_schema"]["optimizer_keying"] == "index"


def test_filter_narrows_the_buffers_as_it_does_the_parameters(tmp_path: Path) -> None:
    """With ``--filter 'model.0.*'`` inspect counted only the selected parameters (params_total 2) but listed every
    buffer of the model in `optimizer.buffers` (the running stats of layer 1 too); buffers now follow the filter:
    the model keys it selects that no torch param group lists."""
    import fnmatch

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    grouped = {p for g in osd["param_groups"] for p in g["params"]}
    for glob in ("model.0.*", "model.*"):
        res = runner.invoke(app, ["inspect", "--json", str(tmp_path / "ck"), "--filter", glob])
        assert res.exit_code == 0, res.stderr
        opt_doc = json.loads(res.stdout)["optimizer"]
        selected = [k for k in msd if fnmatch.fnmatchcase(f"model.{k}", glob)]
        assert opt_doc["params_total"] == len([k for k in selected if k in grouped])
        assert sorted(opt_doc["buffers"]) == sorted(k for k in selected if k not in grouped)
