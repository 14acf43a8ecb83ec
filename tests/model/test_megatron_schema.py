"""Megatron-core ``torch_dist`` checkpoints: reading, detection, optimizer coverage, validate, diff.

The checkpoints are written by megatron-core 0.16.1's own training and save code on CPU / gloo
(``tests/fixtures/megatron.py``: only *device* calls are shimmed — ``torch.cuda.current_device``,
``synchronize``, ``device="cuda"`` factories, the CUDA RNG tracker's ``fork`` — never the
checkpoint code) and committed under ``tests/fixtures/megatron_data`` (building them takes
minutes). Every answer is checked against torch's own reading (``FileSystemReader``,
``torch.load`` of ``common.pt``, ``dcp.load``).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import UnsafePickleError
from ckpttool.format.unpickler import parse_metadata_bytes
from ckpttool.model.checkpoint import open_checkpoint
from ckpttool.model.schemas import megatron

DATA = Path(__file__).parent.parent / "fixtures" / "megatron_data"
RUNS = {"dense1": "iter_0000003", "dense_tp2": "iter_0000003", "moe_ep2": "iter_0000002"}
runner = CliRunner()


def _dir(run: str) -> Path:
    return DATA / run / RUNS[run]


def _torch_md(run: str):  # torch's own reading of .metadata (plain pickle: our own fixture, trusted)
    return dcp.FileSystemReader(str(_dir(run))).read_metadata()


def _common(run: str) -> dict:
    return torch.load(_dir(run) / "common.pt", weights_only=False)


@pytest.mark.parametrize("run", list(RUNS))
def test_metadata_with_local_plans_parses_like_torch(run: str) -> None:
    tmd = _torch_md(run)
    assert getattr(tmd, "all_local_plans", None), "megatron attaches the savers' plans"
    md = parse_metadata_bytes((_dir(run) / ".metadata").read_bytes())
    assert set(md.entries) == set(tmd.state_dict_metadata)
    for key, meta in tmd.state_dict_metadata.items():
        ours = md.entries[key]
        if hasattr(meta, "chunks"):
            assert ours.size == tuple(meta.size)
            assert ours.dtype.name == str(meta.properties.dtype).removeprefix("torch.")
            assert [(c.offsets, c.sizes) for c in ours.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks
            ]


def test_plans_allow_list_is_data_only() -> None:
    # the plans' globals resolve to inert records; a WriteItemType rebuilt from anything but a small
    # int is refused, as is any global outside the allow-list
    evil = pickle.dumps(__import__("os").system, protocol=4)
    with pytest.raises(UnsafePickleError):
        parse_metadata_bytes(evil)
    wit = (
        b"\x80\x04\x8c$torch.distributed.checkpoint.planner\x94\x8c\rWriteItemType\x94\x93\x94"
        b"\x8c\x03abc\x94\x85\x94R\x94."
    )
    with pytest.raises(UnsafePickleError):
        parse_metadata_bytes(wit)


@pytest.mark.parametrize("run", list(RUNS))
def test_detected_and_every_parameter_has_state(run: str) -> None:
    tmd = _torch_md(run)
    tensors = {k for k, m in tmd.state_dict_metadata.items() if hasattr(m, "chunks")}
    state_keys = {k for k in tensors if ".optimizer.state." in f".{k}"}
    model_keys = tensors - state_keys
    with open_checkpoint(DATA / run) as ckpt:  # from the run root: latest_checkpointed_iteration.txt
        cat = ckpt.catalog
        assert ckpt.path == _dir(run)
        assert cat.schema.id == "megatron" and cat.schema.naming == "megatron"
        assert set(cat.model) == model_keys
        assert set(cat.optimizer_state) == model_keys  # every parameter, none outside the model
        seen = {t.key for ps in cat.optimizer_state.values() for t in ps.fields.values() if t is not None}
        assert seen == state_keys
        for fqn, ps in cat.optimizer_state.items():
            assert ps.in_model
            assert ps.fields["exp_avg"].shape == cat.model[fqn].shape
            assert cat.state_key(fqn, "exp_avg") == ps.fields["exp_avg"].key
            if cat.model[fqn].dtype == "bfloat16":  # Float16Optimizer's fp32_param masters
                assert ps.fields["master_weight"].key.endswith(f"optimizer.state.fp32_param.{fqn}")
        assert cat.uncategorized_tensors() == []


@pytest.mark.parametrize("run", list(RUNS))
def test_param_groups_from_common_pt(run: str) -> None:
    common = _common(run)
    opt = common["optimizer"]
    chains = [opt[k] for k in sorted(opt)] if all(isinstance(k, int) for k in opt) else [opt]
    chains = [c.get("optimizer", c) if "param_groups" not in c else c for c in chains]
    want = [(g, float(c["state"]["common_step"])) for c in chains for g in c["param_groups"]]
    with open_checkpoint(_dir(run)) as ckpt:
        groups = ckpt.param_groups()
        assert len(groups) == len(want)
        for g, (tg, step) in zip(groups, want):
            for h in ("lr", "betas", "eps", "weight_decay", "wd_mult"):
                assert g.values[h] == tg[h]
            assert g.values["step"] == step == common["iteration"]
        members = [f for g in groups for f in g.params]
        assert sorted(members) == sorted(ckpt.catalog.optimizer_state)  # each parameter in exactly one group
        for g in groups:  # megatron's default: no weight decay for 1-D (norm) parameters
            for f in g.params:
                is_norm = "layernorm" in f or "layer_norm" in f
                assert (g.values["wd_mult"] == 0.0) == is_norm, f
                assert g.values["is_expert_parallel"] == (".experts." in f)


@pytest.mark.parametrize("run", list(RUNS))
def test_validate_strict_deep_ok(run: str) -> None:
    r = runner.invoke(app, ["validate", "--strict", "--deep", str(DATA / run)])
    assert r.exit_code == 0, r.output
    assert "OK: 0 errors, 0 warnings" in r.output


def test_inspect_reports_coverage() -> None:
    r = runner.invoke(app, ["inspect", str(DATA / "moe_ep2")])
    assert r.exit_code == 0, r.output
    assert "key schema  megatron (detected)" in r.output
    assert "state for 10/10 params" in r.output


def test_values_read_equal_torch_dcp_load() -> None:
    tmd = _torch_md("moe_ep2")
    sd = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in tmd.state_dict_metadata.items()
        if hasattr(m, "chunks")
    }
    dcp.load(sd, checkpoint_id=str(_dir("moe_ep2")), no_dist=True)
    with open_checkpoint(_dir("moe_ep2")) as ckpt:
        for fqn, ps in ckpt.catalog.optimizer_state.items():
            assert torch.equal(ckpt.reader.read_tensor(fqn), sd[fqn])
            for t in ps.fields.values():
                if t is not None:
                    assert torch.equal(ckpt.reader.read_tensor(t.key), sd[t.key])


def test_diff_sees_a_changed_moment(tmp_path: Path) -> None:
    a = _dir("dense1")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    key = "optimizer.state.exp_avg.output_layer.weight"
    tmd = _torch_md("dense1")
    sd = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in tmd.state_dict_metadata.items()
        if hasattr(m, "chunks")
    }
    dcp.load(sd, checkpoint_id=str(a), no_dist=True)
    sd[key] = sd[key] + 1.0
    for f in b.glob("*.distcp"):
        f.unlink()
    (b / ".metadata").unlink()
    dcp.save(sd, checkpoint_id=str(b), no_dist=True)
    r = runner.invoke(app, ["diff", "--what", "all", str(a), str(b)])
    assert r.exit_code != 0, r.output
    assert "output_layer.weight" in r.output
    same = runner.invoke(app, ["diff", "--what", "all", str(a), str(a)])
    assert same.exit_code == 0, same.output


def test_common_reader() -> None:
    c = megatron.parse_common((_dir("moe_ep2") / "common.pt").read_bytes(), "common.pt")
    assert c is not None
    assert c.iteration == 2 and c.common_step == (2.0, 2.0)
    assert c.scheduler["lr_warmup_steps"] == 2
    assert [len(g) for g in c.groups] == [2, 1]
    assert megatron.is_megatron_dir(_dir("moe_ep2"))
    assert megatron.split_state_key("chained_1.optimizer.state.exp_avg.decoder.layers.x.weight") == (
        "decoder.layers.x.weight",
        "exp_avg",
    )
    assert megatron.split_state_key("optimizer.state.fp32_param.a.weight") == ("a.weight", "master_weight")
    assert megatron.split_state_key("decoder.layers.x.weight") is None


@pytest.mark.heavy  # spawns megatron-core on 2 gloo ranks: minutes on a shared 2-core machine
@pytest.mark.parametrize("run", ["dense_tp2", "moe_ep2"])
def test_tensors_equal_megatron_dist_checkpointing_load(tmp_path: Path, run: str) -> None:
    """megatron-core's own loader (TP/EP shards, gate/up factories, optimizer keys) reads what ckpttool reads."""
    pytest.importorskip("megatron.core")
    from tests.fixtures.megatron import load_with_megatron

    load_with_megatron(DATA, run, tmp_path)
    rows = [r for f in sorted(tmp_path.glob("rank*.pt")) for r in torch.load(f, weights_only=False)]
    assert rows
    keys = set()
    with open_checkpoint(_dir(run)) as ckpt:
        whole = {}
        for key, offset, local in rows:
            if key not in whole:
                whole[key] = ckpt.reader.read_tensor(key)
            t = whole[key]
            lead = t.dim() - local.dim()  # megatron's prepended (stacked layer / expert) axes: size 1 locally
            want = t[tuple(slice(o, o + n) for o, n in zip(offset, (1,) * lead + tuple(local.shape)))]
            assert torch.equal(want.reshape(local.shape).to(local.dtype), local), key  # bf16 -> f32 is exact
            keys.add(key)
        cat = ckpt.catalog
        state_keys = {t.key for ps in cat.optimizer_state.values() for t in ps.fields.values() if t is not None}
        assert keys == set(cat.model) | state_keys


@pytest.mark.heavy  # runs megatron-core's training and save (about a minute)
def test_generator_writes_what_is_committed(tmp_path: Path) -> None:
    """The committed fixtures are what tests/fixtures/megatron.py writes with megatron-core today."""
    pytest.importorskip("megatron.core")
    from tests.fixtures.megatron import build_megatron

    build_megatron(tmp_path, ("dense1",))
    new = dcp.FileSystemReader(str(tmp_path / "dense1" / RUNS["dense1"])).read_metadata().state_dict_metadata
    old = _torch_md("dense1").state_dict_metadata
    assert set(new) == set(old)
    for k, m in old.items():
        if hasattr(m, "chunks"):
            assert new[k].size == m.size and new[k].properties.dtype == m.properties.dtype, k
    assert (tmp_path / "dense1" / "latest_checkpointed_iteration.txt").read_text() == "3"
    r = runner.invoke(app, ["validate", "--strict", "--deep", str(tmp_path / "dense1")])
    assert r.exit_code == 0, r.output


def test_iteration_without_metadata_json_is_an_unfinished_save(tmp_path: Path) -> None:
    """megatron-core's ``dist_checkpointing.save`` writes ``common.pt``, then the shards (``.metadata``), then
    ``metadata.json`` "only if the checkpoint is complete"; its load refuses a directory without it ("is not a
    distributed checkpoint"). Such an ``iter_N`` was opened as a checkpoint: ``--step latest`` (no tracker file)
    chose it, ``validate --strict`` of it passed. Now it is an unfinished save: E202 opened directly or by
    ``--step N``, passed over by ``--step latest`` (R001 names it)."""
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").unlink()  # Megatron-LM writes it after a save completes
    cut = shutil.copytree(run / "iter_0000003", run / "iter_0000005")
    (cut / "metadata.json").unlink()
    r = runner.invoke(app, ["validate", "--strict", str(cut)])
    assert r.exit_code == 2, r.output
    assert "[E202]" in r.stderr and "common.pt but no metadata.json" in r.stderr
    r = runner.invoke(app, ["validate", "--strict", str(run), "--step", "5"])
    assert r.exit_code == 2 and "[E202]" in r.stderr and "step 5 is incomplete" in r.stderr, r.output
    r = runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0, r.output
    loc = json.loads(r.stdout)["location"]
    assert loc["model"] == str(run / "iter_0000003") and loc["step"] == 3
    assert [i["step"] for i in loc["newer_incomplete"]] == [5]
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 1, r.output
    # R008: no tracker, so Megatron-LM's own resume loads neither iteration (it starts from random)
    assert [f["code"] for f in json.loads(r.stdout)["findings"]] == ["R001", "R008"]


def test_run_without_tracker_says_megatron_lm_starts_from_random(tmp_path: Path) -> None:
    """Megatron-LM's load (``_load_base_checkpoint``) reads the iteration only from
    latest_checkpointed_iteration.txt (or ``--ckpt-step``): without it, "will not load any checkpoints and will start
    from random". ``--step latest`` on such a save folder picked the highest iteration as "the highest step" and
    validate said OK with no word of it. Now the choice says what Megatron-LM's resume does and validate names the
    missing tracker (R008, warning); the run with its tracker gets none."""
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    why = "Megatron-LM's load_checkpoint loads no iteration and starts from random; --ckpt-step N loads iteration N"
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert loc["how"].startswith(f"`step` latest: step 3 (the highest step; no {tracker.name} in {run}: {why})")
    for argv in ([str(run)], [str(run), "--step", "latest"], [str(run), "--step", "3"]):
        r = runner.invoke(app, ["validate", "--json", *argv])
        assert r.exit_code == 0, r.output
        (r008,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R008"]
        assert r008["key"] == str(tracker)
        assert r008["message"] == (
            f"{run}: no {tracker.name}, so the checked step 3 is not what a resume of this run loads: {why}"
        )
    r = runner.invoke(app, ["validate", "--json", str(run / "iter_0000003")])
    assert "R008" not in {f["code"] for f in json.loads(r.stdout)["findings"]}
    tracker.write_text("3")
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    assert "R008" not in {f["code"] for f in json.loads(r.stdout)["findings"]}


def test_megatron_bridge_run_with_its_own_tracker_is_no_r008(tmp_path: Path) -> None:
    """Megatron Bridge saves megatron-core ``torch_dist`` iterations as Megatron-LM does, but resumes from its own
    tracker, ``latest_train_state.pt`` (``torch.save`` of its ``TrainState.state_dict()``, copied from the
    iteration's ``train_state.pt``), and reads ``latest_checkpointed_iteration.txt`` only without it; its versions
    before the Megatron-LM compatibility tracker write no ``.txt``. Such a save folder was R008 ("Megatron-LM's
    load_checkpoint loads no iteration and starts from random", validate --strict failed) and ``--step latest``
    said so, while Bridge's resume loads the iteration its tracker names. Now either tracker is the run's."""
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").unlink()
    # Bridge's TrainState at iteration 3, saved as Bridge's save_checkpoint does
    state = _bridge_train_state(torch.tensor(3, dtype=torch.int32))
    torch.save(state, run / "iter_0000003" / "train_state.pt")
    shutil.copy(run / "iter_0000003" / "train_state.pt", run / "latest_train_state.pt")
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert loc["how"] == "`step` latest: step 3 (named by latest_train_state.pt)"  # the iteration Bridge loads
    for argv in ([str(run)], [str(run), "--step", "latest"]):
        r = runner.invoke(app, ["validate", "--json", *argv])
        assert r.exit_code == 0, r.output
        # the iteration's train_state.pt is named as not read (K012), the run's tracker found
        assert [f["code"] for f in json.loads(r.stdout)["findings"]] == ["K012"]
    (run / "latest_train_state.pt").unlink()  # neither tracker: R008 names Megatron-LM's
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    (r008,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R008"]
    assert r008["key"] == str(run / "latest_checkpointed_iteration.txt")


def test_megatron_core_save_in_another_trainers_step_folder_is_no_r008(tmp_path: Path) -> None:
    """A megatron-core ``dist_checkpointing`` save in a step directory Megatron-LM does not name (SkyRL's megatron
    backend: ``global_step_N/policy/`` beside its own tracker ``latest_ckpt_global_step.txt``) was R008 "no
    latest_checkpointed_iteration.txt: Megatron-LM's load_checkpoint starts from random": that trainer is not
    Megatron-LM and resumes from its own file. R008 now speaks only of ``iter_N`` directories."""
    run = tmp_path / "run"
    shutil.copytree(DATA / "dense1" / "iter_0000003", run / "global_step_3" / "policy")
    (run / "latest_ckpt_global_step.txt").write_text("3")
    for argv in ([str(run)], [str(run), "--step", "latest"]):
        r = runner.invoke(app, ["validate", "--strict", "--json", *argv])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["path"] == str(run / "global_step_3" / "policy")
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert "from random" not in loc["how"]


def test_tracker_naming_an_unfinished_iteration_is_e202_not_the_older_one(tmp_path: Path) -> None:
    """latest_checkpointed_iteration.txt naming iter_0000005, whose save did not finish (no metadata.json), beside
    the complete iter_0000003: Megatron-LM's resume follows the tracker to iteration 5 and fails there, yet
    ``--step latest`` passed over it and validated (and exported) iteration 3, OK without --strict, and R001 said a
    resume picks the older step. Now ``--step latest`` is E202 naming the tracker, nothing is exported, and the run
    root (its only complete iteration) gets R005 naming the tracker beside R001."""
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    cut = shutil.copytree(run / "iter_0000003", run / "iter_0000005")
    (cut / "metadata.json").unlink()
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.write_text("5")
    for argv in (["validate", str(run)], ["inspect", str(run)], ["export", str(run), str(tmp_path / "out")]):
        r = runner.invoke(app, [*argv, "--step", "latest"])
        assert r.exit_code == 2, r.output
        assert r.stderr.startswith(
            f"error: [E202] {tracker}: names step 5, whose save did not finish: {cut} has common.pt but no "
            "metadata.json"
        ), r.stderr
        assert "a resume that follows latest_checkpointed_iteration.txt loads step 5 and fails" in r.stderr
        assert "pass --step 3" in r.stderr
    assert not (tmp_path / "out").exists()
    r = runner.invoke(app, ["validate", "--json", str(run)])
    assert r.exit_code == 0, r.output
    codes = {f["code"]: f for f in json.loads(r.stdout)["findings"]}
    assert set(codes) == {"R001", "R005"} and codes["R005"]["key"] == str(tracker), r.stdout
    assert runner.invoke(app, ["validate", "--strict", str(run)]).exit_code == 1
    tracker.write_text("3")  # the tracker naming the complete iteration: followed, R001 names the newer one
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0 and [f["code"] for f in json.loads(r.stdout)["findings"]] == ["R001"], r.output


def test_a_step_of_another_run_copied_in_is_r007(tmp_path: Path) -> None:
    """A run root (dense1: iter_0000003) with another run's save copied in as its newest iteration (moe_ep2's, an
    MoE model) and the tracker naming it: Megatron-LM's resume builds the dense model and fails loading it, yet
    ``validate --step latest`` checked iter_0000005 and found nothing about the model (R002 only, for the copied
    common.pt's iteration). Now R007 names the step and the keys only in one of the two, as torch's own reader
    lists them; the run's own iteration copied to iter_0000005 gets no R007."""
    from torch.distributed.checkpoint import FileSystemReader

    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    shutil.copytree(DATA / "dense1" / "iter_0000003", run / "iter_0000005")
    doc = json.loads(runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"]).stdout)
    assert doc["path"] == str(run / "iter_0000005") and "R007" not in {f["code"] for f in doc["findings"]}
    shutil.rmtree(run / "iter_0000005")
    shutil.copytree(DATA / "moe_ep2" / "iter_0000002", run / "iter_0000005")
    mine = set(FileSystemReader(str(run / "iter_0000005")).read_metadata().state_dict_metadata)
    theirs = set(FileSystemReader(str(run / "iter_0000003")).read_metadata().state_dict_metadata)
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R007"]
    assert f["severity"] == "warning" and f["key"] == str(run / "iter_0000005"), f
    head = f"{run / 'iter_0000005'}: step 5 holds another model than step 3 before it ({run / 'iter_0000003'}): "
    assert f["message"].startswith(head), f["message"]
    new_key = f["message"].split("only in it (e.g. ", 1)[1].split(")", 1)[0]
    old_key = f["message"].split("only in step 3 (e.g. ", 1)[1].split(")", 1)[0]
    assert new_key in mine - theirs and old_key in theirs - mine, f["message"]
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run), "--step", "3"])  # the run's own step
    assert "R007" not in {f["code"] for f in json.loads(r.stdout)["findings"]}, r.stdout


def test_latest_release_opens_the_release_directory(tmp_path: Path) -> None:
    """Megatron-LM's latest_checkpointed_iteration.txt holding ``release`` makes its resume load ``<save>/release/``;
    ``--step latest`` passed over the word and opened the highest iter_N instead (and with release/ alone
    was E205 'no checkpoint in a step directory'). Now it opens release/ and says why; a tracker naming a
    release/ that holds no checkpoint is E205 naming the tracker."""
    run = tmp_path / "run"
    shutil.copytree(DATA / "dense1" / "iter_0000003", run / "iter_0000003")
    shutil.copytree(DATA / "dense1" / "iter_0000003", run / "release")
    (run / "latest_checkpointed_iteration.txt").write_text("release")
    r = runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0, r.output
    loc = json.loads(r.stdout)["location"]
    assert loc["model"] == str(run / "release")
    assert loc["how"] == "`step` latest: release/ (named by latest_checkpointed_iteration.txt)"
    shutil.rmtree(run / "release")
    r = runner.invoke(app, ["validate", str(run), "--step", "latest"])
    assert r.exit_code == 2 and "[E205]" in r.stderr, r.output
    assert "latest_checkpointed_iteration.txt: names the release checkpoint" in r.stderr


@pytest.mark.parametrize(
    "config",
    [
        '{"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch"}',
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 2}',
        '{"sharded_backend": "torch_dist", "common_backend": "zarr"}',
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "fully_parallel": true}',
        '{"sharded_backend_version": 1, "common_backend": "torch"}',
        '["torch_dist", 1]',
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1',
    ],
)
def test_metadata_json_megatron_cannot_load_from_is_named(tmp_path: Path, config: str) -> None:
    """A metadata.json megatron-core's own dist_checkpointing.load refuses (another backend or version, a field
    its CheckpointingConfig lacks, no sharded_backend, not a JSON object) passed validate --strict --deep (OK):
    its content was never looked at. K013 now names the file; the config megatron-core writes passes."""
    pytest.importorskip(
        "megatron.core",
        reason="megatron-core is not installed: install the writers as README.md 'Run the tests' says (pinned, --no-deps)",
    )
    from megatron.core.dist_checkpointing.validation import verify_checkpoint_and_load_strategy

    run = shutil.copytree(DATA / "dense1", tmp_path / "dense1")
    it = run / RUNS["dense1"]
    verify_checkpoint_and_load_strategy(str(it))  # megatron's own load reads the saved config
    (it / "metadata.json").write_text(config)
    with pytest.raises(Exception):  # noqa: B017  (JSONDecodeError, TypeError, CheckpointingException)
        verify_checkpoint_and_load_strategy(str(it))
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(run)])
    assert r.exit_code == 1, r.output
    findings = json.loads(r.stdout)["findings"]
    assert [f["code"] for f in findings] == ["K013"], findings
    assert findings[0]["key"] == "metadata.json" and findings[0]["message"].startswith(f"{it / 'metadata.json'}: ")
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # the other fields default
    verify_checkpoint_and_load_strategy(str(it))
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run)])
    assert r.exit_code == 0, r.output


def test_a_missing_common_pt_is_named(tmp_path: Path) -> None:
    """With iter_N/common.pt missing, validate --strict gave ten O001/P004 findings (state without param groups)
    and never said the file is missing; megatron-core's own load_common_state_dict fails without it. K014 names it;
    the save with it has no K014."""
    pytest.importorskip(
        "megatron.core",
        reason="megatron-core is not installed: install the writers as README.md 'Run the tests' says (pinned, --no-deps)",
    )
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    run = shutil.copytree(DATA / "dense1", tmp_path / "dense1")
    it = run / RUNS["dense1"]
    assert isinstance(load_common_state_dict(str(it)), dict)
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run)])
    assert r.exit_code == 0 and json.loads(r.stdout)["findings"] == [], r.output
    (it / "common.pt").unlink()
    with pytest.raises(Exception):  # noqa: B017  (megatron-core's own load of the common state)
        load_common_state_dict(str(it))
    r = runner.invoke(app, ["validate", "--strict", "--json", str(run)])
    assert r.exit_code == 1, r.output
    [f] = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "K014"]
    assert f["key"] == "common.pt" and f["severity"] == "error"
    assert f["message"].startswith(f"{it / 'common.pt'}: missing; megatron-core's dist_checkpointing.load")


def test_megatron_names_saved_layer_by_layer_are_not_a_dist_checkpointing_save(tmp_path: Path) -> None:
    """``dcp.save(model.state_dict())`` of a Megatron GPTModel in a user's own loop keeps a key per layer
    (``decoder.layers.0.mlp.linear_fc1.weight``): it was labelled megatron, and validate failed with K014 (common.pt
    missing, which dist_checkpointing.load needs) and stats said its layers were stacked. dist_checkpointing stacks
    a TransformerBlock's layers on dim 0 (``decoder.layers.<name> [L, ...]``): a per-layer save through torch's
    DefaultSavePlanner is top-level now, validate --strict OK; the same tensors stacked as dist_checkpointing saves
    them, without common.pt, are still megatron and K014."""
    torch.manual_seed(0)
    per_layer = {"embedding.word_embeddings.weight": torch.randn(16, 8)}
    for i in range(2):
        per_layer[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.randn(24, 8)
        per_layer[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.randn(32, 8)
    per_layer |= {"decoder.final_layernorm.weight": torch.ones(8), "output_layer.weight": torch.randn(16, 8)}
    dcp.save(per_layer, checkpoint_id=str(tmp_path / "loop"))
    runner = CliRunner()
    doc = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "loop"), "--json"]).stdout)
    assert (doc["key_schema"]["id"], doc["key_schema"]["naming"]) == ("top-level", "megatron")
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "loop"), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.output
    res = runner.invoke(app, ["stats", str(tmp_path / "loop")])
    assert res.exit_code == 0 and "stacked" not in res.output, res.output

    stacked = {k: v for k, v in per_layer.items() if ".layers." not in k}
    for name in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"):
        stacked[f"decoder.layers.{name}"] = torch.stack([per_layer[f"decoder.layers.{i}.{name}"] for i in range(2)])
    dcp.save(stacked, checkpoint_id=str(tmp_path / "stacked"))
    doc = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "stacked"), "--json"]).stdout)
    assert doc["key_schema"]["id"] == "megatron"
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "stacked"), "--json"])
    assert res.exit_code == 1 and [f["code"] for f in json.loads(res.stdout)["findings"]] == ["K014"], res.output


def test_a_key_per_layer_saved_by_megatrons_planner_is_megatron(tmp_path: Path) -> None:
    """dist_checkpointing keeps a key per layer (``decoder.layers.3.mixer...``) for a MambaBlock (hybrid models)
    and for non-homogeneous TransformerBlock layers, saved by its MCoreSavePlanner with ``flatten_state_dict=False``
    (no planner_data). Such a save lost its megatron label with the per-layer rule alone (no common.pt read, no
    K014): the per-layer keys of a torch DefaultSavePlanner save (planner_data) are top-level, megatron's stay
    megatron."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    torch.manual_seed(0)
    sd = {"embedding.word_embeddings.weight": torch.randn(16, 8), "output_layer.weight": torch.randn(16, 8)}
    for i in range(2):
        sd[f"decoder.layers.{i}.mixer.in_proj.weight"] = torch.randn(24, 8)
        sd[f"decoder.layers.{i}.mixer.out_proj.weight"] = torch.randn(8, 8)
    sd["decoder.final_norm.weight"] = torch.ones(8)
    dcp.save(sd, checkpoint_id=str(tmp_path / "mcore"), planner=DefaultSavePlanner(flatten_state_dict=False))
    dcp.save(sd, checkpoint_id=str(tmp_path / "loop"))
    runner = CliRunner()
    for name, schema in (("mcore", "megatron"), ("loop", "top-level")):
        doc = json.loads(runner.invoke(app, ["inspect", str(tmp_path / name), "--json"]).stdout)
        assert doc["key_schema"]["id"] == schema, name
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "mcore"), "--json"])
    assert res.exit_code == 1 and [f["code"] for f in json.loads(res.stdout)["findings"]] == ["K014"], res.output


def _bridge_train_state(step: object) -> dict:
    """megatron.bridge.training.state.TrainState.state_dict() at ``step``, as Bridge's save_checkpoint torch.saves it
    into iter_N/train_state.pt and copies to the save folder's latest_train_state.pt."""
    return {
        "step": step,
        "consumed_train_samples": torch.tensor(24, dtype=torch.int32),
        "skipped_train_samples": torch.tensor(0, dtype=torch.int32),
        "consumed_valid_samples": torch.tensor(0, dtype=torch.int32),
        "floating_point_operations_so_far": torch.tensor(0.0, dtype=torch.float64),
        "do_train": torch.tensor(True),
        "do_valid": torch.tensor(False),
        "do_test": torch.tensor(False),
    }


def test_step_latest_follows_megatron_bridges_own_tracker(tmp_path: Path) -> None:
    """Megatron Bridge's load_checkpoint takes the iteration from ``latest_train_state.pt`` (``read_train_state``:
    its TrainState's ``step``), never the highest ``iter_N``. ``--step latest`` on its save folder holding iterations
    3 and 5 with the tracker naming 3 (an interrupted run restarted from 3) took iteration 5, "the highest step". Now
    it takes iteration 3, says step 5 is newer, and refuses a tracker naming an iteration not there (E205), one whose
    save did not finish (E202), or one that holds no integer step (E205), each naming the file."""
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").unlink()  # Bridge before its compatibility tracker writes none
    shutil.copytree(run / "iter_0000003", run / "iter_0000005")
    tracker = run / "latest_train_state.pt"
    torch.save(_bridge_train_state(torch.tensor(3, dtype=torch.int32)), tracker)
    r = runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0, r.output
    loc = json.loads(r.stdout)["location"]
    assert loc["model"] == str(run / "iter_0000003") and loc["step"] == 3
    assert loc["how"].startswith("`step` latest: step 3 (named by latest_train_state.pt; step 5 below it is newer")
    (run / "latest_checkpointed_iteration.txt").write_text("5")  # Bridge reads its own tracker first
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert loc["step"] == 3
    torch.save(_bridge_train_state(torch.tensor(7, dtype=torch.int32)), tracker)
    r = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert r.exit_code == 2 and "[E205]" in r.stderr and f"{tracker}: names step 7" in r.stderr, r.output
    torch.save(_bridge_train_state(torch.tensor(5, dtype=torch.int32)), tracker)
    (run / "iter_0000005" / "metadata.json").unlink()  # its save did not finish
    r = runner.invoke(app, ["export", str(run), str(tmp_path / "out"), "--step", "latest"])
    assert r.exit_code == 2 and "[E202]" in r.stderr and str(tracker) in r.stderr, r.output
    assert not (tmp_path / "out").exists()
    for bad in (torch.tensor(3.0), torch.tensor(True), torch.tensor([3, 5])):
        torch.save(_bridge_train_state(bad), tracker)
        r = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
        assert r.exit_code == 2 and "[E205]" in r.stderr and f"{tracker}: holds no iteration" in r.stderr, r.output
        assert "Traceback" not in r.output


def test_bridge_tracker_is_read_without_running_its_pickle(tmp_path: Path) -> None:
    """latest_train_state.pt is a torch.save (a pickle): read by ckpttool's allow-list unpickler, a global off the
    list (os.system) is never called; the tracker is refused (E205) naming it, not followed nor passed over."""
    run = shutil.copytree(DATA / "dense1", tmp_path / "run")
    flag = tmp_path / "ran"

    class _Run:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            import os

            return (os.system, (f"touch {flag}",))

    torch.save({"step": _Run()}, run / "latest_train_state.pt")
    r = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert r.exit_code == 2 and "[E205]" in r.stderr and str(run / "latest_train_state.pt") in r.stderr, r.output
    assert not flag.exists() and "cannot be read as Megatron Bridge's TrainState" in r.stderr
    (run / "latest_train_state.pt").write_bytes(b"3")  # not a torch.save: no iteration known, not passed over
    r = runner.invoke(app, ["inspect", str(run), "--step", "latest"])
    assert r.exit_code == 2 and "[E205]" in r.stderr and "not a torch.save archive" in r.stderr, r.output
    (run / "latest_train_state.pt").unlink()
    (run / "latest_train_state.pt").mkdir()  # Bridge's os.path.isfile passes over a folder: the .txt is followed
    loc = json.loads(runner.invoke(app, ["inspect", "--json", str(run), "--step", "latest"]).stdout)["location"]
    assert loc["how"].startswith("`step` latest: step 3 (named by latest_checkpointed_iteration.txt")
