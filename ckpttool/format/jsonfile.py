"""JSON from untrusted files (``layout.json``, ``config.json``, references, safetensors headers), bounded.

``json.loads`` recurses once per nesting level (100,000 ``[`` raise ``RecursionError``), turns a
10,000-digit number into an int that no later ``str()`` or ``float()`` can handle, and builds
whatever fits in memory. :func:`parse_json` maps each of those to its own error and then walks
the document with the same bounds as unpickled objects (:func:`~ckpttool.format.unpickler.check_object_graph`).
"""

from __future__ import annotations

import json
from typing import Any

from ckpttool.errors import IntegerRangeError, JsonDepthError, ObjectGraphError
from ckpttool.format import limits
from ckpttool.format.unpickler import check_object_graph

__all__ = ["parse_json"]


def parse_json(data: bytes | str, source: str) -> Any:
    """Parse a JSON document from an untrusted file.

    Args:
        data: the file's bytes (UTF-8) or text.
        source: the file as named in messages.

    Raises:
        JsonDepthError: nested deeper or larger than :attr:`Limits.max_depth` /
            :attr:`Limits.max_pickle_nodes`.
        IntegerRangeError: a number with more digits than Python converts, or beyond
            :data:`~ckpttool.format.unpickler.MAX_INT_BITS` bits.
        json.JSONDecodeError, UnicodeDecodeError: not JSON; callers name their own error.
    """
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    try:
        obj = json.loads(text)
    except RecursionError:
        raise JsonDepthError(f"{source}: JSON nested too deeply to read", path=source) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise IntegerRangeError(f"{source}: JSON holds a number too long to read ({str(e)[:60]})", path=source) from e
    try:
        return check_object_graph(obj, source)
    except ObjectGraphError as e:
        raise JsonDepthError(f"{e.message} (JSON: at most {limits.current().max_depth} levels)", path=source) from None
