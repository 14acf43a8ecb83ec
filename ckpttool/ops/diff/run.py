"""``diff A B``: do two checkpoints hold the same model (and optimizer), whatever their sharding or format?

A side is a DCP checkpoint, an HF safetensors directory or file, or a PEFT LoRA adapter.
Names are matched in one namespace: torch-native keys between two DCP checkpoints; the export
mapping (:mod:`ckpttool.ops.export.plan`) for a DCP side against safetensors; stored names
between two safetensors sides, fused experts cut per expert where the other side holds them so
(:mod:`ckpttool.ops.diff.experts`). A :class:`Namer` maps an opened DCP side to its :class:`Item`
s. Values are compared tensor by tensor in canonical global order, at most one global tensor
per side (:mod:`ckpttool.ops.diff.compare`); equal chunking, dtype and raw records are compared
byte for byte without decoding. ``docs/diff.md``.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpttool.engine.execute import can_split, run_item, run_split
from ckpttool.engine.io import ShortReadError
from ckpttool.engine.plan import CompareStream, Crc32, PairedSlabs, Window
from ckpttool.engine.plan import Item as PlanItem
from ckpttool.engine.pool import overlap
from ckpttool.errors import (
    AmbiguousLayoutError,
    CkptError,
    DataFileError,
    DiffError,
    LayoutError,
    NothingComparedError,
    UsageError,
    shell_arg,
    short_key,
)
from ckpttool.format.locator import ChunkLocation
from ckpttool.format.metadata import ChunkMeta, TensorMeta
from ckpttool.format.perrank import PerRankReader
from ckpttool.format.perrank_formats import detect_layout
from ckpttool.format.storage import UrlPath, is_url, local_path, url_path
from ckpttool.layouts.permute import legacy_to_canonical_perm
from ckpttool.layouts.record import LAYOUT_KEY
from ckpttool.model.catalog import Catalog, TensorEntry, bare_glob_hint, match_filter, saved_by_counts
from ckpttool.model.checkpoint import (
    Checkpoint,
    CheckpointOrPath,
    OpenOptions,
    check_source,
    open_checkpoint,
    open_source,
)
from ckpttool.model.discovery import CheckpointSelection
from ckpttool.model.schemas.base import canonical_group_key, canonical_state_key
from ckpttool.model.wrappers import strip_wrapper_segments, wrapper_segments_of
from ckpttool.ops.diff.compare import (
    BLOCK_ELEMENTS,
    Metrics,
    Tolerance,
    ValueCompare,
    ValueDiff,
    compare_tensors,
    same_bytes,
    unravel,
)
from ckpttool.ops.diff.gather import gathered_values, short_tensor
from ckpttool.ops.diff.result import (
    BESIDE_NOTE,
    MODEL_ONLY_NOTE,
    REMOTE_BESIDE_NOTE,
    SELF_NOTE,
    SIDE_B_DECLARED,
    TRAINING_STATE_NOTE,
    UNPROVEN_NOTE,
    WHAT,
    Difference,
    DiffOptions,
    DiffResult,
    Excluded,
    Item,
    SideInfo,
    TensorStat,
)
from ckpttool.ops.diff.sides import side_openings
from ckpttool.ops.export.transform import Run
from ckpttool.ops.fields import PhaseFn, ProgressFn, options_of
from ckpttool.ops.manifest import folder_kind

__all__ = ["Namer", "Side", "diff_checkpoints"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- sides
class Side:
    """One opened input: its checkpoint handle, its kind and a one-tensor cache.

    Attributes:
        label: ``"A"`` or ``"B"``; kind: ``dcp``, ``safetensors`` or ``lora``.
        only_file: a single ``.safetensors`` file given: only its tensors belong to the side.
    """

    def __init__(
        self,
        label: str,
        path: Path | UrlPath,
        ckpt: Checkpoint,
        kind: str,
        only_file: str | None,
        *,
        owned: bool = True,
    ) -> None:
        self.label = label
        self.owned = owned  # opened here (closed by close()), not the caller's opened Checkpoint
        self.read_before = ckpt.reader.bytes_read  # what an opened Checkpoint had read before this diff
        self.path = path
        self.ckpt = ckpt
        self.kind = kind
        self.only_file = only_file
        self._cached: tuple[str, Any] | None = None
        self._located: tuple[str, dict[ChunkMeta, ChunkLocation]] = ("", {})  # the last key's chunk locations
        self._buf: Any = None  # one reusable byte buffer: no page faults on every tensor
        self._held: tuple[str, ...] = ()  # a remote side: the keys whose windows the spool holds
        self.adapter: str | None = None  # the model adapter that named this side (export naming)
        self.quant_atol = 0.0  # the default atol of the last dequantized weight (ops/diff/quantized.py)
        self.quant_atol_at: Any = None  # its per-element atol where it is block FP8 (ops/diff/quantized.py)

    @property
    def reader(self) -> Any:
        return self.ckpt.reader

    def info(self) -> SideInfo:
        lay = self.ckpt.layout
        where = getattr(self.ckpt, "located", None)
        opened = None if where is None or where.model == where.given else str(where.model)
        return SideInfo(
            str(self.path),
            self.kind,
            self.ckpt.catalog.schema.id,
            lay.layout_name if lay is not None and lay.ep_tensors else None,
            len(self.tensor_keys()),
            opened,
            folder_kind(self.ckpt.reader) if self.kind == "dcp" else self.kind,
        )

    def tensor_keys(self) -> list[str]:
        md = self.ckpt.metadata
        keys = [k for k, m in md.entries.items() if isinstance(m, TensorMeta)]
        if self.only_file is None:
            return keys
        tensors = self.ckpt.catalog.tensors
        return [k for k in keys if k in tensors and self.only_file in tensors[k].files]

    def locate(self, key: str, chunk: ChunkMeta) -> ChunkLocation:
        """The checked location of one stored chunk of ``key`` (:meth:`CheckpointReader.locate
        <ckpttool.format.reader.CheckpointReader.locate>`), kept while ``key`` is the last tensor located: a pair
        whose records differ is located once for its byte compare and once more for its value compare otherwise.

        Raises:
            the reader's errors for a chunk it cannot locate (:func:`~ckpttool.format.locator.locate_chunk`).
        """
        if self._located[0] != key:
            self._located = (key, {})
        held = self._located[1]
        loc = held.get(chunk)
        if loc is None:
            loc = held[chunk] = self.reader.locate(key, chunk)
        return loc

    def tensor(self, key: str) -> Any:
        """The global tensor ``key`` as stored (kept until another key is asked for)."""
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        self._cached = None
        import torch

        meta = self.ckpt.metadata.entries[key]
        assert isinstance(meta, TensorMeta)
        self.reader.check_allocation(key, meta)
        if self._buf is None or self._buf.numel() < meta.nbytes:
            self._buf = None
            self._buf = torch.empty(meta.nbytes, dtype=torch.uint8)
        out = self._buf[: meta.nbytes].view(meta.dtype.to_torch()).view(meta.size)
        t = self.reader.read_tensor(key, out=out)
        self._cached = (key, t)
        return t

    def load(self, item: Item) -> Any:
        """The value of ``item`` in canonical order (a view where possible)."""
        import torch

        if item.dequant is not None:
            from ckpttool.ops.diff.quantized import load_dequantized

            return load_dequantized(self, item)
        if item.runs is not None:
            return self._assemble(item)
        t = self.tensor(item.key)
        if item.perm is not None:
            t = t.index_select(0, torch.tensor(item.perm, dtype=torch.long))
            self._cached = (item.key + "\0perm", t)
        if item.piece is not None:
            j, p, n = item.piece
            rows = t.shape[1] // n
            t = t[j, p * rows : (p + 1) * rows]
        return t

    def _assemble(self, item: Item) -> Any:
        """A model adapter's value: every source's runs placed into a new tensor (as export writes it)."""
        import torch

        from ckpttool.engine.kernels import place_runs

        assert item.runs is not None
        out = torch.empty(math.prod(item.shape), dtype=_torch_dtype(item.dtype))
        for e, runs in item.runs:
            flat = self.tensor(e.key).reshape(-1)
            if flat.dtype != out.dtype:  # values cast as a tensor assignment casts them
                flat = flat.to(out.dtype)
            place_runs(_bits(flat), _bits(out), [(r.src, r.length, r.dst) for r in runs])
        return out.view(item.shape)

    def drop_cache(self) -> None:
        self._cached = None
        self._located = ("", {})

    def hold(self, item: Item) -> None:
        """A remote side: evict the chunk windows of the item compared before and fetch those of ``item``
        (``--remote-workers`` range requests at once), so the spool holds one item's tensors, not every one
        compared (docs/storage.md); byte items stay (small, capped). A local side: nothing."""
        reader = self.reader
        if getattr(reader, "spool", None) is None:
            return
        keys = tuple(dict.fromkeys([item.key, *(e.key for e, _ in item.runs or ())]))
        if keys == self._held:
            return
        tensors = reader.metadata.entries
        self._located = ("", {})  # located in windows about to be evicted: located again once fetched
        for k in self._held:
            meta = tensors.get(k)
            if isinstance(meta, TensorMeta):
                reader.evict(reader.storage_info(k, c) for c in meta.chunks if c.numel)
        self._held = keys
        reader.prefetch_keys(k for k in keys if isinstance(tensors.get(k), TensorMeta))

    def close(self) -> None:
        self._cached = self._buf = None
        if self.owned:
            self.ckpt.close()


def _bits(t: Any) -> Any:
    """A contiguous 1-d tensor's elements as a numpy array of integers (or raw records) of the same width (no copy)."""
    import torch

    size = t.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if size in ints:
        return t.view(ints[size]).numpy()
    return t.view(torch.uint8).numpy().view(f"V{size}")


def _hf_side(where: Path, only_file: str | None) -> bool:
    """A safetensors side (a file, or a directory of them without ``.metadata``), named as Hugging Face
    names it; a per-rank save whose rank files are safetensors (torch-checkpointing's
    ``model_{rank}.safetensors``) has torch-native keys, so it is not one."""
    return only_file is not None or (
        where.is_dir()
        and not (where / ".metadata").exists()
        and any(where.glob("*.safetensors"))
        and detect_layout(where) is None
    )


def _same_path(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one path: resolved, or where either is a symlink loop (which ``resolve`` raises
    on) as absolute paths."""
    try:
        return a.resolve() == b.resolve()
    except (RuntimeError, OSError):
        return a.absolute() == b.absolute()


def _open_side(
    label: str,
    path: CheckpointOrPath,
    opening: OpenOptions,
) -> Side:
    if isinstance(path, Checkpoint):  # the caller's, opened already: used as it is and left open
        with open_source(path, opening) as ckpt:
            return Side(label, Path(ckpt.path), ckpt, _side_kind(ckpt), None, owned=False)
    if is_url(path):  # a DCP checkpoint's prefix, read as every command reads one (Path() would fold it to 's3:/b/k')
        try:
            ckpt = open_checkpoint(
                path, declaration=opening.declaration, trust_pickle=opening.trust_pickle, selection=opening.selection
            )
        except LayoutError as e:
            raise _of_side(label, url_path(path), e) from None
        return Side(label, url_path(path), ckpt, _side_kind(ckpt), None)
    p = Path(local_path(path))
    only_file = None
    where = p
    if p.is_file():
        if p.suffix != ".safetensors":
            from ckpttool.model.discovery import is_checkpoint_dir, unfinished_save_hint

            inside = is_checkpoint_dir(p.parent)  # .metadata, a data file, config.json of a checkpoint
            raise DiffError(
                f"{p}: a file that is not a .safetensors file",
                path=p,
                hint=f"pass the checkpoint directory, not a file in it: {shell_arg(p.parent)}"
                if inside
                else unfinished_save_hint(p)  # a data file of a save that did not finish
                or "pass a DCP checkpoint directory, a safetensors directory or file, or a PEFT adapter directory",
            )
        where, only_file = p.parent, p.name
    chosen = opening.selection
    if chosen is not None and chosen.schema is not None and _hf_side(where, only_file):
        chosen = replace(chosen, schema=None)  # HF names: a key-schema override is the DCP sides'
    try:
        if only_file is not None and not (where / ".metadata").exists() and detect_layout(where) is None:
            ckpt = _open_one_file(where, only_file, opening, chosen)
        else:
            ckpt = open_checkpoint(
                where, declaration=opening.declaration, trust_pickle=opening.trust_pickle, selection=chosen
            )
    except LayoutError as e:  # a record or declaration of this side (E403/E404/E406): said of the side
        raise _of_side(label, p, e) from None
    except CkptError as e:
        has_weights = where.is_dir() and any(where.glob("*.safetensors"))
        about_where = e.path is None or _same_path(Path(e.path), where)  # not a damaged file below it
        if (
            e.code == "E200"
            and about_where
            and not (where / ".metadata").exists()
            and where.is_dir()
            and not has_weights
        ):
            raise DiffError(
                f"{where}: neither a DCP checkpoint (.metadata) nor a safetensors directory",
                path=where,
                hint="pass a DCP checkpoint directory, a safetensors directory or file, or a PEFT adapter directory",
            ) from e
        raise
    return Side(label, p, ckpt, _side_kind(ckpt), only_file)


def _open_one_file(where: Path, name: str, opening: OpenOptions, chosen: CheckpointSelection | None) -> Checkpoint:
    """The single safetensors file ``where/name`` as a checkpoint of its own: the other ``.safetensors`` files of
    its folder (another save, a copy under another name) and the folder's index are not read, so they neither
    mix into the side nor make it fail."""
    from ckpttool.format.hf_storage import load_hf_storage_metadata
    from ckpttool.format.reader import CheckpointReader

    reader = CheckpointReader(
        where, trust_pickle=opening.trust_pickle, metadata=load_hf_storage_metadata(where, [name])
    )
    try:
        return Checkpoint(reader, declaration=opening.declaration, selection=chosen)
    except BaseException:
        reader.close()
        raise


def _side_kind(ckpt: Checkpoint) -> str:
    """``dcp``, ``lora`` (a PEFT adapter directory) or ``safetensors``: how an opened side is named."""
    model_dir = Path(ckpt.located.model)
    if ckpt.metadata.serialization != "safetensors" or isinstance(ckpt.reader, PerRankReader):
        return "dcp"  # a per-rank save (raw shard windows) has torch-native keys and optimizer state as a DCP
    if (model_dir / "adapter_config.json").is_file() or (model_dir / "adapter_model.safetensors").is_file():
        return "lora"
    return "safetensors"


# ---------------------------------------------------------------------------------------------- naming
#: A namer: (side, the other side's tensor names, options, format) -> (items, excluded, notes, naming id).
#: :func:`export_items` is the one for HF/LoRA names; a model adapter (torchtitan <-> HF) is another.
Namer = Callable[["Side", set[str], DiffOptions, str], tuple[list[Item], list[Excluded], list[str], str]]


def _entry_item(name: str, e: TensorEntry, category: str, perm: list[int] | None = None) -> Item:
    return Item(name, e.key, e.shape, e.dtype, category, tuple(perm) if perm is not None else None, None, e)


def _perm_of(side: Side, key: str, shape: tuple[int, ...]) -> list[int] | None:
    """Row gather into true expert order for a legacy-layout EP tensor (model or state key)."""
    lay = side.ckpt.require_layout()
    spec = lay.spec_for(key)
    if spec is None or len(shape) <= spec.ep_dim:  # not an EP tensor, or its 0-d step
        return None
    try:
        if lay.canonical_perm(key) is None:
            return None
    except AmbiguousLayoutError as e:  # said of the side, with the options that declare that side's layout
        raise _of_side(side.label, side.path, e) from None
    if spec.ep_dim != 0:
        raise DiffError(
            f"{key}: legacy EP layout on expert dim {spec.ep_dim}; diff un-permutes dim 0 only",
            fqn=key,
            hint="convert the checkpoint with `ckpttool reshard` to the canonical layout first",
        )
    assert lay.ep_size is not None and lay.ep_fsdp_size is not None
    return legacy_to_canonical_perm(shape[0], lay.ep_size, lay.ep_fsdp_size)


def _of_side(label: str, path: Path | UrlPath, e: LayoutError) -> LayoutError:
    """``e`` naming its side and path; for B the hint says that B's declaration is ``opening_b``'s, and ``param`` is
    ``opening_b``: the declaration parameters it names (``source_layout``, ...) otherwise read as A's, which declare
    the other checkpoint (the CLI names B's options instead: :data:`SIDE_B_DECLARED`)."""
    said = f"{label}: " if e.message.startswith(str(path)) else f"{label} ({path}): "
    if label != "B":
        return type(e)(said + e.message, hint=e.hint, path=e.path, fqn=e.fqn)
    return type(e)(said + e.message, hint=SIDE_B_DECLARED + e.hint, path=e.path, fqn=e.fqn, param="opening_b")


def dcp_items(side: Side, what: str) -> tuple[list[Item], list[Excluded], list[str]]:
    """A DCP side in the torch-native namespace: ``model.<fqn>``, ``optimizer.state.<fqn>.<field>``, other keys."""
    cat = side.ckpt.catalog
    items: list[Item] = []
    excluded: list[Excluded] = []
    if what in ("model", "all"):
        for key, me in cat.model.items():
            items.append(_entry_item(cat.schema.canonical_key(key), me, "model", _perm_of(side, key, me.shape)))
        for key in _model_byte_items(cat):  # a module's extra state (get_extra_state): part of the model's state
            items.append(Item(cat.schema.canonical_key(key), key, (), "bytes", "model"))
    if what in ("optimizer", "all"):
        for fqn, ps in cat.optimizer_state.items():
            for fld, e in ps.fields.items():
                name = canonical_state_key(fqn, fld)
                if e is None:
                    key = cat.state_key(fqn, fld)
                    if key not in cat.byte_items:  # Megatron: one common_step per optimizer, in common.pt
                        excluded.append(Excluded(side.label, key, "a shared step saved outside .metadata (common.pt)"))
                        continue
                    items.append(Item(name, key, (), "bytes", "optimizer_state"))
                    continue
                items.append(_entry_item(name, e, "optimizer_state", _perm_of(side, e.key, e.shape)))
    if what == "all":
        listed = {i.key for i in items}
        for key, e in cat.other_tensors.items():
            if e.key in listed:
                continue
            items.append(_entry_item(key, e, cat.category(key)))
        group_keys = {k for g in cat.param_groups for k in g.keys.values()}
        for key in cat.byte_items:
            if key in group_keys:
                continue
            if key == LAYOUT_KEY and not (side.ckpt.layout is not None and side.ckpt.layout.foreign_item):
                excluded.append(Excluded(side.label, key, "the layout record describes the storage order, not values"))
                continue
            if cat.category(key) == "optimizer_state" or key in listed:
                continue  # a state field saved as a byte item, a model's byte item: listed above
            items.append(Item(key, key, (), "bytes", cat.category(key)))
    items, notes = _unwrapped(side, items)
    return items, excluded, notes


def _model_byte_items(cat: Catalog) -> list[str]:
    """Byte items saved under the model's own prefix (``model.<fqn>._extra_state``: what a module's
    ``get_extra_state()`` returns, FP8 scaling metadata; any object a model's ``state_dict()`` holds), which
    ``load_state_dict`` hands back to the model: compared with its tensors. None under a top-level model (its
    prefix ``""`` does not tell a model's byte item from the trainer's ``epoch``) or the layout record."""
    p = cat.schema.model_prefix
    if not p:
        return []
    return [k for k in cat.byte_items if k.startswith(p) and k != LAYOUT_KEY and cat.category(k) == "other"]


def _unwrapped(side: Side, items: list[Item]) -> tuple[list[Item], list[str]]:
    """``items`` with the wrapper segments (``module.``, ``_orig_mod.``, ...: :mod:`ckpttool.model.wrappers`) removed
    from the names of model tensors and their state, as ``export`` names them: a DDP model's ``state_dict()`` saved
    whole compares with the plain model's. Unchanged where two names would become one."""
    renamed: list[Item] = []
    removed: set[str] = set()
    cat = side.ckpt.catalog
    wrappers = wrapper_segments_of(cat.optimizer_state, cat.param_fqns)  # a "module" the names keep is real
    for it in items:
        if it.category in ("model", "optimizer_state"):
            name, segs = strip_wrapper_segments(it.name, wrappers)
            if segs:
                removed.update(segs)
                it = replace(it, name=name)
        renamed.append(it)
    if not removed or len({i.name for i in renamed}) != len(items):
        return items, []
    n = sum(a.name != b.name for a, b in zip(items, renamed))
    return renamed, [
        f"{side.label}: wrapper segment(s) {', '.join(sorted(removed))} removed from {n} name(s), as export names "
        "them (a compiled, DDP or activation-checkpointed model's state_dict)"
    ]


def side_adapter(side: Side, opts: DiffOptions, fmt: str, config: dict[str, Any] | None) -> Any:
    """The model adapter naming a DCP side against HF names: ``opts.adapter``, else detected as ``export`` does.

    Returns a :class:`~ckpttool.model.adapters.ModelAdapter`, or ``None`` (the key rules name the side).

    Raises:
        UsageError: an unknown ``adapter``, or one given against a LoRA adapter.
    """
    from ckpttool.model.adapters import detect_adapter, get_adapter

    cat = side.ckpt.catalog
    if opts.adapter is not None:
        ad = get_adapter(opts.adapter)
        if fmt == "lora" and ad.name != "hf":
            raise UsageError(f"`adapter` {ad.name} applies against HF safetensors, not a LoRA adapter", param="adapter")
        return ad
    if fmt != "hf":
        return None
    return detect_adapter(cat.schema.naming, [cat.fqn_of(k) for k in cat.model], config)


#: Where diff reads the model's config.json (:func:`_hf_config`), in place of export's ``model_assets`` in its hints.
_CONFIG_HERE = "put the model's config.json in the safetensors folder"


def export_items(
    side: Side,
    other: set[str],
    opts: DiffOptions,
    fmt: str,
    tied: bool = False,
    config: dict[str, Any] | None = None,
) -> tuple[list[Item], list[Excluded], list[str], str]:
    """A DCP side named by the export mapping (HF or LoRA keys), experts fused or per-expert as ``other`` holds them.

    A model adapter (``opts.adapter`` or detected; ``config``: the HF ``config.json`` giving its
    RoPE head counts) names torchtitan keys; its tensors are then compared in HF order through
    the export plan's element runs (:attr:`Item.runs`), so the values are the ones export writes.
    """
    from ckpttool.model.adapters import CONFIG_HINT, AdapterConfig
    from ckpttool.ops.export.plan import select_sources
    from ckpttool.ops.export.rules import load_rules
    from ckpttool.ops.export.select import CONFIG_TO_CHECK

    cat = side.ckpt.catalog
    _refuse_peft_against_model(side, fmt)
    mt = config.get("model_type") if config is not None else None
    rules = load_rules(
        Path(opts.map_rules) if opts.map_rules is not None else None, mt if isinstance(mt, str) else None
    )
    adapter = side_adapter(side, opts, fmt, config)
    try:
        selected, warnings, skipped, _ = select_sources(
            cat,
            rules,
            fmt=fmt,
            weights=opts.weights,
            adapter=adapter,
            adapter_config=AdapterConfig.from_hf_config(config),
            model_config=config,
        )
    except CkptError as e:  # an adapter missing a dimension of config.json: diff has no `model_assets` to pass it
        e.hint = e.hint.replace(CONFIG_HINT, _CONFIG_HERE)
        raise
    side.adapter = adapter.name if adapter is not None and any(s.hf is not None for s in selected) else None
    fused, split_tasks = _export_plans(side, selected, rules, fmt)
    items, n_split = _task_items(fused.tasks, split_tasks, other)
    # export's warnings; diff's config.json is the one in the safetensors folder, not export's `model_assets`
    notes = [w.replace(CONFIG_TO_CHECK, _CONFIG_HERE) for w in warnings]
    if n_split:
        notes.append(f"{n_split} fused expert tensor(s) of {side.label} compared per expert with {_other(side)}")
    excluded = [Excluded(side.label, k, reason) for reason, keys in skipped.items() for k in keys]
    # tied head: an lm_head the other side leaves out (tie_word_embeddings) is compared with its embedding
    names = {i.name for i in items}
    embedding = rules.tied_embedding_in(other)
    if (
        tied
        and fmt == "hf"
        and rules.tied_lm_head in names
        and rules.tied_lm_head not in other
        and embedding is not None
    ):
        head = next(i for i in items if i.name == rules.tied_lm_head)
        items[items.index(head)] = replace(head, against=embedding)
        notes.append(
            f"{_other(side)} has no {rules.tied_lm_head} (tied embeddings): {side.label}'s {head.key} is compared "
            f"with {_other(side)}'s {embedding}"
        )
        if opts.weights == "master":
            notes.extend(_tied_master(side, selected, rules, items))
    return items, excluded, notes, "lora" if fmt == "lora" else "export"


def _refuse_peft_against_model(side: Side, fmt: str) -> None:
    """A PEFT LoRA DCP checkpoint against a safetensors model (not a PEFT adapter): its keys
    (``...q_proj.base_layer.weight``, ``...lora_A.default.weight``) name no tensor of a Hugging Face model, and a merged
    export (``hf-merged``) holds ``W + scale * B @ A``, which no stored tensor is.

    Raises:
        DiffError: naming the side, a LoRA key and the pairs diff does compare (E610; was export's E601, whose hint
            named export's `fmt`, an option diff does not have).
    """
    if fmt != "hf":
        return
    peft = next((k for k in side.ckpt.catalog.model if ".lora_A." in k or ".lora_B." in k), None)
    if peft is None:
        return
    raise DiffError(
        f"{side.label} ({side.path}): a PEFT LoRA checkpoint ({peft!r:.120}) against {_other(side)}, a safetensors model: "
        "its LoRA factors and base_layer weights are no tensor of a Hugging Face model (a merged export holds "
        "W + scale * B @ A)",
        path=side.path if not isinstance(side.path, UrlPath) else None,
        hint=f"compare it with its adapter: `ckpttool export {shell_arg(str(side.path))} ADAPTER --format lora`, then "
        f"`ckpttool diff {shell_arg(str(side.path))} ADAPTER`; a merged export against another merged export",
    )


def _tied_master(side: Side, selected: Any, rules: Any, items: list[Item]) -> list[str]:
    """``weights`` master of a tied pair: one FP32 master, kept under one of its two fqns, which ``export`` writes as
    the embedding (``_tied`` there). The one of the two without a master of its own is compared from that master
    (``items`` edited in place) when the two stored parameters are bitwise equal, i.e. one tied parameter; else it
    stays the stored parameter (and a difference shows). Returns the note saying so (or none)."""
    by_out = {s.out_key: s for s in selected}
    embedding = rules.tied_embedding_in(by_out)
    emb = by_out.get(embedding) if embedding is not None else None
    head = by_out.get(rules.tied_lm_head)
    if emb is None or head is None or emb.origin == head.origin:
        return []
    master, plain = (emb, head) if emb.origin == "master" else (head, emb)
    at = next((i for i, it in enumerate(items) if it.name == plain.out_key), None)
    if at is None or not items[at].direct:
        return []
    cat = side.ckpt.catalog
    pm, pp = cat.model[master.model_key], cat.model[plain.model_key]
    if (pm.dtype, pm.shape) != (pp.dtype, pp.shape):
        return []
    if _raw_equal(side, _entry_item(master.model_key, pm, "model"), side, _entry_item(plain.model_key, pp, "model")):
        src = master.source
        items[at] = replace(items[at], key=src.key, shape=src.shape, dtype=src.dtype, entry=src)
        return [
            f"{side.label}'s {plain.model_key} has no master_weight of its own: it is the tied parameter (equal to "
            f"{master.model_key}), compared from {src.key}, as export writes it"
        ]
    return []


def _export_plans(side: Side, selected: Any, rules: Any, fmt: str) -> tuple[Any, dict[str, Any]]:
    """The export plan with fused experts, and the per-expert plan's tasks by model key (HF only; ``{}`` if none)."""
    from ckpttool.errors import ExportError
    from ckpttool.ops.export.experts import expert_orders
    from ckpttool.ops.export.plan import build_plan

    orders = expert_orders(selected, side.ckpt.require_layout())
    fused = build_plan(selected, rules, fmt=fmt, expert_orders=orders)
    per_expert = None
    if fmt == "hf":
        try:
            per_expert = build_plan(selected, rules, fmt=fmt, experts="per-expert", expert_orders=orders)
        except ExportError:
            per_expert = None
    split_tasks = {t.selected.model_key: t for t in per_expert.tasks} if per_expert is not None else {}
    return fused, split_tasks


def _task_items(tasks: Any, split_tasks: dict[str, Any], other: set[str]) -> tuple[list[Item], int]:
    """``(items, fused tensors compared per expert)`` of the export tasks: per expert where ``other`` holds pieces."""
    items: list[Item] = []
    n_split = 0
    assembled: dict[str, Item] = {}  # adapter values, by output name (a fused gate_up_proj has two sources)
    for task in tasks:
        s = task.selected
        src = s.source
        split = split_tasks.get(s.model_key)
        if s.hf is not None:
            chosen = task
            if split is not None and s.out_key not in other and any(p.name in other for p in split.pieces):
                chosen = split
                n_split += len(split.pieces) > 1
            _adapter_items(chosen, assembled, items)
            continue
        if (
            split is not None
            and any(p.expert is not None for p in split.pieces)
            and s.out_key not in other
            and any(p.name in other for p in split.pieces)
        ):
            order = split.expert_order or tuple(range(src.shape[0]))
            for p in split.pieces:
                assert p.expert is not None
                items.append(
                    Item(p.name, src.key, p.shape, src.dtype, "model", None, (order[p.expert], p.part, p.nparts), src)
                )
            n_split += 1
            continue
        perm, name = task.expert_order, s.out_key
        if split is not None and name not in other and len(split.pieces) == 1 and split.pieces[0].name in other:
            name = split.pieces[0].name  # the per-expert form's own name (Mixtral's `block_sparse_moe.gate.weight`)
        items.append(Item(name, src.key, src.shape, src.dtype, "model", perm, None, src))
    return items, n_split


def _adapter_items(task: Any, assembled: dict[str, Item], items: list[Item]) -> None:
    """The items of one adapter-mapped export task: each piece's runs (``dst`` re-based to the piece)."""
    src = task.selected.source
    for k, p in enumerate(task.pieces):
        if task.runs is None:
            runs: tuple[Run, ...] = (Run(0, math.prod(src.shape), 0, 0),)
        else:
            runs = tuple(Run(r.src, r.length, 0, r.dst) for r in task.runs if r.piece == k)
        if task.runs is None and len(task.pieces) == 1 and tuple(p.shape) == tuple(src.shape):
            items.append(Item(p.name, src.key, src.shape, src.dtype, "model", entry=src))  # as stored
            continue
        prev = assembled.get(p.name)
        if prev is not None:  # a shared piece: this source writes its other part
            assert prev.runs is not None
            new = replace(prev, runs=(*prev.runs, (src, runs)))
            items[items.index(prev)] = new
            assembled[p.name] = new
            continue
        item = Item(p.name, src.key, tuple(p.shape), src.dtype, "model", entry=src, runs=((src, runs),))
        assembled[p.name] = item
        items.append(item)


def _other(side: Side) -> str:
    return "B" if side.label == "A" else "A"


def _stored_items(side: Side) -> list[Item]:
    tensors = side.ckpt.catalog.tensors
    out = []
    for key in side.tensor_keys():
        e = tensors[key]
        out.append(_entry_item(key, e, "model"))
    return out


def _pair_names(a: Side, b: Side, opts: DiffOptions) -> tuple[list[Item], list[Item], list[Excluded], list[str], str]:
    """Items of both sides in one namespace (see the module docstring)."""
    if a.kind == "dcp" and b.kind == "dcp":
        ia, ea, notes = dcp_items(a, opts.what)
        ib, eb, notes_b = dcp_items(b, opts.what)
        notes += notes_b
        if opts.adapter is not None:
            notes.append(
                f"`adapter` {opts.adapter} not used: two DCP checkpoints are matched by torch-native keys, "
                "whatever their naming"
            )
        return ia, ib, ea + eb, notes, "torch-native"
    if a.kind != "dcp" and b.kind != "dcp":
        if opts.what == "optimizer":
            raise DiffError(
                f"{a.path}, {b.path}: `what` optimizer but neither side is a DCP checkpoint with optimizer state",
                param="what",
                hint="safetensors files hold model weights only; compare with `what` model",
            )
        ia, ib, notes = _stored_pair(a, b)
        return ia, ib, [], notes, "stored"
    dcp, st = (a, b) if a.kind == "dcp" else (b, a)
    if opts.what == "optimizer":
        raise DiffError(
            f"{st.path}: `what` optimizer but {st.label} is a {'PEFT adapter' if st.kind == 'lora' else 'safetensors'} "
            "input with no optimizer state: nothing to compare it with",
            path=st.path,
            param="what",
            hint="compare the model against it with `what` model, or the optimizer against another DCP checkpoint",
        )
    _require_model(dcp, st)
    st_items = _stored_items(st)
    other = {i.name for i in st_items}
    if st.kind == "lora" and not any(".lora_" in n for n in other):
        raise DiffError(f"{st.path}: a PEFT adapter directory with no LoRA tensors", path=st.path)
    d_items, excluded, notes, naming = export_items(
        dcp, other, opts, "lora" if st.kind == "lora" else "hf", tied=_tied_config(st), config=_hf_config(st, dcp)
    )
    notes.extend(_master_export_note(dcp, d_items, st_items, opts))
    if a is dcp:
        return d_items, st_items, excluded, notes, naming
    return st_items, d_items, excluded, notes, naming


def _stored_pair(a: Side, b: Side) -> tuple[list[Item], list[Item], list[str]]:
    """Two safetensors (or PEFT) sides by their stored names, a fused expert tensor on one side cut per expert
    where the other holds its experts one by one (:mod:`ckpttool.ops.diff.experts`)."""
    from ckpttool.ops.diff.experts import fused_unpaired, split_fused_experts

    ia, ib = _stored_items(a), _stored_items(b)
    names_a, names_b = {i.name for i in ia}, {i.name for i in ib}
    # config.json is read only where a fused expert tensor may be cut: two folders with nothing to pair need none
    mt = _model_type(a, b) if fused_unpaired(ia, names_b) or fused_unpaired(ib, names_a) else None
    # quantized fused expert tensors are cut once dequantized (_experts_dequantized)
    ia, cut_a = split_fused_experts(ia, names_b, mt)
    ib, cut_b = split_fused_experts(ib, names_a, mt)
    if cut_b:  # A's per-expert tensors in the order of B's pieces: each fused tensor of B is read once, not per piece
        at = {i.name: n for n, i in enumerate(ib)}
        ia = sorted(ia, key=lambda i: at.get(i.name, -1))
    notes = [
        f"{n} fused expert tensor(s) of {side.label} compared per expert with {_other(side)}"
        for side, n in ((a, cut_a), (b, cut_b))
        if n
    ]
    return ia, ib, notes


def _experts_dequantized(
    a: Side, items_a: list[Item], b: Side, items_b: list[Item], notes: list[str]
) -> tuple[list[Item], list[Item]]:
    """Dequantized fused FP8 experts of a safetensors side that the other holds per expert, cut into those pieces
    (:func:`~ckpttool.ops.diff.experts.split_dequantized_experts`); a quantized fused tensor that cannot be cut (its
    scale did not pair) is named in a note: it is not compared (listed as only in its side)."""
    from ckpttool.ops.diff.experts import fused_unpaired, split_dequantized_experts

    if a.kind == "dcp" or b.kind == "dcp":
        return items_a, items_b
    names_a, names_b = {i.name for i in items_a}, {i.name for i in items_b}
    if not (fused_unpaired(items_a, names_b) or fused_unpaired(items_b, names_a)):
        return items_a, items_b
    mt = _model_type(a, b)
    items_a, cut_a, left_a = split_dequantized_experts(items_a, names_b, mt)
    items_b, cut_b, left_b = split_dequantized_experts(items_b, names_a, mt)
    if cut_b:  # A's per-expert tensors in the order of B's pieces, as _stored_pair orders them
        at = {i.name: n for n, i in enumerate(items_b)}
        items_a = sorted(items_a, key=lambda i: at.get(i.name, -1))
    notes += [
        f"{n} quantized fused expert tensor(s) of {side.label} dequantized and compared per expert with "
        f"{_other(side)}, each expert on its own scale rows"
        for side, n in ((a, cut_a), (b, cut_b))
        if n
    ]
    notes += [
        f"{len(q)} quantized fused expert tensor(s) of {side.label} ({q[0]}, ...) not compared with "
        f"{_other(side)}'s per-expert tensors (listed as only in A / only in B): not dequantized (their scale does "
        "not pair), so not cut per expert; compare exports written in one expert layout (`export --experts`)"
        for side, q in ((a, left_a), (b, left_b))
        if q
    ]
    return items_a, items_b


def _model_type(*sides: Side) -> str | None:
    """The ``model_type`` of the first side's ``config.json`` that gives one (the family's per-expert form).

    Raises:
        PathEscapeError, UsageError, NotRegularFileError, SizeLimitError: a side's own ``config.json`` symlinked out
            of its folder, not JSON, not a regular file, too large (:meth:`Checkpoint.own_hf_config`).
    """
    for side in sides:
        mt = (side.ckpt.own_hf_config() or {}).get("model_type")
        if isinstance(mt, str):
            return mt
    return None


def _require_model(dcp: Side, st: Side) -> None:
    """Refuse a DCP side with no model tensor against a safetensors side (model weights only): nothing to compare.

    Raises:
        NothingComparedError (E611): the DCP side holds optimizer or training state only (or keys not recognised).
    """
    cat = dcp.ckpt.catalog
    if cat.model:
        return
    why = "; ".join(r.removeprefix("no model tensors: ") for r in cat.schema.reasons[:2])
    raise NothingComparedError(
        f"nothing compared, so no verdict: {dcp.label} ({dcp.path}) holds no model tensors to compare with "
        f"{st.label}'s {'PEFT adapter' if st.kind == 'lora' else 'safetensors'} ({why})",
        path=dcp.path,
        hint=f"pass the checkpoint that holds the model as {dcp.label}, or compare this state against another DCP "
        "checkpoint with `what` optimizer (or `what` all); `ckpttool inspect` shows its keys, `model_prefix` names where "
        "weights are",
    )


def _master_export_note(dcp: Side, d_items: list[Item], st_items: list[Item], opts: DiffOptions) -> list[str]:
    """A note when the safetensors side holds float32 where the DCP side's parameters, which have FP32 masters, are
    stored narrower: an ``export --weights master``, compared without ``weights`` master (dtype differences)."""
    if opts.weights == "master":
        return []
    state = dcp.ckpt.catalog.optimizer_state
    fqn_of = dcp.ckpt.catalog.fqn_of
    st_dtype = {i.name: i.dtype for i in st_items}
    hits = [
        i.name
        for i in d_items
        if i.dtype != "float32"
        and st_dtype.get(i.match) == "float32"
        and i.entry is not None
        and i.key in dcp.ckpt.catalog.model
        and "master_weight" in getattr(state.get(fqn_of(i.key)), "fields", {})
    ]
    if not hits:
        return []
    return [
        f"{dcp.label} keeps FP32 master weights, and {_other(dcp)} holds float32 where {dcp.label}'s parameters are "
        f"stored narrower ({len(hits)} tensor(s), e.g. {hits[0]}): compare an export of the master weights "
        "(export --weights master) with --weights master"
    ]


def _hf_config(st: Side, dcp: Side) -> dict[str, Any] | None:
    """The HF ``config.json`` of the safetensors side (else one beside the DCP checkpoint): the adapter's dimensions."""
    from ckpttool.format.files import resolve_inside
    from ckpttool.model.hfconfig import read_hf_config

    model = Path(dcp.ckpt.located.model)
    for root, rel in (
        (Path(st.ckpt.located.model), "config.json"),
        (model, "config.json"),
        (model, "model_assets/config.json"),
    ):
        if os.path.lexists(root / rel):  # a FIFO, folder or dangling link is refused by the read
            # inside the side's folder: a config.json, or the model_assets folder holding it, symlinked out is E101
            cfg = read_hf_config(resolve_inside(root, rel, what="config.json"), param=None)
            return cfg if isinstance(cfg, dict) else None
    return None


def _tied_config(side: Side) -> bool:
    """The safetensors side's ``config.json`` says ``tie_word_embeddings`` (its ``lm_head`` is the embedding)."""
    from ckpttool.model.hfconfig import tie_word_embeddings

    cfg = side.ckpt.own_hf_config()  # a config.json symlinked out of the folder is E101, as for every folder's own
    return cfg is not None and tie_word_embeddings(cfg) is True


# ---------------------------------------------------------------------------------------------- comparing
def _torch_dtype(name: str) -> Any:
    from ckpttool.format.metadata import DType

    return DType(name).to_torch()


def _stored_as(item: Item) -> str:
    """`` (KEY)``: the stored key of an item only on one side, where it is not the name compared."""
    return f" ({item.key})" if item.key != item.name else ""


def _raw_equal(a: Side, ia: Item, b: Side, ib: Item) -> bool | None:
    """Compare the stored records without decoding (:func:`_equal_plan`); ``None`` when the fast path does not apply.

    Chunks of one grid are compared record by record (zip CRC-32s that differ answer without a
    read); row blocks of two grids (:func:`_row_blocks`) as one byte stream each.
    """
    ea, eb = ia.entry, ib.entry
    assert ea is not None and eb is not None
    ca = sorted(c for c in ea.chunks if c.numel)
    cb = sorted(c for c in eb.chunks if c.numel)
    if ca != cb or len(set(ca)) != len(ca):
        ra_, rb_ = _row_blocks(a, ea), _row_blocks(b, eb)
        if ra_ is None or rb_ is None:
            return None
        return _run_equal(a, ra_, b, rb_)
    la, lb = [a.locate(ea.key, c) for c in ca], [b.locate(eb.key, c) for c in ca]
    if not all(x.raw and y.raw for x, y in zip(la, lb)):
        return None
    if any(_zip_crcs_differ(x, y) for x, y in zip(la, lb)):
        return False  # the zip CRC-32s differ: the values differ (decode to name the element)
    return _run_equal(a, la, b, lb)


def _zip_crcs_differ(x: ChunkLocation, y: ChunkLocation) -> bool:
    return x.record.member is not None and y.record.member is not None and x.record.crc32 != y.record.crc32


def _row_blocks(side: Side, e: TensorEntry) -> list[ChunkLocation] | None:
    """The chunk locations of a tensor stored as raw dim-0 row blocks (FSDP ``Shard(0)``, whole tensors), in order.

    The global tensor's C-order bytes are then the records concatenated: two such sides are
    compared as byte streams whatever their chunk boundaries. ``None``: another split.
    """
    chunks = sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets)
    if not chunks and math.prod(e.shape) == 0:
        return []
    pos = 0
    for c in chunks:
        if not e.shape:
            if len(chunks) != 1:
                return None
            continue
        if c.offsets[0] != pos or any(c.offsets[1:]) or tuple(c.sizes[1:]) != tuple(e.shape[1:]):
            return None
        pos += c.sizes[0]
    if e.shape and pos != e.shape[0]:
        return None
    locs = [side.locate(e.key, c) for c in chunks]
    return locs if all(loc.raw for loc in locs) else None


def _equal_plan(
    a: Side, la: list[ChunkLocation], b: Side, lb: list[ChunkLocation]
) -> tuple[PlanItem, list[ChunkLocation]]:
    """The engine plan comparing A's records (read, concatenated) with B's: one read of each side.

    Sinks: :class:`~ckpttool.engine.plan.CompareStream` over B's windows, then one
    :class:`~ckpttool.engine.plan.Crc32` span per record of A and of B (equal streams have
    equal CRC-32s: B's spans are taken on A's bytes). Returns the item and the records in
    the order of their spans.
    """
    spans = [Crc32(x, y) for locs in (la, lb) for x, y in _record_spans(locs)]
    return PlanItem(_windows(a, la), (CompareStream(_windows(b, lb)), *spans)), [*la, *lb]


_SPLIT_BYTES = 512 << 10  # from here the two halves run on two threads (reads, CRC-32 and memcmp release the GIL)


def _run_equal(a: Side, la: list[ChunkLocation], b: Side, lb: list[ChunkLocation]) -> bool:
    """Run :func:`_equal_plan`; when equal, check every record's CRC-32.

    Raises:
        ChecksumError: equal bytes whose CRC-32 disagrees with a record's zip entry.
        DataFileError: a data file ends first (it changed since the locator checked it).
    """
    if sum(loc.nbytes for loc in la) != sum(loc.nbytes for loc in lb):
        return False
    item, records = _equal_plan(a, la, b, lb)
    n = item.length
    try:
        first, *crcs = run_split(item, n // 2) if n >= _SPLIT_BYTES and can_split(item) else run_item(item)
    except ShortReadError:
        raise _short_read([(a, loc) for loc in la] + [(b, loc) for loc in lb]) from None
    a.reader.count_read(n)
    b.reader.count_read(n)
    if first is not None:
        return False
    for loc, crc in zip(records, crcs):
        loc.check_crc(crc)
    return True


def _stream_values(a: Side, ia: Item, b: Side, ib: Item, how: Tolerance) -> ValueDiff | None:
    """The value comparison of two stored tensors that are raw dim-0 row blocks (:func:`_row_blocks`), on the engine.

    One item reads A's records as one stream; a :class:`~ckpttool.engine.plan.PairedSlabs` sink
    reads B's elements beside each slab of :data:`~ckpttool.ops.diff.compare.BLOCK_ELEMENTS`
    and folds the two into a :class:`~ckpttool.ops.diff.compare.ValueCompare`; a ``Crc32`` span
    per record of A and the sink's spans of B check every record. ``how``: the :class:`Tolerance`.
    ``None``: another storage (:func:`~ckpttool.ops.diff.gather.gathered_values`).

    Raises:
        DataFileError: a data file ends first. ChecksumError: a record fails its CRC-32.
    """
    import torch

    ea, eb = ia.entry, ib.entry
    if not (ia.direct and ib.direct) or ea is None or eb is None or math.prod(ia.shape) == 0:
        return None
    for side, e in ((a, ea), (b, eb)):
        meta = side.ckpt.metadata.entries[e.key]
        assert isinstance(meta, TensorMeta)
        side.reader.check_allocation(e.key, meta)
    la, lb = _row_blocks(a, ea), _row_blocks(b, eb)
    if la is None or lb is None:
        return None
    da, db = _torch_dtype(ia.dtype), _torch_dtype(ib.dtype)
    acc = ValueCompare(da, db, how)

    def fold(mine: memoryview, theirs: memoryview, first: int) -> None:
        acc.add(torch.frombuffer(mine, dtype=da), torch.frombuffer(theirs, dtype=db), first)

    wa, wb = _windows(a, la), _windows(b, lb)
    pair = PairedSlabs(wb, da.itemsize, db.itemsize, BLOCK_ELEMENTS, fold, _record_spans(lb))
    spans = [Crc32(x, y) for x, y in _record_spans(la)]
    try:
        *crcs_a, crcs_b = run_item(PlanItem(wa, (*spans, pair)))
    except ShortReadError:
        raise short_tensor([(b, loc) for loc in lb] + [(a, loc) for loc in la]) from None
    for side, locs, crcs in ((b, lb, crcs_b), (a, la, crcs_a)):
        side.reader.count_read(sum(loc.nbytes for loc in locs))
        for loc, crc in zip(locs, crcs) if side.reader.verify_crc else ():
            loc.check_crc(crc)
    return acc.result()


def _loaded_values(a: Side, ia: Item, b: Side, ib: Item, how: Tolerance) -> ValueDiff:
    """The value comparison of two values assembled in memory (:meth:`Side.load`: the reader's global
    tensors, permuted, cut, placed by an adapter's runs or dequantized), for what has no engine windows
    (:mod:`ckpttool.ops.diff.gather`: records that are not raw, checked zip records, MXFP4); ``how`` as
    :func:`_stream_values`."""
    fut = overlap(b.load, ib)  # both sides read at once
    try:
        ta = a.load(ia)
    finally:
        tb = fut.result()
    return compare_tensors(ta, tb, _quant_how(a, ia, b, ib, how))


def _quant_how(a: Side, ia: Item, b: Side, ib: Item, how: Tolerance) -> Tolerance:
    """``how`` with a dequantized side's default tolerance when none is given (known once its scales are read)."""
    if not how.tolerant and (ia.dequant or ib.dequant):  # one quantized side
        from ckpttool.ops.diff.quantized import quant_tolerance

        rtol, atol = quant_tolerance(ia, ib, a, b) or (None, None)
        how = replace(how, rtol=rtol, atol=atol)
    return how


def _quant_used(a: Side, ia: Item, b: Side, ib: Item) -> tuple[str, float, float] | None:
    """The quantization default tolerance a pair without ``rtol``/``atol`` was compared within (:attr:`TensorStat.tolerance`)."""
    if not (ia.dequant or ib.dequant):
        return None
    from ckpttool.ops.diff.quantized import tolerance_used

    return tolerance_used(ia, ib, a, b)


def _windows(side: Side, locs: list[ChunkLocation]) -> tuple[Window, ...]:
    """The engine windows of raw records, in order."""
    return tuple(Window(side.reader.fd(loc.info.relative_path), loc.data_start, loc.nbytes) for loc in locs)


def _record_spans(locs: list[ChunkLocation]) -> tuple[tuple[int, int], ...]:
    """Each record's ``(start, end)`` in the stream of ``locs`` concatenated."""
    out, pos = [], 0
    for loc in locs:
        out.append((pos, pos + loc.nbytes))
        pos += loc.nbytes
    return tuple(out)


def _short_read(locs: list[tuple[Side, ChunkLocation]]) -> DataFileError:
    """The error naming the first record whose data file now ends before it (the first record if none does)."""
    short = (
        loc
        for side, loc in locs
        if os.fstat(side.reader.fd(loc.info.relative_path)).st_size < loc.data_start + loc.nbytes
    )
    loc = next(short, locs[0][1])
    return DataFileError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=loc.key)


def _compare_pair(
    name: str,
    a: Side,
    ia: Item,
    b: Side,
    ib: Item,
    opts: DiffOptions,
    say: Callable[[str], None] = lambda text: None,
) -> tuple[Difference | None, TensorStat | None]:
    """``(difference or None, the tensors' metrics or None when no value was compared)`` of two items of one name.

    ``say("loading torch")`` before the first decoding comparison imports torch (seconds, once),
    then ``say("comparing")``.
    """
    if ia.dtype == "bytes" or ib.dtype == "bytes":
        return _compare_objects(name, a, ia, b, ib), None
    tolerant = opts.rtol is not None or opts.atol is not None or (ia.dequant is None) != (ib.dequant is None)
    kind = _kind_difference(name, ia, ib, opts, tolerant)
    if kind is not None:
        return kind, None
    cast = (
        opts.as_dtype
        if opts.as_dtype is not None and (ia.dtype != opts.as_dtype or ib.dtype != opts.as_dtype)
        else None
    )
    if ia.direct and ib.direct and ia.dtype == ib.dtype and cast is None:
        same = _raw_equal(a, ia, b, ib)
        if same:
            return None, _stat(name, ia, ib, ValueDiff(0, None), raw=True)
    if "torch" not in sys.modules:
        say("loading torch")
        import torch  # noqa: F401

        say("comparing")
    floating = ia.dtype in _FLOATING and ib.dtype in _FLOATING
    stack = _stacked_layers(name, a, ia, ib)
    how = Tolerance(
        as_dtype=_torch_dtype(cast) if cast is not None and floating else None,
        rtol=opts.rtol,
        atol=opts.atol,
        rows=math.prod(ia.shape[1:]) if stack is not None else None,
    )
    vd = _stream_values(a, ia, b, ib, how)
    if vd is None:
        vd = gathered_values(a, ia, b, ib, how, lambda h: _quant_how(a, ia, b, ib, h))
    if vd is None:
        vd = _loaded_values(a, ia, b, ib, how)
    stat = _stat(name, ia, ib, vd, stack=stack, tolerance=None if how.tolerant else _quant_used(a, ia, b, ib))
    if vd.mismatched == 0:
        return None, stat
    return _values_difference(name, ia, ib, vd, tolerant), stat


def _stacked_layers(name: str, a: Side, ia: Item, ib: Item) -> str | None:
    """The layer-name prefix (``model.decoder.layers.``) of a value stored with every layer stacked on dim 0 by
    A's key schema (:attr:`~ckpttool.model.schemas.base.SchemaSpec.stacked_layers`: Megatron-core's
    ``decoder.layers.<module> [L, ...]``), compared as stored on both sides; else ``None``."""
    from ckpttool.model.schemas import registry

    spec = registry.find(a.ckpt.catalog.schema.id)
    if spec is None or not ia.shape or ia.runs is not None or ib.runs is not None or ia.piece or ia.perm:
        return None
    for p in spec.stacked_layers:
        at = name.find("." + p)
        if at >= 0 and spec.stacked_prefix(name[at + 1 :]) is not None:
            return name[: at + 1 + len(p)]
    return None


def _stat(
    name: str,
    ia: Item,
    ib: Item,
    vd: ValueDiff,
    *,
    raw: bool = False,
    stack: str | None = None,
    tolerance: tuple[str, float, float] | None = None,
) -> TensorStat:
    """The :class:`TensorStat` of a compared pair (booleans: no metrics); ``stack``: the layer-name prefix of a
    tensor of stacked layers, whose per-layer norms :attr:`ValueDiff.rows` gives; ``tolerance``: the quantization
    default the pair was compared within (:func:`~ckpttool.ops.diff.quantized.tolerance_used`)."""
    m: Metrics | None = vd.metrics
    norms: tuple[float | None, float | None] = (None, None)
    if m is None:
        max_abs = rel = cos = None
    else:
        max_abs, rel, cos = m.max_abs, m.rel_l2, m.cosine
        norms = (math.sqrt(m.sum_dd), math.sqrt(m.sum_bb) if m.sum_bb is not None else None)
    if vd.mismatched:
        status = "differ"
    elif (m is not None and m.sum_dd != 0) or vd.not_bitwise:  # -0.0 against 0.0 adds 0 to the sum
        status = "within_tolerance"
    else:
        status = "equal"
    return TensorStat(
        name,
        ia.key,
        ib.key,
        ia.shape,
        ia.dtype,
        ib.dtype,
        math.prod(ia.shape),
        status,
        vd.mismatched,
        max_abs,
        rel,
        cos,
        raw,
        *norms,
        tuple((f"{stack}{i}", math.sqrt(d), math.sqrt(b)) for i, (d, b) in enumerate(vd.rows) if stack is not None),
        tolerance,
    )


def _kind_difference(name: str, ia: Item, ib: Item, opts: DiffOptions, tolerant: bool) -> Difference | None:
    """A shape difference, or a dtype difference the options do not compare across; ``None``: compare the values."""
    if ia.shape != ib.shape:
        return Difference(name, "shape", f"{name}: shape {list(ia.shape)} in A, {list(ib.shape)} in B", ia.key, ib.key)
    if ia.dtype != ib.dtype and opts.as_dtype is None and not tolerant:
        return Difference(
            name,
            "dtype",
            f"{name}: dtype {ia.dtype} in A, {ib.dtype} in B",
            ia.key,
            ib.key,
            a_value=ia.dtype,
            b_value=ib.dtype,
        )
    return None


def _values_difference(name: str, ia: Item, ib: Item, vd: ValueDiff, tolerant: bool) -> Difference:
    """The ``values`` difference of two items whose values differ (``vd.mismatched > 0``)."""
    assert vd.first is not None
    idx = unravel(vd.first, ia.shape)
    how = "outside the tolerance" if tolerant else "differ"
    stored = None
    for label, it in (("A", ia), ("B", ib)):
        at = it.stored_index(vd.first)
        if at is not None:
            stored = {"side": label, "key": at[0], "index": at[1]}
            break
    where = f" = {stored['side']}'s {stored['key']}{stored['index']}" if stored is not None else ""
    msg = (
        f"{name}: {vd.mismatched} of {math.prod(ia.shape)} element(s) {how}; first at {idx}{where} "
        f"(A {vd.a_value!r}, B {vd.b_value!r})"
    )
    if vd.max_abs_error is not None:
        msg += f"; max abs error {vd.max_abs_error:.3g}, max rel error {vd.max_rel_error:.3g}"
    return Difference(
        name,
        "values",
        msg,
        ia.key,
        ib.key,
        idx,
        vd.mismatched,
        math.prod(ia.shape),
        vd.max_abs_error,
        vd.max_rel_error,
        vd.a_value,
        vd.b_value,
        stored,
    )


_FLOATING = {"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}


def _compare_objects(name: str, a: Side, ia: Item, b: Side, ib: Item) -> Difference | None:
    """Byte items (and state fields saved as Python objects): stored bytes, else loaded values."""
    if ia.dtype != ib.dtype:
        return Difference(name, "object", f"{name}: a tensor on one side, a Python object on the other", ia.key, ib.key)
    ra, rb = a.reader.raw_bytes(ia.key), b.reader.raw_bytes(ib.key)
    a.reader.count_read(0)
    if ra == rb:
        return None
    try:
        va, vb = a.reader.read_object(ia.key), b.reader.read_object(ib.key)
    except CkptError as e:  # a finding: the bytes differ and the values could not be read to say more
        return Difference(
            name,
            "object",
            f"{name}: stored bytes differ, values not compared: {e}",
            ia.key,
            ib.key,
        )
    if _same_object(va, vb):
        return None
    return Difference(
        name,
        "object",
        f"{name}: {_short(va)} in A, {_short(vb)} in B",
        ia.key,
        ib.key,
        a_value=_short(va),
        b_value=_short(vb),
    )


def _same_object(x: Any, y: Any, *, any_sequence: bool = False, any_number: bool = False) -> bool:
    """Equal values of one type (``any_sequence``: a list equals a tuple of the same values; ``any_number``: an int
    equals a float of the same value, ``weight_decay: 0`` in one run's YAML and ``0.0`` in the other's; not a bool).
    A NaN equals a NaN of the same bits (a float, or a tensor's element), as the tensors' bitwise comparison has it:
    a diverged run's ``lr: nan`` against its own copy is no difference."""
    try:
        import torch

        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.shape == y.shape
                and x.dtype == y.dtype
                and (bool(torch.equal(x, y)) or same_bytes(x.contiguous(), y.contiguous()))  # NaN: as stored
            )
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(
            _same_object(x[k], y[k], any_sequence=any_sequence, any_number=any_number) for k in x
        )
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return (
            (any_sequence or type(x) is type(y))
            and len(x) == len(y)
            and all(_same_object(p, q, any_sequence=any_sequence, any_number=any_number) for p, q in zip(x, y))
        )
    if any_number and {type(x), type(y)} == {int, float}:
        return bool(x == y)  # exact: Python compares an int with a float without rounding
    return _same_scalar(x, y)


def _same_scalar(x: Any, y: Any) -> bool:
    """Equal values of one type; two NaN floats are equal where their bits are, as a tensor's elements compare."""
    if type(x) is float and type(y) is float and math.isnan(x) and math.isnan(y):
        return struct.pack("<d", x) == struct.pack("<d", y)
    return bool(type(x) is type(y) and x == y)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _group_values(side: Side) -> dict[str, dict[str, Any]]:
    """``optimizer.param_groups.<fqn>`` -> the hyperparameters of the parameter's group (``lr``, ``betas``, ...);
    a group no parameter maps to (a plain ``optimizer.state_dict()``: its ``params`` are indices) by its index,
    ``optimizer.param_groups.<g>``: compared group by group, not left out (an lr changed there was "equal")."""
    cat = side.ckpt.catalog
    side.ckpt.param_groups()
    out: dict[str, dict[str, Any]] = {}
    reached: set[int] = set()
    fqns = [cat.fqn_of(key) for key in cat.model]
    if not fqns:  # an optimizer-only save: its parameters are those of its state (an index-keyed one: by group)
        fqns = [f for f in cat.optimizer_state if not f.isdecimal()]
    wrappers = wrapper_segments_of(cat.optimizer_state, cat.param_fqns)
    names = [strip_wrapper_segments(f, wrappers)[0] for f in fqns]  # as the tensors are named (_unwrapped)
    if len(set(names)) != len(names):
        names = fqns
    for fqn, name in zip(fqns, names):
        g = cat.group_of(fqn) or cat.group_of(name)  # a group listing the fqn without the wrapper
        if g is not None:
            out[canonical_group_key(name)] = g.leaf_values
            reached.add(id(g))
    for g in cat.param_groups:  # a flattened group by its fqn: a model key renamed on its own leaves the group
        if id(g) not in reached:
            gid = str(g.group_id)
            name = gid if g.flavor == "nested" or names is fqns else strip_wrapper_segments(gid, wrappers)[0]
            out.setdefault(canonical_group_key(name), g.leaf_values)
    return out


def _compare_groups(
    a: Side, b: Side, globs: tuple[str, ...] = ()
) -> tuple[int, list[Difference], list[tuple[str, str]]]:
    """``(hyperparameters compared, differences, (how, name) of those equal as values but stored as other types)`` of
    the per-parameter param-group values (names ``globs`` match). ``betas`` saved as a tuple comes back a list from
    torch's ``set_state_dict(..., full_state_dict=True)`` (it flattens and rebuilds the groups), and ``weight_decay``
    is ``0`` in a config that says ``0`` and ``0.0`` in one that says ``0.0``: the optimizer steps alike with either,
    so that is a note, not a difference."""
    ga, gb = _group_values(a), _group_values(b)
    diffs: list[Difference] = []
    retyped: list[tuple[str, str]] = []
    n = 0
    for base in sorted(set(ga) | set(gb)):
        va, vb = ga.get(base), gb.get(base)
        if globs and not _matches(globs, base, *(f"{base}.{h}" for h in set(va or ()) | set(vb or ()))):
            continue
        if va is None or vb is None:  # a name on one side only, not a value compared
            side = "B" if va is not None else "A"
            diffs.append(
                Difference(base, "only_a" if va is not None else "only_b", f"{base}: no param group in {side}")
            )
            continue
        for hyper in sorted(set(va) | set(vb)):
            if globs and not _matches(globs, base, f"{base}.{hyper}"):
                continue
            n += 1
            x, y = va.get(hyper, _MISSING), vb.get(hyper, _MISSING)
            if x is _MISSING or y is _MISSING or not _same_object(x, y):
                retype = _retyped(x, y)
                if retype is not None:
                    retyped.append((retype, f"{base}.{hyper}"))
                    continue
                diffs.append(
                    Difference(
                        f"{base}.{hyper}",
                        "hyperparameter",
                        f"{base}.{hyper}: {_short(x)} in A, {_short(y)} in B",
                        a_value=_short(x),
                        b_value=_short(y),
                    )
                )
    return n, diffs, retyped


def _retyped(x: Any, y: Any) -> str | None:
    """``"sequence"`` (a tuple and a list) or ``"number"`` (an int and a float) where two hyperparameters unequal as
    stored are equal as values, else ``None`` (absent on one side, or other values)."""
    if x is _MISSING or y is _MISSING:
        return None
    if _same_object(x, y, any_sequence=True):
        return "sequence"
    if _same_object(x, y, any_sequence=True, any_number=True):
        return "number"
    return None


class _Missing:
    def __repr__(self) -> str:
        return "absent"


_MISSING = _Missing()


def _check_options(opts: DiffOptions) -> None:
    if opts.what not in WHAT:
        raise UsageError(f"`what` {opts.what!r} is not one of {', '.join(WHAT)}", param="what")
    if opts.weights not in ("params", "master"):
        raise UsageError(f"`weights` {opts.weights!r} is not one of params, master", param="weights")
    for p, v in (("rtol", opts.rtol), ("atol", opts.atol)):
        if v is not None and (  # inf: every value within (and no JSON number)
            not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v >= 0)
        ):
            raise UsageError(
                f"`{p}` must be a finite number >= 0, got {v} (an infinite or NaN tolerance accepts any values, so "
                "no difference could be found)",
                param=p,
                hint=f"give a finite tolerance, e.g. `{p}` {'1e-3' if p == 'rtol' else '1e-6'} (widen it for a looser check)",
            )
    if opts.as_dtype is not None and opts.as_dtype not in ("bfloat16", "float16", "float32", "float64"):
        raise UsageError(
            f"`as_dtype` {opts.as_dtype!r} is not one of bfloat16, float16, float32, float64", param="as_dtype"
        )
    if isinstance(opts.filters, str) or any(not isinstance(g, str) or not g for g in opts.filters):
        raise UsageError(f"`filters` {opts.filters!r} is not a sequence of non-empty globs", param="filters")


def diff_checkpoints(
    a: CheckpointOrPath,
    b: CheckpointOrPath,
    options: DiffOptions | None = None,
    *,
    progress: ProgressFn | None = None,
    opening_a: OpenOptions | None = None,
    opening_b: OpenOptions | None = None,
    phase: PhaseFn | None = None,
) -> DiffResult:
    """Compare two checkpoints (see the module docstring). Neither input is modified.

    Args:
        a, b: each a DCP checkpoint directory (or a directory above one), a safetensors
            directory or file, or a PEFT adapter directory; or an opened :class:`Checkpoint` of
            one (used as it is, left open; its side then takes no ``opening_*`` or step).
        options: :class:`DiffOptions`.
        progress: ``progress(bytes done, bytes total)``: the stored bytes of both sides' values
            to compare, the total known before the first is read; called after each pair.
        opening_a, opening_b: how to open each side (EP layout declaration of an unversioned DCP
            side, step / schema overrides, ``trust_pickle``); a schema override applies to a DCP side
            only (a safetensors side is named as Hugging Face names it).
        phase: ``phase(text)`` as each step before the comparison starts: ``opening A (PATH)``,
            ``opening B (PATH)``, ``matching names``; then ``progress(0, total)`` starts the
            comparison, and ``comparing hyperparameters`` follows it where there are any.

    Returns:
        :class:`DiffResult` (``equal``: exit 0, else 1).

    Raises:
        UsageError: bad options (a step that selects nothing: :func:`~ckpttool.ops.diff.sides.side_openings`).
        DiffError (E610): an input of no known kind, ``what`` ``optimizer`` with a side that holds no optimizer
            state (safetensors, a PEFT adapter), a legacy EP layout on an expert dim other than 0.
        NothingComparedError (E611): no tensor value compared and no difference found (never "equal").
        LayoutError (E405): an undeclared ambiguous EP layout.
        DataFileError (E300): a data file written to or replaced while it was read (no verdict).
        plus the reader's errors for damaged inputs (E1xx-E3xx).
    """
    opts = options_of(options, DiffOptions)
    _check_options(opts)
    opening_a, opening_b = side_openings(a, b, opts, check_source(a, opening_a), check_source(b, opening_b))
    t0 = time.perf_counter()
    say = phase or (lambda text: None)
    say(f"opening A ({a.path if isinstance(a, Checkpoint) else a})")
    sa = _open_side("A", a, opening_a)
    try:
        say(f"opening B ({b.path if isinstance(b, Checkpoint) else b})")
        sb = _open_side("B", b, opening_b)
    except BaseException:
        sa.close()
        raise
    try:
        say("matching names")
        res = _diff(sa, sb, opts, progress, t0, say)
        for side in (sa, sb):  # a data file written meanwhile: no verdict on bytes of two states
            side.ckpt.reader.check_unchanged()
    finally:
        sa.close()
        sb.close()
    return res


def _matches(globs: tuple[str, ...], *names: str) -> bool:
    """Whether a name matches a glob, with or without the canonical ``model.`` prefix (as every ``--filter``)."""
    return any(match_filter(n, g) for n in names for g in globs)


def _filter(
    globs: tuple[str, ...], items_a: list[Item], items_b: list[Item], excluded: list[Excluded]
) -> tuple[list[Item], list[Item], list[Excluded], int]:
    """The items (and exclusions) ``globs`` keep, and how many items they left out (see :class:`DiffOptions`)."""
    if not globs:
        return items_a, items_b, excluded, 0
    keep = {i.match for i in items_a if _matches(globs, i.name, i.key)}
    keep |= {i.name for i in items_b if _matches(globs, i.name, i.key)}
    ka = [i for i in items_a if i.match in keep]
    kb = [i for i in items_b if i.name in keep]
    ke = [e for e in excluded if _matches(globs, e.key)]
    return ka, kb, ke, len(items_a) + len(items_b) - len(ka) - len(kb)


def _item_bytes(side: Side, item: Item) -> int:
    """Stored bytes of ``item``'s value (0: a byte item)."""
    if item.dtype == "bytes":
        return 0
    from ckpttool.format.metadata import DType

    return math.prod(item.shape) * DType(item.dtype).itemsize


class _Tally:
    """What one diff has found so far: differences (the first ``limit`` kept), tensor metrics, counts."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.diffs: list[Difference] = []
        self.count = 0
        self.stats: list[TensorStat] = []
        self.compared = self.equal = self.raw = self.values = 0
        self.hypers = 0  # hyperparameters compared (values read and understood, as tensor values are)

    def add(self, d: Difference) -> None:
        self.count += 1
        if len(self.diffs) < self.limit:
            self.diffs.append(d)

    def pair(self, d: Difference | None, stat: TensorStat | None) -> None:
        self.compared += 1
        if stat is not None:
            self.stats.append(stat)
            self.raw += stat.raw
            self.values += stat.numel
        if d is None:
            self.equal += 1
        else:
            self.add(d)


def _diff(
    a: Side,
    b: Side,
    opts: DiffOptions,
    progress: ProgressFn | None,
    t0: float,
    say: Callable[[str], None],
) -> DiffResult:
    items_a, items_b, excluded, notes, naming = _pair_names(a, b, opts)
    items_a, items_b = _dequantized(a, items_a, b, items_b, notes)
    items_a, items_b = _experts_dequantized(a, items_a, b, items_b, notes)
    seen = (len(items_a), len(items_b))
    bare = _bare_filter_hint(opts.filters, items_a)
    items_a, items_b, excluded, filtered_out = _filter(opts.filters, items_a, items_b, excluded)
    by_b: dict[str, Item] = {}
    for i in items_b:
        by_b.setdefault(i.name, i)
    names_a = {i.match for i in items_a}
    tally = _Tally(opts.max_differences)
    pairs: list[tuple[Item, Item | None]] = []
    seen_b: set[str] = set()
    for ia in items_a:
        ib = by_b.get(ia.match)
        if ib is None or ia.name in seen_b:
            pairs.append((ia, None))
            continue
        seen_b.add(ia.name)
        pairs.append((ia, ib))
    by_a = {i.name: i for i in items_a}
    for ib in items_b:  # B's tied head (B the DCP side) against A's embedding: the pair export_items announced
        if ib.against is not None and ib.name not in names_a and ib.against in by_a:
            pairs.append((replace(by_a[ib.against], name=ib.name), ib))
            names_a.add(ib.name)
    _compare_pairs(a, b, pairs, opts, tally, progress, say)
    a.drop_cache()
    b.drop_cache()
    for ib in items_b:
        if ib.name not in names_a:
            tally.add(Difference(ib.name, "only_b", f"{ib.name}: only in B{_stored_as(ib)}", None, ib.key))
    if opts.what in ("optimizer", "all") and a.kind == "dcp" and b.kind == "dcp":
        say("comparing hyperparameters")
        notes.extend(_compare_hyperparameters(a, b, opts, tally))
        keying = _keying_mismatch(a, b)
        if keying is not None:
            notes.append(f"{keying}: their optimizer state and param groups pair up with nothing (only in A / B)")
        changed = _optimizer_changed(a, b)
        if changed is not None:
            notes.append(changed)
    kept = (len(items_a), len(items_b))
    _fail_closed(a, b, opts, tally, seen, kept, len(pairs) - sum(ib is None for _, ib in pairs), excluded, bare)
    notes.extend(_cross_dtype_notes(tally.stats, opts))
    notes.extend(_beside_notes(a, b, opts))
    notes.extend(_newer_incomplete_notes(a, b))
    notes.extend(_self_note(a, b))
    notes.extend(_unproven_notes(a, b))
    notes.extend(_model_only_note(a, b, opts))
    notes.extend(_training_state_note(a, b, opts))
    seconds = time.perf_counter() - t0
    log.info("diff: %d compared (%d raw), %d differences in %.3f s", tally.compared, tally.raw, tally.count, seconds)
    return DiffResult(
        a.info(),
        b.info(),
        opts,
        naming,
        tally.compared,
        tally.equal,
        tally.raw,
        tally.diffs,
        tally.count,
        excluded,
        notes,
        a.reader.bytes_read - a.read_before + (b.reader.bytes_read - b.read_before if b.reader is not a.reader else 0),
        seconds,
        a.adapter or b.adapter,
        sorted(tally.stats, key=lambda t: t.order),
        tally.values,
        filtered_out,
        tuple(t.name for t in tally.stats),
    )


def _files_beside(side: Side) -> dict[str, str] | None:
    """``{relative name: digest}`` of the files below a local DCP side's directory that hold no item of it
    (``extra_state/``, a trainer's ``trainer_state.json``, unreferenced data files) and of the training state a
    trainer saved beside it (OLMo-core's ``train/rankR.pt``): what ``manifest`` lists as sidecars and training
    state. ``None``: not a local checkpoint of one folder (a URL, a model/optimizer pair in other folders)."""
    from ckpttool.ops.manifest import sidecar_digests, training_state_digests

    reader = side.ckpt.reader
    if reader.remote is not None or any(
        p.resolve().parent != Path(reader.path).resolve() for p in reader.parts.values()
    ):
        return None
    skip = _not_beside(side)
    out = {f["file"]: f"{f['size']}:{f['digest']}" for f in sidecar_digests(Path(reader.path), skip, "xxh3-128")}
    for f in training_state_digests(Path(side.ckpt.located.model), "xxh3-128"):
        out[f"../{f['file']}"] = f"{f['size']}:{f['digest']}"
    return out


def _not_beside(side: Side) -> set[str]:
    """The relative names below a DCP side's folder (or prefix) that are its items, metadata or index, not files
    beside it (:func:`_files_beside`)."""
    from ckpttool.format.manifest_file import MANIFEST_NAME

    reader = side.ckpt.reader
    md = side.ckpt.metadata
    skip = {".metadata", MANIFEST_NAME, "layout.json", *(info.relative_path for info in md.storage.values())}
    skip |= set(getattr(reader, "rank_metadata_files", ()))  # __R.metadata: the metadata, compared as items
    skip.add("model.safetensors.index.json")  # how the files are cut, not what they hold
    skip -= set(getattr(getattr(reader, "assembled", None), "partial", ()))  # rank files of state in no item
    if reader.parts:
        skip |= {f"{name}/.metadata" for name in (p.name for p in reader.parts.values())}
    return skip


def _remote_beside_note(a: Side, b: Side, fa: dict[str, str] | None, fb: dict[str, str] | None) -> list[str]:
    """With ``what`` all where a side is a URL: a note naming the files beside the checkpoints (a remote side's from
    its listing, never fetched) that were not compared, so that "equal" does not claim them; none when neither side
    has any."""
    from ckpttool.format.marker import MARKER_NAME

    remote = [s for s in (a, b) if s.ckpt.reader.remote is not None]
    if not remote:
        return []
    held = []
    for side, local in ((a, fa), (b, fb)):
        store = side.ckpt.reader.remote
        if store is not None:
            skip = _not_beside(side) | {MARKER_NAME}
            names = sorted(n for n in store.sizes() if n not in skip)
        else:
            names = sorted(local or ())
        if names:
            shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3} more)" if len(names) > 3 else "")
            held.append(f"{len(names)} beside {side.label} ({shown})")
    if not held:
        return []
    urls = " and ".join(f"{s.label} ({store.path})" for s in remote if (store := s.ckpt.reader.remote) is not None)
    return [
        f"{REMOTE_BESIDE_NOTE}: {'; '.join(held)}; the files beside {urls} are not fetched: copy "
        f"{'them to local directories and diff those' if len(remote) > 1 else 'it to a local directory and diff that'} "
        "to compare them"
    ]


def _self_note(a: Side, b: Side) -> list[str]:
    """A note when both sides are one checkpoint (``diff X X``; ``diff run/ run/ --step 3``, whose two sides open
    the same step; a link to it): it is compared with itself, which proves only that it reads alike twice."""
    if a.only_file != b.only_file and (a.kind != b.kind or _one_file(a) is None or _one_file(a) != _one_file(b)):
        return []
    if a.reader is not b.reader and not _same_path(Path(a.reader.path), Path(b.reader.path)):
        return []
    where = getattr(a.ckpt, "located", None)
    shown = str(where.model) if where is not None else str(a.reader.path)
    only = a.only_file or b.only_file
    shown = f"{shown}/{only}" if only else shown
    below_run = any(s.info().opened for s in (a, b))  # a run root's step: --a-step/--b-step pick two
    how = (
        "to compare two steps of the run give --a-step N --b-step M" if below_run else "to compare two copies pass both"
    )
    return [f"{SELF_NOTE} ({shown}): compared with itself, which shows only that it reads alike twice; {how}"]


def _unproven_notes(a: Side, b: Side) -> list[str]:
    """A note for each side that cannot be known complete (``Checkpoint.unproven_shards``: per-rank shards of
    ``HuggingFaceStorageWriter(save_distributed=True)`` that no consolidated copy or model class proved), once where
    both sides are one checkpoint: their equality speaks of the pieces present, as inspect's, stats' and export's
    ``warning:`` on the same folder says. None where the other side is known complete: its shapes, compared, prove
    the side's (a rank's pieces missing shrink a shape or leave a tensor only in it)."""
    sides = (a,) if a.reader is b.reader else (a, b)
    why = [(side.label, side.ckpt.unproven_shards()) for side in sides]
    return [f"{UNPROVEN_NOTE}: {label}: {w}" for label, w in why] if all(w is not None for _, w in why) else []


def _group_count(side: Side) -> int:
    """The param groups of a DCP side: a nested group each; in the flattened flavor (a group entry per parameter) the
    parameters with equal hyperparameters count as one group (:meth:`Catalog.leaves`: the save does not say which
    group a parameter was in, so two groups with equal hyperparameters count once)."""
    cat = side.ckpt.catalog
    if all(g.flavor == "nested" for g in cat.param_groups):
        return len(cat.param_groups)
    side.ckpt.param_groups()
    return len(cat.leaves())


def _model_only_note(a: Side, b: Side, opts: DiffOptions) -> list[str]:
    """A note counting the optimizer state fields and param groups of a DCP side that were left out, so that "equal"
    is not read as "the same training state": with ``what`` model (either side's), and with ``what`` all where the
    other side is a safetensors or PEFT input, which holds none to pair them with."""
    mixed = a.kind != b.kind  # one DCP side beside a safetensors / LoRA one (two of those hold no state)
    if opts.what == "optimizer" or (opts.what == "all" and not mixed):
        return []
    counts = []
    for side in (a, b):
        cat = side.ckpt.catalog
        dcp = side.kind == "dcp"
        counts.append(
            (
                sum(len(ps.fields) for ps in cat.optimizer_state.values()) if dcp else 0,
                _group_count(side) if dcp else 0,
            )
        )

    def held(fields: int, groups: int) -> str:
        return f"{fields:,} state field{'s' * (fields != 1)} in {groups:,} param group{'s' * (groups != 1)}"

    if counts[0] == counts[1]:
        if counts[0] == (0, 0):
            return []
        told = f"A and B each hold {held(*counts[0])}"
    else:
        told = "; ".join(f"{side.label} holds {held(*n)}" for side, n in zip((a, b), counts, strict=True) if any(n))
    if not mixed:
        return [f"{MODEL_ONLY_NOTE} ({told}): --what all compares them"]
    st = a if a.kind != "dcp" else b
    kind = "PEFT adapter" if st.kind == "lora" else "safetensors input"
    return [
        f"{MODEL_ONLY_NOTE} ({told}): {st.label} is a {kind}, which holds none; --what all against "
        "another DCP checkpoint compares them"
    ]


def _training_state_note(a: Side, b: Side, opts: DiffOptions) -> list[str]:
    """A note naming the training-state items of a DCP side (``train_state``, ``lr_scheduler``, a data loader's
    state: the catalog's ``training_state``) that were left out, so that "equal" is not read as "resumes the same":
    with ``what`` model or optimizer, and with ``what`` all where the other side is a safetensors or PEFT input."""
    mixed = a.kind != b.kind
    if opts.what == "all" and not mixed:
        return []
    held = [sorted(side.ckpt.catalog.training_state) if side.kind == "dcp" else [] for side in (a, b)]
    if not any(held):
        return []

    def shown(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    if held[0] == held[1]:
        told = f"A and B each hold {shown(held[0])}"
    else:
        told = "; ".join(f"{side.label} holds {shown(h)}" for side, h in zip((a, b), held, strict=True) if h)
    if not mixed:
        return [f"{TRAINING_STATE_NOTE} ({told}): --what all compares them"]
    other = b if a.kind == "dcp" else a
    return [f"{TRAINING_STATE_NOTE} ({told}): {other.label} holds none to compare them with"]


def _one_file(side: Side) -> str | None:
    """The one ``.safetensors`` file a safetensors side reads: the file given, or a folder's only one (``diff DIR
    DIR/model.safetensors`` reads one file twice); ``None`` for a DCP side or a folder of several."""
    if side.only_file is not None or side.kind == "dcp":
        return side.only_file
    files = sorted(Path(side.reader.path).glob("*.safetensors"))
    return files[0].name if len(files) == 1 else None


def _newer_incomplete_notes(a: Side, b: Side) -> list[str]:
    """A note per side opened below a run root whose newer step's save did not finish (validate's ``R001``): the
    step compared is not the run's newest."""
    out = []
    for side in (a, b):
        where = getattr(side.ckpt, "located", None)
        note = where.newer_incomplete_note("compared") if where is not None else None
        if note:
            out.append(f"{side.label}: {note}")
    return out


def _beside_notes(a: Side, b: Side, opts: DiffOptions) -> list[str]:
    """With ``what`` all of two DCP sides (or two safetensors folders): the files beside the checkpoints' items
    (``extra_state/``; an HF folder's ``config.json``) that are on one side only or differ (byte for byte), which
    no item comparison covers; a note each, so that "equal" does not hide them."""
    if opts.what != "all" or a.kind != b.kind or a.kind not in ("dcp", "safetensors") or a.only_file or b.only_file:
        return []
    fa, fb = _files_beside(a), _files_beside(b)
    if fa is None or fb is None:
        return _remote_beside_note(a, b, fa, fb)

    read = {**_read_in_part(b), **_read_in_part(a)}

    def shown(names: list[str]) -> str:
        names = [f"{n} (its {', '.join(read[n])} compared, the rest not)" if n in read else n for n in names]
        return ", ".join(names[:5]) + (f", ... (+{len(names) - 5} more)" if len(names) > 5 else "")

    out = []
    for label, names in (
        ("only in A", sorted(set(fa) - set(fb))),
        ("only in B", sorted(set(fb) - set(fa))),
        ("differ", sorted(n for n in set(fa) & set(fb) if fa[n] != fb[n])),
    ):
        if names:
            out.append(f"{BESIDE_NOTE}: {len(names)} {label} ({shown(names)})")
    return out


def _read_in_part(side: Side) -> dict[str, list[str]]:
    """The rank files of a per-rank side read in part (verl's ``extra_state_*_rank_0.pt``: its ``lr_scheduler`` an
    item, its ``rng`` none) -> the items read from each, which were compared: the rest of the file was not."""
    partial = set(getattr(getattr(side.ckpt.reader, "assembled", None), "partial", ()))
    out: dict[str, set[str]] = {}
    for (key, _), info in side.ckpt.metadata.storage.items():
        if info.relative_path in partial:
            out.setdefault(info.relative_path, set()).add(key.split(".", 1)[0])
    return {name: sorted(items) for name, items in out.items()}


def _cross_dtype_notes(stats: list[TensorStat], opts: DiffOptions) -> list[str]:
    """One note per pair of dtypes whose values were compared across them (``as_dtype``, a tolerance, a quantized
    weight dequantized): the tensors are not a ``dtype`` difference then, but the sides do not store them alike,
    which an "equal" verdict must not hide."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for t in stats:
        if t.a_dtype != t.b_dtype:
            pairs.setdefault((t.a_dtype, t.b_dtype), []).append(t.name)
    how = f"cast to {opts.as_dtype}" if opts.as_dtype else "within the tolerance"
    out = []
    for (da, db), names in pairs.items():
        shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3} more)" if len(names) > 3 else "")
        n = len(names)
        out.append(
            f"stored dtypes differ: {da} in A, {db} in B: {n} tensor{'s' if n != 1 else ''} ({shown}), "
            f"values compared {how}"
        )
    return out


def _dequantized(
    a: Side, items_a: list[Item], b: Side, items_b: list[Item], notes: list[str]
) -> tuple[list[Item], list[Item]]:
    """Quantized weights of either side as their dequantized values (:mod:`ckpttool.ops.diff.quantized`)."""
    from ckpttool.ops.diff.quantized import dequantize_items, note

    items_a, na = dequantize_items(a, items_a, notes)
    items_b, nb = dequantize_items(b, items_b, notes)
    line = note((na, nb))
    if line is not None:
        notes.append(line)
    return items_a, items_b


def _compare_pairs(
    a: Side,
    b: Side,
    pairs: list[tuple[Item, Item | None]],
    opts: DiffOptions,
    tally: _Tally,
    progress: ProgressFn | None,
    say: Callable[[str], None],
) -> None:
    """Compare every pair (an item without a partner is ``only_a``); progress in stored bytes of both sides."""
    total = sum(_item_bytes(a, ia) + _item_bytes(b, ib) for ia, ib in pairs if ib is not None)
    done = 0
    if progress is not None:
        progress(0, total)
    last_a = last_b = None
    for ia, ib in pairs:
        if ib is None:
            tally.add(Difference(ia.name, "only_a", f"{ia.name}: only in A{_stored_as(ia)}", ia.key, None))
            continue
        if last_a is not None and last_a != ia.key:
            a.drop_cache()
        if last_b is not None and last_b != ib.key:
            b.drop_cache()
        last_a, last_b = ia.key, ib.key
        a.hold(ia)
        b.hold(ib)
        tally.pair(*_compare_pair(ia.name, a, ia, b, ib, opts, say))
        done += _item_bytes(a, ia) + _item_bytes(b, ib)
        if progress is not None:
            progress(done, total)


def _compare_hyperparameters(a: Side, b: Side, opts: DiffOptions, tally: _Tally) -> list[str]:
    """The per-parameter param-group values of two DCP sides (those ``opts.filters`` keeps); a note naming those
    equal as values but stored as a tuple on one side and a list on the other."""
    if not (a.ckpt.catalog.param_groups or b.ckpt.catalog.param_groups):
        return []
    n_hyper, gd, retyped = _compare_groups(a, b, opts.filters)
    tally.compared += n_hyper
    tally.hypers += n_hyper
    tally.equal += n_hyper - sum(1 for d in gd if d.a_value is not None)
    for d in gd:
        tally.add(d)
    notes = []
    for how, what, why in (
        ("sequence", "a tuple on one side and a list on the other", "set_state_dict with full_state_dict=True gives "
         "back a list"),
        ("number", "an int on one side and a float on the other", "a config's 0 and 0.0"),
    ):  # fmt: skip
        names = [name for h, name in retyped if h == how]
        if names:
            shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3} more)" if len(names) > 3 else "")
            notes.append(
                f"{len(names)} hyperparameter{'s' if len(names) != 1 else ''} equal as values but {what} ({shown}): "
                f"torch's optimizers step alike with either ({why})"
            )
    return notes


#: Difference kinds that are a verdict on a name both sides hold.
_COMMON_KINDS = frozenset({"values", "shape", "dtype", "object", "hyperparameter"})


def _fail_closed(
    a: Side,
    b: Side,
    opts: DiffOptions,
    tally: _Tally,
    seen: tuple[int, int],
    kept: tuple[int, int],
    common: int,
    excluded: list[Excluded],
    bare: str | None = None,
) -> None:
    """Refuse a result that compared no tensor value nor hyperparameter and found no difference on a common name.

    Names on one side only are a finding when some name is common (byte items), not when none is
    (a naming mismatch: nothing was compared).

    Raises:
        NothingComparedError: what each side holds, and why nothing was compared.
    """
    if tally.values > 0 or tally.hypers > 0 or any(d.kind in _COMMON_KINDS for d in tally.diffs):
        return  # hyperparameters compared (`--filter '*.lr'`) are values read and understood: a verdict
    if common > 0 and tally.count > 0:
        return  # names on one side only beside common byte items: a finding (exit 1), not a naming mismatch
    held = f"A holds {_holdings(a)}; B holds {_holdings(b)}"
    if seen == (0, 0):
        why = f"neither side has {_what_words(opts.what)}"
        hint = _no_tensor_hint(a, b, opts)
    elif kept == (0, 0):
        why = f"`filters` {' '.join(opts.filters)} matched none of the {seen[0]} names of A and {seen[1]} of B"
        hint = _nothing_kept_hint(a, b, opts, bare)
    elif common == 0:
        why, hint = _no_common_name(a, b, opts, seen, kept, excluded)
    elif tally.stats and all(0 in st.shape for st in tally.stats):  # every tensor compared empty: no value to compare
        empty = tally.stats[0]
        items = common - len(tally.stats)
        why = (
            f"{common} name(s) in common, {len(tally.stats)} of them tensors with no element (e.g. {empty.name!r} "
            f"{list(empty.shape)}: the same shape and dtype on both sides, no value to compare)"
            + (f", {items} byte item(s) (equal as stored bytes)" if items > 0 else "")
        )
        hint = (
            "the tensors compared hold 0 elements: the checkpoint is empty or damaged (a dimension saved as 0); "
            "`ckpttool inspect` shows the shapes"
        )
    else:
        why = f"{common} name(s) in common, byte items only (equal as stored bytes), no tensor"
        hint = (
            "the tensors pickled inside byte items (as DefaultSavePlanner(flatten_state_dict=False) saves) are not "
            "compared value by value: re-save with the default planner to compare them"
        )
    raise NothingComparedError(f"nothing compared, so no verdict: {why}; {held}", hint=hint)


def _no_tensor_hint(a: Side, b: Side, opts: DiffOptions) -> str:
    """The E611 hint where neither side has what ``what`` asks for: the optimizer state ``what`` model leaves out, a
    key schema not recognised, a state pickled into byte items, or the kind of checkpoint to pass."""
    held = [s.label for s in (a, b) if s.kind == "dcp" and s.ckpt.catalog.optimizer_state]
    if opts.what == "model" and held:
        return (
            f"{' and '.join(held)} {'hold' if len(held) > 1 else 'holds'} optimizer state only, which `what` model "
            "leaves out: compare it with `what` optimizer (or `what` all)"
        )
    state_only = [s for s in (a, b) if _training_state_only(s)]
    if opts.what != "all" and state_only:
        items = sorted({i for s in state_only for i in s.ckpt.catalog.training_state})
        return (
            f"{' and '.join(s.label for s in state_only)} {'hold' if len(state_only) > 1 else 'holds'} training state "
            f"only ({', '.join(items[:3])}), which `what` {opts.what} leaves out: compare it with `what` all"
        )
    unknown = [s for s in (a, b) if s.kind == "dcp" and s.ckpt.catalog.schema.id == "unrecognized"]
    if unknown and any(s.tensor_keys() for s in unknown):
        side = unknown[0]
        return (
            f"the key schema of {side.label} is not recognised (keys like "
            + ", ".join(repr(k) for k in side.tensor_keys()[:2])
            + "): name it with `schema`, `model_prefix` and `optimizer_prefix` (`ckpttool inspect` shows the keys)"
        )
    if any(_byte_items(s) for s in (a, b)):
        return (
            "a state pickled into byte items (as DefaultSavePlanner(flatten_state_dict=False) saves) has no "
            "tensors to compare: re-save with the default planner, or compare byte items with `what` all"
            if opts.what != "all"
            else "a state pickled into byte items (as DefaultSavePlanner(flatten_state_dict=False) saves) has no "
            "tensors to compare value by value: re-save it with the default planner"
        )
    if opts.what == "optimizer":
        return "pass checkpoints that hold optimizer state, or compare the models with `what` model"
    return "pass checkpoints that hold model tensors (`ckpttool inspect` shows what each holds)"


def _training_state_only(side: Side) -> bool:
    """A DCP side whose every item is training state (``train_state``, ``lr_scheduler``, ``dataloader``: a
    trainer's save of its loop state alone), which only ``what`` all compares."""
    if side.kind != "dcp":
        return False
    cat = side.ckpt.catalog
    keys = list(side.ckpt.metadata.entries)
    return bool(keys) and all(cat.category(k) == "training_state" for k in keys)


def _nothing_kept_hint(a: Side, b: Side, opts: DiffOptions, bare: str | None = None) -> str:
    """The E611 hint where ``filters`` kept no name: the optimizer state it matches, else ``bare`` (a wildcard-free
    filter's wider glob, see :func:`_bare_filter_hint`), else the optimizer state that wider glob matches, else what
    names look like."""
    wide = _wider(opts.filters)
    return (
        _optimizer_filter_hint(a, b, opts)
        or bare
        or (_optimizer_filter_hint(a, b, opts, wide) if wide else None)
        or ("names look like " + ", ".join(repr(n) for n in _examples(a, b)) + "; `ckpttool inspect` lists them")
    )


def _wider(globs: tuple[str, ...]) -> tuple[str, ...] | None:
    """``('*word*',)`` for a single ``--filter`` without a wildcard (a glob matches whole names), else ``None``."""
    if len(globs) != 1 or any(c in globs[0] for c in "*?["):
        return None
    return (f"*{globs[0]}*",)


def _bare_filter_hint(globs: tuple[str, ...], items: list[Item]) -> str | None:
    """:func:`bare_glob_hint` of a single wildcard-free ``--filter`` over A's names before filtering."""
    if len(globs) != 1:
        return None
    return bare_glob_hint(globs[0], lambda g: sum(_matches((g,), i.name, i.key) for i in items), "name")


def _optimizer_filter_hint(a: Side, b: Side, opts: DiffOptions, globs: tuple[str, ...] | None = None) -> str | None:
    """The E611 hint where ``globs`` (default ``opts.filters``) matched no model name but names of a DCP side's
    optimizer state (its state fields, its param groups' items), which ``what`` model leaves out; ``None``
    otherwise."""
    if opts.what != "model":
        return None
    globs = opts.filters if globs is None else globs
    for side in (a, b):
        if side.kind != "dcp":
            continue
        cat = side.ckpt.catalog
        names = [
            name
            for fqn, ps in cat.optimizer_state.items()
            for fld in ps.fields
            for name in (canonical_state_key(fqn, fld), cat.state_key(fqn, fld))
        ]
        names += [k for g in cat.param_groups for k in g.keys.values()]
        hit = next((n for n in names if _matches(globs, n)), None)
        if hit is None:
            continue
        found = f"`filters` {' '.join(globs)} matches names of the optimizer state (e.g. {hit!r} of {side.label})"
        if globs != opts.filters:  # the wider glob of a wildcard-free filter
            found = (
                f"a glob matches whole keys and {opts.filters[0]!r} has no wildcard, so it names one whole key; "
                f"{shell_arg(globs[0])} matches names of the optimizer state (e.g. {hit!r} of {side.label})"
            )
        if a.kind != b.kind:
            return f"{found}, which a safetensors side does not hold: compare it against another DCP checkpoint"
        return f"{found}, which `what` model leaves out: pass `what` optimizer (or `what` all)"
    return None


def _no_common_name(
    a: Side, b: Side, opts: DiffOptions, seen: tuple[int, int], kept: tuple[int, int], excluded: list[Excluded]
) -> tuple[str, str]:
    """What E611 says when no name is common: the counts, a side the mapping left out whole, and the fix."""
    left_out = _all_left_out(seen, excluded)
    why = f"no name in common ({kept[0]} in A, {kept[1]} in B){left_out}"
    if left_out and opts.map_rules is not None:
        bare = "A" if seen[0] == 0 else "B"
        return (
            why,
            f"the rules of `map_rules` ({opts.map_rules}) leave out every key of {bare}: check their `to: null` rules",
        )
    optimizer_only = [
        s for s, n in zip((a, b), seen, strict=True) if n == 0 and s.kind == "dcp" and s.ckpt.catalog.optimizer_state
    ]
    if opts.what == "model" and optimizer_only:
        side = optimizer_only[0]
        return (
            why,
            f"{side.label} holds optimizer state and no model tensor, which `what` model compares: pass the checkpoint "
            f"that holds the model as {side.label}, or compare the optimizer state with `what` optimizer",
        )
    pickled = next((s for s in (a, b) if s.kind == "dcp" and not s.tensor_keys() and _byte_items(s)), None)
    if pickled is not None:
        return (
            why,
            f"{pickled.label} holds no tensor, its state pickled into byte items (as "
            "DefaultSavePlanner(flatten_state_dict=False) saves), whose tensors are not compared value by value: "
            "re-save it with the default planner",
        )
    keying = _keying_mismatch(a, b)
    if keying is not None and opts.what != "model":
        return (
            why,
            f"{keying}: re-save the index-keyed one with get_state_dict (torch.distributed.checkpoint.state_dict)",
        )
    return why, _no_common_name_hint(a, b, kept, opts)


def _optimizer_changed(a: Side, b: Side) -> str | None:
    """Where the two DCP sides' optimizer state was saved by different optimizers (``inspect``'s ``saved_by``: the
    state fields and param groups then differ by design, not by damage): the line that says so; else ``None``.

    Only the optimizers a side's state is told to be saved by count: a parameter whose fields fit no known
    optimizer (``unknown``: a moment missing, a foreign field) is a difference of its own, never a second
    optimizer that would excuse it (AdamW on both sides with one ``exp_avg`` missing in B gets no such line)."""
    said = {s.label: saved_by_counts(s.ckpt.catalog) for s in (a, b)}
    known = {k: {n: c for n, c in v.items() if n != "unknown"} for k, v in said.items()}
    if not known["A"] or not known["B"] or known["A"].keys() == known["B"].keys():
        return None
    stray = [
        f"{said[k]['unknown']} parameter{'s' * (said[k]['unknown'] != 1)} of {k}" for k in "AB" if "unknown" in said[k]
    ]
    return (
        f"A's optimizer state was saved by {_optimizers(known['A'])}, B's by {_optimizers(known['B'])}: their state "
        "fields and param groups differ by design"
        + (f" (the state of {' and '.join(stray)} fits no known optimizer: not by design)" if stray else "")
    )


def _optimizers(counts: dict[str, int]) -> str:
    return next(iter(counts)) if len(counts) == 1 else ", ".join(f"{k} ({n})" for k, n in counts.items())


def _keying_mismatch(a: Side, b: Side) -> str | None:
    """Where one DCP side keys its optimizer state by parameter index (a plain ``optimizer.state_dict()``, which no
    command maps to parameters: design.md §2) and the other by parameter name: what says so; else ``None``."""
    if a.kind != "dcp" or b.kind != "dcp":
        return None
    keying = {s.label: s.ckpt.catalog.schema.optimizer_keying for s in (a, b)}
    if {keying["A"], keying["B"]} != {"index", "fqn"}:
        return None
    by_index = "A" if keying["A"] == "index" else "B"
    return (
        f"{by_index}'s optimizer state is keyed by parameter index (a plain optimizer.state_dict()), "
        f"{'B' if by_index == 'A' else 'A'}'s by parameter name"
    )


def _all_left_out(seen: tuple[int, int], excluded: list[Excluded]) -> str:
    """``; every key of A was left out (6 skipped by a key rule)``: a side whose every key the mapping (``map_rules``,
    an adapter) left out, which the E611 line must say (the ``not compared`` lines of the result are never printed)."""
    out = ""
    for label, n in zip("AB", seen, strict=True):
        reasons: dict[str, int] = {}
        for e in excluded:
            if e.side == label:
                reasons[e.reason] = reasons.get(e.reason, 0) + 1
        if n == 0 and reasons:
            out += f"; every key of {label} was left out (" + ", ".join(f"{c} {r}" for r, c in reasons.items()) + ")"
    return out


def _no_common_name_hint(a: Side, b: Side, kept: tuple[int, int], opts: DiffOptions) -> str:
    """The hint of E611 when no name is common: ``filters`` that kept one side's names only, else a naming mismatch."""
    if opts.filters and 0 in kept:
        none, some = (b, a) if kept[1] == 0 else (a, b)
        return (
            f"`filters` {' '.join(opts.filters)} kept names of {some.label} only: {none.label} holds no name matching "
            f"it ({none.label}'s names look like " + ", ".join(repr(n) for n in _examples(none)) + "); widen the "
            f"filter, or check that {none.label} holds those tensors (an export written with a filter holds only its "
            "part)"
        )
    empty = [s for s in (a, b) if not s.tensor_keys()]  # a side of no tensor at all: no naming to tell apart
    if len(empty) == 1:
        none, some = empty[0], (b if empty[0] is a else a)
        return (
            f"{none.label} holds no tensor at all, none to pair with {some.label}'s ("
            + ", ".join(repr(n) for n in _examples(some))
            + (", ..." if len(some.tensor_keys()) > 2 else "")
            + f"): an empty save, or not the checkpoint meant (`ckpttool inspect {shell_arg(none.path)}` shows "
            "what it holds)"
        )
    names = (
        "A's names look like "
        + ", ".join(repr(n) for n in _examples(a))
        + ", B's like "
        + ", ".join(repr(n) for n in _examples(b))
    )
    if "dcp" in (a.kind, b.kind) and a.kind != b.kind:
        return names + "; for an export with other names pass its rules (`map_rules`) or a model adapter (`adapter`)"
    # the mapping names a DCP checkpoint's keys as a safetensors side's: between two sides of one kind it is unused
    unused = "(`map_rules` and `adapter` name a DCP checkpoint's keys as a safetensors side's)"
    if a.kind != "dcp":
        kinds = f"two {a.kind}" if a.kind == b.kind else f"{a.kind} and {b.kind}"
        return f"{names}: {kinds} inputs are compared by their own names {unused}"
    return (
        f"{names}: two DCP checkpoints are compared by their own keys {unused}; to compare across namings, export one "
        "(`ckpttool export`) and compare the other against that export, naming it with `adapter` or `map_rules`"
    )


def _byte_items(side: Side) -> list[str]:
    md = side.ckpt.metadata
    return [k for k, m in md.entries.items() if not isinstance(m, TensorMeta)]


def _holdings(side: Side) -> str:
    n_t = len(side.tensor_keys())
    byte_items = _byte_items(side)
    shown = ", ".join(repr(k) for k in byte_items[:3]) + (", ..." if len(byte_items) > 3 else "")
    out = f"{n_t} tensor{'s' if n_t != 1 else ''}"
    if byte_items:
        out += f" and {len(byte_items)} byte item{'s' if len(byte_items) != 1 else ''} ({shown})"
    return out


def _what_words(what: str) -> str:
    return {"model": "model tensors", "optimizer": "optimizer state", "all": "tensors or byte items"}[what]


def _examples(*sides: Side) -> list[str]:
    """Two names of each side, as a hint shows them (:func:`~ckpttool.errors.short_key`: a long key by its ends)."""
    out: list[str] = []
    for s in sides:
        out.extend(short for short in map(short_key, sorted(s.tensor_keys())[:2]) if short not in out)
    return out
