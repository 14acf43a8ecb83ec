"""Benchmark `ckpttool export --quantize fp8-block` beside `cp -r` of its output, the BF16 export and a torch script.

One run prints, side by side (warm page cache, every approach in its own process, wall seconds
including interpreter start-up and imports, peak RSS from GNU ``/usr/bin/time -f %M``):

- ``ckpttool export CKPT OUT --quantize fp8-block`` (block FP8 + ``weight_scale_inv``; with
  ``--quant-format compressed-tensors``, block and ``fp8-channel``, as more rows when ``--ct`` is given);
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
bytes. GB/s = output bytes / seconds (10^9); ``x cp`` = that throughput / ``cp -r``'s; CPU s = user +
system seconds of the process (GNU ``time``), the figure to compare on a loaded machine.
``--other DIR`` adds the rows of the ckpttool checkout in ``DIR`` (e.g. a ``git worktree`` of an
earlier commit) run on the same checkpoint in the same run, its output compared byte for byte.

Usage::

    python bench/bench_quantize.py [--root /tmp/ckpttool-bench-quantize] [--gib 0.25] [--rows 4096]
                                   [--cols 4096] [--repeat 3] [--workers N] [--ct] [--skip-torch]
                                   [--other DIR]
    python bench/bench_quantize.py --bands [--cols 4096] [--repeat 3]   # the band kernels alone
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_export import _output_bytes, _same_tensors, _settle, _warm

_TIME = shutil.which("time", path="/usr/bin:/bin")

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


def _run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run ``cmd``; return (wall seconds, CPU seconds user + system, peak RSS bytes), from GNU ``time``
    (a small C parent: the peak RSS is not floored by this process's, as ``bench_export._run`` explains)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf, tempfile.TemporaryFile() as err:
        full = [_TIME, "-f", "%U %S %M", "-o", tf.name, *cmd] if _TIME else cmd
        t0 = time.perf_counter()
        proc = subprocess.run(full, stdout=subprocess.DEVNULL, stderr=err, env=env)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd[:5])} failed:\n{err.read().decode()[-2000:]}")
        if not _TIME:
            return seconds, float("nan"), 0
        user, sys_s, rss = tf.read().split()[-3:]
        return seconds, float(user) + float(sys_s), int(rss) * 1024


class Table:
    """Rows of (approach, wall s, CPU s, peak RSS, output bytes, note), printed with GB/s and x ``cp -r``."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, int, int, str]] = []
        self.cp = 0.0  # cp -r's GB/s

    def add(self, approach: str, run: tuple[float, float, int], nbytes: int, note: str = "") -> None:
        self.rows.append((approach, *run, nbytes, note))

    def print(self) -> None:
        print(f"{'approach':46s} {'wall s':>8s} {'CPU s':>8s} {'GB/s':>7s} {'x cp':>6s} {'peak RSS':>10s}  note")
        for approach, s, cpu, rss, nb, note in self.rows:
            gbs = nb / s / 1e9
            ratio = f"{gbs / self.cp:6.2f}" if self.cp else "     -"
            rss_s = f"{rss / 2**20:.0f} MiB" if rss else "-"
            print(f"{approach:46s} {s:8.2f} {cpu:8.2f} {gbs:7.3f} {ratio} {rss_s:>10s}  {note}")


def _same_files(a: Path, b: Path) -> bool:
    """The same files (the output marker, with its time and pid, left out), byte for byte."""
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    return names == sorted(p.name for p in b.iterdir() if not p.name.startswith(".")) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names
    )


def _bands(cols: int, repeat: int) -> None:
    """CPU ms per ``128 x cols`` band of the native, torch and numpy kernels (BF16 and FP32 sources, block and
    channel), one thread, in this process; each the best of ``repeat`` rounds of 100 bands."""
    import numpy as np
    import torch

    from ckpttool.engine import fp8, fp8_native, kernels

    def numpy_band(band: np.ndarray, block: int | None) -> None:
        w = kernels.to_f32(band.view(np.uint8), "bfloat16" if band.dtype == np.uint16 else "float32").reshape(
            band.shape
        )
        if block is None:
            q, scale, amax = kernels.fp8_channel_quantize(w)
            kernels.fp8_channel_error(w, kernels.fp8_channel_dequantize(q, scale), amax)
        else:
            q, scale, amax = kernels.fp8_block_quantize(w, block)
            kernels.fp8_block_error(w, kernels.fp8_block_dequantize(q, scale, block), amax, block)

    torch.set_num_threads(1)
    w = torch.randn(128, cols, generator=torch.Generator().manual_seed(0)) * 0.02
    sources = {"bf16": w.to(torch.bfloat16).view(torch.uint16).numpy(), "fp32": w.numpy()}
    kinds = [("native", fp8_native.quantize_band), ("torch", fp8.quantize_band), ("numpy", numpy_band)]
    print(f"CPU ms per 128 x {cols} band, one thread, loadavg {_load()}")
    for block in (128, None):
        for src, band in sources.items():
            row = []
            for name, fn in kinds:
                if name == "native" and not fp8_native.available():
                    continue
                best = float("inf")
                for _ in range(repeat):
                    t = time.process_time()
                    for _ in range(100):
                        fn(band, block)
                    best = min(best, (time.process_time() - t) * 10)
                row.append(f"{name} {best:.3f}")
            print(f"  {'block' if block else 'channel'} {src}: " + ", ".join(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-quantize"))
    ap.add_argument("--gib", type=float, default=0.25, help="GB (10^9) of BF16 source weights")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument(
        "--repeat", type=int, default=3, help="rounds of all approaches; the fastest run of each is reported"
    )
    ap.add_argument("--workers", type=int, default=None, help="ckpttool --workers (default: its own)")
    ap.add_argument("--ct", action="store_true", help="also --quant-format compressed-tensors (block and channel)")
    ap.add_argument("--skip-torch", action="store_true", help="leave out the torch script")
    ap.add_argument("--other", type=Path, default=None, help="another ckpttool checkout to run beside (before/after)")
    ap.add_argument("--bands", action="store_true", help="only the band kernels' CPU ms per band, in process")
    args = ap.parse_args()
    if args.bands:
        _bands(args.cols, args.repeat)
        return

    ckpt = _build(args.root, args.gib, args.rows, args.cols)
    src_bytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    print(f"checkpoint {ckpt} ({src_bytes / 1e9:.2f} GB), cpus {os.cpu_count()}, loadavg {_load()}")
    _warm(ckpt)
    env_cmd = [shutil.which("ckpttool") or "ckpttool"]
    workers = ["--workers", str(args.workers)] if args.workers else []
    root = args.root
    # (label, command for an output directory, output directory, environment)
    approaches: list[tuple[str, Callable[[Path], list[str]], Path, dict[str, str] | None]] = []
    flags = [("fp8-block", ["--quantize", "fp8-block"])]
    if args.ct:
        ct = ["--quant-format", "compressed-tensors"]
        flags.append(("fp8-block compressed-tensors", ["--quantize", "fp8-block", *ct]))
        flags.append(("fp8-channel compressed-tensors", ["--quantize", "fp8-channel", *ct]))
    for label, f in flags:
        out = root / ("out_" + label.replace(" ", "_"))
        approaches.append(
            (
                f"ckpttool export {label}",
                lambda o, f=f: [*env_cmd, "export", str(ckpt), str(o), *f, *workers],
                out,
                None,
            )
        )
    quant_out = root / "out_fp8-block"
    if args.other is not None:
        env = {**os.environ, "PYTHONPATH": str(args.other.resolve())}
        # -P: not the working directory first on the path (a run from a checkout would import that one)
        cmd = [sys.executable, "-P", "-m", "ckpttool", "export", str(ckpt)]
        approaches.append(
            (
                f"{args.other.name}: export fp8-block",
                lambda o: [*cmd, str(o), "--quantize", "fp8-block", *workers],
                root / "out_other",
                env,
            )
        )
    approaches.append(
        (
            "ckpttool export (BF16, verbatim)",
            lambda o: [*env_cmd, "export", str(ckpt), str(o), *workers],
            root / "out_bf16",
            None,
        )
    )
    approaches.append(
        ("cp -r of the FP8 output", lambda o: ["cp", "-r", str(quant_out), str(o)], root / "out_cp", None)
    )
    if not args.skip_torch:

        def torch_cmd(o: Path) -> list[str]:
            o.mkdir(parents=True)
            return [sys.executable, "-c", TORCH_SCRIPT, str(ckpt), str(o)]

        approaches.append(("torch script (dcp.load + block quant)", torch_cmd, root / "out_torch", None))
    # rounds of every approach in turn (a load that drifts affects them alike); the fastest run of each
    runs: dict[str, list[tuple[float, float, int]]] = {a[0]: [] for a in approaches}
    for _ in range(args.repeat):
        for label, cmd_for, out, env in approaches:
            shutil.rmtree(out, ignore_errors=True)
            # every run from the same page cache: nothing dirty, no other approach's output cached, its input read in
            _settle(quant_out if out.name == "out_cp" else ckpt, root)
            runs[label].append(_run(cmd_for(out), env))
    nbytes = _output_bytes(quant_out)
    table = Table()
    for label, _, out, _ in approaches:
        note = ""
        if out.name == "out_other":
            note = f"byte-identical: {_same_files(quant_out, out)}"
        elif out.name == "out_torch":
            note = f"bitwise equal: {_same_tensors(quant_out, out)}"
        table.add(label, min(runs[label]), nbytes if out.name in ("out_cp", "out_torch") else _output_bytes(out), note)
        if out.name == "out_cp":
            table.cp = nbytes / min(runs[label])[0] / 1e9
    table.print()
    print(f"loadavg after: {_load()}")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
