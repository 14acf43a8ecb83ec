"""Chunk boxes inside row-major tensors: tiling checks, contiguous runs, strides.

Pure integer functions over shapes (``tuple[int, ...]``, elements, C order) shared by
the reader, export, reshard and validate. A chunk ``(offsets, sizes)`` is the box
``[offsets[d], offsets[d] + sizes[d])`` in every dim ``d`` of the global tensor
(``torch/distributed/checkpoint/metadata.py``: ``ChunkStorageMetadata``).
"""

from __future__ import annotations

from ckpttool.format.metadata import ChunkMeta, TensorMeta

__all__ = ["row_major_stride", "contiguous_run", "tiling_problem"]


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
    if chunks:
        varying = [d for d in range(ndim) if len({(c.offsets[d], c.sizes[d]) for c in chunks}) > 1]
        if len(varying) <= 1:
            d = varying[0] if varying else 0
            first = chunks[0]
            fixed_ok = all(first.offsets[k] == 0 and first.sizes[k] == meta.size[k] for k in range(ndim) if k != d)
            if fixed_ok:
                iv = sorted((c.offsets[d], c.offsets[d] + c.sizes[d]) for c in chunks)
                pos = 0
                for lo, hi in iv:
                    if lo < pos:
                        return f"overlap: chunks overlap at index {lo} of dim {d}"
                    if lo > pos:
                        return f"gap: no chunk covers [{pos}, {lo}) of dim {d}"
                    pos = hi
                if pos != meta.size[d]:
                    return f"gap: no chunk covers [{pos}, {meta.size[d]}) of dim {d}"
                return None
    # General path: pairwise disjoint boxes whose volumes add up to the tensor's.
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if all(
                a.offsets[k] < b.offsets[k] + b.sizes[k] and b.offsets[k] < a.offsets[k] + a.sizes[k]
                for k in range(ndim)
            ):
                return f"overlap: chunks at {a.offsets} and {b.offsets} overlap"
    if covered != total:
        return f"gap: chunks cover {covered} of {total} elements"
    return None
