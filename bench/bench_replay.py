"""Benchmark `ckpttool replay-step` against a torch resume-and-step script on the same checkpoint.

One run prints, side by side (warm page cache, each a fresh process, wall seconds including
interpreter start-up and imports, peak RSS from GNU ``/usr/bin/time -f %M``):

- ``ckpttool replay-step CKPT --device cpu --json``: load parameters and state, one optimizer
  step, the FP64 reference and the comparison of every element;
- the baseline: what a resumed training job does before its first step — build the model
  (parameters on the ``meta`` device, then ``to_empty``: no initialisation cost), build the
  run's optimizer (``FullFP32AdamW``, a ``torch.optim.Optimizer``), ``get_state_dict`` ->
  ``dcp.load`` -> ``set_state_dict`` (torch's distributed-checkpoint state-dict API), a
  gradient per parameter (``torch.randn``) and one ``optimizer.step()``.

The checkpoint (``bench/_ckpts.py``): a Llama-style model (hidden 2048, MLP 5632, vocab
32000, 7 layers: 491M parameters) in BF16 with FullFP32AdamW state (FP32 ``master_weight``,
``exp_avg``, ``exp_avg_sq``), saved by a real 4-rank gloo ``dcp.save`` (6.9 GB), with a
layout record. ``--gb`` scales the model (2 bytes per parameter); the torch script needs
about 21 bytes per parameter of RAM, ckpttool about 16, so a 3B-parameter model (63 GB)
does not fit a 24 GiB machine.

Targets: ckpttool <= 1.0x the baseline's time and peak RSS (CPU seconds printed beside wall).

Usage::

    python bench/bench_replay.py [--gb 1.0] [--repeat 1] [--workdir /tmp/ckpttool-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

BASELINE = textwrap.dedent("""
    import sys, time, warnings
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    sys.path.insert(0, sys.argv[2])
    from _ckpts import param_shapes
    from ckpttool.optim_state import FullFP32AdamW
    ckpt, layers = sys.argv[1], int(sys.argv[3])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            for fqn, shape in param_shapes(layers).items():
                mod = self
                *path, leaf = fqn.split(".")
                for name in path:
                    if not hasattr(mod, name):
                        mod.add_module(name, torch.nn.Module())
                    mod = getattr(mod, name)
                mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16)))

    with torch.device("meta"):
        model = Model()
    model.to_empty(device="cpu")
    opt = FullFP32AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    del msd, osd
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)
    t1 = time.perf_counter()
    opt.step()
    print(f"{time.perf_counter() - t0:.3f} {time.perf_counter() - t1:.3f}")
""")

_TIME = shutil.which("time", path="/usr/bin:/bin")


def _run(cmd: list[str]) -> tuple[float, int, float, str]:
    """``(wall s, peak RSS bytes, CPU s user+sys, stdout)`` of a fresh process."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss_file:
        full = [_TIME, "-f", "%M %U %S", "-o", rss_file.name, *cmd] if _TIME else cmd
        t0 = time.perf_counter()
        p = subprocess.run(full, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:4])} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        fields = rss_file.read().split()[-3:] if _TIME else ["0", "nan", "nan"]
        return wall, int(fields[0]) * 1024, float(fields[1]) + float(fields[2]), p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="BF16 model size in GB (default 1: 491M parameters)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    a = ap.parse_args()
    import compileall

    from _ckpts import layers_for
    from bench_validate import optim_checkpoint

    import ckpttool

    compileall.compile_dir(os.path.dirname(ckpttool.__file__), quiet=1)
    a.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = optim_checkpoint(a.workdir, a.gb)
    layers = layers_for(a.gb, 2)
    size = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
    subprocess.run(["cat", *map(str, ckpt.glob("*.distcp"))], stdout=subprocess.DEVNULL, check=True)
    rows = []
    for _ in range(a.repeat):  # interleaved
        wall, rss, cpu, out = _run(
            [
                sys.executable,
                "-c",
                "from ckpttool.cli import main; main()",
                "replay-step",
                str(ckpt),
                "--device",
                "cpu",
                "--json",
            ]
        )
        doc = json.loads(out)
        rows.append(("ckpttool replay-step --device cpu", wall, rss, cpu, doc))
        wall, rss, cpu, out = _run([sys.executable, "-c", BASELINE, str(ckpt), str(HERE), str(layers)])
        rows.append(("torch resume-and-step script", wall, rss, cpu, out.split()))
    best: dict[str, tuple[float, int, float, object]] = {}
    for name, wall, rss, cpu, info in rows:
        if name not in best or wall < best[name][0]:
            best[name] = (wall, rss, cpu, info)
    numel = sum(p["numel"] for p in best["ckpttool replay-step --device cpu"][3]["params"])  # type: ignore[index]
    print(
        f"machine: {os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"checkpoint {ckpt.name}: {numel / 1e6:.0f}M parameters, {size / 1e9:.2f} GB; best of {a.repeat}"
    )
    print(f"{'approach':36s} {'wall s':>8s} {'CPU s':>8s} {'peak RSS':>10s}  detail")
    ck_wall, ck_rss, ck_cpu, doc = best["ckpttool replay-step --device cpu"]
    t = doc["timing"]  # type: ignore[index]
    print(
        f"{'ckpttool replay-step --device cpu':36s} {ck_wall:8.2f} {ck_cpu:8.2f} {ck_rss / 2**30:8.2f} GiB  "
        f"in-process {t['total_seconds']:.1f} s: load {t['load_seconds']:.1f}, step {t['step_seconds']:.2f}, "
        f"reference+compare {t['reference_seconds']:.1f}; ok={doc['ok']}"  # type: ignore[index]
    )
    b_wall, b_rss, b_cpu, parts = best["torch resume-and-step script"]
    print(
        f"{'torch resume-and-step script':36s} {b_wall:8.2f} {b_cpu:8.2f} {b_rss / 2**30:8.2f} GiB  "
        f"after start-up {parts[0]} s, step {parts[1]} s"  # type: ignore[index]
    )
    print(
        f"ratio: time {ck_wall / b_wall:.2f}x, CPU {ck_cpu / b_cpu:.2f}x (target <= 1.0x), "
        f"peak RSS {ck_rss / b_rss:.2f}x (target <= 1.0x); load average now "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
