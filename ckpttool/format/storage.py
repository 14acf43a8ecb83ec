"""Checkpoints in object storage: fsspec URLs, confined keys, range reads with retries, a sparse spool.

A checkpoint may be an fsspec URL (``s3://``, ``gs://``, ``memory://``; ``file://`` is a local
path). :class:`RemoteStore` lists the prefix once and checks caps and window bounds against the
listed sizes before any request; ``.metadata``, ``layout.json``, ``extra_state/*`` and byte
items are fetched whole, a chunk by one range request of exactly its window into a sparse local
spool at the same offset, so everything above reads it like a local file. Transient failures
are retried with backoff (else ``E141``-``E144``). A ``relative_path`` is confined to the
prefix: empty, absolute, ``..``/``.`` components, a scheme, NUL, backslashes and control
characters are refused (``E101``) before any request. Options and credentials are never logged
or put in a message. Needs ``ckpttool[remote]`` and a backend. ``docs/storage.md``;
``docs/design.md`` §5.
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ckpttool.engine.io import write_all
from ckpttool.engine.pool import map_ordered
from ckpttool.errors import (
    CkptError,
    DataFileError,
    PathEscapeError,
    RemoteNotFoundError,
    RemotePermissionError,
    RemoteStorageError,
    RemoteThrottledError,
    RemoteTransientError,
    SizeLimitError,
)
from ckpttool.format import limits
from ckpttool.format.settings import ProcessSetting

__all__ = [
    "StorageConfig",
    "RemoteStore",
    "UrlPath",
    "configure",
    "current",
    "is_url",
    "parse_storage_options",
    "storage_config",
    "url_path",
    "check_url_key",
    "confine_key",
    "redact",
    "same_store",
]

log = logging.getLogger(__name__)

_SCHEME_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$", re.DOTALL)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class StorageConfig:
    """How remote URLs are opened (the CLI sets it once from ``--storage-option``).

    Attributes:
        options: keyword arguments for :func:`fsspec.filesystem` (credentials, endpoint); nested
            ``a.b=v`` keys build dicts (``client_kwargs.endpoint_url=http://...``). Never logged.
        workers: parallel range requests when fetching chunk windows.
        retries: attempts per request on a transient error (1 = no retry); the only retries: the
            backend's own (s3fs's, botocore's) are turned off, so they do not multiply.
        timeout_s: connect and read timeout of each attempt, in seconds (a request to an endpoint
            that accepts and never answers fails after ``retries`` x this, plus the backoff).
        backoff_s: first retry delay in seconds (doubles per retry, with jitter).
        spool_bytes: how many bytes of fetched chunk windows an export keeps in its local spool
            at a time (it fetches, writes and evicts them in batches of about this size; one
            window larger than this is a batch of its own). ``validate --deep`` evicts each chunk
            once it is checked.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    workers: int = 16
    retries: int = 5
    timeout_s: int = 20
    backoff_s: float = 0.2
    spool_bytes: int = 4 << 30


_SETTING = ProcessSetting(StorageConfig(), positive_ints=("workers", "retries", "spool_bytes", "timeout_s"))


def current() -> StorageConfig:
    """The storage configuration in force."""
    return _SETTING.value


def configure(**changes: Any) -> StorageConfig:
    """Replace fields of the configuration for the rest of the process; returns the previous one.

    Raises:
        ValueError: ``workers``/``retries``/``spool_bytes``/``timeout_s`` not a positive int.
        TypeError: an unknown field.
    """
    return _SETTING.replace(**changes)


def storage_config(**changes: Any) -> AbstractContextManager[StorageConfig]:
    """The configuration changed for the body only (not thread-local)."""
    return _SETTING.scoped(**changes)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_storage_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``["anon=false", "client_kwargs.endpoint_url=http://h:9000"]`` -> fsspec keyword arguments.

    Values ``true``/``false``/``none`` and numbers are converted; a dotted key builds nested
    dicts. The values are secrets as far as ckpttool is concerned: messages name keys only.

    Raises:
        RemoteStorageError: a pair without ``=`` or with an empty key.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise RemoteStorageError(
                f"`storage_options`: {key or '(empty)'!r} is not of the form key=value",
                param="storage_options",
                hint="pass --storage-option KEY=VALUE (nested: client_kwargs.endpoint_url=URL)",
            )
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise RemoteStorageError(
                    f"`storage_options`: {key!r} conflicts with an earlier option", param="storage_options"
                )
            node = nxt
        node[leaf] = _value(val)
    return out


#: Option keys whose values name a place, not a secret: shown in messages (a wrong endpoint must be seen) unless the
#: value carries ``user:password@``.
_SHOWN_OPTIONS = frozenset({"endpoint_url", "region_name"})


def redact(text: str, options: Mapping[str, Any] | None = None) -> str:
    """``text`` with every string value of ``options`` (secrets) replaced by ``***``, but for an ``endpoint_url`` or
    ``region_name`` without ``@`` in it (:data:`_SHOWN_OPTIONS`)."""
    values: list[str] = []

    def walk(o: Any, key: str = "") -> None:
        if isinstance(o, Mapping):
            for k, v in o.items():
                walk(v, str(k))
        elif isinstance(o, str) and len(o) >= 4 and not (key in _SHOWN_OPTIONS and "@" not in o):
            values.append(o)

    walk(options if options is not None else _SETTING.value.options)
    for v in sorted(values, key=len, reverse=True):
        text = text.replace(v, "***")
    return text


# --------------------------------------------------------------------------- URLs
def is_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URL with a scheme other than ``file`` (``s3://b/k``, ``memory://x``)."""
    if path is None or isinstance(path, Path):
        return isinstance(path, UrlPath)
    m = _SCHEME_RE.match(os.fspath(path))
    return m is not None and m.group("scheme").lower() != "file"


def local_path(path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``file:///a/b`` (and ``file://localhost/a/b``, RFC 8089's local host) -> ``/a/b``; anything else unchanged."""
    if isinstance(path, str):
        m = _SCHEME_RE.match(path)
        if m is not None and m.group("scheme").lower() == "file":
            rest = m.group("rest")
            if rest.lower() == "localhost" or rest[:10].lower() == "localhost/":
                rest = rest[9:]
            return rest or "/"
    return path


#: The characters fsspec's ``rm``/``copy``/``expand_path`` read as a glob pattern in a path.
_GLOB_CHARS = re.compile(r"[*?\[]")


class UrlPath(PurePosixPath):
    """A pure path that prints as its URL: ``UrlPath.of("s3://b/run") / "x"`` is ``s3://b/run/x``.

    Only for naming remote files in messages and results (``ckpt.path / relative_path``); it
    is never opened locally. The scheme is carried by the class (one subclass per scheme).
    """

    scheme = ""
    _by_scheme: dict[str, type[UrlPath]] = {}
    _given = ""  # the URL as given, where its key had an empty or '.' component (see check_url_key)

    @staticmethod
    def of(url: str) -> UrlPath:
        m = _SCHEME_RE.match(url)
        if m is None:
            raise ValueError(f"not a URL: {url!r}")
        scheme = m.group("scheme").lower()
        cls = UrlPath._by_scheme.get(scheme)
        if cls is None:
            cls = type(f"UrlPath_{scheme}", (UrlPath,), {"scheme": scheme})
            UrlPath._by_scheme[scheme] = cls
        rest = m.group("rest").strip("/")
        path = cls("/" + rest)
        if any(part in ("", ".") for part in rest.split("/")[1:]):
            # the key holds an empty or '.' component, which the path collapsed: check_url_key refuses it
            path._given = f"{scheme}://{rest}"
        return path

    def __str__(self) -> str:
        return f"{self.scheme}://{super().__str__().lstrip('/')}"

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"UrlPath({str(self)!r})"

    @property
    def key(self) -> str:
        """``bucket/prefix`` without the scheme (what fsspec backends take)."""
        return super().__str__().lstrip("/")


def same_store(a: UrlPath, b: UrlPath) -> bool:
    """Whether ``a`` and ``b`` name objects of one store: the same scheme, or two schemes fsspec opens with one
    filesystem class (its ``known_implementations``: ``s3``/``s3a``, ``gs``/``gcs``, ``az``/``abfs``), so that
    ``s3a://b/k`` is the object ``s3://b/k``. Without fsspec only the same scheme is one store."""
    if a.scheme == b.scheme:
        return True
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return False
    ca, cb = (known_implementations.get(s, {}).get("class") for s in (a.scheme, b.scheme))
    return ca is not None and ca == cb


def url_path(path: str | os.PathLike[str]) -> UrlPath:
    """The :class:`UrlPath` of a URL string (or the path itself when already one)."""
    return path if isinstance(path, UrlPath) else UrlPath.of(os.fspath(path))


def check_url_key(path: UrlPath) -> None:
    """Refuse a URL with a ``..`` component: an object store takes it as characters of the key (``s3://b/x/../hf``
    is not ``s3://b/hf``), so it would read nothing, or write objects whose keys hold ``x/../hf/``.

    An empty or ``.`` component (``s3://b//run``, ``s3://b/./run``) is refused too: S3 keeps it in the key
    (torch's ``FsspecWriter`` to ``s3://b//run`` writes the keys ``/run/...``), while the path would read
    ``s3://b/run``, another checkpoint or none.

    ``?versionId=`` in an ``s3://`` key is refused as well: s3fs reads it as an object version and cuts the key
    there, so ``s3://b/p?versionId=x/step-1`` would be listed as ``s3://b/p/`` (its objects said to be absent) and
    written as the one object ``p``.

    Raises:
        RemoteStorageError: (E140) the hint names the prefix meant.
    """
    if path.scheme in ("s3", "s3a") and "?versionId=" in path.key:
        raise RemoteStorageError(
            f"{path}: '?versionId=' in an s3:// URL names an object version to s3fs, which cuts the key there: "
            "this prefix can be neither read nor written as named",
            path=str(path),
            hint="copy or move the objects to a prefix without '?versionId=' in its name, and pass that",
        )
    if path._given:
        raise RemoteStorageError(
            f"{path._given}: an empty or '.' component in a URL is part of the object key (s3://b//run names the"
            " keys '/run/...'), not a separator",
            path=path._given,
            hint=f"name the prefix without it: {path} (ckpttool reads no key with an empty or '.' component)",
        )
    if ".." in path.key.split("/"):
        meant = posixpath.normpath(path.key)
        bucket = path.key.split("/")[0]
        inside = bucket != ".." and meant.split("/")[0] == bucket  # s3://b/.. and s3://b/../c leave the bucket
        raise RemoteStorageError(
            f"{path}: a '..' component in a URL is part of the object key, not the parent prefix",
            path=str(path),
            hint=f"name the prefix itself: {path.scheme}://{meant}"
            if inside
            else "a '..' cannot leave the bucket: name the bucket and the prefix inside it",
        )


def confine_key(
    root: str,
    relative: str,
    *,
    shown: object,
    what: str = "storage path",
    why: str = "it could leave the checkpoint prefix",
) -> str:
    """``root + "/" + relative`` for a ``relative`` that stays inside the prefix ``root``.

    Object stores have no directories or symlinks: the key is the string. Refused (``E101``):
    empty, absolute, a scheme, NUL/control characters, backslashes, ``.``/``..``/empty
    components — anything that could name another bucket, another prefix, or the same object
    under two names. ``why``: the consequence the message ends with.

    Raises:
        PathEscapeError: the path is refused.
    """
    bad = None
    if not relative:
        bad = "is empty"
    elif _CONTROL_RE.search(relative):
        bad = "holds a control character"
    elif "\\" in relative:
        bad = "holds a backslash"
    elif relative.startswith("/"):
        bad = "is absolute"
    elif ":" in relative.split("/", 1)[0] or "://" in relative:
        bad = "names a scheme or another bucket"
    elif any(part in ("", ".", "..") for part in relative.split("/")):
        bad = "has an empty, '.' or '..' component"
    if bad is not None:
        raise PathEscapeError(f"{shown}: {what} {relative!r} {bad}: {why}", path=relative)
    return f"{root.rstrip('/')}/{relative}"


# --------------------------------------------------------------------------- errors
# credentials missing, wrong or expired: botocore's NoCredentialsError / PartialCredentialsError /
# InvalidAccessKeyId / SignatureDoesNotMatch / ExpiredToken / ProfileNotFound (AWS_PROFILE naming no profile),
# google-auth's DefaultCredentialsError, azure's ClientAuthenticationError, besides a plain 403
_PERMISSION_WORDS = (
    "accessdenied",
    "profilenotfound",
    "forbidden",
    "credentials",
    "invalidaccesskeyid",
    "signaturedoesnotmatch",
    "expiredtoken",
    "clientauthenticationerror",
)
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*")
# s3fs turns S3's SlowDown into ``OSError(EBUSY, "Please reduce your request rate.")``: the code is gone, S3's message stays
_THROTTLE_WORDS = (
    "slowdown",
    "slow down",
    "reduce your request rate",
    "throttl",
    "toomanyrequests",
    "too many requests",
    "requestlimitexceeded",
)


def _wrong_endpoint(e: BaseException) -> str | None:
    """What makes the endpoint unusable, when ``e`` (or an exception it was raised from) says so for good: a host name
    that does not resolve (``EAI_NONAME``/``EAI_NODATA``, not ``EAI_AGAIN``, which a retry may mend), or a TLS
    handshake that cannot succeed (``https://`` to a plain-HTTP port, a certificate that does not verify). ``None``
    otherwise. botocore wraps either in an ``EndpointConnectionError`` / ``SSLError`` whose message says neither."""
    import socket
    import ssl

    final = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, socket.gaierror) and cur.errno in final:
            return "its host name does not resolve"
        if isinstance(cur, ssl.SSLCertVerificationError):
            return "its TLS certificate does not verify"
        if isinstance(cur, ssl.SSLError) and getattr(cur, "reason", None) == "WRONG_VERSION_NUMBER":
            return "it does not speak TLS (an https:// URL for a plain-HTTP port?)"
        cur = cur.__cause__ or cur.__context__
    return None


def _classify(e: BaseException) -> str:
    """``not_found`` | ``permission`` | ``throttled`` | ``changed`` | ``endpoint`` | ``transient`` | ``fatal`` for a
    backend exception."""
    if isinstance(e, CkptError):
        return "fatal"
    if _wrong_endpoint(e) is not None:
        return "endpoint"  # a wrong endpoint: every retry would fail alike (was retried --remote-retries times)
    if isinstance(e, FileNotFoundError):
        return "not_found"
    if isinstance(e, PermissionError):
        return "permission"
    # the words are looked for in the error, not in the URL it may quote: a connection error to
    # ".../credentials-eval/step-100" or "s3://forbidden-planet/..." is no permission error
    text = _URL_RE.sub(" ", f"{type(e).__name__} {e}").lower()
    if any(w in text for w in _THROTTLE_WORDS) or " 429" in text or "(429)" in text:
        return "throttled"
    if any(w in text for w in _PERMISSION_WORDS) or " 403" in text:
        return "permission"
    if "nosuchkey" in text or "nosuchbucket" in text or "not found" in text:
        return "not_found"
    # a range past the object's end (HTTP 416, S3's InvalidRange): the object is shorter than the listing said,
    # it changed since; s3fs raises it as an OSError (EINVAL), which a retry cannot mend
    if "range is not satisfiable" in text or "invalidrange" in text or " 416" in text:
        return "changed"
    # a read pinned to the listed ETag (If-Match) of an object rewritten since, whatever its new size: HTTP 412
    if "pre-conditions you specified did not hold" in text or "preconditionfailed" in text or " 412" in text:
        return "replaced"
    return "transient" if _transient(e, text) else "fatal"


def _transient(e: BaseException, text: str) -> bool:
    """Whether ``e`` (``text``: its lower-cased words, URLs left out) is a failure a retry may mend: a connection
    reset or refused, a timeout, a 5xx."""
    if isinstance(e, (ConnectionError, TimeoutError, OSError, EOFError)):
        return True
    name = type(e).__name__
    if any(w in name for w in ("Connection", "Timeout", "EndpointConnection", "ReadTimeout", "IncompleteRead")):
        return True
    return any(w in text for w in ("internalerror", "serviceunavailable", " 500", " 502", " 503", " 504"))


def _error_for(
    kind: str, e: BaseException, where: str, attempts: int, options: Mapping[str, Any] | None = None
) -> CkptError:
    detail = redact(f"{type(e).__name__}: {str(e)[:160]}", options)
    if kind == "not_found":
        return RemoteNotFoundError(f"{where}: not found ({detail})", path=where)
    if kind == "permission":
        return RemotePermissionError(f"{where}: permission denied ({detail})", path=where)
    if kind == "throttled":
        return RemoteThrottledError(f"{where}: still throttled after {attempts} attempt(s) ({detail})", path=where)
    if kind == "changed":
        return DataFileError(
            f"{where}: the bytes asked lie past the object's end: it is shorter than when it was listed "
            f"(it changed while being read) ({detail})",
            path=where,
            hint="a save or copy may still be writing this checkpoint: run again once it is finished and unchanged",
        )
    if kind == "replaced":
        return DataFileError(
            f"{where}: the object was replaced since it was listed (its ETag differs): it changed while being read "
            f"({detail})",
            path=where,
            hint="a save or copy may still be writing this checkpoint: run again once it is finished and unchanged",
        )
    if kind == "endpoint":
        return RemoteStorageError(
            f"{where}: the endpoint cannot be used: {_wrong_endpoint(e)}; not retried ({detail})",
            path=where,
            hint="check the endpoint (--storage-option client_kwargs.endpoint_url=URL: its scheme, host and port) "
            "and the network's name resolution",
        )
    if kind == "transient":
        return RemoteTransientError(f"{where}: failed after {attempts} attempt(s) ({detail})", path=where)
    if isinstance(e, (TypeError, AttributeError)) and options:  # the backend choked on a value of the wrong type
        return RemoteStorageError(
            f"{where}: the backend could not use the storage options given ({detail})",
            path=where,
            hint="check the types of --storage-option values against the backend's documentation (a nested "
            "setting is given key by key: config_kwargs.retries.max_attempts=3, not config_kwargs.retries=3)",
        )
    return RemoteStorageError(f"{where}: storage request failed ({detail})", path=where)


def bounded_options(scheme: str, options: Mapping[str, Any], timeout_s: int) -> dict[str, Any]:
    """``options`` with a connect and read timeout and no backend retries, unless the user set them.

    s3 (s3fs/botocore): ``config_kwargs`` ``connect_timeout``/``read_timeout`` and
    ``retries.total_max_attempts`` 1 (the request alone: botocore's ``max_attempts`` counts the retries); http(s) (aiohttp): ``client_kwargs.timeout``. Other backends are
    passed as given (their timeouts are theirs to set with ``--storage-option``).
    """
    out = dict(options)
    if scheme in ("s3", "s3a"):
        conf = dict(out.get("config_kwargs") or {})
        conf.setdefault("connect_timeout", timeout_s)
        conf.setdefault("read_timeout", timeout_s)
        conf.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # max_attempts counts retries
        out["config_kwargs"] = conf
    elif scheme in ("http", "https"):
        client = dict(out.get("client_kwargs") or {})
        if "timeout" not in client:
            try:
                import aiohttp
            except ImportError:
                return out
            client["timeout"] = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
        out["client_kwargs"] = client
    return out


def _filesystem(scheme: str, options: Mapping[str, Any], shown: str, timeout_s: int = 20) -> Any:
    try:
        import fsspec
    except ImportError as e:
        raise RemoteStorageError(
            f"{shown}: reading URLs needs fsspec",
            path=shown,
            hint="pip install 'ckpttool[remote]' (and a backend: 'ckpttool[s3]' for s3://)",
        ) from e
    try:
        fs = fsspec.filesystem(scheme, **bounded_options(scheme, options, timeout_s))
        if scheme in ("s3", "s3a") and "retries" not in options:
            fs.retries = 1  # s3fs retries each call 5 times on its own: ckpttool's --remote-retries count them all
        return fs
    except ImportError as e:
        raise RemoteStorageError(
            f"{shown}: the {scheme}:// backend is not installed ({str(e)[:120]})",
            path=shown,
            hint="pip install 'ckpttool[s3]' for s3://, gcsfs for gs://, adlfs for az://",
        ) from e
    except (ValueError, TypeError) as e:
        if isinstance(e, ValueError) and str(e).startswith("Protocol not known"):  # fsspec's registry lookup
            raise RemoteStorageError(
                f"{shown}: fsspec knows no {scheme}:// filesystem", path=shown, hint="use a URL fsspec resolves"
            ) from e
        raise RemoteStorageError(
            f"{shown}: bad storage options for {scheme}:// ({redact(str(e), options)[:120]})",
            path=shown,
            hint="check --storage-option keys against the backend's documentation",
        ) from e
    # a filesystem that opens its target when built (zip://, tar://: OSError) or wraps another one it is not
    # given (dir://: AttributeError from its None path): not a checkpoint prefix
    except (OSError, AttributeError, LookupError, RuntimeError) as e:
        raise RemoteStorageError(
            f"{shown}: cannot open a {scheme}:// filesystem here ({type(e).__name__}: {redact(str(e), options)[:120]})",
            path=shown,
            hint="pass the URL of the checkpoint prefix in an object store (s3://bucket/run/step-100)",
        ) from e


# --------------------------------------------------------------------------- the store
class RemoteStore:
    """One remote prefix (a checkpoint or an output), with counted, retried requests.

    Args:
        url: ``scheme://bucket/prefix``.
        config: the :class:`StorageConfig` (default: :func:`current`).

    Attributes:
        path: the :class:`UrlPath` of ``url`` (for messages).
        requests: requests made (listings, whole reads, range reads, writes).
        bytes_requested: bytes fetched.

    Thread safety: every method may be called from several threads.
    """

    def __init__(self, url: str | os.PathLike[str], config: StorageConfig | None = None) -> None:
        self.config = config or current()
        self.path = url_path(url)
        check_url_key(self.path)
        self.root = self.path.key
        self.fs = _filesystem(self.path.scheme, self.config.options, str(self.path), self.config.timeout_s)
        self.requests = 0
        self.bytes_requested = 0
        self._lock = threading.Lock()
        self._sizes: dict[str, int] | None = None
        self._etags: dict[str, str] = {}  # relative path -> the listing's ETag (s3): every read is pinned to it

    # ---------------------------------------------------------------- requests
    def _count(self, nbytes: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_requested += nbytes

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` retried on transient errors; a coded error otherwise.

        Raises:
            RemoteNotFoundError, RemotePermissionError, RemoteThrottledError, RemoteTransientError,
            RemoteStorageError: per :func:`_classify`.
        """
        cfg = self.config
        delay = cfg.backoff_s
        for attempt in range(1, cfg.retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                kind = _classify(e)
                if kind in ("transient", "throttled") and attempt < cfg.retries:
                    log.debug("%s: %s (%s), retry %d/%d", what, kind, type(e).__name__, attempt, cfg.retries - 1)
                    self._invalidate()
                    time.sleep(delay * (1 + random.random()))
                    delay *= 2
                    continue
                if isinstance(e, CkptError):
                    raise
                raise _error_for(kind, e, what, attempt, cfg.options) from None
        raise AssertionError("unreachable")

    def _invalidate(self) -> None:
        inv = getattr(self.fs, "invalidate_cache", None)
        if inv is not None:
            try:
                inv()
            except Exception:
                pass

    def key(self, relative: str) -> str:
        """The confined backend key of ``relative`` (see :func:`confine_key`)."""
        return confine_key(self.root, relative, shown=self.path)

    def sizes(self) -> dict[str, int]:
        """relative path -> size of every object below the prefix (one listing, cached). A zero-byte object
        whose key ends in ``/`` (a folder marker, as S3 consoles write for "Create folder"; the prefix's own
        ``prefix/`` included) is a directory, not listed: an empty folder made so is an empty output prefix, and a
        marker inside a checkpoint is not a storage path ``a/`` (E101).

        Raises:
            as :meth:`call`.
        """
        if self._sizes is None:

            def listing() -> dict[str, Any]:
                return dict(self.fs.find(self.root, detail=True, withdirs=False))

            self._invalidate()  # a listing cached by the backend may predate writes
            found = self.call(f"{self.path}: listing", listing)
            self._count()
            prefix = self.root.rstrip("/") + "/"
            sizes: dict[str, int] = {}
            etags: dict[str, str] = {}
            for name, info in found.items():
                name = name.lstrip("/") if not self.root.startswith("/") else name
                if name.startswith(prefix) and info.get("type", "file") == "file":
                    rel, size = name[len(prefix) :], int(info.get("size") or 0)
                    if (rel == "" or rel.endswith("/")) and size == 0:
                        continue  # a folder marker ("Create folder" in a console): a directory, not a file
                    sizes[rel] = size
                    if isinstance(info.get("ETag"), str) and info["ETag"]:
                        etags[rel] = info["ETag"]
            self._etags = etags
            self._sizes = sizes
        return self._sizes

    def exists(self) -> bool:
        """Whether any object lies below the prefix."""
        return bool(self.sizes())

    def names_object(self) -> bool:
        """Whether the URL itself is an object (a file of a checkpoint, not its prefix): one request.

        Raises:
            as :meth:`call` (but not-found: ``False``).
        """
        from ckpttool.errors import RemoteNotFoundError

        self._invalidate()  # a listing cached by the backend may predate the object
        try:
            found = bool(self.call(f"{self.path}: info", self.fs.isfile, self.root))
        except RemoteNotFoundError:
            found = False
        self._count()
        return found

    def size(self, relative: str) -> int | None:
        """Size of ``relative`` from the listing, ``None`` when absent."""
        self.key(relative)
        return self.sizes().get(relative)

    def read_range(self, relative: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object: one range request (retried).

        Raises:
            DataFileError: the store returned fewer bytes (the object changed).
            plus those of :meth:`call`.
        """
        key = self.key(relative)
        where = str(self.path / relative)
        data = self._listed_get(where, relative, key, start, end)
        self._count(len(data))
        if len(data) != end - start:
            raise DataFileError(
                f"{where}: asked bytes [{start}, {end}), got {len(data)} (the object changed?)", path=relative
            )
        return bytes(data)

    def _listed_get(self, where: str, relative: str, key: str, start: int, end: int) -> bytes:
        """:meth:`_get` retried; an object of the listing that is gone when its bytes are asked (deleted since) is
        ``E300`` "it changed while being read", not ``E141`` about the URL."""
        try:
            return bytes(self.call(where, self._get, relative, key, start, end))
        except RemoteNotFoundError:
            if self._sizes is None or relative not in self._sizes:
                raise
        raise DataFileError(
            f"{where}: the object was deleted since it was listed: it changed while being read",
            path=where,
            hint="a save or copy may still be writing this checkpoint: run again once it is finished and unchanged",
        )

    def _get(self, relative: str, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``; for s3 pinned to the ETag the listing gave (``If-Match``).

        An object rewritten since the listing with the same size would otherwise be read as the listed one: its
        chunks at the offsets of the old ``.metadata``, tensors of another save. The pinned request fails (HTTP
        412, classified ``replaced``) instead. Other backends read with ``cat_file`` (unpinned).

        For s3 the object key is the prefix's key and ``relative`` as they are: s3fs's ``split_path`` (``cat_file``)
        cuts a key at ``?versionId=`` (an object version to it), so a listed object ``x?versionId=v`` was asked as
        ``x``, another object or none.
        """
        if end <= start:
            return b""
        etag = self._etags.get(relative) if self._sizes is not None else None
        call_s3 = getattr(self.fs, "_call_s3", None)
        if call_s3 is None:
            return bytes(self.fs.cat_file(key, start=start, end=end))
        from fsspec.asyn import sync

        bucket, object_key = self._s3_object(relative)
        pin = {"IfMatch": etag} if etag is not None else {}

        async def get() -> bytes:
            resp = await call_s3("get_object", Bucket=bucket, Key=object_key, Range=f"bytes={start}-{end - 1}", **pin)
            try:
                return bytes(await resp["Body"].read())
            finally:
                resp["Body"].close()

        return bytes(sync(self.fs.loop, get))

    def _s3_object(self, relative: str) -> tuple[str, str]:
        """``(bucket, object key)`` of ``relative`` below an s3 prefix, the key as listed (``split_path`` of the whole
        key cuts it at ``?versionId=``; the URL's own key holds none: :func:`check_url_key`)."""
        bucket, root_key, _ = self.fs.split_path(self.root)
        return bucket, f"{root_key.rstrip('/')}/{relative}" if root_key.strip("/") else relative

    def _delete_listed(self, relative: str) -> None:
        """Delete the s3 object ``relative`` by its key as listed (one request; see :meth:`_s3_object`)."""
        from fsspec.asyn import sync

        bucket, object_key = self._s3_object(relative)
        sync(self.fs.loop, self.fs._call_s3, "delete_object", Bucket=bucket, Key=object_key)

    def read_whole(self, relative: str, cap: int, *, what: str = "file") -> bytes:
        """A whole object, refused before the request when the listing says it is over ``cap``.

        Raises:
            DataFileError: absent from the listing.
            SizeLimitError: larger than ``cap``.
        """
        size = self.size(relative)
        where = self.path / relative
        if size is None:
            raise DataFileError(f"{where}: no such object", path=relative)
        if size > cap:
            raise SizeLimitError(
                f"{where}: {what} of {size} bytes is over the cap of {limits.human(cap)}", path=relative
            )
        if not size:
            return b""
        # one byte past the listed size: an object rewritten since the listing (longer, or shorter) is told by
        # its length, not parsed as a cut-off copy of the new one
        key = self.key(relative)
        data = self._listed_get(str(where), relative, key, 0, size + 1)
        self._count(len(data))
        if len(data) != size:
            raise DataFileError(
                f"{where}: {len(data) if len(data) <= size else 'more than ' + str(size)} bytes, the listing said "
                f"{size}: it changed while being read",
                path=relative,
                hint="a save or copy may still be writing this checkpoint: run again once it is finished and unchanged",
            )
        return bytes(data)

    # ---------------------------------------------------------------- writes
    def put_file(self, local: Path, relative: str) -> None:
        """Upload one file to ``prefix/relative`` (fsspec/s3fs use multipart uploads for large files)."""
        key = self.key(relative)
        self.call(str(self.path / relative), self.fs.put_file, str(local), key)
        self._count()

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write one small object whole (one PUT: readers see the old object or the new one)."""
        key = self.key(relative)
        self.call(str(self.path / relative), self.fs.pipe_file, key, data)
        self._count()
        self.forget_listing()

    def copy(self, src_relative: str, dst: RemoteStore, dst_relative: str) -> None:
        """Server-side copy of one object to another prefix of the same store (``cp_file``: the key as it is;
        fsspec's ``copy`` reads ``*``, ``?`` and ``[`` in a key, ``s3://b/exp[v2]/``, as a pattern)."""
        self.call(str(dst.path / dst_relative), self.fs.cp_file, self.key(src_relative), dst.key(dst_relative))
        self._count()

    def remove(self, relatives: Iterable[str]) -> None:
        """Delete exactly these objects (missing ones are ignored): a key holding ``*``, ``?`` or ``[`` is deleted
        by itself (``rm_file``), never given to fsspec's ``rm``, which reads it as a pattern and deletes the
        objects it matches instead (``exp[v2]/x`` matches ``expv/x``: an object ckpttool did not write). For s3 a
        key holding ``?versionId=`` is deleted by its key as listed: s3fs cuts it there, so deleting the listed
        ``x?versionId=v`` deleted ``x`` (the file an ``--overwrite`` had just published)."""
        rels = list(relatives)
        keys = [self.key(r) for r in rels]
        s3 = getattr(self.fs, "_call_s3", None) is not None
        listed = [r for r in rels if s3 and "?versionId=" in r]
        keys = [k for k, r in zip(keys, rels) if not (s3 and "?versionId=" in r)]  # not `r in listed`: quadratic
        literal = [k for k in keys if not _GLOB_CHARS.search(k)]
        batches: list[tuple[Any, Any]] = [(self.fs.rm, literal)] if literal else []
        batches += [(self.fs.rm_file, k) for k in keys if _GLOB_CHARS.search(k)]
        batches += [(self._delete_listed, r) for r in listed]
        for fn, arg in batches:
            try:
                self.call(f"{self.path}: delete", fn, arg)
            except RemoteNotFoundError:
                pass
            self._count()
        self._sizes = None

    def forget_listing(self) -> None:
        """Drop the cached listing (after writes)."""
        self._sizes = None
        self._etags = {}
        self._invalidate()


class Spool:
    """Sparse local files holding the fetched windows of remote data files, at their offsets.

    A window is fetched once (one range request of exactly its bytes) and then read with the
    same positional reads as a local file; windows are fetched in parallel by :meth:`fetch_many`.
    The spool directory (under ``$TMPDIR``) is removed by :meth:`close`; its files are sparse, so
    the disk holds only the fetched bytes, and :meth:`evict` gives a window's blocks back (a hole
    punched in its place, Linux ``fallocate``) once it has been used: :attr:`held` bytes are in
    the spool now, :attr:`peak` at most so far.
    """

    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self.dir = Path(tempfile.mkdtemp(prefix="ckpttool-spool-"))
        self.held = 0
        self.peak = 0
        self._fds: dict[str, int] = {}
        self._done: set[tuple[str, int, int]] = set()
        self._pending: dict[tuple[str, int, int], threading.Event] = {}
        self._lock = threading.Lock()
        # a spool no longer referenced (its checkpoint dropped without close()) is closed and deleted all the same
        self._release = weakref.finalize(self, _release_spool, self._fds, self.dir)

    def fd(self, relative: str, size: int) -> int:
        """Read/write descriptor of the spool file of ``relative`` (created sparse, ``size`` bytes)."""
        fd = self._fds.get(relative)
        if fd is None:
            with self._lock:
                fd = self._fds.get(relative)
                if fd is None:
                    self.store.key(relative)  # confinement first
                    p = self.dir / f"{len(self._fds):06d}.part"
                    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
                    os.ftruncate(fd, size)
                    self._fds[relative] = fd
        return fd

    def fetch(self, relative: str, size: int, start: int, end: int) -> None:
        """Make bytes ``[start, end)`` of ``relative`` present in its spool file (one range request)."""
        if end <= start:
            return
        k = (relative, start, end)
        with self._lock:
            if k in self._done:
                return
            ev = self._pending.get(k)
            owner = ev is None
            if owner:
                ev = self._pending[k] = threading.Event()
        assert ev is not None
        if not owner:
            ev.wait()
            with self._lock:
                if k in self._done:
                    return
            return self.fetch(relative, size, start, end)
        try:
            data = self.store.read_range(relative, start, end)
            fd = self.fd(relative, size)
            write_all(fd, data, start)
            with self._lock:
                self._done.add(k)
                self.held += end - start
                self.peak = max(self.peak, self.held)
        finally:
            with self._lock:
                self._pending.pop(k, None)
            ev.set()

    def fetch_many(self, windows: Iterable[tuple[str, int, int, int]]) -> None:
        """Fetch ``(relative, size, start, end)`` windows with ``workers`` parallel requests.

        Raises:
            the first error of any request (the others are still awaited).
        """
        todo = sorted({w for w in windows if (w[0], w[2], w[3]) not in self._done})
        if not todo:
            return
        workers = min(self.store.config.workers, len(todo))
        if workers <= 1:
            for w in todo:
                self.fetch(*w)
            return
        map_ordered(lambda w: self.fetch(*w), todo, workers=workers, finish_all=True)

    def evict(self, relative: str, start: int, end: int) -> None:
        """Drop the fetched window ``[start, end)`` of ``relative`` (fetched again if read again)."""
        k = (relative, start, end)
        with self._lock:
            if k not in self._done:
                return
            self._done.discard(k)
            self.held -= end - start
            fd = self._fds.get(relative)
        if fd is not None:
            _punch_hole(fd, start, end - start)

    def close(self) -> None:
        """Close and delete the spool. Idempotent."""
        with self._lock:
            self._release()


def _release_spool(fds: dict[str, int], folder: Path) -> None:
    """Close a spool's descriptors and delete its directory (:meth:`Spool.close`, or the spool collected unclosed)."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)


_FALLOC_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_fallocate: Any = None


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Give the blocks of ``[offset, offset + length)`` back to the filesystem (Linux; elsewhere
    or on a filesystem without hole punching the bytes stay until the spool is closed)."""
    global _fallocate
    if _fallocate is None:
        try:
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).fallocate
            f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            f.restype = ctypes.c_int
            _fallocate = f
        except (OSError, AttributeError):
            _fallocate = False
    if _fallocate and _fallocate(fd, _FALLOC_PUNCH, offset, length) != 0:
        log.debug("spool: cannot punch a hole (errno %d); the window stays until the end", _ctypes_errno())


def _ctypes_errno() -> int:
    import ctypes

    return ctypes.get_errno()
