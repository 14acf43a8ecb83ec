"""``ckpttool replay-step`` on CPU: variants vs the uninterrupted run, never-stepped leaf, damage, options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.replay import ReplayOptions, replay_step
from ckpttool.ops.replay.compare import compare_field
from ckpttool.ops.replay.grads import grad_seed_for, seeded_grad
from tests.fixtures import builders
from tests.fixtures.cache import cached_build
from tests.fixtures.replay import TRAIN_STEPS, VARIANTS, builder, load_recorded, resave, variant_type

runner = CliRunner()


@pytest.fixture(scope="session", params=VARIANTS)
def replay_fx(request: pytest.FixtureRequest, fixture_root: Path) -> tuple[str, Path]:
    """(variant, dir with ckpt/, grads.safetensors, next_step.safetensors)."""
    variant = request.param
    return variant, cached_build(fixture_root, f"replay_{variant}", builder(variant))


@pytest.fixture(scope="session")
def offload_fx(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "replay_cpu_offload_adamw", builder("cpu_offload_adamw"))


@pytest.fixture(scope="session")
def full_fx(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "replay_full_fp32_adamw", builder("full_fp32_adamw"))


def run(*args: Any) -> Any:
    return runner.invoke(app, ["replay-step", *map(str, args)])


def replay_collect(path: Path, **kw: Any) -> tuple[Any, dict[str, dict[str, torch.Tensor]]]:
    got: dict[str, dict[str, torch.Tensor]] = {}
    result = replay_step(path, ReplayOptions(device="cpu", **kw), on_param=lambda fqn, t: got.__setitem__(fqn, t))
    return result, got


def assert_no_traceback(res: Any) -> None:
    assert "Traceback" not in res.stdout and "Traceback" not in res.stderr


# ------------------------------------------------------------------ variants vs the uninterrupted run
@pytest.mark.parametrize("k", [1, 2])
def test_replay_equals_the_uninterrupted_next_steps_bitwise(replay_fx: tuple[str, Path], k: int) -> None:
    variant, root = replay_fx
    result, got = replay_collect(root / "ckpt", grads=root / "grads.safetensors", steps=k)
    assert result.ok, [p.problems for p in result.failed]
    assert result.optimizer_type == variant_type(variant) and result.optimizer_reason == "layout record optimizer.type"
    recorded = load_recorded(root, k)
    assert sorted(got) == sorted(recorded)
    for fqn, fields in recorded.items():
        assert sorted(got[fqn]) == sorted(fields), fqn
        for what, want in fields.items():
            assert got[fqn][what].dtype == want.dtype, (fqn, what)
            assert torch.equal(got[fqn][what], want), (fqn, what)
    fused = variant.endswith("+fused")
    assert all(cfg.get("fused", False) is fused for cfg in result.optimizer_config.values())
    assert any("fused AdamW kernel" in n for n in result.notes) is fused
    for p in result.params:
        assert p.state == "loaded" and p.step_before == TRAIN_STEPS and p.step_after == TRAIN_STEPS + k
        if variant != "adamw":
            assert p.writeback_unequal == 0 and p.sync_unequal == 0


def test_replay_cli_json_reports_each_variant(replay_fx: tuple[str, Path]) -> None:
    variant, root = replay_fx
    res = run(root / "ckpt", "--device", "cpu", "--json")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    d = json.loads(res.stdout)
    assert d["ok"] is True and d["device"] == "cpu" and d["optimizer"]["type"] == variant_type(variant)
    assert d["grads"]["source"] == "seed" and d["params_failed"] == 0 and d["params_total"] == 17
    assert d["timing"]["step_seconds"] > 0 and d["timing"]["state_bytes"] > 0
    fields = {"exp_avg", "exp_avg_sq", "param"} | ({"master_weight"} if variant != "adamw" else set())
    for p in d["params"]:
        assert set(p["errors"]) == fields
        assert all(e["ratio"] <= 1 for e in p["errors"].values())
        assert p["placement"]["param"] == "cpu"


def test_offloaded_parameters_keep_state_on_cpu_and_resident_moments_bf16(offload_fx: Path) -> None:
    result, got = replay_collect(offload_fx / "ckpt", grads=offload_fx / "grads.safetensors", chunk_size=64)
    assert result.ok
    assert result.optimizer_config["cpu_offload_adamw"]["chunk_size"] == 64
    offloaded = {p.fqn for p in result.params if p.offloaded}
    assert offloaded == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    for p in result.params:
        assert p.placement["master_weight"] == "cpu" and p.placement["exp_avg"] == "cpu"
        want = torch.float32 if p.fqn in offloaded else torch.bfloat16
        assert got[p.fqn]["exp_avg"].dtype == want and got[p.fqn]["exp_avg_sq"].dtype == want
    # chunk size changes the staging, never the result
    recorded = load_recorded(offload_fx, 1)
    for fqn in offloaded:
        assert torch.equal(got[fqn]["master_weight"], recorded[fqn]["master_weight"])


def test_human_report_names_the_optimizer_choice_and_passes(sample_ckpt: Path) -> None:
    res = run(sample_ckpt, "--device", "cpu")
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    assert "optimizer   adamw (from layout record optimizer.type)" in out
    assert "grads       seeded (seed 0, scale 0.001)" in out
    assert "result      OK: 31 of 31 parameters match the reference step" in out
    assert "model.layers.0.mlp.experts.gate_up_proj" in out
    assert res.stderr == ""


def test_fsdp_checkpoint_with_uneven_and_zero_size_chunks_replays(fsdp_ckpt: Path) -> None:
    result, got = replay_collect(fsdp_ckpt)
    assert result.ok and result.optimizer_type == "adamw"
    assert got["model.layers.0.odd"]["param"].shape == (3, 16)
    assert any("not replayed" in n for n in result.notes)  # the 0-d buffers


@pytest.mark.slow
def test_declared_legacy_same_dim_layout_replays_with_0d_steps(ep_suite: Path) -> None:
    # the 0-d `step` of an expert parameter passes through the expert reordering
    res = run(
        ep_suite / "legacy", "--device", "cpu", "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"
    )
    assert res.exit_code == 0, res.stderr
    assert "result      OK: 8 of 8 parameters match the reference step" in res.stdout


@pytest.mark.slow
def test_legacy_layout_record_with_a_huge_ep_size_is_refused_not_built(ep_suite: Path, tmp_path: Path) -> None:
    """A layout.json whose ep_size is 2**62 (8 experts): replay-step built the 2**63-entry expert permutation
    (it hung); now E406 naming the key, before any list is built."""
    import shutil

    ckpt = tmp_path / "legacy"
    shutil.copytree(ep_suite / "legacy", ckpt)
    stamp = runner.invoke(
        app, ["stamp", str(ckpt), "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]
    )
    assert stamp.exit_code == 0, stamp.stderr
    record = json.loads((ckpt / "layout.json").read_text())
    record["parallel"]["ep_size"] = 2**62
    (ckpt / "layout.json").write_text(json.dumps(record))
    res = run(ckpt, "--device", "cpu")
    assert res.exit_code == 2 and "[E406]" in res.stderr and "8 experts do not divide" in res.stderr, res.stderr


# ------------------------------------------------------------------ never-stepped leaf
def test_never_stepped_leaf_replays_from_fresh_state_with_the_scheduled_lr(multi_optim_ckpt: Path) -> None:
    from ckpttool.format import CheckpointReader

    res = run(multi_optim_ckpt, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    experts = [p for p in d["params"] if ".experts." in p["fqn"]]
    assert len(experts) == 2
    for p in experts:
        assert p["state"] == "fresh" and p["lr"] == builders.MULTI_EXPERTS_LR_MOVED == 0.0025
        assert p["step_before"] == 0 and p["step_after"] == 1
    assert any("never stepped" in n and "lr 0.0025" in n for n in d["notes"])
    dense = [p for p in d["params"] if ".experts." not in p["fqn"]]
    assert dense and all(p["state"] == "loaded" and p["lr"] == builders.MULTI_DENSE_LR for p in dense)
    # First AdamW step from fresh state moves each weight by ~lr (m_hat/sqrt(v_hat) = sign(g)); weight_decay 0.
    result, got = replay_collect(multi_optim_ckpt, select=r"\.experts\.")
    with CheckpointReader(multi_optim_ckpt) as r:
        for fqn, t in got.items():
            before = r.read_tensor(f"model.{fqn}")
            delta = (t["param"] - before).abs()
            assert torch.allclose(delta.max(), torch.tensor(0.0025), rtol=1e-3), fqn
            assert delta.min() > 0.0024


# ------------------------------------------------------------------ damaged checkpoints
def _state_key(fqn: str, field: str) -> str:
    return f"optimizer.state.{fqn}.{field}"


DENSE_FQN = "model.layers.0.self_attn.q_proj.weight"


def test_bf16_step_is_a_dtype_policy_violation(full_fx: Path, tmp_path: Path) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d[_state_key(DENSE_FQN, "step")] = d[_state_key(DENSE_FQN, "step")].to(torch.bfloat16)

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu")
    assert res.exit_code == 2
    assert res.stdout == ""
    assert res.stderr.startswith(
        f"error: [E511] optimizer state {DENSE_FQN}.step is bfloat16 but full_fp32_adamw saves float32"
    )
    assert "hint: run `ckpttool validate --strict`" in res.stderr
    assert_no_traceback(res)


def test_optimizer_steps_ahead_of_the_layout_records_global_step_are_not_ok(full_fx: Path, tmp_path: Path) -> None:
    """The optimizer state of a later save (step 5 for every parameter) beside weights and a layout record whose
    ``global_step`` is 3 (the save's training step): no parameter can have been stepped more often than the trainer
    stepped. replay-step said OK with a note blaming 'parameters that missed gradients' (which count fewer, not more),
    and validate --deep was silent; the record's global_step is now a trainer counter (R002) for both."""

    def mutate(d: dict[str, Any]) -> None:
        for key in [k for k in d if k.startswith("optimizer.state.") and k.endswith(".step")]:
            d[key] = torch.tensor(float(TRAIN_STEPS + 2))

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu", "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert not doc["ok"] and doc["params_failed"] == 0
    assert len(doc["problems"]) == 1
    assert f"optimizer step {TRAIN_STEPS + 2} (" in doc["problems"][0]
    assert f"but layout.global_step = {TRAIN_STEPS}" in doc["problems"][0]
    assert not any("missed gradients" in n for n in doc["notes"]), doc["notes"]
    assert "error: [E700]" in res.stderr
    assert_no_traceback(res)
    val = runner.invoke(app, ["validate", "--deep", "--json", str(bad)])
    assert val.exit_code == 1, val.output
    r002 = [f for f in json.loads(val.stdout)["findings"] if f["code"] == "R002"]
    assert r002 and f"layout.global_step = {TRAIN_STEPS}" in r002[0]["message"], r002
    # the same steps as the record: OK, as before
    same = run(full_fx / "ckpt", "--device", "cpu", "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["problems"] == []


def test_bf16_moments_where_fp32_is_declared_exit_2(full_fx: Path, tmp_path: Path) -> None:
    def mutate(d: dict[str, Any]) -> None:
        for f in ("exp_avg", "exp_avg_sq"):
            d[_state_key(DENSE_FQN, f)] = d[_state_key(DENSE_FQN, f)].to(torch.bfloat16)

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu", "--json")
    assert res.exit_code == 2 and res.stdout == ""
    assert (
        f"error: [E511] optimizer state {DENSE_FQN}.exp_avg is bfloat16 but full_fp32_adamw saves float32" in res.stderr
    )
    assert_no_traceback(res)


def test_master_out_of_sync_with_bf16_param_is_a_mismatch(full_fx: Path, tmp_path: Path) -> None:
    def mutate(d: dict[str, Any]) -> None:
        m = d[_state_key(DENSE_FQN, "master_weight")]
        m[0, :4] += 0.05  # far beyond one BF16 ulp of these weights

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu")
    assert res.exit_code == 1
    assert "result      FAILED: 16 of 17 parameters match the reference step" in res.stdout
    assert res.stderr.startswith(
        f"error: [E700] 1 of 17 parameter(s) do not reproduce the reference step; worst {DENSE_FQN}: "
        "master_weight out of sync with the parameter before the step: 4 of 1024 element(s)"
    )
    assert "hint: " in res.stderr
    assert_no_traceback(res)
    d = json.loads(run(bad, "--device", "cpu", "--json").stdout)
    worst = d["params"][0]
    assert worst["fqn"] == DENSE_FQN and worst["sync_unequal"] == 4 and not worst["ok"]


def test_missing_exp_avg_sq_exit_2(offload_fx: Path, tmp_path: Path) -> None:
    fqn = "model.layers.0.mlp.experts.down_proj"
    bad = resave(offload_fx / "ckpt", tmp_path / "bad", lambda d: d.pop(_state_key(fqn, "exp_avg_sq")))
    res = run(bad, "--device", "cpu")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith(f"error: [E510] optimizer state of {fqn} lacks exp_avg_sq for cpu_offload_adamw")
    assert_no_traceback(res)


def test_a_moment_of_another_shape_than_its_parameter_is_e512(full_fx: Path, tmp_path: Path) -> None:
    """A saved exp_avg stored flattened (torch's dcp.save of a moment of another shape than its parameter): exit 2,
    one E512 line naming the key and both shapes (docs/errors.md), nothing on stdout."""

    def mutate(d: dict[str, Any]) -> None:
        key = _state_key(DENSE_FQN, "exp_avg")
        d[key] = d[key].flatten()

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu")
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.startswith(
        f"error: [E512] optimizer state {DENSE_FQN}.exp_avg has shape [1024], the parameter needs [32, 32]"
    ), res.stderr
    assert_no_traceback(res)


def test_corrupt_second_moment_values_are_a_mismatch(full_fx: Path, tmp_path: Path) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d[_state_key(DENSE_FQN, "exp_avg_sq")][1, 1] = -1.0  # sqrt of a negative second moment

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu", "--filter", "*q_proj*")
    assert res.exit_code == 1
    assert "error: [E700] 1 of 1 parameter(s)" in res.stderr
    assert_no_traceback(res)


def test_a_nan_in_the_saved_second_moment_is_named_as_the_cause(full_fx: Path, tmp_path: Path) -> None:
    """A NaN in one saved exp_avg_sq element failed the replay (exit 1, right) but E700 blamed a divergence
    of the FP32 master and the parameter ('parameter differs from master_weight.to(bfloat16) in 1 element(s)
    after the step'); now the first problem, and E700's cause, is the non-finite saved value (D001)."""

    def mutate(d: dict[str, Any]) -> None:
        d[_state_key(DENSE_FQN, "exp_avg_sq")][1, 1] = float("nan")

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu")
    assert res.exit_code == 1, res.output
    n = 32 * 32  # q_proj of the fixture's model: element [1, 1] is flat index 33
    assert res.stderr.startswith(
        f"error: [E700] 1 of 17 parameter(s) do not reproduce the reference step; worst {DENSE_FQN}: saved "
        f"exp_avg_sq holds non-finite values [D001]: 1 NaN of {n} element(s), the first at flat index 33; "
    ), res.stderr
    assert "master_weight" not in res.stderr.splitlines()[0]
    assert_no_traceback(res)
    result, _ = replay_collect(bad)
    (worst,) = result.failed
    assert worst.fqn == DENSE_FQN and worst.problems[0].startswith("saved exp_avg_sq holds non-finite values [D001]")
    assert not any("non-finite" in p for p in worst.problems[1:])  # exp_avg, master, param: saved finite


def test_json_of_a_replay_with_non_finite_errors_is_valid_json(full_fx: Path, tmp_path: Path) -> None:
    """With a NaN saved in exp_avg_sq the field errors are infinite: `--json` was E999 'Out of range float values
    are not JSON compliant' (exit 2, no document); now the errors are the string "inf", as `update`'s are."""
    import jsonschema

    from ckpttool.commands.schema import load_schema

    def mutate(d: dict[str, Any]) -> None:
        d[_state_key(DENSE_FQN, "exp_avg_sq")][1, 1] = float("nan")

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu", "--json")
    assert res.exit_code == 1 and "[E700]" in res.stderr, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("replay"))
    worst = doc["params"][0]
    assert worst["fqn"] == DENSE_FQN and worst["errors"]["exp_avg_sq"]["max_abs"] == "inf"
    assert worst["errors"]["exp_avg_sq"]["bad"] == 1 and isinstance(worst["errors"]["exp_avg"]["max_abs"], float)


def test_lost_state_in_a_stepped_leaf_is_not_treated_as_fresh(full_fx: Path, tmp_path: Path) -> None:
    def mutate(d: dict[str, Any]) -> None:
        for f in ("step", "master_weight", "exp_avg", "exp_avg_sq"):
            d.pop(_state_key(DENSE_FQN, f))

    bad = resave(full_fx / "ckpt", tmp_path / "bad", mutate)
    res = run(bad, "--device", "cpu")
    assert res.exit_code == 2
    assert res.stderr.startswith(
        f"error: [E513] parameter {DENSE_FQN} has no optimizer state although other parameters"
    )
    res = run(bad, "--device", "cpu", "--filter", "*.experts.*")  # leaving it out works
    assert res.exit_code == 0, res.stderr


# ------------------------------------------------------------------ optimizer choice
def test_type_from_state_fields_without_a_record_and_offload_patterns(full_fx: Path, tmp_path: Path) -> None:
    plain = resave(full_fx / "ckpt", tmp_path / "norecord", lambda d: d.pop("layout"))
    d = json.loads(run(plain, "--device", "cpu", "--json").stdout)
    assert d["ok"] and d["optimizer"]["type"] == "full_fp32_adamw"
    assert d["optimizer"]["reason"].startswith("state fields")
    res = run(plain, "--device", "cpu", "--json", "--offload-patterns", r"\.experts\.", "--chunk-size", "500")
    d = json.loads(res.stdout)
    assert res.exit_code == 0 and d["optimizer"]["type"] == "cpu_offload_adamw"
    assert d["optimizer"]["reason"] == "state fields (FP32 master_weight) and --offload-patterns"
    assert {p["fqn"] for p in d["params"] if p["offloaded"]} == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }


def test_mixed_moment_dtypes_without_a_record_infer_per_parameter(offload_fx: Path, tmp_path: Path) -> None:
    plain = resave(offload_fx / "ckpt", tmp_path / "norecord", lambda d: d.pop("layout"))
    d = json.loads(run(plain, "--device", "cpu", "--json").stdout)
    assert d["ok"] and d["optimizer"]["type"] == "mixed"
    types = {p["fqn"]: p["optimizer"] for p in d["params"]}
    assert types["model.layers.0.mlp.experts.down_proj"] == "full_fp32_adamw"
    assert types[DENSE_FQN] == "master_fp32_adamw"


def test_optimizer_option_overrides_the_record_and_is_checked(fixture_root: Path) -> None:
    root = cached_build(fixture_root, "replay_master_fp32_adamw", builder("master_fp32_adamw"))
    res = run(root / "ckpt", "--device", "cpu", "--optimizer", "full_fp32_adamw")
    assert res.exit_code == 2
    assert "error: [E511]" in res.stderr and "but full_fp32_adamw saves float32" in res.stderr
    res = run(root / "ckpt", "--device", "cpu", "--optimizer", "adamw")
    assert res.exit_code == 2 and "error: [E510]" in res.stderr and "has unexpected master_weight" in res.stderr


# ------------------------------------------------------------------ gradients, selection, memory
def test_seeded_generator_is_the_documented_formula() -> None:
    fqn = "model.layers.0.mlp.experts.down_proj"
    g = seeded_grad(fqn, (4, 8), torch.bfloat16, seed=3, scale=0.5, step_index=1)
    gen = torch.Generator().manual_seed(grad_seed_for(fqn, 3, 1))
    want = (torch.randn((4, 8), generator=gen, dtype=torch.float32) * 0.5).to(torch.bfloat16)
    assert torch.equal(g, want)
    import zlib

    assert grad_seed_for(fqn, 3, 1) == zlib.crc32(f"ckpttool.replay:3:1:{fqn}".encode())
    assert not torch.equal(g, seeded_grad(fqn, (4, 8), torch.bfloat16, seed=3, scale=0.5, step_index=0))


def test_batches_under_max_memory_give_identical_results(full_fx: Path) -> None:
    one, got_one = replay_collect(full_fx / "ckpt", steps=2)
    many, got_many = replay_collect(full_fx / "ckpt", steps=2, max_memory=150_000)
    assert one.batches == 1 and many.batches > 3 and many.ok
    for fqn in got_one:
        for what in got_one[fqn]:
            assert torch.equal(got_one[fqn][what], got_many[fqn][what]), (fqn, what)
    res = run(full_fx / "ckpt", "--device", "cpu", "--max-memory", "100KiB")
    assert res.exit_code == 2 and "error: [E130]" in res.stderr and "more than --max-memory 102,400" in res.stderr


def test_filter_limits_the_replay(full_fx: Path) -> None:
    d = json.loads(run(full_fx / "ckpt", "--device", "cpu", "--json", "--filter", "*norm.weight").stdout)
    assert d["params_total"] == 5 and all(p["fqn"].endswith("norm.weight") for p in d["params"])
    res = run(full_fx / "ckpt", "--device", "cpu", "--filter", "nothing_matches")
    assert res.exit_code == 2 and res.stderr.startswith(
        "error: [E100] --filter 'nothing_matches' matches none of the 17"
    )


def test_deprecated_select_regex_still_limits_the_replay(full_fx: Path) -> None:
    res = run(full_fx / "ckpt", "--device", "cpu", "--json", "--select", r"norm\.weight$")
    assert res.exit_code == 0 and res.stderr.startswith("warning: replay-step --select REGEX is deprecated")
    assert json.loads(res.stdout)["params_total"] == 5
    res = run(full_fx / "ckpt", "--device", "cpu", "--select", "nothing_matches")
    err = res.stderr.splitlines()
    assert res.exit_code == 2 and err[1].startswith("error: [E100] --select 'nothing_matches' matches none of the 17")


def test_gradient_file_problems_exit_2(full_fx: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    grads = load_file(str(full_fx / "grads.safetensors"))
    grads.pop(DENSE_FQN)
    save_file(grads, str(tmp_path / "missing.safetensors"))
    res = run(full_fx / "ckpt", "--device", "cpu", "--grads", tmp_path / "missing.safetensors")
    assert res.exit_code == 2 and res.stderr.startswith(
        f"error: [E120] --grads {tmp_path / 'missing.safetensors'} has no gradient for {DENSE_FQN}"
    )
    grads[DENSE_FQN] = torch.zeros(3, 3)
    save_file(grads, str(tmp_path / "shape.safetensors"))
    res = run(full_fx / "ckpt", "--device", "cpu", "--grads", tmp_path / "shape.safetensors")
    assert res.exit_code == 2 and "has shape [3, 3], the parameter has [32, 32]" in res.stderr
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    res = run(full_fx / "ckpt", "--device", "cpu", "--grads", tmp_path / "junk.safetensors")
    assert res.exit_code == 2 and "not a readable safetensors file" in res.stderr
    # keys with the checkpoint's model. prefix are accepted
    prefixed = {f"model.{k}": v for k, v in load_file(str(full_fx / "grads.safetensors")).items()}
    save_file(prefixed, str(tmp_path / "prefixed.safetensors"))
    assert run(full_fx / "ckpt", "--device", "cpu", "--grads", tmp_path / "prefixed.safetensors").exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--grads", "g.safetensors", "--grad-seed", "1"],
            "error: [E100] --grads and --grad-seed/--grad-scale are exclusive",
        ),
        (["--tolerance", "1e-5"], "error: [E100] --tolerance '1e-5' is not 'rtol,atol'"),
        # --rtol/--atol are named as given (was "--tolerance 'nan,1e-08'", a flag nobody passed)
        (["--rtol", "nan"], "error: [E100] --rtol nan: must be a finite number >= 0"),
        (["--atol", "inf"], "error: [E100] --atol inf: must be a finite number >= 0"),
        (["--atol", "-1"], "error: [E100] --atol -1.0: must be a finite number >= 0"),
        (["--max-memory", "lots"], "error: [E100] --max-memory 'lots' is not a size"),
        (["--filter", "*", "--select", "("], "error: [E100] --select and --filter are exclusive"),
    ],
)
def test_bad_options_exit_2_with_one_line(full_fx: Path, args: list[str], message: str) -> None:
    res = run(full_fx / "ckpt", "--device", "cpu", *args)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith(message)
    assert_no_traceback(res)


@pytest.mark.parametrize(
    "tol, needle",
    [
        ("inf,inf", "both numbers must be finite"),
        ("1e-5,inf", "both numbers must be finite"),
        ("nan,1e-8", "both numbers must be finite"),
        ("-1e-5,1e-8", "both numbers must be >= 0"),
        ("1e-5,-0.5", "both numbers must be >= 0"),
    ],
)
def test_non_finite_or_negative_tolerance_is_refused(full_fx: Path, tol: str, needle: str) -> None:
    res = run(full_fx / "ckpt", "--device", "cpu", "--tolerance", tol)
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0].startswith(f"error: [E100] --tolerance '{tol}': {needle}"), res.stderr
    assert lines[1].startswith("hint: ") and "--tolerance 1e-5,1e-8" in lines[1]
    assert_no_traceback(res)


def test_rtol_atol_are_the_tolerance_as_diff_names_it(full_fx: Path) -> None:
    """``--rtol``/``--atol`` give the same run as ``--tolerance`` (the other number at its default)."""

    def tol(*args: str) -> Any:
        res = run(full_fx / "ckpt", "--device", "cpu", "--filter", "*", "--json", *args)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["tolerance"]

    assert tol("--rtol", "1e-3") == tol("--tolerance", "1e-3,1e-8") == {"rtol": 1e-3, "atol": 1e-8}
    assert tol("--atol", "1e-6") == {"rtol": 1e-5, "atol": 1e-6}
    assert tol("--rtol", "1e-4", "--atol", "1e-7") == {"rtol": 1e-4, "atol": 1e-7}
    res = run(full_fx / "ckpt", "--device", "cpu", "--tolerance", "1e-5,1e-8", "--atol", "1e-6")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E100] --tolerance and --rtol/--atol are exclusive")
    assert_no_traceback(res)


def test_library_refuses_an_infinite_tolerance(full_fx: Path) -> None:
    from ckpttool.errors import UsageError
    from ckpttool.ops.replay.run import replay_step

    with pytest.raises(UsageError, match="finite"):
        replay_step(full_fx / "ckpt", ReplayOptions(device="cpu", tolerance=(float("inf"), 0.0)))


def test_a_tolerance_or_grad_scale_that_is_no_number_is_a_usage_error_naming_it(full_fx: Path) -> None:
    """`ReplayOptions(tolerance=(1e-5,))` ended in `TypeError: check_tolerance() missing 1 required positional
    argument`, `tolerance=("1e-5", "1e-8")` and `grad_scale="1e-3"` in TypeErrors of a comparison: E100 naming the
    option, before the checkpoint is read; NumPy scalars are numbers."""
    import numpy as np

    from ckpttool.errors import UsageError
    from ckpttool.ops.replay.run import replay_step

    for kw, name in (
        ({"tolerance": (1e-5,)}, "tolerance"),
        ({"tolerance": (1e-5, 1e-8, 0.0)}, "tolerance"),
        ({"tolerance": ("1e-5", "1e-8")}, "tolerance"),
        ({"tolerance": (True, 0.0)}, "tolerance"),
        ({"tolerance": 1e-5}, "tolerance"),
        ({"grad_scale": "1e-3"}, "grad_scale"),
        ({"grad_scale": None}, "grad_scale"),
    ):
        with pytest.raises(UsageError) as e:
            replay_step(full_fx / "ckpt", ReplayOptions(device="cpu", **kw))  # type: ignore[arg-type]
        assert (e.value.code, e.value.param) == ("E100", name), kw
    res = replay_step(
        full_fx / "ckpt",
        ReplayOptions(device="cpu", tolerance=(np.float32(1e-5), np.float64(1e-8)), grad_scale=np.float32(1e-3)),
    )
    assert res.ok and json.loads(json.dumps(res.to_dict()))["tolerance"] == {
        "rtol": float(np.float32(1e-5)),
        "atol": 1e-8,
    }


def test_missing_accelerator_is_a_usage_error(full_fx: Path) -> None:
    from ckpttool.optim_state.device import accelerator_type

    if accelerator_type() == "cuda":
        pytest.skip("this machine has cuda")
    res = run(full_fx / "ckpt", "--device", "cuda")
    assert res.exit_code == 2 and res.stderr.startswith("error: [E121] --device cuda: no cuda device on this machine")


def test_not_a_checkpoint_exit_2(tmp_path: Path) -> None:
    res = run(tmp_path, "--device", "cpu")
    assert res.exit_code == 2 and res.stderr.startswith("error: [E")
    assert_no_traceback(res)


def test_compare_field_flags_values_beyond_tolerance() -> None:
    ref = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    scale = ref.abs() + 0.1
    ok = compare_field(ref.float(), ref, scale, rtol=1e-5, atol=0.0, stored="float32", arithmetic="float32")
    assert ok.ok and ok.max_abs == 0
    off = ref.clone()
    off[1] += 1e-3
    bad = compare_field(off.float(), ref, scale, rtol=1e-5, atol=0.0, stored="float32", arithmetic="float32")
    assert bad.bad == 1 and bad.ratio > 1 and bad.max_abs == pytest.approx(1e-3, rel=1e-3)
    # one BF16 rounding of the same value is accepted for a BF16 field
    bf = compare_field(
        off.to(torch.bfloat16), off, off.abs(), rtol=1e-5, atol=0.0, stored="bfloat16", arithmetic="float32"
    )
    assert bf.ok
    nan = compare_field(
        torch.tensor([float("nan"), -2.0, 0.0]), ref, scale, rtol=1e-5, atol=0.0, stored="float32", arithmetic="float32"
    )
    assert nan.bad == 1


def test_source_checkpoint_is_not_modified(full_fx: Path) -> None:
    import hashlib

    def digest() -> str:
        h = hashlib.sha256()
        for p in sorted((full_fx / "ckpt").rglob("*")):
            if p.is_file():
                h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()

    before = digest()
    assert run(full_fx / "ckpt", "--device", "cpu", "--steps", "2").exit_code == 0
    assert digest() == before


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_gradient_file_that_is_not_a_regular_file_is_named_so(full_fx: Path, tmp_path: Path, kind: str) -> None:
    from tests.fixtures.special_files import fails_instead_of_hanging, make_special

    grads = tmp_path / "grads.safetensors"
    if kind == "directory":
        grads.mkdir()
    else:
        make_special(grads, kind)
    with fails_instead_of_hanging():
        res = run(full_fx / "ckpt", "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith(f"error: [E120] --grads {grads}: not a regular file"), res.stderr


@pytest.mark.parametrize("optimizer", ["RAdam", "NAdam"])
def test_radam_and_nadam_checkpoints_are_named_as_not_adamw(tmp_path: Path, optimizer: str) -> None:
    """RAdam saves exp_avg, exp_avg_sq and step as AdamW does and a group with betas, eps, weight_decay: replay-step
    stepped it as AdamW and said 'OK: 2 of 2 parameters match the reference step' for a step RAdam never takes.
    Its group (as NAdam's) saves decoupled_weight_decay but no amsgrad, which Adam's and AdamW's always hold."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-2)
    train_steps(model, opt, 3, loss="square")
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    res = run(tmp_path / "ck", "--device", "cpu")
    assert res.exit_code == 2 and res.stdout == "", res.output
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"error: [E514] param group of weight was saved by torch.optim.{optimizer} "), first
    assert first.endswith("replay-step replays AdamW"), first
    # an AdamW group of the same torch holds both keys: replayed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    assert "decoupled_weight_decay" in osd["param_groups"][0] and "amsgrad" in osd["param_groups"][0]
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "adamw")
    assert run(tmp_path / "adamw", "--device", "cpu").exit_code == 0


def test_sgd_checkpoint_is_named_as_not_adamw(tmp_path: Path) -> None:
    """An SGD checkpoint was refused with 'lacks betas, eps' and the hint that the checkpoint must save them, as
    if it were damaged; it is a checkpoint of another optimizer, which replay-step does not replay."""
    from tests.fixtures.builders import build_sgd

    build_sgd(tmp_path / "ck")
    res = run(tmp_path / "ck")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "error: [E514] param group of weight has no betas (keys dampening, differentiable, foreach, fused, lr, maximize, "
        "momentum, nesterov, params, weight_decay): it was saved by torch.optim.SGD (state momentum_buffer), not "
        "Adam/AdamW",
        "hint: replay-step replays AdamW steps only; `ckpttool validate` checks the torch.optim.SGD state's fields "
        "and shapes, `ckpttool inspect` shows them",
    ]


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("RMSprop", lambda p: torch.optim.RMSprop(p, lr=0.01)),
        ("Adagrad", lambda p: torch.optim.Adagrad(p, lr=0.1)),
        ("Adafactor", lambda p: torch.optim.Adafactor(p, lr=0.01)),
        ("Rprop", lambda p: torch.optim.Rprop(p, lr=0.01)),
        ("ASGD", lambda p: torch.optim.ASGD(p, lr=0.01)),
        ("SGD-no-momentum", lambda p: torch.optim.SGD(p, lr=0.1)),  # no state: its group tells it
    ],
)
def test_another_optimizers_checkpoint_is_refused_by_its_name(tmp_path: Path, name: str, make: Any) -> None:
    """replay-step refused every optimizer without betas as 'not an Adam/AdamW group (an SGD group has momentum,
    dampening, nesterov)' with a hint to select the AdamW parameters beside Muon, RMSprop's and Adafactor's alike;
    it now names the optimizer torch stepped (``optim_state.known``) and points at what reads its state."""
    made: list[torch.optim.Optimizer] = []
    ref = builders.build_linear_stepped(tmp_path / "ck", lambda p: made.append(make(p)) or made[0], steps=2)
    want = f"torch.optim.{type(made[0]).__name__}"
    res = run(tmp_path / "ck", "--device", "cpu")
    assert res.exit_code == 2 and res.stdout == "", res.output
    error, hint = res.stderr.splitlines()
    fields = sorted(ref["state"][0]) if ref["state"] else []
    state = f"state {', '.join(fields)}" if fields else "no state"
    assert error.startswith("error: [E514] param group of weight has no betas (keys "), error
    assert error.endswith(f"): it was saved by {want} ({state}), not Adam/AdamW"), error
    assert hint == (
        f"hint: replay-step replays AdamW steps only; `ckpttool validate` checks the {want} state's fields and "
        "shapes, `ckpttool inspect` shows them"
    )


def test_zero_initialised_bias_early_in_training_is_not_an_update_size_failure(tmp_path: Path) -> None:
    """A clean torch.optim.AdamW run saved after its first step failed replay-step with R003 on its LayerNorm bias
    ('max |update| 0.001 on a tensor whose largest saved value is 0.001'): a zero-initialised tensor is one update
    in size after one step, and the next update is as large. Such a tensor has no scale of its own to judge by."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "lr": 2e-3}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )
    gen = torch.Generator().manual_seed(1)

    def backward() -> None:
        model(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()

    backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    opt.zero_grad()
    backward()
    names = {p: n for n, p in model.named_parameters()}
    save_file({n: p.grad.clone() for p, n in names.items()}, str(tmp_path / "g.safetensors"))
    opt.step()  # torch's own next step: the reference
    res, got = replay_collect(tmp_path / "ck", grads=str(tmp_path / "g.safetensors"), reference="torch")
    assert sorted(got) == sorted(names.values())
    for p, n in names.items():
        assert torch.equal(got[n]["param"], p.detach()), n
        assert torch.equal(got[n]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), n
    bias = next(r for r in res.params if r.fqn == "1.bias")
    assert bias.update.max_update >= bias.update.max_param > 0  # the case: one update moves it by its own size
    assert bias.update.rel_to_param == 0.0 and bias.problems == []
    assert res.ok, [(r.fqn, r.problems) for r in res.params if r.problems]


def test_a_newer_incomplete_step_of_the_run_root_is_named(full_fx: Path, tmp_path: Path) -> None:
    """replay-step of a run root replayed its newest complete step and said OK with no word of a newer step whose
    save did not finish (torch's .metadata.tmp beside the data files), which validate fails as R001: the check
    before a resume passed silently while the run's newest save was broken. It is now a warning note."""
    import shutil

    root = tmp_path / "run"
    shutil.copytree(full_fx / "ckpt", root / "step-3")
    shutil.copytree(full_fx / "ckpt", root / "step-4")
    (root / "step-4" / ".metadata").rename(root / "step-4" / ".metadata.tmp")
    res = run(root, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["checkpoint"] == str(root / "step-3") and doc["ok"]
    incomplete = [n for n in doc["notes"] if "step 4" in n]
    assert incomplete == [
        f"warning: a newer step's save did not finish: step 4 ({root / 'step-4'}: 1 data file(s), .metadata.tmp, "
        "no .metadata) is newer than the replayed step 3; `ckpttool validate` reports it (R001)"
    ], doc["notes"]


def test_a_saved_lr_far_beyond_the_weights_is_still_an_update_size_failure(tmp_path: Path) -> None:
    """The zero-initialised exemption (a tensor within reach of its saved updates from zero has no scale of its
    own) must not swallow a saved lr far beyond the weights' scale: after 100 steps at lr 1e-3 every tensor is
    within 100 * lr' * bound of zero for a saved lr' of 10, and replay-step said OK. Only tensors of the order of
    lr are exempt; here the weights (largest values 0.3-1) move by about 5 per step: R003."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 100, loss="square")
    msd, osd = get_state_dict(model, opt)
    for lr, name in ((1e-3, "clean"), (10.0, "lr10")):
        for g in osd["param_groups"]:
            g["lr"] = lr
        save_quiet({"model": msd, "optimizer": osd}, tmp_path / name)
    assert replay_step(tmp_path / "clean", ReplayOptions(device="cpu")).ok
    res = replay_step(tmp_path / "lr10", ReplayOptions(device="cpu"))
    failed = {r.fqn for r in res.params if not r.ok}
    assert not res.ok and {"0.weight", "2.weight"} <= failed, [(r.fqn, r.problems) for r in res.params]
    w = next(r for r in res.params if r.fqn == "0.weight")
    assert w.update.rel_to_param > 1 and w.problems[0].startswith("update size [R003]: max |update|"), w.problems
    # the moments are Adam's own: the message names the lr, not a zeroed exp_avg_sq
    assert w.problems[0].endswith(
        "(the moments are within Adam's bound, so the saved lr 10 is beyond the tensor's scale: a wrong lr in the "
        "saved param group (a scheduler or conversion bug))"
    ), w.problems


def _adamw_linear_with(
    tmp_path: Path, mutate: Any, make_optim: Any = None, mutate_model: Any = None
) -> tuple[Path, Path, Any, Any]:
    """A ``torch.nn.Linear(8, 4)`` stepped 3 times by ``torch.optim.AdamW`` (or ``make_optim(params)``), its
    ``get_state_dict`` optimizer state changed by ``mutate(osd)`` (and model state by ``mutate_model(msd)``) and saved
    with ``dcp.save``; gradients of the next step in ``g.safetensors``. Returns (checkpoint, gradients file, model,
    optimizer) before that step."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = (make_optim or (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)))(model.parameters())
    train_steps(model, opt, 3, loss="square")
    msd, osd = get_state_dict(model, opt)
    mutate(osd)
    if mutate_model is not None:
        msd = {k: v.detach().clone() for k, v in msd.items()}  # not the live parameters the caller steps
        mutate_model(msd)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    gen = torch.Generator().manual_seed(7)
    save_file(
        {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in model.named_parameters()},
        str(tmp_path / "g.safetensors"),
    )
    return tmp_path / "ck", tmp_path / "g.safetensors", model, opt


def test_a_nan_saved_state_is_not_called_a_difference_from_torch(tmp_path: Path) -> None:
    """With a NaN saved in exp_avg_sq, --reference torch said the replay 'differs bitwise from torch.optim.AdamW(...)
    on the saved state: param in 1 element(s), exp_avg_sq in 1 element(s)': torch's own step gives NaN at the same
    elements (NaN != NaN). The replay reproduces torch there; the failure is the saved NaN (D001) alone."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["exp_avg_sq"][1, 2] = float("nan")

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads, "--reference", "torch", "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    weight = next(p for p in doc["params"] if p["fqn"] == "weight")
    assert weight["torch_unequal"] == {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "step": 0}
    assert weight["problems"][0].startswith("saved exp_avg_sq holds non-finite values [D001]: 1 NaN of 32 element(s)")
    assert not any("torch.optim.AdamW" in p for p in weight["problems"]), weight["problems"]
    assert_no_traceback(res)


def test_a_non_finite_saved_parameter_names_its_update_size(tmp_path: Path) -> None:
    """With an infinity saved in the parameter, the update-size problem read 'update size [R003]:  (the moments are within
    Adam's bound, so the saved lr 0.01 is beyond the tensor's scale: ...)': no size named (NaN compares as nothing)
    and the lr blamed. It now names the sizes and the non-finite saved value as the cause."""

    def nan_weight(msd: dict[str, Any]) -> None:
        msd["weight"][1, 2] = float("inf")

    ck, grads, _, _ = _adamw_linear_with(tmp_path, lambda osd: None, mutate_model=nan_weight)
    res = run(ck, "--device", "cpu", "--grads", grads, "--json")
    assert res.exit_code == 1, res.output
    weight = next(p for p in json.loads(res.stdout)["params"] if p["fqn"] == "weight")
    assert weight["problems"][0].startswith("saved param holds non-finite values [D001]: 1 infinite of 32 element(s)")
    assert weight["problems"][1] == (
        "update size [R003]: max |update| nan on a tensor whose largest saved value is inf (the step from a saved "
        "non-finite value is not finite)"
    )
    assert_no_traceback(res)


def test_a_saved_lr_of_zero_is_not_ok(tmp_path: Path) -> None:
    """A param group saved with lr 0 replayed 'OK: 2 of 2 parameters match the reference step with a sane update':
    AdamW at lr 0 moves nothing (weight decay included), so the replay checked the moments only. Each parameter of
    the group now fails with an update-size problem naming the lr (exit 1); another group's parameters still pass."""

    def lr0(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["lr"] = 0.0

    ck, grads, _, _ = _adamw_linear_with(tmp_path, lr0)
    res = run(ck, "--device", "cpu", "--grads", grads, "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["params_failed"] == 2
    for p in doc["params"]:
        assert p["problems"] == [
            "update size [R003]: the saved lr is 0, so the step moves no parameter: the replay checks the moments "
            "only, not the update a resume makes (a schedule at its start or end, or a wrong lr in the saved param "
            "group)"
        ]
    assert res.stderr.startswith("error: [E700] 2 of 2 parameter(s) do not reproduce the reference step; worst ")

    def bias_lr0(osd: dict[str, Any]) -> None:
        group = osd["param_groups"][0]
        osd["param_groups"] = [{**group, "params": ["weight"]}, {**group, "params": ["bias"], "lr": 0.0}]

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "bias", bias_lr0)
    doc = json.loads(run(ck, "--device", "cpu", "--grads", grads, "--json").stdout)
    assert [(p["fqn"], p["ok"]) for p in doc["params"]] == [("bias", False), ("weight", True)]
    assert_no_traceback(res)


def test_a_state_reset_to_step_0_in_a_stepped_group_is_not_ok(tmp_path: Path) -> None:
    """One parameter's state reset to step 0 with zero moments while its group is at step 3 (torch.optim never saves
    that: it counts the first step as it creates the state) replayed a clean first step and said 'OK: 2 of 2'; a
    resume restarts that parameter's moments while the group's go on, as for lost state (E513). Validate --deep says
    O007; the replay now fails the parameter naming both steps (exit 1)."""

    def reset(osd: dict[str, Any]) -> None:
        st = osd["state"]["weight"]
        st["step"], st["exp_avg"], st["exp_avg_sq"] = (
            torch.zeros_like(st["step"]),
            0 * st["exp_avg"],
            0 * st["exp_avg_sq"],
        )

    ck, grads, _, _ = _adamw_linear_with(tmp_path, reset)
    res = run(ck, "--device", "cpu", "--grads", grads, "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert [(p["fqn"], p["ok"]) for p in doc["params"]] == [("weight", False), ("bias", True)]
    assert doc["params"][0]["problems"] == [
        "saved step 0 while bias of its param group is at step 3 [O007]: torch.optim counts a parameter's first step "
        "as it creates its state, so this state was reset or made up after the run stepped (a resume restarts its "
        "moments and bias correction while its group's go on)"
    ]
    assert run(ck, "--device", "cpu", "--grads", grads, "--filter", "weight").exit_code == 0  # no group step to compare
    # the flattened flavor (torchtitan's): parameters with equal hyperparameters are one leaf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 3)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    osd = {k: (torch.zeros_like(v) if k.startswith("state.weight.") else v) for k, v in osd.items()}
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "flat")
    res = run(tmp_path / "flat", "--device", "cpu", "--json")
    assert res.exit_code == 1, res.output
    assert json.loads(res.stdout)["params"][0]["problems"][0].startswith(
        "saved step 0 while bias of its param group is at step 3 [O007]"
    )


def test_a_step_saved_as_a_python_number_replays_as_torch_loads_it(tmp_path: Path) -> None:
    """A state whose step is a Python number (3 or 3.0: torch before 1.12, optimizers that count in an int) was refused:
    'E511 optimizer state weight.step is saved as a Python object, not a tensor', though torch.optim.AdamW loads it
    (its __setstate__ makes a float32 tensor of it) and resumes. It now replays as torch loads it, bitwise equal to
    torch.optim.AdamW's next step; a fractional one is refused as a fractional tensor is, and a string still is."""
    for name, value in (("int", 3), ("float", 3.0)):

        def number_steps(osd: dict[str, Any], v: Any = value) -> None:
            for st in osd["state"].values():
                st["step"] = v

        ck, grads, _, _ = _adamw_linear_with(tmp_path / name, number_steps)
        res = run(ck, "--device", "cpu", "--grads", grads, "--reference", "torch", "--json")
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert [(p["step_before"], p["step_after"], p["torch_unequal"]) for p in doc["params"]] == [
            (3.0, 4.0, {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "step": 0})
        ] * 2

    def fractional(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["step"] = 2.5

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "fractional", fractional)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and res.stderr.startswith(
        "error: [E511] optimizer state weight.step is 2.5, not a count of steps taken"
    ), res.stderr

    def text(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["step"] = "3"

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "text", text)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and res.stderr.startswith(
        "error: [E511] optimizer state weight.step is saved as a Python object, not a tensor"
    ), res.stderr
    assert_no_traceback(res)


def assert_replay_is_the_runs_next_step(ck: Path, grads: Path, model: Any, opt: Any) -> None:
    """Step ``opt`` with the gradients file (the run's own next step), replay the checkpoint against torch with the
    same file: every parameter and moment equal to the run's, bitwise."""
    from safetensors.torch import load_file

    g = load_file(str(grads))
    for n, p in model.named_parameters():
        p.grad = g[n].clone()
    opt.step()
    res, got = replay_collect(ck, grads=str(grads), reference="torch")
    assert res.ok, [(r.fqn, r.problems) for r in res.params]
    for n, p in model.named_parameters():
        assert torch.equal(got[n]["param"], p.detach()), n
        assert torch.equal(got[n]["exp_avg"], opt.state[p]["exp_avg"]), n
        assert torch.equal(got[n]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), n
    assert all(r.torch_unequal == {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "step": 0} for r in res.params)


def test_a_negative_saved_second_moment_is_named_as_the_cause(tmp_path: Path) -> None:
    """A negative saved exp_avg_sq (validate --deep's D002) failed the replay (right) with only its consequences:
    'update size [R003]: max |m_hat|/(sqrt(v_hat)+eps) inf ...' and 'param: 1 element(s) beyond tolerance (max abs
    inf ...)', E700 blaming the update size. The first problem, and E700's cause, is now the negative saved value."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["exp_avg_sq"][1, 2] = -1e-4

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(
        "error: [E700] 1 of 2 parameter(s) do not reproduce the reference step; worst weight: saved exp_avg_sq holds "
        "negative values [D002]: 1 of 32 element(s) (min -0.0001), the first at flat index 10; "
    ), res.stderr
    assert_no_traceback(res)
    result, _ = replay_collect(ck, grads=str(grads), reference="torch")
    (worst,) = result.failed
    assert worst.problems[0].startswith("saved exp_avg_sq holds negative values [D002]")
    assert not any("D002" in p or "D001" in p for p in worst.problems[1:]), worst.problems
    assert worst.torch_unequal == {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "step": 0}


def test_a_tensor_lr_replays_torchs_own_step_bitwise(tmp_path: Path) -> None:
    """torch.optim.AdamW(lr=torch.tensor(0.01)) saves its lr as a 0-d tensor; replay-step built AdamW with the float
    and said 'OK' with --reference torch (torch_unequal 0, its reference built the same way) while the run's own next
    step differs from it by an ulp in some elements (torch computes lr * weight_decay and the step size with the
    tensor). Both now take the saved tensor: the replay equals torch's own step bitwise."""
    ck, grads, model, opt = _adamw_linear_with(
        tmp_path, lambda osd: None, lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2), weight_decay=0.1)
    )
    assert torch.is_tensor(opt.param_groups[0]["lr"])
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("flags", [{}, {"fused": True}], ids=["single-tensor", "fused"])
def test_a_half_precision_tensor_lr_matches_the_reference(tmp_path: Path, dtype: torch.dtype, flags: dict) -> None:
    """torch.optim.AdamW(lr=torch.tensor(1e-2, dtype=torch.bfloat16)) (a tensor made under a BF16 default dtype):
    torch's for-loop step forms 1 - lr * weight_decay and the step size lr / (1 - beta1^t) as tensors of that dtype,
    rounded to 8 bits. The replay equalled torch's own next step bitwise, but the formula reference took the lr as a
    float and failed every parameter: '[E700] 2 of 2 parameter(s) do not reproduce the reference step; ... param: ...
    beyond tolerance', blaming a sound state. The reference forms the two scalars in the lr's dtype where the run's
    implementation does (the fused kernel reads the lr as a double: unchanged)."""
    ck, grads, model, opt = _adamw_linear_with(
        tmp_path,
        lambda osd: None,
        lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2, dtype=dtype), weight_decay=0.1, **flags),
    )
    assert opt.param_groups[0]["lr"].dtype == dtype
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)
    res = run(ck, "--device", "cpu", "--grads", grads)  # one step: the one-pass native reference where built
    assert res.exit_code == 0, res.output
    res = run(ck, "--device", "cpu", "--grads", grads, "--steps", "2")  # the torch reference path
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("flags", [{}, {"foreach": False}], ids=["default", "for-loop"])
def test_a_half_precision_tensor_lr_beside_tensor_betas_matches_the_reference(tmp_path: Path, flags: dict) -> None:
    """A BF16 tensor lr beside FP32 tensor betas: torch's for-loop step divides the lr by 1 - beta1^t formed as an FP32
    tensor, so the step size is FP32 (the promoted dtype), not the lr's BF16. The formula reference rounded it to BF16
    and failed every parameter of a sound state: '[E700] 2 of 2 parameter(s) do not reproduce the reference step'.
    It now forms the step size as torch does; one step (native), three steps and the torch reference all pass."""
    betas = (torch.tensor(0.8), torch.tensor(0.95))
    ck, grads, model, opt = _adamw_linear_with(
        tmp_path,
        lambda osd: None,
        lambda p: torch.optim.AdamW(
            p, lr=torch.tensor(1e-2, dtype=torch.bfloat16), betas=betas, weight_decay=0.1, **flags
        ),
    )
    for extra in ([], ["--steps", "3"], ["--reference", "torch"]):
        res = run(ck, "--device", "cpu", "--grads", grads, *extra)
        assert res.exit_code == 0, (extra, res.output)
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lr", ["float", "bf16"])
@pytest.mark.parametrize("flags", [{}, {"fused": True}], ids=["for-loop", "fused"])
def test_half_precision_tensor_betas_match_the_reference(
    tmp_path: Path, dtype: torch.dtype, lr: str, flags: dict[str, bool]
) -> None:
    """AdamW(betas=(torch.tensor(0.9, dtype=torch.bfloat16), ...)): torch's for-loop step forms the bias corrections,
    sqrt(1 - beta2^t) and the step size lr / (1 - beta1^t) as tensors of the betas' dtype (8 bits for BF16). The
    formula reference formed them in float64 and failed every parameter of a sound state: '[E700] 2 of 2
    parameter(s) do not reproduce the reference step'. It forms them as torch does; one step (native), three steps
    and the torch reference all pass, and the replay is torch's own next step (the fused kernel reads the betas as
    doubles: unchanged)."""
    betas = (torch.tensor(0.9, dtype=dtype), torch.tensor(0.95, dtype=dtype))
    lr_value = 1e-2 if lr == "float" else torch.tensor(1e-2, dtype=torch.bfloat16)
    ck, grads, model, opt = _adamw_linear_with(
        tmp_path, lambda osd: None, lambda p: torch.optim.AdamW(p, lr=lr_value, betas=betas, weight_decay=0.1, **flags)
    )
    assert opt.param_groups[0]["betas"][1].dtype == dtype
    for extra in ([], ["--steps", "3"], ["--reference", "torch"]):
        res = run(ck, "--device", "cpu", "--grads", grads, *extra)
        assert res.exit_code == 0, (extra, res.output)
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)


@pytest.mark.parametrize("flags", [{}, {"fused": True}], ids=["single-tensor", "fused"])
def test_tensor_betas_replay_torchs_own_step_bitwise(tmp_path: Path, flags: dict[str, bool]) -> None:
    """torch.optim.AdamW(betas=(torch.tensor(0.9), torch.tensor(0.999))), which torch accepts and keeps as 0-d
    tensors (dcp.save stores the pair as a byte item of two tensors), was refused: '[E514] param group of weight:
    betas[0] is tensor(0.9000), expected a number'. The replay now takes the saved tensors, as the run computed
    1 - beta and the bias corrections with them (floats give steps an ulp away): torch's own next step, bitwise."""
    betas = (torch.tensor(0.8), torch.tensor(0.95))
    ck, grads, model, opt = _adamw_linear_with(
        tmp_path, lambda osd: None, lambda p: torch.optim.AdamW(p, lr=1e-2, betas=betas, weight_decay=0.1, **flags)
    )
    assert all(torch.is_tensor(b) for b in opt.param_groups[0]["betas"])
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)


def test_a_grad_scale_whose_gradients_overflow_is_an_option_error_not_a_failed_checkpoint(tmp_path: Path) -> None:
    """`--grad-scale 1e30` generates gradients whose squares overflow float32: exp_avg_sq of the step is infinite (in
    torch's step too), and replay-step said 'FAILED: 0 of 2 parameters match' with E700 'the saved optimizer state does
    not reproduce the next step; run ckpttool validate' (exit 1), blaming a sound checkpoint for the option. It is now
    E100 naming --grad-scale (exit 2, nothing on stdout), as a gradients file that overflows is E120; a scale whose
    largest generated value squares within float32 still replays OK."""
    ck, _, _, _ = _adamw_linear_with(tmp_path, lambda osd: None)
    for scale in ("1e30", "1e40"):
        res = run(ck, "--device", "cpu", "--grad-scale", scale)
        assert res.exit_code == 2 and res.stdout == "", (scale, res.output)
        assert res.stderr.startswith(f"error: [E100] --grad-scale {float(scale):g} makes the generated gradient of "), (
            res.stderr
        )
        assert "exp_avg_sq of the step would be infinite" in res.stderr
        assert_no_traceback(res)
    ok = run(ck, "--device", "cpu", "--grad-scale", "1e15", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"] is True, ok.output


@pytest.mark.parametrize("optimizer", ["AdamW", "Adam"])
def test_a_torch_26_group_with_weight_decay_warns_that_adam_looks_the_same(tmp_path: Path, optimizer: str) -> None:
    """Before 2.7 torch saved Adam's and AdamW's groups with the same entries (no decoupled_weight_decay), so a save
    of torch.optim.Adam(weight_decay=0.1) (L2 decay: another step) replayed as AdamW with 'OK' and not a word. It
    still replays as AdamW (the common case), with a warning naming the ambiguity; torch 2.7+ groups (the entry
    saved) and groups with weight_decay 0 (the same step either way) get none."""

    def as_torch_26(osd: dict[str, Any]) -> None:
        del osd["param_groups"][0]["decoupled_weight_decay"]

    make = getattr(torch.optim, optimizer)
    ck, grads, _, _ = _adamw_linear_with(tmp_path / "wd", as_torch_26, lambda p: make(p, lr=1e-2, weight_decay=0.1))
    res, _ = replay_collect(ck, grads=str(grads))
    warned = [n for n in res.notes if "before 2.7" in n]
    assert warned == [
        "warning: 2 parameter(s) (e.g. weight) are in param groups saved by torch before 2.7 with weight_decay 0.1 "
        "and no decoupled_weight_decay entry: torch.optim.Adam (L2 weight decay, another step) saves the same entries "
        "as AdamW; replayed as AdamW, which the run must have used"
    ], res.notes
    # `--filter` replays the selected parameters only: the warning counts those (it raised KeyError E999 on the others)
    filtered, _ = replay_collect(ck, grads=str(grads), filter_glob="bias")
    assert [n for n in filtered.notes if "before 2.7" in n] == [
        warned[0].replace("2 parameter(s) (e.g. weight)", "1 parameter(s) (e.g. bias)")
    ]
    ck0, grads0, _, _ = _adamw_linear_with(tmp_path / "wd0", as_torch_26, lambda p: make(p, lr=1e-2, weight_decay=0))
    assert not [n for n in replay_collect(ck0, grads=str(grads0))[0].notes if "before 2.7" in n]
    if optimizer == "AdamW":
        ck27, grads27, _, _ = _adamw_linear_with(tmp_path / "wd27", lambda osd: None)
        assert not [n for n in replay_collect(ck27, grads=str(grads27))[0].notes if "before 2.7" in n]


def test_state_of_a_tensor_in_no_group_and_not_in_the_model_is_a_skip(tmp_path: Path) -> None:
    """Optimizer state for an fqn that is neither a model tensor nor in a param group (validate's O003: a renamed or
    removed parameter) was passed over without a word: 'OK: 2 of 2 parameters match'. It was stepped and is not
    replayed: it is listed in params_skipped with a note, and the result is not OK (exit 1), as for the same state
    listed in a param group."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["state"]["old.weight"] = {k: v.clone() for k, v in osd["state"]["weight"].items()}

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads, "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["params_skipped"] == ["old.weight"] and doc["params_total"] == 2
    assert any("neither model tensors nor in a param group" in n and "old.weight" in n for n in doc["notes"])
    assert res.stderr.startswith(
        "error: [E700] 1 parameter(s) with saved optimizer state were not replayed (e.g. old.weight)"
    )
    assert res.stderr.splitlines()[1] == (  # no fused q/k/v here: --head-dim is not named
        "hint: not a mismatch: the notes say why they were left out and what replays them; or leave them out of the "
        "run with --filter"
    )
    # left out on purpose, it is not a skip
    assert run(ck, "--device", "cpu", "--grads", grads, "--filter", "weight").exit_code == 0


def test_a_parameter_listed_in_two_param_groups_is_refused(tmp_path: Path) -> None:
    """A saved optimizer whose param groups list one parameter twice with different lr (torch.optim refuses to build
    that; a bad merge of groups writes it) replayed with the first group's lr and said 'OK: 2 of 2'; validate --strict
    said OK too. Which lr stepped it is unknown: E514 (exit 2) names both groups; --filter leaves it out."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["param_groups"].append({**osd["param_groups"][0], "params": ["weight"], "lr": 0.5})

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines() == [
        "error: [E514] parameter weight is listed in param groups 0 (lr 0.01, weight_decay 0.1) and 1 (lr 0.5, "
        "weight_decay 0.1): torch.optim never builds a parameter into two groups, so which hyperparameters step it "
        "is unknown",
        "hint: the param groups were merged or edited wrongly; leave the parameter out with --filter",
    ]
    assert run(ck, "--device", "cpu", "--grads", grads, "--filter", "bias").exit_code == 0


def test_a_parameter_listed_twice_in_one_group_or_in_two_equal_groups_is_refused(tmp_path: Path) -> None:
    """Param groups listing a parameter twice in one group (torch.optim warns 'duplicate parameters' and steps it
    twice per optimizer step) or in two groups with equal hyperparameters (torch.optim refuses to build that) replayed
    it once and said 'OK: 2 of 2'. Which update the saved state leads to is unknown: E514 (exit 2) names the
    parameter and the group(s); --filter leaves it out."""

    def twice_in_group(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["params"].append("weight")

    def in_two_equal_groups(osd: dict[str, Any]) -> None:
        osd["param_groups"].append({**osd["param_groups"][0], "params": ["weight"]})

    hint = "hint: the param groups were merged or edited wrongly; leave the parameter out with --filter"
    for mutate, first in [
        (
            twice_in_group,
            "error: [E514] parameter weight is listed twice in param group 0: torch.optim steps a duplicated parameter "
            "twice per optimizer step (it warns 'duplicate parameters'), while a resume steps it once, so which "
            "update the saved state leads to is unknown",
        ),
        (
            in_two_equal_groups,
            "error: [E514] parameter weight is listed in param groups 0 and 1 (equal hyperparameters): torch.optim "
            "never builds a parameter into two groups, so whether the run stepped it once or twice per step is "
            "unknown",
        ),
    ]:
        ck, grads, _, _ = _adamw_linear_with(tmp_path / mutate.__name__, mutate)
        res = run(ck, "--device", "cpu", "--grads", grads)
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines() == [first, hint]
        assert run(ck, "--device", "cpu", "--grads", grads, "--filter", "bias").exit_code == 0


def test_a_fractional_saved_step_is_refused(tmp_path: Path) -> None:
    """A saved step of 2.5 (no torch optimizer counts so: its counter adds 1.0 to a whole number) replayed with bias
    corrections at step 3.5 and said 'OK: 2 of 2', as negative and NaN steps no longer did (E511)."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["step"] = torch.tensor(2.5)

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.startswith(
        "error: [E511] optimizer state weight.step is 2.5, not a count of steps taken (a finite whole number >= 0)\n"
    ), res.stderr
    assert_no_traceback(res)


@pytest.mark.parametrize(("step", "code"), [(1e30, 2), (2.0**24 + 2, 2), (2.0**24 - 1, 0)])
def test_a_float32_step_beyond_what_its_counter_reaches_is_refused(tmp_path: Path, step: float, code: int) -> None:
    """A float32 step of 1e30 replayed 'OK' (bias corrections of 1): torch's float32 counter adds 1.0 and stops at
    2^24 (2^24 + 1 rounds back to it), so no run counted past it. Beyond it is E511; below it the replay runs."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["state"]["weight"]["step"] = torch.tensor(step, dtype=torch.float32)

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == code, res.output
    if code:
        assert res.stderr.startswith(
            f"error: [E511] optimizer state weight.step is {float(torch.tensor(step, dtype=torch.float32)):g}, "
            "beyond what a float32 step counter reaches by adding 1.0 (16,777,216: 2^24 + 1 rounds back to 2^24)"
        ), res.stderr
        assert_no_traceback(res)


def test_reference_torch_says_which_parameters_it_does_not_cover(full_fx: Path) -> None:
    """`--reference torch` on a checkpoint of FP32-master AdamW (full_fp32_adamw) printed the same 'replay  1 step vs a
    float64 reference' line as without it and 'OK': nothing said the torch comparison asked for ran on no parameter.
    A note now names how many parameters it leaves to the formula reference and why."""
    res = run(full_fx / "ckpt", "--device", "cpu", "--reference", "torch")
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stdout.splitlines() if line.startswith("note ")]
    assert any(
        "--reference torch: 17 of 17 parameter(s) (full_fp32_adamw: an FP32 master torch.optim.AdamW does not keep) "
        "are compared with the formula reference only" in n
        for n in notes
    ), notes
    plain = run(full_fx / "ckpt", "--device", "cpu")
    assert "--reference torch" not in plain.stdout


def test_offload_options_that_no_parameter_uses_are_named(full_fx: Path, tmp_path: Path) -> None:
    """--offload-patterns and --chunk-size configure cpu_offload_adamw only; on a checkpoint whose layout record says
    full_fp32_adamw (or a torch.optim.AdamW one) they were dropped without a word and the report looked like an
    offload replay that passed. A warning note now says they were ignored and what would use them."""
    res = run(full_fx / "ckpt", "--device", "cpu", "--offload-patterns", "experts", "--chunk-size", "100")
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stdout.splitlines() if line.startswith("note ")]
    assert (
        "note        warning: --offload-patterns and --chunk-size ignored: options of cpu_offload_adamw, and the "
        "replay runs full_fp32_adamw (from layout record optimizer.type); --optimizer-type cpu_offload_adamw "
        "replays with them"
    ) in notes, notes
    res = run(
        full_fx / "ckpt", "--device", "cpu", "--offload-patterns", "experts", "--optimizer-type", "cpu_offload_adamw"
    )
    assert res.exit_code == 0, res.output
    assert "ignored" not in res.stdout
    ck, _, _, _ = _adamw_linear_with(tmp_path, lambda osd: None)
    doc = json.loads(run(ck, "--device", "cpu", "--chunk-size", "7", "--json").stdout)
    assert doc["ok"] is True and any(n.startswith("warning: `chunk_size` ignored") for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda st: st.pop("step"), "optimizer state lacks field(s) step (have exp_avg, exp_avg_sq)"),
        (lambda st: st.pop("exp_avg"), "optimizer state lacks field(s) exp_avg (have exp_avg_sq, step)"),
        (
            lambda st: st.__setitem__("max_exp_avg_sq", st["exp_avg_sq"].clone()),
            "unknown optimizer state field(s) max_exp_avg_sq",
        ),
    ],
)
def test_missing_or_unknown_fields_without_a_record_are_e510(tmp_path: Path, mutate: Any, message: str) -> None:
    """docs/replay.md: a missing or extra state field is E510. A torch.optim.AdamW checkpoint (no layout record, the
    type inferred from the fields) without its step, or with an extra field, was E511, the dtype-policy code."""

    def change(osd: dict[str, Any]) -> None:
        mutate(osd["state"]["weight"])

    ck, _, _, _ = _adamw_linear_with(tmp_path, change)
    res = run(ck, "--device", "cpu")
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.startswith(f"error: [E510] optimizer state of weight: {message}"), res.stderr
    assert_no_traceback(res)


def test_moments_reset_at_a_later_step_are_noted(tmp_path: Path) -> None:
    """exp_avg and exp_avg_sq zeroed at step 3 (a resume that re-initialised the optimizer but kept the step) replayed
    'OK' without a word: the update from zero moments looks sane. It is now a warning naming them (validate's D008);
    the replay itself still equals torch's own step from that state."""

    def mutate(osd: dict[str, Any]) -> None:
        for f in ("exp_avg", "exp_avg_sq"):
            osd["state"]["weight"][f].zero_()

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    res = run(ck, "--device", "cpu", "--grads", grads, "--reference", "torch", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    notes = [n for n in doc["notes"] if "all-zero exp_avg and exp_avg_sq" in n]
    assert notes == [
        "warning: 1 parameter(s) have all-zero exp_avg and exp_avg_sq at a saved step of 2 or more (moments reset, "
        "e.g. by a resume that re-initialised the optimizer but kept the step), e.g. weight at step 3; "
        "`ckpttool validate --deep` reports D008"
    ], doc["notes"]
    assert all(
        p["torch_unequal"] == dict.fromkeys(("param", "exp_avg", "exp_avg_sq", "step"), 0) for p in doc["params"]
    )
    clean, _, _, _ = _adamw_linear_with(tmp_path / "clean", lambda osd: None)
    doc = json.loads(run(clean, "--device", "cpu", "--json").stdout)
    assert not any("all-zero" in n for n in doc["notes"]), doc["notes"]


def test_sparse_adam_checkpoint_is_named_not_called_damaged(tmp_path: Path) -> None:
    """SparseAdam's group has no weight_decay (torch's own): replay-step said it 'lacks weight_decay' with the hint
    that the checkpoint must save it, as if damaged; it names SparseAdam now."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.01)
    model(torch.randint(0, 10, (3,))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    res = run(tmp_path / "ck", "--device", "cpu")
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        "error: [E514] param group of weight has no weight_decay (keys betas, eps, lr, maximize, params): it was "
        "saved by torch.optim.SparseAdam (state exp_avg, exp_avg_sq, step), not Adam/AdamW",
        "hint: replay-step replays AdamW steps only; `ckpttool validate` checks the torch.optim.SparseAdam state's "
        "fields and shapes, `ckpttool inspect` shows them",
    ], res.stderr


def test_a_param_group_lr_the_scheduler_moved_after_the_snapshot_is_not_ok(tmp_path: Path) -> None:
    """The optimizer state taken (get_state_dict) before the LR scheduler's step, the scheduler saved after it: the
    param group holds the lr of the step before, the scheduler's _last_lr the lr the run takes next, and every counter
    agrees (step 4, last_epoch 4). replay-step said 'OK: 2 of 2' though the step it replays (with the saved lr, as a
    resume takes it) is not the uninterrupted run's next step (torch.optim.AdamW after the scheduler stepped). It now
    fails naming the group and both lrs (exit 1), and validate reports R006; saved after the scheduler, both pass."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    def build(name: str, *, scheduler_after_snapshot: bool) -> tuple[Path, Path, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        train_steps(model, opt, 3, loss="square", sched=sched)
        train_steps(model, opt, 1, loss="square")  # step 4; its scheduler step below
        if not scheduler_after_snapshot:
            sched.step()
        msd, osd = get_state_dict(model, opt)
        if scheduler_after_snapshot:
            sched.step()
        save_quiet({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, tmp_path / name)
        gen = torch.Generator().manual_seed(7)
        grads = {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in model.named_parameters()}
        save_file(grads, str(tmp_path / f"{name}.safetensors"))
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()  # the uninterrupted run's next step, with the lr its scheduler set
        return tmp_path / name, tmp_path / f"{name}.safetensors", {n: p.detach() for n, p in model.named_parameters()}

    ck, grads, run_next = build("clean", scheduler_after_snapshot=False)
    res, got = replay_collect(ck, grads=str(grads))
    assert res.ok and not res.problems, res.problems
    assert all(torch.equal(got[n]["param"], want) for n, want in run_next.items())
    assert runner.invoke(app, ["validate", str(ck)]).exit_code == 0

    ck, grads, run_next = build("late", scheduler_after_snapshot=True)
    res, got = replay_collect(ck, grads=str(grads))
    assert not any(torch.equal(got[n]["param"], want) for n, want in run_next.items())  # not the run's next step
    assert not res.ok and res.problems == (
        "param group 0 saved lr 0.00125 but lr_scheduler._last_lr[0] = 0.000625: the LR scheduler moved the lr and "
        "the param groups were saved without it, so the replay and a resume step with an lr the run did not take its "
        "next step with (`ckpttool validate` reports R006)",
    ), res.problems
    cli = run(ck, "--device", "cpu", "--grads", grads)
    assert cli.exit_code == 1 and "param group 0 saved lr 0.00125 but lr_scheduler._last_lr[0] = 0.000625" in cli.stdout
    assert_no_traceback(cli)
    res = runner.invoke(app, ["validate", str(ck), "--json"])
    assert res.exit_code == 1
    findings = json.loads(res.stdout)["findings"]
    assert [(f["code"], f["key"], f["message"]) for f in findings if f["severity"] != "info"] == [
        (
            "R006",
            "optimizer.param_groups.0.lr",
            "param group 0 saved lr 0.00125 but lr_scheduler._last_lr[0] = 0.000625",
        )
    ]


def test_an_lr_set_by_hand_is_the_runs_own_without_a_scheduler_and_named_in_r006s_hint_with_one(tmp_path: Path) -> None:
    """A manual decay (``group['lr'] *= 0.5`` after each step). Without an LR scheduler the saved lr is the one the run
    steps with next: no R006, and replay-step reproduces torch's next step bitwise. On top of a StepLR the saved lr is
    not the scheduler's ``_last_lr`` and R006 reports it, as for groups saved before the scheduler's step (the saved
    numbers cannot tell the two apart); its hint said only to re-save: it now names the manual decay and
    ``--ignore R006``, with which validate passes."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    def build(name: str, scheduler: bool) -> tuple[Path, Path, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9) if scheduler else None
        for _ in range(3):
            train_steps(model, opt, 1, loss="square", sched=sched)
            for g in opt.param_groups:
                g["lr"] *= 0.5
        msd, osd = get_state_dict(model, opt)
        extra = {"lr_scheduler": sched.state_dict()} if sched is not None else {}
        save_quiet({"model": msd, "optimizer": osd, **extra}, tmp_path / name)
        grads = {n: torch.randn(p.shape) * 1e-2 for n, p in model.named_parameters()}
        save_file(grads, str(tmp_path / f"{name}.safetensors"))
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()  # the run's next step, with the lr set by hand
        return tmp_path / name, tmp_path / f"{name}.safetensors", {n: p.detach() for n, p in model.named_parameters()}

    ck, grads, run_next = build("manual", scheduler=False)
    res, got = replay_collect(ck, grads=str(grads))
    assert res.ok and not res.problems, res.problems
    assert all(torch.equal(got[n]["param"], want) for n, want in run_next.items())
    assert runner.invoke(app, ["validate", str(ck)]).exit_code == 0

    ck, _, _ = build("manual_on_scheduler", scheduler=True)
    res = runner.invoke(app, ["validate", str(ck), "--json"])
    assert res.exit_code == 1
    (r006,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "R006"]
    assert "sets the lr by hand after the scheduler's step" in r006["hint"] and "--ignore R006" in r006["hint"], r006
    assert runner.invoke(app, ["validate", str(ck), "--ignore", "R006"]).exit_code == 0


def test_a_step_counter_reset_to_0_beside_real_moments_is_not_ok(tmp_path: Path) -> None:
    """torch.optim.AdamW after one step saves step 1 with its moments; the same state with every step reset to 0
    (validate --deep: D007, 'non-zero at step 0') replayed 'OK: 2 of 2': the update of the first step it replays stayed
    within the update-size bound's slack (direction 1.1 against 1). A resume bias-corrects those moments as a first
    step; each parameter now fails naming the reset (exit 1), and the state as torch saved it still passes."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, opt, 1, loss="square")
    msd, osd = get_state_dict(model, opt)
    assert all(float(st["step"]) == 1 for st in osd["state"].values())
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "saved")
    for st in osd["state"].values():
        st["step"] = torch.zeros_like(st["step"])
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "reset")
    gen = torch.Generator().manual_seed(7)
    save_file({n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in model.named_parameters()}, str(tmp_path / "g"))
    assert run(tmp_path / "saved", "--device", "cpu", "--grads", tmp_path / "g").exit_code == 0
    res = run(tmp_path / "reset", "--device", "cpu", "--grads", tmp_path / "g", "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["params_failed"] == 2
    for p in doc["params"]:
        assert p["problems"][0] == (
            "saved step 0 with non-zero exp_avg and exp_avg_sq [D007]: the moments start at zero and change only in a "
            "step, which torch.optim counts at once, so the step counter was reset beside the moments of a real run "
            "(a resume bias-corrects them as a first step)"
        ), p["problems"]
    assert res.stderr.startswith("error: [E700] 2 of 2 parameter(s) do not reproduce the reference step; worst ")
    assert_no_traceback(res)
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "reset"), "--deep", "--json"]).stdout)
    assert {(f["code"], f["key"]) for f in found["findings"] if f["code"] == "D007"} == {
        ("D007", "optimizer.state.weight.exp_avg_sq"),
        ("D007", "optimizer.state.bias.exp_avg_sq"),
    }


def test_flattened_param_groups_saved_without_the_schedulers_lr_are_named(tmp_path: Path) -> None:
    """The flattened flavor (torchtitan's: one group entry per parameter, no group order) with a SequentialLR (warmup,
    then cosine) saved after both stepped passes; with the groups' lr put back to initial_lr (groups rebuilt from the
    config) each parameter's group is R006 and the replay fails (it said OK before)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 2)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [warmup, torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)], [2]
    )
    train_steps(model, opt, 5, loss="square", sched=sched)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    save_quiet({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, tmp_path / "clean")
    assert run(tmp_path / "clean", "--device", "cpu").exit_code == 0
    assert runner.invoke(app, ["validate", str(tmp_path / "clean")]).exit_code == 0
    rebuilt = {k: (osd[k.removesuffix(".lr") + ".initial_lr"] if k.endswith(".lr") else v) for k, v in osd.items()}
    save_quiet({"model": msd, "optimizer": rebuilt, "lr_scheduler": sched.state_dict()}, tmp_path / "rebuilt")
    res = run(tmp_path / "rebuilt", "--device", "cpu", "--json")
    assert res.exit_code == 1, res.output
    last = f"{sched.get_last_lr()[0]:g}"
    assert json.loads(res.stdout)["problems"] == [  # both groups alike: one problem, the catalog's first group named
        f"param group bias and 1 more saved lr 0.01 but lr_scheduler._last_lr = [{last}]: the LR scheduler moved the lr "
        "and the param groups were saved without it, so the replay and a resume step with an lr the run did not take "
        "its next step with (`ckpttool validate` reports R006)"
    ]
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "rebuilt"), "--json"]).stdout)["findings"]
    assert sorted(f["key"] for f in found if f["code"] == "R006") == [
        "optimizer.param_groups.bias.lr",
    ]


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("schedulers", [1, 2])
def test_r006_takes_each_optimizers_groups_to_their_own_scheduler(tmp_path: Path, flat: bool, schedulers: int) -> None:
    """Two AdamW optimizers of one model (lr 1e-3 and 0.02, as a Muon + AdamW pair keeps them), each with its own LR
    scheduler or only the first with one, saved after every step (get_state_dict of both, the schedulers as a list):
    R006 compared each group with a scheduler of the other optimizer and said every group's lr was unsaved (4 errors
    flattened, 2 nested). Saved as trained: no R006. The first optimizer's groups put back to their initial_lr: R006
    on those groups only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opts = [torch.optim.AdamW(model[0].parameters(), lr=1e-3), torch.optim.AdamW(model[1].parameters(), lr=0.02)]
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 1, gamma=0.5)]
    if schedulers == 2:
        scheds.append(torch.optim.lr_scheduler.LambdaLR(opts[1], lambda s: 1.0 / (s + 1)))
    for _ in range(3):
        model(torch.randn(2, 4)).square().sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    msd, osd = get_state_dict(model, opts, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    lr_scheduler = [s.state_dict() for s in scheds]
    save_quiet({"model": msd, "optimizer": osd, "lr_scheduler": lr_scheduler}, tmp_path / "saved")
    res = runner.invoke(app, ["validate", str(tmp_path / "saved"), "--json"])
    assert [f["code"] for f in json.loads(res.stdout)["findings"] if f["code"] == "R006"] == [], res.stdout
    if flat:
        first = [k for k in osd if k.startswith("param_groups.0.") and k.endswith(".lr")]
        rebuilt = {k: (osd[k.removesuffix(".lr") + ".initial_lr"] if k in first else v) for k, v in osd.items()}
        assert len(first) == 2  # alike (both at their initial_lr): one finding, the first group named, "and 1 more"
        want = sorted(f"optimizer.{k}" for k in first)[:1]
    else:
        rebuilt = {**osd, "param_groups": [{**g} for g in osd["param_groups"]]}
        rebuilt["param_groups"][0]["lr"] = rebuilt["param_groups"][0]["initial_lr"]
        want = ["optimizer.param_groups.0.lr"]
    save_quiet({"model": msd, "optimizer": rebuilt, "lr_scheduler": lr_scheduler}, tmp_path / "rebuilt")
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "rebuilt"), "--json"]).stdout)["findings"]
    assert sorted(f["key"] for f in found if f["code"] == "R006") == want, found
    assert all(("and 1 more" in f["message"]) == flat for f in found if f["code"] == "R006"), found


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
def test_r006_reads_reduce_lr_on_plateau(tmp_path: Path, flat: bool) -> None:
    """torch's ReduceLROnPlateau puts no initial_lr into its optimizer's groups, so R006 left every group of it out:
    AdamW whose plateau scheduler halved the lr at each of 7 steps (1e-2 to 1.5625e-4), saved with the groups' lr put
    back to the config's 1e-2 (groups rebuilt from the config), passed validate and replay-step, and a resume would
    step at 64 times the run's lr. Now R006 and a replay problem name each group; saved as trained, both pass."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        sched.step(1.0)  # a validation loss that never improves
    assert sched.get_last_lr() == [1e-2 / 64] and "initial_lr" not in opt.param_groups[0]
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 7}}
    save_quiet(state, tmp_path / "saved")
    assert run(tmp_path / "saved", "--device", "cpu").exit_code == 0
    res = runner.invoke(app, ["validate", str(tmp_path / "saved"), "--strict", "--deep", "--json"])
    assert res.exit_code == 0, res.stdout
    if flat:
        rebuilt = {k: (1e-2 if k.endswith(".lr") else v) for k, v in osd.items()}
        want = ["optimizer.param_groups.bias.lr"]  # both groups alike: one finding
    else:
        rebuilt = {**osd, "param_groups": [{**g, "lr": 1e-2} for g in osd["param_groups"]]}
        want = ["optimizer.param_groups.0.lr"]
    save_quiet({**state, "optimizer": rebuilt}, tmp_path / "rebuilt")
    res = run(tmp_path / "rebuilt", "--device", "cpu", "--json")
    assert res.exit_code == 1, res.output
    assert all(
        "saved lr 0.01 but lr_scheduler._last_lr" in p and "0.00015625" in p and "R006" in p
        for p in json.loads(res.stdout)["problems"]
    ), res.stdout
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "rebuilt"), "--json"]).stdout)["findings"]
    assert sorted(f["key"] for f in found if f["code"] == "R006") == want, found


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
def test_r006_leaves_an_undriven_optimizer_beside_reduce_lr_on_plateau(tmp_path: Path, flat: bool) -> None:
    """Two AdamW optimizers (lr 1e-2 for the matrices, 1e-3 for the rest, as a Muon + AdamW split keeps them), a
    ReduceLROnPlateau on the first only, saved as trained: the flattened save's groups of the second optimizer
    (no scheduler, no initial_lr) were taken for the plateau scheduler's and each was R006 (saved lr 0.001 but
    _last_lr = [1e-05]). No R006 now, nested or flattened."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    opts = [
        torch.optim.AdamW(matrices, lr=1e-2),
        torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-3),
    ]
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opts[0], patience=0)
    for _ in range(4):
        model(torch.randn(3, 4)).square().sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        sched.step(1.0)
    msd, osd = get_state_dict(model, opts, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    save_quiet({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, tmp_path / "saved")
    res = runner.invoke(app, ["validate", str(tmp_path / "saved"), "--json"])
    assert [f["key"] for f in json.loads(res.stdout)["findings"] if f["code"] == "R006"] == [], res.stdout


#: An OptimizerParamScheduler's arguments (megatron-core's and NeMo Automodel's copy take the same): warmup 2 steps
#: from 0, decay to step 10, constant weight decay.
_PARAM_SCHEDULER_ARGS: dict[str, Any] = {
    "init_lr": 0.0,
    "max_lr": 1e-2,
    "min_lr": 1e-4,
    "lr_warmup_steps": 2,
    "lr_decay_steps": 10,
    "start_wd": 0.1,
    "end_wd": 0.1,
    "wd_incr_steps": 10,
    "wd_incr_style": "constant",
}


def _megatron_scheduler(opt: Any, style: str = "cosine") -> Any:
    """megatron-core's own OptimizerParamScheduler over a torch optimizer (:data:`_PARAM_SCHEDULER_ARGS`)."""
    sched = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    return sched.OptimizerParamScheduler(opt, lr_decay_style=style, **_PARAM_SCHEDULER_ARGS)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
def test_param_scheduler_lr_is_megatrons_own(style: str) -> None:
    """counters.param_scheduler_lr, from the saved state alone, is the lr megatron-core's OptimizerParamScheduler sets
    at each step past its warmup and beyond its decay (a group's own max_lr/min_lr included); None in the warmup,
    whose start (init_lr) is not saved."""
    from ckpttool.model.counters import param_scheduler_lr

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [], "max_lr": 3e-3, "min_lr": 0.0}], lr=1e-2)
    sched = _megatron_scheduler(opt, style)
    for n in range(1, 13):
        sched.step(1)
        state = sched.state_dict()
        for g in opt.param_groups:
            got = param_scheduler_lr(state, g)
            assert (got is None) if n <= 2 else got == pytest.approx(g["lr"], rel=1e-12, abs=0), (n, got, g)


def test_r006_reads_a_megatron_style_param_scheduler(tmp_path: Path) -> None:
    """A loop with megatron-core's OptimizerParamScheduler (its state: max_lr, num_steps, lr_decay_style, ...; no
    _last_lr, no initial_lr in the groups) over AdamW, saved with dcp.save after 7 steps, passes validate --strict
    --deep and replay-step. Its scheduler state of step 5 beside the rest of step 7 (the lr a resume continues from is
    step 5's), or the groups' lr put back to the config's, passed both; each is R006 now, and a replay problem."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = _megatron_scheduler(opt)
    states = {}
    for n in range(1, 8):
        train_steps(model, opt, 1, loss="square")
        sched.step(1)
        states[n] = sched.state_dict()
    msd, osd = get_state_dict(model, opt)
    saved = {"model": msd, "optimizer": osd, "lr_scheduler": states[7], "train_state": {"step": 7}}
    save_quiet(saved, tmp_path / "saved")
    res = runner.invoke(app, ["validate", str(tmp_path / "saved"), "--strict", "--deep", "--json"])
    assert res.exit_code == 0, res.stdout
    assert run(tmp_path / "saved", "--device", "cpu").exit_code == 0
    lr7 = f"{opt.param_groups[0]['lr']:g}"
    rebuilt = {**osd, "param_groups": [{**g, "lr": 1e-2} for g in osd["param_groups"]]}
    for name, state, msg in [
        (
            "stale",
            {**saved, "lr_scheduler": states[5]},
            f"saved lr {lr7} but lr_scheduler sets 0.00694428 at num_steps = 5",
        ),
        ("rebuilt", {**saved, "optimizer": rebuilt}, f"saved lr 0.01 but lr_scheduler sets {lr7} at num_steps = 7"),
    ]:
        save_quiet(state, tmp_path / name)
        found = json.loads(runner.invoke(app, ["validate", str(tmp_path / name), "--json"]).stdout)["findings"]
        assert [(f["code"], f["key"], f["message"]) for f in found if f["code"] == "R006"] == [
            ("R006", "optimizer.param_groups.0.lr", f"param group 0 {msg} (lr_decay_style cosine)")
        ], found
        res = run(tmp_path / name, "--device", "cpu", "--json")
        assert res.exit_code == 1 and msg in json.loads(res.stdout)["problems"][0], res.output


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
def test_r006_takes_a_warmup_then_plateau_on_one_optimizer(tmp_path: Path, flat: bool) -> None:
    """A LinearLR warmup for 3 steps, then ReduceLROnPlateau on the same AdamW (halving the lr at each of 5 steps,
    1e-2 to 6.25e-4), both saved: the groups carry the warmup's initial_lr and the plateau's lr, and the warmup's
    _last_lr stays at 1e-2. The clean save was R006 'saved lr 0.000625 but lr_schedulers.warmup._last_lr[0] = 0.01'
    and a replay problem; it passes both. The groups saved before the plateau's last step (lr 0.00125) are R006."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for i in range(8):
        opt.zero_grad()
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        if i < 3:
            warmup.step()
        else:
            plateau.step(1.0)  # a validation loss that never improves
    assert plateau.get_last_lr() == pytest.approx([1e-2 / 16]) and warmup.get_last_lr() == pytest.approx([1e-2])
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    schedulers = {"warmup": warmup.state_dict(), "plateau": plateau.state_dict()}
    state = {"model": msd, "optimizer": osd, "lr_schedulers": schedulers, "train_state": {"step": 8}}
    save_quiet(state, tmp_path / "saved")
    res = run(tmp_path / "saved", "--device", "cpu")
    assert res.exit_code == 0, res.output
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "saved"), "--deep", "--json"]).stdout)["findings"]
    assert not [f for f in found if f["code"] == "R006"], found
    if flat:
        late = {k: (2e-2 / 16 if k.endswith(".lr") else v) for k, v in osd.items()}
        want = ["optimizer.param_groups.bias.lr"]  # both groups alike: one finding
    else:
        late = {**osd, "param_groups": [{**g, "lr": 2e-2 / 16} for g in osd["param_groups"]]}
        want = ["optimizer.param_groups.0.lr"]
    save_quiet({**state, "optimizer": late}, tmp_path / "late")
    assert run(tmp_path / "late", "--device", "cpu").exit_code == 1
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "late"), "--json"]).stdout)["findings"]
    assert sorted(f["key"] for f in found if f["code"] == "R006") == want, found


def test_r006_takes_a_frozen_group_of_nemo_automodels_param_scheduler(tmp_path: Path) -> None:
    """NeMo Automodel's OptimizerParamScheduler sets each group's lr to its schedule times the group's lr_mult, which
    it takes as the group's constructed lr over group 0's: a group built with lr 0 (frozen) has lr_mult 0 and keeps lr
    0. That clean save was R006 'param group 1 saved lr 0 but lr_scheduler sets 0.00315572' (an lr_mult of 0 was read
    as none); it passes validate --strict --deep. Group 0's lr put back to the config's is still R006."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    scheduler = pytest.importorskip("nemo_automodel.components.optim.scheduler")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    groups = [{"params": [model.weight], "lr": 1e-2}, {"params": [model.bias], "lr": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    sched = scheduler.OptimizerParamScheduler(opt, lr_decay_style="cosine", **_PARAM_SCHEDULER_ARGS)
    for _ in range(7):
        train_steps(model, opt, 1, loss="square")
        sched.step(1)
    assert opt.param_groups[1]["lr"] == 0.0 and opt.param_groups[1]["lr_mult"] == 0.0
    msd, osd = get_state_dict(model, opt)
    saved = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 7}}
    save_quiet(saved, tmp_path / "saved")
    res = runner.invoke(app, ["validate", str(tmp_path / "saved"), "--strict", "--deep", "--json"])
    assert res.exit_code == 0, res.stdout
    rebuilt = {**osd, "param_groups": [{**osd["param_groups"][0], "lr": 1e-2}, osd["param_groups"][1]]}
    save_quiet({**saved, "optimizer": rebuilt}, tmp_path / "rebuilt")
    found = json.loads(runner.invoke(app, ["validate", str(tmp_path / "rebuilt"), "--json"]).stdout)["findings"]
    assert [f["key"] for f in found if f["code"] == "R006"] == ["optimizer.param_groups.0.lr"], found
