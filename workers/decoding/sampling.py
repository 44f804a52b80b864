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
import threading
from dataclasses import dataclass

import numpy as np
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


# Sampling cost that scales with the vocabulary. The kept sets, the probabilities (bit for bit) and the tokens are
# those of the reference rules, a full sort for top-p (`_top_p_full_sort`) and one float64 cumsum over the
# vocabulary for the draw (`_sample_direct`), but computed on the CPU without either:
# - top-p: the k largest probabilities of each row (a partial sort, k grown for rows that need more) give the same
#   mass_before as the full sort over the prefix that decides, hence the boundary probability v; tokens below v are
#   zeroed. A row whose boundary falls inside a group of equal probabilities (some kept, some dropped: which ones
#   depends on the sort's order of ties) takes the full sort, so the kept set is the reference's in every case;
# - inverse CDF: float64 sums of blocks of _BLOCK tokens locate the block of u * total, and a float64 cumsum inside
#   that block only locates the token, in vocabulary order;
# - no [B, V] temporary beyond the probabilities themselves, which next_tokens keeps in a reused buffer.
# On an accelerator the reference rules run (sorts and cumsums are cheap there).
_BLOCK = 1024  # tokens per block of the two-level inverse CDF
_DIRECT_MAX_V = 2048  # at most this many tokens, one [B, V] cumsum is cheaper than two levels
_ROW_LOOP_MIN_V = 8192  # from this many tokens, a per-row in-place threshold beats a [B, V] mask (CPU)
_CHUNK_BLOCKS = 8  # blocks summed per float64 temporary ([B, 8 x _BLOCK])
_OUT_MIN_NUMEL = 1 << 20  # from this many logits, warp into one buffer (below, fresh tensors cost less than out=)


def _largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values of each row of x [N, V], sorted descending: [N, k] (values only, no indices).

    On the CPU a selection (numpy's introselect, row by row through one reused buffer for a large V) then a sort of
    the k values, several times cheaper than torch.topk there; elsewhere torch.topk."""
    n, v = x.shape
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return torch.topk(x, k, dim=-1).values
    xn = x.contiguous().numpy()
    if k == v:
        top = np.sort(xn, axis=-1)
    elif v < _ROW_LOOP_MIN_V:
        top = np.sort(np.partition(xn, v - k, axis=-1)[:, v - k:], axis=-1)
    else:
        top, buf = np.empty((n, k), dtype=xn.dtype), np.empty(v, dtype=xn.dtype)
        for row, dst in zip(xn, top):
            np.copyto(buf, row)
            buf.partition(v - k)
            dst[:] = buf[v - k:]
        top.sort(axis=-1)
    return torch.from_numpy(top[:, ::-1].copy())  # a copy: torch refuses negative strides


def _fill_below(x: torch.Tensor, bound: torch.Tensor, value: float) -> None:
    """In place: x[n, i] = value wherever x[n, i] < bound[n]. x: [N, V], bound: [N]."""
    if x.device.type == "cpu" and x.shape[-1] >= _ROW_LOOP_MIN_V and x.is_contiguous():
        # threshold_(row, t, value) replaces row <= t; t, the largest float below bound, makes that row < bound
        below = torch.nextafter(bound.to(x.dtype), torch.tensor(float("-inf"), dtype=x.dtype)).tolist()
        for row, t in zip(x, below):
            torch.nn.functional.threshold_(row, t, value)
    else:
        x.masked_fill_(x < bound.to(x.dtype).unsqueeze(-1), value)


def _top_p_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] the tokens the nucleus drops, by a full sort of probs [N, V] (the reference rule)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # [N, V] probability mass of more likely tokens
    drop_sorted = mass_before >= top_p  # the most likely token always stays
    return torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)


def _top_p_(probs: torch.Tensor, top_p: float) -> None:
    """In place on probs [N, V]: zero the tokens outside the nucleus, the smallest set of most likely tokens whose
    mass reaches top_p (the most likely token always stays). Not renormalised.

    The rule is the full sort's (``_top_p_full_sort``): sorted descending, a token is dropped when the mass of the
    tokens sorted before it, mass_before = cumsum - p in float32, is >= top_p. mass_before is nondecreasing along
    the sorted order and its first k entries depend only on the k largest values, so the k largest values of a row
    decide it as soon as the k-th is dropped: the kept tokens are those >= v, the last kept value. On other devices
    the full sort, which is fast there (and a GPU's float32 cumsum of a prefix need not match the full one's)."""
    if probs.device.type != "cpu":
        probs.masked_fill_(_top_p_full_sort(probs, top_p), 0.0)
        return
    n, v = probs.shape
    k = min(v, max(1024, v // 16))
    rows = torch.arange(n, device=probs.device)
    bound = torch.empty(n, dtype=probs.dtype, device=probs.device)
    tied = []
    while rows.numel():
        top = _largest(probs if rows.numel() == n else probs[rows], k).to(probs.device)  # [n', k] descending
        mass_before = top.cumsum(-1) - top  # [n', k]
        keep = mass_before < top_p
        # decided: the k-th largest is dropped (so are all smaller ones), is 0 (the rest are zeros: kept or not,
        # nothing changes), or k is the whole vocabulary
        done = (~keep[:, -1] | (top[:, -1] == 0)) if k < v else torch.ones_like(keep[:, -1])
        c = keep.sum(-1)  # [n'] kept count among the k largest (a prefix: mass_before is nondecreasing)
        last = top.gather(-1, (c - 1).clamp(min=0)[:, None]).squeeze(-1)  # [n'] the smallest kept value
        last = torch.where(c > 0, last, torch.full_like(last, float("inf")))  # top_p <= 0 would drop everything
        nxt = top.gather(-1, c.clamp(max=k - 1)[:, None]).squeeze(-1)  # [n'] the largest dropped value
        # a dropped token equals a kept one (not 0): which of them the full sort keeps depends on its order of ties
        tie = done & (c > 0) & (c < k) & (nxt == last) & (last > 0)
        bound[rows[done]] = last[done]
        tied.append(rows[tie])
        rows, k = rows[~done], min(v, 4 * k)
    tied = torch.cat(tied)
    bound[tied] = float("-inf")  # nothing is below -inf: the full sort decides these rows
    _fill_below(probs, bound, 0.0)
    if tied.numel():
        probs[tied] = probs[tied].masked_fill(_top_p_full_sort(probs[tied], top_p), 0.0)


_SOFTMAX_OUT = torch.ops.aten._softmax.out  # torch.softmax's kernel, writing into a given tensor


def _softmax_into(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """softmax(x, -1), into out [N, V] when given, which may be x itself on the CPU (the CPU kernel maps element by
    element; the tests check the result is torch.softmax's, bit for bit)."""
    if out is None:
        return torch.softmax(x, -1)
    if out is x and x.device.type != "cpu":
        return out.copy_(torch.softmax(x, -1))
    return _SOFTMAX_OUT(x, -1, False, out=out)


def _warp_into(logits: torch.Tensor, warp: Warp, out: torch.Tensor | None) -> torch.Tensor:
    """Float32 logits [N, V] to probabilities (not greedy). Given out [N, V], they are written there with no other
    [N, V] temporary: the scaled and top-k-masked logits live in out until the softmax replaces them; without it
    (small tensors, where allocating is cheaper than the out= call), in fresh tensors."""
    x = logits
    if warp.temperature != 1.0:  # x / 1.0 == x: skipping the division changes no value
        x = logits / warp.temperature if out is None else torch.div(logits, warp.temperature, out=out)
    if warp.top_k and warp.top_k < x.shape[-1]:
        kth = _largest(x, warp.top_k)[:, -1].to(x.device)  # [N]
        if x is logits:
            x = logits.clone() if out is None else out.copy_(logits)
        _fill_below(x, kth, float("-inf"))
    probs = _softmax_into(x, out)
    if warp.top_p < 1.0:
        _top_p_(probs, warp.top_p)
        probs.div_(probs.sum(-1, keepdim=True))
    return probs


def _out_buffer(logits: torch.Tensor) -> torch.Tensor | None:
    """Where _warp_into writes for warp_probs: a fresh tensor above _OUT_MIN_NUMEL elements, else None."""
    return torch.empty_like(logits) if logits.numel() >= _OUT_MIN_NUMEL else None


def warp_probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Logits [..., V] to float32 probabilities [..., V] under `warp`: temperature, then top-k (the tokens below
    the k-th largest logit are dropped), then top-p (the smallest set of most likely tokens whose mass reaches
    top_p; the most likely token always stays), renormalised.

    Greedy (temperature 0) gives a one-hot distribution on the argmax, so that speculative sampling with greedy
    p and q reduces to exact argmax matching.
    """
    logits = logits.float()
    if warp.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    return _warp_into(flat, warp, _out_buffer(flat)).view(logits.shape)


_scratch_local = threading.local()


def _scratch(rows: int, v: int) -> torch.Tensor:
    """A [rows, V] float32 CPU buffer reused across calls by this thread (its largest size so far stays allocated):
    a fresh [B, V] tensor per step costs page faults that at V = 152k weigh as much as the softmax."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < rows * v:
        buf = _scratch_local.buf = torch.empty(rows * v)
    return buf[: rows * v].view(rows, v)


def _sample_direct(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF by one float64 cumsum over the vocabulary: the reference, and the fastest for small V."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    x = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _sample_blocked(probs: torch.Tensor, u: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """Inverse CDF in two levels: the block of u * total among float64 block sums, then the token inside it.

    The same token as `_sample_direct` (float64 accumulation in vocabulary order) except where u * total lies
    within float64 rounding of a boundary; never a zero-probability token, unless the row has no mass (then V - 1,
    as the direct cumsum gives)."""
    b, v = probs.shape
    nb = -(-v // block)  # blocks, the last one possibly partial
    step = block * _CHUNK_BLOCKS
    sums = torch.empty(b, nb, dtype=torch.float64, device=probs.device)  # [B, nb]
    for start in range(0, v, step):
        chunk = probs[:, start:start + step]
        full = chunk.shape[1] // block
        j = start // block
        if full:
            sums[:, j:j + full] = chunk[:, :full * block].reshape(b, full, block).sum(-1, dtype=torch.float64)
        if chunk.shape[1] > full * block:
            sums[:, j + full] = chunk[:, full * block:].sum(-1, dtype=torch.float64)
    cdf = sums.cumsum(-1)  # [B, nb]
    total = cdf[:, -1]
    x = u.to(device=probs.device, dtype=torch.float64) * total  # [B]
    j = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1)  # [B] block of x
    last_block = torch.where(sums > 0, torch.arange(nb, device=probs.device), -1).amax(-1)  # [B]
    j = torch.minimum(j, last_block).clamp_(min=0)  # x >= total after rounding: the last block with mass
    before = torch.where(j > 0, cdf.gather(-1, (j - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)  # [B] mass before
    cols = j[:, None] * block + torch.arange(block, device=probs.device)  # [B, block]
    vals = probs.gather(-1, cols.clamp(max=v - 1)).double().masked_fill_(cols >= v, 0.0)  # [B, block]
    local = torch.cat([before[:, None], vals], -1).cumsum(-1)  # [B, 1 + block] the CDF up to each token's end
    i = torch.searchsorted(local, x[:, None], right=True).squeeze(-1) - 1  # [B] (local[:, 0] = before <= x)
    last_tok = torch.where(vals > 0, torch.arange(block, device=probs.device), 0).amax(-1)  # [B]
    idx = j * block + torch.minimum(i, last_tok)  # x >= the block's CDF after rounding: its last token with mass
    return torch.where(total > 0, idx, v - 1)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token from each of the B distributions probs [B, V] (nonnegative, not
    necessarily normalised), with uniforms u [B]: the first token, in vocabulary order, whose float64 cumulative
    mass exceeds u * total; zero-probability tokens are never chosen."""
    if probs.shape[-1] <= _DIRECT_MAX_V or probs.device.type != "cpu":  # one cumsum is cheap on an accelerator
        return _sample_direct(probs, u)
    return _sample_blocked(probs, u)


def next_tokens(logits: torch.Tensor, warp: Warp, u: torch.Tensor) -> torch.Tensor:
    """Sample (or argmax) one token from each of the B distributions of logits [B, V]: sample(warp_probs(logits,
    warp), u), with the warped probabilities of a large batch in a reused buffer on the CPU (`_scratch`)."""
    return next_tokens_and_logprobs(logits, warp, u, logprobs=False)[0]


def _gathered_logprobs(probs: torch.Tensor, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """log p(tok) [B] float32 from the temperature-1 softmax `probs` [B, V] of `logits`; a row whose gathered
    probability underflowed to 0 (a token below float32's range, which only a hot warp samples) is taken from the
    log-sum-exp of its logits instead."""
    lp = probs.gather(-1, tok[:, None])[:, 0].log()
    low = ~torch.isfinite(lp)
    if lp.device.type != "cpu":  # no wait for the device to ask whether any row underflowed: every row's fallback
        x = logits.float()      # is cheap beside a step's launches, and only the rows that underflowed take it
        return torch.where(low, x.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(x, -1), lp)
    if bool(low.any()):
        rows = low.nonzero()[:, 0]
        x = logits[rows].float()
        lp[rows] = x.gather(-1, tok[rows, None])[:, 0] - torch.logsumexp(x, -1)
    return lp


def next_tokens_and_logprobs(logits: torch.Tensor, warp: Warp, u: torch.Tensor, logprobs: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`next_tokens`, and each sampled token's log-probability under the unwarped logits (temperature 1) [B] float32
    (None without `logprobs`). Under the identity warp (temperature 1, no top-k, no top-p) the probabilities the
    draw was taken from are those, and the log-probability is read from them; otherwise from a softmax of the
    logits into a reused buffer: either costs a fraction of a log-sum-exp over the vocabulary (whose CPU kernel
    takes three passes)."""
    if warp.greedy:
        tok = logits.argmax(-1)
        if not logprobs:
            return tok, None
        x = logits.float()
        return tok, x.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)
    logits = logits.float()
    big = logits.device.type == "cpu" and logits.numel() >= _OUT_MIN_NUMEL
    probs = _warp_into(logits, warp, _scratch(*logits.shape) if big else _out_buffer(logits))
    tok = sample(probs, u)
    if not logprobs:
        return tok, None
    identity = warp.temperature == 1.0 and not (warp.top_k and warp.top_k < logits.shape[-1]) and warp.top_p >= 1.0
    if not identity:
        probs = _softmax_into(logits, _out_buffer(logits) if not big else _scratch(*logits.shape))
    return tok, _gathered_logprobs(probs, logits, tok)
