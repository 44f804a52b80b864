"""Quality measures added to every method's per-prompt stats, outside its cost (papers: docs/references.md).

- hard_constraint / soft_constraint (paper 000, section 4.3): whether the returned response covers every concept of
  the prompt (1.0 or 0.0), and the fraction it covers; only for prompts with concepts.
- perplexity (paper 002): exp of the mean negative log-likelihood of the returned response's tokens under the target
  at temperature 1, given the prompt.
The Runner adds them after it has taken the batch's costs, and their forward is not charged to the Meter, so they
change neither the method's tokens and calls nor its wall or device seconds.
"""

from __future__ import annotations

import math

import torch

from lexical import covered
from workers.logprobs import response_logprobs
from workers.methods.common import Context, MethodResult, PromptInput


def constraint_stats(text: str, concepts: list[str] | None) -> dict:
    """{"hard_constraint", "soft_constraint"} of a response; empty when the prompt has no concepts."""
    if not concepts:
        return {}
    hits = covered(text, list(concepts))
    return {"hard_constraint": float(all(hits)), "soft_constraint": sum(hits) / len(hits)}


@torch.inference_mode()
def perplexities(model: torch.nn.Module, pad_id: int, prompts: list[list[int]], responses: list[list[int]],
                 batch_size: int = 16) -> list[float | None]:
    """Perplexity of each response given its prompt under `model` (temperature 1); None for an empty response."""
    out: list[float | None] = [None] * len(prompts)
    todo = [i for i, r in enumerate(responses) if r]
    for s in range(0, len(todo), batch_size):
        chunk = todo[s : s + batch_size]
        logps, _ = response_logprobs(model, pad_id, [prompts[i] for i in chunk], [responses[i] for i in chunk])
        for i, logp in zip(chunk, logps):
            out[i] = math.exp(-float(logp.double().mean()))
    return out


def add_measures(ctx: Context, prompts: list[PromptInput], results: list[MethodResult]) -> None:
    """Add the constraint and perplexity stats of each prompt's returned candidate, in place."""
    best = [r.candidates[r.best_index] if r.best_index is not None else None for r in results]
    have = [i for i, c in enumerate(best) if c is not None]
    ppl = perplexities(ctx.target, ctx.pad_id, [prompts[i].ids for i in have], [best[i].tokens for i in have])
    for i, value in zip(have, ppl):
        results[i].stats["perplexity"] = value
        results[i].stats.update(constraint_stats(best[i].text, prompts[i].concepts))

