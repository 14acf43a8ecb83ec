"""`ckpttool stamp`: sidecar layout.json after checking the declaration against the chunk geometry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import CheckpointReader
from ckpttool.layouts.record import parse_layout_record
from tests.fixtures.cache import copy_checkpoint
from tests.fixtures.moe_ep import true_state

pytestmark = pytest.mark.slow
runner = CliRunner()
LEGACY = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file() and p.name != "layout.json"}


@pytest.fixture
def legacy_copy(ep_suite: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(ep_suite / "legacy", tmp_path / "legacy")


def test_stamp_writes_a_valid_sidecar_and_nothing_else(legacy_copy: Path) -> None:
    before = snapshot(legacy_copy)
    res = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY])
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    assert res.stdout.startswith(f"wrote {legacy_copy / 'layout.json'}: layout version 1 (legacy), ep_size 2")
    assert "4 EP tensors (4 with EP and FSDP on the expert dim)" in res.stdout
    rec = parse_layout_record((legacy_copy / "layout.json").read_text())
    assert (rec.version, rec.ep_size, rec.ep_fsdp_size) == (1, 2, 2)
    assert set(rec.extra_parallel) == {
        f"model.model.layers.{n}.mlp.experts.{w}" for n in range(2) for w in ("gate_up_proj", "down_proj")
    }
    assert all((s.ep_dim, s.fsdp_dim, s.num_experts) == (0, 0, 8) for s in rec.extra_parallel.values())
    assert rec.optimizer == {"type": "full_fp32_adamw"} and rec.raw["stamped"] is True
    assert snapshot(legacy_copy) == before  # the checkpoint itself is untouched
    assert sorted(p.name for p in legacy_copy.iterdir() if p.name.startswith(".")) == [".metadata"]  # no temp files


def test_stamp_without_ep_fsdp_names_no_fsdp_split(legacy_copy: Path) -> None:
    """`--ep-fsdp-size 1` printed "4 EP tensors (4 with EP and FSDP on the expert dim)": no FSDP split is declared,
    so the count of tensors split by EP and FSDP on one dim says nothing; the line now ends at the tensor count."""
    res = runner.invoke(
        app, ["stamp", str(legacy_copy), "--source-layout", "canonical", "--ep-size", "4", "--ep-fsdp-size", "1"]
    )
    assert res.exit_code == 0, res.stderr
    assert res.stdout.rstrip().endswith("ep_size 4, ep_fsdp_size 1, 4 EP tensors"), res.stdout


def test_stamped_checkpoint_is_resolved_and_reshards_without_declaration(legacy_copy: Path, tmp_path: Path) -> None:
    assert runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY]).exit_code == 0
    ov = json.loads(runner.invoke(app, ["inspect", "--json", str(legacy_copy)]).stdout)
    assert ov["layout"]["version"] == 1 and ov["layout"]["source"] == "sidecar" and ov["layout"]["ambiguous"] == []
    assert all(g["problems"] == [] for g in ov["layout"]["geometry"])
    res = runner.invoke(
        app, ["reshard", str(legacy_copy), str(tmp_path / "out"), "--to", "canonical", "--with-optimizer"]
    )
    assert res.exit_code == 0, res.stderr
    key = "model.model.layers.1.mlp.experts.gate_up_proj"
    with CheckpointReader(tmp_path / "out") as r:
        assert torch.equal(r.read_tensor(key), true_state(8)[key])
    assert not (tmp_path / "out" / "layout.json").exists()  # the record is embedded in the output


def test_stamp_twice_is_a_no_op_and_cannot_contradict_itself(legacy_copy: Path) -> None:
    assert runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY]).exit_code == 0
    text = (legacy_copy / "layout.json").read_text()
    again = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY])
    assert again.exit_code == 0 and again.stderr == ""
    assert again.stdout.startswith(
        f"already recorded in {legacy_copy / 'layout.json'}, nothing written: "
        "layout version 1 (legacy), ep_size 2, ep_fsdp_size 2"
    )
    other = runner.invoke(
        app, ["stamp", str(legacy_copy), "--source-layout", "canonical", "--ep-size", "2", "--ep-fsdp-size", "2"]
    )
    assert other.exit_code == 2 and other.stdout == ""
    assert "error: [E404]" in other.stderr and "layout canonical vs recorded legacy" in other.stderr
    # stamp needs the declaration: the hint says how to replace a wrong sidecar instead of "drop the options"
    hint = other.stderr.splitlines()[1]
    assert hint == (
        f"hint: {legacy_copy / 'layout.json'} already records --source-layout legacy --ep-size 2 "
        f"--ep-fsdp-size 2; if that record is wrong, delete {legacy_copy / 'layout.json'} and stamp "
        "again with the right declaration"
    )
    assert "drop --source-layout" not in other.stderr
    assert (legacy_copy / "layout.json").read_text() == text


def test_stamp_refuses_a_declaration_contradicting_the_geometry(legacy_copy: Path) -> None:
    res = runner.invoke(
        app, ["stamp", str(legacy_copy), "--source-layout", "legacy", "--ep-size", "4", "--ep-fsdp-size", "2"]
    )
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E404] model.model.layers.0.mlp.experts.gate_up_proj: the declared layout")
    hint = res.stderr.splitlines()[1]
    assert hint.startswith(
        "hint: the chunks of model.model.layers.0.mlp.experts.gate_up_proj split the expert dim "
        "into 4 piece(s): ep_size x ep_fsdp_size must be 4"
    )
    assert "drop --source-layout" not in res.stderr
    assert not (legacy_copy / "layout.json").exists()


def test_stamp_refuses_to_contradict_an_embedded_record(ep_suite: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(ep_suite / "p4f1", tmp_path / "p")
    res = runner.invoke(
        app, ["stamp", str(ck), "--source-layout", "canonical", "--ep-size", "4", "--ep-fsdp-size", "1"]
    )
    assert res.exit_code == 2 and "error: [E404]" in res.stderr and not (ck / "layout.json").exists()
    hint = res.stderr.splitlines()[1]
    assert hint.startswith(
        "hint: the layout is recorded inside the checkpoint (byte item 'layout', written with the "
        "save) and stamp cannot replace it; it needs no stamp (it says --source-layout legacy "
        "--ep-size 4 --ep-fsdp-size 1)"
    )
    assert "ckpttool reshard" in hint and "drop --source-layout" not in res.stderr
    res = runner.invoke(
        app, ["stamp", str(ck), "--source-layout", "legacy", "--ep-size", "4", "--ep-fsdp-size", "1", "--json"]
    )
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "ckpttool.stamp/1" and doc["written"] is False and doc["record"]["version"] == 1
    assert doc["recorded_in"] == "embedded" and doc["path"] == str(ck)
    assert not (ck / "layout.json").exists()
    # the no-op names where the record is: no layout.json was (or is) there
    res = runner.invoke(app, ["stamp", str(ck), "--source-layout", "legacy", "--ep-size", "4", "--ep-fsdp-size", "1"])
    assert res.exit_code == 0 and res.stderr == ""
    assert res.stdout.startswith(
        f"already recorded in the checkpoint's embedded layout item, nothing written: {ck}: "
        "layout version 1 (legacy), ep_size 4, ep_fsdp_size 1"
    )
    assert "layout.json" not in res.stdout and not (ck / "layout.json").exists()


def test_stamp_needs_all_three_options(legacy_copy: Path) -> None:
    res = runner.invoke(app, ["stamp", str(legacy_copy), "--source-layout", "legacy", "--ep-size", "2"])
    assert res.exit_code == 2 and "--ep-fsdp-size" in res.stderr and not (legacy_copy / "layout.json").exists()


def test_stamp_json_reports_the_record(legacy_copy: Path) -> None:
    res = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY, "--json"])
    assert res.exit_code == 0 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert doc["written"] is True and doc["ep_tensors"] == 4 and doc["same_dim"] == 4
    assert doc["record"] == json.loads((legacy_copy / "layout.json").read_text())


def test_validate_strict_fails_on_ambiguous_and_passes_after_stamp(legacy_copy: Path) -> None:
    res = runner.invoke(app, ["validate", "--strict", str(legacy_copy)])
    assert res.exit_code == 1, (res.stdout, res.stderr)
    assert runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY]).exit_code == 0
    res = runner.invoke(app, ["validate", "--strict", str(legacy_copy)])
    assert res.exit_code == 0, (res.stdout, res.stderr)


# ------------------------------------------------------------------ declarations nothing can verify
def build_unsplit_experts(out: Path) -> None:
    """One process, no layout record: fused expert tensors saved whole (one chunk, one rank)."""
    import torch.distributed.checkpoint as dcp

    sd = {
        "model.embed_tokens.weight": torch.ones(16, 8),
        "model.layers.0.mlp.experts.down_proj": torch.ones(8, 8, 4),
        "model.layers.0.mlp.experts.gate_up_proj": torch.ones(8, 8, 8),
    }
    dcp.save({"model": sd}, checkpoint_id=str(out))


def stamp_cli(ck: Path, layout: str, p: int, f: int):
    return runner.invoke(
        app, ["stamp", str(ck), "--source-layout", layout, "--ep-size", str(p), "--ep-fsdp-size", str(f)]
    )


def test_stamp_refuses_a_checkpoint_without_ep_tensors(dense_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "dense")
    before = snapshot(ck)
    res = stamp_cli(ck, "legacy", 2, 2)
    assert res.exit_code == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert err[0] == (
        f"error: [E400] {ck}: nothing to stamp: --source-layout legacy --ep-size 2 --ep-fsdp-size 2 "
        "cannot be verified, because the checkpoint has no EP tensors (fused `...experts.<name>` model "
        "tensors with a leading expert dim) whose chunk geometry could be checked"
    )
    assert err[1].startswith("hint: a checkpoint without expert tensors needs no EP layout record; nothing was written")
    assert not (ck / "layout.json").exists() and snapshot(ck) == before
    res = runner.invoke(
        app, ["stamp", str(ck), "--source-layout", "canonical", "--ep-size", "1", "--ep-fsdp-size", "1", "--json"]
    )
    assert res.exit_code == 2 and res.stdout == "" and "error: [E400]" in res.stderr
    assert not (ck / "layout.json").exists()


def test_stamp_refuses_sizes_the_writing_ranks_cannot_confirm(tmp_path: Path) -> None:
    ck = tmp_path / "unsplit"
    build_unsplit_experts(ck)
    # the experts are not split, so no FSDP dim is visible: any ep_fsdp_size would "fit" the chunks
    res = stamp_cli(ck, "canonical", 1, 4)
    assert res.exit_code == 2 and res.stdout == ""
    err = res.stderr.splitlines()
    assert err[0] == (
        f"error: [E400] {ck}: nothing to stamp: --source-layout canonical --ep-size 1 --ep-fsdp-size 4 "
        "cannot be verified: its EP tensors were written by 1 rank(s) [0], but a mesh of ep_size 1 x "
        "ep_fsdp_size 4 = 4 ranks saves every EP tensor from all 4 ranks, so the chunks cannot confirm "
        "the declared sizes"
    )
    assert err[1].startswith("hint: nothing was written; declare the mesh that saved this checkpoint")
    assert not (ck / "layout.json").exists()
    # sizes the chunks contradict: E404 with what the chunks fit
    res = stamp_cli(ck, "canonical", 2, 1)
    assert res.exit_code == 2 and res.stderr.startswith("error: [E404] model.model.layers.0.mlp.experts.down_proj")
    assert "fits --ep-size 1 --ep-fsdp-size 1" in res.stderr.splitlines()[1]
    # the mesh that did save it is verified and stamped
    res = stamp_cli(ck, "canonical", 1, 1)
    assert res.exit_code == 0 and res.stderr == ""
    assert res.stdout.startswith(
        f"wrote {ck / 'layout.json'}: layout version 2 (canonical), ep_size 1, ep_fsdp_size 1, 2 EP tensors"
    )


@pytest.mark.parametrize("listed", [["model.model.layers.0.mlp.experts.gate_up_proj"], None])
def test_a_record_that_leaves_out_split_expert_tensors_is_refused(
    legacy_copy: Path, tmp_path: Path, listed: list[str] | None
) -> None:
    """A layout.json of the saving mesh (legacy, 2x2) listing one expert tensor (or none: no extra_parallel):
    reshard --to canonical un-permuted only the listed ones and copied the other expert tensors block-transposed
    under a canonical record, and export wrote them so to HF, both exit 0. Now E400 naming the first left out,
    nothing written; stamping the full record after deleting layout.json reshards to the true experts."""
    rec: dict[str, object] = {"format": "ckpttool.layout", "version": 1, "parallel": {"ep_size": 2, "ep_fsdp_size": 2}}
    if listed is not None:
        rec["extra_parallel"] = {k: {"ep_dim": 0, "fsdp_dim": 0, "num_experts": 8} for k in listed}
    (legacy_copy / "layout.json").write_text(json.dumps(rec))
    first = "model.model.layers.0.mlp.experts.down_proj" if listed else "model.model.layers.0.mlp.experts.gate_up_proj"
    for cmd in (
        ["reshard", str(legacy_copy), str(tmp_path / "out"), "--to", "canonical", "--with-optimizer"],
        ["export", str(legacy_copy), str(tmp_path / "out")],
    ):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2, (cmd, res.stdout, res.stderr)
        assert res.stderr.startswith(f"error: [E400] {legacy_copy / 'layout.json'}: the layout record"), res.stderr
        assert f"does not list the expert tensor {first!r}" in res.stderr and "Traceback" not in res.stderr
        assert not (tmp_path / "out").exists()
    (legacy_copy / "layout.json").unlink()
    assert runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY]).exit_code == 0
    res = runner.invoke(
        app, ["reshard", str(legacy_copy), str(tmp_path / "out"), "--to", "canonical", "--with-optimizer"]
    )
    assert res.exit_code == 0, res.stderr
    truth = true_state(8)
    with CheckpointReader(tmp_path / "out") as r:
        for n in range(2):
            for w in ("gate_up_proj", "down_proj"):
                key = f"model.model.layers.{n}.mlp.experts.{w}"
                assert torch.equal(r.read_tensor(key), truth[key]), key


def test_a_plain_fsdp_save_is_told_the_sizes_that_record_it(sample_ckpt: Path, tmp_path: Path) -> None:
    """A MoE saved by plain FSDP over 4 ranks (here through `import --world-size 4`, which cuts it as FSDP2's
    Shard(0) does): `stamp --ep-size 1 --ep-fsdp-size 1` is refused, and the hint named only `--ep-size 4
    --ep-fsdp-size 1` (EP alone), not the sizes of a save without EP. It now names `--ep-size 1 --ep-fsdp-size 4`,
    which records it: validate --strict then passes."""
    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), "-q"]).exit_code == 0
    assert runner.invoke(app, ["import", str(hf), str(ckpt), "--world-size", "4", "--no-fsync"]).exit_code == 0
    args = ["stamp", str(ckpt), "--source-layout", "canonical", "--ep-size", "1", "--ep-fsdp-size", "1"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and res.stderr.startswith("error: [E404]")
    assert "--ep-size 1 --ep-fsdp-size 4 when FSDP alone does" in res.stderr.splitlines()[1]
    args[-1] = "4"
    assert runner.invoke(app, args).exit_code == 0
    assert runner.invoke(app, ["validate", str(ckpt), "--strict"]).exit_code == 0


def test_stamp_over_a_layout_json_directory_hints_at_the_directory(legacy_copy: Path) -> None:
    """stamp has no --overwrite and no output directory to choose, yet E600's hint named both."""
    (legacy_copy / "layout.json").mkdir()
    res = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY])
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0] == f"error: [E600] {legacy_copy / 'layout.json'}: cannot write (Is a directory)", res.stderr
    assert lines[1] == f"hint: {legacy_copy / 'layout.json'} is a directory; move it away and run again"
    assert "--overwrite" not in res.stderr and (legacy_copy / "layout.json").is_dir()
    assert sorted(p.name for p in legacy_copy.iterdir() if p.name.startswith(".")) == [".metadata"]  # no temp files


def test_a_layout_json_written_by_another_stamp_meanwhile_is_never_replaced(legacy_copy: Path) -> None:
    """Two stamps of one checkpoint at once: each opened it before either wrote, so neither saw a record, and the
    later rename replaced the earlier one's layout.json (told "wrote ... canonical") by a contradicting record. The
    sidecar is now published only where none is: the later stamp checks the record it finds, as on a second run."""
    from ckpttool.errors import LayoutContradictionError
    from ckpttool.model.checkpoint import OpenOptions, open_source
    from ckpttool.ops.stamp import StampOptions, stamp
    from ckpttool.ui.options import declaration

    legacy, canonical = declaration("legacy", 2, 2), declaration("canonical", 4, 1)
    with open_source(legacy_copy, OpenOptions(declaration=legacy), record_problems=True) as opened:
        assert stamp(legacy_copy, StampOptions(canonical)).written  # the other run, between open and write
        theirs = (legacy_copy / "layout.json").read_bytes()
        with pytest.raises(LayoutContradictionError) as err:
            stamp(opened, StampOptions(legacy))
    assert err.value.code == "E404" and "written meanwhile" in err.value.message
    assert "ep_size 4" in err.value.message and (legacy_copy / "layout.json").read_bytes() == theirs
    assert sorted(p.name for p in legacy_copy.iterdir() if ".ckpttool-tmp" in p.name) == []  # no temporary file left
    # the same declaration found written meanwhile: nothing written, the record named where it is
    (legacy_copy / "layout.json").unlink()
    with open_source(legacy_copy, OpenOptions(declaration=canonical), record_problems=True) as opened:
        assert stamp(legacy_copy, StampOptions(canonical)).written
        again = stamp(opened, StampOptions(canonical))
    assert (again.written, again.recorded_in, again.record["version"]) == (False, "sidecar", 2)


def test_stamp_says_when_it_leaves_the_checkpoints_manifest_out_of_date(legacy_copy: Path) -> None:
    """A manifest made before the stamp does not list ``layout.json``: its ``--verify`` then fails (an extra file).
    stamp said nothing of it; it now warns (stderr and ``warnings`` in --json), and the advice it gives works."""
    assert runner.invoke(app, ["manifest", str(legacy_copy)]).exit_code == 0
    res = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY, "--json"])
    assert res.exit_code == 0, res.stderr
    warning = (
        f"warning: {legacy_copy / 'manifest.json'} was made before layout.json: its --verify reports layout.json as "
        f"an extra file; make it again (`ckpttool manifest {legacy_copy}`) to cover the record"
    )
    assert res.stderr.splitlines() == [warning]
    assert json.loads(res.stdout)["warnings"] == [warning.removeprefix("warning: ")]
    stale = runner.invoke(app, ["manifest", str(legacy_copy), "--verify"])  # what the warning says
    assert stale.exit_code == 1 and "layout.json" in stale.stdout, stale.stdout
    assert runner.invoke(app, ["manifest", str(legacy_copy)]).exit_code == 0  # what it advises
    assert runner.invoke(app, ["manifest", str(legacy_copy), "--verify"]).exit_code == 0
    again = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY])  # already recorded: nothing made stale
    assert again.exit_code == 0 and again.stderr == "", again.stderr


def test_an_unreadable_layout_json_is_named_with_a_hint_that_helps(legacy_copy: Path) -> None:
    """A ``layout.json`` that is a symbolic link to a missing file (inside the checkpoint) cannot be read: E400.
    Its hint said to declare the layout, which stamp had just been given; it now says to fix or delete the file,
    and stamp then records the layout."""
    (legacy_copy / "layout.json").symlink_to("layout-v2.json")  # the target was moved away
    res = runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines() == [
        f"error: [E400] {legacy_copy / 'layout.json'}: cannot read (No such file or directory)",
        "hint: fix or delete layout.json, then declare the layout (--source-layout legacy|canonical --ep-size P "
        "--ep-fsdp-size F) or record it again with `ckpttool stamp`",
    ]
    (legacy_copy / "layout.json").unlink()  # as the hint says
    assert runner.invoke(app, ["stamp", str(legacy_copy), *LEGACY]).exit_code == 0


def test_stamp_of_a_run_root_names_a_newer_unfinished_save(ep_suite: Path, tmp_path: Path) -> None:
    """`stamp RUN --step latest` stamped step 1 while step 2's save had not finished, without a word (stats, export,
    reshard and validate's R001 name it); a warning now does, on stderr and in the JSON warnings."""
    copy_checkpoint(ep_suite / "legacy", tmp_path / "run" / "step-1")
    newer = copy_checkpoint(ep_suite / "legacy", tmp_path / "run" / "step-2")
    (newer / ".metadata").rename(newer / ".metadata.tmp")  # FileSystemWriter's name until every rank finished
    res = runner.invoke(app, ["stamp", str(tmp_path / "run"), "--step", "latest", *LEGACY, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["path"] == str(tmp_path / "run" / "step-1" / "layout.json")
    assert any("step 2" in w and ".metadata.tmp" in w and "(R001)" in w for w in doc["warnings"]), doc["warnings"]
    assert "a newer step's save did not finish: step 2" in res.stderr and "stamped step 1" in res.stderr
    assert not (newer / "layout.json").exists()
