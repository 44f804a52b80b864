"""Warping and sampling: top-k, top-p, greedy, and the counter-based RNG."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import workers.decoding.sampling as sampling
from workers.decoding.sampling import (
    STREAM_ACCEPT, STREAM_TOKEN, Warp, next_tokens, prompt_key, sample, splitmix64, uniforms, warp_probs,
)


def test_greedy_is_one_hot_on_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert warp_probs(logits, Warp(temperature=0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    p = warp_probs(logits, Warp(temperature=1.0, top_k=2))
    assert (p > 0).sum() == 2 and p[0, 1] > 0 and p[0, 2] > 0
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = warp_probs(probs.log(), Warp(temperature=1.0, top_p=0.75))
    assert (p > 0).tolist() == [[True, True, False, False]]  # 0.5 < 0.75 needs the second token
    p = warp_probs(probs.log(), Warp(temperature=1.0, top_p=0.5))
    assert (p > 0).tolist() == [[True, False, False, False]]
    p = warp_probs(probs.log(), Warp(temperature=1.0, top_p=0.01))
    assert (p > 0).sum() == 1  # the most likely token always stays


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    cold = warp_probs(logits, Warp(temperature=0.5))
    hot = warp_probs(logits, Warp(temperature=2.0))
    assert cold[0, 1] > torch.softmax(logits, -1)[0, 1] > hot[0, 1]


def test_inverse_cdf_sampling_matches_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.3])
    n = 20000
    u = uniforms(7, torch.full((n,), prompt_key("p")), torch.arange(n), torch.zeros(n, dtype=torch.long), STREAM_TOKEN)
    draws = sample(probs.expand(n, -1), u)
    counts = torch.bincount(draws, minlength=5)
    assert counts[1] == 0  # a zero-probability token is never drawn
    keep = probs > 0
    chi = stats.chisquare(counts[keep].numpy(), (probs[keep] * n).numpy())
    assert chi.pvalue > 1e-3


def test_uniforms_are_uniform_and_keyed_by_every_coordinate():
    k = torch.full((5000,), prompt_key("a"))
    pos = torch.arange(5000)
    u = uniforms(0, k, torch.zeros_like(pos), pos, STREAM_TOKEN)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    base = uniforms(0, k[:10], pos[:10], pos[:10], STREAM_TOKEN)
    assert torch.equal(base, uniforms(0, k[:10], pos[:10], pos[:10], STREAM_TOKEN))
    for other in (
        uniforms(1, k[:10], pos[:10], pos[:10], STREAM_TOKEN),
        uniforms(0, torch.full((10,), prompt_key("b")), pos[:10], pos[:10], STREAM_TOKEN),
        uniforms(0, k[:10], pos[:10] + 1, pos[:10], STREAM_TOKEN),
        uniforms(0, k[:10], pos[:10], pos[:10] + 1, STREAM_TOKEN),
        uniforms(0, k[:10], pos[:10], pos[:10], STREAM_ACCEPT),
    ):
        assert not torch.equal(base, other)


def test_splitmix64_matches_the_reference_values():
    # splitmix64 finaliser of 0 and 1 (unsigned), from the algorithm's definition
    def ref(x):
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    for x in (0, 1, 12345, (1 << 62) + 7):
        got = int(splitmix64(torch.tensor([x]))[0]) & ((1 << 64) - 1)
        assert got == ref(x)


# ---------------------------------------------------------------------------------------------------------------
# Sampling that scales with the vocabulary (issue 9): the same tokens and the same warped law as the reference
# rules below (a full sort for top-p, one float64 cumsum over the vocabulary for the draw).


def reference_warp(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """The warp before issue 9: a full sort of the vocabulary for top-p."""
    logits = logits.float() / warp.temperature
    if warp.top_k and warp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, warp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if warp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= warp.top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def reference_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order by one float64 cumsum: the first token whose CDF exceeds u * total."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def draws(n: int, seed: int = 0) -> torch.Tensor:
    """n uniforms of one candidate over positions 0 .. n-1, as the engine draws them."""
    pos = torch.arange(n)
    return uniforms(seed, torch.full((n,), prompt_key("scale")), torch.zeros_like(pos), pos, STREAM_TOKEN)


def awkward_rows(b: int, v: int, g: torch.Generator) -> torch.Tensor:
    """[b, v] nonnegative rows: dense, sparse (90% zeros), one nonzero, scaled far from 1, exact ties."""
    dense = torch.rand(b, v, generator=g) ** 4
    sparse = dense * (torch.rand(b, v, generator=g) < 0.1)
    one = torch.zeros(b, v).scatter_(-1, torch.randint(v, (b, 1), generator=g), 0.3)
    rows = torch.cat([dense, sparse, one, dense * 1e4, sparse * 1e-6, torch.randint(3, (b, v), generator=g).float()])
    return rows


def test_blocked_sampler_picks_the_reference_token():
    g = torch.Generator().manual_seed(1)
    for v, block in [(1, 64), (5, 64), (63, 64), (64, 64), (65, 64), (1000, 64), (3001, 256), (5000, 1024)]:
        probs = awkward_rows(40, v, g)
        for seed in range(3):
            u = draws(probs.shape[0], seed)
            want = reference_sample(probs, u)
            assert torch.equal(sampling._sample_blocked(probs, u, block), want), (v, block, seed)
            assert torch.equal(sample(probs, u), want), (v, seed)


def test_sampler_never_draws_a_zero_probability_token_even_at_extreme_uniforms():
    g = torch.Generator().manual_seed(2)
    probs = awkward_rows(20, 3001, g)
    probs[:, -5:] = 0.0  # the reference's clamp to V - 1 would land on a zero there if u * total rounded up
    lo, hi = 0.5 / (1 << 53), (float(1 << 53) - 0.5) / (1 << 53)  # the smallest and largest uniforms()
    for u0 in (lo, hi, 0.5):
        u = torch.full((probs.shape[0],), u0, dtype=torch.float64)
        for got in (sampling._sample_blocked(probs, u, 64), sample(probs, u)):
            assert bool((probs.gather(-1, got[:, None]) > 0).all()), u0
    empty = torch.zeros(2, 3001)  # no mass: V - 1, as the reference cumsum gives
    assert sampling._sample_blocked(empty, torch.full((2,), 0.5, dtype=torch.float64), 64).tolist() == [3000, 3000]


WARPS = [
    Warp(temperature=1.0), Warp(temperature=0.7), Warp(temperature=1.0, top_k=50), Warp(temperature=1.3, top_k=1),
    Warp(temperature=1.0, top_p=0.9), Warp(temperature=0.7, top_p=0.95), Warp(temperature=1.0, top_p=0.999),
    Warp(temperature=1.0, top_p=1e-6), Warp(temperature=1.2, top_k=300, top_p=0.5), Warp(temperature=1.0, top_k=7,
                                                                                           top_p=0.999999),
]


@pytest.mark.parametrize("out_min_numel", [0, 1 << 62], ids=["into-buffers", "fresh-tensors"])
def test_warp_probs_are_the_full_sort_rule_bit_for_bit(monkeypatch, out_min_numel):
    """The same float32 probabilities (hence the same kept sets) as the full sort, for flat and peaked rows, exact
    ties at the nucleus boundary (integer and bf16-rounded logits), -inf logits, a 3-D batch, both sides of the
    per-row CPU paths (V >= _ROW_LOOP_MIN_V), rows whose nucleus outgrows the first partial sort, and both ways of
    holding the intermediate tensors (in one buffer, with an in-place softmax, or fresh)."""
    monkeypatch.setattr(sampling, "_OUT_MIN_NUMEL", out_min_numel)
    calls = {"largest": [], "full_sort": 0}
    largest, full_sort = sampling._largest, sampling._top_p_full_sort
    monkeypatch.setattr(sampling, "_largest", lambda x, k: (calls["largest"].append(k), largest(x, k))[1])
    monkeypatch.setattr(sampling, "_top_p_full_sort",
                        lambda p, t: (calls.__setitem__("full_sort", calls["full_sort"] + 1), full_sort(p, t))[1])
    g = torch.Generator().manual_seed(3)
    for v in (2, 50, 506, 5000, 10000):
        logits = torch.randn(12, v, generator=g) * torch.tensor([0.3, 1.0, 3.0, 10.0]).repeat(3)[:, None]
        logits[4:8] = logits[4:8].round()  # exact ties
        logits[8:10] = logits[8:10].bfloat16().float()  # the ties of a bf16 model's logits
        logits[10, : v // 2] = float("-inf")  # fewer finite logits than some top-k
        for warp in WARPS:
            want = reference_warp(logits, warp)
            got = warp_probs(logits, warp)
            assert torch.equal(got, want), (v, warp)
            assert torch.equal(sampling.next_tokens(logits, warp, draws(12)), reference_sample(want, draws(12)))
    assert max(calls["largest"]) > 1024 and calls["full_sort"] > 0  # both fallbacks ran
    logits3 = torch.randn(3, 4, 3000, generator=g) * 3  # [B, G+1, V] as speculative decoding warps
    for warp in WARPS:
        assert torch.equal(warp_probs(logits3, warp), reference_warp(logits3, warp)), warp


def test_next_tokens_reuses_its_buffer_without_touching_returned_probabilities(monkeypatch):
    monkeypatch.setattr(sampling, "_OUT_MIN_NUMEL", 0)  # the reused buffer at any size
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 3000, generator=g) * 3, torch.randn(6, 9000, generator=g) * 3
    warp = Warp(temperature=0.8, top_k=100, top_p=0.9)
    pa = warp_probs(a, warp)
    kept = pa.clone()
    for logits in (a, b, a[:2], b):
        u = draws(logits.shape[0], 5)
        assert torch.equal(sampling.next_tokens(logits, warp, u), reference_sample(reference_warp(logits, warp), u))
    assert torch.equal(pa, kept)
    assert torch.equal(sampling.next_tokens(b, Warp(temperature=0), draws(6)), b.argmax(-1))


def test_sampled_law_at_a_large_vocabulary_is_the_warped_distribution():
    """Chi-square goodness of fit at V = 50,000 with top-p 0.9 on a peaked distribution: draws over positions match
    the nucleus renormalised, and the same test rejects a distribution that differs in two tokens."""
    g = torch.Generator().manual_seed(5)
    v, n, rows = 50_000, 4_000, 500
    logits = torch.randn(1, v, generator=g)
    logits[0, torch.randperm(v, generator=g)[:12]] = 12.0 + torch.linspace(0, 2.5, 12)  # 12 likely tokens
    warp = Warp(temperature=1.0, top_p=0.9)
    probs = warp_probs(logits, warp)[0]  # drawn from
    law = reference_warp(logits, warp)[0]  # tested against: the full sort's nucleus, renormalised
    support = (law > 0).nonzero().squeeze(-1)
    assert 5 <= len(support) <= 12
    batch = probs.expand(rows, v).contiguous()  # [rows, V] one distribution, drawn at many positions
    u = draws(n, seed=6)
    got = torch.cat([sample(batch, u[i:i + rows]) for i in range(0, n, rows)])
    counts = torch.bincount(got, minlength=v)
    assert counts.sum() == counts[support].sum() == n  # never outside the nucleus
    observed, expected = counts[support].double().numpy(), (law[support].double() * n).numpy()
    assert stats.chisquare(observed, expected * n / expected.sum()).pvalue > 1e-3
    top2 = law[support].argsort(descending=True)[:2]
    wrong = expected.copy()
    wrong[top2.numpy()] = wrong[top2.flip(0).numpy()]  # the two most likely tokens' probabilities swapped
    assert stats.chisquare(observed, wrong * n / wrong.sum()).pvalue < 1e-6


@pytest.mark.parametrize("warp, vocab", [(Warp(1.0), 40000), (Warp(0.7), 40000), (Warp(1.0, top_k=5), 40000),
                                         (Warp(1.0, top_p=0.8), 40000), (Warp(0.0), 40000), (Warp(1000.0), 100)])
def test_the_sampled_tokens_logprob_is_its_unwarped_log_softmax_whatever_the_warp(warp, vocab):
    """The decoding step's log-probability of each sampled token (the logprob reward, the perplexity) is read from
    the softmax the draw was taken from under the identity warp, from a softmax of the raw logits otherwise, and
    from the log-sum-exp where a hot warp samples a token whose raw probability underflows float32."""
    from workers.decoding.sampling import next_tokens_and_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, vocab, generator=gen) * 3
    logits[:, :40] = -200.0  # e^-200 of the mass: 0 in float32 at temperature 1, sampled only under a hot warp
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    tok, logp = next_tokens_and_logprobs(logits, warp, u)
    assert torch.equal(tok, next_tokens(logits, warp, u))
    want = logits.gather(-1, tok[:, None])[:, 0].double() - torch.logsumexp(logits.double(), -1)
    torch.testing.assert_close(logp.double(), want, atol=2e-5, rtol=1e-5)
    if warp.temperature == 1000.0:
        assert (tok < 40).any()  # the fallback rows were exercised
