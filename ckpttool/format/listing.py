"""The files of an opened checkpoint directory: data files, ``extra_state/*`` files, the layout sidecar.

One listing per checkpoint (local: ``os.listdir`` of the directory and of each part of a
model/optimizer pair, ``stat`` of the data files; an object store: its one listing, no
``stat``). The checkpoint model reads metadata only and is handed this listing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import CkptError, DataFileError, NotRegularFileError
from ckpttool.format.directory import DATA_FILE_RE, CheckpointDir
from ckpttool.format.files import UNREADABLE_HINT

__all__ = ["FileListing", "list_files"]


@dataclass(frozen=True)
class FileListing:
    """What :func:`list_files` found.

    Attributes:
        data_files: ``.distcp`` path relative to the checkpoint -> size in bytes (``None``:
            missing or unreadable), sorted by path: the files on disk and the ones ``.metadata``
            references.
        extra_state: ``(relative path, size, stem)`` of the regular files in ``extra_state/``, sorted
            (``stem``: the name without its suffix, where the writing rank is read from).
        has_layout_sidecar: the layout sidecar file ``sidecar_name`` is there.
    """

    data_files: dict[str, int | None]
    extra_state: tuple[tuple[str, int, str], ...]
    has_layout_sidecar: bool


def _local_data_files(cd: CheckpointDir) -> dict[str, int | None]:
    on_disk: dict[str, int | None] = {}
    for sub in ("", *(f"{k}/" for k in cd.parts)):
        try:
            names = os.listdir(cd.path / sub) if sub else os.listdir(cd.path)
        except OSError:
            names = []
        for name in names:
            if DATA_FILE_RE.match(name):
                try:
                    on_disk[sub + name] = (cd.path / sub / name).stat().st_size
                except OSError:
                    on_disk[sub + name] = None
    return on_disk


def _local_extra_state(cd: CheckpointDir) -> list[tuple[str, int, str]]:
    """The regular files of ``extra_state/`` (symlinks confined to the checkpoint, then followed).

    Raises:
        PathEscapeError: ``extra_state`` or a file in it links out of the checkpoint.
        NotRegularFileError: a device, FIFO or socket in it.
        DataFileError: ``extra_state`` cannot be listed, or a file in it cannot be stat'ed (permissions).
    """
    extra: list[tuple[str, int, str]] = []
    extra_dir = cd.path / "extra_state"
    if not extra_dir.is_dir():
        return extra
    cd.resolve("extra_state")  # a symlink out of the checkpoint: PathEscapeError
    try:
        entries = sorted(extra_dir.iterdir())
    except OSError as e:  # a folder of another user, chmod 000: named, not an internal error
        raise DataFileError(
            f"{extra_dir}: cannot list the folder ({e.strerror})", path=extra_dir, hint=UNREADABLE_HINT
        ) from e
    for p in entries:
        rel = f"extra_state/{p.name}"
        try:
            st = cd.resolve(rel).stat() if p.is_symlink() else p.lstat()  # symlinks: confined, then followed
        except OSError as e:
            raise DataFileError(f"{cd.path / rel}: cannot read ({e.strerror})", path=rel, hint=UNREADABLE_HINT) from e
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(
                f"{cd.path / rel} is a device, FIFO or socket, not a regular file; ckpttool reads only regular files",
                path=rel,
            )
        extra.append((rel, st.st_size, p.stem))
    return extra


def list_files(cd: CheckpointDir, referenced: set[str], sidecar_name: str) -> FileListing:
    """The files of checkpoint ``cd`` (see :class:`FileListing`).

    Args:
        cd: the opened checkpoint directory.
        referenced: the data files ``.metadata`` references (sized with ``cd.file_size`` when not listed).
        sidecar_name: the layout sidecar's file name.

    Raises:
        PathEscapeError, NotRegularFileError, DataFileError: as :func:`_local_extra_state`.
    """
    listing = cd.remote.sizes() if cd.remote is not None else None  # an object store: one listing, no stat
    on_disk: dict[str, int | None]
    if listing is not None:
        on_disk = {n: size for n, size in listing.items() if "/" not in n and DATA_FILE_RE.match(n)}
        extra: list[tuple[str, int, str]] = [
            (rel, size, rel.rsplit("/", 1)[1].rsplit(".", 1)[0])
            for rel, size in sorted(listing.items())
            if rel.startswith("extra_state/") and rel.count("/") == 1
        ]
    else:
        on_disk = _local_data_files(cd)
    data_files: dict[str, int | None] = {}
    for rel in sorted(referenced | set(on_disk)):
        size = on_disk.get(rel)
        if rel not in on_disk:
            try:
                size = cd.file_size(rel)
            except CkptError:
                size = None
        data_files[rel] = size
    if listing is None:
        extra = _local_extra_state(cd)
    sidecar = (sidecar_name in listing) if listing is not None else _sidecar_present(cd.path / sidecar_name)
    return FileListing(data_files, tuple(extra), sidecar)


def _sidecar_present(path: Path) -> bool:
    """Whether something that claims to be the layout sidecar is there: a regular file, and also a symlink
    (dangling or leaving the checkpoint) or a FIFO/device, which reading then refuses (E101/E102/E400)
    instead of taking the checkpoint for unversioned; a plain directory of that name is no record."""
    return os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path))
