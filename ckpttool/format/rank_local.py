"""Rank-local metadata: ``dcp.save(..., use_collectives=False)`` writes ``__{rank}.metadata`` per rank.

Source: ``torch/distributed/checkpoint/filesystem.py`` (``_FileSystemWriter.finish`` writes
``__{rank}.metadata`` instead of ``.metadata`` when ``use_collectives`` is false;
``FileSystemReader.read_metadata(rank=)`` reads one back). Without collectives there is no
global plan: each rank's file describes only what that rank wrote, replicated values (0-d
``step`` tensors, ``param_groups`` byte items) are written by every rank, and each file has its
own ``save_id``. :func:`merge_rank_metadata` reads them as one checkpoint: the union of the
chunks, a chunk or byte item written by several ranks kept from the lowest rank, tensors
checked to agree on dtype and global size across ranks. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from ckpttool.errors import MetadataError
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, StorageInfo, TensorMeta

__all__ = ["RANK_METADATA_RE", "merge_rank_metadata", "rank_metadata_names", "ranks_without_metadata"]

RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
#: The name torch's ``_FileSystemWriter.finish`` writes a rank's metadata to before renaming it into place.
_RANK_METADATA_TMP_RE = re.compile(r"^__(\d+)\.metadata\.tmp$")


def rank_metadata_names(names: Collection[str]) -> list[tuple[int, str]]:
    """``(rank, name)`` of the ``__{rank}.metadata`` files among ``names``, by rank."""
    found = [(int(m.group(1)), n) for n in names if (m := RANK_METADATA_RE.match(n))]
    return sorted(found)


def ranks_without_metadata(names: Collection[str], writers: Iterable[int]) -> list[int]:
    """The ranks of a rank-local save whose save did not finish, by rank: ``writers`` (the ranks that wrote data
    files, ``__R_N.distcp``) and the ranks with a ``__R.metadata.tmp`` among ``names``, less those whose
    ``__R.metadata`` is there (each rank writes it last, after its data files)."""
    have = {r for r, _ in rank_metadata_names(names)}
    tmp = {int(m.group(1)) for n in names if (m := _RANK_METADATA_TMP_RE.match(n))}
    return sorted({*writers, *tmp} - have)


def merge_rank_metadata(parts: list[tuple[int, CheckpointMetadata]], where: str) -> CheckpointMetadata:
    """One :class:`CheckpointMetadata` from the rank-local ones (``(rank, metadata)``, by rank).

    Returns:
        The entries in first-seen order (lowest rank first), each tensor's chunks the union of
        the ranks' (duplicates by ``offsets`` kept once, from the lowest rank), storage from the
        rank that supplied each chunk, ``planner_data`` merged, ``save_id`` ``None`` (one per rank), and
        the higher ranks' copies of what a lower rank wrote too in ``replicas``.

    Raises:
        MetadataError: the ranks disagree on a key's kind, dtype or global size, or on the DCP version.
    """
    entries: dict[str, TensorMeta | BytesMeta] = {}
    chunks: dict[str, dict[tuple[int, ...], ChunkMeta]] = {}
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    planner: dict[str, tuple[object, ...]] = {}
    replicas: list[tuple[str, tuple[int, ...] | None, StorageInfo]] = []
    versions = {md.version for _, md in parts}
    if len(versions) > 1:
        raise MetadataError(
            f"{where}: rank-local metadata files disagree on the DCP version ({sorted(map(str, versions))})"
        )
    for rank, md in parts:
        for key, meta in md.entries.items():
            have = entries.get(key)
            if have is None:
                entries[key] = meta
            elif isinstance(have, TensorMeta) != isinstance(meta, TensorMeta) or (
                isinstance(have, TensorMeta)
                and isinstance(meta, TensorMeta)
                and (have.dtype != meta.dtype or have.size != meta.size)
            ):
                raise MetadataError(
                    f"{where}: __{rank}.metadata describes {key!r:.80} differently from a lower rank's "
                    f"({_what(meta)} vs {_what(have)})",
                    fqn=key,
                )
            if isinstance(meta, TensorMeta):
                mine = chunks.setdefault(key, {})
                for c in meta.chunks:
                    info = md.storage.get((key, c.offsets))
                    if c.offsets not in mine:
                        mine[c.offsets] = c
                        if info is not None:
                            storage[(key, c.offsets)] = info
                    elif info is not None:
                        replicas.append((key, c.offsets, info))
            elif (key, None) in md.storage:
                if (key, None) not in storage:
                    storage[(key, None)] = md.storage[(key, None)]
                else:
                    replicas.append((key, None, md.storage[(key, None)]))
        for key, path in md.planner_data.items():
            planner.setdefault(key, path)
    for key, got in chunks.items():
        meta = entries[key]
        assert isinstance(meta, TensorMeta)
        entries[key] = TensorMeta(meta.dtype, meta.size, tuple(got.values()))
    first = parts[0][1]
    return CheckpointMetadata(
        entries=entries,
        storage=storage,
        planner_data=planner,
        version=first.version,
        checkpoint_id=first.checkpoint_id,
        save_id=None,
        serialization=first.serialization,
        replicas=tuple(replicas),
        writer=first.writer,
    )


def _what(meta: TensorMeta | BytesMeta) -> str:
    return f"{meta.dtype}{list(meta.size)}" if isinstance(meta, TensorMeta) else "a byte item"
