"""Oracles of CDSL (paper 000, Algorithm 1) and its baselines CDLH (Algorithm 2) and CDLH-appx, batched.

The reference implementations below follow the papers' pseudocode line by line for one prompt, recomputing every
distribution from scratch (no cache); the batched methods must take the same tokens and the same states.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_speculative import (  # noqa: F401  (one_thread is an autouse fixture)
    EOS, coverage_reward, greedy_reference, one_thread, pair, run, toy_context, toy_prompts,
)
from workers.methods.cdsl import S1, S2, S3, S4, cdsl_states, run_cdsl
from workers.decoding.logprobs import perplexities
from workers.methods.measures import add_measures, constraint_stats


# ---------------------------------------------------------------------------------------------------------------
# References (one prompt, no cache)


def logits_after(model, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([seq])).logits[0, -1].float()


def greedy_tokens(model, seq: list[int], d: int, stop_at_eos: bool) -> list[int]:
    out: list[int] = []
    for _ in range(d):
        out.append(int(logits_after(model, seq + out).argmax()))
        if stop_at_eos and out[-1] == EOS:
            break
    return out


def lookahead_token(target, lookahead_model, pfx, resp, k, d, reward) -> int:
    """One CDLH token after pfx (resp: the response part of pfx, for the reward): Algorithm 2, lines 5-21."""
    cands = torch.topk(logits_after(target, pfx), k).indices.tolist()
    best, best_r = None, -float("inf")
    for c in cands:
        lh = [] if c == EOS else greedy_tokens(lookahead_model, pfx + [c], d, stop_at_eos=True)
        r = reward(resp + [c] + lh)
        if r > best_r:
            best, best_r = c, r
    return best


def reference_cdlh(target, lookahead_model, prompt, limit, k, d, reward) -> list[int]:
    out: list[int] = []
    while len(out) < limit and not (out and out[-1] == EOS):
        out.append(lookahead_token(target, lookahead_model, prompt + out, out, k, d, reward))
    return out


def reference_cdsl(target, draft, prompt, limit, d, k, a_t, r_t, b, reward):
    """Algorithm 1 with hard rejection; returns the response and the count of each state."""
    out: list[int] = []
    counts = [0, 0, 0, 0]
    while len(out) < limit and not (out and out[-1] == EOS):
        pfx = prompt + out
        x = greedy_tokens(draft, pfx, d, stop_at_eos=False)  # lines 5-8
        with torch.inference_mode():
            y = target(torch.tensor([pfx + x])).logits[0, len(pfx) - 1 : -1].argmax(-1).tolist()  # lines 10-15
        n = 0
        while n < d and y[n] == x[n]:  # lines 14-20
            n += 1
        ends = EOS in x[:n]
        if ends:
            n = x.index(EOS) + 1
        r = reward(out + x[:n])  # line 22
        state = int(cdsl_states(torch.tensor([n]), d, torch.tensor([r]), a_t, r_t)[0])
        counts[state - 1] += 1
        acc = x[:n]
        O = None
        if ends or state == S1:  # line 27
            O = acc
        else:
            if state in (S2, S3):  # lines 30-43
                X: list[int] = []
                for _ in range(b):
                    X.append(int(logits_after(target, pfx + acc + X).argmax()))
                    lh = [] if X[-1] == EOS else greedy_tokens(draft, pfx + acc + X, d, stop_at_eos=True)
                    if reward(out + acc + X + lh) >= r_t:
                        O = acc + X
                        break
                    if X[-1] == EOS:
                        break
            if O is None:  # lines 44-47 and 50-51
                O = acc + [lookahead_token(target, draft, pfx + acc, out + acc, k, d, reward)]
        if EOS in O:
            O = O[: O.index(EOS) + 1]
        out += O[: limit - len(out)]
    return out, counts


def scripted(wanted: list[set[int]]):
    """The batched methods' reward and, per prompt, the same reward for the references."""
    return coverage_reward(wanted), [lambda toks, w=w: len(w & set(toks)) / len(w) for w in wanted]


def wanted_sets(count: int, vocab: int = 48, size: int = 6, seed: int = 0) -> list[set[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [set(torch.randperm(vocab - 2, generator=gen)[:size].add(2).tolist()) for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------
# States


def test_states_follow_algorithm_1():
    n = torch.tensor([3, 3, 1, 1, 2, 0, 0])
    r = torch.tensor([0.5, 0.2, 0.5, 0.2, 0.3, 0.9, 0.1], dtype=torch.float64)
    # a = n / 3 against a_t = 0.6 (2/3 >= 0.6 is high), r against r_t = 0.3 (0.3 is high)
    assert cdsl_states(n, 3, r, 0.6, 0.3).tolist() == [S1, S4, S3, S2, S1, S3, S2]
    # a_t = 0 makes every acceptance high; an empty accepted prefix is never S1 (it would emit nothing)
    assert cdsl_states(n, 3, r, 0.0, 0.3).tolist() == [S1, S4, S1, S4, S1, S3, S4]


# ---------------------------------------------------------------------------------------------------------------
# Each state's action, forced by the thresholds, against the reference


def compare_with_reference(a_t, r_t, b, draft_is_target=False, count=4, limit=16, d=3, k=3, seed=21):
    target, draft = pair()
    if draft_is_target:
        draft = target
    prompts = toy_prompts(count, 48, limit, seed=seed)
    wanted = wanted_sets(count, seed=seed)
    batched_reward, refs = scripted(wanted)
    # run_cdsl itself, so that thresholds outside the config's range can force a state
    ctx = toy_context(target, draft, {}, batched_reward, num_prompts=count)
    results, _ = run_cdsl(ctx, prompts, d, k, a_t, r_t, b, "hard")
    total = [0, 0, 0, 0]
    for p, res, ref_r in zip(prompts, results, refs):
        tokens, counts = reference_cdsl(target, draft, p.ids, limit, d, k, a_t, r_t, b, ref_r)
        assert res.candidates[0].tokens == tokens
        assert res.stats["state_counts"] == counts
        total = [x + y for x, y in zip(total, counts)]
    return prompts, results, total


def test_s1_accepts_the_validated_tokens_and_no_bonus():
    # a_t = 0 and r_t below any reward: every iteration with n > 0 is S1; the draft is the target, so n = d
    prompts, results, total = compare_with_reference(0.0, -1.0, 1, draft_is_target=True, limit=15)
    assert total[0] > 0 and total[1] == total[3] == 0
    for p, res in zip(prompts, results):
        assert res.candidates[0].tokens == greedy_reference(pair()[0], p.ids, 15)
        if EOS not in res.candidates[0].tokens:
            assert res.stats["mean_accepted_tokens"] == 3.0  # exactly d per iteration: no bonus token
            assert res.stats["target_calls_per_token"] < 0.5


def test_s2_falls_back_to_a_cdlh_appx_token_when_step_1_fails():
    # a_t above any acceptance, r_t above any reward: always S2, step 1 never passes, so step 2 decides
    _, _, total = compare_with_reference(1.01, 1.01, 2)
    assert total[1] > 0 and total[0] == total[2] == total[3] == 0


def test_s3_step_1_takes_the_targets_greedy_token():
    # a_t above any acceptance, r_t below any reward: always S3, and step 1 passes at its first token, so every
    # iteration emits the accepted greedy-matching drafts and the target's argmax: the target's greedy decoding
    prompts, results, total = compare_with_reference(1.01, -1.0, 1)
    assert total[2] > 0 and total[0] == total[1] == total[3] == 0
    for p, res in zip(prompts, results):
        assert res.candidates[0].tokens == greedy_reference(pair()[0], p.ids, 16)


def test_s4_adds_one_cdlh_appx_token_to_the_validated_ones():
    _, results, total = compare_with_reference(0.0, 1.01, 1, draft_is_target=True, limit=16)
    assert total[3] > 0 and total[0] == total[1] == total[2] == 0
    for res in results:
        if EOS not in res.candidates[0].tokens:
            assert res.stats["mean_accepted_tokens"] == 4.0  # d validated tokens and one CDLH-appx token


def test_all_four_states_in_one_batch_match_the_reference():
    _, _, total = compare_with_reference(0.6, 0.3, 2, count=6, limit=20, seed=22)
    assert all(c > 0 for c in total), f"a state never occurred: {total}"


def test_speculative_sampling_validation_accepts_everything_when_draft_is_target():
    target, _ = pair(sharpness=1.0)
    prompts = toy_prompts(3, 48, 12, seed=23)
    batched_reward, _ = scripted(wanted_sets(3, seed=23))
    method = {"name": "cdsl", "lookahead": 3, "top_k": 3, "accept_threshold": 0.6, "reward_threshold": 0.3, "b": 1,
              "validation": "sampling"}
    results = run(method, toy_context(target, target, {"temperature": 1.0}, batched_reward, 3), prompts)
    for res in results:
        assert res.stats["acceptance_rate"] == 1.0  # p = q: min(1, p/q) = 1
        assert res.stats["state_counts"][1] == res.stats["state_counts"][2] == 0


# ---------------------------------------------------------------------------------------------------------------
# CDLH and CDLH-appx


def test_cdlh_and_cdlh_appx_match_algorithm_2():
    target, draft = pair()
    prompts = toy_prompts(4, 48, 10, seed=24)
    batched_reward, refs = scripted(wanted_sets(4, seed=24))
    for name, lookahead_model in (("cdlh", target), ("cdlh_appx", draft)):
        method = {"name": name, "lookahead": 3, "top_k": 3}
        ctx = toy_context(target, draft, {}, batched_reward, num_prompts=4)
        results = run(method, ctx, prompts)
        for p, res, ref_r in zip(prompts, results, refs):
            assert res.candidates[0].tokens == reference_cdlh(target, lookahead_model, p.ids, 10, 3, 3, ref_r)
        calls = results[0].stats
        if name == "cdlh":
            assert calls["draft_calls_per_token"] == 0.0 and calls["target_calls_per_token"] > 3.0
        else:
            assert calls["draft_calls_per_token"] > 3.0 and calls["target_calls_per_token"] <= 1.1


# ---------------------------------------------------------------------------------------------------------------
# Measures shared by every method


def test_constraint_stats():
    assert constraint_stats("The dog runs across the field", ["dog", "run", "field"]) == {
        "hard_constraint": 1.0, "soft_constraint": 1.0}
    got = constraint_stats("A dog sleeps", ["dog", "run", "field", "ball"])
    assert got == {"hard_constraint": 0.0, "soft_constraint": 0.25}
    assert constraint_stats("anything", None) == {}


def test_perplexity_is_the_targets_and_outside_the_cost():
    target, draft = pair()
    prompts = toy_prompts(2, 48, 8, seed=25)
    ctx = toy_context(target, draft, {"temperature": 0}, num_prompts=2)
    results = run({"name": "greedy"}, ctx, prompts)
    add_measures(ctx, prompts, results)
    forwards = int(ctx.meter.forwards["target"].sum())
    assert forwards == sum(len(r.candidates[0].tokens) for r in results)  # the perplexity forward is not charged
    for p, res in zip(prompts, results):
        toks = res.candidates[0].tokens
        with torch.inference_mode():
            lp = torch.log_softmax(target(torch.tensor([p.ids + toks])).logits[0].float(), -1)
        nll = -sum(float(lp[len(p.ids) - 1 + i, t]) for i, t in enumerate(toks)) / len(toks)
        assert abs(res.stats["perplexity"] - float(torch.tensor(nll).exp())) < 1e-3 * res.stats["perplexity"]
    assert perplexities(target, 0, [[3, 4]], [[]]) == [None]


@pytest.mark.parametrize("elements", [1 << 24, 1])  # one log-sum-exp for the batch, or one per position
def test_perplexity_by_gather_and_logsumexp_is_the_log_softmax_one(elements, monkeypatch):
    """On the bundled trio: the chunked gather-then-logsumexp gives the log_softmax numbers over the whole sequence."""
    from tests.trio_helpers import demo_items, trio, trio_prompts
    from workers.decoding import logprobs
    from workers.decoding.batch import left_pad, position_ids

    monkeypatch.setattr(logprobs, "LOGSUMEXP_ELEMENTS", elements)
    target = trio().engine.target
    prompts = [p.ids for p in trio_prompts(demo_items(5))]
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.get_text_config().vocab_size
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 7, 3, 12, 5)]
    got = perplexities(target, trio().pad_id, prompts, responses)
    with torch.inference_mode():  # the former formula: log_softmax over [B, L, V] in float32
        ids, mask = left_pad([p + r for p, r in zip(prompts, responses)], trio().pad_id, torch.device("cpu"))
        logits = target(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    for r, (value, resp) in enumerate(zip(got, responses)):
        ref = math.exp(-float(logp[r, -len(resp):].double().mean()))
        assert abs(value - ref) <= 1e-5 * ref


def test_trio_cdsl_with_the_lexical_reward():
    from tests.trio_helpers import demo_items, run_trio

    _, results, meter = run_trio({"name": "cdsl"}, demo_items(4), {"temperature": 0, "max_new_tokens": 32},
                                 reward="lexical")
    for g, r in enumerate(results):
        counts = r.stats["state_counts"]
        assert len(counts) == 4 and sum(counts) == round(len(r.candidates[0].tokens) / r.stats["mean_accepted_tokens"])
        assert r.stats["soft_constraint"] is not None and r.stats["hard_constraint"] in (0.0, 1.0)
        assert r.candidates[0].reward == r.stats["soft_constraint"]  # the lexical reward is concept coverage
        assert 0 < r.stats["target_calls_per_token"] < 1.0
    assert int(meter.forwards["reward"].sum()) == 0  # the lexical reward runs no model
