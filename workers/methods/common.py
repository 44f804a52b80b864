"""What every method takes and returns, and the context it runs in.

A method is `fn(ctx: Context, params, prompts: list[PromptInput]) -> list[MethodResult]`: `params` is the method's
own section of the config (a class of schemas.methods, e.g. `SpeculativeRejection`), `ctx` what every method
shares (the models, the sampling warp, the seed, the cost meter), and the result list has one entry per prompt, in
order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from workers.cost import Meter
from workers.rewards import Rescoring, Scored
from workers.sampling import Warp


@dataclass
class PromptInput:
    """One prompt of a batch, ready for decoding."""

    prompt_id: str
    messages: list[dict]
    ids: list[int]  # rendered with the target tokenizer's chat template
    key: int  # counter-based RNG key (workers.sampling.prompt_key)
    limit: int  # most new tokens: max_new_tokens, capped by the target's context
    concepts: list[str] | None = None


@dataclass
class Candidate:
    tokens: list[int]
    finish_reason: str  # eos | length | rejected
    text: str = ""
    reward: float | None = None
    partial_rewards: list[float] = field(default_factory=list)

    def struct(self) -> dict:
        """The candidate as an element of its output row's `candidates` list (schemas.rows.CANDIDATE)."""
        return {
            "text": self.text,
            "num_tokens": len(self.tokens),
            "reward": self.reward,
            "finish_reason": self.finish_reason,
            "partial_rewards": list(self.partial_rewards),
        }


@dataclass
class MethodResult:
    candidates: list[Candidate]
    best_index: int | None
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PoolSampler:
    """How a candidate pool (best_of_n, speculative_rejection) samples: `kind` 'target' (token by token) or
    'speculative' (the draft proposes `gamma` tokens, the target verifies them): generation.sampler and .gamma."""

    kind: str
    gamma: int


@dataclass
class Context:
    """What every method shares: the models and tokenizer, the reward, the sampling warp and seed, the pool
    sampler, and the cost meter of the batch. A method's own parameters come separately (its `params`)."""

    target: torch.nn.Module
    tokenizer: object
    draft: torch.nn.Module | None
    reward: Callable[[list[Scored], Meter], list[float]] | None
    meter: Meter
    warp: Warp
    seed: int
    eos_ids: list[int]
    pad_id: int
    pool_sampler: PoolSampler
    admission: object = None  # workers.methods.rejection.Admission: prompts join a decoding batch (None: all at once)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def scored(self, group: int, prompt: PromptInput, tokens: list[int]) -> Scored:
        return Scored(group, prompt.messages, self.decode(tokens), prompt.ids, list(tokens), prompt.concepts)

    def score(self, items: list[Scored]) -> list[float | None]:
        """Rewards of items; all None when no reward is configured (methods that rank require one)."""
        if self.reward is None:
            return [None] * len(items)
        return self.reward(items, self.meter) if items else []

    def reward_session(self):
        """A scoring session for candidates scored again as they grow (Speculative Rejection's decisions): the
        reward's own when it keeps state between calls (`session(meter)`: a causal reward model keeps each
        candidate's cache, workers.rewards.CachedScoring), else one that scores every call afresh. Either has
        `score(keys, items, final) -> rewards` (a key names one candidate; `final`: its last score) and
        `release(keys)` (candidates that will not be scored again, in bulk)."""
        make = getattr(self.reward, "session", None)
        return make(self.meter) if make is not None else Rescoring(self.score)

    def finish_reason(self, tokens: list[int]) -> str:
        return "eos" if tokens and tokens[-1] in self.eos_ids else "length"


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
