"""The report's PNG plots, drawn with matplotlib's object API (Agg canvas, no pyplot state, no display needed).

Each plot has a ``*_figure`` function that takes plain numbers and returns the matplotlib Figure (tests count its
marks: artists carry a ``gid`` such as ``run:LABEL``, ``frontier``, ``iso:K``), and a function of the same name
without ``_figure`` that returns PNG bytes, so the report can write them to any filesystem. Every mark has a
legend entry, and every legend sits beside or below its axes, never over the marks; run labels are placed inside
the axes where they overlap no other label, marker or error bar (`place_labels`). Axes name their units: the cost
basis on x (FLOPs in an SI unit, or dollars), the reward's own units on y (`runfolder.runs.REWARD_UNITS`).
"""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter
from matplotlib.transforms import Bbox, ScaledTranslation

from reporting.tolerance import positive

DPI = 110
FONT = 8


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _legend_outside(ax, handles) -> None:
    """Every mark's legend entry, in a column to the right of the axes."""
    ax.legend(handles=handles, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              frameon=False)


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Placing labels without collisions


def _ring(step: float) -> list[tuple[float, float]]:
    return [(step, step), (step, -step), (-step, step), (-step, -step), (step, 0), (-step, 0), (0, step),
            (0, -step)]


OFFSETS = [o for step in (7, 15, 26, 40, 56) for o in _ring(step)]  # points, nearest first


def place_labels(ax, anchors: list[tuple], obstacles: list[Bbox], fontsize: float = FONT,
                 color: str = "black") -> list:
    """Annotate each anchor (x, y, text, gid[, first offset]) in data coordinates at the first offset (the anchor's
    own first, then OFFSETS) whose text box overlaps no earlier label and no obstacle (display-space boxes) and stays
    inside the axes; where none is free, the offset inside the axes with the fewest overlaps, so a label never
    leaves the axes for the legend beside them. A label moved past the first ring gets a thin leader line. Returns
    the annotations. Needs the axes' limits to be final."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed: list[Bbox] = []
    out = []
    for x, y, text, gid, *prefer in anchors:
        best, fallback = None, None
        for k, (dx, dy) in enumerate(prefer + OFFSETS):
            k -= len(prefer)
            ha = "left" if dx > 0 else "right" if dx < 0 else "center"
            va = "bottom" if dy > 0 else "top" if dy < 0 else "center"
            spot = {"xytext": (dx, dy), "ha": ha, "va": va,
                    "arrowprops": None if k < 8 else {"arrowstyle": "-", "color": "0.5", "lw": 0.6}}
            ann = ax.annotate(text, (x, y), textcoords="offset points", fontsize=fontsize, color=color, gid=gid,
                              **spot)
            box = ann.get_window_extent(renderer).padded(2)
            ann.remove()
            inside = (box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1)
            if not inside:
                continue
            hits = sum(box.overlaps(b) for b in placed + obstacles)
            if hits == 0:
                best = (spot, box)
                break
            if fallback is None or hits < fallback[0]:
                fallback = (hits, spot, box)
        if best is None:  # nowhere free: the spot inside the axes with the fewest overlaps (never over the legend)
            best = fallback[1:] if fallback is not None else (
                {"xytext": (0, 0), "ha": "center", "va": "center", "arrowprops": None}, None)
        ann = ax.annotate(text, (x, y), textcoords="offset points", fontsize=fontsize, color=color, gid=gid,
                          **best[0])
        placed.append(best[1] if best[1] is not None else ann.get_window_extent(renderer).padded(2))
        out.append(ann)
    return out


def _marker_box(ax, x: float, y: float, size_pt: float, dx_pt: float = 0.0) -> Bbox:
    px, py = ax.transData.transform((x, y))
    half = size_pt / 2 * ax.figure.dpi / 72
    px += dx_pt * ax.figure.dpi / 72
    return Bbox([[px - half, py - half], [px + half, py + half]])


def _bar_box(ax, x: float, low: float, high: float, dx_pt: float = 0.0) -> Bbox:
    (px, p0), (_, p1) = ax.transData.transform([(x, low), (x, high)])
    px += dx_pt * ax.figure.dpi / 72
    return Bbox([[px - 3, min(p0, p1)], [px + 3, max(p0, p1)]])


def _line_boxes(ax, xs: list[float], ys: list[float], step_px: float = 6.0) -> list[Bbox]:
    """Small boxes along a polyline (display space), so labels can keep off it."""
    disp = ax.transData.transform(list(zip(xs, ys)))
    out = []
    for (x0, y0), (x1, y1) in zip(disp[:-1], disp[1:]):
        n = max(1, int(((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5 / step_px))
        for i in range(n + 1):
            x, y = x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n
            out.append(Bbox([[x - 1.5, y - 1.5], [x + 1.5, y + 1.5]]))
    return out


def _dodges(ax, spans: list[tuple[float, float, float]], near_px: float = 8.0, step_pt: float = 7.0) -> list[float]:
    """Horizontal offsets (points) that keep marks from drawing over each other: spans are (x, low, high) in data
    coordinates (a point's error bar, or its marker). A span whose x is within near_px of an earlier one's and whose
    vertical range overlaps it gets +step, -step, +2 step... so each error bar stays visible; a lone one gets 0."""
    lows = ax.transData.transform([(x, lo) for x, lo, _ in spans])
    highs = ax.transData.transform([(x, hi) for x, _, hi in spans])
    out = []
    for i in range(len(spans)):
        k = sum(1 for j in range(i) if abs(lows[j][0] - lows[i][0]) < near_px
                and min(highs[i][1], highs[j][1]) >= max(lows[i][1], lows[j][1]) - near_px)
        out.append(0.0 if k == 0 else step_pt * ((k + 1) // 2) * (1 if k % 2 else -1))
    return out


def _limits(values: list[float], pad: float = 0.08, floor: float | None = None) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    span = (hi - lo) or (abs(hi) or 1.0) * 0.2
    lo, hi = lo - pad * span, hi + pad * span
    if floor is not None:
        lo = max(lo, floor)
    return lo, hi


def nice_levels(values: list[float], most: int = 4) -> list[float]:
    """Up to `most` round numbers (1, 2, 5 x 10^k) spread over the range of the positive values, for reference
    lines; [] when none is positive."""
    pos = sorted(v for v in values if v is not None and v > 0 and math.isfinite(v))
    if not pos:
        return []
    lo, hi = pos[0] / 2, pos[-1] * 1.5
    cands = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
    if len(cands) <= most:
        return cands
    picks = [cands[round(i * (len(cands) - 1) / (most - 1))] for i in range(most)]
    return sorted(set(picks))


def _usd_tick(v: float, _pos=None) -> str:
    """Dollars in plain decimals ($0.00004, $0.25), with no exponent to read."""
    return "$" + np.format_float_positional(v, precision=3, unique=True, fractional=False, trim="-")


# ---------------------------------------------------------------------------------------------------------------
# (a) Mean best reward against USD per prompt: the cost-reward frontier


def flop_unit(values: list[float]) -> tuple[float, str]:
    """(scale, unit) to show FLOPs in: the largest SI prefix the biggest value reaches (1e9, "GFLOP")."""
    top = max((abs(v) for v in values), default=0.0)
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if top >= scale:
            return scale, f"{prefix}FLOP"
    return 1.0, "FLOP"


def reward_vs_cost_figure(points: list[dict], frontier: list[str], single_sample: float | None = None,
                          baseline_reward: float | None = None, usd_per_device_hour: float | None = None,
                          prompts: int | None = None, basis: str = "usd", reward_units: str = "reward") -> Figure:
    """One point per run at (cost per prompt, mean best reward) with its bootstrap interval as error bar; the
    frontier as a line through its runs (cheapest first); the baseline's single-sample reward and mean best reward
    as levels; lines of equal reward gained per unit of cost, (reward - single_sample) / cost, through
    (0, single_sample).

    points: dicts with label, method, cost, reward, low, high, on_frontier, is_baseline, below_baseline; cost is
    FLOPs per prompt for basis "compute" (drawn in the SI unit its largest value reaches) and USD for "usd".
    usd_per_device_hour: the price shared by every run, if one; then, on the USD basis, a top axis shows
    device-seconds per prompt. reward_units: what the reward measures, for the y axis.
    """
    compute = basis == "compute"
    scale, unit = flop_unit([p["cost"] for p in points]) if compute else (1.0, "USD")
    points = [{**p, "x": p["cost"] / scale} for p in points]  # x: the cost in the axis' unit
    fig = _new_figure(10.5, 5.6)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.09, right=0.66, bottom=0.11, top=0.86)
    xs = [p["x"] for p in points]
    ys = [v for p in points for v in (p["low"], p["high"], p["reward"])]
    ys += [v for v in (single_sample, baseline_reward) if v is not None]
    log_x = min(xs) > 0 and max(xs) / min(xs) > 20
    if log_x:
        ax.set_xscale("log")
        x0, x1 = min(xs) / 1.6, max(xs) * 1.6
    else:
        x0, x1 = 0.0, max(xs) * 1.22 or 1.0
    y0, y1 = _limits(ys, pad=0.12)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)

    handles = []
    if single_sample is not None:
        handles.append(ax.axhline(single_sample, color="0.35", ls=":", lw=1.2, gid="baseline-single-sample",
                                  label="baseline's single-sample reward (one sample, no selection)"))
    if baseline_reward is not None:
        handles.append(ax.axhline(baseline_reward, color="0.35", ls="--", lw=0.9, gid="baseline-reward",
                                  label="baseline's mean best reward (below it: below the baseline)"))
    iso_labels = []
    if single_sample is not None:
        # runs that gain reward (beyond float noise: the baseline itself gains ~0), within 3 decades of the best
        gains = [(p["reward"] - single_sample) / p["x"] for p in points
                 if p["x"] > 0 and positive(p["reward"] - single_sample)]
        levels = nice_levels([g for g in gains if g >= max(gains) / 1000]) if gains else []
        n = 200
        grid = [x0 * (x1 / x0) ** (i / n) for i in range(n + 1)] if log_x else [x1 * i / n for i in range(n + 1)]
        for j, k in enumerate(levels):
            line = ax.plot(grid, [single_sample + k * x for x in grid], color="0.75", lw=0.8, ls="-", zorder=0,
                           gid=f"iso:{k:g}", label=f"equal reward gained per {unit} (value at the line's end)"
                           if j == 0 else "_nolegend_")[0]
            if j == 0:
                handles.append(line)
            # the line's end inside the axes: the right edge, or the top edge where it leaves earlier
            # its label just left of that end, between the line and the next steeper one
            right = single_sample + k * x1 <= y1
            xe = x1 if right else (y1 - single_sample) / k
            if xe > x0:
                iso_labels.append((xe, single_sample + k * xe, f"{k:g} / {unit}", f"iso-label:{k:g}",
                                   (-4, 6) if right else (-4, -4)))

    front = sorted((p for p in points if p["label"] in frontier), key=lambda p: frontier.index(p["label"]))
    handles.append(ax.plot([p["x"] for p in front], [p["reward"] for p in front], color="C3", lw=1.8, zorder=1,
                           gid="frontier", label="cost-reward frontier (no run is cheaper and better)")[0])

    dodge = _dodges(ax, [(p["x"], p["low"], p["high"]) for p in points])
    obstacles = _line_boxes(ax, [p["x"] for p in front], [p["reward"] for p in front])
    for i, (p, dx) in enumerate(zip(points, dodge)):
        star = p.get("is_baseline")
        size = 13 if star else 8
        color = f"C{i % 10}" if i % 10 != 3 else "C9"  # C3 is the frontier's
        tags = [t for t, on in (("baseline", star), ("frontier", p["on_frontier"]),
                                ("dominated", not p["on_frontier"]), ("below baseline", p.get("below_baseline")))
                if on]
        c = ax.errorbar([p["x"]], [p["reward"]], yerr=[[p["reward"] - p["low"]], [p["high"] - p["reward"]]],
                        fmt="*" if star else "o", markersize=size, capsize=4, color=color, zorder=3,
                        markerfacecolor=color if p["on_frontier"] else "white", markeredgewidth=1.5,
                        transform=ax.transData + ScaledTranslation(dx / 72, 0, fig.dpi_scale_trans),
                        label=f"{p['label']} ({p['method']}): {', '.join(tags)}")
        c.lines[0].set_gid(f"run:{p['label']}")  # the marker; the caps and bar get their own gids
        for cap in c.lines[1]:
            cap.set_gid(f"cap:{p['label']}")
        for bar in c.lines[2]:
            bar.set_gid(f"bar:{p['label']}")
        handles.append(c)
        obstacles += [_marker_box(ax, p["x"], p["reward"], size, dx), _bar_box(ax, p["x"], p["low"], p["high"], dx)]
    handles.append(Line2D([], [], ls="none", marker="o", markerfacecolor="white", markeredgecolor="0.3",
                          label="open marker: dominated run; bars: 95% bootstrap interval over prompts"))
    if any(dodge):
        handles.append(Line2D([], [], ls="none", marker="$\\leftrightarrow$", color="0.3", markersize=9,
                              label="runs on nearly one spot: drawn a few pixels apart"))
    place_labels(ax, iso_labels, obstacles, fontsize=7, color="0.45")
    iso_boxes = [t.get_window_extent(fig.canvas.get_renderer()).padded(2) for t in ax.texts]
    order = sorted(range(len(points)), key=lambda i: points[i]["x"])
    place_labels(ax, [(points[i]["x"], points[i]["reward"], points[i]["label"], f"label:{points[i]['label']}")
                      for i in order], obstacles + iso_boxes)

    if compute:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos=None: f"{v:g}"))
        ax.set_xlabel(f"compute per prompt ({unit}: 2 x parameters x tokens processed, per model)")
    else:
        ax.xaxis.set_major_formatter(FuncFormatter(_usd_tick))
        ax.set_xlabel("USD per prompt, measured (device-seconds / 3600 x USD per device-hour)")
    ax.set_ylabel(f"mean best reward ({reward_units})")
    if usd_per_device_hour and not compute:
        per_s = usd_per_device_hour / 3600.0
        top = ax.secondary_xaxis("top", functions=(lambda u: u / per_s, lambda s: s * per_s))
        top.set_xlabel(f"device-seconds per prompt (at ${usd_per_device_hour:g} per device-hour)", fontsize=9)
    where = f", {prompts} prompts every run completed" if prompts else ""
    what = "compute" if compute else "USD"
    ax.set_title(f"Mean best reward against {what} per prompt: the cost-reward frontier{where}", fontsize=10,
                 pad=28 if (usd_per_device_hour and not compute) else 8)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax, handles)
    return fig


def reward_vs_cost(*args, **kwargs) -> bytes:
    """PNG of reward_vs_cost_figure."""
    return _png(reward_vs_cost_figure(*args, **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# (b) Paper 001's view: improvement score against relative compute


def improvement_vs_relative_compute_figure(points: list[dict], baseline: str, basis: str = "usd") -> Figure:
    """One point per run at (relative compute, improvement score) against the baseline (paper 001, figure 3).

    points: dicts with label, method, relative_compute, improvement_score, below_baseline; relative_compute is the
    ratio of FLOPs for basis "compute", of device-seconds (the paper's) for "usd".
    """
    fig = _new_figure(10.0, 5.2)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.09, right=0.64, bottom=0.11, top=0.9)
    xs = [p["relative_compute"] for p in points]
    ys = [p["improvement_score"] for p in points] + [0.0, 100.0]
    log_x = min(xs) > 0 and max(xs) / min(xs) > 20
    if log_x:
        ax.set_xscale("log")
        ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)
    else:
        ax.set_xlim(0.0, max(max(xs) * 1.2, 1.2))
    ax.set_ylim(*_limits(ys, pad=0.12))
    handles = [
        ax.axhline(100.0, color="0.35", ls="--", lw=0.9, gid="score-100",
                   label=f"100: as good as the best of {baseline}'s samples"),
        ax.axhline(0.0, color="0.35", ls=":", lw=1.2, gid="score-0",
                   label=f"0: as bad as the worst of {baseline}'s samples"),
        ax.axvline(1.0, color="0.6", ls="-.", lw=0.9, gid="compute-1", label=f"relative compute 1: {baseline}'s cost"),
    ]
    dodge = _dodges(ax, [(p["relative_compute"], p["improvement_score"], p["improvement_score"]) for p in points])
    obstacles = []
    for i, (p, dx) in enumerate(zip(points, dodge)):
        star = p["label"] == baseline
        size = 13 if star else 8
        below = " (below the baseline's reward)" if p.get("below_baseline") else ""
        line = ax.plot([p["relative_compute"]], [p["improvement_score"]], ls="none", marker="*" if star else "o",
                       markersize=size, color=f"C{i % 10}", zorder=3, gid=f"run:{p['label']}",
                       transform=ax.transData + ScaledTranslation(dx / 72, 0, fig.dpi_scale_trans),
                       label=f"{p['label']} ({p['method']}){' - baseline' if star else below}")[0]
        handles.append(line)
        obstacles.append(_marker_box(ax, p["relative_compute"], p["improvement_score"], size, dx))
    order = sorted(range(len(points)), key=lambda i: points[i]["relative_compute"])
    place_labels(ax, [(points[i]["relative_compute"], points[i]["improvement_score"], points[i]["label"],
                       f"label:{points[i]['label']}") for i in order], obstacles)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    what = "FLOPs" if basis == "compute" else "device-seconds"
    ax.set_xlabel(f"relative compute ({what} per prompt / {baseline}'s; paper 001 eq. 7)")
    ax.set_ylabel("improvement score (paper 001 eq. 8)")
    ax.set_title(f"Improvement score against relative compute, baseline {baseline}", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax, handles)
    return fig


def improvement_vs_relative_compute(*args, **kwargs) -> bytes:
    """PNG of improvement_vs_relative_compute_figure."""
    return _png(improvement_vs_relative_compute_figure(*args, **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# (c) Distribution of best rewards, (d) partial against final reward, (e) correlation histograms


def best_reward_distribution_figure(series: list[tuple[str, list[float]]], reward_units: str = "reward") -> Figure:
    """Box plot of the per-prompt best rewards of each run (label, rewards), all scored by one reward whose units
    label the y axis."""
    fig = _new_figure(max(6.5, 1.4 * len(series) + 3.5), 4.5)
    ax = fig.add_subplot()
    parts = ax.boxplot([s for _, s in series], showmeans=True)
    ax.set_xticks(range(1, len(series) + 1), [label for label, _ in series], rotation=20, ha="right", fontsize=9)
    ax.set_ylabel(f"best reward of a prompt ({reward_units})")
    ax.set_title("Best reward per prompt, by run", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    handles = [Patch(facecolor="none", edgecolor="black", label="box: 25th to 75th percentile"),
               Line2D([], [], color=parts["medians"][0].get_color(), label="line: median"),
               Line2D([], [], ls="none", marker=parts["means"][0].get_marker(),
                      color=parts["means"][0].get_markerfacecolor(), label="triangle: mean"),
               Line2D([], [], color="black", label="whiskers: furthest prompt within 1.5 x the box")]
    if any(len(f.get_xdata()) for f in parts["fliers"]):
        handles.append(Line2D([], [], ls="none", marker="o", markerfacecolor="none", markeredgecolor="black",
                              label="circle: a prompt beyond the whiskers"))
    _legend_outside(ax, handles)
    return fig


def best_reward_distribution(series: list[tuple[str, list[float]]], reward_units: str = "reward") -> bytes:
    """PNG of best_reward_distribution_figure."""
    return _png(best_reward_distribution_figure(series, reward_units))


def partial_vs_final_figure(points: dict[int, tuple[list[float], list[float]]], title: str) -> Figure:
    """Partial reward at each decision against final reward, for the candidates of one prompt.

    points: decision index -> (partial rewards, final rewards). The candidate(s) with the highest final reward
    are ringed in red, as in paper 001's figure 2.
    """
    fig = _new_figure(8.5, 5)
    ax = fig.add_subplot()
    fig.subplots_adjust(right=0.72)
    top = max(y for _, ys in points.values() for y in ys)
    ringed = False
    for d, (xs, ys) in sorted(points.items()):
        ax.scatter(xs, ys, s=22, alpha=0.75, color=f"C{d % 10}", label=f"decision {d}", gid=f"decision:{d}")
        best = [(x, y) for x, y in zip(xs, ys) if y == top]
        ax.scatter([x for x, _ in best], [y for _, y in best], s=90, facecolors="none", edgecolors="red",
                   label="_nolegend_" if ringed else "highest final reward of the prompt")
        ringed = True
    ax.set_xlabel("partial reward at the decision token")
    ax.set_ylabel("final reward")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax, ax.get_legend_handles_labels()[0])  # beside the axes: no point hides behind it
    return fig


def partial_vs_final(points: dict[int, tuple[list[float], list[float]]], title: str) -> bytes:
    """PNG of partial_vs_final_figure."""
    return _png(partial_vs_final_figure(points, title))


def correlation_histograms_figure(pearson: list[float], kendall: list[float], title: str) -> Figure:
    """Histograms over prompts of Pearson's r and Kendall's tau (paper 001, figure 4)."""
    fig = _new_figure(9, 4.2)
    for i, (name, values) in enumerate((("Pearson r", pearson), ("Kendall tau", kendall))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.hist(values, bins=20, range=(-1, 1), color=f"C{i}", alpha=0.85, label=f"prompts by {name}")
        ax.set_xlabel(name)
        ax.set_ylabel("prompts")
        ax.grid(True, alpha=0.3)
        # below the axes, where no bar can be
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(bottom=0.25)
    return fig


def correlation_histograms(pearson: list[float], kendall: list[float], title: str) -> bytes:
    """PNG of correlation_histograms_figure."""
    return _png(correlation_histograms_figure(pearson, kendall, title))


# ---------------------------------------------------------------------------------------------------------------
# (f) Rounds of Expert Iteration: held-out reward and cumulative cost by round


def rounds_figure(series: list[dict]) -> Figure:
    """Two panels over the round (x): above, each series' held-out reward with its bootstrap interval (one color
    per chain, one line style per evaluation); below, each chain's cumulative USD, data and training together
    (solid) and data alone (dashed). series: dicts of `reporting.rounds.plot_series`."""
    fig = _new_figure(10.5, 6.4)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    fig.subplots_adjust(left=0.09, right=0.64, bottom=0.09, top=0.93, hspace=0.08)
    chains = list(dict.fromkeys(s["chain"] for s in series))
    evaluations = list(dict.fromkeys(s["evaluation"] for s in series))
    colors = {c: f"C{i % 10}" for i, c in enumerate(chains)}
    styles = {e: ("-", "--", ":", "-.")[i % 4] for i, e in enumerate(evaluations)}
    markers = {e: ("o", "s", "^", "D")[i % 4] for i, e in enumerate(evaluations)}
    handles = []
    for n, s in enumerate(series):
        shift = 0.05 * (n - (len(series) - 1) / 2)  # side by side, so every interval stays visible
        xs = [r + shift for r in s["rounds"]]
        err = [[m - lo for m, lo in zip(s["reward"], s["low"])], [hi - m for m, hi in zip(s["reward"], s["high"])]]
        h = top.errorbar(xs, s["reward"], yerr=err, color=colors[s["chain"]], ls=styles[s["evaluation"]],
                         marker=markers[s["evaluation"]], ms=5, capsize=3, lw=1.3, gid=f"series:{s['label']}",
                         label=s["label"])
        handles.append(h)
    top.set_ylabel(f"held-out reward ({series[0]['reward_units']})" if series else "held-out reward")
    top.grid(True, alpha=0.3)
    top.set_title("Held-out reward by round (95% bootstrap intervals) and what the rounds cost", fontsize=10)
    seen = set()
    for s in series:
        if s["chain"] in seen:
            continue
        seen.add(s["chain"])
        c = colors[s["chain"]]
        handles.append(bottom.plot(s["rounds"], s["cumulative_usd"], color=c, marker="o", ms=4, lw=1.3,
                                   gid=f"cost:{s['chain']}", label=f"{s['chain']}: cumulative USD, data + training")[0])
        handles.append(bottom.plot(s["rounds"], s["cumulative_data_usd"], color=c, ls="--", marker=".", lw=1.0,
                                   gid=f"data-cost:{s['chain']}", label=f"{s['chain']}: cumulative USD of data")[0])
    bottom.set_ylabel("cumulative USD")
    bottom.yaxis.set_major_formatter(FuncFormatter(_usd_tick))
    bottom.set_xlabel("round (0: the starting model)")
    bottom.grid(True, alpha=0.3)
    rounds = sorted({r for s in series for r in s["rounds"]})
    bottom.set_xticks(rounds)
    _legend_outside(top, handles)
    return fig


def rounds(series: list[dict]) -> bytes:
    """PNG of rounds_figure."""
    return _png(rounds_figure(series))
