"""NeMo Automodel 0.7's PEFT (LoRA) save, written by its own ``Checkpointer`` (tests/fixtures/nemo_writer.py).

``epoch_0_step_2/model/`` is PEFT's adapter file as NeMo writes it (``adapter_model.safetensors`` with PEFT's saved
names, ``base_model.model.<hf fqn>.lora_A.weight``, no adapter name; ``adapter_config.json``); ``optim/`` the DCP
optimizer keyed by the HF fqns. References: the model's own ``state_dict()`` after the steps, and PEFT's
``PeftModel.from_pretrained`` of the exported adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow

runner = CliRunner()


@pytest.fixture(scope="module")
def peft_root(fixture_root: Path) -> Path:
    from tests.fixtures.writers import missing

    why = missing("nemo_automodel.components.checkpoint.checkpointing", "transformers", "peft")
    if why:
        pytest.skip(why)
    from tests.fixtures.nemo_writer import build_nemo_peft

    return cached_build(fixture_root, "writers_nemo_peft", build_nemo_peft)


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def _peft_loaded(adapter_dir: Path) -> dict:
    """The LoRA factors PEFT's own loader puts into the model: ``<hf fqn>.lora_A.weight`` -> tensor."""
    from peft import PeftModel

    from tests.fixtures.nemo_writer import tiny_llama

    base = tiny_llama(small=False, decay=True)[0]
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:  # base_model.model.<fqn>.lora_A.default.weight
            out[name.removeprefix("base_model.model.").replace(".default.", ".")] = t
    return out


@pytest.mark.parametrize("prefix", [(), ("--model-prefix", "")], ids=["detected", "model-prefix-top-level"])
def test_lora_export_of_nemo_peft_save_loads_in_peft(peft_root: Path, tmp_path: Path, prefix: tuple) -> None:
    import torch
    from safetensors.torch import load_file

    step = peft_root / "run" / "epoch_0_step_2"
    given = step / "model" / "adapter_config.json"
    out = tmp_path / "lora"
    cli("export", str(step), str(out), "--format", "lora", "--adapter-config", str(given), *prefix)
    got = load_file(out / "adapter_model.safetensors")
    saved = load_file(step / "model" / "adapter_model.safetensors")  # NeMo's own file: PEFT's names
    assert sorted(got) == sorted(saved) and all(got[k].equal(v) for k, v in saved.items())
    want = {k: v for k, v in torch.load(peft_root / "expected.pt", weights_only=True)["model"].items() if "lora_" in k}
    loaded = _peft_loaded(out)
    assert len(want) == 8 and sorted(loaded) == sorted(want)
    assert all(loaded[k].equal(v) for k, v in want.items())
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8


def test_lora_export_without_alpha_names_the_adapter_config_nemo_saved(peft_root: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(peft_root / "run"), str(tmp_path / "lora"), "--format", "lora"])
    assert res.exit_code == 2, res.output
    assert "[E601]" in res.stderr and "lora_alpha cannot be inferred" in res.stderr
    given = peft_root / "run" / "epoch_0_step_2" / "model" / "adapter_config.json"
    assert f"--adapter-config {given} " in res.stderr
    assert not (tmp_path / "lora").exists()


def test_peft_save_is_nemo_automodel_under_peft_prefix(peft_root: Path) -> None:
    doc = json.loads(cli("inspect", str(peft_root / "run"), "--json"))
    ks = doc["key_schema"]
    assert (
        ks["id"] == "nemo-automodel"
        and ks["model_prefix"] == "base_model.model."
        and ks["optimizer_prefix"] == "optim."
    )
    assert not any("do not share" in r for r in ks["reasons"])
    assert doc["summary"]["model_tensor_count"] == 8
    doc = json.loads(cli("validate", str(peft_root / "run"), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["error"] == doc["counts"]["warning"] == 0
    doc = json.loads(cli("replay-step", str(peft_root / "run"), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 8 and all(p["step_before"] == 2 for p in doc["params"])
