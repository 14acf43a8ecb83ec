"""Benchmark `ckpttool export` against `cp -r` of its output and against the usual torch scripts.

One run prints, side by side (warm page cache, every approach in its own process, wall seconds
including interpreter start-up and imports, peak RSS from GNU ``/usr/bin/time -f %M``; every timed
run starts from the same page cache, :func:`_settle`: its input warm, nothing dirty, no other file
this bench wrote cached):

``preserve`` — a Llama-style model (vocab 32000, hidden 2048, MLP 5632, 2 layers, 234M
parameters) in BF16 plus FP32 optimizer state (``step``, ``master_weight``, ``exp_avg``,
``exp_avg_sq``), saved by a real 4-rank gloo ``dcp.save`` of DTensors ``Shard(0)`` (the
FSDP2 layout: every tensor in 4 chunks, one ``__R_0.distcp`` file per rank), 3.05 GiB on
disk, 0.47 GB of model:

- ``ckpttool export CKPT OUT --shard-size 256MB`` (verbatim chunk copies);
- (a) ``dcp_to_torch_save`` + ``torch.load`` + ``safetensors.torch.save_file``;
- (b) a per-output-shard loop: ``dcp.load(no_dist=True)`` into preallocated tensors, then
  ``save_file`` (the approach of common merge scripts);
- (c) ``cp -r`` of ckpttool's output directory: the same bytes, copied by the kernel.

Transforming exports, each beside ``cp -r`` of its own output (the same output bytes):

- ``cast 1 GB``: an FP32 model-only checkpoint of the same shapes (0.94 GB, 4 ranks),
  ``--save-dtype bfloat16``;
- ``master cast``: the ``preserve`` checkpoint with ``--weights master --save-dtype bfloat16``
  (the FP32 masters rounded to BF16);
- ``per-expert`` and ``fused, un-permuted``: a legacy-layout MoE checkpoint (mesh
  ``(ep_fsdp=2, ep=2)``, both on the expert dim, version-1 layout record; 4 layers of fused
  experts ``gate_up_proj [64, 1024, 1024]`` / ``down_proj [64, 1024, 512]`` in BF16, 0.81 GB),
  ``--experts per-expert`` (128 pieces per tensor, experts in true order) and
  ``--experts fused`` (expert slabs un-permuted);
- ``cast 6 GB`` (``--big-gib 6``, off by default: 6.1 GB FP32 model, 27 layers);
- ``moe-big`` (``--only moe-big --big-gib 4``): the MoE checkpoint with as many layers as make
  ``--big-gib`` GB (0.2 GB a layer), ``--experts per-expert`` and ``--experts fused``;
- ``small``: the fixed cost of exporting the built-in sample (``ckpttool sample``) beside
  ``python -c pass``;
- ``phases``: CPU seconds per GB of each phase of a cast export on one thread, on the 1 GB FP32
  checkpoint's files: ``preadv`` into a 1 MiB buffer, CRC-32 (isal, zlib), the FP32 -> BF16
  kernel (numpy; torch's ``copy_``, with the CPU of ``import torch``), ``pwrite`` of 512 KiB with
  and without ``fallocate``, 4 MiB, with write-behind (``sync_file_range`` every 8 MiB), ``O_DIRECT``
  (the disk itself).
- ``many`` (``--only many``, off by default): ``--many N`` one-chunk tensors (``bench_inspect.py``'s
  ``make_many_entries_checkpoint(..., sharded_every=0)``: 8 data files, each tensor ``[4, 16]``
  BF16 in its own ~1.9 KB ``torch.save`` archive), metadata cache warm, beside ``cp -r`` of the
  output; wall and CPU seconds (user + system of the process); ``--many-baseline DIR`` runs another
  copy of the package (a worktree of an older revision) on the same checkpoint, alternated, and
  checks its output is byte-identical.
- ``many-floor`` (``--only many-floor``, off by default): what a floor-cost export of those ``--many N``
  tensors is made of, each step alone in process (CPU s): parsing ``.metadata`` (no cache / cache
  hit), the safetensors header and index text, reading the data files and writing the output bytes.

Every row carries the CPU seconds (user + system) of its process beside the wall time: on a
shared machine the CPU is the figure to compare. ``--baseline DIR`` (a directory holding another
revision's ``ckpttool/``: ``git archive REV ckpttool | tar -x -C DIR``) runs that revision's export
of every case interleaved with this one's and compares their outputs byte for byte (``cmp``);
``--slab-bytes N ...`` runs this tree's export of every case with each slab size
(``CKPTTOOL_SLAB_BYTES``; the default 1 MiB) interleaved too.

Targets: transforming exports >= 80% of ``cp -r``'s throughput of the same output bytes at
>= 4 GB, >= 50% at 1 GB; peak RSS <= 256 MiB + one slab per worker; the small export's fixed
cost <= 0.15 s. GB/s = output bytes / seconds (10^9).

Usage::

    python bench/bench_export.py [--root /tmp/ckpttool-bench-export] [--repeat 3] [--big-gib 6]
                                 [--only preserve cast per-expert ... phases] [--skip-torch]
                                 [--baseline DIR]
    python bench/bench_export.py --only many --many 100000 [--many-baseline DIR] --repeat 2
    python bench/bench_export.py --only many-floor --many 1000000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ckpts import MOE_E, MOE_H, MOE_I, WORLD, build, dense_rank, layers_for, moe_legacy_rank  # noqa: E402

# ------------------------------------------------------------------------------------------ baselines

BASELINE_A = textwrap.dedent("""
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import save_file
    ckpt, tmp, out = sys.argv[1:4]
    dcp_to_torch_save(ckpt, tmp)
    sd = torch.load(tmp, weights_only=False)
    model = {k: v.contiguous() for k, v in sd["model"].items()}
    save_file(model, out + "/model.safetensors", metadata={"format": "pt"})
""")

BASELINE_B = textwrap.dedent("""
    import sys, json, warnings, torch
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    ckpt, out, shard_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    md = dcp.FileSystemReader(ckpt).read_metadata()
    keys = [k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size")]
    shards, cur, size = [], [], 0
    for k in keys:
        v = md.state_dict_metadata[k]
        n = v.size.numel() * v.properties.dtype.itemsize
        if cur and size + n > shard_size:
            shards.append(cur); cur, size = [], 0
        cur.append(k); size += n
    shards.append(cur)
    weight_map = {}
    for i, ks in enumerate(shards):
        sd = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype) for k in ks}
        dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k[len("model."):]: v for k, v in sd.items()}, f"{out}/{name}", metadata={"format": "pt"})
        weight_map.update({k[len("model."):]: name for k in ks})
        del sd
    json.dump({"metadata": {}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"))
""")

_TIME = shutil.which("time", path="/usr/bin:/bin")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str, float]:
    """Run ``cmd``; return (wall seconds, peak RSS bytes of that process, its stdout, its CPU seconds).

    CPU seconds: user + system of the process and everything it waited for (``os.wait4`` of
    ``time``, whose own share is negligible): the figure to compare on a loaded machine.

    The peak RSS comes from GNU ``/usr/bin/time -f %M`` wrapped around the command: Linux
    carries the forking process's peak RSS into a child's ``ru_maxrss`` at exec, so
    measuring from this (large) Python process directly would put a floor under every
    figure; ``time`` is a small C process. Without it, ``os.wait4`` is used (floored).
    """
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r", suffix=".rss") as rss_file,
    ):
        full = [_TIME, "-f", "%M", "-o", rss_file.name, *cmd] if _TIME else cmd
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd[:5])} failed:\n{err.read().decode()[-2000:]}")
        rss = int(rss_file.read().split()[-1]) * 1024 if _TIME else usage.ru_maxrss * 1024
        return seconds, rss, out.read().decode(), usage.ru_utime + usage.ru_stime


def _run_cpu(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[float, float]:
    """Run ``cmd``; return (wall seconds, CPU seconds: user + system of it and its children)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed:\n{err[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime


def _many_case(root: Path, n: int, repeat: int, baseline: Path | None) -> list[str]:
    """Export of ``n`` one-chunk tensors beside ``cp -r`` of its output (and ``baseline``'s package), alternated."""
    from bench_inspect import make_many_entries_checkpoint

    ckpt = root / f"many-{n}"
    if not (ckpt / ".metadata").is_file():
        make_many_entries_checkpoint(ckpt, n, 8, 0)
    runs: dict[str, list[tuple[float, float]]] = {}
    # each package from its own tree: ``python -c`` puts the working directory first on sys.path
    trees = [("ckpttool export (this tree)", ROOT, root / "many-out")]
    if baseline is not None:
        trees.append((f"ckpttool export ({baseline})", baseline.resolve(), root / "many-out-base"))
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()"]
    lines = []
    for label, tree, _ in trees:
        env = dict(os.environ, PYTHONPATH=str(tree))
        where = subprocess.run(
            [sys.executable, "-c", "import ckpttool; print(ckpttool.__file__)"], env=env, cwd=tree, capture_output=True
        )
        lines.append(f"  {label}: {where.stdout.decode().strip()}")
    _run_cpu([*cli, "inspect", str(ckpt), "--json"], cwd=ROOT)  # the metadata cache, as a second run finds it
    for _ in range(repeat):
        for label, tree, out in trees:
            shutil.rmtree(out, ignore_errors=True)
            _settle(ckpt, root)  # the other tree's kept output not cached (_settle)
            env = dict(os.environ, PYTHONPATH=str(tree))
            runs.setdefault(label, []).append(_run_cpu([*cli, "export", str(ckpt), str(out)], env, tree))
        cp_out = root / "many-cp"
        shutil.rmtree(cp_out, ignore_errors=True)
        _settle(trees[0][2], root)
        runs.setdefault("cp -r of the output (baseline)", []).append(
            _run_cpu(["cp", "-r", str(trees[0][2]), str(cp_out)])
        )
        shutil.rmtree(cp_out, ignore_errors=True)
    nbytes = _output_bytes(trees[0][2])
    cp_wall = min(w for w, _ in runs["cp -r of the output (baseline)"])
    lines.insert(0, f"many ({n} one-chunk tensors, {nbytes / 1e6:.1f} MB out): best of {repeat}, wall / CPU seconds")
    for label, rs in runs.items():
        w, c = min(r[0] for r in rs), min(r[1] for r in rs)
        lines.append(f"  {label:44s} {w:8.2f} s wall {c:8.2f} s CPU   {w / cp_wall:7.1f}x cp -r wall")
    if baseline is not None:
        same = all(
            (trees[0][2] / f).read_bytes() == (trees[1][2] / f).read_bytes()
            for f in ("model.safetensors", "model.safetensors.index.json")
        )
        lines.append(f"  output byte-identical to the baseline's: {same}")
    for _, _, out in trees:
        shutil.rmtree(out, ignore_errors=True)
    return lines


def _cpu_of(fn: Any) -> tuple[float, Any]:
    """(CPU seconds of this process, user + system, spent in ``fn()``; its result)."""
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def _floor_documents(metas: Any, rows: list[tuple[str, float]]) -> int:
    """The header and index steps of :func:`_many_floor` (their CPU seconds into ``rows``); the output's size."""
    from ckpttool.format.safetensors import HeaderEntry, _layout

    keys = [k for k in metas if k.startswith("model.")]
    entries = [HeaderEntry(k[len("model.") :], metas[k].dtype.name, metas[k].size) for k in keys]
    c, (prefix, _, _) = _cpu_of(lambda: _layout(entries, None))
    rows.append((f"safetensors header, ckpttool's joined text ({len(prefix) / 1e6:.0f} MB)", c))
    hdr: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e in entries:
        nb = 2 * math.prod(e.shape)  # BF16
        hdr[e.name] = {"dtype": "BF16", "shape": list(e.shape), "data_offsets": [pos, pos + nb]}
        pos += nb
    c, _ = _cpu_of(lambda: json.dumps(hdr, separators=(",", ":")))
    rows.append(("  the same header by json.dumps of the dict (dict built outside)", c))
    c, _ = _cpu_of(lambda: json.dumps({"metadata": {}, "weight_map": {e.name: "model.safetensors" for e in entries}}))
    rows.append(("index: json.dumps of the weight map", c))
    return pos + len(prefix)


def _many_floor(root: Path, n: int) -> list[str]:
    """What a floor-cost export of ``n`` one-chunk tensors is made of, each step alone, in this process.

    The steps every export of them needs, done by the cheapest code at hand: parsing ``.metadata``
    (the native column reader, no cache; and the parsed-metadata cache hit that ``export`` uses,
    with the catalog), the safetensors header text (ckpttool's joined JSON of ``n`` entries, and
    ``json.dumps`` of the header dict), the index (``json.dumps`` of the weight map), and the
    bytes: every data file read once through a 1 MiB buffer (``preadv``, the archives hold the
    128-byte values 1.7 KB apart, so every page is read) and the output's bytes written in 1 MiB
    ``pwrite`` s into a ``fallocate`` d file; beside ``cp -r`` of the export's output (CPU seconds
    of that process).
    """
    from bench_inspect import make_many_entries_checkpoint

    sys.path.insert(0, str(ROOT))
    from ckpttool.format.mdscan import scan_metadata
    from ckpttool.model.checkpoint import open_checkpoint

    ckpt = root / f"many-{n}"
    if not (ckpt / ".metadata").is_file():
        make_many_entries_checkpoint(ckpt, n, 8, 0)
    _warm(ckpt)
    rows: list[tuple[str, float]] = []
    raw = (ckpt / ".metadata").read_bytes()
    c, md = _cpu_of(lambda: scan_metadata(raw, ".metadata"))
    rows.append((f"parse .metadata, native column reader, no cache ({len(raw) / 2**20:.0f} MiB)", c))
    del md
    _run_cpu([sys.executable, "-c", "from ckpttool.cli import main; main()", "inspect", str(ckpt), "--json"], cwd=ROOT)
    open_checkpoint(ckpt).close()  # the modules it imports, once
    c, ck = _cpu_of(lambda: open_checkpoint(ckpt))
    rows.append(("open: parsed-metadata cache hit + catalog (what export does)", c))
    out_bytes = _floor_documents(ck.reader.metadata.entries, rows)
    del ck
    files = [p for p in ckpt.iterdir() if p.name.endswith(".distcp")]
    nread, c_read, _ = _stream(files, lambda b: None)
    rows.append((f"bytes: read every data file once, 1 MiB preadv ({nread / 1e9:.2f} GB)", c_read))
    scratch = root / "many-floor"
    scratch.mkdir(exist_ok=True)
    c, _ = _write(scratch / "w.bin", out_bytes - out_bytes % (1 << 20), 1 << 20, allocate=True)
    rows.append((f"bytes: write model.safetensors ({out_bytes / 1e6:.0f} MB), 1 MiB pwrite s", c))
    shutil.rmtree(scratch, ignore_errors=True)
    total = sum(c for label, c in rows if not label.startswith("  ") and "no cache" not in label)
    lines = [f"many floor ({n} one-chunk tensors), CPU seconds of each step alone (load {os.getloadavg()[0]:.1f}):"]
    lines += [f"  {label:72s} {c:7.2f} s CPU" for label, c in rows]
    lines.append(f"  {'sum (cache hit, ckpttool header, index, bytes)':72s} {total:7.2f} s CPU")
    return lines


def _warm(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def _settle(warm: Path | None, scope: Path | None) -> None:
    """Put the page cache in the state every timed run starts from: no dirty pages (``os.sync``), none of the
    files under ``scope`` cached but ``warm`` 's (read in), so free memory is the same for every run.

    Without it a run finds cached whatever earlier runs left: another variant's kept output, earlier cases'
    checkpoints. At 4 GB a case (24 GiB machine) the run that finds another 4 GB output cached gets its
    page-cache folios from the DMA32 zone, wakes kswapd and stalls in compaction: a plain 4 GiB ``pwrite``
    loop took 2.7-4.3 CPU s so against ~1 s, and the second variant of each interleaved pair ran ~2x the CPU
    of the first with the same package in both (``docs/performance.md``, "Free memory between interleaved
    runs"). Only pages of files under ``scope`` (what this bench wrote) are dropped
    (``posix_fadvise(DONTNEED)`` of clean pages), not the machine's whole cache.
    """
    os.sync()  # no dirty pages of an earlier run left for this one to write back; clean pages can be dropped
    if scope is not None and scope.is_dir():
        keep = warm.resolve() if warm is not None else None
        for p in scope.resolve().rglob("*"):
            if keep is not None and (p == keep or keep in p.parents):
                continue
            try:
                if p.is_file() and not p.is_symlink():
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
            except OSError:
                pass  # removed under us, or not ours to read
    if warm is not None:
        _warm(warm)


def _mem_free_gib() -> float:
    """``MemFree`` of ``/proc/meminfo`` in GiB (0.0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemFree:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _output_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def _same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def load(d: Path) -> dict[str, str]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    out[k] = str(f)
        return out

    ma, mb = load(a), load(b)
    if set(ma) != set(mb):
        return False
    for k in ma:
        with safe_open(ma[k], "pt") as ha, safe_open(mb[k], "pt") as hb:
            ta, tb = ha.get_tensor(k), hb.get_tensor(k)
            if ta.dtype != tb.dtype or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
                return False
    return True


def _check_cast(ckpt: Path, out: Path, dtype: str, key: str) -> bool:
    """One exported tensor equals torch's own ``.to(dtype)`` of the stored tensor, bitwise."""
    import torch
    from safetensors import safe_open

    sys.path.insert(0, str(ROOT))
    from ckpttool.format.reader import CheckpointReader

    with CheckpointReader(ckpt) as r:
        want = r.read_tensor(key).to(getattr(torch, dtype))
    name = key[len("model.") :]
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            if name in h.keys():
                got = h.get_tensor(name)
                return bool(torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)))
    return False


# ------------------------------------------------------------------------------------------ cases


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, int, int, str, float | None]] = []

    def add(
        self, case: str, approach: str, seconds: float, rss: int, nbytes: int, note: str = "", cpu: float | None = None
    ) -> None:
        self.rows.append((case, approach, seconds, rss, nbytes, note, cpu))

    def print(self) -> None:
        print(f"{'case':22s} {'approach':48s} {'seconds':>8s} {'GB/s':>7s} {'CPU s':>7s} {'peak RSS':>10s}  note")
        for case, approach, s, rss, nb, note, cpu in self.rows:
            rss_s = f"{rss / 2**20:.0f} MiB" if rss else "-"
            cpu_s = f"{cpu:.2f}" if cpu is not None else "-"
            print(f"{case:22s} {approach:48s} {s:8.2f} {nb / s / 1e9:7.3f} {cpu_s:>7s} {rss_s:>10s}  {note}")


def _same_files(a: Path, b: Path) -> bool:
    """Every file of ``a`` and ``b`` (one level) byte-identical (what ``cmp`` says), the marker file aside."""
    import filecmp

    names = sorted(p.name for p in a.iterdir() if p.is_file() and not p.name.startswith("."))
    if names != sorted(p.name for p in b.iterdir() if p.is_file() and not p.name.startswith(".")):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def _child_env(package: Path) -> dict[str, str]:
    """The environment of a child that imports ckpttool from ``package`` (a directory holding ``ckpttool/``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(package), env.get("PYTHONPATH", "")) if p)
    return env


def _best(
    cmd: list[str], out: Path | None, repeat: int, warm: Path | None, mkdir: bool = False, scope: Path | None = None
) -> tuple[float, int, str, float]:
    """Fastest wall of ``repeat`` runs, the largest peak RSS, the last stdout, the smallest CPU.

    Each run starts from :func:`_settle` (``warm`` cached, the rest of ``scope`` not)."""
    runs = []
    for _ in range(repeat):
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
            if mkdir:
                out.mkdir()
        _settle(warm, scope)
        runs.append(_run(cmd))
    return min(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2], min(r[3] for r in runs)


def _export_case(
    args: argparse.Namespace, table: Table, notes: list[str], case: str, ckpt: Path, flags: list[str], check: Any = None
) -> None:
    """One transforming (or verbatim) export beside ``cp -r`` of its output; with ``--baseline``, the
    baseline package's export of the same case interleaved with this one (and its bytes compared)."""
    root: Path = args.root
    # the program as installed (`-m`: its entry point); -P: the current directory (the repository) is not put
    # before PYTHONPATH, where it would shadow --baseline's package
    cli = [sys.executable, "-P", "-m", "ckpttool"]
    cmd = [*cli, "export", str(ckpt), "{out}", "--shard-size", args.shard_size, "--json", *flags]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    variants = {"": _child_env(ROOT)}
    if args.baseline is not None:
        variants = {"before: ": _child_env(args.baseline.resolve()), "": variants[""]}
    for n in args.slab_bytes or []:  # this tree with other slab sizes (CKPTTOOL_SLAB_BYTES), interleaved
        variants[f"slab {n >> 10} KiB: "] = dict(_child_env(ROOT), CKPTTOOL_SLAB_BYTES=str(n))
    runs: dict[str, list[tuple[float, int, str, float]]] = {k: [] for k in variants}
    free: list[float] = []
    for _ in range(args.repeat):  # interleaved: the same load on average
        for label, env in variants.items():
            out = root / f"out{'-before' if label == 'before: ' else '-slab' if label else ''}"
            shutil.rmtree(out, ignore_errors=True)
            # the same page cache for every variant: the other variants' kept outputs and earlier cases'
            # checkpoints dropped, this checkpoint warm (else the second variant of each pair runs short of memory)
            _settle(ckpt, root)
            free.append(_mem_free_gib())
            runs[label].append(_run([a.replace("{out}", str(out)) for a in cmd], env))
    out = root / "out"
    nbytes = _output_bytes(out)
    c, crss, _, ccpu = _best(
        ["cp", "-r", str(out), str(root / "out-cp")], root / "out-cp", args.repeat, out, False, root
    )
    shutil.rmtree(root / "out-cp", ignore_errors=True)
    for label, rs in runs.items():
        s, rss, cpu = min(r[0] for r in rs), max(r[1] for r in rs), min(r[3] for r in rs)
        doc = json.loads(min(rs, key=lambda r: r[0])[2])  # the fastest run's own figure
        note = f"{c / s:.0%} of cp -r; CPU {ccpu / cpu:.0%} of cp's"
        table.add(case, f"{label}ckpttool export {' '.join(flags)}".strip(), s, rss, nbytes, note, cpu)
        table.add(case, f"  {label}in-process (--json seconds)", doc["seconds"], 0, nbytes)
    table.add(case, "  cp -r of the output (baseline)", c, crss, nbytes, "", ccpu)
    notes.append(f"{case}: free memory as the export runs started: {min(free):.1f}-{max(free):.1f} GiB")
    if args.baseline is not None:
        notes.append(f"{case}: output byte-identical to the baseline's (cmp): {_same_files(out, root / 'out-before')}")
        shutil.rmtree(root / "out-before", ignore_errors=True)
    if check is not None:
        notes.append(f"{case}: output equals torch's .to() bitwise: {check(out)}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root / "out-slab", ignore_errors=True)


def _torch_baselines(args: argparse.Namespace, table: Table, notes: list[str], llama: Path, shard_bytes: int) -> None:
    root: Path = args.root
    cli = [sys.executable, "-P", "-m", "ckpttool"]
    outs = {n: root / n for n in ("ck", "a", "b")}
    _run([*cli, "export", str(llama), str(outs["ck"]), "--shard-size", args.shard_size])
    tmp_pt = root / "a.pt"
    nbytes = _output_bytes(outs["ck"])
    s, rss, _, cpu = _best(
        [sys.executable, "-c", BASELINE_A, str(llama), str(tmp_pt), str(outs["a"])], outs["a"], 1, llama, True, root
    )
    tmp_pt.unlink(missing_ok=True)
    table.add("preserve", "(a) dcp_to_torch_save + save_file", s, rss, nbytes, "", cpu)
    s, rss, _, cpu = _best(
        [sys.executable, "-c", BASELINE_B, str(llama), str(outs["b"]), str(shard_bytes)],
        outs["b"],
        args.repeat,
        llama,
        True,
        root,
    )
    table.add("preserve", "(b) per-shard dcp.load + save_file", s, rss, nbytes, "", cpu)
    notes.append(f"preserve: ckpttool output == (b) output: {_same_tensors(outs['ck'], outs['b'])}")
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------ phases


def _data_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))


def _per_gb(label: str, nbytes: int, cpu: float, wall: float, note: str = "") -> None:
    print(f"  {label:52s} {nbytes / 1e9:6.2f} GB  {cpu / (nbytes / 1e9):6.3f} CPU s/GB  ({wall:.2f} s wall)  {note}")


def _stream(files: list[Path], per_block: Any) -> tuple[int, float, float]:
    """Read every file through one 1 MiB buffer (``preadv``, as the engine), ``per_block(view)`` on each
    block; (bytes, CPU seconds of this thread, wall seconds)."""
    import numpy as np

    buf = np.empty(1 << 20, dtype=np.uint8)
    mv = memoryview(buf)
    n, c0, w0 = 0, time.thread_time(), time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            size, off = os.fstat(fd).st_size, 0
            while off < size:
                got = os.preadv(fd, [mv[: min(len(mv), size - off)]], off)
                per_block(buf[: got - got % 4])
                off += got
            n += size
        finally:
            os.close(fd)
    return n, time.thread_time() - c0, time.perf_counter() - w0


def _mapped(files: list[Path], per_block: Any) -> tuple[int, float, float]:
    """As :func:`_stream`, but each file mapped read-only (``mmap``) and ``per_block`` called on 1 MiB views of
    the mapping: page faults map the page cache's pages instead of a copy into a buffer."""
    import mmap

    n, c0, w0 = 0, time.thread_time(), time.perf_counter()
    for f in files:
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            mv = memoryview(m)
            size = len(mv)
            for off in range(0, size, 1 << 20):
                per_block(mv[off : min(size, off + (1 << 20))])
            mv.release()
            n += size
    return n, time.thread_time() - c0, time.perf_counter() - w0


def _write(
    path: Path, nbytes: int, step: int, *, allocate: bool, direct: bool = False, behind: int = 0
) -> tuple[float, float]:
    """Write ``nbytes`` to a new file in ``step``-byte ``pwrite`` s; (CPU seconds of this thread, wall).

    ``behind``: start the disk write-back of every ``behind`` bytes as they are written
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, :func:`ckpttool.engine.io.start_writeback`).
    """
    import mmap

    from ckpttool.engine.io import start_writeback

    buf = mmap.mmap(-1, step)  # page-aligned (O_DIRECT needs it)
    buf.write(b"\x5a" * step)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags, 0o644)
    c0, w0 = time.thread_time(), time.perf_counter()
    try:
        if allocate:
            os.posix_fallocate(fd, 0, nbytes)
        for off in range(0, nbytes - nbytes % step, step):
            os.pwrite(fd, buf, off)
            if behind and (off + step) % behind == 0:
                start_writeback(fd, off + step - behind, behind)
    finally:
        os.close(fd)
    out = time.thread_time() - c0, time.perf_counter() - w0
    path.unlink()
    return out


def phases(ckpt: Path, scratch: Path) -> None:
    """CPU seconds per GB of each phase of a cast export, one thread, on ``ckpt``'s data files (warm cache)."""
    import zlib

    import numpy as np
    import torch
    from isal import isal_zlib

    sys.path.insert(0, str(ROOT))
    from ckpttool.engine.kernels import f32_to_bf16
    from ckpttool.engine.native import lib as native_lib

    files = _data_files(ckpt)
    _warm(ckpt)
    print(f"\nphases, one thread, warm page cache ({ckpt.name}; load {os.getloadavg()[0]:.1f}):")
    n, c_read, w = _stream(files, lambda b: None)
    _per_gb("read (preadv, 1 MiB buffer)", n, c_read, w)
    crc = [0]
    n, c, w = _stream(files, lambda b: crc.__setitem__(0, isal_zlib.crc32(b, crc[0])))
    _per_gb("  + CRC-32, isal", n, c - c_read, w, f"(read + CRC {c / (n / 1e9):.3f})")
    c_crc = c / (n / 1e9)
    n, c, w = _stream(files, lambda b: crc.__setitem__(0, zlib.crc32(b, crc[0])))
    _per_gb("  + CRC-32, zlib", n, c - c_read, w)
    n, c, w = _mapped(files, lambda b: crc.__setitem__(0, isal_zlib.crc32(b, crc[0])))
    _per_gb("mmap read-only + CRC-32, isal (no read copy)", n, c, w, f"(against preadv + CRC {c_crc:.3f})")
    out = np.empty(1 << 19, dtype=np.uint16)
    native = native_lib() is not None
    if native:
        n, c, w = _stream(files, lambda b: f32_to_bf16(b.view(np.uint32), out[: b.size // 4]))
        _per_gb("  + cast FP32 -> BF16, native (ckpttool's kernel)", n, c - c_read, w)
    n, c, w = _stream(files, lambda b: f32_to_bf16(b.view(np.uint32), out[: b.size // 4], use_torch=False))
    label = "numpy (the fallback)" if native else "numpy (ckpttool's kernel; native not built)"
    _per_gb(f"  + cast FP32 -> BF16, {label}", n, c - c_read, w)
    torch.set_num_threads(1)
    out_t = torch.from_numpy(out).view(torch.bfloat16)
    n, c, w = _stream(files, lambda b: out_t[: b.size // 4].copy_(torch.from_numpy(b).view(torch.float32)))
    _per_gb("  + cast FP32 -> BF16, torch .copy_ (1 thread)", n, c - c_read, w, "(needs `import torch`)")
    w, _, _, c = _run([sys.executable, "-c", "import torch"])
    print(f"  {'`import torch`, a fresh process':52s} {c:.2f} CPU s ({w:.2f} s wall), once per process")
    half = n // 2 - (n // 2) % (1 << 20)
    scratch.mkdir(parents=True, exist_ok=True)
    variants = (
        ("write 512 KiB pwrites, fallocate first (ckpttool)", 1 << 19, True, False, 0),
        ("write 512 KiB pwrites, no fallocate", 1 << 19, False, False, 0),
        ("write 4 MiB pwrites, fallocate first", 4 << 20, True, False, 0),
        ("write 512 KiB pwrites, write-behind every 8 MiB", 1 << 19, True, False, 8 << 20),
        ("write 4 MiB pwrites, O_DIRECT (the disk; 256 MiB)", 4 << 20, True, True, 0),
    )
    got: dict[str, list[tuple[int, float, float]]] = {}
    for _ in range(3):  # interleaved, the least CPU of 3: a run that meets page reclaim costs several times more
        for label, step, allocate, direct, behind in variants:
            size = min(half, 256 << 20) if direct or behind else half
            try:
                c, w = _write(scratch / "phase.bin", size, step, allocate=allocate, direct=direct, behind=behind)
            except OSError as e:
                print(f"  {label}: {e.strerror}")
                continue
            got.setdefault(label, []).append((size, c, w))
    for label, runs in got.items():
        size, c, w = min(runs, key=lambda r: r[1])
        _per_gb(label, size, c, w, f"{size / w / 1e9:.2f} GB/s (least CPU of {len(runs)})")


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-export"))
    ap.add_argument("--shard-size", default="256MB", help="output shard size for ckpttool and (b)")
    ap.add_argument("--workers", type=int, default=None, help="ckpttool --workers (default: its own)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per approach; the fastest is reported")
    ap.add_argument("--big-gib", type=float, default=0.0, help="also the cast case on an FP32 model of this many GB")
    ap.add_argument("--skip-torch", action="store_true", help="leave out the torch baselines (a) and (b)")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding another revision's ckpttool/ package (git archive REV ckpttool | tar -x -C DIR):"
        " its export of every case runs interleaved with this one's, outputs compared byte for byte",
    )
    ap.add_argument(
        "--only", nargs="*", help="cases to run: preserve cast master per-expert fused big small phases many many-floor"
    )
    ap.add_argument(
        "--slab-bytes",
        type=int,
        nargs="*",
        help="also run this tree's export of each case with these slab sizes (CKPTTOOL_SLAB_BYTES), interleaved",
    )
    ap.add_argument("--many", type=int, default=100_000, help="one-chunk tensors of the many case")
    ap.add_argument("--many-baseline", type=Path, default=None, help="another copy of the package for the many case")
    args = ap.parse_args()
    import compileall

    sys.path.insert(0, str(ROOT))
    import ckpttool
    from ckpttool.ui.options import parse_size

    # as `pip install` does: start-up is measured with bytecode caches, also under PYTHONDONTWRITEBYTECODE
    compileall.compile_dir(os.path.dirname(ckpttool.__file__), quiet=1)
    if args.baseline is not None:
        compileall.compile_dir(str(args.baseline / "ckpttool"), quiet=1)
    shard_bytes = parse_size(args.shard_size, "--shard-size")
    root: Path = args.root
    root.mkdir(parents=True, exist_ok=True)
    want = set(args.only or ["preserve", "cast", "master", "per-expert", "fused", "big", "small", "phases"])
    table = Table()
    notes: list[str] = []
    cli = [sys.executable, "-P", "-m", "ckpttool"]
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())

    if want & {"preserve", "master"}:
        llama = build(root / "ckpt", dense_rank, 2, "bfloat16", True)
        disk = sum(p.stat().st_size for p in llama.iterdir() if p.is_file())
        notes.append(f"preserve/master: {disk / 2**30:.2f} GiB on disk ({WORLD} ranks), BF16 model + FP32 state")
    if "preserve" in want:
        _export_case(args, table, notes, "preserve", llama, [])
        if not args.skip_torch:
            _torch_baselines(args, table, notes, llama, shard_bytes)
    if "master" in want:
        _export_case(args, table, notes, "master cast", llama, ["--weights", "master", "--save-dtype", "bfloat16"])
    if want & {"cast", "phases"}:
        fp32 = build(root / "fp32-1g", dense_rank, 2, "float32", False)
    if "cast" in want:
        _export_case(
            args,
            table,
            notes,
            "cast 1 GB fp32->bf16",
            fp32,
            ["--save-dtype", "bfloat16"],
            lambda out: _check_cast(fp32, out, "bfloat16", "model.model.layers.1.mlp.down_proj.weight"),
        )
    if want & {"per-expert", "fused"}:
        moe = build(root / "moe-legacy", moe_legacy_rank)
    if "per-expert" in want:
        _export_case(args, table, notes, "MoE per-expert", moe, ["--experts", "per-expert"])
    if "fused" in want:
        _export_case(args, table, notes, "MoE fused un-permuted", moe, ["--experts", "fused"])
    if "big" in want and args.big_gib > 0:
        layers = layers_for(args.big_gib, 4)
        big = build(root / f"fp32-{args.big_gib:g}g", dense_rank, layers, "float32", False)
        _export_case(args, table, notes, f"cast {args.big_gib:g} GB fp32->bf16", big, ["--save-dtype", "bfloat16"])
    if "moe-big" in (args.only or []) and args.big_gib > 0:
        layers = max(1, round(args.big_gib * 1e9 / (3 * MOE_E * MOE_I * MOE_H * 2)))  # BF16 gate_up + down a layer
        moe_big = build(root / f"moe-legacy-{args.big_gib:g}g", moe_legacy_rank, layers)
        for experts in ("per-expert", "fused"):
            _export_case(args, table, notes, f"MoE {args.big_gib:g} GB {experts}", moe_big, ["--experts", experts])
    if "many" in (args.only or []):
        notes += _many_case(root, args.many, args.repeat, args.many_baseline)
    if "many-floor" in (args.only or []):
        notes += _many_floor(root, args.many)
    if "small" in want:
        sample = root / "sample"
        if not (sample / ".metadata").is_file():
            _run([*cli, "sample", str(sample)])
        out = root / "out-small"
        s, rss, _, cpu = _best(
            [*cli, "export", str(sample), str(out), "--json"], out, max(args.repeat, 5), sample, False, root
        )
        p, prss, _, pcpu = _best([sys.executable, "-c", "pass"], None, max(args.repeat, 5), None, False, root)
        nbytes = _output_bytes(out)
        note = f"fixed cost {s - p:.3f} s (target <= 0.15 s)"
        table.add("small (sample)", "ckpttool export", s, rss, nbytes, note, cpu)
        table.add("small (sample)", "  python -c pass (baseline)", p, prss, nbytes, "", pcpu)
        shutil.rmtree(out, ignore_errors=True)

    load1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPUs; load average {load0} before, {load1} after; best of {args.repeat}")
    table.print()
    for n in notes:
        print(n)
    print(
        "targets: transforming exports >= 80% of cp -r at >= 4 GB, >= 50% at 1 GB; peak RSS <= 256 MiB + one slab per worker"
    )
    if "phases" in want:
        phases(fp32, root / "phases")


if __name__ == "__main__":
    main()
