"""A process reward model (`models.reward.kind: process`): every step of a response scored, the reward their aggregate.

A response is split into steps at `step_separator` (each step stripped, empty ones dropped; a response with no text is
one empty step) and rendered as the assistant turn of the PRM's chat template with `step_tag` after every step,
``step 1<tag>step 2<tag>``, as process reward models are trained and served (Qwen2.5-Math-PRM's ``<extra_0>``,
Math-Shepherd's `` ки``). The PRM's logits at each tag give the step's score: the softmax probability of `label`
(two labels or more) or the sigmoid of the logit (one label). The reward aggregates them: min, product, mean or last.

A partial response (Speculative Rejection's decisions) is scored the same way, its last, unfinished step as a step:
early rejection with a partial reward. A reward input longer than the PRM's context keeps its end, and with it the
tags of its last steps only (counted in stats.reward_inputs_truncated).

`ProcessRewardScorer` runs the PRM with transformers; `workers.scoring.vllm_reward.VllmRewardScorer` serves it on a
vLLM pooling engine (token_classify) with the same `Steps`. Both score every call whole: no cache is kept between
calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.accounting.cost import Meter
from workers.decoding.kvcache import context_length
from workers.scoring.items import Scored, reward_inputs, right_padded, token_budget_batches
from workers.scoring.scorers import Rescoring


@dataclass(frozen=True)
class Steps:
    """How a response becomes steps and the PRM's per-token logits a reward (`models.reward` of kind process)."""

    separator: str
    tag: str
    label: int
    aggregate: str  # min | product | mean | last

    @classmethod
    def of(cls, reward) -> "Steps":
        return cls(reward.step_separator, reward.step_tag, reward.label, reward.aggregate)

    def split(self, text: str) -> list[str]:
        return [s for s in (part.strip() for part in text.split(self.separator)) if s] or [""]

    def tagged(self, text: str) -> str:
        """The response as the PRM reads it: every step followed by the tag."""
        return "".join(step + self.tag for step in self.split(text))

    def tag_id(self, tokenizer, field: str = "models.reward.step_tag") -> int:
        """The tag's token id: the one token the tag is on its own, or the vocabulary entry spelled as the tag (a
        SentencePiece tokenizer may add a word-start piece to it on its own), whichever a two-step response rendered
        with the PRM's template holds exactly twice. Any other tag is refused naming `field`."""
        unk = tokenizer.unk_token_id
        alone = tokenizer(self.tag, add_special_tokens=False)["input_ids"]
        spelled = tokenizer.convert_tokens_to_ids(self.tag)
        candidates = [i for i in ([alone[0]] if len(alone) == 1 else []) + [spelled] if i is not None and i != unk]
        probe = Scored(0, [{"role": "user", "content": "Add 2 and 3."}], "", [], [])
        seen = reward_inputs(tokenizer, None, [probe], None, [self.tagged(f"2 + 3{self.separator}= 5")])[0][0]
        for i in candidates:
            if seen.count(i) == 2:
                return i
        if not candidates and unk is not None and alone == [unk]:
            raise ValueError(f"{field}: {self.tag!r} is the unknown token of the process reward model's tokenizer, "
                             "which any unknown text also becomes; use a tag the tokenizer knows")
        if not candidates:
            raise ValueError(f"{field}: {self.tag!r} is {len(alone)} tokens of the process reward model's tokenizer "
                             f"({alone}); it must be one")
        raise ValueError(f"{field}: {self.tag!r} does not stay one token after a step in the process reward "
                         "model's chat template (it merges with the text beside it, or the template holds it too); "
                         "choose a tag its tokenizer keeps apart, such as a special token")

    def reward(self, logits: torch.Tensor, ids: list[int], tag_id: int, steps: int) -> float:
        """The reward of one input from its per-token logits [L, labels]: each of its last `steps` tags' scores
        aggregated (fewer where the input was cut; none left: the last token read as the one step)."""
        at = [i for i, t in enumerate(ids) if t == tag_id][-steps:] or [len(ids) - 1]
        picked = logits[at].double()
        scores = picked.softmax(-1)[:, self.label] if picked.shape[-1] > 1 else picked[:, 0].sigmoid()
        if self.aggregate == "min":
            return float(scores.min())
        if self.aggregate == "product":
            return float(scores.prod())
        if self.aggregate == "mean":
            return float(scores.mean())
        return float(scores[-1])

    def check_label(self, num_labels: int, field: str = "models.reward.label") -> None:
        top = max(num_labels - 1, 0)
        if self.label > top:
            hint = " (one label: set it to 0, the sigmoid of that logit)" if num_labels == 1 else ""
            raise ValueError(f"{field}: {self.label} is no label of the process reward model, which has "
                             f"{num_labels} (0 to {top}){hint}")

    def inputs(self, tokenizer, max_len: int | None, items: list[Scored], meter) -> tuple[list[list[int]], list[int]]:
        """Every item's PRM input (cut to `max_len` as reward inputs are) and its number of steps."""
        tagged = [self.tagged(it.text) for it in items]
        encoded, _ = reward_inputs(tokenizer, max_len, items, meter, tagged)
        return encoded, [len(self.split(it.text)) for it in items]


def per_token_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, labels] logits at every token: a token classifier's own, or a sequence classifier's head (`score`)
    applied to every token's hidden state, as vLLM's token_classify does."""
    if type(model).__name__.endswith("ForSequenceClassification"):
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        return model.score(hidden)
    return model(input_ids=ids, attention_mask=mask).logits


class ProcessRewardScorer:
    """A process reward model on transformers, batched under `batch_tokens` (rows x padded length)."""

    cuts_inputs = True  # an input longer than the PRM's context keeps its end
    session_kv_bytes_per_token = 0  # every call is scored whole

    def __init__(self, model, tokenizer, steps: Steps, batch_tokens: int, role: str = "reward"):
        if type(model).__name__.endswith("ForSequenceClassification") and not isinstance(
                getattr(model, "score", None), torch.nn.Module):
            raise ValueError(f"models.reward.path: {type(model).__name__} has no `score` head to read at every token; "
                             "give a token-classification checkpoint")
        self.model, self.tok, self.steps, self.batch_tokens, self.role = model, tokenizer, steps, batch_tokens, role
        steps.check_label(model.config.num_labels)
        self.tag_id = steps.tag_id(tokenizer)
        self.device = next(model.parameters()).device
        self.max_len = context_length(model.config)

    @torch.inference_mode()
    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        if not items:
            return []
        encoded, counts = self.steps.inputs(self.tok, self.max_len, items, meter)
        out = [math.nan] * len(items)
        for batch in token_budget_batches([len(e) for e in encoded], self.batch_tokens):
            ids, mask = right_padded([encoded[i] for i in batch], self.tok.pad_token_id)
            logits = per_token_logits(self.model, ids.to(self.device), mask.to(self.device)).float().cpu()
            for row, i in enumerate(batch):
                out[i] = self.steps.reward(logits[row, : len(encoded[i])], encoded[i], self.tag_id, counts[i])
            meter.count_forward(self.role, torch.tensor([items[i].group for i in batch]), mask.sum(-1))
        return out

    def session(self, meter: Meter) -> Rescoring:
        return Rescoring(lambda items: self(items, meter))
