"""Structural rules CI holds beside import-linter (``docs/design.md`` §5). Usage: ``python scripts/structure_check.py``.

- Function size: no function of the package over 80 lines or cyclomatic complexity 25.
- One read helper: ``os.pread``/``os.preadv`` only in ``ckpttool/engine/`` and the archive
  window's file-object ``readinto`` (one read, which may be short).
- One pool: ``ThreadPoolExecutor`` and ``threading.Thread`` only in ``ckpttool/engine/``.

Exit 1 with one line per violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ckpttool"
MAX_LINES, MAX_COMPLEXITY = 80, 25
READ_SITES = ("engine/", "format/archive.py")
POOL_SITES = ("engine/",)
_BRANCHES = (
    ast.If,
    ast.For,
    ast.While,
    ast.AsyncFor,
    ast.IfExp,
    ast.ExceptHandler,
    ast.Assert,
    ast.comprehension,
    ast.match_case,
)


def complexity(fn: ast.AST) -> int:
    """McCabe's cyclomatic complexity of a function, nested functions included (as radon counts decisions)."""
    n = 1
    for node in ast.walk(fn):
        if isinstance(node, _BRANCHES):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
    return n


def _called(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f"{f.value.id}.{f.attr}"
    return f.id if isinstance(f, ast.Name) else ""


def check_file(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            cc = complexity(node)
            if lines > MAX_LINES or cc > MAX_COMPLEXITY:
                problems.append(f"{rel}:{node.lineno}: {node.name} has {lines} lines, complexity {cc}")
        elif isinstance(node, ast.Call):
            name = _called(node)
            if name in ("os.pread", "os.preadv") and not rel.startswith(READ_SITES):
                problems.append(f"{rel}:{node.lineno}: {name} outside the engine's read helper")
            if name in ("ThreadPoolExecutor", "threading.Thread") and not rel.startswith(POOL_SITES):
                problems.append(f"{rel}:{node.lineno}: {name} outside the engine's pool")
    return problems


def main() -> int:
    problems = [p for path in sorted(ROOT.rglob("*.py")) for p in check_file(path)]
    print("\n".join(problems) or "structure: functions within size, reads and threads in the engine")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
