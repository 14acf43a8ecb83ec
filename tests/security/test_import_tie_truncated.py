"""import's tied-head check (``lm_head.weight`` against its embedding under ``tie_word_embeddings``) reads both
tensors after the safetensors header was read and checked: a file cut short in between (a copy still running, a
sync that replaced it) raised the engine's ShortReadError, which the CLI shows as E999 'internal error'. It is E300
naming the file now. The windows come from the file's own header; the file is truncated after it was read."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpttool.errors import DataFileError
from ckpttool.ops.import_hf import _count_differing, _Source


def test_a_file_cut_short_during_the_tie_check_is_e300(tmp_path: Path) -> None:
    emb = torch.randn(64, 16)
    path = tmp_path / "model.safetensors"
    save_file({"lm_head.weight": emb.clone(), "model.embed_tokens.weight": emb.clone()}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    src = {
        k: _Source(k, path.name, 8 + n + v["data_offsets"][0], "float32", tuple(v["shape"]))
        for k, v in header.items()
        if k != "__metadata__"
    }
    head, tied = src["lm_head.weight"], src["model.embed_tokens.weight"]
    assert _count_differing(tmp_path, head, tied) == 0  # whole: equal
    os.truncate(path, len(raw) - 100)  # the later tensor loses its last 25 values
    with pytest.raises(DataFileError) as e:
        _count_differing(tmp_path, head, tied)
    assert e.value.code == "E300" and str(path) in e.value.message
    assert "truncated or replaced while import read it" in e.value.message
