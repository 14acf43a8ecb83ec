"""Benchmark: ``--step latest`` discovery (``ckpttool.model.discovery.locate``) over a run root of many step
directories on local disk.

Builds, once per layout and count, a run root whose every step directory holds a real checkpoint (one small
``dcp.save`` of a model and an optimizer, written once; its files hard-linked into every step, so the tree costs
no data): ``step-N/`` (torchtitan-style, one folder per step) and ``checkpoint-N/pytorch_model_fsdp_0/`` +
``optimizer_0/`` (Accelerate's pair, three directories per step). Then times ``locate(root, step="latest")``
in-process (median wall and CPU time of ``--runs``, after one warm-up run that fills the OS's directory cache; CPU
time is the figure to compare on a loaded machine) and its peak Python memory (``tracemalloc``), and prints the
step it chose.

Usage: python bench/bench_discovery.py [--counts 10000 30000] [--layouts step accelerate] [--runs 5]
       [--workdir /tmp/ckpttool-bench-discovery]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: a build given there is measured

FOLDERS = {"step": ("",), "accelerate": ("pytorch_model_fsdp_0", "optimizer_0")}
STEP_NAME = {"step": "step-{}", "accelerate": "checkpoint-{}"}


def _source(work: Path) -> Path:
    """One small dcp.save of a model and an optimizer state (written once)."""
    src = work / "source"
    if (src / ".metadata").is_file():
        return src
    import torch
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(src))
    return src


def build(work: Path, layout: str, count: int) -> Path:
    """The run root of ``count`` steps of ``layout`` (cached under ``work``)."""
    root = work / f"{layout}-{count}"
    done = root / ".built"
    if done.is_file():
        return root
    src = _source(work)
    files = sorted(p for p in src.iterdir() if p.is_file())
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, count + 1):
        step = root / STEP_NAME[layout].format(n * 10)
        for folder in FOLDERS[layout]:
            d = step / folder if folder else step
            d.mkdir(parents=True, exist_ok=True)
            for f in files:
                if not (d / f.name).exists():
                    try:
                        os.link(f, d / f.name)
                    except OSError:  # the file system's link count reached (ext4: 65,000)
                        shutil.copyfile(f, d / f.name)
    done.write_text("")
    return root


def measure(root: Path, runs: int) -> tuple[float, float, float, str]:
    """(median wall seconds, median CPU seconds, peak MiB, the chosen checkpoint's directory) of
    ``locate(root, step="latest")``."""
    from ckpttool.model.discovery import CheckpointSelection, locate

    sel = CheckpointSelection(step="latest")
    found = locate(root, sel)  # warm-up: the OS's directory cache
    times, cpu = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        locate(root, sel)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    tracemalloc.start()
    locate(root, sel)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(times), statistics.median(cpu), peak, str(found.model.relative_to(root))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[10_000, 30_000])
    ap.add_argument("--layouts", nargs="+", default=list(FOLDERS), choices=list(FOLDERS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench-discovery"))
    args = ap.parse_args()
    from ckpttool.errors import CkptError

    for layout in args.layouts:
        for count in args.counts:
            root = build(args.workdir, layout, count)
            try:
                secs, cpu, peak, chosen = measure(root, args.runs)
            except CkptError as e:
                print(f"{layout:>10} {count:>7} steps: {e.code} {e.message[:100]}")
                continue
            print(
                f"{layout:>10} {count:>7} steps: {secs:7.3f} s ({cpu:.3f} s CPU)  peak {peak:6.1f} MiB  chose {chosen}"
            )


if __name__ == "__main__":
    main()
