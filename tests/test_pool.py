"""The one candidate pool (workers.pool): its decisions, cuts and results on a deterministic decoder, and the same
decisions, cuts, stats and reward costs through the hf engine's decoder as through a replay of that decoder's own
tokens (tests/test_vllm.py holds the same check for the vllm engine's decoder)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from schemas.methods import Sampling
from tests.metered import MeteredContext, decode
from tests.replay_decoder import ReplayDecoder, ScriptedScorer
from tests.trio_helpers import demo_items, params_of, run_trio, trio_context, trio_prompts
from workers.accounting.cost import Meter
from workers.candidates import PromptInput
from workers.decoding.kvcache import model_kv_bytes
from workers.pool.pool import Pool
from workers.pool.schedules import MemorySchedule

EOS = 0


class Tokenizer:
    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(str(t) for t in tokens if t != EOS)


def scripted_context(meter: Meter) -> MeteredContext:
    """A context whose reward is the mean of a response's tokens (a python-like reward: no reward tokens)."""

    def reward(items, _meter):
        return [float(sum(it.response_ids)) / max(1, len(it.response_ids)) for it in items]

    return MeteredContext(Tokenizer(), [EOS], EOS, ScriptedScorer(reward), Sampling(1.0, 1.0, 0, "target", 4), 0,
                          meter=meter)


def prompt(i: int) -> PromptInput:
    return PromptInput(f"p{i}", [{"role": "user", "content": "x"}], [7, 7, 7], i, 32)


# candidate c of a prompt emits the token c + 1 at every step; candidates 2 and 5 end early (EOS at 6 and 3 tokens)
STREAMS = {(f"p{i}", c): ([c + 1] * 5 + [EOS] if c == 2 else [c + 1] * 2 + [EOS] if c == 5 else [c + 1] * 20)
           for i in range(2) for c in range(6)}


def test_fixed_schedule_cuts_the_lowest_alpha_fraction_and_answers_with_the_best_finished():
    meter = Meter(2)
    sr = params_of({"name": "speculative_rejection", "n": 6, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 4,
                    "scoring_steps": 1})  # a decision at each prompt's own step (the scoring clock's tests are below)
    decoder = ReplayDecoder(6, STREAMS)
    results = decode(Pool.for_method(scripted_context(meter), decoder, sr), [prompt(0), prompt(1)])
    for res in results:
        # at 4 tokens candidate 5 has ended (reward (6 + 6 + 0) / 3 = 4.0): R_partial = {1, 2, 3, 4, 5 (running),
        # 4.0}; floor(0.5 * 6) = 3 values fall below the cut (the 4th smallest, 4.0): candidates 0, 1, 2 stop there.
        # At 8, b = 2: the cut is the larger partial, 5, so candidate 3 (4) stops; candidate 4 runs on alone (b = 1
        # cuts nobody) to its last token, at 20, deciding at 12 and 16.
        assert [c.finish_reason for c in res.candidates] == ["rejected"] * 4 + ["length", "eos"]
        assert [len(c.tokens) for c in res.candidates] == [4, 4, 4, 8, 20, 3]
        assert [c.partial_rewards for c in res.candidates] == [[1.0], [2.0], [3.0], [4.0, 4.0],
                                                               [5.0, 5.0, 5.0, 5.0], []]
        assert res.stats["decision_tokens"] == [4, 8, 12, 16] and res.stats["rejection_rounds"] == 4
        assert res.best_index == 4 and [c.reward for c in res.candidates[4:]] == [5.0, 4.0]  # eq. 6
        assert res.stats["finished_candidates"] == 2
        assert res.stats["generated_tokens"] == 4 * 3 + 8 + 20 + 3
        assert all(c.reward is None for c in res.candidates if c.finish_reason == "rejected")
    # rejected candidates leave the decoder at their decision
    assert sorted(decoder.dropped) == sorted((g, c) for g in range(2) for c in range(4))


def test_memory_schedule_decides_when_a_prompts_kv_would_pass_its_space_and_waits_after_a_round_that_cuts_nobody():
    meter = Meter(1)
    # the space of 2 candidates at full length: 3 prompt tokens + 2 x 32 = 67 tokens (of 1 byte); six running
    # responses of t tokens hold 3 + 6 (t + 1) after the next token, which passes 67 at t = 10
    streams = {("p0", c): [1] * 20 for c in range(6)}  # equal partial rewards: a cut keeps every tie
    schedule = MemorySchedule(2, 1, 10**6)
    pool = Pool(scripted_context(meter), ReplayDecoder(6, streams), 6, 0.5, schedule)
    (res,) = decode(pool, [prompt(0)])
    assert res.stats["decision_tokens"] == [10]  # once, not at every step after: the round rejected nobody
    assert res.stats["kv_space_bytes"] == 67 and all(c.finish_reason == "length" for c in res.candidates)


def test_memory_schedule_spaces_are_per_prompt_and_the_pool_space_bounds_how_many_run():
    """Two prompts whose spaces do not fit the pool's together run one after the other, and each decides exactly as
    it does alone (a prompt's decisions depend on its own candidates only)."""
    def run(prompts, pool_space):
        meter = Meter(len(prompts))
        decoder = ReplayDecoder(6, STREAMS)
        pool = Pool(scripted_context(meter), decoder, 6, 0.5, MemorySchedule(2, 1, pool_space), space=pool_space)
        starts = []
        start = decoder.start
        decoder.start = lambda groups, ps: (starts.append(list(groups)), start(groups, ps))[1]
        return decode(pool, prompts), starts

    alone = [run([prompt(i)], 10**6)[0][0] for i in range(2)]
    together, starts = run([prompt(0), prompt(1)], 100)  # a space is 67: one prompt at a time
    assert starts == [[0], [1]]
    _, both_at_once = run([prompt(0), prompt(1)], 10**6)
    assert both_at_once == [[0, 1]]
    for a, b in zip(alone, together):
        assert a.stats == b.stats
        assert [(c.tokens, c.finish_reason, c.partial_rewards) for c in a.candidates] == \
            [(c.tokens, c.finish_reason, c.partial_rewards) for c in b.candidates]


def test_places_a_cut_frees_start_a_waiting_prompt_in_the_step_of_the_cut_and_its_rows_stay_as_alone():
    """Width 9 holds one prompt of 6 candidates. Prompt 0's round at 4 tokens (3 rejected, 1 ended) leaves 2 running,
    so prompt 1 starts in that turn (after the decoder's 3rd step: a start holds the first token), not a step later,
    and both prompts decide as each does alone."""
    sr = params_of({"name": "speculative_rejection", "n": 6, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 4,
                    "scoring_steps": 1})  # a decision at each prompt's own step (the scoring clock's tests are below)

    def run(prompts, width):
        meter = Meter(len(prompts))
        decoder = ReplayDecoder(6, STREAMS, width=width)
        steps, starts = [0], []
        step, start = decoder.step, decoder.start
        decoder.step = lambda: (steps.__setitem__(0, steps[0] + 1), step())[1]
        decoder.start = lambda groups, ps: (starts.append((steps[0], list(groups))), start(groups, ps))[1]
        return decode(Pool.for_method(scripted_context(meter), decoder, sr), prompts), starts, meter

    (alone0,), _, _ = run([prompt(0)], 9)
    (res0, res1), starts, meter = run([prompt(0), prompt(1)], 9)
    assert starts == [(0, [0]), (3, [1])]  # prompt 0 reaches 4 tokens after 3 steps; its cut lets prompt 1 in at once
    assert meter.steps.sum().item() == pytest.approx(3 + 19)  # then prompt 1's longest candidate: 19 more steps
    for a, b in [(alone0, res0), (run([prompt(1)], 9)[0][0], res1)]:
        assert a.stats["decision_tokens"] == b.stats["decision_tokens"]
        assert [(c.tokens, c.finish_reason, c.partial_rewards) for c in a.candidates] == \
            [(c.tokens, c.finish_reason, c.partial_rewards) for c in b.candidates]


def test_what_the_decoder_holds_for_prompts_not_started_counts_in_the_pools_space():
    """The bytes a decoder holds for prompts prefilled ahead (`Decoder.waiting_bytes`) are part of what the running
    prompts leave: with a space of 10**6 and all but 100 of it held ahead, two prompts whose spaces are 67 each run
    one after the other (the first always starts), and each decides as alone."""
    def run(held):
        meter = Meter(2)
        decoder = ReplayDecoder(6, STREAMS)
        decoder.waiting_bytes = lambda: held
        pool = Pool(scripted_context(meter), decoder, 6, 0.5, MemorySchedule(2, 1, 10**6), space=10**6)
        starts = []
        start = decoder.start
        decoder.start = lambda groups, ps: (starts.append(list(groups)), start(groups, ps))[1]
        return decode(pool, [prompt(0), prompt(1)]), starts

    (free, free_starts), (held, held_starts) = run(0), run(10**6 - 100)
    assert free_starts == [[0, 1]] and held_starts == [[0], [1]]
    for a, b in zip(free, held):
        assert [(c.tokens, c.finish_reason, c.partial_rewards) for c in a.candidates] == \
            [(c.tokens, c.finish_reason, c.partial_rewards) for c in b.candidates]


def test_best_of_n_and_a_pool_of_one():
    meter = Meter(1)
    bon = params_of({"name": "best_of_n", "n": 6})
    (res,) = decode(Pool.for_method(scripted_context(meter), ReplayDecoder(6, STREAMS), bon), [prompt(0)])
    assert res.stats["rejection_rounds"] == 0 and [c.reward for c in res.candidates] == [1, 2, 2.5, 4, 5, 4]
    assert res.best_index == 4
    one = {("p0", 0): [9, 9, EOS]}
    greedy = params_of({"name": "greedy"})
    ctx = MeteredContext(Tokenizer(), [EOS], EOS, None, Sampling(0.0, 1.0, 0, "target", 4), 0, meter=meter)
    (res,) = decode(Pool.for_method(ctx, ReplayDecoder(1, one), greedy), [prompt(0)])
    assert res.best_index == 0 and res.candidates[0].reward is None and res.candidates[0].text == "9 9"


@pytest.mark.parametrize("schedule", [{"schedule": "fixed", "every_k_tokens": 4}, {"memory_candidates": 2}])
def test_the_hf_decoder_and_a_replay_of_its_tokens_give_the_same_decisions_cuts_and_stats(schedule):
    """Speculative Rejection through the hf engine's decoder, and through a decoder that replays each candidate's
    tokens (taken from Best-of-N with the same seed: a candidate's draws depend on its prompt and index only):
    the same decisions, rejections, partial and final rewards, answers, stats and reward costs."""
    items = demo_items(4)
    gen = {"max_new_tokens": 24}
    sr = {"name": "speculative_rejection", "n": 8, "alpha": 0.5, **schedule}
    prompts, real, real_meter = run_trio(sr, items, gen)
    _, bon, _ = run_trio({"name": "best_of_n", "n": 8}, items, gen)
    streams = {(p.prompt_id, c): cand.tokens for p, r in zip(prompts, bon) for c, cand in enumerate(r.candidates)}
    meter = Meter(len(prompts))
    ctx = trio_context(meter, gen)
    decoder = ReplayDecoder(8, streams, model_kv_bytes(ctx.target), 2**40)
    with torch.inference_mode():
        replayed = decode(Pool.for_method(ctx, decoder, params_of(sr)), trio_prompts(items, 24))
    assert any(r.stats["rejection_rounds"] for r in real), "the schedule never decided: the test proves nothing"
    for a, b in zip(real, replayed):
        assert a.stats["decision_tokens"] == b.stats["decision_tokens"]
        assert [(c.tokens, c.finish_reason) for c in a.candidates] == [(c.tokens, c.finish_reason) for c in b.candidates]
        # the same scoring calls of the same items: the same rewards, bit for bit
        assert [c.partial_rewards for c in a.candidates] == [c.partial_rewards for c in b.candidates]
        assert [c.reward for c in a.candidates] == [c.reward for c in b.candidates]
        assert a.best_index == b.best_index
        keys = set(a.stats) - {"perplexity", "hard_constraint", "soft_constraint"}
        assert {k: a.stats[k] for k in keys} == {k: b.stats[k] for k in keys}
    for field in ("tokens", "forwards"):
        assert getattr(real_meter, field)["reward"].tolist() == getattr(meter, field)["reward"].tolist()


def test_the_hf_decoder_prefills_waiting_prompts_ahead_in_one_forward_counted_as_a_step(monkeypatch):
    """On the hf engine a prefill is a forward of its own, which a device bills about as a step: the decoder
    prefills the prompts that wait ahead, many in one forward, so the six prompts here (two at a time in a width of
    8) cost one prefill forward, not one per start; the meter's steps are the decoding steps and that forward. With
    nothing prefilled ahead (AHEAD_TOKENS 0) each start is a prefill of its own, and the rows are the same."""
    from workers.decoding.target import TargetSampler
    from workers.engines.hf import HfDecoder

    items, gen = demo_items(6), {"max_new_tokens": 12}
    prompts = trio_prompts(items, 12)
    bon = params_of({"name": "best_of_n", "n": 4})

    def run():
        calls = {"encode": 0, "step": 0}
        encode, step = TargetSampler.encode, HfDecoder.step

        def counted_encode(self, *args):
            calls["encode"] += 1
            return encode(self, *args)

        def counted_step(self):
            calls["step"] += self._running()
            return step(self)

        monkeypatch.setattr(TargetSampler, "encode", counted_encode)
        monkeypatch.setattr(HfDecoder, "step", counted_step)
        meter = Meter(len(prompts))
        ctx = replace(trio_context(meter, gen), width=8)
        with torch.inference_mode():
            results = decode(Pool.for_method(ctx, HfDecoder(ctx, bon), bon), prompts)
        assert meter.steps.sum().item() == pytest.approx(calls["encode"] + calls["step"])
        assert meter.seq_steps.sum().item() == sum(len(c.tokens) - 1 for r in results for c in r.candidates) + \
            len(prompts)
        return results, calls

    ahead, calls = run()
    assert calls["encode"] == 1 and calls["step"] >= 11
    monkeypatch.setattr(HfDecoder, "AHEAD_TOKENS", 0)
    apart, calls = run()
    assert calls["encode"] >= 3
    for a, b in zip(ahead, apart):
        assert [c.tokens for c in a.candidates] == [c.tokens for c in b.candidates]
