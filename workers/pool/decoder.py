"""What the candidate pool needs of an engine: the `Decoder` protocol, and the names it uses.

A decoder holds the running sequences of one pool on one engine. The pool (`workers.pool.pool`) starts prompts'
candidates on it, steps it, takes the sequences that ended, scores the running ones at decision tokens and drops the
rejected; the decoder knows only its sequences, not rewards, schedules or rows. What it runs comes back with what
happened: a start or a step returns a `StepOutput` (the sequences that ended, and a `Work` of the forwards and
tokens per prompt), a drop the counts it settles. It owns its memory model (`need`, `kv_space`, `width`): what the
pool's admission asks of it, with nothing to call back into its engine. Two implement it:
`workers.engines.hf.HfDecoder` (Winnow's own engine: a `Batch` decoded by the target or the speculative sampler,
rejected sequences dropped by selection) and `workers.engines.vllm.VllmDecoder` (one vLLM request per candidate,
rejected ones aborted).

A sequence is named by its *key* (group, cand): *group* is its prompt's number in the pool (numbers grow as prompts
join a pool and are never reused), *cand* its index among the prompt's n candidates. A sequence's *tokens* are its
response so far (every token sampled for it), and its *logprob* the target's log-probability of them at temperature
1 (before any warp), summed as they were sampled: the `logprob` reward and the perplexity read it, with no forward
of their own.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from workers.accounting.work import Work
from workers.candidates import PromptInput

Key = tuple[int, int]  # (group, cand)


class Seq(NamedTuple):
    """A sequence as a decoder reports it."""

    key: Key
    tokens: list[int]
    logprob: float | None  # None where a decoder does not track it


class StepOutput(NamedTuple):
    """What a decoder's start or step did: the sequences that finished in it (EOS, or their token limit), in key
    order, which no longer run; and what it ran (`Work`: forwards and tokens per prompt, prefills counted as steps)."""

    finished: list[Seq]
    work: Work


class Decoder(Protocol):
    kv_bytes_per_token: int  # KV-cache bytes of one token of one sequence (of every model that keeps a cache)
    width: int  # most sequences one step runs (models.max_num_seqs)
    joins: bool  # whether prompts may start while other prompts' sequences run

    def need(self, prompt: PromptInput, rows: int, kv_tokens: int | None = None) -> int:
        """The most bytes `rows` running sequences of `prompt` may take on this engine (their KV cache, and what
        else the engine holds per sequence), their KV cache bounded by `kv_tokens` tokens when given (a
        Speculative Rejection prompt's KV space): what the pool's admission counts (`workers.pool.pool`)."""

    def wait(self, groups: list[int], prompts: list[PromptInput]) -> None:
        """Prompts that joined the pool, numbered `groups`: they will start in this order, after those that wait
        already. A decoder whose prefill is a forward of its own (the hf engine) prefills them ahead, many at a
        time, so that a start costs no forward of its own; vLLM's prefills ride inside its steps."""

    def waiting_bytes(self) -> int:
        """The bytes held now for prompts that have not started (their prefill, done ahead): the pool's admission
        counts them in its KV space."""

    def start(self, groups: list[int], prompts: list[PromptInput]) -> StepOutput:
        """Start n candidates of each prompt, numbered `groups`: the first that wait, in order. A candidate may end
        at its first token: it is among the output's finished."""

    def step(self) -> StepOutput:
        """One decoding step of every running sequence."""

    def running(self) -> list[Seq]:
        """Every running sequence, in key order."""

    def lengths(self) -> dict[int, list[int]]:
        """Each group with running sequences: the lengths of its running responses, in tokens."""

    def drop(self, keys: Sequence[Key]) -> Work:
        """Stop running sequences (rejected ones): they generate nothing more and their KV cache is freed. Returns
        the counts it settles for them (an engine that counts a step's tokens ahead of its outputs)."""

    def kv_space(self) -> int | None:
        """The bytes this pool's running sequences may take in all (`need` summed), its KV space (None where it
        cannot be read)."""

    def stats(self, group: int) -> dict:
        """The sampler's own measures of a prompt (acceptance of the speculative sampler), or {}."""

    def forget(self, group: int) -> None:
        """Drop what is held for a prompt whose candidates have all ended and whose row is made."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (its time belongs to the prompts that caused it)."""

    def close(self) -> None:
        """Stop every sequence still held (the pool is dropped)."""
