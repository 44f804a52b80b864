"""A process reward model (`models.reward.kind: process`): every step of a response scored, the reward their aggregate.

A response is split into steps at `step_separator` (each step stripped, empty ones dropped; a response with no text is
one empty step) and rendered as the assistant turn of the PRM's chat template with `step_tag` after every step,
``step 1<tag>step 2<tag>``, as process reward models are trained and served (Qwen2.5-Math-PRM's ``<extra_0>``,
Math-Shepherd's `` ки``). The PRM's logits at each tag give the step's score: the softmax probability of `label`
(two labels or more) or the sigmoid of the logit (one label). The reward aggregates them: min, product, mean or last.

A partial response (Speculative Rejection's decisions) is scored the same way, its last, unfinished step as a step:
early rejection with a partial reward. A reward input longer than the PRM's context keeps its end, and with it the
tags of its last steps only (counted in stats.reward_inputs_truncated).

`ProcessRewardScorer` runs the PRM with transformers, and a causal one incrementally: a session keeps each candidate's
cache and its steps' scores between decisions, so a decision feeds the tokens generated since the last one
(the reward model's session, `workers.scoring.reward_session.CachedScoring`).
`workers.scoring.vllm_reward.VllmRewardScorer` serves it on a vLLM pooling
engine (token_classify) with the same `Steps`, every call scored whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.accounting.memory import device_free_bytes
from workers.accounting.work import Work
from workers.scoring.items import Scored, once_per_input, reward_inputs, right_padded, token_budget_batches
from workers.scoring.protocol import Scores
from workers.scoring.reward_model import RewardModelScorer


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
        return self.aggregated(self.step_scores(logits[at]))

    def step_scores(self, picked: torch.Tensor) -> list[float]:
        """The scores of steps from the PRM's logits at their tags [S, labels]: the softmax probability of `label`
        (two labels or more) or the sigmoid of the logit (one label), in float64."""
        picked = picked.double()
        scores = picked.softmax(-1)[:, self.label] if picked.shape[-1] > 1 else picked[:, 0].sigmoid()
        return scores.tolist()

    def aggregated(self, scores: list[float]) -> float:
        """The reward of a response from its steps' scores (min, product, mean or last)."""
        t = torch.tensor(scores, dtype=torch.float64)
        if self.aggregate == "min":
            return float(t.min())
        if self.aggregate == "product":
            return float(t.prod())
        if self.aggregate == "mean":
            return float(t.mean())
        return float(t[-1])

    def check_label(self, num_labels: int, field: str = "models.reward.label") -> None:
        top = max(num_labels - 1, 0)
        if self.label > top:
            hint = " (one label: set it to 0, the sigmoid of that logit)" if num_labels == 1 else ""
            raise ValueError(f"{field}: {self.label} is no label of the process reward model, which has "
                             f"{num_labels} (0 to {top}){hint}")

    def inputs(self, tokenizer, max_len: int | None, items: list[Scored], work) -> tuple[list[list[int]], list[int]]:
        """Every item's PRM input (cut to `max_len` as reward inputs are, recorded in the `Work` `work`) and its
        number of steps."""
        tagged = [self.tagged(it.text) for it in items]
        encoded, _ = reward_inputs(tokenizer, max_len, items, work, tagged)
        return encoded, [len(self.split(it.text)) for it in items]


def per_token_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, labels] logits at every token: a token classifier's own, or a sequence classifier's head (`score`)
    applied to every token's hidden state, as vLLM's token_classify does."""
    if type(model).__name__.endswith("ForSequenceClassification"):
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        return model.score(hidden)
    return model(input_ids=ids, attention_mask=mask).logits


class ProcessRewardScorer(RewardModelScorer):
    """A process reward model on transformers: whole scoring batched under the reward model's memory budget (capped
    by `batch_tokens`), and sessions that keep each candidate's PRM cache and its steps' scores between calls.

    A causal PRM reads a step's tag with the tokens before it only, so what a candidate held at its last decision
    keeps its steps' scores: a session (`session`, the reward model's `CachedScoring`) feeds the tokens since then
    (the last, unfinished step again from where its encoding changed, then the new steps and their tags) and reads
    the new tags; a row's state (`advance`) is the scores of the tags it holds, by position, and its last token's.
    Whether the model scores so exactly is what the reward model's load-time probes say (`incremental`), run here on
    tokens with tags among them and against the PRM's own whole scores (`whole_value`); a model that fails them is
    scored whole at every call."""

    def __init__(self, model, tokenizer, steps: Steps, batch_tokens: int | None, role: str = "reward", **switches):
        """`switches`: the sessions' switches of `RewardModelScorer` (incremental_sessions, levels, share_prompts)."""
        self.reads_hidden = type(model).__name__.endswith("ForSequenceClassification")
        if self.reads_hidden and not isinstance(getattr(model, "score", None), torch.nn.Module):
            raise ValueError(f"models.reward.path: {type(model).__name__} has no `score` head to read at every token; "
                             "give a token-classification checkpoint")
        steps.check_label(model.config.num_labels)
        self.steps = steps
        self.tag_id = steps.tag_id(tokenizer)
        super().__init__(model, tokenizer, batch_tokens, role, **switches)

    def encode_all(self, items: list[Scored], work: Work) -> tuple[list[list[int]], set[int]]:
        """Every item's PRM input, its steps tagged (`Steps.tagged`), cut to the context where longer."""
        return reward_inputs(self.tok, self.max_len, items, work, [self.steps.tagged(it.text) for it in items])

    def counts(self, items: list[Scored]) -> list[int]:
        """Each item's steps: the reward aggregates the scores of its last that many tags."""
        return [len(self.steps.split(it.text)) for it in items]

    @torch.inference_mode()
    def __call__(self, items: list[Scored]) -> Scores:
        work = Work()
        if not items:
            return Scores([], work)
        encoded, _ = self.encode_all(items, work)
        return Scores(self.score_encoded([it.group for it in items], encoded, work, self.counts(items)), work)

    def score_encoded(self, groups: list[int], encoded: list[list[int]], work: Work,
                      counts: list[int] | None = None) -> list[float]:
        """Rewards of whole inputs (`counts`: their steps), each read in full; a prompt's inputs alike once."""
        counts = counts if counts is not None else [len(ids) for ids in encoded]  # every tag
        return once_per_input([(g, tuple(ids), c) for g, ids, c in zip(groups, encoded, counts)],
                              lambda idx: self._whole([groups[i] for i in idx], [encoded[i] for i in idx],
                                                      [counts[i] for i in idx], work))

    def _whole(self, groups: list[int], encoded: list[list[int]], counts: list[int], work: Work) -> list[float]:
        out = [math.nan] * len(encoded)
        lengths = [len(e) for e in encoded]
        budget = self.tokens_budget(device_free_bytes(self.device), max(lengths))
        for batch in token_budget_batches(lengths, budget):
            ids, mask = right_padded([encoded[i] for i in batch], self.pad)
            logits = per_token_logits(self.model, ids.to(self.device), mask.to(self.device)).float().cpu()
            for row, i in enumerate(batch):
                out[i] = self.steps.reward(logits[row, : len(encoded[i])], encoded[i], self.tag_id, counts[i])
            work.forward(self.role, torch.tensor([groups[i] for i in batch]), mask.sum(-1))
        return out

    # -- a session's rows: the scores of the tags they hold --------------------------------------------------------
    def outputs(self, run) -> torch.Tensor:
        """Per-token logits [R, new, labels] of a forward's rows: a token classifier's own, or a sequence
        classifier's head applied to every token of its backbone's output (`per_token_logits`)."""
        if self.reads_hidden:
            return self.model.score(run(self.model.base_model).last_hidden_state).float().cpu()
        return run(self.model).logits.float().cpu()

    def advance(self, state, kept: int, fed: list[int], out: torch.Tensor):
        """A row's state, (its tags' scores by position, its last token's score): the tags among the first `kept`
        tokens keep theirs; the fed tokens' tags and the last token are read from `out`'s last len(fed) rows."""
        tags = tuple(t for t in (state[0] if state is not None else ()) if t[0] < kept)
        at = [j for j, t in enumerate(fed) if t == self.tag_id]
        off = out.shape[0] - len(fed)
        picked = self.steps.step_scores(out[[off + j for j in at] + [out.shape[0] - 1]])
        return tags + tuple(zip((kept + j for j in at), picked[:-1])), picked[-1]

    def value(self, state, count: int | None = None) -> float:
        """The reward: the scores of the last `count` tags (every tag where None) aggregated, or the last token's
        where it holds none (as `Steps.reward` reads an input whose tags were cut)."""
        scores = [s for _, s in state[0]]
        scores = scores[-count:] if count is not None else scores
        return self.steps.aggregated(scores or [state[1]])

    def probe_tokens(self, count: int) -> list[int]:
        """The reward model's probe tokens with the tag at every fourth."""
        return [self.tag_id if k % 4 == 3 else t for k, t in enumerate(super().probe_tokens(count))]

    def prefix_probe(self) -> bool:
        """False: whole scoring reads every input in full (`_whole`); only a session shares what rows hold alike."""
        return False

    def head_holds_no_score(self) -> bool:
        return self.tag_id not in self.template_head
