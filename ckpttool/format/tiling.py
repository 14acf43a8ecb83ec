"""Chunk boxes inside row-major tensors: tiling checks, contiguous runs, strides.

Pure integer functions over shapes (``tuple[int, ...]``, elements, C order) shared by
the reader, export, reshard and validate. A chunk ``(offsets, sizes)`` is the box
``[offsets[d], offsets[d] + sizes[d])`` in every dim ``d`` of the global tensor
(``torch/distributed/checkpoint/metadata.py``: ``ChunkStorageMetadata``).
"""

from __future__ import annotations

import math

from ckpttool.format.metadata import ChunkMeta, TensorMeta

__all__ = ["row_major_stride", "contiguous_run", "tiling_problem", "MAX_SHARDED_DIMS"]


def unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    """The index in ``shape`` (C order) of flat element ``flat`` (``[]`` for a 0-d shape)."""
    out = []
    for d in reversed(shape):
        flat, r = divmod(flat, d) if d else (flat, 0)
        out.append(r)
    return out[::-1]


def row_major_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    """Strides (elements) of a contiguous C-order tensor of ``size`` (torch's ``Tensor.stride()``).

    Dims of size 0 count as 1, as torch does for empty tensors.
    """
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def contiguous_run(shape: tuple[int, ...], start: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` of a box inside a C-order tensor of ``shape`` when the box is one run.

    A box is one contiguous run when every dim after the first dim it does not span
    with size 1 is whole (e.g. FSDP's ``Shard(0)`` row blocks, or one expert slab).

    Args:
        shape: the enclosing tensor's shape.
        start: the box's first index per dim.
        sizes: the box's extent per dim.

    Returns:
        The run in elements, or ``None`` when the box is not contiguous.
    """
    ndim = len(shape)
    k = 0
    while k < ndim and sizes[k] == 1:
        k += 1
    if any(start[d] != 0 or sizes[d] != shape[d] for d in range(k + 1, ndim)):
        return None
    offset, stride = 0, 1
    for d in reversed(range(ndim)):
        offset += start[d] * stride
        stride *= shape[d]
    count = 1
    for s in sizes:
        count *= s
    return offset, count


def tiling_problem(meta: TensorMeta) -> str | None:
    """Check that the chunks of ``meta`` tile the global tensor exactly (no gap, no overlap).

    Returns:
        ``None`` when they do, else a short description (``"gap: ..."`` or
        ``"overlap: ..."``). Zero-size chunks are valid and ignored.
    """
    if len(meta.chunks) == 1:  # the common case: one chunk that is the whole tensor
        c = meta.chunks[0]
        if c.sizes == meta.size and c.offsets.count(0) == len(c.offsets):
            return None
    total = meta.numel
    chunks: list[ChunkMeta] = [c for c in meta.chunks if c.numel > 0]
    covered = sum(c.numel for c in chunks)
    if not meta.size:  # 0-d
        if len(meta.chunks) == 0:
            return "gap: 0-d tensor has no chunk"
        return None
    if total == 0:
        return None
    # Fast path: chunks differ along a single dim and form contiguous intervals there.
    ndim = len(meta.size)
    varying = [d for d in range(ndim) if len({(c.offsets[d], c.sizes[d]) for c in chunks}) > 1]
    if chunks and len(varying) <= 1:
        decided, problem = _interval_tiling(meta, chunks, varying[0] if varying else 0)
        if decided:
            return problem
    # General path: exact and O(n * 2^k) for k sharded dims (see _corner_weights).
    if covered > total:
        return f"overlap: chunks hold {covered} elements, the tensor {total}"
    if covered < total:
        return f"gap: chunks cover {covered} of {total} elements"
    # With the volumes equal, a dim along which all chunks agree is whole in each of them.
    if len(varying) > MAX_SHARDED_DIMS:
        return f"overlap: chunks are split along {len(varying)} dims (at most {MAX_SHARDED_DIMS} are checked)"
    bad = _corner_weights(chunks, varying, meta.size)
    if bad is not None:
        return f"overlap: chunks overlap (and leave a gap) near index {bad}"
    return None


def _interval_tiling(meta: TensorMeta, chunks: list[ChunkMeta], d: int) -> tuple[bool, str | None]:
    """``(True, problem or None)`` when every chunk is whole in every dim but ``d``; ``(False, None)`` otherwise.

    The chunks' ``[offset, offset + size)`` intervals along ``d``, sorted, must then follow each
    other from 0 to the tensor's size with no gap or overlap.
    """
    ndim = len(meta.size)
    first = chunks[0]
    if not all(first.offsets[k] == 0 and first.sizes[k] == meta.size[k] for k in range(ndim) if k != d):
        return False, None
    iv = sorted((c.offsets[d], c.offsets[d] + c.sizes[d]) for c in chunks)
    pos = 0
    for lo, hi in iv:
        if lo < pos:
            return True, f"overlap: chunks overlap at index {lo} of dim {d}"
        if lo > pos:
            return True, f"gap: no chunk covers [{pos}, {lo}) of dim {d}"
        pos = hi
    if pos != meta.size[d]:
        return True, f"gap: no chunk covers [{pos}, {meta.size[d]}) of dim {d}"
    return True, None


#: Dims along which one tensor's chunks may be split for the general tiling check (2^k corners per chunk).
MAX_SHARDED_DIMS = 12


def _corner_weights(chunks: list[ChunkMeta], dims: list[int], size: tuple[int, ...]) -> tuple[int, ...] | None:
    """A corner where the boxes' indicator functions do not add up to the tensor's, or ``None`` (an exact tiling).

    The indicator of a box ``[a, b)`` is the signed sum of the orthant functions at its 2^k
    corners (``+`` for an even number of upper bounds ``b_d``, ``-`` for odd). Orthant functions
    at distinct points are linearly independent, so the boxes cover every element exactly once
    iff the signed corner weights of all boxes, minus those of the whole tensor, cancel at
    every point. One hash-map pass: O(n * 2^k) for n boxes split along k dims (k = 1, 2, 3 for
    FSDP, FSDP x TP, ...), instead of the O(n^2) pairwise overlap test.
    """
    k = len(dims)
    if len(chunks) > 2048:
        return _corner_weights_np(chunks, dims, size)
    weights: dict[tuple[int, ...], int] = {}
    get = weights.get
    masks = [(m, -1 if bin(m).count("1") % 2 else 1) for m in range(1 << k)]
    boxes = [(tuple(c.offsets[d] for d in dims), tuple(c.offsets[d] + c.sizes[d] for d in dims)) for c in chunks]
    boxes.append(((0,) * k, tuple(size[d] for d in dims)))
    last = len(boxes) - 1
    for i, (lo, hi) in enumerate(boxes):
        flip = -1 if i == last else 1
        for m, sign in masks:
            corner = tuple(hi[j] if m >> j & 1 else lo[j] for j in range(k))
            weights[corner] = get(corner, 0) + sign * flip
    for corner, w in weights.items():
        if w:
            return corner
    return None


def _corner_weights_np(chunks: list[ChunkMeta], dims: list[int], size: tuple[int, ...]) -> tuple[int, ...] | None:
    """:func:`_corner_weights` vectorised with numpy (for checkpoints of many chunks)."""
    import numpy as np

    k = len(dims)
    off = np.array([c.offsets for c in chunks], dtype=np.int64)[:, dims]
    hi = off + np.array([c.sizes for c in chunks], dtype=np.int64)[:, dims]
    whole_lo, whole_hi = np.zeros((1, k), dtype=np.int64), np.array([[size[d] for d in dims]], dtype=np.int64)
    n = len(chunks)
    corners = np.empty(((n + 1) << k, k), dtype=np.int64)
    signs = np.empty((n + 1) << k, dtype=np.int64)
    for m in range(1 << k):
        pick = np.array([(m >> j) & 1 for j in range(k)], dtype=bool)
        sign = -1 if bin(m).count("1") % 2 else 1
        base = m * (n + 1)
        corners[base : base + n] = np.where(pick, hi, off)
        corners[base + n] = np.where(pick, whole_hi, whole_lo)[0]
        signs[base : base + n] = sign
        signs[base + n] = -sign
    extent = [size[d] + 1 for d in dims]
    if math.prod(extent) < 1 << 62:  # one int64 key per corner
        mult = np.array([math.prod(extent[j + 1 :]) for j in range(k)], dtype=np.int64)
        keys = corners @ mult
        _, inverse = np.unique(keys, return_inverse=True)
    else:
        _, inverse = np.unique(corners, axis=0, return_inverse=True)
    totals = np.bincount(inverse.reshape(-1), weights=signs)
    nonzero = np.flatnonzero(totals)
    if nonzero.size == 0:
        return None
    first = int(np.flatnonzero(inverse.reshape(-1) == nonzero[0])[0])
    return tuple(int(x) for x in corners[first])
