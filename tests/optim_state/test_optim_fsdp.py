"""2-rank gloo FSDP2: DTensor optimizer state through DCP, cold resume, never-stepped leaf."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.optim_state.test_optim_checkpoint import (
    SCHEDULED_LR,
    Toy,
    assert_bitwise,
    build_multi,
    build_nested,
    free_port,
    load_multi,
    load_nested,
    save_multi,
    save_nested,
    snapshot,
    train_step,
)

pytestmark = pytest.mark.slow

WORLD = 2


def _sharded_toy() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Toy()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return model


def _train(rank: int, wd: Path) -> None:
    from torch.distributed.tensor import DTensor

    model = _sharded_toy()
    opt = build_nested(model)
    for s in range(3):
        train_step(model, opt, s, torch.float32)
    st = opt.state[model.head.weight]
    assert isinstance(st["master_weight"], DTensor) and st["master_weight"].placements == model.head.weight.placements
    assert isinstance(st["exp_avg"], DTensor) and not isinstance(st["step"], DTensor)
    save_nested(model, opt, wd / "nested")
    train_step(model, opt, 3, torch.float32)
    expected = {"nested": snapshot(model, opt)}

    model = _sharded_toy()
    multi, sched = build_multi(model, offload_chunk=5, fused=True)
    for s in range(3):
        train_step(model, multi, s, torch.float32)
        if s < 2:
            sched.step()
    st = multi["dense"].state[model.head.weight]  # a fused FP32 parameter is its own master (its local shard)
    assert st["master_weight"].to_local().data_ptr() == model.head.weight.to_local().data_ptr()
    save_multi(model, multi, wd / "multi")
    assert len(multi["unused"].state) == 0
    train_step(model, multi, 3, torch.float32)
    expected["multi"] = snapshot(model, multi)
    if rank == 0:
        torch.save(expected, wd / "expected.pt")


def _resume(rank: int, wd: Path) -> None:
    expected = torch.load(wd / "expected.pt")
    model = _sharded_toy()
    opt = build_nested(model)
    load_nested(model, opt, wd / "nested")
    train_step(model, opt, 3, torch.float32)
    assert_bitwise(snapshot(model, opt), expected["nested"])

    model = _sharded_toy()
    multi, _ = build_multi(model, offload_chunk=5, fused=True)
    load_multi(model, multi, wd / "multi")
    assert multi["unused"].param_groups[0]["lr"] == SCHEDULED_LR
    assert len(multi["unused"].state) == 0
    train_step(model, multi, 3, torch.float32)
    assert_bitwise(snapshot(model, multi), expected["multi"])
    (wd / f"ok_{rank}").write_text("ok")


def _entry(rank: int, port: int, phase: str, workdir: str) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        (_train if phase == "train" else _resume)(rank, Path(workdir))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(phase: str, workdir: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_entry, args=(free_port(), phase, str(workdir)), nprocs=WORLD, join=True, start_method="spawn")


@pytest.mark.heavy  # CI time: FSDP2 on gloo ranks, three phases; single-process cold resume stays in CI
def test_fsdp2_cold_resume_bitwise_and_empty_leaf_lr(tmp_path):
    _spawn("train", tmp_path)  # train 3 steps, save both flavors, record the uninterrupted 4th step
    _spawn("resume", tmp_path)  # new processes: load, step once, compare bitwise
    assert all((tmp_path / f"ok_{r}").read_text() == "ok" for r in range(WORLD))

    import torch.distributed.checkpoint as dcp

    multi = dcp.FileSystemReader(str(tmp_path / "multi")).read_metadata().state_dict_metadata
    assert not any(k.startswith("optimizer.state.unused.") for k in multi)
    assert "optimizer.param_groups.unused.bias.lr" in multi
    master = multi["optimizer.state.head.weight.master_weight"]  # [5, 24] split 3/2 over two ranks
    assert list(master.size) == [5, 24] and master.properties.dtype == torch.float32
    assert sorted(tuple(c.offsets) for c in master.chunks) == [(0, 0), (3, 0)]
    assert multi["optimizer.state.experts.w_in.exp_avg"].properties.dtype == torch.float32
    nested = dcp.FileSystemReader(str(tmp_path / "nested")).read_metadata().state_dict_metadata
    assert nested["optimizer.state.experts.w_out.exp_avg_sq"].properties.dtype == torch.bfloat16
    assert list(nested["optimizer.state.embed.weight.step"].size) == []
