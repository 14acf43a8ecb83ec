"""``--trust-pickle`` and Megatron-LM's ``common.pt`` (checked-in run ``tests/fixtures/megatron_data/dense1``,
written by megatron-core's own ``dist_checkpointing.save``).

A ``common.pt`` naming a class outside the stand-ins of Megatron's ``args`` is ``E304``, whose hint says to pass
``--trust-pickle``; passing it did nothing (the common state was always read with ``weights_only=True``), so the
command could not be made to read the checkpoint at all. Now the reader's ``trust_pickle`` reaches it; without it the
file is still refused and nothing of its pickle runs.
"""

from __future__ import annotations

import fractions
import shutil
from pathlib import Path

import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli.app import app

DENSE1 = Path(__file__).parent.parent / "fixtures" / "megatron_data" / "dense1" / "iter_0000003"
runner = CliRunner()


def _with_extra_class(tmp_path: Path) -> Path:
    ck = tmp_path / "iter_0000003"
    shutil.copytree(DENSE1, ck)
    obj = torch.load(ck / "common.pt", weights_only=False)
    obj["extra"] = fractions.Fraction(1, 3)  # a class torch.load(weights_only=True) refuses
    torch.save(obj, ck / "common.pt")
    return ck


def test_common_pt_needing_trust_is_read_with_trust_pickle(tmp_path: Path) -> None:
    ck = _with_extra_class(tmp_path)
    refused = runner.invoke(app, ["validate", str(ck)])
    assert refused.exit_code == 2 and refused.stderr.startswith("error: [E304]"), refused.stderr
    assert "--trust-pickle" in refused.stderr
    trusted = runner.invoke(app, ["validate", str(ck), "--trust-pickle"])
    assert trusted.exit_code == 0, trusted.stderr
    with ckpttool.open_checkpoint(ck, trust_pickle=True) as ckpt:
        common = ckpt.catalog.common_state()
    assert common is not None and common.iteration == torch.load(DENSE1 / "common.pt", weights_only=False)["iteration"]
