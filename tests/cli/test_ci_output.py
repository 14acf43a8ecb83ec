"""Output that survives CI logs: hints never hidden, repeated findings grouped, keys folded at dots,
wrapped label lines indented, ``--json`` and ``--no-progress`` as global options.

Everything through the CLI (exit code, stdout, stderr) at 80 columns, piped (no ``COLUMNS``: the
pipe width) and wide.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.cli.tables import column, tables
from tests.cli.test_terminal import ANSI, run_in_pty

runner = CliRunner()


@pytest.fixture(scope="module")
def bf16_reference(sample_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample exported as BF16: every model tensor differs in dtype from it (33 M008 findings)."""
    out = tmp_path_factory.mktemp("ref") / "hf"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--save-dtype", "bf16"])
    assert res.exit_code == 0, res.stderr
    return out


def _env(width: int | None) -> dict[str, str]:
    return {"COLUMNS": str(width) if width else ""}


@pytest.mark.parametrize("width", [80, None])
def test_narrow_validate_prints_each_hint_below_the_table_once(
    width: int | None, sample_ckpt: Path, bf16_reference: Path
) -> None:
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(bf16_reference)], env=_env(width))
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    assert "not shown" not in out  # the hint column is not hidden: it moved below the table
    hints = re.findall(r"^hint \((\w+)\): (.+)$", out, re.M)
    # each code's hint once: below its table, or in the table's hint column where that fits (P002 at 120)
    assert [c for c, _ in hints] == (["M008", "P002"] if width == 80 else ["M008"])
    if width is None:
        assert "".join(column(tables(out)["info (1)"], "hint")).startswith("resume the scheduler")
    assert hints[0][1].startswith("export with --save-dtype")
    # the 33 M008 findings are one row: their count, the first keys and how many more
    warnings = tables(out)["warnings (do not fail without --strict) (33)"]
    assert column(warnings, "code") == ["M008"] and column(warnings, "count") == ["33"]
    keys = "".join(column(warnings, "key"))
    assert keys.startswith("model.lm_head.weightmodel.model.embed_tokens.weight") and keys.endswith("+30 more")
    assert "(and 32 more like it)" in " ".join(column(warnings, "message"))
    assert all(len(ln) <= (width or 120) for ln in out.splitlines() if ln[:1] in "┏┃┡│└")
    # the JSON document still lists every finding
    doc = json.loads(
        runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(bf16_reference), "--json"]).stdout
    )
    assert sum(f["code"] == "M008" for f in doc["findings"]) == 33


def test_wide_validate_keeps_the_hint_column(sample_ckpt: Path, bf16_reference: Path) -> None:
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(bf16_reference)], env=_env(240))
    assert res.exit_code == 0, res.stderr
    assert "hint (" not in res.stdout
    warnings = tables(res.stdout)["warnings (do not fail without --strict) (33)"]
    assert "".join(column(warnings, "hint")).startswith("export with --save-dtype")
    res = runner.invoke(app, ["--wide", "validate", str(sample_ckpt)], env=_env(80))
    assert "hint (" not in res.stdout and "hint" in tables(res.stdout)["info (1)"][0]


@pytest.mark.parametrize("width", [50, 60])
def test_keys_fold_at_dot_boundaries(width: int, sample_ckpt: Path) -> None:
    out = runner.invoke(app, ["inspect", str(sample_ckpt)], env=_env(width)).stdout
    doc = json.loads(runner.invoke(app, ["inspect", str(sample_ckpt), "--json"]).stdout)
    header, rows = tables(out)["model tensors"]
    pieces = [r[0] for r in rows]
    keys, current = [], ""
    for piece, row in zip(pieces, rows, strict=True):
        if row[1]:  # a row with a shape starts a key; the rows after it without one continue it
            if current:
                keys.append(current)
            current = piece
        else:
            assert current.endswith("."), (current, piece)  # folded after a dot, never mid-word
            current += piece
    keys.append(current)
    assert keys == [m["key"] for m in doc["model"]]
    assert any(not r[1] for r in rows)  # some key did fold at this width


def test_wrapped_label_lines_keep_their_indent(sample_ckpt: Path) -> None:
    rc, out = run_in_pty(["inspect", str(sample_ckpt)], 60)
    assert rc == 0, out
    lines = ANSI.sub("", out).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("key schema  "))
    assert lines[i + 1].startswith(" " * 12) and lines[i + 1][12] != " "  # the value column
    j = next(i for i, ln in enumerate(lines) if ln.startswith("layout      "))
    assert lines[j + 1].startswith(" " * 12) and not lines[j + 1].startswith(" " * 13)
    assert all(len(ln) <= 60 for ln in lines[i : i + 2] + lines[j : j + 2])


def test_a_path_longer_than_the_line_is_never_cut_mid_token(sample_ckpt: Path, tmp_path: Path) -> None:
    """At 40 columns ``checkpoint  PATH`` (a path with no space, wider than the room) was cut by rich: the label
    alone on a line, then the path folded every 40 characters, so a copied path was broken. It stays one token
    after its label, as the ``opened`` line's did (the terminal wraps it)."""
    import shutil

    ckpt = shutil.copytree(sample_ckpt, tmp_path / "a_checkpoint_directory_name_longer_than_the_line")
    rc, out = run_in_pty(["inspect", str(ckpt)], 40)
    assert rc == 0, out
    lines = ANSI.sub("", out).replace("\r", "").splitlines()
    assert f"checkpoint  {ckpt}" in lines, lines[:4]
    i = next(i for i, ln in enumerate(lines) if ln.startswith("key schema  "))
    assert lines[i + 1].startswith(" " * 12) and all(len(ln) <= 40 for ln in lines[i : i + 2])  # words still wrap


def test_json_is_a_global_option_too(sample_ckpt: Path) -> None:
    after = runner.invoke(app, ["inspect", str(sample_ckpt), "--json"])
    before = runner.invoke(app, ["--json", "inspect", str(sample_ckpt)])
    assert before.exit_code == after.exit_code == 0
    assert json.loads(before.stdout) == json.loads(after.stdout)
    res = runner.invoke(app, ["--json", "validate", str(sample_ckpt)])
    assert res.exit_code == 0 and json.loads(res.stdout)["schema"].startswith("ckpttool.validate/")
    res = runner.invoke(app, ["--json", "schema", "inspect"])  # JSON anyway
    assert res.exit_code == 0 and json.loads(res.stdout)["$schema"].startswith("https://json-schema.org/")
    res = runner.invoke(app, ["--json", "sample", "x"])
    assert res.exit_code == 2 and res.stdout == ""
    assert "error: [E100] `ckpttool sample` has no JSON output (--json)" in res.stderr


def test_json_before_a_command_without_json_hints_that_commands_help() -> None:
    """``ckpttool --json sample x`` hinted ``see `ckpttool --help```; the help that shows what ``sample``
    takes (no --json) is ``ckpttool sample --help``, as for ``ckpttool sample x --json``."""
    before = runner.invoke(app, ["--json", "sample", "x"])
    after = runner.invoke(app, ["sample", "x", "--json"])
    assert before.exit_code == after.exit_code == 2
    assert before.stderr.splitlines()[1] == after.stderr.splitlines()[1] == "hint: see `ckpttool sample --help`"


def test_no_progress_before_or_after_the_command(sample_ckpt: Path) -> None:
    for argv in (
        ["--no-progress", "validate", str(sample_ckpt), "--deep"],
        ["validate", str(sample_ckpt), "--deep", "--no-progress"],
    ):
        rc, out = run_in_pty(argv, 100)
        assert rc == 0, out
        assert "validate --deep" not in out and "OK: 0 errors" in ANSI.sub("", out)
    assert "--no-progress" in runner.invoke(app, ["rules", "--help"]).stdout


def test_a_key_component_wider_than_the_column_folds_after_an_underscore(sample_ckpt: Path) -> None:
    """At 40 columns the key column is 16 wide and ``post_attention_layernorm.`` is 25: it was cut
    mid-word (``post_attention_l`` / ``ayernorm.weight``); it folds after its last ``_`` that fits."""
    out = runner.invoke(app, ["inspect", str(sample_ckpt)], env=_env(40)).stdout
    doc = json.loads(runner.invoke(app, ["inspect", str(sample_ckpt), "--json"]).stdout)
    _, rows = tables(out)["model tensors"]
    keys, current = [], ""
    for row in rows:
        if row[1]:
            keys.append(current)
            current = row[0]
        else:
            assert current[-1] in "._", (current, row[0])  # folded after a dot or an underscore
            current += row[0]
    assert keys[1:] + [current] == [m["key"] for m in doc["model"]]
    assert "post_attention_" in [r[0] for r in rows]
    rules = runner.invoke(app, ["rules"], env=_env(40)).stdout
    assert "(get_optimizer_" in rules.replace("│", " ").split()  # prose: a long identifier folds the same way
