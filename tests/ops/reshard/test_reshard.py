"""`ckpttool reshard` on real 4-rank DTensor saves: conversion, loading by fresh DCP jobs, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import CheckpointReader
from ckpttool.layouts.declaration import LayoutDeclaration
from ckpttool.model.checkpoint import OpenOptions
from ckpttool.ops.diff import DiffOptions
from ckpttool.ops.replay import ReplayOptions
from ckpttool.ops.reshard import ReshardOptions
from ckpttool.ops.reshard.execute import reshard
from ckpttool.optim_state import FullFP32AdamW
from tests.fixtures.distributed import run_ranks
from tests.fixtures.moe_ep import (
    BETAS,
    EPS,
    LR,
    WD,
    _bits,
    is_ep,
    load_and_check_rank,
    param_shapes,
    true_state,
)

pytestmark = pytest.mark.slow
runner = CliRunner()
DECL = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]


def cli(*args: object):
    return runner.invoke(app, ["reshard", *map(str, args)])


@pytest.fixture(scope="module")
def outputs(ep_suite: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Reshard outputs shared by the tests of this module (read-only)."""
    root = tmp_path_factory.mktemp("reshard")
    legacy = LayoutDeclaration("legacy", 2, 2)
    canonical = LayoutDeclaration("canonical", 2, 2)
    out = {
        "a": root / "legacy_to_canonical_2x2",
        "b": root / "legacy_to_canonical_2x1",
        "c": root / "canonical_passthrough",
        "d": root / "dim1_to_canonical",
        "p": root / "p4f1_to_canonical",
    }
    reshard(
        ep_suite / "legacy",
        out["a"],
        ReshardOptions(to="canonical", with_optimizer=True),
        opening=OpenOptions(declaration=legacy),
    )
    reshard(
        ep_suite / "legacy",
        out["b"],
        ReshardOptions(to="canonical", with_optimizer=True, target_ep_size=2, target_ep_fsdp_size=1),
        opening=OpenOptions(declaration=legacy),
    )
    reshard(
        ep_suite / "canonical",
        out["c"],
        ReshardOptions(to="canonical", with_optimizer=True),
        opening=OpenOptions(declaration=canonical),
    )
    reshard(
        ep_suite / "legacy_dim1",
        out["d"],
        ReshardOptions(to="canonical", with_optimizer=True, target_ep_size=2, target_ep_fsdp_size=2),
    )
    reshard(ep_suite / "p4f1", out["p"], ReshardOptions(to="canonical"))
    return out


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as r:
        return {k: r.read_tensor(k) for k in r.metadata.entries if k.startswith(("model.", "optimizer.state."))}


def test_cli_legacy_to_canonical_is_bitwise_the_true_model(ep_suite: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = cli(ep_suite / "legacy", out, "--to", "canonical", *DECL, "--with-optimizer")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    assert "canonical (version 2), ep_size 2, ep_fsdp_size 2, 4 data files" in res.stdout
    assert "16 with a new expert order" in res.stdout  # 4 EP params + 12 state tensors
    true = true_state(8)
    got = all_tensors(out)
    assert set(got) == {k for k in true if k != "param_groups"}
    for k, v in true.items():
        if k != "param_groups":
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with CheckpointReader(out) as r:
        rec = json.loads(r.read_object("layout"))
        assert r.read_object("optimizer.param_groups.0.lr") == LR
    assert rec["version"] == 2 and rec["parallel"]["ep_size"] == 2 and rec["parallel"]["ep_fsdp_size"] == 2
    source = rec["converted_from"].pop("source")  # the source's identity (tests/ops/reshard/test_reshard_manifest.py)
    assert set(source) == {"algorithm", "metadata_digest", "metadata_size", "manifest_digest"}
    assert rec["converted_from"] == {
        "version": 1,
        "ep_size": 2,
        "ep_fsdp_size": 2,
        "layout_source": "declared",
        "world": 4,
        "origin_world": 4,
    }
    assert sorted(p.name for p in out.iterdir()) == [".ckpttool-output.json", ".metadata"] + [
        f"__{r}_0.distcp" for r in range(4)
    ]


def test_latest_step_below_an_unfinished_newer_save_is_resharded_with_a_warning(ep_suite: Path, tmp_path: Path) -> None:
    """A run root whose newest step has torch's data files but no ``.metadata`` (a save cut short): ``--step
    latest`` reshards the newest complete step, and the output says which and that the newer save did not finish
    (validate's R001), as inspect, stats and replay-step do; it said nothing and looked like the run's latest."""
    run = tmp_path / "run"
    shutil.copytree(ep_suite / "legacy", run / "step-4")
    shutil.copytree(ep_suite / "legacy", run / "step-6")
    (run / "step-6" / ".metadata").unlink()
    out = tmp_path / "out"
    res = cli(run, out, "--step", "latest", "--to", "canonical", *DECL, "--with-optimizer")
    assert res.exit_code == 0, res.stderr
    assert f"source  {run / 'step-4'}:" in res.stdout
    want = (
        f"a newer step's save did not finish: step 6 ({run / 'step-6'}: 4 data file(s), no .metadata) is newer "
        "than the resharded step 4; `ckpttool validate` reports it (R001)"
    )
    assert want in " ".join(res.stderr.split())
    doc = json.loads(
        cli(run, tmp_path / "o2", "--step", "latest", "--to", "canonical", *DECL, "--with-optimizer", "--json").stdout
    )
    assert doc["source"] == str(run / "step-4") and doc["warnings"] == [want]


def test_output_chunks_and_files_match_a_real_canonical_save(ep_suite: Path, outputs: dict[str, Path]) -> None:
    # Each rank of the resumed job reads only its own file: the output lays chunks out exactly
    # as torch lays out a canonical (EP, EP-FSDP) save of the same mesh.
    def layout_of(path: Path) -> dict:
        with CheckpointReader(path) as r:
            md = r.metadata
            return {
                k: sorted((c.offsets, c.sizes, md.storage_for(k, c).relative_path) for c in m.chunks)
                for k, m in md.entries.items()
                if is_ep(k) and hasattr(m, "chunks") and m.size
            }

    want, got = layout_of(ep_suite / "canonical"), layout_of(outputs["a"])
    assert want == got and len(got) == 16


def test_canonical_fixture_passes_through_bitwise(ep_suite: Path, outputs: dict[str, Path]) -> None:
    with CheckpointReader(ep_suite / "canonical") as src, CheckpointReader(outputs["c"]) as out:
        for key, meta in src.metadata.entries.items():
            if key == "layout":
                continue
            if hasattr(meta, "chunks"):
                for c in meta.chunks:
                    assert out.raw_bytes(key, c) == src.raw_bytes(key, c), key  # the very same archives
            else:
                assert out.raw_bytes(key) == src.raw_bytes(key), key


@pytest.mark.heavy  # CI time: every job's output loaded by dcp.load; the bytes of each are compared in CI
def test_fresh_canonical_jobs_load_with_plain_dcp_load(outputs: dict[str, Path], tmp_path: Path) -> None:
    four = [
        (str(outputs["a"]), 2, 2, 0, 8, True),
        (str(outputs["c"]), 2, 2, 0, 8, True),
        (str(outputs["d"]), 2, 2, 1, 8, True),
        (str(outputs["p"]), 4, 1, 0, 8, False),
    ]
    run_ranks(4, load_and_check_rank, four, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ok_{r}" for r in range(4)]
    two = [
        (str(outputs["b"]), 2, 1, 0, 8, True),  # laid out for 2 ranks
        (str(outputs["a"]), 1, 2, 0, 8, True),  # laid out for 4 ranks, loaded by 2 (DCP reshards)
    ]
    done = tmp_path / "two"
    done.mkdir()
    run_ranks(2, load_and_check_rank, two, str(done))
    assert sorted(p.name for p in done.iterdir()) == ["ok_0", "ok_1"]


def _step(tensors: dict[str, torch.Tensor], fqns: list[str]) -> dict[str, torch.Tensor]:
    """One FullFP32AdamW step from a checkpoint's (true-order) state; returns params and state after it."""
    params = {f: torch.nn.Parameter(tensors[f"model.{f}"].clone()) for f in fqns}
    opt = FullFP32AdamW(list(params.items()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    state = {
        i: {
            fld: tensors[f"optimizer.state.{f}.{fld}"].clone()
            for fld in ("step", "master_weight", "exp_avg", "exp_avg_sq")
        }
        for i, f in enumerate(fqns)
    }
    opt.load_state_dict(
        {
            "state": state,
            "param_groups": [
                {"params": list(range(len(fqns))), "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
            ],
        }
    )
    gen = torch.Generator().manual_seed(99)
    for p in params.values():
        p.grad = (torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype)
    opt.step()
    out = {f"model.{f}": p.detach() for f, p in params.items()}
    for f, p in params.items():
        for fld, v in opt.state[p].items():
            out[f"optimizer.state.{f}.{fld}"] = v
    return out


def _unpermute_legacy(t: torch.Tensor, p: int, f: int) -> torch.Tensor:
    """Independent of ckpttool: stored slab f*P+e -> true slab e*F+f (docs/design.md §4)."""
    slabs = t.chunk(p * f)
    true = [None] * (p * f)
    for e in range(p):
        for ff in range(f):
            true[e * f + ff] = slabs[ff * p + e]
    return torch.cat(true)


def test_with_optimizer_one_step_matches_the_unpermuted_original(ep_suite: Path, outputs: dict[str, Path]) -> None:
    fqns = [f for f in param_shapes(8) if is_ep(f)]
    resharded = all_tensors(outputs["a"])
    original = {
        k: (_unpermute_legacy(v, 2, 2) if is_ep(k) and v.dim() else v)
        for k, v in all_tensors(ep_suite / "legacy").items()
    }
    after_resharded = _step(resharded, fqns)
    after_original = _step(original, fqns)
    assert set(after_resharded) == set(after_original) and len(after_resharded) == 5 * len(fqns)
    for k, v in after_original.items():
        assert torch.equal(_bits(after_resharded[k]), _bits(v)), k
    # The step really moved the experts (a test that cannot pass by doing nothing).
    assert not torch.equal(after_original[f"model.{fqns[0]}"], original[f"model.{fqns[0]}"])


def test_legacy_round_trip_restores_the_legacy_save(ep_suite: Path, outputs: dict[str, Path], tmp_path: Path) -> None:
    back = tmp_path / "back"
    res = cli(
        outputs["b"],
        back,
        "--to",
        "legacy",
        "--target-ep-size",
        2,
        "--target-ep-fsdp-size",
        2,
        "--with-optimizer",
        "--json",
    )
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "ckpttool.reshard/1" and doc["from_version"] == 2 and doc["from_source"] == "embedded"
    assert doc["to_layout"] == "legacy" and (doc["from_ep_size"], doc["from_ep_fsdp_size"]) == (2, 1)
    orig, got = all_tensors(ep_suite / "legacy"), all_tensors(back)
    assert set(orig) == set(got)
    for k in orig:
        assert torch.equal(orig[k], got[k]), k
    with CheckpointReader(back) as r:
        assert json.loads(r.read_object("layout"))["version"] == 1


def test_p4f1_identity_with_zero_size_chunks(ep_suite: Path, outputs: dict[str, Path]) -> None:
    orig, got = all_tensors(ep_suite / "p4f1"), all_tensors(outputs["p"])
    assert set(orig) == set(got) and all(torch.equal(orig[k], got[k]) for k in orig)
    with CheckpointReader(outputs["p"]) as r:
        odd = r.metadata.entries["model.model.odd"]
        assert sorted(c.sizes[0] for c in odd.chunks) == [0, 1, 1, 1]


def test_refuses_ambiguous_input_without_declaration(ep_suite: Path, tmp_path: Path) -> None:
    res = cli(ep_suite / "legacy", tmp_path / "o", "--to", "canonical", "--with-optimizer")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E405] model.model.layers.0.mlp.experts.gate_up_proj (and 3 more)")
    assert "hint: declare it with --source-layout" in res.stderr
    assert not (tmp_path / "o").exists()


def test_refuses_declaration_contradicting_geometry(ep_suite: Path, tmp_path: Path) -> None:
    res = cli(
        ep_suite / "legacy",
        tmp_path / "o",
        "--to",
        "canonical",
        "--with-optimizer",
        "--source-layout",
        "legacy",
        "--ep-size",
        "2",
        "--ep-fsdp-size",
        "4",
    )
    assert res.exit_code == 2 and "error: [E404]" in res.stderr and "contradicts the chunk geometry" in res.stderr
    assert not (tmp_path / "o").exists()


def test_refuses_optimizer_state_without_flag(ep_suite: Path, tmp_path: Path) -> None:
    res = cli(ep_suite / "legacy", tmp_path / "o", "--to", "canonical", *DECL)
    assert res.exit_code == 2 and res.stdout == ""
    assert "error: [E602]" in res.stderr and "optimizer state for 4 expert-parallel parameter(s)" in res.stderr
    assert "hint: pass --with-optimizer" in res.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "p2,f2,needle",
    [("3", "1", "do not divide over target ep_size 3"), ("2", "8", "split into ep_size*ep_fsdp_size = 16 equal slabs")],
)
def test_refuses_target_sizes_not_dividing_experts(
    ep_suite: Path, tmp_path: Path, p2: str, f2: str, needle: str
) -> None:
    to = "canonical" if p2 == "3" else "legacy"
    res = cli(
        ep_suite / "legacy",
        tmp_path / "o",
        "--to",
        to,
        *DECL,
        "--with-optimizer",
        "--target-ep-size",
        p2,
        "--target-ep-fsdp-size",
        f2,
    )
    assert res.exit_code == 2 and "error: [E406]" in res.stderr and needle in res.stderr
    assert not (tmp_path / "o").exists()


def test_unversioned_unambiguous_source_needs_target_sizes(ep_suite: Path, tmp_path: Path) -> None:
    res = cli(ep_suite / "legacy_dim1", tmp_path / "o", "--to", "canonical", "--with-optimizer")
    assert res.exit_code == 2 and "error: [E100]" in res.stderr and "--target-ep-size" in res.stderr
    res = cli(
        ep_suite / "legacy_dim1", tmp_path / "o", "--to", "canonical", "--with-optimizer", "--target-ep-size", "2"
    )
    assert res.exit_code == 2 and "give both --target-ep-size and --target-ep-fsdp-size" in res.stderr
    # the hint names the missing option (it said only "run the command with --help")
    assert (
        res.stderr.splitlines()[1] == "hint: add --target-ep-fsdp-size, the size of the job that will load the output"
    )


def test_one_target_size_alone_is_refused_with_the_source_size_to_keep(sample_ckpt: Path, tmp_path: Path) -> None:
    res = cli(sample_ckpt, tmp_path / "o", "--to", "legacy", "--with-optimizer", "--target-ep-size", "2")
    assert res.exit_code == 2 and res.stdout == "" and not (tmp_path / "o").exists()
    assert res.stderr.splitlines() == [
        "error: [E100] give both --target-ep-size and --target-ep-fsdp-size, or neither (keep the source sizes): "
        "--target-ep-size alone does not say the other size of the target mesh",
        "hint: add --target-ep-fsdp-size 1 to keep the source's",
    ]


def test_existing_output_needs_overwrite_and_source_is_untouched(ep_suite: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    before = {p.name: p.stat().st_mtime_ns for p in (ep_suite / "p4f1").iterdir()}
    res = cli(ep_suite / "p4f1", out, "--to", "canonical")
    assert res.exit_code == 2 and "error: [E600]" in res.stderr and (out / "keep.txt").exists()
    # --overwrite replaces only a previous output of ckpttool, never an unrelated directory
    res = cli(ep_suite / "p4f1", out, "--to", "canonical", "--overwrite")
    assert res.exit_code == 2 and "error: [E606]" in res.stderr and "not an output of ckpttool" in res.stderr
    assert (out / "keep.txt").exists()
    assert cli(ep_suite / "p4f1", out, "--to", "canonical", "--overwrite").exit_code == 2
    (out / "keep.txt").unlink()
    assert cli(ep_suite / "p4f1", out, "--to", "canonical").exit_code == 0  # empty: no --overwrite needed
    res = cli(ep_suite / "p4f1", out, "--to", "canonical", "--overwrite")  # a previous reshard output
    assert res.exit_code == 0, res.stderr
    (out / "keep.txt").write_text("x")  # now with a file ckpttool did not write: refused
    res = cli(ep_suite / "p4f1", out, "--to", "canonical", "--overwrite")
    assert res.exit_code == 2 and "error: [E606]" in res.stderr and "keep.txt" in res.stderr
    assert (out / "keep.txt").exists() and (out / ".metadata").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in (ep_suite / "p4f1").iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]


def test_damaged_chunk_archive_is_refused_without_output(ep_suite: Path, tmp_path: Path) -> None:
    from tests.fixtures.cache import copy_checkpoint

    ck = copy_checkpoint(ep_suite / "p4f1", tmp_path / "c")
    with CheckpointReader(ck) as r:
        meta = r.metadata.entries["model.model.layers.0.mlp.experts.down_proj"]
        info = r.storage_info("model.model.layers.0.mlp.experts.down_proj", meta.chunks[0])
    data = bytearray((ck / info.relative_path).read_bytes())
    data[info.offset : info.offset + 4] = b"JUNK"  # break the zip local header
    (ck / info.relative_path).write_bytes(bytes(data))
    res = cli(ck, tmp_path / "o", "--to", "canonical")
    assert res.exit_code == 2 and "error: [E301]" in res.stderr and "down_proj" in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_damaged_byte_item_is_refused_without_output(ep_suite: Path, tmp_path: Path, dry_run: bool) -> None:
    """A byte item is copied verbatim, but first checked as the torch.save archive torch's reader opens: a window
    cut short (a .metadata that lies about its length) is E301 naming the item, nothing written (before, reshard
    copied it and reported success: an output that looked complete and that dcp.load cannot read)."""
    import io

    from tests.fixtures.cache import copy_checkpoint
    from tests.fixtures.damage import edit_storage

    key = "optimizer.param_groups.0.lr"
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "c")
    with CheckpointReader(ck) as r:
        info = r.storage_info(key)
    edit_storage(ck, key, length=info.length - 10)
    window = (ck / info.relative_path).read_bytes()[info.offset : info.offset + info.length - 10]
    with pytest.raises(RuntimeError, match="central directory"):  # what torch's reader does with it (load_bytes)
        torch.load(io.BytesIO(window), weights_only=False)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    res = cli(ck, tmp_path / "o", "--to", "canonical", "--with-optimizer", *DECL, *(["--dry-run"] if dry_run else []))
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(
        f"error: [E301] {ck / info.relative_path}: byte item {key!r} is not a torch.save archive"
    )
    assert "Traceback" not in res.output
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if "ckpttool-tmp" in p.name]
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
def test_byte_item_crc_mismatch_is_e308_unless_no_verify_crc(ep_suite: Path, tmp_path: Path) -> None:
    """A byte item whose data.pkl no longer matches its CRC-32 (one bit of the saved lr flipped; torch's reader never
    checks it): E308 naming the item by default, nothing written; with --no-verify-crc it is copied as stored."""
    import struct

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from tests.fixtures.cache import copy_checkpoint

    key = "optimizer.param_groups.0.lr"
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "c")
    with CheckpointReader(ck) as r:
        info = r.storage_info(key)
    path = ck / info.relative_path
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack(">d", LR), info.offset, info.offset + info.length) + 7  # the pickled float's last byte
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    flipped = struct.unpack(">d", bytes(data[at - 7 : at + 1]))[0]
    args = ["--to", "canonical", "--with-optimizer", *DECL]
    res = cli(ck, tmp_path / "o", *args)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: [E308] {path}: byte item {key!r}: member data.pkl does not match its CRC-32")
    assert not (tmp_path / "o").exists()
    res = cli(ck, tmp_path / "o", *args, "--no-verify-crc")
    assert res.exit_code == 0, res.output
    got = _load_state_dict_from_keys(keys={key}, checkpoint_id=str(tmp_path / "o"))
    assert got["optimizer"]["param_groups"][0]["lr"] == flipped != LR


# ------------------------------------------------------------------ extra_state/ and a mesh of another size
EXTRA_WARNING = (
    "warning: extra_state/ copied unchanged from the source mesh of 1 rank(s) (files for rank(s) [0]); the target "
    "mesh has 2 rank(s): target rank(s) [1] have no extra_state file and resume with fresh scheduler/step/RNG "
    "state. Per-rank extra state cannot be converted; restore scheduler/step/RNG state for the new mesh yourself\n"
)


def validate_json(path: Path) -> tuple[int, dict, str]:
    res = runner.invoke(app, ["validate", "--strict", "--json", str(path)])
    return res.exit_code, json.loads(res.stdout), res.stderr


def test_reshard_to_another_ep_size_warns_about_extra_state_and_passes_validate_strict(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    assert sorted(p.name for p in (sample_ckpt / "extra_state").iterdir()) == ["extra_state_rank_0.pt"]
    out = tmp_path / "o"
    res = cli(
        sample_ckpt, out, "--to", "legacy", "--target-ep-size", "2", "--target-ep-fsdp-size", "1", "--with-optimizer"
    )
    assert res.exit_code == 0, res.stderr
    assert res.stderr == EXTRA_WARNING
    assert "also copied extra_state, model_assets" in res.stdout and "warning" not in res.stdout
    assert sorted(p.name for p in (out / "extra_state").iterdir()) == ["extra_state_rank_0.pt"]  # unchanged
    with CheckpointReader(out) as r:
        cf = json.loads(r.read_object("layout"))["converted_from"]
    assert cf["world"] == 1 and cf["origin_world"] == 1
    # the output passes the CI setting: S007 is info, saying why
    rc, doc, err = validate_json(out)
    assert rc == 0 and doc["ok"] and err == "", doc["findings"]
    (s007,) = [f for f in doc["findings"] if f["code"] == "S007"]
    assert s007["severity"] == "info" and not s007["fails"]
    assert "converted by `ckpttool reshard` from a mesh of 1 rank(s) to one of 2 rank(s)" in s007["message"]
    assert "copied unchanged from the source" in s007["message"]
    human = runner.invoke(app, ["validate", "--strict", str(out)])
    assert human.exit_code == 0 and human.stderr == ""
    assert human.stdout.splitlines()[-1].startswith("OK: 0 errors, 0 warnings")


def test_reshard_json_lists_the_warning_and_keeps_stdout_pure(sample_ckpt: Path, tmp_path: Path) -> None:
    res = cli(
        sample_ckpt,
        tmp_path / "o",
        "--to",
        "canonical",
        "--target-ep-size",
        "2",
        "--target-ep-fsdp-size",
        "1",
        "--with-optimizer",
        "--json",
    )
    assert res.exit_code == 0 and res.stderr == EXTRA_WARNING
    doc = json.loads(res.stdout)
    assert doc["warnings"] == [EXTRA_WARNING[len("warning: ") : -1]]


def test_same_mesh_reshard_has_no_warning_and_chains_keep_the_origin(sample_ckpt: Path, tmp_path: Path) -> None:
    same = cli(sample_ckpt, tmp_path / "same", "--to", "legacy", "--with-optimizer")
    assert same.exit_code == 0 and same.stderr == ""
    assert validate_json(tmp_path / "same")[0] == 0
    # 1 -> 2 -> 2 ranks: the second output still carries the 1-rank extra_state/ and still passes --strict
    assert (
        cli(
            sample_ckpt,
            tmp_path / "a",
            "--to",
            "canonical",
            "--target-ep-size",
            "2",
            "--target-ep-fsdp-size",
            "1",
            "--with-optimizer",
        ).exit_code
        == 0
    )
    b = cli(tmp_path / "a", tmp_path / "b", "--to", "legacy", "--with-optimizer")
    assert b.exit_code == 0 and b.stderr == EXTRA_WARNING
    with CheckpointReader(tmp_path / "b") as r:
        cf = json.loads(r.read_object("layout"))["converted_from"]
    assert cf["world"] == 2 and cf["origin_world"] == 1
    rc, doc, _ = validate_json(tmp_path / "b")
    assert rc == 0 and [f["severity"] for f in doc["findings"] if f["code"] == "S007"] == ["info"]


def test_S007_still_warns_when_a_same_mesh_output_lost_a_file(sample_ckpt: Path, tmp_path: Path) -> None:
    assert (
        cli(
            sample_ckpt,
            tmp_path / "a",
            "--to",
            "canonical",
            "--target-ep-size",
            "2",
            "--target-ep-fsdp-size",
            "1",
            "--with-optimizer",
        ).exit_code
        == 0
    )
    b = tmp_path / "b"
    assert (
        cli(
            tmp_path / "a",
            b,
            "--to",
            "canonical",
            "--target-ep-size",
            "1",
            "--target-ep-fsdp-size",
            "1",
            "--with-optimizer",
        ).exit_code
        == 0
    )
    # back on the 1-rank mesh that wrote extra_state/: a missing file is a damaged copy again
    (b / "extra_state" / "extra_state_rank_0.pt").rename(b / "extra_state" / "extra_state_rank_3.pt")
    rc, doc, _ = validate_json(b)
    assert rc == 1
    (s007,) = [f for f in doc["findings"] if f["code"] == "S007"]
    assert s007["severity"] == "warning" and s007["fails"] and "reshard" not in s007["message"]


def test_ctrl_c_stops_the_copy_within_a_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT while the workers copy: they stop at the next chunk instead of finishing the whole checkpoint
    (a scheduler's SIGTERM grace period is short), and nothing is left behind."""
    import os
    import signal
    import sys

    import torch.distributed.checkpoint as dcp

    from ckpttool.format import writer as writer_mod

    src = tmp_path / "ck"
    dcp.save(
        {"model": {f"model.layers.{i}.mlp.experts.down_proj": torch.full((64, 64), float(i)) for i in range(64)}},
        checkpoint_id=str(src),
        no_dist=True,
    )
    calls: list[int] = []
    real = writer_mod.DCPWriter.copy_archive

    def copy_then_interrupt(self: writer_mod.DCPWriter, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            stop = sys._getframe(1).f_locals["stop"]  # the copy loop's own stop event (execute._run_jobs)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first chunk
            # the main thread handles it meanwhile and sets the workers' stop event (tiny chunks: the rest would
            # take < 1 ms): wait for that, not for a fixed delay a busy machine may outlast (a hang guard)
            assert stop.wait(60)

    monkeypatch.setattr(writer_mod.DCPWriter, "copy_archive", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        reshard(
            src,
            tmp_path / "out",
            ReshardOptions(to="canonical", fsync=False),
            opening=OpenOptions(declaration=LayoutDeclaration.from_options("canonical", 1, 1)),
        )
    assert len(calls) == 1, f"{len(calls)} of 64 chunks copied after Ctrl-C"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_out_of_space_while_copying_model_assets_is_e600(sample_ckpt: Path, tmp_path: Path) -> None:
    """copytree reports a failed file as shutil.Error (no errno): still E600 with the cause, not E999."""
    import shutil

    from tests.fixtures.file_size_limit import run_capped

    src = tmp_path / "ck"
    shutil.copytree(sample_ckpt, src)
    (src / "model_assets" / "tokenizer.json").write_bytes(b"t" * (3 << 20))
    limit = 2 << 20  # the data files (< 1 MiB) fit, the asset does not
    res = run_capped(["reshard", str(src), str(tmp_path / "out"), "--to", "legacy", "--with-optimizer"], limit)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: [E600]") and "File too large" in res.stderr, res.stderr
    assert ".ckpttool-tmp-" not in res.stderr and str(tmp_path / "out") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_out_of_space_while_copying_chunks_names_the_data_file_and_key(ep_suite: Path, tmp_path: Path) -> None:
    """Chunks copied verbatim into a data file over the file-size limit (as on a full disk): the error named
    only OUT ("write failed (File too large)"), not the data file and key as a re-encoded chunk's does."""
    import re

    from tests.fixtures.file_size_limit import run_capped

    out = tmp_path / "out"
    declared = ["--source-layout", "canonical", "--ep-size", "2", "--ep-fsdp-size", "2"]
    res = run_capped(
        ["reshard", str(ep_suite / "canonical"), str(out), "--to", "legacy", "--with-optimizer", *declared], 3000
    )
    assert res.returncode == 2, res.stderr
    first, hint = res.stderr.splitlines()
    with CheckpointReader(ep_suite / "canonical") as r:
        keys = set(r.metadata.entries)
    m = re.fullmatch(
        rf"error: \[E600\] {re.escape(str(out))}/__[0-3]_0\.distcp: cannot write '(.+)' \(File too large\)", first
    )
    assert m is not None and m.group(1) in keys, first
    assert hint.startswith("hint: free space on the output's filesystem"), hint
    assert not out.exists() and not any(".ckpttool-tmp-" in p.name for p in tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ proofs: diff and replay
def _diff_all(src: Path, out: Path, *extra: str) -> dict:
    res = runner.invoke(app, ["diff", str(src), str(out), "--what", "all", "--json", *extra])
    assert res.exit_code == 0, res.stderr + res.stdout
    return json.loads(res.stdout)


def test_reshard_chain_is_proven_equal_by_diff_and_replay_step(
    ep_suite: Path, outputs: dict[str, Path], tmp_path: Path
) -> None:
    from ckpttool.ops.diff import diff_checkpoints
    from ckpttool.ops.replay import replay_step

    legacy = LayoutDeclaration("legacy", 2, 2)
    p4 = tmp_path / "p4f1"
    one = tmp_path / "p1f1"
    back = tmp_path / "back_legacy"
    reshard(ep_suite / "legacy", p4, ReshardOptions(to="canonical", with_optimizer=True, target_ep_size=4, target_ep_fsdp_size=1), opening=OpenOptions(declaration=legacy))  # fmt: skip
    reshard(p4, one, ReshardOptions(to="canonical", with_optimizer=True, target_ep_size=1, target_ep_fsdp_size=1))
    reshard(one, back, ReshardOptions(to="legacy", with_optimizer=True, target_ep_size=2, target_ep_fsdp_size=2))
    decl = DECL  # the source is unversioned legacy 2x2
    for out in (outputs["a"], outputs["b"], p4, one, back):
        doc = _diff_all(ep_suite / "legacy", out, *decl)
        assert doc["equal"] and doc["counts"]["different"] == 0
        # model, 3 state fields + step per parameter, hyperparameters: everything was compared
        assert doc["counts"]["compared"] > len(param_shapes(8)) * 5
        assert {(e["side"], e["key"]) for e in doc["excluded"]} == {("B", "layout")}  # the record, not values
    # the legacy round trip holds the very same bytes: compared as raw records, no decoding
    res = diff_checkpoints(
        ep_suite / "legacy", back, DiffOptions(what="all"), opening_a=OpenOptions(declaration=legacy)
    )
    assert res.equal and res.raw_compared > len(param_shapes(8))
    # canonical <-> legacy: a canonical output against the legacy original with the wrong declaration differs
    wrong = runner.invoke(
        app, ["diff", str(ep_suite / "legacy"), str(one), "--what", "model", "--source-layout", "canonical",
              "--ep-size", "2", "--ep-fsdp-size", "2"],
    )  # fmt: skip
    assert wrong.exit_code == 1 and ".experts." in wrong.stdout

    # replay-step on both: identical next steps (parameters, masters, moments, step) in true expert order
    def stepped(path: Path, declaration: LayoutDeclaration | None) -> dict[str, dict[str, torch.Tensor]]:
        got: dict[str, dict[str, torch.Tensor]] = {}
        res = replay_step(
            path,
            ReplayOptions(device="cpu"),
            on_param=lambda fqn, t: got.__setitem__(fqn, t),
            opening=OpenOptions(declaration=declaration),
        )
        assert res.ok
        return got

    before, after = stepped(ep_suite / "legacy", legacy), stepped(one, None)
    assert set(before) == set(after) and len(before) == len(param_shapes(8))
    for fqn, fields in before.items():
        assert set(fields) == set(after[fqn]), fqn
        for f, v in fields.items():
            assert torch.equal(_bits(v), _bits(after[fqn][f])), (fqn, f)


def test_a_source_moved_away_mid_run_is_named_not_an_internal_error(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source directory moved (or deleted) after the data files were read, before the files beside
    them were listed: E999 FileNotFoundError. Now E300 naming the directory, and no output."""
    import shutil

    from ckpttool.ops.reshard import execute

    src = tmp_path / "src"
    shutil.copytree(sample_ckpt, src)
    real = execute._root_files

    def moved_first(src_p: Path, *args: object, **kwargs: object) -> object:
        src.rename(tmp_path / "moved")  # another process renames the checkpoint as the run reaches its extra files
        return real(src_p, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(execute, "_root_files", moved_first)
    out = tmp_path / "out"
    res = cli(src, out, "--to", "legacy", "--with-optimizer")
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: [E300] {src}: cannot list the checkpoint's files"), res.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), res.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["moved"]


def test_target_sizes_with_empty_pieces_write_one_storage_record_per_key(ep_suite: Path, tmp_path: Path) -> None:
    """--target-ep-size 2 --target-ep-fsdp-size 3 over 8 experts: each EP group's 4 experts chunk as [2, 2, 0], so two
    empty pieces lie at one offset. Both were written as storage records of one key; every ckpttool command then
    failed on the output with E999 (DuplicateKeys). One record per key now, as torch's storage dict holds; the output
    reads through the column reader, validates strictly and holds the true experts."""
    from ckpttool.format.mdscan import scan_metadata

    out = tmp_path / "out"
    res = cli(ep_suite / "legacy", out, "--to", "canonical", "--with-optimizer", *DECL)
    res = cli(
        ep_suite / "legacy", out, "--to", "canonical", "--with-optimizer", *DECL,
        "--target-ep-size", "2", "--target-ep-fsdp-size", "3", "--overwrite",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert scan_metadata((out / ".metadata").read_bytes(), ".metadata") is not None
    for cmd in (["inspect", str(out)], ["validate", "--strict", str(out)]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    truth = true_state(8)
    with CheckpointReader(out) as r:
        for key, t in truth.items():
            if key.startswith("model.") and is_ep(key):
                assert torch.equal(_bits(r.read_tensor(key)), _bits(t)), key


@pytest.mark.parametrize("kind", ["fifo", "dangling", "device"])
def test_a_layout_json_that_is_not_a_regular_file_is_refused_not_ignored(
    ep_suite: Path, tmp_path: Path, kind: str
) -> None:
    """A layout.json that is a FIFO, a dangling symlink or a link to a device was taken for no record at all
    (the listing asked is_file()): the checkpoint read as unversioned and was resharded (exit 0) as if it had
    none. Something of that name that cannot be read is now refused, as a symlink leaving the checkpoint was."""
    import os

    from tests.fixtures.cache import copy_checkpoint

    ck = copy_checkpoint(ep_suite / "legacy_dim1", tmp_path / "ck")
    sidecar = ck / "layout.json"
    if kind == "fifo":
        os.mkfifo(sidecar)
    elif kind == "dangling":
        sidecar.symlink_to("layout-of-step-100.json")
    else:
        sidecar.symlink_to("/dev/zero")
    out = tmp_path / "out"
    res = cli(ck, out, "--to", "canonical", "--target-ep-size", 2, "--target-ep-fsdp-size", 1, "--with-optimizer")
    code = {"fifo": "E102", "dangling": "E400", "device": "E101"}[kind]
    assert res.exit_code == 2 and res.stdout == "", res.stdout
    assert res.stderr.startswith(f"error: [{code}] ") and "layout.json" in res.stderr.splitlines()[0], res.stderr
    assert not out.exists() and os.path.lexists(sidecar)
    res = runner.invoke(app, ["inspect", str(ck)])  # a malformed record is the layout's error there (E400)
    assert f"[{code}]" in (res.stdout if code == "E400" else res.stderr), res.stdout


def test_a_target_mesh_of_millions_of_ranks_is_refused_before_planning(ep_suite: Path, tmp_path: Path) -> None:
    """``--target-ep-fsdp-size 100000000`` (a mistyped size): the plan of 800M target rank files ran until the
    process ran out of memory (E999 MemoryError, or the OOM killer); it is E100 naming the flag, before planning.
    Run with a 3 GiB address-space cap, so that the unfixed plan ends in MemoryError instead of exhausting the host."""
    import resource
    import subprocess
    import sys

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    out = tmp_path / "o"
    args = ["reshard", str(ep_suite / "legacy"), str(out), "--to", "canonical", "--with-optimizer", *DECL,
            "--target-ep-size", "8", "--target-ep-fsdp-size", "100000000"]  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", *args], capture_output=True, text=True, timeout=300, preexec_fn=cap
    )
    err = res.stderr.splitlines()
    assert res.returncode == 2 and len(err) == 2, res.stderr
    assert err[0].startswith("error: [E100] --target-ep-size 8 x --target-ep-fsdp-size 100000000 is 800,000,000 ")
    assert "131,072" in err[0] and not out.exists()


def test_byte_items_copied_unchanged_counts_the_source_items_not_the_new_record(ep_suite: Path, tmp_path: Path) -> None:
    """`reshard` said "6 byte items copied unchanged" of the canonical save's 5 (its param groups): the layout record
    it writes was counted as a copy. Twice over: a source with an embedded record has it replaced, not copied. The
    count is the source's byte items torch's own reader lists that the output holds with the same bytes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def byte_items(path: Path) -> set[str]:
        md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k for k, v in md.items() if isinstance(v, BytesStorageMetadata)}

    src = ep_suite / "canonical"
    decl = ["--source-layout", "canonical", "--ep-size", "2", "--ep-fsdp-size", "2"]
    first, second = tmp_path / "a", tmp_path / "b"
    res = cli(
        src,
        first,
        "--to",
        "canonical",
        "--with-optimizer",
        "--target-ep-size",
        "1",
        "--target-ep-fsdp-size",
        "1",
        *decl,
    )
    assert res.exit_code == 0, res.stderr
    assert "and 5 byte items copied unchanged" in res.stdout and len(byte_items(src)) == 5, res.stdout
    assert byte_items(first) == byte_items(src) | {"layout"}
    res = cli(first, second, "--to", "legacy", "--with-optimizer", "--json")  # the embedded record is replaced
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["byte_items"] == 5 and byte_items(second) == byte_items(first)
