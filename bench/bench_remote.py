"""Benchmark object-storage reads and torchrun runs, each beside its baseline, in one run.

1. **Remote export** from a local S3 server (moto's standalone server on 127.0.0.1, started
   here): ``export s3://.../ckpt OUT`` (verbatim chunk copies; every chunk fetched by a range
   request of exactly its window, ``--remote-workers W``) beside a plain boto3
   ``download_file`` of the same ``.distcp`` objects with the same concurrency (``W`` objects
   at a time, each with ``TransferConfig(max_concurrency=1)``); target: >= 70% of its
   throughput. Also bytes requested vs bytes needed (the chunk windows + ``.metadata``; target:
   equal). Both in-process, wall seconds, GB/s = 10^9 bytes/s of checkpoint data.
2. **2 processes vs 1** (``torchrun --nproc-per-node 2 -m ckpttool ...`` vs ``python -m
   ckpttool ...``, wall seconds including start-up) on CPU-bound cases: a cast export
   (FP32 -> BF16), ``--experts per-expert`` of a legacy-layout MoE, and ``validate --deep``
   (CRC-32 and summaries of every chunk); target >= 1.6x on 2 cores.
3. **2 ranks vs 1 by CPU** (``--only procs-cpu``): a cast export and ``validate --strict --deep``
   of BF16 parameters with FP32 masters and moments, the work alone timed inside each process
   (``bench/_work_cpu.py``): the single process's CPU seconds over the busiest rank's is the
   speed-up 2 free cores give a CPU-bound run, a figure the load barely moves; target >= 1.7x.

The load average is printed with the figures (the machine may be shared).

Usage::

    python bench/bench_remote.py [--root /tmp/ckpttool-bench-remote] [--workers 8] [--repeat 2]
                                 [--only remote|procs|procs-cpu|startup]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _ckpts import build, dense_rank, layers_for, moe_legacy_rank  # noqa: E402


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def remote(root: Path, workers: int, repeat: int) -> None:
    from tests.fixtures.s3 import S3Server

    ckpt = build(root / "fp32-1layer", dense_rank, 1, "float32", False)
    data = sorted(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    total = sum(p.stat().st_size for p in data)
    srv = S3Server().start()
    try:
        t0 = time.perf_counter()
        url = srv.upload_dir(ckpt, "bench", "ckpt")
        print(f"# uploaded {total / 1e9:.2f} GB to the local S3 server in {time.perf_counter() - t0:.1f} s")
        from boto3.s3.transfer import TransferConfig

        from ckpttool.format.storage import storage_config
        from ckpttool.model.checkpoint import open_checkpoint
        from ckpttool.ops.export import export_checkpoint

        client = srv.client()
        cfg = TransferConfig(max_concurrency=1, use_threads=False)
        rows = []
        for _ in range(repeat):
            tmp = Path(tempfile.mkdtemp(dir=root))
            t0 = time.perf_counter()

            def fetch(p: Path, d: Path = tmp) -> None:
                client.download_file("bench", f"ckpt/{p.name}", str(d / p.name), Config=cfg)

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(fetch, data))
            t_boto = time.perf_counter() - t0
            shutil.rmtree(tmp)
            out = root / "out-remote"
            shutil.rmtree(out, ignore_errors=True)
            with storage_config(options=srv.options(), workers=workers):
                t0 = time.perf_counter()
                ck = open_checkpoint(url)
                try:
                    export_checkpoint(ck, out)
                    stats = ck.reader.remote_stats()
                    # every chunk is exported here (a model-only checkpoint): its windows + .metadata
                    needed = sum(s.length for s in ck.metadata.storage.values()) + ck.reader.file_size(".metadata")
                finally:
                    ck.close()
                t_ck = time.perf_counter() - t0
            assert stats is not None
            rows.append((t_boto, t_ck, stats, needed))
        t_boto, t_ck, stats, needed = min(rows, key=lambda r: r[1])
        print(
            f"\n## remote export, {total / 1e9:.2f} GB of .distcp on a local S3 server, {workers} at a time (load {load()})"
        )
        print("| approach | seconds | GB/s | requests | bytes requested |")
        print("|---|---|---|---|---|")
        print(
            f"| boto3 download_file of the .distcp objects | {t_boto:.2f} | {total / t_boto / 1e9:.2f} | {len(data)} objects | {total} |"
        )
        print(
            f"| ckpttool export s3:// (range requests) | {t_ck:.2f} | {total / t_ck / 1e9:.2f} | {stats['requests']} | "
            f"{stats['bytes_requested']} |"
        )
        print(f"ratio {t_boto / t_ck:.0%} of boto3 (target >= 70%); bytes requested {stats['bytes_requested']} vs "
              f"needed {needed} (chunk windows + .metadata): {'equal' if stats['bytes_requested'] == needed else 'DIFFERENT'}")  # fmt: skip
    finally:
        srv.stop()


def run(cmd: list[str]) -> tuple[float, float, float, float]:
    """Wall seconds, the command's own ``seconds`` (rank 0's ``--json``: the work, without start-up),
    and the CPU seconds (user, system) of every process of the run (torchrun and its ranks)."""
    import json
    import resource

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime)
    if r.returncode not in (0, 1):
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    doc = json.loads(r.stdout)
    return wall, float(doc.get("seconds") or doc["stats"]["seconds"]), *cpu


def procs(root: Path, repeat: int, gb: float) -> None:
    layers = layers_for(gb, 4)
    fp32 = build(root / f"fp32-{layers}layer", dense_rank, layers, "float32", False)
    moe_layers = max(1, round(gb / 0.2))
    moe = build(root / f"moe-legacy-{moe_layers}layer", moe_legacy_rank, moe_layers)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cases = [
        ("cast export FP32 -> BF16", fp32, ["export", "{ckpt}", "{out}", "--save-dtype", "bfloat16", "--shard-size", "100MB"]),
        ("export --experts per-expert", moe, ["export", "{ckpt}", "{out}", "--experts", "per-expert", "--shard-size", "100MB"]),
        ("validate --deep (CRC-32)", moe, ["validate", "{ckpt}", "--deep"]),
    ]  # fmt: skip
    print(f"\n## 2 processes vs 1 (torchrun, gloo; load {load()})")
    print("seconds: wall (incl. interpreter, torch.distributed and torchrun start-up) / the run's own `seconds` (work)")
    print("| case | data GB | 1 process, 1 thread | 2 processes, 1 thread each | speed-up (work) | 1 process, 2 threads | 2 processes, 2 threads each | speed-up (work) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    port = 29700
    cpu_rows = []
    capacity: list[str] = []
    for name, ckpt, tmpl in cases:
        nbytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.name.endswith(".distcp"))
        cells: list[str] = []
        cpu_cells: list[str] = []
        for threads in ("1", "2"):
            best: dict[int, tuple[float, float, float, float]] = {}
            # alternated (1, 2, 1, 2, ...): both see the same page-cache state and load on average
            for _ in range(repeat):
                for n in (1, 2):
                    out = root / f"out-{n}"
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(root / f"out-{3 - n}", ignore_errors=True)  # the other run's pages freed
                    args = [a.format(ckpt=ckpt, out=out) for a in tmpl] + ["--workers", threads]
                    port += 1
                    cmd = (
                        [sys.executable, "-m", "ckpttool", *args]
                        if n == 1
                        else [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                              str(port), "-m", "ckpttool", *args]
                    )  # fmt: skip
                    got = run(cmd)
                    if n not in best or got[1] < best[n][1]:
                        best[n] = got
            one, two = best[1], best[2]
            if threads == "1":  # baseline: two independent single-process runs at once (the machine's capacity)
                pairs = []
                for _ in range(repeat):
                    outs = [root / "out-a", root / "out-b"]
                    for o in (*outs, root / "out-1", root / "out-2"):
                        shutil.rmtree(o, ignore_errors=True)
                    t0 = time.perf_counter()
                    procs_ = [
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "ckpttool",
                                *[a.format(ckpt=ckpt, out=o) for a in tmpl],
                                "--workers",
                                "1",
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                        )
                        for o in outs
                    ]
                    for p_ in procs_:
                        p_.wait()
                    pairs.append(time.perf_counter() - t0)
                    for o in outs:
                        shutil.rmtree(o, ignore_errors=True)
                capacity.append(f"| {name} | {one[0]:.2f} | {min(pairs):.2f} | {2 * one[0] / min(pairs):.2f}x |")
            cells += [f"{one[0]:.2f} / {one[1]:.2f}", f"{two[0]:.2f} / {two[1]:.2f}", f"{one[1] / two[1]:.2f}x"]
            cpu_cells += [f"{one[2]:.2f} / {one[3]:.2f}", f"{two[2]:.2f} / {two[3]:.2f}"]
        print(f"| {name} | {nbytes / 1e9:.2f} | " + " | ".join(cells) + " |")
        cpu_rows.append(f"| {name} | " + " | ".join(cpu_cells) + " |")
    print(f"(load average after: {load()}; target >= 1.6x on 2 cores)")
    print("\nCPU seconds of those runs, user / system, every process (torchrun and its ranks included):")
    print(
        "| case | 1 process, 1 thread | 2 processes, 1 thread each | 1 process, 2 threads | 2 processes, 2 threads each |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(cpu_rows))
    print("\nBaseline, the machine's capacity for 2 processes now: two independent single-process runs of the")
    print("whole command at once (1 thread each) vs one alone; wall seconds, throughput ratio (2 x alone / together):")
    print("| case | one alone | two at once | throughput ratio |")
    print("|---|---|---|---|")
    print("\n".join(capacity))


def procs_cpu(root: Path, repeat: int, gb: float) -> None:
    """2 ranks vs 1 process by the CPU seconds of the work alone (``bench/_work_cpu.py``): load-robust.

    On a quiet machine a CPU-bound run of one thread per process takes its CPU time, so the
    speed-up of 2 ranks on 2 free cores is the single process's work CPU over the busiest rank's;
    ``sum/one`` is the CPU the split adds (planning on every rank, the barrier, rank 0's index).
    Wall seconds of the work are printed beside (meaningful only when the load is below 2).
    """
    import json

    layers = layers_for(gb, 4)
    fp32 = build(root / f"fp32-{layers}layer", dense_rank, layers, "float32", False)
    bf16_layers = layers_for(gb / 7, 2)  # BF16 parameters + FP32 masters and moments: 14 bytes a parameter
    mixed = build(root / f"bf16-optim-{bf16_layers}layer", dense_rank, bf16_layers, "bfloat16", True)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    script = str(ROOT / "bench" / "_work_cpu.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"\n## 2 ranks vs 1 process, CPU of the work (1 thread each; load {load()})")
    print("| case | data GB | 1 process: work wall s, CPU s | 2 ranks: work wall s, CPU s per rank | speed-up by CPU (one / busiest rank) | CPU sum / one | speed-up by wall |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    port = 29900
    for name, kind, ckpt in (
        ("cast export FP32 -> BF16", "cast", fp32),
        ("validate --strict --deep (FP32 masters)", "deep", mixed),
    ):
        nbytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.name.endswith(".distcp"))
        best: dict[int, list[dict[str, float]]] = {}
        for _ in range(repeat):  # alternated: both see the same page-cache state and load on average
            for n in (1, 2):
                out = root / f"out-cpu-{n}"
                shutil.rmtree(out, ignore_errors=True)
                port += 1
                launch = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
                cmd = [*(launch if n == 2 else [sys.executable]), script, kind, str(ckpt), str(out), "1"]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env)
                shutil.rmtree(out, ignore_errors=True)
                if r.returncode != 0:
                    raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
                ranks = sorted(
                    (json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")), key=lambda d: d["rank"]
                )
                cpu = max(d["user"] + d["sys"] for d in ranks)
                if n not in best or cpu < max(d["user"] + d["sys"] for d in best[n]):
                    best[n] = ranks
        one = best[1][0]
        c1 = one["user"] + one["sys"]
        c2 = [d["user"] + d["sys"] for d in best[2]]
        w2 = max(d["wall"] for d in best[2])
        print(
            f"| {name} | {nbytes / 1e9:.2f} | {one['wall']:.2f}, {c1:.2f} | {w2:.2f}, "
            + " + ".join(f"{c:.2f}" for c in c2)
            + f" | {c1 / max(c2):.2f}x | {sum(c2) / c1:.2f} | {one['wall'] / w2:.2f}x |"
        )
    print(f"(load average after: {load()}; best of {repeat} by CPU; target >= 1.7x)")


# One torchrun worker, timed: what ckpttool's entry point does (import torch.distributed, join the
# gloo group, run the command, leave the group), each step stamped with time.time() into a JSON file.
_STAMPED = """\
import json, os, sys, time
stamps = {"start": time.time()}
import torch.distributed as dist
stamps["import torch.distributed"] = time.time()
if sys.argv[1:]:
    from ckpttool.cli.app import main as ckpttool_main
    stamps["import ckpttool"] = time.time()
dist.init_process_group("gloo")
stamps["init_process_group (rendezvous)"] = time.time()


def done(code):
    stamps["command (incl. destroy_process_group)"] = time.time()
    with open(os.environ["STAMPS"] + "." + os.environ["RANK"], "w") as f:
        json.dump(stamps, f)
    return code


if sys.argv[1:]:
    sys.argv = ["ckpttool", *sys.argv[1:]]
    real_exit = os._exit
    os._exit = lambda code: real_exit(done(code))  # ckpttool's ranks leave by os._exit
    ckpttool_main()  # joins the group already initialised, runs the command, leaves the group
else:
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(done(0))
"""


def startup(root: Path, gb: float) -> None:
    """Where a torchrun run's fixed start-up goes: launcher, worker imports, rendezvous, the command, exit."""
    import json

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    script = root / "stamped_worker.py"
    script.write_text(_STAMPED)
    moe = build(root / f"moe-legacy-{max(1, round(gb / 0.2))}layer", moe_legacy_rank, max(1, round(gb / 0.2)))
    cases = [
        ("no-op (join gloo, barrier, leave)", []),
        ("ckpttool inspect (reads .metadata)", ["inspect", str(moe), "--json"]),
        ("ckpttool export --experts per-expert", ["export", str(moe), str(root / "out-st"), "--experts", "per-expert", "--shard-size", "100MB", "--json"]),
    ]  # fmt: skip
    print(f"\n## torchrun start-up, 2 processes (load {load()}); seconds from launching torchrun")
    print("| case | worker started | + import torch.distributed | + import ckpttool | + rendezvous | + command | exit of workers and torchrun | wall |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for i, (name, args) in enumerate(cases):
        shutil.rmtree(root / "out-st", ignore_errors=True)
        stamps = root / "stamps"
        for k in range(2):
            Path(f"{stamps}.{k}").unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "STAMPS": str(stamps)}
        cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(29650 + i)]
        t0 = time.time()
        r = subprocess.run([*cmd, str(script), *args], capture_output=True, text=True, env=env)
        t_end = time.time()
        if r.returncode != 0:
            raise SystemExit(f"failed: {name}\n{r.stderr[-2000:]}")
        ranks = [json.loads(Path(f"{stamps}.{k}").read_text()) for k in range(2)]
        keys = list(ranks[0])
        cells, prev = [], t0
        for k in keys:  # the later rank at each step (the run waits for it)
            at = max(rk[k] for rk in ranks)
            cells.append(f"{at - prev:.2f}")
            prev = at
        if not args:
            cells.insert(2, "-")
        cells.append(f"{t_end - prev:.2f}")
        print(f"| {name} | " + " | ".join(cells) + f" | {t_end - t0:.2f} |")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    t_imp = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckpttool", "inspect", str(moe), "--json"], check=True, capture_output=True)
    t_ck = time.perf_counter() - t0
    print(
        f"(one process alone: `python -c 'import torch.distributed'` {t_imp:.2f} s; `ckpttool inspect` without torchrun {t_ck:.2f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-remote"))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", choices=["remote", "procs", "procs-cpu", "startup"])
    ap.add_argument("--gb", type=float, default=4.0, help="size of the 2-processes-vs-1 checkpoints (GB)")
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    print(f"# {os.cpu_count()} CPUs, load average {load()}")
    if args.only in (None, "remote"):
        remote(args.root, args.workers, args.repeat)
    if args.only in (None, "startup"):
        startup(args.root, args.gb)
    if args.only in (None, "procs"):
        procs(args.root, args.repeat, args.gb)
    if args.only in (None, "procs-cpu"):
        procs_cpu(args.root, args.repeat, args.gb)


if __name__ == "__main__":
    main()
