"""`export --manifest`: a digest of every byte range as it is written, and the source identity in `__metadata__`.

Sources are real ``dcp.save`` checkpoints of tiny transformers models; the exports are loaded by
transformers' ``from_pretrained`` (logits equal the original's), the manifest's extents are
compared with the bytes safetensors' own reader returns, and a changed byte is named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format.digest import digest_bytes
from ckpttool.ops.manifest import SOURCE_METADATA_KEY, load_manifest, verify_safetensors_manifest, write_manifest
from tests.ops.export.test_export_consumers import assert_same_logits, export, load_hf

runner = CliRunner()
pytest.importorskip("transformers")

from tests.ops.export.test_export_consumers import llama_ckpt, qwen_ckpt  # noqa: E402,F401  (fixtures)


def _independent_extents(out: Path, algorithm: str) -> dict[tuple[str, int], str]:
    """Digest of every manifest extent, from the tensor bytes safetensors' own reader returns."""
    from safetensors import safe_open

    man = load_manifest(out / "manifest.json")
    got: dict[tuple[str, int], str] = {}
    for name in {e.file for e in man.entries}:
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
                for e in man.entries:
                    if e.file == name and e.key == key:
                        assert e.offsets is not None
                        at = e.offsets[0]
                        got[(key, at)] = digest_bytes(raw[at : at + e.length], algorithm)
    return got


@pytest.mark.parametrize("args", [("--shard-size", "20KB"), ("--save-dtype", "bfloat16")])
def test_llama_manifest_matches_the_bytes_transformers_loads(
    llama_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    args: tuple[str, str],
) -> None:
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    summary = export(llama_ckpt, out, "--manifest", *args)
    assert summary["manifest"] == "manifest.json"
    man = load_manifest(out / "manifest.json")
    assert man.kind == "safetensors" and {e.covers for e in man.entries} == {"extent"}
    assert {e.ident: e.digest for e in man.entries} == {
        (k, (at,)): d for (k, at), d in _independent_extents(out, man.algorithm).items()
    }
    assert verify_safetensors_manifest(out, man) == []
    res = runner.invoke(app, ["manifest", str(out), "--verify"])
    assert res.exit_code == 0, res.stdout + res.stderr
    # the human summary says where it went
    res = runner.invoke(app, ["export", str(llama_ckpt), str(tmp_path / "again"), "--manifest", *args])
    assert res.exit_code == 0, res.output
    assert f"manifest    {tmp_path / 'again'}/manifest.json (every byte digested as written)" in res.stdout.splitlines()
    # the source identity: in the manifest and in every file's __metadata__
    md = digest_bytes((llama_ckpt / ".metadata").read_bytes(), man.algorithm)
    assert man.source is not None and man.source["metadata_digest"] == md
    from safetensors import safe_open

    for f in summary["files"]:
        with safe_open(str(out / f["name"]), framework="pt") as st:
            meta = st.metadata()
        recorded = json.loads(meta[SOURCE_METADATA_KEY])
        assert meta["format"] == "pt" and recorded == {k: v for k, v in man.source.items() if k != "checkpoint"}
    if args[0] == "--shard-size":
        assert_same_logits(load_hf(out, LlamaForCausalLM), llama_ckpt)  # transformers ignores the extra key


def test_moe_per_expert_export_manifest_covers_every_tensor(qwen_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "hf"
    export(qwen_ckpt, out, "--manifest", "--experts", "per-expert", "--hash", "blake3")
    man = load_manifest(out / "manifest.json")
    assert man.algorithm == "blake3"
    assert {e.ident: e.digest for e in man.entries} == {
        (k, (at,)): d for (k, at), d in _independent_extents(out, man.algorithm).items()
    }
    assert verify_safetensors_manifest(out, man) == []


def test_a_changed_byte_and_a_dropped_tensor_are_named(llama_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(llama_ckpt, src)
    made = write_manifest(src)  # the source has a manifest: its digest is recorded too
    out = tmp_path / "hf"
    summary = export(src, out, "--manifest")
    assert summary["source_identity"]["manifest_digest"] == made.digest
    man = load_manifest(out / "manifest.json")
    e = max(man.entries, key=lambda e: e.length)
    with open(out / e.file, "r+b") as f:
        f.seek(e.offset + e.length // 2)
        b = f.read(1)
        f.seek(e.offset + e.length // 2)
        f.write(bytes([b[0] ^ 0x40]))
    res = runner.invoke(app, ["manifest", str(out), "--verify", "--json"])
    assert res.exit_code == 1, res.stdout
    doc = json.loads(res.stdout)
    assert not doc["ok"] and [p["kind"] for p in doc["problems"]] == ["changed"]
    assert doc["problems"][0]["key"] == e.key
    # a manifest that lost a tensor's entries: the tensor is stored but not covered
    other = tmp_path / "partial.json"
    raw = json.loads((out / "manifest.json").read_text())
    raw["entries"] = [x for x in raw["entries"] if x["key"] != e.key]
    other.write_text(json.dumps(raw))
    res = runner.invoke(app, ["manifest", str(out), "--verify", "--output", str(other)])
    assert res.exit_code == 1 and "extra" in res.stdout and e.key in res.stdout


def test_import_of_an_export_traces_back_through_its_manifest(llama_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """DCP -> export --manifest -> import --manifest: the import names the export's manifest; dcp.load reads it."""
    import torch.distributed.checkpoint as dcp

    from ckpttool.format import CheckpointReader
    from ckpttool.ops.manifest import build_manifest

    hf = tmp_path / "hf"
    export(llama_ckpt, hf, "--manifest")
    out = tmp_path / "ckpt"
    res = runner.invoke(app, ["import", str(hf), str(out), "--world-size", "2", "--manifest", "--json"])
    assert res.exit_code == 0, res.stderr
    ident = json.loads(res.stdout)["source_identity"]
    assert ident["manifest_digest"] == digest_bytes((hf / "manifest.json").read_bytes(), ident["algorithm"])
    written = load_manifest(out / "manifest.json")
    assert written.source == ident
    with CheckpointReader(out) as r:
        read = build_manifest(r, written.algorithm, covers="record")
        ours = {k: r.read_tensor(k) for k in r.metadata.entries if k.startswith("model.")}
    assert [e.to_dict() for e in written.entries] == [e.to_dict() for e in read.entries]
    assert (written.metadata_digest, written.metadata_size) == (read.metadata_digest, read.metadata_size)
    assert runner.invoke(app, ["manifest", str(out), "--verify"]).exit_code == 0
    sd = {k: torch.zeros_like(v) for k, v in ours.items()}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(sd[k], ours[k]) for k in ours)


def test_extents_with_a_gap_are_refused_even_when_their_lengths_add_up(llama_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "hf"
    export(llama_ckpt, out, "--manifest", "--shard-size", "20KB")
    raw = json.loads((out / "manifest.json").read_text())
    e = max(raw["entries"], key=lambda x: x["length"])
    half = e["length"] // 2
    # two extents of the same bytes: [0, half) twice stands in for the whole tensor (a gap at the end)
    twin = {**e, "offsets": [half], "offset": e["offset"], "length": e["length"] - half, "sizes": [e["length"] - half]}
    e.update(length=half, sizes=[half])
    raw["entries"].append(twin)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    res = runner.invoke(app, ["manifest", str(out), "--verify", "--output", str(bad)])
    assert res.exit_code == 1 and "do not tile" in res.stdout


def test_a_digest_that_would_not_be_used_or_is_unknown_is_refused_before_any_work(
    dense_ckpt: Path, tmp_path: Path
) -> None:
    """Two `--hash` values went unchecked: `export --dry-run --manifest --hash md6` printed a plan that would write a
    manifest (exit 0) while the same export refuses the digest (E100); `import --hash blake3` without `--manifest`
    (and `--hash md6`) imported with exit 0, the digest ignored, as import records no source identity without its
    manifest. Both are E100 before anything is written; export's `--hash` alone still digests the source identity."""
    hf, out = tmp_path / "hf", tmp_path / "ckpt"

    def refused(args: list[str], line: str) -> None:
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines()[0] == f"error: [E100] {line}", res.stderr
        assert not Path(args[2]).exists()  # the output: nothing written

    unknown = "--hash 'md6' is not one of xxh3-128, blake3, blake2b-256"
    for dry in ([], ["--dry-run"]):
        refused(["export", str(dense_ckpt), str(hf), "--manifest", "--hash", "md6", *dry], unknown)
    doc = export_json(["export", str(dense_ckpt), str(hf), "--hash", "blake3", "--json"])
    assert doc["manifest"] is None and doc["source_identity"]["algorithm"] == "blake3"
    for dry in ([], ["--dry-run"]):
        refused(["import", str(hf), str(out), "--hash", "md6", *dry], unknown)
        refused(
            ["import", str(hf), str(out), "--hash", "blake3", *dry],
            "--hash blake3 is given without --manifest: import digests nothing else, so it would be ignored",
        )
    doc = export_json(["import", str(hf), str(out), "--hash", "blake3", "--manifest", "--json"])
    assert doc["manifest"] is not None and load_manifest(out / "manifest.json").algorithm == "blake3"


def export_json(args: list[str]) -> dict:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)
