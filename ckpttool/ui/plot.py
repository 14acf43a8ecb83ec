"""Pictures of ``ckpttool stats`` and ``ckpttool diff`` results (matplotlib, the optional ``plot``
extra; nothing else imports it).

``write_stats_plot`` draws per-layer L2 norms of the weights, the Adam moments and the RMS of the
last update, one line per checkpoint, and the per-expert weight norms of the last checkpoint as
a heat map (layer x expert). ``write_diff_plot`` draws the relative difference per layer and the
tensors that differ most. Formats by suffix: ``.png``, ``.svg``, or ``.html`` (the SVG inline in
one self-contained page).
"""

from __future__ import annotations

import html
import io
import math
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import OutputError, UsageError, shell_arg
from ckpttool.format.atomic import atomic_write_bytes, check_file_target
from ckpttool.format.files import refuse_unexpanded_tilde_output

if TYPE_CHECKING:
    from ckpttool.ops.diff import DiffResult
    from ckpttool.ops.stats import StatsResult

__all__ = ["PLOT_SUFFIXES", "check_plot_target", "write_diff_plot", "write_stats_plot"]

PLOT_SUFFIXES = (".png", ".svg", ".html")
#: A URL given as ``--plot`` (``s3://b/x.png``, which ``Path`` folds to ``s3:/b/x.png``): its scheme, then ``:/``.
_URL_AS_PATH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/+")


def _pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend.

    Raises:
        UsageError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed",
            hint="pip install 'matplotlib>=3.8' (or pip install -e '.[plot]' in the ckpttool source folder)",
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_plot_target(path: Path, sources: tuple[Path, ...] = ()) -> None:
    """Refuse before any work: an unknown suffix, a missing parent directory, no matplotlib, and a path where
    writing would destroy what ckpttool did not write (:func:`~ckpttool.format.atomic.check_file_target`: not
    a regular file, inside one of ``sources``, an existing picture that ckpttool did not draw).

    Raises:
        UsageError: an unknown suffix, a missing directory, no matplotlib; OutputError (E600): as above.
    """
    try:
        _check_plot_target(path, sources)
    except OSError as e:  # a name the system refuses to look up (over NAME_MAX: ENAMETOOLONG)
        raise OutputError(
            f"--plot {path}: cannot be used as a file name ({e.strerror})",
            hint="give a shorter file name ending in .png, .svg or .html",
        ) from None
    _pyplot()


def _refuse_missing_folder(path: Path) -> None:
    """Raise for ``path`` whose folder is not a directory: a file in its way, or a folder to make first.

    Raises:
        UsageError: always.
    """
    in_way = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if in_way is not None:  # mkdir -p would fail there (File exists)
        raise UsageError(
            f"--plot {path}: {in_way} is a file, not a directory",
            hint="give a file name in a directory, or move that file out of the way",
        )
    raise UsageError(
        f"--plot {path}: directory {path.parent} does not exist",
        hint=f"create it first: mkdir -p {shell_arg(path.parent)}",
    )


def _check_plot_target(path: Path, sources: tuple[Path, ...]) -> None:
    if path.is_dir():
        raise UsageError(f"--plot {path} is a directory", hint="give a file name ending in .png, .svg or .html")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(
            f"--plot {path}: unknown picture format {path.suffix or '(none)'}", hint="use .png, .svg or .html"
        )
    refuse_unexpanded_tilde_output(path, "--plot")
    if not path.parent.is_dir():
        if _URL_AS_PATH.match(str(path)):  # s3://b/x.png reached here as the Path s3:/b/x.png
            url = _URL_AS_PATH.sub(r"\1://", str(path), count=1)
            raise UsageError(
                f"--plot {url}: a URL; --plot writes a local file only",
                hint="give a local file name and copy the picture to object storage yourself",
            )
        _refuse_missing_folder(path)
    check_file_target(
        path,
        option="--plot",
        hint="give a new file name outside the checkpoints read, or one of an earlier --plot",
        sources=sources,
        owned=_drawn_here,
    )


#: What every picture ckpttool draws carries: the PNG ``Software`` text, the SVG's ``dc:creator``, the HTML title.
_MARK = "ckpttool --plot"


def _drawn_here(head: bytes) -> bool:
    """Whether a picture's first bytes carry :data:`_MARK` where ckpttool puts it: the PNG's ``Software`` text
    chunk, the SVG's ``dc:creator`` agent, the HTML page's title (no other mention counts)."""
    mark = _MARK.encode()
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        text = b"Software\x00" + mark  # the tEXt chunk: its length, type, then exactly this text
        return len(text).to_bytes(4, "big") + b"tEXt" + text in head
    if head.startswith(b"<!DOCTYPE html>\n"):
        return head.startswith(b"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" + mark + b": ")
    if head.startswith(b"<?xml"):
        return (
            re.search(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>" + re.escape(mark) + rb"</dc:title>", head) is not None
        )
    return False


def layer_axis(res: StatsResult) -> list[str]:
    """The layers of every checkpoint of ``res`` in model order: each checkpoint's order, a layer that only a
    later checkpoint holds placed after the layer it follows there (one x axis for every line)."""
    order: list[str] = []
    for c in res.checkpoints:
        at = -1
        for g in c.layers:
            if g.name in order:
                at = order.index(g.name)
            else:
                at += 1
                order.insert(at, g.name)
    return order


#: Checkpoints drawn with a legend; more are coloured by their place in the order given, named on a colour bar.
_LEGEND_MOST = 8


def _nonfinite_layers(res: StatsResult, roles: tuple[str, ...]) -> list[set[str]]:
    """Per checkpoint of ``res``, the layers whose tensors of ``roles`` hold NaN or infinity (a layer stacked on dim 0,
    Megatron-core's ``decoder.layers.*``: each of its layers whose tensors of any role do)."""
    out = []
    for c in res.checkpoints:
        found = {t.layer for t in c.tensors if t.nonfinite and t.role in roles}
        if any(n.endswith("*") for n in found):
            found |= {g.name for g in c.layers if g.nonfinite}
        out.append(found)
    return out


#: How a panel says what its ``x`` marks are (a layer's figure is of its finite values, or none where they decide it).
_NONFINITE_KEY = "x at the top: the layer holds NaN/Inf"


def _mark_nonfinite(ax: Any, at: list[int], height: float, color: Any, label: str | None) -> None:
    """Mark the layer positions ``at`` with an ``x`` at ``height`` (a fraction of the panel's height) in ``color``."""
    ax.plot(
        at,
        [height] * len(at),
        linestyle="none",
        marker="x",
        markersize=6,
        color=color,
        label=label,
        transform=ax.get_xaxis_transform(),  # x: the layer; y: a fraction of the panel's height
        clip_on=False,
    )


def _draw_series(
    ax: Any, series: list[tuple[str, dict[str, float]]], bad: list[set[str]], names: list[str], scale: Any
) -> None:
    """Each checkpoint's line (``series``: its label and values per layer) over the layers ``names``, and its layers
    holding NaN/Inf (``bad``) marked; coloured by ``scale`` (a colour scale of many checkpoints), else ``C0``..."""
    for i, (label, pts) in enumerate(series):
        # the same colour in every panel, whichever lines a panel lacks
        color = scale.get_cmap()(i / (len(series) - 1)) if scale is not None else f"C{i % 10}"
        if pts:
            ax.plot(
                range(len(names)),
                [pts.get(n, math.nan) for n in names],
                marker="o",
                markersize=3,
                label=label,
                color=color,
            )
        if bad[i]:  # a checkpoint with no value here is still named, by its marks
            at = [j for j, n in enumerate(names) if n in bad[i]]
            _mark_nonfinite(ax, at, 0.97 - 0.025 * (i % 8), color, None if pts else label)


def _layer_lines(
    ax: Any, res: StatsResult, value: Any, title: str, ylabel: str, empty: str = "", roles: tuple[str, ...] = ()
) -> bool:
    """One line per checkpoint of ``value(layer)`` over the layers of :func:`layer_axis` that have one: each value
    at its own layer's position (a layer without a value in a checkpoint, say one whose parameters were frozen, is
    a gap in that line, not a shift of the values after it). A layer whose tensors of ``roles`` hold NaN/Inf in a
    checkpoint is marked ``x`` at the top of the panel in that checkpoint's colour (its norm, of the finite values
    only, would read as a layer of small or zero weights; its update size, ``nan``, as no value at all)."""
    series: list[tuple[str, dict[str, float]]] = []
    for i, c in enumerate(res.checkpoints):
        # 0 is a value (a zero-initialised LoRA B or gate, moments torch made up before the first step): drawn
        pts = {g.name: v for g in c.layers if (v := value(g)) is not None and math.isfinite(v) and v >= 0}
        series.append((_label(res, i), pts))
    bad = _nonfinite_layers(res, roles)
    names = [n for n in layer_axis(res) if any(n in pts for _, pts in series) or any(n in b for b in bad)]
    shown = [v for _, pts in series for v in pts.values()]
    many = len(series) > _LEGEND_MOST
    if many:  # a legend of dozens of entries is taller than the panel and hides the lines: a colour scale instead
        from matplotlib import colormaps
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        scale = ScalarMappable(norm=Normalize(0, len(series) - 1), cmap=colormaps["viridis"])
    _draw_series(ax, series, bad, names, scale if many else None)
    drawn = bool(shown) or any(bad)
    ax.set_title(title + (f"\n({_NONFINITE_KEY})" if any(bad) else ""), fontsize=9)
    if drawn:
        at = _every(len(names), 64)
        ax.set_xticks(at, [_plain(names[i]) for i in at], rotation=90, fontsize=6)
        ax.set_xlabel("layer", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        _value_scale(ax, shown or [0.0])
        if many:
            bar = ax.figure.colorbar(scale, ax=ax)
            at = sorted({*_every(len(series) - 1, 9), len(series) - 1})  # the first and the last named
            bar.set_ticks(at, labels=[series[i][0] for i in at], fontsize=6)
            bar.set_label("checkpoint (in the order given)", fontsize=8)
        else:
            ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, empty or "not in the checkpoint", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    return drawn


def _value_scale(ax: Any, shown: list[float]) -> None:
    """The y axis of values ``>= 0``: log across a decade or more (symmetric-log where some are 0, which a log
    axis has no place for: linear up to the smallest value above 0); within one, a log axis labels its minor ticks
    alike (10x10^-4 ...): linear from 0, without an offset (values alike to 1e-8 would read as "1e-11+1e-3")."""
    above = [v for v in shown if v > 0]
    if above and max(above) >= 10 * min(above) and len(above) == len(shown):
        ax.set_yscale("log")
    elif above and max(above) >= 10 * min(above):
        ax.set_yscale("symlog", linthresh=min(above))
        ax.set_ylim(0, max(above) * 2)
    else:
        ax.set_ylim(0, max(shown) * 1.05 or 1.0)  # every value 0: a line at 0, not an empty axis
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)


def _every(n: int, most: int) -> list[int]:
    """Positions ``0..n-1`` to label, at most about ``most`` of them (every k-th): 128 experts or 94 layers labelled
    each at 6 points overlap into a black band."""
    return list(range(0, n, max(1, math.ceil(n / most))))


def _plain(text: str) -> str:
    """A name from a checkpoint (a key, a path) as matplotlib draws it literally: its ``$`` escaped, which would
    otherwise start mathtext (``a$x$b`` drawn in italics, ``$\\nocmd$`` a ValueError that ended the command E999),
    and its control characters escaped as the terminal shows them (:func:`~ckpttool.ui.render.safe_text`: a newline
    in a key broke a title's line, an escape sequence was drawn as a box)."""
    from ckpttool.ui.render import safe_text

    return safe_text(text).replace("$", r"\$")


def _label(res: StatsResult, i: int) -> str:
    """Checkpoint ``i`` of ``res`` in a legend or title: ``step N`` where every checkpoint's step is known and
    differs, else its place and the shortest end of its path that tells it from the others (two runs at one
    step: ``#1 runA/step-5 (step 5)``, ``#2 runB/step-5 (step 5)``)."""
    cks = res.checkpoints
    steps = [c.step for c in cks]
    if None not in steps and len(set(steps)) == len(steps):
        return f"step {steps[i]}"
    parts = [Path(c.path).parts for c in cks]
    for k in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names) or k == len(parts[i]):
            break
    step = f" (step {steps[i]})" if steps[i] is not None else ""
    return f"#{i + 1} {_plain(names[i])}{step}"


def _experts(ax: Any, res: StatsResult) -> None:
    last = res.checkpoints[-1]
    rows: dict[str, list[float]] = {}
    for e in last.experts:
        acc = rows.setdefault(e.layer, [0.0] * len(e.norms))
        if len(acc) == len(e.norms):
            rows[e.layer] = [a + n * n for a, n in zip(acc, e.norms)]
    if not rows:
        ax.text(0.5, 0.5, "no expert tensors ([E, ...] on dim 0)", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("experts", fontsize=9)
        ax.set_axis_off()  # a message, not an empty 0-1 plot
        return
    width = max(len(v) for v in rows.values())
    grid = [[(v[i] ** 0.5) if i < len(v) else float("nan") for i in range(width)] for v in rows.values()]
    # an expert of no finite value (its norm nan): red, said in the title, not blank as a cell of no expert
    broken = any(math.isnan(x) for v in rows.values() for x in v)
    from matplotlib import colormaps

    im = ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap=colormaps["viridis"].with_extremes(bad="red") if broken else None,
    )
    names = list(rows)
    at = _every(len(names), 48)
    ax.set_yticks(at, [_plain(names[i]) for i in at], fontsize=6)
    at = _every(width, 16)
    ax.set_xticks(at, [str(i) for i in at], fontsize=6)
    ax.set_xlabel("expert", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    from ckpttool.ops.stats.run import STORED_ORDER_NOTE

    stored = any(n.startswith(STORED_ORDER_NOTE) for n in last.notes)  # the EP layout does not say the true order
    ax.set_title(
        f"expert weight L2 per layer and expert ({_label(res, len(res.checkpoints) - 1)})"
        + ("\nexperts in stored order: the EP layout is not known (ckpttool stamp declares it)" if stored else "")
        + ("\nred: an expert of NaN/Inf values only (no norm)" if broken else ""),
        fontsize=9,
    )
    ax.figure.colorbar(im, ax=ax).set_label("L2 norm of the expert's weights", fontsize=8)


def write_stats_plot(res: StatsResult, path: Path, *, optimizer: bool = True) -> None:
    """Draw ``res`` into ``path`` (written whole: a temporary file renamed into place); ``optimizer``: whether the
    optimizer state was measured (``--no-optimizer``: its panels say so, not that the checkpoint has none).

    Raises:
        UsageError: matplotlib missing, or an unknown suffix.
    """
    check_plot_target(path)
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    _layer_lines(axes[0][0], res, lambda g: g.norms.get("weight"), "weight L2 per layer", "L2 norm", roles=("weight",))
    skipped = "not measured (--no-optimizer)"
    _layer_lines(
        axes[0][1],
        res,
        lambda g: g.norms.get("exp_avg"),
        "exp_avg L2 per layer",
        "L2 norm",
        "no exp_avg in the checkpoint" if optimizer else skipped,
        roles=("exp_avg",),
    )
    _layer_lines(
        axes[1][0],
        res,
        lambda g: g.update_rms,
        "AdamW update RMS per layer",
        "RMS of lr*|m_hat|/(sqrt(v_hat)+eps)",
        "no update size\n(it needs exp_avg, exp_avg_sq, step\nand an AdamW param group: see the notes)"
        if optimizer
        else skipped,
        roles=("exp_avg", "exp_avg_sq"),
    )
    _experts(axes[1][1], res)
    _save(fig, plt, path, ", ".join(Path(c.path).name for c in res.checkpoints))


def _save(fig: Any, plt: Any, path: Path, title: str) -> None:
    """Write ``fig`` to ``path`` in its suffix's format, whole (a temporary file renamed into place)."""
    suffix = path.suffix.lower()
    buf = io.BytesIO()
    fmt = "svg" if suffix == ".html" else suffix[1:]
    with warnings.catch_warnings(record=True) as caught:  # matplotlib's own warnings: ckpttool's lines instead
        warnings.simplefilter("always")
        fig.savefig(buf, format=fmt, dpi=120, metadata={"Software" if fmt == "png" else "Creator": _MARK})
    plt.close(fig)
    _drawing_warnings(path, [str(w.message) for w in caught])
    data = buf.getvalue()
    if suffix == ".html":
        svg = data.decode("utf-8")
        data = (
            f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{_MARK}: {html.escape(title)}</title></head>"
            f"<body>\n{svg[svg.index('<svg') :]}\n</body></html>\n"
        ).encode()
    atomic_write_bytes(path, data, fsync=False)


#: matplotlib's warning for a character its font cannot draw (a CJK checkpoint path): ``Glyph 23455 (...) missing``.
_NO_GLYPH = re.compile(r"Glyph (\d+) .*missing from font")


def _drawing_warnings(path: Path, messages: list[str]) -> None:
    """matplotlib's warnings while drawing ``path`` as ``warning:`` lines (its own printed a source file and line):
    the characters no font had, drawn as boxes, in one line; any other, its first line, once."""
    from ckpttool.ui.output import warn

    boxes = list(dict.fromkeys(chr(int(m.group(1))) for t in messages if (m := _NO_GLYPH.search(t))))
    if boxes:
        warn(f"--plot {path}: the font has no glyph for {', '.join(boxes)} (drawn as boxes)")
    for text in dict.fromkeys(t.splitlines()[0] if t else "" for t in messages if not _NO_GLYPH.search(t)):
        warn(f"--plot {path}: {text}")


def diff_layers(res: DiffResult) -> list[tuple[str, float | None, float]]:
    """Per layer (:func:`~ckpttool.ops.stats.layer_of` of the compared names, in A's order, the model's):
    ``(layer, relative L2 over its decoded tensors, largest relative L2 of its tensors)``.

    The relative L2 of a layer is ``sqrt(sum ||a-b||^2) / sqrt(sum ||b||^2)`` over its tensors whose
    values were decoded (``None`` when none was: all equal records, 0 difference). A tensor of stacked layers
    (Megatron-core's ``decoder.layers.<module> [L, ...]``) counts in each layer by its dim-0 slice
    (:attr:`~ckpttool.ops.diff.result.TensorStat.layers`).
    """
    from ckpttool.ops.stats import layer_of

    acc: dict[str, list[float]] = {}

    def fold(layer: str, d: float | None, b: float | None, rel: float | None) -> None:
        a = acc.setdefault(layer, [0.0, 0.0, 0.0])
        if d is not None and b is not None:
            a[0] += d * d
            a[1] += b * b
        if rel is not None:  # a NaN stays NaN (max would drop it)
            a[2] = math.nan if math.isnan(rel) or math.isnan(a[2]) else max(a[2], rel)

    rank = {name: i for i, name in reversed(list(enumerate(res.compared_order)))}
    for t in sorted(res.tensors, key=lambda t: rank.get(t.name, len(rank))):  # not by difference: an x axis of layers
        if t.layers:
            for layer, d, b in t.layers:
                fold(layer, d, b, _over(d * d, b * b) or 0.0)
        else:
            fold(layer_of(t.name), t.diff_l2, t.b_l2, t.rel_l2)
    return [(k, _over(v[0], v[1]), v[2]) for k, v in acc.items()]


def _over(d2: float, b2: float) -> float | None:
    """``sqrt(d2 / b2)``; where ``||b|| = 0`` (a zero-initialised layer as the reference) ``inf`` if ``a`` differs,
    ``None`` if it does not; ``nan`` where a NaN or infinity in ``a`` or ``b`` made either sum not a number."""
    if math.isnan(d2) or math.isnan(b2):
        return math.nan
    if b2 > 0:
        return math.sqrt(d2) / math.sqrt(b2)
    return None if d2 == 0 else math.inf


def write_diff_plot(res: DiffResult, path: Path) -> None:
    """Draw ``diff``'s per-layer relative difference and its 30 most different tensors into ``path``.

    Raises:
        UsageError: matplotlib missing, or an unknown suffix.
    """
    check_plot_target(path)
    plt = _pyplot()
    layers = diff_layers(res)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6), constrained_layout=True)
    x = range(len(layers))
    floor = 1e-12  # zero on a log axis
    # infinite (||b|| = 0, a differs): drawn at the top, marked; a log axis has no place for it
    finite = [v for _, r, m in layers for v in (r, m) if v is not None and floor < v < math.inf]
    ceiling = 10 * max(finite, default=floor)

    def y(v: float | None) -> float:  # NaN (a non-finite value in a or b) at the top too, marked apart
        return ceiling if v is not None and (v == math.inf or math.isnan(v)) else max(v or 0.0, floor)

    ax1.plot(x, [y(r) for _, r, _ in layers], marker="o", markersize=3, label="layer ||a-b|| / ||b||")
    ax1.plot(x, [y(m) for _, _, m in layers], marker="x", markersize=3, linestyle=":", label="largest tensor")
    inf = [i for i, (_, r, m) in enumerate(layers) if math.inf in (r, m)]
    if inf:
        ax1.plot(inf, [ceiling] * len(inf), "r^", label="infinite: ||b|| = 0 where a differs")
    nan = [i for i, (_, r, m) in enumerate(layers) if any(v is not None and math.isnan(v) for v in (r, m))]
    if nan:
        ax1.plot(nan, [ceiling] * len(nan), "mX", label="not a number: NaN or Inf in a or b")
    at = _every(len(layers), 64)
    ax1.set_xticks(at, [_plain(layers[i][0]) for i in at], rotation=90, fontsize=6)
    ax1.set_yscale("log")
    ax1.set_xlabel("layer", fontsize=8)
    ax1.set_ylabel("||a-b|| / ||b||", fontsize=8)
    ax1.set_title(f"relative L2 difference per layer (values <= {floor:g}: equal)", fontsize=9)
    ax1.legend(fontsize=7)
    _diff_bars(ax2, res, y)
    undrawn = _not_drawn(res)
    fig.suptitle(
        f"a = {_plain(res.a.path)}\nb = {_plain(res.b.path)} (the reference)"
        + "".join(f"\n{_plain(u)}" for u in undrawn),
        fontsize=9,
        color="tab:red" if undrawn else None,
    )
    _save(fig, plt, path, f"diff {res.a.path} {res.b.path}")


def _not_drawn(res: DiffResult) -> list[str]:
    """The differences of ``res`` that no bar or point shows, one line each (none: the picture shows them all):
    tensors that differ with a relative L2 of 0 or none (booleans, ``-0.0`` against ``0.0`` bitwise), and the
    differences that are no tensor's values (dtype, shape, a name on one side only, hyperparameters, byte items)."""
    rank = {name: i for i, name in reversed(list(enumerate(res.compared_order)))}
    flat = [t.name for t in res.tensors if t.status == "differ" and (t.rel_l2 == 0 or t.rel_l2 is None)]
    flat.sort(key=lambda name: rank.get(name, len(rank)))  # in A's order, as the layers are drawn
    out = []
    if flat:
        shown = ", ".join(f"{name:.80}" for name in flat[:3]) + (", ..." if len(flat) > 3 else "")
        out.append(
            f"not drawn: {len(flat)} tensor{'s that differ' if len(flat) != 1 else ' that differs'} with no relative L2 above 0 "
            f"(booleans, -0.0 against 0.0): {shown}"
        )
    kinds: dict[str, int] = {}
    for d in res.differences:
        if d.kind != "values":
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
    if kinds:
        n = sum(kinds.values())
        counts = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
        out.append(
            f"not drawn: {n} difference{'s' if n != 1 else ''} of no tensor's values ({counts}): diff lists them"
        )
    return out


def _diff_bars(ax2: Any, res: DiffResult, y: Any) -> None:
    """The 30 tensors of ``res`` that differ most as bars at ``y(relative L2)``: those whose difference is not a
    number (NaN or Inf in a or b) first, in purple; infinite ones (``||b|| = 0``) in red."""
    nans = [t for t in res.tensors if t.rel_l2 is not None and math.isnan(t.rel_l2)]  # they differ most of all
    top = (nans + [t for t in res.tensors if t.rel_l2 is not None and t.rel_l2 > 0])[:30]
    if top:
        colour = {math.inf: "tab:red"}
        ax2.barh(
            range(len(top)),
            [y(t.rel_l2) for t in top],
            color=[
                "tab:purple" if t in nans else colour.get(t.rel_l2, "tab:blue")  # type: ignore[arg-type]
                for t in top
            ],
        )
        ax2.set_yticks(range(len(top)), [_plain(t.name) for t in top], fontsize=6)
        ax2.invert_yaxis()
        ax2.set_xscale("log")
        ax2.set_xlabel("||a-b|| / ||b||", fontsize=8)
    else:
        differ = any(t.status == "differ" for t in res.tensors)
        text = "no tensor differs by a relative L2 above 0" if differ else "every compared tensor is equal"
        ax2.text(0.5, 0.5, text, ha="center", va="center", transform=ax2.transAxes)
        ax2.set_axis_off()
    ax2.set_title(
        "tensors that differ most (relative L2)" + ("\npurple: not a number, NaN or Inf in a or b" if nans else ""),
        fontsize=9,
    )
