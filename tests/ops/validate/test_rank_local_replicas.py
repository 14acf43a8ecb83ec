"""`validate` on a ``dcp.save(..., use_collectives=False)`` save of a replicated model (every rank saves every tensor).

Each rank writes ``__R.metadata`` and ``__R_0.distcp`` with its own copy of everything, and each rank's
``dcp.load`` reads its own ``__R.metadata`` and file. ckpttool reads the lowest rank's copies; the higher ranks'
files are still data files of the checkpoint: not "unreferenced" (``S006``) when intact, ``S002``/``S003`` when
missing or short (rank 1's resume would fail on them), and with ``--deep`` a copy whose values differ from the lowest
rank's is ``D014`` (rank 1 would resume from other weights). Written by 2 real gloo ranks.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build, copy_checkpoint
from tests.fixtures.distributed import run_ranks

pytestmark = pytest.mark.slow  # a 2-rank gloo job

runner = CliRunner()


def _rank(rank: int, world: int, out: str, drift: bool = False) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(7))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if drift and rank == 1:  # a parameter left out of the gradient all-reduce; a rank that skipped a step
        with torch.no_grad():
            model[1].weight.add_(0.5)
        opt.state[model[0].bias]["step"] -= 1
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out, use_collectives=False)


def _build(out: Path) -> None:
    run_ranks(2, _rank, str(out / "ckpt"))
    run_ranks(2, _rank, str(out / "drift"), True)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(os.environ.get("CKPTTOOL_FIXTURE_CACHE") or tmp_path_factory.mktemp("fx"))
    return cached_build(root, "rank_local_replicated", _build) / "ckpt"


def _validate(ck: Path, *more: str) -> tuple[int, list[tuple[str, str | None, str]]]:
    res = runner.invoke(app, ["validate", str(ck), "--strict", "--json", *more])
    doc: dict[str, Any] = json.loads(res.stdout)
    return res.exit_code, [(f["code"], f["error_code"], f["message"]) for f in doc["findings"]]


def test_clean_replicated_save_has_no_unreferenced_file(replicated: Path) -> None:
    assert sorted(p.name for p in replicated.iterdir()) == [
        "__0.metadata",
        "__0_0.distcp",
        "__1.metadata",
        "__1_0.distcp",
    ]
    assert _validate(replicated) == (0, [])
    assert _validate(replicated, "--deep") == (0, [])


def test_a_rank_whose_copy_drifted_is_d014_with_deep(replicated: Path) -> None:
    drift = replicated.parent / "drift"
    assert _validate(drift) == (0, [])  # the lowest rank's copies are what is read: only --deep compares
    rc, found = _validate(drift, "--deep")
    assert rc == 1 and [(c, e) for c, e, _ in found] == [("D014", None)] * 2, found
    msgs = sorted(m for _, _, m in found)
    assert msgs[0].startswith(
        "model.1.weight at [0, 0]: __1_0.distcp against __0_0.distcp: 32 of 32 elements differ (max |diff| 0.5); "
    ), msgs
    assert msgs[1] == (
        "optim.state.0.bias.step at []: __1_0.distcp against __0_0.distcp: 1 of 1 elements differ (max |diff| 1); "
        "first at element 0: 1 against 2"
    ), msgs


def _rank_dtypes(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "rope.table": torch.randn(16, dtype=torch.complex64, generator=g),  # rotary tables are complex
        "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "tokens": torch.arange(16, dtype=torch.int64) * 2**58,  # beyond float64's 53 bits
    }
    if rank == 1:  # each drifted where a float64 comparison of real values cannot see it
        state["rope.table"][3] += 0.5j
        state["fp8"][5] = torch.tensor(7.0).to(torch.float8_e4m3fn)
        state["tokens"][9] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=out, use_collectives=False)


def test_drift_in_complex_fp8_and_int64_copies_is_d014(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank copies differing only in a complex value's imaginary part, in an FP8 value, or in an int64 above 2**53:
    before, the imaginary part was cast away (no finding, NumPy's ComplexWarning printed), the int64s compared equal
    in float64, and FP8 stopped validate with E999 (NumPy has no float8 dtype). Each is D014 now, counting the one
    value that differs."""
    root = Path(os.environ.get("CKPTTOOL_FIXTURE_CACHE") or tmp_path_factory.mktemp("fx"))
    ck = cached_build(root, "rank_local_replicated_dtypes", lambda out: run_ranks(2, _rank_dtypes, str(out / "c")))
    rc, found = _validate(ck / "c", "--deep")
    assert rc == 1 and [(c, e) for c, e, _ in found] == [("D014", None)] * 3, found
    msgs = sorted(m for _, _, m in found)
    assert msgs[0].startswith("fp8 at [0]: __1_0.distcp against __0_0.distcp: 1 of 16 elements differ"), msgs
    assert msgs[0].endswith("first at element 5: 7 against " + msgs[0].rsplit(" ", 1)[1]), msgs
    assert msgs[1].startswith("rope.table at [0]: __1_0.distcp against __0_0.distcp: 1 of 16 elements differ"), msgs
    assert "(max |diff| 0.5); first at element 3: " in msgs[1], msgs
    assert msgs[2] == (
        "tokens at [0]: __1_0.distcp against __0_0.distcp: 1 of 16 elements differ (max |diff| 1); "
        f"first at element 9: {9 * 2**58 + 1} against {9 * 2**58}"
    ), msgs


def _rank_ulp(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"ulp": torch.randn(8, 8, generator=g), "milli": torch.randn(8, 8, generator=g)}
    if rank == 1:  # a replica one ulp off (a reduction summed in another order), and one 1e-3 off
        state["ulp"][2, 3] = torch.nextafter(state["ulp"][2, 3], torch.tensor(math.inf))
        state["milli"][2, 3] += 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=out, use_collectives=False)


def test_a_replica_one_ulp_off_is_d014_naming_both_values(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A copy one ulp off is found as surely as one 1e-3 off; before, its message printed the two values to 6
    digits, the same (``0.190943 against 0.190943``): they are printed in full where 6 digits cannot tell them."""
    import torch

    root = Path(os.environ.get("CKPTTOOL_FIXTURE_CACHE") or tmp_path_factory.mktemp("fx"))
    ck = cached_build(root, "rank_local_replicated_ulp", lambda out: run_ranks(2, _rank_ulp, str(out / "c")))
    rc, found = _validate(ck / "c", "--deep")
    assert rc == 1 and [(c, e) for c, e, _ in found] == [("D014", None)] * 2, found
    msgs = sorted(m for _, _, m in found)
    g = torch.Generator().manual_seed(0)  # rank 0's copies, as _rank_ulp made them
    ulp, milli = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    a, m = float(ulp[2, 3]), float(milli[2, 3])
    b = float(torch.nextafter(ulp[2, 3], torch.tensor(math.inf)))
    assert f"{a:.6g}" == f"{b:.6g}"
    head = "at [0, 0]: __1_0.distcp against __0_0.distcp: 1 of 64 elements differ"
    assert msgs[0].startswith(f"milli {head} (max |diff| 0.001)"), msgs
    assert msgs[0].endswith(f"first at element 19: {float(milli[2, 3] + 1e-3):.6g} against {m:.6g}"), msgs
    assert msgs[1] == f"ulp {head} (max |diff| {b - a:.4g}); first at element 19: {b!r} against {a!r}", msgs


def test_a_higher_rank_file_missing_or_short_is_found(replicated: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(replicated, tmp_path / "short")
    size = (ck / "__1_0.distcp").stat().st_size
    os.truncate(ck / "__1_0.distcp", 1000)
    rc, found = _validate(ck)
    assert rc == 1 and [(c, e) for c, e, _ in found] == [("S003", "E300")], found
    assert found[0][2].startswith(f"__1_0.distcp: 28 chunk(s) end past the end of the file (1000 bytes, needs {size})")
    (ck / "__1_0.distcp").unlink()
    rc, found = _validate(ck)
    assert (rc, found) == (
        1,
        [("S002", "E300", "__1_0.distcp: data file missing; 28 chunks/byte items are stored in it")],
    )


@pytest.mark.parametrize("rank1", ["tmp", "none"])
def test_a_run_step_whose_rank_has_not_written_its_metadata_is_incomplete(
    replicated: Path, tmp_path: Path, rank1: str
) -> None:
    """A run's newest step where rank 0 has written ``__0.metadata`` and rank 1 its data file but not yet its
    ``__1.metadata`` (torch writes ``__1.metadata.tmp``, then renames it) was a checkpoint to discovery:
    `--step latest` chose it and failed E202, the run root was "2 checkpoints" (E204, its example the unfinished
    step), and validate of the complete step said nothing (R001). Now it is step 2 incomplete, as a save without
    ``.metadata``."""
    run = tmp_path / "run"
    copy_checkpoint(replicated, run / "step-1")
    newer = copy_checkpoint(replicated, run / "step-2")
    if rank1 == "tmp":
        (newer / "__1.metadata").rename(newer / "__1.metadata.tmp")
    else:
        (newer / "__1.metadata").unlink()
    for given in (["--step", "latest"], []):
        res = runner.invoke(app, ["validate", str(run), *given, "--json"])
        doc = json.loads(res.stdout)
        assert res.exit_code == 0 and doc["path"] == str(run / "step-1"), res.output
        r001 = [f for f in doc["findings"] if f["code"] == "R001"]
        assert len(r001) == 1 and "__1.metadata" in r001[0]["message"] and "step 2" in r001[0]["message"], r001
    res = runner.invoke(app, ["inspect", str(run), "--step", "2"])
    assert res.exit_code == 2 and "[E202]" in res.stderr and "step 2 is incomplete" in res.stderr, res.output
    assert "no __1.metadata" in res.stderr
    res = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert res.exit_code == 0 and "step 1 (the highest complete step; step 2 is incomplete" in res.stdout, res.output
