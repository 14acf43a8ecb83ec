"""The package layout the project was specified with holds its jobs, and the metadata-only layers import no torch."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from ckpttool.cli.app import COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_lives_in_ckpttool_commands(name: str) -> None:
    module = importlib.import_module(f"ckpttool.commands.{'import_hf' if name == 'import' else name.replace('-', '_')}")
    assert callable(getattr(module, f"{name.replace('-', '_')}_command"))


def test_the_optimizer_state_and_layout_packages_hold_their_jobs() -> None:
    from ckpttool.layouts import LayoutDeclaration, LayoutRecord, resolve_layout
    from ckpttool.layouts.permute import legacy_to_canonical_perm
    from ckpttool.optim_state import CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW, build_optimizer, reference
    from ckpttool.optim_state.schema import OPTIMIZER_TYPES, expected_state_dtypes

    assert {"adamw", "full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw"} <= set(OPTIMIZER_TYPES)
    assert expected_state_dtypes("full_fp32_adamw", None, "bfloat16")["master_weight"] == "float32"
    assert legacy_to_canonical_perm(4, 2, 2) == [0, 2, 1, 3]
    assert callable(reference.reference_adamw_step)
    assert all(callable(x) for x in (LayoutDeclaration, LayoutRecord, resolve_layout, build_optimizer))
    assert all(isinstance(c, type) for c in (CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW))


def test_metadata_only_layers_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import ckpttool.model.catalog, ckpttool.model.schemas.registry, ckpttool.layouts.declaration\n"
        "import ckpttool.optim_state.schema, ckpttool.optim_state\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_positional_reads_outside_the_engine_are_the_archive_windows_only() -> None:
    """``os.pread``/``os.preadv`` are the engine's (``engine/io.py``): the safetensors header reader and
    writer's read-back use its helpers; only the archive window's file-object ``readinto`` reads itself."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "ckpttool"
    sites = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "os":
                if f.attr in ("pread", "preadv", "pwrite") and not rel.startswith("engine/"):
                    sites.add(rel)
    assert sites == {"format/archive.py"}


def test_the_optimizer_type_choices_are_the_optimizer_state_schemas() -> None:
    """`sample --optimizer-type` and `replay-step --optimizer-type` offer the types of one list
    (`ckpttool.optim_state.schema.OPTIMIZER_TYPES`), not copies of it."""
    from ckpttool.commands.replay_step import OptimizerChoice
    from ckpttool.commands.sample import SampleOptimizer
    from ckpttool.ops.sample import SAMPLE_OPTIMIZERS
    from ckpttool.optim_state.schema import OPTIMIZER_TYPES

    assert SAMPLE_OPTIMIZERS is OPTIMIZER_TYPES
    assert [c.value for c in SampleOptimizer] == list(OPTIMIZER_TYPES)
    assert [c.value for c in OptimizerChoice] == ["auto", *OPTIMIZER_TYPES]


def test_the_float8_dtypes_are_one_list() -> None:
    """Every float8 dtype the dtype table knows is in `FLOAT8_DTYPES`, and the floating set, the writer's
    v3-archive dtypes and validate's low-precision steps are built from it."""
    from ckpttool.format.metadata import DTYPE_ITEMSIZE, FLOAT8_DTYPES, FLOATING_DTYPES
    from ckpttool.format.writer import _V3_DTYPES
    from ckpttool.ops.validate.rules.optimizer import LOW_PRECISION

    assert FLOAT8_DTYPES == tuple(d for d in DTYPE_ITEMSIZE if d.startswith("float8_"))
    assert FLOATING_DTYPES == {"float64", "float32", "float16", "bfloat16", *FLOAT8_DTYPES}
    assert _V3_DTYPES == {*FLOAT8_DTYPES, "uint16", "uint32", "uint64"}
    assert LOW_PRECISION == ("bfloat16", "float16", *FLOAT8_DTYPES)


def test_the_optimizer_state_public_api_block_of_the_docs_imports_as_written() -> None:
    """``docs/optim_state.md``'s import block runs verbatim, and ``__all__`` names exactly what it imports."""
    import re
    from pathlib import Path

    import ckpttool.optim_state as optim_state

    text = (Path(__file__).resolve().parent.parent / "docs" / "optim_state.md").read_text()
    block = re.search(r"```python\n(from ckpttool\.optim_state import \(.*?\)\n)", text, re.S)
    assert block is not None
    namespace: dict[str, object] = {}
    exec(block.group(1), namespace)
    names = set(re.findall(r"\b(\w+),", block.group(1).split("(", 1)[1]))
    assert names == set(optim_state.__all__)
    assert (
        namespace["infer_optimizer_type"]({"step": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}) == "adamw"
    )


def test_every_options_class_docs_design_md_names_is_public_with_its_operation() -> None:
    """docs/design.md §5 "Results" names each operation's ``XOptions``; each one, and the operation that takes it, is
    an attribute of ``ckpttool`` (README: everything a command does is callable from Python). ``StatsOptions`` and
    ``collect_stats`` were missing."""
    from pathlib import Path

    import ckpttool

    text = " ".join((Path(__file__).parents[1] / "docs" / "design.md").read_text().split())
    results = text[text.index("- **Results.**") :]
    named = [n for n in re.findall(r"`(\w+Options)`", results[: results.index("returns a frozen")]) if n != "XOptions"]
    assert len(named) >= 11 and set(named) <= set(ckpttool.__all__), named
    operations = {"Inspect": "inspect", "Validate": "validate", "Export": "export_checkpoint", "Reshard": "reshard"}
    operations |= {"Replay": "replay_step", "Diff": "diff_checkpoints", "Stamp": "stamp", "Manifest": "write_manifest"}
    operations |= {"Import": "import_hf", "Sample": "write_sample", "Stats": "collect_stats"}
    assert {n.removesuffix("Options") for n in named} == set(operations)
    for name, op in operations.items():
        result = "ValidationResult" if name == "Validate" else f"{name}Result"
        assert callable(getattr(ckpttool, op)) and result in ckpttool.__all__, name


def test_every_public_operation_returns_a_public_class() -> None:
    """Each function of ``ckpttool.__all__`` returns a class that is itself an attribute of ``ckpttool``, so a caller can
    annotate and ``isinstance``-check what it gets (``check_against_manifest`` returned a ``ManifestCheck`` reachable
    only from ``ckpttool.ops.manifest``)."""
    import inspect

    import ckpttool

    functions = [n for n in ckpttool.__all__ if inspect.isfunction(getattr(ckpttool, n))]
    assert len(functions) >= 14, functions
    for name in functions:
        returned = inspect.signature(getattr(ckpttool, name)).return_annotation
        assert isinstance(returned, str) and returned in ckpttool.__all__, (name, returned)
        assert getattr(ckpttool, returned).__name__ == returned, name


def test_docs_design_md_layers_are_the_import_linter_contract_and_the_package_tree() -> None:
    """docs/design.md §5: its layer order is pyproject's import-linter ``layers`` contract, and its tree lists each
    package of ``ckpttool`` (and ``errors.py``) and nothing that is not there."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    text = (root / "docs" / "design.md").read_text()
    order = re.search(r"The layers, top to bottom: (.*?)\. Each imports", " ".join(text.split()))
    assert order is not None
    layers = [[n.split()[0].strip("`") for n in part.split("|")] for part in order.group(1).split(" > ")]
    contract = re.search(r'type = "layers"\nlayers = \[(.*?)\]', (root / "pyproject.toml").read_text(), re.S)
    assert contract is not None
    assert [[f"ckpttool.{n}" for n in names] for names in layers] == [
        [m.strip() for m in layer.split("|")] for layer in re.findall(r'"([^"]+)"', contract.group(1))
    ]
    tree = text[text.index("## §5 Layers") :]
    tree = tree[tree.index("```\nckpttool/\n") : tree.index("```", tree.index("```\nckpttool/\n") + 3)]
    listed = set(re.findall(r"^  (\w+)(?:/|\.py)", tree, re.M))
    packages = {p.name for p in (root / "ckpttool").iterdir() if p.is_dir() and not p.name.startswith("_")}
    packages = {n for n in packages if n != "schemas" and (root / "ckpttool" / n / "__init__.py").exists()} | {
        "schemas"
    }
    assert listed == packages | {"errors"}
