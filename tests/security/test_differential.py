"""ckpttool reads what torch's own reader reads, or refuses (the differential test).

For every corpus entry (``tests/fixtures/hostile.py``): every tensor and byte item that
ckpttool's reader returns is loaded again with torch's own ``dcp.load`` (``FileSystemReader``,
``DefaultLoadPlanner``) and must be identical — bit for bit for tensors, ``==`` for objects.
What ckpttool refuses is not asked of torch (torch would run a payload, read outside the
directory, or inflate a bomb); what torch refuses, ckpttool must have refused: a ``dcp.load``
that fails on an item ckpttool returned fails this test, naming the item.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from ckpttool.errors import CkptError
from ckpttool.format.metadata import TensorMeta
from ckpttool.format.reader import CheckpointReader
from tests.fixtures.hostile import ENTRY_NAMES, HF_ENTRY_NAMES, CorpusEntry


def _ckpttool_values(entry: CorpusEntry) -> dict[str, Any] | None:
    """key -> value for every item ckpttool reads (``None``: the checkpoint is refused as a whole)."""
    try:
        reader = CheckpointReader(entry.ckpt)
    except CkptError:
        return None
    out: dict[str, Any] = {}
    with reader:
        for key, meta in reader.metadata.entries.items():
            try:
                out[key] = reader.read_tensor(key) if isinstance(meta, TensorMeta) else reader.read_object(key)
            except CkptError:
                continue
    return out


def _torch_load(path: Any, values: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else io.BytesIO() for k, v in values.items()
    }
    # a Hugging Face folder (no .metadata) through torch's own HuggingFaceStorageReader, as ckpttool models it
    hf = not os.path.lexists(os.path.join(path, ".metadata")) and any(Path(path).glob("*.safetensors"))
    reader = dcp.HuggingFaceStorageReader(str(path)) if hf else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(path), storage_reader=reader, no_dist=True)
    return sd


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b) and type(a) is type(b)


# the 10^6-entry and 20,000-chunk entries take minutes through torch's reader, the 20,000,000-dim header seconds;
# round 4's Hugging Face folders but two: full suite only (-m heavy)
HEAVY_ENTRIES = {"many_entries", "many_chunks"} | (HF_ENTRY_NAMES - {"hf_adapter_beside", "import_expert_3d"})


@pytest.mark.parametrize(
    "entry_name", [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY_ENTRIES else n for n in ENTRY_NAMES]
)
def test_torch_reads_identical_values_or_ckpttool_refuses(entry_name: str, corpus: dict[str, CorpusEntry]) -> None:
    entry = corpus[entry_name]
    ours = _ckpttool_values(entry)
    if not ours:
        return  # refused whole, or nothing readable: nothing for torch to disagree with
    try:
        theirs = _torch_load(entry.ckpt, ours)
    except Exception as whole:
        refused = []
        for key in ours:  # find the items torch refuses that ckpttool returned
            try:
                _torch_load(entry.ckpt, {key: ours[key]})
            except Exception as e:
                refused.append(f"{key!r}: {type(e).__name__}: {str(e)[:200]}")
        raise AssertionError(f"torch refuses what ckpttool read: {refused or whole!r}") from whole
    differ = [k for k in ours if not _same(ours[k], theirs[k])]
    assert not differ, f"ckpttool and torch read different values for {differ[:5]}"


def test_a_clean_save_is_compared_item_by_item(sample_ckpt: Any) -> None:
    """The comparison above is not vacuous: on the untouched sample every item is read by both and equal."""
    entry = CorpusEntry("sample", "the untouched sample", sample_ckpt)
    ours = _ckpttool_values(entry)
    assert ours is not None
    with CheckpointReader(sample_ckpt) as r:
        assert set(ours) == set(r.metadata.entries)
    theirs = _torch_load(sample_ckpt, ours)
    assert all(_same(ours[k], theirs[k]) for k in ours)
