"""Reward scoring of partial and full responses.

Every scorer takes a list of `Scored` items (one response each, partial or finished) and returns one float per
item. The reward model usually has its own tokenizer and chat template, so a response is decoded to text with the
target tokenizer, then rendered as prompt + assistant turn with the reward tokenizer's template and tokenised again.
Model-based scoring is batched under a token budget (rows x padded length), shortest first; a causal reward model
encodes the prompt its candidates share once (see RewardModelScorer).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from lexical import concept_coverage
from workers.cost import Meter
from workers.loading import context_length
from workers.logprobs import response_logprobs

log = logging.getLogger(__name__)


@dataclass
class Scored:
    group: int  # prompt index within the batch (for cost accounting)
    prompt: list[dict]  # chat messages
    text: str  # the response decoded with the target tokenizer, special tokens removed
    prompt_ids: list[int]  # the rendered prompt under the target tokenizer
    response_ids: list[int]  # the response tokens under the target tokenizer
    concepts: list[str] | None = None


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """Messages to text with the tokenizer's chat template, or their contents joined by newlines without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return "\n".join(m["content"] for m in messages)


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
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


class RewardModelScorer:
    """An AutoModelForSequenceClassification with num_labels = 1: the scalar logit is the reward.

    The candidates of one prompt share its rendered prompt, so with a causal reward model that takes a KV cache the
    shared leading tokens are encoded once per batch and their cache repeated across the candidates (the engine's
    trick, applied to scoring); only the responses are encoded row by row. A probe at load decides: the model's
    scores of two probe sequences with and without the shared cache must agree. Bidirectional encoders (BERT-like
    reward models) fail it, because their prompt tokens attend to the response, and are scored whole.
    """

    MIN_SHARED = 8  # shorter shared prefixes are not worth a separate prefill

    def __init__(self, model, tokenizer, batch_tokens: int, meter_role: str = "reward"):
        self.model, self.tok, self.batch_tokens = model, tokenizer, batch_tokens
        self.device = next(model.parameters()).device
        self.max_len = context_length(model)
        if self.max_len is None:
            log.warning("models.reward.path: the reward model's config has no max_position_embeddings, so reward "
                        "inputs are not cut to a context length")
        self.role = meter_role
        self.pad = self.tok.pad_token_id
        self.shares_prefix = prefix_sharing_is_exact(model, self.pad)
        log.info("reward model %s the shared prompt prefix", "caches" if self.shares_prefix else "does not cache")

    def encode(self, item: Scored) -> list[int]:
        """The item in the reward model's template as token ids, whole (it may be longer than the context)."""
        text = render(self.tok, item.prompt + [{"role": "assistant", "content": item.text}], False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        encoded = [self.encode(it) for it in items]
        over = [i for i, ids in enumerate(encoded) if self.max_len is not None and len(ids) > self.max_len]
        if over:  # keep the response's end, and count the cut per prompt (stats.reward_inputs_truncated)
            for i in over:
                encoded[i] = encoded[i][-self.max_len:]
            meter.count_truncated(torch.tensor([items[i].group for i in over]))
        out = [0.0] * len(items)
        whole: list[int] = []
        by_group: dict[int, list[int]] = defaultdict(list)
        for i, it in enumerate(items):
            by_group[it.group].append(i)
        for group, idx in by_group.items():
            shared = shared_prefix([encoded[i] for i in idx], self.pad) if self.shares_prefix and len(idx) > 1 else 0
            if shared < self.MIN_SHARED:
                whole += idx
                continue
            suffixes = [encoded[i][shared:] for i in idx]
            prefix = encoded[idx[0]][:shared]
            for batch in token_budget_batches([shared + len(s) for s in suffixes], self.batch_tokens):
                scores, lengths = score_with_prefix(self.model, self.pad, prefix, [suffixes[b] for b in batch],
                                                    self.device)
                meter.count_forward(self.role, torch.tensor([group]), torch.tensor([shared]))
                meter.count_forward(self.role, torch.full((len(batch),), group), lengths)
                for b, v in zip(batch, scores):
                    out[idx[b]] = v
        for batch in token_budget_batches([len(encoded[i]) for i in whole], self.batch_tokens):
            rows = [whole[b] for b in batch]
            ids, mask = right_padded([encoded[i] for i in rows], self.pad)
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, v in zip(rows, logits[:, 0].float().cpu().tolist()):
                out[i] = v
            meter.count_forward(self.role, torch.tensor([items[i].group for i in rows]), mask.sum(-1))
        return out


def score_with_prefix(model, pad_id: int, prefix: list[int], suffixes: list[list[int]],
                      device: torch.device) -> tuple[list[float], torch.Tensor]:
    """Scores of prefix + each suffix, the prefix encoded once and its cache repeated over the suffixes (right
    padded, so the head's rightmost-non-pad rule reads each suffix's last token); also each suffix's length."""
    cache = DynamicCache(config=model.config)
    pre = torch.tensor([prefix], dtype=torch.long, device=device)
    model(input_ids=pre, attention_mask=torch.ones_like(pre), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(len(suffixes))
    ids, mask = right_padded(suffixes, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    full = torch.cat([mask.new_ones(len(suffixes), len(prefix)), mask], dim=1)
    pos = len(prefix) + torch.arange(ids.shape[1], device=device).expand_as(ids)
    logits = model(input_ids=ids, attention_mask=full, position_ids=pos, past_key_values=cache, use_cache=True).logits
    return logits[:, 0].float().cpu().tolist(), mask.sum(-1).cpu()


@torch.inference_mode()
def prefix_sharing_is_exact(model, pad_id: int | None) -> bool:
    """Whether scoring with a shared prefix's cache gives the model's own scores: two probe sequences (fixed
    pseudo-random tokens, never the pad token) sharing 12 tokens, of unequal lengths, scored both ways."""
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    tokens = [t for t in torch.randint(0, vocab, (64,), generator=gen).tolist() if t != pad_id][:20]
    prefix, suffixes = tokens[:12], [tokens[12:16], tokens[16:18]]
    device = next(model.parameters()).device
    try:
        cached, _ = score_with_prefix(model, pad_id if pad_id is not None else 0, prefix, suffixes, device)
    except (TypeError, ValueError, RuntimeError, AttributeError) as err:  # no cache support in this architecture
        log.info("reward model cannot score with a cached prefix: %s", err)
        return False
    whole = [model(input_ids=torch.tensor([prefix + s], device=device)).logits[0, 0].float().item() for s in suffixes]
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2
    return all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(cached, whole))


class LogprobScorer:
    """Mean token log-probability of the response under the target (temperature 1); -inf for an empty response.

    Batched under a token budget; the log-probabilities come from `workers.logprobs` (no full-vocabulary
    log-softmax)."""

    def __init__(self, model, pad_id: int, batch_tokens: int):
        self.model, self.pad_id, self.batch_tokens = model, pad_id, batch_tokens

    @torch.inference_mode()
    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        out = [float("-inf")] * len(items)
        todo = [i for i, it in enumerate(items) if it.response_ids]
        lengths = [len(items[i].prompt_ids) + len(items[i].response_ids) for i in todo]
        for batch in token_budget_batches(lengths, self.batch_tokens):
            idx = [todo[b] for b in batch]
            logps, real = response_logprobs(self.model, self.pad_id, [items[i].prompt_ids for i in idx],
                                            [items[i].response_ids for i in idx])
            for i, logp in zip(idx, logps):
                out[i] = float(logp.double().mean())
            meter.count_forward("reward", torch.tensor([items[i].group for i in idx]), real)
        return out


class LexicalScorer:
    """Fraction of the row's concepts the response covers (paper 000's CommonGen reward)."""

    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        out = []
        for it in items:
            if it.concepts is None:
                raise ValueError("lexical reward: this row has no concepts")
            out.append(concept_coverage(it.text, list(it.concepts)))
        return out


class PythonScorer:
    """A user function `f(prompts, texts) -> list[float]` named as `module:function`."""

    def __init__(self, path: str):
        module, _, name = path.partition(":")
        try:
            self.fn: Callable = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"models.reward.function: cannot import {path!r}: {err}") from None
        self.path = path

    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        values = list(self.fn([it.prompt for it in items], [it.text for it in items]))
        if len(values) != len(items):
            raise RuntimeError(f"reward function {self.path} returned {len(values)} values for {len(items)} texts")
        out = [float(v) for v in values]
        if not all(math.isfinite(v) for v in out):
            raise RuntimeError(f"reward function {self.path} returned a non-finite value")
        return out
