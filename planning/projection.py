"""The projection of a plan: from what each swept config measured on the sample to the whole dataset, with
intervals; the frontier, its knee, and the answer to the question asked. Pure functions (numpy), no Ray.

For a swept config and a figure X measured per sampled prompt (x_1..x_K, an errored prompt's cost counted as it was
billed, 0 when null), over a prompt set of N prompts that can run:

- **total** of X: ``N x mean(x)``; its **interval**: ``N x`` the percentile bootstrap interval of the mean
  (`reporting.stats.bootstrap_intervals`: 2,000 resamples of the sampled prompts, ``default_rng(0)``, every config
  resampled with the same prompt draws). Figures: generated tokens (every candidate's, rejected ones included),
  processed tokens (target + draft + reward, prefill and scoring included), FLOPs (`reporting.cost`), device-seconds.
- **device-seconds** are the sweep's with their warm-up removed (`planning.estimate`); the full run's own warm-up,
  once per actor (``warmup x W``), is added to the total and both ends of its interval.
- **device-hours** = device-seconds / 3600; **USD** = device-hours x ``cost.usd_per_device_hour``.
- **wall-clock** on W actors: ``fixed + device-seconds / W``, with ``fixed`` what the sweep's runs took beyond their
  device time (start-up, reading, writing: `fixed_seconds`); it assumes the W actors stay busy.
- **mean best reward**: the mean over the sampled prompts that every swept config completed (no error, a best
  reward), with its bootstrap interval, as the report's frontier has it.
- **verified rate** (a job with a verifier): the mean over the config's sampled prompts that ran of whether the
  answer verified, with its bootstrap interval. **USD per verified prompt** (and FLOPs): the cost of the prompts
  that ran over the verified ones, with the percentile bootstrap interval of that ratio
  (`reporting.verified.ratio_intervals`); the full run's warm-up is added to the USD. None without a verified
  prompt on the sample; an unbounded upper end is None.

The frontier is `reporting.frontier.frontier` over (cost, mean best reward) of the whole dataset, the cost on the
plan's basis as `winnow report` has it: compute (FLOPs, the default: it does not move with the machine's load) or
measured USD; "the cheapest" of a target reward is on that basis too, while a budget is always in USD. Its **knee** is
the frontier point farthest above the chord from its cheapest to its most rewarding point, both axes scaled to the
frontier's range (ties: the cheaper); a frontier of two points has no chord to be above, so there the knee is the
more rewarding point when the sample resolves the step to it (the two rewards are not within each other's
intervals), else the cheaper; a frontier of one point is its own knee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reporting.cost import COMPUTE, ROLES, USD
from reporting.frontier import Point, frontier
from reporting.stats import BOOTSTRAP_LEVEL, bootstrap_intervals
from reporting.tolerance import at_least, at_most, greater, less
from reporting.verified import ratio_intervals

COST_FIGURES = ("generated_tokens", "processed_tokens", "flops", "device_seconds")


@dataclass
class Measured:
    """One swept config on the sample: per sampled prompt (the same order for every config) its best reward (nan
    where it has none: an error, or no reward) and what it cost."""

    label: str
    reward: np.ndarray
    generated_tokens: np.ndarray
    processed_tokens: np.ndarray
    flops: np.ndarray | None  # None: the run has no compute (a parameter count is missing)
    device_seconds: np.ndarray
    errors: int = 0
    verified: np.ndarray | None = None  # per prompt: 1 when the answer verified, else 0 (nan: an error); None: no
    # verifier. A Best-of-k estimate holds the chance, between 0 and 1.


def measure(label: str, prompt_ids: list[str], rows: dict[str, dict], flops_of, scale: float = 1.0,
            verifier: bool = False) -> Measured:
    """`Measured` of a run's rows (prompt_id -> row) on the sample's `prompt_ids`; `flops_of(row)` is the row's
    compute (`reporting.cost.RunCost.flops`, None without compute); `scale` multiplies device-seconds (the warm-up's
    removal); `verifier` fills `verified` from ``stats.best_verified`` (null counts as not verified). A sampled
    prompt without a row counts as an error that cost nothing."""
    reward, generated, processed, flops, seconds, verified, errors = [], [], [], [], [], [], 0
    for pid in prompt_ids:
        row = rows.get(pid) or {"error": "no row", "candidates": [], "cost": None, "best_reward": None}
        cost = row["cost"] or {}
        errors += row["error"] is not None
        reward.append(row["best_reward"] if row["error"] is None and row["best_reward"] is not None else math.nan)
        verified.append(math.nan if row["error"] is not None
                        else float((row.get("stats") or {}).get("best_verified") is True))
        generated.append(sum(c["num_tokens"] or 0 for c in row["candidates"] or []))
        tokens = [cost.get(f"{r}_tokens") for r in ROLES]
        processed.append(sum(t or 0 for t in tokens))
        flops.append(flops_of(row) if all(t is not None for t in tokens) and cost else 0.0)
        seconds.append((cost.get("device_seconds") or 0.0) * scale)
    has_flops = all(f is not None for f in flops)
    return Measured(label, np.array(reward, dtype=float), np.array(generated, dtype=float),
                    np.array(processed, dtype=float), np.array(flops, dtype=float) if has_flops else None,
                    np.array(seconds, dtype=float), errors, np.array(verified, dtype=float) if verifier else None)


def _figure(value: float, interval, per_prompt: float | None = None) -> dict:
    out = {"value": float(value), "interval": [float(interval[0]), float(interval[1])]}
    if per_prompt is not None:
        out["per_prompt"] = float(per_prompt)
    return out


def wall_seconds(device_seconds: float, actors: int, fixed_seconds: float) -> float:
    """Wall-clock of a run that spends `device_seconds` on `actors` busy actors, beyond `fixed_seconds`."""
    return fixed_seconds + device_seconds / actors


def verified_figures(m: Measured, usd_per_device_hour: float, warmup_usd: float, prompts: int) -> dict:
    """The verified rate and the cost of a verified prompt (USD, FLOPs) of one config (module docstring)."""
    ran = np.isfinite(m.verified)
    out: dict = {"verified_rate": None, "usd_per_verified": None, "flops_per_verified": None}
    if not ran.any():
        return out
    v = m.verified[ran]
    out["verified_rate"] = _figure(v.mean(), bootstrap_intervals(v[None, :])[0])
    if not v.sum() > 0:
        return out
    verified_total = prompts * v.sum() / len(m.verified)  # the prompt set's verified prompts
    units = [("usd_per_verified", m.device_seconds[ran] / 3600 * usd_per_device_hour, warmup_usd)]
    if m.flops is not None:
        units.append(("flops_per_verified", m.flops[ran], 0.0))
    ivs = ratio_intervals(np.stack([u[1] for u in units]), v)
    for (name, costs, extra), (low, high) in zip(units, ivs):
        add = extra / verified_total
        out[name] = {"value": float(costs.sum() / v.sum() + add), "interval": [
            float(low + add), None if math.isinf(high) else float(high + add)]}
    return out


def project(measured: list[Measured], prompts: int, actors: int, usd_per_device_hour: float,
            fixed_seconds: float, warmup_seconds: float = 0.0) -> list[dict]:
    """Each config's projection to `prompts` prompts (module docstring): figure -> {value, interval, per_prompt},
    plus ``reward_prompts`` (the sampled prompts every config completed) and ``errors`` (projected error rows).
    `warmup_seconds`: one actor's warm-up, paid by the full run once on each of its `actors`."""
    k = len(measured[0].reward)
    common = np.all(np.isfinite(np.stack([m.reward for m in measured])), axis=0)  # [K]
    rewards = np.stack([m.reward[common] for m in measured])  # [R, P]
    reward_iv = bootstrap_intervals(rewards) if common.any() else None
    totals = {}
    for name in COST_FIGURES:
        arrays = [getattr(m, name) for m in measured]
        have = [i for i, a in enumerate(arrays) if a is not None]
        stacked = np.stack([arrays[i] for i in have]) if have else np.zeros((0, k))
        ivs = bootstrap_intervals(stacked) if have else np.zeros((0, 2))
        totals[name] = {i: (float(stacked[j].mean()), ivs[j]) for j, i in enumerate(have)}
    out = []
    for i, m in enumerate(measured):
        figures: dict = {"mean_best_reward": None}
        if reward_iv is not None:
            figures["mean_best_reward"] = _figure(rewards[i].mean(), reward_iv[i])
        for name in ("generated_tokens", "processed_tokens", "flops"):
            got = totals[name].get(i)
            figures[name] = None if got is None else _figure(prompts * got[0], prompts * got[1], got[0])
        mean_s, iv_s = totals["device_seconds"][i]
        warm = warmup_seconds * actors
        seconds = (prompts * mean_s + warm, prompts * iv_s[0] + warm, prompts * iv_s[1] + warm)
        figures["device_hours"] = _figure(seconds[0] / 3600, [s / 3600 for s in seconds[1:]], mean_s / 3600)
        figures["usd"] = _figure(seconds[0] / 3600 * usd_per_device_hour,
                                 [s / 3600 * usd_per_device_hour for s in seconds[1:]],
                                 mean_s / 3600 * usd_per_device_hour)
        figures["wall_seconds"] = _figure(wall_seconds(seconds[0], actors, fixed_seconds),
                                          [wall_seconds(s, actors, fixed_seconds) for s in seconds[1:]])
        if m.verified is not None:
            figures.update(verified_figures(m, usd_per_device_hour, warm / 3600 * usd_per_device_hour, prompts))
        out.append({"label": m.label, "figures": figures, "reward_prompts": int(common.sum()),
                    "sample_errors": m.errors, "errors": prompts * m.errors / k})
    return out


def fixed_seconds(walls: list[tuple[float, float, int]]) -> float:
    """What the sweep's runs took beyond their device time, from (wall seconds, device-seconds, actors) of each:
    the median over runs of ``wall - device-seconds / actors`` (0 at least; a resumed run's wall covers only its
    last part and gives less)."""
    extra = sorted(max(0.0, wall - seconds / actors) for wall, seconds, actors in walls)
    if not extra:
        return 0.0
    mid = len(extra) // 2
    return extra[mid] if len(extra) % 2 else (extra[mid - 1] + extra[mid]) / 2


# ---------------------------------------------------------------------------------------------------------------
# The frontier, its knee and the answer


COST_KEY = {COMPUTE: "flops", USD: "usd"}


def basis_of(projected: list[dict], basis: str) -> str:
    """The basis the frontier is drawn and the picks ranked on: `basis`, or USD where a config has no compute (as
    `winnow report` falls back)."""
    if basis == COMPUTE and any(p["figures"]["flops"] is None for p in projected):
        return USD
    return basis


def points(projected: list[dict], basis: str) -> list[Point]:
    """Frontier points: the whole dataset's cost on `basis` (FLOPs or USD) against the mean best reward, for configs
    with a reward."""
    out = []
    for p in projected:
        r = p["figures"]["mean_best_reward"]
        if r is not None:
            out.append(Point(p["label"], p["figures"][COST_KEY[basis]]["value"], r["value"], *r["interval"]))
    return out


def knee(front: list[Point], verdicts: dict[str, dict]) -> str | None:
    """The knee of frontier points given cheapest first, with their `reporting.frontier.frontier` verdicts (module
    docstring); None for no points."""
    if not front:
        return None
    if len(front) == 2:
        return front[1].label if not verdicts[front[1].label]["step_within_intervals"] else front[0].label
    c0, c1 = front[0].cost, front[-1].cost
    r0, r1 = front[0].reward, front[-1].reward
    if len(front) < 3 or c1 <= c0 or r1 <= r0:
        return front[0].label
    gaps = [(p.reward - r0) / (r1 - r0) - (p.cost - c0) / (c1 - c0) for p in front]
    best = max(gaps)
    return next(p.label for p, g in zip(front, gaps) if g == best)


def needed_sample(k: int, interval: list[float], margin: float) -> int | None:
    """Sampled prompts it would take for a 95% interval of half its width now to end `margin` from its mean (the
    width shrinks as 1/sqrt(K)): ``ceil(K x (half-width / margin)^2)``; None for no margin."""
    if not margin > 0:
        return None
    half = (interval[1] - interval[0]) / 2
    return max(k, math.ceil(k * (half / margin) ** 2))


@dataclass
class Question:
    """What the plan answers: ``target_reward`` (the cheapest config whose reward reaches `value`), ``budget_usd``
    (the best reward within `value` USD), or ``frontier`` (the frontier and its knee)."""

    kind: str
    value: float | None = None

    @property
    def text(self) -> str:
        if self.kind == "target_reward":
            return f"the cheapest config whose projected mean best reward reaches {self.value:g}"
        if self.kind == "budget_usd":
            return f"the best projected mean best reward within ${self.value:g} for the whole dataset"
        return "the cost-reward frontier and its knee"


class Unanswerable(ValueError):
    """The question has no answer among the swept configs (a reward above all, a budget below all): bad input."""


def _usd(p: dict) -> dict:
    return p["figures"]["usd"]


def _reward(p: dict) -> dict:
    return p["figures"]["mean_best_reward"]


def shown(figure: dict, money: bool = False) -> str:
    """A projected figure and its interval: ``0.612 [0.571, 0.655]`` (``$`` before each number when `money`)."""
    d = "$" if money else ""
    low, high = figure["interval"]
    return f"{d}{figure['value']:.4g} [{d}{low:.4g}, {d}{high:.4g}]"


def _unresolved_reward(pick: dict, reach: list[dict], r: float, k: int, cost) -> list[str]:
    """What the sample cannot say about the picked config reaching `r`, and the cheapest config (by `cost`) it can
    say it of."""
    low = _reward(pick)["interval"][0]
    if not less(low, r):
        return []
    needed = needed_sample(k, _reward(pick)["interval"], _reward(pick)["value"] - r)
    text = (f"the sample is too small to say that {pick['label']} reaches {r:g} at 95%: its interval starts at "
            f"{low:.4g}" + (f"; a sample of about {needed} prompts would" if needed else
                            f"; its mean is {r:g} itself, which no sample size resolves"))
    sure = [p for p in reach if at_least(_reward(p)["interval"][0], r)]
    if sure:
        safest = min(sure, key=cost)
        text += (f"; the cheapest config whose whole interval reaches {r:g} is {safest['label']} "
                 f"(${_usd(safest)['value']:.4g})")
    return [text]


def unanswerable(question: Question, configs: list[dict]) -> Unanswerable:
    """Why no swept config answers `question`: the highest reward is below the target, or the cheapest USD above
    the budget."""
    if question.kind == "target_reward":
        best = max(configs, key=lambda p: _reward(p)["value"])
        return Unanswerable(f"--target-reward {question.value:g}: above every swept config's projected mean best "
                            f"reward (the highest: {shown(_reward(best))}, {best['label']}); ask for at most that, or "
                            "sweep larger n with --methods")
    cheapest = min(configs, key=lambda p: _usd(p)["value"])
    return Unanswerable(f"--budget-usd {question.value:g}: below the cheapest swept config's projected cost for the "
                        f"whole dataset ({shown(_usd(cheapest), money=True)}, {cheapest['label']}); give at least "
                        "that, or sweep cheaper configs with --methods")


def answer(projected: list[dict], question: Question, sample_prompts: int, basis: str = COMPUTE) -> dict:
    """The picked config's label, why, and what the sample cannot resolve (`notes`), with the frontier's verdicts
    (label -> `reporting.frontier.frontier`'s dict), its order, knee and basis (`basis_of`): the cheapest is by that
    basis (FLOPs or USD), a budget is in USD. Unanswerable when no config answers."""
    basis = basis_of(projected, basis)
    pts = points(projected, basis)
    if not pts:
        raise Unanswerable("no swept config has a mean best reward on the sample (every prompt errored, or the job "
                           "has no reward)")
    verdicts = frontier(pts)
    order = sorted((p for p in pts if verdicts[p.label]["on_frontier"]), key=lambda p: verdicts[p.label]["position"])
    the_knee = knee(order, verdicts)
    by_label = {p["label"]: p for p in projected if _reward(p) is not None}
    notes: list[str] = []

    def cost(p: dict) -> float:
        return p["figures"][COST_KEY[basis]]["value"]

    by = "compute" if basis == COMPUTE else "USD"
    if question.kind == "target_reward":
        r = question.value
        reach = [p for p in by_label.values() if at_least(_reward(p)["value"], r)]
        if not reach:
            raise unanswerable(question, list(by_label.values()))
        pick = min(reach, key=lambda p: (cost(p), -_reward(p)["value"]))
        why = (f"the cheapest by {by} of the {len(reach)} swept config(s) whose projected mean best reward reaches "
               f"{r:g}: {shown(_reward(pick))}")
        notes += _unresolved_reward(pick, reach, r, sample_prompts, cost)
    elif question.kind == "budget_usd":
        b = question.value
        within = [p for p in by_label.values() if at_most(_usd(p)["value"], b)]
        if not within:
            raise unanswerable(question, list(by_label.values()))
        pick = max(within, key=lambda p: (_reward(p)["value"], -cost(p)))
        why = (f"the highest projected mean best reward of the {len(within)} swept config(s) whose projected cost "
               f"for the whole dataset is within ${b:g}: {shown(_usd(pick), money=True)}")
        high = _usd(pick)["interval"][1]
        if greater(high, b):
            k = needed_sample(sample_prompts, _usd(pick)["interval"], b - _usd(pick)["value"])
            notes.append(f"the sample is too small to say that {pick['label']} stays within ${b:g} at 95%: its "
                         f"cost's interval ends at ${high:.4g}"
                         + (f"; a sample of about {k} prompts would" if k else ""))
    else:
        pick = by_label[the_knee]
        why = (f"the knee of the frontier by {by} ({len(order)} point(s): {', '.join(p.label for p in order)}), "
               "where further reward starts to cost more per unit")
        previous = verdicts[the_knee]["previous"]
        nxt = next((p.label for p in order if verdicts[p.label]["previous"] == the_knee), None)
        if nxt is not None and verdicts[nxt]["step_within_intervals"]:
            notes.append(f"the frontier's step from {the_knee} to {nxt} is within each other's intervals: the sample "
                         "does not tell whether it buys any reward")
        if previous is not None and verdicts[the_knee]["step_within_intervals"]:
            notes.append(f"the frontier's step from {previous} to {the_knee} is within each other's intervals: the "
                         "sample does not tell whether it buys any reward")
    return {"label": pick["label"], "why": why, "notes": notes, "verdicts": verdicts,
            "order": [p.label for p in order], "knee": the_knee, "basis": basis, "level": BOOTSTRAP_LEVEL}
