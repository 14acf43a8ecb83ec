"""Local shard ranges from mesh and placements, checked against torch's own ``Placement._split_tensor``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckpttool.format.perrank import local_ranges
from ckpttool.format.perrank_pickle import Placement

CASES = [
    ((10,), (Placement("shard", 0),), (3,)),
    ((7, 4), (Placement("shard", 0),), (4,)),
    ((3, 5), (Placement("shard", 1),), (4,)),
    ((10,), (Placement("strided_shard", 0, 2),), (2,)),
    ((12, 3), (Placement("strided_shard", 0, 2), Placement("shard", 0)), (2, 2)),
    ((13, 2), (Placement("strided_shard", 0, 3), Placement("shard", 0)), (2, 3)),
    ((8, 6), (Placement("shard", 0), Placement("shard", 1)), (2, 3)),
    ((8, 6), (Placement("replicate"), Placement("shard", 0)), (2, 2)),
    ((2, 3), (Placement("shard", 0),), (4,)),  # more ranks than rows: empty shards
]


def _torch_local(size, placements, mesh, coord):  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    t = torch.arange(int(torch.tensor(size).prod())).reshape(size)
    for p, n, c in zip(placements, mesh, coord):
        if p.kind == "replicate":
            continue
        tp = Shard(p.dim) if p.kind == "shard" else _StridedShard(p.dim, split_factor=p.split_factor)
        t = tp._split_tensor(t, n, with_padding=False)[0][c]
    _ = Replicate
    return t


@pytest.mark.parametrize(("size", "placements", "mesh"), CASES)
def test_ranges_equal_torch_split(size, placements, mesh) -> None:  # type: ignore[no-untyped-def]
    import torch

    full = torch.arange(int(torch.tensor(size).prod())).reshape(size)
    for coord in itertools.product(*(range(n) for n in mesh)):
        want = _torch_local(size, placements, mesh, coord)
        ranges = local_ranges(size, placements, mesh, coord)
        idx = [torch.tensor([g + i for g, k in r for i in range(k)], dtype=torch.long) for r in ranges]
        got = full
        for d, ix in enumerate(idx):
            got = got.index_select(d, ix)
        assert torch.equal(got, want), (coord, ranges)


_LIMITED_INSPECT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a list of 10**9 ranks needs 8 GiB
from ckpttool.cli.app import main
sys.argv = ["ckpttool", "inspect", sys.argv[1]]
main()
"""


@pytest.mark.parametrize("fmt", ["verl", "torch-checkpointing"])
def test_a_declared_world_size_of_1e9_is_never_a_list(tmp_path: Path, fmt: str) -> None:
    """A world size of 10**9 from a rank file's name (verl) or metadata.pkl (torch-checkpointing) with one rank's
    files: E202 naming a few missing ranks. The rank check built list(range(world)) (the OOM killer; E999
    MemoryError under a memory limit)."""
    import pickle
    import subprocess
    import sys

    d = tmp_path / "ckpt"
    d.mkdir()
    if fmt == "verl":
        for role in ("model", "optim", "extra_state"):
            (d / f"{role}_world_size_1000000000_rank_0.pt").write_bytes(b"x")
        want = "model files of ranks [1, 2, 3, 4, 5, 6, 7, 8] ... missing for world size 1000000000"
    else:
        (d / "metadata.pkl").write_bytes(pickle.dumps({"metadata": {}, "world_size": 10**9, "version": "2.0"}))
        (d / "model_0.pt").write_bytes(b"x")
        want = "item 'model' of ranks [1, 2, 3, 4, 5, 6, 7, 8] ... missing for world size 1000000000"
    r = subprocess.run([sys.executable, "-c", _LIMITED_INSPECT, str(d)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "[E202]" in r.stderr and want in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["symlink_out", "fifo", "list"])
def test_verl_fsdp_config_is_read_confined_and_checked(tmp_path: Path, kind: str) -> None:
    """verl's fsdp_config.json is read as every JSON file: a symlink out of the checkpoint was followed and read
    whole (no cap), a FIFO skipped, a JSON list ignored; now E101 / E102 / E280."""
    import os

    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    d = tmp_path / "actor"
    d.mkdir()
    for role in ("model", "optim", "extra_state"):
        (d / f"{role}_world_size_1_rank_0.pt").write_bytes(b"x")
    cfg = d / "fsdp_config.json"
    if kind == "symlink_out":
        (tmp_path / "outside.json").write_text('{"world_size": 1}')
        cfg.symlink_to(tmp_path / "outside.json")
    elif kind == "fifo":
        os.mkfifo(cfg)
    else:
        cfg.write_text("[1]")
    res = CliRunner().invoke(app, ["inspect", str(d)])
    code = {"symlink_out": "[E101]", "fifo": "[E102]", "list": "[E280]"}[kind]
    assert res.exit_code == 2 and code in res.stderr and "fsdp_config.json" in res.stderr, res.stderr
