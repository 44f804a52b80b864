"""Oracles of the decoding core on the bundled trio (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from tests.trio_helpers import config, demo_rows, run_method, tokens_of
from workers.cost import Meter
from workers.engine import Engine, forward, kv_bytes_per_token, left_pad
from workers.methods.rejection import cut_value
from workers.runner import Runner
from workers.sampling import Warp


@pytest.fixture(scope="module")
def rows():
    return demo_rows(4)


def test_greedy_best_of_n_matches_generate(rows):
    runner = Runner(config(method={"name": "best_of_n", "n": 3}, generation={"temperature": 0, "max_new_tokens": 40}))
    prompts, results, _ = run_method(runner, rows)
    for p, res in zip(prompts, results):
        ids = torch.tensor([p.ids])
        ref = runner.target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
            eos_token_id=runner.eos_ids, pad_token_id=runner.pad_id,
        )[0, len(p.ids):].tolist()
        assert ref and len(ref) > 3
        for cand in res.candidates:
            assert cand.tokens == ref


def test_prompts_batched_give_the_same_results_as_alone(rows):
    runner = Runner(config(method={"name": "best_of_n", "n": 6}))
    _, together, _ = run_method(runner, rows)
    for i, row in enumerate(rows):
        _, alone, _ = run_method(runner, [row])
        assert tokens_of(alone)[0] == tokens_of(together)[i]
        assert alone[0].best_index == together[i].best_index
        for a, b in zip(alone[0].candidates, together[i].candidates):
            assert a.reward == pytest.approx(b.reward, abs=1e-4)


def test_same_seed_same_output_and_other_seed_differs(rows):
    a = run_method(Runner(config(seed=3)), rows)[1]
    b = run_method(Runner(config(seed=3)), rows)[1]
    c = run_method(Runner(config(seed=4)), rows)[1]
    assert tokens_of(a) == tokens_of(b)
    assert [r.best_index for r in a] == [r.best_index for r in b]
    assert tokens_of(a) != tokens_of(c)


@pytest.mark.parametrize(
    "schedule",
    [
        {"schedule": "fixed", "every_k_tokens": 6},
        {"schedule": "memory", "memory_budget_mb": 0.5},
    ],
)
def test_speculative_rejection_with_alpha_zero_is_best_of_n(rows, schedule):
    n = 8
    bon = run_method(Runner(config(method={"name": "best_of_n", "n": n})), rows)[1]
    sr = run_method(
        Runner(config(method={"name": "speculative_rejection", "n": n, "alpha": 0.0, **schedule})), rows
    )[1]
    assert tokens_of(sr) == tokens_of(bon)
    assert any(r.stats["rejection_rounds"] > 0 for r in sr), "the schedule never decided: the test proves nothing"
    for s, b in zip(sr, bon):
        assert s.best_index == b.best_index
        assert [c.finish_reason for c in s.candidates] == [c.finish_reason for c in b.candidates]
        for cs, cb in zip(s.candidates, b.candidates):
            assert cs.reward == pytest.approx(cb.reward, abs=1e-4)


def test_speculative_rejection_cuts_the_lowest_alpha_fraction(rows):
    n, alpha, k = 16, 0.5, 8
    cfg = config(method={"name": "speculative_rejection", "n": n, "alpha": alpha, "schedule": "fixed",
                         "every_k_tokens": k})
    _, results, _ = run_method(Runner(cfg), rows)
    for res in results:
        rejected = [c for c in res.candidates if c.finish_reason == "rejected"]
        assert rejected, "alpha = 0.5 rejected nobody"
        for c in rejected:
            assert c.reward is None and c.partial_rewards and len(c.tokens) % k == 0
        # at the first decision every survivor scored at least the cut, every rejected one below it
        survivors = [c for c in res.candidates if c.finish_reason != "rejected" and c.partial_rewards]
        cut_rejected = [c for c in rejected if len(c.partial_rewards) == 1]
        assert cut_rejected and survivors
        assert max(c.partial_rewards[0] for c in cut_rejected) < min(c.partial_rewards[0] for c in survivors)
        best = res.candidates[res.best_index]
        assert best.finish_reason in ("eos", "length")
        assert best.reward == max(c.reward for c in res.candidates if c.reward is not None)


def test_cut_value_is_the_lower_order_statistic():
    assert cut_value([3.0, 1.0, 2.0, 4.0], 0.0) == 1.0
    assert cut_value([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0  # floor(0.5*4) = 2 values strictly below
    assert cut_value([1.0, 2.0], 0.5) == 2.0
    assert cut_value([5.0], 0.9) == 5.0


def test_row_selection_keeps_the_cache_exact(rows):
    runner = Runner(config(generation={"temperature": 1.0}))
    prompts, _ = runner.prepare(rows[:3])
    prompts = [p for _, p in prompts]
    meter = Meter(len(prompts))
    engine = Engine(runner.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0, meter)
    with torch.inference_mode():
        state = engine.prefill([p.ids for p in prompts], 4, [p.key for p in prompts], [40] * 3)
        for _ in range(5):
            engine.step(state)
        keep = torch.tensor([1, 2, 6, 9, 11])
        state.select(keep)
        state.mask = torch.cat([state.mask, state.mask.new_ones(state.size, 1)], 1)
        got = forward(runner.target, "target", state.pending[:, None], state.mask, state.cache, state.group, meter)
        for r in range(state.size):
            seq = prompts[int(state.group[r])].ids + state.tokens[r, : int(state.length[r])].tolist()
            ref = runner.target(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(got[r, -1], ref, atol=1e-4, rtol=1e-4)


def test_prefill_is_once_per_prompt_and_tokens_are_counted(rows):
    runner = Runner(config(method={"name": "best_of_n", "n": 8}))
    prompts, results, meter = run_method(runner, rows)
    for i, (p, res) in enumerate(zip(prompts, results)):
        generated = sum(len(c.tokens) for c in res.candidates)
        longest = max(len(c.tokens) for c in res.candidates)
        # the prompt once, plus every generated token but each row's last (never fed back)
        assert int(meter.tokens["target"][i]) >= len(p.ids) + generated - len(res.candidates)
        assert int(meter.tokens["target"][i]) < 2 * len(p.ids) + generated
        assert int(meter.forwards["target"][i]) == longest
        assert int(meter.forwards["reward"][i]) >= 1


def test_kv_bytes_per_token_from_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert kv_bytes_per_token(model) == 2 * 3 * 2 * 16 * 2


def test_memory_schedule_decides_when_the_cache_would_pass_the_budget(rows):
    runner = Runner(config())
    prompts, _ = runner.prepare(rows[:2])
    width = max(len(p.ids) for _, p in prompts)
    n, per_col = 8, kv_bytes_per_token(runner.target)
    rows_total = n * len(prompts)
    decide_at = 5  # generated tokens at the first decision
    # with g tokens generated the cache holds width + g - 1 columns (the last token is not yet fed); the next step
    # makes it width + g. A budget of width + decide_at - 1 columns is first passed by the step after decide_at.
    budget = rows_total * (width + decide_at - 1) * per_col
    cfg = config(method={"name": "speculative_rejection", "n": n, "alpha": 0.5, "memory_budget_mb": budget / 2**20})
    _, results, _ = run_method(Runner(cfg), rows[:2])
    assert results[0].stats["decision_tokens"][0] == decide_at


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], 0, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    from workers.engine import position_ids

    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
