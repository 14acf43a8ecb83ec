"""Benchmark: ``ckpttool import`` of a Hugging Face folder of many small tensors, two source trees side by side.

The per-tensor cost of the DCP writer (each tensor a ``torch.save`` archive in a ``.distcp`` file, then
``.metadata``) rather than bandwidth: ``--tensors`` (default 100,000) float32 tensors of ``--numel``
(16) values in one ``model.safetensors``, imported with ``--allow-mismatch missing,shape`` (no model
class holds such names), each tree in a fresh process with ``PYTHONPATH`` set to it, alternated, warm
page cache. Beside them torch's own ``dcp.save`` of the same tensors (``no_dist``, the data loaded
first, the save alone timed in process). Wall seconds, CPU seconds (user + sys of the child), peak RSS; a first round of
each tree, not counted, warms the bytecode and the model-class cache.

Usage: python bench/bench_import_many.py --baseline /path/to/baseline/tree [--tensors 100000] [--repeat 3]
       [--workdir /tmp/ckpttool-bench-import]
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

HERE = Path(__file__).resolve().parent

TORCH_SAVE = """
import sys, time, torch, warnings
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
warnings.simplefilter("ignore")
sd = load_file(sys.argv[1])
t0, c0 = time.perf_counter(), time.process_time()
dcp.save(sd, checkpoint_id=sys.argv[2], no_dist=True)
print(f"{time.perf_counter() - t0:.2f} {time.process_time() - c0:.2f}")
"""


def build(workdir: Path, tensors: int, numel: int) -> Path:
    """The HF folder (built once per size): ``model.safetensors`` and a ``config.json`` with a ``model_type``."""
    import torch
    from safetensors.torch import save_file

    hf = workdir / f"hf-{tensors}x{numel}"
    if not (hf / "model.safetensors").exists():
        hf.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        sd = {
            f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w": torch.randn(numel, generator=g)
            for i in range(tensors)
        }
        save_file(sd, str(hf / "model.safetensors"))
        cfg = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "vocab_size": 16}
        (hf / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 16, "num_attention_heads": 1}))
    return hf


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, float, str]:
    """(wall s, user + sys CPU s, peak RSS MiB, stdout) of ``cmd`` (GNU ``time`` for the RSS)."""
    with tempfile.NamedTemporaryFile("r") as rss:
        full = ["/usr/bin/time", "-f", "%M", "-o", rss.name, *cmd]
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out = proc.stdout.read() if proc.stdout is not None else ""
        _, status, ru = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed")
        return dt, ru.ru_utime + ru.ru_stime, int(rss.read().split()[-1]) / 1024, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="the source tree to compare with (a checkout)")
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench-import"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    hf = build(args.workdir, args.tensors, args.numel)
    trees = {"baseline": args.baseline.resolve(), "this tree": HERE.parent}
    best: dict[str, tuple[float, float, float]] = {}
    for rep in range(args.repeat + 1):  # the first round warms up (bytecode, the model-class cache): not counted
        for name, tree in trees.items():
            out = args.workdir / "out"
            shutil.rmtree(out, ignore_errors=True)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, "-m", "ckpttool", "import", str(hf), str(out), "--allow-mismatch", "missing,shape"]
            wall, cpu, rss, _ = timed(cmd, env, tree)  # -m: the cwd comes first on sys.path
            if rep:
                best[name] = min(best.get(name, (wall, cpu, rss)), (wall, cpu, rss))
        out = args.workdir / "torch-out"
        shutil.rmtree(out, ignore_errors=True)
        wall, cpu, rss, said = timed([sys.executable, "-c", TORCH_SAVE, str(hf / "model.safetensors"), str(out)],
                                     dict(os.environ), args.workdir)  # fmt: skip
        save_wall, save_cpu = map(float, said.split())
        best["torch dcp.save"] = min(best.get("torch dcp.save", (save_wall, save_cpu, rss)), (save_wall, save_cpu, rss))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{args.tensors:,} tensors of {args.numel} float32; {os.cpu_count()} CPUs; best of {args.repeat}; load {load}"
    )
    print(f"{'approach':34s} {'wall s':>7s} {'CPU s':>7s} {'RSS MiB':>8s}")
    for name, (wall, cpu, rss) in best.items():
        label = f"ckpttool import ({name})" if name in trees else f"{name} (the save alone)"
        print(f"{label:34s} {wall:7.2f} {cpu:7.2f} {rss:8.0f}")


if __name__ == "__main__":
    main()
