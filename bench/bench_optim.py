"""Optimizer step time and effective bandwidth: ckpttool variants vs torch.optim.AdamW.

Usage::

    python bench/bench_optim.py                      # 256M elements on the CPU
    python bench/bench_optim.py --numel 67108864     # shrink
    python bench/bench_optim.py --device cuda        # on a GPU (cpu_offload_adamw stages via pinned memory)

Every variant steps the same parameters and gradients (``--tensors`` equal tensors,
``--param-dtype`` float32 or bfloat16); all optimizers stay alive (memory: parameters and
gradients once plus every variant's state) and timed steps are interleaved round-robin.
Reported per variant: median and minimum wall time and median process CPU time of a step
over ``--steps`` timed steps after ``--warmup`` untimed ones (the first creates the state;
CPU time is the steadier figure on a shared machine, with ``--threads 1`` it is the work
itself), and effective bandwidth = bytes of
parameter + gradient + all optimizer state tensors divided by the median step time (each
byte counted once, although a step reads most of them more than once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpttool.optim_state import CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the state tensors, each memory once (a fused FP32 master that is its parameter counts 0)."""
    params = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    seen: set[int] = set()
    total = 0
    for st in opt.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor) and t.data_ptr() not in params and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


ONEPASS = "one-pass C bound (not ckpttool's)"


class _Stepper:
    """A step function as far as ``run`` needs an optimizer (``step()``, no state)."""

    def __init__(self, step: Callable[[], None]) -> None:
        self.step = step
        self.state: dict = {}


def _variants(device: torch.device, chunk_size: int) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    out: dict[str, Callable[[list], torch.optim.Optimizer]] = {
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **hyper),
        "torch AdamW for-loop": lambda ps: torch.optim.AdamW(ps, foreach=False, **hyper),
        "full_fp32_adamw": lambda ps: FullFP32AdamW(ps, **hyper),
        "master_fp32_adamw (bf16 m/v)": lambda ps: MasterFP32AdamW(ps, moment_dtype=torch.bfloat16, **hyper),
        "cpu_offload_adamw (all offloaded)": lambda ps: CPUOffloadAdamW(
            [(f"p{i}", p) for i, p in enumerate(ps)], cpu_offload_param_patterns=["."], chunk_size=chunk_size, **hyper
        ),
        "full_fp32_adamw fused": lambda ps: FullFP32AdamW(ps, fused=True, **hyper),
        "master_fp32_adamw fused (bf16 m/v)": lambda ps: MasterFP32AdamW(
            ps, moment_dtype=torch.bfloat16, fused=True, **hyper
        ),
        "cpu_offload_adamw fused (all offloaded)": lambda ps: CPUOffloadAdamW(
            [(f"p{i}", p) for i, p in enumerate(ps)],
            cpu_offload_param_patterns=["."],
            chunk_size=chunk_size,
            fused=True,
            **hyper,
        ),
    }
    return out


def run(
    numel: int,
    tensors: int,
    device: torch.device,
    param_dtype: torch.dtype,
    steps: int,
    warmup: int,
    chunk_size: int,
    only: list[str] | None,
    onepass: bool = False,
) -> list[tuple[str, float, float, float, float, int]]:
    """Returns ``[(variant, median s, min s, median CPU s, GB/s at median, bytes touched)]``; skipped get NaN.

    All optimizers are built over the same parameters and stay alive; timed steps are
    interleaved round-robin (variant A, B, C, A, B, C, ...) so that load from other
    processes spreads over all variants instead of hitting one.
    """
    per = numel // tensors
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(per, generator=gen).to(param_dtype).to(device)) for _ in range(tensors)]
    for p in params:
        p.grad = (torch.randn(per, generator=gen) * 1e-3).to(param_dtype).to(device)
    opts: dict[str, torch.optim.Optimizer] = {}
    variants = _variants(device, chunk_size)
    if onepass:  # the bound of a compiled one-pass kernel (bench/_onepass_adamw.py), CPU only
        from _onepass_adamw import build, onepass_optimizer

        lib = build()
        if lib is not None:
            hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
            variants[ONEPASS] = lambda ps: _Stepper(onepass_optimizer(lib, ps, hyper))
    for name, make in variants.items():
        if only and not any(o in name for o in only):
            continue
        try:
            opts[name] = make(params)
            for _ in range(warmup):
                opts[name].step()
        except (RuntimeError, ValueError) as e:  # e.g. fused unsupported for this device/dtype
            print(f"# {name}: skipped ({e})", file=sys.stderr)
            opts.pop(name, None)
    times: dict[str, list[float]] = {name: [] for name in opts}
    cpu_times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(steps):
        for name, opt in opts.items():
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            opt.step()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
    rows = []
    grad_param = sum(p.numel() * p.element_size() * 2 for p in params)
    for name in variants:
        if name not in opts:
            if not only or any(o in name for o in only):
                rows.append((name, float("nan"), float("nan"), float("nan"), float("nan"), 0))
            continue
        touched = grad_param + (_state_bytes(opts[name]) if name != ONEPASS else 3 * 4 * numel)  # param + grad + state
        med = statistics.median(times[name])
        rows.append((name, med, min(times[name]), statistics.median(cpu_times[name]), touched / med / 1e9, touched))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=256 * 2**20, help="total parameter elements (default 256M)")
    ap.add_argument("--tensors", type=int, default=8, help="split into this many equal tensors (default 8)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, npu, ... (default cpu)")
    ap.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=1 << 22, help="cpu_offload_adamw chunk elements")
    ap.add_argument("--only", nargs="*", help="substrings of variant names to run")
    ap.add_argument(
        "--onepass-bound", action="store_true", help="also time a compiled one-pass C step (needs cc; the bound)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.param_dtype)
    rows = run(
        args.numel, args.tensors, device, dtype, args.steps, args.warmup, args.chunk_size, args.only, args.onepass_bound
    )
    base = next((r[1] for r in rows if r[0] == "torch AdamW foreach"), float("nan"))
    base_min = next((r[2] for r in rows if r[0] == "torch AdamW foreach"), float("nan"))
    print(
        f"numel={args.numel} tensors={args.tensors} device={device} param_dtype={args.param_dtype} "
        f"steps={args.steps} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    base_cpu = next((r[3] for r in rows if r[0] == "torch AdamW foreach"), float("nan"))
    fused = next((r for r in rows if r[0] == "torch AdamW fused"), None)
    print(
        f"{'variant':40s} {'median ms':>10s} {'min ms':>9s} {'cpu ms':>9s} {'GB/s':>8s} {'GiB touched':>12s} "
        f"{'vs foreach: median':>19s} {'min':>6s} {'cpu':>6s} {'vs fused: median':>17s} {'min':>6s} {'cpu':>6s}"
    )
    for name, sec, best, cpu, gbs, touched in rows:
        vs_fused = f"{sec / fused[1]:16.2f}x {best / fused[2]:5.2f}x {cpu / fused[3]:5.2f}x" if fused else f"{'-':>30s}"
        print(
            f"{name:40s} {sec * 1e3:10.1f} {best * 1e3:9.1f} {cpu * 1e3:9.1f} {gbs:8.2f} {touched / 2**30:12.2f} "
            f"{sec / base:18.2f}x {best / base_min:5.2f}x {cpu / base_cpu:5.2f}x {vs_fused}"
        )
    print(
        f"load average {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}; target: fused variants <= 1.1x torch fused"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
