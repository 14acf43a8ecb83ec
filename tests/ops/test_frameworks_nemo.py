"""NeMo Automodel 0.7 checkpoints written by its own ``Checkpointer`` (tests/fixtures/nemo_writer.py).

The step directory ``epoch_0_step_2/`` holds ``model/`` (HuggingFaceStorageWriter safetensors) and
``optim/`` (DCP): opened as one checkpoint without flags. References: the model's and optimizer's
own ``state_dict()`` after the steps, and torch's ``dcp.load`` of ``optim/``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format.hf_storage import load_hf_storage_metadata
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow

runner = CliRunner()


def _nemo_build(fixture_root: Path, name: str, builder: str) -> Path:
    """A run written by NeMo Automodel's own checkpoint code (``tests.fixtures.nemo_writer.<builder>``), cached as
    ``name``; skipped where NeMo Automodel or transformers is not installed."""
    import importlib

    from tests.fixtures.writers import missing

    why = missing("nemo_automodel.components.checkpoint.checkpointing", "transformers")
    if why:
        pytest.skip(why)
    return cached_build(fixture_root, name, getattr(importlib.import_module("tests.fixtures.nemo_writer"), builder))


@pytest.fixture(scope="module")
def nemo_root(fixture_root: Path) -> Path:
    return _nemo_build(fixture_root, "writers_nemo", "build_nemo")


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def test_step_dir_opens_model_and_optimizer(nemo_root: Path) -> None:
    for given in (nemo_root / "run", nemo_root / "run" / "epoch_0_step_2"):
        doc = json.loads(cli("inspect", str(given), "--json"))
        assert doc["location"]["model"].endswith("epoch_0_step_2/model")
        assert doc["location"]["optimizer"].endswith("epoch_0_step_2/optim")
        ks = doc["key_schema"]
        assert ks["id"] == "nemo-automodel" and ks["model_prefix"] == "" and ks["optimizer_prefix"] == "optim."
        assert doc["training_state"] and "sched" in doc["training_state"]
        assert doc["summary"]["model_tensor_count"] == 21
    doc = json.loads(cli("validate", str(nemo_root / "run"), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["error"] == doc["counts"]["warning"] == 0


def test_export_replay_diff_manifest(nemo_root: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = str(nemo_root / "run" / "epoch_0_step_2")
    cli("export", src, str(tmp_path / "hf"))
    got: dict = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        got.update(load_file(f))
    want = torch.load(nemo_root / "expected.pt", weights_only=True)
    assert sorted(got) == sorted(want["model"]) and all(got[k].equal(v) for k, v in want["model"].items())
    doc = json.loads(cli("replay-step", src, "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 21 and all(p["step_before"] == 2 for p in doc["params"])
    doc = json.loads(cli("diff", src, str(tmp_path / "hf"), "--json"))
    assert doc["equal"] and doc["counts"]["compared"] == 21
    cli("manifest", src, "-o", str(tmp_path / "m.json"))
    cli("manifest", src, "--verify", "--output", str(tmp_path / "m.json"))


def test_optimizer_state_matches_torch_reader(nemo_root: Path) -> None:
    """torch's dcp.load of optim/ and the optimizer's own state_dict agree with what replay read."""
    import torch
    import torch.distributed.checkpoint as dcp

    want = torch.load(nemo_root / "expected.pt", weights_only=True)
    names = list(want["model"])  # parameters in order (no buffers in a Llama state dict)
    key = f"optim.state.{names[3]}.exp_avg"
    sd = {key: torch.zeros_like(want["model"][names[3]])}
    dcp.load(sd, checkpoint_id=str(nemo_root / "run" / "epoch_0_step_2" / "optim"))
    assert sd[key].equal(want["optim"]["state"][3]["exp_avg"])


def _save_with_scheduler_ahead(root: Path, extra: int) -> Path:
    """NeMo's own ``Checkpointer`` saves a model trained two AdamW steps, its optimizer and a ``LambdaLR``
    stepped ``extra`` more times than the optimizer (a scheduler of another step saved beside it)."""
    import torch

    from tests.fixtures.nemo_writer import nemo_checkpointer, tiny_llama

    model, optim, sched = tiny_llama(small=True, decay=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randint(0, 64, (1, 8), generator=gen)).logits.float().pow(2).mean().backward()
        optim.step()
        sched.step()
    for _ in range(extra):
        sched.step()
    ckpt = nemo_checkpointer(model, root, consolidated=False)
    step = root / "epoch_0_step_1"
    ckpt.save_model(model, str(step))
    ckpt.save_optimizer(optim, model, str(step), sched)
    return step


def test_scheduler_of_another_step_fails_r002(nemo_root: Path, tmp_path: Path) -> None:
    """NeMo Automodel saves its LR scheduler as ``sched`` in ``optim/``; R002 compared only items named
    ``lr_scheduler``/``scheduler``, so a scheduler three steps ahead of the optimizer passed validate --deep.
    Now its ``last_epoch`` is compared with the optimizer's step; NeMo's own save of a run in step passes."""
    ok = _save_with_scheduler_ahead(tmp_path / "ok", 0)
    doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(ok)))
    assert doc["ok"] and "R002" not in {f["code"] for f in doc["findings"]}, doc["findings"]
    bad = _save_with_scheduler_ahead(tmp_path / "bad", 3)
    doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(bad), code=1))
    (r002,) = [f for f in doc["findings"] if f["code"] == "R002"]
    assert r002["key"] == "sched.last_epoch"
    assert r002["message"].startswith("LR scheduler sched.last_epoch = 5 but optim.state.") and r002[
        "message"
    ].endswith(".step = 2")


def _step_scheduler_state(yields: int) -> dict:
    """NeMo's own ``StepScheduler`` state as its recipe saves it (``torch.save(step_scheduler.state_dict())``
    inside the training loop) after ``yields`` optimizer steps."""
    from nemo_automodel.components.training.step_scheduler import StepScheduler

    sched = StepScheduler(
        global_batch_size=1, local_batch_size=1, dp_size=1, dataloader=list(range(10)), preemption_signal=None
    )
    for i, _ in enumerate(sched):
        if i + 1 == yields:
            return sched.state_dict()
    raise AssertionError("too few batches")


def test_recipe_step_scheduler_beside_is_read_and_compared(nemo_root: Path, tmp_path: Path) -> None:
    """NeMo Automodel's recipes save their StepScheduler (``step``, ``epoch``) as ``step_scheduler.pt`` beside
    ``model/`` and ``optim/``; a resume continues from its ``step``. It was not read at all: one from another
    step passed validate --deep. Now inspect shows it (``trainer_state``) and R002 compares its step with the
    optimizer's."""
    import torch

    step = _save_with_scheduler_ahead(tmp_path / "run", 0)  # NeMo names it epoch_0_step_1 after 2 optimizer steps
    torch.save(_step_scheduler_state(2), step / "step_scheduler.pt")
    doc = json.loads(cli("inspect", "--json", str(step)))
    assert doc["trainer_state"][0]["file"] == "step_scheduler.pt"
    assert doc["trainer_state"][0]["values"] == {"step": 2, "epoch": 0}
    doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(step)))
    assert doc["ok"] and "R002" not in {f["code"] for f in doc["findings"]}, doc["findings"]
    torch.save(_step_scheduler_state(5), step / "step_scheduler.pt")  # the state of a later step
    doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(step), code=1))
    r002 = {f["key"]: f["message"] for f in doc["findings"] if f["code"] == "R002"}
    assert r002.pop("sched.last_epoch") == "LR scheduler sched.last_epoch = 2 but step_scheduler.pt:step = 5"
    assert r002.pop("step_scheduler.pt:step") == (
        "step_scheduler.pt:step = 5 but its directory is epoch_0_step_1 (step 1; a save there holds step 1 or 2)"
    )
    ((key, message),) = r002.items()
    assert key.startswith("optim.state.") and message.endswith(", the largest) but step_scheduler.pt:step = 5")


def test_recipe_rng_and_dataloader_folders_beside_are_named(nemo_root: Path, tmp_path: Path) -> None:
    """NeMo Automodel's recipes save their RNG (``Checkpointer.save_on_global_ranks``:
    ``rng/rng_global_rank_R.pt``) and data loader (``save_on_dp_ranks``: ``dataloader/dataloader_dp_rank_R.pt``)
    into folders of the step directory, beside ``model/`` and ``optim/``; a resume loads them. ckpttool reads
    neither, and validate --strict said OK over them (only files beside the pair were named). Now K012 names
    the folders."""
    import shutil

    from nemo_automodel.components.training.rng import StatefulRNG

    from tests.fixtures.nemo_writer import nemo_checkpointer, tiny_llama

    run = shutil.copytree(nemo_root / "run", tmp_path / "run")
    step = run / "epoch_0_step_2"
    model, _, _ = tiny_llama(small=True, decay=False)
    ckpt = nemo_checkpointer(model, run, consolidated=False)
    ckpt.save_on_global_ranks(StatefulRNG(seed=1), "rng", str(step))
    doc = json.loads(cli("validate", "--strict", "--json", str(run), code=1))
    (k012,) = [f for f in doc["findings"] if f["code"] == "K012"]
    assert k012["message"].endswith("training state beside model/ that ckpttool does not read: epoch_0_step_2/rng/")

    class Loader:  # a stateful data loader's state_dict(), as torchdata's StatefulDataLoader gives
        def state_dict(self) -> dict[str, int]:
            return {"_num_yielded": 2, "_sampler_iter_yielded": 2}

    ckpt.save_on_dp_ranks(Loader(), "dataloader", str(step))
    doc = json.loads(cli("inspect", "--json", str(step)))
    assert doc["unread_beside"] == ["dataloader/", "rng/"]
    doc = json.loads(cli("validate", "--strict", "--json", str(step / "model"), code=1))  # model/ alone
    (k012,) = [f for f in doc["findings"] if f["code"] == "K012"]
    assert k012["message"].endswith(
        f"does not read: {step / 'dataloader'}/, {step / 'rng'}/, {step / 'optim'}/; {step / 'optim'}/ is the "
        f"optimizer folder of model/: open {step} to read them together"
    )


def test_manifest_covers_the_recipe_step_scheduler(nemo_root: Path, tmp_path: Path) -> None:
    """``step_scheduler.pt`` beside ``model/`` and ``optim/`` (the step a NeMo recipe resumes from) was in no
    manifest: one of another step passed ``manifest --verify``. Now it is digested, and checked on verify."""
    import shutil

    import torch

    step = shutil.copytree(nemo_root / "run" / "epoch_0_step_2", tmp_path / "epoch_0_step_2")
    torch.save(_step_scheduler_state(2), step / "step_scheduler.pt")
    cli("manifest", str(step))
    doc = json.loads((step / "model" / "manifest.json").read_text())
    assert [f["file"] for f in doc["training_state"]] == ["step_scheduler.pt"]
    cli("manifest", str(step), "--verify")
    torch.save(_step_scheduler_state(5), step / "step_scheduler.pt")  # the state of a later step
    out = cli("manifest", str(step), "--verify", code=1)
    assert "changed  step_scheduler.pt: differs from the manifest" in out
    (step / "step_scheduler.pt").unlink()
    out = cli("manifest", str(step), "--verify", code=1)
    assert out.count("missing  step_scheduler.pt: in the manifest, not on disk") == 1, out


def test_manifest_of_the_pair_digests_its_metadata_and_assets(nemo_root: Path, tmp_path: Path) -> None:
    """A model/optimizer pair's manifest had no ``sidecars`` and a ``null`` metadata digest: a changed byte in
    ``optim/.metadata`` (a planner_data path: torch's load then unflattens the key elsewhere) or in the HF
    config NeMo saved passed ``manifest --verify``. The step directory's other files are now digested."""
    import shutil

    step = shutil.copytree(nemo_root / "run" / "epoch_0_step_2", tmp_path / "epoch_0_step_2")
    cli("manifest", str(step))
    doc = json.loads((step / "model" / "manifest.json").read_text())
    assert [f["file"] for f in doc["sidecars"]] == [
        "model/consolidate.sh",
        "model/.hf_metadata/config.json",
        "model/.hf_metadata/fqn_to_file_index_mapping.json",
        "model/.hf_metadata/generation_config.json",
        "optim/.metadata",
    ]
    cli("manifest", str(step), "--verify")
    md = step / "optim" / ".metadata"
    data = bytearray(md.read_bytes())
    at = data.index(b"param_groups.model.layers.0.mlp.gate_proj.weight.decoupled_weight_decay")
    data[at + 7] = ord("'")
    md.write_bytes(bytes(data))
    (step / "model" / ".hf_metadata" / "config.json").write_text("{}")
    out = cli("manifest", str(step), "--verify", code=1)
    assert "changed  optim/.metadata: differs from the manifest" in out
    assert "changed  model/.hf_metadata/config.json: differs from the manifest" in out


def _retag_safetensors(path: Path, key: str, old: str, new: str) -> None:
    """Change ``key``'s dtype tag in a safetensors header in place (same length, same byte size)."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    assert header[key]["dtype"] == old and len(old) == len(new)
    header[key]["dtype"] = new
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    path.write_bytes(data[:8] + text + data[8 + n :])


def test_export_refuses_a_parameter_retagged_as_integer(nemo_root: Path, tmp_path: Path) -> None:
    """A model file's header retagged ``F32`` -> ``I32`` (same byte size; the header is the only record of the
    dtype) was exported as an int32 tensor with exit 0. Its optimizer state (float32 moments of its shape)
    refutes the dtype: export refuses with E511 naming the file and key, writes nothing, changes nothing."""
    import hashlib
    import shutil

    step = shutil.copytree(nemo_root / "run" / "epoch_0_step_2", tmp_path / "epoch_0_step_2")
    shard = step / "model" / "shard-00001-model-00001-of-00001.safetensors"
    _retag_safetensors(shard, "model.norm.weight", "F32", "I32")
    before = hashlib.sha256(shard.read_bytes()).hexdigest()
    res = runner.invoke(app, ["export", str(step), str(tmp_path / "hf")])
    assert res.exit_code == 2 and res.stdout == "", (res.stdout, res.stderr)
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"error: [E511] {shard}: 'model.norm.weight' is stored as int32, but its optimizer ")
    assert "'optim.state.model.norm.weight.exp_avg' is float32" in first
    assert "Traceback" not in res.stderr and not (tmp_path / "hf").exists()
    assert hashlib.sha256(shard.read_bytes()).hexdigest() == before
    doc = json.loads(cli("validate", str(step), "--json", code=1))
    o005 = [f["message"] for f in doc["findings"] if f["code"] == "O005"]
    assert o005 == [
        "model.norm.weight: the parameter model.norm.weight is stored as int32, a dtype no optimizer steps, while "
        "its exp_avg is float32: the parameter's dtype record is wrong (a changed header?)"
    ]


def test_verify_names_the_pair_safetensors_model_and_dcp_optimizer(nemo_root: Path, tmp_path: Path) -> None:
    """``manifest --verify`` of a NeMo step printed ``(safetensors)``: the label took the step directory without
    a ``.metadata`` for a Hugging Face folder, though its optimizer is a DCP checkpoint (``optim/.metadata``)."""
    import shutil

    step = shutil.copytree(nemo_root / "run" / "epoch_0_step_2", tmp_path / "epoch_0_step_2")
    cli("manifest", str(step))
    out = cli("manifest", str(step), "--verify")
    assert out.startswith(f"{step} (safetensors + dcp) matches its manifest "), out


def test_model_folder_opened_alone_names_its_optimizer_folder(nemo_root: Path) -> None:
    """model/ of a NeMo step opened alone read the weights, said "state for 0/21 params" and validate --strict
    passed, optim/ beside it (the step's AdamW state, a DCP checkpoint) never mentioned; now inspect names it
    (not read) and K012 says to open the step directory."""
    step = nemo_root / "run" / "epoch_0_step_2"
    doc = json.loads(cli("inspect", "--json", str(step / "model")))
    assert doc["unread_beside"] == [f"{step / 'optim'}/"]
    doc = json.loads(cli("validate", "--strict", "--json", str(step / "model"), code=1))
    (k012,) = [f for f in doc["findings"] if f["code"] == "K012"]
    assert k012["message"].endswith(f"open {step} to read them together"), k012
    # per-rank shards with the config.json NeMo saved in .hf_metadata/: its model class proves the shapes (no S017)
    assert {f["code"] for f in doc["findings"]} == {"K012"}, doc["findings"]
    model = nemo_root / "steps" / "run" / "epoch_0_step_2" / "model"  # save_consolidated=True: model/consolidated/
    shards = load_hf_storage_metadata(model).shards
    assert shards is not None and shards.verified_by == str(model / "consolidated")
    doc = json.loads(cli("validate", "--strict", "--json", str(model), code=1))
    assert {f["code"] for f in doc["findings"]} == {"K012"}, doc["findings"]
    assert json.loads(cli("inspect", "--json", str(step)))["unread_beside"] == []  # the pair: both read


def test_replay_of_the_model_folder_alone_names_the_step_directory(nemo_root: Path) -> None:
    """replay-step of model/ alone (E514) hinted at --optimizer-dir in general; the hint names optim/ beside it
    and the step directory that holds both."""
    step = nemo_root / "run" / "epoch_0_step_2"
    res = runner.invoke(app, ["replay-step", "--device", "cpu", str(step / "model")])
    assert res.exit_code == 2 and "[E514]" in res.stderr, res.output
    assert f"hint: its optimizer folder {step / 'optim'}/ lies beside it: pass the step directory {step}," in res.stderr


def test_import_of_nemos_model_folder_reads_the_config_nemo_saved_beside_it(nemo_root: Path, tmp_path: Path) -> None:
    """NeMo Automodel's ``model/`` keeps the model's config.json in ``model/.hf_metadata/``: import found none, so
    ``--schema torch-native`` checked nothing against the model class (silently) and ``--schema torchtitan`` was
    refused for want of the heads; it reads that config, as inspect and validate do (``hf_config_beside``)."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    model = nemo_root / "run" / "epoch_0_step_2" / "model"
    assert (model / ".hf_metadata" / "config.json").is_file() and not (model / "config.json").exists()
    res = runner.invoke(app, ["import", str(model), str(tmp_path / "native"), "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model_check"]["checked"] is True and doc["model_check"]["model_class"] == "LlamaForCausalLM", doc
    (shard,) = model.glob("*.safetensors")
    ref = load_file(str(shard))
    sd = {f"model.{k}": torch.empty_like(v) for k, v in ref.items()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "native"), no_dist=True)
    assert all(torch.equal(sd[f"model.{k}"].view(torch.uint8), v.view(torch.uint8)) for k, v in ref.items())
    res = runner.invoke(app, ["import", str(model), str(tmp_path / "titan"), "--schema", "torchtitan"])
    assert res.exit_code == 0, res.stderr


def test_a_save_in_another_steps_directory_fails_r002(nemo_root: Path, tmp_path: Path) -> None:
    """NeMo Automodel names a step directory ``epoch_E_step_S`` by its step (``recipes/llm/train_ft.py``: S is
    StepScheduler.step before its increment, so the save after N optimizer steps is step N - 1; its
    speculative-decoding recipes name it N). The directory was never compared: NeMo's own save of step 2
    copied into ``epoch_0_step_5`` (a resume continues at step 5) passed validate --strict --deep. R002 now
    compares the saved step (step_scheduler.pt's, else the optimizer's) with the directory's, N or N + 1."""
    import shutil

    import torch

    saved = _save_with_scheduler_ahead(tmp_path / "run", 0)  # 2 optimizer steps, saved as epoch_0_step_1
    for name in ("epoch_0_step_1", "epoch_0_step_2"):  # the names NeMo's recipes give a save after 2 steps
        step = saved if name == saved.name else shutil.copytree(saved, tmp_path / "run" / name)
        doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(step)))
        assert doc["ok"] and "R002" not in {f["code"] for f in doc["findings"]}, doc["findings"]
    moved = shutil.copytree(saved, tmp_path / "run" / "epoch_0_step_5")
    doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(moved), code=1))
    ((key, message),) = [(f["key"], f["message"]) for f in doc["findings"] if f["code"] == "R002"]
    assert key.startswith("optim.state.") and key.endswith(".step"), key
    assert message == f"{key} = 2 but its directory is epoch_0_step_5 (step 5; a save there holds step 5 or 6)"
    torch.save(_step_scheduler_state(2), moved / "step_scheduler.pt")  # the recipe's own counter: named first
    doc = json.loads(cli("validate", "--strict", "--deep", "--json", str(moved), code=1))
    r002 = {f["key"]: f["message"] for f in doc["findings"] if f["code"] == "R002"}
    assert r002 == {
        "step_scheduler.pt:step": "step_scheduler.pt:step = 2 but its directory is epoch_0_step_5 (step 5; a save "
        "there holds step 5 or 6)"
    }


def test_diff_names_the_safetensors_model_folder_as_manifest_does(nemo_root: Path, tmp_path: Path) -> None:
    """``diff`` of two NeMo steps labelled each side "(dcp, nemo-automodel)" though the ``model/`` folder it opened
    is NeMo's safetensors (``model_save_format="safetensors"``) beside a DCP ``optim/``: the label is now the
    pair's parts, as ``manifest --verify`` names them (``--json``: ``folder``; ``kind`` stays how it is compared)."""
    a, b = nemo_root / "steps" / "run" / "epoch_0_step_2", nemo_root / "steps" / "run" / "epoch_1_step_4"
    out = runner.invoke(app, ["diff", str(a), str(b)])
    assert out.exit_code == 1, out.output
    assert f"A: {a}: opened {a / 'model'} (safetensors + dcp, nemo-automodel)\n" in out.stdout, out.stdout
    res = runner.invoke(app, ["diff", "--json", str(a), str(b)])
    doc = json.loads(res.stdout)
    assert (doc["a"]["kind"], doc["a"]["folder"], doc["b"]["folder"]) == (
        "dcp",
        "safetensors + dcp",
        "safetensors + dcp",
    )


def test_torch_save_format_opens_both_dcp_folders_as_the_pair(nemo_root: Path, tmp_path: Path) -> None:
    """``model_save_format="torch_save"``: ``model/`` is DCP too (no safetensors, no ``.hf_metadata/``); the step
    reads as the same pair, and export gives the model's own ``state_dict()`` after the steps."""
    import torch
    from safetensors.torch import load_file

    root = nemo_root / "torch_save"
    step = root / "run" / "epoch_0_step_2"
    assert (step / "model" / ".metadata").is_file() and not list((step / "model").glob("*.safetensors"))
    doc = json.loads(cli("inspect", str(root / "run"), "--step", "latest", "--json"))
    assert doc["location"]["model"] == str(step / "model") and doc["location"]["optimizer"] == str(step / "optim")
    assert doc["key_schema"]["id"] == "nemo-automodel" and doc["summary"]["model_tensor_count"] == 21
    doc = json.loads(cli("validate", str(root / "run"), "--step", "latest", "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["error"] == doc["counts"]["warning"] == 0
    cli("export", str(step), str(tmp_path / "hf"))
    got: dict = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        got.update(load_file(f))
    want = torch.load(root / "expected.pt", weights_only=True)["model"]
    assert sorted(got) == sorted(want) and all(got[k].equal(v) for k, v in want.items())
    doc = json.loads(cli("replay-step", str(step), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 21 and all(p["step_before"] == 2 for p in doc["params"])


def test_torch_save_format_missing_optimizer_file_or_metadata_fails(nemo_root: Path, tmp_path: Path) -> None:
    """A torch_save step without its optimizer data file fails ``validate --strict`` (S002 naming it); without
    ``optim/.metadata`` (a save that did not finish) it is E202, never the model alone said OK."""
    import shutil

    for gone, code in (("optim/__0_0.distcp", 1), ("optim/.metadata", 2)):
        run = tmp_path / gone.replace("/", "_") / "run"
        shutil.copytree(nemo_root / "torch_save" / "run", run)
        (run / "epoch_0_step_2" / gone).unlink()
        res = runner.invoke(app, ["validate", str(run), "--step", "latest", "--strict", "--json"])
        assert res.exit_code == code, res.output
        if code == 1:
            doc = json.loads(res.stdout)
            assert not doc["ok"]
            assert [f["key"] for f in doc["findings"] if f["code"] == "S002"] == [gone], doc["findings"]
        else:
            assert "[E202]" in res.stderr and "epoch_0_step_2/optim has 1 data file(s), no .metadata" in res.stderr


@pytest.fixture(scope="module")
def nemo_fsdp2_root(fixture_root: Path) -> Path:
    return _nemo_build(fixture_root, "writers_nemo_fsdp2", "build_nemo_fsdp2")


def test_fsdp2_save_of_two_ranks_exports_as_saved(nemo_fsdp2_root: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    step = nemo_fsdp2_root / "run" / "epoch_0_step_2"
    assert sorted(p.name for p in (step / "model").glob("*.safetensors")) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    doc = json.loads(cli("validate", str(nemo_fsdp2_root / "run"), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["error"] == doc["counts"]["warning"] == 0
    cli("export", str(step), str(tmp_path / "hf"))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = torch.load(nemo_fsdp2_root / "expected.pt", weights_only=True)["model"]
    assert sorted(got) == sorted(want) and all(got[k].equal(v) for k, v in want.items())
    doc = json.loads(cli("replay-step", str(step), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 21


def test_fsdp2_save_missing_the_last_ranks_shard_is_refused_not_exported_halved(
    nemo_fsdp2_root: Path, tmp_path: Path
) -> None:
    """Without rank 1's shard-00002 file the step directory (model/ + optim/) exported 21 tensors of half their rows
    at exit 0: the pair's metadata dropped what the shard files prove (nothing: no world size, no global shape), so
    neither the check against .hf_metadata/config.json ran nor a warning was said. Now export is E605 naming the
    shapes and writes nothing, and validate's M010 names each tensor, as for model/ opened alone."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(nemo_fsdp2_root / "run", run)
    step = run / "epoch_0_step_2"
    (step / "model" / "shard-00002-model-00001-of-00001.safetensors").unlink()
    res = runner.invoke(app, ["export", str(step), str(tmp_path / "hf")])
    assert res.exit_code == 2, res.output
    assert (
        "[E605]" in res.stderr and "model.embed_tokens.weight: [64, 32], LlamaForCausalLM has [128, 32]" in res.stderr
    )
    assert not (tmp_path / "hf").exists()
    res = runner.invoke(app, ["validate", str(run), "--step", "latest", "--json"])
    assert res.exit_code == 1, res.output
    m010 = [f["key"] for f in json.loads(res.stdout)["findings"] if f["code"] == "M010"]
    assert len(m010) == 21 and "model.embed_tokens.weight" in m010
