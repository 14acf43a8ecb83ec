"""GPU check of ckpttool's optimizers and ``replay-step`` (called by ``scripts/device_check.sh``).

Creates everything it needs under ``--work`` (default ``$OUT`` or ``/tmp/ckpttool-device-check``):

1. the ``ckpttool sample`` checkpoint (torch AdamW) and a CPU-offload sample;
2. a ~1 GiB checkpoint with CPU-offload state: the sample model scaled up (BF16 parameters,
   ``cpu_offload_adamw`` with experts offloaded, FP32 master and moments, one real step);
3. runs ``pytest tests/optim_state/test_optim_device.py tests/ops/replay/test_replay_device.py`` (the
   accelerator tests);
4. runs ``ckpttool replay-step --device <accelerator>`` on the samples and the 1 GiB checkpoint;
5. measures torch's pinned host<->device copy bandwidth with buffers of the staging size;
6. on an accelerator (``--replay-gb``, default 1.0 there): ``replay-step`` of a 491M-parameter BF16 model with
   FP32 master and moments on the device, beside torch's ``AdamW(fused=True)`` on as many parameters there;
7. prints a short summary (pass/fail, step time, D2H/H2D GB/s achieved vs torch's copies)
   and writes ``summary.json``.

Every step runs in a subprocess under a timeout carved from one overall budget
(``--budget`` seconds, default 220) so the whole check never hangs. Without an
accelerator it says so, runs the same steps with ``--device cpu`` and exits 0 when they pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLI = "import sys; from ckpttool.cli import main; sys.argv[0] = 'ckpttool'; main()"
CHUNK = 1 << 22  # elements per staged chunk (CPUOffloadAdamW default)


class Budget:
    """One deadline shared by every step; each step gets what is left minus a reserve."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self, reserve: float = 10.0) -> float:
        return max(1.0, self.deadline - time.monotonic() - reserve)


def run(cmd: list[str], *, timeout: float, log: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """Run ``cmd`` with a timeout; stdout+stderr go to ``log``. Returns ``(rc, output, seconds)``; rc 124 on timeout."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = (
            124,
            (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
            + f"\nTIMEOUT after {timeout:.0f}s\n",
        )
    log.write_text(out)
    return rc, out, time.monotonic() - t0


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def build_big(out: str, target_gib: float) -> None:
    """Write the ~1 GiB CPU-offload checkpoint (runs in a subprocess)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpttool.ops.sample import SampleConfig, TinyMoEForCausalLM, layout_record_for, sample_optimizer_record
    from ckpttool.optim_state import build_optimizer

    warnings.filterwarnings("ignore")
    # 14 bytes per element saved: BF16 param + FP32 master + two FP32 moments.
    scale = max(target_gib, 0.05)
    inter = int(1024 * scale) // 64 * 64 or 64
    cfg = SampleConfig(
        vocab_size=8192,
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=inter,
        num_experts=8,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = TinyMoEForCausalLM(cfg)
    model = meta.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for b in model.buffers():
            b.zero_()
    opt = build_optimizer(
        "cpu_offload_adamw",
        list(model.named_parameters()),
        lr=1e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        cpu_offload_param_patterns=["experts"],
    )
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    record = layout_record_for(cfg, optimizer=sample_optimizer_record("cpu_offload_adamw"), global_step=1)
    dcp.save({"model": msd, "optimizer": osd, "layout": json.dumps(record)}, checkpoint_id=out)


def copy_bandwidth(device: str, chunk_bytes: int) -> dict[str, float]:
    """torch pinned-buffer copy GB/s (H2D, D2H) for buffers of ``chunk_bytes`` and of 256 MiB."""
    import torch

    out: dict[str, float] = {}
    dev = torch.device(device, torch.accelerator.current_device_index())
    for label, nbytes in (("chunk", chunk_bytes), ("256MiB", 256 << 20)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        reps = max(3, min(50, (2 << 30) // nbytes))
        for direction in ("h2d", "d2h"):
            src, dst = (host, devbuf) if direction == "h2d" else (devbuf, host)
            dst.copy_(src, non_blocking=True)
            torch.accelerator.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            torch.accelerator.synchronize(dev)
            out[f"{direction}_{label}_gbps"] = reps * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def bench_optim(
    device: str, numel: int, steps: int, only: list[str], timeout: float, log: Path, env: dict[str, str]
) -> tuple[int, str, float]:
    """``bench/bench_optim.py`` on ``device``: ``numel`` BF16 parameters, ``steps`` steps, the rows in ``only``."""
    cmd = [sys.executable, str(REPO / "bench" / "bench_optim.py"), "--device", device, "--numel", str(numel)]
    cmd += ["--steps", str(steps), "--param-dtype", "bfloat16", "--only", *only]
    return run(cmd, timeout=timeout, log=log, env=env)


def replay_big(
    gb: float,
    data: Path,
    device: str,
    budget: Budget,
    logs: Path,
    env: dict[str, str],
    checks: dict[str, Any],
    summary: dict[str, Any],
) -> None:
    """``replay-step --device DEVICE`` of a ``gb`` GB BF16 model with FP32 master and moments (491M parameters at
    1 GB; ``bench/bench_validate.py``'s ``optim_checkpoint``), then ``bench/bench_optim.py`` with torch's
    ``AdamW(fused=True)`` and ckpttool's fused ``full_fp32_adamw`` on as many BF16 parameters on the same device:
    the replayed step's time beside torch's own fused step."""
    build = (
        f"import sys; from pathlib import Path; sys.path.insert(0, {str(REPO / 'bench')!r}); "
        f"from bench_validate import optim_checkpoint; print(optim_checkpoint(Path({str(data / 'replay')!r}), {gb}))"
    )
    rc, out, t = run(py(build), timeout=min(240, budget.left(90)), log=logs / "build_replay.log", env=env)
    ckpt = Path(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else None
    if ckpt is None or not (ckpt / ".metadata").is_file():
        checks["replay_big"] = {"ok": False, "error": "checkpoint not built", "tail": out[-400:]}
        print(f"replay-step {gb:g} GB: FAIL (checkpoint not built, rc={rc})", flush=True)
        return
    cmd = py(CLI) + ["replay-step", str(ckpt), "--device", device, "--json"]
    rc, out, t = run(cmd, timeout=min(240, budget.left(45)), log=logs / "replay_big.log", env=env)
    try:
        d = json.loads(out.strip().splitlines()[0])
    except (json.JSONDecodeError, IndexError):
        checks["replay_big"] = {"ok": False, "rc": rc, "tail": out[-400:]}
        print(f"replay-step {gb:g} GB: FAIL rc={rc}: {out.strip()[-300:]}", flush=True)
        return
    numel = sum(p["numel"] for p in d["params"])
    checks["replay_big"] = {
        "ok": rc == 0 and d["ok"],
        "rc": rc,
        "params": d["params_total"],
        "numel": numel,
        "step_s": d["timing"]["step_seconds"],
        "total_s": d["timing"]["total_seconds"],
        "wall_s": round(t, 1),
    }
    c = checks["replay_big"]
    print(
        f"replay-step {gb:g} GB ({numel / 1e6:.0f}M elements, full_fp32_adamw): {'PASS' if c['ok'] else 'FAIL'}; "
        f"step {c['step_s'] * 1e3:.1f} ms, total {c['total_s']:.1f} s, wall {t:.1f} s",
        flush=True,
    )
    if budget.left(5) < 30:
        return
    rc, out, t = bench_optim(
        device,
        numel,
        3,
        ["AdamW fused", "full_fp32_adamw fused"],
        min(120, budget.left(5)),
        logs / "bench_optim_replay.log",
        env,
    )
    summary["replay_big_optim"] = {"rc": rc, "seconds": round(t, 1), "table": out.strip().splitlines()[-5:]}
    print(f"torch fused AdamW vs full_fp32_adamw, {numel / 1e6:.0f}M BF16 params on {device}:", flush=True)
    print("\n".join(out.strip().splitlines()[-5:]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=os.environ.get("OUT") or "/tmp/ckpttool-device-check")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("DEVICE_CHECK_BUDGET", 220)))
    ap.add_argument("--big-gib", type=float, default=1.0, help="size of the CPU-offload checkpoint")
    ap.add_argument("--device", default=None, help="force a device (cpu to test the script without a GPU)")
    ap.add_argument(
        "--replay-gb",
        type=float,
        default=None,
        help="GB of the BF16 model replayed beside torch's fused AdamW (default 1.0 on an accelerator, 0 on cpu: off)",
    )
    ap.add_argument("--build-big", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_big:
        build_big(args.build_big, args.big_gib)
        return 0
    if args.bandwidth:
        print(json.dumps(copy_bandwidth(args.bandwidth, CHUNK * 2)))
        return 0

    budget = Budget(args.budget)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    data = Path(os.environ.get("DEVICE_CHECK_DATA", "/tmp/ckpttool-device-check-data"))
    if data.exists():
        import shutil

        shutil.rmtree(data)
    data.mkdir(parents=True)
    env = dict(
        os.environ,
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        CKPTTOOL_FIXTURE_CACHE=str(data / "fixtures"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    summary: dict[str, Any] = {"checks": {}}
    checks = summary["checks"]

    rc, out, _ = run(
        py(
            "import torch; from ckpttool.optim_state.device import accelerator_type; "
            "t = accelerator_type(); print(torch.__version__, t or 'none', "
            "torch.cuda.get_device_name() if t == 'cuda' else '-', sep='|')"
        ),
        timeout=min(60, budget.left()),
        log=logs / "env.log",
        env=env,
    )
    if rc != 0:
        print(f"FAIL: cannot import torch/ckpttool:\n{out[-2000:]}")
        return 1
    fields = out.strip().splitlines()[-1].split("|") if out.strip() else []
    torch_version, acc, name = fields if len(fields) == 3 else ("?", "none", "-")
    device = args.device or (acc if acc != "none" else "cpu")
    if args.replay_gb is None:
        args.replay_gb = 0.0 if device == "cpu" else 1.0
    summary.update(torch=torch_version, accelerator=acc, device_name=name, device=device)
    print(f"torch {torch_version}; accelerator {acc} ({name}); checks run on --device {device}", flush=True)
    if device == "cpu":
        print("no GPU/accelerator found (or --device cpu): running the CPU path only", flush=True)

    # 1. checkpoints
    sample, sample_off, big = data / "sample", data / "sample_offload", data / "big_offload"
    rc1, out1, t1 = run(
        py(CLI) + ["sample", str(sample)], timeout=min(60, budget.left()), log=logs / "sample.log", env=env
    )
    rc2, out2, t2 = run(
        py(CLI) + ["sample", str(sample_off), "--optimizer", "cpu_offload_adamw"],
        timeout=min(60, budget.left()),
        log=logs / "sample_offload.log",
        env=env,
    )
    rc3, out3, t3 = run(
        [sys.executable, __file__, "--build-big", str(big), "--big-gib", str(args.big_gib)],
        timeout=min(100, budget.left(60)),
        log=logs / "build_big.log",
        env=env,
    )
    big_bytes = sum(p.stat().st_size for p in big.rglob("*") if p.is_file()) if big.exists() else 0
    checks["build"] = {
        "ok": rc1 == rc2 == rc3 == 0,
        "sample_s": round(t1, 1),
        "sample_offload_s": round(t2, 1),
        "big_s": round(t3, 1),
        "big_bytes": big_bytes,
    }
    print(
        f"build: samples {t1:.1f}s/{t2:.1f}s, 1 GiB offload checkpoint {big_bytes / 2**30:.2f} GiB in {t3:.1f}s "
        f"{'ok' if checks['build']['ok'] else 'FAILED'}",
        flush=True,
    )

    # 2. accelerator tests (skip themselves without one)
    rc, out, t = run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/optim_state/test_optim_device.py",
            "tests/ops/replay/test_replay_device.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
        ],
        timeout=min(120, budget.left(70)),
        log=logs / "pytest.log",
        env=env,
    )
    last = out.strip().splitlines()[-1] if out.strip() else ""
    checks["pytest"] = {"ok": rc == 0, "rc": rc, "seconds": round(t, 1), "last_line": last}
    print(
        f"pytest (accelerator tests): {'PASS' if rc == 0 else 'FAIL'} ({last}; {t:.1f}s)",
        flush=True,
    )

    # 3. replay-step on the device
    def replay(name: str, ckpt: Path, extra: list[str], timeout: float) -> None:
        if not ckpt.exists():
            checks[name] = {"ok": False, "error": "checkpoint not built"}
            print(f"replay-step {name}: FAIL (checkpoint not built)")
            return
        cmd = py(CLI) + ["replay-step", str(ckpt), "--device", device, "--json", *extra]
        rc, out, t = run(cmd, timeout=timeout, log=logs / f"replay_{name}.log", env=env)
        try:
            d = json.loads(out.strip().splitlines()[0]) if rc in (0, 1) else None
        except (json.JSONDecodeError, IndexError):
            d = None
        if d is None:
            checks[name] = {"ok": False, "rc": rc, "tail": out[-400:]}
            print(f"replay-step {name}: FAIL rc={rc}: {out.strip()[-300:]}", flush=True)
            return
        tm = d["timing"]
        checks[name] = {
            "ok": rc == 0 and d["ok"],
            "rc": rc,
            "params": d["params_total"],
            "failed": d["params_failed"],
            "optimizer": d["optimizer"]["type"],
            "step_s": tm["step_seconds"],
            "total_s": tm["total_seconds"],
            "effective_gbps": tm["effective_gbps"],
            "d2h_gbps": tm["d2h_gbps"],
            "h2d_gbps": tm["h2d_gbps"],
            "d2h_bytes": tm["d2h_bytes"],
            "h2d_bytes": tm["h2d_bytes"],
            "offload_s": tm["offload_seconds"],
        }
        c = checks[name]
        print(
            f"replay-step {name} ({c['optimizer']}, {c['params']} params): {'PASS' if c['ok'] else 'FAIL'}; "
            f"step {c['step_s'] * 1e3:.1f} ms, state {c['effective_gbps']:.2f} GB/s; "
            f"offload D2H {c['d2h_gbps']:.2f} GB/s H2D {c['h2d_gbps']:.2f} GB/s; wall {t:.1f}s",
            flush=True,
        )

    replay("sample", sample, [], min(60, budget.left(60)))
    replay("sample_offload", sample_off, ["--chunk-size", "1000"], min(60, budget.left(50)))
    replay("big_offload", big, ["--chunk-size", str(CHUNK)], min(120, budget.left(15)))

    # 4. torch's own pinned copy bandwidth with buffers of the staging size
    if device != "cpu":
        rc, out, _ = run(
            [sys.executable, __file__, "--bandwidth", device],
            timeout=min(40, budget.left(2)),
            log=logs / "bandwidth.log",
            env=env,
        )
        try:
            bw = json.loads(out.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            bw = {"error": out[-300:]}
        summary["torch_copy"] = bw
        big_c = checks.get("big_offload", {})
        if "h2d_chunk_gbps" in bw:
            print(
                f"torch pinned copy ({CHUNK * 2 >> 20} MiB buffers): H2D {bw['h2d_chunk_gbps']:.1f} GB/s, "
                f"D2H {bw['d2h_chunk_gbps']:.1f} GB/s; 256 MiB: H2D {bw['h2d_256MiB_gbps']:.1f}, "
                f"D2H {bw['d2h_256MiB_gbps']:.1f} GB/s",
                flush=True,
            )
            if big_c.get("offload_s"):
                print(
                    f"replay-step 1 GiB offload achieved D2H {big_c['d2h_gbps']:.2f} GB/s "
                    f"({100 * big_c['d2h_gbps'] / bw['d2h_chunk_gbps']:.1f}% of torch), H2D {big_c['h2d_gbps']:.2f} GB/s "
                    f"({100 * big_c['h2d_gbps'] / bw['h2d_chunk_gbps']:.1f}% of torch) over the whole offloaded step "
                    "(transfers overlap the CPU update)",
                    flush=True,
                )

    # 5. informational: fused vs foreach optimizer steps on the device (bench/bench_optim.py)
    if device != "cpu" and budget.left(5) > 30:
        rc, out, t = bench_optim(
            device, 1 << 26, 5, ["foreach", "fused"], min(60, budget.left(5)), logs / "bench_optim.log", env
        )
        summary["bench_optim"] = {"rc": rc, "seconds": round(t, 1), "table": out.strip().splitlines()[-12:]}
        print(
            "bench_optim (64M BF16 params, fused vs foreach):\n" + "\n".join(out.strip().splitlines()[-12:]), flush=True
        )

    # 6. replay-step of a ~0.5B-parameter checkpoint (FullFP32AdamW state, a 4-rank gloo dcp.save) on the
    #    device, beside torch's fused AdamW step on as many BF16 parameters on the same device
    if args.replay_gb > 0 and budget.left(5) > 60:
        replay_big(args.replay_gb, data, device, budget, logs, env, checks, summary)

    ok = all(c.get("ok") for c in checks.values())
    summary["ok"] = ok
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"== device check: {'PASS' if ok else 'FAIL'} on {device} ({name}) ==", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
