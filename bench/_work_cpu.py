"""One process (or one torchrun rank) of ``bench_remote.py --only procs-cpu``: a run's work, timed.

Joins the group as ``python -m ckpttool`` does (start-up, not timed), imports what the command
needs (numpy, torch: a rank has imported torch to join), then times the work alone: wall seconds
and this process's CPU seconds (user + system, every thread). Prints one JSON line per process
(rank, wall, user, sys).

Usage: ``[torchrun --nproc-per-node N] bench/_work_cpu.py cast|deep CKPT OUT WORKERS``
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpttool.ops import distributed


def main() -> None:
    kind, ckpt, out, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    group = distributed.set_current(distributed.from_env())
    # imported by the work on first use (numpy; torch by validate's FP32-state rules), and by every
    # rank to join the group (torch): start-up, imported here in both runs
    import numpy  # noqa: F401
    import torch  # noqa: F401

    from ckpttool.ops.export import ExportOptions, export_checkpoint
    from ckpttool.ops.validate.runner import ValidateOptions, validate

    if group.active:
        import torch.distributed as dist

        dist.barrier()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if kind == "cast":
        opts = ExportOptions(save_dtype="bfloat16", shard_size=10**8, workers=workers)
        export_checkpoint(ckpt, out, opts)
    else:
        validate(ckpt, ValidateOptions(strict=True, deep=True, workers=workers))
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    doc = {"rank": group.rank, "wall": wall, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime}
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    group.close()
    group.finish(0)
    os._exit(0)


if __name__ == "__main__":
    main()
