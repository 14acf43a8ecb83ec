"""``validate --deep`` ``D010`` (identical layers) on Megatron-core ``torch_dist`` checkpoints, whose decoder layers
are stored stacked on dim 0 (``decoder.layers.<module> [L, ...]``, one chunk per layer, fc1's gate and up halves
apart): the layers are the dim-0 slices. The copied run is built by megatron-core's own training and save code
(``tests/fixtures/megatron.py``, ``dense1_copied``: layer 0's parameters copied into layer 1 before the save)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.cache import cached_build
from tests.ops.validate.test_content import findings, run

DATA = Path(__file__).parent.parent.parent / "fixtures" / "megatron_data"


@pytest.fixture(scope="module")
def copied() -> Path:
    from tests.fixtures.megatron import build_megatron

    root = Path(os.environ.get("CKPTTOOL_FIXTURE_CACHE", "/tmp/ckpttool-fixtures"))
    return cached_build(root, "megatron-copied", lambda d: build_megatron(d, ("dense1_copied",))) / "dense1_copied"


def test_stacked_layer_written_as_a_copy_is_d010(copied: Path) -> None:
    """Before: validate --deep --strict said OK (the layers have no numeric component in their keys, and fc1's
    half-row chunks had no digest); now D010 names decoder.layers.1 as a copy of decoder.layers.0."""
    rc, doc = run(copied, "--deep", "--strict")
    got = findings(doc, "D010")
    assert rc == 1 and [f["key"] for f in got] == ["decoder.layers.1"], doc["findings"]
    assert "identical to decoder.layers.0.*" in got[0]["message"] and "6 tensors each" in got[0]["message"]


@pytest.mark.parametrize("name", ["dense1", "dense_tp2", "moe_ep2"])
def test_trained_megatron_layers_are_not_d010(name: str) -> None:
    rc, doc = run(DATA / name, "--deep", "--strict")
    assert rc == 0 and not findings(doc, "D010"), doc["findings"]
