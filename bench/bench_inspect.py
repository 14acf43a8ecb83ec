"""Benchmark: `ckpttool inspect --json` vs torch's own metadata read on a 100,000-entry checkpoint.

Builds (once, cached under --workdir) a DCP checkpoint with N tensor entries
"written as if by 8 ranks": a quarter of the tensors are sharded along dim 0
over all 8 ranks (8 chunks each), the rest are written whole by one rank
(round-robin), plus nested param-group byte items. ``.metadata`` is pickled
from torch's real ``Metadata`` dataclasses exactly as ``dcp.save`` does, and
every chunk is a real ``torch.save`` archive at its recorded offset.

Prints, in one run:
  * wall time of ``ckpttool inspect --json DIR`` (a fresh process, as a user runs it);
  * wall time of a fresh process doing ``FileSystemReader(DIR).read_metadata()``
    and listing the keys (torch's bare metadata read, no checks, no report);
  * in-process times of both without interpreter/import start-up;
  * bytes read from ``.distcp`` files by inspect, split into byte-item bytes and
    tensor-chunk bytes (must be 0), by tracing ``os.preadv``.

  * start-up: ``ckpttool inspect`` and ``ckpttool validate --strict`` of the built-in sample
    (``ckpttool sample``: 102 entries, an ``extra_state`` file with a torch RNG state) as fresh
    processes beside ``python -c pass``, and whether torch was imported (target: <= 0.2 s,
    torch never imported).

  * ``--first-run``: ``inspect --json`` with ``--no-cache`` (a first run: the allow-list parser), with
    the cache on and no entry yet (a first run that writes one), and with a warm parsed-metadata cache beside torch's ``read_metadata`` (default 10^6 entries, 2.75 M
    chunks), CPU seconds and peak RSS of each fresh process (``--baseline DIR``: another ckpttool tree
    in the same rounds).

Usage: python bench/bench_inspect.py [--entries 100000] [--ranks 8] [--workdir /tmp/ckpttool-bench]
       python bench/bench_inspect.py --first-run [--entries 1000000] [--repeat 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path


def make_many_entries_checkpoint(
    path: str | os.PathLike[str],
    n_entries: int = 100_000,
    ranks: int = 8,
    sharded_every: int = 4,
    sparse: bool = False,
) -> Path:
    """Write a DCP checkpoint with ``n_entries`` tensor entries as if saved by ``ranks`` ranks.

    Keys follow the schema: ``model.model.layers.{i}.block{j}.weight`` (BF16, shape ``[8*ranks, 16]``
    when sharded, ``[4, 16]`` otherwise) and ``optimizer.param_groups.0.{lr,betas,eps,weight_decay,params}``.
    ``sparse``: the tensor chunks' windows are left as holes (the same ``.metadata`` and byte items;
    for commands that read no tensor bytes, such as ``inspect``), built in a fraction of the time and disk.

    Returns:
        The checkpoint directory.
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    templates: dict[tuple, bytes] = {}

    def archive(shape: tuple[int, ...]) -> bytes:
        blob = templates.get(shape)
        if blob is None:
            buf = io.BytesIO()
            torch.save(torch.ones(shape, dtype=torch.bfloat16), buf)
            blob = templates[shape] = buf.getvalue()
        return blob

    files = [open(out / f"__{r}_0.distcp", "wb") for r in range(ranks)]
    sdm: dict = {}
    storage: dict = {}
    planner: dict = {}
    props = TensorProperties(dtype=torch.bfloat16)
    keys = []
    for i in range(n_entries):
        key = f"model.model.layers.{i // 8}.block{i % 8}.weight"
        keys.append(key[len("model.") :])
        sharded = sharded_every > 0 and i % sharded_every == 0
        size = torch.Size([8 * ranks, 16]) if sharded else torch.Size([4, 16])
        chunks = []
        writers = range(ranks) if sharded else [i % ranks]
        for r in writers:
            offsets = torch.Size([8 * r, 0]) if sharded else torch.Size([0, 0])
            sizes = torch.Size([8, 16]) if sharded else size
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            f = files[r]
            blob = archive(tuple(sizes))
            storage[MetadataIndex(key, offsets)] = _StorageInfo(f"__{r}_0.distcp", f.tell(), len(blob))
            if sparse:
                f.seek(len(blob), os.SEEK_CUR)
            else:
                f.write(blob)
        sdm[key] = TensorStorageMetadata(properties=props, size=size, chunks=chunks)
        planner[key] = ("model", key[len("model.") :])
    for hyper, value in (("lr", 1e-4), ("betas", (0.9, 0.95)), ("eps", 1e-8), ("weight_decay", 0.1), ("params", keys)):
        key = f"optimizer.param_groups.0.{hyper}"
        buf = io.BytesIO()
        torch.save(value, buf)
        blob = buf.getvalue()
        f = files[0]
        storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", f.tell(), len(blob))
        f.write(blob)
        sdm[key] = BytesStorageMetadata()
        planner[key] = ("optimizer", "param_groups", 0, hyper)
    for f in files:
        f.truncate()  # a sparse file ends at its last window, as a written one does
        f.close()
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, version="1.0.0")
    with open(out / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return out


TORCH_READ = """
import sys, time
t0 = time.perf_counter()
from torch.distributed.checkpoint import FileSystemReader
t1 = time.perf_counter()
md = FileSystemReader(sys.argv[1]).read_metadata()
keys = sorted(md.state_dict_metadata)
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {len(keys)}")
"""

CKPTTOOL_READ = """
import sys, time, os
t0 = time.perf_counter()
from ckpttool.ops.inspect import inspect
t1 = time.perf_counter()
ranges = []
_preadv = os.preadv
def traced(fd, buffers, offset, *a):
    n = _preadv(fd, buffers, offset, *a)
    ranges.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
    return n
os.preadv = traced
ov = inspect(sys.argv[1])
t2 = time.perf_counter()
import json
json.dumps(ov.to_dict())
t3 = time.perf_counter()
os.preadv = _preadv
from ckpttool.format import CheckpointDir
cd = CheckpointDir(sys.argv[1])
tensor_ranges = {}
for (fqn, off), info in cd.metadata.storage.items():
    if off is not None:
        tensor_ranges.setdefault(os.path.realpath(os.path.join(sys.argv[1], info.relative_path)), []).append((info.offset, info.offset + info.length))
tensor_bytes = 0
for path, off, n in ranges:
    for lo, hi in tensor_ranges.get(path, ()):
        tensor_bytes += max(0, min(hi, off + n) - max(lo, off))
total = sum(n for _, _, n in ranges if n > 0)
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f} {total} {tensor_bytes} {'torch' in sys.modules}")
"""


def _run(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, res.stdout


SAMPLE_RUN = """
import sys
from ckpttool.cli import main
sys.argv = ["ckpttool", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    if e.code:
        raise
print("torch" in sys.modules, file=sys.stderr)
"""


def bench_startup(workdir: Path, repeat: int) -> None:
    """``inspect`` / ``validate --strict`` of the sample as fresh processes beside ``python -c pass``."""
    sample = workdir / "sample"
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()"]
    if not (sample / ".metadata").is_file():
        subprocess.run([*cli, "sample", str(sample)], check=True, capture_output=True)
    rows = []
    for label, args in (
        ("inspect", ["inspect", str(sample)]),
        ("validate --strict", ["validate", str(sample), "--strict"]),
    ):
        best = min(_run([sys.executable, "-c", SAMPLE_RUN, *args])[0] for _ in range(max(repeat, 5)))
        err = subprocess.run([sys.executable, "-c", SAMPLE_RUN, *args], capture_output=True, text=True).stderr
        rows.append((f"ckpttool {label} (sample)", best, err.split()[-1] if err.split() else "?"))
    base = min(_run([sys.executable, "-c", "pass"])[0] for _ in range(max(repeat, 5)))
    print(f"start-up, {sample} (load average {os.getloadavg()[0]:.2f}):")
    for label, t, torch_loaded in rows:
        print(
            f"  {label:40s} {t:6.3f} s  (fixed cost {t - base:.3f} s, target <= 0.2 s); torch imported: {torch_loaded}"
        )
    print(f"  {'baseline: python -c pass':40s} {base:6.3f} s")


EXPORT_START = """
import os, sys, time
t0 = time.perf_counter()
from ckpttool.cli import main
import ckpttool.ops.distributed as dist


def _first_write(*a, **k):
    # Stands in for entering the output directory: the export has planned everything and checked every chunk.
    sys.stderr.write(f"first write after {time.perf_counter() - t0:.3f} s\\n")
    sys.stderr.flush()
    os._exit(0)


dist.enter_output_dir = _first_write
sys.argv = ["ckpttool", *sys.argv[1:]]
main()
"""


_REPO = str(Path(__file__).resolve().parent.parent)


def _run_rss(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB, the child's own ``ru_maxrss``) of a fresh process."""
    wall, _, rss = _run_usage(cmd, env)
    return wall, rss


def _run_usage(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MiB) of a fresh process (``wait4``)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONPATH", _REPO)  # this tree, unless the case names another (--baseline)
    t0 = time.perf_counter()
    # cwd "/": `python -c` puts the current directory first on sys.path, where a ckpttool tree would shadow PYTHONPATH's
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd="/")
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # 1: validate findings
        raise RuntimeError(f"{cmd[-3:]} exited {proc.returncode}: {err.decode(errors='replace')[-400:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def _built(workdir: Path, entries: int, ranks: int, sharded_every: int, sparse: bool) -> Path:
    """The many-entries checkpoint, built once under ``workdir`` in a child process (see :func:`bench_million`)."""
    name = f"many-{entries}-{ranks}" + ("" if sharded_every == 4 else f"-s{sharded_every}")
    ckpt = workdir / (name + ("-sparse" if sparse else ""))
    if not (ckpt / ".metadata").exists():
        t0 = time.perf_counter()
        build = "import sys; sys.path.insert(0, sys.argv[1]); import gc; gc.disable(); import bench_inspect as b; "
        build += "b.make_many_entries_checkpoint(sys.argv[2], *map(int, sys.argv[3:6]), sparse=sys.argv[6] == '1')"
        here = str(Path(__file__).resolve().parent)
        args = [str(ckpt), str(entries), str(ranks), str(sharded_every), "1" if sparse else "0"]
        subprocess.run([sys.executable, "-c", build, here, *args], check=True)
        print(f"built {ckpt} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return ckpt


def bench_first_run(
    workdir: Path,
    entries: int,
    ranks: int,
    sharded_every: int,
    repeat: int,
    baseline: str | None,
    skip_torch: bool = False,
) -> None:
    """``inspect --json`` without and with the parsed-metadata cache beside torch's ``read_metadata``, one run.

    Fresh processes, interleaved (torch, then each ckpttool variant), best of ``repeat`` by CPU
    seconds (user + system: the figure a loaded machine does not distort); peak RSS the largest
    seen. ``baseline``: another ckpttool tree (a ``git archive`` of the commit to compare with)
    run ``--no-cache`` and with the cache in the same rounds. ``skip_torch``: without torch's read
    (~150 s of CPU at 10^6 entries), ratios against the baseline. The checkpoint is built sparse
    (``inspect`` reads no tensor bytes).
    """
    ckpt = _built(workdir, entries, ranks, sharded_every, sparse=True)
    md_size = (ckpt / ".metadata").stat().st_size
    n_chunks = entries + (entries + sharded_every - 1) // sharded_every * (ranks - 1) if sharded_every else entries
    env = {**os.environ, "CKPTTOOL_CACHE_DIR": str(workdir / "metadata-cache")}
    env.pop("CKPTTOOL_NO_CACHE", None)
    # 2.75 M chunks are 9.4 M records, over the default cap (a trusted input: raised as a user would)
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()", "--max-metadata-size", "2GiB"]
    # a first run with the cache on: no entry yet (its directory removed before each such run), one written
    env_miss = {**env, "CKPTTOOL_CACHE_DIR": str(workdir / "metadata-cache-miss")}
    cases = [
        ("torch FileSystemReader.read_metadata + keys", [sys.executable, "-c", TORCH_READ, str(ckpt)], env),
        ("ckpttool inspect --json --no-cache", [*cli, "--no-cache", "inspect", "--json", str(ckpt)], env),
        ("ckpttool inspect --json (cache miss)", [*cli, "inspect", "--json", str(ckpt)], env_miss),
        ("ckpttool inspect --json (cache hit)", [*cli, "inspect", "--json", str(ckpt)], env),
    ]
    if baseline:
        env_base = {**env, "PYTHONPATH": os.path.abspath(baseline)}
        cases.append(
            (f"baseline {baseline} --no-cache", [*cli, "--no-cache", "inspect", "--json", str(ckpt)], env_base)
        )
        cases.append(
            (f"baseline {baseline} (cache miss)", [*cli, "inspect", "--json", str(ckpt)], {**env_miss, **env_base})
        )
        cases.append((f"baseline {baseline} (cache hit)", [*cli, "inspect", "--json", str(ckpt)], env_base))
    _run_usage(cases[2][1], env)  # page cache warm, cache entry written
    if skip_torch:
        cases.pop(0)
    runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _, _ in cases}
    load = [os.getloadavg()[0]]
    for _ in range(repeat):
        for label, cmd, e in cases:
            if label.endswith("(cache miss)"):
                shutil.rmtree(e["CKPTTOOL_CACHE_DIR"], ignore_errors=True)
            runs[label].append(_run_usage(cmd, e))
            load.append(os.getloadavg()[0])
    best = {label: min(r, key=lambda x: x[1]) for label, r in runs.items()}
    rss = {label: max(x[2] for x in r) for label, r in runs.items()}
    ref = "torch" if not skip_torch else "base" if baseline else "first"
    t_wall, t_cpu, _ = best[cases[-3][0] if skip_torch and baseline else cases[0][0]]
    print(
        f"\n{entries:,} entries ({n_chunks:,} chunks), .metadata {md_size / 2**20:.0f} MiB; "
        f"load average {min(load):.1f}-{max(load):.1f}; best of {repeat} by CPU, fresh processes"
    )
    print(f"  {'':46s} {'wall s':>8s} {'CPU s':>8s} {f'x {ref} CPU':>12s} {f'x {ref} wall':>13s} {'peak RSS':>10s}")
    for label, _, _ in cases:
        wall, cpu, _ = best[label]
        print(f"  {label:46s} {wall:8.2f} {cpu:8.2f} {cpu / t_cpu:12.2f} {wall / t_wall:13.2f} {rss[label]:6.0f} MiB")
    print("  targets: --no-cache <= 0.5 x torch, cache hit <= 0.2 x torch, peak RSS <= 1024 MiB")


def bench_million(workdir: Path, entries: int, ranks: int, sharded_every: int, repeat: int) -> None:
    """One large case: every metadata-bound command as a fresh process beside torch's bare read.

    ckpttool runs twice per command: ``--no-cache`` (what a first run costs: unpickle and check) and
    with a warm parsed-metadata cache (``CKPTTOOL_CACHE_DIR`` in ``workdir``; what every later run
    on the same ``.metadata`` costs).
    """
    ckpt = workdir / (f"many-{entries}-{ranks}" if sharded_every == 4 else f"many-{entries}-{ranks}-s{sharded_every}")
    if not (ckpt / ".metadata").exists():
        # built in a child: its 7 GB of torch objects would otherwise be the high-water mark that every
        # later child inherits at fork (ru_maxrss counts it), and every peak RSS below would read 7 GB
        t0 = time.perf_counter()
        build = "import sys; sys.path.insert(0, sys.argv[1]); import bench_inspect as b; "
        build += "b.make_many_entries_checkpoint(sys.argv[2], *map(int, sys.argv[3:]))"
        here = str(Path(__file__).resolve().parent)
        subprocess.run(
            [sys.executable, "-c", build, here, str(ckpt), str(entries), str(ranks), str(sharded_every)], check=True
        )
        print(f"built {ckpt} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    md_size = (ckpt / ".metadata").stat().st_size
    n_chunks = entries + (entries + sharded_every - 1) // sharded_every * (ranks - 1) if sharded_every else entries
    env = {**os.environ, "CKPTTOOL_CACHE_DIR": str(workdir / "metadata-cache")}
    env.pop("CKPTTOOL_NO_CACHE", None)
    caps = ["--max-metadata-size", "2GiB"]  # 2.75 M chunks are over the default record cap (trusted input)
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()", *caps]
    exp = [sys.executable, "-c", EXPORT_START, *caps]
    out = str(workdir / "export-out-never-written")
    cases = [
        ("inspect --json", [*cli, "inspect", "--json", str(ckpt)]),
        ("inspect (table)", [*cli, "inspect", str(ckpt)]),
        ("validate --strict", [*cli, "validate", "--strict", str(ckpt)]),
        ("export, up to its first write", [*exp, "export", str(ckpt), out]),
    ]
    torch_cmd = [sys.executable, "-c", TORCH_READ, str(ckpt)]
    _run_rss(torch_cmd)  # page cache warm
    _run_rss([*cli, "inspect", "--json", str(ckpt)], env)  # the cache entry exists
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeat):  # interleaved: torch, then each command cold and warm
        rows.setdefault("torch", []).append(_run_rss(torch_cmd))
        for label, cmd in cases:
            rows.setdefault(label + " --no-cache", []).append(_run_rss([*cmd[:3], "--no-cache", *cmd[3:]], env))
            rows.setdefault(label + " (cache hit)", []).append(_run_rss(cmd, env))
    if os.path.exists(out):
        raise RuntimeError(f"the export wrote {out}: the first-write hook no longer stops it (see EXPORT_START)")
    t_torch, rss_torch = min(t for t, _ in rows["torch"]), max(r for _, r in rows["torch"])
    print(
        f"\n{entries:,} entries ({n_chunks:,} chunks, {ranks} ranks, "
        f"{f'every {sharded_every}th tensor in {ranks} chunks' if sharded_every else 'one chunk each'}), "
        f".metadata {md_size / 2**20:.0f} MiB; load average {os.getloadavg()[0]:.2f}; best of {repeat}, fresh processes"
    )
    print(f"  {'':52s} {'wall s':>8s} {'x torch':>8s} {'peak RSS':>10s}")
    print(f"  {'torch FileSystemReader.read_metadata + keys':52s} {t_torch:8.2f} {1.0:8.2f} {rss_torch:7.0f} MiB")
    for label, _ in cases:
        for variant in (" --no-cache", " (cache hit)"):
            runs = rows[label + variant]
            t, rss = min(t for t, _ in runs), max(r for _, r in runs)
            print(f"  {'ckpttool ' + label + variant:52s} {t:8.2f} {t / t_torch:8.2f} {rss:7.0f} MiB")
    print("  targets: <= 0.30 x torch, <= 1024 MiB peak RSS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, help="default 100,000; 1,000,000 with --first-run")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/ckpttool-bench")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--sharded-every",
        type=int,
        default=4,
        help="every k-th tensor is sharded over all ranks (8 chunks); 0: every tensor has one chunk",
    )
    ap.add_argument("--skip-large", action="store_true", help="only the start-up case")
    ap.add_argument(
        "--million",
        action="store_true",
        help="the 10^6-entry cases instead: one chunk per entry and chunk-heavy (every 4th tensor in 8 chunks), "
        "inspect/validate/export start, --no-cache and cache hit, beside torch's read_metadata, with peak RSS",
    )
    ap.add_argument(
        "--first-run",
        action="store_true",
        help="inspect --json --no-cache and cache hit beside torch's read_metadata, CPU seconds and peak RSS "
        "(default 10^6 entries with --entries unset; sparse checkpoint)",
    )
    ap.add_argument(
        "--baseline",
        help="with --first-run: another ckpttool tree run --no-cache and with the cache in the same rounds",
    )
    ap.add_argument(
        "--skip-torch", action="store_true", help="with --first-run: no torch read_metadata; ratios to the baseline"
    )
    args = ap.parse_args()
    if args.first_run:
        bench_first_run(
            Path(args.workdir),
            args.entries or 1_000_000,
            args.ranks,
            args.sharded_every,
            args.repeat,
            args.baseline,
            args.skip_torch,
        )
        return
    args.entries = args.entries or 100_000
    if args.million:
        for every in (0, 4):
            bench_million(Path(args.workdir), 1_000_000, args.ranks, every, args.repeat)
        return
    import compileall

    import ckpttool

    # as `pip install` does: start-up is measured with bytecode caches, also under PYTHONDONTWRITEBYTECODE
    compileall.compile_dir(os.path.dirname(ckpttool.__file__), quiet=1)
    bench_startup(Path(args.workdir), args.repeat)
    if args.skip_large:
        return
    ckpt = (
        Path(args.workdir) / f"many-{args.entries}-{args.ranks}"
        if args.sharded_every == 4
        else Path(args.workdir) / f"many-{args.entries}-{args.ranks}-s{args.sharded_every}"
    )
    if not (ckpt / ".metadata").exists():
        t0 = time.perf_counter()
        make_many_entries_checkpoint(ckpt, args.entries, args.ranks, args.sharded_every)
        print(f"built {ckpt} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    md_size = (ckpt / ".metadata").stat().st_size
    data_size = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()"]
    # Warm the page cache once.
    _run(cli + ["inspect", "--json", str(ckpt)])
    best_cli = min(_run(cli + ["inspect", "--json", str(ckpt)])[0] for _ in range(args.repeat))
    torch_runs = [_run([sys.executable, "-c", TORCH_READ, str(ckpt)]) for _ in range(args.repeat)]
    best_torch = min(t for t, _ in torch_runs)
    torch_import, torch_read, nkeys = torch_runs[0][1].split()
    ck = _run([sys.executable, "-c", CKPTTOOL_READ, str(ckpt)])[1].split()
    ck_import, ck_overview, ck_json, read_total, read_tensor, torch_loaded = ck
    nchunks = sum(
        len(v.chunks)
        for v in __import__("ckpttool.format", fromlist=["x"]).CheckpointDir(ckpt).metadata.entries.values()
        if hasattr(v, "chunks")
    )
    print(
        f"checkpoint: {args.entries} tensor entries ({nchunks} chunks) + 5 byte items, {args.ranks} ranks, "
        f".metadata {md_size / 2**20:.1f} MiB, data {data_size / 2**20:.1f} MiB"
    )
    print(f"{'':44s} {'wall s':>8s}")
    print(f"{'ckpttool inspect --json (fresh process)':44s} {best_cli:8.2f}")
    print(f"{'torch read_metadata + keys (fresh process)':44s} {best_torch:8.2f}")
    print(f"{'ratio ckpttool / torch':44s} {best_cli / best_torch:8.2f}   (target <= 2.0, and < 3 s)")
    print(
        f"in-process: ckpttool import {ck_import} s, overview {ck_overview} s, json {ck_json} s; "
        f"torch import {torch_import} s, read_metadata+keys {torch_read} s ({nkeys} keys)"
    )
    print(
        f"bytes read from .distcp by inspect: {int(read_total)} total, {int(read_tensor)} inside tensor chunks "
        f"(must be 0); torch imported by inspect: {torch_loaded}"
    )


if __name__ == "__main__":
    main()
