"""Logit warping (temperature, top-k, top-p) and counter-based random numbers for sampling.

Randomness is a pure function of (seed, prompt key, candidate index, position, stream): every draw is
``uniform(seed, prompt, cand, pos, stream)``. A candidate therefore samples the same tokens whether its prompt is
decoded alone or batched with others, and whether or not other sequences have left the batch, which is what makes
"batched equals alone" and "Speculative Rejection with alpha = 0 equals Best-of-N" exact properties rather
than statistical ones.

Streams name the purpose of a draw so that different uses never share a number:
- STREAM_TOKEN: sampling a token from the target's (or the only) distribution;
- STREAM_DRAFT: sampling a drafted token from the draft's distribution;
- STREAM_ACCEPT: the uniform of the min(1, p/q) acceptance test;
- STREAM_RESIDUAL: sampling the recovered token from norm(max(0, p - q)).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

STREAM_TOKEN, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3
_NUM_STREAMS = 8

_U64 = 1 << 64


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return x - _U64 if x >= 1 << 63 else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def prompt_key(prompt_id: str) -> int:
    """A 62-bit key for a prompt id, stable across processes and machines."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "little") >> 2


def uniforms(
    seed: int, keys: torch.Tensor, cands: torch.Tensor, positions: torch.Tensor, stream: int
) -> torch.Tensor:
    """Uniform(0, 1) float64 draws, one per element of the broadcast of keys, cands and positions.

    keys: prompt keys (int64), cands: candidate indices, positions: token positions in the response.
    """
    x = splitmix64(torch.full_like(keys, seed) ^ keys)
    x = splitmix64(x ^ cands)
    x = splitmix64(x ^ (positions * _NUM_STREAMS + stream))
    return (_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)


@dataclass(frozen=True)
class Warp:
    """How logits become a sampling distribution: temperature (0 = greedy), then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Logits [..., V] to float32 probabilities [..., V] under `warp`.

    Greedy (temperature 0) gives a one-hot distribution on the argmax, so that speculative sampling with greedy
    p and q reduces to exact argmax matching.
    """
    logits = logits.float()
    if warp.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / warp.temperature
    if warp.top_k and warp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, warp.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if warp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [..., V] probability mass of more likely tokens
        drop_sorted = mass_before >= warp.top_p  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token from each of the B distributions probs [B, V], with uniforms u [B];
    zero-probability tokens are never chosen."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    x = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def next_tokens(logits: torch.Tensor, warp: Warp, u: torch.Tensor) -> torch.Tensor:
    """Sample (or argmax) one token from each of the B distributions of logits [B, V]."""
    if warp.greedy:
        return logits.argmax(-1)
    return sample(warp_probs(logits, warp), u)
