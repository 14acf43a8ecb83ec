"""Resume safety on torchtitan ``CheckpointManager`` saves (tests/fixtures/writers.py), damaged as the real bugs do it.

- ``R001``/E202: a run root whose newest step directory holds a save that did not finish (the data
  files of a real save without its ``.metadata``, or torch's ``.metadata.tmp`` left by a crash
  before the rename): ``--step latest`` chooses the newest complete step and says so, ``--strict``
  fails; ``--step N`` of the incomplete step is E202, not "not found".
- ``R002``: the optimizer state of step 1 kept beside the model and ``train_state`` of step 2 (a
  resume that restored a stale optimizer file), and a scheduler from another step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import IncompleteCheckpointError
from ckpttool.model.discovery import CheckpointSelection, locate
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers

runner = CliRunner()


def run(*args: Any) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def codes(doc: dict[str, Any]) -> set[str]:
    return {f["code"] for f in doc["findings"]}


@pytest.fixture
def run_root(titan_root: Path, tmp_path: Path) -> Path:
    """torchtitan's step-1 and step-2, and step-8 with step-2's data files but no .metadata (the save died)."""
    src = titan_root / "llama3" / "checkpoint"
    root = tmp_path / "checkpoint"
    for s in (1, 2):
        copy_checkpoint(src / f"step-{s}", root / f"step-{s}")
    (root / "step-8").mkdir()
    for f in (src / "step-2").glob("__*.distcp"):
        shutil.copy(f, root / "step-8" / f.name)
    return root


def test_latest_skips_an_incomplete_newer_step(run_root: Path) -> None:
    loc = locate(run_root, CheckpointSelection(step="latest"))
    assert loc.step == 2 and loc.model == run_root / "step-2"
    assert "highest complete step; step 8 is incomplete: 2 data file(s), no .metadata" in loc.how
    assert [i.step for i in loc.newer_incomplete] == [8]
    rc, doc = run(run_root, "--step", "latest")
    assert rc == 0 and codes(doc) == {"R001", "K005"}
    rc, doc = run(run_root, "--step", "latest", "--strict")
    assert rc == 1 and {f["code"] for f in doc["findings"] if f["fails"]} == {"R001"}
    r001 = next(f for f in doc["findings"] if f["code"] == "R001")
    assert "step 8 is newer than the checked step 2 but incomplete" in r001["message"]
    # an older step chosen explicitly is told about the newer incomplete one too
    rc, doc = run(run_root, "--step", "1", "--strict")
    assert rc == 1 and "R001" in codes(doc)
    # the inspect JSON names it
    res = runner.invoke(app, ["inspect", str(run_root), "--step", "latest", "--json"])
    loc_json = json.loads(res.stdout)["location"]
    assert loc_json["step"] == 2 and loc_json["newer_incomplete"][0]["step"] == 8


def test_step_of_an_incomplete_save_says_incomplete(run_root: Path) -> None:
    with pytest.raises(IncompleteCheckpointError) as ei:
        locate(run_root, CheckpointSelection(step=8))
    assert ei.value.code == "E202" and "step 8 is incomplete" in ei.value.message
    res = runner.invoke(app, ["validate", str(run_root), "--step", "8"])
    assert res.exit_code == 2 and "E202" in res.stderr and "not found" not in res.stderr


def test_a_run_whose_only_save_did_not_finish_says_so(run_root: Path) -> None:
    """No ``--step`` and only an unfinished step below: E202 naming it, not "no DCP checkpoint below" (E200),
    and no ``--step N`` in the message that was never given."""
    for s in (1, 2):
        shutil.rmtree(run_root / f"step-{s}")
    with pytest.raises(IncompleteCheckpointError) as ei:
        locate(run_root)
    assert ei.value.message.startswith(f"{run_root}: step 8 is incomplete (a save that did not finish")
    res = runner.invoke(app, ["inspect", str(run_root)])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E202] {run_root}: step 8 is incomplete"), res.stderr


def test_metadata_tmp_of_a_crashed_save(run_root: Path) -> None:
    shutil.rmtree(run_root / "step-8")
    shutil.copytree(run_root / "step-2", run_root / "step-9")
    (run_root / "step-9" / ".metadata").rename(run_root / "step-9" / ".metadata.tmp")  # FileSystemWriter's name
    loc = locate(run_root, CheckpointSelection(step="latest"))
    assert loc.step == 2 and ".metadata.tmp, no .metadata" in loc.newer_incomplete[0].reason
    # only an incomplete step: latest has nothing to choose
    for s in (1, 2):
        shutil.rmtree(run_root / f"step-{s}")
    with pytest.raises(IncompleteCheckpointError):
        locate(run_root, CheckpointSelection(step="latest"))


def test_complete_run_root_is_silent(titan_root: Path) -> None:
    rc, doc = run(titan_root / "llama3" / "checkpoint", "--step", "latest", "--strict", "--deep")
    assert rc == 0 and "R001" not in codes(doc) and "R002" not in codes(doc), doc["findings"]


def test_stale_optimizer_state_beside_newer_train_state(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "llama3" / "checkpoint"
    ck = copy_checkpoint(src / "step-2", tmp_path / "ck")
    step1 = damage.load_md(src / "step-1").state_dict_metadata
    for key in [k for k in step1 if k.startswith("optimizer.state.")]:  # moments and steps of step 1
        damage.rewrite_tensor(ck, key, lambda _t, key=key: damage.read_tensor(src / "step-1", key))
    rc, doc = run(ck, "--strict")
    assert "R002" not in codes(doc)  # needs --deep (the step values)
    rc, doc = run(ck, "--deep")
    assert rc == 1 and "R002" in codes(doc), doc["findings"]
    msgs = [f["message"] for f in doc["findings"] if f["code"] == "R002"]
    assert any("optimizer step 1" in m and "train_state.step = 2" in m for m in msgs), msgs


def test_scheduler_from_another_step(titan_root: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "ck")
    damage.set_byte_item(ck, "lr_scheduler.last_epoch", 1)
    rc, doc = run(ck, "--deep")
    assert rc == 1 and "R002" in codes(doc)
    assert any("lr_scheduler.last_epoch = 1 but train_state.step = 2" in f["message"] for f in doc["findings"])


def test_save_in_the_directory_of_another_step(titan_root: Path, tmp_path: Path) -> None:
    """torchtitan names step-N by the train_state.step it saves: step 2's save copied to step-3/ (a resume from
    "step 3" continues at step 2) is R002 naming both; the same save in step-2/ is not."""
    src = titan_root / "llama3" / "checkpoint" / "step-2"
    rc, doc = run(copy_checkpoint(src, tmp_path / "checkpoint" / "step-3"), "--deep")
    msgs = [f["message"] for f in doc["findings"] if f["code"] == "R002"]
    assert rc == 1 and msgs == ["train_state.step = 2 but its directory is step-3 (step 3)"], doc["findings"]
    rc, doc = run(copy_checkpoint(src, tmp_path / "other" / "step-2"), "--deep")
    assert rc == 0 and "R002" not in codes(doc), doc["findings"]


def test_a_step_saved_as_a_tensor_is_read(titan_root: Path, tmp_path: Path) -> None:
    """torchtitan's older TrainState saved ``step`` as ``torch.tensor(step, dtype=torch.int32)`` (so do loops that
    keep their step in a tensor): inspect showed it, but R002 read trainer steps from byte items only, so step 2's
    save in step-3/ passed ``validate --strict --deep``. The one-element integer tensor is read as the trainer step
    now (from its stored bytes): the same R002 as the int step; in step-2/ no finding."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "step2.pt")
    sd = torch.load(tmp_path / "step2.pt", weights_only=False)
    sd["train_state"]["step"] = torch.tensor(sd["train_state"]["step"], dtype=torch.int32)
    for name in ("step-3", "step-2"):
        dcp.save(sd, checkpoint_id=str(tmp_path / name / "checkpoint" / name))
    rc, doc = run(tmp_path / "step-3" / "checkpoint" / "step-3", "--deep", "--strict")
    msgs = [f["message"] for f in doc["findings"] if f["code"] == "R002"]
    assert rc == 1 and msgs == ["train_state.step = 2 but its directory is step-3 (step 3)"], doc["findings"]
    rc, doc = run(tmp_path / "step-2" / "checkpoint" / "step-2", "--deep", "--strict")
    assert rc == 0 and "R002" not in codes(doc), doc["findings"]


def test_a_save_of_torchtitans_model_under_model_is_torchtitan(titan_root: Path, tmp_path: Path) -> None:
    """torchtitan's CheckpointManager saved its model under ``model.`` before it flattened it to the top level
    (``_flattened_model_states_sd``), its TrainState's ``step`` a 0-d int32 tensor: such a save was torch-native,
    so neither its step-N directory nor its per-step scheduler was checked (step 2's save in step-3/ passed
    ``validate --strict --deep``). torchtitan's names with its ``train_state`` under ``model.`` are torchtitan now."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "step2.pt")
    sd = torch.load(tmp_path / "step2.pt", weights_only=False)
    items = ("optimizer", "lr_scheduler", "dataloader", "train_state")
    old = {"model": {k: v for k, v in sd.items() if k not in items}, **{k: sd[k] for k in items if k in sd}}
    old["train_state"]["step"] = torch.tensor(old["train_state"]["step"], dtype=torch.int32)
    ckpt = tmp_path / "checkpoint" / "step-3"
    dcp.save(old, checkpoint_id=str(ckpt))
    ks = json.loads(runner.invoke(app, ["inspect", str(ckpt), "--json"]).stdout)["key_schema"]
    assert (ks["id"], ks["model_prefix"], ks["naming"]) == ("torchtitan", "model.", "torchtitan")
    rc, doc = run(ckpt, "--deep", "--strict")
    msgs = [f["message"] for f in doc["findings"] if f["code"] == "R002"]
    assert rc == 1 and msgs == ["train_state.step = 2 but its directory is step-3 (step 3)"], doc["findings"]


# ------------------------------------------------------------------ moments (D006, D007, D008)
W1 = "layers.0.feed_forward.w1.weight"


def test_zeroed_exp_avg_sq_beside_a_live_exp_avg(titan_root: Path, tmp_path: Path) -> None:
    import torch

    ck = copy_checkpoint(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "ck")
    damage.rewrite_tensor(ck, f"optimizer.state.{W1}.exp_avg_sq", torch.zeros_like)
    rc, doc = run(ck, "--deep")
    assert rc == 1 and "D006" in codes(doc), doc["findings"]
    d006 = next(f for f in doc["findings"] if f["code"] == "D006")
    assert d006["key"] == f"optimizer.state.{W1}.exp_avg_sq" and "12288 of 12288" in d006["message"]
    assert "whole tensor is 0" in d006["message"]
    rc, doc = run(ck, "--strict")
    assert rc == 0  # metadata alone cannot tell
    # one element: a bit-level reset of a single value
    ck2 = copy_checkpoint(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "ck2")
    damage.rewrite_tensor(
        ck2,
        f"optimizer.state.{W1}.exp_avg_sq",
        lambda t: t.view(-1).index_fill_(0, torch.tensor([3]), 0.0).view(t.shape),
    )
    rc, doc = run(ck2, "--deep")
    assert rc == 1 and any(f["code"] == "D006" and "1 of 12288" in f["message"] for f in doc["findings"])


def test_stale_exp_avg_sq_beyond_the_adam_bound(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "llama3" / "checkpoint"
    ck = copy_checkpoint(src / "step-2", tmp_path / "ck")
    key = f"optimizer.state.{W1}.exp_avg_sq"
    damage.rewrite_tensor(ck, key, lambda _t: damage.read_tensor(src / "step-1", key))  # kept from step 1
    rc, doc = run(ck, "--deep", "--strict")
    assert rc == 1 and codes(doc) & {"D007"}, doc["findings"]
    d007 = next(f for f in doc["findings"] if f["code"] == "D007")
    assert W1 in d007["message"] and "after step 2 with betas (0.9, 0.95)" in d007["message"]


def test_moments_reset_but_step_kept(titan_root: Path, tmp_path: Path) -> None:
    import torch

    ck = copy_checkpoint(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "ck")
    for f in ("exp_avg", "exp_avg_sq"):
        damage.rewrite_tensor(ck, f"optimizer.state.{W1}.{f}", torch.zeros_like)
    rc, doc = run(ck, "--deep", "--strict")
    assert rc == 1 and "D008" in codes(doc) and "D006" not in codes(doc), doc["findings"]


def test_empty_newer_step_directory(run_root: Path) -> None:
    """A save that died right after creating its step directory (torch's writer makes the folder first) leaves
    it empty, or holding empty folders only: R001 names it, and ``--step 9`` says incomplete, not "not found"."""
    shutil.rmtree(run_root / "step-8")
    (run_root / "step-9" / "model").mkdir(parents=True)
    loc = locate(run_root, CheckpointSelection(step="latest"))
    assert loc.step == 2 and [i.step for i in loc.newer_incomplete] == [9]
    assert "no file (the save created the directory" in loc.newer_incomplete[0].reason
    rc, doc = run(run_root, "--step", "latest", "--strict")
    assert rc == 1 and {f["code"] for f in doc["findings"] if f["fails"]} == {"R001"}
    res = runner.invoke(app, ["validate", str(run_root), "--step", "9"])
    assert res.exit_code == 2 and "E202" in res.stderr and "step 9 is incomplete" in res.stderr, res.stderr
    # a folder that is not step-named stays out of it (a run's logs/ or tb/ directory, empty)
    shutil.rmtree(run_root / "step-9")
    (run_root / "tb").mkdir()
    assert locate(run_root, CheckpointSelection(step="latest")).newer_incomplete == ()


def test_empty_step_directory_given_itself(tmp_path: Path) -> None:
    (tmp_path / "step-9").mkdir()
    res = runner.invoke(app, ["inspect", str(tmp_path / "step-9")])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and lines[0] == f"error: [E200] {tmp_path / 'step-9'}: an empty directory " + (
        "(no .metadata, no data files, in it or below it)"
    )
    assert lines[1].startswith("hint: a save that stopped right after creating its step directory leaves it so")
