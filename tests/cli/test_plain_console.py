"""The plain console (a pipe without colour) writes the bytes rich writes, without importing rich.

``PlainConsole`` lays out lines of text and tables of one-line ASCII cells itself; rich's own
console (``PlainConsole.rich``, on another stream) is the reference. Tables it cannot lay out
(folded keys, multi-line or styled cells, a title wider than the table) go to rich.
"""

from __future__ import annotations

import io
import random
import string
from pathlib import Path

import pytest

from ckpttool.ui.render import Col, PlainConsole, _NoTrailingWhitespace, key_cell, print_table, styled
from tests.cli.test_startup_imports import modules_after

_CHARS = string.ascii_letters + string.digits + "._-/ ,:"


def _pair(width: int) -> tuple[PlainConsole, PlainConsole, io.StringIO, io.StringIO]:
    a, b = io.StringIO(), io.StringIO()
    return PlainConsole(_NoTrailingWhitespace(a), width), PlainConsole(_NoTrailingWhitespace(b), width), a, b


def _table(rng: random.Random) -> tuple[str, list[Col], list[list[object]]]:
    def word() -> str:
        return "".join(rng.choice(_CHARS) for _ in range(rng.choice([0, 1, 3, 8, 20, 40, 70])))

    cols = [
        Col(
            rng.choice(["key", "file", "n", "a b", "x" * rng.randint(1, 20)]) + str(i),
            rng.choice(["key", "num", "code", "text"]),
            drop=rng.choice([0, 0, 1, 2]),
            hide_empty=rng.random() < 0.2,
            below=rng.random() < 0.1,
        )
        for i in range(rng.randint(1, 6))
    ]
    cells: list[object] = [None, 12345, 1.5, True, "-", ""]
    rows = [[word() if rng.random() < 0.6 else rng.choice(cells) for _ in cols] for _ in range(rng.choice([0, 1, 5]))]
    title = rng.choice(["", "files", "model tensors", " lead", "trail ", "a long title " * rng.randint(1, 8)])
    return title, cols, rows


@pytest.mark.parametrize("seed", range(2))
def test_plain_tables_are_rich_tables_byte_for_byte(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(120):
        title, cols, rows = _table(rng)
        width = rng.choice([20, 40, 60, 80, 120, 200, 100_000])
        plain, ref, a, b = _pair(width)
        hidden = print_table(plain, title, cols, rows)
        assert print_table(ref.rich, title, cols, rows) == hidden
        plain.print("a line", "and more")
        ref.rich.print("a line", "and more")
        assert a.getvalue() == b.getvalue(), (width, title, [(c.name, c.kind) for c in cols], rows)


def test_lines_and_cells_that_rich_lays_out_still_match() -> None:
    plain, ref, a, b = _pair(60)
    rows = [["a.b.c\x1b[2J", key_cell("model.layers.0.mlp.experts.gate_up_proj", "x.y", more="+3 more"), "é"]]
    for con in (plain, ref.rich):
        con.print("key\nwith a newline \u202e and \t tab  ")
        con.print(styled("result      ", ("OK", "bold green"), ": fine"))
        print_table(con, "findings", [Col("code", "code"), Col("key", "key"), Col("message", "text")], rows)
        con.print("model.layers." * 9, end="")
        con.print()
    assert a.getvalue() == b.getvalue()
    assert "\\x1b[2J" in a.getvalue() and "\\x0a" in a.getvalue()


def test_piped_inspect_and_export_import_no_rich(tmp_path: Path) -> None:
    sample = tmp_path / "sample"
    _, made = modules_after(tmp_path, "sample", str(sample))
    assert made.returncode == 0, made.stderr
    for argv in (("inspect", str(sample)), ("export", str(sample), str(tmp_path / "out"))):
        modules, proc = modules_after(tmp_path, *argv)
        assert proc.returncode == 0, proc.stderr
        assert "┏" in proc.stdout
        assert not any(m == "rich" or m.startswith("rich.") for m in modules), argv
        assert not any(m.split(".")[0] in ("torch", "numpy") for m in modules), argv


def test_trailing_spaces_are_dropped_as_before_and_a_long_run_of_padding_in_one_pass(tmp_path: Path) -> None:
    """The writer drops spaces (and keeps SGR codes) before each newline exactly as its first pattern did, on random
    text of spaces, tabs, colour codes and newlines; a run of 300,000 spaces that no newline follows (a --wide
    table's padding beside a key of 10^5 characters) is written through as it is. Before, the pattern was tried
    from each space of such a run: N^2 steps (`inspect --wide` of a 200,000-character key ran for 6 minutes)."""
    import re

    import torch
    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    first = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)(?=\n)")
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice([" ", " ", "\t", "\n", "x", "│", "\x1b[0m", "\x1b[1;31m"]) for _ in range(30))
        out = io.StringIO()
        _NoTrailingWhitespace(out).write(text + "\n")
        assert out.getvalue() == first.sub(r"\1", (text + "\n").rstrip(" \t")), repr(text)
    out = io.StringIO()
    _NoTrailingWhitespace(out).write("x" + " " * 300_000 + "│\ny \t\x1b[0m\n")
    assert out.getvalue() == "x" + " " * 300_000 + "│\ny\x1b[0m\n"
    key = "blocks." * 15_000 + "weight"
    dcp.save({"model": {key: torch.zeros(2), "norm.weight": torch.ones(2)}}, checkpoint_id=str(tmp_path), no_dist=True)
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--wide"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert res.stdout.count("blocks.") == 15_000 and all(line == line.rstrip() for line in lines)  # the key whole
