"""Benchmark `ckpttool export --quantize fp8-block` beside `cp -r` of its output, the BF16 export and a torch script.

One run prints, side by side (warm page cache, every approach in its own process, wall seconds
including interpreter start-up and imports, peak RSS from GNU ``/usr/bin/time -f %M``):

- ``ckpttool export CKPT OUT --quantize fp8-block`` (block FP8 + ``weight_scale_inv``; with
  ``--quant-format compressed-tensors`` as a second row when ``--ct`` is given);
- ``ckpttool export CKPT OUT`` (the verbatim BF16 export of the same checkpoint);
- ``cp -r`` of the quantized output directory (the same output bytes, copied by the kernel);
- an independent torch script on the same machine: ``dcp.load`` of the whole state dict, then per
  weight DeepSeek-V3's block quantization in torch ops (pad, ``amax`` per ``128 x 128`` block,
  ``scale = amax / 448``, ``(w / scale).to(torch.float8_e4m3fn)``) and ``safetensors.torch.save_file``;
  its output is compared with ckpttool's tensor for tensor (bitwise).

The checkpoint: ``--gib`` GB (10^9 bytes, default 0.25) of BF16 ``[--rows, --cols]`` weights
(default 4096 x 4096, named ``model.layers.N.mlp.down_proj.weight``) plus one norm, saved by a
single-process ``dcp.save``; cached under ``--root``. The issue's size is ``--gib 4`` (about 4 GB
of BF16 source, 2 GB of FP8 output): ``python bench/bench_quantize.py --gib 4 --repeat 1``.

Target (docs/performance.md): the quantized export >= 50% of ``cp -r``'s throughput of its output
bytes. GB/s = output bytes / seconds (10^9).

Usage::

    python bench/bench_quantize.py [--root /tmp/ckpttool-bench-quantize] [--gib 0.25] [--rows 4096]
                                   [--cols 4096] [--repeat 3] [--workers N] [--ct] [--skip-torch]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_export import Table, _output_bytes, _run, _same_tensors, _warm

TORCH_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    ckpt, out, b = sys.argv[1], sys.argv[2], 128
    md = dcp.FileSystemReader(ckpt).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if hasattr(v, "size")}
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    tensors = {}
    for k, w in sd.items():
        name = k.removeprefix("model.")
        if w.ndim != 2 or "norm" in name:
            tensors[name] = w.to(torch.bfloat16)
            continue
        w = w.float()
        rows, cols = w.shape
        nr, nc = -(-rows // b), -(-cols // b)
        padded = torch.zeros(nr * b, nc * b)
        padded[:rows, :cols] = w.abs()
        amax = padded.view(nr, b, nc, b).amax(dim=(1, 3))
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
        full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
        tensors[name] = (w / full).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
""")

BUILD_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    out, n, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    g = torch.Generator().manual_seed(5)
    sd = {f"model.layers.{i}.mlp.down_proj.weight": (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
          for i in range(n)}
    sd["model.norm.weight"] = torch.ones(cols, dtype=torch.bfloat16)
    dcp.save({"model": sd}, checkpoint_id=out, no_dist=True)
""")


def _build(root: Path, gib: float, rows: int, cols: int) -> Path:
    n = max(1, round(gib * 1e9 / (rows * cols * 2)))
    ckpt = root / f"bf16_{n}x{rows}x{cols}"
    if not (ckpt / ".metadata").exists():
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", BUILD_SCRIPT, str(ckpt), str(n), str(rows), str(cols)], check=True)
    return ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-quantize"))
    ap.add_argument("--gib", type=float, default=0.25, help="GB (10^9) of BF16 source weights")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3, help="runs per approach; the fastest is reported")
    ap.add_argument("--workers", type=int, default=None, help="ckpttool --workers (default: its own)")
    ap.add_argument("--ct", action="store_true", help="also --quant-format compressed-tensors")
    ap.add_argument("--skip-torch", action="store_true", help="leave out the torch script")
    args = ap.parse_args()

    ckpt = _build(args.root, args.gib, args.rows, args.cols)
    src_bytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    print(f"checkpoint {ckpt} ({src_bytes / 1e9:.2f} GB), cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    _warm(ckpt)
    env_cmd = [shutil.which("ckpttool") or "ckpttool"]
    workers = ["--workers", str(args.workers)] if args.workers else []
    table = Table()

    def best(approach: str, cmd_for: Callable[[Path], list[str]], out: Path) -> tuple[float, int]:
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            runs.append(_run(cmd_for(out))[:2])
        return min(runs)

    cases = [("fp8-block", ["--quantize", "fp8-block"])]
    if args.ct:
        cases.append(
            ("fp8-block compressed-tensors", ["--quantize", "fp8-block", "--quant-format", "compressed-tensors"])
        )
    quant_out = args.root / "out_fp8"
    for label, flags in cases:
        out = args.root / ("out_" + label.replace(" ", "_"))
        s, rss = best(label, lambda o, f=flags: [*env_cmd, "export", str(ckpt), str(o), *f, *workers], out)
        table.add("quantize", f"ckpttool export {label}", s, rss, _output_bytes(out))
        if label == "fp8-block":
            quant_out = out
    nbytes = _output_bytes(quant_out)
    bf16 = args.root / "out_bf16"
    s, rss = best("bf16", lambda o: [*env_cmd, "export", str(ckpt), str(o), *workers], bf16)
    table.add("quantize", "ckpttool export (BF16, verbatim)", s, rss, _output_bytes(bf16))
    _warm(quant_out)
    cp_out = args.root / "out_cp"
    s, rss = best("cp", lambda o: ["cp", "-r", str(quant_out), str(o)], cp_out)
    table.add("quantize", "cp -r of the FP8 output", s, rss, nbytes)
    if not args.skip_torch:
        t_out = args.root / "out_torch"

        def torch_cmd(o: Path) -> list[str]:
            o.mkdir(parents=True)
            return [sys.executable, "-c", TORCH_SCRIPT, str(ckpt), str(o)]

        s, rss = best("torch", torch_cmd, t_out)
        same = _same_tensors(quant_out, t_out)
        table.add("quantize", "torch script (dcp.load + block quant)", s, rss, nbytes, f"bitwise equal: {same}")
    table.print()


if __name__ == "__main__":
    main()
