"""``--schema/--model-prefix/--optimizer-prefix`` on ``stats`` and ``diff``: a checkpoint whose key schema is
not detected (a state dict saved under custom top-level names) is measured and compared once named, and
refused with a hint naming those options (not ``--filter`` or pickled byte items) until then."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
KEYS = ["--schema", "torch-native", "--model-prefix", "net.", "--optimizer-prefix", "opt_state."]


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A Linear + AdamW after one step, saved by dcp.save as ``{"net": ..., "opt_state": ...}``."""
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 8)).sum().backward()
    o.step()
    ms, os_ = get_state_dict(m, o)
    root = tmp_path_factory.mktemp("custom") / "ckpt"
    dcp.save({"net": ms, "opt_state": os_}, checkpoint_id=str(root))
    return root, m


def test_stats_measures_a_custom_schema_once_named(custom: tuple[Path, torch.nn.Module]) -> None:
    root, m = custom
    bad = runner.invoke(app, ["stats", str(root)])
    assert bad.exit_code == 2
    assert "key schema is not recognised" in bad.stderr and "--model-prefix" in bad.stderr
    res = runner.invoke(app, ["stats", str(root), "--by", "tensor", "--json", *KEYS])
    assert res.exit_code == 0, res.output
    (c,) = json.loads(res.stdout)["checkpoints"]
    norms = {t["fqn"]: t["l2"] for t in c["tensors"] if t["role"] == "weight"}
    assert norms.keys() == {"weight", "bias"}
    assert norms["weight"] == pytest.approx(m.weight.detach().double().norm().item(), rel=1e-6)


def test_stats_of_a_folder_with_no_tensor_names_no_key_schema(tmp_path: Path) -> None:
    """A safetensors file of headers only holds no tensor: no --schema would find one (the hint named them)."""
    from safetensors.torch import save_file

    (tmp_path / "empty").mkdir()
    save_file({}, str(tmp_path / "empty" / "model.safetensors"))
    res = runner.invoke(app, ["stats", str(tmp_path / "empty")])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith(f"error: [E100] {tmp_path / 'empty'}: no tensor to measure; the checkpoint holds no")
    assert "not recognised" not in res.stderr and "--schema" not in res.stderr
    res = runner.invoke(app, ["export", str(tmp_path / "empty"), str(tmp_path / "out")])  # no "(e.g. )", no "optimizer"
    assert res.exit_code == 2 and res.stderr.splitlines()[0] == (
        f"error: [E601] {tmp_path / 'empty'}: no model tensors to export (the checkpoint holds no keys at all)"
    ), res.stderr


def test_diff_names_the_options_and_compares_once_named(custom: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, m = custom
    bad = runner.invoke(app, ["diff", str(root), str(root)])
    assert bad.exit_code == 2 and "[E611]" in bad.stderr
    assert "key schema of A is not recognised" in bad.stderr and "--schema" in bad.stderr
    res = runner.invoke(app, ["diff", str(root), str(root), "--json", *KEYS])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["equal"] and doc["counts"]["compared"] == 2
    # against its HF export: the prefixes name the DCP side only (the safetensors side has HF names)
    out = tmp_path / "hf"
    exp = runner.invoke(app, ["export", str(root), str(out), "--model-prefix", "net."])
    assert exp.exit_code == 0, exp.output
    assert set(load_file(out / "model.safetensors")) == {"weight", "bias"}
    for a, b in ((root, out), (out, root)):
        res = runner.invoke(app, ["diff", str(a), str(b), "--model-prefix", "net.", "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["counts"]["compared"] == 2
    # the library decides it (a schema override on a safetensors side, file or folder, is not applied there)
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.model.discovery import CheckpointSelection
    from ckpttool.model.schemas.keyschema import SchemaOverride
    from ckpttool.ops.diff import diff_checkpoints

    named = OpenOptions(selection=CheckpointSelection(schema=SchemaOverride.from_options(None, "net.", None)))
    for side in (out, out / "model.safetensors"):
        res_lib = diff_checkpoints(root, side, opening_a=named, opening_b=named)
        assert res_lib.equal and res_lib.to_dict()["counts"]["compared"] == 2
