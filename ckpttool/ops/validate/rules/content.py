"""Content rules (``D009``-``D011``, ``D013``, ``D017``): copies, zeros and uninitialised memory that the metadata cannot show.

The ``--deep`` pass records, for each floating model tensor it streams (and each master weight and moment), the
CRC-32 of every chunk (and of every expert's part of a chunk for fused expert tensors ``[E, ...]``) with its place in
global C order (:attr:`~ckpttool.ops.validate.stats.TensorStats.digests`); no data is kept. Two slices are
*identical* when their runs (offset inside the slice, length, CRC-32) are the same and their bytes, read again for
those candidates only, are equal. The rules stay silent on a checkpoint that shows no training step (sparse
upcycling and depth up-scaling copy weights on purpose at step 0). ``docs/rules.md``.
"""

from __future__ import annotations

import functools
import re
import struct
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, cast

from ckpttool.errors import ChunkError, CkptError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, ChunkMeta, TensorMeta
from ckpttool.format.tiling import row_major_stride, unravel
from ckpttool.model.catalog import TensorEntry
from ckpttool.model.discovery import named_step
from ckpttool.model.schemas.base import SchemaSpec
from ckpttool.ops.state_checks import MOMENTS
from ckpttool.ops.validate.base import rule
from ckpttool.ops.validate.context import Context
from ckpttool.ops.validate.rules.data import synthesized_from_stats
from ckpttool.ops.validate.rules.optimizer import step_values
from ckpttool.ops.validate.stats import UNINIT_BOUND

_EXPERT_RE = re.compile(r"(?<=\.experts\.)\d+(?=\.)")
_LAYER_RE = re.compile(r"(?<=layers\.)\d+(?=\.)")

Digest = tuple[tuple[int, int, int], ...]


def _trained(ctx: Context) -> bool:
    """The checkpoint shows a real training step: an optimizer ``step`` >= 1 (not synthesized), or step >= 1 in its name."""
    steps = step_values(ctx)
    if steps and max(steps.values()) >= 1 and not synthesized_from_stats(ctx):
        return True
    located = ctx.ckpt.located
    return (located.step or named_step(located)[0] or 0) >= 1  # a step directory given itself: its name's step


def _slice_digest(runs: list[tuple[int, int, int]], start: int, length: int) -> Digest | None:
    """The runs inside ``[start, start + length)`` relative to ``start``; ``None`` when they do not cover it."""
    inside = sorted((s - start, n, c) for s, n, c in runs if start <= s and s + n <= start + length)
    return tuple(inside) if sum(n for _, n, _ in inside) == length else None


def _tensor_digest(ctx: Context, key: str) -> Digest | None:
    assert ctx.deep_result is not None
    st = ctx.deep_result.stats.get(key)
    if st is None or not st.digests or st.zero:
        return None
    return _slice_digest(st.digests, 0, st.numel)


def _groups(digests: dict[int, Any]) -> list[list[int]]:
    """Indices with equal (known) digests, groups of two or more, in index order."""
    by: dict[Any, list[int]] = defaultdict(list)
    for i, d in sorted(digests.items()):
        if d is not None:
            by[d].append(i)
    return [v for v in by.values() if len(v) > 1]


def _run_window(ctx: Context, key: str, meta: TensorMeta, start: int, n: int) -> Any:
    """The bytes of ``key``'s flat values ``[start, start + n)`` (global C order) as an engine
    :class:`~ckpttool.engine.plan.Window`: a run of a digest lies inside one chunk and is contiguous in it (as the
    deep pass cut it). ``None`` where no raw chunk holds it so (a compressed record, a damaged one: their own
    findings say so)."""
    from ckpttool.engine.plan import Window

    size = tuple(meta.size)
    first, last = unravel(start, size), unravel(start + n - 1, size)
    for c in meta.chunks:
        ends = [o + k for o, k in zip(c.offsets, c.sizes, strict=True)]
        if not all(o <= a <= b < e for o, a, b, e in zip(c.offsets, first, last, ends, strict=True)):
            continue
        stride = row_major_stride(tuple(c.sizes))
        lo = sum((a - o) * k for a, o, k in zip(first, c.offsets, stride, strict=True))
        hi = sum((b - o) * k for b, o, k in zip(last, c.offsets, stride, strict=True))
        if hi - lo != n - 1:
            return None
        try:
            loc = ctx.reader.locate(key, c)
        except CkptError:
            return None
        if not loc.raw:
            return None
        item = DTYPE_ITEMSIZE[meta.dtype.name]
        return Window(ctx.reader.fd(loc.info.relative_path), loc.data_start + lo * item, n * item)
    return None


#: A slice of a stored tensor: its key and the flat index (global C order) of its first value.
_Slice = tuple[str, int]


def _same_slices(ctx: Context, a: _Slice, b: _Slice, digest: Digest) -> bool:
    """Whether the slices at ``a`` and ``b`` whose runs both have ``digest`` hold the same bytes: equal CRC-32s
    (32 bits each: among the pairs of 256 experts in 60 layers of weights and moments a coincidence is likely)
    checked on the bytes, run by run, on the engine (:func:`~ckpttool.engine.differ.differing_values`). ``False``
    where a run cannot be read so: no finding on the CRC-32 alone."""
    import torch

    from ckpttool.engine.differ import differing_values

    ma, mb = ctx.reader.metadata.entries.get(a[0]), ctx.reader.metadata.entries.get(b[0])
    if not isinstance(ma, TensorMeta) or not isinstance(mb, TensorMeta) or ma.dtype != mb.dtype:
        return False
    dtype = torch.uint8  # the stored bytes: bitwise, as the finding says (NaN payloads and -0.0 told apart)
    for rel, n, _ in digest:
        wa, wb = _run_window(ctx, a[0], ma, a[1] + rel, n), _run_window(ctx, b[0], mb, b[1] + rel, n)
        if wa is None or wb is None:
            return False
        try:
            d = differing_values(wa, dtype, wb, dtype)
        except (OSError, EOFError, ValueError, CkptError):
            return False
        if d.count:
            return False
    return True


def _verified(
    ctx: Context, digests: dict[int, Digest | None], where: dict[int, _Slice], moments: dict[int, Any] | None = None
) -> list[list[int]]:
    """The groups of indices with equal digests (:func:`_groups`) whose first two slices (``where``) hold the same
    bytes (:func:`_same_slices`); with ``moments`` (index -> the digests of its moments, :func:`_one_step_moments`),
    only indices whose moments are equal too."""
    keyed: dict[int, Any] = dict(digests)
    if moments is not None:
        keyed = {i: None if d is None else (d, moments.get(i)) for i, d in digests.items()}
    return [g for g in _groups(keyed) if _same_slices(ctx, where[g[0]], where[g[1]], cast(Digest, digests[g[0]]))]


def _first_step_only(ctx: Context) -> bool:
    """Every saved ``step`` is 1 or less: the checkpoint of the first optimizer step, which may have run at ``lr`` 0
    (a linear warmup from 0, transformers' ``get_linear_schedule_with_warmup``): the weights are still their
    initialisation's, copies where it made copies, while their moments hold each one's own gradient."""

    def first() -> bool:
        steps = step_values(ctx)
        return bool(steps) and max(steps.values()) <= 1

    return bool(ctx.once("content.first_step_only", first))  # asked per expert tensor and layer: read once


def _one_step_moments(
    ctx: Context, moments: list[str], e: int, layer: int = 0, layers: int = 1
) -> dict[int, Any] | None:
    """Expert (true index) of layer ``layer`` -> the digests of its ``exp_avg`` and ``exp_avg_sq`` slices, in a
    checkpoint of the first step only (:func:`_first_step_only`; else ``None``): weights equal after that step
    are copies only where their gradients, hence their moments, are equal too (an unknown digest: ``None``, equal)."""
    if not _first_step_only(ctx):
        return None
    assert ctx.deep_result is not None
    out: dict[int, list[Digest | None]] = defaultdict(list)
    for key in moments:
        meta, st = ctx.reader.metadata.entries.get(key), ctx.deep_result.stats.get(key)
        if not isinstance(meta, TensorMeta) or st is None or not st.digests or meta.numel % (e * layers):
            return None
        pe, true = meta.numel // (e * layers), _expert_order(ctx, key, e)
        for i in range(e):
            out[true(i)].append(_slice_digest(st.digests, (layer * e + i) * pe, pe))
    return {i: tuple(d) for i, d in out.items()}


def _describe(groups: list[list[int]], what: str) -> str:
    shown = "; ".join(f"{what}s {', '.join(map(str, g[:8]))}{' ...' if len(g) > 8 else ''}" for g in groups[:3])
    return shown + (f" (+{len(groups) - 3} more groups)" if len(groups) > 3 else "")


_ZEROS = bytes(1 << 16)


@functools.lru_cache(maxsize=64)
def _zero_crc(nbytes: int) -> int:
    """The CRC-32 of ``nbytes`` zero bytes (a digest span of an all-zero slice), in 64 KiB pieces."""
    crc, left = 0, nbytes
    while left:
        n = min(left, len(_ZEROS))
        crc, left = zlib.crc32(memoryview(_ZEROS)[:n], crc), left - n
    return crc


def _true_expert(ctx: Context, key: str, experts: int) -> Callable[[int], int]:
    """Stored expert position -> true expert index: a legacy layout (version 1, EP and EP-FSDP on the expert dim)
    stores the slabs block-transposed (docs/layouts.md), so the findings name the experts the model has."""
    try:
        perm = ctx.layout.canonical_perm(key) if ctx.layout is not None else None
    except CkptError:  # ambiguous or contradicted: L003/L00x say so; stored positions it is
        perm = None
    if not perm or experts % len(perm):
        return lambda i: i
    per, slab_of = experts // len(perm), {s: j for j, s in enumerate(perm)}
    return lambda i: slab_of[i // per] * per + i % per


def _moment_keys(ctx: Context) -> dict[str, list[str]]:
    """Model key of a parameter -> the keys of its ``exp_avg`` and ``exp_avg_sq`` (both saved); built once per
    validation (four rules ask)."""

    def build() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for fqn, ps in ctx.cat.optimizer_state.items():
            fields = [ps.fields.get(m) for m in MOMENTS]
            param = ctx.cat.model_entry(fqn)
            if param is not None and all(isinstance(f, TensorEntry) for f in fields):
                out[param.key] = [f.key for f in fields if isinstance(f, TensorEntry)]
        return out

    got: dict[str, list[str]] = ctx.once("content.moment_keys", build)
    return got


def _zero_slice(ctx: Context, key: str, start: int, length: int) -> bool:
    """``key``'s values in ``[start, start + length)`` (flat, C order; ``length`` 0: all of them) are known to be
    all zero."""
    assert ctx.deep_result is not None
    st = ctx.deep_result.stats.get(key)
    meta = ctx.reader.metadata.entries.get(key)
    if st is None or not isinstance(meta, TensorMeta) or not st.numel:
        return False
    if st.zero and st.covers(meta.numel):
        return True
    if not length:
        return False
    d = _slice_digest(st.digests, start, length) if st.digests else None
    item = DTYPE_ITEMSIZE[meta.dtype.name]
    return d is not None and all(c == _zero_crc(n * item) for _, n, c in d)


def _expert_order(ctx: Context, key: str, e: int) -> Callable[[int], int]:
    """Stored expert position in a layer -> true expert index (:func:`_true_expert`; the experts of stacked layers
    ``[L, E, ...]`` are in their stored order: a layout record's permutation is of dim 0)."""
    return (lambda i: i) if key in ctx.stacked_keys() else _true_expert(ctx, key, e)


def _never_stepped_experts(ctx: Context, moments: list[str], e: int, layer: int = 0, layers: int = 1) -> set[int]:
    """Experts (true indices) of layer ``layer`` (of ``layers`` stacked on dim 0; 1: ``[E, ...]``) whose ``exp_avg``
    and ``exp_avg_sq`` slices are all zero: they never got a gradient (no token routed to them), so an upcycled model
    still holds them as the copies it made at step 0."""
    out: set[int] | None = None
    for key in moments:
        meta = ctx.reader.metadata.entries.get(key)
        if not isinstance(meta, TensorMeta) or meta.numel % (e * layers):
            return set()
        pe, true = meta.numel // (e * layers), _expert_order(ctx, key, e)
        zero = {true(i) for i in range(e) if _zero_slice(ctx, key, (layer * e + i) * pe, pe)}
        out = zero if out is None else out & zero
    return out or set()


def _fused_expert_copies(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    state = ctx.expert_state_keys()
    moments = _moment_keys(ctx)
    any_state = _any_state(ctx)
    flagged: set[str] = set()
    for key in [*ctx.cat.model, *state]:
        meta = ctx.reader.metadata.entries.get(key)
        st = ctx.deep_result.stats.get(key)
        if not isinstance(meta, TensorMeta) or st is None or st.zero or not st.digests:
            continue
        if key in ctx.cat.model and _frozen(ctx, key, any_state):
            continue  # no expert of it ever got a gradient: an upcycled MoE's frozen experts are its step-0 copies
        if key in state and state[key] in flagged:
            continue  # the parameter's finding says it (a rank's slice written for all: its state too)
        layers, e = ctx.expert_grid(key, tuple(meta.size))
        if not e:
            continue
        pe = meta.numel // (layers * e)
        true = _expert_order(ctx, key, e)
        stacked = key in ctx.stacked_keys()
        for layer in range(layers):  # the experts of one layer (stacked layers ``[L, E, ...]``: each layer's)
            base = layer * e * pe
            digests = {true(i): _slice_digest(st.digests, base + i * pe, pe) for i in range(e)}
            owner = state[key] if key in state else key
            split = _by_moments(ctx, key, moments.get(owner) if owner is not None else None, digests, layer, layers)
            if key in state:  # experts that never got a gradient have all-zero moments: not copies
                digests = _without_zero(digests, DTYPE_ITEMSIZE[meta.dtype.name])
            groups = _verified(ctx, digests, {true(i): (key, base + i * pe) for i in range(e)}, split)
            if groups:
                flagged.add(key)
                n = sum(len(g) for g in groups)
                where = f"{key}: layer {layer}" if stacked else key
                yield (
                    key,
                    f"{where}: {n} of {e} expert slices are bitwise copies of another: {_describe(groups, 'expert')}",
                )


def _by_moments(
    ctx: Context, key: str, moments: list[str] | None, digests: dict[int, Digest | None], layer: int, layers: int
) -> dict[int, Any] | None:
    """Leave out of ``digests`` (true expert index -> digest of ``key``'s slice in layer ``layer``) the experts whose
    parameter's moments (``moments``: its ``exp_avg`` and ``exp_avg_sq`` keys) are all zero: they never got a
    gradient and keep their initial values (upcycled copies), in the parameter and in its master weight. Returns the
    moments' digests that copies of ``key``, a parameter or master weight, must share after a first step only
    (:func:`_one_step_moments`; ``None``: no such condition)."""
    if not moments:
        return None
    e = len(digests)
    for i in _never_stepped_experts(ctx, moments, e, layer, layers):
        digests.pop(i, None)
    return None if key in moments else _one_step_moments(ctx, moments, e, layer, layers)


def _without_zero(digests: dict[int, Digest | None], item: int) -> dict[int, Digest | None]:
    """``digests`` without the slices known to be all zero (every run the CRC-32 of zero bytes; ``item``: bytes a
    value)."""
    return {i: d for i, d in digests.items() if d is None or any(c != _zero_crc(n * item) for _, n, c in d)}


def _frozen(ctx: Context, key: str, any_state: bool) -> bool:
    """Model tensor ``key`` has no optimizer state while other parameters have some (``any_state``, computed once
    per rule: :func:`_any_state`): frozen (``requires_grad`` off, or outside every param group), as torch saves no
    state for a parameter that never got a gradient."""
    own = ctx.cat.optimizer_state.get(ctx.cat.fqn_of(key))
    return any_state and (own is None or not own.fields)


def _any_state(ctx: Context) -> bool:
    """Some parameter of the checkpoint has optimizer state fields."""
    return any(ps.fields for ps in ctx.cat.optimizer_state.values())


def _per_expert_copies(ctx: Context) -> Iterator[tuple[str, str]]:
    by_pattern: dict[str, dict[int, str]] = defaultdict(dict)
    moments = _moment_keys(ctx)
    any_state = _any_state(ctx)

    def never_stepped(key: str) -> bool:  # all-zero moments: no token was routed to it
        return all(_zero_slice(ctx, k, 0, 0) for k in moments[key])

    for key, entry in ctx.cat.model.items():
        m = _EXPERT_RE.search(key)
        if m is not None and isinstance(entry, TensorEntry) and entry.numel > 0:
            by_pattern[key[: m.start()] + "#" + key[m.end() :]][int(m.group())] = key
    for pattern, keys in by_pattern.items():
        if all(_frozen(ctx, k, any_state) for k in keys.values()):
            continue  # frozen experts (no state, other parameters have some): never changed since step 0
        if any(k in moments for k in keys.values()):
            # experts that never got a gradient (no state, as torch leaves a parameter whose grad stays None, or
            # all-zero moments) keep their initial values: in an upcycled MoE the copies it made at step 0
            keys = {i: k for i, k in keys.items() if k in moments and not never_stepped(k)}
        if len(keys) < 2:
            continue
        digests = {i: _tensor_digest(ctx, k) for i, k in keys.items()}
        split = None  # after a first step at lr 0 the weights are their initialisation's: copies only if moments are
        if _first_step_only(ctx) and all(k in moments for k in keys.values()):
            split = {i: tuple(_tensor_digest(ctx, m) for m in moments[k]) for i, k in keys.items()}
        groups = _verified(ctx, digests, {i: (k, 0) for i, k in keys.items()}, split)
        if groups:
            yield keys[groups[0][0]], f"{pattern}: bitwise copies across experts: {_describe(groups, 'expert')}"


@rule("D009")
def identical_expert_slices(ctx: Context) -> Iterator[tuple[str, str]]:
    if not _trained(ctx):
        return
    yield from _fused_expert_copies(ctx)
    yield from _per_expert_copies(ctx)


#: A layer's member tensor: its key and, of a tensor with every layer stacked on dim 0, the layer's index there.
_Member = tuple[str, int | None]


def _stacked_spec(ctx: Context) -> SchemaSpec | None:
    """The key schema's spec, which says under which prefixes every layer is stacked on dim 0 (Megatron-core's
    ``decoder.layers.``: :meth:`~ckpttool.model.schemas.base.SchemaSpec.stacked_prefix`)."""
    from ckpttool.model.schemas import registry

    return registry.find(ctx.cat.schema.id)


def _layer_members(ctx: Context) -> dict[str, dict[int, dict[str, _Member]]]:
    """Layer prefix -> layer index -> the layer's tensors (relative name -> member): named ``...layers.N.<rel>``,
    or (a stacked schema) the dim-0 slices of ``decoder.layers.<rel> [L, ...]``."""
    spec = _stacked_spec(ctx)
    layers: dict[str, dict[int, dict[str, _Member]]] = defaultdict(lambda: defaultdict(dict))
    for key, entry in ctx.cat.model.items():
        if not isinstance(entry, TensorEntry):
            continue
        fqn = ctx.cat.fqn_of(key)
        prefix = spec.stacked_prefix(fqn) if spec is not None else None
        if prefix is not None and entry.shape:
            for i in range(entry.shape[0]):
                layers[prefix][i][fqn[len(prefix) :]] = (key, i)
            continue
        m = _LAYER_RE.search(key)
        if m is not None:
            layers[key[: m.start()]][int(m.group())][key[m.end() :]] = (key, None)
    return layers


def _member_digest(ctx: Context, member: _Member) -> Digest | None:
    """The digest of a layer's tensor (:func:`_tensor_digest`), of a stacked one its layer's dim-0 slice (``None``
    where its chunks' digests do not cover the slice, or it is all zero)."""
    key, i = member
    if i is None:
        return _tensor_digest(ctx, key)
    assert ctx.deep_result is not None
    st = ctx.deep_result.stats.get(key)
    shape = ctx.cat.model[key].shape
    if st is None or not st.digests or not shape[0]:
        return None
    row = st.numel // shape[0]
    if _zero_slice(ctx, key, i * row, row):
        return None
    return _slice_digest(st.digests, i * row, row)


def _member_moments(ctx: Context, member: _Member, moments: dict[str, list[str]]) -> tuple[Digest | None, ...]:
    """The digests of a layer's tensor's ``exp_avg`` and ``exp_avg_sq`` (``moments``: :func:`_moment_keys`), of a
    stacked one its layer's dim-0 slices (``None`` where unknown or all zero; ``()`` without moments)."""
    assert ctx.deep_result is not None
    key, i = member
    out: list[Digest | None] = []
    for m in moments.get(key, ()):
        st, meta = ctx.deep_result.stats.get(m), ctx.reader.metadata.entries.get(m)
        if st is None or not st.digests or st.zero or not isinstance(meta, TensorMeta) or not meta.size:
            out.append(None)
            continue
        row = meta.numel // meta.size[0] if i is not None and meta.size[0] else meta.numel
        out.append(_slice_digest(st.digests, (i or 0) * row, row))
    return tuple(out)


def _layer_dims(ctx: Context, member: _Member) -> int:
    """The dims of a layer's tensor (a stacked one's without the layer dim)."""
    key, i = member
    return len(ctx.cat.model[key].shape) - (i is not None)


@rule("D010")
def identical_layers(ctx: Context) -> Iterator[tuple[str, str]]:
    if not _trained(ctx):
        return
    layers = _layer_members(ctx)
    moments = _moment_keys(ctx) if _first_step_only(ctx) else None

    for prefix, by_index in layers.items():
        sig: dict[int, Any] = {}
        keyed: dict[int, Any] = {}  # after a first step only: with the moments' digests (copies share those too)
        for i, members in by_index.items():
            if not any(_layer_dims(ctx, k) >= 2 for k in members.values()):
                continue
            parts = tuple((rel, _member_digest(ctx, k)) for rel, k in sorted(members.items()))
            sig[i] = parts if all(d is not None for _, d in parts) else None
            keyed[i] = sig[i]
            if moments is not None and sig[i] is not None:
                keyed[i] = (sig[i], tuple(_member_moments(ctx, m, moments) for _, m in sorted(members.items())))
        groups = [g for g in _groups(keyed) if _same_layers(ctx, by_index[g[0]], by_index[g[1]], sig[g[0]])]
        for g in filter(None, (_separate_parameters(ctx, by_index, g) for g in groups)):
            yield (
                f"{prefix}{g[1]}",
                f"{prefix}{g[1]}.*: every tensor is bitwise identical to {prefix}{g[0]}.* "
                f"({_describe([g], 'layer')}, {len(by_index[g[0]])} tensors each)",
            )


def _member_start(ctx: Context, member: _Member) -> _Slice:
    """Where a layer's tensor starts: the whole tensor, or a stacked one's dim-0 slice of its layer."""
    key, i = member
    shape = ctx.cat.model[key].shape
    return key, (0 if i is None else i * (ctx.cat.model[key].numel // shape[0]))


def _same_layers(ctx: Context, a: dict[str, _Member], b: dict[str, _Member], parts: Any) -> bool:
    """Whether two layers whose tensors have equal digests (``parts``: relative name -> digest) hold the same bytes
    in every tensor (:func:`_same_slices`)."""
    return all(_same_slices(ctx, _member_start(ctx, a[rel]), _member_start(ctx, b[rel]), d) for rel, d in parts)


def _separate_parameters(ctx: Context, by_index: dict[int, dict[str, _Member]], group: list[int]) -> list[int] | None:
    """The layers of ``group`` (bitwise identical) that are separate parameters, when two or more are; else ``None``.

    One module used at several depths (ALBERT-style sharing, ``nn.ModuleList([block] * n)``) is one set of
    parameters under several names: ``state_dict`` keeps every name, ``named_parameters`` (hence the optimizer
    state) only the first. Identical layers of which only one has optimizer state are that, not a copy; layers
    that each have their own state are separate parameters that should have diverged. Layers none of which has
    state while other parameters have some are frozen (:func:`_frozen`): they keep the values they started with,
    copies where depth up-scaling made them."""
    state = ctx.cat.optimizer_state

    def stepped(i: int) -> bool:
        return any((ps := state.get(ctx.cat.fqn_of(k))) is not None and ps.fields for k, _ in by_index[i].values())

    own = [i for i in group if stepped(i)]
    if not own:  # a model-only save has no optimizer state to tell aliases or frozen layers from copies
        return None if _any_state(ctx) else group
    return own if len(own) > 1 else None


#: Model tensors whose own initialisation is zero (``D011`` leaves them alone), matched on the key's
#: last two components: biases, LoRA's B (PEFT ``lora_B``; zero at init by design, Hu et al. 2021),
#: router / expert-balance biases (DeepSeek-V3 ``e_score_correction_bias``, torchtitan ``expert_bias``),
#: masked-image-modeling mask tokens (transformers' DINOv2, BEiT, Swin, ViT ``embeddings.mask_token``
#: ``[1, (1,) hidden]``: zeroed by ``_init_weights``, used only by masked pretraining, so a fine-tune never
#: gives them a gradient), and anything named ``zero``.
ZERO_INIT_NAMES = re.compile(
    r"(^|[._])(bias|lora_b|lora_B|lora_embedding_B|e_score_correction_bias|expert_bias\w*|mask_token|\w*zero\w*)"
    r"([._]|$)"
)


@rule("D011")
def all_zero_weight(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    if not _trained(ctx):
        return  # before training, zero-initialised tensors are the initialisation's business
    first, moments = _first_step_only(ctx), _moment_keys(ctx)
    for key, entry in ctx.cat.model.items():
        if len(entry.shape) < 2 or entry.numel == 0 or ZERO_INIT_NAMES.search(key):
            continue
        if first and key in moments and not all(_zero_slice(ctx, k, 0, 0) for k in moments[key]):
            continue  # a zero init (adaLN-Zero) with its first gradient in its moments: that step may have run at lr 0
        st = ctx.deep_result.stats.get(key)
        if st is not None and st.zero and st.covers(entry.numel):
            yield key, f"{key}: all {entry.numel} values are 0 (shape {list(entry.shape)}, {entry.dtype})"


#: The fewest values a chunk needs for ``D017`` to compare it with the tensor's other chunks: a few trained values
#: (norm weights near 1.0 in bfloat16) can coincide by chance, a shard of this many cannot.
DUPLICATE_MIN_VALUES = 64
_ONE_BYTES = {"float32": struct.pack("<f", 1.0), "float64": struct.pack("<d", 1.0), "float16": struct.pack("<e", 1.0)}
_ONE_BYTES["bfloat16"] = _ONE_BYTES["float32"][2:]


def _constant(crc: int, n: int, dtype: str) -> bool:
    """``crc`` is the CRC-32 of ``n`` values all 0, or all 1.0 (a norm weight at its initialisation), of ``dtype``:
    chunks equal by their initialisation, not by a copy (computed in 64 KiB pieces, only for chunks found equal)."""
    if crc == _zero_crc(n * DTYPE_ITEMSIZE[dtype]):
        return True
    one = _ONE_BYTES.get(dtype)
    if one is None:
        return False
    piece, left, ones = one * (len(_ZEROS) // len(one)), n * len(one), 0
    while left:
        k = min(left, len(piece))
        ones, left = zlib.crc32(memoryview(piece)[:k], ones), left - k
    return crc == ones


def _chunk_of(meta: TensorMeta, start: int) -> ChunkMeta | None:
    """``meta``'s chunk whose first value is at flat index ``start`` (C order); ``None``: none starts there."""
    size = tuple(meta.size)
    for c in meta.chunks:
        flat, stride = 0, 1
        for d in reversed(range(len(size))):
            flat, stride = flat + c.offsets[d] * stride, stride * size[d]
        if flat == start and all(c.sizes):
            return c
    return None


def _chunk_at(meta: TensorMeta, start: int) -> str:
    """The offsets of ``meta``'s chunk whose first value is at flat index ``start`` (C order), as a finding names it."""
    c = _chunk_of(meta, start)
    return str(tuple(c.offsets)) if c is not None else f"flat index {start}"


def _same_values(ctx: Context, key: str, meta: TensorMeta, starts: list[int]) -> bool:
    """Whether the chunks of ``key`` starting at the first two of ``starts`` hold the same bytes: equal CRC-32s
    (32 bits: among a thousand ranks' shards of a thousand tensors a coincidence is likely) checked on the bytes,
    on the engine for raw records (:func:`~ckpttool.engine.differ.differing_values`), read whole otherwise."""
    from ckpttool.engine.differ import differing_values
    from ckpttool.engine.plan import Window

    ca, cb = _chunk_of(meta, starts[0]), _chunk_of(meta, starts[1])
    if ca is None or cb is None:
        return False  # not chunk starts: nothing to read them by, no finding on the CRC-32 alone
    try:
        la, lb = ctx.reader.locate(key, ca), ctx.reader.locate(key, cb)
    except CkptError:
        return False  # a damaged record: the read's own finding names it
    import torch

    if la.raw and lb.raw:  # compared as bytes: bitwise, as the finding says (NaN payloads and -0.0 told apart)
        wa = Window(ctx.reader.fd(la.info.relative_path), la.data_start, la.nbytes)
        wb = Window(ctx.reader.fd(lb.info.relative_path), lb.data_start, lb.nbytes)
        return la.nbytes == lb.nbytes and differing_values(wa, torch.uint8, wb, torch.uint8).count == 0
    a, b = ctx.reader.read_chunk(key, ca).reshape(-1), ctx.reader.read_chunk(key, cb).reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@rule("D017")
def duplicated_chunks(ctx: Context) -> Iterator[tuple[str, str]]:
    """Two chunks (different offsets) of one floating model tensor, or of a parameter's master weight or moment,
    whose stored values are bitwise identical, from the deep pass's chunk digests; chunks of fewer than
    :data:`DUPLICATE_MIN_VALUES` values, all 0 or all 1.0, model tensors without optimizer state beside others with
    some (frozen, buffers), fused expert tensors (``D009``), layer-stacked ones (``D010``) and checkpoints with no
    training step are left out."""
    assert ctx.deep_result is not None
    if not _trained(ctx):
        return
    stacked, any_state = ctx.stacked_keys(), _any_state(ctx)
    for key in [*ctx.cat.model, *sorted(ctx.state_tensor_keys())]:
        meta = ctx.reader.metadata.entries.get(key)
        st = ctx.deep_result.stats.get(key)
        if not isinstance(meta, TensorMeta) or st is None or not st.digests or st.zero or key in stacked:
            continue
        if key in ctx.cat.model and _frozen(ctx, key, any_state):
            continue  # never stepped (a frozen LayerScale of 1e-5, a buffer): still its initialisation's copies
        if ctx.expert_grid(key, tuple(meta.size))[1] or (st.min is not None and st.min == st.max):
            continue
        by: dict[tuple[int, int], set[int]] = defaultdict(set)
        for start, n, crc in st.digests:
            if n >= DUPLICATE_MIN_VALUES:
                by[(n, crc)].add(start)
        same = sorted(
            (sorted(v), n) for (n, crc), v in by.items() if len(v) > 1 and not _constant(crc, n, meta.dtype.name)
        )
        same = [(starts, n) for starts, n in same if _same_values(ctx, key, meta, starts)]
        if same:
            starts, n = same[0]
            yield (
                key,
                (
                    f"{key}: chunks at {' and '.join(_chunk_at(meta, s) for s in starts[:4])}"
                    + (f" and {len(starts) - 4} more" if len(starts) > 4 else "")
                    + f" hold bitwise identical values ({n} {meta.dtype.name} each)"
                    + (f"; {len(same) - 1} more such groups" if len(same) > 1 else "")
                    + ": one shard's bytes stored in another's place"
                ),
            )


#: Model tensors whose values may legitimately lie beyond ``UNINIT_BOUND`` (``D013`` leaves them
#: alone): attention masks (``finfo.min`` / ``-1e9`` fill) and BatchNorm's running statistics
#: (data statistics, not weights: a first layer's ``running_var`` on raw pixels can pass 1e4).
UNINIT_EXEMPT_NAMES = re.compile(r"(mask|running_var|running_mean)")
#: The fraction of subnormal values from which ``D013`` reports a tensor (docs/rules.md).
SUBNORMAL_FRACTION = 0.1


@rule("D013")
def uninitialised_values(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    for key, entry in ctx.cat.model.items():
        st = ctx.deep_result.stats.get(key)
        if st is None or not st.numel or UNINIT_EXEMPT_NAMES.search(key):
            continue
        sub = st.subnormal >= SUBNORMAL_FRACTION * st.numel
        if not st.beyond and not sub:
            continue
        parts = []
        if st.beyond:
            parts.append(f"{st.beyond} with |x| > {UNINIT_BOUND:g} (largest {st.beyond_max:.3g})")
        if st.subnormal and (sub or st.beyond):
            parts.append(f"{st.subnormal} subnormal ({st.subnormal / st.numel:.1%})")
        yield key, f"{key}: {' and '.join(parts)} of {st.numel} values (shape {list(entry.shape)}, {entry.dtype})"


def _replica_difference(ctx: Context, key: str, offsets: tuple[int, ...], first: Any, other: Any) -> str | None:
    """What differs between two rank files' copies of one replicated chunk (``None``: nothing).

    Both storage windows are compared on the engine (:func:`~ckpttool.engine.differ.differing_values`: bytes first,
    then values, NaN equal to NaN, integers bit for bit, complex values with both parts); the message counts the
    values that differ, with the largest ``|a - b|`` and the first one.

    Raises:
        DataFileError: a rank file is shorter than the window (it changed since it was opened).
    """
    from ckpttool.engine.differ import differing_values
    from ckpttool.engine.io import ShortReadError
    from ckpttool.engine.plan import Window
    from ckpttool.errors import DataFileError

    where = f"{key} at {list(offsets)}: {other.relative_path} against {first.relative_path}"
    if first.length != other.length:
        return f"{where}: {other.length} bytes against {first.length}"
    meta = ctx.reader.metadata.entries[key]
    assert isinstance(meta, TensorMeta)
    dtype = meta.dtype.to_torch()
    fa, fb = ctx.reader.fd(first.relative_path), ctx.reader.fd(other.relative_path)
    try:
        d = differing_values(
            Window(fa, first.offset, first.length), dtype, Window(fb, other.offset, other.length), dtype
        )
    except ShortReadError:
        raise DataFileError(f"{ctx.reader.path}: short read of {key!r}", fqn=key) from None
    if not d.count:
        return None
    example = ""
    if d.first is not None and d.first_values is not None:
        va, vb = d.first_values
        example = f"; first at element {d.first}: {' against '.join(_numbers(vb, va))}"  # other, first
    return f"{where}: {d.count} of {d.numel} elements differ (max |diff| {d.max_abs:.4g}){example}"


def _number(v: Any) -> str:
    """A value for a message: an integer in full (int64 beyond 2**53 included), a float or complex to 6 digits."""
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def _numbers(a: Any, b: Any) -> tuple[str, str]:
    """Two values that differ, for a message (:func:`_number`), in every digit (``repr``) where 6 digits read the
    same: a replica 1 ulp off (``0.190943 against 0.190943`` says nothing)."""
    sa, sb = _number(a), _number(b)
    return (repr(a), repr(b)) if sa == sb else (sa, sb)


class _StorageOf:
    """``reader`` whose storage entry of every chunk is ``info`` (a higher rank's copy, :func:`_rank_local_replicas`)."""

    def __init__(self, reader: Any, info: Any) -> None:
        self._reader, self._info = reader, info

    def storage_info(self, fqn: str, chunk: Any = None) -> Any:
        return self._info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def _rank_local_replicas(ctx: Context) -> Iterator[tuple[str, str]]:
    """The copies a ``dcp.save(use_collectives=False)`` save's higher ranks wrote of a chunk a lower rank wrote too
    (each rank's ``dcp.load`` reads its own), compared with the lowest rank's on their values (``--deep``); a copy
    whose archive cannot be read (``E301``: only that rank reads it, so no other rule does) is named too."""
    from ckpttool.format.locator import locate_chunk
    from ckpttool.format.metadata import StorageInfo

    md = ctx.reader.metadata
    read_errors = ctx.deep_result.read_errors if ctx.deep_result is not None else {}
    for key, offsets, info in md.replicas:
        meta = md.entries.get(key)
        if not isinstance(meta, TensorMeta) or offsets is None or key in read_errors:
            continue
        chunk = next((c for c in meta.chunks if c.offsets == offsets), None)
        if chunk is None or not chunk.numel:
            continue
        try:
            mine = ctx.reader.locate(key, chunk)
        except CkptError:  # the lowest rank's copy: S010 names it
            continue
        try:
            other = locate_chunk(cast(Any, _StorageOf(ctx.reader, info)), key, chunk)
        except ChunkError as e:  # read by that rank's dcp.load alone: never passed over as equal
            yield (
                key,
                f"{key} at {list(offsets)}: {info.relative_path}'s copy cannot be read ({e.message}), so that rank's dcp.load fails on it",
            )
            continue
        except CkptError:  # its file missing or short: S002/S003 name it
            continue
        try:
            if not (mine.raw and other.raw):  # compressed or strided records: not compared
                continue
            msg = _replica_difference(
                ctx,
                key,
                offsets,
                StorageInfo(mine.info.relative_path, mine.data_start, mine.nbytes),
                StorageInfo(other.info.relative_path, other.data_start, other.nbytes),
            )
        except CkptError:  # a copy that cannot be read: S002/S003 name its file
            continue
        if msg is not None:
            yield key, msg


@rule("D014")
def replicas_differ(ctx: Context) -> Iterator[tuple[str | None, str]]:
    if ctx.deep_result is not None:
        yield from _rank_local_replicas(ctx)
    err = ctx.ckpt.replica_error
    if err is None:
        return
    reported = False
    for key, offsets, first, other in getattr(getattr(ctx.reader, "assembled", None), "replicas", ()):
        msg = _replica_difference(ctx, key, offsets, first, other)
        if msg is not None:
            reported = True
            yield key, msg
    if not reported:  # the open-time comparison found a difference: never silent about it
        yield None, err.message
