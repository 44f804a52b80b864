"""Reward scoring of partial and full responses.

Every scorer takes a list of `Scored` items (one response each, partial or finished) and returns one float per
item. The reward model usually has its own tokenizer and chat template, so a response is decoded to text with the
target tokenizer, then rendered as prompt + assistant turn with the reward tokenizer's template and tokenised again.
Model-based scoring is batched under a token budget (rows x padded length), shortest first.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from workers.cost import Meter
from workers.lexical import concept_coverage


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


class ModelReward:
    """An AutoModelForSequenceClassification with num_labels = 1: the scalar logit is the reward."""

    def __init__(self, model, tokenizer, batch_tokens: int, meter_role: str = "reward"):
        self.model, self.tok, self.batch_tokens = model, tokenizer, batch_tokens
        self.device = next(model.parameters()).device
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.role = meter_role

    def encode(self, item: Scored) -> list[int]:
        text = render(self.tok, item.prompt + [{"role": "assistant", "content": item.text}], False)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids[-self.max_len:]  # keep the response end when too long for the reward model

    @torch.inference_mode()
    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        encoded = [self.encode(it) for it in items]
        out = [0.0] * len(items)
        pad = self.tok.pad_token_id
        for batch in token_budget_batches([len(e) for e in encoded], self.batch_tokens):
            width = max(len(encoded[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, : len(encoded[i])] = torch.tensor(encoded[i])
                mask[r, : len(encoded[i])] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            scores = logits[:, 0].float().cpu()
            for r, i in enumerate(batch):
                out[i] = float(scores[r])
            groups = torch.tensor([items[i].group for i in batch])
            meter.count_forward(self.role, groups, mask.sum(-1))
        return out


class LogprobReward:
    """Mean token log-probability of the response under the target (temperature 1)."""

    def __init__(self, model, pad_id: int, batch_tokens: int):
        self.model, self.pad_id, self.batch_tokens = model, pad_id, batch_tokens
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        seqs = [it.prompt_ids + it.response_ids for it in items]
        out = [float("nan")] * len(items)
        for batch in token_budget_batches([len(s) for s in seqs], self.batch_tokens):
            width = max(len(seqs[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
                mask[r, : len(seqs[i])] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1)  # [b, W-1, V] predicts ids[:, 1:]
            tok_logp = logp.gather(-1, ids[:, 1:, None].to(self.device))[..., 0].cpu()  # [b, W-1]
            for r, i in enumerate(batch):
                p, n = len(items[i].prompt_ids), len(items[i].response_ids)
                out[i] = float(tok_logp[r, p - 1 : p - 1 + n].mean()) if n else float("-inf")
            meter.count_forward("reward", torch.tensor([items[i].group for i in batch]), mask.sum(-1))
        return out


class LexicalReward:
    """Fraction of the row's concepts the response covers (paper 000's CommonGen reward)."""

    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        out = []
        for it in items:
            if it.concepts is None:
                raise ValueError("lexical reward: this row has no concepts")
            out.append(concept_coverage(it.text, list(it.concepts)))
        return out


class PythonReward:
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
