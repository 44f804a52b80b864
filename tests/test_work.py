"""What an executor hands back (`workers.accounting.work.Work`) and the one meter the loop charges with it: a record
charged later counts as the meter counted at once, and it keeps what the batch's tensors held when it was made."""

from __future__ import annotations

import pytest
import torch

from workers.accounting.cost import Meter
from workers.accounting.work import Work


def test_a_work_charged_counts_as_the_meter_counts_at_once():
    direct, later, work = Meter(3), Meter(3), Work()
    calls = [
        ("forward", ("target", torch.tensor([0, 0, 1, 2]), torch.tensor([1, 1, 1, 1]),
                     torch.tensor([True, False, False, True]))),
        ("forward", ("reward", torch.tensor([0, 0, 2, 1]), torch.tensor([5, 5, 5, 5]))),
        ("step", (torch.tensor([0, 2]), torch.tensor([3, 1]))),
        ("truncated", (torch.tensor([1, 1]),)),
        ("settle", ("target", 2, -1)),
    ]
    count = {"forward": direct.count_forward, "step": direct.count_step, "truncated": direct.count_truncated,
             "settle": direct.settle}
    for name, args in calls:
        count[name](*args)
        getattr(work, name)(*args)
    later.charge(Work().add(work))
    for field in ("tokens", "forwards"):
        for role in ("target", "draft", "reward"):
            assert getattr(later, field)[role].tolist() == getattr(direct, field)[role].tolist()
    assert later.steps.tolist() == direct.steps.tolist() == pytest.approx([0.75, 0, 0.25])
    assert later.seq_steps.tolist() == direct.seq_steps.tolist()
    assert later.reward_steps.tolist() == direct.reward_steps.tolist()
    assert later.reward_inputs_truncated.tolist() == direct.reward_inputs_truncated.tolist() == [0, 2, 0]
    assert later.tokens["target"].tolist() == [1, 0, 0]  # prompt 2's token settled away


def test_a_record_keeps_what_the_batch_held_when_the_forward_ran():
    """A forward's `counted` mask is the batch's `alive`, which the decoder changes in place as sequences end: the
    record reads it when the forward runs, so a later change charges nobody differently."""
    alive = torch.tensor([True, True, False])
    work = Work()
    work.forward("target", torch.tensor([0, 1, 1]), torch.tensor([1, 1, 1]), counted=alive)
    alive &= torch.tensor([False, True, True])  # the next harvest marks sequence 0 dead
    meter = Meter(2)
    meter.charge(work)
    assert meter.tokens["target"].tolist() == [1, 1] and meter.forwards["target"].tolist() == [1, 1]
