"""Fast paths answer as the slow paths do, over the whole hostile corpus (the differential test of round 3).

The speed work on 10^6-entry metadata added paths that skip per-key work: the parsed-``.metadata``
cache (``format/mdcache.py``; its corpus differential is ``test_metadata_cache.py``), the
column-wise tests with which the storage rules skip their row walk
(``ops/validate/rules/storage.py``: ``COLUMN_PREFILTERS``), and the record-count bound that
refuses a metadata bomb before it is unpickled. Each must give the same coded answer as the
slow path on every entry: the same findings, or the same refusal.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import CkptError
from ckpttool.format import cache as usercache
from ckpttool.format import limits, mdcache, parse_metadata_bytes
from ckpttool.ops.validate.rules import storage as storage_rules
from tests.fixtures.hostile import ENTRY_NAMES, HF_ENTRY_NAMES, CorpusEntry, load_torch_metadata

runner = CliRunner()


def _validate(ckpt: Path) -> tuple[int, list[tuple[str, str | None, str]], str]:
    res = runner.invoke(app, ["validate", str(ckpt), "--json"])
    if res.exit_code == 2:
        return 2, [], res.stderr.splitlines()[0] if res.stderr else ""
    doc = json.loads(res.stdout)
    return res.exit_code, sorted((f["code"], f["key"], f["message"]) for f in doc["findings"]), ""


@pytest.mark.parametrize(
    "entry_name",
    # round 4's Hugging Face folders run no storage rule of a .metadata: full suite only (-m heavy)
    [
        pytest.param(n, marks=pytest.mark.heavy) if n in HF_ENTRY_NAMES else n
        for n in ENTRY_NAMES
        if n != "many_entries"
    ],
)
def test_storage_rules_find_the_same_with_and_without_column_prefilters(
    entry_name: str, corpus: dict[str, CorpusEntry], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = corpus[entry_name].ckpt
    fast = _validate(ckpt)
    monkeypatch.setattr(storage_rules, "COLUMN_PREFILTERS", False)
    slow = _validate(ckpt)
    assert fast == slow, f"{entry_name}: column prefilters change the answer"
    assert "E999" not in fast[2]


def test_a_cache_entry_stored_under_a_higher_cap_is_refused_under_the_default(
    corpus: dict[str, CorpusEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--max-metadata-size`` raised once (the bomb parsed and cached), then the default again: refused as a parse is."""
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    data = (corpus["many_chunks"].ckpt / ".metadata").read_bytes()  # 20,000 chunks: valid
    with limits.limits(max_metadata_bytes=1 << 30):
        parsed = mdcache.parse_metadata_cached(data)
    assert list(tmp_path.rglob("*.ckmd")), "the parse was cached"
    cap = limits.BYTES_PER_METADATA_RECORD * 1000  # 1,000 records: the file holds ~40,000
    with limits.limits(max_metadata_bytes=cap):
        for parse in (parse_metadata_bytes, mdcache.parse_metadata_cached):
            with pytest.raises(CkptError) as e:
                parse(data)
            assert e.value.code == "E307", parse
    assert mdcache.parse_metadata_cached(data) == parsed  # back at the default: the entry is used again


def test_shared_chunk_objects_count_as_chunks(sample_ckpt: Path, tmp_path: Path) -> None:
    """One chunk object listed past the cap (memo references: no NEWOBJ each) is refused as the chunks it lists."""
    md = load_torch_metadata(sample_ckpt)
    key = next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))
    md.state_dict_metadata[key].chunks = md.state_dict_metadata[key].chunks[:1] * 5000
    data = pickle.dumps(md)
    assert data.count(b"\x81") < 1000
    with limits.limits(max_metadata_bytes=limits.BYTES_PER_METADATA_RECORD * 2000):
        with pytest.raises(CkptError) as e:
            parse_metadata_bytes(data)
    assert e.value.code == "E307" and key in e.value.message


def test_a_record_class_called_instead_of_built_is_refused(sample_ckpt: Path) -> None:
    """A ``REDUCE`` call of an allow-listed dataclass (not what torch writes) would escape the NEWOBJ count."""
    data = (sample_ckpt / ".metadata").read_bytes()
    # protocol 4: the Metadata object is EMPTY_TUPLE NEWOBJ right after its class; make it a REDUCE call
    at = data.index(b")\x81")
    with pytest.raises(CkptError) as e:
        parse_metadata_bytes(data[:at] + b")R" + data[at + 2 :])
    assert e.value.code == "E201", e.value.message
