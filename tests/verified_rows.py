"""Hand-made rows of runs with a verifier, for the report and build-sft tests: candidates with the verifier's
verdict, and rows whose `stats` carry the counts, the answer's verdict and pass@k as a verifier run writes them."""

from __future__ import annotations

from math import comb

from conftest_runs import cand, row

MATH_REWARD = {"kind": "math", "answer_column": "answer"}  # a verifier alone: reward 1.0 verified, 0.0 not
MATH_VERIFIER = {"verifier": {"kind": "math", "answer_column": "answer"}}  # config.models keys: a verifier + ranker


def vcand(text: str, reward: float | None, verified: bool | None, finish: str = "eos") -> dict:
    """A candidate with the verifier's verdict (None: not judged)."""
    c = cand(text, reward, finish)
    c.update(verified=verified, answer=None, verifier_reason=None if verified in (True, None) else "wrong answer")
    return c


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased estimator: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 - comb(n - c, k) / comb(n, k)


def vrow(pid: str, cands: list[dict], device_seconds: float = 1.0, cut: bool = False, **kw) -> dict:
    """A row of a run with a verifier: the answer is the highest-reward verified candidate, else the ranker's best;
    stats from the verdicts (pass@1 and pass@k null when `cut`: candidates stopped before they were judged)."""
    r = row(pid, cands, device_seconds=device_seconds, **kw)
    judged = [c for c in cands if c["verified"] is not None]
    good = [i for i, c in enumerate(cands) if c["verified"] is True]
    if good:
        best = max(good, key=lambda i: cands[i]["reward"])
        r.update(best_index=best, best_text=cands[best]["text"], best_reward=cands[best]["reward"])
    n, c = len(judged), len(good)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32) if k <= n} | {n}) if n else []
    r["stats"].update(judged_candidates=n, verified_candidates=c, best_verified=bool(good),
                      pass_at_1=None if cut or not n else c / n,
                      pass_at_k=None if cut or not n else [{"k": k, "value": pass_at_k(n, c, k)} for k in ks])
    return r
