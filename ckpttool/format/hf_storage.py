"""Checkpoints written by torch's ``HuggingFaceStorageWriter``: safetensors files as DCP storage.

Source: ``torch/distributed/checkpoint/hf_storage.py`` and ``_hf_utils.py`` (no ``.metadata``;
files ``model-0000K-of-0000N.safetensors`` with an index, or per-rank
``shard-0000R-model-...`` files whose ``__metadata__["DCP_SHARDING_INFO"]`` gives each
tensor's ``saved_offsets``; table in ``docs/design.md`` §1). :func:`load_hf_storage_metadata`
builds the :class:`CheckpointMetadata` torch's ``HuggingFaceStorageReader.read_metadata``
builds (one chunk per stored tensor) from headers read by the bounded
:func:`ckpttool.format.safetensors.read_header`; ``serialization`` is ``"safetensors"``, so
the chunk locator treats a window as the raw record. Torch-free.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, IncompleteCheckpointError, MetadataError, Refusal
from ckpttool.format.files import hub_blobs, hub_unfinished_download, link_to_nothing, resolve_inside
from ckpttool.format.jsonfile import unique_pairs
from ckpttool.format.metadata import (
    BytesMeta,
    CheckpointMetadata,
    ChunkMeta,
    DType,
    RankShards,
    StorageInfo,
    TensorMeta,
)
from ckpttool.format.safetensors import SAFETENSORS_TAGS, HeaderError, read_header

__all__ = [
    "ADAPTER_PREFIX",
    "HF_INDEX_NAME",
    "check_hf_index",
    "hf_storage_files",
    "read_hf_index",
    "mistral_consolidated",
    "load_hf_storage_metadata",
    "read_safetensors_header",
    "rank_shards",
    "shard_rank",
]

HF_INDEX_NAME = "model.safetensors.index.json"
#: PEFT's ``adapter_model.safetensors``: adapter weights beside a model, never part of it.
ADAPTER_PREFIX = "adapter_model"
_SHARDING_KEY = "DCP_SHARDING_INFO"
_OFFSETS_KEY = "saved_offsets"
_SHARD_RE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
#: The folder ``enable_consolidation`` writes the per-rank shards to, below the consolidated copy
#: (``_hf_utils.SHARDED_DIR_NAME``).
SHARDED_DIR = "sharded"


_bad = Refusal(
    MetadataError,
    "{path}: not a valid safetensors file ({why})",
    hint="the file is damaged or was not written by safetensors / HuggingFaceStorageWriter",
)


#: safetensors dtype tags (``safetensors/src/tensor.rs`` ``Dtype``) that ckpttool does not read: a file holding them is
#: valid, not damaged (AMD's FNUZ FP8, the sub-byte FP4/FP6 of MX formats).
_UNREAD_TAGS = {
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "4-bit float",
    "F6_E2M3": "6-bit float",
    "F6_E3M2": "6-bit float",
}


_HEADER_WORDS = {
    "short": "{size} bytes, shorter than the 8-byte header length",
    "too_long": "header length {length} exceeds the file ({size} bytes) or {cap} bytes",
    "past_end": "header length {length} exceeds the file ({size} bytes) or {cap} bytes",
    "truncated": "header truncated",
    "not_json": "header is not JSON: {cause}",
    "not_object": "header is not a JSON object",
}


#: The hint of a safetensors file or index the OS refuses to read (a folder without ``.metadata``).
_UNREADABLE = "check the file's permissions and that it is a complete copy, then run again"
#: The hint of a damaged ``model.safetensors.index.json``.
_BAD_INDEX = (
    "the index is damaged: restore model.safetensors.index.json from a good copy (or re-download or re-save the model)"
)


def _header_error(path: Path, e: HeaderError) -> MetadataError:
    return _bad(path, e.reason(_HEADER_WORDS))


def read_safetensors_header(path: Path, size: int | None = None) -> tuple[dict[str, Any], int]:
    """:func:`ckpttool.format.safetensors.read_header` of a checkpoint's safetensors file, refusals as :class:`MetadataError`.

    Args:
        path: the file.
        size: its size in bytes (``stat`` when ``None``).

    Returns:
        ``(header, data_start)``: the parsed header (a dict, duplicate keys refused) and the
        absolute offset of the data region (``8 + N``).

    Raises:
        MetadataError: unreadable, a header length past the file or above
            :func:`~ckpttool.format.safetensors.header_cap`, not UTF-8 JSON, or not a JSON object.
        JsonDepthError, IntegerRangeError: a header past the JSON bounds.
        NotRegularFileError: ``path`` is a FIFO, device, socket or directory.
    """
    try:
        return read_header(path, size)
    except HeaderError as e:
        raise _header_error(path, e) from None
    except OSError as e:
        raise MetadataError(f"{path}: cannot read ({e.strerror})", path=path, hint=_UNREADABLE) from e


#: The DCP path's bounds (``format/unpickler.py``): at most 64 dims, each at most 2^62.
MAX_NDIM = 64
MAX_DIM_SIZE = 2**62
_INT64_MAX = 2**63 - 1


def _int_list(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape or offsets tuple: a list of at most 64 ints in ``[0, 2^62]``; ``None`` otherwise."""
    if (
        not isinstance(value, list)
        or len(value) > MAX_NDIM
        or not all(type(v) is int and 0 <= v <= MAX_DIM_SIZE for v in value)
    ):
        return None
    return tuple(value)


def _extent_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why a tensor of ``shape`` cannot exist in torch (its strides or bytes past int64), else ``None``.

    Checked on the non-zero dims: a ``[0, 2**70]`` tensor holds no bytes, but torch cannot
    describe it (``dcp.load`` overflows on its strides).
    """
    n = itemsize
    for d in shape:
        if d:
            n *= d
            if n > _INT64_MAX:
                return f"shape {list(shape)} spans more than 2^63 bytes"
    return None


def hf_storage_files(path: Path) -> list[str]:
    """The safetensors files that make up the checkpoint in ``path`` (names, sorted).

    Consolidated ``model-*.safetensors`` files win over per-rank ``shard-*`` files in the
    same directory (the consolidation's inputs are in ``sharded/``, which is not read). PEFT's
    ``adapter_model*.safetensors`` beside model files are not model weights and are left out; a
    directory holding only adapter files is a PEFT adapter (what ``diff`` and ``export`` of LoRA read).
    Symlinks are listed like files; reading one that leaves the directory is refused
    (:func:`ckpttool.format.files.resolve_inside`).
    """
    try:
        every = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") and not n.startswith("."))
    except OSError:
        return []
    names = [n for n in every if not n.startswith(ADAPTER_PREFIX)] or every
    names = [n for n in names if n not in mistral_consolidated(path, names)]
    consolidated = [n for n in names if not _SHARD_RE.match(n)]
    return consolidated or names


#: Mistral's own single-file save (``consolidated.safetensors``: Mistral's names, ``layers.N.attention.wq.weight``),
#: which Mistral's Hugging Face repositories ship beside the ``save_pretrained`` shards and their index.
_MISTRAL_RE = re.compile(r"^consolidated(?:\.\d+)?\.safetensors$")


def mistral_consolidated(path: Path, names: list[str]) -> list[str]:
    """Of the safetensors file ``names`` in ``path``, Mistral's ``consolidated*.safetensors`` beside an index and the
    files it names: not part of the ``save_pretrained`` model (transformers reads only the index's files), so
    :func:`hf_storage_files` leaves them out, as it leaves out a PEFT adapter; ``[]`` without an index (then such a
    file is the folder's only save, read as any other)."""
    found = [n for n in names if _MISTRAL_RE.match(n)]
    if not found or len(found) == len(names) or not os.path.lexists(path / HF_INDEX_NAME):
        return []
    return found


def shard_rank(name: str) -> int | None:
    """Writing rank of a ``shard-0000R-model-...safetensors`` file (``R - 1``), else ``None``."""
    m = _SHARD_RE.match(os.path.basename(name))
    return int(m.group(1)) - 1 if m else None


def load_hf_storage_metadata(path: Path, files: list[str] | None = None) -> CheckpointMetadata:
    """Build the DCP metadata of a ``HuggingFaceStorageWriter`` checkpoint from its safetensors headers.

    Args:
        path: the directory holding the ``*.safetensors`` files.
        files: only these files of ``path`` (one ``.safetensors`` file given on its own, as ``diff`` takes it:
            its neighbours and the folder's index are not read); default: :func:`hf_storage_files`.

    Returns:
        A :class:`CheckpointMetadata` with ``serialization="safetensors"``: one chunk per
        stored tensor (offsets from ``DCP_SHARDING_INFO``, else zeros), its storage window
        the tensor's ``data_offsets`` made absolute; no byte items, no planner data.

    Raises:
        MetadataError: no safetensors file, a malformed header (unknown dtype, a negative or
            non-integer shape, ``data_offsets`` outside the file or not matching the shape,
            bad sharding info, two tensors whose ``data_offsets`` overlap), or two files storing
            the same chunk of a key.
    """
    alone = files is not None
    files = hf_storage_files(path) if files is None else files
    if not files:
        raise MetadataError(
            f"{path}: no .metadata and no .safetensors files",
            path=path,
            hint="pass a DCP checkpoint (the directory holding .metadata) or a folder of .safetensors files",
        )
    if not alone:
        _check_one_save(path, files)
    found = _Found()
    for name in files:
        _read_file(path, name, found)
    if not alone:  # the index describes the folder, not one file taken on its own
        check_hf_index(path, files, found.storage)
    entries: dict[str, TensorMeta | BytesMeta] = {}
    for key, cs in found.chunks.items():
        ndim = len(cs[0].sizes)
        if any(len(c.sizes) != ndim for c in cs):
            raise MetadataError(
                f"{path}: chunks of {key!r:.80} have different numbers of dims",
                path=path,
                fqn=key,
                hint=f"the safetensors files of one tensor disagree ({_SHARDING_KEY}); a file is damaged or from "
                "another save: copy the checkpoint again or use an earlier one",
            )
        size_ = tuple(max(c.offsets[d] + c.sizes[d] for c in cs) for d in range(ndim))
        entries[key] = TensorMeta(DType(found.dtypes[key]), size_, tuple(cs))
    shards = None if alone else rank_shards(path, files, entries)
    return CheckpointMetadata(entries=entries, storage=found.storage, serialization="safetensors", shards=shards)


#: The hint of a ``save_distributed`` folder proven incomplete.
_RANK_MISSING_HINT = (
    "a rank's shard files were deleted or not copied: copy every shard-0000R-model-...safetensors file the save "
    "wrote (or use torch's consolidated copy, written with enable_consolidation=True)"
)


def rank_shards(path: Path, files: list[str], entries: dict[str, TensorMeta | BytesMeta]) -> RankShards | None:
    """What the per-rank files of a ``HuggingFaceStorageWriter(save_distributed=True)`` folder prove; ``None`` when
    ``files`` are not all ``shard-0000R-model-0000I-of-0000N.safetensors`` files.

    torch records no world size and no global shape (each tensor's size is the largest extent of the pieces
    present), so the evidence is: the rank numbers of the files (a gap is a rank missing); the file indices each
    rank wrote (one file per index holding its items; an index that some ranks wrote and another not is noted);
    and, for a folder named ``sharded`` below torch's consolidated copy (``enable_consolidation``), the
    consolidated files' full shapes, which must equal those of the shards.

    Raises:
        IncompleteCheckpointError: ``E202``, a gap in the rank numbers, or keys or shapes that differ from the
            consolidated copy's.
        MetadataError: ``E200``, files of one folder that disagree on the number of model files (``of-0000N``).
    """
    parsed = [_SHARD_RE.match(n) for n in files]
    if not files or not all(parsed):
        return None
    per_rank: dict[int, set[int]] = {}
    for m in parsed:
        assert m is not None
        per_rank.setdefault(int(m.group(1)) - 1, set()).add(int(m.group(2)))
    if len({int(m.group(3)) for m in parsed if m is not None}) > 1:
        raise MetadataError(
            f"{path}: its shard files disagree on the number of model files (of-0000N): files of several saves",
            path=path,
            hint="a folder holds one save: move the other save's shard files out of it",
        )
    ranks = tuple(sorted(per_rank))
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        r = missing[0]
        raise IncompleteCheckpointError(
            f"{path}: no file of writing rank {r} (shard-{r + 1:05d}-model-*.safetensors) while rank {ranks[-1]} "
            f"wrote its files: {len(missing)} rank(s) of at least {ranks[-1] + 1} missing",
            path=path,
            hint=_RANK_MISSING_HINT,
        )
    every = set().union(*per_rank.values())
    gaps = tuple((r, i) for r in ranks for i in sorted(every - per_rank[r]))
    return RankShards(ranks, _consolidated_proof(path, entries), gaps)


#: NeMo Automodel's consolidated HF copy inside its per-rank model folder (``model/consolidated/``).
NEMO_CONSOLIDATED_DIR = "consolidated"


def _consolidated_proof(path: Path, entries: dict[str, TensorMeta | BytesMeta]) -> str | None:
    """The consolidated copy whose keys and shapes the shards' ``entries`` equal (its path): torch's above a
    ``sharded`` folder, or NeMo Automodel's ``consolidated/`` inside the folder; ``None`` where there is no
    readable copy, or (NeMo's) one that differs.

    Raises:
        IncompleteCheckpointError: ``E202``, a key or shape of torch's copy the shards do not hold.
    """
    if path.name == SHARDED_DIR:
        return _proof_of(path, path.parent, entries, strict=True)
    return _proof_of(path, path / NEMO_CONSOLIDATED_DIR, entries, strict=False)


def _proof_of(path: Path, copy: Path, entries: dict[str, TensorMeta | BytesMeta], *, strict: bool) -> str | None:
    """``str(copy)`` where the consolidated files in ``copy`` hold exactly the keys and shapes of ``entries``;
    ``None`` for no readable copy, or (not ``strict``) one that differs; ``strict``: a difference is ``E202``."""
    if not os.path.isdir(copy) or not any(not _SHARD_RE.match(n) for n in hf_storage_files(copy)):
        return None
    try:
        full = load_hf_storage_metadata(copy).entries
    except CkptError:  # an unreadable copy proves nothing (and is not the folder opened)
        return None
    if not strict:
        same = set(full) == set(entries) and all(_size(full[k]) == _size(entries[k]) for k in full)
        return str(copy) if same else None
    parent = copy
    for key, meta in full.items():
        ours = entries.get(key)
        got = ours.size if isinstance(ours, TensorMeta) else None
        want = meta.size if isinstance(meta, TensorMeta) else None
        if got != want:
            held = f"as {list(got)}" if got is not None else "not at all"
            raise IncompleteCheckpointError(
                f"{path}: the shards hold {key!r:.80} {held}, torch's consolidated copy {parent} as "
                f"{list(want) if want is not None else '-'}: shard files are missing",
                path=path,
                hint=f"{_RANK_MISSING_HINT}; the consolidated copy in {parent} holds the full tensors",
            )
    extra = sorted(set(entries) - set(full))
    return None if extra else str(parent)


def _size(meta: TensorMeta | BytesMeta) -> tuple[int, ...] | None:
    return meta.size if isinstance(meta, TensorMeta) else None


#: ``save_pretrained``'s single-file save; with it beside an index, transformers loads it alone.
HF_SINGLE_NAME = "model.safetensors"


def _check_one_save(path: Path, files: list[str]) -> None:
    """Refuse a folder holding ``model.safetensors`` beside an index that names other files: two saves.

    transformers' ``from_pretrained`` looks for ``model.safetensors`` first and loads it alone, never reading the
    index or its shards (``modeling_utils._get_resolved_checkpoint_files``); reading the folder as one model would mix
    the two saves, and reading the single file alone would silently pass over the other. An index that names only
    ``model.safetensors`` (an ``export`` of one shard) is that one save.

    Raises:
        MetadataError: ``E200``, naming both files and the shards the index lists.
    """
    if HF_SINGLE_NAME not in files:
        return
    wm = read_hf_index(path)
    others = sorted(set(wm.values()) - {HF_SINGLE_NAME}) if wm is not None else []
    if not others:
        return
    more = f" (+{len(others) - 1} more)" if len(others) > 1 else ""
    raise MetadataError(
        f"{path}: holds both {HF_SINGLE_NAME} and {HF_INDEX_NAME} (which lists {others[0]!r:.80}{more}): two saves; "
        f"transformers' from_pretrained would load {HF_SINGLE_NAME} alone and ignore the index and its shards",
        path=path / HF_SINGLE_NAME,
        hint=_in_snapshot_hint(path, f"{HF_SINGLE_NAME}, or the shards {HF_INDEX_NAME} lists")
        or f"keep the save you mean: move {HF_SINGLE_NAME} out of the folder, or {HF_INDEX_NAME} and the "
        "shards it lists",
    )


def _in_snapshot_hint(path: Path, save: str) -> str | None:
    """The hint for a folder of two saves that is a hub cache snapshot (:func:`hub_blobs`): the files of ``save`` copied
    out (the cache's files are huggingface_hub's, never moved); ``None`` for any other folder."""
    try:
        in_hub = hub_blobs(path.resolve()) is not None
    except (OSError, RuntimeError):
        in_hub = False
    if not in_hub:
        return None
    return (
        f"a Hugging Face hub snapshot, whose files are left in place: copy the save you mean ({save}) with "
        "config.json into a folder of its own (`cp -L`: the snapshot's files are links) and pass that folder"
    )


def _link_target_gone(p: Path) -> IncompleteCheckpointError:
    """E202 for the file ``p``, a symlink to nothing (:func:`~ckpttool.format.files.link_to_nothing`)."""
    message, hint = link_to_nothing(p)
    return IncompleteCheckpointError(message, path=p, hint=hint)


def read_hf_index(path: Path) -> dict[str, str] | None:
    """``weight_map`` of ``path/model.safetensors.index.json`` (``None``: no index), bounded and checked.

    Raises:
        MetadataError: not a JSON object with a ``weight_map`` of tensor name -> file name.
        SizeLimitError, JsonDepthError, IntegerRangeError, PathEscapeError, NotRegularFileError:
            as any JSON file read.
    """
    from ckpttool.format import limits
    from ckpttool.format.files import read_regular
    from ckpttool.format.jsonfile import parse_json

    shown = path / HF_INDEX_NAME
    if not os.path.lexists(shown):
        return None
    try:
        raw = read_regular(
            resolve_inside(path, HF_INDEX_NAME, what="index"), limits.current().max_object_bytes, what="index"
        )
        index = parse_json(raw, str(shown))
    except PermissionError as e:  # another user's file, chmod 000: not a damaged index
        raise MetadataError(f"{shown}: cannot read ({e.strerror})", path=shown, hint=_UNREADABLE) from None
    except FileNotFoundError:
        if not os.path.islink(shown):  # removed since it was seen
            raise MetadataError(
                f"{shown}: not a readable index (FileNotFoundError)", path=shown, hint=_BAD_INDEX
            ) from None
        raise _link_target_gone(shown) from None  # a hub snapshot's index whose blob is gone
    except (ValueError, OSError) as e:  # not JSON / not UTF-8 / unreadable
        raise MetadataError(
            f"{shown}: not a readable index ({type(e).__name__})", path=shown, hint=_BAD_INDEX
        ) from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(type(v) is str for v in wm.values()):
        raise MetadataError(f"{shown}: no weight_map of tensor name -> file name", path=shown, hint=_BAD_INDEX)
    return wm


def check_hf_index(path: Path, files: list[str], storage: dict[tuple[str, Any], StorageInfo]) -> None:
    """The index of a sharded HF folder, if any, agrees with the shards read (``files``, holding ``storage``).

    What ``from_pretrained`` loads is the index's ``weight_map``: a shard it names that is missing,
    a shard on disk it does not name (an added file), a tensor it places in another file than the
    one holding it, or a stored tensor it does not list would each load something other than
    what was checked.

    Raises:
        IncompleteCheckpointError: ``E202``, a shard the index names is missing.
        MetadataError: ``E200``, any other disagreement (named, with counts).
    """
    wm = read_hf_index(path)
    if wm is None:
        return
    shown = path / HF_INDEX_NAME
    named = set(wm.values())
    outside = sorted(n for n in named if not n or n != os.path.basename(n) or n in (".", "..") or "\0" in n)
    if outside:  # "../other/model.safetensors", "/etc/x": never read, and not "missing" either
        raise _index_mismatch(
            shown, f"the index names {len(outside)} shard(s) that are not a file of this folder ({outside[0]!r:.80})"
        )
    missing = sorted(named - set(files))
    if missing:
        n = sum(1 for v in wm.values() if v in missing)
        raise IncompleteCheckpointError(
            f"{shown}: the index lists {len(missing)} shard(s) that are missing ({missing[0]!r:.80}; {n} tensors)",
            path=shown,
            hint=hub_unfinished_download(path) or "a shard file is missing; download or copy the complete model",
        )
    extra = sorted(set(files) - named)
    if extra:
        raise _index_mismatch(shown, f"{len(extra)} shard(s) on disk are not in the index ({extra[0]!r:.80})")
    held: dict[str, str] = {}
    for (key, _), info in storage.items():
        held.setdefault(key, info.relative_path)
    moved = [k for k, f in wm.items() if held.get(k) != f]
    if moved:
        k = moved[0]
        where = f"in {held[k]!r:.80}" if k in held else "in no shard"
        raise _index_mismatch(
            shown,
            f"{len(moved)} tensor(s) are not where the index places them ({k!r:.80}: index {wm[k]!r:.80}, {where})",
        )
    unlisted = sorted(set(held) - set(wm))
    if unlisted:
        raise _index_mismatch(shown, f"{len(unlisted)} stored tensor(s) are not in the index ({unlisted[0]!r:.80})")


def _index_mismatch(shown: Path, what: str) -> MetadataError:
    return MetadataError(
        f"{shown}: {what}",
        path=shown,
        hint="the folder is not the one its index describes (a file added, moved or deleted); do not load it",
    )


class _Found:
    """What the files read so far hold: chunks and dtype per key, the storage window per chunk."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[ChunkMeta]] = {}
        self.dtypes: dict[str, str] = {}
        self.storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}


def _read_file(path: Path, name: str, found: _Found) -> None:
    """Add the tensors of the safetensors file ``name`` in ``path`` to ``found`` (checks in header order)."""
    p = path / name
    try:
        size = resolve_inside(path, name, what="safetensors file").stat().st_size
    except FileNotFoundError as e:
        if not os.path.islink(p):
            raise MetadataError(f"{p}: cannot read ({e.strerror})", path=p, hint=_UNREADABLE) from e
        raise _link_target_gone(p) from None
    except OSError as e:
        raise MetadataError(f"{p}: cannot read ({e.strerror})", path=p, hint=_UNREADABLE) from e
    header, data_start = read_safetensors_header(p, size)
    sharding = _sharding_info(p, header.pop("__metadata__", None))
    data_len = size - data_start
    spans: list[tuple[int, int, str]] = []
    for key, rec in header.items():
        dtype, shape, begin, end = _tensor_entry(p, key, rec, data_len)
        spans.append((begin, end, key))
        offsets: tuple[int, ...] = (0,) * len(shape)
        if key in sharding:
            info = sharding[key]
            got = _int_list(info.get(_OFFSETS_KEY)) if isinstance(info, dict) else None
            if got is None or len(got) != len(shape) or any(o + d > MAX_DIM_SIZE for o, d in zip(got, shape)):
                raise _bad(p, f"{_SHARDING_KEY} of {key!r:.80} is not a list of {len(shape)} offsets below 2^62")
            offsets = got
        if (key, offsets) in found.storage:  # two valid files of one folder, each holding the tensor
            raise _twice(path, p, key, found.storage[(key, offsets)].relative_path, offsets)
        if found.dtypes.setdefault(key, dtype) != dtype:
            raise _bad(p, f"{key!r:.80} is {dtype} here but {found.dtypes[key]} in another file")
        found.chunks.setdefault(key, []).append(ChunkMeta(offsets, shape))
        found.storage[(key, offsets)] = StorageInfo(name, data_start + begin, end - begin)
    _check_tiling(p, spans, data_len)


def _twice(path: Path, p: Path, key: str, other: str, offsets: tuple[int, ...]) -> MetadataError:
    """Two safetensors files of one folder that both hold ``key`` (at ``offsets``): a folder of two saves (a
    ``model.safetensors`` beside the sharded files of another save, a copy under another name), not a damaged file."""
    chunk = f" (chunk at {list(offsets)})" if any(offsets) else ""
    return MetadataError(
        f"{path}: {key!r:.80}{chunk} is stored in two files, {other} and {p.name}: the folder holds more than one "
        "save's weights",
        path=p,
        hint=(
            _in_snapshot_hint(path, "one model.safetensors, or the files its index lists")
            or "a model folder holds one save (one model.safetensors, or the files its index lists): move the other "
            "file(s) out of the folder"
        )
        + "; to compare two single files, pass each .safetensors file to `ckpttool diff`",
    )


def _check_tiling(p: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """The tensors' ``data_offsets`` tile the data region from 0 to its end, as safetensors requires.

    safetensors' own loader refuses a gap (``InvalidOffset``), an overlap, or bytes after the last
    tensor (``MetadataIncompleteBuffer``): bytes no tensor accounts for are refused here too.
    """
    at, prev = 0, None
    for begin, end, key in sorted(spans):
        if begin != at:
            what = "overlap those of" if begin < at else "leave a gap after"
            after = f" {prev!r:.80}" if prev is not None else " the start of the data region"
            raise _bad(p, f"{key!r:.80} data_offsets [{begin}, {end}) {what}{after} (at {at})")
        at, prev = end, key
    if at != data_len:
        raise _bad(p, f"the tensors end at byte {at} of the {data_len}-byte data region (unaccounted bytes)")


def _sharding_info(p: Path, meta: Any) -> dict[str, Any]:
    """``DCP_SHARDING_INFO`` of a header's ``__metadata__`` (``{}`` without it), parsed and checked."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(p, "__metadata__ is not a string map")
    text = meta.get(_SHARDING_KEY)
    if text is None:
        return {}
    try:
        sharding = json.loads(text, object_pairs_hook=unique_pairs)
    except (ValueError, RecursionError):
        raise _bad(p, f"{_SHARDING_KEY} is not JSON") from None
    if not isinstance(sharding, dict):
        raise _bad(p, f"{_SHARDING_KEY} is not a JSON object")
    return sharding


def _tensor_entry(p: Path, key: str, rec: Any, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of header entry ``key``, checked against the ``data_len``-byte data region."""
    if not isinstance(rec, dict):
        raise _bad(p, f"entry {key!r:.80} is not an object")
    tag = rec.get("dtype")
    dtype = SAFETENSORS_TAGS.get(tag) if isinstance(tag, str) else None
    if dtype is None and tag in _UNREAD_TAGS:
        raise MetadataError(
            f"{p}: {key!r:.80} has safetensors dtype {tag} ({_UNREAD_TAGS[tag]}), which ckpttool does not read",
            path=p,
            hint="the file is valid safetensors: convert the model's tensors to a dtype ckpttool reads (float8_e4m3fn "
            "with its scales, bfloat16, float32) with the library that quantized it, then run again",
        )
    if dtype is None:
        raise _bad(p, f"{key!r:.80} has dtype {rec.get('dtype')!r:.20} unknown to ckpttool")
    shape = _int_list(rec.get("shape"))
    span = _int_list(rec.get("data_offsets"))
    if shape is None or span is None or len(span) != 2:
        raise _bad(p, f"{key!r:.80} has a malformed shape or data_offsets (at most {MAX_NDIM} dims of at most 2^62)")
    begin, end = span
    problem = _extent_problem(shape, DType(dtype).itemsize)
    if problem is not None:
        raise _bad(p, f"{key!r:.80}: {problem}")
    nbytes = DType(dtype).itemsize * math.prod(shape)
    if begin > end or end > data_len or end - begin != nbytes:
        raise _bad(
            p,
            f"{key!r:.80} data_offsets [{begin}, {end}) do not hold {dtype}{list(shape)} "
            f"({nbytes} bytes) inside the {data_len}-byte data region",
        )
    return dtype, shape, begin, end
