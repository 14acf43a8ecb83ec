"""`reshard --manifest`: the output's manifest taken while writing, and the source's identity in its layout record.

Sources are real 4-rank ``dcp.save`` DTensor checkpoints; the written manifest is compared with an
independent read of the output (``ckpttool manifest --covers record``), torch's own ``dcp.load``
reads the output, and a changed byte is caught by ``validate --manifest``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import CheckpointReader
from ckpttool.format.digest import digest_bytes
from ckpttool.layouts.declaration import LayoutDeclaration
from ckpttool.model.checkpoint import OpenOptions
from ckpttool.ops.manifest import build_manifest, load_manifest, write_manifest
from ckpttool.ops.reshard import ReshardOptions
from ckpttool.ops.reshard.execute import reshard

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def manifested(ep_suite: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Outputs that exercise every write path: verbatim copies, streamed archives, torch.save'd reassemblies."""
    root = tmp_path_factory.mktemp("reshard_manifest")
    out = {"a": root / "legacy_to_canonical", "d": root / "dim1_to_canonical", "p": root / "p4f1"}
    reshard(
        ep_suite / "legacy",
        out["a"],
        ReshardOptions(to="canonical", with_optimizer=True, manifest=True),
        opening=OpenOptions(declaration=LayoutDeclaration("legacy", 2, 2)),
    )
    reshard(
        ep_suite / "legacy_dim1",
        out["d"],
        ReshardOptions(
            to="canonical",
            with_optimizer=True,
            target_ep_size=2,
            target_ep_fsdp_size=2,
            manifest=True,
            algorithm="blake3",
        ),
    )
    reshard(ep_suite / "p4f1", out["p"], ReshardOptions(to="canonical", manifest=True))
    return out


SOURCES = {"a": "legacy", "d": "legacy_dim1", "p": "p4f1"}


@pytest.mark.parametrize("name", ["a", "d", "p"])
def test_written_manifest_equals_an_independent_read_of_the_output(
    manifested: dict[str, Path], ep_suite: Path, name: str
) -> None:
    out = manifested[name]
    written = load_manifest(out / "manifest.json")
    with CheckpointReader(out) as r:
        read = build_manifest(r, written.algorithm, covers="record")
    assert [e.to_dict() for e in written.entries] == [e.to_dict() for e in read.entries]
    assert (written.metadata_digest, written.metadata_size) == (read.metadata_digest, read.metadata_size)
    # the size of every data file (bytes appended after its last window are then named): as a stat of the output
    assert (
        written.data_files
        == read.data_files
        == tuple({"file": f.name, "size": f.stat().st_size} for f in sorted(out.glob("*.distcp")))
    )
    assert {e.covers for e in written.entries if e.offsets is not None} == {"record"}
    assert all(e.covers == "window" for e in written.entries if e.offsets is None)
    # every chunk of the output is listed, and none twice
    assert len(written.entries) == len({e.ident for e in written.entries})
    res = runner.invoke(app, ["validate", str(out), "--manifest", str(out / "manifest.json"), "--json"])
    assert res.exit_code == 0, res.stdout
    doc = json.loads(res.stdout)
    s015 = [s for s in doc["rules"] if s["code"] == "S015"]
    assert s015 and s015[0]["status"] not in ("skipped", "skip") and s015[0]["findings"] == 0, s015
    # the source identity: its .metadata digest, in the manifest and in the layout record
    src = ep_suite / SOURCES[name]
    md = digest_bytes((src / ".metadata").read_bytes(), written.algorithm)
    assert written.source is not None and written.source["metadata_digest"] == md
    with CheckpointReader(out) as r:
        record = json.loads(r.read_object("layout"))
    assert record["converted_from"]["source"] == {k: v for k, v in written.source.items() if k != "checkpoint"}


def test_source_identity_names_the_source_manifest(ep_suite: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ep_suite / "p4f1", src)
    made = write_manifest(src)
    out = tmp_path / "out"
    res = runner.invoke(app, ["reshard", str(src), str(out), "--to", "canonical", "--json"])
    assert res.exit_code == 0, res.stderr
    ident = json.loads(res.stdout)["source_identity"]
    assert ident["manifest_digest"] == made.digest and ident["metadata_digest"] == made.metadata_digest
    assert not (out / "manifest.json").exists()  # the source's manifest describes the source, never copied
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0, res.stderr
    assert made.metadata_digest[:16] in res.stdout and made.digest[:16] in res.stdout


def test_torch_dcp_load_reads_the_output_unchanged(manifested: dict[str, Path]) -> None:
    import torch.distributed.checkpoint as dcp

    out = manifested["a"]
    with CheckpointReader(out) as r:
        keys = [k for k in r.metadata.entries if k.startswith("model.")]
        ours = {k: r.read_tensor(k) for k in keys}
    sd = {k: torch.zeros_like(v) for k, v in ours.items()}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)  # the layout byte item is not asked for: ignored
    assert all(torch.equal(sd[k], ours[k]) for k in keys)


def test_a_changed_byte_in_the_output_is_named(manifested: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(manifested["d"], out)
    man = load_manifest(out / "manifest.json")
    target = max((e for e in man.entries if e.offsets is not None and e.covers == "record"), key=lambda e: e.length)
    with CheckpointReader(out) as r:
        from ckpttool.ops.manifest import record_span

        chunk = next(c for c in r.tensor_meta(target.key).chunks if c.offsets == target.offsets)
        start, length = record_span(r, target.key, chunk) or (0, 0)
    assert length > 0
    with open(out / target.file, "r+b") as f:
        f.seek(start + length // 2)
        b = f.read(1)
        f.seek(start + length // 2)
        f.write(bytes([b[0] ^ 0x01]))
    res = runner.invoke(app, ["validate", str(out), "--manifest", str(out / "manifest.json"), "--json"])
    assert res.exit_code == 1, res.stdout
    text = res.stdout
    assert target.key in text and "differ from the manifest" in text


def test_version_1_manifests_stay_valid(ep_suite: Path, tmp_path: Path) -> None:
    src = ep_suite / "p4f1"
    with CheckpointReader(src) as r:
        man = build_manifest(r)
    doc = man.to_dict()
    doc["version"] = 1
    for e in doc["entries"]:
        del e["covers"]
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(doc))
    loaded = load_manifest(p)
    assert all(e.covers == "window" for e in loaded.entries)
    res = runner.invoke(app, ["validate", str(src), "--manifest", str(p)])
    assert res.exit_code == 0, res.stdout
