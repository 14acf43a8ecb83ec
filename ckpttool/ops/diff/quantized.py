"""``diff`` of quantized sides: block-FP8 / MXFP4 weights compared by their dequantized values.

A side's weight that pairs with a scale (:func:`ckpttool.model.quantized.scaled_pairs`; the
block size from the side's ``config.json``, else 128; a compressed-tensors ``x.weight_scale`` plays
``x.weight_scale_inv``, its block from ``config_groups``; vLLM's per-tensor ``x.weight_scale`` is one block of
the whole weight) is compared as ``float32`` values: ``q * scale``
(block FP8, as torch's ``QuantizedHuggingFaceStorageReader``; fused experts ``[E, out, in]`` each on
its own block grid, as transformers' ``FP8Experts``), decoded slab by slab on the engine
(:mod:`ckpttool.ops.diff.gather`), or ``FP4 * 2^(e - 127)`` dims 1 and 2
swapped (MXFP4, as transformers' ``convert_moe_packed_tensors``); its scale is not compared on
its own. Against an unquantized side, unless ``--rtol`` / ``--atol`` are given, an element is
within tolerance when ``|a - b| <= atol + rtol * |b|`` with

- block FP8: ``rtol`` :data:`FP8_RTOL` (``2^-3``: one e4m3 step, twice the rounding error of round
  to nearest on 3 mantissa bits, which leaves room for the other side's BF16 rounding) and ``atol``
  ``2^-9`` times the element's own block scale (one e4m3fn subnormal step: values quantized to the
  subnormal range; an infinite scale's block dequantizes to infinities and NaN, all outside);
- MXFP4: ``rtol`` :data:`MXFP4_RTOL` (``2^-1``, one E2M1 step) and ``atol`` ``2^-1`` times the element's own
  group scale ``2^(e - 127)`` (one group's large scale does not widen the others'; an exponent 0xFF's group
  dequantizes to NaN, outside).

Two quantized sides are compared dequantized, bitwise unless a tolerance is given. ``docs/diff.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckpttool.model.quantized import (
    PACKED_DTYPES,
    packed_integer_weights,
    scale_grid,
    scaled_pairs,
    without_unusable_blocks,
)
from ckpttool.ops.diff.result import DEQUANTIZED_NOTE

if TYPE_CHECKING:
    from ckpttool.ops.diff.result import Item
    from ckpttool.ops.diff.run import Side

__all__ = [
    "FP8_RTOL",
    "MXFP4_RTOL",
    "dequantize_items",
    "fp8_decoder",
    "load_dequantized",
    "note",
    "packed_note",
    "quant_tolerance",
    "tolerance_used",
]

#: Default relative tolerance of a block-FP8 weight against an unquantized side: one e4m3 step (3 mantissa bits).
FP8_RTOL = 2.0**-3
#: Default relative tolerance of an MXFP4 weight against an unquantized side: one E2M1 step (1 mantissa bit).
MXFP4_RTOL = 2.0**-1
_FP8_ATOL_STEPS = 2.0**-9  # the e4m3fn subnormal step, in units of the block scale
_MXFP4_ATOL_STEPS = 2.0**-1  # the E2M1 subnormal step, in units of the group scale


def _side_config(side: Side) -> dict[str, Any] | None:
    return side.ckpt.own_hf_config()


def dequantize_items(side: Side, items: list[Item], notes: list[str] | None = None) -> tuple[list[Item], int]:
    """``items`` of ``side`` with each quantized weight replaced by its dequantized float32 value and its scale dropped.

    Only items that are stored tensors as they are (:attr:`Item.direct`) pair up. Returns the
    items and the number of weights dequantized; scales that do not fit their weights (then
    compared as stored) and integer-packed weights (:func:`packed_note`) are said in ``notes``.
    """
    direct = {i.name: i for i in items if i.direct and i.dtype != "bytes"}
    tensors = {n: (i.dtype, tuple(i.shape)) for n, i in direct.items()}
    if notes is not None:
        notes.extend(packed_note(side, tensors))
    if not any(d in ("float8_e4m3fn", "float8_e5m2", "uint8") for d, _ in tensors.values()):
        return items, 0
    config = _side_config(side)
    pairs, problems = scaled_pairs(tensors, config)
    pairs, unusable = without_unusable_blocks(pairs, config)  # no grid known: compared as stored, not on 128x128
    problems += unusable
    if problems and notes is not None:  # each problem names the grid or scheme it was checked against
        notes.append(
            f"{side.label}: {len(problems)} quantized weight(s) or scale(s) do not pair up, compared as stored "
            f"(e.g. {problems[0][1]}); a config.json with the quantization_config the weights were quantized with "
            "(weight_block_size, config_groups) beside the side gives their scheme"
        )
    if not pairs:
        return items, 0
    by_weight = {p.weight: p for p in pairs}
    scales = {direct[p.scale].name for p in pairs}
    out: list[Item] = []
    for i in items:
        if i.name in scales and i.direct:
            continue
        p = by_weight.get(i.name) if i.direct else None
        if p is None:
            out.append(i)
            continue
        out.append(
            replace(i, name=p.name, shape=p.shape, dtype="float32", dequant=(p.kind, direct[p.scale].key, p.block))
        )
    return out, len(pairs)


def packed_note(side: Side, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """The note on ``side``'s integer-packed quantized weights (:func:`~ckpttool.model.quantized.packed_integer_weights`:
    AWQ/GPTQ, bitsandbytes, compressed-tensors packed or int), compared as their stored integer codes; ``[]`` if none.
    ``tensors``: name -> ``(dtype name, shape)`` of the side's stored tensors."""
    if all(d not in PACKED_DTYPES for d, _ in tensors.values()):
        return []
    packed = packed_integer_weights(tensors)
    if not packed:
        return []
    methods = sorted({m for _, m in packed})
    return [
        f"{side.label}: {len(packed)} integer-packed quantized weight(s) ({'; '.join(methods)}; e.g. {packed[0][0]}) "
        "compared as their stored integer codes, not as values (ckpttool dequantizes none of these methods): their "
        "differences, rel L2 and cosine are of the packed words, and their scales and zero points are compared on "
        "their own as stored"
    ]


def load_dequantized(side: Side, item: Item) -> Any:
    """The float32 dequantized value of ``item`` (a weight :func:`dequantize_items` marked); notes its largest scale."""
    import numpy as np
    import torch

    from ckpttool.engine import kernels

    assert item.dequant is not None
    kind, scale_key, block = item.dequant
    scale = side.tensor(scale_key).clone()  # side.tensor reuses one buffer: the weight is read next
    if kind != "mxfp4":  # FP8 scales as float32 (compressed-tensors' of a BF16 model are stored bfloat16)
        scale = scale.float()
    q = side.tensor(item.key).reshape(-1).view(torch.uint8).numpy()
    if kind != "mxfp4":
        decode = fp8_decoder(side, item, scale.numpy())
        first = _piece_offset(item)  # a per-expert piece: its own rows of the fused codes only
        return decode(memoryview(q[first : first + math.prod(item.shape)]), 0).reshape(item.shape)
    e = scale.view(torch.uint8).numpy().reshape(-1)
    experts, rows, n = item.shape
    if not q.size:  # no element (an empty dim): nothing to dequantize, and no group size to reshape by
        side.quant_atol = 0.0
        return torch.zeros(item.shape, dtype=torch.float32)
    g = e.size // experts // n
    b = q.size // e.size
    vals = kernels.mxfp4_dequantize(q.reshape(-1, b), e).reshape(experts, n, g * 2 * b)
    finite = e[e != 0xFF]  # an exponent 0xFF (NaN) would make every element of the tensor "within"
    side.quant_atol = _MXFP4_ATOL_STEPS * (2.0 ** (int(finite.max()) - 127) if finite.size else 0.0)
    side.quant_atol_at = _mxfp4_atol_at(e.reshape(experts, n, g), 2 * b)
    return torch.from_numpy(np.ascontiguousarray(vals.transpose(0, 2, 1)))


def fp8_decoder(side: Side, item: Item, scale: Any = None) -> Callable[[memoryview, int], Any]:
    """``decode(e4m3fn bytes, first)``: float32 ``q * scale`` of the weight's flat elements ``[first, first + len)``.

    ``item``: an FP8 weight :func:`dequantize_items` marked (``fp8-block``, ``fp8-compressed-tensors`` or
    ``fp8-tensor`` ``[out, in]``, ``fp8-experts`` ``[E, out, in]``); ``scale``: its float32 scales (default: read from ``side``). Sets ``side.quant_atol``
    from the largest finite scale and ``side.quant_atol_at`` from each block's own. Rows are dequantized by :func:`~ckpttool.engine.kernels.fp8_rows_dequantize`
    (a row a slab cuts is completed with zeros first), so any cut gives the values of the whole tensor.
    """
    import numpy as np
    import torch

    from ckpttool.engine import kernels

    assert item.dequant is not None
    _, scale_key, block = item.dequant
    shape = _stored_shape(item)
    s = scale if scale is not None else side.tensor(scale_key).float().numpy().copy()
    s = s.reshape(scale_grid(shape, block))  # one scale per tensor ([] or [1]): a grid of one block
    *_, rows, cols = shape
    # one scale grid per expert (one for a 2-D weight); counted, as -1 cannot be inferred for an empty grid
    grids = s.reshape(int(np.prod(s.shape[:-2])), *s.shape[-2:])
    own = grids[item.piece[0]] if item.piece is not None else s  # a piece: its expert's scales
    finite = own[np.isfinite(own)]  # an infinite scale (damaged) would make every element of the tensor "within"
    side.quant_atol = _FP8_ATOL_STEPS * (float(finite.max()) if finite.size else 0.0)
    offset = _piece_offset(item)  # a piece's element k is the fused tensor's element offset + k
    side.quant_atol_at = _fp8_atol_at(grids, rows, cols, block, offset)

    def decode(raw: memoryview, first: int) -> Any:
        q = np.frombuffer(raw, np.uint8)
        out = np.empty(q.size, np.float32)
        first += offset
        pos = 0
        while pos < q.size:
            e, r = divmod((first + pos) // cols, rows)
            c = (first + pos) % cols
            if c or q.size - pos < cols:  # part of a row: dequantized as a whole row
                m = min(cols - c, q.size - pos)
                row = np.zeros((1, cols), np.uint8)
                row[0, c : c + m] = q[pos : pos + m]
                out[pos : pos + m] = kernels.fp8_rows_dequantize(row, grids[e], r, block)[0, c : c + m]
            else:
                k = min(rows - r, (q.size - pos) // cols)
                m = k * cols
                out[pos : pos + m] = kernels.fp8_rows_dequantize(
                    q[pos : pos + m].reshape(k, cols), grids[e], r, block
                ).reshape(-1)
            pos += m
        return torch.from_numpy(out)

    return decode


def _stored_shape(item: Item) -> tuple[int, ...]:
    """The shape of the stored weight of ``item`` (a per-expert piece's: the fused ``[E, out, in]``)."""
    return tuple(item.entry.shape) if item.piece is not None and item.entry is not None else tuple(item.shape)


def _piece_offset(item: Item) -> int:
    """The stored flat element of a per-expert piece's first element (``piece`` ``(expert, part, parts)`` of the
    fused ``[E, out, in]``: rows ``part * out/parts`` on of expert ``expert``); 0 for a whole weight."""
    if item.piece is None:
        return 0
    j, p, n = item.piece
    _, out, cols = _stored_shape(item)
    return (j * out + p * (out // n)) * cols


def _fp8_atol_at(grids: Any, rows: int, cols: int, block: tuple[int, int], offset: int = 0) -> Callable[[Any], Any]:
    """``atol(flat positions)`` of a block-FP8 weight ``[E, rows, cols]``: ``2^-9`` times the scale of each
    element's own block (an infinite scale counts 0: its block dequantizes to infinities, outside anyway);
    ``offset``: the stored flat element of position 0 (a per-expert piece's)."""
    import numpy as np
    import torch

    g = torch.from_numpy(np.where(np.isfinite(grids), grids, 0.0).astype(np.float64)) * _FP8_ATOL_STEPS
    br, bc = block

    def at(pos: Any) -> Any:
        pos = pos + offset
        e, rem = pos // (rows * cols), pos % (rows * cols)
        return g[e, (rem // cols) // br, (rem % cols) // bc]

    return at


def _mxfp4_atol_at(exponents: Any, group: int) -> Callable[[Any], Any]:
    """``atol(flat positions)`` of an MXFP4 weight dequantized to ``[E, G*group, N]`` (``exponents`` ``[E, N, G]``,
    ``group`` values a group): ``2^-1`` times the scale ``2^(e - 127)`` of each element's own group (an exponent
    0xFF counts 0: its group dequantizes to NaN, outside anyway)."""
    import numpy as np
    import torch

    experts, n, g = exponents.shape
    scale = np.ldexp(1.0, exponents.astype(np.int64) - 127)
    t = torch.from_numpy(np.where(exponents == 0xFF, 0.0, scale * _MXFP4_ATOL_STEPS))
    rows = g * group

    def at(pos: Any) -> Any:
        e, rem = pos // (rows * n), pos % (rows * n)
        return t[e, rem % n, (rem // n) // group]

    return at


def quant_tolerance(ia: Item, ib: Item, a: Side, b: Side) -> tuple[float, Any] | None:
    """``(rtol, atol)`` of a pair with exactly one dequantized side (the defaults above), else ``None``;
    a block-FP8 or MXFP4 side's ``atol`` is per element (each block's or group's own scale: one large scale
    does not widen the others')."""
    if (ia.dequant is None) == (ib.dequant is None):
        return None
    side, it = (a, ia) if ia.dequant is not None else (b, ib)
    assert it.dequant is not None
    rtol = MXFP4_RTOL if it.dequant[0] == "mxfp4" else FP8_RTOL
    return rtol, side.quant_atol_at if side.quant_atol_at is not None else side.quant_atol


def tolerance_used(ia: Item, ib: Item, a: Side, b: Side) -> tuple[str, float, float] | None:
    """``(scheme, rtol, largest atol)`` of the default tolerance :func:`quant_tolerance` gave the pair just compared
    (the :attr:`~ckpttool.ops.diff.result.TensorStat.tolerance` of ``--json``), else ``None``."""
    used = quant_tolerance(ia, ib, a, b)
    if used is None:
        return None
    side, it = (a, ia) if ia.dequant is not None else (b, ib)
    assert it.dequant is not None
    return it.dequant[0], used[0], float(side.quant_atol)


def note(counts: tuple[int, int]) -> str | None:
    """The line the result's notes carry when weights were dequantized (``counts``: A's, B's)."""
    if not any(counts):
        return None
    sides = ", ".join(f"{n} in {s}" for n, s in zip(counts, "AB") if n)
    return (
        f"{DEQUANTIZED_NOTE} ({sides}; scales not compared on their own); against an "
        f"unquantized side within rtol {FP8_RTOL} (FP8) / {MXFP4_RTOL} (MXFP4) and atol one subnormal step times "
        "each element's block scale (FP8) / group scale (MXFP4), unless `rtol` / `atol` are given"
    )
