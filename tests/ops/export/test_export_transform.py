"""The transform path of export (casts, splits, un-permutation slab by slab) against torch's own results.

The references are torch's ``Tensor.to`` and torch's ``dcp.load`` of the same checkpoints
(real 4-rank gloo DTensor saves, with chunks along inner dims and uneven shards); slab sizes
are forced small so every chunk spans many slabs, segments and runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from ckpttool.format.metadata import ChunkMeta
from ckpttool.model.checkpoint import OpenOptions
from ckpttool.ops.export import ExportOptions, export_checkpoint
from ckpttool.ops.export.transform import Cast, Run, RunMap, SlabWhere, chunk_segments
from tests.fixtures.moe_ep import true_state
from tests.fixtures.torch_free import run_without_torch

_PAIRS = [
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("bfloat16", "float32"),
    ("bfloat16", "float16"),
    ("float16", "float32"),
    ("float16", "bfloat16"),
    ("float64", "bfloat16"),
]


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Random values plus every class of edge: ties, subnormals, overflow, +-0, +-inf, NaN payloads."""
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(4099, generator=g, dtype=torch.float64) * s for s in (1e-3, 1.0, 1e3)]
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1e-40, 6e-8, 5.96e-8, 65504.0, 65520.0, 7e4, 3.4e38]
    )
    x = torch.cat([*parts, special.double()]).to(dtype)
    if dtype == torch.float32:  # halfway cases of bfloat16 rounding (even and odd upper halves) and NaN payloads
        bits = torch.tensor(
            [0x3F808000, 0x3F818000, 0x3F80_8001, 0x7F7F_FFFF, 0xFF7F_FFFF, 0x7FC0_0000, 0x7F80_0001, 0xFFFF_FFFF],
            dtype=torch.int64,
        ).to(torch.int32)
        x = torch.cat([x, bits.view(torch.float32)])
    return x


@pytest.mark.parametrize(("src", "dst"), _PAIRS)
def test_cast_kernels_equal_torch_bitwise(src: str, dst: str) -> None:
    x = _edge_values(getattr(torch, src))
    want = x.to(getattr(torch, dst))
    cast = Cast(src, dst)
    assert cast.fast == (src != "float64")
    out = torch.empty_like(want)
    src_np, out_np = x.view(torch.uint8).numpy(), out.view(torch.uint8).numpy()
    where = SlabWhere("k", tuple(x.shape), ((0, 0, x.numel()),))
    # edges beyond 65504 (float64's: beyond 3.4e38; float32's to bfloat16: from 3.39618e38): Cast refuses them
    if dst == "float16" or src in ("float64", "float32"):
        from ckpttool.engine.kernels import cast as kernel_cast
        from ckpttool.errors import ExportError

        with pytest.raises(ExportError, match=rf"^\[E601\] k: finite \w+ value\(s\) beyond {dst}'s range"):
            cast(src_np, out_np, where)
        if cast.fast:  # the kernel casts as torch
            kernel_cast(src_np, out_np, src, dst)
        else:
            out.copy_(x)
    else:
        cast(src_np, out_np, where)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan), "NaN stays NaN, nothing else becomes NaN"
    keep = ~nan
    assert torch.equal(
        out[keep].view(torch.uint8 if out.element_size() == 1 else _int(out)), want[keep].view(_int(want))
    )


@pytest.mark.parametrize("use_torch", [False, True])
@pytest.mark.parametrize("n", [7, 40000, 70001])
def test_f32_to_bf16_numpy_and_torch_kernels_equal_torch_bitwise(use_torch: bool, n: int) -> None:
    """Both kernels (numpy's passes; torch's copy_ when torch is imported) write torch's ``.to()`` bits,
    NaNs as the canonical 0x7FC0, over whole and partial pieces of torch's grain size."""
    from ckpttool.engine.kernels import BF16_NAN, f32_to_bf16

    x = _edge_values(torch.float32)
    x = x.repeat(n // x.numel() + 1)[:n].contiguous()
    x[::997] = float("nan")
    out = np.empty(n, dtype=np.uint16)
    f32_to_bf16(x.view(torch.int32).numpy().view(np.uint32), out, use_torch=use_torch)
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    want[torch.isnan(x).numpy()] = BF16_NAN
    assert np.array_equal(out, want)


def _int(t: torch.Tensor) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def test_chunk_segments_and_run_map() -> None:
    size = (4, 6, 5)
    # chunk [1:3, 2:5, :] -> 2 segments of 3*5 elements
    seg, nseg, start = chunk_segments(ChunkMeta((1, 2, 0), (2, 3, 5)), size)
    assert (seg, nseg) == (15, 2) and [start(0), start(1)] == [1 * 30 + 2 * 5, 2 * 30 + 2 * 5]
    seg, nseg, start = chunk_segments(ChunkMeta((0, 0, 1), (4, 6, 3)), size)  # inner-dim chunk: one segment per row
    assert (seg, nseg) == (3, 24) and start(7) == 7 * 5 + 1
    seg, nseg, start = chunk_segments(ChunkMeta((2, 0, 0), (2, 6, 5)), size)  # Shard(0) row block
    assert (seg, nseg, start(0)) == (60, 1, 60)
    rm = RunMap([Run(10, 5, 1, 0), Run(0, 10, 0, 3)])
    assert list(rm.parts(8, 4)) == [(0, 2, 0, 11), (2, 2, 1, 0)]
    with pytest.raises(ValueError):
        RunMap([Run(0, 5, 0, 0), Run(4, 2, 1, 0)])


def _torch_model(path: Path) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def _read_out(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / name), "pt") as f:
            for k in f.keys():
                got[k] = f.get_tensor(k)
    return got


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _slab_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the native record mover off (``engine/move.py``): every chunk goes through the Python slab loop."""
    from ckpttool.engine import move

    monkeypatch.setattr(move, "available", lambda *a, **k: False)


@pytest.mark.parametrize("slab", ["16", "100", "4096", "native mover"])
def test_inner_dim_chunks_cast_and_split_per_expert(
    ep_suite: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slab: str
) -> None:
    """FSDP on dim 1 (uneven 3/2 shards): every slab is many partial-row segments that cross piece boundaries.

    With a slab size the Python slab loop runs; ``native mover``: one native call per chunk where built."""
    if slab.isdigit():
        monkeypatch.setenv("CKPTTOOL_SLAB_BYTES", slab)
        _slab_path_only(monkeypatch)
    src = ep_suite / "legacy_dim1"
    ref = _torch_model(src)
    out = tmp_path / "o"
    res = export_checkpoint(src, out, ExportOptions(save_dtype="float32", experts="per-expert", workers=3))
    got = _read_out(out)
    n = 0
    for key, t in ref.items():
        name = key[len("model.") :]
        if ".experts." in key and t.dim() == 3:
            parts = 2 if key.endswith("gate_up_proj") else 1
            proj = ["gate_proj", "up_proj"] if parts == 2 else ["down_proj"]
            a = t.shape[1] // parts
            prefix = name.rsplit(".", 1)[0]
            for j in range(t.shape[0]):
                for p in range(parts):
                    want = t[j, p * a : (p + 1) * a].to(torch.float32)
                    assert torch.equal(_bits(got[f"{prefix}.{j}.{proj[p]}.weight"]), _bits(want)), (key, j, p)
                    n += 1
        else:
            want = t.to(torch.float32) if t.is_floating_point() else t
            assert torch.equal(_bits(got[name]), _bits(want)), key
            n += 1
    assert res.tensors == n == len(got)
    assert res.bytes_read == sum(t.numel() * t.element_size() for t in ref.values())


@pytest.mark.parametrize("mover", [True, False])
def test_legacy_unpermute_and_split_equal_the_true_state(
    ep_suite: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mover: bool
) -> None:
    """Block-transposed expert slabs (P=2, F=2 on dim 0): experts come out in true order, fused and split
    (by the native record mover where built, and by 64-byte slabs)."""
    from ckpttool.layouts.declaration import LayoutDeclaration

    monkeypatch.setenv("CKPTTOOL_SLAB_BYTES", "64")
    if not mover:
        _slab_path_only(monkeypatch)
    truth = true_state(8)
    decl = LayoutDeclaration(source_layout="legacy", ep_size=2, ep_fsdp_size=2)
    for experts in ("fused", "per-expert"):
        out = tmp_path / experts
        export_checkpoint(
            ep_suite / "legacy",
            out,
            ExportOptions(experts=experts, save_dtype="float16"),
            opening=OpenOptions(declaration=decl),
        )
        got = _read_out(out)
        for key, t in truth.items():
            if not key.startswith("model.") or ".experts." not in key:
                continue
            name = key[len("model.") :]
            want = t.to(torch.float16)
            if experts == "fused":
                assert torch.equal(_bits(got[name]), _bits(want)), key
            else:
                prefix, proj = name.rsplit(".", 1)
                for j in range(t.shape[0]):
                    if proj == "down_proj":
                        assert torch.equal(_bits(got[f"{prefix}.{j}.down_proj.weight"]), _bits(want[j])), (key, j)
                    else:
                        a = t.shape[1] // 2
                        assert torch.equal(_bits(got[f"{prefix}.{j}.gate_proj.weight"]), _bits(want[j, :a]))
                        assert torch.equal(_bits(got[f"{prefix}.{j}.up_proj.weight"]), _bits(want[j, a:]))


def test_cast_export_never_imports_torch(sample_ckpt: Path, tmp_path: Path) -> None:
    """A float32 -> bfloat16 export with per-expert split runs on numpy only (start-up and memory)."""
    run_without_torch(
        "export", str(sample_ckpt), str(tmp_path / "o"), "--save-dtype", "bfloat16", "--experts", "per-expert", "--json"
    )
    got = _read_out(tmp_path / "o")
    ref = _torch_model(sample_ckpt)
    w = ref["model.model.embed_tokens.weight"]
    assert torch.equal(_bits(got["model.embed_tokens.weight"]), _bits(w.to(torch.bfloat16)))
    assert all(t.dtype == torch.bfloat16 for t in got.values() if t.is_floating_point())
    assert np.isfinite(got["lm_head.weight"].float().numpy()).all()


def test_cast_export_checks_each_record_crc(sample_ckpt: Path, tmp_path: Path) -> None:
    """A bit flipped inside a stored record fails a cast export (E308, nothing published), as a verbatim one."""
    import shutil

    from ckpttool.errors import ChecksumError
    from tests.fixtures.damage import flip_value_bit

    ckpt = tmp_path / "ckpt"
    shutil.copytree(sample_ckpt, ckpt)
    key = "model.model.layers.0.self_attn.o_proj.weight"
    flip_value_bit(ckpt, key)
    with pytest.raises(ChecksumError, match="o_proj.weight"):
        export_checkpoint(ckpt, tmp_path / "o", ExportOptions(save_dtype="bfloat16"))
    assert not (tmp_path / "o").exists()
    export_checkpoint(ckpt, tmp_path / "o", ExportOptions(save_dtype="bfloat16", verify_crc=False))
    assert (tmp_path / "o" / "model.safetensors").is_file()


@pytest.mark.parametrize("mover", [True, False])
def test_float16_export_refuses_finite_values_beyond_its_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mover: bool
) -> None:
    """``--save-dtype float16`` of FP32 / BF16 values beyond +-65504 wrote infinity (torch's ``to``), exit 0 with a
    generic "narrowing" note; now E601 naming the tensor and the first such element, nothing published. Values
    stored as infinity or NaN stay what they are, and a model within range exports as before."""
    from ckpttool.errors import ExportError

    if not mover:
        _slab_path_only(monkeypatch)
    big = torch.zeros(64, 1024)
    big[3, 7] = 7e4
    ok = torch.randn(64, 1024)
    ok[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    for dtype in (torch.float32, torch.bfloat16):
        src = tmp_path / f"src-{dtype}"
        sd = {"model": {"model.norm.weight": big.to(dtype), "model.embed_tokens.weight": ok.to(dtype)}}
        dcp.save(sd, checkpoint_id=str(src), no_dist=True)
        out = tmp_path / f"out-{dtype}"
        with pytest.raises(
            ExportError,
            match=r"^\[E601\] model\.model\.norm\.weight: finite \w+ value\(s\) beyond float16's range .* "
            r"e\.g\. 70\d+ at \[3, 7\]$",
        ):
            export_checkpoint(src, out, ExportOptions(save_dtype="float16"))
        assert not out.exists()
        del sd["model"]["model.norm.weight"]
        src2 = tmp_path / f"src2-{dtype}"
        dcp.save(sd, checkpoint_id=str(src2), no_dist=True)
        export_checkpoint(src2, out, ExportOptions(save_dtype="float16"))
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            got = f.get_tensor("model.embed_tokens.weight")
        assert torch.equal(_bits(got), _bits(ok.to(dtype).to(torch.float16)))


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])
def test_float64_export_refuses_finite_values_beyond_the_narrower_range(tmp_path: Path, save_dtype: str) -> None:
    """``--save-dtype float32`` / ``bfloat16`` of an FP64 value beyond +-3.4e38 wrote infinity (torch's ``to``) with
    exit 0, where ``float16`` refused its own range (E601); both are E601 too, and the FP64 values within range
    export as torch casts them."""
    from ckpttool.errors import ExportError

    w = torch.tensor([[1.0, -2.5], [1e300, 3.0]], dtype=torch.float64)
    src = tmp_path / "src"
    dcp.save({"model": {"model.norm.weight": w}}, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "out"
    with pytest.raises(ExportError) as info:
        export_checkpoint(src, out, ExportOptions(save_dtype=save_dtype))
    largest = "3.40e38" if save_dtype == "float32" else "3.39e38"
    assert info.value.message == (
        f"model.model.norm.weight: finite float64 value(s) beyond {save_dtype}'s range (+-{largest}) would be "
        "written as infinity, e.g. 1e+300 at [1, 0]"
    )
    assert not out.exists()
    src2 = tmp_path / "src2"
    dcp.save({"model": {"model.norm.weight": w.clamp(-1e30, 1e30)}}, checkpoint_id=str(src2), no_dist=True)
    export_checkpoint(src2, out, ExportOptions(save_dtype=save_dtype))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.norm.weight")
    assert torch.equal(got, w.clamp(-1e30, 1e30).to(getattr(torch, save_dtype)))


@pytest.mark.parametrize("mover", [True, False])
def test_float16_overflow_named_at_its_index_past_the_first_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mover: bool
) -> None:
    """The native mover's index of an overflowing value (a later 64 MiB window, a later 256 KiB piece) is the
    element's own: both paths name the same value at the same index."""
    from ckpttool.errors import ExportError

    if not mover:
        _slab_path_only(monkeypatch)
    w = torch.zeros(4200, 4096)
    w[4150, 5] = -1e5
    src = tmp_path / "src"
    dcp.save({"model": {"model.layers.0.mlp.up_proj.weight": w}}, checkpoint_id=str(src), no_dist=True)
    with pytest.raises(ExportError) as info:
        export_checkpoint(src, tmp_path / "out", ExportOptions(save_dtype="float16"))
    assert info.value.message == (
        "model.model.layers.0.mlp.up_proj.weight: finite float32 value(s) beyond float16's range (+-65504) would be "
        "written as infinity, e.g. -100000 at [4150, 5]"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["native mover", "native slab", "torch slab"])
def test_float32_to_bfloat16_refuses_finite_values_that_round_to_infinity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """FP32 values in [3.39618e38, 3.40282e38] (bit patterns 0x7F7F8000..0x7F7FFFFF) are finite and round to
    bfloat16 infinity (torch's ``to``): ``--save-dtype bfloat16`` wrote infinity with exit 0, where float64 ->
    bfloat16 refused its overflow. Now E601 on every path (the native mover, the native slab kernel, torch's
    copy), the same message as the float64 case; the largest FP32 value that stays finite exports as torch casts
    it, and infinity / NaN stored as such stay what they are."""
    from ckpttool.engine import kernels
    from ckpttool.errors import ExportError

    if path != "native mover":
        _slab_path_only(monkeypatch)
    if path == "torch slab":
        monkeypatch.setattr(kernels, "_native_cast", lambda *a, **k: None)  # not built: torch's copy_
    edge = torch.tensor([0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    big = torch.zeros(64, 1024)
    big[5, 3] = edge[0]
    ok = torch.randn(64, 1024)
    ok[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), float(edge[1]), -float(edge[1])])
    src = tmp_path / "src"
    dcp.save(
        {"model": {"model.norm.weight": big, "model.embed_tokens.weight": ok}}, checkpoint_id=str(src), no_dist=True
    )
    out = tmp_path / "out"
    with pytest.raises(ExportError) as info:
        export_checkpoint(src, out, ExportOptions(save_dtype="bfloat16"))
    assert info.value.code == "E601"
    assert info.value.message == (
        "model.model.norm.weight: finite float32 value(s) beyond bfloat16's range (+-3.39e38) would be written as "
        "infinity, e.g. 3.39618e+38 at [5, 3]"
    )
    assert "save_dtype` preserve" in str(info.value.hint)
    assert not out.exists()
    big[5, 3] = 0.0
    big[63, 1023] = edge[2]  # the most negative FP32 value, the last element
    src2 = tmp_path / "src2"
    dcp.save({"model": {"model.norm.weight": big}}, checkpoint_id=str(src2), no_dist=True)
    with pytest.raises(ExportError, match=r"e\.g\. -3\.40282e\+38 at \[63, 1023\]$"):
        export_checkpoint(src2, out, ExportOptions(save_dtype="bfloat16"))
    src3 = tmp_path / "src3"
    dcp.save({"model": {"model.embed_tokens.weight": ok}}, checkpoint_id=str(src3), no_dist=True)
    export_checkpoint(src3, out, ExportOptions(save_dtype="bfloat16"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.embed_tokens.weight")
    want = ok.to(torch.bfloat16)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    assert torch.equal(_bits(got[keep]), _bits(want[keep]))


@pytest.mark.parametrize(("value", "suggested"), [(7e4, "bfloat16"), (3.4e38, "preserve")])
def test_float16_overflow_hint_suggests_bfloat16_only_where_it_holds_the_value(
    tmp_path: Path, value: float, suggested: str
) -> None:
    """The float16 refusal's hint named ``save_dtype`` bfloat16 ("float32's range") for every value, 3.4e38 too,
    which bfloat16 also makes infinite (largest finite 3.39e38): that export would be refused again. The hint names
    bfloat16 only for a value it holds, else preserve."""
    from ckpttool.errors import ExportError

    src = tmp_path / "src"
    dcp.save({"model": {"model.norm.weight": torch.tensor([1.0, value])}}, checkpoint_id=str(src), no_dist=True)
    with pytest.raises(ExportError) as info:
        export_checkpoint(src, tmp_path / "out", ExportOptions(save_dtype="float16"))
    hint = str(info.value.hint)
    assert hint.startswith(f"export with `save_dtype` {suggested} "), hint
    assert ("bfloat16" in hint) == (suggested == "bfloat16"), hint
    if suggested == "bfloat16":  # the hint's export works
        export_checkpoint(src, tmp_path / "out", ExportOptions(save_dtype="bfloat16"))
    else:
        with pytest.raises(ExportError, match="beyond bfloat16's range"):
            export_checkpoint(src, tmp_path / "out", ExportOptions(save_dtype="bfloat16"))


def test_a_slab_size_int_cannot_read_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CKPTTOOL_SLAB_BYTES`` of 5,000 digits (more than ``int()`` reads) was E999 'Exceeds the limit (4300
    digits)' in every transforming export; it is ignored as any value that is not a size."""
    from ckpttool.ops.export.transform import SLAB_BYTES, env_slab_bytes

    for value in ("9" * 5000, "\u00b2", "0"):
        monkeypatch.setenv("CKPTTOOL_SLAB_BYTES", value)
        assert env_slab_bytes() == SLAB_BYTES
    monkeypatch.setenv("CKPTTOOL_SLAB_BYTES", "4096")
    assert env_slab_bytes() == 4096
