"""What a new user met on checkpoints saved with ``torch.distributed.checkpoint.save``, through the CLI:
``stats`` keeps a long table title whole in a pipe, writes counts with separators and its notes on
stderr; ``inspect`` says plainly when optimizer state is keyed by index and names ``--step`` as a flag;
``export`` says when its output holds no ``config.json``; ``ckpttool --json schema`` is refused."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import shell_arg
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()
CHANGE_TITLE = "relative change ‖W_b − W_a‖ / ‖W_a‖ between consecutive checkpoints (#N: the Nth checkpoint given)"


def _save(state: dict, out: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out


@pytest.fixture(scope="module")
def plain_optimizer_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()})``: state keyed by index."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(up=torch.nn.Linear(8, 8), down=torch.nn.Linear(8, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    return _save(state, tmp_path_factory.mktemp("plain") / "ck")


def test_stats_keeps_a_title_wider_than_its_table_whole_in_a_pipe(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["stats", str(sample_ckpt), str(sample_ckpt)], env={"COLUMNS": ""})
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert CHANGE_TITLE in lines  # one line, not cut to the two-column table's width
    table = lines[lines.index(CHANGE_TITLE) + 1 :]
    assert table[0].startswith("┏") and len(table[0]) < len(CHANGE_TITLE)
    assert "│ model.model.layers.0 │    0 │" in table or any(r.startswith("│ model.layers.0 ") for r in table)


def test_stats_writes_counts_with_thousands_separators(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["stats", str(sample_ckpt)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stderr
    row = next(r for r in res.stdout.splitlines() if r.startswith("│ model.embed_tokens "))
    assert row.split("│")[2].strip() == "4,096"  # 128x32 embedding
    # wide enough for the numel column (at 80 it gives way, named below the table)
    res = runner.invoke(
        app, ["stats", str(sample_ckpt), "--by", "tensor", "--filter", "*embed_tokens*"], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.stderr
    assert " 4,096 " in res.stdout and " 4096 " not in res.stdout


def test_stats_notes_go_to_stderr_and_quiet_drops_them(tmp_path: Path) -> None:
    import torch

    w = torch.ones(4, 4)
    state = {"exp_avg": w * 0.1, "exp_avg_sq": w * 0.01, "step": torch.tensor(3.0)}
    ck = _save({"model": {"layers.0.w": w}, "optimizer": {"state": {"layers.0.w": state}}}, tmp_path / "ck")
    res = runner.invoke(app, ["stats", str(ck)])
    assert res.exit_code == 0, res.stderr
    assert "note:" not in res.stdout and "no update size" not in res.stdout
    assert res.stderr == (
        f"note: {ck}: no update size: no param group or step saved: 1 parameter(s), e.g. layers.0.w\n"
    )
    res = runner.invoke(app, ["-q", "stats", str(ck)])
    assert res.exit_code == 0 and res.stderr == "" and "layers.0" in res.stdout


def test_inspect_says_index_keyed_optimizer_state_matches_no_parameter(plain_optimizer_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(plain_optimizer_ckpt)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    line = next(ln for ln in lines if ln.startswith("optimizer "))
    assert line.startswith("optimizer   flavor nested; state of 4 parameters keyed by index")
    assert "matched to no model parameter (validate: K003;" in line
    assert "state for 0/0 params" not in res.stdout and "state for fqns not in the model" not in res.stdout
    assert any(ln.startswith("│ 0     │      4 │") for ln in lines)  # the param group is still shown
    assert runner.invoke(app, ["validate", str(plain_optimizer_ckpt), "--select", "K003"]).exit_code == 1


def test_inspect_names_the_step_it_opened_by_its_flag(sample_ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "my run"  # a space, as users' folders have
    for step in (1, 2):
        copy_checkpoint(sample_ckpt, root / f"step-{step}")
    res = runner.invoke(app, ["inspect", str(root), "--step", "latest"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.stderr
    assert f"opened      {root / 'step-2'} (--step latest: step 2 (the highest step))" in res.stdout.splitlines()
    res = runner.invoke(app, ["inspect", str(root), "--step", "1"], env={"COLUMNS": "300"})
    assert f"opened      {root / 'step-1'} (--step 1)" in res.stdout.splitlines()
    assert "`" not in res.stdout


def test_json_schema_list_is_refused_not_a_table(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["--json", "schema"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: [E100] `ckpttool schema` without NAME lists the schemas as a table")
    res = runner.invoke(app, ["--json", "schema", "stats"])
    assert res.exit_code == 0 and res.stdout.startswith("{")


def test_export_without_a_config_says_from_pretrained_needs_one(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.stderr
    assert not (tmp_path / "hf" / "config.json").exists()
    assert (
        f"note: {tmp_path / 'hf'} holds no config.json (no --model-assets): transformers' from_pretrained needs one; "
        "pass --model-assets DIR, the folder of the model's config.json and tokenizer files (the trainer saved one "
        f"beside the checkpoint: --model-assets {sample_ckpt / 'model_assets'})\n"
    ) in res.stderr
    assert "config.json" not in res.stdout.split("files")[0]
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "d"), "--dry-run"])
    assert res.exit_code == 0 and f"note: {tmp_path / 'd'} would hold no config.json" in res.stderr
    assets = tmp_path / "assets"
    assets.mkdir()
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "e"), "--model-assets", str(assets)])
    assert res.exit_code == 0, res.stderr
    assert f"holds no config.json ({assets} has none): transformers' from_pretrained needs one" in res.stderr
    res = runner.invoke(
        app, ["export", str(sample_ckpt), str(tmp_path / "f"), "--model-assets", str(sample_ckpt / "model_assets")]
    )
    assert res.exit_code == 0 and "config.json" not in res.stderr and (tmp_path / "f" / "config.json").is_file()
    res = runner.invoke(app, ["-q", "export", str(sample_ckpt), str(tmp_path / "g")])
    assert res.exit_code == 0 and res.stderr == ""


def test_diff_takes_export_rules_as_rules_like_export(sample_ckpt: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "format: ckpttool.export-rules\nversion: 1\nkeys:\n  - {match: '^model\\.lm_head\\.weight$', to: 'head.weight'}\n"
    )
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--rules", str(rules)]).exit_code == 0
    plain = runner.invoke(app, ["diff", str(sample_ckpt), str(hf)])
    assert plain.exit_code == 1  # lm_head.weight on one side, head.weight on the other
    for flag in ("--rules", "--map"):  # export's name, and the old one
        res = runner.invoke(app, ["diff", str(sample_ckpt), str(hf), flag, str(rules)])
        assert res.exit_code == 0, res.stdout + res.stderr
        assert "compared 33 tensors" in res.stdout
    assert "--rules, --map FILE" in runner.invoke(app, ["diff", "--help"], env={"COLUMNS": "200"}).stdout


def test_a_command_suggested_with_a_path_can_be_pasted_as_it_is(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "my sample"
    res = runner.invoke(app, ["sample", str(out), "--train-steps", "0"])
    assert res.exit_code == 0, res.stderr
    assert f"note: try: ckpttool inspect '{out}'\n" in res.stderr
    spaced = copy_checkpoint(sample_ckpt, tmp_path / "a ckpt")
    res = runner.invoke(app, ["import", str(spaced), str(tmp_path / "x")])
    assert res.exit_code == 2
    assert f"hint: did you mean `ckpttool export '{spaced}' OUT` (DCP to safetensors)?" in res.stderr
    res = runner.invoke(app, ["sample", str(tmp_path / "plain"), "--train-steps", "0"])
    assert f"note: try: ckpttool inspect {tmp_path / 'plain'}\n" in res.stderr  # nothing to quote


def test_import_summary_lines_keep_one_value_column(sample_ckpt: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    assets = ["--model-assets", str(sample_ckpt / "model_assets")]
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), *assets]).exit_code == 0
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "ck"), "--ep-size", "2", "--world-size", "2"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[1] == "key schema  torch-native; 2 ranks"
    assert lines[2] == "EP layout   canonical (version 2), ep_size 2, ep_fsdp_size 1; 4 expert tensors"
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "one")])
    assert res.exit_code == 0 and res.stdout.splitlines()[1] == "key schema  torch-native; 1 rank"


def test_manifest_verify_says_what_differs_from_what(sample_ckpt: Path, tmp_path: Path) -> None:
    import re

    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    assert runner.invoke(app, ["manifest", str(ck)]).exit_code == 0
    ok = runner.invoke(app, ["manifest", str(ck), "--verify"])
    assert ok.exit_code == 0
    assert ok.stdout == f"{ck} (dcp) matches its manifest {ck / 'manifest.json'} (140 entries)\n"
    data = ck / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    bad = runner.invoke(app, ["manifest", str(ck), "--verify"])
    assert bad.exit_code == 1
    last = bad.stdout.splitlines()[-1]
    assert re.fullmatch(rf"{re.escape(str(ck))} \(dcp\) differs from its manifest .+ \(140 entries\): 1 problem", last)


def test_replay_step_says_it_compared_with_torch_adamw(sample_ckpt: Path) -> None:
    args = ["replay-step", str(sample_ckpt), "--filter", "*layers.0.mlp.gate.weight"]
    res = runner.invoke(app, [*args, "--reference", "torch"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("replay "))
    assert line.startswith(
        "replay      1 step vs a float64 reference and torch.optim.AdamW with the saved flags (bitwise, 1 of "
        "1 parameter); tolerance"
    )
    assert "result      OK: 1 of 1 parameter matches the reference step with a sane update" in res.stdout
    res = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 0 and "torch.optim.AdamW" not in res.stdout


def test_import_dtype_takes_the_aliases_every_dtype_option_takes(sample_ckpt: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf)]).exit_code == 0
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "a"), "--dtype", "bf16", "--dry-run"])
    assert res.exit_code == 0, res.stderr
    assert "warning: --dtype bfloat16 applies to quantized weights; the checkpoint has none" in res.stderr
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "b"), "--dtype", "fp8"])
    assert res.exit_code == 2 and res.stdout == "" and not (tmp_path / "b").exists()
    assert res.stderr == (
        "error: [E100] --dtype 'fp8' is not one of bfloat16, float32\n"
        "hint: dtype aliases: bf16, fp32/float\n"  # not fp16/half or fp64/double, which it refuses too
    )
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "b"), "--dtype", "half"])
    assert res.exit_code == 2 and res.stderr.endswith("hint: dtype aliases: bf16, fp32/float\n"), res.stderr
    assert "--dtype <bfloat16|float32>" in runner.invoke(app, ["import", "--help"], env={"COLUMNS": "200"}).stdout


def test_export_help_names_every_save_dtype_alias_it_takes(sample_ckpt: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "300"}).stdout
    line = " ".join(out.split())  # the help as one line, however it wraps
    assert "aliases bf16; fp16, f16, half; fp32, f32, float; any case, torch. prefix optional" in line, line
    for word, dtype in (("half", "F16"), ("F32", "F32"), ("torch.float", "F32")):
        hf = tmp_path / word
        res = runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--save-dtype", word])
        assert res.exit_code == 0, res.stderr
        with safe_open(str(next(hf.glob("*.safetensors"))), "np") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {dtype}


def test_export_json_has_no_config_note_beside_it(sample_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--json"])
    # the sample's MoE experts are written fused: the one note is that one (--experts per-expert)
    assert res.exit_code == 0 and [ln for ln in res.stderr.splitlines() if "fused expert tensor(s)" not in ln] == []
    assert "config.json" not in json.loads(res.stdout)["assets"]


def test_export_names_the_filter_by_its_flag_in_the_summary(sample_ckpt: Path, tmp_path: Path) -> None:
    args = ["export", str(sample_ckpt), str(tmp_path / "hf"), "--filter", "model.layers.0.*"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.stderr
    assert "not exported excluded by --filter: 18" in res.stdout.splitlines() and "`" not in res.stdout
    doc = json.loads(runner.invoke(app, [*args[:2], str(tmp_path / "j"), *args[3:], "--json"]).stdout)
    assert doc["skipped"]["excluded by `filter_glob`"]["count"] == 18  # the document keeps the library's reason


@pytest.fixture(scope="module")
def dense_model_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save({"model": model.state_dict()})`` of a dense model: no optimizer state, no experts."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(up=torch.nn.Linear(8, 8), down=torch.nn.Linear(8, 4)))
    return _save({"model": model.state_dict()}, tmp_path_factory.mktemp("dense") / "ck")


def test_messages_name_what_is_wrong(dense_model_ckpt: Path, tmp_path: Path) -> None:
    """reshard of a dense model, import of a missing folder, an export OUT that is a file, a model-only diff
    of optimizer state: each line says what is wrong and what to do, exit 2, nothing written."""
    res = runner.invoke(app, ["reshard", str(dense_model_ckpt), str(tmp_path / "o1"), "--to", "canonical"])
    assert res.exit_code == 2 and "no expert-parallel tensor (a dense model)" in res.stderr
    assert not (tmp_path / "o1").exists()
    res = runner.invoke(app, ["import", str(tmp_path / "missing"), str(tmp_path / "o2")])
    assert res.exit_code == 2 and f"{tmp_path / 'missing'}: no such directory" in res.stderr
    (tmp_path / "afile").write_bytes(b"keep")
    res = runner.invoke(app, ["export", str(dense_model_ckpt), str(tmp_path / "afile")])
    assert res.exit_code == 2 and "exists and is not a directory" in res.stderr and "link" not in res.stderr
    assert (tmp_path / "afile").read_bytes() == b"keep"
    res = runner.invoke(app, ["diff", str(dense_model_ckpt), str(dense_model_ckpt), "--what", "optimizer"])
    assert res.exit_code == 2 and "hold optimizer state, or compare the models with --what model" in res.stderr


def test_reshard_of_a_dense_model_is_refused_whatever_the_target_sizes(dense_model_ckpt: Path, tmp_path: Path) -> None:
    """Target sizes made reshard of a dense model succeed and write a record claiming ep_size 2 for a model without
    experts (without them it was refused): it is refused the same way with or without them, nothing written."""
    for sizes in ([], ["--target-ep-size", "2", "--target-ep-fsdp-size", "1"], ["--target-ep-size", "1"]):
        out = tmp_path / f"o{len(sizes)}"
        res = runner.invoke(app, ["reshard", str(dense_model_ckpt), str(out), "--to", "canonical", *sizes])
        assert res.exit_code == 2, res.stdout
        assert res.stderr.startswith("error: [E100] ") and "no expert-parallel tensor (a dense model)" in res.stderr
        assert not out.exists()


def test_several_checkpoints_hint_a_path_to_paste(dense_model_ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "my run"
    for step in (100, 200):
        copy_checkpoint(dense_model_ckpt, root / f"step-{step}")
    res = runner.invoke(app, ["inspect", str(tmp_path)])
    assert res.exit_code == 2, res.stdout
    assert f"'{root / 'step-200'}'" in res.stderr  # quoted: the space is kept when pasted


def test_sequential_model_optimizer_state_by_index_and_by_fqn(tmp_path: Path) -> None:
    """``nn.Sequential`` (fqns 0.weight, 1.weight): a plain ``opt.state_dict()`` is keyed by index (K003), the
    state of ``get_optimizer_state_dict`` by fqn (0.weight.exp_avg) and validates clean."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    plain = _save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "plain")
    by_fqn = _save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}, tmp_path / "fqn")
    res = runner.invoke(app, ["--json", "inspect", str(plain)])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["key_schema"]["optimizer_keying"] == "index"
    res = runner.invoke(app, ["validate", "--strict", str(plain)])
    assert res.exit_code == 1 and "K003" in res.stdout  # a finding: exit 1
    res = runner.invoke(app, ["--json", "inspect", str(by_fqn)])
    assert json.loads(res.stdout)["key_schema"]["optimizer_keying"] == "fqn"
    res = runner.invoke(app, ["validate", "--strict", str(by_fqn)])
    assert res.exit_code == 0, res.stdout


def test_diff_names_the_steps_it_opened(dense_model_ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        copy_checkpoint(dense_model_ckpt, root / f"step-{step}")
    res = runner.invoke(app, ["diff", str(root), str(root), "--a-step", "1", "--b-step", "2"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"A: {root}: opened {root / 'step-1'} (dcp")
    assert lines[1].startswith(f"B: {root}: opened {root / 'step-2'} (dcp")
    doc = json.loads(runner.invoke(app, ["--json", "diff", str(root / "step-1"), str(root), "--b-step", "2"]).stdout)
    assert doc["a"]["opened"] is None and doc["b"]["opened"] == str(root / "step-2")


def test_sequential_model_nested_optimizer_state_is_keyed_by_fqn(tmp_path: Path) -> None:
    """``nn.Sequential`` fqns (0.weight) with optimizer state nested below each fqn (a dict per parameter, as
    Shampoo-like optimizers keep: state.0.weight.shampoo.factor): keyed by fqn, not by index."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    state = {
        fqn: {"shampoo": {"factor": torch.zeros_like(p), "inverse": torch.ones_like(p)}}
        for fqn, p in model.state_dict().items()
    }
    groups = [{"lr": 0.1, "params": list(state)}]
    ck = _save({"model": model.state_dict(), "optimizer": {"state": state, "param_groups": groups}}, tmp_path / "ck")
    res = runner.invoke(app, ["--json", "inspect", str(ck)])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["key_schema"]["optimizer_keying"] == "fqn"


def test_replay_filter_counts_only_the_tensors_it_selects(sample_ckpt: Path) -> None:
    """The note of model tensors in no param group counts those the selection keeps: the sample's two MoE
    router biases (buffers), one of them in layer 0."""
    notes = {}
    for args in ([], ["--filter", "*layers.0.mlp*"]):
        res = runner.invoke(app, ["replay-step", str(sample_ckpt), *args])
        assert res.exit_code == 0, res.stderr
        out = res.stdout + res.stderr
        notes[bool(args)] = next(line for line in out.splitlines() if "in no param group" in line)
    assert "2 model tensor(s) in no param group" in notes[False]
    assert "1 model tensor(s) in no param group" in notes[True]


def test_import_says_it_wrote_a_manifest(sample_ckpt: Path, tmp_path: Path) -> None:
    # `import --manifest` wrote OUT/manifest.json without a word (reshard --manifest names it)
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf)]).exit_code == 0
    out = tmp_path / "dcp"
    res = runner.invoke(app, ["import", str(hf), str(out), "--manifest"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines()[-1] == f"manifest    {out}/manifest.json (storage records digested as written)"
    assert runner.invoke(app, ["manifest", str(out), "--verify"]).exit_code == 0
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "dry"), "--manifest", "--dry-run"])
    assert res.exit_code == 0 and not (tmp_path / "dry").exists()
    assert res.stdout.splitlines()[-1].startswith(f"manifest    would write {tmp_path / 'dry'}/manifest.json")
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "plain")])
    assert res.exit_code == 0 and "manifest" not in res.stdout


def test_reshard_help_examples_run_on_a_checkpoint_with_optimizer_state(sample_ckpt: Path, tmp_path: Path) -> None:
    """The first reshard example, `ckpttool reshard ckpt/ out/ --to canonical`, was refused (E602: EP optimizer
    state needs --with-optimizer) on any training checkpoint, the sample included; so was the --manifest one.
    Each example that fits the sample's mesh runs on it as printed (the legacy 4x2 one declares another mesh)."""
    import shlex

    from ckpttool.commands.reshard import EPILOG

    lines = [ln.strip() for ln in EPILOG.splitlines() if ln.strip().startswith("ckpttool reshard")]
    assert len(lines) == 4
    ran = 0
    for i, line in enumerate(lines):
        argv = shlex.split(line)[1:]
        if "--source-layout" in argv:
            assert "--with-optimizer" in argv
            continue
        argv = [str(sample_ckpt) if a == "ckpt/" else str(tmp_path / f"out{i}") if a == "out/" else a for a in argv]
        res = runner.invoke(app, argv)
        assert res.exit_code == 0, (line, res.stderr)
        ran += 1
    assert ran == 3


def test_import_for_fsdp_ranks_of_a_moe_says_how_to_keep_its_own_checks_clean(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """`import hf/ ckpt/ --world-size 4` of a MoE (the sample's 8 experts) wrote expert chunks that some EP x
    EP-FSDP mesh (2 x 2) writes too, and no layout record: ckpttool's own `validate --strict` failed (L003) and
    `export` refused (E405), without a word from the import. It now warns, naming `--ep-fsdp-size 4`, which
    writes the same chunks with a record; that output passes `validate --strict` and exports."""
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), "-q"]).exit_code == 0
    plain, recorded = tmp_path / "plain", tmp_path / "recorded"
    res = runner.invoke(app, ["import", str(hf), str(plain), "--world-size", "4", "--no-fsync"])
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines() == [
        "warning: model.model.layers.0.mlp.experts.gate_up_proj (and 3 more): --world-size 4 cuts the expert dim "
        "into blocks that validate, export, reshard and diff cannot tell from an EP layout (L003, E405); import "
        "with --ep-fsdp-size 4 instead: the same chunks, with a layout record"
    ]
    assert runner.invoke(app, ["validate", str(plain), "--strict"]).exit_code == 1  # what the warning foretells
    res = runner.invoke(app, ["import", str(hf), str(recorded), "--ep-fsdp-size", "4", "--no-fsync"])
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    assert runner.invoke(app, ["validate", str(recorded), "--strict"]).exit_code == 0
    assert runner.invoke(app, ["export", str(recorded), str(tmp_path / "back"), "-q"]).exit_code == 0
    res = runner.invoke(app, ["diff", str(plain), str(recorded), "--no-ep"])
    assert res.exit_code == 0, res.stdout  # the same values; the chunks are the same records
    res = runner.invoke(app, ["import", str(hf), str(tmp_path / "two"), "--world-size", "2", "--no-fsync"])
    assert res.exit_code == 0 and res.stderr == ""  # 2 blocks: no EP mesh of both sizes > 1 writes them


def test_export_help_gives_quantize_no_default_it_does_not_have(sample_ckpt: Path, tmp_path: Path) -> None:
    """`export --help` ended --quantize's description with `stay --save-dtype [default: bfloat16]`, click's
    way of saying --quantize itself defaults to bfloat16 (it defaults to no quantization, and its choices are
    fp8-block/fp8-channel). It now says what it meant: the tensors left unquantized are written in
    --save-dtype, whose default `preserve` means bfloat16 with --quantize (as a real export shows)."""
    text = " ".join(runner.invoke(app, ["export", "--help"], env={"COLUMNS": "200"}).stdout.split())
    entry = text[text.index("--quantize <fp8-block|fp8-channel>") : text.index("--quantize-block")]
    assert "[default:" not in entry and "stay unquantized, in --save-dtype (preserve: bfloat16 here)" in entry
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "q"), "--quantize", "fp8-block"])
    assert res.exit_code == 0, res.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"


def test_a_quoted_tilde_path_with_spaces_is_named_ready_to_paste(sample_ckpt: Path, tmp_path: Path) -> None:
    """`ckpttool inspect '~/my ckpt'`: quotes (what a name with a space needs) are why bash left the `~`; the hint's
    path was unquoted, `pass /home/u/my ckpt`, two arguments when pasted. It is one shell argument."""
    copy_checkpoint(sample_ckpt, tmp_path / "my ckpt")
    res = runner.invoke(app, ["inspect", "~/my ckpt"], env={"HOME": str(tmp_path)})
    assert res.exit_code == 2 and res.stderr.splitlines()[1] == (
        "hint: the shell did not expand ~ (it does not inside quotes or after an option's =): "
        f"pass {shell_arg(tmp_path / 'my ckpt')}"
    ), res.stderr
    assert shell_arg(tmp_path / "my ckpt").startswith("'")
    res = runner.invoke(app, ["export", str(tmp_path / "my ckpt"), "~/my out"], env={"HOME": str(tmp_path)})
    assert res.exit_code == 2 and res.stderr.splitlines()[1] == f"hint: pass {shell_arg(tmp_path / 'my out')}"


def test_a_close_name_with_a_space_is_suggested_ready_to_paste(sample_ckpt: Path, tmp_path: Path) -> None:
    """A typo of a folder whose name holds a space (`inspect 'my ckpt-1'` beside `my ckpt-2/`): the folder suggested
    ("did you mean ...?") was unquoted, two arguments when pasted. It is one shell argument."""
    copy_checkpoint(sample_ckpt, tmp_path / "my ckpt-2")
    res = runner.invoke(app, ["inspect", str(tmp_path / "my ckpt-1")])
    assert res.exit_code == 2, res.stderr
    assert res.stderr.splitlines()[1] == f"hint: did you mean {shell_arg(tmp_path / 'my ckpt-2')}?", res.stderr
    assert runner.invoke(app, ["inspect", str(tmp_path / "my ckpt-2")]).exit_code == 0


def test_a_tilde_the_shell_left_unexpanded_is_named_with_its_expansion(sample_ckpt: Path, tmp_path: Path) -> None:
    """`ckpttool inspect '~/ckpt'` or `export ... --model-assets=~/assets` (bash expands `~` neither in quotes nor
    after `--option=`): the hint listed the current directory's folders, and a missing --model-assets was
    'is not a directory' with no hint of what to pass. The hint now names the `~` and the path it stands for."""
    copy_checkpoint(sample_ckpt, tmp_path / "ck")
    env = {"HOME": str(tmp_path)}
    res = runner.invoke(app, ["inspect", "~/ck"], env=env)
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        "error: [E100] ~/ck: no such directory",
        f"hint: the shell did not expand ~ (it does not inside quotes or after an option's =): pass {tmp_path / 'ck'}",
    ], res.stderr
    assert runner.invoke(app, ["inspect", str(tmp_path / "ck")], env=env).exit_code == 0  # the path named works
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(tmp_path / "ck"), str(out), "--model-assets=~/ck/model_assets"], env=env)
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        "error: [E100] --model-assets ~/ck/model_assets: no such directory",
        "hint: the shell did not expand ~ (it does not inside quotes or after an option's =): "
        f"pass {tmp_path / 'ck' / 'model_assets'}",
    ], res.stderr
    assert not out.exists()
    for args in (["validate", "--config=~/nowhere/config.json"], ["replay-step", "--grads=~/g.safetensors"]):
        res = runner.invoke(app, [args[0], str(tmp_path / "ck"), *args[1:]], env=env)
        assert res.exit_code == 2 and res.stderr.splitlines()[1] == (
            "hint: the shell did not expand ~ (it does not inside quotes or after an option's =); "
            f"{tmp_path / args[1].split('~/')[1]} does not exist either"
        ), res.stderr
    res = runner.invoke(
        app, ["export", str(tmp_path / "ck"), str(out), "--model-assets", str(tmp_path / "ck" / "assets")]
    )
    assert (
        res.exit_code == 2 and res.stderr.splitlines()[1] == f"hint: did you mean {tmp_path / 'ck' / 'model_assets'}?"
    )


def test_stamp_of_a_safetensors_model_folder_says_it_has_no_ranks(sample_ckpt: Path, tmp_path: Path) -> None:
    """`ckpttool stamp hf/ --source-layout legacy --ep-size 1 --ep-fsdp-size 1` on an HF export said its EP
    tensors 'were written by 0 rank(s) []' and told to declare the mesh of '0 rank(s)'. It now says a
    safetensors folder names no saving rank and points to the DCP checkpoint; nothing is written."""
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf)]).exit_code == 0
    before = sorted(p.name for p in hf.iterdir())
    res = runner.invoke(app, ["stamp", str(hf), "--source-layout", "legacy", "--ep-size", "1", "--ep-fsdp-size", "1"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: [E400] {hf}: nothing to stamp: --source-layout legacy --ep-size 1 --ep-fsdp-size 1 cannot be "
        "verified: its EP tensors name no saving rank (a safetensors model folder stores each tensor whole, in "
        "files of no rank), so no chunk can confirm the declared sizes",
        "hint: nothing was written; stamp the DCP checkpoint the job saved (the directory holding .metadata and "
        "__R_N.distcp files)",
    ], res.stderr
    assert sorted(p.name for p in hf.iterdir()) == before


def test_a_folder_inside_a_checkpoint_given_as_dot_names_the_checkpoint(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cd ckpt/model_assets && ckpttool inspect .`: `inspect ckpt/model_assets` hinted `pass the checkpoint
    directory ckpt`, but `.` (whose parent as given is `.` again) got only the generic hint about config
    folders and dcp.save. The checkpoint is now looked for above the absolute path and named relative to
    where the user is: `..`."""
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    monkeypatch.chdir(ck / "model_assets")
    for command in ("inspect", "validate", "stats"):
        res = runner.invoke(app, [command, "."])
        assert res.exit_code == 2, res.output
        assert res.stderr.splitlines()[-2:] == [
            "error: [E200] .: no .metadata, and no DCP checkpoint in the 3 directory levels below it",
            "hint: pass the checkpoint directory .. (model_assets/ is a folder inside it)",
        ], res.stderr
    assert runner.invoke(app, ["inspect", ".."]).exit_code == 0


def test_an_optimizer_folder_opened_alone_names_its_model_folder(
    acc_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accelerate's ``optimizer_0/`` given alone (the optimizer half of ``checkpoint-1/``): `replay-step` said the
    optimizer state "does not name this checkpoint's model tensors" and `export` "pass the model checkpoint", as
    if the folder held some other model. Both now name the model folder beside it and the step directory to pass
    instead (as the model folder opened alone names its optimizer folder), relative as the user named it: also
    from inside the folder (``.``)."""
    step = acc_root / "accelerate" / "checkpoint-1"
    monkeypatch.chdir(step)
    want = "hint: its model folder pytorch_model_fsdp_0/ lies beside it: pass the step directory ., which holds both"
    for args in (["replay-step", "optimizer_0"], ["export", "optimizer_0", str(acc_root / "none")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        assert res.stderr.splitlines()[-1] == want, res.stderr
    monkeypatch.chdir(step / "optimizer_0")
    res = runner.invoke(app, ["replay-step", "."])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[-1] == (
        "hint: its model folder ../pytorch_model_fsdp_0/ lies beside it: pass the step directory .., which holds both"
    )
    assert not (acc_root / "none").exists()
    res = runner.invoke(app, ["replay-step", ".."])  # the step directory the hint names: both halves, one checkpoint
    assert res.exit_code == 0, res.output


def test_manifest_verify_of_a_file_in_the_checkpoint_names_its_folder(sample_ckpt: Path, tmp_path: Path) -> None:
    """`manifest FILE --verify` with a file of the checkpoint (its ``.metadata``, a ``.distcp``, the
    ``manifest.json`` itself, a ``.safetensors`` of an export) said ``FILE/manifest.json: no such manifest
    file`` and hinted to write one, as if the folder held none; `manifest FILE` (writing) and every other
    command say the file is not a directory and name the folder to pass. `--verify` now says the same."""
    ckpt = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    assert runner.invoke(app, ["manifest", str(ckpt)]).exit_code == 0
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(ckpt), str(hf), "-q"]).exit_code == 0
    cases = [
        (ckpt / ".metadata", ckpt, "the one holding .metadata"),
        (ckpt / "__0_0.distcp", ckpt, "the one holding .metadata"),
        (ckpt / "manifest.json", ckpt, "the one holding .metadata"),
        (hf / "model.safetensors", hf, "the one holding the .safetensors files"),
    ]
    for given, folder, holding in cases:
        want = [
            f"error: [E100] {given} is not a directory",
            f"hint: pass the checkpoint directory ({holding}), not a file in it: {folder}",
        ]
        for verify in ([], ["--verify"]):
            res = runner.invoke(app, ["manifest", str(given), *verify])
            assert (res.exit_code, res.stdout, res.stderr.splitlines()) == (2, "", want), (verify, res.stderr)
    res = runner.invoke(app, ["manifest", str(ckpt), "--verify"])  # the folder the hint names
    assert res.exit_code == 0, res.output


def test_optimizer_dir_naming_a_file_of_the_optimizer_checkpoint_names_its_folder(acc_root: Path) -> None:
    """`--optimizer-dir checkpoint-1/optimizer_0/.metadata` (the file, not its folder) said "not a DCP checkpoint
    directory (no .metadata)" about a .metadata file; it now says it is a file of a DCP checkpoint and names the
    folder to pass, which the same command then accepts."""
    step = acc_root / "accelerate" / "checkpoint-1"
    model, opt = step / "pytorch_model_fsdp_0", step / "optimizer_0"
    for given in (opt / ".metadata", next(opt.glob("*.distcp"))):
        res = runner.invoke(app, ["replay-step", str(model), "--optimizer-dir", str(given)])
        assert (res.exit_code, res.stdout, res.stderr.splitlines()) == (
            2,
            "",
            [
                f"error: [E100] --optimizer-dir {given}: a file of a DCP checkpoint, not its directory",
                f"hint: pass the folder that holds it: {opt}",
            ],
        ), res.stderr
    res = runner.invoke(app, ["replay-step", str(model), "--optimizer-dir", str(opt)])
    assert res.exit_code == 0, res.output


def test_a_directory_given_for_a_file_option_names_the_option(sample_ckpt: Path, tmp_path: Path) -> None:
    """`--rules DIR` / `--adapter-config DIR` (the folder instead of the file in it) printed ``E102 DIR is a
    directory, not a regular file`` with the special-file hint "replace the special file by the real data",
    naming no option. It now names the option and what it expects, and nothing is written."""
    out = tmp_path / "out"
    cases = [
        (["export", str(sample_ckpt), str(out), "--rules", str(tmp_path)], "--rules", "a YAML rules file"),
        (
            ["export", str(sample_ckpt), str(out), "--format", "lora", "--adapter-config", str(tmp_path)],
            "--adapter-config",
            "an adapter_config.json file",
        ),
    ]
    for args, flag, what in cases:
        res = runner.invoke(app, args)
        assert (res.exit_code, res.stdout, res.stderr.splitlines()) == (
            2,
            "",
            [
                f"error: [E102] {flag} {tmp_path} is a directory, not {what}",
                "hint: pass the file itself, not the folder holding it",
            ],
        ), res.stderr
    assert not out.exists()


def test_the_folder_to_pass_instead_of_a_file_is_named_ready_to_paste(sample_ckpt: Path, tmp_path: Path) -> None:
    """A file of a checkpoint given for the checkpoint (``.metadata``) whose folder has a space in its name:
    the hint named the folder unquoted (``not a file in it: /x/my run/step-3``), which pasted as two arguments,
    while the run-root hints quote theirs. Each command's hint now quotes it as a shell argument, and the
    quoted folder opens."""
    import shlex

    ckpt = copy_checkpoint(sample_ckpt, tmp_path / "my run" / "step-3")
    hf = tmp_path / "my hf"
    assert runner.invoke(app, ["export", str(ckpt), str(hf), "-q"]).exit_code == 0
    cases = [
        (["inspect", str(ckpt / ".metadata")], ckpt),
        (["manifest", str(ckpt / ".metadata"), "--verify"], ckpt),
        (["diff", str(ckpt / ".metadata"), str(ckpt)], ckpt),
        (["import", str(hf / "model.safetensors"), str(tmp_path / "out")], hf),
    ]
    for args, folder in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        hint = res.stderr.splitlines()[-1]
        assert hint.endswith(f"not a file in it: {shlex.quote(str(folder))}"), hint
        assert shlex.split(hint.rpartition(": ")[2]) == [str(folder)]
    assert runner.invoke(app, ["inspect", *shlex.split(shlex.quote(str(ckpt)))]).exit_code == 0


@pytest.mark.parametrize("name", ["we\nird", "two  spaces", "-dash", "tab\there", "it's ünï"])
def test_a_folder_hint_pastes_as_that_folder_whatever_its_name(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The folder to pass, named in a hint as a shell argument (``not a file in it: X``, ``--optimizer-dir``'s
    ``pass the folder that holds it: X``): a newline or a run of spaces in its name was folded into one space
    (``'we ird'``, ``'two spaces'``: another folder), a leading ``-`` pasted as an option, and the
    ``--optimizer-dir`` message folded the name it was given. Each is one line that bash reads back as the folder."""
    import subprocess

    monkeypatch.chdir(tmp_path)
    copy_checkpoint(sample_ckpt, tmp_path / name)
    for args in (
        ["inspect", "--", f"{name}/.metadata"],
        ["validate", str(sample_ckpt), "--optimizer-dir", f"{name}/.metadata"],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        error, hint = res.stderr.splitlines()
        assert error.endswith(" is not a directory" if args[0] == "inspect" else "not its directory"), error
        assert name.replace("\n", "\\x0a").replace("\t", "\\x09") + "/.metadata" in error, error
        token = hint.rpartition(": ")[2]
        pasted = subprocess.run(["bash", "-c", f"printf %s {token}"], capture_output=True, text=True, check=True)
        assert os.path.samefile(pasted.stdout, name), (hint, pasted.stdout)
        assert not pasted.stdout.startswith("-"), hint


def test_a_model_folder_opened_alone_names_its_step_directory_ready_to_paste(acc_root: Path, tmp_path: Path) -> None:
    """replay-step of Accelerate's model folder alone, its ``optimizer_0/`` beside it, in a run folder whose name
    holds a newline and a run of spaces: the hint's step directory was unquoted and folded (``my run``), another
    folder and several shell arguments. It is one argument bash reads back as the step directory."""
    import subprocess

    step = tmp_path / "my\n  run" / "checkpoint-1"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", step)
    res = runner.invoke(app, ["replay-step", str(step / "pytorch_model_fsdp_0")])
    assert res.exit_code == 2, res.output
    hint = res.stderr.splitlines()[-1]
    token = hint.partition("pass the step directory ")[2].removesuffix(", which holds both")
    pasted = subprocess.run(["bash", "-c", f"printf %s {token}"], capture_output=True, text=True, check=True).stdout
    assert pasted == str(step), hint


def test_the_folder_beside_a_half_opened_alone_is_named_ready_to_paste(acc_root: Path, tmp_path: Path) -> None:
    """The model folder opened alone names its optimizer folder, the optimizer folder its model folder: in a run
    folder whose name holds a newline and a run of spaces, that folder was written unquoted (the step directory
    beside it quoted), folded into several shell arguments. Each is one argument bash reads back as the folder."""
    import subprocess

    step = tmp_path / "my\n  run" / "checkpoint-1"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", step)
    for opened, beside, what in (
        ("pytorch_model_fsdp_0", "optimizer_0", "optimizer"),
        ("optimizer_0", "pytorch_model_fsdp_0", "model"),
    ):
        res = runner.invoke(app, ["replay-step", str(step / opened)])
        assert res.exit_code == 2, res.output
        hint = res.stderr.splitlines()[-1]
        assert hint.startswith(f"hint: its {what} folder "), hint
        token = hint.removeprefix(f"hint: its {what} folder ").partition(" lies beside it")[0]
        pasted = subprocess.run(["bash", "-c", f"printf %s {token}"], capture_output=True, text=True, check=True)
        assert pasted.stdout == f"{step / beside}/", hint


def test_manifest_verify_without_a_manifest_names_the_command_that_writes_it(sample_ckpt: Path, tmp_path: Path) -> None:
    """`manifest CK --verify` of a checkpoint with no manifest hinted ``write one with `ckpttool manifest DIR```:
    pasted, ``DIR`` is no directory. The hint names the checkpoint given (and ``--output`` where one was)."""
    ckpt = copy_checkpoint(sample_ckpt, tmp_path / "c k")
    other = tmp_path / "other.json"
    for extra, line in (
        ([], f"hint: write one with `ckpttool manifest '{ckpt}'`"),
        (["--output", str(other)], f"hint: write one with `ckpttool manifest '{ckpt}' --output {other}`"),
    ):
        res = runner.invoke(app, ["manifest", str(ckpt), "--verify", *extra])
        assert res.exit_code == 2 and res.stdout == "" and res.stderr.splitlines()[1] == line, res.stderr
        assert runner.invoke(app, ["manifest", str(ckpt), *extra]).exit_code == 0  # the command the hint names
        assert runner.invoke(app, ["manifest", str(ckpt), "--verify", *extra]).exit_code == 0


def test_validate_manifest_without_a_manifest_names_the_command_that_writes_it(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """`validate CK --manifest` of a checkpoint with no manifest hinted ``write one with `ckpttool manifest DIR```
    (``DIR`` pasted is no directory); the hint names the checkpoint, the step and the file as given."""
    copy_checkpoint(sample_ckpt, tmp_path / "run" / "step-7")
    run, ck, other = tmp_path / "run", tmp_path / "run" / "step-7", tmp_path / "other.json"
    for argv, writes in (
        ([str(ck), "--manifest"], [str(ck)]),
        ([str(run), "--step", "7", "--manifest"], [str(run), "--step", "7"]),
        ([str(ck), "--manifest", str(other)], [str(ck), "--output", str(other)]),
    ):
        res = runner.invoke(app, ["validate", *argv])
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert res.stderr.splitlines()[1] == f"hint: write one with `ckpttool manifest {' '.join(writes)}`", argv
        assert runner.invoke(app, ["manifest", *writes]).exit_code == 0  # the command the hint names
        assert runner.invoke(app, ["validate", *argv]).exit_code == 0, argv
        (other if "--output" in writes else ck / "manifest.json").unlink()


def test_manifest_hints_with_a_backtick_in_the_path_paste_as_that_path(sample_ckpt: Path, tmp_path: Path) -> None:
    """A directory named ``it's `step` é`` hinted ``ckpttool manifest 'it'"'"'s --step é'``: the backticked name in
    the quoted path was read as the parameter `step` and replaced by its flag, so the pasted hint named another
    directory. The hint quotes a backtick with an escape: pasted into bash it gives the very path."""
    import subprocess

    ck = copy_checkpoint(sample_ckpt, tmp_path / "it's `step` é")
    for argv in (["validate", str(ck), "--manifest"], ["manifest", str(ck), "--verify"]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2 and res.stdout == "", res.output
        error, hint = res.stderr.splitlines()[:2]
        assert str(ck) in error, error  # the file named as it is, not with `step` read as the parameter
        assert hint.startswith("hint: write one with `ckpttool manifest ") and hint.endswith("`"), hint
        line = hint.removeprefix("hint: write one with `ckpttool ").removesuffix("`")
        words = subprocess.run(
            ["bash", "-c", f'set -- {line}; printf "%s\\0" "$@"'], capture_output=True, check=True
        ).stdout.split(b"\0")[:-1]
        assert [os.fsdecode(w) for w in words] == ["manifest", str(ck)], (hint, words)


def test_a_backticked_name_inside_a_file_name_is_not_a_parameter() -> None:
    """A message's `` `step` `` is named by its flag; the same letters inside a file name (``run`step`3``, a name
    holding backticks) are the name, not the parameter (the error line named another file)."""
    from ckpttool.ui.output import _with_flags

    flags = {"step": "--step", "ep_size": "--ep-size", "source_layout": "--source-layout"}
    assert (
        _with_flags("`step` latest (`source_layout`/`ep_size`).", flags) == "--step latest (--source-layout/--ep-size)."
    )
    assert _with_flags("/r/run`step`3/.metadata: no `step` 3", flags) == "/r/run`step`3/.metadata: no --step 3"
    assert _with_flags("/r/a `step` b: no `step` 3", flags, keep="/r/a `step` b") == "/r/a `step` b: no --step 3"


def test_a_step_given_with_a_step_directory_names_the_run_root_ready_to_paste(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--step latest`` given with a torchtitan step directory (``run/checkpoint/step-20``) instead of the run's
    checkpoint root: the hint said "pass the directory that holds the step directories" without naming it. It names
    that directory as a shell argument (``.`` given inside the step directory: its absolute path; diff's ``--a-step``
    alike), and the pasted command opens the step; a checkpoint that is no step directory gets no guess."""
    import shlex

    root = tmp_path / "my run" / "checkpoint"
    for s in (10, 20):
        copy_checkpoint(sample_ckpt, root / f"step-{s}")
    res = runner.invoke(app, ["validate", str(root / "step-20"), "--step", "latest"])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr.splitlines() == [
        f"error: [E100] --step latest given, but {root / 'step-20'} is a checkpoint itself",
        f"hint: drop --step, or give --step with the directory above this step directory: {shlex.quote(str(root))}",
    ]
    pasted = runner.invoke(app, ["validate", *shlex.split(res.stderr.rpartition(": ")[2]), "--step", "latest"])
    assert pasted.exit_code == 0 and f"checkpoint  {root / 'step-20'}\n" in pasted.stdout, pasted.output
    monkeypatch.chdir(root / "step-20")
    here = Path(os.getcwd()).parent
    res = runner.invoke(app, ["diff", ".", "../step-10", "--a-step", "10"])
    assert res.exit_code == 2 and res.stderr.splitlines()[-1] == (
        f"hint: drop --a-step, or give --a-step with the directory above this step directory: {shlex.quote(str(here))}"
    ), res.stderr
    res = runner.invoke(app, ["inspect", str(sample_ckpt), "--step", "3"])
    assert res.exit_code == 2 and res.stderr.splitlines()[-1] == (
        "hint: pass the directory that holds the step directories, or drop --step"
    ), res.stderr


@pytest.mark.parametrize("typed", ["fp8", "FP8", "float8_e4m3fn", "torch.float8_e5m2"])
def test_an_fp8_save_dtype_names_the_option_that_writes_fp8(sample_ckpt: Path, tmp_path: Path, typed: str) -> None:
    """``export --save-dtype fp8``: the refusal's hint gave the aliases of bf16/fp16/fp32 only, none of which is
    FP8; it names ``--quantize fp8-block``, and the export that pastes it writes float8_e4m3fn weights."""
    from safetensors import safe_open

    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--save-dtype", typed])
    assert res.exit_code == 2 and res.stdout == "" and not (tmp_path / "hf").exists(), res.output
    error, hint = res.stderr.splitlines()
    assert error == f"error: [E100] --save-dtype {typed!r} is not one of preserve, bfloat16, float16, float32"
    assert hint.startswith("hint: an FP8 export is --quantize fp8-block (or fp8-channel): float8_e4m3fn"), hint
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--quantize", "fp8-block", "-q"])
    assert res.exit_code == 0, res.output
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert str(w.dtype) == "torch.float8_e4m3fn"
    # a dtype that is no FP8 keeps the aliases
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "x"), "--save-dtype", "int8"])
    assert res.exit_code == 2 and res.stderr.splitlines()[-1] == "hint: dtype aliases: bf16, fp16/half, fp32/float"


def test_import_of_a_file_names_what_its_folder_is(sample_ckpt: Path, tmp_path: Path) -> None:
    """``import FILE OUT``: the hint said "pass the Hugging Face model directory, not a file in it: FOLDER" whatever
    the folder held, so a DCP checkpoint's ``.metadata`` or a stray file sent the user to a folder import refuses
    next. The folder is named as what to pass only where it holds safetensors files; a DCP checkpoint's file gets
    the export that converts it (which runs as pasted), any other file what the directory to pass holds."""
    import shlex

    ckpt = copy_checkpoint(sample_ckpt, tmp_path / "my ckpt")
    res = runner.invoke(app, ["import", str(ckpt / ".metadata"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stdout == "", res.output
    hint = res.stderr.splitlines()[-1]
    q = shlex.quote(str(ckpt))
    assert hint == f"hint: {q} is a DCP checkpoint: did you mean `ckpttool export {q} OUT` (DCP to safetensors)?"
    pasted = shlex.split(hint.split("`")[1].replace("OUT", shlex.quote(str(tmp_path / "hf"))))
    assert runner.invoke(app, [*pasted[1:], "-q"]).exit_code == 0
    res = runner.invoke(app, ["import", str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "out")])
    assert (
        res.stderr.splitlines()[-1]
        == f"hint: pass the Hugging Face model directory, not a file in it: {tmp_path / 'hf'}"
    )
    (tmp_path / "notes.txt").write_text("x")
    res = runner.invoke(app, ["import", str(tmp_path / "notes.txt"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.splitlines()[-1] == (
        "hint: pass the Hugging Face model directory (the one holding its model*.safetensors files and config.json); "
        f"{tmp_path} holds no .safetensors file"
    ), res.stderr
    assert not (tmp_path / "out").exists()


def test_json_after_the_command_is_what_it_is_before_it() -> None:
    """docs/cli.md: ``ckpttool --json CMD`` = ``ckpttool CMD --json``. ``ckpttool --json schema inspect`` printed the
    schema while ``ckpttool schema inspect --json`` was ``No such option: --json``, and ``sample x --json`` said
    that where ``--json sample x`` said "has no JSON output". Both spellings now give the same result."""
    before = runner.invoke(app, ["--json", "schema", "inspect"])
    after = runner.invoke(app, ["schema", "inspect", "--json"])
    assert before.exit_code == after.exit_code == 0 and after.stdout == before.stdout, after.output
    assert json.loads(after.stdout)["$schema"].startswith("https://json-schema.org/")
    for argv in (["schema"], ["sample", "x"]):
        before = runner.invoke(app, ["--json", *argv])
        after = runner.invoke(app, [*argv, "--json"])
        assert before.exit_code == after.exit_code == 2 and after.stdout == "", after.output
        assert after.stderr == before.stderr, (before.stderr, after.stderr)
    assert runner.invoke(app, ["sample", "x", "--json"]).stderr.splitlines() == [
        "error: [E100] `ckpttool sample` has no JSON output (--json)",
        "hint: see `ckpttool sample --help`",
    ]
    assert not Path("x").exists()


def test_inspect_names_torchtitan_fused_qkv_state_as_recognised_not_orphaned(titan_root: Path) -> None:
    """torchtitan's ``FusedQKVLinear`` steps ``wqkv`` while its state dict stores ``wq``/``wk``/``wv``: validate
    says ``K005`` (info, "nothing to fix") and ``O003`` leaves it out, but inspect listed it under "state for fqns not
    in the model" (and in ``orphan_state``), the line of lost state. It names it as state stepped fused, stored split."""
    step = titan_root / "llama3" / "checkpoint" / "step-2"  # written by torchtitan's own CheckpointManager
    res = runner.invoke(app, ["inspect", str(step)], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    assert "state for fqns not in the model" not in res.stdout
    assert (
        "fused state 2 parameters stepped fused, stored split (e.g. layers.0.attention.qkv_linear.wqkv.weight as "
        "layers.0.attention.qkv_linear.wq.weight, layers.0.attention.qkv_linear.wk.weight, "
        "layers.0.attention.qkv_linear.wv.weight): recognised, not orphans"
    ) in res.stdout.splitlines()
    doc = json.loads(runner.invoke(app, ["inspect", str(step), "--json"]).stdout)
    assert doc["optimizer"]["orphan_state"] == [] and "_stored_split" not in doc["optimizer"]
    res = runner.invoke(app, ["validate", str(step), "--json"])
    assert [f["code"] for f in json.loads(res.stdout)["findings"]] == ["K005"]


@pytest.mark.parametrize(
    ("argv", "count"),
    [
        (["inspect", "{ckpt}"], "10 model tensors"),
        (["replay-step", "{ckpt}"], "10 parameters"),
        (["export", "{ckpt}", "{out}"], "10 model tensors"),
        (["stats", "{ckpt}"], "10 keys"),
    ],
)
def test_a_filter_without_a_wildcard_names_the_glob_that_matches(
    sample_ckpt: Path, tmp_path: Path, argv: list[str], count: str
) -> None:
    """``--filter experts`` (a word, no ``*``) matches a key named ``experts`` only, so it selected nothing; the hints
    said how globs match in general (one suggested ``'model.*'``). They name ``'*experts*'`` and how many it
    matches, and the command with it pasted runs; a glob that has a wildcard keeps the general hint."""
    import shlex

    args = [a.format(ckpt=sample_ckpt, out=tmp_path / "out") for a in argv]
    res = runner.invoke(app, [*args, "--filter", "experts"])
    assert res.exit_code == 2 and res.stdout == "" and not (tmp_path / "out").exists(), res.output
    hint = res.stderr.splitlines()[-1]
    assert hint == (
        "hint: a glob matches whole keys and 'experts' has no wildcard, so it names one whole key; "
        f"'*experts*' matches {count}"
    )
    pasted = runner.invoke(app, [*args, "--filter", *shlex.split(hint.split("; ")[-1].split(" matches ")[0]), "-q"])
    assert pasted.exit_code == 0, pasted.output
    res = runner.invoke(app, [*args, "--filter", "nothing*"])
    assert res.exit_code == 2 and "has no wildcard" not in res.stderr, res.output


def test_model_assets_naming_its_config_json_names_the_folder(sample_ckpt: Path, tmp_path: Path) -> None:
    """`export --model-assets ckpt/model_assets/config.json` (the file, tab-completed) said "is not a directory"
    with the hint to pass "the directory holding config.json": the hint now names it, as a checkpoint's file given
    for the checkpoint does; a file beside no config.json keeps the plain hint. Nothing is written either way."""
    assets = sample_ckpt / "model_assets"
    out = tmp_path / "hf"
    for given, tail in ((assets / "config.json", f", not a file in it: {assets}"), (sample_ckpt / ".metadata", "")):
        res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--model-assets", str(given)])
        assert (res.exit_code, res.stdout, res.stderr.splitlines()) == (
            2,
            "",
            [
                f"error: [E100] {given}: --model-assets is not a directory",
                f"hint: pass the directory holding config.json and the tokenizer files{tail}",
            ],
        ), res.stderr
        assert not out.exists()
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--model-assets", str(assets), "-q"])
    assert res.exit_code == 0 and (out / "config.json").is_file(), res.output
