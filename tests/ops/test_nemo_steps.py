"""NeMo Automodel runs: ``epoch_E_step_S`` ordering, ``LATEST``, ``.incomplete``, and the consolidated HF copy.

Written by NeMo Automodel 0.7's own ``Checkpointer`` (``tests/fixtures/nemo_writer.py::build_nemo_steps``,
``save_consolidated=True``; the in-progress marker by its own ``mark_checkpoint_incomplete``).
References: the consolidated ``model/consolidated/*.safetensors`` NeMo wrote from the shards
(read with ``safetensors``), and NeMo's own ``find_latest_checkpoint``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def nemo_run(fixture_root: Path) -> Path:
    from tests.fixtures.writers import missing

    why = missing("nemo_automodel.components.checkpoint.checkpointing", "transformers")
    if why:
        pytest.skip(why)
    from tests.fixtures.nemo_writer import build_nemo

    return cached_build(fixture_root, "writers_nemo", build_nemo) / "steps" / "run"  # one build with the other tests


def _inspect(*args: str, code: int = 0) -> dict:
    r = runner.invoke(app, ["inspect", *args, "--json"])
    assert r.exit_code == code, r.output
    return json.loads(r.stdout) if code == 0 else {}


def test_latest_follows_nemo_and_skips_the_unpublished_save(nemo_run: Path) -> None:
    from nemo_automodel.components.checkpoint.utils import find_latest_checkpoint

    assert Path(find_latest_checkpoint(nemo_run)).name == "epoch_1_step_4"
    doc = _inspect(str(nemo_run), "--step", "latest")
    assert doc["location"]["model"].endswith("epoch_1_step_4/model")
    assert doc["location"]["optimizer"].endswith("epoch_1_step_4/optim")
    assert doc["location"]["step"] == 4
    assert doc["hf_copies"] == ["model/consolidated/model-00001-of-00001.safetensors"]
    assert _inspect(str(nemo_run), "--step", "2")["location"]["model"].endswith("epoch_0_step_2/model")
    r = runner.invoke(app, ["inspect", str(nemo_run), "--step", "6"])  # the marked step: E202, not opened
    assert r.exit_code != 0 and "E202" in r.output and ".incomplete" in r.output
    r = runner.invoke(app, ["inspect", str(nemo_run / "epoch_1_step_6")])
    assert r.exit_code != 0 and "E202" in r.output and ".incomplete" in r.output


def test_several_steps_hint_marks_the_unpublished_save_and_never_offers_it(nemo_run: Path) -> None:
    r = runner.invoke(app, ["inspect", str(nemo_run)])
    assert r.exit_code == 2 and r.stderr.startswith("error: [E204]")
    assert r.stderr.splitlines()[1] == (
        f"hint: pick one with --step latest or --step N (steps 2, 4, 6 (incomplete)), or pass a directory, e.g. "
        f"{nemo_run / 'epoch_1_step_4'}"
    )


def test_validate_of_the_unpublished_step_names_it_and_the_flag(nemo_run: Path) -> None:
    r = runner.invoke(app, ["validate", str(nemo_run), "--step", "6", "--wide"])
    assert r.exit_code == 2
    row = next(line for line in r.stdout.splitlines() if "S001 E202" in line)
    assert f"│ {nemo_run / 'epoch_1_step_6'} │ {nemo_run}: --step 6: step 6 is incomplete (a save that did not " in row
    assert "`step`" not in r.stdout and "(the trainer's marker of a save not yet published)" in row
    from ckpttool.ops.validate import RULES

    assert f"{len(RULES) - 1} skipped (the save did not finish)" in r.stdout
    doc = json.loads(runner.invoke(app, ["validate", str(nemo_run), "--step", "6", "--json"]).stdout)
    assert [(f["code"], f["key"]) for f in doc["findings"]] == [("S001", str(nemo_run / "epoch_1_step_6"))]


def test_latest_without_pointer_orders_by_step_then_epoch(nemo_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    for name in ("epoch_0_step_2", "epoch_1_step_4"):
        shutil.copytree(nemo_run / name, run / name)
    shutil.copytree(nemo_run / "epoch_0_step_2", run / "epoch_9_step_3")  # a higher epoch, a lower step
    shutil.copytree(nemo_run / "epoch_0_step_2", run / "epoch_0_step_4")  # step 4 also in epoch 0
    doc = _inspect(str(run), "--step", "latest")
    assert doc["location"]["model"].endswith("epoch_1_step_4/model")


def test_consolidated_copy_is_compared_with_the_shards(nemo_run: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    step = tmp_path / "epoch_0_step_2"
    shutil.copytree(nemo_run / "epoch_0_step_2", step)
    r = runner.invoke(app, ["validate", str(step), "--strict", "--deep", "--json"])
    assert r.exit_code == 0, r.output
    d012 = [x for x in json.loads(r.stdout)["rules"] if x["code"] == "D012"]
    assert d012[0]["status"] != "skipped"
    f = step / "model" / "consolidated" / "model-00001-of-00001.safetensors"
    sd = load_file(f)
    sd["model.norm.weight"] = sd["model.norm.weight"] + torch.ones_like(sd["model.norm.weight"])
    save_file(sd, str(f), metadata={"format": "pt"})
    r = runner.invoke(app, ["validate", str(step), "--deep", "--json"])
    assert r.exit_code == 1
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "D012"]
    assert len(found) == 1 and "model.norm.weight" in found[0]["message"]


def test_a_step_whose_optim_save_did_not_finish_is_not_ok(nemo_run: Path, tmp_path: Path) -> None:
    """A step directory whose optim/ holds NeMo's DCP data files but no .metadata (the save killed before the
    coordinator wrote it) opened itself: validate --strict opened model/ alone and said OK ("model weights
    only"). Now E202 names optim/ and what it lacks; from the run root --step latest passes over the step."""
    run = shutil.copytree(nemo_run, tmp_path / "run")
    step = run / "epoch_1_step_4"
    (step / "optim" / ".metadata").unlink()
    for cmd in (["validate", "--strict"], ["inspect"], ["stats"]):
        res = runner.invoke(app, [*cmd, str(step)])
        assert res.exit_code == 2, (cmd, res.output)
        assert res.stderr.startswith(
            f"error: [E202] {step}: model/ was saved with optim/, whose save did not finish (or is still running): "
            f"{step / 'optim'} has 1 data file(s), no .metadata\n"
        ), res.stderr
        assert "Traceback" not in res.output
    assert _inspect(str(run), "--step", "latest")["location"]["model"] == str(run / "epoch_0_step_2" / "model")
    shutil.copy(nemo_run / "epoch_1_step_4" / "optim" / ".metadata", step / "optim" / ".metadata")
    assert runner.invoke(app, ["validate", "--strict", str(step)]).exit_code == 0


def test_latest_naming_a_removed_step_falls_back_as_nemo_does(nemo_run: Path, tmp_path: Path) -> None:
    """The newest step deleted by hand (a bad save), ``LATEST`` left pointing at it: NeMo's ``find_latest_checkpoint``
    passes over a pointer whose target is no directory and resumes the highest complete step; `step` latest was
    E205 "the trainer's resume fails on it too". It opens that step, saying what LATEST names."""
    from nemo_automodel.components.checkpoint.utils import find_latest_checkpoint

    run = tmp_path / "run"
    shutil.copytree(nemo_run, run, symlinks=True)
    assert (run / "LATEST").is_symlink()
    shutil.rmtree(run / "epoch_1_step_4")
    assert Path(find_latest_checkpoint(run)).name == "epoch_0_step_2"
    doc = _inspect(str(run), "--step", "latest")
    assert doc["location"]["model"] == str(run / "epoch_0_step_2" / "model") and doc["location"]["step"] == 2
    assert "LATEST names step 4, not below the directory, which the trainer passes over" in doc["location"]["how"]


def test_unknown_step_lists_the_unpublished_save_marked_incomplete(nemo_run: Path) -> None:
    """E205 listed "steps found: 2, 4, 6" with step 6's ``.incomplete`` save unmarked, as if it could be picked; it is
    marked as E204 marks it."""
    from ckpttool.errors import StepNotFoundError
    from ckpttool.model.discovery import CheckpointSelection, locate

    with pytest.raises(StepNotFoundError) as ei:
        locate(nemo_run, CheckpointSelection(step=9))
    assert ei.value.message.endswith("steps found: 2, 4, 6 (incomplete)"), ei.value.message
