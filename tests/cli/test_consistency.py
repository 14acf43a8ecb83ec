"""One way to name and offer things across commands (issue 29, "small inconsistencies"), through the CLI.

import of a DCP directory names it as one; uppercase metavars; ``--optimizer-dir`` (a directory)
vs ``--optimizer-type`` (a type) with the old ``--optimizer`` hidden but working; whole command
summaries; remote-storage options only where a URL is taken; completion of option values;
``validate --manifest`` without a value; ``inspect --depth`` below the model prefix; training
state shown once with its step counters; ``-v`` without ``None``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ckpttool.cli.app import COMMANDS, app
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def test_import_of_a_dcp_checkpoint_says_so_and_suggests_export(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["import", str(sample_ckpt), str(out)])
    assert res.exit_code == 2 and res.stdout == ""
    assert f"error: [E100] {sample_ckpt} is a DCP checkpoint (it holds .metadata)" in res.stderr
    assert f"hint: did you mean `ckpttool export {sample_ckpt} OUT`" in res.stderr
    assert "no .metadata and no .safetensors" not in res.stderr and not out.exists()
    root = tmp_path / "run"
    (root / "step-10").mkdir(parents=True)
    (root / "step-10" / ".metadata").write_bytes((sample_ckpt / ".metadata").read_bytes())
    res = runner.invoke(app, ["import", str(root), str(out)])
    assert res.exit_code == 2 and "is a DCP checkpoint (step-10/.metadata is below it)" in res.stderr


def test_inspect_of_an_import_for_more_ranks_than_rows_warns_only_about_what_validate_reports(
    tmp_path: Path,
) -> None:
    """`import --world-size 64` of a model with 8 rows writes an empty file for each rank without a chunk (as
    dcp.save does); `inspect` warned 'data file __R_0.distcp is not referenced by .metadata' for each of them
    while `validate --strict` (S006) rightly reports none. A non-empty unreferenced file is still warned about."""
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.norm.weight": torch.ones(8)}, str(hf / "model.safetensors"))
    out = tmp_path / "dcp"
    assert runner.invoke(app, ["import", str(hf), str(out), "--world-size", "64", "--no-fsync"]).exit_code == 0
    assert (out / "__63_0.distcp").stat().st_size == 0
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    assert runner.invoke(app, ["validate", str(out), "--strict"]).exit_code == 0
    (out / "__63_0.distcp").write_bytes(b"leftover")
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.stderr.splitlines() == [
        "warning: data file __63_0.distcp is not referenced by .metadata",
        "warning: run `ckpttool validate --strict` for the full list of problems",
    ]


@pytest.mark.parametrize("name", COMMANDS)
def test_metavars_are_uppercase_everywhere(name: str) -> None:
    res = runner.invoke(app, [name, "--help"], env=WIDE)
    assert res.exit_code == 0
    usage = res.stdout.splitlines()[0]
    assert not re.search(r"[{\[][a-z_]+[}\]]", usage.split("[OPTIONS]")[1]), usage
    assert not re.search(r"<(path|str|int|float|int range|float range|text)>", res.stdout), res.stdout
    missing = runner.invoke(app, [name]) if name not in ("rules", "schema", "validate") else None
    if missing is not None:
        assert missing.exit_code == 2 and re.search(r"Missing argument '[A-Z_]+'", missing.stderr), missing.stderr


@pytest.mark.parametrize("name", ["inspect", "validate", "export", "replay-step", "manifest"])
def test_help_names_the_checkpoint_argument_as_its_usage_line_does(name: str) -> None:
    """The usage line names the argument CHECKPOINT, but `--optimizer-dir` read "together with DIR's model" and
    `manifest --verify` / `--output` "DIR/manifest.json": a DIR the command does not have. The help says
    CHECKPOINT."""
    res = runner.invoke(app, [name, "--help"])
    assert res.exit_code == 0 and res.stdout.startswith(f"Usage: ckpttool {name} [OPTIONS] "), res.output
    words = " ".join(res.stdout.split())
    assert not re.search(r"\bDIR's|Check DIR\b|instead of DIR/|\(DIR/manifest", words), words
    want = ["CHECKPOINT/manifest.json"] if name == "manifest" else ["together with CHECKPOINT's model."]
    assert all(w in words for w in want), words
    if name == "manifest":
        res = runner.invoke(app, [name, "unused", "--output", ""])
        assert res.stderr.splitlines()[0].endswith("or leave --output out for CHECKPOINT/manifest.json"), res.stderr


def test_validate_without_a_checkpoint_says_so_as_every_command_does() -> None:
    """`ckpttool validate` (CHECKPOINT is optional there, for --list-rules) said `missing CHECKPOINT argument` with
    the hint `ckpttool validate DIR [--strict] [--deep]`, where every other command says `Missing argument
    'CHECKPOINT'.` and its usage line names no DIR. Now the same words, and the hint names --list-rules too."""
    res = runner.invoke(app, ["validate"])
    assert (res.exit_code, res.stdout) == (2, ""), res.output
    assert res.stderr.splitlines() == [
        "error: [E100] Missing argument 'CHECKPOINT'.",
        "hint: ckpttool validate CHECKPOINT [--strict] [--deep], or ckpttool validate --list-rules; see "
        "`ckpttool validate --help`",
    ], res.stderr
    assert runner.invoke(app, ["inspect"]).stderr.splitlines()[0] == res.stderr.splitlines()[0]


@pytest.mark.parametrize("name", COMMANDS)
def test_help_fits_a_narrow_terminal(name: str) -> None:
    """At 60 columns no help line is wider than the terminal (the examples aside: they stay whole to copy): a
    ``<a|b|...>`` list that does not fit becomes ``--schema SCHEMA`` with ``One of: ...`` in the wrapped help."""
    out = runner.invoke(app, [name, "--help"], terminal_width=60).stdout  # CliRunner fixes COLUMNS' width at 80
    wide = [line for line in out.splitlines() if len(line) > 60 and not line.startswith("    ckpttool ")]
    assert wide == [], wide
    if name == "inspect":
        assert "  --schema SCHEMA " in out and "One of: torchtune, olmo-core," in " ".join(out.split())
        assert "--schema <torchtune|" in runner.invoke(app, [name, "--help"], env=WIDE).stdout


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_help_fits_a_40_column_terminal(name: str) -> None:
    """`COLUMNS=40 ckpttool validate --help`: click lays help out at 50 columns at least, and beside a 30-column
    option name the descriptions were 16 columns wide: lines of up to 59 columns, each wrapped again by the
    terminal. Now the help takes the terminal's width and puts a description below its option's name where
    fewer than 20 columns are left beside it; no line ends in a space (the `Usage: ckpttool CMD` line alone)
    or in an opening bracket."""
    args = [name, "--help"] if name else ["--help"]
    out = runner.invoke(app, args, terminal_width=40).stdout  # CliRunner fixes COLUMNS' width at 80
    lines = out.splitlines()
    wide = [ln for ln in lines if len(ln) > 40 and not ln.startswith(("    ckpttool ", "  Docs: "))]
    assert wide == [] and not [ln for ln in lines if ln.endswith(" ")], wide
    assert [ln for ln in lines if ln.endswith(("(", "["))] == [], out
    if name == "validate":
        strict = lines.index("  --strict")  # the description on the lines below the name
        assert lines[strict + 1].startswith("      Warnings fail the run too;"), out
        assert lines[0] == "Usage: ckpttool validate" and lines[1].strip() == "[OPTIONS] [CHECKPOINT]", out


def test_help_takes_a_terminal_narrower_than_50_columns() -> None:
    """`COLUMNS=40 ckpttool --help` (a real run: click lays help out at 50 columns at least, whatever the
    terminal): every line fits 40 columns, the long URL of the epilog aside."""
    env = {**os.environ, "COLUMNS": "40"}
    proc = subprocess.run([sys.executable, "-m", "ckpttool", "--help"], capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert [ln for ln in lines if len(ln) > 40 and not ln.startswith("  Docs: ")] == [], lines
    assert "  --max-metadata-size SIZE" in lines and "  inspect      Show what a checkpoint" in lines, lines


def test_a_long_word_is_not_split_after_its_opening_bracket_alone() -> None:
    """`COLUMNS=40 ckpttool inspect --help` (a real run): the CHECKPOINT argument read `a checkpoint prefix (`
    above `s3://bucket/run/`: a word longer than the column was split after its leading `(`, leaving the
    bracket alone at the end of a line. The word now starts the next line (split after a `/` as before)."""
    env = {**os.environ, "COLUMNS": "40"}
    proc = subprocess.run(
        [sys.executable, "-m", "ckpttool", "inspect", "--help"], capture_output=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert [ln for ln in lines if ln.rstrip().endswith(("(", "["))] == [], lines
    at = [ln.strip() for ln in lines].index("(s3://bucket/run/")
    assert lines[at - 1].strip().endswith("a checkpoint prefix") and lines[at + 1].strip().startswith("step-100,")


def test_optimizer_dir_and_optimizer_type_with_hidden_old_spellings(sample_ckpt: Path) -> None:
    replay = runner.invoke(app, ["replay-step", "--help"], env=WIDE).stdout
    sample = runner.invoke(app, ["sample", "--help"], env=WIDE).stdout
    validate = runner.invoke(app, ["validate", "--help"], env=WIDE).stdout
    assert "--optimizer-type <auto|adamw|" in replay and "--optimizer-type <adamw|" in sample
    assert "--optimizer-dir DIR" in validate and "--optimizer-dir DIR" in replay
    for text in (replay, sample, validate):
        assert not re.search(r"--optimizer(?![-\w])", text), text  # the old spelling is not shown
    # ... but still works
    res = runner.invoke(
        app, ["replay-step", str(sample_ckpt), "--optimizer", "adamw", "--filter", "*layers.0.mlp.gate*"]
    )
    assert res.exit_code == 0 and re.search(r"^optimizer +adamw", res.stdout, re.M), res.stderr
    res = runner.invoke(app, ["replay-step", str(sample_ckpt), "--optimizer-type", "sgd"])
    assert res.exit_code == 2 and "'sgd' is not one of 'auto', 'adamw'" in res.stderr
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--optimizer", str(sample_ckpt / "nothing")])
    assert res.exit_code == 2 and f"--optimizer-dir {sample_ckpt / 'nothing'}: no such directory" in res.stderr
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--optimizer", str(sample_ckpt / "model_assets")])
    assert res.exit_code == 2 and f"--optimizer-dir {sample_ckpt / 'model_assets'}: not a DCP checkpoint" in res.stderr


def test_the_hidden_old_optimizer_spellings_warn_that_they_go(sample_ckpt: Path, tmp_path: Path) -> None:
    """docs/cli.md lists `--optimizer` as removed in the next release, but it was taken without a word (the
    other deprecated spellings, `replay-step --select` and `sample --steps`, warn): scripts would break
    unannounced. Now a warning names the new spelling; the new spelling warns of nothing."""
    res = runner.invoke(
        app, ["replay-step", str(sample_ckpt), "--optimizer", "adamw", "--filter", "*layers.0.mlp.gate*"]
    )
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines() == [
        "warning: replay-step --optimizer is deprecated and will be removed in the next release; use --optimizer-type"
    ]
    res = runner.invoke(app, ["sample", str(tmp_path / "s"), "--optimizer=adamw", "-q"])
    assert res.exit_code == 0 and res.stderr.splitlines() == [
        "warning: sample --optimizer is deprecated and will be removed in the next release; use --optimizer-type"
    ]
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--optimizer", str(sample_ckpt / "nothing")])
    assert res.stderr.splitlines()[0] == (
        "warning: validate --optimizer is deprecated and will be removed in the next release; use --optimizer-dir"
    )
    res = runner.invoke(app, ["sample", str(tmp_path / "t"), "--optimizer-type", "adamw", "-q"])
    assert res.exit_code == 0 and res.stderr == ""


def test_command_summaries_are_not_cut() -> None:
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "80"}).stdout
    commands = out[out.index("Commands:") :]
    assert "..." not in commands and "…" not in commands
    assert "(reads no\n" in commands and "tensor data)." in commands  # wrapped, whole


@pytest.mark.parametrize("name", COMMANDS)
def test_remote_storage_options_only_on_commands_that_take_a_url(name: str) -> None:
    out = runner.invoke(app, [name, "--help"], env=WIDE).stdout
    remote = ("--storage-option", "--remote-workers", "--remote-retries", "--remote-spool-size")
    urls = name in (
        "inspect",
        "validate",
        "export",
        "reshard",
        "stamp",
        "replay-step",
        "manifest",
        "import",
        "stats",
        "diff",
    )
    assert all((flag in out) == urls for flag in remote), (name, out)
    assert "--no-progress" in out and "--wide" in out  # the other global options are everywhere


def complete(words: str) -> list[str]:
    env = {
        **os.environ,
        "_CKPTTOOL_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
    }
    res = subprocess.run([sys.executable, "-m", "ckpttool"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_completion_offers_option_values(tmp_path: Path) -> None:
    for step in ("step-10", "step-200"):
        (tmp_path / "run" / step).mkdir(parents=True)
        (tmp_path / "run" / step / ".metadata").write_bytes(b"")
    assert complete("ckpttool export x y --save-dtype ") == ["preserve", "bfloat16", "float16", "float32"]
    assert complete(f"ckpttool inspect {tmp_path / 'run'} --step ") == ["latest", "10", "200"]
    from ckpttool.model.schemas import registry

    assert complete("ckpttool inspect x --schema ") == list(registry.names())
    assert complete("ckpttool replay-step x --optimizer-type cpu") == ["cpu_offload_adamw"]
    assert complete("ckpttool export x y --hash ") == ["xxh3-128", "blake3", "blake2b-256"]
    assert complete("ckpttool --color ") == ["auto", "always", "never"]
    offered = complete("ckpttool replay-step x --optimi")
    assert "--optimizer-type" in offered and "--optimizer-dir" in offered and "--optimizer" not in offered


def test_validate_manifest_without_a_value_is_the_checkpoints_own(sample_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    res = runner.invoke(app, ["validate", str(ck), "--manifest"])
    assert res.exit_code == 2 and f"{ck}/manifest.json: no such manifest file" in res.stderr
    assert runner.invoke(app, ["manifest", str(ck)]).exit_code == 0
    for argv in (
        [str(ck), "--manifest"],
        ["--manifest", str(ck)],  # the option took DIR: it is the checkpoint, with its own manifest
        [str(ck), "--manifest", str(ck)],  # a directory: its manifest.json
        [str(ck), "--manifest", "--strict"],
        [str(ck), "--manifest", str(ck / "manifest.json")],
    ):
        res = runner.invoke(app, ["validate", *argv, "--json"])
        assert res.exit_code == 0, (argv, res.stderr)
        s015 = next(r for r in json.loads(res.stdout)["rules"] if r["code"] == "S015")
        assert s015["status"] != "skipped", (argv, s015)
    (ck / "__0_0.distcp").write_bytes((ck / "__0_0.distcp").read_bytes()[:-8] + b"\0" * 8)
    res = runner.invoke(app, ["validate", str(ck), "--manifest"])
    assert res.exit_code == 1 and "S015" in res.stdout


def test_inspect_depth_counts_levels_below_the_model_prefix(sample_ckpt: Path) -> None:
    def prefixes(depth: str) -> list[str]:
        res = runner.invoke(app, ["inspect", str(sample_ckpt), "--depth", depth, "--json"])
        assert res.exit_code == 0, res.stderr
        return [r["prefix"] for r in json.loads(res.stdout)["tree"]]

    assert prefixes("1") == ["model.model", "model.lm_head"]
    assert "model.model.layers" in prefixes("2") and "model.model.layers.0" in prefixes("3")


@pytest.fixture(scope="module")
def titan_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dcp.save of model, optimizer, an LR scheduler's state and a train state, after 3 steps (as torchtitan saves)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    lr = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    out = tmp_path_factory.mktemp("titan") / "ck"
    state = {
        "model": msd,
        "optimizer": osd,
        "lr_scheduler": lr,
        "train_state": {"step": torch.tensor(3), "ntokens_seen": torch.tensor(48)},
    }
    dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out


@pytest.mark.parametrize("width", ["80", ""])
def test_training_state_shown_once_with_its_step_counters(width: str, titan_like: Path) -> None:
    res = runner.invoke(app, ["inspect", str(titan_like)], env={"COLUMNS": width})
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    line = "training    lr_scheduler: 6 keys, last_epoch 3, _step_count 4; train_state: 2 keys, step 3, ntokens_seen 48"
    assert line in out.replace("\n            ", " ")
    # not again in the byte items table or an "other keys" line (the key schema's reasons name the items)
    assert "other keys" not in out and not re.search(r"│ (lr_scheduler|train_state)\.", out), out
    assert out.count("lr_scheduler.") == 0 and out.count("train_state:") == 1
    doc = json.loads(runner.invoke(app, ["inspect", str(titan_like), "--json"]).stdout)
    assert doc["training_values"] == {
        "lr_scheduler.last_epoch": 3,
        "lr_scheduler._step_count": 4,
        "train_state.step": 3,
        "train_state.ntokens_seen": 48,
    }


def test_verbose_never_prints_none(titan_like: Path, sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["-v", "inspect", str(titan_like)])
    assert res.exit_code == 0 and "EP layout: unversioned from none (EP sizes not set)" in res.stderr
    assert not re.search(r"\bNone\b", res.stderr + res.stdout)
    res = runner.invoke(app, ["inspect", str(sample_ckpt), "-v"])
    assert "(ep_size 1, ep_fsdp_size 1)" in res.stderr and not re.search(r"\bNone\b", res.stderr)


def test_cli_md_lists_every_schema_and_every_command_that_takes_a_url() -> None:
    from ckpttool.commands.schema import SCHEMA_NAMES

    text = " ".join((Path(__file__).parents[2] / "docs" / "cli.md").read_text().split())
    listed = re.search(r"JSON Schema of a `--json` document \(([^)]*)\)", text)
    assert listed is not None and sorted(re.findall(r"`([^`]+)`", listed.group(1))) == sorted(SCHEMA_NAMES)
    remote = re.search(r"on the commands that take a URL \(([^)]*)\)", text)
    assert remote is not None
    takes_urls = [n for n in COMMANDS if "--storage-option" in runner.invoke(app, [n, "--help"], env=WIDE).stdout]
    assert sorted(re.findall(r"`([^`]+)`", remote.group(1))) == sorted(takes_urls)


def test_optimizer_dir_that_is_the_checkpoint_itself_says_what_to_do(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--optimizer-dir", str(sample_ckpt)])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E100] --optimizer-dir {sample_ckpt} is the model checkpoint itself",
        "hint: --optimizer-dir names a separate optimizer checkpoint (e.g. checkpoint-N/optimizer_0); "
        "leave it out when the checkpoint holds its optimizer state",
    ]


def _docs(name: str) -> str:
    return (Path(__file__).parents[2] / "docs" / name).read_text()


def _code_range(text: str) -> set[str]:
    """``E141-E144, E601`` -> {E141, E142, E143, E144, E601} (codes of a range that have no class left out)."""
    from ckpttool.errors import CkptError, error_class

    out: set[str] = set()
    for lo, hi in re.findall(r"E(\d{3})(?:-E(\d{3}))?", text):
        out |= {f"E{n}" for n in range(int(lo), int(hi or lo) + 1) if error_class(f"E{n}") is not CkptError}
    return out


def test_errors_md_lists_every_error_code_with_the_class_that_raises_it() -> None:
    """docs/errors.md has one row per error code, naming the class ``error_class(code)`` returns; every class is
    raised somewhere in the package and asserted by a test; the groups the page says one ``except`` catches are
    subclasses."""
    import ckpttool.errors as errors

    # the classes of ckpttool.errors (ops/distributed.py's private carrier of another rank's error has no code)
    classes = {
        c.code: c for c in errors._all_classes() if c is not errors.CkptError and c.__module__ == errors.__name__
    }
    text = _docs("errors.md")
    rows = re.findall(r"^\| (E\d{3}) \| (\w+) \|", text, re.M)
    assert len(rows) == len({c for c, _ in rows}), "a code listed twice"
    assert sorted(c for c, _ in rows) == sorted(classes)
    assert [(c, classes[c].__name__) for c, _ in rows] == rows
    # the exit code: 2 (the table above the codes), 1 where the row says "(exit 1)"
    says = {
        c: int(m[0]) if (m := re.findall(r"\(exit (\d)\)", row)) else 2
        for c, row in re.findall(r"^\| (E\d{3}) \|(.*)$", text, re.M)
    }
    assert says == {c: cls.exit_code for c, cls in classes.items()}
    package = Path(errors.__file__).parent
    sources = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name != "errors.py")
    assert [c for c, cls in classes.items() if not re.search(rf"\b{cls.__name__}\(", sources)] == []
    # every code is asserted by a test of its own (the code or its class named in a test that is not about the docs;
    # E604 is an internal invariant no input can break)
    tests = Path(__file__).parents[1]
    asserted = "\n".join(
        p.read_text() for p in tests.rglob("*.py") if p.name not in {Path(__file__).name, "test_doc_refs.py"}
    )
    untested = [c for c, cls in classes.items() if not re.search(rf"\b(?:{c}|{cls.__name__})\b", asserted)]
    assert untested == ["E604"]
    groups = re.findall(r"`(\w+)` \(((?:E\d{3}(?:-E\d{3})?(?:, )?)+)\)", " ".join(text.split()))
    assert len(groups) >= 10
    for name, codes in groups:
        parent = getattr(errors, name)
        assert _code_range(codes) == {c for c, cls in classes.items() if cls is not parent and issubclass(cls, parent)}


def test_every_option_shown_in_help_is_documented() -> None:
    """Each option ``--help`` shows (the root's and every command's, ``--x/--no-x`` both) appears in the README or
    a page of docs/: an option added without a word in the documentation fails here."""
    root = Path(__file__).parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    group = typer.main.get_command(app)
    commands = [group, *(group.commands[name] for name in COMMANDS)]  # type: ignore[attr-defined]
    missing = [
        f"{cmd.name} {flag}"
        for cmd in commands
        for param in cmd.params
        if not getattr(param, "hidden", True)
        for flag in [*param.opts, *param.secondary_opts]
        if flag.startswith("--") and flag != "--help" and not re.search(re.escape(flag) + r"(?![\w-])", text)
    ]
    assert missing == []


@pytest.mark.parametrize(
    "flag", ["--filter", "--select", "--train-steps", "--steps", "--dry-run", "--overwrite", "--ep-size"]
)
def test_cli_md_vocabulary_names_every_command_with_the_option(flag: str) -> None:
    """docs/cli.md's "One vocabulary" table names, for an option, exactly the commands whose --help shows it
    (deprecated spellings, hidden, aside)."""
    shown = re.compile(r"^  (?:-\w, )?" + re.escape(flag) + r"(?![\w-])", re.M)  # an option line of --help
    having = {n for n in COMMANDS if shown.search(runner.invoke(app, [n, "--help"], env=WIDE).stdout)}
    rows = [
        r for r in _docs("cli.md").splitlines() if r.startswith("| ") and re.search(f"`{flag}[ `]", r.split(" | ")[1])
    ]
    assert len(rows) == 1, rows
    named = set(re.findall(r"`([a-z-]+)`", rows[0].split(" | ")[2])) & set(COMMANDS)
    assert named == having


def test_synopses_in_the_docs_list_the_choices_help_lists() -> None:
    """A command's synopsis in docs/ (a code block starting ``ckpttool CMD``) lists for ``--opt a|b|c`` exactly the
    choices ``--help`` shows as ``--opt <a|b|c>``."""
    blocks = [
        (page.name, block)
        for page in sorted((Path(__file__).parents[2] / "docs").glob("*.md"))
        for block in re.findall(r"```\n(ckpttool [a-z-]+ .*?)```", page.read_text(), re.S)
    ]
    checked, wrong = 0, []
    for page, block in blocks:
        name = block.split()[1]
        if name not in COMMANDS:
            continue
        shown = runner.invoke(app, [name, "--help"], env={"COLUMNS": "400"}).stdout
        choices = dict(re.findall(r"^  (?:-\w, )?(--[\w-]+) <([^>]+)>", shown, re.M))
        for flag, values in re.findall(r"(--[\w-]+)[ =]([\w.-]+(?:\|[\w.-]+)+)", block):
            if flag in choices:
                checked += 1
                if set(values.split("|")) != set(choices[flag].split("|")):
                    wrong.append(f"{page} {name} {flag} {values} (--help: {choices[flag]})")
    assert checked >= 15 and wrong == []


def test_command_lines_in_the_docs_use_options_of_their_command() -> None:
    """Every ``ckpttool CMD ...`` line of the README and docs/ (in backticks, a code block, or after ``python -m`` /
    ``torchrun ... -m``) passes only options that CMD (or the root) takes."""
    group = typer.main.get_command(app)
    flags = {n: {o for p in group.commands[n].params for o in [*p.opts, *p.secondary_opts]} for n in COMMANDS}  # type: ignore[attr-defined]
    root_flags = {o for p in group.params for o in [*p.opts, *p.secondary_opts]} | {"--help"}
    root = Path(__file__).parents[2]
    wrong, seen = [], 0
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        lines = re.findall(r"`ckpttool ([^`]+)`", text)
        lines += re.findall(r"^\s*\$?\s*ckpttool ([a-z-].*)$", text, re.M)
        lines += re.findall(r"-m ckpttool ([^`\n]+)", text)
        for line in lines:
            words = line.split()
            while words and words[0].startswith("-"):  # global options before the command, with their value
                words = (
                    words[2:]
                    if len(words) > 1 and not words[1].startswith("-") and words[1] not in COMMANDS
                    else words[1:]
                )
            if not words or words[0] not in COMMANDS:
                continue
            seen += 1
            for word in words[1:]:
                if word in ("|", "&&", ";") or word.startswith("#"):
                    break
                flag = re.match(r"--[a-z][a-z0-9-]*", word)
                if flag and flag.group(0) not in flags[words[0]] | root_flags:
                    wrong.append(f"{page.name}: {words[0]} {flag.group(0)} in {line!r}")
    assert seen > 100 and wrong == []


def test_a_filter_that_matches_nothing_is_one_error_line_and_exit_2(sample_ckpt: Path, tmp_path: Path) -> None:
    """A `--filter` glob that selects nothing, on every command that takes one (docs/errors.md, "A filter that
    matches nothing"): exit 2, one `error:` line naming the glob and a `hint:`, nothing on stdout, no output written;
    the code is the command's documented one."""
    glob = "nothing_matches*"
    calls = {
        "E100": [["inspect", sample_ckpt], ["stats", sample_ckpt], ["replay-step", sample_ckpt]],
        "E601": [["export", sample_ckpt, tmp_path / "hf"]],
        "E611": [["diff", sample_ckpt, sample_ckpt]],
    }
    for code, runs in calls.items():
        for args in runs:
            res = runner.invoke(app, [*map(str, args), "--filter", glob])
            err = res.stderr.splitlines()
            assert res.exit_code == 2 and res.stdout == "", (args, res.output)
            assert len(err) == 2 and err[0].startswith(f"error: [{code}] ") and glob in err[0], (args, err)
            assert err[1].startswith("hint: ") and "Traceback" not in res.stderr, (args, err)
    assert not (tmp_path / "hf").exists()


def test_each_integer_bound_of_a_command_is_its_library_options_bound() -> None:
    """An option the CLI bounds (Typer's `min=`: `--workers`, `--depth`, `--steps`, `--world-size`) holds the
    library to the same bound (the field's `errors.at_least`): `StatsOptions(workers=0)` and
    `InspectOptions(depth=-1)` ran where `--workers 0` / `--depth -1` were refused."""
    import dataclasses

    import ckpttool

    options_of = {
        "inspect": ckpttool.InspectOptions,
        "validate": ckpttool.ValidateOptions,
        "export": ckpttool.ExportOptions,
        "reshard": ckpttool.ReshardOptions,
        "replay-step": ckpttool.ReplayOptions,
        "stats": ckpttool.StatsOptions,
        "import": ckpttool.ImportOptions,
        "diff": ckpttool.DiffOptions,
    }
    group = typer.main.get_command(app)
    checked = []
    for name, cls in options_of.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for param in group.commands[name].params:  # type: ignore[attr-defined]
            minimum = getattr(param.type, "min", None)
            if type(param.type).__name__ == "IntRange" and minimum is not None and param.name in fields:
                assert fields[param.name].metadata.get("at_least") == minimum, (name, param.name)
                checked.append(f"{name} --{param.name}")
    assert len(checked) >= 12, checked
