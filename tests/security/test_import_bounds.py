"""Imports and configs that would exhaust the machine or crash: every count bounded before work (round 3, class 3).

Each case starts from a real ``save_pretrained`` directory (``tests/fixtures/hf_models.py``) and is
damaged as an attacker would: a config's ``num_experts``, an expert's number, the experts
present, the rank of per-expert weights, safetensors shapes past torch's limits, and a config
whose model class would take minutes to build. Contract: one ``error: [E...]`` line (never
``E999``), exit 2, no traceback, nothing written, the source unchanged — or a valid output.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()
EXPERT = "model.layers.0.mlp.experts.{j}.{p}.weight"


@pytest.fixture(scope="session")
def hf_dirs(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "import_hf_dirs", hf_models.build_hf_dirs)


def _tensors(d: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _resave(src: Path, dst: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> Path:
    """``src``'s tensors, edited, saved by safetensors' own ``save_file`` as one ``model.safetensors`` + config."""
    from safetensors.torch import save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file({k: v.contiguous() for k, v in edit(_tensors(src)).items()}, str(dst / "model.safetensors"))
    return dst


def rewrite_header(f: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a safetensors file's JSON header in place of the real one (data region kept; offsets are relative)."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _refused_or_valid(argv: list[str], src: Path, out: Path, codes: set[str]) -> str:
    before = _snapshot(src)
    res = runner.invoke(app, argv)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert _snapshot(src) == before, "the source was modified"
    if res.exit_code == 0:
        return "ok"
    lines = res.stderr.strip().splitlines()
    assert res.exit_code in (1, 2) and lines, res.stderr
    assert len(lines) <= 2 and lines[0].startswith("error: [E") and "E999" not in lines[0], res.stderr
    assert lines[0][8:12] in codes, res.stderr
    assert not out.exists(), "a refused run left output"
    return lines[0][8:12]


def _experts_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _moe(hf_dirs: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], dict[str, Any]] = dict) -> Path:
    return _resave(hf_dirs / "qwen_moe", tmp_path / "hf", edit)


def test_config_num_experts_of_10_11_is_refused(hf_dirs: Path, tmp_path: Path) -> None:
    d = _moe(hf_dirs, tmp_path)
    _experts_config(d, num_experts=10**11)
    got = _refused_or_valid(["import", str(d), str(tmp_path / "o")], d, tmp_path / "o", {"E601"})
    assert got == "E601"


def test_an_expert_numbered_99999999999_is_refused(hf_dirs: Path, tmp_path: Path) -> None:
    def renumber(sd: dict[str, Any]) -> dict[str, Any]:
        for p in ("gate_proj", "up_proj", "down_proj"):
            sd[EXPERT.format(j=99999999999, p=p)] = sd.pop(EXPERT.format(j=3, p=p))
        return sd

    d = _moe(hf_dirs, tmp_path, renumber)
    _experts_config(d, num_experts=None)
    assert _refused_or_valid(["import", str(d), str(tmp_path / "o")], d, tmp_path / "o", {"E601"}) == "E601"


def test_an_expert_numbered_with_5000_digits_is_refused(hf_dirs: Path, tmp_path: Path) -> None:
    """An expert number of 5,000 digits: ``int()`` refuses strings of more than 4,300 digits, and import was E999
    'internal error: ValueError: Exceeds the limit'. It is E206 naming the key, as every command of the folder says."""

    def renumber(sd: dict[str, Any]) -> dict[str, Any]:
        for p in ("gate_proj", "up_proj", "down_proj"):
            sd[EXPERT.format(j="9" * 5000, p=p)] = sd.pop(EXPERT.format(j=3, p=p))
        return sd

    d = _moe(hf_dirs, tmp_path, renumber)
    _experts_config(d, num_experts=None)
    assert _refused_or_valid(["import", str(d), str(tmp_path / "o")], d, tmp_path / "o", {"E206"}) == "E206"
    for command in ("inspect", "validate"):
        assert _refused_or_valid([command, str(d)], d, tmp_path / "o", {"E206"}) == "E206"


def test_only_down_proj_experts_give_a_coded_answer(hf_dirs: Path, tmp_path: Path) -> None:
    d = _moe(
        hf_dirs,
        tmp_path,
        lambda sd: {k: v for k, v in sd.items() if not k.endswith(("gate_proj.weight", "up_proj.weight"))},
    )
    _refused_or_valid(["import", str(d), str(tmp_path / "o")], d, tmp_path / "o", {"E601", "E605"})


@pytest.mark.parametrize("rank", [1, 3])
def test_per_expert_weights_of_another_rank_are_refused(hf_dirs: Path, tmp_path: Path, rank: int) -> None:
    def reshape(sd: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.reshape(-1) if rank == 1 else v.unsqueeze(0)) if ".experts." in k else v for k, v in sd.items()}

    d = _moe(hf_dirs, tmp_path, reshape)
    assert _refused_or_valid(["import", str(d), str(tmp_path / "o")], d, tmp_path / "o", {"E601"}) == "E601"


SHAPES = {
    "past_2_62": [0, 2**70],
    "80_dims": [1] * 80,
    "200000_dims": [1] * 200_000,
    "strides_past_int64": [0, 2**40, 2**40],
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("command", ["import", "validate", "export"])
def test_safetensors_shapes_past_torchs_limits_are_refused_everywhere(
    hf_dirs: Path, tmp_path: Path, shape: str, command: str
) -> None:
    """An extra empty tensor whose shape torch cannot describe: refused by import, ``validate --deep`` and export."""
    d = _resave(hf_dirs / "llama", tmp_path / "hf", dict)

    def add(header: dict[str, Any]) -> None:
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        header["model.extra.weight"] = {"dtype": "F32", "shape": SHAPES[shape], "data_offsets": [end, end]}

    rewrite_header(d / "model.safetensors", add)
    out = tmp_path / "o"
    argv = {
        "import": ["import", str(d), str(out)],
        "validate": ["validate", str(d), "--strict", "--deep"],
        "export": ["export", str(d), str(out)],
    }[command]
    assert _refused_or_valid(argv, d, out, {"E200"}) == "E200"


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_experts"])
@pytest.mark.parametrize("command", ["export", "validate"])
def test_config_bombs_are_refused_before_the_model_is_built(
    hf_dirs: Path, tmp_path: Path, sample_ckpt: Path, field: str, command: str
) -> None:
    """``num_hidden_layers: 200000`` ran the meta-model build for minutes and GBs; refused by a bound from the config."""
    assets = tmp_path / "assets"
    assets.mkdir()
    cfg = json.loads((sample_ckpt / "model_assets" / "config.json").read_text())
    cfg[field] = 200_000 if field == "num_hidden_layers" else 10**9
    (assets / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o"
    argv = {
        "export": ["export", str(sample_ckpt), str(out), "--model-assets", str(assets)],
        "validate": ["validate", str(sample_ckpt), "--config", str(assets / "config.json")],
    }[command]
    # num_experts: export's expert check (E601) may see it first; either way nothing is built
    want = {"E307"} if field == "num_hidden_layers" else {"E307", "E601"}
    assert _refused_or_valid(argv, sample_ckpt, out, want) in want


def test_megatron_import_of_a_config_claiming_1e18_layers_is_refused_at_once(hf_dirs: Path, tmp_path: Path) -> None:
    """``num_hidden_layers: 10**18`` made ``import --schema megatron`` build one layer record per claimed layer
    (no end, memory growing); the first layer the files lack is reported missing (E601) instead."""
    import subprocess
    import sys

    d = tmp_path / "hf"
    shutil.copytree(hf_dirs / "llama", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**18
    (d / "config.json").write_text(json.dumps(cfg))
    before = _snapshot(d)
    out = tmp_path / "o"
    try:
        res = subprocess.run(
            [sys.executable, "-m", "ckpttool", "import", str(d), str(out), "--schema", "megatron"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("import --schema megatron did not end within 60 s")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 2, res.stderr
    assert lines[0].startswith("error: [E601] model.layers.") and "missing from the HF model" in lines[0], res.stderr
    assert lines[1].startswith("hint: ") and not out.exists() and _snapshot(d) == before
