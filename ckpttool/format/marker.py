"""The marker that proves a directory is ckpttool's own: ``.ckpttool-output.json`` (``docs/security.md``, outputs).

Every output directory ckpttool writes (``export``, ``import``, ``reshard``, ``sample``) holds this
file at its top level, and so does every temporary directory it writes into. It is written in these
states:

- ``"writing"``, right after the temporary directory is created: the run that owns it (a random
  ``token``, also the last part of the temporary directory's name, the creating ``pid``, its start
  time, ``host`` and Linux ``boot_id``). A temporary directory of a dead run is removed only when
  this proves it (:func:`stale_verdict`); anything else is reported and left alone.
- ``"complete"``, just before the output is published: the same fields plus ``kind`` (the
  command), the ckpttool ``version``, and every file and directory it wrote with the file's size
  and an ``xxh3-128`` digest of its size, first and last MiB (:func:`file_digest`).
- ``"replacing"``, on an object-store prefix only, while ``--overwrite`` publishes a new output over an old
  one (:func:`replacing_doc`): the new output's fields and files plus ``previous``, the old output's
  entries, so that a replacement cut short is still provably ckpttool's and ``--overwrite`` finishes it.

``--overwrite`` replaces a directory only when its marker agrees with its contents: the same
files, directories and symbolic links (never followed), the same sizes and digests, nothing else
(:func:`ownership`). A marker copied into another directory, or a checkpoint added to an output,
disagrees. The marker is a proof against mistakes (a typo in a path, a copied file), not a
signature: someone who writes a marker on purpose that describes a directory's exact contents is
believed. Document layout::

    {"format": "ckpttool-output/1", "state": "complete", "kind": "export", "version": "0.1.0",
     "command": "ckpttool export", "token": "<16 hex>", "pid": 123, "pid_start": 456,
     "host": "node1", "boot_id": "<uuid>|null", "created": "<UTC ISO 8601>",
     "dirs": ["model_assets"], "links": {"rel": "target"},
     "files": {"model.safetensors": [size, "<digest>"], ...}}
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import platform
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.format.digest import new_hasher
from ckpttool.format.jsonview import json_fields

__all__ = [
    "MARKER_NAME",
    "Ownership",
    "RunId",
    "describe_contents",
    "describe_names",
    "digest_parts",
    "listing_disagreement",
    "replacing_doc",
    "parse_marker",
    "file_digest",
    "new_run",
    "ownership",
    "read_marker",
    "recording",
    "seal",
    "stale_verdict",
    "temp_name",
    "write_writing_marker",
]

log = logging.getLogger(__name__)
MARKER_NAME = ".ckpttool-output.json"
FORMAT = "ckpttool-output/1"
WINDOW = 1 << 20  # bytes hashed at each end of a file
MAX_MARKER_BYTES = 64 << 20  # ~600k files; a larger "marker" is not ours
_TMP_NAME = re.compile(r"^\.(?P<name>.+)\.ckpttool-tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".gguf", ".ckpt")


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot, ``/proc/PID/stat`` field 22); ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class RunId:
    """The run that owns a temporary directory: a random token and the creating process."""

    token: str
    pid: int
    pid_start: int | None
    host: str
    boot_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self)


def new_run() -> RunId:
    """A fresh :class:`RunId` for this process (a 64-bit random token)."""
    pid = os.getpid()
    # os.urandom(8).hex() is secrets.token_hex(8); platform.node() is the host name (socket.gethostname())
    return RunId(os.urandom(8).hex(), pid, _pid_start(pid), platform.node(), _boot_id())


def temp_name(target_name: str, run: RunId) -> str:
    """The temporary sibling's name for output ``target_name``: ``.<name>.ckpttool-tmp-<pid>-<token>``."""
    return f".{target_name}.ckpttool-tmp-{run.pid}-{run.token}"


def marker_bytes(doc: dict[str, Any]) -> bytes:
    """The bytes of a marker document, as written locally and to a URL prefix."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _write_json(directory: Path, doc: dict[str, Any]) -> None:
    """Write the marker in ``directory`` through a temporary name and ``os.replace`` (never half-written)."""
    data = marker_bytes(doc)
    part = directory / f"{MARKER_NAME}.part"
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, directory / MARKER_NAME)


def write_writing_marker(directory: Path, run: RunId) -> None:
    """Mark a freshly created temporary directory as this run's (state ``"writing"``).

    Raises:
        OSError: the directory is not writable.
    """
    _write_json(directory, {"format": FORMAT, "state": "writing", **run.to_dict()})


def file_digest(path: Path | str, size: int) -> str:
    """``xxh3-128`` of ``size`` (8 bytes little-endian), the first and the last MiB of the file (the whole
    file up to 2 MiB).

    Raises:
        OSError: unreadable.
    """
    with open(path, "rb") as f:
        if size <= 2 * WINDOW:
            return digest_parts(size, f.read(2 * WINDOW), b"")
        head = f.read(WINDOW)
        f.seek(size - WINDOW)
        return digest_parts(size, head, f.read(WINDOW))


def digest_parts(size: int, head: bytes, tail: bytes) -> str:
    """:func:`file_digest` from the parts already read: ``head`` (the whole file up to 2 MiB, else its first
    MiB) and ``tail`` (``b""``, else its last MiB); for objects read by range requests."""
    h = new_hasher("xxh3-128")
    h.update(size.to_bytes(8, "little"))
    h.update(head)
    h.update(tail)
    return h.hexdigest()


@dataclass
class _Walk:
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size
    dirs: list[str] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)  # relative path -> link target (never followed)
    odd: list[str] = field(default_factory=list)  # devices, FIFOs, sockets


def _walk(root: Path) -> _Walk:
    """Every entry below ``root`` except the top-level marker (symlinks are listed, never followed).

    Raises:
        OSError: a directory cannot be listed.
    """
    w = _Walk()
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                r = f"{rel}/{e.name}" if rel else e.name
                if r in (MARKER_NAME, f"{MARKER_NAME}.part"):
                    continue
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    w.dirs.append(r)
                    stack.append(r)
                elif stat.S_ISREG(st.st_mode):
                    w.files[r] = st.st_size
                elif stat.S_ISLNK(st.st_mode):
                    w.links[r] = os.readlink(e.path)
                else:
                    w.odd.append(r)
    w.dirs.sort()
    w.odd.sort()
    return w


def seal(directory: Path, run: RunId, kind: str) -> None:
    """Write the complete marker of a finished output in ``directory`` (its files, sizes, digests).

    Args:
        directory: the finished temporary directory (every process done writing).
        run: the run that wrote it.
        kind: the command that wrote it (``export``, ``import``, ``reshard``, ``sample``).

    Raises:
        OSError: a file cannot be read or the marker cannot be written.
    """
    import ckpttool

    w = _walk(directory)
    doc = {
        "format": FORMAT,
        "state": "complete",
        **run.to_dict(),
        "kind": kind,
        "command": f"ckpttool {kind}",
        "version": ckpttool.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dirs": w.dirs,
        "links": dict(sorted(w.links.items())),
        "files": {rel: [size, file_digest(directory / rel, size)] for rel, size in sorted(w.files.items())},
    }
    _write_json(directory, doc)


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker document of ``directory``; ``None`` when absent, not a regular file, too large or not a
    marker (any of these means "not proven ours")."""
    p = directory / MARKER_NAME
    try:
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MARKER_BYTES:
            return None
        with open(p, "rb") as f:
            return parse_marker(f.read(MAX_MARKER_BYTES + 1))
    except OSError:
        return None


@dataclass(frozen=True)
class Ownership:
    """Whether a directory is provably a complete ckpttool output, and what was found otherwise.

    ``owned``: the marker agrees with the contents (or the directory is empty). ``found``: what the
    directory holds, for messages (``"a DCP checkpoint (.metadata, 4 data files)"``). ``why``: how
    the marker disagrees (``""`` when there is none or it agrees).
    """

    owned: bool
    found: str
    why: str = ""
    kind: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def describe_contents(directory: Path) -> str:
    """What ``directory`` holds, in words: a DCP checkpoint, a Hugging Face model folder, a PEFT adapter,
    a git repository, or ``N files`` with the first names (top level only; nothing is read)."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        return f"an unreadable directory ({e.strerror})"
    return describe_names(names)


def describe_names(names: Any) -> str:
    """:func:`describe_contents` from the top-level names (an object store's listing)."""
    visible = sorted(n for n in names if n != MARKER_NAME)
    weights = [n for n in visible if n.endswith(_WEIGHTS)]
    if ".metadata" in visible or any(n.endswith(".metadata") and n.startswith("__") for n in visible):
        return f"a DCP checkpoint (.metadata, {_plural(sum(n.endswith('.distcp') for n in visible), 'data file')})"
    if "adapter_config.json" in visible:
        return "a PEFT adapter (adapter_config.json)"
    hf = [n for n in ("config.json", "model.safetensors.index.json", "generation_config.json") if n in visible]
    if hf or weights:
        return f"a model folder ({', '.join(hf + ([_plural(len(weights), 'weight file')] if weights else []))})"
    if ".git" in visible:
        return "a git repository (.git)"
    shown = ", ".join(visible[:3]) + (", ..." if len(visible) > 3 else "")
    n = len(visible)
    return f"{n} {'entry' if n == 1 else 'entries'} ({shown})" if visible else "nothing"


def _disagreement(directory: Path, doc: dict[str, Any]) -> str:
    """How the complete marker ``doc`` disagrees with the contents of ``directory`` (``""``: it agrees)."""
    files, dirs = doc.get("files"), doc.get("dirs")
    if (
        doc.get("state") != "complete"
        or not isinstance(files, dict)
        or not isinstance(dirs, list)
        or not all(isinstance(d, str) for d in dirs)
    ):
        return f"its {MARKER_NAME} is not a complete output's (an unfinished temporary directory?)"
    try:
        w = _walk(directory)
    except OSError as e:
        return f"it cannot be listed ({e.strerror})"
    if w.odd:
        return f"{w.odd[0]} is a device, FIFO or socket, which ckpttool never writes"
    links = doc.get("links", {})
    if not isinstance(links, dict) or w.links != links:
        bad = sorted(set(w.links) ^ set(links if isinstance(links, dict) else ())) or sorted(w.links)
        return f"symbolic links differ from what {MARKER_NAME} records" + (f" ({bad[0]})" if bad else "")
    extra = sorted(set(w.files) - set(files)) or sorted(set(w.dirs) - set(dirs))
    if extra:
        return f"{extra[0]} is not listed in {MARKER_NAME} (not part of the output ckpttool wrote)"
    missing = sorted(set(files) - set(w.files)) or sorted(set(dirs) - set(w.dirs))
    if missing:
        return f"{missing[0]}, listed in {MARKER_NAME}, is missing"
    for rel, size in sorted(w.files.items()):
        entry = files[rel]
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == size):
            return f"{rel} differs in size from what {MARKER_NAME} records"
        try:
            digest = file_digest(directory / rel, size)
        except OSError as e:
            return f"{rel} cannot be read ({e.strerror})"
        if digest != entry[1]:
            return f"{rel} differs in content from what {MARKER_NAME} records"
    return ""


def replacing_doc(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The marker a URL prefix holds while ``--overwrite`` replaces the output of marker ``old`` with ``new``.

    State ``"replacing"``: ``new``'s fields, its ``files`` (what the prefix will hold), and ``previous``: name ->
    the ``[size, digest]`` entries an object of that name may still have from the outputs it replaces (``old``'s
    files, and its own ``previous`` when ``old`` is itself an interrupted replacement). Never a complete output;
    ``--overwrite`` may replace a prefix that agrees with it (:func:`listing_disagreement`), so an interrupted
    replacement is finished by running it again.
    """
    previous: dict[str, list[Any]] = {}
    seen: set[tuple[str, int, str]] = set()  # a set, not `in` on the lists: a planted marker's 10^6 entries stay linear
    old_files, old_prev = old.get("files"), old.get("previous")
    old_files = old_files if isinstance(old_files, dict) else {}
    old_prev = old_prev if isinstance(old_prev, dict) else {}
    for rel, entries in [*((r, [e]) for r, e in old_files.items()), *old_prev.items()]:
        for entry in entries if isinstance(entries, list) else ():
            if _entry_ok(entry) and (rel, entry[0], entry[1]) not in seen:
                seen.add((rel, entry[0], entry[1]))
                previous.setdefault(rel, []).append(entry)
    return {**new, "state": "replacing", "previous": dict(sorted((r, e) for r, e in previous.items() if e))}


def _entry_ok(entry: Any) -> bool:
    """A marker's ``[size, digest]`` file entry."""
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], int)
        and not isinstance(entry[0], bool)
        and isinstance(entry[1], str)
    )


def _listing_entries(doc: dict[str, Any], replacing: bool) -> dict[str, list[Any]] | None:
    """Name -> the ``[size, digest]`` entries an object of the listing may have under marker ``doc`` (``None``: the
    marker proves no output: not complete, nor, with ``replacing``, an interrupted replacement)."""
    files, state = doc.get("files"), doc.get("state")
    if not isinstance(files, dict) or state not in ("complete", *(("replacing",) if replacing else ())):
        return None
    entries = {rel: [e] for rel, e in files.items()}
    if state == "replacing":
        previous = doc.get("previous")
        if not isinstance(previous, dict) or not all(isinstance(v, list) for v in previous.values()):
            return None
        for rel, alts in previous.items():
            entries.setdefault(rel, []).extend(alts)
    return entries


def listing_disagreement(
    doc: dict[str, Any] | None, sizes: dict[str, int], read: Any, *, replacing: bool = False
) -> str:
    """How a marker ``doc`` disagrees with an object-store listing (``""``: it agrees).

    Args:
        doc: the parsed marker (``None``: none could be read).
        sizes: object name (relative, ``/``-separated) -> size, the marker excluded.
        read: ``read(name, start, end) -> bytes``, a range read of one object.
        replacing: accept an interrupted replacement's marker (:func:`replacing_doc`): every object is one its
            marker names, of the new output or of one it replaces; objects may be missing (``--overwrite``).
    """
    if doc is None:
        return f"no {MARKER_NAME}"
    entries = _listing_entries(doc, replacing)
    if entries is None:
        return f"its {MARKER_NAME} is not a complete output's"
    extra = sorted(set(sizes) - set(entries))
    if extra:
        return f"{extra[0]} is not listed in {MARKER_NAME} (not part of the output ckpttool wrote)"
    missing = sorted(set(doc["files"]) - set(sizes))
    if missing and doc.get("state") == "complete":
        return f"{missing[0]}, listed in {MARKER_NAME}, is missing"
    for rel, size in sorted(sizes.items()):
        alts = [e for e in entries[rel] if _entry_ok(e) and e[0] == size]
        if not alts:
            return f"{rel} differs in size from what {MARKER_NAME} records"
        if size <= 2 * WINDOW:
            got = digest_parts(size, read(rel, 0, size) if size else b"", b"")
        else:
            got = digest_parts(size, read(rel, 0, WINDOW), read(rel, size - WINDOW, size))
        if all(got != e[1] for e in alts):
            return f"{rel} differs in content from what {MARKER_NAME} records"
    return ""


def parse_marker(data: bytes) -> dict[str, Any] | None:
    """A marker document from its bytes; ``None`` when it is not one."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def ownership(directory: Path) -> Ownership:
    """Whether ``--overwrite`` may replace ``directory``: empty, or holding a complete marker that agrees
    with every file, directory and symbolic link in it (names, sizes, digests, link targets).

    Reads the marker and up to 2 MiB of each file; never follows a symbolic link. Never raises for
    what it finds (an unreadable directory is "not owned").
    """
    try:
        empty = not any(os.scandir(directory))
    except OSError as e:
        return Ownership(False, f"an unreadable directory ({e.strerror})")
    if empty:
        return Ownership(True, "nothing")
    doc = read_marker(directory)
    if doc is None:
        present = os.path.lexists(directory / MARKER_NAME)
        found = describe_contents(directory)
        why = f"its {MARKER_NAME} cannot be read as a ckpttool marker" if present else f"no {MARKER_NAME}"
        return Ownership(False, found, why)
    why = _disagreement(directory, doc)
    kind = doc.get("kind") if isinstance(doc.get("kind"), str) else None
    if why:
        return Ownership(False, describe_contents(directory), why, kind)
    return Ownership(True, f"a ckpttool {kind or 'output'} output", "", kind)


def stale_verdict(entry: Path, target_name: str, *, source: Path | None) -> tuple[bool, str]:
    """Whether ``entry`` (in the output's parent) is an abandoned temporary directory of a ckpttool run for
    output ``target_name`` that may be removed: ``(True, "")``, or ``(False, why it stays)``.

    It may be removed only when its name has the temporary form for this output, it is a real directory
    (no symlink), its marker names the same token and pid as its name and the state ``"writing"`` (a
    finished output renamed to that name is kept), was written on this host, its
    process is gone (no such pid, another process with that pid, or another boot), and it is neither
    the source being read nor holds it. A live run's directory gives ``(False, "")`` (not worth a
    warning).
    """
    m = _TMP_NAME.match(entry.name)
    if m is None or m.group("name") != target_name:
        return False, ""
    if entry.is_symlink() or not entry.is_dir():
        return False, "it is not a directory ckpttool created"
    if source is not None:
        with contextlib.suppress(OSError):
            s, e = source.resolve(), entry.resolve()
            if s == e or e in s.parents or s in e.parents:
                return False, "it is the source checkpoint being read"
    doc = read_marker(entry)
    pid = int(m.group("pid"))
    if doc is None:
        if _pid_alive(pid):  # a live run between creating its directory and writing its marker: leave it
            return False, ""
        return False, f"it holds no {MARKER_NAME} proving ckpttool created it"
    if doc.get("token") != m.group("token") or doc.get("pid") != pid:
        return False, f"its {MARKER_NAME} names another run than its name (a copy?)"
    if doc.get("state") != "writing":
        return False, f"its {MARKER_NAME} says it is a finished output (renamed?), not one being written"
    if doc.get("host") != platform.node():
        return False, f"it was created on host {str(doc.get('host'))[:64]!r}, whose processes cannot be checked here"
    boot = _boot_id()
    if boot is not None and doc.get("boot_id") not in (None, boot):
        return True, ""  # written before the last reboot: its process is gone
    if _pid_alive(pid):
        start = doc.get("pid_start")
        if start is None or _pid_start(pid) in (None, start):
            return False, ""  # the run is alive (or cannot be told apart from one): leave it
    return True, ""


@contextlib.contextmanager
def recording(directory: Path, relative: str) -> Iterator[None]:
    """Keep a ckpttool output's marker true while the body writes file ``relative`` into it (``manifest``,
    ``stamp``): if ``directory`` was provably ours before, the marker lists the new file afterwards.
    A directory that was not (no marker, or one that disagreed) is left as it is. A marker that
    cannot be rewritten is logged (the output then no longer proves itself ours: ``--overwrite``
    refuses it, which is safe).
    """
    doc = read_marker(directory)
    owned = doc is not None and not _disagreement(directory, doc)
    yield
    if not owned or doc is None:
        return
    try:
        _record(directory, relative, doc)
    except OSError as e:
        log.warning("%s: could not add %s to %s (%s)", directory, relative, MARKER_NAME, e.strerror or e)


def _record(directory: Path, relative: str, doc: dict[str, Any]) -> None:
    p = directory / relative
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        doc["files"].pop(relative, None)
    else:
        if not stat.S_ISREG(st.st_mode):
            return
        doc["files"][relative] = [st.st_size, file_digest(p, st.st_size)]
        parts = relative.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in doc["dirs"]:
                doc["dirs"].append(d)
        doc["dirs"].sort()
    doc["files"] = dict(sorted(doc["files"].items()))
    _write_json(directory, doc)
