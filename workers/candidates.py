"""What a method takes and returns per prompt: a prompt ready to decode, its candidates, and its result.

Every method, on either engine, turns a batch of `PromptInput`s into one `MethodResult` per prompt, in order: the
candidates it started (rejected ones included), the index of its answer, and its per-method stats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from workers.verifiers.verdict import Verdict, pass_at_k, pass_at_ks


@dataclass
class PromptInput:
    """One prompt of a batch, ready for decoding."""

    prompt_id: str
    messages: list[dict]
    ids: list[int]  # rendered with the target tokenizer's chat template
    rng_key: int  # the prompt's key of the counter-based RNG (workers.decoding.sampling.prompt_key)
    limit: int  # most new tokens: max_new_tokens, capped by the target's context
    concepts: list[str] | None = None
    columns: dict | None = None  # the dataset columns the reward and the verifier read (JobConfig.reward_columns)


@dataclass
class Candidate:
    tokens: list[int]
    finish_reason: str  # eos | length | rejected
    text: str = ""
    reward: float | None = None
    partial_rewards: list[float] = field(default_factory=list)
    logprob: float | None = None  # the target's log-probability of `tokens` (temperature 1), where the engine kept it
    verified: bool | None = None  # the verifier's verdict, where a verifier judged it
    answer: str | None = None  # the final answer the math verifier read in it
    verifier_reason: str | None = None  # why the verifier did not accept it

    def perplexity(self) -> float | None:
        """exp of the mean negative log-likelihood of its tokens under the target (paper 002's measure), from
        `logprob`; None without it or without tokens."""
        if self.logprob is None or not self.tokens:
            return None
        return math.exp(-self.logprob / len(self.tokens))

    def struct(self) -> dict:
        """The candidate as an element of its output row's `candidates` list (schemas.rows.CANDIDATE)."""
        return {
            "text": self.text,
            "num_tokens": len(self.tokens),
            "reward": self.reward,
            "finish_reason": self.finish_reason,
            "partial_rewards": list(self.partial_rewards),
            "verified": self.verified,
            "answer": self.answer,
            "verifier_reason": self.verifier_reason,
        }


@dataclass
class MethodResult:
    candidates: list[Candidate]
    best_index: int | None
    stats: dict = field(default_factory=dict)


def best_of(cands: list[Candidate | None]) -> int | None:
    """Index of the highest-reward finished candidate (the lowest index on ties; None entries are passed over); None
    if none has a reward."""
    best, best_r = None, -math.inf
    for i, c in enumerate(cands):
        if c is not None and c.finish_reason != "rejected" and c.reward is not None and c.reward > best_r:
            best, best_r = i, c.reward
    return best


def reward_stats(cands: list[Candidate]) -> dict:
    rs = [c.reward for c in cands if c.finish_reason != "rejected" and c.reward is not None]
    if not rs:
        return {"reward_mean": None, "reward_std": None}
    t = torch.tensor(rs, dtype=torch.float64)
    return {"reward_mean": float(t.mean()), "reward_std": float(t.std(unbiased=False))}


def settle_verdicts(cands: list[Candidate], verdicts: dict[int, Verdict], as_reward: bool,
                    own_best: int | None = None, ranks: bool = True) -> tuple[int | None, dict]:
    """The answer and the verifier's stats of a prompt whose finished candidates `verdicts` judged (by index). A
    method that does not rank its candidates by reward (`ranks` false: greedy, beam, the draft/target methods) keeps
    its own answer `own_best`, and the verifier only says whether it verified.

    1. Each judged candidate takes its verdict (`verified`, `answer`, `verifier_reason`); where the verifier is the
       reward (`as_reward`: a math or code reward), its reward is 1.0 or 0.0.
    2. The answer is the verified candidate with the highest reward (the ranker's); with none verified, the finished
       one with the highest reward, and `best_verified` is false.
    3. pass@1 and pass@k come from the judged candidates, only where none was cut before it finished: the finished
       ones of a cut prompt are not a fair sample of the method's responses."""
    for i, v in verdicts.items():
        c = cands[i]
        c.verified, c.answer, c.verifier_reason = v.verified, v.answer, v.reason
        if as_reward:
            c.reward = 1.0 if v.verified else 0.0
    ok = [i for i in verdicts if cands[i].verified]
    if not ranks:
        best = own_best
    else:
        best = best_of([c if i in ok else None for i, c in enumerate(cands)]) if ok else best_of(cands)
    n, c = len(verdicts), len(ok)
    fair = n > 0 and all(x.finish_reason != "rejected" for x in cands)
    stats = {
        "judged_candidates": n,
        "verified_candidates": c,
        "best_verified": best is not None and cands[best].verified is True,
        "pass_at_1": pass_at_k(n, c, 1) if fair else None,
        "pass_at_k": [{"k": k, "value": pass_at_k(n, c, k)} for k in pass_at_ks(n)] if fair else None,
    }
    return best, stats
