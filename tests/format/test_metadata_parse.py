"""The allow-list parse of ``.metadata`` (ckpttool.format.unpickler) against torch's own reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpttool.format import parse_metadata_bytes
from ckpttool.format.metadata import CheckpointMetadata, TensorMeta
from ckpttool.format.unpickler import parse_metadata_owned


def _torch_view(ckpt: Path) -> tuple[list[tuple[str, Any]], list[tuple[Any, Any]]]:
    """Entries and storage items as torch's ``FileSystemReader.read_metadata()`` gives them (plain values)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    entries = [
        (
            k,
            (
                str(v.properties.dtype).removeprefix("torch."),
                tuple(v.size),
                [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks],
            )
            if isinstance(v, TensorStorageMetadata)
            else None,
        )
        for k, v in md.state_dict_metadata.items()
    ]
    storage = [
        ((i.fqn, None if i.offset is None else tuple(i.offset)), (s.relative_path, s.offset, s.length))
        for i, s in md.storage_data.items()
    ]
    return entries, storage


def _our_view(md: CheckpointMetadata) -> tuple[list[tuple[str, Any]], list[tuple[Any, Any]]]:
    entries = [
        (k, (v.dtype.name, v.size, [(c.offsets, c.sizes) for c in v.chunks]) if isinstance(v, TensorMeta) else None)
        for k, v in md.entries.items()
    ]
    storage = [(k, (s.relative_path, s.offset, s.length)) for k, s in md.storage.items()]
    return entries, storage


@pytest.mark.parametrize("fixture", ["fsdp_ckpt", "multi_optim_ckpt"])
def test_parse_equals_torch_read_metadata(fixture: str, request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(fixture)
    data = (ckpt / ".metadata").read_bytes()
    holder = [data]
    md = parse_metadata_owned(holder)
    assert holder == []  # handed over: the parser holds the only reference it keeps
    assert _our_view(md) == _torch_view(ckpt)  # values and file order
    assert parse_metadata_bytes(data) == md


def test_equal_values_are_built_once(fsdp_ckpt: Path) -> None:
    """Entries of one layout share one frozen TensorMeta; equal chunks and relative paths are one object each."""
    md = parse_metadata_bytes((fsdp_ckpt / ".metadata").read_bytes())
    tensors = [v for v in md.entries.values() if isinstance(v, TensorMeta)]
    assert len({id(v) for v in tensors}) == len(set(tensors)) < len(tensors)
    chunks = [c for v in tensors for c in v.chunks]
    assert len({id(c) for c in chunks}) == len(set(chunks))
    paths = [s.relative_path for s in md.storage.values()]
    assert len({id(p) for p in paths}) == len(set(paths))


def test_a_shape_holding_a_list_is_named_not_a_crash() -> None:
    """``torch.Size(([1],))`` where a shape belongs: the entry and the value are named (E200), never a TypeError."""
    from ckpttool.errors import MetadataError
    from ckpttool.format.unpickler import _shape

    with pytest.raises(MetadataError) as e:
        _shape(([1],), ".metadata", "w", "chunk sizes")
    assert e.value.message == ".metadata: entry 'w': chunk sizes <tuple of 1 items> holds [1], not a size >= 0"
