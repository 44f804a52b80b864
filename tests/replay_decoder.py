"""A deterministic decoder for the candidate pool (workers.pool.decoder.Decoder): every candidate's tokens are given
in advance and come one per step, so the pool's decisions, cuts and results can be checked without a model, and
the real decoders (hf, vllm) can be checked against a replay of their own tokens."""

from __future__ import annotations

from typing import Sequence

import torch

from workers.accounting.work import Work
from workers.candidates import PromptInput
from workers.pool.decoder import Key, Seq, StepOutput


class ReplayDecoder:
    """`streams[(prompt_id, cand)]`: the whole token list of each candidate (its EOS or its limit included). A
    started candidate holds its first token (as the hf engine's prefill samples it); each step adds the next; a
    candidate ends when its stream does. `space`: the pool's KV space, of `bytes_per_token` a token; `width`: most
sequences a step runs. Records one
    target forward per prompt and step, and its prompt's tokens at the start and a token per running sequence and
    step, in the output of its start or step."""

    def __init__(self, n: int, streams: dict[tuple[str, int], list[int]], bytes_per_token: int = 1,
                 space: int | None = None, width: int = 2**62):
        self.n, self.streams = n, streams
        self.kv_bytes_per_token, self.space = bytes_per_token, space
        self.width, self.joins = width, True
        self.prompts: dict[int, PromptInput] = {}
        self.live: dict[Key, list[int]] = {}
        self.done: list[Seq] = []
        self.dropped: list[Key] = []

    def stream(self, key: Key) -> list[int]:
        return self.streams[(self.prompts[key[0]].prompt_id, key[1])]

    def need(self, prompt: PromptInput, rows: int, kv_tokens: int | None = None) -> int:
        tokens = len(prompt.ids) + rows * prompt.limit
        return (tokens if kv_tokens is None else min(tokens, kv_tokens)) * self.kv_bytes_per_token

    def wait(self, groups: list[int], prompts: list[PromptInput]) -> None:
        pass

    def waiting_bytes(self) -> int:
        return 0

    def start(self, groups: list[int], prompts: list[PromptInput]) -> StepOutput:
        work = Work()
        self.prompts.update(zip(groups, prompts))
        for g, p in zip(groups, prompts):
            keys = [(g, c) for c in range(self.n)]
            for k in keys:
                self.live[k] = self.stream(k)[:1]
            work.forward("target", torch.tensor([g]), torch.tensor([len(p.ids) + self.n]))
        self._end()
        return StepOutput(self._finished(), work)

    def _end(self) -> None:
        for k in [k for k, t in self.live.items() if len(t) == len(self.stream(k))]:
            self.done.append(Seq(k, self.live.pop(k), None))

    def step(self) -> StepOutput:
        work = Work()
        keys = sorted(self.live)
        for k in keys:
            self.live[k] = self.stream(k)[: len(self.live[k]) + 1]
        if keys:
            work.forward("target", torch.tensor([g for g, _ in keys]), torch.ones(len(keys)))
        self._end()
        return StepOutput(self._finished(), work)

    def _finished(self) -> list[Seq]:
        out, self.done = sorted(self.done), []
        return out

    def running(self) -> list[Seq]:
        return [Seq(k, list(self.live[k]), None) for k in sorted(self.live)]

    def lengths(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for (g, _), t in sorted(self.live.items()):
            out.setdefault(g, []).append(len(t))
        return out

    def drop(self, keys: Sequence[Key]) -> Work:
        for k in keys:
            del self.live[k]
            self.dropped.append(k)
        return Work()

    def kv_space(self) -> int | None:
        return self.space

    def stats(self, group: int) -> dict:
        return {}

    def forget(self, group: int) -> None:
        self.prompts.pop(group, None)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.live.clear()


class ScriptedScorer:
    """A reward of the tests (`workers.scoring.protocol.Scorer`) from a function `fn(items, meter) -> floats` (its
    meter None: it runs no model, no reward tokens), every call scored afresh."""

    cuts_inputs = False
    session_kv_bytes_per_token = 0

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, items):
        from workers.scoring.protocol import Scores

        return Scores(self.fn(items, None), Work())

    def session(self):
        from workers.scoring.scorers import Rescoring

        return Rescoring(self)
