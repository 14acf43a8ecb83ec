"""``ckpttool validate`` command line: output formats, selection, strictness, exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.validate import RULES
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


@pytest.fixture
def broken(dense_ckpt: Path, tmp_path: Path) -> Path:
    """Dense fixture with one error (P001: eps dropped) and one warning (S006: stray data file)."""
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ckpt")
    assert damage.drop_keys(ck, lambda k: k == "optimizer.param_groups.0.eps")
    (ck / "__5_0.distcp").write_bytes(b"stale")
    return ck


def test_table_output_groups_by_severity_and_ends_with_counts(broken: Path) -> None:
    res = runner.invoke(app, ["validate", str(broken)])
    assert res.exit_code == 1 and res.stderr == ""
    out = res.stdout
    assert out.index("errors (1)") < out.index("warnings (do not fail without --strict) (1)")
    assert "P001" in out and "S006" in out and "missing eps" in out
    assert out.splitlines()[-1].startswith("FAILED: 1 error, 1 warning, 1 info;")  # M009: the fixture's inv_freq


def test_json_schema_and_fail_flags(broken: Path) -> None:
    res = runner.invoke(app, ["validate", str(broken), "--json"])
    assert res.exit_code == 1 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert doc["schema"] == "ckpttool.validate/1" and doc["exit_code"] == 1 and not doc["ok"]
    assert doc["counts"] == {"error": 1, "warning": 1, "info": 1} and doc["failing"] == 1  # info: M009 (inv_freq)
    by = {f["code"]: f for f in doc["findings"]}
    assert set(by) == {"P001", "S006", "M009"} and not by["M009"]["fails"]
    assert by["P001"]["fails"] and not by["S006"]["fails"]
    for f in doc["findings"]:
        assert set(f) == {"code", "severity", "key", "message", "hint", "error_code", "fatal", "fails"}
    status = {r["code"]: r["status"] for r in doc["rules"]}
    assert status["P001"] == "failed" and status["S006"] == "reported" and status["D001"] == "skipped"
    assert status["S002"] == "passed" and len(status) == len(RULES)


def test_strict_turns_warnings_into_failures(dense_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ckpt")
    (ck / "__5_0.distcp").write_bytes(b"stale")
    assert runner.invoke(app, ["validate", str(ck)]).exit_code == 0
    res = runner.invoke(app, ["validate", str(ck), "--strict"])
    assert res.exit_code == 1 and "[strict]" in res.stdout.splitlines()[-1]


def test_select_and_ignore_by_code_and_prefix(broken: Path) -> None:
    def run(*opts: str) -> tuple[int, set[str], set[str]]:
        r = runner.invoke(app, ["validate", str(broken), "--json", "--strict", *opts])
        doc = json.loads(r.stdout)
        return r.exit_code, {f["code"] for f in doc["findings"]}, {x["code"] for x in doc["rules"]}

    rc, found, ran = run("--ignore", "P001,M009")
    assert (rc, found) == (1, {"S006"}) and "P001" not in ran
    rc, found, ran = run("--ignore", "P00,S006,M009")
    assert (rc, found) == (0, set())
    rc, found, ran = run("--select", "P")
    assert (rc, found) == (1, {"P001"}) and ran == {c for c in RULES if c[0] == "P"} | {"S001", "S009"}
    rc, found, _ = run("--select", "s00", "--select", "O")
    assert (rc, found) == (1, {"S006"})


def test_unknown_rule_code_is_a_usage_error(dense_ckpt: Path) -> None:
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--select", "Z9"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E100] --select 'Z9' matches no rule code")


def test_not_a_directory_exits_2_without_traceback(tmp_path: Path) -> None:
    res = runner.invoke(app, ["validate", str(tmp_path / "nope"), "--json"])
    assert res.exit_code == 2 and res.stdout == "" and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: [E100]")


def test_junit_report_has_one_case_per_rule(broken: Path, tmp_path: Path) -> None:
    junit = tmp_path / "report.xml"
    res = runner.invoke(app, ["validate", str(broken), "--junit", str(junit), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["exit_code"] == 1
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite")
    assert suite is not None
    cases = {c.get("name").split()[0]: c for c in suite.findall("testcase")}
    assert set(cases) == set(RULES) and suite.get("tests") == str(len(RULES))
    assert suite.get("failures") == "1"
    fail = cases["P001"].find("failure")
    assert fail is not None and "missing eps" in fail.get("message")
    assert cases["S006"].find("failure") is None and "S006" in cases["S006"].find("system-out").text
    assert cases["D001"].find("skipped").get("message") == "needs --deep"
    assert cases["S002"].find("failure") is None and cases["S002"].find("skipped") is None


def test_junit_strict_marks_warnings_as_failures(broken: Path, tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    runner.invoke(app, ["validate", str(broken), "--strict", "--junit", str(junit)])
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "2"


def test_list_rules_json(tmp_path: Path) -> None:
    res = runner.invoke(app, ["validate", "--list-rules", "--json"])
    assert res.exit_code == 0
    rows = json.loads(res.stdout)["rules"]
    assert [r["code"] for r in rows] == sorted(RULES)
    assert {r["code"] for r in rows if r["fatal"]} == {"S001", "S009"}


def test_list_rules_with_a_checkpoint_says_it_was_not_checked(broken: Path) -> None:
    """`validate --list-rules CKPT` printed the rules and exited 0 with no word on CKPT (broken here), which reads
    like a pass in a script; stderr now says CKPT was not checked. The listing on stdout is unchanged."""
    alone = runner.invoke(app, ["validate", "--list-rules", "--json"])
    res = runner.invoke(app, ["validate", "--list-rules", str(broken), "--json"])
    assert res.exit_code == 0 and res.stdout == alone.stdout
    assert res.stderr == f"warning: {broken} was not checked: --list-rules lists the rules and exits\n"
    assert alone.stderr == ""


def test_source_checkpoint_is_not_modified(broken: Path) -> None:
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in broken.iterdir()}
    runner.invoke(app, ["validate", str(broken), "--deep", "--strict"])
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in broken.iterdir()}
    assert before == after


@pytest.mark.parametrize("where", ["dir", "missing_parent"])
def test_unwritable_junit_path_gets_a_validate_hint(broken: Path, tmp_path: Path, where: str) -> None:
    target = tmp_path if where == "dir" else tmp_path / "no" / "such" / "r.xml"
    res = runner.invoke(app, ["validate", str(broken), "--junit", str(target)])
    assert res.exit_code == 2 and res.stdout == ""  # refused before any checking: no report on stdout
    err = res.stderr.splitlines()
    assert len(err) == 2, res.stderr
    if where == "dir":
        assert err[0] == f"error: [E600] --junit {target}: is a directory; ckpttool writes only regular files"
    else:
        assert err[0] == f"error: [E600] --junit {target}: directory {target.parent} does not exist"
    assert err[1].startswith("hint: ") and "--junit takes the path of a file" in err[1]
    assert "--overwrite" not in res.stderr  # validate has no such option


@pytest.mark.parametrize(
    ("args", "first"),
    [
        (["--select", "M001"], "error: [E100] --select M001: the selected rules (M001) need --config, not given"),
        (
            ["--select", "D001,M003"],
            "error: [E100] --select D001, M003: the selected rules (D001, M003) need --config and --deep, not given",
        ),
        (["--select", "S015"], "error: [E100] --select S015: the selected rules (S015) need --manifest, not given"),
        (["--select", "S", "--ignore", "S"], "error: [E100] --ignore S leaves none of the rules --select S chose"),
    ],
)
def test_a_selection_that_cannot_run_is_refused_not_ok(
    dense_ckpt: Path, tmp_path: Path, args: list[str], first: str
) -> None:
    """`--select M001` without --config printed "OK: ... 2 rules run, 1 skipped" (exit 0): nothing asked was checked."""
    junit = tmp_path / "r.xml"
    res = runner.invoke(app, ["validate", str(dense_ckpt), *args, "--junit", str(junit)])
    assert res.exit_code == 2 and res.stdout == "" and not junit.exists()
    lines = res.stderr.splitlines()
    assert lines[0].startswith(first) and lines[0].endswith("nothing would be checked"), lines
    assert lines[1].startswith("hint: ") and len(lines) == 2


def test_a_selection_partly_runnable_still_runs(dense_ckpt: Path) -> None:
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--select", "M001,S002", "--json"])
    status = {r["code"]: r for r in json.loads(res.stdout)["rules"]}
    assert res.exit_code == 0 and status["M001"]["reason"] == "needs --config" and status["S002"]["status"] == "passed"


def test_list_rules_honours_select_and_ignore() -> None:
    """`validate --list-rules --select S01` listed all 81 rules; `--select ZZZ` too, exit 0."""
    res = runner.invoke(app, ["validate", "--list-rules", "--json", "--select", "S01,M010", "--ignore", "S015"])
    listed = [r["code"] for r in json.loads(res.stdout)["rules"]]
    assert res.exit_code == 0
    assert listed == sorted(c for c in RULES if (c.startswith("S01") or c == "M010") and c != "S015")
    res = runner.invoke(app, ["validate", "--list-rules", "--select", "ZZZ"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E100] --select 'ZZZ' matches no rule code")
    res = runner.invoke(app, ["validate", "--list-rules", "--json"])
    assert [r["code"] for r in json.loads(res.stdout)["rules"]] == sorted(RULES)


def test_junit_report_of_keys_and_paths_with_control_bytes_is_well_formed(dense_ckpt: Path, tmp_path: Path) -> None:
    """A key with \\x01 / ESC in it (from --against or the checkpoint) was written into the JUnit XML as is: CI could
    not parse the report; a checkpoint folder named with an undecodable byte could not be written at all."""
    import os

    ck = copy_checkpoint(dense_ckpt, Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/ck\xff\x01")))
    ref = tmp_path / "keys.json"
    ref.write_text(json.dumps(["model.evil\x01\x1b[31mkey"]))
    junit = tmp_path / "r.xml"
    res = runner.invoke(app, ["validate", str(ck), "--against", str(ref), "--select", "M005", "--junit", str(junit)])
    assert res.exit_code == 1, res.stderr
    root = ET.parse(junit).getroot()  # well-formed
    suite = root.find("testsuite")
    assert suite is not None and suite.get("name", "").endswith("/ck\\xff\\x01")
    fail = root.find(".//testcase[@name='M005 missing-keys']/failure")
    assert fail is not None
    assert fail.get("message") == f"model.model.evil\\x01\\x1b[31mkey: in the reference {ref} but not in the checkpoint"


def test_list_rules_says_the_junit_report_was_not_written(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    res = runner.invoke(app, ["validate", "--list-rules", "--junit", str(junit)])
    assert res.exit_code == 0 and not junit.exists()
    assert res.stderr == f"warning: --junit {junit} was not written: --list-rules lists the rules and exits\n"


@pytest.mark.parametrize("existing", [False, True])
def test_junit_path_ending_in_a_slash_is_refused(dense_ckpt: Path, tmp_path: Path, existing: bool) -> None:
    """`--junit reports/` wrote a file named `reports` (or replaced an old report `reports`): a directory was meant."""
    target = tmp_path / "reports"
    if existing:  # an earlier report of ckpttool there: still not replaced through a directory spelling
        assert runner.invoke(app, ["validate", str(dense_ckpt), "--junit", str(target)]).exit_code == 0
    before = target.read_bytes() if existing else None
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--junit", f"{target}/"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E600] --junit {target}/: names a directory; --junit takes the path of the report file",
        f"hint: name the file, e.g. --junit {target}/validate.xml",
    ]
    assert (target.read_bytes() if existing else target.exists()) == (before if existing else False)


@pytest.mark.parametrize(
    ("junit", "lines"),
    [
        (
            "-",
            [
                "error: [E600] --junit -: the report is not written to standard output (the validate report goes "
                "there); --junit takes the path of the report file",
                "hint: name the file, e.g. --junit validate.xml (a file named '-': --junit ./-)",
            ],
        ),
        ("", ["error: [E600] --junit '': the path is empty"]),
    ],
)
def test_junit_dash_or_empty_is_refused(
    dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, junit: str, lines: list[str]
) -> None:
    """`--junit -` wrote a file named `-` in the working directory; `--junit ''` said "`--junit .`: is a directory"."""
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--junit", junit])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[: len(lines)] == lines
    assert list(tmp_path.iterdir()) == []
    assert runner.invoke(app, ["validate", str(dense_ckpt), "--junit", "./-"]).exit_code == 0
    assert (tmp_path / "-").read_bytes().startswith(b'<?xml version="1.0"')


def test_workers_without_deep_says_it_has_no_effect(dense_ckpt: Path) -> None:
    """`--workers 8` without --deep was accepted silently, as if it sped up or widened the check."""
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--workers", "8"])
    assert res.exit_code == 0
    assert res.stderr == "note: --workers 8 has no effect without --deep: it sets --deep's reader threads\n"
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--workers", "2", "--deep"])
    assert res.exit_code == 0 and "--workers" not in res.stderr


def test_against_says_values_were_not_compared(sample_ckpt: Path, tmp_path: Path) -> None:
    """An OK of --against another step's export read as "the same weights"; a note says what was compared."""
    out = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(out), "-q"]).exit_code == 0
    res = runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(out), "--select", "M"])
    assert res.exit_code == 0
    assert res.stderr.splitlines()[-1] == (
        f"note: --against compared names, shapes and dtypes, not values: `ckpttool diff {sample_ckpt} {out}` "
        "compares the values"
    )
    assert "note:" not in runner.invoke(app, ["validate", str(sample_ckpt), "--against", str(out), "-q"]).stderr
