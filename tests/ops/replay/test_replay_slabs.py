"""``replay-step``'s slab-by-slab reference: saved values re-read in true expert order, results independent of the slab size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpttool.ops.replay.run as replay_run
from ckpttool.layouts.declaration import LayoutDeclaration
from ckpttool.model.checkpoint import open_checkpoint
from ckpttool.ops.replay import ReplayOptions, replay_step
from ckpttool.ops.replay.slabs import TensorSlabs
from ckpttool.ops.tensors import to_canonical
from tests.fixtures.cache import cached_build
from tests.fixtures.replay import builder, resave


@pytest.fixture(scope="module")
def full_fx(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "replay_full_fp32_adamw", builder("full_fp32_adamw"))


def _torch_tensors(path: Path) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


@pytest.mark.parametrize("variant", ["legacy", "legacy_dim1"])
def test_slab_reads_equal_torch_load_in_true_expert_order(ep_suite: Path, variant: str) -> None:
    """Block-transposed experts (P=2, F=2 on dim 0) and inner-dim FSDP chunks (uneven 3/2), any range."""
    path = ep_suite / variant
    ref = _torch_tensors(path)
    decl = LayoutDeclaration("legacy", 2, 2)
    g = torch.Generator().manual_seed(0)
    with open_checkpoint(path, declaration=decl) as ckpt:
        layout = ckpt.require_layout()
        keys = [k for k in ref if ".experts." in k and ref[k].dim() == 3]
        assert keys
        for key in keys:
            want = to_canonical(layout, key, ref[key]).reshape(-1)
            src = TensorSlabs(ckpt.reader, layout, key, key.split(".master_weight")[0], set())
            for _ in range(20):
                a = int(torch.randint(0, want.numel(), (1,), generator=g))
                b = int(torch.randint(a, want.numel() + 1, (1,), generator=g))
                got = src.read(a, b, torch.empty(b - a, dtype=want.dtype))
                assert torch.equal(got, want[a:b]), (key, a, b)


def _summary(res: Any) -> dict[str, Any]:
    return {
        p.fqn: (
            p.ok,
            p.writeback_unequal,
            p.param_vs_reference_unequal,
            {f: (e.bad, e.max_abs, e.ratio) for f, e in p.fields.items()},
        )
        for p in res.params
    }


def test_results_do_not_depend_on_the_slab_size(full_fx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = replay_step(full_fx / "ckpt", ReplayOptions(device="cpu", steps=2))
    monkeypatch.setattr(replay_run, "REFERENCE_SLAB", 97)
    sliced = replay_step(full_fx / "ckpt", ReplayOptions(device="cpu", steps=2))
    assert whole.ok and sliced.ok
    assert _summary(whole) == _summary(sliced)


def test_corruption_in_a_late_slab_is_found(full_fx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fqn = "model.layers.0.mlp.experts.gate_up_proj"

    def mutate(d: dict[str, Any]) -> None:
        d[f"optimizer.state.{fqn}.exp_avg_sq"].view(-1)[-3] = -1.0  # the last slab's sqrt goes NaN
        d[f"optimizer.state.{fqn}.master_weight"].view(-1)[-1] += 1.0  # the last element out of sync

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    monkeypatch.setattr(replay_run, "REFERENCE_SLAB", 64)
    res = replay_step(bad, ReplayOptions(device="cpu", select="experts.gate_up_proj"))
    (p,) = res.params
    assert not p.ok and p.sync_unequal == 1
    assert any("master_weight out of sync" in x for x in p.problems)
    assert p.fields["exp_avg_sq"].bad >= 1 or p.fields["master_weight"].bad >= 1
