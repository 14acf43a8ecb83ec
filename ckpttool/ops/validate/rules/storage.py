"""Storage rules (``S``): ``.metadata``, data files, chunks, byte items, ``extra_state``.

Facts checked (``docs/design.md`` §1 and §6): every ``relative_path`` resolves inside the
checkpoint and exists; every chunk's ``[offset, offset+length)`` lies inside its file and
holds at least ``numel * itemsize`` bytes; chunks tile their tensor exactly; stream
transforms can be decoded; data files on disk are referenced; every writing rank that
saved data also saved its ``extra_state`` file (when the trainer writes them).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import cast

from ckpttool.errors import (
    ChecksumError,
    DataFileError,
    HyperparameterError,
    PathEscapeError,
    RemoteStorageError,
    TrustRequiredError,
)
from ckpttool.format.dcp_safetensors import DCP_SAFETENSORS
from ckpttool.format.metadata import StorageInfo, TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.ops.validate.base import RULES, Finding, Severity, rule
from ckpttool.ops.validate.context import Context

# The rules over every chunk first test, column-wise over all rows (Context.storage_columns), whether any
# row can give a finding; only then do they walk the rows one by one (what they report comes from that walk).
_path, _offset, _length = (operator.itemgetter(i) for i in range(3))
#: The column-wise tests above may skip the row walk. ``False`` walks every row (the slow path): the same
#: findings by construction, which tests/security/test_fast_slow.py checks over the hostile corpus.
COLUMN_PREFILTERS = True


def _skip(no_row_can_fail: bool) -> bool:
    """Whether a rule may skip its row walk: its column-wise test says no row can fail, and prefilters are on."""
    return COLUMN_PREFILTERS and no_row_can_fail


@rule("S001")
def metadata_unreadable(ctx: Context) -> Iterator[Finding]:
    # A readable .metadata gives a Context at all; the runner reports an unreadable one
    # (open_checkpoint raised) as this rule's finding.
    return iter(())


@rule("S009")
def path_escapes(ctx: Context) -> Iterator[tuple[str, str]]:
    for rel in ctx.data_files():
        err = ctx.file_error(rel)
        if isinstance(err, PathEscapeError):
            yield rel, err.message


@rule("S002")
def data_file_missing(ctx: Context) -> Iterator[tuple[str, str]]:
    replicas = ctx.reader.metadata.replicas  # a use_collectives=False save: each rank loads its own copies
    files = dict.fromkeys([*ctx.data_files(), *(info.relative_path for _, _, info in replicas)])
    missing = [rel for rel in files if isinstance(ctx.file_error(rel), DataFileError)]
    if not missing:
        return
    users: dict[str, int] = defaultdict(int)
    for _, _, info in [*ctx.storage_items(), *replicas]:
        if info is not None:
            users[info.relative_path] += 1
    for rel in missing:
        yield rel, f"{rel}: data file missing; {users[rel]} chunks/byte items are stored in it"


@rule("S003")
def chunk_past_eof(ctx: Context) -> Iterator[tuple[str, str]]:
    if _skip(not _any_past_eof(ctx)):
        return
    by_file: dict[str, list[tuple[str, int]]] = defaultdict(list)
    sizes: dict[str, int | None] = {}  # relative path -> size (None: the file is unusable, another rule's)
    for key, _, info in [*ctx.storage_items(), *_bounded_replicas(ctx)]:
        if info is None:
            continue
        rel = info.relative_path
        if rel in sizes:
            size = sizes[rel]
        else:
            size = sizes[rel] = None if ctx.file_error(rel) is not None else ctx.reader.file_size(rel)
        if size is not None and info.offset + info.length > size:
            by_file[rel].append((key, info.offset + info.length))
    for rel, bad in by_file.items():
        size = ctx.reader.file_size(rel)
        need = max(end for _, end in bad)
        yield (
            rel,
            (
                f"{rel}: {len(bad)} chunk(s) end past the end of the file ({size} bytes, needs {need}), "
                f"first {bad[0][0]!r}"
            ),
        )


def _any_past_eof(ctx: Context) -> bool:
    """Does some row's record end past the end of its (usable) data file?"""
    cols = ctx.storage_columns()
    infos = cast("list[StorageInfo]", list(filter(None, cols.infos)) if cols.missing else cols.infos)
    paths = list(map(_path, infos))
    limit = {  # relative path -> size (infinite: the file is unusable, another rule's)
        rel: math.inf if ctx.file_error(rel) is not None else ctx.reader.file_size(rel) for rel in dict.fromkeys(paths)
    }
    ends = map(operator.add, map(_offset, infos), map(_length, infos))
    return any(map(operator.gt, ends, map(limit.__getitem__, paths))) or any(
        ctx.file_error(info.relative_path) is None
        and info.offset + info.length > ctx.reader.file_size(info.relative_path)
        for _, _, info in _bounded_replicas(ctx)
    )


def _bounded_replicas(ctx: Context) -> list[tuple[str, tuple[int, ...] | None, StorageInfo]]:
    """The higher ranks' copies of a ``use_collectives=False`` save (each rank's ``dcp.load`` reads its own) whose
    windows are known: ``torch.save`` chunks from the metadata, a safetensors-serialized save's from each file's blob
    header (``format.dcp_safetensors`` resolves the copies' windows as the chunks' own)."""
    md = ctx.reader.metadata
    return list(md.replicas) if md.serialization in ("torch_save", DCP_SAFETENSORS) else []


@rule("S004")
def chunks_do_not_tile(ctx: Context) -> Iterator[tuple[str, str]]:
    metas = ctx.distinct_metas().values()  # entries of one layout share one TensorMeta
    if _skip(not any(isinstance(m, TensorMeta) and tiling_problem(m) is not None for m in metas)):
        return
    seen: dict[int, str | None] = {}  # id of a TensorMeta -> its problem (entries of one layout share one)
    for key, meta in ctx.reader.metadata.entries.items():
        if isinstance(meta, TensorMeta):
            problem = seen.get(id(meta), "")
            if problem == "":
                problem = seen[id(meta)] = tiling_problem(meta)
            if problem is not None:
                yield key, f"{key}: chunks do not tile the {list(meta.size)} tensor ({problem})"


@rule("S012")
def chunk_larger_than_record(ctx: Context) -> Iterator[tuple[str, str]]:
    cols = ctx.storage_columns()
    if not cols.missing and not cols.transforms:
        lengths = map(_length, cast("list[StorageInfo]", cols.infos))
        if _skip(not any(map(operator.gt, cols.needs, lengths))):
            return  # every record holds its chunk's bytes (byte items' rows need -1)
    entries = ctx.reader.metadata.entries
    numel: dict[tuple[int, ...], int] = {}  # many chunks share their sizes
    reported: set[str] = set()
    for key, c, info in ctx.storage_items():
        if c is None or info is None or info.transform_descriptors or key in reported:
            continue
        n = numel.get(c.sizes)
        if n is None:
            n = numel[c.sizes] = c.numel
        meta = entries[key]
        assert isinstance(meta, TensorMeta)
        need = n * meta.dtype.itemsize
        if need > info.length:
            reported.add(key)
            declared = f"{key}: chunk at {list(c.offsets)} declares {list(c.sizes)} x {meta.dtype} = {need} bytes"
            yield key, f"{declared} but its record in {info.relative_path} has {info.length}"


@rule("S008")
def storage_entry_missing(ctx: Context) -> Iterator[tuple[str, str]]:
    if _skip(not ctx.storage_columns().missing):
        return
    seen = set()
    for key, chunk, info in ctx.storage_items():
        if info is None and key not in seen:
            seen.add(key)
            where = f" chunk at {list(chunk.offsets)}" if chunk is not None else ""
            yield key, f"{key}{where}: no storage entry in .metadata"


def _transform_problem(descriptors: tuple[str, ...]) -> str | None:
    try:
        from torch.distributed.checkpoint._extension import ExtensionRegistry
    except ImportError:  # pragma: no cover - torch without stream transforms
        return "this torch has no stream-transform support"
    try:
        exts = ExtensionRegistry().from_descriptor_list(list(descriptors))
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:80]}"
    for ex in exts:
        available = getattr(ex, "is_available", None)
        if callable(available) and not available():
            return f"{type(ex).__name__} needs a package that is not installed"
    return None


@rule("S005")
def unsupported_transform(ctx: Context) -> Iterator[tuple[str, str]]:
    if _skip(not ctx.storage_columns().transforms):
        return
    cache: dict[tuple[str, ...], str | None] = {}
    for key, _, info in ctx.storage_items():
        if info is None or not info.transform_descriptors:
            continue
        d = info.transform_descriptors
        if d not in cache:
            cache[d] = _transform_problem(d)
        if cache[d] is not None:
            yield key, f"{key}: transform {list(d)} cannot be decoded ({cache[d]})"


@rule("S006")
def unreferenced_data_file(ctx: Context) -> Iterator[tuple[str, str]]:
    # an empty file holds nothing to lose: `import` / `reshard` write one for each target rank
    # that gets no chunk (more ranks than rows), and those outputs are clean under --strict
    for f in ctx.cat.data_files:
        if not f.referenced and f.size != 0:
            yield f.relative_path, f"{f.relative_path}: data file ({f.size} bytes) is referenced by no .metadata entry"


@rule("S007")
def extra_state_ranks_missing(ctx: Context) -> Iterator[tuple[str, str] | Finding]:
    if not ctx.cat.extra_state:
        return
    have = {f.rank for f in ctx.cat.extra_state if f.rank is not None}
    missing = [r for r in ctx.cat.ranks if r not in have]
    if not missing:
        return
    msg = (
        f"extra_state: no file for writing rank(s) {missing[:16]} "
        f"(ranks {list(ctx.cat.ranks)[:16]} wrote data, extra_state has {sorted(have)[:16]})"
    )
    src = _resharded_from_other_mesh(ctx)
    if src is None:
        yield "extra_state", msg
        return
    # `ckpttool reshard` copied extra_state/ unchanged from a mesh of another size: per-rank state cannot be
    # made up for the new ranks, and reshard said so when it wrote the checkpoint. Not a damaged save.
    yield dataclasses.replace(
        RULES["S007"].make(
            "extra_state",
            f"{msg}; expected: the checkpoint was converted by `ckpttool reshard` from a mesh of {src} to one of "
            f"{len(ctx.cat.ranks)} rank(s), and extra_state/ was copied unchanged from the source",
            "ranks without a file resume with fresh scheduler/step/RNG state; restore that state for the new "
            "mesh if the job needs it",
        ),
        severity=Severity.info,
    )


def _resharded_from_other_mesh(ctx: Context) -> str | None:
    """``"N rank(s)"`` when the layout record says reshard converted this checkpoint from a mesh of another size.

    The size is that of the mesh that wrote the per-rank files (``converted_from.origin_world``, kept
    through repeated reshards), else ``world``, else ``ep_size * ep_fsdp_size``.
    """
    layout = ctx.layout
    if layout is None or layout.record is None:
        return None
    cf = layout.record.raw.get("converted_from")
    if not isinstance(cf, dict):
        return None
    world = cf.get("origin_world") if type(cf.get("origin_world")) is int else cf.get("world")
    if type(world) is not int:
        p, f = cf.get("ep_size"), cf.get("ep_fsdp_size")
        world = p * f if type(p) is int and type(f) is int else None
    if world is None:
        return "unknown size"
    return None if world == len(ctx.cat.ranks) else f"{world} rank(s)"


@rule("S011")
def byte_item_unreadable(ctx: Context) -> Iterator[Finding]:
    r = RULES["S011"]
    for key, e in ctx.byte_item_errors.items():
        if isinstance(e, (DataFileError, PathEscapeError)):
            continue  # reported by S002/S003/S009
        # --trust-pickle is the way only for an item weights_only refuses: a corrupt one it would not mend; an item
        # the store would not give (permissions, network: E140-E144) is not damaged, its error says what to do
        own_hint = (TrustRequiredError, HyperparameterError, RemoteStorageError)
        hint = e.hint if isinstance(e, own_hint) else _DAMAGED_ITEM_HINT
        yield r.make(key, e.message, hint, e.code)


_DAMAGED_ITEM_HINT = (
    "the stored bytes are damaged (a file cut, overwritten or copied from another save): copy the checkpoint "
    "again from a good source, or use an earlier checkpoint; --trust-pickle does not read a corrupt item"
)


@rule("S013")
def extra_state_unreadable(ctx: Context) -> Iterator[Finding]:
    r = RULES["S013"]
    for st in ctx.ckpt.extra_state():
        if st.error is not None:
            hint = st.error.hint or None
            if st.error.code in ("E301", "E308") and hint == st.error.default_hint:  # the hint of a data file
                hint = "the extra_state file is damaged: copy it again from a good source, or use an earlier checkpoint"
            yield r.make(st.file.relative_path, st.error.message, hint, st.error.code)


@rule("S010")
def chunk_unreadable(ctx: Context) -> Iterator[Finding]:
    return _read_errors(ctx, "S010", checksum=False)


@rule("S014")
def chunk_checksum_mismatch(ctx: Context) -> Iterator[Finding]:
    return _read_errors(ctx, "S014", checksum=True)


def _read_errors(ctx: Context, code: str, *, checksum: bool) -> Iterator[Finding]:
    """Rule ``code``'s findings: the ``--deep`` pass's read errors that are (or are not) CRC-32 mismatches."""
    r = RULES[code]
    for key, e in ctx.deep_result.read_errors.items() if ctx.deep_result is not None else ():
        if isinstance(e, ChecksumError) == checksum:
            # a chunk the store would not give (permissions, network: E140-E144) is not damaged: its error's hint
            yield r.make(key, e.message, e.hint if isinstance(e, RemoteStorageError) else None, e.code)


@rule("S015")
def manifest_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    from ckpttool.ops.manifest import verify_manifest, verify_safetensors_manifest

    if ctx.manifest.kind == "safetensors":  # an export's manifest: files, headers and extents, as `manifest --verify`
        if ctx.reader.remote is not None:
            from ckpttool.errors import UsageError

            raise UsageError(
                "a safetensors export's manifest is verified on a local directory",
                param="manifest",
                hint="copy the export locally, or pass the DCP checkpoint's own manifest",
            )
        problems = verify_safetensors_manifest(ctx.reader.path, ctx.manifest)
    else:
        problems = verify_manifest(ctx.reader, ctx.manifest, beside_of=Path(ctx.ckpt.located.model))
    for p in problems:
        yield p.key, f"{p.kind}: {p.message}"


@rule("S016")
def manifest_beside_unchecked(ctx: Context) -> Iterator[tuple[str | None, str]]:
    from ckpttool.ops.manifest import (
        remote_beside,
        unchecked_beside,
        unchecked_sizes,
        unchecked_training_state,
        unchecked_values,
    )

    if ctx.manifest.kind == "safetensors":  # an export's manifest lists its files itself
        return
    where = ctx.manifest.path or "the manifest"
    remote = remote_beside(ctx.reader)  # a remote checkpoint's files beside its data: not fetched, whatever it lists
    if remote:
        shown = ", ".join(remote[:5]) + (f" (+{len(remote) - 5} more)" if len(remote) > 5 else "")
        yield (
            None,
            (
                f"{where}: {len(remote)} file(s) beside the data of a remote checkpoint not checked (not fetched through "
                f"object storage): {shown}"
            ),
        )
    for what, names in (
        ("files beside the data", unchecked_beside(ctx.reader, ctx.manifest)),
        ("training_state", unchecked_training_state(ctx.reader, ctx.manifest, Path(ctx.ckpt.located.model))),
    ):
        if names:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            yield None, f"{where}: lists no {what}; {len(names)} there not checked: {shown}"
    unsized = unchecked_sizes(ctx.reader, ctx.manifest)
    if unsized:
        shown = ", ".join(unsized[:5]) + (f" (+{len(unsized) - 5} more)" if len(unsized) > 5 else "")
        lacks = (
            "records no data file sizes" if ctx.manifest.data_files is None else "leaves data files out of data_files"
        )
        yield (
            None,
            f"{where}: {lacks}; bytes after the last chunk of {len(unsized)} not checked: {shown}",
        )
    unvalued = unchecked_values(ctx.reader, ctx.manifest)
    if unvalued:
        shown = ", ".join(unvalued[:5]) + (f" (+{len(unvalued) - 5} more)" if len(unvalued) > 5 else "")
        yield (
            None,
            f"{where}: digests the empty storage window of {len(unvalued)} byte item(s) read as values; "
            f"their values not checked: {shown}",
        )
