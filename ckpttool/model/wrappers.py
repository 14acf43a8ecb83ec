"""Wrapper segments: module names that wrappers insert into state-dict keys without being part of the model.

``torch.compile`` (``_orig_mod.``), activation checkpointing
(``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``: ``_checkpoint_wrapped_module.``),
FSDP1 (``_fsdp_wrapped_module.``) and ``DistributedDataParallel`` / ``DataParallel``
(``module.``) each add a path segment, anywhere in the key (a compiled block inside a
checkpointed layer gives ``layers.0._checkpoint_wrapped_module._orig_mod.mlp...``).
Hugging Face and PEFT name modules without them, so an export removes every such
segment (torch's own ``consume_prefix_in_state_dict_if_present`` handles a leading
``module.`` only). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["WRAPPER_SEGMENTS", "pair_wrapped", "strip_wrapper_segments", "wrapper_segments_of"]

#: Key segments inserted by wrappers (whole dotted components).
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")


def strip_wrapper_segments(key: str, segments: tuple[str, ...] = WRAPPER_SEGMENTS) -> tuple[str, tuple[str, ...]]:
    """``key`` without wrapper ``segments``, and the segments removed (in order).

    The last component (the tensor's own name, e.g. a parameter called ``module``) is never
    removed. Example: ``model.layers.0._checkpoint_wrapped_module.mlp.weight`` ->
    ``(model.layers.0.mlp.weight, ("_checkpoint_wrapped_module",))``.
    """
    if "module" not in key and "_orig_mod" not in key:  # no segment can be a component (10^6 keys: one C scan each)
        return key, ()
    parts = key.split(".")
    kept = [p for p in parts[:-1] if p not in segments]
    if len(kept) == len(parts) - 1:
        return key, ()
    removed = tuple(p for p in parts[:-1] if p in segments)
    return ".".join([*kept, parts[-1]]), removed


def wrapper_segments_of(state_fqns: Iterable[str], model_fqns: Iterable[str] = ()) -> tuple[str, ...]:
    """The :data:`WRAPPER_SEGMENTS` that are wrappers in a checkpoint whose optimizer state names its parameters
    ``state_fqns`` and whose model tensors are ``model_fqns``: without ``module`` where one of them holds it as a
    component that is not a wrapper of the whole model: inside an optimizer fqn or leading some of them but not
    all, or inside a model fqn after the wrapper segments it starts with. torch's ``get_optimizer_state_dict`` names
    a parameter without DDP's ``module.`` (and ``_orig_mod.``, ...), and ``DataParallel``'s leads every fqn; so such
    a ``module`` is a submodule the model names so (``self.module = nn.Linear(...)``; ``self.enc.module``, frozen,
    which the optimizer names nothing of), which export and diff keep."""
    leading = every = 0
    for fqn in state_fqns:
        every += 1
        if "module" not in fqn:
            continue
        parts = fqn.split(".")[:-1]
        if "module" in parts[1:]:
            return _WITHOUT_MODULE
        leading += bool(parts) and parts[0] == "module"
    if 0 < leading < every:
        return _WITHOUT_MODULE
    for fqn in model_fqns:
        if "module" not in fqn:
            continue
        parts = fqn.split(".")[:-1]
        n = 0
        while n < len(parts) and parts[n] in WRAPPER_SEGMENTS:
            n += 1
        if "module" in parts[n:]:
            return _WITHOUT_MODULE
    return WRAPPER_SEGMENTS


_WITHOUT_MODULE = tuple(s for s in WRAPPER_SEGMENTS if s != "module")


def _only_wrappers_between(stored: str, fqn: str) -> bool:
    """``fqn`` is ``stored`` with some of its wrapper segments left out (the last component kept): a real
    component named ``module`` that ``fqn`` keeps is matched, not dropped."""
    have, want = stored.split("."), fqn.split(".")
    if have[-1] != want[-1]:
        return False
    i = 0
    for part in have[:-1]:
        if i < len(want) - 1 and part == want[i]:
            i += 1
        elif part not in WRAPPER_SEGMENTS:
            return False
    return i == len(want) - 1


def pair_wrapped(model_fqns: Iterable[str], orphans: Iterable[str]) -> dict[str, str]:
    """The model fqn each of ``orphans`` (optimizer fqns that name no model tensor) is stored as, where the
    model's name holds wrapper segments the optimizer's leaves out.

    torch's ``get_optimizer_state_dict`` names parameters by their clean fqn (``_get_fqns`` in
    ``torch/distributed/checkpoint/state_dict.py`` drops ``_orig_mod``, ``_checkpoint_wrapped_module``,
    ``_fsdp_wrapped_module`` and ``module``), while a model whose blocks were compiled or wrapped in place
    saves ``model.state_dict()`` as ``layers.0._orig_mod.attn.q.weight``. An orphan is paired with the one
    model fqn that equals it once only wrapper segments are left out of the model's name; none or several:
    not paired. A segment the optimizer's fqn keeps is a real submodule, never dropped. O(n).
    """
    wanted: dict[str, str | None] = {}
    for f in orphans:
        clean = strip_wrapper_segments(f)[0]
        wanted[clean] = None if clean in wanted else f  # two orphans of one clean name: ambiguous
    if not wanted:
        return {}
    found: dict[str, str | None] = {}
    for stored in model_fqns:
        clean, removed = strip_wrapper_segments(stored)
        if removed and clean in wanted:
            found[clean] = None if clean in found else stored  # two model tensors of one name: ambiguous
    pairs: dict[str, str] = {}
    for clean, model_fqn in found.items():
        fqn = wanted[clean]
        if model_fqn is not None and fqn is not None and _only_wrappers_between(model_fqn, fqn):
            pairs[fqn] = model_fqn
    return pairs
