"""A superscript digit (``²``) is a digit to ``str.isdigit`` but not to ``int()``.

Where a name was tested with ``isdigit()`` and then read with ``int()``, such a character was E999 'internal error:
ValueError': a DCP whose optimizer param-group key holds ``param_groups.².lr`` (inspect, validate, stats,
replay-step), and the user's ``--step ²``, ``COLUMNS=²`` (``tests/cli``) and a ``latest`` file holding ``²``
(``tests/model/test_discovery.py``). Decimal digits are tested with ``isdecimal()``, what ``int()`` reads.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.metadata_edit import load_md, save_md

runner = CliRunner()


def _rename(ckpt: Path, old: str, new: str) -> None:
    md = load_md(ckpt)
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    for idx in [i for i in md.storage_data if i.fqn == old]:
        md.storage_data[dataclasses.replace(idx, fqn=new)] = md.storage_data.pop(idx)
    if md.planner_data and old in md.planner_data:
        md.planner_data[new] = md.planner_data.pop(old)
    save_md(ckpt, md)


@pytest.mark.parametrize("command", ["inspect", "validate", "stats"])
def test_a_param_group_key_with_a_superscript_is_not_an_internal_error(
    dense_ckpt: Path, tmp_path: Path, command: str
) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    _rename(ck, "optimizer.param_groups.0.lr", "optimizer.param_groups.\u00b2.lr")
    res = runner.invoke(app, [command, str(ck)])
    assert "E999" not in res.output and "Traceback" not in res.output, res.output
    assert res.exit_code in (0, 1), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


@pytest.mark.parametrize("command", ["inspect", "validate", "stats"])
def test_a_param_group_index_of_5000_digits_is_not_an_internal_error(
    dense_ckpt: Path, tmp_path: Path, command: str
) -> None:
    """``optimizer.param_groups.<5,000 digits>.lr``: ``int()`` refuses strings of more than 4,300 digits, and the key was
    E999 'internal error: ValueError: Exceeds the limit'. It is E206 naming the key (no param group has such an index);
    so is a layer or expert index of that length (validate's M025 read an expert's with int())."""
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    _rename(ck, "optimizer.param_groups.0.lr", "optimizer.param_groups." + "9" * 5000 + ".lr")
    res = runner.invoke(app, [command, str(ck)])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: [E206]") and "optimizer.param_groups.999" in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 2 and "Traceback" not in res.output
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck2")
    layer = next(k for k in load_md(ck).state_dict_metadata if re.search(r"\.layers\.0\.", k))
    _rename(ck, layer, layer.replace(".layers.0.", ".layers." + "7" * 5000 + ".", 1))
    res = runner.invoke(app, [command, str(ck)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E206]"), res.stderr[:300]


def test_a_step_of_5000_digits_is_a_usage_error(dense_ckpt: Path) -> None:
    """``--step 999...`` (5,000 digits) was E999 'internal error: ValueError: Exceeds the limit (4300 digits)'."""
    for step in ("9" * 5000, "step-" + "9" * 5000):
        res = runner.invoke(app, ["inspect", str(dense_ckpt.parent), "--step", step])
        assert res.exit_code == 2 and res.stderr.startswith("error: [E100]"), res.stderr[:300]
        assert "E999" not in res.stderr and len(res.stderr.splitlines()) == 2
