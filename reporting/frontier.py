"""The cost-reward frontier of runs: which runs are worth their cost, and what the next step of reward costs.

Terms (the report's "Definitions" section repeats them). **Cost** is on the report's basis (`reporting.cost`):
compute (FLOPs per prompt, the default) or measured USD per prompt. Every comparison below is beyond the report's
tolerance (`reporting.tolerance`): numbers that differ by float noise are the same.

- Runs are placed on the **frontier's prompts**: the prompt_ids that every placed run completed (no error, a best
  reward). A run is **placed** when it has at least one such row; the others are listed as not placed. Over those
  prompts each run has a **cost per prompt** (mean) and a **mean best reward**, with a bootstrap interval
  (`reporting.stats.bootstrap_intervals`: paired, the same prompt draws for every run).
- Run A **dominates** run B when A costs no more per prompt and has at least B's mean best reward, and is strictly
  better on one of the two. The **frontier** is the placed runs no run dominates, cheapest first.
- The **marginal cost per unit of reward** of a frontier point is (its cost per prompt - the previous point's) /
  (its mean best reward - the previous point's): what each extra unit of reward costs on that step.
- Two runs are **within each other's intervals** when each one's mean best reward lies inside the other's
  bootstrap interval (ends included): these prompts do not tell their rewards apart.
- A run is **below the baseline** when its mean best reward is lower than the baseline's, on the same prompts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from reporting.cost import COMPUTE, RunCost
from reporting.stats import (BOOTSTRAP_LEVEL, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_intervals,
                             finished_rewards, ok_rows)
from reporting.tolerance import at_least, at_most, greater, less, same
from runfolder.runs import Run


@dataclass(frozen=True)
class Point:
    """One placed run: mean cost per prompt (on the report's basis), mean best reward and its interval."""

    label: str
    cost: float
    reward: float
    low: float
    high: float


def dominates(a: Point, b: Point) -> bool:
    """a costs no more than b and has no less reward, and is strictly better on one of the two (beyond the
    tolerance)."""
    return (at_most(a.cost, b.cost) and at_least(a.reward, b.reward)
            and (less(a.cost, b.cost) or greater(a.reward, b.reward)))


def within_intervals(a: Point, b: Point) -> bool:
    """Each run's mean best reward lies inside the other's interval (ends included, within the tolerance)."""
    return (at_most(a.low, b.reward) and at_most(b.reward, a.high)
            and at_most(b.low, a.reward) and at_most(a.reward, b.high))


def frontier(points: list[Point]) -> dict[str, dict]:
    """label -> on_frontier, position (1-based, cheapest first), previous frontier point and the step from it
    (cost_step, reward_step, marginal_cost_per_reward, step_within_intervals), dominated_by (cheapest first),
    dominated_by_within_intervals, within_intervals_of."""
    by_cost = sorted(points, key=lambda p: (p.cost, -p.reward, p.label))
    out = {}
    for p in points:
        others = [q for q in by_cost if q.label != p.label]
        doms = [q for q in others if dominates(q, p)]
        out[p.label] = {
            "on_frontier": not doms, "position": None, "previous": None, "cost_step": None, "reward_step": None,
            "marginal_cost_per_reward": None, "step_within_intervals": None,
            "dominated_by": [q.label for q in doms],
            "dominated_by_within_intervals": [q.label for q in doms if within_intervals(p, q)],
            "within_intervals_of": [q.label for q in others if within_intervals(p, q)],
        }
    front = [p for p in by_cost if out[p.label]["on_frontier"]]
    for i, p in enumerate(front):
        d = out[p.label]
        d["position"] = i + 1
        if i == 0:
            continue
        prev = front[i - 1]
        du, dr = p.cost - prev.cost, p.reward - prev.reward
        # consecutive frontier points gain reward unless two runs sit on the same point (within the tolerance)
        d.update(previous=prev.label, cost_step=du, reward_step=dr,
                 marginal_cost_per_reward=du / dr if greater(p.reward, prev.reward) else None,
                 step_within_intervals=within_intervals(p, prev))
    return out


def prompt_table(runs: list[Run]) -> tuple[list[str], list[int]]:
    """(the frontier's prompt_ids, sorted; indices of the placed runs): the prompts every run with at least one
    completed prompt (no error, a best reward) completed."""
    done = [{pid for pid, r in ok_rows(run).items() if r["best_reward"] is not None} for run in runs]
    placed = [i for i, d in enumerate(done) if d]
    common = set.intersection(*(done[i] for i in placed)) if placed else set()
    return sorted(common), placed


def build_frontier(runs: list[Run], labels: list[str], base_index: int, costs: list[RunCost],
                   basis: str) -> tuple[dict, list[dict]]:
    """(the report's "frontier" block, one per-run dict per run in order); every number on the frontier's prompts,
    costs on `basis` (every run must have a cost on it: `reporting.cost`), measured USD and FLOPs beside."""
    pids, placed = prompt_table(runs)
    block = {
        "basis": basis, "prompts": len(pids), "order": [], "dominated": {}, "not_placed": {},
        "baseline_mean_best_reward": None, "baseline_single_sample_reward": None,
        "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "level": BOOTSTRAP_LEVEL, "seed": BOOTSTRAP_SEED,
                      "method": "percentile interval of the mean over prompts resampled with replacement; "
                                "every run resampled with the same prompt draws"},
    }
    per_run: list[dict] = [{"placed": False} for _ in runs]
    for i, label in enumerate(labels):
        if i not in placed:
            block["not_placed"][label] = "no prompt completed without an error and with a best reward"
    if not pids:
        for i in placed:
            block["not_placed"][labels[i]] = "no prompt was completed by every run with data"
        return block, per_run
    rows = [[ok_rows(runs[i])[pid] for pid in pids] for i in placed]
    reward = np.array([[r["best_reward"] for r in rs] for rs in rows], dtype=float)  # [R, P]
    intervals = bootstrap_intervals(reward)  # [R, 2]
    points = []
    for k, i in enumerate(placed):
        c = costs[i]
        flops = None if c.problem is not None else statistics.fmean(c.flops(r) for r in rows[k])
        usd = statistics.fmean(c.usd(r) for r in rows[k])
        points.append(Point(labels[i], flops if basis == COMPUTE else usd, float(reward[k].mean()),
                            float(intervals[k, 0]), float(intervals[k, 1])))
        per_run[i] = {"placed": True, "cost_per_prompt": points[-1].cost, "flops_per_prompt": flops,
                      "usd_per_prompt": usd,
                      "device_seconds_per_prompt": statistics.fmean(r["cost"]["device_seconds"] for r in rows[k]),
                      "usd_per_device_hour": c.usd_per_device_hour,
                      "mean_best_reward": points[-1].reward, "interval": [points[-1].low, points[-1].high]}
    verdicts = frontier(points)
    base = next((p for p, i in zip(points, placed) if i == base_index), None)
    if base is not None:
        block["baseline_mean_best_reward"] = base.reward
        z = [finished_rewards(ok_rows(runs[base_index])[pid]) for pid in pids]
        block["baseline_single_sample_reward"] = (statistics.fmean(statistics.fmean(x) for x in z if x)
                                                  if any(z) else None)
    for p, i in zip(points, placed):
        d = per_run[i]
        d.update(verdicts[p.label])
        d["is_baseline"] = i == base_index
        d["below_baseline"] = None if base is None else less(p.reward, base.reward)
        d["below_baseline_within_intervals"] = (None if base is None or not d["below_baseline"]
                                                else within_intervals(p, base))
    block["order"] = [p.label for p in sorted(points, key=lambda p: verdicts[p.label]["position"] or 0)
                      if verdicts[p.label]["on_frontier"]]
    block["dominated"] = {p.label: verdicts[p.label]["dominated_by"]  # cheapest first, like the frontier
                          for p in sorted(points, key=lambda p: (p.cost, -p.reward, p.label))
                          if not verdicts[p.label]["on_frontier"]}
    by_label = {p.label: p for p in points}
    for p, i in zip(points, placed):
        per_run[i]["verdict"] = verdict(p, per_run[i], by_label, base, basis)
    return block, per_run


_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def fmt_flops(x: float) -> str:
    """FLOPs with an SI prefix and 3 significant digits: ``4.26 GFLOP``."""
    for scale, prefix in _PREFIXES:
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"


def fmt_cost(x: float | None, basis: str) -> str:
    """A cost on `basis`: FLOPs with an SI prefix, or dollars with 3 significant digits; n/a for None."""
    if x is None:
        return "n/a"
    return fmt_flops(x) if basis == COMPUTE else f"${x:.3g}"


def fmt_pair(a: float, b: float) -> tuple[str, str]:
    """a and b with 3 significant digits, or as many more (up to 12) as it takes for two different numbers to read
    differently (a stated "1.6801 < 1.68" must not print as "1.68 < 1.68")."""
    for digits in range(3, 13):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y or same(a, b):
            return x, y
    return x, y


def _r(x: float) -> str:
    return f"{x:.3g}"


def _dominator(p: Point, q: Point, ties: list[str], basis: str) -> str:
    less_cost = "less compute" if basis == COMPUTE else "cheaper"
    cost = "the same cost" if same(q.cost, p.cost) else f"{100 * (p.cost - q.cost) / p.cost:.3g}% {less_cost}"
    reward = "the same reward" if same(q.reward, p.reward) else f"+{_r(q.reward - p.reward)} reward"
    tie = ", rewards within each other's intervals" if q.label in ties else ""
    return f"{q.label} ({cost}, {reward}{tie})"


def _names(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def verdict(p: Point, d: dict, points: dict[str, Point], base: Point | None, basis: str) -> str:
    """One sentence on a placed run: its frontier step or what dominates it, and whether it is below the baseline.
    Only numbers of the basis and the rewards: on the compute basis the same runs give the same sentence."""
    if d["on_frontier"]:
        if d["previous"] is None:
            text = "on the frontier: the cheapest run" if len(points) > 1 else "on the frontier: the only run"
        elif d["marginal_cost_per_reward"] is None:
            text = f"on the frontier: the same point as {d['previous']}"
        else:
            text = (f"on the frontier: +{_r(d['reward_step'])} reward over {d['previous']} for "
                    f"+{fmt_cost(d['cost_step'], basis)} per prompt, "
                    f"{fmt_cost(d['marginal_cost_per_reward'], basis)} per unit of reward")
            if d["step_within_intervals"]:
                text += " (within each other's intervals: these prompts do not resolve the step)"
    else:
        first, *more = d["dominated_by"]  # the cheapest run that dominates it in full, the others by name
        text = "dominated by " + _dominator(p, points[first], d["dominated_by_within_intervals"], basis)
        if more:
            text += ", and also by " + _names(more)
    if d["below_baseline"]:
        tie = ", within each other's intervals" if d["below_baseline_within_intervals"] else ""
        mine, theirs = fmt_pair(p.reward, base.reward)
        text += f"; below the baseline's mean best reward ({mine} < {theirs}{tie})"
    return text
