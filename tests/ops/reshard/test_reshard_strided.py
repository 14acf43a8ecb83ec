"""reshard of FSDP2 over EP (``fully_shard`` on a ``(dp_shard_mod_ep, ep)`` mesh, as torchtitan shards its experts).

FSDP2 shards each EP rank's expert block along the expert dim with ``_StridedShard``: the saved global tensor is in
true expert order although the mesh is ``(ep_fsdp, ep)``, and its chunk offsets are those of a block-transposed
legacy save; only the writing ranks differ (rank ``f*P + e`` writes slab ``e*F + f``). The reference is torch's own
``dcp.load`` of the source, in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.ops.export.test_export import torch_load

pytestmark = pytest.mark.slow  # a 4-rank gloo FSDP2 save

runner = CliRunner()
EXPERTS = "model.model.layers.0.mlp.experts."


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(8, 6, 4, generator=gen))
        self.down_proj = torch.nn.Parameter(torch.randn(8, 4, 3, generator=gen))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].mlp = torch.nn.Module()
        self.layers[0].mlp.experts = _Experts()
        self.norm = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))


def _save_fsdp2_over_ep(rank: int, world: int, out: str) -> None:
    """EP 2 x EP-FSDP 2 on 4 ranks: experts ``Shard(0)`` over ``ep``, then ``fully_shard`` over ``dp_shard_mod_ep``
    (FSDP2 writes ``(_StridedShard(0, sf=2), Shard(0))``); one AdamW step, saved with ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    top = torch.nn.Module()
    top.model = _Model()
    experts = top.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name).detach()
        setattr(experts, name, torch.nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)])))
    fully_shard(top, mesh=mesh["dp_shard_mod_ep"])
    opt = torch.optim.AdamW(top.parameters(), lr=1e-2)
    sum(p.full_tensor().square().sum() for p in top.parameters()).backward()
    opt.step()
    msd, osd = get_state_dict(top, opt)
    assert "_StridedShard" in str(msd["model.layers.0.mlp.experts.down_proj"].placements)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)


@pytest.fixture(scope="module")
def strided(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.distributed import run_ranks

    out = tmp_path_factory.mktemp("fsdp2_over_ep") / "step-1"
    run_ranks(4, _save_fsdp2_over_ep, str(out))
    return out


def _decl(layout: str) -> list[str]:
    return ["--source-layout", layout, "--ep-size", "2", "--ep-fsdp-size", "2"]


def test_a_legacy_declaration_of_fsdp2_over_ep_is_refused_not_permuted(strided: Path, tmp_path: Path) -> None:
    """The saving mesh is ``(ep_fsdp, ep)``, the legacy mesh order, so ``--source-layout legacy`` is what its user
    declares: validate said OK and reshard un-permuted experts that were already in true order (exit 0; torch's
    reader of the output gave experts 0, 1, 4, 5, 2, 3, 6, 7). The writing ranks contradict a block-transposed
    save: E404 naming canonical (the hint says to declare it so; stamp's too), nothing written, the source unchanged;
    validate fails (L005)."""
    before = {p.name: p.read_bytes() for p in strided.iterdir()}
    out = tmp_path / "o"
    res = runner.invoke(
        app, ["reshard", str(strided), str(out), "--to", "canonical", "--with-optimizer", *_decl("legacy")]
    )
    assert res.exit_code == 2 and res.stdout == "" and not out.exists(), (res.stdout, res.stderr)
    line = res.stderr.splitlines()[0]
    assert line.startswith(f"error: [E404] {EXPERTS}") and "rank 2 wrote slab 1 of 4" in line, line
    assert "its layout is canonical" in line
    assert res.stderr.splitlines()[1] == (
        "hint: FSDP2 over EP (_StridedShard) saves the experts in true order from its (ep_fsdp, ep) mesh: declare it "
        "--source-layout canonical with the same --ep-size and --ep-fsdp-size"
    )
    res = runner.invoke(app, ["stamp", str(strided), *_decl("legacy")])  # refused before anything is written
    assert res.exit_code == 2 and "rank 2 wrote slab 1 of 4" in res.stderr and "--source-layout canonical" in res.stderr
    res = runner.invoke(app, ["validate", str(strided), *_decl("legacy")])
    assert res.exit_code == 1 and "L005" in res.stdout and "_StridedShard" in res.stdout, res.stdout
    assert {p.name: p.read_bytes() for p in strided.iterdir()} == before


def test_fsdp2_over_ep_declared_canonical_reshards_to_the_values_torch_reads(strided: Path, tmp_path: Path) -> None:
    """Declared canonical (the bytes are in true order): to EP 4 x 1, and to legacy 2 x 2 and back, every tensor
    (parameters, exp_avg, exp_avg_sq, step) is bitwise what torch's own reader gives of the source."""
    truth = torch_load(strided)
    assert any(k.startswith("optimizer.state.") and ".experts." in k for k in truth)
    to4 = tmp_path / "ep4"
    args = ["--with-optimizer", *_decl("canonical")]
    res = runner.invoke(
        app,
        [
            "reshard",
            str(strided),
            str(to4),
            "--to",
            "canonical",
            "--target-ep-size",
            "4",
            "--target-ep-fsdp-size",
            "1",
            *args,
        ],
    )
    assert res.exit_code == 0, res.stderr
    leg, back = tmp_path / "legacy", tmp_path / "back"
    res = runner.invoke(app, ["reshard", str(strided), str(leg), "--to", "legacy", *args])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["reshard", str(leg), str(back), "--to", "canonical", "--with-optimizer"])
    assert res.exit_code == 0, res.stderr
    key = f"{EXPERTS}down_proj"
    assert not torch.equal(torch_load(leg, [key])[key], truth[key])  # block-transposed in between
    for out in (to4, back):
        got = torch_load(out)
        assert set(got) == set(truth)
        for k, v in truth.items():
            assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (out.name, k)


def _true_experts(n: int) -> torch.Tensor:
    return torch.arange(8 * 3 * (n + 1), dtype=torch.float32).view(8, 3, n + 1)


def _save_hsdp(rank: int, world: int, out: str) -> None:
    """8 ranks, mesh ``(rep 2, ep_fsdp 2, ep 2)``: ``legacy/`` block-transposed (``Shard(0), Shard(0)``: rank
    ``(f, e)`` holds true slab ``e*F + f`` at position ``f*P + e``), ``strided/`` FSDP2's ``_StridedShard(0, sf=2),
    Shard(0)`` (true order); dcp.save's deduplication takes each tensor's slabs from either replica."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "ep_fsdp", "ep"))
    f, e = divmod(rank % 4, 2)
    for name, inner in (("legacy", Shard(0)), ("strided", _StridedShard(0, split_factor=2))):
        sd = {}
        for n in range(4):
            t = _true_experts(n)
            local = t.narrow(0, (e * 2 + f) * 2, 2).clone()
            placements = [Replicate(), inner, Shard(0)]
            sd[f"model.layers.{n}.mlp.experts.down_proj"] = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        dcp.save({"model": sd}, checkpoint_id=str(Path(out) / name))


def test_replicated_legacy_saves_are_told_from_strided_ones_by_the_mesh_position(tmp_path: Path) -> None:
    """With replicas the writing ranks of a block-transposed save are not the slab order (dcp.save balances the
    slabs over the replicas, ranks 4..7 for some tensors): the ranks modulo ``P*F`` are. The legacy save declared
    legacy reshards to the true experts torch's reader gives; the strided one declared legacy is E404."""
    from tests.fixtures.distributed import run_ranks

    run_ranks(8, _save_hsdp, str(tmp_path / "hsdp"))
    legacy, strided = tmp_path / "hsdp" / "legacy", tmp_path / "hsdp" / "strided"
    keys = [f"model.model.layers.{n}.mlp.experts.down_proj" for n in range(4)]
    assert all(torch.equal(torch_load(strided)[k], _true_experts(n)) for n, k in enumerate(keys))
    out = tmp_path / "o"
    res = runner.invoke(app, ["reshard", str(legacy), str(out), "--to", "canonical", *_decl("legacy")])
    assert res.exit_code == 0, res.stderr
    got = torch_load(out)
    assert all(torch.equal(got[k], _true_experts(n)) for n, k in enumerate(keys))
    res = runner.invoke(app, ["reshard", str(strided), str(tmp_path / "s"), "--to", "canonical", *_decl("legacy")])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E404] model.model.layers."), res.stderr
    assert "its layout is canonical" in res.stderr and not (tmp_path / "s").exists()
