"""Benchmark: `ckpttool reshard` of a ~2 GiB MoE checkpoint vs `cp -r` of the same bytes.

Builds (once, cached under --workdir) a legacy-layout EP checkpoint with real
``dcp.save`` on 4 gloo ranks: mesh (ep_fsdp=2, ep=2), fused experts
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` in BF16 sharded on dim 0 by
both mesh axes, plus FullFP32AdamW-style state (``master_weight``, ``exp_avg``,
``exp_avg_sq`` float32, ``step``) sharded the same way: the case where
``reshard --with-optimizer`` must permute every expert tensor.

Prints, in one run and with a warm page cache (the source is read once first):
  * ``cp -r SRC DST`` wall time and throughput (the baseline);
  * ``ckpttool reshard --to canonical --with-optimizer`` (same mesh sizes: every chunk
    moves to a new position, archives copied verbatim) as a fresh process, and its
    peak RSS (``wait4``);
  * the same with ``--target-ep-size 4 --target-ep-fsdp-size 2`` (every chunk split in
    two: read, reassembled, re-saved with ``torch.save``);
  * the in-process library time of both (without interpreter start-up and ``import torch``);
  * the budget: throughput >= 50% of ``cp -r``; peak RSS < 2 x largest tensor + 512 MiB.

Usage: python bench/bench_reshard.py [--gib 2.0] [--workdir /tmp/ckpttool-bench-reshard]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

E, H, I_SIZE = 64, 512, 256
P, F = 2, 2
WORLD = P * F
BYTES_PER_ELEMENT = 2 + 3 * 4  # bf16 param + f32 master_weight, exp_avg, exp_avg_sq


def _layers_for(gib: float) -> int:
    per_layer = E * (2 * I_SIZE * H + H * I_SIZE) * BYTES_PER_ELEMENT
    return max(1, round(gib * 2**30 / per_layer))


def _save_rank(rank: int, world: int, out: str, layers: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (F, P), mesh_dim_names=("ep_fsdp", "ep"))  # legacy order
    f, e = divmod(rank, P)
    slab = E // (P * F)
    true_slab = e * F + f

    def local(shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> DTensor:
        rows = shape[1] * shape[2]
        base = torch.arange(slab * rows, dtype=torch.float32).reshape(slab, shape[1], shape[2])
        t = ((base % 251) * 1e-3 + true_slab + salt).to(dtype)
        return DTensor.from_local(
            t,
            mesh,
            [Shard(0), Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    model, state, params = {}, {}, []
    for n in range(layers):
        for name, shape in (("gate_up_proj", (E, 2 * I_SIZE, H)), ("down_proj", (E, H, I_SIZE))):
            fqn = f"model.layers.{n}.mlp.experts.{name}"
            params.append(fqn)
            model[fqn] = local(shape, torch.bfloat16, 0)
            state[fqn] = {
                "step": torch.tensor(10.0),
                "master_weight": local(shape, torch.float32, 0),
                "exp_avg": local(shape, torch.float32, 1),
                "exp_avg_sq": local(shape, torch.float32, 2),
            }
    optim = {
        "state": state,
        "param_groups": [{"params": params, "lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}],
    }
    dcp.save({"model": model, "optimizer": optim}, checkpoint_id=out)


def build(path: Path, gib: float) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.fixtures.distributed import run_ranks

    if (path / ".metadata").is_file():
        return path
    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    run_ranks(WORLD, _save_rank, str(tmp), _layers_for(gib))
    os.rename(tmp, path)
    return path


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024, out.decode()


def warm(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench-reshard"))
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest is reported")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = build(args.workdir / f"legacy-{args.gib:g}gib", args.gib)
    size = du(src)
    largest = 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import compileall

    import ckpttool
    from ckpttool.format import CheckpointDir

    # as `pip install` does: start-up is measured with bytecode caches, also under PYTHONDONTWRITEBYTECODE
    compileall.compile_dir(os.path.dirname(ckpttool.__file__), quiet=1)

    largest = max(m.nbytes for m in CheckpointDir(src).metadata.entries.values() if hasattr(m, "nbytes"))
    budget_rss = 2 * largest + 512 * 2**20
    print(
        f"source   {src}: {size / 2**30:.2f} GiB in {len(list(src.glob('*.distcp')))} files, "
        f"largest tensor {largest / 2**20:.0f} MiB, legacy layout ep_size {P} ep_fsdp_size {F}"
    )
    warm(src)
    out = args.workdir / "out"
    rows = []

    shutil.rmtree(out, ignore_errors=True)

    def best(cmd: list[str]) -> tuple[float, int, str]:
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            runs.append(timed(cmd))
        shutil.rmtree(out, ignore_errors=True)
        return min(runs, key=lambda r: r[0])

    wall, rss, _ = best(["cp", "-r", str(src), str(out)])
    cp_tput = size / wall
    rows.append(("cp -r (baseline)", wall, size / wall, rss, ""))
    wall, rss, _ = best(["sh", "-c", f"cp -r {src} {out} && sync"])
    rows.append(("cp -r && sync", wall, size / wall, rss, ""))

    decl = ["--source-layout", "legacy", "--ep-size", str(P), "--ep-fsdp-size", str(F)]
    target = ["--target-ep-size", "4", "--target-ep-fsdp-size", "2"]
    cases = [
        ("reshard --to canonical --no-fsync", ["--no-fsync"]),
        ("reshard --to canonical (fsync)", []),
        ("reshard ... --target 4x2 --no-fsync", [*target, "--no-fsync"]),
        ("reshard ... --target 4x2 (fsync)", target),
    ]
    for label, extra in cases:
        cmd = [
            shutil.which("ckpttool") or "ckpttool",
            "reshard",
            str(src),
            str(out),
            "--to",
            "canonical",
            "--with-optimizer",
            "--json",
            *decl,
            *extra,
        ]
        wall, rss, stdout = best(cmd)
        doc = json.loads(stdout)
        note = f"{doc['chunks_copied']} chunks copied verbatim, {doc['chunks_rewritten']} reassembled; library {doc['seconds']:.2f} s"
        rows.append((label, wall, size / wall, rss, note))
        lib_tput = size / doc["seconds"]
        rows.append(("  in-process (library call)", doc["seconds"], lib_tput, None, ""))

    print(f"{'':40} {'wall s':>8} {'GiB/s':>7} {'vs cp':>6} {'peak RSS':>10}")
    for label, wall, tput, rss, note in rows:
        rss_s = f"{rss / 2**20:.0f} MiB" if rss is not None else "-"
        print(f"{label:40} {wall:8.2f} {tput / 2**30:7.2f} {tput / cp_tput:6.0%} {rss_s:>10}  {note}")
    print(
        f"budget   throughput >= 50% of cp -r; peak RSS < 2 x {largest / 2**20:.0f} MiB + 512 MiB = "
        f"{budget_rss / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
