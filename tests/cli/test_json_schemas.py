"""Every command's --json output validates against the JSON Schema shipped in the package (`ckpttool schema CMD`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import SCHEMA_NAMES, load_schema
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


def validated(name: str, argv: list[str], exit_codes: tuple[int, ...] = (0,)) -> dict:  # type: ignore[type-arg]
    res = runner.invoke(app, argv)
    assert res.exit_code in exit_codes, (argv, res.stderr)
    doc = json.loads(res.stdout)
    schema = load_schema(name)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [(list(e.path), e.message[:200]) for e in errors[:5]]
    assert doc["schema"] == SCHEMA_NAMES[name]
    # A schema may leave its documents' fields open (consumers ignore what they do not know), but every field the
    # document has is declared, so `ckpttool schema CMD` describes it: inspect's key_schema, location, ... were not.
    assert sorted(undeclared(doc, schema, schema, name)) == [], name
    return doc


def undeclared(doc: object, node: object, root: dict, path: str) -> set[str]:  # type: ignore[type-arg]
    """Paths of the fields of ``doc`` that an object schema with ``properties`` (and no ``additionalProperties``)
    in ``node`` does not declare, through ``$ref``, ``anyOf``/``oneOf``/``allOf``, ``items`` and maps."""
    while isinstance(node, dict) and "$ref" in node:
        target: object = root
        for part in node["$ref"].split("/")[1:]:
            target = target[part]  # type: ignore[index]
        node = target
    if not isinstance(node, dict):
        return set()
    out = {
        p for key in ("anyOf", "oneOf", "allOf") for sub in node.get(key, ()) for p in undeclared(doc, sub, root, path)
    }
    props, more = node.get("properties"), node.get("additionalProperties")
    if isinstance(doc, dict) and props is not None:
        out |= {f"{path}.{k}" for k in doc if k not in props and not more}
        out |= {p for k, v in doc.items() if k in props for p in undeclared(v, props[k], root, f"{path}.{k}")}
    elif isinstance(doc, dict) and isinstance(more, dict):
        out |= {p for k, v in doc.items() for p in undeclared(v, more, root, f"{path}.*")}
    if isinstance(doc, list) and "items" in node:
        out |= {p for v in doc for p in undeclared(v, node["items"], root, f"{path}[]")}
    return out


@pytest.mark.parametrize("name", [*SCHEMA_NAMES, "replay-step"])
def test_schema_command_prints_the_packaged_schema(name: str) -> None:
    res = runner.invoke(app, ["schema", name])
    assert res.exit_code == 0, res.stderr
    schema = json.loads(res.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema == load_schema(name)
    assert schema["properties"]["schema"]["const"] == SCHEMA_NAMES["replay" if name == "replay-step" else name]
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_schema_without_a_name_lists_them() -> None:
    res = runner.invoke(app, ["schema"])
    assert res.exit_code == 0 and all(doc in res.stdout for doc in SCHEMA_NAMES.values())
    bad = runner.invoke(app, ["schema", "frob"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: [E100]")


def test_inspect_json(sample_ckpt: Path, dense_ckpt: Path, fsdp_ckpt: Path, ep_suite: Path) -> None:
    validated("inspect", ["inspect", str(sample_ckpt), "--json"])
    assert "tree" in validated("inspect", ["inspect", str(sample_ckpt), "--json", "--depth", "3"])
    validated("inspect", ["inspect", str(dense_ckpt), "--json"])
    validated("inspect", ["inspect", str(fsdp_ckpt), "--json"])
    doc = validated("inspect", ["inspect", str(ep_suite / "legacy"), "--json"])
    assert doc["layout"]["version"] is None and doc["layout"]["ambiguous"]


def test_inspect_json_with_a_layout_error(sample_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    (ck / "layout.json").write_text('{"format": "ckpttool.layout", "version": 99}')
    doc = validated("inspect", ["inspect", str(ck), "--json"])
    assert doc["layout"] is None and doc["layout_error"]["code"].startswith("E40")


def test_validate_json(sample_ckpt: Path, dense_ckpt: Path, tmp_path: Path) -> None:
    validated("validate", ["validate", str(sample_ckpt), "--json", "--strict", "--deep"])
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    assert damage.drop_keys(ck, lambda k: k == "optimizer.param_groups.0.eps")
    doc = validated("validate", ["validate", str(ck), "--json"], (1,))
    assert doc["findings"] and not doc["ok"]
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / ".metadata").write_bytes(b"not a pickle")
    doc = validated("validate", ["validate", str(tmp_path / "garbage"), "--json"], (2,))
    assert doc["exit_code"] == 2 and doc["findings"][0]["fatal"]


@pytest.fixture(scope="module")
def masters_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ckpttool.ops.sample import SampleOptions, write_sample

    return write_sample(tmp_path_factory.mktemp("m") / "ck", SampleOptions(steps=1, optimizer="cpu_offload_adamw")).path


def test_export_json(sample_ckpt: Path, masters_ckpt: Path, tmp_path: Path) -> None:
    validated("export", ["export", str(sample_ckpt), str(tmp_path / "a"), "--json", "--shard-size", "50KB"])
    doc = validated(
        "export",
        ["export", str(masters_ckpt), str(tmp_path / "b"), "--json", "--weights", "master", "--experts", "per-expert"],
    )
    assert doc["origins"]["master"]["count"] > 0
    doc = validated("export", ["export", str(sample_ckpt), str(tmp_path / "c"), "--json", "--filter", "*norm*"])
    assert doc["skipped"]


def test_reshard_stamp_and_replay_json(sample_ckpt: Path, ep_suite: Path, tmp_path: Path) -> None:
    validated(
        "reshard", ["reshard", str(sample_ckpt), str(tmp_path / "r"), "--to", "legacy", "--with-optimizer", "--json"]
    )
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "ck")
    doc = validated(
        "stamp", ["stamp", str(ck), "--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2", "--json"]
    )
    assert doc["written"] and doc["recorded_in"] == "sidecar"
    doc = validated(
        "stamp",
        ["stamp", str(sample_ckpt), "--source-layout", "canonical", "--ep-size", "1", "--ep-fsdp-size", "1", "--json"],
    )
    assert not doc["written"] and doc["recorded_in"] == "embedded"
    doc = validated("replay", ["replay-step", str(sample_ckpt), "--json", "--steps", "2"])
    assert doc["ok"] and doc["params_total"] == 31


def test_replay_schema_requires_every_field_a_replay_document_has(sample_ckpt: Path) -> None:
    """replay-step --json always writes ``problems`` (the saved state's findings: R002, R006, lost state: ``ok`` is
    false through them alone), ``params_skipped``, ``params_frozen`` and each parameter's ``update`` (R003) and
    ``torch_unequal``, as docs/replay.md lists them; its schema did not require them, so a document without
    ``problems`` (a consumer's only word on why ``ok`` is false with ``params_failed`` 0) validated."""
    doc = validated("replay", ["replay-step", str(sample_ckpt), "--json"])
    schema = load_schema("replay")
    assert set(schema["required"]) == set(doc)
    assert set(schema["properties"]["params"]["items"]["required"]) == set(doc["params"][0])
    validator = jsonschema.Draft202012Validator(schema)
    del doc["problems"]
    assert any(e.validator == "required" for e in validator.iter_errors(doc))


def test_rules_json() -> None:
    a = validated("rules", ["rules", "--json"])
    b = validated("rules", ["validate", "--list-rules", "--json"])
    assert a == b and len(a["rules"]) > 30


def test_a_document_that_breaks_its_schema_is_caught(sample_ckpt: Path) -> None:
    doc = json.loads(runner.invoke(app, ["inspect", str(sample_ckpt), "--json"]).stdout)
    validator = jsonschema.Draft202012Validator(load_schema("inspect"))
    assert validator.is_valid(doc)
    doc["model"][0]["shape"] = "8x32"
    assert not validator.is_valid(doc)
    del doc["summary"]
    assert any(e.validator == "required" for e in validator.iter_errors(doc))


def test_manifest_verify_json(sample_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    validated("manifest", ["manifest", str(ck), "--json"])
    doc = validated("manifest-check", ["manifest", str(ck), "--verify", "--json"])
    assert doc["ok"] and doc["kind"] == "dcp" and doc["problems"] == []
    data = max(ck.glob("__*_0.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = validated("manifest-check", ["manifest", str(ck), "--verify", "--json"], exit_codes=(1,))
    assert not bad["ok"] and {p["kind"] for p in bad["problems"]} == {"changed"}


def test_manifest_verify_json_of_an_hf_export(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--manifest"])
    assert res.exit_code == 0, res.stderr
    doc = validated("manifest-check", ["manifest", str(out), "--verify", "--json"])
    assert doc["ok"] and doc["kind"] == "safetensors" and doc["entries"] > 0


def test_the_name_choices_are_the_schema_table() -> None:
    """`ckpttool schema NAME` offers the names of SCHEMA_NAMES (and `replay-step` beside `replay`), each with a
    'printed by' line."""
    from ckpttool.commands.schema import _PRINTED_BY, SchemaName

    assert [c.value for c in SchemaName] == [
        c for n in SCHEMA_NAMES for c in ((n, "replay-step") if n == "replay" else (n,))
    ]
    assert _PRINTED_BY.keys() == SCHEMA_NAMES.keys()


def _without_parentheses(text: str) -> str:
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    return text


@pytest.mark.parametrize(
    "name, page, anchor",
    [
        ("reshard", "layouts.md", "`--json` prints `ckpttool.reshard/1`:"),
        ("stamp", "layouts.md", "`--json` prints `ckpttool.stamp/1`:"),
        ("manifest-check", "diff.md", "schema `ckpttool.manifest-check/1`:"),
        ("manifest", "diff.md", "`--json` prints schema `ckpttool.manifest/1`:"),
    ],
)
def test_field_lists_in_the_docs_are_the_schemas_fields(name: str, page: str, anchor: str) -> None:
    """Where a page lists a document's fields in a sentence, it lists exactly the fields its JSON Schema declares."""
    text = " ".join((Path(__file__).parents[2] / "docs" / page).read_text().split())
    sentence = _without_parentheses(text[text.index(anchor) + len(anchor) :]).split(". ")[0]
    assert set(re.findall(r"`(\w+)`", sentence)) == set(load_schema(name)["properties"]) - {"schema"}


def test_inspect_md_field_table_is_the_schemas_fields() -> None:
    """docs/inspect.md's field table has a row for each field of the inspect schema (``storage``, only present for a
    checkpoint read from object storage, in the text below it), and no row for a field the schema lacks."""
    text = (Path(__file__).parents[2] / "docs" / "inspect.md").read_text()
    schema = load_schema("inspect")["properties"]
    rows = re.findall(r"^\| `([\w.\[\]]+)`(?: / `[\w.\[\]]+`)? \|", text, re.M)
    tops = {re.split(r"[.\[]", r)[0] for r in rows}
    assert tops | {"storage"} == set(schema) and "`storage` (only for a checkpoint read from object storage" in text
    for row in rows:
        top, _, sub = row.replace("[]", "").partition(".")
        if sub:
            node = schema[top]
            assert sub.split(".")[0] in node.get("properties", {}), row


def test_inspect_and_stats_json_of_non_finite_hyperparameters_are_strict_json(fixture_root: Path) -> None:
    """A diverged run saves NaN/inf hyperparameters and counters: the documents hold them as the strings "nan",
    "inf", "-inf" (never an internal error from json.dumps, never NaN tokens, never null, which says 'not saved')."""
    from tests.fixtures import builders
    from tests.fixtures.cache import cached_build

    ckpt = cached_build(fixture_root, "nonfinite_hyperparameters", builders.build_nonfinite_hyperparameters)

    def strict(text: str) -> dict:  # type: ignore[type-arg]
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))

    doc = validated("inspect", ["inspect", "--json", str(ckpt)])
    strict(runner.invoke(app, ["inspect", "--json", str(ckpt)]).stdout)
    group = doc["optimizer"]["param_groups"][0]
    assert (group["lr"], group["eps"], group["initial_lr"], group["betas"]) == ("nan", "inf", "-inf", ["nan", 0.999])
    assert doc["training_values"] == {"train_state.step": "nan", "lr_scheduler.last_epoch": "nan"}
    human = runner.invoke(app, ["inspect", str(ckpt)])
    assert human.exit_code == 0 and "step nan" in human.stdout and "last_epoch nan" in human.stdout

    stats = validated("stats", ["stats", "--json", str(ckpt)])
    strict(runner.invoke(app, ["stats", "--json", str(ckpt)]).stdout)
    (only,) = stats["checkpoints"]
    assert only["updates"] == []
    assert only["notes"] == ["hyperparameters or step not finite (NaN, infinity): 2 parameter(s), e.g. weight"]


def test_every_json_option_names_the_schema_command_that_prints_its_schema() -> None:
    """Each ``--json`` help said ``its JSON Schema: `ckpttool schema CMD```; pasted, ``CMD`` is refused, and
    ``manifest --verify --json`` prints another document than ``ckpttool schema manifest`` describes."""
    from ckpttool.cli.app import COMMANDS

    named = {}
    for cmd in COMMANDS:
        res = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.stderr
        said = re.search(
            r"--json Write one JSON document to stdout \(its JSON Schema: (.*?)\)\.", " ".join(res.stdout.split())
        )
        if said is None:
            continue
        named[cmd] = re.findall(r"`ckpttool schema ([a-z-]+)`", said.group(1))
        for name in named[cmd]:
            assert runner.invoke(app, ["schema", name]).exit_code == 0, (cmd, name)
    assert named["manifest"] == ["manifest", "manifest-check"]
    assert named["replay-step"] == ["replay-step"] and named["stats"] == ["stats"], named
    assert all(names and names[0] == cmd for cmd, names in named.items()), named
