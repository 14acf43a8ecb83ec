"""The object-store side of ``.ckpttool-output.json``: a listing checked against a marker (``--overwrite`` of a URL).

The digests come from :func:`marker.digest_parts`, the function the writer's :func:`marker.file_digest` uses on a
file's first and last MiB; the listing is a dict of bytes read by range, as a store's objects.
"""

from __future__ import annotations

from typing import Any

from ckpttool.format import marker


def _doc(objects: dict[str, bytes], state: str = "complete") -> dict[str, Any]:
    files = {k: [len(v), marker.digest_parts(len(v), v, b"")] for k, v in objects.items()}
    return {"format": "ckpttool-output/1", "state": state, "files": files}


def _check(doc: dict[str, Any], objects: dict[str, bytes], replacing: bool) -> str:
    sizes = {k: len(v) for k, v in objects.items()}
    return marker.listing_disagreement(doc, sizes, lambda name, a, b: objects[name][a:b], replacing=replacing)


OLD = {"model-00001-of-00002.safetensors": b"a" * 100, "model-00002-of-00002.safetensors": b"b" * 50, "x": b"1"}
NEW = {"model.safetensors": b"c" * 70, "x": b"22"}


def test_a_replacement_cut_short_is_ours_to_overwrite_only() -> None:
    """Any mix of the old and new objects (some missing, `x` of either version) agrees with the `replacing`
    marker for `--overwrite`; never as a complete output (manifest/stamp's check, `replacing=False`)."""
    doc = marker.replacing_doc(_doc(NEW), _doc(OLD))
    assert doc["state"] == "replacing" and doc["files"] == _doc(NEW)["files"]
    mixes = [
        {**OLD},
        {**OLD, "model.safetensors": NEW["model.safetensors"]},
        {"model-00002-of-00002.safetensors": OLD["model-00002-of-00002.safetensors"], **NEW},
        {"x": OLD["x"]},
        {},
    ]
    for mix in mixes:
        assert _check(doc, mix, replacing=True) == "", mix
        assert "not a complete output" in _check(doc, mix, replacing=False)
    # a second cut replacement keeps every version the first one could have left
    again = marker.replacing_doc(_doc({"y": b"3"}), doc)
    for mix in mixes:
        assert _check(again, mix, replacing=True) == "", mix


def test_a_replacing_marker_does_not_vouch_for_other_objects() -> None:
    """An object that neither output wrote, or one of their names with other bytes or size, disagrees."""
    doc = marker.replacing_doc(_doc(NEW), _doc(OLD))
    assert "not listed" in _check(doc, {**NEW, "optimizer.pt": b"z"}, replacing=True)
    assert "differs in content" in _check(doc, {"x": b"33"}, replacing=True)
    assert "differs in size" in _check(doc, {"x": b"4444"}, replacing=True)
    for bad in ({**doc, "previous": []}, {**doc, "previous": {"x": "no"}}, {**doc, "previous": {"x": [[None, 1]]}}):
        assert _check(bad, {"x": OLD["x"]}, replacing=True) != ""


def test_a_complete_marker_keeps_its_exact_listing() -> None:
    """State `complete`: every listed object present with its bytes, nothing missing (as before)."""
    doc = _doc(NEW)
    assert _check(doc, NEW, replacing=True) == _check(doc, NEW, replacing=False) == ""
    assert "is missing" in _check(doc, {"x": NEW["x"]}, replacing=True)


def test_a_planted_replacing_marker_of_a_million_entries_is_carried_over_without_hanging() -> None:
    """A `replacing` marker (up to the 64 MiB cap) whose `previous` repeats one name's entries 10^6 times: the next
    cut-short `--overwrite` carries each distinct entry over once, in a fresh interpreter that must finish (the
    list membership test made it quadratic: hours for a marker under the cap)."""
    code = """
import json, sys
from ckpttool.format import marker
n = 10**6
old = {"format": "ckpttool-output/1", "state": "replacing", "files": {"x": [1, "d"]},
       "previous": {"x": [[i % 1000, "d%d" % i] for i in range(n)] + [[1, "d"]] * n, "y": [[2, "e"]] * n}}
assert len(marker.marker_bytes(old)) < marker.MAX_MARKER_BYTES
doc = marker.replacing_doc({"format": "ckpttool-output/1", "files": {"z": [3, "f"]}}, old)
print(json.dumps([doc["state"], doc["files"], len(doc["previous"]["x"]), doc["previous"]["x"][:2], doc["previous"]["y"]]))
"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    state, files, n_x, first, y = json.loads(res.stdout)
    assert (state, files, y) == ("replacing", {"z": [3, "f"]}, [[2, "e"]])
    assert n_x == 10**6 + 1 and first == [[1, "d"], [0, "d0"]]  # old files first, then previous, each once
