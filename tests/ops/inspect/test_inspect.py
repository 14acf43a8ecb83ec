"""`ckpttool inspect` on the real fixtures: counts, shapes, dtypes, chunks, param groups, JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import builders

runner = CliRunner()


def inspect_json(path: Path, *extra: str) -> dict:
    res = runner.invoke(app, ["inspect", "--json", str(path), *extra])
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    return json.loads(res.stdout)


def test_dense_counts_shapes_dtypes(dense_ckpt: Path) -> None:
    ov = inspect_json(dense_ckpt)
    assert ov["schema"] == "ckpttool.inspect/1"
    model = {t["key"]: t for t in ov["model"]}
    n_layer_params = 4 + 3 + 2  # q,k,v,o + gate,up,down + 2 norms
    assert (
        len(model) == 1 + builders.DENSE["layers"] * n_layer_params + 1 + 1 + 1
    )  # embed, layers, norm, lm_head, buffer
    emb = model["model.model.embed_tokens.weight"]
    assert emb["shape"] == [builders.DENSE["vocab"], builders.DENSE["hidden"]]
    assert emb["dtype"] == "bfloat16" and emb["chunks"] == 1 and emb["ranks"] == [0]
    assert model["model.lm_head.weight"]["dtype"] == "bfloat16"
    assert model["model.model.rotary_emb.inv_freq"]["dtype"] == "float32"
    assert model["model.model.layers.1.mlp.down_proj.weight"]["shape"] == [
        builders.DENSE["hidden"],
        builders.DENSE["inter"],
    ]
    opt = ov["optimizer"]
    assert opt["flavor"] == "nested"
    assert opt["params_with_state"] == opt["params_total"] == len(model) - 1
    assert opt["buffers"] == ["model.rotary_emb.inv_freq"]
    assert opt["fields"] == {
        "exp_avg": {"bfloat16": len(model) - 1},
        "exp_avg_sq": {"bfloat16": len(model) - 1},
        "step": {"float32": len(model) - 1},
    }
    assert opt["implied_type"] == "adamw"
    (group,) = opt["param_groups"]
    assert group["lr"] == pytest.approx(1e-3) and group["weight_decay"] == pytest.approx(0.05)
    assert group["betas"] == [0.9, 0.95] and group["eps"] == pytest.approx(1e-8)
    assert group["params"] == len(model) - 1 and group["missing"] == []
    s = ov["summary"]
    assert s["files"] == 1 and s["ranks"] == [0]
    assert s["bytes_by_category"]["optimizer_state"] > 0
    assert s["bytes_on_disk"] == (dense_ckpt / "__0_0.distcp").stat().st_size
    assert ov["layout"] is None and ov["layout_error"] is None


def test_multi_optim_never_stepped_leaf_keeps_moved_lr(multi_optim_ckpt: Path) -> None:
    ov = inspect_json(multi_optim_ckpt)
    opt = ov["optimizer"]
    assert opt["flavor"] == "flattened"
    experts = [g for g in opt["param_groups"] if not g["has_state"]]
    assert len(experts) == 1
    (leaf,) = experts
    assert leaf["lr"] == pytest.approx(builders.MULTI_EXPERTS_LR_MOVED)
    assert leaf["initial_lr"] == pytest.approx(builders.MULTI_EXPERTS_LR_START)
    assert leaf["params"] == 2 and all(".experts." in p for p in leaf["example_params"])
    assert sorted(opt["never_stepped_with_hyperparameters"]) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    dense = [g for g in opt["param_groups"] if g["has_state"]]
    assert len(dense) == 1 and dense[0]["lr"] == pytest.approx(builders.MULTI_DENSE_LR)
    assert opt["params_with_state"] == opt["params_total"] - 2
    assert ov["layout"]["version"] == 2 and ov["layout"]["source"] == "embedded"


def test_multi_optim_human_output_shows_never_stepped_leaf(multi_optim_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(multi_optim_ckpt)])
    assert res.exit_code == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if "never stepped" in ln)
    assert "0.0025" in line


def test_fsdp_chunks_from_several_ranks(fsdp_ckpt: Path) -> None:
    ov = inspect_json(fsdp_ckpt)
    model = {t["key"]: t for t in ov["model"]}
    world = builders.FSDP_WORLD
    assert ov["summary"]["ranks"] == list(range(world)) and ov["summary"]["files"] == world
    emb = model["model.model.embed_tokens.weight"]
    assert emb["chunks"] == world and emb["ranks"] == list(range(world)) and not emb["uneven"]
    odd = model["model.model.layers.0.odd"]
    assert odd["shape"] == [builders.FSDP_ODD_DIM0, 16]
    assert odd["uneven"] and odd["zero_size_chunks"] == 1
    assert sorted(c[0] for c in odd["chunk_sizes"]) == [0, 1, 1, 1]
    buf = model["model.model.layers.0.scale"]
    assert buf["shape"] == [] and buf["chunks"] == 1  # replicated 0-d buffer stored once
    state = ov["optimizer"]
    assert state["params_with_state"] == 6 and state["fields"]["exp_avg"] == {"float32": 6}


def test_fsdp_human_output_marks_uneven_and_zero_size(fsdp_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(fsdp_ckpt)])
    assert res.exit_code == 0
    row = next(ln for ln in res.stdout.splitlines() if "layers.0.odd" in ln)
    assert "uneven" in row and "1 zero-size" in row


def test_sample_layout_and_extra_state(sample_ckpt: Path) -> None:
    ov = inspect_json(sample_ckpt)
    assert ov["layout"]["version"] == 2
    assert ov["layout"]["extra_parallel"]["model.model.layers.0.mlp.experts.down_proj"]["num_experts"] == 8
    (extra,) = ov["extra_state"]
    assert extra["status"] == "ok" and extra["global_step"] == 3 and "torch_rng_state" in extra["keys"]
    keys = {t["key"] for t in ov["model"]}
    assert "model.model.layers.0.mlp.gate.e_score_correction_bias" in keys


def test_filter_depth_sort(dense_ckpt: Path) -> None:
    ov = inspect_json(dense_ckpt, "--filter", "model.layers.0.*")
    assert ov["model"] and all(t["key"].startswith("model.model.layers.0.") for t in ov["model"])
    ov = inspect_json(dense_ckpt, "--depth", "2")
    prefixes = {r["prefix"]: r for r in ov["tree"]}
    assert prefixes["model.model.layers"]["tensors"] == builders.DENSE["layers"] * 9
    assert sum(r["numel"] for r in ov["tree"]) == ov["summary"]["numel_model"]
    ov = inspect_json(dense_ckpt, "--sort", "size")
    sizes = [t["nbytes"] for t in ov["model"]]
    assert sizes == sorted(sizes, reverse=True)


def test_extra_state_needing_trust_pickle_is_listed(tmp_path: Path, dense_ckpt: Path) -> None:
    import fractions
    import shutil

    import torch

    ck = tmp_path / "ck"
    shutil.copytree(dense_ckpt, ck)
    (ck / "extra_state").mkdir()
    # A stdlib class instance that torch.load(weights_only=True) refuses.
    torch.save({"ratio": fractions.Fraction(1, 3)}, ck / "extra_state" / "extra_state_rank_0.pt")
    ov = inspect_json(ck)
    assert ov["extra_state"][0]["status"] == "needs --trust-pickle"


def test_inspect_reads_no_tensor_data(sample_ckpt: Path, tmp_path: Path) -> None:
    """Every tensor chunk moved to a data file of its own: inspect never opens that file (``validate --deep`` does)."""
    import copy
    import shutil

    from tests.fixtures.metadata_edit import load_md, save_md
    from tests.fixtures.opens import run_cli_recording_opens

    ck = shutil.copytree(sample_ckpt, tmp_path / "ck")
    shutil.copy(ck / "__0_0.distcp", ck / "__1_0.distcp")  # same bytes, same offsets
    md = load_md(ck)
    moved = 0
    for idx, info in list(md.storage_data.items()):
        if idx.offset is not None:  # a tensor chunk (byte items have no offsets)
            info = copy.copy(info)
            info.relative_path = "__1_0.distcp"
            md.storage_data[idx] = info
            moved += 1
    save_md(ck, md)
    assert moved and any(i.relative_path == "__0_0.distcp" for i in md.storage_data.values())

    res = run_cli_recording_opens(["inspect", str(ck)], tmp_path / "opens.log")
    assert res.returncode == 0, res.stderr
    assert "tensor" in res.stdout
    assert res.count(ck / ".metadata") >= 1 and res.count(ck / "__0_0.distcp") >= 1  # byte items are read
    assert res.count(ck / "__1_0.distcp") == 0, res.under(ck)
    # the control: a command that reads tensor data opens it
    deep = run_cli_recording_opens(["validate", str(ck), "--deep"], tmp_path / "opens-deep.log")
    assert deep.count(ck / "__1_0.distcp") >= 1, deep.under(ck)


def test_short_and_unreferenced_data_files_are_flagged(tmp_path: Path, dense_ckpt: Path) -> None:
    import shutil

    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    data = ck / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:  # cut into the last tensor record (byte items lie first)
        f.truncate(size - 100)
    (ck / "__7_0.distcp").write_bytes(b"stray")
    res = plain = runner.invoke(app, ["inspect", str(ck)])
    assert res.exit_code == 0
    assert (
        f"warning: data file __0_0.distcp is shorter than its records need ({size - 100} < {size} bytes" in res.stderr
    )
    assert "warning: data file __7_0.distcp is not referenced by .metadata" in res.stderr
    assert "ckpttool validate --strict" in res.stderr
    # --json: the status is in the data, and the warnings on stderr as without it (and as stats --json): a
    # `inspect --json | jq` of a truncated checkpoint said nothing of it where a person looks
    res = runner.invoke(app, ["inspect", "--json", str(ck)])
    assert res.exit_code == 0 and res.stderr == plain.stderr, res.stderr
    ov = json.loads(res.stdout)
    status = {f["path"]: (f["status"], f["needed"]) for f in ov["files"]}
    assert status == {"__0_0.distcp": ("short", size), "__7_0.distcp": ("unreferenced", 0)}


def test_a_data_file_outside_the_checkpoint_is_named_so_not_missing(tmp_path: Path, dense_ckpt: Path) -> None:
    """A tensor chunk's ``relative_path`` set to ``../../etc/passwd`` in torch's own ``.metadata``: inspect (which
    reads no tensor data) says the file lies outside (status ``outside``), not that it is missing."""
    import dataclasses
    import pickle
    import shutil

    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    md = pickle.loads((ck / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if "layers.1" in k.fqn)
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="../../etc/passwd")
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    res = runner.invoke(app, ["inspect", str(ck)])
    assert res.exit_code == 0 and "warning: data file ../../etc/passwd lies outside the checkpoint" in res.stderr
    assert "is missing" not in res.stderr
    js = runner.invoke(app, ["inspect", "--json", str(ck)])  # the same warning on stderr, the status in the data
    assert js.exit_code == 0 and js.stderr == res.stderr
    status = {f["path"]: f["status"] for f in json.loads(js.stdout)["files"]}
    assert status["../../etc/passwd"] == "outside"


def test_filter_matching_nothing_is_an_error(dense_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(dense_ckpt), "--filter", "nomatch*"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E100] --filter 'nomatch*' matches no key")


@pytest.mark.parametrize("command", [["inspect", "--json"], ["validate", "--strict", "--json"]])
def test_inspect_and_validate_of_the_sample_never_import_torch(sample_ckpt: Path, command: list[str]) -> None:
    """The sample's extra_state holds a torch RNG state tensor: described, not loaded."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom ckpttool.cli import main\n"
        f"sys.argv = ['ckpttool', {command[0]!r}, sys.argv[1], *{command[1:]!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(sample_ckpt)], capture_output=True, text=True, check=True)
    assert out.stderr.split()[-2:] == ["False", "False"], out.stderr
    if command[0] == "inspect":
        doc = json.loads(out.stdout)
        assert "torch_rng_state" in json.dumps(doc["extra_state"])


@pytest.mark.parametrize("fixture", ["dense_ckpt", "fsdp_ckpt", "sample_ckpt", "multi_optim_ckpt"])
def test_streamed_json_is_the_to_dict_document(fixture: str, request: pytest.FixtureRequest) -> None:
    # `inspect --json` streams its tensor rows: the text must be exactly json.dumps of to_dict()
    from ckpttool.ops.inspect import InspectOptions, inspect

    path = request.getfixturevalue(fixture)
    for opts in (InspectOptions(), InspectOptions(depth=2, sort="size")):
        res = inspect(path, opts)
        whole = json.dumps(res.to_dict(), separators=(",", ":"), default=str, allow_nan=False)
        assert "".join(res.json_chunks(rows_per_chunk=3)) == whole
        assert "".join(res.json_chunks()) == whole
