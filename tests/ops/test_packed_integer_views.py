"""``inspect``, ``validate`` and ``diff`` of HF folders whose linear weights are integer-packed quantized codes.

The folders are a real tiny Llama's ``save_pretrained`` tensors with its linear weights replaced by each method's
pieces (AWQ / GPTQ ``qweight``, bitsandbytes 4-bit / 8-bit, compressed-tensors ``pack-quantized`` /
``int-quantized``: :func:`tests.ops.test_import_quantized._packed`, which ``import`` refuses with E612). Each
command names them as packed integer weights, never an OK or a plain value comparison that says nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.ops.test_import_quantized import PACKED_NAMES, _packed, _write_folder

runner = CliRunner()

METHODS = list(PACKED_NAMES)
NAME = PACKED_NAMES


def _folder(tmp_path: Path, method: str, name: str = "src") -> tuple[Path, dict[str, Any], str]:
    tensors, cfg, first = _packed(method)
    return _write_folder(tmp_path / name, tensors, cfg), tensors, first


@pytest.mark.parametrize("method", METHODS)
def test_inspect_names_packed_integer_weights(tmp_path: Path, method: str) -> None:
    """inspect listed the packed codes as ordinary int32 / int8 / uint8 model tensors with no word of quantization.
    Now ``quantized.packed`` (--json) lists every packed weight with its method, and the text says so."""
    src, tensors, first = _folder(tmp_path, method)
    res = runner.invoke(app, ["inspect", str(src), "--json"])
    assert res.exit_code == 0, res.output
    packed = json.loads(res.stdout)["quantized"]["packed"]
    assert packed[0]["weight"] == first and NAME[method] in packed[0]["method"], packed
    n_linear = 14  # 2 layers x 7 projections
    assert len(packed) == n_linear and all(p["weight"] in tensors or p["method"].startswith("bits") for p in packed)
    text = runner.invoke(app, ["inspect", str(src)])
    assert text.exit_code == 0, text.output
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("packed"))
    assert f"{n_linear} integer-packed" in line and NAME[method] in line and first in line, line


@pytest.mark.parametrize("deep", [[], ["--deep"]])
@pytest.mark.parametrize("method", METHODS)
def test_validate_warns_of_packed_integer_weights(tmp_path: Path, method: str, deep: list[str]) -> None:
    """validate (and --deep, which read the codes as values) said ``OK: 0 errors, 0 warnings`` of such a folder
    (compressed-tensors packed: M020 errors calling its scales FP8 scales of a missing weight). Now one M026
    warning a method names the first packed weight and the method; --strict fails."""
    src, _, first = _folder(tmp_path, method)
    res = runner.invoke(app, ["validate", str(src), "--json", "--strict", *deep])
    assert res.exit_code == 1, res.output
    found = [f for f in json.loads(res.stdout)["findings"] if f["severity"] != "info"]
    assert [(f["code"], f["key"]) for f in found] == [("M026", first)], found
    assert NAME[method] in found[0]["message"] and "13 more" in found[0]["message"], found


@pytest.mark.parametrize("method", ["awq", "bnb-8bit", "ct-pack"])
def test_diff_says_packed_codes_are_compared_as_stored_integers(tmp_path: Path, method: str) -> None:
    """diff compared the packed codes as if they were values (max abs 1, rel L2, cosine of int32 words), no note.
    Now a note per side says they are integer-packed quantized weights compared as their stored codes."""
    a, tensors, first = _folder(tmp_path, method, "a")
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] += 1
    b = _write_folder(tmp_path / "b", tensors, json.loads((a / "config.json").read_text()))
    res = runner.invoke(app, ["diff", str(a), str(b), "--json"])
    assert res.exit_code == 1, res.output  # the sides differ
    out = json.loads(res.stdout)
    assert not out["equal"] and any(t["name"] == first and t["status"] == "differ" for t in out["tensors"])
    notes = [n for n in out["notes"] if "integer-packed" in n]
    assert [n[:3] for n in notes] == ["A: ", "B: "] and all(NAME[method] in n and first in n for n in notes), notes
    assert all("stored integer codes" in n for n in notes), notes
    text = runner.invoke(app, ["diff", str(a), str(b)])
    assert "integer-packed" in text.stdout, text.stdout
