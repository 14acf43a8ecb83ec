"""What a new user met on a narrow terminal and in ``--help``, each through the CLI: usage lines that
name arguments as POSIX usage does, label/value lines and verdicts that keep their value column and
never part a number from its unit, a progress bar that stays on one line at 50 columns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import COMMANDS, app
from ckpttool.ui.render import hanging_indent
from tests.cli.test_terminal import ANSI, run_in_pty

runner = CliRunner()

#: A number at the end of a line whose unit starts the next one (``538`` / ``ms in all``).
_PARTED = re.compile(r"\d\n\s*(?:[KMGT]i?B|[kMGT]B|B|ms|s)\b")


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("inspect", "CHECKPOINT"),
        ("validate", "[CHECKPOINT]"),
        ("export", "CHECKPOINT OUT"),
        ("import", "HF_DIR OUT"),
        ("diff", "A B"),
        ("stats", "CHECKPOINT..."),  # one or more
        ("schema", "[NAME]"),
    ],
)
def test_usage_lines_name_arguments_as_posix_usage_does(name: str, usage: str) -> None:
    res = runner.invoke(app, [name, "--help"])
    assert res.exit_code == 0
    assert res.stdout.splitlines()[0] == f"Usage: ckpttool {name} [OPTIONS] {usage}"


def test_no_usage_line_writes_braces() -> None:
    for name in COMMANDS:
        first = runner.invoke(app, [name, "--help"]).stdout.splitlines()[0]
        assert "{" not in first and "}" not in first, first


def test_a_number_stays_with_its_unit_when_a_line_wraps() -> None:
    line = "bytes       model 166.8 KiB, optimizer_state 333.6 KiB, other 0 B"
    assert hanging_indent(line, 50) == "bytes       model 166.8 KiB, optimizer_state\n            333.6 KiB, other 0 B"
    assert hanging_indent("exported 33 tensors, 83.4 KiB in 1 file to e2 (538 ms in all)", 50) == (
        "exported 33 tensors, 83.4 KiB in 1 file to e2\n(538 ms in all)"
    )


def test_a_flag_stays_with_its_value_when_a_line_wraps() -> None:
    assert hanging_indent("pick an earlier step with --step N, or wait", 33) == (
        "pick an earlier step with\n--step N, or wait"
    )
    # a flag followed by another flag or a parenthesis is not glued to it
    assert hanging_indent("pick an earlier step with --deep --strict (both)", 33) == (
        "pick an earlier step with --deep\n--strict (both)"
    )


def test_export_summary_labels_keep_their_value_column_when_wrapped() -> None:
    """export's ``not exported`` (12 wide) and ``config.json`` (a dot in it) labels: at 40 columns their values wrapped
    to the left margin ("not exported not a LoRA adapter tensor:" then "21" alone), unlike every other label line."""
    line = "not exported LoRA factor merged into its base weight: 28; replaced by its modules_to_save copy: 1"
    assert hanging_indent(line, 40) == (
        "not exported LoRA factor merged into its\n             base weight: 28; replaced\n"
        "             by its modules_to_save\n             copy: 1"
    )
    line = 'config.json torch_dtype (unset) -> "bfloat16"; dtype "float32" -> "bfloat16"'
    assert hanging_indent(line, 40) == (
        'config.json torch_dtype (unset) ->\n            "bfloat16"; dtype "float32"\n            -> "bfloat16"'
    )
    # a label-free line still wraps at the left margin
    assert hanging_indent("narrowing casts (precision or range lost): float32->bfloat16 x21", 40) == (
        "narrowing casts (precision or range\nlost): float32->bfloat16 x21"
    )


def test_export_at_50_columns_bar_on_one_line_summary_wrapped_whole(sample_ckpt: Path, tmp_path: Path) -> None:
    rc, out = run_in_pty(["export", str(sample_ckpt), str(tmp_path / "hf"), "--save-dtype", "bf16"], 50)
    assert rc == 0, out
    text = ANSI.sub("", out)
    assert "export: writing ━" in text
    assert not re.search(r"\n\s*KiB", text)  # the bar's amount never wraps onto a line of its own
    assert not _PARTED.search(text), text
    assert re.search(r"\(\d[\d.]* m?s in all; written in \d[\d.]* m?s, ", text.replace("\n", " ")), text


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_side_step_on_a_checkpoint_is_named_as_typed(side: str, sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["diff", str(sample_ckpt), str(sample_ckpt), f"--{side}-step", "3"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith(f"error: [E100] --{side}-step 3 given, but {sample_ckpt} is a checkpoint itself\n")
    assert f"drop --{side}-step" in res.stderr and "--step 3" not in res.stderr


def test_inspect_quotes_both_prefixes_alike(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(sample_ckpt)])
    assert res.exit_code == 0
    assert "key schema  torch-native (detected): model 'model.', optimizer 'optimizer.' by fqn" in res.stdout


def test_inspect_names_the_param_group_items_once_and_the_rest_as_other(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(sample_ckpt)])
    assert res.exit_code == 0, res.stderr
    lines = [ln.rstrip() for ln in res.stdout.splitlines()]
    assert "byte items  13 param-group items (17.4 KiB)" in lines
    assert "other byte items" in lines and "byte items" not in lines  # no second heading of the same name


@pytest.mark.parametrize("name", ["", *COMMANDS])
@pytest.mark.parametrize("columns", ["40", "60", "80"])
def test_help_never_splits_a_word(name: str, columns: str) -> None:
    """Option descriptions wrap at spaces: ``docs/ex`` / ``port.md``, ``app-`` / ``state`` (a choice name),
    ``--source-`` / ``layout`` and ``CK`` / ``PTTOOL_CACHE_DIR`` were split at 60 or 80 columns. A word longer
    than the column is split after a ``.``, ``/``, ``(``, ``=`` or ``_`` only (``torch.load(`` /
    ``weights_only=False)``)."""
    args = [name, "--help"] if name else ["--help"]
    words = re.compile(r"[^\s,|<>]+")  # a choice list folded at a narrow width reads `SCHEMA ... One of: a, b.`
    narrow = words.findall(runner.invoke(app, args, env={"COLUMNS": columns}).stdout)
    wide = set(words.findall(runner.invoke(app, args, env={"COLUMNS": "400"}).stdout))
    i, split = 0, []
    while i < len(narrow):
        w, j = narrow[i], i + 1
        if w in wide or w.rstrip(".") in wide or w.isupper() or w in ("One", "of:"):
            i = j
            continue
        joined = w  # a long word split after punctuation: its pieces join to a word of the wide help
        while j < len(narrow) and joined not in wide and joined[-1] in "./(=_":
            joined, j = joined + narrow[j], j + 1
        if joined in wide or joined.rstrip(".") in wide:
            i = j
            continue
        split.append(w)
        i += 1
    assert split == []


@pytest.mark.parametrize("name", ["", *COMMANDS])
@pytest.mark.parametrize("columns", ["40", "60", "80", "100"])
def test_help_description_never_parts_a_word_at_its_hyphen(name: str, columns: str) -> None:
    """A command's description paragraphs wrapped as click does, at hyphens: ``diff --help`` at 80 columns
    read ``--source-layout/--ep-`` / ``size/--ep-fsdp-size`` and ``import --help`` ``bit-`` / ``exact``
    (the test above compares with the help at 400 columns, which click also wraps at 80)."""
    args = [name, "--help"] if name else ["--help"]
    res = runner.invoke(app, args, env={"COLUMNS": columns})
    assert res.exit_code == 0
    parted = [line for line in res.stdout.splitlines() if re.search(r"[A-Za-z]-$", line)]
    assert parted == []


def test_diff_help_keeps_its_layout_flags_whole_at_80_columns() -> None:
    res = runner.invoke(app, ["diff", "--help"], env={"COLUMNS": "80"})
    assert "--source-layout/--ep-size/--ep-fsdp-size/--no-ep" in res.stdout
    assert "bit-exact" in runner.invoke(app, ["import", "--help"], env={"COLUMNS": "80"}).stdout


def test_verbose_help_shows_no_range_and_still_counts(sample_ckpt: Path) -> None:
    """``-v, --verbose ... -vv: everything.  [x>=0]``: Typer showed the count's range, which says nothing."""
    for args in (["--help"], ["inspect", "--help"]):
        assert "[x>=0]" not in runner.invoke(app, args, env={"COLUMNS": "100"}).stdout
    one = runner.invoke(app, ["-v", "validate", str(sample_ckpt)]).stderr
    two = runner.invoke(app, ["validate", str(sample_ckpt), "-vv"]).stderr
    assert "info: [" in one and "debug: [" not in one and "debug: [" in two


def test_replay_step_help_names_every_cause_of_exit_1(tmp_path: Path) -> None:
    """The help said ``1: a mismatch beyond tolerance``; a zeroed exp_avg_sq that matches the reference
    exits 1 too (an update beyond its bound, R003), as docs/replay.md says; so do a saved lr or eps of 0, saved moments
    beyond Adam's bound and a state reset to step 0 in a group that stepped, which the help did not name."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    text = " ".join(runner.invoke(app, ["replay-step", "--help"], env={"COLUMNS": "100"}).stdout.split())
    assert (
        "1: a mismatch beyond tolerance, an update beyond its bound or a saved lr or eps of 0 (R003), saved moments "
        "beyond Adam's bound or a step reset to 0 (O007, D007), a stepped parameter that could not be replayed, steps "
        "counted with no optimizer state saved, an optimizer step that is not the trainer's or the LR scheduler's (R002), or a group lr not "
        "the LR scheduler's (R006)"
    ) in text
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    osd["state"]["weight"]["exp_avg_sq"].zero_()
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    res = runner.invoke(app, ["replay-step", str(tmp_path / "ck")])
    assert res.exit_code == 1 and "update size [R003]" in res.stderr
