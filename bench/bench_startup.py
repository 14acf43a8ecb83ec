"""Benchmark: start-up and fixed costs of ``ckpttool`` commands as fresh processes, beside ``python -c pass``.

Writes the built-in sample (``ckpttool sample``: a 0.7 MB DCP checkpoint, 102 entries) once, then runs
each case ``--runs`` times as a fresh process (``sys.executable -m ckpttool ...``, stdout to a pipe as in
a script) and prints, per case, the median wall time and the median CPU time (user + sys of the child,
from ``os.wait4``'s rusage). CPU time is the figure to compare on a loaded machine: wall time there
includes waiting for a core. Cases:

  * ``python -c pass``: the interpreter's own start-up (the floor);
  * ``ckpttool --help``, ``inspect SAMPLE``, ``inspect SAMPLE --json``, ``validate SAMPLE``;
  * ``export SAMPLE OUT --overwrite`` and ``cp -r OUT`` of its output: the export's fixed cost is its
    time minus that of moving its bytes (``cp -r``; ~0.7 MB, a few ms);
  * imports: which of torch, numpy, rich and ``ckpttool.ops`` each command imported (``sys.modules``
    at exit; one extra run each).

``--instructions``: also the instructions each case executes (one run under valgrind's cachegrind,
``I refs``), a figure that the load of a shared machine does not change, beside ``python -c pass``'s.

Bytecode: the runs use the ``__pycache__`` an installed package has (``compileall`` first,
``PYTHONDONTWRITEBYTECODE`` unset for the children); without bytecode every run compiles the package.
``--baseline DIR`` runs every case with another copy of the package too, interleaved, side by side.

Targets (issue 30, item 5): ``--help`` <= 0.10 s, ``inspect`` of the sample <= 0.20 s, an export's fixed
cost <= 0.25 s.

Usage: python bench/bench_startup.py [--runs 9] [--workdir /tmp/ckpttool-bench-startup] [--baseline DIR]
       [--instructions]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env["NO_COLOR"] = "1"
    # the children run in the work directory (``-m``/``-c`` put the current directory first on sys.path):
    # this checkout's package comes from PYTHONPATH, the baseline's (--baseline) from before it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def measure(argv: list[str], runs: int, env: dict[str, str]) -> tuple[float, float, int]:
    """Median wall and median CPU of ``runs`` fresh processes of ``argv`` (after one warm-up run)."""
    subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False, cwd=env["CKPTTOOL_BENCH_CWD"]
    )
    walls, cpus, code = [], [], 0
    for _ in range(runs):
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=env["CKPTTOOL_BENCH_CWD"]
        )
        t0 = time.perf_counter()
        proc.stdout.read()  # type: ignore[union-attr]
        proc.stderr.read()  # type: ignore[union-attr]
        _, status, usage = os.wait4(proc.pid, 0)
        walls.append(time.perf_counter() - t0)
        cpus.append(usage.ru_utime + usage.ru_stime)
        proc.returncode = os.waitstatus_to_exitcode(status)
        code = code or proc.returncode
    return statistics.median(walls), statistics.median(cpus), code


_PROBE = (
    "import atexit, sys\n"
    "listing = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(listing, 'w').write('\\n'.join(sys.modules)))\n"
    "from ckpttool.cli import main\n"
    "sys.argv[0] = 'ckpttool'\n"
    "main()\n"
)


def imported(args: list[str], env: dict[str, str], work: Path) -> list[str]:
    """Which of torch, numpy, rich and ckpttool.ops one run of ``ckpttool ARGS`` imports (``sys.modules`` at exit)."""
    listing = work / "modules.txt"
    subprocess.run(
        [sys.executable, "-c", _PROBE, str(listing), *args], capture_output=True, env=env, check=False, cwd=work
    )
    mods = set(listing.read_text().split())
    return sorted(
        top
        for top in ("torch", "numpy", "rich", "ckpttool.ops")
        if any(m == top or m.startswith(top + ".") for m in mods)
    )


def instructions(argv: list[str], env: dict[str, str]) -> float | None:
    """Millions of instructions one run of ``argv`` executes (valgrind cachegrind ``I refs``); None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    proc = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=env["CKPTTOOL_BENCH_CWD"],
        check=False,
    )
    refs = [ln for ln in proc.stderr.splitlines() if "I   refs:" in ln or "I    refs:" in ln]
    return int(refs[-1].split(":")[1].replace(",", "")) / 1e6 if refs else None


def _cases(py: str, sample: Path, out: Path) -> list[tuple[str, list[str]]]:
    ck = [py, "-m", "ckpttool"]
    return [
        ("python -c pass", [py, "-c", "pass"]),
        ("ckpttool --help", [*ck, "--help"]),
        ("ckpttool inspect SAMPLE", [*ck, "inspect", str(sample)]),
        ("ckpttool inspect SAMPLE --json", [*ck, "inspect", str(sample), "--json"]),
        ("ckpttool validate SAMPLE", [*ck, "validate", str(sample)]),
        ("ckpttool export SAMPLE OUT", [*ck, "export", str(sample), str(out), "--overwrite"]),
    ]


def _cp_r(out: Path, copy: Path, runs: int) -> tuple[float, float]:
    """Median wall and CPU of ``cp -r OUT COPY`` (the export's bytes moved by the kernel and nothing else)."""
    walls, cpus = [], []
    for _ in range(runs):
        shutil.rmtree(copy, ignore_errors=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(["cp", "-r", str(out), str(copy)])
        _, _, usage = os.wait4(proc.pid, 0)
        walls.append(time.perf_counter() - t0)
        cpus.append(usage.ru_utime + usage.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench-startup"))
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a directory holding another ckpttool package (e.g. `git archive REV ckpttool | tar -x -C DIR`): "
        "each case also runs with it first on PYTHONPATH, interleaved, side by side",
    )
    ap.add_argument(
        "--instructions", action="store_true", help="also count each case's instructions once (valgrind cachegrind)"
    )
    args = ap.parse_args()
    env = _env()
    py = sys.executable
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    sample, out, copy = work / "sample", work / "out", work / "out-cp"
    subprocess.run(
        [py, "-m", "ckpttool", "sample", str(sample), "--overwrite"], check=True, env=env, capture_output=True
    )
    for root in (REPO, args.baseline):  # bytecode, as a pip install leaves it (warm-up runs would write it too)
        if root is not None:
            subprocess.run([py, "-m", "compileall", "-q", str(Path(root) / "ckpttool")], check=False, env=env)
    env["CKPTTOOL_BENCH_CWD"] = str(work)
    envs = {"": env}
    if args.baseline is not None:
        base = dict(env)
        base["PYTHONPATH"] = os.pathsep.join([str(args.baseline.resolve()), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        envs = {"before": base, "after": env}
    print(f"python {sys.version.split()[0]}, {args.runs} runs each, median; load {os.getloadavg()[0]:.1f}")
    instr = "  instr M (x pass)" if args.instructions else ""
    print(f"{'case':44} {'wall s':>8} {'CPU s':>8}{instr}  imports (torch, numpy, rich, ckpttool.ops)")
    floor: float | None = None
    rows: dict[str, tuple[float, float]] = {}
    for name, argv in _cases(py, sample, out):
        for label, e in envs.items():
            if argv[1] != "-m" and label == "before":
                continue
            wall, cpu, code = measure(argv, args.runs, e)
            rows[label + name] = (wall, cpu)
            ck = argv[1:3] == ["-m", "ckpttool"]
            mods = (", ".join(imported(argv[3:], e, work)) or "none") if ck else ""
            flag = f"  exit {code}" if code else ""
            title = f"{name} ({label})" if label and ck else name
            count = ""
            if args.instructions:
                m = instructions(argv, e)
                floor = floor if ck or m is None else m
                count = f"  {m:8.0f} ({m / floor:4.1f}x)" if m is not None and floor else f"  {'-':>17}"
            print(f"{title:44} {wall:8.3f} {cpu:8.3f}{count}  {mods}{flag}")
    cp_wall, cp_cpu = _cp_r(out, copy, args.runs)
    print(f"{'cp -r OUT (moving the bytes)':44} {cp_wall:8.3f} {cp_cpu:8.3f}")
    for label in envs:
        ex_wall, ex_cpu = rows[label + "ckpttool export SAMPLE OUT"]
        title = f"export fixed cost (export - cp -r){f' ({label})' if label else ''}"
        print(f"{title:44} {ex_wall - cp_wall:8.3f} {ex_cpu - cp_cpu:8.3f}")


if __name__ == "__main__":
    main()
