"""Cost-per-reward metrics of runs, and Speculative Rejection's (paper 001) metrics against a baseline run.

Terms (paper 001, section 5 "Performance Metrics"; Z_1..Z_N are the baseline's *finished* candidates of a prompt,
i.e. finish_reason ``eos`` or ``length`` with a final reward, and Y is the compared run's best response):

- **improvement score** (equation 8), per prompt:
  ``100 * (1 - (max_k s(Z_k) - s(Y)) / (max_k s(Z_k) - min_k s(Z_k)))``, averaged over prompts. It is 100 when Y
  is as good as the baseline's best, 0 when as bad as its worst; it is not clipped. A prompt whose baseline rewards
  are all equal (max = min, e.g. a one-candidate baseline) has no defined score: it is left out and counted.
- **relative compute** (equation 7): ``T / T_baseline`` with T the device-seconds of a prompt (the paper's
  "T x #GPUs"). The headline value is the ratio of the summed device-seconds over the prompts both runs completed
  (what the bill scales with; robust to per-prompt noise in batched timing); the paper's literal per-prompt ratio,
  averaged over prompts, is reported beside it as ``relative_compute_mean_of_ratios``. **relative FLOPs** is the
  same ratio of summed compute (`reporting.cost`), which does not move with machine load.
- **baseline single-sample reward** of a prompt: the mean of s(Z_k), the expected reward of one baseline sample
  with no selection. **reward gain** of a prompt: s(Y) minus that. **reward gained per USD** (per TFLOP): mean
  reward gain over matched prompts divided by the mean USD (TFLOPs, 10^12 FLOPs) per prompt over the same prompts.
  **USD (FLOPs) per unit reward gained** is its inverse. Both are defined only where the mean gain is positive
  beyond the tolerance (`reporting.tolerance`): a run that gains nothing, or loses reward, is not ranked by a ratio
  that would put the cheapest loss first.
- **USD** of a prompt: ``device_seconds / 3600 * cost.usd_per_device_hour`` of that run's manifest; **compute**
  (FLOPs): `reporting.cost`.
- **bootstrap interval** of a mean over prompts: the percentile interval (2.5th and 97.5th percentiles) of the
  mean over ``BOOTSTRAP_RESAMPLES`` resamples of the prompts with replacement, drawn by numpy's ``default_rng``
  with the fixed ``BOOTSTRAP_SEED`` (the same report from the same runs). Runs compared on the same prompts are
  resampled with the same prompt draws (a paired bootstrap).
- **partial/final reward correlation** (paper 001, appendix B): for one prompt and one decision index d, Pearson's
  r and Kendall's tau (scipy's tau-b, equal to the paper's definition when there are no ties) between the
  candidates' partial reward at decision d and their final reward, over candidates that have both. Candidates
  rejected by Speculative Rejection have no final reward, so they are not in it (the survivors are a truncated
  sample, which lowers the correlation the paper measured on every candidate).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats as sstats

from reporting.cost import RunCost, usd
from reporting.tolerance import positive
from runfolder.runs import Run

FINISHED = ("eos", "length")
MIN_CORRELATION_POINTS = 3
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_LEVEL = 0.95
BOOTSTRAP_SEED = 0
_BOOTSTRAP_CHUNK = 250  # resamples drawn at once, so memory stays ~ runs x chunk x prompts


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _spread(xs: list[float]) -> dict:
    """mean, std (population), median and quartiles of xs; None for each when xs is empty."""
    if not xs:
        return {"mean": None, "std": None, "median": None, "q25": None, "q75": None, "n": 0}
    a = np.asarray(xs, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std()), "median": float(np.median(a)),
            "q25": float(np.percentile(a, 25)), "q75": float(np.percentile(a, 75)), "n": int(a.size)}


def bootstrap_draws(prompts: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED):
    """The bootstrap's prompt draws: chunks of [b, prompts] indices, ``resamples`` rows in all, drawn with
    replacement from ``default_rng(seed)``. Every figure resampled over the same number of prompts gets the same
    draws (paired)."""
    rng = np.random.default_rng(seed)
    for start in range(0, resamples, _BOOTSTRAP_CHUNK):
        yield rng.integers(0, prompts, size=(min(_BOOTSTRAP_CHUNK, resamples - start), prompts))  # [b, P]


def bootstrap_intervals(values: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, level: float = BOOTSTRAP_LEVEL,
                        seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """Percentile bootstrap intervals of the mean over prompts, one per row of values [R, P] (runs x prompts).

    Every row is resampled with the same prompt indices (paired), drawn from ``default_rng(seed)``, so the result
    depends only on the values and the arguments. Returns [R, 2] (low, high); P = 1 gives the value itself.
    """
    values = np.asarray(values, dtype=float)  # [R, P]
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(f"bootstrap_intervals needs a [runs, prompts] array with prompts >= 1; got {values.shape}")
    means = [values[:, idx].mean(axis=2) for idx in bootstrap_draws(values.shape[1], resamples, seed)]  # [R, b]
    tail = 100.0 * (1.0 - level) / 2.0
    return np.percentile(np.concatenate(means, axis=1), [tail, 100.0 - tail], axis=1).T  # [R, 2]


def mean_interval(xs: list[float]) -> list[float] | None:
    """[low, high] bootstrap interval of the mean of xs (see bootstrap_intervals); None when xs is empty."""
    if not xs:
        return None
    return [float(v) for v in bootstrap_intervals(np.asarray([xs], dtype=float))[0]]


def ok_rows(run: Run) -> dict[str, dict]:
    """prompt_id -> row, for the rows without an error."""
    return {r["prompt_id"]: r for r in run.rows if r["error"] is None}


def finished_rewards(row: dict) -> list[float]:
    """Final rewards s(Z_k) of a row's finished candidates (eos or length, reward not null)."""
    return [c["reward"] for c in row["candidates"] or [] if c["finish_reason"] in FINISHED and c["reward"] is not None]


def run_summary(run: Run, cost: RunCost) -> dict:
    """Per-run numbers: prompts, errors, best reward spread, tokens, FLOPs, device-seconds and USD per prompt.

    Per-prompt means are over the prompts without an error; totals (device-seconds, USD) include errored rows.
    ``usd_per_reward`` (USD per prompt / mean best reward) is only defined when the mean best reward is positive.
    ``flops_per_prompt`` is None when the run has no compute (``cost.problem`` says why).
    ``mean_best_reward_interval`` is its bootstrap interval over the run's prompts (ordered by prompt_id).
    """
    good = [r for _, r in sorted(ok_rows(run).items())]
    price = run.usd_per_device_hour
    best = [r["best_reward"] for r in good if r["best_reward"] is not None]
    seconds = [r["cost"]["device_seconds"] for r in good]
    out = {
        "prompts": len(run.rows),
        "errors": len(run.rows) - len(good),
        "superseded_error_rows": run.superseded_errors,
        "best_reward": _spread(best),
        "mean_best_reward": _mean(best),
        "mean_best_reward_interval": mean_interval(best),
        "generated_tokens_per_prompt": _mean([sum(c["num_tokens"] or 0 for c in r["candidates"]) for r in good]),
        "target_tokens_per_prompt": _mean([r["cost"]["target_tokens"] for r in good]),
        "draft_tokens_per_prompt": _mean([r["cost"]["draft_tokens"] for r in good]),
        "reward_tokens_per_prompt": _mean([r["cost"]["reward_tokens"] for r in good]),
        "parameters": cost.parameters,
        "parameters_source": cost.source,
        "parameters_not_counted": cost.not_counted,
        "compute_problem": cost.problem,
        "flops_per_prompt": None if cost.problem is not None else _mean([cost.flops(r) for r in good]),
        "device_seconds_per_prompt": _mean(seconds),
        "device_seconds": _spread(seconds),
        "usd_per_device_hour": price,
        "usd_per_prompt": None if not seconds else usd(statistics.fmean(seconds), price),
        "usd_prompt_spread": _spread([usd(s, price) for s in seconds]),
        "device_seconds_total": sum(r["cost"]["device_seconds"] for r in run.rows),
    }
    out["usd_total"] = usd(out["device_seconds_total"], price)
    m = out["mean_best_reward"]
    price = out["usd_per_prompt"]
    out["usd_per_reward"] = price / m if (m is not None and positive(m) and price is not None) else None
    return out


def improvement_score(y: float, z: list[float]) -> float | None:
    """Equation 8 of paper 001 for one prompt: 100 * (1 - (max Z - y) / (max Z - min Z)); None if max Z == min Z."""
    hi, lo = max(z), min(z)
    if hi == lo:
        return None
    return 100.0 * (1.0 - (hi - y) / (hi - lo))


@dataclass
class Matched:
    """One prompt both runs completed: the run's best reward Y, the baseline's finished rewards Z, device-seconds
    and FLOPs (None without compute) of each."""

    prompt_id: str
    y: float
    z: list[float]
    t: float
    t_base: float
    f: float | None
    f_base: float | None


def match(run: Run, base: Run, cost: RunCost, base_cost: RunCost) -> list[Matched]:
    """Prompts (by prompt_id) without error in both runs, where the run has a best reward."""
    mine, theirs = ok_rows(run), ok_rows(base)
    out = []
    for pid in sorted(set(mine) & set(theirs)):
        r, b = mine[pid], theirs[pid]
        if r["best_reward"] is None:
            continue
        out.append(Matched(pid, r["best_reward"], finished_rewards(b), r["cost"]["device_seconds"],
                           b["cost"]["device_seconds"], cost.flops(r), base_cost.flops(b)))
    return out


def _per_cost(gain: float | None, cost: float | None) -> tuple[float | None, float | None]:
    """(reward gained per unit of cost, cost per unit of reward gained), both only for a positive gain."""
    if gain is None or cost is None or not positive(gain):
        return None, None
    return (gain / cost if cost > 0 else None), cost / gain


def compare(run: Run, base: Run, cost: RunCost, base_cost: RunCost) -> dict:
    """Improvement score, relative compute and FLOPs, and reward gained per USD and per TFLOP of `run` against
    `base` (module docstring)."""
    pairs = match(run, base, cost, base_cost)
    with_z = [m for m in pairs if m.z]
    scores = [improvement_score(m.y, m.z) for m in with_z]
    defined = [s for s in scores if s is not None]
    sum_t, sum_base = sum(m.t for m in pairs), sum(m.t_base for m in pairs)
    ratios = [m.t / m.t_base for m in pairs if m.t_base > 0]
    gains = [m.y - statistics.fmean(m.z) for m in with_z]
    usd_matched = usd(statistics.fmean([m.t for m in with_z]), run.usd_per_device_hour) if with_z else None
    flops = cost.problem is None and base_cost.problem is None
    flops_matched = statistics.fmean([m.f for m in with_z]) if (with_z and cost.problem is None) else None
    sum_f, sum_f_base = (sum(m.f for m in pairs), sum(m.f_base for m in pairs)) if flops else (None, None)
    mean_gain = _mean(gains)
    per_usd, usd_per_gain = _per_cost(mean_gain, usd_matched)
    per_flop, flops_per_gain = _per_cost(mean_gain, flops_matched)
    return {
        "matched_prompts": len(pairs),
        "prompts_with_baseline_rewards": len(with_z),
        "improvement_score": _mean(defined),
        "improvement_score_prompts": len(defined),
        "improvement_score_excluded_equal_rewards": len(scores) - len(defined),
        "relative_compute": sum_t / sum_base if sum_base > 0 else None,
        "relative_compute_mean_of_ratios": _mean(ratios),
        "relative_flops": sum_f / sum_f_base if sum_f_base else None,
        "baseline_single_sample_reward": _mean([statistics.fmean(m.z) for m in with_z]),
        "mean_best_reward_matched": _mean([m.y for m in with_z]),
        "mean_reward_gain": mean_gain,
        "gains_reward": None if mean_gain is None else positive(mean_gain),
        "usd_per_prompt_matched": usd_matched,
        "reward_gain_per_usd": per_usd,
        "usd_per_reward_gain": usd_per_gain,
        "flops_per_prompt_matched": flops_matched,
        "reward_gain_per_tflop": None if per_flop is None else per_flop * 1e12,
        "flops_per_reward_gain": flops_per_gain,
    }


# ---------------------------------------------------------------------------------------------------------------
# Partial against final rewards (paper 001, appendix B)


def correlation_points(row: dict) -> dict[int, tuple[list[float], list[float]]]:
    """decision index -> (partial rewards at that decision, final rewards), over candidates with both."""
    points: dict[int, tuple[list[float], list[float]]] = {}
    for c in row["candidates"] or []:
        if c["reward"] is None:
            continue
        for d, p in enumerate(c["partial_rewards"] or []):
            if p is None:
                continue
            xs, ys = points.setdefault(d, ([], []))
            xs.append(p)
            ys.append(c["reward"])
    return points


def correlate(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(Pearson r, Kendall tau-b) of xs and ys; None with fewer than 3 points or a constant side."""
    if len(xs) < MIN_CORRELATION_POINTS or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    r = float(sstats.pearsonr(xs, ys).statistic)
    tau = float(sstats.kendalltau(xs, ys).statistic)
    return r, tau


def correlations(run: Run) -> dict:
    """Per (prompt, decision index) correlations of one run, and their summary per decision index."""
    records, skipped = [], 0
    for pid, row in sorted(ok_rows(run).items()):
        for d, (xs, ys) in sorted(correlation_points(row).items()):
            got = correlate(xs, ys)
            if got is None:
                skipped += 1
                continue
            records.append({"prompt_id": pid, "decision": d, "n": len(xs), "pearson": got[0], "kendall": got[1]})
    by_decision = []
    for d in sorted({r["decision"] for r in records}):
        rs = [r for r in records if r["decision"] == d]
        p, k = [r["pearson"] for r in rs], [r["kendall"] for r in rs]
        by_decision.append({
            "decision": d, "prompts": len(rs), "mean_candidates": statistics.fmean(r["n"] for r in rs),
            "pearson_mean": statistics.fmean(p), "pearson_median": statistics.median(p),
            "kendall_mean": statistics.fmean(k), "kendall_median": statistics.median(k),
        })
    overall = None
    if records:
        p, k = [r["pearson"] for r in records], [r["kendall"] for r in records]
        overall = {"pairs": len(records), "pearson_mean": statistics.fmean(p),
                   "pearson_median": statistics.median(p), "kendall_mean": statistics.fmean(k),
                   "kendall_median": statistics.median(k)}
    return {"records": records, "by_decision": by_decision, "overall": overall, "skipped": skipped}


def sample_prompt(run: Run) -> str | None:
    """The prompt with the most candidates that have both a partial and a final reward (ties: smallest id)."""
    best, best_n = None, 0
    for pid, row in sorted(ok_rows(run).items()):
        n = sum(1 for c in row["candidates"] or [] if c["reward"] is not None and c["partial_rewards"])
        if n > best_n:
            best, best_n = pid, n
    return best if best_n >= MIN_CORRELATION_POINTS else None


def finite(x):
    """JSON-safe value: NaN and infinities become None, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x
