"""Layout resolution (record, sidecar, declaration) and EP chunk geometry on real DTensor saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpttool.errors import LayoutError
from ckpttool.format import CheckpointReader
from ckpttool.layouts.declaration import LayoutDeclaration, resolve_layout
from ckpttool.layouts.permute import canonical_to_legacy_perm
from ckpttool.model.catalog import build_catalog
from ckpttool.ops.tensors import to_canonical
from tests.fixtures.cache import copy_checkpoint
from tests.fixtures.moe_ep import VARIANTS, record_for, true_state

pytestmark = pytest.mark.slow

DOWN = "model.model.layers.0.mlp.experts.down_proj"
GATE_UP = "model.model.layers.1.mlp.experts.gate_up_proj"


def resolved(path: Path, decl: LayoutDeclaration | None = None):
    with CheckpointReader(path) as r:
        cat = build_catalog(r)
        return cat, resolve_layout(cat, r, decl)


def test_unversioned_same_dim_fixtures_are_ambiguous(ep_suite: Path) -> None:
    for name in ("legacy", "canonical"):
        cat, lay = resolved(ep_suite / name)
        assert lay.version is None and lay.source == "none" and lay.record is None
        assert sorted(lay.ambiguous) == sorted(k for k in cat.model if ".experts." in k) and len(lay.ambiguous) == 4
        with pytest.raises(LayoutError) as ei:
            lay.require_unambiguous()
        assert ei.value.code == "E405" and "`source_layout`" in ei.value.hint and "`no_ep`" in ei.value.hint
        assert "ep_size 2 x ep_fsdp_size 2" in ei.value.hint  # the candidate mesh, from the chunks
        geo = {g.key: g for g in lay.geometry(cat)}
        assert geo[DOWN].blocks_per_dim == (4, 1, 1) and geo[DOWN].same_dim and geo[DOWN].fsdp_dim == 0
        assert geo[DOWN].ranks == (0, 1, 2, 3) and geo[DOWN].problems == () and geo[DOWN].num_experts == 8


def test_fsdp_on_dim1_is_unambiguous_and_uneven(ep_suite: Path) -> None:
    cat, lay = resolved(ep_suite / "legacy_dim1")
    assert lay.version is None and lay.ambiguous == []
    geo = {g.key: g for g in lay.geometry(cat)}
    down = geo[DOWN]
    assert down.fsdp_dim == 1 and not down.same_dim and down.blocks_per_dim == (2, 2, 1)
    assert sorted({c.sizes[1] for c in cat.model[DOWN].chunks}) == [2, 3]  # H = 5 split 3/2
    # Legacy and canonical hold identical bytes when the dims differ: no permutation either way.
    lay2 = resolved(ep_suite / "legacy_dim1", LayoutDeclaration("legacy", 2, 2))[1]
    assert not lay2.is_permuted(DOWN) and lay2.canonical_perm(DOWN) is None


def test_embedded_record_p4f1_consistent_with_zero_size_chunks(ep_suite: Path) -> None:
    cat, lay = resolved(ep_suite / "p4f1")
    assert (lay.version, lay.source, lay.ep_size, lay.ep_fsdp_size) == (1, "embedded", 4, 1)
    assert all(not g.problems for g in lay.geometry(cat)) and len(lay.ep_tensors) == 4
    assert cat.model["model.model.odd"].zero_size_chunks == 1
    assert not lay.is_permuted(DOWN)  # F = 1: legacy order is the true order


@pytest.mark.parametrize("name", ["legacy", "canonical"])
def test_declared_layout_gives_true_expert_order(ep_suite: Path, name: str) -> None:
    cat, lay = resolved(ep_suite / name, LayoutDeclaration(name, 2, 2))
    assert lay.version == {"legacy": 1, "canonical": 2}[name] and lay.source == "declared" and lay.ambiguous == []
    true = true_state(8)
    with CheckpointReader(ep_suite / name) as r:
        for key in (DOWN, GATE_UP, "optimizer.state.model.layers.0.mlp.experts.down_proj.exp_avg"):
            stored = r.read_tensor(key)
            assert torch.equal(to_canonical(lay, key, stored), true[key])
            assert lay.is_permuted(key) is (name == "legacy")
        # Non-EP keys and 0-d step pass through.
        emb = "model.model.embed_tokens.weight"
        assert lay.spec_for(emb) is None and to_canonical(lay, emb, r.read_tensor(emb)) is not None
        assert lay.spec_for("optimizer.state.model.layers.0.mlp.experts.down_proj.step") is not None


def test_legacy_fixture_really_is_block_transposed(ep_suite: Path) -> None:
    # The docs/design.md claim, checked on torch's own save: position f*P+e holds true slab e*F+f.
    true = true_state(8)
    with CheckpointReader(ep_suite / "legacy") as r:
        stored = r.read_tensor(DOWN)
    slabs = true[DOWN].split(2)
    assert torch.equal(stored, torch.cat([slabs[i] for i in canonical_to_legacy_perm(4, 2, 2)]))
    assert not torch.equal(stored, true[DOWN])


@pytest.mark.parametrize(
    "decl,needle",
    [
        (LayoutDeclaration("legacy", 2, 4), "contradicts the chunk geometry"),
        (LayoutDeclaration("legacy", 8, 1), "contradicts the chunk geometry"),
        (LayoutDeclaration("canonical", 3, 1), "not divisible by ep_size 3"),
    ],
)
def test_declaration_contradicting_geometry_is_e404(ep_suite: Path, decl: LayoutDeclaration, needle: str) -> None:
    with pytest.raises(LayoutError) as ei:
        resolved(ep_suite / "legacy", decl)
    assert ei.value.code == "E404" and needle in ei.value.message and ei.value.fqn and ".experts." in ei.value.fqn


def test_declaration_contradicting_record_is_e404(ep_suite: Path) -> None:
    with pytest.raises(LayoutError) as ei:
        resolved(ep_suite / "p4f1", LayoutDeclaration("canonical", 4, 1))
    assert ei.value.code == "E404" and "layout canonical vs recorded legacy" in ei.value.message
    with pytest.raises(LayoutError, match="`ep_size` 2 vs recorded ep_size 4"):
        resolved(ep_suite / "p4f1", LayoutDeclaration("legacy", 2, 2))
    # Agreeing with the record is fine.
    assert resolved(ep_suite / "p4f1", LayoutDeclaration("legacy", 4, 1))[1].source == "embedded"


def test_embedded_and_sidecar_disagree_is_e403(ep_suite: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(ep_suite / "p4f1", tmp_path / "c")
    (ck / "layout.json").write_text(json.dumps(record_for(VARIANTS["p4f1"], version=2)))
    with pytest.raises(LayoutError) as ei:
        resolved(ck)
    assert ei.value.code == "E403"


def test_record_contradicting_geometry_is_reported_per_tensor(ep_suite: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "c")
    rec = record_for(VARIANTS["legacy"])
    rec["parallel"]["ep_fsdp_size"] = 4  # 2 x 4 = 8 slabs, the chunks show 4
    (ck / "layout.json").write_text(json.dumps(rec))
    cat, lay = resolved(ck)
    assert lay.source == "sidecar" and lay.version == 1
    geo = lay.geometry(cat)
    assert len(geo) == 4 and all(g.problems for g in geo)
    assert "dim 0 is split into 4 chunk interval(s)" in geo[0].problems[0]


def test_record_naming_a_missing_key(ep_suite: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "c")
    rec = record_for(VARIANTS["legacy"])
    rec["extra_parallel"]["model.model.layers.9.mlp.experts.down_proj"] = {"ep_dim": 0, "fsdp_dim": 0, "num_experts": 8}
    (ck / "layout.json").write_text(json.dumps(rec))
    cat, lay = resolved(ck)
    missing = [g for g in lay.geometry(cat) if g.shape == ()]
    assert [g.key for g in missing] == ["model.model.layers.9.mlp.experts.down_proj"]
    assert missing[0].problems == ("named by the layout but not in the checkpoint",)


@pytest.mark.parametrize(
    "mutate,code",
    [
        (lambda r: r.update(format="other.layout"), "E401"),
        (lambda r: r.update(version=3), "E402"),
        (lambda r: r["parallel"].update(ep_size=0), "E400"),
    ],
)
def test_invalid_sidecar_records(ep_suite: Path, tmp_path: Path, mutate, code: str) -> None:
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "c")
    rec = record_for(VARIANTS["legacy"])
    mutate(rec)
    (ck / "layout.json").write_text(json.dumps(rec))
    with pytest.raises(LayoutError) as ei:
        resolved(ck)
    assert ei.value.code == code


# ------------------------------------------------------------------------------------------ plain FSDP2, several chunks
def test_ep_ranks_that_stored_several_chunks_accept_the_true_declaration(ep_multichunk_ckpt: Path) -> None:
    key = "model.model.layers.0.mlp.experts.down_proj"
    cat, lay = resolved(ep_multichunk_ckpt)
    # 4 blocks from 2 ranks: no EP 2 x EP-FSDP 2 mesh (4 ranks, one block each) wrote them, so not ambiguous
    assert lay.ambiguous == [] and not lay.candidates.get(key)
    _, lay = resolved(ep_multichunk_ckpt, LayoutDeclaration.from_options("canonical", 2, 1))
    assert lay.version == 2 and lay.ep_size == 2 and lay.geometry(cat)[0].problems == ()
    with pytest.raises(LayoutError) as ei:  # 2 blocks per rank cannot be one EP rank's block of 4 experts each
        resolved(ep_multichunk_ckpt, LayoutDeclaration.from_options("canonical", 1, 1))
    assert ei.value.code == "E404"


@pytest.mark.parametrize("order", ["legacy", "canonical"])
def test_a_mesh_of_more_ranks_than_wrote_the_blocks_contradicts_the_chunks(
    ep_multichunk_ckpt: Path, tmp_path: Path, order: str
) -> None:
    """2 EP ranks each saved their 4 experts as 2 chunks (4 blocks, 2 writers). A declared 2 x 2 mesh was
    accepted: reshard --source-layout legacy un-permuted the experts of a save that never was block-transposed
    (exit 0, "1 with a new expert order"). Each rank of a 2 x 2 mesh saves one block: E404, nothing written."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    key = "model.model.layers.0.mlp.experts.down_proj"
    with pytest.raises(LayoutError) as ei:
        resolved(ep_multichunk_ckpt, LayoutDeclaration.from_options(order, 2, 2))
    assert ei.value.code == "E404" and "rank 0 stored experts of two blocks of dim 0" in ei.value.message
    out = tmp_path / "out"
    decl = ["--source-layout", order, "--ep-size", "2", "--ep-fsdp-size", "2"]
    res = CliRunner().invoke(app, ["reshard", str(ep_multichunk_ckpt), str(out), "--to", "canonical", *decl])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E404] {key}: "), res.stderr
    assert not out.exists()


def test_refinement_needs_one_writer_per_block() -> None:
    from ckpttool.layouts.geometry import refines

    want = {(0, 4), (4, 4)}
    got = {(0, 2), (2, 2), (4, 2), (6, 2)}
    same = {(0, 2): {0}, (2, 2): {0}, (4, 2): {1}, (6, 2): {1}}
    split = {(0, 2): {0}, (2, 2): {1}, (4, 2): {2}, (6, 2): {3}}  # EP-FSDP ranks, not one EP rank
    assert refines(got, want, same) and not refines(got, want, split) and not refines(got, want, None)
    assert not refines({(0, 6), (6, 2)}, want, {(0, 6): {0}, (6, 2): {1}})  # a chunk across two blocks


def test_candidates_of_plain_fsdp2(acc_root: Path, moe4_root: Path) -> None:
    _, lay2 = resolved(acc_root / "moe_fsdp2")
    assert lay2.ambiguous == [] and all(c == () for c in lay2.candidates.values())  # 2 blocks: no 2-way x 2-way split
    _, lay4 = resolved(moe4_root / "moe_fsdp4")
    assert len(lay4.ambiguous) == 4 and all(c == ((2, 2),) for c in lay4.candidates.values())
    with CheckpointReader(moe4_root / "moe_fsdp4") as r:
        cat = build_catalog(r)
        no_ep = resolve_layout(cat, r, LayoutDeclaration.from_options(None, None, None, no_ep=True))
    assert no_ep.ambiguous == [] and no_ep.ep_size == 1 and not any(no_ep.is_permuted(k) for k in no_ep.ep_tensors)


def test_no_ep_excludes_sizes_and_contradicts_an_ep_record(ep_suite: Path) -> None:
    with pytest.raises(Exception, match="excludes"):
        LayoutDeclaration.from_options("canonical", 2, 2, no_ep=True)
    with pytest.raises(LayoutError) as ei:
        resolved(ep_suite / "p4f1", LayoutDeclaration.from_options(None, None, None, no_ep=True))
    assert ei.value.code == "E404" and "ep_size 4" in ei.value.message


def test_record_of_a_huge_mesh_is_checked_without_one_entry_per_rank(ep_suite: Path, tmp_path: Path) -> None:
    """A sidecar naming a mesh of 2 x 10**12 ranks (canonical, so no divisibility check stops it first) was
    checked against the chunks by listing every rank's interval: `inspect`, `validate`, `export` and
    `reshard` of such a checkpoint ran out of memory (E999) or hung. Only the non-empty intervals are listed
    now (at most one per expert), so the contradiction is an E404 at once, under a 768 MiB address-space cap."""
    import resource
    import subprocess
    import sys

    from ckpttool.layouts.geometry import nested_shard_intervals, nonempty_shard_intervals

    for n in range(13):
        for mesh in ((1,), (3,), (7,), (2, 3), (4, 5), (2, 2, 3), (1, 40), (40,)):
            assert nonempty_shard_intervals(n, mesh) == {iv for iv in nested_shard_intervals(n, mesh) if iv[1]}
    ck = copy_checkpoint(ep_suite / "canonical", tmp_path / "c")
    rec = record_for(VARIANTS["canonical"])
    rec["parallel"]["ep_fsdp_size"] = 10**12
    (ck / "layout.json").write_text(json.dumps(rec))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))

    args = [sys.executable, "-m", "ckpttool", "reshard", str(ck), str(tmp_path / "o"), "--to", "canonical"]
    res = subprocess.run(
        [*args, "--with-optimizer"], capture_output=True, text=True, timeout=300, preexec_fn=cap, cwd=tmp_path
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: [E404] model.model.layers.0.mlp.experts.gate_up_proj: the chunk geometry")
    assert "ep_size 2 x ep_fsdp_size 1000000000000 gives 8" in res.stderr
    assert not (tmp_path / "o").exists()


def test_uneven_legacy_save_is_ambiguous_not_exported_in_its_stored_order(
    ep_uneven_legacy: Path, tmp_path: Path
) -> None:
    """10 experts saved by a legacy (ep_fsdp=3, ep=2) mesh of 6 ranks, no layout record: DTensor stores the pieces
    2, 2, 2, 2, 1, 1 block-transposed. Only the canonical nesting of the chunk intervals was tried (2, 2, 1, 2, 2, 1),
    so the checkpoint passed as stored in true order: validate --strict said OK and export wrote the experts
    permuted (exit 0). The legacy nesting is a candidate too: E405 with the mesh that fits; a legacy declaration
    of that mesh is refused (E404), not permuted with equal slabs."""
    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.moe_ep import UNEVEN_KEY as key
    from tests.fixtures.moe_ep import uneven_true_experts

    ck = ep_uneven_legacy / "p2f3"
    stored = {key: torch.zeros(10, 2, 3, dtype=torch.bfloat16)}
    dcp.load({"model": stored}, checkpoint_id=str(ck))  # torch's own reader, one process
    order = [int(x) for x in stored[key][:, 0, 0].tolist()]
    assert order == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9] and not torch.equal(stored[key], uneven_true_experts(10))

    runner = CliRunner()
    res = runner.invoke(app, ["validate", "--strict", str(ck)])
    assert res.exit_code == 1 and "L003" in res.stdout and "ep_size 2 x ep_fsdp_size 3" in res.stdout, res.stdout
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ck), str(out)])
    assert res.exit_code == 2 and res.stdout == "" and not out.exists(), res.stdout
    assert res.stderr.startswith(f"error: [E405] model.{key}"), res.stderr
    assert "ep_size 2 x ep_fsdp_size 3" in res.stderr
    decl = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "3"]
    res = runner.invoke(app, ["export", str(ck), str(out), *decl])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E406] model.{key}: ") and not out.exists()
    assert "the chunks fit the declared legacy mesh (ep_size 2, ep_fsdp_size 3)" in res.stderr, res.stderr


def test_uneven_legacy_save_declared_as_saved_is_e406_not_a_contradiction(
    ep_uneven_legacy: Path, tmp_path: Path
) -> None:
    """The E405 on the 10-expert legacy (ep_fsdp=3, ep=2) save names ep_size 2 x ep_fsdp_size 3; declaring exactly
    that was E404 'contradicts the chunk geometry' with the hint 'check the mesh sizes of the job that saved the
    checkpoint', though torch's chunks are those of that mesh: the user was sent back and forth. It is E406 (sizes
    that do not split the experts into equal slabs, which only are un-permuted), one line, the hint saying how to
    convert it (validate: an L001 finding); a declaration the chunks do contradict stays E404. Nothing is written."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.moe_ep import UNEVEN_KEY as key

    ck = ep_uneven_legacy / "p2f3"
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    runner = CliRunner()
    out = tmp_path / "o"
    decl = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "3"]
    res = runner.invoke(app, ["validate", str(ck), *decl])
    assert res.exit_code == 1 and "L001 E406" in res.stdout and "check the mesh sizes" not in res.stdout, res.stdout
    for cmd in (["reshard", str(ck), str(out), "--to", "canonical"], ["diff", str(ck), str(ck)]):
        res = runner.invoke(app, [*cmd, *decl])
        assert res.exit_code == 2 and res.stdout == "" and not out.exists(), (cmd, res.stdout, res.stderr)
        line, hint = res.stderr.splitlines()
        assert line.startswith("error: [E406] ") and f"model.{key}: the chunks fit the declared legacy mesh" in line, (
            line
        )
        assert "save it again from a canonical (ep, ep_fsdp) mesh" in hint and "check the mesh sizes" not in hint
    res = runner.invoke(
        app, ["reshard", str(ck), str(out), "--to", "canonical", *decl[:2], "--ep-size", "3", *decl[4:]]
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: [E404] ") and not out.exists(), res.stderr
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


def test_legacy_record_without_ep_and_uneven_experts_is_read_in_stored_order(
    ep_uneven_legacy: Path, tmp_path: Path
) -> None:
    """5 experts saved by a legacy (ep_fsdp=6, ep=1) mesh (EP off, the last rank holds none) with a version-1 record:
    with one EP rank the legacy order is the true order, but the record was held to "num_experts divisible by
    ep_size*ep_fsdp_size": validate --strict failed (L005 on a clean save), export and reshard refused (E404), and a
    reshard to a legacy 1 x 3 target was refused (E406). Only a permuted layout (both sizes above 1) needs equal
    slabs now; every output holds the experts torch's own reader returns."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.moe_ep import UNEVEN_KEY as key
    from tests.fixtures.moe_ep import uneven_true_experts

    def torch_read(path: Path) -> torch.Tensor:
        got = {key: torch.zeros(5, 2, 3, dtype=torch.bfloat16)}
        dcp.load({"model": got}, checkpoint_id=str(path))  # torch's own reader, one process
        return got[key]

    ck = ep_uneven_legacy / "p1f6"
    truth = uneven_true_experts(5)
    assert torch.equal(torch_read(ck), truth)
    runner = CliRunner()
    res = runner.invoke(app, ["validate", "--strict", "--deep", str(ck)])
    assert res.exit_code == 0 and res.stderr == "" and "OK: 0 errors, 0 warnings" in res.stdout, res.stdout
    res = runner.invoke(app, ["export", str(ck), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.stderr
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")[key], truth)
    for to, p, f in (("canonical", 5, 1), ("legacy", 1, 3)):
        out = tmp_path / f"{to}_{p}x{f}"
        args = ["reshard", str(ck), str(out), "--to", to, "--target-ep-size", str(p), "--target-ep-fsdp-size", str(f)]
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.stderr
        assert torch.equal(torch_read(out), truth), (to, p, f)
