"""scripts/simulate_scale.py: the many-node model on numbers small enough to check by hand, and ``--measure``."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool.ops.distributed import assign

ROOT = Path(__file__).resolve().parents[2]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("simulate_scale", ROOT / "scripts" / "simulate_scale.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["simulate_scale"] = mod
    spec.loader.exec_module(mod)
    return mod


SMALL = {
    "total_bytes": 8e9,
    "nodes": 2,
    "ranks_per_node": 2,
    "entries": 8,
    "saved_ranks": 4,  # 32 chunks of 0.25 GB
    "shard_size": 2e9,  # export: 4 files of 2 tensors (1 GB each)
    "range_bytes": float(2**28),  # one request per chunk
    "metadata_bytes": 1e6,
    "node_gbps": 80.0,  # 10 GB/s a node, 5 GB/s a rank
    "latency_s": 0.01,
    "in_flight": 1,
    "store_rps": 1e9,
    "startup_s": 1.0,
    "cast_gbps": 1.0,
    "deep_gbps": 2.0,
    "metadata_rate": 32.0,  # 32 chunk records: 1 s
    "index_rate": 80.0,  # 0.1 s
    "commit_requests": 0,
}


def test_small_run_by_hand() -> None:
    mod = _script()
    s = mod.Setup(**SMALL)
    assert s.ranks == 4 and s.chunks == 32 and s.chunk == pytest.approx(0.25e9)
    deep = mod.simulate(s, "validate --deep")
    assert deep.units == 32 and deep.busy_ranks == 4
    assert deep.max_rank_bytes == pytest.approx(2e9)  # 8 chunks a rank
    assert deep.max_rank_requests == 8
    assert deep.total_requests == 32 + 4  # the chunks, and every rank's GET of .metadata
    assert deep.bound == "cpu" and deep.work_s == pytest.approx(1.0)  # 2 GB at 2 GB/s (network: 0.4 s)
    assert deep.open_s == pytest.approx(1e6 / 5e9 + 1.0)
    assert deep.commit_s == pytest.approx(0.1 + 4e-4)
    assert deep.wall_s == pytest.approx(1.0 + deep.open_s + 1.0 + deep.commit_s)
    export = mod.simulate(s, "export --save-dtype bfloat16")
    assert export.units == 4 and export.max_rank_bytes == pytest.approx(2e9)
    assert export.work_s == pytest.approx(2.0)  # cast at 1 GB/s
    slow_net = mod.simulate(mod.Setup(**{**SMALL, "node_gbps": 8.0}), "validate --deep")
    assert slow_net.bound == "network" and slow_net.work_s == pytest.approx(2e9 / 0.5e9)
    few_files = mod.simulate(mod.Setup(**{**SMALL, "shard_size": 8e9}), "export --save-dtype bfloat16")
    assert few_files.units == 1 and few_files.busy_ranks == 1 and few_files.work_s == pytest.approx(8.0)
    coalesced = mod.simulate(mod.Setup(**{**SMALL, "coalesce": True, "range_bytes": 1e9}), "validate --deep")
    assert coalesced.max_rank_requests == 2 and coalesced.total_requests == 8 + 4


def test_assignment_is_ckpttools() -> None:
    mod = _script()
    rng = random.Random(3)
    sizes = [rng.choice([1, 5, 5, 7, 100]) * 1000 for _ in range(200)]
    for world in (1, 3, 16):
        owner = assign(sizes, world)
        loads = [0.0] * world
        for i, r in enumerate(owner):
            loads[r] += sizes[i]
        assert mod.assign_heap([float(x) for x in sizes], world) == loads


def test_cli_json_and_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = _script()
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.randn(64, 256), "b": torch.randn(64)}}, checkpoint_id=str(ckpt), no_dist=True)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert mod.main([*args, "--measure", str(ckpt), "--measure-repeat", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["measured"]["cast_gbps"] > 0 and doc["measured"]["deep_gbps"] > 0
    assert doc["setup"]["cast_gbps"] == doc["measured"]["cast_gbps"]
    assert [r["operation"] for r in doc["rows"]] == ["export --save-dtype bfloat16", "validate --deep"]
    assert mod.main(args) == 0
    text = capsys.readouterr().out
    assert "| validate --deep | 32 | 4 |" in text
