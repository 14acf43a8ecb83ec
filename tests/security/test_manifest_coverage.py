"""Integrity manifests cover everything that changes what a reader gets (round 3, class 1).

Each attack of the red-team round, on real saves: a ``data.pkl`` stride swapped from ``(32, 1)``
to ``(1, 32)`` with the CRC-32s fixed (torch's ``dcp.load`` then gives the transpose), an edited
``layout.json``, a shard added to an HF export with its index redirected, an edited
``config.json``. Each passed ``manifest --verify`` and ``validate --manifest`` before; each now
fails both, while the untouched copies still pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.hostile import swap_stride_fixing_crcs

runner = CliRunner()
SQUARE = "model.model.layers.0.self_attn.q_proj.weight"  # [32, 32] float32, one chunk


def _ok(*argv: str) -> None:
    res = runner.invoke(app, list(argv))
    assert res.exit_code == 0, res.stdout + res.stderr


def _verify_fails(d: Path, *, validate: bool = True) -> None:
    res = runner.invoke(app, ["manifest", str(d), "--verify"])
    assert res.exit_code == 1 and "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    if validate:
        res = runner.invoke(app, ["validate", str(d), "--manifest", str(d / "manifest.json")])
        assert res.exit_code != 0 and "E999" not in res.stdout + res.stderr, res.stdout + res.stderr


@pytest.mark.parametrize("made_by", ["manifest --covers record", "reshard --manifest"])
def test_a_stride_swap_with_crcs_fixed_is_found(sample_ckpt: Path, tmp_path: Path, made_by: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    if made_by == "manifest --covers record":
        d = tmp_path / "d"
        shutil.copytree(sample_ckpt, d)
        _ok("manifest", str(d), "--covers", "record")
    else:
        d = tmp_path / "r"
        _ok("reshard", str(sample_ckpt), str(d), "--to", "canonical", "--with-optimizer", "--manifest")
    _ok("manifest", str(d), "--verify")
    before = {SQUARE: torch.empty(32, 32)}
    dcp.load(before, checkpoint_id=str(d), no_dist=True)
    swap_stride_fixing_crcs(d, SQUARE)
    after = {SQUARE: torch.empty(32, 32)}
    dcp.load(after, checkpoint_id=str(d), no_dist=True)  # torch reads it without complaint: the transpose
    assert torch.equal(after[SQUARE], before[SQUARE].T) and not torch.equal(after[SQUARE], before[SQUARE])
    _verify_fails(d)


def test_an_edited_layout_json_is_found(sample_ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "d"
    shutil.copytree(sample_ckpt, d)
    from ckpttool.format.reader import CheckpointReader

    with CheckpointReader(d) as r:  # the sample's embedded layout record, as the layout.json sidecar a trainer writes
        (d / "layout.json").write_text(r.read_object("layout"))
    _ok("manifest", str(d))
    _ok("manifest", str(d), "--verify")
    original = (d / "layout.json").read_text()
    doc = json.loads(original)
    # the same record written differently: opening accepts it (it agrees with the embedded one); the manifest does not
    (d / "layout.json").write_text(json.dumps(doc, indent=2))
    _verify_fails(d)
    doc["version"] = 1 if doc.get("version") != 1 else 2  # the attack: experts permuted on export
    (d / "layout.json").write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(d), "--verify"])
    assert res.exit_code in (1, 2) and "E999" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_an_added_sidecar_file_is_found(sample_ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "d"
    shutil.copytree(sample_ckpt, d)
    _ok("manifest", str(d))
    (d / "extra_state" / "extra_state_rank_9.pt").write_bytes(
        (d / "extra_state" / "extra_state_rank_0.pt").read_bytes()
    )
    _verify_fails(d)


def test_an_added_file_named_by_a_stored_chunks_entry_is_still_found(sample_ckpt: Path, tmp_path: Path) -> None:
    """A hostile manifest cannot hide an added file by writing its name into a stored chunk's ``file``: the
    chunk's data file is the one ``.metadata`` names, and the added file is still ``extra``."""
    d = tmp_path / "d"
    shutil.copytree(sample_ckpt, d)
    _ok("manifest", str(d))
    added = "extra_state/extra_state_rank_9.pt"
    (d / added).write_bytes((d / "extra_state" / "extra_state_rank_0.pt").read_bytes())
    doc = json.loads((d / "manifest.json").read_text())
    doc["entries"][0]["file"] = added
    (d / "manifest.json").write_text(json.dumps(doc))
    _verify_fails(d)
    res = runner.invoke(app, ["manifest", str(d), "--verify"])
    assert f"extra    {added}: a file the manifest does not list" in res.stdout, res.stdout


@pytest.fixture
def hf_export(sample_ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "hf"
    _ok(
        "export",
        str(sample_ckpt),
        str(out),
        "--shard-size",
        "100KB",
        "--manifest",
        "--model-assets",
        str(sample_ckpt / "model_assets"),
    )
    _ok("manifest", str(out), "--verify")
    return out


def test_an_added_shard_and_a_redirected_index_are_found(hf_export: Path) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((hf_export / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    key = next((k for k in wm if k.endswith("lm_head.weight")), next(iter(wm)))
    src = hf_export / index["weight_map"][key]
    t = load_file(str(src))[key]
    save_file({key: t * 0 + 7}, str(hf_export / "model-00003-of-00003.safetensors"), metadata={"format": "pt"})
    index["weight_map"][key] = "model-00003-of-00003.safetensors"
    (hf_export / "model.safetensors.index.json").write_text(json.dumps(index))
    _verify_fails(hf_export)


def test_validate_checks_an_export_against_its_own_manifest(hf_export: Path, sample_ckpt: Path) -> None:
    """``validate --manifest`` of an export's manifest compares files, headers and extents as ``manifest --verify``
    does (it compared them as DCP chunks: every tensor of an intact export was 'missing')."""
    _ok("validate", str(hf_export), "--manifest", str(hf_export / "manifest.json"))


@pytest.mark.parametrize("command", ["manifest --verify", "validate --manifest"])
@pytest.mark.parametrize("made_of", ["dcp", "export"])
def test_a_manifest_of_another_kind_of_checkpoint_is_one_error(
    hf_export: Path, sample_ckpt: Path, tmp_path: Path, command: str, made_of: str
) -> None:
    """A DCP checkpoint's manifest checked against its safetensors export gave ~180 problems (every entry missing,
    every tensor extra), an export's on the DCP checkpoint one per file; now one E260 naming both kinds and a hint."""
    if made_of == "dcp":
        man, target = tmp_path / "dcp-manifest.json", hf_export
        _ok("manifest", str(sample_ckpt), "-o", str(man))
        said = f"{man} is the manifest of a DCP checkpoint (its .metadata digested), but {hf_export} is a safetensors"
    else:
        man, target = hf_export / "manifest.json", sample_ckpt
        said = (
            f"{man} is the manifest of a safetensors export (export --manifest), but {sample_ckpt} is a DCP checkpoint"
        )
    argv = ["manifest", str(target), "--verify", "-o", str(man)]
    if command == "validate --manifest":
        argv = ["validate", str(target), "--manifest", str(man)]
    res = runner.invoke(app, argv)
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and res.stdout == "" and len(lines) == 2, res.stdout + res.stderr
    assert lines[0].startswith(f"error: [E260] {said}"), lines
    assert lines[1].startswith(f"hint: verify {target} against a manifest made of it (`ckpttool manifest {target}`")


def test_a_manifest_of_a_safetensors_folder_on_a_dcp_checkpoint_is_one_error(sample_ckpt: Path, tmp_path: Path) -> None:
    """The manifest of a Hugging Face safetensors folder (its headers digested) on a DCP checkpoint: one E260."""
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"lm_head.weight": torch.randn(8, 4)}, str(hf / "model.safetensors"))
    _ok("manifest", str(hf))
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--verify", "-o", str(hf / "manifest.json")])
    assert res.exit_code == 2 and res.stdout == "", res.stdout + res.stderr
    assert res.stderr.startswith(
        f"error: [E260] {hf / 'manifest.json'} is the manifest of a safetensors model folder (its headers digested), "
        f"but {sample_ckpt} is a DCP checkpoint (with .metadata)\n"
    ), res.stderr


def test_an_edited_config_json_is_found(hf_export: Path) -> None:
    cfg = json.loads((hf_export / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (hf_export / "config.json").write_text(json.dumps(cfg))
    _verify_fails(hf_export)


@pytest.mark.heavy  # CI time
def test_a_manifest_of_many_one_byte_extents_is_bounded_and_grouped(hf_export: Path) -> None:
    """300,000 one-byte extents took 86 s and 560 MB and printed 300,033 lines; now one problem per file, not read
    (100,000 here: the bound does not depend on the count)."""
    doc = json.loads((hf_export / "manifest.json").read_text())
    first = doc["entries"][0]
    doc["entries"] = [
        {**first, "offsets": [i], "sizes": [1], "offset": first["offset"] + i, "length": 1} for i in range(100_000)
    ] + [e for e in doc["entries"] if e["file"] != first["file"]]
    (hf_export / "manifest.json").write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(hf_export), "--verify"])
    assert res.exit_code == 1, res.stdout + res.stderr
    assert "100,000 extents" in res.stdout and len(res.stdout.splitlines()) <= 60, res.stdout[-3000:]
    res = runner.invoke(app, ["manifest", str(hf_export), "--verify", "--json"])
    out = json.loads(res.stdout)
    assert len(out["problems"]) <= 1000 and sum(out["problem_counts"].values()) >= 1


@pytest.mark.parametrize("field", ["offset", "length"])
def test_an_extent_past_its_tensor_is_changed_not_a_damaged_file(hf_export: Path, field: str) -> None:
    """A hostile manifest's extent beyond the end of the file is the manifest's problem (``changed``, exit 1),
    not read, and never reported as a truncated export (E300)."""
    doc = json.loads((hf_export / "manifest.json").read_text())
    entry = doc["entries"][0]
    entry[field] = 10**18
    (hf_export / "manifest.json").write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(hf_export), "--verify"])
    assert res.exit_code == 1 and "E300" not in res.stderr, res.stdout + res.stderr
    assert f"{entry['key']!r} in {entry['file']}: the manifest's extent at byte" in res.stdout, res.stdout
    assert "lies outside the tensor's bytes; not read" in res.stdout, res.stdout
    _verify_fails(hf_export)


@pytest.mark.parametrize(
    ("listing", "name", "said"),
    [
        ("sidecars", "../../etc/hostname", "is not a file name inside the directory"),
        ("sidecars", "/etc/hostname", "is not a file name inside the directory"),
        ("sidecars", "./layout.json", "is not a file name inside the directory"),
        ("training_state", "../secret.txt", "is not a file name inside the directory"),
        ("sidecars", None, "is listed twice"),
    ],
)
def test_a_hostile_sidecar_listing_is_an_unusable_manifest(
    sample_ckpt: Path, tmp_path: Path, listing: str, name: str | None, said: str
) -> None:
    """A sidecar named outside the directory or listed twice is a malformed manifest (E260, exit 2), not a
    ``missing`` file that is on disk."""
    d = tmp_path / "d"
    shutil.copytree(sample_ckpt, d)
    _ok("manifest", str(d))
    doc = json.loads((d / "manifest.json").read_text())
    first = doc["sidecars"][0]
    doc.setdefault(listing, []).append(dict(first) if name is None else {**first, "file": name})
    (d / "manifest.json").write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(d), "--verify"])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("error: [E260] ") and said in lines[0], res.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), res.stderr


@pytest.mark.parametrize("command", ["manifest --verify", "validate --manifest"])
def test_a_checkpoints_own_manifest_symlinked_outside_is_refused(
    sample_ckpt: Path, tmp_path: Path, command: str
) -> None:
    """``DIR/manifest.json`` is part of the untrusted checkpoint: a symlink out of it is E101, never read
    (it was followed: a manifest kept outside the checkpoint verified it, exit 0)."""
    d = tmp_path / "d"
    shutil.copytree(sample_ckpt, d)
    _ok("manifest", str(d))
    outside = tmp_path / "outside.json"
    (d / "manifest.json").rename(outside)
    (d / "manifest.json").symlink_to(outside)
    argv = ["manifest", str(d), "--verify"] if command == "manifest --verify" else ["validate", str(d), "--manifest"]
    res = runner.invoke(app, argv)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 2, res.stdout + res.stderr
    assert lines[0].startswith("error: [E101] ") and "manifest 'manifest.json' resolves outside" in lines[0]
    assert lines[1].startswith("hint: ")
    res = runner.invoke(app, ["manifest", str(d), "--verify", "--output", str(outside)])  # named by the user: read
    assert res.exit_code == 0, res.stdout + res.stderr


def test_a_symlink_beside_the_data_pointed_elsewhere_is_found(sample_ckpt: Path, tmp_path: Path) -> None:
    """A symlink beside a checkpoint's data (``config.json -> configs/a.json``) was listed as ``"symlink"`` and
    nothing else: pointing it at another file (what a loader then reads) still "matched its manifest"; the
    manifest records the digest of the link's target text, so the change is found (never followed). A manifest
    of the older form (``"symlink"``, size 0) still verifies."""
    d = shutil.copytree(sample_ckpt, tmp_path / "ckpt")
    (d / "configs").mkdir()
    (d / "configs" / "a.json").write_text('{"lr": 1}')
    (d / "configs" / "b.json").write_text('{"lr": 2}')
    (d / "config.json").symlink_to("configs/a.json")
    _ok("manifest", str(d))
    doc = json.loads((d / "manifest.json").read_text())
    (link,) = [f for f in doc["sidecars"] if f["file"] == "config.json"]
    assert link["digest"].startswith("symlink:") and link["size"] == len("configs/a.json"), link
    _ok("manifest", str(d), "--verify")
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("configs/b.json")
    res = runner.invoke(app, ["manifest", str(d), "--verify"])
    assert res.exit_code == 1 and "changed  config.json: differs from the manifest" in res.stdout, res.stdout
    link.update(digest="symlink", size=0)  # as an older ckpttool wrote it: any symlink there matches
    (d / "manifest.json").write_text(json.dumps(doc))
    _ok("manifest", str(d), "--verify")


@pytest.mark.parametrize("file", ["../../etc/passwd", "/etc/passwd", "", "a/../../x.distcp"])
@pytest.mark.parametrize("command", ["manifest --verify", "validate --manifest"])
def test_an_entry_file_outside_the_checkpoint_is_an_unusable_manifest(
    sample_ckpt: Path, tmp_path: Path, file: str, command: str
) -> None:
    """An entry whose ``file`` is absolute or leaves the folder still 'matched' (digests were compared by key, the
    place never looked at): it is hostile input, E260 naming the entry, exit 2."""
    man = tmp_path / "m.json"
    _ok("manifest", str(sample_ckpt), "-o", str(man))
    doc = json.loads(man.read_text())
    doc["entries"][0]["file"] = file
    man.write_text(json.dumps(doc))
    argv = ["manifest", str(sample_ckpt), "--verify", "-o", str(man)]
    if command == "validate --manifest":
        argv = ["validate", str(sample_ckpt), "--manifest", str(man), "--select", "S015"]
    res = runner.invoke(app, argv)
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and res.stdout == "" and len(lines) == 2, res.stdout + res.stderr
    assert lines[0].startswith("error: [E260] ") and f"entries[0] ('{doc['entries'][0]['key']}'): file " in lines[0]
    assert "is not a file name inside the directory" in lines[0] and lines[1].startswith("hint: "), lines


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("offset", 10**15, "offset 1000000000000000"),
        ("length", 10**15, "length 1000000000000000"),
        ("offset", 0, "offset 0"),
        ("file", "extra_state/extra_state_rank_0.pt", "file 'extra_state/extra_state_rank_0.pt'"),
    ],
)
def test_an_entry_placed_elsewhere_than_the_checkpoint_says_is_changed(
    sample_ckpt: Path, tmp_path: Path, field: str, value: object, said: str
) -> None:
    """A manifest's ``file``/``offset``/``length`` were never compared with the checkpoint's ``.metadata``: one edited
    to 10^15 (or another file) 'matched'. Each entry's window is now the one ``.metadata`` holds, or a ``changed``
    problem naming the entry, the field and both values (exit 1 in ``manifest --verify`` and S015)."""
    man = tmp_path / "m.json"
    _ok("manifest", str(sample_ckpt), "-o", str(man))
    _ok("manifest", str(sample_ckpt), "--verify", "-o", str(man))  # an untouched manifest still matches
    doc = json.loads(man.read_text())
    entry = doc["entries"][3]
    was = entry[field]
    assert was != value
    entry[field] = value
    man.write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--verify", "-o", str(man), "--json"])
    assert res.exit_code == 1, res.stdout + res.stderr
    problems = json.loads(res.stdout)["problems"]
    shown = f"'{was}'" if isinstance(was, str) else str(was)
    assert [(p["kind"], p["key"]) for p in problems] == [("changed", entry["key"])], problems
    assert problems[0]["message"].endswith(f": the manifest says {said}; the checkpoint's metadata {shown}")
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--manifest", str(man), "--select", "S015", "--json"])
    found = json.loads(res.stdout)["findings"]
    assert res.exit_code == 1 and [(f["code"], f["key"]) for f in found] == [("S015", entry["key"])], res.stdout
    assert said in found[0]["message"]


def test_an_export_manifest_extent_of_a_file_it_does_not_list_is_an_unusable_manifest(hf_export: Path) -> None:
    """An extent naming a file that is not in the manifest's ``files`` was never read (only listed files are):
    the manifest contradicts itself, E260."""
    doc = json.loads((hf_export / "manifest.json").read_text())
    doc["entries"][0]["file"] = "other.safetensors"
    (hf_export / "manifest.json").write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(hf_export), "--verify"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E260] "), res.stdout + res.stderr
    assert "entries[0]" in res.stderr and "file 'other.safetensors' is not in its files" in res.stderr


def test_a_version_1_manifest_still_verifies(sample_ckpt: Path, tmp_path: Path) -> None:
    """A manifest of an older ckpttool (version 1: no ``covers``, ``kind`` or ``sidecars``) that agrees with the
    checkpoint still matches: the storage windows it records are the ones ``.metadata`` holds."""
    man = tmp_path / "m.json"
    _ok("manifest", str(sample_ckpt), "-o", str(man))
    doc = json.loads(man.read_text())
    doc["version"] = 1
    for key in ("kind", "sidecars", "training_state"):
        doc.pop(key, None)
    for e in doc["entries"]:
        e.pop("covers")
    man.write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--verify", "-o", str(man)])
    assert res.exit_code == 0 and "matches its manifest" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("covers", ["window", "record"])
def test_an_edited_crc32_or_metadata_size_is_found(sample_ckpt: Path, tmp_path: Path, covers: str) -> None:
    """An entry's ``crc32`` and ``metadata.size`` were never compared with the checkpoint: edited to other values
    they still 'matched'. Now each is a problem naming the entry (or ``.metadata``) and both values; a ``crc32``
    left out (``null``, as an older manifest may have it) is still accepted."""
    man = tmp_path / "m.json"
    _ok("manifest", str(sample_ckpt), "-o", str(man), "--covers", covers)
    doc = json.loads(man.read_text())
    entry = next(e for e in doc["entries"] if e["crc32"] is not None)
    was = entry["crc32"]
    entry["crc32"] = "00000000" if was != "00000000" else "00000001"
    doc["metadata"]["size"] += 1
    man.write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--verify", "-o", str(man), "--json"])
    assert res.exit_code == 1, res.stdout + res.stderr
    got = [(p["kind"], p["key"], p["message"]) for p in json.loads(res.stdout)["problems"]]
    size = doc["metadata"]["size"] - 1
    assert got == [
        (
            "changed",
            entry["key"],
            f"{entry['key']!r} chunk at {entry['offsets']}: the manifest says crc32 "
            f"{entry['crc32']}; its storage record's zip entry {was}",
        ),
        ("metadata", ".metadata", f"the manifest says .metadata is {size + 1} bytes, not {size}"),
    ], got
    entry["crc32"] = None
    doc["metadata"]["size"] = size
    man.write_text(json.dumps(doc))
    _ok("manifest", str(sample_ckpt), "--verify", "-o", str(man))


def test_a_huge_key_or_file_name_in_a_manifest_is_shortened_in_its_problem_lines(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """A manifest (up to 256 MiB) may name an entry by a 5 MB key or a sidecar by a 100 kB name: each problem line
    printed the whole of it (a 5 MB line); they are shortened to ~200 characters, the JSON keeps the values."""
    m = tmp_path / "m.json"
    _ok("manifest", str(sample_ckpt), "-o", str(m))
    doc = json.loads(m.read_text())
    doc["entries"][0]["key"] = "k" * 5_000_000
    doc["sidecars"].append({"file": "f" * 100_000, "size": 1, "digest": doc["sidecars"][0]["digest"]})
    m.write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--verify", "-o", str(m)])
    assert res.exit_code == 1, res.output[:2000]
    lines = res.output.splitlines()
    assert any(
        ln.startswith("missing  'kkkk") and ln.endswith("is in the manifest but not in the checkpoint") for ln in lines
    )
    assert any(ln.startswith("missing  ffff") and ln.endswith("...: in the manifest, not on disk") for ln in lines)
    assert max(len(ln) for ln in lines) < 400, max(len(ln) for ln in lines)
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--verify", "-o", str(m), "--json"])
    assert "k" * 5_000_000 in [p["key"] for p in json.loads(res.stdout)["problems"]]


def test_a_file_added_as_manifest_json_is_found_by_a_manifest_kept_outside(sample_ckpt: Path, tmp_path: Path) -> None:
    """A manifest kept outside the checkpoint (``--output``) said "matches" after any bytes were added under the name
    ``manifest.json`` (skipped as the checkpoint's own manifest, unread). Only a manifest ckpttool can read is
    skipped there; anything else is a file like any other: ``extra``. A real manifest written there is not."""
    d, outside = tmp_path / "d", tmp_path / "kept.json"
    shutil.copytree(sample_ckpt, d)
    _ok("manifest", str(d), "--output", str(outside))
    (d / "manifest.json").write_bytes(b'{"format":"ckpttool.manifest",' + bytes(range(256)) * 64)
    res = runner.invoke(app, ["manifest", str(d), "--verify", "--output", str(outside)])
    assert res.exit_code == 1, res.stdout + res.stderr
    assert "extra    manifest.json: a file the manifest does not list (added)" in res.stdout, res.stdout
    res = runner.invoke(app, ["validate", str(d), "--manifest", str(outside)])
    assert res.exit_code != 0 and "manifest.json" in res.stdout, res.stdout + res.stderr
    (d / "manifest.json").unlink()
    _ok("manifest", str(d))  # the checkpoint's own manifest beside the one kept outside: no change to the data
    _ok("manifest", str(d), "--verify", "--output", str(outside))
    _ok("manifest", str(d), "--verify")
