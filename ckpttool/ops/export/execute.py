"""``export_checkpoint``: DCP checkpoint -> HF safetensors (sharded + index) or a PEFT LoRA adapter.

The opened checkpoint -> selection and plan (pure, :mod:`ckpttool.ops.export.plan`) -> chunks
checked (tiling, stored sizes) -> output files created at their final size in a temporary
directory -> every stored chunk read once on the pool -> index, assets, atomic rename. A tensor
written as stored is copied verbatim (:func:`ckpttool.format.copy.copy_range`); every other
one streams slab by slab through :mod:`ckpttool.ops.export.transform`, never assembled.
``docs/export.md``, "How it streams".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckpttool.engine.io import write_all
from ckpttool.engine.pool import Lane, wait_exception
from ckpttool.errors import (
    CkptError,
    ExportAccountingError,
    ExportError,
    ModelMismatchError,
    NotRegularFileError,
    UsageError,
    at_least,
    check_path,
    shell_arg,
)
from ckpttool.format import limits
from ckpttool.format.atomic import signals_deferred
from ckpttool.format.files import (
    copy_regular,
    hub_hint,
    missing_path_hint,
    read_regular,
    refuse_link_to_nothing,
    resolve_inside,
)
from ckpttool.format.jsonview import JsonView, json_counted
from ckpttool.format.metadata import DTYPE_ITEMSIZE, ChunkMeta, TensorMeta
from ckpttool.format.outputs import check_target, output_location
from ckpttool.format.reader import CheckpointReader
from ckpttool.format.safetensors import ShardWriter
from ckpttool.format.storage import is_url
from ckpttool.format.tiling import contiguous_run, tiling_problem
from ckpttool.format.unpickler import short_repr
from ckpttool.layouts.declaration import ResolvedLayout
from ckpttool.layouts.record import SIDECAR_NAME
from ckpttool.model.adapters import AdapterConfig, ModelAdapter, detect_adapter, get_adapter
from ckpttool.model.catalog import Catalog, TensorEntry, bare_glob_hint, match_filter
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, gc_held, open_source
from ckpttool.model.hf_forms import fold_expert_forms
from ckpttool.model.hfconfig import config_value, read_hf_config, tie_word_embeddings
from ckpttool.model.schemas.base import canonical_model_key
from ckpttool.model.schemas.detect import detect_schema
from ckpttool.ops import distributed
from ckpttool.ops.export.expected import MISMATCH_KINDS, ModelCheck, compare_with_model
from ckpttool.ops.export.experts import expert_orders
from ckpttool.ops.export.lora import check_lora_alpha, read_adapter_config
from ckpttool.ops.export.outputs import OutputFormat, PrepareRequest, get_format
from ckpttool.ops.export.plan import (
    SAVE_DTYPES,
    SKIP_FILTERED,
    ExportPlan,
    Selected,
    SourceTask,
    build_plan,
    check_quantized_sources,
    check_trainable_dtypes,
    select_sources,
    transposed_expert_keys,
    unaccounted_tensors,
)
from ckpttool.ops.export.rules import ExportRules, load_rules
from ckpttool.ops.export.transform import Cast, Run, RunMap, SlabTransform, env_slab_bytes, stream_chunk
from ckpttool.ops.fields import Hooks, OutputOptions, PhaseFn, ProgressFn, Unpack, hooks_of, options_of, same_named
from ckpttool.ops.manifest import (
    MANIFEST_NAME,
    SOURCE_METADATA_KEY,
    check_algorithm,
    safetensors_manifest,
    source_identity,
)

if TYPE_CHECKING:
    import torch

    from ckpttool.ops.export.quantize import BlockQuantizer, QuantSpec

__all__ = ["ExportOptions", "ExportResult", "export_checkpoint", "ProgressFn"]

log = logging.getLogger(__name__)


#: What to do about a layout record or declaration that the chunks contradict (E404).
_LAYOUT_HINT = (
    "the layout record or declaration does not describe how this checkpoint was saved: correct the declaration, "
    f"or delete the wrong {SIDECAR_NAME} and `ckpttool stamp` the right one"
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp")


@dataclass(frozen=True)
class ExportOptions(OutputOptions):
    """Options of :func:`export_checkpoint` (the CLI flags of ``ckpttool export``): those of every writing
    operation (:class:`~ckpttool.ops.fields.OutputOptions`: ``overwrite``, ``manifest``, ``algorithm``,
    ``dry_run``) and its own. Here the manifest is of kind ``safetensors`` (every byte range written); the
    source identity is also recorded in every output file's safetensors ``__metadata__``
    (``ckpttool.source``); a dry run checks the options, selection, casts, the model check and every
    chunk's tiling, and its file sizes are planned sizes without headers.

    Attributes:
        fmt: a registered output format (:data:`ckpttool.ops.export.outputs.OUTPUT_FORMATS`): ``"hf"``
            (``model*.safetensors`` + index), ``"lora"`` (``adapter_model.safetensors``), ``"hf-merged"``.
        save_dtype: ``"preserve"`` (bit-exact stored dtype) or ``bfloat16``/``float16``/``float32``
            (floating tensors only).
        weights: ``"params"``, ``"master"`` (FP32 ``master_weight`` where present) or ``"auto"``
            (``master`` when the checkpoint holds any ``master_weight``, else ``params``; the result
            says which). ``None`` (the default): ``"auto"`` when ``quantize`` is given, else ``"params"``.
        shard_size: max bytes per output file (default 5*10^9, the Hugging Face ``"5GB"``).
        experts: ``"fused"`` (``[E, 2I, H]`` as stored) or ``"per-expert"`` (HF ``experts.{j}.*`` keys).
            ``None`` (the default): ``"per-expert"`` when ``quantize`` is given (the layout vLLM, torch's
            reader and transformers without a GPU read block FP8 experts in), else ``"fused"``.
        rules: a YAML rules file merged over the packaged defaults.
        model_assets: directory with ``config.json`` / tokenizer files to copy (and read).
        filter_glob: only keys matching this glob (checkpoint key with or without ``model.``, or output key).
        workers: reader threads (``None``: ``min(8, CPU count)``).
        adapter_config: ``adapter_config.json`` to write (LoRA).
        lora_alpha: LoRA ``lora_alpha`` when no adapter config is given.
        verify_crc: check every stored record's CRC-32 as it is copied or read (default on;
            its cost: docs/performance.md).
        adapter: a model adapter name (:data:`ckpttool.model.adapters.ADAPTERS`); ``None``:
            detected from the key names (torchtitan names -> a torchtitan adapter).
        allow_mismatch: kinds of difference from the model class built from ``config.json``
            (``missing``, ``unexpected``, ``shape``, ``dtype``) reported as warnings instead of refused.
        quantize: ``"fp8-block"``: qualifying 2-D weights as block FP8 + ``weight_scale_inv``
            (:mod:`ckpttool.ops.export.quantize`); the rest in ``save_dtype`` (``preserve`` means
            ``bfloat16`` then); ``None``: no quantization.
        quantize_block: the FP8 block size ``B`` (``B x B`` blocks).
        quantize_skip: output-key globs left unquantized besides the defaults.
        quant_format: ``"fp8"`` (DeepSeek-V3 ``weight_scale_inv``) or ``"compressed-tensors"``
            (``weight_scale``, llm-compressor's ``quantization_config``); ``fp8-channel`` needs the latter.
    """

    fmt: str = "hf"
    save_dtype: str = "preserve"
    weights: str | None = None
    shard_size: int = 5 * 10**9
    experts: str | None = None
    rules: Path | None = None
    model_assets: Path | None = None
    filter_glob: str | None = None
    workers: int | None = field(default=None, metadata=at_least(1))
    adapter_config: Path | None = None
    lora_alpha: float | None = None
    verify_crc: bool = True
    adapter: str | None = None
    allow_mismatch: tuple[str, ...] = ()
    quantize: str | None = None
    quantize_block: int = field(default=128, metadata=at_least(1))
    quantize_skip: tuple[str, ...] = ()
    quant_format: str = "fp8"


#: The ``--json`` document of :class:`ExportResult`: its keys in order (``docs/export.md``).
_EXPORT_VIEW = JsonView(
    "ckpttool.export/1",
    "output format files tensors bytes bytes_read seconds:4 write_seconds:4 gb_per_s:4 save_dtype weights experts casts"
    " narrowing_casts origins tied_embeddings layout assets skipped warnings adapter_config source_identity manifest"
    " model_adapter model_check config_edits notes dry_run quantization config_beside",
)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote (``--json``: :meth:`to_dict`, schema ``ckpttool.export/1`` in ``docs/export.md``)."""

    output: str
    format: str
    files: list[dict[str, Any]]
    tensors: int
    """Entries written to the safetensors files (a block-FP8 weight and its scale are two)."""
    bytes: int
    """Bytes of tensor data written (safetensors headers and assets not counted)."""
    bytes_read: int
    """Bytes read from the checkpoint's data files."""
    seconds: float
    """Wall-clock seconds of the export; its writing phase alone: ``write_seconds``."""
    save_dtype: str
    weights: str
    """``params`` (the stored parameters) or ``master`` (the FP32 master weights)."""
    experts: str
    casts: dict[str, int]
    """``"<from>-><to>"`` dtype pair -> tensors cast that way."""
    narrowing_casts: dict[str, int]
    """The casts of :attr:`casts` that lose precision or range (``float32->bfloat16``)."""
    origins: dict[str, list[str]]
    tied_embeddings: str | None
    layout: dict[str, Any]
    assets: list[str]
    skipped: dict[str, list[str]]
    warnings: list[str] = field(default_factory=list)
    adapter_config: dict[str, Any] | None = None
    source_identity: dict[str, Any] | None = None
    manifest: str | None = None
    model_adapter: str | None = None
    model_check: dict[str, Any] | None = None
    config_edits: dict[str, list[Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False
    quantization: dict[str, Any] | None = None
    write_seconds: float = 0.0
    config_beside: str | None = None

    @property
    def gb_per_s(self) -> float:
        """Output bytes per second of the writing phase (``write_seconds``), in GB/s (10^9); 0 when nothing was
        written."""
        return self.bytes / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return _EXPORT_VIEW.render(self, origins=json_counted(self.origins), skipped=json_counted(self.skipped))


# ---------------------------------------------------------------------------------------------- helpers


def _assets_file_hint(assets: Path, what: str) -> str:
    """The hint of a file given as ``model_assets``: its folder where it is that folder's ``config.json`` (or a file
    beside one), as a checkpoint's file given for the checkpoint names its directory."""
    if (assets.parent / "config.json").is_file():
        return f"pass {what}, not a file in it: {assets.parent}"
    return f"pass {what}"


def _read_model_config(assets: Path | None) -> dict[str, Any] | None:
    if assets is None:
        return None
    if not assets.is_dir():
        what = "the directory holding config.json and the tokenizer files"
        raise UsageError(
            f"{assets}: `model_assets` is not a directory"
            if assets.exists()
            else f"`model_assets` {assets}: no such directory",
            path=assets,
            param="model_assets",
            hint=_assets_file_hint(assets, what) if assets.exists() else missing_path_hint(assets, what),
        )
    if os.path.islink(assets / "config.json"):  # a link out of it: E101 first; a hub blob gone: not "no config"
        resolve_inside(assets, "config.json", what="`model_assets` file")
        refuse_link_to_nothing(assets / "config.json", "model_assets")
    if not (assets / "config.json").exists():
        hub = hub_hint(assets)
        if hub is not None:  # the files are in its snapshot: exporting without them would drop config.json silently
            raise UsageError(
                f"{assets}: `model_assets` holds no config.json", path=assets, param="model_assets", hint=hub
            )
        return None
    return read_hf_config(resolve_inside(assets, "config.json", what="`model_assets` file"), param="model_assets")


def _asset_files(assets: Path, out_format: OutputFormat) -> list[tuple[str, Path]]:
    """Top-level regular files of ``--model-assets`` to copy (no weights, no index, no ``manifest.json``: it
    describes that folder's files, not the export's; none the format skips).

    Each is confined to the directory: a symlink is followed only when its target stays inside
    it, and devices, FIFOs and sockets are refused (they are checked again on the open
    descriptor when copied).

    Raises:
        PathEscapeError: a symlink leaves the directory.
        NotRegularFileError: a device, FIFO or socket.
    """
    out = []
    for p in sorted(assets.iterdir()):
        name = p.name
        if name.startswith(".") or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        if name == MANIFEST_NAME:
            continue
        if out_format.skips_asset(name):
            continue
        target = resolve_inside(assets, name, what="`model_assets` file")  # a link out of it: E101 first
        refuse_link_to_nothing(p, "model_assets")
        st = target.stat()
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(
                f"`model_assets` {p} is a device, FIFO or socket, not a regular file", path=p, param="model_assets"
            )
        out.append((name, target))
    return out


def _dedup_chunks(
    reader: CheckpointReader,
    key: str,
    memo: dict[int, tuple[TensorMeta, list[ChunkMeta]]] | None = None,
) -> tuple[TensorMeta, list[ChunkMeta]]:
    """Chunks of ``key`` to read: replicated chunks (same offsets and sizes) once, zero-size ones never.

    ``memo`` (one dict per export): the de-dup and tiling of a ``TensorMeta`` object already
    seen (entries of one layout share it: 2 objects for 10^6 entries) are reused; the
    allocation check (this key's storage records) runs for every key. The chunk list returned
    may then be shared between keys: read it, never change it.

    Raises:
        AllocationError: sizes the stored bytes cannot hold.
        ChunkError: the chunks leave a gap or overlap.
    """
    meta = reader.metadata.entries.get(key)
    if not isinstance(meta, TensorMeta):
        meta = reader.tensor_meta(key)  # raises the error that names it
    reader.check_allocation(key, meta)
    if memo is not None:
        hit = memo.get(id(meta))
        if hit is not None and hit[0] is meta:
            return hit
    if len(meta.chunks) == 1:
        chunks = list(meta.chunks)
    else:
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        chunks = []
        for c in meta.chunks:
            ident = (c.offsets, c.sizes)
            if ident in seen:
                continue
            seen.add(ident)
            chunks.append(c)
    problem = tiling_problem(
        meta if len(chunks) == len(meta.chunks) else TensorMeta(meta.dtype, meta.size, tuple(chunks))
    )
    if problem is not None:
        raise reader.tiling_error(key, meta, problem)
    result = (meta, [c for c in chunks if c.numel > 0])
    if memo is not None:
        memo[id(meta)] = result  # holds meta: its id is not reused while the memo lives
    return result


def _checked_chunks(reader: CheckpointReader, keys: list[str]) -> list[tuple[TensorMeta, list[ChunkMeta]]]:
    """:func:`_dedup_chunks` of every key, in order (the same results and the same first error).

    A key whose ``TensorMeta`` object was already de-duplicated and tiled (entries of one layout
    share it) and whose records :meth:`CheckpointReader.allocation_fits` accepts takes the memo's
    result without a call per chunk: 10^6 one-chunk tensors.
    """
    memo: dict[int, tuple[TensorMeta, list[ChunkMeta]]] = {}
    spans: dict[int, tuple[TensorMeta, tuple[tuple[tuple[int, ...], int], ...] | None]] = {}
    entries_get = reader.metadata.entries.get
    fits = reader.allocation_fits
    out: list[tuple[TensorMeta, list[ChunkMeta]]] = []
    last: object = None  # runs of keys share one meta: no dict lookup for them
    last_hit: tuple[TensorMeta, list[ChunkMeta]] | None = None
    last_spans: tuple[tuple[tuple[int, ...], int], ...] | None = None
    add = out.append
    for key in keys:
        meta = entries_get(key)
        if meta is not last or last_hit is None:
            last, last_hit, last_spans = meta, None, None
            hit = memo.get(id(meta))
            if hit is not None and hit[0] is meta:  # meta is then a TensorMeta, de-duplicated and tiled
                sp = spans.get(id(meta))
                if sp is None or sp[0] is not meta:
                    sp = spans[id(meta)] = (meta, reader.allocation_spans(meta))  # holds meta: its id is not reused
                last_hit, last_spans = hit, sp[1]
        if last_spans is not None and fits(key, last_spans):
            add(last_hit)  # type: ignore[arg-type]  # last_spans is set only with last_hit
            continue
        add(_dedup_chunks(reader, key, memo))
    return out


def _narrow(t: torch.Tensor, chunk: ChunkMeta, size: tuple[int, ...]) -> torch.Tensor:
    view = t
    for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
        if o != 0 or s != size[d]:
            view = view.narrow(d, o, s)
    return view


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (C order), without a copy when it is contiguous."""
    import torch

    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------------------------------- executor


def run_map(task: SourceTask, meta: TensorMeta) -> RunMap:
    """Where each element of ``task``'s source goes among its pieces (expert split and order, see ``plan.py``)."""
    if task.runs is not None:
        return RunMap(task.runs)
    pieces, order = task.pieces, task.expert_order
    numel = meta.numel
    if len(pieces) == 1 and pieces[0].expert is None:
        if order is None:
            return RunMap.identity(numel)
        row = numel // len(order)
        return RunMap([Run(stored * row, row, 0, j * row) for j, stored in enumerate(order)])
    row = numel // meta.size[0]
    runs = []
    for i, p in enumerate(pieces):
        assert p.expert is not None, "split pieces name their expert"
        stored = order[p.expert] if order is not None else p.expert
        part = row // p.nparts
        runs.append(Run(stored * row + p.part * part, part, i, 0))
    return RunMap(runs)


def value_transform(task: SourceTask) -> SlabTransform | None:
    """The value transform of ``task`` (a cast), or ``None`` when the bytes are written as stored."""
    src, out = task.selected.source.dtype, task.pieces[0].dtype
    assert all(p.dtype == out for p in task.pieces), "one output dtype per source"
    return None if src == out else Cast(src, out)


#: The largest slab a row permutation's blocks widen a slab to (a RoPE head: ``head_dim`` rows of a weight).
_MAX_BLOCK_SLAB = 64 << 20
#: Rows up to this many bytes are moved by a row permutation's gather; longer rows are written run by run anyway.
_SMALL_ROW = 1 << 16
# Chunks of at most _SMALL_CHUNK bytes are copied in batches (Executor._copy_small): up to _SMALL_BATCH
# chunks or _SMALL_BATCH_BYTES a task (10^6 one-chunk tensors: docs/performance.md).
_SMALL_CHUNK = 64 << 10
_SMALL_BATCH = 4096
_SMALL_BATCH_BYTES = 4 << 20


class _Bytes:
    """A work unit of direct-task chunks, counted by its ``n`` bytes (read = written) when done."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class _Executor:
    """Runs a plan's tasks on a thread pool, one stored chunk per work unit; bookkeeping in the calling thread only."""

    def __init__(
        self,
        reader: CheckpointReader,
        plan: ExportPlan,
        writers: list[ShardWriter],
        workers: int,
        progress: ProgressFn | None,
        chunks: list[tuple[TensorMeta, list[ChunkMeta]]],
        files: set[int] | None = None,
        merges: dict[str, SlabTransform] | None = None,
        quantizer: BlockQuantizer | None = None,
    ) -> None:
        self.merges = merges or {}
        self.quantizer = quantizer  # quantized tasks: one work unit per band of rows (quantize.py)
        self.reader = reader
        self.files = files  # the output files this process writes (torchrun); None: all
        self.plan = plan
        self.writers = writers
        self.workers = max(1, workers)
        self.progress = progress
        self.total = plan.total_bytes
        self.done = 0
        self.pending: dict[Future[None], int | _Bytes] = {}  # future -> task index, or the bytes of direct chunks
        self.remaining: dict[int, int] = {}
        self.chunks = chunks
        self.bytes_read = 0  # source bytes of finished tasks (counted here, in the calling thread)
        self.slab_bytes = env_slab_bytes()
        self.small: list[tuple[int, SourceTask, ChunkMeta, tuple[int, ...]]] = []  # gathered for _copy_small
        self.small_bytes = 0

    # -- worker side ---------------------------------------------------------------------------
    def _copy_chunk(self, task: SourceTask, chunk: ChunkMeta, size: tuple[int, ...]) -> None:
        """Copy one stored chunk of a direct task to its place in the output file (torch-free when possible)."""
        writer = self.writers[task.shard]
        name = task.pieces[0].name
        span = contiguous_run(size, chunk.offsets, chunk.sizes)
        assert span is not None, "direct tasks have contiguous chunks"
        at = span[0] * DTYPE_ITEMSIZE[task.selected.source.dtype]
        h = writer.new_hasher() if writer.digest is not None else None
        dest = writer.offset(name) + at
        if h is None:
            copied = self.reader.copy_chunk_to_file(task.source_key, chunk, writer.fd, dest)
        else:  # digested as the bytes pass the engine's block buffer
            copied = self.reader.copy_chunk_to_file(task.source_key, chunk, writer.fd, dest, sink=h.update)
            if copied:
                writer.note(name, at, chunk.numel * DTYPE_ITEMSIZE[task.selected.source.dtype], h.hexdigest())
        if not copied:
            writer.write(name, _tensor_bytes(self.reader.read_chunk(task.source_key, chunk)), at)

    def _stream_chunk(
        self, task: SourceTask, chunk: ChunkMeta, meta: TensorMeta, runs: RunMap, transform: SlabTransform | None
    ) -> None:
        """Stream one stored chunk slab by slab into its pieces (cast / split / un-permuted / inner-dim chunks)."""
        writer = self.writers[task.shard]
        names = [p.name for p in task.pieces]

        def write(piece: int, data: memoryview, at: int) -> None:
            writer.write(names[piece], data, at)

        align = meta.size[-1] if meta.size else 1
        slab_bytes = self.slab_bytes
        rows = runs.rows
        if rows is not None and rows.row * meta.dtype.itemsize <= _SMALL_ROW:
            # a permutation of small rows (RoPE q/k): slabs of whole blocks, each gathered and written at once
            align = rows.row * rows.block
            slab_bytes = max(slab_bytes, min(align * meta.dtype.itemsize, _MAX_BLOCK_SLAB))
        stream_chunk(
            self.reader,
            task.source_key,
            chunk,
            meta.size,
            meta.dtype.name,
            runs,
            transform,
            write,
            slab_bytes=slab_bytes,
            align=align,
            # positional writes the native mover makes itself; a digested output takes every write's digest
            targets=None if writer.digest is not None else [(writer.fd, writer.offset(n)) for n in names],
        )

    def _copy_small(self, batch: list[tuple[int, SourceTask, ChunkMeta, tuple[int, ...]]]) -> None:
        """Copy many small stored chunks of direct tasks: one read per run of neighbouring archives, one write per run.

        The chunks' values come from :meth:`~ckpttool.format.reader.CheckpointReader.read_small_chunks`
        (located and CRC-checked as :meth:`_copy_chunk` does); values that land next to each other in
        the same output file are written together. Chunks that path does not take go through
        :meth:`_copy_chunk`.
        """
        got = self.reader.read_small_chunks([(task.selected.source.key, c) for _, task, c, _ in batch])
        run_fd, run_at, run = -1, 0, bytearray()
        writers = self.writers
        for (_, task, chunk, size), values in zip(batch, got):
            if values is None:
                self._copy_chunk(task, chunk, size)
                continue
            writer = writers[task.shard]
            name = task.pieces[0].name
            if chunk.sizes is size or chunk.sizes == size:  # the whole tensor
                at = 0
            else:
                span = contiguous_run(size, chunk.offsets, chunk.sizes)
                assert span is not None, "direct tasks have contiguous chunks"
                at = span[0] * DTYPE_ITEMSIZE[task.selected.source.dtype]
            if writer.digest is not None:
                h = writer.new_hasher()
                h.update(values)
                writer.note(name, at, len(values), h.hexdigest())
            dest = writer.data_start + writer.spans[name][0] + at  # writer.offset(name), inlined (per chunk)
            if writer.fd != run_fd or dest != run_at + len(run):
                if run:
                    write_all(run_fd, run, run_at)
                run_fd, run_at, run = writer.fd, dest, bytearray()
            run += values
        if run:
            write_all(run_fd, run, run_at)

    # -- calling-thread side ---------------------------------------------------------------------
    def _collect(self, block: bool) -> None:
        if not self.pending:
            return
        done, _ = wait(list(self.pending), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        if any(not fut.cancelled() and fut.exception() is not None for fut in done):
            raise self._earliest_error(done)
        for fut in done:
            what = self.pending.pop(fut)
            if isinstance(what, _Bytes):  # chunks of direct tasks: source bytes = output bytes
                self.bytes_read += what.n
                self.done += what.n
                if self.progress is not None:
                    self.progress(self.done, self.total)
            else:
                self._chunk_done(what)

    def _earliest_error(self, done: set[Future[None]]) -> BaseException:
        """The error of the earliest submitted work unit that fails, whichever failed first in time.

        The units submitted before the first failed one of ``done`` are waited for (the later ones are
        cancelled by :meth:`run`): units are submitted in plan order, so the tensor an export names is
        the same at every run and worker count (two tensors with a NaN: always the first in the plan).
        """
        for fut in self.pending:  # insertion order: submission order
            if not fut.cancelled():
                err = wait_exception(fut)  # waits for a unit still running
                if err is not None:
                    return err
        raise AssertionError("a failed work unit is pending")

    def _chunk_done(self, idx: int) -> None:
        """Count one finished chunk of task ``idx`` (its bytes and the progress once the task is complete)."""
        self.remaining[idx] -= 1
        if self.remaining[idx] == 0:
            task = self.plan.tasks[idx]
            meta, chunks = self.chunks[idx]
            self.bytes_read += sum(c.numel for c in chunks) * meta.dtype.itemsize
            self.done += task.out_nbytes
            if self.progress is not None:
                self.progress(self.done, self.total)

    def _submit(self, pool: Lane, idx: int | _Bytes, fn: Callable[..., None], *args: Any) -> None:
        while len(self.pending) >= self.workers * 4:
            self._collect(block=True)
        self.pending[pool.submit(fn, *args)] = idx

    def _flush_small(self, pool: Lane) -> None:
        """Submit the small chunks gathered so far as one task (:meth:`_copy_small`)."""
        if self.small:
            batch, nbytes, self.small, self.small_bytes = self.small, self.small_bytes, [], 0
            self._submit(pool, _Bytes(nbytes), self._copy_small, batch)

    def _direct(self, pool: Lane, idx: int, task: SourceTask, meta: TensorMeta, chunks: list[ChunkMeta]) -> None:
        """Copy a direct task's chunks: each large one a work unit, the small ones gathered into batches.

        A direct task writes each chunk's bytes as read, so its progress is counted in bytes as each
        chunk (or batch) is done (:class:`_Bytes`), with no per-task bookkeeping.
        """
        itemsize = meta.dtype.itemsize
        for c in chunks:
            nbytes = c.numel * itemsize
            if nbytes > _SMALL_CHUNK:
                self._submit(pool, _Bytes(nbytes), self._copy_chunk, task, c, meta.size)
                continue
            self.small.append((idx, task, c, meta.size))  # batched: _copy_small
            self.small_bytes += nbytes
            if len(self.small) >= _SMALL_BATCH or self.small_bytes >= _SMALL_BATCH_BYTES:
                self._flush_small(pool)

    def _dispatch(self, pool: Lane, idx: int, task: SourceTask, meta: TensorMeta, chunks: list[ChunkMeta]) -> None:
        """Submit task ``idx``'s work: quantized bands, direct chunk copies, or streamed chunks."""
        if not chunks:
            self.remaining[idx] = 1
            self.pending[pool.submit(lambda: None)] = idx
            return
        q = self.quantizer
        if q is not None and task.source_key in q.tasks:
            self.remaining[idx] = q.bands(task)
            for b in range(q.bands(task)):
                self._submit(pool, idx, q.band, task, meta, chunks, self.writers[task.shard], b)
        elif task.direct and (
            (len(chunks) == 1 and chunks[0].sizes == meta.size)  # one whole chunk: most tensors at 10^6
            or all(c.sizes == meta.size or contiguous_run(meta.size, c.offsets, c.sizes) is not None for c in chunks)
        ):
            self._direct(pool, idx, task, meta, chunks)
        else:
            self.remaining[idx] = len(chunks)
            runs = run_map(task, meta)
            transform = self.merges.get(task.source_key) or value_transform(task)
            for c in chunks:
                self._submit(pool, idx, self._stream_chunk, task, c, meta, runs, transform)

    def run(self, only: set[int] | None = None) -> None:
        """Run the tasks of this process's files (``only``: those of these task indices)."""
        pool = Lane(self.workers)
        # tasks of one layout share their (meta, chunks) pair (_checked_chunks): whether it is one whole
        # small chunk, and its bytes, are worked out once per run of such tasks
        last: object = None
        small_whole = 0
        try:
            for idx, task in enumerate(self.plan.tasks):
                if (self.files is not None and task.shard not in self.files) or (only is not None and idx not in only):
                    continue
                pair = self.chunks[idx]
                if pair is not last:
                    last, small_whole = pair, _small_whole(*pair)
                if (
                    small_whole
                    and task.direct
                    and (self.quantizer is None or task.source_key not in self.quantizer.tasks)
                ):
                    self.small.append((idx, task, pair[1][0], pair[0].size))  # batched: _copy_small
                    self.small_bytes += small_whole
                    if len(self.small) >= _SMALL_BATCH or self.small_bytes >= _SMALL_BATCH_BYTES:
                        self._flush_small(pool)
                else:
                    self._dispatch(pool, idx, task, *pair)
                if not idx % 64:  # progress, and a worker's error early (_submit collects when the queue is full)
                    self._collect(block=False)
            self._flush_small(pool)
            while self.pending:
                self._collect(block=True)
        finally:
            for fut in self.pending:
                fut.cancel()
            # Deferred: a second Ctrl-C must not close the output files under a running copy.
            with signals_deferred():
                pool.shutdown()
            self.pending.clear()


def _small_whole(meta: TensorMeta, chunks: list[ChunkMeta]) -> int:
    """The bytes of a tensor stored as one whole chunk of at most ``_SMALL_CHUNK`` bytes (``0``: not one)."""
    if len(chunks) != 1 or chunks[0].sizes != meta.size:
        return 0
    nbytes = chunks[0].numel * meta.dtype.itemsize
    return nbytes if 0 < nbytes <= _SMALL_CHUNK else 0


def _run_batches(reader: CheckpointReader, plan: ExportPlan, mine: set[int], executor: _Executor) -> None:
    """Run this rank's tasks: a remote checkpoint's windows by parallel range requests, in batches that
    bound the spool (each batch fetched, written, then evicted); a local one's as one batch."""
    for batch, done_keys in _spool_batches(reader, plan, mine):
        reader.prefetch_keys(plan.tasks[i].source_key for i in batch)
        executor.run(set(batch))
        reader.evict(reader.storage_info(k, c) for k in done_keys for c in reader.tensor_meta(k).chunks if c.numel)


@contextlib.contextmanager
def _one_torch_thread(on: bool) -> Iterator[None]:
    """One torch intra-op thread per engine worker while ``on`` (a quantized export's torch band kernels)."""
    if not on:
        yield
        return
    from ckpttool.engine.fp8 import torch_threads

    with torch_threads(1):
        yield


def _read_whole(reader: CheckpointReader, key: str) -> torch.Tensor:
    """A source tensor assembled from its (deduplicated) chunks."""
    import torch

    meta, chunks = _dedup_chunks(reader, key)
    out = torch.empty(meta.size, dtype=meta.dtype.to_torch())
    for c in chunks:
        reader.read_chunk(key, c, out=_narrow(out, c, meta.size))
    return out


# ---------------------------------------------------------------------------------------------- main entry


def _tied_pair(
    selected: list[Selected], rules: ExportRules, config: dict[str, Any] | None
) -> tuple[Selected | None, Selected | None, bool]:
    tie = tie_word_embeddings(config) is True
    # the last selected tensor of each output key (as a dict keyed by out_key would keep), by a C-level search
    out_keys = [s.out_key for s in selected]
    out_keys.reverse()
    found: list[Selected | None] = []
    names = set(out_keys)
    embedding = rules.tied_embedding_in(names)
    if tie and embedding is None and config is not None:
        embedding = _tied_embedding_of_class(names, rules, config)
    for name in (embedding, rules.tied_lm_head):
        try:
            found.append(None if name is None else selected[len(selected) - 1 - out_keys.index(name)])
        except ValueError:
            found.append(None)
    return found[0], found[1], tie


def _tied_embedding_of_class(names: set[str], rules: ExportRules, config: dict[str, Any]) -> str | None:
    """The one embedding of ``rules.tied_embeddings`` among ``names`` that the config's model class holds, where
    ``names`` holds several (a tied head is tied to its class's own, what ``from_pretrained`` loads); ``None`` when
    ``names`` holds none.

    Raises:
        ExportError (E601): several, and the model class does not tell which (it holds several, or none, or
            transformers cannot build it): writing both and the head would load an untied model's logits.
    """
    present = [k for k in rules.tied_embeddings if k in names]
    if len(present) < 2:
        return None
    from ckpttool.ops.export.expected import check_config_bounds, expected_state_dict

    check_config_bounds(config, len(names))
    got = expected_state_dict(config)
    own = [k for k in present if not isinstance(got, str) and k in got.tensors]
    if len(own) == 1:
        return own[0]
    why = got if isinstance(got, str) else f"{got.model_class} holds {len(own) or 'none'} of them"
    raise ExportError(
        f"config.json says tie_word_embeddings: true and the export holds {len(present)} embeddings the head may be "
        f"tied to ({', '.join(present)}); which one is not known ({why})",
        fqn=present[0],
        hint="name it in a `rules` FILE.yaml: tied_embeddings: {embedding: <key>, lm_head: lm_head.weight} "
        "(docs/export.md, 'Tied embeddings'), or leave the other out with `filter_glob`",
    )


def _check_options(opts: ExportOptions) -> None:
    out_format = get_format(opts.fmt)
    if opts.save_dtype not in SAVE_DTYPES:
        raise UsageError(f"`save_dtype` {opts.save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}", param="save_dtype")
    if opts.weights not in (None, "params", "master", "auto"):
        raise UsageError(f"`weights` {opts.weights!r} is not one of params, master, auto", param="weights")
    if opts.quantize is not None:
        _quant_spec(opts).check(opts.fmt)
    else:  # an FP8 setting alone would be ignored: the export would succeed in full precision
        given = [
            name
            for name, value, default in (
                ("quant_format", opts.quant_format, "fp8"),
                ("quantize_block", opts.quantize_block, 128),
                ("quantize_skip", tuple(opts.quantize_skip), ()),
            )
            if value != default
        ]
        if given:
            raise UsageError(
                f"`{given[0]}` is given without `quantize`: nothing would be quantized",
                param=given[0],
                hint=f"add `quantize` fp8-block (or fp8-channel) for FP8 weights, or drop `{given[0]}`",
            )
    check_lora_alpha(opts.lora_alpha)
    check_algorithm(opts.algorithm)  # of the source identity and the manifest: a dry run refuses it too
    if not out_format.reads_adapter_config:  # a LoRA setting alone would be ignored: a plain export, silently
        lora = [name for name in ("lora_alpha", "adapter_config") if getattr(opts, name) is not None]
        if lora:
            raise UsageError(
                f"`{lora[0]}` is given with `fmt` {opts.fmt}, which writes no LoRA adapter: it would be ignored",
                param=lora[0],
                hint=f"use `fmt` lora (a PEFT adapter) or hf-merged (the LoRA merged into the weights), "
                f"or drop `{lora[0]}`",
            )
    if opts.experts not in (None, "fused", "per-expert"):
        raise UsageError(f"`experts` {opts.experts!r} is not one of fused, per-expert", param="experts")
    if isinstance(opts.shard_size, bool) or not isinstance(opts.shard_size, int) or opts.shard_size <= 0:
        raise UsageError(
            f"`shard_size` must be a positive number of bytes, got {opts.shard_size!r}",
            param="shard_size",
            hint="e.g. 5GB (5*10^9 bytes)",
        )
    bad = [k for k in opts.allow_mismatch if k not in MISMATCH_KINDS]
    if bad:
        import difflib

        close = difflib.get_close_matches(bad[0], MISMATCH_KINDS, n=1)
        raise UsageError(
            f"`allow_mismatch` {bad[0]!r} is not one of {', '.join(MISMATCH_KINDS)}",
            param="allow_mismatch",
            hint=(f"did you mean {close[0]!r}? " if close else "")
            + f"give a comma list of {', '.join(MISMATCH_KINDS)}, e.g. `allow_mismatch` shape,dtype",
        )
    out_format.check_options(_experts(opts))


def _experts(opts: ExportOptions) -> str:
    """``experts`` as the export applies it: ``None`` is ``per-expert`` with ``quantize`` (fused FP8 experts load
    only in transformers' GPU ``FP8Experts``: vLLM and torch's reader refuse them, transformers' CPU path
    drops their scales), else ``fused``."""
    if opts.experts is not None:
        return opts.experts
    return "per-expert" if opts.quantize is not None else "fused"


def _expert_rule_keys(selected: list[Selected], rules: ExportRules) -> list[str]:
    """The output keys of the selected tensors an ``experts`` rule matches (fused ``[E, out, in]`` experts), but
    those a model adapter writes as fused experts itself (:attr:`~ckpttool.model.adapters.base.HFTensor.fused_experts`)."""
    if not any(len(s.source.shape) > 2 for s in selected):  # no [E, out, in] weight: no regex over 10^6 dense keys
        return []
    return [s.out_key for s in selected if (s.hf is None or not s.hf.fused_experts) and rules.expert_rule(s.out_key)]


def _fused_experts_note(
    selected: list[Selected],
    rules: ExportRules,
    opts: ExportOptions,
    out_format: OutputFormat,
    stored: Mapping[str, TensorEntry],
) -> tuple[str, ...]:
    """The note of a default (``experts`` not given) export that writes fused expert tensors an ``experts`` rule
    could split: transformers >= 5 loads them, but ``save_pretrained`` of a fresh model, vLLM's MoE loaders and
    transformers 4.x use the per-expert names. Experts stored transposed (gpt-oss, Llama4), which a per-expert
    split refuses, are their family's own fused form: no note (a half not selected is looked up in ``stored``)."""
    if opts.experts is not None or _experts(opts) != "fused" or not out_format.ties_embeddings:
        return ()
    transposed = transposed_expert_keys(selected, stored)
    fused = [k for k in _expert_rule_keys(selected, rules) if k not in transposed]
    if not fused:
        return ()
    return (
        f"{len(fused)} fused expert tensor(s) written as stored (e.g. {fused[0]}), the layout transformers >= 5 "
        "loads; save_pretrained, vLLM's MoE loaders and transformers 4.x use per-expert names "
        "(experts.N.gate_proj.weight, ...): `experts` per-expert writes those",
    )


def _per_expert_names_note(
    selected: list[Selected], rules: ExportRules, opts: ExportOptions, model_config: dict[str, Any] | None
) -> tuple[str, ...]:
    """The note of a per-expert split without a ``config.json`` (no ``model_type``, the default rules): the pieces
    take the ``gate_proj``/``up_proj``/``down_proj`` names, which transformers' loader fuses back for Qwen3-MoE but
    not for the Mixtral family, whose per-expert names are its own (``block_sparse_moe.experts.N.w1``)."""
    if model_config or opts.rules is not None or _experts(opts) != "per-expert":
        return ()
    split = _expert_rule_keys(selected, rules)
    if not split:
        return ()
    return (
        f"{len(split)} fused expert tensor(s) split per expert (e.g. {split[0]}) with the names transformers' "
        "Qwen3-MoE loader reads (experts.N.gate_proj.weight, ...): without a config.json the model's family "
        "is not known; a Mixtral (MiniMax, PhiMoE) loader reads block_sparse_moe.experts.N.w1/w3/w2.weight and "
        "leaves these experts unloaded: pass `model_assets` with the model's config.json",
    )


def _resolved_experts(opts: ExportOptions, selected: list[Selected]) -> ExportOptions:
    """``opts`` with ``experts`` ``None`` resolved (:func:`_experts`), ``fused`` where a model adapter writes fused
    expert tensors of its own (megatron's stacked experts: split only when ``experts`` per-expert is asked for)."""
    if opts.experts is not None:
        return opts
    experts = _experts(opts)
    if experts == "per-expert" and any(x.hf is not None and x.hf.fused_experts for x in selected):
        experts = "fused"
    return dataclasses.replace(opts, experts=experts)


def _quant_spec(opts: ExportOptions) -> QuantSpec:
    from ckpttool.ops.export.quantize import QuantSpec  # imported by quantized exports only (start-up)

    assert opts.quantize is not None
    return QuantSpec(opts.quantize, opts.quantize_block, opts.quantize_skip, opts.quant_format)


def _output_format(opts: ExportOptions) -> OutputFormat:
    """``opts.fmt``'s registered format, wrapped by :class:`QuantizedFormat` when ``opts.quantize`` asks (one per export)."""
    base = get_format(opts.fmt)
    if opts.quantize is None:
        return base
    from ckpttool.ops.export.quantize import QuantizedFormat

    return QuantizedFormat(base, _quant_spec(opts))


def _resolved(opts: ExportOptions, ckpt: Checkpoint) -> ExportOptions:
    """``weights`` ``None`` / ``auto`` resolved (``master`` when any parameter has a ``master_weight``); ``save_dtype``
    ``preserve`` is ``bfloat16`` for the tensors a quantized export leaves unquantized (``experts`` ``None`` is
    resolved by :func:`_prepare`, which knows whether a model adapter writes fused experts of its own)."""
    weights, save_dtype = opts.weights or ("auto" if opts.quantize is not None else "params"), opts.save_dtype
    if weights == "auto":
        states = ckpt.catalog.optimizer_state.values()
        weights = "master" if any("master_weight" in ps.fields for ps in states) else "params"
    if opts.quantize is not None and save_dtype == "preserve":
        save_dtype = "bfloat16"
    if (weights, save_dtype) == (opts.weights, opts.save_dtype):
        return opts
    return dataclasses.replace(opts, weights=weights, save_dtype=save_dtype)


def masters_note(ckpt: Checkpoint, r: ExportResult) -> str | None:
    """The note said once when an ``hf`` export of the stored parameters (``weights`` ``params``) left FP32
    ``master_weight`` copies of exported parameters behind; ``None`` when it did not.

    Args:
        ckpt: the exported checkpoint (its catalog's optimizer state and layout record's optimizer type).
        r: the export's result.

    Returns:
        One line naming how many parameters have a master, the declared optimizer type, the stored
        dtypes exported and the flags that export the masters instead.
    """
    if r.weights != "params" or r.format != "hf":
        return None
    exported = set(r.origins.get("params", []))
    if not exported:
        return None
    with_master = [
        fqn for fqn, ps in ckpt.catalog.optimizer_state.items() if "master_weight" in ps.fields and ps.in_model
    ]
    if not with_master:
        return None
    record = ckpt.layout.record if ckpt.layout is not None else None
    declared = (record.optimizer or {}).get("type") if record is not None else None
    dtypes = sorted({e.dtype for e in map(ckpt.catalog.model_entry, with_master) if e is not None})
    return (
        f"{len(with_master)} parameter(s) also have an FP32 optimizer master_weight"
        + (f" ({declared})" if declared else "")
        + f"; this export holds the stored {'/'.join(dtypes) or 'parameter'} values; "
        "export the FP32 masters with --weights master (add --save-dtype bf16 to cast them)"
    )


def export_checkpoint(
    source: CheckpointOrPath, out: str | os.PathLike[str], options: ExportOptions | None = None, **hooks: Unpack[Hooks]
) -> ExportResult:
    """Export a DCP checkpoint's model weights as Hugging Face safetensors or a PEFT LoRA adapter.

    Args:
        source: an opened :class:`~ckpttool.model.checkpoint.Checkpoint`, or its path/URL
            (never modified), opened with ``opening``.
        out: output directory; written beside itself and renamed when complete.
        options: see :class:`ExportOptions`.
        progress: ``progress(done_bytes, total_bytes)`` callback, first called once the total is known.
        phase: ``phase(text)`` as each step starts (:data:`PhaseFn`).

    Returns:
        :class:`ExportResult` (``seconds``: the whole export; ``write_seconds``: the writing phase).

    Raises:
        UsageError: bad options, unreadable ``rules`` / ``model_assets`` / ``adapter_config``.
        OutputError: ``out`` exists non-empty (no ``overwrite``), overlaps the source, or cannot be written.
        ExportError: nothing to export, missing masters, tied embeddings that differ, expert counts that
            disagree, undecidable key mapping.
        LayoutError: an undeclared ambiguous EP layout (E405), conflicting records (E403/E404).
        plus the reader's errors for damaged checkpoints (E2xx/E3xx).
    """
    check_path(out, "out")
    opening, progress, phase = hooks_of("export_checkpoint", hooks)
    opts = options_of(options, ExportOptions)
    _check_options(opts)
    model_config = _read_model_config(opts.model_assets)
    mt = model_config.get("model_type") if model_config is not None else None
    rules = load_rules(opts.rules, mt if isinstance(mt, str) else None)
    given_adapter = None
    if get_format(opts.fmt).reads_adapter_config:
        if opts.adapter_config is not None:
            given_adapter = read_adapter_config(Path(opts.adapter_config))
        elif opts.model_assets is not None and os.path.lexists(Path(opts.model_assets) / "adapter_config.json"):
            # as every `model_assets` file: a symlink leaving the folder is E101, a FIFO or folder E102 (not skipped)
            assets = Path(opts.model_assets)
            given_adapter = read_adapter_config(
                resolve_inside(assets, "adapter_config.json", what="`model_assets` file")
            )
    if given_adapter is not None and opts.lora_alpha is not None and given_adapter.get("alpha_pattern"):
        # `lora` would keep the pattern (PEFT applies it over lora_alpha), a merge would not: refused, not guessed
        raise UsageError(
            f"`lora_alpha` is given with an adapter config that has an alpha_pattern "
            f"({short_repr(given_adapter['alpha_pattern'])}): which alpha applies to those modules is ambiguous",
            param="lora_alpha",
            hint="drop `lora_alpha` (the config's lora_alpha and alpha_pattern apply, as in PEFT), or edit the config",
        )
    given = _Given(rules, model_config, given_adapter)
    # the open's objects stay out of the cyclic GC until the export ends (frozen for the writes: gc_held)
    with gc_held() as resume_frozen, open_source(source, opening) as ckpt:
        return _export(ckpt, output_location(out), opts, given, progress, resume_frozen, phase)


@dataclass(frozen=True)
class _Given:
    """What the export's input files held, read before the checkpoint is opened: the key rules
    (``rules``), ``config.json`` of ``model_assets`` and a given ``adapter_config.json``."""

    rules: ExportRules
    model_config: dict[str, Any] | None
    adapter: dict[str, Any] | None


@dataclass(frozen=True)
class _Prepared:
    """What an export decided before any output exists (:func:`_prepare`).

    Attributes:
        embed, lm_head: the tied pair's selections (``tied`` ``"omitted"``: compared after the writes).
        adapter: the format's prepared document (``adapter_config.json`` of a LoRA export).
        merges: source key -> the value transform replacing its cast (LoRA merges).
        chunks: each task's checked chunks, in task order.
        config: the ``config.json`` written (``serving.serving_config``) and its edits, ``None``
            when none is copied.
        notes: facts worth a ``note:`` line (no tokenizer among the assets).
        config_beside: the folder of a ``config.json`` the trainer saved beside the checkpoint, when the
            export writes none (a model format without ``model_assets``).
        experts: ``experts`` as planned (``None`` resolved: :func:`_resolved_experts`).
    """

    plan: ExportPlan
    model_adapter: ModelAdapter | None
    orders: dict[str, tuple[int, ...]]
    tied: str | None
    embed: Selected | None
    lm_head: Selected | None
    adapter: dict[str, Any] | None
    assets: list[tuple[str, Path]]
    check: ModelCheck | None
    merges: dict[str, SlabTransform]
    chunks: list[tuple[TensorMeta, list[ChunkMeta]]]
    model_config: dict[str, Any] | None
    config: tuple[bytes, dict[str, list[Any]]] | None = None
    notes: tuple[str, ...] = ()
    quantizer: BlockQuantizer | None = None
    config_beside: str | None = None
    experts: str = "fused"


def _serving_assets(
    opts: ExportOptions,
    out_format: OutputFormat,
    plan: ExportPlan,
    assets: list[tuple[str, Path]],
    pair: tuple[Selected | None, Selected | None],
    model_config: dict[str, Any] | None,
    check: ModelCheck | None = None,
) -> tuple[tuple[bytes, dict[str, list[Any]]] | None, tuple[str, ...]]:
    """The ``config.json`` to write beside the weights (``ckpttool.ops.export.serving``) and the notes on the
    assets, for a model format (``hf``, ``hf-merged``) given ``--model-assets`` (``check``: the model class
    check, whose class a config without ``architectures`` gets, also where ``--allow-mismatch`` let findings
    through: that is the class the export was accepted for)."""
    from ckpttool.ops.export.serving import (
        PACKED_DTYPES,
        dominant_dtype,
        rounded_on_load,
        serving_config,
        tokenizer_note,
    )

    if opts.model_assets is None or not out_format.ties_embeddings:
        return None, ()
    notes = tuple(n for n in [tokenizer_note((name for name, _ in assets), str(opts.model_assets))] if n)
    path = next((p for name, p in assets if name == "config.json"), None)
    if path is None:
        return None, notes
    edited = out_format.edited_assets(model_config)
    data = edited.get("config.json") or read_regular(path, limits.current().max_object_bytes, what="config.json")
    names = {e.name for entries in plan.entries for e in entries}
    embed, lm_head = pair
    dtype = dominant_dtype(e for entries in plan.entries for e in entries)
    rounded = rounded_on_load(dtype, (e for entries in plan.entries for e in entries))
    if rounded:
        notes += (rounded,)
    config = serving_config(
        data,
        str(path),
        dtype=dtype,
        lm_head_written=lm_head is not None and lm_head.out_key in names,
        embedding_written=embed is not None and embed.out_key in names,
        architecture=check.model_class if check is not None and check.checked else None,
        filtered=bool(plan.skipped.get(SKIP_FILTERED)),
        quantized_written=any(
            e.dtype.startswith("float8_") or e.dtype in PACKED_DTYPES for entries in plan.entries for e in entries
        ),
    )
    return config, notes


def _select(
    ckpt: Checkpoint,
    out_format: OutputFormat,
    opts: ExportOptions,
    rules: ExportRules,
    model_config: dict[str, Any] | None,
    peft_config: dict[str, Any] | None = None,
) -> tuple[ModelAdapter | None, list[Selected], list[str], dict[str, list[str]]]:
    """The model adapter and the format's selection: ``(adapter, selected, warnings, skipped)``.

    Raises:
        ExportError: nothing selected, the format's refusals (:meth:`OutputFormat.check_selection`), a cast or
            `quantize` of weights stored quantized (:func:`check_quantized_sources`).
    """
    cat = ckpt.catalog
    assert opts.weights is not None, "resolved by _resolved"
    model_adapter = export_adapter(cat, opts, model_config)
    selected, warnings, skipped, tags = select_sources(
        cat,
        rules,
        fmt=opts.fmt,
        weights=opts.weights,
        filter_glob=opts.filter_glob,
        adapter=model_adapter,
        adapter_config=AdapterConfig.from_hf_config(model_config),
        peft_config=peft_config,
        model_config=model_config if out_format.checks_model_class else None,
    )
    if not selected:
        per_expert = opts.filter_glob is not None and _experts(opts) == "per-expert"
        raise ExportError(
            f"{ckpt.path}: no {out_format.tensors_noun} to export"
            + (f" (`filter_glob` {opts.filter_glob!r} matched none)" if opts.filter_glob else ""),
            param="filter_glob" if opts.filter_glob else None,
            hint=_bare_glob_hint(cat, opts.filter_glob)
            or (opts.filter_glob and ckpt.catalog.state_only_hint((opts.filter_glob,)))
            or "check the keys with `ckpttool inspect`"
            + (" and the `filter_glob` glob" if opts.filter_glob else "")
            + (
                "; it is matched against the checkpoint's tensors, before fused experts are split: a fused tensor "
                "is selected by its own name (e.g. '*.layers.0.mlp.experts.*'), not by a per-expert name "
                "('*.experts.0.*'), and is written whole"
                if per_expert
                else ""
            ),
        )
    out_format.check_selection(cat, tags, warnings)
    check_quantized_sources(
        str(ckpt.path), selected, opts.save_dtype, opts.quantize, opts.experts or _experts(opts), cat.model
    )
    # a schema override that keeps a wrapper's prefix; validate's R001 (the run's newest save did not finish)
    warnings.extend(w for w in (_wrapper_kept(ckpt, selected), ckpt.located.newer_incomplete_note("exported")) if w)
    return model_adapter, selected, warnings, skipped


def _wrapper_kept(ckpt: Checkpoint, selected: list[Selected]) -> str | None:
    """The warning for a key schema given by the user that reads the model above where detection finds it, so
    that every key written keeps the wrapper's prefix (``--schema torchtitan`` on ``{"model": hf_model.state_dict()}``:
    ``model.model.embed_tokens.weight``, which transformers does not load); ``None`` otherwise."""
    given = ckpt.catalog.schema
    if given.source != "override" or given.model_prefix is None:
        return None
    try:
        found = detect_schema(ckpt.metadata)
    except CkptError:
        return None
    prefix = found.model_prefix
    if prefix is None or prefix == given.model_prefix or not prefix.startswith(given.model_prefix):
        return None
    kept = prefix[len(given.model_prefix) :]
    if not all(s.out_key.startswith(kept) for s in selected):
        return None  # loose keys beside the detected prefix: the user's reading may well be the right one
    shown = ", ".join(s.out_key for s in selected[:2])
    return (
        f"the key schema given ({given.id}: model keys {f'under {given.model_prefix!r}' if given.model_prefix else 'at the top level'}) "
        f"differs from the detected one ({found.id}: model under {prefix!r}): every key written starts with "
        f"{kept!r} ({shown}{', ...' if len(selected) > 2 else ''}), a wrapper's prefix that transformers' "
        f"from_pretrained does not load; leave out the override (`schema`, `model_prefix`), or give `model_prefix` "
        f"{prefix!r}, to write the model's own names"
    )


def _tied(
    selected: list[Selected], rules: ExportRules, config: dict[str, Any] | None, out_format: OutputFormat
) -> tuple[Selected | None, Selected | None, str | None, set[str]]:
    """``(embedding, lm_head, tied, drop)``: how ``tie_word_embeddings`` applies (``drop``: output keys left out)."""
    embed, lm_head, tie = _tied_pair(selected, rules, config) if out_format.ties_embeddings else (None, None, False)
    drop: set[str] = set()
    tied: str | None = None
    if tie and embed is not None and lm_head is not None and lm_head.origin == "master" and embed.origin != "master":
        # one tied parameter, its FP32 master kept under the lm_head's fqn: the embedding written is that master
        # (_check_tied compares the two stored parameters, which must be the same tensor)
        at = next(i for i, x in enumerate(selected) if x is embed)
        embed = selected[at] = dataclasses.replace(embed, source=lm_head.source, origin="master")
    if tie and lm_head is not None and lm_head.merge is not None:
        # the merged lm_head (W + s * B @ A) is no longer the embedding W it is tied to: omitted, the merge is lost
        raise ExportError(
            f"{lm_head.model_key}: a LoRA adapter is merged into the lm_head but config.json says "
            "tie_word_embeddings: true, so the merged lm_head would be left out (tied to the unmerged embedding)",
            fqn=lm_head.model_key,
            hint="set tie_word_embeddings to false in the `model_assets` config.json to write the merged lm_head "
            "beside the embedding (the trained model's logits), or export the adapter with `fmt` lora",
        )
    if tie and embed is not None and embed.merge is not None:
        # the trained model's head is the unmerged embedding; the merged one, tied, would be the head as well
        raise ExportError(
            f"{embed.model_key}: a LoRA adapter is merged into the embedding but config.json says "
            "tie_word_embeddings: true, so the output head would be the merged embedding (the trained model's is the "
            "unmerged one)",
            fqn=embed.model_key,
            hint="export the adapter with `fmt` lora",
        )
    if tie:
        if lm_head is None:
            tied = "absent"
        elif embed is not None:
            drop.add(lm_head.out_key)
            tied = "omitted"
        else:
            tied = "embedding-not-exported"
    return embed, lm_head, tied, drop


def _prepare(
    ckpt: Checkpoint,
    layout: ResolvedLayout,
    out_format: OutputFormat,
    opts: ExportOptions,
    given: _Given,
    say: PhaseFn,
) -> _Prepared:
    """Select, plan and check everything an export can check before it writes (no output exists yet).

    Raises:
        ExportError / ExportAccountingError / ModelMismatchError / UsageError: see :func:`export_checkpoint`.
    """
    reader, cat, rules, model_config = ckpt.reader, ckpt.catalog, given.rules, given.model_config
    model_adapter, selected, warnings, skipped = _select(ckpt, out_format, opts, rules, model_config, given.adapter)
    fused_note = _fused_experts_note(selected, rules, opts, out_format, cat.tensors)  # before `experts` is resolved
    fused_note += _per_expert_names_note(selected, rules, opts, model_config)
    opts = _resolved_experts(opts, selected)
    check_trainable_dtypes(str(ckpt.path), cat, selected)
    orders = _expert_orders(cat, layout, selected)
    embed, lm_head, tied, drop = _tied(selected, rules, model_config, out_format)
    plan = build_plan(
        selected,
        rules,
        **same_named(opts, "fmt", "save_dtype", "shard_size", "experts"),
        expert_orders=orders,
        num_experts=rules.num_experts_from_config(model_config) if model_config else None,
        drop=drop,
        out_format=out_format,
        stored=cat.tensors,
    )
    quantizer = _quantizer(reader, plan, opts, out_format, warnings, model_config)
    plan.warnings, plan.skipped, plan.tied = warnings, skipped, tied
    missing = unaccounted_tensors(cat, plan, {s.model_key for s in selected if s.out_key in drop} if drop else set())
    if missing:
        raise ExportAccountingError(
            f"{ckpt.path}: {len(missing)} tensor(s) would be neither exported nor listed as skipped "
            f"(e.g. {missing[0]!r})",
            fqn=missing[0],
        )
    if log.isEnabledFor(logging.INFO):  # the totals walk every task: only when shown
        _log_plan(plan, opts, orders, tied, skipped)
    beside = _adapter_config_beside(ckpt, out_format, given.adapter)  # named by the E601 asking for lora_alpha
    request = PrepareRequest(plan, cat, reader, given.adapter, opts.lora_alpha, model_config, beside)
    adapter = out_format.prepare(request)
    assets = _asset_files(Path(opts.model_assets), out_format) if opts.model_assets is not None else []
    check = _model_check(ckpt, plan, model_config, opts, out_format, say)
    merges = out_format.transforms(request)
    if quantizer is not None:  # a merged weight that is quantized: its delta is added to each band (quantize.py)
        quantizer.merges = {k: m for k, m in merges.items() if k in quantizer.tasks}
    config, notes = _serving_assets(opts, out_format, plan, assets, (embed, lm_head), model_config, check)
    warnings.extend(w for w in [quantizer is None and _unconfigured_fp8(plan, config, opts)] if w)
    say("checking chunks")  # every source's chunks tile it and fit their stored bytes, before any output exists
    chunks = _checked_chunks(reader, [t.selected.source.key for t in plan.tasks])
    if quantizer is not None and quantizer.other_sources:  # a fused piece's band reads its later sources' rows
        quantizer.sources = {
            t.source_key: c for t, c in zip(plan.tasks, chunks) if t.source_key in quantizer.other_sources
        }
    return _Prepared(
        plan,
        model_adapter,
        orders,
        tied,
        embed,
        lm_head,
        adapter,
        assets,
        check,
        merges,
        chunks,
        model_config,
        config,
        tuple(n for n in [ckpt.located.chosen_note()] if n) + notes + fused_note + _extra_state_note(ckpt.catalog),
        quantizer,
        _config_beside(ckpt, opts, out_format),
        opts.experts or "fused",
    )


def _extra_state_note(cat: Catalog) -> tuple[str, ...]:
    """A note naming the modules' ``_extra_state`` items the export leaves out (Megatron's Transformer Engine
    layers save one per module and shard: FP8 scaling state, no weights), which were left out without a word."""
    keys = [k for k in cat.byte_items if k.rsplit(".", 1)[-1].split("/", 1)[0] == "_extra_state"]
    if not keys:
        return ()
    return (
        f"{len(keys)} module _extra_state item(s) not exported (e.g. {keys[0]}): a module's extra state "
        "(Transformer Engine keeps its FP8 scaling state there), not weights; the HF files hold weights only",
    )


def _expert_orders(cat: Catalog, layout: ResolvedLayout, selected: list[Selected]) -> dict[str, tuple[int, ...]]:
    """:func:`~ckpttool.ops.export.experts.expert_orders`, once the chunks confirm a recorded or declared layout.

    Raises:
        LayoutContradictionError (E404): the record or declaration that un-permutes the experts is contradicted
            by the chunks (a wrong expert count, sizes not dividing it, a tensor the checkpoint lacks).
    """
    if layout.source != "none":
        layout.require_geometry(cat, _LAYOUT_HINT)
    return expert_orders(selected, layout)


def _adapter_config_beside(ckpt: Checkpoint, out_format: OutputFormat, given: dict[str, Any] | None) -> Path | None:
    """:attr:`PrepareRequest.config_beside`: the ``adapter_config.json`` in the checkpoint's (model) folder, for a
    format that reads one and no ``given`` config; ``None`` for none or a URL."""
    folder = ckpt.local_folder
    if not out_format.reads_adapter_config or given is not None or folder is None:
        return None
    path = folder / "adapter_config.json"
    return path if path.is_file() else None


def _name_config_beside(e: ExportError, ckpt: Checkpoint, opts: ExportOptions) -> None:
    """Name the folder of the ``config.json`` saved with the checkpoint in the hint of an adapter's error asking for
    the model's config (no ``model_assets`` given): the one to pass."""
    from ckpttool.model.adapters import CONFIG_HINT

    if opts.model_assets is not None or e.hint != CONFIG_HINT:
        return
    try:
        found = ckpt.hf_config_beside()
    except CkptError:  # a config.json linked out of the checkpoint: not one to name
        return
    if found is not None:
        e.hint = f"{CONFIG_HINT}: the checkpoint holds one, `model_assets` {shell_arg(found)}"


def _config_beside(ckpt: Checkpoint, opts: ExportOptions, out_format: OutputFormat) -> str | None:
    """:attr:`_Prepared.config_beside`: looked for only when a model format gets no ``model_assets``."""
    if opts.model_assets is not None or not out_format.ties_embeddings:
        return None
    found = ckpt.hf_config_beside()
    return str(found) if found is not None else None


def _export(
    ckpt: Checkpoint,
    out: Path,
    opts: ExportOptions,
    given: _Given,
    progress: ProgressFn | None,
    resume_frozen: Callable[[], None],
    phase: PhaseFn | None = None,
) -> ExportResult:
    t0 = time.perf_counter()
    say = phase or (lambda text: None)
    say("planning")
    opts = _resolved(opts, ckpt)
    out_format = _output_format(opts)
    # Planning and the chunk checks allocate ~10 acyclic objects per tensor (10^7 at 10^6 tensors): the
    # cyclic GC (paused by the caller, gc_held) would rescan them again and again (docs/performance.md).
    reader = ckpt.reader
    reader.verify_crc = opts.verify_crc
    layout = ckpt.require_layout()
    try:
        prep = _prepare(ckpt, layout, out_format, opts, given, say)
    except ExportError as e:
        _name_config_beside(e, ckpt, opts)
        raise
    plan = prep.plan
    sources = ckpt.output_sources()
    for source in sources[1:]:  # the output directory below checks the first
        check_target(out, overwrite=opts.overwrite, source=source)
    if opts.dry_run:  # the plan of this very export, checked up to the output directory: nothing written
        check_target(out, overwrite=opts.overwrite, source=sources[0])
        planned = [
            {"name": name, "bytes": size, "tensors": len(entries)}
            for name, size, entries in zip(plan.files, plan.file_bytes(), plan.entries)
        ]
        return _export_result(out, opts, layout, prep, planned, 0, (time.perf_counter() - t0, 0.0), None)
    # torchrun: each rank writes the files assigned to it (by bytes), rank 0 the index (ckpttool.ops.distributed)
    group = distributed.current()
    file_bytes = plan.file_bytes()
    owners = group.share(file_bytes)
    mine = {i for i, r in enumerate(owners) if group.owns(r)}
    identity = source_identity(reader, opts.algorithm)
    # content only (no path): the same checkpoint exported from anywhere gives the same bytes
    content = {k: v for k, v in identity.items() if k != "checkpoint"}
    st_metadata = {"format": "pt", SOURCE_METADATA_KEY: json.dumps(content, sort_keys=True, separators=(",", ":"))}
    # The GC resumes for the writes with every object of the plan (and of the open) in its youngest generation:
    # the first allocation would scan them all, later full collections again. They are
    # long-lived and acyclic: frozen (gc.freeze) until the export ends (gc_held).
    resume_frozen()
    say("writing")
    t_write = time.perf_counter()
    files_info, bytes_read = _write(ckpt, out, opts, out_format, prep, group, mine, st_metadata, identity, progress)
    t_end = time.perf_counter()
    return _export_result(out, opts, layout, prep, files_info, bytes_read, (t_end - t0, t_end - t_write), identity)


def _export_result(
    out: Path,
    opts: ExportOptions,
    layout: ResolvedLayout,
    prep: _Prepared,
    files_info: list[dict[str, Any]],
    bytes_read: int,
    seconds: tuple[float, float],
    identity: dict[str, Any] | None,
) -> ExportResult:
    """The result; ``seconds``: ``(the whole export, its writing phase)``."""
    plan = prep.plan
    return ExportResult(
        output=str(out),
        format=opts.fmt,
        files=files_info,
        tensors=plan.num_tensors,
        bytes=plan.total_bytes,
        bytes_read=bytes_read,
        seconds=seconds[0],
        write_seconds=seconds[1],
        **same_named(opts, "save_dtype", "weights"),
        experts=prep.experts,
        casts=plan.casts,
        narrowing_casts=plan.narrowing,
        origins=plan.origins,
        tied_embeddings=prep.tied,
        layout={
            "version": layout.version,
            "source": layout.source,
            "ep_size": layout.ep_size,
            "ep_fsdp_size": layout.ep_fsdp_size,
            "unpermuted": sorted(prep.orders),
        },
        assets=[name for name, _ in prep.assets],
        skipped=plan.skipped,
        warnings=plan.warnings,
        adapter_config=prep.adapter,
        source_identity=identity,
        manifest=MANIFEST_NAME if opts.manifest else None,
        model_adapter=prep.model_adapter.name if prep.model_adapter is not None else None,
        model_check=prep.check.to_dict() if prep.check is not None else None,
        config_edits=prep.config[1] if prep.config is not None else {},
        notes=list(prep.notes),
        dry_run=opts.dry_run,
        quantization=_quantization(opts, prep),
        config_beside=prep.config_beside,
    )


def _quantizer(
    reader: CheckpointReader,
    plan: ExportPlan,
    opts: ExportOptions,
    out_format: OutputFormat,
    warnings: list[str],
    model_config: dict[str, Any] | None = None,
) -> BlockQuantizer | None:
    """A quantized export's band quantizer (casts recounted, its plan warnings added to ``warnings``), else ``None``.

    Raises:
        UsageError: :meth:`QuantizedFormat.planned`'s.
        ExportError: FP8 weights of modules the model class of ``model_config`` does not build as nn.Linear.
    """
    if "ckpttool.ops.export.quantize" not in sys.modules:  # not loaded: no format of it exists (start-up)
        return None
    from ckpttool.ops.export.quantize import BlockQuantizer, QuantizedFormat, recount_casts

    if not isinstance(out_format, QuantizedFormat):
        return None
    quantized = out_format.planned()
    if model_config:
        _check_fp8_modules(plan, model_config)
    recount_casts(plan, opts.save_dtype, quantized)
    warnings.extend(out_format.warnings())
    return BlockQuantizer(reader, out_format.spec.block, quantized, out_format.spec.channel)


def _check_fp8_modules(plan: ExportPlan, config: dict[str, Any]) -> None:
    """Refuse FP8 weights of modules that transformers' FP8 quantizers do not convert (:func:`.not_linear_weights`).

    Raises:
        ExportError (E601): naming the first weights and the `quantize_skip` glob that keeps them, before anything
            is written.
    """
    from ckpttool.ops.export.expected import check_config_bounds, not_linear_weights
    from ckpttool.ops.export.quantize import FP8_DTYPE

    names = [plan.model_names.get(p.name, p.name) for t in plan.tasks for p in t.pieces if p.dtype == FP8_DTYPE]
    if not names:
        return
    check_config_bounds(config, len(plan.tasks))
    got = not_linear_weights(config, names)
    if got is None or not got[1]:
        return
    cls, bad = got
    leaves = sorted({n.removesuffix(".weight").rsplit(".", 1)[-1] for n in bad})
    raise ExportError(
        f"`quantize` would write {len(bad)} FP8 weight(s) of modules {cls} does not build as nn.Linear "
        f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): transformers' FP8 quantizers convert nn.Linear "
        "only, and would load these as FP8 values without their scales",
        param="quantize",
        hint="keep them in the save dtype with "
        + " ".join(f"`quantize_skip` '*.{leaf}.weight'" for leaf in leaves)
        + " (or export without `quantize`)",
    )


def _quantization(opts: ExportOptions, prep: _Prepared) -> dict[str, Any] | None:
    """``--json`` ``quantization``: the method, block, source, bound and each quantized tensor's error (this process's;
    a `dry_run` quantizes nothing: its ``max_rel_error`` is ``None``, its ``tensors`` empty)."""
    q = prep.quantizer
    if q is None:
        return None
    from ckpttool.ops.export.quantize import MAX_BLOCK_REL_ERROR

    tensors = q.summary()
    return {
        "method": opts.quantize,
        "format": opts.quant_format,
        "block_size": None if opts.quantize == "fp8-channel" else q.block,  # one scale per row: no block
        "source": opts.weights,
        "max_rel_error_bound": MAX_BLOCK_REL_ERROR,
        "quantized": q.count,
        "max_rel_error": None if opts.dry_run else max((t["max_rel_error"] for t in tensors.values()), default=0.0),
        "tensors": tensors,
    }


def _write(
    ckpt: Checkpoint,
    out: Path,
    opts: ExportOptions,
    out_format: OutputFormat,
    prep: _Prepared,
    group: Any,
    mine: set[int],
    st_metadata: dict[str, str],
    identity: dict[str, Any],
    progress: ProgressFn | None,
) -> tuple[list[dict[str, Any]], int]:
    """Write this process's files in a temporary directory beside ``out``, then (root) the documents and
    assets, and publish it: ``(files_info, bytes_read)`` of all processes."""
    reader, checkpoint, plan, merges = ckpt.reader, ckpt.output_sources()[0], prep.plan, prep.merges
    file_bytes = plan.file_bytes()
    tied, embed, lm_head = prep.tied, prep.embed, prep.lm_head
    with contextlib.ExitStack() as stack:
        tmp = distributed.enter_output_dir(
            stack, group, out, overwrite=opts.overwrite, source=checkpoint, kind="export"
        )
        bytes_read = 0
        writers: list[ShardWriter | None] = []
        failure: BaseException | None = None
        try:
            try:
                for i, (name, entries) in enumerate(zip(plan.files, plan.entries)):
                    display = (out if is_url(out) else Path(os.path.abspath(out))) / name
                    try:
                        writers.append(
                            ShardWriter(
                                tmp / name,
                                entries,
                                st_metadata,
                                display=display,
                                digest=opts.algorithm if opts.manifest else None,
                            )
                            if i in mine
                            else None
                        )
                    except ExportError as e:
                        raise _by_checkpoint_key(e, plan) from None
                workers = opts.workers if opts.workers is not None else min(8, os.cpu_count() or 1)
                executor = _Executor(
                    reader, plan, cast(list[ShardWriter], writers), workers, progress, prep.chunks, mine, merges
                )
                executor.quantizer = prep.quantizer
                t_run = time.perf_counter()
                torch_bands = prep.quantizer is not None and prep.quantizer.uses_torch
                with _one_torch_thread(torch_bands):  # the quantizer's torch bands: one per worker
                    _run_batches(reader, plan, mine, executor)
                bytes_read = executor.bytes_read
                if merges:  # this rank's merged weights
                    mine_keys = {t.source_key for t in plan.tasks if t.shard in mine}
                    out_format.check_written({k: m for k, m in merges.items() if k in mine_keys}, plan)
                log.info(
                    "read %d bytes and wrote %d in %.3f s with %d reader thread(s)",
                    bytes_read,
                    sum(file_bytes[i] for i in mine),
                    time.perf_counter() - t_run,
                    workers,
                )
                if tied == "omitted":
                    assert embed is not None and lm_head is not None
                    if next(t.shard for t in plan.tasks if t.selected is embed) in mine:
                        bytes_read += _check_tied(reader, plan, cast(list[ShardWriter], writers), embed, lm_head)
            finally:
                for w in writers:
                    if w is not None:
                        w.close()
        except BaseException as e:
            failure = e
        group.agree(failure)  # every rank done (or all raise the first failing rank's error: nothing published)
        files_info, bytes_read, digests = _gathered(group, plan, bytes_read, writers)
        if group.is_root:
            _write_root_files(tmp, out_format, prep, opts, digests, identity)
    return files_info, bytes_read


def _gathered(
    group: Any, plan: ExportPlan, bytes_read: int, writers: list[ShardWriter | None]
) -> tuple[list[dict[str, Any]], int, dict[int, tuple[int, str, list[Any]]]]:
    """Every process's written files, gathered: ``(files_info, bytes_read, digests by file index)``."""
    done = group.gather(
        (
            bytes_read,
            {i: w.size for i, w in enumerate(writers) if w is not None},
            {i: (w.data_start, w.header_digest, list(w.extents)) for i, w in enumerate(writers) if w is not None},
        )
    )
    bytes_read = sum(n for n, _, _ in done)
    sizes = {i: size for _, part, _ in done for i, size in part.items()}
    digests = {i: d for _, _, part in done for i, d in part.items()}
    files_info: list[dict[str, Any]] = []
    for i, (name, entries) in enumerate(zip(plan.files, plan.entries)):
        size = sizes[i]
        files_info.append({"name": name, "bytes": size, "tensors": len(entries)})
        log.debug("%s: %d tensors, %d bytes", name, len(entries), size)
    return files_info, bytes_read, digests


def _write_root_files(
    tmp: Path,
    out_format: OutputFormat,
    prep: _Prepared,
    opts: ExportOptions,
    digests: dict[int, tuple[int, str, list[Any]]],
    identity: dict[str, Any],
) -> None:
    """The format's documents (index, adapter config), the assets (copied, or as the format edits them), the manifest."""
    plan = prep.plan
    for name, data in out_format.documents(plan, prep.adapter).items():
        (tmp / name).write_bytes(data)
    edited = out_format.edited_assets(prep.model_config)
    if prep.config is not None:  # serving-ready: dtype and tie_word_embeddings as written (ops.export.serving)
        edited = {**edited, "config.json": prep.config[0]}
    for name, p in prep.assets:
        if name in edited:
            (tmp / name).write_bytes(edited[name])
        else:
            copy_regular(p, tmp / name, shown=p)
    if opts.manifest:
        doc = safetensors_manifest(
            [(name, *digests[i]) for i, name in enumerate(plan.files)], opts.algorithm, identity, sidecars_of=tmp
        )
        (tmp / MANIFEST_NAME).write_bytes(doc)


def _model_class_name(config: dict[str, Any]) -> str:
    """``transformers.X``: the class ``config.json`` names (``architectures[0]``), else its ``model_type``."""
    arch = config.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        return f"transformers.{arch[0]}"
    return f"transformers.AutoModelForCausalLM ({config.get('model_type')})"


def _log_plan(
    plan: ExportPlan, opts: ExportOptions, orders: dict[str, Any], tied: Any, skipped: dict[str, list[str]]
) -> None:
    log.info(
        "plan: %d tensors (%d bytes) in %d file(s) of at most %d bytes; weights %s; save dtype %s; casts %s; "
        "experts %s, %d un-permuted from the legacy layout; tied embeddings %s; %d key(s) not exported",
        plan.num_tensors,
        plan.total_bytes,
        len(plan.files),
        opts.shard_size,
        opts.weights,
        opts.save_dtype,
        plan.casts or "none",
        opts.experts,
        len(orders),
        tied or "no",
        sum(len(v) for v in skipped.values()),
    )


def _spool_batches(reader: CheckpointReader, plan: ExportPlan, mine: set[int]) -> list[tuple[list[int], list[str]]]:
    """This process's task indices in plan order, cut into batches whose source windows add up to at
    most the spool budget (``--remote-spool-size``; a larger task is a batch of its own), each with
    the source keys no later batch reads (evicted after it). A local checkpoint: one batch, no keys.
    """
    mine_tasks = [i for i, t in enumerate(plan.tasks) if t.shard in mine]
    budget = reader.spool_budget()
    if budget is None:
        return [(mine_tasks, [])]
    batches: list[list[int]] = []
    held = 0
    for i in mine_tasks:
        key = plan.tasks[i].source_key
        need = sum(reader.storage_info(key, c).length for c in reader.tensor_meta(key).chunks if c.numel)
        if not batches or (held + need > budget and batches[-1]):
            batches.append([])
            held = 0
        batches[-1].append(i)
        held += need
    last = {plan.tasks[i].source_key: b for b, batch in enumerate(batches) for i in batch}
    return [(batch, sorted(k for k, lb in last.items() if lb == b)) for b, batch in enumerate(batches)]


def _unconfigured_fp8(plan: ExportPlan, config: tuple[bytes, Any] | None, opts: ExportOptions) -> str | None:
    """A warning when float8 weights are written as stored (an export that quantizes writes its own
    ``quantization_config`` with `model_assets`, and is not asked this) with block scales (``x.weight_scale_inv``, fused
    ``x_scale_inv``) and no ``quantization_config`` beside them (no `model_assets`, or its ``config.json`` has none):
    vLLM, transformers and ``import`` take the block size from its ``weight_block_size`` (import assumes 128x128
    and refuses scales that do not fit it), so the folder loads nowhere as written. Names the block the scales'
    shapes give (:func:`~ckpttool.model.quantized.blocks_of_scales`) where they give one."""
    from ckpttool.model.quantized import FP8_SCALE_SUFFIX, blocks_of_scales

    written = {k: (dtype, shape) for k, (shape, dtype) in written_tensors(plan).items()}
    scaled = [k for k, (dtype, _) in written.items() if dtype == "float8_e4m3fn" and k + FP8_SCALE_SUFFIX in written]
    if not scaled:
        return None
    if config is not None:
        doc = json.loads(config[0])
        if isinstance(doc, dict) and isinstance(doc.get("quantization_config"), dict):
            return None
    where = (
        "no config.json is written (no `model_assets`)"
        if config is None
        else f"{opts.model_assets}/config.json, copied, has no quantization_config"
    )
    fit = blocks_of_scales(written)
    block = (
        f"the scales fit weight_block_size {list(fit.block)} (blocks of {fit.named} fit their shapes)"
        if fit is not None and fit.block is not None
        else f"the scales' shapes fit blocks of {fit.named}, which dequantize differently"
        if fit is not None
        else "no block size fits every scale"
    )
    return (
        f"{len(scaled)} float8 weight(s) written as stored with block scales (e.g. {scaled[0] + FP8_SCALE_SUFFIX!r}) "
        f"and no quantization_config beside them: {where}; vLLM, transformers and `ckpttool import` read the block "
        f"size from its weight_block_size and cannot load them without it (import assumes 128x128); {block}: give "
        "`model_assets` a config.json with the quantization_config they were quantized with (the source folder's "
        'own, where it has one; e.g. {"quant_method": "fp8", "weight_block_size": [B0, B1]})'
    )


def written_tensors(plan: ExportPlan) -> dict[str, tuple[tuple[int, ...], str]]:
    """Output key -> (shape, dtype) of a plan, expert tensors in their fused form (what transformers loads)."""
    return {key: (shape, dtype) for key, shape, dtype, _ in written_sources(plan)}


def written_sources(plan: ExportPlan) -> Iterator[tuple[str, tuple[int, ...], str, str]]:
    """``(output key, shape, dtype, checkpoint key of its model tensor)`` of each tensor a plan writes, expert
    tensors in their fused form (what transformers loads)."""
    for t in plan.tasks:
        s, dtype = t.selected, t.pieces[0].dtype
        if s.hf is not None and not s.hf.pieces:
            yield s.hf.key, s.hf.shape, dtype, s.model_key
        elif s.hf is not None and s.hf.fused_experts:  # an adapter's fused experts, split per expert or not
            for key, shape in s.hf.pieces:
                yield key, shape, dtype, s.model_key
        elif t.pieces[0].expert is not None:
            yield s.out_key, s.source.shape, dtype, s.model_key
        else:
            for p in t.pieces:
                yield plan.model_names.get(p.name, p.name), p.shape, p.dtype, s.model_key


def without_fp8_scales(written: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``written`` (:func:`written_tensors`) as the model class holds it: less the scales of its float8 weights
    (``x_scale_inv``, ``x_scale``), and MXFP4 ``x_blocks`` ``[E, N, G, B]`` + ``x_scales`` ``[E, N, G]`` as the
    ``x`` ``[E, G*2B, N]`` they dequantize to (dtype ``uint8``: not compared). The scales and blocks are no
    parameters of the model class (the quantizer the config's ``quantization_config`` names adds them), whether
    the export quantized the weights or a folder stored quantized is copied (or validated) as stored."""
    scales = {
        k + x for k, (_, dtype) in written.items() if dtype.startswith("float8") for x in ("_scale_inv", "_scale")
    }
    out = {k: v for k, v in written.items() if k not in scales}
    for k, (shape, dtype) in written.items():
        x = k.removesuffix("_blocks")
        s = out.get(x + "_scales")
        if x != k and dtype == "uint8" and len(shape) == 4 and s is not None and tuple(s[0]) == tuple(shape[:3]):
            e, n, g, b = shape
            del out[k], out[x + "_scales"]
            out.setdefault(x, ((e, g * 2 * b, n), "uint8"))
    return out


def _model_check(
    ckpt: Checkpoint,
    plan: ExportPlan,
    model_config: dict[str, Any] | None,
    opts: ExportOptions,
    out_format: OutputFormat,
    say: PhaseFn,
) -> ModelCheck | None:
    """The plan checked against the model class of ``model_config`` where the format checks it (else ``None``);
    where that did not prove the shapes, the warning of a per-rank shard folder that cannot be known complete
    (:meth:`~ckpttool.model.checkpoint.Checkpoint.unproven_shards`) added to the plan's warnings.

    Raises:
        ModelMismatchError (E605): as :func:`_check_against_model` (a shortfall of the shards' shapes included).
    """
    check = None
    if out_format.checks_model_class and model_config:
        say(f"building model class {_model_class_name(model_config)}")
        check = _check_against_model(plan, model_config, opts, fold=True)
    elif out_format.checks_model_class and ckpt.unproven_shards() is not None:
        check = _check_shards_beside(ckpt, plan, opts, say)
    unproven = None if check is not None and check.checked else ckpt.unproven_shards()
    if unproven is not None:
        plan.warnings.append(unproven)
    return check


def _check_shards_beside(ckpt: Checkpoint, plan: ExportPlan, opts: ExportOptions, say: PhaseFn) -> ModelCheck | None:
    """The shapes of a per-rank shard folder (``HuggingFaceStorageWriter(save_distributed=True)``, which records
    neither the world size nor the full shapes) checked against the model class of the ``config.json`` saved beside
    it (:meth:`~ckpttool.model.checkpoint.Checkpoint.hf_config_beside`), as ``validate`` does: a rank's files missing
    export a model of short shapes otherwise. Only a shortfall (``shape``, ``missing``) is refused; other
    differences from a config nobody passed are the plan's warnings. ``None``: no readable config beside.

    Raises:
        ModelMismatchError (E605): a tensor's shape or a key of the model class the shards do not hold, naming the
            config used.
    """
    try:
        folder = ckpt.hf_config_beside()
        config = read_hf_config(folder, param=None) if folder is not None else None
    except CkptError:  # unreadable: the unproven-shards warning stays
        return None
    if config is None or folder is None:
        return None
    say(f"building model class {_model_class_name(config)} (config.json beside the shards)")
    lenient = tuple(dict.fromkeys((*opts.allow_mismatch, "unexpected", "dtype")))
    try:
        return _check_against_model(plan, config, dataclasses.replace(opts, allow_mismatch=lenient), fold=True)
    except ModelMismatchError as e:
        raise ModelMismatchError(
            e.message.replace("built from config.json", f"built from {folder / 'config.json'}", 1),
            param="model_assets",
            hint="a rank's shard files are missing or the shards are of another model: restore them (each rank writes "
            "shard-0000R-*), or pass the config.json of the model they were saved from (`model_assets`); "
            "`allow_mismatch` shape,missing writes them anyway",
        ) from None


def _check_against_model(
    plan: ExportPlan, config: dict[str, Any], opts: ExportOptions, *, fold: bool = False
) -> ModelCheck:
    """Compare the plan with the model class of ``config`` (:mod:`.expected`); refuse unallowed differences.
    ``fold``: compare per-expert tensors as transformers loads them into the model class
    (:func:`~ckpttool.model.hf_forms.fold_expert_forms`, as validate's ``M010`` does), so that the per-expert names
    ``save_pretrained`` and the trainers' HF adapters write are not a shortfall of the fused ``experts.gate_up_proj``.

    Raises:
        ModelMismatchError (E605): missing / unexpected keys, wrong shapes or dtypes not in ``allow_mismatch``
            (``missing`` is not checked when ``filter_glob`` asks for part of the model).
    """
    written = written_tensors(plan)
    if opts.quantize is not None:  # the scales are not parameters of the model class; the FP8 dtype was asked for
        suffix = "_scale_inv" if opts.quant_format == "fp8" else "_scale"
        written = {k: v for k, v in written.items() if not k.endswith(suffix)}
    written = without_fp8_scales(written)
    if fold:
        mt, want = (
            config_value(config, "model_type"),
            config_value(config, "dtype") or config_value(config, "torch_dtype"),
        )
        written = fold_expert_forms(
            written, mt if isinstance(mt, str) else None, want if isinstance(want, str) else None
        )
    check = compare_with_model(written, config)
    if not check.checked:
        plan.warnings.append(f"keys and shapes were not checked against the model class: {check.not_checked}")
        return check
    if opts.filter_glob and "missing" in check.findings:
        n = len(check.findings.pop("missing"))
        plan.warnings.append(f"{n} key(s) of {check.model_class} not written (`filter_glob` exports part of the model)")
    if (opts.save_dtype != "preserve" or opts.quantize is not None) and "dtype" in check.findings:
        check.findings.pop("dtype")  # the dtype was asked for with `save_dtype`
    refused = {k: v for k, v in check.findings.items() if k not in opts.allow_mismatch}
    for kind, lines in check.findings.items():
        if kind not in refused:
            plan.warnings.append(f"{len(lines)} {kind} key(s) against {check.model_class} (allowed): {lines[0]}")
    if refused:
        parts = []
        for kind, lines in refused.items():
            shown = "; ".join(lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")
            parts.append(f"{kind} {len(lines)}: {shown}")
        want = config.get("dtype") or config.get("torch_dtype")
        hint = (
            f"only the dtype differs: `save_dtype` {want} writes the dtype config.json names; "
            "`allow_mismatch` dtype writes the tensors as stored"
            if set(refused) == {"dtype"} and isinstance(want, str) and want in ("bfloat16", "float16", "float32")
            else "pass the config.json of the model this checkpoint was trained as (or the right `adapter`); "
            f"`allow_mismatch` {','.join(refused)} writes it anyway"
        )
        raise ModelMismatchError(
            f"the export does not fit {check.model_class} built from config.json: " + " | ".join(parts),
            param="model_assets",
            hint=hint,
        )
    return check


def export_adapter(cat: Catalog, opts: ExportOptions, model_config: dict[str, Any] | None) -> ModelAdapter | None:
    """The model adapter of an export: ``opts.adapter``, else detected from the names (formats that detect one: ``hf``).

    Returns ``None`` for LoRA exports and when nothing fits (torchtitan names are then refused, E603).

    Raises:
        UsageError: an unknown ``adapter`` name, or one given with the ``lora`` format.
        ExportError (E601): the ``adapter`` named does not fit the model tensors as a whole (:meth:`ModelAdapter.misfit`).
    """
    out_format = get_format(opts.fmt)
    if opts.adapter is not None:
        ad = get_adapter(opts.adapter)
        out_format.check_model_adapter(ad)
        why = ad.misfit(cat.param_fqns)
        if why is not None:
            raise ExportError(
                f"{cat.path}: adapter {ad.name} does not fit: {why}",
                hint="pick the adapter of the model's family (export --help lists them), or leave `adapter` out",
            )
        return ad
    if not out_format.detects_model_adapter:
        return None
    return detect_adapter(cat.schema.naming, cat.param_fqns, model_config)  # the shared list: read only


def _check_tied(
    reader: CheckpointReader, plan: ExportPlan, writers: list[ShardWriter], embed: Selected, lm_head: Selected
) -> int:
    """Refuse a tied export whose lm_head differs from the embedding (compared bitwise, as stored).

    The lm_head source is read once here; the embedding is compared as written when it
    was copied bit-exact, else read again from the checkpoint. With FP32 masters (``weights`` master), a tied
    parameter has one ``master_weight``, kept under one of its two fqns: when the pair's sources are not two
    tensors of one kind (a master beside a stored parameter, or one master written for both), the two stored
    parameters are compared instead: equal, they are the one tied parameter whose master was written.

    Returns:
        Bytes read from the checkpoint.

    Raises:
        ExportError: shapes, dtypes or bytes differ.
    """
    if embed.origin != lm_head.origin or embed.source is lm_head.source:
        head, emb = _read_whole(reader, lm_head.model_key), _read_whole(reader, embed.model_key)
        equal = _bitwise_equal(head, emb)
        read = sum(t.numel() * t.element_size() for t in (head, emb))
        del head, emb
        if not equal:
            raise ExportError(
                f"{lm_head.model_key} differs from {embed.model_key} but config.json says tie_word_embeddings: true",
                fqn=lm_head.model_key,
                hint="set tie_word_embeddings to false in the `model_assets` config.json to export both, "
                "or use the config the model was trained with",
            )
        return read
    head = _read_whole(reader, lm_head.source.key)
    read = lm_head.source.nbytes
    task = next(t for t in plan.tasks if t.selected is embed)
    if task.direct:
        import torch

        emb = torch.empty(task.pieces[0].shape, dtype=getattr(torch, task.pieces[0].dtype))
        writers[task.shard].read(task.pieces[0].name, _tensor_bytes(emb))
    else:
        emb = _read_whole(reader, embed.source.key)
        read += embed.source.nbytes
    equal = _bitwise_equal(head, emb)
    del emb
    if not equal:
        raise ExportError(
            f"{lm_head.source.key} differs from {embed.source.key} but config.json says tie_word_embeddings: true",
            fqn=lm_head.source.key,
            hint="set tie_word_embeddings to false in the `model_assets` config.json to export both, "
            "or use the config the model was trained with",
        )
    return read


def _by_checkpoint_key(e: ExportError, plan: ExportPlan) -> ExportError:
    """``e`` (a tensor the output format cannot store, named by its output key) naming the checkpoint key that the
    ``rules`` and ``filter_glob`` of its hint match, its output key after it where the two differ."""
    prefix = f"{e.fqn}: "
    for t in plan.tasks:
        key = t.selected.model_key
        if key != e.fqn and e.message.startswith(prefix) and any(p.name == e.fqn for p in t.pieces):
            e.message = f"{key}: {e.message.removeprefix(prefix)} (its output key {e.fqn})"
            e.args = (e.message,)
            e.fqn = key
            break
    return e


def _bare_glob_hint(cat: Catalog, glob: str | None) -> str | None:
    """:func:`bare_glob_hint` of ``filter_glob`` over the model keys (as stored, or as ``model.<fqn>``)."""
    prefix = cat.schema.model_prefix
    return bare_glob_hint(
        glob,
        lambda g: sum(
            match_filter(k, g, prefix) or match_filter(canonical_model_key(cat.fqn_of(k)), g) for k in cat.model
        ),
        "model tensor",
    )
