"""``stamp`` over a hostile sidecar ``layout.json`` that agrees with the declaration but not with the chunks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
LEGACY = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]
GATE_UP = "model.model.layers.0.mlp.experts.gate_up_proj"
EP_KEYS = [f"model.model.layers.{i}.mlp.experts.{n}" for i in (0, 1) for n in ("gate_up_proj", "down_proj")]


def _record(**entry: Any) -> dict[str, Any]:
    spec = {"ep_dim": 0, "fsdp_dim": 0, "num_experts": 8}
    extra = {k: dict(spec) for k in EP_KEYS}
    extra.update(entry)
    return {
        "format": "ckpttool.layout",
        "version": 1,
        "parallel": {"ep_size": 2, "ep_fsdp_size": 2},
        "extra_parallel": extra,
    }


#: Records the chunks contradict: (record, the tensor named, the problem), for stamp and export alike.
CONTRADICTED = [
    (_record(**{GATE_UP: {"ep_dim": 0, "fsdp_dim": 0, "num_experts": 3}}), GATE_UP, "num_experts is 3"),
    (
        _record(**{"model.model.nope.experts.w": {"ep_dim": 0, "fsdp_dim": 0, "num_experts": 8}}),
        "model.model.nope.experts.w",
        "named by the layout but not in the checkpoint",
    ),
]


@pytest.mark.parametrize(
    "record, key, problem",
    [
        *CONTRADICTED,
        (_record(**{GATE_UP: {"ep_dim": 9, "fsdp_dim": 0, "num_experts": 8}}), GATE_UP, "ep_dim 9 is not a dim"),
    ],
)
def test_stamp_does_not_call_a_sidecar_the_chunks_contradict_already_recorded(
    ep_suite: Path, tmp_path: Path, record: dict[str, Any], key: str, problem: str
) -> None:
    # was exit 0 "already recorded in .../layout.json, nothing written" (reshard then refused the record: E404)
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "legacy")
    sidecar = ck / "layout.json"
    sidecar.write_text(json.dumps(record))
    before = sidecar.read_bytes()
    res = runner.invoke(app, ["stamp", str(ck), *LEGACY])
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0].startswith(f"error: [E404] {key}: the chunk geometry contradicts the layout record in {sidecar}")
    assert problem in lines[0]
    assert lines[1] == f"hint: the record is wrong: delete {sidecar} and stamp again with the right declaration"
    assert "Traceback" not in res.stderr
    assert sidecar.read_bytes() == before


@pytest.mark.parametrize(
    "record, key, problem",
    [
        *CONTRADICTED,
        (
            {**_record(), "parallel": {"ep_size": 3, "ep_fsdp_size": 1}},
            GATE_UP,
            "num_experts 8 is not divisible by ep_size 3",
        ),
    ],
)
def test_export_refuses_a_sidecar_the_chunks_contradict(
    ep_suite: Path, tmp_path: Path, record: dict[str, Any], key: str, problem: str
) -> None:
    # was exit 0 for the record naming an absent tensor and for ep_size 3 (export trusted the record;
    # reshard and stamp refused it), and E601 for a wrong num_experts: now E404 like reshard, nothing written
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "legacy")
    (ck / "layout.json").write_text(json.dumps(record))
    out = tmp_path / "out"
    res = runner.invoke(app, ["export", str(ck), str(out)])
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0].startswith(f"error: [E404] {key}: the chunk geometry contradicts the sidecar layout: "), lines
    assert problem in lines[0]
    assert lines[1].startswith("hint: the layout record or declaration does not describe how this checkpoint was saved")
    assert "Traceback" not in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["reshard", "stamp"])
def test_a_sidecar_giving_a_key_twice_is_refused_not_the_last_one_taken(
    ep_suite: Path, tmp_path: Path, command: str
) -> None:
    # `"ep_size": 4, "ep_size": 2`: json keeps the last, so the record read as EP 2 whatever its writer meant
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "legacy")
    text = json.dumps(_record()).replace('"ep_size": 2', '"ep_size": 4, "ep_size": 2')
    (ck / "layout.json").write_text(text)
    argv = {
        "reshard": ["reshard", str(ck), str(tmp_path / "out"), "--to", "canonical", "--with-optimizer"],
        "stamp": ["stamp", str(ck), *LEGACY],
    }[command]
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert lines[0].startswith("error: [E400] ") and f"{ck / 'layout.json'}" in lines[0], lines
    assert "duplicate key 'ep_size'" in lines[0] and len(lines) == 2 and lines[1].startswith("hint: ")
    assert not (tmp_path / "out").exists() and (ck / "layout.json").read_text() == text
