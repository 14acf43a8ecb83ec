"""Gradients for ``replay-step``: a safetensors file, or a documented deterministic generator.

Generator: ``seed_k(fqn) = zlib.crc32(f"ckpttool.replay:{grad_seed}:{k}:{fqn}".encode())``
(``k`` the step index), ``torch.randn`` of the parameter's global shape in true expert order on a
CPU generator seeded with it, times ``grad_scale``, cast to the parameter dtype: the same on
every device, run and saving mesh. File: safetensors, one tensor per parameter fqn (the
``model.`` prefix accepted), global shape in true expert order, any floating dtype, used for
every step. ``docs/replay.md``, "Gradients".
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ckpttool.errors import GradientsError, UsageError
from ckpttool.format.files import unexpanded_tilde_hint
from ckpttool.model.schemas.base import canonical_model_key

if TYPE_CHECKING:
    from typing import Protocol

    import torch

    class _SafeOpen(Protocol):
        """What :class:`GradFile` uses of a ``safetensors.safe_open`` handle (its stub leaves these unannotated)."""

        def keys(self) -> list[str]: ...

        def get_tensor(self, name: str) -> torch.Tensor: ...


__all__ = ["grad_seed_for", "seeded_grad", "GradFile"]


def grad_seed_for(fqn: str, seed: int, step_index: int = 0) -> int:
    """The 32-bit generator seed of ``fqn``'s gradient at step ``step_index`` (see module docstring)."""
    return zlib.crc32(f"ckpttool.replay:{seed}:{step_index}:{fqn}".encode())


def seeded_grad(
    fqn: str, shape: tuple[int, ...], dtype: torch.dtype, *, seed: int, scale: float, step_index: int = 0
) -> torch.Tensor:
    """Deterministic gradient of one parameter, on the CPU.

    Args:
        fqn: parameter fqn (optimizer naming, no ``model.`` prefix).
        shape: global shape (true expert order).
        dtype: parameter dtype of the result.
        seed: ``--grad-seed``.
        scale: ``--grad-scale`` (standard deviation of the FP32 normal sample).
        step_index: 0 for the first replayed step, 1 for the second, ...

    Returns:
        CPU tensor of ``shape`` and ``dtype``: ``(randn_fp32 * scale).to(dtype)``.

    Raises:
        UsageError (E100): ``scale`` makes the gradient overflow ``dtype``, or its square (``exp_avg_sq`` of the step
            would be infinite, in torch's step too): as for a gradients file (E120), the comparison could only blame
            the saved state.
    """
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(grad_seed_for(fqn, seed, step_index))
    g = torch.randn(shape, generator=gen, dtype=torch.float32)
    g.mul_(scale)
    g = g if dtype == torch.float32 else g.to(dtype)
    top = float(g.abs().max()) if g.numel() else 0.0  # NaN where a value is: not <= below
    limit = math.sqrt(torch.finfo(dtype).max)
    if not top <= limit:
        raise UsageError(
            f"`grad_scale` {scale:g} makes the generated gradient of {fqn} overflow {str(dtype).removeprefix('torch.')}"
            f"{' when squared' if math.isfinite(top) else ''} (max |g| {top:.3g}, the most a step can square "
            f"{limit:.3g}): exp_avg_sq of the step would be infinite and every parameter would fail",
            param="grad_scale",
            hint="pass a --grad-scale of the size of the run's gradients (the default 1e-3 is)",
        )
    return g


class GradFile:
    """Gradients from a safetensors file keyed by parameter fqn.

    Args:
        path: the ``.safetensors`` file.
        wrapped: the catalog's :attr:`~ckpttool.model.catalog.Catalog.wrapped` (optimizer fqn -> model fqn with
            wrapper segments): a parameter's gradient may be keyed by either name (``named_parameters()`` of a
            model whose blocks were compiled in place gives ``layers.0._orig_mod.attn.q.weight``).

    Raises:
        UsageError (E120): missing or unreadable file.
    """

    def __init__(self, path: str | os.PathLike[str], wrapped: Mapping[str, str] | None = None) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self._wrapped = wrapped or {}
        if not self.path.is_file():
            raise self._error(
                f": {'not a regular file' if os.path.lexists(self.path) else 'no such file'}",
                hint=unexpanded_tilde_hint(self.path) or "pass a safetensors file of gradients keyed by parameter fqn",
            )
        try:
            self._file = cast("_SafeOpen", safe_open(str(self.path), framework="pt", device="cpu"))
            self._keys = set(self._file.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise self._error(
                f": not a readable safetensors file ({str(e)[:80]})", hint="write it with safetensors.torch.save_file"
            ) from e

    def _error(self, says: str, *, fqn: str | None = None, hint: str | None = None) -> GradientsError:
        """The error about this file (E120, naming ``path``): its message is ``says`` after "`grads` PATH"."""
        return GradientsError(f"`grads` {self.path}{says}", path=self.path, fqn=fqn, hint=hint)

    def _key(self, fqn: str) -> str | None:
        for k in (fqn, canonical_model_key(fqn)):
            if k in self._keys:
                return k
        stored = self._wrapped.get(fqn)
        if stored is not None:
            for k in (stored, canonical_model_key(stored)):
                if k in self._keys:
                    return k
        return None

    def has(self, fqn: str) -> bool:
        """Whether the file holds a gradient for ``fqn``."""
        return self._key(fqn) is not None

    def get(self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The gradient of ``fqn``, shape-checked and cast to ``dtype`` (CPU).

        Raises:
            UsageError (E120): no gradient for ``fqn``, wrong shape, a non-floating dtype, or values that are
                not finite (after the cast).
        """
        import torch

        key = self._key(fqn)
        if key is None:
            raise self._error(
                f" has no gradient for {fqn}",
                fqn=fqn,
                hint="key every selected parameter by its fqn, or narrow the selection with `filter_glob`",
            )
        t = self._file.get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise self._error(
                f": gradient {key} has shape {list(t.shape)}, the parameter has {list(shape)}",
                fqn=fqn,
                hint="gradients must have the parameter's global shape (true expert order)",
            )
        if not t.is_floating_point():
            raise self._error(f": gradient {key} is {t.dtype}, expected a floating dtype", fqn=fqn)
        cast_to = "" if t.dtype == dtype else f" as {str(dtype).removeprefix('torch.')}"  # a cast may overflow
        t = t if t.dtype == dtype else t.to(dtype)
        # a NaN or infinite gradient makes every field NaN: the comparison could only blame the saved state
        bad = int(t.numel() - torch.isfinite(t).sum().item())
        if bad:
            raise self._error(
                f": gradient {key} holds {bad} of {t.numel()} value(s) that are not finite (NaN or infinity){cast_to}",
                fqn=fqn,
                hint="pass finite gradients (the trainer skips a step whose gradients overflow)",
            )
        # a gradient whose square overflows makes exp_avg_sq infinite (in torch's step too): the comparison could
        # only blame the saved state
        top = float(t.abs().max()) if t.numel() else 0.0
        limit = math.sqrt(torch.finfo(dtype).max)
        if top > limit:
            raise self._error(
                f": gradient {key} overflows {str(dtype).removeprefix('torch.')} when squared (max |g| {top:.3g}, "
                f"beyond {limit:.3g}){cast_to}: exp_avg_sq of the step would be infinite",
                fqn=fqn,
                hint="pass gradients of the magnitude the run's steps took (the trainer skips a step whose "
                "gradients overflow)",
            )
        return t
