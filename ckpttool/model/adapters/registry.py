"""The model-adapter registry: each adapter module registers its class and its detection predicate.

:func:`register_adapter` (a class decorator) adds an adapter under its ``name``;
:func:`detect_adapter` asks every registered adapter's :meth:`ModelAdapter.detects` and
takes the one that claims the checkpoint (no built-in order of families). The order of
registration is the order ``--adapter`` lists the names in (:func:`adapter_metavar`).
Its public names are declared once, in the package's ``__all__`` (:mod:`ckpttool.model.adapters`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import UsageError
from ckpttool.model.adapters.base import AdapterConfig, ModelAdapter

#: name -> adapter class, in registration order (the order ``--adapter`` lists them).
ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Register adapter class ``cls`` under ``cls.name`` (a class decorator); a name is registered once."""
    assert cls.name and cls.name not in ADAPTERS, f"adapter {cls.name!r} registered twice"
    ADAPTERS[cls.name] = cls
    return cls


@dataclass
class Evidence:
    """What detection looks at: the key schema's naming, the model fqns and the HF ``config.json``.

    Attributes:
        naming: ``KeySchema.naming`` (``"hf"``, ``"torchtitan"``, ``"unknown"``).
        fqns: the model fqns (read only; 10^6 of them: :meth:`any_fqn_contains` scans once per question).
        model_type: the config's ``model_type`` (``None``: no config, or none given).
    """

    naming: str
    fqns: Sequence[str]
    model_type: str | None
    _seen: dict[tuple[str, ...], bool] = field(default_factory=dict, repr=False)

    def any_fqn_contains(self, *fragments: str) -> bool:
        """Whether some fqn contains one of ``fragments`` (answered once per set of fragments)."""
        hit = self._seen.get(fragments)
        if hit is None:
            hit = self._seen[fragments] = any(any(f in fqn for f in fragments) for fqn in self.fqns)
        return hit


def get_adapter(name: str) -> ModelAdapter:
    """The registered adapter ``name``.

    Raises:
        UsageError: an unknown name (the message lists the registered ones).
    """
    cls = ADAPTERS.get(name)
    if cls is None:
        raise UsageError(
            f"`adapter` {name!r} is not one of {', '.join(ADAPTERS)}",
            param="adapter",
            hint="omit it to detect the adapter from the checkpoint's key names",
        )
    return cls()


def detect_adapter(naming: str, fqns: Sequence[str], config: dict[str, Any] | None = None) -> ModelAdapter | None:
    """The adapter that claims a checkpoint whose model fqns follow ``naming`` (``KeySchema.naming``).

    Each registered adapter's :meth:`~ModelAdapter.detects` is asked; ``None`` when none claims it
    (unknown naming, or a config of another family). The predicates are disjoint.
    """
    ev = Evidence(naming, fqns, AdapterConfig.from_hf_config(config).model_type)
    claims = [cls for cls in ADAPTERS.values() if cls.detects(ev)]
    assert len(claims) <= 1, f"adapters {[c.name for c in claims]} all claim the checkpoint"
    return claims[0]() if claims else None


def adapters_by_config(naming: str, fqns: Sequence[str]) -> list[tuple[str, str]]:
    """``(adapter name, config model_type)`` of the adapters that claim a checkpoint of these names only given an HF
    config of that ``model_type`` (``[]`` where one claims it without a config): OLMo-core's, whose keys do not say
    where the norms sit. ``export`` picks one by the ``model_assets`` config.json's ``model_type``, or ``adapter``."""
    if detect_adapter(naming, fqns) is not None:
        return []
    ev = Evidence(naming, fqns, None)  # one Evidence: its fqn scans are answered once for every model type
    out: list[tuple[str, str]] = []
    for model_type in dict.fromkeys(t for cls in ADAPTERS.values() for t in cls.config_model_types()):
        ev.model_type = model_type
        out.extend((cls.name, model_type) for cls in ADAPTERS.values() if cls.detects(ev))
    return out


def import_adapters(schema: str | None = None, *, identity: bool = True) -> dict[str, type[ModelAdapter]]:
    """The adapters ``ckpttool import`` writes through (:attr:`ModelAdapter.import_schema` set), in registration order.

    ``schema``: only those of that import ``--schema``; ``identity`` False: without ``hf``.
    """
    return {
        n: cls
        for n, cls in ADAPTERS.items()
        if cls.import_schema is not None
        and (schema is None or cls.import_schema == schema)
        and (identity or not cls.identity)
    }


def adapter_metavar(*, identity: bool = True, importable: bool = False) -> str:
    """``<name|name|...>`` of the registered adapters for a CLI option.

    ``identity`` False: without ``hf``; ``importable``: only those ``import`` writes through (:func:`import_adapters`).
    """
    pool = import_adapters() if importable else ADAPTERS
    return "<" + "|".join(n for n, cls in pool.items() if identity or not cls.identity) + ">"
