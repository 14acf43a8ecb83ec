"""Deprecated alias of :mod:`ckpttool.format` (kept for one release): ``from ckpttool.dcp import CheckpointReader``."""

import warnings

from ckpttool.format import CheckpointDir, CheckpointReader, load_metadata, parse_metadata_bytes

warnings.warn("ckpttool.dcp is deprecated: import from ckpttool.format", DeprecationWarning, stacklevel=2)

__all__ = ["CheckpointDir", "CheckpointReader", "load_metadata", "parse_metadata_bytes"]
