"""Allow-list unpickling of DCP ``.metadata`` and of small ``torch.save`` payloads.

torch's ``FileSystemReader.read_metadata`` runs plain ``pickle.load`` on
``.metadata``: any global the file names is imported and may be called. This
module never does that. :class:`MetadataUnpickler` resolves exactly the globals
torch 2.x writes into ``.metadata`` (docs/design.md §6) to light stand-ins
defined here, so reading metadata neither executes foreign code nor imports
torch; any other global raises :class:`~ckpttool.errors.UnsafePickleError`
naming it. The stand-in objects are then validated field by field and converted
to the frozen dataclasses of :mod:`ckpttool.format.metadata`.

:class:`PrimitiveUnpickler` reads ``data.pkl`` of a ``torch.save`` archive that
holds only plain Python values (floats, ints, strings, lists, tuples, dicts) —
what DCP stores for param-group hyperparameters — again without importing torch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import re
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from ckpttool.errors import (
    CkptError,
    IntegerRangeError,
    MetadataError,
    ObjectGraphError,
    PlannerDataError,
    Refusal,
    SizeLimitError,
    UnsafePickleError,
)
from ckpttool.format import limits
from ckpttool.format.metadata import (
    DTYPE_ITEMSIZE,
    BytesMeta,
    CheckpointMetadata,
    ChunkMeta,
    DType,
    StorageInfo,
    TensorMeta,
)
from ckpttool.format.pickleframes import pickle_input

__all__ = [
    "OLMO_STORAGE_INFO",
    "UNREADABLE_PICKLE",
    "load_metadata",
    "parse_metadata_bytes",
    "parse_metadata_owned",
    "gc_paused",
    "PrimitiveUnpickler",
    "PlainGlobalsUnpickler",
    "AttributeBag",
    "EnumValue",
    "enum_stand_in",
    "path_stand_in",
    "AllowListUnpickler",
    "MetadataUnpickler",
    "check_object_graph",
    "check_record_bound",
    "short_repr",
    "MAX_INT_BITS",
]

MAX_NDIM = 64
#: What the C unpickler (and :func:`~ckpttool.format.pickleframes.check_memo`) raises on a pickle that is
#: not readable: beyond ``UnpicklingError``, ``APPEND`` onto a set is an ``AttributeError``, a bad ``PUT``
#: line a ``ValueError``, ``BINBYTES8`` past ``sys.maxsize`` an ``OverflowError``, ``SETITEM`` onto a list an ``IndexError``
UNREADABLE_PICKLE = (
    ValueError,
    EOFError,
    pickle.UnpicklingError,
    TypeError,
    RecursionError,
    MemoryError,
    AttributeError,
    IndexError,
    KeyError,
    OverflowError,
)
_DTYPE_LIKE = re.compile(r"^(?:u?int\d+|float\d+(?:_[a-z0-9]+)*|bfloat\d+|complex\d+|q?u?int\d+x\d+|bits\w+)$")
MAX_DIM_SIZE = 2**62
MAX_OFFSET = 2**63 - 1  # torch stores offsets and lengths as int64
#: Integers in byte items and JSON beyond this many bits are refused (a 128-bit RNG state fits;
#: 2**20000 would fail every formatting and float conversion downstream).
MAX_INT_BITS = 256


def short_repr(v: Any, width: int = 60) -> str:
    """``repr`` of an untrusted value for a message: never fails (huge ints, odd objects), at most ``width`` chars."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"<int of {v.bit_length()} bits>"
    if isinstance(v, (list, tuple, dict, set, frozenset)) and not (
        len(v) <= 8
        and all(
            type(x) in (str, int, float, bool) and not (type(x) is int and x.bit_length() > 64)
            for x in ([*v, *v.values()] if isinstance(v, dict) else v)  # a dict's values may be the bomb
        )
    ):
        return f"<{type(v).__name__} of {len(v)} items>"  # never repr a container: it may be a pickle bomb
    try:
        text = repr(v)
    except Exception:
        text = f"<{type(v).__name__}>"
    return text if len(text) <= width else text[: width - 3] + "..."


# --------------------------------------------------------------------------- stand-ins
def _no_build(state: Any) -> None:
    """``__setstate__`` of the stand-ins a pickle reaches as globals (:meth:`AllowListUnpickler.find_class`): a
    ``BUILD`` on the global itself would otherwise set attributes of ckpttool's own function or class (``__name__``,
    ``__defaults__``, a class attribute) for the rest of the process."""
    raise UnsafePickleError("pickle BUILD on a global itself (it would change the global for the rest of the process)")


class _Sealed(type):
    """Metaclass of the record stand-ins: a ``BUILD`` on the class itself is refused (:func:`_no_build`); a ``BUILD``
    on an instance still fills its ``__dict__`` (the class has no ``__setstate__``)."""

    def __setstate__(cls, state: Any) -> None:
        _no_build(state)


class _Record(metaclass=_Sealed):
    """Attribute bag that a pickled dataclass is rebuilt into (NEWOBJ + BUILD).

    No ``__setstate__``: pickle's C BUILD fills ``__dict__`` from the dict state,
    which keeps unpickling 10^5-entry metadata fast.
    """

    _kind = "record"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # pickle builds a dataclass with NEWOBJ (``cls.__new__``, no ``__init__``); a REDUCE/OBJ call of
        # the class is not what torch writes, and would escape the record count of check_record_bound
        raise UnsafePickleError(f"pickle calls {type(self)._kind} instead of building it as pickle builds a dataclass")


def _kind(name: str) -> type[_Record]:
    return type(name, (_Record,), {"_kind": name})


_Metadata = _kind("Metadata")
_TensorStorageMetadata = _kind("TensorStorageMetadata")
_ChunkStorageMetadata = _kind("ChunkStorageMetadata")
_BytesStorageMetadata = _kind("BytesStorageMetadata")
_MetadataIndex = _kind("MetadataIndex")
_StorageMeta = _kind("StorageMeta")
_StorageInfoRec = _kind("_StorageInfo")
#: the global of OLMo-core's ``_StorageInfo`` (what its ``RemoteFileSystemWriter`` pickles; ``CheckpointMetadata.writer``)
OLMO_STORAGE_INFO = ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")


class _TensorProperties(_Record):
    """torch's TensorProperties pickles a ``__getstate__`` tuple ``(dtype, layout, ...)``."""

    _kind = "TensorProperties"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and state:
            self.__dict__["dtype"] = state[0]
        elif isinstance(state, dict):
            self.__dict__.update((k, v) for k, v in state.items() if isinstance(k, str))


class _DTypeStandIn(str):
    """A torch dtype global such as ``torch.bfloat16``, kept by name."""

    __slots__ = ()  # no __dict__: a pickle's BUILD on a shared stand-in is refused


class _Layout(str):
    __slots__ = ()


def _get_layout(name: Any) -> _Layout:
    # torch.serialization._get_layout('torch.strided'): only a layout name is accepted.
    if not isinstance(name, str) or not name.startswith("torch.") or len(name) > 64:
        raise UnsafePickleError(
            f"torch.serialization._get_layout called with {name!r}, expected a layout name like 'torch.strided'"
        )
    return _Layout(name)


#: The ``torch.Size`` stand-in is ``tuple`` itself: ``REDUCE(torch.Size, (dims,))`` calls it in C
#: and, ``dims`` being the tuple the pickle just built, returns that very tuple (no copy: a tuple
#: class of our own cost one more object per ``torch.Size``, 10% of the unpickled graph; a Python
#: function per ``torch.Size`` was a third of the unpickling time of a 10^6-entry ``.metadata``).
#: Its items are *not* known to be ints here: :func:`_shape` (and :func:`_plain_path_item` for
#: planner data) check every one before it is used.
_SIZE: type[tuple[Any, ...]] = tuple


def _mem_format(value: Any = 0) -> int:
    return value if isinstance(value, int) else -1


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise UnsafePickleError("pathlib path built from non-string parts")
    return os.path.join(*parts) if parts else ""


def _write_item_type(value: Any) -> int:
    # torch.distributed.checkpoint.planner.WriteItemType(n): an enum rebuilt from its int value.
    if type(value) is not int or not 0 <= value < 16:
        raise UnsafePickleError(f"WriteItemType called with {short_repr(value)}, expected a small int")
    return value


def torch_globals(*, size: Any, layout: Any, ordered_dict: Any, dtype: Any) -> dict[tuple[str, str], Any]:
    """The globals any torch pickle may name besides its own classes, for an allow-list table.

    ``torch.Size``, ``torch.serialization._get_layout``, ``collections.OrderedDict`` and every
    ``torch.<dtype>`` (``dtype(name)`` called once per name of :data:`DTYPE_ITEMSIZE`) map to the
    given stand-ins; ``builtins.set``/``frozenset`` to themselves.
    """
    return {
        ("torch", "Size"): size,
        ("torch.serialization", "_get_layout"): layout,
        ("collections", "OrderedDict"): ordered_dict,
        **{("builtins", t.__name__): t for t in (set, frozenset)},
        **{("torch", name): dtype(name) for name in DTYPE_ITEMSIZE},
    }


_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_SHARD_MD = "torch.distributed._shard.sharded_tensor.metadata"
_SHARD_MD2 = "torch.distributed._shard.metadata"

_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): _Metadata,
    (_DCP, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_DCP, "TensorProperties"): _TensorProperties,
    (_SHARD_MD, "TensorProperties"): _TensorProperties,  # torch < 2.2
    (_DCP, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_DCP, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_DCP, "MetadataIndex"): _MetadataIndex,
    (_DCP, "StorageMeta"): _StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format,
    (_SHARD_MD, "MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfoRec,
    # OLMo-core's RemoteFileSystemWriter pickles its own dataclass with torch's fields (relative_path,
    # offset, length; olmo_core/distributed/checkpoint/filesystem.py): the same stand-in, never imported
    # (CheckpointMetadata.writer says the pickle named it)
    OLMO_STORAGE_INFO: _StorageInfoRec,
    # Megatron-core's torch_dist strategy attaches the savers' plans to the Metadata
    # (``Metadata.all_local_plans``, megatron/core/dist_checkpointing/strategies/torch.py): torch's
    # own planner dataclasses, kept as inert records and never read.
    **{(_PLANNER, n): _kind(n) for n in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")},
    (_PLANNER, "WriteItemType"): _write_item_type,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    **torch_globals(size=_SIZE, layout=_get_layout, ordered_dict=dict, dtype=_DTypeStandIn),
}


class AllowListUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals of its :attr:`allowed` table (``(module, name)`` -> the
    stand-in returned) and names ``source`` in every refusal.

    Raises:
        UnsafePickleError: on any other global (:meth:`refused`).
    """

    allowed: ClassVar[dict[tuple[str, str], Any]] = {}

    def __init__(self, file: Any, *, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise self.refused(module, name) from None
        if type(found) is types.FunctionType and found.__dict__.get("__setstate__") is not _no_build:
            found.__setstate__ = _no_build  # type: ignore[attr-defined]  # pickle's BUILD calls it, not setattr
        return found

    def refused(self, module: str, name: str) -> CkptError:
        """The error raised for global ``module.name``, which is not on the allow-list."""
        return UnsafePickleError(
            f"{self._source}: refused to load pickle global {module}.{name} (not on the allow-list)",
            path=self._source,
        )


class MetadataUnpickler(AllowListUnpickler):
    """Unpickler that resolves only the globals torch writes into ``.metadata``.

    Raises:
        UnsafePickleError: on any other global or on a persistent id.
        MetadataError: a ``torch.<dtype>`` global of a dtype this version does not know.
    """

    allowed = _ALLOWED
    #: ``"olmo-core"`` once the stream resolved OLMo-core's ``_StorageInfo`` (:attr:`CheckpointMetadata.writer`)
    writer: str | None = None

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if (module, name) == OLMO_STORAGE_INFO:
            self.writer = "olmo-core"
        return found

    def refused(self, module: str, name: str) -> CkptError:
        if module == "torch" and isinstance(name, str) and _DTYPE_LIKE.match(name):
            # Refused all the same (never resolved), but named for what it most likely is.
            return MetadataError(
                f"{self._source}: tensor dtype torch.{name} is not supported by this ckpttool",
                path=self._source,
                hint="upgrade ckpttool, or re-save the tensors in a supported dtype",
            )
        return super().refused(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._source}: refused pickle persistent id", path=self._source)


class AttributeBag(dict):  # type: ignore[type-arg]
    """Stand-in of a plain attribute holder a trainer pickles (``argparse.Namespace``, ``types.SimpleNamespace``,
    a config dataclass): built empty (``NEWOBJ``, or a call without arguments), its pickled ``__dict__`` becomes its
    items, so it is walked and bounded as any dict (:func:`check_object_graph`) and nothing of the class is run."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError("an attribute holder was pickled with a state that is not a dict")
        self.update(state)


class EnumValue(str):
    """Stand-in of an enum member a trainer pickles (``REDUCE(cls, (value,))``): ``"Class(value)"``, never the enum."""

    __slots__ = ()


def enum_stand_in(name: str) -> Callable[[Any], EnumValue]:
    """The stand-in of enum class ``name``: called with the member's value (an int of at most 64 bits or a string of
    at most 64 characters; anything else is :class:`~ckpttool.errors.UnsafePickleError`)."""

    def build(value: Any = None) -> EnumValue:
        small = value.bit_length() <= 64 if type(value) is int else type(value) is str and len(value) <= 64
        if not small:
            raise UnsafePickleError(f"enum {name} rebuilt from {short_repr(value)}, expected an int or a short name")
        return EnumValue(f"{name}({value!r})")

    return build


#: Stand-in of a pickled ``pathlib`` path: its parts joined, a string (nothing of the file system is touched).
path_stand_in = _path


class PlainGlobalsUnpickler(AllowListUnpickler):
    """Plain values plus the globals of a table the caller gives (inert stand-ins: :class:`AttributeBag`,
    :func:`enum_stand_in`, ...), torch's dtypes by name and ``OrderedDict`` as ``dict``; no tensor storage.

    Raises:
        UnsafePickleError: on any other global or on a persistent id (a tensor).
    """

    def __init__(self, file: Any, *, source: str, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file, source=source)
        self.allowed = {  # type: ignore[misc]
            **torch_globals(size=_SIZE, layout=_get_layout, ordered_dict=dict, dtype=_DTypeStandIn),
            **allowed,
        }

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._source}: pickle holds a tensor storage", path=self._source)


class PrimitiveUnpickler(pickle.Unpickler):
    """Unpickler for plain Python values only (no globals at all).

    ``OrderedDict`` is the one global allowed (as ``dict``), since param-group
    dicts sometimes are one.

    Raises:
        UnsafePickleError: on any global or persistent id.
    """

    def __init__(self, file: Any, *, source: str = "<bytes>") -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise UnsafePickleError(f"{self._source}: pickle names global {module}.{name}", path=self._source)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._source}: pickle holds a tensor storage", path=self._source)


_CONTAINERS = (list, tuple, dict, set, frozenset)


#: A tree walk may visit this many times more values than the object holds (shared sub-objects
#: referenced from several places) before the object counts as a pickle bomb.
SHARING_FACTOR = 16
_BIG = 1 << 62  # tree sizes are clamped here: a bomb's true size can have thousands of digits


def check_object_graph(obj: Any, where: str) -> Any:
    """Refuse an unpickled object that no consumer could walk: bounded tree size, depth and ints.

    A pickle's memo lets a few hundred bytes describe ``[x, x]`` nested 40 deep: 41 objects in
    memory, 2^40 values to anything that walks it as a tree (``repr``, ``json.dumps``, a
    comparison, rich's table). The walk here visits each object once (memo by identity) and
    computes each container's tree size and height from its children's, so it costs the
    object's size, not the tree's. An object is refused when its tree has more than
    :attr:`Limits.max_pickle_nodes` values *and* more than :data:`SHARING_FACTOR` times the
    values it really holds (a legitimately large list, 10^7 sample indices, passes: its tree is
    its size), or when it nests deeper than :attr:`Limits.max_depth`.

    Returns:
        ``obj``.

    Raises:
        ObjectGraphError: a pickle bomb, too deep, or a container that contains itself.
        IntegerRangeError: an int of more than :data:`MAX_INT_BITS` bits.
    """
    cap = limits.current()
    max_nodes, max_depth = cap.max_pickle_nodes, cap.max_depth
    if not isinstance(obj, _CONTAINERS):
        _leaf(obj, where)
        return obj
    done: dict[int, tuple[int, int]] = {}  # id -> (tree size, height)
    kids: dict[int, list[Any]] = {}  # id -> its container children (leaves are only counted)
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(obj, False)]
    held = 0  # values the object really holds: the children of each distinct container, once
    while stack:
        o, finished = stack.pop()
        oid = id(o)
        if not finished:
            if oid in done:
                continue
            if oid in open_:
                raise ObjectGraphError(f"{where}: holds a container that contains itself")
            open_.add(oid)
            if len(open_) > max_depth:  # the containers being walked form one path from the root
                raise ObjectGraphError(f"{where}: nested deeper than {max_depth} levels")
            items: Any = [*o.keys(), *o.values()] if isinstance(o, dict) else o
            held += len(items)
            sub = _scan(items, where)
            kids[oid] = sub
            stack.append((o, True))
            for c in sub:
                if id(c) in open_:
                    raise ObjectGraphError(f"{where}: holds a container that contains itself")
                if id(c) not in done:
                    stack.append((c, False))
            continue
        sub = kids.pop(oid)
        n = len(o) * 2 if isinstance(o, dict) else len(o)
        size, height = 1 + n - len(sub), 1
        for c in sub:
            cs, ch = done[id(c)]
            size = min(_BIG, size + cs)
            height = max(height, ch + 1)
        if height > max_depth:
            raise ObjectGraphError(f"{where}: nested deeper than {max_depth} levels")
        if size > max_nodes and size > SHARING_FACTOR * held:
            raise ObjectGraphError(
                f"{where}: unfolds to more than {max_nodes:,} values from {held:,} "
                "(shared containers nested in each other: a pickle bomb)"
            )
        open_.discard(oid)
        done[oid] = (size, height)
    return obj


_PLAIN_LEAVES = frozenset({float, str, bool, type(None), bytes, complex})
_INT_LIMIT = 1 << MAX_INT_BITS


def _scan(items: Any, where: str) -> list[Any]:
    """The container children of ``items``; leaves are checked (ints' size) in C-speed passes where possible."""
    types = set(map(type, items))
    if types <= _PLAIN_LEAVES:
        return []
    if types <= _PLAIN_LEAVES | {int}:
        ints = [x for x in items if type(x) is int] if len(types) > 1 else items
        if ints and (max(ints) >= _INT_LIMIT or min(ints) <= -_INT_LIMIT):
            big = next(x for x in ints if abs(x) >= _INT_LIMIT)
            _leaf(big, where)
        return []
    out = []
    for c in items:
        if isinstance(c, _CONTAINERS):
            out.append(c)
        else:
            _leaf(c, where)
    return out


def _children(o: Any) -> Iterator[Any]:
    if isinstance(o, dict):
        for k, v in o.items():
            yield k
            yield v
    else:
        yield from o


def _leaf(o: Any, where: str) -> None:
    if isinstance(o, int) and not isinstance(o, bool) and o.bit_length() > MAX_INT_BITS:
        raise IntegerRangeError(f"{where}: holds an int of {o.bit_length()} bits (at most {MAX_INT_BITS} are read)")


# --------------------------------------------------------------------------- validation
_bad = Refusal(MetadataError, "{path}: {why}")


_VALID_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
_INTS_ONLY = frozenset({int}).issuperset


def _shape(value: Any, source: str, key: str, what: str) -> tuple[int, ...]:
    # Validated shapes are cached by value (tuples of ints hash fast); most chunks repeat a few shapes.
    # Only tuples made purely of in-range ints are ever cached, so a hit is always valid.
    _ok = _VALID_SHAPES
    # (32.0,) and (True,) compare and hash equal to (32,) and (1,): a hit counts only when every
    # item is an exact int (one C-speed pass over the item types). The cached tuple itself is
    # returned, so equal shapes share one object once the unpickled graph is freed.
    if type(value) is tuple and _INTS_ONLY(map(type, value)):  # ints first: a list item is unhashable
        hit = _ok.get(value)
        if hit is not None:
            return hit
    if not isinstance(value, tuple) or len(value) > MAX_NDIM:
        raise _bad(source, f"entry {key!r}: {what} is not a shape tuple ({type(value).__name__})")
    for d in value:
        if type(d) is int and d > MAX_DIM_SIZE:
            raise IntegerRangeError(
                f"{source}: entry {key!r}: {what} holds {short_repr(d)}, beyond torch's sizes (2^62)",
                path=source,
                fqn=key,
            )
        if type(d) is not int or d < 0:
            raise _bad(
                source, f"entry {key!r}: {what} {short_repr(value, 80)} holds {short_repr(d, 40)}, not a size >= 0"
            )
    if len(_ok) < 65536:
        _ok[value] = value
    return value


_NEWOBJ, _NEWOBJ_EX = b"\x81", b"\x92"


def _too_many_records(source: str, what: str) -> SizeLimitError:
    cap = limits.metadata_record_cap()
    return SizeLimitError(
        f"{source}: {what}, over the cap of {cap:,} records ({limits.BYTES_PER_METADATA_RECORD} bytes of "
        f"--max-metadata-size {limits.human(limits.current().max_metadata_bytes)} each)",
        path=source,
        hint="a .metadata this large is a metadata bomb or needs `ckpttool --max-metadata-size SIZE` (trusted input)",
    )


def check_record_bound(data: bytes | bytearray, source: str) -> None:
    """Refuse a ``.metadata`` whose pickle may build more records than :func:`~ckpttool.format.limits.metadata_record_cap`.

    Records are built only by ``NEWOBJ``/``NEWOBJ_EX`` (a call of a record class is refused), so
    the count of those two opcode bytes in ``data`` (C-speed, before unpickling) bounds them; a
    byte of another opcode's argument can only make the bound larger.

    Raises:
        SizeLimitError: ``E307``.
    """
    bound = data.count(_NEWOBJ) + data.count(_NEWOBJ_EX)
    if bound > limits.metadata_record_cap():
        raise _too_many_records(source, f"may build {bound:,} records")


class _Shared:
    """Equal converted values built once per parse: a chunk, a tensor layout, a relative path.

    Keys are values that already passed their checks (shapes of exact ints), so a hit is as valid
    as the value it stands for; entries of one layout share one frozen :class:`TensorMeta` (as the
    parsed-metadata cache's decoder builds them), which keeps 10^6 entries from costing 10^6
    layouts and 10^6 chunk objects more.
    """

    __slots__ = ("chunks", "layouts", "paths")

    def __init__(self) -> None:
        self.chunks: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ChunkMeta] = {}
        self.layouts: dict[tuple[DType, tuple[int, ...], tuple[ChunkMeta, ...]], TensorMeta] = {}
        self.paths: dict[str, str] = {}


def _convert_tensor(
    key: str, rec: Any, source: str, dtypes: dict[str, DType], left: list[int], shared: _Shared
) -> TensorMeta:
    d = rec.__dict__
    props = d.get("properties")
    if not isinstance(props, _TensorProperties):
        raise _bad(source, f"entry {key!r}: properties are not TensorProperties")
    dtype = props.__dict__.get("dtype")
    if type(dtype) is not _DTypeStandIn:
        raise _bad(source, f"entry {key!r}: dtype {short_repr(dtype)} is not a torch dtype")
    size = _shape(d.get("size"), source, key, "size")
    chunks_raw = d.get("chunks")
    if type(chunks_raw) is not list:
        raise _bad(source, f"entry {key!r}: chunks is not a list")
    left[0] -= len(chunks_raw)  # one shared chunk object listed 10^7 times is 10^7 chunks to convert
    if left[0] < 0:
        raise _too_many_records(source, f"entry {key!r} brings the chunks and entries past the cap")
    ndim = len(size)
    chunks = []
    made = shared.chunks
    for c in chunks_raw:
        if type(c) is not _ChunkStorageMetadata:
            raise _bad(source, f"entry {key!r}: chunk is {type(c).__name__}, not ChunkStorageMetadata")
        cd = c.__dict__
        offsets = _shape(cd.get("offsets"), source, key, "chunk offsets")
        sizes = _shape(cd.get("sizes"), source, key, "chunk sizes")
        chunk = made.get((size, offsets, sizes))  # checked shapes: a hit is a chunk checked in this tensor shape
        if chunk is None:
            if len(offsets) != ndim or len(sizes) != ndim:
                raise _bad(source, f"entry {key!r}: chunk rank {len(sizes)} differs from tensor rank {ndim}")
            for o, sz, dim in zip(offsets, sizes, size):
                if o + sz > dim:
                    raise _bad(source, f"entry {key!r}: chunk at {offsets} size {sizes} lies outside tensor {size}")
            chunk = made[(size, offsets, sizes)] = ChunkMeta(offsets, sizes)
        chunks.append(chunk)
    dt = dtypes.get(dtype)
    if dt is None:
        dt = dtypes[dtype] = DType(str(dtype))
    layout = (dt, size, tuple(chunks))
    meta = shared.layouts.get(layout)
    if meta is None:
        meta = shared.layouts[layout] = TensorMeta(*layout)
    return meta


def _convert_storage(raw: Any, source: str, shared: _Shared) -> dict[tuple[str, tuple[int, ...] | None], StorageInfo]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _bad(source, f"storage_data is {type(raw).__name__}, not a dict")
    out: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    paths = shared.paths
    new = tuple.__new__
    for idx, info in raw.items():
        if type(idx) is not _MetadataIndex or type(info) is not _StorageInfoRec:
            raise _bad(source, "storage_data holds entries that are not MetadataIndex -> _StorageInfo")
        idd = idx.__dict__
        fqn = idd.get("fqn")
        offset = idd.get("offset")
        if type(fqn) is not str:
            raise _bad(source, f"storage_data key has fqn {short_repr(fqn)}, not a string")
        if offset is not None:
            offset = _shape(offset, source, fqn, "storage offset")
        ind = info.__dict__
        rel = ind.get("relative_path")
        off = ind.get("offset")
        length = ind.get("length")
        tds = ind.get("transform_descriptors")
        if type(rel) is not str or type(off) is not int or type(length) is not int:
            raise _bad(source, f"storage entry for {fqn!r}: relative_path/offset/length have wrong types")
        if off < 0 or length < 0 or off + length > MAX_OFFSET:
            _storage_range(source, fqn, off, length)
        if tds is None:
            tds = ()
        elif not isinstance(tds, (list, tuple)) or not all(isinstance(t, str) for t in tds):
            raise _bad(source, f"storage entry for {fqn!r}: transform_descriptors is not a list of strings")
        else:
            tds = tuple(str(t) for t in tds)  # exact str: never a stand-in subclass
        rel = paths.setdefault(rel, rel)  # one string per data file, not one per chunk
        out[(fqn, offset)] = new(StorageInfo, (rel, off, length, tds))  # StorageInfo(...) without its __new__ call
    return out


def _storage_range(source: str, fqn: str, off: int, length: int) -> None:
    """Raise the error of a storage range that is negative or beyond int64."""
    if abs(off) > MAX_OFFSET or abs(length) > MAX_OFFSET or off + length > MAX_OFFSET:
        raise IntegerRangeError(
            f"{source}: storage entry for {fqn!r}: offset {short_repr(off)} / length {short_repr(length)} beyond int64",
            path=source,
            fqn=fqn,
        )
    if off < 0 or length < 0:
        raise _bad(
            source,
            f"storage entry for {fqn!r}: negative offset {short_repr(off)} or length {short_repr(length)}",
        )


def _convert(obj: Any, source: str, writer: str | None = None) -> CheckpointMetadata:
    if not isinstance(obj, _Metadata):
        raise _bad(source, f"holds a {type(obj).__name__}, not a DCP Metadata object")
    sdm = getattr(obj, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise _bad(source, "state_dict_metadata is missing or not a dict")
    entries: dict[str, TensorMeta | BytesMeta] = {}
    dtypes: dict[str, DType] = {}
    bytes_meta = BytesMeta()
    shared = _Shared()
    storage_raw = getattr(obj, "storage_data", None)
    n_storage = len(storage_raw) if isinstance(storage_raw, dict) else 0
    left = [limits.metadata_record_cap() - len(sdm) - n_storage]
    if left[0] < 0:
        raise _too_many_records(source, f"holds {len(sdm):,} entries and {n_storage:,} storage items")
    for key, rec in sdm.items():
        if type(key) is not str:
            raise _bad(source, f"state_dict_metadata has a key {short_repr(key)} that is not a string")
        if type(rec) is _TensorStorageMetadata:
            entries[key] = _convert_tensor(key, rec, source, dtypes, left, shared)
        elif type(rec) is _BytesStorageMetadata:
            entries[key] = bytes_meta
        else:
            raise _bad(source, f"entry {key!r} is {type(rec).__name__}, not tensor or bytes metadata")
    # the entry records (~10 objects per chunk) are freed before the storage items are built
    sdm = key = rec = None
    vars(obj).pop("state_dict_metadata", None)
    planner_data = _convert_planner(getattr(obj, "planner_data", None), source)
    storage = _convert_storage(storage_raw, source, shared)
    version = getattr(obj, "version", None)
    smeta = getattr(obj, "storage_meta", None)
    ckpt_id = save_id = None
    if isinstance(smeta, _StorageMeta):
        cid = getattr(smeta, "checkpoint_id", None)
        ckpt_id = cid if isinstance(cid, str) else None
        sid = getattr(smeta, "save_id", None)
        save_id = sid if isinstance(sid, str) else None
    return CheckpointMetadata(
        entries=entries,
        storage=storage,
        planner_data=planner_data,
        version=str(version) if isinstance(version, str) else None,
        checkpoint_id=str(ckpt_id) if ckpt_id is not None else None,
        save_id=str(save_id) if save_id is not None else None,
        writer=writer,
    )


def _plain_path_item(v: Any) -> str | int | tuple[int, ...] | None:
    """A planner-data path item as a plain value (``None``: not convertible)."""
    if type(v) is str:
        return v
    if type(v) is int:
        return v if -MAX_OFFSET <= v <= MAX_OFFSET else None
    if isinstance(v, (_DTypeStandIn, _Layout)):
        return str(v)  # torch.bfloat16 / torch.strided in a custom planner's data: their names
    if type(v) is tuple and len(v) <= MAX_NDIM and all(type(d) is int for d in v):
        return tuple(int(d) for d in v)  # a torch.Size, or the int tuple ckpttool writes for one
    return None


def _convert_planner(planner: Any, source: str) -> dict[str, tuple[Any, ...]]:
    """``planner_data`` as key -> path of plain ``str``/``int`` items (what torch's DefaultSavePlanner writes).

    dtypes, layouts and ``torch.Size`` that custom planners leave there become their names and int
    tuples: nothing of ckpttool's stand-ins survives into values ckpttool later writes. One C-speed
    type test per path.

    Raises:
        PlannerDataError: a path that is not a sequence, or holds unhashable or other values.
        ObjectGraphError: a path item that is a pickle bomb (checked before it is named).
    """
    if planner is None:
        return {}
    if not isinstance(planner, dict):
        raise PlannerDataError(f"{source}: planner_data is a {type(planner).__name__}, not a dict", path=source)
    out: dict[str, tuple[Any, ...]] = {}
    plain = _PLAIN_PATH_TYPES
    for k, v in planner.items():
        tv = type(v)
        if type(k) is str and (tv is tuple or tv is list) and len(v) <= MAX_NDIM:
            types = {*map(type, v)}
            if types <= plain and (
                int not in types or all(-MAX_OFFSET <= x <= MAX_OFFSET for x in v if type(x) is int)
            ):
                out[k] = v if tv is tuple else tuple(v)
                continue
        out[k] = _planner_path(k, v, source)
    return out


_PLAIN_PATH_TYPES = frozenset({str, int})


def _planner_path(k: Any, v: Any, source: str) -> tuple[Any, ...]:
    """The slow path of :func:`_convert_planner`: convert stand-ins, or name what is wrong."""
    if type(k) is not str:
        raise PlannerDataError(f"{source}: planner_data has a key {short_repr(k)} that is not a string", path=source)
    if not isinstance(v, (tuple, list)) or len(v) > MAX_NDIM:
        if isinstance(v, _CONTAINERS):
            check_object_graph(v, f"{source}: planner_data[{k!r}]")
        raise PlannerDataError(
            f"{source}: planner_data path of {k!r} is {short_repr(v)}, not a tuple of str/int", path=source, fqn=k
        )
    path = tuple(_plain_path_item(x) for x in v)
    if any(x is None for x in path):
        bad = next(x for x, y in zip(v, path) if y is None)
        if isinstance(bad, _CONTAINERS):
            check_object_graph(bad, f"{source}: planner_data[{k!r}]")  # a bomb is named as one, never walked
        raise PlannerDataError(
            f"{source}: planner_data path of {k!r} holds {short_repr(bad)} ({type(bad).__name__}); "
            "paths hold str keys and int indices only",
            path=source,
            fqn=k,
        )
    return path


def parse_metadata_bytes(data: bytes, source: str = ".metadata") -> CheckpointMetadata:
    """Parse the bytes of a ``.metadata`` file safely.

    Args:
        data: the file content.
        source: the file name used in error messages.

    Returns:
        The validated :class:`CheckpointMetadata`.

    Raises:
        UnsafePickleError: the pickle names a global outside the allow-list.
        MetadataError: empty, truncated, garbage, or not a DCP ``Metadata``.
    """
    return parse_metadata_owned([data], source)


def _check_input(data: bytes | bytearray, source: str) -> None:
    if not data:
        raise MetadataError(f"{source} is empty", path=source)
    check_record_bound(data, source)


def parse_metadata_owned(
    holder: list[bytes | bytearray], source: str = ".metadata", reread: Callable[[], bytes] | None = None
) -> CheckpointMetadata:
    """:func:`parse_metadata_bytes` of the bytes in ``holder`` (a one-item list, emptied).

    The native column reader (:func:`ckpttool.format.mdscan.scan_metadata_owned`) reads the bytes
    first; where it declines them (or is not built) the allow-list unpickler does, and its result or
    message is the answer. With the caller's only reference handed over, the bytes (~465 MiB at
    10^6 entries and 2.75 M chunks) are freed once read into columns (or unpickled), before the
    objects are built: they are never in memory beside the converted metadata. A ``bytearray``
    with ``reread`` (reads the same file again) is released behind the native parse instead, and
    the file read again where the unpickler has to run.

    Raises:
        as :func:`parse_metadata_bytes`, and as ``reread``.
    """
    _check_input(holder[0], source)
    from ckpttool.format.mdscan import scan_metadata_owned

    # the native column reader (frees the bytes); None: the unpickler decides
    md = scan_metadata_owned(holder, source, reread)
    if md is not None:
        return md
    data = holder.pop()
    if reread is not None:  # maybe the file read again: its bytes checked as the first read's were
        _check_input(data, source)
    if isinstance(data, bytearray):  # given without reread: pickle reads bytes
        data = bytes(data)
    obj, writer = _unpickle(data, source)
    del data
    return _convert(obj, source, writer)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the body (re-entrant; restores its state).

    Unpickling and converting a 10^6-entry ``.metadata`` allocates ~10^7 acyclic objects, and
    so do the catalog, the rules and inspect's report built from them; the cyclic GC would
    rescan them over and over (``docs/performance.md``).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _unpickle(data: bytes, source: str) -> tuple[Any, str | None]:
    """The unpickled object and the storage writer the stream named (:attr:`MetadataUnpickler.writer`)."""
    try:
        up = MetadataUnpickler(pickle_input(data), source=source)
        return up.load(), up.writer  # a read across a FRAME's end refused
    except UnsafePickleError:
        raise
    except MetadataError:
        raise
    except RecursionError as e:
        raise _bad(source, "pickle nests too deeply") from e
    except MemoryError as e:
        raise _bad(source, "pickle needs more memory than available") from e
    except Exception as e:
        raise MetadataError(
            f"{source} is not a readable pickle ({type(e).__name__}: {str(e)[:80]})", path=source
        ) from e


def load_metadata(path: str | os.PathLike[str]) -> CheckpointMetadata:
    """Read and validate a ``.metadata`` file (see :func:`parse_metadata_bytes`).

    Raises:
        MetadataError: the file cannot be read, or its content is invalid.
        UnsafePickleError: the pickle names a global outside the allow-list.
    """
    from ckpttool.format.files import read_regular

    p = Path(path)
    try:
        data = read_regular(p, limits.current().max_metadata_bytes, what=".metadata")
    except OSError as e:
        raise MetadataError(f"cannot read {p}: {e.strerror}", path=p) from e
    return parse_metadata_bytes(data, str(p))
