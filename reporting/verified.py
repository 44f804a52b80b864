"""The verified answers of runs that have a verifier (`runfolder.runs.verifier_kind`): how many prompts verified,
pass@1 and pass@k, and what a pass costs.

Terms (the report's "Definitions" section repeats them):

- A prompt **ran** when its row has no error. It **verified** when its answer verified: the row's
  `stats.best_verified` is true. A row that ran without a verdict (`best_verified` null) counts as not verified,
  and is counted apart (`unjudged_prompts`).
- **verified rate**: verified prompts / prompts that ran, with the bootstrap interval of that mean.
- **mean pass@1** and **mean pass@k**: the rows' `stats.pass_at_1` and `stats.pass_at_k` (the unbiased estimator of
  Chen et al. 2021 from each prompt's judged candidates), averaged over the prompts that ran; pass@k at the k's
  every row has. None when a row that ran has none: the method cut candidates before they were judged, and the
  judged ones are then a biased sample.
- **cost of a pass** (Cost-of-Pass, arXiv 2504.13359): the cost of the prompts that ran divided by the verified
  prompts, in measured USD, FLOPs (`reporting.cost`; None where the run has no compute) and device-seconds. It
  equals cost per prompt / verified rate. A run with no verified prompt has an infinite cost of a pass: None, said
  as "no verified prompt".
- its **interval**: the percentile bootstrap interval of that ratio, the summed cost over the summed verified
  prompts of each resample of the prompts, drawn by `reporting.stats.bootstrap_draws` (the draws of the verified
  rate's interval, so the two are paired). A resample without a verified prompt has an infinite ratio; where one
  reaches the upper percentile, the upper end is None (unbounded).
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from reporting.cost import RunCost
from reporting.stats import BOOTSTRAP_LEVEL, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_draws, mean_interval
from reporting.tolerance import positive
from runfolder.runs import Run, verifier_kind

COST_UNITS = ("usd", "flops", "device_seconds")


def _percentile(sorted_values: np.ndarray, q: float) -> float:
    """The q-th percentile (0-100) of sorted values, linear between neighbours as numpy's default, but infinite
    where a neighbour it needs is infinite (numpy's interpolation gives NaN there)."""
    h = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(h), math.ceil(h)
    a, b = float(sorted_values[lo]), float(sorted_values[hi])
    if math.isinf(b):
        return math.inf
    return a + (b - a) * (h - lo)


def ratio_intervals(costs: np.ndarray, passes: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
                    level: float = BOOTSTRAP_LEVEL, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """Percentile bootstrap intervals of sum(cost) / sum(passes) over prompts, one per row of costs [C, P] (one
    row per cost unit), each resample's prompts drawn by `bootstrap_draws` and shared by every row (paired).
    Returns [C, 2] (low, high); a resample with no pass has an infinite ratio, so an end may be infinite."""
    costs = np.asarray(costs, dtype=float)  # [C, P]
    passes = np.asarray(passes, dtype=float)  # [P]
    if costs.ndim != 2 or costs.shape[1] == 0 or passes.shape != (costs.shape[1],):
        raise ValueError(f"ratio_intervals needs costs [units, prompts] and passes [prompts] with prompts >= 1; got "
                         f"{costs.shape} and {passes.shape}")
    ratios = []
    for idx in bootstrap_draws(costs.shape[1], resamples, seed):  # [b, P]
        num = costs[:, idx].sum(axis=2)  # [C, b]
        den = passes[idx].sum(axis=1)  # [b]
        ratios.append(np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf))  # [C, b]
    ratios = np.sort(np.concatenate(ratios, axis=1), axis=1)  # [C, resamples]
    tail = 100.0 * (1.0 - level) / 2.0
    return np.array([[_percentile(r, tail), _percentile(r, 100.0 - tail)] for r in ratios])  # [C, 2]


def _pass_at_k(rows: list[dict]) -> list[dict] | None:
    """Mean pass@k over rows at the k's every row has ([{k, value}], k ascending); None when a row has none."""
    tables = []
    for r in rows:
        got = r["stats"]["pass_at_k"]
        if got is None:
            return None
        tables.append({e["k"]: e["value"] for e in got if e["k"] is not None and e["value"] is not None})
    shared = set.intersection(*(set(t) for t in tables)) if tables else set()
    return [{"k": k, "value": statistics.fmean(t[k] for t in tables)} for k in sorted(shared)]


def verified_summary(run: Run, cost: RunCost, summary: dict) -> dict | None:
    """The verified answers of one run (module docstring), over its prompts that ran ordered by prompt_id; None
    when the run has no verifier. `summary` is its `reporting.stats.run_summary`, for the cost per unit of reward
    shown beside the cost of a pass."""
    kind = verifier_kind(run)
    if kind is None:
        return None
    good = sorted((r for r in run.rows if r["error"] is None), key=lambda r: r["prompt_id"])
    stats = [r["stats"] or {} for r in good]
    verified = [1.0 if s.get("best_verified") is True else 0.0 for s in stats]
    passes = int(sum(verified))
    pass_1 = [s.get("pass_at_1") for s in stats]
    out = {
        "verifier": kind,
        "prompts_ran": len(good),
        "verified_prompts": passes,
        "unjudged_prompts": sum(s.get("best_verified") is None for s in stats),
        "judged_candidates": sum(s.get("judged_candidates") or 0 for s in stats),
        "verified_candidates": sum(s.get("verified_candidates") or 0 for s in stats),
        "verified_rate": statistics.fmean(verified) if good else None,
        "verified_rate_interval": mean_interval(verified),
        "pass_at_1": statistics.fmean(pass_1) if good and None not in pass_1 else None,
        "prompts_without_pass_at_1": sum(p is None for p in pass_1),
        "pass_at_k": _pass_at_k(good) if good else None,
    }
    per_prompt = {
        "usd": [cost.usd(r) for r in good],
        "flops": None if cost.problem is not None else [cost.flops(r) for r in good],
        "device_seconds": [r["cost"]["device_seconds"] for r in good],
    }
    units = [u for u in COST_UNITS if per_prompt[u] is not None]
    price = {"no_verified_prompt": passes == 0}
    intervals = ratio_intervals(np.array([per_prompt[u] for u in units]), np.array(verified)) if passes else None
    for u in COST_UNITS:
        known = u in units and passes > 0
        price[u] = sum(per_prompt[u]) / passes if known else None
        if known:
            low, high = (float(v) for v in intervals[units.index(u)])
            price[f"{u}_interval"] = [low, None if math.isinf(high) else high]
        else:
            price[f"{u}_interval"] = None
    out["cost_of_a_pass"] = price
    m = summary["mean_best_reward"]
    reward = m is not None and positive(m)
    out["cost_per_unit_reward"] = {
        "usd": summary["usd_per_reward"],
        "flops": summary["flops_per_prompt"] / m if (reward and summary["flops_per_prompt"] is not None) else None,
    }
    return out
