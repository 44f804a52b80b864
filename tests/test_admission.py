"""Prompts that join a batch while it decodes (continuous batching inside an actor): the joined batch computes every
sequence's own logits (Batch.extend, shared prefix or repeated cache), and a pool that admits prompts as rows free
gives the rows of the pool that starts them all at once."""

from __future__ import annotations

import pytest
import torch

import workers.decoding.batch as batch_module
import workers.decoding.target as target_module
from tests.trio_helpers import demo_items, trio, trio_prompts
from workers.accounting.cost import Meter
from workers.decoding.batch import forward
from workers.decoding.sampling import Warp
from workers.decoding.target import TargetSampler


def _check_logits(runner, prompts, batch, logits):
    with torch.inference_mode():
        for r in range(batch.size):
            seq = prompts[int(batch.group[r])].ids + batch.tokens[r, : int(batch.length[r]) - 1].tolist()
            ref = runner.engine.target(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(logits[r], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shared", [True, False])
def test_a_prompt_joining_a_decoding_batch_gets_its_own_logits(shared, monkeypatch):
    runner = trio()
    monkeypatch.setattr("workers.decoding.shared_prefix.SHARE_MIN_BYTES", 0)  # share even the tiny trio's prompts
    if not shared:
        monkeypatch.setattr(target_module, "share", lambda *a: None)
    prompts = trio_prompts(demo_items(4))
    # the joining prompts are longer than the running one and shorter: both sides get padded
    order = sorted(range(4), key=lambda i: len(prompts[i].ids))
    first, later = [prompts[order[1]]], [prompts[order[0]], prompts[order[3]]]
    prompts = first + later
    engine, meter = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0), Meter(3)
    with torch.inference_mode():
        batch = engine.prefill([p.ids for p in first], 3, [p.rng_key for p in first], [30])
        for _ in range(5):
            engine.step(batch)
        batch.select(torch.tensor([0, 2]))  # one candidate left: the joined batch has uneven prompts
        new = engine.prefill([p.ids for p in later], 3, [p.rng_key for p in later], [30, 30], first_group=1)
        batch.extend(new, runner.pad_id)
        assert batch.group.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
        for _ in range(4):
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], 1)
            logits = forward(runner.engine.target, "target", batch.pending[:, None], batch.mask, batch.cache,
                             batch.group,
                             engine.work)[:, -1]
            engine._sample_into(batch, logits)
        _check_logits(runner, prompts, batch, logits)
    meter.charge(engine.take_work())  # what the sampler ran, as its decoder hands it up
    assert meter.tokens["target"].tolist()[1] >= len(later[0].ids)  # prefill counted to the right prompt


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
    from workers.actor.runner import Runner

    cfg = config(method=method, generation={"max_new_tokens": 24}, resources={"prompts_per_batch": 4})
    items = demo_items(4)
    together = Runner(cfg).run(items)
    runner = Runner(cfg)
    ready, _ = runner.prepare(items)
    # room for one prompt and a half: the next prompt joins once half of the running one's candidates have left
    runner.engine.kv_space_bytes = int(1.5 * max(runner.engine.memory_need(p, runner.params, runner.reward)
                                                for _, p in ready))
    joins, extend = [], batch_module.Batch.extend

    def counted(batch, other, pad_id):
        joins.append((batch.size, other.size))
        return extend(batch, other, pad_id)

    monkeypatch.setattr(batch_module.Batch, "extend", counted)
    rows = runner.run(items)
    assert joins and all(running > 0 for running, _ in joins)  # prompts joined a batch that was still decoding
    assert comparable(rows) == comparable(together)
    # (the target tokens charged may differ: a finished sequence is fed until its batch compacts, which depends
    # on who else is in the batch)


def _loop_ends(runner, within: float = 10.0) -> bool:
    """Whether the runner's decoding loop thread ends (it does once its last call has returned)."""
    import time

    deadline = time.monotonic() + within
    while runner.loop.serving and time.monotonic() < deadline:
        time.sleep(0.01)
    return not runner.loop.serving


def _feed_two_calls(runner, first: list[dict], second: list[dict]) -> tuple[list[dict], list[dict], float]:
    """Run two actor calls on `runner` from two threads, the second started once the first decodes."""
    import threading
    import time

    out: dict[str, list[dict]] = {}
    started = threading.Event()
    step = TargetSampler.step

    def stepping(self, batch):
        started.set()
        return step(self, batch)

    def call(name, items):
        out[name] = runner.run(items)

    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TargetSampler, "step", stepping)
        a = threading.Thread(target=call, args=("a", first))
        a.start()
        assert started.wait(60)
        b = threading.Thread(target=call, args=("b", second))
        b.start()
        a.join(120)
        b.join(120)
    return out["a"], out["b"], time.perf_counter() - t0


@pytest.mark.parametrize("method", [
    {"name": "best_of_n", "n": 4},
    {"name": "speculative_rejection", "n": 4, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 4},
    {"name": "greedy"},
])
def test_two_actor_calls_feed_one_decoding_loop_and_get_the_rows_of_running_alone(method, monkeypatch):
    """Continuous batching across actor calls (workers.pool.loop): a second call's prompts join the batch while the
    first call's decode; each call gets the rows it gets alone, its cost charged once."""
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    cfg = config(method=method, generation={"max_new_tokens": 24}, resources={"prompts_per_batch": 2,
                                                                              "feed_calls": True})
    items = demo_items(4)
    runner = Runner(cfg)
    alone = runner.run(items[:2]) + runner.run(items[2:])
    seen = []  # groups of every sampling step's batch
    step = TargetSampler.step

    def watched(self, batch):
        seen.append(set(batch.group[batch.alive].tolist()))
        return step(self, batch)

    monkeypatch.setattr(TargetSampler, "step", watched)
    a, b, elapsed = _feed_two_calls(runner, items[:2], items[2:])
    assert [r["prompt_id"] for r in a + b] == [x["prompt_id"] for x in items]
    assert comparable(a + b) == comparable(alone)
    assert any(s & {0, 1} and s & {2, 3} for s in seen)  # a step decoded prompts of both calls together
    device = sum(r["cost"]["device_seconds"] for r in a + b)
    assert 0 < device <= elapsed  # each stretch of the loop charged once, to the prompts that worked in it
    assert all(r["cost"]["target_forwards"] > 0 and r["cost"]["reward_tokens"] >= 0 for r in a + b)
    assert _loop_ends(runner) and runner.loop.pool is None  # the loop ended with its last call, its pool dropped


def test_a_failure_in_the_decoding_loop_fails_every_call_in_flight_and_the_next_call_runs(monkeypatch):
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    runner = Runner(config(method={"name": "best_of_n", "n": 4}, generation={"max_new_tokens": 16}))
    items = demo_items(4)
    want = runner.run(items[:2])
    step, calls = TargetSampler.step, []

    def failing(self, batch):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("engine died")
        return step(self, batch)

    monkeypatch.setattr(TargetSampler, "step", failing)
    with pytest.raises(RuntimeError, match="engine died"):
        runner.run(items[:2])
    assert _loop_ends(runner)
    assert comparable(runner.run(items[:2])) == comparable(want)  # a fresh pool for the next call


def test_a_forward_charges_only_the_sequences_it_counts():
    """A batch's ended rows are still fed until it compacts and charge nobody: `counted` marks the rows charged,
    tokens and forward calls alike (a prompt whose rows are all uncounted was in no forward)."""
    m = Meter(3)
    m.count_forward("target", torch.tensor([0, 0, 1, 2]), torch.tensor([1, 1, 1, 1]),
                    torch.tensor([True, False, False, True]))
    assert m.tokens["target"].tolist() == [1, 0, 1] and m.forwards["target"].tolist() == [1, 0, 1]
    m.count_forward("target", torch.tensor([0, 1]), torch.tensor([2, 3]))  # every row counted
    assert m.tokens["target"].tolist() == [3, 3, 1] and m.forwards["target"].tolist() == [2, 1, 1]
    assert m.reward_steps.tolist() == [0, 0, 0]  # the target's forwards are its steps, counted by count_step
    m.count_forward("reward", torch.tensor([0, 0, 2, 1]), torch.tensor([5, 5, 5, 5]),
                    torch.tensor([True, True, True, False]))
    assert m.reward_steps.tolist() == pytest.approx([2 / 3, 0, 1 / 3])  # one forward, shared by its counted rows


def test_the_reward_models_forwards_are_shared_among_the_prompts_in_them():
    """stats.reward_steps: each reward-model forward is shared among the prompts in it by their rows, so the rows'
    shares sum to the forwards the reward model made (counted here by a hook), as their decoding_steps sum to the
    actor's steps."""
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    runner = Runner(config(method={"name": "speculative_rejection", "n": 8, "alpha": 0.5},
                           generation={"max_new_tokens": 24}))
    calls: list[int] = []
    runner.reward.model.register_forward_hook(lambda *_: calls.append(1))
    rows = runner.run(demo_items(6))
    shares = [r["stats"]["reward_steps"] for r in rows]
    assert all(s > 0 for s in shares) and sum(shares) == pytest.approx(len(calls)) and len(calls) < 6 * 8


def test_a_meter_over_a_window_of_prompts_charges_each_stretch_once(monkeypatch):
    """The feed's meter: prompts numbered on (grow), the oldest forgotten (retire; their dead rows, still fed until
    the batch compacts, charge nobody), and each stretch of time shared by the tokens caused in it (tick)."""
    import workers.accounting.cost as cost

    clock = iter([0.0, 10.0, 16.0, 20.0, 30.0])
    monkeypatch.setattr(cost.time, "perf_counter", lambda: next(clock))
    m = Meter(2)  # started at t = 0
    m.count_forward("target", torch.tensor([0, 0, 1]), torch.tensor([3, 3, 2]))  # 6 and 2 tokens
    m.tick()  # t = 10: 7.5 s and 2.5 s
    m.grow(3)
    m.count_forward("target", torch.tensor([1, 2]), torch.tensor([1, 1]))
    m.count_forward("reward", torch.tensor([2]), torch.tensor([2]))  # scoring counts as work too
    m.tick()  # t = 16: 6 s, 1/4 to prompt 1, 3/4 to prompt 2
    costs = m.per_prompt(2.0, [0, 1], wall=5.0)
    assert [c["device_seconds"] for c in costs] == [pytest.approx(15.0), pytest.approx(2 * (2.5 + 1.5))]
    assert [c["target_tokens"] for c in costs] == [6, 3] and costs[0]["wall_seconds"] == 5.0
    m.retire(2)  # prompts 0 and 1 are written
    assert (m.base, m.num_prompts) == (2, 1)
    m.count_forward("target", torch.tensor([0, 1, 2]), torch.tensor([1, 1, 1]))  # rows of retired prompts: not charged
    m.count_truncated(torch.tensor([1, 2]))
    m.pause()  # t = 20: 4 s to prompt 2; the next stretch starts now
    (c,) = m.per_prompt(1.0, [2], wall=1.0)
    assert (c["target_tokens"], c["reward_tokens"], c["target_forwards"]) == (2, 2, 2)
    assert c["device_seconds"] == pytest.approx(4.5 + 4.0) and int(m.reward_inputs_truncated[0]) == 1
