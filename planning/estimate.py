"""What the sweep's runs tell beyond their own rows: Best-of-k for every k up to n from one Best-of-n run, the
device time a run spends warming up, and how a prompt's device time scales from n candidates to k. Pure functions
(numpy, math), no Ray.

**Best-of-k from a Best-of-n run.** A Best-of-N candidate is sampled from the seed, the prompt and its index alone
(`workers.decoding.sampling`), so a Best-of-k run draws Best-of-n's first k candidates. The plan takes the mean over
every k-subset of the n candidates instead of the first k: the same expectation, with less spread. Per prompt:

- **best reward**: the expected highest of k rewards drawn without replacement from the n finished candidates'.
  With the rewards sorted, r_(1) <= ... <= r_(n), it is ``sum_i r_(i) C(i-1, k-1) / C(n, k)`` (`expected_best`).
- **verified** (a job with a verifier): the chance that one of the k verified, ``1 - C(n-c, k) / C(n, k)`` with c
  of the n judged candidates verified (pass@k, Chen et al. 2021). Best-of-k's answer verifies exactly then.
- **generated tokens**: k/n of the n candidates' tokens (exact in expectation).
- **processed tokens**: a prompt is read once whatever k; its candidates' tokens grow with k. The target and the
  reward model are each charged the prompt once (`stats.prompt_tokens`, the target's count, taken for both) and
  k/n of the rest. The draft's tokens scale as the target's. Left out: a reward template's tokens per candidate,
  and candidate prefixes the reward model reads once; both are counted with the prompt.
- **FLOPs**: each model's processed tokens times its parameters (`reporting.cost`).
- **device-seconds**: the row's, times `DeviceModel.ratio`.

**The device model.** A run's device time is taken as ``a x forwards + b x work``. Forwards are the row's shares of
its actor's forwards (``stats.decoding_steps + stats.reward_steps``); work is its FLOPs, or its processed tokens
where the run has no compute. Best-of-k takes as many forwards as Best-of-n (an upper bound: its longest candidate
is at most as long) and k's work. ``a`` and ``b`` are fitted to the sweep's runs, warm-up removed, and to the warm
calls of the warm-up probe, whose narrow calls set them apart, by least squares with both at least 0
(`fit_device_model`). With one run, or no forward counts, ``a`` is 0: device time follows the
work, which leans low for small k where a forward has a fixed cost (a GPU at small widths).

**The warm-up.** An actor's first call carries one-time work: the first forwards at each shape, the reward session.
A full run pays it once per actor; a sweep run pays it on a small sample, where it weighs far more. The warm-up probe
(`planning.sweep.probe_config`) decodes the same few prompts in three calls on one actor, in order. The warm-up is
the first call's device-seconds beyond its processed tokens at the warm calls' rate (their seconds over their
tokens), and 0 when the first call was no slower (`warmup_seconds`). On a loaded machine one call's seconds may
move more than the warm-up itself.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from planning.projection import Measured
from planning.sweep import probe_call
from reporting.cost import ROLES
from reporting.stats import FINISHED


def subset_weights(n: int, k: int) -> np.ndarray:
    """``C(i-1, k-1) / C(n, k)`` for i = 1..n: the chance that the i-th smallest of n values is the highest of a
    uniformly drawn k-subset (0 for i < k; they sum to 1)."""
    if not 1 <= k <= n:
        raise ValueError(f"subset_weights needs 1 <= k <= n; got k = {k}, n = {n}")
    i = np.arange(1, n + 1, dtype=float)
    log = np.full(n, -np.inf)
    ok = i >= k
    lg = np.vectorize(math.lgamma)
    whole = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)  # log C(n, k)
    log[ok] = lg(i[ok]) - math.lgamma(k) - lg(i[ok] - k + 1) - whole  # log C(i-1, k-1) - log C(n, k)
    return np.exp(log)


def expected_best(rewards: list[float], k: int) -> float:
    """The expected highest of k rewards drawn without replacement from `rewards` (k is capped at their number);
    nan without rewards."""
    if not rewards:
        return math.nan
    r = np.sort(np.asarray(rewards, dtype=float))
    return float(r @ subset_weights(len(r), min(k, len(r))))


def pass_at(n: int, c: int, k: int) -> float:
    """pass@k of n judged candidates of which c verified: ``1 - C(n-c, k) / C(n, k)`` (k capped at n); nan for n 0."""
    if n <= 0:
        return math.nan
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ---------------------------------------------------------------------------------------------------------------
# The device model


@dataclass(frozen=True)
class DeviceModel:
    """Device-seconds as ``a x forwards + b x work`` (module docstring); `why` says how a and b were set."""

    a: float
    b: float
    why: str

    def ratio(self, forwards: float | None, work_k: float, work_n: float) -> float:
        """Best-of-k's device time over Best-of-n's for a prompt of `forwards` forwards and work `work_n` at n,
        `work_k` at k; between work_k / work_n and 1."""
        if work_n <= 0:
            return 1.0
        if forwards is None or self.a <= 0:
            return work_k / work_n
        return (self.a * forwards + self.b * work_k) / (self.a * forwards + self.b * work_n)


def fit_device_model(runs: list[tuple[float, float, float]]) -> DeviceModel:
    """`DeviceModel` from (device-seconds, forwards, work) of each sweep run, warm-up removed: least squares through
    the origin with a, b >= 0 (module docstring)."""
    usable = [(d, f, w) for d, f, w in runs if d > 0 and w > 0 and f > 0]
    if len(usable) < 2:
        return DeviceModel(0.0, 1.0, "fewer than two measurements with forwards: device time taken to follow the "
                                     "work")
    d, f, w = (np.array(x, dtype=float) for x in zip(*usable))
    scale_f, scale_w = f.mean(), w.mean()  # solve on scaled columns: FLOPs and forwards differ by ~1e9
    x = np.stack([f / scale_f, w / scale_w], axis=1)
    coef, *_ = np.linalg.lstsq(x, d, rcond=None)
    a, b = coef[0] / scale_f, coef[1] / scale_w
    if a >= 0 and b > 0:
        return DeviceModel(float(a), float(b), f"fitted to {len(usable)} measurements")
    return DeviceModel(0.0, 1.0, f"the fit to {len(usable)} measurements gave a negative term: device time taken to "
                                 "follow the work")


# ---------------------------------------------------------------------------------------------------------------
# Rows


def forwards_of(row: dict) -> float | None:
    """The row's shares of its actor's forwards (decoding steps and reward-model forwards); None without counts."""
    s = row.get("stats") or {}
    if s.get("decoding_steps") is None:
        return None
    return float(s["decoding_steps"]) + float(s.get("reward_steps") or 0.0)


def processed(row: dict) -> float:
    c = row["cost"] or {}
    return float(sum(c.get(f"{r}_tokens") or 0 for r in ROLES))


def verified_of(row: dict) -> float:
    """1 when the row's answer verified (`stats.best_verified`), else 0 (a verdict that is null counts as not
    verified, as `winnow report` counts it); nan for an error row."""
    if row["error"] is not None:
        return math.nan
    return 1.0 if (row.get("stats") or {}).get("best_verified") is True else 0.0


def best_of_k_cost(row: dict, k: int) -> dict:
    """The expected `cost` token counts of Best-of-k from a Best-of-n row (module docstring), with the row's n."""
    c = row["cost"]
    n = len(row["candidates"] or [])
    f = k / n if n else 1.0
    prompt = float((row.get("stats") or {}).get("prompt_tokens") or 0)
    out = {}
    for role in ("target", "reward"):
        t = float(c[f"{role}_tokens"] or 0)
        shared = min(prompt, t)
        out[f"{role}_tokens"] = shared + f * (t - shared)
    target = float(c["target_tokens"] or 0)
    out["draft_tokens"] = float(c["draft_tokens"] or 0) * (out["target_tokens"] / target if target else f)
    return out


def best_of_k(label: str, k: int, prompt_ids: list[str], rows: dict[str, dict], flops_of, model: DeviceModel,
              scale: float, verifier: bool) -> Measured:
    """`Measured` of Best-of-k on the sample's `prompt_ids` from a Best-of-n run's rows (prompt_id -> row; module
    docstring). `flops_of(row)` is a row's compute (None without); `scale` multiplies device-seconds (the warm-up's
    removal); `verifier` fills the verified figure. A sampled prompt without a row counts as an error that cost
    nothing, as in `planning.projection.measure`."""
    reward, generated, processed_k, flops, seconds, verified, errors = [], [], [], [], [], [], 0
    has_flops = True
    for pid in prompt_ids:
        row = rows.get(pid)
        if row is None or row["error"] is not None:
            errors += 1
            cost = (row or {}).get("cost") or {}
            reward.append(math.nan)
            verified.append(math.nan)
            generated.append(0.0)
            processed_k.append(sum(float(cost.get(f"{r}_tokens") or 0) for r in ROLES))
            flops.append(flops_of(row) if row is not None and cost else 0.0)
            seconds.append(float(cost.get("device_seconds") or 0.0) * scale)
            continue
        cands = row["candidates"] or []
        n = len(cands)
        rewards = [c["reward"] for c in cands if c["finish_reason"] in FINISHED and c["reward"] is not None]
        reward.append(expected_best(rewards, k) if rewards else math.nan)
        judged = [c.get("verified") for c in cands if c.get("verified") is not None]
        verified.append(pass_at(len(judged), sum(judged), k) if judged else 0.0)
        generated.append(k / n * sum(c["num_tokens"] or 0 for c in cands) if n else 0.0)
        tokens = best_of_k_cost(row, k)
        processed_k.append(sum(tokens.values()))
        at_k = {**row, "cost": {**row["cost"], **tokens}}
        f_n, f_k = flops_of(row), flops_of(at_k)
        has_flops = has_flops and f_k is not None
        flops.append(f_k)
        work_n, work_k = (f_n, f_k) if (f_n is not None and f_k is not None) else (processed(row), sum(tokens.values()))
        ratio = model.ratio(forwards_of(row), work_k, work_n)
        seconds.append(float(row["cost"]["device_seconds"] or 0.0) * ratio * scale)
    as_array = (lambda xs: np.array(xs, dtype=float))
    return Measured(label, as_array(reward), as_array(generated), as_array(processed_k),
                    as_array(flops) if has_flops and all(f is not None for f in flops) else None,
                    as_array(seconds), errors, as_array(verified) if verifier else None)


# ---------------------------------------------------------------------------------------------------------------
# The warm-up


def warmup_seconds(rows: list[dict]) -> dict:
    """The warm-up of one actor from the probe's rows (module docstring): ``seconds`` (None when the probe did not
    measure it: a call missing or errored, or no work), and each call's device-seconds and processed tokens."""
    calls: dict[int, list[dict]] = {}
    for r in rows:
        c = probe_call(r["prompt_id"])
        if c is not None:
            calls.setdefault(c, []).append(r)
    shown = [{"call": c, "device_seconds": sum(float(r["cost"]["device_seconds"] or 0) for r in rs),
              "processed_tokens": sum(processed(r) for r in rs), "errors": sum(r["error"] is not None for r in rs)}
             for c, rs in sorted(calls.items())]
    out = {"seconds": None, "calls": shown}
    if len(shown) < 2 or shown[0]["call"] != 0 or any(c["errors"] or c["processed_tokens"] <= 0 for c in shown):
        return out
    rate = sum(c["device_seconds"] for c in shown[1:]) / sum(c["processed_tokens"] for c in shown[1:])
    first = shown[0]
    out["seconds"] = max(0.0, first["device_seconds"] - rate * first["processed_tokens"])
    out["warm_rate"] = rate
    return out
