"""Export planning: which checkpoint tensors become which output tensors, in which dtype and file.

Pure functions over the :class:`~ckpttool.model.catalog.Catalog` (metadata only; no tensor
data is read here). The executor (:mod:`ckpttool.ops.export.execute`) reads each
:class:`SourceTask`'s chunks once and writes its :class:`Piece` s.

Shapes: a fused expert tensor ``w_EAB`` ``[E, A, B]`` split into ``n`` parts gives
``E * n`` pieces ``[A / n, B]``: piece ``(j, p)`` is ``w_EAB[order[j], p*A/n:(p+1)*A/n, :]``
where ``order[j]`` is the stored position of true expert ``j`` (identity except for
legacy EP layouts, ``docs/layouts.md``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from ckpttool.errors import ExportError, StateDtypeError, UsageError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, FLOATING_DTYPES, TRAINABLE_DTYPES
from ckpttool.format.safetensors import HeaderEntry, is_narrowing
from ckpttool.model.adapters import AdapterConfig, HFTensor, ModelAdapter, rope_to_hf_rows
from ckpttool.model.catalog import Catalog, TensorEntry, dtype_refuted_by, match_filter
from ckpttool.ops.export.rules import ExpertRule, ExportRules
from ckpttool.ops.export.transform import Run

if TYPE_CHECKING:
    from ckpttool.ops.export.outputs import OutputFormat, PieceContext, SourcePieces

__all__ = [
    "SAVE_DTYPES",
    "Origin",
    "Selected",
    "Piece",
    "SourceTask",
    "ExportPlan",
    "SelectResult",
    "select_sources",
    "build_plan",
    "check_expert_dim",
    "per_expert_pieces",
    "split_adapter_experts",
    "require_model_tensors",
    "check_quantized_sources",
    "check_trainable_dtypes",
    "filtered",
    "stored_pieces",
    "saved_names",
    "shard_file_names",
    "check_exportable_names",
    "unaccounted_tensors",
    "SKIP_TRAINING_STATE",
    "SKIP_OUTSIDE_SCHEMA",
    "SKIP_EXTRA_STATE",
    "SKIP_FILTERED",
]

SAVE_DTYPES = ("preserve", "bfloat16", "float16", "float32")
#: What an exported tensor was read from: the parameter, or its FP32 ``master_weight``.
Origin = Literal["params", "master"]


def shard_file_names(n: int, stem: str = "model") -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000K-of-0000N.safetensors`` (HF naming)."""
    if n == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


@dataclass(frozen=True)
class LoraPair:
    """The LoRA factors merged into a base weight (``hf-merged``): ``W + (alpha / r) * B @ A``.

    Attributes:
        a_key, b_key: checkpoint keys of ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``.
        module: the module path (``model.layers.0.self_attn.q_proj``), for ``rank_pattern`` / ``alpha_pattern``.
        adapter: the PEFT adapter name (``default``).
    """

    a_key: str
    b_key: str
    module: str
    adapter: str


#: The per-tensor plan classes (``Selected``, ``Piece``, ``SourceTask``) are slots dataclasses,
#: not frozen: 10^6 tensors build 3 x 10^6 of them, and a frozen one is several times slower to build
#: (one ``object.__setattr__`` call per field). Treat them as values all the same: nothing
#: assigns their fields after construction; ``unsafe_hash`` keeps them hashable by value.
@dataclass(slots=True, unsafe_hash=True)
class Selected:
    """A model tensor chosen for export.

    Attributes:
        model_key: the checkpoint key of the model tensor it stands for.
        out_key: its output key (before any expert split).
        source: the tensor entry read (the parameter, or its ``master_weight``).
        origin: ``"params"`` or ``"master"``.
        hf: where a model adapter puts it (``None``: the key rules' output key, as stored).
        merge: the LoRA factors merged into it (``hf-merged``; ``None``: no merge).
    """

    model_key: str
    out_key: str
    source: TensorEntry
    origin: Origin
    hf: HFTensor | None = None
    merge: LoraPair | None = None


@dataclass(slots=True, unsafe_hash=True)
class Piece:
    """One output tensor cut from a source: expert ``expert`` (true order), part ``part`` of ``nparts``.

    ``shared``: several sources write disjoint parts of it (an adapter's fused ``gate_up_proj``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    expert: int | None = None
    part: int = 0
    nparts: int = 1
    shared: bool = False


@dataclass(slots=True, unsafe_hash=True)
class SourceTask:
    """Read one source tensor (each chunk once) and write its pieces into shard ``shard``.

    Attributes:
        expert_order: stored position of true expert ``j`` along dim 0, when that
            is not the identity or when the tensor is split per expert.
        runs: an adapter's element moves (RoPE rows, fused halves, expert split), explicit;
            ``None``: derived from the pieces and ``expert_order``.
    """

    selected: Selected
    pieces: tuple[Piece, ...]
    shard: int
    expert_order: tuple[int, ...] | None = None
    runs: tuple[Run, ...] | None = None

    @property
    def source_key(self) -> str:
        return self.selected.source.key

    @property
    def direct(self) -> bool:
        """One piece equal to the stored tensor: chunks are read straight into the output file."""
        p = self.pieces[0]
        return (
            len(self.pieces) == 1
            and p.expert is None
            and self.expert_order is None
            and self.runs is None
            and self.selected.merge is None
            and p.dtype == self.selected.source.dtype
        )

    @property
    def out_nbytes(self) -> int:
        if self.runs is not None:
            return sum(r.length for r in self.runs) * DTYPE_ITEMSIZE[self.pieces[0].dtype]
        if len(self.pieces) == 1:
            return _nbytes(self.pieces[0].dtype, self.pieces[0].shape)
        return sum(_nbytes(p.dtype, p.shape) for p in self.pieces)


@dataclass
class ExportPlan:
    """Everything the executor needs, plus what the summary reports.

    Attributes:
        tasks: in write order.
        files: output file names; ``entries[k]`` are the tensors of ``files[k]``.
        warnings: one line each (keys renamed by a ``warn`` rule, skipped keys, ...).
        casts: ``"src->dst"`` -> number of tensors cast; ``narrowing``: the subset that loses precision or range.
        origins: ``"params"``/``"master"`` -> output keys taken from there.
        skipped: reason -> checkpoint keys not exported.
        tied: ``None`` (untied / no config), ``"omitted"`` or ``"absent"`` (see docs/export.md).
        model_names: output name -> the model's own key, for the names a per-expert export takes from the
            family's ``save_pretrained`` (Mixtral's ``block_sparse_moe.gate.weight`` -> ``mlp.gate.weight``).
    """

    format: str
    tasks: list[SourceTask]
    files: list[str]
    entries: list[list[HeaderEntry]]
    warnings: list[str] = field(default_factory=list)
    casts: dict[str, int] = field(default_factory=dict)
    narrowing: dict[str, int] = field(default_factory=dict)
    origins: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    tied: str | None = None
    model_names: dict[str, str] = field(default_factory=dict)
    _file_bytes: tuple[tuple[int, int], list[int]] | None = field(default=None, repr=False, compare=False)

    def file_bytes(self) -> list[int]:
        """Bytes of each file's tensors (``files[k]``: the ``out_nbytes`` of its tasks), a new list.

        :func:`build_plan` records them as it packs; computed from the tasks again when ``tasks``
        was replaced or resized since.
        """
        sig = (id(self.tasks), len(self.tasks))
        if self._file_bytes is not None and self._file_bytes[0] == sig:
            return list(self._file_bytes[1])
        out = [0] * len(self.files)
        for t in self.tasks:
            out[t.shard] += t.out_nbytes
        self._file_bytes = (sig, out)
        return list(out)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes())

    @property
    def num_tensors(self) -> int:
        return sum(len(e) for e in self.entries)

    def weight_map(self) -> dict[str, str]:
        """Output key -> file name, sorted by key (``model.safetensors.index.json``)."""
        # output keys are unique across the files (build_plan refuses a key produced twice): sorted by key alone
        pairs = [(e.name, name) for name, ents in zip(self.files, self.entries) for e in ents]
        pairs.sort()
        return dict(pairs)


#: ``(selected, warnings, skipped, tags)`` of a selection (``tags``: LoRA output key -> adapter name).
SelectResult = tuple[list[Selected], list[str], dict[str, list[str]], dict[str, str]]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def filtered(key: str, canonical: str, out_key: str, glob: str | None, prefix: str | None) -> bool:
    """Whether ``filter_glob`` ``glob`` leaves the tensor out: it matches none of its checkpoint ``key`` (with or
    without the schema's model ``prefix``), its ``canonical`` ``model.<fqn>`` key (with or without ``model.``)
    and its output name ``out_key`` (``False`` without a glob)."""
    if not glob:
        return False
    return not (match_filter(key, glob, prefix) or match_filter(canonical, glob) or fnmatch.fnmatchcase(out_key, glob))


#: ``skipped`` reasons of tensors that are not model weights (``docs/export.md``).
SKIP_TRAINING_STATE = "training state (scheduler, data loader, step), not weights"
SKIP_OUTSIDE_SCHEMA = "outside the key schema (not model weights)"
#: the reason of the keys ``filter_glob`` left out
SKIP_FILTERED = "excluded by `filter_glob`"
#: a module's ``get_extra_state()`` saved as a tensor under the model's own prefix (Transformer Engine >= 2.0 keeps
#: its FP8 scaling state as a pickled ``uint8`` tensor ``<module>._extra_state``): no weight of any HF model class
SKIP_EXTRA_STATE = "a module's extra state (`_extra_state`: Transformer Engine's FP8 scaling state), not weights"


def check_exportable_names(cat: Catalog, fmt: str, adapter: ModelAdapter | None = None) -> None:
    """Refuse model names that output format ``fmt`` has no names for (:meth:`OutputFormat.check_names`).

    Raises:
        ExportNamingError (E603): torchtitan names with no model adapter for them (``hf``), or under ``lora``.
        ExportError (E601): no model tensor at all (nothing recognised, or an optimizer-only checkpoint).
    """
    from ckpttool.ops.export.outputs import get_format

    get_format(fmt).check_names(cat, adapter)


def require_model_tensors(cat: Catalog) -> None:
    """Raises ExportError (E601): the catalog has no model tensor (nothing recognised, or optimizer state only)."""
    if not cat.model:
        from ckpttool.model.beside import model_folder_hint

        why = "; ".join(cat.schema.reasons[:2])
        raise ExportError(
            f"{cat.path}: no model tensors to export ({why})",
            hint=model_folder_hint(
                cat.path,
                "pass the model checkpoint (or the folder holding model and optimizer); `ckpttool inspect` "
                "shows the keys, `model_prefix` says where the weights are",
            ),
        )


def check_trainable_dtypes(root: str, cat: Catalog, selected: list[Selected]) -> None:
    """Refuse a parameter to export whose stored dtype its optimizer state refutes.

    A parameter an optimizer steps has a floating (or complex) dtype, as its moments of its shape do; one
    stored as an integer or bool beside floating moments has a misrecorded dtype (a safetensors header
    edited from ``F32`` to ``I32``, same byte size, where the header is the only record of the dtype, as in
    NeMo Automodel's and torch's ``HuggingFaceStorageWriter`` model files). ``validate`` reports it as
    ``O005``; written as stored, the output would hold the float bits as integers.

    Raises:
        StateDtypeError (E511): the first such parameter, naming its data file, key and the state field.
    """
    if not cat.optimizer_state or all(s.source.dtype in TRAINABLE_DTYPES for s in selected):
        return
    states: dict[str, Mapping[str, TensorEntry | None]] = {}
    for fqn, ps in cat.optimizer_state.items():
        if ps.in_model and ps.fields:
            for key in ps.stored_as or (cat.model_key(fqn),):
                states[key] = ps.fields
    for s in selected:
        src = s.source
        refuted = dtype_refuted_by(src, states.get(src.key, {}))
        if refuted is None:
            continue
        moment = refuted[1]
        where = f"{root}/{src.files[0]}" if src.files else root
        raise StateDtypeError(
            f"{where}: {src.key!r} is stored as {src.dtype}, but its optimizer state {moment.key!r} is "
            f"{moment.dtype} of the same shape: an optimizer steps floating-point parameters only, so the "
            f"stored dtype is wrong (a damaged header?); nothing was exported",
            hint="the data file's dtype record was changed after the save; use an intact copy or an earlier "
            "checkpoint (`ckpttool validate --strict` reports it as O005)",
            path=where,
            fqn=src.key,
        )


#: The scale beside a quantized weight ``x`` (block FP8 ``x_scale_inv``, compressed-tensors ``x_scale``) and
#: MXFP4's ``x_blocks`` / ``x_scales`` (:mod:`ckpttool.model.quantized`).
_SCALE_SUFFIXES = ("_scale_inv", "_scale")


def check_quantized_sources(
    root: str,
    selected: list[Selected],
    save_dtype: str,
    quantize: str | None,
    experts: str = "fused",
    stored: Mapping[str, object] | None = None,
) -> None:
    """Refuse a cast (``save_dtype`` other than ``preserve``) or a ``quantize`` of weights already stored quantized,
    a per-expert split (``experts`` ``per-expert``) of fused FP8 experts stored beside their ``[E, ...]`` scales,
    and a ``float8`` weight exported without the scale ``stored`` (the model keys) holds for it (left out by
    ``filter_glob`` or a key rule: FP8 codes no reader can scale).

    A ``float8`` weight beside its scale (``x.weight_scale_inv``, ``x.weight_scale``) holds codes, not values:
    cast on their own they become the codes times 1 (hundreds of times the weights) and the scales stray
    tensors; MXFP4 ``x_blocks`` / ``x_scales`` would pass through a ``quantize`` untouched. ``preserve``
    copies them as stored (a valid quantized folder); ``ckpttool import`` dequantizes them.

    Raises:
        ExportError (E601): the first such weight and its scale; nothing is written.
    """
    cast = save_dtype != "preserve" or quantize is not None
    fp8 = [s for s in selected if s.source.dtype.startswith("float8")]  # (10^6 plain tensors: no set built)
    chosen = {s.model_key for s in selected} if fp8 else set()
    held = stored if stored is not None else {}
    for s in fp8:
        left = [s.model_key + x for x in _SCALE_SUFFIXES if s.model_key + x in held and s.model_key + x not in chosen]
        if left:
            raise ExportError(
                f"{root}: {s.out_key!r} is stored quantized ({s.source.dtype}) but its scale {left[0]!r} is not "
                "exported (`filter_glob` or a key rule left it out): the FP8 codes alone are not the weights; "
                "nothing was exported",
                hint=f"select the scales too (a `filter_glob` that also matches {left[0]!r}), or dequantize the "
                "folder with `ckpttool import` and export that",
                fqn=s.model_key,
            )
    if not cast and experts != "per-expert":
        return
    keys = {s.out_key for s in selected}
    for s in selected:
        scale = None
        if s.source.dtype.startswith("float8"):
            scale = next((s.out_key + x for x in _SCALE_SUFFIXES if s.out_key + x in keys), None)
        elif s.out_key.endswith("_blocks") and s.out_key[: -len("_blocks")] + "_scales" in keys:
            scale = s.out_key[: -len("_blocks")] + "_scales"
        if scale is None or not (cast or len(s.source.shape) == 3):
            continue
        if quantize is not None:
            what = f"`quantize` {quantize} would treat the stored codes as the weights' values"
        elif cast:
            what = f"`save_dtype` {save_dtype} would treat the stored codes as the weights' values"
        else:
            what = "`experts` per-expert would split the codes per expert and leave the scale fused (no scale each)"
        raise ExportError(
            f"{root}: {s.out_key!r} is stored quantized ({s.source.dtype} beside its scale {scale!r}): {what}; "
            "nothing was exported",
            hint="export it without `quantize`, with `save_dtype` preserve and `experts` fused, the defaults (copied "
            "as stored), or dequantize it with `ckpttool import` (--dtype bfloat16|float32) and export that",
            fqn=s.model_key,
        )


def select_sources(
    cat: Catalog,
    rules: ExportRules,
    *,
    fmt: str = "hf",
    weights: str = "params",
    filter_glob: str | None = None,
    adapter: ModelAdapter | None = None,
    adapter_config: AdapterConfig | None = None,
    peft_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
) -> SelectResult:
    """Choose the tensors to export and their output keys (output format ``fmt``'s :meth:`OutputFormat.select`).

    Args:
        cat: the catalog.
        rules: key rules (``hf``) / LoRA pattern (``lora``).
        fmt: a registered output format name (``"hf"``, ``"lora"``, ``"hf-merged"``).
        weights: ``"params"`` or ``"master"`` (the FP32 ``master_weight`` where a
            parameter has one, like DeepSpeed's ``zero_to_fp32``).
        filter_glob: only checkpoint keys (with or without ``model.``) or output keys matching it.
        adapter: a model adapter mapping the fqns to HF names and layouts (``hf`` format; the key
            rules are then not used); keys it does not know are skipped and reported.
        adapter_config: the model dimensions the adapter needs (RoPE heads).
        peft_config: a given PEFT adapter config (``lora``: its ``bias`` selects the biases PEFT saves).
        model_config: the model's ``config.json``: keys its model class (built by transformers on the meta
            device) holds are its own names, not reported as outside the HF naming.

    Returns:
        ``(selected, warnings, skipped, adapter_names)``; ``adapter_names`` maps
        LoRA output keys to their adapter name (``lora`` only).

    Raises:
        ExportError: ``--weights master`` with no master weight in the checkpoint,
            a master whose shape differs from its parameter, or two keys mapping
            to one output key.
    """
    from ckpttool.ops.export.outputs import SelectRequest, get_format

    out_format = get_format(fmt)
    out_format.check_names(cat, adapter)
    return out_format.select(
        SelectRequest(cat, rules, weights, filter_glob, adapter, adapter_config, peft_config, model_config)
    )


def build_plan(
    selected: list[Selected],
    rules: ExportRules,
    *,
    fmt: str = "hf",
    save_dtype: str = "preserve",
    shard_size: int = 5 * 10**9,
    experts: str = "fused",
    expert_orders: dict[str, tuple[int, ...]] | None = None,
    num_experts: int | None = None,
    drop: set[str] | None = None,
    out_format: OutputFormat | None = None,
    stored: Mapping[str, TensorEntry] | None = None,
) -> ExportPlan:
    """Turn the selection into tasks, pieces and output files.

    Args:
        selected: from :func:`select_sources`.
        rules: for the expert split rules.
        fmt: the name of a registered output format: its :meth:`OutputFormat.pieces_planner` gives each
            source's output tensors, :meth:`~OutputFormat.starts_file` / :meth:`~OutputFormat.file_names` the
            files (``hf``: sharded ``model*.safetensors``; ``lora``: ``adapter_model.safetensors``).
        save_dtype: ``preserve`` or a floating dtype applied to floating tensors only.
        shard_size: maximum bytes per output file (a larger single source gets a file of its own).
        experts: ``"fused"`` or ``"per-expert"``.
        expert_orders: model key -> stored position of each true expert (legacy EP un-permutation).
        num_experts: expected expert count (``--model-assets`` config), checked against dim 0.
        drop: output keys to leave out (a tied ``lm_head.weight``).
        out_format: the output format object to plan with (a wrapped one, e.g. a quantized export); ``None``: ``fmt``'s.
        stored: the checkpoint's tensors by key: where a fused expert tensor's partner is not selected (``--filter``).

    Raises:
        UsageError: unknown ``save_dtype`` / ``experts``.
        ExportError: a fused expert tensor whose dims do not fit the split or the expert count.
    """
    from ckpttool.ops.export.outputs import PieceContext, get_format

    if save_dtype not in SAVE_DTYPES:
        raise UsageError(f"`save_dtype` {save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}", param="save_dtype")
    if experts not in ("fused", "per-expert"):
        raise UsageError(f"`experts` {experts!r} is not one of fused, per-expert", param="experts")
    out_format = out_format or get_format(fmt)
    source_pieces = out_format.pieces_planner()
    _refuse_transposed_experts(selected, stored or {}, experts)
    ctx = PieceContext(rules, experts == "per-expert", expert_orders or {}, num_experts)
    drop = drop or set()
    casts: dict[str, int] = {}
    narrowing: dict[str, int] = {}
    origins: dict[str, list[str]] = {}
    # Greedy packing in source order; a source's pieces stay in one file (read once). Packing raises
    # nothing, so it runs in this loop (the errors below come in the same order as without it).
    packer = _Packer(out_format.starts_file, shard_size)
    place = packer.place
    tasks: list[SourceTask] = []
    add_task = tasks.append
    preserve = save_dtype == "preserve"
    for s in selected:
        if drop and s.out_key in drop:
            continue
        src_dtype = s.source.dtype
        dtype = src_dtype if preserve or src_dtype not in FLOATING_DTYPES else save_dtype
        pieces, runs, order, counted = source_pieces(s, dtype, ctx)
        if dtype != src_dtype:
            _count_cast(casts, narrowing, f"{src_dtype}->{dtype}", is_narrowing(src_dtype, dtype), len(counted))
        listed = origins.get(s.origin)
        if listed is None:
            listed = origins[s.origin] = []
        if len(counted) == 1:
            listed.append(counted[0])
        else:
            listed.extend(counted)
        add_task(SourceTask(s, pieces, place(pieces, runs), order, runs))
    files = out_format.file_names(max(len(packer.sizes), 1))
    # the output names, after every check of the loop above (their errors come after those, as they always did)
    entries = _header_entries(tasks, len(files))
    plan = ExportPlan(
        fmt, tasks, files, entries, casts=casts, narrowing=narrowing, origins=origins, model_names=ctx.model_names
    )
    plan._file_bytes = ((id(tasks), len(tasks)), packer.file_bytes or [0] * len(files))
    return plan


def saved_names(got: SourcePieces, ctx: PieceContext) -> SourcePieces:
    """``got`` with every piece named as the family's ``save_pretrained`` names it (a per-expert export,
    ``ctx.rules.saved_name``: Mixtral's ``block_sparse_moe``); each name it changes is recorded in
    ``ctx.model_names`` (new -> the model's own)."""
    saved_name = ctx.rules.saved_name
    if not ctx.per_expert or saved_name is None:
        return got
    pieces, runs, order, counted = got
    out = []
    for p in pieces:
        name = saved_name(p.name)
        if name != p.name:
            ctx.model_names[name] = p.name
            p = replace(p, name=name)
        out.append(p)
    return tuple(out), runs, order, [saved_name(n) for n in counted]


def _count_cast(casts: dict[str, int], narrowing: dict[str, int], tag: str, narrows: bool, n: int) -> None:
    """Count ``n`` output tensors cast as ``tag`` (``"src->dst"``), in ``narrowing`` too when it ``narrows``."""
    casts[tag] = casts.get(tag, 0) + n
    if narrows:
        narrowing[tag] = narrowing.get(tag, 0) + n


class _Packer:
    """Greedy packing of sources into files: ``starts_file(packed, nbytes, shard_size)`` opens the next one.

    ``sizes``: packed bytes of each file; ``file_bytes``: the bytes its tasks write (a fused
    piece's halves each count); a shared (fused) piece's sources all go to its first file.
    """

    def __init__(self, starts_file: Callable[[int, int, int], bool], shard_size: int) -> None:
        self.starts_file = starts_file
        self.shard_size = shard_size
        self.sizes: list[int] = []
        self.file_bytes: list[int] = []
        self.shared_at: dict[str, int] = {}

    def place(self, pieces: tuple[Piece, ...], runs: tuple[Run, ...] | None) -> int:
        """The file index of a source writing ``pieces`` (through ``runs``)."""
        first = pieces[0]
        sizes = self.sizes
        if runs is None and len(pieces) == 1 and not first.shared and sizes:  # one plain piece (10^6 tensors)
            nbytes = _nbytes(first.dtype, first.shape)
            if self.starts_file(sizes[-1], nbytes, self.shard_size):
                sizes.append(0)
                self.file_bytes.append(0)
            sizes[-1] += nbytes
            self.file_bytes[-1] += nbytes
            return len(sizes) - 1
        nbytes = (
            _nbytes(first.dtype, first.shape) if len(pieces) == 1 else sum(_nbytes(p.dtype, p.shape) for p in pieces)
        )
        sizes = self.sizes
        if first.shared and first.name in self.shared_at:
            k = self.shared_at[first.name]
        else:
            if not sizes or self.starts_file(sizes[-1], nbytes, self.shard_size):
                sizes.append(0)
                self.file_bytes.append(0)
            sizes[-1] += nbytes
            k = len(sizes) - 1
            if first.shared:
                self.shared_at[first.name] = k
        # what the task writes (SourceTask.out_nbytes): its runs' elements, else its pieces
        self.file_bytes[k] += nbytes if runs is None else sum(r.length for r in runs) * DTYPE_ITEMSIZE[first.dtype]
        return k


def _header_entries(tasks: list[SourceTask], n_files: int) -> list[list[HeaderEntry]]:
    """Each file's header entries in task order (a shared piece once).

    Raises:
        ExportError: an output key produced twice, or not UTF-8 text.
    """
    plain = _plain_entries(tasks, n_files)
    if plain is not None:
        return plain
    entries: list[list[HeaderEntry]] = [[] for _ in range(n_files)]
    names_seen: set[str] = set()
    for t in tasks:
        pieces = t.pieces
        shard_entries = entries[t.shard]
        if len(pieces) == 1 and not pieces[0].shared:  # the loop below for one plain piece
            p = pieces[0]
            name = p.name
            if name in names_seen or not name.isascii():
                _check_name(t.selected, name, names_seen)  # raises, unless a non-ASCII name that is UTF-8 text
            names_seen.add(name)
            shard_entries.append(HeaderEntry(name, p.dtype, p.shape))
            continue
        for p in pieces:
            name = p.name
            if p.shared and name in names_seen:
                continue
            _check_name(t.selected, name, names_seen)
            names_seen.add(name)
            shard_entries.append(HeaderEntry(name, p.dtype, p.shape))
    return entries


def _plain_entries(tasks: list[SourceTask], n_files: int) -> list[list[HeaderEntry]] | None:
    """:func:`_header_entries` of tasks of one plain piece each, with ASCII names written once, as
    comprehensions (10^6 tensors); ``None`` for anything else (the loop of ``_header_entries`` names the error)."""
    pieces = [t.pieces for t in tasks]
    if any(len(ps) != 1 or ps[0].shared for ps in pieces):
        return None
    names = [ps[0].name for ps in pieces]
    if not "".join(names).isascii() or len(set(names)) != len(names):
        return None
    if n_files == 1:
        return [[HeaderEntry(ps[0].name, ps[0].dtype, ps[0].shape) for ps in pieces]]
    entries: list[list[HeaderEntry]] = [[] for _ in range(n_files)]
    for t, ps in zip(tasks, pieces):
        entries[t.shard].append(HeaderEntry(ps[0].name, ps[0].dtype, ps[0].shape))
    return entries


def check_expert_dim(s: Selected, e: int, num_experts: int | None) -> None:
    """Raises ExportError: dim 0 of expert tensor ``s`` (``e``) differs from the config's ``num_experts``."""
    if num_experts is not None and e != num_experts:
        raise ExportError(
            f"{s.model_key}: expert dim 0 has {e} experts but the model config says num_experts={num_experts}",
            fqn=s.model_key,
            hint="pass the `model_assets` of the model this checkpoint was trained as",
        )


def _transposed_pair(gate_up: Sequence[int], down: Sequence[int]) -> bool:
    """Whether fused ``gate_up_proj`` / ``down_proj`` shapes are 3-D and not ``[E, 2I, H]`` / ``[E, H, I]``."""
    return len(gate_up) == 3 and len(down) == 3 and (gate_up[1] != 2 * down[2] or gate_up[2] != down[1])


def _partner_shape(s: Selected, shapes: Mapping[str, Any], stored: Mapping[str, TensorEntry], partner: str) -> Any:
    """The shape of the other half (``partner``: ``gate_up_proj`` or ``down_proj``) of the fused expert pair of ``s``:
    the selected tensor's, else the stored one's by its checkpoint key (a ``--filter`` selecting one half), else
    ``None``."""
    own = "down_proj" if partner == "gate_up_proj" else "gate_up_proj"
    shape = shapes.get(s.out_key.removesuffix(own) + partner)
    entry = stored.get(s.model_key.removesuffix(own) + partner) if s.model_key.endswith(f".{own}") else None
    return entry.shape if shape is None and entry is not None else shape


def transposed_expert_keys(selected: list[Selected], stored: Mapping[str, TensorEntry]) -> set[str]:
    """The output keys of the selected fused ``gate_up_proj`` / ``down_proj`` tensors of pairs stored transposed
    (gpt-oss, Llama4: ``[E, H, 2I]`` / ``[E, I, H]``), which a per-expert split refuses; a half not selected is looked
    up in ``stored``. A model adapter's tensors are not."""
    shapes = {s.out_key: s.source.shape for s in selected if s.hf is None}
    out: set[str] = set()
    for s in selected:
        if s.hf is not None:
            continue
        if s.out_key.endswith(".gate_up_proj"):
            down = _partner_shape(s, shapes, stored, "down_proj")
            pair = None if down is None else (s.source.shape, down)
        elif s.out_key.endswith(".down_proj"):
            gate_up = _partner_shape(s, shapes, stored, "gate_up_proj")
            pair = None if gate_up is None else (gate_up, s.source.shape)
        else:
            continue
        if pair is not None and _transposed_pair(*pair):
            out.add(s.out_key)
    return out


def _refuse_transposed_experts(selected: list[Selected], stored: Mapping[str, TensorEntry], experts: str) -> None:
    """Raise where a fused ``<prefix>.gate_up_proj`` and its ``<prefix>.down_proj`` are not ``[E, 2I, H]`` and
    ``[E, H, I]``, the layout a per-expert split cuts: experts stored transposed (``gate_up_proj`` ``[E, H, 2I]``,
    ``down_proj`` ``[E, I, H]``; gate and up columns interleaved in gpt-oss, concatenated in Llama4), which the
    split would cut into wrong ``gate_proj``/``up_proj`` halves and transposed ``down_proj`` weights. The half not
    selected (a ``--filter`` selecting one) is looked up in ``stored`` by its checkpoint key. Nothing to check
    unless ``experts`` is ``per-expert``.

    Raises:
        ExportError: such a pair.
    """
    if experts != "per-expert":
        return
    shapes = {s.out_key: s.source.shape for s in selected if s.hf is None}
    for s in selected:
        if s.hf is not None:
            continue  # a model adapter's tensors: its own map cuts them (torchtitan's w1/w3 halves)
        if s.out_key.endswith(".gate_up_proj"):
            gate_up, down = s.source.shape, _partner_shape(s, shapes, stored, "down_proj")
        elif s.out_key.endswith(".down_proj") and s.out_key.removesuffix("down_proj") + "gate_up_proj" not in shapes:
            gate_up, down = _partner_shape(s, shapes, stored, "gate_up_proj"), s.source.shape  # selected alone
        else:
            continue
        if gate_up is not None and down is not None and _transposed_pair(gate_up, down):
            beside = f"{list(gate_up)} beside down_proj {list(down)}"
            if s.out_key.endswith(".down_proj"):
                beside = f"{list(down)} beside gate_up_proj {list(gate_up)}"
            raise ExportError(
                f"{s.model_key}: {beside} is not the [E, 2I, H] / [E, H, I] "
                "layout a per-expert split cuts (experts stored transposed, [E, H, 2I] / [E, I, H]: gate and up "
                "interleaved in gpt-oss, concatenated in Llama4)",
                fqn=s.model_key,
                hint="export with `experts` fused (the experts written as stored, the names the model class loads)",
            )


def per_expert_pieces(s: Selected, rule: ExpertRule, dtype: str) -> tuple[Piece, ...]:
    """``E * n`` pieces ``[A / n, B]`` of a fused expert tensor ``[E, A, B]`` split by ``rule`` into ``n`` parts.

    Raises:
        ExportError: not ``[E, A, B]``, 0 experts, or ``n`` does not divide ``A``.
    """
    shape = s.source.shape
    if len(shape) != 3:
        raise ExportError(
            f"{s.model_key}: matches the fused expert rule but has shape {list(shape)}, not [E, A, B]",
            fqn=s.model_key,
            hint="fix the experts rules (`rules`) or export with `experts` fused",
        )
    e, a, b = shape
    if e == 0:
        raise ExportError(
            f"{s.model_key}: has shape {list(shape)}: 0 experts, nothing to write per expert",
            fqn=s.model_key,
            hint="export with `experts` fused (writes the empty tensor), or leave it out with `filter_glob`",
        )
    n = len(rule.parts)
    if a % n:
        raise ExportError(
            f"{s.model_key}: dim 1 ({a}) cannot be split into {n} equal parts {list(rule.parts)}",
            fqn=s.model_key,
            hint="the tensor is not a fused gate/up projection; fix the experts rules",
        )
    names = rule.split_names(s.out_key, e)
    assert names is not None
    return tuple(Piece(names[j][p], (a // n, b), dtype, j, p, n) for j in range(e) for p in range(n))


def _check_name(s: Selected, name: str, names_seen: set[str]) -> None:
    """Raise for an output key that is not UTF-8 text or is produced twice (the checks of :func:`build_plan`)."""
    try:
        if not name.isascii():
            name.encode("utf-8")
    except UnicodeEncodeError:
        raise ExportError(
            f"{s.model_key!a}: output key {name!a} is not valid UTF-8 text (safetensors stores names as UTF-8 JSON)",
            fqn=s.model_key,
            hint="leave it out with `filter_glob` or rename it with a `rules` entry",
        ) from None
    if name in names_seen:
        raise ExportError(
            f"{s.model_key}: output key {name!r} is produced twice",
            fqn=s.model_key,
            hint="fix the key/experts rules (`rules`) so every output key is unique",
        )


def stored_pieces(s: Selected, dtype: str, ctx: PieceContext, rule: ExpertRule | None) -> SourcePieces:
    """The pieces of a source named by the key rules: as stored, or split per expert by ``rule``.

    A fused expert tensor ``[E, A, B]`` split into ``n`` parts gives ``E * n`` pieces ``[A / n, B]``.

    Raises:
        ExportError: an expert dim that disagrees with ``num_experts``, a split rule matching a
            tensor that is not ``[E, A, B]``, 0 experts, or a dim 1 that ``n`` does not divide.
    """
    shape = s.source.shape
    order = ctx.orders.get(s.model_key) if ctx.orders else None
    if rule is None and order is None:  # the common case: one piece as stored
        return (Piece(s.out_key, shape, dtype),), None, None, [s.out_key]
    if rule is not None and len(shape) == 3:
        check_expert_dim(s, shape[0], ctx.num_experts)
        assert order is None or len(order) == shape[0], "expert_orders gives one entry per expert"
    pieces: tuple[Piece, ...]
    if ctx.per_expert and rule is not None:
        pieces = per_expert_pieces(s, rule, dtype)
        if order is None:
            order = tuple(range(shape[0]))
    else:
        pieces = (Piece(s.out_key, shape, dtype),)
    if order is not None and not ctx.per_expert and order == tuple(range(len(order))):
        order = None
    return pieces, None, order, [p.name for p in pieces] if len(pieces) > 1 else [pieces[0].name]


def adapter_pieces(
    s: Selected,
    hf: HFTensor,
    dtype: str,
    experts: str,
    order: tuple[int, ...] | None,
    num_experts: int | None,
    rules: ExportRules | None = None,
) -> tuple[tuple[Piece, ...], tuple[Run, ...] | None]:
    """The output pieces and element runs of a source mapped by a model adapter.

    - RoPE q/k ``[n*hd, dim]``: one piece, one run per row (:func:`~ckpttool.model.adapters.rope_to_hf_rows`).
    - a fused half (``nparts`` 2) of ``[E, A, B]``: expert ``j``'s ``A*B`` elements go to
      ``[j, part*A:(part+1)*A, :]`` of the shared ``[E, 2A, B]`` piece, or (per-expert) to a piece ``[A, B]`` of its own.
    - an expert tensor ``[E, A, B]`` kept fused: as stored; per-expert: ``E`` pieces ``[A, B]``.
    - an adapter's explicit fused expert pieces (megatron's stacked experts), per-expert: split by the expert rule
      of ``rules`` that names them (:func:`split_adapter_experts`).
    - anything else: one piece as stored (``runs`` ``None``: a direct copy when the dtype is kept).

    Raises:
        ExportError: an expert dim that disagrees with the config's ``num_experts``; adapter expert pieces that no
            expert rule splits.
    """
    shape = s.source.shape
    if hf.pieces:  # an adapter's explicit element map (one source -> several HF tensors)
        pieces = tuple(Piece(k, sh, dtype, shared=hf.shared) for k, sh in hf.pieces)
        runs = tuple(Run(*r) for r in hf.runs)
        if hf.fused_experts and experts == "per-expert":
            return split_adapter_experts(s, pieces, runs, rules)
        return pieces, runs
    if hf.rope_heads is not None:
        rows, cols = shape
        dst = rope_to_hf_rows(hf.rope_heads, rows // hf.rope_heads)
        return (Piece(hf.key, hf.shape, dtype),), tuple(Run(r * cols, cols, 0, d * cols) for r, d in enumerate(dst))
    is_expert = hf.nparts > 1 or hf.per_expert is not None
    if not is_expert:
        return (Piece(hf.key, hf.shape, dtype),), None
    e, a, b = shape
    check_expert_dim(s, e, num_experts)
    stored = order if order is not None else tuple(range(e))
    slab = a * b
    if experts == "per-expert" and hf.per_expert is not None:
        pieces = tuple(Piece(hf.per_expert.format(j=j), (a, b), dtype, j) for j in range(e))
        return pieces, tuple(Run(stored[j] * slab, slab, j, 0) for j in range(e))
    if hf.nparts > 1:
        piece = Piece(hf.key, hf.shape, dtype, shared=True)
        return (piece,), tuple(Run(stored[j] * slab, slab, 0, (j * hf.nparts + hf.part) * slab) for j in range(e))
    if order is None:
        return (Piece(hf.key, hf.shape, dtype),), None
    return (Piece(hf.key, hf.shape, dtype),), tuple(Run(stored[j] * slab, slab, 0, j * slab) for j in range(e))


def split_adapter_experts(
    s: Selected, pieces: tuple[Piece, ...], runs: tuple[Run, ...], rules: ExportRules | None
) -> tuple[tuple[Piece, ...], tuple[Run, ...]]:
    """An adapter's fused expert pieces ``[E, A, B]`` (megatron's ``experts.gate_up_proj`` / ``down_proj`` of each
    layer) as the per-expert pieces ``[A / n, B]`` the expert rule naming each gives (``experts.{j}.gate_proj.weight``
    ...): every run cut where it crosses an expert's part; pieces no run writes (an expert saved as its own key
    writes one) are left out.

    Raises:
        ExportError (E601): a piece no expert rule of ``rules`` splits, or whose dim 1 its parts do not divide.
    """
    split: list[tuple[int, int, int]] = []  # per fused piece: first new piece, part size (elements), parts per expert
    out: list[Piece] = []
    for p in pieces:
        rule = rules.expert_rule(p.name) if rules is not None and len(p.shape) == 3 else None
        n = len(rule.parts) if rule is not None else 0
        if rule is None or p.shape[1] % n:
            raise ExportError(
                f"{s.model_key}: {p.name} {list(p.shape)} matches no per-expert split of the experts rules",
                fqn=s.model_key,
                hint="export with `experts` fused",
            )
        e, a, b = p.shape
        names = rule.split_names(p.name, e)
        assert names is not None
        split.append((len(out), a // n * b, n))
        out += [Piece(names[j][q], (a // n, b), p.dtype, j, q, n) for j in range(e) for q in range(n)]
    cut: list[Run] = []
    for r in runs:
        first, part, _ = split[r.piece]
        src, dst, left = r.src, r.dst, r.length
        while left:
            k, off = divmod(dst, part)
            n = min(left, part - off)
            cut.append(Run(src, n, first + k, off))
            src, dst, left = src + n, dst + n, left - n
    used = sorted({r.piece for r in cut})
    index = {old: new for new, old in enumerate(used)}
    return tuple(out[i] for i in used), tuple(Run(r.src, r.length, index[r.piece], r.dst) for r in cut)


def unaccounted_tensors(cat: Catalog, plan: ExportPlan, dropped: set[str]) -> list[str]:
    """Non-optimizer tensors that the plan neither writes nor lists in ``skipped`` (should be none).

    Args:
        cat: the catalog.
        plan: the built plan (``skipped`` filled).
        dropped: checkpoint keys left out on purpose and reported elsewhere (a tied ``lm_head``).
    """
    written = {t.selected.model_key for t in plan.tasks}
    keys = (*cat.model, *cat.other_tensors)
    left = set(keys).difference(written, *plan.skipped.values(), dropped)  # set operations, no Python loop per key
    return [k for k in keys if k in left] if left else []
