"""Sampling cost against the vocabulary size: `python -m bench.sampling_scale`.

One decoding step's sampling, `next_tokens(logits, warp, u)` (warp: temperature, top-k, top-p, softmax; then the
inverse-CDF draw), on B = 64 rows of float32 logits drawn N(0, 1) x 3 (a flat-ish distribution: top-p 0.9 keeps
about 4% of the vocabulary, a hard case for a partial sort), for V in 506, 32000 and 152064, under four warps:
temperature 1; top-k 50; top-p 0.9; temperature 0.7 with top-p 0.95.

Two sides, alternated call by call (``--repeats`` times each, median of the CPU ms per call, one torch thread):

- **baseline**: the implementation before issue 9 (copied below as ``baseline_*``): a full sort of the vocabulary
  for top-p and a float64 cumsum over the vocabulary for the draw;
- **new**: ``workers.decoding.sampling.next_tokens`` (partial sort for top-p, two-level inverse CDF).

Both sides must choose the same tokens on the bench's inputs (uniforms from
``workers.decoding.sampling.uniforms``); the bench
stops with an error otherwise, and reports whether the warped probabilities are bitwise equal.

The scale of a decoding step is the LM head: the ms of one [B, 896] x [896, V] float32 matmul (the hidden size of a
~0.5B-parameter Qwen2), measured in the same run; ``new % LM head`` is the new side's ms over it. The whole step
(the transformer's layers as well) costs more than the LM head, so the share of a step is smaller still.

Figures are CPU time (``time.process_time``) on a shared machine, where other processes still compete for caches
and memory bandwidth: the load average (``os.getloadavg``) is printed at the start and at the end. Fresh [B, V]
tensors cost page faults on every call where the allocator returns them to the system (glibc does above 32 MiB: a
[64, 152064] float32 tensor is 37 MiB); the baseline makes several per call, the new side none in next_tokens
(a reused buffer) above 1M logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.common import table
from workers.decoding.sampling import STREAM_TOKEN, Warp, next_tokens, prompt_key, uniforms, warp_probs

VOCABS = (506, 32000, 152064)
WARPS = {
    "temperature 1": Warp(temperature=1.0),
    "top-k 50": Warp(temperature=1.0, top_k=50),
    "top-p 0.9": Warp(temperature=1.0, top_p=0.9),
    "T 0.7, top-p 0.95": Warp(temperature=0.7, top_p=0.95),
}
HIDDEN = 896


# ---------------------------------------------------------------------------------------------------------------
# The baseline: workers/decoding/sampling.py's warp and draw before issue 9, verbatim


def baseline_warp_probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
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


def baseline_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)  # [B, V]
    x = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def baseline_next_tokens(logits: torch.Tensor, warp: Warp, u: torch.Tensor) -> torch.Tensor:
    if warp.greedy:
        return logits.argmax(-1)
    return baseline_sample(baseline_warp_probs(logits, warp), u)


# ---------------------------------------------------------------------------------------------------------------


def ms(fn) -> float:
    """CPU ms of one call of fn (``time.process_time``: user + system time of this process, page faults included;
    with one torch thread, robust to the load of other processes, unlike wall-clock)."""
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def ab(a, b, repeats: int) -> tuple[float, float]:
    """Median ms per call of a and of b, alternated call by call after one warm-up call each."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(ms(a))
        tb.append(ms(b))
    return statistics.median(ta), statistics.median(tb)


def case(vocab: int, rows: int, repeats: int, seed: int = 0) -> dict[str, dict]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3.0  # [B, V]
    cands = torch.arange(rows)
    u = uniforms(seed, torch.full((rows,), prompt_key("bench")), cands, torch.zeros_like(cands), STREAM_TOKEN)  # [B]
    h, w = torch.randn(rows, HIDDEN, generator=g), torch.randn(HIDDEN, vocab, generator=g) / HIDDEN ** 0.5
    head = statistics.median(ms(lambda: h @ w) for _ in range(max(3, repeats)))
    out = {}
    for name, warp in WARPS.items():
        old_tok, new_tok = baseline_next_tokens(logits, warp, u), next_tokens(logits, warp, u)
        if not torch.equal(old_tok, new_tok):
            raise SystemExit(f"V={vocab} {name}: the new sampler chose other tokens than the baseline "
                             f"({int((old_tok != new_tok).sum())} of {rows} rows)")
        same_probs = torch.equal(baseline_warp_probs(logits, warp), warp_probs(logits, warp))
        t_old, t_new = ab(lambda: baseline_next_tokens(logits, warp, u), lambda: next_tokens(logits, warp, u), repeats)
        out[f"{vocab} / {name}"] = {
            "baseline ms": t_old, "new ms": t_new, "speed-up": t_old / t_new, "LM head ms": head,
            "new % LM head": 100.0 * t_new / head, "same tokens": True, "same probs": same_probs,
        }
        print(f"V={vocab} {name}: baseline {t_old:.2f} ms, new {t_new:.2f} ms; load {os.getloadavg()[0]:.2f}",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default=",".join(map(str, VOCABS)), help="comma-separated vocabulary sizes")
    ap.add_argument("--rows", type=int, default=64, help="rows (sequences) per call")
    ap.add_argument("--repeats", type=int, default=7, help="calls per side and case (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start}; torch threads {torch.get_num_threads()}; rows {args.rows}")
    rows: dict[str, dict] = {}
    for vocab in (int(v) for v in args.vocabs.split(",")):
        rows.update(case(vocab, args.rows, args.repeats))
    load_end = os.getloadavg()
    cols = ["baseline ms", "new ms", "speed-up", "LM head ms", "new % LM head", "same probs"]
    print(table(f"Sampling per step, {args.rows} rows, CPU ms (median of {args.repeats}, alternated); load average "
                f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end", rows, cols, first="V / warp"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load_start": load_start, "load_end": load_end, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
