"""Wrapper segments (`_orig_mod.`, `_checkpoint_wrapped_module.`, `_fsdp_wrapped_module.`, `module.`) anywhere in a key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpttool.model.wrappers import strip_wrapper_segments
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.export.test_export_consumers import assert_same_logits, export, load_hf


@pytest.fixture(scope="session")
def wrapped(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_wrapped", hf_models.build_wrapped)


def test_strip_wrapper_segments_keeps_the_tensor_name() -> None:
    assert strip_wrapper_segments("module.model.layers.0._checkpoint_wrapped_module._orig_mod.mlp.w.weight") == (
        "model.layers.0.mlp.w.weight",
        ("module", "_checkpoint_wrapped_module", "_orig_mod"),
    )
    assert strip_wrapper_segments("a.module") == ("a.module", ())


def test_hf_export_removes_wrapper_segments_and_loads(wrapped: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    doc = export(wrapped / "llama", tmp_path / "hf")
    assert any("wrapper segment(s)" in w and "_orig_mod" in w for w in doc["warnings"]), doc["warnings"]
    assert_same_logits(load_hf(tmp_path / "hf", LlamaForCausalLM), wrapped / "llama")


def test_lora_export_removes_wrapper_segments_and_peft_loads_the_adapter(wrapped: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out = tmp_path / "adapter"
    export(wrapped / "lora", out, "--format", "lora", "--lora-alpha", str(hf_models.LORA_ALPHA))
    base = load_hf(wrapped / "lora" / "base", LlamaForCausalLM)
    assert_same_logits(PeftModel.from_pretrained(base, out), wrapped / "lora")


def test_lora_keys_peft_would_not_match_are_refused(wrapped: Path, tmp_path: Path) -> None:
    from tests.ops.export.test_export import assert_clean_failure, export_cli

    cfg = {"peft_type": "LORA", "r": hf_models.LORA_R, "lora_alpha": 8, "target_modules": ["k_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    res = export_cli(
        str(wrapped / "lora"),
        str(tmp_path / "o"),
        "--format",
        "lora",
        "--adapter-config",
        str(tmp_path / "adapter_config.json"),
    )
    assert_clean_failure(res, "E601", "would not be loaded by PEFT", "target_modules")


def test_a_schema_given_above_the_detected_model_prefix_warns_naming_the_keys(wrapped: Path, tmp_path: Path) -> None:
    """`--schema torchtitan` (top-level model keys) on torch's `dcp.save({"model": hf_model.state_dict()})` wrote
    `model.model.*` / `model.lm_head.weight` without a word: transformers loads none of them."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    src = wrapped / "llama_plain"
    runner = CliRunner()
    for args, schema in ((["--schema", "torchtitan"], "torchtitan"), (["--model-prefix", ""], "custom")):
        out = tmp_path / schema
        res = runner.invoke(app, ["export", str(src), str(out), "-q", *args])
        assert res.exit_code == 0, res.stderr
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = sorted(f.keys())
        assert keys[0] == "model.lm_head.weight" and all(k.startswith("model.") for k in keys)
        assert res.stderr == (
            f"warning: the key schema given ({schema}: model keys at the top level) differs from the detected one "
            "(torch-native: model under 'model.'): every key written starts with 'model.' "
            "(model.model.embed_tokens.weight, model.model.layers.0.self_attn.q_proj.weight, ...), a wrapper's "
            "prefix that transformers' from_pretrained does not load; leave out the override (--schema, "
            "--model-prefix), or give --model-prefix 'model.', to write the model's own names\n"
        )
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "detected"), "-q", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["warnings"] == [], res.stderr
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "same"), "-q", "--json", "--schema", "torch-native"])
    assert res.exit_code == 0 and json.loads(res.stdout)["warnings"] == [], res.stderr


def test_a_compiled_model_saved_beside_its_optimizer_is_the_plain_model(tmp_path: Path) -> None:
    """`dcp.save({"model": compiled.state_dict(), "optimizer": get_optimizer_state_dict(compiled, opt)})` keys the
    model `model._orig_mod.<fqn>` while the optimizer names the parameters `<fqn>` (so does a DDP model's:
    `model.module.<fqn>`), as torch's resume loads them. `validate --deep` failed the clean checkpoint with O003
    'is not a model tensor' for every parameter, `diff` against the plain save found no name in common (E611) and
    `replay-step` found no parameter (E514). The wrapper segments leading the model keys are now part of the model
    prefix: validate is clean, diff says equal, replay-step passes, and the export equals the plain one's."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 3, loss="square")
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd, "train_state": {"step": 3}}, tmp_path / "plain")
    compiled = torch.compile(model)
    wsd, wosd = compiled.state_dict(), get_optimizer_state_dict(compiled, opt)
    assert all(k.startswith("_orig_mod.") for k in wsd) and sorted(wosd["state"]) == sorted(msd), (list(wsd), wosd)
    save_quiet({"model": wsd, "optimizer": wosd, "train_state": {"step": 3}}, tmp_path / "compiled")
    runner = CliRunner()
    for name in ("plain", "compiled"):
        res = runner.invoke(app, ["validate", str(tmp_path / name), "--deep", "--strict", "--json"])
        assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.output
        res = runner.invoke(app, ["replay-step", str(tmp_path / name), "--device", "cpu", "--json"])
        assert res.exit_code == 0 and json.loads(res.stdout)["problems"] == [], res.output
        res = runner.invoke(app, ["export", str(tmp_path / name), str(tmp_path / f"hf_{name}"), "--json"])
        assert res.exit_code == 0, res.output
    ref = load_file(tmp_path / "hf_plain" / "model.safetensors")
    got = load_file(tmp_path / "hf_compiled" / "model.safetensors")
    assert sorted(ref) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    res = runner.invoke(app, ["diff", str(tmp_path / "plain"), str(tmp_path / "compiled"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["equal"] is True and doc["counts"]["compared"] == 6 == doc["counts"]["equal"], doc


def test_diff_compares_a_data_parallel_models_save_with_the_plain_one(tmp_path: Path) -> None:
    """`dcp.save({"model": dp.state_dict(), "optimizer": get_optimizer_state_dict(dp, opt)})` of a DataParallel model
    names model and state `module.<fqn>`; `diff` against the plain model's save found no name in common (E611, with a
    hint to pass --rules or --adapter). It now compares names as export writes them (wrapper segments removed, said in
    a note): equal, tensors, state and param groups alike; a changed weight is still a difference."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 3, loss="square")
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "plain")
    dp = torch.nn.DataParallel(model)
    dsd, dosd = dp.state_dict(), get_optimizer_state_dict(dp, opt)
    assert all(k.startswith("module.") for k in [*dsd, *dosd["state"]]), (list(dsd), list(dosd["state"]))
    save_quiet({"model": dsd, "optimizer": dosd}, tmp_path / "dp")
    changed = {**dsd, "module.2.bias": dsd["module.2.bias"] + 1}
    save_quiet({"model": changed, "optimizer": dosd}, tmp_path / "changed")
    runner = CliRunner()
    res = runner.invoke(app, ["diff", str(tmp_path / "plain"), str(tmp_path / "dp"), "--what", "all", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["equal"] is True and doc["counts"]["compared"] == 90 == doc["counts"]["equal"], doc["counts"]
    assert doc["notes"] == [
        "B: wrapper segment(s) module removed from 24 name(s), as export names them (a compiled, DDP or "
        "activation-checkpointed model's state_dict)"
    ]
    res = runner.invoke(app, ["diff", str(tmp_path / "plain"), str(tmp_path / "changed"), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and [d["name"] for d in doc["differences"]] == ["model.2.bias"], doc["differences"]


def test_O003_pairs_a_compiled_blocks_state_and_names_an_ambiguous_wrapped_key(tmp_path: Path) -> None:
    """A model whose block is compiled in place (`model[0] = torch.compile(model[0])`, as per-block compile does)
    saved with `model.state_dict()` keys the block `0._orig_mod.weight`, while `get_optimizer_state_dict` names it
    `0.weight`. O003 called that state orphaned; it is paired with its wrapped key now (torch resumes it). Where two
    model keys share the name without their wrappers, nothing is paired: O003 names the stored key and how to save
    it. State of a parameter the model lacks keeps the plain message."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 2, loss="square")
    model[0] = torch.compile(model[0])
    msd, osd = model.state_dict(), get_optimizer_state_dict(model, opt)
    assert "0._orig_mod.weight" in msd and "0.weight" in osd["state"], (list(msd), list(osd["state"]))
    del msd["2.bias"]  # a parameter the model lacks: state of another model
    msd["0._checkpoint_wrapped_module.bias"] = msd["0._orig_mod.bias"].clone()  # 0.bias: which of the two?
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ckpt")
    res = CliRunner().invoke(app, ["validate", str(tmp_path / "ckpt"), "--json"])
    msgs = sorted(f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "O003")
    assert res.exit_code == 1 and msgs == [
        "optimizer.state.0.bias.*: '0.bias' is not a model tensor (fields exp_avg, exp_avg_sq, step); the model "
        "stores it as 'model.0._checkpoint_wrapped_module.bias', with wrapper segments the optimizer's names leave out "
        "(a compiled or checkpoint-wrapped block's state_dict() saved beside get_optimizer_state_dict), but another "
        "model key or optimizer fqn has that name without them too, so ckpttool cannot pair them; save the model "
        "with get_model_state_dict, which removes them",
        "optimizer.state.2.bias.*: '2.bias' is not a model tensor (fields exp_avg, exp_avg_sq, step)",
    ], msgs


def test_a_submodule_named_module_is_kept_by_export_and_diff(tmp_path: Path) -> None:
    """A model whose submodule is named ``module`` (``self.module = nn.Linear(...)``), saved plain and under DDP's
    ``module.`` with ``get_optimizer_state_dict`` (which names it ``module.weight``): export wrote ``weight``/``bias``,
    names the model does not load, and diff stripped the real name as a wrapper. The optimizer's names keep it, so it
    is a real name: export writes the model's own keys (loaded strictly, equal to torch's), diff notes no removal."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.builders import save_quiet, train_steps

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.module(x))

    torch.manual_seed(0)
    model = Inner()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 2, loss="square")
    osd = get_optimizer_state_dict(model, opt)
    assert "module.weight" in osd["state"]
    save_quiet({"model": model.state_dict(), "optimizer": osd}, tmp_path / "plain")
    ddp_keys = {f"module.{k}": v for k, v in model.state_dict().items()}  # DistributedDataParallel(model).state_dict()
    save_quiet({"model": ddp_keys, "optimizer": osd}, tmp_path / "ddp")
    runner = CliRunner()
    for name in ("plain", "ddp"):
        res = runner.invoke(app, ["export", str(tmp_path / name), str(tmp_path / f"hf-{name}")])
        assert res.exit_code == 0, res.output
        out = load_file(str(tmp_path / f"hf-{name}" / "model.safetensors"))
        fresh = Inner()
        fresh.load_state_dict(out, strict=True)
        assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())
    res = runner.invoke(app, ["diff", str(tmp_path / "ddp"), str(tmp_path / "plain"), "--what", "all", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["equal"] and not any("wrapper" in n for n in doc["notes"]), doc["notes"]


def test_a_frozen_submodule_named_module_is_kept_by_export_and_diff(tmp_path: Path) -> None:
    """A submodule named ``module`` inside the model (``self.enc.module``) is frozen (``requires_grad_(False)``): the
    optimizer's state names none of its parameters, so only the model's keys tell that ``module`` is no wrapper (it
    follows ``enc``; DDP's leads the key). export wrote ``enc.weight``/``enc.bias`` for ``enc.module.weight``/
    ``enc.module.bias`` (keys the model does not load) and diff noted them as wrapper segments removed; both now keep
    the model's own keys (loaded strictly, equal to torch's)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from tests.fixtures.builders import save_quiet, train_steps

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.head = torch.nn.Module(), torch.nn.Linear(4, 2)
            self.enc.module = torch.nn.Linear(4, 4).requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc.module(x))

    torch.manual_seed(0)
    model = Inner()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_steps(model, opt, 2, loss="square")
    osd = get_optimizer_state_dict(model, opt)
    assert set(osd["state"]) == {"head.weight", "head.bias"}
    save_quiet({"model": model.state_dict(), "optimizer": osd}, tmp_path / "plain")
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(tmp_path / "plain"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    Inner().load_state_dict(out, strict=True)
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())
    res = runner.invoke(app, ["diff", str(tmp_path / "plain"), str(tmp_path / "hf"), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["equal"] and not any("wrapper" in n for n in doc["notes"]), doc["notes"]


def test_a_parameter_saved_wrapped_and_unwrapped_is_refused_with_a_hint_for_that(tmp_path: Path) -> None:
    """A state dict holding ``module.w`` beside ``w`` (a model saved with and without its DDP wrapper): export refuses
    the two sources of one output key. Its hint spoke of fixing key rules the user never gave; it now says what
    the two names are and how to keep one."""
    import torch
    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    dcp.save({"model": {"module.w": torch.ones(2, 2), "w": torch.zeros(2, 2)}}, checkpoint_id=str(tmp_path / "ck"))
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ck"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        "error: [E601] model.module.w and model.w both map to the output key 'w'",
        "hint: the checkpoint holds one parameter under a wrapped and an unwrapped name (a model saved with and "
        "without its wrapper): keep one with --filter, or map one to another output key with --rules",
    ], res.stderr
    assert not (tmp_path / "out").exists()
