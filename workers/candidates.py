"""What a method takes and returns per prompt: a prompt ready to decode, its candidates, and its result.

Every method, on either engine, turns a batch of `PromptInput`s into one `MethodResult` per prompt, in order: the
candidates it started (rejected ones included), the index of its answer, and its per-method stats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class PromptInput:
    """One prompt of a batch, ready for decoding."""

    prompt_id: str
    messages: list[dict]
    ids: list[int]  # rendered with the target tokenizer's chat template
    rng_key: int  # the prompt's key of the counter-based RNG (workers.decoding.sampling.prompt_key)
    limit: int  # most new tokens: max_new_tokens, capped by the target's context
    concepts: list[str] | None = None


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


def best_of(cands: list[Candidate]) -> int | None:
    """Index of the highest-reward finished candidate (the lowest index on ties); None if none has a reward."""
    best, best_r = None, -math.inf
    for i, c in enumerate(cands):
        if c.finish_reason != "rejected" and c.reward is not None and c.reward > best_r:
            best, best_r = i, c.reward
    return best


def reward_stats(cands: list[Candidate]) -> dict:
    rs = [c.reward for c in cands if c.finish_reason != "rejected" and c.reward is not None]
    if not rs:
        return {"reward_mean": None, "reward_std": None}
    t = torch.tensor(rs, dtype=torch.float64)
    return {"reward_mean": float(t.mean()), "reward_std": float(t.std(unbiased=False))}
