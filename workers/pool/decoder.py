"""What the candidate pool needs of an engine: the `Decoder` protocol, and the names it uses.

A decoder holds the running sequences of one pool on one engine. The pool (`workers.pool.pool`) starts prompts'
candidates on it, steps it, takes the sequences that ended, scores the running ones at decision tokens and drops the
rejected; the decoder knows only its sequences, not rewards, schedules or rows. Two implement it:
`workers.engines.hf.HfDecoder` (Winnow's own engine: a `Batch` decoded by the target or the speculative sampler,
rejected sequences dropped by selection) and `workers.engines.vllm.VllmDecoder` (one vLLM request per candidate,
rejected ones aborted).

A sequence is named by its *key* (group, cand): *group* is its prompt's number in the pool (numbers grow as prompts
join a pool and are never reused), *cand* its index among the prompt's n candidates. A sequence's *tokens* are its
response so far (every token sampled for it).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from workers.candidates import PromptInput

Key = tuple[int, int]  # (group, cand)


class Decoder(Protocol):
    def admit(self, waiting: Sequence[PromptInput]) -> int:
        """How many of the waiting prompts (in order) may start now: as many as the room left holds, and at least
        one when nothing runs."""

    def start(self, groups: list[int], prompts: list[PromptInput]) -> None:
        """Start n candidates of each prompt, numbered `groups` (consecutive). A candidate may end at its first
        token; it is reported by the next `ended`."""

    def step(self) -> None:
        """One decoding step of every running sequence."""

    def ended(self) -> list[tuple[Key, list[int]]]:
        """The sequences that finished (EOS, or their token limit) since the last call, with their tokens; they no
        longer run."""

    def running(self) -> tuple[list[Key], list[list[int]]]:
        """Every running sequence's key and tokens, in a fixed order."""

    def lengths(self) -> dict[int, int]:
        """Each group with running sequences: its longest running response, in tokens."""

    def drop(self, keys: Sequence[Key]) -> None:
        """Stop running sequences (rejected ones): they generate nothing more and their KV cache is freed."""

    def kv_bytes(self) -> int:
        """KV-cache bytes the running sequences will hold after the next step."""

    def kv_space(self) -> int | None:
        """KV-cache bytes this pool is given (None where they cannot be read)."""

    def stats(self, group: int) -> dict:
        """The sampler's own measures of a prompt (acceptance of the speculative sampler), or {}."""

    def forget(self, group: int) -> None:
        """Drop what is held for a prompt whose candidates have all ended and whose row is made."""

    def measure(self, requests: list[tuple[object, list[int], list[int]]]) -> None:
        """Ask for the perplexity under the target (temperature 1) of each (tag, prompt ids, response ids); the
        answers come from `measured`, outside any prompt's cost."""

    def measured(self) -> dict[object, float]:
        """The perplexities answered since the last call, by tag."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (its time belongs to the prompts that caused it)."""

    def close(self) -> None:
        """Stop every sequence and measure still held (the pool is dropped)."""
