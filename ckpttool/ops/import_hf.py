"""``import_hf``: an HF safetensors model (sharded + index) -> a DCP checkpoint a trainer ``dcp.load`` s.

Target key schemas: ``torch-native`` (``model.<hf key>``), torchtitan (through the model
adapter's :meth:`~ckpttool.model.adapters.ModelAdapter.from_hf`) or megatron-core ``torch_dist``
(:mod:`ckpttool.ops.import_megatron`: stacked layers, fused ``linear_qkv`` / ``linear_fc1``). Every tensor is described
row by row as byte runs of the safetensors files; a chunk is the ``torch.chunk`` row range of a
rank (DTensor/FSDP2 ``Shard(0)``), written as a ``torch.save`` archive streamed from those runs
(:meth:`~ckpttool.format.writer.DCPWriter.stream_tensor_archive`; nothing of tensor size in
memory), one ``__{rank}_0.distcp`` per rank, atomically. A tied ``lm_head.weight`` absent from
the files is written from the embedding. ``docs/import.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import (
    CkptError,
    ExportError,
    MetadataError,
    ModelMismatchError,
    UsageError,
    at_least,
    check_path,
    shell_arg,
    short_key,
)
from ckpttool.format.atomic import absolute_path
from ckpttool.format.files import hub_hint, hub_unfinished_download, missing_path_hint, open_regular, resolve_inside
from ckpttool.format.hf_storage import (
    ADAPTER_PREFIX,
    hf_storage_files,
    load_hf_storage_metadata,
    mistral_consolidated,
)
from ckpttool.format.jsonview import JsonView, json_counted
from ckpttool.format.marker import MARKER_NAME
from ckpttool.format.metadata import ChunkMeta, DType, TensorMeta
from ckpttool.format.outputs import check_target, output_location
from ckpttool.format.storage import is_url
from ckpttool.format.writer import DCPWriter
from ckpttool.model.adapters import (
    ADAPTERS,
    AdapterConfig,
    ModelAdapter,
    NativeTensor,
    Skip,
    get_adapter,
    import_adapters,
    rope_from_hf_rows,
)
from ckpttool.model.beside import hf_config_beside, is_training_state_file
from ckpttool.model.catalog import refuse_long_numbers
from ckpttool.model.discovery import find_checkpoints, step_of
from ckpttool.model.hf_forms import FORMS, ExpertForm, forms_for, model_key
from ckpttool.model.hfconfig import (
    config_value,
    read_hf_config,
    tie_word_embeddings,
    tied_embedding_key,
    untied_embedding_key,
)
from ckpttool.model.schemas import registry
from ckpttool.model.schemas.base import SchemaSpec, canonical_model_key
from ckpttool.ops import distributed
from ckpttool.ops.fields import OutputOptions, PhaseFn, ProgressFn, check_output_ranks, options_of

if TYPE_CHECKING:
    from ckpttool.layouts.record import EPTensorSpec
    from ckpttool.ops.export.expected import ModelCheck

# The EP pieces (expert-name pattern, layout record, nested intervals) are imported where EP sizes are
# given: a dense import's start-up does not pay for the reshard planner and the layout declarations.

__all__ = ["ImportOptions", "ImportResult", "ep_dim1_chunks", "ep_rows", "import_hf", "torch_chunk_rows"]

SCHEMAS = tuple(s.name for s in registry.import_targets())


@dataclass(frozen=True)
class ImportOptions(OutputOptions):
    """Options of :func:`import_hf` (the flags of ``ckpttool import``): those of every writing operation
    (:class:`~ckpttool.ops.fields.OutputOptions`: ``overwrite``, ``manifest``, ``algorithm``, ``dry_run``) and
    its own. Here the manifest digests every record as it is written, with the source directory's identity
    (its headers' and manifest's digests); a dry run checks the sources, the index, the adapter and the EP
    placement, and its file ``bytes`` are the tensor data planned for each rank file.

    Attributes:
        schema: ``torch-native``, ``torchtitan`` or ``megatron``.
        adapter: the model adapter for ``torchtitan`` (``None``: from the config's ``model_type``);
            ``megatron`` uses ``megatron-gpt``.
        config: ``config.json`` (default: the one in the HF directory).
        world_size: ranks to pre-shard for (one data file per rank; chunks along dim 0 as ``Shard(0)``).
        ep_size, ep_fsdp_size: pre-shard MoE expert tensors for an EP x EP-FSDP mesh (``P`` x ``F``
            ranks, canonical order, a layout record); ``None``: no EP. ``world_size`` is then ``P * F``.
        fsync: ``fsync`` the data files and ``.metadata`` before the output is moved into place
            (survives a power loss; its cost: docs/performance.md).
        dtype: what quantized weights (block FP8, MXFP4) are dequantized to: ``bfloat16`` (``None``)
            or ``float32`` (:mod:`ckpttool.ops.import_quant`).
        allow_mismatch: kinds of difference from the model class built from the config (``missing``,
            ``shape``) imported anyway, as warnings (:func:`check_against_model`).
    """

    schema: str = SCHEMAS[0]
    adapter: str | None = None
    config: Path | None = None
    world_size: int = field(default=1, metadata=at_least(1))
    ep_size: int | None = field(default=None, metadata=at_least(1))
    ep_fsdp_size: int | None = field(default=None, metadata=at_least(1))
    fsync: bool = True
    dtype: str | None = None
    allow_mismatch: tuple[str, ...] = ()


#: The ``--json`` document of :class:`ImportResult`: its keys in order (``key_schema``: the ``schema`` field).
_IMPORT_VIEW = JsonView(
    "ckpttool.import/1",
    "source output key_schema adapter world_size ep_size ep_fsdp_size ep_tensors tensors bytes seconds:4 gb_per_s:4"
    " files skipped warnings source_identity manifest dry_run dequantized model_check",
)


@dataclass(frozen=True)
class ImportResult:
    """What an import wrote (``--json``: :meth:`to_dict`, schema ``ckpttool.import/1``)."""

    source: str
    output: str
    schema: str
    adapter: str | None
    world_size: int
    tensors: int
    bytes: int
    seconds: float
    files: list[dict[str, Any]]
    skipped: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    ep_size: int | None = None
    ep_fsdp_size: int | None = None
    ep_tensors: int = 0
    source_identity: dict[str, Any] | None = None
    manifest: str | None = None
    dry_run: bool = False
    dequantized: dict[str, Any] | None = None
    model_check: dict[str, Any] | None = None

    @property
    def gb_per_s(self) -> float:
        """Bytes written per second (``seconds``), in GB/s (10^9); 0 when no time was measured."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return _IMPORT_VIEW.render(self, key_schema=self.schema, skipped=json_counted(self.skipped))


def torch_chunk_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's dim-0 rows as ``torch.chunk`` cuts them (DTensor ``Shard(0)``).

    ``ceil(rows / world_size)`` rows per rank; the last non-empty rank holds the rest and the ranks after
    it hold none (``torch.distributed.tensor._ops.utils`` / ``Shard._split_tensor``).
    """
    size = -(-rows // world_size) if rows else 0
    out = []
    for r in range(world_size):
        start = min(r * size, rows)
        out.append((start, max(0, min(size, rows - start))))
    return out


@dataclass
class _Source:
    """A stored HF tensor: file, absolute byte offset of its data, dtype, shape."""

    key: str
    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class _Native:
    """One output tensor and where the bytes of each of its dim-0 rows are: ``(file, byte offset, bytes)`` runs."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    rows: list[list[tuple[str, int, int]]]
    planner: tuple[str, ...]
    flat: tuple[str, int] | None = None  # a tensor stored as is: (file, offset); ``rows`` unused


def _row_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DType(dtype).itemsize * math.prod(shape[1:])


def _plain(key: str, src: _Source, shape: tuple[int, ...], planner: tuple[str, ...]) -> _Native:
    """A native tensor that is the HF tensor as stored (one byte run)."""
    return _Native(key, src.dtype, shape, [], planner, flat=(src.file, src.offset))


def _expert_count(what: str, fqn: str, found: dict[int, Any], num_experts: Any) -> int:
    """The expert count of per-expert tensors ``found`` (expert number -> tensor): they must be ``0..E-1``.

    ``E`` is the config's ``num_experts`` when it gives one, else one more than the highest number
    found. Checked by count, lowest and highest number (the numbers are distinct): nothing is
    allocated by an expert number or a config value (``num_experts: 10**11``, an expert numbered
    99999999999).

    Raises:
        ExportError: the numbers are not ``0..E-1``, or ``num_experts`` is not a positive int.
    """
    if num_experts is not None and (type(num_experts) is not int or num_experts < 0):
        raise ExportError(
            f"config num_experts is {str(num_experts)[:40]!r}, not an integer >= 0",
            fqn=fqn,
            hint="fix config.json (num_experts / num_local_experts / n_routed_experts)",
        )
    n = num_experts or (max(found) + 1 if found else 0)
    if len(found) != n or (found and (min(found) != 0 or max(found) != n - 1)):
        shown = sorted(found)[:8] if len(found) <= 1 << 16 else f"{len(found):,} numbers"
        raise ExportError(
            f"{what}: per-expert tensors for experts {shown} but the model has {n:,}",
            fqn=fqn,
            hint="the HF checkpoint is incomplete, or its config's num_experts does not match",
        )
    return n


def _expert_matrix(what: str, fqn: str, src: _Source) -> tuple[int, int]:
    """``(rows, cols)`` of a per-expert weight, which is 2-D.

    Raises:
        ExportError: another rank.
    """
    if len(src.shape) != 2:
        raise ExportError(
            f"{what}: per-expert weight {src.key!r:.80} has shape {list(src.shape)}, not a 2-D matrix",
            fqn=fqn,
            hint="the HF checkpoint is damaged or of another architecture",
        )
    return src.shape[0], src.shape[1]


def _refuse_unmapped_forms(sources: dict[str, _Source], model_type: str | None, forms: list[ExpertForm]) -> None:
    """Per-expert keys of a registered checkpoint form that does not apply to this ``model_type`` are refused:
    written as stored, they would be keys the model's ``state_dict()`` does not have.

    Raises:
        ExportError (E601): naming the first such key.
    """
    expert_keys = [k for k in sources if ".experts." in k]  # every form's pattern has it: one substring test per key
    for form in FORMS.values():
        if form in forms:
            continue
        hits = [k for k in expert_keys if form.pattern.match(k) and not any(f.pattern.match(k) for f in forms)]
        if not hits:
            continue
        k = min(hits)  # the first in name order (sorted only on the way to an error: 10^6 keys otherwise)
        kinds = ", ".join(form.model_types or ())
        said = f"the config's model_type is {model_type!r}" if model_type else "no config.json gives its model_type"
        raise ExportError(
            f"{k}: a per-expert key of the {form.name} checkpoint form ({kinds}), but {said}: import cannot map it "
            "to the model's fused expert tensors",
            fqn=k,
            hint="pass the model's own config.json (`config`); the import knows the per-expert forms of "
            + ", ".join(f"{f.name} ({', '.join(f.model_types or ('any',))})" for f in FORMS.values()),
        )


def _fuse_per_expert(sources: dict[str, _Source], out: dict[str, _Native], acfg: AdapterConfig) -> set[str]:
    """HF per-expert keys -> the model's fused ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj``.

    Through the registered checkpoint forms that apply to the config's ``model_type``
    (:mod:`ckpttool.model.hf_forms`: Qwen-style ``experts.<j>.gate_proj``, Mixtral's ``block_sparse_moe.experts.<j>.w1``),
    the fused key renamed as the form says. Returns the source keys consumed.

    Raises:
        ExportError: experts that do not cover ``0..E-1``, parts of different shapes, per-expert keys of a form
            that does not apply to the model type.
    """
    forms = forms_for(acfg.model_type)
    _refuse_unmapped_forms(sources, acfg.model_type, forms)
    used: set[str] = set()
    expert_keys = [k for k in sources if ".experts." in k]  # every form's pattern has it
    for form in forms:
        groups: dict[str, dict[str, dict[int, _Source]]] = {}
        for k in expert_keys:
            src = sources[k]
            m = form.pattern.match(k)
            if m and k not in used:
                groups.setdefault(m["p"], {}).setdefault(m["proj"], {})[int(m["j"])] = src
        for prefix, projs in groups.items():
            for fused, parts in form.fused():
                got = [projs.get(p, {}) for p in parts]
                if not any(got):
                    continue  # none of this fused tensor's parts (only down_proj experts): nothing to fuse
                # every fused tensor of the module has the same experts: one lost down_proj is not a smaller model
                n = acfg.num_experts or max(max(g) for g in projs.values() if g) + 1
                for p, g in zip(parts, got):
                    _expert_count(f"{prefix}.experts.*.{p}.weight", f"{prefix}.experts.0.{p}.weight", g, n)
                first = got[0][0]
                _check_parts_alike(f"{prefix}.experts.{fused}", first, got)
                a, b = _expert_matrix(prefix, f"{prefix}.experts.0.{parts[0]}.weight", first)
                nb = DType(first.dtype).itemsize * a * b
                rows = [[(g[j].file, g[j].offset, nb) for g in got] for j in range(n)]
                name = form.rename(f"{prefix}.experts.{fused}")
                key = canonical_model_key(name)
                out[key] = _Native(key, first.dtype, (n, a * len(parts), b), rows, ("model", name))
                used.update(s.key for g in got for s in g.values())
    return used


def _check_parts_alike(fused: str, first: _Source, got: list[dict[int, _Source]]) -> None:
    """The per-expert parts of one fused tensor (``got``: each part's experts) share ``first``'s dtype and shape.

    Raises:
        ExportError (E601): naming the first part (by expert, then part) that differs, and ``first``.
    """
    parts = [s for j in sorted(got[0]) for g in got if (s := g.get(j)) is not None]
    odd = [s for s in parts if (s.shape, s.dtype) != (first.shape, first.dtype)]
    if odd:
        more = f" (+{len(odd) - 1} more)" if len(odd) > 1 else ""
        raise ExportError(
            f"{odd[0].key}: {odd[0].dtype} {list(odd[0].shape)}{more}, but {first.key} is {first.dtype} "
            f"{list(first.shape)}: the per-expert tensors are fused into one {fused} of one dtype and shape",
            fqn=odd[0].key,
            hint="every expert's tensors must share one dtype and shape: load the model with transformers and save "
            "it again with save_pretrained (one dtype), or check that the folder holds one model's experts",
        )


def _generic_expert_names(sources: dict[str, _Source], acfg: AdapterConfig) -> dict[str, _Source]:
    """``sources`` with the keys of a family's own per-expert form (Mixtral's ``block_sparse_moe.experts.<j>.w1``)
    under the generic form's names (``mlp.experts.<j>.gate_proj``) and the form's renames applied to the rest:
    the names the megatron import reads. Keys of a form that does not apply to the model type are refused.

    Raises:
        ExportError (E601): as :func:`_refuse_unmapped_forms`; two stored keys of one name.
    """
    forms = forms_for(acfg.model_type)
    _refuse_unmapped_forms(sources, acfg.model_type, forms)
    generic = next(f for f in FORMS.values() if f.model_types is None)
    out: dict[str, _Source] = {}
    for k, src in sources.items():
        name = k
        for form in forms:
            m = form.pattern.match(name) if form is not generic else None
            if m is not None:
                as_generic = dict(zip((form.gate, form.up, form.down), (generic.gate, generic.up, generic.down)))
                name = form.rename(f"{m['p']}.experts.{m['j']}.{as_generic[m['proj']]}.weight")
            else:
                name = form.rename(name)
        if name in out:
            raise ExportError(
                f"{k}: stored beside another tensor named {name!r}",
                fqn=k,
                hint="the folder mixes two naming forms of one model; re-save it with save_pretrained",
            )
        out[name] = replace(src, key=name)
    return out


def _model_name(key: str, acfg: AdapterConfig) -> str:
    """The model's own name of a stored HF key: the renames of the checkpoint forms of its ``model_type``."""
    for form in forms_for(acfg.model_type):
        key = form.rename(key)
    return key


def _native_tensors(
    sources: dict[str, _Source], opts: ImportOptions, adapter: ModelAdapter | None, acfg: AdapterConfig
) -> tuple[list[_Native], dict[str, list[str]]]:
    skipped: dict[str, list[str]] = {}
    out: dict[str, _Native] = {}
    stacked: dict[str, dict[int, _Source]] = {}
    fused = _fuse_per_expert(sources, out, acfg) if adapter is None else set()
    for key in sorted(sources, key=lambda k: (sources[k].file, sources[k].offset)):
        src = sources[key]
        if key in fused:
            continue
        if adapter is None:
            name = _model_name(key, acfg)
            nk = canonical_model_key(name)
            if nk in out:  # two stored keys of one model key (a legacy name beside its renamed one)
                raise _two_tensors_of_one_key(key, name)
            out[nk] = _plain(nk, src, src.shape, ("model", name))
            continue
        targets = adapter.from_hf(key, src.shape, acfg)
        if isinstance(targets, Skip):
            skipped.setdefault(targets.reason, []).append(key)
            continue
        if targets is None:
            raise ExportError(
                f"{key}: not a key of the {adapter.name} adapter (shape {list(src.shape)})",
                fqn=key,
                hint="import with `schema` torch-native (HF names), or choose the right `adapter`",
            )
        for t in targets:
            _add_target(out, stacked, src, t)
    for nk, parts in stacked.items():
        n = _expert_count(nk, nk, parts, acfg.num_experts)
        first = parts[0]
        _check_parts_alike(nk, first, [parts])
        nb = DType(first.dtype).itemsize * math.prod(first.shape)
        rows = [[(parts[j].file, parts[j].offset, nb)] for j in range(n)]
        out[nk] = _Native(nk, first.dtype, (n, *first.shape), rows, (nk,))
    return list(out.values()), skipped


def _add_target(out: dict[str, _Native], stacked: dict[str, dict[int, _Source]], src: _Source, t: NativeTensor) -> None:
    if t.expert is not None:
        stacked.setdefault(t.key, {})[t.expert] = src
        return
    if t.rope_heads is not None:
        dst = rope_from_hf_rows(t.rope_heads, src.shape[0] // t.rope_heads)  # HF row -> native row
        rb = _row_bytes(src.dtype, src.shape)
        rows: list[list[tuple[str, int, int]]] = [[] for _ in range(src.shape[0])]
        for hf_row, native_row in enumerate(dst):
            rows[native_row] = [(src.file, src.offset + hf_row * rb, rb)]
        out[t.key] = _Native(t.key, src.dtype, t.shape, rows, (t.key,))
        return
    if t.nparts > 1:
        e, a, b = t.shape
        item = DType(src.dtype).itemsize
        rows = [[(src.file, src.offset + ((j * t.nparts + t.part) * a * b) * item, a * b * item)] for j in range(e)]
        out[t.key] = _Native(t.key, src.dtype, t.shape, rows, (t.key,))
        return
    out[t.key] = _plain(t.key, src, t.shape, (t.key,))


def _megatron_tensors(
    sources: dict[str, _Source],
    md: Any,
    warnings: list[str],
    config: Any,
    acfg: AdapterConfig,
    ep: tuple[int, int] | None,
) -> tuple[list[_Native], dict[str, list[str]], tuple[str, ...]]:
    """``schema`` megatron: the stacked tensors (:mod:`ckpttool.ops.import_megatron`), skipped keys, byte items.

    A tied ``lm_head.weight`` the import added from the embedding is dropped again (with its
    warning): megatron's tied model has no ``output_layer.weight``.
    """
    from ckpttool.ops.import_megatron import megatron_natives

    if ep is not None:
        raise UsageError("`schema` megatron takes no EP sizes (megatron's keys are global)", param="ep_size")
    if "lm_head.weight" in sources and "lm_head.weight" not in md.entries:
        del sources["lm_head.weight"]  # written from whichever embedding the class ties it to (GPT-2's wte, ...)
        warnings[:] = [w for w in warnings if not w.startswith(_TIED_NOTE)]
    tensors, skipped, objects = megatron_natives(_generic_expert_names(sources, acfg), config, acfg)
    return [_Native(t.key, t.dtype, t.shape, t.rows, (t.key,), flat=t.flat) for t in tensors], skipped, objects


def _segments(n: _Native, start: int, length: int, fds: dict[str, int]) -> list[tuple[int, int, int]]:
    """``(fd, offset, length)`` runs of rows ``[start, start + length)``, adjacent rows merged."""
    if n.flat is not None:
        rb = _row_bytes(n.dtype, n.shape) if n.shape else DType(n.dtype).itemsize
        return [(fds[n.flat[0]], n.flat[1] + start * rb, length * rb)]
    segs: list[tuple[int, int, int]] = []
    for i in range(start, start + length):
        assert n.rows[i], (n.key, i)
        for f, off, nb in n.rows[i]:
            fd = fds[f]
            if segs and segs[-1][0] == fd and segs[-1][1] + segs[-1][2] == off:
                segs[-1] = (fd, segs[-1][1], segs[-1][2] + nb)
            else:
                segs.append((fd, off, nb))
    return segs


def _no_progress(done: int, total: int) -> None:
    return None


def _no_phase(text: str) -> None:
    return None


@dataclass(frozen=True)
class _Report:
    """Where the import says what it is doing (no-ops by default)."""

    progress: ProgressFn = _no_progress
    phase: PhaseFn = _no_phase


def import_hf(
    hf_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ImportOptions | None = None,
    *,
    progress: ProgressFn | None = None,
    phase: PhaseFn | None = None,
) -> ImportResult:
    """Convert a Hugging Face safetensors model directory into a DCP checkpoint (see the module docstring).

    Args:
        hf_dir: directory with ``model*.safetensors`` (+ ``model.safetensors.index.json``) and ``config.json``.
        out: output directory; written beside itself and renamed when complete.
        options: :class:`ImportOptions`.
        progress: optional ``(bytes written, bytes total)`` callback of this process's share: ``(0, total)``
            once planned, then after each chunk.
        phase: optional ``phase(text)`` as each step starts: ``reading headers``, ``planning``, ``writing``
            (the bytes of ``progress``), ``writing metadata``.

    Returns:
        :class:`ImportResult`.

    Raises:
        UsageError: bad options, no config where the adapter needs one; ``hf_dir`` a DCP checkpoint
            (``.metadata`` in it or below it, no ``*.safetensors``: E100, naming ``export``); ``hf_dir`` a URL
            (``s3://...``: E100, the model is read from a local directory; ``out`` may be a URL).
        MetadataError: unreadable or malformed safetensors headers; an index naming tensors the files lack.
        ExportError (E601): keys the adapter does not know, per-expert tensors that do not cover the experts.
        OutputError: ``out`` exists (no ``overwrite``) or cannot be written.
    """
    check_path(hf_dir, "hf_dir")
    check_path(out, "out")
    _refuse_url_source(hf_dir)
    _refuse_dcp_source(Path(hf_dir))
    opts = options_of(options, ImportOptions)
    report = _Report(progress or _no_progress, phase or _no_phase)
    if opts.ep_size is None and opts.ep_fsdp_size is None:
        return _import_plain(hf_dir, out, opts, report=report)
    return _import_ep(hf_dir, out, opts, report)


def _refuse_url_source(hf_dir: str | os.PathLike[str]) -> None:
    """A URL given as ``hf_dir`` is named as given: the Hugging Face folder is read from a local directory (as a
    ``Path``, ``s3://b/m`` was the local ``s3:/b/m``: "no such directory", with a hint listing the current directory).

    Raises:
        UsageError (E100): ``hf_dir`` is a URL other than ``file://``.
    """
    if is_url(hf_dir):
        raise UsageError(
            f"{hf_dir}: a URL; import reads the Hugging Face model from a local directory",
            param="hf_dir",
            hint="copy the folder here first (its *.safetensors, index and config.json), then import it; "
            "the output may be a URL (docs/storage.md)",
        )


def _refuse_dcp_source(hf_dir: Path) -> None:
    """A DCP checkpoint given as ``hf_dir`` is named as one, with the command that converts it (``export``).

    Raises:
        UsageError (E100): ``hf_dir`` holds no ``*.safetensors`` file but ``.metadata`` (or a run root
            with DCP checkpoints below it).
    """
    from ckpttool.model.discovery import find_checkpoints

    try:
        if not hf_dir.is_dir() or any(hf_dir.glob("*.safetensors")):
            return
        what = "it holds .metadata" if (hf_dir / ".metadata").is_file() else None
        if what is None:
            below = [p for p in find_checkpoints(hf_dir) if (p / ".metadata").is_file()]
            what = f"{below[0].relative_to(hf_dir)}/.metadata is below it" if below else None
    except OSError:
        return  # unreadable: the import names the problem
    if what is not None:
        raise UsageError(
            f"{hf_dir} is a DCP checkpoint ({what}), not a Hugging Face safetensors model",
            path=hf_dir,
            hint=f"did you mean `ckpttool export {shell_arg(hf_dir)} OUT` (DCP to safetensors)? "
            "import reads a directory of model*.safetensors files",
        )


def _import_ep(
    hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], opts: ImportOptions, report: _Report
) -> ImportResult:
    """Check the EP sizes, then import for the ``P * F`` ranks of the EP x EP-FSDP mesh (:func:`_import_plain`)."""
    p, f = opts.ep_size or 1, opts.ep_fsdp_size or 1
    check_output_ranks(p * f, f"`ep_size` {p} x `ep_fsdp_size` {f}", "ep_fsdp_size")
    if opts.world_size not in (1, p * f):
        raise UsageError(
            f"`world_size` {opts.world_size} is not `ep_size` x `ep_fsdp_size` = {p * f}",
            param="world_size",
            hint="leave `world_size` out with EP sizes: the output has one file per rank of the EP x EP-FSDP mesh",
        )
    return _import_plain(hf_dir, out, replace(opts, world_size=p * f), ep=(p, f), report=report)


def ep_rows(num_experts: int, ep_size: int, ep_fsdp_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the experts each rank of a canonical ``(EP, EP-FSDP)`` mesh holds.

    Rank ``r = e * F + f`` (canonical, EP-outer order) holds piece ``f`` of EP group ``e``'s
    experts: DTensor ``(Shard(0), Shard(0))`` over the ``(ep, ep_fsdp)`` mesh, ``torch.chunk``
    sizes nested left to right (:func:`~ckpttool.layouts.geometry.nested_shard_intervals`), the
    placement ``ckpttool reshard --to canonical`` writes for the same sizes (EP and EP-FSDP on
    the expert dim, as torchtitan and VeOmni shard experts when ``num_experts >= P * F``). An
    empty piece is ``(num_experts, 0)``.
    """
    from ckpttool.layouts.geometry import nested_shard_intervals

    return nested_shard_intervals(num_experts, (ep_size, ep_fsdp_size))


def ep_dim1_chunks(shape: tuple[int, ...], ep_size: int, ep_fsdp_size: int) -> list[tuple[int, ChunkMeta]]:
    """``(rank, chunk)`` of an expert tensor ``[E, A, ...]`` with fewer experts than ranks (``E < P * F``).

    torchtitan (``torchtitan/distributed/fsdp.py``) then shards the experts on dim 1 for EP-FSDP,
    ``Shard(1)``, to avoid padding: rank ``r = e * F + f`` of the canonical ``(ep, ep_fsdp)`` mesh
    holds experts ``torch.chunk(range(E), P)[e]`` and of each the dim-1 rows
    ``torch.chunk(range(A), F)[f]`` (DTensor ``(Shard(0), Shard(1))``).
    """
    out = []
    experts = torch_chunk_rows(shape[0], ep_size)
    rows = torch_chunk_rows(shape[1], ep_fsdp_size)
    for e, (es, el) in enumerate(experts):
        for f, (rs, rl) in enumerate(rows):
            rest = tuple(shape[2:])
            out.append((e * ep_fsdp_size + f, ChunkMeta((es, rs, *([0] * len(rest))), (el, rl, *rest))))
    return out


def _expert_segments(n: _Native, chunk: ChunkMeta, fds: dict[str, int]) -> list[tuple[int, int, int]]:
    """``(fd, offset, length)`` runs of a ``(Shard(0), Shard(1))`` chunk: its dim-1 rows of each of its experts."""
    item = DType(n.dtype).itemsize
    row = item * math.prod(n.shape[2:])
    expert = row * n.shape[1]
    lo, hi = chunk.offsets[1] * row, (chunk.offsets[1] + chunk.sizes[1]) * row
    segs: list[tuple[int, int, int]] = []
    for j in range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]):
        runs = [(n.flat[0], n.flat[1] + j * expert, expert)] if n.flat is not None else n.rows[j]
        at = 0  # of the run in the expert's bytes
        for f, off, nb in runs:
            a, b = max(lo, at), min(hi, at + nb)
            if a < b:
                fd, start = fds[f], off + (a - at)
                if segs and segs[-1][0] == fd and segs[-1][1] + segs[-1][2] == start:
                    segs[-1] = (fd, segs[-1][1], segs[-1][2] + (b - a))
                else:
                    segs.append((fd, start, b - a))
            at += nb
    return segs


@dataclass(frozen=True)
class _Placed:
    """Where a tensor's chunks go: ``(target rank, chunk)`` pairs; ``dim1``: a ``(Shard(0), Shard(1))``
    expert tensor whose chunks cut dim 1 (:func:`ep_dim1_chunks`), else chunks of whole dim-0 rows."""

    native: _Native
    chunks: list[tuple[int, ChunkMeta]]
    dim1: bool


@dataclass(frozen=True)
class _Written:
    """What the writing of an import takes: the placed tensors, the open source files (``name -> fd``), the
    options, the EP mesh ``(ep_size, ep_fsdp_size)`` and specs of a layout record, the torchrun group and
    megatron's ``_extra_state`` byte items."""

    placed: list[_Placed]
    fds: dict[str, int]
    opts: ImportOptions
    ep: tuple[int, int] | None
    ep_specs: dict[str, EPTensorSpec]
    group: distributed.Group
    objects: tuple[str, ...] = ()


def _row_chunks(shape: tuple[int, ...], rows: list[tuple[int, int]]) -> list[tuple[int, ChunkMeta]]:
    """``(rank, chunk)`` of the dim-0 row ranges ``rows[rank] = (start, length)`` of a tensor of ``shape``."""
    rest = (0,) * (len(shape) - 1)
    return [(rank, ChunkMeta((start, *rest), (length, *shape[1:]))) for rank, (start, length) in enumerate(rows)]


def _check_digest(opts: ImportOptions) -> None:
    """``algorithm`` one ckpttool knows, and given only with ``manifest``: import records no source identity
    without its manifest, so another digest alone would be ignored (a typo too, which the run with a manifest
    refuses).

    Raises:
        UsageError: an unknown ``algorithm``, or one other than the default without ``manifest``.
    """
    from ckpttool.format.digest import DEFAULT_ALGORITHM
    from ckpttool.ops.manifest import check_algorithm

    check_algorithm(opts.algorithm)
    if not opts.manifest and opts.algorithm != DEFAULT_ALGORITHM:
        raise UsageError(
            f"`algorithm` {opts.algorithm} is given without `manifest`: import digests nothing else, "
            "so it would be ignored",
            param="algorithm",
            hint="add `manifest` to write the output's manifest.json with that digest, or drop `algorithm`",
        )


def _check_import_options(hf_dir: str | os.PathLike[str], opts: ImportOptions) -> Path:
    """``schema`` and ``world_size`` usable and ``hf_dir`` a directory holding safetensors files; returns it."""
    if opts.schema not in SCHEMAS:
        raise UsageError(f"`schema` {opts.schema!r} is not one of {', '.join(SCHEMAS)}", param="schema")
    check_output_ranks(opts.world_size, f"`world_size` {opts.world_size}", "world_size")
    _check_digest(opts)
    src_dir = Path(hf_dir)
    if not src_dir.is_dir():
        if src_dir.exists():  # (a link that leads nowhere lexists: it is "no such directory" below, said to be a link)
            raise UsageError(
                f"{src_dir}: not a directory",
                path=src_dir,
                hint=_file_given_hint(src_dir.parent),
            )
        raise UsageError(
            f"{src_dir}: no such directory",
            path=src_dir,
            hint=missing_path_hint(src_dir, "a Hugging Face model directory"),
        )
    if not hf_storage_files(src_dir):
        pickled = sorted(n for n in os.listdir(src_dir) if n.endswith((".bin", ".pt", ".pth")))
        hub = hub_hint(src_dir)
        raise MetadataError(
            f"{src_dir}: no .metadata and no .safetensors files",
            path=src_dir,
            hint=hub_unfinished_download(src_dir)
            or _pickled_hint(pickled)
            or hub
            or _below_hint(src_dir, tuple(pickled)),
        )
    return src_dir


def _pickled_hint(pickled: list[str]) -> str | None:
    """The hint of a folder holding ``torch.save`` files (``.bin``, ``.pt``, ``.pth``) and no safetensors file: the
    weights file to re-save with ``save_pretrained`` or the PEFT adapter to merge; ``None`` where they are all a
    trainer's training state (``optimizer.pt``, ``rng_state.pth``: never named as weights)."""
    weights = [n for n in pickled if not is_training_state_file(n)]
    if not weights:
        return None
    if all(n.startswith(ADAPTER_PREFIX) for n in weights):
        return (
            f"{weights[0]} is a PEFT adapter (a torch.save file), not a model: import the base model, or merge the "
            "adapter into it first (PEFT's merge_and_unload, then save_pretrained)"
        )
    return (
        f"import reads safetensors files only ({weights[0]} is a torch.save file): load the model with "
        "transformers and save it again with save_pretrained (it writes safetensors), then import that"
    )


def _file_given_hint(folder: Path) -> str:
    """The hint of a file given as ``hf_dir``: its ``folder`` to pass where it holds safetensors files; the
    ``export`` of it where it is a DCP checkpoint (``ckpt/.metadata``); else what the directory to pass holds."""
    try:
        if hf_storage_files(folder):
            return f"pass the Hugging Face model directory, not a file in it: {shell_arg(folder)}"
        dcp = (folder / ".metadata").is_file()
    except OSError:
        dcp = False
    if dcp:
        return f"{shell_arg(folder)} is a DCP checkpoint: did you mean `ckpttool export {shell_arg(folder)} OUT` (DCP to safetensors)?"
    return hub_hint(folder) or (  # a blob of a hub cache: its snapshot names it
        "pass the Hugging Face model directory (the one holding its model*.safetensors files and config.json); "
        f"{shell_arg(folder)} holds no .safetensors file"
    )


def _below_hint(src_dir: Path, state: tuple[str, ...] = ()) -> str:
    """The hint for a folder without safetensors files: the model folders below it, if any (a Trainer run's
    ``checkpoint-N/``, ``HuggingFaceStorageWriter(enable_consolidation=True)``'s ``sharded/``, NeMo's ``model/``);
    else the training-state files ``state`` it holds instead of weights, if any."""
    below = sorted(
        (p for p in find_checkpoints(src_dir) if hf_storage_files(p)), key=lambda p: _newest_step_first(p, src_dir)
    )
    if not below and state:
        more = f", ... ({len(state)} in all)" if len(state) > 3 else ""
        return (
            f"the folder holds training state ({', '.join(state[:3])}{more}), no model weights: pass the Hugging "
            "Face model directory, the one holding model*.safetensors and config.json"
        )
    if not below:
        return "pass the Hugging Face model directory, the one holding model*.safetensors and config.json"
    if len(below) == 1:
        return f"the safetensors files are in a folder below it: pass {shell_arg(below[0])}"
    shown = ", ".join(shell_arg(p) for p in below[:3])
    return f"{len(below)} model folders are below it: pass one of them ({shown}{', ...' if len(below) > 3 else ''})"


def _newest_step_first(folder: Path, root: Path) -> tuple[int, str]:
    """Sort key of a model folder below ``root``: below a trainer's step directories (``checkpoint-N``) the newest
    step first, by its number (``checkpoint-1000`` before ``checkpoint-500``), then the other folders by name."""
    steps = [n for n in (step_of(part) for part in folder.relative_to(root).parts) if n is not None]
    return (-steps[0] if steps else 1, str(folder))


#: What :func:`check_against_model` may be told to allow: ``dcp.load`` into the model fails on a missing key
#: or another shape; it leaves a key the model lacks unread (a warning) and casts values to the model's dtypes.
IMPORT_MISMATCH_KINDS = ("missing", "shape")


def check_against_model(
    tensors: dict[str, tuple[tuple[int, ...], str]], config: dict[str, Any], allow: tuple[str, ...], warnings: list[str]
) -> ModelCheck:
    """Compare the tensors a ``torch-native`` import writes (model key -> (shape, dtype), experts in the model's
    own form) with the model class transformers builds from ``config`` on the meta device, before anything is
    written (``export``'s comparison, :func:`~ckpttool.ops.export.expected.compare_with_model`). Keys the model
    lacks are a warning (``dcp.load`` leaves them unread); dtypes are not compared (it casts).

    Raises:
        UsageError (E100): a kind in ``allow`` that is not one of :data:`IMPORT_MISMATCH_KINDS`.
        ModelMismatchError (E605): keys the model has and the folder lacks, or of another shape, unless ``allow``
            names the kind (then a warning).
    """
    from ckpttool.errors import SizeLimitError
    from ckpttool.ops.export.expected import ModelCheck, compare_with_model

    bad = [k for k in allow if k not in IMPORT_MISMATCH_KINDS]
    if bad:
        raise UsageError(
            f"`allow_mismatch` {bad[0]!r} is not one of {', '.join(IMPORT_MISMATCH_KINDS)}",
            param="allow_mismatch",
            hint="keys the model lacks are a warning, and dcp.load casts dtypes: neither needs allowing",
        )
    try:
        check = compare_with_model(tensors, config, loaded_by_hf=False)
    except SizeLimitError as e:  # a config far larger than the folder (its model class is not built)
        check = ModelCheck(False, not_checked=e.message)
    if not check.checked:
        warnings.append(f"keys and shapes were not checked against the model class: {check.not_checked}")
        return check
    check.findings.pop("dtype", None)
    refused = {k: v for k, v in check.findings.items() if k in IMPORT_MISMATCH_KINDS and k not in allow}
    for kind, lines in check.findings.items():
        if kind not in refused:
            why = "allowed" if kind in allow else "dcp.load into the model leaves them unread"
            warnings.append(f"{len(lines)} {kind} key(s) against {check.model_class} ({why}): {_first(lines)}")
    if refused:
        parts = [f"{kind} {len(lines)}: {_first(lines)}" for kind, lines in refused.items()]
        raise ModelMismatchError(
            f"the import does not fit {check.model_class} built from config.json: " + " | ".join(parts),
            param="config",
            hint="dcp.load into this model would fail; pass the model's own config.json (`config`) or a complete "
            f"model directory; `allow_mismatch` {','.join(refused)} imports it anyway",
        )
    return check


def _first(lines: list[str], n: int = 3) -> str:
    """The first ``n`` of ``lines`` and how many more: ``'a; b; c (+2 more)'``."""
    return "; ".join(lines[:n]) + (f" (+{len(lines) - n} more)" if len(lines) > n else "")


def _tie_lm_head(sources: dict[str, _Source], config: Any, warnings: list[str]) -> None:
    """Under ``tie_word_embeddings``, a ``lm_head.weight`` the folder does not store is written from the embedding
    (``save_pretrained`` leaves the tied copy out; the model's ``state_dict()`` has it), and an embedding it does not
    store from a stored ``lm_head.weight`` (safetensors' ``save_model`` keeps that name of the shared pair:
    :func:`~ckpttool.model.hfconfig.untied_embedding_key`), as ``from_pretrained`` ties either way."""
    if tie_word_embeddings(config) is not True:
        return
    head = sources.get("lm_head.weight")
    if head is not None:
        model_type = config.get("model_type") if isinstance(config, dict) else None
        emb = untied_embedding_key(sources, model_type=model_type) if tied_embedding_key(sources) is None else None
        # an embedding of the head's shape stored under a name of its own (InternLM2's tok_embeddings): never a second
        if emb is not None and not any(
            k != head.key and "emb" in k and v.shape == head.shape for k, v in sources.items()
        ):
            sources[emb] = _Source(emb, head.file, head.offset, head.dtype, head.shape)
            warnings.append(
                f"tied {emb} written from lm_head.weight (tie_word_embeddings; the folder stores the head only)"
            )
        return
    found = tied_embedding_key(sources)  # the class's _tied_weights_keys embedding
    if found is not None:
        e = sources[found]
        sources["lm_head.weight"] = _Source("lm_head.weight", e.file, e.offset, e.dtype, e.shape)
        warnings.append(_tied_note(found))


_TIE_BLOCK = 16 << 20  # bytes of the head (and of the embedding) compared at a time


def _check_tied_head(src_dir: Path, sources: dict[str, _Source], config: Any, cfg_path: Path | None) -> None:
    """Under ``tie_word_embeddings``, a stored ``lm_head.weight`` must hold the values of the stored embedding the
    model class ties it to (:func:`~ckpttool.model.hfconfig.tied_embedding_key`), compared as transformers'
    ``from_pretrained`` compares them (``torch.equal`` of the values; streamed, 16 MiB at a time).

    ``from_pretrained`` leaves the two untied where they differ; a model built from the config (what ``dcp.load``
    of the import fills) holds one tensor for both, which would then get the values of only one of them.
    Another shape is left to the check against the model class (E605).

    Raises:
        ExportError (E601): the head differs from the embedding; the message counts the elements.
    """
    head, emb_key = sources.get("lm_head.weight"), tied_embedding_key(sources)
    if tie_word_embeddings(config) is not True or head is None or emb_key is None:
        return
    emb = sources[emb_key]
    if head.shape != emb.shape:
        return
    differ = _count_differing(src_dir, head, emb)
    if differ:
        numel = math.prod(head.shape)
        raise ExportError(
            f"{src_dir}: lm_head.weight differs from {emb_key} in {differ:,} of {numel:,} elements, but "
            f"{_config_file(cfg_path)} ties them (tie_word_embeddings): "
            "from_pretrained loads them untied, while the model this config builds holds one tensor for both",
            path=src_dir,
            param="config",
            hint="the head was trained untied: pass `config` with tie_word_embeddings false (the model "
            "from_pretrained builds, which loads both); to tie it, import the model without the stored lm_head.weight",
        )


def _config_file(path: Path | None) -> str:
    """How messages name the config read from ``path`` (a ``config.json`` or the folder holding one)."""
    if path is None:
        return "the config"
    return str(path / "config.json" if path.is_dir() else path)


def _count_differing(src_dir: Path, a: _Source, b: _Source) -> int:
    """How many elements of the stored tensors ``a`` and ``b`` (one shape) hold other values, as
    :func:`~ckpttool.engine.differ.differing_values` compares them (NaN on both sides alike; two dtypes in float64,
    complex128 where one is complex), 16 MiB of the wider side at a time.

    Raises:
        DataFileError (E300): a file ends before a tensor's data (it changed since its header was read).
    """
    from ckpttool.engine.differ import differing_values
    from ckpttool.engine.io import ShortReadError
    from ckpttool.engine.plan import Window
    from ckpttool.errors import DataFileError

    da, db = DType(a.dtype).to_torch(), DType(b.dtype).to_torch()
    numel = math.prod(a.shape)
    fa = open_regular(resolve_inside(src_dir, a.file, what="safetensors file"))
    try:
        fb = open_regular(resolve_inside(src_dir, b.file, what="safetensors file"))
        try:
            wa, wb = Window(fa, a.offset, numel * da.itemsize), Window(fb, b.offset, numel * db.itemsize)
            try:
                return differing_values(wa, da, wb, db, slab_bytes=_TIE_BLOCK).count
            except ShortReadError:  # its header was read whole: the file changed since
                raise DataFileError(
                    f"{src_dir / a.file} or {src_dir / b.file}: ends before the data of {a.key} / {b.key} "
                    "(truncated or replaced while import read it)",
                    path=src_dir / a.file,
                    fqn=a.key,
                ) from None
        finally:
            os.close(fb)
    finally:
        os.close(fa)


_TIED_NOTE = "tied lm_head.weight written from "


def _tied_note(embedding: str) -> str:
    return f"{_TIED_NOTE}{embedding} (tie_word_embeddings)"


def _model_check(natives: list[_Native], config: Any, opts: ImportOptions, warnings: list[str]) -> ModelCheck | None:
    """:func:`check_against_model` of an import with a config whose schema writes the HF model class's own keys
    (``SchemaSpec.import_checks_hf_model``, ``torch-native``: the keys ``dcp.load`` into the HF model class asks for:
    ``model.<key>``, planner path ``("model", key)``); ``None`` otherwise."""
    if config is None or not registry.get(opts.schema).import_checks_hf_model:
        return None
    model = {n.planner[1]: (n.shape, n.dtype) for n in natives if len(n.planner) == 2 and n.planner[0] == "model"}
    return check_against_model(model, config, opts.allow_mismatch, warnings)


def _hf_sources(src_dir: Path, md: Any) -> dict[str, _Source]:
    """The stored HF tensors by key (whole tensors only: per-rank shards raise E601)."""
    sources: dict[str, _Source] = {}
    for key, tm in md.entries.items():
        if not isinstance(tm, TensorMeta):
            continue
        c = tm.chunks[0]
        if len(tm.chunks) != 1 or any(c.offsets) or c.sizes != tm.size:
            raise ExportError(
                f"{src_dir}: {key!r} is stored as per-rank shards; import reads whole tensors",
                fqn=key,
                hint=(
                    f"`ckpttool export {shell_arg(src_dir)} OUT` writes the assembled tensors (or save with "
                    "HuggingFaceStorageWriter(enable_consolidation=True)); import OUT"
                ),
            )
        info = md.storage_for(key, c)
        assert info is not None, key
        sources[key] = _Source(key, info.relative_path, info.offset, tm.dtype.name, tm.size)
    return sources


def _check_index(src_dir: Path, sources: dict[str, _Source]) -> None:
    """``model.safetensors.index.json``, if any, names no tensor the safetensors files lack."""
    index_path = src_dir / "model.safetensors.index.json"
    if index_path.exists():
        from ckpttool.format import limits
        from ckpttool.format.files import read_regular
        from ckpttool.format.jsonfile import parse_json

        index = parse_json(
            read_regular(
                resolve_inside(src_dir, index_path.name, what="index"), limits.current().max_object_bytes, what="index"
            ),
            str(index_path),
        )
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(wm, dict):
            absent = sorted(set(wm) - set(sources))
            if absent:
                raise ExportError(
                    f"{index_path}: the index lists {len(absent)} tensor(s) no safetensors file holds (e.g. {absent[0]!r})",
                    fqn=absent[0],
                    hint=hub_unfinished_download(src_dir)
                    or "a shard file is missing; download or copy the complete model",
                )


def _choose_adapter(opts: ImportOptions, config: Any, cfg_path: Any = None) -> ModelAdapter | None:
    """The adapter of ``schema`` torchtitan (``adapter``, else from ``model_type``); ``None`` for torch-native.

    ``adapter`` must be one import writes through (:func:`~ckpttool.model.adapters.import_adapters`, the
    registry's :attr:`~ckpttool.model.adapters.ModelAdapter.import_schema`) and one of ``schema``.
    """
    importable = import_adapters()
    if opts.adapter is not None and opts.adapter not in importable:
        names = ", ".join(import_adapters(identity=False))
        raise UsageError(
            f"`adapter` {opts.adapter!r} is export only; import writes through {names}"
            if opts.adapter in ADAPTERS
            else f"`adapter` {opts.adapter!r} is not one of {names}",
            param="adapter",
            hint="omit it to take the adapter from the config's model_type",
        )
    own = import_adapters(opts.schema, identity=False)
    adapter: ModelAdapter | None = None
    spec = registry.get(opts.schema)
    if spec.import_adapters_by_model_type:  # torchtitan: its adapter named by the config's model_type
        adapter = get_adapter(_adapter_by_model_type(opts, spec, own, config, cfg_path))
    elif spec.import_through_own_adapter:  # megatron: its one adapter
        if opts.adapter is not None and opts.adapter not in own:
            raise UsageError(f"`schema` {spec.name} imports through the {' or '.join(own)} adapter", param="adapter")
        adapter = get_adapter(opts.adapter or next(iter(own)))
    elif opts.adapter is not None and importable[opts.adapter].import_schema != opts.schema:
        others = dict.fromkeys(str(cls.import_schema) for cls in importable.values() if not cls.identity)
        raise UsageError(f"`adapter` applies to `schema` {' or '.join(others)}", param="adapter")
    return adapter


def _adapter_by_model_type(
    opts: ImportOptions, spec: SchemaSpec, own: dict[str, Any], config: Any, cfg_path: Any = None
) -> str:
    """``adapter``, else the one :attr:`~ckpttool.model.schemas.base.SchemaSpec.import_adapters_by_model_type` names for
    the config's ``model_type``; one of the schema's own (``own``)."""
    name = opts.adapter
    mt = None
    if name is None:
        mt = config_value(config, "model_type")
        if isinstance(mt, str):
            name = next((a for pat, a in spec.import_adapters_by_model_type if fnmatchcase(mt, pat)), None)
    if name is None:
        which = f"model_type {mt!r}" if isinstance(mt, str) else "no model_type"
        where = "no config (none beside the weights, no `config`)"
        if cfg_path is not None:  # the file, or the folder holding it
            where = str(cfg_path) if str(cfg_path).endswith(".json") else f"{str(cfg_path).rstrip('/')}/config.json"
        by_type = ", ".join(f"{a} ({pat})" for pat, a in spec.import_adapters_by_model_type)
        raise UsageError(
            f"`schema` {spec.name} needs a model adapter: {where} holds {which}, which none of its adapters "
            f"converts ({by_type})"
            if cfg_path is not None
            else f"`schema` {spec.name} needs a model adapter, and there is {where} to name one",
            param="adapter",
            hint=f"pass `adapter` {' or '.join(own)} (and `config`) only for a model of that architecture",
        )
    if name not in own:  # another naming: its keys are not the schema's
        raise UsageError(
            f"`schema` {spec.name} imports through a {spec.name} adapter, not {name}",
            param="adapter",
            hint=f"pass `adapter` {' or '.join(own)}, or leave it out (the config's model_type)",
        )
    return name


def _check_ep(src_dir: Path, natives: list[_Native], ep: tuple[int, int] | None) -> None:
    """With EP sizes: the model has expert tensors and ``ep_size`` divides each one's expert count."""
    if ep is not None:
        from ckpttool.layouts.declaration import EP_NAME_RE
    if ep is not None and not any(len(n.shape) >= 2 and EP_NAME_RE.search(n.key) for n in natives):
        raise UsageError(
            f"{src_dir}: `ep_size` / `ep_fsdp_size` given, but the model has no MoE expert tensor "
            "(fused `experts.<name>` with a leading expert dim)",
            param="ep_size",
            hint="leave the EP sizes out for a dense model (`world_size` pre-shards it for FSDP2)",
        )
    if ep is not None:
        for n in natives:
            if len(n.shape) >= 2 and EP_NAME_RE.search(n.key) and n.shape[0] % ep[0]:
                raise UsageError(
                    f"{n.key}: {n.shape[0]} experts are not divisible by `ep_size` {ep[0]} (every EP rank "
                    "holds the same number of experts)",
                    param="ep_size",
                    fqn=n.key,
                    hint=f"pick an `ep_size` that divides {n.shape[0]}",
                )


def _warn_plain_fsdp_experts(
    natives: list[_Native], opts: ImportOptions, ep: tuple[int, int] | None, warnings: list[str]
) -> None:
    """``world_size`` without EP sizes cuts fused expert tensors by ``Shard(0)`` and writes no layout record: where
    those blocks are also what some EP x EP-FSDP mesh writes, ckpttool's own ``validate --strict`` (L003),
    ``export``, ``reshard`` and ``diff`` (E405) find the expert order unknown. Say so, and how to avoid it: with
    ``num_experts`` divisible by ``world_size``, ``ep_fsdp_size`` = ``world_size`` writes the same chunks and a
    layout record (docs/import.md)."""
    if ep is not None or opts.world_size < 2 or registry.get(opts.schema).import_writes_stacked:
        return
    from ckpttool.layouts.declaration import EP_NAME_RE
    from ckpttool.layouts.geometry import nested_shard_intervals

    def ambiguous(experts: int) -> bool:
        got = {iv for iv in torch_chunk_rows(experts, opts.world_size) if iv[1]}
        blocks = len(got)
        return any(
            not blocks % p
            and blocks // p >= 2
            and not experts % p
            and {iv for iv in nested_shard_intervals(experts, (p, blocks // p)) if iv[1]} == got
            for p in range(2, blocks // 2 + 1)
        )

    hit = [n for n in natives if len(n.shape) >= 2 and EP_NAME_RE.search(n.key) and ambiguous(n.shape[0])]
    if not hit:
        return
    w = opts.world_size
    same = all(n.shape[0] % w == 0 for n in hit)
    warnings.append(
        f"{hit[0].key}{f' (and {len(hit) - 1} more)' if len(hit) > 1 else ''}: `world_size` {w} cuts the expert "
        "dim into blocks that validate, export, reshard and diff cannot tell from an EP layout (L003, E405)"
        + (
            f"; import with `ep_fsdp_size` {w} instead: the same chunks, with a layout record"
            if same
            else "; pass --no-ep to them (plain FSDP: experts in true order)"
        )
    )


def _open_sources(src_dir: Path, natives: list[_Native], fds: dict[str, int]) -> None:
    """Open every safetensors file the tensors read from into ``fds`` (file name -> fd; the caller closes them)."""
    for n in natives:
        for row in [[(*n.flat, 0)]] if n.flat is not None else n.rows:
            for f, _, _ in row:
                if f not in fds and not f.startswith("\0"):  # "\0...": a staged dequantized tensor (import_quant)
                    fds[f] = open_regular(resolve_inside(src_dir, f, what="safetensors file"))


def _place(
    natives: list[_Native], opts: ImportOptions, ep: tuple[int, int] | None, ep_specs: dict[str, EPTensorSpec]
) -> tuple[list[_Placed], list[int], int]:
    """Chunks of every tensor per target rank (EP tensors by :func:`ep_rows`, specs into ``ep_specs``).

    Returns the placements, the bytes of each target rank file and the total tensor bytes.
    """
    if ep is not None:
        from ckpttool.layouts.declaration import EP_NAME_RE
        from ckpttool.layouts.record import EPTensorSpec
    total = 0
    placed: list[_Placed] = []
    file_bytes = [0] * opts.world_size
    for n in natives:
        itemsize = DType(n.dtype).itemsize
        if not n.shape:
            placed.append(_Placed(n, [(0, ChunkMeta((), ()))], dim1=False))
            file_bytes[0] += itemsize
            continue
        if ep is not None and len(n.shape) >= 2 and EP_NAME_RE.search(n.key):
            if n.shape[0] < ep[0] * ep[1]:  # fewer experts than ranks: EP-FSDP on dim 1 (torchtitan)
                ep_specs[n.key] = EPTensorSpec(ep_dim=0, fsdp_dim=1, num_experts=n.shape[0])
                pl = _Placed(n, ep_dim1_chunks(n.shape, *ep), dim1=True)
            else:
                ep_specs[n.key] = EPTensorSpec(ep_dim=0, fsdp_dim=0, num_experts=n.shape[0])
                pl = _Placed(n, _row_chunks(n.shape, ep_rows(n.shape[0], *ep)), dim1=False)
        else:
            pl = _Placed(n, _row_chunks(n.shape, torch_chunk_rows(n.shape[0], opts.world_size)), dim1=False)
        placed.append(pl)
        for rank, chunk in pl.chunks:
            file_bytes[rank] += itemsize * chunk.numel
        total += itemsize * math.prod(n.shape)
    return placed, file_bytes, total


def _write_output(
    src_dir: Path,
    dst: Any,
    job: _Written,
    file_bytes: list[int],
    identity: dict[str, Any] | None,
    report: _Report = _Report(),
) -> list[dict[str, Any]]:
    """Write the output (this rank's share of the rank files; the root ``.metadata`` and manifest); its files."""
    opts, group = job.opts, job.group
    files_info: list[dict[str, Any]] = []
    owners = group.share(file_bytes)
    mine = {r for r in range(opts.world_size) if group.owns(owners[r])}
    with contextlib.ExitStack() as stack:
        tmp = distributed.enter_output_dir(stack, group, dst, overwrite=opts.overwrite, source=src_dir, kind="import")
        try:
            report.phase("writing")
            w = _write_dcp(tmp, dst, job, mine, report.progress)
        except BaseException as e:
            if group.active and not distributed.agreed(e):
                group.agree(e)  # the other ranks learn of it (and raise it) in _write_dcp
            raise
        if group.is_root:
            report.phase("writing metadata" + (" and manifest.json" if opts.manifest else ""))
            if registry.get(opts.schema).import_writes_stacked:  # megatron-core's metadata.json and common.pt
                from ckpttool.ops.import_megatron import write_megatron_files

                write_megatron_files(tmp, opts.fsync)
            if opts.manifest:
                from ckpttool.ops.manifest import write_output_manifest

                write_output_manifest(w, tmp, opts.algorithm, identity)
            for p in sorted(tmp.iterdir()):
                if p.name == MARKER_NAME:  # ckpttool's own marker, not a checkpoint file
                    continue
                files_info.append({"name": p.name, "bytes": p.stat().st_size})
    return files_info


def _adapter_files(src_dir: Path) -> list[str]:
    """The PEFT ``adapter_model*.safetensors`` files in ``src_dir`` (not base weights).

    Raises:
        UsageError: the folder holds only a PEFT adapter, no model.
    """
    adapters = sorted(n for n in os.listdir(src_dir) if n.startswith(ADAPTER_PREFIX) and n.endswith(".safetensors"))
    if adapters and all(n.startswith(ADAPTER_PREFIX) for n in hf_storage_files(src_dir)):
        raise UsageError(
            f"{src_dir}: holds only a PEFT adapter ({adapters[0]}), not a model",
            hint="import the base model, or merge the adapter into it first",
        )
    return adapters


def _warn_left_out(src_dir: Path, adapters: list[str], warnings: list[str]) -> None:
    """Name what the folder holds beside the model that is not imported: a PEFT adapter, Mistral's own
    ``consolidated.safetensors`` (both left out by ``hf_storage_files``) and training state."""
    if adapters:  # PEFT adapter weights beside the model are not base weights (hf_storage_files leaves them out)
        warnings.append(f"{adapters[0]} (a PEFT adapter) was not imported: merge it into the model first to import it")
    _warn_unread_beside(src_dir, warnings)
    every = sorted(n for n in os.listdir(src_dir) if n.endswith(".safetensors") and not n.startswith("."))
    for name in mistral_consolidated(src_dir, every):  # hf_storage_files leaves it out, as transformers does
        warnings.append(
            f"{name} (Mistral's own format, beside the files model.safetensors.index.json names) was not imported: "
            "the import is the index's model, as transformers loads it"
        )


#: What a Hugging Face ``Trainer`` writes beside its final ``save_model()`` weights, and model repositories often
#: ship: the run's arguments and log, no state to resume from; named only beside training state that is.
_RECORDS_ONLY = frozenset({"training_args.bin", "trainer_state.json"})


def _warn_unread_beside(src_dir: Path, warnings: list[str]) -> None:
    """Name the training state saved beside the weights that import does not read (a Hugging Face ``Trainer``
    ``checkpoint-N/``: ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``; NeMo Automodel's ``optim/`` beside
    ``model/``; :func:`ckpttool.model.beside.unread_beside`): the output holds the model weights only. Other
    pickles (a ``pytorch_model.bin`` copy of the weights) are not named: they are not training state."""
    from ckpttool.model.beside import unpaired_optimizer, unread_beside

    opt = unpaired_optimizer(src_dir, src_dir)
    unread = (*unread_beside(src_dir, src_dir, any_pickle=False), *((opt,) if opt is not None else ()))
    if set(unread) - _RECORDS_ONLY:  # a final save_model() folder (weights, training_args.bin) holds no state
        shown = ", ".join(unread[:6]) + (f" (+{len(unread) - 6} more)" if len(unread) > 6 else "")
        warnings.append(
            f"{shown}: not imported (training state beside the weights, which import does not read): "
            "the output holds the model weights only, no optimizer or scheduler state to resume from"
        )


def _prepare_sources(
    src_dir: Path,
    sources: dict[str, _Source],
    config: Any,
    cfg_path: Path | None,
    opts: ImportOptions,
    warnings: list[str],
) -> None:
    """The stored tensors are some (:func:`_check_not_empty`) and those the index lists (:func:`_check_index`); a base
    model's keys get the prefix the config's model class holds them under (:func:`_add_base_model_prefix`); under a
    tying config a stored head holds its embedding's values (:func:`_check_tied_head`: before any is dequantized)."""
    _check_not_empty(src_dir, sources)
    _check_index(src_dir, sources)
    _rename_stored_keys(sources, config)
    _add_base_model_prefix(sources, config, opts, warnings)
    _check_tied_head(src_dir, sources, config, cfg_path)


def _rename_stored_keys(sources: dict[str, _Source], config: Any) -> None:
    """Stored keys the config's model class holds under another name (GPT-NeoX's ``embed_out.weight``, which
    transformers v5 loads as ``lm_head.weight``: :data:`ckpttool.model.hf_forms.KEY_RENAMES`) under the model's name,
    as ``from_pretrained`` renames them.

    Raises:
        ExportError (E601): a stored key beside the model's own name of it (two tensors for one key); both named
            by :func:`~ckpttool.errors.short_key` (a message of one readable line).
    """
    model_type = config.get("model_type") if isinstance(config, dict) else None
    renamed = {k: name for k in sources if (name := model_key(k, model_type)) != k}
    for key, name in renamed.items():
        if name in sources:
            raise _two_tensors_of_one_key(key, name)
        s = sources.pop(key)
        sources[name] = replace(s, key=name)


def _two_tensors_of_one_key(key: str, name: str) -> ExportError:
    """E601: the stored ``key`` names the model key ``name`` that another stored tensor holds already (a legacy name
    beside its renamed one); both by :func:`~ckpttool.errors.short_key`."""
    return ExportError(
        f"{short_key(key)}: stored beside another tensor of the model key {short_key(name)!r}",
        fqn=key,
        hint="the folder mixes two naming forms of one model; re-save it with save_pretrained",
    )


def _add_base_model_prefix(sources: dict[str, _Source], config: Any, opts: ImportOptions, warnings: list[str]) -> None:
    """A base model's save loaded into the config's causal LM (the hub's ``openai-community/gpt2`` stores
    ``GPT2Model``'s ``wte.weight``, ``h.0.attn.c_attn.weight``, ... under a ``GPT2LMHeadModel`` config): every stored
    key the model class holds only one level down, under the one prefix ``P.`` that no stored key has
    (``transformer.``, its ``base_model_prefix``), is written as ``P.<key>``, as ``from_pretrained`` adds that prefix
    (``core_model_loading.py``); a warning says so. For the schemas that check against the HF model class
    (``torch-native``) with a config; the model class comes from the same cache as the check."""
    if config is None or not registry.get(opts.schema).import_checks_hf_model:
        return
    from ckpttool.errors import SizeLimitError
    from ckpttool.ops.export.expected import check_config_bounds, expected_state_dict

    try:
        check_config_bounds(config, len(sources))
    except SizeLimitError:  # the check against the model class says so
        return
    got = expected_state_dict(config)
    if isinstance(got, str):
        return
    below: dict[str, set[str]] = {}  # key one level down -> the prefixes the model holds it under
    for e in got.tensors:
        head, _, rest = e.partition(".")
        if rest:
            below.setdefault(rest, set()).add(head)
    moved = [k for k in sources if k not in got.tensors and k in below]
    prefixes = {p for k in moved for p in below[k]}
    if len(prefixes) != 1:
        return
    (prefix,) = prefixes
    if any(k.startswith(prefix + ".") for k in sources):  # some stored under it already: not a base model's save
        return
    for k in moved:
        s = sources.pop(k)
        sources[f"{prefix}.{k}"] = _Source(f"{prefix}.{k}", s.file, s.offset, s.dtype, s.shape)
    warnings.append(
        f"{len(moved)} stored key(s) of the base model ({_first(moved, 2)}) written under {prefix}., where "
        f"{got.model_class} holds them, as from_pretrained loads them"
    )


def _check_not_empty(src_dir: Path, sources: dict[str, _Source]) -> None:
    """Refuse safetensors files that hold no tensor: an empty checkpoint would load into no model.

    Raises:
        ExportError (E601): naming the first file.
    """
    if not sources:
        names = hf_storage_files(src_dir)
        raise ExportError(
            f"{src_dir / names[0]}: the safetensors file(s) hold no tensor ({len(names)} file(s), headers only)",
            path=src_dir / names[0],
            hint="the model folder is incomplete or not a model; download or copy the model's weights again",
        )


def _import_plain(
    hf_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    opts: ImportOptions,
    ep: tuple[int, int] | None = None,
    report: _Report = _Report(),
) -> ImportResult:
    """The import; with ``ep = (P, F)`` expert tensors are placed by :func:`ep_rows` and a layout record is written."""
    t0 = time.perf_counter()
    src_dir = _check_import_options(hf_dir, opts)
    report.phase(f"reading headers of {src_dir}")
    # the folder's config.json, or where the trainer saved it with the weights (NeMo Automodel's model/.hf_metadata/)
    cfg_path = opts.config if opts.config is not None else hf_config_beside(src_dir)
    config = (
        read_hf_config(cfg_path, param="config" if opts.config is not None else None) if cfg_path is not None else None
    )
    adapters = _adapter_files(src_dir)
    md = refuse_long_numbers(src_dir, load_hf_storage_metadata(src_dir))  # an expert or layer of 5,000 digits
    warnings: list[str] = []
    _warn_left_out(src_dir, adapters, warnings)
    sources = _hf_sources(src_dir, md)
    _prepare_sources(src_dir, sources, config, cfg_path, opts, warnings)
    real_files = sorted({s.file for s in sources.values()})
    plans = _dequantize_sources(src_dir, sources, _quant_config(src_dir, config, opts), opts, warnings)
    _tie_lm_head(sources, config, warnings)
    adapter = _choose_adapter(opts, config, cfg_path)
    acfg = AdapterConfig.from_hf_config(config)
    report.phase("planning")
    objects: tuple[str, ...] = ()
    if registry.get(opts.schema).import_writes_stacked:  # megatron-core's stacked layers
        natives, skipped, objects = _megatron_tensors(sources, md, warnings, config, acfg, ep)
    else:
        natives, skipped = _native_tensors(sources, opts, adapter, acfg)
    check = _model_check(natives, config, opts, warnings)
    _check_ep(src_dir, natives, ep)
    _warn_plain_fsdp_experts(natives, opts, ep, warnings)
    fds: dict[str, int] = {} if not plans else _staged_fds(src_dir, plans)
    ep_specs: dict[str, EPTensorSpec] = {}
    try:
        _open_sources(src_dir, natives, fds)
        identity = None
        if opts.manifest:
            from ckpttool.ops.manifest import safetensors_source_identity

            identity = safetensors_source_identity(src_dir, real_files, opts.algorithm)
        dst = output_location(out)
        # torchrun: each rank writes the target rank files assigned to it (by bytes), rank 0 .metadata
        group = distributed.current()
        placed, file_bytes, total = _place(natives, opts, ep, ep_specs)
        if opts.dry_run:  # this very plan, checked up to the output directory: nothing written
            check_target(dst, overwrite=opts.overwrite, source=src_dir)
            files_info = [{"name": DCPWriter.file_name(r), "bytes": b} for r, b in enumerate(file_bytes)]
        else:
            job = _Written(placed, fds, opts, ep, ep_specs, group, objects)
            files_info = _write_output(src_dir, dst, job, file_bytes, identity, report)
    finally:
        for fd in fds.values():
            os.close(fd)
    return ImportResult(
        source=str(src_dir),
        output=str(dst),
        schema=opts.schema,
        adapter=adapter.name if adapter is not None else None,
        world_size=opts.world_size,
        tensors=len(natives),
        bytes=total,
        seconds=time.perf_counter() - t0,
        files=files_info,
        skipped=skipped,
        warnings=warnings,
        ep_size=ep[0] if ep is not None else None,
        ep_fsdp_size=ep[1] if ep is not None else None,
        ep_tensors=len(ep_specs),
        source_identity=identity,
        manifest="manifest.json" if opts.manifest else None,
        dry_run=opts.dry_run,
        dequantized=_dequantized_summary(plans),
        model_check=check.to_dict() if check is not None else None,
    )


def _quant_config(src_dir: Path, config: Any, opts: ImportOptions) -> Any:
    """The config that says how quantized weights scale: ``config``; a ``--config`` without a
    ``quantization_config`` (the base model's, given for the model check) says nothing of it, so the folder's own
    ``quantization_config`` is taken beside it (an unreadable own config.json: none, as before)."""
    if opts.config is None or not isinstance(config, dict) or "quantization_config" in config:
        return config
    own_dir = hf_config_beside(src_dir)
    try:
        own = read_hf_config(own_dir, param=None) if own_dir is not None else None
    except CkptError:
        return config
    qc = own.get("quantization_config") if isinstance(own, dict) else None
    return config if qc is None else {**config, "quantization_config": qc}


def _dequantize_sources(
    src_dir: Path, sources: dict[str, _Source], config: Any, opts: ImportOptions, warnings: list[str]
) -> dict[str, Any]:
    """Replace quantized pairs in ``sources`` by their dequantized tensors, staged on first read
    (:mod:`ckpttool.ops.import_quant`); the scales are read and checked here, before anything is written.

    Returns:
        The plans (dequantized name -> :class:`~ckpttool.ops.import_quant.Dequantized`).
    """
    from ckpttool.ops.import_quant import STAGED_PREFIX, plan_dequantize, read_scales

    plans, consumed = plan_dequantize(sources, config, opts.dtype)
    raw = sorted(k for k, s in sources.items() if s.dtype.startswith("float8_") and k + "_scale" in sources)
    raw = [k for k in raw if k not in plans]
    if raw:  # no quantization_config (under one, plan_dequantize refused them): nothing says how they scale
        more = f" (+{len(raw) - 1} more)" if len(raw) > 1 else ""
        warnings.append(
            f"{raw[0]}{more}: float8 weight(s) beside an x.weight_scale imported as their stored FP8 codes, unscaled: "
            "the config has no quantization_config saying how they scale; pass `config` with the one they were "
            "quantized with to dequantize them"
        )
    if not plans:
        if opts.dtype is not None:
            warnings.append(f"`dtype` {opts.dtype} applies to quantized weights; the checkpoint has none")
        return plans
    fds = _staged_fds(src_dir, plans)
    try:
        for plan in plans.values():
            read_scales(fds, plan)  # type: ignore[arg-type]
    finally:
        for fd in fds.values():
            os.close(fd)
    for k in consumed:
        sources.pop(k, None)
    for name, plan in plans.items():
        sources[name] = _Source(name, STAGED_PREFIX + name, 0, plan.dtype, plan.pair.shape)
    _cast_expert_parts(sources, plans, config, warnings)
    return plans


def _cast_expert_parts(sources: dict[str, _Source], plans: dict[str, Any], config: Any, warnings: list[str]) -> None:
    """Per-expert parts of a fused tensor stored unquantized beside dequantized parts (one expert kept BF16 among
    FP8 experts) are staged in the dequantized dtype (:class:`~ckpttool.ops.import_quant.Cast`), with a warning:
    the fused tensor has one dtype, and ``dtype`` float32 would otherwise leave them bfloat16 among float32."""
    from ckpttool.ops.import_quant import CASTABLE, STAGED_PREFIX, Cast

    mt = config_value(config, "model_type") if isinstance(config, dict) else None
    out_dtype = next(iter(plans.values())).dtype
    cast: list[str] = []
    for form in forms_for(mt if isinstance(mt, str) else None):
        groups: dict[tuple[str, str], list[str]] = {}
        for k in sources:
            m = form.pattern.match(k)
            if m:
                fused = next(f for f, parts in form.fused() if m["proj"] in parts)
                groups.setdefault((m["p"], fused), []).append(k)
        for keys in groups.values():
            if not any(k in plans for k in keys):
                continue
            for k in keys:
                src = sources[k]
                if k not in plans and src.dtype != out_dtype and src.dtype in CASTABLE:
                    plans[k] = Cast(k, (src.file, src.offset), src.dtype, src.shape, out_dtype)
                    sources[k] = _Source(k, STAGED_PREFIX + k, 0, out_dtype, src.shape)
                    cast.append(k)
    if cast:
        more = f" (+{len(cast) - 1} more)" if len(cast) > 1 else ""
        warnings.append(
            f"{cast[0]}{more}: stored {plans[cast[0]].src_dtype}, unquantized, beside dequantized experts of the same "
            f"fused tensor: written as {out_dtype} with them"
        )


def _staged_fds(src_dir: Path, plans: dict[str, Any]) -> dict[str, int]:
    from ckpttool.ops.import_quant import StagedFds

    return StagedFds(src_dir, plans)


def _dequantized_summary(plans: dict[str, Any]) -> dict[str, Any] | None:
    from ckpttool.ops.import_quant import Cast

    plans = {k: p for k, p in plans.items() if not isinstance(p, Cast)}  # cast, not dequantized: a warning says so
    if not plans:
        return None
    first = next(iter(plans.values()))
    kinds: dict[str, int] = {}
    for p in plans.values():
        kinds[p.pair.kind] = kinds.get(p.pair.kind, 0) + 1
    return {"dtype": first.dtype, "kinds": kinds, "tensors": sorted(plans)}


def _write_dcp(tmp: Path, dst: Any, job: _Written, mine: set[int], progress: ProgressFn = _no_progress) -> DCPWriter:
    """Write the chunks of the target rank files in ``mine`` into ``tmp``; the root writes ``.metadata``.

    Under torchrun every rank declares every tensor and writes its own files; after the barrier
    the root merges the other ranks' records (chunk offsets in their files) and writes
    ``.metadata`` (:mod:`ckpttool.ops.distributed`). One process: ``mine`` is every rank.
    ``progress(bytes written, bytes total)`` after each chunk (the total: the bytes of ``mine``).
    """
    placed, fds, opts, ep, ep_specs, objects = job.placed, job.fds, job.opts, job.ep, job.ep_specs, job.objects
    total = sum(DType(p.native.dtype).itemsize * c.numel for p in placed for r, c in p.chunks if r in mine)
    total += sum(DType(p.native.dtype).itemsize for p in placed if not p.native.shape and 0 in mine)
    done = 0
    progress(0, total)
    with DCPWriter(
        tmp,
        dst if is_url(dst) else absolute_path(dst),
        fsync=opts.fsync,
        digest=opts.algorithm if opts.manifest else None,
    ) as w:
        w.ensure_files(sorted(mine))
        for p in placed:
            n = p.native
            dt = DType(n.dtype)
            w.declare_tensor(n.key, dt, n.shape, n.planner)
            if not n.shape:
                if 0 in mine:
                    w.stream_tensor_archive(n.key, ChunkMeta((), ()), 0, dt, _segments(n, 0, 1, fds))
                    done += dt.itemsize
                    progress(done, total)
                continue
            for rank, chunk in p.chunks:
                if (rank > 0 and chunk.numel == 0) or rank not in mine:
                    continue
                if p.dim1:
                    segments = _expert_segments(n, chunk, fds)
                else:
                    segments = _segments(n, chunk.offsets[0], chunk.sizes[0], fds)
                w.stream_tensor_archive(n.key, chunk, rank, dt, segments)
                done += dt.itemsize * chunk.numel
                progress(done, total)
            release = getattr(fds, "release", None)
            if release is not None:  # staged dequantized tensors: dropped once written (import_quant.StagedFds)
                release()
        if objects and 0 in mine:  # megatron's `_extra_state` byte items (ops/import_megatron.py)
            from ckpttool.ops.import_megatron import EXTRA_STATE_VALUE

            for key in objects:
                w.write_object(key, 0, EXTRA_STATE_VALUE, None)
        if ep is not None and 0 in mine:  # the record `reshard` / `stamp` embed (docs/layouts.md), as a byte item
            from ckpttool.layouts.record import LAYOUT_KEY
            from ckpttool.ops.reshard.plan import make_record

            record = make_record(2, ep[0], ep[1], ep_specs, optimizer={})
            w.write_object(LAYOUT_KEY, 0, json.dumps(record, sort_keys=True), (LAYOUT_KEY,))
        if not distributed.merge_rank_files(job.group, w, mine):  # pairs with _import_plain's agree(error)
            return w
        w.finish()
    return w
