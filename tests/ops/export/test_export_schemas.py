"""`ckpttool export` on checkpoints of the other key schemas: what it says is found through the schema."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.catalog import build_catalog
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def test_masters_note_finds_masters_of_a_top_level_checkpoint(fixture_root: Path, tmp_path: Path) -> None:
    # the FP32-master fixture re-saved the torchtitan way: model tensors at the top level, optimizer
    # state under "optimizer.", a train_state item
    ref = _tensors(cached_build(fixture_root, "export_master", hf_models.build_master))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in ref.items():
        if k.startswith("optimizer.state."):
            fqn, _, fld = k[len("optimizer.state.") :].rpartition(".")
            state.setdefault(fqn, {})[fld] = t
    model = {k[len("model.") :]: t for k, t in ref.items() if k.startswith("model.")}
    sd = {
        **model,
        "optimizer": {"state": state, "param_groups": [{"lr": 1e-2, "params": sorted(state)}]},
        "train_state": {"step": torch.tensor(2)},
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    cat = build_catalog(tmp_path / "ck")
    assert (cat.schema.id, cat.schema.model_prefix) == ("torchtitan", "")
    with_master = [f for f, ps in cat.optimizer_state.items() if "master_weight" in ps.fields and ps.in_model]
    assert len(with_master) > 10

    res = runner.invoke(app, ["export", str(tmp_path / "ck"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note:") and "master_weight" in ln]
    assert len(notes) == 1, res.stderr
    assert f"{len(with_master)} parameter(s) also have an FP32 optimizer master_weight" in notes[0]
    assert "stored bfloat16 values" in notes[0] and "--weights master" in notes[0]
