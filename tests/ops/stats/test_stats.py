"""``ckpttool stats``: every figure checked against torch on tensors read by torch's own DCP reader."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from ckpttool.ops.stats import StatsOptions, collect_stats, layer_of, module_of
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

runner = CliRunner()


def torch_state(ckpt: Path, tmp_path: Path) -> dict[str, Any]:
    """The whole checkpoint as torch's own DCP reader loads it (flattened keys)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    nested = torch.load(out, weights_only=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, list) and prefix.endswith("param_groups."):
            for i, x in enumerate(v):
                walk(f"{prefix}{i}.", x)
        else:
            flat[prefix[:-1]] = v

    walk("", nested)
    return flat


def close(a: float, b: float) -> bool:
    """Equal within the documented precision (float32 block sums added in float64)."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


@pytest.mark.parametrize("fixture", ["dense_ckpt", "fsdp_ckpt"])
def test_tensor_statistics_match_torch(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    ckpt: Path = request.getfixturevalue(fixture)
    ref = torch_state(ckpt, tmp_path)
    res = collect_stats([ckpt], StatsOptions(workers=2))
    c = res.checkpoints[0]
    assert c.tensors and not c.notes
    seen_roles = set()
    for t in c.tensors:
        x = ref[t.key].double().reshape(-1)
        seen_roles.add(t.role)
        assert t.numel == x.numel() and t.nonfinite == 0, t.key
        assert close(t.l2, float(x.norm())), (t.key, t.l2, float(x.norm()))
        assert math.isclose(t.mean, float(x.mean()), rel_tol=1e-5, abs_tol=1e-9), t.key
        assert math.isclose(t.std, float(x.std(unbiased=False)), rel_tol=1e-5, abs_tol=1e-9), t.key
        assert t.abs_max == float(x.abs().max()), t.key
        assert t.zero_fraction == float((x == 0).double().mean()), t.key
    assert {"weight", "exp_avg", "exp_avg_sq"} <= seen_roles
    # per-layer norms are the L2 over the layer's model tensors
    layer = next(g for g in c.layers if g.name == "model.layers.0")
    keys = [k for k in ref if k.startswith("model.model.layers.0.") and isinstance(ref[k], torch.Tensor)]
    want = math.sqrt(sum(float(ref[k].double().pow(2).sum()) for k in keys))
    assert close(layer.norms["weight"], want)
    assert layer.params == sum(ref[k].numel() for k in keys)


def test_update_size_is_the_adamw_step_from_the_saved_moments(dense_ckpt: Path, tmp_path: Path) -> None:
    ref = torch_state(dense_ckpt, tmp_path)
    c = collect_stats([dense_ckpt], StatsOptions()).checkpoints[0]
    groups = [k for k in ref if k.startswith("optimizer.param_groups.") and k.endswith(".params")]
    assert c.updates and len(c.updates) == len({p for g in groups for p in ref[g]})
    for u in c.updates:
        gid = next(g for g in groups if u.fqn in ref[g]).rsplit(".", 1)[0]
        lr, (b1, b2), eps = ref[f"{gid}.lr"], ref[f"{gid}.betas"], ref[f"{gid}.eps"]
        step = float(ref[f"optimizer.state.{u.fqn}.step"])
        m = ref[f"optimizer.state.{u.fqn}.exp_avg"].double() / (1 - b1**step)
        v = ref[f"optimizer.state.{u.fqn}.exp_avg_sq"].double() / (1 - b2**step)
        want = lr * m.abs() / (v.sqrt() + eps)
        assert u.step == step and u.lr == lr
        assert math.isclose(u.rms, float(want.pow(2).mean().sqrt()), rel_tol=1e-6), u.fqn
        assert math.isclose(u.max, float(want.max()), rel_tol=1e-6), u.fqn
        w = ref[f"model.{u.fqn}"].double()
        assert u.relative is not None and math.isclose(u.relative, u.rms / float(w.pow(2).mean().sqrt()), rel_tol=1e-6)


def test_per_expert_norms_of_a_moe_checkpoint(sample_ckpt: Path, tmp_path: Path) -> None:
    ref = torch_state(sample_ckpt, tmp_path)
    c = collect_stats([sample_ckpt], StatsOptions(optimizer=False)).checkpoints[0]
    assert c.experts and not c.updates and {t.role for t in c.tensors} == {"weight"}
    for e in c.experts:
        x = ref[e.key].double()
        assert len(e.norms) == x.shape[0]
        for i, n in enumerate(e.norms):
            assert close(n, float(x[i].norm())), (e.key, i)


def _run(tmp_path: Path, steps: int, nan_at: str | None = None) -> list[Path]:
    """A tiny MoE trained for ``steps`` AdamW steps, one DCP checkpoint per step (torch's dcp.save)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpttool.ops.sample import SampleConfig, TinyMoEForCausalLM

    torch.manual_seed(0)
    cfg = SampleConfig(num_hidden_layers=2, num_experts=4)
    model = TinyMoEForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    out = []
    for s in range(1, steps + 1):
        opt.zero_grad()
        model.loss(torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)).backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        if nan_at is not None:
            msd[nan_at] = msd[nan_at].clone()
            msd[nan_at].view(-1)[:3] = torch.tensor([math.nan, math.inf, -math.inf])
        path = tmp_path / f"step-{s}"
        with pytest.warns(UserWarning):  # "torch.distributed is disabled ... single process"
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))
        out.append(path)
    return out


@pytest.fixture(scope="module")
def run3(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three consecutive checkpoints of one run (read-only)."""
    return _run(tmp_path_factory.mktemp("run"), 3)


def test_relative_change_between_checkpoints_matches_torch(run3: list[Path], tmp_path: Path) -> None:
    paths = run3
    res = collect_stats(paths, StatsOptions())
    assert len(res.checkpoints) == 3 and not res.skipped
    refs = [torch_state(p, tmp_path) for p in paths]
    for i in range(2):
        a, b = refs[i], refs[i + 1]
        for ch in (x for x in res.changes if x.a == str(paths[i])):
            keys = [k for k in a if k.startswith("model.") and layer_of(k[len("model.") :]) == ch.layer]
            d2 = sum(float((b[k].double() - a[k].double()).pow(2).sum()) for k in keys)
            a2 = sum(float(a[k].double().pow(2).sum()) for k in keys)
            assert ch.tensors == len(keys)
            assert ch.relative is not None and math.isclose(ch.relative, math.sqrt(d2 / a2), rel_tol=1e-6), ch
            assert ch.absolute is not None and math.isclose(ch.absolute, math.sqrt(d2), rel_tol=1e-6), ch
    assert all(ch.relative and ch.relative > 0 for ch in res.changes)
    assert [c["absolute"] for c in res.to_dict()["changes"]] == [c.absolute for c in res.changes]


def test_change_of_float32_values_is_exact_in_float64(tmp_path: Path) -> None:
    """The difference of two float32 values more than a factor 2 apart was rounded to float32 before its square was
    taken in float64: ``‖W_b − W_a‖`` of two unrelated float32 tensors (a re-initialised head, complex64 RoPE tables
    whose phase moved) was off torch's float64 figure by ~1e-9. Each difference is now taken in float64 (exact)."""
    g = torch.Generator().manual_seed(0)
    a = {"layers.0.w": torch.randn(4096, generator=g), "layers.1.freqs": torch.randn(512, 2, generator=g)}
    b = {"layers.0.w": torch.randn(4096, generator=g), "layers.1.freqs": torch.randn(512, 2, generator=g)}
    for name, sd in (("a", a), ("b", b)):
        model = {"layers.0.w": sd["layers.0.w"], "layers.1.freqs": torch.view_as_complex(sd["layers.1.freqs"])}
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / name), no_dist=True)
    res = runner.invoke(app, ["stats", "--json", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 0, res.stderr
    changes = {c["layer"]: c for c in json.loads(res.stdout)["changes"]}
    for key, layer in (("layers.0.w", "layers.0"), ("layers.1.freqs", "layers.1")):
        x, y = a[key].double(), b[key].double()
        want_abs = float((y - x).norm())
        assert math.isclose(changes[layer]["absolute"], want_abs, rel_tol=1e-12), (layer, changes[layer], want_abs)
        assert math.isclose(changes[layer]["relative"], want_abs / float(x.norm()), rel_tol=1e-12), changes[layer]


def test_change_columns_say_what_they_count(run3: list[Path], tmp_path: Path) -> None:
    """The change columns were headed ``Δ1→2``, ``Δ2→3`` (positions) over checkpoints named ``step-1``...: a reader
    took them for steps. Without known steps they are ``#N`` (the Nth checkpoint given), and the title says so;
    directories named by their step (``step-3`` given itself) head them by those steps."""
    import shutil

    res = runner.invoke(app, ["stats", *map(str, reversed(run3))], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stderr
    assert "Δ3→2" in res.stdout and "Δ2→1" in res.stdout and "consecutive checkpoints (steps)" in res.stdout
    unnamed = [shutil.copytree(p, tmp_path / f"run-{c}") for p, c in zip(reversed(run3), "abc")]
    res = runner.invoke(app, ["stats", *map(str, unnamed)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stderr
    assert "between consecutive checkpoints (#N: the Nth checkpoint given)" in res.stdout, res.stdout
    assert "Δ#1→#2" in res.stdout and "Δ#2→#3" in res.stdout and "Δ1→2" not in res.stdout, res.stdout


def test_checkpoints_given_out_of_step_order_are_warned_about(run3: list[Path], tmp_path: Path) -> None:
    """``ckpttool stats run/step-*`` with a ``step-10`` beside ``step-2``: the shell's glob sorts ``step-10`` before
    ``step-2``, and the changes were computed 1→10, 10→2 without a word, the ten-step jump read as one step's change.
    A checkpoint whose known step is below the one given before it is now a warning (with -q and --json too) naming
    the steps in the order given; checkpoints in run order (or two runs at one step) have none."""
    import shutil

    steps = {1: run3[0], 2: run3[1], 10: run3[2]}
    for s, src in steps.items():
        shutil.copytree(src, tmp_path / f"step-{s}")
    globbed = sorted(str(p) for p in tmp_path.glob("step-*"))  # what the shell gives: step-1, step-10, step-2
    assert [Path(p).name for p in globbed] == ["step-1", "step-10", "step-2"]
    want = (
        "warning: the checkpoints are not in step order (steps 1, 10, 2, as given): each change is between "
        "neighbours as given; give them in run order (a shell glob puts step-10 before step-2: ls -v, sort -V)"
    )
    for extra in ([], ["-q"], ["--json"]):
        res = runner.invoke(app, ["stats", *globbed, "--no-optimizer", *extra], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.stderr
        assert want in res.stderr.splitlines(), res.stderr
    in_order = sorted(globbed, key=lambda p: int(Path(p).name.split("-")[1]))
    res = runner.invoke(app, ["stats", *in_order, "--no-optimizer"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "warning" not in res.stderr, res.stderr
    assert "Δ1→2" in res.stdout and "Δ2→10" in res.stdout
    res = runner.invoke(app, ["stats", str(run3[0]), str(run3[0]), "--no-optimizer"])  # one step twice: no order
    assert res.exit_code == 0 and "warning" not in res.stderr, res.stderr


def test_a_run_root_without_step_says_how_to_follow_the_run(run3: list[Path], tmp_path: Path) -> None:
    """``ckpttool stats run/`` (a run's root, step-1 ... step-3 below it) said only "pick one with --step N|latest, or
    pass a directory": the way to see the run step by step, stats' point, was left unsaid. The hint now also names
    the steps' directories in run order (step-10 after step-2), as one command line."""
    import shlex
    import shutil

    root = tmp_path / "run"
    for s, src in ((1, run3[0]), (2, run3[1]), (10, run3[2])):
        shutil.copytree(src, root / f"step-{s}")
    res = runner.invoke(app, ["stats", str(root)])
    assert res.exit_code == 2 and res.stdout == ""
    err, hint = res.stderr.splitlines()
    assert err.startswith("error: [E204] ")
    follow = " ".join(shlex.quote(str(root / f"step-{s}")) for s in (1, 2, 10))
    assert hint.endswith(f"; or follow the run, its steps in run order: ckpttool stats {follow}"), hint
    assert "--step latest or --step N" in hint
    ok = runner.invoke(app, ["stats", *shlex.split(hint.rsplit("ckpttool stats ", 1)[1]), "--no-optimizer"])
    assert ok.exit_code == 0 and "Δ1→2" in ok.stdout and "Δ2→10" in ok.stdout, ok.stderr


def test_a_pair_given_again_has_its_own_change_column(run3: list[Path]) -> None:
    """``stats s1 s2 s1 s2``: three consecutive pairs, the JSON's 3 x layers changes, but the table's columns were
    keyed by the pair's paths, and the third pair (s1→s2 again) folded into the first: two columns, ``Δ#1→#2`` and
    ``Δ#2→#3``. Each pair given has its column now, its figures those of the JSON."""
    paths = [str(run3[0]), str(run3[1])] * 2
    res = runner.invoke(app, ["stats", *paths, "--no-optimizer"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stderr
    doc = json.loads(runner.invoke(app, ["stats", *paths, "--no-optimizer", "--json"]).stdout)
    layers = list(dict.fromkeys(ch["layer"] for ch in doc["changes"]))
    assert len(doc["changes"]) == 3 * len(layers)
    table = res.stdout.split("relative change", 1)[1].splitlines()
    head = next(ln for ln in table if "Δ#1→#2" in ln)
    assert "Δ#2→#3" in head and "Δ#3→#4" in head, res.stdout
    for layer in layers:
        row = next(ln for ln in table if ln.startswith(f"│ {layer} "))
        want = [f"{ch['relative']:.4g}" for ch in doc["changes"] if ch["layer"] == layer]
        assert [c.strip() for c in row.strip("│").split("│")[1:]] == want, (row, want)


def test_steps_the_trainer_saved_name_the_checkpoints(tmp_path: Path) -> None:
    """Step directories opened one by one had ``step: null`` though each saved ``train_state.step`` (torchtitan's
    item): the step is now the trainer's when its counters agree, and the change columns are headed by it."""
    paths = []
    for s in (100, 200):
        sd = {"model": {"layers.0.w": torch.full((4, 4), s / 100.0)}, "train_state": {"step": s}}
        with pytest.warns(UserWarning):  # "torch.distributed is disabled ... single process"
            dcp.save(sd, checkpoint_id=str(tmp_path / f"s{s}"))
        paths.append(str(tmp_path / f"s{s}"))
    res = runner.invoke(app, ["stats", *paths, "--json"])
    assert res.exit_code == 0, res.stderr
    assert [c["step"] for c in json.loads(res.stdout)["checkpoints"]] == [100, 200]
    res = runner.invoke(app, ["stats", *paths], env={"COLUMNS": "200"})
    assert "Δ100→200" in res.stdout and "consecutive checkpoints (steps)" in res.stdout, res.stdout


def test_nan_and_inf_are_counted_and_left_out_of_the_sums(tmp_path: Path) -> None:
    key = "model.layers.0.mlp.shared_experts.up_proj.weight"
    (path,) = _run(tmp_path, 1, nan_at=key)
    ref = torch_state(path, tmp_path)[f"model.{key}"].double().reshape(-1)
    row = next(t for t in collect_stats([path], StatsOptions()).checkpoints[0].tensors if t.fqn == key)
    finite = ref[torch.isfinite(ref)]
    assert row.nonfinite == 3 and row.numel == ref.numel()
    assert close(row.l2, float(finite.norm())) and close(row.mean, float(finite.mean()))
    layer = next(g for g in collect_stats([path], StatsOptions()).checkpoints[0].layers if g.name == "model.layers.0")
    assert layer.nonfinite == 3


@pytest.mark.parametrize("field", ["exp_avg", "exp_avg_sq"])
def test_update_size_of_moments_with_nan_is_nan(dense_ckpt: Path, tmp_path: Path, field: str) -> None:
    """A NaN and an infinity in one parameter's exp_avg gave a finite update size without a word, and in its
    exp_avg_sq a made-up one (the native kernel read them as 0: exp_avg / eps, rms 28 for a step of 1e-3); torch's
    next step there is not finite: the size is nan (JSON null), for the layer too, and a note names the parameter."""
    bad = copy_checkpoint(dense_ckpt, tmp_path / "bad")
    fqn = "model.layers.1.mlp.up_proj.weight"

    def poison(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[:2] = torch.tensor([math.nan, math.inf])
        return t

    damage.rewrite_tensor(bad, f"optimizer.state.{fqn}.{field}", poison)
    c = collect_stats([bad], StatsOptions()).checkpoints[0]
    (note,) = [n for n in c.notes if n.startswith("update size nan")]
    assert note.endswith(f"1 parameter(s), e.g. {fqn}") and "D001" in note
    u = next(u for u in c.updates if u.fqn == fqn)
    assert math.isnan(u.rms) and math.isnan(u.max) and u.to_dict()["rms"] is None
    layer = next(g for g in c.layers if g.name == "model.layers.1")
    assert layer.update_rms is not None and math.isnan(layer.update_rms)
    others = [u for u in c.updates if u.fqn != fqn]
    assert others and all(0 < u.rms < 1e-2 for u in others)
    clean = collect_stats([dense_ckpt], StatsOptions()).checkpoints[0]
    assert not any(n.startswith("update size nan") for n in clean.notes)
    res = runner.invoke(app, ["stats", str(bad)])
    assert res.exit_code == 0
    assert "note: " in res.stderr and "update size nan: exp_avg or exp_avg_sq holds NaN/Inf" in res.stderr
    assert "no update size" not in res.stderr


def test_update_size_where_exp_avg_sq_overflowed_is_torchs_step_not_nan(tmp_path: Path) -> None:
    """A gradient spike of 1e30 (a diverging run) overflows exp_avg_sq to +inf in float32 while exp_avg stays finite:
    torch's step there is lr * |m_hat| / inf = 0 (the weights move by weight decay only, checked below with
    torch.optim.AdamW on the loaded state). stats said "update size nan ... the next step writes non-finite weights
    there" for every such parameter; its size is the one torch computes, element by element, with a note."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for scale in (1.0, 1e30):  # a normal step, then the spike
        opt.zero_grad()
        (model(torch.randn(5, 4)).pow(2).sum() * scale).backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ckpt")
    ref = torch_state(tmp_path / "ckpt", tmp_path)
    m, v = ref["optimizer.state.0.weight.exp_avg"], ref["optimizer.state.0.weight.exp_avg_sq"]
    assert torch.isfinite(m).all() and torch.isinf(v).any() and not torch.isnan(v).any()
    c = collect_stats([tmp_path / "ckpt"], StatsOptions()).checkpoints[0]
    assert not any(n.startswith("update size nan") for n in c.notes)
    (note,) = [n for n in c.notes if n.startswith("update size 0 where exp_avg_sq overflowed")]
    assert "D001" in note and "4 parameter(s)" in note
    b1, b2 = ref["optimizer.param_groups.0.betas"]
    lr, eps = ref["optimizer.param_groups.0.lr"], ref["optimizer.param_groups.0.eps"]
    sizes: dict[str, list[torch.Tensor]] = {}
    for u in c.updates:
        step = float(ref[f"optimizer.state.{u.fqn}.step"])
        mh = ref[f"optimizer.state.{u.fqn}.exp_avg"].double() / (1 - b1**step)
        vh = ref[f"optimizer.state.{u.fqn}.exp_avg_sq"].double() / (1 - b2**step)
        want = lr * mh.abs() / (vh.sqrt() + eps)  # 0 where vh is +inf
        assert math.isclose(u.rms, float(want.pow(2).mean().sqrt()), rel_tol=1e-6, abs_tol=1e-30), u.fqn
        assert math.isclose(u.max, float(want.max()), rel_tol=1e-6, abs_tol=1e-30), u.fqn
        sizes.setdefault(u.layer, []).append(want.reshape(-1))
    for g in c.layers:  # the layer's RMS over its parameters' elements
        assert g.update_rms is not None and math.isclose(
            g.update_rms, float(torch.cat(sizes[g.name]).pow(2).mean().sqrt()), rel_tol=1e-6
        ), g.name
    assert json.loads(json.dumps(c.to_dict(), allow_nan=False))["updates"][0]["rms"] is not None
    # torch's own next step from this state: finite weights, moved by weight decay alone where exp_avg_sq is +inf
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    inf = torch.isinf(v)
    assert torch.isfinite(model[0].weight).all()
    assert torch.equal(model[0].weight.detach()[inf], (before * (1 - lr * 0.01))[inf])


def test_update_size_of_a_negative_second_moment_is_nan(dense_ckpt: Path, tmp_path: Path) -> None:
    """A negative value in one parameter's exp_avg_sq (a damaged moment: a sum of squares never is) was read as 0:
    ``lr * |m_hat| / eps``, an update RMS of thousands for a step of 1e-3, without a word, a divergence that never
    happened. torch's next step takes its square root (NaN, checked below on the loaded state): the size is nan
    (JSON null), for the layer too, and a note names the parameter."""
    bad = copy_checkpoint(dense_ckpt, tmp_path / "bad")
    fqn = "model.layers.1.mlp.up_proj.weight"

    def negate(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] = -t.view(-1)[0] - 1e-6
        return t

    damage.rewrite_tensor(bad, f"optimizer.state.{fqn}.exp_avg_sq", negate)
    v = torch_state(bad, tmp_path)[f"optimizer.state.{fqn}.exp_avg_sq"]
    assert float(v.min()) < 0 and math.isnan(float(v.double().sqrt().view(-1)[0]))  # torch's denominator there
    c = collect_stats([bad], StatsOptions()).checkpoints[0]
    (note,) = [n for n in c.notes if n.startswith("update size nan: exp_avg_sq holds negative")]
    assert note.endswith(f"1 parameter(s), e.g. {fqn}") and "D002" in note, note
    u = next(u for u in c.updates if u.fqn == fqn)
    assert math.isnan(u.rms) and math.isnan(u.max) and u.to_dict()["rms"] is None
    layer = next(g for g in c.layers if g.name == "model.layers.1")
    assert layer.update_rms is not None and math.isnan(layer.update_rms)
    others = [u for u in c.updates if u.fqn != fqn]
    assert others and all(0 < u.rms < 1e-2 for u in others)
    clean = collect_stats([dense_ckpt], StatsOptions()).checkpoints[0]
    assert not any(n.startswith("update size nan") for n in clean.notes)
    res = runner.invoke(app, ["stats", str(bad)])
    assert res.exit_code == 0 and "update size nan: exp_avg_sq holds negative values" in res.stderr, res.stderr


def test_step_latest_past_an_unfinished_newer_save_says_so(dense_ckpt: Path, tmp_path: Path) -> None:
    """`stats RUN --step latest` measured step 1 while step 2's save had not finished, without a word (replay-step
    and validate's R001 name it); a note now does, on stderr and in the JSON notes."""
    copy_checkpoint(dense_ckpt, tmp_path / "run" / "step-1")
    newer = copy_checkpoint(dense_ckpt, tmp_path / "run" / "step-2")
    (newer / ".metadata").rename(newer / ".metadata.tmp")  # FileSystemWriter's name until every rank finished
    res = runner.invoke(app, ["stats", str(tmp_path / "run"), "--step", "latest"])
    assert res.exit_code == 0, res.output
    assert "step-1 (torch-native, step 1)" in res.stdout
    assert "a newer step's save did not finish: step 2" in res.stderr and "(R001)" in res.stderr
    assert "no update size" not in res.stderr
    doc = json.loads(runner.invoke(app, ["stats", str(tmp_path / "run"), "--step", "latest", "--json"]).stdout)
    assert any("step 2" in n and ".metadata.tmp" in n for n in doc["checkpoints"][0]["notes"])
    clean = json.loads(runner.invoke(app, ["stats", str(tmp_path / "run" / "step-1"), "--json"]).stdout)
    assert not any("did not finish" in n for n in clean["checkpoints"][0]["notes"])


def test_update_size_of_state_made_up_before_the_first_step_says_so(tmp_path: Path) -> None:
    """A save before the first optimizer step (get_state_dict's zero-lr step: step 1, all-zero moments) had an
    update rms of 0 without a word, as if a step had moved nothing; a note says it is no training step's (D005)."""
    from tests.fixtures.builders import build_linear_stepped

    for steps in (0, 1):
        build_linear_stepped(tmp_path / f"s{steps}", lambda p: torch.optim.AdamW(p, lr=1e-2), steps=steps)
    before, after = collect_stats([tmp_path / "s0", tmp_path / "s1"], StatsOptions()).checkpoints
    (note,) = [n for n in before.notes if "no training step" in n]
    assert "D005" in note and note.endswith("2 parameter(s), e.g. weight")
    assert {u.rms for u in before.updates} == {0.0}
    assert not any("no training step" in n for n in after.notes) and all(u.rms > 0 for u in after.updates)
    res = runner.invoke(app, ["stats", str(tmp_path / "s0")])
    assert res.exit_code == 0 and "note: " in res.stderr and "update size of no training step" in res.stderr
    assert "no update size" not in res.stderr


def test_groups_by_layer_and_module_type() -> None:
    assert layer_of("model.layers.12.mlp.experts.3.w1.weight") == "model.layers.12"
    assert module_of("model.layers.12.mlp.experts.3.w1.weight") == "model.layers.*.mlp.experts.*.w1.weight"
    assert layer_of("tok_embeddings.weight") == "tok_embeddings" and layer_of("norm") == "norm"


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_table_json_and_filter(dense_ckpt: Path) -> None:
    res = runner.invoke(app, ["stats", str(dense_ckpt)])
    assert res.exit_code == 0, res.stderr
    assert "model.layers.0" in res.stdout and "update rms" in res.stdout
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--json", "--filter", "*layers.1.*"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert not list(jsonschema.Draft202012Validator(load_schema("stats")).iter_errors(doc))
    fqns = {t["fqn"] for t in doc["checkpoints"][0]["tensors"]}
    assert fqns and all(".layers.1." in f for f in fqns)
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--filter", "nothing.matches"])
    assert res.exit_code == 2 and "no tensor to measure" in res.stderr and "Traceback" not in res.stderr


def test_cli_by_tensor_and_module(dense_ckpt: Path) -> None:
    wide = {"COLUMNS": "250"}
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--by", "tensor", "--no-optimizer"], env=wide)
    assert res.exit_code == 0 and "model.model.layers.0.mlp.down_proj.weight" in res.stdout
    assert "exp_avg" not in res.stdout
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--by", "module"], env=wide)
    assert res.exit_code == 0 and "model.layers.*.mlp.down_proj.weight" in res.stdout


def test_damaged_chunk_is_a_coded_error(dense_ckpt: Path, tmp_path: Path) -> None:
    bad = copy_checkpoint(dense_ckpt, tmp_path / "bad")
    damage.corrupt_chunk_bytes(bad, "model.model.layers.0.mlp.down_proj.weight")
    res = runner.invoke(app, ["stats", str(bad)])
    assert res.exit_code == 2, res.stdout
    assert res.stderr.startswith("error: [E") and "down_proj" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_plot_files_are_written_and_decodable(suffix: str, run3: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")
    paths = run3
    out = tmp_path / f"norms{suffix}"
    res = runner.invoke(app, ["stats", *map(str, paths), "--plot", str(out)])
    assert res.exit_code == 0, res.stderr
    data = out.read_bytes()
    if suffix == ".png":
        import matplotlib.image

        img = matplotlib.image.imread(out)
        assert img.shape[0] > 200 and img.shape[1] > 200
    elif suffix == ".svg":
        assert ET.fromstring(data).tag.endswith("svg")
    else:
        text = data.decode()
        assert text.startswith("<!DOCTYPE html>") and "<svg" in text and "<script" not in text
        ET.fromstring(text[text.index("<svg") : text.index("</svg>") + 6])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_plot_refused_before_any_work(dense_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--plot", str(tmp_path / "x.gif")])
    assert res.exit_code == 2 and "unknown picture format" in res.stderr
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--plot", str(tmp_path)])  # a directory: said so
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E100] --plot {tmp_path} is a directory\n")
    # a URL: said so (was 'directory s3:/bucket does not exist', hint 'create it first'), for diff too
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--plot", "s3://bucket/run/norms.png"])
    assert res.exit_code == 2 and res.stderr == (
        "error: [E100] --plot s3://bucket/run/norms.png: a URL; --plot writes a local file only\n"
        "hint: give a local file name and copy the picture to object storage yourself\n"
    )
    res = runner.invoke(app, ["diff", str(dense_ckpt), str(dense_ckpt), "--plot", "gs://b/d.svg"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E100] --plot gs://b/d.svg: a URL;")
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from ckpttool.cli import main\n"
        f"sys.argv = ['ckpttool', 'stats', {str(dense_ckpt)!r}, '--plot', {str(tmp_path / 'x.png')!r}]\n"
        "main()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (
        p.returncode == 2
        and "hint: pip install 'matplotlib>=3.8' (or pip install -e '.[plot]' in the ckpttool source folder)"
        in p.stderr
        and "Traceback" not in p.stderr
    )
    assert not (tmp_path / "x.png").exists() and p.stdout == ""


@pytest.mark.parametrize("command", ["stats", "diff"])
def test_plot_name_the_system_refuses_is_one_coded_line(command: str, dense_ckpt: Path, tmp_path: Path) -> None:
    """``--plot`` with a file name of 300 characters (over NAME_MAX, 255): the stat of the target raised
    ``OSError: [Errno 36] File name too long`` and the command ended ``E999 internal error``; it is E600 naming
    the option and the system's reason, before anything is read, and nothing is written."""
    import errno
    import os

    name = tmp_path / ("x" * 300 + ".png")
    with pytest.raises(OSError) as raised:  # what the system says of that name
        os.stat(name)
    assert raised.value.errno == errno.ENAMETOOLONG
    args = [command, str(dense_ckpt)] + ([str(dense_ckpt)] if command == "diff" else []) + ["--plot", str(name)]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    err, hint = res.stderr.splitlines()
    assert err == f"error: [E600] --plot {name}: cannot be used as a file name (File name too long)", err
    assert hint.startswith("hint: ") and "E999" not in res.stderr
    assert os.listdir(tmp_path) == []


def test_matplotlib_is_imported_only_by_the_plot_module() -> None:
    root = Path(__file__).resolve().parents[3] / "ckpttool"
    users = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"^\s*(import|from) matplotlib", p.read_text(), re.M)
    )
    assert users == ["ui/plot.py"], users


def test_diff_plot_and_its_per_layer_figures_agree_with_stats(run3: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")
    """``diff B A`` per layer (||b - a|| / ||a||) is what ``stats A B`` calls the change from A to B."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import diff_layers

    a, b = run3[0], run3[1]
    res = diff_checkpoints(str(b), str(a), DiffOptions())
    got = {name.removeprefix("model."): rel for name, rel, _ in diff_layers(res)}
    want = {ch.layer: ch.relative for ch in collect_stats([a, b], StatsOptions()).changes}
    assert got.keys() == want.keys()
    for layer, rel in want.items():
        assert rel is not None and got[layer] is not None and math.isclose(got[layer], rel, rel_tol=1e-6), layer
    out = tmp_path / "diff.svg"
    cli = runner.invoke(app, ["diff", str(b), str(a), "--plot", str(out)])
    assert cli.exit_code == 1, cli.stderr  # the checkpoints differ
    # said as stats says it: the last line of the result, on stdout, with -q too
    assert ET.fromstring(out.read_bytes()).tag.endswith("svg") and cli.stdout.splitlines()[-1] == f"wrote {out}"
    quiet = runner.invoke(app, ["-q", "diff", str(b), str(a), "--plot", str(out)])
    assert quiet.stdout.splitlines()[-1] == f"wrote {out}" and quiet.stderr == ""
    refused = runner.invoke(app, ["diff", str(b), str(a), "--plot", str(tmp_path / "x.jpg")])
    assert refused.exit_code == 2 and "unknown picture format" in refused.stderr
    # --json: the document on stdout, where the picture went on stderr (diff and stats alike)
    for argv in (["diff", str(b), str(a)], ["stats", str(a)]):
        js = runner.invoke(app, [*argv, "--plot", str(out), "--json"])
        assert json.loads(js.stdout) and js.stderr.splitlines()[-1] == f"note: wrote {out}", js.stderr


@pytest.mark.parametrize(("name", "code"), [("chunks_gap", "[E303]"), ("chunks_overlap", "[E301]")])
def test_chunks_that_do_not_tile_are_refused(sample_ckpt: Path, tmp_path: Path, name: str, code: str) -> None:
    """stats measures chunk by chunk: chunks with a gap (rows [0, 3) and [5, 8) of 8) or an overlap were measured
    as they are (a tensor with a hole, rows counted twice) and reported, exit 0; now refused as read_tensor does."""
    from tests.fixtures.hostile import EXPERT_KEY, build_entry

    entry = build_entry(tmp_path / "corpus", sample_ckpt, name)
    res = runner.invoke(app, ["stats", str(entry.ckpt)])
    assert res.exit_code == 2 and code in res.stderr and EXPERT_KEY in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_quantized_weights_are_left_out_not_measured_as_their_codes(tmp_path: Path) -> None:
    # an FP8 export's weights were measured as their e4m3fn codes (abs max 448) and their scales as weights
    from safetensors.torch import save_file

    w = torch.randn(32, 16) * 0.02
    scale = (w.abs().amax() / 448).reshape(1, 1)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": (w / scale).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.up_proj.weight_scale_inv": scale,
            "model.norm.weight": torch.ones(16),
        },
        str(fp8 / "model.safetensors"),
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file(
        {"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(16)}, str(plain / "model.safetensors")
    )
    res = runner.invoke(app, ["stats", "--json", str(plain), str(fp8)])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    assert [t["key"] for t in doc["checkpoints"][1]["tensors"]] == ["model.norm.weight"]
    assert doc["checkpoints"][1]["notes"] == [
        "quantized weights left out (their stored FP8/FP4 codes and scales are not the weights' values): "
        "1 parameter(s), e.g. model.layers.0.mlp.up_proj.weight"
    ]
    assert doc["skipped"] == [
        f"model.layers.0.mlp.up_proj.weight: quantized in {fp8} (stored codes and scales, not values)"
    ]
    res = runner.invoke(app, ["stats", str(fp8)], env={"COLUMNS": "200"})
    # no FP8 code (448 is E4M3's largest) shown as a value; the temporary folder's name may hold "448" (pytest-448)
    assert res.exit_code == 0 and "448" not in res.stdout.replace(str(fp8), "FP8_DIR")
    assert res.stderr.startswith(f"note: {fp8}: quantized weights left out"), res.stderr


def test_a_checkpoint_of_quantized_weights_only_says_so(tmp_path: Path) -> None:
    # every weight left out as quantized: the error was 'no tensor to measure' with the hint to check a
    # --filter never given, and nothing said the weights were left out
    from safetensors.torch import save_file

    w = torch.randn(32, 16) * 0.02
    scale = (w.abs().amax() / 448).reshape(1, 1)
    (tmp_path / "fp8").mkdir()
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": (w / scale).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.up_proj.weight_scale_inv": scale,
        },
        str(tmp_path / "fp8" / "model.safetensors"),
    )
    res = runner.invoke(app, ["stats", str(tmp_path / "fp8")])
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        f"error: [E100] {tmp_path / 'fp8'}: no tensor to measure; its 1 quantized weight(s) are left out "
        "(FP8/FP4 codes and scales, not values)",
        "hint: measure the unquantized checkpoint it was made from, or `ckpttool import` it (weights dequantized)",
    ]


def test_expert_norms_and_changes_are_in_true_expert_order_for_a_legacy_layout(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    # a legacy EP layout stores experts permuted on dim 0: stats listed their norms in stored order
    # (expert 2's norm was expert 4's) and measured a change of 0.19 between a checkpoint and its
    # reshard, which hold the same values
    legacy = tmp_path / "legacy"
    res = runner.invoke(
        app,
        ["reshard", str(sample_ckpt), str(legacy), "--to", "legacy", "--target-ep-size", "2",
         "--target-ep-fsdp-size", "2", "--with-optimizer", "-q"],
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["stats", "--json", str(sample_ckpt), str(legacy)])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    canon, leg = ({e["key"]: e["norms"] for e in c["experts"]} for c in doc["checkpoints"])
    assert canon and leg == canon
    assert len(set(next(iter(canon.values())))) > 1  # distinct norms: a permutation would show
    assert doc["changes"] and all(c["relative"] == 0 for c in doc["changes"]), doc["changes"]
    assert doc["skipped"] == []


def test_a_note_says_no_update_size_only_where_it_explains_one() -> None:
    from ckpttool.ops.stats.run import QUANTIZED_NOTE, STORED_ORDER_NOTE, note_line

    assert note_line("no param group or step saved: 1 parameter(s)") == (
        "no update size: no param group or step saved: 1 parameter(s)"
    )
    assert note_line(f"{QUANTIZED_NOTE}: 2 tensor(s)") == f"{QUANTIZED_NOTE}: 2 tensor(s)"
    assert note_line(STORED_ORDER_NOTE) == STORED_ORDER_NOTE


def test_change_of_a_layer_that_became_nan_is_not_a_number(tmp_path: Path) -> None:
    # a NaN was read as 0: a layer whose weight diverged showed a finite relative change (0.25 here)
    import warnings

    import torch.distributed.checkpoint as dcp

    def save(out: Path, w1: torch.Tensor) -> Path:
        state = {"model": {"layers.0.w": torch.ones(4, 4), "layers.1.w": w1}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(out), no_dist=True)
        return out

    w = torch.ones(4, 4)
    bad = w.clone()
    bad[1, 2] = float("nan")
    a, b = save(tmp_path / "a", w), save(tmp_path / "b", bad)
    res = runner.invoke(app, ["stats", "--json", str(a), str(b)])
    assert res.exit_code == 0, res.stderr
    assert [(c["layer"], c["relative"]) for c in json.loads(res.stdout)["changes"]] == [
        ("layers.0", 0.0),
        ("layers.1", None),
    ]
    table = runner.invoke(app, ["stats", str(a), str(b)]).stdout
    assert re.search(r"│ layers\.1 +│ +nan │", table), table


def test_one_source_and_no_options_are_the_list_of_one_and_the_defaults(dense_ckpt: Path) -> None:
    """``collect_stats("ckpt/")`` split the path into characters ("c: no such directory"), ``options=None``
    was an AttributeError, and a str ``filters`` was globbed character by character."""
    from ckpttool.errors import UsageError
    from ckpttool.model.checkpoint import open_checkpoint

    def measured(res: Any) -> str:
        return re.sub(r'"seconds": [0-9.e-]+', "", json.dumps(res.to_dict()["checkpoints"]))

    want = measured(collect_stats([dense_ckpt], StatsOptions()))
    assert measured(collect_stats(str(dense_ckpt))) == want
    with open_checkpoint(dense_ckpt) as ck:
        assert measured(collect_stats(ck)) == want
    with pytest.raises(UsageError, match="`filters` 'model.\\*' is not a sequence of non-empty globs"):
        collect_stats([dense_ckpt], StatsOptions(filters="model.*"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="`options` must be a StatsOptions, got dict"):
        collect_stats([dense_ckpt], {})  # type: ignore[arg-type]


def test_complex_tensors_are_said_to_be_moduli_and_change_with_their_phase(tmp_path: Path) -> None:
    """RoPE's ``freqs_cis`` (complex64, torchtitan's ``precompute_freqs_cis``): ``stats`` measures its moduli and
    says so; the change between two checkpoints compares the complex values (a change of RoPE theta moves only
    the phase: the moduli are all 1, and the change was reported as 0.0)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def freqs_cis(theta: float) -> torch.Tensor:
        freqs = 1.0 / (theta ** (torch.arange(0, 8, 2).float() / 8))
        return torch.polar(torch.ones(16, 4), torch.outer(torch.arange(16).float(), freqs))

    def save(out: Path, theta: float) -> Path:
        state = {"model": {"freqs_cis": freqs_cis(theta), "layers.0.w": torch.ones(4, 4)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(out), no_dist=True)
        return out

    a, b = save(tmp_path / "a", 10000.0), save(tmp_path / "b", 500000.0)
    res = runner.invoke(app, ["stats", "--json", str(a), str(b)])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    za, zb = freqs_cis(10000.0).to(torch.complex128), freqs_cis(500000.0).to(torch.complex128)
    want = float((zb - za).abs().norm() / za.abs().norm())
    (change,) = [c for c in doc["changes"] if c["layer"] == "freqs_cis"]
    assert change["relative"] is not None and math.isclose(change["relative"], want, rel_tol=1e-6), change
    assert want > 0.1
    row = next(t for t in doc["checkpoints"][0]["tensors"] if t["fqn"] == "freqs_cis")
    assert close(row["l2"], float(za.abs().norm())) and close(row["mean"], 1.0)
    assert [n for n in doc["checkpoints"][0]["notes"] if "moduli" in n] == [
        "complex tensors measured by their moduli |z| (mean and std are of |z|; abs max, L2 and zeros exact): "
        "1 parameter(s), e.g. model.freqs_cis"
    ]
    text = runner.invoke(app, ["stats", str(a)])
    assert text.exit_code == 0 and "note: " in text.stderr and "moduli |z|" in text.stderr, text.stderr


@pytest.mark.parametrize("optimizer", ["RAdam", "AdamW-amsgrad"])
def test_no_update_size_for_a_group_whose_step_is_not_adamw(tmp_path: Path, optimizer: str) -> None:
    """RAdam (and AdamW with amsgrad) save AdamW's moments: the update size was the AdamW step's, a step their
    trainer never takes. As replay-step refuses such groups (E514), stats leaves the update out with a note."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    params = model.parameters()
    opt = torch.optim.RAdam(params, lr=1e-2) if optimizer == "RAdam" else torch.optim.AdamW(params, amsgrad=True)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    res = runner.invoke(app, ["stats", "--json", str(tmp_path / "ck")])
    assert res.exit_code == 0, res.stderr
    (doc,) = json.loads(res.stdout)["checkpoints"]
    assert doc["updates"] == []
    assert doc["notes"] == [
        "not an AdamW param group (amsgrad, RAdam or NAdam: another step): 2 parameter(s), e.g. weight"
    ]


@pytest.mark.parametrize(
    "edit",
    [{"betas": (1.0, 0.999)}, {"betas": (0.9, 1.0)}, {"lr": -1e-3}, {"eps": -1e-8}, {"lr": "0.01"}, {"maximize": "no"}],
)
def test_no_update_size_from_hyperparameters_outside_adamws_domain(tmp_path: Path, edit: dict[str, Any]) -> None:
    """A param group saved with betas[0] 1.0 (edited, merged wrongly: torch.optim.AdamW refuses to build one) made
    stats stop with 'error: [E999] internal error: ZeroDivisionError' (its bias correction 1 - 1^step is 0). As
    replay-step refuses such a group (E514), stats leaves the update out with a note and measures the rest. stats
    kept its own copy of the domain checks: an lr saved as the string '0.01' (torch's resume raises TypeError) or
    maximize as 'no' (torch steps uphill) got an update size. The note now comes from validate's P006 check."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0].update(edit)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    res = runner.invoke(app, ["stats", "--json", str(tmp_path / "ck")])
    assert res.exit_code == 0, res.stderr
    (doc,) = json.loads(res.stdout)["checkpoints"]
    assert doc["updates"] == [] and len(doc["tensors"]) == 6
    assert doc["notes"] == [
        "hyperparameters torch.optim cannot step with (validate: P006): 2 parameter(s), e.g. weight"
    ]


def test_a_tensor_new_in_the_later_checkpoint_is_named_as_not_compared(tmp_path: Path) -> None:
    """A tensor only in B (a layer added, a key renamed) was silently left out of the change; one only in A
    was named: both are listed in ``skipped`` and on the 'not compared' lines."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    w0, w1 = torch.randn(8, 8), torch.randn(4, 8)
    sides = {
        "a": {"layers.0.weight": w0, "layers.1.weight": w1, "emb.weight": torch.randn(4, 4)},
        "b": {"layers.0.weight": w0 + 0.01, "layers.1.weight": w1, "head.weight": torch.randn(3, 4)},
    }
    for name, sd in sides.items():
        dcp.save({"model": sd}, checkpoint_id=str(tmp_path / name))
    a, b = tmp_path / "a", tmp_path / "b"
    res = runner.invoke(app, ["stats", "--json", str(a), str(b)])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    assert doc["skipped"] == [f"emb.weight: missing in {b}", f"head.weight: missing in {a}"]
    assert [(c["layer"], c["tensors"]) for c in doc["changes"]] == [("layers.0", 1), ("layers.1", 1)]
    table = runner.invoke(app, ["stats", str(a), str(b)])
    assert f"not compared: head.weight: missing in {a}" in table.stdout
    assert runner.invoke(app, ["stats", "--json", "--filter", "layers.*", str(a), str(b)]).stdout.count("missing") == 0


def test_a_tensor_with_no_finite_value_has_no_abs_max(tmp_path: Path) -> None:
    """An all-inf/NaN weight: abs max null in JSON and nan in the table, for the tensor and its layer (was 0.0:
    the engine's 'none', shown as if the largest value were 0). Its L2, and its layer's weight norm where every
    parameter value is non-finite, likewise (was 0: a zeroed layer, as a dead expert's was); a layer with some
    finite parameter values (a bias) has their norm (torch's, of the finite values)."""
    import torch.distributed.checkpoint as dcp

    sd = {"layers.0.weight": torch.full((4, 4), math.inf), "layers.1.weight": torch.full((4,), math.nan)}
    sd["layers.1.bias"] = torch.tensor([0.5, -2.0])
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "c"))
    res = runner.invoke(app, ["stats", "--json", "--by", "tensor", str(tmp_path / "c")])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    got = {t["fqn"]: (t["abs_max"], t["nonfinite"]) for t in doc["checkpoints"][0]["tensors"]}
    assert got == {"layers.0.weight": (None, 16), "layers.1.weight": (None, 4), "layers.1.bias": (2.0, 0)}
    layers = {g["name"]: g["abs_max"] for g in doc["checkpoints"][0]["layers"]}
    assert layers == {"layers.0": None, "layers.1": 2.0}
    l2 = {t["fqn"]: t["l2"] for t in doc["checkpoints"][0]["tensors"]}
    assert l2["layers.0.weight"] is None and l2["layers.1.weight"] is None
    assert close(l2["layers.1.bias"], float(sd["layers.1.bias"].double().norm()))
    norms = {g["name"]: g["norms"] for g in doc["checkpoints"][0]["layers"]}
    assert norms["layers.0"] == {"weight": None}
    assert list(norms["layers.1"]) == ["weight"] and close(norms["layers.1"]["weight"], l2["layers.1.bias"])
    table = runner.invoke(app, ["stats", "--wide", str(tmp_path / "c")]).stdout
    assert re.search(r"│ layers\.0 +│ +16 │ +nan │ +nan │ +16 │", table), table


def test_an_empty_tensor_has_no_share_of_zeros_and_int_tensors_match_torch(tmp_path: Path) -> None:
    """A tensor of no element (a [0, 4] parameter) said 0.0% zeros (JSON 0.0) beside its null mean: a share of no
    values is null (`-` in the table). Integer and bool buffers are measured as torch measures them in float64."""
    import torch.distributed.checkpoint as dcp

    sd = {
        "empty": torch.zeros(0, 4),
        "counts": torch.tensor([0, 3, -7, 0, 2**40], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "codes": torch.tensor([-3, 0, 5], dtype=torch.int8),
    }
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    res = runner.invoke(app, ["stats", "--json", "--by", "tensor", str(tmp_path / "c")])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    rows = {t["fqn"]: t for t in doc["checkpoints"][0]["tensors"]}
    assert rows["empty"]["numel"] == 0 and rows["empty"]["zero_fraction"] is None and rows["empty"]["mean"] is None
    for name in ("counts", "mask", "codes"):
        x = sd[name].to(torch.float64)
        want = (x.mean(), x.std(unbiased=False), x.abs().max(), x.norm(), (x == 0).double().mean())
        got = [rows[name][k] for k in ("mean", "std", "abs_max", "l2", "zero_fraction")]
        assert all(close(g, float(w)) for g, w in zip(got, want, strict=True)), (name, got, want)
    table = runner.invoke(app, ["stats", "--wide", "--by", "tensor", str(tmp_path / "c")]).stdout
    assert re.search(r"│ model\.empty .*│ +- │\n", table), table


def test_a_parameter_of_no_element_has_no_figure_in_the_table_or_json(tmp_path: Path) -> None:
    """A parameter of no element (a [0, 4] weight, stepped by AdamW: torch keeps its moments) said `nan` for its mean,
    std and abs max in the table, as an all-NaN tensor's, beside `-` for its zeros and NaN/Inf; its update's max was
    JSON 0.0 beside a null rms. No element: `-` in the table, null in JSON, for every figure but its L2 (a sum, 0)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.empty = torch.nn.Parameter(torch.zeros(0, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum() + (self.empty @ x.T).sum()

    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).backward()
    opt.step()
    assert opt.state[m.empty]["exp_avg"].shape == (0, 4)  # torch keeps state of no element
    msd, osd = get_state_dict(m, opt)
    save_quiet({"model": msd, "optim": osd}, tmp_path / "c")
    doc = json.loads(runner.invoke(app, ["stats", "--json", str(tmp_path / "c")]).stdout)
    jsonschema.validate(doc, load_schema("stats"))
    c = doc["checkpoints"][0]
    empty = {t["key"]: t for t in c["tensors"] if t["fqn"] == "empty"}
    assert set(empty) == {"model.empty", "optim.state.empty.exp_avg", "optim.state.empty.exp_avg_sq"}, empty
    for t in empty.values():
        assert [t[k] for k in ("numel", "mean", "std", "abs_max", "l2", "zero_fraction")] == [
            0,
            None,
            None,
            None,
            0.0,
            None,
        ]
    (u,) = [u for u in c["updates"] if u["fqn"] == "empty"]
    assert (u["numel"], u["rms"], u["max"]) == (0, None, None), u
    table = runner.invoke(app, ["stats", "--wide", "--by", "tensor", str(tmp_path / "c")]).stdout
    for key in empty:
        # key, role, dtype, numel 0, mean, std, abs max: -, L2 0, zeros -
        assert re.search(rf"│ {re.escape(key)} +│ \w+ +│ float32 │ +0 │ +- │ +- │ +- │ +0 │ +- │", table), table
    assert "nan" not in table, table


def test_change_of_a_layer_all_zero_in_the_earlier_checkpoint_is_inf_or_0(tmp_path: Path) -> None:
    """A zero-initialised layer (a LoRA B, an AdaLN-Zero gate) has ||W_a|| = 0: its change was None, a blank `-` in
    the table, as if not computed, whether it moved or not; now `inf` where it moved (JSON null), 0 where it stayed."""
    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.no_grad():
        m[1].weight.zero_()
        m[1].bias.zero_()
    m.register_buffer("still", torch.zeros(3))  # layer "still": zero in both
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    save_quiet({"model": m.state_dict()}, tmp_path / "a")
    train_steps(m, opt, 2)
    save_quiet({"model": m.state_dict()}, tmp_path / "b")
    rel = {ch.layer: ch.relative for ch in collect_stats([tmp_path / "a", tmp_path / "b"]).changes}
    assert rel["1"] == math.inf and rel["still"] == 0.0 and rel["0"] is not None and 0 < rel["0"] < 1, rel
    res = runner.invoke(app, ["stats", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 0, res.stderr
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in res.stdout.splitlines() if ln.count("│") == 3}
    assert rows["1"] == "inf" and rows["still"] == "0", res.stdout
    doc = json.loads(runner.invoke(app, ["stats", "--json", str(tmp_path / "a"), str(tmp_path / "b")]).stdout)
    assert {c["layer"]: c["relative"] for c in doc["changes"]}["1"] is None


def test_per_layer_table_fits_a_60_column_terminal(tmp_path: Path) -> None:
    """At 60 columns the per-layer table of a checkpoint with moments was 72 cells wide (only `abs max` could give
    way, the layer names were too short to fold), so the terminal wrapped every line of it; the second moments'
    norm now gives way too, named below the table."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train_steps(m, opt, 2)
    msd, osd = get_state_dict(m, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    res = runner.invoke(app, ["stats", str(tmp_path / "ck")], env={"COLUMNS": "60"})
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(ln) for ln in lines if ln[:1] in "┏┃┡│└") <= 60, res.stdout
    assert "  (not shown at 60 columns: abs max, ‖exp_avg_sq‖; see --wide or --json)" in lines
    assert "‖exp_avg‖" in res.stdout and "update rms" in res.stdout
    wide = runner.invoke(app, ["stats", str(tmp_path / "ck")], env={"COLUMNS": "200"})
    assert "‖exp_avg_sq‖" in wide.stdout and "abs max" in wide.stdout and "not shown" not in wide.stdout


def test_checkpoints_of_different_models_are_said_to_be_so_once(dense_ckpt: Path, sample_ckpt: Path) -> None:
    """Two checkpoints of different models given together: a `not compared` line per tensor (40 here, `another
    shape` or `missing`) and no word on why nothing was; now one line first says they share no tensor."""
    res = runner.invoke(app, ["stats", str(dense_ckpt), str(sample_ckpt), "--no-optimizer"])
    assert res.exit_code == 0, res.stderr
    skipped = [ln for ln in res.stdout.splitlines() if ln.startswith("not compared: ")]
    assert skipped[0] == (
        f"not compared: {dense_ckpt} and {sample_ckpt} have no model tensor of one name and shape in common: "
        "checkpoints of different models? (the change is between checkpoints of one run)"
    )
    assert len(skipped) > 20 and "relative change" not in res.stdout
    # checkpoints of one model: nothing skipped, no such line
    doc = collect_stats([dense_ckpt, dense_ckpt], StatsOptions(optimizer=False))
    assert doc.changes and not doc.skipped


def test_per_tensor_table_fits_a_60_column_terminal(dense_ckpt: Path, tmp_path: Path) -> None:
    """``stats --by tensor`` at 60 columns printed a 105-column table (no column could give way) that the terminal
    wrapped into a jumble; zeros, mean, dtype, numel and std now give way, named below it, and key, role, abs max and
    L2 stay, the L2 that torch computes of each tensor."""
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--by", "tensor"], env={"COLUMNS": "60"})
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(ln) for ln in lines if ln[:1] in "┏┃┡│└") <= 60, res.stdout
    (hidden,) = [ln for ln in lines if ln.startswith("  (not shown at 60 columns: ")]
    assert "zeros" in hidden and "L2" not in hidden and "abs max" not in hidden, hidden
    head = next(ln for ln in lines if ln.startswith("┃ key"))
    names = [c.strip() for c in head.strip("┃").split("┃")]
    assert names[:2] == ["key", "role"] and "L2" in names and "abs max" in names, names
    ref = torch_state(dense_ckpt, tmp_path)
    wide = runner.invoke(app, ["stats", str(dense_ckpt), "--by", "tensor", "--wide"], env={"COLUMNS": "60"})
    rows = [ln for ln in wide.stdout.splitlines() if ln.startswith("│ model.")]
    assert rows
    wide_head = next(ln for ln in wide.stdout.splitlines() if ln.startswith("┃ key"))
    at = [c.strip() for c in wide_head.strip("┃").split("┃")].index("L2")
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[at] == f"{float(ref[cells[0]].double().norm()):.4g}", cells


def test_change_table_of_many_checkpoints_is_split_to_fit_the_terminal(run3: list[Path]) -> None:
    """``stats`` of 12 checkpoints at 80 columns printed one change table 128 columns wide (11 Δ columns, none of
    which may give way) that the terminal wrapped into a jumble. It is now printed as several tables that each fit,
    every one with the layer column, the Δ columns in order, each figure the one --json has; --wide keeps one."""
    paths = [str(run3[i % 3]) for i in range(12)]
    res = runner.invoke(app, ["stats", *paths, "--no-optimizer", "-q"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.stderr
    part = res.stdout.split("relative change", 1)[1].splitlines()
    assert max(len(ln) for ln in part if ln[:1] in "┏┃┡│└") <= 80, res.stdout
    heads = [ln for ln in part if ln.startswith("┃ layer")]
    assert len(heads) > 1
    shown = [c.strip() for h in heads for c in h.strip("┃").split("┃")[1:]]
    assert shown == [f"Δ#{i}→#{i + 1}" for i in range(1, 12)], shown
    doc = json.loads(runner.invoke(app, ["stats", *paths, "--no-optimizer", "--json"]).stdout)
    layer = doc["changes"][0]["layer"]
    got = [c.strip() for ln in part if ln.startswith(f"│ {layer} ") for c in ln.strip("│").split("│")[1:]]
    assert got == [f"{ch['relative']:.4g}" for ch in doc["changes"] if ch["layer"] == layer]
    wide = runner.invoke(app, ["stats", *paths, "--no-optimizer", "-q", "--wide"], env={"COLUMNS": "80"})
    assert len([ln for ln in wide.stdout.split("relative change", 1)[1].splitlines() if ln.startswith("┃ layer")]) == 1


def test_a_layer_without_model_tensors_has_no_abs_max_not_nan(dense_ckpt: Path, tmp_path: Path) -> None:
    """``stats --filter 'optimizer.*'`` (the moments only): each layer's ``abs max`` (of its model tensors, none
    measured) read ``nan``, what the table prints for weights that hold only NaN/Inf: a divergence that is not
    there. It is blank (the column left out when no layer has one); a layer whose weights are all NaN still says
    nan."""
    res = runner.invoke(app, ["stats", str(dense_ckpt), "--filter", "optimizer.*"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stderr
    table = [ln for ln in res.stdout.splitlines() if ln[:1] in "┃│"]
    assert table and not any("nan" in ln for ln in table), res.stdout
    assert "abs max" not in table[0] and "‖exp_avg‖" in table[0], table[0]
    bad = copy_checkpoint(dense_ckpt, tmp_path / "bad")
    fqn = "model.layers.1.mlp.up_proj.weight"
    for key in [k for k in torch_state(bad, tmp_path) if k.startswith("model.model.layers.1.") and "weight" in k]:
        damage.rewrite_tensor(bad, key, lambda t: torch.full_like(t, math.nan))
    res = runner.invoke(app, ["stats", str(bad), "--no-optimizer"], env={"COLUMNS": "200"})
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("│ model.layers.1 "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    head = next(ln for ln in res.stdout.splitlines() if ln.startswith("┃ layer"))
    assert cells[[c.strip() for c in head.strip("┃").split("┃")].index("abs max")] == "nan", (row, fqn)


def test_a_truncated_scale_stats_skips_is_warned_of_as_inspect_does(tmp_path: Path) -> None:
    """A DCP (torch's dcp.save) whose data file ends inside the last record, a block-FP8 weight's scale that stats
    leaves out: inspect warned "shorter than its records need (truncated?)", stats exited 0 without a word. stats
    now gives inspect's warning lines (stderr, and ``warnings`` in --json), still measuring what it can."""
    from torch.distributed.checkpoint import FileSystemReader

    torch.manual_seed(0)
    sd = {
        "model": {
            "a.weight": torch.randn(16, 16),
            "b.weight": torch.randn(16, 16).to(torch.float8_e4m3fn),
            "b.weight_scale_inv": torch.rand(1, 1) + 1,
        }
    }
    d = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(d), no_dist=True)
    storage = FileSystemReader(str(d)).read_metadata().storage_data
    last = max(storage.values(), key=lambda s: s.offset)
    assert [k.fqn for k, s in storage.items() if s is last] == ["model.b.weight_scale_inv"]
    data = d / last.relative_path
    data.write_bytes(data.read_bytes()[: last.offset + last.length // 2])
    inspected = runner.invoke(app, ["inspect", str(d)])
    assert inspected.exit_code == 0, inspected.output
    warned = [line for line in inspected.stderr.splitlines() if line.startswith("warning: ")]
    assert warned and "truncated?" in warned[0], inspected.stderr
    res = runner.invoke(app, ["stats", str(d)])
    assert res.exit_code == 0, res.output
    assert [line for line in res.stderr.splitlines() if line.startswith("warning: ")] == warned, res.stderr
    doc = json.loads(runner.invoke(app, ["stats", "--json", str(d)]).stdout)
    jsonschema.validate(doc, load_schema("stats"))
    (c,) = doc["checkpoints"]
    assert c["warnings"] == [w.removeprefix("warning: ") for w in warned]
    assert [t["fqn"] for t in c["tensors"]] == ["a.weight"]


@pytest.mark.parametrize("native", ["1", "0"])
def test_float64_values_whose_squares_overflow_have_their_norm_and_std(
    tmp_path: Path, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float64 tensor of finite values beyond ~1e154 (their squares pass float64's 1.8e308) printed its L2 as
    `inf` (JSON null for L2 and std) with no word, its layer's norm `inf` too, and values near 1e307 summed to an
    infinite mean. The sums are now taken of the values scaled by their largest |x|: finite, as torch's own."""
    monkeypatch.setenv("CKPTTOOL_NATIVE", native)
    big = torch.full((64, 4), 1e200, dtype=torch.float64)
    big[::2] = -3e200
    near_max = torch.full((64,), 1e307, dtype=torch.float64)
    near_max[1] = 2e307
    sd = {"layers.0.w": big, "layers.1.w": near_max}
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    res = runner.invoke(app, ["stats", "--json", "--by", "tensor", str(tmp_path / "c")])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    rows = {t["fqn"]: t for t in doc["checkpoints"][0]["tensors"]}
    norms = {g["name"]: g["norms"]["weight"] for g in doc["checkpoints"][0]["layers"]}
    for name, x in sd.items():
        s = x / x.abs().max()  # torch's own figures, scaled back
        want = [float(v) * float(x.abs().max()) for v in (s.mean(), s.std(unbiased=False), s.norm())]
        got = [rows[name][k] for k in ("mean", "std", "l2")]
        assert all(g is not None and math.isclose(g, w, rel_tol=1e-12) for g, w in zip(got, want)), (name, got, want)
        assert norms[layer_of(name)] is not None and math.isclose(norms[layer_of(name)], want[2], rel_tol=1e-12)
    table = runner.invoke(app, ["stats", str(tmp_path / "c")]).stdout
    assert "inf" not in table, table


@pytest.mark.parametrize("native", ["1", "0"])
def test_float64_expert_norms_whose_squares_overflow(
    tmp_path: Path, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-expert norms of a float64 ``[E, out, in]`` tensor of values beyond ~1e154 were JSON null (``inf``) beside
    the tensor's finite L2: they are taken of the values scaled by their largest |x|, as torch's own, an infinite
    value left out as the tensor's L2 leaves it."""
    monkeypatch.setenv("CKPTTOOL_NATIVE", native)
    torch.manual_seed(0)
    w = torch.randn(3, 8, 4, dtype=torch.float64) * 1e180
    w[1, 0, 0], w[2, 3, 1] = 1e-300, math.inf
    dcp.save({"model": {"layers.0.mlp.experts.w1": w}}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    res = runner.invoke(app, ["stats", "--json", str(tmp_path / "c")])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    (row,) = doc["checkpoints"][0]["experts"]
    finite = torch.where(torch.isfinite(w), w, 0.0)
    scale = finite.abs().max()
    want = [float((finite[e] / scale).norm() * scale) for e in range(3)]
    assert row["norms"] is not None and all(
        g is not None and math.isclose(g, x, rel_tol=1e-12) for g, x in zip(row["norms"], want)
    ), (row["norms"], want)


@pytest.mark.parametrize("native", ["1", "0"])
def test_float64_change_whose_squares_overflow(tmp_path: Path, native: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stats A B`` of float64 values beyond ~1e154 gave the relative change NaN (inf / inf) and the absolute one
    JSON null, as for a diverged tensor: the sums are kept scaled, the figures are torch's own."""
    monkeypatch.setenv("CKPTTOOL_NATIVE", native)
    torch.manual_seed(0)
    a = torch.randn(16, 4, dtype=torch.float64) * 1e200
    b = a * 1.5
    b[0, 0] = -1.7e308  # b - a near float64's largest
    small = torch.randn(8, dtype=torch.float64)
    for name, x in (("a", a), ("b", b)):
        sd = {"layers.0.w": x, "layers.0.bias": small + (name == "b")}
        dcp.save({"model": sd}, checkpoint_id=str(tmp_path / name), no_dist=True)
    res = runner.invoke(app, ["stats", "--json", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    (change,) = doc["changes"]
    m = 1e308  # torch's norms, of values scaled to stay in range
    d = torch.cat([(b / m - a / m).reshape(-1), torch.ones(8, dtype=torch.float64) / m])
    want_abs = float(d.norm()) * m
    want_rel = want_abs / (float(torch.cat([(a / m).reshape(-1), small / m]).norm()) * m)
    assert change["absolute"] is not None and math.isclose(change["absolute"], want_abs, rel_tol=1e-12), change
    assert change["relative"] is not None and math.isclose(change["relative"], want_rel, rel_tol=1e-12), change


@pytest.mark.parametrize("native", ["1", "0"])
def test_float64_values_whose_squares_underflow_have_their_norm_std_and_change(
    tmp_path: Path, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float64 tensor of values near 1e-170 (their squares pass below float64's smallest 2.2e-308) printed its L2
    and std as 0, its per-expert norms 0, and the change between two checkpoints of it 0 (`stayed`) where it moved.
    The sums are now taken of the values scaled by their largest |x|, as torch's own figures scaled back."""
    monkeypatch.setenv("CKPTTOOL_NATIVE", native)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 4, dtype=torch.float64, generator=g) * 1e-170
    experts = torch.randn(3, 8, 4, dtype=torch.float64, generator=g) * 1e-160
    experts[1] *= 1e-3  # one expert far smaller than the others
    mixed = torch.randn(16, dtype=torch.float64, generator=g)
    mixed[3] = 1e-200  # tiny beside ordinary values: the plain sums hold it (nothing to rescale)
    a = {"layers.0.w": w, "layers.1.mlp.experts.w1": experts, "layers.2.w": mixed}
    b = {"layers.0.w": w * 1.25, "layers.1.mlp.experts.w1": experts, "layers.2.w": mixed}
    for name, sd in (("a", a), ("b", b)):
        dcp.save({"model": sd}, checkpoint_id=str(tmp_path / name), no_dist=True)
    res = runner.invoke(app, ["stats", "--json", "--by", "tensor", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    first = doc["checkpoints"][0]
    rows = {t["fqn"]: t for t in first["tensors"]}
    norms = {g["name"]: g["norms"]["weight"] for g in first["layers"]}

    def scaled(x: torch.Tensor) -> list[float]:  # torch's figures of x / max|x|, scaled back
        m = float(x.abs().max())
        s = x / m
        return [float(v) * m for v in (s.mean(), s.std(unbiased=False), s.norm())]

    for name, x in a.items():
        got = [rows[name][k] for k in ("mean", "std", "l2")]
        want = scaled(x)
        assert all(math.isclose(g_, w_, rel_tol=1e-12) for g_, w_ in zip(got, want)), (name, got, want)
        assert math.isclose(norms[layer_of(name)], want[2], rel_tol=1e-12), (name, norms)
    (row,) = first["experts"]
    want_e = [scaled(experts[e])[2] for e in range(3)]
    assert all(math.isclose(g_, w_, rel_tol=1e-12) for g_, w_ in zip(row["norms"], want_e)), (row["norms"], want_e)
    changes = {c["layer"]: c for c in doc["changes"]}
    want_abs = scaled(w * 1.25 - w)[2]
    assert math.isclose(changes["layers.0"]["absolute"], want_abs, rel_tol=1e-12), changes["layers.0"]
    assert math.isclose(changes["layers.0"]["relative"], 0.25, rel_tol=1e-12), changes["layers.0"]
    assert changes["layers.1"]["absolute"] == 0.0 and changes["layers.1"]["relative"] == 0.0
    assert changes["layers.2"]["relative"] == 0.0


def test_integer_buffers_are_rows_of_their_own_not_part_of_a_layers_sums(tmp_path: Path) -> None:
    """A BatchNorm's `num_batches_tracked` (int64, the forward passes so far) was summed into its layer: its
    `params`, ||weight||, abs max and change between checkpoints (||weight|| about the count, 80, where the floating
    tensors' norm is ~2; the counter's 40 -> 80 swamped the weights' change). Integer and bool tensors stay rows of `--by tensor`, out
    of the layer and module sums; the change lists them as not compared."""
    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def steps(n: int) -> None:
        for _ in range(n):
            m(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    steps(40)
    save_quiet({"model": m.state_dict()}, tmp_path / "a")
    sd_a = {k: v.clone() for k, v in m.state_dict().items()}
    steps(40)
    save_quiet({"model": m.state_dict()}, tmp_path / "b")
    sd_b = m.state_dict()
    assert sd_b["1.num_batches_tracked"].item() == 80
    res = collect_stats([tmp_path / "a", tmp_path / "b"])
    floating = [k for k in sd_b if k.startswith("1.") and sd_b[k].is_floating_point()]
    layer = {g.name: g for g in res.checkpoints[1].layers}["1"]
    want = torch.cat([sd_b[k].double().flatten() for k in floating])
    assert layer.params == want.numel() and close(layer.norms["weight"], float(want.norm())), layer
    assert close(layer.abs_max, float(want.abs().max())), layer
    d = torch.cat([(sd_b[k].double() - sd_a[k].double()).flatten() for k in floating])
    a = torch.cat([sd_a[k].double().flatten() for k in floating])
    change = {c.layer: c for c in res.changes}["1"]
    assert change.tensors == len(floating) and close(change.relative, float(d.norm() / a.norm())), change
    assert any(s.startswith("1.num_batches_tracked: int64 values") for s in res.skipped), res.skipped
    rows = {t.fqn: t for t in res.checkpoints[1].tensors}
    assert rows["1.num_batches_tracked"].abs_max == 80  # still measured as a tensor of its own


def test_an_expert_of_nan_only_has_no_norm_not_a_dead_experts_zero(sample_ckpt: Path, tmp_path: Path) -> None:
    """Expert 2 of layer 1 diverged (all NaN): its norm, of its finite values (none), was 0.0 in JSON and the darkest
    cell of the heat map, a dead expert, with nothing said. It is ``null`` (no norm), drawn red and said in the title;
    every other expert's norm is torch's of its finite values (expert 5 holds one infinity)."""
    bad = copy_checkpoint(sample_ckpt, tmp_path / "bad")
    key = "model.model.layers.1.mlp.experts.gate_up_proj"

    def poison(t: torch.Tensor) -> torch.Tensor:
        t[2].fill_(math.nan)
        t[5].view(-1)[7] = math.inf  # one value of expert 5
        return t

    damage.rewrite_tensor(bad, key, poison)
    ref = torch_state(bad, tmp_path)[key].double()
    c = collect_stats([bad], StatsOptions(optimizer=False)).checkpoints[0]
    (e,) = [e for e in c.experts if e.key == key]
    got = e.to_dict()["norms"]
    for i in range(ref.shape[0]):
        finite = ref[i][torch.isfinite(ref[i])]
        if finite.numel():
            assert close(got[i], float(finite.norm())), i
        else:
            assert got[i] is None, (i, got[i])
    assert [i for i, v in enumerate(got) if v is None] == [2]
    out = tmp_path / "p.svg"
    res = runner.invoke(app, ["stats", str(bad), "--no-optimizer", "--plot", str(out), "-q"])
    assert res.exit_code == 0, res.output
    ET.parse(out)  # the SVG parses; matplotlib names each text it draws in a comment
    assert "red: an expert of NaN/Inf values only" in " ".join(re.findall(r"<!-- (.*?) -->", out.read_text()))
