"""Constrained decoding with speculative lookaheads (CDSL, paper 000, Algorithm 1; docs/references.md) and its
baselines CDLH (Algorithm 2, target lookaheads) and CDLH-appx (section 3.1, draft lookaheads), batched across
prompts.

Symbols as in the paper: d (`lookahead`) drafted/lookahead tokens, k (`top_k`) candidate tokens, a_t
(`accept_threshold`), r_t (`reward_threshold`), b target tokens tried in step 1, R the reward (`ctx.score`).

One CDSL iteration for a sequence whose response so far is T (pfx = prompt + T):
  draft x_1..x_d with the draft (greedy for hard validation, sampled from q for speculative-sampling validation);
  verify with one target forward: n = accepted tokens (argmax match, or min(1, p/q) tests), a = n / d;
  r = R(T + x_1..x_n); the state and its action (O is what the sequence emits):
    S1  a >= a_t, r >= r_t   O = x_1..x_n (no bonus token: nothing unscored is accepted)
    S2  a <  a_t, r <  r_t   step 1, then step 2 if step 1 found nothing
    S3  a <  a_t, r >= r_t   the same actions as S2
    S4  a >= a_t, r <  r_t   O = x_1..x_n + one CDLH-appx token
  step 1: for i = 1..b, X_i = the target's argmax after x_1..x_n, X_1..X_{i-1}; a greedy draft lookahead of d
    tokens after it; if R(T + x_1..x_n + X_1..X_i + lookahead) >= r_t, O = x_1..x_n + X_1..X_i;
  step 2: O = x_1..x_n + one CDLH-appx token after x_1..x_n.
A CDLH-appx token after context c: the target's top-k next tokens at c (from its logits), each extended by d greedy
draft tokens, scored by R; the best (the more likely on ties) is taken. CDLH is the same with the target's
lookaheads.

Two points the paper leaves open, decided here: an accepted EOS ends the sequence with x_1..x_n cut after it,
whatever the state (nothing can follow an EOS); and a sequence whose n = 0 would be S1 (possible only with a_t = 0)
is treated as S3, since S1 would emit nothing and repeat the same iteration forever.

Calls are free where the paper's quantities already exist: X_1 and step 2's candidates come from the verification
forward (the target's logits after x_1..x_n), so step 1 costs b - 1 extra target calls at most.
"""

from __future__ import annotations

import torch

from schemas.methods import CDLH, CDSL, CDLHAppx
from workers.accounting.work import Work
from workers.candidates import MethodResult, PromptInput
from workers.context import Context
from workers.methods.draft_target import decode_batch, finish, score_sequences
from workers.decoding.sampling import STREAM_ACCEPT, STREAM_DRAFT, Warp, sample, uniforms, warp_probs
from workers.decoding.speculative import DecodeTally, Side, SpecBatch, emit, ragged_cat, room

S1, S2, S3, S4 = 1, 2, 3, 4


def cdsl_states(n: torch.Tensor, d: int, r: torch.Tensor, a_t: float, r_t: float) -> torch.Tensor:
    """[B] state 1..4 of Algorithm 1 (lines 25, 28, 48) from accepted counts n [B] of d drafted tokens and the
    rewards r [B] of the accepted prefixes."""
    a = n.double() / d
    high_a = a >= a_t
    high_r = r.to(a.device) >= r_t
    state = torch.where(high_a, torch.where(high_r, S1, S4), torch.where(high_r, S3, S2))
    return torch.where((state == S1) & (n == 0), S3, state)  # S1 with nothing accepted would not progress


def rollout(
    side: Side, seq: torch.Tensor, seq_len: torch.Tensor, live: torch.Tensor, d: int, eos: torch.Tensor,
    group: torch.Tensor, work: Work, tally: DecodeTally | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy lookahead: bring `live` sequences to context seq (tokens after the side's n_in), then d greedy tokens
    (d forwards; a sequence stops after an EOS). Returns lookahead [B, d], its lengths [B], and the logits after the
    context's last token ([B, V], None when no sequence was live)."""
    b = seq.shape[0]
    lh = torch.zeros(b, d, dtype=torch.long, device=seq.device)
    lh_len = torch.zeros(b, dtype=torch.long, device=seq.device)
    if not bool(live.any()):
        return lh, lh_len, None
    logits = side.extend_to(seq, seq_len, live, group, work, tally)[:, -1]  # [B, V]
    first = logits
    live = live.clone()
    for j in range(d):
        tok = logits.argmax(-1)
        lh[:, j] = torch.where(live, tok, 0)
        lh_len += live.long()
        live &= ~torch.isin(tok, eos)
        if j + 1 == d or not bool(live.any()):
            break
        logits = side.feed(tok[:, None], live[:, None], group, work, tally)[:, -1]
    return lh, lh_len, first


def best_lookahead_token(
    ctx: Context, prompts: list[PromptInput], batch: SpecBatch, side: Side, s_logits: torch.Tensor,
    prefix: torch.Tensor,
    prefix_len: torch.Tensor, ext: torch.Tensor, ext_len: torch.Tensor, select: torch.Tensor, k: int, d: int,
    eos: torch.Tensor, tally: DecodeTally, work: Work,
) -> torch.Tensor:
    """One CDLH token for the sequences `select` marks, with lookaheads from `side` (a throwaway fork of it).

    s_logits [B, V]: the target's logits at the context; prefix: the side's context after its n_in; ext: what
    follows the response before the candidate (x_1..x_n in CDSL). Returns [B] tokens (0 for sequences not selected)."""
    idx = select.nonzero().flatten()  # [R]
    out = torch.zeros(batch.size, dtype=torch.long, device=s_logits.device)
    if idx.numel() == 0:
        return out
    cands = torch.topk(s_logits[idx], k, dim=-1).indices  # [R, k] ordered by logit
    rep = idx.repeat_interleave(k)  # [R*k]
    flat = cands.reshape(-1, 1)  # [R*k, 1]
    one = torch.ones_like(rep)
    f = side.fork(rep)
    seq, seq_len = ragged_cat(prefix[rep], prefix_len[rep], flat, one)
    lh, lh_len, _ = rollout(f, seq, seq_len, ~torch.isin(flat[:, 0], eos), d, eos, batch.group[rep], work, tally)
    full, full_len = ragged_cat(ext[rep], ext_len[rep], flat, one)
    full, full_len = ragged_cat(full, full_len, lh, lh_len)
    r = score_sequences(ctx, prompts, batch, rep, full, full_len, work).view(-1, k)  # [R, k]
    best = r.argmax(-1)  # the first maximum: the more likely candidate on ties
    out[idx] = cands[torch.arange(idx.numel(), device=idx.device), best]
    return out


def step_one(
    ctx: Context, prompts: list[PromptInput], batch: SpecBatch, t: Side, dr: Side, after_n: torch.Tensor,
    x: torch.Tensor, n: torch.Tensor, select: torch.Tensor, b: int, d: int, r_t: float, eos: torch.Tensor,
    tally: DecodeTally, work: Work,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of S2/S3 (Algorithm 1, lines 30-43) for the sequences `select` marks. after_n [B, V]: the target's
    logits after x_1..x_n. Returns X [B, b], its accepted length [B] and whether step 1 found tokens [B]."""
    bsz = batch.size
    dev = x.device
    X = torch.zeros(bsz, b, dtype=torch.long, device=dev)
    X_len = torch.zeros(bsz, dtype=torch.long, device=dev)
    found = torch.zeros(bsz, dtype=torch.bool, device=dev)
    searching = select.clone()
    t_back, t_back_len = t.backlog(batch.tokens, batch.length)
    t_ctx, t_ctx_len = ragged_cat(t_back, t_back_len, x, n)  # target context: backlog, pending, x_1..x_n
    d_back, d_back_len = dr.backlog(batch.tokens, batch.length)
    d_ctx, d_ctx_len = ragged_cat(d_back, d_back_len, x, n)
    X[:, 0] = after_n.argmax(-1)  # line 32 for i = 1: already known from the verification forward
    for i in range(b):
        width = torch.full_like(n, i + 1)
        if i > 0:
            seq, seq_len = ragged_cat(t_ctx, t_ctx_len, X, torch.full_like(n, i))
            logits = t.extend_to(seq, seq_len, searching, batch.group, work, tally)[:, -1]
            X[:, i] = torch.where(searching, logits.argmax(-1), 0)
        seq, seq_len = ragged_cat(d_ctx, d_ctx_len, X, width)  # lines 34-38: the draft's lookahead
        lh, lh_len, _ = rollout(dr, seq, seq_len, searching & ~torch.isin(X[:, i], eos), d, eos, batch.group,
                                work, tally)
        ext, ext_len = ragged_cat(x, n, X, width)
        ext, ext_len = ragged_cat(ext, ext_len, lh, lh_len)
        idx = searching.nonzero().flatten()
        r = torch.full((bsz,), -torch.inf, dtype=torch.float64, device=dev)
        r[idx] = score_sequences(ctx, prompts, batch, idx, ext[idx], ext_len[idx], work)
        hit = searching & (r >= r_t)  # line 39
        found |= hit
        X_len = torch.where(hit, i + 1, X_len)
        searching &= ~hit & ~torch.isin(X[:, i], eos)  # nothing can follow an EOS
        if not bool(searching.any()):
            break
    return X, X_len, found


def step_cdsl(
    ctx: Context, prompts: list[PromptInput], batch: SpecBatch, tally: DecodeTally, work: Work, d: int, k: int,
    a_t: float, r_t: float, b: int, validation: str, eos: torch.Tensor, decide=cdsl_states,
) -> torch.Tensor:
    """One CDSL iteration for every open sequence; returns [B] the states taken (0 for sequences not running).

    `decide(n, d, r, a_t, r_t) -> state` is Algorithm 1's decision, a parameter so tests can force states."""
    t, dr = batch.sides(ctx.target, ctx.draft)
    bsz = batch.size
    dev = batch.pending.device
    ar = torch.arange(bsz, device=dev)
    room_ = room(batch, eos)
    active = room_ > 0
    warp = ctx.warp if validation == "sampling" else Warp(temperature=0.0)
    pos0 = batch.length - 1 - batch.offset  # [B] response index of the pending token
    grp = batch.group

    # lines 4-8: draft d tokens
    seq, seq_len = dr.backlog(batch.tokens, batch.length)
    logits = dr.extend_to(seq, seq_len, active, grp, work, tally)[:, -1]  # [B, V]
    x = torch.zeros(bsz, d, dtype=torch.long, device=dev)
    qs = []
    for i in range(d):
        q_i = warp_probs(logits, warp)  # [B, V]
        u = uniforms(ctx.seed, batch.rng_key, batch.cand, pos0 + 1 + i, STREAM_DRAFT)
        x[:, i] = logits.argmax(-1) if warp.greedy else sample(q_i, u)
        qs.append(q_i)
        if i + 1 < d:
            logits = dr.feed(x[:, i : i + 1], active[:, None], grp, work, tally)[:, -1]

    # lines 9-20: verify with one target forward; n accepted
    back, back_len = t.backlog(batch.tokens, batch.length)
    seq, seq_len = ragged_cat(back, back_len, x, torch.full_like(back_len, d) * active)
    L = t.extend_to(seq, seq_len, active, grp, work, tally, keep=d + 1)  # [B, d+1, V] column i predicts x_{i+1}
    if validation == "hard":
        ok = L[:, :d].argmax(-1) == x
    else:
        p = warp_probs(L[:, :d], warp)
        q = torch.stack(qs, 1)
        p_d = p.gather(-1, x[..., None])[..., 0]
        q_d = q.gather(-1, x[..., None])[..., 0]
        u = uniforms(ctx.seed, batch.rng_key[:, None], batch.cand[:, None], pos0[:, None] + 1 + torch.arange(d, device=dev),
                     STREAM_ACCEPT)
        ok = u.to(p_d.dtype) * q_d < p_d
    n = ok.long().cumprod(-1).sum(-1) * active  # [B]
    j = torch.arange(d, device=dev)[None, :]
    accepted_eos = torch.isin(x, eos) & (j < n[:, None])
    ends = accepted_eos.any(-1)  # an accepted EOS ends the sequence
    n = torch.where(ends, accepted_eos.long().argmax(-1) + 1, n)

    # line 22: reward of the accepted prefix; lines 24-52: state and action
    idx = active.nonzero().flatten()
    r = torch.zeros(bsz, dtype=torch.float64, device=dev)
    r[idx] = score_sequences(ctx, prompts, batch, idx, x[idx], n[idx], work)
    state = decide(n, d, r, a_t, r_t) * active
    after_n = L[ar, n]  # [B, V] the target's logits after x_1..x_n

    extra = torch.zeros(bsz, max(b, 1), dtype=torch.long, device=dev)
    extra_len = torch.zeros(bsz, dtype=torch.long, device=dev)
    low_a = active & ~ends & ((state == S2) | (state == S3))
    found = torch.zeros(bsz, dtype=torch.bool, device=dev)
    if b > 0 and bool(low_a.any()):
        X, X_len, found = step_one(ctx, prompts, batch, t, dr, after_n, x, n, low_a, b, d, r_t, eos, tally, work)
        extra = torch.where(found[:, None], X, extra)
        extra_len = torch.where(found, X_len, extra_len)
    appx = active & ~ends & ((state == S4) | (low_a & ~found))
    if bool(appx.any()):
        d_back, d_back_len = dr.backlog(batch.tokens, batch.length)
        prefix, prefix_len = ragged_cat(d_back, d_back_len, x, n)
        o = best_lookahead_token(ctx, prompts, batch, dr, after_n, prefix, prefix_len, x, n, appx, k, d, eos, tally,
                                 work)
        extra[:, 0] = torch.where(appx, o, extra[:, 0])
        extra_len = torch.where(appx, 1, extra_len)

    block, block_len = ragged_cat(x, n, extra, extra_len)
    m = emit(batch, block, block_len * active, room_, eos)
    t.commit(batch.tokens, batch.length)
    dr.commit(batch.tokens, batch.length)
    batch.store(t, dr)
    tally.add_states(grp, state)
    tally.add("proposed", grp, torch.full_like(n, d) * active)
    tally.add("accepted", grp, n)
    tally.add("emitted", grp, m)
    tally.add("generated", grp, m)
    tally.add("verifications", grp, active)
    return state


def step_cdlh(
    ctx: Context, prompts: list[PromptInput], batch: SpecBatch, tally: DecodeTally, work: Work, k: int, d: int,
    approx: bool, eos: torch.Tensor, s_logits: torch.Tensor | None,
) -> torch.Tensor | None:
    """One token of CDLH (Algorithm 2; lookaheads by the target) or CDLH-appx (by the draft) for every open sequence.

    s_logits [B, V]: the target's logits at the current context when already known (CDLH keeps them from the
    chosen candidate's first lookahead forward), else None. Returns the next call's s_logits (None for CDLH-appx).
    """
    t, dr = batch.sides(ctx.target, ctx.draft if approx else None)
    bsz = batch.size
    dev = batch.pending.device
    ar = torch.arange(bsz, device=dev)
    room_ = room(batch, eos)
    active = room_ > 0
    if s_logits is None:  # lines 4-5: s(x) = M_p(pfx)
        seq, seq_len = t.backlog(batch.tokens, batch.length)
        s_logits = t.extend_to(seq, seq_len, active, batch.group, work, tally)[:, -1]
    cands = torch.topk(s_logits, k, dim=-1).indices  # [B, k] line 6
    side = dr if approx else t
    side.repeat(k)  # one sequence per candidate; the chosen one is kept below
    rep = ar.repeat_interleave(k)
    flat = cands.reshape(-1, 1)
    one = torch.ones_like(rep)
    back, back_len = side.backlog(batch.tokens[rep], batch.length[rep])
    seq, seq_len = ragged_cat(back, back_len, flat, one)
    live = active[rep] & ~torch.isin(flat[:, 0], eos)
    lh, lh_len, first = rollout(side, seq, seq_len, live, d, eos, batch.group[rep], work, tally)  # lines 9-16
    full, full_len = ragged_cat(flat, one, lh, lh_len)
    r = torch.full((bsz * k,), -torch.inf, dtype=torch.float64, device=dev)
    idx = active[rep].nonzero().flatten()
    r[idx] = score_sequences(ctx, prompts, batch, rep[idx], full[idx], full_len[idx], work)  # line 17
    best = r.view(bsz, k).argmax(-1)  # lines 18-21 (strict >: the first maximum)
    side.select(ar * k + best)
    m = emit(batch, cands[ar, best][:, None], active.long(), room_, eos)
    if approx:
        t.commit(batch.tokens, batch.length)
        dr.commit(batch.tokens, batch.length, with_pending=True)
        batch.store(t, dr)
        nxt = None
    else:
        t.commit(batch.tokens, batch.length, with_pending=True)  # the chosen token is in the cache already
        batch.store(t, None)
        nxt = first.view(bsz, k, -1)[ar, best] if first is not None else None
    tally.add("emitted", batch.group, m)
    tally.add("generated", batch.group, m)
    return nxt


@torch.inference_mode()
def run_cdsl(ctx: Context, prompts: list[PromptInput], d: int, k: int, a_t: float, r_t: float, b: int,
             validation: str, decide=cdsl_states) -> tuple[list[MethodResult], Work]:
    if ctx.draft is None:
        raise ValueError("models.draft: required by method 'cdsl'")

    def step(batch: SpecBatch, tally: DecodeTally, work: Work, eos: torch.Tensor, kept) -> None:
        step_cdsl(ctx, prompts, batch, tally, work, d, k, a_t, r_t, b, validation, eos, decide)

    out, tally, work = decode_batch(ctx, prompts, ctx.draft, step)
    results, work = finish(ctx, prompts, out, tally, work)
    for g, res in enumerate(results):
        res.stats["state_counts"] = tally.states[g].tolist()
    return results, work


@torch.inference_mode()
def run_cdlh(ctx: Context, prompts: list[PromptInput], d: int, k: int, approx: bool
             ) -> tuple[list[MethodResult], Work]:
    if approx and ctx.draft is None:
        raise ValueError("models.draft: required by method 'cdlh_appx'")
    s_logits = None  # the target's next-token logits carried between steps, one line per open sequence

    def step(batch: SpecBatch, tally: DecodeTally, work: Work, eos: torch.Tensor, kept) -> None:
        nonlocal s_logits
        if kept is not None and s_logits is not None:
            s_logits = s_logits[kept]
        s_logits = step_cdlh(ctx, prompts, batch, tally, work, k, d, approx, eos, s_logits)

    out, tally, work = decode_batch(ctx, prompts, ctx.draft if approx else None, step)
    return finish(ctx, prompts, out, tally, work, speculative=False)


def cdsl(ctx: Context, params: CDSL, prompts: list[PromptInput]) -> tuple[list[MethodResult], Work]:
    p = params
    return run_cdsl(ctx, prompts, p.lookahead, p.top_k, p.accept_threshold, p.reward_threshold, p.b, p.validation)


def cdlh(ctx: Context, params: CDLH, prompts: list[PromptInput]) -> tuple[list[MethodResult], Work]:
    return run_cdlh(ctx, prompts, params.lookahead, params.top_k, approx=False)


def cdlh_appx(ctx: Context, params: CDLHAppx, prompts: list[PromptInput]) -> tuple[list[MethodResult], Work]:
    return run_cdlh(ctx, prompts, params.lookahead, params.top_k, approx=True)
