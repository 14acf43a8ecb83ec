"""Every command on every hostile/broken checkpoint.

One parametrized test: for each corpus entry (``tests/fixtures/hostile.py``) and
each registered command (with its minimal arguments, plus the entry's own, e.g.
``--model-assets``), the command either succeeds — where the input is merely
unusual or damaged where the command does not read — or fails with one
``error: [Exxx] ...`` line and an optional ``hint:`` line, exit 2 (1 for
``validate`` findings). Always: no traceback, no internal error (E999), no canary
file, the corpus unchanged, nothing written outside the command's output path
(cwd and ``TMPDIR`` are fresh directories that must stay empty; the output path
is nested in directories that do not exist yet, and a failed run must not leave
them), the command's own peak RSS under 1 GiB, no hang (a run still going after ``TIMEOUT_S``
fails), and a command listed in the entry's ``must_fail`` fails with one of the entry's codes.

Round 4 (issue 31) adds ``import`` (a DCP checkpoint is refused, ``E100``; the Hugging Face entries are
imported) and ``manifest --verify``, and entries whose source is named like OUT's temporary: those run with
OUT beside the source, which must still exist, unchanged, with nothing but OUT beside it.

The full product (every command on every entry) is ``-m heavy``; by default (``-m "not heavy"``,
CI) a fixed subset runs: ``validate-deep`` on every entry — every entry through the command whose
job is to notice damage, reading all data — plus a rotation of the other commands so that each
entry meets one or two more commands and each command meets every kind of entry (:func:`in_default_subset`;
round 4's entries and commands run a fixed slice, :data:`ROUND4_DEFAULT`).
The wall time of the runs is a benchmark figure (docs/performance.md), not asserted here.

Commands land progressively: the matrix covers the commands registered in
``ckpttool.cli.app`` now, and ``test_every_command_is_in_the_matrix`` fails when a
new command has no minimal argument list here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.hostile import CANARY_DIRNAME, ENTRY_NAMES, ROUND4_NAMES, TMP_OUT, CorpusEntry
from tests.fixtures.special_files import fails_instead_of_hanging

runner = CliRunner()

# torch creates $TMPDIR/torchinductor_<user> when torch.optim is first imported (replay-step): import it
# now, so that the cache directory lands in the session's TMPDIR, not in a test's isolated one.
import torch._inductor.config  # noqa: E402,F401

# command id -> (CLI command name, argv builder(ckpt, out)); the minimal arguments of each command.
MATRIX: dict[str, tuple[str, Callable[[Path, Path], list[str]]]] = {
    "inspect": ("inspect", lambda ck, out: ["inspect", str(ck)]),
    "inspect-json": ("inspect", lambda ck, out: ["inspect", str(ck), "--json"]),
    "validate": ("validate", lambda ck, out: ["validate", str(ck)]),
    "validate-deep": ("validate", lambda ck, out: ["validate", str(ck), "--strict", "--deep"]),
    "export": ("export", lambda ck, out: ["export", str(ck), str(out)]),
    # the transform path: every floating tensor cast and expert tensors split, slab by slab
    "export-cast": (
        "export",
        lambda ck, out: ["export", str(ck), str(out), "--save-dtype", "float16", "--experts", "per-expert"],
    ),
    "reshard": ("reshard", lambda ck, out: ["reshard", str(ck), str(out), "--to", "canonical"]),
    "reshard-optim": (
        "reshard",
        lambda ck, out: ["reshard", str(ck), str(out), "--to", "canonical", "--with-optimizer"],
    ),
    "stamp": (
        "stamp",
        lambda ck, out: ["stamp", str(ck), "--source-layout", "canonical", "--ep-size", "1", "--ep-fsdp-size", "1"],
    ),
    "replay-step": ("replay-step", lambda ck, out: ["replay-step", str(ck), "--device", "cpu"]),
    "diff": ("diff", lambda ck, out: ["diff", str(ck), str(ck), "--what", "all"]),
    "manifest": ("manifest", lambda ck, out: ["manifest", str(ck), "--output", str(out)]),
    "stats": ("stats", lambda ck, out: ["stats", str(ck)]),
    # round 4: import reads a Hugging Face folder (a DCP checkpoint is refused, E100); the manifest check
    "import": ("import", lambda ck, out: ["import", str(ck), str(out)]),
    "manifest-verify": ("manifest", lambda ck, out: ["manifest", str(ck), "--verify"]),
}
NOT_ON_CHECKPOINTS = {"sample", "rules", "schema"}  # take no input checkpoint
WRITES_OUT = {"export", "export-cast", "reshard", "reshard-optim", "manifest", "import"}
# exit 1: ran and found problems
FINDINGS_EXIT_1 = {"validate", "validate-deep", "replay-step", "manifest-verify"}
TIMEOUT_S = 180  # a hang is a failure, not a wait
RSS_BUDGET = 1 << 30  # the contract: a run's own peak resident memory stays below 1 GiB

ERROR_RE = re.compile(r"^error: \[(E\d{3})\] \S.*$")


def registered_commands() -> set[str]:
    """Names of the commands registered in the Typer app."""
    names = set()
    for info in app.registered_commands:
        names.add(info.name or info.callback.__name__.replace("_", "-"))  # type: ignore[union-attr]
    return names


REGISTERED = registered_commands()
COMMAND_IDS = [cid for cid, (name, _) in MATRIX.items() if name in REGISTERED]


def test_every_command_is_in_the_matrix() -> None:
    missing = REGISTERED - NOT_ON_CHECKPOINTS - {name for name, _ in MATRIX.values()}
    assert not missing, f"add minimal arguments for {sorted(missing)} to MATRIX"


# --------------------------------------------------------------------------- corpus (tests/security/conftest.py)
def snapshot(root: Path) -> dict[str, tuple]:
    """Relative path -> (mode, size, mtime, content hash for files up to 4 MiB, link target)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            digest = link = None
            if p.is_symlink():
                link = os.readlink(p)
            elif p.is_file() and st.st_size <= 4 << 20:
                digest = hashlib.sha1(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest, link)
    return out


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0); ``False`` where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def copy_entry(src: Path, dst: Path) -> None:
    """Copy a corpus entry keeping symlinks, FIFOs, devices and holes as they are (``cp -a --sparse=always``)."""
    subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)


@contextmanager
def _isolated(work: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """cwd = ``work/cwd`` and TMPDIR = ``work/tmp``, both empty; yields the TMPDIR path."""
    cwd, tmp = work / "cwd", work / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


# --------------------------------------------------------------------------- the contract
def assert_contract(cid: str, entry: CorpusEntry, exit_code: int, stdout: str, stderr: str) -> None:
    """The output half of the contract (exit code, stderr shape, codes); see the module docstring."""
    where = f"{cid} on {entry.name}: exit {exit_code}\nstdout: {stdout[-2000:]}\nstderr: {stderr[-2000:]}"
    assert "Traceback" not in stdout and "Traceback" not in stderr, where
    assert exit_code in (0, 1, 2), where
    if exit_code == 1:
        assert cid in FINDINGS_EXIT_1, where
    if cid in entry.must_fail:
        assert exit_code != 0, f"must fail: {where}"
    if entry.unusual and cid in {"inspect", "inspect-json", "validate"}:
        assert exit_code in (0, 1), f"merely unusual input must be readable: {where}"
    if exit_code == 0:
        if cid.endswith("-json"):
            json.loads(stdout)
        return
    lines = stderr.splitlines()
    if exit_code == 1 and not any(ln.startswith("error:") for ln in lines):
        return  # validate/replay findings: reported on stdout
    assert 1 <= len(lines) <= 2, f"stderr must be one error line and an optional hint: {where}"
    m = ERROR_RE.match(lines[0])
    assert m, f"error line format: {where}"
    assert len(lines) == 1 or lines[1].startswith("hint: "), where
    code = m.group(1)
    assert code != "E999", f"internal error: {where}"
    if cid.endswith("-json") and stdout:
        json.loads(stdout)  # machine output stays parseable even when the command fails
    if cid in entry.must_fail and entry.codes:
        assert any(code.startswith(c) for c in entry.codes), f"expected one of {sorted(entry.codes)}: {where}"


ALWAYS = "validate-deep"  # runs on every entry in the default subset
LARGE_ENTRIES = ("many_chunks", "many_entries")
ROTATION = 8  # each entry also meets every ROTATION-th of the other commands (1-2 of them; all under -m heavy)
# Round 4 (issue 31): its entries and commands run in full under -m heavy; by default a representative slice,
# each entry through the command whose job is to notice its damage (CI time).
ROUND4_COMMANDS = ("import", "manifest-verify")
ROUND4_DEFAULT = {
    "manifest_record_stride_swap": ("manifest-verify",),
    "manifest_hf_added_shard": ("manifest-verify",),
    "temp_named_source": ("export",),
    "temp_named_forged_marker": ("import",),
    "hf_shard_deleted": ("validate-deep",),
    "import_expert_99999999999": ("import",),
    "config_layers_200000": ("export",),
    "record_view_offset_huge": ("validate-deep",),
}


def in_default_subset(cid: str, entry_name: str) -> bool:
    """Whether (command, entry) runs without ``-m heavy``: deterministic, every entry of rounds 1-3 at least twice
    (:data:`LARGE_ENTRIES` once),
    round 4's slice (:data:`ROUND4_DEFAULT`)."""
    if entry_name in ROUND4_NAMES:
        return cid in ROUND4_DEFAULT.get(entry_name, ())
    if cid in ROUND4_COMMANDS:
        return False
    if cid == ALWAYS:
        return True
    if entry_name in LARGE_ENTRIES:  # 10^5 chunks or entries: validate-deep only (CI time)
        return False
    others = [c for c in COMMAND_IDS if c != ALWAYS and c not in ROUND4_COMMANDS]
    return (others.index(cid) + ENTRY_NAMES.index(entry_name)) % ROTATION == 0


def matrix_cases() -> list:  # type: ignore[type-arg]
    """Every (command, entry) pair; those outside :func:`in_default_subset` marked ``heavy``."""
    return [
        pytest.param(cid, name, id=f"{cid}-{name}", marks=() if in_default_subset(cid, name) else pytest.mark.heavy)
        for name in ENTRY_NAMES
        for cid in COMMAND_IDS
    ]


def test_the_default_subset_covers_every_entry_and_command() -> None:
    default = [(c, n) for c in COMMAND_IDS for n in ENTRY_NAMES if in_default_subset(c, n)]
    assert {n for _, n in default} == set(ENTRY_NAMES) - set(ROUND4_NAMES) | set(ROUND4_DEFAULT)
    assert {c for c, _ in default} == set(COMMAND_IDS)
    for name in ENTRY_NAMES:
        if name not in ROUND4_NAMES:
            assert (ALWAYS, name) in default and sum(n == name for _, n in default) >= (
                1 if name in LARGE_ENTRIES else 2
            ), name
    assert set(ROUND4_DEFAULT) <= set(ROUND4_NAMES)


@pytest.mark.parametrize(("cid", "entry_name"), matrix_cases())
def test_command_on_hostile_checkpoint(
    cid: str, entry_name: str, corpus: dict[str, CorpusEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = corpus[entry_name]
    root = entry.ckpt.parent.parent
    canary_dir = root / CANARY_DIRNAME
    ckpt = entry.ckpt
    beside = bool(entry.extra.get("out_beside"))  # OUT beside the source (named like OUT's temporary)
    if cid == "stamp" or beside:  # stamp writes layout.json into the checkpoint: give it its own copy
        copy_entry(entry.ckpt.parent, tmp_path / "entry")
        ckpt = tmp_path / "entry" / entry.ckpt.name
    stamp_before = snapshot(ckpt.parent) if cid == "stamp" or beside else None
    out = tmp_path / "nested" / "a" / "b" / "OUT"  # parents a failed run must not leave behind
    if beside:
        out = ckpt.parent / TMP_OUT
    argv = MATRIX[cid][1](ckpt, out) + list(entry.extra.get("args", {}).get(cid, []))
    before = snapshot(root)
    with _isolated(tmp_path, monkeypatch) as tmpdir, fails_instead_of_hanging(TIMEOUT_S, "a command hung"):
        rss_before = _rss_kib("VmRSS") if _reset_peak_rss() else None
        res = runner.invoke(app, argv)
        peak = _rss_kib("VmHWM")

    assert not any(canary_dir.iterdir()), f"a payload ran: {sorted(os.listdir(canary_dir))}"
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert_contract(cid, entry, res.exit_code, res.stdout, res.stderr)
    assert snapshot(root) == before, "the corpus (source checkpoint) was modified"
    assert not any((tmp_path / "cwd").iterdir()), "files created in the working directory"
    assert not any(tmpdir.iterdir()), f"files left in TMPDIR: {os.listdir(tmpdir)}"
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    expected = {"cwd", "tmp"} | ({"entry"} if cid == "stamp" or beside else set())
    if cid in WRITES_OUT and res.exit_code == 0 and not beside:
        expected.add("nested")
    assert set(leftovers) == expected, f"output outside the output path, or a failed run left output: {leftovers}"
    if stamp_before is not None:  # stamp (may add layout.json) and OUT beside the source (may add OUT, nothing else)
        after = snapshot(ckpt.parent)
        outs = {k for k in after if beside and (k == TMP_OUT or k.startswith(TMP_OUT + "/"))}
        wrote = beside and cid in WRITES_OUT and res.exit_code == 0
        assert ckpt.is_dir(), "the source was removed (as a stale temporary?)"
        assert (TMP_OUT in outs) == wrote, f"OUT beside the source: {sorted(outs)[:5]}"
        added = set(after) - outs - set(stamp_before)
        changed = {k for k in stamp_before if after.get(k) != stamp_before[k] and k != ckpt.name}
        assert not changed, f"{cid} changed existing files: {changed}"
        assert added <= ({f"{ckpt.name}/layout.json"} if cid == "stamp" and res.exit_code == 0 else set()), added
    if rss_before is not None and peak is not None:
        grew = (peak - rss_before) << 10
        assert grew < RSS_BUDGET, f"{cid} on {entry_name}: peak RSS grew by {grew / 2**20:.0f} MiB"


def test_export_of_odd_keys_is_loadable_or_refused(corpus: dict[str, CorpusEntry], tmp_path: Path) -> None:
    if "export" not in REGISTERED:
        pytest.skip("`ckpttool export` is not registered yet")
    from safetensors import safe_open

    out = tmp_path / "out"
    res = runner.invoke(app, ["export", str(corpus["odd_keys"].ckpt), str(out)])
    if res.exit_code == 2:
        assert ERROR_RE.match(res.stderr.splitlines()[0]) and "E999" not in res.stderr
        return
    assert res.exit_code == 0, res.stderr
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            assert len(list(st.keys())) > 0
