"""Flat element ranges of checkpoint tensors, in true expert order, read chunk by chunk (bounded memory).

``replay-step`` computes its reference and compares slab by slab: for each slab of a
parameter it reads the *saved* values of that slab again (parameter, ``master_weight``,
``exp_avg``, ``exp_avg_sq``) from the data files, so no full-size copy of the pre-step state
is kept beside the optimizer's (which it updates in place, as a resumed run does).

A :class:`TensorSlabs` maps a range ``[a, b)`` of the tensor's flat C order (true expert
order: a legacy EP layout's block-transposed expert slabs along dim 0 are put back, see
``docs/design.md`` §4) onto the chunk segments that hold it
(:func:`ckpttool.ops.export.transform.chunk_segments`) and reads each piece with one
``os.preadv`` from the chunk's raw record (the chunk locator checks every chunk first).
Chunks the locator does not map (stream transforms, torch's newer encoding) are decoded
once by ``torch.load(weights_only=True)``; a permutation along another dim than 0 falls back
to the whole tensor in memory.
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any

from ckpttool.format.metadata import ChunkMeta, TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.layouts.declaration import ResolvedLayout
from ckpttool.ops.export.transform import chunk_segments

if TYPE_CHECKING:
    import torch

    from ckpttool.format.reader import CheckpointReader

__all__ = ["StackedSlabs", "TensorSlabs"]


class TensorSlabs:
    """Reads ``[a, b)`` of one tensor's flat elements (true expert order) into a 1-d tensor.

    Args:
        reader: the checkpoint reader (thread-safe).
        layout: the resolved layout (permutation of legacy EP tensors).
        key: the checkpoint key; ``model_key``: the parameter's model key (ambiguity is decided on it).
        ambiguous: model keys replayed in stored order (unversioned, undeclared EP tensors).

    Raises:
        ChunkError: chunks that do not tile the tensor.
        LayoutError, LayoutSizeError: as :func:`ckpttool.ops.tensors.to_canonical`.
    """

    def __init__(
        self, reader: CheckpointReader, layout: ResolvedLayout, key: str, model_key: str, ambiguous: set[str]
    ) -> None:

        self.reader, self.key = reader, key
        meta = reader.tensor_meta(key)
        assert isinstance(meta, TensorMeta)
        self.meta = meta
        self.dtype = meta.dtype.name
        self.numel = meta.numel
        reader.check_allocation(key, meta)
        problem = tiling_problem(meta)
        if problem is not None:
            raise reader.tiling_error(key, meta, problem)
        self._whole: torch.Tensor | None = None
        self._block = 0
        self._perm: list[int] | None = None
        if meta.size and model_key not in ambiguous:
            perm = layout.canonical_perm(key)
            spec = layout.spec_for(key)
            if perm is not None and spec is not None:
                if spec.ep_dim != 0:
                    from ckpttool.ops.tensors import to_canonical

                    self._whole = to_canonical(layout, key, reader.read_tensor(key)).reshape(-1)
                else:
                    from ckpttool.errors import LayoutSizeError

                    if meta.size[0] % len(perm):
                        raise LayoutSizeError(f"dim 0 of size {meta.size[0]} does not divide into {len(perm)} blocks")
                    self._perm = perm
                    self._block = self.numel // len(perm)
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        segs: list[tuple[int, int, ChunkMeta, int]] = []  # (global start, length, chunk, element offset in chunk)
        for c in meta.chunks:
            if c.numel == 0 or (c.offsets, c.sizes) in seen:
                continue
            seen.add((c.offsets, c.sizes))
            seg, nseg, start = chunk_segments(c, meta.size)
            segs.extend((start(i), seg, c, i * seg) for i in range(nseg))
        segs.sort(key=lambda s: s[0])
        self._segs = segs
        self._starts = [s[0] for s in segs]
        self._locs: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        self._lock = threading.Lock()

    def _stored_ranges(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(stored flat start, length, offset in the slab)`` of canonical ``[a, b)``."""
        if self._perm is None:
            return [(a, b - a, 0)]
        out = []
        be = self._block
        pos = a
        while pos < b:
            i, r = divmod(pos, be)
            n = min(b - pos, be - r)
            out.append((self._perm[i] * be + r, n, pos - a))
            pos += n
        return out

    def _location(self, chunk: ChunkMeta) -> Any:
        ident = (chunk.offsets, chunk.sizes)
        loc = self._locs.get(ident)
        if loc is None:
            loc = self.reader.locate(self.key, chunk)
            if not loc.raw:  # decoded once (torch.load weights_only) and sliced from memory
                t = self.reader.read_chunk(self.key, chunk)
                loc = t.contiguous().reshape(-1)
            with self._lock:
                self._locs[ident] = loc
        return loc

    def read(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (1-d, ``b - a`` elements of the stored dtype, contiguous) with elements ``[a, b)``.

        Raises:
            DataFileError, PathEscapeError, ChunkError: as :meth:`CheckpointReader.read_chunk`.
        """
        import torch

        if self._whole is not None:
            out.copy_(self._whole[a:b])
            return out
        item = out.element_size()
        raw = out.view(torch.uint8).numpy()
        for s, n, off in self._stored_ranges(a, b):
            end = s + n
            i = max(0, bisect.bisect_right(self._starts, s) - 1)
            while i < len(self._segs) and self._segs[i][0] < end:
                g, length, chunk, local = self._segs[i]
                lo, hi = max(s, g), min(end, g + length)
                if lo < hi:
                    loc = self._location(chunk)
                    dst = off + (lo - s)
                    start = local + (lo - g)
                    if isinstance(loc, torch.Tensor):
                        out[dst : dst + hi - lo].copy_(loc[start : start + hi - lo])
                    else:
                        self.reader.pread_into(
                            loc.info,
                            loc.record.data_offset + start * item,
                            raw[dst * item : (dst + hi - lo) * item],
                            self.key,
                        )
                i += 1
        return out


class StackedSlabs:
    """The flat elements of a fused parameter stored split, as one tensor.

    The fused tensor's rows are the parts' rows cut into ``groups`` equal row groups each and
    interleaved group by group (``groups`` 1: concatenation along dim 0). In C order rows are
    contiguous runs of elements, so ``[a, b)`` maps onto consecutive runs of the parts.

    Args:
        parts: one :class:`TensorSlabs` per part, in fused order (same dtype).
        groups: row groups per part (each part's element count divides by it).
    """

    def __init__(self, parts: list[TensorSlabs], groups: int = 1) -> None:
        self.parts = parts
        self.dtype = parts[0].dtype
        self.numel = sum(p.numel for p in parts)
        self._runs: list[tuple[int, int, int]] = []  # (fused start, part index, start in the part), then lengths
        self._lens: list[int] = []
        pos = 0
        for g in range(groups):
            for i, p in enumerate(parts):
                n = p.numel // groups
                self._runs.append((pos, i, g * n))
                self._lens.append(n)
                pos += n

    def read(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (1-d, ``b - a`` elements) with elements ``[a, b)`` of the fused tensor."""
        for (start, i, src), n in zip(self._runs, self._lens):
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                self.parts[i].read(src + lo - start, src + hi - start, out[lo - a : hi - a])
        return out
