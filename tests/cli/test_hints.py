"""Every `--option` a message tells the user to pass exists on the command that prints it.

Two checks: a static one over every string literal of the package (each `--flag` exists on
the command module that holds it, on the command a `ckpttool CMD ... --flag` names, or, for
library and shared text, on some command), and a dynamic one that runs each command into
its errors and checks every flag of every `error:`/`hint:`/`warning:`/`note:` line against
that command — and that no library parameter name in backticks (`` `max_memory` ``) is left
untranslated.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli.app import GLOBAL_OPTIONS, app
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
GROUP = typer.main.get_command(app)
COMMANDS = GROUP.commands  # type: ignore[attr-defined]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
NAMED = re.compile(r"ckpttool ([a-z][a-z-]*|\{\})((?:\s+(?!ckpttool\b)[^\s`'\"|;()]+)*)")
QUOTED_INPUT = re.compile(r"No such option: --\S+")  # click quoting what the user typed
LEFTOVER_PARAM = re.compile(r"`[a-z][a-z0-9]*_[a-z0-9_]*`")  # a library parameter the sink did not translate
# Flags of other tools that messages may quote (torch / pytest / pip / Megatron-LM's training arguments), not ckpttool's.
FOREIGN = {
    "--no-deps",
    "--nproc-per-node",
    "--recursive",
    "--ckpt-step",
    "--local-dir",
}  # pip, torchrun, `aws s3 cp`, Megatron-LM, `hf download`


def flags_of(name: str) -> set[str]:
    cmd = COMMANDS[name]
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))} | set(
        GLOBAL_OPTIONS
    )


ROOT_FLAGS = {o for p in GROUP.params for o in getattr(p, "opts", ())} | set(GLOBAL_OPTIONS)
ALL_FLAGS = set().union(*(flags_of(n) for n in COMMANDS)) | ROOT_FLAGS
MODULE_COMMAND = {"replay_step": "replay-step", "import_hf": "import"}


def check_text(text: str, default: str | None) -> list[str]:
    """Problems with the flags of ``text`` printed by command ``default`` (``None``: any command)."""
    problems = []
    text = QUOTED_INPUT.sub("No such option: (input)", text)
    named_spans = []
    for m in NAMED.finditer(text):
        cmd = m.group(1)
        if cmd == "{}":  # an f-string naming the command at run time: its flags are checked where it runs
            named_spans.append(m.span())
            continue
        if cmd not in COMMANDS:
            continue
        named_spans.append(m.span())
        for f in FLAG.findall(m.group(2)):
            if f not in flags_of(cmd) and f not in FOREIGN:
                problems.append(f"`ckpttool {cmd}` has no {f}: {text!r}")
    for m in FLAG.finditer(text):
        if any(a <= m.start() < b for a, b in named_spans) or m.group(0) in FOREIGN:
            continue
        have = flags_of(default) if default else ALL_FLAGS
        if m.group(0) not in have:
            problems.append(f"{default or 'no command'} has no {m.group(0)}: {text!r}")
    return problems


def string_literals(path: Path) -> list[str]:
    """Every string constant of a module, f-string parts joined (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append(node.value)
    return out


def test_every_flag_in_the_package_text_exists_where_it_is_printed() -> None:
    root = Path(ckpttool.__file__).parent
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        default = None
        if rel.parts[:1] == ("commands",) and rel.stem != "__init__":
            default = MODULE_COMMAND.get(rel.stem, rel.stem)
        for text in string_literals(path):
            if "--" in text:
                problems += [f"{rel}: {p}" for p in check_text(text, default)]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_missing_option() -> None:
    assert check_text("pass --overwrite", "validate")
    assert not check_text("pass --overwrite", "export")
    assert check_text("run `ckpttool validate --overwrite`", "export")
    assert not check_text("declare it with `ckpttool stamp DIR --source-layout legacy`", None)


# ----------------------------------------------------------------------------- dynamic
def messages(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.split(":", 1)[0] in ("error", "hint", "warning", "note")]


@pytest.fixture(scope="module")
def scenarios(
    sample_ckpt: Path, dense_ckpt: Path, ep_suite: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[str, list[str]]]:
    """(command, argv) runs that end in errors, warnings or notes worth a hint."""
    tmp = tmp_path_factory.mktemp("hints")
    full = tmp / "full"
    full.mkdir()
    (full / "x.txt").write_text("x")
    empty = tmp / "empty"
    empty.mkdir()
    truncated = copy_checkpoint(sample_ckpt, tmp / "trunc")
    with open(truncated / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    ambiguous = ep_suite / "legacy"
    s, d, o = str(sample_ckpt), str(dense_ckpt), str(tmp / "out")
    return [
        ("inspect", ["inspect", str(tmp / "nope")]),
        ("inspect", ["inspect", str(empty)]),
        ("inspect", ["inspect", s, "--filter", "*nothing*"]),
        ("inspect", ["inspect", str(truncated)]),
        ("inspect", ["inspect", str(ambiguous)]),
        ("validate", ["validate", str(truncated), "--deep"]),
        ("validate", ["validate", str(ambiguous), "--strict"]),
        ("validate", ["validate", s, "--select", "Z9"]),
        ("validate", ["validate", s, "--junit", str(tmp)]),
        ("export", ["export", s, str(full)]),
        ("export", ["export", s, o, "--filter", "*nothing*"]),
        ("export", ["export", str(ambiguous), o]),
        ("export", ["export", str(truncated), o]),
        ("export", ["export", s, o, "--weights", "master"]),
        ("export", ["export", s, o, "--save-dtype", "int8"]),
        ("reshard", ["reshard", s, o, "--to", "legacy"]),
        ("reshard", ["reshard", str(ambiguous), o, "--to", "canonical"]),
        ("reshard", ["reshard", s, str(full), "--to", "legacy", "--with-optimizer"]),
        ("stamp", ["stamp", s, "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "1"]),
        ("replay-step", ["replay-step", d, "--max-memory", "1"]),
        ("replay-step", ["replay-step", s, "--filter", "*nothing*"]),
        ("replay-step", ["replay-step", s, "--device", "cuda"]),
        ("replay-step", ["replay-step", str(ambiguous), "--grads", str(tmp / "nope.safetensors")]),
        ("replay-step", ["replay-step", s, "--select", "x"]),
        ("sample", ["sample", str(full)]),
        ("schema", ["schema", "frob"]),
        ("inspect", ["inspect", s, "--bogus"]),
    ]


def test_every_printed_flag_exists_on_the_command(scenarios: list[tuple[str, list[str]]]) -> None:
    problems, seen = [], 0
    for cmd, argv in scenarios:
        res = runner.invoke(app, argv)
        lines = messages(res.stderr)
        assert lines or res.exit_code in (0, 1), (argv, res.stderr)
        for line in lines:
            seen += line.count("--")
            problems += [f"{argv}: {p}" for p in check_text(line, cmd)]
            if LEFTOVER_PARAM.search(line):
                problems.append(f"{argv}: untranslated library parameter in {line!r}")
            if "Traceback" in line or "E999" in line:
                problems.append(f"{argv}: {line}")
    assert not problems, "\n".join(problems)
    assert seen > 10  # the scenarios do print flags


def test_lora_export_options_of_the_hf_format_say_what_to_do(sample_ckpt: Path, tmp_path: Path) -> None:
    """``--format lora`` with ``--experts per-expert`` or a model adapter was refused with the generic
    ``run the command with --help``."""
    for extra, hint in (
        (
            ["--experts", "per-expert"],
            "hint: a LoRA adapter has no expert tensors to split: leave --experts out, or export with --format hf",
        ),
        (
            ["--adapter", "torchtitan-llama3"],
            "hint: a LoRA adapter keeps PEFT's names: leave --adapter out, or export with --format hf",
        ),
    ):
        res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--format", "lora", *extra])
        assert res.exit_code == 2 and res.stdout == "" and res.stderr.splitlines()[1] == hint, res.stderr
        assert res.stderr.startswith(f"error: [E100] {extra[0]} {extra[1]} applies to the hf format only\n")
    assert not (tmp_path / "out").exists()


def test_lora_settings_without_a_lora_format_are_refused_not_ignored(sample_ckpt: Path, tmp_path: Path) -> None:
    """``export --lora-alpha 16`` (no ``--format lora``) wrote a plain HF export and said nothing."""
    for extra in (["--lora-alpha", "16"], ["--format", "hf", "--adapter-config", str(tmp_path / "a.json")]):
        res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), *extra])
        flag = next(a for a in extra if a in ("--lora-alpha", "--adapter-config"))
        assert res.exit_code == 2 and res.stdout == ""
        assert res.stderr.splitlines() == [
            f"error: [E100] {flag} is given with --format hf, which writes no LoRA adapter: it would be ignored",
            f"hint: use --format lora (a PEFT adapter) or hf-merged (the LoRA merged into the weights), or drop {flag}",
        ]
    assert not (tmp_path / "out").exists()


def test_a_bad_option_value_the_library_refuses_names_the_command_help(sample_ckpt: Path, tmp_path: Path) -> None:
    """``export --quantize fp8`` (refused by the library, not by click) printed ``hint: run the command with
    --help``, which names no command; click's own refusals print ``hint: see `ckpttool CMD --help```."""
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "out"), "--quantize", "fp8"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "error: [E100] --quantize 'fp8' is not one of fp8-block, fp8-channel",
        "hint: see `ckpttool export --help`",
    ]
    assert not (tmp_path / "out").exists()


def test_reshard_ep_size_without_a_source_layout_names_the_target_sizes(sample_ckpt: Path, tmp_path: Path) -> None:
    """`reshard CK OUT --to canonical --ep-size 2` (meaning the target's EP size) hinted only to add
    ``--source-layout``, which declares how the checkpoint was saved: the sample records its layout, so that
    declaration is refused (E404). The hint names ``--target-ep-size`` too."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["reshard", str(sample_ckpt), str(out), "--to", "canonical", "--ep-size", "2"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "error: [E100] --ep-size/--ep-fsdp-size given without --source-layout",
        "hint: for the mesh of the job that will load the output pass --target-ep-size and --target-ep-fsdp-size; "
        "to declare the mesh an unversioned checkpoint was saved with, add --source-layout legacy|canonical",
    ], res.stderr
    assert not out.exists()


def test_plot_into_a_missing_folder_names_the_command_that_makes_it(sample_ckpt: Path, tmp_path: Path) -> None:
    """`stats CK --plot no/such/p.png` hinted ``create it first``; the hint is now the command to paste."""
    pytest.importorskip("matplotlib")
    folder = tmp_path / "pics of run"
    for cmd in (["stats", str(sample_ckpt)], ["diff", str(sample_ckpt), str(sample_ckpt)]):
        res = runner.invoke(app, [*cmd, "--plot", str(folder / "p.png")])
        assert res.exit_code == 2 and res.stdout == ""
        assert res.stderr.splitlines() == [
            f"error: [E100] --plot {folder / 'p.png'}: directory {folder} does not exist",
            f"hint: create it first: mkdir -p '{folder}'",
        ], res.stderr
    assert not folder.exists()


def test_plot_under_a_file_is_not_a_missing_folder(sample_ckpt: Path, tmp_path: Path) -> None:
    """`--plot notes.txt/p.png` (a file where a folder is named) said ``directory notes.txt does not exist`` and
    hinted ``mkdir -p notes.txt``, which fails pasted (File exists): the file is named as the one in the way."""
    pytest.importorskip("matplotlib")
    blocker = tmp_path / "notes.txt"
    blocker.write_text("kept\n")
    for target in (blocker / "p.png", blocker / "sub" / "p.png"):
        res = runner.invoke(app, ["stats", str(sample_ckpt), "--plot", str(target)])
        assert res.exit_code == 2 and res.stdout == ""
        assert res.stderr.splitlines() == [
            f"error: [E100] --plot {target}: {blocker} is a file, not a directory",
            "hint: give a file name in a directory, or move that file out of the way",
        ], res.stderr
    assert blocker.read_text() == "kept\n"
