"""A sequence-classification reward model: whole scoring (`RewardModelScorer`) and incremental scoring of candidates
that grow (`CachedScoring`, a session that keeps each candidate's reward-model KV cache between calls).

Model-based scoring is batched under a token budget (rows x padded length), shortest first, sized from the device's
free memory and capped by `models.reward.batch_tokens`; a causal reward model encodes the prompt its candidates
share once. A method that scores the same candidates again and again as they grow (Speculative Rejection's
decisions) scores through a *session* (`RewardModelScorer.session`): with a causal reward model the session keeps
each candidate's cache and feeds only the tokens its cache does not hold.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from typing import Hashable, NamedTuple, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from workers.accounting.cost import Meter
from workers.accounting.memory import device_free_bytes
from workers.decoding.kvcache import (
    cache_kw,
    cache_of,
    context_length,
    fork_cache,
    layers_of,
    model_kv_bytes,
    pack,
    stack_caches,
)
from workers.decoding.shared_prefix import SharedPrefixCache, shared_forward, worth_sharing
from workers.scoring.items import (
    Scored,
    last_real,
    once_per_input,
    reward_input,
    reward_inputs,
    right_padded,
    shared_prefix,
    template_head,
    token_budget_batches,
)
from workers.scoring.scorers import Rescoring

log = logging.getLogger(__name__)

SCORING_MEMORY_FRACTION = 0.5  # of the device's free memory, for the transient tensors of one scoring forward
CACHE_MEMORY_FRACTION = 0.25  # of the device's free memory (a session's own caches counted as free), for the caches
# a session keeps between calls; rows past it are dropped and scored from their prompt again at their next call



class RewardModelScorer:
    """An AutoModelForSequenceClassification with num_labels = 1: the scalar logit is the reward.

    The candidates of one prompt share its rendered prompt, so with a causal reward model that takes a KV cache the
    shared leading tokens are encoded once per batch and their cache repeated across the candidates (the engine's
    trick, applied to scoring); only the responses are encoded row by row. A probe at load decides: the model's
    scores of two probe sequences with and without the shared cache must agree. Bidirectional encoders (BERT-like
    reward models) fail it, because their prompt tokens attend to the response, and are scored whole.

    It scores incrementally in a session (`session`, CachedScoring) when a second probe, a session's calls of growing
    sequences (two sharing a prefix, a cache with dropped, holed, tokens fed again), gives its own scores of them
    (`whole_value`); `incremental` says whether it did. Bidirectional encoders fail that one too.

    Batches: rows x padded input length stays under what SCORING_MEMORY_FRACTION of the device's free memory holds
    (`forward_bytes`, with the cache's bytes per token measured by the probe), and under `batch_tokens` when set
    (the user's cap, `models.reward.batch_tokens`; None: memory alone).
    """

    MIN_SHARED = 8  # shorter shared prefixes are not worth a separate prefill
    # False: sessions score every call whole even where the model scores incrementally (bench.bill --reward-session
    # whole, the side that a session is measured against)
    incremental_sessions = True
    cuts_inputs = True  # an input longer than the context keeps its end

    def __init__(self, model, tokenizer, batch_tokens: int | None, meter_role: str = "reward"):
        self.model, self.tok, self.batch_tokens = model, tokenizer, batch_tokens
        self.device = next(model.parameters()).device
        self.dtype_bytes = next(model.parameters()).element_size()
        self.max_len = context_length(model.config)
        if self.max_len is None:
            log.warning("models.reward.path: the reward model's config has no max_position_embeddings, so reward "
                        "inputs are not cut to a context length")
        self.role = meter_role
        self.pad = self.tok.pad_token_id
        self.head_pad = model.config.get_text_config().pad_token_id  # the id the classification head skips
        self.kv_bytes_per_token = model_kv_bytes(model)  # replaced by the cache's own, measured by the probe
        self.template_head = template_head(tokenizer)  # what every prompt's encoding starts with (a session's once)
        self.head_row: RowCaches | None = None  # set below, once the model is known to score incrementally
        self.shares_prompt = False  # until the probe below says
        # whole scoring encodes a prompt's shared prefix once where its cache gives the model's own scores
        self.shares_prefix = self.prefix_probe()
        # sessions keep each candidate's cache where that gives the scorer's own scores (`whole_value`): a causal
        # model that takes a cache; a bidirectional encoder fails the probe (its prompt attends to the response)
        self.incremental = incremental_is_exact(self)
        # whether a session may hold a prompt's prefix once for its candidates (`CachedScoring._worth_sharing`)
        self.shares_prompt = self.incremental and incremental_is_exact(self, share=True)
        # the template's head, encoded once here (a load-time cost, as the probes are, charged to no prompt, so that
        # a prompt's cost does not depend on which prompts shared its session): every session's prompts start from it
        self.head_row = RowCaches.encoded(model, self.template_head) if self.incremental and self.template_head \
            and self.head_holds_no_score() else None
        # what a session keeps per token of a running candidate: its cache, where it keeps one
        self.session_kv_bytes_per_token = self.kv_bytes_per_token if self.incremental and self.incremental_sessions \
            else 0
        log.info("reward model %s", "keeps each candidate's cache between calls" if self.incremental else
                 "caches the shared prompt prefix" if self.shares_prefix else "scores whole sequences")

    def session(self, meter: Meter):
        """A scoring session for candidates scored again as they grow: CachedScoring when `incremental`, else one
        that scores every call afresh (Rescoring)."""
        if self.incremental and self.incremental_sessions:
            return CachedScoring(self, meter)
        return Rescoring(lambda items: self(items, meter))

    def encode(self, item: Scored) -> list[int]:
        return reward_input(self.tok, item)

    def encode_all(self, items: list[Scored], meter: Meter) -> tuple[list[list[int]], set[int]]:
        """Every item's reward input, cut to the context where longer (`items.reward_inputs`)."""
        return reward_inputs(self.tok, self.max_len, items, meter)

    # -- what a forward's outputs make of a row: what a session keeps of it (its *state*) and its score --------------
    # A session (CachedScoring) keeps each row's state with its cache; a sequence-classification head reads the last
    # token, so the state is the score itself. A process reward model (workers.scoring.process_reward) reads every
    # step's tag and keeps their scores.
    def counts(self, items: list[Scored]) -> list[int] | None:
        """What `value` needs of each item beyond its row's state (a PRM's steps); None: nothing."""
        return None

    def outputs(self, run) -> list:
        """The head's outputs of one forward, row by row; `run(m)` calls the model or its backbone `m` with the
        forward's inputs (their new tokens right-aligned): here each row's score, at its last token."""
        return run(self.model).logits[:, 0].float().cpu().tolist()

    def advance(self, state, kept: int, fed: list[int], out):
        """A row's state once `fed` follows the first `kept` tokens of what it held (state `state`), from its row
        of `outputs` (`fed` in its last columns)."""
        return out

    def value(self, state, count: int | None = None) -> float:
        """The score of a row in `state`; `count`: its item's entry of `counts` (None: no item's)."""
        return state

    def whole_value(self, ids: list[int]) -> float:
        """The score of `ids` in one forward of its own, no cache: what the probes compare a session with."""
        t = torch.tensor([ids], device=self.device)
        return self.value(self.advance(None, 0, ids, self.outputs(lambda m: m(input_ids=t))[0]))

    def probe_tokens(self, count: int) -> list[int]:
        """`count` fixed tokens for the load-time probes."""
        return _probe_tokens(self.model, self.head_pad, count)

    def prefix_probe(self) -> bool:
        """Whether whole scoring may encode a prompt's shared prefix once: the model scores with a shared prefix's
        cache exactly (`prefix_sharing_is_exact`)."""
        return prefix_sharing_is_exact(self.model, self.pad)

    def head_holds_no_score(self) -> bool:
        """Whether the template's head holds nothing `value` reads (a session's rows start from its cache)."""
        return True

    def forward_bytes(self, rows: int, new: int, cached: int) -> int:
        """Peak bytes of one scoring forward of `rows` sequences feeding `new` tokens each over `cached` columns of
        cache, an upper estimate: per new token, one layer's activations (8 x hidden + 3 x intermediate values),
        its cache entry, and float32 attention scores of every head plus the mask over the cached and new columns;
        per row, one layer's cache copied while it grows by concatenation."""
        cfg = self.model.config.get_text_config()
        hidden = cfg.hidden_size
        inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
        act = self.dtype_bytes * (8 * hidden + 3 * inter)
        kv, cols = self.kv_bytes_per_token, cached + new
        per_row = new * (act + kv + 4 * (cfg.num_attention_heads + 1) * cols) + cols * kv // cfg.num_hidden_layers
        return rows * per_row

    def tokens_budget(self, free: int | None, new: int, cached: int = 0) -> float:
        """Most rows x `new` tokens for one forward over `cached` columns: what SCORING_MEMORY_FRACTION of `free`
        bytes holds (`forward_bytes`, at least one row), capped by batch_tokens."""
        budget = math.inf
        if free is not None:
            rows = int(free * SCORING_MEMORY_FRACTION) // max(1, self.forward_bytes(1, max(new, 1), cached))
            budget = max(1, rows) * max(new, 1)
        return budget if self.batch_tokens is None else min(budget, self.batch_tokens)

    @torch.inference_mode()
    def __call__(self, items: list[Scored], meter: Meter) -> list[float]:
        encoded, _ = self.encode_all(items, meter)
        return self.score_encoded([it.group for it in items], encoded, meter)

    def score_encoded(self, groups: list[int], encoded: list[list[int]], meter: Meter,
                      counts: list[int] | None = None) -> list[float]:
        """Scores of encoded sequences of prompts `groups`, each prompt's shared prefix encoded once per batch when
        the model allows it, the others whole; a prompt's sequences alike are scored once (`counts`: unused)."""
        return once_per_input([(g, tuple(ids)) for g, ids in zip(groups, encoded)], lambda idx: self._score_distinct(
            [groups[i] for i in idx], [encoded[i] for i in idx], meter))

    def _score_distinct(self, groups: list[int], encoded: list[list[int]], meter: Meter) -> list[float]:
        free = device_free_bytes(self.device)
        out = [0.0] * len(encoded)
        whole: list[int] = []
        by_group: dict[int, list[int]] = defaultdict(list)
        for i, g in enumerate(groups):
            by_group[g].append(i)
        for group, idx in by_group.items():
            shared = shared_prefix([encoded[i] for i in idx], self.pad) if self.shares_prefix and len(idx) > 1 else 0
            if shared < self.MIN_SHARED:
                whole += idx
                continue
            suffixes = [encoded[i][shared:] for i in idx]
            prefix = encoded[idx[0]][:shared]
            lengths = [shared + len(s) for s in suffixes]
            for batch in token_budget_batches(lengths, self.tokens_budget(free, max(lengths))):
                scores, lengths_ = score_with_prefix(self.model, self.pad, prefix, [suffixes[b] for b in batch],
                                                     self.device)
                meter.count_forward(self.role, torch.tensor([group]), torch.tensor([shared]))
                meter.count_forward(self.role, torch.full((len(batch),), group), lengths_)
                for b, v in zip(batch, scores):
                    out[idx[b]] = v
        lengths = [len(encoded[i]) for i in whole]
        for batch in token_budget_batches(lengths, self.tokens_budget(free, max(lengths, default=1))):
            rows = [whole[b] for b in batch]
            ids, mask = right_padded([encoded[i] for i in rows], self.pad)
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, v in zip(rows, logits[:, 0].float().cpu().tolist()):
                out[i] = v
            meter.count_forward(self.role, torch.tensor([groups[i] for i in rows]), mask.sum(-1))
        return out


def score_with_prefix(model, pad_id: int, prefix: list[int], suffixes: list[list[int]],
                      device: torch.device) -> tuple[list[float], torch.Tensor]:
    """Scores of prefix + each suffix, the prefix encoded once and its cache repeated over the suffixes (right
    padded, so the head's rightmost-non-pad rule reads each suffix's last token); also each suffix's length."""
    cache = DynamicCache(config=model.config)
    pre = torch.tensor([prefix], dtype=torch.long, device=device)
    model(input_ids=pre, attention_mask=torch.ones_like(pre), **cache_kw(model, cache), use_cache=True)
    cache.batch_repeat_interleave(len(suffixes))
    ids, mask = right_padded(suffixes, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    full = torch.cat([mask.new_ones(len(suffixes), len(prefix)), mask], dim=1)
    pos = len(prefix) + torch.arange(ids.shape[1], device=device).expand_as(ids)
    logits = model(input_ids=ids, attention_mask=full, position_ids=pos, **cache_kw(model, cache),
                   use_cache=True).logits
    return logits[:, 0].float().cpu().tolist(), mask.sum(-1).cpu()


def _probe_tokens(model, pad_id: int | None, count: int) -> list[int]:
    """`count` fixed pseudo-random token ids, never the pad token."""
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    return [t for t in torch.randint(0, vocab, (4 * count,), generator=gen).tolist() if t != pad_id][:count]


def _close(got: list[float], want: list[float], model) -> bool:
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2
    return all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, want))


@torch.inference_mode()
def prefix_sharing_is_exact(model, pad_id: int | None) -> bool:
    """Whether scoring with a shared prefix's cache gives the model's own scores: two probe sequences (fixed
    pseudo-random tokens, never the pad token) sharing 12 tokens, of unequal lengths, scored both ways."""
    tokens = _probe_tokens(model, pad_id, 20)
    prefix, suffixes = tokens[:12], [tokens[12:16], tokens[16:18]]
    device = next(model.parameters()).device
    try:
        cached, _ = score_with_prefix(model, pad_id if pad_id is not None else 0, prefix, suffixes, device)
    except (TypeError, ValueError, RuntimeError, AttributeError) as err:  # no cache support in this architecture
        log.info("reward model cannot score with a cached prefix: %s", err)
        return False
    whole = [model(input_ids=torch.tensor([prefix + s], device=device)).logits[0, 0].float().item() for s in suffixes]
    return _close(cached, whole, model)


@torch.inference_mode()
def incremental_is_exact(scorer: RewardModelScorer, share: bool = False) -> bool:
    """Whether a CachedScoring session gives the model's own scores over two calls: three probe sequences, two of
    them sharing a prefix, then one of those with its last held token replaced and more appended (a hole in the
    cache), the other extended, and a third new; each scored whole for comparison. Measures the cache's bytes per
    token (`kv_bytes_per_token`) on the way. Only plain full-attention cache layers (DynamicLayer) qualify.
    `share`: the session holds the shared prefix once for its rows (the shared-prefix attention reads it), and a
    third call feeds a row whose encoding changed inside that prefix and a new row of the prompt."""
    model = scorer.model
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        return False  # sliding-window and other layer kinds keep their own column bookkeeping
    t = scorer.probe_tokens(40)
    first = [t[:16], t[:12] + t[16:19]]
    second = [first[0][:-1] + t[20:23], first[1] + t[23:25], t[25:31]]
    third = [second[1] + t[31:33], t[:5] + t[33:36], t[:12] + t[36:40]]
    session = CachedScoring(scorer, Meter(1))
    session.share_prompts = True if share else None
    try:
        got = session.feed(["a", "b"], [0, 0], first, [False, False])
        measured = session.cache_bytes() // max(1, sum(p.size * p.width for p in session.parts))
        got += session.feed(["a", "b", "c"], [0, 0, 0], second, [False] * 3)
        if share:
            got += session.feed(["b", "a", "d"], [0, 0, 0], third, [False] * 3)
            if not session.prefixes:
                return False
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, NotImplementedError) as err:
        log.info("reward model cannot score incrementally%s: %s", " with a shared prompt" if share else "", err)
        return False
    whole = [scorer.whole_value(s) for s in first + second + (third if share else [])]
    if measured > 0 and not share:
        scorer.kv_bytes_per_token = measured
    return _close(got, whole, model)


class Feed(NamedTuple):
    """What a call does with one held row: keep its first `kept` tokens (the rest become holes) and feed the rest of
    item `item`'s encoding."""

    kept: int
    item: int


class Prefix(NamedTuple):
    """A prompt's shared prefix held once for its candidates' rows (`RowCaches.pre`): its tokens and each layer's
    (keys, values) [1, H, L, D]."""

    group: int
    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    state: object = None  # its row's state (`RewardModelScorer.advance`), which its candidates' rows start from

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class RowCaches:
    """Reward-model caches of some scored sequences, one row each, that one forward serves.

    Row r holds its tokens `ids[r]` in `cache` at the columns that `mask` [r, C] marks 1, in order; the 0 columns
    are holes (columns fed for other rows, or held tokens dropped because the row's encoding changed there). Holes
    are never attended to and position ids count only real columns, so a row's cache is that of its tokens alone.
    `scores[r]` is the state of `ids[r]` (`RewardModelScorer.advance`: its score for a reward model, its steps'
    scores for a process reward model; None until it is fed); `plan[r]` is the row's `Feed` while a call feeds it
    (None otherwise).
    `pre[r]`: where a row's prompt is held once for its candidates (a slot of its session's `Prefix`es), the slot,
    and the row's cache holds only the columns after it (`ids[r]` still spells the whole encoding); None: the row's
    cache holds all its columns."""

    def __init__(self, config, cache: DynamicCache | None, mask: torch.Tensor, keys: list, groups: list[int],
                 ids: list[list[int]], scores: list[float | None], pre: list[int | None] | None = None):
        self.config = config  # the reward model's, for new caches
        self.cache = cache  # None while the rows hold no column
        self.mask = mask  # [R, C] long
        self.keys, self.groups, self.ids, self.scores = keys, groups, ids, scores
        self.pre = pre if pre is not None else [None] * len(keys)
        self.plan: list[Feed | None] = [None] * len(keys)

    @staticmethod
    @torch.inference_mode()
    def encoded(model, ids: list[int], group: int = 0) -> "RowCaches":
        """One row holding `ids`, encoded now (not counted: the caller counts it where it is a prompt's)."""
        device = next(model.parameters()).device
        cache = DynamicCache(config=model.config)
        t = torch.tensor([ids], dtype=torch.long, device=device)
        model(input_ids=t, attention_mask=torch.ones_like(t), **cache_kw(model, cache), use_cache=True)
        return RowCaches(model.config, cache, torch.ones_like(t), [None], [group], [list(ids)], [None])

    @property
    def size(self) -> int:
        return len(self.keys)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in layers_of(self.cache))

    def take(self, idx: list[int]) -> "RowCaches":
        """Rows `idx` (repeats allowed), copied, their plans included."""
        t = torch.tensor(idx, dtype=torch.long, device=self.mask.device)
        cache = fork_cache(self.cache, t) if self.cache is not None else None
        out = RowCaches(self.config, cache, self.mask.index_select(0, t), [self.keys[i] for i in idx],
                        [self.groups[i] for i in idx], [list(self.ids[i]) for i in idx], [self.scores[i] for i in idx],
                        [self.pre[i] for i in idx])
        out.plan = [self.plan[i] for i in idx]
        return out

    @staticmethod
    def stack(parts: list["RowCaches"]) -> "RowCaches":
        """Parts stacked into one, the narrower ones padded on the left with holes."""
        width = max(p.width for p in parts)
        cache = stack_caches(parts[0].config, [p.cache for p in parts], [p.size for p in parts],
                             [p.width for p in parts])
        mask = torch.cat([torch.nn.functional.pad(p.mask, (width - p.width, 0)) for p in parts])
        out = RowCaches(parts[0].config, cache, mask, [k for p in parts for k in p.keys],
                        [g for p in parts for g in p.groups], [i for p in parts for i in p.ids],
                        [s for p in parts for s in p.scores], [s for p in parts for s in p.pre])
        out.plan = [f for p in parts for f in p.plan]
        return out


class Branch(NamedTuple):
    """Leading tokens that two or more fresh items of one prompt share beyond their parent branch (or the prompt's
    shared prefix): tokens [start, end) of item `item`'s encoding, at depth `level` (1: below the prefix)."""

    group: int
    parent: int  # a branch's index, -1: the prompt's shared prefix
    start: int
    end: int
    item: int
    level: int


def branch_tree(encoded: list[list[int]], idx: list[int], start: int, pad_id: int | None,
                levels: int) -> tuple[list[Branch], dict[int, int]]:
    """The radix tree of items `idx` of one prompt beyond the `start` tokens they all share: a branch for each run of
    tokens that two or more of them share beyond their parent's (at most `levels` deep), never holding an item's
    last real token (the one the head reads, which each item feeds in its own row). Returns the branches (a parent
    before its children; `group` left 0) and each item's deepest branch (-1: none)."""
    branches: list[Branch] = []
    below: dict[int, int] = {}
    todo = [(list(idx), start, -1, 0)]
    while todo:
        members, depth, parent, level = todo.pop()
        by_token: dict[int, list[int]] = defaultdict(list)
        for i in members:
            if level < levels and last_real(encoded[i], pad_id) > depth:
                by_token[encoded[i][depth]].append(i)
            else:
                below[i] = parent
        for part in by_token.values():
            if len(part) == 1:
                below[part[0]] = parent
                continue
            end = shared_prefix([encoded[i] for i in part], pad_id)  # > depth: they share token `depth`
            branches.append(Branch(0, parent, depth, end, part[0], level + 1))
            todo.append((part, end, len(branches) - 1, level + 1))
    return branches, below


def fork(sources: list[tuple[RowCaches, int]]) -> tuple[RowCaches, list[int]]:
    """Copies of rows of one or more RowCaches (`sources`: which rows, repeats allowed) in one, and the order of
    its rows: row r is a copy of `sources[order[r]]` (the rows of one source stay together, right-aligned to the
    widest source, the narrower ones' leading columns holes). Written once into the new cache: a row repeated from
    one source (a prompt's prefix for each of its candidates) is broadcast, not copied first."""
    of: dict[int, list[int]] = defaultdict(list)  # id of a source -> positions in `sources`
    parts: dict[int, RowCaches] = {}
    for k, (p, _) in enumerate(sources):
        of[id(p)].append(k)
        parts[id(p)] = p
    order = [k for ks in of.values() for k in ks]
    width = max(p.width for p in parts.values())
    first = next(iter(parts.values()))
    mask = first.mask.new_zeros((len(sources), width))
    filled = next((p.cache for p in parts.values() if p.cache is not None), None)
    layers = [(k.new_zeros((len(sources), *k.shape[1:2], width, k.shape[-1])),
               v.new_zeros((len(sources), *v.shape[1:2], width, v.shape[-1]))) for k, v in layers_of(filled)] \
        if filled is not None else []
    at = 0
    for key, ks in of.items():
        p, rows = parts[key], [sources[k][1] for k in ks]
        span, cols = slice(at, at + len(rows)), slice(width - p.width, width)
        same = len(set(rows)) == 1
        pick = (lambda t: t[rows[0]: rows[0] + 1]) if same else \
            (lambda t: t.index_select(0, torch.tensor(rows, dtype=torch.long, device=t.device)))
        mask[span, cols] = pick(p.mask)
        if p.cache is not None:
            for (k_out, v_out), (k_in, v_in) in zip(layers, layers_of(p.cache)):
                k_out[span, :, cols] = pick(k_in)
                v_out[span, :, cols] = pick(v_in)
        at += len(rows)
    picked = [sources[k] for k in order]
    out = RowCaches(first.config, cache_of(first.config, layers) if layers else None, mask,
                    [p.keys[r] for p, r in picked], [p.groups[r] for p, r in picked],
                    [list(p.ids[r]) for p, r in picked], [p.scores[r] for p, r in picked],
                    [p.pre[r] for p, r in picked])
    out.plan = [p.plan[r] for p, r in picked]
    return out, order


class CachedScoring:
    """Scores candidates again and again as they grow, keeping each one's reward-model KV cache between calls.

    A call (`score(keys, items, final)`) renders and tokenises every item afresh, as whole scoring does; then, for
    a key whose cache is held, the leading tokens that the cache holds and that the new encoding starts with are
    kept, the rest of the held tokens are dropped (holed in the mask: the template's end-of-turn tokens, which move
    as the response grows, and any token whose encoding changed, e.g. a word merged across the old end), and only
    the new encoding's remaining tokens are fed. The kept part never reaches past the token the classification
    head reads (the last non-pad one), so every row feeds at least that token; an unchanged encoding gets its last
    score without a forward. Positions count only real columns, so every score equals the model's score of the
    whole encoding (float noise aside). A key without a cache starts from its prompt's shared prefix, encoded once
    for the prompt's new keys of the call (as RewardModelScorer does) from the template's head, which the scorer
    encodes once for every session, every prompt's prefix of the call in one forward (`_seeds`); the leading
    tokens that some of the prompt's new keys share beyond it are fed once too, the branches of a radix tree
    (`branch_tree`, `_feed_tree`): at a first decision most candidates start alike ("The", "Sure,"). Where a prompt's
    copies in its candidates' caches would be worth sharing (`worth_sharing`, the decoder's rule) its prefix is held
    once (`Prefix`, `RowCaches.pre`) and read by the decoder's shared-prefix attention, and the candidates' caches
    hold only their own columns; a candidate without a cache later starts from it. A call's items of one prompt with
    the same encoding (twins: candidates alike at a first decision, or grown alike since) are fed once (`_twins`).

    New tokens are right-aligned in each forward, so every row's last column is its last token (what the head
    reads); the shorter rows' holes sit before their new tokens. Rows that one forward serves share one cache
    (`RowCaches`); a call takes the rows it scores out of a cache that also holds rows it does not (a decision for some
    prompts only), so that no row is fed hole columns for nothing, joins small caches and splits large ones to keep
    each forward within the memory budget (`RewardModelScorer.tokens_budget`, the cached columns counted), feeds a
    call's held rows in its fresh rows' last forward where both fit, and packs out holes once they pass
    PACK_FRACTION of a cache's columns. Keys leave in bulk (`release`, one selection per cache); `final` keys (a
    finished candidate's last score) are released at the next `release` too, and a batch made only of new final
    keys is never kept. Inputs cut to the reward model's context are scored whole and not kept (the cut moves).
    The caches kept stay under CACHE_MEMORY_FRACTION of the free memory; rows over it are dropped at `release`
    (and start from their prompt again). Every token fed is counted in the meter.
    """

    PACK_FRACTION = 0.5
    MAX_LEVELS = 4  # levels of branches below a prompt's shared prefix, a forward each (`branch_tree`)
    # None: hold a prompt's prefix once where `_worth_sharing` says; True: every prompt's (the load-time probe, tests);
    # False: none (bench.bill --reward-prefix copy, the side it is measured against)
    share_prompts: bool | None = None

    def __init__(self, scorer: RewardModelScorer, meter: Meter):
        self.s, self.meter = scorer, meter
        self.parts: list[RowCaches] = []
        self.prefixes: dict[int, Prefix] = {}  # slot -> a prompt's prefix its rows share (`RowCaches.pre`)
        self.next_slot = 0
        self.stacked: tuple[tuple, list] | None = None  # the last forward's prefixes stacked (slots, layers)
        self.leaving: set = set()  # keys to drop at the next release (final, or cut to the context)
        self.warned = False

    def cache_bytes(self) -> int:
        return sum(p.nbytes() for p in self.parts) + sum(x.nbytes() for x in self.prefixes.values())

    def held(self) -> list:
        """The keys whose caches are held."""
        return [k for p in self.parts for k in p.keys]

    @torch.inference_mode()
    def score(self, keys: Sequence[Hashable], items: list[Scored], final: Sequence[bool] | None = None) -> list[float]:
        """Scores of items (one per key; a key names one candidate for the session's life). `final`: the items
        scored for the last time (their keys leave at the next release)."""
        final = list(final) if final is not None else [False] * len(items)
        encoded, cut = self.s.encode_all(items, self.meter)
        counts = self.s.counts(items)
        out: list[float] = [0.0] * len(items)
        if cut:
            idx = sorted(cut)
            values = self.s.score_encoded([items[i].group for i in idx], [encoded[i] for i in idx], self.meter,
                                          [counts[i] for i in idx] if counts is not None else None)
            for i, v in zip(idx, values):
                out[i] = v
            self.leaving.update(keys[i] for i in idx)
        todo = [i for i in range(len(items)) if i not in cut]
        values = self.feed([keys[i] for i in todo], [items[i].group for i in todo], [encoded[i] for i in todo],
                           [final[i] for i in todo], [counts[i] for i in todo] if counts is not None else None)
        for i, v in zip(todo, values):
            out[i] = v
        # One input, one score: items of a prompt with the same encoding (the same response so far, common at the
        # first decisions) get the first one's score, whatever rows and caches scored them, so that the float noise
        # between those does not break their tie at a rejection cut.
        first: dict[tuple, float] = {}
        return [first.setdefault((items[i].group, tuple(encoded[i])), v) for i, v in enumerate(out)]

    @torch.inference_mode()
    def release(self, keys: Sequence[Hashable]) -> None:
        """Drop the caches of `keys` and of the keys marked leaving, in bulk; pack caches whose holes pass
        PACK_FRACTION; keep the caches held under CACHE_MEMORY_FRACTION of the free memory."""
        gone = set(keys) | self.leaving
        self.leaving = set()
        parts = []
        for p in self.parts:
            stay = [r for r, k in enumerate(p.keys) if k not in gone]
            if not stay:
                continue
            if len(stay) < p.size:
                p = p.take(stay)
            if p.width and float(p.mask.sum()) < (1 - self.PACK_FRACTION) * p.size * p.width:
                p.mask = pack(p.cache, p.mask)
            parts.append(p)
        self.parts = parts
        self._trim(device_free_bytes(self.s.device))
        used = {slot for p in self.parts for slot in p.pre}
        self.prefixes = {slot: x for slot, x in self.prefixes.items() if slot in used}
        self.stacked = None

    def _trim(self, free: int | None) -> None:
        """Drop the last caches while those held pass CACHE_MEMORY_FRACTION of `free` bytes (the session's own
        counted as free): their rows start from their prompt again at their next call."""
        if free is None:
            return
        held = self.cache_bytes()
        allowed = (free + held) * CACHE_MEMORY_FRACTION
        if held > allowed:  # first the holes out (joins and stacks right-align rows of unequal widths)
            for p in self.parts:
                p.mask = pack(p.cache, p.mask)
            held = self.cache_bytes()
        while self.parts and held > allowed:
            held -= self.parts.pop().nbytes()
            self._warn_over()

    def _warn_over(self) -> None:
        if not self.warned:
            self.warned = True
            log.info("reward caches over %.0f%% of the free memory: some candidates are scored from their prompt "
                     "again", 100 * CACHE_MEMORY_FRACTION)

    # -- one call, token level -------------------------------------------------------------------------------------
    def feed(self, keys: list, groups: list[int], encoded: list[list[int]], final: list[bool],
             counts: list[int] | None = None) -> list[float]:
        """Scores of `encoded` (whole sequences, at most the context long) of prompts `groups`, under `keys`
        (`counts`: the scorer's `counts` of their items)."""
        if len(set(keys)) != len(keys):
            raise ValueError("CachedScoring: each key may be scored once per call")
        free = device_free_bytes(self.s.device)
        out: list[float] = [0.0] * len(keys)
        where = {k: (p, r) for p in self.parts for r, k in enumerate(p.keys)}
        fresh: dict[int, list[int]] = defaultdict(list)  # prompt -> its items without a cache
        gone = set()  # held keys fed afresh (encoding changed inside the prompt's shared prefix) or as twins
        lead_of = self._twins(keys, groups, encoded, final, where)
        for i, (k, ids) in enumerate(zip(keys, encoded)):
            if final[i]:
                self.leaving.add(k)
            if i in lead_of:
                if k in where:
                    gone.add(k)
                continue
            if k not in where:
                fresh[groups[i]].append(i)
                continue
            p, r = where[k]
            if p.ids[r] == ids and p.scores[r] is not None:
                out[i] = self.s.value(p.scores[r], counts[i] if counts is not None else None)
                continue
            kept = min(len(os.path.commonprefix([p.ids[r], ids])), last_real(ids, self.s.head_pad))
            if p.pre[r] is not None and kept < len(self.prefixes[p.pre[r]].ids):
                gone.add(k)
                fresh[groups[i]].append(i)
                continue
            p.plan[r] = Feed(kept, i)
        if gone:
            parts = []
            for q in self.parts:
                stay = [r for r, k in enumerate(q.keys) if k not in gone]
                parts += [q] if len(stay) == q.size else [q.take(stay)] if stay else []
            self.parts = parts
        pending = self._held_pieces(encoded, free)
        self._feed_fresh(keys, groups, encoded, final, fresh, free, out, pending, counts)
        for piece in pending:  # those that no fresh rows' forward took along
            self._forward(piece, encoded, out, counts)
            self.parts.append(piece)
        self._copy_twins(keys, final, lead_of, out)
        self._trim(free)  # the held rows grew by what they were fed
        return out

    def _twins(self, keys: list, groups: list[int], encoded: list[list[int]], final: list[bool],
               where: dict) -> dict[int, int]:
        """Items of a call that another item of their prompt with the same encoding (the same response so far:
        candidates alike at the first decisions, or after the same tokens since) stands for: twin -> its lead. The
        lead is fed (or already holds that encoding's score); a twin is not, and takes the lead's score and, unless
        final, a copy of its cache (`_copy_twins`). A lead is an item whose held row already has the encoding's
        score if any, else one that is not final (its cache is kept), else the first."""
        rank: dict[tuple, tuple[int, int]] = {}
        unchanged = set()  # items whose held row already has their score: never a twin (nothing to save)
        for i, (k, ids) in enumerate(zip(keys, encoded)):
            sig = (groups[i], tuple(ids))
            if k in where and where[k][0].ids[where[k][1]] == ids and where[k][0].scores[where[k][1]] is not None:
                unchanged.add(i)
            r = (0 if i in unchanged else 1 if not final[i] else 2, i)
            rank[sig] = min(rank.get(sig, r), r)
        return {i: rank[(groups[i], tuple(ids))][1] for i, ids in enumerate(encoded)
                if i not in unchanged and rank[(groups[i], tuple(ids))][1] != i}

    def _copy_twins(self, keys: list, final: list[bool], lead_of: dict[int, int], out: list[float]) -> None:
        """Each twin's score is its lead's; a twin that goes on gets a copy of its lead's row, where that row is kept
        (else it starts from its prompt at its next call, as a dropped row does)."""
        where = {k: (p, r) for p in self.parts for r, k in enumerate(p.keys)}
        copies = []
        for i, lead in lead_of.items():
            out[i] = out[lead]
            if not final[i] and keys[lead] in where:
                copies.append((i, where[keys[lead]]))
        if copies:
            rows, order = fork([src for _, src in copies])
            rows.keys = [keys[copies[k][0]] for k in order]
            self.parts.append(rows)

    def _new_tokens(self, p: RowCaches, encoded: list[list[int]]) -> int:
        return max((len(encoded[f.item]) - f.kept for f in p.plan if f is not None), default=0)

    def _fits(self, parts: list[RowCaches], encoded: list[list[int]], free: int | None) -> bool:
        new = max(self._new_tokens(p, encoded) for p in parts)
        rows = sum(p.size for p in parts)
        return rows * new <= self.s.tokens_budget(free, new, max(self._columns(p) for p in parts))

    def _columns(self, p: RowCaches) -> int:
        """The most columns a row of p attends to before its new tokens: its cache's and its shared prefix's."""
        return p.width + max((len(self.prefixes[slot].ids) for slot in p.pre if slot is not None), default=0)

    def _held_pieces(self, encoded: list[list[int]], free: int | None) -> list[RowCaches]:
        """The held rows planned this call, taken out of the parts (small caches joined, large ones split, to fit
        the budget), to be fed by the caller: each in a forward of its own, or in the forward of a call's fresh rows
        where both fit (`_feed_tree`): on a device where a forward costs about the same at any width, the
        forwards are what it bills."""
        fed_now: list[RowCaches] = []  # caches whose every row is fed this call
        kept_apart: list[RowCaches] = []  # caches none of whose rows is
        for p in self.parts:
            planned = [r for r, f in enumerate(p.plan) if f is not None]
            if not planned:
                kept_apart.append(p)
            elif len(planned) == p.size:
                fed_now.append(p)
            else:  # a call for some of its rows (e.g. one prompt's decision): the others wait apart, unfed
                kept_apart.append(p.take([r for r, f in enumerate(p.plan) if f is None]))
                fed_now.append(p.take(planned))
        self.parts = kept_apart
        if not fed_now:
            return []
        batches: list[list[RowCaches]] = []
        for p in fed_now:
            if batches and self._fits(batches[-1] + [p], encoded, free):
                batches[-1].append(p)
            else:
                batches.append([p])
        pieces = []
        for b in batches:
            pieces += self._split(RowCaches.stack(b) if len(b) > 1 else b[0], encoded, free)
        return pieces

    def _split(self, p: RowCaches, encoded: list[list[int]], free: int | None) -> list[RowCaches]:
        if self._fits([p], encoded, free):
            return [p]
        lengths = [len(encoded[f.item]) - f.kept if f is not None else 1 for f in p.plan]
        budget = self.s.tokens_budget(free, max(lengths), self._columns(p))
        return [p.take(rows) for rows in token_budget_batches(lengths, budget)]

    def _feed_fresh(self, keys: list, groups: list[int], encoded: list[list[int]], final: list[bool],
                    fresh: dict[int, list[int]], free: int | None, out: list[float], pending: list[RowCaches],
                    counts: list[int] | None = None) -> None:
        """Feed the items without a cache, in batches within the budget: each prompt's shared prefix encoded once
        (a one-row seed), then the tokens that some of its items share beyond it, each branch of their tree fed once
        (`branch_tree`, level by level, a row per branch forked from its parent's), and each item's remaining tokens
        in a row of its own, forked from its deepest branch, in one forward with a piece of `pending` (held rows,
        `_held_pieces`) where both fit the budget (that piece leaves `pending`, fed)."""
        if not fresh:
            return
        shared_of, held_prefix = {}, {}
        head = self.s.head_row.ids[0] if self.s.head_row is not None else []
        for g, idx in fresh.items():
            slot = next((slot for slot, x in self.prefixes.items() if x.group == g and all(
                encoded[i][: len(x.ids)] == x.ids and last_real(encoded[i], self.s.head_pad) >= len(x.ids)
                for i in idx)), None)
            if slot is not None:  # the prompt's prefix, held since an earlier call for its other rows
                held_prefix[g], shared_of[g] = slot, len(self.prefixes[slot].ids)
                continue
            shared = shared_prefix([encoded[i] for i in idx], self.s.head_pad) if len(idx) > 1 else 0
            if shared < self.s.MIN_SHARED:  # too short for a prefill of its own, but the template's head is held
                shared = len(head) if head and all(encoded[i][: len(head)] == head and
                                                   last_real(encoded[i], self.s.head_pad) >= len(head)
                                                   for i in idx) else 0
            shared_of[g] = shared
        seeds = self._seeds({g: encoded[idx[0]][: shared_of[g]] for g, idx in fresh.items() if g not in held_prefix},
                            free)
        for g, idx in fresh.items():
            if g in held_prefix:
                seeds[g] = (self._prefix_row(held_prefix[g]), 0)
            elif seeds[g][0].cache is not None and self._worth_sharing(shared_of[g], len(idx)):
                seeds[g] = (self._hold_prefix(*seeds[g]), 0)
        apart = {g for g, (rows, r) in seeds.items() if rows.pre[r] is not None}  # rows hold no copy of the prefix
        items = [i for idx in fresh.values() for i in idx]
        lengths = [len(encoded[i]) - shared_of[groups[i]] for i in items]
        budget = self.s.tokens_budget(free, max(lengths), max(shared_of.values()))
        grown = {id(p): p.nbytes() + p.size * self._new_tokens(p, encoded) * self.s.kv_bytes_per_token
                 for p in pending}  # each held piece's bytes once fed (every row grows by the piece's new columns)
        held = self.cache_bytes() + sum(grown.values())
        allowed = math.inf if free is None else (free + held) * CACHE_MEMORY_FRACTION
        for batch in self._keepable(token_budget_batches(lengths, budget),
                                    [0 if groups[i] in apart else shared_of[groups[i]] for i in items],
                                    lengths, allowed - held):
            by_group: dict[int, list[int]] = defaultdict(list)
            for b in batch:
                by_group[groups[items[b]]].append(items[b])
            last = pending[-1] if pending else None  # the piece `_feed_tree` may take along
            rows, took = self._feed_tree(by_group, seeds, shared_of, keys, encoded, out, pending, free, counts)
            if took:  # that piece is counted in `rows` now
                held -= grown[id(last)]
            if all(final[i] for i in (items[b] for b in batch)):
                keep = False
            elif held + rows.nbytes() > allowed:  # kept within the caches' share of the memory, as `release` keeps
                self._warn_over()
                keep = False
            else:
                keep = True
            if not keep and took:  # the held rows it took along stay held (they were before the call)
                rows = rows.take(list(range(took)))
            if keep or took:
                held += rows.nbytes()
                self.parts.append(rows)

    def _worth_sharing(self, columns: int, rows: int) -> bool:
        """Whether a prompt's prefix of `columns` tokens is held once for its `rows` fresh candidates rather than
        copied into each one's cache: where the model shares it exactly (`RewardModelScorer.shares_prompt`) and the
        copies would be worth it (`worth_sharing`, the decoder's rule)."""
        if self.share_prompts is not None:
            return self.share_prompts
        return self.s.shares_prompt and worth_sharing(columns, rows, self.s.kv_bytes_per_token, self.s.device)

    def _hold_prefix(self, rows: RowCaches, r: int) -> RowCaches:
        """Row r of `rows` (a seed: a prompt's prefix) held once in the session's prefixes; returns the row that
        its candidates fork from, which holds no column."""
        real = rows.mask[r].bool()
        layers = [(k[r: r + 1][:, :, real].contiguous(), v[r: r + 1][:, :, real].contiguous())
                  for k, v in layers_of(rows.cache)]
        if int(real.sum()) != len(rows.ids[r]):
            raise RuntimeError("CachedScoring: a seed's cache does not hold its tokens")
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.prefixes[slot] = Prefix(rows.groups[r], list(rows.ids[r]), layers, rows.scores[r])
        return self._prefix_row(slot)

    def _prefix_row(self, slot: int) -> RowCaches:
        x = self.prefixes[slot]
        return RowCaches(self.s.model.config, None, torch.zeros((1, 0), dtype=torch.long, device=self.s.device),
                         [None], [x.group], [list(x.ids)], [x.state], [slot])

    def _prefix_view(self, p: RowCaches) -> tuple[SharedPrefixCache, torch.Tensor]:
        """A shared-prefix cache over the prefixes that p's rows read (left-padded to the widest; a row without one
        reads an empty one) and p's own columns after them, and the prefix columns' mask [R, Lp]."""
        slots = tuple(dict.fromkeys(slot for slot in p.pre if slot is not None))
        widths = [len(self.prefixes[slot].ids) for slot in slots] + ([0] if None in p.pre else [])
        lp = max(widths)
        if self.stacked is None or self.stacked[0] != (slots, lp, None in p.pre):
            layers = []
            for li in range(len(self.prefixes[slots[0]].layers)):
                ks, vs = [], []
                for slot, w in zip(slots, widths):
                    k, v = self.prefixes[slot].layers[li]
                    ks.append(torch.nn.functional.pad(k, (0, 0, lp - w, 0)))
                    vs.append(torch.nn.functional.pad(v, (0, 0, lp - w, 0)))
                if None in p.pre:
                    ks.append(ks[0].new_zeros(ks[0].shape))
                    vs.append(vs[0].new_zeros(vs[0].shape))
                layers.append((torch.cat(ks), torch.cat(vs)))
            self.stacked = ((slots, lp, None in p.pre), layers)
        index = {slot: j for j, slot in enumerate(slots)}
        at = [index[slot] if slot is not None else len(slots) for slot in p.pre]
        device = p.mask.device
        group = torch.tensor(at, dtype=torch.long, device=device)
        width = torch.tensor(widths, dtype=torch.long, device=device)[group]  # [R]
        pmask = (torch.arange(lp, device=device)[None, :] >= (lp - width)[:, None]).long()
        return SharedPrefixCache.of_layers(self.stacked[1], group, layers_of(p.cache)), pmask

    def _keepable(self, batches: list[list[int]], shared: list[int], own: list[int], room: float) -> list[list[int]]:
        """`batches` of items (each `shared` columns from its prompt's seed, `own` of its own), the batch that would
        pass `room` bytes of caches split where it passes, so that the rows before the split can be kept and the
        rest are scored without keeping them. A batch's rows are right-aligned: they take at most the most shared
        columns and, for the own ones, as many as the most own ones at each level of the tree and after it."""
        kv, out, levels = self.s.kv_bytes_per_token, [], self.MAX_LEVELS + 1
        for batch in batches:
            most_shared = most_own = 0
            for k, b in enumerate(batch):
                most_shared, most_own = max(most_shared, shared[b]), max(most_own, own[b])
                if (k + 1) * (most_shared + levels * most_own) * kv > room:
                    out += [batch[:k], batch[k:]] if k else [batch]
                    room = 0
                    break
            else:
                out.append(batch)
                room -= len(batch) * (most_shared + levels * most_own) * kv
        return out

    def _feed_tree(self, by_group: dict[int, list[int]], seeds: dict[int, tuple[RowCaches, int]],
                   shared_of: dict[int, int], keys: list, encoded: list[list[int]], out: list[float],
                   pending: list[RowCaches], free: int | None, counts: list[int] | None = None
                   ) -> tuple[RowCaches, int]:
        """One batch of fresh items (prompt -> its items): the branches of each prompt's tree fed level by level
        from its seed, then every item's own tokens, with the last piece of `pending` (held rows) where both fit;
        returns the rows fed last and how many of them (the first ones) are that piece's."""
        branches: list[Branch] = []
        below: dict[int, int] = {}  # item -> its deepest branch, -1 for its seed
        for g, idx in by_group.items():
            base = len(branches)
            tree, leaves = branch_tree(encoded, idx, shared_of[g], self.s.head_pad, self.MAX_LEVELS)
            branches += [b._replace(group=g, parent=b.parent + base if b.parent >= 0 else -1) for b in tree]
            below.update({i: j + base if j >= 0 else -1 for i, j in leaves.items()})
        held: dict[int, tuple[RowCaches, int]] = {}  # branch -> the rows holding it and its row there

        def parent_row(j: int, group: int) -> tuple[RowCaches, int]:
            return held[j] if j >= 0 else seeds[group]

        spelled = [encoded[b.item][: b.end] for b in branches]  # a branch's tokens, the prompt's prefix first
        unused = [0.0] * len(branches)  # a branch's own score (at its last token) is no item's
        for level in range(1, 1 + max((b.level for b in branches), default=0)):
            at = [j for j, b in enumerate(branches) if b.level == level]
            rows, order = fork([parent_row(branches[j].parent, branches[j].group) for j in at])
            at = [at[k] for k in order]
            rows.keys, rows.plan = [None] * len(at), [Feed(branches[j].start, j) for j in at]
            self._forward(rows, spelled, unused)
            held.update({j: (rows, r) for r, j in enumerate(at)})
        idx = [i for members in by_group.values() for i in members]
        group_of = {i: g for g, members in by_group.items() for i in members}
        rows, order = fork([parent_row(below[i], group_of[i]) for i in idx])
        idx = [idx[k] for k in order]
        rows.keys = [keys[i] for i in idx]
        rows.plan = [Feed(branches[below[i]].end if below[i] >= 0 else shared_of[group_of[i]], i) for i in idx]
        took = 0
        if pending and self._fits([pending[-1], rows], encoded, free):
            took = pending[-1].size
            rows = RowCaches.stack([pending.pop(), rows])
        self._forward(rows, encoded, out, counts)
        return rows, took

    def _seeds(self, prefixes: dict[int, list[int]], free: int | None) -> dict[int, tuple[RowCaches, int]]:
        """Each prompt's row holding its `prefixes[prompt]` (nothing where it is empty), fed and counted now: every
        prompt's in one forward within the memory budget, not one forward each (on a device where a forward costs
        about the same at any width, the forwards are what it bills). A prefix that starts with the template's head
        starts from the scorer's cache of it (`RewardModelScorer.head_row`): only the rest is fed. Returns, per
        prompt, the rows and its row there."""
        head = self.s.head_row
        empty = RowCaches(self.s.model.config, None, torch.zeros((1, 0), dtype=torch.long, device=self.s.device),
                          [None], [0], [[]], [None])
        groups = list(prefixes)
        start = {g: head.width if head is not None and prefixes[g][: head.width] == head.ids[0] else 0 for g in groups}
        lengths = [len(prefixes[g]) - start[g] for g in groups]
        out: dict[int, tuple[RowCaches, int]] = {}
        for batch in token_budget_batches(lengths, self.s.tokens_budget(free, max(lengths, default=1), max(
                (start[g] for g in groups), default=0))):
            members = [groups[b] for b in batch]
            rows, order = fork([(head if start[g] else empty, 0) for g in members])
            members = [members[k] for k in order]
            rows.groups = members
            rows.plan = [Feed(start[g], k) if len(prefixes[g]) > start[g] else None for k, g in enumerate(members)]
            if any(f is not None for f in rows.plan):
                self._forward(rows, [prefixes[g] for g in members], [0.0] * len(members))
            out.update({g: (rows, r) for r, g in enumerate(members)})
        return out

    def _forward(self, p: RowCaches, encoded: list[list[int]], out: list[float],
                 counts: list[int] | None = None) -> None:
        """Feed each planned row of p its new tokens (after dropping the held tokens past the kept ones) and read
        its state and score (`RewardModelScorer.advance`, `value`; `counts`: the items' `counts`; every row of p is
        planned: `_held_pieces` takes the planned rows apart)."""
        model, device = self.s.model, p.mask.device
        feeds = [encoded[f.item][f.kept:] if f is not None else [] for f in p.plan]
        new = max(len(f) for f in feeds)
        keep = torch.tensor([f.kept if f is not None else len(ids) for f, ids in zip(p.plan, p.ids)], device=device)
        view, pmask = self._prefix_view(p) if any(slot is not None for slot in p.pre) else (None, None)
        if view is not None:
            keep = keep - pmask.sum(1)  # of the row's own columns
        mask = p.mask * (p.mask.cumsum(1) <= keep[:, None])  # [R, C]: held tokens past the kept ones become holes
        fill = self.s.head_pad if self.s.head_pad is not None else 0
        ids = torch.full((p.size, new), fill, dtype=torch.long)
        block = torch.zeros((p.size, new), dtype=torch.long)
        for r, f in enumerate(feeds):
            if f:
                ids[r, new - len(f):] = torch.tensor(f, dtype=torch.long)
                block[r, new - len(f):] = 1
        mask = torch.cat([mask, block.to(device)], dim=1)  # [R, C + new]
        if view is not None:  # the prompts' prefixes read once per prompt, before each row's own columns
            full = torch.cat([pmask, mask], dim=1)
            pos = (full.cumsum(-1) - 1).clamp(min=0)[:, -new:]
            outs = self.s.outputs(lambda m: shared_forward(m, view, input_ids=ids.to(device), attention_mask=full,
                                                           position_ids=pos, use_cache=True))
            # the own columns, out of the view's growing storage (its spare columns are not kept between calls)
            cache = cache_of(model.config, [(layer.keys.contiguous(), layer.values.contiguous())
                                            for layer in view.layers])
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]  # [R, new]: positions count only real columns
            cache = p.cache if p.cache is not None else DynamicCache(config=model.config)
            outs = self.s.outputs(lambda m: m(input_ids=ids.to(device), attention_mask=mask, position_ids=pos,
                                              **cache_kw(m, cache), use_cache=True))
        p.cache, p.mask = cache, mask
        fed = [r for r, f in enumerate(p.plan) if f is not None]
        for r in fed:
            f = p.plan[r]
            p.ids[r] = p.ids[r][: f.kept] + feeds[r]
            p.scores[r] = self.s.advance(p.scores[r], f.kept, feeds[r], outs[r])
            out[f.item] = self.s.value(p.scores[r], counts[f.item] if counts is not None else None)
        self.meter.count_forward(self.s.role, torch.tensor([p.groups[r] for r in fed]),
                                 torch.tensor([len(feeds[r]) for r in fed]))
        p.plan = [None] * p.size
