"""What an actor needs of an engine (`Engine`): the seam between the engines of `workers.engines` (hf: Winnow's own
on transformers; vllm: one vLLM engine per actor) and the actor's wiring (`workers.actor.runner.Runner`), so that
nothing outside an engine's own module asks which engine it is.

An engine holds the target (and the draft, on hf) on the actor's device, says what its tokenizer and stop tokens
are and how much memory a pool's sequences may take, makes a candidate pool's decoder
(`workers.pool.decoder.Decoder`), and runs the decoding loop (`workers.pool.loop.Loop.serve`) in the thread that may
step it.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from workers.candidates import PromptInput
from workers.context import Context
from workers.pool.decoder import Decoder
from workers.scoring.protocol import Scorer


class Engine(Protocol):
    name: str  # models.engine
    tokenizer: object  # the target's
    eos_ids: list[int]  # the tokenizer's EOS and the generation config's stop tokens
    pad_id: int
    context_length: int | None  # the target's context in tokens (None: its config has none)
    device: torch.device
    target: torch.nn.Module | None  # loaded in this process (None where the engine holds it, vLLM)
    draft: torch.nn.Module | None

    def start(self) -> None:
        """Build what runs the models, once, after the reward is loaded."""

    def serve(self, fn: Callable[[], None]) -> None:
        """Run a decoding loop's function in the thread that steps this engine."""

    def kv_space(self) -> int | None:
        """The bytes a pool's sequences may take now (None where it cannot be read): read when a pool's context is
        made (`Context.kv_space`)."""

    def decoder(self, ctx: Context, params) -> Decoder:
        """A candidate pool's decoder for a pool method's parameters (schemas.methods), with the context's memory."""

    def check(self, prompts: list[PromptInput], params, reward: Scorer | None = None) -> None:
        """Raise before a call when one of its prompts cannot run on this engine alone (its memory)."""

    def memory_chunks(self, prompts: list[PromptInput], params, reward: Scorer | None = None) -> list[list[int]]:
        """The prompts' indices in consecutive chunks that each fit in memory, for the methods with a loop of their
        own (beam, MJSD, CDSL, CDLH), which run on an engine that loads the models here."""

    def synchronize(self) -> None:
        """Wait for the device's queued work."""
