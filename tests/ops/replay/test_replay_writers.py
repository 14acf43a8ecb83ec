"""`ckpttool replay-step --device cpu` on checkpoints written by the real trainers.

The next AdamW step replayed from each writer's saved state must match the independent FP64
reference (torch.optim.AdamW semantics); what cannot be replayed is refused with the cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers

runner = CliRunner()


def replay(*args: str) -> dict:
    res = runner.invoke(app, ["replay-step", *args, "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def test_torchtitan_flattened_optimizer(titan_root: Path) -> None:
    doc = replay(str(titan_root / "llama3" / "checkpoint"), "--step", "2", "--head-dim", "16")
    assert doc["ok"] and doc["optimizer"]["type"] == "adamw"
    fqns = {p["fqn"] for p in doc["params"]}
    assert "tok_embeddings.weight" in fqns and "layers.1.feed_forward.w2.weight" in fqns
    # stepped fused, stored split: replayed on wq/wk/wv assembled per KV head, so every stepped parameter counts
    assert {f for f in fqns if "wqkv" in f} == {f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)}
    assert any("stepped fused but stored split" in n and "assembled as the model fuses them" in n for n in doc["notes"])
    assert len(fqns) == 17 and doc["params_skipped"] == []  # 15 stored as they are stepped, 2 fused
    assert all(p["step_before"] == 2 for p in doc["params"])
    assert not [n for n in doc["notes"] if "constant lr" in n]
    # several steps: each at the saved lr, while torchtitan's LRSchedulersContainer would move it (a warning says so)
    doc = replay(str(titan_root / "llama3" / "checkpoint"), "--step", "2", "--head-dim", "16", "--steps", "2")
    assert [n for n in doc["notes"] if "constant lr" in n] == [
        "warning: 2 steps replayed, each with the lr saved in its param group; the run's LR scheduler "
        "(lr_scheduler.last_epoch = 2) moves the lr after every step, so steps 2 and later are AdamW at a constant lr, "
        "not the steps the run takes"
    ]


def test_torchtitan_fused_qkv_without_head_dim_says_what_to_pass(titan_root: Path) -> None:
    args = ["replay-step", str(titan_root / "llama3" / "checkpoint"), "--step", "2", "--device", "cpu"]
    res = runner.invoke(app, args)
    assert res.exit_code == 1
    # wq/wk/wv are the parts of the fused wqkv, not buffers or frozen parameters
    assert "in no param group" not in res.stdout
    assert "not replayed; pass --head-dim N (the model's hidden size / attention heads)" in res.stdout
    assert res.stderr.splitlines()[1] == (
        "hint: not a mismatch: the notes say why they were left out and what replays them (a fused q/k/v: "
        "--head-dim N); or leave them out of the run with --filter"
    )
    doc = json.loads(runner.invoke(app, [*args, "--head-dim", "16", "--json"]).stdout)
    assert doc["ok"] and not any("in no param group" in n for n in doc["notes"])
    res = runner.invoke(app, [*args, "--head-dim", "7"])  # given, but no head dim of these projections
    assert res.exit_code == 1 and "and --head-dim 7 does not divide their k rows (64): not replayed" in res.stdout


def test_torchtitan_fused_qkv_head_dim_from_the_config_saved_with_it(titan_root: Path, tmp_path: Path) -> None:
    """A torchtitan llama3 step (its q/k/v stepped fused as ``wqkv``) with the model's ``config.json`` saved beside it
    (``model_assets/``): replay-step left the fused parameters out and failed unless given --head-dim, which the
    config tells. They are assembled with the config's head dim; a --head-dim that contradicts it is E100 naming both."""
    import shutil

    transformers = pytest.importorskip("transformers")
    ck = tmp_path / "step-2"
    shutil.copytree(titan_root / "llama3" / "checkpoint" / "step-2", ck)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4
    )
    cfg.save_pretrained(ck / "model_assets")
    doc = replay(str(ck))
    assert doc["ok"] and {p["fqn"] for p in doc["params"] if "wqkv" in p["fqn"]} == {
        f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)
    }
    assert replay(str(ck), "--head-dim", "16")["ok"]
    res = runner.invoke(app, ["replay-step", str(ck), "--device", "cpu", "--head-dim", "8"])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines() == [
        f"error: [E100] --head-dim 8 contradicts {ck / 'model_assets' / 'config.json'}, saved with the checkpoint: "
        "its head dim is 16",
        "hint: leave out --head-dim (the config tells it), or pass --head-dim 16",
    ]


def test_torchtitan_fused_qkv_config_saved_with_it_that_cannot_tell_the_head_dim(
    titan_root: Path, tmp_path: Path
) -> None:
    """A ``config.json`` saved with a torchtitan step whose head dim does not divide the fused k rows (7 of 64), or
    that is not JSON: the note said no config.json was saved, --head-dim 16 (the right one) was refused as
    contradicting the config's 7, and a damaged config refused the replay even with --head-dim given."""
    import shutil

    ck = tmp_path / "step-2"
    shutil.copytree(titan_root / "llama3" / "checkpoint" / "step-2", ck)
    (ck / "model_assets").mkdir()
    cfg = ck / "model_assets" / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 7}))
    res = runner.invoke(app, ["replay-step", str(ck), "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert "and the head dim 7 of the config.json saved with it does not divide their k rows (64): not replayed" in (
        " ".join(res.stdout.split())
    ), res.stdout
    assert replay(str(ck), "--head-dim", "16")["ok"]
    cfg.write_text("{not json")
    assert replay(str(ck), "--head-dim", "16")["ok"]
    res = runner.invoke(app, ["replay-step", str(ck), "--device", "cpu"])  # needed, and damaged: named
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E100] {cfg}"), res.output


def test_torchtitan_moe(titan_root: Path) -> None:
    doc = replay(str(titan_root / "moe"))
    assert doc["ok"] and any("inner_experts.w1_EFD" in p["fqn"] for p in doc["params"])
    # qwen3's q_norm tells the head dim: the fused wqkv is assembled without --head-dim
    assert {p["fqn"] for p in doc["params"] if "wqkv" in p["fqn"]} == {
        f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)
    }


def test_torchtitan_head_dim_contradicting_the_q_norm_is_refused(titan_root: Path) -> None:
    """qwen3's q_norm (8 elements) tells the head dim, but --head-dim 4 overrode it without a word: the fused wqkv was
    assembled in the wrong row order against its saved state and the replay said OK. A --head-dim that contradicts
    the checkpoint's per-head norm is now refused (E100, exit 2) naming both; the right one replays as without it."""
    args = ["replay-step", str(titan_root / "moe"), "--device", "cpu"]
    res = runner.invoke(app, [*args, "--head-dim", "4"])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines() == [
        "error: [E100] --head-dim 4 contradicts the checkpoint: layers.0.attention.q_norm.weight, the per-head norm "
        "beside layers.0.attention.qkv_linear.wqkv.weight, has 8 elements (the head dim); assembled with the wrong "
        "head dim, the fused rows would not line up with their saved state",
        "hint: leave out --head-dim (the checkpoint tells it), or pass --head-dim 8",
    ]
    assert replay(str(titan_root / "moe"), "--head-dim", "8")["ok"]


def test_accelerate_pair_and_app_state(acc_root: Path) -> None:
    doc = replay(str(acc_root / "accelerate" / "checkpoint-1"))
    assert doc["ok"] and len(doc["params"]) == 21
    doc = replay(str(acc_root / "app_state"))
    assert doc["ok"] and len(doc["params"]) == 21 and doc["params"][0]["fqn"].startswith(("model.", "lm_head"))


def test_synthesized_state_is_reported(acc_root: Path, titan_root: Path) -> None:
    for src in (acc_root / "accelerate" / "checkpoint-0", titan_root / "llama3_fresh" / "checkpoint" / "step-1"):
        doc = replay(str(src), *(("--head-dim", "16") if "llama3" in str(src) else ()))
        notes = [n for n in doc["notes"] if "synthesized state" in n]
        assert notes and "D005" in notes[0], doc["notes"]


def test_refusals_name_the_cause(plain_root: Path, titan_root: Path) -> None:
    res = runner.invoke(app, ["replay-step", str(plain_root / "plain_optimizer"), "--device", "cpu"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E251]")
    assert "get_optimizer_state_dict(model, optimizer)" in res.stderr
    res = runner.invoke(
        app, ["replay-step", str(titan_root / "llama3" / "checkpoint"), "--step", "3", "--device", "cpu"]
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: [E514]") and "--step 2" in res.stderr
    res = runner.invoke(app, ["replay-step", str(titan_root / "llama3" / "checkpoint"), "--device", "cpu"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E204]") and "--step latest or --step N" in res.stderr


def test_a_model_only_last_save_names_the_newest_step_with_optimizer_state(titan_root: Path, tmp_path: Path) -> None:
    """torchtitan's last_save_model_only step 3 (BF16 weights only) after full saves at steps 1 and 2: the hint
    names step 2, pasteable; with no older full save, the hint stays the one about an optimizer checkpoint."""
    import shlex
    import shutil

    run = tmp_path / "it's a run" / "checkpoint"
    for step in (1, 2, 3):
        shutil.copytree(titan_root / "llama3" / "checkpoint" / f"step-{step}", run / f"step-{step}")
    res = runner.invoke(app, ["replay-step", str(run.parent), "--step", "latest", "--device", "cpu"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E514]"), res.stderr
    hint = res.stderr.splitlines()[1]
    assert hint == (
        f"hint: step 2 of this run holds its optimizer state: pass --step 2 "
        f"(ckpttool replay-step {shlex.quote(str(run))} --step 2)"
    )
    pasted = shlex.split(hint.split("(", 1)[1].rstrip(")"))
    assert pasted == ["ckpttool", "replay-step", str(run), "--step", "2"]
    assert replay(*pasted[2:], "--head-dim", "16")["ok"]
    shutil.rmtree(run / "step-1")
    shutil.rmtree(run / "step-2")
    res = runner.invoke(app, ["replay-step", str(run / "step-3"), "--device", "cpu"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E514]") and "--optimizer-dir" in res.stderr


def _titan_resaved(titan_root: Path, out: Path, **older: str) -> Path:
    """torchtitan's step-2 save, loaded with torch's DCP reader and saved again with ``dcp.save`` under
    ``out/checkpoint/step-2``, its items named in ``older`` (``optimizer``, ``lr_scheduler``) taken from step 1: the
    state a resume leaves that restored one file of an older step beside the newer weights."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = titan_root / "llama3" / "checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for step in (1, 2):
        dcp_to_torch_save(run / f"step-{step}", out / f"step{step}.pt")
        sd[step] = torch.load(out / f"step{step}.pt", weights_only=False)
    mixed = {**sd[2], **{item: sd[1][item] for item in older}}
    dcp.save(mixed, checkpoint_id=str(out / "checkpoint" / "step-2"))
    return out / "checkpoint" / "step-2"


def test_optimizer_state_of_an_older_step_is_not_ok(titan_root: Path, tmp_path: Path) -> None:
    """step-1's optimizer state beside step-2's weights and train_state: AdamW replays it exactly, but not the step
    the run would take (bias correction of step 1 at the trainer's step 2): exit 1 naming the counters, as R002."""
    ckpt = _titan_resaved(titan_root, tmp_path, optimizer="1")
    args = ["replay-step", str(ckpt), "--device", "cpu", "--head-dim", "16"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 1, res.stderr
    doc = json.loads(res.stdout)
    assert not doc["ok"] and doc["params_failed"] == 0 and len(doc["params"]) == 17
    assert all(p["step_before"] == 1 for p in doc["params"])
    assert (
        len(doc["problems"]) == 1
        and doc["problems"][0].startswith("optimizer step 1 (optimizer.state.")
        and "but train_state.step = 2" in doc["problems"][0]
    )
    assert "R002" in doc["problems"][0]
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and res.stderr.startswith("error: [E700] optimizer step 1 (")
    # the verdict says why it failed, not only that every parameter matches
    (verdict,) = [line for line in res.stdout.splitlines() if line.startswith("result")]
    assert verdict == (
        "result      FAILED: 17 of 17 parameters match the reference step with a sane update; the saved state as a "
        "whole does not resume the run (1 problem below)"
    )
    assert "R002" in runner.invoke(app, ["validate", "--deep", str(ckpt)]).stdout
    # a subset of the parameters (--filter) may legitimately have stepped fewer times: no verdict from its steps
    res = runner.invoke(app, [*args, "--filter", "norm.weight", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["problems"] == []
    # step-1's LR scheduler beside step-2's optimizer and trainer: this step replays exactly, but the resumed run
    # would take the next lr from another step's schedule; not OK, as validate's R002
    sched = _titan_resaved(titan_root, tmp_path / "sched", lr_scheduler="1")
    res = runner.invoke(app, ["replay-step", str(sched), "--device", "cpu", "--head-dim", "16", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and not doc["ok"] and doc["params_failed"] == 0, res.stdout
    (problem,) = doc["problems"]
    assert problem.startswith("LR scheduler lr_scheduler.") and "= 1 but train_state.step = 2" in problem, problem
    assert "R002" in problem and "R002" in runner.invoke(app, ["validate", "--deep", str(sched)]).stdout
