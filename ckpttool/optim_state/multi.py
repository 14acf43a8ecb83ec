"""``MultiOptimizer``: named leaf optimizers over one model, saved as one flattened state dict.

Keys (the flattened flavor of ``torch.distributed.checkpoint.state_dict``, below the
trainer's ``optimizer.`` prefix): ``state.<param_fqn>.<field>`` and
``param_groups.<param_fqn>.<hyper>``; leaf names are not part of them. It does not call
``get/set_optimizer_state_dict`` for a leaf without state, because their
``_init_optim_state`` fakes a step (creating ``step`` 1 and zero moments on save, ``{}``
fields on load); such a leaf saves only its hyperparameters, and loading unflattens per leaf
and calls the leaf's own ``load_state_dict`` (dtype and shape checks). Why and how:
``docs/optim_state.md``, "MultiOptimizer".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ckpttool.errors import OptimStateError, UsageError
from ckpttool.optim_state.adamw import MasterAdamWBase
from ckpttool.optim_state.checkpoint import check_saved_state, iter_state_entries

__all__ = ["MultiOptimizer"]

logger = logging.getLogger(__name__)


def _model_fqns(model: nn.Module) -> dict[torch.Tensor, str]:
    """Parameter -> FQN as ``torch.distributed.checkpoint.state_dict`` names it."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[torch.Tensor, str] = {}
    for name, param in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:
            raise UsageError(f"parameter {name} maps to {len(fqns)} FQNs", hint="untie or unwrap the parameter")
        out[param] = next(iter(fqns))
    return out


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(len(s) > 0 for s in optimizer.state.values())


class MultiOptimizer:
    """Named leaf optimizers (e.g. ``dense`` and ``experts``) over one model.

    ``step``/``zero_grad`` go to every leaf; attach LR schedulers to the leaves
    (``multi["experts"]``). ``state_dict``/``load_state_dict`` use one flattened dict for all
    leaves (see the module docstring); pass ``multi.state_dict()`` to ``dcp.save`` under
    the ``optimizer`` key and build the ``dcp.load`` target with :meth:`state_dict_template`.

    Args:
        model: the module whose ``named_parameters()`` name the leaves' parameters (the
            FSDP2-wrapped model when sharded).
        optimizers: ``{leaf name: optimizer}``; each parameter in at most one leaf, every
            leaf parameter a parameter of ``model``.

    Raises:
        UsageError: no leaves, a parameter shared by two leaves, or one not in ``model``.
    """

    def __init__(self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise UsageError(
                "MultiOptimizer needs at least one leaf optimizer", hint='e.g. {"dense": ..., "experts": ...}'
            )
        self.model = model
        self.optimizers: dict[str, torch.optim.Optimizer] = dict(optimizers)
        self._fqn = _model_fqns(model)
        owner: dict[torch.Tensor, str] = {}
        for name, opt in self.optimizers.items():
            for group in opt.param_groups:
                for p in group["params"]:
                    if p not in self._fqn:
                        raise UsageError(f"leaf {name!r} holds a parameter that is not a parameter of the model")
                    if p in owner:
                        raise UsageError(
                            f"parameter {self._fqn[p]} is in leaves {owner[p]!r} and {name!r}",
                            hint="give each parameter to exactly one leaf",
                        )
                    owner[p] = name

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All leaves' param groups, leaf by leaf (the group dicts themselves)."""
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure`` once (if given), then step every leaf. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` on every leaf."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ save
    def state_dict(self) -> dict[str, Any]:
        """The flattened state dict of all leaves; never steps and never creates state.

        Returns:
            ``{"state.<fqn>.<field>": Tensor, "param_groups.<fqn>.<hyper>": value}``; a leaf
            without state contributes its hyperparameters only.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        out: dict[str, Any] = {}
        for name, opt in self.optimizers.items():
            if _has_state(opt):
                sd = get_optimizer_state_dict(
                    self.model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
                )
            else:
                logger.debug("leaf %s has no state: saving its hyperparameters only", name)
                sd = self._hyper_only(opt)
            clash = out.keys() & sd.keys()
            if clash:
                raise OptimStateError(f"leaf {name!r} repeats key(s) {sorted(clash)[:3]}")
            out.update(sd)
        return out

    def _hyper_only(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for group in opt.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                for k, v in hyper.items():
                    out[f"param_groups.{self._fqn[p]}.{k}"] = v
        return out

    # ------------------------------------------------------------------ load
    def state_dict_template(
        self, saved: Mapping[str, Any] | Iterable[str] | None = None, *, prefix: str = ""
    ) -> dict[str, Any]:
        """A ``dcp.load`` target for :meth:`load_state_dict`, built without stepping.

        Args:
            saved: the checkpoint's keys (an iterable of flattened keys) or its
                ``Metadata.state_dict_metadata`` (key -> storage metadata). State templates
                are made only for parameters with saved state; with metadata, saved dtypes
                and shapes are checked against the configuration first. ``None`` makes
                state templates for every trainable parameter.
            prefix: the optimizer's key prefix in ``saved`` (``"optimizer."`` for the
                trainer schema). Default ``""``.

        Returns:
            ``{"state.<fqn>.<field>": Tensor with the configured dtype and placement,
            "param_groups.<fqn>.<hyper>": current value}``.

        Raises:
            OptimStateError: saved fields of a parameter differ from the configured ones, or
                a saved dtype/shape differs (metadata given).
            UsageError: a leaf type for which no state template can be made.
        """
        keys: set[str] | None = None
        if saved is not None:
            keys = {k[len(prefix) :] for k in saved if k.startswith(prefix)}
        saved_fields: dict[str, set[str]] = {}
        if keys is not None:
            fqns = set(self._fqn.values())
            for key in keys:
                if key.startswith("state."):
                    fqn, _, field = key[len("state.") :].rpartition(".")
                    if fqn in fqns:
                        saved_fields.setdefault(fqn, set()).add(field)
        out: dict[str, Any] = {}
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    fqn = self._fqn[p]
                    for k, v in group.items():
                        if k == "params":
                            continue
                        key = f"param_groups.{fqn}.{k}"
                        if keys is None or key in keys:
                            out[key] = v
                    if not p.requires_grad:
                        continue
                    if keys is not None and fqn not in saved_fields:
                        continue  # never stepped when saved: load no state
                    template = _state_template(opt, group, p)
                    if keys is not None:
                        _check_saved_fields(opt, fqn, saved_fields[fqn], template)
                    for field, value in template.items():
                        out[f"state.{fqn}.{field}"] = value
        if isinstance(saved, Mapping):
            check_saved_state(saved, out, prefix=prefix)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore every leaf from a flattened state dict (as :meth:`state_dict` writes it).

        Hyperparameters come from ``param_groups.<fqn>.<hyper>`` (all parameters of a
        group must agree); a parameter without ``state.<fqn>.*`` keys gets no state.
        ``param_names`` absent from the checkpoint keeps its current value.

        Args:
            state_dict: the flattened state dict, e.g. the template after ``dcp.load``.

        Raises:
            OptimStateError: a hyperparameter missing or disagreeing within a group, keys
                for parameters no leaf holds, or a leaf's own dtype/shape checks.
        """
        consumed: set[str] = set()
        by_fqn: dict[str, dict[str, Any]] = {}
        for key, fqn, field, value in iter_state_entries(state_dict):
            by_fqn.setdefault(fqn, {})[field] = value
            consumed.add(key)
        for name, opt in self.optimizers.items():
            groups: list[dict[str, Any]] = []
            state: dict[str, dict[str, Any]] = {}
            for i, group in enumerate(opt.param_groups):
                fqns = [self._fqn[p] for p in group["params"]]
                saved_group: dict[str, Any] = {"params": fqns}
                for k in group:
                    if k == "params":
                        continue
                    values = []
                    for fqn in fqns:
                        key = f"param_groups.{fqn}.{k}"
                        if key in state_dict:
                            values.append(state_dict[key])
                            consumed.add(key)
                    if not values:
                        if k == "param_names":
                            continue
                        raise OptimStateError(
                            f"leaf {name!r} group {i}: hyperparameter {k!r} missing from the state dict "
                            f"(no param_groups.<fqn>.{k} for {fqns[0] if fqns else '<no params>'})",
                            fqn=fqns[0] if fqns else None,
                        )
                    if len(values) != len(fqns) or any(v != values[0] for v in values[1:]):
                        raise OptimStateError(
                            f"leaf {name!r} group {i}: parameters disagree on {k!r} ({values[:3]}...)",
                            hint="every parameter of a param group must carry the same hyperparameters",
                        )
                    saved_group[k] = values[0]
                groups.append(saved_group)
                for fqn in fqns:
                    if fqn in by_fqn:
                        state[fqn] = by_fqn.pop(fqn)
            opt.load_state_dict({"state": state, "param_groups": groups})
        leftover = sorted(set(state_dict) - consumed) + sorted(f"state.{f}.*" for f in by_fqn)
        if leftover:
            raise OptimStateError(
                f"state dict has {len(leftover)} key(s) no leaf uses, e.g. {', '.join(leftover[:3])}",
                hint="the checkpoint was saved with other parameters or leaves",
            )


def _check_saved_fields(opt: torch.optim.Optimizer, fqn: str, saved: set[str], template: Mapping[str, Any]) -> None:
    """Refuse a leaf whose state fields for ``fqn`` are not the ones the checkpoint saved.

    Raises:
        OptimStateError: another set of fields (the checkpoint was saved by another optimizer type).
    """
    if saved != set(template):
        raise OptimStateError(
            f"optimizer state of {fqn} was saved with field(s) {', '.join(sorted(saved))}; "
            f"the {type(opt).__name__} leaf expects {', '.join(template)}",
            fqn=fqn,
            hint="build the leaf with the optimizer type that saved the checkpoint",
        )


def _state_template(
    opt: torch.optim.Optimizer, group: Mapping[str, Any], param: torch.Tensor
) -> dict[str, torch.Tensor]:
    if isinstance(opt, MasterAdamWBase):
        return opt.state_template(param)
    if type(opt) in (torch.optim.AdamW, torch.optim.Adam):
        on_device = bool(group.get("fused") or group.get("capturable"))
        step_device = param.device if on_device else torch.device("cpu")
        out = {
            "step": torch.zeros((), dtype=torch.float32, device=step_device),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group.get("amsgrad"):
            out["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return out
    raise UsageError(
        f"no state template for a {type(opt).__name__} leaf",
        hint="use a ckpttool optimizer or torch.optim.AdamW for MultiOptimizer leaves",
    )
