"""Quality measures added to every method's per-prompt stats, outside its cost (papers: docs/references.md).

- hard_constraint / soft_constraint (paper 000, section 4.3): whether the returned response covers every concept of
  the prompt (1.0 or 0.0), and the fraction it covers; only for prompts with concepts.
- perplexity (paper 002): exp of the mean negative log-likelihood of the returned response's tokens under the target
  at temperature 1, given the prompt (`workers.decoding.logprobs.perplexities`).
The Runner adds the constraint stats to every row. A candidate pool's perplexity comes from the log-probabilities
its decoder kept while sampling (`workers.pool`, on either engine: no forward); for the methods with a loop of their
own, `add_perplexities` runs a forward after the batch's costs are taken, recorded nowhere, so it changes neither
the method's tokens and calls nor its wall or device seconds.
"""

from __future__ import annotations

from lexical import covered
from workers.candidates import MethodResult, PromptInput
from workers.context import Context
from workers.decoding.logprobs import perplexities


def constraint_stats(text: str, concepts: list[str] | None) -> dict:
    """{"hard_constraint", "soft_constraint"} of a response; empty when the prompt has no concepts."""
    if not concepts:
        return {}
    hits = covered(text, list(concepts))
    return {"hard_constraint": float(all(hits)), "soft_constraint": sum(hits) / len(hits)}


def add_perplexities(ctx: Context, prompts: list[PromptInput], results: list[MethodResult]) -> None:
    """Add the perplexity of each prompt's returned candidate under the target, in place, by a forward, where the
    result has none (a candidate pool's comes from its decoding)."""
    best = [r.candidates[r.best_index] if r.best_index is not None else None for r in results]
    have = [i for i, c in enumerate(best) if c is not None and "perplexity" not in results[i].stats]
    ppl = perplexities(ctx.target, ctx.pad_id, [prompts[i].ids for i in have], [best[i].tokens for i in have])
    for i, value in zip(have, ppl):
        results[i].stats["perplexity"] = value


def add_measures(ctx: Context, prompts: list[PromptInput], results: list[MethodResult]) -> None:
    """Every quality measure of each prompt's returned candidate (perplexity and constraint stats), in place: what
    a row gets beside its method's own stats."""
    add_perplexities(ctx, prompts, results)
    for p, r in zip(prompts, results):
        if r.best_index is not None:
            r.stats.update(constraint_stats(r.candidates[r.best_index].text, p.concepts))
