"""``export --quantize``: FP8 weights beside their scales, in the DeepSeek-V3 or the compressed-tensors convention.

Each selected 2-D ``*.weight`` ``[out, in]`` (float32 / bfloat16 / float16 source; an expert of a
3-D ``[E, out, in]`` tensor split with ``--experts per-expert``; a LoRA-merged weight) becomes
``float8_e4m3fn`` (safetensors ``F8_E4M3``) plus a float32 scale; ``q * scale`` dequantizes. Fused
expert tensors ``[E, out, in]`` (:func:`fused_experts`, ``--experts fused``) are quantized expert by
expert, scales ``[E, ...]`` (transformers' ``FP8Experts`` layout: ``gate_up_proj`` +
``gate_up_proj_scale_inv``; ``fp8`` only, compressed-tensors refuses them); a fused piece two sources
write (torchtitan's ``w1|w3`` ``gate_up_proj``) after assembly, a block possibly straddling them.

- ``--quantize fp8-block`` (``B`` = ``--quantize-block``, 128): one scale per ``B x B`` block,
  ``[ceil(out / B), ceil(in / B)]``; per block ``scale = amax / 448`` (edge blocks padded in the
  scale computation only; an all-zero block gets ``scale = 1``), ``q = e4m3fn(w / scale)`` rounded
  to nearest even and saturated to ±448.
- ``--quantize fp8-channel`` (compressed-tensors only): one scale per output row, ``[out, 1]``.

``--quant-format`` (:data:`QUANT_FORMATS`) names the scale and ``config.json``'s ``quantization_config``:

- ``fp8`` (DeepSeek-V3, vLLM ``fp8``, transformers ``FineGrainedFP8``, torch's
  ``QuantizedHuggingFaceStorageReader``): ``x.weight_scale_inv`` (DeepSeek's name for the scale
  that multiplies), ``{"quant_method": "fp8", "weight_block_size": [B, B], ...}``;
- ``compressed-tensors`` (what llm-compressor writes and vLLM loads: ``compressed_tensors``
  ``ModelCompressor.update_config`` with the ``FP8_BLOCK`` / ``FP8_DYNAMIC`` preset schemes):
  ``x.weight_scale``, ``{"quant_method": "compressed-tensors", "format": "float-quantized",
  "config_groups": {"group_0": ...}, "ignore": [...]}`` (:func:`compressed_tensors_config`).

Left in the save dtype (``bfloat16`` unless ``--save-dtype``): anything not a 2-D ``*.weight`` nor fused
experts, :data:`DEFAULT_SKIP` (embeddings, norms, ``lm_head``, router gates), ``--quantize-skip`` globs and
pieces that are not whole rows of their sources.

:class:`QuantizedFormat` wraps a model format (``hf``, ``hf-merged``) and plans the two pieces of
each weight; :class:`BlockQuantizer` runs one band of ``B`` output rows per work unit (rows read
from the stored chunks that hold them: bounded memory; a LoRA delta added in FP32 before the
rounding), writes both pieces at their planned offsets and checks every band
(``docs/export.md``, "Quantized export (FP8)").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import ExportError, QuantizationError, UsageError
from ckpttool.format.tiling import unravel
from ckpttool.ops.export.outputs import OutputFormat, PieceContext, PiecesFn, SourcePieces

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from ckpttool.format.metadata import ChunkMeta, TensorMeta
    from ckpttool.format.reader import CheckpointReader
    from ckpttool.format.safetensors import ShardWriter
    from ckpttool.ops.export.plan import ExportPlan, Piece, Selected, SourceTask
    from ckpttool.ops.export.transform import Run

__all__ = [
    "QUANT_METHODS",
    "QUANT_FORMATS",
    "DEFAULT_SKIP",
    "FP8_DTYPE",
    "MAX_BLOCK_REL_ERROR",
    "QuantFormat",
    "QuantSpec",
    "QuantTask",
    "QuantizedFormat",
    "BlockQuantizer",
    "compressed_tensors_config",
    "quantization_config",
    "fused_experts",
    "recount_casts",
    "scale_name",
]

#: ``--quantize`` choices: one scale per ``B x B`` block, or per output row (compressed-tensors ``channel``).
QUANT_METHODS = ("fp8-block", "fp8-channel")
#: The quantized weights' dtype (safetensors ``F8_E4M3``).
FP8_DTYPE = "float8_e4m3fn"
#: Output keys left unquantized by default (globs over the output key): embeddings, norms, lm_head, router gates and
#: Qwen2-MoE's ``shared_expert_gate`` (vLLM builds both gates unquantized; llm-compressor's MoE recipes ignore them).
DEFAULT_SKIP = (
    "*embed*", "*wte*", "*wpe*", "*norm*", "lm_head.weight", "*.gate.weight", "*router*", "*shared_expert_gate*",
)  # fmt: skip
#: The input embeddings transformers' model classes tie ``lm_head`` to (:data:`~ckpttool.model.hfconfig.TIED_EMBEDDING_KEYS`,
#: under any prefix): Llama's ``embed_tokens``, GPT-2's ``wte``, GPT-NeoX's ``embed_in``, BLOOM's / Falcon's
#: ``word_embeddings``. One of them written without ``lm_head.weight``: the head is tied, kept out of the conversion.
_TIED_EMBEDDING_GLOBS = ("*embed_tokens.weight", "*wte.weight", "*embed_in.weight", "*word_embeddings.weight")
#: Source dtypes that are quantized (others are written as the save dtype says). float64 is rounded to float32 first
#: (:func:`_widen`), as torch's own ``.to(torch.float8_e4m3fn)`` of a double does (c10 converts from float).
_QUANTIZABLE = ("float32", "bfloat16", "float16", "float64")
#: The largest error allowed, per block, relative to the block's amax: half an e4m3fn ulp at the top of the range
#: (16 / 448 = 0.0357, round to nearest even on 3 mantissa bits) plus float32 rounding of ``w / scale``.
MAX_BLOCK_REL_ERROR = 16 / 448 * (1 + 2**-10)
_E607_HINT = (
    "leave the tensor unquantized with `quantize_skip`, or check the checkpoint with `ckpttool validate --deep`"
)
_MASTER_HINT = " (the values are its FP32 master_weight's: `weights` params quantizes the stored parameter)"


def scale_name(weight: str, suffix: str = "_scale_inv") -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (DeepSeek-V3 / transformers ``FineGrainedFP8``; ``suffix``
    ``_scale``: compressed-tensors)."""
    return weight + suffix


@dataclass(frozen=True)
class QuantFormat:
    """One ``--quant-format`` (a registry entry of :data:`QUANT_FORMATS`).

    Attributes:
        name: the ``--quant-format`` choice.
        scale_suffix: appended to ``x.weight`` to name its scale.
        methods: the ``--quantize`` methods it can write.
        help: one line for ``--help`` and the docs.
    """

    name: str
    scale_suffix: str
    methods: tuple[str, ...]
    help: str

    def config(self, spec: QuantSpec, kept: list[str]) -> dict[str, Any]:
        """``config.json`` ``quantization_config`` for ``spec``; ``kept``: modules of 2-D weights left unquantized."""
        if self.name == "fp8":
            return quantization_config(spec.block, kept)
        return compressed_tensors_config(spec.method, spec.block, kept)


#: ``--quant-format`` registry: the scale's name and the ``quantization_config`` of each convention.
QUANT_FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("fp8", "_scale_inv", ("fp8-block",), "DeepSeek-V3 block FP8 (weight_scale_inv, quant_method fp8)"),
        QuantFormat(
            "compressed-tensors",
            "_scale",
            ("fp8-block", "fp8-channel"),
            "llm-compressor's compressed-tensors float-quantized (weight_scale, config_groups, ignore)",
        ),
    )
}


#: The largest ``--quantize-block``: ``weight_block_size`` is read into 32-bit integers (vLLM, C kernels).
MAX_BLOCK = 2**31 - 1


@dataclass(frozen=True)
class QuantSpec:
    """``--quantize`` and its options.

    Attributes:
        method: one of :data:`QUANT_METHODS`.
        block: ``B`` of the ``B x B`` blocks (``--quantize-block``, default 128); ``fp8-channel`` takes only
            the default (the rows of a work unit there).
        skip: ``--quantize-skip`` globs over the output keys, added to :data:`DEFAULT_SKIP`.
        fmt: ``--quant-format``, a key of :data:`QUANT_FORMATS`.
    """

    method: str
    block: int = 128
    skip: tuple[str, ...] = ()
    fmt: str = "fp8"

    def check(self, fmt: str) -> None:
        """Raises UsageError: an unknown method or quant format, a method the quant format cannot write, a block < 1,
        a block other than 128 with ``fp8-channel``, or a format that writes no model weights (``lora``)."""
        if self.method not in QUANT_METHODS:
            raise UsageError(f"`quantize` {self.method!r} is not one of {', '.join(QUANT_METHODS)}", param="quantize")
        qf = QUANT_FORMATS.get(self.fmt)
        if qf is None:
            raise UsageError(
                f"`quant_format` {self.fmt!r} is not one of {', '.join(QUANT_FORMATS)}", param="quant_format"
            )
        if self.method not in qf.methods:
            raise UsageError(
                f"`quantize` {self.method} is not written by `quant_format` {self.fmt} (it writes {', '.join(qf.methods)})",
                param="quantize",
                hint="use `quant_format` compressed-tensors for per-channel scales",
            )
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise UsageError(f"`quantize_block` must be a positive integer, got {self.block!r}", param="quantize_block")
        if self.block > MAX_BLOCK:  # written into config.json's weight_block_size: readers hold it in 32 bits
            raise UsageError(
                f"`quantize_block` {self.block} is larger than {MAX_BLOCK} (2^31 - 1)",
                param="quantize_block",
                hint="a block at least as large as the weights quantizes each weight with one scale; 128 is the "
                "DeepSeek-V3 convention vLLM's kernels are tuned for",
            )
        if self.channel and self.block != 128:  # a block size fp8-channel would not write: never taken silently
            raise UsageError(
                f"`quantize_block` {self.block} sets the blocks of fp8-block; fp8-channel writes one scale per output row",
                param="quantize_block",
                hint="drop `quantize_block`, or quantize with `quantize` fp8-block",
            )
        if fmt == "lora":
            raise UsageError(
                "`quantize` applies to model weights; `fmt` lora writes an adapter",
                param="quantize",
                hint="export the model with `fmt` hf (or hf-merged) to quantize it",
            )

    @property
    def channel(self) -> bool:
        """One scale per output row (``fp8-channel``)."""
        return self.method == "fp8-channel"

    @property
    def scale_suffix(self) -> str:
        return QUANT_FORMATS[self.fmt].scale_suffix

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale of a ``[out, in]`` weight: ``[ceil(out / B), ceil(in / B)]`` per block, ``[out, 1]`` per channel;
        of fused experts ``[E, out, in]``: the same per expert, ``[E, ...]``."""
        *lead, out, inn = shape
        return (*lead, out, 1) if self.channel else (*lead, -(-out // self.block), -(-inn // self.block))

    def candidate(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether output tensor ``name`` is of a kind that is quantized: a 2-D ``*.weight`` or fused experts
        (:func:`fused_experts`), whatever its dtype and the skip globs."""
        return (len(shape) == 2 and name.endswith(".weight")) or fused_experts(name, shape)

    def quantizes(self, name: str, shape: tuple[int, ...], dtype: str) -> bool:
        """Whether output tensor ``name`` (shape ``shape``, source ``dtype``) is quantized."""
        if not self.candidate(name, shape) or dtype not in _QUANTIZABLE or 0 in shape:
            return False
        return not any(fnmatch.fnmatchcase(name, g) for g in (*DEFAULT_SKIP, *self.skip))


def fused_experts(name: str, shape: tuple[int, ...]) -> bool:
    """A fused expert tensor ``[E, out, in]`` of an ``experts`` module (transformers v5's ``mlp.experts.gate_up_proj`` /
    ``down_proj``, an adapter's fused ``w1|w3``, Megatron's grouped ``linear_fc1`` / ``linear_fc2``)."""
    return len(shape) == 3 and ".experts." in name and not name.endswith("bias")


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


def _fp8_args(strategy: str, dynamic: bool, **extra: Any) -> dict[str, Any]:
    """A compressed-tensors ``QuantizationArgs`` as ``model_dump`` writes it (8-bit float, symmetric)."""
    args = {"dynamic": dynamic, "group_size": None, "num_bits": 8, "strategy": strategy, "symmetric": True}
    args.update(extra)
    args["type"] = "float"
    return dict(sorted(args.items()))


def compressed_tensors_config(method: str, block: int, ignore: list[str]) -> dict[str, Any]:
    """The ``config.json`` ``quantization_config`` of a compressed-tensors FP8 export.

    As ``compressed_tensors.ModelCompressor.update_config`` writes it for llm-compressor's
    ``FP8_BLOCK`` (``fp8-block``: weights ``block`` with ``block_structure [B, B]``, dynamic
    activations per group of ``B``) or ``FP8_DYNAMIC`` (``fp8-channel``: weights ``channel``,
    dynamic activations per token) preset on ``Linear`` modules, ``format: float-quantized``,
    ``quantization_status: compressed``; ``ignore`` names the modules of 2-D weights left
    unquantized (``lm_head``, router gates, skipped ones).
    """
    if method == "fp8-channel":
        weights = _fp8_args("channel", False)
        acts = _fp8_args("token", True)
    else:
        weights = _fp8_args("block", False, block_structure=[block, block])
        acts = _fp8_args("group", True, group_size=block)
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": acts,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


#: ``(first output row, first source row, rows, source)``: a segment of a quantized piece's rows (:class:`QuantTask`).
Segment = tuple[int, int, int, int]


@dataclass(frozen=True)
class QuantTask:
    """The quantized pieces of one source task.

    For piece ``2k`` (FP8 weight ``[rows, cols]``, or fused experts ``[E, rows, cols]``) and ``2k + 1`` (its scale),
    ``rows[k]``: segments ``(first output row, first source row, rows, source)``; output rows counted over the
    piece's leading dims (``[prod(shape[:-1]), shape[-1]]``), source rows over the source's, ``source`` an index
    into ``sources`` (``sources[0]``: the task's own source key). A fused tensor written by several sources (an
    adapter's ``w1|w3`` ``gate_up_proj``) is quantized by its first source's task, which reads every source's
    rows (a block may straddle two sources); the other sources' tasks quantize nothing (no ``rows``).
    """

    rows: tuple[tuple[Segment, ...], ...]
    sources: tuple[str, ...] = ()

    @property
    def weights(self) -> int:
        return len(self.rows)


@dataclass
class _Shared:
    """A fused piece written by several sources, as planned so far (:meth:`QuantizedFormat.pieces_planner`)."""

    owner: str  # the first source's key: its task quantizes the piece
    rows: int  # the piece's rows over its leading dims
    quantized: bool
    keys: list[str] = dataclasses.field(default_factory=list)
    segments: list[Segment] = dataclasses.field(default_factory=list)


def _derived_runs(
    pieces: tuple[Piece, ...], runs: tuple[Run, ...] | None, order: tuple[int, ...] | None, shape: tuple[int, ...]
) -> list[Run]:
    """The element moves of a source (as ``execute.run_map``: explicit ``runs``, else the expert split and order)."""
    from ckpttool.ops.export.transform import Run

    if runs is not None:
        return list(runs)
    numel = 1
    for d in shape:
        numel *= d
    if len(pieces) == 1 and pieces[0].expert is None:
        if order is None:
            return [Run(0, numel, 0, 0)]
        row = numel // len(order)
        return [Run(stored * row, row, 0, j * row) for j, stored in enumerate(order)]
    row = numel // shape[0]
    out = []
    for i, p in enumerate(pieces):
        if p.expert is None:
            raise ValueError("a split piece without its expert")
        stored = order[p.expert] if order is not None else p.expert
        part = row // p.nparts
        out.append(Run(stored * row + p.part * part, part, i, 0))
    return out


def _segments(
    pieces: tuple[Piece, ...], runs: tuple[Run, ...] | None, order: tuple[int, ...] | None, shape: tuple[int, ...]
) -> list[list[tuple[int, int, int]]]:
    """Each piece's ``(first output row, first source row, rows)``; raises ValueError when a piece is not made of
    whole source rows (rows over the leading dims: ``[prod(shape[:-1]), shape[-1]]``)."""
    cols = shape[-1]
    if any(len(p.shape) < 2 or p.shape[-1] != cols for p in pieces):
        raise ValueError("not whole rows")
    segs: list[list[tuple[int, int, int]]] = [[] for _ in pieces]
    for r in _derived_runs(pieces, runs, order, shape):
        if r.src % cols or r.dst % cols or r.length % cols:
            raise ValueError("not whole rows")
        segs[r.piece].append((r.dst // cols, r.src // cols, r.length // cols))
    return segs


def _covering(segments: list[Segment], rows: int) -> tuple[Segment, ...]:
    """``segments`` sorted; raises ValueError unless they tile output rows ``[0, rows)``."""
    segments = sorted(segments)
    at = 0
    for o, _, n, _ in segments:
        if o != at:
            raise ValueError("rows not covered")
        at += n
    if at != rows:
        raise ValueError("rows not covered")
    return tuple(segments)


def _lead_rows(shape: tuple[int, ...]) -> int:
    """Rows of ``shape`` over its leading dims (``prod(shape[:-1])``)."""
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def _piece_rows(
    key: str,
    pieces: tuple[Piece, ...],
    runs: tuple[Run, ...] | None,
    order: tuple[int, ...] | None,
    shape: tuple[int, ...],
) -> QuantTask:
    """Each piece's rows as segments of whole rows of source ``key``; raises ValueError when a piece is not made of
    whole rows or a piece is shared with other sources."""
    if any(p.shared for p in pieces):
        raise ValueError("shared")
    segs = _segments(pieces, runs, order, shape)
    rows = tuple(_covering([(o, s0, n, 0) for o, s0, n in sg], _lead_rows(p.shape)) for p, sg in zip(pieces, segs))
    return QuantTask(rows, (key,))


class QuantizedFormat(OutputFormat):
    """A model format (``base``) whose qualifying weights are written as FP8 plus scales (:class:`QuantSpec`)."""

    def __init__(self, base: OutputFormat, spec: QuantSpec) -> None:
        self.base, self.spec = base, spec
        for attr in ("name", "help", "tensors_noun", "reads_adapter_config", "detects_model_adapter"):
            setattr(self, attr, getattr(base, attr))
        self.ties_embeddings, self.checks_model_class = base.ties_embeddings, base.checks_model_class
        self.quantized: dict[str, QuantTask] = {}  # source key -> its quantized pieces (filled as the plan is made)
        self.kept: list[str] = []  # modules of 2-D weights (and of fused experts) left unquantized
        self._shared: dict[str, _Shared] = {}  # fused piece written by several sources -> its plan so far
        self._experts: tuple[list[str], list[str]] = ([], [])  # (kept, quantized) fused expert tensors
        self._fused_rows: dict[str, int] = {}  # quantized fused expert tensor -> its rows (`out` of [E, out, in])
        self._names: set[str] = set()  # every output tensor planned (what the `quantize_skip` globs are matched to)
        self._fused_only = False  # a model adapter writes fused expert tensors (megatron's stacked experts)

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
        """The base format's pieces; each piece of a qualifying source becomes ``(fp8 weight, float32 scale)``.

        A source is quantized when every piece it writes qualifies (:meth:`QuantSpec.quantizes`) and is made
        of whole source rows (a weight, an adapter's RoPE row permutation, an expert of a per-expert split,
        fused experts ``[E, out, in]``, a LoRA-merged weight); otherwise all its pieces are written as the base
        format says. A fused piece written by several sources (an adapter's ``w1|w3`` ``gate_up_proj``) is
        quantized as one tensor, by its first source's task (:class:`QuantTask`).

        Raises:
            ExportError: fused expert tensors to quantize in a quant format that has no fused layout
                (compressed-tensors); a later source of a quantized fused piece that cannot be quantized with it.
        """
        base_fn, spec = self.base.pieces_planner(), self.spec

        def fp8_pieces(s: Selected, dtype: str, ctx: PieceContext) -> SourcePieces:
            pieces, runs, order, counted = base_fn(s, dtype, ctx)
            self._names.update(p.name for p in pieces)
            if s.hf is not None and s.hf.fused_experts:
                self._fused_only = True
            if len(pieces) == 1 and pieces[0].shared:
                return self._shared_piece(s, pieces[0], runs, counted)
            key = s.source.key
            task = None
            if all(spec.quantizes(p.name, p.shape, s.source.dtype) for p in pieces):
                self._check_fused(s, pieces)
                try:
                    task = _piece_rows(key, pieces, runs, order, s.source.shape)
                except ValueError:
                    task = None
            if task is None:
                self._check_skip_split(s, pieces)
                self._keep(pieces)
                return pieces, runs, order, counted
            self.quantized[key] = task
            out = self._pairs(pieces)
            return out, None, None, [p.name for p in out]

        return fp8_pieces

    def _pairs(self, pieces: tuple[Piece, ...], record: bool = True) -> tuple[Piece, ...]:
        """``(fp8 weight, float32 scale)`` of each piece (a shared piece's scale is shared too); ``record``: count
        the fused expert tensors among them (once per output tensor)."""
        from ckpttool.ops.export.plan import Piece

        out: list[Piece] = []
        for p in pieces:
            out.append(dataclasses.replace(p, dtype=FP8_DTYPE))
            scale = scale_name(p.name, self.spec.scale_suffix)
            out.append(Piece(scale, self.spec.scale_shape(p.shape), "float32", shared=p.shared))
            if record and fused_experts(p.name, p.shape):
                self._experts[1].append(p.name)
                self._fused_rows[p.name] = p.shape[1]
        return tuple(out)

    def _keep(self, pieces: tuple[Piece, ...]) -> None:
        """Record the modules of pieces written unquantized (``modules_to_not_convert`` / ``ignore``)."""
        for p in pieces:
            if len(p.shape) == 2 and p.name.endswith(".weight"):
                self.kept.append(p.name.removesuffix(".weight"))
            elif fused_experts(p.name, p.shape):
                self.kept.append(p.name.rpartition(".")[0])  # the experts module transformers converts as a whole
                self._experts[0].append(p.name)

    def _check_skip_split(self, s: Selected, pieces: tuple[Piece, ...]) -> None:
        """Raises UsageError: a `quantize_skip` glob keeps some pieces of one source (an expert of a per-expert
        split, one of a fused QKV's projections) and would quantize the others: a source is quantized whole or
        not at all, so its other pieces were kept unquantized too, without a word (every expert of every layer
        for `quantize_skip` '*.experts.0.*')."""
        spec, dtype = self.spec, s.source.dtype
        if len(pieces) < 2 or not spec.skip:
            return
        by_glob = [
            p.name
            for p in pieces
            if spec.candidate(p.name, p.shape)
            and dtype in _QUANTIZABLE
            and 0 not in p.shape
            and not any(fnmatch.fnmatchcase(p.name, g) for g in DEFAULT_SKIP)
            and any(fnmatch.fnmatchcase(p.name, g) for g in spec.skip)
        ]
        others = [p.name for p in pieces if spec.quantizes(p.name, p.shape, dtype)]
        if not by_glob or not others:
            return
        module = by_glob[0].partition(".experts.")[0] + ".experts" if ".experts." in by_glob[0] else None
        raise UsageError(
            f"`quantize_skip` keeps {by_glob[0]} but not {others[0]}, written from the same checkpoint tensor "
            f"{s.model_key} (a tensor is quantized whole or not at all)",
            param="quantize_skip",
            hint=(
                "transformers and vLLM convert an experts module as a whole: skip all its experts or none "
                f"(e.g. `quantize_skip` '{module}.*')"
                if module is not None
                else f"skip all the tensors written from {s.model_key} or none"
            ),
        )

    def _check_fused(self, s: Selected, pieces: tuple[Piece, ...]) -> None:
        """Raises ExportError: fused expert tensors to quantize in a quant format with no fused layout."""
        fused = next((p.name for p in pieces if fused_experts(p.name, p.shape)), None)
        if fused is not None and self.spec.fmt != "fp8":
            # a model adapter's own fused experts (megatron's stacked experts) are fused unless `experts` per-expert
            per_expert = "" if s.hf is not None and s.hf.fused_experts else "`experts` per-expert (or "
            raise ExportError(
                f"{s.model_key}: fused expert tensor {fused} [E, out, in]: `quant_format` {self.spec.fmt} has no "
                "fused-expert layout its consumers load (it quantizes Linear modules; transformers and vLLM read "
                "its experts per expert)",
                fqn=s.model_key,
                param="quant_format",
                hint=f"export with {per_expert}`quant_format` fp8{')' if per_expert else ''}, or leave the experts "
                "unquantized with `quantize_skip` '*.experts.*'",
            )

    def _shared_piece(self, s: Selected, p: Piece, runs: tuple[Run, ...] | None, counted: list[str]) -> SourcePieces:
        """A fused piece written by several sources: quantized as one tensor after assembly, by its first source's
        task (the others' tasks write nothing: no runs, no bytes, nothing counted)."""
        key, st = s.source.key, self._shared.get(p.name)
        if st is None:
            segs = None
            if self.spec.quantizes(p.name, p.shape, s.source.dtype):
                self._check_fused(s, (p,))
                try:
                    segs = _segments((p,), runs, None, s.source.shape)[0]
                except ValueError:
                    segs = None
            st = self._shared[p.name] = _Shared(key, _lead_rows(p.shape), segs is not None)
            if segs is None:
                self._keep((p,))
        if not st.quantized:
            return (p,), runs, None, counted
        try:
            if s.source.dtype not in _QUANTIZABLE:
                raise ValueError(s.source.dtype)
            segs = _segments((p,), runs, None, s.source.shape)[0]
        except ValueError:
            raise ExportError(
                f"{s.model_key}: writes part of {p.name} ({s.source.dtype}, shape {list(s.source.shape)}), which "
                "its other sources quantize, but cannot be quantized with them",
                fqn=s.model_key,
                hint=f"leave {p.name} unquantized with `quantize_skip`",
            ) from None
        st.segments.extend((o, s0, n, len(st.keys)) for o, s0, n in segs)
        st.keys.append(key)
        pair = self._pairs((p,), record=key == st.owner)
        self.quantized[key] = QuantTask((), (key,))  # the owner's rows once every source is planned (:meth:`planned`)
        if key == st.owner:
            return pair, None, None, [q.name for q in pair]
        return pair, (), None, []  # no runs: the owner's task writes the piece and its scale

    def planned(self) -> dict[str, QuantTask]:
        """Source key -> its quantized pieces, once the plan is made: each fused piece written by several sources
        gets every source's rows (its owner's :class:`QuantTask`).

        Raises:
            UsageError: `quantize_skip` keeps some fused expert tensors of an experts module and quantizes others
                (transformers converts an experts module as a whole).
        """
        for name, st in self._shared.items():
            if st.quantized:
                try:
                    rows = _covering(st.segments, st.rows)
                except ValueError:
                    raise ExportError(f"{name}: its sources do not write every row once", fqn=name) from None
                self.quantized[st.owner] = QuantTask((rows,), tuple(st.keys))
        kept, quantized = ({n.rpartition(".")[0]: n for n in names} for names in self._experts)
        both = sorted(set(kept) & set(quantized))
        if both:
            raise UsageError(
                f"`quantize_skip` keeps {kept[both[0]]} but quantizes {quantized[both[0]]} of the same experts module",
                param="quantize_skip",
                hint="transformers converts an experts module as a whole: skip all its tensors or none "
                f"(e.g. `quantize_skip` '{both[0]}.*')",
            )
        self._check_gate_up_rows()
        return self.quantized

    def _check_gate_up_rows(self) -> None:
        """Raises UsageError: a fused ``gate_up_proj`` ``[E, 2I, H]`` quantized with ``2I <= B`` gets one scale row
        (``[E, 1, ceil(H/B)]``), but transformers' ``FP8Experts`` allocates at least two (``min_sf_out=2``: one per
        half, gate and up) and its loader does not fit the one into them: the folder loads nowhere as FP8 experts
        (vLLM and torch's reader take no fused experts; transformers without a GPU drops their scales)."""
        block = self.spec.block
        small = sorted(n for n, rows in self._fused_rows.items() if n.endswith("gate_up_proj") and rows <= block)
        if not small:
            return
        rows = self._fused_rows[small[0]]
        half = rows // 2
        fit = half & -half if half > 0 else 1  # the largest power of two dividing each half: blocks within one half
        raise UsageError(
            f"`quantize_block` {block}: fused {small[0]} has {rows} rows (gate and up, {half} each), all in one "
            f"block, so its scale would be [E, 1, ...], but transformers' FP8Experts holds [E, 2, ...] (a scale row "
            "per half) and does not load it",
            param="quantize_block",
            hint=f"quantize with `quantize_block` {fit} (blocks within each half)"
            + ("" if self._fused_only else ", or export `experts` per-expert (the default with `quantize`)"),
        )

    def warnings(self) -> list[str]:
        """Plan warnings: a `quantize_skip` glob that matches no output tensor (a typo, or a checkpoint key's
        spelling: it quantized what was meant to be kept), fused expert tensors quantized (the layout vLLM and
        torch's reader do not read), no weight quantized at all (the export holds no FP8 tensor)."""
        out = [
            f"`quantize_skip` {g!r} matches no output tensor, so it kept nothing unquantized (the globs match output "
            f"keys as written, e.g. {min(self._names, key=lambda n: ('.layers.' not in n, n))!r})"
            for g in self.spec.skip
            if self._names and not any(fnmatch.fnmatchcase(n, g) for n in self._names)
        ]
        if self._names and not self.quantized:
            out.append(
                f"`quantize` {self.spec.method}: none of the {len(self._names)} tensor(s) written is quantized "
                "(embeddings, norms, lm_head, router gates, 1-D and `quantize_skip` tensors stay unquantized): the "
                "export holds no FP8 weight, and its config.json no quantization_config"
            )
        if not self._experts[1]:
            return out
        remedy = (
            "export with `experts` per-expert for them, or leave them unquantized with `quantize_skip` '*.experts.*'"
            if self._fused_only
            else "export with `experts` per-expert (the default with `quantize`) for them"
        )
        return out + [
            f"{len(self._experts[1])} fused expert tensor(s) quantized as [E, out, in] FP8 with "
            "[E, ceil(out/B), ceil(in/B)] scales (transformers' FP8Experts layout, loaded on a GPU only); vLLM and "
            "torch's QuantizedHuggingFaceStorageReader refuse them and transformers without a GPU loads their FP8 values "
            f"without the scales (wrong weights): {remedy}"
        ]

    def edited_assets(self, model_config: dict[str, Any] | None) -> dict[str, bytes]:
        """The base format's edits, and ``config.json`` with the quant format's ``quantization_config``."""
        edited = dict(self.base.edited_assets(model_config))
        if model_config is not None and self.quantized:  # nothing quantized: no quantization_config to write
            doc = json.loads(edited["config.json"]) if "config.json" in edited else dict(model_config)
            kept = set(self.kept)
            names = self._names
            embedding = any(fnmatch.fnmatchcase(n, g) for n in names for g in _TIED_EMBEDDING_GLOBS)
            if embedding and not any(n.endswith("lm_head.weight") for n in names):
                # a tied lm_head (not written): transformers still builds it as a Linear, and would convert it to an
                # FP8 one (FP8Linear, compressed-tensors' `Linear` target) whose FP8 weight and scale the folder lacks
                kept.add("lm_head")
            doc["quantization_config"] = QUANT_FORMATS[self.spec.fmt].config(self.spec, sorted(kept))
            edited["config.json"] = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
        return edited


def recount_casts(plan: ExportPlan, save_dtype: str, quantized: dict[str, QuantTask] | None = None) -> None:
    """Count each quantized weight once as ``src->float8_e4m3fn`` in ``plan.casts`` / ``plan.narrowing``
    instead of twice (weight and scale) as ``src->save_dtype``; with ``quantized``, list no scale in
    ``plan.origins`` (the weights taken from the parameters or their masters: a scale is none of them)."""
    scales: set[str] = set()
    for t in plan.tasks:
        p = t.pieces
        if quantized is not None:
            if t.source_key not in quantized:
                continue
            n = quantized[t.source_key].weights  # 0: a later source of a fused piece (its owner counts it)
            scales.update(q.name for q in p if q.dtype != FP8_DTYPE)  # a quantized task: (FP8 weight, scale) pairs
        elif len(p) != 2 or p[0].dtype != FP8_DTYPE or p[1].dtype != "float32":
            continue
        else:
            n = 1
        if n == 0:
            continue
        src = t.selected.source.dtype
        if src != save_dtype:
            for d in (plan.casts, plan.narrowing):
                tag = f"{src}->{save_dtype}"
                if tag in d:
                    d[tag] -= 2 * n
                    if d[tag] <= 0:
                        del d[tag]
        for d in (plan.casts, plan.narrowing):
            d[f"{src}->{FP8_DTYPE}"] = d.get(f"{src}->{FP8_DTYPE}", 0) + n
    if scales:
        for origin, keys in plan.origins.items():
            plan.origins[origin] = [k for k in keys if k not in scales]


@dataclass(frozen=True)
class _Where:
    """A band, for error messages: ``expert`` (``"expert 3 "``, empty for a 2-D weight), its index within the
    matrix and its first row there."""

    expert: str
    band: int
    row: int


@dataclass
class _Stats:
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    blocks: int = 0
    zero_blocks: int = 0


#: Source bytes a work unit of :class:`BlockQuantizer` reads (a run of bands of one matrix; at least one band): one
#: read per stored chunk, one write of FP8 bytes and one of scales, one pool task per ~8 MiB.
UNIT_BYTES = 8 << 20

#: A stored record: ``(key, chunk offsets)``.
_Mark = tuple[str, tuple[int, ...]]


class _RecordCrcs:
    """The CRC-32 of the records a quantized export reads, computed from the bands' own reads (thread-safe).

    Work units read a record in pieces, out of order, on several threads: each piece's CRC-32 is kept
    by its offset in the record and, once the pieces tile the record, they are combined in record order
    (``crc32_combine``) and compared with the zip entry's (:meth:`ChunkLocation.check_crc`). A record
    read only in part is read whole and checked when its task's last unit is done; a unit whose band
    fails its checks has its records checked whole first (:meth:`verify`). Without ``crc32_combine``
    (no isal), or where the entry's CRC covers more than the values, a record is read whole once before
    its first rows are used. Nothing is checked when the reader's ``verify_crc`` is off.
    """

    def __init__(self, reader: CheckpointReader) -> None:
        from ckpttool.engine.crc import crc32_array, crc32_combine

        self.reader, self.on = reader, bool(reader.verify_crc)
        self._crc32, self._combine = crc32_array, crc32_combine
        self._lock = threading.Lock()
        self._pieces: dict[_Mark, dict[int, tuple[int, int]]] = {}  # record -> start -> (length, CRC-32)
        self._covered: dict[_Mark, int] = {}  # record -> bytes in its pieces
        self._done: set[_Mark] = set()  # records checked
        self._open: dict[str, dict[_Mark, Any]] = {}  # task key -> the records its units read (locations)
        self._left: dict[str, int] = {}  # task key -> its units not done

    @staticmethod
    def _mark(loc: Any) -> _Mark:
        return (loc.key, tuple(loc.chunk.offsets))

    def _by_pieces(self, loc: Any) -> bool:
        """Whether ``loc``'s CRC-32 can come from pieces of its values (the entry's CRC covers exactly them)."""
        return self._combine is not None and loc.record.member is not None and loc.record.compressed_size == loc.nbytes

    def expect(self, task: str, units: int) -> None:
        """Task ``task`` runs ``units`` work units (:meth:`unit_done` counts them down)."""
        self._left[task] = units

    def before_use(self, loc: Any) -> None:
        """Check ``loc`` whole now when its CRC-32 cannot come from pieces (once per record)."""
        if self.on and not self._by_pieces(loc):
            self._verify_whole(loc)

    def piece(self, loc: Any, start: int, data: Any) -> None:
        """Bytes ``data`` (a ``uint8`` array) read at ``start`` of ``loc``'s values; checks the record once its pieces
        tile it.

        Raises:
            ChecksumError: the record's CRC-32 does not match (E308).
        """
        if not self.on or not self._by_pieces(loc):
            return
        mark, n = self._mark(loc), len(data)
        crc = self._crc32(data, 0)
        with self._lock:
            if mark in self._done:
                return
            pieces = self._pieces.setdefault(mark, {})
            if start in pieces:  # a piece read again
                return
            pieces[start] = (n, crc)
            self._covered[mark] = covered = self._covered.get(mark, 0) + n
            if covered < loc.nbytes:
                return
            del self._pieces[mark], self._covered[mark]
        whole, at = 0, 0
        for s, (length, c) in sorted(pieces.items()):
            if s != at:  # overlapping pieces: read it whole instead
                self._verify_whole(loc)
                return
            whole, at = int(self._combine(whole, c, length)), at + length  # type: ignore[misc]
        if at != loc.nbytes:
            self._verify_whole(loc)
            return
        loc.check_crc(whole)
        with self._lock:
            self._done.add(mark)

    def verify(self, locs: list[Any]) -> None:
        """Check the records of ``locs`` not checked yet, each read whole (before a band's error is reported)."""
        if self.on:
            for loc in locs:
                self._verify_whole(loc)

    def unit_done(self, task: str, locs: list[Any]) -> None:
        """One unit of ``task`` done, having read ``locs``; after its last, the records it read in part are checked."""
        if not self.on:
            return
        with self._lock:
            opened = self._open.setdefault(task, {})
            for loc in locs:
                opened.setdefault(self._mark(loc), loc)
            self._left[task] -= 1
            if self._left[task] > 0:
                return
            del self._open[task], self._left[task]
        for loc in opened.values():
            self._verify_whole(loc)

    def _verify_whole(self, loc: Any) -> None:
        mark = self._mark(loc)
        with self._lock:
            if mark in self._done:
                return
        self.reader.verify_record(loc)
        with self._lock:
            self._done.add(mark)
            self._pieces.pop(mark, None)
            self._covered.pop(mark, None)


class BlockQuantizer:
    """Quantizes the planned FP8 tasks of an export, a run of bands of ``B`` output rows per call (thread-safe).

    Args:
        reader: the checkpoint reader.
        block: ``B``.
        tasks: source key -> its quantized pieces (:attr:`QuantizedFormat.quantized`).
        channel: one scale per output row (``fp8-channel``) instead of per ``B x B`` block.

    Attributes:
        merges: source key -> its LoRA merge (``W + s * B @ A``, added in FP32 to the rows before quantizing).
    """

    def __init__(
        self, reader: CheckpointReader, block: int, tasks: dict[str, QuantTask], channel: bool = False
    ) -> None:
        self.reader, self.block, self.tasks, self.channel = reader, block, tasks, channel
        self.merges: dict[str, Any] = {}
        # key -> (meta, checked chunks) of the sources a task reads besides its own (a fused piece's later sources)
        self.sources: dict[str, tuple[TensorMeta, list[ChunkMeta]]] = {}
        self.stats: dict[str, _Stats] = {}  # output weight name -> its figures
        self._units_of: dict[str, list[tuple[int, int, int]]] = {}  # source key -> its work units
        self._lock = threading.Lock()
        self._locs: dict[tuple[str, tuple[int, ...]], Any] = {}  # (key, chunk offsets) -> its checked location
        # output file (its writer's id) -> the lock its units' writes take: ext4 serialises buffered writes to a
        # file (i_rwsem) and a writer waiting for it spins in the kernel, ~16% of the export's CPU with two
        # workers (docs/performance.md); a thread waiting here sleeps
        self._write_locks: dict[int, threading.Lock] = {}
        self._crcs = _RecordCrcs(reader)
        from ckpttool.engine import fp8_native
        from ckpttool.engine.kernels import Scratch

        #: whether the bands run torch's kernels (no native kernel): one torch thread per engine worker
        self.uses_torch = not fp8_native.available()
        self._band_kernel: Callable[..., Any] = fp8_native.quantize_band
        self._bands_kernel: Callable[..., Any] = fp8_native.quantize_bands
        if self.uses_torch:
            # imported here, while the export holds the GC (planning): torch's import under a running
            # collector over the plan's objects costs several times its own time
            from ckpttool.engine import fp8

            self._band_kernel = fp8.quantize_band

        self._buffers = Scratch(min_items=1)  # per thread: the bands, their FP8 bytes and scales, the bytes read

    @property
    def count(self) -> int:
        """Quantized output weights (an expert split counts each expert)."""
        return sum(t.weights for t in self.tasks.values())

    @property
    def other_sources(self) -> set[str]:
        """Source keys read by another source's task (:attr:`sources` must hold their checked chunks)."""
        return {k for t in self.tasks.values() for k in t.sources[1:]}

    def _units(self, task: SourceTask) -> list[tuple[int, int, int]]:
        """``(piece, first band, end band)`` of each work unit of ``task`` (computed once per task): ``ceil(rows / B)``
        bands per matrix (per expert of fused experts ``[E, rows, cols]``), taken :data:`UNIT_BYTES` of source at a
        time (a unit never crosses experts)."""
        units = self._units_of.get(task.source_key)
        if units is None:
            from ckpttool.format.metadata import DTYPE_ITEMSIZE

            b, item = self.block, DTYPE_ITEMSIZE.get(task.selected.source.dtype, 4)
            units = []
            for k in range(self.tasks[task.source_key].weights):
                shape = task.pieces[2 * k].shape
                per, group = -(-shape[-2] // b), max(1, UNIT_BYTES // (b * shape[-1] * item))
                for e in range(_lead_rows(shape[:-1])):
                    units.extend((k, e * per + j, e * per + min(per, j + group)) for j in range(0, per, group))
            with self._lock:
                self._units_of[task.source_key] = units
                self._crcs.expect(task.source_key, len(units))
        return units

    def bands(self, task: SourceTask) -> int:
        """Work units of ``task``: runs of consecutive bands of one quantized matrix (``ceil(rows / B)`` bands each)."""
        return len(self._units(task))

    def band(
        self, task: SourceTask, meta: TensorMeta, chunks: list[ChunkMeta], writer: ShardWriter, index: int
    ) -> None:
        """Work unit ``index``: read its rows (one read per stored chunk they span), quantize and check them as bands of
        ``B`` output rows (one native call for the unit), then write the unit's FP8 bytes and its scales (one write each).

        The rows of a fused piece may come from several sources (``QuantTask.sources``). The CRC-32 of each
        record read is computed from these reads and checked once they cover it (:class:`_RecordCrcs`); a unit
        that fails its checks has its records checked whole first, so damaged bytes are reported as such.

        Raises:
            QuantizationError (E607): a block holding NaN / infinity, a zero or non-finite scale for a
                non-zero block, or an error above :data:`MAX_BLOCK_REL_ERROR` (the unit's first such band).
            ChecksumError (E308): a record read does not match its CRC-32 (unless ``verify_crc`` is off).
        """
        import numpy as np

        k, j0, j1 = self._units(task)[index]
        b, qt = self.block, self.tasks[task.source_key]
        weight, scales = task.pieces[2 * k], task.pieces[2 * k + 1]
        rows, cols = weight.shape[-2:]
        e, jj0 = divmod(j0, -(-rows // b))  # expert (0 for a 2-D weight), first band within it
        r0, r1 = e * rows + jj0 * b, e * rows + min(rows, (jj0 + j1 - j0) * b)
        merge = self.merges.get(task.source_key)
        metas = [(meta, chunks), *(self.sources[key] for key in qt.sources[1:])]
        # the stored values as they are (the kernel widens them exactly), float32 to add a LoRA delta to
        same = all(m.dtype == meta.dtype for m, _ in metas)
        held = (merge is None and same and _held(meta.dtype.name)) or np.float32
        touched: list[Any] = []  # the records read (checked whole before a band's error is reported)
        per = r1 - r0 if self.channel else (j1 - j0) * -(-cols // b)  # the unit's scales
        q = _page_matched(self._buffers, "q", (r1 - r0) * cols, writer.offset(weight.name) + r0 * cols)
        q2 = q.reshape(r1 - r0, cols)
        scale = self._buffers.get("scale", np.float32, per)
        unit = self._buffers.get(f"rows-{held.__name__}", held, (r1 - r0) * cols).reshape(r1 - r0, cols)
        try:
            for o0, s0, n, src in _source_ranges(qt.rows[k], r0, r1):
                self._read_rows(qt.sources[src], *metas[src], s0, s0 + n, unit[o0 - r0 : o0 - r0 + n], touched)
            if merge is not None:  # PEFT's (B @ A) * scaling, in FP32, before the one rounding (to FP8), band by band
                for a0, a1, _, _ in self._band_spans(r1 - r0, cols):
                    for o0, s0, n, _ in _source_ranges(qt.rows[k], r0 + a0, r0 + a1):
                        _merge_rows(task.source_key, merge, s0, unit[o0 - r0 : o0 - r0 + n])
            self._quantize(
                weight.name, f"expert {e} " if len(weight.shape) > 2 else "", jj0, unit, q2, scale, qt.sources
            )
            if merge is not None and not merge.changed:
                merge.changed = any(
                    self._merge_changed(task, meta, chunks, k, (r0 + a0, r0 + a1), q2[a0:a1], scale[c0:c1])
                    for a0, a1, c0, c1 in self._band_spans(r1 - r0, cols)
                )
        except ExportError:  # E607, or a LoRA merge that is not finite (E601)
            self._crcs.verify(touched)  # damaged bytes: their ChecksumError first
            raise
        at = r0 * 4 if self.channel else j0 * scales.shape[-1] * 4
        lock = self._write_locks.get(id(writer))
        if lock is None:
            with self._lock:
                lock = self._write_locks.setdefault(id(writer), threading.Lock())
        with lock:
            writer.write(weight.name, memoryview(q), r0 * cols)
            writer.write(scales.name, memoryview(scale.view(np.uint8)), at)
        self._crcs.unit_done(task.source_key, touched)

    def _band_spans(self, n: int, cols: int) -> list[tuple[int, int, int, int]]:
        """``(first row, end row, first scale, end scale)`` of each band of ``B`` rows of a unit of ``n`` rows."""
        b, ncb = self.block, -(-cols // self.block)
        return [
            (a0, min(n, a0 + b), *((a0, min(n, a0 + b)) if self.channel else (i * ncb, (i + 1) * ncb)))
            for i, a0 in enumerate(range(0, n, b))
        ]

    def _quantize(
        self,
        name: str,
        expert: str,
        band0: int,
        rows: np.ndarray,
        q: np.ndarray,
        scale: np.ndarray,
        sources: tuple[str, ...] = (),
    ) -> None:
        """Quantize and check a unit's bands of ``B`` rows (``expert``: ``"expert 3 "`` or empty; ``band0``: the index of
        its first band in the matrix) of output weight ``name`` into ``q`` (``uint8`` ``[rows, cols]``) and ``scale``
        (float32, one per block / row, band after band); record their figures. ``sources``: the checkpoint keys read;
        an error names those that are FP32 ``master_weight`` copies (the parameter itself may hold no such value).

        Raises:
            QuantizationError (E607): the first band, in order, with a bad scale or an error above the bound.
        """
        import numpy as np

        block, spans = None if self.channel else self.block, self._band_spans(*rows.shape)
        if self.uses_torch:  # one band at a time (its results are the kernel's scratch: copied out at once)
            amax, worst, rel = np.empty_like(scale), np.empty(len(spans)), np.empty(len(spans))
            for i, (a0, a1, c0, c1) in enumerate(spans):
                t = self._band_kernel(rows[a0:a1], block)
                np.copyto(q[a0:a1], t.q)
                np.copyto(scale[c0:c1], t.scale)
                np.copyto(amax[c0:c1], t.amax)
                worst[i], rel[i] = t.worst, t.rel
        else:
            r = self._bands_kernel(rows, block, self.block, q, scale)
            amax, worst, rel = r.amax, r.worst, r.rel
        if not (np.isfinite(scale).all() and ((scale > 0) | (amax == 0)).all() and (rel <= MAX_BLOCK_REL_ERROR).all()):
            masters = [k for k in sources if k.endswith(".master_weight")]
            label = f"{name} (read from {', '.join(map(repr, masters))})" if masters else name
            hint = _E607_HINT + _MASTER_HINT if masters else _E607_HINT
            for i, (a0, a1, c0, c1) in enumerate(spans):  # the first bad band, as one band at a time would find it
                where = _Where(expert, band0 + i, (band0 + i) * self.block)
                self._check_scales(label, where, scale[c0:c1], amax[c0:c1], name, hint)
                if not rel[i] <= MAX_BLOCK_REL_ERROR:
                    raise QuantizationError(
                        f"{label}: {expert}rows {where.row}..{where.row + a1 - a0 - 1} dequantize with a relative "
                        f"error of {float(rel[i]):.4g} (bound {MAX_BLOCK_REL_ERROR:.4g})",
                        fqn=name,
                        hint=hint if masters else None,
                    )
        zero = int(np.count_nonzero(amax == 0))
        with self._lock:
            st = self.stats.setdefault(name, _Stats())
            st.max_abs_error = max(st.max_abs_error, float(worst.max()))
            st.max_rel_error = max(st.max_rel_error, float(rel.max()))
            st.blocks += len(scale)
            st.zero_blocks += zero

    def _merge_changed(
        self,
        task: SourceTask,
        meta: TensorMeta,
        chunks: list[ChunkMeta],
        k: int,
        span: tuple[int, int],
        q: np.ndarray,
        scale: np.ndarray,
    ) -> bool:
        """Whether the merged band's FP8 bytes or scales differ from those of the base weight's rows."""
        import numpy as np

        from ckpttool.engine import kernels

        r0, r1 = span
        base = np.empty_like(q, dtype=np.float32)
        for o0, s0, n, _ in _source_ranges(self.tasks[task.source_key].rows[k], r0, r1):
            self._read_rows(task.source_key, meta, chunks, s0, s0 + n, base[o0 - r0 : o0 - r0 + n], None)
        if self.channel:
            q0, s0_, _ = kernels.fp8_channel_quantize(base)
        else:
            q0, s0_, _ = kernels.fp8_block_quantize(base, self.block)
        return not (np.array_equal(q0, q) and np.array_equal(s0_.view(np.uint32), scale.view(np.uint32)))

    def _check_scales(
        self, name: str, where: _Where, scale: np.ndarray, amax: np.ndarray, fqn: str = "", hint: str = _E607_HINT
    ) -> None:
        """Raises E607 for a non-finite scale or a zero one of a non-zero block (``where``: the band's expert, index
        and first row; a block band's scales run along the columns, a channel band's one per row; ``name``: the
        weight as the message names it, ``fqn``: its output key, ``name`` if empty)."""
        import numpy as np

        bad = np.flatnonzero(~np.isfinite(scale) | ((scale <= 0) & (amax != 0)))
        if bad.size:
            j = int(bad[0])
            why = "holds NaN or infinity" if not np.isfinite(amax[j]) else f"amax {float(amax[j]):.4g} gives scale 0"
            at = f"row {where.row + j}" if self.channel else f"block ({where.band}, {j})"
            raise QuantizationError(
                f"{name}: {where.expert}{at} {why}: no finite positive FP8 scale",
                fqn=fqn or name,
                hint=hint,
            )

    def _read_rows(
        self,
        key: str,
        meta: TensorMeta,
        chunks: list[ChunkMeta],
        s0: int,
        s1: int,
        dest: np.ndarray,
        touched: list[Any] | None,
    ) -> None:
        """Source rows ``[s0, s1)`` (over the leading dims: ``[prod(size[:-1]), size[-1]]``) as float32 into ``dest``
        (``[s1 - s0, cols]``), from every chunk holding part of them; ``touched`` (``None``: a second read, not
        counted towards the records' CRC-32) gets the records read."""
        size = meta.size
        lead = size[-2]
        r = s0
        while r < s1:
            outer, inner = divmod(r, lead)
            n = min(s1 - r, lead - inner)
            idx = tuple(unravel(outer, size[:-2]))
            for c in chunks:
                co, cs = c.offsets, c.sizes
                if any(not co[d] <= idx[d] < co[d] + cs[d] for d in range(len(idx))):
                    continue
                lo, hi = max(inner, co[-2]), min(inner + n, co[-2] + cs[-2])
                if lo >= hi:
                    continue
                local = 0
                for d in range(len(idx)):
                    local = local * cs[d] + (idx[d] - co[d])
                crow = local * cs[-2] + (lo - co[-2])
                at = r - s0 + lo - inner
                dest_c = dest[at : at + hi - lo, co[-1] : co[-1] + cs[-1]]
                self._read_chunk_rows(key, meta, c, crow, hi - lo, dest_c, touched)
            r += n

    def _read_chunk_rows(
        self, key: str, meta: TensorMeta, c: ChunkMeta, row: int, n: int, dest: np.ndarray, touched: list[Any] | None
    ) -> None:
        """``n`` rows of stored chunk ``c`` from its row ``row`` (over its leading dims) as float32 into ``dest``."""
        import numpy as np

        item = meta.dtype.itemsize
        width = c.sizes[-1]
        start, nbytes = row * width * item, n * width * item
        mark = (key, tuple(c.offsets))
        loc = self._locs.get(mark)
        if loc is None:
            loc = self._locs[mark] = self.reader.locate(key, c)  # checked once per chunk (a race locates twice)
        if loc.raw:
            assert loc.record is not None
            if touched is not None:
                touched.append(loc)
                self._crcs.before_use(loc)
            if dest.dtype == _held(meta.dtype.name) and dest.flags.c_contiguous:  # straight into the band
                buf = dest.reshape(-1).view(np.uint8)
                self.reader.pread_into(loc.info, loc.record.data_offset + start, buf, key)
            else:
                buf = self._buffers.get("raw", np.uint8, nbytes)
                self.reader.pread_into(loc.info, loc.record.data_offset + start, buf, key)
                _widen(buf, meta.dtype.name, dest, key)
            if touched is not None:
                self._crcs.piece(loc, start, buf)
            return
        from ckpttool.ops.export.transform import _decoded_chunk  # a chunk the locator cannot map: decoded (whole)

        _widen(_decoded_chunk(self.reader, key, c)[start : start + nbytes], meta.dtype.name, dest, key)

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


def _page_matched(scratch: Any, name: str, n: int, offset: int) -> Any:
    """``n`` bytes of ``scratch``'s buffer ``name`` starting at the same offset within a 4 KiB page as file offset
    ``offset``: the kernel's copy into (or out of) the page cache runs ~3x slower per byte when the destination lies
    a few bytes past the source modulo the page (``docs/performance.md``, "Quantized export")."""
    import numpy as np

    raw = scratch.get(name, np.uint8, n + _PAGE)
    at = (offset - raw.ctypes.data) % _PAGE
    return raw[at : at + n]


_PAGE = 4096


def _widen(raw: np.ndarray, dtype: str, dest: np.ndarray, key: str) -> None:
    """Raw ``uint8`` bytes of ``float32`` / ``bfloat16`` / ``float16`` / ``float64`` values into ``dest`` (``[n, width]``,
    rows may be strided): float32 exactly (bfloat16: its bits shifted into the upper half; float64 rounded to nearest),
    or the stored dtype (:func:`_held`).

    Raises:
        QuantizationError: a finite float64 value of ``key`` beyond float32's range (it would round to infinity and
            be told as "NaN or infinity" in the checkpoint, which holds none).
    """
    import numpy as np

    shape = dest.shape
    if dest.dtype != np.float32:  # a band held in the stored dtype (_held)
        np.copyto(dest, raw.view(dest.dtype).reshape(shape))
    elif dtype == "bfloat16":
        np.left_shift(raw.view(np.uint16).reshape(shape), 16, out=dest.view(np.uint32), dtype=np.uint32)
    elif dtype == "float32":
        np.copyto(dest, raw.view(np.float32).reshape(shape))
    elif dtype == "float64":
        src = raw.view(np.float64).reshape(shape)
        with np.errstate(over="ignore"):
            np.copyto(dest, src)
        over = np.isinf(dest) & np.isfinite(src)
        if over.any():
            v = float(src[over][0])
            raise QuantizationError(
                f"{key}: float64 value {v:.4g} is beyond float32's range (3.4e38), which FP8 quantization rounds "
                "through: no finite FP8 scale",
                fqn=key,
                hint="check the tensor with `ckpttool stats` (neither FP8, bfloat16 nor float32 holds such a value; "
                "an export without --quantize and with --save-dtype preserve keeps it in float64)",
            )
    else:
        np.copyto(dest, raw.view(np.float16).reshape(shape))


def _merge_rows(key: str, merge: Any, s0: int, rows: np.ndarray) -> None:
    """``rows`` (float32, source rows ``s0..`` of ``key``) += ``s * B @ A`` of their rows (a :class:`LoraMerge`'s
    factors), in place.

    Raises:
        ExportError (E601): a merged value not finite where the stored one is (an infinite or NaN factor, a huge
            ``lora_alpha``), as the unquantized merge refuses it (not told as the checkpoint's NaN).
    """
    import numpy as np

    from ckpttool.ops.export.merge import nonfinite_merge

    with np.errstate(over="ignore", invalid="ignore"):
        merged = rows + (merge.b[s0 : s0 + rows.shape[0]] @ merge.a) * np.float32(merge.scale)
    bad = np.flatnonzero(~np.isfinite(merged) & np.isfinite(rows))
    if bad.size:
        r, c = divmod(int(bad[0]), rows.shape[1])
        v, w = float(merged.flat[bad[0]]), float(rows.flat[bad[0]])
        raise nonfinite_merge(
            key, f" at [{s0 + r}, {c}]", v, w, "to quantize", f"{bad.size} such value(s) in these rows", merge.scale
        )
    rows[...] = merged


def _held(dtype: str) -> Any:
    """The numpy dtype a band holds source ``dtype`` in, unwidened (bfloat16 as its ``uint16`` bits); ``None``: float32."""
    import numpy as np

    return {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}.get(dtype)


def _source_ranges(segments: tuple[Segment, ...], r0: int, r1: int) -> list[Segment]:
    """``(first output row, first source row, rows, source)`` of output rows ``[r0, r1)`` from a piece's segments."""
    out: list[Segment] = []
    for o, src, n, key in segments:
        lo, hi = max(o, r0), min(o + n, r1)
        if lo < hi:
            out.append((lo, src + lo - o, hi - lo, key))
    return out
