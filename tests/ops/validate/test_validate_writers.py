"""`ckpttool validate --strict [--deep]` on checkpoints written by the real trainers.

What each writer saved is known (see tests/fixtures/writers.py); the rules must say OK on the
healthy saves and name the real problems: state torch synthesized for a never-stepped optimizer
(``D005``), index-keyed optimizer state (``K003``), an optimizer folder alone (``K004``), nothing
recognised (``K001``), plain FSDP2 MoE on 4 ranks (``L003`` with its candidate meshes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.catalog import build_catalog

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers

runner = CliRunner()


def run(*args: Any) -> tuple[int, dict[str, Any], str]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout), res.stderr


def failing(doc: dict[str, Any]) -> set[str]:
    return {f["code"] for f in doc["findings"] if f["fails"]}


def test_model_only_save_skips_the_optimizer_rules_and_says_why(titan_root: Path) -> None:
    """torchtitan's last_save_model_only step: the O rules are skipped with their reason, not "passed" over nothing."""
    root = titan_root / "llama3" / "checkpoint"
    rc, doc, _ = run(root, "--step", 3, "--strict", "--deep")
    reasons = {s["code"]: s["reason"] for s in doc["rules"] if s["code"].startswith("O")}
    assert rc == 0 and set(reasons.values()) == {"no optimizer state (model weights only)"}, reasons
    rc, doc, _ = run(root, "--step", 2, "--strict")  # a full save: they run
    assert rc == 0 and not [s for s in doc["rules"] if s["reason"] == "no optimizer state (model weights only)"]
    res = runner.invoke(app, ["validate", str(root), "--step", "3"])
    assert "skipped (needs --against; needs --config; needs --deep; needs --manifest; no optimizer state (model " in (
        res.stdout
    )


def test_torchtitan_saves_pass(titan_root: Path) -> None:
    root = titan_root / "llama3" / "checkpoint"
    for step in (1, 2, 3):
        rc, doc, err = run(root, "--step", step, "--strict", "--deep")
        assert rc == 0, (step, doc["findings"], err)
    rc, doc, _ = run(root, "--step", 2, "--strict")
    assert [f["code"] for f in doc["findings"]] == ["K005"]  # info: wqkv stepped fused, stored as wq/wk/wv
    rc, doc, _ = run(titan_root / "moe", "--strict", "--deep")
    assert rc == 0, doc["findings"]  # plain FSDP2 over 2 ranks: no L003


def test_torchtitan_never_stepped_save_is_synthesized_state(titan_root: Path) -> None:
    src = titan_root / "llama3_fresh" / "checkpoint" / "step-1"
    rc, doc, _ = run(src, "--strict")
    assert rc == 0, doc["findings"]  # metadata alone cannot tell
    rc, doc, _ = run(src, "--strict", "--deep")
    assert rc == 1 and failing(doc) == {"D005"}, doc["findings"]
    d005 = next(f for f in doc["findings"] if f["code"] == "D005")
    n_params = sum(1 for ps in build_catalog(src).optimizer_state.values() if ps.fields)
    assert f"({n_params} parameter(s))" in d005["message"]


def test_accelerate_pairs(acc_root: Path) -> None:
    rc, doc, _ = run(acc_root / "accelerate" / "checkpoint-1", "--strict", "--deep")
    assert rc == 0, doc["findings"]
    # get_optimizer_state_dict on a never-stepped optimizer (verified on torch 2.13): step 1, zero moments
    rc, doc, _ = run(acc_root / "accelerate", "--step", "0", "--strict", "--deep")
    assert rc == 1 and failing(doc) == {"D005"}
    rc, doc, _ = run(acc_root / "accelerate" / "checkpoint-1" / "optimizer_0", "--strict")
    assert rc == 1 and failing(doc) == {"K004"} and len(doc["findings"]) == 1  # not one O003 per parameter
    c1 = acc_root / "accelerate" / "checkpoint-1"
    rc, doc, _ = run(c1 / "pytorch_model_fsdp_0", "--optimizer", c1 / "optimizer_0", "--strict", "--deep")
    assert rc == 0, doc["findings"]


def test_a_newest_step_without_its_optimizer_folder_is_not_latest(acc_root: Path, tmp_path: Path) -> None:
    """Accelerate's save_state writes pytorch_model_fsdp_0/ then optimizer_0/: a save cut between the two
    leaves a step of the model folder alone, which its load_state cannot resume. `--step latest` opened it as a
    model-only checkpoint (validate --strict OK, export wrote it); now, where the run's other steps hold both
    folders, it is step N incomplete: passed over and named by R001, `--step N` is E202."""
    import shutil

    run_dir = shutil.copytree(acc_root / "accelerate", tmp_path / "accelerate")
    shutil.copytree(
        run_dir / "checkpoint-1" / "pytorch_model_fsdp_0", run_dir / "checkpoint-2" / "pytorch_model_fsdp_0"
    )
    rc, doc, _ = run(run_dir, "--step", "latest", "--strict")
    assert rc == 1 and doc["path"] == str(run_dir / "checkpoint-1")
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
    assert "checkpoint-2" in r001["message"] and failing(doc) == {"R001"}
    res = runner.invoke(app, ["export", str(run_dir), str(tmp_path / "hf"), "--step", "2"])
    assert res.exit_code == 2 and "[E202]" in res.stderr and "pytorch_model_fsdp_0/ but no optimizer_0/" in res.stderr
    assert not (tmp_path / "hf").exists()
    rc, doc, _ = run(run_dir / "checkpoint-2", "--strict")  # opened itself: a model-only save of its own
    assert rc == 0, doc["findings"]


def test_app_state_and_hf_storage_pass(acc_root: Path) -> None:
    for where in ("app_state", "hf_consolidated", "moe_fsdp2"):
        rc, doc, _ = run(acc_root / where, "--strict", "--deep")
        assert rc == 0, (where, doc["findings"])
    # per-rank shards alone record no full shape (S017: a last rank missing would not show), proven by its copy
    rc, doc, _ = run(acc_root / "hf_sharded", "--strict", "--deep")
    assert rc == 1 and failing(doc) == {"S017"} and len(doc["findings"]) == 1, doc["findings"]
    rc, doc, _ = run(acc_root / "hf_consolidated" / "sharded", "--strict", "--deep")
    assert rc == 0 and doc["findings"] == [], doc["findings"]


def test_plain_optimizer_state_dict_is_one_finding(plain_root: Path) -> None:
    rc, doc, _ = run(plain_root / "plain_optimizer", "--strict")
    assert rc == 1 and failing(doc) == {"K003"} and len(doc["findings"]) == 1, doc["findings"]
    assert "get_optimizer_state_dict" in doc["findings"][0]["hint"]
    rc, doc, _ = run(plain_root / "flat_hf", "--strict", "--deep")
    assert rc == 0, doc["findings"]


def test_plain_fsdp2_moe_on_4_ranks(moe4_root: Path) -> None:
    src = moe4_root / "moe_fsdp4"
    rc, doc, _ = run(src)
    assert rc == 0 and {f["code"] for f in doc["findings"]} == {"L003"}
    f = doc["findings"][0]
    assert "ep_size 2 x ep_fsdp_size 2" in f["message"] and "--no-ep" in f["hint"]
    rc, doc, _ = run(src, "--strict")
    assert rc == 1 and failing(doc) == {"L003"}
    rc, doc, _ = run(src, "--strict", "--no-ep")
    assert rc == 0, doc["findings"]


def test_nothing_recognised_never_passes(tmp_path: Path) -> None:
    dcp.save({"ema": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "ck"))
    rc, doc, _ = run(tmp_path / "ck")
    assert rc == 1 and failing(doc) == {"K001"}


def test_uncategorized_tensors_fail_strict(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "ck"))
    rc, doc, _ = run(tmp_path / "ck")
    assert rc == 0 and {f["code"] for f in doc["findings"]} == {"K002"}
    rc, doc, _ = run(tmp_path / "ck", "--strict")
    assert rc == 1 and failing(doc) == {"K002"} and "'ema.w'" in doc["findings"][0]["message"]


def test_non_persistent_buffer_is_info_and_not_divergence(tmp_path: Path) -> None:
    mask = torch.full((4, 4), float("-inf")).triu(1)
    sd = {
        "model": {"layers.0.attn.bias": mask, "layers.0.attn.w": torch.ones(4, 4), "rotary_emb.inv_freq": torch.ones(2)}
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    rc, doc, _ = run(tmp_path / "ck", "--strict", "--deep")
    assert rc == 0 and {f["code"] for f in doc["findings"]} == {"M009"}, doc["findings"]
    assert "recomputed" in doc["findings"][0]["hint"] and "diverged" not in doc["findings"][0]["hint"]


def test_state_lost_in_a_stepped_group(acc_root: Path, tmp_path: Path) -> None:
    import shutil

    from tests.fixtures import damage

    ck = shutil.copytree(acc_root / "accelerate" / "checkpoint-1", tmp_path / "checkpoint-1")
    fqn = "model.layers.1.mlp.down_proj.weight"
    damage.drop_keys(ck / "optimizer_0", lambda k: k.startswith(f"optimizer.state.{fqn}."))
    rc, doc, _ = run(ck, "--strict")
    assert rc == 1 and failing(doc) == {"O009"} and doc["findings"][0]["key"] == fqn
    res = runner.invoke(app, ["replay-step", str(ck), "--device", "cpu"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E513] parameter {fqn} has no optimizer state")


@pytest.mark.parametrize("flag", ["--optimizer", "--optimizer-dir"])
def test_optimizer_flag_spellings(acc_root: Path, flag: str) -> None:
    c1 = acc_root / "accelerate" / "checkpoint-1"
    rc, doc, _ = run(c1 / "pytorch_model_fsdp_0", flag, c1 / "optimizer_0", "--strict")
    assert rc == 0


def test_select_of_optimizer_rules_on_a_model_only_save_is_refused_not_ok(titan_root: Path) -> None:
    """`--select O --deep` on torchtitan's last_save_model_only step said OK with every selected rule skipped."""
    root = titan_root / "llama3" / "checkpoint"
    res = runner.invoke(app, ["validate", str(root), "--step", "3", "--select", "O", "--deep"])
    assert res.exit_code == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert err[0].startswith("error: [E100] --select O: the selected rules (O001, O002, O003, O004, O005, O006 and ")
    assert err[0].endswith(": no optimizer state (model weights only); nothing would be checked")
    assert err[1] == "hint: select rules for what this checkpoint holds (`ckpttool inspect` shows it)"
    res = runner.invoke(app, ["validate", str(root), "--step", "3", "--select", "O,S002", "--deep"])
    assert res.exit_code == 0  # a rule that runs: the others are reported skipped
