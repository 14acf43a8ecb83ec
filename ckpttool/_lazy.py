"""Lazy package attributes: ``import ckpttool`` (or a subpackage) imports none of its modules until a name is used.

Start-up time is a feature of a CLI: ``ckpttool inspect`` must not import torch, numpy or the
export machinery it does not run (``docs/design.md`` §9).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, where: Mapping[str, str], names: list[str], *, submodules: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` (PEP 562) that load ``where[name]`` on first use.

    Args:
        package: the package's ``__name__``.
        where: public name -> the module that defines it.
        names: the package's ``__all__``.
        submodules: names that are the package's own submodules, imported on first use.

    Returns:
        ``(__getattr__, __dir__)``; a loaded name is stored in the package's namespace, so
        ``__getattr__`` runs once per name. An unknown name raises ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
