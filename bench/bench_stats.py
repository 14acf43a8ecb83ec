"""Benchmark: ``ckpttool stats`` beside ``cat`` of the same files and ``validate --strict --deep``.

One run prints, on a checkpoint with FP32 optimizer state written by a real 4-rank gloo
``dcp.save`` (``bench/_ckpts.py`` ``dense_rank``: BF16 parameters, FP32 ``master_weight``,
``exp_avg``, ``exp_avg_sq``), warm page cache:

- ``cat`` of the data files to ``/dev/null`` (a fresh process): the baseline;
- ``ckpttool stats CKPT --json`` (a fresh process, start-up included): wall time, GB/s, peak RSS;
- ``ckpttool validate --strict --deep --json`` (a fresh process), for scale.

Target: ``stats`` within 1.5x ``cat``'s time.

Usage: python bench/bench_stats.py [--gb 4] [--workdir /tmp/ckpttool-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _timed(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (MiB, sampled every 10 ms with psutil) of a fresh process."""
    import psutil

    t0 = time.perf_counter()
    proc = psutil.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    dt = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # validate exits 1 on findings (the synthetic moments break Adam's bound)
        raise SystemExit(f"{argv[:4]} exited {proc.returncode}")
    return dt, peak >> 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="total checkpoint size, GB (parameters ~1/7 of it)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from _ckpts import build, dense_rank, layers_for

    # BF16 params (2 B) + FP32 master, exp_avg, exp_avg_sq (12 B): 14 B a parameter
    layers = layers_for(a.gb * 2 / 14, 2)
    ckpt = build(a.workdir / f"stats-bf16-{a.gb:g}gb-fp32-state", dense_rank, layers, "bfloat16", True)
    files = sorted(str(p) for p in ckpt.glob("*.distcp"))
    size = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat", *files], check=True, stdout=subprocess.DEVNULL)  # warm the page cache
    exe = [sys.executable, "-m", "ckpttool"]
    rows = []
    for name, argv in (
        ("cat (baseline)", ["cat", *files]),
        ("ckpttool stats", [*exe, "stats", str(ckpt), "--json"]),
        ("ckpttool validate --strict --deep", [*exe, "validate", "--strict", "--deep", str(ckpt), "--json"]),
    ):
        runs = [_timed(argv) for _ in range(a.repeat)]
        best = min(r[0] for r in runs)
        rows.append((name, best, size / best / 1e9, max(r[1] for r in runs)))
    base = rows[0][1]
    print(f"checkpoint {ckpt} ({size / 1e9:.2f} GB in {len(files)} files), best of {a.repeat}, warm cache")
    print(f"{'':36} {'seconds':>8} {'GB/s':>6} {'x cat':>6} {'peak RSS MiB':>12}")
    for name, s, gbs, rss in rows:
        print(f"{name:36} {s:8.2f} {gbs:6.2f} {s / base:6.2f} {rss:12d}")
    print(json.dumps({"gb": size / 1e9, "rows": [dict(zip(("name", "s", "gbps", "rss_mib"), r)) for r in rows]}))


if __name__ == "__main__":
    main()
