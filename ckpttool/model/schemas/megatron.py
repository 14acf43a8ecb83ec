"""``megatron``: Megatron-core ``dist_checkpointing.save`` with the ``torch_dist`` backend.

What megatron-core 0.16 writes (``megatron/core/dist_checkpointing/strategies/torch.py``,
``megatron/core/optimizer/optimizer.py``), checked on checkpoints its own code saved:

- ``.metadata``: torch's DCP ``Metadata`` plus ``all_local_plans`` (torch's ``SavePlan`` records;
  the unpickler keeps them inert); no ``planner_data``.
- Model tensors by their *sharded key*, no ``model.`` prefix, the layers stacked on a leading
  dim (``decoder.layers.self_attention.linear_qkv.weight [L, ...]``, experts
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, out, in]``); ``_extra_state``
  byte items ``<key>._extra_state/shard_<offsets>_<shape>``.
- Optimizer state **field first**: ``optimizer.state.<field>.<key>`` (``exp_avg``,
  ``exp_avg_sq``; ``fp32_param`` the FP32 masters of a bf16/fp16 model, ``param`` those of the
  ``DistributedOptimizer``'s ``fully_reshardable`` save), under
  ``chained_<i>.`` when a ``ChainedOptimizer`` holds several (dense / expert parameters).
- ``common.pt`` (``torch.save``): ``optimizer`` (param groups without ``params``, the shared
  step ``state.common_step``, the ``DistributedOptimizer``'s in each param group's ``step``; one per chained
  optimizer), ``opt_param_scheduler``,
  ``iteration``; ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}``.

Torch-free; :func:`parse_common` reads the bytes of ``common.pt`` with ckpttool's safe loader (the catalog fetches
them, from a local folder or an object-store prefix, confined and capped).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.model.schemas.base import CommonState, Detected, Discovery, SchemaSpec

if TYPE_CHECKING:
    from ckpttool.model.catalog import ParamGroup

__all__ = [
    "COMMON_FILE",
    "MegatronCommon",
    "SPEC",
    "config_problem",
    "is_distopt_bucket",
    "is_megatron_dir",
    "no_weight_decay",
    "parse_common",
    "split_state_key",
]

COMMON_FILE = "common.pt"
METADATA_JSON = "metadata.json"
_STATE_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.([A-Za-z_][A-Za-z0-9_]*)\.(.+)$")
_EXPERTS = ".experts.experts."
#: The fqn prefix of the parameters megatron stores with the layers stacked on dim 0.
STACKED_PREFIX = "decoder.layers."


#: Megatron's state field names that have a ckpttool name: ``fp32_param`` is the FP32 master
#: weight of a bf16/fp16 parameter (``Float16OptimizerWithFloat16Params``; the ``DistributedOptimizer``'s
#: ``fully_sharded_model_space`` save), ``param`` the ``DistributedOptimizer``'s main (FP32) parameter in its
#: ``fully_reshardable`` save (``_get_main_param_and_optimizer_states``).
FIELD_NAMES = {"fp32_param": "master_weight", "param": "master_weight"}


#: A bucket buffer of the ``DistributedOptimizer``'s ``dp_reshardable`` save (Megatron-LM's default with
#: ``--use-distributed-optimizer``; ``sharded_param_state_dp_reshardable``):
#: ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<j>.dtype_(...).bucket_idx_<k>.<field>``, the flat
#: ``param`` / ``exp_avg`` / ``exp_avg_sq`` of a gradient bucket, whose intra-parameter padding megatron saves
#: as allocated (``torch.empty``: any bits). Not mapped to parameters.
_DISTOPT_BUCKET_RE = re.compile(
    r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\..+\.bucket_idx_\d+\.\w+$", re.DOTALL
)


def is_distopt_bucket(key: str) -> bool:
    """Whether ``key`` is a ``dp_reshardable`` bucket buffer (:data:`_DISTOPT_BUCKET_RE`): its values include
    padding megatron never wrote, so no value check applies to it as a whole."""
    return _DISTOPT_BUCKET_RE.match(key) is not None


#: a key of megatron's optimizer (a ``ChainedOptimizer``'s below its ``chained_N.`` prefix)
_OPTIMIZER_KEY_RE = re.compile(r"^(?:chained_\d+\.)?optimizer\.")


def is_optimizer_key(key: str) -> bool:
    """Whether ``key`` is the optimizer's (state, or a ``dp_reshardable`` bucket): never a model tensor, also under
    a chained optimizer's ``chained_N.`` prefix, which names no optimizer head."""
    return _OPTIMIZER_KEY_RE.match(key) is not None


def split_state_key(key: str) -> tuple[str, str] | None:
    """``(key of the parameter, field)`` of a state key ``[chained_N.]optimizer.state.<field>.<key>``, else ``None``.

    The field is ckpttool's name (:data:`FIELD_NAMES`: ``fp32_param`` -> ``master_weight``).
    """
    m = _STATE_RE.match(key)
    if m is None or m.group(2) == "common_step":
        return None
    return m.group(3), FIELD_NAMES.get(m.group(2), m.group(2))


def chain_of(state_key: str, chains: int = 1) -> int:
    """The chained-optimizer index of a state key: its ``chained_N.`` prefix. Without one (Megatron-LM's
    ``chained_optim_avoid_prefix``) of ``chains`` 2, megatron's order (``get_megatron_optimizer``: the dense
    parameters' optimizer, then the expert-parallel ones', ``mlp.experts.``); else ``0``."""
    m = _STATE_RE.match(state_key)
    if m is None:
        return 0
    if m.group(1) is not None:
        return int(m.group(1))
    return int(chains == 2 and ".experts." in f".{m.group(3)}")


def per_layer_shape(fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The parameter's own shape: without the stacked layer dim (``decoder.layers.``) and expert dim."""
    n = 0
    if fqn.startswith(STACKED_PREFIX):
        n = 2 if _EXPERTS in fqn else 1
    return shape[n:]


def no_weight_decay(fqn: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default rule (``get_standard_config_overrides``): biases and 1-D parameters get ``wd_mult`` 0."""
    return fqn.endswith(("bias", "_bias")) or len(per_layer_shape(fqn, shape)) == 1


#: What ``common.pt`` says about the optimizer and the schedule (the schema's :class:`CommonState`).
MegatronCommon = CommonState


def is_megatron_dir(path: Path) -> bool:
    """``metadata.json`` names the ``torch_dist`` sharded backend (megatron-core's ``save_config``)."""
    p = path / METADATA_JSON
    if not p.is_file():
        return False
    try:
        doc = json.loads(p.read_text(encoding="utf-8")[:4096])
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist"


#: The ``metadata.json`` megatron-core 0.16's ``dist_checkpointing.load`` reads a checkpoint with: its
#: ``CheckpointingConfig`` fields with their defaults (``core.py``), the backends and versions its default load
#: strategies are registered for (``strategies/torch.py``: ``torch_dist`` 1; ``strategies/common.py``: ``torch`` 1).
_CONFIG_LOADED = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_CONFIG_CAP = 1 << 16


def config_problem(ckpt_dir: Path) -> str | None:
    """Why megatron-core's ``dist_checkpointing.load`` would refuse ``<ckpt_dir>/metadata.json``, else ``None``
    (a file absent is a save not published: named by discovery, ``E202`` / ``R001``).

    Its ``maybe_load_config`` ``json.load`` s the file into ``CheckpointingConfig(**config)`` (no other field,
    ``sharded_backend`` required) and ``verify_checkpoint_and_load_strategy`` looks the default load strategies
    up by backend and version: only ``torch_dist`` 1 and ``torch`` 1 are registered; any other config leaves the
    shards ckpttool read unloadable by megatron (a ``TypeError``, or no strategy for the backend).

    Raises:
        CkptError: a symlink out of the checkpoint (``PathEscapeError``), not a regular file.
    """
    from ckpttool.format.files import read_regular, resolve_inside

    p = ckpt_dir / METADATA_JSON
    if not os.path.lexists(p):
        return None
    src = resolve_inside(ckpt_dir, METADATA_JSON, what=METADATA_JSON)
    data = read_regular(src, _CONFIG_CAP, shown=p, what=METADATA_JSON)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return f"is not JSON ({str(e)[:80]}): megatron-core's load fails reading it"
    if not isinstance(doc, dict):
        return f"holds a JSON {type(doc).__name__}, not the object of megatron-core's CheckpointingConfig"
    unknown = sorted(str(k) for k in doc if k not in _CONFIG_LOADED)
    if unknown:
        return f"holds field(s) {', '.join(map(repr, unknown[:4]))} megatron-core's CheckpointingConfig does not have"
    if "sharded_backend" not in doc:
        return "lacks sharded_backend, which megatron-core's CheckpointingConfig requires"
    got = {**{k: v for k, v in _CONFIG_LOADED.items() if k != "sharded_backend"}, **doc}
    bad = [k for k, v in _CONFIG_LOADED.items() if got[k] != v]
    if bad:
        shown = ", ".join(f"{k} {got[k]!r}" for k in bad)
        return (
            f"names {shown}; megatron-core's load has strategies for sharded_backend 'torch_dist' 1 and "
            "common_backend 'torch' 1 only (the .metadata shards read here are torch_dist's)"
        )
    return None


def _step_value(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    item = getattr(v, "item", None)  # a loaded 0-d tensor
    if callable(item) and getattr(v, "numel", lambda: 0)() == 1:
        out = item()
        return float(out) if isinstance(out, (int, float)) else None
    return None


def _one_optimizer(sd: Any) -> tuple[tuple[dict[str, Any], ...], float | None]:
    """Param groups and common step of one optimizer's saved dict (FP32Optimizer, or Float16's nested ``optimizer``)."""
    if isinstance(sd, dict) and "param_groups" not in sd and isinstance(sd.get("optimizer"), dict):
        sd = sd["optimizer"]
    if not isinstance(sd, dict):
        return (), None
    groups = tuple(dict(g) for g in sd.get("param_groups", ()) if isinstance(g, dict))
    state = sd.get("state")
    step = _step_value(state.get("common_step")) if isinstance(state, dict) else None
    if step is None:  # the DistributedOptimizer's state_dict() puts the shared step in each param group
        steps = {v for g in groups if (v := _step_value(g.get("step"))) is not None}
        step = max(steps, default=None)
    return groups, step


def _common_globals() -> dict[tuple[str, str], Any]:
    """Inert stand-ins of the classes Megatron-LM's ``common.pt`` names beside plain values: its ``args``
    (``argparse.Namespace``, which ``generate_state_dict`` saves in every checkpoint) and what they hold (megatron-core's
    enums, its ``OptimizerConfig``, paths), the set megatron-core itself loads ``common.pt`` with
    (``megatron/core/safe_globals.py``, ``SAFE_GLOBALS``) less numpy's arrays and ``BytesIO``; nothing of megatron is
    imported."""
    from ckpttool.format.unpickler import AttributeBag, enum_stand_in, path_stand_in

    enums = {
        "megatron.core.enums": ("ModelType",),
        "megatron.core.transformer.enums": ("AttnBackend", "CudaGraphScope", "ModelType", "AttnMaskType"),
        "megatron.core.rerun_state_machine": ("RerunDiagnostic", "RerunMode", "RerunState"),
        "signal": ("Signals",),
    }
    table: dict[tuple[str, str], Any] = {(m, n): enum_stand_in(n) for m, names in enums.items() for n in names}
    for holder in (("argparse", "Namespace"), ("types", "SimpleNamespace"), _OPTIMIZER_CONFIG):
        table[holder] = AttributeBag
    table.update({("pathlib", n): path_stand_in for n in ("PosixPath", "PurePosixPath")})
    return table


#: megatron-core's ``OptimizerConfig`` (a dataclass), which Megatron-LM's args can hold
_OPTIMIZER_CONFIG = ("megatron.core.optimizer.optimizer_config", "OptimizerConfig")


def parse_common(data: bytes, shown: str, trust_pickle: bool = False) -> MegatronCommon:
    """What ``common.pt`` holds, from its bytes (``shown``: the file, as messages name it; ``trust_pickle``: a file
    naming other classes than :func:`_common_globals`' is read with ``torch.load(weights_only=False)``, the command's
    ``--trust-pickle``).

    Loaded by :func:`ckpttool.format.reader.load_saved_object` (zip structure checked, plain values and Megatron-LM's
    ``args`` by an unpickler of inert stand-ins (:func:`_common_globals`), tensors through
    ``torch.load(weights_only=True)``); the bytes were read confined and capped as every file of the checkpoint
    (``Catalog.common_state``).

    Raises:
        CkptError: not a readable ``torch.save`` archive, or it needs ``--trust-pickle``.
    """
    from ckpttool.format.reader import load_saved_object

    obj = load_saved_object(data, shown, trust_pickle=trust_pickle, plain_globals=_common_globals())
    if not isinstance(obj, dict):
        return MegatronCommon()
    opt = obj.get("optimizer")
    chains: list[Any]
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        chains = [opt[k] for k in sorted(opt)]  # ChainedOptimizer: {0: ..., 1: ...}
    elif isinstance(opt, list):
        chains = opt
    elif opt is None:
        chains = []
    else:
        chains = [opt]
    parsed = [_one_optimizer(c) for c in chains]
    sched = obj.get("opt_param_scheduler")
    it = obj.get("iteration")
    return MegatronCommon(
        groups=tuple(g for g, _ in parsed),
        common_step=tuple(s for _, s in parsed),
        scheduler=dict(sched) if isinstance(sched, dict) else {},
        scheduler_item="opt_param_scheduler",
        iteration=it if isinstance(it, int) and not isinstance(it, bool) else None,
        keys=tuple(str(k) for k in obj),
        values={str(k): v for k, v in obj.items() if type(v) in (int, float)},
        args=dict(args) if isinstance(args := obj.get("args"), dict) else None,
    )


#: a layer's own key (``decoder.layers.3.mlp...``)
_PER_LAYER = re.compile(r"^decoder\.layers\.\d+\.")


def _claims(d: Detected) -> bool:
    # dist_checkpointing stacks the layers of a TransformerBlock on dim 0 (``decoder.layers.<name> [L, ...]``) and
    # keeps a key per layer only for a MambaBlock or non-homogeneous layers, saved by its MCoreSavePlanner with
    # flatten_state_dict=False: no planner_data. Megatron's module names saved layer by layer through torch's
    # DefaultSavePlanner (dcp.save(model.state_dict()) of a user's loop) are no dist_checkpointing save: no
    # common.pt belongs beside them
    return (
        d.naming == "megatron" and d.model_prefix == "" and not (d.planner and any(_PER_LAYER.match(f) for f in d.fqns))
    )


#: The parameters megatron-core marks ``is_embedding_or_output_parameter`` (``LanguageModule.
#: setup_embeddings_and_output_layer``): the word embedding and the output layer, which its ``decoupled_lr`` override
#: (``get_standard_config_overrides``: ``ParamKey(attr="is_embedding_or_output_parameter")``) puts in a group of their own.
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def _decoupled_overrides(args: Mapping[str, Any]) -> dict[str, float] | None:
    """The override ``get_standard_config_overrides`` gives the embedding and output layer for the run's saved
    ``args`` (``{"max_lr": decoupled_lr[, "min_lr": decoupled_min_lr]}``), ``{}`` without ``decoupled_lr``, ``None``
    where the args do not say (no ``decoupled_lr`` saved, or not a number)."""
    if "decoupled_lr" not in args:
        return None
    lr, low = args.get("decoupled_lr"), args.get("decoupled_min_lr")
    if lr is None:
        return {}
    if not _number(lr) or (low is not None and not _number(low)):
        return None
    return {"max_lr": float(lr)} | ({"min_lr": float(low)} if low is not None else {})


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _override_of(fqn: str, shape: tuple[int, ...], decoupled: dict[str, float]) -> tuple[tuple[str, Any], ...] | None:
    """The parameter's merged override as megatron's ``_get_param_groups`` keys it
    (``param_group_override_to_tuple``: sorted items; ``None`` without one)."""
    o: dict[str, Any] = {"wd_mult": 0.0} if no_weight_decay(fqn, shape) else {}
    if decoupled and fqn in EMBEDDING_OR_OUTPUT:
        o.update(decoupled)
    return tuple(sorted(o.items())) if o else None


def _standard_members(
    groups: Sequence[dict[str, Any]], chain_params: Mapping[str, tuple[int, ...]], args: Mapping[str, Any] | None
) -> list[list[str]] | None:
    """The members of one chained optimizer's saved groups by megatron's standard overrides (``_get_param_groups``
    with ``get_standard_config_overrides``), else ``None`` (nothing guessed).

    Without ``decoupled_lr`` in the saved ``args``: the ``wd_mult`` 1 / 0 pair (or one of them). With it: one group
    per distinct override (biases and 1-D parameters ``wd_mult`` 0; the embedding and the output layer the
    decoupled ``max_lr`` / ``min_lr``), sorted as megatron sorts them (no override first, then the override
    tuples in order); the saved groups must be exactly those, each holding its override's values
    (``wd_mult``, ``max_lr``, ``min_lr``, ``default_config``). ``apply_wd_to_qk_layernorm`` (another ``wd_mult`` rule)
    is not derived."""
    mults = [g.get("wd_mult") for g in groups]
    decoupled = _decoupled_overrides(args) if args is not None else None
    if args is not None and args.get("apply_wd_to_qk_layernorm"):
        return None
    if not decoupled:
        if not (len(groups) in (1, 2) and len(set(mults)) == len(mults) and set(mults) <= {0.0, 1.0}):
            return None
        members: list[list[str]] = [[] for _ in groups]
        for fqn, shape in chain_params.items():
            want = 0.0 if no_weight_decay(fqn, shape) else 1.0
            if want in mults:
                members[mults.index(want)].append(fqn)
        return members
    keyed = {fqn: _override_of(fqn, shape, decoupled) for fqn, shape in chain_params.items()}
    order = sorted(set(keyed.values()), key=lambda k: (k is not None, k or ()))
    if len(order) != len(groups):
        return None
    for key, g in zip(order, groups):
        o = dict(key or ())
        saved: dict[str, Any] = {"wd_mult": o.get("wd_mult", 1.0), "default_config": not any("lr" in k for k in o)}
        saved.update({k: v for k, v in o.items() if k in ("max_lr", "min_lr")})
        if any(k not in g or g[k] != v for k, v in saved.items()):
            return None
    return [[f for f, k in keyed.items() if k == key] for key in order]


def assign_groups(
    common: CommonState, params: Mapping[str, tuple[str, tuple[int, ...]]]
) -> list[tuple[dict[str, Any], list[str]]]:
    """The param groups of ``common.pt`` (every chained optimizer's, in order) with their members.

    ``common.pt`` keeps no ``params`` lists (megatron drops them: ``LocalNonpersistentObject``);
    the members follow megatron's standard grouping (``_get_param_groups`` with ``get_standard_config_overrides``,
    :func:`_standard_members`): per chained optimizer, biases and 1-D parameters (:func:`no_weight_decay`) in its
    group with ``wd_mult`` 0, the others in the one with ``wd_mult`` 1, and where the saved Megatron-LM ``args``
    name a ``decoupled_lr`` the embedding and output layer (:data:`EMBEDDING_OR_OUTPUT`) in the group of that
    ``max_lr``. A chain whose groups are not those (custom overrides, ``decoupled_lr`` groups without the ``args``
    that say so) gets no members: nothing is guessed.

    Args:
        common: what :func:`parse_common` read.
        params: parameter key -> (one of its state keys: its chained optimizer, global shape), of the parameters
            with state.

    Returns:
        ``[(hyperparameters, member keys)]``, each chain's groups in saved order; a chain's shared
        ``common_step`` is its groups' ``step`` value.
    """
    out: list[tuple[dict[str, Any], list[str]]] = []
    args = common.args if isinstance(common.args, Mapping) else None
    for chain, groups in enumerate(common.groups):
        mine = {fqn: shape for fqn, (key, shape) in params.items() if chain_of(key, len(common.groups)) == chain}
        members = _standard_members(groups, mine, args) or [[] for _ in groups]
        for g, m in zip(groups, members):
            values = dict(g)
            values["chained_optimizer"] = chain
            if common.common_step[chain] is not None:
                values["step"] = common.common_step[chain]
            out.append((values, m))
    return out


def shared_step_params(common: CommonState, params: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """The parameters whose state holds their chained optimizer's ``common_step``: every one of its parameters, in
    whichever group (megatron-core's load puts it in each parameter's state, ``_restore_common_per_param_step``),
    also where :func:`assign_groups` leaves the groups without members."""
    n = len(common.common_step)
    return [f for f, (key, _) in params.items() if (c := chain_of(key, n)) < n and common.common_step[c] is not None]


def common_steps_problems(common: CommonState) -> Iterator[tuple[str, str]]:
    """The optimizers' ``common_step`` of ``common.pt``: one per optimizer (the ``DistributedOptimizer``'s param
    groups hold the same ``step``), megatron's ``ChainedOptimizer`` steps every chained
    optimizer together (one skip decision for all), and an optimizer never steps more often than the
    iterations run (a step skipped for a loss-scale overflow, or a resume with ``--no-load-optim``,
    leaves it behind; nothing puts it ahead)."""
    for i, groups in enumerate(common.groups):
        if not any("step" in g for g in groups):
            continue  # a plain optimizer's groups: the step is each parameter's (or state.common_step)
        # a group without "step" beside those with one: no step to megatron-core's load (a KeyError there)
        saved = [
            (j, _step_value(g["step"]), repr(g["step"])) if "step" in g else (j, None, "no step")
            for j, g in enumerate(groups)
        ]
        if len({repr(v) if v is not None else raw for _, v, raw in saved}) > 1:  # NaN != NaN: compared as text
            chain = f"chained optimizer {i}'s" if len(common.groups) > 1 else "optimizer"
            shown = ", ".join(f"group {j}: {v:g}" if v is not None else f"group {j}: {raw}" for j, v, raw in saved)
            yield (
                f"{COMMON_FILE}:optimizer",
                f"{COMMON_FILE}: the {chain} param groups' step differ ({shown}); megatron-core's "
                "DistributedOptimizer loads one step into every parameter (its load asserts a single value)",
            )
    steps = {i: int(s) for i, s in enumerate(common.common_step) if s is not None and math.isfinite(s)}
    if len(set(steps.values())) > 1:
        shown = ", ".join(f"optimizer {i}: {s}" for i, s in steps.items())
        yield (
            f"{COMMON_FILE}:optimizer",
            f"{COMMON_FILE}: the chained optimizers' common_step differ ({shown}); megatron steps them together",
        )
    top = max(steps.values(), default=None)
    if top is not None and common.iteration is not None and top > common.iteration:
        yield (
            f"{COMMON_FILE}:optimizer",
            f"{COMMON_FILE}: optimizer common_step {top} is ahead of iteration {common.iteration}",
        )


#: The keys megatron-core's ``load_state_dict`` matches a saved param group to the optimizer's by
#: (``optimizer.py``: ``param_group_identifier_keys``; ``pre_<key>`` where NeMo renamed one)
GROUP_IDENTIFIER_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _identifier(g: Mapping[str, Any]) -> tuple[Any, ...] | None:
    try:
        return tuple(g[k] if k in g else g[f"pre_{k}"] for k in GROUP_IDENTIFIER_KEYS)
    except KeyError:
        return None


def indistinct_groups(common: CommonState) -> Iterator[tuple[str, str]]:
    """Param groups of one optimizer that megatron-core's load cannot tell apart: its ``load_state_dict``
    (``_filter_and_reorder_param_groups``) maps each saved group by :data:`GROUP_IDENTIFIER_KEYS` into a dict, so of
    groups with equal keys only the last is restored, for all of them — torch's ``load_state_dict`` then raises
    ("doesn't match the size of optimizer's group") where their sizes differ, and otherwise steps the earlier groups'
    parameters with the last one's ``lr`` / ``max_lr`` / ``min_lr``. megatron-core 0.16's own ``decoupled_lr`` saves
    are such: the decoupled group differs from the default one in ``max_lr`` / ``min_lr`` only."""
    for i, groups in enumerate(common.groups):
        seen: dict[str, int] = {}  # by repr: the values are plain numbers and bools
        for j, g in enumerate(groups):
            ident = _identifier(g)
            if ident is None:
                continue
            first = seen.setdefault(repr(ident), j)
            if first == j:
                continue
            chain = f"chained optimizer {i}'s" if len(common.groups) > 1 else "the optimizer's"
            shown = ", ".join(f"{k} {v!r}" for k, v in zip(GROUP_IDENTIFIER_KEYS, ident))
            differ = sorted(k for k in ("lr", "max_lr", "min_lr") if groups[first].get(k) != g.get(k))
            yield (
                f"{COMMON_FILE}:optimizer",
                f"{COMMON_FILE}: {chain} param groups {first} and {j} have the same {shown}, the key megatron-core's "
                f"load_state_dict matches saved groups by: it restores group {j} for both"
                + (f" (they differ in {', '.join(differ)})" if differ else "")
                + ", and raises where their sizes differ",
            )


def inferred_groups_note(used: Sequence[ParamGroup], chosen: set[str], differ: list[str]) -> str:
    """``replay-step``'s warning when the replayed parameters' groups differ in ``differ``: their members were
    inferred by megatron's default rule (:func:`assign_groups`), which a run with its own ``no_weight_decay_cond``
    or ``config_overrides`` did not use."""
    zero = next((f for g in used if g.values.get("wd_mult") == 0.0 for f in g.params if f in chosen), None)
    return (
        f"warning: common.pt saves its param groups without their parameters; the {', '.join(differ)} of each "
        "parameter is its group's by megatron's default grouping (biases and 1-D parameters in the wd_mult 0 group"
        + (f", e.g. {zero}" if zero else "")
        + "): a run with its own no_weight_decay_cond or config_overrides grouped otherwise, and the replay does not "
        "show it (docs/frameworks.md)"
    )


SPEC = SchemaSpec(
    name="megatron",
    # dist_checkpointing.save writes common.pt first, then the shards (.metadata), then metadata.json
    # "only if the checkpoint is complete"; its load refuses a directory without it ("is not a
    # distributed checkpoint"), and Megatron-LM writes latest_checkpointed_iteration.txt after it
    discovery=Discovery(
        step_words=("iter",),
        publish_markers=((METADATA_JSON, (COMMON_FILE,)),),
        # megatron/training/checkpointing.py::_load_base_checkpoint: without the tracker (and --ckpt-step) it prints
        # "will not load any checkpoints and will start from random". Megatron Bridge (megatron.bridge.training.
        # checkpointing) saves the same iterations and resumes from its own tracker, latest_train_state.pt (a
        # torch.save of its TrainState), falling back to Megatron-LM's: its versions before the compatibility
        # tracker write only that one, so either file is the run's
        # Bridge's load_checkpoint reads latest_train_state.pt first (its TrainState's step is the iteration)
        latest_files=("latest_train_state.pt",),
        latest_required=(
            (
                "latest_checkpointed_iteration.txt",
                "Megatron-LM's load_checkpoint loads no iteration and starts from random; --ckpt-step N loads "
                "iteration N",
            ),
            (
                "latest_train_state.pt",
                "Megatron Bridge's load_checkpoint loads no iteration and starts from random",
            ),
        ),
    ),
    model_prefix="",
    claims=_claims,
    priority=40,
    split_state_key=split_state_key,
    optimizer_key=is_optimizer_key,
    files_read=(COMMON_FILE,),
    stacked_layers=(STACKED_PREFIX,),
    common_state_file=COMMON_FILE,
    read_common_state=parse_common,
    read_trusted_common_state=functools.partial(parse_common, trust_pickle=True),
    common_state_required=(
        "megatron-core's dist_checkpointing.load reads the common state from it "
        "(the iteration, the optimizers' param groups and step, the run's args) and fails without it"
    ),
    common_state_problems=common_steps_problems,
    group_load_problems=indistinct_groups,
    group_members=assign_groups,
    shared_step_params=shared_step_params,
    inferred_groups_note=inferred_groups_note,
    # Megatron's own loss scaler skips the step of an iteration that overflowed; the iteration still counts
    skips_overflow_steps=True,
    reshard_refusal=(
        "a megatron-core torch_dist checkpoint: its expert tensors are stored by global expert index "
        "([L, E, ...] with each rank's sharded offsets), so there is no EP layout to convert",
        "megatron-core loads it at any EP size as it is (dist_checkpointing.load reshards on load)",
    ),
    config_file=METADATA_JSON,
    config_problem=config_problem,
    doc_model="`<key>` (top level, layers stacked: `decoder.layers.<...> [L, ...]`)",
    doc_optimizer="`[chained_N.]optimizer.state.<field>.<key>` (field first); groups in `common.pt`",
    doc_written_by="megatron-core `dist_checkpointing.save` (`torch_dist`), Megatron-LM `iter_N/`",
    import_help="megatron-core torch_dist GPTModel keys (stacked layers, fused linear_qkv/linear_fc1)",
    import_through_own_adapter=True,
    import_writes_stacked=True,
)
