"""``export --quantize fp8-block``: DeepSeek-V3 block FP8 weights beside their ``weight_scale_inv``.

Each selected 2-D ``*.weight`` ``[out, in]`` (float32 / bfloat16 / float16 source) becomes
``float8_e4m3fn`` (safetensors ``F8_E4M3``) plus ``<name>_scale_inv`` (``x.weight`` ->
``x.weight_scale_inv``), float32 ``[ceil(out / B), ceil(in / B)]``, ``B`` = ``--quantize-block``
(128). Per ``B x B`` block: ``scale = amax / 448`` (edge blocks padded in the scale computation
only; an all-zero block gets ``scale = 1``), ``q = e4m3fn(w / scale)`` rounded to nearest even
and saturated to ±448; ``weight_scale_inv`` stores ``scale`` (DeepSeek's name: ``q * scale``
dequantizes, as torch's ``QuantizedHuggingFaceStorageReader`` and transformers'
``FineGrainedFP8`` do). Left in the save dtype (``bfloat16`` unless ``--save-dtype``): anything
not a 2-D ``*.weight``, :data:`DEFAULT_SKIP` (embeddings, norms, ``lm_head``, router gates) and
``--quantize-skip`` globs. ``config.json`` gets ``quantization_config`` (:func:`quantization_config`).

:class:`QuantizedFormat` wraps a model format (``hf``, ``hf-merged``) and plans the two pieces;
:class:`BlockQuantizer` runs one band of ``B`` rows per work unit (rows read from the stored
chunks that hold them: bounded memory), writes both pieces at their planned offsets and checks
every band (``docs/export.md``, "Quantized export (FP8)").
"""

from __future__ import annotations

import fnmatch
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import QuantizationError, UsageError
from ckpttool.ops.export.outputs import OutputFormat, PieceContext, PiecesFn, SourcePieces

if TYPE_CHECKING:
    import numpy as np

    from ckpttool.format.metadata import ChunkMeta, TensorMeta
    from ckpttool.format.reader import CheckpointReader
    from ckpttool.format.safetensors import ShardWriter
    from ckpttool.ops.export.plan import ExportPlan, Selected, SourceTask

__all__ = [
    "QUANT_METHODS",
    "DEFAULT_SKIP",
    "FP8_DTYPE",
    "MAX_BLOCK_REL_ERROR",
    "QuantSpec",
    "QuantizedFormat",
    "BlockQuantizer",
    "quantization_config",
    "recount_casts",
    "scale_name",
]

#: ``--quantize`` choices.
QUANT_METHODS = ("fp8-block",)
#: The quantized weights' dtype (safetensors ``F8_E4M3``).
FP8_DTYPE = "float8_e4m3fn"
#: Output keys left unquantized by default (globs over the output key): embeddings, norms, lm_head, router gates.
DEFAULT_SKIP = ("*embed*", "*wte*", "*wpe*", "*norm*", "lm_head.weight", "*.gate.weight", "*router*")
#: Source dtypes that are quantized (others are written as the save dtype says).
_QUANTIZABLE = ("float32", "bfloat16", "float16")
#: The largest error allowed, per block, relative to the block's amax: half an e4m3fn ulp at the top of the range
#: (16 / 448 = 0.0357, round to nearest even on 3 mantissa bits) plus float32 rounding of ``w / scale``.
MAX_BLOCK_REL_ERROR = 16 / 448 * (1 + 2**-10)


def scale_name(weight: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (DeepSeek-V3 / transformers ``FineGrainedFP8``)."""
    return weight + "_scale_inv"


@dataclass(frozen=True)
class QuantSpec:
    """``--quantize`` and its options.

    Attributes:
        method: one of :data:`QUANT_METHODS`.
        block: ``B`` of the ``B x B`` blocks (``--quantize-block``, default 128).
        skip: ``--quantize-skip`` globs over the output keys, added to :data:`DEFAULT_SKIP`.
    """

    method: str
    block: int = 128
    skip: tuple[str, ...] = ()

    def check(self, fmt: str) -> None:
        """Raises UsageError: an unknown method, a block < 1, or a format that writes no model weights (``lora``)."""
        if self.method not in QUANT_METHODS:
            raise UsageError(f"`quantize` {self.method!r} is not one of {', '.join(QUANT_METHODS)}", param="quantize")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise UsageError(f"`quantize_block` must be a positive integer, got {self.block!r}", param="quantize_block")
        if fmt == "lora":
            raise UsageError(
                "`quantize` applies to model weights; `fmt` lora writes an adapter",
                param="quantize",
                hint="export the model with `fmt` hf (or hf-merged) to quantize it",
            )

    def quantizes(self, name: str, shape: tuple[int, ...], dtype: str) -> bool:
        """Whether output tensor ``name`` (source ``shape``, ``dtype``) is quantized."""
        if len(shape) != 2 or not name.endswith(".weight") or dtype not in _QUANTIZABLE or 0 in shape:
            return False
        return not any(fnmatch.fnmatchcase(name, g) for g in (*DEFAULT_SKIP, *self.skip))


def quantization_config(block: int, not_converted: list[str]) -> dict[str, Any]:
    """The ``config.json`` ``quantization_config`` of a block FP8 export (DeepSeek-V3, transformers ``FineGrainedFP8Config``,
    vLLM ``fp8``): ``modules_to_not_convert`` names the modules of 2-D weights left unquantized."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": not_converted,
    }


def _row_order(task: SourceTask, rows: int, cols: int) -> list[int] | None:
    """Source row of each output row when ``task.runs`` is a permutation of whole rows (an adapter's RoPE rows),
    ``None`` for the identity; raises ValueError for any other run map."""
    if task.runs is None:
        return None
    src = [-1] * rows
    for r in task.runs:
        if r.length != cols or r.piece != 0 or r.src % cols or r.dst % cols:
            raise ValueError("not a row permutation")
        src[r.dst // cols] = r.src // cols
    if sorted(src) != list(range(rows)):
        raise ValueError("not a row permutation")
    return src


class QuantizedFormat(OutputFormat):
    """A model format (``base``) whose qualifying weights are written as block FP8 plus scales (:class:`QuantSpec`)."""

    def __init__(self, base: OutputFormat, spec: QuantSpec) -> None:
        self.base, self.spec = base, spec
        for attr in ("name", "help", "tensors_noun", "reads_adapter_config", "detects_model_adapter"):
            setattr(self, attr, getattr(base, attr))
        self.ties_embeddings, self.checks_model_class = base.ties_embeddings, base.checks_model_class
        self.quantized: dict[str, tuple[int, ...]] = {}  # source key -> output shape (filled as the plan is made)
        self.kept: list[str] = []  # modules of 2-D weights left unquantized

    # delegated hooks
    def check_options(self, experts: str) -> None:
        self.base.check_options(experts)

    def check_model_adapter(self, adapter: Any) -> None:
        self.base.check_model_adapter(adapter)

    def check_names(self, cat: Any, adapter: Any) -> None:
        self.base.check_names(cat, adapter)

    def select(self, req: Any) -> Any:
        return self.base.select(req)

    def check_selection(self, cat: Any, tags: dict[str, str], warnings: list[str]) -> None:
        self.base.check_selection(cat, tags, warnings)

    def starts_file(self, packed: int, nbytes: int, shard_size: int) -> bool:
        return self.base.starts_file(packed, nbytes, shard_size)

    def file_names(self, n: int) -> list[str]:
        return self.base.file_names(n)

    def prepare(self, req: Any) -> dict[str, Any] | None:
        return self.base.prepare(req)

    def transforms(self, req: Any) -> dict[str, Any]:
        return self.base.transforms(req)

    def check_written(self, transforms: dict[str, Any], plan: ExportPlan) -> None:
        self.base.check_written(transforms, plan)

    def documents(self, plan: ExportPlan, prepared: dict[str, Any] | None) -> dict[str, bytes]:
        return self.base.documents(plan, prepared)

    def skips_asset(self, name: str) -> bool:
        return self.base.skips_asset(name)

    # the quantization
    def pieces_planner(self) -> PiecesFn:
        """The base format's pieces; a qualifying weight's one piece becomes ``(fp8 weight, float32 scale_inv)``."""
        from ckpttool.ops.export.plan import Piece

        base_fn, spec, b = self.base.pieces_planner(), self.spec, self.spec.block

        def fp8_pieces(s: Selected, dtype: str, ctx: PieceContext) -> SourcePieces:
            pieces, runs, order, counted = base_fn(s, dtype, ctx)
            p = pieces[0]
            if s.merge is not None and spec.quantizes(p.name, p.shape, s.source.dtype):
                raise UsageError(
                    f"{p.name}: `quantize` of a LoRA-merged weight is not supported yet",
                    param="quantize",
                    hint="export with `fmt` hf (no merge), or leave the merged modules out with `quantize_skip`",
                )
            one = len(pieces) == 1 and p.expert is None and not p.shared and order is None
            if not one or not spec.quantizes(p.name, p.shape, s.source.dtype) or p.shape != s.source.shape:
                if len(p.shape) == 2 and p.name.endswith(".weight"):
                    self.kept.append(p.name.removesuffix(".weight"))
                return pieces, runs, order, counted
            if runs is not None:
                try:
                    _row_order_check(runs, p.shape)
                except ValueError:
                    self.kept.append(p.name.removesuffix(".weight"))
                    return pieces, runs, order, counted
            out, inn = p.shape
            self.quantized[s.source.key] = p.shape
            scales = Piece(scale_name(p.name), (-(-out // b), -(-inn // b)), "float32")
            return (Piece(p.name, p.shape, FP8_DTYPE), scales), runs, None, [p.name, scales.name]

        return fp8_pieces

    def edited_assets(self, model_config: dict[str, Any] | None) -> dict[str, bytes]:
        """The base format's edits, and ``config.json`` with ``quantization_config`` (:func:`quantization_config`)."""
        edited = dict(self.base.edited_assets(model_config))
        if model_config is not None:
            doc = json.loads(edited["config.json"]) if "config.json" in edited else dict(model_config)
            doc["quantization_config"] = quantization_config(self.spec.block, sorted(set(self.kept)))
            edited["config.json"] = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
        return edited


def recount_casts(plan: ExportPlan, save_dtype: str) -> None:
    """Count each quantized weight once as ``src->float8_e4m3fn`` in ``plan.casts`` / ``plan.narrowing``
    instead of twice (weight and scale) as ``src->save_dtype``."""
    for t in plan.tasks:
        p = t.pieces
        if len(p) != 2 or p[0].dtype != FP8_DTYPE or p[1].name != scale_name(p[0].name):
            continue
        src = t.selected.source.dtype
        if src != save_dtype:
            for d in (plan.casts, plan.narrowing):
                tag = f"{src}->{save_dtype}"
                if tag in d:
                    d[tag] -= 2
                    if d[tag] <= 0:
                        del d[tag]
        for d in (plan.casts, plan.narrowing):
            d[f"{src}->{FP8_DTYPE}"] = d.get(f"{src}->{FP8_DTYPE}", 0) + 1


def _row_order_check(runs: Any, shape: tuple[int, ...]) -> None:
    """Raises ValueError unless ``runs`` move whole rows of ``shape`` into one piece."""
    cols = shape[1]
    if any(r.length != cols or r.piece != 0 or r.src % cols or r.dst % cols for r in runs):
        raise ValueError("not a row permutation")


@dataclass
class _Stats:
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    blocks: int = 0
    zero_blocks: int = 0


class BlockQuantizer:
    """Quantizes the planned FP8 tasks of an export, one band of ``B`` output rows per call (thread-safe).

    Args:
        reader: the checkpoint reader.
        block: ``B``.
        tasks: the source keys quantized (:attr:`QuantizedFormat.quantized`).
    """

    def __init__(self, reader: CheckpointReader, block: int, tasks: set[str]) -> None:
        self.reader, self.block, self.tasks = reader, block, tasks
        self.stats: dict[str, _Stats] = {}  # output weight name -> its figures
        self._lock = threading.Lock()

    @staticmethod
    def bands(task: SourceTask) -> int:
        """Work units of ``task``: ``ceil(rows / B)`` bands (the scale's rows)."""
        return task.pieces[1].shape[0]

    def band(
        self, task: SourceTask, meta: TensorMeta, chunks: list[ChunkMeta], writer: ShardWriter, index: int
    ) -> None:
        """Read output rows ``[index * B, (index + 1) * B)``, quantize, check and write them and their scale row.

        Raises:
            QuantizationError (E607): a block holding NaN / infinity, a zero or non-finite scale for a
                non-zero block, or an error above :data:`MAX_BLOCK_REL_ERROR`.
        """
        import numpy as np

        from ckpttool.engine import kernels

        b = self.block
        weight, scales = task.pieces
        rows, cols = weight.shape
        r0, r1 = index * b, min(rows, (index + 1) * b)
        band = np.empty((r1 - r0, cols), dtype=np.float32)
        order = _row_order(task, rows, cols)
        for o0, s0, n in _source_ranges(order, r0, r1):
            self._read_rows(task.source_key, meta, chunks, s0, s0 + n, band[o0 - r0 : o0 - r0 + n])
        q, scale, amax = kernels.fp8_block_quantize(band, b)
        self._check_scales(weight.name, index, scale, amax)
        deq = kernels.fp8_block_dequantize(q, scale, b)
        worst, rel = kernels.fp8_block_error(band, deq, amax, b)
        if not rel <= MAX_BLOCK_REL_ERROR:
            raise QuantizationError(
                f"{weight.name}: rows {r0}..{r1 - 1} dequantize with a relative error of {rel:.4g} "
                f"(bound {MAX_BLOCK_REL_ERROR:.4g})",
                fqn=task.source_key,
            )
        # numpy stubs: __buffer__ only on 3.12+
        writer.write(weight.name, memoryview(q.reshape(-1)), r0 * cols)  # type: ignore[arg-type]
        writer.write(scales.name, memoryview(scale.view(np.uint8)), index * scales.shape[1] * 4)  # type: ignore[arg-type]
        with self._lock:
            st = self.stats.setdefault(weight.name, _Stats())
            st.max_abs_error = max(st.max_abs_error, worst)
            st.max_rel_error = max(st.max_rel_error, rel)
            st.blocks += len(scale)
            st.zero_blocks += int((amax == 0).sum())

    @staticmethod
    def _check_scales(name: str, index: int, scale: np.ndarray, amax: np.ndarray) -> None:
        import numpy as np

        bad = np.flatnonzero(~np.isfinite(scale) | ((scale <= 0) & (amax != 0)))
        if bad.size:
            j = int(bad[0])
            why = "holds NaN or infinity" if not np.isfinite(amax[j]) else f"amax {float(amax[j]):.4g} gives scale 0"
            raise QuantizationError(
                f"{name}: block ({index}, {j}) {why}: no finite positive FP8 scale",
                fqn=name,
                hint="leave the tensor unquantized with `quantize_skip`, or check the checkpoint with "
                "`ckpttool validate --deep`",
            )

    def _read_rows(
        self, key: str, meta: TensorMeta, chunks: list[ChunkMeta], s0: int, s1: int, dest: np.ndarray
    ) -> None:
        """Source rows ``[s0, s1)`` as float32 into ``dest`` (``[s1 - s0, cols]``), from every chunk holding part of them."""
        import numpy as np

        from ckpttool.engine.kernels import to_f32

        dtype = meta.dtype.name
        item = meta.dtype.itemsize
        for c in chunks:
            (cr, cc), (sr, sc) = c.offsets, c.sizes
            lo, hi = max(s0, cr), min(s1, cr + sr)
            if lo >= hi:
                continue
            start, n = (lo - cr) * sc * item, (hi - lo) * sc * item
            loc = self.reader.locate(key, c)
            if loc.raw:
                assert loc.record is not None
                buf = np.empty(n, dtype=np.uint8)
                self.reader.pread_into(loc.info, loc.record.data_offset + start, buf, key)
            else:  # a chunk the locator cannot map: decoded (whole) by the reader
                from ckpttool.ops.export.transform import _decoded_chunk

                buf = _decoded_chunk(self.reader, key, c)[start : start + n]
            dest[lo - s0 : hi - s0, cc : cc + sc] = to_f32(buf, dtype).reshape(hi - lo, sc)

    def summary(self) -> dict[str, Any]:
        """``--json`` ``quantization.tensors``: output weight name -> its error figures, sorted by name."""
        return {
            k: {
                "max_abs_error": v.max_abs_error,
                "max_rel_error": v.max_rel_error,
                "blocks": v.blocks,
                "zero_blocks": v.zero_blocks,
            }
            for k, v in sorted(self.stats.items())
        }


def _source_ranges(order: list[int] | None, r0: int, r1: int) -> list[tuple[int, int, int]]:
    """``(first output row, first source row, rows)`` of output rows ``[r0, r1)``: runs of consecutive source rows."""
    if order is None:
        return [(r0, r0, r1 - r0)]
    out: list[tuple[int, int, int]] = []
    for o in range(r0, r1):
        s = order[o]
        if out and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((o, s, 1))
    return out
