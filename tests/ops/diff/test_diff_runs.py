"""`ckpttool diff` for comparing runs: per-tensor metrics, `--filter`, per-side steps, fail closed.

Inputs are written by torch's own ``dcp.save``: two training runs of the tiny dense LM of
``tests.fixtures.builders`` (FP32, torch AdamW, steps 1 and 3 each), states pickled into byte
items by ``DefaultSavePlanner(flatten_state_dict=False)``, and small hand-made state dicts
whose metrics are known in closed form. The metrics are checked against torch computing them
in float64 on tensors loaded by torch's own ``dcp.load``.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.diff import DiffOptions, diff_checkpoints
from tests.fixtures import builders
from tests.fixtures.cache import cached_build
from tests.ops.diff.test_diff import diff_json

runner = CliRunner()
RUN_STEPS = (1, 3)


def cli(*args: object, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, ["diff", *map(str, args)], env=env)


def refused(*args: object) -> tuple[Any, list[str]]:
    """``cli(*args)`` that must end in exit 2 with nothing on stdout; the result and its stderr lines."""
    res = cli(*args)
    assert res.exit_code == 2 and res.stdout == "", res.output
    return res, res.stderr.splitlines()


def _save(state: dict[str, Any], out: Path, **kw: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(out), no_dist=True, **kw)
    return out


def _train(seed: int) -> Any:
    """Model + AdamW of one run and its batches' generator (the same initial weights in every run)."""
    torch.manual_seed(0)
    model = builders.dense_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05)
    return model, optim, torch.Generator().manual_seed(seed)


def build_runs(out: Path) -> None:
    """``run1/step-{1,3}`` and ``run2/step-{1,3}``: the same initial weights, other batches."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for run, seed in (("run1", 1), ("run2", 2)):
        model, optim, gen = _train(seed)
        for step in range(1, max(RUN_STEPS) + 1):
            optim.zero_grad()
            model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
            optim.step()
            if step in RUN_STEPS:
                msd, osd = get_state_dict(model, optim)
                _save({"model": msd, "optimizer": osd}, out / run / f"step-{step}")


def build_pickled(out: Path) -> None:
    """Two states saved with ``DefaultSavePlanner(flatten_state_dict=False)``: each a byte item ``model``."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        sd = builders.dense_model().state_dict()
        _save({"model": sd}, out / name, planner=DefaultSavePlanner(flatten_state_dict=False))


@pytest.fixture(scope="session")
def runs(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "diff_runs", build_runs)


@pytest.fixture(scope="session")
def pickled(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "diff_pickled", build_pickled)


def reference(path: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer state of ``path`` as torch's ``dcp.load`` reads them, by diff's torch-native names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(0)
    optim.zero_grad()
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()  # creates the state entries dcp.load fills in
    msd, osd = get_state_dict(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(path), no_dist=True)
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, fields in osd["state"].items():
        for f, v in fields.items():
            out[f"optimizer.state.{fqn}.{f}"] = v
    return out


def torch_metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """``max |a-b|``, ``||a-b|| / ||b||``, cosine: torch in float64 on the whole tensors."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    d = a64 - b64
    cos = torch.nn.functional.cosine_similarity(a64, b64, dim=0, eps=0.0)
    return float(d.abs().max()), float(d.norm() / b64.norm()), float(cos)


# ------------------------------------------------------------------------------------------ metrics


@pytest.mark.parametrize("sides", ["runs", "steps"])
def test_metrics_equal_torch_on_dcp_load(runs: Path, sides: str) -> None:
    """Two runs at step 3 (`--step`), and one run's step 1 against its step 3 (`--a-step/--b-step`)."""
    if sides == "runs":
        args: tuple[object, ...] = (runs / "run1", runs / "run2", "--step", "3")
        pa, pb = runs / "run1" / "step-3", runs / "run2" / "step-3"
    else:
        args = (runs / "run1", runs / "run1", "--a-step", "1", "--b-step", "latest")
        pa, pb = runs / "run1" / "step-1", runs / "run1" / "step-3"
    doc = diff_json(*args, "--what", "all", code=1)
    ra, rb = reference(pa), reference(pb)
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert set(by_name) == set(ra) == set(rb)  # model, exp_avg, exp_avg_sq and step of every parameter
    checked = 0
    for name, t in by_name.items():
        a, b = ra[name], rb[name]
        assert t["shape"] == list(a.shape) and t["numel"] == a.numel() and t["a_dtype"] == "float32"
        if torch.equal(a, b):
            assert (t["status"], t["max_abs"], t["rel_l2"], t["cosine"]) == ("equal", 0.0, 0.0, 1.0), name
            continue
        max_abs, rel, cos = torch_metrics(a, b)
        assert t["status"] == "differ" and t["mismatched"] == int((a != b).sum())
        assert t["max_abs"] == pytest.approx(max_abs, rel=1e-12, abs=0), name
        assert t["rel_l2"] == pytest.approx(rel, rel=1e-12), name
        assert t["cosine"] == pytest.approx(cos, rel=1e-12), name
        checked += 1
    assert checked > 40  # 21 parameters, their exp_avg and exp_avg_sq, and the steps
    # sorted by difference, largest first; the summary names the largest
    rels = [t["rel_l2"] for t in doc["tensors"]]
    assert rels == sorted(rels, reverse=True)
    s = doc["summary"]
    assert s["max_rel_l2"] == rels[0] and s["max_rel_l2_name"] == doc["tensors"][0]["name"]
    assert s["tensors"] == len(doc["tensors"]) == doc["counts"]["tensors"]
    assert s["values"] == doc["counts"]["values"] == sum(a.numel() for a in ra.values())
    assert s["min_cosine"] == min(t["cosine"] for t in doc["tensors"])


def test_run_root_and_step_directories_give_one_answer(runs: Path) -> None:
    by_root = diff_checkpoints(runs / "run1" / "step-3", runs / "run2" / "step-3")
    doc = diff_json(runs / "run1", runs / "run2", "--step", "latest", code=1)
    assert [t.to_dict() for t in by_root.tensors] == doc["tensors"]


def test_hf_side_never_gets_the_step(runs: Path, tmp_path: Path) -> None:
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.model.discovery import CheckpointSelection
    from ckpttool.ops.export import ExportOptions
    from ckpttool.ops.export.execute import export_checkpoint

    export_checkpoint(
        runs / "run1", tmp_path / "hf", ExportOptions(), opening=OpenOptions(selection=CheckpointSelection(3))
    )
    for args in (("--step", "3"), ("--a-step", "3")):
        doc = diff_json(runs / "run1", tmp_path / "hf", *args, code=0)
        assert doc["summary"]["equal"] == doc["counts"]["tensors"] > 0
    res = cli(runs / "run1" / "step-3", tmp_path / "hf", "--step", "3")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == (
        f"error: [E100] --step 3 given, but neither {runs / 'run1' / 'step-3'} nor {tmp_path / 'hf'} "
        "is a directory of several checkpoints"
    )


def test_filter_keeps_matching_names_on_both_sides(runs: Path) -> None:
    a, b = runs / "run1" / "step-3", runs / "run2" / "step-3"
    doc = diff_json(a, b, "--filter", "model.layers.0.*", "--filter", "*.norm.weight", "--what", "all", code=1)
    names = {t["name"] for t in doc["tensors"]}
    assert names and all(".layers.0." in n or n.endswith(".norm.weight") for n in names)
    assert {n for n in names if n.startswith("model.")} == {
        k for k in reference(a) if k.startswith("model.model.layers.0.") or k == "model.model.norm.weight"
    }
    assert doc["comparison"]["filters"] == ["model.layers.0.*", "*.norm.weight"]
    assert doc["counts"]["filtered_out"] > 0 and doc["counts"]["different"] == len(names)
    assert all(d["name"] in names or d["kind"] == "hyperparameter" for d in doc["differences"])


def test_progress_counts_the_bytes_of_both_sides(runs: Path) -> None:
    calls: list[tuple[int, int]] = []
    res = diff_checkpoints(
        runs / "run1" / "step-1",
        runs / "run2" / "step-3",
        DiffOptions(what="all"),
        progress=lambda d, t: calls.append((d, t)),
    )
    total = 2 * sum(t.numel * 4 for t in res.tensors)  # FP32 on both sides
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_phases_are_named_and_the_bar_starts_with_its_total(runs: Path) -> None:
    import io

    from rich.console import Console

    from ckpttool.ui.render import PhaseProgress

    a, b = runs / "run1" / "step-1", runs / "run2" / "step-3"
    events: list[Any] = []
    buf = io.StringIO()
    shown = PhaseProgress(Console(file=buf, force_terminal=True, width=120), "diff", bar_text="comparing")
    try:
        diff_checkpoints(
            a,
            b,
            DiffOptions(what="all"),
            progress=lambda d, t: (events.append((d, t)), shown.progress(d, t)),
            phase=lambda text: (events.append(text), shown.phase(text)),
        )
    finally:
        shown.close()
    total = events[3][1]
    assert events[:4] == [f"opening A ({a})", f"opening B ({b})", "matching names", (0, total)]
    assert events[-2:] == [(total, total), "comparing hyperparameters"]
    frames = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue())
    assert "/?" not in frames and "?/" not in frames  # never a bar without its total
    kib = f"{total / 1024:.1f}/{total / 1024:.1f} KiB"
    assert "diff: comparing" in frames and kib in frames


def test_torch_is_loaded_in_a_named_phase_only_when_values_are_decoded(runs: Path) -> None:
    """A fresh process: equal records are settled without torch; the first decoding names the import."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ckpttool.ops.diff import diff_checkpoints\n"
        "phases = []\n"
        "diff_checkpoints(sys.argv[1], sys.argv[2], phase=phases.append)\n"
        "print(phases[3:], 'torch' in sys.modules)\n"
    )
    run1, run2 = runs / "run1" / "step-3", runs / "run2" / "step-3"
    for b, want in ((run1, "[] False"), (run2, "['loading torch', 'comparing'] True")):
        out = subprocess.run(
            [sys.executable, "-c", code, str(run1), str(b)], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and out.stdout.strip() == want, out.stderr


def test_metric_edge_cases_and_blocks() -> None:
    """Blocks equal and not, zero norms, NaN, booleans: as the definitions in docs/diff.md say."""
    from ckpttool.ops.diff import compare

    n = compare.BLOCK_ELEMENTS * 2 + 5  # three blocks, the middle one equal, the last one partial
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, generator=g)
    b = a.clone()
    b[:10] += 1
    b[-3:] *= 2
    m = compare.compare_tensors(a, b).metrics
    assert m is not None
    max_abs, rel, cos = torch_metrics(a, b)
    assert (m.max_abs, m.rel_l2, m.cosine) == (
        pytest.approx(max_abs, rel=1e-12),
        pytest.approx(rel, rel=1e-9),
        pytest.approx(cos, rel=1e-12),
    )
    z, one = torch.zeros(4), torch.ones(4)
    assert (compare.compare_tensors(z, one).metrics.rel_l2, compare.compare_tensors(z, one).metrics.cosine) == (
        1.0,
        None,
    )  # type: ignore[union-attr]
    assert compare.compare_tensors(one, z).metrics.rel_l2 == math.inf  # type: ignore[union-attr]
    same_nan = torch.tensor([1.0, math.nan])
    assert (compare.compare_tensors(same_nan, same_nan.clone()).metrics.cosine) == 1.0  # type: ignore[union-attr]
    other = torch.tensor([2.0, math.nan])
    assert math.isnan(compare.compare_tensors(same_nan, other).metrics.cosine)  # type: ignore[arg-type, union-attr]
    flags = torch.tensor([True, False])
    assert compare.compare_tensors(flags, ~flags).metrics is None


def test_a_cosine_rounded_past_one_is_one_not_printed_as_1_minus_a_negative(tmp_path: Path) -> None:
    """One element one ulp apart: the float64 sums give a cosine of 1 + 2^-52, which the table printed as
    ``1--2.2e-16`` and ``--json`` gave as more than 1; a cosine is at most 1 (torch's cosine_similarity)."""
    a = torch.randn(64, generator=torch.Generator().manual_seed(8))
    b = a.clone()
    b[3] = torch.nextafter(b[3], torch.tensor(10.0))
    pa, pb = _save({"model": {"w": a}}, tmp_path / "a"), _save({"model": {"w": b}}, tmp_path / "b")
    ref = float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))
    doc = diff_json(pa, pb, code=1)
    (t,) = doc["tensors"]
    assert t["status"] == "differ" and -1.0 <= t["cosine"] <= 1.0 and t["cosine"] == pytest.approx(ref, abs=1e-15)
    res = cli(pa, pb)
    assert res.exit_code == 1 and "--" not in res.stdout.replace("--json", ""), res.stdout


def test_int64_values_past_float64_precision_are_compared_exactly_within_a_tolerance(tmp_path: Path) -> None:
    """A training state's int64 seed 2**60 + 1 against 2**60: with ``--atol 0`` the float64 ``|a-b|`` is 0 and
    the tensor was "within tolerance" (exit 0); torch.isclose on the int64 values says they are not close."""
    seed_a = torch.tensor([2**60 + 1, 7, -(2**62)], dtype=torch.int64)
    seed_b = torch.tensor([2**60, 7, 2**62], dtype=torch.int64)
    pa = _save({"model": {"w": torch.ones(2)}, "train": {"seed": seed_a}}, tmp_path / "a")
    pb = _save({"model": {"w": torch.ones(2)}, "train": {"seed": seed_b}}, tmp_path / "b")
    for atol in ("0", "1"):  # 2 elements, then 1, outside
        ref = ~torch.isclose(seed_a, seed_b, rtol=0.0, atol=float(atol))
        doc = diff_json(pa, pb, "--what", "all", "--atol", atol, code=1)
        mismatched = {d["name"]: d["mismatched"] for d in doc["differences"]}
        assert mismatched.get("train.seed", 0) == int(ref.sum()), (atol, doc["differences"])
    (d,) = diff_json(pa, pb, "--what", "all", "--atol", "0", code=1)["differences"]
    assert (d["index"], d["a_value"], d["b_value"]) == ([0], 2**60 + 1, 2**60)


@pytest.mark.parametrize("tol", [("--atol", "1e-3"), ("--rtol", "1e-3"), ("--rtol", "1e-3", "--atol", "1e-3")])
def test_tolerance_counts_infinities_as_torch_isclose(tmp_path: Path, tol: tuple[str, ...]) -> None:
    """An infinity is within the tolerance only against the same infinity: ``atol + rtol * |inf|`` (inf, or NaN
    with a zero rtol) must not let ``1.0`` against ``inf`` or ``-inf`` against ``inf`` pass, as torch.isclose."""
    inf, nan = math.inf, math.nan
    a = torch.tensor([1.0, 2.0, inf, nan, 5.0, -inf, 0.0, inf, -inf])
    b = torch.tensor([inf, 2.0, inf, nan, nan, inf, -0.0, 7.0, -inf])
    pa = _save({"model": {"w": a}}, tmp_path / "a")
    pb = _save({"model": {"w": b}}, tmp_path / "b")
    opts = dict(zip(tol[::2], map(float, tol[1::2]), strict=True))
    ref = ~torch.isclose(a, b, rtol=opts.get("--rtol", 0.0), atol=opts.get("--atol", 0.0), equal_nan=True)
    doc = diff_json(pa, pb, *tol, code=1)
    (d,) = doc["differences"]
    assert d["mismatched"] == int(ref.sum()) == 4
    assert d["index"] == [int(ref.nonzero()[0, 0])] == [0]


# ------------------------------------------------------------------------------------------ human output


def _hand_made(tmp: Path) -> tuple[Path, Path]:
    """Two checkpoints whose metrics are known in closed form, and four tensors of another dtype."""
    a = {
        "same": torch.tensor([3.0, 4.0]),
        "turned": torch.tensor([1.0, 0.0]),
        "one_changed": torch.tensor([1.0, 2.0, 2.0, 4.0]),
        **{f"d{i}": torch.zeros(2) for i in range(4)},
    }
    b = {
        "same": torch.tensor([3.0, 4.0]),
        "turned": torch.tensor([0.0, 1.0]),
        "one_changed": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        **{f"d{i}": torch.zeros(2, dtype=torch.bfloat16) for i in range(4)},
    }
    return _save({"model": a}, tmp / "a"), _save({"model": b}, tmp / "b")


def test_table_sorted_by_difference_with_grouped_dtypes(tmp_path: Path) -> None:
    a, b = _hand_made(tmp_path)
    res = cli(a, b, env={"COLUMNS": "100"})
    assert res.exit_code == 1, res.stderr
    out = re.sub(r"\(\d+\.\d\d s\)", "(T s)", res.stdout)
    # turned: |a-b| = 1, ||a-b|| = sqrt 2, ||b|| = 1, cosine 0; one_changed: ||a-b|| = 1, ||b|| = sqrt 30,
    # cosine 27 / sqrt(25 * 30)
    rel, cos = 1 / math.sqrt(30), 27 / math.sqrt(25 * 30)
    assert f"{rel:.3g}" == "0.183" and f"{cos:.6g}" == "0.985901"
    assert out == (
        f"A: {a} (dcp, torch-native)\n"
        f"B: {b} (dcp, torch-native)\n"
        "compared model (torch-native names), bitwise\n"
        "tensors, largest difference first (rel L2 = ||A-B||/||B||)\n"
        "┏━━━━━━━━━━━━━━━━━━━┳━━━━━━━┳━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━┓\n"
        "┃ key               ┃ shape ┃ dtype   ┃ max abs ┃ rel L2 ┃   cosine ┃ status ┃\n"
        "┡━━━━━━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━┩\n"
        "│ model.turned      │ 2     │ float32 │       1 │   1.41 │        0 │ DIFFER │\n"
        "│ model.one_changed │ 4     │ float32 │       1 │  0.183 │ 0.985901 │ DIFFER │\n"
        "└───────────────────┴───────┴─────────┴─────────┴────────┴──────────┴────────┘\n"
        "  ... 1 equal tensor not listed (--json lists every tensor)\n"
        "  model.one_changed: 1 of 4 elements differ; first at [2] (A 2, B 3)\n"
        "  dtype: float32 in A, bfloat16 in B: 4 tensors (model.d0, model.d1, model.d2, ... (+1 more))\n"
        "  hint: compare values across dtypes with --as-dtype DTYPE (both sides cast) or --rtol/--atol\n"
        "compared 3 tensors / 8 values (1 as raw records), 4 other (by dtype, shape, stored bytes or hyperparameter): "
        "2 differ; max rel L2 1.41 (model.turned); max abs 1 (model.turned); min cosine 0 (model.turned)\n"
        "DIFFERENT: 6 differences (T s)\n"
    )
    doc = diff_json(a, b, code=1)
    dtype = [d for d in doc["differences"] if d["kind"] == "dtype"]
    assert [(d["name"], d["a_value"], d["b_value"]) for d in dtype] == [
        (f"model.d{i}", "float32", "bfloat16") for i in range(4)
    ]
    assert all("as_dtype" not in d["message"] for d in doc["differences"])
    # cast: the four compare equal, and so do the others' metrics
    doc = diff_json(a, b, "--as-dtype", "float32", code=1)
    assert {t["name"]: t["status"] for t in doc["tensors"]} == {
        "model.turned": "differ",
        "model.one_changed": "differ",
        "model.same": "equal",
        **{f"model.d{i}": "equal" for i in range(4)},
    }


def test_within_tolerance_is_its_own_status(tmp_path: Path) -> None:
    a, b = _hand_made(tmp_path)
    doc = diff_json(a, b, "--filter", "one_changed", "--rtol", "0.5", code=0)
    (t,) = doc["tensors"]
    assert t["status"] == "within_tolerance" and t["mismatched"] == 0 and t["rel_l2"] == 1 / math.sqrt(30)
    assert doc["summary"]["within_tolerance"] == 1 and doc["equal"] is True


def test_signed_zeros_and_nan_payloads_within_a_tolerance_are_not_called_bitwise_equal(tmp_path: Path) -> None:
    """``-0.0`` against ``0.0`` (or a NaN against a NaN of another payload) adds 0 to ``sum (a-b)^2``: with
    ``--atol`` the tensor was "equal" and the verdict a plain "equal", which says bitwise equal; they are within the
    tolerance (as torch.isclose says) but their bits differ (as torch's bit views say), so "within tolerance"."""
    nan_b = torch.tensor([math.nan]).view(torch.int32) ^ (1 << 31)  # -nan: another bit pattern, still a NaN
    a = {"z": torch.tensor([1.0, 0.0, 2.0]), "n": torch.tensor([1.0, math.nan]), "same": torch.ones(2)}
    b = {"z": torch.tensor([1.0, -0.0, 2.0]), "n": torch.cat([torch.ones(1), nan_b.view(torch.float32)])}
    b["same"] = torch.ones(2)
    pa, pb = _save({"model": a}, tmp_path / "a"), _save({"model": b}, tmp_path / "b")
    for k in ("z", "n"):
        assert torch.isclose(a[k], b[k], atol=1e-3, equal_nan=True).all()
        assert not torch.equal(a[k].view(torch.int32), b[k].view(torch.int32))
    doc = diff_json(pa, pb, "--atol", "1e-3", code=0)
    status = {t["name"]: t["status"] for t in doc["tensors"]}
    assert status == {"model.z": "within_tolerance", "model.n": "within_tolerance", "model.same": "equal"}
    res = cli(pa, pb, "--atol", "1e-3")
    assert res.stdout.splitlines()[-1].startswith("equal within tolerance: 2 tensors not bitwise equal ("), res.stdout
    doc = diff_json(pa, pb, code=1)  # bitwise: both differ
    assert {d["name"] for d in doc["differences"]} == {"model.z", "model.n"}


def test_values_of_one_dtype_equal_only_after_as_dtype_are_not_called_bitwise_equal(tmp_path: Path) -> None:
    """Two AdamW saves 1001 and 1002 steps in (lr 0 and no gradient: only the float32 ``step`` counters differ).
    ``--as-dtype bfloat16`` rounds both counters to 1000: the verdict was a plain "equal" (which says bitwise
    equal) over stored values that torch reads as different; they are equal as cast, not as stored."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    saved = []
    for steps in (1001, 1002):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optim = torch.optim.AdamW(model.parameters(), lr=0.0)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optim.step()
        msd, osd = get_state_dict(model, optim)
        saved.append(_save({"model": msd, "optim": osd}, tmp_path / f"s{steps}"))
    loaded = []
    for path in saved:  # torch's own reader: the counters differ as stored, equal as bfloat16
        sd = {"optim": {"state": {n: {"step": torch.tensor(0.0)} for n in ("weight", "bias")}}}
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
        loaded.append(sd["optim"]["state"]["weight"]["step"])
    assert not torch.equal(*loaded) and torch.equal(*(t.to(torch.bfloat16) for t in loaded))
    doc = diff_json(*saved, "--what", "all", "--as-dtype", "bfloat16", code=0)
    status = {t["name"]: t["status"] for t in doc["tensors"] if t["status"] != "equal"}
    assert status == {
        "optimizer.state.weight.step": "within_tolerance",
        "optimizer.state.bias.step": "within_tolerance",
    }
    res = cli(*saved, "--what", "all", "--as-dtype", "bfloat16")
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("equal as bfloat16 (2 tensors not bitwise equal as stored) ("), res.stdout
    assert "bitwise after casting to bfloat16\n" in res.stdout  # no quantized weights named in the header
    doc = diff_json(*saved, "--what", "all", code=1)  # bitwise: the counters differ
    assert {d["name"] for d in doc["differences"]} == set(status)


# ------------------------------------------------------------------------------------------ fail closed


def test_pickled_state_against_itself_is_an_error_not_equal(pickled: Path) -> None:
    a = pickled / "a"
    held = "A holds 0 tensors and 1 byte item ('model'); B holds 0 tensors and 1 byte item ('model')"
    res = cli(a, a)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E611] nothing compared, so no verdict: neither side has model tensors; {held}",
        "hint: a state pickled into byte items (as DefaultSavePlanner(flatten_state_dict=False) saves) has no "
        "tensors to compare: re-save with the default planner, or compare byte items with --what all",
    ]
    res = cli(a, a, "--what", "all", "--json")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == (
        "error: [E611] nothing compared, so no verdict: 1 name(s) in common, byte items only "
        f"(equal as stored bytes), no tensor; {held}"
    )


def test_pickled_states_that_differ_are_a_finding(pickled: Path) -> None:
    res = cli(pickled / "a", pickled / "b")
    assert res.exit_code == 2 and res.stderr.startswith("error: [E611] nothing compared")
    doc = diff_json(pickled / "a", pickled / "b", "--what", "all", code=1)
    (d,) = doc["differences"]
    assert d["kind"] == "object" and d["name"] == "model" and doc["tensors"] == []
    assert doc["counts"]["values"] == 0 and doc["counts"]["different"] == 1


def test_a_pickled_state_against_a_flattened_one_names_the_pickled_side(runs: Path, pickled: Path) -> None:
    """One side saved by the default planner, the other with ``flatten_state_dict=False``: no name in common, and
    the hint says which side is pickled, never an empty list of its names nor an export across namings."""
    hint = (
        "hint: {} holds no tensor, its state pickled into byte items (as DefaultSavePlanner(flatten_state_dict=False) "
        "saves), whose tensors are not compared value by value: re-save it with the default planner"
    )
    for args, side in (
        ((runs / "run1" / "step-1", pickled / "a"), "B"),
        ((pickled / "a", runs / "run1" / "step-1"), "A"),
    ):
        for what in ("model", "all"):
            _, err = refused(*args, "--what", what)
            assert err[0].startswith("error: [E611] nothing compared, so no verdict: no name in common"), err
            assert err[1:] == [hint.format(side)]


def test_a_name_on_one_side_beside_equal_byte_items_is_a_finding(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner

    torch.manual_seed(1)
    sd = builders.dense_model().state_dict()
    x = _save({"model": sd}, tmp_path / "x", planner=DefaultSavePlanner(flatten_state_dict=False))
    y = _save({"model": sd, "extra": {"k": 1}}, tmp_path / "y", planner=DefaultSavePlanner(flatten_state_dict=False))
    doc = diff_json(x, y, "--what", "all", code=1)
    assert [(d["kind"], d["name"]) for d in doc["differences"]] == [("only_b", "extra")]
    assert doc["counts"]["values"] == 0 and doc["counts"]["equal"] == 1
    res = cli(x, y)  # model tensors: none on either side
    assert res.exit_code == 2 and res.stderr.startswith("error: [E611] nothing compared")


def test_byte_items_that_cannot_be_read_are_a_finding(tmp_path: Path) -> None:
    """A byte item the allow-list unpickler refuses: differing bytes are reported, never skipped."""
    sd = {"w": torch.ones(2)}
    _save({"model": sd, "extra": _Custom(1)}, tmp_path / "a")
    _save({"model": sd, "extra": _Custom(2)}, tmp_path / "b")
    doc = diff_json(tmp_path / "a", tmp_path / "b", "--what", "all", code=1)
    (d,) = doc["differences"]
    assert d["kind"] == "object" and d["name"] == "extra"
    assert d["message"].startswith("extra: stored bytes differ, values not compared: [E304]")


class _Custom:
    def __init__(self, v: int) -> None:
        self.v = v


def test_no_common_name_and_nothing_matching_are_errors(runs: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    save_file({"foo": torch.ones(2)}, tmp_path / "x" / "model.safetensors")
    save_file({"bar": torch.ones(2)}, tmp_path / "y" / "model.safetensors")
    res = cli(tmp_path / "x", tmp_path / "y")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == (
        "error: [E611] nothing compared, so no verdict: no name in common (1 in A, 1 in B); "
        "A holds 1 tensor; B holds 1 tensor"
    )
    a = runs / "run1" / "step-3"
    res = cli(a, a, "--filter", "nothing.*")
    assert res.exit_code == 2 and res.stdout == ""
    line = res.stderr.splitlines()[0]
    assert line.startswith(
        "error: [E611] nothing compared, so no verdict: --filter nothing.* matched none of the 22 names of A and 22 of B;"
    )


def test_no_common_name_of_two_dcp_or_two_safetensors_sides_hints_no_unused_mapping(tmp_path: Path) -> None:
    """Two DCP checkpoints (or two safetensors folders) naming their tensors differently: the E611 hint said "pass
    its rules (--rules) or a model adapter (--adapter)", which map a DCP checkpoint to a safetensors side's names
    only (between two DCP sides diff itself warns that they are unused). The hint says how they are compared."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 3))
    named = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 3)})
    a = _save({"model": seq.state_dict()}, tmp_path / "a")
    b = _save({"model": named.state_dict()}, tmp_path / "b")
    res, err = refused(a, b)
    assert err[0].startswith("error: [E611] nothing compared, so no verdict: no name in common (2 in A, 2 in B)"), err
    assert err[1] == (
        "hint: A's names look like 'model.0.bias', 'model.0.weight', B's like 'model.proj.bias', "
        "'model.proj.weight': two DCP checkpoints are compared by their own keys (--rules and --adapter name a DCP "
        "checkpoint's keys as a safetensors side's); to compare across namings, export one (`ckpttool export`) and "
        "compare the other against that export, naming it with --adapter or --rules"
    ), err
    for side, sd in (("x", seq.state_dict()), ("y", named.state_dict())):
        (tmp_path / side).mkdir()
        save_file(sd, tmp_path / side / "model.safetensors")
    res, err = refused(tmp_path / "x", tmp_path / "y")
    assert res.stderr.splitlines()[1] == (
        "hint: A's names look like '0.bias', '0.weight', B's like 'proj.bias', 'proj.weight': two safetensors "
        "inputs are compared by their own names (--rules and --adapter name a DCP checkpoint's keys as a "
        "safetensors side's)"
    ), res.stderr


def test_a_filter_matching_one_side_only_says_so(tmp_path: Path) -> None:
    """A checkpoint against an export written with --filter: a diff --filter that matches only the checkpoint's
    names is E611 with a hint naming the filter, not a naming mismatch (--rules / --adapter)."""
    from ckpttool.ops.export import ExportOptions
    from ckpttool.ops.export.execute import export_checkpoint
    from tests.fixtures import hf_models

    src = tmp_path / "ckpt"
    torch.manual_seed(3)
    from transformers import LlamaForCausalLM

    hf_models._quiet()
    _save({"model": dict(LlamaForCausalLM(hf_models.llama_config()).state_dict())}, src)
    export_checkpoint(src, tmp_path / "norms", ExportOptions(filter_glob="*norm*"))
    res = cli(src, tmp_path / "norms", "--filter", "*mlp*")
    assert res.exit_code == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert err[0].startswith("error: [E611] nothing compared, so no verdict: no name in common (6 in A, 0 in B)")
    assert err[1].startswith("hint: --filter *mlp* kept names of A only: B holds no name matching it")
    assert "--rules" not in err[1]


def test_a_filter_matching_optimizer_names_names_what(tmp_path: Path) -> None:
    """``diff a b --filter '*exp_avg*'`` (``--what model``, the default) was E611 with a hint of model names
    ("names look like 'model.embed.weight'"), not saying that the filter matches the optimizer state, which
    ``--what optimizer`` compares. The hint now says so and names the option; against a safetensors side, which holds
    no optimizer state, it says that instead."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    a = _save({"model": msd, "optimizer": osd}, tmp_path / "a")
    for glob in ("*exp_avg*", "optimizer.*"):
        res, err = refused(a, a, "--filter", glob)
        assert err[0].startswith(f"error: [E611] nothing compared, so no verdict: --filter {glob} matched none"), err
        assert err[1].startswith(f"hint: --filter {glob} matches names of the optimizer state (e.g. 'optimizer."), err
        assert err[1].endswith("of A), which --what model leaves out: pass --what optimizer (or --what all)"), err
        named = err[1].split("(e.g. '")[1].split("'")[0]  # a state field torch's own optimizer state holds
        fqn, field = named.removeprefix("optimizer.state.").rsplit(".", 1)
        assert field in osd["state"][fqn] and fnmatch.fnmatchcase(named, glob), named
        assert diff_json(a, a, "--filter", glob, "--what", "optimizer", code=0)["counts"]["tensors"] > 0
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in msd.items()}, tmp_path / "hf" / "model.safetensors")
    res = cli(tmp_path / "hf", a, "--filter", "*exp_avg*")
    assert res.exit_code == 2 and res.stderr.splitlines()[1].endswith(
        "of B), which a safetensors side does not hold: compare it against another DCP checkpoint"
    ), res.stderr
    res = cli(a, a, "--filter", "nothing.*")  # a filter matching nothing anywhere keeps the names hint
    assert res.stderr.splitlines()[1].startswith("hint: names look like 'model."), res.stderr


def test_a_filter_without_wildcard_names_the_wider_glob(tmp_path: Path) -> None:
    """``diff a b --filter attn`` (a word, no wildcard: a glob matches whole names) was E611 with the hint "names look
    like 'model.embed.weight'", as inspect/stats/export no longer say. The hint now names ``'*attn*'`` and how many
    names of A it matches (counted here with fnmatch over torch's own state dict keys), and a word matching only
    optimizer state (``exp_avg``) names the wider glob with ``--what optimizer``; with the wider glob the diff
    compares."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    a = _save({"model": msd, "optimizer": osd}, tmp_path / "a")
    word = next(p for p in ("attn", "attention", "mlp") if any(p in k for k in msd))
    n = sum(fnmatch.fnmatchcase(f"model.{k}", f"*{word}*") for k in msd)
    res, err = refused(a, a, "--filter", word)
    assert err[0].startswith(f"error: [E611] nothing compared, so no verdict: --filter {word} matched none"), err
    assert err[1] == (
        f"hint: a glob matches whole keys and {word!r} has no wildcard, so it names one whole key; "
        f"'*{word}*' matches {n} names"
    ), err
    assert diff_json(a, a, "--filter", f"*{word}*", code=0)["counts"]["tensors"] == n
    res, err = refused(a, a, "--filter", "exp_avg")
    assert err[1].startswith(
        "hint: a glob matches whole keys and 'exp_avg' has no wildcard, so it names one whole key; '*exp_avg*' "
        "matches names of the optimizer state (e.g. 'optimizer.state."
    ), err
    assert err[1].endswith("of A), which --what model leaves out: pass --what optimizer (or --what all)"), err
    assert diff_json(a, a, "--filter", "*exp_avg*", "--what", "optimizer", code=0)["counts"]["tensors"] > 0


def test_training_state_only_against_safetensors_says_what_diff_found(tmp_path: Path) -> None:
    """``dcp.save({"optimizer": ...})`` or ``{"train_state": ...}`` against an HF safetensors folder was E601 "no model
    tensors to export", export's wording (diff exports nothing). It is now one E611 line naming the side, its path and
    that it holds no model tensors, with the fix; the safetensors side may be A or B."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in msd.items()}, tmp_path / "hf" / "model.safetensors")
    opt_only = _save({"optimizer": osd}, tmp_path / "opt")
    train_only = _save({"train_state": {"step": torch.tensor(3), "seen": torch.tensor(96)}}, tmp_path / "train")
    for a, b, side, path in (
        (opt_only, tmp_path / "hf", "A", opt_only),
        (tmp_path / "hf", train_only, "B", train_only),
    ):
        res, err = refused(a, b)
        assert len(err) == 2 and "export" not in res.stderr and "Traceback" not in res.stderr, err
        assert err[0].startswith(
            f"error: [E611] nothing compared, so no verdict: {side} ({path}) holds no model tensors to compare with "
            f"{'B' if side == 'A' else 'A'}'s safetensors ("
        ), err
        assert err[1] == (
            f"hint: pass the checkpoint that holds the model as {side}, or compare this state against another DCP "
            "checkpoint with --what optimizer (or --what all); `ckpttool inspect` shows its keys, --model-prefix names "
            "where weights are"
        ), err
    assert "optimizer state only" in cli(opt_only, tmp_path / "hf").stderr


def test_two_optimizer_only_checkpoints_under_what_model_name_what_optimizer(tmp_path: Path) -> None:
    """``diff opt1 opt2`` of two ``dcp.save({"optimizer": ...})`` saves (``--what model``, the default) was E611 with
    the hint of a state pickled into byte items ("re-save with the default planner"): the byte items are the param
    groups' hyperparameters, the state is tensors. The hint now says the sides hold optimizer state only and names
    ``--what optimizer``, which compares them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    osd = get_state_dict(model, optim)[1]
    a, b = _save({"optimizer": osd}, tmp_path / "a"), _save({"optimizer": osd}, tmp_path / "b")
    res, err = refused(a, b)
    assert res.stderr.splitlines()[1] == (
        "hint: A and B hold optimizer state only, which --what model leaves out: compare it with --what optimizer "
        "(or --what all)"
    ), res.stderr
    n = sum(torch.is_tensor(v) for st in osd["state"].values() for v in st.values())  # torch's own state tensors
    assert diff_json(a, b, "--what", "optimizer", code=0)["counts"]["tensors"] == n


def _optimizer_alone_and_beside_its_model(tmp_path: Path) -> tuple[Any, Any, Path, Path]:
    """A model and AdamW after two steps; its optimizer state saved alone (``opt``) and beside the model (``full``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    return (
        model,
        optim,
        _save({"optimizer": osd}, tmp_path / "opt"),
        _save({"model": msd, "optimizer": osd}, tmp_path / "full"),
    )


def test_an_optimizer_only_save_has_the_param_groups_of_a_full_one(tmp_path: Path) -> None:
    """``diff opt/ full/ --what optimizer``, one optimizer state saved alone and beside its model, was "DIFFERENT", one
    difference per parameter ("optimizer.param_groups.0: no param group in B", "...: no param group in A"): with no model
    tensor the parameters were not mapped to their groups. They are now, through the state's parameters: equal, and an
    lr changed in the reference's param groups is one difference per parameter."""
    model, optim, opt_only, full = _optimizer_alone_and_beside_its_model(tmp_path)
    n = len(list(model.parameters()))
    doc = diff_json(opt_only, full, "--what", "optimizer", code=0)
    assert doc["equal"] and not doc["differences"], doc["differences"]
    for g in optim.param_groups:
        g["lr"] = 5e-3
    from torch.distributed.checkpoint.state_dict import get_state_dict

    other = _save({"optimizer": get_state_dict(model, optim)[1]}, tmp_path / "other")
    doc = diff_json(other, full, "--what", "optimizer", code=1)
    assert [(x["kind"], x["a_value"], x["b_value"]) for x in doc["differences"]] == [
        ("hyperparameter", "0.005", "0.01")
    ] * n


def test_an_optimizer_only_side_against_a_model_names_the_side(tmp_path: Path) -> None:
    """``diff opt/ full/`` (an optimizer-only save against a model + optimizer save, ``--what model``) was E611 "no
    name in common" with the hint of a naming mismatch ("pass its rules (--rules) or a model adapter (--adapter)"),
    though A holds no model tensor at all. The hint now says so, for whichever side it is."""
    model, optim, opt_only, full = _optimizer_alone_and_beside_its_model(tmp_path)
    for a, b, side in ((opt_only, full, "A"), (full, opt_only, "B")):
        res, err = refused(a, b)
        assert err[0].startswith("error: [E611] nothing compared, so no verdict: no name in common"), err
        assert err[1] == (
            f"hint: {side} holds optimizer state and no model tensor, which --what model compares: pass the "
            f"checkpoint that holds the model as {side}, or compare the optimizer state with --what optimizer"
        ), err


def test_the_library_picks_each_sides_step(runs: Path) -> None:
    """`diff_checkpoints` itself applies `step` to the sides that are run roots and refuses a side step on a checkpoint."""
    from ckpttool.errors import UsageError
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints

    res = diff_checkpoints(runs / "run1", runs / "run1" / "step-3", DiffOptions(step="3"))
    assert res.equal and res.a.opened and "step-3" in res.a.opened
    with pytest.raises(UsageError) as info:
        diff_checkpoints(runs / "run1" / "step-3", runs / "run1", DiffOptions(a_step="3"))
    assert info.value.param == "a_step" and "`a_step` 3 given, but" in str(info.value)


def test_bitwise_only_difference_is_named_in_the_summary(tmp_path: Path) -> None:
    """-0.0 against 0.0: every metric is 0 for all tensors; the summary names the tensor that differs."""
    base = {f"w{i}": torch.full((2, 2), float(i + 1)) for i in range(3)}
    pos = dict(base, w2=torch.zeros(2, 2))
    neg = dict(base, w2=torch.zeros(2, 2).neg())
    a, b = _save({"model": pos}, tmp_path / "a"), _save({"model": neg}, tmp_path / "b")
    doc = diff_json(a, b, code=1)
    s = doc["summary"]
    assert (s["differ"], s["max_rel_l2_name"], s["max_abs_name"], s["min_cosine_name"]) == (1, *["model.w2"] * 3)
    res = cli(a, b)
    assert res.exit_code == 1
    assert "max rel L2 0 (model.w2); max abs 0 (model.w2); min cosine 1 (model.w2)" in res.stdout.replace("\n", " ")


# ------------------------------------------------------------------------------------------ hyperparameters


def test_betas_given_back_as_a_list_by_a_full_state_dict_load_are_no_difference(tmp_path: Path) -> None:
    """torch's ``set_state_dict(..., full_state_dict=True)`` (how FSDP2 loads a consolidated optimizer state)
    flattens the param groups and rebuilds ``betas`` as a list: a faithful resume of a save whose betas were a tuple
    was "DIFFERENT: 6 differences" (``(0.9, 0.95) in A, [0.9, 0.95] in B``). The optimizer steps alike with
    either: a note names them, the verdict is equal; betas of other values still differ."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    a = _save({"model": msd, "optimizer": osd}, tmp_path / "a")
    set_state_dict(
        model, optim, model_state_dict=msd, optim_state_dict=osd, options=StateDictOptions(full_state_dict=True)
    )
    b = _save(dict(zip(("model", "optimizer"), get_state_dict(model, optim))), tmp_path / "b")
    for g in optim.param_groups:
        g["betas"] = (0.9, 0.99)
    c = _save(dict(zip(("model", "optimizer"), get_state_dict(model, optim))), tmp_path / "c")
    # the reference: torch's own reader gives a tuple in A, a list of the same values in B
    groups = []
    for p in (a, b):
        dcp_to_torch_save(p, tmp_path / f"{p.name}.pt")
        groups.append(torch.load(tmp_path / f"{p.name}.pt", weights_only=False)["optimizer"]["param_groups"])
    assert type(groups[0][0]["betas"]) is tuple and type(groups[1][0]["betas"]) is list
    assert list(groups[0][0]["betas"]) == groups[1][0]["betas"]
    n = len(list(model.parameters()))
    for what in ("optimizer", "all"):
        doc = diff_json(a, b, "--what", what, code=0)
        assert doc["equal"] and not doc["differences"], doc["differences"]
        assert [x for x in doc["notes"] if "tuple on one side and a list on the other" in x] == [
            f"{n} hyperparameters equal as values but a tuple on one side and a list on the other "
            f"({', '.join(sorted(f'optimizer.param_groups.{k}.betas' for k in msd)[:3])}, ... (+{n - 3} more)): "
            "torch's optimizers step alike with either (set_state_dict with full_state_dict=True gives back a list)"
        ]
    doc = diff_json(a, c, "--what", "optimizer", code=1)
    assert {(x["kind"], x["name"].rsplit(".", 1)[1]) for x in doc["differences"]} == {("hyperparameter", "betas")}
    assert len(doc["differences"]) == n and not any("tuple on one side" in x for x in doc["notes"])


def test_an_int_and_a_float_of_one_value_are_no_hyperparameter_difference(tmp_path: Path) -> None:
    """``weight_decay: 0`` in one run's config and ``0.0`` in the other's (``lr: 1`` and ``1.0``) was "DIFFERENT"
    (``0.0 in A, 0 in B``) although torch's AdamW steps bitwise alike with either: a note names them now, the
    verdict is equal; another value, or a bool against an int, still differs."""

    def run(wd: Any, lr: Any, out: Path) -> tuple[Path, torch.Tensor]:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        o = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, amsgrad=wd is True)
        for _ in range(2):
            m(torch.ones(2, 4)).square().sum().backward()
            o.step()
        return _save({"model": m.state_dict(), "optimizer": o.state_dict()}, out), m.weight.detach().clone()

    a, wa = run(0.0, 1.0, tmp_path / "a")
    b, wb = run(0, 1, tmp_path / "b")
    assert torch.equal(wa, wb)  # the reference: torch steps alike with the int and the float
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(b, tmp_path / "b.pt")
    group = torch.load(tmp_path / "b.pt", weights_only=False)["optimizer"]["param_groups"][0]
    assert (type(group["weight_decay"]), type(group["lr"])) == (int, int)
    doc = diff_json(a, b, "--what", "optimizer", code=0)
    assert doc["equal"] and not doc["differences"]
    assert [x for x in doc["notes"] if "an int on one side" in x] == [
        "2 hyperparameters equal as values but an int on one side and a float on the other "
        "(optimizer.param_groups.0.lr, optimizer.param_groups.0.weight_decay): torch's optimizers step alike with "
        "either (a config's 0 and 0.0)"
    ]
    c, _ = run(0.0, 0.5, tmp_path / "c")
    doc = diff_json(a, c, "--what", "optimizer", code=1)
    assert [(x["name"], x["a_value"], x["b_value"]) for x in doc["differences"] if x["kind"] == "hyperparameter"] == [
        ("optimizer.param_groups.0.lr", "1.0", "0.5")
    ]
    d, _ = run(True, 1, tmp_path / "d")  # weight_decay=True: a bool is not the int 1
    e, _ = run(1, 1, tmp_path / "e")
    doc = diff_json(d, e, "--what", "optimizer", code=1)
    assert "optimizer.param_groups.0.weight_decay" in {x["name"] for x in doc["differences"]}


# ------------------------------------------------------------------------------------------ one checkpoint twice


def test_one_checkpoint_on_both_sides_is_said_to_be_compared_with_itself(runs: Path, tmp_path: Path) -> None:
    """``diff run/ run/ --step 3`` opens run/step-3 on both sides (the user meant two steps) and ``diff X X``
    compares X with itself: both said a plain "equal", as if two checkpoints had been found alike. The verdict and a
    note now say that A and B are one checkpoint; a copy of it is two."""
    run = runs / "run1"
    res = cli(run, run, "--step", "3")
    assert res.exit_code == 0, res.output
    assert (
        f"  note: A and B are one checkpoint ({run / 'step-3'}): compared with itself, which shows only that it "
        "reads alike twice; to compare two steps of the run give --a-step N --b-step M"
    ) in res.stdout.splitlines(), res.stdout
    assert res.stdout.splitlines()[-1].startswith("equal to itself: A and B are one checkpoint (note above) (")
    link = tmp_path / "link"
    link.symlink_to(run / "step-1")
    doc = diff_json(run / "step-1", link, "--what", "all", code=0)
    assert [x for x in doc["notes"] if x.startswith("A and B are one checkpoint")] == [
        f"A and B are one checkpoint ({run / 'step-1'}): compared with itself, which shows only that it reads alike "
        "twice; to compare two copies pass both"
    ]
    import shutil

    copy = Path(shutil.copytree(run / "step-1", tmp_path / "copy"))
    res = cli(run / "step-1", copy)
    assert res.exit_code == 0 and "one checkpoint" not in res.stdout, res.stdout
    assert res.stdout.splitlines()[-1].startswith("equal as models; optimizer state not compared (note above) (")


def test_a_folder_and_its_only_safetensors_file_are_one_checkpoint(tmp_path: Path) -> None:
    """``diff DIR DIR/model.safetensors`` reads one file twice but said a plain "equal", as if two copies had been
    found alike (``diff X X`` says that it compared X with itself). It now says so, either way round; a copy of the file
    is two checkpoints."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, hf / "model.safetensors")
    note = (
        f"A and B are one checkpoint ({hf / 'model.safetensors'}): compared with itself, which shows only that it "
        "reads alike twice; to compare two copies pass both"
    )
    for a, b in ((hf, hf / "model.safetensors"), (hf / "model.safetensors", hf)):
        doc = diff_json(a, b, code=0)
        assert [x for x in doc["notes"] if x.startswith("A and B are one checkpoint")] == [note], doc["notes"]
        assert doc["counts"]["tensors"] == len(load_file(hf / "model.safetensors"))
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(hf / "model.safetensors", copy / "model.safetensors")
    doc = diff_json(hf, copy / "model.safetensors", code=0)
    assert not [x for x in doc["notes"] if x.startswith("A and B are one checkpoint")], doc["notes"]


def test_a_filter_that_keeps_hyperparameters_only_gives_a_verdict(tmp_path: Path) -> None:
    """``diff run1 run2 --what optimizer --filter '*.lr'`` (did the learning rate change?) compared the lr of every
    parameter, found them equal and still refused: "E611 nothing compared: --filter *.lr matched none of the 18
    names". Hyperparameters are values read and understood: equal ones are a verdict (exit 0), other ones a finding
    (exit 1); the reference is the param groups torch's own reader loads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    a = _save(dict(zip(("model", "optimizer"), get_state_dict(model, optim))), tmp_path / "a")
    b = _save(dict(zip(("model", "optimizer"), get_state_dict(model, optim))), tmp_path / "b")
    for g in optim.param_groups:
        g["lr"] = 5e-3
    c = _save(dict(zip(("model", "optimizer"), get_state_dict(model, optim))), tmp_path / "c")
    lrs = []
    for p in (a, b, c):
        dcp_to_torch_save(p, tmp_path / f"{p.name}.pt")
        lrs.append(
            [g["lr"] for g in torch.load(tmp_path / f"{p.name}.pt", weights_only=False)["optimizer"]["param_groups"]]
        )
    assert lrs[0] == lrs[1] != lrs[2]
    n = len(list(model.parameters()))
    doc = diff_json(a, b, "--what", "optimizer", "--filter", "*.lr", code=0)
    assert doc["equal"] and doc["counts"]["compared"] == n and doc["counts"]["tensors"] == 0, doc["counts"]
    doc = diff_json(a, c, "--what", "optimizer", "--filter", "*.lr", code=1)
    assert [(x["kind"], x["a_value"], x["b_value"]) for x in doc["differences"]] == [
        ("hyperparameter", "0.01", "0.005")
    ] * n
    # a filter matching no name nor hyperparameter is still no verdict
    res = cli(a, b, "--what", "optimizer", "--filter", "*.nothing")
    assert res.exit_code == 2 and res.stderr.startswith("error: [E611] nothing compared"), res.output


def test_param_groups_of_an_index_keyed_optimizer_are_compared(tmp_path: Path) -> None:
    """``dcp.save({"model": ..., "optimizer": optimizer.state_dict()})`` keys its state and groups by index: no
    parameter maps to a group, so no hyperparameter was compared and an lr changed from 0.01 to 0.5 was "equal"
    (``--what optimizer`` and ``--what all``). Such groups are compared group by group, by index, against the
    values torch's own reader loads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, optim, gen = _train(1)
    model.loss(torch.randint(0, builders.DENSE["vocab"], (2, 8), generator=gen)).backward()
    optim.step()
    a = _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, tmp_path / "a")
    b = _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, tmp_path / "b")
    optim.param_groups[0]["lr"] = 0.5
    c = _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, tmp_path / "c")
    dcp_to_torch_save(a, tmp_path / "a.pt")
    dcp_to_torch_save(c, tmp_path / "c.pt")
    groups = [torch.load(tmp_path / f"{n}.pt", weights_only=False)["optimizer"]["param_groups"] for n in "ac"]
    changed = [h for h in groups[0][0] if groups[0][0][h] != groups[1][0][h]]
    assert changed == ["lr"] and (groups[0][0]["lr"], groups[1][0]["lr"]) == (1e-2, 0.5)
    for what in ("optimizer", "all"):
        doc = diff_json(a, c, "--what", what, code=1)
        assert [(d["kind"], d["name"], d["a_value"], d["b_value"]) for d in doc["differences"]] == [
            ("hyperparameter", "optimizer.param_groups.0.lr", "0.01", "0.5")
        ]
        doc = diff_json(a, b, "--what", what, code=0)
        hypers = len([h for h in groups[0][0] if h not in ("params", "param_names")])
        assert doc["counts"]["compared"] == doc["counts"]["tensors"] + hypers, doc["counts"]


def _plain_and_get_state_dict_saves(tmp_path: Path) -> tuple[Path, Path]:
    """One model + torch AdamW after a step, saved twice: its plain ``optimizer.state_dict()`` (state keyed by
    parameter index) and ``get_state_dict``'s (keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    plain = _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, tmp_path / "plain")
    msd, osd = get_state_dict(model, optim)
    return plain, _save({"model": msd, "optimizer": osd}, tmp_path / "gsd")


def test_an_index_keyed_optimizer_against_a_name_keyed_one_is_no_verdict_over_nothing(tmp_path: Path) -> None:
    """`diff plain/ gsd/ --what optimizer` was "DIFFERENT: 29 differences" with 0 tensors compared: the param groups
    each side holds alone (by index in A, by parameter in B) counted as hyperparameter differences. They are names
    on one side only: nothing compared is E611, its hint naming the keying; `--what all` compares the model tensors
    (equal, torch's own) and says why the optimizer state pairs up with nothing."""
    plain, gsd = _plain_and_get_state_dict_saves(tmp_path)
    res, err = refused(plain, gsd, "--what", "optimizer")
    assert err[0].startswith("error: [E611] nothing compared, so no verdict: no name in common"), err
    assert err[1] == (
        "hint: A's optimizer state is keyed by parameter index (a plain optimizer.state_dict()), B's by parameter "
        "name: re-save the index-keyed one with get_state_dict (torch.distributed.checkpoint.state_dict)"
    ), err
    doc = diff_json(plain, gsd, "--what", "all", code=1)
    assert doc["counts"]["tensors"] == 4 and not [
        d for d in doc["differences"] if d["kind"] not in ("only_a", "only_b")
    ]
    assert any("keyed by parameter index" in n for n in doc["notes"]), doc["notes"]
    assert diff_json(plain, plain, "--what", "optimizer", code=0)["equal"]  # same keying: compared


def test_a_save_of_training_state_only_is_pointed_to_what_all(tmp_path: Path) -> None:
    """`diff train/ train/` of a save holding only torchtitan-style train_state hinted at `--schema` (the key schema
    is not recognised), which changes nothing: training state is compared by `--what all`, the hint now says so."""
    state = {"train_state": {"step": torch.tensor(3), "tokens": 100}}
    a = _save(state, tmp_path / "a")
    b = _save({"train_state": {"step": torch.tensor(4), "tokens": 100}}, tmp_path / "b")
    res = cli(a, b)
    assert res.exit_code == 2 and res.stderr.splitlines()[1] == (
        "hint: A and B hold training state only (train_state), which --what model leaves out: compare it with "
        "--what all"
    ), res.stderr
    doc = diff_json(a, b, "--what", "all", code=1)
    assert [d["name"] for d in doc["differences"]] == ["train_state.step"], doc["differences"]


def test_no_common_name_hint_names_a_key_of_a_million_characters_by_its_ends(tmp_path: Path) -> None:
    """E611's hint shows two names of each side: a key of 10^6 characters (with control characters) is shown by its
    start, end and length, on one line with no control character reaching the terminal. Before, it was printed
    whole (a 1 MB hint line)."""
    key = "blocks." * 150_000 + "\x1b]0;title\x07proj.weight"
    a = _save({"model": {key: torch.zeros(2), "norm.weight": torch.ones(2)}}, tmp_path / "a")
    b = _save({"model": {"other.weight": torch.zeros(2)}}, tmp_path / "b")
    res, err = refused(a, b)
    assert len(err) == 2 and err[0].startswith("error: [E611]") and "\x1b" not in res.stderr, err[0]
    assert err[1].startswith("hint: A's names look like 'model.blocks.blocks.") and len(err[1]) < 1000, len(err[1])
    assert f"proj.weight ({len('model.' + key):,} characters)" in err[1] and "'model.norm.weight'" in err[1], err[1]
