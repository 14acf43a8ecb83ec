"""`diff` and `manifest --verify` say no more than they compared: a single .safetensors file beside others, values
compared across dtypes or within a tolerance, files beside two DCP checkpoints, a tied head on either side, a run
root verified without a step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema

runner = CliRunner()


def invoke(*args: object) -> Any:
    return runner.invoke(app, [*map(str, args)])


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.ones(8),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
    }


def test_single_file_is_read_alone_beside_other_saves_in_its_folder(tmp_path: Path) -> None:
    a = weights()
    b = {k: v.clone() for k, v in a.items()}
    b["model.norm.weight"][0] = 1 + 2**-23  # one ulp: shown with the digits that tell it apart
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in a.items()}, str(tmp_path / "c.safetensors"))  # another save
    res = invoke("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert res.exit_code == 1, res.output
    assert "model.norm.weight: 1 of 8 elements differ; first at [0] (A 1, B 1.00000012)" in res.output
    same = invoke("diff", tmp_path / "a.safetensors", tmp_path / "a.safetensors")
    assert same.exit_code == 0 and "compared 3 tensors" in same.output, same.output


def test_a_folder_of_two_saves_names_both_files_not_a_damaged_one(tmp_path: Path) -> None:
    save_file(weights(), str(tmp_path / "model.safetensors"))
    save_file(weights(), str(tmp_path / "model-copy.safetensors"))
    res = invoke("diff", tmp_path, tmp_path / "model.safetensors")
    assert res.exit_code == 2
    assert "is stored in two files, model-copy.safetensors and model.safetensors" in res.stderr
    assert "damaged" not in res.stderr and "move the other file(s) out" in res.stderr


def test_values_compared_across_dtypes_or_within_a_tolerance_are_said_so(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file(weights(), str(tmp_path / "a" / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights().items()}, str(tmp_path / "b" / "model.safetensors"))
    res = invoke("diff", tmp_path / "a", tmp_path / "b", "--rtol", "0.01")
    assert res.exit_code == 0, res.output
    assert "note: stored dtypes differ: float32 in A, bfloat16 in B: 3 tensors" in res.output
    assert "equal within tolerance: 2 tensors not bitwise equal" in res.output  # norm.weight (ones) is exact
    doc = json.loads(invoke("diff", tmp_path / "a", tmp_path / "b", "--as-dtype", "bfloat16", "--json").stdout)
    jsonschema.validate(doc, load_schema("diff"))
    assert doc["equal"] and any(n.startswith("stored dtypes differ") for n in doc["notes"])


def test_what_all_names_files_beside_two_dcp_checkpoints(tmp_path: Path) -> None:
    for side in ("a", "b"):
        dcp.save({"model": weights()}, checkpoint_id=tmp_path / side)
    (tmp_path / "b" / "extra_state").mkdir()
    (tmp_path / "b" / "extra_state" / "extra_state_rank_0.pt").write_bytes(b"rng")
    res = invoke("diff", tmp_path / "a", tmp_path / "b", "--what", "all")
    assert res.exit_code == 0, res.output
    assert "files beside the checkpoint, not compared as items: 1 only in B (extra_state/extra_state_rank_0.pt)" in (
        res.output
    )
    assert "equal; files beside the checkpoints differ" in res.output
    model_only = invoke("diff", tmp_path / "a", tmp_path / "b")
    assert "beside" not in model_only.output


def test_what_all_names_a_differing_config_of_two_hf_folders(tmp_path: Path) -> None:
    for side, theta in (("a", 10000.0), ("b", 1.0)):
        (tmp_path / side).mkdir()
        save_file(weights(), str(tmp_path / side / "model.safetensors"))
        (tmp_path / side / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": theta}))
    res = invoke("diff", tmp_path / "a", tmp_path / "b", "--what", "all")
    assert res.exit_code == 0, res.output
    assert "not compared as items: 1 differ (config.json)" in res.output


def test_tied_head_is_compared_whichever_side_the_dcp_checkpoint_is(tmp_path: Path) -> None:
    w = weights()
    head = w["model.embed_tokens.weight"].clone()
    head[3, 4] += 1
    dcp.save({"model": {**w, "lm_head.weight": head}}, checkpoint_id=tmp_path / "dcp")
    (tmp_path / "hf").mkdir()
    save_file(w, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    for a, b in (("dcp", "hf"), ("hf", "dcp")):
        res = invoke("diff", tmp_path / a, tmp_path / b, "--json")
        assert res.exit_code == 1, res.output
        doc = json.loads(res.stdout)
        assert [d["kind"] for d in doc["differences"]] == ["values"], doc["differences"]
        assert doc["differences"][0]["name"] == "lm_head.weight" and doc["differences"][0]["index"] == [3, 4]


def test_manifest_verify_of_a_run_root_asks_for_a_step(tmp_path: Path) -> None:
    for step in (1, 2):
        dcp.save({"model": weights()}, checkpoint_id=tmp_path / f"step-{step}")
    res = invoke("manifest", tmp_path, "--verify")
    assert res.exit_code == 2 and "[E204]" in res.stderr and "--step" in res.stderr, res.stderr
    gone = invoke("manifest", tmp_path / "nowhere", "--verify")
    assert gone.exit_code == 2 and "no such directory" in gone.stderr, gone.stderr


def _one_adamw_step() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    """A ``Linear(4, 3)`` and its AdamW (lr 1e-3) after one step (seed 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_equal_models_of_two_training_states_do_not_read_as_the_same_state(tmp_path: Path) -> None:
    """Two saves of one AdamW run that differ only in the scheduler's lr: ``diff`` (``--what model``, the default)
    said a plain "equal". It compared the model only; a note and the verdict now say that the optimizer state and
    param groups were left out, and ``--what all`` finds the lr."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _one_adamw_step()
    for name, lr in (("a", 1e-3), ("b", 5e-4)):
        opt.param_groups[0]["lr"] = lr
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / name), no_dist=True)
    res = invoke("diff", tmp_path / "a", tmp_path / "b")
    assert res.exit_code == 0, res.output
    note = (
        "optimizer state and param groups not compared (A and B each hold 6 state fields in 1 param group): "
        "--what all compares them"
    )
    assert f"  note: {note}" in res.stdout.splitlines(), res.stdout
    assert res.stdout.splitlines()[-1].startswith("equal as models; optimizer state not compared (note above) (")
    doc = json.loads(invoke("diff", tmp_path / "a", tmp_path / "b", "--json").stdout)
    assert doc["equal"] is True and note in doc["notes"]
    jsonschema.validate(doc, load_schema("diff"))
    full = invoke("diff", tmp_path / "a", tmp_path / "b", "--what", "all")
    assert full.exit_code == 1 and "optimizer.param_groups.weight.lr: 0.001 in A, 0.0005 in B" in full.stdout
    assert "not compared (" not in full.stdout
    bare = tmp_path / "bare"  # B without optimizer state: the note names A's alone
    dcp.save({"model": get_state_dict(model, opt)[0]}, checkpoint_id=str(bare), no_dist=True)
    doc = json.loads(invoke("diff", tmp_path / "a", bare, "--json").stdout)
    assert doc["notes"] == [
        "optimizer state and param groups not compared (A holds 6 state fields in 1 param group): "
        "--what all compares them"
    ]
    copy = tmp_path / "bare-copy"  # neither side holds optimizer state: nothing was left out, no note
    dcp.save({"model": get_state_dict(model, opt)[0]}, checkpoint_id=str(copy), no_dist=True)
    assert json.loads(invoke("diff", bare, copy, "--json").stdout)["notes"] == []


def test_a_training_state_against_its_safetensors_export_says_the_state_was_not_compared(tmp_path: Path) -> None:
    """A DCP save with AdamW state (and a step-0 save with param groups only) against the model's safetensors: a
    plain "equal", with ``--what model`` saying nothing of the state and ``--what all`` nothing of the param groups.
    The note counts what was left out, names the side that holds none, and the verdict says so as for two DCP sides."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, opt)  # step 0: torch makes up the state (6 fields)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "state"), no_dist=True)
    plain = {"state": {}, "param_groups": osd["param_groups"]}
    dcp.save({"model": msd, "optim": plain}, checkpoint_id=str(tmp_path / "groups"), no_dist=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    for dcp_side, what, held in (
        ("state", "model", "6 state fields"),
        ("state", "all", "6 state fields"),
        ("groups", "all", "0 state fields"),
    ):
        for a, b in ((dcp_side, "m.safetensors"), ("m.safetensors", dcp_side)):
            res = invoke("diff", tmp_path / a, tmp_path / b, "--what", what, "--json")
            assert res.exit_code == 0, res.output
            doc = json.loads(res.stdout)
            label, st = ("A", "B") if a == dcp_side else ("B", "A")
            note = (
                f"optimizer state and param groups not compared ({label} holds {held} in 1 param group): {st} is a "
                "safetensors input, which holds none; --what all against another DCP checkpoint compares them"
            )
            assert doc["equal"] is True and note in doc["notes"], doc["notes"]
            jsonschema.validate(doc, load_schema("diff"))
        text = invoke("diff", tmp_path / dcp_side, tmp_path / "m.safetensors", "--what", what).stdout
        assert text.splitlines()[-1].startswith("equal as models; optimizer state not compared (note above) ("), text


def test_equal_models_of_two_training_steps_say_the_training_state_was_not_compared(tmp_path: Path) -> None:
    """Two saves of one model at ``train_state.step`` 5 and 6 (with and without AdamW state and an LR scheduler):
    ``diff`` (``--what model``) said a plain "equal" over the training state it left out. A note names the items,
    the verdict says so, and ``--what all`` finds the steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _one_adamw_step()
    msd, osd = get_state_dict(model, opt)
    for step in (5, 6):
        state = {"model": msd, "optim": osd, "train_state": {"step": step}, "lr_scheduler": {"last_epoch": step}}
        dcp.save(state, checkpoint_id=str(tmp_path / f"full{step}"), no_dist=True)
        dcp.save({"model": msd, "train_state": {"step": step}}, checkpoint_id=str(tmp_path / f"m{step}"), no_dist=True)
    res = invoke("diff", tmp_path / "m5", tmp_path / "m6")
    assert res.exit_code == 0, res.output
    note = "training state not compared (A and B each hold train_state): --what all compares them"
    assert f"  note: {note}" in res.stdout.splitlines(), res.stdout
    assert res.stdout.splitlines()[-1].startswith("equal as models; training state not compared (note above) (")
    doc = json.loads(invoke("diff", tmp_path / "m5", tmp_path / "m6", "--json").stdout)
    assert doc["equal"] is True and doc["notes"] == [note]
    jsonschema.validate(doc, load_schema("diff"))
    res = invoke("diff", tmp_path / "full5", tmp_path / "full6")
    assert res.stdout.splitlines()[-1].startswith(
        "equal as models; optimizer and training state not compared (notes above) ("
    ), res.stdout
    assert "  note: training state not compared (A and B each hold lr_scheduler, train_state): --what all" in res.stdout
    res = invoke("diff", tmp_path / "full5", tmp_path / "full6", "--what", "optimizer")
    assert res.stdout.splitlines()[-1].startswith("equal; training state not compared (note above) ("), res.stdout
    full = invoke("diff", tmp_path / "m5", tmp_path / "m6", "--what", "all")
    assert full.exit_code == 1 and "train_state.step: 5 in A, 6 in B" in full.stdout, full.stdout
    assert "not compared (" not in full.stdout


def test_equal_per_rank_shards_no_copy_proves_complete_say_so_as_inspect_does(acc_root: Path, tmp_path: Path) -> None:
    """``HuggingFaceStorageWriter(save_distributed=True)`` shards (torch's own writer, 2 gloo ranks) record no world
    size: inspect, stats and export warn that the folder cannot be known complete, but ``diff`` of it against a byte
    copy said a bare ``equal``. It still compares every tensor (exit 0) and says of what: the pieces present. Against
    torch's consolidated copy (its shapes prove the shards') nothing is added."""
    import shutil

    src = acc_root / "hf_sharded"
    copy = shutil.copytree(src, tmp_path / "copy")
    inspect = invoke("inspect", src, "--json")
    assert inspect.exit_code == 0 and "record neither the world size" in inspect.stderr
    doc = json.loads((res := invoke("diff", src, copy, "--json")).stdout)
    assert res.exit_code == 0 and doc["equal"] is True
    assert doc["counts"]["compared"] == doc["counts"]["equal"] == inspect_count(inspect.stdout) > 0
    unproven = [n for n in doc["notes"] if n.startswith("not known complete: ")]
    assert [n.split(": ")[1] for n in unproven] == ["A", "B"] and all("world size" in n for n in unproven)
    text = invoke("diff", src, copy)
    assert text.exit_code == 0
    assert text.stdout.splitlines()[-1].startswith("equal; of the shards present, not known complete (note above)")
    proven = json.loads(invoke("diff", src, acc_root / "hf_consolidated", "--json").stdout)
    assert proven["equal"] is True and not any(n.startswith("not known complete") for n in proven["notes"])


def inspect_count(stdout: str) -> int:
    return int(json.loads(stdout)["summary"]["tensor_count"])
