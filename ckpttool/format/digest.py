"""Strong digests of stored bytes (integrity manifests), one place for the algorithms.

``xxh3-128`` (xxHash's XXH3, 128-bit, by Yann Collet; the ``xxhash`` package) is the default:
faster on one core than the page cache delivers a checkpoint, with a 2^-128 accidental
collision probability. It is not a cryptographic hash: it detects damage (bit rot, truncated
copies, a file replaced by another run's), not a forger who can rewrite the manifest too.
``blake3`` (the BLAKE3 reference implementation's Python binding) and ``blake2b`` (stdlib
``hashlib``) are slower, cryptographic choices (``--hash``; ``docs/performance.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Hasher", "new_hasher", "digest_bytes"]

DEFAULT_ALGORITHM = "xxh3-128"


class Hasher(Protocol):
    """The hashlib-style object every algorithm returns."""

    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


def _xxh3() -> Hasher:
    import xxhash

    return xxhash.xxh3_128()


def _blake3() -> Hasher:
    import blake3

    return blake3.blake3()


def _blake2b() -> Hasher:
    return hashlib.blake2b(digest_size=32)


#: algorithm name (as stored in manifests) -> constructor.
ALGORITHMS: dict[str, Callable[[], Hasher]] = {"xxh3-128": _xxh3, "blake3": _blake3, "blake2b-256": _blake2b}


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of ``algorithm`` (a key of :data:`ALGORITHMS`).

    Raises:
        KeyError: unknown algorithm (callers name their own error).
    """
    return ALGORITHMS[algorithm]()


def digest_bytes(data: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a bytes-like object."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()
