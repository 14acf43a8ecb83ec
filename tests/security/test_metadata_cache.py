"""The hostile corpus through the parsed-``.metadata`` cache: the same metadata or the same refusal, twice."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ckpttool.errors import CkptError
from ckpttool.format import cache as usercache
from ckpttool.format import mdcache, parse_metadata_bytes
from tests.fixtures.hostile import CorpusEntry


def _outcome(fn: object, data: bytes) -> object:
    try:
        return fn(data, ".metadata")  # type: ignore[operator]
    except CkptError as e:
        return (type(e).__name__, e.code, e.message)


@pytest.mark.heavy  # CI time: the whole corpus twice; the cache's codec is checked on real metadata in CI
def test_corpus_parses_the_same_through_the_cache(
    corpus: dict[str, CorpusEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    checked = refused = 0
    stored: set[bytes] = set()
    for name, entry in sorted(corpus.items()):
        md_file = entry.ckpt / ".metadata"
        if not md_file.is_file() or md_file.is_symlink():
            continue
        data = md_file.read_bytes()
        direct = _outcome(parse_metadata_bytes, data)
        assert _outcome(mdcache.parse_metadata_cached, data) == direct, name  # miss (stores when parsed)
        assert _outcome(mdcache.parse_metadata_cached, data) == direct, name  # hit, or refused again
        checked += 1
        refused += isinstance(direct, tuple)
        if not isinstance(direct, tuple):
            stored.add(hashlib.sha256(data).digest())
    assert checked > 20 and refused > 5
    assert len(list((tmp_path / "cache").rglob("*.ckmd"))) == len(stored)  # refusals are never cached
