"""Benchmark: ``ckpttool validate`` metadata rules on 100,000 entries, and ``--deep`` vs ``cat``.

Prints, in one run, ckpttool's figure beside its baseline:

1. Metadata rules (``validate --strict``, no ``--deep``) on a 100,000-entry checkpoint
   written "as if by 8 ranks" (``bench_inspect.make_many_entries_checkpoint``): wall time
   of a fresh ``ckpttool validate --strict --json`` process and of the in-process library
   call, beside a fresh process doing torch's bare ``FileSystemReader.read_metadata()``
   (no checks at all). Target: under 3 s.
2. ``validate --strict --deep`` on a ~3 GiB BF16 checkpoint saved by ``dcp.save`` (8 data
   files), warm page cache, beside ``cat`` of the same data files to ``/dev/null``: read
   throughput of both. Target: at least 60% of ``cat``'s throughput; with every record's
   CRC-32 checked (the default), at least 50%. Printed with the CRC-32 computed by ``isal``
   (the default), by ``zlib``, and not at all.
3. ``validate --strict --deep`` as a fresh process on a checkpoint with FP32 optimizer state:
   a 1 GB BF16 Llama-style model (491M parameters, 4-rank gloo DTensor ``Shard(0)`` save) with
   FullFP32AdamW's ``master_weight``, ``exp_avg``, ``exp_avg_sq`` (6.9 GB in 4 files; every
   parameter/master pair compared bitwise), beside ``cat`` of the same files in a fresh process.
   Target: at least 60% of ``cat``'s throughput, start-up included.
4. CRC-32 alone: ``zlib.crc32``, ``isal_zlib.crc32`` (and ``zlib_ng.crc32`` when installed) over
   1 MiB cache-resident slices.
5. ``export`` of item 2's checkpoint's model, in process, with and without ``verify_crc``,
   beside ``cp -r`` of the output directory.
6. The tiling check (``tiling_problem``) on one tensor stored as 10^6 chunks (1000 x 1000
   chunks of 1 x 1, and 10^6 row blocks), and ``validate --strict`` on a checkpoint holding it.

Usage: python bench/bench_validate.py [--entries 100000] [--deep-gib 3] [--deep-optim-gb 1] [--workdir /tmp/ckpttool-bench]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from ckpttool.ops.validate import ValidateOptions

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _many_entries(workdir: Path, n: int, ranks: int = 8, sharded_every: int = 4) -> Path:
    try:
        from bench_inspect import make_many_entries_checkpoint
    except ImportError:  # pragma: no cover - bench_inspect is in the repository
        raise SystemExit("bench/bench_inspect.py (make_many_entries_checkpoint) is required") from None
    # Same cache names as bench_inspect.py.
    path = workdir / (f"many-{n}-{ranks}" if sharded_every == 4 else f"many-{n}-{ranks}-s{sharded_every}")
    if not (path / ".metadata").is_file():
        print(f"building {n}-entry checkpoint in {path} ...", file=sys.stderr)
        make_many_entries_checkpoint(path, n_entries=n, ranks=ranks, sharded_every=sharded_every)
    return path


def _big(workdir: Path, gib: float) -> Path:
    """A ~``gib`` GiB BF16 checkpoint: 64 MiB tensors (some with NaN-free random data), 8 files."""
    path = workdir / f"deep-{gib:g}gib"
    if (path / ".metadata").is_file():
        return path
    import torch
    import torch.distributed.checkpoint as dcp

    print(f"building {gib:g} GiB checkpoint in {path} ...", file=sys.stderr)
    n = max(1, round(gib * 1024 / 64))
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(32 * 1024 * 1024, generator=g) * 0.02).to(torch.bfloat16)
    sd = {f"model.layers.{i}.mlp.weight": base.roll(i * 997).view(4096, 8192) for i in range(n)}
    tmp = workdir / f".deep-{gib:g}gib.tmp"
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=8))
    os.rename(tmp, path)
    return path


def optim_checkpoint(workdir: Path, gb: float) -> Path:
    """A ``gb`` GB BF16 model with FP32 master/moments (``bench/_ckpts.py``), cached under ``workdir``."""
    import json

    from _ckpts import build, dense_rank, layers_for

    record = {
        "format": "ckpttool.layout",
        "version": 2,
        "parallel": {"dp_shard_size": 4},
        "optimizer": {
            "type": "full_fp32_adamw",
            "master_dtype": "float32",
            "step_dtype": "float32",
            "moment_dtypes": {"resident": "float32"},
        },
        "global_step": 100,
    }
    layers = layers_for(gb, 2)
    return build(workdir / f"llama-bf16-{gb:g}gb-fp32-state", dense_rank, layers, "bfloat16", True, json.dumps(record))


def _fresh(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - t0, p


TORCH_READ = (
    "import sys\nfrom torch.distributed.checkpoint import FileSystemReader\n"
    "md = FileSystemReader(sys.argv[1]).read_metadata()\nprint(len(md.state_dict_metadata))\n"
)


def bench_metadata(path: Path, repeat: int) -> None:
    from ckpttool.ops.validate import validate

    cli = min(_fresh(["ckpttool", "validate", str(path), "--strict", "--json"])[0] for _ in range(repeat))
    t_in = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = validate(path, ValidateOptions(strict=True))
        t_in.append(time.perf_counter() - t0)
    assert res.exit_code == 0, [f.message for f in res.findings[:3]]
    base = min(_fresh([sys.executable, "-c", TORCH_READ, str(path)])[0] for _ in range(repeat))
    ran = sum(1 for s in res.rules if s.status != "skipped")
    print(f"metadata rules, {path.name}: {ran} rules, {len(res.findings)} findings")
    print(f"  ckpttool validate --strict (fresh process)   {cli:7.2f} s   (target < 3 s)")
    print(f"  ckpttool validate() in process               {min(t_in):7.2f} s")
    print(f"  baseline: torch read_metadata (fresh proc.)  {base:7.2f} s   (reads .metadata only, checks nothing)")


def bench_deep(path: Path, repeat: int, workers: int | None) -> None:
    from ckpttool.ops.validate import validate

    files = sorted(str(p) for p in path.glob("*.distcp"))
    total = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    t_cat = min(_fresh(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])[0] for _ in range(repeat))
    t_in, res = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = validate(path, ValidateOptions(strict=True, deep=True, workers=workers))
        t_in.append(time.perf_counter() - t0)
    assert res is not None and res.exit_code == 0, [f.message for f in res.findings[:3]]
    t_cli = min(_fresh(["ckpttool", "validate", str(path), "--strict", "--deep", "--json"])[0] for _ in range(repeat))
    gib = total / 2**30
    print(
        f"--deep, {path.name}: {gib:.2f} GiB in {len(files)} files, read {res.bytes_read / 2**30:.2f} GiB "
        f"with {workers or 'default'} workers, warm cache"
    )
    print(
        f"  ckpttool validate --strict --deep (in proc.) {min(t_in):7.2f} s  {gib / min(t_in):6.2f} GiB/s  "
        f"({gib / min(t_in) / (gib / t_cat):.0%} of cat, target >= 60%)"
    )
    print(
        f"  ckpttool validate --strict --deep (fresh)    {t_cli:7.2f} s  {gib / t_cli:6.2f} GiB/s  "
        f"({gib / t_cli / (gib / t_cat):.0%} of cat)"
    )
    print(f"  baseline: cat files > /dev/null              {t_cat:7.2f} s  {gib / t_cat:6.2f} GiB/s")


def bench_deep_fresh(path: Path, repeat: int) -> None:
    """``validate --strict --deep`` and ``cat`` as fresh processes, warm cache (start-up included on both sides)."""
    files = sorted(str(p) for p in path.glob("*.distcp"))
    total = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    t_cat, t_cli = [], []
    for _ in range(repeat):  # interleaved: load from other processes hits both sides alike
        t_cat.append(_fresh(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])[0])
        t, p = _fresh(["ckpttool", "validate", str(path), "--strict", "--deep", "--json"])
        if p.returncode != 0:
            raise SystemExit(f"validate --deep failed ({p.returncode}): {p.stdout[-1500:]} {p.stderr[-1500:]}")
        t_cli.append(t)
    gb = total / 1e9
    c, v = min(t_cat), min(t_cli)
    print(f"--deep, {path.name}: {gb:.2f} GB in {len(files)} files (BF16 params + FP32 master/moments), warm cache")
    print(
        f"  ckpttool validate --strict --deep (fresh)    {v:7.2f} s  {gb / v:6.2f} GB/s  ({c / v:.0%} of cat, target >= 60%)"
    )
    print(f"  baseline: cat files > /dev/null (fresh)      {c:7.2f} s  {gb / c:6.2f} GB/s")


def _crc_variants() -> list[tuple[str, object]]:
    import zlib

    out: list[tuple[str, object]] = [("zlib", zlib.crc32)]
    try:
        from isal import isal_zlib

        out.append(("isal", isal_zlib.crc32))
    except ImportError:
        pass
    try:
        from zlib_ng import zlib_ng

        out.append(("zlib-ng", zlib_ng.crc32))
    except ImportError:
        pass
    return out


def bench_crc(repeat: int) -> None:
    buf = memoryview(os.urandom(1 << 20))
    n = 2048  # 2 GiB through one cache-resident 1 MiB slice
    print("CRC-32 of 1 MiB cache-resident slices, one thread (crc32c is another polynomial: not usable for zip)")
    for name, fn in _crc_variants():
        best = min(_timed(lambda fn=fn: [fn(buf, 0) for _ in range(n)]) for _ in range(repeat))
        print(f"  {name:8} {n / 1024 / best:6.2f} GiB/s")


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def bench_deep_crc(path: Path, repeat: int, workers: int | None) -> None:
    """``--deep`` with the CRC-32 by isal (default), by zlib, and skipped, beside ``cat``."""
    import zlib

    import ckpttool.ops.validate.deep as deep
    from ckpttool.ops.validate import validate

    files = sorted(str(p) for p in path.glob("*.distcp"))
    gib = sum(os.path.getsize(f) for f in files) / 2**30
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    t_cat = min(_fresh(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])[0] for _ in range(repeat))
    real = deep.crc32
    print(f"--deep with and without CRC-32, {path.name}: {gib:.2f} GiB, warm cache, in process")
    for label, fn in (("CRC-32 by isal (default)", real), ("CRC-32 by zlib", zlib.crc32), ("no CRC-32", None)):
        deep.crc32 = fn if fn is not None else (lambda data, value=0: 0)  # type: ignore[assignment]
        try:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                res = validate(path, ValidateOptions(strict=True, deep=True, workers=workers))
                times.append(time.perf_counter() - t0)
            if fn is not None:
                assert res.exit_code == 0, [f.message for f in res.findings[:3]]
        finally:
            deep.crc32 = real
        t = min(times)
        print(f"  {label:26} {t:6.2f} s  {gib / t:6.2f} GiB/s  ({t_cat / t:.0%} of cat; target >= 50% with CRC)")
    print(f"  baseline: cat > /dev/null  {t_cat:6.2f} s  {gib / t_cat:6.2f} GiB/s")


def bench_export_crc(path: Path, workdir: Path, repeat: int) -> None:
    """``export`` (model tensors of the --deep checkpoint) with and without ``verify_crc``, beside ``cp -r``."""
    import shutil

    from ckpttool.ops.export import ExportOptions, export_checkpoint

    outs = workdir / "export-crc"
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir()
    res = None
    rows = []
    for verify in (True, False):
        times = []
        for i in range(repeat):
            out = outs / f"out-{verify}-{i}"
            t0 = time.perf_counter()
            res = export_checkpoint(path, out, ExportOptions(verify_crc=verify, shard_size=1 << 30))
            times.append(time.perf_counter() - t0)
            if i < repeat - 1:
                shutil.rmtree(out)
        rows.append((verify, min(times)))
    assert res is not None
    last = outs / f"out-True-{repeat - 1}"
    t_cp = []
    for i in range(repeat):
        target = outs / f"cp-{i}"
        t_cp.append(_fresh(["cp", "-r", str(last), str(target)])[0])
        shutil.rmtree(target)
    gb = res.bytes / 1e9
    print(f"export of {path.name}'s model: {gb:.2f} GB in {len(res.files)} file(s), in process, warm cache")
    for verify, t in rows:
        label = "with --verify-crc (default)" if verify else "with --no-verify-crc"
        print(f"  {label:28} {t:6.2f} s  {gb / t:6.2f} GB/s  ({min(t_cp) / t:.0%} of cp -r)")
    print(f"  CRC cost: {rows[0][1] / rows[1][1] - 1:+.1%} of the export's time")
    print(f"  baseline: cp -r of the output {min(t_cp):6.2f} s  {gb / min(t_cp):6.2f} GB/s")
    shutil.rmtree(outs, ignore_errors=True)


def bench_tiling(workdir: Path, repeat: int) -> None:
    from ckpttool.format.metadata import ChunkMeta, DType, TensorMeta
    from ckpttool.format.tiling import tiling_problem

    n = 1000
    grid = TensorMeta(DType("float32"), (n, n), tuple(ChunkMeta((i, j), (1, 1)) for i in range(n) for j in range(n)))
    rows = TensorMeta(DType("float32"), (n * n, 4), tuple(ChunkMeta((i, 0), (1, 4)) for i in range(n * n)))
    print("tiling check on one tensor stored as 10^6 chunks (the pairwise check it replaced: ~5*10^11 box tests)")
    for name, meta in (("1000 x 1000 chunks of 1 x 1", grid), ("10^6 row blocks", rows)):
        best = min(_timed(lambda meta=meta: tiling_problem(meta)) for _ in range(repeat))
        assert tiling_problem(meta) is None
        print(f"  {name:30} {best:6.2f} s")
    ck = workdir / "tiled-1e6"
    if not (ck / ".metadata").is_file():
        import torch

        from ckpttool.ops.sample import write_sample
        from tests.fixtures.hostile import (
            append_bytes,
            fast_metadata_pickle,
            load_torch_metadata,
            metadata_specs,
            torch_save_archive,
        )

        write_sample(ck)
        st = ("__0_0.distcp", *append_bytes(ck, "__0_0.distcp", torch_save_archive(torch.ones(1, 1))))
        tensors, items, planner = metadata_specs(load_torch_metadata(ck))
        chunks = [((i, j), (1, 1), st) for i in range(n) for j in range(n)]
        tensors.append(("model.model.tiled.weight", "float32", (n, n), chunks))
        (ck / ".metadata").write_bytes(fast_metadata_pickle(tensors, items, planner))
    t = min(_fresh(["ckpttool", "validate", str(ck), "--strict", "--json"])[0] for _ in range(repeat))
    size = (ck / ".metadata").stat().st_size / 1e6
    print(f"  ckpttool validate --strict, fresh process, sample + that tensor ({size:.0f} MB .metadata): {t:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--deep-gib", type=float, default=3.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--skip-metadata", action="store_true")
    ap.add_argument(
        "--sharded-every",
        type=int,
        default=4,
        help="as bench_inspect.py: every k-th tensor sharded over 8 ranks; 0: one chunk per tensor",
    )
    ap.add_argument("--skip-deep", action="store_true")
    ap.add_argument("--deep-optim-gb", type=float, default=1.0, help="BF16 model GB of the FP32-state case (0: skip)")
    ap.add_argument("--skip-crc", action="store_true", help="skip the CRC-32, export and tiling sections")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    if not a.skip_metadata:
        bench_metadata(_many_entries(a.workdir, a.entries, sharded_every=a.sharded_every), a.repeat)
    if not a.skip_deep:
        bench_deep(_big(a.workdir, a.deep_gib), a.repeat, a.workers)
    if a.deep_optim_gb > 0:
        bench_deep_fresh(optim_checkpoint(a.workdir, a.deep_optim_gb), a.repeat)
    if not a.skip_crc:
        bench_crc(a.repeat)
        big = _big(a.workdir, a.deep_gib)
        bench_deep_crc(big, a.repeat, a.workers)
        bench_export_crc(big, a.workdir, a.repeat)
        bench_tiling(a.workdir, a.repeat)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
