"""Detection of a checkpoint's key schema: by structure, asking the registered specs in priority order.

Detection (:func:`detect_schema`) reads ``planner_data`` (the nesting of the saved state dict:
``("model", "<fqn>")`` vs ``("model.layers.0.x",)``) when the checkpoint has it, else the key
prefixes; the model-prefix candidates come from the specs' model containers, the optimizer
prefixes from their optimizer heads, and the optimizer's fqns must name the model tensors. The
first registered spec that claims the findings names the schema; the result says why
(:attr:`KeySchema.reasons`). A :class:`SchemaOverride` (``--schema``, ``--model-prefix``,
``--optimizer-prefix``) replaces detection. The naming convention of the model fqns (``hf``:
``model.layers.N.self_attn.q_proj.weight``; ``torchtitan``: ``layers.N.attention.wq.weight``)
is reported separately: exports to Hugging Face names need ``hf`` naming. Param groups are
``<optimizer prefix>param_groups.<i>.<hyper>`` (nested) or ``...param_groups.<fqn>.<hyper>``
(flattened). A plain ``optimizer.state_dict()`` keys state by parameter *index*
(``optimizer.state.0.exp_avg``): its ``optimizer_keying`` is ``"index"``, which no command can
map to parameters. Torch-free; metadata only.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice, repeat
from typing import Any, cast

from ckpttool.errors import SchemaError
from ckpttool.format.metadata import CheckpointMetadata, TensorMeta
from ckpttool.model.nested_state import describe_nested, nested_state_items
from ckpttool.model.schemas import registry
from ckpttool.model.schemas.base import COUNTER_ITEMS, Detected, split_per_parameter_key
from ckpttool.model.schemas.keyschema import KeySchema, SchemaOverride, model_head
from ckpttool.model.schemas.registry import Derived
from ckpttool.model.wrappers import WRAPPER_SEGMENTS, strip_wrapper_segments

__all__ = ["detect_schema", "fused_parts", "model_naming", "planner_paths"]

_Path = tuple[Any, ...] | None
# torchtitan naming (torchtitan/models/*: Decoder with tok_embeddings, layers.N.attention / feed_forward / moe).
_TITAN_RE = re.compile(
    r"^(?:tok_embeddings\.weight|output\.weight|layers\.\d+\.(?:attention|feed_forward|moe|attention_norm|ffn_norm)\.)"
)
# Hugging Face transformers naming (LlamaForCausalLM, Qwen3MoeForCausalLM, PEFT wrappers ...).
_HF_RE = re.compile(
    r"(?:^|\.)(?:embed_tokens\.weight|lm_head\.weight|layers\.\d+\.(?:self_attn|mlp|input_layernorm)\.)"
)
_OPT_PARTS = ("state", "param_groups")
# torchtune naming (torchtune/modules/transformer.py: TransformerSelfAttentionLayer attn / sa_norm / mlp_norm).
_TUNE_RE = re.compile(
    r"^(?:norm\.scale|layers\.\d+\.(?:attn\.(?:q_proj|k_proj|v_proj|output_proj)|sa_norm|mlp_norm)\.)"
)
# Megatron-core naming (megatron/core/models/gpt/gpt_model.py: embedding, decoder with layers stacked
# in sharded state dicts, output_layer).
_MEGATRON_RE = re.compile(
    r"^(?:embedding\.word_embeddings\.weight|output_layer\.weight|decoder\.(?:layers|final_layernorm)\.)"
)


def planner_paths(md: CheckpointMetadata) -> dict[str, tuple[Any, ...]]:
    """The ``planner_data`` paths that flatten to their own key: the nesting of the saved state dict.

    torch's ``DefaultSavePlanner`` flattens a nested state dict into keys
    ``".".join(map(str, path))`` (``torch/distributed/checkpoint/_nested_dict.py``,
    ``flatten_state_dict``) and records each path in ``planner_data``. A custom planner may
    store anything there; a path that does not join to its key says nothing about the key's
    nesting and is left out (the key is then read by its prefixes, as without planner data).

    Returns:
        key -> path, a subset of ``md.planner_data`` (the same dict when every path is consistent).
    """
    planner = md.planner_data
    cached = md.__dict__.get("_planner_paths")  # detection and the catalog ask for the same one
    if cached is not None and cached[0] is planner and cached[1] == len(planner):
        return cast(dict[str, tuple[Any, ...]], cached[2])
    bad = _unjoined(planner)
    out = planner
    if bad:
        out = dict(planner)
        for k in bad:
            del out[k]
    md.__dict__["_planner_paths"] = (planner, len(planner), out)  # a cache on the frozen object, not a field
    return out


def _unjoined(planner: dict[str, tuple[Any, ...]]) -> list[str]:
    """The keys ``k`` of ``planner`` with ``".".join(map(str, planner[k])) != k``, in order.

    A path of ``str`` items (nearly all of them) is joined in C as it is (``str(x) is x`` for the
    parser's exact ``str``); a path holding an int makes ``str.join`` refuse it, and it is then
    joined through ``str``. After :data:`_JOIN_RETRIES` such paths, the rest are all joined through ``str``.
    """
    keys, paths = list(planner), list(planner.values())
    key_it, path_it = iter(keys), iter(paths)
    bad: list[str] = []
    done = retries = 0
    while True:
        joined = map(".".join, path_it) if retries < _JOIN_RETRIES else map(".".join, map(map, repeat(str), path_it))
        try:
            for k, text in zip(key_it, joined):  # zip takes the key first, then the joined path
                if text != k:
                    bad.append(k)
                done += 1
            return bad
        except TypeError:  # the path of keys[done] holds a non-str item: joined through str
            k = keys[done]
            if ".".join(map(str, paths[done])) != k:
                bad.append(k)
            done += 1
            retries += 1


_JOIN_RETRIES = 1000


def fused_parts(fqn: str, model_keys: set[str], model_prefix: str) -> tuple[str, ...] | None:
    """Model keys a fused optimizer parameter is stored as, or ``None``.

    torchtitan's ``FusedQKVLinear`` steps ``<p>.wqkv.weight`` but its state-dict hook saves
    ``<p>.wq.weight``, ``<p>.wk.weight``, ``<p>.wv.weight`` (head-interleaved rows,
    ``torchtitan/models/common/attention.py``).
    """
    for rx, templates in registry.derived().fused_rules:
        m = rx.match(fqn)
        if m is None:
            continue
        keys = tuple(model_prefix + t.format(**m.groupdict()) for t in templates)
        if all(k in model_keys for k in keys):
            return keys
    return None


def model_naming(fqns: list[str]) -> str:
    """``"torchtitan"``, ``"hf"``, ``"megatron"``, ``"torchtune"`` or ``"unknown"``: the naming convention most model fqns follow."""
    if not fqns:
        return "unknown"
    megatron = sum(1 for f in fqns if _MEGATRON_RE.search(f))
    if megatron * 2 > len(fqns):
        return "megatron"
    if sum(1 for f in fqns if _TUNE_RE.search(f)) * 2 > len(fqns):
        return "torchtune"
    titan = sum(1 for f in fqns if _TITAN_RE.search(f))
    hf = sum(1 for f in fqns if _HF_RE.search(f))
    if titan > hf and titan * 4 >= len(fqns):
        return "torchtitan"
    if hf and hf >= titan:
        return "hf"
    return "unknown"


def _optimizer_prefix_of(key: str, path: _Path, heads: frozenset[str]) -> str | None:
    """``"optimizer."`` / ``"app.optim."`` when ``key`` is an optimizer state or group key (``heads``: optimizer heads)."""
    if path is not None and len(path) >= 2:
        p0 = path[0]
        if p0 in heads:
            rest = path[1]
            if isinstance(rest, str) and (rest in _OPT_PARTS or rest.startswith(("state.", "param_groups."))):
                pre = f"{p0}."
                if key.startswith(pre):
                    return pre
        elif len(path) >= 3 and isinstance(p0, str) and path[1] in heads:
            rest = path[2]
            if isinstance(rest, str) and (rest in _OPT_PARTS or rest.startswith(("state.", "param_groups."))):
                pre = f"{p0}.{path[1]}."
                if key.startswith(pre):
                    return pre
        return None  # the nesting is known and it is not an optimizer's
    parts = key.split(".", 3)
    if len(parts) > 2 and parts[0] in heads and parts[1] in _OPT_PARTS:
        return f"{parts[0]}."
    if len(parts) > 3 and parts[0] not in heads and parts[1] in heads and parts[2] in _OPT_PARTS:
        return f"{parts[0]}.{parts[1]}."
    return None


def _in_container(container: tuple[str | None, ...], parts: Any, heads: frozenset[str] | None) -> bool:
    """``parts`` (path or key components) fill ``container`` (``None``: any str, not an optimizer head when ``heads``)."""
    for c, p in zip(container, parts):
        if c is None:
            if not isinstance(p, str) or (heads is not None and p in heads):
                return False
        elif p != c:
            return False
    return True


def _key_matcher(container: tuple[str | None, ...], heads: frozenset[str]) -> Callable[[str], str | None]:
    """For keys without a planner path: the prefix of ``key`` when it fills ``container`` (and more follows)."""
    if None not in container:
        fixed = ".".join(cast(tuple[str, ...], container)) + "."
        n = len(fixed)
        return lambda key: fixed if len(key) > n and key.startswith(fixed) else None
    if len(container) == 2 and container[0] is None and container[1] is not None:  # <app>.model.
        second_name = container[1]

        def app(key: str) -> str | None:
            head, _, rest = key.partition(".")
            second, _, rest2 = rest.partition(".")
            return f"{head}.{second}." if second == second_name and rest2 and head not in heads else None

        return app
    m = len(container)

    def general(key: str) -> str | None:
        parts = key.split(".", m)
        if len(parts) > m and parts[m] and _in_container(container, parts, heads):
            return key[: len(key) - len(parts[m])]
        return None

    return general


def _simple(containers: list[tuple[str | None, ...]]) -> list[tuple[bool, str]] | None:
    """``(nested under an app, name)`` per container when each is ``(name,)`` or ``(None, name)``, else ``None``."""
    out = []
    for c in containers:
        if len(c) == 1 and c[0] is not None:
            out.append((False, c[0]))
        elif len(c) == 2 and c[0] is None and c[1] is not None:
            out.append((True, c[1]))
        else:
            return None
    return out


def _candidate_test(known: Derived) -> Callable[[str, _Path], str | None]:
    """``(key, path) ->`` the model prefix a tensor key suggests: ``""`` (top level) or a spec's
    container (``"model."``, ``"<app>.model."``); ``None``: none (see :attr:`Derived.containers`)."""
    heads = frozenset(known.optimizer_heads)
    containers = [c for c, _ in known.containers]
    simple = _simple(containers)
    by_key = [_key_matcher(c, heads) for c in containers]
    items = known.training_state_items

    def by_prefix(key: str) -> str | None:
        if simple is None:
            return next((found for found in (m(key) for m in by_key) if found is not None), None)
        head, _, rest = key.partition(".")
        for nested, name in simple:  # the containers' order: the first that fits
            if not nested:
                if head == name and rest:
                    return f"{name}."
                continue
            second, _, rest2 = rest.partition(".")
            if second == name and rest2 and head not in heads:
                return f"{head}.{name}."
        return None

    def candidate(key: str, path: _Path) -> str | None:
        if path is not None:
            n = len(path)
            if n == 1:  # a top-level tensor: the model's, unless a training-state item ("step", "rng_state")
                return "" if key not in items else None
            for container in containers:
                if n == len(container) + 1 and _in_container(container, path, None):
                    return ".".join(path[:-1]) + "."
            return None
        found = by_prefix(key)
        if found is not None:
            return found
        head = key.partition(".")[0]
        if head in heads or head in items or key == "layout":
            return None
        return ""

    return candidate


def _starts_with_fqn(rest: str, model_fqns: set[str]) -> bool:
    """Whether ``rest`` is a model fqn followed by at least one more dotted part (the state's field)."""
    parts = rest.split(".")
    return any(".".join(parts[:i]) in model_fqns for i in range(1, len(parts)))


def _index_keyed(state: list[tuple[str, _Path]], state_prefix: str, model_fqns: set[str]) -> bool:
    """Optimizer state keyed by integer parameter ids (a plain ``optimizer.state_dict()``)."""
    firsts = {f.split(".", 1)[0] for f in model_fqns}
    seen = False
    for key, path in state:
        if not key.startswith(state_prefix):
            continue
        seen = True
        if path is not None and len(path) >= 4 and isinstance(path[-2], int):
            continue
        if path is not None and isinstance(path[-1], str) and path[-1].startswith("state."):
            return False  # flattened by get_optimizer_state_dict (flatten_optimizer_state_dict=True), which keys by fqn
        if path is not None and "state" in (above := path[:-2]):
            param = path[len(above) - above[::-1].index("state")]  # after the optimizer's own (last) "state"
            if isinstance(param, str) and not param.isdecimal():
                # planner_data holds the state dict's own key: a name ('0.weight' of an nn.Sequential whose
                # model keys carry another prefix), not the integer id of a plain optimizer.state_dict() ('0')
                return False
        rest = key[len(state_prefix) :]
        head = rest.split(".", 1)[0]
        # a model whose fqns start with digits (nn.Sequential: 0.weight): by fqn only where the key starts with
        # one of them (state.0.weight.exp_avg, nested state.0.weight.shampoo.factor), by index where it starts
        # with the number alone (state.0.exp_avg)
        if not head.isdecimal() or (head in firsts and _starts_with_fqn(rest, model_fqns)):
            return False
    return seen


@dataclass
class _Scan:
    """One pass over the entries: the votes for the prefixes."""

    tensors: list[str] = field(default_factory=list)
    opt_votes: Counter[str] = field(default_factory=Counter)
    model_votes: Counter[str] = field(default_factory=Counter)
    tops: set[str] = field(default_factory=set)
    opt_keys: list[tuple[str, str, _Path]] = field(default_factory=list)


def _scan(md: CheckpointMetadata, get: Any, known: Derived) -> _Scan:
    s = _Scan()
    heads = frozenset(known.optimizer_heads)
    tensors, tops, opt_votes, model_votes = s.tensors, s.tops, s.opt_votes, s.model_votes
    # tensors at ("model", <fqn>): the common case, counted without the two calls (valid while a spec
    # nests its model under "model" and no optimizer is called "model")
    fast: object = "model" if (("model",) in (c for c, _ in known.containers) and "model" not in heads) else object()
    n_model_paths = 0
    candidate = _candidate_test(known)
    for key, meta in md.entries.items():
        path = get(key)
        if path is not None and len(path) == 2 and path[0] == fast and type(meta) is TensorMeta:
            # what the general code below does for them: not an optimizer key (_optimizer_prefix_of: None),
            # a tensor whose model prefix candidate is "model." (_candidate_test)
            if not n_model_paths:
                tops.add("model")
                model_votes["model."] += 0  # first seen here: the votes keep their order of first appearance
            n_model_paths += 1
            tensors.append(key)
            continue
        top = path[0] if path else key.partition(".")[0]
        if type(top) is str:
            tops.add(top)
        pre = _optimizer_prefix_of(key, path, heads)
        if pre is not None:
            opt_votes[pre] += 1
            s.opt_keys.append((pre, key, path))
            continue
        if type(meta) is TensorMeta:
            tensors.append(key)
            mp = candidate(key, path)
            if mp is not None:
                model_votes[mp] += 1
    if n_model_paths:
        model_votes["model."] += n_model_paths
    return s


def _choose_model_prefix(votes: Counter[str], planner: bool, md: CheckpointMetadata, reasons: list[str]) -> str | None:
    if not votes:
        return None
    named = [p for p in votes if p]
    if not named:
        return ""
    if not planner:
        # Key prefixes only. A flat state dict whose fqns start with "model." (an HF causal
        # LM: model.layers.N..., lm_head.weight) cannot be told from {"model": ...} by the
        # keys; loose top-level tensors beside them, or safetensors storage (always a flat
        # HF state dict), decide for the flat reading; the optimizer's fqns decide below.
        if "" in votes or md.serialization == "safetensors":
            reasons.append(
                "keys under 'model.' are taken as fqns of a flat state dict ("
                + ("loose top-level tensors beside them" if "" in votes else "safetensors storage")
                + "); --schema torch-native reads them as {'model': ...}"
            )
            return ""
    # planner_data shows the containers: ``model`` / ``<app>.model`` win over loose
    # top-level tensors, which then count as "other".
    return max(named, key=lambda p: (votes[p], p == "model."))


def _prefix_options(tensors: list[str], known: Derived) -> list[str]:
    """The model prefixes the optimizer's fqns are tried under: the specs' fixed ones, then the wildcard ones seen."""
    fixed_heads = {c[0] for c, _ in known.containers if None not in c}
    seen: set[str] = set()
    for container, _ in known.containers:
        if None not in container:
            continue
        n = len(container)
        if n == 2 and container[0] is None and container[1] is not None:  # <app>.model.: one split per key
            name = container[1]
            seen.update(f"{k.partition('.')[0]}.{name}." for k in tensors if k.split(".", 2)[1:2] == [name])
            continue
        for k in tensors:
            parts = k.split(".", n)
            if len(parts) >= n and _in_container(container, parts, None):
                seen.add(".".join(parts[:n]) + ".")
    return [*known.fixed_prefixes, *sorted(p for p in seen if p.partition(".")[0] not in fixed_heads)]


_WRAPPER_HEADS = tuple(f"{seg}." for seg in WRAPPER_SEGMENTS)
#: Most leading wrapper segments taken into a model prefix (DDP of a compiled, checkpoint-wrapped FSDP1 model has
#: 4): each prefix is a string as long as its segments, so 10^5 segments in one key would cost ~10^10 bytes.
_MAX_WRAPPER_DEPTH = 8


def _wrapped_prefixes(tensors: list[str], options: list[str]) -> list[str]:
    """Each option followed by the wrapper segments that lead the keys below it (``model._orig_mod.``,
    ``model.module.``: ``dcp.save({"model": compiled_or_ddp.state_dict(), "optimizer": get_optimizer_state_dict(...)})``,
    whose optimizer names the parameters without them); at most ``_MAX_WRAPPER_DEPTH`` segments."""
    found: set[str] = set()
    for k in tensors:
        for p in options:
            if not k.startswith(p) or not k.startswith(_WRAPPER_HEADS, len(p)):
                continue
            parts = k[len(p) :].split(".")
            n = 0
            while n < min(len(parts) - 1, _MAX_WRAPPER_DEPTH) and parts[n] in WRAPPER_SEGMENTS:
                n += 1
            found.update(p + ".".join(parts[:i]) + "." for i in range(1, n + 1))
    return sorted(found - set(options))


def _optimizer_fqns_rule(
    scan: _Scan, state: list[tuple[str, _Path]], state_prefix: str, model_prefix: str | None, reasons: list[str]
) -> str | None:
    """The model prefix under which the optimizer's fqns are model keys, when it names more than ``model_prefix`` does.

    The optimizer names the parameters: that prefix wins over the nesting planner_data shows (a
    checkpoint re-saved as a flat dict keeps "model.<fqn>" keys at the top level). Field names
    hold no dots: head = key minus field. ``None``: ``model_prefix`` stands.
    """
    heads = {k[len(state_prefix) :].rpartition(".")[0] for k, _ in state}
    loose = scan.tensors

    def matches(prefix: str) -> int:
        n = len(prefix)
        return sum(1 for k in loose if k.startswith(prefix) and k[n:] in heads)

    options = _prefix_options(loose, registry.derived())
    scores = {p: matches(p) for p in options}
    if max(scores.values(), default=0) < len(heads):  # fqns no prefix names: a wrapped model's keys?
        wrapped = _wrapped_prefixes(loose, options)
        options += wrapped
        scores.update((p, matches(p)) for p in wrapped)
    best = max(options, key=lambda p: (scores[p], p == model_prefix))
    current = scores.get(model_prefix, 0) if model_prefix is not None else 0
    if scores[best] <= current:
        return None
    if model_prefix is not None:
        reasons.append(
            f"the optimizer's fqns name the model keys under {best!r} "
            f"({'top level' if not model_prefix else repr(model_prefix)} by the nesting of the keys)"
        )
    return best


def _keying(sch: KeySchema, tensors: list[str], state: list[tuple[str, _Path]], state_prefix: str, get: Any) -> str:
    index = bool(state) and all(
        (p is not None and len(p) >= 4 and isinstance(p[-2], int))
        or k[len(state_prefix) :].split(".", 1)[0].isdecimal()
        for k, p in state
    )
    if index:  # digits could also be the first fqn component of an nn.Sequential model
        index = _index_keyed(state, state_prefix, {sch.fqn_of(k) for k in tensors if sch.is_model_candidate(k, get(k))})
    return "index" if index else "fqn"


def top_group_fqns(md: CheckpointMetadata, planner: dict[str, tuple[Any, ...]]) -> frozenset[str] | None:
    """The parameter fqns a flattened optimizer state dict at the top level names in its param groups (``lr`` of
    ``param_groups.<fqn>.lr``: ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, one planner
    path part), for :meth:`KeySchema.top_optimizer_test`; empty for nested groups (``param_groups.0.lr``, the path
    nests them); ``None`` without planner_data (the paths cannot tell)."""
    if not planner:
        return None
    n = len("param_groups.")
    return frozenset(
        k[n:].rpartition(".")[0]
        for k, m in md.entries.items()
        if k.startswith("param_groups.") and type(m) is not TensorMeta and len(planner.get(k) or ((),)) == 1
    )


def top_param_fqns(
    md: CheckpointMetadata, planner: dict[str, tuple[Any, ...]], opt_prefix: str | None
) -> frozenset[str]:
    """The top-level tensors that are parameters though their names are training-state items' (a model's parameter
    called ``step``: :meth:`KeySchema.model_test`): a counter's name (:data:`COUNTER_ITEMS`) on a tensor of other
    than one element, which no counter is; with an optimizer state dict at the top level (``opt_prefix`` ``""``),
    the fqns it is keyed by, its flattened param groups' (:func:`top_group_fqns`) and its state's (planner path
    ``("state", fqn, field)``, nested; none without planner_data); with one under a prefix (torchtitan's
    ``optimizer.``), such a top-level tensor whose fqn keys its state or its flattened param group
    (``optimizer.state.step.exp_avg``, ``optimizer.param_groups.step.lr``)."""
    sized = {k for k in COUNTER_ITEMS if type(m := md.entries.get(k)) is TensorMeta and m.numel != 1}
    if opt_prefix:
        return frozenset(sized).union(_keyed_by_optimizer(md, opt_prefix))
    if not planner or opt_prefix is None:
        return frozenset(sized)
    nested = (p[1] for k, p in planner.items() if len(p) == 3 and p[0] == "state" and type(p[1]) is str)
    return (top_group_fqns(md, planner) or frozenset()).union(nested, sized)


def _keyed_by_optimizer(md: CheckpointMetadata, opt_prefix: str) -> set[str]:
    """The top-level tensors named as training-state items (``step``) that the optimizer under ``opt_prefix`` keys
    as parameters: ``<opt_prefix>state.<name>.<field>`` or ``<opt_prefix>param_groups.<name>.<hyper>``."""
    entries = md.entries
    named = [t for t in registry.derived().training_state_items if type(entries.get(t)) is TensorMeta]
    if not named:
        return set()
    heads = {f"{opt_prefix}{part}.{t}.": t for t in named for part in ("state", "param_groups")}
    found = set()
    for key in entries:
        head, dot, last = key.rpartition(".")
        if dot and head + "." in heads and last:
            found.add(heads[head + "."])
    return found


def _optimizer_at_top(md: CheckpointMetadata, state: list[str]) -> bool:
    """torch's optimizer state dict saved at the top level: ``state.`` tensors beside ``param_groups.`` items that
    are not tensors (``params``, ``lr`` of each group: ``dcp.save(get_optimizer_state_dict(...))``, alone, merged
    into the model's state dict, or in the optimizer folder of a model/optimizer pair), or groups' ``lr`` items
    alone (an optimizer that keeps no state: SGD with momentum 0, or one not stepped yet): the optimizer prefix is
    then ``""``, and a top-level model does not claim those keys (:meth:`KeySchema.model_test`). A model with
    submodules called ``state`` and ``param_groups`` has tensors alone there."""
    groups = [(k, type(m) is TensorMeta) for k, m in md.entries.items() if k.startswith("param_groups.")]
    # an lr is a tensor where the optimizer was given one (SGD(params, lr=torch.tensor(0.1)))
    return not all(t for _, t in groups) and (bool(state) or any(k.endswith(".lr") for k, _ in groups))


def _optimizer_keys(
    md: CheckpointMetadata, scan: _Scan, get: Any, groups: frozenset[str] | None
) -> tuple[str | None, str, list[tuple[str, _Path]]]:
    """The optimizer prefix (``None``: no optimizer), its state prefix and its state keys with their planner paths
    (``groups``: :func:`top_group_fqns`)."""
    opt_prefix = scan.opt_votes.most_common(1)[0][0] if scan.opt_votes else None
    if opt_prefix is None:
        mine = KeySchema("unrecognized", None, "", _group_fqns=groups).top_optimizer_test()
        top = [(k, get(k)) for k in scan.tensors if k.startswith("state.") and mine(k, get(k))]
        if _optimizer_at_top(md, [k for k, _ in top]):
            return "", "state.", top
    state_prefix = f"{opt_prefix}state."
    return (
        opt_prefix,
        state_prefix,
        [(k, p) for pre, k, p in scan.opt_keys if pre == opt_prefix and k.startswith(state_prefix)],
    )


def _schema_id(found: Detected) -> str:
    """``unrecognized``, or the name of the first registered spec that claims ``found`` (``custom``: none)."""
    if found.model_prefix is None and found.optimizer_prefix is None:
        return "unrecognized"
    return next((s.name for s in registry.specs() if s.claims(found)), "custom")


def _closing_reasons(
    md: CheckpointMetadata,
    planner: bool,
    found: Detected,
    counted: tuple[int, bool],
    keying: str | None,
    fqns: list[str],
    per_parameter: str = "",
) -> list[str]:
    """The reasons after the prefixes' (``counted``: the number of model tensors, found by planner paths;
    ``per_parameter``: the optimizer item saved as one optimizer per parameter, :func:`_per_parameter_item`)."""
    reasons = []
    n_model, use_paths = counted
    how = "planner_data (the nesting of the saved state dict)" if planner else "key prefixes (no planner_data)"
    model_prefix, opt_prefix, naming = found.model_prefix, found.optimizer_prefix, found.naming
    nested = nested_state_items(md) if model_prefix is None and opt_prefix is None else []
    if nested:
        reasons.append(describe_nested(md, nested) + "; ckpttool reads none of it")
        return reasons
    if model_prefix is None and opt_prefix is None:
        entries = md.entries
        if not entries:
            reasons.append("the checkpoint holds no keys at all")
            return reasons
        reasons.append(
            f"no model tensors or optimizer state recognised among {len(entries)} key(s) "
            f"(e.g. {', '.join(repr(k) for k in list(entries)[:3])})"
        )
    if model_prefix is not None:
        where = f"under {model_prefix!r}" if model_prefix else "at the top level of the saved dict"
        reasons.append(f"{n_model} model tensor(s) {where}" + (f", found by {how}" if use_paths or not planner else ""))
    elif opt_prefix is not None:
        reasons.append("no model tensors: optimizer state only (pair it with its model checkpoint)")
    if opt_prefix is not None:
        where = f"under {opt_prefix!r}" if opt_prefix else "at the top level (torch's optimizer state dict as it is)"
        if per_parameter:
            reasons.append(PER_PARAMETER_REASON.format(item=per_parameter))
        elif keying == "index":
            reasons.append(f"optimizer state {where} is keyed by parameter index (a plain optimizer.state_dict())")
        else:
            reasons.append(f"optimizer state {where}, keyed by parameter fqn")
    if naming != "unknown":
        reasons.append(f"model fqns follow {naming} naming (e.g. {fqns[0]!r})" if fqns else f"{naming} naming")
    if found.training_state:
        reasons.append(f"training-state items: {', '.join(found.training_state)}")
    return reasons


def detect_schema(md: CheckpointMetadata, override: SchemaOverride | None = None) -> KeySchema:
    """The key schema of a checkpoint, detected from its keys and ``planner_data`` (or overridden).

    One pass over the entries, then a few set lookups.

    Args:
        md: the validated metadata.
        override: from :meth:`SchemaOverride.from_options` (replaces detection).

    Returns:
        The :class:`KeySchema`; ``id == "unrecognized"`` when no model tensor and no optimizer
        state were found (every key then counts as "other").

    Raises:
        SchemaError: an override whose model or optimizer prefix matches no key.
    """
    planner = planner_paths(md)
    if override is not None:
        return _overridden(md, override, [k for k, m in md.entries.items() if type(m) is TensorMeta])
    known = registry.derived()
    get = planner.get
    scan = _scan(md, get, known)
    reasons: list[str] = []
    groups = None if scan.opt_votes else top_group_fqns(md, planner)  # an optimizer under a prefix: not needed
    opt_prefix, state_prefix, state = _optimizer_keys(md, scan, get, groups)
    model_prefix = _choose_model_prefix(scan.model_votes, bool(planner), md, reasons)
    for spec in registry.specs():
        if spec.prefix_notes is not None:
            reasons.extend(spec.prefix_notes(model_prefix, opt_prefix))
    use_paths = bool(planner)
    best = _optimizer_fqns_rule(scan, state, state_prefix, model_prefix, reasons) if state else None
    if best is not None:
        model_prefix, use_paths = best, False
    sch = KeySchema(
        "unrecognized",
        model_prefix,
        opt_prefix,
        _model_head=model_head(model_prefix or ""),
        _use_paths=use_paths,
        _group_fqns=groups,
        _param_fqns=(params := top_param_fqns(md, planner, opt_prefix)),
    )
    test = sch.model_test()
    # the votes left out the parameters named as counters (params): counted with the test then
    voted = use_paths and opt_prefix != "" and not params
    n_model, sample = _model_sample(scan, test, get, model_prefix if voted else None)
    if model_prefix is not None and not n_model:
        model_prefix = None
    fqns = [sch.fqn_of(k) for k in sample]
    # a top-level name that is the model's own tensor (a parameter called `step`) is no training-state item
    training = tuple(sorted(t for t in scan.tops if t in known.training_state_items and not test(t, get(t))))
    keying = None if opt_prefix is None else _keying(sch, scan.tensors, state, state_prefix, get)
    found = Detected(
        model_prefix,
        opt_prefix,
        "" in scan.model_votes,
        model_naming(fqns),
        training,
        md.writer,
        tuple(fqns),
        bool(planner),
    )
    # a prefix ending in wrapper segments (model._orig_mod.) is its trainer's prefix with a wrapped model's keys
    unwrapped = strip_wrapper_segments(model_prefix + "x")[0][:-1] if model_prefix else model_prefix
    sid = _schema_id(found if unwrapped == model_prefix else replace(found, model_prefix=unwrapped))
    opt_prefix, keying, found, item = _per_parameter(md, sid, found, keying)  # one optimizer per parameter
    reasons += _closing_reasons(md, bool(planner), found, (n_model, use_paths), keying, fqns, item)
    head = model_head(model_prefix or "")
    return replace(
        sch,
        id=sid,
        model_prefix=model_prefix,
        optimizer_prefix=opt_prefix,
        optimizer_keying=keying,
        naming=found.naming,
        reasons=tuple(reasons),
        training_state=training,
        _model_head=head,
    )


#: The key schema's reason for an optimizer saved as one optimizer per parameter (:func:`_per_parameter_item`).
PER_PARAMETER_REASON = (
    "optimizer state under {item!r} saved as one optimizer per parameter ({item}<fqn>.state.0.<field>, "
    "{item}<fqn>.param_groups.0.*: torchtune's OptimizerInBackwardWrapper, optimizer_in_bwd), keyed by parameter fqn"
)


def _per_parameter(
    md: CheckpointMetadata, sid: str, found: Detected, keying: str | None
) -> tuple[str | None, str | None, Detected, str]:
    """``(optimizer prefix, keying, found, item)``: where detection found no optimizer and schema ``sid`` reads one
    saved as one optimizer per parameter (:func:`_per_parameter_item`), its item as the prefix, keyed by fqn; else
    as found (``item`` ``""``)."""
    item = _per_parameter_item(md, sid) if found.optimizer_prefix is None else ""
    if not item:
        return found.optimizer_prefix, keying, found, ""
    return item, "fqn", replace(found, optimizer_prefix=item), item


def _per_parameter_item(md: CheckpointMetadata, sid: str) -> str:
    """The optimizer item of schema ``sid`` saved as one optimizer per parameter
    (:attr:`~ckpttool.model.schemas.base.SchemaSpec.per_parameter_optimizers`: torchtune's ``optimizer_in_bwd``)
    where some key is such an optimizer's state or param group (optimizers that never stepped save their groups
    alone) and none holds an index other than 0 (an optimizer of several parameters: a layout not read, ``K002``),
    else ``""``."""
    spec = registry.find(sid)
    item = spec.per_parameter_optimizers if spec is not None else ""
    if not item:
        return ""
    keys = [k for k in md.entries if k.startswith(item)]
    if any(_other_index(k) for k in keys):  # an optimizer of several parameters: not this layout, none of it read
        return ""
    return item if any(split_per_parameter_key(k, item) is not None for k in keys) else ""


def _other_index(key: str) -> bool:
    """``key`` is ``<...>.state.<i>.<field>`` or ``<...>.param_groups.<i>.<hyper>`` with ``i`` a number other than
    0 (``field``/``hyper`` without dots)."""
    for part in (".state.", ".param_groups."):
        _, sep, tail = key.rpartition(part)
        index, dot, name = tail.partition(".")
        if sep and dot and name and "." not in name and index.isdecimal() and index != "0":
            return True
    return False


def _model_sample(scan: _Scan, test: Any, get: Any, voted: str | None) -> tuple[int, list[str]]:
    """``(number of model keys, the first 4096 of them)`` of the scanned tensors ``test`` accepts; ``voted``: the
    model prefix whose votes counted them already (planner paths, no optimizer at the top level: the votes counted
    exactly the keys :meth:`KeySchema.is_model_candidate` accepts; one there would have counted its flattened
    ``state.`` keys too)."""
    if voted is not None:
        return scan.model_votes[voted], list(islice((k for k in scan.tensors if test(k, get(k))), 4096))
    model_keys = [k for k in scan.tensors if test(k, get(k))]
    return len(model_keys), model_keys[:4096]


def _check_override(
    md: CheckpointMetadata, ov: SchemaOverride, probe: KeySchema, tensors: list[str], n_model: int
) -> None:
    """Raise when a prefix the user gave matches nothing.

    Raises:
        SchemaError: the model prefix matches no tensor (given, or from ``--schema``); the given
            optimizer prefix matches no key.
    """
    model_prefix, opt_prefix = probe.model_prefix, probe.optimizer_prefix
    if model_prefix is not None and not n_model:
        if ov.model_prefix is not None or ov.schema is not None:
            raise SchemaError(
                f"model prefix {model_prefix!r} matches no tensor of the checkpoint "
                f"(keys look like {', '.join(repr(k) for k in tensors[:3])})",
                param="model_prefix" if ov.model_prefix is not None else "schema",
            )
    if opt_prefix and ov.optimizer_prefix is not None and not any(k.startswith(opt_prefix) for k in md.entries):
        raise SchemaError(
            f"optimizer prefix {opt_prefix!r} matches no key of the checkpoint",
            param="optimizer_prefix",
        )


def _overridden(md: CheckpointMetadata, ov: SchemaOverride, tensors: list[str]) -> KeySchema:
    spec = next((s for s in registry.specs() if s.name == ov.schema), None) if ov.schema else None
    base_model, base_opt = (spec.model_prefix, spec.optimizer_prefix) if spec is not None else (None, None)
    model_prefix = ov.model_prefix if ov.model_prefix is not None else base_model
    opt_prefix = ov.optimizer_prefix if ov.optimizer_prefix is not None else base_opt
    sid = ov.schema if ov.schema and ov.model_prefix is None and ov.optimizer_prefix is None else "custom"
    if model_prefix is None and opt_prefix is None:
        model_prefix = ""
    paths = planner_paths(md)
    groups = top_group_fqns(md, paths)
    params = top_param_fqns(md, paths, opt_prefix)
    probe = KeySchema(sid, model_prefix, opt_prefix, _use_paths=False, _group_fqns=groups, _param_fqns=params)
    model_keys = [k for k in tensors if probe.is_model_candidate(k, paths.get(k))]
    _check_override(md, ov, probe, tensors, len(model_keys))
    if opt_prefix and not any(k.startswith(opt_prefix) for k in md.entries):
        opt_prefix = None
    fqns = [probe.fqn_of(k) for k in model_keys]
    keying = None
    if opt_prefix is not None:
        sp = f"{opt_prefix}state."
        state = [(k, paths.get(k)) for k in md.entries if k.startswith(sp)]
        keying = "index" if _index_keyed(state, sp, set(fqns)) else "fqn"
    given = ", ".join(
        f"{n} {v!r}"
        for n, v in (
            ("schema", ov.schema),
            ("model prefix", ov.model_prefix),
            ("optimizer prefix", ov.optimizer_prefix),
        )
        if v is not None
    )
    said = f"implied by the format ({ov.by})" if ov.by else f"given on the command line ({given})"
    reasons = (f"{said}: {len(model_keys)} model tensor(s)",)
    tops = {k.split(".", 1)[0] for k in md.entries}
    training = tuple(sorted(t for t in tops if t in registry.derived().training_state_items))
    return KeySchema(
        sid,
        model_prefix,
        opt_prefix,
        keying,
        model_naming(fqns),
        "format" if ov.by else "override",
        reasons,
        training,
        (),
        False,
        groups,
    )
