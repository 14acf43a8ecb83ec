"""reshard on the storage kinds beyond FileSystemWriter's default: rank-local metadata works, the others refuse.

References: the EP suite's true state (``tests/fixtures/moe_ep.py``), read back from the output with
torch's own ``dcp_to_torch_save`` (its ``dcp.load`` of every tensor); the fixtures of torch's writer
options and megatron-core's own ``torch_dist`` saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build
from tests.fixtures.moe_ep import true_state

runner = CliRunner()
DECL = ("--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2")
MEGATRON = Path(__file__).parent.parent.parent / "fixtures" / "megatron_data"


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def test_rank_local_metadata_reshards_bitwise(ep_suite: Path, tmp_path: Path) -> None:
    """``use_collectives=False`` (``__R.metadata`` only): legacy -> canonical is the true state, as torch loads it;
    the source's rank-local metadata files are not copied beside the new ``.metadata``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = ep_suite / "legacy_rank_local"
    assert not (src / ".metadata").exists() and (src / "__3.metadata").is_file()
    out = tmp_path / "out"
    res = runner.invoke(app, ["reshard", str(src), str(out), "--to", "canonical", *DECL, "--with-optimizer"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == [".ckpttool-output.json", ".metadata"] + [
        f"__{r}_0.distcp" for r in range(4)
    ]
    dcp_to_torch_save(str(out), str(tmp_path / "full.pt"))
    got = _flat(torch.load(tmp_path / "full.pt", weights_only=False))
    true = true_state(8)
    for k, v in true.items():
        if k != "param_groups":
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.heavy  # CI time
def test_other_kinds_are_refused_naming_the_kind(fixture_root: Path, tmp_path: Path) -> None:
    """DCP safetensors serialization and megatron torch_dist: E602 naming what was seen, nothing written."""
    from tests.fixtures.torch_writers import build_torch_writers

    tw = cached_build(fixture_root, "torch_writers", build_torch_writers)
    for src, words in (
        (tw / "safetensors", "SerializationFormat.SAFETENSORS"),
        (MEGATRON / "moe_ep2", "megatron-core torch_dist"),
    ):
        out = tmp_path / src.name
        res = runner.invoke(app, ["reshard", str(src), str(out), "--to", "canonical", "--with-optimizer"])
        assert res.exit_code == 2 and res.stderr.startswith("error: [E602]") and words in res.stderr, res.stderr
        assert not out.exists()


def test_a_hugging_face_model_folder_is_refused_pointing_to_import(sample_ckpt: Path, tmp_path: Path) -> None:
    """`reshard hf/ out/` of a model folder (here ckpttool's own export) called it "a HuggingFaceStorageWriter
    checkpoint" and hinted `ckpttool export` it or re-save it with dcp.save: neither applies to a model folder;
    `ckpttool import` writes the DCP checkpoint for a mesh."""
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf)]).exit_code == 0
    out = tmp_path / "out"
    res = runner.invoke(app, ["reshard", str(hf), str(out), "--to", "canonical", "--with-optimizer"])
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0].startswith(f"error: [E602] {hf}: a safetensors checkpoint (a Hugging Face model folder or ")
    assert lines[1].startswith("hint: `ckpttool import` it") and "ckpttool export" not in lines[1]
    assert not out.exists()


def _save_index_keyed(rank: int, world: int, out: str) -> None:
    """The legacy 2 x 2 EP save of the suite with the optimizer as a plain ``optimizer.state_dict()`` has it:
    state and param groups keyed by parameter index."""
    import torch.distributed.checkpoint as dcp

    from tests.fixtures.moe_ep import _sharded_state

    msd, osd = _sharded_state(true_state(8), "legacy", rank, 2, 2, 0)
    assert osd is not None
    names = list(osd["state"])
    state = {i: osd["state"][n] for i, n in enumerate(names)}
    groups = [dict(g, params=list(range(len(names)))) for g in osd["param_groups"]]
    dcp.save({"model": msd, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=out)


@pytest.mark.slow  # a 4-rank gloo save
def test_index_keyed_optimizer_state_is_refused_when_the_expert_order_changes(tmp_path: Path) -> None:
    """State keyed by parameter index names no parameter: reshard permuted the experts and passed their
    exp_avg/exp_avg_sq/master_weight through in the legacy order (with or without --with-optimizer, "0
    optimizer state tensors"), exit 0. It is E251 now, nothing written; a target in the same order still works."""
    from tests.fixtures.distributed import run_ranks

    src = tmp_path / "indexed"
    run_ranks(4, _save_index_keyed, str(src))
    for extra in ((), ("--with-optimizer",)):
        res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--to", "canonical", *DECL, *extra])
        assert res.exit_code == 2, res.stdout
        assert res.stderr.startswith("error: [E251] optim.state.3.master_weight: the optimizer state under 'optim.'")
        assert "get_optimizer_state_dict" in res.stderr
        assert not (tmp_path / "o").exists()
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "same"), "--to", "legacy", *DECL])
    assert res.exit_code == 0, res.stderr
    assert "0 with a new expert order" in res.stdout


def test_a_malformed_layout_record_hint_does_not_send_back_to_the_declaration(ep_suite: Path, tmp_path: Path) -> None:
    """A garbage layout.json, or an embedded item that is ckpttool's record by its format but malformed, is read
    as the layout record whatever is declared, yet the E400 hint said "declare the layout with --source-layout
    ...": declaring gave the same error and the same hint. The hint now says what to do with the record itself."""
    import json
    import shutil

    import torch.distributed.checkpoint as dcp

    own = tmp_path / "own"
    g = torch.Generator().manual_seed(0)
    experts = torch.randn(8, 4, 5, generator=g)
    broken = json.dumps({"format": "ckpttool.layout", "version": 2, "parallel": {"ep_size": 0}})
    dcp.save({"model": {"layers.0.mlp.experts.down_proj": experts}, "layout": broken}, checkpoint_id=own, no_dist=True)
    res = runner.invoke(
        app,
        ["reshard", str(own), str(tmp_path / "o"), "--to", "canonical", "--no-ep", "--target-ep-size", "2"]
        + ["--target-ep-fsdp-size", "1"],
    )
    assert res.exit_code == 2 and res.stderr.startswith(
        f"error: [E400] {own}: byte item 'layout': parallel.ep_size is 0"
    )
    assert "declare the layout with" not in res.stderr
    assert "a declaration does not replace it" in res.stderr
    side = tmp_path / "side"
    shutil.copytree(ep_suite / "legacy", side)
    (side / "layout.json").write_text("garbage")
    res = runner.invoke(app, ["reshard", str(side), str(tmp_path / "o"), "--to", "canonical", *DECL])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E400] {side}/layout.json: not valid JSON")
    assert "hint: fix or delete layout.json, then declare the layout" in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("item", ["bshd", '{"tp": 2, "order": "bshd"}'])
def test_a_layout_item_of_the_trainers_own_is_an_item_not_a_record(tmp_path: Path, item: str) -> None:
    """``dcp.save({"model": ..., "layout": "bshd"})`` (a trainer's own top-level ``layout`` item, not ckpttool's
    record) failed every command: inspect showed the layout as an E400 error, validate failed L001, export, stamp
    and reshard refused E400 with a hint to save the checkpoint again. The item is told from the record by content
    now: inspect, validate and export read the checkpoint as unversioned; stamp records the layout in layout.json;
    reshard refuses (E400, one line, the stamp hint) until the layout is recorded, then keeps the trainer's item
    as saved and writes its record to the output's layout.json."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from ckpttool.layouts.record import parse_layout_record

    g = torch.Generator().manual_seed(0)
    model = {"layers.0.mlp.experts.down_proj": torch.randn(8, 4, 5, generator=g), "layers.0.w": torch.randn(3, 3)}
    src = tmp_path / "src"
    dcp.save({"model": model, "layout": item}, checkpoint_id=src, no_dist=True)
    res = runner.invoke(app, ["inspect", str(src), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["layout_error"] is None and doc["layout"]["source"] == "none", res.stdout
    res = runner.invoke(app, ["validate", str(src), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.stdout
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.stderr
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(model) and all(torch.equal(exported[k], v) for k, v in model.items())
    out = tmp_path / "out"
    target = ["--to", "canonical", "--target-ep-size", "2", "--target-ep-fsdp-size", "1"]
    res = runner.invoke(app, ["reshard", str(src), str(out), *target, "--no-ep"])
    assert res.exit_code == 2 and len(res.stderr.splitlines()) == 2 and not out.exists(), res.stderr
    assert res.stderr.startswith(f"error: [E400] {src}: the byte item 'layout' is the trainer's own"), res.stderr
    assert f"hint: record the layout beside it with `ckpttool stamp {src} --source-layout" in res.stderr
    res = runner.invoke(
        app, ["stamp", str(src), "--source-layout", "canonical", "--ep-size", "1"] + ["--ep-fsdp-size", "1"]
    )
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["reshard", str(src), str(out), *target])
    assert res.exit_code == 0, res.stderr
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "layout": None}
    dcp.load(loaded, checkpoint_id=out, no_dist=True)  # torch's own reader: the trainer's item as it saved it
    assert loaded["layout"] == item and all(torch.equal(loaded["model"][k], v) for k, v in model.items())
    rec = parse_layout_record((out / "layout.json").read_text())
    assert (rec.version, rec.ep_size, rec.ep_fsdp_size) == (2, 2, 1)
    assert list(rec.extra_parallel) == ["model.layers.0.mlp.experts.down_proj"]
    res = runner.invoke(app, ["validate", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.stdout
    res = runner.invoke(app, ["inspect", str(out), "--json"])
    assert json.loads(res.stdout)["layout"]["source"] == "sidecar"


_CTRL_C_AS_THE_MANIFEST_IS_WRITTEN = """
import os, signal, sys
from ckpttool.ops.reshard import execute

real = execute._write_output_manifest

def write_output_manifest(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C once layout.json is written in the temporary directory
    return real(*args, **kwargs)

execute._write_output_manifest = write_output_manifest
sys.argv = ["ckpttool", *sys.argv[1:]]
from ckpttool.cli import entry
entry()
"""


def test_ctrl_c_after_the_record_is_written_in_the_unfinished_output_says_only_interrupted(tmp_path: Path) -> None:
    """reshard of a checkpoint with a trainer's own ``layout`` item writes its record to ``layout.json`` in the
    temporary directory; Ctrl-C then (as ``--manifest`` is written) ended with 'error: interrupted after
    <OUT's temporary directory>/layout.json was written: it is complete', while the temporary directory was removed
    and no output is left. The line is the bare 'error: interrupted' (exit 130) and nothing is on disk."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    model = {"layers.0.mlp.experts.down_proj": torch.randn(8, 4, 5), "layers.0.w": torch.randn(3, 3)}
    dcp.save({"model": model, "layout": "bshd"}, checkpoint_id=src, no_dist=True)
    stamp = ["stamp", str(src), "--source-layout", "canonical", "--ep-size", "1", "--ep-fsdp-size", "1"]
    assert runner.invoke(app, stamp).exit_code == 0
    out = tmp_path / "out"
    target = ["--to", "canonical", "--target-ep-size", "2", "--target-ep-fsdp-size", "1", "--manifest", "-q"]
    cmd = [sys.executable, "-c", _CTRL_C_AS_THE_MANIFEST_IS_WRITTEN, "reshard", str(src), str(out), *target]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: interrupted", proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@dataclass
class TrainerLayout:
    """A trainer's own object saved under the name ``layout`` (not in torch's safe globals)."""

    order: str


def test_a_layout_item_of_the_trainers_own_is_read_by_validate_deep(tmp_path: Path) -> None:
    """validate --deep reads every byte item (S011: one torch.load(weights_only=True) refuses) but left out the one
    named 'layout' as ckpttool's record, so a trainer's own 'layout' object that needs --trust-pickle passed as OK.
    A 'layout' item that is not ckpttool's record is read as any other now. (The trainer's class is this module's
    own: argparse.Namespace, say, is one megatron-core's import adds to torch's safe globals for the whole process.)"""
    import json

    import torch.distributed.checkpoint as dcp

    model = {"layers.0.mlp.experts.down_proj": torch.zeros(8, 4, 5)}
    dcp.save({"model": model, "layout": TrainerLayout("bshd")}, checkpoint_id=tmp_path / "c", no_dist=True)
    res = runner.invoke(app, ["validate", "--deep", "--json", str(tmp_path / "c")])
    assert res.exit_code == 1, res.stdout
    ((code, key, message),) = [(f["code"], f["key"], f["message"]) for f in json.loads(res.stdout)["findings"]]
    assert (code, key) == ("S011", "layout") and message.endswith(f"classes {__name__}.TrainerLayout"), message


def _save_with_ema(rank: int, world: int, out: str) -> None:
    """The legacy 2 x 2 EP save of the suite with an EMA copy of the expert weights beside the model
    (``{"model", "optimizer", "ema"}``), sharded like them."""
    import torch.distributed.checkpoint as dcp

    from tests.fixtures.moe_ep import _sharded_state, is_ep

    msd, osd = _sharded_state(true_state(8), "legacy", rank, 2, 2, 0)
    ema = {k: v for k, v in msd.items() if is_ep(f"model.{k}")}
    dcp.save({"model": msd, "optimizer": osd, "ema": ema}, checkpoint_id=out)


@pytest.mark.slow  # a 4-rank gloo save
def test_an_expert_tensor_outside_model_and_optimizer_is_refused_when_the_order_changes(tmp_path: Path) -> None:
    """An EMA copy of the experts ('ema.model.layers.0.mlp.experts.gate_up_proj', uncategorized) was copied in
    the legacy order while the model's experts and their optimizer state were put in the canonical one, exit 0
    ("27 other tensors ... copied unchanged"). It is E602 now, nothing written; a target in the same order
    still copies it."""
    from tests.fixtures.distributed import run_ranks

    src = tmp_path / "ema"
    run_ranks(4, _save_with_ema, str(src))
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--to", "canonical", "--with-optimizer", *DECL])
    assert res.exit_code == 2, res.stdout
    assert res.stderr.startswith("error: [E602] ema.model.layers.0.mlp.experts.gate_up_proj: an expert tensor outside")
    assert not (tmp_path / "o").exists()
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "same"), "--to", "legacy", "--with-optimizer", *DECL])
    assert res.exit_code == 0, res.stderr
    assert "0 with a new expert order" in res.stdout


def _save_optimizer_only(rank: int, world: int, out: str) -> None:
    """The optimizer state of the suite's legacy 2 x 2 EP save, saved on its own (``{"optimizer": ...}``)."""
    import torch.distributed.checkpoint as dcp

    from tests.fixtures.moe_ep import _sharded_state

    _, osd = _sharded_state(true_state(8), "legacy", rank, 2, 2, 0)
    dcp.save({"optimizer": osd}, checkpoint_id=out)


@pytest.mark.slow  # a 4-rank gloo save
def test_expert_optimizer_state_without_its_parameters_is_refused(tmp_path: Path) -> None:
    """An optimizer saved on its own, declared legacy 2 x 2: reshard --to canonical found "0 EP parameters",
    copied the experts' state in the legacy order and recorded the output as canonical, exit 0. It is E602 now,
    nothing written; a target in the same legacy order still copies it."""
    from tests.fixtures.distributed import run_ranks

    src = tmp_path / "optim"
    run_ranks(4, _save_optimizer_only, str(src))
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--to", "canonical", "--with-optimizer", *DECL])
    assert res.exit_code == 2, res.stdout
    assert res.stderr.startswith("error: [E602] optimizer.state.model.layers.0.mlp.experts.gate_up_proj.master_weight")
    assert "which the checkpoint does not hold" in res.stderr
    assert not (tmp_path / "o").exists()
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "same"), "--to", "legacy", "--with-optimizer", *DECL])
    assert res.exit_code == 0, res.stderr


def test_metadata_whose_chunks_do_not_cover_its_size_is_named_before_shapes_are_compared(tmp_path: Path) -> None:
    """A .metadata that gives an expert parameter the size [8, 8, 6] while its chunks (and its optimizer state)
    hold [8, 8, 5] was refused with E602 "exp_avg: shape [8, 8, 5] differs from its parameter's [8, 8, 6]": the
    state was blamed for the metadata's inconsistency. The error now names the tensor whose chunks do not tile
    the size .metadata gives it; nothing written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.hostile import load_torch_metadata, write_torch_metadata

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.experts = torch.nn.Module()
    model.layers[0].mlp.experts.down_proj = torch.nn.Parameter(torch.randn(8, 8, 5))
    opt = torch.optim.AdamW(model.parameters())
    model.layers[0].mlp.experts.down_proj.sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    src = tmp_path / "lie"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(src), no_dist=True)
    md = load_torch_metadata(src)
    key = "model.layers.0.mlp.experts.down_proj"
    md.state_dict_metadata[key].size = torch.Size([8, 8, 6])
    write_torch_metadata(src, md)
    for flags in ((), ("--with-optimizer",)):
        res = runner.invoke(
            app,
            ["reshard", str(src), str(tmp_path / "o"), "--to", "canonical", *flags]
            + ["--target-ep-size", "2", "--target-ep-fsdp-size", "1"],
        )
        assert res.exit_code == 2, res.stdout
        assert res.stderr.startswith(
            f"error: [E301] {src}: chunks of {key!r} do not tile the size [8, 8, 6] that .metadata gives it (gap: "
        ), res.stderr
        assert "optimizer.state" not in res.stderr
        assert not (tmp_path / "o").exists()


def test_an_output_path_through_dotdot_means_what_the_shell_means(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reshard L missing/../X` wrote ./X although missing/ does not exist (the path was normalized as text), and
    `link/../X` wrote ./X where the shell and every later command see <link's target>/../X. Reshard and export
    (one output layer) now refuse the first (E600, nothing written) and write the second where the kernel puts it."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    experts = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    dcp.save({"model": {"layers.0.mlp.experts.down_proj": experts}}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    sizes = ["--to", "canonical", "--target-ep-size", "2", "--target-ep-fsdp-size", "1"]
    for args in (["reshard", "ck", "missing/../X", *sizes], ["reshard", "ck", "missing/../X", *sizes, "--dry-run"],
                 ["export", "ck", "missing/../X"]):  # fmt: skip
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.stdout
        assert res.stderr.startswith(
            "error: [E600] missing/../X: cannot write there (missing is not an existing directory, so missing/.. "
        ), res.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    res = runner.invoke(app, ["reshard", "ck", "link/../X", *sizes])
    assert res.exit_code == 0, res.stderr
    assert not (tmp_path / "X").exists() and (tmp_path / "real" / "X" / ".metadata").is_file()
    res = runner.invoke(app, ["inspect", "link/../X"])
    assert res.exit_code == 0, res.stderr


def _save_with_expert_bias(rank: int, world: int, out: str) -> None:
    """The legacy 2 x 2 EP save of the suite (model only) with a per-expert bias
    ``model.layers.0.mlp.experts.down_proj_bias [8]`` (expert ``j`` holds ``j``) sharded like the experts:
    ``(Shard(0), Shard(0))`` on the ``(ep_fsdp, ep)`` mesh, so its stored order is block-transposed too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from tests.fixtures.moe_ep import _meshes, _sharded_state, ep_local

    msd, _ = _sharded_state(true_state(8, optimizer=False), "legacy", rank, 2, 2, 0)
    _, ep_mesh, _, shard = _meshes("legacy", 2, 2)
    bias = torch.arange(8, dtype=torch.float32)
    local = ep_local(bias, "legacy", rank, 2, 2, 0).clone()
    msd["model.layers.0.mlp.experts.down_proj_bias"] = DTensor.from_local(
        local, ep_mesh, [shard(0), shard(0)], run_check=False, shape=bias.shape, stride=bias.stride()
    )
    dcp.save({"model": msd}, checkpoint_id=out)


@pytest.mark.slow  # a 4-rank gloo save
def test_a_one_dim_per_expert_tensor_is_refused_when_the_order_changes(tmp_path: Path) -> None:
    """A 1-D per-expert tensor under ``experts.`` (a bias or scale ``[E]``) is no fused EP tensor (those have at
    least 2 dims): it was copied in the legacy order while the expert weights were put in the canonical one,
    exit 0 (torch's reader of the output: biases 0, 1, 4, 5, 2, 3, 6, 7 beside weights 0..7). It is E602 now,
    nothing written; a target in the same order still copies it."""
    from tests.fixtures.distributed import run_ranks
    from tests.ops.export.test_export import torch_load

    src = tmp_path / "bias"
    run_ranks(4, _save_with_expert_bias, str(src))
    key = "model.model.layers.0.mlp.experts.down_proj_bias"
    assert torch_load(src, [key])[key].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # stored block-transposed
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--to", "canonical", *DECL])
    assert res.exit_code == 2 and res.stdout == "", res.stdout
    assert res.stderr.startswith(f"error: [E602] {key}: a per-expert tensor [8] split over ranks"), res.stderr
    assert not (tmp_path / "o").exists()
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "same"), "--to", "legacy", *DECL])
    assert res.exit_code == 0, res.stderr
    assert "0 with a new expert order" in res.stdout
    assert torch_load(tmp_path / "same", [key])[key].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.slow  # a 4-rank gloo save
def test_export_refuses_a_one_dim_per_expert_tensor_it_would_leave_in_the_stored_order(tmp_path: Path) -> None:
    """`export --source-layout legacy` of that save wrote the expert weights in true order and the bias
    `[8]` in the stored one (0, 1, 4, 5, 2, 3, 6, 7), exit 0: the bias of expert 2 beside the weights of expert 4.
    It is E601 now, naming the tensor, nothing written; without the bias (`--filter` on the weights) the export
    runs and writes the weights in true order (torch's reader of the source, un-permuted, is the reference)."""
    from safetensors.torch import load_file

    from tests.fixtures.distributed import run_ranks
    from tests.ops.export.test_export import torch_load

    src = tmp_path / "bias"
    run_ranks(4, _save_with_expert_bias, str(src))
    key = "model.model.layers.0.mlp.experts.down_proj_bias"
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "hf"), *DECL])
    assert res.exit_code == 2 and res.stdout == "", res.stdout
    assert res.stderr.startswith(f"error: [E601] {key}: a per-expert tensor [8] split over ranks"), res.stderr
    assert not (tmp_path / "hf").exists()
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "w"), *DECL, "--filter", "*experts.*_proj"])
    assert res.exit_code == 0, res.stderr
    out = load_file(str(tmp_path / "w" / "model.safetensors"))
    assert out and not any(k.endswith("_bias") for k in out), sorted(out)
    stored = torch_load(src, ["model.model.layers.0.mlp.experts.down_proj"])[
        "model.model.layers.0.mlp.experts.down_proj"
    ]
    true = stored[[0, 1, 4, 5, 2, 3, 6, 7]]  # legacy 2 x 2: stored position of true expert j
    assert torch.equal(out["model.layers.0.mlp.experts.down_proj"], true)
