"""Resume-safety rules (``R``): would a resume from this checkpoint continue the run it came from?

``R001`` looks at the run root the checkpoint was chosen from (:mod:`ckpttool.model.discovery`);
``R002`` compares the step counters that the optimizer, the trainer and the LR scheduler saved
(values from the ``--deep`` pass and the small training-state byte items). ``docs/rules.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.errors import CkptError
from ckpttool.format.metadata import BytesMeta
from ckpttool.model.beside import TRAINER_STEP_KEY, read_training_state_beside
from ckpttool.ops.validate.base import rule
from ckpttool.ops.validate.context import Context
from ckpttool.ops.validate.rules.data import saved_steps, synthesized_from_stats

if TYPE_CHECKING:
    from ckpttool.model.schemas.megatron import MegatronCommon


@rule("R001")
def newer_step_incomplete(ctx: Context) -> Iterator[tuple[str, str]]:
    loc = ctx.ckpt.located
    for inc in loc.newer_incomplete:
        chosen = f"step {loc.step}" if loc.step is not None else str(loc.model)
        yield (
            str(inc.path),
            f"{inc.path}: step {inc.step} is newer than the checked {chosen} but incomplete ({inc.reason})",
        )


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
_SCHEDULER_ITEMS = ("lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "sched")


@dataclass(frozen=True)
class _Counter:
    key: str
    value: int


def _int_item(ctx: Context, key: str) -> int | None:
    meta = ctx.reader.metadata.entries.get(key)
    if not isinstance(meta, BytesMeta) or not ctx.storage_ok(key):
        return None
    try:
        v = ctx.reader.read_object(key)
    except CkptError:
        return None  # reported by the storage rules
    return v if type(v) is int else None


def _train_steps(ctx: Context) -> list[_Counter]:
    out = [_Counter(k, v) for k in TRAIN_STEP_KEYS if (v := _int_item(ctx, k)) is not None]
    for st in ctx.ckpt.extra_state():
        if st.global_step is not None:
            out.append(_Counter(st.file.relative_path, st.global_step))
    if ctx.ckpt.located is not None:  # OLMo-core's train/rankR.pt, NeMo's step_scheduler.pt beside the checkpoint
        for ts in read_training_state_beside(Path(ctx.ckpt.located.model)):
            name = TRAINER_STEP_KEY.get(ts.file, "global_step")
            gs = ts.values.get(name)
            if isinstance(gs, int):
                out.append(_Counter(f"{ts.file}:{name}", gs))
    return out


def _scheduler_counters(ctx: Context) -> tuple[list[_Counter], list[_Counter]]:
    """``(last_epoch counters, _step_count counters)`` of the saved LR schedulers."""
    epochs, counts = [], []
    for key, meta in ctx.reader.metadata.entries.items():
        if not isinstance(meta, BytesMeta) or key.split(".", 1)[0] not in _SCHEDULER_ITEMS:
            continue
        if key.endswith(".last_epoch") and (v := _int_item(ctx, key)) is not None:
            epochs.append(_Counter(key, v))
        elif key.endswith("._step_count") and (v := _int_item(ctx, key)) is not None:
            counts.append(_Counter(key, v))
    return epochs, counts


def _optimizer_step(ctx: Context) -> _Counter | None:
    """The largest saved optimizer ``step`` (parameters that missed gradients count fewer)."""
    best: _Counter | None = None
    for key, values, _ in saved_steps(ctx):
        for v in values or ():
            if math.isfinite(v) and v >= 0 and v == int(v) and (best is None or v > best.value):
                best = _Counter(key, int(v))
    return best


@rule("R002")
def train_step_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    yield from _megatron_iteration(ctx)
    if synthesized_from_stats(ctx):
        return  # saved before the first optimizer step (D005): the counters of no step to compare
    opt = _optimizer_step(ctx)
    trains = _train_steps(ctx)
    epochs, counts = _scheduler_counters(ctx)
    yield from _no_optimizer_state(ctx, trains + epochs)
    ref = trains[0] if trains else (opt if opt is not None else (epochs[0] if epochs else None))
    if ref is None:
        return
    for c in trains[1:]:
        if c.value != ref.value:
            yield c.key, f"{c.key} = {c.value} but {ref.key} = {ref.value}"
    if opt is not None and opt is not ref and opt.value != ref.value:
        yield opt.key, f"optimizer step {opt.value} ({opt.key}, the largest) but {ref.key} = {ref.value}"
    for c in epochs:
        if c is not ref and c.value != ref.value:
            yield c.key, f"LR scheduler {c.key} = {c.value} but {ref.key} = {ref.value}"
    by_item = {e.key.rsplit(".", 1)[0]: e for e in epochs}
    for c in counts:
        e = by_item.get(c.key.rsplit(".", 1)[0])
        if e is not None and c.value != e.value + 1:
            yield c.key, f"LR scheduler {c.key} = {c.value} but {e.key} = {e.value} (expected last_epoch + 1)"


def _no_optimizer_state(ctx: Context, counters: list[_Counter]) -> Iterator[tuple[str, str]]:
    """Param groups saved but no state for any parameter (an optimizer that never stepped: step 0) while the
    trainer's step or the scheduler's ``last_epoch`` counts steps taken: the moments of those steps were
    lost (an optimizer rebuilt before the save, a state file of a fresh optimizer); a resume restarts them
    from zero. Megatron keeps its step in ``common.pt`` (its moments are state: not this case)."""
    if opt_state_saved(ctx) or not ctx.cat.param_groups:
        return
    top = max(counters, key=lambda c: c.value, default=None)
    if top is not None and top.value > 0:
        n = len({p for g in ctx.cat.param_groups for p in g.params})
        key = f"{ctx.cat.schema.optimizer_prefix or ''}state"
        yield (
            key,
            f"no optimizer state for any of the {n} parameter(s) of the param groups (an optimizer that never "
            f"stepped) but {top.key} = {top.value}: the moments of {top.value} step(s) were not saved",
        )


def opt_state_saved(ctx: Context) -> bool:
    """Some parameter has saved optimizer state (any field)."""
    return any(ps.fields for ps in ctx.cat.optimizer_state.values())


def _megatron_iteration(ctx: Context) -> Iterator[tuple[str, str]]:
    """Megatron's ``common.pt`` ``iteration`` against the ``iter_NNNNNNN`` directory it was saved in (megatron
    names the directory by the iteration it saves; a resume continues from ``common.pt``'s)."""
    if ctx.cat.schema.id != "megatron" or ctx.ckpt.located is None:
        return
    from ckpttool.model.discovery import step_of
    from ckpttool.model.schemas.megatron import COMMON_FILE, read_common

    d = Path(ctx.ckpt.located.model)
    named = step_of(d.name)
    try:
        common = read_common(d)
    except CkptError:
        return  # named by the rules that read it
    if common is None:
        return
    if named is not None and common.iteration is not None and common.iteration != named:
        yield COMMON_FILE, f"{COMMON_FILE} iteration = {common.iteration} but its directory is {d.name} (step {named})"
    yield from _megatron_common_steps(common)


def _megatron_common_steps(common: MegatronCommon) -> Iterator[tuple[str, str]]:
    """The optimizers' ``common_step`` of ``common.pt``: megatron's ``ChainedOptimizer`` steps every chained
    optimizer together (one skip decision for all), and an optimizer never steps more often than the
    iterations run (a step skipped for a loss-scale overflow, or a resume with ``--no-load-optim``,
    leaves it behind; nothing puts it ahead)."""
    from ckpttool.model.schemas.megatron import COMMON_FILE

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
