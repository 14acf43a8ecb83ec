"""Benchmark: ``ckpttool diff`` and ``ckpttool manifest`` beside their baselines, in one run.

1. ``diff A B`` of two identical ~3 GB BF16 checkpoints with different shardings: A a 4-rank
   gloo DTensor ``Shard(0)`` save (``bench/_ckpts.py``), B the same tensors saved again by one
   process (one chunk per tensor), so no raw fast path applies: every tensor is read from both
   sides and compared bitwise. Beside ``cmp`` of A's data files with a byte copy of them (the read
   limit of comparing 2 x 3 GB) and beside ``dcp.load`` of both + ``torch.equal`` per tensor.
   Warm page cache; fresh processes; peak RSS from GNU ``time``. Targets: >= 50% of ``cmp``'s
   throughput, peak RSS <= 2 x the largest tensor + 512 MiB.
2. ``diff A A2`` (same chunking: the raw-record fast path) beside the same ``cmp``.
3. ``manifest A`` beside ``cat`` of A's files. Target: >= 60% of ``cat``.
4. The digest candidates on a 256 MiB buffer: xxh3-128, BLAKE3 (1 thread), BLAKE2b, SHA-256,
   and CRC-32 (isal) for reference.

The load average (``os.getloadavg``) is printed next to every figure: the machine is shared.

Usage: python bench/bench_diff.py [--gb 3] [--workdir /tmp/ckpttool-bench] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

_TIME = shutil.which("time", path="/usr/bin:/bin")
PY = sys.executable


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a fresh process (GNU ``time -f %M``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss, tempfile.TemporaryFile() as err:
        full = [_TIME, "-f", "%M", "-o", rss.name, *cmd] if _TIME else cmd
        t0 = time.perf_counter()
        proc = subprocess.run(full, stdout=subprocess.DEVNULL, stderr=err)
        dt = time.perf_counter() - t0
        if proc.returncode not in ok:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
        text = rss.read().split()
        return dt, int(text[-1]) * 1024 if _TIME and text else 0


def data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(".distcp"))


def nbytes(path: Path) -> int:
    return sum(p.stat().st_size for p in data_files(path))


def warm(*paths: Path) -> None:
    for path in paths:
        for p in data_files(path):
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def build_a(workdir: Path, gb: float) -> Path:
    from _ckpts import build, dense_rank, layers_for

    return build(workdir / f"diff-a-{gb:g}gb", dense_rank, layers_for(gb, 2), "bfloat16", False, None)


def build_b(a: Path, workdir: Path) -> Path:
    """A's tensors saved again by one process (another chunking)."""
    out = workdir / (a.name.replace("diff-a", "diff-b"))
    if (out / ".metadata").is_file():
        return out
    import torch.distributed.checkpoint as dcp

    from ckpttool.format import CheckpointReader

    with CheckpointReader(a) as r:
        sd = {k.removeprefix("model."): r.read_tensor(k) for k in r.metadata.entries if k.startswith("model.")}
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=4), no_dist=True)
    os.rename(tmp, out)
    return out


def copy_of(a: Path, workdir: Path) -> Path:
    out = workdir / (a.name + "-copy")
    if not (out / ".metadata").is_file():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(a, out)
    return out


LOAD_AND_EQUAL = r"""
import sys, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
def load(path):
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return sd
a = load(sys.argv[1]); b = load(sys.argv[2])
assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    a = build_a(args.workdir, args.gb)
    b = build_b(a, args.workdir)
    a2 = copy_of(a, args.workdir)
    from ckpttool.format import CheckpointReader

    with CheckpointReader(a) as r:
        largest = max(m.nbytes for m in r.metadata.entries.values() if hasattr(m, "nbytes"))
    na, nb = nbytes(a), nbytes(b)
    ck = [PY, "-m", "ckpttool"]
    print(
        f"A: {a} ({na / 1e9:.2f} GB, {len(data_files(a))} files, 4-rank Shard(0)); B: {b} ({nb / 1e9:.2f} GB, 1 chunk/tensor)"
    )
    print(f"largest tensor {largest / 2**20:.0f} MiB; RSS target <= {(2 * largest + (512 << 20)) / 2**20:.0f} MiB")
    print(f"machine: {os.cpu_count()} CPUs; best of {args.repeat}")
    print(f"{'case':38s} {'seconds':>8s} {'GB/s':>7s} {'peak RSS':>10s}  load")

    def best(label: str, cmd: list[str], total: int, ok: tuple[int, ...] = (0,), *paths: Path) -> float:
        runs = []
        for _ in range(args.repeat):
            warm(*paths)
            runs.append(run(cmd, ok))
        dt, rss = min(runs)
        print(f"{label:38s} {dt:8.2f} {total / dt / 1e9:7.2f} {rss / 2**20:8.0f} MiB  {load()}", flush=True)
        return total / dt

    # 1. different shardings
    cmp_cmd = ["sh", "-c", " && ".join(f"cmp {p} {a2 / p.name}" for p in data_files(a))]
    cmp_rate = best("cmp A's files with a copy", cmp_cmd, 2 * na, (0,), a, a2)
    diff_rate = best("ckpttool diff A B (other sharding)", [*ck, "diff", str(a), str(b)], na + nb, (0,), a, b)
    best("dcp.load A and B + torch.equal", [PY, "-c", LOAD_AND_EQUAL, str(a), str(b)], na + nb, (0,), a, b)
    print(f"  diff / cmp = {diff_rate / cmp_rate:.0%} (target >= 50%)")
    # 2. same chunking: raw records
    raw_rate = best("ckpttool diff A A-copy (raw records)", [*ck, "diff", str(a), str(a2)], 2 * na, (0,), a, a2)
    print(f"  raw diff / cmp = {raw_rate / cmp_rate:.0%}")
    # 3. manifest vs cat
    cat_rate = best("cat A's files > /dev/null", ["sh", "-c", f"cat {a}/*.distcp > /dev/null"], na, (0,), a)
    out = Path(tempfile.mkdtemp()) / "manifest.json"
    for algo in ("xxh3-128", "blake3"):
        rate = best(
            f"ckpttool manifest A --hash {algo}", [*ck, "manifest", str(a), "-o", str(out), "--hash", algo], na, (0,), a
        )
        print(f"  manifest ({algo}) / cat = {rate / cat_rate:.0%} (target >= 60%)")
    # 4. digest candidates
    import hashlib

    import blake3
    import xxhash

    from ckpttool.engine.crc import IMPLEMENTATION, crc32

    buf = os.urandom(256 << 20)
    cands = [
        ("xxh3-128 (xxhash)", lambda d: xxhash.xxh3_128(d).digest()),
        ("blake3 (1 thread)", lambda d: blake3.blake3(d).digest()),
        ("blake2b-256 (hashlib)", lambda d: hashlib.blake2b(d, digest_size=32).digest()),
        ("sha256 (hashlib)", lambda d: hashlib.sha256(d).digest()),
        (f"crc32 ({IMPLEMENTATION}, not a strong hash)", lambda d: crc32(d, 0)),
    ]
    print("digests of a 256 MiB buffer:")
    for name, fn in cands:
        t = min(_timed(fn, buf) for _ in range(3))
        print(f"  {name:38s} {len(buf) / t / 1e9:7.2f} GB/s  {load()}")


def _timed(fn: object, buf: bytes) -> float:
    t0 = time.perf_counter()
    fn(buf)  # type: ignore[operator]
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
