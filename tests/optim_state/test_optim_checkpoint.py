"""DCP save/restore of ckpttool optimizers in one process: cold resume, empty leaf, dtype checks."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckpttool.errors import OptimStateError
from ckpttool.optim_state import (
    CheckedLoadPlanner,
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
    MultiOptimizer,
    check_saved_state,
)

EXPERT_LR = 0.01
SCHEDULED_LR = 0.0025  # 0.01 after two StepLR(gamma=0.5) steps


class Toy(nn.Module):
    """Tiny MoE-shaped model: dense embed/head, fused experts, a module forward never uses."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        self.embed = nn.Linear(16, 24, bias=False)
        self.experts = nn.Module()
        self.experts.w_in = nn.Parameter(torch.randn(4, 24, 6, generator=gen) * 0.2)
        self.experts.w_out = nn.Parameter(torch.randn(4, 6, 24, generator=gen) * 0.2)
        self.head = nn.Linear(24, 5)
        self.unused = nn.Linear(8, 3)  # its parameters never receive a gradient
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.startswith("experts."):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        e = torch.einsum("bh,ehi->bei", h, self.experts.w_in).relu()
        h = h + torch.einsum("bei,eih->bh", e, self.experts.w_out) / 4
        return self.head(h)


def batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(50 + step)).to(dtype)


def train_step(model: nn.Module, opt: Any, step: int, dtype: torch.dtype) -> None:
    loss = model(batch(step, dtype)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def named(model: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if n.startswith(prefix)]


def build_nested(model: nn.Module) -> CPUOffloadAdamW:
    """One optimizer over the used parameters (two groups), offloading experts in 64-element chunks."""
    groups = [
        {"params": named(model, "embed") + named(model, "head"), "lr": 0.01, "weight_decay": 0.1},
        {"params": named(model, "experts"), "lr": 0.02, "weight_decay": 0.0},
    ]
    return CPUOffloadAdamW(
        groups,
        betas=(0.9, 0.95),
        cpu_offload_param_patterns=["experts"],
        chunk_size=64,
        cpu_moment_dtype=torch.bfloat16,
    )


def build_multi(model: nn.Module, offload_chunk: int | None = None, fused: bool = False) -> tuple[MultiOptimizer, Any]:
    """dense: FullFP32AdamW (``fused``); experts: MasterFP32AdamW (bf16 moments) or CPUOffloadAdamW; unused: never steps."""
    dense = FullFP32AdamW(
        [p for n, p in named(model, "embed") + named(model, "head")], lr=0.01, weight_decay=0.1, fused=fused
    )
    if offload_chunk is None:
        experts = MasterFP32AdamW([p for _, p in named(model, "experts")], lr=0.02)
    else:
        experts = CPUOffloadAdamW(
            named(model, "experts"), lr=0.02, cpu_offload_param_patterns=["experts"], chunk_size=offload_chunk
        )
    unused = FullFP32AdamW([p for _, p in named(model, "unused")], lr=EXPERT_LR)
    sched = torch.optim.lr_scheduler.StepLR(unused, step_size=1, gamma=0.5)
    return MultiOptimizer(model, {"dense": dense, "experts": experts, "unused": unused}), sched


def fixed_grads(model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(77)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) * 0.1 for p in model.parameters()]


def snapshot(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of parameters and every state tensor, keyed by FQN."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    names = {p: n for n, p in model.named_parameters()}
    out = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    optimizers = opt.optimizers.values() if isinstance(opt, MultiOptimizer) else [opt]
    for o in optimizers:
        for p, st in o.state.items():
            for field, v in st.items():
                out[f"state.{names[p]}.{field}"] = full(v)
    return out


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for k in expected:
        assert actual[k].dtype == expected[k].dtype, k
        assert torch.equal(actual[k], expected[k]), k


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- save and load
def save_nested(model: nn.Module, opt: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save(
        {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
        checkpoint_id=str(path),
    )


def load_nested(model: nn.Module, opt: Any, path: Path) -> None:
    """torch's standard flow; the fresh optimizer's template is made by torch's fake step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    md = dcp.FileSystemReader(str(path)).read_metadata()
    check_saved_state(md.state_dict_metadata, sd["optimizer"])
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optimizer"])


def save_multi(model: nn.Module, multi: MultiOptimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model), "optimizer": multi.state_dict()}, checkpoint_id=str(path))


def load_multi(model: nn.Module, multi: MultiOptimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        "model": get_model_state_dict(model),
        "optimizer": multi.state_dict_template(md.state_dict_metadata, prefix="optimizer."),
    }
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"])
    multi.load_state_dict(sd["optimizer"])


# ---------------------------------------------------------------- cold resume
def _resume_child(rank: int, workdir: str) -> None:
    """Fresh process: build, load both checkpoints, take step 4, compare with the uninterrupted run."""
    del rank
    torch.set_num_threads(1)
    wd = Path(workdir)
    expected = torch.load(wd / "expected.pt")
    model = Toy(torch.bfloat16)
    opt = build_nested(model)
    load_nested(model, opt, wd / "nested")
    train_step(model, opt, 3, torch.bfloat16)
    assert_bitwise(snapshot(model, opt), expected["nested"])

    model = Toy(torch.bfloat16)
    multi, _ = build_multi(model)
    load_multi(model, multi, wd / "multi")
    assert multi["unused"].param_groups[0]["lr"] == SCHEDULED_LR
    assert len(multi["unused"].state) == 0
    train_step(model, multi, 3, torch.bfloat16)
    assert_bitwise(snapshot(model, multi), expected["multi"])
    (wd / "child_ok").write_text("ok")


def test_cold_resume_in_new_process_is_bitwise_equal_to_uninterrupted_step(tmp_path):
    expected = {}
    with one_thread():
        model = Toy(torch.bfloat16)
        opt = build_nested(model)
        for s in range(3):
            train_step(model, opt, s, torch.bfloat16)
        save_nested(model, opt, tmp_path / "nested")
        train_step(model, opt, 3, torch.bfloat16)
        expected["nested"] = snapshot(model, opt)

        model = Toy(torch.bfloat16)
        multi, sched = build_multi(model)
        for s in range(3):
            train_step(model, multi, s, torch.bfloat16)
            if s < 2:
                sched.step()
        assert multi["unused"].param_groups[0]["lr"] == SCHEDULED_LR
        save_multi(model, multi, tmp_path / "multi")
        assert len(multi["unused"].state) == 0  # saving created no state
        train_step(model, multi, 3, torch.bfloat16)
        expected["multi"] = snapshot(model, multi)
    torch.save(expected, tmp_path / "expected.pt")

    import torch.multiprocessing as mp

    mp.start_processes(_resume_child, args=(str(tmp_path),), nprocs=1, join=True, start_method="spawn")
    assert (tmp_path / "child_ok").read_text() == "ok"

    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp_path / "multi")).read_metadata().state_dict_metadata)
    assert not any(k.startswith("optimizer.state.unused.") for k in keys)
    assert "optimizer.param_groups.unused.weight.lr" in keys
    assert "optimizer.state.experts.w_in.master_weight" in keys
    nested = dcp.FileSystemReader(str(tmp_path / "nested")).read_metadata().state_dict_metadata
    assert nested["optimizer.state.experts.w_in.exp_avg"].properties.dtype == torch.bfloat16  # cpu moments
    assert nested["optimizer.state.embed.weight.exp_avg"].properties.dtype == torch.float32  # resident moments
    assert "optimizer.param_groups.0.lr" in nested and "optimizer.param_groups.1.params" in nested


# ---------------------------------------------------------------- torch's flattened flavor
@pytest.mark.parametrize("kind", ["full", "master", "offload"])
def test_single_optimizer_flattened_flavor_through_torch_get_and_set(tmp_path, kind):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def make(model: nn.Module) -> Any:
        used = named(model, "embed") + named(model, "head") + named(model, "experts")
        if kind == "full":
            return FullFP32AdamW([p for _, p in used], lr=0.01)
        if kind == "master":
            return MasterFP32AdamW([p for _, p in used], lr=0.01)
        return CPUOffloadAdamW(used, lr=0.01, cpu_offload_param_patterns=["experts"], chunk_size=50)

    model = Toy(torch.bfloat16)
    opt = make(model)
    for s in range(2):
        train_step(model, opt, s, torch.bfloat16)
    osd = get_optimizer_state_dict(model, opt, options=flat)
    assert "state.experts.w_in.master_weight" in osd and "param_groups.head.bias.lr" in osd
    dcp.save({"model": get_model_state_dict(model), "optimizer": osd}, checkpoint_id=str(tmp_path))

    fresh_model = Toy(torch.bfloat16)
    fresh = make(fresh_model)
    sd = {
        "model": get_model_state_dict(fresh_model),
        "optimizer": get_optimizer_state_dict(fresh_model, fresh, options=flat),
    }
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=CheckedLoadPlanner())
    set_model_state_dict(fresh_model, sd["model"])
    set_optimizer_state_dict(fresh_model, fresh, sd["optimizer"], options=flat)
    train_step(model, opt, 2, torch.bfloat16)
    train_step(fresh_model, fresh, 2, torch.bfloat16)
    assert_bitwise(snapshot(fresh_model, fresh), snapshot(model, opt))


def test_fused_fp32_resume_takes_the_saved_master_where_the_saved_parameter_differs(tmp_path):
    """A fused step makes an FP32 parameter its own master; a checkpoint whose parameter is not its
    master (here: the parameter saved with an offset) resumes from the saved master, as before."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make(model: nn.Module) -> FullFP32AdamW:
        return FullFP32AdamW([p for n, p in model.named_parameters() if not n.startswith("unused")], fused=True)

    model = Toy()
    opt = make(model)
    for s in range(2):
        train_step(model, opt, s, torch.float32)
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": {k: v if k.startswith("unused") else v + 1.0 for k, v in msd.items()}, "optimizer": osd},
        checkpoint_id=str(tmp_path),
    )

    fresh_model = Toy()
    fresh = make(fresh_model)
    fmsd, fosd = get_state_dict(fresh_model, fresh)  # torch fake-steps the empty optimizer here
    sd = {"model": fmsd, "optimizer": fosd}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    set_state_dict(fresh_model, fresh, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert torch.equal(fresh_model.head.bias, model.head.bias + 1.0)  # loaded as saved until the next step
    for m, o in ((model, opt), (fresh_model, fresh)):  # the same gradients (a forward would see the offset)
        for (n, p), g in zip(m.named_parameters(), fixed_grads(model)):
            p.grad = None if n.startswith("unused") else g
        o.step()
    assert_bitwise(snapshot(fresh_model, fresh), snapshot(model, opt))


# ---------------------------------------------------------------- empty leaf, same process
def test_multi_optimizer_empty_leaf_keeps_scheduled_lr_and_gets_no_state(tmp_path):
    model = Toy()
    multi, sched = build_multi(model)
    for s in range(2):
        train_step(model, multi, s, torch.float32)
        sched.step()
    sd = multi.state_dict()
    assert not any(k.startswith("state.unused.") for k in sd)
    assert sd["param_groups.unused.weight.lr"] == sd["param_groups.unused.bias.lr"] == SCHEDULED_LR
    assert len(multi["unused"].state) == 0
    save_multi(model, multi, tmp_path / "ck")

    fresh_model = Toy()
    fresh, _ = build_multi(fresh_model)
    assert fresh["unused"].param_groups[0]["lr"] == EXPERT_LR
    load_multi(fresh_model, fresh, tmp_path / "ck")
    assert fresh["unused"].param_groups[0]["lr"] == SCHEDULED_LR
    assert len(fresh["unused"].state) == 0
    assert fresh["dense"].param_groups[0]["lr"] == 0.01
    assert_bitwise(snapshot(fresh_model, fresh), snapshot(model, multi))


def test_torch_get_optimizer_state_dict_fake_steps_an_empty_optimizer():
    """The trap MultiOptimizer avoids (torch 2.13 _init_optim_state): state appears, lr survives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = Toy()
    opt = FullFP32AdamW(model.unused.parameters(), lr=SCHEDULED_LR)
    before = model.unused.weight.detach().clone()
    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert sd["state.unused.weight.step"].item() == 1.0  # state created by a zero-grad, lr=0 step
    assert sd["param_groups.unused.weight.lr"] == SCHEDULED_LR
    assert torch.equal(model.unused.weight, before)


def test_multi_optimizer_rejects_shared_or_foreign_parameters():
    from ckpttool.errors import UsageError

    model = Toy()
    a = FullFP32AdamW(model.head.parameters())
    with pytest.raises(UsageError, match="leaves"):
        MultiOptimizer(model, {"a": a, "b": FullFP32AdamW(model.head.parameters())})
    with pytest.raises(UsageError, match="not a parameter of the model"):
        MultiOptimizer(model, {"a": FullFP32AdamW([nn.Parameter(torch.zeros(2))])})


def test_multi_optimizer_load_rejects_unknown_keys_and_disagreeing_groups():
    model = Toy()
    multi, _ = build_multi(model)
    train_step(model, multi, 0, torch.float32)
    sd = multi.state_dict()
    with pytest.raises(OptimStateError, match="no leaf uses"):
        multi.load_state_dict({**sd, "param_groups.ghost.weight.lr": 0.1})
    bad = dict(sd)
    bad["param_groups.head.bias.lr"] = 0.5
    with pytest.raises(OptimStateError, match="disagree on 'lr'"):
        multi.load_state_dict(bad)
    bad = {k: v for k, v in sd.items() if k != "param_groups.unused.weight.eps" and k != "param_groups.unused.bias.eps"}
    with pytest.raises(OptimStateError, match="'eps' missing"):
        multi.load_state_dict(bad)


# ---------------------------------------------------------------- dtype checks with real DCP
@pytest.fixture(scope="module")
def bf16_moment_ckpt(tmp_path_factory) -> Path:
    """A flattened checkpoint whose experts moments are BF16 (MasterFP32AdamW)."""
    path = tmp_path_factory.mktemp("bf16mom") / "ck"
    model = Toy()
    multi, _ = build_multi(model)
    train_step(model, multi, 0, torch.float32)
    save_multi(model, multi, path)
    return path


def _fp32_experts_multi(model: nn.Module) -> MultiOptimizer:
    dense = FullFP32AdamW([p for _, p in named(model, "embed") + named(model, "head")], lr=0.01, weight_decay=0.1)
    experts = FullFP32AdamW([p for _, p in named(model, "experts")], lr=0.02)
    unused = FullFP32AdamW([p for _, p in named(model, "unused")], lr=EXPERT_LR)
    return MultiOptimizer(model, {"dense": dense, "experts": experts, "unused": unused})


def test_restore_rejects_bf16_moment_where_fp32_configured_before_reading_data(bf16_moment_ckpt):
    import torch.distributed.checkpoint as dcp

    model = Toy()
    multi = _fp32_experts_multi(model)
    md = dcp.FileSystemReader(str(bf16_moment_ckpt)).read_metadata()
    with pytest.raises(OptimStateError) as exc:
        multi.state_dict_template(md.state_dict_metadata, prefix="optimizer.")
    msg = str(exc.value)
    assert "experts.w_in.exp_avg" in msg and "saved as bfloat16" in msg and "configured for float32" in msg
    assert exc.value.fqn == "experts.w_in"


def test_checked_planner_rejects_mismatch_inside_dcp_load(bf16_moment_ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model = Toy()
    multi = _fp32_experts_multi(model)
    keys = dcp.FileSystemReader(str(bf16_moment_ckpt)).read_metadata().state_dict_metadata.keys()
    template = multi.state_dict_template(keys, prefix="optimizer.")  # keys only: no dtype check yet
    with pytest.raises((OptimStateError, CheckpointException), match="saved as bfloat16"):
        dcp.load({"optimizer": template}, checkpoint_id=str(bf16_moment_ckpt), planner=CheckedLoadPlanner())


def test_plain_dcp_load_would_convert_silently(bf16_moment_ckpt):
    """Why the metadata check exists: DCP copies a BF16 moment into an FP32 target without complaint."""
    import torch.distributed.checkpoint as dcp

    model = Toy()
    multi = _fp32_experts_multi(model)
    keys = dcp.FileSystemReader(str(bf16_moment_ckpt)).read_metadata().state_dict_metadata.keys()
    template = multi.state_dict_template(keys, prefix="optimizer.")
    dcp.load({"optimizer": template}, checkpoint_id=str(bf16_moment_ckpt))
    assert template["state.experts.w_in.exp_avg"].dtype == torch.float32


def test_template_rejects_state_saved_by_another_optimizer_type(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = Toy()
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)
    multi_plain = MultiOptimizer(model, {"all": plain})
    train_step(model, multi_plain, 0, torch.float32)
    save_multi(model, multi_plain, tmp_path / "ck")
    keys = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata.keys()
    with pytest.raises(OptimStateError, match="expects step, master_weight"):
        _fp32_experts_multi(Toy()).state_dict_template(keys, prefix="optimizer.")
    # the same checkpoint restores into torch.optim.AdamW leaves (no state for the unused module)
    fresh_model = Toy()
    fresh = MultiOptimizer(fresh_model, {"all": torch.optim.AdamW(fresh_model.parameters(), lr=0.01)})
    load_multi(fresh_model, fresh, tmp_path / "ck")
    assert_bitwise(snapshot(fresh_model, fresh), snapshot(model, multi_plain))
