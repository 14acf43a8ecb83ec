"""``inspect``: a metadata-only overview of a checkpoint.

:func:`inspect` (an opened checkpoint or a path) returns an :class:`InspectResult` whose :meth:`~InspectResult.to_dict`
is the ``--json`` document (schema ``ckpttool.inspect/1``, ``docs/inspect.md``). It reads
``.metadata``, the small param-group and layout byte items, and the ``extra_state/``
files (``weights_only`` only) — never tensor data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain, compress, islice, repeat
from json.encoder import encode_basestring_ascii as _enc  # what json.dumps uses for str (ensure_ascii)
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, PathEscapeError, TrustRequiredError, UsageError, at_least
from ckpttool.format.files import resolve_inside
from ckpttool.format.jsonview import json_fields, json_number
from ckpttool.format.mdstorage import file_extents
from ckpttool.format.perrank import PerRankReader
from ckpttool.layouts.geometry import EPGeometry
from ckpttool.layouts.record import EPTensorSpec
from ckpttool.model.beside import TrainerState, read_training_state_beside
from ckpttool.model.catalog import (
    Catalog,
    ParamGroup,
    TensorEntry,
    bare_glob_hint,
    group_by_prefix,
    leaf_key,
    match_filter,
    saved_by_counts,
)
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, ExtraState, OpenOptions, gc_held, open_source
from ckpttool.model.counters import keeps_no_state
from ckpttool.model.discovery import Located
from ckpttool.model.schemas.keyschema import KeySchema
from ckpttool.model.schemas.nemo import hf_copies
from ckpttool.ops.fields import options_of
from ckpttool.optim_state.schema import HYPERPARAMETERS

log = logging.getLogger(__name__)

__all__ = [
    "SCHEMA",
    "SORT_KEYS",
    "ExtraStateRow",
    "FileRow",
    "GroupRow",
    "InspectOptions",
    "InspectResult",
    "LayoutSummary",
    "OptimizerSummary",
    "Summary",
    "tensor_dict",
    "TreeRow",
    "inspect",
]

SCHEMA = "ckpttool.inspect/1"
_dtype, _numel, _nbytes = operator.attrgetter("dtype"), operator.attrgetter("numel"), operator.attrgetter("nbytes")
SORT_KEYS = ("name", "size")
_GROUP_VALUES = (*HYPERPARAMETERS, "initial_lr")


@dataclass(frozen=True)
class InspectOptions:
    """What ``inspect`` shows.

    Attributes:
        filter_glob: only tensors whose key matches (:func:`~ckpttool.model.catalog.match_filter`).
        depth: also aggregate model tensors by their first ``depth`` key components below the model
            prefix (``model.model.layers`` at depth 2 under ``model.``).
        sort: ``"name"`` (file order) or ``"size"`` (largest first) for tensor lists.
    """

    filter_glob: str | None = None
    depth: int | None = field(default=None, metadata=at_least(1))
    sort: str = "name"


def tensor_dict(t: TensorEntry) -> dict[str, Any]:
    """JSON row of a tensor (``model[]`` and ``other_tensors[]`` of ``ckpttool.inspect/1``)."""
    return {
        "key": t.key,
        "shape": list(t.shape),
        "dtype": t.dtype,
        "numel": t.numel,
        "nbytes": t.nbytes,
        "chunks": len(t.chunks),
        "chunk_sizes": [list(c.sizes) for c in t.chunks],
        "ranks": list(t.ranks),
        "uneven": t.uneven,
        "zero_size_chunks": t.zero_size_chunks,
    }


@dataclass(frozen=True)
class FileRow:
    """A data file: size on disk (``None``: missing), rank, bytes its records need, status."""

    path: str
    size: int | None
    rank: int | None
    referenced: bool
    needed: int
    status: str  # ok | missing | short | unreferenced | outside

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TreeRow:
    """Model tensors aggregated by a key prefix (``--depth``)."""

    prefix: str
    tensors: int
    numel: int
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Summary:
    """Counts and byte totals of the whole checkpoint."""

    files: int
    """Data files the ``.metadata`` refers to."""
    ranks: tuple[int, ...]
    bytes_on_disk: int
    """Bytes of all data files present (their sizes on disk)."""
    tensor_count: int
    model_tensor_count: int
    byte_item_count: int
    numel_model: int
    """Elements of all model tensors."""
    bytes_by_dtype: dict[str, int]
    """Logical bytes (``numel`` x item size) of all tensors, by dtype name."""
    bytes_by_category: dict[str, int]
    """Logical bytes by ``model``, ``optimizer_state``, ``other``."""

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self)


@dataclass(frozen=True)
class GroupRow:
    """A param group (nested, as saved) or flattened per-parameter groups aggregated by equal values."""

    id: int | str
    flavor: str
    values: dict[str, Any]  # lr, weight_decay, betas, eps, initial_lr (JSON-safe; None when not saved)
    params: int
    example_params: tuple[str, ...]
    has_state: bool
    missing: tuple[str, ...]
    keeps_no_state: bool = False
    """torch's SGD with ``momentum`` 0: its steps keep no per-parameter state (no state is not 'never stepped')."""
    members_known: bool = True
    """``False``: a group saved without its parameters (Megatron's ``common.pt``) whose members ckpttool cannot
    derive (:attr:`~ckpttool.model.catalog.ParamGroup.members_known`): ``params`` 0 and no state say nothing of it."""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "flavor": self.flavor,
            **self.values,
            "params": self.params,
            "example_params": list(self.example_params),
            "has_state": self.has_state,
            "missing": list(self.missing),
            "keeps_no_state": self.keeps_no_state,
        }
        if not self.members_known:  # only then: the documents of every other group stay as they were
            out["members_known"] = False
        return out


@dataclass(frozen=True)
class OptimizerSummary:
    """Optimizer coverage, state fields, implied/declared type and param groups."""

    flavor: str | None
    """Param-group key flavor: ``nested``, ``flattened``, ``mixed`` (``None``: no groups)."""
    params_total: int
    """Parameters: model keys in a param group (all model keys when there are no groups)."""
    params_with_state: int
    fields: dict[str, dict[str, int]]
    """State field -> dtype name -> parameters holding it in that dtype."""
    implied_type: str | None
    implied_types: dict[str, int]
    """Optimizer type implied by a parameter's fields -> parameters (``implied_type``: the most common)."""
    saved_by: str | None
    saved_by_counts: dict[str, int]
    """The optimizer a parameter's state fields (and its param group) imply -> parameters
    (:func:`ckpttool.optim_state.known.saved_by`: ``torch.optim.RMSprop``, ``ambiguous: A or B``, ``unknown``;
    ``saved_by``: the most common, ``None`` where no parameter has state), most first (then by name)."""
    declared_type: str | None
    """``optimizer.type`` of the layout record."""
    param_groups: tuple[GroupRow, ...]
    params_without_state: tuple[str, ...]
    never_stepped_with_hyperparameters: tuple[str, ...]
    """Fqns with no state but with hyperparameters saved (members of a param group)."""
    orphan_state: tuple[str, ...]
    """Fqns with state that are not model keys (nor a fused parameter the model stores split: ``_stored_split``;
    validate's ``O003``)."""
    buffers: tuple[str, ...]
    """Model keys in no param group (persistent buffers)."""
    _stored_split: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)
    """Fqn the optimizer steps fused -> the model keys that store it split (torchtitan ``wqkv`` as
    ``wq``/``wk``/``wv``; validate's ``K005``): its state is recognised, not an orphan (text output only)."""

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self, param_groups=[g.to_dict() for g in self.param_groups])


@dataclass(frozen=True)
class LayoutSummary:
    """The EP layout: recorded, declared, or detected by name on an unversioned checkpoint.

    ``ambiguous`` and ``geometry`` are ``None`` when the layout could not be resolved.
    """

    version: int | None
    layout: str
    source: str
    parallel: dict[str, int]
    extra_parallel: dict[str, EPTensorSpec]
    optimizer: dict[str, Any]
    global_step: int | None
    ambiguous: tuple[str, ...] | None = None
    geometry: tuple[EPGeometry, ...] | None = None
    candidates: dict[str, tuple[tuple[int, int], ...]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": self.version,
            "layout": self.layout,
            "source": self.source,
            "parallel": self.parallel,
            "extra_parallel": {
                k: {"ep_dim": s.ep_dim, "fsdp_dim": s.fsdp_dim, "num_experts": s.num_experts}
                for k, s in self.extra_parallel.items()
            },
            "optimizer": self.optimizer,
            "global_step": self.global_step,
        }
        if self.ambiguous is not None:
            d["ambiguous"] = list(self.ambiguous)
        if self.geometry is not None:
            d["geometry"] = [g.to_dict() for g in self.geometry]
        if self.candidates is not None:
            d["candidates"] = {k: [list(pf) for pf in v] for k, v in self.candidates.items()}
        return d


@dataclass(frozen=True)
class ExtraStateRow:
    """A per-rank ``extra_state/*.pt`` file and whether it loads with ``weights_only=True``."""

    path: str
    size: int
    rank: int | None
    status: str  # ok | needs --trust-pickle | unreadable: ...
    keys: tuple[str, ...] = ()
    global_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "rank": self.rank, "status": self.status}
        if self.status == "ok":
            d["keys"] = list(self.keys)
        if self.global_step is not None:
            d["global_step"] = self.global_step
        return d


@dataclass(frozen=True)
class InspectResult:
    """Everything ``inspect`` shows (``docs/inspect.md``); :meth:`to_dict` is the ``--json`` document."""

    path: str
    dcp_version: str | None
    """``Metadata.version`` of the ``.metadata`` file."""
    summary: Summary
    files: tuple[FileRow, ...]
    model: tuple[TensorEntry, ...]
    """Model tensors after ``filter_glob``, in ``sort`` order."""
    optimizer: OptimizerSummary
    layout: LayoutSummary | None
    layout_error: CkptError | None
    """Why the layout record is invalid (``None``: valid or absent)."""
    extra_state: tuple[ExtraStateRow, ...]
    byte_items: tuple[tuple[str, int], ...]
    """``(key, stored size in bytes)`` of every byte item."""
    other_keys: tuple[str, ...]
    other_tensors: tuple[TensorEntry, ...]
    tree: tuple[TreeRow, ...] | None = None
    schema: KeySchema | None = None
    location: Located | None = None
    training_state: dict[str, tuple[str, ...]] | None = None
    uncategorized_tensors: tuple[str, ...] = ()
    non_persistent_buffers: tuple[str, ...] = ()
    serialization: str = "torch_save"
    storage: dict[str, Any] | None = None
    quantized: dict[str, Any] | None = None
    derived_from: dict[str, Any] | None = None
    model_adapter: str | None = None
    adapter_choices: tuple[tuple[str, str], ...] = ()
    training_values: dict[str, int | float] | None = None
    hf_copies: tuple[str, ...] = ()
    trainer_state: tuple[TrainerState, ...] = ()
    unread_beside: tuple[str, ...] = ()
    unproven_shards: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document, schema ``ckpttool.inspect/1``."""
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "path": self.path,
            "dcp_version": self.dcp_version,
            "summary": self.summary.to_dict(),
            "files": [f.to_dict() for f in self.files],
            "model": [tensor_dict(t) for t in self.model],
            "optimizer": self.optimizer.to_dict(),
            "layout": self.layout.to_dict() if self.layout is not None else None,
            "layout_error": self.layout_error.to_dict() if self.layout_error is not None else None,
            "extra_state": [e.to_dict() for e in self.extra_state],
            "byte_items": [{"key": k, "bytes": n} for k, n in self.byte_items],
            "other_keys": list(self.other_keys),
            "other_tensors": [tensor_dict(t) for t in self.other_tensors],
        }
        if self.tree is not None:
            d["tree"] = [r.to_dict() for r in self.tree]
        d["key_schema"] = self.schema.to_dict() if self.schema is not None else None
        d["location"] = self.location.to_dict() if self.location is not None else None
        d["serialization"] = self.serialization
        d["training_state"] = {k: list(v) for k, v in (self.training_state or {}).items()}
        d["uncategorized_tensors"] = list(self.uncategorized_tensors)
        d["non_persistent_buffers"] = list(self.non_persistent_buffers)
        d["quantized"] = self.quantized
        if self.storage is not None:
            d["storage"] = dict(self.storage)
        d["derived_from"] = dict(self.derived_from) if self.derived_from is not None else None
        d["model_adapter"] = self.model_adapter
        d["adapter_choices"] = [{"adapter": a, "model_type": t} for a, t in self.adapter_choices]
        d["training_values"] = {k: json_number(v) for k, v in (self.training_values or {}).items()}
        d["hf_copies"] = list(self.hf_copies)
        d["trainer_state"] = [t.to_dict() for t in self.trainer_state]
        d["unread_beside"] = list(self.unread_beside)
        if self.unproven_shards is not None:  # only where it applies: other documents are unchanged
            d["unproven_shards"] = self.unproven_shards
        return d

    def json_chunks(self, rows_per_chunk: int = 8192) -> Iterator[str]:
        """The ``--json`` document as pieces of text: ``"".join(...)`` is exactly
        ``json.dumps(self.to_dict(), separators=(",", ":"), default=str, allow_nan=False)``.

        The tensor lists are encoded row by row (the rows of tensors of one layout share their
        text after the key), so no dict per tensor is built and the document is never whole in
        memory (no peak of the document's size; docs/performance.md).
        """
        d = self.to_dict_shallow()
        # everything but the tensor rows encoded first: a value json refuses raises before any text is out
        text = {
            name: _optimizer_pieces(value) if name == "optimizer" else [_dumps(value)]
            for name, value in d.items()
            if name not in ("model", "other_tensors")
        }
        yield "{"
        for i, (name, value) in enumerate(d.items()):
            head = ("," if i else "") + _enc(name) + ":"
            if name in text:
                first, *rest = text[name]
                yield head + first
                yield from rest
            else:
                yield head + "["
                yield from _tensor_rows(value, rows_per_chunk)
                yield "]"
        yield "}"

    def to_dict_shallow(self) -> dict[str, Any]:
        """:meth:`to_dict` with ``model`` and ``other_tensors`` left as tuples of :class:`TensorEntry`."""
        model, others = self.model, self.other_tensors
        shallow = dataclasses.replace(self, model=(), other_tensors=())
        d = shallow.to_dict()
        d["model"], d["other_tensors"] = model, others
        return d


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str, allow_nan=False)


def _optimizer_pieces(value: Any) -> list[str]:
    """:func:`_dumps` of the optimizer section, as pieces; its two name lists are encoded once when they are one.

    With no parameter stepped, ``params_without_state`` and ``never_stepped_with_hyperparameters``
    are the same fqns (10^6 names each at 10^6 tensors): the same string objects, so the same text.
    A dict of ``str`` keys encodes as ``{``, the ``,``-joined ``key:value`` items, ``}`` with these
    separators, which is what the pieces are.
    """
    a, b = "params_without_state", "never_stepped_with_hyperparameters"
    va, vb = (value.get(a), value.get(b)) if type(value) is dict else (None, None)
    if not (
        type(va) is list
        and type(vb) is list
        and len(va) == len(vb) >= 1024
        and all(type(k) is str for k in value)
        and all(map(operator.is_, va, vb))
    ):
        return [_dumps(value)]
    shared = _dumps(va)
    pieces = ["{"]
    for i, (k, v) in enumerate(value.items()):
        pieces.append(("," if i else "") + _enc(k) + ":")
        pieces.append(shared if k in (a, b) else _dumps(v))
    pieces.append("}")
    return pieces


def _tensor_rows(tensors: tuple[TensorEntry, ...], per_chunk: int) -> Iterator[str]:
    """``tensor_dict`` rows of ``tensors`` as JSON text, comma-separated, ``per_chunk`` rows a piece.

    Built in C (``map`` over the rows, one ``join`` a piece): a row is ``,{"key":``, the encoded key
    and the text after the key, which depends only on the fields after it (:class:`_RowTails`, shared
    by the rows of one layout); the first row's comma is cut.
    """
    tails = map(_RowTails().__getitem__, map(_TAIL, tensors))
    parts = chain.from_iterable(zip(repeat(',{"key":'), map(_enc, map(_KEY, tensors)), tails))
    first = True
    while piece := "".join(islice(parts, 3 * per_chunk)):
        yield piece[1:] if first else piece
        first = False


_KEY = operator.itemgetter(0)
#: The :class:`TensorEntry` fields ``tensor_dict`` reads after the key: shape, dtype, numel, nbytes, chunks, ranks.
_TAIL = operator.itemgetter(1, 2, 3, 4, 5, 6)


class _RowTails(dict[tuple[Any, ...], str]):
    """The JSON text of a ``tensor_dict`` row after its key (``,"shape":...}``), by the fields it is made of.

    Looked up with those fields (:data:`_TAIL`); holds at most 65536 texts (cleared when full).
    """

    def __missing__(self, fields: tuple[Any, ...]) -> str:
        if len(self) >= 65536:
            self.clear()
        shape, dtype, numel, nbytes, chunks, ranks = fields
        row = tensor_dict(TensorEntry("", shape, dtype, numel, nbytes, chunks, ranks, ()))
        del row["key"]
        text = self[fields] = "," + _dumps(row)[1:]
        return text


# ----------------------------------------------------------------------------------------------- build
def _detected_adapter(cat: Any) -> str | None:
    """The model adapter ``export`` would use on these names (no config: by the keys alone), asked as ``export``
    asks: with the fqns, which an adapter of the naming scans (once) for the fragments it claims or refuses."""
    from ckpttool.model.adapters import detect_adapter

    ad = detect_adapter(cat.schema.naming, cat.param_fqns)  # the shared list: read only
    return ad.name if ad is not None else None


def _adapter_choices(cat: Any) -> tuple[tuple[str, str], ...]:
    """The adapters ``export`` would pick for these names by the ``model_assets`` config's ``model_type`` (or
    ``adapter``), where the names alone pick none (:func:`~ckpttool.model.adapters.adapters_by_config`; only names
    of no known naming are asked: OLMo-core's)."""
    from ckpttool.model.adapters import adapters_by_config

    if cat.schema.naming != "unknown" or not cat.model:
        return ()
    return tuple(adapters_by_config(cat.schema.naming, cat.param_fqns))


def _plain(value: Any) -> Any:
    """JSON-safe view of a hyperparameter value (tuples -> lists, tensors -> numbers; a non-finite float, which JSON
    cannot hold, as the string ``"nan"``/``"inf"``/``"-inf"``: saved, so never ``None``, which says 'not saved')."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, float):
        return json_number(value)
    return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)


def _group_row(
    cat: Catalog, g: ParamGroup, gid: int | str, params: int, examples: list[str], has_state: bool
) -> GroupRow:
    return GroupRow(
        gid,
        g.flavor,
        {h: _plain(g.values.get(h)) for h in _GROUP_VALUES},
        params,
        tuple(examples),
        has_state,
        tuple(sorted(cat.missing_hyperparameters(g))),
        keeps_no_state(g),
        g.members_known,
    )


def _param_group_rows(cat: Catalog, filt: str | None) -> list[GroupRow]:
    """Nested groups as they are; flattened ones aggregated by leaf (equal values) and whether they have state."""

    def has_state(fqn: str) -> bool:
        ps = cat.optimizer_state.get(fqn)
        return ps is not None and bool(ps.fields)

    if cat.optimizer_flavor != "flattened":
        stepped = {f for f, ps in cat.optimizer_state.items() if ps.fields}
        return [
            _group_row(cat, g, g.group_id, len(g.params), g.params[:3], not stepped.isdisjoint(g.params))
            for g in cat.param_groups
        ]
    members: dict[tuple[str, bool], list[str]] = {}
    first: dict[tuple[str, bool], ParamGroup] = {}
    for g in cat.param_groups:
        fqn = str(g.group_id)
        if match_filter(cat.model_key(fqn), filt, cat.schema.model_prefix):
            sig = (leaf_key(g), has_state(fqn))  # a leaf (Catalog.leaves), split by state
            members.setdefault(sig, []).append(fqn)
            first.setdefault(sig, g)
    return [_group_row(cat, first[sig], fqns[0], len(fqns), fqns[:3], sig[1]) for sig, fqns in members.items()]


def _never_stepped(cat: Catalog, without: list[str], grouped: set[str] | None) -> tuple[str, ...]:
    """The members of a param group among ``without`` (sorted; all of them when ``grouped`` is ``None``: every fqn
    is grouped), less those of torch's SGD with momentum 0, which keeps no state however many steps it took (the
    groups are looked at only when some parameter lacks state: 10^6 flattened groups of a stepped AdamW are not)."""
    never_stepped = tuple(without) if grouped is None else tuple(filter(grouped.__contains__, without))
    stateless = {f for g in cat.param_groups if keeps_no_state(g) for f in g.params} if never_stepped else set()
    return tuple(f for f in never_stepped if f not in stateless) if stateless else never_stepped


def _with_fused(cat: Catalog, filt: str | None, params: list[str], buffers: list[str]) -> tuple[list[str], list[str]]:
    """``params`` with each parameter the optimizer steps fused while the model stores it split (torchtitan's ``wqkv``
    as ``wq``/``wk``/``wv``: ``ParamState.stored_as``) counted once by its optimizer fqn, as torch's metadata, the
    param groups and ``stats`` count it, and ``buffers`` without its stored split keys, which are no buffers (where
    ``--filter`` selects one of those keys)."""
    fused = {f: ps.stored_as for f, ps in cat.optimizer_state.items() if ps.stored_as}
    if not fused:
        return params, buffers
    split = set(chain.from_iterable(fused.values()))
    shown = [f for f, keys in fused.items() if any(match_filter(k, filt, cat.schema.model_prefix) for k in keys)]
    return params + [f for f in shown if f not in params], [b for b in buffers if cat.model_key(b) not in split]


def _optimizer_section(cat: Catalog, filt: str | None, declared: str | None) -> OptimizerSummary:
    # Param groups name the real parameters (nested: `params` lists; flattened: one group per
    # parameter); model tensors in no group are buffers.
    state = cat.optimizer_state
    fqns = cat.param_fqns
    shown = [f for f in fqns if match_filter(cat.model_key(f), filt, cat.schema.model_prefix)] if filt else fqns
    if cat.params_listed_in_order():  # every fqn is grouped (and there is one): no set of 10^6 names
        params, buffers, grouped = list(shown), [], None
    else:
        grouped = set(chain.from_iterable(g.params for g in cat.param_groups))
        nested_known = bool(grouped)
        params = [f for f in shown if f in grouped or f in state] if nested_known else shown
        buffers = [f for f in shown if f not in grouped and f not in state] if nested_known else []
    params, buffers = _with_fused(cat, filt, params, buffers)
    with_state = [f for f in filter(state.__contains__, params) if state[f].fields]
    stepped = set(with_state)
    without = sorted(f for f in params if f not in stepped) if stepped else sorted(params)
    never_stepped = _never_stepped(cat, without, grouped)
    field_dtypes: dict[str, Counter[str]] = defaultdict(Counter)
    implied: Counter[str] = Counter()
    by = saved_by_counts(cat, with_state)
    for fqn in with_state:
        ps = cat.optimizer_state[fqn]
        for name, dtype in ps.field_dtypes.items():
            field_dtypes[name][dtype] += 1
        implied[ps.implied_type or "unknown"] += 1
    return OptimizerSummary(
        flavor=cat.optimizer_flavor,
        params_total=len(params),
        params_with_state=len(with_state),
        fields={k: dict(v) for k, v in sorted(field_dtypes.items())},
        implied_type=implied.most_common(1)[0][0] if implied else None,
        implied_types=dict(implied),
        saved_by=next(iter(by), None),
        saved_by_counts=by,
        declared_type=declared,
        param_groups=tuple(_param_group_rows(cat, filt)),
        params_without_state=tuple(without),
        never_stepped_with_hyperparameters=never_stepped,
        orphan_state=tuple(sorted(f for f, ps in cat.optimizer_state.items() if not ps.in_model and not ps.stored_as)),
        buffers=tuple(buffers),
        _stored_split={f: ps.stored_as for f, ps in sorted(cat.optimizer_state.items()) if ps.stored_as},
    )


def _extra_state_row(st: ExtraState) -> ExtraStateRow:
    f = st.file
    if st.error is None:
        return ExtraStateRow(f.relative_path, f.size, f.rank, "ok", st.keys, st.global_step)
    status = "needs --trust-pickle" if isinstance(st.error, TrustRequiredError) else f"unreadable: {st.error}"
    return ExtraStateRow(f.relative_path, f.size, f.rank, status)


_IDENTITY_FIELDS: dict[str, type] = {
    "checkpoint": str,
    "algorithm": str,
    "metadata_digest": str,
    "metadata_size": int,
    "manifest_digest": str,
}


def source_identity_of(raw: Any) -> dict[str, Any] | None:
    """A recorded source identity (``converted_from.source``), kept only when well formed (untrusted input).

    Known fields of the right type (strings capped at 4096 characters); ``None`` for anything else.
    """
    if not isinstance(raw, dict):
        return None
    out: dict[str, Any] = {}
    for name, kind in _IDENTITY_FIELDS.items():
        v = raw.get(name)
        if v is None or (isinstance(v, kind) and not isinstance(v, bool) and len(str(v)) <= 4096):
            out[name] = v
        else:
            return None
    return out


def _derived_from(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The checkpoint this one was made from, as its layout record names it (``reshard`` outputs)."""
    resolved = ckpt.layout
    rec = resolved.record if resolved is not None else None
    if rec is None:
        return None
    cf = rec.raw.get("converted_from")
    return source_identity_of(cf.get("source")) if isinstance(cf, dict) else None


def _layout_section(ckpt: Checkpoint) -> LayoutSummary | None:
    cat, resolved = ckpt.catalog, ckpt.layout
    if resolved is None:
        return None
    ambiguous, geometry = tuple(resolved.ambiguous), tuple(resolved.geometry(cat))
    rec = resolved.record
    if rec is not None:
        return LayoutSummary(
            rec.version,
            rec.layout_name,
            resolved.source,
            rec.parallel,
            rec.extra_parallel,
            rec.optimizer,
            rec.global_step,
            ambiguous,
            geometry,
        )
    if not resolved.ep_tensors:
        return None
    # Unversioned or declared: EP tensors detected by name (docs/layouts.md).
    parallel = (
        {"ep_size": resolved.ep_size, "ep_fsdp_size": resolved.ep_fsdp_size}
        if resolved.ep_size is not None and resolved.ep_fsdp_size is not None
        else {}
    )
    return LayoutSummary(
        resolved.version,
        resolved.layout_name or "unversioned",
        resolved.source,
        parallel,
        resolved.ep_tensors,
        {},
        None,
        ambiguous,
        geometry,
        dict(resolved.candidates) if resolved.version is None else None,
    )


def _needed_bytes(ckpt: Checkpoint) -> dict[str, int]:
    """Bytes each data file must hold: the end of its last record (metadata only; no data read)."""
    return file_extents(ckpt.metadata.storage)


def _file_status(root: str, path: str, size: int | None, needed: int, referenced: bool) -> str:
    if _escapes(root, path):
        return "outside"  # no reader opens it (PathEscapeError, E101): not "missing"
    if size is None:
        return "missing"
    if size < needed:
        return "short"
    return "ok" if referenced else "unreferenced"


def _escapes(root: str, path: str) -> bool:
    """Whether the readers refuse ``path`` as leaving the checkpoint directory ``root`` (``resolve_inside``; a
    remote checkpoint's names cannot leave their prefix)."""
    if not os.path.isdir(root):
        return False
    try:
        resolve_inside(Path(root), path, what="data file")
    except PathEscapeError:
        return True
    return False


def _checked(ckpt: Checkpoint, opts: InspectOptions) -> InspectResult:
    """The overview of an open checkpoint, after inspect's refusals (see :func:`inspect`)."""
    if opts.sort not in SORT_KEYS:
        raise UsageError(f"`sort` {opts.sort!r} is not one of {', '.join(SORT_KEYS)}", param="sort")
    if ckpt.layout_error is not None and ckpt.declaration is not None:
        raise ckpt.layout_error  # a contradicting declaration is the user's error, not a finding
    ckpt.param_groups()
    if ckpt.byte_item_errors:  # inspect shows the values: an unreadable one is an error, not a finding
        raise next(iter(ckpt.byte_item_errors.values()))
    if ckpt.replica_error is not None:  # which rank's copy would it show? an error, as for every reader
        raise ckpt.replica_error
    if ckpt.tiling_error is not None:  # a tensor no file holds whole: an error, as for every reader
        raise ckpt.tiling_error
    return _build(ckpt, opts)


def _summary(cat: Catalog, tensors: Mapping[str, TensorEntry]) -> Summary:
    """Counts and bytes of the checkpoint (by dtype, by category) for the summary."""
    if cat.group_tensors:  # param-group entries saved as tensors: tensors of the checkpoint too
        tensors = {**tensors, **cat.group_tensors}
    dtypes, sizes = list(map(_dtype, tensors.values())), list(map(_nbytes, tensors.values()))
    bytes_by_dtype = {d: sum(compress(sizes, map(d.__eq__, dtypes))) for d in dict.fromkeys(dtypes)}  # a few dtypes
    state_bytes = sum(t.nbytes for ps in cat.optimizer_state.values() for t in ps.fields.values() if t)
    return Summary(
        files=sum(1 for f in cat.data_files if f.referenced),
        ranks=cat.ranks,
        bytes_on_disk=sum(f.size or 0 for f in cat.data_files),
        tensor_count=len(tensors),
        model_tensor_count=len(cat.model),
        byte_item_count=len(cat.byte_items),
        numel_model=sum(map(_numel, cat.model.values())),
        bytes_by_dtype=dict(sorted(bytes_by_dtype.items())),
        bytes_by_category={
            "model": sum(map(_nbytes, cat.model.values())),
            "optimizer_state": state_bytes,
            "other": sum(map(_nbytes, cat.other_tensors.values())) + sum(map(_nbytes, cat.group_tensors.values())),
        },
    )


def _model_rows(ckpt: Checkpoint, tensors: Mapping[str, TensorEntry], opts: InspectOptions) -> list[TensorEntry]:
    """The model tensors ``filter_glob`` selects, in ``sort`` order; raises when it matches no key at all, or only
    keys of the optimizer state (shown by their parameters: it would show nothing)."""
    cat, filt = ckpt.catalog, opts.filter_glob
    prefix = cat.schema.model_prefix
    model_rows = [t for t in cat.model.values() if match_filter(t.key, filt, prefix)] if filt else [*cat.model.values()]
    if filt and not model_rows and not any(match_filter(k, filt, prefix) for k in tensors):
        shown = f"the {prefix!r} prefix" if prefix else "a prefix"
        raise UsageError(
            f"`filter_glob` {filt!r} matches no key of {ckpt.path}",
            param="filter_glob",
            hint=cat.state_only_hint((filt,))
            or bare_glob_hint(filt, lambda g: sum(match_filter(k, g, prefix) for k in cat.model), "model tensor")
            or f"globs match keys with or without {shown}, e.g. "
            f"'{cat.fqn_of(next(iter(cat.model), 'layers.0.x')).split('.')[0]}.*'",
        )
    state_only = filt and not model_rows and not any(match_filter(k, filt) for k in cat.other_tensors)
    hint = cat.state_only_hint((filt,)) if filt and state_only else None
    if filt and hint:  # the glob matched optimizer state, which inspect shows by its parameters: nothing shown
        raise UsageError(
            f"`filter_glob` {filt!r} selects no model tensor of {ckpt.path}", param="filter_glob", hint=hint
        )
    if opts.sort == "size":
        model_rows.sort(key=lambda t: (-t.nbytes, t.key))
    return model_rows


def _file_rows(cat: Catalog, needed: dict[str, int]) -> tuple[FileRow, ...]:
    """One row per data file: size, rank, referenced, bytes the metadata needs, status."""
    return tuple(
        FileRow(
            f.relative_path,
            f.size,
            f.rank,
            f.referenced,
            needed.get(f.relative_path, 0),
            _file_status(str(cat.path), f.relative_path, f.size, needed.get(f.relative_path, 0), f.referenced),
        )
        for f in cat.data_files
    )


def file_rows(ckpt: Checkpoint) -> tuple[FileRow, ...]:
    """One :class:`FileRow` per data file of ``ckpt`` (metadata and file sizes only; no data read)."""
    return _file_rows(ckpt.catalog, _needed_bytes(ckpt))


def file_warnings(rows: Iterable[FileRow]) -> list[str]:
    """Warning texts for data files that are missing, short or not referenced (``[]``: none): what ``inspect``
    and ``stats`` say of ``rows`` (:func:`file_rows`), whichever records they read.

    An empty unreferenced file is not warned about, as ``validate``'s S006 does not report it: torch's
    ``dcp.save`` and ckpttool's ``import`` / ``reshard`` write one for each rank that gets no chunk (an import
    for 2048 ranks of a small model printed a warning line for each of ~1000 such files)."""
    what = {
        "missing": "is missing",
        "unreferenced": "is not referenced by .metadata",
        "outside": "lies outside the checkpoint directory (never read: a damaged or hostile .metadata)",
    }
    bad = [
        f"data file {f.path} "
        + (what.get(f.status) or f"is shorter than its records need ({f.size} < {f.needed} bytes; truncated?)")
        for f in rows
        if f.status != "ok" and not (f.status == "unreferenced" and f.size == 0)
    ]
    return [*bad, "run `ckpttool validate --strict` for the full list of problems"] if bad else []


def _build(ckpt: Checkpoint, opts: InspectOptions) -> InspectResult:
    cat, filt = ckpt.catalog, opts.filter_glob
    stateful = any(ps.fields for ps in cat.optimizer_state.values())
    tensors = cat.tensors if stateful or cat.other_tensors else cat.model  # read only: no copy of a model-only one
    model_rows = _model_rows(ckpt, tensors, opts)
    needed = _needed_bytes(ckpt)
    declared = None
    if ckpt.layout is not None and ckpt.layout.record is not None:
        declared = ckpt.layout.record.optimizer.get("type")
    summary = _summary(cat, tensors)
    tree = None
    if opts.depth:
        # --depth N: N levels below the model prefix ('model.' is not a level of the model)
        below = len(cat.schema.model_prefix.rstrip(".").split(".")) if cat.schema.model_prefix else 0
        agg = group_by_prefix([(t.key, t.numel, t.nbytes) for t in model_rows], opts.depth + below)
        tree = tuple(TreeRow(k, n, numel, nbytes) for k, (n, numel, nbytes) in agg.items())
    return InspectResult(
        path=str(ckpt.path),
        dcp_version=cat.dcp_version,
        summary=summary,
        files=_file_rows(cat, needed),
        model=tuple(model_rows),
        optimizer=_optimizer_section(cat, filt, declared),
        layout=_layout_section(ckpt),
        layout_error=ckpt.layout_error,
        extra_state=tuple(_extra_state_row(st) for st in ckpt.extra_state()),
        byte_items=tuple(cat.byte_items.items()),
        other_keys=tuple(cat.other_keys),
        other_tensors=tuple(t for t in cat.other_tensors.values() if match_filter(t.key, filt))
        if filt
        else tuple(cat.other_tensors.values()),
        tree=tree,
        schema=cat.schema,
        location=ckpt.located,
        model_adapter=_detected_adapter(cat),
        adapter_choices=_adapter_choices(cat),
        quantized=_quantized(ckpt, cat),
        training_state={k: tuple(v) for k, v in cat.training_state.items()},
        uncategorized_tensors=tuple(cat.uncategorized_tensors()),
        non_persistent_buffers=tuple(cat.non_persistent_buffers()),
        serialization="per_rank" if isinstance(ckpt.reader, PerRankReader) else ckpt.metadata.serialization,
        storage=_storage_stats(ckpt),
        derived_from=_derived_from(ckpt),
        training_values=_training_values(ckpt),
        hf_copies=tuple(hf_copies(ckpt.reader.path, ckpt.located.model)),
        trainer_state=(*_common_state(ckpt), *read_training_state_beside(ckpt.located.model)),
        unread_beside=ckpt.unread_beside(),
        unproven_shards=ckpt.unproven_shards(),
    )


def _common_state(ckpt: Checkpoint) -> tuple[TrainerState, ...]:
    """The trainer's common state (Megatron's ``common.pt``: its ``iteration``, the step a resume continues from) as a
    trainer-state row; ``()`` for a schema without one and a checkpoint without the file."""
    name = ckpt.common_state_file
    if name is None:
        return ()
    try:
        common = ckpt.common_state()
    except CkptError as e:
        return (TrainerState(name, error=str(e).splitlines()[0][:300]),)
    if common is None:
        return ()
    return (TrainerState(name, dict(common.values), common.keys),)


def _quantized(ckpt: Checkpoint, cat: Catalog) -> dict[str, Any] | None:
    """Quantized model weights and their scales (every convention :func:`ckpttool.model.quantized.scaled_pairs`
    pairs), ``None`` when there are none; the block size from a ``config.json`` beside the checkpoint, else 128.
    ``packed`` (only when there are some): ``{"weight", "method"}`` of each integer-packed weight
    (:func:`~ckpttool.model.quantized.packed_integer_weights`: AWQ/GPTQ, bitsandbytes, compressed-tensors packed or
    int), whose stored integers are codes, not values."""
    from itertools import repeat

    from ckpttool.model.quantized import (
        CT_SCALE_SUFFIX,
        FP8_SCALE_SUFFIX,
        PACKED_DTYPES,
        block_size,
        block_size_problem,
        compressed_tensors_block,
        packed_integer_weights,
        scaled_pairs,
        scheme_name,
        without_unusable_blocks,
    )

    dtypes = {*map(_dtype, cat.model.values())}
    # an FP8 scale's name: a scale beside no float8 weight (its weight missing or not float8) does not pair either
    scales = any(map(str.endswith, cat.model, repeat((FP8_SCALE_SUFFIX, ".weight" + CT_SCALE_SUFFIX))))
    if not scales and dtypes.isdisjoint(("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", *PACKED_DTYPES)):
        return None  # the dtypes and names first, in C: no row per tensor for a checkpoint without quantized weights
    tensors = {k: (t.dtype, tuple(t.shape)) for k, t in cat.model.items()}
    packed = [{"weight": k, "method": m} for k, m in packed_integer_weights(tensors)]
    if not (packed or scales) and dtypes.isdisjoint(("float8_e4m3fn", "float8_e5m2", "uint8", "float8_e8m0fnu")):
        return None  # integer tensors that are no packed weights (position ids, counters): no config read for them
    config = None
    cfg = os.path.join(ckpt.located.model, "config.json")
    if os.path.lexists(cfg):  # a FIFO, folder or dangling link is refused by the read, not taken for none
        from ckpttool.model.hfconfig import read_hf_config

        # the directory: a config.json symlinked out of it is E101; named as the folder's own, no option
        config = read_hf_config(ckpt.located.model, param=None)
    block = block_size(config)
    pairs, problems = scaled_pairs(tensors, config)
    pairs, unusable = without_unusable_blocks(pairs, config)  # as validate's M020, import's E612: no grid known
    problems += unusable
    unusable_grid = block_size_problem(config) is not None
    if not pairs and not problems and not packed:
        return None
    extra: dict[str, Any] = {"packed": packed} if packed else {}
    ct = compressed_tensors_block(config)
    if ct is not None:
        extra["compressed_tensors"] = scheme_name(ct)
    fp8_blocks = not unusable_grid and (
        any(p.kind in ("fp8-block", "fp8-experts") for p in pairs)
        or any(k.endswith(FP8_SCALE_SUFFIX) for k, _ in problems)
    )
    return {
        **extra,
        "block": list(block) if fp8_blocks else None,
        "schemes": _quant_schemes(pairs, block if fp8_blocks else None, extra.get("compressed_tensors")),
        "pairs": [
            {"kind": p.kind, "weight": p.weight, "scale": p.scale, "dequantized_shape": list(p.shape)} for p in pairs
        ],
        "problems": [{"key": k, "message": m} for k, m in problems],
    }


def _quant_schemes(pairs: list[Any], block: tuple[int, int] | None, ct: str | None) -> list[str]:
    """How the quantized weights present are scaled, one phrase per format (``inspect``'s ``quantized`` line and
    ``--json`` ``schemes``): FP8 blocks (``block``: only where block-FP8 ``x_scale_inv`` tensors are stored),
    compressed-tensors' scheme, vLLM's per-tensor FP8, MXFP4 groups (``2 * B`` FP4 values under one E8M0 scale)."""
    kinds = {p.kind for p in pairs}
    out = [f"compressed-tensors {'one scale per tensor' if ct == 'tensor' else ct}"] if ct else []
    if "fp8-tensor" in kinds:  # vLLM's per-tensor FP8: one scale a weight, no grid
        out.append("one FP8 scale per tensor")
    if block is not None:
        out.append(f"{block[0]}x{block[1]} blocks for FP8")
    groups = sorted({p.block[1] for p in pairs if p.kind == "mxfp4"})
    if groups:
        out.append(f"MXFP4 groups of {'/'.join(map(str, groups))} values, one E8M0 scale each")
    return out


#: Training-state leaves whose value ``inspect`` shows: the step counters (``train_state.step``,
#: a scheduler's ``last_epoch``/``_step_count``), torchtitan's token count and torchtune's recipe counters
#: (``epochs_run``, ``steps_run``, ``total_epochs``, ``max_steps_per_epoch``).
_TRAINING_LEAVES = (
    "step",
    "last_epoch",
    "_step_count",
    "ntokens_seen",
    "global_step",
    "epoch",
    "epochs_run",
    "steps_run",
    "total_epochs",
    "max_steps_per_epoch",
)


def _training_values(ckpt: Checkpoint) -> dict[str, int | float]:
    """The values of the step counters among the training-state keys (a few bytes each).

    A byte item holding a plain number (read with the no-globals unpickler), or a one-element
    integer/float tensor stored as its plain value (:meth:`~ckpttool.format.reader.CheckpointReader.read_scalar`,
    no torch). A key whose value cannot be read that way is left out (its key is still listed).
    """
    cat, reader, out = ckpt.catalog, ckpt.reader, {}
    for key in chain.from_iterable(cat.training_state.values()):
        if key.rsplit(".", 1)[-1] not in _TRAINING_LEAVES:
            continue
        try:
            if key in cat.byte_items:
                value = reader.read_object(key)
            elif key in cat.tensors:
                value = reader.read_scalar(key)
            else:
                continue
        except (CkptError, TrustRequiredError):
            continue
        if type(value) in (int, float):
            out[key] = value
    return out


def _storage_stats(ckpt: Checkpoint) -> dict[str, Any] | None:
    """Requests and bytes fetched from object storage for a remote checkpoint (``None`` for a path)."""
    stats = ckpt.reader.remote_stats()
    if stats is None:
        return None
    log.info("%s: %d storage request(s), %d byte(s) fetched", ckpt.path, stats["requests"], stats["bytes_requested"])
    return {"url": str(ckpt.path), **stats}


def inspect(
    source: CheckpointOrPath, options: InspectOptions | None = None, *, opening: OpenOptions | None = None
) -> InspectResult:
    """Metadata-only overview of a checkpoint (``ckpttool inspect``).

    Args:
        source: an opened :class:`~ckpttool.model.checkpoint.Checkpoint` (opened with
            ``record_problems=True`` an invalid layout record is reported in
            :attr:`InspectResult.layout_error`), or its path/URL, opened with ``opening``
            (and ``record_problems=True``).
        options: see :class:`InspectOptions`.

    Returns:
        The :class:`InspectResult` (``to_dict()``: schema ``ckpttool.inspect/1``, ``docs/inspect.md``).

    Raises:
        UsageError: ``sort`` unknown, ``filter_glob`` matching no key (or only optimizer-state keys).
        CkptError: an unreadable or unsafe param-group byte item.
        LayoutError: a layout declaration that contradicts the record or the chunk geometry.
        plus those of :func:`~ckpttool.model.checkpoint.open_checkpoint` (unusable ``.metadata``).
    """
    with gc_held(), open_source(source, opening, record_problems=True) as ckpt:
        return _checked(ckpt, options_of(options, InspectOptions))
