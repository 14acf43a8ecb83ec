"""``replay_step``: replay the next optimizer step(s) from a checkpoint and compare with a reference.

Per memory batch (``plan.make_batches``): read parameters and saved state in true expert
order; build ckpttool's optimizer (``ckpttool.optim_state.build_optimizer``, the record's
``fused`` choice) and load the saved state through its own ``load_state_dict``; run K timed
``optimizer.step()`` calls with gradients from ``grads.py``; then, slab by slab
(:data:`REFERENCE_SLAB`), re-read the saved values, check ``param == master_weight.to(dtype)``
bitwise, run the FP64 reference (:func:`ckpttool.optim_state.reference.reference_adamw_step`)
and compare (``compare.py``). No full-size copy of the pre-step state or of the reference is
made; the checkpoint is only read. ``docs/replay.md``, "What it does", "Memory".
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ckpttool.engine.pool import map_ordered
from ckpttool.errors import (
    CkptError,
    DeviceUnavailableError,
    HyperparameterError,
    StateDtypeError,
    UsageError,
    at_least,
    shell_arg,
)
from ckpttool.format.atomic import signals_held
from ckpttool.format.jsonview import json_fields, json_number
from ckpttool.format.metadata import TensorMeta
from ckpttool.model.catalog import Catalog, leaf_key
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, OpenOptions, open_source
from ckpttool.model.counters import (
    Counter,
    directory_step_disagrees,
    lost_optimizer_state,
    optimizer_step_disagrees,
    record_steps,
    scheduler_counters,
    scheduler_disagrees,
    scheduler_lr_disagrees,
    several_optimizer_steps,
    skips_optimizer_steps,
    synthesized_state_lost,
    trainer_steps,
)
from ckpttool.ops.fields import PhaseFn, ProgressFn, options_of, same_named
from ckpttool.ops.replay.compare import (
    FieldError,
    compare_field,
    count_unequal,
    count_unequal_nan_equal,
    effective_rtol,
    machine_eps,
    merge_field_errors,
)
from ckpttool.ops.replay.plan import ITEMSIZE, Hyper, ParamPlan, make_batches, plan_replay, split_qkv
from ckpttool.ops.replay.slabs import StackedSlabs, TensorSlabs
from ckpttool.ops.state_checks import MOMENTS, exp_avg_lost, step_not_count, synthesized_params
from ckpttool.ops.tensors import to_canonical
from ckpttool.optim_state.bounds import (
    FP16_SUBNORMAL,
    adam_ratio_bound,
    beta1_span,
    fp16_step_factor,
    fp16_underflow_margin,
)

# the public names are re-exported (and listed in ``__all__``) by ``ckpttool.ops.replay``

logger = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
_REF_DTYPES = ("float64", "float32")
#: ``--reference``: the formula reference alone, or also ``torch.optim.AdamW`` with the saved flags (bitwise).
REFERENCES = ("formula", "torch")
#: Saved param-group switches of ``torch.optim.AdamW`` that select its implementation or arithmetic.
#: The saved switches that choose torch.optim.AdamW's arithmetic (``differentiable``: the capturable form's bias
#: corrections and step size as tensors), kept in the replay's own group.
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")
TORCH_FLAGS = ("fused", "foreach", "capturable", "maximize", "amsgrad")


#: ``R003``: a step that moves a tensor by more than this fraction of its largest saved magnitude.
UPDATE_REL_BOUND = 1.0
#: ``R003``: a tensor within reach of its saved updates from zero has no scale of its own (``rel_to_param`` 0) when
#: its largest value is at least this fraction of ``lr`` (Adam's first step moves each element by about ``lr``).
UPDATE_ZERO_INIT_FLOOR = 0.1
#: ``R003``: slack on the Adam direction bound (moments stored in BF16/FP32 round; the bound is rarely approached).
UPDATE_BOUND_SLACK = 1.1


@dataclass(frozen=True)
class UpdateSize:
    """How large the replayed update is (from the reference, over the whole tensor).

    Attributes:
        max_update: ``max |theta_after - theta_before|`` over the K steps.
        max_param: ``max |theta_before|`` (saved master, else parameter).
        rel_to_param: ``max_update / max_param`` (0 when the tensor has no scale to compare with: ``max_param``
            is 0, or between ``UPDATE_ZERO_INIT_FLOOR * lr`` and ``step_before * lr * direction_bound *
            UPDATE_BOUND_SLACK``, the distance its saved steps can have moved it from zero, as a zero-initialised
            bias early in training; with FP16 moments times :func:`~ckpttool.optim_state.bounds.fp16_step_factor`).
        direction: ``max |m_hat| / (sqrt(v_hat) + eps)`` of the last step (the update in units of lr); with FP16
            moments ``v`` takes :func:`~ckpttool.optim_state.bounds.fp16_underflow_margin` (what underflow took).
        direction_bound: :func:`~ckpttool.optim_state.bounds.adam_ratio_bound` at that step.
    """

    max_update: float
    max_param: float
    rel_to_param: float
    direction: float
    direction_bound: float

    @property
    def ok(self) -> bool:
        return self.rel_to_param <= UPDATE_REL_BOUND and self.direction <= self.direction_bound * UPDATE_BOUND_SLACK

    def to_dict(self) -> dict[str, Any]:
        """The fields (a non-finite one as ``"inf"`` / ``"nan"``: ``direction_bound`` is ``inf`` where no finite
        bound exists, e.g. ``beta1^2 > beta2`` late in a run) and ``ok``."""
        return {**{k: json_number(v) for k, v in json_fields(self).items()}, "ok": self.ok}


@dataclass
class ParamResult:
    """Replay outcome of one parameter.

    Attributes:
        fqn, shape, dtype, numel: the parameter (stored dtype name).
        optimizer_type: the optimizer that replayed it; group_id, lr, weight_decay: its group.
        state: ``"loaded"`` or ``"fresh"`` (never-stepped leaf).
        offloaded: master and moments kept on the CPU (``cpu_offload_adamw``).
        step_before, step_after, expected_step: saved ``step``, after the replay, saved + K.
        fields: ``master_weight`` / ``exp_avg`` / ``exp_avg_sq`` / ``param`` -> :class:`FieldError`.
        param_vs_reference_unequal: elements where the parameter differs from
            ``reference_master.to(param dtype)`` (bitwise; FP32-master types only).
        writeback_unequal: elements where the parameter differs from the optimizer's own
            ``master_weight.to(param dtype)`` (must be 0; FP32-master types only).
        sync_unequal: before the step, elements where the saved parameter differs from the
            saved ``master_weight.to(param dtype)`` (must be 0).
        placement: tensor -> device string after the step.
        problems: one line per failed check (empty: the parameter passed).
        update: the size of the reference's update (:class:`UpdateSize`); beyond its bounds it
            is a problem (``R003``) even when the optimizer agrees with the reference.
        torch_unequal: with ``reference="torch"``: elements of ``param``, ``exp_avg``,
            ``exp_avg_sq`` (and ``step``) that differ bitwise from ``torch.optim.AdamW`` with the
            saved flags (``None``: not compared).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    optimizer_type: str
    group_id: int | str
    lr: float
    weight_decay: float
    state: Literal["loaded", "fresh"]
    offloaded: bool
    step_before: float
    step_after: float | None = None
    expected_step: float | None = None
    fields: dict[str, FieldError] = field(default_factory=dict)
    param_vs_reference_unequal: int | None = None
    writeback_unequal: int | None = None
    sync_unequal: int | None = None
    placement: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    update: UpdateSize | None = None
    torch_unequal: dict[str, int] | None = None
    moments_zero: bool = False  # saved exp_avg and exp_avg_sq all zero at step >= 2 (a note, validate's D008)
    exp_avg_zero: bool = False  # saved exp_avg all zero, exp_avg_sq not, at step >= 2 (a note, validate's D015)
    moments_at_step0: tuple[str, ...] = ()  # saved moments non-zero at step 0 (a problem, validate's D007)
    # saved max |exp_avg|/sqrt(exp_avg_sq) and Adam's bound at the saved step, where beyond it (a problem, D007)
    moments_beyond: tuple[float, float] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def worst_ratio(self) -> float:
        """Largest error/tolerance ratio over the compared fields (inf when a bitwise check failed)."""
        if any((self.writeback_unequal, self.sync_unequal)) or (
            self.step_after is not None and self.step_after != self.expected_step
        ):
            return float("inf")
        return max((f.ratio for f in self.fields.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "numel": self.numel,
            "optimizer": self.optimizer_type,
            "group": self.group_id,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "state": self.state,
            "offloaded": self.offloaded,
            "step_before": self.step_before,
            "step_after": self.step_after,
            "expected_step": self.expected_step,
            "errors": {k: v.to_dict() for k, v in self.fields.items()},
            "param_vs_reference_unequal": self.param_vs_reference_unequal,
            "writeback_unequal": self.writeback_unequal,
            "sync_unequal": self.sync_unequal,
            "placement": self.placement,
            "update": self.update.to_dict() if self.update is not None else None,
            "torch_unequal": self.torch_unequal,
            "ok": self.ok,
            "problems": self.problems,
        }


@dataclass(frozen=True)
class ReplayResult:
    """Everything ``replay-step`` found (rendered by the command; ``to_dict`` is the ``--json`` schema).

    Attributes:
        path: checkpoint directory. device: the device the optimizer ran on.
        optimizer_type, optimizer_reason, optimizer_config: the choice and why.
        steps: K. grads: gradient source description. tolerance: ``(rtol, atol)``.
        reference_dtype: ``float64`` or ``float32``.
        params: per-parameter results, worst first.
        notes: facts for the user (fresh leaves, overrides, layout).
        batches: memory batches used. max_memory: the budget in bytes.
        timing: ``step_seconds`` (inside ``optimizer.step()``, synchronized), ``state_bytes``
            (bytes the steps read and wrote), ``effective_gbps``, offload transfer figures
            (``d2h_bytes``, ``h2d_bytes``, ``offload_seconds``, ``d2h_gbps``, ``h2d_gbps``),
            ``load_seconds``, ``reference_seconds``, ``total_seconds``, ``bytes_read``.
        skipped: selected parameters with saved state that were not replayed (``ok`` is then False).
        frozen: selected parameters without optimizer state that the format shows are frozen
            (``requires_grad=False``): not replayed, counted apart from ``params``.
        problems: findings about the saved state as a whole (``ok`` is then False): param groups with
            no optimizer state for any parameter while the trainer or LR scheduler counted steps
            (:func:`~ckpttool.model.counters.lost_optimizer_state`; a resume would restart the moments
            from zero, which a replay from fresh state cannot tell from a first step).
    """

    path: str
    device: str
    optimizer_type: str
    optimizer_reason: str
    optimizer_config: dict[str, dict[str, Any]]
    steps: int
    grads: dict[str, Any]
    tolerance: tuple[float, float]
    reference_dtype: str
    params: list[ParamResult]
    notes: list[str]
    batches: int
    max_memory: int
    timing: dict[str, float]
    skipped: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every parameter passed, no selected parameter with saved state was left out, and the saved
        state as a whole has no problem."""
        return all(p.ok for p in self.params) and not self.skipped and not self.problems

    @property
    def failed(self) -> list[ParamResult]:
        return [p for p in self.params if not p.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "ckpttool.replay/1",
            "checkpoint": self.path,
            "device": self.device,
            "optimizer": {
                "type": self.optimizer_type,
                "reason": self.optimizer_reason,
                "config": self.optimizer_config,
            },
            "steps": self.steps,
            "grads": self.grads,
            "tolerance": {"rtol": self.tolerance[0], "atol": self.tolerance[1]},
            "reference_dtype": self.reference_dtype,
            "ok": self.ok,
            "params_total": len(self.params),
            "params_failed": len(self.failed),
            "params_skipped": list(self.skipped),
            "params_frozen": list(self.frozen),
            "problems": list(self.problems),
            "params": [p.to_dict() for p in self.params],
            "notes": self.notes,
            "batches": self.batches,
            "max_memory": self.max_memory,
            "timing": self.timing,
        }


# ----------------------------------------------------------------------------- device
def resolve_device(device: str) -> Any:
    """The ``torch.device`` for ``--device``.

    Args:
        device: ``auto`` (the accelerator if there is one, else ``cpu``), ``cpu``, ``cuda`` or ``npu``.

    Returns:
        ``torch.device`` (with the current index for an accelerator).

    Raises:
        UsageError (E121): an accelerator type that this machine does not have.
    """
    import torch

    from ckpttool.optim_state.device import accelerator_type

    if device not in DEVICE_CHOICES:
        raise DeviceUnavailableError(f"`device` {device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if device == "npu":
        try:
            import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (optional: registers the npu accelerator)
        except ImportError as e:
            raise DeviceUnavailableError(
                "`device` npu needs torch_npu, which is not installed", hint="install torch_npu, or use `device` cpu"
            ) from e
    acc = accelerator_type()
    if device == "auto":
        device = acc or "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if acc != device:
        raise DeviceUnavailableError(
            f"`device` {device}: no {device} device on this machine (accelerator: {acc or 'none'})",
            hint="use `device` auto or `device` cpu",
        )
    return torch.device(device, torch.accelerator.current_device_index())


def _synchronize(device: Any) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _is_number(value: object) -> bool:
    """A real number that is no bool (a NumPy float or integer scalar is one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _default_max_memory() -> int:
    """Half the available host memory (psutil when installed, else ``sysconf``), at least 256 MiB."""
    try:
        import psutil  # type: ignore[import-untyped]  # optional, and no types-psutil in the dev dependencies

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 8 << 30
    return max(avail // 2, 256 << 20)


def check_tolerance(rtol: float, atol: float, text: str | None = None) -> None:
    """Refuse tolerances that are negative or not finite (an infinite tolerance can never fail).

    Args:
        rtol, atol: the tolerance.
        text: how the user wrote it (``"1e-5,1e-8"``), shown in the message; default ``rtol,atol``.

    Raises:
        UsageError (E100).
    """
    shown = repr(text) if text is not None else f"{rtol},{atol}"
    if not (math.isfinite(rtol) and math.isfinite(atol)):
        raise UsageError(
            f"`tolerance` {shown}: both numbers must be finite (an infinite or NaN tolerance "
            "accepts any result, so the check could never fail)",
            param="tolerance",
            hint="give finite values, e.g. `tolerance` 1e-5,1e-8 (widen them, e.g. 1e-3,1e-6, for a looser check)",
        )
    if not (rtol >= 0 and atol >= 0):
        raise UsageError(
            f"`tolerance` {shown}: both numbers must be >= 0",
            param="tolerance",
            hint="rtol and atol are non-negative bounds, e.g. `tolerance` 1e-5,1e-8",
        )


@dataclass(frozen=True)
class ReplayOptions:
    """How ``replay-step`` replays.

    Attributes:
        device: ``auto`` | ``cpu`` | ``cuda`` | ``npu``: where parameters live and resident state updates.
        select: ``re.search`` over parameter fqns (``None``: all parameters); older than ``filter_glob``.
        filter_glob: ``fnmatch`` glob over checkpoint keys ``model.<fqn>`` with or without ``model.``
            (``None``: all parameters), as ``inspect``/``export --filter``.
        grads: safetensors file of gradients keyed by fqn; ``None`` uses the seeded generator.
        grad_seed, grad_scale: generator seed and scale (``grads.py``).
        optimizer: ``auto`` or an optimizer type name (see ``plan.plan_replay``).
        offload_patterns: ``cpu_offload_adamw`` patterns (``re.search`` over fqns).
        chunk_size: ``cpu_offload_adamw`` staging chunk, elements.
        steps: K >= 1 steps.
        max_memory: peak-memory budget in bytes for one batch (default: half the available RAM).
        tolerance: ``(rtol, atol)`` for FP32 fields (``compare.py`` widens it for BF16).
        reference_dtype: ``float64`` (default) or ``float32``.
        reference: ``formula`` (the independent reference alone) or ``torch``: besides it,
            ``torch.optim.AdamW`` built with the flags saved in each parameter's group (``fused``,
            ``foreach``, ``capturable``, ``differentiable``, ``maximize``, ``amsgrad``) steps a copy of the saved
            state, and the replay must equal it bitwise (``adamw``-type parameters; the copy
            doubles the batch's memory).
        head_dim: attention head dim, to assemble fused ``wqkv`` parameters stored as
            ``wq``/``wk``/``wv`` (``None``: from ``q_norm``/``k_norm`` beside them, else they are skipped).
    """

    device: str = "auto"
    select: str | None = None
    grads: str | os.PathLike[str] | None = None
    grad_seed: int = 0
    grad_scale: float = 1e-3
    optimizer: str = "auto"
    offload_patterns: Sequence[str] | None = None
    chunk_size: int | None = field(default=None, metadata=at_least(1))
    steps: int = field(default=1, metadata=at_least(1))
    max_memory: int | None = field(default=None, metadata=at_least(1))
    tolerance: tuple[float, float] = (1e-5, 1e-8)
    reference_dtype: str = "float64"
    filter_glob: str | None = None
    reference: str = "formula"
    head_dim: int | None = field(default=None, metadata=at_least(1))

    def check(self) -> None:
        """Refuse values that cannot run (before anything is read).

        Raises:
            UsageError: a bad value, named by its parameter.
        """
        tol = self.tolerance
        if not (isinstance(tol, (tuple, list)) and len(tol) == 2 and all(map(_is_number, tol))):
            raise UsageError(
                f"`tolerance` must be a pair (rtol, atol) of numbers, got {type(tol).__name__} {tol!r:.40}",
                param="tolerance",
                hint="e.g. `tolerance` (1e-5, 1e-8)",
            )
        check_tolerance(*tol)
        if not _is_number(self.grad_scale):
            raise UsageError(
                f"`grad_scale` must be a number, got {type(self.grad_scale).__name__} {self.grad_scale!r:.40}",
                param="grad_scale",
            )
        if self.reference_dtype not in _REF_DTYPES:
            raise UsageError(
                f"`reference_dtype` must be float64 or float32, got {self.reference_dtype!r}", param="reference_dtype"
            )
        if not self.grad_scale > 0:
            raise UsageError(f"`grad_scale` must be > 0, got {self.grad_scale}", param="grad_scale")
        if self.reference not in REFERENCES:
            raise UsageError(
                f"`reference` must be one of {', '.join(REFERENCES)}, got {self.reference!r}", param="reference"
            )


# ----------------------------------------------------------------------------- replay
def replay_step(
    source: CheckpointOrPath,
    options: ReplayOptions | None = None,
    *,
    progress: ProgressFn | None = None,
    opening: OpenOptions | None = None,
    on_param: Callable[[str, dict[str, Any]], None] | None = None,
    phase: PhaseFn | None = None,
) -> ReplayResult:
    """Replay ``steps`` optimizer steps from a checkpoint and compare with an independent reference.

    Args:
        source: the opened :class:`~ckpttool.model.checkpoint.Checkpoint` (its layout declaration
            included), or its path, opened with ``opening``; only read.
        options: see :class:`ReplayOptions`.
        on_param: called as ``on_param(fqn, {"param", "master_weight", "exp_avg", "exp_avg_sq", "step"})``
            with CPU tensors after each parameter's replay (true expert order; ``master_weight`` absent for adamw).
        progress: called as ``progress(done, total)`` parameters, from ``(0, total)`` as the replay of the
            first batch starts, then after each parameter's reference comparison.
        phase: called as ``phase(text)`` as each step starts: ``planning``, then per memory batch
            ``loading optimizer state``, ``building the model``, ``replaying N parameters``.

    Returns:
        The :class:`ReplayResult` (``ok`` is False when any parameter is beyond tolerance).

    Raises:
        UsageError: bad options, device unavailable, unusable gradients file, memory budget too small.
        OptimStateError: state unusable for the replay (missing fields, dtype policy, hyperparameters).
        LayoutError: invalid/conflicting layout record or declaration; E405 for an ambiguous EP
            tensor when gradients come from a file.
        CkptError: unreadable or unsafe checkpoint.
    """
    opts = options_of(options, ReplayOptions)
    opts.check()
    rtol, atol = opts.tolerance  # plain floats in the result and its JSON (a NumPy scalar is not serializable)
    opts = dataclasses.replace(opts, tolerance=(float(rtol), float(atol)), grad_scale=float(opts.grad_scale))
    with signals_held():  # a Ctrl-C inside torch.distributed's C++ init aborts the process: held until torch loaded
        importlib.import_module("torch")
    with open_source(source, opening) as ckpt:
        return _replay(ckpt, opts, on_param, progress, phase or (lambda text: None))


@dataclass(frozen=True)
class _Prepared:
    """What a replay runs: the plan, its layout, gradients file, ambiguous EP keys and the notes so far."""

    layout: Any
    plan: Any
    notes: list[str]
    grad_file: Any
    ambiguous: set[str]
    synthesized: int = 0  # parameters whose state is synthesized (step 1, all-zero moments: D005)


def _older_optimizer_step_hint(ckpt: Checkpoint) -> str | None:
    """For a save without optimizer state (torchtitan's ``last_save_model_only``): the newest older step of the
    same run that holds it, as a hint to pass, or ``None`` (at most 8 older steps are opened)."""
    from ckpttool.format.storage import is_url
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.model.discovery import older_steps

    here = str(ckpt.catalog.path)
    if is_url(here) or ckpt.located.optimizer is not None:
        return None
    for step, path in older_steps(Path(here))[:8]:
        try:
            if open_checkpoint(path).param_groups():
                run = shell_arg(path.parent)
                return f"step {step} of this run holds its optimizer state: pass --step {step} (ckpttool replay-step {run} --step {step})"
        except CkptError:
            continue
    return None


def _config_head_dim(ckpt: Checkpoint, given: int | None) -> int | None:
    """The attention head dim of the ``config.json`` saved with the checkpoint (:meth:`Checkpoint.hf_config_beside`):
    its ``head_dim``, else ``hidden_size / num_attention_heads``; looked for only where q/k/v are stepped fused and
    stored split (torchtitan's ``wqkv``), ``None`` where there is none. With ``given`` (``--head-dim``) a config that
    cannot be read is passed over, and one whose head dim does not divide the k rows is not this model's.

    Raises:
        UsageError: ``given`` contradicts it (both named); without ``given``, a config that cannot be read.
    """
    rows_k = next((ckpt.catalog.model[p[1]].shape[0] for p in _qkv_parts(ckpt.catalog)), None)
    folder = ckpt.hf_config_beside() if rows_k is not None else None
    if folder is None:
        return None
    from ckpttool.model.hfconfig import read_hf_config

    try:
        cfg = read_hf_config(folder, param=None)
    except CkptError:
        if given is not None:  # the flag tells the head dim
            return None
        raise
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    hd: int | None = cfg.get("head_dim") if type(cfg.get("head_dim")) is int and cfg["head_dim"] > 0 else None
    if hd is None and type(heads) is int and type(hidden) is int and heads > 0 and hidden > 0 and hidden % heads == 0:
        hd = hidden // heads
    if hd is not None and given is not None and given != hd and rows_k and rows_k % hd == 0:
        raise UsageError(
            f"`head_dim` {given} contradicts {folder / 'config.json'}, saved with the checkpoint: its head dim is {hd}"
            + ("" if cfg.get("head_dim") == hd else f" (hidden_size {hidden} / num_attention_heads {heads})"),
            path=folder / "config.json",
            param="head_dim",
            hint=f"leave out `head_dim` (the config tells it), or pass `head_dim` {hd}",
        )
    return hd


def _qkv_parts(cat: Catalog) -> Iterator[tuple[str, ...]]:
    """The model keys of each parameter stepped fused as q/k/v and stored split (``wq``, ``wk``, ``wv``) present."""
    for ps in cat.optimizer_state.values():
        parts = ps.stored_as
        k = cat.model.get(parts[1]) if split_qkv(parts) else None
        if k is not None and k.shape:  # the k rows are its dim 0
            yield parts


def _prepare(ckpt: Checkpoint, opts: ReplayOptions) -> _Prepared:
    """Plan the replay, check the gradients file and note synthesized state and the EP layouts."""
    import torch

    from ckpttool.ops.replay.grads import GradFile

    reader, cat = ckpt.reader, ckpt.catalog
    ckpt.param_groups()
    layout = ckpt.require_layout()
    try:
        plan = plan_replay(
            cat,
            layout.record,
            **same_named(opts, "select", "filter_glob", "optimizer", "offload_patterns", "chunk_size", "head_dim"),
            object_steps=_object_steps(ckpt),
            config_head_dim=_config_head_dim(ckpt, opts.head_dim),
        )
    except HyperparameterError as e:
        hint = None if cat.param_groups else _older_optimizer_step_hint(ckpt)
        if hint is None:
            raise
        e.hint = hint  # the same error (its key, file and code), with the step to pass
        raise
    notes = list(plan.notes)
    spec = cat.schema.spec
    notes.extend(_lr_before_step_note(spec.lr_set_before_step if spec is not None else "", plan.params))
    if opts.steps > 1:
        notes.extend(_constant_lr_note(ckpt, opts.steps))
    newer = ckpt.located.newer_incomplete_note("replayed")
    if newer:  # validate's R001: the run's newest save is broken, the replay proves an older one
        notes.append(f"warning: {newer}")
    synth = synthesized_params(reader, cat, [p.fqn for p in plan.params if p.state])
    if synth:
        notes.append(
            f"warning: {len(synth)} parameter(s) have synthesized state (step 1, all-zero exp_avg/exp_avg_sq: the "
            f"optimizer never stepped before the save), e.g. {synth[0]}; `ckpttool validate --deep` reports D005"
        )
    if opts.reference == "torch":
        masters = [p for p in plan.params if p.optimizer_type != "adamw"]
        if masters:
            types = ", ".join(sorted({p.optimizer_type for p in masters}))
            notes.append(
                f"`reference` torch: {len(masters)} of {len(plan.params)} parameter(s) ({types}: an FP32 master "
                "torch.optim.AdamW does not keep) are compared with the formula reference only, e.g. "
                f"{masters[0].fqn}"
            )
    grad_file = GradFile(opts.grads, cat.wrapped) if opts.grads is not None else None
    if grad_file is not None:
        for p in plan.params:
            if not grad_file.has(p.fqn):
                grad_file.get(p.fqn, p.shape, torch.float32)  # raises E120 naming the first missing fqn
    ambiguous = set(layout.ambiguous) & {p.key for p in plan.params}
    if ambiguous:
        if grad_file is not None:
            layout.require_unambiguous()
        notes.append(
            f"{len(ambiguous)} EP tensor(s) of unknown layout (no record, EP and EP-FSDP on one dim) replay in "
            "stored expert order; declare --source-layout to replay in true expert order"
        )
    if layout.version == 1 and any(layout.is_permuted(p.key) for p in plan.params):
        notes.append("legacy (version 1) EP tensors are replayed in true expert order (block permutation undone)")
    return _Prepared(layout, plan, notes, grad_file, ambiguous, len(synth))


def _capturable_note(params: Sequence[ParamPlan], dev: Any) -> list[str]:
    """Where parameters saved with ``capturable=True`` (an accelerator run's) replay on the CPU, which torch refuses
    it on: the replay and ``--reference torch`` take the non-capturable arithmetic, not the run's."""
    if dev.type != "cpu":
        return []
    saved = [p.fqn for p in params if p.optimizer_type == "adamw" and dict(p.hyper.extra).get("capturable") is True]
    if not saved:
        return []
    return [
        f"{len(saved)} parameter(s) saved with capturable=True (an accelerator run's step), e.g. {saved[0]}: torch "
        "steps it on an accelerator only, so the CPU replay and `reference` torch take the non-capturable step, which "
        "may differ from the run's own in the last bit; replay on the run's device (`device` cuda) for its arithmetic"
    ]


def _lr_before_step_note(how: str, params: Sequence[ParamPlan]) -> list[str]:
    """A ``warning:`` note where the trainer sets the ``lr`` before each optimizer step (``how``:
    :attr:`~ckpttool.model.schemas.base.SchemaSpec.lr_set_before_step`): the saved ``lr`` is the saved step's, and its
    next step takes the schedule's ``lr`` at the step after, which the checkpoint does not hold. The note names the
    first replayed parameter whose ``lr`` differs from its group's ``initial_lr`` (the schedule moves it), else says
    that the replay is the next step where the schedule is flat there."""
    if not how or not params:
        return []
    moved = next(
        (
            (p, init)
            for p in params
            if isinstance(init := dict(p.hyper.extra).get("initial_lr"), (int, float))
            and not isinstance(init, bool)
            and init != p.hyper.lr
        ),
        None,
    )
    head = (
        f"warning: the replay steps with the lr saved in each param group, the lr of the saved step: {how}, so the "
        "step a resume takes next has the schedule's lr at the step after it, which the checkpoint does not hold"
    )
    if moved is None:
        flat = "the saved lr equals the group's initial_lr: the replay is that step where the schedule is flat there"
        return [f"{head}; {flat}"]
    p, init = moved
    return [
        f"{head}; the schedule moves it ({p.fqn}: lr {p.hyper.lr:g}, initial_lr {init:g}), so the replayed parameters "
        "are not the ones the trainer saves next (the moments and step are)"
    ]


def _constant_lr_note(ckpt: Checkpoint, steps: int) -> list[str]:
    """With ``--steps`` K > 1 every replayed step uses the ``lr`` saved in the param groups, while the run's LR
    scheduler, where one is saved, moves it after each step: steps 2..K are AdamW at a constant ``lr``, not the
    run's (a warning note naming the scheduler's counter)."""
    epochs, _ = scheduler_counters(ckpt)
    where = f"{epochs[0].key} = {epochs[0].value}" if epochs else None
    if where is None and ckpt.common_state_file is not None:  # Megatron's scheduler, in common.pt
        try:
            common = ckpt.common_state()
        except CkptError:
            common = None
        if common is not None and common.scheduler:
            where = f"{ckpt.common_state_file} {common.scheduler_item}"
    if where is None:
        return []
    return [
        f"warning: {steps} steps replayed, each with the lr saved in its param group; the run's LR scheduler ({where}) "
        "moves the lr after every step, so steps 2 and later are AdamW at a constant lr, not the steps the run takes"
    ]


def _grad_description(grad_file: Any, opts: ReplayOptions) -> dict[str, Any]:
    """The result's ``grads``: the gradients file, or the seeded generator."""
    return (
        {"source": "file", "path": str(grad_file.path)}
        if grad_file is not None
        else {
            "source": "seed",
            "seed": opts.grad_seed,
            "scale": opts.grad_scale,
            "generator": "torch.randn(fp32, cpu Generator seeded zlib.crc32('ckpttool.replay:{seed}:{k}:{fqn}')) * scale",
        }
    )


def _step_mismatch_note(results: list[ParamResult], record: Any, notes: list[str]) -> None:
    """Note the first loaded parameter whose saved step is behind the layout record's ``global_step`` (one ahead of it
    is a problem of the saved state: :func:`_state_problems`, ``R002``)."""
    for r in results:
        if (
            r.state == "loaded"
            and record is not None
            and record.global_step is not None
            and r.step_before < float(record.global_step)
        ):
            notes.append(
                f"saved step of {r.fqn} is {r.step_before:g} but the layout record's global_step is "
                f"{record.global_step} (parameters that missed gradients on some steps count fewer)"
            )
            break


#: The saved moments a replay notes (``ParamResult`` flag, what the parameters have, ``validate --deep``'s rule): all
#: zero at a step of 2 or more (``D008``: the update looks sane, the state of the steps taken was lost), and an
#: all-zero ``exp_avg`` beside a non-zero ``exp_avg_sq`` (``D015``: :func:`~ckpttool.ops.state_checks.exp_avg_lost`).
_ZERO_STATE_NOTES = (
    (
        "moments_zero",
        "all-zero exp_avg and exp_avg_sq at a saved step of 2 or more (moments reset, e.g. by a resume that "
        "re-initialised the optimizer but kept the step)",
        "D008",
    ),
    (
        "exp_avg_zero",
        "an all-zero exp_avg beside a non-zero exp_avg_sq at a saved step of 2 or more (AdamW's exp_avg is zero only "
        "where every gradient was, and exp_avg_sq would be too: the first moment was reset or lost)",
        "D015",
    ),
)


def _zero_state_notes(results: list[ParamResult], notes: list[str]) -> None:
    """A ``warning:`` note per kind of lost moments (:data:`_ZERO_STATE_NOTES`) some parameter's saved state shows."""
    for flag, what, code in _ZERO_STATE_NOTES:
        zero = [r for r in results if getattr(r, flag)]
        if zero:
            notes.append(
                f"warning: {len(zero)} parameter(s) have {what}, e.g. {zero[0].fqn} at step "
                f"{zero[0].step_before:g}; `ckpttool validate --deep` reports {code}"
            )


def _reset_step_problems(results: list[ParamResult], cat: Catalog) -> None:
    """Fail each loaded parameter saved at ``step`` 0 in a leaf whose other parameters stepped (``validate --deep``'s
    ``O007`` finds the counters apart), or saved at ``step`` 0 with non-zero moments (``validate --deep``'s ``D007``:
    a counter reset beside the moments of a real run, which the update-size bound may not catch). ``torch.optim`` creates a parameter's state in its first step and counts it
    at once, so a saved step 0 is state made up after the fact: its moments and bias correction restart at a resume
    while the group's go on, as for state lost (``E513``), which the replay of that made-up state cannot tell.
    Leaves as :meth:`~ckpttool.model.catalog.Catalog.leaves` (flattened groups with equal hyperparameters are one)."""

    def leaf(r: ParamResult) -> str:
        g = cat.group_of(r.fqn)
        return leaf_key(g) if g is not None else str(r.group_id)

    top: dict[str, ParamResult] = {}
    for r in results:
        if r.state == "loaded" and ((t := top.get(leaf(r))) is None or r.step_before > t.step_before):
            top[leaf(r)] = r
    for r in results:
        t = top.get(leaf(r))
        if r.state == "loaded" and r.step_before == 0 and t is not None and t.step_before >= 1:
            r.problems.insert(
                0,
                f"saved step 0 while {t.fqn} of its param group is at step {t.step_before:g} [O007]: torch.optim "
                "counts a parameter's first step as it creates its state, so this state was reset or made up after "
                "the run stepped (a resume restarts its moments and bias correction while its group's go on)",
            )
        elif r.state == "loaded" and r.moments_beyond is not None:
            ratio, bound = r.moments_beyond
            r.problems.insert(
                0,
                f"saved moments beyond Adam's bound [D007]: max |exp_avg|/sqrt(exp_avg_sq) {ratio:.4g}, beyond "
                f"{bound:.4g}, the most AdamW's recursion allows after the saved step {r.step_before:g} with its "
                "group's betas: the step counter or a moment is not this parameter's (a step set back, a stale, "
                "scaled or swapped moment); a resume steps from state no run produced",
            )
        elif r.state == "loaded" and r.moments_at_step0:
            r.problems.insert(
                0,
                f"saved step 0 with non-zero {' and '.join(r.moments_at_step0)} [D007]: the moments start at zero and "
                "change only in a step, which torch.optim counts at once, so the step counter was reset beside the "
                "moments of a real run (a resume bias-corrects them as a first step)",
            )


def _finish_timing(timing: dict[str, float], t_start: float, bytes_read: int) -> None:
    """Add the rates, the total seconds and the bytes read to ``timing``."""
    st = timing["step_seconds"]
    off = timing["offload_seconds"]
    timing.update(
        effective_gbps=(timing["state_bytes"] / st / 1e9) if st > 0 else 0.0,
        d2h_gbps=(timing["d2h_bytes"] / off / 1e9) if off > 0 else 0.0,
        h2d_gbps=(timing["h2d_bytes"] / off / 1e9) if off > 0 else 0.0,
        total_seconds=time.perf_counter() - t_start,
        bytes_read=float(bytes_read),
    )


def _plural_params(n: int) -> str:
    return f"{n:,} parameter" + ("" if n == 1 else "s")


def _run_batches(
    reader: Any,
    prep: _Prepared,
    batches: list[list[ParamPlan]],
    opts: ReplayOptions,
    *,
    dev: Any,
    ref_dtype: Any,
    timing: dict[str, float],
    on_param: Callable[[str, dict[str, Any]], None] | None,
    progress: ProgressFn | None,
    say: Callable[[str], None],
) -> tuple[list[ParamResult], int]:
    """Replay the batches in order (:func:`_replay_batch`); returns the results and the bytes read."""
    import torch

    rtol, atol = opts.tolerance
    layout, plan, grad_file, ambiguous = prep.layout, prep.plan, prep.grad_file, prep.ambiguous

    def canon(key: str, model_key: str, t: torch.Tensor) -> torch.Tensor:
        if model_key in ambiguous:
            return t
        return to_canonical(layout, key, t)

    results: list[ParamResult] = []
    done = [0]
    total = len(plan.params)

    def advance() -> None:  # one parameter compared
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    start_read = reader.bytes_read
    for n, batch in enumerate(batches, 1):
        of = f" (batch {n}/{len(batches)})" if len(batches) > 1 else ""
        phases = (
            f"loading optimizer state{of}",
            f"building the model{of}",
            f"replaying {_plural_params(len(batch))}{of}",
        )
        results.extend(
            _replay_batch(
                reader,
                batch,
                dev=dev,
                steps=opts.steps,
                plan_config=plan.config,
                grad_file=grad_file,
                grad_seed=opts.grad_seed,
                grad_scale=opts.grad_scale,
                rtol=rtol,
                atol=atol,
                ref_dtype=ref_dtype,
                canon=canon,
                slabs=lambda key, model_key: TensorSlabs(reader, layout, key, model_key, ambiguous),
                timing=timing,
                on_param=on_param,
                torch_reference=opts.reference == "torch",
                phases=(say, phases, progress, (done[0], total), advance),
            )
        )
    bytes_read = reader.bytes_read - start_read
    return results, bytes_read


def _replay(
    ckpt: Checkpoint,
    opts: ReplayOptions,
    on_param: Callable[[str, dict[str, Any]], None] | None,
    progress: ProgressFn | None,
    say: Callable[[str], None],
) -> ReplayResult:
    import torch

    t_start = time.perf_counter()
    rtol, atol = opts.tolerance
    dev = resolve_device(opts.device)
    budget = opts.max_memory if opts.max_memory is not None else _default_max_memory()
    reader = ckpt.reader
    say("planning")
    prep = _prepare(ckpt, opts)
    layout, plan, notes, grad_file = prep.layout, prep.plan, prep.notes, prep.grad_file
    notes.extend(_capturable_note(plan.params, dev))
    ref_dtype = getattr(torch, opts.reference_dtype)
    ref_itemsize = 8 if opts.reference_dtype == "float64" else 4
    batches = make_batches(plan.params, budget, ref_itemsize, steps=opts.steps)
    logger.info(
        "replay: %d parameter(s) on %s with %s (%s); %d batch(es) under %d bytes; %s reference",
        len(plan.params),
        dev,
        plan.optimizer_type,
        plan.reason,
        len(batches),
        budget,
        opts.reference_dtype,
    )
    grad_desc = _grad_description(grad_file, opts)

    timing = {
        "step_seconds": 0.0,
        "state_bytes": 0.0,
        "d2h_bytes": 0.0,
        "h2d_bytes": 0.0,
        "offload_seconds": 0.0,
        "load_seconds": 0.0,
        "reference_seconds": 0.0,
    }
    results, bytes_read = _run_batches(
        reader,
        prep,
        batches,
        opts,
        dev=dev,
        ref_dtype=ref_dtype,
        timing=timing,
        on_param=on_param,
        progress=progress,
        say=say,
    )
    _step_mismatch_note(results, layout.record, notes)
    _zero_state_notes(results, notes)
    _reset_step_problems(results, ckpt.catalog)
    results.sort(key=lambda r: (r.ok, -r.worst_ratio, r.fqn))
    _finish_timing(timing, t_start, bytes_read)
    return ReplayResult(
        path=str(ckpt.path),
        device=str(dev),
        optimizer_type=plan.optimizer_type,
        optimizer_reason=plan.reason,
        optimizer_config=plan.config,
        steps=opts.steps,
        grads=grad_desc,
        tolerance=(rtol, atol),
        reference_dtype=opts.reference_dtype,
        params=results,
        notes=notes,
        batches=len(batches),
        max_memory=budget,
        timing=timing,
        skipped=tuple(plan.skipped),
        frozen=tuple(plan.frozen),
        problems=_state_problems(ckpt, prep, results, complete=opts.select is None and opts.filter_glob is None),
    )


def _object_steps(ckpt: Checkpoint) -> dict[str, float]:
    """fqn -> ``step`` saved as a Python number (a byte item: torch before 1.12, optimizers that count in an int),
    which ``torch.optim.AdamW`` turns into a float32 tensor as it loads the state (``Adam.__setstate__``). Other
    objects are left out (the plan refuses them, E511); a step shared by a param group (Megatron) is not read."""
    cat, entries = ckpt.catalog, ckpt.reader.metadata.entries
    out: dict[str, float] = {}
    for fqn, ps in cat.optimizer_state.items():
        if "step" not in ps.fields or ps.fields["step"] is not None:
            continue
        key = cat.state_key(fqn, "step")
        if key in entries and not isinstance(entries[key], TensorMeta):
            v = ckpt.reader.read_object(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[fqn] = float(v)
    return out


def _state_problems(
    ckpt: Checkpoint, prep: _Prepared, results: list[ParamResult], *, complete: bool
) -> tuple[str, ...]:
    """The saved state's problems as a whole (:attr:`ReplayResult.problems`): steps counted with no optimizer state,
    or an optimizer ``step`` that is not the trainer's (``complete``: every stepped parameter was replayed, so the
    largest saved step is the optimizer's)."""
    lost = lost_optimizer_state(ckpt) if prep.plan.params else None
    if lost is not None:
        return (f"{lost[1]}; every parameter replayed from fresh state (`ckpttool validate --deep` reports R002)",)
    loaded = [r for r in results if r.state != "fresh"]
    lost = synthesized_state_lost(ckpt, prep.synthesized) if complete else None
    if lost is not None:  # made-up state of an optimizer rebuilt after steps were taken
        return (f"{lost[1]} (`ckpttool validate --deep` reports R002)",)
    if not loaded or prep.synthesized:
        return ()  # nothing loaded to compare; or saved before the first step (D005), as R002 skips it
    top = max(loaded, key=lambda r: r.step_before)
    opt = Counter(f"{ckpt.catalog.schema.optimizer_prefix or ''}state.{top.fqn}.step", int(top.step_before))
    trains = trainer_steps(ckpt) + record_steps(ckpt)
    if trains:
        bad = optimizer_step_disagrees(ckpt, opt, trains[0], all_params=complete)
        why = f"the optimizer state is not the trainer's step, and a resume would bias-correct for step {opt.value}"
        if bad is None:  # optimizer and trainer agree: an LR scheduler of another save still moves the next lr
            bad = next(iter(scheduler_disagrees(ckpt, trains[0], scheduler_counters(ckpt)[0])), None)
            why = "the LR scheduler is of another save: a resume would take the lr of another step from the next one"
    elif several_optimizer_steps(ckpt):  # verl: the optimizer steps per mini-batch, the scheduler per training step
        epochs = scheduler_counters(ckpt)[0]
        bad = directory_step_disagrees(ckpt, epochs[0] if epochs else None)
        why = "the LR scheduler is of another save than its step directory: a resume would take the lr of another step"
    else:  # no trainer step saved: the LR scheduler's last_epoch is the run's only other counter
        lags = not complete or skips_optimizer_steps(ckpt)
        bad = next(iter(scheduler_disagrees(ckpt, opt, scheduler_counters(ckpt)[0], ref_may_lag=lags)), None)
        why = "the optimizer state and the LR scheduler are of different saves: a resume pairs the moments of one step with the lr of another"
    out = () if bad is None else (f"{bad[1]}: {why} (`ckpttool validate --deep` reports R002)",)
    return out + _scheduler_lr_problems(ckpt, loaded)


def _scheduler_lr_problems(ckpt: Checkpoint, loaded: list[ParamResult]) -> tuple[str, ...]:
    """A replayed parameter's group whose saved ``lr`` is not the one the saved LR scheduler set in it
    (:func:`~ckpttool.model.counters.scheduler_lr_disagrees`): the replay steps with the saved ``lr``, which the
    uninterrupted run did not take its next step with."""
    groups = ckpt.param_groups()
    bad = scheduler_lr_disagrees(ckpt, groups, {r.group_id for r in loaded})
    return tuple(
        f"{msg}: the LR scheduler moved the lr and the param groups were saved without it, so the replay and a "
        "resume step with an lr the run did not take its next step with (`ckpttool validate` reports R006)"
        for _, msg in bad
    )


#: Elements per reference/comparison slab: a few dozen float64 temporaries of this size per worker.
REFERENCE_SLAB = 1 << 16
#: Elements per slab of the one-pass native kernel (``kernel.py``): only the saved values' reads are buffered.
NATIVE_SLAB = 1 << 18
#: dtypes of saved fields whose values :meth:`_SlabContext._nonfinite_saved` checks for NaN and infinity
_FLOAT_FIELDS = frozenset({"float64", "float32", "bfloat16", "float16"})

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def _saved_moment_flags(p: ParamPlan, r: ParamResult, t: dict[str, Any]) -> None:
    """Set what the loaded moments show before the step (the notes and problems of :func:`_zero_state_notes` and
    :func:`_reset_step_problems`): zero moments, non-zero moments at step 0."""
    step_before = r.step_before
    zero = [not bool(t[f].any()) if f in t else None for f in MOMENTS]  # each moment read once
    r.moments_zero = step_before >= 2 and all(z is True for z in zero)
    r.exp_avg_zero = exp_avg_lost(step_before, p.hyper.beta1, *zero)
    if step_before == 0 and not p.fresh:
        r.moments_at_step0 = tuple(f for f, z in zip(MOMENTS, zero, strict=True) if z is False)


def _loaded_moments_beyond(p: ParamPlan, t: dict[str, Any]) -> tuple[float, float] | None:
    """:func:`_saved_moments_beyond` of a parameter's loaded state where its ``step`` is a count of at least 1 (other
    steps: ``None``; :func:`~ckpttool.ops.state_checks.step_not_count` refuses the ones that are no count)."""
    if p.fresh or "step" not in t or not all(f in t for f in MOMENTS):
        return None
    step = float(t["step"].item())
    if not (math.isfinite(step) and step >= 1 and step == int(step)):
        return None
    return _saved_moments_beyond(p, step, t["exp_avg"], t["exp_avg_sq"])


#: Elements per chunk of :func:`_saved_moments_beyond` (bounds its float64 temporaries to a few MiB).
_RATIO_CHUNK = 1 << 18


def _saved_moments_beyond(p: ParamPlan, step: float, m: Any, v: Any) -> tuple[float, float] | None:
    """``(max |exp_avg| / sqrt(exp_avg_sq), bound)`` of the saved moments where beyond Adam's bound at the saved step
    (:func:`~ckpttool.optim_state.bounds.adam_ratio_bound`, raw moments, with ``UPDATE_BOUND_SLACK``), else ``None``.

    Adam's own recursion cannot leave moments beyond it, whatever the gradients: a step counter set back (or
    another parameter's, or another save's), a stale or scaled moment. The step replayed from such state can
    still be within the bound after it (the new gradient dilutes the old moments), so the saved state is checked
    as saved (``validate --deep``'s ``D007``). Elements with ``exp_avg_sq <= 0`` or NaN are left out (``D006``,
    ``D002``, ``D001`` name them); an FP16 ``exp_avg_sq`` takes
    :func:`~ckpttool.optim_state.bounds.fp16_underflow_margin`. Read in chunks of :data:`_RATIO_CHUNK` elements.
    """
    import torch

    h = p.hyper
    bound = adam_ratio_bound(step, h.beta1, h.beta2, bias_corrected=False, span=beta1_span(dict(h.extra)))
    limit = bound * UPDATE_BOUND_SLACK
    if not math.isfinite(limit) or m.shape != v.shape or not (m.is_floating_point() and v.is_floating_point()):
        return None
    margin = fp16_underflow_margin(step, h.beta2) if v.dtype == torch.float16 else 0.0
    m, v = m.detach().reshape(-1), v.detach().reshape(-1)
    worst = 0.0
    for a in range(0, m.numel(), _RATIO_CHUNK):
        mc, vc = m[a : a + _RATIO_CHUNK], v[a : a + _RATIO_CHUNK]
        # float32 first pass (m^2 - limit^2 (v + margin) <= 0 everywhere: within); float64 where it is not
        q = mc.float().square().sub_(vc.float(), alpha=limit * limit)  # square(): .float() of float32 is mc itself
        if not bool((q > -margin * limit * limit).any()):
            continue
        mm, vv = mc.double().square(), vc.double()
        ok_v = vv > 0
        vv = vv + margin
        beyond = (mm > vv * (limit * limit)) & ok_v
        if bool(beyond.any()):
            worst = max(worst, float(mm[beyond].div_(vv[beyond]).max().sqrt().item()))
    return (worst, bound) if worst > 0 else None


@contextmanager
def _reuse_freed_memory() -> Iterator[None]:
    """Keep freed slab temporaries in the heap while the reference runs (glibc; elsewhere a no-op).

    The reference allocates thousands of slab-sized float64 tensors; with glibc's defaults each
    one above 128 KiB is a fresh ``mmap`` (or the heap top is trimmed after its ``free``), so
    every slab pays its page faults again (several times slower per element). Raising the mmap
    and trim thresholds for the pass keeps them for reuse; afterwards the defaults come back
    and ``malloc_trim`` returns what is free to the system.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    changed = bool(mallopt(_M_MMAP_THRESHOLD, 64 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 512 << 20))
    try:
        yield
    finally:
        if changed:
            mallopt(_M_TRIM_THRESHOLD, 128 << 10)
            mallopt(_M_MMAP_THRESHOLD, 128 << 10)
            malloc_trim(0)


def _load_batch(
    reader: Any,
    batch: list[ParamPlan],
    canon: Callable[[str, str, Any], Any],
    workers: int,
    steps: int,
    timing: dict[str, float],
) -> tuple[dict[str, dict[str, Any]], dict[str, ParamResult]]:
    """Read each parameter and its saved state (true expert order, in threads); start its result."""
    import torch

    t0 = time.perf_counter()
    results: dict[str, ParamResult] = {}
    beyond: dict[str, tuple[float, float] | None] = {}

    def load(p: ParamPlan) -> dict[str, torch.Tensor]:
        if p.parts:  # a fused parameter stored split: its parts interleaved in row groups (plan.ParamPlan)
            pieces = [canon(k, k, reader.read_tensor(k)) for k in p.parts]
            g = p.part_groups
            t = {"param": torch.cat([x.reshape(g, -1) for x in pieces], 1).reshape(p.shape)}
        else:
            t = {"param": canon(p.key, p.key, reader.read_tensor(p.key))}
        for f, entry in p.state.items():
            t[f] = canon(entry.key, p.key, reader.read_tensor(entry.key))
        if p.shared_step is not None:
            t["step"] = torch.tensor(p.shared_step, dtype=torch.float32)
        beyond[p.fqn] = _loaded_moments_beyond(p, t)  # in the reading threads
        return t

    loaded = dict(zip((p.fqn for p in batch), map_ordered(load, batch, workers=workers)))
    for p in batch:
        t = loaded[p.fqn]
        step_before = float(t["step"].item()) if "step" in t else 0.0
        is_f32 = "step" in t and t["step"].dtype == torch.float32  # a Python-number step is loaded as float32
        why = step_not_count(step_before, is_f32)
        if why is not None:
            raise StateDtypeError(
                f"optimizer state {p.fqn}.step {why}",
                fqn=p.fqn,
                hint="run `ckpttool validate --strict --deep` on the checkpoint to see every problem",
            )
        r = ParamResult(
            p.fqn,
            p.shape,
            p.dtype,
            p.numel,
            p.optimizer_type,
            p.hyper.group_id,
            p.hyper.lr,
            p.hyper.weight_decay,
            "fresh" if p.fresh else "loaded",
            p.offloaded,
            step_before,
        )
        r.expected_step = step_before + steps
        _saved_moment_flags(p, r, t)
        r.moments_beyond = beyond.get(p.fqn)
        results[p.fqn] = r
    timing["load_seconds"] += time.perf_counter() - t0
    return loaded, results


def _build_optimizers(
    batch: list[ParamPlan],
    loaded: dict[str, dict[str, Any]],
    dev: Any,
    plan_config: dict[str, dict[str, Any]],
) -> tuple[dict[str, Any], list[tuple[Any, list[ParamPlan], bool]]]:
    """Device parameters and one optimizer per (type, group, placement); the optimizers adopt the loaded state."""
    import torch

    from ckpttool.optim_state.factory import build_optimizer

    params: dict[str, torch.nn.Parameter] = {}
    for p in batch:
        src = loaded[p.fqn]["param"]
        params[p.fqn] = torch.nn.Parameter(src.to(dev, copy=dev.type != "cpu"), requires_grad=True)
    buckets: dict[tuple[Any, ...], list[ParamPlan]] = {}
    for p in batch:
        buckets.setdefault((p.optimizer_type, p.hyper, p.offloaded), []).append(p)
    optimizers: list[tuple[Any, list[ParamPlan], bool]] = []
    for (type_name, hyper, offloaded), members in buckets.items():
        group = {"params": [(m.fqn, params[m.fqn]) for m in members], **hyper.as_kwargs()}
        if type_name == "adamw":
            if "fused" not in plan_config.get(type_name, {}):
                group.update(saved_flags(hyper, dev, IMPLEMENTATION_FLAGS))  # the run's implementation
            flags = {**group, **plan_config.get(type_name, {})}
            group["lr"], group["betas"] = torch_lr(hyper, dev, flags), torch_betas(hyper, dev, flags)
        opt = build_optimizer(type_name, [group], **plan_config.get(type_name, {}))
        saved_group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        saved_group["params"] = list(range(len(members)))
        state = {
            i: {f: v for f, v in loaded[m.fqn].items() if f != "param"} for i, m in enumerate(members) if not m.fresh
        }
        opt.load_state_dict({"state": state, "param_groups": [saved_group]})
        optimizers.append((opt, members, offloaded and dev.type != "cpu"))
    return params, optimizers


def torch_lr(hyper: Hyper, dev: Any, flags: dict[str, bool]) -> Any:
    """The ``lr`` to build ``torch.optim.AdamW`` with ``flags``: the saved float, or a 0-d tensor of the saved dtype
    where the group saved one (torch then computes ``lr * weight_decay`` and the step size with the tensor: a float
    gives results an ulp away from the run's own step). A float where torch refuses a tensor (``foreach`` without
    ``capturable``: a run captured on an accelerator, replayed on the CPU)."""
    if hyper.lr_dtype is None or (flags.get("foreach") and not flags.get("capturable")):
        return hyper.lr
    import torch

    dtype = getattr(torch, hyper.lr_dtype)
    return torch.tensor(hyper.lr, dtype=dtype, device=dev if flags.get("capturable") else "cpu")


def torch_betas(hyper: Hyper, dev: Any, flags: dict[str, bool]) -> Any:
    """The ``betas`` to build ``torch.optim.AdamW`` with ``flags``: the saved floats, or two 0-d tensors of the saved
    dtype where the group saved tensors (torch then computes ``1 - beta`` and the bias corrections in that dtype), as
    :func:`torch_lr` passes ``lr``; floats where torch refuses tensors (``foreach`` without ``capturable``)."""
    if hyper.betas_dtype is None or (flags.get("foreach") and not flags.get("capturable")):
        return (hyper.beta1, hyper.beta2)
    import torch

    dtype, where = getattr(torch, hyper.betas_dtype), dev if flags.get("capturable") else "cpu"
    return (torch.tensor(hyper.beta1, dtype=dtype, device=where), torch.tensor(hyper.beta2, dtype=dtype, device=where))


def for_loop_scalar_dtypes(group: dict[str, Any], param: Any) -> tuple[Any, Any]:
    """The dtypes of a group's tensor ``lr`` and tensor ``betas`` (each else ``None``) where ``torch.optim.AdamW``
    takes its for-loop step (not fused, not foreach, not capturable: ``_single_tensor_adam`` forms the decay factor
    in the ``lr``'s dtype, the bias corrections in the betas', the step size in that of ``lr / (1 - beta1**t)``),
    else ``(None, None)``. A ``differentiable`` group's step (always the for-loop one) forms the bias corrections and
    the step size as tensors of the step's dtype (FP32; beside FP32 betas: BF16 betas are promoted), so its second
    dtype is that one, float betas or not."""
    import torch

    if group.get("fused") or group.get("capturable"):
        return None, None
    if group.get("differentiable"):
        lr, beta1 = group.get("lr"), group.get("betas", (None,))[0]
        betas = beta1.dtype if isinstance(beta1, torch.Tensor) else torch.float32
        return (lr.dtype if isinstance(lr, torch.Tensor) else None), torch.promote_types(betas, torch.float32)
    foreach = group.get("foreach")
    if not (foreach is False or (foreach is None and param.device.type == "cpu")):
        return None, None
    lr, beta1 = group.get("lr"), group.get("betas", (None,))[0]
    return (lr.dtype if isinstance(lr, torch.Tensor) else None), (
        beta1.dtype if isinstance(beta1, torch.Tensor) else None
    )


def saved_flags(hyper: Hyper, dev: Any, names: Sequence[str] = TORCH_FLAGS) -> dict[str, bool]:
    """The ``torch.optim.AdamW`` switches saved in a param group (``Hyper.extra``), as booleans.

    ``capturable`` is kept only on an accelerator (torch refuses it for CPU tensors); ``fused``
    and ``foreach`` are never both set (``fused`` wins, as torch requires one).
    """
    extra = dict(hyper.extra)
    out = {k: extra[k] for k in names if isinstance(extra.get(k), bool)}
    if out.get("capturable") and dev.type == "cpu":
        out["capturable"] = False
    if out.get("fused") and out.get("foreach"):
        out["foreach"] = False
    return out


def _torch_snapshot(batch: list[ParamPlan], loaded: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Copies of the saved parameter and state of the ``adamw``-type parameters (before the optimizer adopts them)."""
    return {p.fqn: {k: t.clone() for k, t in loaded[p.fqn].items()} for p in batch if p.optimizer_type == "adamw"}


def _torch_reference(
    batch: list[ParamPlan],
    snapshot: dict[str, dict[str, Any]],
    grads: list[dict[str, Any]],
    params: dict[str, Any],
    optimizers: list[tuple[Any, list[ParamPlan], bool]],
    *,
    dev: Any,
    results: dict[str, ParamResult],
) -> None:
    """``torch.optim.AdamW`` with each parameter's saved flags, K steps on the snapshot; bitwise against the replay."""
    import torch

    state_of = {m.fqn: opt.state.get(params[m.fqn], {}) for opt, members, _ in optimizers for m in members}
    for p in batch:
        saved = snapshot.get(p.fqn)
        if saved is None:
            continue
        flags = saved_flags(p.hyper, dev)
        flags.update({k: True for k, v in saved_flags(p.hyper, dev, ("differentiable",)).items() if v})
        theta = torch.nn.Parameter(saved["param"].to(dev, copy=True))
        kwargs: dict[str, Any] = {
            **p.hyper.as_kwargs(),
            **flags,
            "lr": torch_lr(p.hyper, dev, flags),
            "betas": torch_betas(p.hyper, dev, flags),
        }
        # a group's differentiable, not the constructor's: that would step with autograd on (in place on a leaf)
        opt = torch.optim.AdamW([{"params": [theta], "differentiable": kwargs.pop("differentiable", False)}], **kwargs)
        if not p.fresh:
            st = {k: v.to(dev) if k != "step" else v for k, v in saved.items() if k != "param"}
            group = {**opt.param_groups[0], "params": [0]}
            opt.load_state_dict({"state": {0: st}, "param_groups": [group]})
        for gk in grads:
            theta.grad = gk[p.fqn].to(dev)
            opt.step()
            theta.grad = None
        mine, ref = state_of[p.fqn], opt.state[theta]
        r = results[p.fqn]
        r.torch_unequal = {"param": count_unequal_nan_equal(params[p.fqn].detach().cpu(), theta.detach().cpu())}
        for f in ("exp_avg", "exp_avg_sq", "step"):
            if f in mine and f in ref:
                r.torch_unequal[f] = count_unequal_nan_equal(
                    mine[f].detach().cpu().reshape(-1), ref[f].detach().cpu().reshape(-1)
                )
        bad = {f: n for f, n in r.torch_unequal.items() if n}
        if bad:
            shown = ", ".join(f"{k}={v}" for k, v in flags.items())
            r.problems.append(
                f"differs bitwise from torch.optim.AdamW({shown}) on the saved state: "
                + ", ".join(f"{f} in {n} element(s)" for f, n in bad.items())
            )


def _timed_step(optimizers: list[tuple[Any, list[ParamPlan], bool]], dev: Any, timing: dict[str, float]) -> None:
    """One timed ``optimizer.step()`` per optimizer; counts the state and offload bytes moved."""
    for opt, members, staged in optimizers:
        _synchronize(dev)
        t2 = time.perf_counter()
        opt.step()
        _synchronize(dev)
        dt = time.perf_counter() - t2
        timing["step_seconds"] += dt
        for member in members:
            timing["state_bytes"] += member.numel * _bytes_per_step(member)
        if staged:
            timing["offload_seconds"] += dt
            for member in members:
                ip = ITEMSIZE[member.dtype]
                timing["d2h_bytes"] += member.numel * ip
                timing["h2d_bytes"] += member.numel * ip


def _timed_steps(
    batch: list[ParamPlan],
    params: dict[str, Any],
    optimizers: list[tuple[Any, list[ParamPlan], bool]],
    *,
    dev: Any,
    steps: int,
    grad_file: Any,
    grad_seed: int,
    grad_scale: float,
    workers: int,
    timing: dict[str, float],
) -> list[dict[str, Any]]:
    """K timed steps; the gradients are kept (on the CPU) for the reference and returned, per step."""
    import torch

    from ckpttool.ops.replay.grads import seeded_grad

    grads: list[dict[str, torch.Tensor]] = []
    for k in range(steps):
        if grad_file is not None:
            gk = grads[0] if grads else {p.fqn: grad_file.get(p.fqn, p.shape, getattr(torch, p.dtype)) for p in batch}
        else:  # seeded per fqn: the same values whatever the thread order

            def gen(p: ParamPlan, k: int = k) -> torch.Tensor:
                return seeded_grad(
                    p.fqn, p.shape, getattr(torch, p.dtype), seed=grad_seed, scale=grad_scale, step_index=k
                )

            gk = dict(zip((p.fqn for p in batch), map_ordered(gen, batch, workers=workers)))
        for p in batch:
            g = gk[p.fqn]
            params[p.fqn].grad = g.to(dev) if dev.type != "cpu" else g
        grads.append(gk)
        _timed_step(optimizers, dev, timing)
        for p in batch:
            params[p.fqn].grad = None
    return grads


def _reference_pass(
    optimizers: list[tuple[Any, list[ParamPlan], bool]],
    results: dict[str, ParamResult],
    params: dict[str, Any],
    grads: list[dict[str, Any]],
    *,
    dev: Any,
    steps: int,
    rtol: float,
    atol: float,
    ref_dtype: Any,
    slabs: Callable[[str, str], TensorSlabs],
    workers: int,
    timing: dict[str, float],
    on_param: Callable[[str, dict[str, Any]], None] | None,
    advance: Callable[[], None] | None = None,
) -> list[ParamResult]:
    """Reference and comparison, slab by slab, in parallel (torch's kernels release the GIL); ``advance()``
    after each parameter."""
    import torch

    t1 = time.perf_counter()
    out: list[ParamResult] = []
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _reuse_freed_memory():
            for opt, members, _ in optimizers:
                for member in members:
                    r = results[member.fqn]
                    param = params[member.fqn]
                    st = opt.state.get(param, {})
                    dtypes = for_loop_scalar_dtypes(opt.param_groups[0], param)
                    ctx = _SlabContext(
                        member,
                        r,
                        param.detach(),
                        st,
                        grads,
                        slabs,
                        steps,
                        rtol,
                        atol,
                        ref_dtype,
                        dtypes,
                        fused=bool(opt.param_groups[0].get("fused")),
                    )
                    bounds = [(a, min(a + ctx.slab, member.numel)) for a in range(0, member.numel, ctx.slab)]
                    parts = map_ordered(ctx.run, bounds, workers=workers)
                    ctx.finish(parts, dev)
                    if on_param is not None:
                        cpu = {"param": param.detach().cpu()}
                        for f in ("master_weight", "exp_avg", "exp_avg_sq", "step"):
                            if f in st:
                                cpu[f] = st[f].detach().cpu()
                        on_param(member.fqn, cpu)
                    out.append(r)
                    if advance is not None:
                        advance()
    finally:
        torch.set_num_threads(prev_threads)
    timing["reference_seconds"] += time.perf_counter() - t1
    return out


def _replay_batch(
    reader: Any,
    batch: list[ParamPlan],
    *,
    dev: Any,
    steps: int,
    plan_config: dict[str, dict[str, Any]],
    grad_file: Any,
    grad_seed: int,
    grad_scale: float,
    rtol: float,
    atol: float,
    ref_dtype: Any,
    canon: Callable[[str, str, Any], Any],
    slabs: Callable[[str, str], TensorSlabs],
    timing: dict[str, float],
    on_param: Callable[[str, dict[str, Any]], None] | None,
    torch_reference: bool = False,
    phases: tuple[Any, ...] | None = None,
) -> list[ParamResult]:
    """Replay one memory batch (see the module docstring); returns its parameter results.

    ``phases``: ``(say, (loading, building, replaying), progress, (done, total), advance)``: each step named
    with ``say``, the parameter count drawn from ``progress(done, total)`` as the replay starts, then
    ``advance()`` after each parameter.

    Memory is that of a resumed run: the parameters, their loaded state (adopted by the
    optimizer, updated in place), one gradient per step; the reference and the comparison
    then run slab by slab over the *saved* values read again from the checkpoint
    (:class:`~ckpttool.ops.replay.slabs.TensorSlabs`), with slab-sized temporaries only.
    """
    workers = max(1, min(4, os.cpu_count() or 1))
    say, names, progress, counts, advance = phases or (lambda text: None, ("", "", ""), None, (0, 0), None)
    say(names[0])
    loaded, results = _load_batch(reader, batch, canon, workers, steps, timing)
    snapshot = _torch_snapshot(batch, loaded) if torch_reference else None
    say(names[1])
    params, optimizers = _build_optimizers(batch, loaded, dev, plan_config)
    del loaded
    say(names[2])
    if progress is not None:
        progress(*counts)
    grads = _timed_steps(
        batch,
        params,
        optimizers,
        dev=dev,
        steps=steps,
        grad_file=grad_file,
        grad_seed=grad_seed,
        grad_scale=grad_scale,
        workers=workers,
        timing=timing,
    )
    if snapshot is not None:
        _torch_reference(batch, snapshot, grads, params, optimizers, dev=dev, results=results)
        del snapshot
    return _reference_pass(
        optimizers,
        results,
        params,
        grads,
        dev=dev,
        steps=steps,
        rtol=rtol,
        atol=atol,
        ref_dtype=ref_dtype,
        slabs=slabs,
        workers=workers,
        timing=timing,
        on_param=on_param,
        advance=advance,
    )


class _SlabContext:
    """The reference and the checks of one parameter, one slab at a time (:meth:`run` is thread-safe)."""

    def __init__(
        self,
        p: ParamPlan,
        r: ParamResult,
        param: Any,
        st: dict[str, Any],
        grads: list[dict[str, Any]],
        slabs: Callable[[str, str], TensorSlabs],
        steps: int,
        rtol: float,
        atol: float,
        ref_dtype: Any,
        scalar_dtypes: tuple[Any, Any] = (None, None),
        *,
        fused: bool = False,
    ) -> None:
        self.p, self.r, self.st, self.steps = p, r, st, steps
        # torch.optim.AdamW's for-loop and foreach steps read FP16 moments as stored (rounded) in the parameter
        # update; its fused kernel computes the update from the unrounded ones (docs/replay.md, "Tolerance")
        self.fp16_moments = p.moment_dtype == "float16"
        self.rounds_moments = self.fp16_moments and p.optimizer_type == "adamw" and not fused
        self.rtol, self.atol, self.ref_dtype = rtol, atol, ref_dtype
        # the dtypes of a tensor lr and tensor betas where the run's step formed its scalars in them
        self.lr_dtype, self.betas_dtype = scalar_dtypes  # for_loop_scalar_dtypes
        self.has_master = p.optimizer_type != "adamw"
        self.param = param.reshape(-1)
        self.actual: dict[str, Any] = {
            f: st[f].detach().reshape(-1) for f in ("master_weight", "exp_avg", "exp_avg_sq") if f in st
        }
        self.grads = [g[p.fqn].reshape(-1) for g in grads]
        self.saved: dict[str, Any] = {
            "param": StackedSlabs([slabs(k, k) for k in p.parts], p.part_groups) if p.parts else slabs(p.key, p.key)
        }
        for f, entry in p.state.items():
            if f != "step":
                self.saved[f] = slabs(entry.key, p.key)
        self.native = self._native_constants()
        self.slab = NATIVE_SLAB if self.native is not None else REFERENCE_SLAB

    def _rtols(self) -> tuple[float, float, float, float]:
        """Effective rtol of master, ``exp_avg``, ``exp_avg_sq``, parameter (as :meth:`_compare` passes them)."""
        p = self.p
        arith = "float32" if self.has_master else p.dtype
        moments = effective_rtol(self.rtol, p.moment_dtype, arith)
        return (
            effective_rtol(self.rtol, "float32", "float32"),
            moments,
            moments,
            effective_rtol(self.rtol, p.dtype, arith),
        )

    def _native_constants(self) -> Any:
        """The one-pass kernel's constants where it applies (one step, float64, CPU tensors of its dtypes), else ``None``."""
        import torch

        from ckpttool.ops.replay.kernel import KINDS, constants, slab_kernel

        if self.steps != 1 or self.ref_dtype != torch.float64 or slab_kernel() is None:
            return None
        if self.fp16_moments:  # FP16 moments: rounded, their underflow allowed for (the torch path)
            return None
        if self.has_master and "master_weight" not in self.actual:
            return None
        live = [self.param, self.grads[0], *self.actual.values()]
        if any(t.device.type != "cpu" or not t.is_contiguous() or str(t.dtype)[6:] not in KINDS for t in live):
            return None
        saved = [s.dtype for s in self.saved.values()]
        if self.saved["param"].dtype != self.p.dtype or str(self.param.dtype)[6:] != self.p.dtype:
            return None
        if any(d not in KINDS for d in saved):
            return None
        return constants(self.p.hyper, self.r.step_before, self.atol, self._rtols(), self.lr_dtype, self.betas_dtype)

    def _read(self, field: str, a: int, b: int) -> Any:
        import torch

        src = self.saved[field]
        return src.read(a, b, torch.empty(b - a, dtype=getattr(torch, src.dtype)))

    def run(self, bounds: tuple[int, int]) -> dict[str, Any]:
        """Reference and comparison of elements ``[a, b)``; returns the slab's partial results."""
        a, b = bounds
        if self.native is not None:
            return self._run_native(a, b)
        res: dict[str, Any] = {}
        theta, m0, v0 = self._saved_start(a, b, res)
        rs, late = self._reference(theta, m0, v0, a, b)
        res["update"] = self._update_size(theta, rs)
        res["fields"] = self._compare(a, b, rs, late, res)
        return res

    def _run_native(self, a: int, b: int) -> dict[str, Any]:
        """:meth:`run` in one native pass (``kernel.py``): the same partial results, the same bits."""
        from ckpttool.ops.replay.kernel import run_slab

        p = self.p
        saved_param = self._read("param", a, b)
        theta, sync = saved_param, None
        if self.has_master and not p.fresh:
            theta, sync = self._read("master_weight", a, b), saved_param
        m0 = v0 = None
        if not p.fresh:
            m0, v0 = self._read("exp_avg", a, b), self._read("exp_avg_sq", a, b)
        master = self.actual["master_weight"][a:b] if self.has_master else None
        tensors = [theta, sync, m0, v0, self.grads[0][a:b], master]
        tensors += [self.actual["exp_avg"][a:b], self.actual["exp_avg_sq"][a:b], self.param[a:b]]
        o = run_slab(tensors, b - a, self.native, self._rtols())
        res: dict[str, Any] = {}
        if sync is not None:
            res["sync_unequal"] = o.sync_unequal
            if o.sync_unequal:
                res["sync_diff"] = o.sync_diff
        res["update"] = o.update
        fields = {f: o.fields[f] for f in ("exp_avg", "exp_avg_sq", "param")}
        if self.has_master:
            fields = {"master_weight": o.fields["master_weight"], **fields}
            res["writeback_unequal"] = o.writeback_unequal
            res["param_vs_reference_unequal"] = o.param_vs_reference_unequal
        res["fields"] = fields
        return res

    def _update_size(self, theta: Any, rs: dict[str, Any]) -> tuple[float, float, float]:
        """``(max |update|, max |theta_before|, max |m_hat| / (sqrt(v_hat) + eps))`` of the slab (reference values)."""
        if theta.numel() == 0:
            return 0.0, 0.0, 0.0
        h = self.p.hyper
        t = self.r.step_before + self.steps
        d = float((rs["theta"] - theta.to(rs["theta"].dtype)).abs_().max().item())
        pmax = float(theta.abs().max().item())
        m_hat = rs["m"].abs() / (1 - h.beta1**t)
        v = rs["v"]
        if self.fp16_moments:  # what underflow took from v (docs/replay.md, "Update size")
            v = v + fp16_underflow_margin(t, h.beta2)
        denom = (v / (1 - h.beta2**t)).sqrt_().add_(h.eps)
        u = float(m_hat.div_(denom).max().item())
        return d, pmax, (u if u == u else math.inf)

    def _saved_start(self, a: int, b: int, res: dict[str, Any]) -> tuple[Any, Any, Any]:
        """The saved ``theta`` (master, else parameter) and moments of ``[a, b)``; checks master sync into ``res``."""
        import torch

        p = self.p
        pt = getattr(torch, p.dtype)
        saved_param = self._read("param", a, b)
        if self.has_master and not p.fresh:
            saved_master = self._read("master_weight", a, b)
            res["sync_unequal"] = count_unequal(saved_param, saved_master.to(pt))
            if res["sync_unequal"]:
                res["sync_diff"] = (saved_param.double() - saved_master.double()).abs().max().item()
            theta = saved_master
        else:
            theta = saved_param
        if p.fresh:
            mdt = getattr(torch, p.moment_dtype)
            m0, v0 = torch.zeros(b - a, dtype=mdt), torch.zeros(b - a, dtype=mdt)
        else:
            m0, v0 = self._read("exp_avg", a, b), self._read("exp_avg_sq", a, b)
        return theta, m0, v0

    def _reference(self, theta: Any, m0: Any, v0: Any, a: int, b: int) -> tuple[dict[str, Any], Any]:
        """K reference steps from the saved values; the final values, their scales and the late-step path."""
        import torch

        from ckpttool.optim_state.reference import reference_adamw_step

        p, ref = self.p, self.ref_dtype
        pt = getattr(torch, p.dtype)
        rs: dict[str, Any] = {"theta": theta.to(ref, copy=True), "m": m0.to(ref, copy=True), "v": v0.to(ref, copy=True)}
        for name in ("theta", "m", "v"):
            rs[f"scale_{name}"] = rs[name].abs()
        step, late = self.r.step_before, None
        h = p.hyper
        for k in range(self.steps):
            new_theta, m, v, step = reference_adamw_step(
                rs["theta"],
                self.grads[k][a:b],
                rs["m"],
                rs["v"],
                step,
                h.lr,
                (h.beta1, h.beta2),
                h.eps,
                h.weight_decay,
                dtype=ref,
                lr_dtype=self.lr_dtype,
                betas_dtype=self.betas_dtype,
                moment_dtype=torch.float16 if self.rounds_moments else None,
            )
            if k < self.steps - 1:  # the optimizer stores its state in these dtypes between steps
                new_theta = new_theta.to(torch.float32 if self.has_master else pt).to(ref)
                mdt = getattr(torch, p.moment_dtype)
                m, v = m.to(mdt).to(ref), v.to(mdt).to(ref)
            for name, new in (("theta", new_theta), ("m", m), ("v", v)):
                delta = (new - rs[name]).abs_()
                rs[f"scale_{name}"].add_(delta)
                if name == "theta" and k > 0:
                    late = delta if late is None else late.add_(delta)
                rs[name] = new
        return rs, late

    def _compare(self, a: int, b: int, rs: dict[str, Any], late: Any, res: dict[str, Any]) -> dict[str, FieldError]:
        """Compare the stepped values of ``[a, b)`` with the reference; bitwise write-back counts into ``res``."""
        import torch

        p = self.p
        pt = getattr(torch, p.dtype)
        param = self.param[a:b].cpu()
        arith = "float32" if self.has_master else p.dtype
        steps = self.steps

        def check(
            actual: Any, ref: str, stored: str, arithmetic: str, carried: str, late_path: Any = None, atol: float = 0.0
        ) -> FieldError:
            """``actual`` against the reference ``rs[ref]`` (its scale ``rs["scale_" + ref]``); ``carried``: the
            dtype whose per-step rounding the saved value carries; ``late_path``: the master's and param's; ``atol``:
            added to the user's."""
            return compare_field(
                actual,
                rs[ref],
                rs[f"scale_{ref}"],
                rtol=self.rtol,
                atol=self.atol + atol,
                stored=stored,
                arithmetic=arithmetic,
                late_path=late_path,
                late_rtol=2 * machine_eps(p.moment_dtype),  # used only with a late_path
                carry_rtol=2 * (steps - 1) * machine_eps(carried),
            )

        fields: dict[str, FieldError] = {}
        if self.has_master:
            master = self.actual["master_weight"][a:b].cpu()
            fields["master_weight"] = check(master, "theta", "float32", "float32", "float32", late)
            res["writeback_unequal"] = count_unequal(param, master.to(pt))
            res["param_vs_reference_unequal"] = count_unequal(param, rs["theta"].to(pt))
        # an FP16 moment below 2**-14 rounds to a multiple of 2**-24: torch's may be the reference's neighbour
        sub = FP16_SUBNORMAL * steps if self.fp16_moments else 0.0
        for f, key in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            fields[f] = check(self.actual[f][a:b].cpu(), key, p.moment_dtype, arith, p.moment_dtype, atol=sub)
        fields["param"] = check(param, "theta", p.dtype, arith, "float32" if self.has_master else p.dtype, late)
        return fields

    def finish(self, parts: list[dict[str, Any]], dev: Any) -> None:
        """Merge the slabs' results into the parameter's result and check step and placement."""
        p, r, st = self.p, self.r, self.st
        if self.has_master and not p.fresh:
            r.sync_unequal = sum(x.get("sync_unequal", 0) for x in parts)
            if r.sync_unequal:
                diff = max(x.get("sync_diff", 0.0) for x in parts)
                r.problems.append(
                    f"master_weight out of sync with the parameter before the step: {r.sync_unequal} of {p.numel} "
                    f"element(s) differ from master_weight.to({p.dtype}) (max |param - master| {diff:.3g})"
                )
        step = st.get("step")
        r.step_after = float(step.item()) if step is not None else None
        if r.step_after != r.expected_step:
            r.problems.append(f"step is {r.step_after} after the replay, expected {r.expected_step:g} (saved + steps)")
        r.placement = {"param": str(self.param.device)}
        for f in ("master_weight", "exp_avg", "exp_avg_sq", "step"):
            if f in st:
                r.placement[f] = str(st[f].device)
        order = ["master_weight", "exp_avg", "exp_avg_sq", "param"]
        for f in order:
            errs = [x["fields"][f] for x in parts if f in x["fields"]]
            if errs:
                r.fields[f] = merge_field_errors(errs)
        if self.has_master:
            r.writeback_unequal = sum(x.get("writeback_unequal", 0) for x in parts)
            if r.writeback_unequal:
                r.problems.append(
                    f"parameter differs from master_weight.to({p.dtype}) in {r.writeback_unequal} element(s) after the step"
                )
            r.param_vs_reference_unequal = sum(x.get("param_vs_reference_unequal", 0) for x in parts)
        self._check_update(parts)
        for f, err in r.fields.items():
            if not err.ok:
                r.problems.append(
                    f"{f}: {err.bad} element(s) beyond tolerance (max abs {err.max_abs:.3g}, max rel {err.max_rel:.3g}, "
                    f"rtol {err.rtol:.3g})"
                )
        r.problems[:0] = self._nonfinite_saved()  # the cause first: every later difference follows from it
        # Placement: the parameter on the device; master/moments on the CPU when offloaded, else beside it.
        want_state = "cpu" if p.offloaded else dev.type
        if self.param.device.type != dev.type:
            r.problems.append(f"parameter is on {self.param.device}, expected {dev.type}")
        for f in ("master_weight", "exp_avg", "exp_avg_sq"):
            if f in st and st[f].device.type != want_state:
                r.problems.append(
                    f"{f} is on {st[f].device}, expected {want_state}" + (" (offloaded)" if p.offloaded else "")
                )

    def _nonfinite_saved(self) -> list[str]:
        """A ``D001`` problem for each saved field (moments, master, parameter) holding NaN or infinity (``D002``
        for a negative saved ``exp_avg_sq``).

        Read again slab by slab only for a parameter that failed (``[]`` without reading for one that passes so
        far): a non-finite saved value, not the replay, is then why the master, moments and parameter differ from
        the reference (NaN never equals NaN).
        """
        import torch

        out: list[str] = []
        if not self.r.problems:
            return out
        n = self.p.numel
        for f in ("exp_avg_sq", "exp_avg", "master_weight", "param"):
            if f not in self.saved or self.saved[f].dtype not in _FLOAT_FIELDS:
                continue
            nan = inf = 0
            first: int | None = None
            for a in range(0, n, self.slab):
                t = self._read(f, a, min(a + self.slab, n))
                bad = ~torch.isfinite(t)
                if bad.any():
                    nans = int(t.isnan().sum())
                    nan, inf = nan + nans, inf + int(bad.sum()) - nans
                    if first is None:
                        first = a + int(bad.nonzero()[0, 0])
            if first is not None:
                what = ", ".join(x for x in (f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else "") if x)
                out.append(
                    f"saved {f} holds non-finite values [D001]: {what} of {n} element(s), the first at flat index "
                    f"{first}; AdamW's step from it is not finite (the differences below follow from it, not from "
                    "the replay)"
                )
            if f == "exp_avg_sq":
                out.extend(self._negative_saved(f))
        return out

    def _negative_saved(self, f: str) -> list[str]:
        """A ``D002`` problem when the saved second moment holds negative values (as ``validate --deep``).

        Adam's ``exp_avg_sq`` is a running mean of squares; the square root of a negative one is NaN, so the step
        of those elements is not finite, whatever the replay does.
        """
        n = self.p.numel
        count = 0
        lowest = 0.0
        first: int | None = None
        for a in range(0, n, self.slab):
            t = self._read(f, a, min(a + self.slab, n))
            neg = t < 0
            if neg.any():
                count += int(neg.sum())
                lowest = min(lowest, float(t[neg].min()))
                if first is None:
                    first = a + int(neg.nonzero()[0, 0])
        if first is None:
            return []
        return [
            f"saved {f} holds negative values [D002]: {count} of {n} element(s) (min {lowest:.3g}), the first at "
            f"flat index {first}; the square root of a negative second moment is NaN, so AdamW's step from it is "
            "not finite (the differences below follow from it, not from the replay)"
        ]

    def _check_update(self, parts: list[dict[str, Any]]) -> None:
        """Merge the slabs' update sizes into the result; beyond the bounds is an ``R003`` problem."""
        p, r = self.p, self.r
        if p.hyper.lr == 0:  # AdamW then moves nothing (decay included): no update to check, whatever the moments
            r.problems.append(
                "update size [R003]: the saved lr is 0, so the step moves no parameter: the replay checks the moments "
                "only, not the update a resume makes (a schedule at its start or end, or a wrong lr in the saved param "
                "group)"
            )
        if p.hyper.eps == 0:  # 0/0 = NaN wherever exp_avg_sq is 0; torch.optim.AdamW defaults to 1e-8
            r.problems.append(
                "update size [R003]: the saved eps is 0, so AdamW divides by sqrt(v_hat) alone: an element whose "
                "exp_avg_sq is 0 (a gradient always zero there) steps by 0/0 = NaN and one near 0 beyond any bound "
                "(a wrong eps in the saved param group: 1e-8 rounded to 0 in float16, a conversion bug)"
            )
        ups = [x["update"] for x in parts if "update" in x]
        if not ups:
            return
        d, pmax, u = (max(x[i] for x in ups) for i in range(3))
        t = r.step_before + self.steps
        bound = adam_ratio_bound(t, p.hyper.beta1, p.hyper.beta2, span=beta1_span(dict(p.hyper.extra)))
        # A tensor no larger than the distance its saved steps can have moved it from zero (each step moves an
        # element by at most lr * bound, with the slack) may have started at zero (biases, norm biases, LoRA B):
        # its size is the updates' own, so it is no scale to judge the next update by (as an all-zero tensor).
        # Such a tensor is of the order of lr (Adam's first step moves each element by about lr); one far smaller
        # than lr is not (a saved lr far beyond the weights' scale: judged).
        lr = abs(p.hyper.lr)
        reach = r.step_before * lr * bound * UPDATE_BOUND_SLACK
        if self.fp16_moments:  # an underflowed FP16 exp_avg_sq moved elements beyond lr * bound
            reach *= fp16_step_factor(p.hyper.beta2, p.hyper.eps)
        rel = d / pmax if pmax > 0 and not lr * UPDATE_ZERO_INIT_FLOOR <= pmax <= reach else 0.0
        r.update = UpdateSize(d, pmax, rel, u, bound)
        if r.update.ok:
            return
        why = []
        if r.update.rel_to_param > UPDATE_REL_BOUND:
            why.append(f"max |update| {d:.3g} on a tensor whose largest saved value is {pmax:.3g}")
        if u > r.update.direction_bound * UPDATE_BOUND_SLACK:
            why.append(
                f"max |m_hat|/(sqrt(v_hat)+eps) {u:.3g} (update/lr) beyond {r.update.direction_bound:.3g}, the most "
                f"Adam's moments allow at step {t:g}"
            )
        finite = math.isfinite(d) and math.isfinite(pmax)
        if not why:  # NaN compares as nothing: name the sizes themselves
            why.append(f"max |update| {d:.3g} on a tensor whose largest saved value is {pmax:.3g}")
        if u > r.update.direction_bound * UPDATE_BOUND_SLACK:
            cause = (
                "the saved moments or step cannot be Adam's own: a zeroed or stale exp_avg_sq, a reset step; run "
                "`ckpttool validate --deep`"
            )
        elif not finite:  # a saved NaN or infinity (D001, named first), not the lr
            cause = "the step from a saved non-finite value is not finite"
        else:  # the moments are Adam's: the step is lr-sized, and lr is beyond the tensor's scale
            cause = (
                f"the moments are within Adam's bound, so the saved lr {p.hyper.lr:.3g} is beyond the tensor's "
                "scale: a wrong lr in the saved param group (a scheduler or conversion bug)"
            )
        r.problems.append("update size [R003]: " + "; ".join(why) + f" ({cause})")


def _bytes_per_step(p: ParamPlan) -> int:
    """Bytes one step reads and writes per element: state read+write, gradient read, parameter write."""
    ip, im = ITEMSIZE[p.dtype], ITEMSIZE[p.moment_dtype]
    if p.optimizer_type == "adamw":
        return 2 * ip + 4 * im + ip
    return 8 + 4 * im + ip + ip
