"""`D014` replicas-differ: replicated state that drifted apart between the rank files of a per-rank save.

The 2-rank saves are torch-checkpointing's own ``CheckpointManager`` saves of an FSDP2 Llama
after two AdamW steps (tests/fixtures/perrank.py), whose optimizer ``step`` of every parameter is
a plain tensor saved by each rank (a replica). The damage is the real bug's: one rank skipped an
optimizer step (a step skipped on one rank only, e.g. a gradient scaler that saw an inf there), so
its ``step`` counters are one behind the other rank's; the file is re-saved with ``torch.save``
as the manager wrote it. The clean saves (``.pt`` and safetensors) stay silent.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

runner = CliRunner()


@pytest.fixture(scope="session")
def tc_root(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed (pip install --no-deps torch-checkpointing==0.1.1)")
    return cached_build(fixture_root, "perrank_torch_checkpointing", perrank.build_torch_checkpointing)


def validate(*args: Any) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def d014(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["code"] == "D014"]


@pytest.mark.parametrize("name", ["w2", "w2st"])
def test_clean_two_rank_saves_are_silent(tc_root: Path, name: str) -> None:
    rc, doc = validate(tc_root / name / "step-2", "--deep", "--strict")
    assert rc == 0 and not d014(doc), doc["findings"]


def _rank_1_skips_a_step(ck: Path) -> dict[str, Any]:
    """Rewrite rank 1's optimizer file with every ``step`` one lower (rank 1 skipped one of the two steps)."""
    import torch

    f = ck / "optimizer_1.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeviceMesh unpickled without a process group
        sd = torch.load(f, weights_only=False)
    for st in sd["state"].values():
        st["step"] = st["step"] - 1
    torch.save(sd, f)
    return sd


def test_rank_that_skipped_a_step(tc_root: Path, tmp_path: Path) -> None:
    ck = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    sd = _rank_1_skips_a_step(ck)
    rc, doc = validate(ck)  # not a --deep rule: the open compares the replicas
    found = d014(doc)
    assert rc == 1 and len(found) == len(sd["state"]), doc["findings"]
    by_key = {x["key"]: x for x in found}
    msg = by_key["optimizer.state.model.embed_tokens.weight.step"]["message"]
    assert "optimizer_1.pt against optimizer_0.pt: 1 of 1 elements differ (max |diff| 1)" in msg
    assert "1 against 2" in msg and found[0]["severity"] == "error"  # rank 1's value against rank 0's
    assert not [x for x in doc["findings"] if x["code"] == "S001"]  # the other rules ran
    res = runner.invoke(app, ["inspect", str(ck)])  # every other reader refuses it
    assert res.exit_code != 0 and "E280" in res.output and "replicated shards differ" in res.output


def test_manifest_verify_refuses_replicas_that_differ(tc_root: Path, tmp_path: Path) -> None:
    """A rank's copy of a replicated value is in no manifest entry (the first rank's is): opened to
    list a deleted data file's entries, the replicas' E280 was kept aside and the verdict 'matches'."""
    ck = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    res = runner.invoke(app, ["manifest", str(ck)])
    assert res.exit_code == 0, res.output
    _rank_1_skips_a_step(ck)
    res = runner.invoke(app, ["manifest", "--verify", str(ck)])
    assert res.exit_code == 2 and "E280" in res.stderr and "replicated shards differ" in res.stderr, res.output
    assert "matches" not in res.stdout
