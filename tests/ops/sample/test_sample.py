"""``ckpttool sample``: clean errors for unusable targets/seeds, and an atomic write (docs/design.md §7)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def sample(*args: object):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["sample", *map(str, args), "--train-steps", "1"])


def leftovers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".ckpttool-" in n and n != ".ckpttool-output.json")


def assert_error(res, code: str, *needles: str) -> None:  # type: ignore[no-untyped-def]
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines[-2].startswith(f"error: [{code}]"), res.stderr
    assert lines[-1].startswith("hint: "), res.stderr
    assert "Traceback" not in res.stderr and "E999" not in res.stderr
    for n in needles:
        assert n in lines[-2], (n, lines[-2])


def test_parent_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "file" / "x", tmp_path / "file" / "x" / "y"):
        res = sample(target)
        assert_error(res, "E600", "cannot write there", f"{tmp_path / 'file'} is not a directory")
    assert sorted(os.listdir(tmp_path)) == ["file"] and (tmp_path / "file").read_text() == "x"


def test_target_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert_error(sample(tmp_path / "f"), "E600", "not a directory")
    assert (tmp_path / "f").read_text() == "x" and leftovers(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")
def test_unwritable_location() -> None:
    before = set(os.listdir("/proc"))
    assert_error(sample("/proc/ckpttool-sample-x"), "E600", "cannot write there")
    assert not os.path.exists("/proc/ckpttool-sample-x") and not [
        n for n in set(os.listdir("/proc")) - before if "ckpttool" in n
    ]


def test_a_url_is_refused_not_written_as_a_local_s3_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sample s3://b/x` trained and wrote the local folder ./s3:/b/x (typer's Path() of the URL) and said 'wrote
    sample checkpoint to s3:/b/x'; `sample file:///a/b` wrote ./file:/a/b. A URL is E100 before anything is trained
    or written; file://PATH is the local PATH, as for every other command."""
    from ckpttool.errors import UsageError
    from ckpttool.ops.sample import write_sample

    monkeypatch.chdir(tmp_path)
    for url in ("s3://ckpts/sample", "gs://b/run/sample"):
        res = sample(url)
        assert_error(res, "E100", f"{url}: a URL; sample writes a local directory")
        with pytest.raises(UsageError):
            write_sample(url)
    assert os.listdir(tmp_path) == []
    res = sample(f"file://{tmp_path}/local")
    assert res.exit_code == 0, res.output
    assert os.listdir(tmp_path) == ["local"] and (tmp_path / "local" / ".metadata").is_file()
    assert f"wrote sample checkpoint to {tmp_path}/local\n" in res.stderr


@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**63), "-1"])
def test_seed_out_of_range(seed: str, tmp_path: Path) -> None:
    res = runner.invoke(app, ["sample", str(tmp_path / "s"), "--seed", seed])
    assert_error(res, "E100", "seed", seed)
    assert "0 to 9223372036854775807" in res.stderr
    assert os.listdir(tmp_path) == []


def test_largest_seed_works(tmp_path: Path) -> None:
    res = runner.invoke(app, ["sample", str(tmp_path / "s"), "--seed", str(2**63 - 1), "--train-steps", "0"])
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "s" / ".metadata").is_file()


def test_existing_non_empty_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    assert_error(sample(d), "E600", "not empty")
    assert os.listdir(d) == ["keep.txt"] and leftovers(tmp_path) == []


def test_existing_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing empty directory given by a relative path (not the current directory itself: E600)."""
    d = tmp_path / "d"
    d.mkdir()
    monkeypatch.chdir(tmp_path)
    res = sample("d")
    assert res.exit_code == 0, res.stderr
    assert sorted(os.listdir(d)) == [
        ".ckpttool-output.json",
        ".metadata",
        "__0_0.distcp",
        "extra_state",
        "model_assets",
    ]
    assert leftovers(tmp_path) == [] and leftovers(d) == []
    res = runner.invoke(app, ["inspect", "d", "--json"])
    assert res.exit_code == 0, res.stderr


def test_write_sample_api_keeps_working(tmp_path: Path) -> None:
    """``write_sample(p, SampleOptions(...))`` into an existing empty directory."""
    import torch.distributed.checkpoint as dcp

    from ckpttool.errors import OutputError
    from ckpttool.ops.sample import SampleOptions, write_sample

    p = tmp_path / "p"
    p.mkdir()
    res = write_sample(p, SampleOptions(steps=1, optimizer="master_fp32_adamw"))
    assert res.path == p and (res.steps, res.seed, res.optimizer) == (1, 0, "master_fp32_adamw")
    assert sorted(os.listdir(p)) == [
        ".ckpttool-output.json",
        ".metadata",
        "__0_0.distcp",
        "extra_state",
        "model_assets",
    ]
    assert (p / "extra_state" / "extra_state_rank_0.pt").is_file()
    assert json.loads((p / "model_assets" / "config.json").read_text())["model_type"] == "dots1"
    md = dcp.FileSystemReader(str(p)).read_metadata()
    assert str(md.storage_meta.checkpoint_id) == str(p)  # the final path, not the temporary one
    assert leftovers(tmp_path) == []
    with pytest.raises(OutputError):
        write_sample(p)


def test_write_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    real = torch.save

    def failing_save(obj, f, *a, **kw):  # type: ignore[no-untyped-def]
        if str(f).endswith("extra_state_rank_0.pt"):  # after dcp.save wrote a complete-looking .metadata
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    out = tmp_path / "s"
    assert_error(sample(out), "E600", "write failed")
    assert os.listdir(tmp_path) == []


INTERRUPTED = r"""
import os, signal, sys, torch
SIG = getattr(signal, sys.argv[1])
real = torch.save
def save(obj, f, *a, **kw):
    if str(f).endswith("extra_state_rank_0.pt"):
        os.kill(os.getpid(), SIG)
    return real(obj, f, *a, **kw)
torch.save = save
from ckpttool.cli import app
sys.argv = ["ckpttool", "sample", sys.argv[2], "--train-steps", "1"]
app()
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_interrupted_leaves_nothing(sig: str, tmp_path: Path) -> None:
    out = tmp_path / "s"
    res = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, sig, str(out)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 130, res.stderr
    assert "error: interrupted" in res.stderr and "Traceback" not in res.stderr
    assert os.listdir(tmp_path) == []


CTRL_C_IN_TORCH_DISTRIBUTED_INIT = """
import os, signal, sys

inside = False

def profile(frame, event, arg):  # Ctrl-C as torch.distributed's C++ init runs Python code (through pybind11)
    global inside
    if event == "c_call" and getattr(arg, "__name__", "") == "_c10d_init":
        inside = True
    elif event == "call" and inside:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)

assert "torch" not in sys.modules
sys.setprofile(profile)
sys.argv = ["ckpttool", *sys.argv[1:]]
from ckpttool.cli import entry
entry()
"""


@pytest.mark.parametrize("command", ["sample", "replay-step"])
def test_ctrl_c_while_torch_loads_is_an_interrupt_not_an_abort(command: str, tmp_path: Path, sample_ckpt: Path) -> None:
    """`timeout -s INT 2 ckpttool sample DIR` (or replay-step CKPT): a Ctrl-C landing inside torch.distributed's C++
    initialisation (pybind11 calling Python) ended the process with SIGABRT ("terminate called after throwing an
    instance of 'python_error'", exit 134, a core file), sample's temporary output left behind. The signal is now
    held until torch has loaded: exit 130, 'error: interrupted', nothing left, the checkpoint untouched."""
    before = {p.name: p.stat().st_mtime_ns for p in sample_ckpt.iterdir()}
    args = ["sample", str(tmp_path / "s")] if command == "sample" else ["replay-step", str(sample_ckpt)]
    res = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_TORCH_DISTRIBUTED_INIT, *args], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 130, res.stderr[-2000:]
    assert res.stderr.splitlines() == ["error: interrupted"], res.stderr[-2000:]
    assert res.stdout == ""
    assert os.listdir(tmp_path) == []
    assert {p.name: p.stat().st_mtime_ns for p in sample_ckpt.iterdir()} == before


def test_sample_on_a_full_disk_is_e600_without_traceback(tmp_path: Path) -> None:
    """torch's CheckpointException is a BaseException: the failure inside it (EFBIG here) is what the user sees."""
    from tests.fixtures.file_size_limit import run_capped

    res = run_capped(["sample", str(tmp_path / "s")], 100_000)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith("error: [E600]") and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_exported_sample_loads_in_transformers_without_a_warning(sample_ckpt: Path, tmp_path: Path) -> None:
    """The README's export of the sample loads with AutoModelForCausalLM: no missing, unexpected or
    mismatched key and nothing logged at warning level; the router buffer (the tensor no optimizer
    updates) arrives with its saved values."""
    import logging
    import warnings

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    out = tmp_path / "hf"
    res = runner.invoke(
        app, ["export", str(sample_ckpt), str(out), "--model-assets", str(sample_ckpt / "model_assets")]
    )
    assert res.exit_code == 0, res.stderr
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    hf_logging.add_handler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    finally:
        hf_logging.remove_handler(handler)
    assert type(model).__name__ == "Dots1ForCausalLM"
    assert not [r.getMessage() for r in records], [r.getMessage()[:500] for r in records]
    assert not [str(w.message) for w in caught if "torch.distributed" not in str(w.message)]
    saved = load_file(str(out / "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(model.state_dict()[bias], saved[bias]) and saved[bias].abs().sum() > 0
    assert set(model.state_dict()) == set(saved)


def test_a_bf16_sample_says_bfloat16_in_its_config_and_exports_with_it(tmp_path: Path) -> None:
    """`sample --optimizer-type master_fp32_adamw` saves BF16 parameters (beside FP32 masters), but its
    model_assets/config.json said torch_dtype float32: the README's export with `--model-assets` of that sample
    failed E605 (every tensor bfloat16, config float32). The config names the saved dtype now."""
    import json

    from safetensors import safe_open

    ck = tmp_path / "ck"
    res = runner.invoke(app, ["sample", str(ck), "--optimizer-type", "master_fp32_adamw"])
    assert res.exit_code == 0, res.stderr
    assert json.loads((ck / "model_assets" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ck), str(out), "--model-assets", str(ck / "model_assets")])
    assert res.exit_code == 0, res.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
