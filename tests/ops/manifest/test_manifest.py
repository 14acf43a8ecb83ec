"""`ckpttool manifest` and `validate --manifest` (rule S015) on real dcp.save checkpoints, and hostile manifests."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from ckpttool.format import CheckpointReader
from ckpttool.format.digest import ALGORITHMS
from ckpttool.ops.manifest import ManifestOptions, load_manifest, verify_manifest, write_manifest
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


def invoke(*args: object) -> Any:
    return runner.invoke(app, [*map(str, args)])


def s015(ckpt: Path, manifest: Path) -> list[dict[str, Any]]:
    res = invoke("validate", ckpt, "--manifest", manifest, "--select", "S015", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == (1 if doc["findings"] else 0), res.stderr
    return [f for f in doc["findings"] if f["code"] == "S015"]


def test_manifest_lists_every_chunk_and_byte_item_with_crc_and_digest(fsdp_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    res = invoke("manifest", ck, "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("manifest"))
    man = json.loads((ck / "manifest.json").read_text())
    assert man["format"] == "ckpttool.manifest" and man["version"] == 2 and man["algorithm"] == "xxh3-128"
    with CheckpointReader(ck) as r:
        want = {(k, tuple(c.offsets)) for k, m in r.metadata.entries.items() if hasattr(m, "chunks") for c in m.chunks}
        want |= {(k, None) for k, m in r.metadata.entries.items() if not hasattr(m, "chunks")}
        e = next(e for e in man["entries"] if e["offsets"] and e["sizes"] and all(e["sizes"]))
        info = r.storage_info(
            e["key"], r.metadata.entries[e["key"]].chunks[0].__class__(tuple(e["offsets"]), tuple(e["sizes"]))
        )
        loc = r.locate(
            e["key"], r.metadata.entries[e["key"]].chunks[0].__class__(tuple(e["offsets"]), tuple(e["sizes"]))
        )
    got = {(e["key"], tuple(e["offsets"]) if e["offsets"] is not None else None) for e in man["entries"]}
    assert got == want and doc["entries"] == len(want)
    # the window is the storage entry's, the CRC-32 the zip entry's, the digest that of the window's bytes
    assert (e["file"], e["offset"], e["length"]) == (info.relative_path, info.offset, info.length)
    assert e["crc32"] == f"{loc.record.crc32:08x}"
    import xxhash

    with open(ck / e["file"], "rb") as f:
        f.seek(e["offset"])
        assert e["digest"] == xxhash.xxh3_128(f.read(e["length"])).hexdigest()
    assert s015(ck, ck / "manifest.json") == []


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_round_trips(dense_ckpt: Path, tmp_path: Path, algorithm: str) -> None:
    out = tmp_path / "m.json"
    res = write_manifest(dense_ckpt, ManifestOptions(out=out, algorithm=algorithm))
    assert res.algorithm == algorithm and res.bytes_hashed > 0
    man = load_manifest(out)
    with CheckpointReader(dense_ckpt) as r:
        assert verify_manifest(r, man) == []
    assert list(dense_ckpt.glob("manifest*")) == []  # the source is not touched with --output


def _resave(src: Path, out: Path, edit: Any) -> Path:
    with CheckpointReader(src) as r:
        sd = {
            k.removeprefix("model."): r.read_tensor(k)
            for k, m in r.metadata.entries.items()
            if k.startswith("model.") and hasattr(m, "chunks")
        }
    edit(sd)
    dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    return out


def test_changed_missing_and_added_chunks_are_named(dense_ckpt: Path, tmp_path: Path) -> None:
    a = _resave(dense_ckpt, tmp_path / "a", lambda sd: None)
    write_manifest(a, ManifestOptions(algorithm="xxh3-128"))
    man = a / "manifest.json"
    key = "model.model.layers.0.mlp.up_proj.weight"

    def change(sd: dict[str, torch.Tensor]) -> None:
        sd[key.removeprefix("model.")][1, 2] += 1

    def drop(sd: dict[str, torch.Tensor]) -> None:
        del sd["model.norm.weight"]

    def add(sd: dict[str, torch.Tensor]) -> None:
        sd["extra.bias"] = torch.zeros(3)

    for name, edit, kind, k in (
        ("changed", change, "changed", key),
        ("missing", drop, "missing", "model.model.norm.weight"),
        ("added", add, "extra", "model.extra.bias"),
    ):
        b = _resave(dense_ckpt, tmp_path / name, edit)
        found = s015(b, man)
        chunk = [f for f in found if f["key"] == k]
        assert len(chunk) == 1 and chunk[0]["message"].startswith(f"{kind}: '{k}'"), found
        others = {f["key"] for f in found} - {k}
        assert others <= {".metadata"}, found  # nothing else named, besides the re-written .metadata
    # bytes flipped in place (no re-save): the chunk is named, the rest is not
    c = copy_checkpoint(a, tmp_path / "flip")
    man_doc = json.loads(man.read_text())
    e = next(e for e in man_doc["entries"] if e["key"] == key)
    with open(c / e["file"], "r+b") as f:
        f.seek(e["offset"] + e["length"] - 200)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    found = s015(c, man)
    assert [(f["key"], f["message"].split(":")[0]) for f in found] == [(key, "changed")]


def test_validate_without_manifest_skips_s015(dense_ckpt: Path) -> None:
    res = invoke("validate", dense_ckpt, "--json")
    doc = json.loads(res.stdout)
    st = next(r for r in doc["rules"] if r["code"] == "S015")
    assert st["status"] == "skipped" and "--manifest" in st["reason"]


@pytest.mark.parametrize(
    "content, code",
    [
        (b"not json", "E260"),
        (b'{"format": "other", "version": 1}', "E260"),
        (b'{"format": "ckpttool.manifest", "version": 99, "algorithm": "xxh3-128", "entries": []}', "E260"),
        (b'{"format": "ckpttool.manifest", "version": 1, "algorithm": "md5", "entries": []}', "E260"),
        (b'{"format": "ckpttool.manifest", "version": 1, "algorithm": [], "entries": []}', "E260"),
        (b'{"format": "ckpttool.manifest", "version": 2, "algorithm": {"a": 1}, "entries": []}', "E260"),
        (b'{"format": "ckpttool.manifest", "version": 2, "algorithm": "xxh3-128", "kind": [], "entries": []}', "E260"),
        (b'{"format": "ckpttool.manifest", "version": 1, "algorithm": "xxh3-128", "entries": [{"key": 1}]}', "E260"),
        (b"[" * 100_000 + b"]" * 100_000, "E309"),
        (
            b'{"format": "ckpttool.manifest", "version": 2, "algorithm": "xxh3-128", "entries": [], "data_files": 1}',
            "E260",
        ),
        (
            b'{"format": "ckpttool.manifest", "version": 2, "algorithm": "xxh3-128", "entries": [], '
            b'"data_files": [{"file": "../x", "size": 1}]}',
            "E260",
        ),
        (
            b'{"format": "ckpttool.manifest", "version": 2, "algorithm": "xxh3-128", "entries": [], '
            b'"data_files": [{"file": "a", "size": 1}, {"file": "a", "size": 2}]}',
            "E260",
        ),
        (
            b'{"format": "ckpttool.manifest", "version": 2, "algorithm": "xxh3-128", "entries": [], '
            b'"data_files": [{"file": "a", "size": -1}]}',
            "E260",
        ),
    ],
)
def test_hostile_manifests_are_refused_with_one_error(
    dense_ckpt: Path, tmp_path: Path, content: bytes, code: str
) -> None:
    bad = tmp_path / "manifest.json"
    bad.write_bytes(content)
    res = invoke("validate", dense_ckpt, "--manifest", bad)
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith(f"error: [{code}]"), res.stderr
    assert "Traceback" not in res.stderr


def test_a_manifest_naming_a_key_twice_is_refused(dense_ckpt: Path, tmp_path: Path) -> None:
    """``{"sidecars": [...], ..., "sidecars": []}``: json.loads kept the last, so the manifest said two things and
    --verify checked the one another reader (first key wins) would not; a key given twice is now E260."""
    man = tmp_path / "m.json"
    assert invoke("manifest", dense_ckpt, "--output", man).exit_code == 0
    text = man.read_text()
    assert '"sidecars":[]' in text
    man.write_text(text.replace("{", '{"sidecars":[{"file":"notes.txt","size":1,"digest":"00"}],', 1))
    res = invoke("manifest", dense_ckpt, "--verify", "--output", man)
    assert res.exit_code == 2 and res.stdout == "", res.stdout + res.stderr
    assert res.stderr.startswith(f"error: [E260] {man}: not a ckpttool manifest (duplicate key 'sidecars')"), res.stderr


def test_oversized_manifest_is_refused_before_reading(dense_ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "manifest.json"
    with open(bad, "wb") as f:
        f.truncate(2 << 20)
    res = invoke("--max-object-size", "1MiB", "validate", dense_ckpt, "--manifest", bad)
    assert res.exit_code == 2 and "over the cap" in res.stderr, res.stderr


@pytest.mark.parametrize("covers", ["window", "record"])
def test_a_record_failing_its_crc_gets_no_manifest(dense_ckpt: Path, tmp_path: Path, covers: str) -> None:
    """A value bit flipped in a dcp.save record (its zip CRC-32 left as saved): writing a manifest of it
    would certify damaged bytes; E308 names the file and key, nothing is written."""
    from tests.fixtures.damage import flip_value_bit

    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    key = next(k for k, v in CheckpointReader(ck).metadata.entries.items() if hasattr(v, "chunks") and v.numel > 100)
    flip_value_bit(ck, key)
    if covers == "window":  # the command's
        res = runner.invoke(app, ["manifest", str(ck)])
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.startswith(f"error: [E308] {ck}/") and f"{key!r} chunk at" in res.stderr, res.stderr
        assert "storage record fails its CRC-32 check" in res.stderr
    else:  # what reshard --manifest computes
        from ckpttool.errors import ChecksumError

        with pytest.raises(ChecksumError, match="storage record fails its CRC-32 check"):
            write_manifest(ck, ManifestOptions(covers="record"))
    assert not (ck / "manifest.json").exists()


def test_a_dtype_changed_in_a_safetensors_header_is_a_problem(tmp_path: Path) -> None:
    # the manifest of a safetensors folder digested the data windows only: a header whose dtype
    # was rewritten (F32 -> I32, same bytes, same sizes) verified as "matches"

    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"lm_head.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}, str(hf / "model.safetensors"))
    res = invoke("manifest", hf)
    assert res.exit_code == 0, res.stderr
    doc = json.loads((hf / "manifest.json").read_text())
    assert doc["metadata"]["file"] == "safetensors headers" and doc["metadata"]["size"] > 8
    assert invoke("manifest", hf, "--verify").exit_code == 0
    data = bytearray((hf / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    head = data[8 : 8 + n].decode()
    new = head.replace('"lm_head.weight":{"dtype":"F32"', '"lm_head.weight":{"dtype":"I32"', 1)
    assert new != head and len(new) == len(head)
    data[8 : 8 + n] = new.encode()
    (hf / "model.safetensors").write_bytes(bytes(data))
    res = invoke("manifest", hf, "--verify")
    assert res.exit_code == 1, res.stdout
    assert res.stdout.splitlines()[0] == "metadata safetensors headers differ from the ones the manifest was made of"
    assert [f["key"] for f in s015(hf, hf / "manifest.json")] == ["safetensors headers"]


def test_bytes_appended_to_a_hugging_face_folders_file_are_a_change_not_e200(tmp_path: Path) -> None:
    """`ckpttool manifest` of a save_pretrained folder (kind dcp, its headers digested): a byte appended to
    model.safetensors made `manifest --verify` stop with E200 (exit 2: the reader refuses the file, as safetensors
    does) instead of the verdict the manifest exists for. Now it is `changed`, naming the file (exit 1), and every
    entry is still checked: a flipped byte in a tensor is named too."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tests.fixtures import hf_models

    hf = tmp_path / "hf"
    hf_models.tiny_tied_model("gpt2").save_pretrained(hf)
    assert invoke("manifest", hf).exit_code == 0
    assert json.loads((hf / "manifest.json").read_text())["kind"] == "dcp"
    assert invoke("manifest", hf, "--verify").exit_code == 0
    shard = hf / "model.safetensors"
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(SafetensorError):
        load_file(str(shard))
    res = invoke("manifest", hf, "--verify", "--json")
    assert res.exit_code == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert [(p["kind"], p["key"]) for p in doc["problems"]] == [("changed", "model.safetensors")]
    assert f"the file has {size + 1:,} bytes" in doc["problems"][0]["message"]
    data = bytearray(shard.read_bytes())
    with shard.open("rb") as f:  # one bit of transformer.wte.weight's data
        n = struct.unpack("<Q", f.read(8))[0]
        start = json.loads(f.read(n))["transformer.wte.weight"]["data_offsets"][0]
    data[8 + n + start] ^= 1
    shard.write_bytes(bytes(data))
    res = invoke("manifest", hf, "--verify", "--json")
    assert res.exit_code == 1
    got = [(p["kind"], p["key"]) for p in json.loads(res.stdout)["problems"]]
    assert got == [("changed", "transformer.wte.weight"), ("changed", "model.safetensors")], got


def test_bytes_appended_to_an_exported_safetensors_file_are_a_problem(dense_ckpt: Path, tmp_path: Path) -> None:
    # an export's manifest digests the header and each tensor's extents: a byte appended after the last
    # tensor was in no extent, and `manifest --verify` said "matches" of a file safetensors' loader refuses
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    res = invoke("export", dense_ckpt, out, "--manifest")
    assert res.exit_code == 0, res.stderr
    assert invoke("manifest", out, "--verify").exit_code == 0
    shard = out / "model.safetensors"
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(SafetensorError, match="not fully covered"):
        load_file(str(shard))
    res = invoke("manifest", out, "--verify", "--json")
    assert res.exit_code == 1, res.stdout
    doc = json.loads(res.stdout)
    assert [(p["kind"], p["key"]) for p in doc["problems"]] == [("changed", "model.safetensors")]
    assert f"the file has {size + 1:,} bytes" in doc["problems"][0]["message"]
    res = invoke("validate", out, "--manifest", out / "manifest.json")  # its reader refuses the file, as safetensors
    assert res.exit_code == 2 and "[E200]" in res.stderr and "unaccounted bytes" in res.stderr


def test_an_exported_safetensors_file_cut_short_names_its_extents(dense_ckpt: Path, tmp_path: Path) -> None:
    # a shard cut short stopped `manifest --verify` of an export with E300 and no verdict (exit 2), where a DCP
    # data file cut short is a problem per entry (exit 1): each extent the file no longer holds is now `changed`
    out = tmp_path / "hf"
    assert invoke("export", dense_ckpt, out, "--manifest").exit_code == 0
    man = load_manifest(out / "manifest.json")
    shard = out / "model.safetensors"
    last = max(man.entries, key=lambda e: e.offset)
    shard.write_bytes(shard.read_bytes()[: last.offset + 1])  # the last tensor's extent loses all but one byte
    res = invoke("manifest", out, "--verify", "--json")
    assert res.exit_code == 1, res.output
    problems = json.loads(res.stdout)["problems"]
    assert [(p["kind"], p["key"]) for p in problems] == [("changed", last.key)]
    assert f"the file ({last.offset + 1:,} bytes) ends before them (cut short)" in problems[0]["message"]


def test_verify_names_what_the_folder_is_not_the_manifest_format(tmp_path: Path) -> None:
    """`manifest --verify` of a Hugging Face safetensors folder printed "(dcp)": the manifest of a folder has the
    DCP manifest's entries, but the folder is no DCP checkpoint (no .metadata). The label names the folder;
    --json keeps `kind`, the manifest's format."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"lm_head.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}, str(hf / "model.safetensors"))
    assert invoke("manifest", hf).exit_code == 0
    res = invoke("manifest", hf, "--verify")
    assert (
        res.exit_code == 0
        and res.stdout == f"{hf} (safetensors) matches its manifest {hf / 'manifest.json'} (2 entries)\n"
    )
    assert json.loads(invoke("manifest", hf, "--verify", "--json").stdout)["kind"] == "dcp"


def test_verify_names_a_pair_of_dcp_folders_dcp(acc_root: Path, tmp_path: Path) -> None:
    """An Accelerate ``checkpoint-N/`` (``pytorch_model_fsdp_0/`` and ``optimizer_0/``, two DCP checkpoints) was
    labelled ``(safetensors)`` by ``manifest --verify``: the step directory has no ``.metadata`` of its own."""
    import shutil

    step = shutil.copytree(acc_root / "accelerate" / "checkpoint-1", tmp_path / "checkpoint-1")
    out = tmp_path / "m.json"
    assert invoke("manifest", step, "-o", out).exit_code == 0
    res = invoke("manifest", step, "--verify", "-o", out)
    assert res.exit_code == 0 and res.stdout.startswith(f"{step} (dcp) matches its manifest {out} "), res.stdout


def test_bytes_appended_to_a_dcp_data_file_are_a_problem(dense_ckpt: Path, tmp_path: Path) -> None:
    # the entries digest the chunk windows: a byte appended after the last one was in none of them, and
    # `manifest --verify` said "matches" of a data file other than the one the manifest was made of
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    assert invoke("manifest", ck).exit_code == 0
    data = ck / "__0_0.distcp"
    size = data.stat().st_size
    assert json.loads((ck / "manifest.json").read_text())["data_files"] == [{"file": "__0_0.distcp", "size": size}]
    with CheckpointReader(ck) as r:  # the windows end where the file does: torch's writer leaves no byte uncovered
        assert max(r.storage_info(k, c).offset + r.storage_info(k, c).length for k, c in _chunks(r)) == size
    with open(data, "ab") as f:
        f.write(b"\0")
    res = invoke("manifest", ck, "--verify", "--json")
    assert res.exit_code == 1, res.stdout
    problems = json.loads(res.stdout)["problems"]
    assert [(p["kind"], p["key"]) for p in problems] == [("changed", "__0_0.distcp")]
    assert f"the file has {size + 1:,} bytes, the manifest recorded {size:,}" in problems[0]["message"]
    assert [f["key"] for f in s015(ck, ck / "manifest.json")] == ["__0_0.distcp"]
    # a manifest of an older ckpttool (no data_files) still verifies what it lists
    old = json.loads((ck / "manifest.json").read_text())
    del old["data_files"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert invoke("manifest", ck, "--verify", "-o", tmp_path / "old.json").exit_code == 0


def _chunks(r: CheckpointReader) -> list[tuple[str, Any]]:
    return [(k, c) for k, m in r.metadata.entries.items() for c in getattr(m, "chunks", (None,))]


def test_a_manifest_is_not_written_as_another_checkpoints_own(dense_ckpt: Path, tmp_path: Path) -> None:
    # `manifest A -o B/manifest.json` replaced checkpoint B's own manifest (one ckpttool wrote) by A's: B then
    # "differed from its manifest" in every entry. Another checkpoint's manifest place is refused, B's kept
    a = copy_checkpoint(dense_ckpt, tmp_path / "a")
    b = copy_checkpoint(dense_ckpt, tmp_path / "b")
    assert invoke("manifest", b).exit_code == 0
    kept = (b / "manifest.json").read_bytes()
    hf = tmp_path / "hf"
    assert invoke("export", dense_ckpt, hf, "--manifest").exit_code == 0
    exported = (hf / "manifest.json").read_bytes()
    for target in (b / "manifest.json", hf / "manifest.json"):
        res = invoke("manifest", a, "-o", target)
        assert res.exit_code == 2 and res.stderr.startswith(f"error: [E600] manifest {target}: is the place of"), (
            res.stderr
        )
    assert (b / "manifest.json").read_bytes() == kept and (hf / "manifest.json").read_bytes() == exported
    assert invoke("manifest", b, "--verify").exit_code == 0
    (b / "manifest.json").unlink()  # none there yet: A's would still pass for B's own
    assert invoke("manifest", a, "-o", b / "manifest.json").exit_code == 2 and not (b / "manifest.json").exists()
    assert invoke("manifest", a, "-o", tmp_path / "manifest.json").exit_code == 0  # a folder of no checkpoint


def test_verify_lists_the_entries_of_a_deleted_or_cut_data_file(sample_ckpt: Path, tmp_path: Path) -> None:
    """A data file deleted (or cut short) after the manifest was written: each of its entries is a problem
    (missing / changed) and the verdict is exit 1, not an E300 stop with no verdict."""
    for damage in ("delete", "truncate"):
        ck = copy_checkpoint(sample_ckpt, tmp_path / damage)
        assert invoke("manifest", ck).exit_code == 0
        data = ck / "__0_0.distcp"
        if damage == "delete":
            data.unlink()
        else:
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        res = invoke("manifest", ck, "--verify", "--json")
        assert res.exit_code == 1, res.output
        problems = json.loads(res.stdout)["problems"]
        kinds = {p["kind"] for p in problems}
        assert kinds == ({"missing"} if damage == "delete" else {"changed"}), kinds
        if damage == "delete":
            assert len(problems) == len(load_manifest(ck / "manifest.json").entries)
            assert problems[0]["message"].endswith("in __0_0.distcp: its data file is missing")
        else:
            assert all("truncated?" in p["message"] for p in problems)


def test_validate_reads_the_checkpoints_own_manifest_given_as_empty(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """`ValidateOptions(manifest="")`: the library finds the manifest beside the opened checkpoint's .metadata
    (a directory: its manifest.json), as `validate --manifest` without a value does (a URL's:
    tests/cli/test_remote_storage.py)."""
    from ckpttool.ops.validate import ValidateOptions, validate

    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    write_manifest(ck, ManifestOptions())
    for given in ("", ck):
        res = validate(ck, ValidateOptions(manifest=given, select=("S015",)))
        assert {s.rule.code: s.status for s in res.rules}["S015"] == "passed" and res.exit_code == 0


def test_verify_with_a_manifest_without_sidecars_names_the_files_it_did_not_check(
    fsdp_ckpt: Path, tmp_path: Path
) -> None:
    """A manifest without ``sidecars`` (an older ckpttool's, or one with the list cut out) cannot vouch for
    ``layout.json`` or an added file: --verify said "matches" over files it never read; it now names them."""
    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    (ck / "layout.json").write_text('{"format": "ckpttool.layout", "version": 2}\n')
    assert invoke("manifest", ck).exit_code == 0
    doc = json.loads((ck / "manifest.json").read_text())
    assert [f["file"] for f in doc.pop("sidecars")] == ["layout.json"]
    (ck / "manifest.json").write_text(json.dumps(doc))
    (ck / "layout.json").write_text('{"format": "ckpttool.layout", "version": 2, "parallel": {"ep_size": 4}}\n')
    (ck / "added.pt").write_bytes(b"x")
    res = invoke("manifest", ck, "--verify")
    assert res.exit_code == 0, res.stderr  # the chunks match; the files beside them are unknown, not "changed"
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "2 files there not checked (added.pt, layout.json)" in warning[0], res.stderr
    assert "matches" in res.stdout and "not checked" in res.stdout
    res = invoke("manifest", ck, "--verify", "--json")
    got = json.loads(res.stdout)
    jsonschema.validate(got, load_schema("manifest-check"))
    assert got["ok"] and len(got["warnings"]) == 1 and "added.pt, layout.json" in got["warnings"][0]
    # A manifest with its sidecars (every one this ckpttool writes) checks them: no warning.
    assert invoke("manifest", ck).exit_code == 0
    res = invoke("manifest", ck, "--verify", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["warnings"] == [] and "warning" not in res.stderr


def test_validate_manifest_without_sidecars_warns_S016(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """`validate --manifest` with a manifest without ``sidecars`` said OK (S015 checks the data only) over a file
    added beside the data that nothing read; S016 now names it (a warning: `--strict` fails)."""
    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    assert invoke("manifest", ck).exit_code == 0
    res = invoke("validate", ck, "--manifest", "--strict", "--json")
    assert res.exit_code == 0 and "S016" not in {f["code"] for f in json.loads(res.stdout)["findings"]}, res.stdout
    doc = json.loads((ck / "manifest.json").read_text())
    doc.pop("sidecars")
    (ck / "manifest.json").write_text(json.dumps(doc))
    (ck / "notes.txt").write_text("kept beside the data\n")
    res = invoke("validate", ck, "--manifest", "--json")
    s016 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "S016"]
    assert res.exit_code == 0 and len(s016) == 1 and s016[0]["severity"] == "warning", res.stdout
    assert s016[0]["message"].endswith("lists no files beside the data; 1 there not checked: notes.txt")
    assert invoke("validate", ck, "--manifest", "--strict").exit_code == 1


def test_a_manifest_without_data_file_sizes_names_the_bytes_it_did_not_check(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """A manifest without ``data_files`` (an older ckpttool's, or the list cut out) cannot see bytes appended to a
    data file after its last chunk: --verify and `validate --manifest` said "matches"/OK in silence, unlike a
    manifest without ``sidecars``. Both now say which data files' sizes were not checked (a warning, exit 0)."""
    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    assert invoke("manifest", ck).exit_code == 0
    doc = json.loads((ck / "manifest.json").read_text())
    files = [f["file"] for f in doc.pop("data_files")]
    (ck / "manifest.json").write_text(json.dumps(doc))
    with open(ck / files[0], "ab") as f:
        f.write(b"appended after the last chunk")
    res = invoke("manifest", ck, "--verify")
    assert res.exit_code == 0, res.stderr  # every chunk matches; the bytes after them are unknown, not "changed"
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "records no data file sizes" in warning[0] and files[0] in warning[0], res.stderr
    assert "matches" in res.stdout and "not checked" in res.stdout
    res = invoke("validate", ck, "--manifest", "--json")
    s016 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "S016"]
    assert len(s016) == 1 and "records no data file sizes" in s016[0]["message"], res.stdout
    assert files[0] in s016[0]["message"]
    assert invoke("manifest", ck).exit_code == 0  # a manifest of this ckpttool records them: no warning
    res = invoke("manifest", ck, "--verify", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["warnings"] == [] and "warning" not in res.stderr


def test_a_data_files_list_leaving_a_data_file_out_names_the_bytes_it_did_not_check(
    fsdp_ckpt: Path, tmp_path: Path
) -> None:
    """A manifest whose ``data_files`` leaves a data file out (edited: ckpttool records every one) cannot see bytes
    appended to that file after its last chunk: --verify said "matches" and `validate --manifest` OK in silence, while
    a manifest with no ``data_files`` at all got a warning. Both now name the file (a warning, exit 0), and the
    appended bytes are outside every window torch's reader reads."""
    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    assert invoke("manifest", ck).exit_code == 0
    doc = json.loads((ck / "manifest.json").read_text())
    kept = [f for f in doc["data_files"] if f["file"] != "__2_0.distcp"]
    assert len(kept) == len(doc["data_files"]) - 1
    doc["data_files"] = kept
    (ck / "manifest.json").write_text(json.dumps(doc))
    want = {"model": {"lm_head.weight": torch.zeros(32, 16)}}  # rows 16..23 are in __2_0.distcp
    dcp.load(want, checkpoint_id=str(fsdp_ckpt))
    with open(ck / "__2_0.distcp", "ab") as f:
        f.write(b"appended after the last chunk")
    got = {"model": {"lm_head.weight": torch.zeros(32, 16)}}
    dcp.load(got, checkpoint_id=str(ck))  # torch's reader: the same values, the appended bytes in no window
    assert torch.equal(got["model"]["lm_head.weight"], want["model"]["lm_head.weight"])
    res = invoke("manifest", ck, "--verify")
    assert res.exit_code == 0, res.stderr
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "leaves data files out of its data_files (edited)" in warning[0], res.stderr
    assert "1 file not checked after their last chunk (__2_0.distcp)" in warning[0], res.stderr
    assert "matches" in res.stdout and "not checked" in res.stdout
    res = invoke("manifest", ck, "--verify", "--json")
    assert json.loads(res.stdout)["warnings"] == [warning[0][len("warning: ") :]], res.stdout
    res = invoke("validate", ck, "--manifest", "--json")
    s016 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "S016"]
    assert len(s016) == 1 and s016[0]["message"].endswith(
        "leaves data files out of data_files; bytes after the last chunk of 1 not checked: __2_0.distcp"
    ), res.stdout
    assert invoke("validate", ck, "--manifest", "--strict").exit_code == 1


def test_bytes_hashed_counts_the_files_beside_the_data(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """The files beside the data (an optimizer ``.pt``, ``trainer_state.json``) are digested whole, yet
    ``bytes_hashed`` counted the chunks alone: a 2 GiB ``optim.pt`` beside 15 KiB of chunks printed "15.2 KiB
    hashed ... 1.93 kB/s" after hashing for seconds. It now counts every byte digested."""
    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    (ck / "optim.pt").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (ck / "trainer_state.json").write_text('{"global_step": 7}\n')
    res = invoke("manifest", ck, "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads((ck / "manifest.json").read_text())
    chunks = sum(e["length"] for e in doc["entries"])
    beside = sum(f["size"] for f in doc["sidecars"])
    assert beside == (1 << 20) + len('{"global_step": 7}\n')
    assert json.loads(res.stdout)["bytes_hashed"] == chunks + beside


def test_verify_with_a_manifest_whose_metadata_digest_is_cut_out_does_not_pass(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """``"metadata": null`` (a model/optimizer pair's) in the manifest of a checkpoint with a ``.metadata``:
    --verify said "matches" over a dtype changed in .metadata (every window intact, the values reinterpreted)."""
    from tests.fixtures.metadata_edit import load_md, save_md

    ck = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    assert invoke("manifest", ck).exit_code == 0
    doc = json.loads((ck / "manifest.json").read_text())
    assert doc["metadata"]["file"] == ".metadata"
    doc["metadata"] = None
    (ck / "manifest.json").write_text(json.dumps(doc))
    md = load_md(ck)
    key, meta = next((k, m) for k, m in md.state_dict_metadata.items() if getattr(m, "properties", None) is not None)
    assert meta.properties.dtype == torch.float32
    meta.properties.dtype = torch.int32
    save_md(ck, md)
    res = invoke("manifest", ck, "--verify", "--json")
    assert res.exit_code == 1, res.stdout
    got = json.loads(res.stdout)
    assert not got["ok"] and [(p["kind"], p["key"]) for p in got["problems"]] == [("metadata", ".metadata")]
    assert "records no digest of .metadata" in got["problems"][0]["message"]


def test_verify_names_a_rank_local_dcp_save_dcp_not_safetensors(ep_suite: Path, tmp_path: Path) -> None:
    """dcp.save(..., use_collectives=False) writes __R.metadata and no .metadata: the verdict called it safetensors."""
    ck = copy_checkpoint(ep_suite / "legacy_rank_local", tmp_path / "c")
    assert not (ck / ".metadata").exists() and (ck / "__0.metadata").is_file()
    assert invoke("manifest", ck).exit_code == 0
    res = invoke("manifest", ck, "--verify")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith(f"{ck} (dcp) matches its manifest"), res.stdout


# ------------------------------------------------------------------------ interrupted while the manifest is written
INTERRUPTED = r"""
import os, runpy, signal, sys
sig = getattr(signal, sys.argv.pop(1))
real_fsync = os.fsync
def fsync(fd):
    os.kill(os.getpid(), sig)  # arrives while manifest.json's temporary file is synced, before its rename
    real_fsync(fd)
os.fsync = fsync
runpy.run_module("ckpttool", run_name="__main__")
"""


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_manifest_interrupted_while_written_leaves_nothing_in_the_checkpoint(
    signum: str, ep_suite: Path, tmp_path: Path
) -> None:
    """Ctrl-C or SIGTERM while manifest.json was written left its temporary file in the checkpoint (SIGTERM:
    killed, exit 143): a reshard output holding it was no longer provably ckpttool's (`--overwrite`: E606)."""
    import hashlib
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    assert invoke("reshard", ep_suite / "p4f1", out, "--to", "canonical").exit_code == 0

    def tree() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}

    before = tree()
    res = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, signum, "manifest", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert (res.returncode, res.stderr.strip()) == (130, "error: interrupted"), (res.returncode, res.stderr)
    assert tree() == before  # no manifest.json, no temporary file beside it
    again = invoke("reshard", ep_suite / "p4f1", out, "--to", "canonical", "--overwrite")
    assert again.exit_code == 0, again.stderr


def test_a_manifest_interrupted_while_written_leaves_no_folder_it_made(dense_ckpt: Path, tmp_path: Path) -> None:
    """``--output`` in folders that do not exist yet: Ctrl-C while the file was written left them behind."""
    import os
    import subprocess
    import sys

    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    res = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, "SIGINT", "manifest", str(ck), "-o", str(tmp_path / "new/a/m.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert (res.returncode, res.stderr.strip()) == (130, "error: interrupted"), (res.returncode, res.stderr)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_manifest_of_a_run_root_names_a_newer_unfinished_save(dense_ckpt: Path, tmp_path: Path) -> None:
    """`manifest RUN --step latest` digested step 1 while step 2's save had not finished, without a word (stats,
    export, reshard and validate's R001 name it); a warning now does, on stderr and in the JSON warnings."""
    copy_checkpoint(dense_ckpt, tmp_path / "run" / "step-1")
    newer = copy_checkpoint(dense_ckpt, tmp_path / "run" / "step-2")
    (newer / ".metadata").unlink()  # the data files of a save whose coordinator never wrote .metadata
    res = runner.invoke(app, ["manifest", str(tmp_path / "run"), "--step", "latest"])
    assert res.exit_code == 0, res.output
    assert f"wrote {tmp_path / 'run' / 'step-1' / 'manifest.json'}" in res.stdout
    assert "a newer step's save did not finish: step 2" in res.stderr and "digested step 1" in res.stderr
    doc = json.loads(runner.invoke(app, ["manifest", str(tmp_path / "run"), "--step", "latest", "--json"]).stdout)
    assert len(doc["warnings"]) == 1 and "step 2" in doc["warnings"][0] and "(R001)" in doc["warnings"][0]
    assert not (newer / "manifest.json").exists()
    clean = json.loads(runner.invoke(app, ["manifest", str(tmp_path / "run" / "step-1"), "--json"]).stdout)
    assert clean["warnings"] == []


def test_verify_of_a_run_root_names_a_newer_unfinished_save(dense_ckpt: Path, tmp_path: Path) -> None:
    """`manifest RUN --step latest` warned that step 2's save had not finished (R001), `manifest RUN --step latest
    --verify` said only "matches", its JSON `warnings` empty: the verdict covered step 1, not the run's newest save.
    Verify warns as the write does, on stderr, in the verdict line and in the JSON."""
    run = tmp_path / "run"
    copy_checkpoint(dense_ckpt, run / "step-1")
    newer = copy_checkpoint(dense_ckpt, run / "step-2")
    (newer / ".metadata").unlink()  # the data files of a save whose coordinator never wrote .metadata
    assert invoke("manifest", run / "step-1").exit_code == 0
    res = runner.invoke(app, ["manifest", str(run), "--step", "latest", "--verify"])
    assert res.exit_code == 0, res.output
    assert "a newer step's save did not finish: step 2" in res.stderr and "verified step 1" in res.stderr
    assert "matches its manifest" in res.stdout and "a newer step's save did not finish (see the warning)" in res.stdout
    assert "files beside the data" not in res.stdout
    doc = json.loads(runner.invoke(app, ["manifest", str(run), "--step", "latest", "--verify", "--json"]).stdout)
    assert doc["ok"] is True and len(doc["warnings"]) == 1 and "(R001)" in doc["warnings"][0], doc
    clean = json.loads(runner.invoke(app, ["manifest", str(run / "step-1"), "--verify", "--json"]).stdout)
    assert clean["warnings"] == []


def test_verify_of_the_latest_step_opens_the_step_whose_manifest_it_read(
    dense_ckpt: Path, fsdp_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`manifest --verify RUN --step latest` located the latest step twice, for the manifest and to open the
    checkpoint: a save finishing in between (step 2, here right after the manifest's step was located) checked
    step 1's manifest against step 2's data, every chunk "changed". The step located once is the one opened."""
    import ckpttool.model.discovery as discovery

    run = tmp_path / "run"
    copy_checkpoint(dense_ckpt, run / "step-1")
    assert invoke("manifest", run / "step-1").exit_code == 0
    real, calls = discovery.locate, []

    def locate_then_save(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        calls.append(found.step)
        if len(calls) == 1:  # another rank's save of step 2 completes now
            copy_checkpoint(fsdp_ckpt, run / "step-2")
        return found

    monkeypatch.setattr(discovery, "locate", locate_then_save)
    res = invoke("manifest", run, "--step", "latest", "--verify", "--json")
    assert calls == [1], calls
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["path"] == str(run / "step-1") and doc["problems"] == [], doc


def test_check_against_manifest_takes_an_opened_checkpoint(dense_ckpt: Path, tmp_path: Path) -> None:
    """Every operation takes an opened ``Checkpoint`` or a path (README, "Library"); ``check_against_manifest(ckpt)``
    ended in ``TypeError: expected str, bytes or os.PathLike object, not Checkpoint``. It verifies the opened
    checkpoint against the manifest ``write_manifest`` writes for it, as for its path, and names a changed chunk the
    same way; ``opening`` beside an opened checkpoint, or a closed one, is E100."""
    import ckpttool
    from ckpttool.errors import UsageError
    from ckpttool.model.checkpoint import OpenOptions, open_checkpoint

    a = copy_checkpoint(dense_ckpt, tmp_path / "a")
    write_manifest(a)
    by_path = ckpttool.check_against_manifest(a).to_dict()
    with open_checkpoint(a) as ck:
        opened = ckpttool.check_against_manifest(ck).to_dict()
        with pytest.raises(UsageError) as e:
            ckpttool.check_against_manifest(ck, opening=OpenOptions(trust_pickle=True))
        assert e.value.code == "E100"
    assert opened == by_path and opened["ok"] is True
    with pytest.raises(UsageError, match="the checkpoint was closed"):
        ckpttool.check_against_manifest(ck)
    man = json.loads((a / "manifest.json").read_text())
    e0 = next(e for e in man["entries"] if e["key"].startswith("model.") and e["length"] > 400)
    with open(a / e0["file"], "r+b") as f:
        f.seek(e0["offset"] + e0["length"] - 200)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with open_checkpoint(a) as ck:
        changed = ckpttool.check_against_manifest(ck).to_dict()
    assert changed == ckpttool.check_against_manifest(a).to_dict() and changed["ok"] is False
    assert [p["key"] for p in changed["problems"]] == [e0["key"]]


def test_verify_refuses_hash_and_covers_it_would_ignore(dense_ckpt: Path, tmp_path: Path) -> None:
    """`manifest --verify` checks with the digest and coverage its manifest records, and took a `--hash` or
    `--covers` silently: `--verify --hash blake3` over an xxh3-128 manifest passed as if checked with a
    cryptographic digest, and a typo (`--hash md6`, refused when writing) passed with exit 0. Both are E100 now;
    the manifest's own algorithm still verifies (--json names it)."""
    man = tmp_path / "m.json"
    assert invoke("manifest", dense_ckpt, "-o", man).exit_code == 0
    assert json.loads(man.read_text())["algorithm"] == "xxh3-128"
    for extra, named in (
        (["--hash", "blake3"], "--hash blake3"),
        (["--hash", "md6"], "--hash md6"),
        (["--covers", "record"], "--covers record"),
    ):
        res = invoke("manifest", dense_ckpt, "--verify", "-o", man, *extra)
        assert res.exit_code == 2 and res.stdout == "", res.output
        lines = res.stderr.splitlines()
        assert (
            lines[0]
            == f"error: [E100] {named} given with --verify, which checks with the digest and coverage its manifest records"
        )
        assert lines[1].startswith("hint: drop it") and len(lines) == 2
    res = invoke("manifest", dense_ckpt, "--verify", "-o", man, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["algorithm"] == "xxh3-128"
    # writing still takes both, and verifying reads them back from the manifest
    assert invoke("manifest", dense_ckpt, "-o", man, "--hash", "blake3", "--covers", "record").exit_code == 0
    res = invoke("manifest", dense_ckpt, "--verify", "-o", man, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["algorithm"] == "blake3"
    assert "record" in {e.get("covers") for e in json.loads(man.read_text())["entries"]}


def test_a_data_files_list_naming_a_file_no_entry_is_stored_in_is_refused(dense_ckpt: Path, tmp_path: Path) -> None:
    """``data_files`` records the size of each file the entries' windows lie in. Edited to name a file no entry is
    stored in (and that is not on disk), --verify said "matches" and exited 0: the manifest contradicts itself and is
    now refused (E260), naming the list item. A recorded size smaller than the file is the verify's ``changed``."""
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    assert invoke("manifest", ck).exit_code == 0
    doc = json.loads((ck / "manifest.json").read_text())
    good = json.dumps(doc)
    doc["data_files"].append({"file": "__9_0.distcp", "size": 12})
    (ck / "manifest.json").write_text(json.dumps(doc))
    for args in (["manifest", ck, "--verify"], ["validate", ck, "--manifest"]):
        res = invoke(*args)
        assert res.exit_code == 2 and res.stdout == "", res.stdout
        assert res.stderr.startswith("error: [E260]"), res.stderr
        assert "data_files[1] ('__9_0.distcp') is a file no entry is stored in" in res.stderr, res.stderr
    doc = json.loads(good)
    doc["data_files"][0]["size"] = 100
    (ck / "manifest.json").write_text(json.dumps(doc))
    res = invoke("manifest", ck, "--verify", "--json")
    problems = json.loads(res.stdout)["problems"]
    assert res.exit_code == 1 and [(p["kind"], p["key"]) for p in problems] == [("changed", "__0_0.distcp")]


def test_bytes_removed_after_the_last_window_are_a_problem(dense_ckpt: Path, tmp_path: Path) -> None:
    """A data file that held bytes after its last window when the manifest was made (appended by another tool), and
    lost them since: every entry's window is intact, and --verify said "matches" of a file other than the one the
    manifest was made of. Its size is now ``changed``, as bytes appended after the manifest are."""
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    data = ck / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "ab") as f:
        f.write(b"trailing bytes no window covers")
    assert invoke("manifest", ck).exit_code == 0
    os.truncate(data, size)
    res = invoke("manifest", ck, "--verify", "--json")
    assert res.exit_code == 1, res.stdout
    problems = json.loads(res.stdout)["problems"]
    assert [(p["kind"], p["key"]) for p in problems] == [("changed", "__0_0.distcp")]
    assert (
        f"31 byte(s) after the data removed since the manifest was made (the file has {size:,} bytes"
        in problems[0]["message"]
    )
    assert [f["key"] for f in s015(ck, ck / "manifest.json")] == ["__0_0.distcp"]
