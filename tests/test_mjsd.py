"""Oracles of MJSD (paper 002, Algorithm 1), batched: tau = 1 is the target's own decoding; q is the joint draft
probability of the chosen beam's own prefix; one target call per iteration."""

from __future__ import annotations

import math

import torch

from tests.test_speculative import (  # noqa: F401  (one_thread is an autouse fixture)
    EOS, PAD, greedy_reference, one_thread, pair, run, toy_context, toy_prompts,
)
from workers.accounting.work import Work
from workers.methods.mjsd import beam_draft, likelihood_warp, mjsd_accept
from workers.decoding.sampling import Warp, warp_probs
from workers.decoding.speculative import DecodeTally, open_batch


def test_tau_one_is_the_targets_greedy_decoding():
    target, draft = pair()
    prompts = toy_prompts(8, 48, 20, seed=11)
    ctx = toy_context(target, draft, {"temperature": 0}, num_prompts=8)
    results = run({"name": "mjsd", "gamma": 4, "num_beams": 3, "tau": 1.0}, ctx, prompts)
    for p, r in zip(prompts, results):
        assert r.candidates[0].tokens == greedy_reference(target, p.ids, 20)
        assert r.stats["acceptance_rate"] == 0.0 and r.stats["mean_accepted_tokens"] == 1.0


def reference_beams(draft, context: list[int], gamma: int, num_beams: int, warp: Warp):
    """Cache-free beam search on the draft: (tokens, joint log q of each prefix) of the best beam, and whether
    any step reordered the beams (a beam's parent was another slot)."""
    beams = [([], [])]  # (tokens, log q of each prefix)
    reordered = False
    with torch.inference_mode():
        for step in range(gamma):
            cands = []
            for b, (toks, hist) in enumerate(beams):
                score = hist[-1] if hist else 0.0
                if toks and toks[-1] == EOS:  # an ended beam stays, its score frozen
                    cands.append((score, b, EOS))
                    continue
                logq = torch.log(warp_probs(draft(torch.tensor([context + toks])).logits[0, -1], warp))
                cands += [(score + float(logq[v]), b, v) for v in range(logq.shape[0])]
            cands.sort(key=lambda c: -c[0])
            chosen = cands[:num_beams]
            if step > 0 and [c[1] for c in chosen] != list(range(len(chosen))):
                reordered = True
            beams = [(beams[b][0] + [v], beams[b][1] + [s]) for s, b, v in chosen]
    best = max(beams, key=lambda bh: bh[1][-1])
    return best[0], best[1], reordered


def test_q_is_the_joint_draft_probability_of_the_chosen_beams_prefix():
    target, draft = pair()
    prompts = toy_prompts(6, 48, 20, seed=12)
    gamma, m = 4, 3
    warp = Warp(temperature=0.0)
    with torch.inference_mode():
        work, tally = Work(), DecodeTally(6)
        batch = open_batch(target, draft, [p.ids for p in prompts], [p.rng_key for p in prompts], [20] * 6, PAD, work,
                           tally)
        _, d = batch.sides(target, draft)
        gam = torch.full((6,), gamma)
        x, logq = beam_draft(d, batch, gam, m, warp, 0, torch.tensor([EOS]), work, tally)
        assert d.size == 6  # the draft side is back to one sequence per prompt, on the chosen beams
    any_reordered = False
    lik = likelihood_warp(warp)
    for i, p in enumerate(prompts):
        ref_tokens, ref_hist, reordered = reference_beams(draft, p.ids, gamma, m, lik)
        any_reordered |= reordered
        assert x[i].tolist() == ref_tokens
        torch.testing.assert_close(logq[i].double(), torch.tensor(ref_hist, dtype=torch.float64), atol=1e-4, rtol=0)
        # and from scratch: log q(x_1..x_j) is the sum of the draft's log-probabilities of the chosen tokens (up to
        # an EOS; an ended beam's score stays frozen)
        k = ref_tokens.index(EOS) + 1 if EOS in ref_tokens else gamma
        with torch.inference_mode():
            seq = torch.tensor([p.ids + ref_tokens[:k]])
            lp = torch.log_softmax(draft(seq).logits[0, len(p.ids) - 1 : -1].float(), -1)
        own = lp.gather(-1, torch.tensor(ref_tokens[:k])[:, None])[:, 0].cumsum(0)
        torch.testing.assert_close(logq[i, :k], own, atol=1e-4, rtol=0)
    assert any_reordered, "no beam was ever reordered: the alignment of q was not exercised"


def test_acceptance_is_the_longest_prefix_over_tau():
    logp = torch.log(torch.tensor([[0.5, 0.1, 0.09, 0.05], [0.2, 0.1, 0.05, 0.01], [0.9, 0.8, 0.7, 0.6]]))
    logq = torch.log(torch.tensor([[0.6, 0.5, 0.3, 0.1], [0.9, 0.9, 0.9, 0.9], [0.5, 0.4, 0.3, 0.2]]))
    eligible = torch.ones(3, 4, dtype=torch.bool)
    # sequence 0: ratios 0.83, 0.2, 0.3, 0.5 -> the longest over 0.25 is j = 4 although j = 2 fails
    assert mjsd_accept(logp, logq, eligible, 0.25).tolist() == [4, 0, 4]
    assert mjsd_accept(logp, logq, eligible, 0.9).tolist() == [0, 0, 4]
    assert mjsd_accept(logp, logq, eligible, 1.0).tolist() == [0, 0, 0]  # min(1, .) > 1 never holds
    eligible[2, 2:] = False
    assert mjsd_accept(logp, logq, eligible, 0.0).tolist() == [4, 4, 2]


def test_one_target_call_per_iteration_and_full_acceptance_when_draft_is_target():
    target, _ = pair()
    prompts = toy_prompts(4, 48, 21, seed=13)
    gamma = 4
    ctx = toy_context(target, target, {"temperature": 0}, num_prompts=4)
    results = run({"name": "mjsd", "gamma": gamma, "num_beams": 3, "tau": 0.1}, ctx, prompts)
    for g, r in enumerate(results):
        n = len(r.candidates[0].tokens)
        iterations = round(n / r.stats["mean_accepted_tokens"])
        assert int(ctx.meter.forwards["target"][g]) == 1 + iterations  # the prefill, then one per iteration
        if EOS not in r.candidates[0].tokens:
            assert r.stats["acceptance_rate"] == 1.0  # p = q: every prefix passes
            assert iterations == math.ceil(n / (gamma + 1))


def test_sampled_mjsd_is_seeded():
    target, draft = pair()
    prompts = toy_prompts(3, 48, 16, seed=14)
    method = {"name": "mjsd", "gamma": 3, "num_beams": 4, "tau": 0.1}
    a = run(method, toy_context(target, draft, {"temperature": 1.0}, num_prompts=3, seed=1), prompts)
    b = run(method, toy_context(target, draft, {"temperature": 1.0}, num_prompts=3, seed=1), prompts)
    c = run(method, toy_context(target, draft, {"temperature": 1.0}, num_prompts=3, seed=2), prompts)
    tokens = lambda rs: [r.candidates[0].tokens for r in rs]  # noqa: E731
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)
    assert all(r.stats["mean_accepted_tokens"] > 1.0 for r in a)


def test_trio_mjsd_with_tau_one_is_greedy_and_the_defaults_accept_long_prefixes():
    from tests.trio_helpers import demo_items, run_trio, tokens_of

    items = demo_items(4)
    gen = {"temperature": 0, "max_new_tokens": 32}
    _, greedy, _ = run_trio({"name": "greedy"}, items, gen)
    _, tau_one, _ = run_trio({"name": "mjsd", "tau": 1.0, "gamma": 3, "num_beams": 2}, items, gen)
    assert tokens_of(tau_one) == tokens_of(greedy)
    _, default, meter = run_trio({"name": "mjsd"}, items, gen)
    for g, r in enumerate(default):
        assert r.stats["mean_accepted_tokens"] > 2.0 and r.stats["perplexity"] is not None
        iterations = round(len(r.candidates[0].tokens) / r.stats["mean_accepted_tokens"])
        assert int(meter.forwards["target"][g]) == 1 + iterations
