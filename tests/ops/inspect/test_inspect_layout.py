"""`ckpttool inspect` shows the layout version, the EP geometry and ambiguity; accepts a declaration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

pytestmark = pytest.mark.slow
runner = CliRunner()


def inspect_json(path: Path, *extra: str) -> dict:
    res = runner.invoke(app, ["inspect", "--json", str(path), *extra])
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    return json.loads(res.stdout)


def test_unversioned_legacy_shows_geometry_and_ambiguity(ep_suite: Path) -> None:
    lay = inspect_json(ep_suite / "legacy")["layout"]
    assert lay["version"] is None and lay["layout"] == "unversioned" and lay["source"] == "none"
    assert len(lay["ambiguous"]) == 4 and len(lay["geometry"]) == 4
    row = next(g for g in lay["geometry"] if g["key"].endswith("layers.0.mlp.experts.down_proj"))
    assert row == {
        "key": "model.model.layers.0.mlp.experts.down_proj",
        "shape": [8, 5, 4],
        "ep_dim": 0,
        "fsdp_dim": 0,
        "num_experts": 8,
        "blocks_per_dim": [4, 1, 1],
        "ranks": [0, 1, 2, 3],
        "same_dim": True,
        "problems": [],
    }


def test_declaration_resolves_the_layout(ep_suite: Path) -> None:
    lay = inspect_json(ep_suite / "legacy", "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2")[
        "layout"
    ]
    assert (lay["version"], lay["layout"], lay["source"]) == (1, "legacy", "declared")
    assert lay["parallel"] == {"ep_size": 2, "ep_fsdp_size": 2} and lay["ambiguous"] == []


def test_embedded_record_and_dim1_geometry(ep_suite: Path) -> None:
    lay = inspect_json(ep_suite / "p4f1")["layout"]
    assert (lay["version"], lay["source"], lay["parallel"]["ep_size"]) == (1, "embedded", 4)
    assert all(g["problems"] == [] and g["blocks_per_dim"][0] == 4 for g in lay["geometry"])
    dim1 = inspect_json(ep_suite / "legacy_dim1")["layout"]
    assert dim1["ambiguous"] == [] and {tuple(g["blocks_per_dim"]) for g in dim1["geometry"]} == {(2, 2, 1)}


def test_human_output_names_version_geometry_and_the_fix(ep_suite: Path) -> None:
    res = runner.invoke(app, ["inspect", str(ep_suite / "legacy")])
    assert res.exit_code == 0 and res.stderr == ""
    assert "EP geometry" in res.stdout and "ambiguous   4 EP tensors" in res.stdout
    assert "--source-layout legacy|canonical" in res.stdout
    res = runner.invoke(app, ["inspect", str(ep_suite / "p4f1")])
    assert "layout      version 1 (legacy, embedded)" in res.stdout and "ambiguous" not in res.stdout


def test_contradicting_declaration_is_an_error(ep_suite: Path) -> None:
    res = runner.invoke(
        app,
        ["inspect", str(ep_suite / "p4f1"), "--source-layout", "canonical", "--ep-size", "4", "--ep-fsdp-size", "1"],
    )
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith("error: [E404]")


def test_incomplete_declaration_is_a_usage_error(ep_suite: Path) -> None:
    res = runner.invoke(app, ["inspect", str(ep_suite / "legacy"), "--source-layout", "legacy"])
    assert (
        res.exit_code == 2 and "error: [E100] --source-layout legacy needs --ep-size and --ep-fsdp-size" in res.stderr
    )


def test_dense_checkpoint_has_no_layout_section(dense_ckpt: Path) -> None:
    assert inspect_json(dense_ckpt)["layout"] is None
