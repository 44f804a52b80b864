"""When Speculative Rejection decides, and whom a decision keeps (paper 001, Algorithm 1; docs/references.md).

A *decision token* is a point where every running candidate of a prompt is scored (its partial reward) and, per
prompt, the running candidates whose partial reward is below

    r_cut = q_alpha(R_partial)                                                     (eq. 4)

stop (finish_reason "rejected"); the others continue (eq. 5). R_partial holds the partial rewards of the running
candidates and the final rewards of those that finished since the last decision. q_alpha is the lower
alpha-quantile as an order statistic: the (floor(alpha * b) + 1)-th smallest of the b values, so floor(alpha * b)
candidates fall strictly below it when there are no ties; ties at the cut are kept, and alpha = 0 keeps every
candidate. The cut itself is the pure function `rejection_cut`.

A schedule says which prompts are due for a decision, from the decoder's sequences (`workers.pool.decoder`):
Best-of-N never decides (`NoDecisions`); `FixedSchedule` decides each time a prompt's longest running response
reaches a multiple of k tokens; `MemorySchedule` is paper 001's rule: a decision when the running candidates' KV
cache would pass the memory they have. Each prompt has a space of its own there (the KV cache that
`memory_candidates` of its candidates hold at full length), so that a prompt's decisions depend on its own
candidates only, whatever prompts share the decoder, on either engine; the pool's KV space bounds how many prompts
run at once (`admit`). Every schedule keeps its clock per prompt.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Mapping, Sequence

from schemas.methods import MethodParams, SpeculativeRejection
from workers.candidates import PromptInput
from workers.pool.decoder import Decoder


class NoDecisions:
    """Best-of-N (and the single-response pools): never decide."""

    decides = False

    def kv_tokens(self, prompt: PromptInput) -> int | None:
        """The most KV tokens the schedule lets a prompt's sequences hold (its KV space), or None (full length)."""
        return None

    def due(self, decoder: Decoder, prompts: Mapping[int, PromptInput], every: int = 1) -> set[int]:
        """The prompts among `prompts` (group -> prompt) due for a rejection round now, from their running
        sequences on `decoder` (a schedule's clock moves only for the prompts it is asked about), asked every
        `every` steps (the pool's scoring clock)."""
        return set()

    def rejected(self, counts: Mapping[int, int]) -> None:
        """Candidates rejected per prompt by the last round."""

    def forget(self, group: int) -> None:
        pass

    def stats(self, prompt: PromptInput) -> dict:
        return {}


class FixedSchedule(NoDecisions):
    """A decision each time a prompt's longest running response reaches a multiple of k tokens."""

    decides = True

    def __init__(self, k: int):
        self.k = k
        self.last: dict[int, int] = defaultdict(int)  # group -> its longest response at its last decision

    def due(self, decoder: Decoder, prompts: Mapping[int, PromptInput], every: int = 1) -> set[int]:
        out = set()
        for g, lengths in decoder.lengths().items():
            if g not in prompts:
                continue
            longest = max(lengths)
            if longest // self.k > self.last[g] // self.k:
                self.last[g] = longest
                out.add(g)
        return out

    def forget(self, group: int) -> None:
        self.last.pop(group, None)


class MemorySchedule(NoDecisions):
    """Paper 001's rule, a space per prompt: a decision for a prompt when its running candidates' KV cache would pass
    its space with the next token.

    A prompt's space is the KV cache that `candidates` of its candidates hold at full length: its prompt's tokens
    once and each response at its token limit, x `kv_bytes_per_token` (at most the pool's space). Its KV cache
    while it decodes is counted the same way: its prompt's tokens once and each running response's tokens, with the
    next one. The pool counts a running prompt's hold as its space at most (`kv_tokens`), so prompts start beside
    it while room remains (`workers.pool.pool`).

    After a round, decisions continue at each further step while the prompt's cache stays over its space and the
    last round rejected someone; once a round can reject no one (alpha = 0, or a pool too small to cut), its next
    decision waits until the cache has been back under the space, so an uncuttable pool is not re-scored at every
    token.
    """

    decides = True

    def __init__(self, candidates: int, kv_bytes_per_token: int, pool_space: int):
        self.candidates, self.kv, self.pool_space = candidates, kv_bytes_per_token, pool_space
        self.armed: dict[int, bool] = {}

    def space(self, prompt: PromptInput) -> int:
        """A prompt's KV space in bytes."""
        return min(self.kv_tokens(prompt) * self.kv, self.pool_space)

    def kv_tokens(self, prompt: PromptInput) -> int:
        return len(prompt.ids) + self.candidates * prompt.limit

    def due(self, decoder: Decoder, prompts: Mapping[int, PromptInput], every: int = 1) -> set[int]:
        out = set()
        for g, lengths in decoder.lengths().items():
            prompt = prompts.get(g)
            if prompt is None:
                continue
            held = (len(prompt.ids) + sum(lengths) + every * len(lengths)) * self.kv  # by the prompt's next tick
            if held <= self.space(prompt):
                self.armed[g] = True
            elif self.armed.get(g, True) or every > 1:  # on a clock, every tick over the space is a decision
                self.armed[g] = False
                out.add(g)
        return out

    def rejected(self, counts: Mapping[int, int]) -> None:
        for g, count in counts.items():
            if count > 0:
                self.armed[g] = True

    def forget(self, group: int) -> None:
        self.armed.pop(group, None)

    def stats(self, prompt: PromptInput) -> dict:
        return {"kv_space_bytes": self.space(prompt)}


def schedule_space(params: SpeculativeRejection, kv_space: int | None) -> int:
    """The pool's KV space under the memory schedule: the engine's KV space x memory_fraction, capped by
    method.kv_space_mb when it is set (`kv_space` None: it could not be read)."""
    space = math.inf if kv_space is None else kv_space * params.memory_fraction
    cap = params.kv_space_cap_mb()
    if cap is not None:
        space = min(space, cap * 2**20)
    if not math.isfinite(space):
        raise ValueError("method.kv_space_mb: the memory the pool has could not be read (the host's available "
                         "memory: /proc/meminfo, sysconf); set method.kv_space_mb to give the memory schedule its "
                         "KV space")
    return int(space)


def pool_space(params: MethodParams, kv_space: int | None) -> int | None:
    """The bytes a pool's running prompts may hold in all: the decoder's KV space, or for Speculative Rejection's
    memory schedule its share of it (`schedule_space`); None where it cannot be read (no bound)."""
    if isinstance(params, SpeculativeRejection) and params.schedule == "memory":
        return schedule_space(params, kv_space)
    return kv_space


def schedule_for(params: MethodParams, decoder: Decoder) -> NoDecisions:
    """The decision schedule of a pool method's parameters on `decoder`."""
    if not isinstance(params, SpeculativeRejection):
        return NoDecisions()
    if params.schedule == "fixed":
        return FixedSchedule(params.every_k_tokens)
    return MemorySchedule(params.kv_space_candidates(), decoder.kv_bytes_per_token,
                          schedule_space(params, decoder.kv_space()))


def cut_value(values: Sequence[float], alpha: float) -> float:
    """q_alpha as an order statistic: the (floor(alpha * b) + 1)-th smallest of b values."""
    ordered = sorted(values)
    return ordered[min(int(math.floor(alpha * len(ordered))), len(ordered) - 1)]


def rejection_cut(scores: Sequence[float], finished: Sequence[float], alpha: float) -> list[int]:
    """One prompt's decision (paper 001, equations 4-5): the indices of the running candidates that continue.

    scores: partial rewards of the prompt's running candidates; finished: final rewards of its candidates that
    finished since the last decision. Both make up R_partial (eq. 3), of b values, and

        r_cut = q_alpha(R_partial)                                                 (eq. 4)
        candidate i continues  <=>  scores[i] >= r_cut                             (eq. 5)

    where q_alpha is the (floor(alpha * b) + 1)-th smallest of the b values (`cut_value`): floor(alpha * b) values
    fall strictly below it when there are no ties; ties at the cut continue; alpha = 0 keeps every running
    candidate. Finished candidates count in R_partial but are neither kept nor rejected (they have finished)."""
    if not scores:
        return []
    r_cut = cut_value(list(scores) + list(finished), alpha)
    return [i for i, s in enumerate(scores) if s >= r_cut]
