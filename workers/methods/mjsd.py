"""Multi-token joint speculative decoding (MJSD, paper 002, Algorithm 1; docs/references.md), batched across
prompts.

One iteration per sequence:
1. the draft beam-samples gamma tokens with num_beams beams: every beam is extended by every token, the
   num_beams (beam, token) pairs are drawn without replacement with probability proportional to the joint draft
   probability (Gumbel top-k; the num_beams best at temperature 0, i.e. beam search), and the best beam wins;
2. q_j = q(x_1..x_j) is the joint draft probability of the *chosen* beam's own prefix. Beam scores are reordered
   with the beam indices at every step (the prefix history of beam m is gathered from its parent), so q_j belongs
   to the same tokens as x_1..x_j (the authors' code skipped this reordering and compared p against other beams'
   scores);
3. one target forward gives p(x_1..x_j) for every j; the longest prefix j with min(1, p/q) > tau is accepted (not
   necessarily every shorter one passes, as in the paper's loop);
4. one token t is sampled from the target at position j + 1 (argmax at temperature 0). Emitted: x_1..x_j, t.
So every iteration costs exactly one target call. tau = 1 accepts nothing (min(1, .) > 1 never holds): MJSD is then
the target's own decoding.

Likelihoods p and q are the models' distributions warped by temperature, top-k and top-p; at temperature 0 (greedy
selection) they are taken at temperature 1, since the one-hot argmax distribution has no likelihood to compare.
Beams that reach EOS stay in the beam with their score frozen (their continuation is EOS at log-probability 0), as
do the beams of a sequence past its own gamma_b = min(gamma, room - 1).
"""

from __future__ import annotations

import math

import torch

from schemas.methods import MJSD
from workers.accounting.work import Work
from workers.candidates import MethodResult, PromptInput
from workers.context import Context
from workers.methods.draft_target import decode_batch, finish
from workers.decoding.sampling import STREAM_TOKEN, Warp, sample, uniforms, warp_probs
from workers.decoding.speculative import (
    STREAM_BEAM, DecodeTally, Side, SpecBatch, commit_block, ragged_cat, room,
)


def likelihood_warp(warp: Warp) -> Warp:
    """The warp whose probabilities MJSD compares: the sampling warp, at temperature 1 when sampling is greedy."""
    return Warp(temperature=warp.temperature if not warp.greedy else 1.0, top_k=warp.top_k, top_p=warp.top_p)


def log_probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    return torch.log(warp_probs(logits, warp))  # -inf where the warp removed a token


def choose_beams(
    scores: torch.Tensor, num_beams: int, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick num_beams of the candidate scores [B, C] (joint log q of each (beam, token) pair).

    u None: the num_beams largest (beam search). Otherwise Gumbel top-k with uniforms u [B, C]: a draw without
    replacement proportional to exp(score). Returns (chosen scores [B, M], chosen candidate indices [B, M]).
    """
    if u is None:
        return torch.topk(scores, num_beams, dim=-1)
    gumbel = -torch.log(-torch.log(u.to(scores.dtype)))  # [B, C]
    idx = torch.topk(scores + gumbel, num_beams, dim=-1).indices
    return scores.gather(1, idx), idx


def beam_draft(
    d: Side, batch: SpecBatch, gam: torch.Tensor, num_beams: int, warp: Warp, seed: int, eos: torch.Tensor,
    work: Work, tally: DecodeTally, stride: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam-sample gamma_b tokens per sequence with the draft. Returns the chosen beam's tokens x [B, G] and the joint
    draft log-probabilities of its prefixes, log q(x_1..x_j) [B, G]. The draft side ends on the chosen beams
    (fed: backlog, pending, x_1..x_{G-1}). `stride`: the method's gamma (the most any iteration drafts), which keeps
    the random coordinates of different iterations apart (default: this call's G)."""
    b, m = batch.size, num_beams
    g = int(gam.max())
    lik = likelihood_warp(warp)
    pos0 = batch.length - 1 - batch.offset  # [B] response index of the pending token
    seq, seq_len = d.backlog(batch.tokens, batch.length)
    logits = d.extend_to(seq, seq_len, gam > 0, batch.group, work, None)[:, -1]  # [B, V]
    v = logits.shape[-1]
    fill = int(eos[0])
    cand_ids = torch.arange(m * v, device=logits.device)  # RNG coordinate of each (beam, token) pair

    def draws(step: int) -> torch.Tensor | None:
        """Uniforms [B, M*V] of one beam step. Their position coordinate, pending index x gamma_max + step, is
        unique to the iteration (the pending index grows every iteration), so no draw is reused by a later one."""
        if warp.greedy:
            return None
        return uniforms(seed, batch.rng_key[:, None], cand_ids[None, :], (pos0 * (stride or g) + step)[:, None],
                        STREAM_BEAM)

    # step 1: only beam 0 is live
    start = torch.full((b, m), -math.inf, device=logits.device)
    start[:, 0] = 0.0
    cand = (start[:, :, None] + log_probs(logits, lik)[:, None, :]).reshape(b, m * v)  # [B, M*V]
    score, idx = choose_beams(cand, m, draws(0))  # [B, M]
    tokens = (idx % v)[:, :, None]  # [B, M, 1]
    hist = score[:, :, None]  # [B, M, 1] log q of each beam's prefixes
    d.repeat(m)
    grp = batch.group.repeat_interleave(m)
    for i in range(1, g):
        live = (gam > i).repeat_interleave(m)  # [B*M] sequences still drafting
        out = d.feed(tokens[:, :, -1].reshape(b * m, 1), live[:, None], grp, work, None)[:, -1]
        logq = log_probs(out, lik).view(b, m, v)  # [B, M, V]
        frozen = torch.isin(tokens[:, :, -1], eos) | ~(gam > i)[:, None]  # [B, M] ended beams and ended sequences
        still = torch.full_like(logq, -math.inf)
        still[..., fill] = 0.0
        logq = torch.where(frozen[..., None], still, logq)
        cand = (score[:, :, None] + logq).reshape(b, m * v)
        score, idx = choose_beams(cand, m, draws(i))
        parent = idx // v  # [B, M]
        tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, i)), (idx % v)[..., None]], -1)
        hist = torch.cat([hist.gather(1, parent[..., None].expand(-1, -1, i)), score[..., None]], -1)
        d.select((torch.arange(b, device=idx.device)[:, None] * m + parent).flatten())
    # draft calls counted per sequence: the first forward (one sequence per prompt), then num_beams sequences per
    # further step
    tally.add("draft_calls", batch.group, (gam > 0).long() + m * (gam - 1).clamp(min=0))
    best = score.argmax(-1)  # [B]
    ar = torch.arange(b, device=best.device)
    d.select(ar * m + best)
    return tokens[ar, best], hist[ar, best]


def mjsd_accept(logp_joint: torch.Tensor, logq_joint: torch.Tensor, eligible: torch.Tensor, tau: float) -> torch.Tensor:
    """[B] the longest j (0 if none) among eligible [B, G] with min(1, p(x_1..j)/q(x_1..j)) > tau."""
    log_tau = math.log(tau) if tau > 0 else -math.inf
    ok = (torch.clamp(logp_joint - logq_joint, max=0.0) > log_tau) & eligible  # [B, G]
    j = torch.arange(1, ok.shape[1] + 1, device=ok.device)[None, :]
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return (ok.long() * j).max(-1).values


def step_mjsd(
    target: torch.nn.Module, draft: torch.nn.Module, batch: SpecBatch, gamma: int, num_beams: int, tau: float,
    warp: Warp, seed: int, eos: torch.Tensor, work: Work, tally: DecodeTally,
) -> None:
    """One MJSD iteration (Algorithm 1) for every open sequence."""
    t, d = batch.sides(target, draft)
    b = batch.size
    dev = batch.pending.device
    ar = torch.arange(b, device=dev)
    room_ = room(batch, eos)
    active = room_ > 0
    gam = (room_ - 1).clamp(0, gamma) * active  # [B]
    g = int(gam.max()) if b else 0
    pos0 = batch.length - 1 - batch.offset
    lik = likelihood_warp(warp)

    if g > 0:
        x, logq_joint = beam_draft(d, batch, gam, num_beams, warp, seed, eos, work, tally, stride=gamma)  # [B, G] x2
    else:
        x = torch.zeros(b, 0, dtype=torch.long, device=dev)
        logq_joint = torch.zeros(b, 0, device=dev)
    back, back_len = t.backlog(batch.tokens, batch.length)
    seq, seq_len = ragged_cat(back, back_len, x, gam)
    logits = t.extend_to(seq, seq_len, active, batch.group, work, tally, keep=g + 1)  # [B, G+1, V]
    if logits is None:
        return
    cols = ((g - gam)[:, None] + torch.arange(g + 1, device=dev)[None, :]).clamp(max=g)
    logits = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))  # column i predicts position i+1

    j_idx = torch.arange(g, device=dev)[None, :]
    is_eos = torch.isin(x, eos)
    first_eos = is_eos.long().cumsum(-1).eq(0).sum(-1)  # [B] index of the first EOS in x (g if none)
    eligible = (j_idx < gam[:, None]) & (j_idx <= first_eos[:, None])  # prefixes end at the first EOS
    logp_joint = log_probs(logits[:, :g], lik).gather(-1, x[..., None])[..., 0].cumsum(-1)  # [B, G]
    j_star = mjsd_accept(logp_joint, logq_joint, eligible, tau)  # [B]

    nxt_logits = logits[ar, j_star]  # [B, V] the target at position j + 1
    u = uniforms(seed, batch.rng_key, batch.cand, pos0 + 1 + j_star, STREAM_TOKEN)
    nxt = nxt_logits.argmax(-1) if warp.greedy else sample(warp_probs(nxt_logits, warp), u)
    block = torch.cat([x, x.new_zeros(b, 1)], 1)
    block[ar, j_star] = nxt
    commit_block(batch, t, d, tally, block, j_star, active, gam, room_, eos)


@torch.inference_mode()
def run_mjsd(ctx: Context, prompts: list[PromptInput], gamma: int, num_beams: int, tau: float
             ) -> tuple[list[MethodResult], Work]:
    if ctx.draft is None:
        raise ValueError("models.draft: required by method 'mjsd'")

    def step(batch: SpecBatch, tally: DecodeTally, work: Work, eos: torch.Tensor, kept) -> None:
        step_mjsd(ctx.target, ctx.draft, batch, gamma, num_beams, tau, ctx.warp, ctx.seed, eos, work, tally)

    out, tally, work = decode_batch(ctx, prompts, ctx.draft, step)
    return finish(ctx, prompts, out, tally, work)


def mjsd(ctx: Context, params: MJSD, prompts: list[PromptInput]) -> tuple[list[MethodResult], Work]:
    return run_mjsd(ctx, prompts, params.gamma, params.num_beams, params.tau)
