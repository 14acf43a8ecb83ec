"""Benchmark `ckpttool export` against `cp -r` of its output and against the usual torch scripts.

One run prints, side by side (warm page cache, every approach in its own process, wall seconds
including interpreter start-up and imports, peak RSS from GNU ``/usr/bin/time -f %M``):

``preserve`` — a Llama-style model (vocab 32000, hidden 2048, MLP 5632, 2 layers, 234M
parameters) in BF16 plus FP32 optimizer state (``step``, ``master_weight``, ``exp_avg``,
``exp_avg_sq``), saved by a real 4-rank gloo ``dcp.save`` of DTensors ``Shard(0)`` (the
FSDP2 layout: every tensor in 4 chunks, one ``__R_0.distcp`` file per rank), 3.05 GiB on
disk, 0.47 GB of model:

- ``ckpttool export CKPT OUT --shard-size 256MB`` (verbatim chunk copies);
- (a) ``dcp_to_torch_save`` + ``torch.load`` + ``safetensors.torch.save_file``;
- (b) a per-output-shard loop: ``dcp.load(no_dist=True)`` into preallocated tensors, then
  ``save_file`` (the approach of common merge scripts);
- (c) ``cp -r`` of ckpttool's output directory: the same bytes, copied by the kernel.

Transforming exports, each beside ``cp -r`` of its own output (the same output bytes):

- ``cast 1 GB``: an FP32 model-only checkpoint of the same shapes (0.94 GB, 4 ranks),
  ``--save-dtype bfloat16``;
- ``master cast``: the ``preserve`` checkpoint with ``--weights master --save-dtype bfloat16``
  (the FP32 masters rounded to BF16);
- ``per-expert`` and ``fused, un-permuted``: a legacy-layout MoE checkpoint (mesh
  ``(ep_fsdp=2, ep=2)``, both on the expert dim, version-1 layout record; 4 layers of fused
  experts ``gate_up_proj [64, 1024, 1024]`` / ``down_proj [64, 1024, 512]`` in BF16, 0.81 GB),
  ``--experts per-expert`` (128 pieces per tensor, experts in true order) and
  ``--experts fused`` (expert slabs un-permuted);
- ``cast 6 GB`` (``--big-gib 6``, off by default: 6.1 GB FP32 model, 27 layers);
- ``small``: the fixed cost of exporting the built-in sample (``ckpttool sample``) beside
  ``python -c pass``;
- ``many`` (``--only many``, off by default): ``--many N`` one-chunk tensors (``bench_inspect.py``'s
  ``make_many_entries_checkpoint(..., sharded_every=0)``: 8 data files, each tensor ``[4, 16]``
  BF16 in its own ~1.9 KB ``torch.save`` archive), metadata cache warm, beside ``cp -r`` of the
  output; wall and CPU seconds (user + system of the process); ``--many-baseline DIR`` runs another
  copy of the package (a worktree of an older revision) on the same checkpoint, alternated, and
  checks its output is byte-identical.

Targets: transforming exports >= 50% of ``cp -r``'s throughput of the same output bytes,
peak RSS <= 256 MiB + one slab per worker; the small export's fixed cost <= 0.15 s.
GB/s = output bytes / seconds (10^9).

Usage::

    python bench/bench_export.py [--root /tmp/ckpttool-bench-export] [--repeat 3] [--big-gib 6]
                                 [--only preserve cast per-expert ...] [--skip-torch]
    python bench/bench_export.py --only many --many 100000 [--many-baseline DIR] --repeat 2
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ckpts import WORLD, build, dense_rank, layers_for, moe_legacy_rank  # noqa: E402

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
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd[:5])} failed:\n{err.read().decode()[-2000:]}")
        rss = int(rss_file.read().split()[-1]) * 1024 if _TIME else usage.ru_maxrss * 1024
        return seconds, rss, out.read().decode()


def _run_cpu(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[float, float]:
    """Run ``cmd``; return (wall seconds, CPU seconds: user + system of it and its children)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed:\n{err[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime


def _many_case(root: Path, n: int, repeat: int, baseline: Path | None) -> list[str]:
    """Export of ``n`` one-chunk tensors beside ``cp -r`` of its output (and ``baseline``'s package), alternated."""
    from bench_inspect import make_many_entries_checkpoint

    ckpt = root / f"many-{n}"
    if not (ckpt / ".metadata").is_file():
        make_many_entries_checkpoint(ckpt, n, 8, 0)
    runs: dict[str, list[tuple[float, float]]] = {}
    # each package from its own tree: ``python -c`` puts the working directory first on sys.path
    trees = [("ckpttool export (this tree)", ROOT, root / "many-out")]
    if baseline is not None:
        trees.append((f"ckpttool export ({baseline})", baseline.resolve(), root / "many-out-base"))
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()"]
    lines = []
    for label, tree, _ in trees:
        env = dict(os.environ, PYTHONPATH=str(tree))
        where = subprocess.run(
            [sys.executable, "-c", "import ckpttool; print(ckpttool.__file__)"], env=env, cwd=tree, capture_output=True
        )
        lines.append(f"  {label}: {where.stdout.decode().strip()}")
    _run_cpu([*cli, "inspect", str(ckpt), "--json"], cwd=ROOT)  # the metadata cache, as a second run finds it
    for _ in range(repeat):
        for label, tree, out in trees:
            shutil.rmtree(out, ignore_errors=True)
            _warm(ckpt)
            env = dict(os.environ, PYTHONPATH=str(tree))
            runs.setdefault(label, []).append(_run_cpu([*cli, "export", str(ckpt), str(out)], env, tree))
        cp_out = root / "many-cp"
        shutil.rmtree(cp_out, ignore_errors=True)
        _warm(trees[0][2])
        runs.setdefault("cp -r of the output (baseline)", []).append(
            _run_cpu(["cp", "-r", str(trees[0][2]), str(cp_out)])
        )
        shutil.rmtree(cp_out, ignore_errors=True)
    nbytes = _output_bytes(trees[0][2])
    cp_wall = min(w for w, _ in runs["cp -r of the output (baseline)"])
    lines.insert(0, f"many ({n} one-chunk tensors, {nbytes / 1e6:.1f} MB out): best of {repeat}, wall / CPU seconds")
    for label, rs in runs.items():
        w, c = min(r[0] for r in rs), min(r[1] for r in rs)
        lines.append(f"  {label:44s} {w:8.2f} s wall {c:8.2f} s CPU   {w / cp_wall:7.1f}x cp -r wall")
    if baseline is not None:
        same = all(
            (trees[0][2] / f).read_bytes() == (trees[1][2] / f).read_bytes()
            for f in ("model.safetensors", "model.safetensors.index.json")
        )
        lines.append(f"  output byte-identical to the baseline's: {same}")
    for _, _, out in trees:
        shutil.rmtree(out, ignore_errors=True)
    return lines


def _warm(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def _output_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def _same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def load(d: Path) -> dict[str, str]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
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


def _check_cast(ckpt: Path, out: Path, dtype: str, key: str) -> bool:
    """One exported tensor equals torch's own ``.to(dtype)`` of the stored tensor, bitwise."""
    import torch
    from safetensors import safe_open

    sys.path.insert(0, str(ROOT))
    from ckpttool.format.reader import CheckpointReader

    with CheckpointReader(ckpt) as r:
        want = r.read_tensor(key).to(getattr(torch, dtype))
    name = key[len("model.") :]
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            if name in h.keys():
                got = h.get_tensor(name)
                return bool(torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)))
    return False


# ------------------------------------------------------------------------------------------ main


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, int, int, str]] = []

    def add(self, case: str, approach: str, seconds: float, rss: int, nbytes: int, note: str = "") -> None:
        self.rows.append((case, approach, seconds, rss, nbytes, note))

    def print(self) -> None:
        print(f"{'case':22s} {'approach':44s} {'seconds':>8s} {'GB/s':>7s} {'peak RSS':>10s}  note")
        for case, approach, s, rss, nb, note in self.rows:
            rss_s = f"{rss / 2**20:.0f} MiB" if rss else "-"
            print(f"{case:22s} {approach:44s} {s:8.2f} {nb / s / 1e9:7.3f} {rss_s:>10s}  {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-export"))
    ap.add_argument("--shard-size", default="256MB", help="output shard size for ckpttool and (b)")
    ap.add_argument("--workers", type=int, default=None, help="ckpttool --workers (default: its own)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per approach; the fastest is reported")
    ap.add_argument("--big-gib", type=float, default=0.0, help="also the cast case on an FP32 model of this many GB")
    ap.add_argument("--skip-torch", action="store_true", help="leave out the torch baselines (a) and (b)")
    ap.add_argument("--only", nargs="*", help="cases to run: preserve cast master per-expert fused big small many")
    ap.add_argument("--many", type=int, default=100_000, help="one-chunk tensors of the many case")
    ap.add_argument("--many-baseline", type=Path, default=None, help="another copy of the package for the many case")
    args = ap.parse_args()
    import compileall

    sys.path.insert(0, str(ROOT))
    import ckpttool
    from ckpttool.ui.options import parse_size

    # as `pip install` does: start-up is measured with bytecode caches, also under PYTHONDONTWRITEBYTECODE
    compileall.compile_dir(os.path.dirname(ckpttool.__file__), quiet=1)
    shard_bytes = parse_size(args.shard_size, "--shard-size")
    root: Path = args.root
    root.mkdir(parents=True, exist_ok=True)
    want = set(args.only or ["preserve", "cast", "master", "per-expert", "fused", "big", "small"])
    table = Table()
    notes: list[str] = []
    cli = [sys.executable, "-c", "from ckpttool.cli import main; main()"]

    def best(
        cmd: list[str], out: Path | None, repeat: int, warm: Path | None, mkdir: bool = False
    ) -> tuple[float, int, str]:
        runs = []
        for _ in range(repeat):
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
                if mkdir:
                    out.mkdir()
            if warm is not None:
                _warm(warm)
            runs.append(_run(cmd))
        return min(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]

    def export_case(case: str, ckpt: Path, flags: list[str], check: Any = None) -> None:
        out, cp_out = root / "out", root / "out-cp"
        cmd = [*cli, "export", str(ckpt), str(out), "--shard-size", args.shard_size, "--json", *flags]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        s, rss, doc_text = best(cmd, out, args.repeat, ckpt)
        doc = json.loads(doc_text)
        nbytes = _output_bytes(out)
        c, crss, _ = best(["cp", "-r", str(out), str(cp_out)], cp_out, args.repeat, out)
        shutil.rmtree(cp_out, ignore_errors=True)
        ok = check(out) if check is not None else None
        table.add(case, f"ckpttool export {' '.join(flags)}".strip(), s, rss, nbytes, f"{c / s:.0%} of cp -r")
        table.add(case, "  in-process (--json seconds)", doc["seconds"], 0, nbytes)
        table.add(case, "  cp -r of the output (baseline)", c, crss, nbytes)
        if ok is not None:
            notes.append(f"{case}: output equals torch's .to() bitwise: {ok}")
        shutil.rmtree(out, ignore_errors=True)

    if want & {"preserve", "master"}:
        llama = build(root / "ckpt", dense_rank, 2, "bfloat16", True)
        disk = sum(p.stat().st_size for p in llama.iterdir() if p.is_file())
        notes.append(f"preserve/master: {disk / 2**30:.2f} GiB on disk ({WORLD} ranks), BF16 model + FP32 state")
    if "preserve" in want:
        export_case("preserve", llama, [])
        if not args.skip_torch:
            outs = {n: root / n for n in ("ck", "a", "b")}
            _run([*cli, "export", str(llama), str(outs["ck"]), "--shard-size", args.shard_size])
            tmp_pt = root / "a.pt"
            nbytes = _output_bytes(outs["ck"])
            s, rss, _ = best(
                [sys.executable, "-c", BASELINE_A, str(llama), str(tmp_pt), str(outs["a"])], outs["a"], 1, llama, True
            )
            tmp_pt.unlink(missing_ok=True)
            table.add("preserve", "(a) dcp_to_torch_save + save_file", s, rss, nbytes)
            s, rss, _ = best(
                [sys.executable, "-c", BASELINE_B, str(llama), str(outs["b"]), str(shard_bytes)],
                outs["b"],
                args.repeat,
                llama,
                True,
            )
            table.add("preserve", "(b) per-shard dcp.load + save_file", s, rss, nbytes)
            notes.append(f"preserve: ckpttool output == (b) output: {_same_tensors(outs['ck'], outs['b'])}")
            for d in outs.values():
                shutil.rmtree(d, ignore_errors=True)
    if "master" in want:
        export_case(
            "master cast",
            llama,
            ["--weights", "master", "--save-dtype", "bfloat16"],
        )
    if "cast" in want:
        fp32 = build(root / "fp32-1g", dense_rank, 2, "float32", False)
        export_case(
            "cast 1 GB fp32->bf16",
            fp32,
            ["--save-dtype", "bfloat16"],
            lambda out: _check_cast(fp32, out, "bfloat16", "model.model.layers.1.mlp.down_proj.weight"),
        )
    if want & {"per-expert", "fused"}:
        moe = build(root / "moe-legacy", moe_legacy_rank)
    if "per-expert" in want:
        export_case("MoE per-expert", moe, ["--experts", "per-expert"])
    if "fused" in want:
        export_case("MoE fused un-permuted", moe, ["--experts", "fused"])
    if "big" in want and args.big_gib > 0:
        layers = layers_for(args.big_gib, 4)
        big = build(root / f"fp32-{args.big_gib:g}g", dense_rank, layers, "float32", False)
        export_case(f"cast {args.big_gib:g} GB fp32->bf16", big, ["--save-dtype", "bfloat16"])
    if "many" in (args.only or []):
        notes += _many_case(root, args.many, args.repeat, args.many_baseline)
    if "small" in want:
        sample = root / "sample"
        if not (sample / ".metadata").is_file():
            _run([*cli, "sample", str(sample)])
        out = root / "out-small"
        s, rss, _ = best([*cli, "export", str(sample), str(out), "--json"], out, max(args.repeat, 5), sample)
        p, prss, _ = best([sys.executable, "-c", "pass"], None, max(args.repeat, 5), None)
        nbytes = _output_bytes(out)
        table.add("small (sample)", "ckpttool export", s, rss, nbytes, f"fixed cost {s - p:.3f} s (target <= 0.15 s)")
        table.add("small (sample)", "  python -c pass (baseline)", p, prss, nbytes)
        shutil.rmtree(out, ignore_errors=True)

    print(
        f"machine: {os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; best of {args.repeat}"
    )
    table.print()
    for n in notes:
        print(n)
    print("targets: transforming exports >= 50% of cp -r; peak RSS <= 256 MiB + one slab per worker")


if __name__ == "__main__":
    main()
