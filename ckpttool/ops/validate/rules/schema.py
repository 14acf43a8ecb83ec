"""Key-schema rules (``K``): did ckpttool understand what the checkpoint holds?

Built on the catalog's key schema (:mod:`ckpttool.model.schemas`). A checkpoint in which
nothing is recognised as model or optimizer state never passes, and tensors outside every
known category fail ``--strict``: validation fails closed on what it did not understand.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ckpttool.format.unpickler import short_repr
from ckpttool.model.beside import read_training_state_beside, trainer_state_missing
from ckpttool.model.catalog import per_parameter_item
from ckpttool.model.discovery import unpublished
from ckpttool.model.nested_state import describe_nested, nested_state_items
from ckpttool.model.schemas.detect import planner_paths
from ckpttool.ops.validate.base import RuleSkipped, rule
from ckpttool.ops.validate.context import Context

#: Why a rule that reads files beside the checkpoint did not run on a URL.
_REMOTE = "a remote checkpoint: the files beside it are not fetched"


def _examples(keys: list[str], n: int = 3) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


@rule("K001")
def nothing_recognised(ctx: Context) -> Iterator[tuple[str | None, str]]:
    cat = ctx.cat
    if cat.model or cat.optimizer_state or cat.param_groups or nested_state_items(ctx.reader.metadata):
        return  # nested state in byte items: K010
    keys = list(ctx.reader.metadata.entries)
    yield None, f"{cat.path}: no model tensor and no optimizer state among {len(keys)} key(s): {_examples(keys)}"


@rule("K002")
def uncategorized_tensors(ctx: Context) -> Iterator[tuple[str, str] | tuple[str, str, str]]:
    if not (ctx.cat.model or ctx.cat.optimizer_state):
        return  # K001
    odd = ctx.cat.uncategorized_tensors()
    if odd:
        message = f"{len(odd)} tensor(s) outside the {ctx.cat.schema.id} key schema: {_examples(odd)}"
        per_param = ctx.cat.per_parameter_optimizer_state()
        if per_param:
            yield odd[0], f"{message}; {len(per_param)} of them are {PER_PARAMETER_OPTIMIZERS}", PER_PARAMETER_HINT
        else:
            yield odd[0], message


#: K002's words for the state of one optimizer per parameter (torchtune's ``optimizer_in_bwd``)
PER_PARAMETER_OPTIMIZERS = (
    "the state of one optimizer per parameter (<fqn>.state.<i>.<field>, as torchtune's OptimizerInBackwardWrapper saves "
    "with optimizer_in_bwd) in a layout ckpttool does not read (it reads torchtune's own, state.0 of one parameter per "
    "optimizer): the optimizer state was not checked"
)
PER_PARAMETER_HINT = (
    "check the optimizer state with the trainer's own resume; to check it here, save with one optimizer "
    "(torchtune: optimizer_in_bwd False)"
)


@rule("K003")
def optimizer_state_by_index(ctx: Context) -> Iterator[tuple[str, str]]:
    sch = ctx.cat.schema
    if sch.optimizer_keying == "index":
        n = len(ctx.cat.optimizer_state)
        yield (
            f"{sch.optimizer_prefix}state",
            f"{sch.optimizer_prefix}state.<i>.*: state of {n} parameter(s) keyed by integer index "
            f"(e.g. {next(iter(ctx.cat.optimizer_state), '?')!r}), not by fqn",
        )


@rule("K004")
def optimizer_without_model(ctx: Context) -> Iterator[tuple[str, str]]:
    cat = ctx.cat
    if not cat.model and cat.optimizer_state and cat.schema.optimizer_keying != "index":
        yield (
            str(cat.schema.state_prefix),
            f"{cat.path}: optimizer state for {len(cat.optimizer_state)} parameter(s) and no model tensors",
        )


@rule("K005")
def state_of_split_parameter(ctx: Context) -> Iterator[tuple[str, str]]:
    split = [(f, ps) for f, ps in ctx.cat.optimizer_state.items() if ps.stored_as]
    if split:
        f, ps = split[0]
        yield f, f"{len(split)} parameter(s) stepped fused, stored split (e.g. {f} as {', '.join(ps.stored_as)})"


def _leads_to(key: str, path: object) -> bool:
    """Whether a prefix of ``path`` (a tuple) joins to ``key`` with ``.``: a custom planner may append its own
    data to torch's path (the corpus' ``planner_data_torch_objects``), a damaged one joins to nothing."""
    if not isinstance(path, tuple):
        return False
    joined = ""
    for i, part in enumerate(path):
        if not isinstance(part, (str, int)):
            return False
        joined = f"{joined}.{part}" if i else str(part)
        if len(joined) >= len(key):
            return joined == key
    return False


@rule("K006")
def planner_path_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    md = ctx.reader.metadata
    kept = planner_paths(md)
    if len(kept) == len(md.planner_data):
        return
    bad = [k for k, v in md.planner_data.items() if k not in kept and not _leads_to(k, v)]
    if bad:
        k = bad[0]
        more = f" (+{len(bad) - 1} more: {_examples(bad[1:])})" if len(bad) > 1 else ""
        yield k, f"{len(bad)} planner_data path(s) lead to no key: {k!r} has {short_repr(md.planner_data[k])}{more}"


@rule("K007")
def per_parameter_optimizers_resume(ctx: Context) -> Iterator[tuple[str, str]]:
    item = per_parameter_item(ctx.cat.schema)
    spec = ctx.cat.schema.spec
    note = spec.per_parameter_resume if spec is not None else ""
    if not (item and note and ctx.cat.optimizer_state):
        return
    n = len(ctx.cat.optimizer_state)
    yield f"{item}*", f"the optimizer state of {n} parameter(s), one optimizer each ({item}<fqn>.state.0.*): {note}"


@rule("K010")
def nested_state_in_byte_items(ctx: Context) -> Iterator[tuple[str | None, str]]:
    md = ctx.reader.metadata
    keys = nested_state_items(md)
    if keys:
        yield keys[0], f"{ctx.cat.path}: {describe_nested(md, keys)}"


@rule("K011")
def training_state_beside_checkpoint(ctx: Context) -> Iterator[tuple[str | None, str]]:
    model = ctx.ckpt.local_folder
    if model is None:
        raise RuleSkipped(_REMOTE)
    spec = ctx.cat.schema.spec
    restores = spec is not None and spec.restores_trainer_state_beside  # OLMo-core's train/rankR.pt
    if restores and (missing := trainer_state_missing(model)) is not None:
        yield None, missing
    step = model.parent
    if spec is not None and spec.publish_note and (why := unpublished(step)) is not None:
        yield (  # OLMo-core's model_and_optim/ opened directly (the step directory or `--step N` is E202)
            None,
            f"{step}: holds {why}: a save not yet published ({spec.publish_note}): {model.name}/ was "
            "read, the save may still be running or was interrupted",
        )
    bad = [s for s in read_training_state_beside(model) if s.error is not None]
    if bad:
        yield (
            None,
            f"{model.parent}: {len(bad)} training-state file(s) beside {model.name}/ not read: "
            + "; ".join(f"{s.file}: {s.error}" for s in bad[:3]),
        )


@rule("K012")
def training_state_not_read(ctx: Context) -> Iterator[tuple[str | None, str] | tuple[str | None, str, str]]:
    located = ctx.ckpt.located
    unread = ctx.ckpt.unread_beside()
    if unread:
        shown = ", ".join(unread[:6]) + (f" (+{len(unread) - 6} more)" if len(unread) > 6 else "")
        from ckpttool.model.beside import unpaired_optimizer

        model = Path(located.model)
        opt = unpaired_optimizer(model, Path(located.given)) if located.optimizer is None else None
        both = (
            f"; {opt} is the optimizer folder of {model.name}/: open {model.parent} to read them together"
            if opt is not None and opt in unread
            else ""
        )
        message = f"{located.given}: training state beside {model.name}/ that ckpttool does not read: {shown}{both}"
        if ctx.cat.optimizer_state:  # read and checked here: the rule's hint to bring it to DCP does not apply
            yield None, message, _READ_OPTIMIZER_HINT
        else:
            yield None, message


#: K012's hint where the opened checkpoint holds optimizer state (Accelerate's ``save_state``: ``optimizer_0/`` read,
#: ``scheduler.bin`` and ``random_states_R.pkl`` beside it not).
_READ_OPTIMIZER_HINT = (
    "check those files with the trainer's own loader (the model and the optimizer state saved here were checked)"
)


@rule("K013")
def megatron_config(ctx: Context) -> Iterator[tuple[str | None, str]]:
    spec = ctx.cat.schema.spec  # Megatron's metadata.json
    if spec is None or spec.config_problem is None:
        return
    from ckpttool.errors import CkptError

    d = ctx.ckpt.local_folder
    if d is None:
        raise RuleSkipped(_REMOTE)
    try:
        problem = spec.config_problem(d)
    except CkptError as e:
        problem = e.message
    if problem is not None:
        yield spec.config_file, f"{d / spec.config_file}: {problem}"


@rule("K014")
def megatron_common_missing(ctx: Context) -> Iterator[tuple[str | None, str]]:
    spec = ctx.cat.schema.spec  # Megatron's common.pt
    if spec is None or spec.common_state_file is None or not spec.common_state_required:
        return
    d = ctx.ckpt.local_folder
    if d is None:  # a URL: the prefix's listing says whether the object is there (the catalog reads it from there)
        reader = ctx.ckpt.reader
        if reader.remote is None or str(ctx.ckpt.located.model) != str(reader.path):
            raise RuleSkipped(_REMOTE)
        if reader.remote.size(spec.common_state_file) is None:
            yield (
                spec.common_state_file,
                f"{reader.path / spec.common_state_file}: missing; {spec.common_state_required}",
            )
        return
    if not os.path.lexists(d / spec.common_state_file):
        yield spec.common_state_file, f"{d / spec.common_state_file}: missing; {spec.common_state_required}"
