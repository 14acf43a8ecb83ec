"""Read the rich tables ckpttool prints back into cells (for width tests)."""

from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def tables(text: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """``title -> (header, physical rows)`` of every box table in ``text`` (ANSI codes removed).

    A physical row is one printed line of cells: a folded key continues on the next row with the
    other cells empty.
    """
    out: dict[str, tuple[list[str], list[list[str]]]] = {}
    lines = ANSI.sub("", text).splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("┏"):
            continue
        title = lines[i - 1].strip() if i else ""
        header = [c.strip() for c in lines[i + 1].strip("┃").split("┃")]
        rows = []
        for row in lines[i + 3 :]:
            if row.startswith("└"):
                break
            rows.append([c.strip() for c in row.strip("│").split("│")])
        out[title] = (header, rows)
    return out


def column(table: tuple[list[str], list[list[str]]], name: str) -> list[str]:
    """The non-empty cells of column ``name`` (continuation lines of folded cells are empty elsewhere)."""
    header, rows = table
    i = header.index(name)
    return [r[i] for r in rows if r[i]]
