"""JSON from untrusted files (``layout.json``, ``config.json``, references, safetensors headers), bounded.

``json.loads`` recurses once per nesting level (100,000 ``[`` raise ``RecursionError``), turns a
10,000-digit number into an int that no later ``str()`` or ``float()`` can handle, and builds
whatever fits in memory. :func:`parse_json` maps each of those to its own error and then walks
the document with the same bounds as unpickled objects (:func:`~ckpttool.format.unpickler.check_object_graph`).
:func:`unique_pairs` is the duplicate-key policy of documents whose keys must be unique
(safetensors headers): refused, never last-one-wins.
"""

from __future__ import annotations

import json
from typing import Any

from ckpttool.errors import CkptError, IntegerRangeError, JsonDepthError, ObjectGraphError
from ckpttool.format import limits
from ckpttool.format.unpickler import check_object_graph

__all__ = ["DuplicateKeyError", "check_json_graph", "json_error", "parse_json", "unique_pairs"]


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (raised by :func:`unique_pairs`)."""


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads`` that refuses a key given twice in one object.

    Raises:
        DuplicateKeyError: ``duplicate key 'k'`` (the key's repr cut at 80 characters).
    """
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"duplicate key {k!r:.80}")
        out[k] = v
    return out


def json_error(e: ValueError | RecursionError, source: str) -> CkptError | None:
    """The error :func:`parse_json` names for a failed ``json.loads`` of ``source``.

    Returns:
        :class:`JsonDepthError` (nested too deeply), :class:`IntegerRangeError` (a number too
        long to convert), or ``None`` for text that is not JSON (``json.JSONDecodeError``,
        ``UnicodeDecodeError``, :class:`DuplicateKeyError`): the caller names its own error.
    """
    if isinstance(e, RecursionError):
        return JsonDepthError(f"{source}: JSON nested too deeply to read", path=source)
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError, DuplicateKeyError)):
        return None
    # "Exceeds the limit (4300 digits) for integer string conversion"
    return IntegerRangeError(f"{source}: JSON holds a number too long to read ({str(e)[:60]})", path=source)


def check_json_graph(obj: Any, source: str) -> Any:
    """``obj`` (a decoded JSON document) when it is within the object-graph bounds.

    Raises:
        JsonDepthError: nested deeper or larger than :attr:`Limits.max_depth` /
            :attr:`Limits.max_pickle_nodes`.
        IntegerRangeError: an int beyond :data:`~ckpttool.format.unpickler.MAX_INT_BITS` bits.
    """
    try:
        return check_object_graph(obj, source)
    except ObjectGraphError as e:
        raise JsonDepthError(f"{e.message} (JSON: at most {limits.current().max_depth} levels)", path=source) from None


def parse_json(data: bytes | str, source: str, *, unique_keys: bool = False) -> Any:
    """Parse a JSON document from an untrusted file.

    Args:
        data: the file's bytes (UTF-8) or text.
        source: the file as named in messages.
        unique_keys: refuse a key given twice in one object (:func:`unique_pairs`) instead of keeping the last.

    Raises:
        JsonDepthError: nested deeper or larger than :attr:`Limits.max_depth` /
            :attr:`Limits.max_pickle_nodes`.
        IntegerRangeError: a number with more digits than Python converts, or beyond
            :data:`~ckpttool.format.unpickler.MAX_INT_BITS` bits.
        json.JSONDecodeError, UnicodeDecodeError: not JSON; callers name their own error.
        DuplicateKeyError: ``unique_keys`` and a key given twice; callers name their own error.
    """
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    try:
        obj = json.loads(text, object_pairs_hook=unique_pairs if unique_keys else None)
    except (ValueError, RecursionError) as e:
        mapped = json_error(e, source)
        if mapped is None:
            raise
        raise mapped from (None if isinstance(e, RecursionError) else e)
    return check_json_graph(obj, source)
