"""Megatron-LM's ``args`` in ``common.pt`` (``tests/fixtures/megatron.py``, run ``dense1_args``: megatron-core's own
training and ``dist_checkpointing.save`` of the state dict with ``args``, as Megatron-LM's ``generate_state_dict``
builds it in every checkpoint).

Reference: megatron-core's own ``dist_checkpointing.load_common_state_dict`` (with its ``register_safe_globals``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.megatron import megatron_run

pytestmark = pytest.mark.slow  # megatron-core's training and save on a gloo rank


def cli(*args: str) -> tuple[int, str]:
    """``python -m ckpttool ARGS`` in a process of its own: importing megatron.core (as the fixture's check does)
    registers its classes as torch.load's safe globals for the whole process, which a user's ckpttool never has."""
    res = subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True, text=True, timeout=300)
    return res.returncode, res.stdout + res.stderr if res.returncode else res.stdout


@pytest.fixture(scope="module")
def lm_run() -> Path:
    return megatron_run("megatron-args", "dense1_args")


def test_common_pt_with_megatron_lms_args_is_read(lm_run: Path) -> None:
    """Before: every command that reads common.pt stopped with E304 ("classes argparse.Namespace ... pass
    --trust-pickle"), and --trust-pickle did not help: validate, replay-step and inspect refused a clean Megatron-LM
    checkpoint. Now its args are read as inert values and the checkpoint passes."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    step = lm_run / "iter_0000003"
    rc, out = cli("validate", str(lm_run), "--strict", "--deep", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["counts"]["error"] == doc["counts"]["warning"] == 0, doc["findings"]
    rc, out = cli("replay-step", str(lm_run), "--device", "cpu", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["ok"] and len(doc["params"]) == 9 and all(p["step_before"] == 3 for p in doc["params"])
    rc, out = cli("inspect", str(step), "--json")
    assert rc == 0, out
    register_safe_globals()
    common = dist_checkpointing.load_common_state_dict(str(step))
    assert type(common["args"]).__name__ == "Namespace" and common["iteration"] == 3  # what megatron-core reads back
