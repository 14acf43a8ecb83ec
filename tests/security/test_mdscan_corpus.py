"""The hostile corpus through the native column reader of ``.metadata``: the same result or message as without it."""

from __future__ import annotations

import pytest

from ckpttool.engine import native
from ckpttool.format import limits
from tests.fixtures.hostile import CorpusEntry
from tests.format.test_mdscan import _agrees, _parsed, _parsed_without_kernels

pytestmark = pytest.mark.skipif(native.function("ckpt_mdscan", None) is None, reason="native kernels not built")


@pytest.mark.heavy  # every entry parsed twice (~70 s on 2 loaded cores); the CLI corpus tests run the column reader in CI
def test_hostile_corpus_agrees(corpus: dict[str, CorpusEntry], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``.metadata`` of the hostile corpus: the same result or message with and without the column reader."""
    for entry in corpus.values():
        f = entry.ckpt / ".metadata"
        if not f.is_file():
            continue
        data = f.read_bytes()
        if len(data) > limits.current().max_metadata_bytes:
            continue
        _agrees(data)
        with_columns = _parsed(data)
        ref = _parsed_without_kernels(data, monkeypatch)
        if isinstance(ref, Exception):
            assert type(with_columns) is type(ref) and str(with_columns) == str(ref), entry.name
        else:
            assert with_columns == ref, entry.name
