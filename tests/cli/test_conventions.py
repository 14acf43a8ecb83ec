"""What users expect of a CLI: --version, -h, python -m, completion, examples, -v/-q anywhere, one vocabulary."""

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

from ckpttool.cli.app import app
from ckpttool.errors import UsageError
from ckpttool.ui.options import parse_dtype, parse_size

runner = CliRunner()
COMMANDS = (
    "inspect",
    "validate",
    "export",
    "reshard",
    "stamp",
    "replay-step",
    "sample",
    "rules",
    "schema",
    "diff",
    "stats",
    "manifest",
    "import",
)


def click_command(name: str):  # type: ignore[no-untyped-def]
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------------------------------------- --version, -h
def test_version_names_package_torch_and_safetensors_without_importing_torch() -> None:
    from importlib.metadata import version

    code = (
        "import sys\n"
        "from ckpttool.cli import main\n"
        "sys.argv = ['ckpttool', '--version']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    first, last = res.stdout.splitlines()[0], res.stdout.splitlines()[-1]
    assert first.startswith(f"ckpttool {version('ckpttool')} (torch {version('torch')}, ")
    assert f"safetensors {version('safetensors')}" in first
    assert last == "torch not imported", res.stdout
    assert runner.invoke(app, ["-V"]).stdout == runner.invoke(app, ["--version"]).stdout


@pytest.mark.parametrize("cmd", ["", *COMMANDS])
def test_h_is_help(cmd: str) -> None:
    argv = [cmd] if cmd else []
    short, long = runner.invoke(app, [*argv, "-h"]), runner.invoke(app, [*argv, "--help"])
    assert short.exit_code == long.exit_code == 0, short.stderr
    assert short.stdout == long.stdout and "Usage:" in short.stdout


def test_python_dash_m() -> None:
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("ckpttool "), res.stderr
    res = run_cli("inspect", "--help")
    assert res.returncode == 0 and "Usage: ckpttool inspect" in res.stdout


def test_shell_completion_script_and_completions() -> None:
    res = run_cli("--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert res.returncode == 0 and "_CKPTTOOL_COMPLETE" in res.stdout, res.stderr
    env = {"_CKPTTOOL_COMPLETE": "complete_bash", "COMP_WORDS": "ckpttool re", "COMP_CWORD": "1"}
    res = run_cli(env=env)
    assert "replay-step" in res.stdout.split() and "reshard" in res.stdout.split(), (res.stdout, res.stderr)
    env = {"_CKPTTOOL_COMPLETE": "complete_bash", "COMP_WORDS": "ckpttool export x y --save-d", "COMP_CWORD": "4"}
    assert "--save-dtype" in run_cli(env=env).stdout.split()


def _flags(cmd) -> set[str]:  # type: ignore[no-untyped-def]
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())) if o[0] == "-"}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_examples_that_use_its_own_options(name: str) -> None:
    res = runner.invoke(app, [name, "--help"])
    assert res.exit_code == 0
    examples = res.stdout.split("Examples:\n", 1)[1].splitlines()
    lines = [ln.strip() for ln in examples if ln.strip().startswith("ckpttool ")]
    assert lines, res.stdout
    for line in lines:
        words = line.split("#")[0].split("|")[0].split()
        assert words[1] in COMMANDS, line
        flags = _flags(click_command(words[1]))
        for w in words[2:]:
            if w.startswith("-"):
                assert w.split("=")[0] in flags, (line, w)


# ---------------------------------------------------------------------------------------------- -v / -q
@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_before_or_after_the_subcommand_logs_decisions(where: str, sample_ckpt: Path) -> None:
    argv = ["-v", "inspect", str(sample_ckpt)] if where == "before" else ["inspect", str(sample_ckpt), "-v"]
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, res.stderr
    assert "info: [checkpoint]" in res.stderr and "key schema torch-native" in res.stderr
    assert "EP layout: canonical from embedded" in res.stderr
    assert "info:" not in runner.invoke(app, ["inspect", str(sample_ckpt)]).stderr  # and nothing by default


def test_verbose_export_shows_the_plan_casts_and_timings(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--save-dtype", "bf16", "-vv"])
    assert res.exit_code == 0, res.stderr
    err = res.stderr
    assert "save dtype bfloat16; casts {'float32->bfloat16': 33}" in err
    assert re.search(r"read \d+ bytes and wrote \d+ in \d\.\d{3} s", err)
    assert re.search(r"debug: \[export\.execute\] model\.safetensors: 33 tensors, \d+ bytes", err)
    assert res.stdout.startswith("exported 33 tensors")


def test_verbose_reshard_shows_per_file_timings(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["reshard", str(sample_ckpt), str(tmp_path / "r"), "--to", "legacy", "--with-optimizer", "--verbose"]
    )
    assert res.exit_code == 0, res.stderr
    assert re.search(r"info: \[reshard\.execute\] __0_0\.distcp: \d+ chunks, \d+ bytes in \d\.\d{3} s", res.stderr)


def test_quiet_drops_notes_and_progress_but_keeps_results_and_errors(tmp_path: Path) -> None:
    out = tmp_path / "s"
    res = runner.invoke(app, ["sample", str(out), "--train-steps", "0"])
    assert res.exit_code == 0 and "note: wrote sample checkpoint" in res.stderr
    res = runner.invoke(app, ["-q", "sample", str(out), "--train-steps", "0", "--overwrite"])
    assert res.exit_code == 0 and res.stderr == ""
    res = runner.invoke(app, ["inspect", str(out), "--quiet"])
    assert res.exit_code == 0 and res.stdout.startswith("checkpoint") and res.stderr == ""
    res = runner.invoke(app, ["sample", str(out), "-q"])  # an error is never quiet
    assert res.exit_code == 2 and res.stderr.startswith("error: [E600]")


# ---------------------------------------------------------------------------------------------- sample
def test_sample_overwrite_reruns_and_train_steps_replaces_steps(tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert runner.invoke(app, ["sample", str(out), "--train-steps", "1"]).exit_code == 0
    res = runner.invoke(app, ["sample", str(out), "--train-steps", "1"])
    assert res.exit_code == 2 and "--overwrite" in res.stderr.splitlines()[-1]
    res = runner.invoke(app, ["sample", str(out), "--train-steps", "2", "--overwrite"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert doc["layout"]["global_step"] == 2
    res = runner.invoke(app, ["sample", str(out), "--steps", "0", "--overwrite"])  # the old spelling, for one release
    assert res.exit_code == 0
    assert "warning: sample --steps is deprecated" in res.stderr and "--train-steps" in res.stderr
    assert json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)["layout"]["global_step"] == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    res = runner.invoke(app, ["sample", str(tmp_path / "mine"), "--overwrite"])  # not a previous output: refused
    assert res.exit_code == 2 and (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_choice_options_list_their_choices() -> None:
    out = runner.invoke(app, ["sample", "--help"], env={"COLUMNS": "200"}).stdout
    assert re.search(r"[<\[]adamw\|full_fp32_adamw\|master_fp32_adamw\|cpu_offload_adamw[>\]]", out), out
    res = runner.invoke(app, ["sample", "x", "--optimizer", "sgd"])
    assert res.exit_code == 2 and "'sgd' is not one of 'adamw', 'full_fp32_adamw'" in res.stderr
    assert "<preserve|bfloat16|float16|float32>" in runner.invoke(app, ["export", "--help"]).stdout


# ---------------------------------------------------------------------------------------------- vocabulary
@pytest.mark.parametrize(
    "text, name",
    [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("fp32", "float32"),
     ("float32", "float32"), ("float", "float32"), ("torch.bfloat16", "bfloat16"), ("fp64", "float64")],
)  # fmt: skip
def test_dtype_aliases(text: str, name: str) -> None:
    assert parse_dtype(text, "--save-dtype") == name


def test_dtype_errors_name_the_flag_and_the_choices() -> None:
    with pytest.raises(UsageError) as ei:
        parse_dtype("int8", "--save-dtype", ("bfloat16", "float32"), extra=("preserve",))
    assert ei.value.message == "--save-dtype 'int8' is not one of preserve, bfloat16, float32"


@pytest.mark.parametrize(
    "text, n",
    [("5GB", 5 * 10**9), ("5gb", 5 * 10**9), ("5GiB", 5 * 2**30), ("5G", 5 * 2**30), ("512M", 512 * 2**20),
     ("100KB", 100_000), ("1.5GiB", 3 * 2**29), ("4096", 4096)],
)  # fmt: skip
def test_sizes_have_one_documented_meaning(text: str, n: int) -> None:
    assert parse_size(text, "--shard-size") == n


def test_export_dtype_alias_and_decimal_shard_size(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        ["export", str(sample_ckpt), str(tmp_path / "hf"), "--save-dtype", "fp16", "--shard-size", "40KB", "--json"],
    )
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["save_dtype"] == "float16" and len(doc["files"]) > 1
    assert all(f["bytes"] <= 40_000 + 4096 for f in doc["files"][:-1])  # + header; a single big tensor may exceed


def test_replay_filter_glob_and_deprecated_select(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["replay-step", str(sample_ckpt), "--filter", "*experts.down_proj", "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["device"] == "cpu"  # --device auto: no accelerator here
    assert sorted(p["fqn"] for p in doc["params"]) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.1.mlp.experts.down_proj",
    ]
    same = runner.invoke(app, ["replay-step", str(sample_ckpt), "--filter", "model.model.layers.*.experts.down_proj"])
    assert same.exit_code == 0 and "2 of 2 parameters match" in same.stdout  # with the 'model.' of the key too
    old = runner.invoke(app, ["replay-step", str(sample_ckpt), "--select", r"experts\.down_proj$", "--json"])
    assert old.exit_code == 0 and sorted(p["fqn"] for p in json.loads(old.stdout)["params"]) == sorted(
        p["fqn"] for p in doc["params"]
    )
    assert "warning: replay-step --select REGEX is deprecated" in old.stderr and "--filter GLOB" in old.stderr
    both = runner.invoke(app, ["replay-step", str(sample_ckpt), "--select", "x", "--filter", "y"])
    assert both.exit_code == 2 and both.stderr.startswith("error: [E100] --select and --filter are exclusive")
    none = runner.invoke(app, ["replay-step", str(sample_ckpt), "--filter", "*nothing*"])
    assert none.exit_code == 2, none.stderr
    assert none.stderr.startswith("error: [E100] --filter '*nothing*' matches none of the 31 parameter(s)")
    assert "None" not in none.stderr


@pytest.mark.parametrize("glob", ["*exp_avg_sq", "exp_avg_sq"])
@pytest.mark.parametrize("cmd", ["inspect", "stats", "export", "replay-step"])
def test_a_filter_over_optimizer_state_keys_names_the_parameter_to_select(
    cmd: str, glob: str, sample_ckpt: Path, tmp_path: Path
) -> None:
    """`--filter '*exp_avg_sq'` selects no parameter (a filter selects parameters; their state comes with them): the
    hint said to check the glob against `inspect` (which showed an empty table, exit 0). Each now says the glob
    matched optimizer state and names a parameter to select instead; the bare word as its wildcard form too."""
    args = [cmd, str(sample_ckpt), *([str(tmp_path / "hf")] if cmd == "export" else []), "--filter", glob]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.stderr
    said = "'*exp_avg_sq'" if glob.startswith("*") else "'exp_avg_sq' (no wildcard; '*exp_avg_sq*')"
    assert res.stderr.splitlines()[1] == (
        f"hint: {said} matches optimizer state (e.g. 'optimizer.state.model.embed_tokens.weight.exp_avg_sq'), "
        "which comes with its parameter: --filter selects parameters, e.g. 'model.embed_tokens.weight'"
    ), res.stderr
    assert not (tmp_path / "hf").exists()


def test_replay_reference_dtype_alias(sample_ckpt: Path) -> None:
    res = runner.invoke(
        app, ["replay-step", str(sample_ckpt), "--filter", "*norm.weight", "--reference-dtype", "fp32", "--json"]
    )
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["reference_dtype"] == "float32"


@pytest.mark.parametrize("what", ["no-optimizer", "groups-name-nothing"])
def test_replay_without_recognised_parameters_names_the_problem(what: str, tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    model = {"w": torch.ones(4), "b": torch.zeros(2)}
    sd: dict[str, object] = {"model": model}
    if what == "groups-name-nothing":
        sd["optimizer"] = {
            "state": {},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": ["x.y"]}],
        }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    res = runner.invoke(app, ["replay-step", str(tmp_path / "ck")])
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: [E514]"), res.stderr
    assert "None" not in res.stderr and "--select" not in res.stderr
    assert ("no optimizer param groups" if what == "no-optimizer" else "none of the 1 parameter(s)") in lines[0]


# ---------------------------------------------------------------------------------------------- FP32 masters
@pytest.fixture(scope="module")
def masters_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ckpttool.ops.sample import SampleOptions, write_sample

    return write_sample(tmp_path_factory.mktemp("m") / "ck", SampleOptions(steps=1, optimizer="master_fp32_adamw")).path


def test_export_of_fp32_masters_with_default_weights_says_so_once(masters_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(masters_ckpt), str(tmp_path / "a")])
    assert res.exit_code == 0, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note:") and "master_weight" in ln]
    assert len(notes) == 1, res.stderr
    assert "31 parameter(s) also have an FP32 optimizer master_weight (master_fp32_adamw)" in notes[0]
    assert "stored bfloat16 values" in notes[0] and "--weights master" in notes[0]
    res = runner.invoke(app, ["export", str(masters_ckpt), str(tmp_path / "b"), "--weights", "master"])
    assert res.exit_code == 0 and "master_weight" not in res.stderr  # the other note: no config.json
    assert "note:" not in runner.invoke(app, ["export", str(masters_ckpt), str(tmp_path / "c"), "-q"]).stderr


def test_no_masters_note_for_plain_adamw(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "a")])
    assert res.exit_code == 0 and "master_weight" not in res.stderr


# ---------------------------------------------------------------------------------------------- rules, urls
def test_rules_command_is_validate_list_rules() -> None:
    a, b = runner.invoke(app, ["rules", "--json"]), runner.invoke(app, ["validate", "--list-rules", "--json"])
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout
    assert json.loads(a.stdout)["schema"] == "ckpttool.rules/1"
    human = runner.invoke(app, ["rules"])
    assert human.exit_code == 0 and "S001" in human.stdout and "D001" in human.stdout


def test_rules_command_takes_select_and_ignore_as_validate_list_rules() -> None:
    """`ckpttool rules` says "(select them with --select/--ignore)" and cli.md makes it `validate --list-rules`, yet
    `rules --select O` was "No such option: --select" (exit 2). It now lists what `validate --list-rules` lists
    with the same options, repeated or comma-separated; an unknown code is the same E100."""
    for args in (["--select", "O,P", "--ignore", "O004"], ["--select", "O", "--select", "P", "--ignore", "O004"]):
        a = runner.invoke(app, ["rules", "--json", *args])
        b = runner.invoke(app, ["validate", "--list-rules", "--json", "--select", "O,P", "--ignore", "O004"])
        assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout, a.output
        codes = [r["code"] for r in json.loads(a.stdout)["rules"]]
        assert codes and all(c[0] in "OP" for c in codes) and "O004" not in codes and "O001" in codes
    human = runner.invoke(app, ["rules", "--select", "P"])
    assert human.exit_code == 0 and "P002" in human.stdout and "O001" not in human.stdout
    bad = runner.invoke(app, ["rules", "--select", "ZZZ"])
    assert (bad.exit_code, bad.stdout) == (2, "")
    assert bad.stderr.startswith("error: [E100] --select 'ZZZ' matches no rule code")


def test_rules_whose_ignore_covers_the_selection_is_refused_as_validate_refuses_it() -> None:
    """`validate CKPT --select O --ignore O` is E100 (nothing would be checked), but `rules` / `validate --list-rules`
    with the same options listed no rule at exit 0, an empty table as their answer. They give validate's E100 now."""
    line = "error: [E100] --ignore O, P leaves none of the rules --select O, P chose: nothing would be checked"
    for argv in (["rules"], ["rules", "--json"], ["validate", "--list-rules"]):
        r = runner.invoke(app, [*argv, "--select", "O,P", "--ignore", "O", "--ignore", "P"])
        assert (r.exit_code, r.stdout) == (2, ""), r.output
        assert r.stderr.splitlines()[0] == line, r.stderr


def test_show_completion_prints_the_script_of_the_shell_named() -> None:
    """cli.md gives `--show-completion [SHELL]`, but Typer detects the running shell and dropped the name: from bash,
    `--show-completion zsh` printed bash's script (which zsh cannot source), `--show-completion tcsh` too, exit 0.
    The shell named is the script printed now; one without a script is E100."""
    first = {"bash": "_ckpttool_completion() {", "zsh": "#compdef ckpttool", "fish": "complete --command ckpttool"}
    for shell, line in first.items():
        res = runner.invoke(app, ["--show-completion", shell])
        assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith(line), (shell, res.output)
        assert "_CKPTTOOL_COMPLETE" in res.stdout and res.stderr == ""
    res = runner.invoke(app, ["--show-completion", "tcsh"])
    assert (res.exit_code, res.stdout) == (2, "")
    assert res.stderr.splitlines()[0] == "error: [E100] --show-completion tcsh: no completion script for this shell"


def test_completion_flags_help_names_the_shell_argument() -> None:
    """`ckpttool --help` described `--install-completion` / `--show-completion` with Typer's words alone ("for the
    current shell"), so a user reading the help could not learn that both take a SHELL (cli.md: `[SHELL]`), the way
    to get zsh's script from bash. The help names the argument and the shells it takes."""
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0, res.output
    words = " ".join(res.stdout.split())  # the help as wrapped at any width
    assert (
        "--install-completion Install completion for the current shell, or for the SHELL given after the flag "
        "(bash, zsh, fish, powershell, pwsh). --show-completion Show completion for the current shell, or for the "
        "SHELL given after the flag, to copy it or customize the installation. -h, --help"
    ) in words, res.stdout


def test_install_completion_installs_for_the_shell_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--install-completion zsh` from bash installed bash's completion (in ~/.bashrc): the name was dropped as
    `--show-completion`'s was. The shell named gets it now (a home directory of the test's own)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    res = runner.invoke(app, ["--install-completion", "zsh"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0] == f"zsh completion installed in {tmp_path / '.zfunc' / '_ckpttool'}"
    assert (tmp_path / ".zfunc" / "_ckpttool").read_text().startswith("#compdef ckpttool")
    assert "compinit" in (tmp_path / ".zshrc").read_text() and not (tmp_path / ".bashrc").exists()
    res = runner.invoke(app, ["--install-completion", "tcsh"])
    assert (res.exit_code, res.stdout) == (2, "") and "[E100] --install-completion tcsh" in res.stderr


def test_project_urls_and_docs_references_resolve() -> None:
    from importlib.metadata import metadata

    urls = dict(u.split(", ", 1) for u in metadata("ckpttool").get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    help_text = runner.invoke(app, ["--help"]).stdout
    assert urls["Homepage"] in help_text and "ckpttool schema" in help_text


def test_hint_docs_paths_point_to_the_documentation(sample_ckpt: Path, tmp_path: Path) -> None:
    from importlib.metadata import metadata

    docs = dict(u.split(", ", 1) for u in metadata("ckpttool").get_all("Project-URL") or [])["Documentation"]
    rules = tmp_path / "rules.yaml"
    rules.write_text("- not a mapping\n")
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "o"), "--rules", str(rules)])
    assert res.exit_code == 2, res.stderr
    hint = res.stderr.splitlines()[-1]
    assert hint == f"hint: see {docs}/export.md for the schema", res.stderr


def test_inspect_filter_takes_the_same_globs_as_replay_step(sample_ckpt: Path) -> None:
    a = json.loads(runner.invoke(app, ["inspect", str(sample_ckpt), "--filter", "*experts.down_proj", "--json"]).stdout)
    assert [t["key"] for t in a["model"]] == [
        "model.model.layers.0.mlp.experts.down_proj",
        "model.model.layers.1.mlp.experts.down_proj",
    ]


def test_the_fp32_masters_note_is_the_librarys(masters_ckpt: Path, tmp_path: Path) -> None:
    """The export library words the masters note from the opened checkpoint and the result (the command prints it)."""
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.export import ExportOptions, export_checkpoint, masters_note

    with open_checkpoint(masters_ckpt) as ckpt:
        params = export_checkpoint(ckpt, tmp_path / "a", ExportOptions())
        note = masters_note(ckpt, params)
        master = export_checkpoint(ckpt, tmp_path / "b", ExportOptions(weights="master"))
        assert masters_note(ckpt, master) is None
    assert note is not None and note.startswith(
        "31 parameter(s) also have an FP32 optimizer master_weight (master_fp32_adamw); "
        "this export holds the stored bfloat16 values; export the FP32 masters with --weights master"
    )


def test_a_complex32_tensor_prints_no_python_warning(tmp_path: Path) -> None:
    """torch warns once that ComplexHalf is experimental when a complex32 tensor is made: `stats` (as `diff`) of a
    checkpoint holding one (torch's `dcp.save` stores it) prints its results, not a Python `UserWarning` line."""
    import torch
    import torch.distributed.checkpoint as dcp

    ck = tmp_path / "ck"
    sd = {"model": {"w": torch.randn(3, 2), "c": torch.randn(3, dtype=torch.complex64).to(torch.complex32)}}
    dcp.save(sd, checkpoint_id=str(ck), no_dist=True)
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", "stats", str(ck)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "│ c " in res.stdout, res.stderr
    assert "Warning" not in res.stderr and "ComplexHalf" not in res.stderr, res.stderr
