"""The name of ckpttool's manifest file and how its first bytes are recognised: the part of the manifest
format (``ckpttool.ops.manifest``, ``docs/diff.md``) that readers below the operations need, such as a
per-rank folder's check for files left unread (a manifest written beside the rank files is the tool's own)."""

from __future__ import annotations

import re

__all__ = ["MANIFEST_FORMAT", "MANIFEST_NAME", "is_manifest_head"]

#: The manifest document's ``format`` field, its first field as written.
MANIFEST_FORMAT = "ckpttool.manifest"
#: The file ``ckpttool manifest DIR`` writes by default (beside ``.metadata``).
MANIFEST_NAME = "manifest.json"

_HEAD = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + re.escape(MANIFEST_FORMAT.encode()) + rb'"')


def is_manifest_head(head: bytes) -> bool:
    """Whether ``head``, the first bytes of a file, begin a manifest ckpttool wrote (``"format": "ckpttool.manifest"``)."""
    return _HEAD.match(head) is not None
