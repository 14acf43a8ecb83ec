"""The key-schema registry: one spec per schema, and everything derived from it.

The ``--schema`` choices, ``ckpttool import``'s choices, the step-directory names and the
``docs/design.md`` §2 table come from the registered specs; a schema registered by a test
module alone is detected by ``inspect`` and placed by the catalog (the seam a trainer's
schema is added through).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli.app import app
from ckpttool.model.catalog import build_catalog
from ckpttool.model.checkpoint import open_checkpoint
from ckpttool.model.counters import trainer_steps
from ckpttool.model.discovery import step_of
from ckpttool.model.schemas import registry
from ckpttool.model.schemas.base import CommonState, Detected, SchemaSpec, canonical_model_key
from ckpttool.model.schemas.keyschema import SchemaOverride
from ckpttool.ui.options import IMPORT_SCHEMA_DEFAULT, ImportSchemaChoice, SchemaChoice

runner = CliRunner()
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_builtin_schemas_in_priority_order() -> None:
    assert registry.names() == (
        "torchtune",
        "olmo-core",
        "torch-native",
        "app-state",
        "nemo-automodel",
        "torchtitan",
        "megatron",
        "verl",
        "torch-checkpointing",
        "top-level",
    )
    assert [(s.model_prefix, s.optimizer_prefix) for s in registry.specs()] == [
        ("model.", "optimizer."),
        ("model.", "optim."),
        ("model.", "optimizer."),
        ("app.model.", "app.optim."),
        ("", "optim."),
        ("", "optimizer."),
        ("", "optimizer."),
        ("model.", "optimizer."),
        ("model.", "optimizer."),
        ("", "optimizer."),
    ]
    assert canonical_model_key("layers.0.w") == "model.layers.0.w"


def test_docs_table_is_the_registry() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("## §2 Key schema") : text.index("## §3")]
    lines = section.splitlines()
    start = lines.index("| schema | model tensors | optimizer state | written by |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert "\n".join(lines[start:end]) + "\n" == registry.schema_table()


def test_cli_choices_come_from_the_registry() -> None:
    assert [c.value for c in SchemaChoice] == list(registry.names())
    assert [c.value for c in ImportSchemaChoice] == ["torch-native", "torchtitan", "megatron"]
    assert IMPORT_SCHEMA_DEFAULT.value == "torch-native"
    packaged = json.loads((Path(ckpttool.__file__).parent / "schemas" / "import.schema.json").read_text())
    assert packaged["properties"]["key_schema"]["enum"] == [s.name for s in registry.import_targets()]
    help_text = re.sub(r"\s+", " ", runner.invoke(app, ["inspect", "--help"], terminal_width=200).stdout)
    assert "|".join(registry.names()) in help_text and "olmo-core|torch-native|app-state|nemo-automodel" in help_text


def test_step_directory_names() -> None:
    assert [step_of(n) for n in ("step-3", "checkpoint-100", "global_step7", "iter_0000100", "Epoch_2", "stepx")] == [
        3,
        100,
        7,
        100,
        2,
        None,
    ]
    assert registry.derived().discovery.latest_files == (
        "LATEST",
        "LATEST.txt",
        "latest_train_state.pt",  # Megatron Bridge's, read before Megatron-LM's .txt as Bridge's resume reads them
        "latest_ckpt_global_step.txt",  # SkyRL's
        "latest",
        "latest_checkpointed_iteration.txt",
    )
    assert [step_of(n) for n in ("epoch_0_step_5", "epoch_3_step_12", "epoch_0_step_x")] == [5, 12, None]


def test_a_spec_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.get("torchtitan"))
    with pytest.raises(KeyError):
        registry.get("no-such-schema")


# ------------------------------------------------------------------------------ a schema added by a test
def _trainer_claims(d: Detected) -> bool:
    return d.model_prefix == "trainer."


TRAINER = SchemaSpec(
    name="trainer-x",
    model_prefix="trainer.",
    optimizer_prefix="optimizer.",
    model_container=("trainer",),
    claims=_trainer_claims,
    priority=15,
    training_state_items=("trainer_clock",),
)


@pytest.fixture
def trainer_schema() -> Iterator[SchemaSpec]:
    registry.register(TRAINER)
    try:
        yield TRAINER
    finally:
        registry.unregister(TRAINER.name)


@pytest.fixture
def trainer_ckpt(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    sd = {
        "trainer": {f"layers.{i}.w": torch.randn(4, 4, generator=g) for i in range(3)},
        "trainer_clock": {"ticks": torch.tensor(7)},
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    return tmp_path / "ck"


def test_a_registered_schema_is_detected_and_placed(trainer_schema: SchemaSpec, trainer_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(trainer_ckpt)])
    assert res.exit_code == 0, res.stderr
    ks = json.loads(res.stdout)["key_schema"]
    assert (ks["id"], ks["model_prefix"], ks["training_state"]) == ("trainer-x", "trainer.", ["trainer_clock"])
    cat = build_catalog(trainer_ckpt)
    assert sorted(cat.model) == ["trainer.layers.0.w", "trainer.layers.1.w", "trainer.layers.2.w"]
    assert cat.param_fqns == ["layers.0.w", "layers.1.w", "layers.2.w"]
    assert cat.model_key("layers.1.w") == "trainer.layers.1.w"
    assert cat.training_state == {"trainer_clock": ["trainer_clock.ticks"]}
    assert cat.uncategorized_tensors() == []
    over = build_catalog(trainer_ckpt, SchemaOverride.from_options("trainer-x", None, None))
    assert over.schema.id == "trainer-x" and sorted(over.model) == sorted(cat.model)


def test_without_the_registered_schema(trainer_ckpt: Path) -> None:
    assert "trainer-x" not in registry.names()
    cat = build_catalog(trainer_ckpt)
    # nested under a name no spec knows: no model tensors, every tensor is "other"
    assert cat.schema.id == "unrecognized" and not cat.model
    assert sorted(cat.other_tensors) == [*(f"trainer.layers.{i}.w" for i in range(3)), "trainer_clock.ticks"]


# ------------------------------------------------------------------------------ a trainer's common state
READS: list[Path] = []


def _read_clock(data: bytes, shown: str) -> CommonState | None:
    """A test trainer's common state: ``clock.json`` beside ``.metadata`` (its iteration and one param group)."""
    READS.append(Path(shown).parent)
    doc = json.loads(data)
    return CommonState(
        groups=(tuple(doc["groups"]),), common_step=(None,), iteration=doc["iteration"], keys=tuple(doc), values={}
    )


def _every_parameter(common: CommonState, params: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[Any]:
    return [(dict(g), sorted(params)) for g in common.groups[0]]


CLOCKED = SchemaSpec(
    name="trainer-clocked",
    model_prefix="trainer.",
    optimizer_prefix="optimizer.",
    model_container=("trainer",),
    claims=_trainer_claims,
    priority=15,
    common_state_file="clock.json",
    read_common_state=_read_clock,
    group_members=_every_parameter,
)


def test_a_registered_common_state_is_read_once_by_every_reader(tmp_path: Path) -> None:
    """A schema that declares a common-state file (and a reader) has its iteration counted as a trainer step, its
    param groups in the catalog and its file as one ckpttool reads, with no generic module naming it."""
    g = torch.Generator().manual_seed(3)
    model = {f"layers.{i}.w": torch.randn(4, 4, generator=g) for i in range(2)}
    state = {f"optimizer.state.layers.{i}.w.exp_avg": torch.zeros(4, 4) for i in range(2)}
    dcp.save({"trainer": model, **state}, checkpoint_id=str(tmp_path / "iter_5"))
    (tmp_path / "iter_5" / "clock.json").write_text(json.dumps({"iteration": 4, "groups": [{"lr": 0.5}]}))
    registry.register(CLOCKED)
    READS.clear()
    try:
        with open_checkpoint(tmp_path / "iter_5") as ckpt:
            assert ckpt.catalog.schema.id == "trainer-clocked"
            [group] = ckpt.catalog.param_groups
            assert (group.values, group.params) == ({"lr": 0.5}, ["layers.0.w", "layers.1.w"])
            assert group.keys == {"lr": "clock.json:optimizer.param_groups.0.lr"}
            assert [(c.key, c.value) for c in trainer_steps(ckpt)] == [("clock.json:iteration", 4)]
            assert ckpt.common_state() is ckpt.common_state()
            assert ckpt.unread_beside() == ()
        assert READS == [tmp_path / "iter_5"]  # read once: the catalog's groups, the counters and the rest share it
        res = runner.invoke(app, ["validate", "--json", "--select", "R002", str(tmp_path / "iter_5")])
        assert res.stdout.strip(), (res.exit_code, res.stderr)
        found = [f for f in json.loads(res.stdout)["findings"] if f["severity"] in ("error", "warning")]
        assert [(f["code"], f["key"]) for f in found] == [("R002", "clock.json")], res.stdout
        assert "clock.json iteration = 4 but its directory is iter_5 (step 5)" in found[0]["message"]
    finally:
        registry.unregister(CLOCKED.name)


def test_the_common_state_of_a_url_is_not_read_from_a_local_folder_named_like_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Path("s3://b/ck")`` is the local relative path ``s3:/b/ck``: a remote checkpoint's common state was looked
    for there, so a folder of that name in the current directory was read as the checkpoint's own state."""
    from ckpttool.format.storage import UrlPath

    g = torch.Generator().manual_seed(3)
    dcp.save({"trainer": {"layers.0.w": torch.randn(4, 4, generator=g)}}, checkpoint_id=str(tmp_path / "iter_5"))
    planted = tmp_path / "s3:" / "bkt" / "ck"
    planted.mkdir(parents=True)
    (planted / "clock.json").write_text(json.dumps({"iteration": 99, "groups": [{"lr": 9.0}]}))
    monkeypatch.chdir(tmp_path)
    registry.register(CLOCKED)
    READS.clear()
    try:
        with open_checkpoint(tmp_path / "iter_5") as ckpt:
            assert ckpt.catalog.common_state(UrlPath.of("s3://bkt/ck")) is None
            assert ckpt.catalog.common_state(str(planted)).iteration == 99  # a local folder is read
        assert READS == [planted]  # iter_5 holds no clock.json: nothing to parse
    finally:
        registry.unregister(CLOCKED.name)


def _clock_config(folder: Path) -> str | None:
    return None if (folder / "clock.cfg").is_file() else "absent: the trainer's load reads it"


DECLARED = SchemaSpec(
    name="trainer-declared",
    model_prefix="trainer.",
    optimizer_prefix="optimizer.",
    model_container=("trainer",),
    claims=_trainer_claims,
    priority=15,
    common_state_file="clock.json",
    read_common_state=_read_clock,
    common_state_required="the trainer's load reads its clock from it",
    config_file="clock.cfg",
    config_problem=_clock_config,
    reshard_refusal=("a trainer-declared checkpoint: nothing to convert", "load it as it is"),
)


def test_behaviours_a_schema_declares_are_asked_of_its_spec(trainer_ckpt: Path, tmp_path: Path) -> None:
    """``validate`` (K013, K014) and ``reshard`` (E602) ask the spec what its trainer needs, not its name."""
    registry.register(DECLARED)
    try:
        res = runner.invoke(app, ["validate", "--json", "--select", "K013,K014", str(trainer_ckpt)])
        found = {f["code"]: f for f in json.loads(res.stdout)["findings"] if f["severity"] in ("error", "warning")}
        assert sorted(found) == ["K013", "K014"], res.stdout
        assert found["K013"]["message"] == f"{trainer_ckpt / 'clock.cfg'}: absent: the trainer's load reads it"
        assert found["K014"]["message"] == (
            f"{trainer_ckpt / 'clock.json'}: missing; the trainer's load reads its clock from it"
        )
        res = runner.invoke(app, ["reshard", str(trainer_ckpt), str(tmp_path / "out"), "--to", "canonical"])
        assert res.exit_code == 2 and "[E602]" in res.stderr, (res.exit_code, res.stderr)
        assert f"{trainer_ckpt}: a trainer-declared checkpoint: nothing to convert" in res.stderr
        assert "hint: load it as it is" in res.stderr
        assert not (tmp_path / "out").exists()
    finally:
        registry.unregister(DECLARED.name)
