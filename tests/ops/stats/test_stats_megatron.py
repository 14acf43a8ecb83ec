"""``ckpttool stats`` of Megatron-core ``torch_dist`` checkpoints (written by megatron-core's own save code,
``tests/fixtures/megatron_data``): the decoder layers are stored stacked (``decoder.layers.<module> [L, ...]``),
and are grouped per layer (``decoder.layers.0``, ``decoder.layers.1``, ...), every figure checked against
the tensors torch's own DCP reader loads, sliced on dim 0."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from tests.ops.stats.test_stats import torch_state

DATA = Path(__file__).parent.parent.parent / "fixtures" / "megatron_data"
CKPTS = ["dense1/iter_0000003", "dense_tp2/iter_0000003", "moe_ep2/iter_0000002"]
STACKED = "decoder.layers."
runner = CliRunner()


def _stats(*paths: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    r = runner.invoke(app, ["stats", "--json", *extra, *map(str, paths)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    return doc


def _param(key: str) -> tuple[str, str]:
    """``(parameter key, role)`` of a key torch loaded (megatron's state keys are field first)."""
    for field, role in (("exp_avg_sq", "exp_avg_sq"), ("exp_avg", "exp_avg"), ("fp32_param", "master_weight")):
        head = f"optimizer.state.{field}."
        if head in key:
            return key.split(head, 1)[1], role
    return key, "weight"


def _expected_layers(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per layer: params, norms per role and abs max of the weights, from torch's tensors sliced on dim 0."""
    out: dict[str, dict[str, Any]] = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor) or key.endswith("common_step") or "_extra_state" in key:
            continue
        fqn, role = _param(key)
        t = t.to(torch.float64)
        slices = [(f"{STACKED}{i}", t[i]) for i in range(t.shape[0])] if fqn.startswith(STACKED) else [(fqn, t)]
        for layer, s in slices:
            if not fqn.startswith(STACKED):
                layer = fqn.rpartition(".")[0]
            g = out.setdefault(layer, {"params": 0, "s2": {}, "abs_max": 0.0})
            g["s2"][role] = g["s2"].get(role, 0.0) + float((s * s).sum())
            if role == "weight":
                g["params"] += s.numel()
                g["abs_max"] = max(g["abs_max"], float(s.abs().max()))
    return out


@pytest.mark.parametrize("ckpt", CKPTS)
def test_layers_of_stacked_tensors_are_rows(ckpt: str, tmp_path: Path) -> None:
    """Before: one row per stacked module (``decoder.layers.mlp.linear_fc1``) for all layers together; now one
    row per layer, its figures those of the dim-0 slices torch loads."""
    path = DATA / ckpt
    doc = _stats(path)
    c = doc["checkpoints"][0]
    got = {g["name"]: g for g in c["layers"]}
    want = _expected_layers(torch_state(path, tmp_path))
    assert [n for n in got if n.startswith("decoder.layers")] == ["decoder.layers.0", "decoder.layers.1"]
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, w in want.items():
        g = got[name]
        assert g["params"] == w["params"], name
        assert g["abs_max"] == pytest.approx(w["abs_max"], rel=1e-12), name
        assert set(g["norms"]) == set(w["s2"]), name
        for role, s2 in w["s2"].items():
            assert g["norms"][role] == pytest.approx(math.sqrt(s2), rel=1e-9, abs=1e-30), (name, role)
        assert g["update_rms"] is not None and g["update_rms"] > 0, name
    # the tensor rows stay one per stored tensor, their layer the stack's
    stacked = [t for t in c["tensors"] if t["fqn"].startswith(STACKED)]
    assert stacked and all(t["layer"] == "decoder.layers.*" for t in stacked)
    assert all(u["layer"] == "decoder.layers.*" for u in c["updates"] if u["fqn"].startswith(STACKED))


def test_per_layer_update_size_matches_adamw(tmp_path: Path) -> None:
    """A layer's update RMS is that of AdamW's step over its slices of the moments (common.pt's lr, betas, eps, step)."""
    path = DATA / "dense1" / "iter_0000003"
    state = torch_state(path, tmp_path)
    common = torch.load(path / "common.pt", weights_only=False)["optimizer"]
    common = common if "param_groups" in common else common["optimizer"]
    step = float(common["state"]["common_step"])
    doc = _stats(path)
    layers = {g["name"]: g for g in doc["checkpoints"][0]["layers"]}
    for i in range(2):
        s2, n = 0.0, 0
        for key, m in state.items():
            if "optimizer.state.exp_avg." not in key or not key.split("exp_avg.", 1)[1].startswith(STACKED):
                continue
            fqn = key.split("exp_avg.", 1)[1]
            v = state[key.replace(".exp_avg.", ".exp_avg_sq.")]
            norm = fqn.endswith(("layer_norm_weight", "bias"))
            g = next(g for g in common["param_groups"] if g["wd_mult"] == (0.0 if norm else 1.0))
            b1, b2 = g["betas"]
            mh = m[i].double() / (1 - b1**step)
            vh = v[i].double() / (1 - b2**step)
            u = g["lr"] * mh.abs() / (vh.sqrt() + g["eps"])
            s2 += float((u * u).sum())
            n += u.numel()
        assert layers[f"decoder.layers.{i}"]["update_rms"] == pytest.approx(math.sqrt(s2 / n), rel=1e-6)


def test_stacked_experts_norms_per_layer_and_expert(tmp_path: Path) -> None:
    """The MoE fixture stores experts ``[L, E, out, in]`` (one chunk per layer and expert): per-expert norms per
    layer (the heat map's rows), each ``||t[l, e]||``; before, none."""
    path = DATA / "moe_ep2" / "iter_0000002"
    state = torch_state(path, tmp_path)
    doc = _stats(path)
    experts = doc["checkpoints"][0]["experts"]
    keys = [k for k in state if k.startswith("decoder.layers.mlp.experts.experts.") and k.endswith(".weight")]
    assert keys
    assert sorted((e["key"], e["layer"]) for e in experts) == sorted(
        (k, f"decoder.layers.{i}") for k in keys for i in range(2)
    )
    for e in experts:
        t = state[e["key"]].to(torch.float64)[int(e["layer"].rsplit(".", 1)[1])]
        assert len(e["norms"]) == t.shape[0] == 4
        for j, n in enumerate(e["norms"]):
            assert n == pytest.approx(float(t[j].norm()), rel=1e-9)


def test_change_between_steps_per_layer(tmp_path: Path) -> None:
    """The relative change is per layer of the stacked tensors: on the same chunks (one layer each) and on other
    chunks (dense1 vs the TP=2 run: compared whole, sliced per layer); checked against torch's tensors."""
    a, b = DATA / "dense1" / "iter_0000003", DATA / "dense_tp2" / "iter_0000003"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sa, sb = torch_state(a, tmp_path / "a"), torch_state(b, tmp_path / "b")
    want: dict[str, list[float]] = {}
    for key, x in sa.items():
        if not isinstance(x, torch.Tensor) or "optimizer" in key or "_extra_state" in key or key not in sb:
            continue
        x, y = x.double(), sb[key].double()
        parts = [(f"{STACKED}{i}", x[i], y[i]) for i in range(2)] if key.startswith(STACKED) else []
        parts = parts or [(key.rpartition(".")[0], x, y)]
        for layer, xs, ys in parts:
            acc = want.setdefault(layer, [0.0, 0.0])
            acc[0] += float(((ys - xs) ** 2).sum())
            acc[1] += float((xs * xs).sum())
    doc = _stats(a, b, extra=("--no-optimizer",))
    got = {c["layer"]: c["relative"] for c in doc["changes"]}
    assert set(got) == set(want)
    for layer, (d2, a2) in want.items():
        assert got[layer] == pytest.approx(math.sqrt(d2 / a2), rel=1e-9), layer
    same = _stats(a, a, extra=("--no-optimizer",))
    assert {c["layer"]: c["relative"] for c in same["changes"]} == dict.fromkeys(want, 0.0)


def test_plot_has_a_point_per_layer(tmp_path: Path) -> None:
    """``--plot`` draws the layers of the stacked tensors on its axis (``decoder.layers.0``, ``decoder.layers.1``)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.svg"
    r = runner.invoke(app, ["stats", "--plot", str(out), str(DATA / "moe_ep2" / "iter_0000002")])
    assert r.exit_code == 0, r.output
    svg = out.read_text()
    assert "decoder.layers.0" in svg and "decoder.layers.1" in svg
    assert "decoder.layers.mlp" not in svg


def test_stack_in_chunks_of_several_layers_is_grouped_whole(tmp_path: Path) -> None:
    """A stacked tensor saved in chunks of several layers (torch's ``dcp.save`` of the state megatron's save holds,
    loaded whole) is measured as one group, named in a note, never read whole for the change between steps."""
    import shutil

    import torch.distributed.checkpoint as dcp

    src = DATA / "dense1" / "iter_0000003"
    state = {k: v for k, v in torch_state(src, tmp_path).items() if isinstance(v, torch.Tensor)}
    out = tmp_path / "whole" / "iter_0000003"
    dcp.save(state, checkpoint_id=str(out))
    for name in ("common.pt", "metadata.json"):
        shutil.copy(src / name, out / name)
    r = runner.invoke(app, ["stats", "--json", str(out), str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, load_schema("stats"))
    c = doc["checkpoints"][0]
    assert c["schema"] == "megatron"
    assert any(n.startswith("layers stacked in chunks of several layers") for n in c["notes"]), c["notes"]
    names = [g["name"] for g in c["layers"]]
    assert "decoder.layers.mlp.linear_fc1" in names and "decoder.layers.0" not in names
    assert {ch["layer"] for ch in doc["changes"]} == set(names)
    assert all(ch["relative"] == 0.0 for ch in doc["changes"])


def test_diff_plot_and_json_are_per_layer_of_stacked_tensors(tmp_path: Path) -> None:
    """``diff --plot`` drew one point per stacked module (``model.decoder.layers.mlp.linear_fc1``: every layer
    lumped) where ``stats`` has one per layer; now the per-layer series (and ``--json`` ``tensors[].layers``) is per
    dim-0 slice, each figure that of torch's tensors sliced on dim 0 (dense1 against the TP=2 bf16 run, cast)."""
    pytest.importorskip("matplotlib")
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import diff_layers

    a, b = DATA / "dense1" / "iter_0000003", DATA / "dense_tp2" / "iter_0000003"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sa, sb = torch_state(a, tmp_path / "a"), torch_state(b, tmp_path / "b")
    want: dict[str, list[float]] = {}
    slices: dict[str, list[tuple[str, float, float]]] = {}
    for key, x in sa.items():
        if not isinstance(x, torch.Tensor) or "optimizer" in key or "_extra_state" in key or key not in sb:
            continue
        x, y = x.double(), sb[key].to(torch.float32).double()
        parts = [(f"model.{STACKED}{i}", x[i], y[i]) for i in range(2)] if key.startswith(STACKED) else []
        if parts:
            slices[f"model.{key}"] = [(n, float((xs - ys).norm()), float(ys.norm())) for n, xs, ys in parts]
        for layer, xs, ys in parts or [(f"model.{key}".rpartition(".")[0], x, y)]:
            acc = want.setdefault(layer, [0.0, 0.0])
            acc[0] += float(((xs - ys) ** 2).sum())
            acc[1] += float((ys * ys).sum())
    out = tmp_path / "d.svg"
    r = runner.invoke(app, ["diff", "--json", "--as-dtype", "float32", "--plot", str(out), str(a), str(b)])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, load_schema("diff"))
    got = {t["name"]: t.get("layers") for t in doc["tensors"]}
    assert {n for n, v in got.items() if v} == set(slices)
    for name, rows in slices.items():
        assert [row["layer"] for row in got[name]] == [n for n, _, _ in rows]
        for row, (_, d, n) in zip(got[name], rows):
            assert row["diff_l2"] == pytest.approx(d, rel=1e-9) and row["b_l2"] == pytest.approx(n, rel=1e-9), name
    res = diff_checkpoints(str(a), str(b), DiffOptions(as_dtype="float32"))
    layers = {name: rel for name, rel, _ in diff_layers(res)}
    assert set(layers) == set(want), sorted(layers)
    for layer, (d2, b2) in want.items():
        assert layers[layer] == pytest.approx(math.sqrt(d2 / b2), rel=1e-9), layer
    svg = out.read_text()
    assert "model.decoder.layers.0" in svg and "model.decoder.layers.1" in svg
    assert "<!-- model.decoder.layers.mlp.linear_fc1 -->" not in svg


def test_layer_whose_second_moment_slice_is_negative_has_no_update_size(tmp_path: Path) -> None:
    """A negative value in layer 1's slice of a stacked exp_avg_sq (damaged: validate's D002) was read as 0, and
    ``decoder.layers.1`` got an update RMS of ``lr * |m_hat| / eps``; torch's next step there takes its square root,
    NaN. That layer's update size is now nan (JSON null), as the parameter's; layer 0's is the one AdamW computes."""
    import shutil

    from tests.fixtures import damage

    path = tmp_path / "ck"
    shutil.copytree(DATA / "dense1" / "iter_0000003", path)
    key = "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"

    def negate(t: torch.Tensor) -> torch.Tensor:
        t[1].view(-1)[0] = -1.0
        return t

    damage.rewrite_tensor(path, key, negate, row_major=True)
    v = torch_state(path, tmp_path)[key]
    assert float(v[1].min()) == -1.0 and float(v[0].min()) >= 0  # what torch's reader loads
    before = {g["name"]: g for g in _stats(DATA / "dense1" / "iter_0000003")["checkpoints"][0]["layers"]}
    c = _stats(path)["checkpoints"][0]
    layers = {g["name"]: g for g in c["layers"]}
    assert layers["decoder.layers.1"]["update_rms"] is None
    assert layers["decoder.layers.0"]["update_rms"] == pytest.approx(before["decoder.layers.0"]["update_rms"])
    u = next(u for u in c["updates"] if u["fqn"] == "decoder.layers.mlp.linear_fc1.weight")
    assert u["rms"] is None
    assert any(n.startswith("update size nan: exp_avg_sq holds negative values") for n in c["notes"]), c["notes"]


@pytest.fixture(scope="module")
def mixed() -> Path:
    """megatron-core's own save of a block of mixed layer types (layer 0 dense, layer 1 MoE: ``moe_layer_freq``
    [0, 1]), which it writes per layer (``decoder.layers.<i>.``), not stacked (``tests/fixtures/megatron.py``)."""
    import os

    from tests.fixtures.cache import cached_build
    from tests.fixtures.megatron import build_megatron

    root = Path(os.environ.get("CKPTTOOL_FIXTURE_CACHE", "/tmp/ckpttool-fixtures"))
    return cached_build(root, "megatron-mixed", lambda d: build_megatron(d, ("moe_mixed",))) / "moe_mixed"


@pytest.mark.heavy  # megatron-core's save on first use (cached after)
def test_layers_saved_per_layer_by_a_mixed_block_are_not_split_as_stacked(mixed: Path, tmp_path: Path) -> None:
    """A mixed block's ``decoder.layers.0.mlp.linear_fc1.weight [96, 32]`` was taken for a stacked tensor (its
    name starts with ``decoder.layers.``): stats split its rows as layers (``decoder.layers.0`` .. ``.3`` for a
    2-layer model, figures mixed across layers) and noted "layers stacked in chunks of several layers each". A
    ``decoder.layers.<N>.`` fqn is one layer's: the rows are the layers megatron saved, their figures torch's."""
    import re

    path = mixed / "iter_0000002"
    state = torch_state(path, tmp_path)
    assert not any(k.startswith("model.decoder.layers.mlp.") for k in state)  # per layer, as megatron saved it
    want: dict[str, dict[str, Any]] = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor) or key.endswith("common_step") or "_extra_state" in key:
            continue
        fqn, role = _param(key)
        fqn = fqn.removeprefix("model.")
        m = re.match(r"(decoder\.layers\.\d+)\.", fqn)
        g = want.setdefault(m.group(1) if m else fqn.rpartition(".")[0], {"params": 0, "s2": {}})
        g["s2"][role] = g["s2"].get(role, 0.0) + float((t.double() ** 2).sum())
        g["params"] += t.numel() if role == "weight" else 0
    doc = _stats(path)
    c = doc["checkpoints"][0]
    got = {g["name"]: g for g in c["layers"]}
    assert [n for n in got if n.startswith("decoder.layers")] == ["decoder.layers.0", "decoder.layers.1"]
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, w in want.items():
        assert got[name]["params"] == w["params"], name
        for role, s2 in w["s2"].items():
            assert got[name]["norms"][role] == pytest.approx(math.sqrt(s2), rel=1e-9, abs=1e-30), (name, role)
    assert not any("stacked" in n for n in c["notes"]), c["notes"]
    r = runner.invoke(app, ["stats", str(path)])
    assert r.exit_code == 0 and "stacked" not in r.output, r.output


@pytest.mark.parametrize(
    ("ckpt", "key"),
    [
        ("dense1/iter_0000003", "decoder.layers.mlp.linear_fc1.weight"),
        ("moe_ep2/iter_0000002", "decoder.layers.mlp.experts.experts.linear_fc1.weight"),
    ],
)
def test_layers_of_stacked_float64_values_whose_squares_overflow(ckpt: str, key: str, tmp_path: Path) -> None:
    """A stacked float64 tensor (``[L, ...]``, experts ``[L, E, ...]``) of values beyond ~1e154 gave each layer's
    weight norm as ``inf`` (JSON null) where the tensor's own row was finite: a layer's sums are taken scaled by
    its largest |x| as a tensor's, the norms those of torch's slices on dim 0, scaled back."""
    import shutil

    from tests.fixtures import damage

    path = tmp_path / "ck"
    shutil.copytree(DATA / ckpt, path)
    damage.rewrite_tensor(path, key, lambda t: t.double() * 1e200, row_major=True)
    state = torch_state(path, tmp_path)
    assert state[key].dtype == torch.float64
    want: dict[str, list[float]] = {}
    for k, t in state.items():
        if not isinstance(t, torch.Tensor) or not k.startswith(STACKED) or "_extra_state" in k:
            continue
        for i in range(t.shape[0]):
            s = t[i].double()
            m = float(s.abs().max()) or 1.0
            want.setdefault(f"{STACKED}{i}", []).append(float((s / m).norm()) * m)
    c = _stats(path)["checkpoints"][0]
    got = {g["name"]: g["norms"]["weight"] for g in c["layers"]}
    for layer, norms in want.items():
        assert got[layer] is not None and math.isclose(got[layer], math.hypot(*norms), rel_tol=1e-9), (layer, got)
    table = runner.invoke(app, ["stats", str(path)]).stdout
    assert " inf " not in table, table
