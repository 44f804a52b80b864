"""What each prompt of a batch cost: tokens and forward calls per model, wall and device seconds; and how many of
its reward inputs were cut to fit the reward model (not a cost, but counted per prompt in the same place).

A batched forward serves several prompts at once; it counts as one forward call for each prompt that had sequences
in it, and each prompt is charged the real (unmasked) tokens of its own sequences. Device seconds of a batch are
shared among its prompts in proportion to the target tokens they caused, so they sum to the batch's device time.
"""

from __future__ import annotations

import time

import torch

ROLES = ("target", "draft", "reward")


class Meter:
    def __init__(self, num_prompts: int):
        self.num_prompts = num_prompts
        self.tokens = {r: torch.zeros(num_prompts, dtype=torch.long) for r in ROLES}
        self.forwards = {r: torch.zeros(num_prompts, dtype=torch.long) for r in ROLES}
        self.reward_inputs_truncated = torch.zeros(num_prompts, dtype=torch.long)
        self.started = time.perf_counter()

    def count_forward(self, role: str, group: torch.Tensor, new_tokens: torch.Tensor) -> None:
        """One forward over sequences of prompts `group` [B] that processed `new_tokens` [B] real tokens each."""
        g = group.cpu()
        self.tokens[role] += torch.bincount(g, weights=new_tokens.cpu().double(), minlength=self.num_prompts).long()
        self.forwards[role] += (torch.bincount(g, minlength=self.num_prompts) > 0).long()

    def count_truncated(self, group: torch.Tensor) -> None:
        """Reward inputs of prompts `group` [B] (one entry per input) that were cut to the reward model's context."""
        self.reward_inputs_truncated += torch.bincount(group.cpu(), minlength=self.num_prompts)

    def per_prompt(self, devices: float = 1.0) -> list[dict]:
        """The output row's `cost` struct (README: Output columns) for each prompt. `devices`: GPUs (or 1 for a CPU
        worker) this batch held."""
        wall = time.perf_counter() - self.started
        tgt = self.tokens["target"].double()
        share = tgt / tgt.sum() if tgt.sum() > 0 else torch.full_like(tgt, 1.0 / max(self.num_prompts, 1))
        out = []
        for i in range(self.num_prompts):
            out.append(
                {
                    "target_tokens": int(self.tokens["target"][i]),
                    "draft_tokens": int(self.tokens["draft"][i]),
                    "reward_tokens": int(self.tokens["reward"][i]),
                    "target_forwards": int(self.forwards["target"][i]),
                    "draft_forwards": int(self.forwards["draft"][i]),
                    "reward_forwards": int(self.forwards["reward"][i]),
                    "wall_seconds": wall,
                    "device_seconds": wall * devices * float(share[i]),
                }
            )
        return out
