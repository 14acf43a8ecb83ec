"""Benchmark `ckpttool export` against the usual ways of turning a DCP checkpoint into safetensors.

One run prints, side by side, for the same ~3 GiB checkpoint (warm page cache):

- ``ckpttool export CKPT OUT --shard-size S`` (the CLI, in a subprocess);
- (a) ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` of the whole
  checkpoint, then ``torch.load`` + ``safetensors.torch.save_file`` of the model tensors;
- (b) a per-output-shard loop: ``dcp.load(no_dist=True)`` of the shard's model tensors
  into preallocated tensors, then ``save_file`` (the approach of common merge scripts);
- (c) ``cp -r`` of ckpttool's output directory: the same model bytes, copied by the
  kernel, as the disk limit.

Each approach runs in its own process; wall seconds include interpreter start-up and
imports (the user's view); peak RSS is that process's maximum resident set size
(GNU ``/usr/bin/time -f %M``, see :func:`_run`).
GB/s = model bytes written / seconds (10^9).

The checkpoint: a Llama-style model (vocab 32000, hidden 2048, MLP 5632, 2 layers,
234M parameters) in BF16, plus FP32 optimizer state (``step``, ``master_weight``,
``exp_avg``, ``exp_avg_sq``; 12 bytes/param), saved by a real 4-rank gloo job with
``dcp.save`` of DTensors ``Shard(0)`` on a 1-D mesh (the FSDP2 layout: every tensor
in 4 chunks, one ``__R_0.distcp`` file per rank): 3.05 GiB on disk, 0.47 GB of model.

Usage::

    python bench/bench_export.py [--root /tmp/ckpttool-bench-export] [--shard-size 256MB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

VOCAB, HIDDEN, INTER, LAYERS, WORLD = 32000, 2048, 5632, 2, 4


def _param_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for n in range(LAYERS):
        p = f"model.layers.{n}"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{m}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{p}.mlp.gate_proj.weight"] = (INTER, HIDDEN)
        shapes[f"{p}.mlp.up_proj.weight"] = (INTER, HIDDEN)
        shapes[f"{p}.mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes[f"{p}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


# ------------------------------------------------------------------------------------------ generator


def _rank_main(rank: int, port: int, out: str) -> None:
    """One rank of the 4-rank save: DTensor Shard(0) shards of every parameter and its FP32 state."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(1000 + rank)

    def shard(shape: tuple[int, ...], dtype: torch.dtype, scale: float) -> DTensor:
        rows = -(-shape[0] // WORLD)
        lo = min(rank * rows, shape[0])
        hi = min(lo + rows, shape[0])
        local = (torch.randn((hi - lo, *shape[1:]), generator=gen) * scale).to(dtype)
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    model, state = {}, {}
    for fqn, shape in _param_shapes().items():
        master = shard(shape, torch.float32, 0.02)
        model[fqn] = DTensor.from_local(
            master.to_local().to(torch.bfloat16),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=master.shape,
            stride=master.stride(),
        )
        state[fqn] = {
            "step": torch.tensor(100.0),
            "master_weight": master,
            "exp_avg": shard(shape, torch.float32, 1e-3),
            "exp_avg_sq": shard(shape, torch.float32, 1e-6),
        }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(state)}]
    dcp.save({"model": model, "optimizer": {"state": state, "param_groups": groups}}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def generate(ckpt: Path) -> None:
    """Write the benchmark checkpoint with a real 4-rank gloo ``dcp.save`` (skipped when present)."""
    if (ckpt / ".metadata").is_file():
        return
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--_rank", str(r), str(port), str(ckpt)]) for r in range(WORLD)
    ]
    if any(p.wait() != 0 for p in procs):
        shutil.rmtree(ckpt, ignore_errors=True)
        raise SystemExit("checkpoint generation failed")
    print(f"generated {ckpt} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


# ------------------------------------------------------------------------------------------ baselines

BASELINE_A = textwrap.dedent("""
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import save_file
    ckpt, tmp, out = sys.argv[1:4]
    dcp_to_torch_save(ckpt, tmp)
    sd = torch.load(tmp, weights_only=False)
    model = {k: v.contiguous() for k, v in sd["model"].items()}
    save_file(model, out + "/model.safetensors", metadata={"format": "pt"})
""")

BASELINE_B = textwrap.dedent("""
    import sys, json, warnings, torch
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    ckpt, out, shard_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    md = dcp.FileSystemReader(ckpt).read_metadata()
    keys = [k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size")]
    shards, cur, size = [], [], 0
    for k in keys:
        v = md.state_dict_metadata[k]
        n = v.size.numel() * v.properties.dtype.itemsize
        if cur and size + n > shard_size:
            shards.append(cur); cur, size = [], 0
        cur.append(k); size += n
    shards.append(cur)
    weight_map = {}
    for i, ks in enumerate(shards):
        sd = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype) for k in ks}
        dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k[len("model."):]: v for k, v in sd.items()}, f"{out}/{name}", metadata={"format": "pt"})
        weight_map.update({k[len("model."):]: name for k in ks})
        del sd
    json.dump({"metadata": {}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"))
""")


_TIME = shutil.which("time", path="/usr/bin:/bin")


def _run(cmd: list[str]) -> tuple[float, int, str]:
    """Run ``cmd``; return (wall seconds, peak RSS bytes of that process, its stdout).

    The peak RSS comes from GNU ``/usr/bin/time -f %M`` wrapped around the command: Linux
    carries the forking process's peak RSS into a child's ``ru_maxrss`` at exec, so
    measuring from this (large) Python process directly would put a floor under every
    figure; ``time`` is a small C process. Without it, ``os.wait4`` is used (floored).
    """
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r", suffix=".rss") as rss_file,
    ):
        full = [_TIME, "-f", "%M", "-o", rss_file.name, *cmd] if _TIME else cmd
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{err.read().decode()[-2000:]}")
        rss = int(rss_file.read().split()[-1]) * 1024 if _TIME else usage.ru_maxrss * 1024
        return seconds, rss, out.read().decode()


def _warm(ckpt: Path) -> None:
    for p in ckpt.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
    os.sync()


def _model_bytes(out: Path) -> int:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return int(index["metadata"]["total_size"])


def _same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def load(d: Path) -> dict[str, str]:
        files = sorted(d.glob("*.safetensors"))
        out = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    out[k] = str(f)
        return out

    ma, mb = load(a), load(b)
    if set(ma) != set(mb):
        return False
    for k in ma:
        with safe_open(ma[k], "pt") as ha, safe_open(mb[k], "pt") as hb:
            ta, tb = ha.get_tensor(k), hb.get_tensor(k)
            if ta.dtype != tb.dtype or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-export"))
    ap.add_argument("--shard-size", default="256MB", help="output shard size for ckpttool and (b)")
    ap.add_argument("--workers", type=int, default=None, help="ckpttool --workers (default: its own, min(8, CPUs))")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of ckpttool, (b) and (c); the fastest is reported ((a) takes ~40 s and runs once)",
    )
    args = ap.parse_args()
    import compileall

    import ckpttool
    from ckpttool.cli.options import parse_size

    # as `pip install` does: start-up is measured with bytecode caches, also under PYTHONDONTWRITEBYTECODE
    compileall.compile_dir(os.path.dirname(ckpttool.__file__), quiet=1)

    shard_bytes = parse_size(args.shard_size)
    root: Path = args.root
    ckpt = root / "ckpt"
    generate(ckpt)
    disk = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    outs = {n: root / n for n in ("ckpttool", "a", "b", "c")}
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
    tmp_pt = root / "a.pt"
    tmp_pt.unlink(missing_ok=True)

    def best(name: str, make_cmd: Callable[[], list[str]], out: Path, repeat: int, prepare: bool = True) -> None:
        runs = []
        for _ in range(repeat):
            shutil.rmtree(out, ignore_errors=True)
            if prepare:
                out.mkdir()
            _warm(ckpt)
            runs.append(_run(make_cmd()))
        rows.append((name, min(r[0] for r in runs), max(r[1] for r in runs)))
        outputs[name] = [r[2] for r in runs]

    rows: list[tuple[str, float, int]] = []
    outputs: dict[str, list[str]] = {}
    cmd = [
        sys.executable,
        "-c",
        "from ckpttool.cli import main; main()",
        "export",
        str(ckpt),
        str(outs["ckpttool"]),
        "--shard-size",
        args.shard_size,
        "--json",
    ]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    best("ckpttool export", lambda: cmd, outs["ckpttool"], args.repeat, prepare=False)
    model_bytes = _model_bytes(outs["ckpttool"])
    largest = max(n * 2 for n in (VOCAB * HIDDEN, INTER * HIDDEN))

    best(
        "(a) dcp_to_torch_save + save_file",
        lambda: [sys.executable, "-c", BASELINE_A, str(ckpt), str(tmp_pt), str(outs["a"])],
        outs["a"],
        1,
    )
    tmp_pt.unlink(missing_ok=True)
    best(
        "(b) per-shard dcp.load + save_file",
        lambda: [sys.executable, "-c", BASELINE_B, str(ckpt), str(outs["b"]), str(shard_bytes)],
        outs["b"],
        args.repeat,
    )
    best(
        "(c) cp -r of the model bytes",
        lambda: ["cp", "-r", str(outs["ckpttool"]), str(outs["c"])],
        outs["c"],
        args.repeat,
        prepare=False,
    )

    same = _same_tensors(outs["ckpttool"], outs["b"])
    print(
        f"checkpoint: {disk / 2**30:.2f} GiB on disk ({WORLD} ranks), model {model_bytes / 1e9:.3f} GB BF16; "
        f"shard size {args.shard_size}; {os.cpu_count()} CPUs; ckpttool output == (b) output: {same}"
    )
    print(f"{'approach':38s} {'seconds':>8s} {'GB/s':>7s} {'peak RSS':>10s}")
    for name, s, rss in rows:
        print(f"{name:38s} {s:8.2f} {model_bytes / s / 1e9:7.3f} {rss / 2**20:7.0f} MiB")
    inner = min(json.loads(o)["seconds"] for o in outputs["ckpttool export"])
    print(
        f"ckpttool in-process (after interpreter start-up and imports): {inner:.2f} s, "
        f"{model_bytes / inner / 1e9:.3f} GB/s"
    )
    ck, a, b, c = (r[1] for r in rows)
    budget = shard_bytes + largest + (512 << 20)
    print(
        f"speed-up vs (a): {a / ck:.1f}x (target >= 2x); vs (b): {b / ck:.1f}x (target > 1x); "
        f"throughput vs (c): {c / ck:.0%} (target >= 50%)"
    )
    print(
        f"peak RSS {rows[0][2] / 2**20:.0f} MiB vs budget shard + largest tensor + 512 MiB = {budget / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_rank":
        _rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
