"""Progress that tells the truth, through the CLI on a real pseudo-terminal: each phase named on stderr
before its bar, the bar only with its total (never ``0/?``), nothing drawn with ``--json``, ``-q``,
``--no-progress`` or in a pipe; export's timings split into the whole run and its writing phase."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.cli.test_terminal import ANSI, run_in_pty

runner = CliRunner()


def _shown(argv: list[str]) -> str:
    """Everything a terminal of 120 columns received (stdout and stderr), escape sequences removed."""
    rc, out = run_in_pty(argv, 120)
    assert rc == 0, out
    text = re.sub(r" *\r?\n *", " ", ANSI.sub("", out))  # a summary or phase line may wrap (at a space)
    assert "/?" not in text and "?/" not in text  # never a bar without its total
    return text


def _in_order(text: str, *parts: str) -> None:
    at = 0
    for p in parts:
        i = text.find(p, at)
        assert i >= 0, f"{p!r} not after offset {at} in {text!r}"
        at = i + len(p)


def test_export_names_its_phases_then_draws_the_write_bar(sample_ckpt: Path, tmp_path: Path) -> None:
    assets = sample_ckpt / "model_assets"
    text = _shown(["export", str(sample_ckpt), str(tmp_path / "hf"), "--model-assets", str(assets)])
    _in_order(
        text,
        f"export: opening {sample_ckpt}…",
        "export: planning…",
        "export: building model class transformers.",
        "export: writing…",
        "export: writing ━",
        "KiB",
        "exported 33 tensors",
        "in all; written in ",
    )
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("flag", ["--no-progress", "-q"])
def test_no_phase_line_and_no_bar_when_asked(flag: str, sample_ckpt: Path, tmp_path: Path) -> None:
    rc, out = run_in_pty([flag, "export", str(sample_ckpt), str(tmp_path / "hf")], 120)
    assert rc == 0, out
    assert "export: " not in out and "…" not in out and "B/s " not in out  # no phase line, no bar


def _phase_of_the_run(doc: dict[str, Any], phase: str, nbytes: str | None = None) -> None:
    """``doc[phase]`` is a part of the run's ``doc["seconds"]`` (relations only: no duration is asserted), and
    ``doc["gb_per_s"]``, where given, is the rate of ``doc[nbytes]`` over that phase alone."""
    assert 0 <= doc[phase] <= doc["seconds"], doc
    if nbytes is not None and doc[phase] > 0:
        assert doc["gb_per_s"] == pytest.approx(doc[nbytes] / doc[phase] / 1e9, rel=0.01, abs=1e-3)


def test_export_json_carries_the_whole_time_and_the_write_time(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    _phase_of_the_run(doc, "write_seconds", "bytes")
    assert "export:" not in res.stderr  # not a terminal: no phase line
    dry = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "dry"), "--json", "--dry-run"])
    assert dry.exit_code == 0, dry.stderr
    assert json.loads(dry.stdout)["write_seconds"] == 0  # nothing written


def test_replay_step_names_its_phases_before_the_parameter_bar(sample_ckpt: Path) -> None:
    # at 60 columns: the opening line may fold inside the path; the wrapped verdict keeps its value column
    rc, out = run_in_pty(["replay-step", str(sample_ckpt), "--device", "cpu", "--filter", "*layers.0.*"], 60)
    assert rc == 0, out
    lines = ANSI.sub("", out).splitlines()
    text = " ".join(lines)
    assert "/?" not in text and "?/" not in text
    _in_order(
        text,
        "replay-step: opening ",
        "replay-step: planning…",
        "replay-step: loading optimizer state…",
        "replay-step: building the model…",
        "replay-step: replaying ",
    )
    assert "replaying 0/?" not in text
    i = next(i for i, ln in enumerate(lines) if ln.startswith("result      OK: "))
    assert len(lines[i]) <= 60 and lines[i + 1].startswith(" " * 12) and lines[i + 1][12] != " ", lines[i : i + 2]


def test_stats_manifest_and_diff_name_their_phases(sample_ckpt: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(sample_ckpt, a)
    shutil.copytree(sample_ckpt, b)
    # at 60 columns (phase lines may fold inside a path): the per-layer table fits, its low-value columns hidden
    # (named below it) and its key column whole
    rc, out = run_in_pty(["stats", str(a), str(b)], 60)
    assert rc == 0, out
    lines = ANSI.sub("", out).splitlines()
    text = " ".join(lines)
    _in_order(text, "stats: opening ", "2/2…", "stats: measuring ", " 500.3/500.3 KiB", "stats: comparing steps")
    assert "B/s" not in text  # a bar below 80 columns: no rate, no time left
    rows = [ln for ln in lines if ln.startswith("│ ")]
    assert [r.split("│")[1].strip() for r in rows][:2] == ["model.embed_tokens", "model.layers.0"]
    assert max(len(r) for r in rows) <= 60 and "(not shown at 60 columns: " in text
    assert any(r.startswith("│ model.layers.0 ") for r in rows) and any(r.startswith("│ lm_head ") for r in rows)
    text = _shown(["manifest", str(a)])
    _in_order(text, f"manifest: opening {a}…", "manifest: planning…", "manifest: hashing", "wrote ")
    assert "; hashed in " in text and "in all" in text  # the rate of the hashing alone
    assert (a / "manifest.json").is_file()
    text = _shown(["manifest", str(a), "--verify"])
    _in_order(
        text,
        f"manifest --verify: reading manifest {a / 'manifest.json'}…",
        f"manifest --verify: opening {a}…",
        "manifest --verify: verifying ━",
        "matches its manifest",
    )
    doc = json.loads(runner.invoke(app, ["manifest", str(b), "--json"]).stdout)
    _phase_of_the_run(doc, "hash_seconds", "bytes_hashed")
    text = _shown(["diff", str(a), str(b)])
    _in_order(text, f"diff: opening A ({a})…", f"diff: opening B ({b})…", "diff: matching names…", "diff: comparing ━")


def test_validate_deep_names_its_phases_and_rates_the_reading_alone(sample_ckpt: Path) -> None:
    # at 60 columns: the opening line may fold inside the path; "checking rules", named after the bar
    # started, keeps the bar on one line
    rc, out = run_in_pty(["validate", str(sample_ckpt), "--deep"], 60)
    assert rc == 0, out
    text = ANSI.sub("", out)
    assert not re.search(r"\n\s*KiB", text)
    _in_order(
        text.replace("\n", " "),
        "validate --deep: opening ",
        "validate --deep: reading param groups and extra state…",
        "validate --deep: planning the deep pass…",
        "validate --deep: reading ━",
        "validate --deep: checking ru",  # the bar keeps its amounts whole: a long phase name ends in "…"
        "OK: ",
        ", read ",
    )
    stats = json.loads(runner.invoke(app, ["validate", str(sample_ckpt), "--deep", "--json"]).stdout)["stats"]
    _phase_of_the_run(stats, "deep_seconds")


def test_reshard_names_its_phases_and_rates_the_writing_alone(sample_ckpt: Path, tmp_path: Path) -> None:
    argv = ["reshard", str(sample_ckpt), str(tmp_path / "r"), "--to", "canonical", "--with-optimizer"]
    text = _shown([*argv, "--manifest"])
    _in_order(
        text,
        f"reshard: opening {sample_ckpt}…",
        "reshard: planning…",
        "reshard: writing ━",
        "reshard: copying extra files",
        "reshard: writing manifest.json",
        "wrote ",
        "in all; written in ",
    )
    assert (tmp_path / "r" / ".metadata").is_file()
    doc = json.loads(runner.invoke(app, [*argv[:2], str(tmp_path / "j"), *argv[3:], "--json"]).stdout)
    _phase_of_the_run(doc, "write_seconds")
    res = runner.invoke(app, [*argv[:2], str(tmp_path / "p"), *argv[3:]])  # not a terminal: nothing on stderr
    assert res.exit_code == 0 and res.stderr == "", res.stderr


def test_import_names_its_phases_and_draws_the_write_bar(sample_ckpt: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    assets = sample_ckpt / "model_assets"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--model-assets", str(assets)]).exit_code == 0
    text = _shown(["import", str(hf), str(tmp_path / "dcp"), "--manifest"])
    _in_order(
        text,
        f"import: reading headers of {hf}…",
        "import: planning…",
        "import: writing ━",
        "KiB",
        "import: writing metadata and manifest.json",
    )
    assert (tmp_path / "dcp" / ".metadata").is_file()
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "p")])  # not a terminal: nothing on stderr
    assert res.exit_code == 0 and res.stderr == "", res.stderr
