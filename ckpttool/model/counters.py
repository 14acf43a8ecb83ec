"""The step counters a trainer and its LR schedulers saved beside the optimizer state.

Read from small byte items of the checkpoint (torchtitan ``train_state.step``, Megatron
``iteration``, HF-style ``global_step``, each scheduler's ``last_epoch`` / ``_step_count``), from
``extra_state/*.pt`` and from the training-state files a trainer keeps beside the checkpoint
(OLMo-core ``train/rankR.pt``, NeMo Automodel ``step_scheduler.pt``). Used by ``validate`` (R002)
and ``replay-step``; ``docs/rules.md``, R002.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.errors import CkptError
from ckpttool.format.metadata import BytesMeta
from ckpttool.model.beside import TRAINER_STEP_KEY, read_training_state_beside
from ckpttool.model.catalog import alike_groups

if TYPE_CHECKING:
    from ckpttool.model.catalog import ParamGroup
    from ckpttool.model.checkpoint import Checkpoint

#: Training-state items holding the trainer's step count (item -> key suffix below the item).
#: torchtitan: ``train_state.step``; Megatron: ``iteration``; HF-style: ``global_step``.
TRAIN_STEP_KEYS = (
    "train_state.step",
    "trainer_state.global_step",
    "training_state.step",
    "training_state.global_step",
    "global_step",
    "iteration",
    "step",
)
#: LR scheduler items (NeMo Automodel saves its scheduler as ``sched`` in ``optim/``).
SCHEDULER_ITEMS = ("lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "sched")


@dataclass(frozen=True)
class Counter:
    """One saved counter: where it is (a key, or ``file:name``) and its integer value."""

    key: str
    value: int


def _small_item(ckpt: Checkpoint, key: str) -> object:
    """Byte item ``key``'s object, or tensor ``key``'s one element (torchtitan's older ``TrainState`` saved ``step`` as
    ``torch.tensor(step, dtype=torch.int32)``; read from its stored bytes,
    :meth:`~ckpttool.format.reader.CheckpointReader.read_scalar`); ``None`` where it is not stored or cannot be read
    (never raises: a damaged item is the storage checks' finding)."""
    meta = ckpt.reader.metadata.entries.get(key)
    if meta is None:
        return None
    try:
        if isinstance(meta, BytesMeta):
            ckpt.reader.storage_info(key)
            return ckpt.reader.read_object(key)
        return ckpt.reader.read_scalar(key)
    except CkptError:
        return None


def _int_item(ckpt: Checkpoint, key: str) -> int | None:
    """Item ``key`` (:func:`_small_item`) when it holds an ``int`` (an integer tensor's element included)."""
    v = _small_item(ckpt, key)
    return v if type(v) is int else None


def trainer_steps(ckpt: Checkpoint) -> list[Counter]:
    """The trainer's step counters, in :data:`TRAIN_STEP_KEYS` order, then ``extra_state`` files'
    ``global_step``, then the iteration of the trainer's common state (Megatron's ``common.pt``), then the training-state files beside the
    checkpoint."""
    root = ckpt.catalog.schema.state_root  # "app." in an app-state save; top-level items are read too
    keys = [root + k for k in TRAIN_STEP_KEYS] + (list(TRAIN_STEP_KEYS) if root else [])
    out = [Counter(k, v) for k in keys if (v := _int_item(ckpt, k)) is not None]
    for st in ckpt.extra_state():
        if st.global_step is not None:
            out.append(Counter(st.file.relative_path, st.global_step))
    if ckpt.common_state_file is not None:  # Megatron-LM's iteration is in common.pt, beside .metadata
        try:
            common = ckpt.common_state()
        except CkptError:
            common = None  # named by the rules that read it
        if common is not None and common.iteration is not None:
            out.append(Counter(f"{ckpt.common_state_file}:iteration", common.iteration))
    # OLMo-core's train/rankR.pt, NeMo's step_scheduler.pt beside the checkpoint (a URL's UrlPath kept: none read)
    for ts in read_training_state_beside(ckpt.located.model):
        name = TRAINER_STEP_KEY.get(ts.file, "global_step")
        gs = ts.values.get(name)
        if isinstance(gs, int):
            out.append(Counter(f"{ts.file}:{name}", gs))
    return out


def record_steps(ckpt: Checkpoint) -> list[Counter]:
    """The ``global_step`` of ckpttool's layout record (docs/design.md §4: the training step its writer recorded for
    the save), as a trainer counter beside :func:`trainer_steps`' (after them): ``layout.global_step`` for the byte
    item, ``layout.json:global_step`` for the sidecar; empty without one. ``validate``'s ``R002`` and
    ``replay-step`` compare the optimizer's ``step`` with it."""
    record = ckpt.layout.record if ckpt.layout is not None else None
    if record is None or record.global_step is None:
        return []
    where = "layout.json" if ckpt.layout is not None and ckpt.layout.source == "sidecar" else "layout"
    sep = ":" if where == "layout.json" else "."
    return [Counter(f"{where}{sep}global_step", record.global_step)]


def _phase_of_a_sequence(key: str, entries: Mapping[str, object]) -> bool:
    """``key`` is a counter of a scheduler nested in ``<parent>._schedulers.<i>.`` whose parent saves its own
    ``last_epoch``: torch's ``SequentialLR`` (warmup, then cosine) steps one child at a time and keeps the run's
    count itself, so a child's ``last_epoch`` counts only its own phase. ``ChainedScheduler`` saves no counter of
    its own and steps every child each step: its children's count the run's steps."""
    parts = key.split(".")
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "_schedulers" and ".".join([*parts[:i], "last_epoch"]) in entries:
            return True
    return False


def scheduler_counters(ckpt: Checkpoint) -> tuple[list[Counter], list[Counter]]:
    """``(last_epoch counters, _step_count counters)`` of the saved LR schedulers (not those of the phases of a
    ``SequentialLR``, which count their own phase: :func:`_phase_of_a_sequence`)."""
    epochs, counts = [], []
    entries = ckpt.reader.metadata.entries
    root = ckpt.catalog.schema.state_root  # "app." in an app-state save; top-level items are read too
    for key, meta in entries.items():
        if not isinstance(meta, BytesMeta):
            continue
        if key[len(root) if key.startswith(root) else 0 :].split(".", 1)[0] not in SCHEDULER_ITEMS:
            continue
        if "._schedulers." in key and _phase_of_a_sequence(key, entries):
            continue
        if key.endswith(".last_epoch") and (v := _int_item(ckpt, key)) is not None:
            epochs.append(Counter(key, v))
        elif key.endswith("._step_count") and (v := _int_item(ckpt, key)) is not None:
            counts.append(Counter(key, v))
    return epochs, counts


def _number(v: object) -> float | None:
    """``v`` as a float when it is a real number or a one-element tensor of one (an ``lr`` saved as a tensor)."""
    if type(v) in (int, float):
        return float(v)  # type: ignore[arg-type]
    numel = getattr(v, "numel", None)
    if callable(numel) and numel() == 1 and not getattr(v, "is_complex", lambda: False)():
        return float(v.item())  # type: ignore[attr-defined]
    return None


def _last_lrs(ckpt: Checkpoint) -> list[tuple[str, list[float]]]:
    """``(key, values)`` of each saved LR scheduler's ``_last_lr`` (torch's ``LRScheduler.state_dict()``: the ``lr``
    its last ``step()`` set in each param group, in group order), not those of a ``SequentialLR``'s or
    ``ChainedScheduler``'s children (the parent's is the run's); an item that cannot be read or holds anything but a
    list of numbers is left out (never raises)."""
    out = []
    root = ckpt.catalog.schema.state_root
    for key, meta in ckpt.reader.metadata.entries.items():
        if not isinstance(meta, BytesMeta) or not key.endswith("._last_lr") or "._schedulers." in key:
            continue
        if key[len(root) if key.startswith(root) else 0 :].split(".", 1)[0] not in SCHEDULER_ITEMS:
            continue
        try:
            ckpt.reader.storage_info(key)
            v = ckpt.reader.read_object(key)
        except CkptError:
            continue
        values = [_number(x) for x in v] if isinstance(v, (list, tuple)) else []
        if values and all(x is not None for x in values):
            out.append((key, [x for x in values if x is not None]))
    return out


def _plateau(ckpt: Checkpoint, last_lr_key: str) -> bool:
    """The scheduler whose ``_last_lr`` is ``last_lr_key`` is torch's ``ReduceLROnPlateau``: its ``state_dict()`` saves
    ``min_lrs`` (one per param group) beside it, and it puts no ``initial_lr`` into its optimizer's groups."""
    return last_lr_key.removesuffix("_last_lr") + "min_lrs" in ckpt.reader.metadata.entries


#: The entries of a Megatron-style ``OptimizerParamScheduler.state_dict()`` (megatron-core's, NeMo Automodel's copy)
#: that fix the lr it sets past its warmup. ``init_lr`` (the warmup's start) and WSD's ``wsd_decay_steps`` are not
#: saved.
PARAM_SCHEDULER_KEYS = ("max_lr", "min_lr", "num_steps", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def param_scheduler_states(ckpt: Checkpoint) -> list[tuple[str, dict[str, object]]]:
    """``(where, state)`` of each saved Megatron-style LR scheduler (:data:`PARAM_SCHEDULER_KEYS`): byte items below
    an item of :data:`SCHEDULER_ITEMS` or ``opt_param_scheduler`` (a loop's ``dcp.save``; NeMo Automodel's ``sched``),
    and the ``opt_param_scheduler`` of the trainer's common state (Megatron-LM's ``common.pt``). Never raises."""
    out: list[tuple[str, dict[str, object]]] = []
    entries = ckpt.reader.metadata.entries
    for key in entries:
        if not key.endswith(".num_steps"):
            continue
        item = key.removesuffix(".num_steps")
        top = item[len(ckpt.catalog.schema.state_root) :] if item.startswith(ckpt.catalog.schema.state_root) else item
        if top.split(".", 1)[0] not in (*SCHEDULER_ITEMS, "opt_param_scheduler"):
            continue
        if all(f"{item}.{k}" in entries for k in PARAM_SCHEDULER_KEYS):
            out.append((item, {k: _small_item(ckpt, f"{item}.{k}") for k in PARAM_SCHEDULER_KEYS}))
    if ckpt.common_state_file is not None:
        try:
            common = ckpt.common_state()
        except CkptError:
            common = None  # named by the rules that read it
        if common is not None and all(k in common.scheduler for k in PARAM_SCHEDULER_KEYS):
            out.append((f"{ckpt.common_state_file} {common.scheduler_item}", dict(common.scheduler)))
    return out


def param_scheduler_lr(state: Mapping[str, object], group: Mapping[str, object]) -> float | None:
    """The lr a Megatron-style ``OptimizerParamScheduler`` (``state``: its saved entries) sets in param group ``group``
    (its ``max_lr``/``min_lr`` where it saves them, else the scheduler's), as its ``get_lr`` computes it
    (``megatron/core/optimizer_param_scheduler.py``): ``max_lr`` for ``constant``, ``min_lr`` past ``lr_decay_steps``,
    else ``linear``, ``cosine`` or ``inverse-square-root`` decay from ``max_lr`` to ``min_lr``. ``None`` where it cannot
    be told: within the warmup (its start, ``init_lr``, is not saved), ``WSD`` (``wsd_decay_steps`` not saved), another
    style, entries that are not numbers."""
    nums = [_number(group.get(k, state.get(k))) for k in ("max_lr", "min_lr")]
    steps = [state.get(k) for k in ("num_steps", "lr_warmup_steps", "lr_decay_steps")]
    if any(v is None for v in nums) or not all(type(v) is int for v in steps):
        return None
    hi, lo = nums[0] or 0.0, nums[1] or 0.0
    n, warm, decay = (int(v) for v in steps)  # type: ignore[call-overload]
    style = state.get("lr_decay_style")
    if warm > 0 and n <= warm:
        return None
    if style == "constant":
        return hi
    if n > decay:
        return lo
    if style == "inverse-square-root":
        return max(lo, hi * math.sqrt(max(warm, 1)) / math.sqrt(max(n, 1)))
    if decay <= warm or style not in ("linear", "cosine"):
        return None
    ratio = (n - warm) / (decay - warm)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return lo + coeff * (hi - lo)


def _lr_not_the_param_scheduler(
    ckpt: Checkpoint, groups: list[ParamGroup], selected: set[int | str] | None
) -> list[tuple[str, str]]:
    """The findings of :func:`scheduler_lr_disagrees` for a saved Megatron-style scheduler (one only: with several,
    which groups are whose is not saved), over the groups without ``initial_lr`` (torch's schedulers' groups): a
    group's ``lr`` is neither the one its state sets nor that times the group's ``lr_mult`` (NeMo Automodel's
    copy multiplies it in)."""
    states = param_scheduler_states(ckpt)
    if len(states) != 1:
        return []
    where, state = states[0]
    out: list[tuple[int | str, str, str]] = []
    for g in groups:
        lr = _number(g.values.get("lr"))
        if lr is None or "initial_lr" in g.values or (selected is not None and g.group_id not in selected):
            continue
        want = param_scheduler_lr(state, g.values)
        mult = _number(g.values.get("lr_mult"))
        if want is None or any(
            math.isclose(lr, w, rel_tol=1e-6) for w in (want, want * (1.0 if mult is None else mult))
        ):
            continue
        out.append(
            (
                g.group_id,
                g.keys.get("lr", where),
                f"saved lr {lr:g} but {where} sets {want:g} at num_steps = "
                f"{state['num_steps']} (lr_decay_style {state['lr_decay_style']})",
            )
        )
    return alike_groups(out, " ")


def scheduler_lr_disagrees(
    ckpt: Checkpoint, groups: list[ParamGroup], selected: set[int | str] | None = None
) -> list[tuple[str, str]]:
    """``(key, message)`` of each param group (of ``selected`` group ids, default all) whose saved ``lr`` is not the
    ``lr`` the saved LR scheduler set in it (its ``_last_lr``): the scheduler moved the ``lr`` and the param groups
    were saved without it (an optimizer state taken before the scheduler stepped, or its groups rebuilt from the
    config), so a resume takes its next step with an ``lr`` the run never had. ``groups`` are every param group,
    loaded (:meth:`~ckpttool.model.checkpoint.Checkpoint.param_groups`). Only groups a scheduler governs are
    checked: torch's ``LRScheduler`` puts an ``initial_lr`` in each group of its optimizer, so a group without one
    (an optimizer no scheduler drives, beside one that has) is compared with those schedulers only. A group without
    one is compared with the saved ``ReduceLROnPlateau`` schedulers (:func:`_plateau`, which put none), where they
    tell it is theirs: nested groups without one as many as their ``lr`` values, or flattened groups beside a
    ``ReduceLROnPlateau`` as the only scheduler, with no more sets of hyperparameters than its ``lr`` values (one
    per group of its optimizer; more: groups of another optimizer, which no scheduler drives). One scheduler whose ``_last_lr`` has one value per compared nested
    group is matched by index; otherwise (flattened groups, whose order is not saved; several optimizers and
    schedulers, which group belongs to which not saved) a group whose ``lr`` is none of the schedulers' values is one.
    A ``ReduceLROnPlateau`` that does not govern the groups without ``initial_lr`` drives groups with one (a warmup
    scheduler's, stepped until the plateau takes over), so those are compared with every scheduler's values.
    Groups without a numeric ``lr`` are left out (``validate``'s ``P006``). Groups with the same finding are one,
    ``param group <id> and N more saved lr ...`` (:func:`~ckpttool.model.catalog.alike_groups`)."""
    lasts = _last_lrs(ckpt)
    if not lasts:
        return _lr_not_the_param_scheduler(ckpt, groups, selected)
    plateaus = [(k, last) for k, last in lasts if _plateau(ckpt, k)]
    others = [(k, last) for k, last in lasts if not _plateau(ckpt, k)]
    nested = all(g.flavor == "nested" for g in groups)
    bare = [g for g in groups if "initial_lr" not in g.values]
    if nested:
        plateau_governs = len(bare) == sum(len(last) for _, last in plateaus)
    else:  # one hyperparameter set per group of its optimizer: more are another optimizer's groups
        leaves = {
            tuple(sorted((k, repr(v)) for k, v in g.values.items() if k not in ("params", "param_names"))) for g in bare
        }
        plateau_governs = len(lasts) == 1 and len(bare) == len(groups) and len(leaves) <= len(lasts[0][1])
    # a plateau scheduler that is not the bare groups' shares an optimizer with a warmup (LinearLR, then
    # ReduceLROnPlateau): once the warmup stops stepping, the groups hold the plateau's lr, not its _last_lr
    drivers = [(others if plateau_governs else lasts, [g for g in groups if "initial_lr" in g.values])]
    if plateaus and plateau_governs:
        drivers.append((plateaus, bare))
    out: list[tuple[int | str, str, str]] = []
    for scheds, governed in drivers:
        if scheds and governed:
            out += _lr_not_the_schedulers(scheds, governed, selected, by_index=nested)
    return alike_groups(out, " ")


def _lr_not_the_schedulers(
    lasts: list[tuple[str, list[float]]], groups: list[ParamGroup], selected: set[int | str] | None, *, by_index: bool
) -> list[tuple[int | str, str, str]]:
    """The findings of :func:`scheduler_lr_disagrees` for ``groups`` (``(group_id, key, problem)``, not yet grouped),
    governed by the schedulers of ``lasts``: by index where ``by_index`` (nested groups) and one scheduler saved one
    ``lr`` per group, else by membership."""
    key0, last0 = lasts[0]
    by_index = by_index and len(lasts) == 1 and len(last0) == len(groups)
    every = [w for _, last in lasts for w in last]
    names = ", ".join(f"{k} = [{', '.join(f'{w:g}' for w in last)}]" for k, last in lasts)
    out: list[tuple[int | str, str, str]] = []
    for i, g in enumerate(groups):
        lr = _number(g.values.get("lr"))
        if lr is None or (selected is not None and g.group_id not in selected):
            continue
        want = [last0[i]] if by_index else every
        if any(math.isclose(lr, w, rel_tol=1e-6, abs_tol=0.0) for w in want):
            continue
        where = f"{key0}[{i}] = {last0[i]:g}" if by_index else names
        out.append((g.group_id, g.keys.get("lr", key0), f"saved lr {lr:g} but {where}"))
    return out


def keeps_no_state(group: ParamGroup) -> bool:
    """A param group of torch's ``SGD`` with ``momentum`` 0: its steps keep no per-parameter state
    (``optimizer.state`` stays empty however many steps it took)."""
    m = group.values.get("momentum")
    return "betas" not in group.values and type(m) in (int, float) and m == 0


def lost_optimizer_state(ckpt: Checkpoint, counters: list[Counter] | None = None) -> tuple[str, str] | None:
    """``(key, message)`` when param groups are saved with no optimizer state for any parameter (an
    optimizer that never stepped: step 0) while a trainer step or scheduler ``last_epoch`` (``counters``;
    default: those read here) counts steps taken: the moments of those steps were lost (an optimizer
    rebuilt before the save, the state file of a fresh optimizer), and a resume restarts them from zero.
    ``None`` otherwise, and for param groups of plain SGD (``momentum`` 0), which keeps no state.
    Megatron keeps its step in ``common.pt`` (its moments are state: not this case)."""
    cat = ckpt.catalog
    if any(ps.fields for ps in cat.optimizer_state.values()) or not cat.param_groups:
        return None
    try:
        groups = ckpt.param_groups()
    except CkptError:  # an unreadable group item is the storage checks' finding
        groups = cat.param_groups
    if all(keeps_no_state(g) for g in groups):
        return None  # plain SGD steps without any per-parameter state: nothing was lost
    if counters is None:
        counters = [*trainer_steps(ckpt), *scheduler_counters(ckpt)[0]]
    top = max(counters, key=lambda c: c.value, default=None)
    if top is None or top.value <= 0:
        return None
    n = len({p for g in cat.param_groups for p in g.params})
    return (
        f"{cat.schema.optimizer_prefix or ''}state",
        f"no optimizer state for any of the {n} parameter(s) of the param groups (an optimizer that never "
        f"stepped) but {top.key} = {top.value}: the moments of {top.value} step(s) were not saved",
    )


def synthesized_state_lost(ckpt: Checkpoint, n: int) -> tuple[str, str] | None:
    """``(key, message)`` when the ``n`` parameters whose state is the one torch makes up for an optimizer that never
    stepped (step 1, all-zero moments: ``validate``'s ``D005``) are every parameter with state, while the trainer's
    step or an LR scheduler's ``last_epoch`` counts 2 or more steps taken: an optimizer rebuilt before the save
    (``get_state_dict`` of a fresh one), whose moments of those steps were lost, as with no state at all
    (:func:`lost_optimizer_state`). ``None`` otherwise, and where a loss scaler may have skipped every step so far
    (:func:`skips_optimizer_steps`: fp16 overflows at the first scales)."""
    if not n or n < sum(1 for ps in ckpt.catalog.optimizer_state.values() if ps.fields) or skips_optimizer_steps(ckpt):
        return None
    top = max([*trainer_steps(ckpt), *scheduler_counters(ckpt)[0]], key=lambda c: c.value, default=None)
    if top is None or top.value < 2:  # 1: a loop that counts its first step before the optimizer takes it
        return None
    return (
        f"{ckpt.catalog.schema.optimizer_prefix or ''}state",
        f"the optimizer state of all {n} parameter(s) is what torch makes up for an optimizer that never stepped "
        f"(step 1, all-zero moments: D005) but {top.key} = {top.value}: the moments of {top.value} step(s) were "
        "not saved (an optimizer rebuilt before the save): resume from an earlier save whose optimizer state was "
        "saved; where it was reset on purpose (these weights fine-tuned with a new optimizer), a resume restarts the "
        "moments from zero, as that reset did",
    )


#: The entries of a saved ``torch.amp.GradScaler`` (``state_dict()``: ``scale``, ``growth_factor``, ``backoff_factor``,
#: ``growth_interval``, ``_growth_tracker``), as the last components of its flattened keys.
_GRAD_SCALER_KEYS = ("scale", "backoff_factor", "_growth_tracker")

#: Why an optimizer's step is one ahead of the trainer's in every save of a run: torch's ``_init_optim_state``
#: (``torch/distributed/checkpoint/state_dict.py``), which ``get_state_dict`` runs on an optimizer with no state,
#: takes one zero-lr step with zero gradients to create it, and the live optimizer keeps that step.
ONE_AHEAD = (
    "; one ahead, as after a save before the first step: get_state_dict on an optimizer with no state yet takes "
    "one zero-lr step to create it (torch's _init_optim_state) and the live optimizer keeps counting from it"
)


def saves_grad_scaler(ckpt: Checkpoint) -> bool:
    """The checkpoint saves a loss scaler's state (``torch.amp.GradScaler``, any item name): ``scaler.step(opt)``
    skips the optimizer step of an iteration whose gradients hold inf/NaN, while the trainer's step and the LR
    scheduler count it, so the optimizer's ``step`` is legitimately behind them (never ahead)."""
    entries = ckpt.reader.metadata.entries
    for key in entries:
        if key.endswith("._growth_tracker"):
            item = key[: -len("._growth_tracker")]
            if all(f"{item}.{k}" in entries for k in _GRAD_SCALER_KEYS):
                return True
    return False


def skips_optimizer_steps(ckpt: Checkpoint) -> bool:
    """The trainer counts steps whose optimizer step was skipped, so the optimizer's ``step`` may be behind its
    step and its LR scheduler: a saved ``GradScaler`` (:func:`saves_grad_scaler`) or a trainer's own loss scaler
    (``SchemaSpec.skips_overflow_steps``: Megatron's, an iteration that overflowed), or the trainer's own skip-step
    optimizer, told by its param groups (``SchemaSpec.skip_step_groups``: OLMo-core's ``SkipStepAdamW``, a loss
    spike)."""
    spec = ckpt.catalog.schema.spec
    if spec is not None and spec.skip_step_groups is not None and spec.skip_step_groups(ckpt.catalog.param_groups):
        return True
    return saves_grad_scaler(ckpt) or (spec is not None and spec.skips_overflow_steps)


def optimizer_step_disagrees(
    ckpt: Checkpoint, opt: Counter, ref: Counter, *, all_params: bool = True
) -> tuple[str, str] | None:
    """``(key, message)`` when the optimizer's largest saved ``step`` (``opt``) is not the step ``ref`` (the
    trainer's, else a per-step LR scheduler's ``last_epoch``) counts: optimizer state of another save beside
    the trainer's counters (``validate``'s ``R002``). Behind is allowed where a ``GradScaler`` is saved or the
    trainer is Megatron (a step skipped for a loss-scale overflow, which the iteration still counts), and where
    ``all_params`` is false (the largest step of a subset: parameters that missed gradients count fewer); ahead
    never is."""
    if opt.value == ref.value:
        return None
    if opt.value < ref.value and (not all_params or skips_optimizer_steps(ckpt)):
        return None
    return (
        opt.key,
        f"optimizer step {opt.value} ({opt.key}, the largest) but {ref.key} = {ref.value}"
        + (ONE_AHEAD if opt.value == ref.value + 1 else ""),
    )


def step_directory(ckpt: Checkpoint) -> tuple[str, int] | None:
    """``(name, step)`` of the step directory the checkpoint was saved in, where its trainer names step directories
    by the trainer step (:attr:`~ckpttool.model.schemas.base.SchemaSpec.step_dir_is_trainer_step`): the checkpoint
    directory itself (torchtitan's ``step-N``), or the directory above a step folder of the schema (OLMo-core's
    ``stepN/model_and_optim``, verl's ``global_step_N/actor``) or above a model/optimizer pair (NeMo Automodel's
    ``epoch_E_step_S/model`` + ``optim``); ``None`` otherwise."""
    from ckpttool.model.discovery import step_of
    from ckpttool.model.schemas import registry

    spec = registry.find(ckpt.catalog.schema.id)
    if spec is None or not spec.step_dir_is_trainer_step:
        return None
    d = Path(ckpt.located.model)
    if d.name in {folder for folder, _ in spec.discovery.step_folders} or ckpt.located.optimizer is not None:
        d = d.parent
    step = step_of(d.name)
    return None if step is None else (d.name, step)


def several_optimizer_steps(ckpt: Checkpoint) -> bool:
    """The trainer takes a varying number of optimizer steps per trainer step (verl's PPO mini-batches): the
    optimizer's ``step`` counts neither the trainer's steps nor the LR scheduler's
    (:attr:`~ckpttool.model.schemas.base.SchemaSpec.several_optimizer_steps_per_step`)."""
    from ckpttool.model.schemas import registry

    spec = registry.find(ckpt.catalog.schema.id)
    return spec is not None and spec.several_optimizer_steps_per_step


def directory_step_disagrees(
    ckpt: Checkpoint, counter: Counter | None, *, may_lag: bool = False
) -> tuple[str, str] | None:
    """``(key, message)`` when ``counter`` (the trainer's saved step, else the optimizer's, else the LR scheduler's)
    is not a step its step directory (:func:`step_directory`) can hold: within ``[N + lo, N + hi]`` of the directory's
    step ``N`` (:attr:`~ckpttool.model.schemas.base.SchemaSpec.step_dir_range`; ``may_lag``: any step behind is
    allowed, an optimizer that skips steps the trainer counts): a save copied or renamed into another step's
    directory, which a resume from that step would continue at the saved step instead (``validate``'s ``R002``)."""
    from ckpttool.model.schemas import registry

    named = step_directory(ckpt)
    spec = registry.find(ckpt.catalog.schema.id)
    if named is None or counter is None or spec is None:
        return None
    lo, hi = spec.step_dir_range
    low = None if lo is None or may_lag else named[1] + lo
    high = None if hi is None else named[1] + hi
    if (low is None or counter.value >= low) and (high is None or counter.value <= high):
        return None
    if (low, high) == (named[1], named[1]):
        expected = ""
    elif low is None:
        expected = f"; a save there holds step {high} or less"
    elif high is None:
        expected = f"; a save there holds step {low} or more"
    else:
        expected = f"; a save there holds step {' or '.join(str(v) for v in range(low, high + 1))}"
    return counter.key, f"{counter.key} = {counter.value} but its directory is {named[0]} (step {named[1]}{expected})"


def scheduler_per_step(ckpt: Checkpoint) -> bool:
    """The checkpoint's trainer steps its LR scheduler once per optimizer step (:attr:`SchemaSpec.scheduler_per_step`;
    ``False`` for a schema ckpttool has no spec of)."""
    from ckpttool.model.schemas import registry

    spec = registry.find(ckpt.catalog.schema.id)
    return spec is not None and spec.scheduler_per_step


def scheduler_disagrees(
    ckpt: Checkpoint, ref: Counter, epochs: list[Counter], *, ref_may_lag: bool = False
) -> list[tuple[str, str]]:
    """``(key, message)`` of each LR scheduler ``last_epoch`` (``epochs``) that is not the step ``ref`` counts
    (``validate``'s ``R002``). A scheduler behind ``ref`` is one only where the trainer steps it once per optimizer
    step (:func:`scheduler_per_step`; else it may step per epoch: ``R004``). ``ref_may_lag``: ``ref`` (an optimizer's
    step) may be behind the scheduler legitimately (the largest step of a subset of the parameters, or a trainer
    that skips optimizer steps the scheduler counts: :func:`skips_optimizer_steps`), so a scheduler ahead is not."""
    per_step = scheduler_per_step(ckpt)
    return [
        (c.key, f"LR scheduler {c.key} = {c.value} but {ref.key} = {ref.value}")
        for c in epochs
        if c is not ref and c.value != ref.value and (per_step if c.value < ref.value else not ref_may_lag)
    ]
