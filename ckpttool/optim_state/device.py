"""Accelerator helpers: the one place that talks to device-specific runtime APIs.

Everything here goes through the device-agnostic ``torch.accelerator`` API and the
generic ``torch.Stream`` / ``torch.Event`` classes, so the same code drives CUDA,
Ascend NPU (``torch_npu`` registers itself as the accelerator) or any other
backend torch exposes that way. No ``torch.cuda.*`` call exists outside this module
(and none inside it either).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

__all__ = [
    "accelerator_type",
    "is_accelerator",
    "pinned_empty",
    "TransferStream",
]

logger = logging.getLogger(__name__)


def accelerator_type() -> str | None:
    """Device type of the current accelerator (``"cuda"``, ``"npu"``, ...), or ``None`` without one."""
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


def is_accelerator(device: torch.device | str) -> bool:
    """True for a device that is neither ``cpu`` nor ``meta`` (its memory needs explicit transfers).

    Args:
        device: a ``torch.device`` or device string such as ``"cuda:0"``.
    """
    return torch.device(device).type not in ("cpu", "meta")


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Uninitialized page-locked host buffer of ``nbytes`` bytes (``uint8``, 1-d).

    Falls back to ordinary host memory when no accelerator is present (pinning needs one).

    Args:
        nbytes: buffer size in bytes, >= 0.

    Returns:
        A ``uint8`` tensor of shape ``[nbytes]`` on the CPU.
    """
    pin = torch.accelerator.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class TransferStream:
    """A side stream for host<->device copies on one accelerator device, with event helpers.

    Copies issued inside :meth:`active` are enqueued on the side stream; the caller
    records an event after them (:meth:`record`) and waits on it from the host
    (``event.synchronize()``) before touching the host buffer again.

    Args:
        device: the accelerator device (``torch.device("cuda", 0)``, ``"npu:0"``, ...).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if not is_accelerator(self.device):
            raise ValueError(f"TransferStream needs an accelerator device, got {self.device}")
        self.stream = torch.Stream(device=self.device)

    def current(self) -> torch.Stream:
        """The device's current (compute) stream."""
        return torch.accelerator.current_stream(self.device)

    def wait_for_compute(self) -> None:
        """Order later side-stream work after everything already queued on the compute stream."""
        self.stream.wait_stream(self.current())

    def compute_waits(self) -> None:
        """Order later compute-stream work after everything queued on the side stream."""
        self.current().wait_stream(self.stream)

    @contextlib.contextmanager
    def active(self) -> Iterator[torch.Stream]:
        """Make the side stream current for the duration of the block."""
        previous = self.current()
        torch.accelerator.set_stream(self.stream)
        try:
            yield self.stream
        finally:
            torch.accelerator.set_stream(previous)

    def record(self) -> torch.Event:
        """Record and return an event at the side stream's current position."""
        event = torch.Event(device=self.device)
        event.record(self.stream)
        return event
