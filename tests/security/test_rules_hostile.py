"""A hostile ``--rules`` YAML (export, diff): one E100 line of bounded size, never the expansion of an alias bomb."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _alias_bomb(section: str, depth: int) -> str:
    """``section:`` holding a list whose items alias the previous level: 9**depth leaves from depth+1 lines."""
    text = f"{section}:\n  - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(1, depth):
        text += f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n"
    return text


@pytest.mark.parametrize(
    "section, needle",
    [
        ("format", "format is <list of 7 items>, expected 'ckpttool.export-rules'"),
        ("version", "rules version <list of 7 items> is not supported"),
    ],
)
def test_alias_bomb_in_format_or_version_is_refused_without_expanding_it(
    sample_ckpt: Path, tmp_path: Path, section: str, needle: str
) -> None:
    # was: the message held repr() of the expanded value (9**7 leaves: a 30 MB line; at depth 9 it never finished)
    rules = tmp_path / "rules.yaml"
    rules.write_text(_alias_bomb(section, 7))
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--rules", str(rules), "--dry-run"])
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: [E100] {rules}: ") and needle in lines[0]
    assert lines[1].startswith("hint: ")
    assert len(res.stderr) < 500
    assert not (tmp_path / "out").exists()


def test_alias_bomb_under_a_mapping_value_is_not_expanded(sample_ckpt: Path, tmp_path: Path) -> None:
    # a one-entry mapping passed the "small container" test of short_repr while its value was the bomb
    rules = tmp_path / "rules.yaml"
    rules.write_text("format:\n  x:\n" + "".join(f"  {line}\n" for line in _alias_bomb("", 7).splitlines()[1:]))
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--rules", str(rules), "--dry-run"])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"error: [E100] {rules}: format is <dict of 1 items>, expected")
    assert len(res.stderr) < 500


@pytest.mark.parametrize("warn, shown", [("'no'", "'no'"), ("[x]", "['x']"), ("0", "0")])
def test_key_rule_warn_that_is_not_a_boolean_is_refused(
    sample_ckpt: Path, tmp_path: Path, warn: str, shown: str
) -> None:
    # was accepted as bool(value): the quoted string 'no' turned the warning on
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"keys:\n  - {{match: '^model\\.x$', to: 'x', warn: {warn}}}\n")
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--rules", str(rules), "--dry-run"])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"error: [E100] {rules}: keys[0]: 'warn' is {shown}, expected true or false")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "text, key, line",
    [
        # a second `keys:` section: YAML keeps the last, so the first's skip of model.norm.weight was dropped unsaid
        (
            "keys:\n  - {match: '^model\\.model\\.norm\\.weight$', to: null}\n"
            "tied_embeddings: {embedding: model.embed_tokens.weight, lm_head: lm_head.weight}\n"
            "keys:\n  - {match: '^model\\.lm_head\\.weight$', to: 'output.weight'}\n",
            "'keys'",
            4,
        ),
        # a rule giving `to` twice: which one renames was YAML's choice
        ("keys:\n  - {match: '^model\\.model\\.norm\\.weight$', to: null, to: 'norm.weight'}\n", "'to'", 2),
    ],
)
def test_a_key_given_twice_is_refused_not_the_last_one_taken(
    sample_ckpt: Path, tmp_path: Path, text: str, key: str, line: int
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--rules", str(rules)])
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert lines[0] == f"error: [E100] {rules}: not valid YAML (duplicate key {key} at line {line})"
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert not (tmp_path / "out").exists()


def test_yaml_merge_keys_overridden_by_the_mapping_are_no_duplicates(sample_ckpt: Path, tmp_path: Path) -> None:
    # `<<: *base` then `to:` is YAML's override of a merged key, not a key given twice
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "keys:\n  - &skip {match: '^model\\.model\\.norm\\.weight$', to: null}\n"
        "  - {<<: *skip, match: '^model\\.lm_head\\.weight$', to: 'output.weight'}\n"
    )
    res = runner.invoke(
        app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--rules", str(rules), "--dry-run", "--json"]
    )
    assert res.exit_code == 0, res.stderr


def test_a_rules_file_over_one_mib_is_refused_before_yaml_reads_it(sample_ckpt: Path, tmp_path: Path) -> None:
    # was read up to --max-object-size (256 MiB): YAML builds ~180 bytes of objects per byte of a flow list, a
    # 20 MB file took 46 s and 3.7 GB, 256 MiB some 47 GB
    rules = tmp_path / "rules.yaml"
    rules.write_text("keys: []\n" + "# a comment line of the rules file\n" * 32_000)
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--rules", str(rules), "--dry-run"])
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert lines[0] == f"error: [E307] {rules}: rules file of {rules.stat().st_size} bytes is over the cap of 1 MiB"
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "--max-object-size" not in lines[1]
    assert not (tmp_path / "out").exists()
