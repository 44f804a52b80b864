"""What each prompt of a batch cost: tokens and forward calls per model, wall and device seconds; and how many of
its reward inputs were cut to fit the reward model (not a cost, but counted per prompt in the same place).

A batched forward serves several prompts at once; it counts as one forward call for each prompt that had sequences
in it, and each prompt is charged the real (unmasked) tokens of its own sequences. Device seconds of a batch are
shared among its prompts in proportion to the target tokens they caused, so they sum to the batch's device time.

A decoding step of a candidate pool (`count_step`) is what a device bills when a step costs about the same at any
width (a GPU at these model sizes): each prompt is charged its share of the step, its running sequences over the
step's width, so the shares of a loop's prompts sum to its steps; and its sequence-steps (its running sequences).
Steps over sequence-steps is the loop's mean width.

A meter also serves a decoding loop that prompts join and leave over an actor's life (`workers.pool.loop`): prompts are
numbered on, `grow` adds room for the next ones and `retire` forgets the oldest once they are done, so the meter
holds only a window of prompt numbers (`base` is the first). There each stretch of work is charged as it ends
(`tick`): its seconds are shared among the prompts by the tokens they caused in it, so the device seconds of all the
prompts sum to the loop's busy time, however many actor calls overlapped.

No layer below the loop holds a meter: samplers, decoders, scorers and methods hand back what they ran (a
`workers.accounting.work.Work`), and the loop (or the runner, for a method with a loop of its own) charges it here
(`charge`), in one place.
"""

from __future__ import annotations

import time

import torch

from workers.accounting.work import Work

ROLES = ("target", "draft", "reward")


class Meter:
    def __init__(self, num_prompts: int):
        self.num_prompts = num_prompts  # the window's size: prompts base .. base + num_prompts - 1
        self.base = 0
        self.tokens = {r: torch.zeros(num_prompts, dtype=torch.long) for r in ROLES}
        self.forwards = {r: torch.zeros(num_prompts, dtype=torch.long) for r in ROLES}
        self.reward_inputs_truncated = torch.zeros(num_prompts, dtype=torch.long)
        self.steps = torch.zeros(num_prompts, dtype=torch.float64)  # each prompt's share of the decoding steps
        self.seq_steps = torch.zeros(num_prompts, dtype=torch.long)  # its sequences' steps
        self.reward_steps = torch.zeros(num_prompts, dtype=torch.float64)  # its share of the reward model's forwards
        self.started = time.perf_counter()
        self.seconds: torch.Tensor | None = None  # [num_prompts] float64 once `tick` charges time
        self._charged: torch.Tensor | None = None  # tokens of every role at the last tick

    def charge(self, work: Work) -> None:
        """Count what `work` records, in its order: forwards (`count_forward`), steps (`count_step`), cut reward
        inputs (`count_truncated`) and corrections (`settle`)."""
        for entry in work.entries:
            kind = entry[0]
            if kind == "forward":
                self.count_forward(*entry[1:])
            elif kind == "step":
                self.count_step(*entry[1:])
            elif kind == "truncated":
                self.count_truncated(*entry[1:])
            elif kind == "settle":
                self.settle(*entry[1:])
            else:
                raise ValueError(f"Meter.charge: unknown entry {kind!r}")

    def _index(self, group: torch.Tensor, values: torch.Tensor | None = None):
        """Window positions of prompts `group` (and their `values`), without retired prompts: a retired prompt's
        finished sequences may still be fed until their batch compacts, and nobody is charged for them."""
        g = group.cpu()
        if not self.base:
            return g, values
        g = g - self.base
        keep = g >= 0
        if bool(keep.all()):
            return g, values
        return g[keep], (values.cpu()[keep] if values is not None else None)

    def count_forward(self, role: str, group: torch.Tensor, new_tokens: torch.Tensor,
                      counted: torch.Tensor | None = None) -> None:
        """One forward over sequences of prompts `group` [B] that processed `new_tokens` [B] real tokens each, of
        which only the sequences `counted` [B] bool marks are charged (default all). The three come from the device
        in one transfer: a forward's count costs the host one wait for the device, not one per tensor."""
        cols = [group, new_tokens] if counted is None else [group, new_tokens, counted]
        moved = torch.stack([c.to(group.device, torch.long) for c in cols]).cpu()
        g, new_tokens = moved[0], moved[1]
        if counted is not None:
            keep = moved[2].bool()
            g, new_tokens = g[keep], new_tokens[keep]
        g, new_tokens = self._index(g, new_tokens)
        self.tokens[role] += torch.bincount(g, weights=new_tokens.cpu().double(), minlength=self.num_prompts).long()
        rows = torch.bincount(g, minlength=self.num_prompts)
        self.forwards[role] += (rows > 0).long()
        if role == "reward" and int(rows.sum()):  # the forward shared among its prompts by their rows
            self.reward_steps += rows.double() / int(rows.sum())

    def settle(self, role: str, group: int, tokens: int) -> None:
        """Correct prompt `group`'s count of `role` tokens by `tokens`, where an engine counts a step's work before
        its outputs come and settles the count once they do (`workers.engines.vllm`): the count changes, the time
        already charged does not, and the correction is no new work for the next `tick`."""
        i = group - self.base
        if not tokens or i < 0:
            return
        self.tokens[role][i] += tokens
        if self._charged is not None:
            self._charged[i] += tokens

    def count_step(self, groups: torch.Tensor, running: torch.Tensor) -> None:
        """One decoding step of prompts `groups` [P] with `running` [P] sequences each: each is charged running /
        width of the step (width = the step's sequences) and its sequences' steps."""
        width = int(running.sum())
        if not width:
            return
        g, running = self._index(groups, running)
        self.steps.index_add_(0, g, running.double() / width)
        self.seq_steps.index_add_(0, g, running.long())

    def count_truncated(self, group: torch.Tensor) -> None:
        """Reward inputs of prompts `group` [B] (one entry per input) that were cut to the reward model's context."""
        self.reward_inputs_truncated += torch.bincount(self._index(group)[0], minlength=self.num_prompts)

    # -- a window of prompts over a decoding loop ---------------------------------------------------------------
    def _all_tokens(self) -> torch.Tensor:
        return sum(self.tokens[r] for r in ROLES).double()

    def grow(self, num_prompts: int) -> None:
        """Make room for prompts up to base + num_prompts - 1 (a loop numbers its prompts on)."""
        extra = num_prompts - self.num_prompts
        if extra <= 0:
            return
        for d in (self.tokens, self.forwards):
            for r in ROLES:
                d[r] = torch.cat([d[r], d[r].new_zeros(extra)])
        self.reward_inputs_truncated = torch.cat([self.reward_inputs_truncated,
                                                  self.reward_inputs_truncated.new_zeros(extra)])
        self.steps = torch.cat([self.steps, self.steps.new_zeros(extra)])
        self.seq_steps = torch.cat([self.seq_steps, self.seq_steps.new_zeros(extra)])
        self.reward_steps = torch.cat([self.reward_steps, self.reward_steps.new_zeros(extra)])
        if self.seconds is not None:
            self.seconds = torch.cat([self.seconds, self.seconds.new_zeros(extra)])
            self._charged = torch.cat([self._charged, self._charged.new_zeros(extra)])
        self.num_prompts = num_prompts

    def retire(self, upto: int) -> None:
        """Forget prompts before `upto` (absolute number): their rows are written."""
        drop = min(upto - self.base, self.num_prompts)
        if drop <= 0:
            return
        for d in (self.tokens, self.forwards):
            for r in ROLES:
                d[r] = d[r][drop:].clone()
        self.reward_inputs_truncated = self.reward_inputs_truncated[drop:].clone()
        self.steps, self.seq_steps = self.steps[drop:].clone(), self.seq_steps[drop:].clone()
        self.reward_steps = self.reward_steps[drop:].clone()
        if self.seconds is not None:
            self.seconds = self.seconds[drop:].clone()
            self._charged = self._charged[drop:].clone()
        self.num_prompts -= drop
        self.base += drop

    def tick(self) -> None:
        """Charge the seconds since the last tick to the prompts that caused tokens since then, in proportion to
        them. A stretch in which no token was counted is carried over to the next one that counts some."""
        if self.seconds is None:
            self.seconds = torch.zeros(self.num_prompts, dtype=torch.float64)
            self._charged = torch.zeros(self.num_prompts, dtype=torch.float64)
        now = time.perf_counter()
        total = self._all_tokens()
        caused = total - self._charged
        if float(caused.sum()) > 0:
            self.seconds += (now - self.started) * caused / caused.sum()
            self._charged = total
            self.started = now

    def pause(self) -> None:
        """Charge what was done so far, then start the next stretch now: the time in between is nobody's (the
        quality measures, waiting for prompts)."""
        self.tick()
        self.started = time.perf_counter()

    def step_stats(self, groups: list[int] | None = None) -> list[dict]:
        """Each prompt's (or prompts `groups`', absolute numbers) decoding steps as its row's stats: its share of
        the steps (`decoding_steps`), its sequence-steps (`sequence_steps`) and its share of the reward model's
        forwards (`reward_steps`); empty for a prompt of no step (a method that is not a candidate pool)."""
        out = []
        for g in range(self.base, self.base + self.num_prompts) if groups is None else groups:
            i = g - self.base
            seq = int(self.seq_steps[i])
            out.append({"decoding_steps": float(self.steps[i]), "sequence_steps": seq,
                        "reward_steps": float(self.reward_steps[i])} if seq else {})
        return out

    # -- the rows' cost struct ------------------------------------------------------------------------------------
    def per_prompt(self, devices: float = 1.0, groups: list[int] | None = None, wall: float | None = None
                   ) -> list[dict]:
        """The output row's `cost` struct (docs/config.md: Output columns) for each prompt (or for prompts `groups`,
        absolute numbers). `devices`: GPUs (or 1 for a CPU worker) this batch held. `wall`: the wall seconds of the
        prompts' batch (default: since `started`). Device seconds are the prompts' share of the time since
        `started` by their target tokens, or what `tick` charged them when the meter serves a loop."""
        wall = time.perf_counter() - self.started if wall is None else wall
        if self.seconds is not None:
            seconds = self.seconds
        else:
            tgt = self.tokens["target"].double()
            share = tgt / tgt.sum() if tgt.sum() > 0 else torch.full_like(tgt, 1.0 / max(self.num_prompts, 1))
            seconds = wall * share
        out = []
        for g in range(self.base, self.base + self.num_prompts) if groups is None else groups:
            i = g - self.base
            out.append(
                {
                    "target_tokens": int(self.tokens["target"][i]),
                    "draft_tokens": int(self.tokens["draft"][i]),
                    "reward_tokens": int(self.tokens["reward"][i]),
                    "target_forwards": int(self.forwards["target"][i]),
                    "draft_forwards": int(self.forwards["draft"][i]),
                    "reward_forwards": int(self.forwards["reward"][i]),
                    "wall_seconds": wall,
                    "device_seconds": float(seconds[i]) * devices,
                }
            )
        return out
