"""``reshard``: rewrite EP tensors between layout versions / mesh sizes.

Plans from metadata (:mod:`ckpttool.ops.reshard.plan`) and writes an atomic output: output
chunks equal to a source chunk are copied verbatim after the chunk locator's checks; other EP
chunks are assembled tensor by tensor (each source chunk read once; peak memory one tensor's
rewritten chunks plus one source chunk) and written with ``torch.save``; byte items pass
through, the ``layout`` item replaced by the new record (``converted_from`` names the source; a ``layout``
item of the trainer's own is copied and the record written to the output's ``layout.json``); files beside the checkpoint are copied, a stale sidecar ``layout.json`` is not. The source is
only read. ``docs/layouts.md``, "ckpttool reshard".
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.engine.pool import map_ordered, worker_count
from ckpttool.errors import (
    DataFileError,
    NotRegularFileError,
    PathEscapeError,
    ReshardError,
    SizeLimitError,
    check_path,
)
from ckpttool.format import limits
from ckpttool.format.atomic import atomic_write_text, signals_deferred
from ckpttool.format.directory import DATA_FILE_RE, METADATA_NAME
from ckpttool.format.files import copy_regular, resolve_inside
from ckpttool.format.marker import MARKER_NAME
from ckpttool.format.metadata import ChunkMeta
from ckpttool.format.outputs import check_target, output_location
from ckpttool.format.rank_local import RANK_METADATA_RE
from ckpttool.format.reader import CheckpointReader, check_saved_archive
from ckpttool.format.storage import confine_key, is_url
from ckpttool.format.tiling import contiguous_run
from ckpttool.format.writer import DCPWriter, can_stream
from ckpttool.layouts.record import SIDECAR_NAME
from ckpttool.model.catalog import Catalog
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, open_source
from ckpttool.ops import distributed
from ckpttool.ops.fields import Hooks, PhaseFn, ProgressFn, Unpack, hooks_of, options_of, same_named
from ckpttool.ops.manifest import MANIFEST_NAME, source_identity, write_output_manifest
from ckpttool.ops.reshard.plan import ReshardOptions, ReshardPlan, TensorPlan, origin_world, plan_reshard

if TYPE_CHECKING:
    import torch

__all__ = ["ReshardOptions", "ReshardResult", "reshard", "execute_plan"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardResult:
    """What :func:`reshard` did (``ckpttool reshard --json``, schema ``ckpttool.reshard/1``).

    Attributes:
        source, target: directories.
        from_version, from_source: source layout version (``None`` unversioned) and where it came from.
        from_ep_size, from_ep_fsdp_size: source sizes (``None`` when unknown).
        to_version, ep_size, ep_fsdp_size: target layout and mesh sizes; world = ``ep_size * ep_fsdp_size``.
        ep_tensors: EP parameters; permuted: keys whose expert order changed (parameters and state).
        optimizer_tensors: optimizer state tensors of EP parameters rewritten with them.
        passthrough_tensors, byte_items: copied unchanged.
        chunks_copied, chunks_rewritten: output chunks copied as archives / assembled and re-saved.
        files: output data files (relative path, bytes).
        extra_files: files/directories beside the checkpoint copied unchanged (``extra_state``, ...).
        bytes_written, seconds: totals (``seconds``: planning to the finished output).
        write_seconds: the writing of the data files alone (0 with ``dry_run``); at most ``seconds``.
        warnings: things the output cannot fix, one line each (e.g. per-rank ``extra_state`` files
            copied from a source mesh of another size).
    """

    source: str
    target: str
    from_version: int | None
    from_source: str
    from_ep_size: int | None
    from_ep_fsdp_size: int | None
    to_version: int
    ep_size: int
    ep_fsdp_size: int
    ep_tensors: int
    permuted: list[str]
    optimizer_tensors: int
    passthrough_tensors: int
    byte_items: int
    chunks_copied: int = 0
    chunks_rewritten: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)
    extra_files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    write_seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    source_identity: dict[str, Any] | None = None
    manifest: str | None = None
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON view (``--json``), schema ``ckpttool.reshard/1``."""
        d = dict(self.__dict__)
        d["schema"] = "ckpttool.reshard/1"
        d["to_layout"] = "canonical" if self.to_version == 2 else "legacy"
        return d


def _stream_segments(
    tp: TensorPlan, oc: Any, reader: CheckpointReader, records: dict[ChunkMeta, tuple[int, int] | None]
) -> list[tuple[int, int, int]] | None:
    """Byte segments of the source files whose concatenation is output chunk ``oc`` (``None``: not that simple)."""
    item = tp.dtype.itemsize
    if not can_stream(tp.dtype):
        return None
    runs = []
    for piece in oc.pieces:
        src = piece.src_chunk
        if src not in records:
            loc = reader.locate(tp.key, src)
            if loc.raw and reader.verify_crc:
                reader.verify_record(loc)  # its bytes are copied in pieces: check the whole record once
            records[src] = (reader.fd(loc.info.relative_path), loc.data_start) if loc.raw else None
        where = records[src]
        s_run = contiguous_run(src.sizes, piece.src_start, piece.sizes)
        d_run = contiguous_run(oc.chunk.sizes, piece.dst_start, piece.sizes)
        if where is None or s_run is None or d_run is None:
            return None
        runs.append((d_run[0], d_run[1], where[0], where[1] + s_run[0] * item))
    runs.sort()
    pos, segments = 0, []
    for d_off, count, fd, byte_off in runs:
        if d_off != pos:
            return None
        segments.append((fd, byte_off, count * item))
        pos += count
    return segments if pos == oc.chunk.numel else None


def _box(t: torch.Tensor, start: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(start, sizes)):
        if o != 0 or s != t.shape[d]:
            t = t.narrow(d, o, s)
    return t


@dataclass
class _Job:
    """One output chunk to write in the parallel phase: a verbatim copy or a streamed archive."""

    key: str
    chunk: Any
    dtype: Any
    nbytes: int
    copy: tuple[int, Any] | None = None  # (source fd, StorageInfo)
    segments: list[tuple[int, int, int]] | None = None
    location: Any = None  # the copied chunk's ChunkLocation (its record's CRC-32 is checked while copying)
    record: Any = None  # the copied chunk's ChunkLocation (its record's span, digested as it is copied)


def _plan_jobs(tp: TensorPlan, reader: CheckpointReader, jobs: dict[int, list[_Job]]) -> list[int]:
    """Queue the chunks of ``tp`` that need no tensor; return the indices of those that do."""
    records: dict[ChunkMeta, tuple[int, int] | None] = {}
    fallback = []
    nbytes_of = tp.dtype.itemsize
    for i, oc in enumerate(tp.chunks):
        raw = oc.raw_source
        if raw is not None:
            loc = reader.locate(tp.key, raw)  # the archive is checked before it is copied
            info = loc.info
            if reader.verify_crc and (loc.record.deflated or not loc.in_file):
                reader.verify_record(loc)  # compressed: checked by decoding it once
            jobs[oc.rank].append(
                _Job(
                    tp.key,
                    oc.chunk,
                    tp.dtype,
                    oc.chunk.numel * nbytes_of,
                    copy=(reader.fd(info.relative_path), info),
                    location=loc if reader.verify_crc else None,
                    record=loc,
                )
            )
            continue
        segments = _stream_segments(tp, oc, reader, records)
        if segments is not None:  # contiguous pieces: bytes go file to file, no tensor needed
            jobs[oc.rank].append(_Job(tp.key, oc.chunk, tp.dtype, oc.chunk.numel * nbytes_of, segments=segments))
        else:
            fallback.append(i)
    return fallback


def _run_jobs(
    rank: int, jobs: list[_Job], writer: DCPWriter, tick: Callable[[int, bool], None], stop: threading.Event
) -> None:
    t0 = time.perf_counter()
    for job in jobs:
        if stop.is_set():  # interrupted, or another worker failed: the output is abandoned
            return
        if job.copy is not None:
            writer.copy_archive(
                job.key, job.chunk, rank, job.copy[0], job.copy[1], verify=job.location, location=job.record
            )
        else:
            assert job.segments is not None
            writer.stream_tensor_archive(job.key, job.chunk, rank, job.dtype, job.segments)
        tick(job.nbytes, job.copy is not None)
    writer.sync(rank)
    log.info(
        "%s: %d chunks, %d bytes in %.3f s",
        DCPWriter.file_name(rank),
        len(jobs),
        sum(j.nbytes for j in jobs),
        time.perf_counter() - t0,
    )


def _write_reassembled(tp: TensorPlan, indices: list[int], reader: CheckpointReader, writer: DCPWriter) -> None:
    """Chunks whose pieces are not byte runs (e.g. FSDP on another dim, new sizes): assemble with torch."""
    import torch

    buffers = {i: torch.empty(tp.chunks[i].chunk.sizes, dtype=tp.dtype.to_torch()) for i in indices}
    by_source: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
    for i in indices:
        for piece in tp.chunks[i].pieces:
            by_source[piece.src_chunk].append((i, piece))
    reader.check_allocation(tp.key, reader.tensor_meta(tp.key))
    for src_chunk, uses in by_source.items():
        if len(uses) == 1:
            i, piece = uses[0]
            view = _box(buffers[i], piece.dst_start, piece.sizes)
            if piece.sizes == src_chunk.sizes and view.is_contiguous():
                reader.read_chunk(tp.key, src_chunk, out=view)  # straight into place, one read
                continue
        whole = reader.read_chunk(tp.key, src_chunk)
        for i, piece in uses:
            _box(buffers[i], piece.dst_start, piece.sizes).copy_(_box(whole, piece.src_start, piece.sizes))
        del whole
    for i in indices:
        oc = tp.chunks[i]
        writer.write_chunk(tp.key, oc.chunk, oc.rank, buffers.pop(i))


def execute_plan(
    plan: ReshardPlan,
    reader: CheckpointReader,
    out_dir: Path,
    checkpoint_id: Path,
    options: ReshardOptions,
    progress: ProgressFn | None = None,
) -> tuple[DCPWriter, dict[str, int]]:
    """Write the planned checkpoint into ``out_dir`` (data files + ``.metadata``).

    Output chunks that are a whole source chunk (copied verbatim) or a concatenation of
    contiguous source byte runs (streamed into a new archive) are written by one worker
    thread per target file, in parallel (the copies run in the kernel and release the GIL);
    the remaining chunks are assembled with torch, tensor by tensor. Each data file is
    ``fsync``ed before ``.metadata`` is written.

    Args:
        plan: from :func:`~ckpttool.ops.reshard.plan.plan_reshard`.
        reader: reader of ``plan.source``.
        out_dir: an empty directory.
        checkpoint_id: the final path, recorded in the metadata.
        options: its ``threads`` (worker threads; default: CPU count, at most the number of target files),
            ``fsync`` (see :class:`~ckpttool.format.writer.DCPWriter`), and ``manifest``: digest every written
            record with ``algorithm`` (``writer.manifest_entries()``).
        progress: called with ``(0, bytes total)`` first, then ``(bytes done, bytes total)`` (from worker threads).

    Returns:
        The finished writer (byte counts) and ``{"copied": n, "rewritten": n}`` chunk counts.
    """
    counts = {"copied": 0, "rewritten": 0}
    total = sum(t.dtype.itemsize * math.prod(t.shape) for t in plan.tensors)
    state = {"done": 0}
    lock = threading.Lock()
    if progress is not None:  # the total, before the first byte is written
        progress(0, total)

    def tick(nbytes: int, copied: bool) -> None:
        with lock:
            state["done"] += nbytes
            counts["copied" if copied else "rewritten"] += 1
            if progress is not None:
                progress(state["done"], total)

    # torchrun: each rank writes the target rank files assigned to it (by bytes); rank 0 writes .metadata
    group = distributed.current()
    file_bytes = [0] * plan.world
    for tp in plan.tensors:
        for oc in tp.chunks:
            file_bytes[oc.rank] += oc.chunk.numel * tp.dtype.itemsize
    owners = group.share(file_bytes)
    mine = {r for r in range(plan.world) if group.owns(owners[r])}
    reader.prefetch_keys(t.key for t in plan.tensors if any(oc.rank in mine for oc in t.chunks))  # remote
    digest = options.algorithm if options.manifest else None
    with DCPWriter(out_dir, checkpoint_id, fsync=options.fsync, digest=digest) as writer:
        writer.ensure_files(range(plan.world) if not group.active else sorted(mine))
        jobs: dict[int, list[_Job]] = {r: [] for r in range(plan.world)}
        fallback: list[tuple[TensorPlan, list[int]]] = []
        for tp in plan.tensors:
            writer.declare_tensor(tp.key, tp.dtype, tp.shape, plan.planner_data.get(tp.key))
            rest = _plan_jobs(tp, reader, jobs)
            if rest:
                fallback.append((tp, rest))
        _run_parallel(plan, jobs, mine, writer, tick, options.threads)
        for tp, all_indices in fallback:
            indices = [i for i in all_indices if tp.chunks[i].rank in mine]
            if not indices:
                continue
            _write_reassembled(tp, indices, reader, writer)
            tick(sum(tp.chunks[i].chunk.numel for i in indices) * tp.dtype.itemsize, False)
            with lock:
                counts["rewritten"] += len(indices) - 1
        _write_byte_items(plan, reader, writer, mine)
        # pairs with _reshard's agree(error); rank 0's counts become every rank's, as the merged records give every
        # rank's bytes
        if not distributed.merge_rank_files(group, writer, mine, counts):
            return writer, counts
        writer.finish()
    return writer, counts


def _write_byte_items(plan: ReshardPlan, reader: CheckpointReader, writer: DCPWriter, mine: set[int]) -> None:
    """Byte items of this rank's target files: copied verbatim, or the new value (the ``layout`` record)."""
    for bp in plan.byte_items:
        if bp.rank not in mine:
            continue
        path = plan.planner_data.get(bp.key)
        if bp.value is None:
            info = reader.storage_info(bp.key)
            reader.fetch(info)
            writer.copy_bytes_item(bp.key, bp.rank, reader.fd(info.relative_path), info, path)
        else:
            writer.write_object(bp.key, bp.rank, bp.value, path)


def _run_parallel(
    plan: ReshardPlan,
    jobs: dict[int, list[_Job]],
    mine: set[int],
    writer: DCPWriter,
    tick: Callable[[int, bool], None],
    threads: int | None,
) -> None:
    """The copy phase: one job list per target file of this rank, ``threads`` files at a time.

    Raises:
        the first error in rank order; on an error or Ctrl-C / SIGTERM the other workers stop
        within one chunk and are waited for (deferred: a second Ctrl-C must not close the
        writer's files under a running worker).
    """
    workers = worker_count(threads, plan.world)
    stop = threading.Event()
    ranks = [r for r in range(plan.world) if r in mine]
    map_ordered(
        lambda r: _run_jobs(r, jobs[r], writer, tick, stop), ranks, workers=workers, stop=stop, guard=signals_deferred
    )


def _source_file(name: str) -> bool:
    """A data file or a rank-local ``__R.metadata`` (``use_collectives=False``) of the source: the output has
    its own (a copied ``__R.metadata`` would describe the source's chunks beside the new ``.metadata``)."""
    return bool(DATA_FILE_RE.match(name) or RANK_METADATA_RE.match(name))


#: what reshard says of a checkpoint whose chunks are not ``torch.save`` archives, by ``serialization``
_NOT_ARCHIVES = {
    "safetensors": "a safetensors checkpoint (a Hugging Face model folder or HuggingFaceStorageWriter output: "
    "safetensors files, no .metadata)",
    "dcp_safetensors": "a DCP checkpoint saved with FileSystemWriter(serialization_format=SerializationFormat."
    "SAFETENSORS) (each data file a safetensors blob, not torch.save archives)",
    "mixed": "a safetensors model folder paired with a DCP optimizer folder (NeMo Automodel's model/ + optim/)",
}


def _refuse_kind(ckpt: Checkpoint) -> None:
    """ReshardError (E602) naming the storage kind or schema reshard does not rewrite.

    Reshard copies ``torch.save`` chunk archives verbatim and permutes EP chunks of a known layout:
    other chunk encodings, per-rank formats and megatron-core's ``torch_dist`` (experts stored by
    their global index; no EP layout to convert) are refused before anything is written.
    """
    src_p, reader = ckpt.path, ckpt.reader
    kind = reader.metadata.serialization
    if getattr(reader, "assembled", None) is not None:
        what = "a per-rank checkpoint (each rank's own torch.save / safetensors file, assembled; no DCP metadata)"
    elif kind != "torch_save":
        what = _NOT_ARCHIVES.get(kind, f"a checkpoint of serialization {kind!r}")
    elif (spec := ckpt.catalog.schema.spec) is not None and spec.reshard_refusal is not None:
        why, hint = spec.reshard_refusal  # megatron-core's torch_dist: experts by global index, no EP layout
        raise ReshardError(f"{src_p}: {why}", hint=hint)
    else:
        return
    raise ReshardError(
        f"{src_p}: {what}; reshard rewrites and copies the torch.save chunk archives of FileSystemWriter checkpoints",
        hint="`ckpttool import` it, which writes a DCP checkpoint for the mesh you name (--world-size, or --ep-size "
        "and --ep-fsdp-size)"
        if kind == "safetensors" and getattr(reader, "assembled", None) is None
        else "export it with `ckpttool export`, or re-save it with dcp.save's default FileSystemWriter",
    )


def _copy_extra_remote(reader: CheckpointReader, dst: Path) -> list[str]:
    """:func:`_copy_extra_files` for a checkpoint in object storage: every other object below its prefix.

    Each object is confined (``E101``) and capped by ``--max-object-size`` before it is fetched.
    """
    assert reader.remote is not None
    names = [
        rel
        for rel in sorted(reader.remote.sizes())
        if rel not in (METADATA_NAME, SIDECAR_NAME, MANIFEST_NAME, MARKER_NAME)
        and not ("/" not in rel and _source_file(rel))
    ]
    for rel in names:  # every key checked before the first is fetched or written
        try:
            confine_key(reader.remote.root, rel, shown=reader.path, what="object", why="it cannot be copied to OUT")
        except PathEscapeError as e:
            raise PathEscapeError(
                e.message,
                path=rel,
                hint="it is no part of the DCP checkpoint (its .metadata does not name it): rename or delete the "
                "object, then run again",
            ) from None
    copied = []
    for rel in names:
        data = reader.read_file(rel, limits.current().max_object_bytes, what="file beside the checkpoint")
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        copied.append(rel.split("/", 1)[0])
    return sorted(set(copied))


def _listed(d: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    """The entries of the source directory ``d`` by name.

    Raises:
        DataFileError: it cannot be listed (moved or deleted while the checkpoint was read).
    """
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise DataFileError(
            f"{d}: cannot list the checkpoint's files ({e.strerror}); was it moved or deleted while it was read?",
            path=Path(d),
            hint="leave the checkpoint in place until the command ends, then run it again",
        ) from e


def _copy_extra_files(src: Path, dst: Path) -> list[str]:
    """Copy files beside the checkpoint (not ``.metadata``, data files, the sidecar or the source's manifest).

    Only regular files are copied (checked on the open descriptor: a device or FIFO is never
    read); directories are recreated; a symlink is recreated as the same link when its target
    stays inside the checkpoint.

    Raises:
        PathEscapeError: a symlink leaves the checkpoint.
        NotRegularFileError: a device, FIFO or socket.
    """
    root = src.resolve()
    copied = []

    def copy_entry(entry: os.DirEntry[str], rel: str, out: Path) -> None:
        if entry.is_symlink():
            resolve_inside(root, rel, what="file")  # PathEscapeError when it leaves the checkpoint
            os.symlink(os.readlink(entry.path), out)
        elif entry.is_dir(follow_symlinks=False):
            out.mkdir()
            for child in _listed(entry.path):
                copy_entry(child, f"{rel}/{child.name}", out / child.name)
        elif entry.is_file(follow_symlinks=False):
            copy_regular(Path(entry.path), out, shown=src / rel)
            shutil.copystat(entry.path, out)
        else:
            raise NotRegularFileError(f"{src / rel} is a device, FIFO or socket, not a regular file", path=src / rel)

    for entry in _listed(src):
        if entry.name in (METADATA_NAME, SIDECAR_NAME, MANIFEST_NAME, MARKER_NAME) or _source_file(entry.name):
            continue
        copy_entry(entry, entry.name, dst / entry.name)
        copied.append(entry.name)
    return copied


def reshard(
    source: CheckpointOrPath, out: str | os.PathLike[str], options: ReshardOptions | None = None, **hooks: Unpack[Hooks]
) -> ReshardResult:
    """Write a new DCP checkpoint whose EP tensors are in the ``options.to`` layout for the target mesh.

    Args:
        source: the opened source :class:`~ckpttool.model.checkpoint.Checkpoint` (its layout declaration
            included), or its path/URL, opened with ``opening``; only read.
        out: output directory (must not exist or be empty, unless ``overwrite``).
        options: see :class:`ReshardOptions`.
        progress: optional ``(bytes done, bytes total)`` callback: ``(0, total)`` once planned, then
            after each written chunk.
        phase: ``phase(text)`` as each step starts: ``planning``, ``writing`` (the bytes of
            ``progress``), then ``copying extra files`` and ``writing manifest.json`` where there are any.

    Returns:
        A :class:`ReshardResult` (``seconds``: planning to the finished output; ``write_seconds``: the writing).

    Raises:
        UsageError, LayoutError, ReshardError, ChunkError: see
            :func:`~ckpttool.ops.reshard.plan.plan_reshard`; OutputError: bad target.
    """
    opening, progress, phase = hooks_of("reshard", hooks)
    check_path(out, "out")
    opts = options_of(options, ReshardOptions)
    with open_source(source, opening) as ckpt:
        return _reshard(ckpt, output_location(out), opts, progress, phase or (lambda text: None))


def _reshard(
    ckpt: Checkpoint, dst_p: Path, opts: ReshardOptions, progress: ProgressFn | None, say: PhaseFn
) -> ReshardResult:
    t0 = time.perf_counter()
    say("planning")
    src_p, reader, cat = ckpt.path, ckpt.reader, ckpt.catalog
    _refuse_kind(ckpt)
    if reader.parts:
        raise ReshardError(
            f"{src_p}: model and optimizer are separate checkpoints ({', '.join(reader.parts)}); reshard writes "
            "one checkpoint directory",
            hint="reshard the model folder on its own (its optimizer state is in the other folder)",
        )
    reader.verify_crc = opts.verify_crc
    layout = ckpt.require_layout()
    identity = source_identity(reader, opts.algorithm)
    content = {k: v for k, v in identity.items() if k != "checkpoint"}  # content only: same bytes from anywhere
    plan = plan_reshard(cat, reader, layout, opts, source=content)
    log.info(
        "plan: %s -> %s, ep_size %d, ep_fsdp_size %d, %d target rank(s), %d tensor(s) with a new expert order",
        layout.layout_name or "unversioned",
        "canonical" if plan.to_version == 2 else "legacy",
        plan.ep_size,
        plan.ep_fsdp_size,
        plan.world,
        len(plan.permuted_keys),
    )
    _check_byte_items(plan, reader, src_p, opts.verify_crc)
    if opts.dry_run:  # this very plan, checked up to the output directory: nothing written
        check_target(dst_p, overwrite=opts.overwrite, source=src_p)
        planned, counts = _planned_files(plan)
        total, names = sum(f["bytes"] for f in planned), _extra_names(src_p, reader)
        return _result(
            ckpt, dst_p, opts, plan, layout, counts, planned, names, total, time.perf_counter() - t0, identity
        )
    group = distributed.current()
    with contextlib.ExitStack() as stack:
        tmp = distributed.enter_output_dir(stack, group, dst_p, overwrite=opts.overwrite, source=src_p, kind="reshard")
        say("writing")
        t_write = time.perf_counter()
        try:
            writer, counts = execute_plan(
                plan,
                reader,
                tmp,
                dst_p if is_url(dst_p) else dst_p.resolve(),
                opts,
                progress,
            )
        except BaseException as e:
            if group.active and not distributed.agreed(e):
                group.agree(e)  # the other ranks learn of it (and raise it) in execute_plan
            raise
        write_seconds = time.perf_counter() - t_write
        extra, files = _root_files(src_p, reader, tmp, writer, opts, identity, plan, say) if group.is_root else ([], [])
    res = _result(
        ckpt, dst_p, opts, plan, layout, counts, files, extra, writer.bytes_written, time.perf_counter() - t0, identity
    )
    return replace(res, write_seconds=round(write_seconds, 3))


def _root_files(
    src_p: Path,
    reader: CheckpointReader,
    tmp: Path,
    writer: DCPWriter,
    opts: ReshardOptions,
    identity: dict[str, Any],
    plan: ReshardPlan,
    say: PhaseFn,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Rank 0's part once the data files are written: the extra files copied, the record written to
    ``layout.json`` where the trainer's own byte item ``layout`` was kept, the manifest written;
    ``(extra names, data files with their sizes)``."""
    world = plan.world
    if _extra_names(src_p, reader):
        say("copying extra files")
    extra = _copy_extra_files(src_p, tmp) if reader.remote is None else _copy_extra_remote(reader, tmp)
    if plan.record_in_sidecar:
        atomic_write_text(tmp / SIDECAR_NAME, json.dumps(plan.record, sort_keys=True, indent=2) + "\n")
    if opts.manifest:
        say("writing manifest.json")
        _write_output_manifest(writer, tmp, opts.algorithm, identity)
    files = [
        {"path": DCPWriter.file_name(r), "bytes": (tmp / DCPWriter.file_name(r)).stat().st_size} for r in range(world)
    ]
    return extra, files


def _extra_names(src: Path, reader: CheckpointReader) -> list[str]:
    """The top-level names :func:`_copy_extra_files` / :func:`_copy_extra_remote` would copy (nothing read)."""
    skip = (METADATA_NAME, SIDECAR_NAME, MANIFEST_NAME, MARKER_NAME)
    if reader.remote is not None:
        names = {rel.split("/", 1)[0] for rel in reader.remote.sizes() if rel not in skip}
        return sorted(n for n in names if not _source_file(n))
    return [e.name for e in _listed(src) if e.name not in skip and not _source_file(e.name)]


def _planned_files(plan: ReshardPlan) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each target rank file with the tensor bytes planned for it, and the chunks to copy verbatim / rewrite."""
    sizes = [0] * plan.world
    counts = {"copied": 0, "rewritten": 0}
    for t in plan.tensors:
        for oc in t.chunks:
            sizes[oc.rank] += oc.chunk.numel * t.dtype.itemsize
            counts["copied" if oc.raw_source is not None else "rewritten"] += 1
    return [{"path": DCPWriter.file_name(r), "bytes": sizes[r]} for r in range(plan.world)], counts


def _check_byte_items(plan: ReshardPlan, reader: CheckpointReader, src_p: Path, verify_crc: bool) -> None:
    """Byte items are copied verbatim, never loaded: still capped like every object, and each checked as the
    ``torch.save`` archive torch will read (:func:`~ckpttool.format.reader.check_saved_archive`, nothing unpickled),
    as every copied chunk is by the chunk locator: a damaged item is refused, never copied into an output that
    looks complete and that ``dcp.load`` cannot read.

    Raises:
        SizeLimitError: a byte item over ``--max-object-size``.
        ChunkError: a byte item that is not a ``torch.save`` archive torch reads the same way (E301).
        ChecksumError: one whose member fails its CRC-32, with ``verify_crc`` (E308).
    """
    cap = limits.current().max_object_bytes
    for bp in plan.byte_items:
        info = reader.storage_info(bp.key) if bp.value is None else None
        if info is None:
            continue
        if info.length > cap:
            raise SizeLimitError(
                f"{src_p / info.relative_path}: byte item {bp.key!r} is {info.length} bytes, over the cap of "
                f"{limits.human(cap)}",
                path=info.relative_path,
                fqn=bp.key,
            )
        where = f"{src_p / info.relative_path}: byte item {bp.key!r}"
        check_saved_archive(reader.raw_bytes(bp.key), where, fqn=bp.key, verify_crc=verify_crc)


def _result(
    ckpt: Checkpoint,
    dst_p: Path,
    opts: ReshardOptions,
    plan: ReshardPlan,
    layout: Any,
    counts: dict[str, int],
    files: list[dict[str, Any]],
    extra: list[str],
    bytes_written: int,
    seconds: float,
    identity: dict[str, Any],
) -> ReshardResult:
    cat, src_p = ckpt.catalog, ckpt.path
    kinds: dict[str, int] = defaultdict(int)
    for t in plan.tensors:
        kinds[t.kind] += 1
    warnings = _extra_state_warnings(cat, extra, origin_world(cat, layout), plan.world)
    newer = ckpt.located.newer_incomplete_note("resharded")
    if newer:  # validate's R001: the run's newest save did not finish, an older step was resharded
        warnings.append(newer)
    return ReshardResult(
        source=str(src_p),
        target=str(dst_p),
        from_version=layout.version,
        from_source=layout.source,
        from_ep_size=layout.ep_size,
        from_ep_fsdp_size=layout.ep_fsdp_size,
        **same_named(plan, "to_version", "ep_size", "ep_fsdp_size"),
        ep_tensors=kinds["ep"],
        permuted=plan.permuted_keys,
        optimizer_tensors=kinds["ep_state"],
        passthrough_tensors=kinds["passthrough"],
        byte_items=sum(1 for bp in plan.byte_items if bp.value is None),  # the new layout record is no copy
        chunks_copied=counts["copied"],
        chunks_rewritten=counts["rewritten"],
        files=files,
        extra_files=extra,
        bytes_written=bytes_written,
        seconds=round(seconds, 3),
        warnings=warnings,
        source_identity=identity,
        manifest=MANIFEST_NAME if opts.manifest else None,
        dry_run=opts.dry_run,
    )


def _write_output_manifest(writer: DCPWriter, out: Path, algorithm: str, identity: dict[str, Any]) -> None:
    write_output_manifest(writer, out, algorithm, identity)


def _extra_state_warnings(cat: Catalog, extra: list[str], src_world: int, world: int) -> list[str]:
    """Per-rank ``extra_state`` files cannot be fabricated for a mesh of another size: say what was done.

    ``src_world``: ranks of the mesh that wrote the files (:func:`~.plan.origin_world`); ``world``: target ranks.
    """
    if "extra_state" not in extra:
        return []
    have = sorted({f.rank for f in cat.extra_state if f.rank is not None})
    if not have or src_world == world:
        return []
    missing = [r for r in range(world) if r not in have]
    unused = [r for r in have if r >= world]
    what = []
    if missing:
        what.append(
            f"target rank(s) {_ranks(missing)} have no extra_state file and resume with fresh scheduler/step/RNG state"
        )
    if unused:
        what.append(f"the files of source rank(s) {_ranks(unused)} belong to no target rank")
    return [
        f"extra_state/ copied unchanged from the source mesh of {src_world} rank(s) (files for rank(s) "
        f"{_ranks(have)}); the target mesh has {world} rank(s)"
        + (f": {'; '.join(what)}" if what else "")
        + ". Per-rank extra state cannot be converted; restore scheduler/step/RNG state for the new mesh yourself"
    ]


def _ranks(ranks: list[int]) -> str:
    return str(ranks[:16])[:-1] + ", ...]" if len(ranks) > 16 else str(ranks)
