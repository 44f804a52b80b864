"""Best-of-N and Speculative Rejection (paper 001, Algorithm 1; docs/references.md) on one candidate pool per
prompt.

Several prompts share one batch; each prompt's candidates form its pool. Generation runs until a *decision
token*; there every running candidate gets a partial reward, candidates that finished since the last decision get
their final reward, and, per prompt, the running candidates whose partial reward is below

    r_cut = q_alpha(R_partial)                                                     (eq. 4)

stop (finish_reason "rejected"); the others continue (eq. 5). R_partial holds the partial rewards of the running
candidates and the final rewards of those that finished since the last decision. q_alpha is the lower
alpha-quantile as an order statistic: the (floor(alpha * b) + 1)-th smallest of the b values, so floor(alpha * b)
candidates fall strictly below it when there are no ties; ties at the cut are kept, and alpha = 0 keeps every
candidate. The cut itself is the pure function `rejection_cut`. The answer is the finished candidate with the
highest final reward (eq. 6).

Best-of-N is the same pool with no decision tokens. Rejected sequences leave the KV cache by selection
(`Batch.select`), so a round costs the scoring and nothing more; and the scoring goes through one reward session
per pool (`Context.reward_session`), which with a causal reward model keeps each running candidate's reward-model
cache from one decision to the next, so a decision feeds the reward model the tokens generated since the last one
(plus the template's end-of-turn tokens), not every response whole. A method is a `PoolPlan` (its n, alpha, schedule and
sampler); `run_plan` turns `pool_step` (admit, harvest, decide, step: plain functions of a `Pool`) until the pool is
empty, then makes each prompt's result (`prompt_result`). `workers.feed` turns the same steps for a pool that prompts
join over many actor calls (`add_prompts`, `complete_prompts`, `forget_prompt`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from schemas.methods import BestOfN, SpeculativeRejection
from workers.engine import Batch
from workers.memory import host_available_bytes
from workers.methods.common import Candidate, Context, MethodResult, PromptInput, best_of, reward_stats
from workers.methods.samplers import pool_sampler

# Dead (finished) sequences leave the cache once they are at least 1/COMPACT_FRACTION of the batch.
COMPACT_FRACTION = 8


def batch_groups(batch: Batch) -> set[int]:
    return set(batch.group.tolist())


class NoDecisions:
    """Best-of-N: never decide."""

    def due(self, batch: Batch, sampler) -> set[int]:
        return set()

    def rejected(self, count: int) -> None:
        pass


class FixedSchedule:
    """A decision each time a prompt's responses reach a multiple of k tokens. A prompt that joined the batch while
    it decoded (continuous batching) keeps its own clock; where prompts start together (a sampler that does not
    admit prompts mid-decode), one clock, the batch's longest response, times them all."""

    def __init__(self, k: int):
        self.k = k
        self.last: dict[int, int] = defaultdict(int)  # prompt (or -1: the whole batch) -> length at its last decision

    def due(self, batch: Batch, sampler) -> set[int]:
        if not getattr(sampler, "admits", False):
            length = int(batch.length.max())
            if length // self.k > self.last[-1] // self.k:
                self.last[-1] = length
                return batch_groups(batch)
            return set()
        groups, where = torch.unique(batch.group, return_inverse=True)
        longest = torch.zeros(len(groups), dtype=torch.long, device=batch.length.device)
        longest.scatter_reduce_(0, where, batch.length, reduce="amax")
        out = set()
        for g, length in zip(groups.tolist(), longest.tolist()):
            if length // self.k > self.last[g] // self.k:
                self.last[g] = length
                out.add(g)
        return out

    def rejected(self, count: int) -> None:
        pass

    def forget(self, group: int) -> None:
        self.last.pop(group, None)


class MemorySchedule:
    """A decision when the running sequences' KV cache would grow past `budget_bytes` with the next step.

    The cache costs sequences x columns x bytes-per-column (padding and holes included, since they are allocated).
    After a round, decisions continue at each further step while the cache stays over the budget and the last round
    rejected someone; once a round can reject no one (alpha = 0, or pools too small to cut), the next decision
    waits until the cache has been back under the budget, so an uncuttable pool is not re-scored at every token.
    """

    def __init__(self, budget_bytes: float):
        self.budget = budget_bytes
        self.armed = True

    def due(self, batch: Batch, sampler) -> set[int]:
        need = batch.size * (batch.kv_columns() + sampler.columns_per_step) * sampler.kv_bytes_per_column
        if need <= self.budget:
            self.armed = True
            return set()
        if self.armed:
            self.armed = False
            return batch_groups(batch)
        return set()

    def rejected(self, count: int) -> None:
        if count > 0:
            self.armed = True


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


def memory_budget_bytes(params: SpeculativeRejection, device: torch.device) -> int:
    """The KV budget of the memory schedule: the free memory of the device (on CUDA, torch.cuda.mem_get_info; on
    CPU, the host's available memory) x memory_fraction, capped by memory_budget_mb when it is set."""
    if device.type == "cuda":
        free: int | None = torch.cuda.mem_get_info(device)[0]
    else:
        free = host_available_bytes()
    budget = math.inf if free is None else free * params.memory_fraction
    if params.memory_budget_mb is not None:
        budget = min(budget, params.memory_budget_mb * 2**20)
    if not math.isfinite(budget):
        raise ValueError("method.memory_budget_mb: the host's available memory could not be read (/proc/meminfo, "
                         "sysconf); set method.memory_budget_mb to give the memory schedule its KV budget")
    return int(budget)


# ---------------------------------------------------------------------------------------------------------------
# The candidate pools of one batch of prompts, while they decode


@dataclass
class Pool:
    """Every prompt's candidate pool while a batch decodes: the running sequences are in `batch` (the sampler's),
    the finished and rejected candidates in `pools`."""

    prompts: list[PromptInput]
    sampler: object  # workers.engine.Engine or workers.speculative.SpeculativeEngine
    batch: Batch | None  # None until the first prompts start
    pools: list[list[Candidate | None]]  # [prompt][cand]; None while the candidate runs
    waiting: list[int] = field(default_factory=list)  # prompts not started yet, in order
    partials: dict[tuple[int, int], list[float]] = field(default_factory=lambda: defaultdict(list))  # (prompt, cand)
    decisions: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # prompt -> response lengths
    unscored: list[tuple[int, int]] = field(default_factory=list)  # finished since the last decision, no reward yet
    scoring: object = None  # the reward session (Context.reward_session), made at the first scoring: it keeps each
    # running candidate's reward-model cache from one decision to the next
    n: int = 0  # candidates per prompt

    @property
    def running(self) -> bool:
        return self.batch is not None and bool(self.batch.alive.any())


@dataclass
class Admission:
    """Continuous batching inside an actor: a pool's prompts join its batch while it decodes, in order, as long as
    the memory their sequences may take at their peak (`need(prompt)`, bytes) fits in `budget` beside the running
    prompts (each charged its need x its running candidates / n). A prompt always starts when nothing runs."""

    budget: int
    need: Callable[[PromptInput], int]


def open_pool(prompts: list[PromptInput], n: int, sampler) -> Pool:
    """A pool whose prompts all wait; `admit` starts them."""
    return Pool(list(prompts), sampler, None, [[None] * n for _ in prompts], waiting=list(range(len(prompts))), n=n)


def admit(ctx: Context, pool: Pool, n: int) -> None:
    """Start waiting prompts: prefill each once and start its n candidates. Without an admission policy (or with a
    sampler that cannot join prompts to a decoding batch) every prompt starts at once; with one (`Admission`), the
    next prompts start as the running ones leave room, joining the batch (`Batch.extend`)."""
    if not pool.waiting:
        return
    policy = ctx.admission if getattr(pool.sampler, "admits", False) else None
    b = pool.batch
    if policy is None:
        if b is not None:
            return
        take = list(pool.waiting)
    else:
        used = 0.0
        if b is not None and b.size:
            groups, running = torch.unique(b.group[b.alive], return_counts=True)
            used = sum(policy.need(pool.prompts[g]) * r / n for g, r in zip(groups.tolist(), running.tolist()))
        take = []
        for g in pool.waiting:
            need = policy.need(pool.prompts[g])
            if (used or take) and used + need > policy.budget:
                break
            take.append(g)
            used += need
    if not take:
        return
    del pool.waiting[: len(take)]
    ps = [pool.prompts[g] for g in take]
    kw = {"first_group": take[0]} if take[0] else {}
    new = pool.sampler.prefill([p.ids for p in ps], n, [p.key for p in ps], [p.limit for p in ps], **kw)
    if b is None or not b.size:
        pool.batch = new
    else:
        b.extend(new, ctx.pad_id)


def running_candidates(pool: Pool) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """(prompt, cand) and the tokens so far of each sequence of the batch, in batch order."""
    b = pool.batch
    keys = list(zip(b.group.tolist(), b.cand.tolist()))
    tokens = [t[:k] for t, k in zip(b.tokens.tolist(), b.length.tolist())]
    return keys, tokens


def harvest(ctx: Context, pool: Pool) -> None:
    """Move finished sequences (EOS or length limit) into their pools; they leave the cache in bulk."""
    b = pool.batch
    done = pool.sampler.done(b)
    if bool(done.any()):
        idx = done.nonzero().flatten()
        keys = zip(b.group[idx].tolist(), b.cand[idx].tolist())
        for (g, c), t, k in zip(keys, b.tokens[idx].tolist(), b.length[idx].tolist()):
            pool.pools[g][c] = Candidate(t[:k], ctx.finish_reason(t[:k]))
            pool.unscored.append((g, c))
        b.alive &= ~done
    b.compact(min_dead=max(1, b.size // COMPACT_FRACTION))


def reward_session(ctx: Context, pool: Pool):
    if pool.scoring is None:
        pool.scoring = ctx.reward_session()
    return pool.scoring


def score_finished(ctx: Context, pool: Pool, live: Sequence[tuple[tuple[int, int], list[int]]] = (),
                   done: list[tuple[int, int]] | None = None) -> list[float | None]:
    """Give the finished candidates `done` their final reward, scoring the running candidates `live` ((prompt,
    cand) and tokens so far) in the same call; returns the partial rewards of `live`. Without `done` (the end of
    the pool): every candidate finished since the last decision, which then leave the reward session here (a
    decision's leave with its rejected, `decide`)."""
    session = reward_session(ctx, pool)
    final = done is None
    done = list(pool.unscored) if done is None else done
    items = [ctx.scored(g, pool.prompts[g], t) for (g, _), t in live]
    items += [ctx.scored(g, pool.prompts[g], pool.pools[g][c].tokens) for g, c in done]
    scores = session.score([k for k, _ in live] + done, items, [False] * len(live) + [True] * len(done))
    for (g, c), s in zip(done, scores[len(live):]):
        pool.pools[g][c].reward = s
    if final:
        session.release(done)
    return scores[: len(live)]


def decide(ctx: Context, pool: Pool, alpha: float, groups: set[int]) -> int:
    """One rejection round for prompts `groups`: partial rewards of their running candidates, final rewards of
    their candidates finished since their last round, `rejection_cut` per prompt, and sequence selection (the
    other prompts' sequences all stay). The rejected and the finished candidates leave the reward session
    together. Returns the number of candidates rejected."""
    pool.batch.compact()
    every, all_tokens = running_candidates(pool)
    rows = [i for i, (g, _) in enumerate(every) if g in groups]  # the batch's sequences this round decides on
    live, tokens = [every[i] for i in rows], [all_tokens[i] for i in rows]
    finished: dict[int, list[float]] = defaultdict(list)
    done = [k for k in pool.unscored if k[0] in groups]
    pool.unscored = [k for k in pool.unscored if k[0] not in groups]
    scores = score_finished(ctx, pool, list(zip(live, tokens)), done)
    for g, c in done:
        finished[g].append(pool.pools[g][c].reward)
    seqs_of: dict[int, list[int]] = defaultdict(list)  # prompt -> its sequences' indices in the batch
    for i, ((g, c), s) in enumerate(zip(live, scores)):
        pool.partials[(g, c)].append(s)
        seqs_of[g].append(i)
    keep: list[int] = []
    for g, seqs in seqs_of.items():
        pool.decisions[g].append(max(len(tokens[i]) for i in seqs))
        keep += [seqs[k] for k in rejection_cut([scores[i] for i in seqs], finished[g], alpha)]
    kept = set(keep)
    rejected = [i for i in range(len(live)) if i not in kept]
    for i in rejected:
        g, c = live[i]
        pool.pools[g][c] = Candidate(tokens[i], "rejected")
    pool.scoring.release(done + [live[i] for i in rejected])
    gone = {rows[i] for i in rejected}
    stay = [i for i in range(len(every)) if i not in gone]
    pool.batch.select(torch.tensor(stay, dtype=torch.long, device=pool.batch.pending.device))
    return len(rejected)


def prompt_result(ctx: Context, pool: Pool, g: int) -> MethodResult:
    """Prompt g's candidates (decoded), its answer (eq. 6: the finished one with the highest reward), stats."""
    cands = pool.pools[g]
    for c, cand in enumerate(cands):
        cand.text = ctx.decode(cand.tokens)
        cand.partial_rewards = pool.partials.get((g, c), [])
    stats = {
        "generated_tokens": sum(len(c.tokens) for c in cands),
        "finished_candidates": sum(c.finish_reason != "rejected" for c in cands),
        "rejection_rounds": len(pool.decisions[g]),
        "decision_tokens": pool.decisions[g],
        **reward_stats(cands),
        **pool.sampler.stats(g),
    }
    return MethodResult(cands, best_of(cands), stats)  # eq. 6


@dataclass
class PoolPlan:
    """How a candidate-pool method decodes: its context (with the warp it samples with), n candidates per prompt,
    the rejection quantile alpha and the schedule of decision tokens, its sampler, and what it adds to each
    prompt's result at the end (`finish`)."""

    ctx: Context
    n: int
    alpha: float
    schedule: object  # NoDecisions | FixedSchedule | MemorySchedule
    sampler: object  # workers.engine.Engine or workers.speculative.SpeculativeEngine
    finish: Callable[[MethodResult], None] | None = None

    def result(self, pool: Pool, g: int) -> MethodResult:
        r = prompt_result(self.ctx, pool, g)
        if self.finish is not None:
            self.finish(r)
        return r

    def forget(self, pool: Pool, g: int) -> None:
        """Drop what the pool and the schedule hold of prompt g once its row is made (`forget_prompt`)."""
        forget_prompt(pool, g)
        drop = getattr(self.schedule, "forget", None)
        if drop is not None:
            drop(g)


def pool_step(pool: Pool, plan: PoolPlan) -> bool:
    """One turn of the decoding loop: start the waiting prompts that fit, harvest finished sequences, a rejection
    round where the schedule calls one, and one sampling step. Returns False once nothing runs or waits."""
    ctx = plan.ctx
    admit(ctx, pool, plan.n)  # before the harvest: a fresh candidate's first token may already end it
    if pool.batch is None:
        return bool(pool.waiting)
    harvest(ctx, pool)
    if not pool.running:
        return bool(pool.waiting)
    due = plan.schedule.due(pool.batch, pool.sampler)
    if due:
        plan.schedule.rejected(decide(ctx, pool, plan.alpha, due))
        if not pool.running:
            return True
    pool.sampler.step(pool.batch)
    return True


@torch.inference_mode()
def run_plan(plan: PoolPlan, prompts: list[PromptInput]) -> list[MethodResult]:
    """Decode n candidates per prompt, with a rejection round at each decision token the schedule calls."""
    pool = open_pool(prompts, plan.n, plan.sampler)
    while pool_step(pool, plan):
        pass
    if pool.unscored:
        score_finished(plan.ctx, pool)
    return [plan.result(pool, g) for g in range(len(prompts))]


def run_pool(ctx: Context, prompts: list[PromptInput], n: int, alpha: float, schedule, sampler) -> list[MethodResult]:
    """Decode n candidates per prompt with `sampler`, with a rejection round at each decision token the schedule
    calls."""
    return run_plan(PoolPlan(ctx, n, alpha, schedule, sampler), prompts)


# ---------------------------------------------------------------------------------------------------------------
# A pool that prompts join while it decodes, over many actor calls (workers.feed)


def add_prompts(pool: Pool, prompts: list[PromptInput]) -> list[int]:
    """Append prompts to a pool, decoding or not; they wait for `admit`. Returns their numbers (groups)."""
    first = len(pool.prompts)
    pool.prompts.extend(prompts)
    pool.pools.extend([None] * pool.n for _ in prompts)
    groups = list(range(first, first + len(prompts)))
    pool.waiting.extend(groups)
    return groups


def complete_prompts(ctx: Context, pool: Pool, groups: set[int]) -> list[int]:
    """The prompts among `groups` whose every candidate has ended, with their final rewards given (one scoring
    call for all of them; their candidates leave the reward session)."""
    ended = [g for g in sorted(groups) if all(c is not None for c in pool.pools[g])]
    mine = set(ended)
    done = [k for k in pool.unscored if k[0] in mine]
    if done:
        pool.unscored = [k for k in pool.unscored if k[0] not in mine]
        score_finished(ctx, pool, (), done)
        pool.scoring.release(done)
    return ended


def forget_prompt(pool: Pool, g: int) -> None:
    """Drop what the pool holds of prompt g once its row is made: a long-lived pool keeps only its numbering."""
    pool.prompts[g] = None
    pool.pools[g] = None
    for c in range(pool.n):
        pool.partials.pop((g, c), None)
    pool.decisions.pop(g, None)


def best_of_n_plan(ctx: Context, params: BestOfN) -> PoolPlan:
    return PoolPlan(ctx, params.n, 0.0, NoDecisions(), pool_sampler(ctx))


def speculative_rejection_plan(ctx: Context, params: SpeculativeRejection) -> PoolPlan:
    if params.schedule == "fixed":
        return PoolPlan(ctx, params.n, params.alpha, FixedSchedule(params.every_k_tokens), pool_sampler(ctx))
    budget = memory_budget_bytes(params, next(ctx.target.parameters()).device)

    def finish(r: MethodResult) -> None:
        r.stats["memory_budget_bytes"] = budget

    return PoolPlan(ctx, params.n, params.alpha, MemorySchedule(budget), pool_sampler(ctx), finish)


def best_of_n(ctx: Context, params: BestOfN, prompts: list[PromptInput]) -> list[MethodResult]:
    return run_plan(best_of_n_plan(ctx, params), prompts)


def speculative_rejection(ctx: Context, params: SpeculativeRejection, prompts: list[PromptInput]) -> list[MethodResult]:
    return run_plan(speculative_rejection_plan(ctx, params), prompts)
