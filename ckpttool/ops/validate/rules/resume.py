"""Resume-safety rules (``R``): would a resume from this checkpoint continue the run it came from?

``R001`` looks at the run root the checkpoint was chosen from (:mod:`ckpttool.model.discovery`);
``R002`` compares the step counters that the optimizer, the trainer and the LR scheduler saved
(values from the ``--deep`` pass and the small training-state byte items); ``R004`` names a scheduler behind
them where the trainer's convention is not known (per-epoch or stale); ``R006`` a param group's ``lr`` that is not
the one the saved LR scheduler set. ``docs/rules.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from ckpttool.errors import CkptError
from ckpttool.model import counters
from ckpttool.ops.validate.base import RuleSkipped, rule
from ckpttool.ops.validate.context import Context
from ckpttool.ops.validate.rules.data import saved_steps, synthesized_from_stats


@rule("R001")
def newer_step_incomplete(ctx: Context) -> Iterator[tuple[str, str]]:
    loc = ctx.ckpt.located
    for inc in loc.newer_incomplete:
        chosen = f"step {loc.step}" if loc.step is not None else str(loc.model)
        yield (
            str(inc.path),
            f"{inc.path}: step {inc.step} is newer than the checked {chosen} but incomplete ({inc.reason})",
        )


@rule("R005")
def latest_names_no_checkpoint(ctx: Context) -> Iterator[tuple[str, str]]:
    """The run root given names a latest step (its ``latest`` file) that no checkpoint below it has, or one whose
    save did not finish (Megatron-LM, verl, DeepSpeed follow the file and fail there), while the checkpoint checked
    was chosen without it (its only one, or ``--step N``): ``--step latest`` is ``E205`` / ``E202`` there."""
    from ckpttool.errors import IncompleteCheckpointError, StepNotFoundError
    from ckpttool.model.discovery import CheckpointSelection, locate
    from ckpttool.model.schemas import registry

    loc = ctx.ckpt.located
    given = Path(loc.given)
    if given == Path(loc.model) or not given.is_dir():
        return
    try:
        locate(given, CheckpointSelection(step="latest"))
    except (StepNotFoundError, IncompleteCheckpointError) as e:
        p = Path(e.path) if e.path is not None else None
        if p is not None and p.parent == given and p.name in registry.derived().discovery.latest_files:
            yield str(e.path), e.message  # the latest file's own complaint
    except CkptError:
        return  # another reason --step latest fails there: not this rule's


@rule("R008")
def latest_file_missing(ctx: Context) -> Iterator[tuple[str, str]]:
    """The checkpoint was chosen below a run root (its step directory is one of the root's) whose trainer resumes only
    from its ``latest`` file (verl: ``latest_checkpointed_iteration.txt``), and the root holds none: the trainer's
    resume loads no step (verl trains from scratch), whichever step was checked."""
    from ckpttool.model.discovery import missing_latest

    loc = ctx.ckpt.located
    given = Path(loc.given)
    if given == Path(loc.model) or not given.is_dir():
        return
    missing = missing_latest(given, Path(loc.model))
    if missing is None:
        return
    chosen = f"step {loc.step}" if loc.step is not None else str(loc.model)
    yield (
        str(missing[0]),
        f"{given}: no {missing[0].name}, so the checked {chosen} is not what a resume of this run loads: {missing[1]}",
    )


@rule("R007")
def step_model_differs(ctx: Context) -> Iterator[tuple[str, str]]:
    """The step chosen below a run root (``DIR --step N|latest``, or the root's only complete step) holds another
    model than the newest complete step before it in the same folder: model keys only in one of them, or a key
    whose global shape differs (a step of another run copied in; the model config changed between saves). One
    resume builds one model, which cannot load both."""
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.model.discovery import older_steps

    loc = ctx.ckpt.located
    here = Path(loc.model)
    if Path(loc.given) == here or loc.step is None or loc.optimizer is not None:
        return
    older = older_steps(here)[:1]
    if not older:
        return
    step, path = older[0]
    try:
        other = open_checkpoint(path).catalog
    except CkptError as e:  # not this checkpoint's finding, but never passed as compared
        raise RuleSkipped(f"step {step} before it ({path}) could not be read: [{e.code}] {e.message}") from None
    namings = {other.schema.naming, ctx.ckpt.catalog.schema.naming}
    if len(namings) > 1 and "unknown" not in namings:
        return  # one model under two namings (torchtitan's last_save_in_hf: the last step in HF names)
    theirs = {k: e.shape for k, e in other.model.items()}
    mine = {k: e.shape for k, e in ctx.ckpt.catalog.model.items()}
    if not mine or not theirs:
        return
    only_here = sorted(set(mine) - set(theirs))
    only_there = sorted(set(theirs) - set(mine))
    shaped = sorted(k for k in set(mine) & set(theirs) if tuple(mine[k]) != tuple(theirs[k]))
    if not (only_here or only_there or shaped):
        return
    parts = []
    if only_here:
        parts.append(f"{len(only_here)} model key(s) only in it (e.g. {only_here[0]})")
    if only_there:
        parts.append(f"{len(only_there)} only in step {step} (e.g. {only_there[0]})")
    if shaped:
        k = shaped[0]
        shape_here, shape_there = list(mine[k]), list(theirs[k])
        parts.append(f"{len(shaped)} of another shape (e.g. {k}: {shape_here} here, {shape_there} in step {step})")
    yield (
        str(here),
        f"{here}: step {loc.step} holds another model than step {step} before it ({path}): " + "; ".join(parts),
    )


def _optimizer_step(ctx: Context) -> counters.Counter | None:
    """The largest saved optimizer ``step`` (parameters that missed gradients count fewer)."""
    best: counters.Counter | None = None
    for key, values, _ in saved_steps(ctx):
        for v in values or ():
            if math.isfinite(v) and v >= 0 and v == int(v) and (best is None or v > best.value):
                best = counters.Counter(key, int(v))
    return best


@rule("R002")
def train_step_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    yield from _common_state_iteration(ctx)
    if not ctx.deep:
        return  # common.pt alone (``shallow`` in rules.json): the other counters are the deep pass's
    synthesized = synthesized_from_stats(ctx)
    if synthesized:  # saved before the first optimizer step (D005): the counters of no step to compare
        lost = counters.synthesized_state_lost(ctx.ckpt, len(synthesized))
        if lost is not None:
            yield lost
        return
    # verl: the optimizer steps once per PPO mini-batch, the scheduler and the directory count training steps
    opt = None if counters.several_optimizer_steps(ctx.ckpt) else _optimizer_step(ctx)
    trains = counters.trainer_steps(ctx.ckpt) + counters.record_steps(ctx.ckpt)
    epochs, counts = counters.scheduler_counters(ctx.ckpt)
    yield from _no_optimizer_state(ctx, trains + epochs)
    ref = trains[0] if trains else (opt if opt is not None else (epochs[0] if epochs else None))
    if ref is None:
        return
    for c in trains[1:]:
        if c.value != ref.value:
            yield c.key, f"{c.key} = {c.value} but {ref.key} = {ref.value}"
    named = counters.directory_step_disagrees(
        ctx.ckpt, ref, may_lag=ref is opt and counters.skips_optimizer_steps(ctx.ckpt)
    )
    if named is not None:
        yield named
    if opt is not None and opt is not ref:
        bad = counters.optimizer_step_disagrees(ctx.ckpt, opt, ref)
        if bad is not None:
            yield bad
    yield from counters.scheduler_disagrees(
        ctx.ckpt, ref, epochs, ref_may_lag=ref is opt and counters.skips_optimizer_steps(ctx.ckpt)
    )
    by_item = {e.key.rsplit(".", 1)[0]: e for e in epochs}
    for c in counts:
        e = by_item.get(c.key.rsplit(".", 1)[0])
        # 0: a scheduler whose own step() never goes through LRScheduler.step, which alone counts it (torch's
        # CosineAnnealingWarmRestarts: 0 however many steps it took); the constructor's initial step counts 1
        if e is not None and c.value != 0 and c.value != e.value + 1:
            yield c.key, f"LR scheduler {c.key} = {c.value} but {e.key} = {e.value} (expected last_epoch + 1)"


@rule("R006")
def scheduler_lr_unsaved(ctx: Context) -> Iterator[tuple[str, str]]:
    """A param group whose saved ``lr`` is not the one the saved LR scheduler set in it
    (:func:`~ckpttool.model.counters.scheduler_lr_disagrees`)."""
    try:
        groups = ctx.ckpt.param_groups()
    except CkptError:
        return  # an unreadable group item is the storage checks' finding
    yield from counters.scheduler_lr_disagrees(ctx.ckpt, groups)


@rule("R004")
def scheduler_behind_step(ctx: Context) -> Iterator[tuple[str, str]]:
    if counters.scheduler_per_step(ctx.ckpt) or synthesized_from_stats(ctx):
        return  # R002 compares them
    trains = counters.trainer_steps(ctx.ckpt)
    epochs, _ = counters.scheduler_counters(ctx.ckpt)
    ref = trains[0] if trains else _optimizer_step(ctx)
    for c in epochs:
        if ref is not None and c.value < ref.value:
            yield (
                c.key,
                f"LR scheduler {c.key} = {c.value} but {ref.key} = {ref.value}: a scheduler stepped once per epoch, "
                "or one restored from an older step",
            )


def _no_optimizer_state(ctx: Context, counted: list[counters.Counter]) -> Iterator[tuple[str, str]]:
    """Steps counted but no optimizer state saved (:func:`~ckpttool.model.counters.lost_optimizer_state`)."""
    lost = counters.lost_optimizer_state(ctx.ckpt, counted)
    if lost is not None:
        yield lost


def _common_state_iteration(ctx: Context) -> Iterator[tuple[str, str]]:
    """The iteration of the trainer's common state (Megatron's ``common.pt``) against the step directory it was
    saved in (megatron names the directory ``iter_NNNNNNN`` by the iteration it saves; a resume continues from
    ``common.pt``'s), then the schema's own checks of it (``SchemaSpec.common_state_problems``)."""
    name = ctx.ckpt.common_state_file
    if name is None:
        return
    from ckpttool.model.discovery import step_of

    d = Path(ctx.ckpt.located.model)
    named = step_of(d.name)
    try:
        common = ctx.ckpt.common_state()
    except CkptError:
        return  # named by the rules that read it
    if common is None:
        return
    if named is not None and common.iteration is not None and common.iteration != named:
        yield name, f"{name} iteration = {common.iteration} but its directory is {d.name} (step {named})"
    spec = ctx.cat.schema.spec
    if spec is not None and spec.common_state_problems is not None:
        yield from spec.common_state_problems(common)
