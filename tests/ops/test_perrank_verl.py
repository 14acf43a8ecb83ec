"""verl FSDP per-rank checkpoints (tests/fixtures/perrank.py: verl's own FSDPCheckpointManager, 1 and 2 gloo ranks).

Answers are checked against what torch gathers from the live FSDP2 model and optimizer
(``DTensor.full_tensor``) and, for export, against transformers logits of that model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.checkpoint import open_checkpoint
from tests.fixtures import damage
from tests.fixtures.cache import cached_build

runner = CliRunner()


# verl's own FSDPCheckpointManager save is built on 1 and 2 gloo ranks (~1 min on a 2-core machine): the
# full run (README) covers verl; CI keeps torch-checkpointing's per-rank format (tests/ops/test_perrank_torch_checkpointing.py)
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="session")
def verl_root(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("ray") is None:
        pytest.skip(
            "verl is not installed (pip install --no-deps verl==0.9.1 ray==2.60.0 tensordict==0.15.3, as .ci/run does)"
        )
    return cached_build(fixture_root, "perrank_verl", perrank.build_verl)


def _actor(root: Path, world: int) -> Path:
    return root / f"w{world}" / "global_step_2" / "actor"


@pytest.mark.parametrize("world", [1, 2])
def test_assembled_tensors_equal_torch_gathered(verl_root: Path, world: int) -> None:
    import torch

    ref = torch.load(verl_root / f"w{world}" / "reference.pt", weights_only=False)
    with open_checkpoint(_actor(verl_root, world)) as ck:
        assert ck.catalog.schema.id == "verl"
        assert set(ck.catalog.model) == {f"model.{k}" for k in ref["model"]}
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["names"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg_sq"), ref["exp_avg_sq"][k]), k
            assert float(ck.reader.read_tensor(f"optimizer.state.{k}.step")) == ref["step"][k]
            assert ck.reader.read_object(f"optimizer.param_groups.{k}.lr") == ref["lr"]
        assert ck.reader.read_object("lr_scheduler.last_epoch") == 2
        if world == 2:
            chunks = ck.metadata.entries["model.model.embed_tokens.weight"].chunks
            assert [c.offsets for c in chunks] == [(0, 0), (32, 0)]


def test_equal_to_verls_own_model_merger(verl_root: Path) -> None:
    """verl's model_merger (FSDP backend) merges the same rank files; ckpttool assembles the same tensors."""
    import torch
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    actor = _actor(verl_root, 2)
    cfg = ModelMergerConfig(
        operation="merge", backend="fsdp", local_dir=str(actor), hf_model_config_path=str(actor / "huggingface")
    )
    m = FSDPModelMerger(cfg)
    world = m._get_world_size()
    mesh, names = m._extract_device_mesh_info(m._load_rank_zero_state_dict(world), world)
    total, shape = m._calculate_shard_configuration(mesh, names)
    merged = m._load_and_merge_state_dicts(world, total, shape, names)
    with open_checkpoint(actor) as ck:
        assert set(ck.catalog.model) == {f"model.{k}" for k in merged}
        for k, t in merged.items():  # the merger casts to the config's dtype (bfloat16)
            assert torch.equal(ck.reader.read_tensor(f"model.{k}").to(t.dtype), t), k


@pytest.mark.parametrize("where", ["run", "step", "actor"])
def test_found_from_run_root_step_dir_and_actor(verl_root: Path, where: str) -> None:
    actor = _actor(verl_root, 2)
    given = {"run": verl_root / "w2", "step": actor.parent, "actor": actor}[where]
    res = runner.invoke(app, ["inspect", "--json", str(given)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["location"]["model"] == str(actor)  # never actor/huggingface
    assert "verl-fsdp" in doc["location"]["how"]


def test_inspect_names_the_format_not_a_command_line_override(verl_root: Path) -> None:
    actor = _actor(verl_root, 2)
    res = runner.invoke(app, ["inspect", str(actor)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert "dcp version -; per-rank files (not DCP)" in lines
    assert "key schema  verl (format): model 'model.', optimizer 'optimizer.' by fqn, hf names; adapter hf" in lines
    assert "            - implied by the format (verl-fsdp per-rank files): 21 model tensor(s)" in lines
    assert "command line" not in res.stdout and "safetensors storage" not in res.stdout
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(actor)]).stdout)
    assert (doc["serialization"], doc["key_schema"]["source"]) == ("per_rank", "format")
    # the rank each file was saved by (verl's *_rank_R.pt), not [] / null as when read from __R_N.distcp names only
    assert doc["summary"]["ranks"] == [0, 1] and "files       5 data files from ranks 0,1, " in res.stdout
    assert all(f["rank"] == int(f["path"].rsplit("_rank_", 1)[1][:-3]) for f in doc["files"]), doc["files"]


def test_validate_strict_deep_ok_and_reads_training_state(verl_root: Path) -> None:
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(_actor(verl_root, 2))])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ok"] is True


def test_rank_file_copied_over_another_is_refused(verl_root: Path, tmp_path: Path) -> None:
    """Rank 0's model file copied over rank 1's: each DTensor names mesh coordinate 0 twice, so rank 1's
    rows are held by no file. Every reader refuses it (E280) and validate lists each tensor (S004)."""
    actor = shutil.copytree(_actor(verl_root, 2), tmp_path / "actor")
    shutil.copyfile(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_2_rank_1.pt")
    before = (actor / "model_world_size_2_rank_1.pt").read_bytes()
    for cmd in (["inspect"], ["manifest"], ["stats"], ["export", str(tmp_path / "out")]):
        res = runner.invoke(app, [cmd[0], str(actor), *cmd[1:]])
        assert res.exit_code == 2, (cmd, res.output)
        assert res.stderr.startswith(
            f"error: [E280] {actor}: the rank files' shards do not tile 21 tensor(s): "
            "model.model.embed_tokens.weight: gap: no chunk covers [32, 64) of dim 0 (and 20 more); "
            "model_world_size_2_rank_0.pt and model_world_size_2_rank_1.pt hold the same shards\n"
        ), res.stderr
        assert res.stdout == ""
    assert not (actor / "manifest.json").exists() and not (tmp_path / "out").exists()
    res = runner.invoke(app, ["validate", str(actor), "--json"])
    assert res.exit_code == 1
    s004 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "S004"]
    assert len(s004) == 21 and all("gap" in f["message"] for f in s004)
    assert (actor / "model_world_size_2_rank_1.pt").read_bytes() == before


def test_missing_rank_file_is_incomplete(verl_root: Path, tmp_path: Path) -> None:
    actor = shutil.copytree(_actor(verl_root, 2), tmp_path / "actor")
    (actor / "optim_world_size_2_rank_1.pt").unlink()
    res = runner.invoke(app, ["validate", str(actor)])
    assert res.exit_code != 0
    assert "E202" in res.output and "optimizer files of ranks [1]" in res.output


def test_replicas_that_differ_are_refused(verl_root: Path, tmp_path: Path) -> None:
    import torch

    actor = shutil.copytree(_actor(verl_root, 2), tmp_path / "actor")
    with open_checkpoint(actor) as ck:
        assert ck.metadata.entries["optimizer.state.lm_head.weight.step"].chunks  # type: ignore[union-attr]
    other = actor / "optim_world_size_2_rank_1.pt"
    sd = torch.load(other, weights_only=False)
    sd["state"][0]["step"] = torch.tensor(5.0)
    torch.save(sd, other)
    res = runner.invoke(app, ["inspect", str(actor)])
    assert res.exit_code != 0
    assert "E280" in res.output and "replicated shards differ" in res.output
    res = runner.invoke(app, ["validate", str(actor), "--json"])  # validate: a finding, the other rules still run
    assert res.exit_code == 1
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "D014"]
    assert [f["key"] for f in found] == ["optimizer.state.model.embed_tokens.weight.step"], found  # state[0]
    msg = found[0]["message"]  # in the order of the files it names: rank 1's value against rank 0's
    assert "optim_world_size_2_rank_1.pt against " in msg and "optim_world_size_2_rank_0.pt" in msg, msg
    assert "1 of 1 elements differ (max |diff| 3); first at element 0: 5 against 2" in msg


def test_export_names_the_saved_hf_config_and_the_dtype_fix(verl_root: Path, tmp_path: Path) -> None:
    actor = _actor(verl_root, 2)
    res = runner.invoke(app, ["export", str(verl_root / "w2"), str(tmp_path / "a"), "--quantize", "fp8-block"])
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines()[0] == f"note: source {actor} (the only checkpoint below the directory given)"
    assert res.stderr.splitlines()[1] == (
        f"note: {tmp_path / 'a'} holds no config.json (no --model-assets): transformers' from_pretrained needs one "
        "(and the fp8-block weights' quantization_config goes into it: vLLM cannot load them without it); pass "
        "--model-assets DIR, the folder of the model's config.json and tokenizer files (the trainer saved one "
        f"beside the checkpoint: --model-assets {actor / 'huggingface'})"
    )
    # --json carries the folder (no note beside the document); none once --model-assets is given
    res = runner.invoke(app, ["export", str(verl_root / "w2"), str(tmp_path / "c"), "--dry-run", "--json"])
    assert (
        res.exit_code == 0 and res.stderr == f"note: source {actor} (the only checkpoint below the directory given)\n"
    )
    assert json.loads(res.stdout)["config_beside"] == str(actor / "huggingface")
    res = runner.invoke(
        app,
        [
            "export",
            str(actor),
            str(tmp_path / "d"),
            "--json",
            "--dry-run",
            "--model-assets",
            str(actor / "huggingface"),
            "--save-dtype",
            "bfloat16",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config_beside"] is None
    # verl's config says bfloat16 over float32 shards: the hint names both ways out
    res = runner.invoke(app, ["export", str(actor), str(tmp_path / "b"), "--model-assets", str(actor / "huggingface")])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E605]")
    assert res.stderr.splitlines()[1] == (
        "hint: only the dtype differs: --save-dtype bfloat16 writes the dtype config.json names; "
        "--allow-mismatch dtype writes the tensors as stored"
    )


def test_export_matches_transformers_logits(verl_root: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    actor = _actor(verl_root, 2)
    out = tmp_path / "hf"
    res = runner.invoke(
        app, ["export", str(actor), str(out), "--model-assets", str(actor / "huggingface"), "--allow-mismatch", "dtype"]
    )
    assert res.exit_code == 0, res.output
    ref = torch.load(verl_root / "w2" / "reference.pt", weights_only=False)
    cfg = AutoConfig.from_pretrained(actor / "huggingface")
    want = LlamaForCausalLM(cfg).float()
    want.load_state_dict(ref["model"])
    got = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_unsafe_global_in_a_rank_file_is_refused(verl_root: Path, tmp_path: Path) -> None:
    import torch

    actor = shutil.copytree(_actor(verl_root, 1), tmp_path / "actor")
    extra = actor / "extra_state_world_size_1_rank_0.pt"
    torch.save({"lr_scheduler": None, "rng": {"x": Path("/etc")}}, extra)
    res = runner.invoke(app, ["inspect", str(actor)])
    assert res.exit_code != 0
    assert "E201" in res.output and "pathlib" in res.output


def test_verl_and_torch_checkpointing_saves_of_one_training_are_equal(verl_root: Path, fixture_root: Path) -> None:
    """The two fixtures train the same model with the same seeds: diff across the formats is bitwise equal."""
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed")
    tc = cached_build(fixture_root, "perrank_torch_checkpointing", perrank.build_torch_checkpointing)
    res = runner.invoke(app, ["diff", "--json", str(_actor(verl_root, 2)), str(tc / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["equal"] is True
    args = ["diff", "--json", "--what", "all", str(_actor(verl_root, 2)), str(tc / "w2st" / "step-2")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["equal"] is True
    # rank 0's extra_state holds the lr_scheduler diff compared (beside its rng, which it did not); rank 1's copy and
    # torch-checkpointing's lr_scheduler_1.pt were not read
    assert report["notes"] == [
        "files beside the checkpoint, not compared as items: 6 only in A (extra_state_world_size_2_rank_0.pt (its "
        "lr_scheduler compared, the rest not), extra_state_world_size_2_rank_1.pt, fsdp_config.json, "
        "huggingface/config.json, huggingface/generation_config.json, ... (+1 more))",
        "files beside the checkpoint, not compared as items: 2 only in B (lr_scheduler_1.pt, metadata.pkl)",
    ]


def test_frozen_parameters_are_not_lost_state(verl_root: Path) -> None:
    """frozen/: FROZEN saved with requires_grad=False by verl's own manager; verl's build_optimizer lists
    them in the param group, torch's AdamW never gives them state. Not an error: listed as frozen (K021)."""
    import torch

    from tests.fixtures.perrank import FROZEN

    actor = verl_root / "frozen" / "global_step_2" / "actor"
    ref = torch.load(verl_root / "frozen" / "reference.pt", weights_only=False)
    assert set(ref["exp_avg"]) == set(ref["names"]) - set(FROZEN)  # torch's own optimizer: no state for them
    with open_checkpoint(actor) as ck:
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["exp_avg"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
        assert ck.catalog.frozen == frozenset(FROZEN)
        assert "2 frozen parameter(s)" in ck.located.described
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(actor)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ok"] is True and not [f for f in doc["findings"] if f["code"] == "O009"]
    (k021,) = [f for f in doc["findings"] if f["code"] == "K021"]
    assert all(n in k021["message"] for n in FROZEN)


def test_replay_step_skips_frozen_parameters_and_says_so(verl_root: Path) -> None:
    from tests.fixtures.perrank import FROZEN

    actor = verl_root / "frozen" / "global_step_2" / "actor"
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(actor)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ok"] is True and doc["params_frozen"] == list(FROZEN)
    assert doc["params_total"] == 21 - len(FROZEN) and not {p["fqn"] for p in doc["params"]} & set(FROZEN)
    res = runner.invoke(app, ["replay-step", "--device", "cpu", str(actor)])
    assert "2 frozen parameter(s) (no optimizer state) not replayed" in res.output


def test_state_missing_on_one_rank_is_not_frozen(verl_root: Path, tmp_path: Path) -> None:
    """State dropped from one rank's optimizer file leaves a hole in the assembled moments: an error."""
    import torch

    actor = shutil.copytree(verl_root / "w2" / "global_step_2" / "actor", tmp_path / "actor")
    other = actor / "optim_world_size_2_rank_1.pt"
    sd = torch.load(other, weights_only=False)
    del sd["state"][3]
    torch.save(sd, other)
    res = runner.invoke(app, ["validate", "--json", str(actor)])
    assert res.exit_code != 0, res.output


@pytest.mark.parametrize("field", ["step", "exp_avg_sq"])
def test_a_state_field_lost_on_one_rank_is_refused(verl_root: Path, tmp_path: Path, field: str) -> None:
    """One rank's optimizer file whose state of a parameter lacks a field the other rank saved (its step, read as a
    replica from rank 0's): replay-step said OK over the lost step and validate --deep passed, while that rank's
    optimizer fails on its first step after the resume; now E280 naming the rank file, the parameter and both fields."""
    import torch

    actor = shutil.copytree(verl_root / "w2" / "global_step_2" / "actor", tmp_path / "actor")
    other = actor / "optim_world_size_2_rank_1.pt"
    sd = torch.load(other, weights_only=False)
    del sd["state"][3][field]
    torch.save(sd, other)
    for cmd in (["replay-step", "--device", "cpu"], ["validate", "--deep"]):
        res = runner.invoke(app, [*cmd, str(actor)])
        assert res.exit_code in (1, 2) and "OK" not in res.stdout.splitlines()[-1:], res.output
        line = next(ln for ln in res.stderr.splitlines() if ln.startswith("error:"))
        assert line.startswith("error: [E280] ") and "optim_world_size_2_rank_1.pt: optimizer state of 'model." in line
        assert "optim_world_size_2_rank_0.pt has exp_avg, exp_avg_sq, step" in line
        assert "every rank saves the same state fields" in res.stderr


def test_replay_of_optimizer_state_from_another_save_than_the_scheduler_is_not_ok(
    verl_root: Path, tmp_path: Path
) -> None:
    """verl saves no trainer step: the LR scheduler's last_epoch (stepped once per training step) and the step
    directory global_step_N are the run's counters. A scheduler one step ahead (extra_state of another save) passed
    replay-step, "OK", while validate --deep reported R002; replay now says it is of another save, exit 1."""
    import torch

    actor = shutil.copytree(verl_root / "w2" / "global_step_2", tmp_path / "global_step_2") / "actor"
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(actor)])
    assert res.exit_code == 0 and json.loads(res.stdout)["problems"] == [], res.output
    for rank in (0, 1):
        f = actor / f"extra_state_world_size_2_rank_{rank}.pt"
        sd = torch.load(f, weights_only=False)
        assert sd["lr_scheduler"]["last_epoch"] == 2
        sd["lr_scheduler"]["last_epoch"], sd["lr_scheduler"]["_step_count"] = 3, 4
        torch.save(sd, f)
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(actor)])
    assert res.exit_code == 1, res.output
    (problem,) = json.loads(res.stdout)["problems"]
    assert problem.startswith(
        "lr_scheduler.last_epoch = 3 but its directory is global_step_2 (step 2; a save there holds step 2 or less): "
        "the LR scheduler is of another save than its step directory"
    ), problem
    res = runner.invoke(app, ["validate", "--deep", "--json", str(actor)])
    assert "R002" in [f["code"] for f in json.loads(res.stdout)["findings"]], res.output


def test_run_prefix_on_s3_names_the_verl_folder(verl_root: Path, s3_server: Any) -> None:
    """The run prefix on S3 (moto server): the verl actor folder below it is named, with what is unsupported."""
    import uuid

    url = s3_server.upload_dir(verl_root / "w1", "ckpts", f"verl-{uuid.uuid4().hex[:8]}")
    res = runner.invoke(app, [*s3_server.cli_options(), "validate", url])
    assert res.exit_code == 2, res.output
    assert f"{url}/global_step_2/actor: a verl-fsdp per-rank checkpoint" in res.output.replace("\n", "")
    assert "E280" in res.output


def test_a_flipped_byte_in_a_rank_file_fails_its_crc(verl_root: Path, tmp_path: Path) -> None:
    """A shard whose window is its whole torch.save record is checked against the record's zip CRC-32,
    as a DCP chunk is: one byte changed inside it is a checksum error in every command that reads it."""
    actor = shutil.copytree(_actor(verl_root, 2), tmp_path / "actor")
    with open_checkpoint(actor) as ck:
        members = ck.reader.assembled.members  # type: ignore[attr-defined]
        whole = {(rel, off): m for (rel, off), m in members.items() if rel == "model_world_size_2_rank_1.pt"}
        keys = [k for (k, _), info in ck.metadata.storage.items() if (info.relative_path, info.offset) in whole]
    assert whole and keys
    (rel, off), m = next(iter(whole.items()))
    path = actor / rel
    data = bytearray(path.read_bytes())
    data[off + m.size // 2] ^= 0x10
    path.write_bytes(bytes(data))
    res = runner.invoke(app, ["validate", str(actor), "--deep", "--json"])
    assert res.exit_code == 1, res.output
    codes = {f["code"] for f in json.loads(res.stdout)["findings"]}
    assert "S014" in codes, codes
    for args in (["export", str(actor), str(tmp_path / "hf")], ["stats", str(actor)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and "fails its CRC-32 check" in res.stderr, (args, res.output)
        assert "Traceback" not in res.output
    assert not (tmp_path / "hf").exists()


def test_no_optimizer_state_after_steps_fails_r002(verl_root: Path, tmp_path: Path) -> None:
    """Every rank's optimizer file holding its param groups and no state (the ``state_dict()`` of an optimizer
    rebuilt before the save: it never stepped) beside an LR scheduler at ``last_epoch`` 2: every parameter
    read as frozen / a never-stepped leaf, and validate --strict --deep passed a resume that restarts the
    moments from zero. Now R002 names it and replay-step fails on it; the real save passes both."""
    import torch

    # the step directory (w2/ holds no latest_checkpointed_iteration.txt: from there R008 fails --strict)
    real = verl_root / "w2" / "global_step_2"
    doc = json.loads(runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(real)]).stdout)
    assert doc["ok"] and "R002" not in {f["code"] for f in doc["findings"]}
    run = shutil.copytree(verl_root / "w2", tmp_path / "w2")
    actor = run / "global_step_2" / "actor"
    for rank in (0, 1):
        path = actor / f"optim_world_size_2_rank_{rank}.pt"
        saved = torch.load(path, weights_only=False)
        saved["state"] = {}
        torch.save(saved, path)
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(run)])
    assert res.exit_code == 1, res.output
    (r002,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "R002"]
    assert r002["key"] == "optimizer.state"
    assert r002["message"] == (
        "no optimizer state for any of the 21 parameter(s) of the param groups (an optimizer that never stepped) "
        "but lr_scheduler.last_epoch = 2: the moments of 2 step(s) were not saved"
    )
    # replay-step replayed every parameter from fresh state and said OK; now it fails on the same finding
    ok = json.loads(runner.invoke(app, ["replay-step", "--json", str(verl_root / "w2")]).stdout)
    assert ok["ok"] and ok["problems"] == []
    res = runner.invoke(app, ["replay-step", "--json", str(run)])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert not doc["ok"] and doc["params_failed"] == 0 and doc["params_total"] == 21
    assert doc["problems"] == [
        r002["message"] + "; every parameter replayed from fresh state (`ckpttool validate --deep` reports R002)"
    ]
    assert "[E700] no optimizer state for any of the 21 parameter(s)" in res.stderr
    text = runner.invoke(app, ["replay-step", str(run)])
    assert text.exit_code == 1 and "FAILED" in text.stdout and "problem     no optimizer state" in text.stdout


def test_manifest_covers_the_rng_state_of_every_rank(verl_root: Path, tmp_path: Path) -> None:
    """Each rank's RNG state in ``extra_state_*.pt`` is described, never assembled into an entry: rank 0's file
    holds the scheduler's entries, so it was left out of the sidecars too, and a byte changed in its RNG
    record passed ``manifest --verify``. Files holding state in no entry are now digested whole."""
    actor = shutil.copytree(_actor(verl_root, 2), tmp_path / "actor")
    res = runner.invoke(app, ["manifest", str(actor)])
    assert res.exit_code == 0, res.output
    doc = json.loads((actor / "manifest.json").read_text())
    sidecars = [f["file"] for f in doc["sidecars"]]
    assert "extra_state_world_size_2_rank_0.pt" in sidecars and "extra_state_world_size_2_rank_1.pt" in sidecars
    assert runner.invoke(app, ["manifest", str(actor), "--verify"]).exit_code == 0

    path = actor / "extra_state_world_size_2_rank_0.pt"
    damage.flip_member_byte(path, "extra_state_world_size_2_rank_0/data/0", 100, 0xFF)  # the CPU RNG state's record
    res = runner.invoke(app, ["manifest", str(actor), "--verify"])
    assert res.exit_code == 1, res.output
    assert "changed  extra_state_world_size_2_rank_0.pt: differs from the manifest" in res.stdout


def _tied_rank(rank: int, world: int, root: str) -> None:
    """verl's FSDPCheckpointManager saving a tied-embedding Llama (``tie_word_embeddings``, as Qwen2.5-0.5B)."""
    import warnings

    import torch
    from omegaconf import DictConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from tests.fixtures.perrank import _model_and_opt, _reference, _train

    warnings.filterwarnings("ignore")
    model, opt, sched = _model_and_opt(tie=True)
    _train(model, opt, sched, rank, 2)
    mgr = FSDPCheckpointManager(
        model, opt, lr_scheduler=sched, checkpoint_config=DictConfig({"save_contents": ["model", "optimizer", "extra"]})
    )
    mgr.save_checkpoint(str(Path(root) / "global_step_2" / "actor"), global_step=2)
    ref = _reference(model, opt)
    if rank == 0:
        torch.save(ref, Path(root) / "reference.pt")
        model.config.save_pretrained(Path(root) / "assets")


def test_tied_embeddings_are_one_parameter(verl_root: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tied model's state dict pickles ``lm_head.weight`` as a second DTensor over the embedding's local
    tensor (two objects, one storage record), while the optimizer counts the parameter once: every command
    refused verl's own save with E280 ("the optimizer steps 20 parameters, the model file holds 21"). The
    tie is now found by the shared storage view; the tensors and moments are torch's, export omits the head."""
    import torch
    from safetensors.torch import load_file

    from tests.fixtures.distributed import run_ranks

    root = tmp_path_factory.mktemp("verl_tied")
    run_ranks(2, _tied_rank, str(root))
    actor = root / "global_step_2" / "actor"
    ref = torch.load(root / "reference.pt", weights_only=False)
    assert len(ref["names"]) == 20 and len(ref["model"]) == 21  # lm_head.weight is model.embed_tokens.weight
    with open_checkpoint(actor) as ck:
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["names"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
        assert not any(k.startswith("optimizer.state.lm_head.") for k in ck.metadata.entries)
    res = runner.invoke(app, ["validate", str(actor), "--strict", "--deep", "--json"])
    assert res.exit_code == 0, res.output
    out = tmp_path_factory.mktemp("verl_tied_hf") / "hf"
    res = runner.invoke(app, ["export", str(actor), str(out), "--model-assets", str(root / "assets")])
    assert res.exit_code == 0, res.output
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(k for k in ref["model"] if k != "lm_head.weight")
    assert all(torch.equal(got[k], ref["model"][k]) for k in got)


def test_verl_rank_files_beside_a_dcp_checkpoint_are_named(verl_root: Path, tmp_path: Path) -> None:
    """verl's rank files in a folder that also holds a DCP checkpoint were passed over in silence
    (validate --strict OK); K012 now names them. verl's own save (replicas on rank 1 included) names none."""
    import torch
    import torch.distributed.checkpoint as dcp

    mixed = tmp_path / "mixed"
    dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(mixed))
    for f in _actor(verl_root, 2).glob("*_world_size_2_rank_*.pt"):
        shutil.copy(f, mixed / f.name)
    res = runner.invoke(app, ["validate", "--strict", "--json", str(mixed)])
    assert res.exit_code == 1, res.output
    (k012,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K012"]
    assert "extra_state_world_size_2_rank_0.pt, extra_state_world_size_2_rank_1.pt" in k012["message"]
    for world in (1, 2):
        doc = json.loads(runner.invoke(app, ["inspect", "--json", str(_actor(verl_root, world))]).stdout)
        assert doc["unread_beside"] == []


def test_verl_data_loader_state_beside_actor_is_named(verl_root: Path, tmp_path: Path) -> None:
    """verl's trainer saves global_step_N/data.pt (torch.save of the data loader's state_dict, loaded on
    resume) beside actor/: validate --strict was OK over it from the run root, the step or actor/, which
    ckpttool never reads. K012 and inspect's unread_beside now name it; a critic/ checkpoint beside actor/
    (opened on its own) is not named."""
    import torch

    run = shutil.copytree(_actor(verl_root, 2).parent.parent, tmp_path / "run")
    step = run / "global_step_2"
    torch.save({"_num_yielded": 4, "_sampler_iter_yielded": 4}, step / "data.pt")
    for given, rel in ((step / "actor", str(step / "data.pt")), (step, "data.pt"), (run, "global_step_2/data.pt")):
        res = runner.invoke(app, ["validate", "--strict", "--json", str(given)])
        assert res.exit_code == 1, res.output
        (k012,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K012"]
        assert k012["message"].endswith(f"does not read: {rel}"), k012
        doc = json.loads(runner.invoke(app, ["inspect", "--json", str(given)]).stdout)
        assert doc["unread_beside"] == [rel]
    shutil.copytree(step / "actor", step / "critic")
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(step / "actor")]).stdout)
    assert doc["unread_beside"] == [str(step / "data.pt")]
    (step / "data.pt").unlink()
    res = runner.invoke(app, ["validate", "--strict", "--json", str(step / "actor")])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("rel", ["model_world_size_2_rank_1.pt", "optim_world_size_2_rank_0.pt"])
def test_a_truncated_rank_file_says_so(verl_root: Path, tmp_path: Path, rel: str) -> None:
    """A rank file cut short (a copy or save interrupted) was E280 with the hint "the per-rank files do not fit
    together (placements, shapes, replicas)", which sends the user after a misfit that is not there; the hint
    now says the file is truncated or damaged. Every command refuses it the same way, exit 2, no traceback."""
    actor = shutil.copytree(_actor(verl_root, 2), tmp_path / "actor")
    damage.truncate(actor, rel)
    for cmd in (["inspect"], ["validate", "--strict", "--deep"], ["stats"], ["diff", str(_actor(verl_root, 2))]):
        res = runner.invoke(app, [*cmd, str(actor)])
        assert res.exit_code == 2, (cmd, res.output)
        assert res.stderr.startswith(f"error: [E280] {actor / rel}: not a torch.save archive"), res.stderr
        assert "hint: the file is truncated or damaged (an interrupted save or copy)" in res.stderr, res.stderr
        assert "Traceback" not in res.output


def test_a_newer_step_missing_a_rank_file_is_passed_over(verl_root: Path, tmp_path: Path) -> None:
    """verl writes each rank's files straight into global_step_N/actor/: a save killed part way leaves a rank's
    file missing. From the run root (no latest_checkpointed_iteration.txt: verl's async save writes none) the
    newest step was chosen and refused (E202), and the E204 hint offered it; global_step_N/ given was E200 'no
    DCP checkpoint'. Now the step is incomplete as a DCP save without .metadata is: --step latest and the run
    root pass over it to the complete step and R001 names it; --step N and global_step_N/ are E202."""
    run = tmp_path / "run"
    shutil.copytree(_actor(verl_root, 2).parent, run / "global_step_2")
    shutil.copytree(_actor(verl_root, 2).parent, run / "global_step_4")
    (run / "global_step_4" / "actor" / "optim_world_size_2_rank_1.pt").unlink()
    why = "optimizer files of ranks [1] missing for world size 2"
    for args in ([str(run)], [str(run), "--step", "latest"]):
        res = runner.invoke(app, ["validate", "--json", *args])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
        assert r001["message"] == (
            f"{run / 'global_step_4' / 'actor'}: step 4 is newer than the checked step 2 but incomplete ({why})"
        )
        loc = json.loads(runner.invoke(app, ["inspect", "--json", *args]).stdout)["location"]
        assert loc["model"] == str(run / "global_step_2" / "actor")
    for args in ([str(run), "--step", "4"], [str(run / "global_step_4")]):
        res = runner.invoke(app, ["validate", *args])
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith("error: [E202] ") and f"{run / 'global_step_4' / 'actor'} has {why}" in res.stderr


def test_a_tracker_naming_a_step_missing_a_rank_file_is_e202(verl_root: Path, tmp_path: Path) -> None:
    """verl's trainer writes latest_checkpointed_iteration.txt and its resume (find_latest_ckpt_path) loads the
    step it names whenever that directory exists: naming global_step_4, whose rank 1 lost its model file, the
    resume fails there. ``--step latest`` passed over it and validated global_step_2 (OK, exit 0) and R001 said a
    resume picks the older step. Now ``--step latest`` is E202 naming the tracker (validate, inspect, export:
    nothing written), and the run root with global_step_2 its only complete step gets R005 naming it."""
    run = tmp_path / "run"
    shutil.copytree(_actor(verl_root, 2).parent, run / "global_step_2")
    shutil.copytree(_actor(verl_root, 2).parent, run / "global_step_4")
    (run / "global_step_4" / "actor" / "model_world_size_2_rank_1.pt").unlink()
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.write_text("4")
    out = tmp_path / "out"
    for argv in (["validate", str(run)], ["inspect", str(run)], ["export", str(run), str(out)]):
        r = runner.invoke(app, [*argv, "--step", "latest"])
        assert r.exit_code == 2, r.output
        assert r.stderr.splitlines()[0] == (
            f"error: [E202] {tracker}: names step 4, whose save did not finish: {run / 'global_step_4' / 'actor'} "
            "has model files of ranks [1] missing for world size 2; a resume that follows "
            "latest_checkpointed_iteration.txt loads step 4 and fails (the newest complete step is 2)"
        ), r.stderr
    assert not out.exists()
    r = runner.invoke(app, ["validate", "--json", str(run)])
    assert r.exit_code == 0, r.output
    assert sorted(f["code"] for f in json.loads(r.stdout)["findings"] if f["code"][0] == "R") == ["R001", "R005"]
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "2"])  # the step asked for: checked as asked
    assert r.exit_code == 0 and json.loads(r.stdout)["path"] == str(run / "global_step_2" / "actor"), r.output


def test_a_copied_step_missing_a_rank_file_is_incomplete_not_no_checkpoint(verl_root: Path, tmp_path: Path) -> None:
    """global_step_2/ copied under another name (``cp -r run/global_step_2 backup``), then a rank file lost: no
    step-named directory says which step it is, and every command said E200 'no DCP checkpoint in the 3 directory
    levels below it'. It is E202 naming actor/ and the missing rank, as in the step directory."""
    backup = shutil.copytree(_actor(verl_root, 2).parent, tmp_path / "backup")
    (backup / "actor" / "model_world_size_2_rank_1.pt").unlink()
    for cmd in (["inspect"], ["manifest"], ["diff", str(_actor(verl_root, 2))]):
        res = runner.invoke(app, [cmd[0], str(backup), *cmd[1:]])
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines() == [
            f"error: [E202] {backup}: {backup / 'actor'} has model files of ranks [1] missing for world size 2 (a "
            "save that did not finish, or an async save still running)",
            "hint: wait for the save to finish, or use an earlier step or a complete copy of this one",
        ]
    assert not (backup / "actor" / "manifest.json").exists()


@pytest.mark.parametrize("where", ["step", "actor"])
def test_stats_names_the_step_of_global_step_n(verl_root: Path, where: str) -> None:
    """stats of global_step_2/ (or its actor/) had step null: verl saves no step counter, only the directory name."""
    actor = _actor(verl_root, 2)
    r = runner.invoke(app, ["stats", "--json", str(actor if where == "actor" else actor.parent)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["checkpoints"][0]["step"] == 2


def test_plain_tensors_under_verls_rank_file_names_are_refused_saying_so(tmp_path: Path) -> None:
    """A loop's ``torch.save(model.state_dict())`` named like verl's rank files holds plain tensors, not the DTensors
    verl's FSDP workers save: E280 said the optimizer steps 2 parameters while "the model file holds 0"."""
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 4)).sum().backward()
    opt.step()
    actor = tmp_path / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    torch.save(opt.state_dict(), actor / "optim_world_size_1_rank_0.pt")
    res = runner.invoke(app, ["inspect", str(actor)])
    assert res.exit_code == 2 and res.stdout == "", res.output
    err, hint = res.stderr.strip().splitlines()
    assert err.startswith("error: [E280] model_world_size_1_rank_0.pt: plain tensors under verl's rank-file name"), err
    assert "dcp.save" in hint


def test_a_ppo_save_with_several_optimizer_steps_per_training_step_passes(tmp_path: Path) -> None:
    """verl's PPO steps the actor's optimizer once per mini-batch and its LR scheduler once per training step
    (``engine_workers.train_mini_batch``), and saves ``global_step_N/actor``: after 2 steps of 3 mini-batches the
    optimizer's step is 6, the scheduler's last_epoch 2. R002 compared the two as if the scheduler stepped with the
    optimizer and failed verl's own save ("last_epoch = 2 but ...step = 6"), and replay-step failed on it (E700).
    The optimizer's step of a verl save is now compared with neither; the scheduler with the directory's step
    (never ahead of it: critic_warmup steps leave it behind)."""
    import importlib.util

    import torch

    from tests.fixtures import perrank

    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed")
    perrank.build_verl_ppo(tmp_path / "run")
    actor = tmp_path / "run" / "global_step_2" / "actor"
    state = torch.load(actor / "optim_world_size_1_rank_0.pt", weights_only=False)["state"]
    assert {float(s["step"]) for s in state.values()} == {6.0}
    doc = json.loads(runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(actor)]).stdout)
    assert doc["ok"] and "R002" not in {f["code"] for f in doc["findings"]}, doc["findings"]
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(actor)])
    assert res.exit_code == 0 and json.loads(res.stdout)["problems"] == [], res.output
    moved = shutil.copytree(tmp_path / "run" / "global_step_2", tmp_path / "run" / "global_step_1") / "actor"
    res = runner.invoke(app, ["validate", "--deep", "--json", str(moved)])
    assert res.exit_code == 1, res.output
    ((key, message),) = [(f["key"], f["message"]) for f in json.loads(res.stdout)["findings"] if f["code"] == "R002"]
    assert (key, message) == (
        "lr_scheduler.last_epoch",
        "lr_scheduler.last_epoch = 2 but its directory is global_step_1 (step 1; a save there holds step 1 or less)",
    )


def test_r006_of_every_group_alike_is_one_finding(verl_root: Path, tmp_path: Path) -> None:
    """verl saves one param group per parameter: an LR scheduler whose ``_last_lr`` is not the groups' lr was 21
    identical R006 findings (and 21 replay-step problems), where P002 says it once with a count. R006 now groups the
    same way: one finding, one problem, naming the first group and how many more."""
    import torch

    actor = shutil.copytree(verl_root / "w2" / "global_step_2", tmp_path / "global_step_2") / "actor"
    for rank in (0, 1):
        f = actor / f"extra_state_world_size_2_rank_{rank}.pt"
        sd = torch.load(f, weights_only=False)
        assert sd["lr_scheduler"]["_last_lr"] == [0.00075]
        sd["lr_scheduler"]["_last_lr"] = [0.0015]
        torch.save(sd, f)
    res = runner.invoke(app, ["validate", "--json", str(actor)])
    assert res.exit_code == 1, res.output
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "R006"]
    assert [(f["key"], f["message"]) for f in found] == [
        (
            "optimizer.param_groups.lm_head.weight.lr",
            "param group lm_head.weight and 20 more saved lr 0.00075 but lr_scheduler._last_lr = [0.0015]",
        )
    ]
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(actor)])
    assert res.exit_code == 1, res.output
    (problem,) = json.loads(res.stdout)["problems"]
    assert problem.startswith("param group lm_head.weight and 20 more saved lr 0.00075 but lr_scheduler._last_lr")


def test_a_run_root_without_the_tracker_says_verl_trains_from_scratch(verl_root: Path, tmp_path: Path) -> None:
    """verl's trainer resumes (resume_mode auto) from find_latest_ckpt_path, which reads only
    latest_checkpointed_iteration.txt and returns None without it: "Training from scratch", no step loaded (verl
    writes none with async_save; a copy of the step directories leaves it behind). ``--step latest`` picked the
    highest step as "the highest step" and validate said OK with no word of it. Now the choice says what verl's
    resume does (inspect, export's source note) and validate names the missing file (R008, warning); with the file
    written, or a step directory given, there is no R008."""
    run = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(_actor(verl_root, 2).parent, run / f"global_step_{step}")
    tracker = run / "latest_checkpointed_iteration.txt"
    why = (
        "verl's resume (resume_mode auto: find_latest_ckpt_path) loads no step and trains from scratch; resume_mode "
        "resume_path with resume_from_path set to the step directory loads it"
    )
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    (r008,) = [f for f in doc["findings"] if f["code"] == "R008"]
    assert r008["key"] == str(tracker) and r008["severity"] == "warning"
    assert r008["message"] == (
        f"{run}: no latest_checkpointed_iteration.txt, so the checked step 4 is not what a resume of this run loads: "
        + why
    )
    assert runner.invoke(app, ["validate", str(run), "--step", "latest", "--strict"]).exit_code == 1
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert loc["model"] == str(run / "global_step_4" / "actor")
    assert loc["how"].startswith(f"`step` latest: step 4 (the highest step; no {tracker.name} in {run}: {why})")
    r = runner.invoke(app, ["export", str(run), str(tmp_path / "out"), "--step", "latest", "--allow-mismatch", "dtype"])
    assert r.exit_code == 0, r.output
    assert f"the highest step; no {tracker.name} in {run}: {why}" in r.stderr
    for argv in ([str(run / "global_step_4")], [str(run / "global_step_4" / "actor")]):
        doc = json.loads(runner.invoke(app, ["validate", "--json", *argv]).stdout)
        assert "R008" not in {f["code"] for f in doc["findings"]}
    tracker.write_text("4")
    doc = json.loads(runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"]).stdout)
    assert "R008" not in {f["code"] for f in doc["findings"]} and doc["path"] == str(run / "global_step_4" / "actor")
    assert "no latest_checkpointed" not in runner.invoke(app, ["inspect", str(run), "--step", "latest"]).stdout


def test_a_skyrl_run_root_with_its_own_tracker_is_no_r008(verl_root: Path, tmp_path: Path) -> None:
    """SkyRL (derived from verl) saves verl's per-rank files (``model_world_size_W_rank_R.pt`` ...) in
    ``global_step_N/policy/`` and resumes (``resume_mode: latest``) from its own tracker,
    ``latest_ckpt_global_step.txt``, in the run root: such a root was R008 ("no latest_checkpointed_iteration.txt:
    verl's resume trains from scratch", validate --strict failed) though SkyRL's resume loads the step its tracker
    names. Now the SkyRL tracker is the run's; without either file R008 stays (SkyRL starts from scratch too)."""
    run = tmp_path / "run"
    shutil.copytree(_actor(verl_root, 2), run / "global_step_2" / "policy")
    (run / "latest_ckpt_global_step.txt").write_text("2")  # SkyRL's trainer writes str(global_step)
    for argv in ([str(run)], [str(run), "--step", "latest"]):
        doc = json.loads(runner.invoke(app, ["validate", "--json", *argv]).stdout)
        assert doc["path"] == str(run / "global_step_2" / "policy")
        assert "R008" not in {f["code"] for f in doc["findings"]}
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert "latest_checkpointed_iteration.txt" not in loc["how"]
    (run / "latest_ckpt_global_step.txt").unlink()
    doc = json.loads(runner.invoke(app, ["validate", "--json", str(run)]).stdout)
    (r008,) = [f for f in doc["findings"] if f["code"] == "R008"]
    assert r008["key"] == str(run / "latest_checkpointed_iteration.txt")


def _verl_lora(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if any(importlib.util.find_spec(m) is None for m in ("verl", "ray", "peft")):
        pytest.skip("verl (with ray) and peft are needed for verl's LoRA saves")
    return cached_build(fixture_root, "perrank_verl_lora", perrank.build_verl_lora)


def test_a_lora_only_save_says_so_not_that_two_saves_were_mixed(fixture_root: Path, tmp_path: Path) -> None:
    """verl's save_lora_only writes the LoRA adapter tensors alone into the model files and the whole optimizer
    (every parameter of the PEFT model, the frozen base's included) into the optimizer files, as verl's own save
    code does here. Every command refused it with E280 'the optimizer steps 29 parameters, the model file holds 8'
    and the hint that both must come from one save (they do). Now the refusal names the LoRA-only save and why its
    optimizer state cannot be read; nothing is said OK and export writes nothing."""
    root = _verl_lora(fixture_root)
    actor = root / "lora_only" / "global_step_2" / "actor"
    assert {"lora_train_meta.json", "optim_world_size_2_rank_1.pt"} <= {p.name for p in actor.iterdir()}
    why = (
        "optim_world_size_2_rank_0.pt: a LoRA-only save (verl's checkpoint save_lora_only): the model file holds "
        "only the 8 adapter tensors (lora_/adapter_ keys), the optimizer steps all 29 parameters of the PEFT model, "
        "the frozen base model's included; which of its indices is which adapter tensor is not saved, so its state "
        "cannot be read"
    )
    out = tmp_path / "out"
    for argv in (["inspect", str(actor)], ["export", str(actor), str(out)]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 2 and r.stdout == "", r.output
        assert r.stderr.splitlines()[0] == f"error: [E280] {why}", r.stderr
        assert "both must come from one save" not in r.stderr
    assert not out.exists()
    r = runner.invoke(app, ["validate", "--json", str(root / "lora_only")])
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and [f["message"] for f in doc["findings"] if f["severity"] == "error"] == [why]


def test_a_lora_adapter_export_names_verls_lora_alpha_and_peft_loads_it(fixture_root: Path, tmp_path: Path) -> None:
    """A LoRA model saved whole by verl (base and adapter tensors; the base frozen) beside verl's
    lora_train_meta.json ({r, lora_alpha, task_type}). ``export --format lora`` without ``--lora-alpha`` said only
    'pass `lora_alpha` A (the LoraConfig lora_alpha used in training)', though the trainer recorded it beside the
    checkpoint; now the hint names it. With it, peft's own PeftModel.from_pretrained loads the adapter and its
    tensors are the live model's (torch-gathered), and its logits are the live PEFT model's."""
    import torch
    from peft import PeftModel

    from tests.fixtures.writers import hf_llama

    root = _verl_lora(fixture_root)
    actor = root / "full" / "global_step_2" / "actor"
    out = tmp_path / "adapter"
    r = runner.invoke(app, ["export", str(actor), str(out), "--format", "lora"])
    assert r.exit_code == 2 and not out.exists(), r.output
    assert r.stderr.splitlines()[1] == (
        "hint: pass --lora-alpha 8 (verl's lora_train_meta.json beside the checkpoint records r 4, lora_alpha 8) or "
        "--adapter-config FILE"
    ), r.stderr
    r = runner.invoke(app, ["export", str(actor), str(out), "--format", "lora", "--lora-alpha", "8"])
    assert r.exit_code == 0, r.output
    ref = torch.load(root / "params.pt")
    base = hf_llama()
    prefix = "base_model.model."
    base.load_state_dict(
        {k[len(prefix) :].replace(".base_layer.", "."): v for k, v in ref.items() if "lora_" not in k}, strict=True
    )
    ids = torch.arange(16).reshape(2, 8)
    peft_model = PeftModel.from_pretrained(base, str(out))
    got = dict(peft_model.named_parameters())
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    live = hf_llama()
    from peft import LoraConfig, get_peft_model

    live = get_peft_model(live, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    live.load_state_dict(ref, strict=False)
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, live(input_ids=ids).logits)


def test_a_tracker_holding_a_step_directory_name_is_refused_as_verl_refuses_it(verl_root: Path, tmp_path: Path) -> None:
    """verl's find_latest_ckpt_path reads latest_checkpointed_iteration.txt with int() (Megatron-LM's read_metadata
    too): 'global_step_2' there raises ValueError, and the resume stops. ``--step latest`` read it as DeepSpeed's
    ``latest`` tag and opened global_step_2 ('named by latest_checkpointed_iteration.txt'). Now it is E205 naming the
    file and the number to write; validate from the run root names it (R005); the step directory itself is fine."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    run = tmp_path / "run"
    shutil.copytree(_actor(verl_root, 2).parent, run / "global_step_2")
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.write_text("global_step_2")
    with pytest.raises(ValueError):  # verl's own resume
        find_latest_ckpt_path(str(run))
    said = (
        f"{tracker}: holds 'global_step_2', which is not an iteration number (the trainer's resume stops on it: "
        "Megatron-LM's 'Invalid metadata file', verl's int() raises ValueError)"
    )
    for argv in (
        ["inspect", str(run), "--step", "latest"],
        ["export", str(run), str(tmp_path / "out"), "--step", "latest"],
    ):
        r = runner.invoke(app, argv)
        assert r.exit_code == 2 and r.stdout == "", r.output
        assert r.stderr.splitlines() == [
            f"error: [E205] {said}",
            "hint: write the step number alone into latest_checkpointed_iteration.txt (2), or pass --step N",
        ]
    assert not (tmp_path / "out").exists()
    doc = json.loads(runner.invoke(app, ["validate", "--json", str(run)]).stdout)
    assert [f["message"] for f in doc["findings"] if f["code"] == "R005"] == [said]
    tracker.write_text("2\n")  # what verl writes: its resume and --step latest open global_step_2
    assert find_latest_ckpt_path(str(run)) == str(run / "global_step_2")
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert loc["model"] == str(run / "global_step_2" / "actor")


def test_step_latest_follows_skyrls_own_tracker(verl_root: Path, tmp_path: Path) -> None:
    """SkyRL's ``load_checkpoints`` (``resume_mode: latest``) loads ``global_step_<int(latest_ckpt_global_step.txt)>``,
    never the highest step directory. ``--step latest`` over its run root holding steps 2 and 4 with the tracker
    naming 2 took step 4 ("the highest step"). Now it takes step 2 and says step 4 is newer; a tracker naming a step
    not there, or a step directory's name (``int()`` fails on it), is E205 naming the file."""
    run = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(_actor(verl_root, 2), run / f"global_step_{step}" / "policy")
    tracker = run / "latest_ckpt_global_step.txt"
    tracker.write_text("2")  # SkyRL's trainer writes str(global_step)
    r = runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0, r.output
    loc = json.loads(r.stdout)["location"]
    assert loc["model"] == str(run / "global_step_2" / "policy") and loc["step"] == 2
    assert loc["how"].startswith(
        "`step` latest: step 2 (named by latest_ckpt_global_step.txt; step 4 below it is newer"
    )
    for text, said in (("6", f"{tracker}: names step 6"), ("global_step_4", "is not an iteration number")):
        tracker.write_text(text)
        r = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
        assert r.exit_code == 2 and "[E205]" in r.stderr and said in r.stderr, r.output


@pytest.mark.parametrize("kind", ["folder", "link"])
def test_a_tracker_that_is_a_directory_is_e205_as_verls_resume_fails(
    verl_root: Path, tmp_path: Path, kind: str
) -> None:
    """verl's ``find_latest_ckpt_path`` opens ``latest_checkpointed_iteration.txt`` and ``int()`` s its text: a folder
    of that name, or a link to a step directory, raises IsADirectoryError, and no step is resumed. ``--step latest``
    passed over the folder (the highest step) and followed the link as NeMo's ``LATEST`` link is. Now both are E205
    naming the file; nothing is exported."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    run = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(_actor(verl_root, 2), run / f"global_step_{step}" / "actor")
    tracker = run / "latest_checkpointed_iteration.txt"
    if kind == "folder":
        tracker.mkdir()
    else:
        tracker.symlink_to("global_step_2")
    with pytest.raises(IsADirectoryError):  # the trainer's own resume
        find_latest_ckpt_path(str(run))
    r = runner.invoke(app, ["export", str(run), str(tmp_path / "out"), "--step", "latest"])
    assert r.exit_code == 2 and "[E205]" in r.stderr and f"{tracker}: is " in r.stderr, r.output
    assert "IsADirectoryError" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()
    r = runner.invoke(app, ["inspect", str(run), "--step", "4"])  # a step named is still opened
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="session")
def verl_fsdp1(verl_root: Path, fixture_root: Path) -> Path:
    from tests.fixtures import perrank

    return cached_build(fixture_root, "perrank_verl_fsdp1", perrank.build_verl_fsdp1)


def test_fsdp1_save_is_named_not_called_unsafe(verl_fsdp1: Path, tmp_path: Path) -> None:
    """verl's default actor strategy ``fsdp`` (FSDP1) saves ShardedTensor model shards and the optimizer's state over
    FSDP1's flat parameters (which elements are which parameter is not saved). Before: every command refused it as a
    pickle naming a global off the allow-list (E201, 'the file may run code when loaded by torch'); now E280 names
    the FSDP1 save by its ``fsdp_config.json`` (without that file, by the model rank file's ShardedTensor), never an
    OK, nothing written."""
    actor = verl_fsdp1 / "global_step_2" / "actor"
    before = {p.name: p.read_bytes() for p in actor.iterdir() if p.is_file()}
    assert json.loads((actor / "fsdp_config.json").read_text())["FSDP_version"] == 1
    cfg = f"{actor / 'fsdp_config.json'}: a verl save of an FSDP1 model (FSDP_version 1"
    for args in (
        ["inspect", str(verl_fsdp1)],
        ["validate", "--strict", "--deep", str(actor)],
        ["stats", str(actor)],
        ["replay-step", str(actor), "--device", "cpu"],
        ["export", str(actor), str(tmp_path / "out")],
    ):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and "E280" in r.output and cfg in " ".join(r.output.split()), (args, r.output)
        assert "E201" not in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()
    copy = tmp_path / "older" / "actor"  # verl before fsdp_config.json: the rank files alone
    shutil.copytree(actor, copy, ignore=shutil.ignore_patterns("fsdp_config.json"))
    r = runner.invoke(app, ["inspect", str(copy)])
    said = f"{copy / 'model_world_size_2_rank_0.pt'}: a ShardedTensor (torch.distributed._shard.sharded_tensor"
    assert r.exit_code == 2 and "[E280]" in r.stderr and said in r.stderr, r.output
    assert {p.name: p.read_bytes() for p in actor.iterdir() if p.is_file()} == before
