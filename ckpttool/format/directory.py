"""A DCP checkpoint directory: validated ``.metadata``, confined data files, shared descriptors.

:class:`CheckpointDir` reads ``.metadata`` with the allow-list unpickler
(:mod:`ckpttool.format.unpickler`; no torch import), or builds it from safetensors headers for
a ``HuggingFaceStorageWriter`` save (:mod:`ckpttool.format.hf_storage`), confines every
``relative_path`` to the directory (a model/optimizer pair: each path inside its own part's
folder, ``parts``), and keeps one read-only descriptor per data file shared by every reader
thread (positional reads). File layout: torch's ``FileSystemWriter``
(``torch/distributed/checkpoint/filesystem.py``): ``.metadata`` plus ``__{rank}_{n}.distcp``.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

from ckpttool.errors import (
    CkptError,
    DataFileError,
    IncompleteCheckpointError,
    MetadataError,
    NotRegularFileError,
    PathEscapeError,
    RemoteNotFoundError,
    UsageError,
    shell_arg,
)
from ckpttool.format import limits
from ckpttool.format.dcp_safetensors import is_safetensors_serialized, resolve_safetensors_windows
from ckpttool.format.digest import DEFAULT_ALGORITHM, digest_bytes
from ckpttool.format.files import (
    UNREADABLE_HINT,
    confined,
    copy_regular,
    file_kind,
    missing_path_hint,
    open_regular,
    read_regular,
    read_regular_owned,
    resolve_inside,
)
from ckpttool.format.hf_storage import hf_storage_files, load_hf_storage_metadata, shard_rank
from ckpttool.format.mdcache import parse_metadata_taken
from ckpttool.format.mdstorage import referenced_paths
from ckpttool.format.metadata import CheckpointMetadata, ChunkMeta, StorageInfo
from ckpttool.format.rank_local import merge_rank_metadata, rank_metadata_names, ranks_without_metadata
from ckpttool.format.storage import RemoteStore, Spool, is_url, local_path

__all__ = [
    "DATA_FILE_RE",
    "METADATA_NAME",
    "CheckpointDir",
    "data_file_ranks",
    "rank_of_file",
    "resolve_inside",
    "open_regular",
    "read_regular",
    "copy_regular",
]

log = logging.getLogger(__name__)
DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
METADATA_NAME = ".metadata"


def data_file_ranks(names: Iterable[str]) -> set[int]:
    """The ranks that wrote ``__{rank}_{n}.distcp`` data files among the file ``names``."""
    return {int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n))}


def rank_of_file(relative_path: str) -> int | None:
    """Writing rank encoded in a ``__{rank}_{n}.distcp`` (or ``shard-0000R-model-*.safetensors``) file name, else ``None``."""
    m = DATA_FILE_RE.match(os.path.basename(relative_path))
    return int(m.group(1)) if m else shard_rank(relative_path)


def _holding(directory: Path) -> str:
    """What the checkpoint directory ``directory`` is known by, for a hint: its safetensors files when it holds
    no ``.metadata`` but safetensors (a Hugging Face folder), else ``.metadata``."""
    try:
        safetensors = not os.path.lexists(directory / METADATA_NAME) and bool(hf_storage_files(directory))
    except OSError:
        safetensors = False
    return "the one holding the .safetensors files" if safetensors else "the one holding .metadata"


def not_a_directory_error(p: Path) -> UsageError:
    """The ``E100`` of a checkpoint argument that names a file (a ``.distcp``, ``.metadata`` or ``.safetensors``
    file of the checkpoint): the hint names its folder, the directory to pass."""
    return UsageError(
        f"{p} is not a directory",
        path=p,
        hint=f"pass the checkpoint directory ({_holding(p.parent)}), not a file in it: {shell_arg(p.parent)}",
    )


def _checkpoints_below(url: object, sizes: dict[str, int], shown: int = 6) -> str | None:
    """A hint naming the prefixes below ``url`` that hold a ``.metadata`` (a run root's steps, in natural order:
    step-99 before step-100), or ``None`` when there are none."""
    suffix = "/" + METADATA_NAME
    found = [rel[: -len(suffix)] for rel in sizes if rel.endswith(suffix)]
    if not found:
        return None
    found.sort(key=lambda r: [(0, int(t), "") if t.isdecimal() else (1, 0, t) for t in re.split(r"(\d+)", r)])
    more = f" (+{len(found) - shown} more)" if len(found) > shown else ""
    names = ", ".join(f"{url}/{r}" for r in found[-shown:])
    return f"checkpoints below it: {names}{more} (pass one of them)"


def checkpoints_below_url(url: str | os.PathLike[str]) -> str | None:
    """A hint naming the checkpoints (prefixes holding a ``.metadata``) below the URL prefix ``url``, in natural
    order (the newest step last), from one listing; ``None`` when there is none.

    Raises:
        RemoteStorageError and its subclasses (E140-E144): the listing failed; RemoteNotFoundError (E141) is not
            raised for an empty prefix (``None`` is returned).
    """
    store = RemoteStore(url)
    return _checkpoints_below(store.path, store.sizes())


def _file_state(st: os.stat_result) -> tuple[int, ...]:
    """What identifies a file's content without reading it: device, inode, size, mtime and ctime (ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _close_descriptors(fds: dict[str, int]) -> None:
    """Close the data file descriptors of a local checkpoint no longer referenced (its :meth:`CheckpointDir.close`
    was not called; after it, ``fds`` is empty)."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class CheckpointDir:
    """A DCP checkpoint directory with its validated metadata (torch-free).

    Args:
        path: the checkpoint directory.
        metadata: already built metadata (a composed checkpoint); ``.metadata`` is then not read.
        parts: with ``metadata``: first ``relative_path`` component -> the directory that part's
            paths must stay inside.

    Raises:
        UsageError: ``path`` does not exist or is not a directory.
        IncompleteCheckpointError: data files but no ``.metadata``.
        MetadataError / UnsafePickleError: ``.metadata`` missing or unusable.

    Thread safety: :meth:`fd`, :meth:`file_size` and :meth:`storage_info` may be called
    from several threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: CheckpointMetadata | None = None,
        parts: dict[str, Path] | None = None,
    ) -> None:
        self.remote: RemoteStore | None = None
        self.spool: Spool | None = None
        self._parts_remote: dict[str, str] = {}
        self._resolved: dict[str, Path] = {}
        self._sizes: dict[str, int] = {}
        self._fds: dict[str, int] = {}
        # (device, inode, size, mtime, ctime) of each local data file as opened: see check_unchanged
        self._opened: dict[str, tuple[int, ...]] = {}
        self.closed = False  # after close(): no data file is opened again (a read is UsageError, not a leak)
        self._lock = threading.Lock()
        self.parts: dict[str, Path] = dict(parts or {})
        self.metadata: CheckpointMetadata
        # (algorithm, hex digest, size) of the .metadata bytes parsed (the last ones read, see metadata_file_digest)
        self._metadata_digest: tuple[str, str, int] | None = None
        # the __R.metadata files read as this checkpoint's metadata (a use_collectives=False save), by rank
        self.rank_metadata_files: tuple[str, ...] = ()
        if is_url(path):
            self._open_remote(path, metadata)
            return
        path = local_path(path)
        # a handle dropped without close() gives its descriptors back when collected, as a file object does
        weakref.finalize(self, _close_descriptors, self._fds)
        p = Path(path)
        if not p.exists():
            raise UsageError(f"{p}: no such directory", path=p, hint=missing_path_hint(p, "the checkpoint directory"))
        if not p.is_dir():
            raise not_a_directory_error(p)
        self.path = p
        self.root = p.resolve()
        self._part_roots = {k: v.resolve() for k, v in self.parts.items()}
        if metadata is not None:
            self.metadata = metadata
            return
        md = p / METADATA_NAME
        if not os.path.lexists(md) and hf_storage_files(p):
            self.metadata = load_hf_storage_metadata(p)
            return
        if not os.path.lexists(md) and rank_metadata_names(os.listdir(p)):
            self.metadata = self._read_rank_local(rank_metadata_names(os.listdir(p)), os.listdir(p))
            self._resolve_serialization()
            return
        if not os.path.lexists(md):
            if any(DATA_FILE_RE.match(n) for n in os.listdir(p)):
                raise IncompleteCheckpointError(
                    f"{p}: has .distcp data files but no .metadata (incomplete save)", path=md
                )
            raise MetadataError(
                f"{p}: no .metadata file; not a DCP checkpoint",
                path=md,
                hint="pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files)",
            )
        self.metadata = parse_metadata_taken(
            [self._read_metadata_bytes(md, owned=True)], str(md), lambda: bytes(self._read_metadata_bytes(md))
        )
        self._resolve_serialization()

    def _read_rank_local(self, ranks: list[tuple[int, str]], names: list[str]) -> CheckpointMetadata:
        """The ``__{rank}.metadata`` files of a ``use_collectives=False`` save, merged (:mod:`.rank_local`).

        Raises:
            IncompleteCheckpointError: a rank wrote data files but no ``__{rank}.metadata``.
            MetadataError / UnsafePickleError: a rank's file is unusable, or the ranks disagree.
        """
        lacking = ranks_without_metadata(names, data_file_ranks(names))
        if lacking:
            raise IncompleteCheckpointError(
                f"{self.path}: rank-local metadata (use_collectives=False) but rank(s) {lacking} wrote data "
                f"files or __R.metadata.tmp and no __R.metadata (incomplete save)",
                path=self.path / f"__{lacking[0]}.metadata",
            )
        parts: list[tuple[int, CheckpointMetadata]] = []
        blobs: list[bytes] = []
        cap = limits.current().max_metadata_bytes

        def reread(name: str) -> Callable[[], bytes]:
            return lambda: self.read_file(name, cap, what=name)

        for rank, name in ranks:
            shown = self.path / name
            try:
                data = self.read_file(name, cap, what=name)
            except DataFileError as e:
                raise MetadataError(e.message, path=shown) from e
            blobs.append(data)
            parts.append((rank, parse_metadata_taken([data], str(shown), reread(name))))
        joined = b"".join(blobs)
        self.rank_metadata_files = tuple(name for _, name in ranks)
        self._metadata_digest = (DEFAULT_ALGORITHM, digest_bytes(joined, DEFAULT_ALGORITHM), len(joined))
        log.info(
            "%s: %d rank-local metadata files (use_collectives=False) read as one checkpoint", self.path, len(parts)
        )
        return merge_rank_metadata(parts, str(self.path))

    def _resolve_serialization(self) -> None:
        """A ``SerializationFormat.SAFETENSORS`` save: chunk windows from its files' headers (:mod:`.dcp_safetensors`)."""
        if is_safetensors_serialized(self.metadata):
            self.metadata = resolve_safetensors_windows(self, self.metadata)

    def _read_metadata_bytes(self, shown: str | os.PathLike[str], *, owned: bool = False) -> bytes | bytearray:
        """``.metadata``'s bytes (``owned``: a local file's in a ``bytearray`` the parse may release as it reads)."""
        try:
            data = self._read(METADATA_NAME, limits.current().max_metadata_bytes, ".metadata", owned)
        except DataFileError as e:
            raise MetadataError(e.message, path=shown) from e
        # digested as read (xxh3-128, cheap next to parsing): outputs name their source by it without a second read
        self._metadata_digest = (DEFAULT_ALGORITHM, digest_bytes(data, DEFAULT_ALGORITHM), len(data))
        return data

    def metadata_file_digest(self, algorithm: str) -> tuple[str, int] | None:
        """Hex digest (``algorithm``) and size in bytes of the ``.metadata`` this handle parsed, if known.

        Known when ``.metadata`` was read at open and ``algorithm`` is
        :data:`~ckpttool.format.digest.DEFAULT_ALGORITHM` (``xxh3-128``, digested as the bytes were
        read: the bytes of this parse, even when the file changed later); ``None`` otherwise
        (metadata passed in, safetensors storage without ``.metadata``, another algorithm).
        """
        d = self._metadata_digest
        return (d[1], d[2]) if d is not None and d[0] == algorithm else None

    def _open_remote(self, url: str | os.PathLike[str], metadata: CheckpointMetadata | None) -> None:
        """Open a checkpoint below a URL prefix (:mod:`ckpttool.format.storage`): one listing, then ``.metadata``."""
        store = RemoteStore(url)
        self.remote = store
        self.path = cast(Path, store.path)  # a UrlPath: prints as the URL, never opened locally
        self.spool = Spool(store)
        self.root = self.spool.dir
        self._part_roots = {}
        try:
            sizes = store.sizes()
            if metadata is not None:
                self.metadata = metadata
                return
            if METADATA_NAME not in sizes and rank_metadata_names(set(sizes)):
                self.metadata = self._read_rank_local(rank_metadata_names(set(sizes)), list(sizes))
                self._resolve_serialization()
                return
            if METADATA_NAME not in sizes:
                if not sizes:
                    obj = store.names_object()  # e.g. the URL of the .metadata object itself
                    raise RemoteNotFoundError(
                        f"{store.path}: " + ("an object, not a prefix" if obj else "no object below this prefix"),
                        path=store.path,
                        hint="pass the URL of the checkpoint directory (the prefix holding .metadata)"
                        + (f": {store.path.parent}" if obj else ""),
                    )
                if any(DATA_FILE_RE.match(n) for n in sizes):
                    raise IncompleteCheckpointError(
                        f"{store.path}: has .distcp data files but no .metadata (incomplete save)",
                        path=store.path / METADATA_NAME,
                    )
                raise MetadataError(
                    f"{store.path}: no .metadata object; not a DCP checkpoint (remote checkpoints are opened "
                    "at their own prefix, without step discovery or safetensors-only storage)",
                    path=store.path / METADATA_NAME,
                    hint=_checkpoints_below(store.path, sizes)
                    or (
                        "it holds safetensors files (a Hugging Face save or a ckpttool export), which are read from a "
                        "local folder only: copy the prefix to a local directory and pass that"
                        if any(n.endswith(".safetensors") and "/" not in n for n in sizes)
                        else "pass the URL of the prefix that dcp.save wrote (it holds .metadata and __R_N.distcp)"
                    ),
                )
            shown = store.path / METADATA_NAME
            self.metadata = parse_metadata_taken(
                [self._read_metadata_bytes(shown)], str(shown), lambda: bytes(self._read_metadata_bytes(shown))
            )
            self._resolve_serialization()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every data file descriptor (and delete a remote checkpoint's spool). Idempotent; a read of a
        data file afterwards is :class:`UsageError`."""
        with self._lock:
            self.closed = True
            if self.spool is None:
                for fd in self._fds.values():
                    os.close(fd)
            self._fds.clear()
        if self.spool is not None:
            if self.remote is not None and self.remote.requests:
                log.info(
                    "%s: %d storage request(s), %d byte(s) fetched",
                    self.path,
                    self.remote.requests,
                    self.remote.bytes_requested,
                )
                self.remote.requests = 0  # logged once
            self.spool.close()

    # ------------------------------------------------------------------ remote
    def fetch(self, info: StorageInfo) -> None:
        """Make the byte window of ``info`` readable through :meth:`fd` (remote: one range request; local: nothing).

        Raises:
            RemoteStorageError and subclasses: the request failed (after retries).
        """
        if self.spool is not None:
            self.spool.fetch(
                info.relative_path, self.file_size(info.relative_path), info.offset, info.offset + info.length
            )

    def prefetch(self, infos: Iterable[StorageInfo]) -> None:
        """Fetch many windows with ``--remote-workers`` parallel range requests (local: nothing).

        Raises:
            as :meth:`fetch`; PathEscapeError, DataFileError as :meth:`storage_info`.
        """
        if self.spool is None:
            return
        wins = [(i.relative_path, self.file_size(i.relative_path), i.offset, i.offset + i.length) for i in infos]
        self.spool.fetch_many(wins)

    def prefetch_keys(self, keys: Iterable[str]) -> None:
        """:meth:`prefetch` every chunk (or byte item) of ``keys`` (local: nothing)."""
        if self.spool is None:
            return
        infos = []
        for key in keys:
            meta = self.metadata.entries.get(key)
            chunks = getattr(meta, "chunks", None)
            if chunks is None:
                infos.append(self.storage_info(key))
            else:
                infos.extend(self.storage_info(key, c) for c in chunks if c.numel)
        self.prefetch(infos)

    def evict(self, infos: Iterable[StorageInfo]) -> None:
        """Drop fetched windows from the spool once used (local: nothing); read again, they are fetched again."""
        if self.spool is None:
            return
        for i in infos:
            self.spool.evict(i.relative_path, i.offset, i.offset + i.length)

    def spool_budget(self) -> int | None:
        """Bytes of windows to hold in the spool at a time (``StorageConfig.spool_bytes``); ``None`` for a local checkpoint."""
        if self.spool is None:
            return None
        return self.spool.store.config.spool_bytes

    def spool_peak(self) -> int | None:
        """The most bytes of fetched windows the spool held at once so far; ``None`` for a local checkpoint."""
        return self.spool.peak if self.spool is not None else None

    def remote_stats(self) -> dict[str, int] | None:
        """``{"requests": n, "bytes_requested": b}`` of a remote checkpoint, ``None`` for a local one."""
        if self.remote is None:
            return None
        return {"requests": self.remote.requests, "bytes_requested": self.remote.bytes_requested}

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ files
    def resolve(self, relative_path: str) -> Path:
        """Absolute path of a data file, confined to the checkpoint directory.

        Raises:
            PathEscapeError: absolute, ``..`` or symlink escapes.
        """
        hit = self._resolved.get(relative_path)
        if hit is not None:
            return hit
        if self.remote is not None:
            self.remote.key(relative_path)  # confined to the prefix, or PathEscapeError
            target = self.root / relative_path  # for messages only; remote files are read through the spool
            self._resolved[relative_path] = target
            return target
        if not relative_path or "\x00" in relative_path or os.path.isabs(relative_path):
            raise PathEscapeError(
                f"{self.path}: storage path {relative_path!r} is absolute or empty", path=relative_path
            )
        target = (self.root / relative_path).resolve()
        root = next((r for k, r in self._part_roots.items() if relative_path.startswith(k + "/")), self.root)
        if not confined(target, root):
            raise PathEscapeError(
                f"{self.path}: path {relative_path!r} resolves outside the checkpoint ({target})",
                path=relative_path,
            )
        self._resolved[relative_path] = target
        return target

    def read_file(self, relative_path: str, cap: int, *, what: str = "file") -> bytes:
        """Read a file of the checkpoint (``.metadata``, ``layout.json``, ``extra_state/*``): confined, regular, capped.

        Raises:
            PathEscapeError: it resolves outside the checkpoint (a symlink out of it).
            NotRegularFileError: a device, FIFO, socket or directory.
            SizeLimitError: larger than ``cap``.
            DataFileError: missing or unreadable.
        """
        data = self._read(relative_path, cap, what, owned=False)
        assert isinstance(data, bytes)
        return data

    def _read(self, relative_path: str, cap: int, what: str, owned: bool) -> bytes | bytearray:
        """:meth:`read_file`; ``owned``: a local file's bytes in a ``bytearray`` of the caller's own."""
        target = self.resolve(relative_path)
        if self.remote is not None:
            return self.remote.read_whole(relative_path, cap, what=what)
        read = read_regular_owned if owned else read_regular
        try:
            return read(target, cap, shown=self.path / relative_path, what=what)
        except CkptError:
            raise
        except OSError as e:
            raise DataFileError(f"{self.path / relative_path}: cannot read ({e.strerror})", path=relative_path) from e

    def file_size(self, relative_path: str) -> int:
        """Size in bytes of a data file.

        Raises:
            PathEscapeError, DataFileError: escaping, missing or not a regular file.
        """
        size = self._sizes.get(relative_path)
        if size is None and self.remote is not None:
            self.resolve(relative_path)
            got = self.remote.size(relative_path)
            if got is None:
                raise DataFileError(
                    f"{self.path / relative_path}: data file missing (no such object)", path=relative_path
                )
            self._sizes[relative_path] = size = got
        if size is None:
            target = self.resolve(relative_path)
            try:
                st = target.stat()
            except OSError as e:
                raise DataFileError(
                    f"{self.path / relative_path}: data file missing ({e.strerror})", path=relative_path
                ) from e
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFileError(
                    f"{self.path / relative_path}: data file is {file_kind(st.st_mode)}, not a regular file",
                    path=relative_path,
                )
            size = st.st_size
            self._sizes[relative_path] = size
        return size

    def fd(self, relative_path: str) -> int:
        """A read-only descriptor of a data file, opened once and shared (use positional reads only).

        Raises:
            PathEscapeError, DataFileError: escaping, missing or unreadable file.
            UsageError (E100): the checkpoint was closed.
        """
        if self.closed:
            raise UsageError(
                f"{self.path}: the checkpoint was closed; cannot read {relative_path}",
                path=self.path,
                hint="use it inside its `with ckpttool.open_checkpoint(...)` block, or open it again",
            )
        fd = self._fds.get(relative_path)
        if fd is None and self.spool is not None:
            fd = self.spool.fd(relative_path, self.file_size(relative_path))
            self._fds[relative_path] = fd
        if fd is None:
            with self._lock:
                fd = self._fds.get(relative_path)
                if fd is None:
                    target = self.resolve(relative_path)
                    try:
                        fd = open_regular(target, shown=self.path / relative_path)
                    except OSError as e:
                        raise DataFileError(
                            f"{self.path / relative_path}: cannot open data file ({e.strerror})",
                            path=relative_path,
                            hint=UNREADABLE_HINT if isinstance(e, PermissionError) else None,
                        ) from e
                    self._opened[relative_path] = _file_state(os.fstat(fd))
                    self._fds[relative_path] = fd
        return fd

    def check_unchanged(self) -> None:
        """Check that no local data file read so far changed since it was opened (a writer meanwhile).

        A result built from bytes read while another process wrote to a data file (or renamed another
        file over its name) would certify, or call equal, a state the checkpoint never had as a whole:
        called before a manifest is written and before a verdict. A remote checkpoint's objects are
        checked by their ETags instead (docs/storage.md).

        Raises:
            DataFileError (E300): the file changed while it was read (its size, modification or status
                change time), or its name now holds another file.
        """
        with self._lock:
            opened = [(rel, fd, self._opened[rel]) for rel, fd in self._fds.items() if rel in self._opened]
        for rel, fd, before in opened:
            now = _file_state(os.fstat(fd))
            try:
                named = _file_state(os.stat(self.resolve(rel)))[:2]
            except OSError:
                named = ()
            if now != before or named != before[:2]:
                if named != before[:2]:  # the bytes read are those of a file the name no longer holds
                    how = "replaced by another file during the run" if named else "removed during the run"
                elif now[:4] != before[:4]:
                    how = "written to during the run"
                else:
                    how = "its status changed during the run: a write, a chmod or a hard link"

                raise DataFileError(
                    f"{self.path / rel}: changed while it was read ({how}): no result is given for it",
                    path=rel,
                    hint="another process is writing this checkpoint; rerun when that save or copy is complete",
                )

    def data_files(self) -> list[str]:
        """Relative paths referenced by ``storage_data`` (sorted, unique)."""
        return sorted(referenced_paths(self.metadata.storage))

    def storage_info(self, fqn: str, chunk: ChunkMeta | None = None) -> StorageInfo:
        """Storage info of a chunk (or byte item), bounds-checked against its file.

        Raises:
            MetadataError: no storage entry for it.
            PathEscapeError, DataFileError: bad path, missing or too-short file.
        """
        info = self.metadata.storage_for(fqn, chunk)
        if info is None:
            where = f" chunk at {chunk.offsets}" if chunk is not None else ""
            raise MetadataError(f"{self.path}: no storage entry for {fqn!r}{where}", fqn=fqn)
        size = self.file_size(info.relative_path)
        if info.offset + info.length > size:
            raise DataFileError(
                f"{self.path / info.relative_path}: {fqn!r} needs bytes [{info.offset}, "
                f"{info.offset + info.length}) but the file has {size} (truncated?)",
                path=info.relative_path,
                fqn=fqn,
            )
        return info
