"""The model-adapter interface: declarative key maps plus element moves (torch-free, metadata only).

An adapter translates one model family's state-dict names, and where the conventions differ
the element layout, between a trainer's convention and HF transformers'. It never touches
data: :meth:`ModelAdapter.to_hf` says where each element of ``(fqn, shape)`` goes
(:class:`HFTensor`), :meth:`ModelAdapter.from_hf` the inverse (import). Transforms are exact
element moves: ``rope`` (interleaved -> HF ``rotate_half`` rows, the ``permute`` of
transformers' ``convert_llama_weights_to_hf.py``), ``part`` (one of ``nparts`` blocks of dim 1),
``experts`` (per-expert tensors). ``docs/export.md``, "Model adapters"; ``docs/design.md`` §5,
"Registries".
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import ExportError
from ckpttool.model.hfconfig import config_value, tie_word_embeddings

__all__ = [
    "CONFIG_HINT",
    "AdapterConfig",
    "HFTensor",
    "NativeTensor",
    "Skip",
    "KeyMap",
    "HF_LAYER",
    "LAYER_RE",
    "ModelAdapter",
    "layer_map",
    "rope_to_hf_rows",
    "rope_from_hf_rows",
]


#: The hint of an adapter that lacks a dimension of the model's ``config.json`` (export's ``model_assets`` folder
#: holds it); ``diff``, which reads the config.json of the safetensors folder, words it its own way.
CONFIG_HINT = "pass the model's config.json with `model_assets`"


@dataclass(frozen=True)
class AdapterConfig:
    """The model dimensions an adapter needs, read from an HF ``config.json``."""

    n_heads: int | None = None
    """``num_attention_heads``."""
    n_kv_heads: int | None = None
    """``num_key_value_heads`` (``n_heads`` when absent: no GQA)."""
    head_dim: int | None = None
    """``head_dim`` (``hidden_size // num_attention_heads`` when absent)."""
    hidden_size: int | None = None
    """``hidden_size``."""
    num_experts: int | None = None
    """Routed experts (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``), or ``None``."""
    tie_word_embeddings: bool = False
    """The config's flag."""
    model_type: str | None = None
    """The config's ``model_type`` (``llama``, ``qwen3``, ``qwen3_moe``, ...)."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | None) -> AdapterConfig:
        """Read the fields from an HF ``config.json`` (or its ``text_config``); missing ones stay ``None``."""
        if not cfg:
            return cls()

        def num(*names: str) -> int | None:
            v = config_value(cfg, *names)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

        heads = num("num_attention_heads")
        hidden = num("hidden_size")
        head_dim = num("head_dim") or (hidden // heads if hidden and heads and hidden % heads == 0 else None)
        mt = config_value(cfg, "model_type")
        return cls(
            n_heads=heads,
            n_kv_heads=num("num_key_value_heads") or heads,
            head_dim=head_dim,
            hidden_size=hidden,
            num_experts=num("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
            tie_word_embeddings=tie_word_embeddings(cfg) is True,
            model_type=mt if isinstance(mt, str) else None,
        )


@dataclass(frozen=True)
class _Placement:
    """Where one tensor goes, and the element moves on the way (:class:`HFTensor`, :class:`NativeTensor`).

    Attributes:
        key: the destination key.
        shape: the destination tensor's shape.
        rope_heads: the RoPE row permutation (export) or its inverse (import) with this many heads
            (``None``: rows as stored).
        part, nparts: block ``part`` of ``nparts`` along dim 1 of a fused ``[E, nparts*A, B]``.
    """

    key: str
    shape: tuple[int, ...]
    rope_heads: int | None = None
    part: int = 0
    nparts: int = 1


@dataclass(frozen=True)
class HFTensor(_Placement):
    """Where one source tensor goes in the HF state dict.

    Attributes:
        key: the HF key (a fused tensor's key when ``nparts > 1``).
        shape: the HF tensor's shape (the fused shape when ``nparts > 1``).
        rope_heads: apply the RoPE row permutation with this many heads (``None``: rows as stored).
        part, nparts: the source is block ``part`` of ``nparts`` along dim 1 of ``[E, nparts*A, B]``.
        per_expert: per-expert key template (``{j}``) of an expert tensor ``[E, A, B]``;
            with ``nparts > 1`` the template of *this* part's per-expert tensors.
        pieces, runs: an explicit element map for a source that becomes several HF tensors
            (Megatron's stacked layers, fused ``linear_qkv``): the HF tensors ``(key, shape)`` and
            ``(src, length, piece, dst)`` element runs (flat C order); ``()``: none.
        fused_experts: those pieces are fused expert tensors ``[E, ...]`` (no per-expert split).
        shared: the source writes only its runs of those pieces; other sources write the rest (one expert of
            a fused tensor).
    """

    per_expert: str | None = None
    pieces: tuple[tuple[str, tuple[int, ...]], ...] = ()
    runs: tuple[tuple[int, int, int, int], ...] = ()
    fused_experts: bool = False
    shared: bool = False


@dataclass(frozen=True)
class NativeTensor(_Placement):
    """Where one HF tensor goes in the trainer's state dict (import): the inverse of :class:`HFTensor`.

    Attributes:
        key: the native key.
        shape: the native tensor's shape.
        rope_heads: undo the RoPE permutation with this many heads.
        part, nparts: the HF tensor ``[E, nparts*A, B]`` is cut along dim 1; this is block ``part``.
        expert: the HF tensor is expert ``expert`` (``[A, B]``) of a native ``[E, A, B]``.
    """

    expert: int | None = None


@dataclass(frozen=True)
class Skip:
    """A tensor the adapter leaves out on purpose, and why (reported in the export's ``skipped``)."""

    reason: str


@dataclass(frozen=True)
class KeyMap:
    """One declarative mapping between a native key pattern and an HF key template.

    Attributes:
        native: regex over the native fqn, named groups ``layer`` (and ``expert`` for per-expert HF keys).
        hf: HF key template (``{layer}``).
        native_key: the native key written by ``from_hf`` (``{layer}``).
        kind: ``copy``, ``rope_q``, ``rope_k``, ``gate`` / ``up`` (the two halves of a fused
            ``gate_up_proj``), ``experts`` (an expert tensor as stored), or ``skip``.
        per_expert: HF per-expert template (``{layer}``, ``{j}``) for expert tensors.
        reason: why a ``skip`` key is left out.
    """

    native: str
    hf: str | None
    native_key: str | None = None
    kind: str = "copy"
    per_expert: str | None = None
    reason: str = ""

    @functools.cached_property
    def _re(self) -> re.Pattern[str]:  # compiled on first use: importing the adapters compiles no pattern
        return re.compile(self.native)


#: A decoder layer's native fqn prefix ``layers.<N>.`` as a regex (group ``layer``).
LAYER_RE = r"layers\.(?P<layer>\d+)\."
#: A decoder layer's HF key prefix (``{layer}``).
HF_LAYER = "model.layers.{layer}."


def layer_map(
    native: str, hf: str, kind: str = "copy", *, read: str | None = None, per_expert: str | None = None
) -> KeyMap:
    """The :class:`KeyMap` of a decoder-layer tensor: native ``layers.{layer}.<native>`` <-> HF
    ``model.layers.{layer}.<hf>`` (``per_expert``: after the same prefix).

    ``read``: the regex of the native names matched after ``layers.N.`` (also an older release's
    spelling), by default ``native`` itself; ``native`` is what ``from_hf`` writes.
    """
    return KeyMap(
        LAYER_RE + (re.escape(native) if read is None else read),
        HF_LAYER + hf,
        "layers.{layer}." + native,
        kind,
        per_expert=None if per_expert is None else HF_LAYER + per_expert,
    )


def _check_rope(key: str, shape: tuple[int, ...], heads: int | None, head_dim: int | None, what: str) -> int:
    if heads is None or head_dim is None:
        raise ExportError(
            f"{key}: the RoPE row permutation needs `num_attention_heads`, `num_key_value_heads` and `head_dim` "
            "(or `hidden_size`) from the model's config.json",
            fqn=key,
            hint=CONFIG_HINT,
        )
    if len(shape) != 2 or shape[0] != heads * head_dim or head_dim % 2:
        raise ExportError(
            f"{key}: shape {list(shape)} is not [{what} * head_dim, dim] = [{heads} * {head_dim}, ...] "
            "(with an even head_dim) as the config says",
            fqn=key,
            hint="pass the config.json of the model this checkpoint was trained as",
        )
    return heads


def rope_to_hf_rows(n_heads: int, head_dim: int) -> list[int]:
    """Destination row of every source row (interleaved RoPE pairs -> HF half-split), ``n_heads * head_dim`` long.

    ``dst[h*hd + 2*i + j] = h*hd + j*(hd/2) + i``; the same row move as
    ``w.view(n_heads, hd // 2, 2, dim).transpose(1, 2).reshape(n_heads * hd, dim)``
    (``permute`` in transformers' ``convert_llama_weights_to_hf.py``).
    """
    half = head_dim // 2
    dst = [0] * (n_heads * head_dim)
    for h in range(n_heads):
        for i in range(half):
            for j in range(2):
                dst[h * head_dim + 2 * i + j] = h * head_dim + j * half + i
    return dst


def rope_from_hf_rows(n_heads: int, head_dim: int) -> list[int]:
    """Destination row of every HF row (half-split -> interleaved): the inverse of :func:`rope_to_hf_rows`."""
    to = rope_to_hf_rows(n_heads, head_dim)
    inv = [0] * len(to)
    for src, dst in enumerate(to):
        inv[dst] = src
    return inv


class ModelAdapter:
    """A family's key maps and tensor transforms (see the module docstring); subclasses set :attr:`maps`.

    Attributes:
        name: the ``--adapter`` name (``torchtitan-llama3``, ``torchtitan-qwen3``, ``hf``); registered with
            :func:`~ckpttool.model.adapters.registry.register_adapter`, detected by :meth:`detects`.
        description: one line for ``inspect`` and the docs.
        maps: the key maps, first match wins.
        import_schema: the ``ckpttool import --schema`` whose keys :meth:`from_hf` writes (``None``:
            export only; ``import --adapter`` neither lists nor takes it).
        naming, model_types, foreign: what the default :meth:`detects` asks (see there).
    """

    name = ""
    description = ""
    maps: tuple[KeyMap, ...] = ()
    #: keys and tensors as stored (the HF naming itself): no native names to import from
    identity = False
    import_schema: str | None = None
    naming: str | None = None
    model_types: tuple[str | None, ...] | None = None
    foreign: tuple[str, ...] = ()

    @classmethod
    def detects(cls, evidence: Any) -> bool:
        """Whether this adapter claims a checkpoint (an :class:`~ckpttool.model.adapters.registry.Evidence`).

        By default: the key schema's naming is :attr:`naming`, the config's ``model_type`` is one of
        :attr:`model_types` (``None`` in it: no config; ``model_types`` ``None``: any) and no model
        fqn holds a :attr:`foreign` fragment (keys of another family).
        """
        if cls.naming is None or evidence.naming != cls.naming:
            return False
        if cls.model_types is not None and evidence.model_type not in cls.model_types:
            return False
        return not (cls.foreign and evidence.any_fqn_contains(*cls.foreign))

    @classmethod
    def config_model_types(cls) -> tuple[str, ...]:
        """The HF config ``model_type`` values under which :meth:`detects` may claim a checkpoint (by default those
        of :attr:`model_types`): what ``inspect`` offers where the names alone pick no adapter."""
        return tuple(t for t in cls.model_types or () if t)

    def misfit(self, fqns: Any) -> str | None:
        """Why this adapter, named with ``--adapter``, cannot export a checkpoint of these model fqns as a whole
        (a tensor every model of the HF family has is missing), or ``None`` (the default: per tensor only)."""
        return None

    def _match(self, fqn: str) -> tuple[KeyMap, re.Match[str]] | None:
        for m in self.maps:
            hit = m._re.fullmatch(fqn)
            if hit is not None:
                return m, hit
        return None

    def matches(self, fqn: str) -> bool:
        """Whether ``fqn`` is one of this family's native keys."""
        return self._match(fqn) is not None

    def to_hf(self, fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor | Skip | None:
        """Where the native tensor ``fqn`` ``shape`` goes in the HF state dict.

        Returns:
            :class:`HFTensor`, :class:`Skip` (left out on purpose), or ``None``: not a key of this family.

        Raises:
            ExportError (E601): a RoPE permutation without the config's head counts, or a shape
                that does not fit them; an expert tensor that is not ``[E, A, B]``.
        """
        hit = self._match(fqn)
        if hit is None:
            return None
        m, g = hit
        if m.kind == "skip" or m.hf is None:
            return Skip(m.reason)
        layer = g.groupdict().get("layer")
        key = m.hf.format(layer=layer)
        per = m.per_expert.format(layer=layer, j="{j}") if m.per_expert else None
        if m.kind == "rope_q":
            return HFTensor(key, shape, rope_heads=_check_rope(fqn, shape, cfg.n_heads, cfg.head_dim, "n_heads"))
        if m.kind == "rope_k":
            return HFTensor(key, shape, rope_heads=_check_rope(fqn, shape, cfg.n_kv_heads, cfg.head_dim, "n_kv_heads"))
        if m.kind in ("gate", "up", "experts"):
            if len(shape) != 3:
                raise ExportError(
                    f"{fqn}: an expert tensor must be [E, A, B], got shape {list(shape)}",
                    fqn=fqn,
                    hint="the checkpoint does not hold this model family's grouped experts; pick another `adapter`",
                )
            if m.kind == "experts":
                return HFTensor(key, shape, per_expert=per)
            e, a, b = shape
            return HFTensor(key, (e, 2 * a, b), part=0 if m.kind == "gate" else 1, nparts=2, per_expert=per)
        return HFTensor(key, shape)

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        """Where the HF tensor ``hf_key`` goes in the native state dict (import); the inverse of :meth:`to_hf`.

        Returns:
            the native tensors it feeds (two for a fused ``gate_up_proj``), :class:`Skip`, or
            ``None``: not an HF key of this family.

        Raises:
            ExportError (E601): as :meth:`to_hf`.
        """
        found: list[NativeTensor] = []
        for m in self.maps:
            if m.hf is None or m.native_key is None:
                continue
            for form, per in ((m.hf, False), (m.per_expert, True)):
                if form is None:
                    continue
                pat = re.escape(form).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
                g = re.fullmatch(pat, hf_key)
                if g is None:
                    continue
                found.append(self._native(m, g.groupdict(), per, hf_key, shape, cfg))
        return found or None

    def _native(
        self, m: KeyMap, d: dict[str, str], per: bool, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig
    ) -> NativeTensor:
        assert m.native_key is not None
        nk = m.native_key.format(layer=d.get("layer"))
        if m.kind == "rope_q":
            return NativeTensor(nk, shape, rope_heads=_check_rope(hf_key, shape, cfg.n_heads, cfg.head_dim, "n_heads"))
        if m.kind == "rope_k":
            return NativeTensor(
                nk, shape, rope_heads=_check_rope(hf_key, shape, cfg.n_kv_heads, cfg.head_dim, "n_kv_heads")
            )
        if m.kind in ("gate", "up", "experts"):
            if per:
                return NativeTensor(nk, shape, expert=int(d["j"]))
            if m.kind == "experts":
                return NativeTensor(nk, shape)
            if len(shape) != 3 or shape[1] % 2:
                raise ExportError(
                    f"{hf_key}: a fused gate_up_proj must be [E, 2I, H], got shape {list(shape)}",
                    fqn=hf_key,
                    hint="the HF checkpoint does not hold this model family's fused experts; pick another `adapter`",
                )
            e, a2, b = shape
            return NativeTensor(nk, (e, a2 // 2, b), part=1 if m.kind == "up" else 0, nparts=2)
        return NativeTensor(nk, shape)
