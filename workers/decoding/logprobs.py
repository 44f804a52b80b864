"""Log-probabilities of responses under a causal LM, without a full-vocabulary log-softmax.

log p(token) is the chosen token's logit minus the log-sum-exp over the vocabulary. Taking the gather first and the
log-sum-exp a few positions at a time keeps the float32 working set at O(B x T) plus one chunk, where a
`log_softmax` over [B, T, V] would copy every logit (gigabytes at a 150k-token vocabulary). Sequences are left
padded, so every response ends at the last column and the model is asked only for the logits of the response
positions (`logits_to_keep`). Used by the `logprob` reward (`workers.scoring.scorers.LogprobScorer`) and by the
perplexity measure (`perplexities`).
"""

from __future__ import annotations

import math

import torch

from workers.decoding.batch import left_pad, position_ids

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
def response_logprobs(model: torch.nn.Module, pad_id: int, prompts: list[list[int]],
                      responses: list[list[int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One forward over prompt + response of each sequence: the log-probability of every response token given what
    precedes it (a CPU float32 tensor per sequence), and each sequence's real (unpadded) token count [B].

    Every response must be non-empty."""
    if any(not r for r in responses):
        raise ValueError("response_logprobs: every response must have at least one token")
    dev = next(model.parameters()).device
    ids, mask = left_pad([p + r for p, r in zip(prompts, responses)], pad_id, dev)  # [B, L]
    n_max = max(len(r) for r in responses)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                   logits_to_keep=n_max + 1).logits  # [B, n_max + 1, V]; column j predicts token L - n_max + j
    logp = token_logprobs(logits[:, :-1], ids[:, -n_max:]).cpu()  # [B, n_max]
    return [logp[i, n_max - len(r):] for i, r in enumerate(responses)], mask.sum(-1).cpu()


@torch.inference_mode()
def perplexities(model: torch.nn.Module, pad_id: int, prompts: list[list[int]], responses: list[list[int]],
                 batch_size: int = 16) -> list[float | None]:
    """Perplexity of each response given its prompt under `model` (temperature 1): exp of the mean negative
    log-likelihood of its tokens; None for an empty response."""
    out: list[float | None] = [None] * len(prompts)
    todo = [i for i, r in enumerate(responses) if r]
    for s in range(0, len(todo), batch_size):
        chunk = todo[s : s + batch_size]
        logps, _ = response_logprobs(model, pad_id, [prompts[i] for i in chunk], [responses[i] for i in chunk])
        for i, logp in zip(chunk, logps):
            out[i] = math.exp(-float(logp.double().mean()))
    return out
