"""What a scorer takes: a response (partial or finished) with its prompt, and the helpers that turn items into
batches of token ids.

The reward model usually has its own tokenizer and chat template, so a response is decoded to text with the target
tokenizer, then rendered as prompt + assistant turn with the reward tokenizer's template and tokenised again.
Model-based scoring is batched under a token budget (rows x padded length), shortest first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Hashable

import torch


@dataclass
class Scored:
    """One response to score, with its prompt. `logprob`: the target's log-probability of `response_ids` summed as
    they were sampled, where the engine kept it (the `logprob` reward reads it instead of a forward)."""

    group: int  # prompt index within the batch (for cost accounting)
    prompt: list[dict]  # chat messages
    text: str  # the response decoded with the target tokenizer, special tokens removed
    prompt_ids: list[int]  # the rendered prompt under the target tokenizer
    response_ids: list[int]  # the response tokens under the target tokenizer
    concepts: list[str] | None = None
    logprob: float | None = None
    row: dict | None = None  # the prompt's dataset columns the reward reads (its `columns`), where it names any


def once_per_input(inputs: list[Hashable], score: Callable[[list[int]], list]) -> list:
    """Scores of items whose `inputs` say which are alike (a prompt's candidates with the same response so far,
    common at the first decisions): `score(idx)` scores the first item of each input, and every item alike gets its
    value."""
    first: dict[Hashable, int] = {}
    for i, x in enumerate(inputs):
        first.setdefault(x, i)
    if len(first) == len(inputs):
        return score(list(range(len(inputs))))
    values = dict(zip(first, score(list(first.values()))))
    return [values[x] for x in inputs]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """Messages to text with the tokenizer's chat template, or their contents joined by newlines without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return "\n".join(m["content"] for m in messages)


def reward_text(tokenizer, item: Scored, response: str | None = None) -> str:
    """The item rendered in the reward model's template; the assistant turn is `response` where given (a process
    reward's tagged steps), else the item's text."""
    content = item.text if response is None else response
    return render(tokenizer, item.prompt + [{"role": "assistant", "content": content}], False)


def reward_input(tokenizer, item: Scored, response: str | None = None) -> list[int]:
    """The item in the reward model's template as token ids, whole (it may be longer than the context)."""
    return tokenizer(reward_text(tokenizer, item, response), add_special_tokens=False)["input_ids"]


def template_head(tokenizer) -> list[int]:
    """The leading token ids that the reward tokenizer's template gives every prompt (its opening tokens, a default
    system turn): the longest common prefix of the encodings of a few conversations with different contents. An
    encoding that starts with them may share their cache; one that does not is encoded whole."""
    encodings = [reward_input(tokenizer, Scored(0, [{"role": "user", "content": text}], text, [], []))
                 for text in ("", "0", "a b", "Zz.")]
    return encodings[0][: len(os.path.commonprefix(encodings))]


def reward_inputs(tokenizer, max_len: int | None, items: list[Scored], work,
                  responses: list[str] | None = None) -> tuple[list[list[int]], set[int]]:
    """Every item's reward input (`reward_input`, with `responses[i]` as its assistant turn where given), those
    longer than `max_len` cut to their last max_len tokens (the response's end) and recorded per prompt in `work`
    (a `Work`: stats.reward_inputs_truncated); also the indices of the cut ones."""
    texts = [reward_text(tokenizer, it, None if responses is None else responses[i]) for i, it in enumerate(items)]
    # one call of the tokenizer for them all (a fast tokenizer encodes a list in one batch): a scoring call's items
    # are many, and a call each cost a fifth more host time (2,048 tiny-trio items: 0.18 against 0.15 CPU s)
    encoded = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    over = {i for i, ids in enumerate(encoded) if max_len is not None and len(ids) > max_len}
    if over:
        for i in over:
            encoded[i] = encoded[i][-max_len:]
        work.truncated(torch.tensor([items[i].group for i in sorted(over)]))
    return encoded, over


def token_budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so that len(batch) x longest <= budget (a single over-long item forms its own batch)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def shared_prefix(seqs: list[list[int]], pad_id: int | None) -> int:
    """Leading tokens every sequence shares, short enough that each keeps its last non-pad token after them (the
    token a sequence-classification head reads)."""
    common = len(os.path.commonprefix(seqs))
    last_real = min(max((i for i, t in enumerate(s) if t != pad_id), default=0) for s in seqs)
    return min(common, last_real)


def right_padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists to right-padded ids [B, L] and mask [B, L]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


def last_real(ids: list[int], pad_id: int | None) -> int:
    """Index of the token a sequence-classification head reads: the last one that is not `pad_id` (transformers
    looks for the rightmost non-pad token of input_ids), 0 if there is none."""
    return max((i for i, t in enumerate(ids) if t != pad_id), default=0)
