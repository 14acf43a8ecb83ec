"""FP32-master AdamW optimizers: ``FullFP32AdamW`` and ``MasterFP32AdamW``.

State per parameter: ``step`` (0-d float32, CPU), ``master_weight`` (float32, the parameter's
shape), ``exp_avg``/``exp_avg_sq`` (the moment dtype); for an FSDP2 ``DTensor`` parameter every
non-``step`` field is a ``DTensor`` with its mesh and placements. The update is AdamW with
decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2) in torch's convention
(``torch/optim/adam.py::_multi_tensor_adam``'s op sequence) on the FP32 master, then
``param = master.to(param.dtype)`` (round to nearest even); ``fused=True`` runs
``torch._fused_adamw_`` instead, bitwise equal to ``torch.optim.AdamW(fused=True)`` on the
masters; there a contiguous FP32 parameter is its own master (no copy, the bytes of torch's
fused step; ``state_dict`` gives that master as a copy). ``load_state_dict`` checks every saved field's presence, dtype and shape before
anything is cast or moved (:class:`~ckpttool.errors.OptimStateError`). Details:
``docs/optim_state.md`` ("State schema", "Arithmetic").
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import torch
from torch.distributed.tensor import DTensor

from ckpttool.errors import OptimStateError, UsageError
from ckpttool.format.metadata import dtype_name
from ckpttool.optim_state.onepass import NativeCall, StepChunk, native_call, run_native

if TYPE_CHECKING:  # Unpack of a TypedDict in **kwargs: typing 3.11+
    from typing_extensions import Unpack

__all__ = ["AdamWArgs", "FullFP32AdamW", "MasterFP32AdamW", "MasterAdamWBase", "FUSED_CHUNK"]

logger = logging.getLogger(__name__)

_F32 = torch.float32
_ALLOWED_MOMENT_DTYPES = (torch.float32, torch.bfloat16)

#: Elements per chunk of the fused CPU step: master, gradient, moments and parameter chunks
#: (~5 MiB together for FP32) stay in the CPU cache between the update and the rounding copy.
FUSED_CHUNK = 1 << 18


class AdamWArgs(TypedDict, total=False):
    """The keywords a subclass of :class:`MasterAdamWBase` passes on to it unchanged: the
    hyperparameters and the implementation switch (defaults and ranges in its docstring)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    foreach: bool | None
    fused: bool | None


@dataclass(frozen=True)
class AdamWHyper:
    """The hyperparameters of one param group's step, as the kernels take them (Python floats)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of_group(cls, group: Mapping[str, Any]) -> AdamWHyper:
        """The hyperparameters of a param group (``lr`` a float or a 0-d tensor, ``betas`` a pair)."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        beta1, beta2 = group["betas"]
        return cls(float(lr), beta1, beta2, group["eps"], group["weight_decay"])

    def fused_adamw_(
        self,
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        """``torch._fused_adamw_`` over float32 lists with these hyperparameters (decoupled weight decay)."""
        torch._fused_adamw_(
            masters,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            **vars(self),  # the fields are the kernel's keyword names: lr, beta1, beta2, eps, weight_decay
            amsgrad=False,
            maximize=False,
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _as_dtype(value: Any, what: str) -> torch.dtype:
    dtype: torch.dtype | None
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = getattr(torch, dtype_name(value), None)
    if dtype not in _ALLOWED_MOMENT_DTYPES:
        raise UsageError(
            f"{what} must be float32 or bfloat16, got {value!r}",
            hint="set the moment dtype to float32 or bfloat16",
        )
    return dtype


def _wrap_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Wrap ``local`` as a DTensor with ``param``'s mesh and placements (identity for plain params)."""
    if not isinstance(param, DTensor):
        return local
    mesh = param.device_mesh
    if local.device.type == mesh.device_type:
        return DTensor.from_local(
            local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    # DTensor.from_local would move a CPU local tensor onto the mesh's accelerator; build the
    # DTensor the way FSDP2's CPU offload does (torch/distributed/fsdp/_fully_shard/_fsdp_common.py).
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(param.placements), tensor_meta=TensorMeta(param.shape, param.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]  # torch: untyped DTensor.__init__


@dataclass
class _Bucket:
    """The local tensors of a param group's parameters on one device with one moment dtype, a list per field."""

    masters: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avgs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    steps: list[torch.Tensor] = dataclasses.field(default_factory=list)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)


def _adamw_foreach_(bucket: _Bucket, hyper: AdamWHyper) -> None:
    """One in-place AdamW step over lists of local tensors on one device.

    The op sequence is ``torch/optim/adam.py::_multi_tensor_adam`` (non-capturable,
    decoupled weight decay), applied to the FP32 masters.

    Args:
        bucket: ``masters`` (float32, updated in place), ``grads`` of the same shapes (any floating
            dtype; widened to float32), ``exp_avgs``/``exp_avg_sqs`` (float32 or bfloat16, updated in
            place), ``steps`` (0-d float32 CPU tensors, incremented in place); ``params`` unused.
        hyper: the param group's hyperparameters.
    """
    masters, exp_avgs, exp_avg_sqs, steps = bucket.masters, bucket.exp_avgs, bucket.exp_avg_sqs, bucket.steps
    if not masters:
        return
    torch._foreach_add_(steps, 1.0)
    g32, m32, v32 = _widened(bucket.grads, exp_avgs, exp_avg_sqs)
    lr, beta1, beta2, eps, weight_decay = hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay
    if weight_decay != 0:
        torch._foreach_mul_(masters, 1 - lr * weight_decay)
    torch._foreach_lerp_(m32, g32, 1 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, 1 - beta2)
    del g32
    step_values = [s.item() for s in steps]
    step_size = [(lr / (1 - beta1**s)) * -1 for s in step_values]
    bias_correction2_sqrt = [(1 - beta2**s) ** 0.5 for s in step_values]
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(masters, m32, denom, step_size)
    del denom
    _store_moments(exp_avgs, exp_avg_sqs, m32, v32)


def _widened(
    grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``(grads, exp_avgs, exp_avg_sqs)`` as float32 lists: the inputs where already float32, else copies."""
    g32 = [g if g.dtype == _F32 else g.to(_F32) for g in grads]
    widen = exp_avgs[0].dtype != _F32
    m32 = [m.to(_F32) for m in exp_avgs] if widen else exp_avgs
    v32 = [v.to(_F32) for v in exp_avg_sqs] if widen else exp_avg_sqs
    return g32, m32, v32


def _store_moments(
    exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], m32: list[torch.Tensor], v32: list[torch.Tensor]
) -> None:
    """Round the updated float32 moments back into narrower saved moments (nothing when they were float32)."""
    if m32 is not exp_avgs:
        torch._foreach_copy_(exp_avgs, m32)
        torch._foreach_copy_(exp_avg_sqs, v32)


def adamw_chunk_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
    *,
    step_size: float,
    bias_correction2_sqrt: float,
) -> None:
    """The AdamW update of :func:`_adamw_foreach_` on one 1-d chunk (step already incremented).

    Args:
        master: float32 chunk ``[n]``, updated in place.
        grad: gradient chunk ``[n]`` (any floating dtype).
        exp_avg, exp_avg_sq: moment chunks ``[n]`` (float32 or bfloat16), updated in place.
        hyper: the param group's hyperparameters.
        step_size: ``-(lr / (1 - beta1**step))``.
        bias_correction2_sqrt: ``(1 - beta2**step) ** 0.5``.
    """
    g = grad if grad.dtype == _F32 else grad.to(_F32)
    widen = exp_avg.dtype != _F32
    m = exp_avg.to(_F32) if widen else exp_avg
    v = exp_avg_sq.to(_F32) if widen else exp_avg_sq
    if hyper.weight_decay != 0:
        master.mul_(1 - hyper.lr * hyper.weight_decay)
    m.lerp_(g, 1 - hyper.beta1)
    v.mul_(hyper.beta2)
    v.addcmul_(g, g, value=1 - hyper.beta2)
    denom = v.sqrt()
    denom.div_(bias_correction2_sqrt)
    denom.add_(hyper.eps)
    master.addcdiv_(m, denom, value=step_size)
    if widen:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


class FusedScratch:
    """FP32 scratch chunks of the fused CPU step (widened gradient and moments), grown on demand."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._workers: dict[int, FusedScratch] = {}

    def get(self, name: str, n: int) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self._bufs[name] = torch.empty(n, dtype=_F32)
        return buf[:n]

    def worker(self, k: int) -> FusedScratch:
        """The scratch of worker ``k`` of a parallel chunk loop (its own buffers)."""
        if k not in self._workers:
            self._workers[k] = FusedScratch()
        return self._workers[k]


def _fused_chunks_(chunks: list[StepChunk], scratch: FusedScratch, hyper: AdamWHyper) -> None:
    """:func:`fused_adamw_chunk_` over ``chunks``, split over ``torch.get_num_threads()`` pool threads.

    Each thread runs its share of the chunks with one intra-op thread, so a step is one fork-join
    rather than one per op and chunk (on a machine with more runnable threads than cores, a
    barrier per 256K-element op costs up to a scheduler time slice). Chunks are independent
    elementwise updates: the result does not depend on the split.
    """
    threads = min(torch.get_num_threads(), len(chunks))
    if threads <= 1:
        for c in chunks:
            fused_adamw_chunk_(c, scratch, hyper)
        return
    from ckpttool.engine.pool import map_ordered

    per = -(-len(chunks) // threads)

    def run(k: int) -> None:
        prev = torch.get_num_threads()
        torch.set_num_threads(1)  # this thread's intra-op setting (torch keeps it per thread)
        try:
            with torch.no_grad():  # grad mode is per thread: the step's parameter chunks are no-grad views
                for c in chunks[k * per : (k + 1) * per]:
                    fused_adamw_chunk_(c, scratch.worker(k), hyper)
        finally:
            torch.set_num_threads(prev)

    map_ordered(run, range(-(-len(chunks) // per)), workers=threads)


def fused_adamw_chunk_(chunk: StepChunk, scratch: FusedScratch, hyper: AdamWHyper) -> None:
    """One fused AdamW update (``torch._fused_adamw_``) of 1-d CPU chunks; ``step`` already incremented.

    Args:
        chunk: ``master`` float32 ``[n]``, updated in place; ``grad`` ``[n]`` (float32, or any floating
            dtype: widened into ``scratch``); ``exp_avg``, ``exp_avg_sq`` ``[n]`` (float32, or bfloat16:
            widened and stored back rounded); ``step`` the parameter's 0-d float32 step (the kernel reads
            it for the bias corrections); ``param`` ``[n]`` to receive ``master.to(param.dtype)``, or ``None``.
        scratch: buffers for widened chunks.
        hyper: the param group's hyperparameters.
    """
    call = native_call(chunk, hyper)
    if call is not None:
        call.run(0, call.n)
        return
    master, grad, exp_avg, exp_avg_sq, step, param = chunk
    n = master.numel()
    g = grad if grad.dtype == _F32 else scratch.get("grad", n).copy_(grad)
    widen = exp_avg.dtype != _F32
    m = scratch.get("exp_avg", n).copy_(exp_avg) if widen else exp_avg
    v = scratch.get("exp_avg_sq", n).copy_(exp_avg_sq) if widen else exp_avg_sq
    hyper.fused_adamw_([master], [g], [m], [v], [step])
    if widen:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if param is not None:
        param.copy_(master)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (same pointer, dtype, shape, strides)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _adamw_fused_(bucket: _Bucket, scratch: FusedScratch, hyper: AdamWHyper) -> None:
    """The fused step over lists of local tensors on one device, parameters written (see the module docstring).

    A master that is its parameter (:func:`_aliases`: FP32 parameters, see
    :meth:`MasterAdamWBase._fused_master`) is updated in place and not copied; on the CPU,
    those with FP32 gradients and moments go to one ``torch._fused_adamw_`` call over their
    whole tensors (the bytes of ``torch.optim.AdamW(fused=True)``), the others go to the native
    one-pass kernel (``optim_state/onepass.py``) or, where it does not apply, are walked in
    ``FUSED_CHUNK`` chunks.

    Args:
        bucket: as for :func:`_adamw_foreach_`; its ``params`` receive ``master.to(param.dtype)``.
        scratch: buffers for widened chunks (CPU).
        hyper: the param group's hyperparameters.
    """
    b = bucket
    if not b.masters:
        return
    torch._foreach_add_(b.steps, 1.0)
    aliased = [_aliases(m, p) for m, p in zip(b.masters, b.params)]
    if b.masters[0].device.type != "cpu":
        g32, m32, v32 = _widened(b.grads, b.exp_avgs, b.exp_avg_sqs)
        dev_steps = [s.to(b.masters[0].device) for s in b.steps]  # the device kernel reads its steps on the device
        hyper.fused_adamw_(b.masters, g32, m32, v32, dev_steps)
        _store_moments(b.exp_avgs, b.exp_avg_sqs, m32, v32)
        copied = [i for i, a in enumerate(aliased) if not a]
        if copied:
            torch._foreach_copy_([b.params[i] for i in copied], [b.masters[i] for i in copied])
        return
    whole = [i for i, a in enumerate(aliased) if a and b.grads[i].dtype == _F32 and b.exp_avgs[i].dtype == _F32]
    if whole:
        fields = (b.masters, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps)
        hyper.fused_adamw_(*([f[i] for i in whole] for f in fields))
    chunks, calls, copies = _cpu_work(b, aliased, set(whole), hyper)
    run_native(calls, torch.get_num_threads())
    _fused_chunks_(chunks, scratch, hyper)
    for param, master in copies:
        param.copy_(master)


def _cpu_work(
    b: _Bucket, aliased: list[bool], done: set[int], hyper: AdamWHyper
) -> tuple[list[StepChunk], list[NativeCall], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The fused CPU step's work for the parameters of ``b`` not in ``done``.

    Returns:
        ``(chunks, calls, copies)``: ``FUSED_CHUNK`` chunks for torch's kernel, one native
        one-pass call per parameter where it applies (:func:`native_call`), and the
        ``(param, master)`` pairs of non-contiguous parameters, written after the update.
    """
    chunks: list[StepChunk] = []
    calls: list[NativeCall] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, (master, grad, m, v, step, param) in enumerate(
        zip(b.masters, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps, b.params)
    ):
        if i in done:
            continue
        mf, gf, ef, vf = (t.reshape(-1) for t in (master, grad, m, v))
        pf = param.view(-1) if param.is_contiguous() and not aliased[i] else None
        if pf is None and not aliased[i]:
            copies.append((param, master))
        call = native_call(StepChunk(mf, gf, ef, vf, step, pf), hyper)
        if call is not None:
            calls.append(call)
            continue
        n = mf.numel()
        for a in range(0, n, FUSED_CHUNK):
            e = min(n, a + FUSED_CHUNK)
            chunks.append(StepChunk(mf[a:e], gf[a:e], ef[a:e], vf[a:e], step, pf[a:e] if pf is not None else None))
    return chunks, calls, copies


class MasterAdamWBase(torch.optim.Optimizer):
    """Common machinery of the FP32-master AdamW variants (not used directly).

    Subclasses choose the moment dtype and the state placement per parameter
    (:meth:`moment_dtype`, :meth:`offloaded`); offloaded parameters go through
    :meth:`_step_offloaded`, which subclasses implement.

    Args:
        params: parameters, ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``)
            or param-group dicts, as for any ``torch.optim.Optimizer``.
        lr: learning rate, >= 0. Default ``1e-3``.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``. Default ``(0.9, 0.999)``.
        eps: added to the denominator, >= 0. Default ``1e-8``.
        weight_decay: decoupled weight decay coefficient, >= 0. Default ``1e-2``.
        foreach: use the ``torch._foreach_*`` step (the default; ``False`` is refused: there is
            no per-tensor loop implementation).
        fused: use torch's fused AdamW kernel (``torch._fused_adamw_``), like
            ``torch.optim.AdamW(fused=True)``. Not serialized in the state dict (a property of
            the run, recorded in the layout record's ``optimizer.fused``).

    Raises:
        UsageError: a hyperparameter out of range, a tensor ``lr``, ``fused`` and ``foreach`` both set.
    """

    type_name: ClassVar[str] = ""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        _check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if fused and foreach:
            raise UsageError(
                "`fused` and `foreach` cannot both be True", hint="choose one implementation, as for torch"
            )
        if foreach is False and not fused:
            raise UsageError(
                "`foreach` False: there is no per-tensor loop implementation",
                hint="use the default foreach step, or fused=True",
            )
        self.fused = bool(fused)
        self._fused_scratch = FusedScratch()
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group after checking its hyperparameters (see ``torch.optim.Optimizer``)."""
        hyper = {k: param_group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in param_group}
        _check_hyper(**hyper)
        super().add_param_group(param_group)

    # ----------------------------------------------------------------- policy
    def moment_dtype(self, param: torch.Tensor) -> torch.dtype:
        """Dtype of ``exp_avg``/``exp_avg_sq`` for ``param``."""
        raise NotImplementedError

    def offloaded(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s master and moments live in host memory and update on the CPU."""
        return False

    def state_device(self, param: torch.Tensor) -> torch.device:
        """Device of ``param``'s ``master_weight`` and moments."""
        return torch.device("cpu") if self.offloaded(param) else _local(param).device

    def expected_state_dtypes(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        """``{field: dtype}`` this optimizer saves for ``param`` (see ``schema.expected_state_dtypes``)."""
        mdt = self.moment_dtype(param)
        return {"step": _F32, "master_weight": _F32, "exp_avg": mdt, "exp_avg_sq": mdt}

    def param_name(self, param: torch.Tensor) -> str | None:
        """The name given for ``param`` (``param_names`` of its group), if any."""
        for group in self.param_groups:
            names = group.get("param_names")
            if names is None:
                continue
            for p, name in zip(group["params"], names):
                if p is param:
                    return str(name)
        return None

    # ------------------------------------------------------------------ state
    def _init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        device = self.state_device(param)
        mdt = self.moment_dtype(param)
        local = _local(param).detach()
        master = local.to(device=device, dtype=_F32, copy=True)
        state = {
            "step": torch.zeros((), dtype=_F32),
            "master_weight": _wrap_like(param, master),
            "exp_avg": _wrap_like(param, torch.zeros(local.shape, dtype=mdt, device=device)),
            "exp_avg_sq": _wrap_like(param, torch.zeros(local.shape, dtype=mdt, device=device)),
        }
        return state

    def state_template(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Freshly initialized state for ``param`` (not installed): a DCP load target.

        Returns:
            ``{"step": 0-d f32, "master_weight": f32 copy of the parameter, "exp_avg", "exp_avg_sq": zeros}``
            with this optimizer's dtypes and placement (DTensors for DTensor parameters).
        """
        return self._init_state(param)

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimizer step over every parameter that has a gradient.

        Args:
            closure: optional callable re-evaluating the model and returning the loss.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            UsageError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        hyper = AdamWHyper.of_group(group)
        buckets: dict[tuple[Any, ...], _Bucket] = defaultdict(_Bucket)
        offloaded: list[torch.Tensor] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise UsageError(f"{type(self).__name__} does not support sparse gradients", hint="use dense gradients")
            state = self.state.get(p)
            if not state:
                self.state[p] = state = self._init_state(p)
            if self.offloaded(p):
                offloaded.append(p)
                continue
            master = self._fused_master(p, state) if self.fused else _local(state["master_weight"])
            key = (master.device, state["exp_avg"].dtype)
            bucket = buckets[key]
            bucket.masters.append(master)
            bucket.grads.append(_local(p.grad))
            bucket.exp_avgs.append(_local(state["exp_avg"]))
            bucket.exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            bucket.steps.append(state["step"])
            bucket.params.append(_local(p))
        for bucket in buckets.values():
            if self.fused:
                _adamw_fused_(bucket, self._fused_scratch, hyper)
            else:
                _adamw_foreach_(bucket, hyper)
                torch._foreach_copy_(bucket.params, bucket.masters)
        if offloaded:
            self._step_offloaded(offloaded, hyper)

    @staticmethod
    def _fused_master(param: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The local master the fused step updates: for an FP32 parameter, the parameter itself.

        A contiguous FP32 parameter on its master's device holds the master's values after
        every step, so the fused step keeps one copy, as ``torch.optim.AdamW`` does: the first
        fused step after the state was created or loaded copies the master into the parameter
        and makes ``state["master_weight"]`` the parameter's detached alias; the kernel then
        updates the parameter in place. Other parameters keep their own master.
        """
        master = _local(state["master_weight"])
        local = _local(param)
        if local.dtype != _F32 or local.device != master.device or not local.is_contiguous():
            return master
        if not _aliases(master, local):
            local.copy_(master)
            state["master_weight"] = param.detach()
        return local

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``; a master that is its parameter is given as a copy.

        See :meth:`_fused_master`: with the copy, a ``dcp.load`` into this state dict writes the
        saved master into the copy, not into the model's parameter (the parameter receives the
        loaded master at the next step, as for any other parameter).
        """
        sd = super().state_dict()
        index = {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}
        for p, st in self.state.items():
            master = st.get("master_weight")
            if isinstance(master, torch.Tensor) and _aliases(_local(master), _local(p)) and id(p) in index:
                i = index[id(p)]
                sd["state"][i] = {**sd["state"][i], "master_weight": master.clone()}
        return sd

    def _step_offloaded(self, params: list[torch.Tensor], hyper: AdamWHyper) -> None:
        raise NotImplementedError(f"{type(self).__name__} offloads no parameter")

    # ------------------------------------------------------------- load state
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state and hyperparameters after checking saved dtypes and shapes.

        Accepts the ``torch.optim.Optimizer.state_dict()`` layout: ``state`` keyed by
        parameter id *or* FQN, ``param_groups`` whose ``params`` list those keys in order.
        Every field is checked against :meth:`expected_state_dtypes` (dtype) and the
        parameter's global shape (``step`` is 0-d) before anything is cast or moved;
        no dtype is ever converted. Tensors may be plain tensors or DTensors (a plain
        tensor for a DTensor parameter is sliced locally to the parameter's placement).
        A parameter absent from ``state`` (or with an empty dict) gets no state.

        Args:
            state_dict: ``{"state": {key: {field: Tensor}}, "param_groups": [...]}``.

        Raises:
            OptimStateError: unknown parameter key, missing or extra field, wrong dtype or
                shape, group count/size mismatch.
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise OptimStateError(
                "an optimizer state dict needs the keys 'state' and 'param_groups'",
                hint="pass what optimizer.state_dict() returns (see docs/optim_state.md)",
            )
        saved_groups = list(state_dict["param_groups"])
        groups = self.param_groups
        if len(saved_groups) != len(groups):
            raise OptimStateError(
                f"saved state has {len(saved_groups)} param group(s), the optimizer has {len(groups)}",
                hint="build the optimizer with the same param groups as the run that saved the state",
            )
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise OptimStateError(
                    f"param group {i}: saved {len(sg['params'])} parameter(s), the optimizer has {len(g['params'])}",
                    hint="build the optimizer with the same param groups as the run that saved the state",
                )
        id_map = dict(
            zip(
                chain.from_iterable(sg["params"] for sg in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
            )
        )
        placed: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for key, fields in state_dict["state"].items():
            if key not in id_map:
                raise OptimStateError(f"saved state for parameter {key!r} that no param group lists", fqn=str(key))
            if not fields:
                continue
            param = id_map[key]
            self._check_saved_fields(param, str(self.param_name(param) or key), fields)
            placed[param] = {f: self._place(param, f, v) for f, v in fields.items()}
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        for param, fields in placed.items():
            self.state[param] = fields

    def _check_saved_fields(self, param: torch.Tensor, name: str, fields: Mapping[str, Any]) -> None:
        expected = self.expected_state_dtypes(param)
        missing = [f for f in expected if f not in fields]
        extra = [f for f in fields if f not in expected]
        if missing or extra:
            parts = [f"{word} {', '.join(fs)}" for word, fs in (("missing", missing), ("unexpected", extra)) if fs]
            raise OptimStateError(
                f"optimizer state of {name}: {'; '.join(parts)} for {self.type_name}",
                fqn=name,
                hint=f"the state was saved by another optimizer type; {self.type_name} saves {', '.join(expected)}",
            )
        for field, dtype in expected.items():
            value = fields[field]
            if not isinstance(value, torch.Tensor):
                raise OptimStateError(
                    f"optimizer state {name}.{field} is a {type(value).__name__}, expected a {dtype_name(dtype)} tensor",
                    fqn=name,
                )
            if value.dtype != dtype:
                raise OptimStateError(
                    f"optimizer state {name}.{field} was saved as {dtype_name(value.dtype)} but {self.type_name} "
                    f"is configured for {dtype_name(dtype)}; refusing to convert it",
                    fqn=name,
                    hint="configure the optimizer with the saved moment dtype, or convert the checkpoint explicitly",
                )
            shape = torch.Size([]) if field == "step" else param.shape
            if value.shape != shape:
                raise OptimStateError(
                    f"optimizer state {name}.{field} has shape {list(value.shape)}, the parameter needs {list(shape)}",
                    fqn=name,
                    hint="the state belongs to a different model configuration",
                )

    def _place(self, param: torch.Tensor, field: str, value: torch.Tensor) -> torch.Tensor:
        if field == "step":
            return (value.full_tensor() if isinstance(value, DTensor) else value).detach().to("cpu")
        device = self.state_device(param)
        if isinstance(param, DTensor):
            if isinstance(value, DTensor):
                if tuple(value.placements) != tuple(param.placements):
                    value = value.redistribute(param.device_mesh, param.placements)
                local = value.to_local()
            else:
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(
                    value.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
            return _wrap_like(param, local.detach().to(device))
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.detach().to(device)


def _check_hyper(**hyper: Any) -> None:
    lr = hyper.get("lr")
    if lr is not None:
        if isinstance(lr, torch.Tensor):
            raise UsageError("a tensor learning rate is not supported", hint="pass lr as a Python float")
        if not lr >= 0.0:
            raise UsageError(f"invalid learning rate {lr}", hint="lr must be >= 0")
    betas = hyper.get("betas")
    if betas is not None:
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise UsageError(f"invalid betas {betas}", hint="betas must be two floats in [0, 1)")
    eps = hyper.get("eps")
    if eps is not None and not eps >= 0.0:
        raise UsageError(f"invalid eps {eps}", hint="eps must be >= 0")
    wd = hyper.get("weight_decay")
    if wd is not None and not wd >= 0.0:
        raise UsageError(f"invalid weight_decay {wd}", hint="weight_decay must be >= 0")


class FullFP32AdamW(MasterAdamWBase):
    """AdamW with an FP32 master weight and FP32 moments for parameters of any float dtype.

    State per parameter: ``step`` (0-d f32, CPU), ``master_weight`` f32, ``exp_avg`` f32,
    ``exp_avg_sq`` f32 (DTensors like the parameter under FSDP2). After each step the
    parameter receives ``master.to(param.dtype)`` (round to nearest even).

    Formula: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"
    (Algorithm 2), with bias correction and weight decay exactly as ``torch.optim.AdamW``
    (``torch/optim/adam.py::_multi_tensor_adam``); see the module docstring.

    Args:
        params: parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate. Default ``1e-3``.
        betas: ``(beta1, beta2)``. Default ``(0.9, 0.999)``.
        eps: denominator term. Default ``1e-8``.
        weight_decay: decoupled weight decay. Default ``1e-2``.
        foreach, fused: the implementation (see :class:`MasterAdamWBase`); ``fused=True`` runs
            torch's fused AdamW kernel on the FP32 masters.

    Raises:
        UsageError: a hyperparameter out of range.
    """

    type_name = "full_fp32_adamw"

    def moment_dtype(self, param: torch.Tensor) -> torch.dtype:
        return _F32


class MasterFP32AdamW(MasterAdamWBase):
    """AdamW with an FP32 master weight and moments of an explicitly configured dtype.

    Identical arithmetic to :class:`FullFP32AdamW` (moments are widened to FP32 for the
    update and stored back rounded to nearest even when ``moment_dtype`` is BF16).

    Args:
        params: parameters, ``(name, parameter)`` pairs or param-group dicts.
        moment_dtype: ``torch.bfloat16`` (default) or ``torch.float32`` (names accepted).
        **hyper: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``foreach``, ``fused`` by keyword,
            as for :class:`MasterAdamWBase` (same defaults).

    Raises:
        UsageError: a hyperparameter out of range or another moment dtype.
    """

    type_name = "master_fp32_adamw"

    def __init__(
        self, params: Iterable[Any], *, moment_dtype: torch.dtype | str = torch.bfloat16, **hyper: Unpack[AdamWArgs]
    ) -> None:
        self._moment_dtype = _as_dtype(moment_dtype, "moment_dtype")
        super().__init__(params, **hyper)

    def moment_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self._moment_dtype
