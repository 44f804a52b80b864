"""What a method and a candidate pool share for one batch of prompts (`Context`).

A method is `fn(ctx: Context, params, prompts: list[PromptInput]) -> list[MethodResult]` (`workers.methods`); a
candidate pool (`workers.pool`) takes the same context. `params` is the method's own section of the config (a class
of schemas.methods), `ctx` what every method shares: the tokenizer and stop tokens, the reward, how it samples
(`sampling`: the warp, and on the hf engine the sampler of a candidate pool: 'target' token by token, or
'speculative' with `gamma` drafted tokens per verification) and the seed, and on the hf engine the loaded target and
draft (None on the vllm engine, whose target lives in vLLM) with the memory a pool's decoder may take (`kv_space`,
`width`). `for_method(params)` gives a method its own sampling (greedy decodes at temperature 0, nucleus with its
top_p, speculative decoding with its sampler and gamma: schemas.methods `sampling`). A context holds no cost
counter: what a method or a pool runs comes back with its results (a `workers.accounting.work.Work`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
import torch

from schemas.methods import MethodParams, Sampling
from workers.accounting.work import Work
from workers.candidates import PromptInput
from workers.decoding.sampling import Warp
from workers.scoring.items import Scored
from workers.scoring.protocol import Scorer, Scores, Session
from workers.scoring.scorers import Rescoring
from workers.verifiers.verdict import Verifier


@dataclass
class Context:
    tokenizer: object
    eos_ids: list[int]
    pad_id: int
    reward: Scorer | None
    sampling: Sampling
    seed: int
    target: torch.nn.Module | None = None
    draft: torch.nn.Module | None = None
    verifier: Verifier | None = None  # judges finished candidates (models.verifier, or a math or code reward)
    verdict_reward: bool = False  # the verifier is the reward: a judged candidate's reward is 1.0 or 0.0
    # what a candidate pool's decoder may take on the hf engine, as the actor's engine gives it: its KV space in bytes
    # (read when the context is made; None: the device's free memory, read when asked) and its width (most sequences
    # a step runs, models.max_num_seqs; None: no bound but the KV space)
    kv_space: int | None = None
    width: int | None = None

    @cached_property
    def warp(self) -> Warp:
        s = self.sampling
        return Warp(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

    def for_method(self, params: MethodParams) -> "Context":
        """This context with the method of `params`'s own sampling (a method's `sampling` of this one's)."""
        s = params.sampling(self.sampling)
        return self if s == self.sampling else replace(self, sampling=s)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def scored(self, group: int, prompt: PromptInput, tokens: list[int], logprob: float | None = None) -> Scored:
        return Scored(group, prompt.messages, self.decode(tokens), prompt.ids, list(tokens), prompt.concepts, logprob,
                      prompt.columns)

    def score(self, items: list[Scored]) -> Scores:
        """Rewards of items (all None when no reward is configured: methods that rank require one), with what
        scoring them ran."""
        if self.reward is None or not items:
            return Scores([None] * len(items), Work())
        return self.reward(items)

    def reward_session(self) -> Session:
        """A scoring session for candidates scored again as they grow (Speculative Rejection's decisions): the
        reward's own (`Scorer.session`: a causal reward model keeps each candidate's cache,
        workers.scoring.reward_session.CachedScoring), or without a reward one that scores every call to None."""
        return self.reward.session() if self.reward is not None else Rescoring(self.score)

    def finish_reason(self, tokens: list[int]) -> str:
        return "eos" if tokens and tokens[-1] in self.eos_ids else "length"
