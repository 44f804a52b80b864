"""What a reward scorer offers the pool and the actor (`Scorer`), and the session it scores growing candidates in
(`Session`): the seam between the scorers of `workers.scoring` and the rest, so that nothing outside a scorer's own
module asks which scorer it is.

A scorer scores a list of `workers.scoring.items.Scored` items (one response each, partial or finished) into floats,
and hands them back with what it processed to score them (`Scores`: the values and a `Work`, the forwards and tokens
per prompt), which its caller adds to its own and the loop charges. A method that scores the same candidates again
and again as they grow (Speculative Rejection's decisions) scores them through a session: a reward model keeps each
candidate's cache there (`workers.scoring.reward_session.CachedScoring`); the others score every call afresh
(`workers.scoring.scorers.Rescoring`).
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Protocol, Sequence

from workers.accounting.work import Work
from workers.scoring.items import Scored


class Scores(NamedTuple):
    """A scoring call's rewards, one per item (None where no reward is configured), and what it ran for them."""

    values: list
    work: Work


class Session(Protocol):
    def score(self, keys: Sequence[Hashable], items: list[Scored], final: Sequence[bool] | None = None) -> Scores:
        """Rewards of items, one per key (a key names one candidate for the session's life); `final`: the items
        scored for the last time."""

    def release(self, keys: Sequence[Hashable]) -> None:
        """Candidates that will not be scored again, in bulk."""


class Scorer(Protocol):
    cuts_inputs: bool  # whether an input may be cut to a context (counted: rows carry stats.reward_inputs_truncated)
    session_kv_bytes_per_token: int  # KV bytes its sessions keep per token of a running candidate (0: none kept)

    def __call__(self, items: list[Scored]) -> Scores:
        """Rewards of items, scored whole, and what scoring them ran."""

    def session(self) -> Session:
        """A session for candidates scored again as they grow."""
