"""Oracles of the decoding core on the bundled trio (CPU, float32)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trio_helpers import demo_items, run_trio, tokens_of, trio, trio_prompts
from workers.accounting.cost import Meter
from workers.decoding.batch import forward, left_pad
from workers.decoding.kvcache import model_kv_bytes
from workers.decoding.sampling import Warp
from workers.decoding.target import TargetSampler

BON8 = {"name": "best_of_n", "n": 8}


@pytest.fixture(scope="module")
def items():
    return demo_items(4)


def test_greedy_best_of_n_matches_generate(items):
    runner = trio()
    prompts, results, _ = run_trio({"name": "best_of_n", "n": 3}, items, {"temperature": 0, "max_new_tokens": 40})
    for p, res in zip(prompts, results):
        ids = torch.tensor([p.ids])
        ref = runner.engine.target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
            eos_token_id=runner.eos_ids, pad_token_id=runner.pad_id,
        )[0, len(p.ids):].tolist()
        assert ref and len(ref) > 3
        for cand in res.candidates:
            assert cand.tokens == ref


def test_prompts_batched_give_the_same_results_as_alone(items):
    bon = {"name": "best_of_n", "n": 6}
    _, together, _ = run_trio(bon, items)
    for i, item in enumerate(items):
        _, alone, _ = run_trio(bon, [item])
        assert tokens_of(alone)[0] == tokens_of(together)[i]
        assert alone[0].best_index == together[i].best_index
        for a, b in zip(alone[0].candidates, together[i].candidates):
            assert a.reward == pytest.approx(b.reward, abs=1e-4)


def test_same_seed_same_output_and_other_seed_differs(items):
    a = run_trio(BON8, items, seed=3)[1]
    b = run_trio(BON8, items, seed=3)[1]
    c = run_trio(BON8, items, seed=4)[1]
    assert tokens_of(a) == tokens_of(b)
    assert [r.best_index for r in a] == [r.best_index for r in b]
    assert tokens_of(a) != tokens_of(c)


@pytest.mark.parametrize(
    "schedule",
    [
        {"schedule": "fixed", "every_k_tokens": 6},
        {"schedule": "memory", "kv_space_mb": 0.5},
    ],
)
def test_speculative_rejection_with_alpha_zero_is_best_of_n(items, schedule):
    n = 8
    bon = run_trio({"name": "best_of_n", "n": n}, items)[1]
    sr = run_trio({"name": "speculative_rejection", "n": n, "alpha": 0.0, **schedule}, items)[1]
    assert tokens_of(sr) == tokens_of(bon)
    assert any(r.stats["rejection_rounds"] > 0 for r in sr), "the schedule never decided: the test proves nothing"
    for s, b in zip(sr, bon):
        assert s.best_index == b.best_index
        assert [c.finish_reason for c in s.candidates] == [c.finish_reason for c in b.candidates]
        for cs, cb in zip(s.candidates, b.candidates):
            assert cs.reward == pytest.approx(cb.reward, abs=1e-4)


def test_speculative_rejection_cuts_the_lowest_alpha_fraction(items):
    n, alpha, k = 16, 0.5, 8
    method = {"name": "speculative_rejection", "n": n, "alpha": alpha, "schedule": "fixed", "every_k_tokens": k}
    _, results, _ = run_trio(method, items)
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


def test_sequence_selection_keeps_the_cache_exact(items):
    runner = trio()
    prompts = trio_prompts(items[:3])
    engine = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0)
    with torch.inference_mode():
        state = engine.prefill([p.ids for p in prompts], 4, [p.rng_key for p in prompts], [40] * 3)
        for _ in range(5):
            engine.step(state)
        keep = torch.tensor([1, 2, 6, 9, 11])
        state.select(keep)
        state.mask = torch.cat([state.mask, state.mask.new_ones(state.size, 1)], 1)
        got = forward(runner.engine.target, "target", state.pending[:, None], state.mask, state.cache, state.group,
                      engine.work)
        for r in range(state.size):
            seq = prompts[int(state.group[r])].ids + state.tokens[r, : int(state.length[r])].tolist()
            ref = runner.engine.target(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(got[r, -1], ref, atol=1e-4, rtol=1e-4)


def test_prefill_is_once_per_prompt_and_tokens_are_counted(items):
    prompts, results, meter = run_trio(BON8, items)
    for i, (p, res) in enumerate(zip(prompts, results)):
        generated = sum(len(c.tokens) for c in res.candidates)
        longest = max(len(c.tokens) for c in res.candidates)
        # the prompt once, plus every generated token but each sequence's last (never fed back)
        assert int(meter.tokens["target"][i]) >= len(p.ids) + generated - len(res.candidates)
        assert int(meter.tokens["target"][i]) < 2 * len(p.ids) + generated
        assert int(meter.forwards["target"][i]) == longest
        assert int(meter.forwards["reward"][i]) >= 1


def test_kv_bytes_per_token_from_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert model_kv_bytes(model) == 2 * 3 * 2 * 16 * 2


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], 0, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    from workers.decoding.batch import position_ids

    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_quality_measures_run_after_the_cost_window_closes(items, monkeypatch):
    """The Runner bills the method alone: a method with a loop of its own (beam search) has the perplexity forward
    of its measures after the costs are taken."""
    import time

    import workers.actor.runner as runner_module
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    runner = Runner(config(method={"name": "beam", "num_beams": 2}, generation={"max_new_tokens": 8}))
    events = []
    add_perplexities, per_prompt = runner_module.add_perplexities, Meter.per_prompt

    def slow_measures(ctx, prompts, results):
        events.append("measures")
        time.sleep(1.0)
        add_perplexities(ctx, prompts, results)

    def costs(meter, *args, **kwargs):
        events.append("costs")
        return per_prompt(meter, *args, **kwargs)

    monkeypatch.setattr(runner_module, "add_perplexities", slow_measures)
    monkeypatch.setattr(Meter, "per_prompt", costs)
    start = time.perf_counter()
    out = runner.run(items[:2])
    total = time.perf_counter() - start
    assert events == ["costs", "measures"]
    for row in out:
        assert row["stats"]["perplexity"] is not None  # the measures ran
        assert row["cost"]["wall_seconds"] <= total - 1.0  # and were not timed
        assert row["cost"]["device_seconds"] <= total - 1.0


@pytest.mark.parametrize("method, generation", [({"name": "greedy"}, {"temperature": 0}),
                                                ({"name": "best_of_n", "n": 4}, {"temperature": 0.7, "top_p": 0.9}),
                                                ({"name": "speculative_rejection", "n": 4, "schedule": "fixed",
                                                  "every_k_tokens": 4}, {"temperature": 1.3, "top_k": 20})])
def test_a_pools_perplexity_and_logprob_come_from_its_decoding_and_equal_a_scoring_forward(items, method, generation):
    """Paper 001's logprob reward (ln p(Y|X) / len(Y)) and the perplexity, read from the target's logits at each
    sampled token (temperature 1, before the warp), equal a separate forward of the target over prompt and response,
    under any warp; the logprob reward then costs no reward forward."""
    from workers.decoding.logprobs import response_logprobs

    gen = {"max_new_tokens": 12, **generation}
    prompts, results, meter = run_trio(method, items[:3], gen, reward="logprob")
    target = trio().engine.target
    for p, res in zip(prompts, results):
        cands = [c for c in res.candidates if c.tokens]
        logps, _ = response_logprobs(target, trio().pad_id, [p.ids] * len(cands), [c.tokens for c in cands])
        for c, logp in zip(cands, logps):
            assert c.logprob == pytest.approx(float(logp.double().sum()), abs=1e-3)
            if c.finish_reason != "rejected":
                assert c.reward == pytest.approx(float(logp.double().mean()), abs=1e-4)
            for partial, t in zip(c.partial_rewards, res.stats["decision_tokens"]):
                assert partial == pytest.approx(float(logp[:t].double().mean()), abs=1e-4)
        best = res.candidates[res.best_index]
        ref = float(response_logprobs(target, trio().pad_id, [p.ids], [best.tokens])[0][0].double().mean())
        assert res.stats["perplexity"] == pytest.approx(math.exp(-ref), rel=1e-4)
    assert int(meter.tokens["reward"].sum()) == 0 and int(meter.forwards["reward"].sum()) == 0


def test_host_memory_falls_back_to_sysconf_without_proc_meminfo(monkeypatch):
    from workers.accounting import memory

    assert memory.host_available_bytes() > 0  # MemAvailable

    def no_file(*args, **kwargs):
        raise OSError("no /proc here")

    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}

    def sysconf(name):
        if name not in pages:
            raise ValueError(f"unrecognized configuration name {name!r}")  # as os.sysconf says it
        return pages[name]

    monkeypatch.setattr(memory, "open", no_file, raising=False)
    monkeypatch.setattr(memory.os, "sysconf", sysconf)
    assert memory.host_available_bytes() == 1000 * 4096
    pages.clear()  # sysconf knows neither name either
    assert memory.host_available_bytes() is None


def test_unknown_context_length_warns_once_and_skips_only_that_check(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import workers.engines.hf as hf_module
    from tests.trio_helpers import config
    from workers.actor.runner import Runner
    from workers.decoding.kvcache import context_length

    load = hf_module.load_causal_lm

    def without_context(*args, **kwargs):
        loaded = load(*args, **kwargs)
        cfg = loaded.model.config.get_text_config()
        del cfg.max_position_embeddings
        monkeypatch.delattr(type(cfg), "max_position_embeddings", raising=False)  # the class default too
        return loaded

    monkeypatch.setattr(hf_module, "load_causal_lm", without_context)
    cfg = config(method={"name": "greedy"}, generation={"max_new_tokens": 12})
    with caplog.at_level(logging.WARNING, logger="workers.actor.runner"):
        runner = Runner(cfg)
    assert context_length(runner.engine.target.config) is None and runner.context_length is None
    no_field = SimpleNamespace(get_text_config=lambda: SimpleNamespace())
    assert context_length(no_field) is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "workers.actor.runner"]
    assert len(warnings) == 1
    assert cfg.models.target in warnings[0] and "not checked against a context length" in warnings[0]
    long_prompt = [{"role": "user", "content": "word " * 3000}]
    ready, errors = runner.prepare([{"prompt_id": "long", "prompt": long_prompt},
                                    {"prompt_id": "blank", "prompt": [{"role": "user", "content": " "}]}])
    assert [p.prompt_id for _, p in ready] == ["long"] and ready[0][1].limit == 12
    assert len(ready[0][1].ids) > 3000
    assert list(errors) == [1] and "empty prompt" in errors[1]["error"]  # the other checks still apply


def test_on_a_scoring_clock_decisions_come_on_its_ticks_and_share_reward_forwards(items):
    """method.scoring_steps = 4: every decision at a multiple of 4 tokens of its prompt's own responses, and the
    prompts' decisions and final scorings share forwards, so the reward model runs fewer than at every step."""
    forwards, decisions = {}, {}
    for every in (1, 4):
        method = {"name": "speculative_rejection", "n": 16, "alpha": 0.5, "scoring_steps": every}
        _, results, meter = run_trio(method, items)
        decisions[every] = [d for r in results for d in r.stats["decision_tokens"]]
        forwards[every] = float(meter.reward_steps.sum())  # each forward's share sums to 1 over its prompts
    assert decisions[4] and decisions[1], "no prompt decided: the test proves nothing"
    assert all(d % 4 == 0 for d in decisions[4]), decisions[4]
    assert any(d % 4 for d in decisions[1])  # without the clock, decisions fall where each prompt's memory says
    assert forwards[4] < forwards[1], forwards
