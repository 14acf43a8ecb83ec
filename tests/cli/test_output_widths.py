"""Human output at 60/80/100/200 columns and in a pipe: nothing misleads.

Numbers, shapes, dtypes and codes are never split across lines; keys are never cut (folded at
worst); low-value columns are hidden, and named, before that; no line ends in whitespace; the
width is ``COLUMNS`` or, piped, a fixed default; and no Python repr (``None``, ``{'``, ``[]``,
``True``) or ``1 data files`` reaches a human.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ui.render import PIPE_WIDTH, fmt_dict, fmt_rate, fmt_seconds, fmt_shape, fmt_value, plural
from tests.cli.tables import column, tables
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
WIDTHS = (60, 80, 100, 200)
REPRS = re.compile(r"\bNone\b|\{'|\[\]|\bTrue\b|\bFalse\b|\b1 data files\b|\b0\.00 GB/s")
NUMBER = re.compile(r"-?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")
ERR_CELL = re.compile(r"\d\.\de[-+]\d{2}/\d\.\de[-+]\d{2}( !)?")


@pytest.fixture(scope="module")
def broken(dense_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = copy_checkpoint(dense_ckpt, tmp_path_factory.mktemp("w") / "ck")
    assert damage.drop_keys(ck, lambda k: k == "optimizer.param_groups.0.eps")
    (ck / "__5_0.distcp").write_bytes(b"stale")
    return ck


BOX = "┏┃┡│└"


def check_layout(out: str, width: int | None, reprs: bool = True) -> None:
    """No trailing whitespace; tables within ``width`` (piped, a line of text stays whole); no reprs."""
    lines = out.splitlines()
    assert not [ln for ln in lines if ln != ln.rstrip()], "trailing whitespace"
    if width is not None:
        too_long = [ln for ln in lines if ln[:1] in BOX and len(ln) > width]
        assert not too_long, (width, too_long[:3])
    assert not (reprs and REPRS.search(out)), REPRS.search(out)


def invoke(argv: list[str], width: int | None):  # type: ignore[no-untyped-def]
    env = {"COLUMNS": str(width)} if width is not None else {"COLUMNS": ""}
    res = runner.invoke(app, argv, env=env)
    assert res.exit_code in (0, 1), res.stderr
    return res


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect(width: int, sample_ckpt: Path) -> None:
    out = invoke(["inspect", str(sample_ckpt)], width).stdout
    check_layout(out, width)
    doc = json.loads(runner.invoke(app, ["inspect", str(sample_ckpt), "--json"]).stdout)
    t = tables(out)
    model = t["model tensors"]
    assert column(model, "shape") == [fmt_shape(m["shape"]) for m in doc["model"]]
    assert column(model, "dtype") == [m["dtype"] for m in doc["model"]]
    keys = "".join(r[0] for r in model[1])  # folded keys concatenate back to the keys, in order
    assert keys == "".join(m["key"] for m in doc["model"])
    if "numel" in model[0]:
        assert column(model, "numel") == [f"{m['numel']:,}" for m in doc["model"]]
    groups = t["param groups"]
    assert column(groups, "lr") == ["0.00025"] and column(groups, "params") == ["31"]
    geo = t["EP geometry"]
    assert column(geo, "shape") == ["8x32x32", "8x32x16", "8x32x32", "8x32x16"]
    if width >= 200:
        assert "not shown" not in out and "ranks" in model[0] and "initial_lr" in groups[0]
    else:
        assert "(not shown at" in out  # what was left out is named
    assert "files       1 data file from rank 0" in out
    assert "parallel ep_size=1, ep_fsdp_size=1" in out.replace("\n", " ")


@pytest.mark.parametrize("width", WIDTHS)
def test_validate(width: int, broken: Path) -> None:
    out = invoke(["validate", str(broken)], width).stdout
    check_layout(out, width)
    errors = tables(out)["errors (1)"]
    assert column(errors, "code") == ["P001"]
    assert out.splitlines()[-1].startswith("FAILED: 1 error, 1 warning")


@pytest.mark.parametrize("width", WIDTHS)
def test_replay_step(width: int, sample_ckpt: Path) -> None:
    out = invoke(["replay-step", str(sample_ckpt), "--filter", "*layers.0.*"], width).stdout
    check_layout(out, width)
    params = tables(out)["parameters (worst first)"]
    assert all(ERR_CELL.fullmatch(c) for c in column(params, "param")), column(params, "param")
    if "lr" in params[0]:
        assert set(column(params, "lr")) == {"0.00025"}
    assert column(params, "result") == ["ok"] * 14
    assert "".join(r[0] for r in params[1]).count("model.layers.0.") == 14  # keys folded, never cut


@pytest.mark.parametrize("width", WIDTHS)
def test_export_and_rules(width: int, sample_ckpt: Path, tmp_path: Path) -> None:
    out = invoke(["export", str(sample_ckpt), str(tmp_path / "hf"), "--shard-size", "50KB"], width).stdout
    check_layout(out, width)
    assert re.match(r"exported 33 tensors, 166\.8 KiB in \d+ files to .* \(\d.* (ms|s), \d.* [kMG]?B/s\)", out)
    files = tables(out)["files"]
    assert all(NUMBER.fullmatch(n) for n in column(files, "tensors"))
    rules = invoke(["rules"], width).stdout
    check_layout(rules, width, reprs=False)  # rule summaries are prose that may quote Python
    assert len(column(tables(rules)["rules"], "code")) > 30


@pytest.mark.parametrize("width", WIDTHS)
def test_stats(width: int, sample_ckpt: Path) -> None:
    """`stats`'s per-layer table kept the parameter count and ‖exp_avg‖ at any width: 65 columns wide at 60 (the
    terminal wrapped every row). Now they give way, named below, and the layer, ‖weight‖ and update size stay."""
    out = invoke(["stats", str(sample_ckpt)], width).stdout
    check_layout(out, width)
    layers = tables(out)["per layer"]
    assert column(layers, "layer")[0] == "model.embed_tokens", column(layers, "layer")
    assert all(NUMBER.fullmatch(v) for v in column(layers, "‖weight‖") + column(layers, "update rms"))
    shown = set(layers[0])
    assert ("params" in shown) == (width >= 80) and "‖exp_avg‖" in shown, shown
    if "not shown" in out:
        hidden = out.split(f"(not shown at {width} columns: ")[1].split(";")[0].split(", ")
        assert not shown & set(hidden) and {"layer", "‖weight‖", "update rms"} <= shown, (shown, hidden)


def test_piped_output_uses_a_fixed_default_width(sample_ckpt: Path) -> None:
    out = invoke(["inspect", str(sample_ckpt)], None).stdout
    check_layout(out, PIPE_WIDTH)
    assert max(len(ln) for ln in out.splitlines()) > 100  # the table uses it: all its columns fit
    assert "ranks" in tables(out)["model tensors"][0]


def test_a_columns_value_int_does_not_read_is_ignored(sample_ckpt: Path) -> None:
    """``COLUMNS=²`` (a digit to ``str.isdigit``, not to ``int()``) was E999 'internal error: ValueError' in every
    command that prints a table; it is ignored as any other value that is not a width. So is a number of 5,000 digits
    (more than ``int()`` reads: E999 'Exceeds the limit (4300 digits)')."""
    plain = runner.invoke(app, ["inspect", str(sample_ckpt)], env={"COLUMNS": ""}).stdout
    for columns in ("\u00b2", "9" * 5000):
        res = runner.invoke(app, ["inspect", str(sample_ckpt)], env={"COLUMNS": columns})
        assert res.exit_code == 0, res.stderr
        assert res.stdout == plain


def test_wide_never_narrows(sample_ckpt: Path) -> None:
    out = invoke(["inspect", str(sample_ckpt), "--wide"], 60).stdout
    check_layout(out, None)
    assert "not shown" not in out and "ranks" in tables(out)["model tensors"][0]
    assert all("│" not in r[0] for r in tables(out)["model tensors"][1])


def test_formatters() -> None:
    assert fmt_shape((8, 32, 32)) == "8x32x32" and fmt_shape(()) == "scalar" and fmt_shape(None) == "-"
    assert fmt_dict({"ep_size": 4, "tp_size": 1}) == "ep_size=4, tp_size=1" and fmt_dict({}) == "-"
    assert fmt_value(None) == "-" and fmt_value(True) == "yes" and fmt_value([0.9, 0.95]) == "0.9, 0.95"
    assert fmt_value([]) == "-" and fmt_value(1e-8) == "1e-08"
    assert plural(1, "data file") == "1 data file" and plural(2, "batch", "batches") == "2 batches"
    assert fmt_rate(170_816, 0.0153) == "11.2 MB/s" and fmt_rate(2.5e9, 1.0) == "2.5 GB/s"
    assert fmt_rate(100, 0.0) == "-" and fmt_rate(999, 1.0) == "999 B/s"
    # just under a unit's 1000: never "1e+03" (a time near 1 s printed "1e+03 ms", which the README check's
    # timing mask does not match)
    assert fmt_rate(999.7, 1.0) == "1 kB/s" and fmt_rate(999.7e9, 1.0) == "1,000 GB/s"
    assert fmt_rate(999.4e6, 1.0) == "999 MB/s" and fmt_rate(2.5e12, 1.0) == "2,500 GB/s"
    assert fmt_seconds(0.9996) == "1.00 s" and fmt_seconds(0.9994) == "999 ms" and fmt_seconds(0.0123) == "12.3 ms"
    assert fmt_seconds(2.5) == "2.50 s"


@pytest.mark.parametrize("width", [40, 50, 60, 80])
def test_long_keys_in_message_cells_fold_at_dots(width: int) -> None:
    """A key inside a text cell (validate's message naming parameters) that is wider than its column folds after
    a ``.``, as key cells do, never mid-word (``input_layernorm.weig`` / ``ht``)."""
    import io

    from rich.console import Console

    from ckpttool.ui.render import Col, print_table

    words = (
        "2 frozen parameter(s), no optimizer state: model.embed_tokens.weight, model.layers.0.input_layernorm.weight"
    )
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, legacy_windows=False)
    print_table(con, "info", [Col("code", "code"), Col("key", "key"), Col("message", "text")], [["K021", "k", words]])
    cells = [ln.split("│")[3].strip() for ln in buf.getvalue().splitlines() if ln.startswith("│")]
    assert "".join(cells).replace(" ", "") == words.replace(" ", "")
    whole = set(words.split())
    for cell in cells[:-1]:
        last = cell.split()[-1]
        assert last.endswith(".") or last in whole, (width, cells)  # a break after a dot or between words
