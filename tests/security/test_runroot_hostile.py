"""Hostile inputs to today's run-root, shard-config and import checks (tests/security conventions: real saves, damaged
copies, one line naming the file, the documented exit code, the source never modified)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _damage_config(folder: Path, how: str) -> None:
    cfg = folder / "config.json"
    cfg.unlink()
    if how == "malformed":
        cfg.write_text("{")
    elif how == "fifo":
        os.mkfifo(cfg)
    else:  # a link out of the folder
        outside = folder.parent / "outside.json"
        outside.write_text(json.dumps({"model_type": "llama"}))
        cfg.symlink_to(outside)


@pytest.mark.parametrize("how", ["malformed", "fifo", "link_out"])
def test_unreadable_config_beside_shards_is_not_named_as_the_proof(
    hf_shards_root: Path, tmp_path: Path, how: str
) -> None:
    """A save_distributed folder's config.json that cannot be read: validate and export passed it over in silence,
    and S017 / export's warning told the user to check the shards against that very config.json ("`ckpttool
    validate` and `export` do"), which neither had read. Now the warning says it was not read and why."""
    src = tmp_path / "shards"
    shutil.copytree(hf_shards_root / "w2" / "with_config", src)
    _damage_config(src, how)
    before = _digest(src)
    res = runner.invoke(app, ["validate", str(src), "--json"])
    assert res.exit_code == 1, res.output  # M028: the folder's config.json cannot be read
    found = json.loads(res.stdout)["findings"]
    assert sorted(f["code"] for f in found) == ["M028", "S017"], found
    (f,) = [f for f in found if f["code"] == "S017"]
    assert "the config.json beside them was not read" in f["message"], f["message"]
    assert "`ckpttool validate` and `export` do" not in f["message"]
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    warnings = "\n".join(json.loads(res.stdout)["warnings"])
    assert "the config.json beside them was not read" in warnings and "`export` do" not in warnings
    assert "Traceback" not in res.output and _digest(src) == before


@pytest.fixture(scope="session")
def hf_dirs(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "import_hf_dirs", hf_models.build_hf_dirs)


def test_a_complex_head_is_not_called_tied_by_its_real_part(hf_dirs: Path, tmp_path: Path) -> None:
    """A tying config and a stored complex64 lm_head.weight whose real part is the embedding: the tied-head check
    compared the two in float64, which drops the imaginary part (torch's UserWarning on stderr), called them equal
    and imported a head that is not the embedding. Now they are compared in complex128: E601, nothing written."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    src.mkdir()
    sd: dict[str, torch.Tensor] = {}
    for f in sorted((hf_dirs / "llama").glob("*.safetensors")):
        sd.update(load_file(f))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].to(torch.complex64) + 1j
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((hf_dirs / "llama" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    before = _digest(src)
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "dcp")])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: [E601] "), lines
    assert "lm_head.weight differs from model.embed_tokens.weight in 3,072 of 3,072 elements" in lines[0]
    assert not (tmp_path / "dcp").exists() and _digest(src) == before


@pytest.mark.parametrize("damage", ["truncated", "zeros"])
def test_r007_over_an_unreadable_step_before_is_skipped_not_passed(
    sample_ckpt: Path, tmp_path: Path, damage: str
) -> None:
    """R007 compares the step chosen with the step before it: a step before it whose .metadata cannot be read was
    passed over in silence and R007 reported "passed" (OK over a comparison never made). Now it is skipped, its
    reason naming the step and the error."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(sample_ckpt, run / f"step-{s}")
    md = run / "step-1" / ".metadata"
    if damage == "truncated":
        md.write_bytes(md.read_bytes()[:100])
    else:  # a FIFO is no .metadata to the trainers (torchtitan's isfile): no step before, R007 passes
        md.write_bytes(bytes(4096))
    before = _digest(run)
    res = runner.invoke(app, ["validate", str(run), "--step", "latest", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    (r007,) = [r for r in doc["rules"] if r["code"] == "R007"]
    assert r007["status"] == "skipped" and r007["reason"].startswith("step 1 before it ("), r007
    assert str(run / "step-1") in r007["reason"] and _digest(run) == before


def test_a_step_link_loop_is_named_a_loop_not_missing_storage(sample_ckpt: Path, tmp_path: Path) -> None:
    """A step directory link that leads back to itself (step-3 -> step-3): `--step latest` passes over it to step 2
    as an unknown save, and said its target "does not exist (storage removed or not mounted)", sending the user to
    remount storage for a link loop. Now the loop is named."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(sample_ckpt, run / f"step-{s}")
    (run / "step-3").symlink_to("step-3")
    res = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert res.exit_code == 0, res.output
    (opened,) = [line for line in res.stdout.splitlines() if line.startswith("opened")]
    assert str(run / "step-2") in opened and "step 3 is incomplete: no target: it links to 'step-3'" in opened
    assert "which only leads back to itself (a symlink loop" in opened and "not mounted" not in opened


def test_many_misnamed_step_folders_beside_a_step_are_each_passed_over(sample_ckpt: Path, tmp_path: Path) -> None:
    """2,000 finished saves under torchtitan's misnamed names (step-N-backup) beside step-1: `--step latest` passes
    over each as torchtitan's resume takes them, naming the newest. (Each folder listed the run folder once again:
    9,000 of them took 58 s before, 1 s now on the 2-core helper machine; no wall-clock assertion here.)"""
    run = tmp_path / "run"
    shutil.copytree(sample_ckpt, run / "step-1")
    for i in range(2, 2001):
        d = run / f"step-{i}-backup"
        d.mkdir()
        for name in (".metadata", "__0_0.distcp"):
            os.link(sample_ckpt / name, d / name)
    res = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert res.exit_code == 0, res.output
    (opened,) = [line for line in res.stdout.splitlines() if line.startswith("opened")]
    assert opened.startswith(f"opened      {run / 'step-1'} (`step` latest: step 1".replace("`step`", "--step"))
    assert "step 2000 is incomplete: a finished save under the name step-2000-backup, not step-2000" in opened


@pytest.mark.parametrize("text", ["+2\n", "0_2", " +1 \r\n", "0_0_1"])
def test_tracker_number_int_reads_is_the_step_megatron_loads(sample_ckpt: Path, tmp_path: Path, text: str) -> None:
    """Megatron-LM and verl read latest_checkpointed_iteration.txt with int() (the reference here): '+2' and '0_2'
    are step 2 to them. `--step latest` refused both (E205, "the trainer's resume stops on it"), which it does not."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(sample_ckpt, run / f"step-{s}")
    (run / "latest_checkpointed_iteration.txt").write_text(text)
    want = int(text.strip())  # Megatron's read_metadata: int(f.read().strip())
    res = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert res.exit_code == 0, res.output
    (opened,) = [line for line in res.stdout.splitlines() if line.startswith("opened")]
    assert opened.startswith(
        f"opened      {run / f'step-{want}'} (--step latest: step {want} (named by latest_checkpointed_iteration.txt"
    ), opened
