"""The loop of the draft/target methods that steer one response per prompt (MJSD, CDSL, CDLH): open a batch of one
sequence per prompt on the target (and the draft), step it until every sequence has finished, score and finish.
Every forward and scoring call of a run is recorded in one `Work` that the run hands back with its results, as a
candidate pool hands back its turns' work.

(Speculative decoding itself is a candidate pool of one candidate per prompt, sampled by the speculative sampler:
`workers.pool`, `workers.decoding.speculative.SpeculativeSampler`.)
"""

from __future__ import annotations

from typing import Callable

import torch

from workers.accounting.work import Work
from workers.candidates import Candidate, MethodResult, PromptInput
from workers.context import Context
from workers.decoding.speculative import DecodeTally, SpecBatch, open_batch


def eos_tensor(ctx: Context) -> torch.Tensor:
    return torch.tensor(sorted(set(ctx.eos_ids)), dtype=torch.long, device=next(ctx.target.parameters()).device)


def decode_batch(ctx: Context, prompts: list[PromptInput], draft, step: Callable
                 ) -> tuple[dict[int, list[int]], DecodeTally, Work]:
    """One response per prompt: open a batch of one sequence per prompt on the target (and `draft`, when given),
    then call `step(batch, tally, work, eos, kept)` until every sequence has finished; returns the responses, the
    tally and what ran (`work`, which the steps fill). `kept` holds the indices of the sequences the last harvest
    kept (None when none finished), for state a method keeps outside `batch`."""
    eos = eos_tensor(ctx)
    tally, work = DecodeTally(len(prompts)), Work()
    batch = open_batch(ctx.target, draft, [p.ids for p in prompts], [p.rng_key for p in prompts],
                     [p.limit for p in prompts], ctx.pad_id, work, tally)
    out: dict[int, list[int]] = {}
    while True:
        kept = harvest(batch, eos, out)
        if batch.size == 0:
            return out, tally, work
        step(batch, tally, work, eos, kept)


def harvest(batch: SpecBatch, eos: torch.Tensor, out: dict[int, list[int]]) -> torch.Tensor | None:
    """Record finished sequences (EOS pending, or at their limit) by group and drop them from both caches.

    Returns the indices of the sequences kept (for per-sequence state held outside `batch`), or None when none
    finished."""
    done = batch.alive & (torch.isin(batch.pending, eos) | (batch.length >= batch.limit))
    if not bool(done.any()):
        return None
    for i in done.nonzero().flatten().tolist():
        out[int(batch.group[i])] = batch.response(i)
    batch.alive &= ~done
    keep = batch.alive.nonzero().flatten()
    batch.select(keep)
    return keep


def score_sequences(ctx: Context, prompts: list[PromptInput], batch: SpecBatch, idx: torch.Tensor, ext: torch.Tensor,
                    ext_len: torch.Tensor, work: Work) -> torch.Tensor:
    """Rewards [R] of each sequence idx[r]'s response followed by ext[r, :ext_len[r]] (float64); what scoring ran
    goes to `work`."""
    items = []
    for r, i in enumerate(idx.tolist()):
        g = int(batch.group[i])
        items.append(ctx.scored(g, prompts[g], batch.response(i) + ext[r, : int(ext_len[r])].tolist()))
    values, ran = ctx.score(items)
    work.add(ran)
    if any(v is None for v in values):
        raise ValueError("models.reward: required by this method, which steers decoding by reward")
    return torch.tensor(values, dtype=torch.float64, device=idx.device)


def finish(ctx: Context, prompts: list[PromptInput], out: dict[int, list[int]], tally: DecodeTally, work: Work,
           speculative: bool = True) -> tuple[list[MethodResult], Work]:
    """One result per prompt from its response: scored when a reward is configured, with the tally's stats; and
    the run's work, the final scoring added."""
    cands = [Candidate(out[g], ctx.finish_reason(out[g])) for g in range(len(prompts))]
    rewards, ran = ctx.score([ctx.scored(g, p, c.tokens) for g, (p, c) in enumerate(zip(prompts, cands))])
    work.add(ran)
    results = []
    for g, (c, r) in enumerate(zip(cands, rewards)):
        c.text, c.reward = ctx.decode(c.tokens), r
        stats = {"generated_tokens": len(c.tokens), "finished_candidates": 1, **tally.stats(g, speculative)}
        results.append(MethodResult([c], 0, stats))
    return results, work
