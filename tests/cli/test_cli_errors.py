"""Bad input to `ckpttool inspect`: one `error:` line naming the file/key, a hint, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _canary(path: str) -> None:
    """Would prove code execution: creates ``path`` if ever called."""
    Path(path).write_text("executed")


class _CanaryPayload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_canary, (self.path,))


def assert_clean_failure(res, code: str, *needles: str, exit_code: int = 2) -> None:  # type: ignore[no-untyped-def]
    assert res.exit_code == exit_code, (res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: [{code}]"), res.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def inspect(path: Path):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["inspect", str(path)])


def test_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    assert_clean_failure(inspect(f), "E100", "not a directory")
    assert_clean_failure(inspect(tmp_path / "nope"), "E100", "no such directory")


def test_a_torch_save_file_is_not_sent_to_its_directory(tmp_path: Path, dense_ckpt: Path) -> None:
    """``inspect model.pt`` hinted ``pass the checkpoint directory ..., not a file in it: DIR`` for a DIR that
    holds no checkpoint; only a file inside a checkpoint (here a data file) names its directory."""
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    res = inspect(tmp_path / "model.pt")
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: [E100] {tmp_path / 'model.pt'} is not a directory",
        f"hint: pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files; {tmp_path} "
        "holds none): a single torch.save file (.pt, .bin) is not a distributed checkpoint",
    ]
    res = inspect(dense_ckpt / "__0_0.distcp")
    assert res.stderr.splitlines()[1] == (
        f"hint: pass the checkpoint directory (the one holding .metadata), not a file in it: {dense_ckpt}"
    )


def test_a_data_file_of_an_unfinished_save_names_its_folder_and_why(tmp_path: Path, dense_ckpt: Path) -> None:
    """`inspect step-3/__0_0.distcp` where step-3's save did not finish (data file, no .metadata) hinted
    "(it holds .metadata and __R_N.distcp files; step-3 holds none): a single torch.save file (.pt, .bin) is not a
    distributed checkpoint": step-3 holds a data file, and the file is one. The hint now says what step-3 holds and
    why it cannot be opened; `diff` (which takes safetensors files) says the same."""
    step = tmp_path / "run" / "step-3"
    shutil.copytree(dense_ckpt, step)
    (step / ".metadata").unlink()  # dcp.save writes .metadata last: the save was interrupted before it
    data = sorted(step.glob("__*.distcp"))
    hint = (
        f"hint: {step} holds {len(data)} data file(s), no .metadata: its save did not finish (or an async save is "
        f"still running); wait for it and pass {step}, or pass an earlier complete checkpoint directory"
    )
    before = {p.name: p.read_bytes() for p in step.iterdir() if p.is_file()}
    for argv in (["inspect", str(data[0])], ["validate", str(data[0])], ["export", str(data[0]), str(tmp_path / "o")]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2 and res.stdout == ""
        assert res.stderr.splitlines() == [f"error: [E100] {data[0]} is not a directory", hint]
    res = runner.invoke(app, ["diff", str(data[0]), str(dense_ckpt)])
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: [E610] {data[0]}: a file that is not a .safetensors file",
        hint,
    ]
    assert {p.name: p.read_bytes() for p in step.iterdir() if p.is_file()} == before  # the source untouched
    assert not (tmp_path / "o").exists()


def test_a_run_root_hint_can_be_followed_as_written(tmp_path: Path, dense_ckpt: Path) -> None:
    """`inspect run/` (step-1, step-2, an interrupted step-3) hinted "pick one with --step N|latest": pasted as
    written, the shell pipes into a command `latest`. The hint now spells both forms, and `--step latest` as
    written opens the newest complete step."""
    root = tmp_path / "run"
    for s in (1, 2, 3):
        shutil.copytree(dense_ckpt, root / f"step-{s}")
    (root / "step-3" / ".metadata").unlink()  # the last save was interrupted before its .metadata
    res = inspect(root)
    assert res.exit_code == 2 and res.stdout == ""
    hint = res.stderr.splitlines()[1]
    assert hint == (
        f"hint: pick one with --step latest or --step N (steps 1, 2, 3 (incomplete)), or pass a directory, e.g. "
        f"{root / 'step-2'}"
    )
    ok = runner.invoke(app, ["inspect", str(root), "--step", "latest"])
    assert ok.exit_code == 0 and f"checkpoint  {root / 'step-2'}" in ok.stdout, ok.stderr


def test_an_interrupted_step_given_itself_names_the_step_to_pass(tmp_path: Path, dense_ckpt: Path) -> None:
    """`inspect run/step-3`, whose save was interrupted (data files, no .metadata), hinted "use an earlier
    checkpoint" without naming one though step-2 beside it is complete. The hint now names it, and the command
    as the hint says runs."""
    root = tmp_path / "run"
    for s in (1, 2, 3):
        shutil.copytree(dense_ckpt, root / f"step-{s}")
    (root / "step-3" / ".metadata").unlink()
    for argv in (["inspect"], ["validate", "--strict"]):
        res = runner.invoke(app, [*argv, str(root / "step-3")])
        assert res.exit_code == 2, res.output
        assert res.stderr.splitlines() == [
            f"error: [E202] {root / 'step-3'}: has .distcp data files but no .metadata (incomplete save)",
            "hint: the save did not finish (crashed or async save still running); wait for it, or pass the newest "
            f"complete step before it: {root / 'step-2'}",
        ]
    ok = inspect(Path(res.stderr.rsplit(": ", 1)[1].strip()))
    assert ok.exit_code == 0 and f"checkpoint  {root / 'step-2'}" in ok.stdout, ok.stderr
    (root / "step-2" / ".metadata").unlink()  # no complete step after step-1 either: step-1 is named
    res = inspect(root / "step-3")
    assert res.stderr.splitlines()[1].endswith(f"before it: {root / 'step-1'}")


def test_a_run_root_hint_names_a_step_not_an_export_beside_the_steps(tmp_path: Path, dense_ckpt: Path) -> None:
    """An export written into the run's folder (`export run/step-2 run/hf`), listed after the steps, was the
    hint's example: "or pass a directory, e.g. run/hf", the export instead of a training step. The example is
    now the newest complete step."""
    root = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(dense_ckpt, root / f"step-{s}")
    res = runner.invoke(app, ["export", str(root / "step-2"), str(root / "hf"), "-q"])
    assert res.exit_code == 0, res.stderr
    res = inspect(root)
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: [E204] {root}: no .metadata; 3 checkpoints below it: step-1; step-2; hf",
        f"hint: pick one with --step latest or --step N (steps 1, 2), or pass a directory, e.g. {root / 'step-2'}",
    ]


def test_missing_path_hint_names_the_close_directory(tmp_path: Path) -> None:
    """A typo'd path: the hint names the directory it most likely meant (the rest of the path kept), a file
    given in place of the directory names that directory, and a path with nothing close lists what is there."""
    (tmp_path / "run" / "checkpoint" / "step-100").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "step-100" / ".metadata").write_bytes(b"")
    res = inspect(tmp_path / "rnu" / "checkpoint")
    assert res.stderr.splitlines() == [
        f"error: [E100] {tmp_path / 'rnu' / 'checkpoint'}: no such directory",
        f"hint: did you mean {tmp_path / 'run' / 'checkpoint'}?",
    ]
    res = inspect(tmp_path / "run" / "checkpoint" / "step-10")
    assert res.stderr.splitlines()[1] == f"hint: did you mean {tmp_path / 'run' / 'checkpoint' / 'step-100'}?"
    res = inspect(tmp_path / "run" / "checkpoint" / "step-100" / ".metadata")
    assert res.stderr.splitlines()[1] == (
        "hint: pass the checkpoint directory (the one holding .metadata), not a file in it: "
        f"{tmp_path / 'run' / 'checkpoint' / 'step-100'}"
    )
    res = inspect(tmp_path / "zzzzzz" / "a")
    assert res.stderr.splitlines()[1] == f"hint: pass the checkpoint directory; {tmp_path} holds run"
    res = runner.invoke(app, ["import", str(tmp_path / "rnu"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.splitlines()[1] == f"hint: did you mean {tmp_path / 'run'}?"


@pytest.mark.parametrize("cmd", ["inspect", "validate", "export", "stats"])
def test_a_folder_inside_a_checkpoint_hints_the_checkpoint(cmd: str, sample_ckpt: Path, tmp_path: Path) -> None:
    """``export CKPT/model_assets OUT`` (the assets folder given for the checkpoint) hinted ``pass the
    directory that dcp.save wrote ...``, though the checkpoint is right above: the hint names it. A folder
    with no checkpoint above it keeps the general hint."""
    extra = [str(tmp_path / "out")] if cmd == "export" else []
    res = runner.invoke(app, [cmd, str(sample_ckpt / "model_assets"), *extra])
    assert res.exit_code == 2 and not (tmp_path / "out").exists(), res.stderr
    err, hint = res.stderr.splitlines()[-2:]
    assert err.startswith(f"error: [E200] {sample_ckpt / 'model_assets'}: no .metadata"), err
    assert hint == f"hint: pass the checkpoint directory {sample_ckpt} (model_assets/ is a folder inside it)", hint
    (tmp_path / "plain").mkdir()
    res = runner.invoke(app, [cmd, str(tmp_path / "plain"), *extra])
    assert res.stderr.splitlines()[-1].startswith("hint: pass the directory that dcp.save wrote"), res.stderr


@pytest.mark.parametrize("cmd", ["inspect", "validate", "export", "stats", "manifest"])
def test_a_file_in_a_folder_of_a_checkpoint_hints_the_checkpoint(cmd: str, sample_ckpt: Path, tmp_path: Path) -> None:
    """``inspect CKPT/model_assets/config.json`` (a file one folder down in the checkpoint) hinted ``pass the
    directory that dcp.save wrote (... CKPT/model_assets holds none): a single torch.save file (.pt, .bin) is not a
    distributed checkpoint`` -- the checkpoint right above went unnamed, and config.json is no torch.save file. The
    hint names the checkpoint, as for its folder; a file in a folder that is no checkpoint keeps the general hint."""
    extra = [str(tmp_path / "out")] if cmd == "export" else []
    for inner in ("model_assets/config.json", "extra_state/extra_state_rank_0.pt"):
        res = runner.invoke(app, [cmd, str(sample_ckpt / inner), *extra])
        assert res.exit_code == 2 and not (tmp_path / "out").exists(), res.stderr
        assert res.stderr.splitlines()[-2:] == [
            f"error: [E100] {sample_ckpt / inner} is not a directory",
            f"hint: pass the checkpoint directory {sample_ckpt} ({inner} is a file inside it)",
        ], res.stderr
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.pt").write_bytes(b"x")
    res = runner.invoke(app, [cmd, str(tmp_path / "plain" / "model.pt"), *extra])
    assert res.stderr.splitlines()[-1].startswith("hint: pass the directory that dcp.save wrote"), res.stderr


def test_version_and_help_given_as_commands_hint_their_flags(sample_ckpt: Path) -> None:
    """`ckpttool version` and `ckpttool help inspect` (commands in other CLIs) got no did-you-mean, only `see
    ckpttool --help`; `ckpttool inspect DIR --install-completion` was "No such option", though --version there says
    where it goes. Each hint now names the flag that does it."""
    cases = {
        ("version",): ("No such command 'version'.", "the versions are printed by `ckpttool --version` (-V)"),
        ("help",): ("No such command 'help'.", "help is `ckpttool --help` (-h)"),
        ("help", "replay-step"): ("No such command 'help'.", "a command's help is `ckpttool replay-step --help`"),
        ("inspect", str(sample_ckpt), "--install-completion"): (
            "--install-completion is an option of ckpttool itself, given after the command name",
            "run `ckpttool --install-completion [SHELL]` alone",
        ),
        ("validate", "--show-completion", "zsh"): (
            "--show-completion is an option of ckpttool itself, given after the command name",
            "run `ckpttool --show-completion [SHELL]` alone",
        ),
    }
    for args, (error, hint) in cases.items():
        res = runner.invoke(app, list(args))
        assert (res.exit_code, res.stdout) == (2, ""), res.output
        assert res.stderr.splitlines() == [f"error: [E100] {error}", f"hint: {hint}"], res.stderr
    res = runner.invoke(app, ["versoin"])  # any other word keeps the general hint
    assert res.stderr.splitlines()[-1] == "hint: see `ckpttool --help`", res.stderr


def test_step_given_as_a_directory_name_hints_its_number(tmp_path: Path) -> None:
    for given, hint in (
        ("step-200", "hint: give the step's number, --step 200, or pass that directory itself"),
        ("iter_0000200", "hint: give the step's number, --step 200, or pass that directory itself"),
        ("lates", "hint: e.g. --step 200, or --step latest for the newest complete step"),
        # a superscript is a digit to str.isdigit, not to int(): it was E999 'internal error: ValueError'
        ("\u00b2", "hint: e.g. --step 200, or --step latest for the newest complete step"),
        # torchtitan's load_step -1 (its newest step) hinted --step 1, the oldest; 10.0 hinted --step 0
        (
            "-1",
            "hint: a step number is 0 or more (torchtitan's load_step -1 means its newest step): --step latest for "
            "the newest complete step, or e.g. --step 200",
        ),
        ("10.0", "hint: e.g. --step 200, or --step latest for the newest complete step"),
        # a number in another notation hinted the digits after its letter: 1e3 (1000) hinted --step 3
        ("1e3", "hint: e.g. --step 200, or --step latest for the newest complete step"),
        ("0x10", "hint: e.g. --step 200, or --step latest for the newest complete step"),
    ):
        res = runner.invoke(app, ["inspect", str(tmp_path), "--step", given])
        assert res.exit_code == 2 and res.stderr.splitlines() == [
            f"error: [E100] --step {given!r} is not a step number or 'latest'",
            hint,
        ]


def test_unknown_hash_is_named_by_its_flag_in_every_command(sample_ckpt: Path, tmp_path: Path) -> None:
    """export/reshard/import --hash md7 was E999 (KeyError from the source identity), manifest's named `algorithm`."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.zeros(2)}, str(hf / "model.safetensors"))
    want = [
        "error: [E100] --hash 'md7' is not one of xxh3-128, blake3, blake2b-256",
        "hint: xxh3-128 is the fast default; blake3 is cryptographic",
    ]
    for args in (
        ["manifest", str(sample_ckpt), "--hash", "md7"],
        ["export", str(sample_ckpt), str(tmp_path / "o1"), "--manifest", "--hash", "md7"],
        ["reshard", str(sample_ckpt), str(tmp_path / "o2"), "--to", "canonical", "--with-optimizer", "--hash", "md7"],
        ["import", str(hf), str(tmp_path / "o3"), "--manifest", "--hash", "md7"],
    ):
        res = runner.invoke(app, args)
        assert (res.exit_code, res.stderr.splitlines()) == (2, want), (args, res.stderr)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "hf"]
    res = runner.invoke(app, ["--storage-option", "foo", "inspect", "s3://bucket/x"])
    assert res.exit_code == 2 and "'--storage-option': 'foo' is not of the form key=value" in res.stderr


def test_no_metadata(tmp_path: Path) -> None:
    assert_clean_failure(inspect(tmp_path), "E200", "no .metadata")


def test_incomplete_save(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    (ck / ".metadata").unlink()
    assert_clean_failure(inspect(ck), "E202", "incomplete save")


def test_validate_of_an_incomplete_save_names_its_directory_once(tmp_path: Path, dense_ckpt: Path) -> None:
    """validate printed ``error: [E202] CK/.metadata: CK: has .distcp data files ...``: the path twice, the
    first of a file that does not exist; the finding's key is the directory, and the lines are inspect's."""
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    (ck / ".metadata").unlink()
    res = runner.invoke(app, ["validate", str(ck)])
    assert res.exit_code == 2 and res.stderr == runner.invoke(app, ["inspect", str(ck)]).stderr
    assert res.stderr.startswith(f"error: [E202] {ck}: has .distcp data files but no .metadata (incomplete save)\n")
    doc = json.loads(runner.invoke(app, ["validate", str(ck), "--json"]).stdout)
    assert [(f["code"], f["key"]) for f in doc["findings"]] == [("S001", str(ck))]


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "is empty"),
        (b"\x80\x04\x95garbage", "not a readable pickle"),
        (os.urandom(4096), ".metadata"),
        (pickle.dumps({"a": 1}), "not a DCP Metadata"),
    ],
    ids=["empty", "truncated", "random", "wrong-type"],
)
def test_bad_metadata(tmp_path: Path, dense_ckpt: Path, content: bytes, needle: str) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    (ck / ".metadata").write_bytes(content)
    res = inspect(ck)
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: [E20")
    assert needle in res.stderr.splitlines()[0]


def test_truncated_real_metadata(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    data = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(data[: len(data) // 2])
    assert_clean_failure(inspect(ck), "E200", ".metadata")


def test_refused_pickle_global_never_runs(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    canary = tmp_path / "canary"
    (ck / ".metadata").write_bytes(pickle.dumps(_CanaryPayload(str(canary))))
    assert_clean_failure(inspect(ck), "E201", "tests.cli.test_cli_errors._canary")
    assert not canary.exists()


def test_path_escaping_directory(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    shutil.copy(ck / "__0_0.distcp", tmp_path / "outside.distcp")
    md = dcp.FileSystemReader(str(ck)).read_metadata()
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert_clean_failure(inspect(ck), "E101", "../outside.distcp", "outside the checkpoint")


def test_symlinked_data_file_escaping(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    shutil.move(ck / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    (ck / "__0_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    assert_clean_failure(inspect(ck), "E101", "__0_0.distcp")


def test_short_and_missing_data_file(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    with open(ck / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    assert_clean_failure(inspect(ck), "E300", "__0_0.distcp", "truncated")
    (ck / "__0_0.distcp").unlink()
    assert_clean_failure(inspect(ck), "E300", "__0_0.distcp", "missing")


def test_trust_pickle_option_reads_extra_state(tmp_path: Path, dense_ckpt: Path) -> None:
    import fractions
    import json

    import torch

    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    (ck / "extra_state").mkdir()
    torch.save({"ratio": fractions.Fraction(1, 3), "global_step": 7}, ck / "extra_state" / "extra_state_rank_0.pt")
    res = runner.invoke(app, ["inspect", "--json", "--trust-pickle", str(ck)])
    assert res.exit_code == 0
    (extra,) = json.loads(res.stdout)["extra_state"]
    assert extra["status"] == "ok" and extra["global_step"] == 7


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["inspect", "--bogus", "X"], "--bogus"),
        (["inspect", "X", "--depth", "0"], "--depth"),
        (["inspect", "X", "--sort", "foo"], "--sort"),
        (["inspect"], "Missing argument"),
        (["frob"], "No such command 'frob'"),
        (["--remote-workers", "0", "inspect", "X"], "--remote-workers"),
        (["--remote-retries", "-1", "inspect", "X"], "--remote-retries"),
        (["--remote-spool-size", "1x", "inspect", "X"], "--remote-spool-size"),
        (["--remote-spool-size", "0", "inspect", "X"], "--remote-spool-size"),
    ],
    ids=[
        "unknown-option",
        "bad-depth",
        "bad-choice",
        "missing-arg",
        "unknown-command",
        "zero-remote-workers",
        "negative-remote-retries",
        "bad-spool-size",
        "zero-spool-size",
    ],
)
def test_usage_errors_follow_the_error_contract(argv: list[str], needle: str) -> None:
    res = runner.invoke(app, argv)
    assert_clean_failure(res, "E100", needle)
    assert "--help" in res.stderr.splitlines()[1]


@pytest.mark.parametrize(
    "argv, help_line",
    [
        (["inspect", "X", "--filter"], "hint: see `ckpttool inspect --help`"),
        (["-v", "export", "X", "OUT", "--shard-size"], "hint: see `ckpttool export --help`"),
        (["validate", "--select"], "hint: see `ckpttool validate --help`"),
        (["--color"], "hint: see `ckpttool --help`"),
    ],
)
def test_an_option_without_its_value_hints_its_commands_help(argv: list[str], help_line: str) -> None:
    """``inspect X --filter`` (the value left out) hinted ``see `ckpttool --help```, whose help lists no
    ``--filter``: click raises that error without the command's context. The hint names the command whose
    option it is; a root option's own missing value still names the root's help."""
    res = runner.invoke(app, argv)
    assert_clean_failure(res, "E100", f"Option '{argv[-1]}' requires an argument.")
    assert res.stderr.splitlines()[1] == help_line


@pytest.mark.parametrize("cmd", ["sample", "replay-step"])
def test_a_bad_value_names_the_option_as_help_shows_it(cmd: str, tmp_path: Path) -> None:
    """``sample DIR --optimizer-type sgd`` said ``Invalid value for '--optimizer-type' / '--optimizer'``,
    naming the deprecated spelling that --help leaves out; the error names the option as --help does."""
    for flag in ("--optimizer-type", "--optimizer"):
        res = runner.invoke(app, [cmd, str(tmp_path / "x"), flag, "sgd"])
        assert_clean_failure(res, "E100", "Invalid value for '--optimizer-type': 'sgd' is not one of")
        assert "'--optimizer'" not in res.stderr and not (tmp_path / "x").exists()


def test_export_option_errors_hint_a_fix_not_the_help(sample_ckpt: Path, tmp_path: Path) -> None:
    """``export --allow-mismatch shapes`` and a missing ``--adapter-config`` file were hinted only ``run the
    command with --help``: the hints name the fix."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--allow-mismatch", "shapes"])
    assert_clean_failure(res, "E100", "--allow-mismatch 'shapes' is not one of missing, unexpected, shape, dtype")
    assert res.stderr.splitlines()[1] == (
        "hint: did you mean 'shape'? give a comma list of missing, unexpected, shape, dtype, "
        "e.g. --allow-mismatch shape,dtype"
    )
    cfg = tmp_path / "adapter_config.json"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--format", "lora", "--adapter-config", str(cfg)])
    assert_clean_failure(res, "E100", f"{cfg}: cannot read adapter config")
    hint = res.stderr.splitlines()[1]
    assert hint.startswith("hint: pass the adapter_config.json that PEFT wrote") and "--adapter-config" in hint
    assert not out.exists()


def test_no_cache_help_names_both_caches() -> None:
    res = runner.invoke(app, ["--help"])
    text = " ".join(res.stdout.split())
    line = text[text.index("--no-cache") :][:300]
    assert "parsed-metadata cache" in line and "model-shape cache" in line, line


def test_no_arguments_prints_help() -> None:
    res = runner.invoke(app, [])
    assert res.exit_code == 0 and "Commands" in res.stdout


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "--json"], ["validate", "--strict"]])
def test_closed_stdout_is_not_a_failure(argv: list[str], sample_ckpt: Path) -> None:
    """`ckpttool inspect DIR | head -1`: the reader going away is a normal stop (exit 0), not 1."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", "from ckpttool.cli import main; main()", *argv, str(sample_ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "error" not in err


def test_a_stdout_that_cannot_encode_a_key_escapes_it(tmp_path: Path) -> None:
    """`inspect` on a stdout whose encoding cannot hold a key's characters (PYTHONIOENCODING=ascii, a cp1252
    console) printed half its report, then 'error: [E999] internal error: UnicodeEncodeError' (exit 2). The
    character is now escaped (as Python's own stderr does) and the report is whole."""
    import subprocess
    import sys

    from tests.fixtures.builders import save_quiet

    ckpt = tmp_path / "ck"
    save_quiet({"model": {"caf\u00e9.weight": torch.ones(2), "e\u0301.bias": torch.ones(1)}}, ckpt)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "120"}
    proc = subprocess.run(
        [sys.executable, "-m", "ckpttool", "inspect", str(ckpt)], capture_output=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode("ascii")
    assert "model.caf\\xe9.weight" in out and "model.e\\u0301.bias" in out and "layout      none" in out, out
    assert proc.stderr == b""


@pytest.mark.parametrize("argv", [["inspect"], ["validate", "--deep"]])
def test_a_table_of_escaped_keys_keeps_its_columns(argv: list[str], tmp_path: Path) -> None:
    """On a stdout that cannot encode a key's 'é' (PYTHONIOENCODING=ascii) the stream wrote it as `\\xe9` after
    the table was laid out, so its row ran 3 columns past the frame (`| model.caf\\xe9.weight | 2     |` under a
    `| key               |` header). The escape is now made before the layout: every row as wide as its frame."""
    import subprocess
    import sys

    from tests.fixtures.builders import save_quiet

    ckpt = tmp_path / "ck"
    save_quiet({"model": {"caf\u00e9.weight": torch.tensor([float("nan"), 1.0]), "b.bias": torch.ones(1)}}, ckpt)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "120"}
    proc = subprocess.run(
        [sys.executable, "-m", "ckpttool", argv[0], str(ckpt), *argv[1:]], capture_output=True, env=env, timeout=120
    )
    out = proc.stdout.decode("ascii")
    assert proc.returncode == (0 if argv[0] == "inspect" else 1), proc.stderr.decode()
    rows = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert any("model.caf\\xe9.weight" in ln for ln in rows), out
    frames = [i for i, ln in enumerate(out.splitlines()) if ln.startswith("+-")]
    assert len(frames) >= 2 and len(frames) % 2 == 0, out
    lines = out.splitlines()
    for top, bottom in zip(frames[::2], frames[1::2], strict=True):
        assert {len(ln) for ln in lines[top : bottom + 1]} == {len(lines[top])}, "\n".join(lines[top : bottom + 1])


@pytest.mark.parametrize(
    "encoding_env",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}],
    ids=["ioencoding-ascii", "c-locale-no-utf8-mode"],
)
def test_a_stdout_that_cannot_encode_box_characters_gets_an_ascii_table(
    encoding_env: dict[str, str], tmp_path: Path
) -> None:
    """A stdout whose encoding holds only ASCII: `inspect` into a pipe wrote its table frame as `\\u250f\\u2501...`
    escapes under PYTHONIOENCODING=ascii (docs/cli.md: "tables are drawn in ASCII"), and under LC_ALL=C with
    PYTHONUTF8=0 (stdout's error handler 'surrogateescape', not 'strict') it stopped with 'error: [E999]
    internal error: UnicodeEncodeError' (exit 2). Both now draw the frame as rich does in ASCII, report whole."""
    import subprocess
    import sys

    from tests.fixtures.builders import save_quiet

    ckpt = tmp_path / "ck \u00e9"
    save_quiet({"model": {"w.weight": torch.ones(2, 3), "b.bias": torch.ones(1)}}, ckpt)  # plain cells
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_")}
    env.update(encoding_env, COLUMNS="120")
    proc = subprocess.run(
        [sys.executable, "-m", "ckpttool", "inspect", str(ckpt)], capture_output=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = proc.stdout.decode("ascii")
    lines = out.splitlines()
    assert lines[0].startswith("checkpoint  ") and "\\u25" not in out, out
    head = lines.index("model tensors")
    assert lines[head + 1].startswith("+---") and lines[head + 2].startswith("| key "), out
    assert any(ln.startswith("| model.w.weight ") and "| 2x3 " in ln for ln in lines), out
    assert "layout      none" in out, out
    assert b"Traceback" not in proc.stderr and b"E999" not in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["-V"], ["inspect", "--help"], ["export", "-h"]])
def test_closed_stdout_during_help_or_version_is_not_a_failure(argv: list[str]) -> None:
    """`ckpttool --help | ...` with the reader gone: click's own EPIPE handling exited 1 (no line) where a
    command's output exits 0 (docs/errors.md)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


@pytest.mark.parametrize("json_output", [False, True])
def test_closed_stdout_keeps_the_verdict(json_output: bool, sample_ckpt: Path, tmp_path: Path) -> None:
    """`ckpttool diff A B | head -1` under `set -o pipefail`: the reader going away does not turn
    "different" (exit 1) into 0; equal stays 0."""
    import subprocess
    import sys

    from ckpttool.ops.sample import SampleOptions, write_sample

    other = tmp_path / "other"
    write_sample(other, SampleOptions(seed=1))
    for b, code in ((other, 1), (sample_ckpt, 0)):
        argv = ["diff", str(sample_ckpt), str(b), *(["--json"] if json_output else [])]
        proc = subprocess.Popen(
            [sys.executable, "-c", "from ckpttool.cli import main; main()", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the first write
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == code, err
        assert "Traceback" not in err and "error" not in err


def test_finalizer_noise_from_an_interrupt_is_not_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt landing in ``__del__`` (Python prints "Exception ignored in ...") is handled by
    AtomicOutputDir's flag; the CLI's unraisable hook keeps it off stderr, and only it."""
    import sys

    from ckpttool.cli.app import _unraisable
    from ckpttool.format import atomic as output

    class Raises:
        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def __del__(self) -> None:
            raise self.exc

    monkeypatch.setattr(sys, "unraisablehook", _unraisable)
    monkeypatch.setattr(output, "_signal_received", False)  # an earlier in-process Ctrl-C test may have set it
    Raises(KeyboardInterrupt())  # collected at once: its __del__ raises
    assert capsys.readouterr().err == ""
    assert not output.signal_received()
    Raises(AttributeError("'ZipFile' object has no attribute '_writing'"))  # no signal seen: a real bug, printed
    assert "_writing" in capsys.readouterr().err


def test_a_thread_whose_start_a_signal_cut_short_does_not_break_the_exit() -> None:
    """SIGINT landing inside ``Thread.start()`` (a pool growing as the command is interrupted) leaves a thread
    in ``threading._limbo`` that was never started: joining it raised "cannot join thread before it is
    started", a traceback after "error: interrupted" and exit 1 instead of 130. The exit now leaves it to the
    interpreter (``_threads_ended`` is False)."""
    import threading

    from ckpttool.cli.app import _threads_ended

    t = threading.Thread(target=lambda: None)
    threading._limbo[t] = t  # type: ignore[attr-defined]  # where start() puts it before the OS thread runs
    try:
        assert _threads_ended() is False
    finally:
        del threading._limbo[t]  # type: ignore[attr-defined]


_INTERRUPT_WHILE_LOADING_THE_COMMAND = """
import importlib
import sys

app = importlib.import_module("ckpttool.cli.app")

def load(name):
    raise KeyboardInterrupt  # Ctrl-C while the command's modules import (torch: most of a run's start-up)

app._load_command = load
sys.argv = ["ckpttool", "inspect", sys.argv[1]]
app.entry()
"""

_INTERRUPT_WHILE_THE_CLI_IMPORTS = """
import sys

class Finder:
    def find_spec(self, name, path=None, target=None):
        if name == "ckpttool.ui.output":
            raise KeyboardInterrupt  # Ctrl-C while `ckpttool` (the console script) imports the CLI
        return None

sys.meta_path.insert(0, Finder())
sys.argv = ["ckpttool", "inspect", sys.argv[1]]
from ckpttool.cli import entry
entry()
"""


@pytest.mark.parametrize(
    "script", [_INTERRUPT_WHILE_LOADING_THE_COMMAND, _INTERRUPT_WHILE_THE_CLI_IMPORTS], ids=["command", "cli"]
)
def test_ctrl_c_before_the_command_runs_says_interrupted(tmp_path: Path, script: str) -> None:
    """Ctrl-C while a command's modules load was turned by Typer into a silent exit 130 (no line on
    stderr); while the CLI itself imported, a KeyboardInterrupt traceback. Both now print the one
    ``error: interrupted`` line and exit 130."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == "error: interrupted\n"


_INTERRUPT_WHILE_TORCH_IMPORTS_NUMPY = """
import sys

class Finder:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy.linalg":  # numpy half imported, as `import torch` imports it
            sys.meta_path.remove(self)
            raise KeyboardInterrupt  # Ctrl-C while the command's first `import torch` runs
        return None

sys.meta_path.insert(0, Finder())
sys.argv = ["ckpttool", "replay-step", sys.argv[1], "--filter", "*norm*"]
from ckpttool.cli import entry
entry()
"""


def test_ctrl_c_while_torch_imports_numpy_is_not_swallowed(sample_ckpt: Path) -> None:
    """torch's extension imports numpy and drops any exception that import raises: a Ctrl-C landing there was
    lost, and ``replay-step`` went on to print its full report with exit 0 (or, once it imported numpy
    itself, ``E999 internal error: ImportError: cannot load module more than once per process``). The program
    imports numpy before torch, so the interrupt ends the run: ``error: interrupted``, exit 130
    (docs/errors.md)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_WHILE_TORCH_IMPORTS_NUMPY, str(sample_ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "error: interrupted\n")


@pytest.mark.parametrize("closed", [">&-", "2>&-", ">&- 2>&-"], ids=["stdout", "stderr", "both"])
def test_a_closed_stdout_or_stderr_keeps_the_verdict(sample_ckpt: Path, tmp_path: Path, closed: str) -> None:
    """Started with stdout or stderr closed (Python's ``sys.stdout`` is ``None``): every command failed with
    E999 ('NoneType' object has no attribute 'write', exit 2) or exited 1 with no line. The exit code is the
    verdict's, as with a reader that went away."""
    import subprocess
    import sys

    from ckpttool.ops.sample import SampleOptions, write_sample

    other = tmp_path / "other"
    write_sample(other, SampleOptions(seed=1))
    cases = [
        (["inspect", str(sample_ckpt)], 0),
        (["diff", str(sample_ckpt), str(other)], 1),
        (["inspect", str(tmp_path / "missing")], 2),
    ]
    for argv, code in cases:
        proc = subprocess.run(
            ["sh", "-c", f'exec "$@" {closed}', "sh", sys.executable, "-m", "ckpttool", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == code, (argv, proc.stderr)
        assert "E999" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("stream", ["stderr", "stdout and stderr"])
def test_a_reader_of_stderr_that_went_away_keeps_the_verdict(sample_ckpt: Path, tmp_path: Path, stream: str) -> None:
    """``ckpttool ... 2>&1 | head -1``: the error line was written into a pipe whose reader had left, and the
    BrokenPipeError of that write was taken for a closed stdout: exit 0, a refused ``--overwrite`` or a missing
    checkpoint read as a success under ``set -o pipefail``. The exit code is the verdict's."""
    import subprocess
    import sys

    from ckpttool.ops.sample import SampleOptions, write_sample

    other = tmp_path / "other"
    write_sample(other, SampleOptions(seed=1))
    training = tmp_path / "training"
    shutil.copytree(sample_ckpt, training)
    (training / ".ckpttool-output.json").unlink()  # a checkpoint ckpttool did not write
    cases = [
        (["inspect", str(tmp_path / "missing")], 2),
        (["export", str(other), str(training), "--overwrite"], 2),
        (["diff", str(sample_ckpt), str(other)], 1),
    ]
    for argv, code in cases:
        read, write = os.pipe()
        os.close(read)  # the reader is gone before anything is written
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "ckpttool", *argv],
                stdout=write if stream != "stderr" else subprocess.DEVNULL,
                stderr=write,
                timeout=120,
            )
        finally:
            os.close(write)
        assert proc.returncode == code, argv
    assert (training / ".metadata").is_file() and not (training / ".ckpttool-output.json").exists()


def test_an_interrupt_ends_the_same_way_wherever_it_lands(capsys: pytest.CaptureFixture[str]) -> None:
    """One function decides what Ctrl-C ends with, for the program's start and for a running command alike."""
    from ckpttool.format.atomic import forget_published
    from ckpttool.ui.output import interrupted

    forget_published()  # no output written by this invocation (the CLI's main starts each one so)
    assert interrupted() == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_replay_step_without_grad_flags_takes_the_librarys_generator_defaults() -> None:
    from ckpttool.commands.replay_step import DeviceChoice, OptimizerChoice, _replay_options
    from ckpttool.ops.replay import ReplayOptions

    opts = _replay_options(
        device=DeviceChoice.auto,
        filter_glob=None,
        select=None,
        grads=None,
        grad_seed=None,
        grad_scale=None,
        optimizer=OptimizerChoice["auto"],
        offload_patterns=None,
        chunk_size=None,
        steps=1,
        max_memory=None,
        tolerance="1e-5,1e-8",
        reference_dtype="float64",
    )
    assert (opts.grad_seed, opts.grad_scale) == (ReplayOptions().grad_seed, ReplayOptions().grad_scale)


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["import", "hf", "out", "--world-size", "2.5"], "Invalid value for '--world-size': '2.5' is not an integer."),
        (["validate", "ckpt", "--workers", "four"], "Invalid value for '--workers': 'four' is not an integer."),
        (["sample", "out", "--seed", "x"], "Invalid value for '--seed': 'x' is not an integer."),
        (["diff", "a", "b", "--rtol", "tight"], "Invalid value for '--rtol': 'tight' is not a number."),
    ],
)
def test_a_value_of_the_wrong_type_is_named_plainly(argv: list[str], want: str) -> None:
    """A non-integer for a bounded integer option read "'2.5' is not a valid int range." (click's type name),
    as if a range such as 1-4 were asked for."""
    res = runner.invoke(app, argv)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0] == f"error: [E100] {want}"


@pytest.mark.parametrize("argv", [["inspect", ""], ["validate", ""], ["export", "{ckpt}", ""], ["stats", ""]])
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(sample_ckpt: Path, argv: list[str]) -> None:
    """``ckpttool inspect ""`` (an unset ``$CKPT``) read the current directory, and ``export CKPT ""`` named it as
    the output: an empty path is now E100, exit 2, before anything is read or written."""
    res = runner.invoke(app, [a.format(ckpt=sample_ckpt) for a in argv])
    assert res.exit_code == 2, res.output
    assert "[E100]" in res.stderr and "an empty path (an unset shell variable?)" in res.stderr, res.stderr


@pytest.mark.parametrize(
    ("cmd", "flag"),
    [
        (["export", "{ckpt}", "{out}"], "--model-assets"),
        (["export", "{ckpt}", "{out}"], "--rules"),
        (["export", "{ckpt}", "{out}", "--format", "lora"], "--adapter-config"),
        (["import", "{ckpt}", "{out}"], "--config"),
        (["validate", "{ckpt}"], "--config"),
        (["validate", "{ckpt}"], "--against"),
        (["validate", "{ckpt}"], "--optimizer-dir"),
        (["inspect", "{ckpt}"], "--optimizer-dir"),
        (["diff", "{ckpt}", "{ckpt}"], "--rules"),
        (["diff", "{ckpt}", "{ckpt}"], "--plot"),
        (["stats", "{ckpt}"], "--plot"),
        (["replay-step", "{ckpt}"], "--grads"),
    ],
)
def test_an_empty_file_or_folder_option_is_refused_not_taken_as_the_current_directory(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmd: list[str], flag: str
) -> None:
    """``export CKPT OUT --model-assets ""`` (an unset ``$ASSETS``) copied every file of the current directory into
    the export as its assets; ``validate --against ""`` took the current directory as the reference model. An empty
    path given to any file or folder option is now E100 naming the option, exit 2, before anything is written."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("not an asset\n")
    monkeypatch.chdir(cwd)
    out = tmp_path / "out"
    res = runner.invoke(app, [*(a.format(ckpt=sample_ckpt, out=out) for a in cmd), flag, ""])
    assert res.exit_code == 2 and res.stdout == "", res.output
    err = res.stderr.splitlines()[0]  # an option of two spellings is named by both: '--rules' / '--map'
    assert err.startswith(f"error: [E100] Invalid value for '{flag}'"), res.stderr
    assert err.endswith(": an empty path (an unset shell variable?); name the file or directory"), res.stderr
    assert not out.exists() and sorted(p.name for p in cwd.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("cmd", [["import", "{hf}"], ["reshard", "{ckpt}", "--to", "canonical"]])
def test_an_empty_output_path_hint_names_a_directory_not_the_refused_current_one(
    sample_ckpt: Path, tmp_path: Path, cmd: list[str]
) -> None:
    """``ckpttool import HF ""`` (an unset ``$OUT``): the E100 said "pass '.' for the current directory", and the
    current directory as OUT is refused (E600); for an output it says to name the output directory."""
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf)]).exit_code == 0
    argv = [a.format(hf=hf, ckpt=sample_ckpt) for a in cmd]
    res = runner.invoke(app, [*argv[:2], "", *argv[2:]])
    assert res.exit_code == 2, res.output
    err = res.stderr.splitlines()[0]
    assert err.startswith("error: [E100] ") and "an empty path (an unset shell variable?)" in err, err
    assert "name the output directory" in err and "'.'" not in err, err


@pytest.mark.parametrize("verify", [False, True])
def test_an_empty_manifest_output_is_refused_not_taken_as_the_current_directory(
    sample_ckpt: Path, verify: bool
) -> None:
    """``ckpttool manifest CKPT -o ""`` (an unset ``$OUT``) said "manifest .: is a directory" (E600, the empty path
    read as the current directory); it is now E100 saying the path is empty and naming a file to give."""
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "-o", "", *(["--verify"] if verify else [])])
    assert res.exit_code == 2 and res.stdout == "", res.output
    err = res.stderr.splitlines()[0]
    assert err.startswith("error: [E100] ") and "an empty path (an unset shell variable?)" in err, err
    assert "name the manifest file (e.g. ./manifest.json)" in err and "is a directory" not in err, err
    assert not (sample_ckpt / "manifest.json").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["stats", "{long}"],
        ["stats", "{ok}", "{ok}/{name}"],
        ["diff", "{long}", "{ok}"],
        ["diff", "{ok}", "{long}"],
        ["inspect", "{long}"],
        ["validate", "{long}"],
        ["export", "{ok}", "{long}"],
    ],
    ids=["stats", "stats-second", "diff-a", "diff-b", "inspect", "validate", "export-out"],
)
def test_a_path_the_system_refuses_as_too_long_is_one_coded_line(
    args: list[str], dense_ckpt: Path, tmp_path: Path
) -> None:
    """A checkpoint (or output) path with a component of 300 characters (over NAME_MAX): every command ended with
    ``error: [E999] internal error: OSError: [Errno 36] File name too long``, an invitation to report a bug; it is
    E100 naming the path and the system's reason, exit 2, nothing on stdout."""
    import errno

    name = "y" * 300
    with pytest.raises(OSError) as raised:  # what the system says of such a name
        os.stat(tmp_path / name)
    assert raised.value.errno == errno.ENAMETOOLONG
    argv = [a.format(long=tmp_path / name, ok=dense_ckpt, name=name) for a in args]
    res = runner.invoke(app, argv)
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    err, hint = res.stderr.splitlines()
    assert err.startswith("error: [E100] ") and "File name too long" in err and name[:50] in err, err
    assert hint.startswith("hint: ") and "E999" not in res.stderr


def test_an_output_that_is_a_symlink_loop_is_one_coded_line(dense_ckpt: Path, tmp_path: Path) -> None:
    """``export ckpt loop/a`` where ``a -> b -> a``: ``Path.resolve()`` raised ``RuntimeError: Symlink loop from``
    and export ended in E999 internal error; a symlink loop met anywhere is E100 naming the path, exit 2."""
    import errno

    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OSError) as raised:  # what the system says of it
        os.stat(tmp_path / "a")
    assert raised.value.errno == errno.ELOOP
    res = runner.invoke(app, ["export", str(dense_ckpt), str(tmp_path / "a")])
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    err, hint = res.stderr.splitlines()
    assert err == f"error: [E100] {tmp_path / 'a'}: a symbolic link loop (a link that leads back to itself)", err
    assert hint.startswith("hint: ") and sorted(os.listdir(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize("kind", ["loop", "dangling"])
@pytest.mark.parametrize("command", ["inspect", "validate", "stats", "import"])
def test_a_checkpoint_path_that_is_a_link_to_nothing_says_so(command: str, kind: str, tmp_path: Path) -> None:
    """``stats loop/a`` (a -> b -> a) or a dangling link said only "no such directory" (import: "not a directory,
    pass the folder, not a file in it") beside a hint about other folders, though the path is right there in
    ``ls``; the hint now says it is a symbolic link leading to nothing, and where it points."""
    if kind == "loop":
        (tmp_path / "a").symlink_to("b")
        (tmp_path / "b").symlink_to("a")
    else:
        (tmp_path / "a").symlink_to("gone")
    argv = [command, str(tmp_path / "a")] + ([str(tmp_path / "out")] if command == "import" else [])
    res = runner.invoke(app, argv)
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    err, hint = res.stderr.splitlines()
    assert err == f"error: [E100] {tmp_path / 'a'}: no such directory", err
    target = "b" if kind == "loop" else "gone"
    assert hint.startswith(f"hint: {tmp_path / 'a'} is a symbolic link to {target} that leads to nothing"), hint
    assert not (tmp_path / "out").exists()
    # a folder of the path that is such a link (a/step-1): named, where the hint listed other folders
    argv = [command, str(tmp_path / "a" / "step-1")] + ([str(tmp_path / "out")] if command == "import" else [])
    res = runner.invoke(app, argv)
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    hint = res.stderr.splitlines()[-1]
    assert (
        hint
        == f"hint: {tmp_path / 'a'}, in the path, is a symbolic link to {target} that leads to nothing (dangling, or a loop)"
    ), hint
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--max-object-size", "1GiB"], ["--max-metadata-size=2GiB"]])
def test_a_read_cap_after_the_command_name_says_where_it_goes(argv: list[str], sample_ckpt: Path) -> None:
    """`ckpttool inspect DIR --max-object-size 1GiB` (docs/cli.md: the caps go before the command name only)
    said 'No such option: --max-object-size (Possible options: --ep-size)' and pointed to `inspect --help`,
    which does not list it. It now names it as ckpttool's own option and shows where it goes."""
    name = argv[0].split("=")[0]
    res = runner.invoke(app, ["inspect", str(sample_ckpt), *argv])
    assert res.exit_code == 2 and res.stdout == "", res.stdout
    assert res.stderr.splitlines() == [
        f"error: [E100] {name} is an option of ckpttool itself, given after the command name",
        f"hint: put it before the command: `ckpttool {name} SIZE inspect ...`",
    ], res.stderr
    moved = runner.invoke(app, [*argv[0].split("="), *argv[1:], "inspect", str(sample_ckpt)])
    assert moved.exit_code == 0 and moved.stdout.startswith(f"checkpoint  {sample_ckpt}\n"), moved.stderr
    other = runner.invoke(app, ["inspect", str(sample_ckpt), "--bogus"])
    assert other.exit_code == 2 and other.stderr.splitlines()[1] == "hint: see `ckpttool inspect --help`"


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_the_version_flag_after_the_command_name_says_where_it_goes(flag: str, sample_ckpt: Path) -> None:
    """`ckpttool validate DIR --json -V` said 'No such option: -V' and pointed to `validate --help`, which does not
    list it (`-V` is the root's, docs/cli.md). It now names it as ckpttool's own flag and shows where it goes."""
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--json", flag])
    assert res.exit_code == 2 and res.stdout == "", res.stdout
    assert res.stderr.splitlines() == [
        f"error: [E100] {flag} is an option of ckpttool itself, given after the command name",
        f"hint: put it before the command: `ckpttool {flag}` (it prints the versions and exits)",
    ], res.stderr
    moved = runner.invoke(app, [flag])
    assert moved.exit_code == 0 and moved.stdout.startswith("ckpttool "), moved.stdout


_INTERRUPT_WHILE_A_DATACLASS_IS_DEFINED = """
import dataclasses
import os
import signal
import sys

set_name = dataclasses.Field.__set_name__
module = sys.argv[1]

def interrupted_set_name(self, owner, name):
    if owner.__module__ == module:
        dataclasses.Field.__set_name__ = set_name
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled in this frame: inside __set_name__
        sum(range(10))
    return set_name(self, owner, name)

dataclasses.Field.__set_name__ = interrupted_set_name
sys.argv = ["ckpttool", "export", *sys.argv[2:]]
from ckpttool.cli import entry
entry()
"""


@pytest.mark.parametrize(
    "module",
    ["ckpttool.format.metadata", "ckpttool.model.catalog", "ckpttool.ops.export.plan", "ckpttool.ops.export.execute"],
)
def test_ctrl_c_while_a_module_defines_a_dataclass_says_interrupted(
    sample_ckpt: Path, tmp_path: Path, module: str
) -> None:
    """Python 3.10 and 3.11 wrap an exception raised in a class's ``__set_name__`` in ``RuntimeError: Error
    calling __set_name__ on 'Field' instance ...``: a Ctrl-C landing while a module defines a dataclass with a
    ``field(...)`` (the modules load lazily, in the first second of every run) printed that traceback with
    exit 1 (while the command line was being set up) or ``E999 internal error`` (in the command). It is an
    interrupt: one ``error: interrupted`` line, exit 130, no output (docs/errors.md)."""
    import subprocess
    import sys

    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_WHILE_A_DATACLASS_IS_DEFINED, module, str(sample_ckpt), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "error: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_internal_error_raised_from_a_handled_ctrl_c_is_not_an_interrupt(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only Python's own wrapping of a Ctrl-C (``RuntimeError: Error calling __set_name__ ...``) is an interrupt:
    a bug raised from a Ctrl-C the code had handled (a cleanup that failed, ``raise ... from e``) exited 130 with
    ``error: interrupted``, as if the user had stopped a run that in fact failed. It is ``E999 internal error``."""
    import ckpttool.ops.manifest as manifest

    def broken_cleanup(*args: object, **kwargs: object) -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise TypeError("cleanup after the interrupt failed") from e

    monkeypatch.setattr(manifest, "write_manifest", broken_cleanup)
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["manifest", str(sample_ckpt), "--output", str(out)])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[0] == (
        "error: [E999] internal error: TypeError: cleanup after the interrupt failed"
    ), res.stderr
    assert not out.exists()
