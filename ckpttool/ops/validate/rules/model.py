"""Model rules (``M``): structure against an HF ``config.json`` (``--config``) or a reference (``--against``).

Checkpoint keys are ``model.<HF name>`` (``docs/design.md`` §2). Layer indices are read
from ``...layers.<N>.`` (or GPT-2's ``transformer.h.<N>.``) components, per-expert indices from ``...experts.<j>.``; fused
expert tensors (``...experts.gate_up_proj`` ``[E, 2I, H]``, HF transformers v5) carry
the experts in dim 0. Config names: ``num_hidden_layers``; ``num_experts`` /
``n_routed_experts`` / ``num_local_experts``; ``tie_word_embeddings`` (also read from
``text_config`` of multimodal configs; when the config leaves it out, the default of transformers' config class
for its ``model_type``: ``model.hfconfig.tie_word_embeddings``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from ckpttool.model.hfconfig import config_value, tie_word_embeddings, tied_embedding_key
from ckpttool.ops.validate.base import RuleSkipped, rule
from ckpttool.ops.validate.context import Context

#: The decoder-layer container: ``layers`` (Llama, OPT's ``model.decoder.layers``, GPT-NeoX's ``gpt_neox.layers``) or
#: ``h`` (GPT-2, Falcon, BLOOM, GPT-J: ``transformer.h.<N>``), a whole key component.
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*?\.)?(?:layers|h))\.(?P<idx>\d+)\.")
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\bexperts)\.(?P<idx>\d+)\.(?P<rest>.+)$")
_FUSED_RE = re.compile(r"^(?P<prefix>.*\bexperts)\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")
_PER_EXPERT_PROJ = {
    "gate_proj.weight": "gate_up_proj",
    "up_proj.weight": "gate_up_proj",
    "down_proj.weight": "down_proj",
    "w1.weight": "gate_up_proj",
    "w3.weight": "gate_up_proj",
    "w2.weight": "down_proj",
}


def _ranges(idx: list[int]) -> str:
    if not idx:
        return "none"
    idx = sorted(idx)
    parts, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}..{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")


def _missing(got: set[int], n: int) -> str:
    """``_ranges`` of the indices in ``0..n-1`` that ``got`` lacks, without building them (``n`` comes from a
    config.json and may be huge); ``""`` when none is missing."""
    parts: list[str] = []
    nxt = 0
    for i in sorted(x for x in got if 0 <= x < n) + [n]:
        if i > nxt:
            parts.append(f"{nxt}" if i - 1 == nxt else f"{nxt}..{i - 1}")
            if len(parts) > 6:
                break
        nxt = i + 1
    return ", ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")


def _num_experts(ctx: Context) -> int | None:
    v = config_value(ctx.config, "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    return int(v) if isinstance(v, int) and v > 0 else None


def _layer_indices(keys: Collection[str]) -> dict[str, set[int]]:
    """Layer container prefix -> the layer indices of ``keys`` under it (:data:`_LAYER_RE`)."""
    by_prefix: dict[str, set[int]] = defaultdict(set)
    for key in keys:
        m = _LAYER_RE.match(key)
        if m:
            by_prefix[m["prefix"]].add(int(m["idx"]))
    return by_prefix


def _adapter_names(ctx: Context) -> dict[str, _Ours] | None:
    """The HF names ``export`` writes through the model adapter of a checkpoint whose model keys are that adapter's
    (Megatron's stacked ``decoder.layers.*``), with ``--config`` for its dimensions; ``None`` where the keys are HF
    names already or no adapter maps them."""
    if ctx.config is None:
        return None
    names: dict[str, _Ours]
    skip: str | None
    names, skip = ctx.once("against_names", lambda: _against_names(ctx))
    if skip is not None or all(o.via is None for o in names.values()):
        return None
    return names


@rule("M001")
def layer_coverage(ctx: Context) -> Iterator[tuple[str, str] | tuple[str, str, str]]:
    n = config_value(ctx.config, "num_hidden_layers", "n_layer", "num_layers")
    if not isinstance(n, int):
        yield (
            "config",
            "--config has no integer num_hidden_layers; layer coverage cannot be checked",
            "pass the model's own config.json",
        )
        return
    by_prefix, via = _layer_indices(ctx.cat.model), ""
    if not by_prefix:  # Megatron's stacked layers (decoder.layers.*, [L, ...]): the layers export writes through them
        adapted = _adapter_names(ctx) or {}
        by_prefix = _layer_indices(adapted)
        via = next((f" (the layers export writes through {o.via})" for o in adapted.values() if o.via), "")
    if not by_prefix:
        yield "model", f"no model key has a layers.<N> (or h.<N>) component but the config has {n} layers"
        return
    hf_layers = ctx.cat.model_key("model.layers")  # HF causal LMs: model.layers.<N>, spelled by the key schema
    main = hf_layers if hf_layers in by_prefix else max(by_prefix, key=lambda p: len(by_prefix[p]))
    got = by_prefix[main]
    missing, extra = _missing(got, n), sorted(i for i in got if not 0 <= i < n)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"out of range {_ranges(extra)}")
        note = ""
        if missing and not extra and max(got) == len(got) - 1:  # 0..len-1: indices are >= 0 and distinct
            note = " (indices restart at 0: stage-local numbering of one pipeline stage?)"
        yield (
            main,
            f"{main}: has layers {_ranges(sorted(got))}{via}, config num_hidden_layers {n}: {'; '.join(parts)}{note}",
        )
    for prefix, idx in by_prefix.items():
        if prefix == main or not prefix.endswith(main.rsplit(".", 1)[-1]):
            continue
        dup = sorted(idx & got)
        if dup and prefix.split(".")[-2:] == main.split(".")[-2:]:
            yield prefix, f"{prefix}: layers {_ranges(dup)} also stored under {main} (duplicate layer container)"


@rule("M002")
def expert_coverage(ctx: Context) -> Iterator[tuple[str, str]]:
    e = _num_experts(ctx)
    if e is None:
        expert = next((k for k in ctx.cat.model if _EXPERT_RE.match(k) or _FUSED_RE.match(k)), None)
        if expert is not None:  # expert tensors and a config with no expert count: nothing to check them against
            raise RuleSkipped(f"--config names no num_experts / n_routed_experts but the checkpoint has {expert}")
        return  # dense model
    per: dict[tuple[str, str], set[int]] = defaultdict(set)
    for key, t in ctx.cat.model.items():
        m = _EXPERT_RE.match(key)
        if m:
            per[(m["prefix"], m["rest"])].add(int(m["idx"]))
            continue
        f = _FUSED_RE.match(key)
        if f and len(t.shape) >= 2 and t.shape[0] != e:
            yield (
                key,
                f"{key}: fused expert tensor has {t.shape[0]} experts in dim 0 ({list(t.shape)}), config num_experts {e}",
            )
    reported: set[str] = set()
    for (prefix, rest), idx in sorted(per.items()):
        missing, extra = _missing(idx, e), sorted(i for i in idx if not 0 <= i < e)
        if (missing or extra) and prefix not in reported:
            reported.add(prefix)
            parts = ([f"missing {missing}"] if missing else []) + ([f"out of range {_ranges(extra)}"] if extra else [])
            yield (
                f"{prefix}.*.{rest}",
                (f"{prefix}.<j>.{rest}: experts {_ranges(sorted(idx))} of num_experts {e}: {'; '.join(parts)}"),
            )


def _own_num_experts(cfg: dict[str, Any] | None) -> int | None:
    v = config_value(cfg, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


@rule("M025")
def per_expert_incomplete(ctx: Context) -> Iterator[tuple[str, str]]:
    """Per-expert ``<p>.experts.<j>.<proj>.weight`` of one fused tensor (gate + up, down) that do not all cover
    ``0..E-1``: what ``import`` refuses (E601) as it fuses them. ``E``: the ``num_experts`` of the folder's own
    ``config.json``, else one more than the highest expert any per-expert tensor of the module has. With a ``--config``
    that gives ``num_experts``, ``M002`` judges the coverage against it instead."""
    from ckpttool.model.hf_forms import forms_for

    if ctx.config is not None and _num_experts(ctx) is not None:
        return  # M002
    cfg = ctx.config if ctx.config is not None else ctx.quant_config  # without --config: the folder's own
    n_cfg = _own_num_experts(cfg)
    mt = config_value(cfg, "model_type")
    keys = [k for k in ctx.cat.model if ".experts." in k]
    used: set[str] = set()
    for form in forms_for(mt if isinstance(mt, str) else None):
        groups: dict[str, dict[str, dict[int, str]]] = {}
        for k in keys:
            m = form.pattern.match(k)
            if m and k not in used:
                groups.setdefault(m["p"], {}).setdefault(m["proj"], {})[int(m["j"])] = k
        for prefix, projs in sorted(groups.items()):
            for _fused, parts in form.fused():
                got = [projs.get(p, {}) for p in parts]
                if not any(got):
                    continue
                n = n_cfg or max(max(g) for g in projs.values() if g) + 1  # the module's experts, as import
                for p, g in zip(parts, got):
                    missing, extra = _missing(set(g), n), sorted(i for i in g if i >= n)
                    if missing or extra:
                        why = ([f"missing {missing}"] if missing else []) + (
                            [f"out of range {_ranges(extra)}"] if extra else []
                        )
                        yield (
                            f"{prefix}.experts.*.{p}.weight",
                            f"{prefix}.experts.<j>.{p}.weight: per-expert tensors for experts {_ranges(sorted(g))} "
                            f"but the model has {n:,}: {'; '.join(why)}",
                        )
                used.update(k for g in got for k in g.values())


@rule("M028")
def hf_config_unreadable(ctx: Context) -> Iterator[tuple[str, str]]:
    """A Hugging Face safetensors folder's own ``config.json`` that cannot be read as a config
    (:attr:`Context.own_hf_config`): ``from_pretrained`` reads it before any
    weight and fails. No finding without one (a folder of weights alone), or for a DCP checkpoint."""
    if ctx.ckpt.metadata.serialization != "safetensors":
        return
    error = ctx.own_hf_config[1]
    if error is not None:
        yield "config.json", error.message


@rule("M003")
def tied_head_differs(ctx: Context) -> Iterator[tuple[str, str]]:
    if not tie_word_embeddings(ctx.config):
        return
    head, emb = ctx.cat.tied_keys()
    if head is None or emb is None:
        return
    h, m = ctx.cat.model[head], ctx.cat.model[emb]
    if h.shape != m.shape or h.dtype != m.dtype:
        yield head, f"{head}: {h.dtype}{list(h.shape)} vs {emb} {m.dtype}{list(m.shape)} with tie_word_embeddings true"
        return
    dr = ctx.deep_result
    for p in dr.pairs if dr is not None else ():
        if p.kind == "tied" and p.compared and p.mismatched:
            where = f"in {p.mismatched} of {p.numel} elements ({p.differences()})"
            yield head, f"{head}: differs from {emb} {where} although tie_word_embeddings is true"


@rule("M004")
def untied_head_missing(ctx: Context) -> Iterator[tuple[str, str]]:
    if tie_word_embeddings(ctx.config):
        return
    if config_value(ctx.config, "vocab_size") is None and config_value(ctx.config, "num_hidden_layers") is None:
        return  # not a language-model config
    head, emb = ctx.cat.tied_keys()
    if head is None and emb is not None:
        from ckpttool.model.hf_forms import model_key

        model_type = config_value(ctx.config, "model_type")
        if any(model_key(k, model_type) == "lm_head.weight" for k in ctx.cat.model):
            return  # stored under the name from_pretrained renames (GPT-NeoX's embed_out.weight)
        if "lm_head.weight" in (_adapter_names(ctx) or ()):
            return  # a model adapter's head (Megatron's output_layer.weight), exported as lm_head.weight
        key = ctx.cat.model_key("lm_head.weight")
        yield key, f"{key} is missing and tie_word_embeddings is not true"


# ------------------------------------------------------------------------------------------ --against
@dataclass(frozen=True)
class _Ours:
    """A checkpoint model tensor under the HF name ``--against`` compares: the checkpoint key findings name, the
    shape and dtype; ``via``: the model adapter the name and shape went through (``None``: the checkpoint's own)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    via: str | None = None

    def label(self, name: str) -> str:
        """How a finding names it: the checkpoint key, and the HF name where an adapter gave it."""
        return self.key if self.via is None else f"{self.key} (as {name} through {self.via})"


def _ckpt_names(ctx: Context) -> dict[str, _Ours]:
    """HF name -> :class:`_Ours` of every model tensor; :class:`RuleSkipped` when the checkpoint's names are not
    HF's and no model adapter maps them (see :func:`_against_names`)."""
    names: dict[str, _Ours]
    skip: str | None
    names, skip = ctx.once("against_names", lambda: _against_names(ctx))
    if skip is not None:
        raise RuleSkipped(skip)
    return names


def _against_names(ctx: Context) -> tuple[dict[str, _Ours], str | None]:
    """:func:`_ckpt_names`' names and, where they cannot be compared, why (once per validation: M005-M008 and the
    fused-expert cover each ask).

    A checkpoint whose names are a model adapter's (torchtitan's, Megatron's) is compared under the names and
    shapes ``export`` writes through that adapter (RoPE rows, fused or stacked tensors split), with ``--config`` or
    else the reference's own ``config.json`` for the dimensions; where neither gives them, why."""
    from ckpttool.errors import CkptError
    from ckpttool.model.adapters import detect_adapter
    from ckpttool.ops.export.execute import written_sources

    names = {ctx.cat.fqn_of(k): _Ours(k, t.shape, t.dtype) for k, t in ctx.cat.model.items()}
    if ctx.reference is not None and 2 * len(names.keys() & ctx.reference.tensors.keys()) >= len(names):
        return names, None  # the reference speaks the checkpoint's names (a key list of them): compared as they are
    config = ctx.config if ctx.config is not None else ctx.reference.config if ctx.reference is not None else None
    adapter = detect_adapter(ctx.cat.schema.naming, ctx.cat.param_fqns, config)
    if adapter is None or adapter.name == "hf":
        return names, None
    try:
        plan = _export_plan(ctx, config, drop_tied=False)
    except CkptError as e:
        return names, (
            f"the checkpoint's model keys are {adapter.name} names, the reference's Hugging Face names, and they "
            f"cannot be mapped to them ({e.message}): pass the model's config.json with --config, or compare with "
            "`ckpttool diff CHECKPOINT REF` (through the adapter)"
        )
    return {
        name: _Ours(key, tuple(shape), dtype, adapter.name) for name, shape, dtype, key in written_sources(plan)
    }, None


def _fused_cover(ctx: Context, ref_names: set[str]) -> dict[str, str]:
    """Reference per-expert names covered by a fused tensor of :func:`_ckpt_names` -> that tensor's HF name."""
    cover: dict[str, str] = {}
    names = _ckpt_names(ctx)
    for name in ref_names:
        m = _EXPERT_RE.match(name)
        if not m or m["rest"] not in _PER_EXPERT_PROJ:
            continue
        fused = f"{m['prefix']}.{_PER_EXPERT_PROJ[m['rest']]}"
        ours = names.get(fused)
        if ours is not None and ours.shape and int(m["idx"]) < ours.shape[0]:
            cover[name] = fused
    return cover


def _tied(ctx: Context) -> bool | None:
    assert ctx.reference is not None
    if ctx.reference.tie_word_embeddings is not None:
        return ctx.reference.tie_word_embeddings
    return tie_word_embeddings(ctx.config)


def _unread_tie(ctx: Context, tied: bool | None) -> str | None:
    """Why the tie of the head is not known because the reference's ``config.json`` could not be read (its
    ``tie_word_embeddings`` would have decided), else ``None``: the head is then reported, never passed over."""
    assert ctx.reference is not None
    if tied is not None or ctx.reference.config_problem is None:
        return None
    return f"whether lm_head is tied to the embedding is not known: {ctx.reference.config_problem}"


_UNREAD_HINT = "fix the reference's config.json (its tie_word_embeddings says whether lm_head.weight is expected)"


def _tied_head(name: str, tied: bool | None, names: Collection[str]) -> bool:
    """``name`` is an ``lm_head.weight`` that may be tied (``tied`` not ``False``) to an embedding of ``names`` that
    transformers' model classes tie it to (:func:`~ckpttool.model.hfconfig.tied_embedding_key`), or to one named
    ``...embed_tokens.weight`` under another prefix (an older multimodal save's ``language_model.model.``)."""
    if not name.endswith("lm_head.weight") or tied is False:
        return False
    return tied_embedding_key(names) is not None or any(n.endswith("embed_tokens.weight") for n in names)


def _given(ctx: Context, what: str) -> None:
    """Raise :class:`RuleSkipped` unless the ``--against`` reference gives the ``shape`` / ``dtype`` of a key (a key
    list, or an index whose safetensors files are not beside it, gives names only: nothing to compare)."""
    assert ctx.reference is not None
    if not any(getattr(rt, what) is not None for rt in ctx.reference.tensors.values()):
        raise RuleSkipped(
            f"the reference {ctx.reference.source} gives no {what}s (a key list, or an index without its safetensors)"
        )


@rule("M005")
def missing_keys(ctx: Context) -> Iterator[tuple[str, str] | tuple[str, str, str]]:
    assert ctx.reference is not None
    names = _ckpt_names(ctx)
    ref = ctx.reference.tensors
    cover = _fused_cover(ctx, set(ref))
    tied = _tied(ctx)
    via = next((o.via for o in names.values() if o.via is not None), None)
    for name in ref:
        if name in names or name in cover:
            continue
        key = ctx.cat.model_key(name) if via is None else name
        missing = "not in the checkpoint" if via is None else f"not written from the checkpoint through {via}"
        if _tied_head(name, tied, names):
            unread = _unread_tie(ctx, tied)
            if unread is not None:
                yield (
                    key,
                    f"{key}: in the reference {ctx.reference.source} but {missing}; {unread}",
                    _UNREAD_HINT,
                )
            continue  # tied embeddings: the head is the embedding
        yield key, f"{key}: in the reference {ctx.reference.source} but {missing}"


@rule("M006")
def unexpected_keys(ctx: Context) -> Iterator[tuple[str, str] | tuple[str, str, str]]:
    assert ctx.reference is not None
    names = _ckpt_names(ctx)
    ref = ctx.reference.tensors
    covered = set(_fused_cover(ctx, set(ref)).values())
    tied = _tied(ctx)
    for name, ours in names.items():
        if name in ref or name in covered:
            continue
        label = ours.label(name)
        if _tied_head(name, tied, ref):
            unread = _unread_tie(ctx, tied)
            if unread is not None:
                yield ours.key, f"{label}: not in the reference {ctx.reference.source}; {unread}", _UNREAD_HINT
            continue  # HF drops a tied head from the saved weights
        yield ours.key, f"{label}: not in the reference {ctx.reference.source}"


@rule("M007")
def shape_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.reference is not None
    names = _ckpt_names(ctx)
    ref = ctx.reference.tensors
    _given(ctx, "shape")
    for name, rt in ref.items():
        ours = names.get(name)
        if ours is not None and rt.shape is not None and tuple(rt.shape) != ours.shape:
            yield ours.key, f"{ours.label(name)}: shape {list(ours.shape)}, reference {list(rt.shape)}"
    seen: set[str] = set()
    for name, fused in _fused_cover(ctx, set(ref)).items():
        rt, ours = ref[name], names[fused]
        if rt.shape is None or fused in seen or len(ours.shape) != 3 or len(rt.shape) != 2:
            continue
        rest = _EXPERT_RE.match(name)["rest"]  # type: ignore[index]
        want = (rt.shape[0] * 2, rt.shape[1]) if _PER_EXPERT_PROJ[rest] == "gate_up_proj" else tuple(rt.shape)
        if ours.shape[1:] != want:
            seen.add(fused)
            yield (
                ours.key,
                f"{ours.label(fused)}: fused shape {list(ours.shape)} does not match per-expert {name} {list(rt.shape)}",
            )


@rule("M008")
def dtype_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.reference is not None
    names = _ckpt_names(ctx)
    _given(ctx, "dtype")
    for name, rt in ctx.reference.tensors.items():
        ours = names.get(name)
        if ours is not None and rt.dtype is not None and rt.dtype != ours.dtype:
            yield ours.key, f"{ours.label(name)}: dtype {ours.dtype}, reference {rt.dtype}"


@rule("M009")
def non_persistent_buffer_saved(ctx: Context) -> Iterator[tuple[str, str]]:
    keys = ctx.cat.non_persistent_buffers()
    if keys:
        more = f" (+{len(keys) - 1} more)" if len(keys) > 1 else ""
        yield keys[0], f"{keys[0]}{more}: a non-persistent buffer saved as a model tensor"


def _export_plan(ctx: Context, config: dict[str, Any] | None, *, drop_tied: bool) -> Any:
    """The plan ``export`` makes of the model tensors with ``config`` (an HF ``config.json``): the names, shapes and
    dtypes it writes (``drop_tied``: less a tied ``lm_head.weight``, as export leaves it out).

    Raises:
        CkptError: the tensors cannot be mapped to Hugging Face names (an adapter without the dimensions it needs).
    """
    from ckpttool.model.adapters import AdapterConfig
    from ckpttool.ops.export.execute import ExportOptions, export_adapter
    from ckpttool.ops.export.plan import build_plan, select_sources
    from ckpttool.ops.export.rules import load_rules

    rules = load_rules(None)
    adapter = export_adapter(ctx.cat, ExportOptions(), config)
    selected, _, _, _ = select_sources(
        ctx.cat, rules, adapter=adapter, adapter_config=AdapterConfig.from_hf_config(config)
    )
    tie = drop_tied and tie_word_embeddings(config) is True
    drop = {rules.tied_lm_head} if tie and rules.tied_embedding_in({s.out_key for s in selected}) else set()
    return build_plan(selected, rules, drop=drop)


def _model_class_check(ctx: Context) -> tuple[Any, str | None]:
    """The export plan's tensors (names as ``export`` writes them) compared with the config's model class."""
    from ckpttool.errors import CkptError
    from ckpttool.model.hf_forms import fold_expert_forms
    from ckpttool.ops.export.execute import without_fp8_scales, written_tensors
    from ckpttool.ops.export.expected import compare_with_model

    assert ctx.config is not None
    try:
        plan = _export_plan(ctx, ctx.config, drop_tied=True)
    except CkptError as e:
        return None, f"the tensors cannot be mapped to Hugging Face names ({e.message})"
    mt = config_value(ctx.config, "model_type")
    want = config_value(ctx.config, "dtype") or config_value(ctx.config, "torch_dtype")
    fused = fold_expert_forms(
        without_fp8_scales(written_tensors(plan)),
        mt if isinstance(mt, str) else None,
        want if isinstance(want, str) else None,
    )
    return compare_with_model(fused, ctx.config), None


@rule("M010")
def model_class_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    check, why = _model_class_check(ctx)
    if check is None or not check.checked:  # M011 says why; M010 never "passed" over a comparison not made
        raise RuleSkipped(f"model class not checked: {why if why is not None else check.not_checked}")
    for kind, lines in check.findings.items():
        for line in lines:
            key = line.split(" ", 1)[0].rstrip(":")
            yield key, f"{kind}: {line} ({check.model_class})"


@rule("S017")
def rank_shards_unproven(ctx: Context) -> Iterator[tuple[str, str]]:
    why = ctx.ckpt.unproven_shards()
    if why is None:
        return
    if ctx.config is not None:
        check, problem = _model_class_check(ctx)
        if problem is None and check is not None and check.checked:
            return  # M010 compared every key and shape with the model class: any shortfall is its error
    yield str(ctx.ckpt.located.model), why


@rule("M011")
def model_class_not_checked(ctx: Context) -> Iterator[tuple[str, str]]:
    check, why = _model_class_check(ctx)
    if why is not None:
        yield "config", f"keys and shapes not checked against the model class: {why}"
    elif check is not None and not check.checked:
        yield "config", f"keys and shapes not checked against the model class: {check.not_checked}"
