"""CPU seconds of each step of an export of N one-chunk tensors, in one process, this tree beside another.

Each step runs as ``export`` runs it (planning with the cyclic GC paused, the writes with the plan's
objects frozen), one thread, timed by ``time.process_time`` (so a loaded machine inflates it less than
wall time): imports, open (parsed-metadata cache hit + catalog), selection, plan, unaccounted tensors,
chunk checks, the safetensors header (``ShardWriter``), the executor's queueing, the small-chunk copy
(every batch of ``_copy_small`` in this thread: reads, template checks, CRC-32, joined writes), the index.
The checkpoint is ``bench_export.py --only many``'s (``make_many_entries_checkpoint(..., sharded_every=0)``).

    python bench/bench_many_phases.py --many 100000 --baseline DIR --repeat 3
    python bench/bench_many_phases.py --many 1000000 --baseline DIR --repeat 1

DIR: another revision's package (``git archive REV ckpttool | tar -x -C DIR``, its native kernels built).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _phases(ckpt: Path) -> None:
    """Print ``label<TAB>CPU seconds`` of each step (run in a child, the package of its ``PYTHONPATH``)."""
    import gc
    import shutil
    import tempfile
    import time

    clock = time.process_time
    gc.disable()  # as export does while it plans (gc_held)
    t = clock()
    from ckpttool.format.safetensors import ShardWriter
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.export import execute as ex
    from ckpttool.ops.export.plan import build_plan, unaccounted_tensors
    from ckpttool.ops.export.rules import load_rules

    rows = [("imports", clock() - t)]
    t = clock()
    ck = open_checkpoint(ckpt)
    rows.append(("open: parsed-metadata cache hit + catalog", clock() - t))
    opts = ex._resolved(ex.ExportOptions(), ck)
    fmt = ex._output_format(opts)
    rules = load_rules(None)
    t = clock()
    _, selected, _, skipped = ex._select(ck, fmt, opts, rules, None)
    rows.append(("selection (key rules)", clock() - t))
    t = clock()
    plan = build_plan(selected, rules, out_format=fmt)
    rows.append(("plan (pieces, tasks, packing, header entries)", clock() - t))
    plan.skipped = skipped
    t = clock()
    unaccounted_tensors(ck.catalog, plan, set())
    rows.append(("unaccounted tensors", clock() - t))
    t = clock()
    chunks = ex._checked_chunks(ck.reader, [task.selected.source.key for task in plan.tasks])
    rows.append(("chunk checks", clock() - t))
    gc.enable()
    gc.freeze()  # as export does for the writes
    tmp = Path(tempfile.mkdtemp(prefix="many-phases-"))
    try:
        t = clock()
        writers = [ShardWriter(tmp / n, e, {"format": "pt"}) for n, e in zip(plan.files, plan.entries)]
        rows.append(("safetensors header (ShardWriter)", clock() - t))
        exe = ex._Executor(ck.reader, plan, writers, 1, None, chunks)
        batches: list = []
        exe._submit = lambda pool, idx, fn, *args: batches.append(args[0])  # type: ignore[method-assign]

        class _NoPool:
            def __init__(self, workers: int) -> None:
                pass

            def shutdown(self, cancel: bool) -> None:
                pass

        ex.Lane = _NoPool  # type: ignore[misc,assignment]
        t = clock()
        exe.run()
        rows.append(("executor loop (queueing)", clock() - t))
        t = clock()
        for b in batches:
            exe._copy_small(b)
        rows.append(("small-chunk copy (reads, checks, writes)", clock() - t))
        t = clock()
        fmt.documents(plan, None)
        rows.append(("index", clock() - t))
        for w in writers:
            w.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for label, c in rows:
        print(f"{label}\t{c:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-export"))
    ap.add_argument("--many", type=int, default=100_000)
    ap.add_argument("--baseline", type=Path, default=None, help="another copy of the package, run alternated")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tree; the least CPU of each step is reported")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        _phases(args.child)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_inspect import make_many_entries_checkpoint

    ckpt = args.root / f"many-{args.many}"
    if not (ckpt / ".metadata").is_file():
        make_many_entries_checkpoint(ckpt, args.many, 8, 0)
    trees = [("this tree", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()"]
    subprocess.run(
        [*cli, "inspect", str(ckpt), "--json"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        check=True,
    )  # the metadata cache, as a second run finds it
    best: dict[str, dict[str, float]] = {}
    order: list[str] = []
    load0 = os.getloadavg()
    for _ in range(args.repeat):
        for name, tree in trees:
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(ckpt)],
                cwd=tree,
                env=dict(os.environ, PYTHONPATH=str(tree)),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for line in out.splitlines():
                label, c = line.split("\t")
                if label not in order:
                    order.append(label)
                best.setdefault(name, {})[label] = min(best.get(name, {}).get(label, 1e9), float(c))
    print(
        f"many phases ({args.many} one-chunk tensors), CPU s, least of {args.repeat}; load {load0} -> {os.getloadavg()}"
    )
    print(f"  {'step':48s}" + "".join(f"{name:>12s}" for name, _ in trees))
    for label in [*order, "sum"]:
        vals = [sum(best[n].values()) if label == "sum" else best[n][label] for n, _ in trees]
        print(f"  {label:48s}" + "".join(f"{v:12.2f}" for v in vals))


if __name__ == "__main__":
    main()
