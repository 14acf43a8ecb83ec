"""Benchmark: ``ckpttool stats`` beside ``cat`` of the same files and ``validate --strict --deep``.

One run prints, on a checkpoint with FP32 optimizer state written by a real 4-rank gloo
``dcp.save`` (``bench/_ckpts.py`` ``dense_rank``: BF16 parameters, FP32 ``master_weight``,
``exp_avg``, ``exp_avg_sq``), warm page cache:

- ``cat`` of the data files to ``/dev/null`` (a fresh process): the baseline;
- ``ckpttool stats CKPT --json`` (a fresh process, start-up included): wall time, GB/s, peak RSS;
- ``ckpttool validate --strict --deep --json`` (a fresh process), for scale;
- ``ckpttool stats --help`` (a fresh process): the start-up every command pays (imports, CLI);
- the two scans again with ``CKPTTOOL_SCAN_MMAP=0`` (``[pread]``: slabs read with ``pread`` into the buffers
  instead of read from read-only mappings of the files).

Children run with compiled bytecode, as an installed package has it (``PYTHONPYCACHEPREFIX``: a cache
for the run, warmed by one untimed round of every case).

and, in this process, two measured bounds on the same bytes: ``read + CRC-32`` (the engine's
1 MiB reads and the CRC every reader checks: the floor of any checked read) and ``bare numpy``
(the same, plus the reductions ``stats`` makes of every value, straight numpy calls on each
128 Ki-value slab as float32: bit patterns, zeros, sum, squares and their sum), one thread.

Target: ``stats`` within 1.5x ``cat``'s time. ``--baseline DIR`` (a copy of another revision's
package: ``git archive REV ckpttool | tar -x -C DIR``) runs both ckpttool rows with that package
too, interleaved with this one, for a before/after in the same run. Each row also gives the
child's CPU time (user + sys), the figure to compare on a loaded machine.

``--hf-storage``: the checkpoint is instead FP32 weights (``[4096, 4096]`` each) saved by ``dcp.save``
with torch's ``HuggingFaceStorageWriter`` (safetensors data files, which store no CRC-32: the scan
computes none there). Rounds alternate the order of the cases (ABBA), so no tree always runs first.

``--cold``: every timed run (and each bound) starts with the checkpoint's pages dropped from the page cache
(``os.sync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)`` of each data file; no root needed, other files' pages
stay): the files come from the disk, as for a checkpoint not read since it was written out.

Usage: python bench/bench_stats.py [--gb 4] [--workdir /tmp/ckpttool-bench] [--baseline DIR] [--hf-storage] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _bare(files: list[str], reductions: bool) -> tuple[float, float]:
    """Wall and CPU seconds of a bare loop over ``files``: 1 MiB ``preadv`` + CRC-32, and with
    ``reductions`` the statistics of each 128 Ki-value float32 slab (the floor ``stats`` is held to)."""
    import numpy as np

    from ckpttool.engine.crc import crc32

    raw = np.empty(1 << 20, np.uint8)
    t = np.empty(1 << 17, np.uint32)
    sq = np.empty(1 << 17, np.float32)
    total = 0.0
    c0, w0 = time.process_time(), time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        size, off, crc = os.fstat(fd).st_size, 0, 0
        while off + raw.size <= size:
            os.preadv(fd, [raw], off)
            off += raw.size
            crc = crc32(raw, crc)
            if not reductions:
                continue
            for half in (raw[: 1 << 19], raw[1 << 19 :]):
                x, u = half.view(np.float32), half.view(np.uint32)
                np.left_shift(u, 1, out=t)
                total += int(t.max()) + int(np.count_nonzero(t))
                total += float(np.add.reduce(np.einsum("ij->i", x.reshape(-1, 1024)), dtype=np.float64))
                np.multiply(x, x, out=sq)
                total += float(np.add.reduce(np.einsum("ij->i", sq.reshape(-1, 1024)), dtype=np.float64))
        os.close(fd)
    return time.perf_counter() - w0, time.process_time() - c0


def _drop(files: list[str]) -> None:
    """Drop ``files``' clean pages from the page cache (after ``os.sync``, so none is dirty): the next read is the disk's."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _hf_storage(out: Path, gb: float) -> Path:
    """``out``: FP32 ``[4096, 4096]`` weights, ``gb`` GB in all, saved by ``dcp.save`` through torch's
    ``HuggingFaceStorageWriter`` (one process); built once, then reused."""
    if (out / ".built").exists():
        return out
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    shutil.rmtree(out, ignore_errors=True)
    gen = torch.Generator().manual_seed(0)
    n = max(1, round(gb * 1e9 / (4096 * 4096 * 4)))
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4096, 4096, generator=gen) * 0.02 for i in range(n)}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True), no_dist=True)
    (out / ".built").touch()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="total checkpoint size, GB (parameters ~1/7 of it)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another revision's package directory, run beside this one")
    ap.add_argument("--hf-storage", action="store_true", help="FP32 weights saved with HuggingFaceStorageWriter")
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint's pages from the cache before each run")
    a = ap.parse_args()
    from _ckpts import build, dense_rank, layers_for

    if a.hf_storage:
        ckpt = _hf_storage(a.workdir / f"stats-hf-storage-fp32-{a.gb:g}gb", a.gb)
        files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    else:
        # BF16 params (2 B) + FP32 master, exp_avg, exp_avg_sq (12 B): 14 B a parameter
        layers = layers_for(a.gb * 2 / 14, 2)
        ckpt = build(a.workdir / f"stats-bf16-{a.gb:g}gb-fp32-state", dense_rank, layers, "bfloat16", True)
        files = sorted(str(p) for p in ckpt.glob("*.distcp"))
    size = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat", *files], check=True, stdout=subprocess.DEVNULL)  # warm the page cache
    exe = [sys.executable, "-m", "ckpttool"]
    here = str(Path(__file__).resolve().parents[1])
    packages = [("", here, {})] + ([(" [baseline]", str(a.baseline.resolve()), {})] if a.baseline else [])
    packages.append((" [pread]", here, {"CKPTTOOL_SCAN_MMAP": "0"}))  # this tree without mapped reads
    cases: list[tuple[str, list[str], dict[str, str] | None]] = [("cat (baseline)", ["cat", *files], None)]
    # compiled bytecode as an installed package has it (a bytecode cache per run, warmed by the first round)
    pyc = tempfile.mkdtemp(prefix="ckpttool-bench-pyc-")
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    base_env["PYTHONPYCACHEPREFIX"] = pyc
    commands = (
        ["stats", "--help"],
        ["stats", str(ckpt), "--json"],
        ["validate", "--strict", "--deep", str(ckpt), "--json"],
    )
    for cmd in commands:
        for tag, pkg, extra in packages:
            if tag == " [pread]" and cmd[1] == "--help":
                continue
            env = dict(base_env, PYTHONPATH=pkg, **extra)
            cases.append(
                (
                    f"ckpttool {' '.join(cmd[:1] + [c for c in cmd[1:] if c.startswith('--')][:2])}{tag}",
                    [*exe, *cmd],
                    env,
                )
            )
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name, _, _ in cases}
    for _name, argv, env in cases:  # warm-up: the bytecode cache, the page cache
        _timed(argv, env)
    for r in range(a.repeat):  # interleaved: every case once per round, every other round in reverse
        for name, argv, env in cases if r % 2 == 0 else cases[:1] + cases[:0:-1]:
            if a.cold:
                _drop(files)
            runs[name].append(_timed(argv, env))
    bounds: dict[str, list[tuple[float, float]]] = {"read + CRC-32 (bound)": [], "bare numpy (bound)": []}
    import numpy as np

    with np.errstate(all="ignore"):  # the bytes of BF16 parameters read as float32: NaN and overflow
        for _ in range(a.repeat):
            for name, red in zip(bounds, (False, True)):
                if a.cold:
                    _drop(files)
                bounds[name].append(_bare(files, red))
    shutil.rmtree(pyc, ignore_errors=True)
    rows = []
    for name, _, _ in cases:
        rs = runs[name]
        best = min(r[0] for r in rs)
        rows.append((name, best, size / best / 1e9, max(r[1] for r in rs), min(r[2] for r in rs)))
    for name, rs in bounds.items():
        best = min(r[0] for r in rs)
        rows.append((f"{name}, in process, 1 thread", best, size / best / 1e9, 0, min(r[1] for r in rs)))
    base = rows[0][1]
    cache = "cold cache (pages dropped before each run)" if a.cold else "warm cache"
    print(f"checkpoint {ckpt} ({size / 1e9:.2f} GB in {len(files)} files), best of {a.repeat}, {cache}")
    print(f"{'':48} {'seconds':>8} {'GB/s':>6} {'x cat':>6} {'CPU s':>6} {'peak RSS MiB':>12}")
    for name, s_, gbs, rss, cpu in rows:
        print(f"{name:48} {s_:8.2f} {gbs:6.2f} {s_ / base:6.2f} {cpu:6.2f} {rss:12d}")
    keys = ("name", "s", "gbps", "rss_mib", "cpu_s")
    print(json.dumps({"gb": size / 1e9, "cold": a.cold, "rows": [dict(zip(keys, r)) for r in rows]}))


if __name__ == "__main__":
    main()
