"""The hostile corpus, built once per test session (and xdist worker) from the real ``sample`` save."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.hostile import CorpusEntry, build_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory, sample_ckpt: Path) -> dict[str, CorpusEntry]:
    """Every corpus entry (read-only: a test that writes works on a copy)."""
    return build_corpus(tmp_path_factory.mktemp("hostile-corpus"), sample_ckpt)
