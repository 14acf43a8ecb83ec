"""Benchmark checkpoints, written by real multi-rank gloo ``dcp.save`` jobs (cached by the callers).

- :func:`dense_rank`: a Llama-style model (vocab 32000, hidden 2048, MLP 5632, ``layers`` layers) as
  DTensors ``Shard(0)`` on a 1-D mesh of 4 ranks (the FSDP2 layout), optionally with FP32 optimizer
  state (``step``, ``master_weight``, ``exp_avg``, ``exp_avg_sq >= 0``: FullFP32AdamW's fields, the
  parameter equal to ``master_weight`` rounded) and a layout record.
- :func:`moe_legacy_rank`: fused MoE experts in the legacy EP layout (mesh ``(ep_fsdp=2, ep=2)``,
  both on the expert dim, version-1 record).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

VOCAB, HIDDEN, INTER, WORLD = 32000, 2048, 5632, 4
MOE_E, MOE_H, MOE_I, MOE_LAYERS, MOE_P, MOE_F = 64, 1024, 512, 4, 2, 2
ROOT = Path(__file__).resolve().parents[1]


def param_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter fqn (optimizer naming) -> shape of the Llama-style model."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for n in range(layers):
        p = f"model.layers.{n}"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{m}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{p}.mlp.gate_proj.weight"] = (INTER, HIDDEN)
        shapes[f"{p}.mlp.up_proj.weight"] = (INTER, HIDDEN)
        shapes[f"{p}.mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes[f"{p}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def sq(t: Any) -> Any:
    """Elementwise square (a valid, non-negative ``exp_avg_sq``)."""
    return t * t


def dense_rank(
    rank: int, world: int, out: str, layers: int, dtype_name: str, optimizer: bool, record: str | None = None
) -> None:
    """One rank of a 4-rank FSDP2-style save: DTensor Shard(0) shards (and FP32 state when asked)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1000 + rank)
    dtype = getattr(torch, dtype_name)

    def shard(shape: tuple[int, ...], dt: torch.dtype, scale: float) -> DTensor:
        rows = -(-shape[0] // world)
        lo = min(rank * rows, shape[0])
        hi = min(lo + rows, shape[0])
        local = (torch.randn((hi - lo, *shape[1:]), generator=gen) * scale).to(dt)
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    model, state = {}, {}
    for fqn, shape in param_shapes(layers).items():
        if not optimizer:
            model[fqn] = shard(shape, dtype, 0.02)
            continue
        master = shard(shape, torch.float32, 0.02)
        model[fqn] = DTensor.from_local(
            master.to_local().to(dtype), mesh, [Shard(0)], run_check=False, shape=master.shape, stride=master.stride()
        )
        exp_avg = shard(shape, torch.float32, 1e-3)
        state[fqn] = {
            "step": torch.tensor(100.0),
            "master_weight": master,
            "exp_avg": exp_avg,
            # >= exp_avg^2: moments Adam's own steps could have left (replay-step's R003 refuses
            # |m_hat| / sqrt(v_hat) beyond what Adam allows)
            "exp_avg_sq": sq(exp_avg) + sq(shard(shape, torch.float32, 1e-3)),
        }
    sd: dict[str, Any] = {"model": model}
    if optimizer:
        groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(state)}]
        sd["optimizer"] = {"state": state, "param_groups": groups}
    if record:
        sd["layout"] = record
    dcp.save(sd, checkpoint_id=out)


def moe_legacy_rank(rank: int, world: int, out: str, layers: int = MOE_LAYERS) -> None:
    """One rank of a legacy-layout EP save: mesh (ep_fsdp, ep), both on the expert dim (block-transposed);
    ``layers`` MoE layers (gate_up_proj 128 MiB + down_proj 64 MiB of BF16: 0.2 GB a layer)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (MOE_F, MOE_P), mesh_dim_names=("ep_fsdp", "ep"))
    gen = torch.Generator().manual_seed(2000 + rank)
    slab = MOE_E // (MOE_P * MOE_F)

    def local(shape: tuple[int, ...]) -> DTensor:
        t = (torch.randn((slab, *shape[1:]), generator=gen) * 0.02).to(torch.bfloat16)
        return DTensor.from_local(
            t,
            mesh,
            [Shard(0), Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    model, extra = {}, {}
    for n in range(layers):
        for name, shape in (("gate_up_proj", (MOE_E, 2 * MOE_I, MOE_H)), ("down_proj", (MOE_E, MOE_H, MOE_I))):
            fqn = f"model.layers.{n}.mlp.experts.{name}"
            model[fqn] = local(shape)
            extra[f"model.{fqn}"] = {"ep_dim": 0, "fsdp_dim": 0, "num_experts": MOE_E}
    record = {
        "format": "ckpttool.layout",
        "version": 1,
        "parallel": {"ep_size": MOE_P, "ep_fsdp_size": MOE_F},
        "extra_parallel": extra,
    }
    dcp.save({"model": model, "layout": json.dumps(record)}, checkpoint_id=out)


def build(path: Path, fn: Any, *args: Any) -> Path:
    if (path / ".metadata").is_file():
        return path
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.distributed import run_ranks

    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    run_ranks(WORLD, fn, str(tmp), *args)
    os.rename(tmp, path)
    print(f"# generated {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


def layers_for(gb: float, itemsize: int) -> int:
    """Layers of the Llama-style model whose parameters take ``gb`` GB at ``itemsize`` bytes each."""
    per_layer = (4 * HIDDEN * HIDDEN + 3 * INTER * HIDDEN + 2 * HIDDEN) * itemsize
    return max(1, round((gb * 1e9 - 2 * VOCAB * HIDDEN * itemsize) / per_layer))
