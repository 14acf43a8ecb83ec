"""Export planning: which checkpoint tensors become which output tensors, in which dtype and file.

Pure functions over the :class:`~ckpttool.model.catalog.Catalog` (metadata only; no tensor
data is read here). The executor (:mod:`ckpttool.ops.export.execute`) reads each
:class:`SourceTask`'s chunks once and writes its :class:`Piece` s.

Shapes: a fused expert tensor ``w_EAB`` ``[E, A, B]`` split into ``n`` parts gives
``E * n`` pieces ``[A / n, B]``: piece ``(j, p)`` is ``w_EAB[order[j], p*A/n:(p+1)*A/n, :]``
where ``order[j]`` is the stored position of true expert ``j`` (identity except for
legacy EP layouts, ``docs/layouts.md``).
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from dataclasses import dataclass, field

from ckpttool.errors import ExportError, ExportNamingError, UsageError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, FLOATING_DTYPES
from ckpttool.format.safetensors import HeaderEntry, is_narrowing
from ckpttool.model.adapters import AdapterConfig, HFTensor, ModelAdapter, Skip, rope_to_hf_rows
from ckpttool.model.catalog import Catalog, TensorEntry, match_filter
from ckpttool.model.schemas.base import CANONICAL_MODEL_PREFIX, canonical_model_key
from ckpttool.model.wrappers import strip_wrapper_segments
from ckpttool.ops.export.rules import ExportRules
from ckpttool.ops.export.transform import Run

__all__ = [
    "SAVE_DTYPES",
    "Selected",
    "Piece",
    "SourceTask",
    "ExportPlan",
    "select_sources",
    "build_plan",
    "shard_file_names",
    "check_exportable_names",
    "unaccounted_tensors",
    "SKIP_TRAINING_STATE",
    "SKIP_OUTSIDE_SCHEMA",
]

SAVE_DTYPES = ("preserve", "bfloat16", "float16", "float32")


def shard_file_names(n: int, stem: str = "model") -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000K-of-0000N.safetensors`` (HF naming)."""
    if n == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


@dataclass(frozen=True)
class LoraPair:
    """The LoRA factors merged into a base weight (``hf-merged``): ``W + (alpha / r) * B @ A``.

    Attributes:
        a_key, b_key: checkpoint keys of ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``.
        module: the module path (``model.layers.0.self_attn.q_proj``), for ``rank_pattern`` / ``alpha_pattern``.
        adapter: the PEFT adapter name (``default``).
    """

    a_key: str
    b_key: str
    module: str
    adapter: str


#: The per-tensor plan classes (``Selected``, ``Piece``, ``SourceTask``) are slots dataclasses,
#: not frozen: 10^6 tensors build 3 x 10^6 of them, and a frozen one costs ~5x more to build
#: (one ``object.__setattr__`` call per field). Treat them as values all the same: nothing
#: assigns their fields after construction; ``unsafe_hash`` keeps them hashable by value.
@dataclass(slots=True, unsafe_hash=True)
class Selected:
    """A model tensor chosen for export.

    Attributes:
        model_key: the checkpoint key of the model tensor it stands for.
        out_key: its output key (before any expert split).
        source: the tensor entry read (the parameter, or its ``master_weight``).
        origin: ``"params"`` or ``"master"``.
        hf: where a model adapter puts it (``None``: the key rules' output key, as stored).
    """

    model_key: str
    out_key: str
    source: TensorEntry
    origin: str
    hf: HFTensor | None = None
    merge: LoraPair | None = None


@dataclass(slots=True, unsafe_hash=True)
class Piece:
    """One output tensor cut from a source: expert ``expert`` (true order), part ``part`` of ``nparts``.

    ``shared``: several sources write disjoint parts of it (an adapter's fused ``gate_up_proj``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    expert: int | None = None
    part: int = 0
    nparts: int = 1
    shared: bool = False


@dataclass(slots=True, unsafe_hash=True)
class SourceTask:
    """Read one source tensor (each chunk once) and write its pieces into shard ``shard``.

    Attributes:
        expert_order: stored position of true expert ``j`` along dim 0, when that
            is not the identity or when the tensor is split per expert.
        runs: an adapter's element moves (RoPE rows, fused halves, expert split), explicit;
            ``None``: derived from the pieces and ``expert_order``.
    """

    selected: Selected
    pieces: tuple[Piece, ...]
    shard: int
    expert_order: tuple[int, ...] | None = None
    runs: tuple[Run, ...] | None = None

    @property
    def source_key(self) -> str:
        return self.selected.source.key

    @property
    def direct(self) -> bool:
        """One piece equal to the stored tensor: chunks are read straight into the output file."""
        p = self.pieces[0]
        return (
            len(self.pieces) == 1
            and p.expert is None
            and self.expert_order is None
            and self.runs is None
            and self.selected.merge is None
            and p.dtype == self.selected.source.dtype
        )

    @property
    def out_nbytes(self) -> int:
        if self.runs is not None:
            return sum(r.length for r in self.runs) * DTYPE_ITEMSIZE[self.pieces[0].dtype]
        if len(self.pieces) == 1:
            return _nbytes(self.pieces[0].dtype, self.pieces[0].shape)
        return sum(_nbytes(p.dtype, p.shape) for p in self.pieces)


@dataclass
class ExportPlan:
    """Everything the executor needs, plus what the summary reports.

    Attributes:
        tasks: in write order.
        files: output file names; ``entries[k]`` are the tensors of ``files[k]``.
        warnings: one line each (keys renamed by a ``warn`` rule, skipped keys, ...).
        casts: ``"src->dst"`` -> number of tensors cast; ``narrowing``: the subset that loses precision or range.
        origins: ``"params"``/``"master"`` -> output keys taken from there.
        skipped: reason -> checkpoint keys not exported.
        tied: ``None`` (untied / no config), ``"omitted"`` or ``"absent"`` (see docs/export.md).
    """

    format: str
    tasks: list[SourceTask]
    files: list[str]
    entries: list[list[HeaderEntry]]
    warnings: list[str] = field(default_factory=list)
    casts: dict[str, int] = field(default_factory=dict)
    narrowing: dict[str, int] = field(default_factory=dict)
    origins: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    tied: str | None = None
    _file_bytes: tuple[tuple[int, int], list[int]] | None = field(default=None, repr=False, compare=False)

    def file_bytes(self) -> list[int]:
        """Bytes of each file's tensors (``files[k]``: the ``out_nbytes`` of its tasks), a new list.

        :func:`build_plan` records them as it packs; computed from the tasks again when ``tasks``
        was replaced or resized since.
        """
        sig = (id(self.tasks), len(self.tasks))
        if self._file_bytes is not None and self._file_bytes[0] == sig:
            return list(self._file_bytes[1])
        out = [0] * len(self.files)
        for t in self.tasks:
            out[t.shard] += t.out_nbytes
        self._file_bytes = (sig, out)
        return list(out)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes())

    @property
    def num_tensors(self) -> int:
        return sum(len(e) for e in self.entries)

    def weight_map(self) -> dict[str, str]:
        """Output key -> file name, sorted by key (``model.safetensors.index.json``)."""
        out = {}
        for k, ents in enumerate(self.entries):
            for e in ents:
                out[e.name] = self.files[k]
        return dict(sorted(out.items()))


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def _filtered(key: str, canonical: str, out_key: str, glob: str | None, prefix: str | None) -> bool:
    if not glob:
        return False
    return not (match_filter(key, glob, prefix) or match_filter(canonical, glob) or fnmatch.fnmatchcase(out_key, glob))


#: torchtitan's LoRA adapter tensors (``torchtitan/components/lora.py``: ``<linear>.lora_a`` / ``.lora_b``).
_TITAN_LORA_RE = re.compile(r"\.lora_[ab]\.weight$")

#: ``skipped`` reasons of tensors that are not model weights (``docs/export.md``).
SKIP_TRAINING_STATE = "training state (scheduler, data loader, step), not weights"
SKIP_OUTSIDE_SCHEMA = "outside the key schema (not model weights)"


def check_exportable_names(cat: Catalog, fmt: str, adapter: ModelAdapter | None = None) -> None:
    """Refuse model names that have no Hugging Face mapping.

    With ``adapter`` (given or detected) torchtitan names are mapped by it (``hf`` format).

    Raises:
        ExportNamingError (E603): torchtitan naming (``tok_embeddings.weight``,
            ``layers.N.attention.wq.weight``): HF names need torchtitan's state-dict adapter
            (split/fused projections, the RoPE row permutation of ``wq``/``wk``).
        ExportError (E601): no model tensor at all (nothing recognised, or an optimizer-only checkpoint).
    """
    sch = cat.schema
    if not cat.model:
        why = "; ".join(sch.reasons[:2])
        raise ExportError(
            f"{cat.path}: no model tensors to export ({why})",
            hint="pass the model checkpoint (or the folder holding model and optimizer); `ckpttool inspect` "
            "shows the keys, `model_prefix` says where the weights are",
        )
    if sch.naming == "torchtitan" and fmt in ("hf", "lora") and (adapter is None or fmt == "lora"):
        fqns = [cat.fqn_of(k) for k in list(cat.model)[:2]]
        raise ExportNamingError(
            f"{cat.path}: the model tensors have torchtitan names (e.g. {', '.join(repr(f) for f in fqns)}); "
            + (
                "no LoRA adapter export exists for torchtitan models"
                if fmt == "lora"
                else "no built-in model adapter fits them (the config's model_type names another family)"
            ),
            hint=(
                "merge the adapters into the weights in torchtitan and export the merged model with `fmt` hf"
                if fmt == "lora"
                else "choose one with `adapter` (torchtitan-llama3, torchtitan-qwen3) and pass the model's "
                "config.json with `model_assets`, or save with torchtitan's checkpoint.last_save_in_hf"
            ),
        )


def select_sources(
    cat: Catalog,
    rules: ExportRules,
    *,
    fmt: str = "hf",
    weights: str = "params",
    filter_glob: str | None = None,
    adapter: ModelAdapter | None = None,
    adapter_config: AdapterConfig | None = None,
) -> tuple[list[Selected], list[str], dict[str, list[str]], dict[str, str]]:
    """Choose the tensors to export and their output keys.

    Args:
        cat: the catalog.
        rules: key rules (``hf``) / LoRA pattern (``lora``).
        fmt: ``"hf"`` or ``"lora"``.
        weights: ``"params"`` or ``"master"`` (the FP32 ``master_weight`` where a
            parameter has one, like DeepSpeed's ``zero_to_fp32``).
        filter_glob: only checkpoint keys (with or without ``model.``) or output keys matching it.
        adapter: a model adapter mapping the fqns to HF names and layouts (``hf`` format; the key
            rules are then not used); keys it does not know are skipped and reported.
        adapter_config: the model dimensions the adapter needs (RoPE heads).

    Returns:
        ``(selected, warnings, skipped, adapter_names)``; ``adapter_names`` maps
        LoRA output keys to their adapter name (``lora`` only).

    Raises:
        ExportError: ``--weights master`` with no master weight in the checkpoint,
            a master whose shape differs from its parameter, or two keys mapping
            to one output key.
    """
    check_exportable_names(cat, fmt, adapter)
    if fmt == "hf-merged":
        return _select_merged(cat, rules, weights=weights, filter_glob=filter_glob)
    if fmt == "hf":
        peft = next((k for k in cat.model if ".lora_A." in k or ".lora_B." in k), None)
        if peft is not None:
            raise ExportError(
                f"{cat.path}: a PEFT LoRA checkpoint ({peft}); `fmt` hf would write base_layer / lora_A.<adapter> "
                "names that no Hugging Face class loads",
                fqn=peft,
                param="fmt",
                hint="export the adapter with `fmt` lora, or the merged model with `fmt` hf-merged (`merge_lora`)",
            )
    use_adapter = adapter is not None and fmt == "hf" and adapter.name != "hf"
    acfg = adapter_config or AdapterConfig()
    unknown: list[str] = []
    unwrapped: list[str] = []
    segments: set[str] = set()
    selected: list[Selected] = []
    warnings: list[str] = []
    skipped: dict[str, list[str]] = {}
    adapter_names: dict[str, str] = {}
    renamed: list[str] = []
    masters_found = 0
    prefix = cat.schema.model_prefix
    map_key = rules.key_mapper()
    any_hf = False
    is_lora, master = fmt == "lora", weights == "master"
    add = selected.append
    # 10^6 keys: the fqns come from the catalog's shared list (KeySchema.fqn_of of every model key, in order)
    for (key, entry), param_fqn in zip(cat.model.items(), cat.param_fqns):
        fqn = param_fqn
        canonical = CANONICAL_MODEL_PREFIX + fqn  # canonical_model_key: rules match the torch-native model.<fqn>
        # "module" / "_orig_mod" cannot straddle "model." and the fqn: the test strip_wrapper_segments starts with
        if "module" in fqn or "_orig_mod" in fqn:
            canonical, removed = strip_wrapper_segments(canonical)  # _orig_mod., module., ... anywhere
            if removed:
                unwrapped.append(key)
                segments.update(removed)
                fqn = strip_wrapper_segments(fqn)[0]
        if is_lora:
            hit = rules.lora_output_key(canonical)
            if hit is None:
                skipped.setdefault("not a LoRA adapter tensor", []).append(key)
                continue
            out_key, lora_name = hit
        elif use_adapter:
            assert adapter is not None
            conv = adapter.to_hf(fqn, entry.shape, acfg)
            if conv is None:
                unknown.append(key)
                skipped.setdefault(f"no key map of adapter {adapter.name}", []).append(key)
                continue
            if isinstance(conv, Skip):
                skipped.setdefault(conv.reason, []).append(key)
                continue
            out_key = conv.key
        else:
            out, matched, warn = map_key(canonical)
            if not matched:
                skipped.setdefault("no key rule matches", []).append(key)
                continue
            if out is None:
                skipped.setdefault("skipped by a key rule", []).append(key)
                continue
            out_key = out
            if warn:
                renamed.append(f"{key} -> {out_key}")
        if filter_glob and _filtered(key, canonical, out_key, filter_glob, prefix):
            skipped.setdefault("excluded by `filter_glob`", []).append(key)
            continue
        if is_lora:
            adapter_names[out_key] = lora_name
        source, origin = entry, "params"
        if master:
            ps = cat.optimizer_state.get(param_fqn)
            mw = ps.fields.get("master_weight") if ps is not None else None
            if mw is not None:
                if mw.shape != entry.shape:
                    raise ExportError(
                        f"{mw.key}: master_weight shape {list(mw.shape)} differs from the parameter's {list(entry.shape)}",
                        fqn=mw.key,
                        hint="the optimizer state does not belong to this model; export with `weights` params",
                    )
                source, origin = mw, "master"
                masters_found += 1
        if use_adapter and isinstance(conv, HFTensor):
            any_hf = True
            add(Selected(key, out_key, source, origin, conv))
        else:
            add(Selected(key, out_key, source, origin))
    if weights == "master" and masters_found == 0:
        raise ExportError(
            f"{cat.path}: `weights` master but no parameter has an optimizer.state.<fqn>.master_weight",
            hint="this checkpoint's optimizer keeps no FP32 masters (e.g. torch AdamW); export with `weights` params",
        )
    if unwrapped:
        shown = ", ".join(unwrapped[:3]) + (f" (+{len(unwrapped) - 3} more)" if len(unwrapped) > 3 else "")
        warnings.append(
            f"wrapper segment(s) {', '.join(sorted(segments))} removed from {len(unwrapped)} key(s): {shown}"
        )
    if unknown:
        assert adapter is not None
        lora = [k for k in unknown if _TITAN_LORA_RE.search(k)]
        if lora and filter_glob is None:
            raise ExportNamingError(
                f"{cat.path}: {len(lora)} torchtitan LoRA adapter tensor(s) (e.g. {lora[0]!r}) have no HF mapping; "
                "the export would write the base weights without the fine-tune",
                fqn=lora[0],
                hint="merge the LoRA adapters into the weights in torchtitan before saving, or export the base "
                "model on purpose with `filter_glob` selecting its other keys",
            )
        shown = ", ".join(unknown[:3]) + (f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else "")
        warnings.append(f"{len(unknown)} model tensor(s) unknown to adapter {adapter.name} are not exported: {shown}")
    if renamed:
        shown = ", ".join(renamed[:5]) + (f" (+{len(renamed) - 5} more)" if len(renamed) > 5 else "")
        warnings.append(f"{len(renamed)} key(s) outside the HF naming were exported as their fqn: {shown}")
    for key in cat.other_tensors:
        reason = SKIP_TRAINING_STATE if cat.category(key) == "training_state" else SKIP_OUTSIDE_SCHEMA
        skipped.setdefault(reason, []).append(key)
    outside = skipped.get(SKIP_OUTSIDE_SCHEMA)
    if outside:
        shown = ", ".join(outside[:3]) + (f" (+{len(outside) - 3} more)" if len(outside) > 3 else "")
        warnings.append(f"{len(outside)} tensor(s) outside the {cat.schema.id} key schema are not exported: {shown}")
    if not any_hf and len({s.out_key for s in selected}) == len(selected):
        # every output key unique, no fused parts: nothing below raises
        return selected, warnings, skipped, adapter_names
    seen: dict[str, str] = {}
    for s in selected:
        ident = s.out_key if s.hf is None or s.hf.nparts == 1 else f"{s.out_key} (part {s.hf.part})"
        if ident in seen:
            raise ExportError(
                f"{seen[ident]} and {s.model_key} both map to the output key {ident!r}",
                fqn=s.model_key,
                hint="fix the key rules (`rules`) so every output key is unique",
            )
        seen[ident] = s.model_key
    fused: dict[str, set[int]] = {}
    for s in selected:
        if s.hf is not None and s.hf.nparts > 1:
            fused.setdefault(s.out_key, set()).add(s.hf.part)
    for key, parts in fused.items():
        n = next(s.hf.nparts for s in selected if s.hf is not None and s.out_key == key)
        if len(parts) != n:
            have = next(s.model_key for s in selected if s.out_key == key)
            raise ExportError(
                f"{key}: fused from {n} source tensors but only {have} is exported (parts {sorted(parts)} of {n})",
                fqn=have,
                hint="export every part (check `filter_glob`), or use `experts` per-expert",
            )
    return selected, warnings, skipped, adapter_names


_PEFT_RE = re.compile(
    r"^model\.(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector)\.(?P<adapter>[^.]+)(?:\.weight)?$"
)
_PEFT_BASE = canonical_model_key("base_model.model.")


def _select_merged(
    cat: Catalog, rules: ExportRules, *, weights: str, filter_glob: str | None
) -> tuple[list[Selected], list[str], dict[str, list[str]], dict[str, str]]:
    """Selection of a merged-LoRA export: base weights named as the plain model, each with its LoRA pair.

    ``model.base_model.model.<m>.base_layer.weight`` -> ``<m>.weight`` (merged), other
    ``model.base_model.model.<x>`` -> ``<x>``; ``modules_to_save.<adapter>.`` copies replace their
    ``original_module.`` (as ``merge_and_unload``); the LoRA factors are read, not written.

    Raises:
        ExportError: DoRA (``lora_magnitude_vector``), LoRA on embeddings, several adapters, a
            ``lora_A`` without its ``lora_B`` / base weight, or no LoRA tensor at all.
    """
    pairs: dict[str, dict[str, str]] = {}
    names: set[str] = set()
    for key in cat.model:
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        m = _PEFT_RE.match(canonical)
        if m is None:
            continue
        part = m["part"]
        if part == "lora_magnitude_vector":
            raise ExportError(
                f"{key}: DoRA (lora_magnitude_vector); the merge of weight-decomposed LoRA is not implemented",
                fqn=key,
                hint="merge with PEFT's merge_and_unload(), or export the adapter with `fmt` lora",
            )
        if part.startswith("lora_embedding"):
            raise ExportError(
                f"{key}: LoRA on an embedding; its merge is not implemented",
                fqn=key,
                hint="export the adapter with `fmt` lora",
            )
        names.add(m["adapter"])
        pairs.setdefault(m["module"], {})[part] = key
    if not pairs:
        raise ExportError(
            f"{cat.path}: no LoRA tensor (lora_A / lora_B) to merge",
            hint="`fmt` hf-merged merges a PEFT LoRA checkpoint; export a plain model with `fmt` hf",
        )
    if len(names) > 1:
        raise ExportError(
            f"{cat.path}: the checkpoint holds several LoRA adapters {sorted(names)}; which to merge is ambiguous",
            hint="merge one of them with PEFT, or export each with `fmt` lora and `filter_glob`",
        )
    adapter = next(iter(names))
    sub: dict[str, Selected] = {}
    selected: list[Selected] = []
    warnings: list[str] = []
    skipped: dict[str, list[str]] = {}
    used: set[str] = set()
    for key, entry in cat.model.items():
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        if _PEFT_RE.match(canonical):
            skipped.setdefault("LoRA factor merged into its base weight", []).append(key)
            continue
        plain = canonical_model_key(canonical[len(_PEFT_BASE) :]) if canonical.startswith(_PEFT_BASE) else canonical
        if ".original_module." in plain:
            skipped.setdefault("replaced by its modules_to_save copy", []).append(key)
            continue
        plain = re.sub(r"\.modules_to_save\.[^.]+\.", ".", plain)
        module = None
        if ".base_layer." in plain:
            module, _, tail = plain.partition(".base_layer.")
            plain = f"{module}.{tail}"
            module = module[len(CANONICAL_MODEL_PREFIX) :]
        out, matched, _ = rules.map_key(plain)
        if not matched or out is None:
            skipped.setdefault("no key rule matches" if not matched else "skipped by a key rule", []).append(key)
            continue
        if _filtered(key, plain, out, filter_glob, cat.schema.model_prefix):
            skipped.setdefault("excluded by `filter_glob`", []).append(key)
            continue
        merge = None
        if module is not None and plain.endswith(".weight"):
            p = pairs.get(module, {})
            if "lora_A" in p and "lora_B" in p:
                merge = LoraPair(p["lora_A"], p["lora_B"], module, adapter)
                used.add(module)
        sel = Selected(key, out, entry, "params", merge=merge)
        if out in sub:
            raise ExportError(
                f"{sub[out].model_key} and {key} both map to the output key {out!r}",
                fqn=key,
                hint="fix the key rules (`rules`) so every output key is unique",
            )
        sub[out] = sel
        selected.append(sel)
    orphan = sorted(set(pairs) - used)
    if orphan and not filter_glob:
        raise ExportError(
            f"{len(orphan)} LoRA module(s) have no base weight (or lack lora_A / lora_B) to merge into: {orphan[0]}",
            fqn=orphan[0],
            hint="the checkpoint is an adapter only; export it with `fmt` lora and merge with PEFT over the base model",
        )
    if weights == "master":
        raise ExportError("`weights` master is not supported with `fmt` hf-merged", param="weights")
    for key in cat.other_tensors:
        reason = SKIP_TRAINING_STATE if cat.category(key) == "training_state" else SKIP_OUTSIDE_SCHEMA
        skipped.setdefault(reason, []).append(key)
    return selected, warnings, skipped, {}


def _out_dtype(src: str, save_dtype: str) -> str:
    if save_dtype == "preserve" or src not in FLOATING_DTYPES:
        return src
    return save_dtype


def build_plan(
    selected: list[Selected],
    rules: ExportRules,
    *,
    fmt: str = "hf",
    save_dtype: str = "preserve",
    shard_size: int = 5 * 10**9,
    experts: str = "fused",
    expert_orders: dict[str, tuple[int, ...]] | None = None,
    num_experts: int | None = None,
    drop: set[str] | None = None,
) -> ExportPlan:
    """Turn the selection into tasks, pieces and output files.

    Args:
        selected: from :func:`select_sources`.
        rules: for the expert split rules.
        fmt: ``"hf"`` (sharded ``model*.safetensors``) or ``"lora"`` (``adapter_model.safetensors``).
        save_dtype: ``preserve`` or a floating dtype applied to floating tensors only.
        shard_size: maximum bytes per output file (a larger single source gets a file of its own).
        experts: ``"fused"`` or ``"per-expert"``.
        expert_orders: model key -> stored position of each true expert (legacy EP un-permutation).
        num_experts: expected expert count (``--model-assets`` config), checked against dim 0.
        drop: output keys to leave out (a tied ``lm_head.weight``).

    Raises:
        UsageError: unknown ``save_dtype`` / ``experts``.
        ExportError: a fused expert tensor whose dims do not fit the split or the expert count.
    """
    if save_dtype not in SAVE_DTYPES:
        raise UsageError(f"`save_dtype` {save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}", param="save_dtype")
    if experts not in ("fused", "per-expert"):
        raise UsageError(f"`experts` {experts!r} is not one of fused, per-expert", param="experts")
    orders = expert_orders or {}
    drop = drop or set()
    casts: Counter[str] = Counter()
    narrowing: Counter[str] = Counter()
    origins: dict[str, list[str]] = {}
    # Greedy packing in source order; a source's pieces stay in one file (read once). Packing raises
    # nothing, so it runs in this loop (the errors below come in the same order as without it).
    tasks: list[SourceTask] = []
    add_task = tasks.append
    sizes: list[int] = []  # packed bytes of each file
    file_bytes: list[int] = []  # bytes its tasks write (the fused pieces' halves each count)
    shared_at: dict[str, int] = {}  # a shared (fused) piece's file: every source of it writes there
    preserve = save_dtype == "preserve"
    per_expert = experts == "per-expert"
    packed = fmt != "lora"
    runs: tuple[Run, ...] | None
    for s in selected:
        if drop and s.out_key in drop:
            continue
        src = s.source
        src_dtype = src.dtype
        dtype = src_dtype if preserve or src_dtype not in FLOATING_DTYPES else save_dtype  # _out_dtype
        order = orders.get(s.model_key) if orders else None
        pieces: tuple[Piece, ...]
        if s.hf is not None:
            pieces, runs = adapter_pieces(s, s.hf, dtype, experts, order, num_experts)
            counted = [p.name for p in pieces if not p.shared or s.hf.part == 0]  # a fused tensor counts once
            if dtype != src_dtype:
                tag = f"{src_dtype}->{dtype}"
                casts[tag] += len(counted)
                if is_narrowing(src_dtype, dtype):
                    narrowing[tag] += len(counted)
            origins.setdefault(s.origin, []).extend(counted)
            order = None
        else:
            runs = None
            shape = src.shape
            # the rule matters for [E, A, B] tensors, and for any shape with per-expert (which refuses other shapes)
            wanted = fmt == "hf" and (per_expert or len(shape) == 3)
            rule = rules.expert_rule(s.out_key) if wanted else None
            if rule is not None and len(shape) == 3:
                e = shape[0]
                if num_experts is not None and e != num_experts:
                    raise ExportError(
                        f"{s.model_key}: expert dim 0 has {e} experts but the model config says num_experts={num_experts}",
                        fqn=s.model_key,
                        hint="pass the `model_assets` of the model this checkpoint was trained as",
                    )
                assert order is None or len(order) == e, "expert_orders gives one entry per expert"
            if per_expert and rule is not None:
                if len(shape) != 3:
                    raise ExportError(
                        f"{s.model_key}: matches the fused expert rule but has shape {list(shape)}, not [E, A, B]",
                        fqn=s.model_key,
                        hint="fix the experts rules (`rules`) or export with `experts` fused",
                    )
                e, a, b = shape
                if e == 0:
                    raise ExportError(
                        f"{s.model_key}: has shape {list(shape)}: 0 experts, nothing to write per expert",
                        fqn=s.model_key,
                        hint="export with `experts` fused (writes the empty tensor), or leave it out with `filter_glob`",
                    )
                n = len(rule.parts)
                if a % n:
                    raise ExportError(
                        f"{s.model_key}: dim 1 ({a}) cannot be split into {n} equal parts {list(rule.parts)}",
                        fqn=s.model_key,
                        hint="the tensor is not a fused gate/up projection; fix the experts rules",
                    )
                names = rule.split_names(s.out_key, e)
                assert names is not None
                pieces = tuple(Piece(names[j][p], (a // n, b), dtype, j, p, n) for j in range(e) for p in range(n))
                if order is None:
                    order = tuple(range(e))
            else:
                pieces = (Piece(s.out_key, shape, dtype),)
            if order is not None and not per_expert and order == tuple(range(len(order))):
                order = None
            if dtype != src_dtype:
                tag = f"{src_dtype}->{dtype}"
                casts[tag] += len(pieces)
                if is_narrowing(src_dtype, dtype):
                    narrowing[tag] += len(pieces)
            listed = origins.get(s.origin)
            if listed is None:
                listed = origins[s.origin] = []
            if len(pieces) == 1:
                listed.append(pieces[0].name)
            else:
                listed.extend(p.name for p in pieces)
        first = pieces[0]
        nbytes = (
            _nbytes(first.dtype, first.shape) if len(pieces) == 1 else sum(_nbytes(p.dtype, p.shape) for p in pieces)
        )
        if first.shared and first.name in shared_at:
            k = shared_at[first.name]
        else:
            if not sizes or (packed and sizes[-1] > 0 and sizes[-1] + nbytes > shard_size):
                sizes.append(0)
                file_bytes.append(0)
            sizes[-1] += nbytes
            k = len(sizes) - 1
            if first.shared:
                shared_at[first.name] = k
        # what the task writes (SourceTask.out_nbytes): its runs' elements, else its pieces
        file_bytes[k] += nbytes if runs is None else sum(r.length for r in runs) * DTYPE_ITEMSIZE[first.dtype]
        add_task(SourceTask(s, pieces, k, order, runs))
    n_files = max(len(sizes), 1)
    files = ["adapter_model.safetensors"] if fmt == "lora" else shard_file_names(n_files)
    file_bytes = file_bytes or [0] * len(files)
    entries: list[list[HeaderEntry]] = [[] for _ in files]
    names_seen: set[str] = set()
    # the output names, after every check of the loop above (their errors come after those, as they always did)
    for t in tasks:
        pieces = t.pieces
        shard_entries = entries[t.shard]
        if len(pieces) == 1 and not pieces[0].shared:  # the loop below for one plain piece
            p = pieces[0]
            name = p.name
            if name in names_seen or not name.isascii():
                _check_name(t.selected, name, names_seen)  # raises, unless a non-ASCII name that is UTF-8 text
            names_seen.add(name)
            shard_entries.append(HeaderEntry(name, p.dtype, p.shape))
            continue
        for p in pieces:
            name = p.name
            if p.shared and name in names_seen:
                continue
            _check_name(t.selected, name, names_seen)
            names_seen.add(name)
            shard_entries.append(HeaderEntry(name, p.dtype, p.shape))
    plan = ExportPlan(fmt, tasks, files, entries, casts=dict(casts), narrowing=dict(narrowing), origins=origins)
    plan._file_bytes = ((id(tasks), len(tasks)), file_bytes)
    return plan


def _check_name(s: Selected, name: str, names_seen: set[str]) -> None:
    """Raise for an output key that is not UTF-8 text or is produced twice (the checks of :func:`build_plan`)."""
    try:
        if not name.isascii():
            name.encode("utf-8")
    except UnicodeEncodeError:
        raise ExportError(
            f"{s.model_key!a}: output key {name!a} is not valid UTF-8 text (safetensors stores names as UTF-8 JSON)",
            fqn=s.model_key,
            hint="leave it out with `filter_glob` or rename it with a `rules` entry",
        ) from None
    if name in names_seen:
        raise ExportError(
            f"{s.model_key}: output key {name!r} is produced twice",
            fqn=s.model_key,
            hint="fix the key/experts rules (`rules`) so every output key is unique",
        )


def adapter_pieces(
    s: Selected,
    hf: HFTensor,
    dtype: str,
    experts: str,
    order: tuple[int, ...] | None,
    num_experts: int | None,
) -> tuple[tuple[Piece, ...], tuple[Run, ...] | None]:
    """The output pieces and element runs of a source mapped by a model adapter.

    - RoPE q/k ``[n*hd, dim]``: one piece, one run per row (:func:`~ckpttool.model.adapters.rope_to_hf_rows`).
    - a fused half (``nparts`` 2) of ``[E, A, B]``: expert ``j``'s ``A*B`` elements go to
      ``[j, part*A:(part+1)*A, :]`` of the shared ``[E, 2A, B]`` piece, or (per-expert) to a piece ``[A, B]`` of its own.
    - an expert tensor ``[E, A, B]`` kept fused: as stored; per-expert: ``E`` pieces ``[A, B]``.
    - anything else: one piece as stored (``runs`` ``None``: a direct copy when the dtype is kept).

    Raises:
        ExportError: an expert dim that disagrees with the config's ``num_experts``.
    """
    shape = s.source.shape
    if hf.rope_heads is not None:
        rows, cols = shape
        dst = rope_to_hf_rows(hf.rope_heads, rows // hf.rope_heads)
        return (Piece(hf.key, hf.shape, dtype),), tuple(Run(r * cols, cols, 0, d * cols) for r, d in enumerate(dst))
    is_expert = hf.nparts > 1 or hf.per_expert is not None
    if not is_expert:
        return (Piece(hf.key, hf.shape, dtype),), None
    e, a, b = shape
    if num_experts is not None and e != num_experts:
        raise ExportError(
            f"{s.model_key}: expert dim 0 has {e} experts but the model config says num_experts={num_experts}",
            fqn=s.model_key,
            hint="pass the `model_assets` of the model this checkpoint was trained as",
        )
    stored = order if order is not None else tuple(range(e))
    slab = a * b
    if experts == "per-expert" and hf.per_expert is not None:
        pieces = tuple(Piece(hf.per_expert.format(j=j), (a, b), dtype, j) for j in range(e))
        return pieces, tuple(Run(stored[j] * slab, slab, j, 0) for j in range(e))
    if hf.nparts > 1:
        piece = Piece(hf.key, hf.shape, dtype, shared=True)
        return (piece,), tuple(Run(stored[j] * slab, slab, 0, (j * hf.nparts + hf.part) * slab) for j in range(e))
    if order is None:
        return (Piece(hf.key, hf.shape, dtype),), None
    return (Piece(hf.key, hf.shape, dtype),), tuple(Run(stored[j] * slab, slab, 0, j * slab) for j in range(e))


def unaccounted_tensors(cat: Catalog, plan: ExportPlan, dropped: set[str]) -> list[str]:
    """Non-optimizer tensors that the plan neither writes nor lists in ``skipped`` (should be none).

    Args:
        cat: the catalog.
        plan: the built plan (``skipped`` filled).
        dropped: checkpoint keys left out on purpose and reported elsewhere (a tied ``lm_head``).
    """
    written = {t.selected.model_key for t in plan.tasks}
    listed = {k for keys in plan.skipped.values() for k in keys}
    return [k for k in (*cat.model, *cat.other_tensors) if k not in written and k not in listed and k not in dropped]
