"""``--overwrite`` replaces only a directory ckpttool provably wrote (docs/security.md, "Ownership of outputs").

Every output directory carries ``.ckpttool-output.json`` (written by ckpttool: kind, version, token,
every file with its size and digest). Through the real CLI, each kind of foreign directory is
refused with ``E606`` naming what it holds, and stays byte-identical: a real ``dcp.save``
checkpoint (for ``export``, ``import``, ``reshard`` and ``sample``), a Hugging Face model folder
made by a real export plus its config, random files, a marker copied into a real checkpoint, a
marker whose files were edited afterwards. The README's own ``--overwrite`` lines still re-run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
MARKER = ".ckpttool-output.json"


def snapshot(root: Path) -> dict[str, str]:
    """Every entry below ``root``: file bytes (sha256), directories, symlink targets."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".ckpttool-tmp-" in n or ".ckpttool-old-" in n)


def cli(*args: object):  # type: ignore[no-untyped-def]
    return runner.invoke(app, [str(a) for a in args])


def assert_refused(res, *needles: str, code: str = "E606") -> str:  # type: ignore[no-untyped-def]
    """Exit 2, one ``error: [CODE]`` line (returned) and a hint line, nothing on stdout, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines[-2].startswith(f"error: [{code}] "), res.stderr
    assert lines[-1].startswith("hint: "), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    for n in needles:
        assert n in lines[-2], (n, lines[-2])
    return lines[-2]


@pytest.fixture(scope="module")
def hf_export(sample_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real export (with the sample's config.json) of the sample checkpoint: an import source."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    res = cli("export", sample_ckpt, out, "--model-assets", sample_ckpt / "model_assets")
    assert res.exit_code == 0, res.stderr
    return out


def command(name: str, sample_ckpt: Path, hf_export: Path, out: Path) -> list[object]:
    return {
        "export": ["export", sample_ckpt, out],
        "import": ["import", hf_export, out],
        "reshard": ["reshard", sample_ckpt, out, "--to", "canonical", "--with-optimizer"],
        "sample": ["sample", out, "--train-steps", "0"],
    }[name]


# ----------------------------------------------------------------------------------- foreign directories
@pytest.mark.parametrize("name", ["export", "import", "reshard", "sample"])
def test_a_real_training_checkpoint_is_never_replaced(
    name: str, dense_ckpt: Path, sample_ckpt: Path, hf_export: Path, tmp_path: Path
) -> None:
    """A copy of a real dcp.save checkpoint (no marker) as OUT: every writing command refuses it."""
    out = copy_checkpoint(dense_ckpt, tmp_path / "step-1000")
    assert not (out / MARKER).exists()
    before = snapshot(out)
    line = assert_refused(cli(*command(name, sample_ckpt, hf_export, out), "--overwrite"))
    assert f"{out}: --overwrite refused: it holds a DCP checkpoint (.metadata" in line
    assert f"no {MARKER}" in line
    assert snapshot(out) == before and leftovers(tmp_path) == []
    # without --overwrite: E600, and the hint says --overwrite would not help
    res = cli(*command(name, sample_ckpt, hf_export, out))
    assert_refused(res, "exists and is not empty", code="E600")
    assert "--overwrite would not replace it" in res.stderr.strip().splitlines()[-1]
    assert snapshot(out) == before


def test_a_model_folder_keeps_its_config(sample_ckpt: Path, hf_export: Path, tmp_path: Path) -> None:
    """An HF model folder (a real export's safetensors + config.json + generation_config.json, as a user
    downloads it): not ckpttool's, so `export ... base_model_copy --overwrite` leaves it whole."""
    out = tmp_path / "base_model_copy"
    shutil.copytree(hf_export, out)
    (out / MARKER).unlink()
    (out / "generation_config.json").write_text('{"bos_token_id": 1}\n')
    before = snapshot(out)
    line = assert_refused(cli("export", sample_ckpt, out, "--overwrite"))
    assert "a model folder (config.json, model.safetensors.index.json, generation_config.json, 1 weight file)" in line
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_random_files_and_a_repository_are_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "notes"
    (out / "src" / ".git").mkdir(parents=True)
    (out / "todo.txt").write_text("keep me\n")
    (out / "src" / "x.py").write_text("print(1)\n")
    before = snapshot(out)
    line = assert_refused(cli("export", sample_ckpt, out, "--overwrite"))
    assert "it holds 2 entries (src, todo.txt), not an output of ckpttool" in line
    assert snapshot(out) == before


def test_a_report_ckpttool_wrote_into_its_own_output_is_named_as_added_not_as_foreign(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """`validate --junit` (or `stats --plot`) into an export folder, then `export --overwrite`: E606 said the folder
    was "not an output of ckpttool" and the report "(ckpttool did not write it)", both untrue. The refusal stays
    (the folder no longer holds only the output), in words that are true of it and of a copied marker alike."""
    out = tmp_path / "hf"
    assert cli("export", sample_ckpt, out).exit_code == 0
    assert cli("validate", sample_ckpt, "--junit", out / "report.xml").exit_code == 0
    before = snapshot(out)
    line = assert_refused(cli("export", sample_ckpt, out, "--overwrite"))
    assert (
        "it holds a model folder (model.safetensors.index.json, 1 weight file), not provably an output of ckpttool"
        in line
    )
    assert line.endswith(f"; report.xml is not listed in {MARKER} (not part of the output ckpttool wrote)")
    assert "did not write" not in line and "not an output" not in line
    # without --overwrite: E600, whose hint said the same of the folder
    res = cli("export", sample_ckpt, out)
    assert res.exit_code == 2 and res.stderr.splitlines()[-1] == (
        "hint: choose another output directory (it holds a model folder (model.safetensors.index.json, 1 weight file), "
        "not provably an output of ckpttool: --overwrite would not replace it)"
    )
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_marker_copied_into_a_real_checkpoint_is_refused(
    dense_ckpt: Path, sample_ckpt: Path, hf_export: Path, tmp_path: Path
) -> None:
    """A genuine marker (from another output) copied into a real checkpoint disagrees with its files."""
    out = copy_checkpoint(dense_ckpt, tmp_path / "ckpt")
    shutil.copy(hf_export / MARKER, out / MARKER)
    before = snapshot(out)
    line = assert_refused(cli("import", hf_export, out, "--overwrite"))
    assert (
        "it holds a DCP checkpoint" in line
        and f"is not listed in {MARKER} (not part of the output ckpttool wrote)" in line
    )
    assert snapshot(out) == before


def test_a_marker_that_lists_the_files_but_not_their_bytes_is_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    """A previous output whose data file was replaced by other bytes of the same size (a training run that
    wrote into it, a forged marker naming the right files and sizes): the digests disagree."""
    out = tmp_path / "out"
    assert cli("reshard", sample_ckpt, out, "--to", "canonical", "--with-optimizer").exit_code == 0
    data = out / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # the last MiB: as if another save had written it
    data.write_bytes(bytes(raw))
    before = snapshot(out)
    line = assert_refused(cli("reshard", sample_ckpt, out, "--to", "canonical", "--with-optimizer", "--overwrite"))
    assert f"__0_0.distcp differs in content from what {MARKER} records" in line
    assert snapshot(out) == before
    # a marker edited to claim another size, and one that is not JSON: refused too
    doc = json.loads((out / MARKER).read_text())
    doc["files"]["__0_0.distcp"][0] += 1
    (out / MARKER).write_text(json.dumps(doc))
    assert "differs in size" in assert_refused(cli("export", sample_ckpt, out, "--overwrite"))
    (out / MARKER).write_text("{not json")
    assert "cannot be read as a ckpttool marker" in assert_refused(cli("export", sample_ckpt, out, "--overwrite"))


@pytest.mark.parametrize("how", ["symlink", "directory"])
def test_a_marker_that_is_not_a_regular_file_is_refused(how: str, sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("export", sample_ckpt, out).exit_code == 0
    real = tmp_path / "elsewhere.json"
    shutil.move(out / MARKER, real)
    if how == "symlink":
        (out / MARKER).symlink_to(real)
    else:
        (out / MARKER).mkdir()
    before = snapshot(out)
    assert_refused(cli("export", sample_ckpt, out, "--overwrite"))
    assert snapshot(out) == before


# ----------------------------------------------------------------------------------- ckpttool's own outputs
@pytest.mark.parametrize("name", ["export", "import", "reshard"])
def test_a_previous_output_is_replaced_and_carries_a_marker(
    name: str, sample_ckpt: Path, hf_export: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = command(name, sample_ckpt, hf_export, out)
    assert cli(*argv).exit_code == 0
    first = json.loads((out / MARKER).read_text())
    assert first["kind"] == name and first["state"] == "complete" and first["command"] == f"ckpttool {name}"
    assert set(first["files"]) == {k for k, v in snapshot(out).items() if v != "dir" and k != MARKER}
    res = cli(*argv, "--overwrite")
    assert res.exit_code == 0, res.stderr
    second = json.loads((out / MARKER).read_text())
    assert second["token"] != first["token"] and leftovers(tmp_path) == []


def test_a_previous_output_given_without_overwrite_is_named_by_what_it_holds(
    sample_ckpt: Path, hf_export: Path, tmp_path: Path
) -> None:
    """`ckpttool export HF CKPT` (the arguments swapped; CKPT a checkpoint `reshard` wrote) answered only "pass
    --overwrite to replace this previous output", which would replace the checkpoint with an export. The hint now
    says what it holds, and the checkpoint stays untouched."""
    ckpt = tmp_path / "resharded"
    assert cli("reshard", sample_ckpt, ckpt, "--to", "legacy", "--with-optimizer").exit_code == 0
    before = snapshot(ckpt)
    res = cli("export", hf_export, ckpt)
    assert (res.exit_code, res.stdout) == (2, ""), res.output
    assert res.stderr.splitlines() == [
        f"error: [E600] {ckpt} exists and is not empty",
        "hint: choose another output directory, or pass --overwrite to replace this previous output (a ckpttool "
        "reshard output: a DCP checkpoint (.metadata, 1 data file))",
    ], res.stderr
    assert snapshot(ckpt) == before


def test_an_empty_directory_is_replaced(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    res = cli("export", sample_ckpt, out, "--overwrite")
    assert res.exit_code == 0, res.stderr
    assert (out / "model.safetensors").is_file() and (out / MARKER).is_file()


def test_the_readme_overwrite_lines_rerun(tmp_path: Path) -> None:
    """README: `ckpttool sample S --overwrite` and `ckpttool export S HF --model-assets S/model_assets
    --overwrite`, each run twice (the second replaces the first)."""
    s, hf = tmp_path / "ckpttool-sample", tmp_path / "ckpttool-hf"
    for _ in range(2):
        res = cli("sample", s, "--overwrite")
        assert res.exit_code == 0, res.stderr
        res = cli("export", s, hf, "--model-assets", s / "model_assets", "--overwrite")
        assert res.exit_code == 0, res.stderr
    assert json.loads((s / MARKER).read_text())["kind"] == "sample"
    assert json.loads((hf / MARKER).read_text())["kind"] == "export"
    assert leftovers(tmp_path) == []


def test_a_manifest_written_into_an_output_keeps_it_replaceable(sample_ckpt: Path, tmp_path: Path) -> None:
    """`ckpttool manifest OUT` adds manifest.json to OUT's marker (ckpttool wrote it); a hand-made file does not."""
    out = tmp_path / "out"
    argv = ["reshard", sample_ckpt, out, "--to", "canonical", "--with-optimizer"]
    assert cli(*argv).exit_code == 0
    res = cli("manifest", out)
    assert res.exit_code == 0, res.stderr
    doc = json.loads((out / MARKER).read_text())
    assert doc["files"]["manifest.json"][0] == (out / "manifest.json").stat().st_size
    res = cli(*argv, "--overwrite")
    assert res.exit_code == 0, res.stderr
    (out / "NOTES.md").write_text("mine\n")
    res = cli("manifest", out)  # the marker disagrees already: it is not rewritten to bless NOTES.md
    assert res.exit_code == 0, res.stderr
    assert "NOTES.md" in assert_refused(cli(*argv, "--overwrite"))


def test_a_foreign_prefix_in_object_storage_is_refused(
    dense_ckpt: Path, sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """The same rule below a URL prefix: a training checkpoint uploaded there is refused, objects untouched;
    a previous export there (it carries the marker) is replaced."""
    url = s3_server.upload_dir(dense_ckpt, "ckpts", f"t-{uuid.uuid4().hex[:8]}")
    key = url.split("/", 3)[3]
    before = s3_server.download_dir("ckpts", key, tmp_path / "before")
    opts = s3_server.cli_options()
    res = runner.invoke(app, [*opts, "export", str(sample_ckpt), url, "--overwrite"])
    line = assert_refused(res, "it holds a DCP checkpoint (.metadata")
    assert f"no {MARKER}" in line
    assert s3_server.download_dir("ckpts", key, tmp_path / "after") == before
    out = url + "-hf"
    assert runner.invoke(app, [*opts, "export", str(sample_ckpt), out]).exit_code == 0
    res = runner.invoke(app, [*opts, "export", str(sample_ckpt), out, "--overwrite"])
    assert res.exit_code == 0, res.output


def test_the_current_directory_as_out_is_refused_and_left_in_place(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cd empty/ && ckpttool export CKPT .` wrote the output beside the folder and renamed it over it: the
    shell was left in a removed directory (`ls` showed nothing, as if nothing was exported) and the next
    command there failed E999 (FileNotFoundError). `--overwrite` of a ckpttool output one stands in did the
    same. Now E600 names the current directory; the folder keeps its inode and its files."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    ino = os.stat(here).st_ino
    for argv in (["export", str(sample_ckpt), "."], ["sample", "."], ["export", str(sample_ckpt), str(here)]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2 and res.stdout == "", (argv, res.stderr)
        lines = res.stderr.splitlines()
        assert lines[0] == (
            f"error: [E600] {here}: is the current directory; ckpttool writes the output beside it and renames "
            "it into place, which would leave this shell in a removed directory"
        )
        assert lines[1].startswith("hint: name a new directory for the output (e.g. ./hf)")
    assert os.stat(here).st_ino == ino and list(here.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]

    res = runner.invoke(app, ["export", str(sample_ckpt), "hf"])  # what the hint says
    assert res.exit_code == 0, res.stderr
    monkeypatch.chdir(here / "hf")
    before = sorted(p.name for p in Path(".").iterdir())
    res = runner.invoke(app, ["export", str(sample_ckpt), ".", "--overwrite"])
    assert res.exit_code == 2 and "is the current directory" in res.stderr
    res = runner.invoke(app, ["export", str(sample_ckpt), "..", "--overwrite"])
    assert res.exit_code == 2 and "is the current directory or holds it" in res.stderr
    assert sorted(p.name for p in Path(".").iterdir()) == before and os.path.samefile(".", here / "hf")


def test_a_removed_current_directory_is_one_line_before_anything_is_read(sample_ckpt: Path, tmp_path: Path) -> None:
    """In a shell whose directory was removed from another shell, `sample OUT` died in torch's import
    ("Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so", exit 2, no code) and `inspect .` said E200
    "no .metadata". Every command is now refused with one E100 line; an absolute output is not created."""
    gone = tmp_path / "gone"
    gone.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for argv in (["sample", str(out)], ["inspect", "."], ["export", str(sample_ckpt), str(out)]):
        script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
        cmd = ["sh", "-c", script, "sh", str(gone), sys.executable, "-m", "ckpttool", *argv]
        gone.mkdir(exist_ok=True)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 2 and res.stdout == "", (argv, res.stderr)
        assert res.stderr.splitlines() == [
            "error: [E100] the current directory no longer exists (it was removed after this shell entered it)",
            "hint: cd to an existing directory and run the command again",
        ], argv
        assert not out.exists() and not gone.exists()


@pytest.mark.parametrize("name", ["export", "import", "reshard", "sample"])
def test_overwrite_help_says_it_replaces_only_what_ckpttool_wrote(name: str) -> None:
    """--help said "Replace an existing non-empty output directory once the new output is complete", which the
    command refuses (E606) for any directory ckpttool did not write."""
    text = " ".join(runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "Replace an existing non-empty output directory" not in text
    assert (
        "--overwrite Replace an earlier output of ckpttool in the output directory once the new output is complete "
        "(never a directory ckpttool did not write: E606)." in text
    )
