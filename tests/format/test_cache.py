"""The cache plumbing both codecs share (ckpttool.format.cache): capped regular-file reads, best-effort atomic stores."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from ckpttool.format import cache


def test_store_then_read(tmp_path: Path) -> None:
    path = tmp_path / "c" / "folder" / "k.bin"
    cache.store_entry(path, lambda: b"entry", "test cache")
    assert cache.read_entry(path) == b"entry"
    assert cache.read_entry(path, 2) == b"ent"  # at most max_bytes + 1: the caller refuses a longer entry
    assert [p.name for p in path.parent.iterdir()] == ["k.bin"]  # no temporary file left


def test_a_failed_store_leaves_nothing_and_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> bytes:
        raise ValueError("cannot encode")

    path = tmp_path / "c" / "k.bin"
    logger = logging.getLogger("tests.format.test_cache")
    with caplog.at_level(logging.INFO, logger="tests.format.test_cache"):
        cache.store_entry(path, broken, "test cache", logger=logger)
        blocked = tmp_path / "file"
        blocked.write_text("x")
        cache.store_entry(blocked / "k.bin", lambda: b"entry", "test cache", logger=logger)  # parent is a file
    assert not path.exists() and not (tmp_path / "c").exists()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["test cache not written"] * 2
    assert "ValueError: cannot encode" in caplog.records[0].getMessage()


def test_missing_entry_reads_as_none(tmp_path: Path) -> None:
    assert cache.read_entry(tmp_path / "absent") is None


def test_model_shape_entry_bytes_are_those_json_dump_wrote() -> None:
    doc = {
        "format": 2,
        "key": "ab",
        "model_class": "X",
        "tensors": {"é.w": [[2, 3], "float32"]},
        "optional": [],
        "not_linear": ["é.w"],
    }
    written = io.StringIO()
    json.dump(doc, written)  # how entries were written before the shared store
    assert json.dumps(doc).encode("ascii") == written.getvalue().encode()
