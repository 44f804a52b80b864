"""Best-of-N and Speculative Rejection (paper 001, Algorithm 1) on one candidate pool per prompt.

Several prompts share one batch; each prompt's candidates form its pool. Generation runs until a *decision
token*; there every running candidate gets a partial reward, candidates that finished since the last decision get
their final reward, and, per prompt, the running candidates whose partial reward is below

    r_cut = q_alpha(R_partial)                                                     (eq. 4)

stop (finish_reason "rejected"); the others continue (eq. 5). R_partial holds the rewards of every candidate that
was running at the start of the round, the finished ones included (their partial reward is their final one).
q_alpha is the lower alpha-quantile as an order statistic: the (floor(alpha * b) + 1)-th smallest of the b values,
so floor(alpha * b) candidates fall strictly below it when there are no ties; ties at the cut are kept, and
alpha = 0 keeps every candidate. The answer is the finished candidate with the highest final reward (eq. 6).

Best-of-N is the same pool with no decision tokens. Rejected rows leave the KV cache by row selection, so a
round costs the scoring and nothing more.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from workers.engine import Rows
from workers.methods.common import Candidate, Context, MethodResult, PromptInput, best_of, reward_stats
from workers.methods.samplers import make_sampler

# Dead (finished) rows leave the cache once they are at least 1/COMPACT_FRACTION of the batch.
COMPACT_FRACTION = 8


class NoDecisions:
    """Best-of-N: never decide."""

    def due(self, rows: Rows, sampler) -> bool:
        return False

    def rejected(self, count: int) -> None:
        pass


class FixedSchedule:
    """A decision each time the responses reach a multiple of k tokens."""

    def __init__(self, k: int):
        self.k = k
        self.last = 0

    def due(self, rows: Rows, sampler) -> bool:
        length = int(rows.length.max())
        if length // self.k > self.last // self.k:
            self.last = length
            return True
        return False

    def rejected(self, count: int) -> None:
        pass


class MemorySchedule:
    """A decision when the running rows' KV cache would grow past `budget_bytes` with the next step.

    The cache costs rows x columns x bytes-per-column (padding and holes included, since they are allocated).
    After a round, decisions continue at each further step while the cache stays over the budget and the last round
    rejected someone; once a round can reject no one (alpha = 0, or pools too small to cut), the next decision
    waits until the cache has been back under the budget, so an uncuttable pool is not re-scored at every token.
    """

    def __init__(self, budget_bytes: float):
        self.budget = budget_bytes
        self.armed = True

    def due(self, rows: Rows, sampler) -> bool:
        need = rows.size * (rows.kv_columns() + sampler.columns_per_step) * sampler.kv_bytes_per_column
        if need <= self.budget:
            self.armed = True
            return False
        if self.armed:
            self.armed = False
            return True
        return False

    def rejected(self, count: int) -> None:
        if count > 0:
            self.armed = True


def cut_value(values: list[float], alpha: float) -> float:
    """q_alpha as an order statistic: the (floor(alpha * b) + 1)-th smallest of b values."""
    ordered = sorted(values)
    return ordered[min(int(math.floor(alpha * len(ordered))), len(ordered) - 1)]


def memory_budget_bytes(method, device: torch.device) -> float:
    """The KV budget: method.memory_budget_mb, or on GPU the free memory x memory_fraction (the smaller of the two
    when both exist)."""
    budget = math.inf
    if method.memory_budget_mb is not None:
        budget = method.memory_budget_mb * 2**20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free * method.memory_fraction)
    if not math.isfinite(budget):
        raise ValueError("method.memory_budget_mb: required on CPU when schedule is 'memory'")
    return budget


@torch.inference_mode()
def run_pool(ctx: Context, prompts: list[PromptInput], n: int, alpha: float, schedule) -> list[MethodResult]:
    """Decode n candidates per prompt, with a rejection round at each decision token the schedule calls."""
    sampler = make_sampler(ctx)
    rows = sampler.prefill([p.ids for p in prompts], n, [p.key for p in prompts], [p.limit for p in prompts])
    pools: list[list[Candidate | None]] = [[None] * n for _ in prompts]
    partials: dict[tuple[int, int], list[float]] = defaultdict(list)  # (prompt, cand) -> partial rewards
    decisions: dict[int, list[int]] = defaultdict(list)  # prompt -> response length at each of its decisions
    unscored: list[tuple[int, int]] = []  # finished since the last decision, no final reward yet

    def live_rows() -> tuple[list[tuple[int, int]], list[list[int]]]:
        keys = list(zip(rows.group.tolist(), rows.cand.tolist()))
        tokens = [t[:k] for t, k in zip(rows.tokens.tolist(), rows.length.tolist())]
        return keys, tokens

    def harvest() -> None:
        """Move finished rows (EOS or length limit) into their pools; they leave the cache in bulk."""
        done = sampler.done(rows)
        if bool(done.any()):
            idx = done.nonzero().flatten()
            keys = zip(rows.group[idx].tolist(), rows.cand[idx].tolist())
            for (g, c), t, k in zip(keys, rows.tokens[idx].tolist(), rows.length[idx].tolist()):
                pools[g][c] = Candidate(t[:k], ctx.finish_reason(t[:k]))
                unscored.append((g, c))
            rows.alive &= ~done
        rows.compact(min_dead=max(1, rows.size // COMPACT_FRACTION))

    def decide() -> None:
        """One rejection round: partial rewards, the alpha-quantile cut per prompt, row selection."""
        rows.compact()
        live, tokens = live_rows()
        items = [ctx.scored(g, prompts[g], t) for (g, _), t in zip(live, tokens)]
        items += [ctx.scored(g, prompts[g], pools[g][c].tokens) for g, c in unscored]
        scores = ctx.score(items)
        live_scores = scores[: len(live)]
        for (g, c), s in zip(unscored, scores[len(live):]):
            pools[g][c].reward = s
        r_partial: dict[int, list[float]] = defaultdict(list)  # eq. 3, per prompt
        for (g, c), s, t in zip(live, live_scores, tokens):
            r_partial[g].append(s)
            partials[(g, c)].append(s)
        for g, c in unscored:
            r_partial[g].append(pools[g][c].reward)
        for g in {g for g, _ in live}:
            decisions[g].append(max(len(t) for (gg, _), t in zip(live, tokens) if gg == g))
        r_cut = {g: cut_value(v, alpha) for g, v in r_partial.items()}  # eq. 4
        keep = []
        for i, ((g, c), s) in enumerate(zip(live, live_scores)):
            if s >= r_cut[g]:  # eq. 5
                keep.append(i)
            else:
                pools[g][c] = Candidate(tokens[i], "rejected")
        schedule.rejected(len(live) - len(keep))
        unscored.clear()
        rows.select(torch.tensor(keep, dtype=torch.long, device=rows.pending.device))

    while True:
        harvest()
        if not bool(rows.alive.any()):
            break
        if schedule.due(rows, sampler):
            decide()
            if not bool(rows.alive.any()):
                break
        sampler.step(rows)

    if unscored:
        scores = ctx.score([ctx.scored(g, prompts[g], pools[g][c].tokens) for g, c in unscored])
        for (g, c), s in zip(unscored, scores):
            pools[g][c].reward = s

    results = []
    for g, pool in enumerate(pools):
        for c, cand in enumerate(pool):
            cand.text = ctx.decode(cand.tokens)
            cand.partial_rewards = partials.get((g, c), [])
        stats = {
            "generated_tokens": sum(len(c.tokens) for c in pool),
            "finished_candidates": sum(c.finish_reason != "rejected" for c in pool),
            "rejection_rounds": len(decisions[g]),
            "decision_tokens": decisions[g],
            **reward_stats(pool),
            **sampler.stats(g),
        }
        results.append(MethodResult(pool, best_of(pool), stats))  # eq. 6
    return results


def best_of_n(ctx: Context, prompts: list[PromptInput]) -> list[MethodResult]:
    return run_pool(ctx, prompts, ctx.config.method.n, 0.0, NoDecisions())


def speculative_rejection(ctx: Context, prompts: list[PromptInput]) -> list[MethodResult]:
    m = ctx.config.method
    if m.schedule == "fixed":
        schedule = FixedSchedule(m.every_k_tokens)
    else:
        schedule = MemorySchedule(memory_budget_bytes(m, next(ctx.target.parameters()).device))
    return run_pool(ctx, prompts, m.n, m.alpha, schedule)
