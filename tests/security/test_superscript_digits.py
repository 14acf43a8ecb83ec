"""A superscript digit (``²``) is a digit to ``str.isdigit`` but not to ``int()``.

Where a name was tested with ``isdigit()`` and then read with ``int()``, such a character was E999 'internal error:
ValueError': a DCP whose optimizer param-group key holds ``param_groups.².lr`` (inspect, validate, stats,
replay-step), and the user's ``--step ²``, ``COLUMNS=²`` (``tests/cli``) and a ``latest`` file holding ``²``
(``tests/model/test_discovery.py``). Decimal digits are tested with ``isdecimal()``, what ``int()`` reads.
"""

from __future__ import annotations

import dataclasses
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
