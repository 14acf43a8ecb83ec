"""Every line ckpttool prints is escaped once, at the output sink (errors, warnings, hints, tables, logs, JSON).

The corpus' ``escape_file_name`` entry names its data file with an OSC title sequence, a CSI
screen clear and cursor home, a bidi override and newlines around "ALL CHECKS PASSED", then
cuts the file short so that error lines name it; ``odd_keys`` puts such characters in keys.
Nothing a terminal would act on may reach stdout or stderr, and no line may be the forged one.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ui.output import SanitizedStream
from ckpttool.ui.render import safe_text, stdout_console, table
from tests.fixtures.hostile import CorpusEntry
from tests.security.test_hostile_matrix import MATRIX

runner = CliRunner()
# ESC, BEL, CSI (8-bit), CR, the bidi override and isolates, line/paragraph separators
_LIVE = ("\x1b", "\x07", "\x9b", "\r", "\u202e", "\u2066", "\u2028", "\u2029")


def _check(text: str, where: str) -> None:
    for ch in _LIVE:
        assert ch not in text, f"{where}: raw {ch!r} printed"
    assert "ALL CHECKS PASSED" not in [ln.strip() for ln in text.splitlines()], f"{where}: a forged line"


@pytest.mark.parametrize("entry_name", ["escape_file_name", "odd_keys"])
@pytest.mark.parametrize("cid", ["inspect", "inspect-json", "validate", "validate-deep", "export", "replay-step"])
def test_nothing_live_reaches_the_terminal(
    cid: str, entry_name: str, corpus: dict[str, CorpusEntry], tmp_path: object
) -> None:
    entry = corpus[entry_name]
    res = runner.invoke(app, MATRIX[cid][1](entry.ckpt, tmp_path / "out"))  # type: ignore[operator]
    _check(res.stdout, f"{cid} stdout")
    _check(res.stderr, f"{cid} stderr")
    for line in res.stderr.splitlines():
        assert line.startswith(("error: ", "hint: ", "warning: ")), f"{cid}: stray stderr line {line!r}"
    if cid == "inspect-json" and res.exit_code == 0:
        keys = {t["key"] for t in json.loads(res.stdout)["model"]}  # JSON keeps the real strings, escaped by JSON
        assert any("\x1b" in k for k in keys) or entry_name != "odd_keys"


def test_the_file_name_is_shown_escaped(corpus: dict[str, CorpusEntry]) -> None:
    res = runner.invoke(app, ["validate", str(corpus["escape_file_name"].ckpt), "--json"])
    assert "\\x1b]0;pwned\\x07\\x1b[2J" not in res.stdout  # JSON: the string itself, JSON-escaped
    key = json.loads(res.stdout)["findings"][0]["key"]
    assert key.startswith("\x1b]0;pwned\x07\x1b[2J") and "\nALL CHECKS PASSED\n" in key
    res = runner.invoke(app, ["export", str(corpus["escape_file_name"].ckpt), "/nonexistent/out"])
    assert res.stderr.startswith("error: [E300] ") and "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[H\\u202e" in res.stderr


def test_the_sink_stream_keeps_only_a_final_newline() -> None:
    raw = io.StringIO()
    s = SanitizedStream(raw)
    s.write("warning: key \x1b[31mred\x1b[0m\nALL CHECKS PASSED\n")
    s.write("\n")
    assert raw.getvalue() == "warning: key \\x1b[31mred\\x1b[0m\\x0aALL CHECKS PASSED\n\n"


def test_rich_output_is_escaped_segment_by_segment(capsys: pytest.CaptureFixture[str]) -> None:
    con = stdout_console()
    con.print(table("t", ["key"], [["a\x1b]0;x\x07\nALL CHECKS PASSED"]]))
    from rich.text import Text

    con.print(Text("plain \x1b[2J text"))  # a renderable that bypasses render_str
    out = capsys.readouterr().out
    _check(out, "rich")
    assert "\\x1b]0;x\\x07\\x0aALL CHECKS PASSED" in out


def test_log_records_pass_the_sink(caplog: pytest.LogCaptureFixture) -> None:
    raw = io.StringIO()
    handler = logging.StreamHandler(SanitizedStream(raw))
    log = logging.getLogger("ckpttool.test-escaping")
    log.addHandler(handler)
    try:
        log.warning("reading %s", "\x1b[2J\u202efile\nALL CHECKS PASSED")
    finally:
        log.removeHandler(handler)
    _check(raw.getvalue(), "log")


def test_safe_text_escapes_c1_bidi_and_separators() -> None:
    assert safe_text("\x9b2J\u202e\u2066\u2028x\udcff") == "\\x9b2J\\u202e\\u2066\\u2028x\\udcff"
    assert safe_text("a\tb\nc", keep_newlines=True) == "a\tb\nc"


@pytest.mark.parametrize("name", ["new\nline", "two  spaces", "tab\there"])
def test_an_error_line_names_the_path_as_it_is(name: str, sample_ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint directory whose name holds a newline, a tab or two spaces: the one error line names that
    directory (control characters escaped as ``\\x0a``/``\\x09``), not a path with the whitespace squashed."""
    import shutil

    ck = tmp_path / name
    shutil.copytree(sample_ckpt, ck)
    (ck / ".metadata").write_bytes(b"not a pickle")
    res = CliRunner().invoke(app, ["inspect", str(ck)])
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: [E200]"), res.stderr
    assert safe_text(str(ck)) in lines[0]


def test_an_error_line_keeps_the_folders_of_its_path_as_they_are(tmp_path: Path) -> None:
    """The message names the run root as well as the step directory (its own path): both keep the newline
    (escaped), not a root with the newline turned into a space."""
    root = tmp_path / "run\nroot"
    (root / "step-3").mkdir(parents=True)  # a save that stopped right after creating its folder
    res = CliRunner().invoke(app, ["inspect", str(root)])
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: [E202] {safe_text(str(root))}: step 3 is incomplete")
    assert f"{safe_text(str(root / 'step-3'))} has no file" in lines[0]
    assert str(root).replace("\n", " ") not in lines[0]
