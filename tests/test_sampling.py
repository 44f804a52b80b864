"""Warping and sampling: top-k, top-p, greedy, and the counter-based RNG."""

from __future__ import annotations

import torch
from scipy import stats

from workers.sampling import (
    STREAM_ACCEPT, STREAM_TOKEN, Warp, prompt_key, sample, splitmix64, uniforms, warp_probs,
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
