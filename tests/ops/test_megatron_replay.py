"""``replay-step`` on Megatron-core ``torch_dist`` checkpoints (written by megatron-core's own code, see
``tests/fixtures/megatron.py``: device-call shims only).

The hyperparameters and the step come from ``common.pt`` (megatron keeps no per-parameter step:
one ``common_step`` per optimizer; param groups without ``params``, their members by megatron's
default rule: no weight decay for 1-D parameters); checked here against ``torch.load`` of
``common.pt`` and the replayed step against ckpttool's float64 reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.megatron import assert_r002

DATA = Path(__file__).parent.parent / "fixtures" / "megatron_data"
runner = CliRunner()


@pytest.mark.parametrize(
    ("run", "step", "optimizer"),
    [
        ("dense1", "iter_0000003", "adamw"),
        ("dense_tp2", "iter_0000003", "full_fp32_adamw"),
        ("moe_ep2", "iter_0000002", "adamw"),
    ],
)
def test_replay_uses_common_pt(run: str, step: str, optimizer: str) -> None:
    common = torch.load(DATA / run / step / "common.pt", weights_only=False)
    opt = common["optimizer"]
    chains = [opt[k] for k in sorted(opt)] if all(isinstance(k, int) for k in opt) else [opt]
    chains = [c if "param_groups" in c else c["optimizer"] for c in chains]
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(DATA / run)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["params_total"] == len(doc["params"]) > 0
    for p in doc["params"]:
        chain = chains[1] if ".experts." in p["fqn"] and len(chains) > 1 else chains[0]
        norm = "layernorm" in p["fqn"] or "layer_norm" in p["fqn"]
        group = next(g for g in chain["param_groups"] if g["wd_mult"] == (0.0 if norm else 1.0))
        assert p["optimizer"] == optimizer
        assert p["lr"] == group["lr"] and p["weight_decay"] == group["weight_decay"]
        assert p["step_before"] == float(chain["state"]["common_step"]) == common["iteration"]
        assert p["step_after"] == p["step_before"] + 1
        assert p["state"] == "loaded" and p["ok"], p


def test_stats_update_size_uses_the_common_step() -> None:
    """``stats`` reads megatron's step where replay-step does (the param group's ``common_step``): an update size
    for every parameter, no "hyperparameters unreadable" note."""
    r = runner.invoke(app, ["stats", "--json", str(DATA / "dense_tp2")])
    assert r.exit_code == 0, r.output
    assert "unreadable" not in r.stderr
    layers = json.loads(r.stdout)["checkpoints"][0]["layers"]
    assert layers and all(row["update_rms"] is not None and row["update_rms"] > 0 for row in layers), layers


@pytest.mark.parametrize("kind", ["symlink_out", "fifo"])
def test_common_pt_is_read_confined(tmp_path: Path, kind: str) -> None:
    """common.pt is read as every file of the checkpoint: a symlink to a file outside it was followed and read
    (its param groups and step shown by inspect, used by replay-step; validate OK), a FIFO of that name passed
    over as "no common.pt"; now E101 / E102 naming it."""
    import os
    import shutil

    run = shutil.copytree(DATA / "dense_tp2", tmp_path / "run")
    common = run / "iter_0000003" / "common.pt"
    outside = tmp_path / "elsewhere.pt"
    shutil.move(common, outside)
    if kind == "symlink_out":
        common.symlink_to(outside)
    else:
        os.mkfifo(common)
    code, text = ("E101", "resolves outside") if kind == "symlink_out" else ("E102", "is a FIFO, not a regular file")
    for cmd in (["inspect"], ["validate", "--strict", "--deep"], ["replay-step", "--device", "cpu"], ["stats"]):
        r = runner.invoke(app, [*cmd, str(run)])
        assert r.exit_code == 2, (cmd, r.output)
        assert f"[{code}]" in r.stderr and "common.pt" in r.stderr and text in r.stderr, r.stderr
    assert outside.read_bytes() == (DATA / "dense_tp2" / "iter_0000003" / "common.pt").read_bytes()


def test_common_pt_iteration_other_than_its_directory_fails_r002(tmp_path: Path) -> None:
    """common.pt's iteration (what megatron resumes from) other than the iter_NNNNNNN directory megatron named by
    it: validate --deep passed it; now R002 names common.pt and both values. The real save passes."""
    import shutil

    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(DATA / "dense_tp2")])
    assert r.exit_code == 0, r.output
    run = shutil.copytree(DATA / "dense_tp2", tmp_path / "run")
    common = run / "iter_0000003" / "common.pt"
    obj = torch.load(common, weights_only=False)
    assert obj["iteration"] == 3
    obj["iteration"] = 99
    torch.save(obj, common)
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(run)])
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R002"]
    assert r.exit_code == 1 and len(found) == 1, r.stdout
    assert found[0]["key"] == "common.pt"
    assert found[0]["message"] == "common.pt iteration = 99 but its directory is iter_0000003 (step 3)"


def test_plain_validate_checks_common_pt_iteration_against_its_directory(tmp_path: Path) -> None:
    """A run directory iter_0000010 whose common.pt says iteration 8 (a save renamed, or a stale common.pt kept):
    plain ``validate --strict`` (no --deep) said OK; now R002 reports it from common.pt alone, and says in its
    status what ran without --deep. A checkpoint of another schema still skips R002 (needs --deep)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(DATA / "dense1" / "iter_0000003", run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    common = run / "iter_0000010" / "common.pt"
    obj = torch.load(common, weights_only=False)
    obj["iteration"] = 8
    torch.save(obj, common)
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run)])
    doc = json.loads(r.stdout)
    found = [f for f in doc["findings"] if f["code"] == "R002"]
    assert r.exit_code == 1 and len(found) == 1, r.stdout
    assert found[0]["key"] == "common.pt"
    assert found[0]["message"] == "common.pt iteration = 8 but its directory is iter_0000010 (step 10)"
    status = next(s for s in doc["rules"] if s["code"] == "R002")
    assert status["status"] == "failed" and status["reason"].startswith("without --deep: common.pt's iteration")
    r = runner.invoke(app, ["validate", "--strict", "--json", str(DATA / "dense1")])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0, r.stdout
    assert next(s for s in doc["rules"] if s["code"] == "R002")["status"] == "passed"


def test_plain_validate_says_r002_checked_common_pt_only() -> None:
    """Without --deep the human summary of a Megatron checkpoint read "OK: ... 50 rules run" with R002 counted as a
    full check; only --json's rule status said it checked common.pt alone. The summary now says so."""
    r = runner.invoke(app, ["validate", str(DATA / "dense1")])
    assert r.exit_code == 0, r.output
    last = r.stdout.splitlines()[-1]
    assert last.startswith("OK: ") and (
        " rules run (1 in part: R002 without --deep: common.pt's iteration against its iter_N directory and its "
        "optimizers' common_step only), " in last
    ), last
    r = runner.invoke(app, ["validate", "--deep", str(DATA / "dense1")])
    assert r.exit_code == 0 and "in part" not in r.stdout, r.output


def test_junit_says_r002_checked_common_pt_only(tmp_path: Path) -> None:
    """Without --deep the JUnit report showed R002 as a plain pass; its test case now says it ran in part."""
    import xml.etree.ElementTree as ET

    report = tmp_path / "r.xml"
    r = runner.invoke(app, ["validate", str(DATA / "dense1"), "--junit", str(report)])
    assert r.exit_code == 0, r.output
    case = next(c for c in ET.parse(report).iter("testcase") if c.get("name", "").startswith("R002 "))
    assert case.find("failure") is None and case.find("skipped") is None
    out = case.find("system-out")
    assert out is not None and out.text == (
        "ran in part: without --deep: common.pt's iteration against its iter_N directory and its optimizers' "
        "common_step only"
    )
    assert runner.invoke(app, ["validate", "--deep", str(DATA / "dense1"), "--junit", str(report)]).exit_code == 0
    case = next(c for c in ET.parse(report).iter("testcase") if c.get("name", "").startswith("R002 "))
    assert case.find("system-out") is None


def test_r002_without_deep_is_skipped_outside_megatron(dense_ckpt: Path) -> None:
    r = runner.invoke(app, ["validate", "--json", str(dense_ckpt)])
    status = next(s for s in json.loads(r.stdout)["rules"] if s["code"] == "R002")
    assert status["status"] == "skipped" and status["reason"] == "needs --deep"


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (
            (2.0, 1.0),
            "common.pt: the chained optimizers' common_step differ (optimizer 0: 2, optimizer 1: 1); "
            "megatron steps them together",
        ),
        ((3.0, 3.0), "common.pt: optimizer common_step 3 is ahead of iteration 2"),
        ((1.0, 1.0), None),  # behind the iteration: a step skipped for a loss-scale overflow, --no-load-optim
    ],
)
def test_common_step_against_the_iteration_and_the_other_chain(
    tmp_path: Path, steps: tuple[float, float], message: str | None
) -> None:
    """megatron's ChainedOptimizer steps its optimizers together and never more often than the iterations run;
    common.pt's common_step was never compared (validate --deep passed a chain one step behind the other, and
    a step ahead of the iteration). Now R002 names them; a step behind the iteration stays legitimate."""
    import shutil

    run = shutil.copytree(DATA / "moe_ep2", tmp_path / "run")
    path = run / "iter_0000002" / "common.pt"
    common = torch.load(path, weights_only=False)
    for chain, step in zip(sorted(common["optimizer"]), steps):
        common["optimizer"][chain]["state"]["common_step"] = torch.tensor(step)
    torch.save(common, path)
    assert_r002(run, message)


def test_stepped_parameters_of_unassigned_groups_fail_the_replay(tmp_path: Path) -> None:
    """A chained optimizer whose groups are not megatron's default pair (a custom override: a third group)
    gets no members, so its parameters (the experts, with saved exp_avg/exp_avg_sq) are in no param group.
    replay-step said "OK: 8 of 8 parameters" over them, calling them "buffers, frozen parameters"; they are
    stepped parameters not replayed: listed in params_skipped, and the replay is not OK."""
    import shutil

    run = shutil.copytree(DATA / "moe_ep2", tmp_path / "run")
    path = run / "iter_0000002" / "common.pt"
    common = torch.load(path, weights_only=False)
    extra = dict(common["optimizer"][1]["param_groups"][0], lr_mult=0.5, lr=5e-4)
    common["optimizer"][1]["param_groups"].append(extra)
    torch.save(common, path)
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(run)])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert not doc["ok"]
    assert sorted(doc["params_skipped"]) == [
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.mlp.experts.experts.linear_fc2.weight",
    ]
    assert all(".experts." not in p["fqn"] for p in doc["params"])
    assert any("in no param group, so their hyperparameters are unknown" in n for n in doc["notes"])
    assert not any("(buffers, frozen parameters)" in n for n in doc["notes"])
    assert "[E700] 2 parameter(s) with saved optimizer state were not replayed" in r.stderr
    # left out on purpose with --filter, the rest replays OK
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", "--filter", "*self_attention*", str(run)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"]


def test_common_step_is_every_parameters_when_groups_have_no_inferred_members(tmp_path: Path) -> None:
    """A plain optimizer's common.pt with a param group beside megatron's default pair (an override group, empty on
    the rank that saved it, as megatron-core aligns groups across ranks): no group gets members, and validate read
    the optimizer's common_step as no one's, O001 "optimizer state lacks step" for every parameter. megatron-core's
    load gives it to every parameter's state (_restore_common_per_param_step): no O001."""
    run = _with_override_group(tmp_path)
    r = runner.invoke(app, ["validate", "--json", str(run)])
    doc = json.loads(r.stdout)
    assert not [f for f in doc["findings"] if f["code"] == "O001"], [f["message"] for f in doc["findings"]]


def test_parameters_of_groups_without_inferred_members_are_not_p004(tmp_path: Path) -> None:
    """That plain optimizer (an override group beside the default pair), validated --deep: P004 (error) said each
    parameter "has optimizer state but is in no param group", its hint that a resume would give it the optimizer's
    default hyperparameters. megatron-core's load rebuilds the groups from the model and its config (common.pt keeps
    no params lists): the members are only not inferred here, nothing is wrong with the save."""
    run = _with_override_group(tmp_path)
    r = runner.invoke(app, ["validate", "--deep", "--json", str(run)])
    doc = json.loads(r.stdout)
    assert not [f for f in doc["findings"] if f["code"] == "P004"], [f["message"] for f in doc["findings"]]
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["stats", str(run)])  # not "no param group or step saved": both are
    assert r.exit_code == 0 and "no param group or step saved" not in r.output, r.output
    assert "no update size: its param group not known (those of common.pt are not the trainer's default grouping)" in (
        " ".join(r.output.split())
    ), r.output


def _with_override_group(tmp_path: Path) -> Path:
    """dense1 (a plain optimizer) with a third param group in common.pt: an ``lr_mult`` 0.5 override group."""
    import shutil

    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    path = run / "iter_0000003" / "common.pt"
    common = torch.load(path, weights_only=False)
    groups = common["optimizer"]["param_groups"]
    half = {k: groups[0][k] * 0.5 for k in ("lr", "max_lr", "min_lr")}
    groups.append(dict(groups[0], lr_mult=0.5, default_config=False, **half))
    torch.save(common, path)
    return run


def test_replay_of_groups_without_inferred_members_says_so(tmp_path: Path) -> None:
    """replay-step on that plain optimizer: E514 said "none of the 0 parameter(s) of the param groups is a model
    tensor" and "the optimizer state does not name this checkpoint's model tensors", which it does. It says that the
    groups are not the default grouping, so their members are not known."""
    run = _with_override_group(tmp_path)
    r = runner.invoke(app, ["replay-step", "--device", "cpu", str(run)])
    assert r.exit_code == 2 and r.stdout == "", r.output
    line = r.stderr.splitlines()[0]
    assert line.startswith("error: [E514]") and "the 3 param groups of common.pt are not the trainer's default" in line
    assert "which parameters each holds is not known; nothing to replay" in line, line


def test_inspect_and_stats_name_the_iteration_of_common_pt() -> None:
    """Megatron keeps its step in common.pt (``iteration``): inspect showed no step and stats' step was null for
    a real iter_0000003; inspect's trainer line names common.pt's iteration and stats' step is 3."""
    ckpt = DATA / "dense1" / "iter_0000003"
    r = runner.invoke(app, ["inspect", "--json", str(ckpt)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["trainer_state"]
    assert rows[0]["file"] == "common.pt" and rows[0]["values"]["iteration"] == 3 and rows[0]["error"] is None
    r = runner.invoke(app, ["inspect", str(ckpt)], terminal_width=200)
    assert "trainer     common.pt: iteration 3" in r.stdout, r.stdout
    r = runner.invoke(app, ["stats", "--json", str(ckpt)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["checkpoints"][0]["step"] == 3


def test_a_latest_file_naming_no_checkpoint_is_r005(tmp_path: Path) -> None:
    """latest_checkpointed_iteration.txt naming iteration 5 beside the one save iter_0000003: validate of the run
    root checked iter_0000003 and said OK, though Megatron-LM's resume follows the file and fails (inspect
    --step latest is E205). Now R005 names the file; the real run passes."""
    import shutil

    r = runner.invoke(app, ["validate", "--strict", "--json", str(DATA / "dense1")])
    assert r.exit_code == 0 and not json.loads(r.stdout)["findings"], r.stdout
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run)])
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R005"]
    assert r.exit_code == 1 and f["severity"] == "warning", r.stdout
    assert f["message"] == (
        f"{run / 'latest_checkpointed_iteration.txt'}: names step 5, but no checkpoint of step 5 is below {run}; "
        "steps found: 3"
    )


@pytest.mark.parametrize(("common_step", "flagged"), [(2.0, False), (4.0, True)])
def test_common_step_against_the_iteration(tmp_path: Path, common_step: float, flagged: bool) -> None:
    """megatron skips the optimizer step of an iteration whose loss scale overflowed and still counts the
    iteration: a common_step behind common.pt's iteration is no problem of the saved state as a whole (as
    validate's R002); ahead of it, no megatron run makes, is."""
    import shutil

    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    path = run / "iter_0000003" / "common.pt"
    common = torch.load(path, weights_only=False)
    common["optimizer"]["state"]["common_step"] = torch.tensor(common_step)
    torch.save(common, path)
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(run)])
    doc = json.loads(r.stdout)
    assert all(p["step_before"] == common_step for p in doc["params"])
    if flagged:
        (problem,) = doc["problems"]
        assert problem.startswith("optimizer step 4 (optimizer.state.") and "but common.pt:iteration = 3" in problem
        assert "R002" in problem
        assert r.exit_code == 1
    else:
        assert doc["problems"] == []


def test_inferred_group_membership_is_said() -> None:
    """common.pt keeps its param groups without their parameters: the weight decay each parameter replays with
    (0.1, or 0.0 for biases and 1-D parameters) is megatron's default grouping, not read from the checkpoint; the
    replay said nothing of it, now a warning note names the hyperparameter and the rule."""
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(DATA / "dense1")])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and {p["weight_decay"] for p in doc["params"]} == {0.0, 0.1}
    (note,) = [n for n in doc["notes"] if "without their parameters" in n]
    assert note.startswith("warning: common.pt saves its param groups without their parameters; the weight_decay of")
    assert "megatron's default grouping" in note and "no_weight_decay_cond or config_overrides" in note
    # one parameter, one group: nothing depends on the membership
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(DATA / "dense1"), "--filter", "*word_emb*"])
    assert not [n for n in json.loads(r.stdout)["notes"] if "without their parameters" in n]


def test_several_steps_say_the_lr_is_held() -> None:
    """--steps 2 replays both steps with the lr saved in common.pt's groups, while megatron's OptimizerParamScheduler
    (saved in common.pt) moves it after each step: the replay said nothing; now a warning note names the scheduler."""
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", "--steps", "2", str(DATA / "dense1")])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["steps"] == 2
    (note,) = [n for n in doc["notes"] if "constant lr" in n]
    assert note.startswith("warning: 2 steps replayed, each with the lr saved in its param group; the run's LR ")
    assert "(common.pt opt_param_scheduler)" in note
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(DATA / "dense1")])
    assert not [n for n in json.loads(r.stdout)["notes"] if "constant lr" in n]


def test_common_pt_scheduler_of_another_step_is_r006(tmp_path: Path) -> None:
    """megatron-core's OptimizerParamScheduler state in common.pt (num_steps, max_lr, cosine decay; no _last_lr) of
    another step beside the param groups it set at step 3 (what iteration 5's save holds: a scheduler file of another
    save) passed validate --strict --deep and replay-step: the resume continues the schedule from step 5. R006 now
    names each group with the lr the scheduler state sets (megatron's own get_lr at num_steps 5), and replay-step
    fails; the real save passes both."""
    import shutil

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    assert runner.invoke(app, ["replay-step", "--device", "cpu", str(DATA / "dense1")]).exit_code == 0
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    common = run / "iter_0000003" / "common.pt"
    obj = torch.load(common, weights_only=False)
    assert obj["opt_param_scheduler"]["num_steps"] == 3
    obj["opt_param_scheduler"]["num_steps"] = 5
    torch.save(obj, common)
    s = obj["opt_param_scheduler"]
    ref = OptimizerParamScheduler(
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=s["max_lr"]),
        init_lr=0.0,
        max_lr=s["max_lr"],
        min_lr=s["min_lr"],
        lr_warmup_steps=s["lr_warmup_steps"],
        lr_decay_steps=s["lr_decay_steps"],
        lr_decay_style=s["lr_decay_style"],
        start_wd=s["start_wd"],
        end_wd=s["end_wd"],
        wd_incr_steps=s["wd_incr_steps"],
        wd_incr_style=s["wd_incr_style"],
    )
    ref.step(5)
    opt = obj["optimizer"] if "param_groups" in obj["optimizer"] else obj["optimizer"]["optimizer"]
    want, saved = ref.optimizer.param_groups[0]["lr"], opt["param_groups"][0]["lr"]
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(run)])
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R006"]
    assert r.exit_code == 1 and [f["message"] for f in found] == [  # both groups alike: one finding
        f"param group 0 and 1 more saved lr {saved:g} but common.pt opt_param_scheduler sets {want:g} at num_steps = 5 "
        "(lr_decay_style cosine)"
    ], r.stdout
    r = runner.invoke(app, ["replay-step", "--device", "cpu", str(run)])
    assert r.exit_code == 1 and f"sets {want:g} at num_steps = 5" in r.stdout, r.output
