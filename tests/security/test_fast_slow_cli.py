"""Every command answers the same on the fast path and the slow path, over the whole hostile corpus (issue 31).

The fast path is what a user with a warm cache gets: the parsed-``.metadata`` cache hit
(``format/mdcache.py``, stored after a first run; its decode shares equal layouts, so the catalog
builds its entries column-wise, ``model/catalog.py``) and the storage rules' column-wise
prefilters (``ops/validate/rules/storage.py``). The slow path is ``CKPTTOOL_NO_CACHE=1`` (as
``--no-cache``) with the prefilters off: every entry parsed by the unpickler and walked row by row.
For every entry and command: the same exit code, the same error code, and for ``validate`` the
same findings (code, key) — on the first run (cache miss, storing) and on the second (cache hit).
The whole product is ``-m heavy``; by default a slice of entries whose values the fast paths once
let through.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import cache as usercache
from ckpttool.format import mdcache
from ckpttool.ops.validate.rules import storage as storage_rules
from tests.fixtures.hostile import ENTRY_NAMES, CorpusEntry

runner = CliRunner()
ERROR_RE = re.compile(r"^error: \[(E\d{3})\]")

# command id -> argv builder (the matrix's minimal arguments; validate with --json to compare findings)
COMMANDS = {
    "inspect-json": lambda ck, out: ["inspect", str(ck), "--json"],
    "validate-deep": lambda ck, out: ["validate", str(ck), "--strict", "--deep", "--json"],
    "export": lambda ck, out: ["export", str(ck), str(out)],
    "stats": lambda ck, out: ["stats", str(ck)],
}
# by default: the regressions of round 3 (values a fast path let through) and a round-4 record view
DEFAULT_ENTRIES = {"huge_int_offset", "storage_dtype_list", "manifest_record_stride_swap"}
DEFAULT_COMMANDS = {"validate-deep"}


def _verdict(res: Any) -> tuple[Any, ...]:
    """(exit code, error code or None, sorted (rule code, key) findings of validate --json)."""
    lines = res.stderr.splitlines()
    m = ERROR_RE.match(lines[0]) if lines else None
    findings: list[tuple[str, Any]] = []
    if res.exit_code in (0, 1) and res.stdout.lstrip().startswith("{"):
        doc = json.loads(res.stdout)
        findings = sorted((f["code"], str(f.get("key"))) for f in doc.get("findings", []))
    assert "Traceback" not in res.stderr and (m is None or m.group(1) != "E999"), res.stderr[-2000:]
    return res.exit_code, m.group(1) if m else None, findings


def cases() -> list:  # type: ignore[type-arg]
    return [
        pytest.param(
            cid,
            name,
            id=f"{cid}-{name}",
            marks=() if name in DEFAULT_ENTRIES and cid in DEFAULT_COMMANDS else pytest.mark.heavy,
        )
        for name in ENTRY_NAMES
        for cid in COMMANDS
    ]


@pytest.mark.parametrize(("cid", "entry_name"), cases())
def test_fast_and_slow_paths_give_the_same_verdict(
    cid: str, entry_name: str, corpus: dict[str, CorpusEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = corpus[entry_name]
    if entry.extra.get("out_beside"):
        pytest.skip("the source named like OUT's temporary is the matrix's case (its copy is read there)")
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)  # the sample's small .metadata is cached too

    def run(tag: str) -> tuple[Any, ...]:
        argv = COMMANDS[cid](entry.ckpt, tmp_path / tag / "OUT")
        argv += list(entry.extra.get("args", {}).get(cid, []))
        return _verdict(runner.invoke(app, argv))

    miss, hit = run("miss"), run("hit")  # the first run stores the parse (if any), the second uses it
    monkeypatch.setenv(usercache.NO_CACHE_ENV, "1")
    monkeypatch.setattr(storage_rules, "COLUMN_PREFILTERS", False)
    slow = run("slow")
    assert miss == slow, f"{cid} on {entry_name}: cache miss {miss} vs slow path {slow}"
    assert hit == slow, f"{cid} on {entry_name}: cache hit {hit} vs slow path {slow}"


def test_the_fast_path_is_taken(
    corpus: dict[str, CorpusEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not vacuous: on a corpus entry that opens, the first run stores a parse and the second reads it."""
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    ckpt = corpus["manifest_record_stride_swap"].ckpt
    assert runner.invoke(app, ["inspect", str(ckpt), "--json"]).exit_code == 0
    stored = list((tmp_path / "cache").rglob("*.ckmd"))
    assert len(stored) == 1
    calls: list[int] = []
    real = mdcache._decode_owned
    monkeypatch.setattr(mdcache, "_decode_owned", lambda *a: calls.append(1) or real(*a))
    assert runner.invoke(app, ["inspect", str(ckpt), "--json"]).exit_code == 0
    assert calls == [1], "the second run did not read the cache entry"
