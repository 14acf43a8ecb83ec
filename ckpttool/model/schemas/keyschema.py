"""The key schema of one checkpoint (:class:`KeySchema`: detected or given) and the user's override.

:func:`~ckpttool.model.schemas.detect.detect_schema` builds a :class:`KeySchema`; the catalog
is built through it (which keys are model tensors: :meth:`KeySchema.model_test`,
:meth:`KeySchema.model_mask`). :class:`SchemaOverride` is ``--schema`` / ``--model-prefix`` /
``--optimizer-prefix``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import and_, eq, itemgetter, ne, not_
from typing import Any

from ckpttool.errors import UsageError
from ckpttool.format.jsonview import json_fields
from ckpttool.model.schemas import registry
from ckpttool.model.schemas.base import SchemaSpec, canonical_model_key

__all__ = ["KeySchema", "SchemaOverride", "model_head"]

_BUT_LAST = itemgetter(slice(None, -1))

#: The top-level parts of torch's optimizer state dict (``Optimizer.state_dict()``, ``get_optimizer_state_dict``).
TOP_OPTIMIZER_PARTS = frozenset(("state", "param_groups"))


@dataclass(frozen=True)
class SchemaOverride:
    """A key schema given by the user instead of detection.

    Attributes:
        schema: a registered schema name (:func:`~ckpttool.model.schemas.registry.names`) or ``None``.
        model_prefix: the model keys' prefix (``""``: top level), overriding ``schema``'s.
        optimizer_prefix: the optimizer keys' prefix (``"optimizer."``), overriding ``schema``'s.
        by: the checkpoint format that implies ``schema`` (``"verl-fsdp per-rank files"``); ``""``:
            given on the command line.
    """

    schema: str | None = None
    model_prefix: str | None = None
    optimizer_prefix: str | None = None
    by: str = ""

    @classmethod
    def from_options(
        cls, schema: str | None, model_prefix: str | None, optimizer_prefix: str | None
    ) -> SchemaOverride | None:
        """Build an override from ``--schema/--model-prefix/--optimizer-prefix``; ``None`` when none is given.

        Raises:
            UsageError: an unknown ``schema``, or a non-empty prefix that does not end with ``.``.
        """
        if schema is None and model_prefix is None and optimizer_prefix is None:
            return None
        if schema is not None and schema not in registry.names():
            raise UsageError(
                f"`schema` {schema!r} is not one of {', '.join(registry.names())}",
                param="schema",
                hint="or give the prefixes with `model_prefix` / `optimizer_prefix`",
            )
        for name, v in (("model_prefix", model_prefix), ("optimizer_prefix", optimizer_prefix)):
            if v and not v.endswith("."):
                raise UsageError(
                    f"`{name}` {v!r} must end with '.' (or be empty for keys at the top level)",
                    param=name,
                    hint=f"e.g. `{name}` '{v}.'",
                )
        return cls(schema, model_prefix, optimizer_prefix)


@dataclass(frozen=True)
class KeySchema:
    """Where a checkpoint keeps what (``docs/design.md`` §2).

    Attributes:
        id: ``torch-native``, ``app-state``, ``torchtitan``, ``top-level``, ``custom`` (prefixes
            given by the user) or ``unrecognized`` (neither model tensors nor optimizer state found).
        model_prefix: prefix of the model keys (``""``: top level; ``None``: no model tensors).
        optimizer_prefix: prefix of the optimizer keys (``""``: top level; ``None``: no optimizer state).
        optimizer_keying: ``"fqn"`` (state keyed by parameter name), ``"index"`` (a plain
            ``optimizer.state_dict()``: integer ids) or ``None`` (no optimizer state).
        naming: naming convention of the model fqns: ``"hf"``, ``"torchtitan"`` or ``"unknown"``.
        source: ``"detected"``, ``"override"`` (given on the command line) or ``"format"`` (implied by a
            per-rank checkpoint format).
        reasons: why this schema (one line each, for ``inspect``).
        training_state: top-level training-state items present (``lr_scheduler``, ``train_state``, ...).

    With ``optimizer_prefix ""`` (torch's optimizer state dict saved at the top level: ``dcp.save(
    get_optimizer_state_dict(...))``, alone or merged into the model's state dict) a top-level model does not claim
    its ``state.`` and ``param_groups.`` keys (:meth:`top_optimizer_test`); a model's own parameters named so
    (a submodule called ``state``: ``state.weight``) stay the model's.
    """

    id: str
    model_prefix: str | None
    optimizer_prefix: str | None
    optimizer_keying: str | None = None
    naming: str = "unknown"
    source: str = "detected"
    reasons: tuple[str, ...] = ()
    training_state: tuple[str, ...] = ()
    _model_head: tuple[str, ...] = field(default=(), repr=False, compare=False)
    _use_paths: bool = field(default=True, repr=False, compare=False)
    _group_fqns: frozenset[str] | None = field(default=None, repr=False, compare=False)
    _param_fqns: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @property
    def recognised(self) -> bool:
        """Model tensors or optimizer state were found."""
        return self.model_prefix is not None or self.optimizer_prefix is not None

    @property
    def spec(self) -> SchemaSpec | None:
        """The registered spec of this schema (``None``: ``custom``, ``unrecognized``, or given by prefixes alone):
        what generic code asks about its trainer's behaviour."""
        return registry.find(self.id)

    @property
    def state_prefix(self) -> str | None:
        """``<optimizer prefix>state.`` (``None``: no optimizer)."""
        return None if self.optimizer_prefix is None else f"{self.optimizer_prefix}state."

    @property
    def groups_prefix(self) -> str | None:
        """``<optimizer prefix>param_groups.`` (``None``: no optimizer)."""
        return None if self.optimizer_prefix is None else f"{self.optimizer_prefix}param_groups."

    @property
    def state_root(self) -> str:
        """The prefix the trainer's other items (LR scheduler, step, data loader) are saved under beside the model
        and the optimizer: ``""`` (the top level), or ``"<app>."`` for a schema whose model sits in
        ``{<any app>: {"model": ...}}`` (``app-state``: torch's DCP tutorial saves ``{"app": AppState(...)}``,
        whose ``state_dict()`` holds ``model``, ``optim`` and whatever else the loop adds, e.g. ``scheduler``)."""
        spec = registry.find(self.id)
        p = self.model_prefix
        if spec is None or not p or len(spec.container) < 2 or spec.container[0] is not None:
            return ""
        return p.split(".", 1)[0] + "."

    def fqn_of(self, key: str) -> str:
        """The parameter fqn of a model key (the key without the model prefix)."""
        p = self.model_prefix or ""
        return key[len(p) :] if p and key.startswith(p) else key

    def model_key(self, fqn: str) -> str:
        """The checkpoint key of parameter ``fqn``."""
        return f"{self.model_prefix or ''}{fqn}"

    def canonical_key(self, key: str) -> str:
        """The torch-native spelling ``model.<fqn>`` of a model key (what export rules match)."""
        return canonical_model_key(self.fqn_of(key))

    def is_model_candidate(self, key: str, path: tuple[Any, ...] | None) -> bool:
        """Whether tensor ``key`` (planner path ``path``) is a model tensor under this schema."""
        return self.model_test()(key, path)

    def model_test(self) -> Callable[[str, tuple[Any, ...] | None], bool]:
        """:meth:`is_model_candidate` as a function specialised for this schema (10^6 calls per catalog)."""
        p, op = self.model_prefix, self.optimizer_prefix or None
        if p is None:
            return lambda key, path: False
        if p == "":
            return self._top_level_test()
        n, head, np_ = len(self._model_head), self._model_head, len(p)
        if self._use_paths and head:
            return lambda key, path: (
                key.startswith(p)
                and len(key) > np_
                and (path is None or (len(path) == n + 1 and path[:n] == head))
                and not (op is not None and key.startswith(op))
            )
        return lambda key, path: key.startswith(p) and len(key) > np_ and not (op is not None and key.startswith(op))

    def _top_level_test(self) -> Callable[[str, tuple[Any, ...] | None], bool]:
        """:meth:`model_test` of a model at the top level: a tensor whose planner path is its key alone, or (no
        planner_data) whose first component names no training-state item or optimizer; neither a training-state
        item's own name (``step``, ``rng_state``) nor the optimizer's keys."""
        op = self.optimizer_prefix or None
        if self.optimizer_prefix == "":  # torch's optimizer state dict at the top level too: not model keys
            inner = replace(self, optimizer_prefix=None)._top_level_test()
            optimizer = self.top_optimizer_test()
            return lambda key, path: not optimizer(key, path) and inner(key, path)
        known = registry.derived()
        # a parameter the optimizer names (param_groups.step.lr, state.step.exp_avg) is the model's whatever its
        # name: a model's own parameter called `step` or `epoch` is no training counter
        params = self._param_fqns
        items, heads = known.training_state_items.difference(params), known.optimizer_heads

        def loose(key: str) -> bool:
            head = key.partition(".")[0]
            return (head not in items or key in params) and head not in heads and key != "layout"

        if self._use_paths:
            return lambda key, path: (
                (len(path) == 1 and key not in items if path is not None else loose(key))
                and not (op is not None and key.startswith(op))
            )
        return lambda key, path: loose(key) and not (op is not None and key.startswith(op))

    def top_optimizer_test(self) -> Callable[[str, tuple[Any, ...] | None], bool]:
        """Whether a key (planner path) is the optimizer's, torch's optimizer state dict being at the top level.

        A ``state.`` or ``param_groups.`` key is the optimizer's where its planner path nests it there (``("state",
        fqn, field)``: ``get_optimizer_state_dict``'s default) or, flattened (``flatten_optimizer_state_dict=True``:
        one path part), where its parameter is one the flattened param groups name (``param_groups.<fqn>.lr``); a
        model's parameter ``state.weight`` (a submodule called ``state``) is neither. Without planner_data or
        flattened groups to tell (``_group_fqns`` ``None``) every such key is the optimizer's."""
        fqns = self._group_fqns

        def test(key: str, path: tuple[Any, ...] | None) -> bool:
            part, _, rest = key.partition(".")
            if part not in TOP_OPTIMIZER_PARTS:
                return False
            if path is not None and len(path) > 1:
                return bool(path[0] == part)
            return fqns is None or rest.rpartition(".")[0] in fqns

        return test

    def model_mask(self, keys: Mapping[str, Any], paths: Mapping[str, tuple[Any, ...]]) -> Iterator[bool]:
        """``map(self.model_test(), keys, map(paths.get, keys))``, column-wise in C for prefixed model keys.

        Args:
            keys: the keys (iterated in order; ``in`` answered in O(1), e.g. ``md.entries``).
            paths: key -> planner path (:func:`planner_paths`).
        """
        p, op = self.model_prefix, self.optimizer_prefix or None
        if not p:  # top level (or no model): the per-key test
            return map(self.model_test(), keys, map(paths.get, keys))
        mask: Iterator[bool] = map(str.startswith, keys, repeat(p))
        if p in keys:  # len(key) > len(p): only p itself starts with p and is not longer
            mask = map(and_, mask, map(ne, keys, repeat(p)))
        head = self._model_head
        if self._use_paths and head:
            # path is None or (len(path) == n + 1 and path[:n] == head): path[:-1] == head for n >= 1,
            # with a path that passes standing in for a missing one
            passes = (*head, None)
            mask = map(and_, mask, map(eq, map(_BUT_LAST, map(paths.get, keys, repeat(passes))), repeat(head)))
        if op is not None and (p.startswith(op) or op.startswith(p)):  # else no key starts with both
            mask = map(and_, mask, map(not_, map(str.startswith, keys, repeat(op))))
        return mask

    def to_dict(self) -> dict[str, Any]:
        """JSON view (``inspect --json`` ``schema``)."""
        return json_fields(self)


def model_head(prefix: str) -> tuple[str, ...]:
    """The planner-path head of a model prefix: ``"app.model."`` -> ``("app", "model")``, ``""`` -> ``()``."""
    return tuple(prefix[:-1].split(".")) if prefix else ()
