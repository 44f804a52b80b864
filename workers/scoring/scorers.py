"""The scorers other than a reward model, and the session that scores every call afresh.

Every scorer takes a list of `Scored` items (one response each, partial or finished) and returns one float per item
with what it ran for them (`workers.scoring.protocol.Scores`): `LogprobScorer` (mean token log-probability under the
target), `LexicalScorer` (concept coverage), `PythonScorer` (a user function). The reward model is
`workers.scoring.reward_model`.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from lexical import concept_coverage
from workers.accounting.work import Work
from workers.decoding.logprobs import response_logprobs
from workers.scoring.items import Scored, once_per_input, token_budget_batches
from workers.scoring.protocol import Scores
from workers.verifiers.user_function import UserFunction


class Rescoring:
    """A session that scores every call afresh with `score(items) -> Scores` (scorers that keep no state). Items of
    a prompt with the same response tokens in a call (candidates alike at a first decision) are one input, scored
    once."""

    def __init__(self, score: Callable[[list[Scored]], Scores]):
        self._score = score

    def score(self, keys: Sequence[Hashable], items: list[Scored], final: Sequence[bool] | None = None) -> Scores:
        work = Work()
        if not items:
            return Scores([], work)

        def distinct(idx: list[int]) -> list:
            values, ran = self._score([items[i] for i in idx])
            work.add(ran)
            return values

        return Scores(once_per_input([(it.group, tuple(it.response_ids), it.text) for it in items], distinct), work)

    @torch.inference_mode()
    def release(self, keys: Sequence[Hashable]) -> None:
        pass


class LogprobScorer:
    """Mean token log-probability of the response under the target (temperature 1); -inf for an empty response
    (paper 001, section 5.3: s(Y) = ln p(Y|X) / len(Y)).

    An item whose log-probability the engine kept while sampling it (`Scored.logprob`: every candidate pool, on either
    engine) is scored from it, with no forward and no reward tokens. The others (the methods with a loop of their
    own, on the hf engine) are scored by a forward of the target, batched under a token budget; the
    log-probabilities come from `workers.decoding.logprobs` (no full-vocabulary log-softmax)."""

    cuts_inputs = False  # the target reads the whole response
    session_kv_bytes_per_token = 0

    def __init__(self, model, pad_id: int, batch_tokens: int):
        self.model, self.pad_id, self.batch_tokens = model, pad_id, batch_tokens

    def session(self) -> Rescoring:
        return Rescoring(self)

    @torch.inference_mode()
    def __call__(self, items: list[Scored]) -> Scores:
        work = Work()
        out = [float("-inf")] * len(items)
        for i, it in enumerate(items):
            if it.response_ids and it.logprob is not None:
                out[i] = it.logprob / len(it.response_ids)
        todo = [i for i, it in enumerate(items) if it.response_ids and it.logprob is None]
        if todo and self.model is None:
            raise RuntimeError("the logprob reward: an item without the log-probability its engine kept, and no "
                               "target loaded to score it (engine vllm)")
        lengths = [len(items[i].prompt_ids) + len(items[i].response_ids) for i in todo]
        for batch in token_budget_batches(lengths, self.batch_tokens):
            idx = [todo[b] for b in batch]
            logps, real = response_logprobs(self.model, self.pad_id, [items[i].prompt_ids for i in idx],
                                            [items[i].response_ids for i in idx])
            for i, logp in zip(idx, logps):
                out[i] = float(logp.double().mean())
            work.forward("reward", torch.tensor([items[i].group for i in idx]), real)
        return Scores(out, work)


class LexicalScorer:
    """Fraction of the row's concepts the response covers (paper 000's CommonGen reward)."""

    cuts_inputs = False
    session_kv_bytes_per_token = 0

    def session(self) -> Rescoring:
        return Rescoring(self)

    def __call__(self, items: list[Scored]) -> Scores:
        out = []
        for it in items:
            if it.concepts is None:
                raise ValueError("lexical reward: this row has no concepts")
            out.append(concept_coverage(it.text, list(it.concepts)))
        return Scores(out, Work())


class PythonScorer:
    """A user function `f(prompts, texts[, rows]) -> list[float]` named as `module:function`
    (`workers.verifiers.user_function`: what it is handed, and its time limit per call)."""

    cuts_inputs = False
    session_kv_bytes_per_token = 0

    def session(self) -> Rescoring:
        return Rescoring(self)

    def __init__(self, path: str, timeout_s: float = 120.0, columns: list[str] | None = None):
        self.fn = UserFunction(path, "models.reward.function", timeout_s, list(columns or []))
        self.path = path

    def __call__(self, items: list[Scored]) -> Scores:
        return Scores(self.fn.floats([it.prompt for it in items], [it.text for it in items],
                                     [it.row or {} for it in items]), Work())
