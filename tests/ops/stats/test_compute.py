"""The statistics kernels of ``ckpttool stats`` against float64 numpy on values of every kind."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ckpttool.ops.stats.compute import AdamHyper, Moments, ValueSums, adam_update, block_sum, sum_squares


def _values(dtype: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 0.02).astype(np.float64)
    special = [0.0, -0.0, 3.5, -7.25, 1e-3, -0.0, 0.0]
    x[: min(n, 7)] = special[: min(n, 7)]
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n", [1, 1023, 1024, 5000, 300_000])
def test_add_slice_matches_float64(dtype: str, n: int) -> None:
    x = _values(dtype, n)
    if n > 10:
        x[9], x[10] = np.nan, -np.inf
    sums = ValueSums()
    w, sq = sums.add_slice(x)
    s = sums.acc
    ref = x.astype(np.float64)
    fin = np.isfinite(ref)
    r = ref[fin]
    assert s.numel == n and s.nonfinite == int((~fin).sum())
    assert s.zeros == int((r == 0).sum())  # -0.0 is a zero
    assert s.abs_max == float(np.abs(r).max())
    tol = 1e-6 if dtype != "float64" else 1e-12
    assert math.isclose(s.s1, float(r.sum()), rel_tol=tol, abs_tol=tol * float(np.abs(r).sum()))
    assert math.isclose(s.s2, float((r * r).sum()), rel_tol=tol)
    assert np.array_equal(w, np.where(fin, ref, 0.0).astype(w.dtype))  # non-finite set to 0, positions kept
    assert np.allclose(sq, w.astype(np.float64) ** 2, rtol=1e-6)


def test_block_sum_precision() -> None:
    x = np.full(1 << 17, 0.1, np.float32)  # the worst case of float32 accumulation
    assert abs(block_sum(x) - float(x.astype(np.float64).sum())) / float(x.astype(np.float64).sum()) < 1e-6
    y = np.arange(3000, dtype=np.float32)
    assert block_sum(y) == float(y.sum())  # integers: exact
    assert math.isclose(sum_squares(y), float((y.astype(np.float64) ** 2).sum()), rel_tol=1e-7)  # float32 squares


def test_adam_update_is_the_formula() -> None:
    rng = np.random.default_rng(1)
    m = (rng.standard_normal(5000) * 1e-3).astype(np.float32)
    v = (rng.standard_normal(5000) * 1e-3).astype(np.float32) ** 2
    v[:3] = [0.0, -1e-9, 0.0]  # zero and (damaged) negative second moments: as 0
    m[0] = 0.0
    h = AdamHyper(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=7)
    acc = Moments()
    adam_update(m, v, h, acc)
    bc1, bc2 = 1 - 0.9**7, 1 - 0.95**7
    u = h.lr * np.abs(m.astype(np.float64)) / bc1 / (np.sqrt(np.maximum(v, 0) / bc2) + h.eps)
    assert acc.numel == 5000
    assert math.isclose(acc.max, float(u.max()), rel_tol=1e-5)
    assert math.isclose(acc.s2, float((u * u).sum()), rel_tol=1e-5)
    acc = Moments()
    adam_update(m, v, AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=0.0, step=1), acc)
    assert acc.numel == 5000 - 3  # eps 0: 0 / 0 and m / 0 (v = 0, v < 0) are not finite, left out


def test_stats_reads_packed_fp4_as_its_e2m1_values(tmp_path: object) -> None:
    # bytes 0..15: low nibbles are the 16 E2M1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), high nibbles 0
    import json
    import math
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    ck = Path(str(tmp_path)) / "ck"
    dcp.save(
        {"model": {"w": torch.arange(16, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}},
        checkpoint_id=str(ck),
        no_dist=True,
    )
    res = CliRunner().invoke(app, ["stats", "--json", str(ck)])
    assert res.exit_code == 0, res.stderr
    (t,) = json.loads(res.stdout)["checkpoints"][0]["tensors"]
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert t["numel"] == 32 and t["abs_max"] == 6.0 and t["mean"] == 0.0
    assert math.isclose(t["l2"], math.sqrt(2 * sum(v * v for v in e2m1)))


def test_stats_of_a_complex_tensor_are_of_its_moduli(tmp_path: object) -> None:
    # torchtitan saves RoPE's complex64 freqs_cis: a cast to float would drop the imaginary parts (and warn on stderr)
    import json
    import math

    import torch
    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    ck = f"{tmp_path}/ck"
    c = torch.polar(torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.3, 2.0, -1.0]))
    dcp.save({"model": {"freqs_cis": c}}, checkpoint_id=ck, no_dist=True)
    res = CliRunner().invoke(app, ["stats", "--json", ck])
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    (t,) = json.loads(res.stdout)["checkpoints"][0]["tensors"]
    assert t["numel"] == 3
    assert math.isclose(t["l2"], float(torch.linalg.vector_norm(c)), rel_tol=1e-6)
    assert math.isclose(t["abs_max"], 2.0, rel_tol=1e-6)
