"""Caps on the work one untrusted input may cause, checked before anything is read or inflated.

Every reader asks this module how much it may read or build and refuses past it with
:class:`~ckpttool.errors.SizeLimitError` (``E307``) or
:class:`~ckpttool.errors.ObjectGraphError` (``E306``) before the work is done (sparse files,
inflation bombs, pickle/JSON DAG bombs). The caps hold process-wide (the CLI's
``--max-metadata-size/--max-object-size``; :func:`set_limits` or :func:`limits` in the
library). Tensor chunks are not capped here: their size comes from ``.metadata`` and is checked
against the stored bytes before allocation. ``docs/design.md`` §6; ``docs/security.md``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ckpttool.format.settings import ProcessSetting

__all__ = ["Limits", "current", "set_limits", "limits", "human", "metadata_record_cap", "BYTES_PER_METADATA_RECORD"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """The caps (bytes, counts).

    Attributes:
        max_metadata_bytes: size of a ``.metadata`` file (10^6 entries are ~140 MB).
        max_object_bytes: a byte item, an ``extra_state`` file, a decompressed ``data.pkl``,
            a JSON file (``layout.json``, ``config.json``, an ``--against`` reference), an
            ``--model-assets`` file is not capped (it is copied, never parsed).
        max_pickle_nodes: containers and values of one unpickled object, counted as a tree
            (a shared sub-list counts once per reference: that is how every consumer walks it);
            refused past it only when the tree is also 16x what the object holds (a DAG bomb).
        max_depth: nesting depth of an unpickled object or a JSON document.
        max_tensor_pickle_bytes: ``data.pkl`` of one tensor chunk archive (torch writes ~200 bytes).
        max_archive_members: members of one ``torch.save`` archive.
    """

    max_metadata_bytes: int = 1 * GiB
    max_object_bytes: int = 256 * MiB
    max_pickle_nodes: int = 1_000_000
    max_depth: int = 100
    max_tensor_pickle_bytes: int = 1 * MiB
    max_archive_members: int = 1 << 16


_SETTING = ProcessSetting(Limits())


def current() -> Limits:
    """The caps in force."""
    return _SETTING.value


def set_limits(**changes: int) -> Limits:
    """Replace some caps for the rest of the process (``set_limits(max_object_bytes=2 << 30)``).

    Returns:
        The previous :class:`Limits`.

    Raises:
        ValueError: a cap that is not a positive int.
        TypeError: an unknown name.
    """
    return _SETTING.replace(**changes)


def limits(**changes: int) -> contextlib.AbstractContextManager[Limits]:
    """Caps changed for the body only (not thread-local: set them before starting workers)."""
    return _SETTING.scoped(**changes)


#: Bytes of ``--max-metadata-size`` per record a ``.metadata`` may build (see :func:`metadata_record_cap`).
BYTES_PER_METADATA_RECORD = 128


def metadata_record_cap() -> int:
    """The most records (dataclass objects, chunks, storage items) one ``.metadata`` may build.

    One per :data:`BYTES_PER_METADATA_RECORD` bytes of :attr:`Limits.max_metadata_bytes`
    (8,388,608 at the 1 GiB default; a 10^6-entry save builds ~5 x 10^6). Parsing costs
    ~250 bytes of memory per record, and a pickle can build one from ~5 bytes (a shared
    object referenced again), so the file-size cap alone does not bound the work: a
    10^7-chunk ``.metadata`` is refused by this count before it is unpickled or converted.
    ``--max-metadata-size`` raises both caps.
    """
    return _SETTING.value.max_metadata_bytes // BYTES_PER_METADATA_RECORD


def human(n: int) -> str:
    """``268435456`` -> ``'256 MiB'`` for cap messages."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"
