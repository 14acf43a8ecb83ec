"""Sharded Hugging Face folders read as the index describes them, or refused (round 3, class "sharded HF folders").

Every folder is a real ``ckpttool export`` of the ``sample`` save (two shards and an index) or a
``save_file`` of real tensors, then damaged: a shard deleted with the index still listing it, a
shard added, an index entry pointing at another shard, a gap between tensors in a data region
(which safetensors itself refuses), and PEFT's ``adapter_model.safetensors`` beside the model.
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

runner = CliRunner()


@pytest.fixture(scope="module")
def export_dir(sample_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "export"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--shard-size", "100KB"])
    assert res.exit_code == 0, res.stderr
    assert len(list(out.glob("*.safetensors"))) == 2
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(src, d)
    return d


def _validate(d: Path) -> tuple[int, str]:
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep"])
    assert "Traceback" not in res.stderr and "E999" not in res.stdout + res.stderr, res.stderr
    return res.exit_code, res.stdout + res.stderr


def _index(d: Path) -> dict[str, Any]:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def _delete_shard(d: Path) -> None:
    _shards(d)[1].unlink()


def _add_shard(d: Path) -> None:
    shutil.copy(_shards(d)[1], d / "model-00003-of-00003.safetensors")


def _redirect_entry(d: Path) -> None:
    """The index places one tensor of shard 1 in shard 2 (an attacker's added shard would be named the same way)."""
    idx = _index(d)
    first, second = (p.name for p in _shards(d))
    key = next(k for k, v in idx["weight_map"].items() if v == first)
    idx["weight_map"][key] = second
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _unlisted_tensor(d: Path) -> None:
    idx = _index(d)
    idx["weight_map"].pop(next(iter(idx["weight_map"])))
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "shard_deleted": (_delete_shard, "E202"),
    "shard_added": (_add_shard, "E200"),
    "entry_redirected": (_redirect_entry, "E200"),
    "tensor_not_in_index": (_unlisted_tensor, "E200"),
}


def test_an_intact_export_validates(export_dir: Path) -> None:
    assert _validate(export_dir)[0] == 0


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_the_index_is_checked_against_the_shards(export_dir: Path, tmp_path: Path, damage: str) -> None:
    d = _copy(export_dir, tmp_path)
    fn, code = DAMAGE[damage]
    fn(d)
    exit_code, text = _validate(d)
    assert exit_code != 0 and f"[{code}]" in text, text
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o")])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E") and "E999" not in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


def _gap_file(d: Path, drop: str) -> None:
    """A real ``save_file`` whose header then forgets one tensor: its bytes become a gap (or trailing bytes)."""
    import torch
    from safetensors.torch import save_file

    d.mkdir()
    f = d / "model.safetensors"
    save_file({"a.weight": torch.arange(8.0), "b.weight": torch.ones(4), "c.weight": torch.zeros(2)}, str(f))
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop(drop)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize("drop", ["a.weight", "b.weight", "c.weight"])
def test_gaps_in_a_data_region_are_refused_as_safetensors_refuses_them(tmp_path: Path, drop: str) -> None:
    from safetensors import SafetensorError, safe_open

    d = tmp_path / "g"
    _gap_file(d, drop)
    with pytest.raises(SafetensorError):  # the reference: safetensors' own loader
        with safe_open(str(d / "model.safetensors"), "pt") as st:
            [st.get_tensor(k) for k in st.keys()]
    exit_code, text = _validate(d)
    assert exit_code != 0 and "[E200]" in text, text
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o")])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E200]"), res.stderr


def test_an_adapter_beside_the_model_is_not_imported_as_base_weights(export_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    d = _copy(export_dir, tmp_path)
    lora = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file(
        {lora: torch.ones(2, 32), "model.norm.weight": torch.full((32,), 7.0)}, str(d / "adapter_model.safetensors")
    )
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o"), "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert any("adapter_model.safetensors" in w for w in doc["warnings"]), doc["warnings"]
    from ckpttool.format.reader import CheckpointReader

    with CheckpointReader(tmp_path / "o") as r:
        assert not any("lora" in k for k in r.metadata.entries)
        norm = r.read_tensor("model.model.norm.weight")
    assert not torch.equal(norm, torch.full((32,), 7.0))  # the model's own norm, not the adapter file's


def test_a_folder_holding_only_a_peft_adapter_is_not_imported_as_a_model(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "adapter"
    d.mkdir()
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 32)},
        str(d / "adapter_model.safetensors"),
    )
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "out")])
    assert res.exit_code == 2 and "holds only a PEFT adapter" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../other/model-00002-of-00002.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_index_naming_a_file_outside_the_folder_says_so(export_dir: Path, tmp_path: Path, name: str) -> None:
    """A weight_map value that is not a file of the folder: E200 naming it as such (it was E202 "missing", whose
    hint says to download the missing shard), in validate and import; nothing outside is read."""
    d = _copy(export_dir, tmp_path)
    idx = _index(d)
    key = next(iter(idx["weight_map"]))
    idx["weight_map"][key] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    rc, out = _validate(d)
    assert rc == 2 and "[E200]" in out and "not a file of this folder" in out and repr(name) in out, out
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o")])
    assert res.exit_code == 2 and "not a file of this folder" in res.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("folder", ["huggingface", "model_assets", ".hf_metadata"])
def test_a_config_folder_symlinked_out_of_the_folder_is_refused_not_read(
    export_dir: Path, sample_ckpt: Path, tmp_path: Path, folder: str
) -> None:
    """An HF folder without its own ``config.json`` reads the one a trainer saved beside the weights
    (``huggingface/``, ``model_assets/``, NeMo Automodel's ``.hf_metadata/``); such a folder that is a symlink out of
    the folder was followed, and ``import`` took the config of whatever folder it points at. It is E101, as a
    ``config.json`` symlinked out is, and nothing is written."""
    hf = shutil.copytree(export_dir, tmp_path / "hf")
    assert not (hf / "config.json").exists()
    elsewhere = shutil.copytree(sample_ckpt / "model_assets", tmp_path / "elsewhere")
    (hf / folder).symlink_to(elsewhere, target_is_directory=True)
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "dcp")])
    assert res.exit_code == 2, res.output
    first = res.stderr.splitlines()[0]
    assert first.startswith("error: [E101]") and f"{folder}/config.json" in first, res.stderr
    assert not (tmp_path / "dcp").exists()
