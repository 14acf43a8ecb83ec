"""Runs spread over torchrun ranks (gloo on 127.0.0.1): equal to the single-process run, bitwise.

Each test starts ``torchrun --nproc-per-node N -m ckpttool ...`` on a free port and compares
with the same command run in one process; a rank failing on a damaged chunk it owns fails the
whole run with one ``error:`` line naming the rank, and leaves no output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpttool.ops.distributed import Group, assign
from tests.fixtures.cache import copy_checkpoint
from tests.fixtures.damage import corrupt_chunk_bytes
from tests.fixtures.dcp_equal import assert_same_state
from tests.fixtures.s3 import free_port

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def torchrun_cmd(n: int) -> list[str]:
    """``torchrun`` of ``n`` ranks on a port free now (another process may take it before torchrun listens)."""
    assert TORCHRUN is not None
    return [TORCHRUN, "--nproc-per-node", str(n), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def port_taken(stderr: str) -> bool:
    """torchrun could not listen on its port (taken since :func:`free_port`): it exits 1 before any rank starts."""
    return "EADDRINUSE" in stderr and "failed to listen" in stderr


def run_torchrun(n: int, args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` of ``torchrun_cmd(n) + args``, on another port when the port was taken (no rank ran)."""
    for _ in range(4):
        r = subprocess.run([*torchrun_cmd(n), *args], capture_output=True, text=True, timeout=300, **kwargs)
        if not port_taken(r.stderr):
            break
    return r


def torchrun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CKPTTOOL_DEBUG", None)
    return run_torchrun(n, ["-m", "ckpttool", *args], env=env)


def single(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True, text=True, timeout=300)


def files_of(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` but ckpttool's marker (its token and pid differ from run to run)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() != ".ckpttool-output.json"
    }


def test_assign_balances_by_size_and_is_deterministic() -> None:
    assert assign([5, 1, 4, 2], 2) == [0, 0, 1, 1]  # loads 6 and 6
    assert assign([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert assign([3], 4) == [0]


def test_single_group_collectives_are_no_ops() -> None:
    g = Group()
    assert g.broadcast(3) == 3 and g.gather(4) == [4]
    g.agree(None)
    with pytest.raises(ValueError):
        g.agree(ValueError("x"))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.heavy)])  # 4 ranks: in the full run
def test_export_on_n_ranks_is_bitwise_the_single_process_export(sample_ckpt: Path, tmp_path: Path, n: int) -> None:
    args = ["--shard-size", "20KB", "--save-dtype", "bfloat16", "--experts", "per-expert"]
    assert single("export", str(sample_ckpt), str(tmp_path / "one"), *args).returncode == 0
    r = torchrun(n, "export", str(sample_ckpt), str(tmp_path / "many"), *args, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    want = files_of(tmp_path / "one")
    assert len([f for f in want if f.endswith(".safetensors")]) >= n  # every rank had a file to write
    assert files_of(tmp_path / "many") == want
    doc = json.loads(r.stdout)  # rank 0 alone printed one document
    assert doc["bytes_read"] > 0 and len(doc["files"]) == len(want) - 1


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.heavy)])  # 4 ranks: in the full run
def test_validate_deep_on_n_ranks_equals_single_process(sample_ckpt: Path, n: int) -> None:
    one = single("validate", str(sample_ckpt), "--deep", "--json")
    many = torchrun(n, "validate", str(sample_ckpt), "--deep", "--json")
    assert many.returncode == one.returncode == 0, many.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(many.stdout)
    assert a["stats"]["bytes_read"] == b["stats"]["bytes_read"]
    for d in (a, b):
        d.pop("stats")
        for rule in d.get("rules", []):
            rule.pop("seconds", None)
    assert a == b


@pytest.mark.heavy  # CI time
@pytest.mark.slow
def test_validate_deep_on_2_ranks_finds_a_damaged_chunk(sample_ckpt: Path, tmp_path: Path) -> None:
    bad = copy_checkpoint(sample_ckpt, tmp_path / "bad")
    corrupt_chunk_bytes(bad, "model.model.norm.weight")
    one = single("validate", str(bad), "--deep", "--json")
    many = torchrun(2, "validate", str(bad), "--deep", "--json")
    assert one.returncode == many.returncode == 1
    assert json.loads(one.stdout)["findings"] == json.loads(many.stdout)["findings"]


@pytest.mark.heavy  # CI time
@pytest.mark.slow
def test_a_rank_failing_on_its_chunk_fails_every_rank_and_leaves_no_output(sample_ckpt: Path, tmp_path: Path) -> None:
    args = ["--shard-size", "60KB"]
    good = tmp_path / "good"
    assert single("export", str(sample_ckpt), str(good), *args).returncode == 0
    index = json.loads((good / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    sizes = [(good / f).stat().st_size for f in files]
    owners = dict(zip(files, assign(sizes, 2)))
    victim = next(k for k, f in sorted(index["weight_map"].items()) if owners[f] == 1)
    bad = copy_checkpoint(sample_ckpt, tmp_path / "bad")
    corrupt_chunk_bytes(bad, "model." + victim)
    out = tmp_path / "out"
    r = torchrun(2, "export", str(bad), str(out), *args)
    assert r.returncode != 0  # torchrun exits 1 when a rank fails; each rank exited 2
    assert "exitcode  : 2" in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("error: [E3") and "rank 1:" in errors[0] and victim in errors[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]


@pytest.mark.heavy  # CI time
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_reshard_on_n_ranks_loads_as_the_single_process_reshard(sample_ckpt: Path, tmp_path: Path, n: int) -> None:
    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    assert single("reshard", str(sample_ckpt), str(tmp_path / "one"), *args).returncode == 0
    r = torchrun(n, "reshard", str(sample_ckpt), str(tmp_path / "many"), *args)
    assert r.returncode == 0, r.stderr[-3000:]
    one, many = files_of(tmp_path / "one"), files_of(tmp_path / "many")
    assert sorted(one) == sorted(many)
    # data files: the same archives except torch.save's per-save serialization id
    for name in one:
        if name.endswith(".distcp"):
            assert len(one[name]) == len(many[name]), name
    assert_same_state(tmp_path / "one", tmp_path / "many", tmp_path)


@pytest.mark.slow
def test_reshard_on_2_ranks_reports_every_ranks_chunks(sample_ckpt: Path, tmp_path: Path) -> None:
    """The summary of a torchrun reshard counted only rank 0's chunks ("33 chunks copied verbatim, 64
    reassembled" where one process says 74 and 128) while its bytes were every rank's; both are the run's now."""
    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2", "--json"]
    one = single("reshard", str(sample_ckpt), str(tmp_path / "one"), *args)
    many = torchrun(2, "reshard", str(sample_ckpt), str(tmp_path / "many"), *args)
    assert one.returncode == 0 and many.returncode == 0, many.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(many.stdout)
    assert a["chunks_copied"] + a["chunks_rewritten"] > 0
    for k in ("chunks_copied", "chunks_rewritten", "bytes_written", "files"):
        assert a[k] == b[k], k


@pytest.mark.heavy  # CI time
@pytest.mark.slow
def test_reshard_rank_failure_fails_every_rank_and_leaves_no_output(sample_ckpt: Path, tmp_path: Path) -> None:
    bad = copy_checkpoint(sample_ckpt, tmp_path / "bad")
    corrupt_chunk_bytes(bad, "model.model.layers.1.mlp.experts.down_proj")
    out = tmp_path / "out"
    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    r = torchrun(2, "reshard", str(bad), str(out), *args)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank " in errors[0] and "down_proj" in errors[0], r.stderr[-3000:]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]


@pytest.mark.slow
@pytest.mark.heavy  # CI time: three torchrun commands
def test_manifests_of_torchrun_outputs_cover_every_rank_and_verify(sample_ckpt: Path, tmp_path: Path) -> None:
    from ckpttool.format import CheckpointReader
    from ckpttool.ops.manifest import build_manifest, load_manifest

    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    r = torchrun(2, "reshard", str(sample_ckpt), str(tmp_path / "rs"), *args, "--manifest")
    assert r.returncode == 0, r.stderr[-3000:]
    written = load_manifest(tmp_path / "rs" / "manifest.json")
    with CheckpointReader(tmp_path / "rs") as rd:
        read = build_manifest(rd, covers="record")
    assert [e.to_dict() for e in written.entries] == [e.to_dict() for e in read.entries]
    assert single("manifest", str(tmp_path / "rs"), "--verify").returncode == 0
    ex = ["--shard-size", "20KB", "--save-dtype", "bfloat16", "--manifest"]
    assert single("export", str(sample_ckpt), str(tmp_path / "one"), *ex).returncode == 0
    r = torchrun(2, "export", str(sample_ckpt), str(tmp_path / "many"), *ex)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "many" / "manifest.json").read_bytes() == (tmp_path / "one" / "manifest.json").read_bytes()
    v = single("manifest", str(tmp_path / "many"), "--verify")
    assert v.returncode == 0, v.stdout + v.stderr


# ------------------------------------------------------------------ import under torchrun
# A script torchrun runs in place of `-m ckpttool`: rank RANK_LIMITED gets a file-size limit
# (RLIMIT_FSIZE) of LIMIT bytes, so its first large write fails (EFBIG) and only that rank fails.
_LIMITED = """\
import os, resource, runpy, sys
if os.environ["RANK"] == os.environ["RANK_LIMITED"]:
    n = int(os.environ["LIMIT"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
sys.argv = ["ckpttool", *sys.argv[1:]]
runpy.run_module("ckpttool", run_name="__main__")
"""


def _differing_bytes(a: bytes, b: bytes) -> int:
    import numpy as np

    return int(np.count_nonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)))


@pytest.fixture(scope="module")
def hf_dir(fixture_root: Path) -> Path:
    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    return cached_build(fixture_root, "import_hf_dirs", hf_models.build_hf_dirs) / "qwen_moe"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--world-size", "3"],
        pytest.param(["--ep-size", "2", "--ep-fsdp-size", "2"], marks=pytest.mark.heavy),  # CI time
        # more ranks than experts: the experts' EP-FSDP chunks cut dim 1 (torchtitan's Shard(1))
        pytest.param(["--ep-size", "2", "--ep-fsdp-size", "8"], marks=pytest.mark.heavy),
    ],
)
def test_import_on_2_ranks_is_the_single_process_import(hf_dir: Path, tmp_path: Path, extra: list[str]) -> None:
    from ckpttool.format import CheckpointReader

    assert single("import", str(hf_dir), str(tmp_path / "one"), *extra).returncode == 0
    r = torchrun(2, "import", str(hf_dir), str(tmp_path / "many"), *extra, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    one, many = files_of(tmp_path / "one"), files_of(tmp_path / "many")
    assert sorted(one) == sorted(many) and len([f for f in one if f.endswith(".distcp")]) >= 3
    with CheckpointReader(tmp_path / "one") as a, CheckpointReader(tmp_path / "many") as b:
        # the same entries, chunks and byte windows (file, offset, length), in the same order
        assert a.metadata.entries == b.metadata.entries and a.metadata.planner_data == b.metadata.planner_data
        assert list(a.metadata.storage.items()) == list(b.metadata.storage.items())
        archives = {f: 0 for f in one if f.endswith(".distcp")}
        for info in a.metadata.storage.values():
            archives[info.relative_path] += 1
    # data files: the same bytes but torch.save's random 40-digit serialization id of each archive
    # (and that entry's CRC-32 in its local and central headers)
    for name, n in archives.items():
        assert len(one[name]) == len(many[name]), name
        assert _differing_bytes(one[name], many[name]) <= n * (40 + 8), name
    assert_same_state(tmp_path / "one", tmp_path / "many", tmp_path)  # torch's reader: bitwise the same state
    doc = json.loads(r.stdout)  # rank 0 alone printed, every file listed
    assert sorted(f["name"] for f in doc["files"]) == sorted(one)


@pytest.mark.slow
@pytest.mark.parametrize("failing", [0, 1])
def test_import_rank_failure_fails_every_rank_and_leaves_no_output(hf_dir: Path, tmp_path: Path, failing: int) -> None:
    script = tmp_path / "limited.py"
    script.write_text(_LIMITED)
    out = tmp_path / "out"
    assert TORCHRUN is not None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK_LIMITED": str(failing), "LIMIT": "4096"}
    env.pop("CKPTTOOL_DEBUG", None)
    r = run_torchrun(2, [str(script), "import", str(hf_dir), str(out), "--world-size", "2"], env=env)
    assert r.returncode != 0
    assert r.stderr.count("exitcode  : ") == 2, r.stderr[-3000:]  # both ranks failed, not just the limited one
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]  # rank 0 alone printed: the failing rank's error
    assert errors[0].startswith(f"error: [E600] rank {failing}: {out}/__{failing}_0.distcp: cannot write"), errors[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]


# rank 1 is slow (it sleeps before its share of the export): the run is interrupted while rank 0
# holds the temporary output and waits for it
_SLOW_RANK_1 = """\
import os, runpy, sys, time
if os.environ["RANK"] == "1":
    from ckpttool.ops.export import execute

    run = execute._Executor.run
    execute._Executor.run = lambda self, *a, **k: (time.sleep(3600), run(self, *a, **k))[1]
elif "WAITING" in os.environ:  # rank 0 says when it enters its first collective after its share
    from ckpttool.ops.distributed import Group

    agree = Group.agree
    def told(self, error):
        if self.phase == "writing":
            open(os.environ["WAITING"], "w").close()
        return agree(self, error)
    Group.agree = told
sys.argv = ["ckpttool", *sys.argv[1:]]
runpy.run_module("ckpttool", run_name="__main__")
"""


# Ctrl-C reaches rank 0 as soon as the output is open while rank 1 goes on writing its share: rank 1
# fills the staging directory (2,000 files, so rank 0's removal takes a while), then keeps adding a file
# each millisecond while rank 0 removes the directory, as a peer's writer threads do until their unit ends
_LATE_PEER = """\
import os, runpy, signal, sys, time
from ckpttool.format.marker import MARKER_NAME
from ckpttool.ops import distributed

enter = distributed.enter_output_dir
def entered(*a, **k):
    tmp = enter(*a, **k)
    deadline = time.monotonic() + 60
    if os.environ["RANK"] == "0":
        while not (tmp / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
    for i in range(2000):
        (tmp / f"early-{i}").touch()
    (tmp / "ready").touch()
    gone = None
    while time.monotonic() < deadline and (gone is None or time.monotonic() < gone + 1.0):
        if gone is None and not (tmp / MARKER_NAME).exists():
            gone = time.monotonic()
        try:
            (tmp / f"late-{time.monotonic_ns()}").touch()
        except FileNotFoundError:
            break
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
distributed.enter_output_dir = entered
sys.argv = ["ckpttool", *sys.argv[1:]]
runpy.run_module("ckpttool", run_name="__main__")
"""


@pytest.mark.slow
def test_ctrl_c_leaves_no_staging_directory_when_a_peer_wrote_there_during_its_removal(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """Rank 0 removes the staging directory as it leaves; a file rank 1 writes there meanwhile made the removal's
    last rmdir fail, and a directory of rank 1's shards was left beside OUT (seen in CI). Rank 0 removes it again
    once every rank has ended."""
    script = tmp_path / "late.py"
    script.write_text(_LATE_PEER)
    out = tmp_path / "out" / "deeper"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CKPTTOOL_DEBUG", None)
    r = run_torchrun(2, [str(script), "export", str(sample_ckpt), str(out)], env=env)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted"], r.stderr[-3000:]
    assert "forcefully exiting" not in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.py"]  # nor the parent of OUT this run made


@pytest.mark.slow
@pytest.mark.parametrize("when", ["output-open", "rank-0-waiting"])
def test_ctrl_c_of_torchrun_publishes_nothing_and_removes_the_temporary_output(
    sample_ckpt: Path, tmp_path: Path, when: str
) -> None:
    """Ctrl-C as soon as rank 0 opened the output, and once it waits in the barrier for rank 1 (the
    sizes half of gloo's two-part gather done on its side: a signal raised there left rank 1 in
    the second half until torchrun killed both 30 s later)."""
    import signal
    import time

    script = tmp_path / "slow.py"
    script.write_text(_SLOW_RANK_1)
    out = tmp_path / "out"
    waiting = tmp_path / "rank-0-waiting"
    assert TORCHRUN is not None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CKPTTOOL_DEBUG", None)
    if when == "rank-0-waiting":
        env["WAITING"] = str(waiting)
    ready = (
        (lambda: waiting.exists())
        if when == "rank-0-waiting"
        else (lambda: bool([p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]))
    )
    args = [str(script), "export", str(sample_ckpt), str(out), "--shard-size", "20KB"]
    interrupted = False
    for _ in range(4):
        proc = subprocess.Popen(
            [*torchrun_cmd(2), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not a test runner's SIG_IGN
        )
        try:
            deadline = time.monotonic() + 300
            while not ready():
                if proc.poll() is not None:
                    break
                if time.monotonic() > deadline:  # a hang guard, not a speed check
                    pytest.fail("the run never opened its output")
                time.sleep(0.02)
            else:
                if when == "rank-0-waiting":
                    time.sleep(1.0)  # rank 0 is inside the gather by now (not a timing assertion)
                proc.send_signal(signal.SIGINT)  # Ctrl-C of torchrun: it stops every rank (SIGTERM)
                interrupted = True
            # The ranks stop at once, not at gloo's timeout (30 min): a run still going after 300 s fails the
            # test here (TimeoutExpired), a generous bound that leaves no doubt about which of the two happened.
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        if not port_taken(err):  # torchrun's port was taken before it listened: again on another
            break
    assert interrupted, "the run ended before it opened its output: " + err[-3000:]
    assert proc.returncode != 0  # torchrun's own exit status (1) on a signal; the ranks exit 130
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted"], err[-3000:]
    assert "forcefully exiting" not in err, err[-3000:]  # every rank left on its own, none was killed
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]


@pytest.mark.heavy  # CI time
@pytest.mark.slow
def test_validate_deep_on_2_ranks_names_a_nan_master_weight(fixture_root: Path, tmp_path: Path) -> None:
    """D004 of a NaN master_weight against its finite BF16 parameter on 2 gloo ranks: each rank's count of NaN
    differences is merged, so the finding says "1 NaN against a number" as one process does (not max |diff| 0)."""
    import torch

    from tests.fixtures import damage
    from tests.fixtures.cache import cached_build
    from tests.ops.validate.test_validate import build_master

    ck = copy_checkpoint(cached_build(fixture_root, "validate_master", build_master), tmp_path / "ck")

    def nan_at_0(t: torch.Tensor) -> torch.Tensor:
        t[0, 0] = float("nan")
        return t

    damage.rewrite_tensor(ck, "optimizer.state.model.layers.1.mlp.down_proj.weight.master_weight", nan_at_0)
    one = single("validate", str(ck), "--strict", "--deep", "--json")
    many = torchrun(2, "validate", str(ck), "--strict", "--deep", "--json")
    assert one.returncode == many.returncode == 1, many.stderr[-3000:]
    d004 = [[f["message"] for f in json.loads(r.stdout)["findings"] if f["code"] == "D004"] for r in (one, many)]
    assert d004[0] == d004[1] and len(d004[0]) == 1 and d004[0][0].endswith("(1 NaN against a number)"), d004


@pytest.mark.slow
def test_validate_deep_on_2_ranks_names_the_worst_amsgrad_element_as_one_process(tmp_path: Path) -> None:
    """D016 on 2 gloo ranks: each rank reads its share of the chunks of an FSDP2 amsgrad save whose
    ``max_exp_avg_sq`` and ``exp_avg_sq`` of one parameter were swapped; the counts and the worst element (its
    global index and values) are merged into the finding one process gives."""
    from tests.fixtures.distributed import run_ranks
    from tests.ops.validate.test_amsgrad_maximum import _fsdp_rank

    run_ranks(2, _fsdp_rank, str(tmp_path))
    ck = tmp_path / "swapped"
    one = single("validate", str(ck), "--strict", "--deep", "--json")
    many = torchrun(2, "validate", str(ck), "--strict", "--deep", "--json")
    assert one.returncode == many.returncode == 1, many.stderr[-3000:]
    found = [[(f["code"], f["message"]) for f in json.loads(r.stdout)["findings"]] for r in (one, many)]
    assert found[0] == found[1] and [c for c, _ in found[0]] == ["D016"], found
