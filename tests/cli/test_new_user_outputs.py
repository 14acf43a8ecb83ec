"""Output locations a new user gives by mistake or by circumstance: a read-only checkpoint folder for
``manifest``, an empty mount point (a container's volume) as ``OUT``. Each is refused on one line with a hint
that names an option the command has, before any work is done, and nothing of the user's is touched."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _in_mount_namespace(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) in a private mount namespace (``unshare -rm``), so that it can mount without touching
    the machine's mounts; skip where that is not allowed."""
    if shutil.which("unshare") is None or sys.platform != "linux":
        pytest.skip("needs util-linux unshare on Linux (a private mount namespace)")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not allowed here: {probe.stderr.strip()}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(["unshare", "-rm", "sh", "-ec", script], capture_output=True, text=True, env=env)


def _ckpttool_on_read_only(folder: Path, args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ckpttool ARGS`` (``args``: shell words) with ``folder`` bind-mounted read-only over itself."""
    return _in_mount_namespace(
        f'mount --bind "{folder}" "{folder}"; mount -o remount,ro,bind "{folder}"; '
        f'exec "{sys.executable}" -m ckpttool {args}'
    )


def test_manifest_that_cannot_be_written_hints_output_not_overwrite(sample_ckpt: Path, tmp_path: Path) -> None:
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc (a place no manifest can be written)")
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    res = runner.invoke(app, ["manifest", str(ck), "--output", "/proc/manifest.json"])
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0].startswith("error: [E600] /proc/manifest.json: cannot write the manifest (")
    assert "--overwrite" not in res.stderr  # manifest has no such option
    assert lines[1].startswith("hint: write it to a writable place with --output FILE")
    assert len(lines) == 2 and "Traceback" not in res.output


def test_manifest_of_a_read_only_checkpoint_is_refused_before_hashing(sample_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ro ckpt ü")
    before = _tree(ck)
    res = _ckpttool_on_read_only(ck, f'--no-progress manifest "{ck}"')
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E600] {ck}/manifest.json: cannot write the manifest ({ck} is not writable: read-only file "
        "system); nothing was hashed",
        "hint: write it to a writable place with --output FILE (check the checkpoint against it later with "
        "`ckpttool manifest DIR --verify --output FILE`)",
    ]
    assert _tree(ck) == before


@pytest.mark.parametrize(
    "argv", [["export", "{ck}", "{out}"], ["export", "{ck}", "{out}", "--dry-run"], ["sample", "{out}"]]
)
def test_an_empty_mount_point_as_out_is_refused_before_writing(
    sample_ckpt: Path, tmp_path: Path, argv: list[str]
) -> None:
    out = tmp_path / "volume"
    out.mkdir()
    args = " ".join(f'"{a.format(ck=sample_ckpt, out=out)}"' for a in argv)
    res = _in_mount_namespace(
        f'mount -t tmpfs tmpfs "{out}"; "{sys.executable}" -m ckpttool --no-progress {args} || rc=$?; '
        f'ls -A "{out}"; exit ${{rc:-0}}'
    )
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""  # nothing planned or written, and nothing inside the mount
    assert res.stderr.splitlines() == [
        f"error: [E600] {out} is a mount point: ckpttool writes the output beside it and renames it into place, "
        "which a mount point does not allow",
        f"hint: name a new directory inside it for the output (e.g. {out}/out)",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"]  # no staging directory left beside it


def test_an_empty_read_only_mount_point_as_out_is_not_told_to_write_inside_it(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "volume"
    out.mkdir()
    res = _in_mount_namespace(
        f'mount -t tmpfs -o ro tmpfs "{out}"; '
        f'exec "{sys.executable}" -m ckpttool --no-progress export "{sample_ckpt}" "{out}"'
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"error: [E600] {out} is a mount point: ckpttool writes the output beside it and renames it into place, "
        "which a mount point does not allow",
        "hint: choose a writable output location (the mount point itself is not writable: read-only file system)",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"]


def test_a_safetensors_file_given_for_a_directory_hints_its_folder_by_its_safetensors(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    hf = tmp_path / "hf model"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(hf)])
    assert res.exit_code == 0, res.output
    f = hf / "model.safetensors"
    for argv in (["inspect", str(f)], ["validate", str(f)], ["export", str(f), str(tmp_path / "again")]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2, res.output
        assert res.stdout == ""
        assert res.stderr.splitlines() == [
            f"error: [E100] {f} is not a directory",
            "hint: pass the checkpoint directory (the one holding the .safetensors files), not a file in it: "
            f"{shlex.quote(str(hf))}",  # quoted: the folder's name has a space, pasted as one argument
        ]  # not "(the one holding .metadata)": this folder has none
    res = runner.invoke(app, ["inspect", str(sample_ckpt / ".metadata")])
    assert res.exit_code == 2
    assert res.stderr.splitlines()[1] == (
        f"hint: pass the checkpoint directory (the one holding .metadata), not a file in it: {sample_ckpt}"
    )


@pytest.mark.parametrize(
    ("argv", "option", "hint"),
    [
        (["validate", "--deep", "{ck}", "--junit", "{file}.xml"], "--junit", "hint: --junit takes the path of a file"),
        (["stats", "{ck}", "--plot", "{file}.png"], "--plot", "hint: give a new file name"),
    ],
)
def test_a_report_into_a_read_only_folder_is_refused_before_the_work(
    sample_ckpt: Path, tmp_path: Path, argv: list[str], option: str, hint: str
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    args = " ".join(f'"{a.format(ck=sample_ckpt, file=reports / "r")}"' for a in argv)
    res = _ckpttool_on_read_only(reports, f"--no-progress {args}")
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""  # no validation report, no statistics: nothing was run before the refusal
    lines = res.stderr.splitlines()
    suffix = argv[-1].rsplit(".", 1)[1]
    assert lines[0] == (
        f"error: [E600] {option} {reports}/r.{suffix}: cannot write there ({reports} is not writable: "
        "read-only file system)"
    )
    assert len(lines) == 2 and lines[1].startswith(hint)


def test_export_without_model_assets_names_the_config_saved_with_the_checkpoint(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--json"])
    assert res.exit_code == 0, res.output
    import json

    assert json.loads(res.stdout)["config_beside"] == str(sample_ckpt / "model_assets")  # ckpttool sample's own
    # a Hugging Face folder given as the source holds its config.json itself: the note names that folder
    hf = tmp_path / "hf model"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--model-assets", str(sample_ckpt / "model_assets")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["export", str(hf), str(tmp_path / "again")])
    assert res.exit_code == 0, res.output
    assert (
        f"note: {tmp_path / 'again'} holds no config.json (no --model-assets): transformers' from_pretrained needs "
        "one; pass --model-assets DIR, the folder of the model's config.json and tokenizer files (the checkpoint's "
        f"folder holds one: --model-assets '{hf}')\n"
    ) in res.stderr
    res = runner.invoke(app, ["export", str(hf), str(tmp_path / "third"), "--model-assets", str(hf)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "third" / "config.json").read_bytes() == (hf / "config.json").read_bytes()


def test_a_model_folder_without_safetensors_gets_a_hint_that_fits_it(sample_ckpt: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    hf = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--model-assets", str(sample_ckpt / "model_assets")])
    assert res.exit_code == 0, res.output
    old = tmp_path / "old style"  # what save_pretrained(safe_serialization=False) of transformers 4 wrote
    old.mkdir()
    shutil.copy(hf / "config.json", old / "config.json")
    torch.save(load_file(hf / "model.safetensors"), old / "pytorch_model.bin")
    before = _tree(old)
    for argv in (["inspect", str(old)], ["validate", str(old)], ["export", str(old), str(tmp_path / "o")]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2, res.output
        lines = res.stderr.splitlines()
        assert (
            lines[0] == f"error: [E200] {old}: no .metadata, and no DCP checkpoint in the 3 directory levels below it"
        )
        assert lines[1] == (
            "hint: pytorch_model.bin is a torch.save file, which ckpttool does not read: it reads DCP checkpoints "
            "and safetensors folders; load the model with transformers and save it again with save_pretrained "
            "(it writes safetensors), then pass that folder"
        )
    assert _tree(old) == before and not (tmp_path / "o").exists()
    (old / "pytorch_model.bin").unlink()  # a folder of config.json alone: the --model-assets of an export
    res = runner.invoke(app, ["inspect", str(old)])
    assert res.exit_code == 2
    assert res.stderr.splitlines()[1] == (
        "hint: it holds config.json but no weights (a model's config folder: pass it to export as --model-assets); "
        "pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files)"
    )


def test_notes_wrap_at_spaces_on_a_narrow_terminal_and_stay_whole_in_a_pipe(sample_ckpt: Path, tmp_path: Path) -> None:
    from tests.cli.test_terminal import ANSI, run_in_pty

    out = tmp_path / "hf"
    rc, text = run_in_pty(["--no-progress", "export", str(sample_ckpt), str(out)], 60)
    assert rc == 0, text
    lines = ANSI.sub("", text).splitlines()
    first = lines.index(next(line for line in lines if line.startswith("note: 4 fused expert tensor(s)")))
    note = [lines[first]]
    for line in lines[first + 1 :]:
        if not line.startswith("      ") or line.startswith("      - "):
            break
        note.append(line)
    assert len(note) > 1 and all(len(line) <= 60 for line in note), note  # not cut mid-word by the terminal
    piped = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "piped")], env={"COLUMNS": "60"})
    whole = next(line for line in piped.stderr.splitlines() if line.startswith("note: 4 fused expert tensor(s)"))
    assert len(whole) > 60  # a pipe keeps the line whole, for grep
    assert " ".join(line.strip() for line in note) == whole


def test_stamp_of_a_read_only_checkpoint_hints_the_declaration_on_each_command(ep_suite: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "legacy")
    before = _tree(ck)
    declared = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]
    res = _ckpttool_on_read_only(ck, f'stamp "{ck}" {" ".join(declared)}')
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E600] {ck}/layout.json: cannot write ({ck} is not writable: read-only file system); "
        "nothing was written",
        "hint: the checkpoint's folder cannot be written; declare the layout on each command instead "
        "(--source-layout legacy --ep-size 2 --ep-fsdp-size 2), or stamp a writable copy of the checkpoint",
    ]
    assert _tree(ck) == before
    res = runner.invoke(app, ["inspect", str(ck), *declared])  # the hint's way out works
    assert res.exit_code == 0, res.output
    assert "layout      version 1 (legacy, declared); parallel ep_size=2, ep_fsdp_size=2; 4 EP tensors" in res.stdout


@pytest.mark.parametrize("dry_run", [True, False])
def test_export_below_a_read_only_folder_is_refused_and_dry_run_says_so(
    sample_ckpt: Path, tmp_path: Path, dry_run: bool
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / "hf"
    flag = " --dry-run" if dry_run else ""
    res = _ckpttool_on_read_only(ro, f'-q export "{sample_ckpt}" "{out}"{flag}')
    assert res.returncode == 2, res.stdout + res.stderr  # --dry-run said the export would be written
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E600] {out}: cannot write there ({ro} is not writable: read-only file system)",
        "hint: choose a writable output location",
    ]
    assert list(ro.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


@pytest.mark.parametrize("command", ["export", "reshard"])
def test_an_output_inside_a_bind_mount_of_the_source_is_refused(command: str, ep_suite: Path, tmp_path: Path) -> None:
    """The same volume mounted at two paths (a container's /data and /mnt/data): ``OUT`` under the second
    path lies inside the checkpoint. It was taken for another place: export wrote its output into the
    checkpoint, reshard copied its own temporary directory into itself until a name grew too long (E100)."""
    ck = copy_checkpoint(ep_suite / "p4f1", tmp_path / "ck")
    alias = tmp_path / "alias"
    alias.mkdir()
    before = _tree(ck)
    args = f'export "{ck}" "{alias}/out"' if command == "export" else f'reshard "{ck}" "{alias}/out" --to canonical'
    res = _in_mount_namespace(
        f'mount --bind "{ck}" "{alias}"; exec "{sys.executable}" -m ckpttool --no-progress {args}'
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"error: [E600] {alias}/out: output overlaps the source checkpoint {ck}",
        "hint: write the output to a directory outside the checkpoint",
    ]
    assert _tree(ck) == before and sorted(os.listdir(ck)) == sorted(before)


@pytest.mark.parametrize(
    ("args", "given"),
    [
        (["export", "{ck}", "~/hf"], "~/hf"),
        (["export", "{ck}", "~/hf", "--dry-run"], "~/hf"),
        (["reshard", "{ck}", "~/rs", "--to", "legacy", "--with-optimizer"], "~/rs"),
        (["sample", "~/smp"], "~/smp"),
        (["manifest", "{ck}", "--output=~/m.json"], "manifest ~/m.json"),
        (["validate", "{ck}", "--junit=~/r.xml"], "--junit ~/r.xml"),
        (["stats", "{ck}", "--plot=~/p.png"], "--plot ~/p.png"),
    ],
)
def test_an_output_starting_with_an_unexpanded_tilde_is_refused_with_the_path_meant(
    args: list[str], given: str, sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`export ck '~/hf'`, `stats ck --plot=~/p.png` (bash expands `~` neither in quotes nor after `--option=`):
    the output was written into a new folder literally named `~` in the current directory (`ls` shows `~`, and
    `rm -rf ~` to remove it is the home folder), and `--plot`/`--junit` said `directory ~ does not exist`, hint
    `create it first`. Now each is refused on one line before any work, the hint naming the path meant; nothing
    is written in the current directory or the home folder."""
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.chdir(work)
    res = runner.invoke(app, [a.format(ck=ck) for a in args], env={"HOME": str(home)})
    meant = home / given.split("~/")[1]
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E600] {given}: the shell did not expand ~ (it does not inside quotes or after an option's =); "
        "as given, it names a folder ~ in the current directory, not the home folder",
        f"hint: pass {meant}",
    ], res.stderr
    assert list(work.iterdir()) == [] and list(home.iterdir()) == []


def test_a_folder_named_tilde_that_exists_is_taken_as_given(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder literally named `~` that the user made is an ordinary output location."""
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    (tmp_path / "~").mkdir()
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["export", str(ck), "~/hf"], env={"HOME": str(tmp_path / "home")})
    assert res.exit_code == 0, res.output
    assert (tmp_path / "~" / "hf" / "model.safetensors").is_file() and not (tmp_path / "home").exists()


def test_a_manifest_given_with_an_unexpanded_tilde_is_named_with_its_expansion(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """`validate ck --manifest=~/ck/manifest.json` (no expansion after `=`): the hint said `write one with
    ckpttool manifest DIR` beside a manifest that exists; it now names the path meant."""
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    assert runner.invoke(app, ["manifest", str(ck)]).exit_code == 0
    res = runner.invoke(app, ["validate", str(ck), "--manifest=~/ck/manifest.json"], env={"HOME": str(tmp_path)})
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "error: [E100] ~/ck/manifest.json: no such manifest file",
        "hint: the shell did not expand ~ (it does not inside quotes or after an option's =): "
        f"pass {ck / 'manifest.json'}",
    ], res.stderr
    assert runner.invoke(app, ["validate", str(ck), f"--manifest={ck / 'manifest.json'}"]).exit_code == 0
