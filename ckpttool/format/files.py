"""Opening files of untrusted inputs: confined to a directory, regular files only, sizes capped before reading.

Every file ckpttool reads or copies from an input (``.metadata``, data files, ``layout.json``,
``extra_state/*``, ``--model-assets`` files, ``--config``, ``--against``) goes through these
functions: a path that resolves (after ``..`` and symlinks) outside its directory is
:class:`~ckpttool.errors.PathEscapeError` (``E101``) — but for a Hugging Face hub snapshot's links
into its own repository's ``blobs/`` (:func:`hub_blobs`); a device, FIFO, socket or directory is
:class:`~ckpttool.errors.NotRegularFileError` (``E102``), checked on the open descriptor (the
open is non-blocking, so a FIFO cannot hang it); a file larger than its cap is
:class:`~ckpttool.errors.SizeLimitError` (``E307``) before a byte is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpttool.errors import (
    CkptError,
    DataFileError,
    NotRegularFileError,
    PathEscapeError,
    SizeLimitError,
    UsageError,
    shell_arg,
)
from ckpttool.format import limits

__all__ = [
    "resolve_inside",
    "confined",
    "hub_blobs",
    "hub_snapshot",
    "hub_hint",
    "file_kind",
    "open_regular",
    "read_regular",
    "read_regular_owned",
    "refuse_directory",
    "copy_regular",
    "missing_path_hint",
    "unexpanded_tilde_hint",
    "refuse_unexpanded_tilde_output",
    "hub_repository",
    "hub_unfinished_download",
    "hub_main_not_in_cache",
    "link_to_nothing",
    "refuse_link_to_nothing",
    "UNREADABLE_HINT",
]

#: The hint of a file or folder this user may not read or list (chmod 000, another user's): not damage, not missing.
UNREADABLE_HINT = "make it readable by this user (chmod/chown) and run again"


def unexpanded_tilde_hint(path: Path | str) -> str | None:
    """The hint for a missing path that starts with a ``~`` the shell left as it is (``'~/ckpt'`` in quotes,
    ``--model-assets=~/assets`` after ``=``): the path it stands for; ``None`` for any other path."""
    path = Path(path)
    head = path.parts[0] if path.parts else ""
    home = Path(os.path.expanduser(path))
    if not head.startswith("~") or home == path or os.path.lexists(path):  # a folder named `~` is taken as given
        return None
    told = f"the shell did not expand {head} (it does not inside quotes or after an option's =)"
    return f"{told}: pass {shell_arg(home)}" if home.exists() else f"{told}; {home} does not exist either"


def refuse_unexpanded_tilde_output(path: str | os.PathLike[str], option: str = "") -> None:
    """Refuse an output path that starts with a ``~`` the shell left as it is (``'~/hf'`` in quotes,
    ``--junit=~/r.xml`` after ``=``): written as given, the output would go into a folder literally named ``~``
    in the current directory, made for it. A folder ``~`` that exists there already is taken as given.

    Args:
        path: the output as the user gave it (before it is made absolute); option: the flag that named it, or
            ``""`` for a positional OUT.

    Raises:
        OutputError (E600): naming the path and, as the hint, the path it stands for.
    """
    from ckpttool.errors import OutputError

    text = os.fspath(path)
    parts = Path(text).parts
    head = parts[0] if parts else ""
    home = os.path.expanduser(text)
    if not head.startswith("~") or home == text or os.path.lexists(head):
        return
    shown = f"{option} {text}" if option else text
    raise OutputError(
        f"{shown}: the shell did not expand {head} (it does not inside quotes or after an option's =); "
        f"as given, it names a folder {head} in the current directory, not the home folder",
        path=Path(text),
        hint=f"pass {shell_arg(home)}",
    )


def missing_path_hint(path: Path, what: str) -> str:
    """A hint for a path that does not exist: a symbolic link that leads nowhere said to be one; the directories
    beside it with a close name (a typo), else the nearest folder above it that exists and a few of its
    subdirectories; ``pass {what}`` when neither helps. A path that starts with a ``~`` the shell left as it
    is (quoted, or after ``--option=``) is named with its expansion."""
    import difflib

    # a link that leads nowhere (dangling, or a loop: a -> b -> a): the path itself, or a folder of it (a/x, a a loop)
    link = next((p for p in (path, *path.parents) if os.path.islink(p) and not os.path.exists(p)), None)
    if link is not None:
        try:
            target = os.readlink(link)
        except OSError:
            target = "?"
        if link != path:
            return f"{link}, in the path, is a symbolic link to {target} that leads to nothing (dangling, or a loop)"
        return f"{path} is a symbolic link to {target} that leads to nothing (dangling, or a loop): pass {what} itself"
    tilde = unexpanded_tilde_hint(path)
    if tilde is not None:
        return tilde
    missing, parent, tail = path.name, path.parent, Path()
    while not parent.is_dir() and parent != parent.parent:
        missing, parent, tail = parent.name, parent.parent, Path(missing) / tail
    try:
        names = sorted(e.name for e in os.scandir(parent) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return f"pass {what}"
    close = [parent / c for c in difflib.get_close_matches(missing, names, n=3, cutoff=0.6)]
    whole = [c / tail for c in close if (c / tail).exists()]  # the rest of the path given, where it exists
    if close:
        return "did you mean " + " or ".join(map(shell_arg, whole or close)) + "?"
    if not names:
        return f"pass {what} ({parent} holds no directory)"
    more = f", ... ({len(names)} in all)" if len(names) > 6 else ""
    return f"pass {what}; {parent} holds {', '.join(names[:6])}{more}"


_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


#: The repository folders of a Hugging Face hub cache (``huggingface_hub``'s ``file_download.py``:
#: ``<cache>/models--ORG--NAME/snapshots/<revision>/<file>`` is a relative symlink to ``../../blobs/<etag>``).
_HUB_REPOS = ("models--", "datasets--", "spaces--")


def hub_blobs(directory: Path) -> Path | None:
    """``<repo>/blobs`` when the resolved ``directory`` is a hub snapshot ``<repo>/snapshots/<revision>`` or a
    folder below one (``<repo>`` named ``models--*``, ``datasets--*`` or ``spaces--*``), else ``None``."""
    for d in (directory, *directory.parents):
        if d.parent.name == "snapshots" and d.parent.parent.name.startswith(_HUB_REPOS):
            return d.parent.parent / "blobs"
    return None


def hub_repository(path: Path) -> Path | None:
    """The Hugging Face hub repository folder (``models--ORG--NAME``, ``datasets--*``, ``spaces--*``, holding
    ``snapshots/`` or ``blobs/``) that ``path`` is or lies below, symlinks resolved (``path`` need not exist yet: its
    nearest existing folder is resolved), else ``None``. ``huggingface_hub`` manages these folders: a file added to a
    snapshot is listed as a file of that revision, and ``hf cache delete`` removes the whole folder."""
    p = Path(os.path.abspath(path))
    tail: list[str] = []
    while not os.path.lexists(p) and p != p.parent:
        tail.insert(0, p.name)
        p = p.parent
    try:
        p = p.resolve().joinpath(*tail)
    except (OSError, RuntimeError):  # a symlink loop: judged by its names
        p = p.joinpath(*tail)
    for d in (p, *p.parents):
        if d.name.startswith(_HUB_REPOS) and (_probe_dir(d / "snapshots") or _probe_dir(d / "blobs")):
            return d
    return None


def _probe_dir(p: Path) -> bool:
    """``p`` is a directory; ``False`` where it cannot be looked at (a name over 255 bytes, a folder this user may
    not search): the caller's own open then names the path given, not ``p``."""
    try:
        return p.is_dir()
    except OSError:
        return False


def hub_unfinished_download(directory: Path) -> str | None:
    """A hint for a folder ``huggingface_hub`` is still downloading into, else ``None``: a hub snapshot
    (:func:`hub_blobs`) whose repository's ``blobs/`` holds ``<hash>.incomplete`` files (the snapshot's link to a file
    is made once its blob is complete, so the file is missing from the snapshot until then), or an
    ``hf download --local-dir`` folder whose ``.cache/huggingface/download/`` holds ``*.incomplete`` files (the file
    is moved into place once complete)."""
    try:
        blobs = hub_blobs(directory.resolve())
    except (OSError, RuntimeError):
        return None
    staging = blobs if blobs is not None else directory / ".cache" / "huggingface" / "download"
    base, rel = (blobs.parent, "blobs") if blobs is not None else (directory, ".cache/huggingface/download")
    try:
        resolve_inside(base, rel, what="download folder")  # a link out of the folder is not listed
        unfinished = sum(1 for e in os.scandir(staging) if e.name.endswith(".incomplete"))
    except (OSError, RuntimeError, CkptError):
        return None
    if not unfinished:
        return None
    if blobs is None:
        where, command, again = "this folder", "the download (`hf download ... --local-dir`)", "folder"
    else:
        command = _download_command(blobs.parent) or "the download"
        where, again = "the hub cache", "snapshot"
    return (
        f"a download into {where} is not finished ({unfinished} .incomplete file(s) in {staging}): "
        f"let {command} finish (or run it again if it stopped), then pass the {again} again"
    )


def _download_command(repo: Path) -> str | None:
    """```hf download ORG/NAME``` for a hub model repository folder ``models--ORG--NAME``; ``None`` for a dataset's or
    a space's (their download takes ``--repo-type``)."""
    kind, _, name = repo.name.partition("--")
    return f"`hf download {name.replace('--', '/', 1)}`" if kind == "models" else None


def link_to_nothing(link: Path) -> tuple[str, str]:
    """The message and hint for a file ``link`` that is a symlink to nothing (a hub snapshot's link whose blob is
    gone, or not downloaded yet): a file of the model missing, named by the link, not damage."""
    return (
        f"{link}: links to {os.readlink(link)!r:.120}, which does not exist",
        hub_unfinished_download(link.parent)
        or "the file the link points to is missing (a hub cache blob deleted or not downloaded); download or copy "
        "the complete model",
    )


def refuse_link_to_nothing(link: Path, param: str | None = None) -> None:
    """Refuse a file ``link`` that is a symlink to nothing (a hub snapshot's link whose blob is gone), named by the
    link, not by the blob it names: a file missing, not a damaged one (:func:`hub_unfinished_download` says where a
    download is still running).

    Raises:
        UsageError (E100): as above; ``param`` the option that named the folder.
    """
    if not os.path.islink(link) or os.path.exists(link):
        return
    message, hint = link_to_nothing(link)
    raise UsageError(message, path=link, param=param, hint=hint)


def hub_snapshot(repo: Path) -> Path | None:
    """The snapshot a hub repository folder ``repo`` (``models--ORG--NAME``) points at: ``snapshots/<refs/main>``,
    else its only snapshot; ``None`` when ``repo`` is no hub repository or the choice is not clear."""
    if not repo.name.startswith(_HUB_REPOS) or not (repo / "snapshots").is_dir():
        return None
    rev = _main_revision(repo)
    if rev and (repo / "snapshots" / rev).is_dir():
        return repo / "snapshots" / rev
    if rev:  # main is a revision not in the cache: another snapshot is not "the" model
        return None
    revs = [d for d in (repo / "snapshots").iterdir() if d.is_dir()]
    return revs[0] if len(revs) == 1 else None


def _main_revision(repo: Path) -> str:
    """The revision ``repo/refs/main`` names (``""``: none, or not a plain name)."""
    try:  # huggingface_hub writes it as a file of the repository folder: a link out of it is not followed
        rev = read_regular(resolve_inside(repo, "refs/main", what="refs/main"), 256).decode("ascii").strip()
    except (OSError, RuntimeError, CkptError, UnicodeDecodeError):
        return ""
    return rev if "/" not in rev and rev not in (".", "..") and "\0" not in rev else ""


def hub_main_not_in_cache(repo: Path) -> str | None:
    """The revision a hub repository folder's ``refs/main`` names when ``snapshots/`` holds no folder of it (its
    download not finished, or the snapshot removed), else ``None``."""
    if not repo.name.startswith(_HUB_REPOS) or not (repo / "snapshots").is_dir():
        return None
    rev = _main_revision(repo)
    return rev if rev and not (repo / "snapshots" / rev).is_dir() else None


def hub_hint(directory: Path) -> str | None:
    """A hint for a Hugging Face hub repository folder (``models--ORG--NAME``), its ``blobs/``, or a hub cache root
    (the folder holding them) given where a model folder is wanted: the snapshot to pass (:func:`hub_snapshot`); ``None``
    when ``directory`` is neither (or no snapshot of it is clear)."""
    snapshot = hub_snapshot(directory)
    if snapshot is not None:
        return f"a Hugging Face hub repository folder: pass its snapshot, {snapshot}"
    blobs_of = hub_snapshot(directory.parent) if directory.name == "blobs" else None
    if blobs_of is not None:  # the files by content hash, no names: the snapshot names them
        return f"the blobs of a Hugging Face hub repository (files named by hash): pass its snapshot, {blobs_of}"
    if directory.name.startswith(_HUB_REPOS) and (directory / "snapshots").is_dir():  # no refs/main to choose by
        revs = sorted(str(d) for d in (directory / "snapshots").iterdir() if d.is_dir())
        main = hub_main_not_in_cache(directory)
        if main is not None:  # the snapshots there are other revisions than the model's main
            fetch = _download_command(directory) or "its download"
            more = f", ... ({len(revs)} in all)" if len(revs) > 3 else ""
            listed = f", or pass the snapshot of the revision you mean, {', '.join(revs[:3])}{more}" if revs else ""
            return (
                f"its refs/main names revision {main[:64]}, which has no snapshot in the cache (a download not "
                f"finished, or the snapshot removed): run {fetch} to fetch it{listed}"
            )
        if revs:
            more = f", ... ({len(revs)} in all)" if len(revs) > 3 else ""
            return f"a Hugging Face hub repository folder: pass one of its snapshots, {', '.join(revs[:3])}{more}"
    try:
        repos = sorted(e.name for e in os.scandir(directory) if e.is_dir() and e.name.startswith(_HUB_REPOS[0]))
    except OSError:
        return None
    snapshots = [s for s in (hub_snapshot(directory / r) for r in repos) if s is not None]
    if not snapshots:
        return None
    more = f", ... ({len(snapshots)} in all)" if len(snapshots) > 3 else ""
    return f"a Hugging Face hub cache: pass the snapshot of one model, {', '.join(map(str, snapshots[:3]))}{more}"


def confined(target: Path, root: Path) -> bool:
    """Whether the resolved ``target`` is the resolved ``root``, lies below it, or is a blob of the hub repository
    whose snapshot ``root`` is (:func:`hub_blobs`)."""
    return target == root or root in target.parents or target.parent == hub_blobs(root)


def resolve_inside(root: Path, relative: str | os.PathLike[str], *, what: str = "path") -> Path:
    """``root / relative`` with every symlink resolved, refused unless it stays inside ``root``.

    In a Hugging Face hub snapshot (:func:`hub_blobs`) a file may also resolve to a blob of the same
    repository (``<repo>/blobs/<etag>``): that is where the hub cache keeps a snapshot's files.

    Args:
        root: the directory the file must lie in (resolved here).
        relative: a path relative to ``root`` (absolute paths, NUL and empty paths are refused).
        what: how the path is named in messages.

    Raises:
        PathEscapeError: absolute, empty, ``..`` or a symlink that leaves ``root`` (and its repository's blobs).
    """
    rel = os.fspath(relative)
    base = root.resolve()
    if not rel or "\x00" in rel or os.path.isabs(rel):
        raise PathEscapeError(f"{root}: {what} {rel!r} is absolute or empty", path=rel)
    target = (base / rel).resolve()
    if not confined(target, base):
        raise PathEscapeError(f"{root}: {what} {rel!r} resolves outside {root} ({target})", path=rel)
    return target


def file_kind(mode: int) -> str:
    """What an ``st_mode`` that is not a regular file's is, as errors say it (``a FIFO``, ``a socket``)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def refuse_directory(path: Path, param: str, what: str) -> None:
    """Refuse a directory given where the user names a file (``--rules``, ``--adapter-config``): not the
    special-file hint of :func:`open_regular`, which is about devices and FIFOs.

    Raises:
        NotRegularFileError (E102): ``path`` is a directory; ``param`` (the library parameter, shown as its flag)
        and ``what`` (``a YAML rules file``) name what was expected.
    """
    if path.is_dir():
        raise NotRegularFileError(
            f"`{param}` {path} is a directory, not {what}",
            path=path,
            param=param,
            hint="pass the file itself, not the folder holding it",
        )


def open_regular(path: Path, *, shown: str | os.PathLike[str] | None = None) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (checked on the open descriptor).

    The open is non-blocking, so a FIFO cannot hang it; devices, FIFOs, sockets and
    directories are refused before a byte is read.

    Raises:
        NotRegularFileError: ``path`` is not a regular file.
        OSError: it cannot be opened (missing, permissions); callers name their own error.
    """
    fd = os.open(path, _O_READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(
                f"{shown if shown is not None else path} is {file_kind(st.st_mode)}, not a regular file", path=path
            )
        if _O_READ & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_capped(path: Path, cap: int, shown: str | os.PathLike[str] | None, what: str) -> tuple[int, int]:
    """The descriptor and size of regular file ``path``, refused when larger than ``cap`` bytes."""
    fd = open_regular(path, shown=shown)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise _over_cap(path, cap, shown, what, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _over_cap(
    path: Path, cap: int, shown: str | os.PathLike[str] | None, what: str, size: int | None = None
) -> SizeLimitError:
    of = f" of {size} bytes" if size is not None else ""  # without: the file grew while being read
    return SizeLimitError(
        f"{shown if shown is not None else path}: {what}{of} is over the cap of {limits.human(cap)}", path=path
    )


def read_regular(path: Path, cap: int, *, shown: str | os.PathLike[str] | None = None, what: str = "file") -> bytes:
    """The content of regular file ``path``, refused before reading when larger than ``cap`` bytes.

    Raises:
        NotRegularFileError: not a regular file.
        SizeLimitError: larger than ``cap`` (``ckpttool --max-object-size`` raises the default).
        OSError: cannot be opened or read.
    """
    fd, size = _open_capped(path, cap, shown, what)
    try:
        chunks, got = [], 0
        want = size + 1  # the whole file in one read (no second copy by the join), then to its end
        while True:
            piece = os.read(fd, min(want, cap + 1 - got))
            want = 1 << 24
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
            if got > cap:
                raise _over_cap(path, cap, shown, what)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_owned(
    path: Path, cap: int, *, shown: str | os.PathLike[str] | None = None, what: str = "file"
) -> bytearray:
    """:func:`read_regular` into a ``bytearray`` of the caller's own (the native ``.metadata`` parse
    releases its pages as it reads them: :func:`ckpttool.format.mdscan.scan_metadata_owned`).

    Raises:
        as :func:`read_regular`.
    """
    fd, size = _open_capped(path, cap, shown, what)
    try:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        try:
            while got < size:
                n = os.readv(fd, [view[got:]])
                if not n:  # cut while being read
                    break
                got += n
        finally:
            view.release()
        if got < size:
            del buf[got:]
        while more := os.read(fd, min(1 << 24, cap + 1 - len(buf))):  # grown while being read: to its end
            buf += more
            if len(buf) > cap:
                raise _over_cap(path, cap, shown, what)
        return buf
    finally:
        os.close(fd)


def copy_regular(src: Path, dst: Path, *, shown: str | os.PathLike[str] | None = None) -> None:
    """Copy regular file ``src`` (checked on its open descriptor: never a device or FIFO) to a new file ``dst``.

    Raises:
        NotRegularFileError: ``src`` is not a regular file.
        DataFileError: ``src`` cannot be opened (moved or deleted since it was listed).
        OSError: reading or writing failed.
    """
    from ckpttool.format.copy import copy_range

    try:
        fd = open_regular(src, shown=shown)
    except OSError as e:
        raise DataFileError(
            f"{shown if shown is not None else src}: cannot read ({e.strerror}); was it moved or deleted while it "
            "was read?",
            path=src,
            hint="leave the source in place until the command ends, then run it again",
        ) from e
    try:
        size = os.fstat(fd).st_size
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            copy_range(fd, out, 0, 0, size)
        finally:
            os.close(out)
    finally:
        os.close(fd)
