"""FP32-master AdamW variants vs torch.optim.AdamW and the reference; schema; load checks."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from ckpttool.errors import OptimStateError, UsageError
from ckpttool.format.metadata import dtype_name
from ckpttool.optim_state import (
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
    build_optimizer,
)
from ckpttool.optim_state.offload import StagingBuffers
from ckpttool.optim_state.reference import reference_adamw_step
from ckpttool.optim_state.schema import expected_state_dtypes, infer_optimizer_type

SHAPES = [(257,), (16, 8), (3,), (5, 7)]
# two groups with different lr / weight decay; group 1 without decay
GROUP_HYPER = [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.02, "weight_decay": 0.0}]
BETAS, EPS = (0.9, 0.95), 1e-8


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def grads_for(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def groups_of(params, named: bool = False):
    items = [(f"layers.{i}.{'experts' if i % 2 == 0 else 'dense'}.w", p) for i, p in enumerate(params)]
    if not named:
        items = [p for _, p in items]
    return [{"params": items[:2], **GROUP_HYPER[0]}, {"params": items[2:], **GROUP_HYPER[1]}]


def build(kind: str, params, **kw):
    if kind == "full":
        return FullFP32AdamW(groups_of(params), betas=BETAS, eps=EPS, **kw)
    if kind == "master_f32":
        return MasterFP32AdamW(groups_of(params), betas=BETAS, eps=EPS, moment_dtype=torch.float32, **kw)
    if kind == "offload":
        return CPUOffloadAdamW(
            groups_of(params, named=True),
            betas=BETAS,
            eps=EPS,
            cpu_offload_param_patterns=["experts"],
            chunk_size=64,
            **kw,
        )
    raise AssertionError(kind)


def run_torch_fp32(steps: int, param_dtype: torch.dtype):
    """FP32 torch AdamW on FP32 copies of the (possibly BF16) starting weights, BF16-valued grads."""
    start = make_params(param_dtype)
    ref = [torch.nn.Parameter(p.detach().float()) for p in start]
    opt = torch.optim.AdamW(groups_of(ref), betas=BETAS, eps=EPS, foreach=False)
    for s in range(steps):
        for p, g in zip(ref, grads_for(s, start)):
            p.grad = g.float()
        opt.step()
    return ref, opt


@pytest.mark.parametrize("kind", ["full", "master_f32", "offload"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_variant_matches_torch_adamw_fp32_over_three_steps(kind, param_dtype):
    params = make_params(param_dtype)
    opt = build(kind, params)
    for s in range(3):
        for p, g in zip(params, grads_for(s, params)):
            p.grad = g
        opt.step()
    ref, ref_opt = run_torch_fp32(3, param_dtype)
    for p, r in zip(params, ref):
        st, rst = opt.state[p], ref_opt.state[r]
        torch.testing.assert_close(st["master_weight"], r.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(st["exp_avg"], rst["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(st["exp_avg_sq"], rst["exp_avg_sq"], rtol=1e-6, atol=1e-7)
        assert st["step"].item() == rst["step"].item() == 3.0
        # the parameter is exactly the master rounded to its dtype (RNE)
        assert p.dtype == param_dtype
        assert torch.equal(p.detach(), st["master_weight"].to(param_dtype))


@pytest.mark.parametrize("kind", ["full", "master_f32", "offload"])
def test_state_fields_and_dtypes_follow_design_table(kind):
    params = make_params(torch.bfloat16)
    opt = build(kind, params)
    for p, g in zip(params, grads_for(0, params)):
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    for pid, p in enumerate(params):
        fields = sd["state"][pid]
        assert list(fields) == ["step", "master_weight", "exp_avg", "exp_avg_sq"]
        assert fields["step"].shape == () and fields["step"].dtype == torch.float32
        assert fields["master_weight"].dtype == torch.float32 and fields["master_weight"].shape == p.shape
        assert fields["exp_avg"].dtype == torch.float32
        assert infer_optimizer_type({k: v.dtype for k, v in fields.items()}) == "full_fp32_adamw"
    for group in sd["param_groups"]:
        assert {"lr", "betas", "eps", "weight_decay"} <= set(group)
        assert not any("offload" in k or "chunk" in k for k in group)  # placement policy is not serialized


def test_master_fp32_bf16_moments_follow_reference_with_rounded_moments():
    params = make_params(torch.bfloat16)
    opt = MasterFP32AdamW(groups_of(params), betas=BETAS, eps=EPS)  # bf16 moments by default
    ref = [
        {
            "w": p.detach().float(),
            "m": torch.zeros(p.shape, dtype=torch.bfloat16),
            "v": torch.zeros(p.shape, dtype=torch.bfloat16),
        }
        for p in params
    ]
    hyper = [GROUP_HYPER[0]] * 2 + [GROUP_HYPER[1]] * 2
    for s in range(3):
        grads = grads_for(s, params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for r, g, h in zip(ref, grads, hyper):
            w, m, v, _ = reference_adamw_step(r["w"], g, r["m"], r["v"], s, h["lr"], BETAS, EPS, h["weight_decay"])
            r["w"], r["m"], r["v"] = w.float(), m.to(torch.bfloat16), v.to(torch.bfloat16)
    for p, r in zip(params, ref):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
        torch.testing.assert_close(st["master_weight"], r["w"], rtol=1e-5, atol=1e-6)
        # moments stored rounded: at most one bf16 ulp apart from the f64 reference's rounding
        torch.testing.assert_close(st["exp_avg"].float(), r["m"].float(), rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(st["exp_avg_sq"].float(), r["v"].float(), rtol=8e-3, atol=1e-6)
        assert torch.equal(p.detach(), st["master_weight"].to(torch.bfloat16))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_offload_chunked_with_tail_is_bitwise_equal_to_unchunked(param_dtype, moment_dtype):
    # 257 elements, chunk 64: four full chunks and a 1-element tail
    params = make_params(param_dtype)
    chunked = CPUOffloadAdamW(
        groups_of(params, named=True),
        betas=BETAS,
        eps=EPS,
        cpu_offload_param_patterns=["experts"],
        chunk_size=64,
        cpu_moment_dtype=moment_dtype,
        resident_moment_dtype=moment_dtype,
    )
    plan = chunked.offload_plan()
    assert plan == {
        "layers.0.experts.w": True,
        "layers.1.dense.w": False,
        "layers.2.experts.w": True,
        "layers.3.dense.w": False,
    }
    other = make_params(param_dtype)
    whole = MasterFP32AdamW(groups_of(other), betas=BETAS, eps=EPS, moment_dtype=moment_dtype)
    for s in range(3):
        for p, q, g in zip(params, other, grads_for(s, params)):
            p.grad, q.grad = g, g.clone()
        chunked.step()
        whole.step()
    for p, q in zip(params, other):
        for field in ("master_weight", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(chunked.state[p][field], whole.state[q][field]), field
            assert chunked.state[p][field].dtype == whole.state[q][field].dtype
        assert torch.equal(p, q)


def test_offload_moment_dtypes_chosen_independently():
    params = make_params(torch.bfloat16)
    opt = CPUOffloadAdamW(
        groups_of(params, named=True),
        cpu_offload_param_patterns=[r"\.experts\."],
        cpu_moment_dtype="bfloat16",
        resident_moment_dtype=torch.float32,
        chunk_size=100,
    )
    for p, g in zip(params, grads_for(0, params)):
        p.grad = g
    opt.step()
    dtypes = [opt.state[p]["exp_avg"].dtype for p in params]
    assert dtypes == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    cfg = {"cpu_offload_param_patterns": [r"\.experts\."], "cpu_moment_dtype": "bfloat16"}
    for name, p in zip(opt.offload_plan(), params):
        want = expected_state_dtypes("cpu_offload_adamw", cfg, p.dtype, fqn=name)["exp_avg"]
        assert want == dtype_name(opt.state[p]["exp_avg"].dtype)
    # cpu_offload=False keeps everything resident (resident dtype)
    off = CPUOffloadAdamW(
        groups_of(params, named=True),
        cpu_offload_param_patterns=["experts"],
        cpu_offload=False,
        cpu_moment_dtype="bfloat16",
    )
    assert not any(off.offload_plan().values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cpu_offload_param_patterns": []}, "non-empty"),
        ({"cpu_offload_param_patterns": "experts"}, "non-empty"),
        ({"cpu_offload_param_patterns": ["("]}, "invalid offload pattern"),
        ({"cpu_offload_param_patterns": ["x"], "chunk_size": 0}, "chunk_size"),
        ({"cpu_offload_param_patterns": ["x"], "cpu_moment_dtype": torch.float16}, "float32 or bfloat16"),
    ],
)
def test_offload_rejects_bad_config(kwargs, message):
    with pytest.raises(UsageError, match=message):
        CPUOffloadAdamW(groups_of(make_params(torch.float32), named=True), **kwargs)


def test_offload_needs_parameter_names():
    with pytest.raises(UsageError, match="parameter names"):
        CPUOffloadAdamW(make_params(torch.float32), cpu_offload_param_patterns=["x"])


def test_staging_buffers_wait_before_reuse_and_grow():
    class FakeEvent:
        def __init__(self):
            self.synced = False

        def synchronize(self):
            self.synced = True

    staging = StagingBuffers(chunk_size=8, num_slots=2)
    a = staging.acquire("d2h", 0, 8, torch.float32)
    assert a.shape == (8,) and staging.nbytes == 32
    ev = FakeEvent()
    staging.release("d2h", 0, ev)
    b = staging.acquire("d2h", 0, 4, torch.bfloat16)  # reuse waits for the outstanding transfer
    assert ev.synced and b.data_ptr() == a.data_ptr() and staging.grow_count == 1
    ev2 = FakeEvent()
    staging.release("d2h", 0, ev2)
    staging.acquire("d2h", 0, 16, torch.float32)  # grow only after the wait
    assert ev2.synced and staging.grow_count == 2 and staging.nbytes == 64


def _each_variant(**hyper):  # type: ignore[no-untyped-def]
    """The three optimizers over the same parameters with the same hyperparameter keywords."""
    named = [(f"p{i}", p) for i, p in enumerate(make_params(torch.float32))]
    yield FullFP32AdamW(named, **hyper)
    yield MasterFP32AdamW(named, moment_dtype="float32", **hyper)
    yield CPUOffloadAdamW(named, cpu_offload_param_patterns=["p0"], **hyper)


@pytest.mark.parametrize("hyper", [{"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": -1.0}, {"weight_decay": -0.1}])
def test_hyperparameters_validated(hyper):
    for make in (FullFP32AdamW, MasterFP32AdamW):
        with pytest.raises(UsageError):
            make(make_params(torch.float32), **hyper)
    with pytest.raises(UsageError):
        CPUOffloadAdamW([("p0", make_params(torch.float32)[0])], cpu_offload_param_patterns=["p0"], **hyper)


def test_variants_take_torch_adamw_defaults_and_the_given_hyperparameters():
    """Every variant's param group holds ``torch.optim.AdamW``'s defaults, or the keywords it was given."""
    torch_defaults = {
        k: torch.optim.AdamW([torch.zeros(1)]).defaults[k] for k in ("lr", "betas", "eps", "weight_decay")
    }
    for opt in _each_variant():
        assert {k: opt.param_groups[0][k] for k in torch_defaults} == torch_defaults, type(opt).__name__
    given = {"lr": 0.25, "betas": (0.5, 0.75), "eps": 1e-6, "weight_decay": 0.0}
    for opt in _each_variant(fused=True, **given):
        assert {k: opt.param_groups[0][k] for k in given} == given and opt.fused, type(opt).__name__


def test_build_optimizer_factory():
    params = make_params(torch.float32)
    assert type(build_optimizer("adamw", params, lr=0.1)) is torch.optim.AdamW
    assert type(build_optimizer("full_fp32_adamw", params)) is FullFP32AdamW
    m = build_optimizer("master_fp32_adamw", params, moment_dtype="float32")
    assert type(m) is MasterFP32AdamW and m.moment_dtype(params[0]) == torch.float32
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    assert type(build_optimizer("cpu_offload_adamw", named, cpu_offload_param_patterns=["p0"])) is CPUOffloadAdamW
    with pytest.raises(UsageError, match="unknown optimizer type"):
        build_optimizer("sgd", params)
    with pytest.raises(UsageError, match="bad configuration"):
        build_optimizer("full_fp32_adamw", params, moment_dtype="bf16")


def test_expected_and_inferred_types_round_trip():
    f32, bf16 = "float32", "bfloat16"
    assert expected_state_dtypes("adamw", {}, torch.bfloat16) == {"step": f32, "exp_avg": bf16, "exp_avg_sq": bf16}
    assert expected_state_dtypes("master_fp32_adamw", None, bf16)["exp_avg"] == bf16
    assert expected_state_dtypes("master_fp32_adamw", {"moment_dtype": "fp32"}, bf16)["exp_avg"] == f32
    layout_cfg = {"moment_dtypes": {"resident": "float32", "cpu": "float32"}, "offload_patterns": ["experts"]}
    assert expected_state_dtypes("cpu_offload_adamw", layout_cfg, bf16)["exp_avg_sq"] == f32
    for t in ("adamw", "full_fp32_adamw", "master_fp32_adamw"):
        assert infer_optimizer_type(expected_state_dtypes(t, {}, bf16)) == t
    # offload with f32 moments saves what full_fp32_adamw saves
    assert infer_optimizer_type(expected_state_dtypes("cpu_offload_adamw", {}, bf16)) == "full_fp32_adamw"
    with pytest.raises(UsageError, match="fqn"):
        expected_state_dtypes("cpu_offload_adamw", {"cpu_moment_dtype": "bf16"}, bf16)
    with pytest.raises(UsageError, match="unknown optimizer type"):
        expected_state_dtypes("lion", {}, bf16)
    bad = [
        {"step": "float32", "exp_avg": "float32"},
        {"step": "float32", "master_weight": "bfloat16", "exp_avg": "float32", "exp_avg_sq": "float32"},
        {"step": "float32", "master_weight": "float32", "exp_avg": "bfloat16", "exp_avg_sq": "float32"},
        {"step": "float32", "exp_avg": "float32", "exp_avg_sq": "float32", "momentum_buffer": "float32"},
    ]
    for fields in bad:
        with pytest.raises(OptimStateError):
            infer_optimizer_type(fields)


def test_references_agree_and_do_not_mutate_inputs():
    gen = torch.Generator().manual_seed(3)
    w, g = torch.randn(33, generator=gen), torch.randn(33, generator=gen).to(torch.bfloat16)
    m, v = torch.randn(33, generator=gen) * 0.1, torch.rand(33, generator=gen) * 0.01
    before = [t.clone() for t in (w, g, m, v)]
    args = (w, g, m, v, 5.0, 0.01, (0.9, 0.95), 1e-8, 0.1)
    a = reference_adamw_step(*args)
    b = reference_adamw_step(*args, via="torch")
    for x, y in zip(a[:3], b[:3]):
        assert x.dtype == torch.float64
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    assert a[3] == b[3] == 6.0
    for t, t0 in zip((w, g, m, v), before):
        assert torch.equal(t, t0)
    f32 = reference_adamw_step(*args, dtype=torch.float32)
    assert f32[0].dtype == torch.float32
    with pytest.raises(ValueError):
        reference_adamw_step(w, g[:3], m, v, 0, 0.01, (0.9, 0.95), 1e-8, 0.0)


def _trained(kind: str, param_dtype=torch.bfloat16):
    params = make_params(param_dtype)
    opt = build(kind, params)
    for s in range(2):
        for p, g in zip(params, grads_for(s, params)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("kind", ["full", "master_f32", "offload"])
def test_load_state_dict_round_trip_then_identical_step(kind):
    params, opt = _trained(kind)
    sd = copy.deepcopy(opt.state_dict())  # load_state_dict adopts tensors, as torch does
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = build(kind, fresh_params)
    fresh.load_state_dict(sd)
    for p, q, g in zip(params, fresh_params, grads_for(7, params)):
        p.grad, q.grad = g, g.clone()
    opt.step()
    fresh.step()
    for p, q in zip(params, fresh_params):
        assert torch.equal(p, q)
        for f in ("master_weight", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][f], fresh.state[q][f])


def test_load_state_dict_rejects_bf16_moment_where_fp32_is_configured():
    params, opt = _trained("full")
    sd = opt.state_dict()
    sd["state"][1]["exp_avg_sq"] = sd["state"][1]["exp_avg_sq"].to(torch.bfloat16)
    named_groups = [
        {"params": [("layers.0.w", params[0]), ("layers.1.w", params[1])], **GROUP_HYPER[0]},
        {"params": [("layers.2.w", params[2]), ("layers.3.w", params[3])], **GROUP_HYPER[1]},
    ]
    fresh = FullFP32AdamW(named_groups)
    with pytest.raises(OptimStateError) as exc:
        fresh.load_state_dict(sd)
    msg = str(exc.value)
    assert "layers.1.w.exp_avg_sq" in msg and "bfloat16" in msg and "float32" in msg and "refusing" in msg
    assert exc.value.code == "E500" and exc.value.fqn == "layers.1.w"
    assert not fresh.state  # nothing was loaded or cast


def test_load_state_dict_rejects_missing_field_shape_and_other_type():
    params, opt = _trained("full")
    adamw_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.AdamW(groups_of(adamw_params))
    for p, g in zip(adamw_params, grads_for(0, adamw_params)):
        p.grad = g
    plain.step()
    with pytest.raises(OptimStateError, match="missing master_weight"):
        build("full", make_params(torch.bfloat16)).load_state_dict(plain.state_dict())
    sd = opt.state_dict()
    sd["state"][0]["master_weight"] = sd["state"][0]["master_weight"][:-1]
    with pytest.raises(OptimStateError, match=re.escape("shape [256]")):
        build("full", make_params(torch.bfloat16)).load_state_dict(sd)
    with pytest.raises(OptimStateError, match="'state' and 'param_groups'"):
        build("full", make_params(torch.bfloat16)).load_state_dict({"state": {}})
    sd = opt.state_dict()
    sd["param_groups"] = sd["param_groups"][:1]
    with pytest.raises(OptimStateError, match="param group"):
        build("full", make_params(torch.bfloat16)).load_state_dict(sd)


def test_explicit_state_injection_for_replay():
    """The replay-step path: inject state by FQN into a fresh optimizer, step, compare with the reference."""
    gen = torch.Generator().manual_seed(9)
    p = torch.nn.Parameter(torch.randn(10, generator=gen).to(torch.bfloat16))
    master = p.detach().float() + 1e-3 * torch.randn(10, generator=gen)
    m, v = torch.randn(10, generator=gen) * 1e-2, torch.rand(10, generator=gen) * 1e-4
    grad = torch.randn(10, generator=gen).to(torch.bfloat16)
    opt = build_optimizer(
        "full_fp32_adamw", [{"params": [("model.w", p)], "lr": 0.003, "betas": BETAS, "eps": EPS, "weight_decay": 0.05}]
    )
    opt.load_state_dict(
        {
            "state": {
                "model.w": {
                    "step": torch.tensor(41.0),
                    "master_weight": master.clone(),
                    "exp_avg": m.clone(),
                    "exp_avg_sq": v.clone(),
                }
            },
            "param_groups": [{"params": ["model.w"], "lr": 0.003, "betas": BETAS, "eps": EPS, "weight_decay": 0.05}],
        }
    )
    p.grad = grad
    opt.step()
    w, em, ev, t = reference_adamw_step(master, grad, m, v, 41.0, 0.003, BETAS, EPS, 0.05)
    torch.testing.assert_close(opt.state[p]["master_weight"], w.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ev.float(), rtol=1e-6, atol=1e-7)
    assert opt.state[p]["step"].item() == t == 42.0
