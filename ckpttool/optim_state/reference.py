"""Independent reference AdamW step, for tests and ``ckpttool replay-step``; shares no code with the optimizers.

:func:`reference_adamw_step` writes out AdamW (Loshchilov & Hutter 2019, "Decoupled Weight
Decay Regularization", Algorithm 2) in torch's convention (``torch/optim/adamw.py``: decay
``lr * weight_decay``, bias-corrected ``m_hat / (sqrt(v_hat) + eps)``); with ``via="torch"`` it
runs one for-loop ``torch.optim.AdamW`` step on clones instead. Both compute in ``dtype``
(float64 by default), never mutate their inputs and return new tensors.
``docs/optim_state.md``, "Arithmetic".
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["reference_adamw_step", "tensor_lr_scalars"]


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"reference dtype must be float32 or float64, got {dtype}")


def tensor_lr_scalars(
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    t: float,
    lr_dtype: torch.dtype | None,
    betas_dtype: torch.dtype | None = None,
) -> tuple[float, float, float, float]:
    """``(1 - lr * weight_decay, lr, 1 - beta1**t, 1 - beta2**t)`` of step ``t``, as a for-loop ``torch.optim.AdamW``
    forms them from an ``lr`` saved as a tensor of ``lr_dtype`` and betas saved as tensors of ``betas_dtype``
    (``None``: floats, unrounded).

    torch computes ``1 - lr * weight_decay`` in the ``lr``'s dtype, ``1 - beta**t`` and ``sqrt(1 - beta2**t)`` in the
    betas' dtype (BF16: 8 bits) and the step size ``lr / (1 - beta1**t)`` in the promoted dtype of the two (BF16 lr,
    FP32 betas: FP32). The returned ``lr`` is that rounded step size times the returned ``1 - beta1**t``, and the
    returned ``1 - beta2**t`` the square of the rounded ``sqrt(1 - beta2**t)``, so the formula takes the run's values.
    """
    beta1, beta2 = betas
    bias_correction1, bias_correction2 = 1.0 - beta1**t, 1.0 - beta2**t
    if lr_dtype is None and betas_dtype is None:
        return 1.0 - lr * weight_decay, lr, bias_correction1, bias_correction2
    lr_t = lr if lr_dtype is None else torch.tensor(lr, dtype=lr_dtype)
    if betas_dtype is None:
        step_size, bc2_sqrt = lr_t / bias_correction1, bias_correction2**0.5
    else:
        b1, b2 = torch.tensor(beta1, dtype=betas_dtype), torch.tensor(beta2, dtype=betas_dtype)
        step_size, bc2_sqrt = lr_t / (1 - b1**t), (1 - b2**t) ** 0.5
    return float(1 - lr_t * weight_decay), float(step_size) * bias_correction1, bias_correction1, float(bc2_sqrt) ** 2


def reference_adamw_step(
    master_fp32: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    dtype: torch.dtype = torch.float64,
    *,
    via: Literal["formula", "torch"] = "formula",
    lr_dtype: torch.dtype | None = None,
    betas_dtype: torch.dtype | None = None,
    moment_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One AdamW step from the formula (or, ``via="torch"``, by ``torch.optim.AdamW``), on widened clones.

    Args:
        master_fp32: weights before the step, any shape ``S`` (float32 master, or any float dtype).
        grad: gradient, shape ``S`` (any float dtype).
        exp_avg: first moment before the step, shape ``S`` (any float dtype, e.g. bf16 as saved).
        exp_avg_sq: second moment before the step, shape ``S``.
        step: steps taken before this one (the saved ``step`` value; a 0-d tensor is accepted).
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: denominator term.
        weight_decay: decoupled weight decay coefficient (scaled by ``lr``, as in torch).
        dtype: compute and result dtype, ``torch.float64`` (default) or ``torch.float32``.
        via: ``"formula"`` (the written-out step) or ``"torch"`` (one ``torch.optim.AdamW`` step,
            ``foreach=False``, ``fused=False``: the formula's cross-check).
        lr_dtype: the dtype of an ``lr`` the run passed as a tensor to a for-loop step (formula only):
            :func:`tensor_lr_scalars`; ``betas_dtype``: that of betas it passed as tensors, likewise.
        moment_dtype: the dtype the run stores the moments in, where its step rounds them to it between the moment
            update and the parameter update (formula only; ``torch.float16``: torch's FP16 moments, whose underflow
            to subnormals and zero changes the update; ``None``: unrounded). The returned moments are the rounded
            ones.

    Returns:
        ``(new_master, new_exp_avg, new_exp_avg_sq, new_step)``: three new tensors of shape
        ``S`` and dtype ``dtype`` on the input's device, and ``step + 1`` as a float.

    Raises:
        ValueError: shapes differ or ``dtype`` is not float32/float64.
    """
    _check_dtype(dtype)
    if not (master_fp32.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
        raise ValueError(
            f"shape mismatch: master {list(master_fp32.shape)}, grad {list(grad.shape)}, "
            f"exp_avg {list(exp_avg.shape)}, exp_avg_sq {list(exp_avg_sq.shape)}"
        )
    beta1, beta2 = float(betas[0]), float(betas[1])
    theta, g, m, v = (x.detach().to(dtype=dtype, copy=True) for x in (master_fp32, grad, exp_avg, exp_avg_sq))
    if via == "torch":
        p = torch.nn.Parameter(theta)
        p.grad = g
        opt = torch.optim.AdamW(
            [p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, foreach=False, fused=False
        )
        opt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v}
        opt.step()
        state = opt.state[p]
        return p.detach(), state["exp_avg"], state["exp_avg_sq"], float(state["step"].item())
    t = float(step) + 1.0
    decay, lr, bias_correction1, bias_correction2 = tensor_lr_scalars(
        lr, weight_decay, (beta1, beta2), t, lr_dtype, betas_dtype
    )
    theta = theta * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    if moment_dtype is not None:  # the moments as the run stores them, which its parameter update reads
        m, v = m.to(moment_dtype).to(dtype), v.to(moment_dtype).to(dtype)
    m_hat = m / bias_correction1
    v_hat = v / bias_correction2
    theta = theta - lr * m_hat / (torch.sqrt(v_hat) + eps)
    return theta, m, v, t
