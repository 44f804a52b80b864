"""What a call of an executor ran, per prompt (`Work`): the record a sampler, a decoder, a scorer or a method fills
and hands back with its results, so that costs travel up with the data and are charged once, where the loop keeps
its meter (`workers.accounting.cost.Meter.charge`).

1. An executor makes a `Work` for the call it runs, or keeps one that its caller takes after each call.
2. Each forward it runs is recorded as it happens (`forward`): the prompts of its sequences and the real tokens each
   fed, moved to the host in one transfer, so that later changes to the batch's tensors change nothing recorded.
3. A decoding step of a candidate pool is recorded with its width (`step`); reward inputs cut to the reward model's
   context (`truncated`); a count made ahead of an engine's outputs and corrected once they come (`settle`).
4. A caller that runs several executors adds their records to its own (`add`) and hands the sum up.

A record holds prompts by their number (group), whatever window of prompts a meter holds when it is charged.
"""

from __future__ import annotations

import torch


class Work:
    """The forwards, tokens, steps and cut reward inputs of one call, in the order they happened."""

    def __init__(self):
        self.entries: list[tuple] = []  # ("forward", role, group [N], tokens [N]) | ("step", groups, running) | ...

    def forward(self, role: str, group: torch.Tensor, new_tokens: torch.Tensor,
                counted: torch.Tensor | None = None) -> None:
        """One forward of model `role` over sequences of prompts `group` [B] that fed `new_tokens` [B] real tokens
        each, of which only the sequences `counted` [B] bool marks count (default all): a forward counts once for
        each prompt with a counted sequence in it. The three come from the device in one transfer."""
        cols = [group, new_tokens] if counted is None else [group, new_tokens, counted]
        moved = torch.stack([c.to(group.device, torch.long) for c in cols]).cpu()
        g, tokens = moved[0], moved[1]
        if counted is not None:
            keep = moved[2].bool()
            g, tokens = g[keep], tokens[keep]
        self.entries.append(("forward", role, g, tokens))

    def step(self, groups: torch.Tensor, running: torch.Tensor) -> None:
        """One decoding step of prompts `groups` [P] with `running` [P] sequences each (its width: their sum)."""
        self.entries.append(("step", groups.cpu(), running.cpu()))

    def truncated(self, group: torch.Tensor) -> None:
        """Reward inputs of prompts `group` [B] (one entry per input) cut to the reward model's context."""
        self.entries.append(("truncated", group.cpu()))

    def settle(self, role: str, group: int, tokens: int) -> None:
        """Correct prompt `group`'s count of `role` tokens by `tokens`: an engine that counts a step's work before its
        outputs come settles the count once they do (`workers.engines.vllm`)."""
        if tokens:
            self.entries.append(("settle", role, group, tokens))

    def add(self, other: "Work") -> "Work":
        """This record followed by `other`'s; returns this one."""
        self.entries += other.entries
        return self
