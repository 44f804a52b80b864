"""Batched speculative decoding (Leviathan et al.; docs/references.md), and the two-cache bookkeeping every
draft/target method shares.

Terms (a *sequence* is one line of a decoding batch; see workers.decoding.batch for groups, pending tokens and holes):
- drafted tokens d_1..d_gamma: proposed by the draft, d_i sampled from q_i, the draft's warped distribution at
  that position (its argmax at temperature 0);
- accepted: a drafted token that passes u_i < p_i(d_i) / q_i(d_i), u_i uniform, i.e. probability min(1, p/q);
  only the leading run of passing tokens is accepted;
- rejected (drafted token): the first drafted token that fails; every drafted token after it is discarded
  unexamined (not to be confused with a candidate rejected by a Speculative Rejection cut);
- recovered token: the token sampled at the rejected position from norm(max(0, p_i - q_i));
- bonus token: the token sampled from p_{gamma+1} when every drafted token of the sequence was accepted;
- emitted block: the accepted tokens, then the recovered or bonus token, cut after the first EOS and at the
  sequence's limit. Its last token becomes the sequence's pending token.
p and q are warped identically (temperature, top-k, top-p). At temperature 0 both are one-hot, so acceptance is
argmax matching and the recovered token is the target's argmax: greedy speculative decoding is the target's own
greedy decoding, token for token.

Ragged acceptance without per-sequence cropping. Each model keeps its own KV cache and 2-D mask (a `Side`).
Whatever a step feeds (a backlog, the pending token, drafted tokens, lookaheads) is appended as columns to every
sequence at once; a sequence with nothing to feed at a column gets a hole there (mask 0). Once the step's tokens are
decided, `Side.commit` keeps, per sequence, the longest run of fed columns that agrees with the committed tokens and
turns the rest into holes; columns that are holes in every sequence are cropped from the right (`cache.crop(-n)`,
only for n > 0). Position ids always come from the mask's cumsum, so holes take no position and the cache stays
exact. A committed
token a model has not seen yet (the draft never feeds the last drafted token; the target's own choices in CDSL) waits
in that model's *backlog*, tokens[n_in : length - 1], and is fed right-aligned (left holes) in front of its next feed.
When holes pile up, `pack` moves each sequence's real columns together: keys carry their rotary positions already, so
moving a column changes nothing.

Randomness is counter-based (workers.decoding.sampling): a draw is a function of (seed, prompt, candidate, response
position, stream), so a sequence's tokens do not depend on the sequences batched with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import DynamicCache

from workers.accounting.work import Work
from workers.decoding.batch import Batch, left_pad, position_ids
from workers.decoding.kvcache import cache_kw, crop_right, fork_cache, model_kv_bytes, new_cache, pack, pack_threshold
from workers.decoding.logprobs import token_logprobs
from workers.decoding.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    STREAM_TOKEN,
    Warp,
    next_tokens_and_logprobs,
    sample,
    uniforms,
    warp_probs,
)

# workers.decoding.sampling uses streams 0-3 of its 8; MJSD's beam sampling draws its Gumbel noise from stream 4.
STREAM_BEAM = 4


# ---------------------------------------------------------------------------------------------------------------
# Ragged token helpers: per-sequence slices of [B, T] token tables, left-aligned with a length.


def take(tokens: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens[b, start_b : start_b + count_b] left-aligned: ([B, W] with W = max count, [B] lengths)."""
    count = count.clamp(min=0)
    width = int(count.max()) if count.numel() else 0
    j = torch.arange(width, device=tokens.device)  # [W]
    idx = (start[:, None] + j).clamp(0, max(tokens.shape[1] - 1, 0))  # [B, W]
    out = tokens.gather(1, idx) if width and tokens.shape[1] else tokens.new_zeros(tokens.shape[0], width)
    return out.masked_fill(j >= count[:, None], 0), count


def ragged_cat(
    a: torch.Tensor, a_len: torch.Tensor, b: torch.Tensor, b_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence concatenation of a[b, :a_len_b] and b[b, :b_len_b] (left-aligned [B, W], [B])."""
    out_len = a_len + b_len
    width = int(out_len.max()) if out_len.numel() else 0
    j = torch.arange(width, device=a.device)[None, :]  # [1, W]
    from_a = a.gather(1, j.clamp(max=max(a.shape[1] - 1, 0)).expand(a.shape[0], -1)) if a.shape[1] else 0
    jb = (j - a_len[:, None]).clamp(0, max(b.shape[1] - 1, 0))  # [B, W]
    from_b = b.gather(1, jb) if b.shape[1] else 0
    out = torch.where(j < a_len[:, None], from_a, from_b) if width else a.new_zeros(a.shape[0], 0)
    return out.masked_fill(j >= out_len[:, None], 0) if width else out, out_len


def right_align(seq: torch.Tensor, start: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seq[b, start_b:stop_b] right-aligned into [B, W] ids with a [B, W] bool mask of the real entries."""
    n = (stop - start).clamp(min=0)
    width = int(n.max()) if n.numel() else 0
    j = torch.arange(width, device=seq.device)[None, :]  # [1, W]
    lead = width - n[:, None]  # [B, 1] left holes
    src = (start[:, None] + j - lead).clamp(0, max(seq.shape[1] - 1, 0))
    real = j >= lead
    ids = seq.gather(1, src) if width and seq.shape[1] else seq.new_zeros(seq.shape[0], width)
    return ids.masked_fill(~real, 0), real


# ---------------------------------------------------------------------------------------------------------------
# Per-prompt counters


class DecodeTally:
    """Per-prompt counters of a decoding method: calls per model, drafted tokens proposed and accepted, tokens
    emitted and generated, and CDSL's states. Calls are counted per sequence (a forward over k sequences of a prompt
    is k calls), which is how a single sequence sees them and how the papers count them; a `Work` records batched
    forwards."""

    KEYS = ("target_calls", "draft_calls", "proposed", "accepted", "emitted", "verifications", "generated")

    def __init__(self, num_groups: int):
        self.c = {k: torch.zeros(num_groups, dtype=torch.long) for k in self.KEYS}
        self.states = torch.zeros(num_groups, 4, dtype=torch.long)

    def grow(self, num_groups: int) -> None:
        """Room for groups up to num_groups - 1 (prompts that join a pool later)."""
        extra = num_groups - self.states.shape[0]
        if extra > 0:
            self.c = {k: torch.cat([v, v.new_zeros(extra)]) for k, v in self.c.items()}
            self.states = torch.cat([self.states, self.states.new_zeros(extra, 4)])

    def add(self, key: str, group: torch.Tensor, values: torch.Tensor) -> None:
        self.c[key].index_add_(0, group.cpu(), values.cpu().long())

    def add_states(self, group: torch.Tensor, state: torch.Tensor) -> None:
        """Count CDSL states 1..4 (0 = no state this iteration)."""
        for s in range(1, 5):
            self.states[:, s - 1].index_add_(0, group.cpu(), (state == s).cpu().long())

    def ratio(self, num: str, den: str, g: int) -> float | None:
        d = int(self.c[den][g])
        return float(self.c[num][g]) / d if d else None

    def stats(self, g: int, speculative: bool = True) -> dict:
        out = {
            "draft_calls_per_token": self.ratio("draft_calls", "generated", g),
            "target_calls_per_token": self.ratio("target_calls", "generated", g),
        }
        if speculative:
            out["acceptance_rate"] = self.ratio("accepted", "proposed", g)
            out["mean_accepted_tokens"] = self.ratio("emitted", "verifications", g)
        return out


# ---------------------------------------------------------------------------------------------------------------
# One model's view of the batch


@dataclass
class Side:
    """One model's cache and mask over the batch, and what it has seen.

    n_in[b]: how many of the sequence's tokens (tokens[b, :n_in]) are in this cache; tokens[n_in : length - 1] are its
    backlog and tokens[length - 1] the pending token. Columns appended since the last commit (from `base` on) are
    the *fed* region; `fed` holds their token ids.
    """

    model: torch.nn.Module
    role: str  # "target" | "draft" (for the Work and the DecodeTally)
    cache: DynamicCache
    mask: torch.Tensor  # [B, L] long
    n_in: torch.Tensor  # [B]
    base: int = -1
    fed: torch.Tensor | None = None  # [B, L - base]

    def __post_init__(self):
        if self.base < 0:
            self.base = self.mask.shape[1]
        if self.fed is None:
            self.fed = self.mask.new_zeros(self.mask.shape[0], self.mask.shape[1] - self.base)

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def feed(
        self, ids: torch.Tensor, real: torch.Tensor, group: torch.Tensor, work: Work, tally: DecodeTally | None,
        keep: int = 1,
    ) -> torch.Tensor | None:
        """Append columns ids [B, W] (real [B, W] bool; False = hole) and run one forward.

        Returns float32 logits [B, keep, V] of the last `keep` columns, or None (and appends nothing) when no sequence
        has a real column. Only sequences with a real column are counted, in `work` and in the DecodeTally.
        """
        real = real.bool()
        if ids.shape[1] == 0 or not bool(real.any()):
            return None
        w = ids.shape[1]
        self.mask = torch.cat([self.mask, real.long()], 1)  # [B, L + W]
        self.fed = torch.cat([self.fed, ids], 1)
        out = self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=position_ids(self.mask)[:, -w:],
            **cache_kw(self.model, self.cache), use_cache=True, logits_to_keep=keep,
        )
        charged = real.any(-1)  # [B] sequences with a real column
        work.forward(self.role, group, real.sum(-1), charged)
        if tally is not None:
            tally.add(self.role + "_calls", group, charged)
        return out.logits.float()

    def _ranks(self) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.mask[:, self.base:].bool()  # [B, F] real fed columns
        return f, f.long().cumsum(-1) - 1  # rank of each real fed column in the fed sequence

    def match(self, seq: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """[B] length of the longest run of real fed columns, from the first, that equals seq[b, :seq_len_b]
        (seq holds the tokens that follow the cache's n_in tokens)."""
        f, rank = self._ranks()
        if f.shape[1] == 0 or seq.shape[1] == 0:
            return torch.zeros(self.size, dtype=torch.long, device=self.mask.device)
        expect = seq.gather(1, rank.clamp(0, seq.shape[1] - 1))  # [B, F]
        ok = f & (rank < seq_len[:, None]) & (self.fed == expect)
        good = f & ((f & ~ok).long().cumsum(-1) == 0)
        return good.sum(-1)

    def retract(self, count: torch.Tensor, which: torch.Tensor | None = None) -> None:
        """Keep the first count[b] real fed columns of each sequence (of those `which` [B] bool marks, default all)
        and hole the rest."""
        f, rank = self._ranks()
        keep = f & (rank < count[:, None])
        if which is not None:
            keep = torch.where(which[:, None], keep, f)
        self.mask = torch.cat([self.mask[:, : self.base], keep.long()], 1)

    def extend_to(
        self, seq: torch.Tensor, seq_len: torch.Tensor, which: torch.Tensor, group: torch.Tensor, work: Work,
        tally: DecodeTally | None, keep: int = 1,
    ) -> torch.Tensor | None:
        """Bring the sequences `which` [B] bool marks to the context seq[b, :seq_len_b] (the tokens after the cache's
        n_in) and return logits of the last `keep` columns: fed columns that agree with seq stay, the others become
        holes, and the rest of seq (at least its last token) is fed right-aligned. Other sequences get holes."""
        count = torch.minimum(self.match(seq, seq_len), (seq_len - 1).clamp(min=0))
        self.retract(count, which)
        ids, real = right_align(seq, count, seq_len)
        return self.feed(ids, real & which[:, None], group, work, tally, keep)

    def commit(self, tokens: torch.Tensor, length: torch.Tensor, with_pending: bool = False) -> None:
        """Keep the fed columns that agree with the committed tokens[:, :length] (the pending token excluded unless
        `with_pending`), hole the rest, advance n_in, crop trailing holes and start a new fed region."""
        stop = length if with_pending else length - 1
        seq, seq_len = take(tokens, self.n_in, stop - self.n_in)
        count = self.match(seq, seq_len)
        self.retract(count)
        self.n_in = self.n_in + count
        self.mask = crop_right(self.cache, self.mask)
        self.mask = pack(self.cache, self.mask, pack_threshold(self.mask.shape[1]))
        self.base = self.mask.shape[1]
        self.fed = self.mask.new_zeros(self.size, 0)

    def backlog(self, tokens: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's tokens this cache has not seen, the pending one included: ([B, W], [B])."""
        return take(tokens, self.n_in, length - self.n_in)

    # -- sequence bookkeeping (the fed region follows the sequences) ----------------------------------------------
    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.mask, self.n_in, self.fed = self.mask[idx], self.n_in[idx], self.fed[idx]

    def repeat(self, k: int) -> None:
        self.cache.batch_repeat_interleave(k)
        self.mask = self.mask.repeat_interleave(k, 0)
        self.n_in = self.n_in.repeat_interleave(k, 0)
        self.fed = self.fed.repeat_interleave(k, 0)

    def fork(self, idx: torch.Tensor) -> "Side":
        """An independent copy of sequences `idx` (for lookaheads that are thrown away)."""
        return Side(self.model, self.role, fork_cache(self.cache, idx), self.mask[idx], self.n_in[idx], self.base,
                    self.fed[idx])


# ---------------------------------------------------------------------------------------------------------------
# Sequences of two models


@dataclass
class SpecBatch(Batch):
    """A batch decoded with a draft beside the target: `cache`/`mask`/`t_in` are the target's side, `d_*` the draft's.

    `offset` is 0 when tokens[:, :length] is the response (the speculative sampler), 1 when tokens[:, 0] is the
    prompt's last token, fed as the first pending token so that the first iteration of MJSD, CDSL and CDLH is the
    papers' own (their response is tokens[:, 1:length]).
    """

    t_in: torch.Tensor | None = None  # [B]
    d_cache: DynamicCache | None = None
    d_mask: torch.Tensor | None = None  # [B, Ld]
    d_in: torch.Tensor | None = None  # [B]
    offset: int = 0

    def select(self, idx: torch.Tensor) -> None:
        if idx.numel() == self.size and bool((idx == torch.arange(self.size, device=idx.device)).all()):
            return
        self.cache.batch_select_indices(idx)
        if self.d_cache is not None:
            self.d_cache.batch_select_indices(idx)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value[idx])
        self.trim_left()

    def trim_left(self) -> None:
        """Drop the columns no surviving sequence needs (leading padding, holes), in both caches."""
        self.mask = pack(self.cache, self.mask, pack_threshold(self.mask.shape[1]))
        if self.d_cache is not None:
            self.d_mask = pack(self.d_cache, self.d_mask, pack_threshold(self.d_mask.shape[1]))

    def kv_columns(self) -> int:
        """Columns of the wider of the two caches (the memory schedule charges both caches at this width)."""
        d = int(self.d_mask.shape[1]) if self.d_mask is not None else 0
        return max(int(self.mask.shape[1]), d)

    def sides(self, target: torch.nn.Module, draft: torch.nn.Module | None) -> tuple[Side, Side | None]:
        t = Side(target, "target", self.cache, self.mask, self.t_in)
        d = Side(draft, "draft", self.d_cache, self.d_mask, self.d_in) if draft is not None else None
        return t, d

    def store(self, t: Side, d: Side | None) -> None:
        self.cache, self.mask, self.t_in = t.cache, t.mask, t.n_in
        if d is not None:
            self.d_cache, self.d_mask, self.d_in = d.cache, d.mask, d.n_in

    def response(self, i: int) -> list[int]:
        return self.tokens[i, self.offset : int(self.length[i])].tolist()

    def response_len(self) -> torch.Tensor:
        return self.length - self.offset


def room(batch: Batch, eos: torch.Tensor) -> torch.Tensor:
    """[B] tokens each sequence may still emit: 0 for dead sequences and sequences whose pending token is EOS."""
    open_ = batch.alive & ~torch.isin(batch.pending, eos)
    return torch.where(open_, batch.limit - batch.length, 0).clamp(min=0)


def emit(batch: Batch, block: torch.Tensor, block_len: torch.Tensor, room_: torch.Tensor,
         eos: torch.Tensor) -> torch.Tensor:
    """Append each sequence's emitted block[b, :block_len_b], cut after its first EOS and at room_[b] tokens.

    Updates tokens, length and pending; returns [B] the number of tokens appended."""
    k = block.shape[1]
    j = torch.arange(k, device=block.device)[None, :]  # [1, K]
    is_eos = torch.isin(block, eos) & (j < block_len[:, None])
    upto_eos = torch.where(is_eos.any(-1), is_eos.long().argmax(-1) + 1, block_len)
    m = torch.minimum(torch.minimum(block_len, upto_eos), room_).clamp(min=0)  # [B]
    b_idx, j_idx = (j < m[:, None]).nonzero(as_tuple=True)
    batch.tokens[b_idx, batch.length[b_idx] + j_idx] = block[b_idx, j_idx]
    last = block.gather(1, (m - 1).clamp(min=0)[:, None])[:, 0] if k else batch.pending
    batch.pending = torch.where(m > 0, last, batch.pending)
    batch.length = batch.length + m
    return m


def open_batch(
    target: torch.nn.Module, draft: torch.nn.Module | None, prompts: list[list[int]], rng_keys: list[int],
    limits: list[int], pad_id: int, work: Work, tally: DecodeTally, reps: int = 1,
) -> SpecBatch:
    """A batch in the pending convention (offset 1): each prompt's last token is the first pending token, the caches
    hold the rest of the prompt (prefilled once per prompt, repeated `reps` times)."""
    dev = next(target.parameters()).device
    p = len(prompts)
    ids, mask = left_pad([q[:-1] for q in prompts], pad_id, dev)  # [P, L]
    groups = torch.arange(p, device=dev)

    def prefill(model, role):
        cache = new_cache(model.config)
        side = Side(model, role, cache, mask.new_zeros(p, 0), torch.zeros(p, dtype=torch.long, device=dev))
        side.feed(ids, mask.bool(), groups, work, None)
        tally.add(role + "_calls", groups, mask.any(-1).long() * reps)
        cache.batch_repeat_interleave(reps)
        return cache, side.mask.repeat_interleave(reps, 0)

    t_cache, t_mask = prefill(target, "target")
    d_cache, d_mask = prefill(draft, "draft") if draft is not None else (None, None)
    b = p * reps
    width = max(limits) + 1
    tokens = torch.full((b, width), pad_id, dtype=torch.long, device=dev)
    last = torch.tensor([q[-1] for q in prompts], dtype=torch.long, device=dev).repeat_interleave(reps)
    tokens[:, 0] = last
    zeros = torch.zeros(b, dtype=torch.long, device=dev)
    return SpecBatch(
        cache=t_cache, mask=t_mask, pending=last.clone(), group=groups.repeat_interleave(reps),
        cand=torch.arange(reps, device=dev).repeat(p), rng_key=torch.tensor(rng_keys, dtype=torch.long, device=dev)
        .repeat_interleave(reps), length=torch.ones(b, dtype=torch.long, device=dev),
        limit=torch.tensor(limits, dtype=torch.long, device=dev).repeat_interleave(reps) + 1, tokens=tokens,
        alive=torch.ones(b, dtype=torch.bool, device=dev), logprob=torch.zeros(b, dtype=torch.float64, device=dev),
        t_in=zeros.clone(), d_cache=d_cache, d_mask=d_mask,
        d_in=zeros.clone() if draft is not None else None, offset=1,
    )


# ---------------------------------------------------------------------------------------------------------------
# Speculative sampling: the per-position rules as plain functions


def accept_count(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor, gamma_seq: torch.Tensor) -> torch.Tensor:
    """[B] accepted drafted tokens: the leading run of u_i < p_i(d_i) / q_i(d_i), among the first gamma_seq[b].

    p_d, q_d, u: [B, G] target and draft probabilities of the drafted tokens, and uniforms."""
    g = p_d.shape[1]
    ok = (u.to(p_d.dtype) * q_d < p_d) & (torch.arange(g, device=p_d.device)[None, :] < gamma_seq[:, None])
    return ok.long().cumprod(-1).sum(-1)


def recovered_or_bonus(
    p_next: torch.Tensor, q_next: torch.Tensor, rejected: torch.Tensor, u: torch.Tensor, greedy: bool
) -> torch.Tensor:
    """[B] the token after the accepted ones: from norm(max(0, p - q)) where a draft was rejected (recovered), from
    p where all were accepted (bonus). p_next, q_next: [B, V]. If rounding leaves max(0, p - q) without mass
    (p = q, where a rejection has probability 0), p itself is used."""
    resid = (p_next - q_next).clamp(min=0)  # [B, V]
    resid = torch.where((resid.sum(-1, keepdim=True) > 0) & rejected[:, None], resid, p_next)
    if greedy:
        return resid.argmax(-1)
    return sample(resid, u)


# ---------------------------------------------------------------------------------------------------------------
# The speculative sampler (the interface of workers.decoding.target.TargetSampler)


class SpeculativeSampler:
    """Draft proposes gamma tokens per sequence, target verifies them in one forward: samples from the target's own
    (warped) distribution, with fewer target calls."""

    admits = False  # a batch's prompts all start together (two caches and a draft backlog per sequence)

    role = "target"

    def __init__(
        self, target: torch.nn.Module, draft: torch.nn.Module, gamma: int, pad_id: int, eos_ids: list[int],
        warp: Warp, seed: int,
    ):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1; got {gamma}")
        self.target, self.draft, self.gamma = target, draft, gamma
        self.device = next(target.parameters()).device
        self.pad_id = pad_id
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.warp, self.seed = warp, seed
        self.work = Work()  # the forwards run since the decoder last took them
        self.columns_per_step = gamma + 1  # the most columns a step appends to either cache
        self.kv_bytes_per_column = model_kv_bytes(target) + model_kv_bytes(draft)
        self.tally: DecodeTally | None = None

    def stats(self, group: int) -> dict:
        return self.tally.stats(group) if self.tally is not None else {}

    def take_work(self) -> Work:
        """The forwards run since the last call, handed to the decoder (a fresh record starts)."""
        work, self.work = self.work, Work()
        return work

    def prefill(self, prompts: list[list[int]], n: int, rng_keys: list[int], limits: list[int], first_group: int = 0
                ) -> SpecBatch:
        """Prefill each prompt once in both models, repeat n times, sample every sequence's first token from the
        target. The prompts are groups first_group, first_group + 1, ... (the tally keeps every group's counts)."""
        dev = self.device
        p = len(prompts)
        if self.tally is None:
            self.tally = DecodeTally(first_group + p)
        self.tally.grow(first_group + p)
        ids, mask = left_pad(prompts, self.pad_id, dev)  # [P, L]
        groups = torch.arange(p, device=dev) + first_group
        zeros = torch.zeros(p, dtype=torch.long, device=dev)

        t = Side(self.target, "target", new_cache(self.target.config), mask.new_zeros(p, 0), zeros)
        logits = t.feed(ids, mask.bool(), groups, self.work, None)[:, -1]  # [P, V]
        d = Side(self.draft, "draft", new_cache(self.draft.config), mask.new_zeros(p, 0), zeros)
        d.feed(ids, mask.bool(), groups, self.work, None)
        for side in (t, d):
            side.cache.batch_repeat_interleave(n)
            self.tally.add(side.role + "_calls", groups, torch.full_like(groups, n))
        b = p * n
        batch = SpecBatch(
            cache=t.cache, mask=t.mask.repeat_interleave(n, 0),
            pending=torch.zeros(b, dtype=torch.long, device=dev), group=groups.repeat_interleave(n),
            cand=torch.arange(n, device=dev).repeat(p),
            rng_key=torch.tensor(rng_keys, dtype=torch.long, device=dev).repeat_interleave(n),
            length=torch.zeros(b, dtype=torch.long, device=dev),
            limit=torch.tensor(limits, dtype=torch.long, device=dev).repeat_interleave(n),
            tokens=torch.full((b, max(limits)), self.pad_id, dtype=torch.long, device=dev),
            alive=torch.ones(b, dtype=torch.bool, device=dev), logprob=torch.zeros(b, dtype=torch.float64, device=dev),
            t_in=torch.zeros(b, dtype=torch.long, device=dev), d_cache=d.cache, d_mask=d.mask.repeat_interleave(n, 0),
            d_in=torch.zeros(b, dtype=torch.long, device=dev), offset=0,
        )
        u = uniforms(self.seed, batch.rng_key, batch.cand, batch.length, STREAM_TOKEN)
        first = logits.repeat_interleave(n, 0)  # [B, V]
        tok, logp = next_tokens_and_logprobs(first, self.warp, u)
        batch.append_pending(tok, logp)
        self.tally.add("generated", batch.group, torch.ones_like(batch.group))
        return batch

    def step(self, batch: SpecBatch) -> None:
        step_speculative(self.target, self.draft, batch, self.gamma, self.warp, self.seed, self.eos, self.work,
                         self.tally)

    def finished(self, batch: Batch) -> torch.Tensor:
        return batch.alive & (torch.isin(batch.pending, self.eos) | (batch.length >= batch.limit))

    def is_eos(self, tok: torch.Tensor) -> torch.Tensor:
        return torch.isin(tok, self.eos)


def step_speculative(
    target: torch.nn.Module, draft: torch.nn.Module, batch: SpecBatch, gamma: int, warp: Warp, seed: int,
    eos: torch.Tensor, work: Work, tally: DecodeTally,
) -> torch.Tensor:
    """One draft-then-verify step for every open sequence; returns [B] tokens emitted.

    A sequence drafts gamma_b = min(gamma, room_b - 1) tokens, so it never drafts past its limit and its tokens do not
    depend on the other batch. Position coordinates of the random draws: the response index of the token drawn.
    """
    t, d = batch.sides(target, draft)
    b = batch.size
    dev = batch.pending.device
    ar = torch.arange(b, device=dev)
    room_ = room(batch, eos)  # [B]
    active = room_ > 0
    gam = (room_ - 1).clamp(0, gamma) * active  # [B] drafts proposed per sequence
    g = int(gam.max()) if b else 0
    pos0 = batch.length - 1 - batch.offset  # [B] response index of the pending token

    # -- draft: gamma tokens from q -------------------------------------------------------------------------------
    drafts = torch.zeros(b, g, dtype=torch.long, device=dev)  # [B, G]
    q = None  # [B, G, V]
    if g > 0:
        seq, seq_len = d.backlog(batch.tokens, batch.length)
        logits = d.extend_to(seq, seq_len, gam > 0, batch.group, work, tally)[:, -1]  # [B, V]
        qs = []
        for i in range(g):
            q_i = warp_probs(logits, warp)  # [B, V]
            u = uniforms(seed, batch.rng_key, batch.cand, pos0 + 1 + i, STREAM_DRAFT)
            drafts[:, i] = logits.argmax(-1) if warp.greedy else sample(q_i, u)
            qs.append(q_i)
            if i + 1 < g:
                logits = d.feed(drafts[:, i : i + 1], (gam > i + 1)[:, None], batch.group, work, tally)[:, -1]
        q = torch.stack(qs, 1)

    # -- verify: one target forward over the pending token and the drafts -----------------------------------------
    back, back_len = t.backlog(batch.tokens, batch.length)
    seq, seq_len = ragged_cat(back, back_len, drafts, gam)
    logits = t.extend_to(seq, seq_len, active, batch.group, work, tally, keep=g + 1)  # [B, G+1, V]
    if logits is None:
        return torch.zeros(b, dtype=torch.long, device=dev)
    shift = g - gam  # sequences with fewer drafts are right-aligned: their columns start later
    cols = (shift[:, None] + torch.arange(g + 1, device=dev)[None, :]).clamp(max=g)  # [B, G+1]
    logits = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))  # [B, G+1, V] column i = p_{i+1}
    p = warp_probs(logits, warp)  # [B, G+1, V]

    if g > 0:
        p_d = p[:, :g].gather(-1, drafts[..., None])[..., 0]  # [B, G]
        q_d = q.gather(-1, drafts[..., None])[..., 0]  # [B, G]
        u = uniforms(seed, batch.rng_key[:, None], batch.cand[:, None], pos0[:, None] + 1 + torch.arange(g, device=dev),
                     STREAM_ACCEPT)
        n = accept_count(p_d, q_d, u, gam)  # [B]
        q_next = q[ar, n.clamp(max=g - 1)]  # [B, V]
    else:
        n = torch.zeros(b, dtype=torch.long, device=dev)
        q_next = torch.zeros_like(p[:, 0])
    rejected = n < gam
    u = uniforms(seed, batch.rng_key, batch.cand, pos0 + 1 + n, STREAM_RESIDUAL)
    if warp.greedy:
        nxt = logits[ar, n].argmax(-1)  # greedy: the recovered or bonus token is the target's argmax
    else:
        nxt = recovered_or_bonus(p[ar, n], q_next, rejected, u, greedy=False)
    block = torch.cat([drafts, drafts.new_zeros(b, 1)], 1)  # [B, G+1]
    block[ar, n] = nxt
    m = commit_block(batch, t, d, tally, block, n, active, gam, room_, eos)
    # the emitted tokens' log-probabilities under the target's unwarped logits (the pool's logprob and perplexity)
    emitted = torch.arange(g + 1, device=dev)[None, :] < m[:, None]  # [B, G+1]
    batch.logprob = batch.logprob + (token_logprobs(logits, block).double() * emitted).sum(-1)
    return m


def commit_block(batch, t, d, tally: DecodeTally, block: torch.Tensor, accepted: torch.Tensor, active: torch.Tensor,
                 proposed: torch.Tensor, room_: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """End of a verification: emit each active sequence's `accepted` drafts plus the target's token (block[:, :n+1]),
    bring both caches in step with the committed tokens, and tally; returns the tokens emitted per sequence."""
    m = emit(batch, block, (accepted + 1) * active, room_, eos)
    t.commit(batch.tokens, batch.length)
    d.commit(batch.tokens, batch.length)
    batch.store(t, d)
    tally.add("proposed", batch.group, proposed)
    tally.add("accepted", batch.group, accepted * active)
    tally.add("emitted", batch.group, m)
    tally.add("generated", batch.group, m)
    tally.add("verifications", batch.group, active)
    return m
