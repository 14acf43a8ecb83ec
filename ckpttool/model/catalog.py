"""The checkpoint catalog: a typed view of a DCP checkpoint built from metadata alone.

Built through the checkpoint's key schema (:mod:`ckpttool.model.schemas`): model tensors,
optimizer state and param groups, training state, the ``layout`` record, and the rest
("other": reported, never dropped). Nothing downstream spells a prefix: it asks the catalog
(:meth:`Catalog.model_key`, :meth:`Catalog.fqn_of`). FQNs contain dots, so keys are split by
``planner_data`` or the longest matching model fqn, never by counting dots.
:func:`build_catalog` reads only ``.metadata``; :func:`load_param_groups` the small param-group
byte items, importing torch only for a non-plain item. ``docs/design.md`` §2.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain, compress, filterfalse, repeat
from operator import add, and_, eq, getitem, is_, itemgetter, not_
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, NamedTuple

from ckpttool.errors import (
    CkptError,
    HyperparameterError,
    IndexedOptimizerStateError,
    IntegerRangeError,
    OptimStateError,
    PlannerDataError,
    shell_arg,
)
from ckpttool.format.directory import CheckpointDir, rank_of_file
from ckpttool.format.listing import FileListing, list_files
from ckpttool.format.mdstorage import chunk_path_columns, chunk_paths, key_ids, referenced_paths
from ckpttool.format.metadata import (
    DTYPE_ITEMSIZE,
    TRAINABLE_DTYPES,
    BytesMeta,
    CheckpointMetadata,
    ChunkMeta,
    StorageInfo,
    TensorMeta,
)
from ckpttool.format.storage import UrlPath, is_url, url_path
from ckpttool.layouts.record import LAYOUT_KEY, SIDECAR_NAME
from ckpttool.model.schemas import registry
from ckpttool.model.schemas.base import (
    CANONICAL_MODEL_PREFIX,
    CommonState,
    per_parameter_key,
    split_per_parameter_key,
)
from ckpttool.model.schemas.detect import detect_schema, fused_parts, planner_paths
from ckpttool.model.schemas.keyschema import KeySchema, SchemaOverride
from ckpttool.model.wrappers import pair_wrapped
from ckpttool.optim_state.known import saved_by
from ckpttool.optim_state.schema import infer_optimizer_type, missing_hyperparameters

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader

__all__ = [
    "refuse_long_numbers",
    "TensorEntry",
    "ParamState",
    "ParamGroup",
    "DataFile",
    "ExtraStateFile",
    "Catalog",
    "build_catalog",
    "leaf_key",
    "load_param_groups",
    "implied_optimizer_type",
    "saved_by_counts",
    "bare_glob_hint",
    "match_filter",
    "group_by_prefix",
    "KNOWN_NON_PERSISTENT_BUFFERS",
    "adapter_frozen",
    "frozen_params",
    "lost_state",
    "listed_twice",
    "dtype_refuted_by",
]

#: Buffers models register with ``persistent=False`` (recomputed at load, never in a state dict
#: ``from_pretrained`` expects): a checkpoint that stores them was saved from another kind of
#: state dict. Matched against the last fqn components.
KNOWN_NON_PERSISTENT_BUFFERS = (
    "rotary_emb.inv_freq",
    "rotary_emb.original_inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
    "attention.rope.cache",
    "rope.cache",
    "freqs_cis",
    "attn.bias",
    "attn.masked_bias",
    "moe.tokens_per_expert",
    "tokens_per_expert_E",
)
#: (names, ".name" suffixes) of :data:`KNOWN_NON_PERSISTENT_BUFFERS`: one set lookup and one ``endswith`` per key.
_NON_PERSISTENT = (frozenset(KNOWN_NON_PERSISTENT_BUFFERS), tuple("." + b for b in KNOWN_NON_PERSISTENT_BUFFERS))
#: Names that are a non-persistent buffer only as a mask of 2 or more dims (GPT-2's causal
#: ``attn.bias`` ``[1, 1, n, n]``): a 1-D ``attn.bias`` is the bias of a module called ``attn``.
_MASK_ONLY = ("attn.bias",)
#: Param-group items whose values define a leaf (everything but membership lists).
_MEMBERSHIP_ITEMS = ("params", "param_names")
_EXTRA_STATE_RE = re.compile(r"(\d+)")


class TensorEntry(NamedTuple):
    """A tensor of the checkpoint (immutable: a named tuple, so that 10^6 of them are built in C).

    Attributes:
        key: flattened checkpoint key (``model.model.layers.0.mlp.down_proj.weight``).
        shape: global shape; dtype: stored dtype name; numel, nbytes: global sizes.
        chunks: stored chunks; ranks: writing ranks (from ``__R_N.distcp`` names);
        files: data files holding its chunks; chunk_files: the data file of each chunk
        (``None``: no storage entry), aligned with ``chunks``.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int
    chunks: tuple[ChunkMeta, ...]
    ranks: tuple[int, ...]
    files: tuple[str, ...]
    chunk_files: tuple[str | None, ...] = ()

    def chunk_rank(self, i: int) -> int | None:
        """Writing rank of chunk ``i`` (``None``: unknown)."""
        f = self.chunk_files[i] if i < len(self.chunk_files) else None
        return _rank(f) if f is not None else None

    @property
    def uneven(self) -> bool:
        """Chunks of different sizes (e.g. dim 0 not divisible by the world size)."""
        chunks = self.chunks
        return len(chunks) > 1 and any(c.sizes != chunks[0].sizes for c in chunks)

    @property
    def zero_size_chunks(self) -> int:
        return sum(1 for c in self.chunks if 0 in c.sizes)


def alike_groups(found: Iterable[tuple[int | str, str, str]], sep: str = ": ") -> list[tuple[str, str]]:
    """``(key, message)`` of param-group findings ``found`` (``(group_id, key, problem)`` each), one per distinct
    ``problem`` in the order first found: the first group's ``key``, message ``param group <id>[ and N more]<sep>
    <problem>``. One place for the grouping of ``validate``'s per-group findings (P002, P006, R006) and
    ``replay-step``'s problems, so 21 groups with the same problem are one line with a count."""
    seen: dict[str, list[tuple[int | str, str]]] = {}
    for group_id, key, problem in found:
        seen.setdefault(problem, []).append((group_id, key))
    out: list[tuple[str, str]] = []
    for problem, hits in seen.items():
        more = f" and {len(hits) - 1} more" if len(hits) > 1 else ""
        out.append((hits[0][1], f"param group {hits[0][0]}{more}{sep}{problem}"))
    return out


@dataclass
class ParamState:
    """Optimizer state of one parameter: field name -> :class:`TensorEntry` (or ``None`` for a byte item).

    Attributes:
        fqn: the parameter fqn (the optimizer's name for it).
        fields: field name -> entry.
        in_model: ``fqn`` is a model tensor of the checkpoint.
        stored_as: model keys of a parameter the optimizer steps fused while the model's state
            dict stores it split (torchtitan ``wqkv`` saved as ``wq``/``wk``/``wv``); ``()`` otherwise.
    """

    fqn: str
    fields: dict[str, TensorEntry | None] = field(default_factory=dict)
    in_model: bool = True
    stored_as: tuple[str, ...] = ()

    @property
    def field_dtypes(self) -> dict[str, str]:
        """Field name -> stored dtype name (``"bytes"`` for a field saved as a byte item)."""
        return {name: (t.dtype if t is not None else "bytes") for name, t in self.fields.items()}

    @property
    def implied_type(self) -> str | None:
        """The optimizer type these fields imply (:func:`implied_optimizer_type`), or ``None``."""
        return implied_optimizer_type(self.field_dtypes)


@dataclass
class ParamGroup:
    """One parameter group.

    Attributes:
        group_id: group index (nested flavor) or parameter fqn (flattened flavor).
        flavor: ``"nested"`` or ``"flattened"``.
        keys: hyperparameter name -> checkpoint key of its byte item.
        values: hyperparameter name -> value, filled by :func:`load_param_groups`.
        params: parameter fqns of the group (flattened: ``[group_id]``; nested:
            from the ``params`` item once loaded).
        members_known: ``False`` for a group of the trainer's common state (Megatron's ``common.pt``, which saves
            no ``params``) whose members its schema cannot derive while parameters with state belong to its
            optimizer: ``params`` is then empty for want of knowledge, not because the group holds none.
    """

    group_id: int | str
    flavor: str
    keys: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)
    members_known: bool = True

    @property
    def leaf_values(self) -> dict[str, Any]:
        """The loaded hyperparameter values that define its leaf (all but ``params``/``param_names``)."""
        return {k: v for k, v in sorted(self.values.items()) if k not in _MEMBERSHIP_ITEMS}


@dataclass(frozen=True)
class DataFile:
    """A ``.distcp`` file: path relative to the checkpoint, size on disk (``None``: missing), rank."""

    relative_path: str
    size: int | None
    rank: int | None
    referenced: bool


@dataclass(frozen=True)
class ExtraStateFile:
    """A per-rank ``extra_state/*.pt`` file (torch.save of scheduler/step/RNG state)."""

    relative_path: str
    size: int
    rank: int | None


@dataclass
class Catalog:
    """Everything known about a checkpoint from its metadata (see module docstring).

    Attributes (besides the obvious): ``schema`` the key schema it was built through;
    ``training_state`` keys of training-state items (scheduler, data loader, step) by item;
    ``other_tensors`` every tensor that is neither a model tensor nor optimizer state nor a param-group entry;
    ``group_tensors`` param-group entries saved as tensors (``torch.optim.AdamW(lr=torch.tensor(...))``: its
    ``lr`` and a scheduler's ``initial_lr`` are 0-d tensors, which ``dcp.save`` stores as tensors, not byte items).
    """

    path: Path
    dcp_version: str | None
    model: dict[str, TensorEntry]
    optimizer_state: dict[str, ParamState]
    param_groups: list[ParamGroup]
    optimizer_flavor: str | None
    byte_items: dict[str, int]
    other_tensors: dict[str, TensorEntry]
    data_files: list[DataFile]
    extra_state: list[ExtraStateFile]
    has_layout_item: bool
    has_layout_sidecar: bool
    ranks: tuple[int, ...]
    schema: KeySchema = field(default_factory=lambda: KeySchema("torch-native", "model.", "optimizer."))
    training_state: dict[str, list[str]] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()  # fqns its format knows were never stepped (per-rank: Assembled.frozen)
    group_tensors: dict[str, TensorEntry] = field(default_factory=dict)
    wrapped: dict[str, str] = field(default_factory=dict)  # optimizer fqn -> its model fqn with wrapper segments
    _unwrapped: dict[str, str] = field(default_factory=dict, repr=False, compare=False)  # the reverse of wrapped
    _group_index: dict[str, ParamGroup] | None = field(default=None, repr=False, compare=False)
    _group_index_size: int = field(default=-1, repr=False, compare=False)
    _tensor_index: tuple[tuple[int, ...], dict[str, TensorEntry]] | None = field(
        default=None, repr=False, compare=False
    )
    # the groups whose params loading may change (all but flattened ones, which keep [fqn]), keyed by the list's id, len
    _loadable_groups: tuple[int, int, list[ParamGroup]] | None = field(default=None, repr=False, compare=False)
    _fqns: tuple[tuple[int, int, str | None, int], list[str]] | None = field(default=None, repr=False, compare=False)
    _paths: dict[str, tuple[Any, ...]] | None = field(default=None, repr=False, compare=False)  # planner_paths
    _common: dict[tuple[str, PurePath], tuple[CommonState | None, CkptError | None]] = field(
        default_factory=dict, repr=False, compare=False
    )  # common_state, per (schema, folder)
    _remote: CheckpointDir | None = field(default=None, repr=False, compare=False)  # a URL checkpoint's own reader
    _trust_pickle: bool = field(default=False, repr=False, compare=False)  # its reader's trust_pickle (common state)

    def common_state(self, where: str | os.PathLike[str] | None = None) -> CommonState | None:
        """The trainer's common state of the folder ``where`` (default: :attr:`path`), as its key schema's
        :attr:`~ckpttool.model.schemas.base.SchemaSpec.read_common_state` reads it, read once (an error too);
        ``None`` for a schema that declares none, or no such file.

        Raises:
            CkptError: the file is unreadable, needs ``--trust-pickle`` (the catalog of a reader opened with
                ``trust_pickle`` reads it with ``torch.load(weights_only=False)``), or is over the caps (the same error
                each call).
        """
        folder = self.path if where is None else where if isinstance(where, PurePath) else _folder(where)
        return _common_state(self.schema, folder, self._common, self._remote, self._trust_pickle)

    def state_only_hint(self, globs: Sequence[str]) -> str | None:
        """The hint of a ``--filter`` that selects no parameter but matches optimizer-state keys
        (``'*exp_avg_sq'``, or the bare word ``exp_avg_sq`` taken as ``'*exp_avg_sq*'``): a filter selects
        parameters, whose state comes with them. ``None``: each glob matches a model key, or no state key."""
        for g in globs:
            wide = g if any(c in g for c in "*?[") else f"*{g}*"
            if any(match_filter(k, wide, self.schema.model_prefix) for k in self.model):
                continue  # it selects parameters (widened: the bare word's own hint says so)
            for ps in self.optimizer_state.values():
                t = next((t for t in ps.fields.values() if t is not None and match_filter(t.key, wide, None)), None)
                if t is not None:
                    said = repr(g) if wide == g else f"{g!r} (no wildcard; {wide!r})"
                    return (
                        f"{said} matches optimizer state (e.g. {t.key!r}), which comes with its parameter: "
                        f"--filter selects parameters, e.g. {ps.fqn!r}"
                    )
        return None

    @property
    def param_fqns(self) -> list[str]:
        """Model keys without the schema's model prefix (the optimizer's fqns); a shared list, do not modify it.

        Built once and again only when ``model`` or the schema changed; the fqn strings of the
        planner paths when every model key has one (10^6 keys: no new strings).
        """
        sig = (id(self.model), len(self.model), self.schema.model_prefix, len(self.wrapped))
        if self._fqns is not None and self._fqns[0] == sig:
            return self._fqns[1]
        fqns = _fqns_of(self.model, self.schema.model_prefix or "", self._paths)
        if self.wrapped:  # the optimizer's names of a wrapped block's parameters (:attr:`wrapped`)
            fqns = [self._unwrapped.get(f, f) for f in fqns]
        self._fqns = (sig, fqns)
        return fqns

    def fqn_of(self, key: str) -> str:
        """The parameter fqn of model key ``key`` (the optimizer's name of a wrapped parameter: :attr:`wrapped`)."""
        fqn = self.schema.fqn_of(key)
        return self._unwrapped.get(fqn, fqn) if self._unwrapped else fqn

    def model_key(self, fqn: str) -> str:
        """The checkpoint key of parameter ``fqn`` (with the wrapper segments of a wrapped one: :attr:`wrapped`)."""
        return self.schema.model_key(self.wrapped.get(fqn, fqn) if self.wrapped else fqn)

    def model_entry(self, fqn: str) -> TensorEntry | None:
        """The model tensor of parameter ``fqn``, or ``None``."""
        return self.model.get(self.model_key(fqn))

    def state_key(self, fqn: str, field_name: str) -> str:
        """The checkpoint key of state field ``field_name`` of parameter ``fqn``."""
        if self.schema.optimizer_keying == INDEX_MAPPED:  # the key holds the parameter's index
            ps = self.optimizer_state.get(fqn)
            t = ps.fields.get(field_name) if ps is not None else None
            if t is not None:
                return t.key
            fqns = self.param_fqns
            return f"{self.schema.state_prefix}{fqns.index(fqn) if fqn in fqns else fqn}.{field_name}"
        if item := per_parameter_item(self.schema):  # one optimizer per parameter: optimizer.<fqn>.state.0.<field>
            return per_parameter_key(item, "state", fqn, field_name)
        if _state_splitter(self.schema) is not None:  # a schema with its own grammar (Megatron: field first)
            ps = self.optimizer_state.get(fqn)
            t = ps.fields.get(field_name) if ps is not None else None
            return t.key if t is not None else f"{self.schema.optimizer_prefix or 'optimizer.'}state.{field_name}.{fqn}"
        return f"{self.schema.state_prefix or 'optimizer.state.'}{fqn}.{field_name}"

    def group_key(self, group_id: int | str) -> str:
        """The key prefix of param group ``group_id`` (``optimizer.param_groups.<id>``; one optimizer per parameter:
        ``optimizer.<fqn>.param_groups.0``)."""
        if (item := per_parameter_item(self.schema)) and isinstance(group_id, str) and group_id != "*":
            return per_parameter_key(item, "param_groups", group_id)
        return f"{self.schema.groups_prefix or 'optimizer.param_groups.'}{group_id}"

    def category(self, key: str) -> str:
        """``model``, ``optimizer_state``, ``param_groups``, ``layout``, ``training_state`` or ``other``."""
        if key in self.model:
            return "model"
        split = _state_splitter(self.schema)
        if split is not None and split(key) is not None:
            return "optimizer_state"
        if (item := per_parameter_item(self.schema)) and (parts := split_per_parameter_key(key, item)) is not None:
            return "optimizer_state" if parts[0] == "state" else "param_groups"
        sp, gp = self.schema.state_prefix, self.schema.groups_prefix
        if sp is not None and key.startswith(sp):
            return "optimizer_state"
        if gp is not None and key.startswith(gp):
            return "param_groups"
        if key == LAYOUT_KEY:
            return "layout"
        if any(key in keys for keys in self.training_state.values()):
            return "training_state"
        return "other"

    def uncategorized_tensors(self) -> list[str]:
        """Tensors in no known category: not model, optimizer state, layout or training state."""
        return [k for k in self.other_tensors if self.category(k) == "other"]

    def per_parameter_optimizer_state(self) -> list[str]:
        """Uncategorized tensors that are the state of one optimizer per parameter, ``<prefix><fqn>.state.<i>.<field>``
        with ``<fqn>`` a model fqn: the state dict of torchtune's ``OptimizerInBackwardWrapper`` (``optimizer_in_bwd``:
        ``{fqn: optimizer.state_dict()}`` under ``optimizer.``) where the key schema does not read it (a schema other
        than ``torchtune``, or optimizers of several parameters: ``state.<i>`` with ``i`` not 0); ``[]`` for none."""
        fqns = set(self.param_fqns)
        lengths = {len(f) for f in fqns}
        out = []
        for key in self.uncategorized_tensors():
            head, sep, tail = key.rpartition(".state.")
            index, dot, field = tail.partition(".")
            if sep and dot and field and index.isdigit() and any(_suffixes(head, fqns, lengths)):
                out.append(key)
        return out

    def non_persistent_buffers(self) -> list[str]:
        """Model keys of buffers models register as non-persistent (:data:`KNOWN_NON_PERSISTENT_BUFFERS`).

        A key with optimizer state is a parameter whatever its name (a ``Linear`` called ``attn``
        has an ``attn.bias``), and ``attn.bias`` is GPT-2's mask only with 2 or more dims.
        """
        names, suffixes = _NON_PERSISTENT
        fqns = self.param_fqns
        # a name or a ".name" suffix ends with the name: test that first, for every fqn at C speed
        hits = list(compress(range(len(fqns)), map(str.endswith, fqns, repeat(KNOWN_NON_PERSISTENT_BUFFERS))))
        if not hits:
            return []
        keys = list(self.model)
        state, model = self.optimizer_state, self.model
        return [
            keys[i]
            for i in hits
            if (fqns[i] in names or fqns[i].endswith(suffixes))
            and fqns[i] not in state  # optimizer state: a trained parameter, not a buffer
            and not (fqns[i].endswith(_MASK_ONLY) and len(model[keys[i]].shape) < 2)
        ]

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        """All tensor entries: model, optimizer state fields, others."""
        out = dict(self.model)
        for ps in self.optimizer_state.values():
            for t in ps.fields.values():
                if t is not None:
                    out[t.key] = t
        out.update(self.other_tensors)
        return out

    def tensor(self, key: str) -> TensorEntry:
        """``tensors[key]`` in O(1): the index is built once and rebuilt when the model tensors, the parameters with
        optimizer state or the other tensors change in number (``tensors`` builds its dict anew: called per key,
        quadratic, minutes of ``stats`` at 10^4 tensors).

        Raises:
            KeyError: ``key`` is no tensor of the checkpoint.
        """
        stamp = (len(self.model), len(self.optimizer_state), len(self.other_tensors))
        if self._tensor_index is None or self._tensor_index[0] != stamp:
            self._tensor_index = (stamp, self.tensors)
        return self._tensor_index[1][key]

    @property
    def other_keys(self) -> list[str]:
        """Keys outside the schema (tensors and byte items)."""
        known_bytes = {k for g in self.param_groups for k in g.keys.values()}
        known_bytes.add(LAYOUT_KEY)
        state_bytes = {
            self.state_key(ps.fqn, f) for ps in self.optimizer_state.values() for f, t in ps.fields.items() if t is None
        }
        others = [k for k in self.byte_items if k not in known_bytes and k not in state_bytes]
        return sorted(list(self.other_tensors) + others)

    def group_of(self, fqn: str) -> ParamGroup | None:
        """The param group a parameter belongs to (nested: needs :func:`load_param_groups`).

        Nested groups list their members in ``params``; a flattened group is the group of
        the one parameter it is named after. O(1) after the first call: the fqn -> group
        index is rebuilt when the number of listed params changes (after loading).
        """
        return self.group_index().get(fqn)

    def group_index(self) -> dict[str, ParamGroup]:
        """fqn -> its param group (:meth:`group_of` for many fqns: look them up in this dict).

        Rebuilt when the number of listed params changed (after loading); do not keep it across loads.
        """
        # O(nested groups) per call, not O(all groups): one flattened group per parameter (torchtune's optimizer_in_bwd,
        # flatten_optimizer_state_dict) made a group_of per parameter quadratic (minutes at 10^4 parameters)
        groups, cached = self.param_groups, self._loadable_groups
        if cached is None or cached[:2] != (id(groups), len(groups)):
            cached = self._loadable_groups = (id(groups), len(groups), [g for g in groups if g.flavor != "flattened"])
        size = len(groups) + sum(len(g.params) - 1 for g in cached[2])
        if self._group_index is None or self._group_index_size != size:
            index: dict[str, ParamGroup] = {}
            for g in self.param_groups:  # the first group listing an fqn holds it (setdefault, at C speed)
                index.update(dict.fromkeys(filterfalse(index.__contains__, g.params), g))
            self._group_index, self._group_index_size = index, size
        return self._group_index

    def missing_hyperparameters(self, group: ParamGroup) -> list[str]:
        """The hyperparameters ``group`` lacks (:func:`~ckpttool.optim_state.schema.missing_hyperparameters`), told
        from its saved state fields where it lacks ``betas`` or ``eps`` (Lion's group, ``lion_group``; a group of
        another optimizer that lost every key, told by its state: Rprop's, Adafactor's, ...): those of its members,
        or of every parameter while a nested group's ``params`` are not loaded."""
        missing = missing_hyperparameters(group.keys)
        if not missing or ("eps" in group.keys and "betas" in group.keys):
            return missing
        members = group.params or list(self.optimizer_state)
        states = filter(None, map(self.optimizer_state.get, members))
        return missing_hyperparameters(group.keys, {f for ps in states for f in ps.fields})

    def params_listed_in_order(self) -> bool:
        """Do the param groups' ``params``, one group after the other, list exactly :attr:`param_fqns` in order?

        What a save of optimizers over all model tensors writes (no buffers, no frozen
        parameters): then every fqn has a group. A sufficient test, at C speed (``False`` says
        nothing; ask :meth:`group_index` then).
        """
        fqns = self.param_fqns
        groups = self.param_groups
        if not fqns or sum(len(g.params) for g in groups) != len(fqns):
            return False
        return list(chain.from_iterable(g.params for g in groups)) == fqns

    def leaves(self) -> list[tuple[str, ParamGroup, list[str]]]:
        """Sets of parameters that step together, as ``(label, first group, fqns)``.

        A nested param group is one leaf. In the flattened flavor (hyperparameters repeated
        per parameter; ``torch.distributed.checkpoint.state_dict`` with
        ``flatten_optimizer_state_dict=True``) the parameters whose loaded hyperparameter
        values are all equal form one leaf, which is how a multi-optimizer reassembles its
        groups. Needs :func:`load_param_groups` for the values.
        """
        out: list[tuple[str, ParamGroup, list[str]]] = []
        flat: dict[str, tuple[ParamGroup, list[str]]] = {}
        for g in self.param_groups:
            if g.flavor == "nested":
                out.append((f"param group {g.group_id}", g, list(g.params)))
            else:
                flat.setdefault(leaf_key(g), (g, []))[1].append(str(g.group_id))
        for g, fqns in flat.values():
            v = g.values
            out.append((f"flattened group with lr={v.get('lr')!r}, weight_decay={v.get('weight_decay')!r}", g, fqns))
        return out

    def tied_keys(self) -> tuple[str | None, str | None]:
        """``(lm_head key, input embedding key)`` of the model (``None`` where absent): the embedding transformers'
        model classes tie the head to (:func:`~ckpttool.model.hfconfig.tied_embedding_key`), else one by its name's
        end (a wrapped or other model's), else torchtitan's ``tok_embeddings.weight``."""
        from ckpttool.model.hfconfig import tied_embedding_key

        head = next((k for k in self.model if k.endswith("lm_head.weight")), None)
        fqns = {self.fqn_of(k): k for k in self.model}
        tied = tied_embedding_key(fqns)
        emb = fqns[tied] if tied is not None else None
        if emb is None:
            emb = next((k for k in self.model if k.endswith("embed_tokens.weight")), None)
        if emb is None:
            emb = next((k for k in self.model if k.endswith(("wte.weight", "word_embeddings.weight"))), None)
        if emb is None:
            emb = next((k for k in self.model if self.fqn_of(k) == "tok_embeddings.weight"), None)
        return head, emb


def _fqns_of(keys: dict[str, Any], prefix: str, paths: dict[str, tuple[Any, ...]] | None) -> list[str]:
    """``[KeySchema.fqn_of(k) for k in keys]`` for the model prefix ``prefix``, in C where it can be.

    A planner path that joins to its key (``paths``: :func:`~ckpttool.model.schemas.detect.planner_paths`)
    and is the prefix's components plus one ``str`` holds, as that last item, exactly the key
    without the prefix (``key == prefix + path[-1]``); when every key has such a path, those
    strings are the fqns (no new string per key). Otherwise the keys are cut (in C when all have the prefix).
    """
    if not prefix:
        return list(keys)
    if paths and prefix.endswith("."):
        head = tuple(prefix[:-1].split("."))
        held = list(map(paths.get, keys, repeat(())))
        if all(map(eq, map(_BUT_LAST, held), repeat(head))):
            last = list(map(_LAST, held))
            if {*map(type, last)} <= {str}:
                return last
    n = len(prefix)
    if all(map(str.startswith, keys, repeat(prefix))):  # the usual case: slice every key at C speed
        return list(map(itemgetter(slice(n, None)), keys))
    return [k[n:] if k.startswith(prefix) else k for k in keys]


_BUT_LAST = itemgetter(slice(None, -1))
_LAST = itemgetter(-1)
_RANK_CACHE: dict[str, int | None] = {}


def _rank(relative_path: str) -> int | None:
    r = _RANK_CACHE.get(relative_path, -1)
    if r == -1:
        r = _RANK_CACHE[relative_path] = rank_of_file(relative_path)
    return r


class _EntryBuilder:
    """Builds the :class:`TensorEntry` of tensors of one metadata, sharing what repeats (10^6 tensors).

    The file/rank tuples of one-chunk tensors are shared per data file, the ranks per file set, the
    element count per shape object (the parser shares equal shapes). :meth:`many` builds the
    entries of one-chunk tensors column-wise in C: all but the key is one tuple per (layout
    object, data file), and an entry is its key joined to that tuple.
    """

    def __init__(
        self,
        md_storage: Mapping[tuple[str, tuple[int, ...] | None], StorageInfo],
        rank_of: Callable[[str], int | None] = _rank,
    ) -> None:
        self.storage, self.get = md_storage, md_storage.get
        self.rank_of = rank_of
        self.by_path: dict[str | None, tuple[tuple[str, ...], tuple[str | None, ...], tuple[int, ...]]] = {}
        self.by_files: dict[tuple[str, ...], tuple[int, ...]] = {}
        self.numel: dict[int, tuple[tuple[int, ...], int]] = {}

    def _ranks(self, ufiles: tuple[str, ...]) -> tuple[int, ...]:
        r = self.by_files.get(ufiles)
        if r is None:
            r = self.by_files[ufiles] = tuple(sorted({r for r in map(self.rank_of, ufiles) if r is not None}))
        return r

    def one_file(self, rel: str | None) -> tuple[tuple[str, ...], tuple[str | None, ...], tuple[int, ...]]:
        """(files, chunk_files, ranks) of a one-chunk tensor stored in ``rel`` (``None``: no storage entry)."""
        shared = self.by_path.get(rel)
        if shared is None:
            ufiles: tuple[str, ...] = (rel,) if rel is not None else ()
            shared = self.by_path[rel] = (ufiles, (rel,), self._ranks(ufiles))
        return shared

    def sizes(self, meta: TensorMeta) -> tuple[int, int]:
        """(numel, nbytes) of ``meta``."""
        size = meta.size
        known = self.numel.get(id(size))
        if known is not None and known[0] is size:
            numel = known[1]
        else:
            numel = math.prod(size)
            self.numel[id(size)] = (size, numel)
        return numel, numel * DTYPE_ITEMSIZE[meta.dtype.name]

    def __call__(self, key: str, meta: TensorMeta) -> TensorEntry:
        get = self.get
        chunks = meta.chunks
        if len(chunks) == 1:
            info = get((key, chunks[0].offsets))
            ufiles, chunk_files, ranks = self.one_file(info.relative_path if info is not None else None)
        else:
            chunk_files = tuple([i.relative_path if (i := get((key, c.offsets))) is not None else None for c in chunks])
            ufiles = tuple(sorted({f for f in chunk_files if f is not None}))
            ranks = self._ranks(ufiles)
        numel, nbytes = self.sizes(meta)
        return _new_entry(
            TensorEntry, (key, meta.size, meta.dtype.name, numel, nbytes, chunks, ranks, ufiles, chunk_files)
        )

    def many(
        self, keys: list[str], metas: list[TensorMeta], sids: Sequence[int] | None = None
    ) -> dict[str, TensorEntry]:
        """``{key: self(key, meta)}`` for the aligned lists ``keys`` and ``metas``, in their order.

        Built in C (``map``/``zip`` over the columns) when the tensors share their layout objects
        (the parser and the cache's decode share equal layouts): the chunk offsets of the layout give the storage
        keys, and the layout with the data files of the records gives the rest of an entry, one
        tuple per distinct (layout, files) (:class:`_Tails`), so an entry is its key joined to it.
        ``sids``: the keys' string ids in the storage table, when known
        (:func:`~ckpttool.format.mdstorage.key_ids`).
        """
        # layouts by id (the metas stay alive, held by the caller); ids are recomputed where used, not kept
        # (10^6 int objects: 32 MB)
        layouts = dict(zip(map(id, metas), metas))
        if len(layouts) * 4 > len(metas):  # layouts not shared (metadata built by hand): one by one
            return dict(zip(keys, map(self, keys, metas)))
        offsets = {i: m.chunks[0].offsets for i, m in layouts.items() if len(m.chunks) == 1}
        tails = {i: _Tails(self, m) for i, m in layouts.items()}
        if len(offsets) == len(layouts):  # one chunk each
            return dict(zip(keys, self._one_chunk(keys, metas, offsets, tails, sids)))
        # with tensors of zero or several chunks: one stream of entries per layout of those (each fqn looked up
        # once for all its chunks), one for the one-chunk tensors, merged back in order by the layout of each key
        one = list(map(offsets.__contains__, map(id, metas)))
        several: dict[int, tuple[list[str], array[int]]] = {i: ([], array("i")) for i in layouts if i not in offsets}
        ids = compress(sids, map(not_, one)) if sids is not None else repeat(-1)
        for k, m, s in zip(compress(keys, map(not_, one)), compress(metas, map(not_, one)), ids):
            group, group_ids = several[id(m)]
            group.append(k)
            group_ids.append(s)
        streams: dict[int, Iterator[TensorEntry]] = {}
        for i, (group, group_ids) in several.items():  # per layout: the data file of each chunk, column by column
            offs = [c.offsets for c in layouts[i].chunks]
            cols = chunk_path_columns(self.storage, group, offs, group_ids if sids is not None else None)
            files = zip(*cols) if cols else repeat((), len(group))
            # built now: the record numbers of the chunk columns are freed before the next layout's
            built = list(map(_new_entry, repeat(TensorEntry), map(add, zip(group), map(tails[i].__getitem__, files))))
            streams[i] = iter(built)
        single_ids = array("i", compress(sids, one)) if sids is not None else None
        single = self._one_chunk(list(compress(keys, one)), list(compress(metas, one)), offsets, tails, single_ids)
        streams.update(dict.fromkeys(offsets, single))
        return dict(zip(keys, map(next, map(streams.__getitem__, map(id, metas)))))

    def _one_chunk(
        self,
        keys: list[str],
        metas: list[TensorMeta],
        offsets: dict[int, tuple[int, ...]],
        tails: dict[int, _Tails],
        sids: Sequence[int] | None,
    ) -> Iterator[TensorEntry]:
        """The entries of one-chunk tensors (layouts by id in ``offsets`` and ``tails``), in order, built in C."""
        rels = chunk_paths(self.storage, keys, map(offsets.__getitem__, map(id, metas)), sids)
        tails_of = map(tails.__getitem__, map(id, metas))
        return map(_new_entry, repeat(TensorEntry), map(add, zip(keys), map(getitem, tails_of, rels)))


class _Tails(dict[Any, tuple[Any, ...]]):
    """The :class:`TensorEntry` fields after ``key`` of tensors of layout ``meta``, by where their chunks are stored.

    Keyed by the data file of the chunk (one-chunk layouts: ``str`` or ``None``, no storage
    record) or by the tuple of the chunks' data files (other layouts).
    """

    def __init__(self, builder: _EntryBuilder, meta: TensorMeta) -> None:
        super().__init__()
        self.builder, self.meta = builder, meta

    def __missing__(self, where: Any) -> tuple[Any, ...]:
        meta, builder = self.meta, self.builder
        if len(meta.chunks) == 1:
            ufiles, chunk_files, ranks = builder.one_file(where)
        else:
            chunk_files = where  # kept as the key: zip makes a new tuple for its next row
            ufiles = tuple(sorted({f for f in chunk_files if f is not None}))
            ranks = builder._ranks(ufiles)
        numel, nbytes = builder.sizes(meta)
        tail = (meta.size, meta.dtype.name, numel, nbytes, meta.chunks, ranks, ufiles, chunk_files)
        self[where] = tail
        return tail


_new_entry = tuple.__new__


class _Inventory:
    """Longest-match splitter of ``<param_fqn>.<rest>`` against the parameter fqns of ``model``
    (:func:`_fqns_of` its keys; the set is built at the first split)."""

    def __init__(self, model: dict[str, TensorEntry], prefix: str, paths: dict[str, tuple[Any, ...]]) -> None:
        self._model, self._prefix, self._paths = model, prefix, paths
        self._set: set[str] | None = None

    @property
    def _fqns(self) -> set[str]:
        if self._set is None:
            self._set = set(_fqns_of(self._model, self._prefix, self._paths))
        return self._set

    def split(self, rest: str) -> tuple[str, str] | None:
        # Try every dot position from the right: the longest fqn that is known wins.
        pos = len(rest)
        fqns = self._fqns
        while True:
            pos = rest.rfind(".", 0, pos)
            if pos <= 0:
                return None
            head = rest[:pos]
            if head in fqns:
                return head, rest[pos + 1 :]


class _Sorter:
    """Sorts the keys that are not model tensors into optimizer state, param groups, training state and other."""

    def __init__(
        self,
        cd: CheckpointDir,
        sch: KeySchema,
        planner: dict[str, tuple[Any, ...]],
        model: dict[str, TensorEntry],
        entry: _EntryBuilder,
    ) -> None:
        self.cd, self.md, self.sch, self.planner, self.model, self.entry = cd, cd.metadata, sch, planner, model, entry
        self.inv = _Inventory(
            model, sch.model_prefix or "", planner
        )  # every model key starts with the prefix (model_test)
        self.opt_head = tuple(sch.optimizer_prefix[:-1].split(".")) if sch.optimizer_prefix else ()
        self.training_items = registry.derived().training_state_items
        self.root = sch.state_root
        self.optimizer_state: dict[str, ParamState] = {}
        self.model_set: set[str] | None = None
        self.groups: dict[Any, ParamGroup] = {}
        self.flavors: set[str] = set()
        self.byte_items: dict[str, int] = {}
        self.other_tensors: dict[str, TensorEntry] = {}
        self.group_tensors: dict[str, TensorEntry] = {}
        self.training: dict[str, list[str]] = {}

    def sort(self, items: Iterable[tuple[str, TensorMeta | BytesMeta]]) -> None:
        """Sort ``(key, meta)`` items (in order) into the categories."""
        state_prefix, groups_prefix = self.sch.state_prefix, self.sch.groups_prefix
        storage, planner, byte_items = self.md.storage, self.planner, self.byte_items
        split = _state_splitter(self.sch)
        item = per_parameter_item(self.sch)
        for key, meta in items:
            if isinstance(meta, BytesMeta):
                info = storage.get((key, None))
                byte_items[key] = info.length if info is not None else 0
            path = planner.get(key)
            parts = split(key) if split is not None else None
            own = split_per_parameter_key(key, item) if item else None
            if parts is not None:
                self._state_parts(key, meta, parts)
            elif own is not None:
                self._per_parameter(key, meta, own)
            elif state_prefix is not None and key.startswith(state_prefix):
                self._state(key, meta, path, state_prefix)
            elif groups_prefix is not None and key.startswith(groups_prefix):
                self._group(key, path, groups_prefix)
                if isinstance(meta, TensorMeta):  # a tensor hyperparameter (lr=torch.tensor(...))
                    self.group_tensors[key] = self.entry(key, meta)
            elif key != LAYOUT_KEY:
                top = self._item(key, path)
                if top in self.training_items:
                    self.training.setdefault(top, []).append(key)
                if isinstance(meta, TensorMeta):
                    self.other_tensors[key] = self.entry(key, meta)

    def _item(self, key: str, path: tuple[Any, ...] | None) -> str | None:
        """The item ``key`` belongs to below the schema's :attr:`~KeySchema.state_root` (``lr_scheduler`` of
        ``lr_scheduler.last_epoch``; ``scheduler`` of ``app.scheduler.last_epoch`` in an app-state save)."""
        root = self.root
        if not root or not key.startswith(root):  # top-level items beside an app's are read too
            return path[0] if path and isinstance(path[0], str) else key.split(".", 1)[0]
        return path[1] if path and len(path) > 1 and isinstance(path[1], str) else key[len(root) :].split(".", 1)[0]

    def _item_of(self, path: tuple[Any, ...] | None, part: str) -> tuple[Any, Any] | None:
        """``(id, name)`` when ``path`` is ``(*optimizer head, part, id, name)``, else ``None``."""
        n_head = len(self.opt_head)
        if not path or len(path) != n_head + 3 or tuple(path[:n_head]) != self.opt_head or path[n_head] != part:
            return None
        return path[n_head + 1], path[n_head + 2]

    def _state(self, key: str, meta: Any, path: tuple[Any, ...] | None, state_prefix: str) -> None:
        split = None
        n_head = len(self.opt_head)
        if (  # path is (*optimizer head, "state", fqn, field)
            path
            and len(path) == n_head + 3
            and tuple(path[:n_head]) == self.opt_head
            and path[n_head] == "state"
            and isinstance(path[n_head + 1], (str, int))
        ):
            split = (str(path[n_head + 1]), str(path[n_head + 2]))
        if split is None:
            split = self.inv.split(key[len(state_prefix) :])
        in_model = split is not None and self.sch.model_key(split[0]) in self.model
        if split is None:
            # Not a known parameter: the field is the last component (field names hold no dots).
            head, _, fld = key[len(state_prefix) :].rpartition(".")
            split = (head, fld)
        fqn, fld = split
        ps = self.optimizer_state.get(fqn)
        if ps is None:
            if not in_model and self.model_set is None:
                self.model_set = set(self.model)  # once, not per fqn (10^6 model keys)
            stored = () if in_model else (fused_parts(fqn, self.model_set or set(), self.sch.model_prefix or "") or ())
            ps = self.optimizer_state[fqn] = ParamState(fqn, in_model=in_model, stored_as=stored)
        ps.fields[fld] = self.entry(key, meta) if isinstance(meta, TensorMeta) else None

    def _state_parts(self, key: str, meta: Any, parts: tuple[str, str]) -> None:
        """A state key the schema split itself (:attr:`SchemaSpec.split_state_key`) into ``(fqn, field)``."""
        fqn, fld = parts
        ps = self.optimizer_state.get(fqn)
        if ps is None:
            ps = self.optimizer_state[fqn] = ParamState(fqn, in_model=self.sch.model_key(fqn) in self.model)
        ps.fields[fld] = self.entry(key, meta) if isinstance(meta, TensorMeta) else None

    def _per_parameter(self, key: str, meta: Any, parts: tuple[str, str, str]) -> None:
        """A key of one optimizer per parameter (:func:`per_parameter_item`): ``("state", fqn, field)`` is that
        parameter's state, ``("param_groups", fqn, hyper)`` its own group (flattened flavor: group id ``fqn``)."""
        part, fqn, name = parts
        if part == "state":
            self._state_parts(key, meta, (fqn, name))
            return
        self.flavors.add("flattened")
        g = self.groups.get(fqn)
        if g is None:
            g = self.groups[fqn] = ParamGroup(fqn, "flattened", params=[fqn])
        g.keys[name] = key
        if isinstance(meta, TensorMeta):  # a tensor hyperparameter (lr=torch.tensor(...))
            self.group_tensors[key] = self.entry(key, meta)

    def _group(self, key: str, path: tuple[Any, ...] | None, groups_prefix: str) -> None:
        rest = key[len(groups_prefix) :]
        raw = self._item_of(self.md.planner_data.get(key), "param_groups")
        if raw is not None:
            bad = raw[0]
            if type(bad) not in (int, str):
                raise PlannerDataError(
                    f"{self.cd.path}: planner_data gives {key!r} the param-group id {bad!r:.60} "
                    f"({type(bad).__name__}); group ids are list indices (int) or parameter names (str)",
                    fqn=key,
                )
        gid: Any
        item = self._item_of(path, "param_groups")
        if item is not None:
            gid, hyper = item[0], str(item[1])
        else:
            head, _, tail = rest.partition(".")
            if head.isdecimal() and tail and "." not in tail:
                gid, hyper = int(head), tail
            else:
                split = self.inv.split(rest)
                gid, hyper = split if split is not None else rest.rpartition(".")[::2]
        flavor = "nested" if isinstance(gid, int) else "flattened"
        self.flavors.add(flavor)
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = ParamGroup(gid, flavor, params=[] if flavor == "nested" else [str(gid)])
        g.keys[hyper] = key


def _files(
    listing: FileListing, referenced: set[str], rank_of: Callable[[str], int | None] = rank_of_file
) -> tuple[list[DataFile], list[ExtraStateFile]]:
    data_files = [DataFile(rel, size, rank_of(rel), rel in referenced) for rel, size in listing.data_files.items()]
    extra = []
    for rel, size, stem in listing.extra_state:
        m = _EXTRA_STATE_RE.findall(stem)
        extra.append(ExtraStateFile(rel, size, int(m[-1]) if m else None))
    return data_files, extra


def build_catalog(
    ckpt: CheckpointDir | str | os.PathLike[str],
    schema: KeySchema | SchemaOverride | None = None,
) -> Catalog:
    """Build the :class:`Catalog` of a checkpoint from ``.metadata`` and the listing of its files
    (:func:`ckpttool.format.listing.list_files`).

    Args:
        ckpt: an opened :class:`CheckpointDir` or a path.
        schema: the key schema to build through (a :class:`KeySchema`), an override of
            detection (:class:`SchemaOverride`), or ``None`` to detect it
            (:func:`~ckpttool.model.schemas.detect.detect_schema`).

    Raises:
        UsageError, MetadataError, UnsafePickleError, IncompleteCheckpointError:
            as :class:`CheckpointDir`.
        SchemaError: an override that matches no key.
    """
    cd = ckpt if isinstance(ckpt, CheckpointDir) else CheckpointDir(ckpt)
    md = refuse_long_numbers(cd.path, cd.metadata)
    sch = schema if isinstance(schema, KeySchema) else detect_schema(md, schema)
    planner = planner_paths(md)  # paths that flatten to their key; md.planner_data holds them all
    entries = md.entries
    # model tensors: the schema's test and the entries built column-wise (10^6 tensors)
    metas = list(entries.values())
    is_model = list(map(and_, map(is_, map(type, metas), repeat(TensorMeta)), sch.model_mask(entries, planner)))
    if (owned := _optimizer_owned(sch)) is not None:  # keys of a schema's own optimizer grammar are never the model's
        is_model = [m and not owned(k) for k, m in zip(entries, is_model)]
    # a per-rank save: the rank of each file is the one its format read it as (not in DCP's file names)
    saved_by = getattr(getattr(cd, "assembled", None), "file_ranks", None)
    rank_of = saved_by.get if saved_by else None
    entry = _EntryBuilder(md.storage, rank_of or _rank)
    ids = key_ids(md.storage, entries)  # the keys' string ids in the storage table, when known (a cache hit)
    model: dict[str, TensorEntry] = entry.many(
        list(compress(entries, is_model)),
        list(compress(metas, is_model)),  # type: ignore[arg-type]
        array("i", compress(ids, is_model)) if ids is not None else None,
    )
    del metas
    rest = _Sorter(cd, sch, planner, model, entry)
    rest.sort(compress(entries.items(), map(not_, is_model)))  # the rest, in order
    referenced = referenced_paths(md.storage) | {info.relative_path for _, _, info in md.replicas}
    files = list_files(cd, referenced, SIDECAR_NAME)
    data_files, extra = _files(files, referenced, rank_of or rank_of_file)
    ranks = tuple(sorted({f.rank for f in data_files if f.rank is not None and f.referenced}))
    flavors = rest.flavors
    groups = sorted(rest.groups.values(), key=lambda g: (isinstance(g.group_id, str), g.group_id))
    common: dict[tuple[str, PurePath], tuple[CommonState | None, CkptError | None]] = {}
    remote, trust = (cd if cd.remote is not None else None), getattr(cd, "trust_pickle", False) is True  # a reader's
    if sch.spec is not None and sch.spec.group_members is not None:  # param groups in the trainer's common state
        groups = _common_state_groups(sch, _common_state(sch, cd.path, common, remote, trust), rest.optimizer_state)
        flavors = {"nested"} if groups else set()
    if sch.spec is not None and sch.spec.index_state_by_param_order and sch.optimizer_keying == "index":
        sch, rest.optimizer_state = _index_mapped(sch, model, rest.optimizer_state, len(groups))
    sch, wrapped = _wrapped(sch, model, rest.optimizer_state, planner)
    return Catalog(
        path=cd.path,
        dcp_version=md.version,
        model=model,
        optimizer_state=rest.optimizer_state,
        param_groups=groups,
        optimizer_flavor=None if not flavors else (flavors.pop() if len(flavors) == 1 else "mixed"),
        byte_items=rest.byte_items,
        other_tensors=rest.other_tensors,
        data_files=data_files,
        extra_state=extra,
        has_layout_item=isinstance(md.entries.get(LAYOUT_KEY), BytesMeta),
        has_layout_sidecar=files.has_layout_sidecar,
        ranks=ranks,
        schema=sch,
        training_state=rest.training,
        group_tensors=rest.group_tensors,
        wrapped=wrapped,
        _unwrapped={v: k for k, v in wrapped.items()},
        _paths=planner,
        _trust_pickle=trust,
        _common=common,
        _remote=remote,
    )


#: The most digits ``int()`` reads (``sys.get_int_max_str_digits``' default): a key's index past it cannot be read.
_MAX_INDEX_DIGITS = 4300
_LONG_NUMBER = re.compile(rf"\d{{{_MAX_INDEX_DIGITS + 1},}}")


def refuse_long_numbers(path: Any, md: CheckpointMetadata) -> CheckpointMetadata:
    """``md``, or IntegerRangeError (E206) for a key holding a number of more than 4,300 digits (``model.layers.<5,000
    digits>.weight``): no layer, expert or param group has such an index, and ``int()`` refuses to read it."""
    if max(map(len, md.entries), default=0) <= _MAX_INDEX_DIGITS:  # the common case: one pass at C speed
        return md
    for key in md.entries:
        m = _LONG_NUMBER.search(key) if len(key) > _MAX_INDEX_DIGITS else None
        if m is not None:
            raise IntegerRangeError(
                f"{path}: key {key[: m.start() + 12]!r}... holds a number of {m.end() - m.start():,} digits "
                "(no layer, expert or param group has such an index)",
                fqn=key,
            )
    return md


def _wrapped(
    sch: KeySchema,
    model: dict[str, TensorEntry],
    state: dict[str, ParamState],
    paths: dict[str, tuple[Any, ...]] | None,
) -> tuple[KeySchema, dict[str, str]]:
    """Optimizer fqns that name no model tensor paired with the model fqn that holds the same name plus wrapper
    segments (:func:`~ckpttool.model.wrappers.pair_wrapped`: a block compiled or wrapped in place, saved with
    ``model.state_dict()`` beside ``get_optimizer_state_dict``); each paired state is marked ``in_model``, and the
    schema's reasons (inspect's key schema) say how many were paired."""
    if sch.optimizer_keying == "index":
        return sch, {}
    orphans = [f for f, ps in state.items() if not ps.in_model and not ps.stored_as]
    if not orphans:
        return sch, {}
    fqns = (f for f in _fqns_of(model, sch.model_prefix or "", paths) if f not in state)
    pairs = pair_wrapped(fqns, orphans)
    if not pairs:
        return sch, {}
    for fqn in pairs:
        state[fqn].in_model = True
    fqn, stored = next(iter(pairs.items()))
    why = (
        f"{len(pairs)} optimizer fqn(s) paired with the model key that adds wrapper segments to it "
        f"({fqn} -> {sch.model_key(stored)}: a block compiled or wrapped in place)"
    )
    return replace(sch, reasons=(*sch.reasons, why)), pairs


def _folder(where: str | os.PathLike[str]) -> PurePath:
    """The folder ``where`` names: a URL's :class:`UrlPath` (never the local ``s3:/…`` of ``Path(url)``)."""
    return url_path(where) if is_url(where) else Path(where)


def _common_state(
    sch: KeySchema,
    where: PurePath,
    cache: dict[tuple[str, PurePath], tuple[CommonState | None, CkptError | None]],
    remote: CheckpointDir | None = None,
    trust_pickle: bool = False,
) -> CommonState | None:
    """:meth:`Catalog.common_state` of folder ``where`` under schema ``sch``, kept in ``cache``; ``remote``: the
    reader of a URL checkpoint, whose own prefix's common state it fetches; ``trust_pickle``: the file may be read
    with ``torch.load(weights_only=False)`` (the command's ``--trust-pickle``)."""
    spec = sch.spec
    if spec is None or spec.read_common_state is None or spec.common_state_file is None:
        return None
    if isinstance(where, UrlPath) and (remote is None or str(where) != str(remote.path)):
        return None  # another URL's common state is not fetched; no local file named like it is read either
    hit = cache.get((spec.name, where))
    read = (trust_pickle and spec.read_trusted_common_state) or spec.read_common_state
    if hit is None:
        try:
            data = _common_state_bytes(where, spec.common_state_file, remote)
            shown = str(where / spec.common_state_file)
            hit = (None if data is None else read(data, shown), None)
        except CkptError as e:
            hit = (None, e)
        cache[(spec.name, where)] = hit
    if hit[1] is not None:
        raise hit[1]
    return hit[0]


def _common_state_bytes(where: PurePath, name: str, remote: CheckpointDir | None) -> bytes | None:
    """The bytes of the common-state file ``name`` of folder ``where`` (``None``: no such file), read as every file
    of a checkpoint is: confined to the folder, a regular file, at most ``--max-object-size``. A URL checkpoint's
    own prefix is read through its reader (``remote``): absent from its listing is no such file.

    Raises:
        PathEscapeError, NotRegularFileError, SizeLimitError, DataFileError: as ``CheckpointDir.read_file``.
    """
    from ckpttool.format import limits
    from ckpttool.format.files import read_regular, resolve_inside

    cap = limits.current().max_object_bytes
    if isinstance(where, UrlPath):
        assert remote is not None and remote.remote is not None
        if remote.remote.size(name) is None:  # confined to the prefix, or PathEscapeError
            return None
        return remote.read_file(name, cap, what=name)
    folder = Path(where)
    p = folder / name
    if not os.path.lexists(p):
        return None
    # a symlink out of the folder is refused (E101), a FIFO or a directory of that name is named (E102)
    src = resolve_inside(folder, name, what=name)
    return read_regular(src, cap, shown=p, what=name)


def _common_state_groups(sch: KeySchema, common: CommonState | None, state: dict[str, ParamState]) -> list[ParamGroup]:
    """The param groups of the trainer's common state, their members by its trainer's default rule
    (:attr:`~ckpttool.model.schemas.base.SchemaSpec.group_members`)."""
    spec = sch.spec
    if common is None or spec is None or spec.group_members is None:
        return []
    params = {fqn: (t.key, t.shape) for fqn, ps in state.items() for t in ps.fields.values() if t is not None}
    groups = []
    for i, (values, members) in enumerate(spec.group_members(common, params)):
        keys = {h: f"{spec.common_state_file}:optimizer.param_groups.{i}.{h}" for h in values}
        groups.append(ParamGroup(i, "nested", keys=keys, values=values, params=members))
        if "step" in values and spec.shared_step_params is None:  # the shared step, saved once in the common state
            for fqn in members:
                state[fqn].fields.setdefault("step", None)
    if spec.shared_step_params is not None:  # every parameter's of its optimizer, in whichever group
        for fqn in spec.shared_step_params(common, params):
            state[fqn].fields.setdefault("step", None)
    _mark_unknown_members(groups, params)
    return groups


def _mark_unknown_members(groups: list[ParamGroup], params: Mapping[str, Any]) -> None:
    """Where parameters with state are in no group, the groups of each chained optimizer none of whose groups got
    a member hold them: their members are unknown (:attr:`ParamGroup.members_known`), not none."""
    grouped = {f for g in groups for f in g.params}
    if all(f in grouped for f in params):
        return
    chains: dict[Any, list[ParamGroup]] = {}
    for g in groups:
        chains.setdefault(g.values.get("chained_optimizer"), []).append(g)
    for members in chains.values():
        if not any(g.params for g in members):
            for g in members:
                g.members_known = False


#: ``KeySchema.optimizer_keying`` of index-keyed state mapped to fqns by the parameter order (torchtune)
INDEX_MAPPED = "index-mapped"


def _index_mapped(
    sch: KeySchema, model: dict[str, TensorEntry], state: dict[str, ParamState], n_groups: int = 1
) -> tuple[KeySchema, dict[str, ParamState]]:
    """Index-keyed optimizer state (``optimizer.state.<i>.<field>``) renamed to the fqns of the parameters.

    torch's ``Optimizer.state_dict()`` numbers the parameters of its ``param_groups`` 0, 1, ...
    in order (``torch/optim/optimizer.py``, ``state_dict``: ``param_mappings``); torchtune
    builds the optimizer from ``model.parameters()`` and its models have no persistent buffers,
    so index ``i`` is the ``i``-th key of the model's state dict, the order ``.metadata`` keeps
    them in. The groups' ``params`` lists confirm it when they are read (:func:`load_param_groups`).
    An index beyond the model tensors leaves the state keyed by index (rule ``K003``), and so does an optimizer of
    several param groups (not the one group of ``model.parameters()``: its own order, a loop's decay / no-decay
    split) or a state tensor whose shape is not the mapped parameter's (0-d fields such as ``step`` aside).
    """
    fqns = [sch.fqn_of(k) for k in model]
    if n_groups > 1 or not all(i.isdecimal() and int(i) < len(fqns) for i in state):
        return sch, state
    shapes = [e.shape for e in model.values()]
    for i, ps in state.items():
        if any(t is not None and t.shape and t.shape != shapes[int(i)] for t in ps.fields.values()):
            return sch, state
    mapped: dict[str, ParamState] = {}
    for i, ps in state.items():
        fqn = fqns[int(i)]
        mapped[fqn] = ParamState(fqn, fields=ps.fields, in_model=True)
    why = (
        f"optimizer state under {sch.optimizer_prefix!r} is keyed by parameter index (torch's optimizer.state_dict()); "
        f"index i is the model's i-th parameter ({len(fqns)} in the model's state-dict order)"
    )
    reasons = tuple(why if "keyed by parameter index" in r else r for r in sch.reasons)
    return replace(sch, optimizer_keying=INDEX_MAPPED, reasons=reasons), mapped


def per_parameter_item(sch: KeySchema) -> str:
    """The optimizer item of ``sch`` saved as one optimizer per parameter (``optimizer.``: torchtune's
    ``optimizer_in_bwd``, :attr:`~ckpttool.model.schemas.base.SchemaSpec.per_parameter_optimizers`), where detection
    chose it as the optimizer prefix (or the schema was given with it); ``""`` otherwise."""
    spec = sch.spec
    item = spec.per_parameter_optimizers if spec is not None else ""
    return item if item and sch.optimizer_prefix == item and sch.optimizer_keying == "fqn" else ""


def _state_splitter(sch: KeySchema) -> Any:
    """The schema's own state-key splitter (:attr:`SchemaSpec.split_state_key`), or ``None``."""
    spec = registry.find(sch.id)
    return spec.split_state_key if spec is not None else None


def _optimizer_owned(sch: KeySchema) -> Callable[[str], bool] | None:
    """Whether a key is the optimizer's by the schema's own grammar: a state key (:attr:`SchemaSpec.split_state_key`),
    or another key of its optimizer (:attr:`SchemaSpec.optimizer_key`); ``None`` without such a grammar."""
    spec = registry.find(sch.id)
    if spec is None or spec.split_state_key is None:
        return None
    split, own = spec.split_state_key, spec.optimizer_key
    return lambda key: split(key) is not None or (own is not None and own(key))


def leaf_key(group: ParamGroup) -> str:
    """The key of the leaf a param group belongs to (see :meth:`Catalog.leaves`).

    A nested group is its own leaf (``"group <i>"``); flattened groups with equal loaded
    hyperparameter values share one.
    """
    if group.flavor == "nested":
        return f"group {group.group_id}"
    return repr(group.leaf_values)


def load_param_groups(cat: Catalog, reader: CheckpointReader, errors: dict[str, CkptError] | None = None) -> None:
    """Fill ``values`` (and ``params`` for nested groups) of every param group from its byte items.

    Args:
        cat: the catalog.
        reader: a reader of the same checkpoint.
        errors: when given, a byte item that cannot be read safely is recorded here
            (key -> error) and skipped; otherwise its error is raised.

    Raises:
        CkptError: a byte item cannot be read safely (only without ``errors``).
    """
    own = per_parameter_item(cat.schema)
    for g in cat.param_groups:
        for hyper, key in g.keys.items():
            # a per-parameter optimizer's group has its fqn as params already; its saved params is still checked
            if hyper in g.values or (hyper == "params" and g.params and not (own and g.flavor == "flattened")):
                continue  # loaded already
            try:
                value = _group_value(reader, key)
            except CkptError as e:
                if errors is None:
                    raise
                errors[key] = e
                continue
            if hyper == "params":
                try:
                    _check_params(cat, g, value)
                    if own and g.flavor == "flattened":
                        _check_own_params(cat, g, value)
                        continue
                except CkptError as e:
                    if errors is None:
                        raise
                    errors[key] = e
                    continue
                if isinstance(value, (list, tuple)):
                    g.params = list(map(str, value))
                    if cat.schema.optimizer_keying == INDEX_MAPPED:
                        g.params = _group_fqns(cat, g)
                continue
            g.values[hyper] = value


def _check_params(cat: Catalog, group: ParamGroup, value: Any) -> None:
    """Refuse a nested group's ``params`` that is not a list of parameter names (or indices): an entry ``None``, or
    ``params`` saved as a string or another object, would else be read as no parameter or a parameter ``"None"``.

    Raises:
        HyperparameterError (E514): naming the group and what its ``params`` holds.
    """
    hint = (
        "the param groups were edited or converted wrongly: save them from the optimizer (its state_dict() lists "
        "each group's parameters), or use an earlier checkpoint"
    )

    def shown(v: Any) -> str:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    if not isinstance(value, (list, tuple)):
        raise HyperparameterError(
            f"{cat.path}: param group {group.group_id}: params is a {type(value).__name__} ({shown(value)}), not a "
            "list of parameter names",
            hint=hint,
        )
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise HyperparameterError(
                f"{cat.path}: param group {group.group_id}: params entry {i} of {len(value)} is {shown(v)}, not a "
                "parameter name",
                hint=hint,
            )


def _check_own_params(cat: Catalog, group: ParamGroup, value: Any) -> None:
    """Refuse the ``params`` of one optimizer per parameter (:func:`per_parameter_item`) that is not ``[0]``: that
    optimizer held other parameters than the one its state is read for (``state.0``), which torch's
    ``load_state_dict`` of a one-parameter optimizer refuses, and which parameter is its index 0 is not recorded.

    Raises:
        HyperparameterError (E514): naming the group (the parameter's fqn) and what its ``params`` lists.
    """
    if len(value) != 1 or value[0] != 0:
        shown = repr(list(value[:4]))[:-1] + (", ...]" if len(value) > 4 else "]")
        raise HyperparameterError(
            f"{cat.path}: param group {group.group_id} (one optimizer per parameter): params lists {len(value)} "
            f"parameter(s) {shown}, not that parameter alone ([0]): its optimizer held other parameters, so its "
            "state.0 is not known to be this parameter's",
            hint="save with one optimizer per parameter as torchtune's optimizer_in_bwd does, or with one optimizer "
            "(optimizer_in_bwd False); or use an earlier checkpoint",
        )


def _group_value(reader: CheckpointReader, key: str) -> Any:
    """One param-group entry: a byte item, or a tensor entry (``torch.optim.AdamW(lr=torch.tensor(...))`` saves
    its ``lr`` as a 0-d tensor, which ``dcp.save`` stores as a tensor): one element read as a Python number
    (from its stored bytes, without torch, where :meth:`~CheckpointReader.read_scalar` can), a larger tensor
    described (``SavedTensor``), never read."""
    from ckpttool.format.reader import SavedTensor

    meta = reader.metadata.entries.get(key)
    if isinstance(meta, TensorMeta):
        if meta.numel == 1:
            value = reader.read_scalar(key)
            return value if value is not None else reader.read_tensor(key).reshape(()).item()
        return SavedTensor(str(meta.dtype), tuple(meta.size))
    return reader.read_object(key)


def _group_fqns(cat: Catalog, group: ParamGroup) -> list[str]:
    """The fqns of an index-keyed group's ``params`` (:func:`_index_mapped`).

    Raises:
        IndexedOptimizerStateError: the groups do not number the model's parameters 0..N-1 in order,
            so index ``i`` is not the model's ``i``-th parameter.
    """
    fqns = cat.param_fqns
    start = sum(len(g.params) for g in cat.param_groups[: cat.param_groups.index(group)])
    want = [str(i) for i in range(start, start + len(group.params))]
    last = group is cat.param_groups[-1]
    if group.params != want or (last and start + len(group.params) != len(fqns)):
        raise IndexedOptimizerStateError(
            f"{cat.path}: param group {group.group_id} lists parameter indices "
            f"{', '.join(group.params[:4])}{', ...' if len(group.params) > 4 else ''} of a model with {len(fqns)} "
            "parameters: the optimizer was not built from model.parameters() in order, so no index can be matched "
            "to a parameter",
            hint="the indices number the optimizer's own parameter list; a checkpoint of an optimizer built from "
            "model.parameters() (torchtune's recipes) is read by index",
        )
    return [fqns[int(i)] for i in group.params]


#: A name component of a LoRA / DoRA adapter parameter: PEFT's ``lora_A``/``lora_B``/``lora_embedding_A``/
#: ``lora_embedding_B``/``lora_magnitude_vector``, torchtune's and torchtitan's ``lora_a``/``lora_b``, torchtune
#: DoRA's ``magnitude``.
_ADAPTER_PARAM = re.compile(r"(?:^|\.)(?:lora_[aAbB]|lora_embedding_[AB]|lora_magnitude_vector|magnitude)(?:\.|$)")


def _stateless_in_stepped_leaves(cat: Catalog) -> Iterator[tuple[str, list[str], list[str]]]:
    """``(label, fqns with state, model tensors without state)`` of each leaf that stepped (some state in it);
    ``cat.frozen`` left out."""
    stepped = {f for f, ps in cat.optimizer_state.items() if ps.fields}
    model = cat.model
    for label, _, fqns in cat.leaves():
        if stepped.isdisjoint(fqns):
            continue
        without = [f for f in fqns if f not in stepped and f not in cat.frozen and cat.model_key(f) in model]
        yield label, [f for f in fqns if f in stepped], without


def adapter_frozen(cat: Catalog) -> list[str]:
    """The frozen base weights of an adapter (LoRA) setup, in leaf order: in a leaf whose parameters with
    state are all adapter parameters (:data:`_ADAPTER_PARAM`: ``lora_A``, ``lora_b``, ``magnitude``, ...),
    the other parameters without state.

    torchtune's LoRA recipes (and a plain ``AdamW(model.parameters())`` over a model with
    ``requires_grad_(False)`` base weights) pass the frozen weights to the optimizer, which never gives
    them state: never stepped, not lost state. An adapter parameter without state is not counted (lost),
    nor is any parameter of a leaf where a non-adapter parameter has state. Needs
    :func:`load_param_groups` for flattened leaves.
    """
    out: list[str] = []
    for _, with_state, without in _stateless_in_stepped_leaves(cat):
        if all(_ADAPTER_PARAM.search(f) for f in with_state):
            out.extend(f for f in without if not _ADAPTER_PARAM.search(f))
    return out


def frozen_params(cat: Catalog) -> frozenset[str]:
    """Parameters known never stepped, not lost state: ``cat.frozen`` (a format that shows it) and
    :func:`adapter_frozen`."""
    return cat.frozen | frozenset(adapter_frozen(cat))


def dtype_refuted_by(
    param: TensorEntry | None, fields: Mapping[str, TensorEntry | None]
) -> tuple[str, TensorEntry] | None:
    """``(field name, entry)`` of a floating optimizer-state field (not ``step``) of ``param``'s shape when
    ``param`` is stored in a dtype no optimizer steps (an integer, bool; :data:`TRAINABLE_DTYPES`): the
    parameter's dtype record is then the wrong one (a safetensors header changed from ``F32`` to ``I32``);
    ``None`` otherwise. Used by ``validate`` (``O005``) and ``export`` (``E511``).
    """
    if param is None or param.dtype in TRAINABLE_DTYPES:
        return None
    for name, t in fields.items():
        if t is not None and name != "step" and t.dtype in TRAINABLE_DTYPES and t.shape == param.shape:
            return name, t
    return None


def lost_state(cat: Catalog) -> dict[str, str]:
    """Parameters with no optimizer state in a leaf whose other parameters have state (the leaf stepped).

    The one check behind ``validate`` rule ``O009`` and ``replay-step``'s ``E513``: a leaf
    (:meth:`Catalog.leaves`: a nested param group, or flattened parameters with equal saved
    hyperparameters) steps all its parameters together, so a member without state lost it
    (or never got a gradient, and a resume would then bias-correct it as step 1). Only model
    tensors count, not ``cat.frozen`` (a format that shows they were never stepped) nor the frozen
    base weights of an adapter setup (:func:`adapter_frozen`); needs :func:`load_param_groups`
    for flattened leaves.

    Returns:
        fqn -> the label of its leaf, in leaf order.
    """
    out: dict[str, str] = {}
    for label, with_state, without in _stateless_in_stepped_leaves(cat):
        adapter_only = all(_ADAPTER_PARAM.search(f) for f in with_state)
        for f in without:
            if not adapter_only or _ADAPTER_PARAM.search(f):
                out[f] = label
    return out


def _number_text(v: Any) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


def listed_twice(cat: Catalog) -> Iterator[tuple[str, str]]:
    """``(fqn, message)`` of each parameter listed more than once in the param groups (loaded: needs
    :func:`load_param_groups`), in group order; the one check behind ``validate``'s ``P005`` and ``replay-step``'s
    ``E514``.

    In two groups: ``torch.optim`` refuses to build such an optimizer ("some parameters appear in more than one
    parameter group"), so no run saved it; the catalog takes the first group, and which ``lr`` stepped the parameter
    is unknown (nor, with equal hyperparameters, whether it was stepped once per step). Twice in one group:
    ``torch.optim`` warns ("duplicate parameters") and steps it twice per optimizer step, so one replayed step is
    not the run's; a resume through ``set_optimizer_state_dict`` keeps one entry and steps it once.
    """
    if sum(len(g.params) for g in cat.param_groups) == len(cat.group_index()):
        return  # every fqn listed once (the common case, at C speed)
    first: dict[str, ParamGroup] = {}
    for g in cat.param_groups:
        here: set[str] = set()
        for f in g.params:
            h = first.setdefault(f, g)
            if h is g:
                if f in here:
                    yield (
                        f,
                        f"parameter {f} is listed twice in param group {g.group_id}: torch.optim steps a duplicated "
                        "parameter twice per optimizer step (it warns 'duplicate parameters'), while a resume steps "
                        "it once, so which update the saved state leads to is unknown",
                    )
                here.add(f)
                continue
            if h.leaf_values != g.leaf_values:
                a, b = h.values, g.values
                yield (
                    f,
                    f"parameter {f} is listed in param groups {h.group_id} (lr {_number_text(a.get('lr'))}, "
                    f"weight_decay {_number_text(a.get('weight_decay'))}) and {g.group_id} (lr "
                    f"{_number_text(b.get('lr'))}, weight_decay {_number_text(b.get('weight_decay'))}): torch.optim "
                    "never builds a parameter into two groups, so which hyperparameters step it is unknown",
                )
                continue
            yield (
                f,
                f"parameter {f} is listed in param groups {h.group_id} and {g.group_id} (equal hyperparameters): "
                "torch.optim never builds a parameter into two groups, so whether the run stepped it once or twice "
                "per step is unknown",
            )


def saved_by_counts(cat: Catalog, fqns: Iterable[str] | None = None) -> dict[str, int]:
    """The optimizer that saved the state of each parameter of ``fqns`` that has state (every parameter with state
    where ``None``; :func:`ckpttool.optim_state.known.saved_by`, told from its fields and its param group) ->
    parameters, most first (then by name): ``{"torch.optim.RMSprop": 4}``; ``{}`` where none has state. AdamW's
    state in a group of the trainer's own skip-step optimizer (``SchemaSpec.skip_step_groups``: OLMo-core's groups
    without ``amsgrad``) is named as that optimizer (``olmo_core.optim.SkipStepAdamW``)."""
    groups = cat.group_index() if cat.param_groups else {}
    state = cat.optimizer_state
    by: Counter[str] = Counter()
    seen: dict[tuple[int, tuple[str, ...]], str] = {}  # (the group's id, the fields) -> the answer: groups live here
    for fqn in state if fqns is None else fqns:
        ps = state.get(fqn)
        if ps is None or not ps.fields:
            continue
        g = groups.get(fqn)
        k = (id(g), tuple(ps.fields))
        name = seen.get(k)
        if name is None:
            if len(seen) >= 4096:  # a group per parameter (flattened): no hits to keep
                seen.clear()
            name = seen[k] = _skip_step_named(
                cat, g, saved_by(ps.fields, None if g is None else g.keys, None if g is None else g.values)
            )
        by[name] += 1
    return dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))


def _skip_step_named(cat: Catalog, group: ParamGroup | None, name: str) -> str:
    """``name`` (``saved_by``'s), or the schema's skip-step optimizer (``SchemaSpec.skip_step_saved_by``) where
    ``name`` is torch's AdamW and ``group`` is one of that optimizer's groups (``SchemaSpec.skip_step_groups``)."""
    spec = cat.schema.spec
    if name != "torch.optim.AdamW" or group is None or spec is None or spec.skip_step_saved_by is None:
        return name
    told = spec.skip_step_groups is not None and spec.skip_step_groups((group,))
    return spec.skip_step_saved_by if told else name


def implied_optimizer_type(fields: dict[str, str]) -> str | None:
    """Optimizer type implied by a parameter's state fields and dtypes, or ``None`` if no type fits.

    A lenient wrapper of :func:`ckpttool.optim_state.schema.infer_optimizer_type` (torch-free)
    for overviews: a field set that
    no ckpttool optimizer writes (BF16 ``step``, mixed moment dtypes, ...) gives ``None``
    instead of an error. ``cpu_offload_adamw`` stores the same fields as
    ``full_fp32_adamw``; only the layout record tells them apart.

    Args:
        fields: field name -> dtype name.
    """
    try:
        return infer_optimizer_type(fields)
    except OptimStateError:
        return None


def match_filter(key: str, pattern: str | None, prefix: str | None = CANONICAL_MODEL_PREFIX) -> bool:
    """``fnmatch`` of a key (with or without its model prefix ``prefix``) against a glob."""
    if not pattern:
        return True
    return fnmatch.fnmatchcase(key, pattern) or (
        bool(prefix) and key.startswith(prefix or "") and fnmatch.fnmatchcase(key[len(prefix or "") :], pattern)
    )


def bare_glob_hint(pattern: str | None, count: Callable[[str], int], noun: str = "key") -> str | None:
    """The hint of a ``--filter`` ``pattern`` without a wildcard (``experts``) that selected nothing: a glob matches a
    whole key, so it names ``'*experts*'`` with how many ``noun``s it matches (``count(glob)``, the caller's own
    matching); ``None`` where ``pattern`` holds a wildcard or the wider glob matches nothing either."""
    if not pattern or any(c in pattern for c in "*?["):
        return None
    wide = f"*{pattern}*"
    n = count(wide)
    if n == 0:
        return None
    return (
        f"a glob matches whole keys and {pattern!r} has no wildcard, so it names one whole key; "
        f"{shell_arg(wide)} matches {n} {noun}{'' if n == 1 else 's'}"
    )


def group_by_prefix(keys: list[tuple[str, int, int]], depth: int) -> dict[str, tuple[int, int, int]]:
    """Aggregate ``(key, numel, nbytes)`` by the first ``depth`` dotted components.

    Returns:
        prefix -> (tensor count, numel, nbytes), in first-seen order.
    """
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for key, numel, nbytes in keys:
        prefix = ".".join(key.split(".")[:depth])
        agg = out[prefix]
        agg[0] += 1
        agg[1] += numel
        agg[2] += nbytes
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def _suffixes(head: str, fqns: set[str], lengths: set[int]) -> Iterator[str]:
    """The fqns in ``fqns`` (``lengths``: theirs) that ``head`` is, or ends with after a ``.``
    (``optimizer.layers.0.w`` -> ``layers.0.w``).

    Only the tails as long as some fqn are cut and looked up: a key of 10^5 dots costs its length, not its length
    squared (each tail joined anew)."""
    starts = [0] + [m.end() for m in re.finditer(r"\.", head)]
    for k in starts:
        if len(head) - k in lengths and (cand := head[k:]) in fqns:
            yield cand
