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
reaches a multiple of k tokens (a clock per prompt); `MemorySchedule` decides when the running sequences' KV cache
would pass the memory the pool has (paper 001's rule, the same on both engines: the decoder reports the KV bytes
after the next step and the KV space the pool is given).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from schemas.methods import SpeculativeRejection
from workers.pool.decoder import Decoder


class NoDecisions:
    """Best-of-N (and the single-response pools): never decide."""

    def due(self, decoder: Decoder) -> set[int]:
        return set()

    def rejected(self, count: int) -> None:
        pass

    def forget(self, group: int) -> None:
        pass

    def stats(self) -> dict:
        return {}


class FixedSchedule(NoDecisions):
    """A decision each time a prompt's longest running response reaches a multiple of k tokens; each prompt keeps
    its own clock, so a prompt's decisions do not depend on the prompts decoded beside it."""

    def __init__(self, k: int):
        self.k = k
        self.last: dict[int, int] = defaultdict(int)  # group -> its longest response at its last decision

    def due(self, decoder: Decoder) -> set[int]:
        out = set()
        for g, longest in decoder.lengths().items():
            if longest // self.k > self.last[g] // self.k:
                self.last[g] = longest
                out.add(g)
        return out

    def forget(self, group: int) -> None:
        self.last.pop(group, None)


class MemorySchedule(NoDecisions):
    """A decision for every running prompt when the running sequences' KV cache would grow past `budget_bytes` with
    the next step.

    After a round, decisions continue at each further step while the cache stays over the budget and the last round
    rejected someone; once a round can reject no one (alpha = 0, or pools too small to cut), the next decision
    waits until the cache has been back under the budget, so an uncuttable pool is not re-scored at every token.
    """

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.armed = True

    def due(self, decoder: Decoder) -> set[int]:
        if decoder.kv_bytes() <= self.budget:
            self.armed = True
            return set()
        if self.armed:
            self.armed = False
            return set(decoder.lengths())
        return set()

    def rejected(self, count: int) -> None:
        if count > 0:
            self.armed = True

    def stats(self) -> dict:
        return {"memory_budget_bytes": self.budget}


def memory_budget(params: SpeculativeRejection, kv_space: int | None) -> int:
    """The memory schedule's KV budget: the KV space the pool is given x memory_fraction, capped by
    memory_budget_mb when it is set (`kv_space` None: it could not be read)."""
    budget = math.inf if kv_space is None else kv_space * params.memory_fraction
    if params.memory_budget_mb is not None:
        budget = min(budget, params.memory_budget_mb * 2**20)
    if not math.isfinite(budget):
        raise ValueError("method.memory_budget_mb: the memory the pool has could not be read (the host's available "
                         "memory: /proc/meminfo, sysconf); set method.memory_budget_mb to give the memory schedule its "
                         "KV budget")
    return int(budget)


def schedule_for(params, decoder: Decoder) -> NoDecisions:
    """The decision schedule of a pool method's parameters on `decoder`."""
    if not isinstance(params, SpeculativeRejection):
        return NoDecisions()
    if params.schedule == "fixed":
        return FixedSchedule(params.every_k_tokens)
    return MemorySchedule(memory_budget(params, decoder.kv_space()))


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
