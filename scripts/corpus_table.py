"""Print docs/security.md's corpus table: what every command does with every hostile corpus entry.

Builds the corpus (``tests/fixtures/hostile.py``) from a fresh ``ckpttool sample`` checkpoint and
runs each command of the matrix (``tests/security/test_hostile_matrix.py``) in process, as the
matrix test does. Cells: ``ok`` exit 0; ``1 findings``; ``2 Exxx`` the error's code.

Usage: python scripts/corpus_table.py [--workdir DIR] [--entries A,B] [--commands X,Y]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--entries", default="", help="comma-separated entry names (default: every entry)")
    ap.add_argument("--commands", default="", help="comma-separated command ids (default: every command)")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from ckpttool.ops.sample import write_sample
    from tests.fixtures.hostile import TMP_OUT, build_corpus
    from tests.security.test_hostile_matrix import COMMAND_IDS, MATRIX, copy_entry

    work = a.workdir or Path(tempfile.mkdtemp(prefix="ckpttool-corpus-"))
    base = write_sample(work / "sample").path
    corpus = build_corpus(work / "corpus", base, tuple(a.entries.split(",")) if a.entries else None)
    cids = a.commands.split(",") if a.commands else COMMAND_IDS
    runner = CliRunner()
    print("| entry | what is wrong | " + " | ".join(f"`{c}`" for c in cids) + " |")
    print("|---|---|" + "---|" * len(cids))
    for name, entry in corpus.items():
        cells = []
        for cid in cids:
            ckpt = entry.ckpt
            scratch = work / "scratch"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            out = scratch / "out"
            if cid == "stamp" or entry.extra.get("out_beside"):
                copy_entry(entry.ckpt.parent, scratch / "entry")
                ckpt = scratch / "entry" / entry.ckpt.name
                if entry.extra.get("out_beside"):  # OUT beside a source named like OUT's temporary
                    out = ckpt.parent / TMP_OUT
            argv = MATRIX[cid][1](ckpt, out) + list(entry.extra.get("args", {}).get(cid, []))
            res = runner.invoke(app, argv)
            m = re.match(r"error: \[(E\d{3})\]", res.stderr)
            cells.append("ok" if res.exit_code == 0 else f"{res.exit_code} {m.group(1) if m else 'findings'}")
        print(f"| `{name}` | {entry.description.replace('|', '/')} | " + " | ".join(cells) + " |")
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
