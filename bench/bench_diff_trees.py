"""Benchmark: ``ckpttool diff`` of two source trees side by side (a baseline and this one), in one run.

The raw-record comparisons (:mod:`ckpttool.ops.diff.run`, one engine plan per tensor pair):
``diff A B`` (A a 4-rank ``Shard(0)`` save, B the same tensors in one chunk each: the row blocks
compared as one byte stream) and ``diff A A-copy`` (the same chunking: record by record); then
both again with ``--as-dtype float32``, which decodes every value (the BF16 values cast, the
engine's ``PairedSlabs`` folding both sides slab by slab into the value comparison). The
assembled values (:mod:`ckpttool.ops.diff.gather`): a torchtitan Llama checkpoint against its
HF export (``bench_diff_adapter``'s case: q/k rows permuted by the model adapter's runs) and
that export quantized (``--quantize fp8-block``) against the BF16 export (every projection
dequantized), and one 8192 x 8192 weight quantized against its BF16 export (the memory of
a large dequantized value). Each
tree runs in a fresh process with ``PYTHONPATH`` set to it, the trees alternating, warm page
cache; wall seconds, CPU seconds (user + sys of the child), peak RSS and the load average beside each.

Usage: python bench/bench_diff_trees.py --baseline /path/to/baseline/tree [--gb 1] [--repeat 3]
       [--workdir /tmp/ckpttool-bench] [--only TEXT]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_diff import build_a, build_b, copy_of, nbytes, warm  # noqa: E402
from bench_diff_adapter import build as build_titan  # noqa: E402


def build_big(workdir: Path, n: int = 8192) -> tuple[Path, Path]:
    """One ``n x n`` weight (``down_proj``) saved by ``dcp.save``, exported in BF16 and with ``--quantize fp8-block``."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.ops.export import ExportOptions
    from ckpttool.ops.export.execute import export_checkpoint

    src, assets = workdir / f"big{n}", workdir / f"big{n}-assets"
    out = {"bf16": workdir / f"big{n}-bf16", "fp8": workdir / f"big{n}-fp8"}
    if not all((o / "model.safetensors").exists() for o in out.values()):
        w = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        dcp.save({"model.layers.0.mlp.down_proj.weight": w}, checkpoint_id=str(src), no_dist=True)
        assets.mkdir(exist_ok=True)
        (assets / "config.json").write_text(json.dumps({"hidden_size": n}))
        for name, quant in (("bf16", None), ("fp8", "fp8-block")):
            opts = ExportOptions(model_assets=assets, shard_size=1 << 40, overwrite=True, quantize=quant)
            export_checkpoint(src, out[name], opts)
    return out["fp8"], out["bf16"]


def build_many(workdir: Path, n: int = 20_000) -> tuple[Path, Path]:
    """``n`` tensors of 64 float32 values saved by ``dcp.save``, and the same with every other one changed by 1e-3:
    the per-pair cost (locating and checking each chunk's archive) rather than bandwidth (built once)."""
    import torch
    import torch.distributed.checkpoint as dcp

    a, b = workdir / f"many{n}-a", workdir / f"many{n}-b"
    if not (b / ".metadata").exists():
        g = torch.Generator().manual_seed(0)
        sd = {f"model.layers.{i // 10}.w{i % 10}": torch.randn(64, generator=g) for i in range(n)}
        dcp.save(sd, checkpoint_id=str(a), no_dist=True)
        dcp.save(
            {k: v + 1e-3 if i % 2 == 0 else v for i, (k, v) in enumerate(sd.items())},
            checkpoint_id=str(b),
            no_dist=True,
        )
    return a, b


def build_fp8(src: Path, assets: Path, hf: Path) -> Path:
    """``src`` exported with ``--quantize fp8-block`` beside its BF16 export ``hf`` (built once)."""
    from ckpttool.ops.export import ExportOptions
    from ckpttool.ops.export.execute import export_checkpoint

    out = hf.with_name(hf.name + "-fp8")
    if not (out / "model.safetensors").exists():
        opts = ExportOptions(model_assets=assets, shard_size=1 << 40, overwrite=True, quantize="fp8-block")
        export_checkpoint(src, out, opts)
    return out


def timed(tree: Path, args: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, float, float]:
    """(wall seconds, user + sys CPU seconds, peak RSS MiB) of ``python -m ckpttool ARGS`` run from ``tree``
    (``ok``: the exit codes expected; 1 where the inputs differ).

    The peak RSS is GNU ``time``'s ``%M`` (a child forked by this large process would inherit its high-water mark).
    """
    import tempfile

    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.NamedTemporaryFile("r") as rss:
        cmd = ["/usr/bin/time", "-f", "%M", "-o", rss.name, sys.executable, "-m", "ckpttool", *args]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL)  # -m: the cwd comes first
        _, status, ru = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) not in ok:
            raise SystemExit(f"{tree}: ckpttool {' '.join(args)} failed")
        return dt, ru.ru_utime + ru.ru_stime, int(rss.read().split()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="the source tree to compare with (a checkout)")
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    ap.add_argument("--only", default="", help="run only the cases whose label contains this text")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    a = build_a(args.workdir, args.gb)
    b, a2 = build_b(a, args.workdir), copy_of(a, args.workdir)
    titan, hf, assets = build_titan(args.workdir, args.gb)
    fp8 = build_fp8(titan, assets, hf)
    big_fp8, big_bf16 = build_big(args.workdir)
    many_a, many_b = build_many(args.workdir)
    trees = {"baseline": args.baseline.resolve(), "this tree": HERE.parent}
    print(f"A {nbytes(a) / 1e9:.2f} GB; {os.cpu_count()} CPUs; best of {args.repeat} (wall, and CPU of that run)")
    print(f"{'case':34s} {'tree':10s} {'wall s':>7s} {'CPU s':>7s} {'RSS MiB':>7s}  load")
    for label, one, other, extra in (
        ("diff A B (row blocks, streams)", a, b, []),
        ("diff A A-copy (records)", a, a2, []),
        ("diff A B --as-dtype float32", a, b, ["--as-dtype", "float32"]),
        ("diff A A-copy --as-dtype float32", a, a2, ["--as-dtype", "float32"]),
        ("diff TITAN HF (adapter runs)", titan, hf, []),
        ("diff HF-FP8 HF (dequantized)", fp8, hf, []),
        ("diff FP8 BF16, one 8192^2 weight", big_fp8, big_bf16, []),
        ("diff 20,000 small, half differ", many_a, many_b, []),
    ):
        if args.only not in label:
            continue
        best: dict[str, tuple[float, float, float]] = {}
        for _ in range(args.repeat):
            for name, tree in trees.items():
                warm(one, other)
                run = timed(tree, ["diff", str(one), str(other), *extra], (0, 1) if one == many_a else (0,))
                best[name] = min(best.get(name, run), run)
        for name, (wall, cpu, rss) in best.items():
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"{label:34s} {name:10s} {wall:7.2f} {cpu:7.2f} {rss:7.0f}  {load}", flush=True)


if __name__ == "__main__":
    main()
