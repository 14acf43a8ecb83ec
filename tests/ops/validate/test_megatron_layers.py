"""``validate --deep`` ``D010`` (identical layers) and ``D009`` (identical experts) on Megatron-core ``torch_dist`` checkpoints, whose decoder layers
are stored stacked on dim 0 (``decoder.layers.<module> [L, ...]``, one chunk per layer, fc1's gate and up halves
apart): the layers are the dim-0 slices. The copied run is built by megatron-core's own training and save code
(``tests/fixtures/megatron.py``, ``dense1_copied``: layer 0's parameters copied into layer 1 before the save)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.fixtures.cache import cached_build
from tests.fixtures.damage import rewrite_tensor
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


_EXPERTS = "decoder.layers.mlp.experts.experts.linear_fc{}.weight"


def _moe_copy(tmp_path: Path, fn: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """A copy of the Megatron MoE run (EP 2, experts stored ``[L, E, out, in]``, one chunk per layer and expert) with
    both expert weights rewritten by ``fn``, each chunk a raw record as megatron's writer leaves it."""
    shutil.copytree(DATA / "moe_ep2", tmp_path / "moe")
    for fc in (1, 2):
        rewrite_tensor(tmp_path / "moe" / "iter_0000002", _EXPERTS.format(fc), fn, row_major=True)
    return tmp_path / "moe"


def test_stacked_expert_written_as_a_copy_is_d009(tmp_path: Path) -> None:
    """Before: validate --deep --strict said OK when layer 0's expert 1 held expert 0's bytes (the experts were
    taken to be dim 0, the layers, and fc1's half-expert chunks had no digest); now D009 names the layer and the
    experts, in both weights."""

    def copy_0_to_1(t: torch.Tensor) -> torch.Tensor:
        t[0, 1] = t[0, 0]
        return t

    rc, doc = run(_moe_copy(tmp_path, copy_0_to_1), "--deep", "--strict")
    got = findings(doc, "D009")
    assert rc == 1 and sorted(f["key"] for f in got) == [_EXPERTS.format(1), _EXPERTS.format(2)], doc["findings"]
    for f in got:
        assert f"{f['key']}: layer 0: 2 of 4 expert slices are bitwise copies of another: experts 0, 1" == f["message"]


def test_stacked_layers_of_equal_experts_are_not_expert_copies(tmp_path: Path) -> None:
    """Layer 1's experts holding layer 0's (every expert distinct within its layer) are not D009 (before, the layers
    were compared as experts: "experts 0, 1")."""

    def layer_0_to_1(t: torch.Tensor) -> torch.Tensor:
        t[1] = t[0]
        return t

    _, doc = run(_moe_copy(tmp_path, layer_0_to_1), "--deep", "--strict")
    assert not findings(doc, "D009"), doc["findings"]


def test_trained_megatron_experts_are_not_d009() -> None:
    rc, doc = run(DATA / "moe_ep2", "--deep", "--strict")
    assert rc == 0 and not findings(doc, "D009"), doc["findings"]
