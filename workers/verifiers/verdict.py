"""What a verifier says of one finished response (`Verdict`), and what every verifier offers (`Verifier`).

A verifier answers yes or no, and only for a finished response. It judges off the decoding thread: `submit` returns
a future at once, and the caller collects the verdict when it needs it, so decoding goes on while answers are
checked or code runs.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from math import comb
from typing import Protocol


@dataclass(frozen=True)
class Verdict:
    """`verified`: the response passed. `reason`: why not (None when it passed): a short phrase such as
    "wrong answer", "no answer", "timeout", "memory", or "test failed: ...". `answer`: the final answer a math
    verifier read in the response (None for other verifiers, or when it found none)."""

    verified: bool
    reason: str | None = None
    answer: str | None = None


class Verifier(Protocol):
    columns: tuple[str, ...]  # the row columns it reads (its reference), which travel with each prompt

    def submit(self, text: str, row: dict, prompt: list | None = None) -> Future:
        """Start judging `text` (a finished response, special tokens removed) against `row` (the prompt's reward
        columns; `prompt`: its chat messages, which a python verifier is handed); the future's result is a
        `Verdict`. Never blocks on the judging itself."""

    def close(self) -> None:
        """Stop its workers (verdicts not collected yet are cancelled)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples verifies, estimated without bias from n samples of which c verified
    (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_ks(n: int) -> list[int]:
    """The k's a row reports pass@k at: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []
