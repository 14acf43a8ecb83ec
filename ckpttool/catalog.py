"""Deprecated alias of :mod:`ckpttool.model.catalog` (kept for one release): ``from ckpttool.catalog import build_catalog``."""

import warnings

from ckpttool.model.catalog import Catalog, build_catalog

warnings.warn("ckpttool.catalog is deprecated: import from ckpttool.model", DeprecationWarning, stacklevel=2)

__all__ = ["Catalog", "build_catalog"]
