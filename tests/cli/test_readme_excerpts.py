"""scripts/readme_excerpts.py: the README's excerpts block is where the script writes, and ``--check``
ignores only timings and rates (scripts/check runs the full ``--check`` against fresh runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("readme_excerpts", ROOT / "scripts" / "readme_excerpts.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["readme_excerpts"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_holds_one_generated_block_with_every_shown_command() -> None:
    mod = _script()
    text = (ROOT / "README.md").read_text()
    start, end = mod.current(text)
    block = text[start:end]
    assert text.count(mod.BEGIN) == 1 and text.count(mod.END) == 1
    shown = [c for c, picks in mod.EXCERPTS if picks]
    assert [ln[2:] for ln in block.splitlines() if ln.startswith("$ ")] == shown
    try_it = text[text.index("## Try it") : text.index("## What each command answers")]
    assert all(c in try_it for c, _ in mod.EXCERPTS[:4])  # the commands of "Try it"


def test_check_masks_timings_and_rates_only() -> None:
    mod = _script()
    a = "exported 33 tensors, 166.8 KiB in 1 file to /tmp/x (31.6 ms, 5.4 MB/s) in 0.41 s"
    b = "exported 33 tensors, 166.8 KiB in 1 file to /tmp/x (6.20 s, 27.5 kB/s) in 1.02 s"
    assert mod.masked(a) == mod.masked(b)
    assert mod.masked(a) != mod.masked(a.replace("33 tensors", "34 tensors"))
    assert mod.masked("166.8 KiB") == "166.8 KiB"
