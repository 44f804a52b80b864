"""The decoding batch: the sequences of one model's decoding, their KV cache and mask, and the counted forward.

Terms used throughout:
- a *sequence* is one line of a decoding batch: of the KV cache, of the attention mask and of ``tokens`` (a
  candidate, or a beam, while it decodes); a `Batch` holds them;
- a *group* is one prompt of the batch; its sequences are its candidates (``cand`` 0..n-1);
- the *pending* token of a sequence is the last token sampled for it, not yet fed to the model (the cache holds
  the prompt and every generated token but the pending one);
- a *hole* is a masked (0) column inside a sequence's mask: left padding, or (for speculative decoding) a rejected
  draft position. Holes are never attended to; position ids count only real columns.
(The glossary, docs/glossary.md, defines prompt, candidate, sequence, finished and rejected for the whole project.)

The samplers (`workers.decoding.target`, `workers.decoding.speculative`) prefill each prompt once and share its cache
across its candidates (`workers.decoding.shared_prefix`; repeated across them, ``batch_repeat_interleave``, for a
model where sharing is not exact); the KV cache grows in place (`workers.decoding.kvcache`); finished and rejected
sequences leave the cache by selection (``batch_select_indices``), never by a new prefill; prompts may join a batch
while it decodes (`Batch.extend`, continuous batching). The target sampler's static step moves a started batch's
cache into fixed storage (`workers.decoding.static_step.StaticCache`), where the same operations keep their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import DynamicCache

from workers.accounting.work import Work
from workers.decoding.kvcache import cache_kw, drop_left, fork_cache, join_caches, layers_of
from workers.decoding.shared_prefix import SharedPrefixCache, shared_forward
from workers.decoding.static_step import StaticCache


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real columns: [B, L] mask -> [B, L] positions (0 at holes before the first)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def forward(
    model: torch.nn.Module,
    role: str,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    cache: DynamicCache,
    group: torch.Tensor,
    work: Work,
    keep: int = 1,
    counted: torch.Tensor | None = None,
) -> torch.Tensor:
    """One counted forward of `input_ids` [B, T] appended to `cache`; `mask` [B, L] covers cache + new columns.

    Returns logits [B, keep, V] of the last `keep` positions (float32). Records in `work`, per group, the real new
    tokens and one forward call, of the sequences `counted` [B] bool marks (default all): an ended sequence still fed
    until its batch compacts is nobody's, so a prompt's count depends on its own sequences only.
    """
    t = input_ids.shape[1]
    if isinstance(cache, StaticCache):  # the static step: one token per sequence, the last logits
        if t != 1 or keep != 1:
            raise ValueError(f"a static cache's step feeds one token and keeps one logit, not {t} and {keep}")
        logits = cache.step(input_ids, mask)  # [B, 1, V]
        work.forward(role, group, mask[:, -1], counted)
        return logits
    pos = position_ids(mask)[:, -t:]  # [B, T]
    inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=keep)
    if isinstance(cache, SharedPrefixCache):
        out = shared_forward(model, cache, **inputs)
    else:
        out = model(**cache_kw(model, cache), **inputs)
    work.forward(role, group, mask[:, -t:].sum(-1), counted)
    return out.logits.float()


@dataclass
class Batch:
    """The sequences of one model's decoding. All tensors share dim 0 (sequences)."""

    cache: DynamicCache
    mask: torch.Tensor  # [B, L] long: 1 real column in cache (or the pending token), 0 hole
    pending: torch.Tensor  # [B] last sampled token, not yet in the cache
    group: torch.Tensor  # [B] prompt index within the batch
    cand: torch.Tensor  # [B] candidate index within the prompt
    rng_key: torch.Tensor  # [B] the prompt's key of the counter-based RNG (see workers.decoding.sampling)
    length: torch.Tensor  # [B] tokens generated so far, the pending one included
    limit: torch.Tensor  # [B] most tokens this sequence may generate
    tokens: torch.Tensor  # [B, T] generated tokens; tokens[i, :length[i]] are valid
    alive: torch.Tensor  # [B] bool: False once a sequence finished or was rejected (it leaves at the next compaction)
    logprob: torch.Tensor  # [B] float64: the target's log-probability of tokens[:length] (temperature 1, no warp),
    # summed as they were sampled

    @property
    def size(self) -> int:
        return int(self.pending.shape[0])

    def select(self, idx: torch.Tensor) -> None:
        """Keep only sequences `idx` (a LongTensor of indices), in the cache and in every per-sequence tensor."""
        if idx.numel() == self.size and bool((idx == torch.arange(self.size, device=idx.device)).all()):
            return
        self.cache.batch_select_indices(idx)
        for f in fields(self):
            if f.name != "cache":
                setattr(self, f.name, getattr(self, f.name)[idx])
        self.trim_left()

    def compact(self, min_dead: int = 1, alive: torch.Tensor | None = None) -> None:
        """Select the alive sequences once at least `min_dead` are dead (a select copies the whole cache, so dead
        sequences are dropped in bulk rather than one at a time). `alive`: a host copy of `self.alive` where the
        caller holds one, so that the count needs no wait for the device."""
        alive = self.alive if alive is None else alive
        dead = int((~alive).sum())
        if dead and dead >= min_dead:
            self.select(alive.nonzero().flatten().to(self.alive.device))

    def trim_left(self) -> None:
        """Drop leading columns that are holes in every sequence (left padding no survivor needs); with a shared
        prefix, those of the prefix and those that lead the columns after it (the steps decoded before any survivor
        joined), so that a batch that prompts join while it decodes holds the columns its sequences use, not one per
        step it has lived."""
        if self.size == 0:
            return
        real = self.mask.any(0)
        if isinstance(self.cache, StaticCache):
            first = int(real.float().argmax()) if bool(real.any()) else self.mask.shape[1]
            first = self.cache.drop_left(first)  # only once they are worth a shift of the storage
        elif isinstance(self.cache, SharedPrefixCache):
            width = self.cache.width
            after = int(real[width:].float().argmax()) if bool(real[width:].any()) else self.mask.shape[1] - width
            if after:
                self.cache.drop_suffix(after)
                self.mask = torch.cat([self.mask[:, :width], self.mask[:, width + after:]], 1)
            first = int(real[:width].float().argmax()) if bool(real[:width].any()) else width
            first = self.cache.drop_left(first)  # the holes of the prompts' own columns
        else:
            if bool(real[0]):
                return
            first = int(real.float().argmax())
            if not drop_left(self.cache, first):
                return  # sliding-window and other layer kinds keep their own column bookkeeping
        self.mask = self.mask[:, first:]

    def extend(self, other: Batch, pad_id: int) -> None:
        """Append the sequences of `other`, freshly prefilled prompts (their first tokens pending, nothing decoded),
        to this batch while it decodes: the caches are joined (`SharedPrefixCache.extend`, or right-aligned
        `kvcache.join_caches`) and the columns one side lacks become holes in its mask."""
        rows, la, lb = self.size, self.mask.shape[1], other.mask.shape[1]
        if isinstance(self.cache, StaticCache) and type(other.cache) is not SharedPrefixCache:
            left = int((other.limit - other.length).max()) if other.size else 0  # tokens its rows may still take
            self.cache.join(other.cache, other.size, lb, lb + left + 1)
            width = max(la, lb)
            mask_a, mask_b = _pad_mask(self.mask, width - la, 0), _pad_mask(other.mask, width - lb, 0)
        elif isinstance(self.cache, SharedPrefixCache) and isinstance(other.cache, SharedPrefixCache):
            suffix = la - self.cache.width
            pad_self, pad_other = self.cache.extend(other.cache, rows)
            mask_a = _pad_mask(self.mask, pad_self, 0)
            mask_b = _pad_mask(other.mask, pad_other, suffix)
        elif not isinstance(self.cache, SharedPrefixCache) and not isinstance(other.cache, SharedPrefixCache):
            join_caches(self.cache, other.cache, rows, other.size)
            width = max(la, lb)
            mask_a, mask_b = _pad_mask(self.mask, width - la, 0), _pad_mask(other.mask, width - lb, 0)
        else:
            raise ValueError("a shared-prefix batch and a repeated-cache batch cannot be joined")
        self.mask = torch.cat([mask_a, mask_b], 0)
        t = max(self.tokens.shape[1], other.tokens.shape[1])
        self.tokens = torch.cat([_pad_tokens(self.tokens, t, pad_id), _pad_tokens(other.tokens, t, pad_id)], 0)
        for f in fields(self):
            if f.name not in ("cache", "mask", "tokens"):
                setattr(self, f.name, torch.cat([getattr(self, f.name), getattr(other, f.name)], 0))

    def append_pending(self, tok: torch.Tensor, logprob: torch.Tensor) -> None:
        """Record `tok` [B] as each sequence's new pending token, of target log-probability `logprob` [B]."""
        ar = torch.arange(self.size, device=tok.device)
        self.tokens[ar, self.length.clamp(max=self.tokens.shape[1] - 1)] = tok
        self.length = self.length + 1
        self.pending = tok
        self.logprob = self.logprob + logprob.double()

    def kv_columns(self) -> int:
        return int(self.mask.shape[1])


@dataclass
class Prefilled:
    """Prompts prefilled and not started: each prompt's cache (one row, left-padded), mask and last logits, from
    which its candidates start with no forward of their own (`TargetSampler.begin`)."""

    cache: DynamicCache
    mask: torch.Tensor  # [P, L] long
    logits: torch.Tensor  # [P, V] float32: the next-token logits after each prompt
    groups: list[int]  # each row's prompt

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in layers_of(self.cache)) + self.logits.nbytes

    def take(self, rows: list[int]) -> "Prefilled":
        """Rows `rows`, copied, the leading columns that are holes in all of them dropped."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        cache, mask = fork_cache(self.cache, idx), self.mask.index_select(0, idx)
        real = mask.any(0)
        first = int(real.float().argmax()) if bool(real.any()) else 0
        if first and drop_left(cache, first):
            mask = mask[:, first:]
        return Prefilled(cache, mask, self.logits.index_select(0, idx), [self.groups[r] for r in rows])

    def join(self, other: "Prefilled") -> "Prefilled":
        """These rows and then `other`'s (right-aligned, the narrower side's leading columns holes)."""
        join_caches(self.cache, other.cache, len(self.groups), len(other.groups))
        width = max(self.mask.shape[1], other.mask.shape[1])
        mask = torch.cat([_pad_mask(m, width - m.shape[1], 0) for m in (self.mask, other.mask)])
        return Prefilled(self.cache, mask, torch.cat([self.logits, other.logits]), self.groups + other.groups)


def _pad_mask(mask: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """`mask` with `left` and `right` hole columns added."""
    if not left and not right:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], left), mask, mask.new_zeros(mask.shape[0], right)], 1)


def _pad_tokens(tokens: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    if tokens.shape[1] == width:
        return tokens
    return torch.cat([tokens, tokens.new_full((tokens.shape[0], width - tokens.shape[1]), pad_id)], 1)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists to left-padded ids [P, L] and mask [P, L]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)
