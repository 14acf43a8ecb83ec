"""Stale references in the docs, the README and the package's docstrings and comments.

Usage: ``python scripts/doc_refs.py`` (from anywhere). Finds, without importing the package:

- dotted names of ckpttool (``ckpttool.ops.export.quantize``, ``:func:`~ckpttool.model.counters.x```,
  ``Catalog.wrapped``, ``mdcache.parse_metadata_cached``, ``ops.fields.OutputOptions``, a docstring's
  ``:mod:`.sibling```, the names listed after a module: ```ckpttool.layouts` (`resolve_layout`)``) whose
  module, class, function or attribute does not exist; Sphinx roles of one name no module defines;
- file paths (``engine/scan.py``, ``native/fp8.c``, ``ops/diff/compare.py::ValueCompare``,
  ``format/hf_storage.check_hf_index``, ``tests/...``, markdown links) that name no file of the repository;
- sections named by title (``docs/export.md``, "Model adapters"; ``docs/design.md`` §5, "One handle") or
  number (§N) that no heading or bold title of the page has;
- error codes (``E204``) not in the table of ``docs/errors.md``, rule codes (``R002``) not in the one of
  ``docs/rules.md``; codes in those tables that nothing raises (no error class of that code constructed by
  the package, no ``@rule`` function, no row of ``rules.json``).

Names that are also state-dict keys, JSON fields or other libraries' (``optimizer.state``, ``torch.load``)
are left alone: it reports no false positives, and so misses a stale name spelled like them.

Exit 1 with one line per stale reference, ``FILE:LINE: what``.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckpttool"

#: First segments of dotted names that are not ckpttool's (state-dict keys, other libraries' objects).
_FOREIGN = {"torch", "np", "numpy", "dcp", "os", "sys", "json", "typer", "rich", "pickle", "shlex", "math"}
_DOTTED = re.compile(r"\b(ckpttool(?:\.\w+)+)(?![\w/:-])")
_BACKTICKED = re.compile(r"`+~?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`+")
#: a Sphinx role naming one name (``:func:`select_sources```).
_ROLE = re.compile(r":(?:func|meth|class|attr|data|exc|obj):`~?([A-Za-z_]\w*)(?:\(\))?`")
_PATH = re.compile(
    r"(?<![\w./-])(?!docs/X\.md)((?:[\w-]+/)+[\w.-]+\.(?:py|c|h|md|json|yaml|toml|txt|sh))(?![\w-])(?:::([\w.]+))?"
)
_BARE = re.compile(r"(?<![\w./-])((?:test|bench)_\w+\.py)(?![\w-])(?:::([\w.]+))?")
#: ``format/hf_storage.check_hf_index``: a module path and a name in it.
_PATH_NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+)\.([A-Za-z_]\w*)(?![\w-])")
_EXTENSIONS = {"py", "c", "h", "md", "json", "yaml", "toml", "txt", "sh", "so", "pt", "pkl", "safetensors", "distcp"}
_CODE = re.compile(r"(?<![\w-])([EOSPLMKDR])(\d{3})(?![\w-])")
_SUBPACKAGES = {"ops", "format", "engine", "ui", "layouts", "optim_state", "cli", "commands"}
#: Module names that are also the words of state-dict keys, JSON fields and local variables.
_WORDS = {"optimizer", "layout", "metadata", "data", "experts", "plan", "reader", "writer", "options", "run", "app"}
_WORDS |= {"output", "stats", "quantized", "multi", "rules", "grads", "compare", "kernel", "checkpoint", "megatron"}
_WORDS |= {"olmo_core", "safetensors", "torch_checkpointing", "verl", "torchtune", "nemo", "lora", "merge", "serving"}
_LINK = re.compile(r"\]\(([\w./-]+\.md)?(?:#([^)]*))?\)")
#: what every kind of reference holds: a line without it is not parsed further.
_ANY = re.compile(r"[`/§]|\]\(|\.md|ckpttool\.|[EOSPLMKDR]\d{3}")
#: a module and the names it is said to hold: "`ckpttool.layouts` (`resolve_layout`, `tensor_geometry`)".
_MODULE_NAMES = re.compile(r"`(ckpttool(?:\.\w+)+)` \(([^()]*)\)")
#: a Sphinx role naming a name relative to the module's package (``:class:`~.base.ModelFormat```).
_RELATIVE_ROLE = re.compile(r":(mod|func|meth|class|attr|data|exc|obj):`~?(\.[\w.]+?)(?:\(\))?`")
#: a page's section named by its title: ``docs/export.md``, "Model adapters"; ``docs/design.md`` §5, "One handle".
_TITLED = re.compile(r'(?:(\w+)\.md`{0,2},?|§(\d+),?) \(?"([^"]+)"')
_SECTION = re.compile(r"design(?:\.md)?`{0,2} §(\d+)")
#: a ``--json`` document's schema id: ``ckpttool.inspect/1``.
_SCHEMA_ID = re.compile(r"\bckpttool\.([a-z][a-z-]*)/(\d+)\b")
_ROOTS = ("", "ckpttool/", "docs/", "ckpttool/engine/")


@dataclass
class Module:
    """What one module of the package defines, read from its syntax tree."""

    names: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)
    lazy: bool = False


@dataclass
class Index:
    """The package's modules, classes and their members."""

    modules: dict[str, Module] = field(default_factory=dict)
    #: every name the package defines: module-level names and class members.
    defined: set[str] = field(default_factory=set)
    #: string constants of the package that start ``ckpttool.``: format names and keys (``ckpttool.layout``).
    identifiers: set[str] = field(default_factory=set)
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def has_member(self, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether some class called ``cls`` (or a base of it) defines ``member``."""
        for members, bases in self.classes.get(cls, []):
            if member in members:
                return True
            for base in bases:
                if base in self.classes:
                    if base not in seen and self.has_member(base, member, seen | {cls}):
                        return True
                elif _foreign_has(base, member):
                    return True
        return False


def _foreign_has(base: str, member: str) -> bool:
    """Whether a base class from outside the package has ``member`` (``True`` where it cannot be told)."""
    import builtins
    import collections.abc
    import enum
    import pickle
    import typing

    name = base.split("[")[0].rsplit(".", 1)[-1]
    for module in (builtins, typing, enum, collections.abc, pickle):
        if hasattr(module, name):
            return hasattr(getattr(module, name), member)
    return True


def _class_members(node: ast.ClassDef) -> set[str]:
    """Its methods, nested classes, class-level names and the ``self.x`` / ``cls.x`` its methods assign."""
    members: set[str] = set()
    for item in _statements(node.body):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                members |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    for item in ast.walk(node):
        if isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
            if isinstance(item.value, ast.Name) and item.value.id in ("self", "cls"):
                members.add(item.attr)
    return members


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module-level statements, also those inside ``if``/``try``/``with`` blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _statements(block)
            for handler in getattr(node, "handlers", []):
                yield from _statements(handler.body)


def _module(tree: ast.Module, name: str, index: Index) -> Module:
    mod = Module()
    for node in _statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.names.add(node.name)
            mod.lazy |= node.name == "__getattr__"
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
            index.classes.setdefault(node.name, []).append((_class_members(node), bases))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        mod.names.add(leaf.id)
                        mod.lazy |= leaf.id == "__getattr__"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: -node.level] if not name.endswith("__init__") else name.split(".")
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                mod.names.add(alias.asname or alias.name)
                mod.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                mod.names.add(alias.asname or alias.name.split(".")[0])
    if mod.lazy:  # a lazy package's names are the strings it lists
        mod.names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return mod


def build_index() -> Index:
    """Read every module of the package (no import)."""
    index = Index()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        text = path.read_text()
        index.modules[name] = _module(ast.parse(text), name, index)
        index.identifiers |= set(re.findall(r"[\"'](ckpttool\.[\w.]+)", text))
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    index.files = listed.stdout.splitlines()
    index.defined = {n for m in index.modules.values() for n in m.names}
    index.defined |= {n for variants in index.classes.values() for members, _ in variants for n in members}
    for path in PACKAGE.rglob("*.so"):  # a built extension module
        index.modules[".".join(path.relative_to(ROOT).parts[:-1] + (path.name.split(".")[0],))] = Module(lazy=True)
    return index


def _resolve(index: Index, dotted: str, depth: int = 0) -> str | None:
    """``None`` where ``ckpttool.x.y`` exists, else the part that does not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        mod = index.modules.get(".".join(parts[:cut]))
        if mod is not None:
            break
    else:
        return dotted
    rest = parts[cut:]
    if not rest:
        return None
    head = rest[0]
    if head not in mod.names and ".".join(parts[:cut] + [head]) not in index.modules:
        return ".".join(parts[: cut + 1])
    if len(rest) == 1:
        return None
    source = mod.imports.get(head)
    if source and source.startswith("ckpttool.") and depth < 5:
        return _resolve(index, ".".join([source, *rest[1:]]), depth + 1)
    if head in index.classes and not index.has_member(head, rest[1]):
        return ".".join(parts[: cut + 2])
    return None


def _short(index: Index, dotted: str) -> str | None:
    """A backticked ``Class.attr`` or ``module.attr`` of the package that does not exist, else ``None``."""
    parts = dotted.split(".")
    head, attr = parts[0], parts[1]
    if head in _FOREIGN:
        return None
    if head in index.classes and head[0].isupper():
        return None if index.has_member(head, attr) else f"{head}.{attr}"
    if head in _SUBPACKAGES and len(parts) > 2:  # ``ops.fields.OutputOptions``
        return _resolve(index, "ckpttool." + dotted)
    modules = [name for name in index.modules if name.rsplit(".", 1)[-1] == head]
    if len(modules) != 1 or head in _WORDS or attr in _EXTENSIONS or head in sys.stdlib_module_names:
        return None
    module = index.modules[modules[0]]
    found = module.lazy or attr in module.names or f"{modules[0]}.{attr}" in index.modules
    return None if found else f"{head}.{attr}"


def _path_exists(index: Index, ref: str, where: Path) -> bool:
    ref = ref.removeprefix("./")
    if (where.parent / ref).exists():
        return True
    if any((ROOT / root / ref).exists() for root in _ROOTS):
        return True
    return any(f.endswith("/" + ref) for f in index.files)


def _ours(ref: str) -> bool:
    first = ref.split("/")[0]
    return first in {"ckpttool", "docs", "tests", "scripts", "bench", "engine", "format", "ops", "model", "native"} | {
        "cli",
        "commands",
        "ui",
        "layouts",
        "optim_state",
        "schemas",
        "adapters",
        "validate",
        "export",
        "diff",
        "replay",
        "stats",
        "reshard",
        "fixtures",
        "security",
    }


def _name_in(index: Index, ref: str, name: str) -> bool:
    path = next((f for f in index.files if f == ref or f.endswith("/" + ref)), None)
    if path is None or not path.endswith(".py"):
        return True
    module = index.modules.get(path.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    if module is None:
        text = (ROOT / path).read_text()
        return re.search(rf"^(def|class)\s+{re.escape(name.split('.')[0])}\b", text, re.M) is not None
    head, _, rest = name.partition(".")
    return head in module.names and (
        not rest or head not in index.classes or index.has_member(head, rest.split(".")[0])
    )


@functools.cache
def _titles(page: Path) -> str:
    """The headings and bold run-in titles of ``page``, lower case, backticks dropped, one a line."""
    text = re.sub(r"`[^`\n]*\*[^`\n]*`", "", page.read_text()).replace("`", "")  # no ``**kwargs`` spans
    titles = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    titles += re.findall(r"\*\*([^*\n]+)\*\*", text)
    return "\n".join(titles).lower()


@functools.cache
def _schema_ids() -> set[str]:
    """The ``schema`` ids of the packaged JSON Schemas (``ckpttool/schemas/*.schema.json``)."""
    return {
        m
        for path in (PACKAGE / "schemas").glob("*.schema.json")
        for m in re.findall(r'"const": "(ckpttool\.[a-z-]+/\d+)"', path.read_text())
    }


@functools.cache
def _anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings as GitHub makes them (lower case, punctuation dropped, ``-`` for spaces)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            anchors.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return anchors


def _has_section(page: Path, title: str) -> bool:
    """Whether a heading or bold title of ``page`` starts or holds ``title``."""
    return title.replace("`", "").lower() in _titles(page)


def _held_names(index: Index, module: str, listed: str) -> Iterator[str]:
    """The names of ``listed`` (backticked identifiers with ``_``) that ``module`` and its submodules lack."""
    if module not in index.modules:
        return
    names = {n for name, m in index.modules.items() if name == module or name.startswith(module + ".") for n in m.names}
    for name in re.findall(r"`([A-Za-z]\w*_\w*)(?:\([^`]*\))?`", listed):
        if name not in names:
            yield name


def _texts() -> Iterator[tuple[Path, str]]:
    yield ROOT / "README.md", (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "docs").glob("*.md")):
        yield path, path.read_text()
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, path.read_text()
    yield PACKAGE / "ops/validate/rules.json", (PACKAGE / "ops/validate/rules.json").read_text()


def _table_codes(doc: Path, pattern: str) -> set[str]:
    return set(re.findall(rf"^\| `?({pattern}\d{{3}})`? \|", doc.read_text(), re.M))


def _line_refs(index: Index, path: Path, line: str, codes: tuple[set[str], set[str]]) -> Iterator[str]:
    """The stale references of one line of ``path``."""
    if not _ANY.search(line):
        return
    yield from _name_refs(index, line)
    if path.suffix == ".py" and path.is_relative_to(PACKAGE):
        yield from _relative_refs(index, path, line)
    yield from _file_refs(index, path, line)
    yield from _section_refs(path, line)
    errors, rules = codes
    for m in _CODE.finditer(line):
        code = m.group(1) + m.group(2)
        if m.group(1) == "E" and code not in errors and code not in {"E000", "E999"}:
            yield f"{code}: not in docs/errors.md"
        elif m.group(1) != "E" and code not in rules:
            yield f"{code}: not in docs/rules.md"


def _name_refs(index: Index, line: str) -> Iterator[str]:
    """Dotted names, ``Class.attr``/``module.attr``, names listed after a module, Sphinx roles of one name."""
    for m in _DOTTED.finditer(line):
        if m.group(1) in index.identifiers:
            continue
        missing = _resolve(index, m.group(1).rstrip("."))
        if missing:
            yield f"`{m.group(1)}`: no {missing}"
    for m in _BACKTICKED.finditer(line):
        if not m.group(1).startswith("ckpttool."):
            missing = _short(index, m.group(1))
            if missing:
                yield f"`{m.group(1)}`: no {missing}"
    for m in _MODULE_NAMES.finditer(line):
        for name in _held_names(index, m.group(1), m.group(2)):
            yield f"`{name}`: not in {m.group(1)}"
    for m in _ROLE.finditer(line):
        if m.group(1) not in index.defined:
            yield f"{m.group(0)}: nothing of the package is called {m.group(1)}"


def _relative_refs(index: Index, path: Path, line: str) -> Iterator[str]:
    """Relative Sphinx roles of a module of the package (``:mod:`.sibling```, ``:class:`~.base.X```)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for m in _RELATIVE_ROLE.finditer(line):
        # a ``.module`` is a sibling; another ``.name`` is looked up as Sphinx does: in this module or its
        # package, else any object whose name so ends
        role, ref = m.group(1), m.group(2)
        first = ref.split(".")[1]
        candidates = [package]
        if role != "mod":
            candidates += [module, *(n for n, mod in index.modules.items() if first in mod.names)]
            candidates += [n.rsplit(".", 1)[0] for n in index.modules if n.endswith("." + first)]
        if all(_resolve(index, c + ref) for c in candidates):
            yield f"`{ref}`: no such name in {package}" + ("" if role == "mod" else " or elsewhere")


def _file_refs(index: Index, path: Path, line: str) -> Iterator[str]:
    """File paths, ``path.py::Name`` and ``dir/module.name``."""
    for m in _PATH_NAME.finditer(line):
        ref, name = m.group(1) + ".py", m.group(2)
        if name not in _EXTENSIONS and _ours(ref) and _path_exists(index, ref, path) and not _name_in(index, ref, name):
            yield f"{m.group(0)}: no {name} in {ref}"
    for m in [*_PATH.finditer(line), *_BARE.finditer(line)]:
        ref, name = m.group(1), m.group(2)
        if "/" in ref and not _ours(ref):
            continue
        if not _path_exists(index, ref, path):
            yield f"{ref}: no such file"
        elif name and not _name_in(index, ref, name):
            yield f"{ref}::{name}: not defined there"


def _section_refs(path: Path, line: str) -> Iterator[str]:
    """Sections by title or number, ``--json`` schema ids, markdown links and their anchors."""
    for m in _TITLED.finditer(line):
        page = ROOT / ("README.md" if m.group(1) == "README" else f"docs/{m.group(1) or 'design'}.md")
        if page.exists() and not _has_section(page, m.group(3)):
            yield f'{page.relative_to(ROOT)}, "{m.group(3)}": no such section'
    for m in _SECTION.finditer(line):
        if not _has_section(ROOT / "docs/design.md", f"§{m.group(1)} "):
            yield f"docs/design.md §{m.group(1)}: no such section"
    for m in _SCHEMA_ID.finditer(line):
        if m.group(0) not in _schema_ids():
            yield f"{m.group(0)}: no JSON Schema in ckpttool/schemas/ has this id"
    for m in _LINK.finditer(line):
        page = path.parent / m.group(1) if m.group(1) else path
        if not page.exists():
            yield f"{m.group(1)}: no such page beside {path.name}"
        elif m.group(2) and page.suffix == ".md" and m.group(2) not in _anchors(page):
            yield f"{m.group(1) or ''}#{m.group(2)}: no such heading in {page.name}"


def _unraised(index: Index, errors: set[str], rules: set[str]) -> Iterator[str]:
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "errors.py")
    constructed = set(re.findall(r"\b(\w+)\(", source))  # a class called: raised, or made to be raised
    declared = dict(re.findall(r'^class (\w+)\(.*code="(E\d{3})"', (PACKAGE / "errors.py").read_text(), re.M))
    by_code = {code: cls for cls, code in declared.items()}
    for code in sorted(errors):
        cls = by_code.get(code)
        if cls is None:
            yield f"docs/errors.md: {code}: no error class has this code"
        elif cls not in constructed and f'"{code}"' not in source:
            yield f"docs/errors.md: {code}: {cls} is never raised"
    for code in sorted(set(by_code) - errors):
        yield f"ckpttool/errors.py: {code}: not in the table of docs/errors.md"
    table = json.loads((PACKAGE / "ops/validate/rules.json").read_text())
    decorated = set(re.findall(r'@rule\(\s*"([A-Z]\d{3})"', source))
    for code in sorted(rules):
        if code not in table:
            yield f"docs/rules.md: {code}: no row in ckpttool/ops/validate/rules.json"
        elif code not in decorated and f'"{code}"' not in source:
            yield f"docs/rules.md: {code}: no rule raises it"
    for code in sorted(set(table) - rules):
        yield f"ckpttool/ops/validate/rules.json: {code}: not in the table of docs/rules.md"


def main() -> int:
    index = build_index()
    errors = _table_codes(ROOT / "docs/errors.md", "E")
    rules = _table_codes(ROOT / "docs/rules.md", "[SOPLMKDR]")
    # codes rules.md defines in its text, not its table (replay-step's verdicts: "**`R003` update size**")
    verdicts = set(re.findall(r"\*\*`([SOPLMKDR]\d{3})`", (ROOT / "docs/rules.md").read_text()))
    problems = list(_unraised(index, errors, rules))
    for path, text in _texts():
        for number, line in enumerate(text.splitlines(), 1):
            for problem in _line_refs(index, path, line, (errors, rules | verdicts)):
                problems.append(f"{path.relative_to(ROOT)}:{number}: {problem}")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
