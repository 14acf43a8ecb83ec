"""A small but real sample checkpoint: a tiny MoE causal LM saved with ``dcp.save``.

Parameter names of HF's ``Dots1ForCausalLM`` in the transformers v5 fused-expert layout
(``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``, shared experts,
the router buffer ``mlp.gate.e_score_correction_bias``), so the export loads with
``AutoModelForCausalLM.from_pretrained`` without missing or unexpected keys. Trained a few
AdamW steps on random tokens and saved as VeOmni-style trainers do (``model``, ``optimizer``,
``layout`` record), plus ``extra_state/extra_state_rank_0.pt`` and ``model_assets/config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import at_least
from ckpttool.ops.fields import options_of
from ckpttool.optim_state.schema import OPTIMIZER_TYPES

if TYPE_CHECKING:
    from typing import TypedDict

    class _AdamWHyper(TypedDict):
        lr: float
        betas: tuple[float, float]
        eps: float
        weight_decay: float


__all__ = [
    "SampleConfig",
    "SampleOptions",
    "SampleResult",
    "TinyMoEForCausalLM",
    "write_sample",
    "layout_record_for",
    "SAMPLE_OPTIMIZERS",
    "sample_optimizer_record",
]


@dataclass(frozen=True)
class SampleConfig:
    """Sizes of the sample model (H hidden, I expert intermediate, E experts)."""

    vocab_size: int = 128
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    moe_intermediate_size: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """A ``Dots1ForCausalLM`` ``config.json`` dict for these sizes (every layer MoE); ``torch_dtype``: ``dtype``,
        the dtype the model's tensors are saved in (HF convention)."""
        cfg = asdict(self)
        cfg["n_routed_experts"] = cfg.pop("num_experts")
        cfg.update(
            architectures=["Dots1ForCausalLM"],
            model_type="dots1",
            intermediate_size=4 * self.hidden_size,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            max_position_embeddings=256,
            torch_dtype=dtype,
        )
        return cfg


def _rms_norm_class() -> type[Any]:
    """``RMSNorm(dim, eps)``: root-mean-square norm with a learned ``weight``."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    return RMSNorm


def _attention_class(rms_norm: type[Any]) -> type[Any]:
    """``Attention(config)``: causal GQA self-attention with per-head q/k norms (``self_attn``)."""
    import torch
    from torch import nn

    RMSNorm = rms_norm

    class Attention(nn.Module):
        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            self.c = c
            h, d = c.hidden_size, c.head_dim
            self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
            self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
            self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
            self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
            self.q_norm = RMSNorm(d, c.rms_norm_eps)
            self.k_norm = RMSNorm(d, c.rms_norm_eps)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            c = self.c
            q = self.q_norm(self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim)).transpose(1, 2)
            k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
            v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            rep = c.num_attention_heads // c.num_key_value_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out: torch.Tensor = self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            return out

    return Attention


def _moe_class() -> type[Any]:
    """``SparseMoE(config)``: router (``gate``), fused ``experts`` and ``shared_experts`` (``mlp``)."""
    import torch
    from torch import nn

    class Router(nn.Module):
        e_score_correction_bias: torch.Tensor  # a registered buffer

        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(c.num_experts, c.hidden_size) * 0.02)
            self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts), persistent=True)

    class Experts(nn.Module):
        """Fused experts: gate_up_proj ``[E, 2I, H]``, down_proj ``[E, H, I]``."""

        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
            self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.02)
            self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.02)

    class SharedExpert(nn.Module):
        """The always-active expert (``mlp.shared_experts``): a SwiGLU MLP."""

        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            h, i = c.hidden_size, c.moe_intermediate_size * c.n_shared_experts
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
            return out

    class SparseMoE(nn.Module):
        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            self.c = c
            self.gate = Router(c)
            self.experts = Experts(c)
            self.shared_experts = SharedExpert(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c = self.c
            logits = x @ self.gate.weight.t()
            probs = torch.softmax(logits.float(), dim=-1)
            top_w, top_i = torch.topk(probs + self.gate.e_score_correction_bias, c.num_experts_per_tok, dim=-1)
            top_w = torch.gather(probs, -1, top_i)
            top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
            weights = torch.zeros_like(probs, dtype=x.dtype).scatter(-1, top_i, top_w)  # [..., E]
            gu = torch.einsum("bth,eih->btei", x, self.experts.gate_up_proj)  # [B,T,E,2I]
            g, u = gu.chunk(2, dim=-1)
            y = torch.einsum("btei,ehi->bteh", torch.nn.functional.silu(g) * u, self.experts.down_proj)
            shared: torch.Tensor = self.shared_experts(x)
            return (y * weights.unsqueeze(-1)).sum(2) + shared

    return SparseMoE


def _build_model_class() -> type:
    """``TinyMoEForCausalLM(config)``: the decoder layers over the attention and MoE parts."""
    import torch
    from torch import nn

    RMSNorm = _rms_norm_class()
    Attention = _attention_class(RMSNorm)
    SparseMoE = _moe_class()

    class Layer(nn.Module):
        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            self.self_attn = Attention(c)
            self.mlp = SparseMoE(c)
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(self.input_layernorm(x))
            out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
            return out

    class Backbone(nn.Module):
        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    class TinyMoEForCausalLM(nn.Module):
        """Tiny MoE causal LM with ``Dots1ForCausalLM`` parameter names."""

        def __init__(self, c: SampleConfig) -> None:
            super().__init__()
            self.config = c
            self.model = Backbone(c)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.model.embed_tokens(input_ids)
            for layer in self.model.layers:
                x = layer(x)
            logits: torch.Tensor = self.lm_head(self.model.norm(x))
            return logits

        def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
            logits = self(input_ids[:, :-1])
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1)
            )

    return TinyMoEForCausalLM


_MODEL_CLASS: type | None = None


def TinyMoEForCausalLM(config: SampleConfig | None = None) -> Any:
    """Build the tiny MoE model (``torch.nn.Module``) for ``config``."""
    global _MODEL_CLASS
    if _MODEL_CLASS is None:
        _MODEL_CLASS = _build_model_class()
    return _MODEL_CLASS(config or SampleConfig())


def layout_record_for(
    config: SampleConfig,
    *,
    ep_size: int = 1,
    ep_fsdp_size: int = 1,
    optimizer: dict[str, Any] | None = None,
    global_step: int = 0,
    version: int = 2,
    fsdp_dim: int = 0,
) -> dict[str, Any]:
    """Layout record (docs/design.md §4) for the sample model's fused expert tensors."""
    extra = {}
    for n in range(config.num_hidden_layers):
        for name in ("gate_up_proj", "down_proj"):
            extra[f"model.model.layers.{n}.mlp.experts.{name}"] = {
                "ep_dim": 0,
                "fsdp_dim": fsdp_dim,
                "num_experts": config.num_experts,
            }
    return {
        "format": "ckpttool.layout",
        "version": version,
        "parallel": {
            "ep_size": ep_size,
            "ep_fsdp_size": ep_fsdp_size,
            "ep_replicate_size": 1,
            "dp_shard_size": ep_size * ep_fsdp_size,
            "tp_size": 1,
        },
        "extra_parallel": extra,
        "optimizer": optimizer or {"type": "adamw"},
        "global_step": global_step,
    }


#: ``SampleOptions.optimizer`` choices: torch AdamW on FP32 parameters (the default), or a
#: ckpttool FP32-master optimizer on BF16 parameters (experts offloaded for cpu_offload_adamw):
#: every type of the optimizer-state schema (:data:`~ckpttool.optim_state.schema.OPTIMIZER_TYPES`).
SAMPLE_OPTIMIZERS = OPTIMIZER_TYPES


def sample_optimizer_record(optimizer: str) -> dict[str, Any]:
    """The layout record's ``optimizer`` object for a :data:`SAMPLE_OPTIMIZERS` choice."""
    if optimizer == "adamw":
        return {"type": "adamw", "fused": False}
    moments = {
        "full_fp32_adamw": {"resident": "float32"},
        "master_fp32_adamw": {"resident": "bfloat16"},
        "cpu_offload_adamw": {"resident": "float32", "cpu": "float32"},
    }[optimizer]
    out: dict[str, Any] = {
        "type": optimizer,
        "master_dtype": "float32",
        "step_dtype": "float32",
        "moment_dtypes": moments,
        "fused": False,  # the sample trains with the foreach step
    }
    if optimizer == "cpu_offload_adamw":
        out["offload_patterns"] = ["experts"]
    return out


def _sample_optimizer(model: Any, optimizer: str) -> Any:
    hyper: _AdamWHyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if optimizer == "adamw":
        import torch

        return torch.optim.AdamW(model.parameters(), **hyper)
    from ckpttool.optim_state.factory import build_optimizer

    cfg: dict[str, Any] = {}
    if optimizer == "master_fp32_adamw":
        cfg["moment_dtype"] = "bfloat16"
    if optimizer == "cpu_offload_adamw":
        cfg["cpu_offload_param_patterns"] = ["experts"]
    return build_optimizer(optimizer, list(model.named_parameters()), **hyper, **cfg)


#: ``SampleOptions.seed`` range: what ``torch.manual_seed`` and the data generator accept.
SEED_LIMIT = 2**63


class _FinalPathWriter:  # built lazily: a torch FileSystemWriter that records the final path
    cls: type | None = None

    @classmethod
    def make(cls, directory: Path, final: Path) -> Any:
        if cls.cls is None:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            class Writer(FileSystemWriter):
                """Writes into the temporary directory; ``storage_meta.checkpoint_id`` is the final path."""

                def __init__(self, path: Path, final_path: Path) -> None:
                    super().__init__(path)
                    self._final_path = final_path

                def storage_meta(self) -> Any:
                    meta = super().storage_meta()
                    if meta is not None:
                        meta.checkpoint_id = self._final_path
                    return meta

            cls.cls = Writer
        return cls.cls(directory, final)


@dataclass(frozen=True)
class SampleOptions:
    """What ``write_sample`` trains and how it writes.

    Attributes:
        steps: optimizer steps before the save.
        seed: RNG seed in ``[0, 2**63)`` (the output is deterministic for a given seed and torch).
        config: model sizes (default :class:`SampleConfig`).
        optimizer: ``adamw`` (default: ``torch.optim.AdamW``, FP32 parameters) or a ckpttool
            FP32-master type (``full_fp32_adamw``, ``master_fp32_adamw`` with BF16 moments,
            ``cpu_offload_adamw`` offloading ``experts``) with BF16 parameters; the layout
            record's ``optimizer`` object describes it.
        overwrite: replace an existing non-empty ``path`` that is provably an output of ckpttool
            (its ``.ckpttool-output.json`` agrees with its files), once the new sample is
            complete (as ``export --overwrite``); never a checkpoint ckpttool did not write.
    """

    steps: int = field(default=3, metadata=at_least(0))
    seed: int = 0
    config: SampleConfig | None = None
    optimizer: str = "adamw"
    overwrite: bool = False


@dataclass(frozen=True)
class SampleResult:
    """A written sample checkpoint.

    Attributes:
        path: the checkpoint directory (as given).
        steps, seed, optimizer: as trained.
    """

    path: Path
    steps: int
    seed: int
    optimizer: str

    def to_dict(self) -> dict[str, Any]:
        """``{"path", "steps", "seed", "optimizer"}`` (the path as a string)."""
        return {"path": str(self.path), "steps": self.steps, "seed": self.seed, "optimizer": self.optimizer}


def write_sample(path: str | os.PathLike[str], options: SampleOptions | None = None) -> SampleResult:
    """Train the tiny MoE for ``options.steps`` optimizer steps and save it as a DCP checkpoint.

    Everything (``dcp.save``, ``extra_state/``, ``model_assets/``) is written into a temporary
    sibling directory renamed into place when complete
    (:class:`~ckpttool.format.atomic.AtomicOutputDir`): a failed or interrupted run leaves nothing.

    Args:
        path: target directory; must not exist or be empty.
        options: see :class:`SampleOptions`.

    Returns:
        A :class:`SampleResult` (``path``: the checkpoint directory as given).

    Raises:
        OutputError: ``path`` exists and is not empty (without ``overwrite``), or cannot be written.
        ForeignOutputError: (E606) ``overwrite`` of a directory ckpttool did not write.
        UsageError: unknown ``optimizer``, ``seed`` out of range, ``path`` a URL (``file://`` is its local path).
    """
    from ckpttool.errors import UsageError, check_path
    from ckpttool.format.atomic import AtomicOutputDir, absolute_path
    from ckpttool.format.storage import is_url, local_path

    check_path(path, "path")
    if is_url(path):  # Path() of it was the local folder ./s3:/bucket/...
        raise UsageError(
            f"{path}: a URL; sample writes a local directory",
            path=path,
            hint="write the sample to a local directory, then export or reshard it to the URL",
        )
    opts = options_of(options, SampleOptions)
    steps, seed, optimizer = opts.steps, opts.seed, opts.optimizer
    if optimizer not in SAMPLE_OPTIMIZERS:
        raise UsageError(f"unknown sample optimizer {optimizer!r}", hint=f"use one of {', '.join(SAMPLE_OPTIMIZERS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"seed {seed!r} is out of range", hint=f"use an integer seed from 0 to {SEED_LIMIT - 1}")
    out = Path(local_path(path))  # file:///a/b is /a/b
    with AtomicOutputDir(out, overwrite=opts.overwrite, kind="sample") as tmp:
        _train_and_save(
            tmp,
            absolute_path(out),
            steps=steps,
            seed=seed,
            config=opts.config or SampleConfig(),
            optimizer=optimizer,
        )
    return SampleResult(out, steps, seed, optimizer)


def _train_and_save(tmp: Path, final: Path, *, steps: int, seed: int, config: SampleConfig, optimizer: str) -> None:
    import warnings

    from ckpttool.errors import OutputError
    from ckpttool.format.atomic import signals_deferred

    # A Ctrl-C inside torch.distributed's C++ initialisation (pybind11 running Python) aborts the process
    # (SIGABRT, the temporary output left behind): held until the imports end, then raised as any interrupt.
    with signals_deferred():
        import torch
        import torch.distributed.checkpoint.state_dict_saver as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

    c = config
    torch.manual_seed(seed)
    model = TinyMoEForCausalLM(c)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.01, 0.01, c.num_experts))
    if optimizer != "adamw":
        model.to(torch.bfloat16)
    optim = _sample_optimizer(model, optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ids = torch.randint(0, c.vocab_size, (2, 16), generator=gen)
        optim.zero_grad(set_to_none=True)
        model.loss(ids).backward()
        optim.step()
        sched.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    record = layout_record_for(c, optimizer=sample_optimizer_record(optimizer), global_step=steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(
                {"model": model_sd, "optimizer": optim_sd, "layout": json.dumps(record)},
                storage_writer=_FinalPathWriter.make(tmp, final),
            )
        except CheckpointException as e:  # a BaseException; what failed inside it is a write
            cause = next((exc for exc, _ in e.failures.values()), e)
            if isinstance(cause, OSError):
                raise cause from None  # ENOSPC, EFBIG, EACCES: AtomicOutputDir words it (E600)
            raise OutputError(
                f"{final}: writing the sample checkpoint failed ({' '.join(str(cause).split())[:160]})",
                path=final,
                hint="check free disk space and the file size limit there",
            ) from None
    extra = tmp / "extra_state"
    extra.mkdir()
    torch.save(
        {"global_step": steps, "lr_scheduler": sched.state_dict(), "torch_rng_state": torch.get_rng_state()},
        extra / "extra_state_rank_0.pt",
    )
    assets = tmp / "model_assets"
    assets.mkdir()
    dtype = "float32" if optimizer == "adamw" else "bfloat16"  # the parameters as saved (model.to above)
    (assets / "config.json").write_text(json.dumps(c.hf_config(dtype), indent=2) + "\n")
