"""Key-schema detection on checkpoints written by the real trainers, and overrides.

Each expectation is a fact of the writer (torchtitan keeps the model at the top level, the DCP
tutorial's AppState nests under ``app.``, ``optimizer.state_dict()`` keys state by index), checked
against what :func:`ckpttool.model.schemas.detect.detect_schema` and the catalog make of its ``.metadata``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool.errors import SchemaError, UsageError
from ckpttool.model.catalog import build_catalog
from ckpttool.model.checkpoint import open_checkpoint
from ckpttool.model.discovery import CheckpointSelection
from ckpttool.model.schemas.keyschema import SchemaOverride

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers


def _titan(titan_root: Path, run: str, step: int) -> Path:
    return titan_root / run / "checkpoint" / f"step-{step}"


def test_torchtitan_full_save(titan_root: Path) -> None:
    cat = build_catalog(_titan(titan_root, "llama3", 2))
    s = cat.schema
    assert (s.id, s.model_prefix, s.optimizer_prefix, s.optimizer_keying, s.naming) == (
        "torchtitan",
        "",
        "optimizer.",
        "fqn",
        "torchtitan",
    )
    assert set(s.training_state) == {"lr_scheduler", "dataloader", "train_state"}
    assert "tok_embeddings.weight" in cat.model and "lm_head.weight" in cat.model
    assert cat.optimizer_flavor == "flattened"
    # Every optimizer fqn is a model key, except the fused wqkv that the model's state dict splits.
    orphans = {f: ps.stored_as for f, ps in cat.optimizer_state.items() if not ps.in_model}
    assert orphans and all(f.endswith("qkv_linear.wqkv.weight") for f in orphans)
    for f, parts in orphans.items():
        head = f.removesuffix("wqkv.weight")
        assert parts == (f"{head}wq.weight", f"{head}wk.weight", f"{head}wv.weight")
    assert cat.uncategorized_tensors() == []
    assert cat.training_state["train_state"] == ["train_state.step", "train_state.ntokens_seen"] or set(
        cat.training_state["train_state"]
    ) == {"train_state.step", "train_state.ntokens_seen"}


def test_torchtitan_model_only_bf16_save(titan_root: Path) -> None:
    cat = build_catalog(_titan(titan_root, "llama3", 3))
    assert cat.schema.id == "torchtitan" and cat.schema.optimizer_prefix is None
    assert len(cat.model) == 21 and {t.dtype for t in cat.model.values()} == {"bfloat16"}


def test_torchtitan_moe_experts_are_ep_candidates(titan_root: Path) -> None:
    with open_checkpoint(_titan(titan_root, "moe", 1)) as ck:
        ep = ck.require_layout().ep_tensors
        assert sorted(ep) == sorted(k for k in ck.catalog.model if ".inner_experts." in k)
        assert all(s.num_experts == 8 for s in ep.values())
        assert ck.require_layout().ambiguous == []  # 2 ranks: no EP>1 x EP-FSDP>1 split of 2 blocks


def test_accelerate_folders(acc_root: Path) -> None:
    model = build_catalog(acc_root / "accelerate" / "checkpoint-1" / "pytorch_model_fsdp_0")
    assert (model.schema.id, model.schema.model_prefix, model.schema.optimizer_prefix) == (
        "torch-native",
        "model.",
        None,
    )
    optim = build_catalog(acc_root / "accelerate" / "checkpoint-1" / "optimizer_0")
    assert optim.schema.model_prefix is None and optim.schema.optimizer_prefix == "optimizer."
    assert not optim.model and len(optim.optimizer_state) == 21


def test_app_state(acc_root: Path) -> None:
    cat = build_catalog(acc_root / "app_state")
    s = cat.schema
    assert (s.id, s.model_prefix, s.optimizer_prefix, s.optimizer_keying) == (
        "app-state",
        "app.model.",
        "app.optim.",
        "fqn",
    )
    assert cat.fqn_of("app.model.lm_head.weight") == "lm_head.weight"
    assert all(ps.in_model for ps in cat.optimizer_state.values()) and len(cat.optimizer_state) == 21
    assert cat.param_groups and cat.uncategorized_tensors() == []


def test_plain_optimizer_state_dict_is_index_keyed(plain_root: Path) -> None:
    cat = build_catalog(plain_root / "plain_optimizer")
    assert cat.schema.optimizer_keying == "index" and cat.schema.model_prefix == "model."
    assert set(cat.optimizer_state) == {str(i) for i in range(21)}


def test_flat_hf_state_dict_keeps_model_in_the_fqn(plain_root: Path) -> None:
    cat = build_catalog(plain_root / "flat_hf")
    assert (cat.schema.id, cat.schema.model_prefix, cat.schema.naming) == ("top-level", "", "hf")
    assert "lm_head.weight" in cat.model and "model.embed_tokens.weight" in cat.model
    assert cat.other_tensors == {}


def test_hf_storage_is_top_level(acc_root: Path) -> None:
    cat = build_catalog(acc_root / "hf_sharded")
    assert cat.schema.model_prefix == "" and "lm_head.weight" in cat.model and len(cat.model) == 21


def test_nothing_recognised(tmp_path: Path) -> None:
    dcp.save({"ema": {"w": torch.ones(3)}, "stats": {"count": torch.zeros(2)}}, checkpoint_id=str(tmp_path))
    cat = build_catalog(tmp_path)
    assert cat.schema.id == "unrecognized" and not cat.schema.recognised and not cat.model
    assert sorted(cat.uncategorized_tensors()) == ["ema.w", "stats.count"]
    assert "no model tensors or optimizer state recognised" in cat.schema.reasons[0]


def test_loose_tensor_beside_the_model_is_uncategorized(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path))
    cat = build_catalog(tmp_path)
    assert cat.schema.id == "torch-native" and list(cat.model) == ["model.w"]
    assert cat.uncategorized_tensors() == ["ema.w"]


@pytest.mark.parametrize("how", ["state_dict", "get_state_dict", "flattened"])
def test_a_plain_save_under_optim_is_torch_native(how: str, tmp_path: Path) -> None:
    """A user's own loop saving ``dcp.save({"model": ..., "optim": ...})`` was labelled ``olmo-core`` by the key
    prefixes alone (and so judged by OLMo-core's trainer rules: train/rankR.pt beside it, stepN names). OLMo-core's
    saves are told by the ``_StorageInfo`` its own writer pickles (tests/ops/test_frameworks_olmo_core.py); a plain
    save is torch-native, whichever way its optimizer state dict was taken."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    if how == "state_dict":
        msd, osd = model.state_dict(), optim.state_dict()
    else:
        msd, osd = get_state_dict(
            model, optim, options=StateDictOptions(flatten_optimizer_state_dict=how == "flattened")
        )
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    cat = build_catalog(tmp_path)
    assert (cat.schema.id, cat.schema.model_prefix, cat.schema.optimizer_prefix) == ("torch-native", "model.", "optim.")
    assert cat.schema.optimizer_keying == ("index" if how == "state_dict" else "fqn")
    res = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert (
        res.exit_code == 0 and "key schema  torch-native (detected): model 'model.', optimizer 'optim.'" in res.stdout
    )


def test_a_loops_top_level_save_with_a_scheduler_is_not_torchtitan(tmp_path: Path) -> None:
    """``dcp.save({**model_sd, "optimizer": ..., "lr_scheduler": ...})`` of a user's loop was labelled torchtitan by
    its ``lr_scheduler`` item alone, and judged as torchtitan's trainer (which steps its scheduler every optimizer
    step): a scheduler stepped once per epoch failed ``validate --deep`` with R002 (error) where the same save under
    ``model.`` gets R004 (warning). torchtitan's CheckpointManager saves its TrainState (``train_state``) in every
    save but a model-only one (torchtitan names): without either, the save is top-level."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.9)
    for _epoch in range(2):
        for _ in range(3):
            optim.zero_grad()
            model(torch.randint(0, 16, (2, 4))).pow(2).mean().backward()
            optim.step()
        sched.step()
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, checkpoint_id=str(tmp_path))
    cat = build_catalog(tmp_path)
    assert (cat.schema.id, cat.schema.model_prefix, cat.schema.training_state) == ("top-level", "", ("lr_scheduler",))
    res = CliRunner().invoke(app, ["validate", "--deep", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(f["code"], f["severity"]) for f in doc["findings"] if f["code"].startswith("R")] == [("R004", "warning")]


# ------------------------------------------------------------------------------------------ overrides
def test_override_reads_a_flat_save_as_torch_native(plain_root: Path) -> None:
    with open_checkpoint(
        plain_root / "flat_hf", selection=CheckpointSelection(schema=SchemaOverride("torch-native"))
    ) as ck:
        s = ck.catalog.schema
        assert (s.id, s.source, s.model_prefix) == ("torch-native", "override", "model.")
        assert "model.embed_tokens.weight" in ck.catalog.model and "lm_head.weight" in ck.catalog.other_tensors


def test_override_model_prefix(acc_root: Path) -> None:
    ov = SchemaOverride.from_options(None, "app.model.", "app.optim.")
    cat = build_catalog(acc_root / "app_state", ov)
    assert cat.schema.id == "custom" and len(cat.model) == 21 and len(cat.optimizer_state) == 21


def test_override_that_matches_nothing_is_e250(acc_root: Path) -> None:
    with pytest.raises(SchemaError) as ei:
        build_catalog(acc_root / "app_state", SchemaOverride.from_options(None, "nope.", None))
    assert ei.value.code == "E250" and ei.value.param == "model_prefix" and "'nope.'" in ei.value.message


@pytest.mark.parametrize("args", [("bogus", None, None), (None, "model", None), (None, None, "optim")])
def test_bad_override_options_are_usage_errors(args: tuple) -> None:
    with pytest.raises(UsageError):
        SchemaOverride.from_options(*args)


def test_planner_paths_that_do_not_flatten_to_their_key_are_ignored(tmp_path: Path) -> None:
    """A custom planner's planner_data says nothing about nesting: the keys are read by their prefixes."""
    import dataclasses

    from ckpttool.format.directory import CheckpointDir
    from ckpttool.model.schemas.detect import detect_schema, planner_paths

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save(
        {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
        checkpoint_id=str(tmp_path),
        no_dist=True,
    )
    md = CheckpointDir(tmp_path).metadata
    assert planner_paths(md) is md.planner_data  # torch's own paths all flatten to their key
    junk = dict(md.planner_data)
    junk["model.weight"] = ("model", "weight", "float32", "torch.strided", (4, 4))
    junk["optimizer.state.weight.exp_avg"] = ("optimizer", "state", "bias", "exp_avg")
    odd = dataclasses.replace(md, planner_data=junk)
    assert set(planner_paths(odd)) == set(md.planner_data) - {"model.weight", "optimizer.state.weight.exp_avg"}
    sch = detect_schema(odd)
    assert (sch.model_prefix, sch.optimizer_prefix) == ("model.", "optimizer.")
    cat = build_catalog(CheckpointDir(tmp_path, metadata=odd))
    assert set(cat.optimizer_state) == {"weight", "bias"}
    assert cat.optimizer_state["weight"].in_model and set(cat.optimizer_state["weight"].fields) >= {"exp_avg"}


@pytest.mark.parametrize("saved", ["optimizer_only", "beside_model", "pair"])
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_an_optimizer_state_dict_at_the_top_level_is_optimizer_state(saved: str, flatten: bool, tmp_path: Path) -> None:
    """``dcp.save(get_optimizer_state_dict(model, optim))`` puts torch's optimizer state dict at the top level:
    ``state.<fqn>.<field>`` tensors beside ``param_groups.*`` items; saved alone, merged into the model's state dict
    (``{**msd, **osd}``), or as the ``optimizer/`` folder beside a top-level ``model/``. The top-level schema counted
    every flattened ``state.`` tensor as a model weight (inspect listed exp_avg and step under 'model tensors',
    validate --strict said OK as 'model weights only', export wrote them as weights); the nested ones were 'other'
    (K002). Both are the optimizer's state at the top level (prefix ''), checked against the state dict torch saved."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 16, (2, 4))).pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    if saved == "pair":
        dcp.save(msd, checkpoint_id=str(tmp_path / "model"))
        dcp.save(osd, checkpoint_id=str(tmp_path / "optimizer"))
    else:
        dcp.save(osd if saved == "optimizer_only" else {**msd, **osd}, checkpoint_id=str(tmp_path))
    nested = osd if flatten else {f"state.{fqn}.{k}": v for fqn, s in osd["state"].items() for k, v in s.items()}
    want = {k: tuple(v.shape) for k, v in nested.items() if k.startswith("state.") and isinstance(v, torch.Tensor)}
    assert len(want) == 9  # 3 parameters x (step, exp_avg, exp_avg_sq)
    cat = open_checkpoint(tmp_path).catalog
    assert (cat.schema.id, cat.schema.optimizer_prefix, cat.schema.optimizer_keying) == ("top-level", "", "fqn")
    assert "optimizer state at the top level (torch's optimizer state dict as it is), keyed by parameter fqn" in (
        cat.schema.reasons
    )
    assert sorted(cat.model) == ([] if saved == "optimizer_only" else sorted(msd))
    assert not cat.uncategorized_tensors()
    got = {t.key: t.shape for ps in cat.optimizer_state.values() for t in ps.fields.values() if t is not None}
    assert got == want
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)["summary"]
    assert summary["model_tensor_count"] == (0 if saved == "optimizer_only" else 3)
    assert summary["bytes_by_category"]["optimizer_state"] == sum(
        v.numel() * v.element_size() for k, v in nested.items() if k in want
    )
    if saved != "optimizer_only":
        res = CliRunner().invoke(app, ["validate", "--strict", str(tmp_path), "--json"])
        assert res.exit_code == 0 and not json.loads(res.stdout)["findings"], res.output


def _stepped(model: torch.nn.Module, flatten: bool, steps: int = 1, batch: int = 2) -> tuple[dict, dict]:
    """``get_state_dict(model, AdamW)`` after ``steps`` AdamW steps on random ``[batch, 8]`` inputs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(batch, 8)).pow(2).mean().backward()
        optim.step()
    return get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flatten))


def _exported_loads(src: Path, out: Path, fresh: torch.nn.Module, msd: dict) -> None:
    """``ckpttool export SRC OUT`` exits 0 and its ``model.safetensors`` loads strictly into ``fresh`` with
    ``msd``'s values, bit for bit."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    res = CliRunner().invoke(app, ["export", str(src), str(out)])
    assert res.exit_code == 0, res.output
    exported = load_file(out / "model.safetensors")
    fresh.load_state_dict(exported, strict=True)
    assert all(torch.equal(exported[k], v) for k, v in msd.items())


class _StateNamed(torch.nn.Module):
    """A model whose submodules are called ``state`` and ``param_groups``, as torch's optimizer state dict's parts."""

    def __init__(self) -> None:
        super().__init__()
        self.state = torch.nn.Linear(8, 8)
        self.param_groups = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.param_groups(self.state(x))


@pytest.mark.parametrize("saved", ["model_only", "beside_model", "pair"])
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_a_model_submodule_called_state_is_the_models(saved: str, flatten: bool, tmp_path: Path) -> None:
    """A model with submodules called ``state`` and ``param_groups`` (model keys ``state.weight``,
    ``param_groups.bias``), saved alone, merged with ``get_optimizer_state_dict`` (``{**msd, **osd}``) or as a
    model/optimizer pair. Its weights were read as torch's optimizer state dict at the top level: alone, 'optimizer
    state only' (export E601, no model tensors); beside the optimizer, the model lost them (export wrote 2 of 4
    weights with exit 0, validate O003 on an fqn ''). They are the model's: every weight exported, torch's
    load_state_dict of the export strict, validate --strict clean."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    msd, osd = _stepped(_StateNamed(), flatten)
    src = tmp_path / "ckpt"
    if saved == "pair":
        dcp.save(msd, checkpoint_id=str(src / "model"))
        dcp.save(osd, checkpoint_id=str(src / "optimizer"))
    else:
        dcp.save(msd if saved == "model_only" else {**msd, **osd}, checkpoint_id=str(src))
    cat = open_checkpoint(src).catalog
    assert cat.schema.model_prefix == "" and sorted(cat.model) == sorted(msd)
    assert not cat.uncategorized_tensors()
    if saved == "model_only":
        assert cat.schema.optimizer_prefix is None and not cat.optimizer_state
    else:
        assert cat.schema.optimizer_prefix == "" and sorted(cat.optimizer_state) == sorted(msd)
        assert all(ps.in_model for ps in cat.optimizer_state.values())
    res = CliRunner().invoke(app, ["validate", "--strict", str(src), "--json"])
    assert res.exit_code == 0 and not json.loads(res.stdout)["findings"], res.output
    _exported_loads(src, tmp_path / "out", _StateNamed(), msd)


class _CounterNamed(torch.nn.Module):
    """A model whose top-level parameters are called ``step`` and ``epoch``, as a trainer's counters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.step = torch.nn.Parameter(torch.randn(4))
        self.epoch = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.step + self.epoch


@pytest.mark.parametrize("saved", ["beside_model", "pair"])
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_a_model_parameter_called_step_is_the_models(saved: str, flatten: bool, tmp_path: Path) -> None:
    """A model with top-level parameters called ``step`` and ``epoch`` saved with its AdamW state at the top level
    (torchtitan's layout, ``{**msd, **osd}``) or as a model/optimizer pair: the parameters were read as the trainer's
    step and epoch counters (inspect 'training step: 1 key', validate O003 'state.step.*: step is not a model tensor',
    export wrote 1 of 3 weights with exit 0). The optimizer keys them as parameters: they are the model's; a real
    counter beside them (``global_step``) stays training state."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    msd, osd = _stepped(_CounterNamed(), flatten)
    src = tmp_path / "ckpt"
    if saved == "pair":
        dcp.save({**msd, "global_step": torch.tensor(1)}, checkpoint_id=str(src / "model"))
        dcp.save(osd, checkpoint_id=str(src / "optimizer"))
    else:
        dcp.save({**msd, **osd, "global_step": torch.tensor(1)}, checkpoint_id=str(src))
    cat = open_checkpoint(src).catalog
    assert sorted(cat.model) == sorted(msd) and list(cat.training_state) == ["global_step"], cat.training_state
    assert sorted(cat.optimizer_state) == sorted(msd) and all(ps.in_model for ps in cat.optimizer_state.values())
    res = CliRunner().invoke(app, ["validate", "--deep", str(src), "--json"])
    assert res.exit_code == 0 and not json.loads(res.stdout)["findings"], res.output
    _exported_loads(src, tmp_path / "out", _CounterNamed(), msd)


def test_a_model_only_save_with_a_parameter_called_step_keeps_it(tmp_path: Path) -> None:
    """A model-only save (torchtitan's last save, an export source) of a model with top-level parameters called
    ``step`` and ``epoch``, beside a real counter (``global_step``, one element) and ``torch.get_rng_state()``: no
    optimizer names the parameters, but no counter holds more than one element. They were training state (export
    wrote ``lin`` alone, exit 0); they are the model's, the counter and the RNG state stay training state."""

    torch.manual_seed(0)
    msd = _CounterNamed().state_dict()
    src = tmp_path / "ckpt"
    dcp.save({**msd, "global_step": torch.tensor(7), "rng_state": torch.get_rng_state()}, checkpoint_id=str(src))
    cat = open_checkpoint(src).catalog
    assert sorted(cat.model) == sorted(msd) and sorted(cat.training_state) == ["global_step", "rng_state"]
    assert f"- {len(msd)} model tensor(s) at the top level" in "\n".join(f"- {r}" for r in cat.schema.reasons)
    _exported_loads(src, tmp_path / "out", _CounterNamed(), msd)


class _ScalarCounterNamed(torch.nn.Module):
    """A model whose top-level parameters ``step`` (0-d) and ``epoch`` (``[1]``) are shaped as counters are saved."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # its buffer num_batches_tracked: a 0-d int64 counter of the model's
        self.step = torch.nn.Parameter(torch.tensor(0.5))
        self.epoch = torch.nn.Parameter(torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) * self.step + self.epoch


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_a_one_element_parameter_called_step_beside_an_optimizer_under_a_prefix_is_the_models(
    flatten: bool, tmp_path: Path
) -> None:
    """torchtitan's layout: the model at the top level, the optimizer under ``optimizer.`` and the trainer's step in
    ``train_state``. A model parameter called ``step`` (0-d) or ``epoch`` (``[1]``) was read as a trainer's counter
    though ``optimizer.state.step.*`` keys it: validate failed the clean save with O003 ('step' is not a model
    tensor) and export left both weights out (counted as training state). They are the model's; the real counter
    ``train_state.step`` stays training state and is read."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = _ScalarCounterNamed()
    msd, osd = _stepped(model, flatten, steps=3, batch=5)
    src = tmp_path / "ckpt"
    dcp.save({**msd, "optimizer": osd, "train_state": {"step": torch.tensor(3)}}, checkpoint_id=str(src))
    cat = open_checkpoint(src).catalog
    assert sorted(cat.model) == sorted(msd) and list(cat.training_state) == ["train_state"], cat.training_state
    params = dict(model.named_parameters())
    assert sorted(cat.optimizer_state) == sorted(params) and all(ps.in_model for ps in cat.optimizer_state.values())
    res = CliRunner().invoke(app, ["validate", "--deep", str(src), "--json"])
    assert res.exit_code == 0 and not json.loads(res.stdout)["findings"], res.output
    res = CliRunner().invoke(app, ["inspect", str(src), "--json"])
    assert json.loads(res.stdout)["training_values"] == {"train_state.step": 3}, res.stdout
    _exported_loads(src, tmp_path / "out", _ScalarCounterNamed(), msd)


@pytest.mark.parametrize("lr", ["float", "tensor"])
@pytest.mark.parametrize("saved", ["beside_model", "pair"])
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_a_stateless_optimizer_at_the_top_level_is_an_optimizer(
    saved: str, flatten: bool, lr: str, tmp_path: Path
) -> None:
    """SGD with momentum 0 keeps no state: ``get_optimizer_state_dict`` holds its param groups alone. Saved at the
    top level (``{**msd, **osd}`` or a model/optimizer pair) it was not read as an optimizer: validate --strict
    said OK, 'no optimizer state (model weights only)', on a group whose lr is NaN (a scheduler's), the optimizer
    rules skipped; an lr given as a tensor (``SGD(params, lr=torch.tensor(0.1))``) was a model tensor, flattened
    (``param_groups.0.weight.lr`` among the weights), or K002, nested. The groups are the optimizer's, as under
    ``optimizer.``: P006 names the NaN lr."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1 if lr == "float" else torch.tensor(0.1))
    model(torch.randn(2, 8)).pow(2).mean().backward()
    optim.step()
    optim.param_groups[0]["lr"] = float("nan") if lr == "float" else torch.tensor(float("nan"))
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    assert not osd["state"] if not flatten else not any(k.startswith("state.") for k in osd)
    if saved == "pair":
        dcp.save(msd, checkpoint_id=str(tmp_path / "model"))
        dcp.save(osd, checkpoint_id=str(tmp_path / "optimizer"))
    else:
        dcp.save({**msd, **osd}, checkpoint_id=str(tmp_path))
    cat = open_checkpoint(tmp_path).catalog
    assert (cat.schema.model_prefix, cat.schema.optimizer_prefix) == ("", "")
    assert sorted(cat.model) == sorted(msd) and not cat.optimizer_state
    res = CliRunner().invoke(app, ["validate", "--strict", str(tmp_path), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 1, res.output
    group = "0.bias and 3 more" if flatten else "0"  # a flattened group is named by its parameters
    assert [(f["code"], f["message"]) for f in doc["findings"]] == [
        ("P006", f"param group {group}: lr is nan, not a finite number")
    ]


def test_model_and_optimizer_both_at_the_top_level_read_by_prefixes(tmp_path: Path) -> None:
    """``dcp.save(get_model_state_dict(m), "model/")`` and ``dcp.save(get_optimizer_state_dict(m, o), "optimizer/")``:
    the pair opens as one checkpoint with both at the top level, read with ``--model-prefix '' --optimizer-prefix ''``.
    The model claimed the optimizer's ``state.`` tensors too (inspect: 'state for 0/2 params', its exp_avg listed as
    model tensors), so no command could read that pair's optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save(msd, checkpoint_id=str(tmp_path / "model"))
    dcp.save(osd, checkpoint_id=str(tmp_path / "optimizer"))
    sel = CheckpointSelection(schema=SchemaOverride(model_prefix="", optimizer_prefix=""))
    cat = open_checkpoint(tmp_path, selection=sel).catalog
    assert sorted(cat.model) == ["bias", "weight"] and not cat.uncategorized_tensors()
    assert sorted(cat.optimizer_state) == ["bias", "weight"]
    assert {f: sorted(ps.fields) for f, ps in cat.optimizer_state.items()} == {
        f: ["exp_avg", "exp_avg_sq", "step"] for f in ("bias", "weight")
    }
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--model-prefix", "", "--optimizer-prefix", ""])
    assert res.exit_code == 0, res.output
    assert "model top level, optimizer top level by fqn" in res.stdout and "state for 2/2 params" in res.stdout


def test_a_top_level_training_item_tensor_is_not_a_model_tensor(tmp_path: Path) -> None:
    """``dcp.save({**model.state_dict(), "rng_state": torch.get_rng_state(), "step": torch.tensor(5)})``: a loop's
    training state saved as loose top-level tensors (planner path ``("step",)``, like a parameter's). The top-level
    schema counted them as model tensors (inspect: 6 model tensors, a uint8 [5056] 'rng_state' among the weights,
    while its reasons listed them as training-state items; export wrote them into model.safetensors). They are the
    training state they are named for."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    rng = torch.get_rng_state()
    dcp.save({**model.state_dict(), "rng_state": rng, "step": torch.tensor(5)}, checkpoint_id=str(tmp_path))
    cat = build_catalog(tmp_path)
    assert (cat.schema.id, cat.schema.training_state) == ("top-level", ("rng_state", "step"))
    assert sorted(cat.model) == sorted(model.state_dict())
    assert "4 model tensor(s) at the top level of the saved dict" in cat.schema.reasons[0]
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["summary"]["model_tensor_count"] == 4
    assert doc["summary"]["bytes_by_category"]["model"] == sum(v.nbytes for v in model.state_dict().values())
    assert doc["training_state"] == {"rng_state": ["rng_state"], "step": ["step"]}
    assert not doc["uncategorized_tensors"]
