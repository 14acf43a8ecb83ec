"""The values of ``diff``: its options, the items it pairs, and its result (``--json`` schema ``ckpttool.diff/1``).

:class:`DiffOptions` in, :class:`DiffResult` out (:func:`ckpttool.ops.diff.run.diff_checkpoints`);
:class:`Item` is one comparable value of a side in the common namespace, :class:`Difference` and
:class:`TensorStat` what one pair of items gives; the package re-exports them
(:mod:`ckpttool.ops.diff`). ``docs/diff.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import at_least
from ckpttool.format.jsonview import json_fields
from ckpttool.format.jsonview import json_number as _num
from ckpttool.model.catalog import TensorEntry
from ckpttool.ops.diff.compare import unravel
from ckpttool.ops.export.transform import Run

#: ``DiffOptions.what`` values (``--what``).
WHAT = ("model", "optimizer", "all")

#: How a note on the files beside two DCP checkpoints (``what`` all) begins: files on one side only or differing,
#: which no item comparison covers (``extra_state/``, a trainer's state file).
BESIDE_NOTE = "files beside the checkpoint, not compared as items"

#: How the note begins that names the files beside the checkpoints (``what`` all) where a side is a URL, whose files
#: beside it are not fetched: they were not compared at all.
REMOTE_BESIDE_NOTE = "files beside the checkpoints not compared"


def as_side_b(text: str) -> str:
    """``text`` with side A's layout declaration parameters (`` `source_layout` ``, `` `ep_size` ``,
    `` `ep_fsdp_size` ``, `` `no_ep` ``: the library's and every other command's names) spelled as ``diff``'s
    side-B ones (`` `b_source_layout` ``, ...), which the CLI names ``--b-source-layout``, ...)."""
    for name in ("source_layout", "ep_fsdp_size", "ep_size", "no_ep"):
        text = text.replace(f"`{name}`", f"`b_{name}`")
    return text


#: How the hint of a layout error of side B (E403-E406, its ``param`` ``opening_b``) begins: B's declaration is the
#: ``declaration`` of ``opening_b`` (``LayoutDeclaration.from_options(source_layout=..., ...)``), whose parameters the
#: rest of the hint names; the CLI drops it and names B's options (:func:`as_side_b`: ``--b-source-layout``, ...).
SIDE_B_DECLARED = "B's layout is declared by the declaration of `opening_b`: "

#: How the note on two sides that are one checkpoint begins (``diff X X``, ``diff run/ run/ --step 3``): it was
#: compared with itself, which shows only that it reads alike twice; the verdict says so.
SELF_NOTE = "A and B are one checkpoint"

#: How the note on a side that cannot be known complete begins (a ``HuggingFaceStorageWriter(save_distributed=True)``
#: folder of per-rank shards no consolidated copy proves: ``Checkpoint.unproven_shards``, validate's ``S017``, the
#: ``warning:`` of inspect, stats and export): "equal" then speaks of the pieces present; the verdict says so.
UNPROVEN_NOTE = "not known complete"

#: How the note on two DCP checkpoints compared with ``what`` model (the default) begins when either holds optimizer
#: state or param groups: "equal" then speaks of the model tensors only; the verdict says so.
MODEL_ONLY_NOTE = "optimizer state and param groups not compared"
#: The note naming the training-state items (train_state, lr_scheduler, data loader) that ``what`` model or
#: optimizer left out, so that "equal" is not read as "resumes the same" (``--what all`` compares them).
TRAINING_STATE_NOTE = "training state not compared"

#: How the note on quantized weights compared dequantized begins: against an unquantized side they are compared
#: within their quantization step without ``rtol``/``atol``; the header says so.
DEQUANTIZED_NOTE = "quantized weights compared dequantized"


@dataclass(frozen=True)
class DiffOptions:
    """What ``diff`` compares and how.

    Attributes:
        what: ``model``, ``optimizer`` (state and param groups) or ``all`` (also training state
            and other items).
        rtol, atol: tolerance comparison (``None``: bitwise).
        as_dtype: cast both sides to this floating dtype name first (``bfloat16`` for a BF16
            export of an FP32 model).
        map_rules: export rules YAML (``docs/export.md``) mapping DCP keys to safetensors names.
        weights: ``params`` or ``master``: which DCP tensor stands for a parameter against a
            safetensors side (``master``: its FP32 ``master_weight``).
        adapter: a model adapter name (:data:`ckpttool.model.adapters.ADAPTERS`) naming a DCP
            side against safetensors; ``None``: detected from the key names, as ``export`` does.
        max_differences: differences listed in full (all are counted).
        filters: globs (``fnmatch``: ``*`` also matches dots); when given, only names matching one
            are compared, on both sides: a common name, a side's stored key, or either without its
            ``model.`` prefix. A pair is kept when either side's item matches.
        step: the step (an integer >= 0 or ``latest``) of each side that is a run's checkpoint root (a
            directory that is no checkpoint itself); an error where neither side is one.
        a_step, b_step: the step of side A / B, overriding ``step`` (an error on a side that is a checkpoint
            itself). A step chosen replaces the one in that side's ``opening_a``/``opening_b`` selection.
    """

    what: str = "model"
    rtol: float | None = None
    atol: float | None = None
    as_dtype: str | None = None
    map_rules: str | os.PathLike[str] | None = None
    weights: str = "params"
    adapter: str | None = None
    max_differences: int = field(default=1000, metadata=at_least(0))
    filters: tuple[str, ...] = ()
    step: str | None = None
    a_step: str | None = None
    b_step: str | None = None


@dataclass(frozen=True)
class Item:
    """One comparable value of a side, in the common namespace.

    Attributes:
        name: the common name; key: the side's checkpoint key it is read from.
        shape, dtype: of the value as compared (a per-expert piece: the piece's).
        category: ``model``, ``optimizer_state``, ``training_state``, ``other``.
        perm: gather permutation of dim 0 into true expert order (legacy EP layouts).
        piece: ``(stored expert index, part, nparts)``: a per-expert piece of a fused tensor.
        entry: the catalog entry of ``key`` (``None``: a byte item).
        against: the other side's name it is compared with, when not ``name`` (a tied head).
        runs: a model adapter's element moves, as the export plan writes them: for each source
            tensor, the :class:`~ckpttool.ops.export.transform.Run` s of its flat elements into this
            value (``dst`` in the value's flat C order); ``None``: the value is the stored tensor.
    """

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    category: str
    perm: tuple[int, ...] | None = None
    piece: tuple[int, int, int] | None = None
    entry: TensorEntry | None = None
    against: str | None = None
    runs: tuple[tuple[TensorEntry, tuple[Run, ...]], ...] | None = None
    dequant: tuple[str, str, tuple[int, int]] | None = None  # (kind, scale key, block): ops/diff/quantized.py

    @property
    def match(self) -> str:
        """The other side's name it is compared with (``against``: a tied head against the embedding)."""
        return self.against or self.name

    @property
    def direct(self) -> bool:
        return (
            self.perm is None
            and self.piece is None
            and self.runs is None
            and self.entry is not None
            and not self.dequant
        )

    def stored_index(self, flat: int) -> tuple[str, list[int]] | None:
        """``(key, index)`` in the side's stored tensor of the compared value's flat element ``flat``.

        ``None`` when the value is the stored tensor as it is (the compared index is the stored one).
        """
        if self.runs is not None:
            for e, runs in self.runs:
                for r in runs:
                    if r.dst <= flat < r.dst + r.length:
                        return e.key, unravel(r.src + flat - r.dst, e.shape)
            return None
        if self.perm is not None:
            idx = unravel(flat, self.shape)
            idx[0] = self.perm[idx[0]]
            return self.key, idx
        if self.piece is not None and self.entry is not None:
            j, p, _n = self.piece
            idx = unravel(flat, self.shape)
            return self.key, [j, p * self.shape[0] + idx[0], *idx[1:]]
        return None


@dataclass(frozen=True)
class Difference:
    """One difference (``--json`` ``differences[]``).

    Attributes:
        name: the common name; a_key, b_key: each side's key (``None``: absent there).
        kind: ``only_a``, ``only_b``, ``shape``, ``dtype``, ``values``, ``hyperparameter``, ``object``.
        message: one line.
        index: global index of the first differing element (canonical order).
        mismatched, numel: differing (or outside-tolerance) elements, of how many.
        max_abs_error, max_rel_error, a_value, b_value: see :class:`~ckpttool.ops.diff.compare.ValueDiff`.
        stored: where that element is stored when the compared order is not a side's stored order
            (a model adapter's RoPE rows or fused halves, a legacy EP permutation, a per-expert
            piece): ``{"side": "A", "key": ..., "index": [...]}`` in that side's stored tensor.
    """

    name: str
    kind: str
    message: str
    a_key: str | None = None
    b_key: str | None = None
    index: list[int] | None = None
    mismatched: int | None = None
    numel: int | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    a_value: Any = None
    b_value: Any = None
    stored: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in json_fields(self).items()}


#: ``TensorStat.status`` values: bitwise (or after the cast) equal, within the tolerance but not
#: equal, and differing (bitwise, or outside the tolerance).
STATUSES = ("equal", "within_tolerance", "differ")


@dataclass(frozen=True)
class TensorStat:
    """The metrics of one pair of tensors whose values were compared (``--json`` ``tensors[]``).

    Attributes:
        name: the common name; a_key, b_key: each side's key.
        shape: as compared; a_dtype, b_dtype: as stored; numel: elements compared.
        status: one of :data:`STATUSES`.
        mismatched: elements that differ (bitwise) or lie outside the tolerance.
        max_abs: ``max |a-b|``; rel_l2: ``||a-b|| / ||b||`` (B the reference); cosine:
            ``a.b / (||a|| ||b||)``: float64 sums over every element, of the values as compared
            (after ``as_dtype``). Equal values: 0, 0, 1. ``None``: booleans (and a cosine where
            one side is all zero). Non-finite: ``inf``/``nan``.
        raw: settled on the fast path (equal records, not decoded).
        diff_l2, b_l2: ``||a-b||`` and ``||b||`` (float64; ``None`` when not computed: booleans,
            equal records), so that groups of tensors (a layer) get their relative L2.
        layers: of a tensor whose key schema stacks every layer on dim 0 (Megatron-core's
            ``decoder.layers.<module> [L, ...]``, :attr:`~ckpttool.model.schemas.base.SchemaSpec.stacked_layers`),
            ``(layer, ||a-b||, ||b||)`` of each dim-0 slice, named as an unstacked layer
            (``model.decoder.layers.3``); ``()`` otherwise, or when the values were not decoded (equal records).
        tolerance: ``(scheme, rtol, atol_max)`` where a quantized weight (scheme ``fp8-block``, ``fp8-experts``,
            ``fp8-compressed-tensors``, ``fp8-tensor``, ``mxfp4``) was compared dequantized against an unquantized
            side without ``rtol``/``atol``: its quantization step's default tolerance
            (:func:`~ckpttool.ops.diff.quantized.quant_tolerance`), ``atol_max`` the largest element's atol; ``None``:
            the options' comparison (bitwise, the cast, or ``rtol``/``atol``).
    """

    name: str
    a_key: str
    b_key: str
    shape: tuple[int, ...]
    a_dtype: str
    b_dtype: str
    numel: int
    status: str
    mismatched: int
    max_abs: float | None
    rel_l2: float | None
    cosine: float | None
    raw: bool = False
    diff_l2: float | None = None
    b_l2: float | None = None
    layers: tuple[tuple[str, float, float], ...] = ()
    tolerance: tuple[str, float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {k: _num(v) for k, v in json_fields(self).items() if k not in ("layers", "tolerance")}
        if self.layers:
            d["layers"] = [{"layer": n, "diff_l2": _num(x), "b_l2": _num(y)} for n, x, y in self.layers]
        if self.tolerance is not None:
            scheme, rtol, atol = self.tolerance
            d["tolerance"] = {"source": "quantization", "scheme": scheme, "rtol": _num(rtol), "atol_max": _num(atol)}
        return d

    @property
    def order(self) -> tuple[float, float, float]:
        """Sort key, largest difference first: relative L2 (NaN first), then max abs, then 1 - cosine."""
        import math

        def big(v: float | None) -> float:
            if v is None:
                return -1.0
            return math.inf if math.isnan(v) else v

        cos = self.cosine
        return (-big(self.rel_l2), -big(self.max_abs), -(1 - cos if cos is not None and not math.isnan(cos) else 0))


@dataclass(frozen=True)
class Excluded:
    """A key of one side left out of the comparison, and why."""

    side: str
    key: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self)


@dataclass(frozen=True)
class SideInfo:
    path: str
    kind: str
    schema: str
    layout: str | None
    tensors: int
    #: the checkpoint directory opened where it is not ``path`` (a run root's step, a model/optimizer pair's model)
    opened: str | None = None
    #: what the side is, as the text output names it (:func:`~ckpttool.ops.manifest.folder_kind`): ``dcp``,
    #: ``safetensors``, a per-rank format's name, or a pair's parts (``safetensors + dcp``: NeMo Automodel's
    #: safetensors ``model/`` beside its DCP ``optim/``); ``kind`` says how it is compared. ``None``: ``kind``.
    folder: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self)


@dataclass(frozen=True)
class DiffResult:
    """Outcome of :func:`diff_checkpoints` (``--json``: :meth:`to_dict`, schema ``ckpttool.diff/1``).

    ``equal`` is true when nothing differs: no key on one side only, every compared value
    equal (bitwise, after the cast, or within the tolerance). Exit code 0 / 1.
    """

    a: SideInfo
    b: SideInfo
    options: DiffOptions
    naming: str
    compared: int
    equal_count: int
    raw_compared: int
    differences: list[Difference]
    difference_count: int
    excluded: list[Excluded]
    notes: list[str]
    bytes_read: int
    seconds: float
    model_adapter: str | None = None
    tensors: list[TensorStat] = field(default_factory=list)
    values: int = 0
    filtered_out: int = 0
    #: The names of ``tensors`` in A's order (the checkpoint's, as compared): the order of layers in a picture.
    compared_order: tuple[str, ...] = ()

    @property
    def equal(self) -> bool:
        return self.difference_count == 0

    def summary(self) -> dict[str, Any]:
        """``--json`` ``summary``: tensors by status, the largest relative L2 and max abs, the smallest cosine (with names)."""
        import math

        by_status = {st: sum(1 for t in self.tensors if t.status == st) for st in STATUSES}
        rel = [t for t in self.tensors if t.rel_l2 is not None]
        cos = [t for t in self.tensors if t.cosine is not None]
        mab = [t for t in self.tensors if t.max_abs is not None]

        def top(ts: list[TensorStat], value: Callable[[TensorStat], float], sign: float) -> tuple[str | None, Any]:
            if not ts:
                return None, None
            # on a tie (0 for a bitwise-only difference: -0.0 against 0.0, two NaN payloads) a tensor that differs
            best = max(ts, key=lambda t: (math.inf if math.isnan(value(t)) else sign * value(t), t.status != "equal"))
            return best.name, _num(value(best))

        out: dict[str, Any] = {"tensors": len(self.tensors), "values": self.values, **by_status}
        for label, ts, fn, sign in (
            ("max_rel_l2", rel, lambda t: t.rel_l2, 1.0),
            ("max_abs", mab, lambda t: t.max_abs, 1.0),
            ("min_cosine", cos, lambda t: t.cosine, -1.0),
        ):
            name, v = top(ts, fn, sign)
            out[label] = v
            out[f"{label}_name"] = name
        return out

    def comparison(self) -> dict[str, Any]:
        """``--json`` ``comparison``: ``mode`` ``tolerance`` (``rtol``/``atol`` given), ``bitwise``, or ``quantization``
        (none given, and ``quantized_tensors`` > 0 of ``tensors`` compared within their quantization step, each
        with its :attr:`TensorStat.tolerance`; the others bitwise or after the cast)."""
        o = self.options
        quantized = sum(1 for t in self.tensors if t.tolerance is not None)
        mode = "tolerance" if (o.rtol is not None or o.atol is not None) else "quantization" if quantized else "bitwise"
        out: dict[str, Any] = {
            "mode": mode,
            "rtol": o.rtol,
            "atol": o.atol,
            "as_dtype": o.as_dtype,
            "filters": list(o.filters),
        }
        if quantized:
            out["quantized_tensors"] = quantized
        return out

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "schema": "ckpttool.diff/1",
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "what": o.what,
            "comparison": self.comparison(),
            "naming": self.naming,
            "model_adapter": self.model_adapter,
            "equal": self.equal,
            "counts": {
                "compared": self.compared,
                "equal": self.equal_count,
                "raw": self.raw_compared,
                "different": self.difference_count,
                "excluded": len(self.excluded),
                "tensors": len(self.tensors),
                "values": self.values,
                "filtered_out": self.filtered_out,
            },
            "summary": self.summary(),
            "tensors": [t.to_dict() for t in self.tensors],
            "differences": [d.to_dict() for d in self.differences],
            "excluded": [e.to_dict() for e in self.excluded],
            "notes": list(self.notes),
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 6),
        }
