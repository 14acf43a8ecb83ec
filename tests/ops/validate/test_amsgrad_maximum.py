"""``D016``: amsgrad's ``max_exp_avg_sq`` below ``exp_avg_sq``. torch's Adam/AdamW (``amsgrad=True``) store
``max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)`` after updating ``exp_avg_sq``, so a save of theirs never
holds one below the other. Checkpoints are real runs saved by ``dcp.save`` (one process, and FSDP2 on 2 gloo
ranks); the damaged ones swap the two fields of one parameter before ``dcp.save`` writes them. The expected count
and worst element come from torch's own reader (``dcp_to_torch_save``), not from ckpttool."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` steps; the gradient of step 1 is 4x the others (a loss spike), so that ``exp_avg_sq`` decays
    below its running maximum afterwards, as in any run whose gradients shrink."""
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        opt.zero_grad()
        (model(torch.randn(3, 4, generator=g)) * (4.0 if i == 1 else 1.0)).pow(2).sum().backward()
        opt.step()


def _swap(state: dict[str, Any], fqn: str) -> None:
    st = state[fqn]
    st["max_exp_avg_sq"], st["exp_avg_sq"] = st["exp_avg_sq"], st["max_exp_avg_sq"]


def _save(
    out: Path, *, amsgrad: bool = True, swap: str | None = None, foreach: bool = False, zstd: bool = False
) -> None:
    """``zstd``: every chunk compressed by torch's ``ZStandard`` extension (no raw record: the deep pass's torch
    path reads and compares the pair)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=amsgrad, foreach=foreach)
    _train(model, opt, 6, 1)
    msd, osd = get_state_dict(model, opt)
    if swap is not None:
        _swap(osd["state"], swap)
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        if zstd:
            from torch.distributed.checkpoint._extension import ZStandard

            writer = dcp.FileSystemWriter(str(out), _extensions=[ZStandard()])
            dcp.save({"model": msd, "optimizer": osd}, storage_writer=writer)
        else:
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


def _fsdp_rank(rank: int, world: int, root: str) -> None:
    """FSDP2 (``fully_shard`` over 2 ranks, dim-0 shards) stepped by AdamW(amsgrad=True); saved as is to
    ``root/clean`` and with one parameter's two fields swapped (each rank its own shard) to ``root/swapped``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 6))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    _train(model, opt, 6, 1 + rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(Path(root, "clean")))
    _swap(osd["state"], "0.weight")
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(Path(root, "swapped")))


def _validate(ckpt: Path, *env: str) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(
        app, ["validate", str(ckpt), "--strict", "--deep", "--json"], env=dict(e.split("=", 1) for e in env)
    )
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)["findings"]


def _expected(ckpt: Path, fqn: str, tmp: Path) -> str:
    """The finding's message computed from torch's own reading of the checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(tmp / "whole.pt"))
    st = torch.load(tmp / "whole.pt", weights_only=True)["optimizer"]["state"][fqn]
    mx, v = st["max_exp_avg_sq"], st["exp_avg_sq"]
    below = (mx < v) & (mx >= 0)
    d = torch.where(below, v.double() - mx.double(), torch.tensor(-1.0, dtype=torch.float64))
    flat = int(d.reshape(-1).argmax())
    at = list(torch.unravel_index(torch.tensor(flat), mx.shape))
    i = tuple(int(x) for x in at)
    return (
        f"{fqn}: max_exp_avg_sq is below exp_avg_sq at {int(below.sum())} of {mx.numel()} values (worst at "
        f"{list(i)}: max_exp_avg_sq {float(mx[i]):.6g} < exp_avg_sq {float(v[i]):.6g})"
    )


@pytest.mark.parametrize(("foreach", "zstd"), [(False, False), (True, False), (False, True)])
def test_a_real_amsgrad_run_passes_and_its_swapped_fields_are_D016(tmp_path: Path, foreach: bool, zstd: bool) -> None:
    _save(tmp_path / "clean", foreach=foreach, zstd=zstd)
    rc, findings = _validate(tmp_path / "clean")
    assert rc == 0 and findings == [], findings

    _save(tmp_path / "swapped", swap="0.weight", foreach=foreach, zstd=zstd)
    want = _expected(tmp_path / "swapped", "0.weight", tmp_path)
    assert " at 0 of " not in want  # the run made a maximum above exp_avg_sq somewhere: the swap shows
    for native in ("1", "0"):  # the kernels built, and the numpy path alone
        rc, findings = _validate(tmp_path / "swapped", f"CKPTTOOL_NATIVE={native}")
        assert rc == 1 and [(f["code"], f["key"], f["message"]) for f in findings] == [
            ("D016", "optimizer.state.0.weight.max_exp_avg_sq", want)
        ], findings
        assert findings[0]["severity"] == "error" and findings[0]["hint"]


def test_adam_without_amsgrad_is_not_checked(tmp_path: Path) -> None:
    """No ``max_exp_avg_sq``: nothing to compare, and the rule passes (it has no pair to judge)."""
    _save(tmp_path / "plain", amsgrad=False)
    res = runner.invoke(app, ["validate", str(tmp_path / "plain"), "--strict", "--deep", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["findings"] == [], doc["findings"]
    assert {r["code"]: r["status"] for r in doc["rules"]}["D016"] == "passed"


def test_fsdp2_amsgrad_shards_pass_and_a_swap_is_D016_at_its_global_index(tmp_path: Path) -> None:
    """Dim-0 shards of two ranks: the worst element is named by its index in the global tensor."""
    from tests.fixtures.distributed import run_ranks

    run_ranks(2, _fsdp_rank, str(tmp_path))
    rc, findings = _validate(tmp_path / "clean")
    assert rc == 0 and findings == [], findings
    want = _expected(tmp_path / "swapped", "0.weight", tmp_path)
    rc, findings = _validate(tmp_path / "swapped")
    assert rc == 1 and [(f["code"], f["message"]) for f in findings] == [("D016", want)], findings
