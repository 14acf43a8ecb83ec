"""``stats --plot`` and ``diff --plot``: what the pictures put where (read back from matplotlib's own axes)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckpttool.ops.stats import StatsOptions, collect_stats, layer_of
from tests.fixtures.builders import save_quiet, train_steps

pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")


@pytest.fixture(scope="module")
def unfrozen(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two checkpoints of one run of three Linear layers: layer 1 frozen until the first save (no optimizer state
    for it there), trained with the others after it."""
    root = tmp_path_factory.mktemp("unfrozen")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    m[1].requires_grad_(False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = []
    for step, frozen in ((2, True), (4, False)):
        m[1].requires_grad_(not frozen)
        train_steps(m, opt, 2)
        msd, osd = get_state_dict(m, opt)
        save_quiet({"model": msd, "optimizer": osd}, root / f"step-{step}")
        out.append(root / f"step-{step}")
    return out


def _drawn(ax: Any) -> dict[str, dict[str, float]]:
    """Each line's legend label -> {x tick label: y} of its finite points."""
    ticks = {round(t): lbl.get_text() for t, lbl in zip(ax.get_xticks(), ax.get_xticklabels())}
    return {
        line.get_label(): {ticks[round(x)]: float(y) for x, y in line.get_xydata() if math.isfinite(y)}
        for line in ax.get_lines()
    }


def test_each_value_is_drawn_at_its_own_layer_when_a_checkpoint_lacks_a_layer(unfrozen: list[Path]) -> None:
    """step-2 has no exp_avg (no update size) for frozen layer 1: its layer-2 value was drawn at the position
    labelled "1" (the positions counted per line, the labels of the last line), a line that said layer 1 had
    moments it never had; now every line is drawn over one axis of layers, layer 1 a gap in step-2's."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from ckpttool.ui.plot import _label, _layer_lines

    res = collect_stats(unfrozen, StatsOptions())
    first, second = res.checkpoints
    assert "exp_avg" not in next(g for g in first.layers if g.name == "1").norms  # the premise: frozen in step-2
    values: list[Callable[[Any], float | None]] = [
        lambda g: g.norms.get("exp_avg"),
        lambda g: g.update_rms,
        lambda g: g.norms.get("weight"),
    ]
    for value in values:
        fig, ax = plt.subplots()
        assert _layer_lines(ax, res, value, "t", "y")
        drawn = _drawn(ax)
        plt.close(fig)
        for i, c in enumerate(res.checkpoints):
            want = {g.name: value(g) for g in c.layers if value(g) is not None}
            assert drawn[_label(res, i)] == pytest.approx(want), (i, drawn)


def test_diff_plot_draws_the_layers_in_the_models_order(tmp_path: Path) -> None:
    """The per-layer line of ``diff --plot`` took its layers in the order of ``tensors[]`` (most different first):
    a deeper layer that moved more was drawn left of layer 0, the line zig-zagging over an axis in no order; now
    the layers are in the checkpoint's order (the order ``stats`` draws them in)."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import diff_layers, write_diff_plot

    torch.manual_seed(0)
    m = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    save_quiet({"model": m.state_dict()}, tmp_path / "a")
    with torch.no_grad():
        for i, layer in enumerate(m):  # the deeper, the larger the change: ranked 2, 1, 0
            layer.weight.add_(0.1 * (i + 1))
    save_quiet({"model": m.state_dict()}, tmp_path / "b")
    res = diff_checkpoints(str(tmp_path / "b"), str(tmp_path / "a"), DiffOptions())
    assert [layer_of(t.name) for t in res.tensors][:3] == ["model.2", "model.1", "model.0"]  # the premise: ranked
    layers = diff_layers(res)
    assert [name for name, _, _ in layers] == ["model.0", "model.1", "model.2"]
    rel = [r for _, r, _ in layers]
    assert rel == sorted(rel) and all(r is not None and r > 0 for r in rel)
    write_diff_plot(res, tmp_path / "d.svg")
    # the x tick labels come first, then the axis label or the y ticks' (math)
    texts = _svg_texts(tmp_path / "d.svg")
    drawn = texts[: next(i for i, x in enumerate(texts) if x == "layer" or x.startswith("$"))]
    assert drawn == ["model.0", "model.1", "model.2"]


def _svg_texts(path: Path) -> list[str]:
    """The texts a matplotlib SVG draws (it names each in a comment), ``&lt;`` and ``&gt;`` unescaped."""
    return [t.replace("&lt;", "<").replace("&gt;", ">") for t in re.findall(r"<!-- (.*?) -->", path.read_text())]


def test_pictures_label_their_axes_and_name_what_they_compare(unfrozen: list[Path], tmp_path: Path) -> None:
    """The pictures had titles only: no axis said what it counts (layers, L2 norms, the update's RMS), the heat
    map's colour bar had no unit, and diff's picture never said which checkpoint is a and which b."""
    from ckpttool.ops.stats import collect_stats
    from ckpttool.ui.plot import write_diff_plot, write_stats_plot

    out = tmp_path / "s.svg"
    write_stats_plot(collect_stats(unfrozen, StatsOptions()), out)
    texts = _svg_texts(out)
    assert texts.count("layer") == 3 and texts.count("L2 norm") == 2, texts
    assert "RMS of lr*|m_hat|/(sqrt(v_hat)+eps)" in texts
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints

    a, b = unfrozen[1], unfrozen[0]
    write_diff_plot(diff_checkpoints(str(a), str(b), DiffOptions()), tmp_path / "d.svg")
    texts = _svg_texts(tmp_path / "d.svg")
    assert f"a = {a}" in texts and f"b = {b} (the reference)" in texts, texts
    assert texts.count("||a-b|| / ||b||") == 2 and "layer" in texts


def test_the_experts_heat_map_names_its_axes_and_its_colour_scale(sample_ckpt: Path, tmp_path: Path) -> None:
    from ckpttool.ops.stats import collect_stats
    from ckpttool.ui.plot import write_stats_plot

    out = tmp_path / "s.svg"
    res = collect_stats([sample_ckpt], StatsOptions())
    write_stats_plot(res, out)
    texts = [t.replace("&#39;", "'").replace("&apos;", "'") for t in _svg_texts(out)]
    assert "expert" in texts and texts.count("layer") == 4, texts  # three line panels and the heat map
    assert "L2 norm of the expert's weights" in texts
    assert res.checkpoints[0].step == 3  # the sample's train_state.step
    assert "expert weight L2 per layer and expert (step 3)" in texts, texts


def test_names_with_dollar_signs_are_drawn_as_written(tmp_path: Path) -> None:
    """matplotlib reads text between two ``$`` as mathtext: a key ``emb$\\nocmd{$.weight`` ended ``stats --plot``
    and ``diff --plot`` with ``E999 internal error: ValueError`` (and ``a$x$b`` would be drawn in italics); names
    from a checkpoint (keys, layers, folder names, paths) are now drawn literally."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    key = "emb$\\nocmd{$.weight"
    a, b = tmp_path / "ck$x$-1", tmp_path / "ck$x$-2"
    for scale, out in ((1.0, a), (2.0, b)):
        save_quiet({"model": {key: torch.ones(3) * scale, "layers.0.w": torch.ones(2)}}, out)
    runner = CliRunner()
    res = runner.invoke(app, ["stats", str(a), str(b), "--plot", str(tmp_path / "s.svg")])
    assert res.exit_code == 0, res.stderr
    texts = _svg_texts(tmp_path / "s.svg")
    assert "emb$\\nocmd{$" in texts and f"#1 {a.name}" in texts and f"#2 {b.name}" in texts, texts
    res = runner.invoke(app, ["diff", str(b), str(a), "--plot", str(tmp_path / "d.svg")])
    assert res.exit_code == 1, res.stderr  # they differ
    texts = _svg_texts(tmp_path / "d.svg")
    assert f"model.{key}" in texts and f"a = {b}" in texts, texts


def test_no_optimizer_panels_say_not_measured_not_absent(sample_ckpt: Path, tmp_path: Path) -> None:
    """With --no-optimizer the exp_avg and update panels said "not in the checkpoint" of a checkpoint that holds
    both; they now say they were not measured (and, measured and absent, what an update size needs)."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    runner = CliRunner()
    res = runner.invoke(app, ["stats", str(sample_ckpt), "--no-optimizer", "--plot", str(tmp_path / "s.svg")])
    assert res.exit_code == 0, res.stderr
    texts = _svg_texts(tmp_path / "s.svg")
    assert texts.count("not measured (- -no-optimizer)") == 2 and "not in the checkpoint" not in texts, texts
    model_only = tmp_path / "model-only"
    save_quiet({"model": {"layers.0.w": torch.ones(4)}}, model_only)
    res = runner.invoke(app, ["stats", str(model_only), "--plot", str(tmp_path / "m.svg")])
    assert res.exit_code == 0, res.stderr
    texts = _svg_texts(tmp_path / "m.svg")
    assert "no exp_avg in the checkpoint" in texts and "no update size" in texts, texts


def test_many_experts_and_layers_are_labelled_every_kth_not_into_a_black_band(tmp_path: Path) -> None:
    """128 experts were each labelled at 6 points below a heat map 5 inches wide: the numbers ran into one black
    band; now about 16 of them (every 8th), and at most about 48 layers (every k-th) on its other axis."""
    sd = {}
    for layer in range(100):
        sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.full((128, 2, 2), 1.0 + layer)
    save_quiet({"model": sd}, tmp_path / "ck")
    out = tmp_path / "s.svg"
    from ckpttool.ui.plot import write_stats_plot

    write_stats_plot(collect_stats([tmp_path / "ck"], StatsOptions()), out)
    texts = _svg_texts(out)
    i = texts.index("expert weight L2 per layer and expert (#1 ck)")
    experts = [t for t in texts[:i] if t.isdigit()]  # the heat map's tick labels come before its title
    assert experts[:3] == ["0", "8", "16"] and len(experts) == 16, experts
    layers = [t for t in texts[:i] if t.startswith("model.layers.")]
    # the weight panel labels every 2nd of 100 layers (50), the heat map every 3rd (34)
    assert len(layers) == 50 + 34 and layers[:2] == ["model.layers.0", "model.layers.2"], layers
    assert layers[50:52] == ["model.layers.0", "model.layers.3"], layers


def test_diff_plot_of_many_layers_labels_every_kth(tmp_path: Path) -> None:
    """diff --plot labelled each of 100 layers at 6 points: the names overlapped; now every 2nd (at most ~64)."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import write_diff_plot

    for scale, name in ((1.0, "a"), (2.0, "b")):
        save_quiet({"model": {f"layers.{i}.w": torch.full((2,), scale + i) for i in range(100)}}, tmp_path / name)
    write_diff_plot(diff_checkpoints(str(tmp_path / "b"), str(tmp_path / "a"), DiffOptions()), tmp_path / "d.svg")
    texts = _svg_texts(tmp_path / "d.svg")
    ticks = texts[: texts.index("layer")]
    assert ticks[:2] == ["model.layers.0", "model.layers.2"] and len(ticks) == 50, ticks


def test_heat_map_says_when_its_experts_are_in_stored_order(ep_suite: Path, tmp_path: Path) -> None:
    """An unversioned EP save whose expert order cannot be told: the note on stderr said the per-expert norms are
    in stored order, the heat map (drawn in that order) did not; its title now says so."""
    from ckpttool.ui.plot import write_stats_plot

    order = "experts in stored order: the EP layout is not known (ckpttool stamp declares it)"
    for name, stored in (("legacy", True), ("p4f1", False)):  # p4f1: a version-1 record, un-permuted
        res = collect_stats([ep_suite / name], StatsOptions(optimizer=False))
        write_stats_plot(res, tmp_path / f"{name}.svg")
        assert (order in _svg_texts(tmp_path / f"{name}.svg")) is stored, name


def test_diff_plot_marks_a_layer_whose_reference_is_zero_as_infinite_not_equal(tmp_path: Path) -> None:
    """diff A B with a layer all zero in B (the reference: a zero-initialised LoRA B at step 0) and not in A: the
    layer's ||a-b|| / ||b|| was None and drawn at the floor, as equal; it is now infinite, drawn at the top and
    marked as such."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import diff_layers, write_diff_plot

    save_quiet({"model": {"layers.0.w": torch.ones(4), "layers.1.lora_b": torch.full((4,), 0.5)}}, tmp_path / "a")
    save_quiet({"model": {"layers.0.w": torch.ones(4) * 2, "layers.1.lora_b": torch.zeros(4)}}, tmp_path / "b")
    res = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"), DiffOptions())
    assert {n: r for n, r, _ in diff_layers(res)} == {"model.layers.0": 0.5, "model.layers.1": math.inf}
    write_diff_plot(res, tmp_path / "d.svg")
    assert "infinite: ||b|| = 0 where a differs" in _svg_texts(tmp_path / "d.svg")


def test_two_runs_at_one_step_are_told_apart_in_the_legend(tmp_path: Path) -> None:
    """`stats runA runB --step 5 --plot`: both lines were labelled "step 5"; each now names its run."""
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    for run, scale in (("runA", 1.0), ("runB", 2.0)):
        save_quiet({"model": {"layers.0.w": torch.ones(4) * scale}}, tmp_path / run / "step-5")
    out = tmp_path / "s.svg"
    res = CliRunner().invoke(
        app,
        ["stats", str(tmp_path / "runA"), str(tmp_path / "runB"), "--step", "5"]
        + [
            "--plot",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.stderr
    texts = _svg_texts(out)
    assert "#1 runA/step-5 (step 5)" in texts and "#2 runB/step-5 (step 5)" in texts, texts


def test_diff_plot_marks_nan_differences_as_not_a_number_not_equal(tmp_path: Path) -> None:
    """diff A B with NaN/Inf in B: those layers were drawn as 'infinite: ||b|| = 0 where a differs' (||b|| was
    NaN, not 0), their largest tensor at the floor (equal), and the bar panel said 'every compared tensor is
    equal' though the text summary counted them as differing; they are now NaN, marked as not a number, and
    listed first among the tensors that differ most."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import diff_layers, write_diff_plot

    save_quiet({"model": {"layers.0.w": torch.ones(4), "layers.1.w": torch.ones(4)}}, tmp_path / "a")
    nan = torch.tensor([1.0, math.nan, math.inf, 1.0])
    save_quiet({"model": {"layers.0.w": torch.ones(4) * 2, "layers.1.w": nan}}, tmp_path / "b")
    res = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"), DiffOptions())
    got = {n: (r, m) for n, r, m in diff_layers(res)}
    assert got["model.layers.0"] == (0.5, 0.5)
    r, m = got["model.layers.1"]
    assert r is not None and math.isnan(r) and math.isnan(m)
    write_diff_plot(res, tmp_path / "d.svg")
    texts = _svg_texts(tmp_path / "d.svg")
    assert "not a number: NaN or Inf in a or b" in texts
    assert "infinite: ||b|| = 0 where a differs" not in texts and "every compared tensor is equal" not in texts
    assert "model.layers.1.w" in texts and "model.layers.0.w" in texts  # the bars' names (the x axis: layers)


def test_many_checkpoints_are_a_colour_scale_not_a_legend_over_the_lines(tmp_path: Path) -> None:
    """``stats run/step-{1..40} --plot``: each panel had a legend of 40 entries, taller than the panel, drawn over
    the lines (their values hidden), and matplotlib printed its own ``UserWarning: constrained_layout not applied``
    on stderr. Beyond 8 checkpoints the lines are coloured by their place in the run, and one colour bar per panel
    names every k-th checkpoint; each line is still labelled, and drawn at the values stats measured."""
    import subprocess
    import sys

    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.image import imread

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    paths = []
    for step in range(1, 41):
        train_steps(m, opt, 1)
        msd, osd = get_state_dict(m, opt)
        save_quiet({"model": msd, "optimizer": osd}, tmp_path / f"step-{step}")
        paths.append(str(tmp_path / f"step-{step}"))
    for suffix in (".svg", ".png"):
        out = tmp_path / f"many{suffix}"
        res = subprocess.run(
            [sys.executable, "-m", "ckpttool", "stats", *paths, "-q", "--plot", str(out)],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0 and res.stderr == "", res.stderr
    texts = _svg_texts(tmp_path / "many.svg")
    labels = [t for t in texts if re.fullmatch(r"step \d+", t)]
    assert texts.count("checkpoint (in the order given)") == 3, texts  # weights, exp_avg, update size
    assert 0 < len(labels) <= 3 * 10 and {"step 1", "step 40"} <= set(labels), labels
    assert imread(tmp_path / "many.png").shape == (960, 1440, 4)
    # the lines themselves: one per checkpoint, labelled, at the norms stats measured (torch's, tests above)
    import matplotlib.pyplot as plt

    from ckpttool.ui.plot import _layer_lines

    res_ = collect_stats(paths, StatsOptions())
    fig, ax = plt.subplots()
    _layer_lines(ax, res_, lambda g: g.norms.get("weight"), "w", "L2 norm")
    drawn = _drawn(ax)
    plt.close(fig)
    assert ax.get_legend() is None and len(drawn) == 40
    for i, c in enumerate(res_.checkpoints):
        assert drawn[f"step {i + 1}"] == {g.name: pytest.approx(g.norms["weight"]) for g in c.layers}


@pytest.mark.parametrize("command", ["diff", "stats"])
def test_characters_the_font_lacks_are_one_warning_not_matplotlibs(command: str, tmp_path: Path) -> None:
    """``diff 実験/a 実験/b --plot d.png``: the picture names both paths, DejaVu Sans has no CJK glyphs, and
    matplotlib printed two raw ``.../plot.py:279: UserWarning: Glyph 23455 (...) missing from font(s)`` lines with
    its source line on stderr. Now one ``warning:`` names the characters drawn as boxes; the picture is written."""
    import subprocess
    import sys

    from matplotlib.image import imread

    paths = []
    for name, scale in (("a", 1.0), ("b", 2.0)):
        save_quiet({"model": {"layers.0.w": torch.ones(4) * scale}}, tmp_path / "実験" / name)
        paths.append(str(tmp_path / "実験" / name))
    if command == "stats":  # stats names a path in its legend where the steps are unknown: #1 実験/a
        paths = [paths[0], str(tmp_path / "実験" / "b")]
        for p in paths:
            Path(p).rename(Path(p).with_name(f"{Path(p).name}-験"))
        paths = [f"{p}-験" for p in paths]
    out = tmp_path / "d.png"
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", command, *paths, "-q", "--plot", str(out)], capture_output=True, text=True
    )
    assert res.returncode == (1 if command == "diff" else 0), res.stderr
    chars = "実, 験" if command == "diff" else "験"
    assert res.stderr.splitlines() == [f"warning: --plot {out}: the font has no glyph for {chars} (drawn as boxes)"]
    assert imread(out).shape[2] == 4


def test_values_of_zero_are_drawn_and_each_checkpoint_keeps_its_colour(tmp_path: Path) -> None:
    """A layer whose norm is 0 (a zero-initialised LoRA B; moments torch made up before the first step) was left out
    of its panel, and a panel of zeros only said "no exp_avg in the checkpoint"; a checkpoint without a line in a
    panel shifted the colours of the later ones there. Zeros are drawn (symmetric-log axis), colours kept."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from ckpttool.ui.plot import _label, _layer_lines

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with torch.no_grad():
        b.weight.zero_()
        b.bias.zero_()
    m = torch.nn.ModuleDict({"lora_a": a, "lora_b": b})
    save_quiet({"model": m.state_dict()}, tmp_path / "s0")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)  # a step of zero gradients: weights kept
    for p in (*a.parameters(), *b.parameters()):  # state torch makes up before a first step: moments all zero
        p.grad = torch.zeros_like(p)
    opt.step()
    msd, osd = get_state_dict(m, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "s1")
    res = collect_stats([tmp_path / "s0", tmp_path / "s1"], StatsOptions())
    for value, want in (
        (lambda g: g.norms.get("weight"), [{"lora_a": a, "lora_b": b}] * 2),
        (lambda g: g.norms.get("exp_avg"), [None, {"lora_a": 0.0, "lora_b": 0.0}]),
    ):
        fig, ax = plt.subplots()
        assert _layer_lines(ax, res, value, "t", "y")  # drawn: not "no exp_avg in the checkpoint"
        drawn = _drawn(ax)
        colours = {line.get_label(): line.get_color() for line in ax.get_lines()}
        plt.close(fig)
        for i, w in enumerate(want):
            label = _label(res, i)
            if w is None:
                assert label not in drawn
                continue
            expect = {
                k: (v if isinstance(v, float) else float(torch.cat([v.weight.flatten(), v.bias]).norm()))
                for k, v in w.items()
            }
            assert drawn[label] == pytest.approx(expect), (label, drawn)
            assert colours[label] == f"C{i}"  # checkpoint #2 is C1 in every panel, though #1 has no moments
    assert (
        res.checkpoints[0].layers
        and next(g for g in res.checkpoints[0].layers if g.name == "lora_b").norms["weight"] == 0
    )


def test_layers_holding_nan_are_marked_not_drawn_as_zero_weights(tmp_path: Path) -> None:
    """A diverged step (a NaN gradient in layer 1) leaves layer 1's weights and moments all NaN: the weight panel drew
    its norm, of no finite value, at 0 (a layer that blew up read as one that collapsed to zero) and the update panel
    left that checkpoint out, not even in its legend, with no word of NaN anywhere in the picture. Each such layer
    is marked ``x`` in its checkpoint's colour and the panel says what the marks are."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from ckpttool.ui.plot import _label, _layer_lines, write_stats_plot

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step, poison in ((1, False), (2, True)):
        opt.zero_grad()
        m(torch.randn(3, 4)).sum().backward()
        if poison:  # a diverged step in layer 1 only
            m[1].weight.grad.fill_(math.nan)
            m[1].bias.grad.fill_(math.nan)
        opt.step()
        msd, osd = get_state_dict(m, opt)
        save_quiet({"model": msd, "optimizer": osd}, tmp_path / f"step-{step}")
    res = collect_stats([tmp_path / "step-1", tmp_path / "step-2"], StatsOptions())
    second = res.checkpoints[1]
    # the layer's norm, of no finite value: none (not 0)
    assert torch.isnan(m[1].weight).all() and math.isnan(
        next(g for g in second.layers if g.name == "1").norms["weight"]
    )
    out = tmp_path / "p.svg"
    write_stats_plot(res, out)
    assert sum("the layer holds NaN/Inf" in t for t in _svg_texts(out)) == 3  # each line panel says it
    for value, roles in (
        (lambda g: g.norms.get("weight"), ("weight",)),
        (lambda g: g.update_rms, ("exp_avg", "exp_avg_sq")),
    ):
        fig, ax = plt.subplots()
        assert _layer_lines(ax, res, value, "t", "y", roles=roles)
        ticks = {round(t): lbl.get_text() for t, lbl in zip(ax.get_xticks(), ax.get_xticklabels())}
        marks = [ln for ln in ax.get_lines() if ln.get_marker() == "x"]
        colours = {ln.get_label(): ln.get_color() for ln in ax.get_lines() if ln.get_marker() == "o"}
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        title = ax.get_title()
        plt.close(fig)
        (mark,) = marks  # step-2 only, at layer 1 only
        assert [ticks[round(x)] for x in mark.get_xdata()] == ["1"]
        assert mark.get_color() == "C1" and colours.get(_label(res, 1), "C1") == "C1"
        assert _label(res, 1) in legend and "NaN/Inf" in title


def test_diff_plot_names_the_differences_it_cannot_draw(tmp_path: Path) -> None:
    """diff A B --plot where a boolean mask differs, a -0.0 stands for 0.0 (bitwise DIFFER, relative L2 0) and a
    tensor's shape differs: the verdict was DIFFERENT (3 differences) and the picture said 'every compared tensor is
    equal', with no bar and no word of them. It now says no tensor differs by a relative L2 above 0 and names what it
    does not draw; two equal saves still get 'every compared tensor is equal' and no such line."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import write_diff_plot

    mask, w = torch.tensor([True, False, True]), torch.arange(6, dtype=torch.float32)
    save_quiet({"model": {"mask": mask, "z": torch.zeros(4), "w": w}}, tmp_path / "a")
    save_quiet({"model": {"mask": mask, "z": torch.zeros(4), "w": w}}, tmp_path / "a2")
    z = torch.zeros(4)
    z[2] = -0.0
    save_quiet({"model": {"mask": ~mask, "z": z, "w": w.reshape(2, 3)}}, tmp_path / "b")
    res = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"), DiffOptions())
    assert not res.equal and res.difference_count == 3
    write_diff_plot(res, tmp_path / "d.svg")
    texts = _svg_texts(tmp_path / "d.svg")
    assert "every compared tensor is equal" not in texts and "no tensor differs by a relative L2 above 0" in texts
    assert (
        "not drawn: 2 tensors that differ with no relative L2 above 0 (booleans, -0.0 against 0.0): model.mask, model.z"
        in texts
    ), texts
    assert "not drawn: 1 difference of no tensor's values (1 shape): diff lists them" in texts, texts
    write_diff_plot(diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "a2"), DiffOptions()), tmp_path / "e.svg")
    texts = _svg_texts(tmp_path / "e.svg")
    assert "every compared tensor is equal" in texts and not [t for t in texts if t.startswith("not drawn")], texts


def test_diff_plot_draws_control_characters_of_names_escaped(tmp_path: Path) -> None:
    """A key holding a newline and an escape sequence (``m\\n\\x1b[31mX``) broke the 'not drawn' line of diff --plot in
    two and drew the escape as a box; names are drawn as the terminal shows them (``m\\\\x0a\\\\x1b[31mX``), one line."""
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints
    from ckpttool.ui.plot import write_diff_plot

    key = "m\n\x1b[31mX"
    mask = torch.tensor([True, False, True])
    save_quiet({"model": {key: mask}}, tmp_path / "a")
    save_quiet({"model": {key: ~mask}}, tmp_path / "b")
    res = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"), DiffOptions())
    write_diff_plot(res, tmp_path / "d.svg")
    texts = _svg_texts(tmp_path / "d.svg")
    line = "not drawn: 1 tensor that differs with no relative L2 above 0 (booleans, -0.0 against 0.0): model.m\\x0a\\x1b[31mX"
    assert line in texts and not [t for t in texts if "\x1b" in t], texts
