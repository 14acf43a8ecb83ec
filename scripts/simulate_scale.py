"""Simulate a many-node run of ``ckpttool export`` (cast) and ``validate --deep`` on object storage.

From per-process rates (measured on this machine with ``--measure CKPT``, or given), compute for a
checkpoint of ``--total-bytes`` on ``--nodes`` x ``--ranks-per-node`` torchrun ranks what every
rank reads, how many range requests it sends, what rank 0's index/commit step costs, and the
expected wall time, and print a table (``--json``: the same as one JSON document).

The model (each line a term of the wall time; docs/performance.md, "Scaling to a multi-terabyte
checkpoint on many nodes"):

- **start**: torchrun and each rank's ``import torch.distributed`` + the gloo rendezvous
  (``--startup-s``, measured ~3 s for 2 ranks on one node).
- **open**: every rank GETs ``.metadata`` (``--metadata-bytes``) and parses it
  (``--metadata-rate`` chunk records/s, a first run without the parsed-metadata cache).
- **work**: the units are assigned as ckpttool assigns them (``ckpttool.ops.distributed.assign``:
  largest first to the least-loaded rank): export by output file (``--shard-size``), validate
  by chunk. A rank's time is the slowest of its CPU (bytes / the measured per-process rate),
  its share of the node's network (``--node-gbps`` / ranks per node) and its requests
  (``ceil(window / --range-bytes)`` per chunk, ``--in-flight`` at a time, ``--latency-s``
  each); the store's request rate (``--store-rps`` per prefix, ``--prefixes``) bounds all ranks
  together. The slowest rank sets the wall time.
- **commit**: the barrier, rank 0 gathering every rank's records and building the index
  (``--index-rate`` entries/s), then the publish (``--commit-requests`` requests).

Usage::

    python scripts/simulate_scale.py                                  # 1 TB, 64 x 8 ranks, rates below
    python scripts/simulate_scale.py --measure /path/to/fp32-ckpt    # measure the rates here first
    python scripts/simulate_scale.py --total-bytes 2e12 --shard-size 1e9 --json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Per-process work rates (GB/s of source bytes, one process, 1 thread, warm page cache) measured
# with --measure on the 2-core development machine (docs/performance.md); --measure replaces them.
CAST_GBPS = 1.1
DEEP_GBPS = 4.1
METADATA_CHUNKS_PER_S = 60_000.0  # first run (no cache): ~16 s for 10^6 entries of one chunk
INDEX_ENTRIES_PER_S = 250_000.0  # rank 0: index entries built and written per second


@dataclass(frozen=True)
class Setup:
    """The run to simulate: checkpoint, machines, store and per-process rates (units in field names)."""

    total_bytes: float = 1e12
    nodes: int = 64
    ranks_per_node: int = 8
    entries: int = 2900  # tensor entries (a 70B model's parameters, master weights and two moments)
    saved_ranks: int = 512  # chunks per entry: the ranks that saved it (FSDP: every rank holds a shard)
    chunk_bytes: float = 0.0  # 0: total_bytes / (entries * saved_ranks)
    coalesce: bool = False  # neighbouring chunk windows merged into range reads of up to range_bytes
    shard_size: float = 5e9
    range_bytes: float = float(64 * 2**20)
    metadata_bytes: float = 0.0  # 0: ~140 bytes per chunk, as torch's pickle of DCP metadata
    node_gbps: float = 100.0  # network per node, gigabits/s
    latency_s: float = 0.03  # first byte of a range request
    in_flight: int = 8  # --remote-workers
    store_rps: float = 5500.0  # GET requests/s per prefix (S3's documented per-prefix rate)
    prefixes: int = 1
    startup_s: float = 3.0
    cast_gbps: float = CAST_GBPS
    deep_gbps: float = DEEP_GBPS
    metadata_rate: float = METADATA_CHUNKS_PER_S
    index_rate: float = INDEX_ENTRIES_PER_S
    commit_requests: int = 4

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def chunk(self) -> float:
        """Bytes of one chunk."""
        return self.chunk_bytes or self.total_bytes / (self.entries * self.saved_ranks)

    @property
    def chunks(self) -> int:
        return max(1, math.ceil(self.total_bytes / self.chunk))

    @property
    def n_entries(self) -> int:
        return self.entries

    @property
    def md_bytes(self) -> float:
        return self.metadata_bytes or 140.0 * self.chunks


@dataclass(frozen=True)
class Row:
    """One operation's simulated run: the busiest rank's share and the wall time's terms (seconds)."""

    operation: str
    units: int
    busy_ranks: int
    max_rank_bytes: float
    mean_rank_bytes: float
    max_rank_requests: int
    total_requests: int
    start_s: float
    open_s: float
    work_s: float
    bound: str
    commit_s: float
    wall_s: float
    aggregate_gbps: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def assign_heap(sizes: list[float], world: int) -> list[float]:
    """Per-rank load of ckpttool's assignment (largest first to the least loaded rank, ties: lowest rank).

    The same assignment as ``ckpttool.ops.distributed.assign`` in O(n log world) instead of O(n world).
    """
    heap = [(0.0, r) for r in range(world)]
    for s in sorted(sizes, reverse=True):
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + s, r))
    loads = [0.0] * world
    for load, r in heap:
        loads[r] = load
    return loads


def _units(s: Setup, op: str) -> list[float]:
    """Work units in bytes: export's output files (whole chunks, up to ``shard_size``), validate's chunks."""
    if op == "validate --deep":
        unit = s.chunk
    else:
        tensor = s.total_bytes / s.entries
        unit = max(1, int(s.shard_size // tensor)) * tensor
    n = s.total_bytes / unit
    full = math.floor(n + 1e-9)
    rest = s.total_bytes - full * unit
    return [unit] * full + ([rest] if rest > 1e-9 * unit else [])


def simulate(s: Setup, op: str) -> Row:
    """The simulated run of ``op`` (``"export --save-dtype bfloat16"`` or ``"validate --deep"``)."""
    units = _units(s, op)
    loads = assign_heap(units, s.ranks)
    busiest = max(loads)
    if s.coalesce:  # one request per range_bytes of neighbouring windows
        max_requests = math.ceil(busiest / s.range_bytes)
        data_requests = math.ceil(s.total_bytes / s.range_bytes)
    else:  # ckpttool today: each chunk window its own request(s)
        req_per_chunk = max(1, math.ceil(s.chunk / s.range_bytes))
        max_requests = math.ceil(busiest / s.chunk) * req_per_chunk
        data_requests = s.chunks * req_per_chunk
    total_requests = data_requests + s.ranks * max(1, math.ceil(s.md_bytes / s.range_bytes))
    rate = s.deep_gbps if op == "validate --deep" else s.cast_gbps
    cpu_s = busiest / (rate * 1e9)
    net_s = busiest / (s.node_gbps / 8 * 1e9 / s.ranks_per_node)
    req_s = max_requests * s.latency_s / s.in_flight
    store_s = total_requests / (s.store_rps * s.prefixes)
    terms = {"cpu": cpu_s, "network": net_s, "request latency": req_s, "store request rate": store_s}
    bound = max(terms, key=lambda k: terms[k])
    open_s = s.md_bytes / (s.node_gbps / 8 * 1e9 / s.ranks_per_node) + s.chunks / s.metadata_rate
    commit_s = s.n_entries / s.index_rate + s.commit_requests * s.latency_s + s.ranks * 1e-4  # gather: ~0.1 ms/rank
    wall = s.startup_s + open_s + terms[bound] + commit_s
    return Row(
        operation=op,
        units=len(units),
        busy_ranks=sum(1 for x in loads if x > 0),
        max_rank_bytes=busiest,
        mean_rank_bytes=s.total_bytes / s.ranks,
        max_rank_requests=max_requests,
        total_requests=total_requests,
        start_s=s.startup_s,
        open_s=open_s,
        work_s=terms[bound],
        bound=bound,
        commit_s=commit_s,
        wall_s=wall,
        aggregate_gbps=s.total_bytes / wall / 1e9,
    )


def _json_seconds(cmd: list[str]) -> float:
    """The ``seconds`` of a ckpttool ``--json`` run (the work, without start-up)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, check=False)
    if r.returncode not in (0, 1):  # validate: 1 on findings
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-800:]}")
    doc = json.loads(r.stdout)
    if "stats" in doc:  # validate: the --deep pass itself (its total includes opening and the rules)
        return float(doc["stats"]["deep_seconds"])
    return float(doc["seconds"])


def measure(ckpt: Path, repeat: int = 2) -> dict[str, float]:
    """Per-process rates (GB/s of source bytes) of a cast export and ``validate --deep`` of ``ckpt``, best of ``repeat``."""
    nbytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    cli = [sys.executable, "-m", "ckpttool"]
    best = {"cast_gbps": 0.0, "deep_gbps": 0.0}
    with tempfile.TemporaryDirectory(prefix="ckpttool-sim-") as tmp:
        for i in range(repeat):
            out = Path(tmp) / f"out{i}"
            t = _json_seconds([*cli, "export", str(ckpt), str(out), "--save-dtype", "bfloat16", "--workers", "1"])
            best["cast_gbps"] = max(best["cast_gbps"], nbytes / t / 1e9)
            t = _json_seconds([*cli, "validate", str(ckpt), "--deep", "--workers", "1"])
            best["deep_gbps"] = max(best["deep_gbps"], nbytes / t / 1e9)
    best["measured_bytes"] = float(nbytes)
    best["load"] = os.getloadavg()[0]
    return best


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def table(s: Setup, rows: list[Row]) -> str:
    """The rows as a Markdown table, after a line describing the setup."""
    head = (
        f"{_gb(s.total_bytes)} in {s.chunks:,} chunks of {s.chunk / 1e6:,.2f} MB, {s.n_entries:,} entries, "
        f".metadata {_gb(s.md_bytes)}; {s.nodes} nodes x {s.ranks_per_node} ranks = {s.ranks}; "
        f"{s.node_gbps:g} Gb/s per node, {s.latency_s * 1e3:g} ms per request, {s.in_flight} in flight, "
        f"range reads of {s.range_bytes / 2**20:g} MiB{' (neighbouring windows coalesced)' if s.coalesce else ''}; "
        f"rates per process: cast {s.cast_gbps:g} GB/s, "
        f"--deep {s.deep_gbps:g} GB/s"
    )
    lines = [
        head,
        "",
        "| operation | units | busy ranks | bytes, busiest rank (mean) | requests, busiest rank (all) "
        "| start s | open s | work s (bound) | index/commit s | wall s | GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.operation} | {r.units:,} | {r.busy_ranks} | {_gb(r.max_rank_bytes)} ({_gb(r.mean_rank_bytes)}) "
            f"| {r.max_rank_requests:,} ({r.total_requests:,}) | {r.start_s:.1f} | {r.open_s:.1f} "
            f"| {r.work_s:.1f} ({r.bound}) | {r.commit_s:.1f} | {r.wall_s:.1f} | {r.aggregate_gbps:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in Setup.__dataclass_fields__.values():
        if isinstance(f.default, bool):
            ap.add_argument("--" + f.name.replace("_", "-"), action="store_true")
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--measure", type=Path, help="a local DCP checkpoint: measure the per-process rates on it first")
    ap.add_argument("--measure-repeat", type=int, default=2, help="runs of each measured command (best of)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    args = ap.parse_args(argv)
    fields = {k: getattr(args, k) for k in Setup.__dataclass_fields__}
    measured = None
    if args.measure is not None:
        t0 = time.perf_counter()
        measured = measure(args.measure, args.measure_repeat)
        fields.update(cast_gbps=measured["cast_gbps"], deep_gbps=measured["deep_gbps"])
        measured["seconds"] = time.perf_counter() - t0
    s = Setup(**fields)
    rows = [simulate(s, "export --save-dtype bfloat16"), simulate(s, "validate --deep")]
    if args.json:
        print(json.dumps({"setup": asdict(s), "measured": measured, "rows": [r.to_dict() for r in rows]}))
    else:
        if measured is not None:
            print(f"measured on {args.measure}: {json.dumps(measured)}")
        print(table(s, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
