"""The report's PNG plots, drawn with matplotlib's object API (Agg canvas, no pyplot state, no display needed).

Each function takes plain numbers and returns PNG bytes, so the report can write them to any filesystem.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 110


def stacked(points: list[dict], i: int) -> int:
    """How many earlier points lie within 3% of the axes' spans of point i (its label's row above the point)."""
    xs, ys = [p["usd_mean"] for p in points], [p["reward_mean"] for p in points]
    dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    return sum(abs(xs[j] - xs[i]) < 0.03 * dx and abs(ys[j] - ys[i]) < 0.03 * dy for j in range(i))


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def reward_vs_compute(points: list[dict], baseline: str) -> bytes:
    """(a) One point per run: mean best reward against mean USD per prompt, error bars = std across prompts.

    points: dicts with label, method, usd_mean, usd_std, reward_mean, reward_std.
    """
    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot()
    for i, p in enumerate(points):
        marker = "*" if p["label"] == baseline else "o"
        ax.errorbar(p["usd_mean"], p["reward_mean"], xerr=p["usd_std"], yerr=p["reward_std"], fmt=marker,
                    markersize=12 if marker == "*" else 8, capsize=4, color=f"C{i % 10}",
                    label=f"{p['label']} ({p['method']})" + (" - baseline" if p["label"] == baseline else ""))
        # labels of runs that land on nearly the same point are stacked rather than drawn over each other
        ax.annotate(p["label"], (p["usd_mean"], p["reward_mean"]), textcoords="offset points",
                    xytext=(6, 6 + 12 * stacked(points, i)), fontsize=9)
    usds = [p["usd_mean"] for p in points if p["usd_mean"] > 0]
    if usds and max(usds) / min(usds) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("USD per prompt (mean; bars: std across prompts)")
    ax.set_ylabel("best reward (mean; bars: std across prompts)")
    ax.set_title("Reward against compute, one point per run")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def best_reward_distribution(series: list[tuple[str, list[float]]]) -> bytes:
    """(b) Box plot of the per-prompt best rewards of each run (label, rewards)."""
    fig = Figure(figsize=(max(5.0, 1.4 * len(series) + 2), 4.5))
    ax = fig.add_subplot()
    ax.boxplot([s for _, s in series], showmeans=True)
    ax.set_xticks(range(1, len(series) + 1), [label for label, _ in series], rotation=20, ha="right", fontsize=9)
    ax.set_ylabel("best reward per prompt")
    ax.set_title("Distribution of best rewards per run (triangle: mean)")
    ax.grid(True, axis="y", alpha=0.3)
    return _png(fig)


def partial_vs_final(points: dict[int, tuple[list[float], list[float]]], title: str) -> bytes:
    """(c) Partial reward at each decision against final reward, for the candidates of one prompt.

    points: decision index -> (partial rewards, final rewards). The candidate(s) with the highest final reward
    are ringed in red, as in paper 001's figure 2.
    """
    fig = Figure(figsize=(6.5, 5))
    ax = fig.add_subplot()
    top = max(y for _, ys in points.values() for y in ys)
    for d, (xs, ys) in sorted(points.items()):
        ax.scatter(xs, ys, s=22, alpha=0.75, color=f"C{d % 10}", label=f"decision {d}")
        best = [(x, y) for x, y in zip(xs, ys) if y == top]
        ax.scatter([x for x, _ in best], [y for _, y in best], s=90, facecolors="none", edgecolors="red")
    ax.set_xlabel("partial reward at the decision token")
    ax.set_ylabel("final reward")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def correlation_histograms(pearson: list[float], kendall: list[float], title: str) -> bytes:
    """Histograms over prompts of Pearson's r and Kendall's tau (paper 001, figure 4)."""
    fig = Figure(figsize=(9, 3.8))
    for i, (name, values) in enumerate((("Pearson r", pearson), ("Kendall tau", kendall))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.hist(values, bins=20, range=(-1, 1), color=f"C{i}", alpha=0.85)
        ax.set_xlabel(name)
        ax.set_ylabel("prompts")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _png(fig)
