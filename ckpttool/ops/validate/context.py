"""What the rules look at: the opened checkpoint, the options, and the derived facts they share.

A :class:`Context` wraps a :class:`~ckpttool.model.checkpoint.Checkpoint` opened with
``record_problems=True`` (so an invalid layout record or an unreadable byte item is a
recorded fact, not an exception), the ``--config`` / ``--against`` inputs, and after
``--deep`` the values read from the data files (:mod:`ckpttool.ops.validate.deep`). Its
helpers are caches of facts several rules need; rules are pure functions of it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

from ckpttool.errors import CkptError, DataFileError, PathEscapeError
from ckpttool.format.mdstorage import storage_infos
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, StorageInfo, TensorMeta
from ckpttool.layouts.declaration import ResolvedLayout
from ckpttool.model.catalog import Catalog, ParamGroup
from ckpttool.model.checkpoint import Checkpoint
from ckpttool.ops.validate.reference import Reference
from ckpttool.ops.validate.stats import expert_grid

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader
    from ckpttool.ops.validate.stats import DeepResult

__all__ = ["Context", "StorageColumns", "StorageItem"]

#: ``(key, chunk or None for a byte item, storage entry or None when missing)``.
StorageItem = tuple[str, ChunkMeta | None, StorageInfo | None]

# Last key components that name parameters (nn.Linear/Embedding/Norm, fused experts).
_PARAM_NAMES = frozenset(
    {
        "weight",
        "bias",
        "gate_up_proj",
        "down_proj",
        "gate_proj",
        "up_proj",
        "w1",
        "w2",
        "w3",
        "gate_up_proj_bias",
        "down_proj_bias",
    }
)
_INDEX_RE = re.compile(r"\.\d+\.")
_LAYER_RE = re.compile(r"^(.*?\.\d+)\.")


def _layer_of(fqn: str) -> str | None:
    """The key prefix up to the first numeric component (``model.layers.3``), or ``None``."""
    m = _LAYER_RE.match(fqn)
    return m.group(1) if m else None


@dataclass(frozen=True)
class StorageColumns:
    """:meth:`Context.storage_items` as aligned columns, one row per non-empty chunk and byte item.

    Attributes:
        keys: the entry key of each row (a key repeats for each of its chunks), in ``.metadata`` order.
        chunks: the chunk of each row (``None``: a byte item).
        infos: its storage entry (``None``: none in ``.metadata``).
        needs: bytes the chunk's elements take (``numel * itemsize``; ``-1`` for a byte item).
        missing: some row has no storage entry.
        transforms: some row's storage entry names stream transforms.
    """

    keys: list[str]
    chunks: list[ChunkMeta | None]
    infos: list[StorageInfo | None]
    needs: list[int]
    missing: bool
    transforms: bool


def _rows_of(meta: object) -> tuple[tuple[ChunkMeta | None, ...], tuple[tuple[int, ...] | None, ...], tuple[int, ...]]:
    """``(chunks, storage-key offsets, needed bytes)`` of the rows of one entry (see :class:`StorageColumns`)."""
    if isinstance(meta, TensorMeta):
        chunks = tuple(c for c in meta.chunks if 0 not in c.sizes)
        itemsize = meta.dtype.itemsize
        return chunks, tuple(c.offsets for c in chunks), tuple(c.numel * itemsize for c in chunks)
    return (None,), (None,), (-1,)


def _storage_columns(md: CheckpointMetadata, distinct: dict[int, TensorMeta | BytesMeta]) -> StorageColumns:
    """The rows of every entry, built column-wise: the per-entry work is memoised per shared entry object.

    Entries of one layout share one :class:`TensorMeta` (the parser shares equal ones), so a
    10^6-entry checkpoint has a few distinct ones; every row is then C-level ``map``/``zip`` work.
    """
    metas = list(md.entries.values())
    ids = list(map(id, metas))
    rows = {i: _rows_of(m) for i, m in distinct.items()}
    per_entry = list(map(rows.__getitem__, ids))
    if all(len(r[0]) == 1 for r in rows.values()):  # one row per entry
        keys = list(md.entries)
        chunks = list(map(_first, map(_first, per_entry)))
        offsets: Any = map(_first, map(_second, per_entry))
        needs = list(map(_first, map(_third, per_entry)))
    else:
        keys = list(chain.from_iterable(map(repeat, md.entries, map(len, map(_first, per_entry)))))
        chunks = list(chain.from_iterable(map(_first, per_entry)))
        offsets = chain.from_iterable(map(_second, per_entry))
        needs = list(chain.from_iterable(map(_third, per_entry)))
    storage = md.storage
    if len(storage) == len(keys):  # storage_data in the order of the rows (saves of one rank): no lookups
        offsets = list(offsets)
        if list(map(_first, storage)) == keys and list(map(_second, storage)) == offsets:
            infos: list[StorageInfo | None] = list(storage.values())
        else:
            infos = storage_infos(storage, keys, offsets)
    else:
        infos = storage_infos(storage, keys, offsets)
    missing = None in infos
    transforms = any(map(_fourth, filter(None, infos)))
    return StorageColumns(keys, chunks, infos, needs, missing, transforms)


_first, _second, _third, _fourth = (operator.itemgetter(i) for i in range(4))


@dataclass
class Context:
    """Everything the rules read (see module docstring).

    Attributes:
        ckpt: the checkpoint, opened with ``record_problems=True``.
        deep, strict: command options.
        config: HF config dict (``--config``) or ``None``.
        reference: ``--against`` reference or ``None``.
        deep_result: per-tensor statistics of the ``--deep`` pass.
        manifest: the ``--manifest`` (:class:`ckpttool.ops.manifest.Manifest`) or ``None``.
    """

    ckpt: Checkpoint
    deep: bool = False
    strict: bool = False
    config: dict[str, Any] | None = None
    reference: Reference | None = None
    deep_result: DeepResult | None = None
    manifest: Any = None
    _file_errors: dict[str, CkptError | None] = field(default_factory=dict)
    _params: dict[str, bool] | None = None
    _storage_items: list[StorageItem] | None = None
    _storage_columns: StorageColumns | None = None
    _distinct_metas: dict[int, TensorMeta | BytesMeta] | None = None
    _data_files: list[str] | None = None
    _optimized: set[str] = field(default_factory=set)
    _patterns: set[str] = field(default_factory=set)
    _layers: set[str | None] = field(default_factory=set)
    _modules: dict[str, set[str]] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set)
    _own_config: tuple[dict[str, Any] | None] | None = None
    _own_config_error: CkptError | None = None
    _expert_state: dict[str, str | None] | None = None
    _stacked: frozenset[str] | None = None
    _once: dict[str, Any] = field(default_factory=dict)

    def once(self, name: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per validation under ``name`` (what several rules derive alike)."""
        if name not in self._once:
            self._once[name] = make()
        return self._once[name]

    # ------------------------------------------------------------------ shortcuts
    @property
    def cat(self) -> Catalog:
        return self.ckpt.catalog

    @property
    def reader(self) -> CheckpointReader:
        return self.ckpt.reader

    @property
    def layout(self) -> ResolvedLayout | None:
        return self.ckpt.layout

    @property
    def quant_config(self) -> dict[str, Any] | None:
        """The config that gives quantized weights their block size: ``--config``, else the ``config.json`` in
        the checkpoint's own folder (an FP8 Hugging Face folder's ``quantization_config``), else ``None``
        (128); an unreadable own ``config.json`` counts as none (the block rules' hint asks for ``--config``).
        A ``--config`` without a ``quantization_config`` (the base model's, given for coverage) says nothing of
        the quantization: the own folder's ``quantization_config`` is taken beside it."""
        if self.config is not None and "quantization_config" in self.config:
            return self.config
        if self._own_config is None:  # read once: the rules ask for it per scale tensor
            own, error = self.own_hf_config
            if error is not None and self.config is None:  # a --config given: the own config.json is not needed
                self._own_config_error = error
            if self.config is not None:
                qc = own.get("quantization_config") if isinstance(own, dict) else None
                own = self.config if qc is None else {**self.config, "quantization_config": qc}
            self._own_config = (own,)
        return self._own_config[0]

    @property
    def own_hf_config(self) -> tuple[dict[str, Any] | None, CkptError | None]:
        """The checkpoint's own ``config.json`` (:meth:`~ckpttool.model.checkpoint.Checkpoint.own_hf_config`, read
        once) and why it could not be read: ``(config or None, None)`` or ``(None, error)``."""

        def read() -> tuple[dict[str, Any] | None, CkptError | None]:
            try:
                return self.ckpt.own_hf_config(), None
            except CkptError as e:
                return None, e

        got: tuple[dict[str, Any] | None, CkptError | None] = self.once("own_hf_config", read)
        return got

    @property
    def own_config_error(self) -> CkptError | None:
        """Why the checkpoint's own ``config.json`` could not be read (``None``: read, absent, or ``--config`` given)."""
        _ = self.quant_config
        return self._own_config_error

    @property
    def layout_error(self) -> CkptError | None:
        return self.ckpt.layout_error

    @property
    def byte_item_errors(self) -> dict[str, CkptError]:
        return self.ckpt.byte_item_errors

    # ------------------------------------------------------------------ storage helpers
    def file_error(self, relative_path: str) -> CkptError | None:
        """Why a referenced data file cannot be used (escaping path, missing), or ``None``."""
        if relative_path not in self._file_errors:
            err: CkptError | None = None
            try:
                self.reader.file_size(relative_path)
            except (PathEscapeError, DataFileError) as e:
                err = e
            self._file_errors[relative_path] = err
        return self._file_errors[relative_path]

    def data_files(self) -> list[str]:
        """Relative paths referenced by ``storage_data`` (sorted, unique; cached)."""
        if self._data_files is None:
            self._data_files = self.reader.data_files()
        return self._data_files

    def storage_ok(self, fqn: str, chunk: ChunkMeta | None = None) -> bool:
        """The chunk/byte item has a storage entry inside an existing file, within its bounds."""
        try:
            self.reader.storage_info(fqn, chunk)
        except CkptError:
            return False
        return True

    def storage_items(self) -> list[StorageItem]:
        """Every non-empty chunk and byte item with its storage entry, in ``.metadata`` order (cached)."""
        if self._storage_items is None:
            cols = self.storage_columns()
            self._storage_items = list(zip(cols.keys, cols.chunks, cols.infos))
        return self._storage_items

    def distinct_metas(self) -> dict[int, TensorMeta | BytesMeta]:
        """The distinct entry objects of ``.metadata`` by ``id`` (cached; entries of one layout share one
        :class:`TensorMeta`, so a 10^6-entry checkpoint may have a handful). The metadata holds them: the ids
        stay unique while the checkpoint is open."""
        if self._distinct_metas is None:
            metas = self.reader.metadata.entries.values()
            self._distinct_metas = dict(zip(map(id, metas), metas))
        return self._distinct_metas

    def storage_columns(self) -> StorageColumns:
        """:meth:`storage_items` as columns (cached), for checks over every row at C speed."""
        if self._storage_columns is None:
            self._storage_columns = _storage_columns(self.reader.metadata, self.distinct_metas())
        return self._storage_columns

    # ------------------------------------------------------------------ optimizer helpers
    def expert_state_keys(self) -> dict[str, str | None]:
        """Keys of the ``master_weight``/``exp_avg``/``exp_avg_sq`` of fused expert parameters (``[E, ...]``) -> the
        parameter's model key (``None`` when the checkpoint has no model entry for it): their expert slices are
        digested and compared like the parameter's (``D009``)."""
        if self._expert_state is None:
            out: dict[str, str | None] = {}
            for fqn, ps in self.cat.optimizer_state.items():
                for name in ("master_weight", "exp_avg", "exp_avg_sq"):
                    t = ps.fields.get(name)
                    if t is not None and self.expert_grid(t.key, tuple(t.shape))[1]:
                        param = self.cat.model_entry(fqn)
                        out[t.key] = param.key if param is not None else None
            self._expert_state = out
        return self._expert_state

    def state_tensor_keys(self) -> frozenset[str]:
        """Keys of every parameter's ``master_weight``/``exp_avg``/``exp_avg_sq``: the deep pass digests their chunks
        as a model tensor's (``D017``; of fused expert parameters also each expert's slice, ``D009``)."""

        def make() -> frozenset[str]:
            return frozenset(
                t.key
                for ps in self.cat.optimizer_state.values()
                for name in ("master_weight", "exp_avg", "exp_avg_sq")
                if (t := ps.fields.get(name)) is not None
            )

        keys: frozenset[str] = self.once("state_tensor_keys", make)
        return keys

    def stacked_keys(self) -> frozenset[str]:
        """Model keys, and their optimizer-state keys, of parameters the key schema stores with every layer stacked
        on dim 0 (:attr:`~ckpttool.model.schemas.base.SchemaSpec.stacked_layers`: Megatron-core's
        ``decoder.layers.<module> [L, ...]``; a ``decoder.layers.<N>.`` fqn is one layer's)."""
        if self._stacked is None:
            from ckpttool.model.schemas import registry

            spec = registry.find(self.cat.schema.id)

            def stacked(fqn: str) -> bool:
                return spec is not None and spec.stacked_prefix(fqn) is not None

            out: set[str] = set()
            if spec is not None and spec.stacked_layers:
                out.update(k for k in self.cat.model if stacked(self.cat.fqn_of(k)))
                for fqn, ps in self.cat.optimizer_state.items():
                    if stacked(fqn):
                        out.update(t.key for t in ps.fields.values() if t is not None)
            self._stacked = frozenset(out)
        return self._stacked

    def expert_grid(self, key: str, size: tuple[int, ...]) -> tuple[int, int]:
        """``(layers, experts per layer)`` of tensor ``key`` (:func:`~ckpttool.ops.validate.stats.expert_grid`; its
        layers stacked on dim 0 where :meth:`stacked_keys` holds it)."""
        return expert_grid(key, size, key in self.stacked_keys())

    @property
    def has_optimizer(self) -> bool:
        return bool(self.cat.optimizer_state or self.cat.param_groups)

    def group_of(self, fqn: str) -> ParamGroup | None:
        """Param group holding ``fqn`` (:meth:`~ckpttool.model.catalog.Catalog.group_of`)."""
        return self.cat.group_of(fqn)

    def lost_hyperparameters(self, fqn: str) -> bool:
        """Is there evidence that ``fqn`` is an optimized parameter although it has no state and no group?

        A model tensor outside every param group is normally frozen or a buffer. It counts as
        an optimized parameter that lost its hyperparameters when either

        - the tensor of the same name in another layer/expert is optimized *and* some tensor
          of its own layer is optimized (so the layer is not frozen), or
        - its name is a parameter name (``weight``, ``bias``, fused expert weights) and another
          tensor of the same module is optimized; not when that is only its ``bias`` and no tensor of
          its name is optimized anywhere (bias-only training, BitFit, leaves every ``weight`` frozen).

        Frozen layers/modules, LoRA base weights and buffers (``inv_freq``,
        ``e_score_correction_bias``, 0-d scales) give no such evidence.
        """
        if self._params is None:
            grouped = {p for g in self.cat.param_groups for p in g.params}
            optimized = {
                f
                for f in self.cat.param_fqns
                if f in grouped or (f in self.cat.optimizer_state and self.cat.optimizer_state[f].fields)
            }
            self._optimized = optimized
            self._patterns = {_INDEX_RE.sub(".#.", f) for f in optimized}
            self._layers = {_layer_of(f) for f in optimized} - {None}
            self._modules = {}
            for f in optimized:
                module, _, name = f.rpartition(".")
                self._modules.setdefault(module, set()).add(name)
            self._names = {f.rpartition(".")[2] for f in optimized}
            self._params = {}
        if fqn in self._optimized:
            return False
        hit = self._params.get(fqn)
        if hit is None:
            layer = _layer_of(fqn)
            by_pattern = _INDEX_RE.sub(".#.", fqn) in self._patterns and layer is not None and layer in self._layers
            module, _, name = fqn.rpartition(".")
            by_module = name in _PARAM_NAMES and module in self._modules
            if by_module and name not in self._names and self._modules[module] == {"bias"}:
                by_module = False  # only biases trained, this name nowhere (every weight frozen: BitFit): frozen
            hit = self._params[fqn] = by_pattern or by_module
        return bool(hit)

    def group_sets(self) -> list[tuple[str, list[str]]]:
        """Parameters that share one optimizer leaf, as ``(label, fqns)`` (:meth:`Catalog.leaves`)."""
        return [(label, fqns) for label, _, fqns in self.cat.leaves()]
