"""Training state saved beside the weights in a form ckpttool does not read is named, never passed over:
rule ``K012`` (``--strict`` fails) and ``inspect``'s ``unread_beside``. Folders laid out as Hugging Face's
``Trainer`` saves them (weights by ``save_pretrained``, ``torch.save`` of the optimizer and scheduler state,
``TrainerState.save_to_json``), as Accelerate's FSDP folders with its ``save_state`` files, and DeepSpeed's
``global_stepN/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.trainer_callback import TrainerState
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8))).loss.backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _hf_trainer_checkpoint(root: Path) -> Path:
    """``checkpoint-1/`` as ``Trainer._save_checkpoint`` writes it without FSDP/DeepSpeed."""
    model, opt, sched = _trained()
    ckpt = root / "checkpoint-1"
    model.save_pretrained(ckpt)
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    torch.save(sched.state_dict(), ckpt / "scheduler.pt")
    torch.save({"python": None, "cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")
    TrainerState(global_step=1).save_to_json(str(ckpt / "trainer_state.json"))
    return ckpt


def validate(*args: str) -> tuple[int, list[dict[str, str]]]:
    res = runner.invoke(app, ["validate", "--strict", "--json", *args])
    return res.exit_code, json.loads(res.stdout)["findings"]


def test_hf_trainer_state_beside_the_weights_is_named(tmp_path: Path) -> None:
    ckpt = _hf_trainer_checkpoint(tmp_path)
    code, findings = validate(str(ckpt))
    k012 = [f for f in findings if f["code"] == "K012"]
    assert code == 1 and len(k012) == 1, findings
    assert k012[0]["message"].endswith("optimizer.pt, rng_state.pth, scheduler.pt, trainer_state.json")
    # inspect lists them, relative to the directory given (a run root with --step)
    res = runner.invoke(app, ["inspect", str(tmp_path), "--step", "latest", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["unread_beside"] == [
        "checkpoint-1/optimizer.pt",
        "checkpoint-1/rng_state.pth",
        "checkpoint-1/scheduler.pt",
        "checkpoint-1/trainer_state.json",
    ]
    text = runner.invoke(app, ["inspect", str(ckpt)]).stdout
    assert "not read    optimizer.pt, rng_state.pth, scheduler.pt, trainer_state.json" in text
    # acknowledged: the rest passes; without those files there is nothing to name
    assert validate(str(ckpt), "--ignore", "K012")[0] == 0
    for name in ("optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"):
        (ckpt / name).unlink()
    code, findings = validate(str(ckpt))
    assert code == 0 and not [f for f in findings if f["code"] == "K012"]
    assert json.loads(runner.invoke(app, ["inspect", str(ckpt), "--json"]).stdout)["unread_beside"] == []


@pytest.mark.parametrize("beside", ["scheduler.bin", "random_states_0.pkl", "global_step1/"])
def test_state_beside_a_model_optimizer_pair_is_named(tmp_path: Path, beside: str) -> None:
    """Accelerate's FSDP folders (``pytorch_model_fsdp_0`` + ``optimizer_0``, both ``dcp.save``) read as a
    pair; the step directory above them holds its ``save_state`` files or DeepSpeed's engine state."""
    model, opt, _ = _trained()
    msd, osd = get_state_dict(model, opt)
    step = tmp_path / "checkpoint-1"
    dcp.save({"model": msd}, checkpoint_id=str(step / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": osd}, checkpoint_id=str(step / "optimizer_0"))
    code, findings = validate(str(step))
    assert code == 0 and not [f for f in findings if f["code"] == "K012"], findings
    if beside.endswith("/"):
        (step / beside).mkdir()
        (step / beside / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    else:
        (step / beside).write_bytes(b"x")
    code, findings = validate(str(step))
    (k012,) = [f for f in findings if f["code"] == "K012"]
    assert code == 1 and k012["message"].endswith(f"does not read: {beside}")
    doc = json.loads(runner.invoke(app, ["inspect", str(step), "--json"]).stdout)
    assert doc["location"]["optimizer"] is not None and doc["unread_beside"] == [beside]


def test_any_pickle_beside_a_dcp_checkpoint_is_named(tmp_path: Path) -> None:
    """Training state under a name no list knows (a trainer's own ``torch.save`` of its counters, the
    ``custom_checkpoint_N.pkl`` Accelerate's ``save_custom_state`` writes for an object registered for
    checkpointing) is not read either: named by its pickle suffix, never passed over as OK."""
    model, opt, sched = _trained()
    msd, osd = get_state_dict(model, opt)
    ckpt = tmp_path / "step-1"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(ckpt))
    code, findings = validate(str(ckpt))
    assert code == 0 and not [f for f in findings if f["code"] == "K012"], findings
    torch.save({"step": 1, "rng": torch.get_rng_state()}, ckpt / "trainer_state.pt")
    torch.save(sched.state_dict(), ckpt / "custom_checkpoint_0.pkl")  # as Accelerate's save_custom_state names it
    code, findings = validate(str(ckpt))
    (k012,) = [f for f in findings if f["code"] == "K012"]
    assert code == 1 and k012["message"].endswith("does not read: custom_checkpoint_0.pkl, trainer_state.pt")
    doc = json.loads(runner.invoke(app, ["inspect", str(ckpt), "--json"]).stdout)
    assert doc["unread_beside"] == ["custom_checkpoint_0.pkl", "trainer_state.pt"]


def test_a_dcp_checkpoint_in_a_subfolder_is_named(tmp_path: Path) -> None:
    """The optimizer state ``dcp.save``d into a folder of the model's checkpoint is a checkpoint of its own, not
    read with it: named (K012, ``unread_beside``) rather than validated OK over the model alone."""
    model, opt, _ = _trained()
    msd, osd = get_state_dict(model, opt)
    ckpt = tmp_path / "step-1"
    dcp.save({"model": msd}, checkpoint_id=str(ckpt))
    code, findings = validate(str(ckpt))
    assert code == 0 and not [f for f in findings if f["code"] == "K012"], findings
    dcp.save({"optimizer": osd}, checkpoint_id=str(ckpt / "optim"))
    code, findings = validate(str(ckpt))
    (k012,) = [f for f in findings if f["code"] == "K012"]
    assert code == 1 and k012["message"].endswith("does not read: optim/")
    assert json.loads(runner.invoke(app, ["inspect", str(ckpt), "--json"]).stdout)["unread_beside"] == ["optim/"]
    assert validate(str(ckpt), "--ignore", "K012")[0] == 0


def test_a_folder_of_pickles_in_the_checkpoint_folder_is_named(tmp_path: Path) -> None:
    """A loop's per-rank state saved into folders of the checkpoint folder (``rng/rank0.pt``, ``dataloader/rank_0.pt``)
    is not read: validate --strict said OK (only such folders of the step directory above a model/optimizer pair were
    named). They are named now (K012, ``unread_beside``); ``extra_state/`` (read) and the model's assets are not."""
    model, opt, sched = _trained()
    msd, osd = get_state_dict(model, opt)
    ckpt = tmp_path / "step-1"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(ckpt))
    (ckpt / "extra_state").mkdir()
    torch.save({"global_step": 1, "lr_scheduler": sched.state_dict()}, ckpt / "extra_state" / "extra_state_rank_0.pt")
    (ckpt / "model_assets").mkdir()
    model.config.save_pretrained(ckpt / "model_assets")
    torch.save({"vocab": [1, 2]}, ckpt / "model_assets" / "tokenizer.bin")
    code, findings = validate(str(ckpt))
    assert code == 0 and not [f for f in findings if f["code"] == "K012"], findings
    for folder, name in (("rng", "rank0.pt"), ("dataloader", "rank_0.pt")):
        (ckpt / folder).mkdir()
        torch.save({"state": torch.get_rng_state()}, ckpt / folder / name)
    code, findings = validate(str(ckpt))
    (k012,) = [f for f in findings if f["code"] == "K012"]
    assert code == 1 and k012["message"].endswith("does not read: dataloader/, rng/"), k012
    assert json.loads(runner.invoke(app, ["inspect", str(ckpt), "--json"]).stdout)["unread_beside"] == [
        "dataloader/",
        "rng/",
    ]


def test_optimizer_state_and_counters_beside_in_other_encodings_are_named(tmp_path: Path) -> None:
    """Moments saved as ``optimizer.safetensors`` and counters as ``train_state.json`` beside a DCP checkpoint are
    training state ckpttool does not read: validate --strict said OK, naming neither (K012 names them now)."""
    from safetensors.torch import save_file

    model, opt, _ = _trained()
    ckpt = tmp_path / "step-1"
    dcp.save({"model": get_state_dict(model, opt)[0]}, checkpoint_id=str(ckpt))
    save_file(
        {f"{i}.exp_avg": s["exp_avg"] for i, s in opt.state_dict()["state"].items()}, ckpt / "optimizer.safetensors"
    )
    (ckpt / "train_state.json").write_text(json.dumps({"step": 1}))
    code, findings = validate(str(ckpt))
    (k012,) = [f for f in findings if f["code"] == "K012"]
    assert code == 1 and k012["message"].endswith("does not read: optimizer.safetensors, train_state.json"), k012
