"""The registered key schemas, in priority order: the one place detection, discovery and the CLI ask.

The built-in schemas (one module each in this package, its ``SPEC`` in the tuple at the end
of this module) are registered at import; :func:`register` adds another (one module with a
:class:`~ckpttool.model.schemas.base.SchemaSpec`), :func:`unregister` removes it. What the
specs contribute together (training-state items, optimizer heads, step-directory names, fused
parameters) is derived once per change of the registry (:func:`derived`). Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ckpttool.model.schemas import (
    app_state,
    megatron,
    nemo,
    olmo_core,
    top_level,
    torch_checkpointing,
    torch_native,
    torchtitan,
    torchtune,
    verl,
)
from ckpttool.model.schemas.base import (
    GENERIC_DISCOVERY,
    GENERIC_TRAINING_STATE_ITEMS,
    Discovery,
    SchemaSpec,
)

__all__ = [
    "Derived",
    "derived",
    "find",
    "get",
    "import_targets",
    "names",
    "register",
    "schema_table",
    "specs",
    "unregister",
]

_SPECS: list[SchemaSpec] = []


@dataclass(frozen=True)
class Derived:
    """What the registered specs contribute together.

    Attributes:
        training_state_items: top-level training-state item names (generic ones and every spec's).
        optimizer_heads: top-level names of optimizer state dicts (every spec's, first-seen order).
        containers: ``(container, spec)`` of the specs whose model is nested (``container`` non-empty), in priority order.
        fixed_prefixes: model prefixes of the specs without a wildcard container, deduplicated, in priority order.
        step_re: the step-directory regex (``<word>[-_]?<N>``, case-insensitive, ``N`` ASCII digits; use ``match``).
        discovery: every spec's :class:`~ckpttool.model.schemas.base.Discovery` and the generic one, merged: each
            field's items in priority order, repeats dropped (latest files, folder pairs, step folders, markers, ...).
        staging_prefixes: ``(prefix, step words)``: how a staged step directory's name starts, for the step words of
            the spec declaring it (the merged discovery lists the prefixes alone).
        fused_rules: every spec's fused-parameter rules.
    """

    training_state_items: frozenset[str]
    optimizer_heads: tuple[str, ...]
    containers: tuple[tuple[tuple[str | None, ...], SchemaSpec], ...]
    fixed_prefixes: tuple[str, ...]
    step_re: re.Pattern[str]
    discovery: Discovery
    staging_prefixes: tuple[tuple[str, tuple[str, ...]], ...]
    fused_rules: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...]


_DERIVED: list[Derived] = []


def register(spec: SchemaSpec) -> None:
    """Add ``spec`` (asked after the specs of lower or equal :attr:`~SchemaSpec.priority`).

    Raises:
        ValueError: a spec of that name is registered already.
    """
    if any(s.name == spec.name for s in _SPECS):
        raise ValueError(f"key schema {spec.name!r} is registered already")
    _SPECS.append(spec)
    _SPECS.sort(key=lambda s: s.priority)  # stable: ties keep registration order
    _DERIVED.clear()


def unregister(name: str) -> SchemaSpec:
    """Remove the spec named ``name`` and return it.

    Raises:
        KeyError: no spec of that name.
    """
    spec = get(name)
    _SPECS.remove(spec)
    _DERIVED.clear()
    return spec


def specs() -> tuple[SchemaSpec, ...]:
    """The registered specs, in priority order."""
    return tuple(_SPECS)


def names() -> tuple[str, ...]:
    """The registered schema names, in priority order (the ``--schema`` choices)."""
    return tuple(s.name for s in _SPECS)


def get(name: str) -> SchemaSpec:
    """The spec named ``name``.

    Raises:
        KeyError: no spec of that name.
    """
    spec = find(name)
    if spec is None:
        raise KeyError(name)
    return spec


def find(name: str) -> SchemaSpec | None:
    """The spec named ``name``, or ``None`` (a schema given by its prefixes alone has none)."""
    return next((s for s in _SPECS if s.name == name), None)


def import_targets() -> tuple[SchemaSpec, ...]:
    """The specs ``ckpttool import`` can write (:attr:`~SchemaSpec.import_help` given), in priority order."""
    return tuple(s for s in _SPECS if s.import_help is not None)


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _merged(discovery: list[Discovery]) -> Discovery:
    """One :class:`Discovery` holding every item of ``discovery``'s, in order, repeats dropped."""
    return Discovery(
        **{f.name: tuple(dict.fromkeys(x for d in discovery for x in getattr(d, f.name))) for f in fields(Discovery)}
    )


def derived() -> Derived:
    """What the registered specs contribute together (rebuilt after :func:`register` / :func:`unregister`)."""
    if _DERIVED:
        return _DERIVED[0]
    all_discovery = [*(s.discovery for s in _SPECS), GENERIC_DISCOVERY]
    merged = _merged(all_discovery)
    d = Derived(
        training_state_items=frozenset(GENERIC_TRAINING_STATE_ITEMS).union(*(s.training_state_items for s in _SPECS)),
        optimizer_heads=_unique([h for s in _SPECS for h in s.optimizer_heads]),
        containers=tuple((s.container, s) for s in _SPECS if s.container),
        fixed_prefixes=_unique([s.model_prefix for s in _SPECS if None not in s.container]),
        # ASCII digits only, to the end of the name (``$`` also matches before a trailing newline)
        step_re=re.compile(rf"(?:{'|'.join(map(re.escape, merged.step_words))})[-_]?([0-9]+)\Z", re.I),
        discovery=merged,
        staging_prefixes=tuple(dict.fromkeys((x, d.step_words) for d in all_discovery for x in d.staging_prefixes)),
        fused_rules=tuple(r for s in _SPECS for r in s.fused_rules),
    )
    _DERIVED.append(d)
    return d


def schema_table() -> str:
    """The ``docs/design.md`` §2 table of the registered schemas (markdown, one row per spec)."""
    rows = ["| schema | model tensors | optimizer state | written by |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.doc_model} | {s.doc_optimizer} | {s.doc_written_by} |" for s in _SPECS]
    return "\n".join(rows) + "\n"


for _spec in (
    torch_native.SPEC,
    app_state.SPEC,
    torchtitan.SPEC,
    megatron.SPEC,
    top_level.SPEC,
    verl.SPEC,
    torch_checkpointing.SPEC,
    olmo_core.SPEC,
    nemo.SPEC,
    torchtune.SPEC,
):
    register(_spec)
