"""Benchmark: ``ckpttool stats`` beside ``cat`` of the same files and ``validate --strict --deep``.

One run prints, on a checkpoint with FP32 optimizer state written by a real 4-rank gloo
``dcp.save`` (``bench/_ckpts.py`` ``dense_rank``: BF16 parameters, FP32 ``master_weight``,
``exp_avg``, ``exp_avg_sq``), warm page cache:

- ``cat`` of the data files to ``/dev/null`` (a fresh process): the baseline;
- ``ckpttool stats CKPT --json`` (a fresh process, start-up included): wall time, GB/s, peak RSS;
- ``ckpttool validate --strict --deep --json`` (a fresh process), for scale.

Target: ``stats`` within 1.5x ``cat``'s time. ``--baseline DIR`` (a copy of another revision's
package: ``git archive REV ckpttool | tar -x -C DIR``) runs both ckpttool rows with that package
too, interleaved with this one, for a before/after in the same run. Each row also gives the
child's CPU time (user + sys), the figure to compare on a loaded machine.

Usage: python bench/bench_stats.py [--gb 4] [--workdir /tmp/ckpttool-bench] [--baseline DIR]
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


def _timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (MiB, sampled every 10 ms with psutil) and CPU seconds (user + sys) of a fresh process."""
    import resource

    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # cwd outside the repository: `python -m` puts the cwd first on sys.path, PYTHONPATH must choose the package
    proc = psutil.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd="/")
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):  # validate exits 1 on findings (the synthetic moments break Adam's bound)
        raise SystemExit(f"{argv[:4]} exited {proc.returncode}")
    return dt, peak >> 20, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="total checkpoint size, GB (parameters ~1/7 of it)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another revision's package directory, run beside this one")
    a = ap.parse_args()
    from _ckpts import build, dense_rank, layers_for

    # BF16 params (2 B) + FP32 master, exp_avg, exp_avg_sq (12 B): 14 B a parameter
    layers = layers_for(a.gb * 2 / 14, 2)
    ckpt = build(a.workdir / f"stats-bf16-{a.gb:g}gb-fp32-state", dense_rank, layers, "bfloat16", True)
    files = sorted(str(p) for p in ckpt.glob("*.distcp"))
    size = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat", *files], check=True, stdout=subprocess.DEVNULL)  # warm the page cache
    exe = [sys.executable, "-m", "ckpttool"]
    here = str(Path(__file__).resolve().parents[1])
    packages = [("", here)] + ([(" [baseline]", str(a.baseline.resolve()))] if a.baseline else [])
    cases: list[tuple[str, list[str], dict[str, str] | None]] = [("cat (baseline)", ["cat", *files], None)]
    for cmd in (["stats", str(ckpt), "--json"], ["validate", "--strict", "--deep", str(ckpt), "--json"]):
        for tag, pkg in packages:
            env = dict(os.environ, PYTHONPATH=pkg)
            cases.append(
                (
                    f"ckpttool {' '.join(cmd[:1] + [c for c in cmd[1:] if c.startswith('--')][:2])}{tag}",
                    [*exe, *cmd],
                    env,
                )
            )
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name, _, _ in cases}
    for _ in range(a.repeat):  # interleaved: every case once per round
        for name, argv, env in cases:
            runs[name].append(_timed(argv, env))
    rows = []
    for name, _, _ in cases:
        rs = runs[name]
        best = min(r[0] for r in rs)
        rows.append((name, best, size / best / 1e9, max(r[1] for r in rs), min(r[2] for r in rs)))
    base = rows[0][1]
    print(f"checkpoint {ckpt} ({size / 1e9:.2f} GB in {len(files)} files), best of {a.repeat}, warm cache")
    print(f"{'':48} {'seconds':>8} {'GB/s':>6} {'x cat':>6} {'CPU s':>6} {'peak RSS MiB':>12}")
    for name, s_, gbs, rss, cpu in rows:
        print(f"{name:48} {s_:8.2f} {gbs:6.2f} {s_ / base:6.2f} {cpu:6.2f} {rss:12d}")
    keys = ("name", "s", "gbps", "rss_mib", "cpu_s")
    print(json.dumps({"gb": size / 1e9, "rows": [dict(zip(keys, r)) for r in rows]}))


if __name__ == "__main__":
    main()
