"""`D013` uninitialised-values on real ``dcp.save`` checkpoints.

The bug: a model built on the meta device, ``to_empty(device=...)`` (storage from
``torch.empty``: whatever the allocator hands back), and an ``init_weights()`` that forgets a
buffer (torchtitan's RoPE cache) or a parameter. What ``torch.empty`` returns depends on the
allocator's history, so the test writes into exactly that never-initialised storage the heap
words recycled memory holds (addresses and small counters): deterministic bytes, the real path.
Clean checkpoints of several sizes (trained with ``torch.optim.AdamW``, FP32 and BF16), an
upcycled MoE at step 0 and a LoRA at init stay silent (tests/ops/validate/test_content.py holds
the last two, and the torchtitan saves).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def run(*args: Any) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def d013(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["code"] == "D013"]


class Block(torch.nn.Module):
    def __init__(self, dim: int, seq: int) -> None:
        super().__init__()
        self.register_buffer("cache", torch.empty(seq, dim))  # a RoPE cache, persistent
        self.wq = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, 4, bias=False)

    def init_weights(self) -> None:
        """The buggy init: wq only (the cache and head are left as to_empty made them)."""
        torch.nn.init.normal_(self.wq.weight, std=0.02)
        torch.nn.init.zeros_(self.wq.bias)


def _heap_words(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` int64 words as recycled heap memory holds them: user-space addresses (0x00007fxx_xxxxxxxx)."""
    low = torch.randint(0, 1 << 31, (n,), generator=gen, dtype=torch.int64) << 1
    high = 0x7F00 + torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64)
    return (high << 32) | low


def test_to_empty_without_init_is_reported(tmp_path: Path) -> None:
    with torch.device("meta"):
        m = Block(16, 32)
    m.to_empty(device="cpu")
    m.init_weights()
    gen = torch.Generator().manual_seed(0)
    # the storage to_empty allocated, never initialised: as recycled memory leaves it
    m.cache.view(torch.int64).view(-1).copy_(_heap_words(m.cache.numel() // 2, gen))  # addresses
    m.head.weight.view(torch.int32).copy_(torch.randint(1, 4096, m.head.weight.shape, generator=gen))  # counters
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "step-0"))
    rc, doc = run(tmp_path / "step-0", "--deep")
    by_key = {f["key"]: f for f in d013(doc)}
    assert sorted(by_key) == ["model.cache", "model.head.weight"], doc["findings"]
    cache = by_key["model.cache"]["message"]
    assert re.search(
        r"\d+ with \|x\| > 10000 \(largest [\d.]+e\+\d+\) and \d+ subnormal \(5\d\.\d%\) of 512 values", cache
    )
    assert "64 subnormal (100.0%) of 64 values" in by_key["model.head.weight"]["message"]
    assert by_key["model.cache"]["severity"] == "warning" and "to_empty" in by_key["model.cache"]["hint"]
    rc, _ = run(tmp_path / "step-0", "--deep", "--strict")
    assert rc == 1
    rc, doc = run(tmp_path / "step-0")
    assert not d013(doc)  # a --deep rule


def _train(dim: int, layers: int, dtype: torch.dtype, steps: int, seed: int) -> torch.nn.Module:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend
    try:
        return _train_on(dim, layers, dtype, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train_on(dim: int, layers: int, dtype: torch.dtype, steps: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Embedding(64, dim),
        *[
            torch.nn.Sequential(
                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
            )
            for _ in range(layers)
        ],
        torch.nn.Linear(dim, 64, bias=False),
    ).to(dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    for _ in range(steps):
        x = torch.randint(0, 64, (8, 16))
        loss = torch.nn.functional.cross_entropy(m(x).float().reshape(-1, 64), x.roll(1, 1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    m.opt = opt  # type: ignore[assignment]
    return m


@pytest.mark.parametrize(
    ("dim", "layers", "dtype"), [(8, 1, torch.float32), (32, 2, torch.bfloat16), (64, 3, torch.float32)]
)
def test_trained_models_are_silent(tmp_path: Path, dim: int, layers: int, dtype: torch.dtype) -> None:
    m = _train(dim, layers, dtype, steps=10, seed=dim)
    opt = m.opt
    del m.opt
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "step-10"))
    _, doc = run(tmp_path / "step-10", "--deep")
    assert not d013(doc), doc["findings"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_magnitude_counts_match_torch(dtype: torch.dtype) -> None:
    """The deep pass's bit-pattern counts equal torch's on values of every kind (both signs)."""
    from ckpttool.ops.validate.deep import SUBNORMAL_DTYPES, SUBNORMAL_STRIDE, _summarise
    from ckpttool.ops.validate.stats import UNINIT_BOUND

    gen = torch.Generator().manual_seed(1)
    tiny = torch.finfo(dtype).tiny
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
    garbage = torch.randint(-(2**15), 2**15, (4096,), generator=gen, dtype=torch.int64).to(bits).view(dtype)
    special = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 4, -tiny / 4, 1e4, -1e4, 1.01e4, float("inf"), float("nan")])
    t = torch.cat([torch.randn(1000, generator=gen, dtype=torch.float32).to(dtype), garbage, special.to(dtype)])
    for part in (t, t[:1000], t[-len(special) :]):
        st = _summarise("w", part, str(dtype).removeprefix("torch."), False, False, True)
        a = part.double().abs()
        assert st.beyond == int(((a > UNINIT_BOUND) & a.isfinite()).sum())
        if st.beyond:
            assert st.beyond_max == float(a[a.isfinite()].max())
        sub = (a > 0) & (a < tiny)
        sampled = bool(sub[::SUBNORMAL_STRIDE].any())  # exact counts where the strided sample shows one
        want_sub = int(sub.sum()) if st.dtype in SUBNORMAL_DTYPES and sampled else 0
        assert st.subnormal == want_sub
    heap = torch.randint(1, 4096, (3000,), generator=gen, dtype=torch.int64).to(bits)  # counters: all subnormal
    if dtype in (torch.float32, torch.float64):
        st = _summarise("w", heap.view(dtype), str(dtype).removeprefix("torch."), False, False, True)
        assert st.subnormal == 3000 * heap.element_size() // heap.view(dtype).element_size()
