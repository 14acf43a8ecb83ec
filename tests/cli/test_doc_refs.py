"""scripts/doc_refs.py: the references of the docs and docstrings name what exists, and the checker tells a
stale name, file or code from a live one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def doc_refs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_refs", ROOT / "scripts" / "doc_refs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["doc_refs"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def index(doc_refs: ModuleType) -> object:
    return doc_refs.build_index()


def _problems(doc_refs: ModuleType, index: object, line: str) -> list[str]:
    codes = ({"E204", "E308"}, {"R002", "D004"})
    return list(doc_refs._line_refs(index, ROOT / "docs" / "design.md", line, codes))


def test_the_docs_and_docstrings_hold_no_stale_reference(doc_refs: ModuleType, capsys) -> None:  # type: ignore[no-untyped-def]
    assert doc_refs.main() == 0, capsys.readouterr().out


@pytest.mark.parametrize(
    "line",
    [
        "`ckpttool.ops.export.quantize` and :func:`~ckpttool.model.counters.lost_optimizer_state`",
        "`engine/scan.py`, `native/fp8.c`, `ops/diff/compare.py::ValueCompare`, `format/hf_storage.check_hf_index`",
        "`E204`, `R002`, D004 and E308 ([storage](storage.md))",
        "`Catalog.wrapped`, :meth:`OutputFormat.pieces_planner`, `mdcache.parse_metadata_cached(data)`",
        ":func:`select_sources`, `tests/security/test_hf_folders.py`, `ckpttool.layout` (a format name)",
        "`model.safetensors.index.json`, `optimizer.state.<fqn>`, `torch.load`, `layout.json`",
        "Built on `ckpttool.layouts` (`resolve_layout`, `tensor_geometry`).",
        '``docs/export.md``, "Model adapters"; ``docs/design.md`` §5, "One chunk locator"; design.md §9',
        "[storage](storage.md#a-rank-lost-under-torchrun-local-and-url-outputs), [design](design.md)",
        "schemas `ckpttool.manifest/1`, `ckpttool.manifest-check/1`",
    ],
)
def test_live_references_pass(doc_refs: ModuleType, index: object, line: str) -> None:
    assert _problems(doc_refs, index, line) == []


@pytest.mark.parametrize(
    ("line", "stale"),
    [
        ("`ckpttool.ops.export.quantise`", "ckpttool.ops.export.quantise"),
        (":func:`~ckpttool.model.counters.lost_state`", "ckpttool.model.counters.lost_state"),
        ("`engine/scanner.py`", "engine/scanner.py"),
        ("`native/fp9.c`", "native/fp9.c"),
        ("`ops/diff/compare.py::ValueCompared`", "ValueCompared"),
        ("`format/hf_storage.check_index`", "check_index"),
        ("`E203`", "E203"),
        ("R099", "R099"),
        (":meth:`OutputFormat.source_pieces`", "OutputFormat.source_pieces"),
        ("`mdcache.parse_cached`", "mdcache.parse_cached"),
        (":func:`select_source`", "select_source"),
        ("`ops.fields.OutputOption`", "OutputOption"),
        ("`tests/security/test_hf_folder.py`", "test_hf_folder.py"),
        ("see [the rules](rulez.md)", "rulez.md"),
        ("Built on `ckpttool.layouts` (`resolve_layout`, `ep_geometry`).", "ep_geometry"),
        ('``docs/export.md``, "Model adaptors"', "Model adaptors"),
        ('``docs/design.md`` §5, "One chunk reader"', "One chunk reader"),
        ("``docs/design.md`` §12", "§12"),
        ("[storage](storage.md#a-rank-lost-under-torchrun)", "storage.md#a-rank-lost-under-torchrun"),
        ("schema `ckpttool.manifest-verify/1`", "ckpttool.manifest-verify/1"),
    ],
)
def test_stale_references_are_reported(doc_refs: ModuleType, index: object, line: str, stale: str) -> None:
    problems = _problems(doc_refs, index, line)
    assert len(problems) == 1 and stale in problems[0], problems


def test_table_codes_without_a_raiser_are_reported(doc_refs: ModuleType, index: object) -> None:
    errors = doc_refs._table_codes(ROOT / "docs" / "errors.md", "E")
    rules = doc_refs._table_codes(ROOT / "docs" / "rules.md", "[SOPLMKDR]")
    assert list(doc_refs._unraised(index, errors, rules)) == []
    problems = list(doc_refs._unraised(index, errors | {"E123"}, (rules - {"S002"}) | {"R099"}))
    assert any("E123: no error class" in p for p in problems), problems
    assert any("R099: no row" in p for p in problems), problems
    assert any("S002: not in the table of docs/rules.md" in p for p in problems), problems


@pytest.mark.parametrize(
    ("line", "stale"),
    [
        (":mod:`.archive` (zip archives), :mod:`.crcs` (CRC-32)", ".crcs"),
        (":class:`~.metadata.CheckpointMetadata`, :func:`.missing_function`", ".missing_function"),
    ],
)
def test_relative_roles_of_a_module_docstring(doc_refs: ModuleType, index: object, line: str, stale: str) -> None:
    codes: tuple[set[str], set[str]] = (set(), set())
    where = ROOT / "ckpttool" / "format" / "__init__.py"
    problems = list(doc_refs._line_refs(index, where, line, codes))
    assert len(problems) == 1 and stale in problems[0], problems
    assert (
        list(doc_refs._line_refs(index, where, ":mod:`.archive`, :class:`~.metadata.CheckpointMetadata`", codes)) == []
    )
