"""Allow-list unpickling of per-rank ``torch.save`` state dicts that hold DTensors (torch-free).

verl's FSDP checkpoint manager and torch-checkpointing save each rank's state dict with
``torch.save``: tensors are ``_rebuild_tensor_v2`` views of storage records, DTensors
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, ..., {"_local_tensor", "_spec"})``
with a ``DTensorSpec`` (``DeviceMesh``, placements ``Shard`` / ``_StridedShard`` /
``Replicate`` / ``Partial``, ``TensorMeta``) pickled as data (torch ``_tensor.py``,
``distributed/tensor/_api.py``, ``_dtensor_spec.py``, ``device_mesh.py``). :class:`RankUnpickler`
resolves exactly those globals to inert stand-ins defined here — nothing is imported, no
constructor runs — and refuses any other global (:class:`~ckpttool.errors.UnsafePickleError`
naming it). numpy arrays (verl's RNG state) become :class:`Opaque` records, described, never built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckpttool.errors import CkptError, PerRankError, UnsafePickleError
from ckpttool.format.archive import STORAGE_DTYPES
from ckpttool.format.metadata import DTYPE_ITEMSIZE
from ckpttool.format.pickleframes import pickle_input
from ckpttool.format.unpickler import AllowListUnpickler, torch_globals

__all__ = ["DTensorRec", "LocalTensor", "Opaque", "Placement", "RankUnpickler", "Record", "unpickle_rank"]


class LocalTensor(NamedTuple):
    """A plain tensor in the pickle: a view of storage record ``data/<key>`` (elements)."""

    dtype: str
    """The storage's dtype name (an untyped storage takes the tensor's)."""
    key: str
    storage_numel: int
    """Elements of the whole storage record."""
    storage_offset: int
    """The view's first element in the storage (elements, not bytes)."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    """Per dim, in elements."""


class Placement(NamedTuple):
    """One DTensor placement: ``kind`` ``shard`` / ``strided_shard`` / ``replicate`` / ``partial``."""

    kind: str
    dim: int = -1
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "strided_shard":
            return f"_StridedShard({self.dim}, sf={self.split_factor})"
        return "Replicate()" if self.kind == "replicate" else "Partial()"


class Record:
    """Attribute bag a pickled class instance is rebuilt into (``NEWOBJ`` args kept in ``_args``)."""

    _kind = "record"

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        o = object.__new__(cls)
        o.__dict__["_args"] = args
        return o

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update((k, v) for k, v in state.items() if isinstance(k, str))
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update((k, v) for k, v in state[1].items() if isinstance(k, str))

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


def _kind(name: str) -> type[Record]:
    return type(name, (Record,), {"_kind": name})


class Opaque(Record):
    """A value that is read and described but never built (numpy arrays and dtypes of an RNG state)."""

    _kind = "opaque"


@dataclass
class DTensorRec:
    """A DTensor as data: its local tensor and the spec that places it in the global tensor."""

    dtype: str
    size: tuple[int, ...]
    local: LocalTensor | None = None
    spec: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class _StateDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` (a state dict carries its ``_metadata`` as pickled state: dropped)."""

    def __setstate__(self, state: Any) -> None:
        pass


class _Marker(str):
    """A class global that is only compared, never called (``DTensor``)."""


_DTENSOR = _Marker("DTensor")


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> LocalTensor:
    if not (isinstance(storage, tuple) and len(storage) == 4 and storage[0] == "storage"):
        raise UnsafePickleError("per-rank state dict: a tensor rebuilt from something that is not a storage")
    _, dtype, key, numel = storage
    return _local(dtype, key, numel, storage_offset, size, stride)


def _rebuild_v3(
    storage: Any, storage_offset: Any, size: Any, stride: Any, rg: Any, hooks: Any, dtype: Any, *rest: Any
) -> LocalTensor:
    if not (isinstance(storage, tuple) and len(storage) == 4 and storage[0] == "storage"):
        raise UnsafePickleError("per-rank state dict: a tensor rebuilt from something that is not a storage")
    _, sdtype, key, numel = storage
    if sdtype is None:
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE or numel % DTYPE_ITEMSIZE[dtype]:
            raise UnsafePickleError(f"per-rank state dict: an untyped storage of {numel!r:.40} bytes as {dtype!r:.40}")
        sdtype, numel = dtype, numel // DTYPE_ITEMSIZE[dtype]
    return _local(sdtype, key, numel, storage_offset, size, stride)


def _ints(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) <= 64 and all(type(x) is int and 0 <= x < 1 << 62 for x in v)


def _local(dtype: Any, key: Any, numel: Any, offset: Any, size: Any, stride: Any) -> LocalTensor:
    if not (
        _ints(size) and _ints(stride) and len(size) == len(stride) and type(offset) is int and 0 <= offset < 1 << 62
    ):
        raise UnsafePickleError("per-rank state dict: a tensor view with malformed size/stride/offset")
    return LocalTensor(str(dtype), str(key), int(numel), offset, tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, requires_grad: Any = None, hooks: Any = None, *rest: Any) -> Any:
    return data


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> DTensorRec:
    if cls is not _DTENSOR:
        raise UnsafePickleError(f"per-rank state dict: a tensor subclass {cls!r:.60} (only DTensor is read)")
    if not (isinstance(dtype, str) and _ints(tuple(size) if isinstance(size, (tuple, list)) else None)):
        raise UnsafePickleError("per-rank state dict: a DTensor with a malformed dtype or size")
    return DTensorRec(str(dtype), tuple(size))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func not in (_rebuild_wrapper_subclass, _rebuild_v2, _rebuild_parameter) or not isinstance(args, tuple):
        raise UnsafePickleError("per-rank state dict: _rebuild_from_type_v2 of an unexpected rebuild function")
    out = func(*args)
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values): DTensor has slots
        merged: dict[Any, Any] = {}
        for part in state:
            if isinstance(part, dict):
                merged.update(part)
        state = merged
    if isinstance(out, DTensorRec) and isinstance(state, dict):
        local = state.get("_local_tensor")
        if not isinstance(local, LocalTensor):
            raise UnsafePickleError("per-rank state dict: a DTensor without a plain local tensor")
        out.local, out.spec = local, state.get("_spec")
    return out


def _layout(name: Any) -> str:
    if not isinstance(name, str) or len(name) > 64:
        raise UnsafePickleError("per-rank state dict: torch.serialization._get_layout of a non-name")
    return name


def _device(*args: Any) -> str:
    return ":".join(str(a)[:16] for a in args)


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode``: how protocol-2 pickles spell ``bytes`` (``latin1`` text only)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError("per-rank state dict: _codecs.encode of something other than latin1 text")
    return text.encode("latin1")


def _opaque(*args: Any) -> Opaque:
    return Opaque()


_TENSOR_MOD = "torch.distributed.tensor"
_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor"
_SPEC_MOD = "torch.distributed.tensor._dtensor_spec"
_PLACEMENTS = ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types")
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    (_TENSOR_MOD, "DTensor"): _DTENSOR,
    ("torch.distributed.tensor._api", "DTensor"): _DTENSOR,
    ("torch.distributed._tensor.api", "DTensor"): _DTENSOR,
    **{(_SPEC_MOD, n): _kind(n) for n in ("DTensorSpec", "TensorMeta", "ShardOrderEntry")},
    ("torch.distributed._tensor._dtensor_spec", "DTensorSpec"): _kind("DTensorSpec"),
    ("torch.distributed.device_mesh", "DeviceMesh"): _kind("DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"): _kind("MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"): _kind("FlatLayout"),
    ("torch", "device"): _device,
    **torch_globals(size=tuple, layout=_layout, ordered_dict=_StateDict, dtype=str),
    # verl's RNG state: numpy's legacy random state (described, never built)
    ("numpy.core.multiarray", "_reconstruct"): _opaque,
    ("numpy._core.multiarray", "_reconstruct"): _opaque,
    ("numpy", "ndarray"): _opaque,
    ("numpy", "dtype"): _opaque,
    ("_codecs", "encode"): _encode,
}
for _mod in _PLACEMENTS:
    for _name in ("Shard", "_StridedShard", "Replicate", "Partial", "_Partial"):
        _ALLOWED[(_mod, _name)] = _kind(_name.lstrip("_"))
for _name, _dtype in STORAGE_DTYPES.items():
    _ALLOWED[("torch", _name)] = ("storage_type", _dtype)
_ALLOWED[("torch", "UntypedStorage")] = ("storage_type", None)
_ALLOWED[("torch.storage", "UntypedStorage")] = ("storage_type", None)


class RankUnpickler(AllowListUnpickler):
    """Unpickler of one rank's ``data.pkl``: tensors, DTensors and their specs as data (see the module docstring).

    Raises:
        UnsafePickleError: any global not on the allow-list (named), or a persistent id that is
            not a storage record.
    """

    allowed = _ALLOWED

    def refused(self, module: str, name: str) -> CkptError:
        if isinstance(module, str) and module.startswith(_SHARDED_TENSOR):
            # refused all the same (never resolved), but named for what it is: FSDP1's sharded state dict
            return PerRankError(
                f"{self._source}: a ShardedTensor ({module}.{name}), what FSDP1's SHARDED_STATE_DICT saves (verl's "
                "actor strategy 'fsdp'); ckpttool reads the DTensors of FSDP2 and torch's DCP checkpoints, not these",
                path=self._source,
                hint="save with FSDP2 (verl: actor strategy fsdp2) or with torch's dcp.save (get_state_dict), whose "
                "checkpoints ckpttool reads",
            )
        return super().refused(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{self._source}: an unexpected pickle persistent id", path=self._source)
        _, stype, key, _location, numel = pid
        ok = isinstance(stype, tuple) and len(stype) == 2 and stype[0] == "storage_type"
        if not ok or type(key) is not str or not key.isdecimal() or type(numel) is not int or not 0 <= numel < 1 << 62:
            raise UnsafePickleError(f"{self._source}: a malformed storage record reference", path=self._source)
        return ("storage", stype[1], key, numel)


def unpickle_rank(pkl: bytes, source: str) -> Any:
    """The object of one rank file's ``data.pkl`` (:class:`RankUnpickler`).

    Raises:
        UnsafePickleError: a global off the allow-list.
        PickleBombError: a memo bomb or an 8-byte length past the end
            (:func:`~ckpttool.format.pickleframes.check_memo`), before unpickling.
        UNREADABLE_PICKLE (``ckpttool.format.unpickler``): any other unreadable pickle.
    """
    return RankUnpickler(pickle_input(pkl), source=source).load()
