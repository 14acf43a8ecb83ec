"""File outputs (``validate --junit``, ``manifest [-o]``, ``stats/diff --plot``) never replace what ckpttool did not write.

Each is written to a temporary name and renamed over its path, which would replace whatever is there: a
checkpoint's own ``.metadata`` or data file, a FIFO or a device node, a user's file. Such paths are refused
with E600 (exit 2) before any work, and the refused path is left byte for byte as it was.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def ckpt(sample_ckpt: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(sample_ckpt, tmp_path / "ckpt")


def _refused(res: object, needle: str) -> None:
    out, err, code = res.stdout, res.stderr, res.exit_code  # type: ignore[attr-defined]
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert lines[0].startswith("error: [E600]") and needle in lines[0], err
    assert lines[1].startswith("hint: ") and "Traceback" not in err


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "report.xml"])
def test_junit_inside_the_checkpoint_is_refused(ckpt: Path, name: str) -> None:
    before = _digests(ckpt)
    res = runner.invoke(app, ["validate", str(ckpt), "--junit", str(ckpt / name)])
    _refused(res, "which this command reads")
    assert _digests(ckpt) == before


def test_junit_over_a_fifo_or_a_foreign_file_is_refused_and_ckpttools_own_is_replaced(
    ckpt: Path, tmp_path: Path
) -> None:
    fifo = tmp_path / "pipe.xml"
    os.mkfifo(fifo)
    _refused(runner.invoke(app, ["validate", str(ckpt), "--junit", str(fifo)]), "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)

    foreign = tmp_path / "results.xml"
    foreign.write_text('<?xml version="1.0"?>\n<testsuites name="pytest"><testsuite/></testsuites>\n')
    _refused(runner.invoke(app, ["validate", str(ckpt), "--junit", str(foreign)]), "is not an output of this kind")
    assert "pytest" in foreign.read_text()

    own = tmp_path / "validate.xml"
    own.write_bytes(b"")  # an empty file (mktemp) holds nothing to lose
    for _ in range(2):  # then the report of the first run is replaced by the second's
        res = runner.invoke(app, ["validate", str(ckpt), "--junit", str(own)])
        assert res.exit_code == 0, res.stderr
        assert '<testsuites name="ckpttool validate"' in own.read_text()


def test_junit_inside_a_separate_optimizer_dir_or_against_dir_is_refused(ckpt: Path, tmp_path: Path) -> None:
    against = tmp_path / "hf"
    against.mkdir()
    res = runner.invoke(app, ["validate", str(ckpt), "--against", str(against), "--junit", str(against / "r.xml")])
    _refused(res, "which this command reads")
    assert list(against.iterdir()) == []


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_manifest_output_over_a_checkpoint_file_is_refused(ckpt: Path, name: str) -> None:
    before = _digests(ckpt)
    res = runner.invoke(app, ["manifest", str(ckpt), "-o", str(ckpt / name)])
    _refused(res, "which this command reads")
    assert _digests(ckpt) == before
    assert runner.invoke(app, ["validate", str(ckpt), "--strict"]).exit_code == 0


def test_manifest_default_path_replaces_only_a_ckpttool_manifest(ckpt: Path, tmp_path: Path) -> None:
    for _ in range(2):  # beside .metadata, and again over the manifest it wrote
        res = runner.invoke(app, ["manifest", str(ckpt)])
        assert res.exit_code == 0, res.stderr
    assert runner.invoke(app, ["manifest", str(ckpt), "--verify"]).exit_code == 0

    (ckpt / "manifest.json").write_text('{"files": ["written by another tool"]}\n')
    res = runner.invoke(app, ["manifest", str(ckpt)])
    _refused(res, "is not an output of this kind")
    assert (ckpt / "manifest.json").read_text() == '{"files": ["written by another tool"]}\n'
    # the hint names a way out, not "no --output", which is what was run
    hint = res.stderr.splitlines()[1]
    assert "--output FILE" in hint and "no --output" not in hint, hint
    out = tmp_path / "elsewhere.json"
    assert runner.invoke(app, ["manifest", str(ckpt), "--output", str(out)]).exit_code == 0
    assert runner.invoke(app, ["manifest", str(ckpt), "--verify", "--output", str(out)]).exit_code == 0

    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    _refused(runner.invoke(app, ["manifest", str(ckpt), "-o", str(fifo)]), "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_plot_inside_a_checkpoint_or_over_a_foreign_picture_is_refused(ckpt: Path, tmp_path: Path) -> None:
    before = _digests(ckpt)
    _refused(runner.invoke(app, ["stats", str(ckpt), "--plot", str(ckpt / "norms.png")]), "which this command reads")
    assert _digests(ckpt) == before
    photo = tmp_path / "holiday.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    _refused(runner.invoke(app, ["stats", str(ckpt), "--plot", str(photo)]), "is not an output of this kind")
    _refused(runner.invoke(app, ["diff", str(ckpt), str(ckpt), "--plot", str(photo)]), "is not an output of this kind")
    assert photo.read_bytes() == b"\x89PNG\r\n\x1a\n" + b"\0" * 64


def test_a_symbolic_link_is_never_replaced(ckpt: Path, tmp_path: Path) -> None:
    """A link inside the checkpoint to an earlier report outside it, or a dangling link: the rename would put a
    regular file where the link is, so the link is refused (and the checkpoint keeps its entries)."""
    earlier = tmp_path / "earlier.xml"
    assert runner.invoke(app, ["validate", str(ckpt), "--junit", str(earlier)]).exit_code == 0
    (ckpt / "link.xml").symlink_to(earlier)
    (tmp_path / "dangling.xml").symlink_to(tmp_path / "nowhere.xml")
    for target in (ckpt / "link.xml", tmp_path / "dangling.xml"):
        _refused(runner.invoke(app, ["validate", str(ckpt), "--junit", str(target)]), "is a symbolic link")
        assert target.is_symlink()
    assert runner.invoke(app, ["manifest", str(ckpt), "-o", str(tmp_path / "dangling.xml")]).exit_code == 2


def test_junit_inside_a_run_roots_other_step_is_refused(ckpt: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    for step in (100, 200):
        shutil.copytree(ckpt, run / f"step-{step}")
    target = run / "step-200" / "r.xml"
    _refused(runner.invoke(app, ["validate", str(run), "--step", "100", "--junit", str(target)]), "which this command")
    assert not target.exists()


def test_manifest_never_lands_on_an_empty_file_of_the_checkpoint(ckpt: Path) -> None:
    (ckpt / "empty.bin").write_bytes(b"")
    _refused(runner.invoke(app, ["manifest", str(ckpt), "-o", str(ckpt / "empty.bin")]), "which this command reads")
    assert (ckpt / "empty.bin").read_bytes() == b""


def test_plot_replaces_only_a_picture_ckpttool_drew(ckpt: Path, tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot", reason="the plot extra is not installed: pip install -e '.[plot]'")
    mine = tmp_path / "my_loss.png"
    fig, ax = plt.subplots()
    ax.plot([3, 2, 1])
    fig.savefig(mine)  # the user's own matplotlib figure
    plt.close(fig)
    before = mine.read_bytes()
    _refused(runner.invoke(app, ["stats", str(ckpt), "--plot", str(mine)]), "is not an output of this kind")
    assert mine.read_bytes() == before
    ours = tmp_path / "norms.png"
    for _ in range(2):  # drawn, then drawn again over itself
        res = runner.invoke(app, ["stats", str(ckpt), "--plot", str(ours)])
        assert res.exit_code == 0, res.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_manifest_writes_inside_the_checkpoint_only_at_its_own_place(ckpt: Path, tmp_path: Path) -> None:
    """Inside the directories read, only ``manifest.json`` beside ``.metadata``: not ``extra_state/``, not a new
    folder, not a run root or another step; on a run root ``--verify`` finds the manifest where it was written."""
    import shutil

    before = _digests(ckpt)
    for target in (ckpt / "extra_state" / "m.json", ckpt / "new" / "deep" / "m.json", ckpt / "layout.json"):
        _refused(runner.invoke(app, ["manifest", str(ckpt), "-o", str(target)]), "which this command reads")
        assert not target.exists()
    assert _digests(ckpt) == before and not (ckpt / "new").exists()

    run = tmp_path / "run"
    for step in (100, 200):
        shutil.copytree(ckpt, run / f"step-{step}")
    for target in (run / "m.json", run / "step-100" / "manifest.json"):
        res = runner.invoke(app, ["manifest", str(run), "--step", "latest", "-o", str(target)])
        _refused(res, "which this command reads")
    assert runner.invoke(app, ["manifest", str(run), "--step", "latest"]).exit_code == 0
    assert (run / "step-200" / "manifest.json").is_file() and not (run / "step-100" / "manifest.json").exists()
    res = runner.invoke(app, ["manifest", str(run), "--step", "latest", "--verify"])
    assert res.exit_code == 0, res.stdout + res.stderr


def test_plot_mark_counts_only_where_ckpttool_puts_it(ckpt: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.html"
    notes.write_text("<!DOCTYPE html>\n<p>ran `ckpttool --plot` yesterday</p>\n")
    _refused(runner.invoke(app, ["stats", str(ckpt), "--plot", str(notes)]), "is not an output of this kind")
    assert "yesterday" in notes.read_text()
    pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")
    for suffix in (".svg", ".html"):
        ours = tmp_path / f"norms{suffix}"
        for _ in range(2):
            res = runner.invoke(app, ["stats", str(ckpt), "--plot", str(ours)])
            assert res.exit_code == 0, res.stderr


def test_manifest_output_over_a_users_file_outside_the_checkpoint_hints_another_file(
    ckpt: Path, tmp_path: Path
) -> None:
    """``manifest CKPT -o notes.txt`` where notes.txt is the user's file outside the checkpoint: refused and kept, but
    the hint said "write the manifest ... to a file outside the checkpoint", which is what was run; it says to
    choose a new file. Inside the checkpoint the hint stays as it was."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    res = runner.invoke(app, ["manifest", str(ckpt), "-o", str(notes)])
    _refused(res, "is not an output of this kind")
    hint = res.stderr.splitlines()[1]
    assert hint.startswith("hint: choose a new file for --output") and "outside the checkpoint" not in hint, hint
    assert notes.read_text() == "precious\n"
    res = runner.invoke(app, ["manifest", str(ckpt), "-o", str(ckpt / ".metadata")])
    _refused(res, "which this command reads")
    assert "outside the checkpoint" in res.stderr.splitlines()[1]


def test_junit_url_is_refused_as_a_url_and_a_file_url_is_the_local_file(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--junit s3://b/v.xml` was the local path ./s3:/b/v.xml ('E600 directory s3:/b does not exist', the URL
    mangled; with a folder s3:/b there, the report went into it) and `--junit file:///r/v.xml` was refused as the
    missing directory file:/r, though a file:// URL is the local path everywhere else (`--plot`, `manifest
    --output`, the checkpoint argument)."""
    work = tmp_path / "cwd"
    (work / "s3:" / "bkt").mkdir(parents=True)
    monkeypatch.chdir(work)
    res = runner.invoke(app, ["validate", str(ckpt), "--junit", "s3://bkt/v.xml"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert lines[0] == "error: [E100] --junit s3://bkt/v.xml: a URL; --junit writes a local file only", res.stderr
    assert lines[1].startswith("hint: ") and "Traceback" not in res.stderr
    assert not any((work / "s3:" / "bkt").iterdir())

    report = tmp_path / "v.xml"
    res = runner.invoke(app, ["validate", str(ckpt), "--junit", f"file://{report}"])
    assert res.exit_code == 0, res.output
    assert report.read_text().startswith("<?xml") and "<testsuite" in report.read_text()
    before = _digests(ckpt)
    _refused(runner.invoke(app, ["validate", str(ckpt), "--junit", f"file://{ckpt}/v.xml"]), "which this command reads")
    assert _digests(ckpt) == before
