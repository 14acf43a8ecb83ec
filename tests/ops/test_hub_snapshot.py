"""Hugging Face hub snapshots: every file of ``models--ORG--NAME/snapshots/REV/`` is a symlink to ``../../blobs/X``.

The cache is laid out as ``huggingface_hub`` lays it out, and ``huggingface_hub``'s own
``scan_cache_dir`` and ``try_to_load_from_cache`` are asked to recognise it first. A link into the
repository's own ``blobs/`` is read; any other link leaving the snapshot is still ``E101``.
References: torch's ``dcp.load`` into the transformers model (logits), ``safetensors``' reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="session")
def hf_dirs(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "import_hf_dirs", hf_models.build_hf_dirs)


def hub_snapshot(src: Path, cache: Path, repo_id: str = "tiny/llama") -> Path:
    """``src``'s files as the hub cache keeps them: blobs named by their sha256, relative links in the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REV
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    for f in sorted(src.iterdir()):
        if f.name == "reference.pt":  # the test's logits, not a file of the model repository
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        os.symlink(f"../../blobs/{digest}", snap / f.name)
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    (info,) = scan_cache_dir(cache).repos
    assert info.repo_id == repo_id and {r.commit_hash for r in info.revisions} == {REV}
    assert try_to_load_from_cache(repo_id, "config.json", cache_dir=cache) == str(snap / "config.json")
    return snap


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, res.output
    return res.output


def test_import_of_a_hub_snapshot_loads_with_identical_logits(hf_dirs: Path, tmp_path: Path) -> None:
    import transformers

    src = hf_dirs / "llama"  # sharded: model.safetensors.index.json and its shards are links too
    snap = hub_snapshot(src, tmp_path / "hub")
    doc = json.loads(cli("import", str(snap), str(tmp_path / "dcp"), "--json"))
    assert doc["tensors"] > 0
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(src))
    hf_models.assert_dcp_logits(model, tmp_path / "dcp", src / "reference.pt")


def test_every_reader_of_a_hf_folder_reads_a_hub_snapshot(hf_dirs: Path, tmp_path: Path) -> None:
    src = hf_dirs / "llama"
    snap = hub_snapshot(src, tmp_path / "hub")
    assert "OK:" in cli("validate", "--strict", str(snap))
    assert "equal" in cli("diff", str(src), str(snap))
    cli("import", str(src), str(tmp_path / "dcp"))
    assert "OK:" in cli("validate", "--strict", str(tmp_path / "dcp"), "--against", str(snap))
    cli("export", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--model-assets", str(snap))
    written = tmp_path / "hf" / "generation_config.json"  # copied as it is (config.json gets its dtype set)
    assert not written.is_symlink() and written.read_bytes() == (src / "generation_config.json").read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize("where", ["outside", "other-repo", "not-a-hub-cache"])
def test_a_link_out_of_the_snapshots_own_blobs_is_still_refused(hf_dirs: Path, tmp_path: Path, where: str) -> None:
    src = hf_dirs / "llama"
    snap = hub_snapshot(src, tmp_path / "hub")
    shard = next(p for p in sorted(snap.iterdir()) if p.name.endswith(".safetensors"))
    if where == "not-a-hub-cache":  # the same layout under a folder the hub would not name models--*
        plain = tmp_path / "hub" / "copies"
        os.rename(snap.parent.parent, plain)
        snap = plain / "snapshots" / REV
    else:
        target = tmp_path / "elsewhere" if where == "outside" else tmp_path / "hub" / "models--x--y" / "blobs"
        target.mkdir(parents=True)
        shutil.copyfile(shard.resolve(), target / "blob")
        shard.unlink()
        os.symlink(os.path.relpath(target / "blob", snap), shard)
    for args in (("validate", "--strict", str(snap)), ("import", str(snap), str(tmp_path / "dcp"))):
        out = cli(*args, code=2)
        assert "[E101]" in out and "resolves outside" in out, out
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_snapshot_link_whose_blob_is_gone_is_a_missing_shard_not_damage(
    hf_dirs: Path, tmp_path: Path, command: str
) -> None:
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    shard = next(p for p in sorted(snap.iterdir()) if p.name.endswith(".safetensors"))
    shard.resolve().unlink()  # the blob deleted from the cache, the snapshot's link left behind
    args = [command, str(snap)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    assert "[E202]" in out and f"{shard.name}: links to '../../blobs/" in out and "which does not exist" in out, out
    assert "hint: the file the link points to is missing" in out and ".metadata" not in out, out
    assert "Traceback" not in out and not (tmp_path / "dcp").exists()


def test_validate_of_a_snapshot_whose_blob_is_gone_says_a_file_is_missing(hf_dirs: Path, tmp_path: Path) -> None:
    """The rules skipped beside S001's E202 said `(the save did not finish)` under a hint to download the complete
    model: the model was saved whole, a file of it is gone."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    shard = next(p for p in sorted(snap.iterdir()) if p.name.endswith(".safetensors"))
    shard.resolve().unlink()
    out = cli("validate", str(snap), code=2)
    assert "skipped (a file of the model is missing)" in out and "did not finish" not in out, out


def test_import_of_the_hub_repository_folder_names_its_snapshot(hf_dirs: Path, tmp_path: Path) -> None:
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    (snap.parent / ("f" * 40)).mkdir()  # an older revision beside it: refs/main chooses
    repo = snap.parent.parent
    out = cli("import", str(repo), str(tmp_path / "dcp"), code=2)
    assert "[E200]" in out and f"pass its snapshot, {snap}" in out.replace("\n", ""), out
    assert not (tmp_path / "dcp").exists()


def test_import_of_the_hub_repositorys_blobs_names_its_snapshot(hf_dirs: Path, tmp_path: Path) -> None:
    """`blobs/` holds the snapshot's files under their hashes: the import said to pass a folder holding
    model*.safetensors; it now names the snapshot that names them, as for the repository folder."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    out = cli("import", str(snap.parent.parent / "blobs"), str(tmp_path / "dcp"), code=2)
    assert "[E200]" in out and f"pass its snapshot, {snap}" in out.replace("\n", ""), out
    assert "the blobs of a Hugging Face hub repository" in out.replace("\n", " "), out
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("command", ["inspect", "validate", "stats"])
def test_a_hub_repository_folder_of_two_revisions_names_the_one_refs_main_names(
    hf_dirs: Path, tmp_path: Path, command: str
) -> None:
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    older = snap.parent / ("0" * 40)  # sorts first: an example taken from the listing would name it
    shutil.copytree(snap, older, symlinks=True)
    out = cli(command, str(snap.parent.parent), code=2).replace("\n", "")
    assert "[E204]" in out and f"pass one of them, e.g. {snap} (the snapshot refs/main names)" in out, out


def test_import_of_the_hub_cache_root_names_a_models_snapshot(hf_dirs: Path, tmp_path: Path) -> None:
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    out = cli("import", str(tmp_path / "hub"), str(tmp_path / "dcp"), code=2)
    assert "[E200]" in out and f"a Hugging Face hub cache: pass the snapshot of one model, {snap}" in out.replace(
        "\n", ""
    ), out
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("given", ["repo", "cache"])
def test_export_model_assets_of_a_hub_folder_above_the_snapshot_is_refused(
    hf_dirs: Path, tmp_path: Path, given: str
) -> None:
    """The files are in the snapshot: the repository folder holds none, so the export would have no config.json
    (a note once advised copying one into the hub cache)."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    cli("import", str(snap), str(tmp_path / "dcp"))
    assets = snap.parent.parent if given == "repo" else tmp_path / "hub"
    out = cli("export", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--model-assets", str(assets), code=2)
    assert "--model-assets holds no config.json" in out and str(snap) in out.replace("\n", ""), out
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("option", ["--against", "--config"])
def test_validate_reference_of_a_hub_repository_folder_names_its_snapshot(
    hf_dirs: Path, tmp_path: Path, option: str
) -> None:
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    cli("import", str(snap), str(tmp_path / "dcp"))
    out = cli("validate", "--strict", str(tmp_path / "dcp"), option, str(snap.parent.parent), code=2)
    assert "[E100]" in out and f"pass its snapshot, {snap}" in out.replace("\n", ""), out
    assert "OK:" in cli("validate", "--strict", str(tmp_path / "dcp"), option, str(snap))


def test_export_with_a_hub_snapshot_as_assets_never_advises_writing_into_the_cache(
    hf_dirs: Path, tmp_path: Path
) -> None:
    """The tokenizer note once ended 'copy the tokenizer of the base model into it': into the snapshot, a folder
    huggingface_hub manages. The files belong in the export."""
    src = tmp_path / "notok"
    shutil.copytree(hf_dirs / "llama", src)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    snap = hub_snapshot(src, tmp_path / "hub")
    cli("import", str(snap), str(tmp_path / "dcp"))
    res = runner.invoke(app, ["export", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--model-assets", str(snap)])
    assert res.exit_code == 0, res.output
    note = " ".join(res.stderr.split())
    assert "holds no tokenizer files" in note and "copy the base model's tokenizer files into the export" in note, note
    assert "into it" not in note


def test_validate_against_of_a_torchtitan_import_compares_through_the_adapter(hf_dirs: Path, tmp_path: Path) -> None:
    """`import --schema torchtitan` writes torchtitan names; `--against` the HF model it came from once compared them
    as HF names ('FAILED', every tensor missing), then skipped all four rules and said OK of a reference it never
    looked at. It compares the names, shapes and dtypes export writes through the adapter (the dimensions from the
    reference's config.json): equal to the model it came from, as diff (through the adapter) finds."""
    src = hf_dirs / "llama"
    cli("import", str(src), str(tmp_path / "titan"), "--schema", "torchtitan")
    assert "equal" in cli("diff", str(tmp_path / "titan"), str(src))
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "titan"), "--against", str(src)])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "OK:" in out and "torchtitan-llama3 names" not in out, out
    assert "--against compared names, shapes and dtypes" in res.stderr, res.stderr


def test_validate_against_through_the_adapter_finds_what_differs(hf_dirs: Path, tmp_path: Path) -> None:
    """Against another model's folder (one layer fewer, BF16): the torchtitan checkpoint's extra layer is unexpected
    (M006, named by its torchtitan key and the HF name export writes), and the dtypes differ (M008), as the
    safetensors headers of the reference say."""
    from safetensors import safe_open

    src = hf_dirs / "llama"
    cli("import", str(src), str(tmp_path / "titan"), "--schema", "torchtitan")
    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copy(src / "config.json", ref / "config.json")
    keep = {}
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            keep.update({k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys() if ".layers.1." not in k})
    save_file(keep, str(ref / "model.safetensors"))
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "titan"), "--against", str(ref), "--json"])
    assert res.exit_code == 1, res.output
    found = {(f["code"], f["key"]): f["message"] for f in json.loads(res.stdout)["findings"]}
    assert {c for c, _ in found} == {"M006", "M008"}, found
    unexpected = {k for c, k in found if c == "M006"}
    assert unexpected and all(k.startswith("layers.1.") for k in unexpected), unexpected
    assert "as model.layers.1." in found[("M006", "layers.1.attention_norm.weight")]
    dtypes = {k for c, k in found if c == "M008"}
    assert "tok_embeddings.weight" in dtypes and not any(k.startswith("layers.1.") for k in dtypes), dtypes


def test_validate_against_that_compared_nothing_says_so_beside_its_ok(hf_dirs: Path, tmp_path: Path) -> None:
    """Where the torchtitan names cannot be mapped to HF's (the reference folder has no config.json and no --config
    gives the heads the RoPE rows need), the four rules are skipped and a note beside the OK says --against compared
    nothing, and why; with --config they compare."""
    cli("import", str(hf_dirs / "llama"), str(tmp_path / "titan"), "--schema", "torchtitan")
    ref = tmp_path / "ref"
    ref.mkdir()
    for f in (hf_dirs / "llama").glob("*.safetensors"):
        shutil.copy(f, ref / f.name)
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "titan"), "--against", str(ref)])
    assert res.exit_code == 0, res.output
    note = " ".join(res.stderr.split())
    assert "note: --against compared nothing: the checkpoint's model keys are torchtitan-llama3 names" in note, note
    assert "pass the model's config.json with --config" in note, note
    config = str(hf_dirs / "llama" / "config.json")
    res = runner.invoke(
        app, ["validate", "--strict", str(tmp_path / "titan"), "--against", str(ref), "--config", config]
    )
    assert res.exit_code == 0, res.output
    assert "--against compared names, shapes and dtypes" in res.stderr, res.stderr


def test_validate_against_a_key_list_in_the_checkpoints_own_names_is_still_compared(
    hf_dirs: Path, tmp_path: Path
) -> None:
    """A reference that speaks the checkpoint's torchtitan names (a JSON key list of them) is compared as it is: a
    key the list names and the checkpoint lacks is M005, not skipped because the names are not HF's."""
    from ckpttool.model.checkpoint import open_checkpoint

    cli("import", str(hf_dirs / "llama"), str(tmp_path / "titan"), "--schema", "torchtitan")
    with open_checkpoint(tmp_path / "titan") as ckpt:
        names = [ckpt.catalog.fqn_of(k) for k in ckpt.catalog.model]
    (tmp_path / "keys.json").write_text(json.dumps([*names, "layers.9.attention.wq.weight"]))
    res = runner.invoke(app, ["validate", "--json", str(tmp_path / "titan"), "--against", str(tmp_path / "keys.json")])
    found = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"] if f["code"].startswith("M00")]
    assert found == [("M005", "layers.9.attention.wq.weight")], res.stdout


def test_import_of_a_hub_repository_folder_without_refs_main_lists_its_snapshots(hf_dirs: Path, tmp_path: Path) -> None:
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    other = snap.parent / ("f" * 40)
    other.mkdir()
    repo = snap.parent.parent
    (repo / "refs" / "main").unlink()  # a download by revision only: no refs/main says which snapshot
    out = " ".join(cli("import", str(repo), str(tmp_path / "dcp"), code=2).split())
    want = f"pass one of its snapshots, {snap}, {other}".replace(" ", "")
    assert "[E200]" in out and want in out.replace(" ", ""), out


def test_validate_against_a_sharded_hub_snapshot_compares_shapes_and_dtypes(hf_dirs: Path, tmp_path: Path) -> None:
    """The snapshot's index resolves into blobs/: its shards were looked for there, not found, and M007/M008 were
    skipped ('gives no shapes') while the note said shapes and dtypes were compared (safetensors' own reader
    finds the shards' shapes)."""
    from safetensors import safe_open

    src = hf_dirs / "llama"
    assert (src / "model.safetensors.index.json").is_file()  # sharded: the index names its shards
    snap = hub_snapshot(src, tmp_path / "hub")
    shapes = {}
    for f in sorted(snap.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            shapes.update({k: h.get_slice(k).get_shape() for k in h.keys()})
    cli("import", str(src), str(tmp_path / "dcp"))
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "dcp"), "--against", str(snap), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    status = {r["code"]: r["status"] for r in doc["rules"]}
    assert status["M007"] == "passed" and status["M008"] == "passed", doc["rules"]
    assert len(shapes) > 0


def test_validate_against_a_key_list_says_it_compared_names_only(hf_dirs: Path, tmp_path: Path) -> None:
    """A key list gives no shapes or dtypes (M007/M008 skipped): the note once said 'compared names, shapes and
    dtypes'."""
    src = hf_dirs / "llama"
    cli("import", str(src), str(tmp_path / "dcp"))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(sorted(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])))
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "dcp"), "--against", str(keys)])
    assert res.exit_code == 0, res.output
    note = " ".join(res.stderr.split())
    assert "--against compared names, not values" in note, note
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "dcp"), "--against", str(src)])
    assert "--against compared names, shapes and dtypes, not values" in " ".join(res.stderr.split())


def _tree(root: Path) -> list[tuple[str, str]]:
    """Every entry below ``root``: its relative path and what it is (a link's target, a file's bytes' digest)."""
    out = []
    for p in sorted(root.rglob("*")):
        what = os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        out.append((str(p.relative_to(root)), what))
    return out


def test_nothing_is_written_into_the_hub_cache(hf_dirs: Path, tmp_path: Path) -> None:
    """`manifest SNAPSHOT` wrote manifest.json into the snapshot (huggingface_hub then lists it as a file of the
    revision); an import or export whose OUT lay in the repository folder was written there (`snapshots/other`
    reads as a revision named `other`). Each is refused, the cache left as it was."""
    cache = tmp_path / "hub"
    snap = hub_snapshot(hf_dirs / "llama", cache)
    repo = snap.parent.parent
    before = _tree(cache)
    cli("import", str(hf_dirs / "llama"), str(tmp_path / "dcp"))
    for args in (
        ("manifest", str(snap)),
        ("manifest", str(repo)),  # the repository folder: its snapshot is read, the manifest's default place in it
        ("manifest", str(snap), "--output", str(repo / "manifest.json")),
        ("import", str(snap), str(repo / "dcp")),
        ("export", str(tmp_path / "dcp"), str(repo / "snapshots" / "other")),
    ):
        out = cli(*args, code=2).replace("\n", "")
        assert "[E600]" in out and "inside the Hugging Face hub cache's repository folder" in out, (args, out)
        assert "hint: write it outside the hub cache" in out and "Traceback" not in out, out
    assert _tree(cache) == before
    for args in (("manifest", str(snap), "--verify"), ("validate", str(snap), "--manifest")):  # its default place
        out = cli(*args, code=2).replace("\n", "")  # the hint named `ckpttool manifest SNAP`, which is refused
        assert "no such manifest file" in out and "write one outside it, `ckpttool manifest " in out, out
        assert f"{snap} --output FILE`" in out and "write one with" not in out, out
    cli("manifest", str(snap), "--output", str(tmp_path / "m.json"))  # outside the cache: written, and it verifies
    assert "OK:" in cli("validate", str(snap), "--manifest", str(tmp_path / "m.json"))


@pytest.mark.parametrize("left", ["one-shard", "config-only"])
@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_snapshot_whose_download_is_not_finished_says_so(
    hf_dirs: Path, tmp_path: Path, command: str, left: str
) -> None:
    """huggingface_hub downloads a file to ``blobs/<hash>.incomplete`` and links it into the snapshot once complete:
    until then the file is missing from the snapshot. The hint said a shard was missing ("download or copy the
    complete model") or, with no weights linked yet, that the folder was a config folder for --model-assets."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub", repo_id="org/tiny-llama")
    gone = [p for p in sorted(snap.iterdir()) if p.name.startswith("model")]
    for p in gone[:1] if left == "one-shard" else gone:
        blob = p.resolve()
        p.unlink()
        with open(blob, "r+b") as f:  # a part of it downloaded
            f.truncate(blob.stat().st_size // 3)
        blob.rename(blob.with_name(blob.name + ".incomplete"))
    args = [command, str(snap)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    code = "[E202]" if left == "one-shard" else "[E200]"
    assert code in out and "hint: a download into the hub cache is not finished (" in out, out
    assert ".incomplete file(s) in " in out and "let `hf download org/tiny-llama` finish" in out, out
    assert "--model-assets" not in out and "Traceback" not in out and not (tmp_path / "dcp").exists(), out


@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_snapshot_of_two_saves_is_never_advised_to_move_files_in_the_cache(
    hf_dirs: Path, tmp_path: Path, command: str
) -> None:
    """A hub repository may hold model.safetensors beside a sharded index (both uploaded): the refusal's hint said to
    move one save out of the folder, that is, to edit huggingface_hub's cache. It says to copy the save meant out."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    shutil.copytree(hf_dirs / "llama", src)
    whole: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        whole.update(load_file(shard))
    save_file(whole, str(src / "model.safetensors"), metadata={"format": "pt"})
    snap = hub_snapshot(src, tmp_path / "hub")
    before = _tree(tmp_path / "hub")
    args = [command, str(snap)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    assert "[E200]" in out and "holds both model.safetensors and model.safetensors.index.json" in out, out
    assert "hint: a Hugging Face hub snapshot, whose files are left in place: copy the save you mean" in out, out
    assert "`cp -L`" in out and "move" not in out.split("hint:")[1], out
    assert _tree(tmp_path / "hub") == before and not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_local_dir_download_not_finished_says_so(hf_dirs: Path, tmp_path: Path, command: str) -> None:
    """``hf download --local-dir DIR`` writes each file to ``DIR/.cache/huggingface/download/<h>.<etag>.incomplete``
    (huggingface_hub's own ``get_local_download_paths`` names it) and moves it into place once complete."""
    from huggingface_hub._local_folder import get_local_download_paths

    local = tmp_path / "local"
    shutil.copytree(hf_dirs / "llama", local)
    shard = sorted(local.glob("model-*.safetensors"))[1]
    paths = get_local_download_paths(local, shard.name)
    paths.incomplete_path("0" * 40).write_bytes(shard.read_bytes()[:1000])
    shard.unlink()
    args = [command, str(local)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    assert "[E202]" in out and f"missing ('{shard.name}'" in out, out
    assert "hint: a download into this folder is not finished (1 .incomplete file(s) in " in out, out
    assert "`hf download ... --local-dir`" in out and "Traceback" not in out and not (tmp_path / "dcp").exists()


def test_a_local_dir_download_folder_linked_out_is_not_listed(hf_dirs: Path, tmp_path: Path) -> None:
    """``DIR/.cache/huggingface/download`` a symlink to a folder elsewhere: its ``*.incomplete`` files were counted
    (a listing outside the folder given) and the hint said a download into this folder was not finished."""
    local = tmp_path / "local"
    shutil.copytree(hf_dirs / "llama", local)
    shard = sorted(local.glob("model-*.safetensors"))[1]
    shard.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "other.incomplete").write_bytes(b"")
    (local / ".cache" / "huggingface").mkdir(parents=True)
    os.symlink(elsewhere, local / ".cache" / "huggingface" / "download")
    out = cli("validate", str(local), code=2).replace("\n", "")
    assert "[E202]" in out and f"missing ('{shard.name}'" in out and "not finished" not in out, out
    assert "hint: a shard file is missing" in out and "Traceback" not in out, out


def test_a_main_revision_not_in_the_cache_says_how_many_snapshots_there_are(hf_dirs: Path, tmp_path: Path) -> None:
    """The hint listed the first 3 of the repository's other snapshots as if they were all of them."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    repo = snap.parent.parent
    for i in range(4):
        (repo / "snapshots" / f"{i:040x}").mkdir()
    (repo / "refs" / "main").write_text("f" * 40)
    out = cli("inspect", str(repo), code=2).replace("\n", "")
    assert "or pass the snapshot of the revision you mean, " in out and ", ... (5 in all)" in out, out


def test_an_output_name_too_long_below_a_models_folder_name_is_named_as_given(hf_dirs: Path, tmp_path: Path) -> None:
    """An output folder named models--<300 bytes>: the hub cache check looked at OUT/snapshots, and the error named
    that path (`OUT/snapshots: File name too long`), one the user never gave."""
    out_dir = tmp_path / ("models--" + "x" * 300)
    out = cli("import", str(hf_dirs / "llama"), str(out_dir), code=2).replace("\n", "")
    assert f"[E100] {out_dir}: File name too long" in out and "/snapshots" not in out and "Traceback" not in out, out


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_a_snapshot_linked_back_to_its_repository_gives_one_hint_not_forty(tmp_path: Path, command: str) -> None:
    """``snapshots/models--x`` a link to the repository folder itself and ``refs/main`` naming it: the hint of what
    the snapshot holds followed it again as a repository folder, 40 times deep (until the kernel's link limit), a
    hint of 19 kB. The snapshot is described once."""
    repo = tmp_path / "hub" / "models--t--m"
    for d in ("snapshots", "refs", "blobs"):
        (repo / d).mkdir(parents=True)
    os.symlink("..", repo / "snapshots" / "models--x")
    (repo / "refs" / "main").write_text("models--x")
    torch.save({"w": torch.ones(2)}, repo / "pytorch_model.bin")
    res = runner.invoke(app, [command, str(repo)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    hint = next(line for line in res.stderr.splitlines() if line.startswith("hint:"))
    assert hint.count("in its snapshot") == 1 and "pytorch_model.bin is a torch.save file" in hint, hint
    assert len(res.output) < 4000, len(res.output)  # it was over 19,000


class _Planted:
    """Unpickling it makes a directory: a file that ran code would show it."""

    def __init__(self, where: Path) -> None:
        self.where = str(where)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.where,))


@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_hub_repository_of_a_pickled_model_names_its_weights_file_never_loading_it(
    hf_dirs: Path, tmp_path: Path, command: str
) -> None:
    """A repository holding pytorch_model.bin alone, given by its repository folder: inspect/validate (which look below
    it) said only to pass a dcp.save directory, not what the snapshot holds. Nothing in the file is run."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(hf_dirs / "llama" / "config.json", src / "config.json")
    ran = tmp_path / "ran"
    torch.save({"model.norm.weight": torch.ones(4), "x": _Planted(ran)}, src / "pytorch_model.bin")
    snap = hub_snapshot(src, tmp_path / "hub")
    args = [command, str(snap.parent.parent)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    assert (
        "[E200]" in out
        and str(snap) in out
        and "pytorch_model.bin is a torch.save file" in out
        or (command == "import" and "pass its snapshot" in out)
    ), out
    assert not ran.exists() and "Traceback" not in out and not (tmp_path / "dcp").exists()
    out = cli(*args[:1], str(snap), *args[2:], code=2).replace("\n", "")
    assert "[E200]" in out and "pytorch_model.bin is a torch.save file" in out and not ran.exists(), out


@pytest.mark.parametrize("given", ["repository", "cache"])
@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_hub_repository_whose_main_revision_is_not_in_the_cache_is_not_read_as_an_older_one(
    hf_dirs: Path, tmp_path: Path, command: str, given: str
) -> None:
    """refs/main moved to a new revision whose snapshot is not there yet: validate of the repository folder (or the
    cache) said OK of the older snapshot, and import's hint named it as "its snapshot"."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    repo = snap.parent.parent
    (repo / "refs" / "main").write_text("f" * 40)
    path = repo if given == "repository" else tmp_path / "hub"
    args = [command, str(path)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    # (import of a cache root reads nothing: its hint names a folder below)
    if not (command == "import" and given == "cache"):
        assert f"its refs/main names revision {'f' * 40}, which has no snapshot in the cache" in out, out
        assert "run `hf download tiny/llama` to fetch it, or pass the snapshot of the revision you mean" in out, out
    assert "OK:" not in out and "Traceback" not in out and not (tmp_path / "dcp").exists(), out
    assert "OK:" in cli("validate", str(snap))  # the older revision given itself is read


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_a_refs_main_linked_out_of_the_repository_is_not_read(hf_dirs: Path, tmp_path: Path, command: str) -> None:
    """refs/main a symlink to a file outside the hub repository folder: its content was read and shown in the hint
    ("its refs/main names revision <the file's first 64 bytes>"), a read outside the checkpoint. It is not followed:
    the folder is read as one without refs/main (its only snapshot), as before refs/main was checked."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    repo = snap.parent.parent
    secret = tmp_path / "elsewhere" / "token"
    secret.parent.mkdir()
    secret.write_text("hf_SECRETTOKEN")
    (repo / "refs" / "main").unlink()
    os.symlink(secret, repo / "refs" / "main")
    res = runner.invoke(app, [command, str(repo)])
    assert "SECRETTOKEN" not in res.output and "Traceback" not in res.output, res.output
    assert res.exit_code == 0 and str(snap.name) in res.output.replace("\n", ""), res.output


@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_snapshot_whose_index_blob_is_gone_is_a_missing_file_not_damage(
    hf_dirs: Path, tmp_path: Path, command: str
) -> None:
    """The index's link to a blob gone from the cache was `E200` "not a readable index (FileNotFoundError)", the hint
    to restore a damaged index; a shard's such link is `E202`, a file missing. So is the index's now."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    index = snap / "model.safetensors.index.json"
    index.resolve().unlink()
    args = [command, str(snap)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    assert "[E202]" in out and f"{index.name}: links to '../../blobs/" in out and "which does not exist" in out, out
    assert "hint: the file the link points to is missing" in out and "damaged" not in out, out
    assert "Traceback" not in out and not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("gone", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("command", ["import", "export"])
def test_a_snapshot_asset_whose_blob_is_gone_is_named_by_its_link(
    hf_dirs: Path, tmp_path: Path, command: str, gone: str
) -> None:
    """`export --model-assets SNAP` with an asset's blob gone from the cache was E999 (FileNotFoundError on the blob);
    import named the blob path as a damaged config.json."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    (snap / gone).resolve().unlink()
    if command == "import":
        args = ["import", str(snap), str(tmp_path / "out")]
        if gone != "config.json":  # import copies no asset: it reads config.json alone
            cli(*args)
            return
    else:
        cli("import", str(hf_dirs / "llama"), str(tmp_path / "dcp"))
        args = ["export", str(tmp_path / "dcp"), str(tmp_path / "out"), "--model-assets", str(snap)]
    out = cli(*args, code=2).replace("\n", "")
    assert f"[E100] {snap / gone}: links to '../../blobs/" in out and "which does not exist" in out, out
    assert "hint: the file the link points to is missing" in out and "damaged" not in out, out
    assert "E999" not in out and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["import", "validate", "inspect"])
def test_a_blob_of_the_hub_cache_given_names_the_snapshot(hf_dirs: Path, tmp_path: Path, command: str) -> None:
    """A blob file given (a path from `du`/`ls` of the cache): the hint said the blobs folder holds no .safetensors
    file (import) or to pass a dcp.save directory, not the snapshot that names the blob."""
    snap = hub_snapshot(hf_dirs / "llama", tmp_path / "hub")
    blob = (snap / "model.safetensors.index.json").resolve()
    args = [command, str(blob)] + ([str(tmp_path / "dcp")] if command == "import" else [])
    out = cli(*args, code=2).replace("\n", "")
    assert (
        "[E100]" in out
        and f"hint: the blobs of a Hugging Face hub repository (files named by hash): pass its snapshot, {snap}" in out
    ), out
    assert "Traceback" not in out and not (tmp_path / "dcp").exists()
