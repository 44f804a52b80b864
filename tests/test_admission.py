"""Prompts that join a batch while it decodes (continuous batching inside an actor): the joined batch computes every
sequence's own logits (Batch.extend, shared prefix or repeated cache), and a pool that admits prompts as rows free
gives the rows of the pool that starts them all at once."""

from __future__ import annotations

import pytest
import torch

import workers.engine as eng
from tests.trio_helpers import demo_items, trio, trio_prompts
from workers.cost import Meter
from workers.engine import Engine, forward
from workers.sampling import Warp


def _check_logits(runner, prompts, batch, logits):
    with torch.inference_mode():
        for r in range(batch.size):
            seq = prompts[int(batch.group[r])].ids + batch.tokens[r, : int(batch.length[r]) - 1].tolist()
            ref = runner.target(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(logits[r], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shared", [True, False])
def test_a_prompt_joining_a_decoding_batch_gets_its_own_logits(shared, monkeypatch):
    runner = trio()
    monkeypatch.setattr("workers.shared_prefix.SHARE_MIN_BYTES", 0)  # share even the tiny trio's prompts
    if not shared:
        monkeypatch.setattr(eng, "share", lambda *a: None)
    prompts = trio_prompts(demo_items(4))
    # the joining prompts are longer than the running one and shorter: both sides get padded
    order = sorted(range(4), key=lambda i: len(prompts[i].ids))
    first, later = [prompts[order[1]]], [prompts[order[0]], prompts[order[3]]]
    prompts = first + later
    engine = Engine(runner.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0, Meter(3))
    with torch.inference_mode():
        batch = engine.prefill([p.ids for p in first], 3, [p.key for p in first], [30])
        for _ in range(5):
            engine.step(batch)
        batch.select(torch.tensor([0, 2]))  # one candidate left: the joined batch has uneven prompts
        new = engine.prefill([p.ids for p in later], 3, [p.key for p in later], [30, 30], first_group=1)
        batch.extend(new, runner.pad_id)
        assert batch.group.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
        for _ in range(4):
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], 1)
            logits = forward(runner.target, "target", batch.pending[:, None], batch.mask, batch.cache, batch.group,
                             engine.meter)[:, -1]
            engine._sample_into(batch, logits)
        _check_logits(runner, prompts, batch, logits)
    assert engine.meter.tokens["target"].tolist()[1] >= len(later[0].ids)  # prefill counted to the right prompt


def comparable(rows: list[dict]) -> list:
    """What admission must not change: texts, finish reasons and partial-reward counts exactly; rewards up to float
    noise (the reward model scores other batch shapes)."""
    return [(r["prompt_id"], r["best_index"], r["stats"].get("decision_tokens"),
             [(c["text"], c["finish_reason"], len(c["partial_rewards"]), pytest.approx(c["reward"], abs=1e-5))
              for c in r["candidates"]]) for r in rows]


@pytest.mark.parametrize("method", [
    {"name": "best_of_n", "n": 6},
    {"name": "speculative_rejection", "n": 6, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 4},
])
def test_prompts_admitted_as_rows_free_give_the_rows_of_starting_together(method, monkeypatch):
    from tests.trio_helpers import config
    from workers.runner import Runner

    cfg = config(method=method, generation={"max_new_tokens": 24}, resources={"prompts_per_batch": 4})
    items = demo_items(4)
    together = Runner(cfg).run(items)
    runner = Runner(cfg)
    ready, _ = runner.prepare(items)
    # room for one prompt and a half: the next prompt joins once half of the running one's candidates have left
    runner.memory_budget = int(1.5 * max(runner.memory_need(p) for _, p in ready))
    joins, extend = [], eng.Batch.extend

    def counted(batch, other, pad_id):
        joins.append((batch.size, other.size))
        return extend(batch, other, pad_id)

    monkeypatch.setattr(eng.Batch, "extend", counted)
    rows = runner.run(items)
    assert joins and all(running > 0 for running, _ in joins)  # prompts joined a batch that was still decoding
    assert comparable(rows) == comparable(together)
    # (the target tokens charged may differ: a finished sequence is fed until its batch compacts, which depends
    # on who else is in the batch)
