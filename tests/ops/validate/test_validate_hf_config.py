"""``M028``: a Hugging Face folder's own ``config.json`` that ``from_pretrained`` cannot read.

The folders are written by transformers' own ``save_pretrained`` (a tiny Llama); ``validate --strict`` said OK on
them with a malformed or dangling ``config.json``, which ``from_pretrained`` and vLLM read before any weight.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    out = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def _validate(path: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", "--strict", str(path), "--json", *args])
    assert "Traceback" not in res.stderr, res.stderr
    return res.exit_code, json.loads(res.stdout)["findings"]


def _break(folder: Path, how: str) -> None:
    cfg = folder / "config.json"
    cfg.unlink()
    if how == "malformed":
        cfg.write_text('{"model_type": "llama", ')
    elif how == "array":
        cfg.write_text("[1, 2]")
    elif how == "dangling":
        cfg.symlink_to(folder / "gone.json")
    elif how == "outside":  # a valid config, but out of the folder: not followed (import refuses it, E101)
        shutil.copy(folder.parent.parent / "good" / "config.json", folder.parent / "elsewhere.json")
        cfg.symlink_to(folder.parent / "elsewhere.json")
    elif how == "directory":
        cfg.mkdir()


def test_clean_folder_has_no_finding(llama: Path) -> None:
    code, found = _validate(llama)
    assert code == 0 and [f for f in found if f["code"] == "M028"] == [], found


@pytest.mark.parametrize("how", ["malformed", "array", "dangling", "outside", "directory"])
def test_unreadable_config_is_an_error_that_from_pretrained_agrees_with(tmp_path: Path, llama: Path, how: str) -> None:
    (tmp_path / "good").mkdir()
    shutil.copy(llama / "config.json", tmp_path / "good" / "config.json")
    folder = tmp_path / "ckpt" / "model"
    shutil.copytree(llama, folder)
    _break(folder, how)
    if how == "outside":
        assert transformers.AutoConfig.from_pretrained(folder).model_type == "llama"
    else:
        with pytest.raises((OSError, ValueError)):  # the reference: transformers cannot read the config
            transformers.AutoConfig.from_pretrained(folder)
    before = {p.name: (p.is_symlink(), p.stat().st_size if p.is_file() else None) for p in folder.iterdir()}
    code, found = _validate(folder)
    m028 = [f for f in found if f["code"] == "M028"]
    assert code == 1 and len(m028) == 1 and m028[0]["key"] == "config.json", found
    assert m028[0]["severity"] == "error" and "config.json" in m028[0]["message"], m028
    # a --config given for the checks does not make the folder's own config readable
    code, found = _validate(folder, "--config", str(tmp_path / "good" / "config.json"))
    assert code == 1 and [f["code"] for f in found if f["code"] == "M028"] == ["M028"], found
    after = {p.name: (p.is_symlink(), p.stat().st_size if p.is_file() else None) for p in folder.iterdir()}
    assert after == before  # nothing written or moved


def test_weights_without_config_and_dcp_folders_are_not_judged(tmp_path: Path, llama: Path) -> None:
    folder = tmp_path / "weights"
    shutil.copytree(llama, folder)
    os.remove(folder / "config.json")  # weights alone: a valid folder to validate
    code, found = _validate(folder)
    assert code == 0 and not [f for f in found if f["code"] == "M028"], found
    ckpt = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=str(ckpt))
    (ckpt / "config.json").write_text("{not json")  # a DCP folder's file of its own: not an HF config
    code, found = _validate(ckpt)
    assert not [f for f in found if f["code"] == "M028"], found


def test_configs_from_pretrained_reads_are_not_judged(tmp_path: Path, llama: Path) -> None:
    """No ``M028`` where ``from_pretrained`` reads the config: the ``Infinity``/``NaN`` literals ``save_pretrained``
    writes for a non-finite float (``json.dumps``), a key given twice (the last wins), and a hub snapshot's
    subfolder whose ``config.json`` links to the repository's blob (``../../../blobs/<sha256>``)."""
    import hashlib

    cfg = transformers.AutoConfig.from_pretrained(llama)
    cfg.final_logit_softcapping, cfg.attention_temperature = float("inf"), float("nan")
    nonfinite = tmp_path / "nonfinite"
    shutil.copytree(llama, nonfinite)
    cfg.save_pretrained(nonfinite)
    text = (nonfinite / "config.json").read_text()
    assert "Infinity" in text and "NaN" in text
    twice = tmp_path / "twice"
    shutil.copytree(llama, twice)
    (twice / "config.json").write_text(text.rstrip().rstrip("}") + ', "model_type": "llama"}')
    repo = tmp_path / "hub" / "models--tiny--sub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    sub = repo / "snapshots" / rev / "model"
    sub.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for f in sorted(llama.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        os.symlink(f"../../../blobs/{digest}", sub / f.name)
    for folder in (nonfinite, twice, sub):
        assert transformers.AutoConfig.from_pretrained(folder).model_type == "llama"  # the reference reads it
        code, found = _validate(folder)
        assert code == 0 and not [f for f in found if f["code"] == "M028"], (folder, found)
