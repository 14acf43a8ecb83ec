"""``ckpttool validate``: every rule triggered by a real checkpoint damaged in one way; clean fixtures pass.

Each test copies a real ``dcp.save`` fixture, damages it with one helper of
``tests/fixtures/damage.py`` and asserts that exactly the expected rule fails
the run, with exit codes and output streams checked through the CLI.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.validate import RULES, ValidateOptions, validate
from tests.fixtures import damage
from tests.fixtures.cache import cached_build, copy_checkpoint
from tests.fixtures.torch_free import run_without_torch

runner = CliRunner()


# ------------------------------------------------------------------------------------------ fixtures
MASTER_PARAMS = {
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 12),
    "model.layers.1.mlp.down_proj.weight": (8, 12),
    "model.norm.weight": (8,),
    "lm_head.weight": (16, 8),
}


def build_master(out: Path) -> None:
    """BF16 parameters with FP32 masters and BF16 moments (master_fp32_adamw), nested flavor, layout record."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(7)
    msd, state = {}, {}
    for fqn, shape in MASTER_PARAMS.items():
        master = torch.randn(shape, generator=g) * 0.1
        msd[fqn] = master.to(torch.bfloat16)
        m, v = torch.zeros(shape), torch.zeros(shape)
        for _ in range(5):  # moments Adam's recursion makes (betas 0.9, 0.95) from random gradients
            grad = torch.randn(shape, generator=g) * 1e-3
            m, v = 0.9 * m + 0.1 * grad, 0.95 * v + 0.05 * grad * grad
        state[fqn] = {
            "step": torch.tensor(5.0),
            "master_weight": master,
            "exp_avg": m.to(torch.bfloat16),
            "exp_avg_sq": v.to(torch.bfloat16),
        }
    osd = {
        "state": state,
        "param_groups": [
            {"params": list(MASTER_PARAMS), "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        ],
    }
    record = {
        "format": "ckpttool.layout",
        "version": 2,
        "parallel": {"ep_size": 1, "ep_fsdp_size": 1},
        "extra_parallel": {},
        "optimizer": {"type": "master_fp32_adamw", "moment_dtypes": {"resident": "bfloat16"}},
        "global_step": 5,
    }
    dcp.save({"model": msd, "optimizer": osd, "layout": json.dumps(record)}, checkpoint_id=str(out))


@pytest.fixture(scope="session")
def master_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "validate_master", build_master)


@pytest.fixture
def copy_of(tmp_path: Path):
    def make(src: Path) -> Path:
        return copy_checkpoint(src, tmp_path / "ckpt")

    return make


# ------------------------------------------------------------------------------------------ helpers
def run(*args: Any) -> tuple[int, dict[str, Any], str]:
    """``ckpttool validate ARGS --json``: exit code, parsed JSON, stderr."""
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout), res.stderr


def failing_codes(doc: dict[str, Any]) -> set[str]:
    return {f["code"] for f in doc["findings"] if f["fails"]}


def codes(doc: dict[str, Any], *severities: str) -> set[str]:
    sev = severities or ("error", "warning")
    return {f["code"] for f in doc["findings"] if f["severity"] in sev}


def only(path: Path, code: str, *extra: Any, exit_code: int = 1) -> dict[str, Any]:
    """Assert that validating ``path`` (strict) fails with exactly rule ``code``; return the JSON."""
    rc, doc, err = run(path, "--strict", *extra)
    assert codes(doc) == {code}, doc["findings"]
    assert rc == exit_code == doc["exit_code"], (rc, err)
    assert all(f["message"] and f["hint"] and "\n" not in f["message"] for f in doc["findings"])
    return doc


# ------------------------------------------------------------------------------------------ clean fixtures
@pytest.mark.parametrize("name", ["dense_ckpt", "multi_optim_ckpt", "fsdp_ckpt", "sample_ckpt", "master_ckpt"])
def test_clean_fixtures_pass_strict_deep(name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(name)
    res = runner.invoke(app, ["validate", str(path), "--strict", "--deep"])
    assert res.exit_code == 0, res.stdout
    assert res.stdout.splitlines()[-1].startswith("OK: 0 errors, 0 warnings")
    assert res.stderr == ""


def test_clean_sample_reports_scheduler_initial_lr_as_info(sample_ckpt: Path) -> None:
    rc, doc, _ = run(sample_ckpt, "--strict")
    assert rc == 0 and doc["ok"] and doc["counts"] == {"error": 0, "warning": 0, "info": 1}
    (f,) = doc["findings"]
    assert f["code"] == "P002" and "initial_lr 0.001" in f["message"] and not f["fails"]


def test_never_stepped_leaf_with_hyperparameters_is_clean(multi_optim_ckpt: Path) -> None:
    rc, doc, _ = run(multi_optim_ckpt, "--strict")
    assert rc == 0 and codes(doc) == set()
    p002 = [f for f in doc["findings"] if f["code"] == "P002"]
    assert p002 and "lr 0.0025" in p002[0]["message"]


def build_initial_lr(out: Path) -> None:
    """Two param groups carrying initial_lr: group 0 not moved by the scheduler (lr == initial_lr), group 1 moved."""
    import torch.distributed.checkpoint as dcp

    msd = {"model.a.weight": torch.ones(4, 4), "model.b.weight": torch.ones(4, 4)}
    state = {k: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 4), "exp_avg_sq": torch.zeros(4, 4)} for k in msd}
    base = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    osd = {
        "state": state,
        "param_groups": [
            {"params": ["model.a.weight"], "lr": 1e-3, "initial_lr": 1e-3, **base},
            {"params": ["model.b.weight"], "lr": 2.5e-4, "initial_lr": 1e-3, **base},
        ],
    }
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


def test_P002_reports_only_groups_whose_lr_differs_from_initial_lr(tmp_path: Path) -> None:
    build_initial_lr(tmp_path / "ck")
    rc, doc, err = run(tmp_path / "ck", "--strict")
    assert rc == 0 and err == "" and doc["counts"] == {"error": 0, "warning": 0, "info": 1}, doc["findings"]
    (f,) = doc["findings"]
    assert f["code"] == "P002" and f["severity"] == "info" and not f["fails"]
    assert f["key"] == "optimizer.param_groups.1" and f["message"] == "param group 1: initial_lr 0.001, lr 0.00025"
    # the human output names only the moved group
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "ck")])
    assert res.exit_code == 0 and "param group 0" not in res.stdout and "param group 1" in res.stdout


def test_P002_silent_when_the_scheduler_has_not_moved_the_lr(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    msd = {"model.a.weight": torch.ones(4, 4)}
    osd = {
        "state": {
            "model.a.weight": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 4), "exp_avg_sq": torch.zeros(4, 4)}
        },
        "param_groups": [
            {
                "params": ["model.a.weight"],
                "lr": 1e-3,
                "initial_lr": 1e-3,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "weight_decay": 0.0,
            }
        ],
    }
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "ck")])
    assert res.exit_code == 0 and res.stderr == ""
    assert "initial_lr" not in res.stdout and res.stdout.splitlines()[-1].startswith("OK: 0 errors, 0 warnings, 0 info")


# ------------------------------------------------------------------------------------------ storage
def test_S001_garbage_metadata_exits_2(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    (ck / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    rc, doc, err = run(ck)
    assert rc == 2 and codes(doc) == {"S001"} and doc["findings"][0]["fatal"]
    assert err.startswith("error: [E200]") and "hint:" in err


def test_S001_of_a_safetensors_folder_names_its_file_not_metadata(tmp_path: Path) -> None:
    """An unreadable safetensors shard: the finding's key is the shard, and the error line reads as the other
    commands' (it was `.metadata: <path>/model.safetensors: ...` for a folder that has no .metadata)."""
    import struct

    ck = tmp_path / "hf"
    ck.mkdir()
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()  # fmt: skip
    (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    rc, doc, err = run(ck, "--deep")
    assert rc == 2 and codes(doc) == {"S001"} and doc["findings"][0]["key"] == "model.safetensors"
    assert err.startswith(f"error: [E200] {ck / 'model.safetensors'}: not a valid safetensors file"), err


def test_S001_unsafe_pickle_names_the_global(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    (ck / ".metadata").write_bytes(b"cos\nsystem\n(S'touch /tmp/ckpttool-pwned'\ntR.")
    rc, doc, err = run(ck, "--deep")
    assert rc == 2 and codes(doc) == {"S001"} and doc["findings"][0]["error_code"] == "E201"
    assert "system" in doc["findings"][0]["message"] and "[E201]" in err
    assert not Path("/tmp/ckpttool-pwned").exists()


def test_S002_missing_data_file(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.delete_file(ck, "__0_0.distcp")
    doc = only(ck, "S002")
    assert doc["findings"][0]["key"] == "__0_0.distcp" and doc["findings"][0]["error_code"] == "E300"


def test_S003_truncated_file(fsdp_ckpt: Path, copy_of) -> None:
    ck = copy_of(fsdp_ckpt)
    damage.truncate(ck, "__2_0.distcp", 0.5)
    doc = only(ck, "S003")
    assert doc["findings"][0]["key"] == "__2_0.distcp" and "past the end" in doc["findings"][0]["message"]


def test_S004_gap_and_overlap(fsdp_ckpt: Path, copy_of) -> None:
    ck = copy_of(fsdp_ckpt)
    md = damage.load_md(ck)
    key = "model.model.layers.0.proj.weight"
    chunks = md.state_dict_metadata[key].chunks
    assert len(chunks) == 4
    md.state_dict_metadata[key].chunks = chunks[:1] + chunks[2:]  # drop rank 1's rows
    damage.save_md(ck, md)
    doc = only(ck, "S004")
    assert "gap" in doc["findings"][0]["message"] and doc["findings"][0]["key"] == key


def test_S005_unknown_transform(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.edit_storage(ck, "model.model.norm.weight", transform_descriptors=["rot13-unknown/1"])
    doc = only(ck, "S005")
    assert "rot13-unknown" in doc["findings"][0]["message"]


def test_S006_unreferenced_file_is_a_warning(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    (ck / "__7_0.distcp").write_bytes(b"left over")
    rc, doc, _ = run(ck)
    assert rc == 0 and codes(doc) == {"S006"} and not failing_codes(doc)
    only(ck, "S006")


def test_S006_ignores_an_empty_data_file(dense_ckpt: Path, copy_of) -> None:
    """`import --world-size 64` of a small model writes empty files for the ranks with no rows."""
    ck = copy_of(dense_ckpt)
    (ck / "__7_0.distcp").write_bytes(b"")
    rc, doc, _ = run(ck)
    assert rc == 0 and "S006" not in codes(doc)


def test_S007_extra_state_ranks_missing(fsdp_ckpt: Path, copy_of) -> None:
    ck = copy_of(fsdp_ckpt)
    (ck / "extra_state").mkdir()
    torch.save({"global_step": 2}, ck / "extra_state" / "extra_state_rank_0.pt")
    doc = only(ck, "S007")
    assert "[1, 2, 3]" in doc["findings"][0]["message"]


def test_S008_storage_entry_missing(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    md = damage.load_md(ck)
    del md.storage_data[next(i for i in md.storage_data if i.fqn == "model.model.norm.weight")]
    damage.save_md(ck, md)
    only(ck, "S008")


def test_S009_escaping_path_exits_2(dense_ckpt: Path, copy_of, tmp_path: Path) -> None:
    ck = copy_of(dense_ckpt)
    (tmp_path / "outside").mkdir()
    damage.edit_storage(ck, "model.model.norm.weight", relative_path="../outside/__0_0.distcp")
    rc, doc, err = run(ck, "--deep")
    assert rc == 2 and codes(doc) == {"S009"} and "[E101]" in err


def test_S010_corrupt_chunk_needs_deep(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.corrupt_chunk_bytes(ck, "model.model.layers.0.mlp.up_proj.weight")
    rc, doc, _ = run(ck, "--strict")
    assert rc == 0 and codes(doc) == set()
    doc = only(ck, "S010", "--deep")
    assert doc["findings"][0]["key"] == "model.model.layers.0.mlp.up_proj.weight"


def test_S010_names_only_the_moment_that_is_corrupt(dense_ckpt: Path, copy_of) -> None:
    """``exp_avg`` and ``exp_avg_sq`` are read together: a corrupt ``exp_avg`` chunk was reported for the intact
    ``exp_avg_sq`` too (with ``exp_avg``'s message), whose values then went unchecked. Now each is read again alone."""
    ck = copy_of(dense_ckpt)
    base = "optimizer.state.model.layers.0.mlp.up_proj.weight"

    def nan_at_0(t: Any) -> Any:
        t.view(-1)[0] = float("nan")
        return t

    damage.rewrite_tensor(ck, f"{base}.exp_avg_sq", nan_at_0)
    damage.corrupt_chunk_bytes(ck, f"{base}.exp_avg")
    rc, doc, _ = run(ck, "--deep")
    assert rc == 1
    found = [(f["code"], f["key"]) for f in doc["findings"] if f["code"] != "M009"]  # the fixture's inv_freq
    assert found == [("D001", f"{base}.exp_avg_sq"), ("S010", f"{base}.exp_avg")], found
    assert f"'{base}.exp_avg' chunk at" in next(f["message"] for f in doc["findings"] if f["code"] == "S010")


def test_a_chunk_the_deep_pass_cannot_read_is_reported_whatever_select_chose(dense_ckpt: Path, copy_of) -> None:
    """``--select D001`` over a chunk whose CRC-32 fails said OK (D001 passed over values it never read): the
    deep pass's read errors bring S014 / S010 in; only ``--ignore`` leaves them out."""
    ck = copy_of(dense_ckpt)
    damage.flip_value_bit(ck, "model.model.layers.0.mlp.up_proj.weight")
    rc, doc, _ = run(ck, "--deep", "--select", "D001")
    assert rc == 1 and codes(doc) == {"S014"}, doc["findings"]
    assert doc["findings"][0]["key"] == "model.model.layers.0.mlp.up_proj.weight"
    rc, doc, _ = run(ck, "--deep", "--select", "D001", "--ignore", "S014")
    assert rc == 0 and codes(doc) == set()


def test_S011_corrupt_byte_item_does_not_hint_trust_pickle(dense_ckpt: Path, copy_of) -> None:
    """A damaged byte item (E301) got S011's hint for one that needs trust ("if the checkpoint is trusted, pass
    --trust-pickle"): no option reads a corrupt archive, and that one would unpickle it unchecked."""
    ck = copy_of(dense_ckpt)
    damage.corrupt_chunk_bytes(ck, "optimizer.param_groups.0.lr")
    doc = only(ck, "S011")
    f = doc["findings"][0]
    assert f["error_code"] == "E301" and f["key"] == "optimizer.param_groups.0.lr"
    assert "damaged" in f["hint"] and "does not read a corrupt item" in f["hint"], f["hint"]


def test_S011_byte_item_needing_trust_pickle(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.set_byte_item(ck, "optimizer.param_groups.0.lr", datetime.date(2020, 1, 1))
    doc = only(ck, "S011")
    assert "--trust-pickle" in doc["findings"][0]["hint"] and doc["findings"][0]["error_code"] == "E304"
    rc, doc, _ = run(ck, "--strict", "--trust-pickle")  # read when trusted: a date is no lr to step with (P006)
    assert rc == 1 and codes(doc) == {"P006"}
    assert [f["message"] for f in doc["findings"] if f["code"] == "P006"] == [
        "param group 0: lr is datetime.date(2020, 1, 1), not a number"
    ]


def test_S012_chunk_larger_than_its_record(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.edit_storage(ck, "model.lm_head.weight", length=200)
    only(ck, "S012")


def test_S013_extra_state_refused_by_weights_only(sample_ckpt: Path, copy_of) -> None:
    ck = copy_of(sample_ckpt)
    torch.save({"when": datetime.date(2020, 1, 1)}, ck / "extra_state" / "extra_state_rank_0.pt")
    doc = only(ck, "S013")
    assert doc["findings"][0]["key"] == "extra_state/extra_state_rank_0.pt"


def test_S013_a_damaged_extra_state_file_gets_a_hint_about_that_file(sample_ckpt: Path, copy_of) -> None:
    """A damaged extra_state file (its zip records broken) was hinted ``the data file is damaged or does not
    belong to this .metadata``, the hint of a data file: extra_state files are no data file of .metadata."""
    ck = copy_of(sample_ckpt)
    f = ck / "extra_state" / "extra_state_rank_0.pt"
    raw = bytearray(f.read_bytes())
    raw[-30] ^= 1  # in the zip end records
    f.write_bytes(bytes(raw))
    doc = only(ck, "S013")
    (finding,) = [f for f in doc["findings"] if f["code"] == "S013"]
    assert finding["key"] == "extra_state/extra_state_rank_0.pt" and "not a torch.save archive" in finding["message"]
    assert finding["hint"] == (
        "the extra_state file is damaged: copy it again from a good source, or use an earlier checkpoint"
    )


# ------------------------------------------------------------------------------------------ optimizer
Q = "model.layers.0.self_attn.q_proj.weight"


def test_O001_partial_state(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    assert damage.drop_keys(ck, lambda k: k == f"optimizer.state.{Q}.exp_avg_sq")
    doc = only(ck, "O001")
    assert doc["findings"][0]["key"] == Q and "exp_avg_sq" in doc["findings"][0]["message"]


def test_O002_param_group_entries_deleted_for_never_stepped_param(multi_optim_ckpt: Path, copy_of) -> None:
    ck = copy_of(multi_optim_ckpt)
    fqn = "model.layers.0.mlp.experts.gate_up_proj"
    assert damage.drop_keys(ck, lambda k: k.startswith(f"optimizer.param_groups.{fqn}."))
    doc = only(ck, "O002")
    assert doc["findings"][0]["key"] == fqn and "reset" in doc["findings"][0]["message"]


def test_O002_silent_on_bias_only_training(tmp_path: Path) -> None:
    """BitFit (every weight frozen, only the biases trained, the optimizer over those) failed validate with one
    O002 error per module ('its lr/weight_decay would reset'): a weight beside its trained bias counted as a
    parameter that lost its group. A name optimized nowhere in the model is frozen; the check passes."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_steps(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "bitfit")
    rc, doc, _ = run(tmp_path / "bitfit", "--deep", "--strict")
    assert rc == 0 and not doc["findings"], doc["findings"]


def test_O003_state_for_unknown_fqn(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.rename_key(ck, f"optimizer.state.{Q}.step", "optimizer.state.model.layers.9.q.weight.step")
    damage.rename_key(ck, f"optimizer.state.{Q}.exp_avg", "optimizer.state.model.layers.9.q.weight.exp_avg")
    damage.rename_key(ck, f"optimizer.state.{Q}.exp_avg_sq", "optimizer.state.model.layers.9.q.weight.exp_avg_sq")
    rc, doc, _ = run(ck, "--strict")
    # The renamed state is an orphan, and the parameter it belonged to lost its state in a stepped group.
    assert rc == 1 and codes(doc) == {"O003", "O009"}, doc["findings"]
    by_code = {f["code"]: f for f in doc["findings"]}
    assert by_code["O003"]["key"] == "model.layers.9.q.weight" and by_code["O009"]["key"] == Q


def test_O004_state_shape_differs(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.replace_single_chunk(ck, f"optimizer.state.{Q}.exp_avg", torch.zeros(16, 8, dtype=torch.bfloat16))
    doc = only(ck, "O004")
    assert "[16, 8]" in doc["findings"][0]["message"] and "[16, 16]" in doc["findings"][0]["message"]


def test_O005_bf16_moment_in_fp32_adamw_state(sample_ckpt: Path, copy_of) -> None:
    ck = copy_of(sample_ckpt)
    fqn = "model.layers.1.mlp.experts.down_proj"
    damage.rewrite_tensor(ck, f"optimizer.state.{fqn}.exp_avg", lambda t: t.to(torch.bfloat16))
    doc = only(ck, "O005")
    msg = doc["findings"][0]["message"]
    assert "exp_avg is bfloat16 (expected float32)" in msg and "declared type adamw" in msg


def test_O005_bf16_master_weight(master_ckpt: Path, copy_of) -> None:
    ck = copy_of(master_ckpt)
    damage.rewrite_tensor(ck, "optimizer.state.lm_head.weight.master_weight", lambda t: t.to(torch.bfloat16))
    doc = only(ck, "O005")
    assert "master_weight is bfloat16 (expected float32)" in doc["findings"][0]["message"]


def test_O006_master_weight_missing_for_one_param(master_ckpt: Path, copy_of) -> None:
    ck = copy_of(master_ckpt)
    assert damage.drop_keys(ck, lambda k: k == "optimizer.state.model.norm.weight.master_weight")
    doc = only(ck, "O006")
    assert "4 parameter(s) have master_weight, 1 do not" in doc["findings"][0]["message"]


def test_O007_step_counters_disagree_is_a_deep_warning(master_ckpt: Path, copy_of) -> None:
    ck = copy_of(master_ckpt)
    damage.rewrite_tensor(ck, "optimizer.state.model.norm.weight.step", lambda t: t - 2)
    rc, doc, _ = run(ck, "--deep")
    assert rc == 0 and "O007" in codes(doc) and codes(doc) <= {"O007", "D007"}  # D007: moments of 5 steps at step 3
    doc = only(ck, "O007", "--deep")
    assert "4 at 5, 1 at 3" in doc["findings"][0]["message"] and doc["findings"][0]["key"] == "model.norm.weight"


def test_O008_unknown_state_field(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.rename_key(ck, f"optimizer.state.{Q}.exp_avg_sq", f"optimizer.state.{Q}.momentum_buffer")
    rc, doc, _ = run(ck)
    assert rc == 0 and codes(doc) == {"O008"}
    only(ck, "O008")


# ------------------------------------------------------------------------------------------ param groups
def test_P001_group_missing_eps(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    assert damage.drop_keys(ck, lambda k: k == "optimizer.param_groups.0.eps")
    doc = only(ck, "P001")
    assert "missing eps" in doc["findings"][0]["message"]


def test_P003_bf16_step(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    damage.rewrite_tensor(ck, f"optimizer.state.{Q}.step", lambda t: t.to(torch.bfloat16))
    doc = only(ck, "P003")
    assert "bfloat16" in doc["findings"][0]["message"]


def test_P004_param_removed_from_nested_group(dense_ckpt: Path, copy_of) -> None:
    from ckpttool.format import CheckpointReader

    ck = copy_of(dense_ckpt)
    with CheckpointReader(ck) as r:
        params = r.read_object("optimizer.param_groups.0.params")
    damage.set_byte_item(ck, "optimizer.param_groups.0.params", [p for p in params if p != Q])
    doc = only(ck, "P004")
    assert doc["findings"][0]["key"] == Q


# ------------------------------------------------------------------------------------------ deep
def test_D001_nan_in_a_parameter(fsdp_ckpt: Path, copy_of) -> None:
    ck = copy_of(fsdp_ckpt)

    def nan(t: torch.Tensor) -> torch.Tensor:
        t[2, 3] = float("nan")
        t[1, 1] = float("inf")
        return t

    damage.rewrite_tensor(ck, "model.model.layers.1.proj.weight", nan)
    assert codes(run(ck, "--strict")[1]) == set()
    doc = only(ck, "D001", "--deep")
    assert "2 of 256 values" in doc["findings"][0]["message"]


def test_D002_negative_exp_avg_sq(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)

    def neg(t: torch.Tensor) -> torch.Tensor:
        t[0, :3] = -1.0
        return t

    damage.rewrite_tensor(ck, f"optimizer.state.{Q}.exp_avg_sq", neg)
    doc = only(ck, "D002", "--deep")
    assert "3 of 256 values are negative" in doc["findings"][0]["message"]


def test_D003_fractional_step(dense_ckpt: Path, copy_of) -> None:
    ck = copy_of(dense_ckpt)
    for key in [k for k in damage.load_md(ck).state_dict_metadata if k.endswith(".step")]:
        damage.rewrite_tensor(ck, key, lambda t: t + 0.5)
    rc, doc, _ = run(ck, "--strict", "--deep")
    d003 = [f for f in doc["findings"] if f["code"] == "D003"]
    assert rc == 1 and codes(doc) == {"D003"} and d003 and all("3.5" in f["message"] for f in d003)


def test_D004_param_desynced_from_master(master_ckpt: Path, copy_of) -> None:
    ck = copy_of(master_ckpt)
    key = "model.model.layers.1.mlp.down_proj.weight"

    def bump(t: torch.Tensor) -> torch.Tensor:
        t[0, :5] += 0.25
        return t

    damage.rewrite_tensor(ck, key, bump)
    assert codes(run(ck, "--strict")[1]) == set()
    doc = only(ck, "D004", "--deep")
    f = doc["findings"][0]
    assert f["key"] == key and "5 of 96 elements" in f["message"] and "max |diff| 0.25" in f["message"]


def test_D004_a_nan_master_weight_is_named_not_max_diff_0(master_ckpt: Path, copy_of, tmp_path: Path) -> None:
    """A NaN master_weight against its finite BF16 parameter said "1 of 96 elements differ ... (max |diff| 0)": the
    NaN difference was dropped from the maximum. The finding says what differs, natively, with CKPTTOOL_NATIVE=0
    (numpy's comparison) and through torch's comparison of the same values."""
    import os
    import subprocess
    import sys

    from ckpttool.ops.validate.deep import _compare
    from ckpttool.ops.validate.stats import PairStats

    ck = copy_of(master_ckpt)
    key = "model.model.layers.1.mlp.down_proj.weight"
    master = "optimizer.state.model.layers.1.mlp.down_proj.weight.master_weight"

    def nan_at_0(t: torch.Tensor) -> torch.Tensor:
        t[0, 0] = float("nan")
        return t

    damage.rewrite_tensor(ck, master, nan_at_0)
    want = f"{key}: 1 of 96 elements differ from {master} cast to the parameter dtype (1 NaN against a number)"
    rc, doc, _ = run(ck, "--strict", "--deep")
    assert rc == 1 and [f["message"] for f in doc["findings"] if f["code"] == "D004"] == [want], doc["findings"]
    root = Path(__file__).resolve().parents[3]
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", "validate", str(ck), "--strict", "--deep", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CKPTTOOL_NATIVE": "0", "PYTHONPATH": str(root)},
    )
    assert res.returncode == 1, res.stderr
    assert [f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "D004"] == [want]
    a = torch.ones(4, 3, dtype=torch.bfloat16)
    b = torch.ones(4, 3)
    b[0, 0], b[1, 1], b[2, 2] = float("nan"), 1.5, float("nan")
    a[2, 2] = float("nan")
    pair = PairStats("a", "b", "master")
    _compare(pair, a, b)
    assert (pair.mismatched, pair.nan_mismatched, pair.max_diff) == (2, 1, 0.5)
    assert pair.differences() == "max |diff| 0.5; 1 NaN against a number"


# ------------------------------------------------------------------------------------------ rules are documented
def test_every_rule_is_documented_in_docs_rules_md() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "rules.md").read_text()
    for code, r in RULES.items():
        assert f"`{code}`" in text and r.name in text, code
    # the table's row of each rule: its name, its severity (", fatal" for the fatal ones) and the options it needs
    rows = re.findall(r"^\| `([A-Z]\d{3})` \| ([\w-]+) \| ([^|]+) \|([^|]*)\|", text, re.M)
    assert sorted(c for c, *_ in rows) == sorted(RULES)
    for code, name, severity, needs in rows:
        r = RULES[code]
        assert name == r.name, code
        assert re.match(rf"{r.severity.value}(, fatal)?\b", severity) and ("fatal" in severity) == r.fatal, code
        assert set(re.findall(r"--(\w+)", needs)) == set(r.needs), code


def test_every_row_of_the_rule_table_is_a_registered_rule() -> None:
    table = json.loads(
        (Path(__file__).resolve().parents[3] / "ckpttool" / "ops" / "validate" / "rules.json").read_text()
    )
    assert list(table) == sorted(RULES) and all(RULES[c].name == row["name"] for c, row in table.items())


def test_library_call_matches_cli(dense_ckpt: Path) -> None:
    res = validate(dense_ckpt, ValidateOptions(strict=True))
    assert res.exit_code == 0 and res.to_dict()["schema"] == "ckpttool.validate/1"
    assert {s.rule.code for s in res.rules if s.status == "skipped"} == {c for c, r in RULES.items() if r.needs - set()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("special", [float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, -2.5, 0.0])
def test_deep_bit_pattern_summary_matches_torch(dtype: torch.dtype, special: float) -> None:
    from ckpttool.ops.validate.deep import _summarise

    t = torch.rand(3001, generator=torch.Generator().manual_seed(3)).to(dtype)
    t[1234] = special
    st = _summarise("optimizer.state.w.exp_avg_sq", t, str(dtype).removeprefix("torch."), True, False)
    assert st.nonfinite == int((~torch.isfinite(t)).sum())
    assert st.negative == int((t < 0).sum())


def test_deep_pass_of_fp32_state_never_imports_torch(master_ckpt: Path) -> None:
    """``validate --strict --deep`` of BF16 parameters with FP32 masters and moments runs on numpy only
    (torch's import is 1-3 s and ~200 MiB, more than the pass itself)."""
    r = run_without_torch("validate", str(master_ckpt), "--strict", "--deep", "--json", exit_codes=(0, 1))
    doc = json.loads(r.stdout)
    assert doc["deep"] and doc["stats"]["bytes_read"] > 0


def test_P001_sgd_group_needs_no_betas(tmp_path: Path) -> None:
    """A plain SGD checkpoint failed `validate` with P001 'missing betas, eps' and the hint to save the full param
    groups, which it does; its momentum_buffer is SGD's known state (it was O008, which failed --strict)."""

    from tests.fixtures.builders import build_sgd

    build_sgd(tmp_path / "sgd")
    rc, doc, _ = run(tmp_path / "sgd", "--strict")
    assert rc == 0 and codes(doc) == set()
    damage.drop_keys(tmp_path / "sgd", lambda k: k == "optimizer.param_groups.0.lr")
    rc, doc, _ = run(tmp_path / "sgd")  # lr is still required
    p001 = [f["message"] for f in doc["findings"] if f["code"] == "P001"]
    assert rc == 1 and len(p001) == 1 and p001[0].startswith("param group 0: missing lr (has dampening, ")


@pytest.mark.parametrize("name", ["Adafactor", "Rprop"])
def test_P001_other_torch_optimizers_need_no_betas(tmp_path: Path, name: str) -> None:
    """torch's Adafactor (beta2_decay, d) and Rprop (etas, step_sizes; no weight_decay) save their full param groups:
    P001 failed them with 'missing betas' (Rprop also 'eps, weight_decay'); their state is known
    (``optim_state.known``: it was O008, which failed --strict)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    rc, doc, _ = run(tmp_path / "ck", "--strict")
    assert rc == 0 and codes(doc) == set(), doc["findings"]
    damage.drop_keys(tmp_path / "ck", lambda k: k == "optimizer.param_groups.0.lr")
    rc, doc, _ = run(tmp_path / "ck")  # lr is still required
    p001 = [f["message"] for f in doc["findings"] if f["code"] == "P001"]
    assert rc == 1 and len(p001) == 1 and p001[0].startswith("param group 0: missing lr (has "), p001


@pytest.mark.parametrize(("name", "asked"), [("Adafactor", "lr, weight_decay"), ("Rprop", "lr"), ("AdamW", None)])
def test_P001_a_group_that_lost_every_key_asks_its_optimizers_hyperparameters(
    tmp_path: Path, name: str, asked: str | None
) -> None:
    """A param group saved with only its params (every hyperparameter dropped) beside torch's Rprop or Adafactor
    state: P001 said 'missing lr, betas, eps, weight_decay', AdamW's, which Rprop's group never has; the state tells
    the optimizer (as inspect's saved_by does), so it now asks that one's (AdamW's state: still all four)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"] = [{"params": g["params"]} for g in osd["param_groups"]]
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    rc, doc, _ = run(tmp_path / "ck")
    p001 = [f["message"] for f in doc["findings"] if f["code"] == "P001"]
    assert rc == 1 and p001 == [f"param group 0: missing {asked or 'lr, betas, eps, weight_decay'} (has params)"]


def test_R002_plain_sgd_keeps_no_state(tmp_path: Path) -> None:
    """torch's SGD with momentum 0 steps without any per-parameter state: its empty optimizer.state beside
    train_state.step 3 and a scheduler's last_epoch 3 is not lost state (R002 failed a correct checkpoint).
    Groups of a stateful optimizer with no state are still R002 (tests/ops/test_perrank_verl.py)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    msd, osd = get_state_dict(model, opt)
    assert osd["state"] == {}
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 3}}
        dcp.save(state, checkpoint_id=str(tmp_path / "sgd"))
    rc, doc, _ = run(tmp_path / "sgd", "--deep")
    assert rc == 0 and "R002" not in codes(doc), doc["findings"]


def _save_app_state(out: Path, app_step: int, **beside: Any) -> None:
    """torch's DCP tutorial: ``dcp.save({"app": AppState(model, optimizer)})``, its ``state_dict()`` adding the LR
    scheduler and the loop's step, as training loops built on the tutorial do; AdamW and StepLR stepped 3 times."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    train_steps(model, opt, 3, sched=sched)

    class AppState(Stateful):
        def state_dict(self) -> dict[str, Any]:
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd, "scheduler": sched.state_dict(), "step": app_step}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            raise NotImplementedError

    save_quiet({"app": AppState(), **beside}, out)


def test_app_state_scheduler_and_step_are_read_as_training_state(tmp_path: Path) -> None:
    """An AppState save keeps its scheduler and step under ``app.``: they were "other keys", never compared, so
    ``app.step`` 7 beside optimizer step 3 passed ``validate --strict --deep``. They are now training state
    (inspect lists them with their counters) and R002 compares them, as it does top-level ones."""
    _save_app_state(tmp_path / "ok", 3)
    rc, doc, _ = run(tmp_path / "ok", "--deep", "--strict")
    assert rc == 0 and not codes(doc) & {"R002", "R004"}, doc["findings"]
    res = runner.invoke(app, ["inspect", str(tmp_path / "ok"), "--json"])
    ov = json.loads(res.stdout)
    assert sorted(ov["training_state"]) == ["scheduler", "step"]
    assert ov["training_state"]["step"] == ["app.step"]
    assert "app.scheduler.last_epoch" in ov["training_state"]["scheduler"]
    assert ov["training_values"]["app.scheduler.last_epoch"] == 3 and ov["training_values"]["app.step"] == 3
    text = runner.invoke(app, ["inspect", str(tmp_path / "ok")], env={"COLUMNS": "200"}).stdout
    assert "training    scheduler: 8 keys, last_epoch 3, _step_count 4; step: 1 key, value 3" in text

    _save_app_state(tmp_path / "stale", 7)
    rc, doc, _ = run(tmp_path / "stale", "--deep")
    r002 = [f for f in doc["findings"] if f["code"] == "R002"]
    assert rc == 1 and len(r002) == 1 and r002[0]["message"].endswith("but app.step = 7"), doc["findings"]

    _save_app_state(tmp_path / "beside", 3, step=9)  # a top-level item beside the app's is read too
    rc, doc, _ = run(tmp_path / "beside", "--deep")
    r002 = [f["message"] for f in doc["findings"] if f["code"] == "R002"]
    assert rc == 1 and len(r002) == 1 and "step = 9" in r002[0], doc["findings"]


def _save_amsgrad(out: Path, *, amsgrad: bool = True, change: Any = None) -> None:
    """A torch.optim.AdamW run (two groups: decay, no_decay) saved with ``dcp.save`` after 3 steps; ``change``
    edits the optimizer state dict before the save."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, amsgrad=amsgrad
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    if change is not None:
        change(osd["state"])
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd, "train_state": {"step": 3}}, checkpoint_id=str(out))


def test_amsgrad_adamw_checkpoint_passes_strict_and_its_max_exp_avg_sq_is_checked(tmp_path: Path) -> None:
    """A clean torch.optim.AdamW(amsgrad=True) checkpoint failed `validate --strict` with O008 'unknown state
    field max_exp_avg_sq', and O001/O004/O005 skipped every one of its parameters as not AdamW state. The field
    is AdamW's own where the param group says amsgrad=True: checked against exp_avg_sq (present, shape, dtype)."""
    _save_amsgrad(tmp_path / "clean")
    rc, doc, _ = run(tmp_path / "clean", "--strict", "--deep")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    passed = {r["code"] for r in doc["rules"] if r["status"] == "passed"}
    assert {"O001", "O004", "O005", "O008"} <= passed

    def to_bf16(state: dict[str, Any]) -> None:
        state["0.weight"]["max_exp_avg_sq"] = state["0.weight"]["max_exp_avg_sq"].to(torch.bfloat16)

    _save_amsgrad(tmp_path / "bf16", change=to_bf16)
    doc = only(tmp_path / "bf16", "O005")
    assert [f["message"] for f in doc["findings"]] == [
        "optimizer.state.0.weight.max_exp_avg_sq: bfloat16 but exp_avg_sq is float32 (amsgrad keeps their running "
        "maximum in its dtype)"
    ]

    def drop(state: dict[str, Any]) -> None:
        del state["2.bias"]["max_exp_avg_sq"]

    _save_amsgrad(tmp_path / "lacks", change=drop)
    doc = only(tmp_path / "lacks", "O001")
    assert [f["message"] for f in doc["findings"]] == [
        "2.bias: optimizer state lacks max_exp_avg_sq, which its amsgrad=True param group keeps"
    ]

    def add(state: dict[str, Any]) -> None:  # the field without amsgrad: not torch's AdamW state
        state["0.weight"]["max_exp_avg_sq"] = state["0.weight"]["exp_avg_sq"].clone()

    _save_amsgrad(tmp_path / "plain", amsgrad=False, change=add)
    only(tmp_path / "plain", "O008")


@pytest.mark.parametrize("kind", ["sequential", "chained"])
def test_R002_counts_a_sequential_scheduler_by_its_own_last_epoch_not_its_phases(tmp_path: Path, kind: str) -> None:
    """A clean run with torch's SequentialLR (LinearLR warmup for 5 steps, then cosine) saved at step 10 failed
    `validate --deep` with R002 'lr_scheduler._schedulers.0.last_epoch = 4 but train_state.step = 10': each phase
    counts only its own steps; the SequentialLR's own last_epoch counts the run's. A scheduler saved one step
    behind is still R002, for SequentialLR (its own counter) and ChainedScheduler (no counter of its own: its
    children each step every step)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.optim import lr_scheduler as lrs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = lrs.LinearLR(opt, start_factor=0.1, total_iters=5)
    if kind == "sequential":
        sched: Any = lrs.SequentialLR(opt, [warmup, lrs.CosineAnnealingLR(opt, T_max=100)], milestones=[5])
    else:
        sched = lrs.ChainedScheduler([warmup, lrs.ExponentialLR(opt, 0.99)])
    behind: dict[str, Any] = {}
    for step in range(1, 11):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        if step == 9:
            behind = copy.deepcopy(sched.state_dict())
    msd, osd = get_state_dict(model, opt)
    for name, sd in (("clean", sched.state_dict()), ("behind", behind)):
        with warnings.catch_warnings():  # torch: no process group, saving in one process
            warnings.simplefilter("ignore")
            state = {"model": msd, "optimizer": osd, "lr_scheduler": sd, "train_state": {"step": 10}}
            dcp.save(state, checkpoint_id=str(tmp_path / name))
    rc, doc, _ = run(tmp_path / "clean", "--deep", "--strict")
    assert rc == 0 and "R002" not in codes(doc), doc["findings"]
    rc, doc, _ = run(tmp_path / "behind", "--deep", "--strict")
    # a plain dcp.save (schema torch-native): the trainer's convention is not known, behind is R004 (warning)
    behind_msgs = sorted(f["message"].split(":")[0] for f in doc["findings"] if f["code"] == "R004")
    if kind == "sequential":
        assert behind_msgs == ["LR scheduler lr_scheduler.last_epoch = 9 but train_state.step = 10"], behind_msgs
    else:
        assert behind_msgs == [
            f"LR scheduler lr_scheduler._schedulers.{i}.last_epoch = 9 but train_state.step = 10" for i in (0, 1)
        ], behind_msgs
    assert rc == 1 and "R002" not in codes(doc)


def test_R002_a_cosine_warm_restarts_scheduler_whose_step_count_torch_leaves_at_0_is_clean(tmp_path: Path) -> None:
    """torch's CosineAnnealingWarmRestarts overrides step() and never counts `_step_count` (saved 0 at every step):
    a clean run saved at step 6 failed `validate --deep` with R002 'lr_scheduler._step_count = 0 but
    lr_scheduler.last_epoch = 6 (expected last_epoch + 1)'. A `_step_count` another scheduler saved out of step with
    its `last_epoch` is still R002."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.optim import lr_scheduler as lrs

    from tests.fixtures.builders import save_quiet, train_steps

    saves = {}
    for name, make in (
        ("cawr", lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2)),
        ("lambda", lambda o: lrs.LambdaLR(o, lambda k: 1.0)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = make(opt)
        train_steps(model, opt, 6, sched=sched)
        msd, osd = get_state_dict(model, opt)
        saves[name] = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 6}}
    assert saves["cawr"]["lr_scheduler"]["_step_count"] == 0 and saves["cawr"]["lr_scheduler"]["last_epoch"] == 6
    save_quiet(saves["cawr"], tmp_path / "cawr")
    rc, doc, _ = run(tmp_path / "cawr", "--deep", "--strict")
    assert rc == 0 and [f["code"] for f in doc["findings"]] == ["P002"], doc["findings"]  # info: the lr moved
    saves["lambda"]["lr_scheduler"]["_step_count"] = 9
    save_quiet(saves["lambda"], tmp_path / "off")
    doc = only(tmp_path / "off", "R002", "--deep")
    assert [f["message"] for f in doc["findings"]] == [
        "LR scheduler lr_scheduler._step_count = 9 but lr_scheduler.last_epoch = 6 (expected last_epoch + 1)"
    ]


def test_R004_a_scheduler_stepped_per_epoch_in_a_plain_save_is_a_warning_not_R002(tmp_path: Path) -> None:
    """torch's classic loop steps StepLR once per epoch: after 3 epochs of 10 steps `last_epoch` is 3 while the
    optimizer's step is 30. `validate --deep` failed it with R002 (error, exit 1 without --strict) though nothing is
    wrong. In a plain dcp.save the trainer's convention is not known: a scheduler behind the step is R004 (warning:
    per epoch, or stale; `--ignore R004`), one ahead of it is still R002; in a torchtitan save (its
    LRSchedulersContainer steps every train step) behind is still R002."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        sched.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, checkpoint_id=str(tmp_path / "ep")
        )
        ahead = {**sched.state_dict(), "last_epoch": 31, "_step_count": 32}
        dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": ahead}, checkpoint_id=str(tmp_path / "ahead"))
    rc, doc, _ = run(tmp_path / "ep", "--deep")
    assert rc == 0 and codes(doc) == {"R004"}, doc["findings"]
    [f] = [f for f in doc["findings"] if f["code"] == "R004"]
    assert f["severity"] == "warning" and f["key"] == "lr_scheduler.last_epoch"
    assert "last_epoch = 3 but" in f["message"] and "= 30" in f["message"] and "--ignore R004" in f["hint"]
    rc, doc, _ = run(tmp_path / "ep", "--deep", "--strict", "--ignore", "R004")
    assert rc == 0 and codes(doc) == set(), doc["findings"]
    only(tmp_path / "ahead", "R002", "--deep")


def test_D007_moments_of_a_real_run_beside_a_step_reset_to_0(tmp_path: Path) -> None:
    """A torch.optim.AdamW run of 20 steps saved with every `step` reset to 0 (a converter or resume that reset the
    counter) passed `validate --strict --deep` (exit 0): D007 skipped steps below 1, yet after no step Adam's
    moments are zero. The next step bias-corrects them as step 1 (exp_avg * 10). Now D007 names each parameter;
    the unreset save is clean."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 20, loss="square")
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "clean")
    for st in osd["state"].values():
        st["step"] = torch.tensor(0.0)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "reset")
    rc, doc, _ = run(tmp_path / "clean", "--strict", "--deep")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    doc = only(tmp_path / "reset", "D007", "--deep")
    assert sorted(f["message"].split(":")[0] for f in doc["findings"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert all("at step 0, before any Adam step" in f["message"] for f in doc["findings"])


def test_D007_names_the_nan_moments_its_ratio_leaves_out(tmp_path: Path) -> None:
    """A step reset to 0 beside the moments of 20 AdamW steps, 3 of one parameter's `exp_avg` values NaN: D007 gave
    the largest |exp_avg|/sqrt(exp_avg_sq) of the other 29 as the parameter's, not saying NaN was there (as D004
    counts a NaN against a number). It now names the count it left out; D001 names the values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 20, loss="square")
    msd, osd = get_state_dict(model, opt)
    for st in osd["state"].values():
        st["step"] = torch.tensor(0.0)
    osd["state"]["0.weight"]["exp_avg"].view(-1)[:3] = float("nan")
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "nan")
    rc, doc, _ = run(tmp_path / "nan", "--deep")
    assert rc == 1 and codes(doc) == {"D001", "D007"}, doc["findings"]
    d007 = {f["message"].split(":")[0]: f["message"] for f in doc["findings"] if f["code"] == "D007"}
    assert "3 of 32 values of exp_avg are NaN or infinite, left out (D001)" in d007["0.weight"], d007
    assert all("NaN" not in m for k, m in d007.items() if k != "0.weight"), d007


def _amp_run() -> tuple[dict[str, Any], dict[str, Any], int]:
    """30 iterations of a clean fp16 AMP run on CPU (torch's recipe: scaler.step(opt); scaler.update(); sched.step()),
    whose GradScaler skips the optimizer step of the first iterations (their scaled gradients overflow):
    ``({"model", "optimizer", "lr_scheduler"} state dicts, the scaler's state dict, optimizer steps taken)``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # overflows at first: skipped steps
    for _ in range(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(3, 4)).pow(2).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    taken = int(opt.state[model.weight]["step"])
    assert 0 < taken < 30
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, scaler.state_dict(), taken


def _save_each(root: Path, saves: dict[str, dict[str, Any]]) -> None:
    """``dcp.save`` of each state dict to ``root/<name>`` (one process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    for name, state in saves.items():
        with warnings.catch_warnings():  # torch: no process group, saving in one process
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(root / name))


def test_R002_optimizer_steps_skipped_by_a_grad_scaler_are_not_a_mismatch(tmp_path: Path) -> None:
    """A clean fp16 AMP run (torch.amp.GradScaler, torch's recipe: scaler.step(opt); scaler.update(); sched.step())
    saved with its scaler failed `validate --deep` with R002 'optimizer step 18 ... but train_state.step = 30': the
    scaler skips the optimizer step of an iteration whose scaled gradients overflow while the trainer and the
    scheduler count it. With a saved GradScaler the optimizer may be behind; ahead is still R002, and so is behind
    without a scaler."""
    base, scaler, taken = _amp_run()
    _save_each(
        tmp_path,
        {
            "amp": {**base, "scaler": scaler, "train_state": {"step": 30}},
            "ahead": {**base, "scaler": scaler, "train_state": {"step": taken - 1}},
            "no_scaler": {**base, "train_state": {"step": 30}},
        },
    )
    rc, doc, _ = run(tmp_path / "amp", "--deep", "--strict")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    for name, ref in (("ahead", f"train_state.step = {taken - 1}"), ("no_scaler", "train_state.step = 30")):
        rc, doc, _ = run(tmp_path / name, "--deep")
        opt_msgs = [f["message"] for f in doc["findings"] if f["code"] == "R002" and f["message"].startswith("opt")]
        one_ahead = "; one ahead, as after a save before the first step" if name == "ahead" else ""
        assert rc == 1 and [m.split(": get_state_dict")[0] for m in opt_msgs] == [
            f"optimizer step {taken} (optimizer.state.weight.step, the largest) but {ref}{one_ahead}"
        ], doc["findings"]


def test_a_scheduler_ahead_of_an_optimizer_whose_steps_a_grad_scaler_skipped_is_not_a_mismatch(
    tmp_path: Path,
) -> None:
    """The same AMP run saved without a trainer step (model, optimizer, scheduler, scaler: a plain training loop's
    save): R002 compared the scheduler's last_epoch 30 with the optimizer's step and failed `validate --deep`, and
    replay-step said the two were of different saves, though the scaler's skipped steps are counted by the scheduler
    alone. With a saved GradScaler a scheduler ahead of the optimizer is no finding; without one it still is."""
    base, scaler, taken = _amp_run()
    _save_each(tmp_path, {"amp": {**base, "scaler": scaler}, "no_scaler": base})
    rc, doc, _ = run(tmp_path / "amp", "--deep", "--strict")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    res = runner.invoke(app, ["replay-step", str(tmp_path / "amp"), "--device", "cpu", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["problems"] == [], res.output
    rc, doc, _ = run(tmp_path / "no_scaler", "--deep")
    assert rc == 1 and [f["message"] for f in doc["findings"] if f["code"] == "R002"] == [
        f"LR scheduler lr_scheduler.last_epoch = 30 but optimizer.state.weight.step = {taken}"
    ], doc["findings"]


def test_R002_state_torch_made_up_for_a_rebuilt_optimizer_beside_steps_taken(tmp_path: Path) -> None:
    """A model trained 4 steps saved with `get_state_dict(model, fresh_optimizer)` (an optimizer rebuilt before the
    save: torch's `_init_optim_state` makes up step 1 and all-zero moments) beside `train_state.step` 4 and the LR
    scheduler's `last_epoch` 4 passed `validate --deep` with only the D005 warning (exit 0): R002 skipped every
    synthesized state as a save before the first step, though the moments of 4 steps were lost, which it reports
    for an optimizer with no state at all, and replay-step said OK. Now R002 and a replay problem; a step-0 save, and one beside a GradScaler (which may have
    skipped every step so far), are not."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    train_steps(model, opt, 4, sched=sched)
    model.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert float(osd["state"]["weight"]["step"]) == 1 and not osd["state"]["weight"]["exp_avg"].any()
    scaler = torch.amp.GradScaler("cpu").state_dict()
    base = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}
    save_quiet({**base, "train_state": {"step": 4}}, tmp_path / "rebuilt")
    save_quiet({**base, "lr_scheduler": {**sched.state_dict(), "last_epoch": 0, "_step_count": 1}}, tmp_path / "s0")
    save_quiet({**base, "scaler": scaler, "train_state": {"step": 4}}, tmp_path / "amp")
    rc, doc, _ = run(tmp_path / "rebuilt", "--deep")
    assert rc == 1 and sorted(f["code"] for f in doc["findings"]) == ["D005", "R002"], doc["findings"]
    lost = (
        "the optimizer state of all 2 parameter(s) is what torch makes up for an optimizer that never stepped (step 1, "
        "all-zero moments: D005) but train_state.step = 4: the moments of 4 step(s) were not saved (an optimizer "
        "rebuilt before the save): resume from an earlier save whose optimizer state was saved; where it was reset on "
        "purpose (these weights fine-tuned with a new optimizer), a resume restarts the moments from zero, as that "
        "reset did"
    )
    assert [f["message"] for f in doc["findings"] if f["code"] == "R002"] == [lost]
    for name in ("s0", "amp"):
        rc, doc, _ = run(tmp_path / name, "--deep")
        assert rc == 0 and [f["code"] for f in doc["findings"]] == ["D005"], doc["findings"]
    # replay-step said OK on the rebuilt one: it now names the same problem
    for name, problems in (("rebuilt", [lost + " (`ckpttool validate --deep` reports R002)"]), ("s0", []), ("amp", [])):
        res = runner.invoke(app, ["replay-step", str(tmp_path / name), "--device", "cpu", "--json"])
        assert json.loads(res.stdout)["problems"] == problems and res.exit_code == (1 if problems else 0), res.output


def test_an_optimizer_one_step_ahead_after_a_step_0_save_says_why(tmp_path: Path) -> None:
    """A run that saved at step 0 (``get_state_dict`` before any ``optimizer.step()``) and again at step 3: torch's
    ``_init_optim_state`` took a zero-lr step to create the state, and the live optimizer kept it, so step 3's save
    says optimizer step 4. R002 was right but gave no cause; it now says what leaves an optimizer one ahead."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        for step in range(4):
            if step in (0, 3):
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optimizer": osd, "train_state": {"step": step}}
                dcp.save(state, checkpoint_id=str(tmp_path / f"s{step}"))
            if step < 3:
                model(torch.randn(5, 4)).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
    assert int(opt.state[model[0].weight]["step"]) == 4  # the zero-lr step of the step-0 save, then 3 real ones
    rc, doc, _ = run(tmp_path / "s3", "--deep")
    msgs = [f["message"] for f in doc["findings"] if f["code"] == "R002"]
    assert rc == 1 and len(msgs) == 1 and msgs[0].startswith("optimizer step 4 ("), doc["findings"]
    assert msgs[0].endswith(
        "but train_state.step = 3; one ahead, as after a save before the first step: get_state_dict on an optimizer "
        "with no state yet takes one zero-lr step to create it (torch's _init_optim_state) and the live optimizer "
        "keeps counting from it"
    ), msgs


def test_a_float64_step_of_a_float64_default_dtype_run_is_adamws_own(tmp_path: Path) -> None:
    """``torch.optim.AdamW`` makes its step counter float64 when the run's default dtype is float64
    (``_get_scalar_dtype``): a clean run saved so was O005 in validate ("step is float64 (expected float32)") and E511
    in replay-step ("every AdamW variant saves a float32 step"). Both now take it; replay-step equals torch's step."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            model(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        assert opt.state[model[0].weight]["step"].dtype == torch.float64
        msd, osd = get_state_dict(model, opt)
    finally:
        torch.set_default_dtype(before)
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "c"))
    rc, doc, _ = run(tmp_path / "c", "--strict", "--deep")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    res = runner.invoke(app, ["replay-step", str(tmp_path / "c"), "--reference", "torch", "--json"])
    assert res.exit_code == 0, res.stderr
    params = json.loads(res.stdout)["params"]
    assert len(params) == 4 and all(
        p["torch_unequal"] == dict.fromkeys(("param", "exp_avg", "exp_avg_sq", "step"), 0) for p in params
    )
    # a master-weight type's float64 step is still not one any of its writers saves
    from ckpttool.errors import OptimStateError
    from ckpttool.optim_state.schema import infer_optimizer_type

    with pytest.raises(OptimStateError, match="every AdamW variant saves a float32 step"):
        infer_optimizer_type(
            {"step": "float64", "master_weight": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}
        )


def test_inspect_reads_a_saved_grad_scaler_as_training_state(tmp_path: Path) -> None:
    """torch's AMP recipe saves `scaler.state_dict()` beside model and optimizer; `inspect` listed its five entries as
    'other keys' beside the other byte items, as if ckpttool did not know them. They are now a training-state item,
    as `lr_scheduler` is."""
    base, scaler, _ = _amp_run()
    _save_each(tmp_path, {"amp": {**base, "scaler": scaler}})
    res = runner.invoke(app, ["inspect", str(tmp_path / "amp"), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and sorted(doc["training_state"]) == ["lr_scheduler", "scaler"], doc["training_state"]
    assert sorted(doc["training_state"]["scaler"]) == [f"scaler.{k}" for k in sorted(scaler)]
    text = runner.invoke(app, ["inspect", str(tmp_path / "amp")], env={"COLUMNS": "200"}).stdout
    assert "other keys" not in text and "scaler: 5 keys" in text, text


def test_a_frozen_parameter_in_a_stepped_group_says_how_to_tell_it_from_lost_state(tmp_path: Path) -> None:
    """An embedding frozen (requires_grad=False) after AdamW was built over ``model.parameters()`` never gets state
    while its group steps: O009 (metadata alone cannot tell it from lost state). The hint only said 'use an earlier
    checkpoint', which no earlier checkpoint of that run helps; it now names the frozen case and what to do."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[0].weight.requires_grad_(False)
    model(torch.randint(0, 16, (2, 4))).pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    assert sorted(osd["state"]) == ["1.bias", "1.weight"]  # torch gave the frozen weight no state
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path))
    res = CliRunner().invoke(app, ["validate", str(tmp_path), "--json"])
    (f,) = json.loads(res.stdout)["findings"]
    assert (res.exit_code, f["code"], f["key"]) == (1, "O009", "0.weight")
    assert "requires_grad=False" in f["hint"] and "--ignore O009" in f["hint"]
