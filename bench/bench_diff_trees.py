"""Benchmark: ``ckpttool diff`` of two source trees side by side (a baseline and this one), in one run.

The raw-record comparisons (:mod:`ckpttool.ops.diff.run`, one engine plan per tensor pair):
``diff A B`` (A a 4-rank ``Shard(0)`` save, B the same tensors in one chunk each: the row blocks
compared as one byte stream) and ``diff A A-copy`` (the same chunking: record by record); then
both again with ``--as-dtype float32``, which decodes every value (the BF16 values cast, the
engine's ``PairedSlabs`` folding both sides slab by slab into the value comparison). Each
tree runs in a fresh process with ``PYTHONPATH`` set to it, the trees alternating, warm page
cache; wall seconds, CPU seconds (user + sys of the child) and the load average beside each.

Usage: python bench/bench_diff_trees.py --baseline /path/to/baseline/tree [--gb 1] [--repeat 3]
       [--workdir /tmp/ckpttool-bench]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_diff import build_a, build_b, copy_of, nbytes, warm  # noqa: E402


def timed(tree: Path, args: list[str]) -> tuple[float, float]:
    """(wall seconds, user + sys CPU seconds) of ``python -m ckpttool ARGS`` run from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", *args], env=env, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{tree}: ckpttool {' '.join(args)} failed")
    return dt, ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="the source tree to compare with (a checkout)")
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    a = build_a(args.workdir, args.gb)
    b, a2 = build_b(a, args.workdir), copy_of(a, args.workdir)
    trees = {"baseline": args.baseline.resolve(), "this tree": HERE.parent}
    print(f"A {nbytes(a) / 1e9:.2f} GB; {os.cpu_count()} CPUs; best of {args.repeat} (wall, and CPU of that run)")
    print(f"{'case':34s} {'tree':10s} {'wall s':>7s} {'CPU s':>7s}  load")
    for label, other, extra in (
        ("diff A B (row blocks, streams)", b, []),
        ("diff A A-copy (records)", a2, []),
        ("diff A B --as-dtype float32", b, ["--as-dtype", "float32"]),
        ("diff A A-copy --as-dtype float32", a2, ["--as-dtype", "float32"]),
    ):
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            for name, tree in trees.items():
                warm(a, other)
                run = timed(tree, ["diff", str(a), str(other), *extra])
                best[name] = min(best.get(name, run), run)
        for name, (wall, cpu) in best.items():
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"{label:34s} {name:10s} {wall:7.2f} {cpu:7.2f}  {load}", flush=True)


if __name__ == "__main__":
    main()
