"""``collect_stats``: streaming statistics of one or more checkpoints of a run.

One pass over each checkpoint's data (chunks in parallel on the engine's pool, each byte read
once): per-tensor statistics of the model tensors and the optimizer state, sums per layer and
per module type, per-expert norms of ``[E, ...]`` expert tensors, and the size of the last AdamW
update from the saved moments and param groups. With two or more checkpoints, a second pass reads
the model tensors of each consecutive pair together for the per-layer relative change.
Memory: one slice per worker and lockstep member, plus the per-tensor sums.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

from ckpttool.engine.kernels import IEEE_BITS, float_values
from ckpttool.engine.pool import map_ordered, worker_count
from ckpttool.engine.stats import SlabStats
from ckpttool.errors import CkptError, UsageError, at_least
from ckpttool.format.metadata import TRAINABLE_DTYPES, ChunkMeta
from ckpttool.model.catalog import Catalog, TensorEntry, bare_glob_hint, match_filter, saved_by_counts
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, OpenOptions, open_source
from ckpttool.model.discovery import NEWER_INCOMPLETE, Located, named_step
from ckpttool.ops.fields import PhaseFn, options_of, same_named
from ckpttool.ops.inspect import file_rows, file_warnings
from ckpttool.ops.state_checks import synthesized
from ckpttool.ops.stats.compute import (
    TINY_ABS_MAX,
    AdamHyper,
    Moments,
    ScaledSquares,
    ValueSums,
    centered_squares,
    chunk_slices,
    chunk_sums,
    exact_update,
    expert_nonfinite,
    expert_sums,
    moment_sums,
    pair_slabs,
    read_pair,
    release_buffers,
    scaled_expert_squares,
    scaled_sums,
    sum_squares,
    tensor_values,
)
from ckpttool.ops.stats.result import (
    CheckpointStats,
    ExpertNorms,
    GroupStats,
    LayerChange,
    StatsResult,
    TensorValueStats,
    UpdateStats,
)
from ckpttool.optim_state.schema import hyperparameter_problems, other_adam_family

__all__ = ["MAX_CHECKPOINTS", "StatsOptions", "collect_stats", "layer_of", "module_of", "note_line"]

#: The most checkpoints one call compares (each stays open for the change pass).
MAX_CHECKPOINTS = 64
#: A tensor pair stored with different chunk geometries is compared whole up to this many bytes a side.
WHOLE_PAIR_BYTES = 64 << 20

Progress = Callable[[int, int], None] | None
_NUMERIC = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass(frozen=True)
class StatsOptions:
    """Options of :func:`collect_stats`.

    Attributes:
        filters: globs over fqns/keys (a tensor is measured when it matches any; none: all).
        workers: chunks read at once (default: the CPU count).
        optimizer: measure the optimizer state and the update size (default on).
    """

    filters: tuple[str, ...] = ()
    workers: int | None = field(default=None, metadata=at_least(1))
    optimizer: bool = True


def layer_of(fqn: str) -> str:
    """The layer of a parameter: the fqn up to its first numeric component (``layers.3``), else
    its module path (``tok_embeddings``, ``model.norm``)."""
    m = _NUMERIC.search(fqn)
    if m is not None:
        return fqn[: m.end()]
    head, _, _ = fqn.rpartition(".")
    return head or fqn


def module_of(fqn: str) -> str:
    """The module type of a parameter: numeric components replaced by ``*`` (``layers.*.mlp.w1.weight``)."""
    return _NUMERIC.sub(lambda m: m.group(0).replace(m.group(1), "*"), fqn)


@dataclass(frozen=True)
class _Work:
    """One chunk to read: of ``key`` alone, or of the two moments of a parameter in lockstep."""

    key: str
    chunk_index: int
    entry: TensorEntry
    moment_key: str | None = None  # exp_avg_sq read with exp_avg ``key``
    hyper: AdamHyper | None = None
    expert_dim: int | None = None  # the experts' dim (``[E, ...]``: 0; stacked layers ``[L, E, ...]``: 1)


def stacked_prefix(ckpt: Checkpoint, fqn: str) -> str | None:
    """The prefix of ``fqn`` under which its checkpoint's key schema stores every layer stacked on dim 0
    (:attr:`~ckpttool.model.schemas.base.SchemaSpec.stacked_layers`: Megatron-core's ``decoder.layers.``), else ``None``."""
    from ckpttool.model.schemas import registry

    spec = registry.find(ckpt.catalog.schema.id)
    if spec is None:
        return None
    return spec.stacked_prefix(fqn)


#: Why a stacked tensor's layers are grouped together (its chunks hold several layers each).
STACKED_CHUNKS_NOTE = "layers stacked in chunks of several layers each: measured together as one group"


def _split_layers(
    ckpt: Checkpoint, fqn: str, entry: TensorEntry, notes: dict[str, list[str]], stacked: dict[str, str], *keys: str
) -> bool:
    """Whether ``fqn``'s layers are stacked on dim 0 one per chunk (what megatron-core's ``ShardedTensor`` s with a
    prepended layer axis save): each chunk's figures are then its layer's, from the one read; ``stacked[key]``
    is set to the layers' prefix for each of ``keys``. A stacked tensor chunked otherwise is noted and grouped whole."""
    prefix = stacked_prefix(ckpt, fqn)
    if prefix is None or not entry.shape:
        return False
    if any(c.sizes[0] != 1 for c in entry.chunks):
        said = notes.setdefault(STACKED_CHUNKS_NOTE, [])
        if fqn not in said:
            said.append(fqn)
        return False
    stacked.update(dict.fromkeys(keys, prefix))
    return True


def _expert_dim(ckpt: Checkpoint, fqn: str, entry: TensorEntry, role: str, split: bool) -> int | None:
    """The dim of a model tensor's experts: ``[E, out, in]`` (dim 0), stacked layers ``[L, E, out, in]`` split one
    layer per chunk (``split``: dim 1); ``None``: no per-expert norms."""
    stored = stacked_prefix(ckpt, fqn) is not None
    d = 1 if stored else 0
    if role != "weight" or (stored and not split):
        return None
    if len(entry.shape) == 3 + d and "expert" in fqn.lower() and entry.shape[d] > 1:
        return d
    return None


def _run_work(ckpt: Checkpoint, w: _Work) -> tuple[ValueSums, ValueSums | None, Moments | None]:
    reader = ckpt.reader
    chunk = w.entry.chunks[w.chunk_index]
    if w.moment_key is None:
        if w.expert_dim is None:
            return chunk_sums(reader, w.key, chunk), None, None
        d = w.expert_dim
        inner = math.prod(chunk.sizes[d + 1 :])
        experts: dict[int, float] = {}
        sums = chunk_sums(reader, w.key, chunk, lambda _, sq, e0: expert_sums(experts, sq, e0, inner, chunk.offsets[d]))
        sums.experts = experts
        return sums, None, None
    v_chunk = ckpt.catalog.tensor(w.moment_key).chunks[w.chunk_index]
    sums, second, upd = moment_sums((reader, w.key, chunk), (reader, w.moment_key, v_chunk), w.hyper)
    return sums, second, (upd if w.hyper is not None else None)


def _evict_work(ckpt: Checkpoint, w: _Work) -> None:
    """A remote checkpoint: give the windows of the chunk (and its moment's) back to the spool once measured, so
    it holds the chunks being measured, not every one (docs/storage.md); a local one: nothing."""
    reader = ckpt.reader
    if getattr(reader, "spool", None) is None:
        return
    done = [(w.key, w.entry.chunks[w.chunk_index])]
    if w.moment_key is not None:
        done.append((w.moment_key, ckpt.catalog.tensor(w.moment_key).chunks[w.chunk_index]))
    reader.evict(reader.storage_info(k, c) for k, c in done if c.numel)


def _selected(fqn: str, key: str, filters: tuple[str, ...]) -> bool:
    return not filters or any(match_filter(fqn, f, None) or match_filter(key, f, None) for f in filters)


#: A group whose next step is not AdamW's: saved with amsgrad (the denominator is max_exp_avg_sq), or by torch's
#: RAdam or NAdam (``decoupled_weight_decay`` without ``amsgrad``, which Adam's and AdamW's groups always hold).
NOT_ADAMW_NOTE = "not an AdamW param group (amsgrad, RAdam or NAdam: another step)"
#: A group with a value torch.optim cannot step with, or steps with as another (``validate``'s ``P006``: a string
#: ``lr``, a beta of 1, a negative ``lr``, a switch saved as a string, ...).
P006_NOTE = "hyperparameters torch.optim cannot step with (validate: P006)"


def _hyper(ckpt: Checkpoint, fqn: str, notes: dict[str, list[str]]) -> AdamHyper | None:
    """The hyperparameters and saved step of parameter ``fqn`` (``None``, with a note, when unknown)."""
    cat = ckpt.catalog
    group = cat.group_of(fqn)
    ps = cat.optimizer_state.get(fqn)
    spec = cat.schema.spec
    if group is None and ps is not None and spec is not None and spec.group_members is not None:
        why = f"its param group not known (those of {spec.common_state_file} are not the trainer's default grouping)"
        notes.setdefault(why, []).append(fqn)  # saved without members, and these cannot be inferred
        return None
    if group is None or ps is None or "step" not in ps.fields:
        notes.setdefault("no param group or step saved", []).append(fqn)
        return None
    v = group.values
    if v.get("amsgrad") or other_adam_family(v) is not None:
        notes.setdefault(NOT_ADAMW_NOTE, []).append(fqn)  # as replay-step refuses them (E514)
        return None
    betas = v.get("betas")
    try:
        lr = float(v["lr"])
        b1, b2 = (float(betas[0]), float(betas[1])) if betas is not None else (0.9, 0.999)
        eps = float(v.get("eps", 1e-8))
        step_entry = ps.fields["step"]
        shared = v.get("step")  # saved once for the whole optimizer (Megatron's common_step), as replay-step reads it
        if step_entry is None and isinstance(shared, (int, float)) and not isinstance(shared, bool):
            step = float(shared)
        else:
            step = _step_value(ckpt, cat.state_key(fqn, "step"), step_entry)
    except (KeyError, TypeError, ValueError, IndexError, CkptError) as e:
        notes.setdefault(f"hyperparameters unreadable ({type(e).__name__})", []).append(fqn)
        return None
    if not all(math.isfinite(x) for x in (lr, b1, b2, eps, step)):  # no update size (and none JSON can hold)
        notes.setdefault("hyperparameters or step not finite (NaN, infinity)", []).append(fqn)
        return None
    if hyperparameter_problems(v):  # a string lr float() reads, a beta of 1 (no bias correction), a negative lr, ...
        notes.setdefault(P006_NOTE, []).append(fqn)  # as replay-step refuses them (E514)
        return None
    return AdamHyper(lr=lr, beta1=b1, beta2=b2, eps=eps, step=step)


def _saved_step(ckpt: Checkpoint, located: Located) -> int | None:
    """The step of the checkpoint: ``--step``'s on a run root; else the one the trainer saved
    (``train_state.step``, ``iteration``, ``global_step``, OLMo-core's ``train/rankR.pt``:
    :func:`~ckpttool.model.counters.trainer_steps`) when its counters agree; else the step the trainer named its
    step directory by (verl's ``global_step_2/actor``, NeMo's ``epoch_0_step_2/model``, ``step-2``); else ``None``.
    A directory named by an epoch (torchtune's ``dist_epoch_N``) or a save index (Accelerate's
    ``checkpoints/checkpoint_N``) names no step, with ``--step`` too."""
    from ckpttool.model.counters import trainer_steps

    named, epoch = named_step(located)
    if located.step is not None and not epoch:
        return located.step
    values = {c.value for c in trainer_steps(ckpt)}
    if values:
        return values.pop() if len(values) == 1 else None
    return named


def _step_value(ckpt: Checkpoint, key: str, entry: TensorEntry | None) -> float:
    """A saved ``step``: a floating tensor's first value through :func:`chunk_slices` (numpy, no torch
    import), else torch's read (integer tensors) or the byte item's value (old optimizers).

    Raises:
        CkptError: the chunk is damaged; IndexError: an empty tensor; TypeError/ValueError: not a number.
    """
    if entry is None:
        raw = ckpt.reader.read_object(key)
    elif entry.dtype in IEEE_BITS and entry.chunks and not any(entry.chunks[0].offsets):
        first = None
        for raw, dtype in chunk_slices(ckpt.reader, key, entry.chunks[0]):  # to the end: the record's CRC is checked
            first = float(float_values(raw, dtype)[0]) if first is None and raw.size else first
        if first is None:
            raise IndexError(key)
        return first
    else:
        raw = ckpt.reader.read_tensor(key)
    return float(raw.reshape(-1)[0]) if hasattr(raw, "reshape") else float(raw)


#: Why a quantized weight and its scale are not measured (a ``note:`` and a ``skipped`` reason).
QUANTIZED_NOTE = "quantized weights left out (their stored FP8/FP4 codes and scales are not the weights' values)"
_FP8_SCALES = ("_scale_inv", "_scale")


def quantized_keys(model: dict[str, TensorEntry]) -> dict[str, str]:
    """Model keys that hold quantized weights or their scales -> the weight's key.

    Block/channel FP8 (a ``float8_*`` tensor beside ``<key>_scale_inv`` or ``<key>_scale``, as
    DeepSeek-V3, ``export --quantize`` and compressed-tensors store it) and MXFP4 (``x_blocks``
    ``uint8`` beside ``x_scales``): measured as stored, the codes would be reported as weights
    (an ``abs max`` of 448, the e4m3fn maximum). A ``float8`` tensor with no scale is its own value.
    """
    out: dict[str, str] = {}
    for key, e in model.items():
        if e.dtype.startswith("float8"):
            scales = [key + sfx for sfx in _FP8_SCALES if key + sfx in model]
            if scales:
                out[key] = key
                out.update(dict.fromkeys(scales, key))
        elif key.endswith("_blocks") and e.dtype == "uint8" and key[: -len("_blocks")] + "_scales" in model:
            out[key] = out[key[: -len("_blocks")] + "_scales"] = key
    return out


def _plan(
    ckpt: Checkpoint, opts: StatsOptions, notes: dict[str, list[str]]
) -> tuple[list[_Work], dict[str, tuple[str, str]], dict[str, str]]:
    """The chunks to read, per key ``(fqn, role)``, and the keys whose layers are stacked one per chunk ->
    their layers' prefix (:func:`_split_layers`)."""
    cat = ckpt.catalog
    work: list[_Work] = []
    roles: dict[str, tuple[str, str]] = {}
    stacked: dict[str, str] = {}

    def add(key: str, fqn: str, role: str, entry: TensorEntry) -> None:
        ckpt.reader.check_tiled(key, ckpt.reader.tensor_meta(key))  # each chunk is measured on its own
        roles[key] = (fqn, role)
        expert = _expert_dim(ckpt, fqn, entry, role, _split_layers(ckpt, fqn, entry, notes, stacked, key))
        work.extend(_Work(key, i, entry, expert_dim=expert) for i in range(len(entry.chunks)))

    if cat.optimizer_state and opts.optimizer:
        ckpt.param_groups()
    quantized = quantized_keys(cat.model)
    for key, entry in cat.model.items():
        fqn = cat.fqn_of(key)
        if not _selected(fqn, key, opts.filters):
            continue
        if key in quantized:
            if quantized[key] == key:
                notes.setdefault(QUANTIZED_NOTE, []).append(fqn)
            continue
        add(key, fqn, "weight", entry)
    if not opts.optimizer:
        return work, roles, stacked
    for fqn, ps in cat.optimizer_state.items():
        if not _selected(fqn, cat.state_key(fqn, ""), opts.filters):
            continue
        m, v = ps.fields.get("exp_avg"), ps.fields.get("exp_avg_sq")
        paired = m is not None and v is not None and m.chunks == v.chunks and _complex(m) == _complex(v)
        for name, field_entry in ps.fields.items():
            if field_entry is None or name == "step" or (paired and name in ("exp_avg", "exp_avg_sq")):
                continue
            add(field_entry.key, fqn, name, field_entry)
        if paired:
            assert m is not None and v is not None
            for moment in (m, v):
                ckpt.reader.check_tiled(moment.key, ckpt.reader.tensor_meta(moment.key))
            roles[m.key], roles[v.key] = (fqn, "exp_avg"), (fqn, "exp_avg_sq")
            _split_layers(ckpt, fqn, m, notes, stacked, m.key, v.key)
            hyper = _hyper(ckpt, fqn, notes)
            work.extend(_Work(m.key, i, m, moment_key=v.key, hyper=hyper) for i in range(len(m.chunks)))
        elif ps.fields:
            notes.setdefault(_unpaired_note(cat, fqn, m, v), []).append(fqn)
    return work, roles, stacked


def _unpaired_note(cat: Catalog, fqn: str, m: TensorEntry | None, v: TensorEntry | None) -> str:
    """Why a parameter with state has no update size: AdamW's two moments ``m``, ``v`` stored in different chunks, or
    one complex and the other real (torch's AdamW keeps both complex, or both real); else its state has not both (SGD's ``momentum_buffer``, RMSprop's ``square_avg``, Lion's lone ``exp_avg``) and
    the optimizer that saved it (``inspect``'s ``saved_by``) steps otherwise."""
    if m is not None and v is not None and m.chunks != v.chunks:
        return "moments stored with different chunks (no update size)"
    if m is not None and v is not None:
        return "one moment complex and the other real, not AdamW's pair"
    (who,) = saved_by_counts(cat, (fqn,))
    if who == "unknown":
        return "optimizer state that no known optimizer saves (validate: O008), not AdamW's two moments"
    return f"optimizer state of {who}, whose step is not AdamW's"


def _complex(e: TensorEntry) -> bool:
    """``e`` is stored complex (read as its moduli, or as its real and imaginary parts beside another tensor)."""
    return e.dtype.startswith("complex")


#: A variance ``sum x^2 / n - mean^2`` below this fraction of ``sum x^2 / n`` (a spread under 1e-3 of the values'
#: RMS) has lost digits to rounding: the standard deviation is taken about the mean in a second read.
CANCELLING_VARIANCE = 1e-6


def _std(ckpt: Checkpoint, key: str, s: SlabStats) -> float:
    """The finite values' standard deviation: :attr:`SlabStats.std`, or where its one-pass formula cancels
    (:data:`CANCELLING_VARIANCE`), ``sqrt(sum (x - mean)^2 / n)`` from a second read of the tensor."""
    if s.finite < 2 or s.s2 <= 0 or not math.isfinite(s.s2) or s.abs_max < TINY_ABS_MAX:
        return s.std  # tiny float64 values: taken scaled (_scaled_row)
    ms = s.s2 / s.finite
    if ms - s.mean * s.mean > CANCELLING_VARIANCE * ms:
        return s.std
    return math.sqrt(centered_squares(ckpt.reader, key, ckpt.catalog.tensor(key).chunks, s.mean) / s.finite)


def _scaled_row(
    ckpt: Checkpoint, row: TensorValueStats, s: SlabStats, chunks: tuple[ChunkMeta, ...] | None = None
) -> TensorValueStats:
    """``row`` with the mean, L2 and std of a tensor (over ``chunks``, default all: a stacked tensor's layer)
    whose float64 sums overflowed (finite values beyond ~1e154: their squares pass float64's range) or underflow
    (values below :data:`~ckpttool.ops.stats.compute.TINY_ABS_MAX`: their squares lose digits or read 0) taken from
    the values scaled by their largest ``|x|``, read again."""
    if s.finite < 1 or not 0 < s.abs_max < math.inf:
        return row
    if math.isfinite(s.s1) and math.isfinite(s.s2) and s.abs_max >= TINY_ABS_MAX:
        return row
    chunks = chunks or ckpt.catalog.tensor(row.key).chunks
    y1, y2 = scaled_sums(ckpt.reader, row.key, chunks, s.abs_max)
    mean = y1 / s.finite * s.abs_max
    _, c2 = scaled_sums(ckpt.reader, row.key, chunks, s.abs_max, mean)
    return replace(row, mean=mean, l2=math.sqrt(y2) * s.abs_max, std=math.sqrt(c2 / s.finite) * s.abs_max)


def _expert_norms(
    ckpt: Checkpoint, key: str, s: ValueSums, dim: int, chunks: tuple[ChunkMeta, ...] | None = None
) -> tuple[float, ...]:
    """The per-expert norms of ``s`` (``key``'s experts on ``dim``, over ``chunks``, default all): where a float64
    sum of squares overflowed or underflowed (values below :data:`~ckpttool.ops.stats.compute.TINY_ABS_MAX`), taken
    of the values scaled by their largest ``|x|``, read again. An expert with no finite value (found by a read again)
    has the norm ``nan`` (JSON ``null``): of its finite values, none, it would read 0, a dead expert."""
    n, scale = ckpt.catalog.tensor(key).shape[dim], s.acc.abs_max
    chunks = chunks or ckpt.catalog.tensor(key).chunks
    bad = expert_nonfinite(ckpt.reader, key, chunks, dim) if s.acc.nonfinite else set()
    fine = all(math.isfinite(v) for v in s.experts.values()) and scale >= TINY_ABS_MAX
    if fine or not 0 < scale < math.inf:
        norms = [math.sqrt(s.experts.get(e, 0.0)) for e in range(n)]
    else:
        sq = scaled_expert_squares(ckpt.reader, key, chunks, dim, scale)
        norms = [math.sqrt(sq.get(e, 0.0)) * scale for e in range(n)]
    return tuple(math.nan if e in bad else v for e, v in enumerate(norms))


def _nothing_to_measure(ckpt: Checkpoint, opts: StatsOptions, notes: dict[str, list[str]]) -> UsageError:
    """The error of a plan with no tensor: no match for ``--filter``, an unknown key schema, no tensor at
    all, or only quantized weights (their codes and scales are left out, :data:`QUANTIZED_NOTE`)."""
    empty = not ckpt.catalog.tensors  # no key schema would find one: not a schema to name
    quantized = len(notes.get(QUANTIZED_NOTE, ()))
    unknown = not opts.filters and not empty and not quantized and ckpt.catalog.schema.id == "unrecognized"
    if quantized:
        hint = "measure the unquantized checkpoint it was made from, or `ckpttool import` it (weights dequantized)" + (
            ", or widen --filter" if opts.filters else ""
        )
    elif unknown:
        hint = "name the keys with --schema, --model-prefix and --optimizer-prefix (`ckpttool inspect` shows them)"
    elif empty:
        hint = "pass a checkpoint that holds tensors (`ckpttool inspect` shows what this one holds)"
    else:
        cat = ckpt.catalog
        bare = (
            bare_glob_hint(opts.filters[0], lambda g: sum(_selected(cat.fqn_of(k), k, (g,)) for k in cat.model))
            if len(opts.filters) == 1
            else None
        )
        hint = (
            bare
            or cat.state_only_hint(opts.filters)
            or "check --filter against `ckpttool inspect` (globs match fqns and keys)"
        )
    return UsageError(
        f"{ckpt.catalog.path}: no tensor to measure"
        + (f" matches {', '.join(opts.filters)}" if opts.filters else "")
        + ("; its key schema is not recognised" if unknown else "")
        + ("; the checkpoint holds no tensor" if empty else "")
        + (
            f"; its {quantized} quantized weight(s) are left out (FP8/FP4 codes and scales, not values)"
            if quantized
            else ""
        ),
        hint=hint,
    )


def _tensor_row(key: str, fqn: str, role: str, entry: TensorEntry, s: SlabStats, std: float) -> TensorValueStats:
    return TensorValueStats(
        key=key,
        fqn=fqn,
        role=role,
        layer=layer_of(fqn),
        module=module_of(fqn),
        dtype=entry.dtype,
        shape=entry.shape,
        # no finite value: no norm (null), as an expert's; 0 would read as a zeroed tensor. No element: 0, a sum of none
        l2=math.sqrt(s.s2) if s.nonfinite < s.numel or not s.numel else math.nan,
        zero_fraction=(s.zeros / s.numel) if s.numel else math.nan,  # no share of no values: null
        std=std,
        # no finite value (an all-NaN/inf tensor): no largest one either (the engine's 0.0), null in JSON
        abs_max=s.abs_max if s.nonfinite < s.numel else math.nan,
        **same_named(s, "numel", "mean", "nonfinite"),
    )


class _Group:
    def __init__(self) -> None:
        self.params = 0
        self.norms: dict[str, list[float]] = {}
        self.abs_max = math.nan  # until a model tensor with a finite value
        self.nonfinite = 0
        self.upd = Moments()

    def add(self, row: TensorValueStats) -> None:
        norms = self.norms.setdefault(row.role, [])  # summed by math.hypot: no overflow of l2 * l2
        if not math.isnan(row.l2):  # of the finite values: a role whose every value is NaN/inf has no norm
            norms.append(row.l2)
        self.nonfinite += row.nonfinite
        if row.role == "weight":
            self.params += row.numel
            if not math.isnan(row.abs_max):
                self.abs_max = row.abs_max if math.isnan(self.abs_max) else max(self.abs_max, row.abs_max)

    def result(self, name: str) -> GroupStats:
        rms = math.sqrt(self.upd.s2 / self.upd.numel) if self.upd.numel else None
        return GroupStats(
            name,
            self.params,
            {k: math.hypot(*v) if v else math.nan for k, v in self.norms.items()},
            self.abs_max,
            self.nonfinite,
            rms,
        )


def _groups(
    rows: Iterable[TensorValueStats], updates: Iterable[tuple[str, Moments]], by: Callable[[TensorValueStats], str]
) -> tuple[GroupStats, ...]:
    """The groups of ``rows`` named by ``by`` (in first-row order), with the update sizes ``(group, moments)``.
    Integer and bool tensors (a BatchNorm's ``num_batches_tracked``, masks, indices) are rows of their own but no
    part of a group's sums: a counter of 200 is no weight."""
    groups: dict[str, _Group] = {}
    for r in rows:
        if r.dtype in TRAINABLE_DTYPES:
            groups.setdefault(by(r), _Group()).add(r)
    for name, u in updates:
        groups.setdefault(name, _Group()).upd.merge(u)
    return tuple(g.result(name) for name, g in groups.items())


def _layer_rows(
    rows: list[TensorValueStats], stacked: dict[str, str], slices: dict[tuple[str, int], TensorValueStats]
) -> list[TensorValueStats]:
    """The rows ``--by layer`` groups: each tensor's, a stacked one's replaced by its layers' (in layer order)."""
    per_key: dict[str, list[TensorValueStats]] = {}
    for (k, _), r in sorted(slices.items(), key=lambda kv: kv[0][1]):
        per_key.setdefault(k, []).append(r)
    out: list[TensorValueStats] = []
    for r in rows:
        out.extend(per_key.get(r.key, ()) if r.key in stacked else (r,))
    return out


def _updates(
    ckpt: Checkpoint, moments: dict[str, Moments], hypers: dict[str, AdamHyper], rows: list[TensorValueStats]
) -> list[UpdateStats]:
    weight_rms = {r.fqn: r.l2 / math.sqrt(r.numel) for r in rows if r.role == "weight" and r.numel}
    layers = {r.fqn: r.layer for r in rows}
    out = []
    for fqn, u in moments.items():
        rms = math.sqrt(u.s2 / u.numel) if u.numel else math.nan
        w = weight_rms.get(fqn)
        h = hypers[fqn]
        layer = layers.get(fqn, layer_of(fqn))
        big = u.max if u.numel else math.nan  # no element, no largest update (JSON null, as its rms)
        out.append(UpdateStats(fqn, layer, h.step, h.lr, u.numel, rms, big, (rms / w) if w else None))
    return out


def _work_bytes(w: _Work) -> int:
    """Stored bytes one work item reads (both moments of a pair)."""
    e = w.entry
    return e.chunks[w.chunk_index].numel * (e.nbytes // max(e.numel, 1)) * (2 if w.moment_key else 1)


class _StackedLayers:
    """The figures per layer of the tensors whose layers are stacked on dim 0 one per chunk (``stacked``: key ->
    the layers' prefix): each chunk's figures are its layer's (the chunk's dim-0 offset), from the one read."""

    def __init__(self, stacked: dict[str, str]) -> None:
        self.stacked = stacked
        self.sums: dict[tuple[str, int], ValueSums] = {}  # (key, layer index)
        self.moments: dict[tuple[str, int], Moments] = {}  # (fqn, layer index)
        self.prefix: dict[str, str] = {}  # fqn -> the layers' prefix

    def add(self, w: _Work, fqn: str, a: ValueSums, b: ValueSums | None, u: Moments | None) -> None:
        """Fold one work item's results (``a`` of ``w.key``, ``b`` of its ``exp_avg_sq``, ``u`` the update sizes)."""
        if w.key not in self.stacked:
            return
        layer = w.entry.chunks[w.chunk_index].offsets[0]
        self.sums.setdefault((w.key, layer), ValueSums()).merge(a)
        if w.moment_key is not None and b is not None:
            self.sums.setdefault((w.moment_key, layer), ValueSums()).merge(b)
        if u is not None and w.hyper is not None:
            self.moments.setdefault((fqn, layer), Moments()).merge(u)
            self.prefix[fqn] = self.stacked[w.key]

    def rows(self, ckpt: Checkpoint, roles: dict[str, tuple[str, str]]) -> dict[tuple[str, int], TensorValueStats]:
        """Each stacked tensor's rows per layer (named ``decoder.layers.3``; their ``std`` from the one pass, a
        layer's float64 sums that overflowed or underflowed taken again scaled, as a tensor's: :func:`_scaled_row`)."""
        entries = ckpt.catalog.tensors
        return {
            (k, i): _scaled_row(
                ckpt,
                replace(_tensor_row(k, *roles[k], entries[k], s.acc, s.acc.std), layer=f"{self.stacked[k]}{i}"),
                s.acc,
                tuple(c for c in entries[k].chunks if c.offsets[0] == i),
            )
            for (k, i), s in self.sums.items()
        }

    def experts(self, ckpt: Checkpoint, roles: dict[str, tuple[str, str]]) -> tuple[ExpertNorms, ...]:
        """Per-expert norms per layer of the stacked expert weights ``[L, E, ...]`` (megatron's global expert
        offsets: true order)."""
        entries = ckpt.catalog.tensors
        return tuple(
            ExpertNorms(
                k,
                f"{self.stacked[k]}{i}",
                module_of(roles[k][0]),
                _expert_norms(ckpt, k, s, 1, tuple(c for c in entries[k].chunks if c.offsets[0] == i)),
            )
            for (k, i), s in sorted(self.sums.items(), key=lambda kv: kv[0][1])
            if s.experts and roles[k][1] == "weight"
        )

    def updates(
        self, moments: dict[str, Moments], slices: dict[tuple[str, int], TensorValueStats]
    ) -> list[tuple[str, Moments]]:
        """``(layer, update sizes)`` of every parameter: a stacked one's per layer (``nan`` in a layer whose moments
        hold NaN/Inf or whose ``exp_avg_sq`` holds a negative value, as a tensor's), any other's in :func:`layer_of`
        its fqn."""
        for (k, i), r in slices.items():
            broken = r.nonfinite or (r.role == "exp_avg_sq" and self.sums[(k, i)].acc.negative)
            if r.role in ("exp_avg", "exp_avg_sq") and broken and (r.fqn, i) in self.moments:
                self.moments[(r.fqn, i)] = Moments(self.moments[(r.fqn, i)].numel, math.nan, math.nan)
        return [(layer_of(f), u) for f, u in moments.items() if f not in self.prefix] + [
            (f"{self.prefix[f]}{i}", u) for (f, i), u in self.moments.items()
        ]


def _stats_one(ckpt: Checkpoint, opts: StatsOptions, progress: Progress) -> CheckpointStats:
    t0 = time.perf_counter()
    notes: dict[str, list[str]] = {}
    work, roles, stacked = _plan(ckpt, opts, notes)
    if not work:
        raise _nothing_to_measure(ckpt, opts, notes)
    complex_keys = [k for k in roles if ckpt.catalog.tensor(k).dtype.startswith("complex")]
    if complex_keys:  # chunk_slices measures |z|: said, its figures are not the values'
        notes[COMPLEX_NOTE] = complex_keys
    total = sum(_work_bytes(w) for w in work)
    done = [0]
    if progress is not None:  # the total, before the first byte is read
        progress(0, total)

    def one(w: _Work) -> tuple[ValueSums, ValueSums | None, Moments | None]:
        r = _run_work(ckpt, w)
        _evict_work(ckpt, w)
        done[0] += _work_bytes(w)
        if progress is not None:
            progress(done[0], total)
        return r

    before = ckpt.reader.bytes_read
    results = map_ordered(one, work, workers=worker_count(opts.workers, len(work)))
    sums: dict[str, ValueSums] = {}
    moments: dict[str, Moments] = {}
    hypers: dict[str, AdamHyper] = {}
    layers = _StackedLayers(stacked)
    for w, (a, b, u) in zip(work, results):
        sums.setdefault(w.key, ValueSums()).merge(a)
        if w.moment_key is not None and b is not None:
            sums.setdefault(w.moment_key, ValueSums()).merge(b)
        if u is not None and w.hyper is not None:
            fqn = roles[w.key][0]
            moments.setdefault(fqn, Moments()).merge(u)
            hypers[fqn] = w.hyper
        layers.add(w, roles[w.key][0], a, b, u)
    entries = ckpt.catalog.tensors
    rows = [_tensor_row(k, roles[k][0], roles[k][1], entries[k], s.acc, _std(ckpt, k, s.acc)) for k, s in sums.items()]
    rows = [_scaled_row(ckpt, r, sums[r.key].acc) for r in rows]
    rows = [replace(r, layer=stacked[r.key] + "*") if r.key in stacked else r for r in rows]
    slices = layers.rows(ckpt, roles)
    experts = tuple(
        ExpertNorms(
            k,
            layer_of(roles[k][0]),
            module_of(roles[k][0]),
            _true_order(ckpt, k, _expert_norms(ckpt, k, s, 0), notes),
        )
        for k, s in sums.items()
        if s.experts and roles[k][1] == "weight" and k not in stacked
    ) + layers.experts(ckpt, roles)
    negative = {roles[k][0] for k, s in sums.items() if roles[k][1] == "exp_avg_sq" and s.acc.negative}
    exact = _exact_updates(ckpt, work, roles, rows, stacked)
    _judge_moments(moments, hypers, rows, notes, negative, exact)
    updates = _updates(ckpt, moments, hypers, rows)
    layer_updates = layers.updates(moments, slices)
    read = ckpt.reader.bytes_read - before
    return CheckpointStats(
        path=str(ckpt.catalog.path),
        schema=ckpt.catalog.schema.id,
        step=_saved_step(ckpt, ckpt.located),
        tensors=tuple(rows),
        layers=_groups(_layer_rows(rows, stacked, slices), layer_updates, lambda r: r.layer),
        modules=_groups(rows, ((module_of(f), u) for f, u in moments.items()), lambda r: module_of(r.fqn)),
        experts=experts,
        updates=tuple(updates),
        notes=tuple(f"{why}: {len(fqns)} parameter(s), e.g. {fqns[0]}" for why, fqns in notes.items())
        + _newer_incomplete(ckpt),
        bytes_read=read,
        seconds=time.perf_counter() - t0,
        warnings=(*file_warnings(file_rows(ckpt)), *filter(None, [ckpt.unproven_shards()])),
    )


#: Parameters whose state torch made up before the first step (``D005``): their update size is that of no real step.
SYNTHESIZED_NOTE = (
    "update size of no training step: step 1 with all-zero exp_avg and exp_avg_sq, state torch made up for an "
    "optimizer that had not stepped (validate --deep: D005)"
)


def _judge_moments(
    moments: dict[str, Moments],
    hypers: dict[str, AdamHyper],
    rows: list[TensorValueStats],
    notes: dict[str, list[str]],
    negative: set[str],
    exact: dict[str, Moments],
) -> None:
    """The update sizes that are no training step's, said in ``notes``: moments holding NaN/Inf, or an
    ``exp_avg_sq`` holding negative values (the parameters ``negative``) (the size made ``nan`` in ``moments``, as
    torch's next step there; the kernels read them as 0) and state torch made up before the first step (``D005``).
    The parameters ``exact`` (:func:`_exact_updates`: moments holding infinities whose update is finite) take
    those sizes instead, said in a note of their own."""
    of: dict[str, list[TensorValueStats]] = {}  # each parameter's moment rows, in one pass over the rows
    for r in rows:
        if r.role in ("exp_avg", "exp_avg_sq") and r.fqn in moments:
            of.setdefault(r.fqn, []).append(r)
    broken = [fqn for fqn in moments if any(r.nonfinite for r in of.get(fqn, ())) and fqn not in exact]
    for fqn, u in exact.items():
        moments[fqn] = u
    if exact:
        notes[OVERFLOWED_MOMENTS_NOTE] = list(exact)
    for fqn in broken:
        moments[fqn] = Moments(moments[fqn].numel, math.nan, math.nan)
    if broken:
        notes[NONFINITE_MOMENTS_NOTE] = broken
    below = [fqn for fqn in moments if fqn in negative and fqn not in broken]
    for fqn in below:
        moments[fqn] = Moments(moments[fqn].numel, math.nan, math.nan)
    if below:
        notes[NEGATIVE_MOMENTS_NOTE] = below
    made_up = synthesized((fqn, hypers[fqn].step, _zero_moments(of.get(fqn, []))) for fqn in moments)
    if made_up:  # get_state_dict's zero-lr step before the first real one
        notes[SYNTHESIZED_NOTE] = made_up


def _zero_moments(found: list[TensorValueStats]) -> list[bool | None]:
    """Whether each of a parameter's ``exp_avg`` and ``exp_avg_sq`` rows (``found``) is all zero (``None``: a moment
    not measured, or empty), as :func:`~ckpttool.ops.state_checks.synthesized` takes them."""
    zeros: list[bool | None] = [r.zero_fraction == 1.0 if r.numel else None for r in found]
    return zeros if len(zeros) == 2 else [None, None]


def _exact_updates(
    ckpt: Checkpoint,
    work: list[_Work],
    roles: dict[str, tuple[str, str]],
    rows: list[TensorValueStats],
    stacked: dict[str, str],
) -> dict[str, Moments]:
    """The update sizes of the parameters whose moments hold NaN/Inf (a diverged run's save; their layers not stacked
    on dim 0), read once more element by element as torch's step takes them (:func:`exact_update`), of those whose
    size is finite: an ``exp_avg_sq`` overflowed to ``+inf`` under a finite ``exp_avg`` (an update of 0 there)."""
    suspects = {r.fqn for r in rows if r.role in ("exp_avg", "exp_avg_sq") and r.nonfinite and r.key not in stacked}
    per: dict[str, list[_Work]] = {}
    for w in work:
        if w.moment_key is not None and w.hyper is not None and roles[w.key][0] in suspects:
            per.setdefault(roles[w.key][0], []).append(w)
    out: dict[str, Moments] = {}
    for fqn, ws in per.items():
        pairs = (
            pair
            for w in ws
            if w.moment_key is not None
            for pair in read_pair(
                (ckpt.reader, w.key, w.entry.chunks[w.chunk_index]),
                (ckpt.reader, w.moment_key, ckpt.catalog.tensor(w.moment_key).chunks[w.chunk_index]),
            )
        )
        hyper = ws[0].hyper
        assert hyper is not None  # the works gathered have one
        u = exact_update(pairs, hyper)
        if math.isfinite(u.s2) and math.isfinite(u.max):
            out[fqn] = u
    return out


#: A run root's newer step whose save did not finish (validate's ``R001``): ``--step latest`` measured an older one.
NEWER_INCOMPLETE_NOTE = NEWER_INCOMPLETE


def _newer_incomplete(ckpt: Checkpoint) -> tuple[str, ...]:
    """The note naming the newest unfinished step newer than the one measured (``--step latest`` chose the newest
    complete one), as the other commands reading a step name it; none otherwise."""
    note = ckpt.located.newer_incomplete_note("measured")
    return (note,) if note else ()


#: Complex tensors (RoPE's ``freqs_cis``) are measured by their moduli ``|z|``: said, not passed off as their values.
COMPLEX_NOTE = "complex tensors measured by their moduli |z| (mean and std are of |z|; abs max, L2 and zeros exact)"
#: Parameters whose exp_avg_sq overflowed to +inf under a finite exp_avg: torch's step there is 0, a finite size.
OVERFLOWED_MOMENTS_NOTE = (
    "update size 0 where exp_avg_sq overflowed to +inf under a finite exp_avg (lr*|m_hat|/inf, as torch's step: "
    "those values move by weight decay only; the rest measured as any; validate --deep: D001)"
)
#: Parameters whose moments hold NaN/Inf: their update size is not a number, as torch's next step there (a ``note:``).
NONFINITE_MOMENTS_NOTE = (
    "update size nan: exp_avg or exp_avg_sq holds NaN/Inf "
    "(the next step writes non-finite weights there; validate --deep: D001)"
)
#: Parameters whose exp_avg_sq holds negative values (damaged: a sum of squares never is): no update size either.
NEGATIVE_MOMENTS_NOTE = (
    "update size nan: exp_avg_sq holds negative values, which no step writes "
    "(a damaged second moment: the next step takes its square root, NaN; validate --deep: D002)"
)
#: Why per-expert norms are in stored order (a ``note:``).
STORED_ORDER_NOTE = "per-expert norms in stored order (the EP layout is not known: declare it with `ckpttool stamp`)"


#: Notes that say what they are about themselves (the others say why a parameter has no update size).
_SELF_SAID = (
    QUANTIZED_NOTE,
    STORED_ORDER_NOTE,
    COMPLEX_NOTE,
    NONFINITE_MOMENTS_NOTE,
    OVERFLOWED_MOMENTS_NOTE,
    NEGATIVE_MOMENTS_NOTE,
    NEWER_INCOMPLETE_NOTE,
    SYNTHESIZED_NOTE,
)


def note_line(note: str) -> str:
    """A checkpoint's note as a line for people: why no update size was computed, said as such (the notes of
    quantized weights and of experts in stored order are about the weights, not the update)."""
    return note if note.startswith(_SELF_SAID) else f"no update size: {note}"


def _true_order(
    ckpt: Checkpoint, key: str, stored: tuple[float, ...], notes: dict[str, list[str]]
) -> tuple[float, ...]:
    """Per-expert figures of ``key`` in true expert order (a legacy EP layout stores experts permuted on dim 0).

    Where the layout cannot say (an unversioned checkpoint sharded on the expert dim by EP and
    EP-FSDP, ``E405``), the stored order is kept and the key noted.
    """
    try:
        order = _expert_order(ckpt, key, len(stored))
    except CkptError:
        notes.setdefault(STORED_ORDER_NOTE, []).append(ckpt.catalog.fqn_of(key))
        return stored
    return stored if order is None else tuple(stored[order[j]] for j in range(len(stored)))


def _expert_order(ckpt: Checkpoint, key: str, n: int) -> tuple[int, ...] | None:
    """``order[j]``: the dim-0 index of ``key`` holding true expert ``j`` (``None``: stored in true order).

    Raises:
        LayoutError (E405): an unversioned checkpoint whose order cannot be told.
    """
    from ckpttool.layouts.permute import legacy_to_canonical_perm

    layout = ckpt.layout
    if layout is None or not layout.ep_tensors:
        return None
    spec = layout.spec_for(key)
    if spec is None or spec.ep_dim != 0 or spec.num_experts != n or layout.canonical_perm(key) is None:
        return None
    assert layout.ep_size is not None and layout.ep_fsdp_size is not None
    return tuple(legacy_to_canonical_perm(n, layout.ep_size, layout.ep_fsdp_size))


def _pair_sums(
    a: Checkpoint,
    ka: str,
    b: Checkpoint,
    kb: str,
    orders: tuple[Any, Any] = (None, None),
    stacked: str | None = None,
) -> list[tuple[str, ScaledSquares, ScaledSquares]]:
    """``[(layer, sum (b - a)^2, sum a^2)]`` of one tensor of two checkpoints (float64, :class:`ScaledSquares`: no
    overflow); the first is NaN when either side holds a NaN or infinity there (a tensor that diverged has no finite
    change). One entry, the tensor's layer (:func:`layer_of`); a tensor whose layers are ``stacked`` on dim 0 under
    that prefix: one per layer (``decoder.layers.3``), from the same read.

    ``orders``: each side's expert order (:func:`_expert_order`) where they differ: both tensors are
    then read whole and compared in true expert order.
    """
    ea, eb = a.catalog.model[ka], b.catalog.model[kb]
    whole = layer_of(a.catalog.fqn_of(ka)) if stacked is None else None
    if (
        ea.chunks == eb.chunks
        and orders == (None, None)
        and (stacked is None or all(c.sizes[0] == 1 for c in ea.chunks))
    ):
        per: dict[str, tuple[ScaledSquares, ScaledSquares, list[int]]] = {}
        for ca, cb in zip(ea.chunks, eb.chunks):
            acc = per.setdefault(whole or f"{stacked}{ca.offsets[0]}", (ScaledSquares(), ScaledSquares(), [0]))
            va, vb = ValueSums(), ValueSums()

            def one(
                sa: tuple[Any, str],
                sb: tuple[Any, str],
                acc: tuple[ScaledSquares, ScaledSquares, list[int]] = acc,
                va: ValueSums = va,
                vb: ValueSums = vb,
            ) -> None:
                (x, sq), (y, _) = va.add_raw(*sa, slot=0), vb.add_raw(*sb, slot=1)
                acc[0].add_difference(x, y)
                acc[1].add_values(x, float(sq.sum()))

            pair_slabs((a.reader, ka, ca), (b.reader, kb, cb), one)
            acc[2][0] += va.acc.nonfinite + vb.acc.nonfinite
        return [(layer, ScaledSquares(total=math.nan) if bad[0] else d2, a2) for layer, (d2, a2, bad) in per.items()]

    def values(c: Checkpoint, k: str, order: Any) -> Any:
        v = tensor_values(c.reader, k)
        return v if order is None else v.reshape(len(order), -1)[list(order)].reshape(-1)

    xs, ys = values(a, ka, orders[0]), values(b, kb, orders[1])
    parts = (
        [(whole, xs, ys)]
        if whole is not None
        else [
            (f"{stacked}{i}", x, y)
            for i, (x, y) in enumerate(zip(xs.reshape(ea.shape[0], -1), ys.reshape(ea.shape[0], -1)))
        ]
    )
    out = []
    for layer, xv, yv in parts:
        va, vb = ValueSums(), ValueSums()
        x, _ = va.add_slice(xv, slot=0)
        y, _ = vb.add_slice(yv, slot=1)
        d2, a2 = ScaledSquares(), ScaledSquares()
        d2.add_difference(x, y)
        a2.add_values(x, sum_squares(x))
        out.append((layer, ScaledSquares(total=math.nan) if va.acc.nonfinite or vb.acc.nonfinite else d2, a2))
    return out


def _pair_orders(a: Checkpoint, ka: str, b: Checkpoint, kb: str, shape: tuple[int, ...]) -> tuple[Any, Any] | None:
    """Both sides' expert orders where they differ, ``(None, None)`` where they agree; ``None``: not known."""
    if not shape:
        return (None, None)
    try:
        oa, ob = _expert_order(a, ka, shape[0]), _expert_order(b, kb, shape[0])
    except CkptError:
        return None
    ident = tuple(range(shape[0]))
    return (None, None) if (oa or ident) == (ob or ident) else (oa, ob)


def _changes(a: Checkpoint, b: Checkpoint, opts: StatsOptions, skipped: list[str]) -> list[LayerChange]:
    ca, cb = a.catalog, b.catalog
    qa, qb = quantized_keys(ca.model), quantized_keys(cb.model)
    pairs: list[tuple[str, str, str, tuple[Any, Any]]] = []
    first, alike, selected = len(skipped), 0, 0
    for ka, ea in ca.model.items():
        fqn = ca.fqn_of(ka)
        if not _selected(fqn, ka, opts.filters):
            continue
        eb = cb.model_entry(fqn)
        side, q, key = (ca, qa, ka) if ka in qa else (cb, qb, eb.key if eb is not None else "")
        if key in q:
            if q[key] == key:  # the weight (its scale is left out silently)
                skipped.append(f"{fqn}: quantized in {side.path} (stored codes and scales, not values)")
            continue
        selected += 1
        if eb is None or eb.shape != ea.shape:
            skipped.append(f"{fqn}: {'missing in' if eb is None else 'another shape in'} {cb.path}")
            continue
        alike += 1
        why = _other_values(ea.dtype, eb.dtype, ca, cb)
        if why:
            skipped.append(f"{fqn}: {why}")
            continue
        orders = _pair_orders(a, ka, b, eb.key, ea.shape)
        if orders is None:
            skipped.append(f"{fqn}: the EP layout of {ca.path} or {cb.path} does not say its expert order")
        elif orders != (None, None) and max(ea.nbytes, eb.nbytes) > WHOLE_PAIR_BYTES:
            skipped.append(
                f"{fqn}: experts stored in another order in {cb.path} and larger than {WHOLE_PAIR_BYTES >> 20} MiB"
            )
        elif ea.chunks != eb.chunks and max(ea.nbytes, eb.nbytes) > WHOLE_PAIR_BYTES:
            skipped.append(f"{fqn}: stored with other chunks in {cb.path} and larger than {WHOLE_PAIR_BYTES >> 20} MiB")
        else:
            pairs.append((fqn, ka, eb.key, orders))
    for kb in cb.model:  # a tensor new in b (a layer added, a key renamed): not compared, and said so
        fqn = cb.fqn_of(kb)
        if not _selected(fqn, kb, opts.filters) or ca.model_entry(fqn) is not None:
            continue
        if kb in qb and qb[kb] != kb:  # a scale of a quantized weight: left out with its weight
            continue
        skipped.append(f"{fqn}: missing in {ca.path}")
    if selected and not alike:  # said once, before the tensors: not two checkpoints of one run
        skipped.insert(
            first,
            f"{ca.path} and {cb.path} have no model tensor of one name and shape in common: checkpoints of "
            "different models? (the change is between checkpoints of one run)",
        )
    got = map_ordered(
        lambda p: _pair_sums(a, p[1], b, p[2], p[3], _pair_stack(a, p[1], b, p[2], p[0])),
        pairs,
        workers=worker_count(opts.workers, max(1, len(pairs))),
    )
    return _layer_changes(str(ca.path), str(cb.path), got)


def _other_values(da: str, db: str, ca: Catalog, cb: Catalog) -> str | None:
    """Why two tensors of one name and shape, of dtypes ``da`` and ``db``, have no change to measure: an integer or
    bool tensor (a counter, mask or index) on either side, or complex values on one side only; ``None``: none."""
    if da not in TRAINABLE_DTYPES or db not in TRAINABLE_DTYPES:
        return f"{da if da not in TRAINABLE_DTYPES else db} values (a counter, mask or index, not a weight)"
    if da.startswith("complex") != db.startswith("complex"):
        return f"{da} in {ca.path}, {db} in {cb.path}"
    return None


def _layer_changes(a: str, b: str, got: Iterable[list[tuple[str, ScaledSquares, ScaledSquares]]]) -> list[LayerChange]:
    """The per-layer changes from :func:`_pair_sums` ' ``(layer, sum (b - a)^2, sum a^2)`` of each tensor pair."""
    per: dict[str, tuple[ScaledSquares, ScaledSquares, list[int]]] = {}
    for layers in got:
        for layer, d2, a2 in layers:
            acc = per.setdefault(layer, (ScaledSquares(), ScaledSquares(), [0]))
            acc[0].merge(d2)
            acc[1].merge(a2)
            acc[2][0] += 1
    return [
        LayerChange(a, b, layer, _relative(d2.norm(), a2.norm()), n, absolute=d2.norm())
        for layer, (d2, a2, [n]) in per.items()
    ]


def _pair_stack(a: Checkpoint, ka: str, b: Checkpoint, kb: str, fqn: str) -> str | None:
    """The stacked-layer prefix of a tensor compared per layer: stacked on both sides one layer per chunk (as each
    side's rows are grouped, :func:`_split_layers`; no read of a whole tensor of several layers per chunk)."""
    prefix = stacked_prefix(a, fqn)
    ea, eb = a.catalog.model[ka], b.catalog.model[kb]
    if prefix is None or not ea.shape or any(c.sizes[0] != 1 for c in (*ea.chunks, *eb.chunks)):
        return None
    return prefix


def _relative(d: float, a: float) -> float:
    """``d / a`` of the norms ``‖b - a‖``, ``‖a‖``; of a layer all zero in A (a zero-initialised LoRA B, an AdaLN-Zero
    gate) 0 where it stayed zero and ``inf`` where it moved (not a figure left out); NaN where either side held a NaN
    or infinity."""
    if a > 0 or math.isnan(d):
        return d / a if a > 0 else math.nan
    return 0.0 if d == 0 else math.inf


def collect_stats(
    sources: CheckpointOrPath | Sequence[CheckpointOrPath],
    options: StatsOptions | None = None,
    *,
    progress: Progress = None,
    opening: OpenOptions | None = None,
    phase: PhaseFn | None = None,
) -> StatsResult:
    """Statistics of each checkpoint of ``sources`` (in order; one checkpoint or path alone is a
    sequence of one) and the per-layer change between consecutive ones.

    ``progress(done_bytes, total_bytes)`` per checkpoint measured (``(0, total)`` once planned, then
    after each chunk); ``phase(text)`` as each step starts: ``opening PATH i/n``, ``measuring PATH i/n``,
    ``comparing steps``.

    Raises:
        UsageError: no source, more than :data:`MAX_CHECKPOINTS`, ``options`` that are no
            :class:`StatsOptions`, ``filters`` that are no sequence of non-empty globs, or nothing
            to measure (filters).
        CkptError: a checkpoint cannot be opened or a chunk is damaged (as for every reader).
    """
    if isinstance(sources, (str, os.PathLike, Checkpoint)):
        sources = [sources]
    options = options_of(options, StatsOptions)
    if isinstance(options.filters, str) or any(not isinstance(g, str) or not g for g in options.filters):
        raise UsageError(f"`filters` {options.filters!r} is not a sequence of non-empty globs", param="filters")
    if not sources:
        raise UsageError("no checkpoint given", hint="ckpttool stats CKPT [CKPT ...]")
    if len(sources) > MAX_CHECKPOINTS:
        raise UsageError(f"{len(sources)} checkpoints given; at most {MAX_CHECKPOINTS}", hint="measure them in batches")
    try:
        with ExitStack() as stack:
            say = phase or (lambda text: None)
            ckpts = []
            for i, s in enumerate(sources, 1):
                say(f"opening {s.path if isinstance(s, Checkpoint) else s} {i}/{len(sources)}")
                ckpts.append(stack.enter_context(open_source(s, opening)))
            per_list = []
            for i, c in enumerate(ckpts, 1):
                say(f"measuring {c.path} {i}/{len(ckpts)}")
                per_list.append(_stats_one(c, options, progress))
            per = tuple(per_list)
            skipped: list[str] = []
            if len(ckpts) > 1:
                say("comparing steps")
            changes = [ch for a, b in zip(ckpts, ckpts[1:]) for ch in _changes(a, b, options, skipped)]
    finally:
        release_buffers()
    return StatsResult(per, tuple(changes), tuple(skipped))
