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

from workers.engine import left_pad, position_ids
from lexical import covered
from workers.methods.common import Context, MethodResult, PromptInput


def constraint_stats(text: str, concepts: list[str] | None) -> dict:
    """{"hard_constraint", "soft_constraint"} of a response; empty when the prompt has no concepts."""
    if not concepts:
        return {}
    hits = covered(text, list(concepts))
    return {"hard_constraint": float(all(hits)), "soft_constraint": sum(hits) / len(hits)}


# Most float32 elements a log-sum-exp over the vocabulary works on at once (64 MiB).
LOGSUMEXP_ELEMENTS = 1 << 24


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) [B, T] from logits [B, T, V] (any dtype): the chosen token's logit minus the log-sum-exp over
    the vocabulary, in float32, a few positions at a time, so no [B, T, V] float32 copy is made."""
    b, t, v = logits.shape
    chosen = logits.gather(-1, tokens[..., None])[..., 0].float()  # [B, T]
    step = max(1, LOGSUMEXP_ELEMENTS // max(b * v, 1))
    lse = torch.cat([torch.logsumexp(logits[:, s : s + step].float(), -1) for s in range(0, t, step)], 1)  # [B, T]
    return chosen - lse


@torch.inference_mode()
def perplexities(model: torch.nn.Module, pad_id: int, prompts: list[list[int]], responses: list[list[int]],
                 batch_size: int = 16) -> list[float | None]:
    """Perplexity of each response given its prompt under `model` (temperature 1); None for an empty response.

    Sequences are left-padded, so every response ends at the last column: logits are kept only for the last
    (longest response + 1) positions, those that predict response tokens."""
    dev = next(model.parameters()).device
    out: list[float | None] = [None] * len(prompts)
    todo = [i for i, r in enumerate(responses) if r]
    for s in range(0, len(todo), batch_size):
        chunk = todo[s : s + batch_size]
        ids, mask = left_pad([prompts[i] + responses[i] for i in chunk], pad_id, dev)  # [b, L]
        n_max = max(len(responses[i]) for i in chunk)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=n_max + 1).logits  # [b, n_max+1, V]; column j predicts token L - n_max + j
        logp = token_logprobs(logits[:, :-1], ids[:, -n_max:])  # [b, n_max]
        for r, i in enumerate(chunk):
            n = len(responses[i])
            out[i] = math.exp(-float(logp[r, -n:].double().mean()))
    return out


def add_measures(ctx: Context, prompts: list[PromptInput], results: list[MethodResult]) -> None:
    """Add the constraint and perplexity stats of each prompt's returned candidate, in place."""
    best = [r.candidates[r.best_index] if r.best_index is not None else None for r in results]
    have = [i for i, c in enumerate(best) if c is not None]
    ppl = perplexities(ctx.target, ctx.pad_id, [prompts[i].ids for i in have], [best[i].tokens for i in have])
    for i, value in zip(have, ppl):
        results[i].stats["perplexity"] = value
        results[i].stats.update(constraint_stats(best[i].text, prompts[i].concepts))

