"""``CPUOffloadAdamW``: FP32-master AdamW whose selected parameters update on the CPU.

A parameter is offloaded when ``cpu_offload`` is on and one of ``cpu_offload_param_patterns``
matches its full name (``re.search``; never serialized). Offloaded master and moments live in
host memory (moments in ``cpu_moment_dtype``) and update chunk by chunk (``chunk_size``
elements) through bounded pinned staging (``num_staging_slots`` buffers per direction, a
buffer reused only after its last transfer's event); the CPU arithmetic is the resident
path's op sequence, so CPU results are bitwise identical to it. Other parameters update like
:class:`~ckpttool.optim_state.FullFP32AdamW` (moments in ``resident_moment_dtype``).
``docs/optim_state.md``, "CPU offload and staging".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ckpttool.errors import UsageError
from ckpttool.optim_state.adamw import (
    _F32,
    AdamWArgs,
    AdamWHyper,
    FusedScratch,
    MasterAdamWBase,
    _as_dtype,
    _local,
    _wrap_like,
    adamw_chunk_,
    fused_adamw_chunk_,
)
from ckpttool.optim_state.device import TransferStream, is_accelerator, pinned_empty
from ckpttool.optim_state.onepass import StepChunk

if TYPE_CHECKING:  # Unpack of a TypedDict in **kwargs: typing 3.11+
    from typing_extensions import Unpack

__all__ = ["CPUOffloadAdamW", "StagingBuffers"]

logger = logging.getLogger(__name__)

_KINDS = ("d2h", "h2d")
_FUSED_ALIGN = 64  # elements: a multiple of every CPU vector width torch's kernels use


class StagingBuffers:
    """A bounded set of pinned host buffers for chunked transfers, each guarded by an event.

    Args:
        chunk_size: elements per chunk (buffers start sized for ``chunk_size`` float32 values).
        num_slots: buffers per direction (``d2h`` gradients, ``h2d`` parameters). Default 2.
    """

    def __init__(self, chunk_size: int, num_slots: int = 2) -> None:
        self.chunk_size = chunk_size
        self.num_slots = num_slots
        self._bufs: dict[str, list[torch.Tensor | None]] = {k: [None] * num_slots for k in _KINDS}
        self._events: dict[str, list[Any]] = {k: [None] * num_slots for k in _KINDS}
        self.grow_count = 0

    def acquire(self, kind: str, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Wait until the slot's last transfer finished, then return a ``[numel]`` view of ``dtype``.

        The buffer grows (never shrinks) when it is too small, only after that wait.
        """
        event = self._events[kind][slot]
        if event is not None:
            event.synchronize()
            self._events[kind][slot] = None
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * itemsize
        buf = self._bufs[kind][slot]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, self.chunk_size * 4)
            self._bufs[kind][slot] = buf = pinned_empty(size)
            self.grow_count += 1
            logger.debug("staging %s slot %d: %d bytes", kind, slot, size)
        return buf[:nbytes].view(dtype)

    def release(self, kind: str, slot: int, event: Any) -> None:
        """Attach the event recorded after the transfer that reads/writes the slot's buffer."""
        self._events[kind][slot] = event

    def synchronize(self) -> None:
        """Wait for every outstanding transfer."""
        for kind in _KINDS:
            for slot, event in enumerate(self._events[kind]):
                if event is not None:
                    event.synchronize()
                    self._events[kind][slot] = None

    @property
    def nbytes(self) -> int:
        """Pinned bytes currently held."""
        return sum(b.numel() for k in _KINDS for b in self._bufs[k] if b is not None)


class _DirectChunks:
    """Chunk source/sink for a CPU parameter: views, no copies."""

    def __init__(self, grad_flat: torch.Tensor, param_flat: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
        self.grad_flat, self.param_flat, self.bounds = grad_flat, param_flat, bounds

    def fetch(self, idx: int) -> torch.Tensor:
        a, b = self.bounds[idx]
        return self.grad_flat[a:b]

    def store(self, idx: int, master_chunk: torch.Tensor) -> None:
        a, b = self.bounds[idx]
        self.param_flat[a:b].copy_(master_chunk)


class _StagedChunks:
    """Chunk source/sink for an accelerator parameter through pinned staging buffers."""

    def __init__(
        self,
        staging: StagingBuffers,
        stream: TransferStream,
        grad_flat: torch.Tensor,
        param_flat: torch.Tensor,
        bounds: list[tuple[int, int]],
    ) -> None:
        self.staging, self.stream = staging, stream
        self.grad_flat, self.param_flat, self.bounds = grad_flat, param_flat, bounds
        self.pending: dict[int, tuple[torch.Tensor, Any]] = {}

    def _issue(self, idx: int) -> None:
        if idx >= len(self.bounds) or idx in self.pending:
            return
        a, b = self.bounds[idx]
        slot = idx % self.staging.num_slots
        buf = self.staging.acquire("d2h", slot, b - a, self.grad_flat.dtype)
        with self.stream.active():
            buf.copy_(self.grad_flat[a:b], non_blocking=True)
            event = self.stream.record()
        self.staging.release("d2h", slot, event)
        self.pending[idx] = (buf, event)

    def fetch(self, idx: int) -> torch.Tensor:
        self._issue(idx)
        self._issue(idx + 1)  # prefetch: overlaps the next transfer with this chunk's update
        buf, event = self.pending.pop(idx)
        event.synchronize()
        return buf

    def store(self, idx: int, master_chunk: torch.Tensor) -> None:
        a, b = self.bounds[idx]
        slot = idx % self.staging.num_slots
        out = self.staging.acquire("h2d", slot, b - a, self.param_flat.dtype)
        out.copy_(master_chunk)
        with self.stream.active():
            self.param_flat[a:b].copy_(out, non_blocking=True)
            event = self.stream.record()
        self.staging.release("h2d", slot, event)


class CPUOffloadAdamW(MasterAdamWBase):
    """FP32-master AdamW that updates parameters matching ``cpu_offload_param_patterns`` on the CPU.

    State per parameter: ``step`` (0-d f32, CPU), ``master_weight`` f32, ``exp_avg`` and
    ``exp_avg_sq`` in ``cpu_moment_dtype`` (offloaded) or ``resident_moment_dtype``
    (others). Offloaded state lives in host memory; the chunked staging path is in
    ``docs/optim_state.md``, "CPU offload and staging". Same arithmetic as :class:`FullFP32AdamW` (Loshchilov & Hutter
    2019; ``torch/optim/adam.py::_multi_tensor_adam``).

    The parameters must be named: pass ``model.named_parameters()`` or groups whose
    ``params`` are ``(name, parameter)`` pairs; names are matched with ``re.search``.

    Args:
        params: ``(name, parameter)`` pairs or param-group dicts of such pairs.
        cpu_offload_param_patterns: non-empty list of regular expressions.
        resident_moment_dtype: moments of non-offloaded parameters, ``float32`` (default) or ``bfloat16``.
        cpu_moment_dtype: moments of offloaded parameters, ``float32`` (default) or ``bfloat16``.
        chunk_size: elements per staged chunk, > 0. Default ``1 << 22``.
        cpu_offload: ``False`` keeps every parameter resident (patterns unused). Default ``True``.
        num_staging_slots: pinned buffers per transfer direction, >= 1. Default 2.
        **hyper: ``lr``, ``betas``, ``eps``, ``weight_decay`` by keyword, as for
            :class:`~ckpttool.optim_state.adamw.MasterAdamWBase` (same defaults), and
            ``foreach``/``fused``, the implementation; ``fused=True`` runs torch's fused AdamW kernel on the
            host chunks of offloaded parameters (a BF16 gradient chunk widened in a scratch
            buffer; ``chunk_size`` rounded up to a multiple of 64 elements, so that the result
            does not depend on it) and on the resident parameters (see
            :class:`~ckpttool.optim_state.adamw.MasterAdamWBase`).

    Raises:
        UsageError: empty or invalid patterns, unnamed parameters, bad chunk size,
            moment dtype other than float32/bfloat16, hyperparameter out of range.
    """

    type_name = "cpu_offload_adamw"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        cpu_offload_param_patterns: Sequence[str],
        resident_moment_dtype: torch.dtype | str = torch.float32,
        cpu_moment_dtype: torch.dtype | str = torch.float32,
        chunk_size: int = 1 << 22,
        cpu_offload: bool = True,
        num_staging_slots: int = 2,
        **hyper: Unpack[AdamWArgs],
    ) -> None:
        if isinstance(cpu_offload_param_patterns, str) or not cpu_offload_param_patterns:
            raise UsageError(
                f"cpu_offload_param_patterns must be a non-empty list of regular expressions, got {cpu_offload_param_patterns!r}",
                hint='e.g. cpu_offload_param_patterns=["experts"]',
            )
        try:
            self._patterns = [re.compile(p) for p in cpu_offload_param_patterns]
        except re.error as e:
            raise UsageError(f"invalid offload pattern: {e}", hint="use Python re syntax") from e
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise UsageError(f"chunk_size must be a positive int, got {chunk_size!r}", hint="e.g. chunk_size=1<<22")
        if num_staging_slots < 1:
            raise UsageError(f"num_staging_slots must be >= 1, got {num_staging_slots}", hint="use 2")
        self.cpu_offload_param_patterns = list(cpu_offload_param_patterns)
        self.resident_moment_dtype = _as_dtype(resident_moment_dtype, "resident_moment_dtype")
        self.cpu_moment_dtype = _as_dtype(cpu_moment_dtype, "cpu_moment_dtype")
        self.chunk_size = chunk_size
        self.cpu_offload = bool(cpu_offload)
        self._offload: dict[torch.Tensor, bool] = {}
        self._staging = StagingBuffers(chunk_size, num_staging_slots)
        self._streams: dict[torch.device, TransferStream] = {}
        super().__init__(params, **hyper)
        n_off = sum(self._offload.values())
        logger.info("CPUOffloadAdamW: %d of %d parameter(s) offloaded", n_off, len(self._offload))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a named param group and decide each parameter's placement."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names")
        if names is None:
            raise UsageError(
                "CPUOffloadAdamW needs parameter names to apply cpu_offload_param_patterns",
                hint="pass model.named_parameters() or param groups of (name, parameter) pairs",
            )
        for p, name in zip(group["params"], names):
            self._offload[p] = self.cpu_offload and any(rx.search(name) for rx in self._patterns)

    def offloaded(self, param: torch.Tensor) -> bool:
        return self._offload.get(param, False)

    def moment_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.cpu_moment_dtype if self.offloaded(param) else self.resident_moment_dtype

    def offload_plan(self) -> dict[str, bool]:
        """``{parameter name: offloaded}`` for every parameter, in param-group order."""
        return {name: self._offload[p] for g in self.param_groups for p, name in zip(g["params"], g["param_names"])}

    @property
    def staging_nbytes(self) -> int:
        """Pinned staging bytes currently held (bounded by ``2 * num_staging_slots * chunk_size * 4``)."""
        return self._staging.nbytes

    def _init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        local = _local(param).detach()
        if not (self.offloaded(param) and is_accelerator(local.device)):
            return super()._init_state(param)
        host = local.to("cpu")  # same dtype first: no full-size FP32 temporary on the device
        master = host.to(_F32) if host.dtype != _F32 else host
        mdt = self.moment_dtype(param)
        return {
            "step": torch.zeros((), dtype=_F32),
            "master_weight": _wrap_like(param, master),
            "exp_avg": _wrap_like(param, torch.zeros(local.shape, dtype=mdt)),
            "exp_avg_sq": _wrap_like(param, torch.zeros(local.shape, dtype=mdt)),
        }

    def _stream(self, device: torch.device) -> TransferStream:
        stream = self._streams.get(device)
        if stream is None:
            self._streams[device] = stream = TransferStream(device)
        return stream

    def _step_offloaded(self, params: list[torch.Tensor], hyper: AdamWHyper) -> None:
        used: list[TransferStream] = []
        for p in params:
            local = _local(p)
            if not local.is_contiguous():
                raise UsageError(
                    f"CPUOffloadAdamW needs contiguous parameters; {self.param_name(p)} is not",
                    hint="make the parameter contiguous before building the optimizer",
                )
            assert p.grad is not None  # step() passes only parameters that have a gradient
            grad_flat = _local(p.grad).reshape(-1)
            param_flat = local.view(-1)
            n = param_flat.numel()
            step = self.chunk_size
            if self.fused:  # torch's fused CPU kernel rounds a chunk's scalar tail differently from its vector body:
                step = (
                    -(-step // _FUSED_ALIGN) * _FUSED_ALIGN
                )  # aligned chunks keep the result independent of chunk_size
            bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
            if is_accelerator(local.device):
                stream = self._stream(local.device)
                if stream not in used:
                    stream.wait_for_compute()  # gradients are produced on the compute stream
                    used.append(stream)
                chunks: _DirectChunks | _StagedChunks = _StagedChunks(
                    self._staging, stream, grad_flat, param_flat, bounds
                )
            else:
                chunks = _DirectChunks(grad_flat, param_flat, bounds)
            self._update_chunks(self.state[p], chunks, bounds, hyper, self._fused_scratch if self.fused else None)
        for stream in used:
            stream.compute_waits()

    @staticmethod
    def _update_chunks(
        state: dict[str, torch.Tensor],
        chunks: _DirectChunks | _StagedChunks,
        bounds: list[tuple[int, int]],
        hyper: AdamWHyper,
        fused: FusedScratch | None = None,
    ) -> None:
        state["step"].add_(1.0)
        if fused is not None:
            master = _local(state["master_weight"]).view(-1)
            exp_avg = _local(state["exp_avg"]).view(-1)
            exp_avg_sq = _local(state["exp_avg_sq"]).view(-1)
            for idx, (a, b) in enumerate(bounds):
                chunk = StepChunk(master[a:b], chunks.fetch(idx), exp_avg[a:b], exp_avg_sq[a:b], state["step"], None)
                fused_adamw_chunk_(chunk, fused, hyper)
                chunks.store(idx, master[a:b])
            return
        s = state["step"].item()
        step_size = (hyper.lr / (1 - hyper.beta1**s)) * -1
        bias_correction2_sqrt = (1 - hyper.beta2**s) ** 0.5
        master = _local(state["master_weight"]).view(-1)
        exp_avg = _local(state["exp_avg"]).view(-1)
        exp_avg_sq = _local(state["exp_avg_sq"]).view(-1)
        for idx, (a, b) in enumerate(bounds):
            grad = chunks.fetch(idx)
            adamw_chunk_(
                master[a:b],
                grad,
                exp_avg[a:b],
                exp_avg_sq[a:b],
                hyper,
                step_size=step_size,
                bias_correction2_sqrt=bias_correction2_sqrt,
            )
            chunks.store(idx, master[a:b])
