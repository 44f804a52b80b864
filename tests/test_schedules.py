"""When Speculative Rejection decides and whom a decision keeps (workers/pool/schedules.py): the cut of equations
4-5 as an order statistic, the memory schedule's decision per prompt within its own KV space, and the pool's KV space
from the device's memory. Beside tests/test_pool.py, whose pools these schedules drive."""

from __future__ import annotations

import pytest

from tests.trio_helpers import demo_items, run_trio, trio
from workers.decoding.kvcache import model_kv_bytes
from workers.pool.schedules import cut_value, rejection_cut


@pytest.fixture(scope="module")
def items():
    return demo_items(4)


def test_cut_value_is_the_lower_order_statistic():
    assert cut_value([3.0, 1.0, 2.0, 4.0], 0.0) == 1.0
    assert cut_value([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0  # floor(0.5*4) = 2 values strictly below
    assert cut_value([1.0, 2.0], 0.5) == 2.0
    assert cut_value([5.0], 0.9) == 5.0


def test_rejection_cut_keeps_the_running_candidates_at_or_above_the_cut():
    scores = [0.3, 0.1, 0.4, 0.2]
    assert rejection_cut(scores, [], 0.0) == [0, 1, 2, 3]  # alpha = 0 keeps every candidate
    assert rejection_cut(scores, [], 0.5) == [0, 2]  # floor(0.5 * 4) = 2 strictly below the cut are dropped
    assert rejection_cut(scores, [], 0.25) == [0, 2, 3]  # floor(0.25 * 4) = 1
    assert rejection_cut(scores, [], 0.99) == [2]  # floor(0.99 * 4) = 3
    # ties at the cut are kept: the cut is the 3rd smallest (0.2), which three candidates share
    assert rejection_cut([0.1, 0.2, 0.2, 0.2, 0.5], [], 0.5) == [1, 2, 3, 4]
    assert rejection_cut([0.7, 0.7, 0.7], [], 0.9) == [0, 1, 2]


def test_rejection_cut_counts_finished_candidates_but_never_keeps_or_drops_them():
    running = [0.1, 0.2, 0.3]
    # alone: b = 3, floor(0.5 * 3) = 1 below the cut, the cut is the 2nd smallest (0.2)
    assert rejection_cut(running, [], 0.5) == [1, 2]
    # with two finished above them: b = 5, floor(0.5 * 5) = 2 below, the cut is the 3rd smallest (0.3)
    assert rejection_cut(running, [0.9, 0.95], 0.5) == [2]
    # with two finished below them: {0.0, 0.0, 0.1, 0.2, 0.3}, the cut is 0.1 and every running candidate stays
    assert rejection_cut(running, [0.0, 0.0], 0.5) == [0, 1, 2]
    # the indices are those of the running candidates only; with nothing running there is nothing to keep
    assert rejection_cut([], [0.5, 0.6], 0.5) == []


@pytest.mark.parametrize("memory_candidates,every", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_memory_schedule_decides_when_a_prompts_cache_would_pass_its_space(items, memory_candidates, every):
    """A prompt's first decision comes at the first length d where its running candidates' cache (the prompt once,
    each response with the next token) would pass the space of `memory_candidates` candidates at full length. On a
    scoring clock of `every` steps, d is the first tick of its own clock (a multiple of `every` tokens) where the
    cache would pass the space by the next tick."""
    n, kv = 8, model_kv_bytes(trio().engine.target)
    method = {"name": "speculative_rejection", "n": n, "alpha": 0.5, "memory_candidates": memory_candidates,
              "scoring_steps": every}
    prompts, results, _ = run_trio(method, items)
    decided = []
    for p, res in zip(prompts, results):
        space = (len(p.ids) + memory_candidates * p.limit) * kv
        assert res.stats["kv_space_bytes"] == space

        def held(t: int) -> int:  # the cache by the next tick (every tokens on), when the responses are t tokens long
            running = [c for c in res.candidates if len(c.tokens) > t or (len(c.tokens) == t and c.partial_rewards
                                                                          and c.finish_reason == "rejected")]
            return (len(p.ids) + len(running) * (t + every)) * kv

        ticks = range(every, max(len(c.tokens) for c in res.candidates) + 1, every) if every > 1 else \
            range(1, max(len(c.tokens) for c in res.candidates) + 1)
        if res.stats["decision_tokens"]:
            d = res.stats["decision_tokens"][0]
            assert d in ticks and held(d) > space >= max((held(t) for t in ticks if t < d), default=0)
            decided.append(d)
        else:  # its candidates ended before they would have passed its space
            assert all(held(t) <= space for t in ticks)
    assert decided, "no prompt decided: the test proves nothing"


def test_the_schedules_space_is_the_free_memory_share_capped_by_kv_space_mb(monkeypatch):
    from schemas.methods import SpeculativeRejection
    from tests.trio_helpers import trio_context
    from workers.accounting import memory
    from workers.engines.hf import HfDecoder
    from workers.pool.schedules import schedule_space

    from dataclasses import replace

    sr = {"name": "speculative_rejection"}
    # a context without a KV space of its own: the decoder reads the device's free memory when asked
    decoder = HfDecoder(replace(trio_context(), kv_space=None), SpeculativeRejection(**sr, n=4))
    real = schedule_space(SpeculativeRejection(**sr), decoder.kv_space())  # the host's own memory on CPU
    assert isinstance(real, int) and 0 < real < 2**62
    gib = 2**30
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 10 * gib)
    space = decoder.kv_space()
    assert schedule_space(SpeculativeRejection(**sr), space) == int(0.8 * 10 * gib)
    assert schedule_space(SpeculativeRejection(**sr, memory_fraction=0.5), space) == 5 * gib
    assert schedule_space(SpeculativeRejection(**sr, kv_space_mb=100), space) == 100 * 2**20
    assert schedule_space(SpeculativeRejection(**sr, memory_budget_mb=10**6), space) == 8 * gib
    monkeypatch.setattr(memory, "host_available_bytes", lambda: None)
    with pytest.raises(ValueError, match="method.kv_space_mb"):
        schedule_space(SpeculativeRejection(**sr), decoder.kv_space())
    assert schedule_space(SpeculativeRejection(**sr, memory_budget_mb=2), decoder.kv_space()) == 2 * 2**20  # old name


def test_the_memory_schedule_records_its_budget_and_runs_on_cpu_without_one(items):
    from schemas.rows import STATS_FIELDS

    assert "kv_space_bytes" in STATS_FIELDS
    gen = {"max_new_tokens": 8}
    kv = model_kv_bytes(trio().engine.target)
    # a pool's space smaller than a prompt's (4 candidates, 1 at full length: about 30 x 2 KiB) bounds it
    prompts, capped, _ = run_trio({"name": "speculative_rejection", "n": 4, "kv_space_mb": 0.02}, items[:2], gen)
    assert [r.stats["kv_space_bytes"] for r in capped] == [int(0.02 * 2**20)] * 2
    assert all((len(p.ids) + 8) * kv > 0.02 * 2**20 for p in prompts)
    prompts, minimal, _ = run_trio({"name": "speculative_rejection", "n": 4}, items[:2], gen)  # nothing configured
    for p, r in zip(prompts, minimal):
        assert r.stats["kv_space_bytes"] == (len(p.ids) + 1 * 8) * kv and r.best_index is not None
    _, fixed, _ = run_trio({"name": "speculative_rejection", "n": 4, "schedule": "fixed"}, items[:2], gen)
    assert all("kv_space_bytes" not in r.stats for r in fixed)  # null in the output row
