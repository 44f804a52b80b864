"""A sequence-classification reward model, scored whole (`RewardModelScorer`), and the load-time probes that say how
it may be scored: with a prompt's prefix encoded once, and incrementally in a session.

Whole scoring of a call (`RewardModelScorer.__call__`):
1. each item is rendered in the reward model's chat template and tokenised, cut to its context where longer
   (`items.reward_inputs`; the cut ones recorded per prompt);
2. a prompt's items alike are one input (`items.once_per_input`);
3. a causal reward model encodes the prompt its candidates share once per batch and repeats its cache across them
   (`score_with_prefix`), where the load-time probe says that gives its own scores (`prefix_sharing_is_exact`);
4. the rest are scored whole, batched under a token budget (rows x padded length), shortest first, sized from the
   device's free memory and capped by `models.reward.batch_tokens`;
5. the scores come back with what was fed (`Scores`: values and a `Work`).
A method that scores the same candidates again and again as they grow (Speculative Rejection's decisions) scores
through a *session* (`RewardModelScorer.session`): where the probe `incremental_is_exact` passes, a
`workers.scoring.reward_session.CachedScoring` keeps each candidate's cache and feeds only the tokens it does not
hold (its caches kept in `workers.scoring.reward_cache`); otherwise every call is scored afresh.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from workers.accounting.memory import device_free_bytes
from workers.accounting.work import Work
from workers.decoding.kvcache import cache_kw, context_length, model_kv_bytes
from workers.scoring.items import (
    Scored,
    once_per_input,
    reward_input,
    reward_inputs,
    right_padded,
    shared_prefix,
    template_head,
    token_budget_batches,
)
from workers.scoring.protocol import Scores
from workers.scoring.reward_cache import RowCaches
from workers.scoring.reward_session import MAX_LEVELS, CachedScoring
from workers.scoring.scorers import Rescoring

log = logging.getLogger(__name__)

SCORING_MEMORY_FRACTION = 0.5  # of the device's free memory, for the transient tensors of one scoring forward


def default_levels(device: torch.device) -> int:
    """Levels of a session's radix tree (`CachedScoring`) on `device`. On the CPU a forward's cost grows with the
    tokens it feeds, so every level that saves tokens pays (MAX_LEVELS). On an accelerator at these sizes a forward
    costs about the same at any width, so a scoring call feeds all of its tokens in one forward (0)."""
    return MAX_LEVELS if device.type == "cpu" else 0


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
    cuts_inputs = True  # an input longer than the context keeps its end

    def __init__(self, model, tokenizer, batch_tokens: int | None, role: str = "reward", *,
                 incremental_sessions: bool = True, levels: int | None = None, share_prompts: bool | None = None):
        """`role`: the model a `Work` records the forwards of. The sessions' switches: `incremental_sessions` False
        scores every call whole even where the model scores incrementally (the side a session is measured against,
        bench.bill --reward-session whole); `levels` and `share_prompts` as `CachedScoring` takes them. `levels`
        None: by the device (`default_levels`)."""
        self.model, self.tok, self.batch_tokens = model, tokenizer, batch_tokens
        self.device = next(model.parameters()).device
        levels = default_levels(self.device) if levels is None else levels
        self.incremental_sessions, self.levels, self.share_prompts = incremental_sessions, levels, share_prompts
        self.dtype_bytes = next(model.parameters()).element_size()
        self.max_len = context_length(model.config)
        if self.max_len is None:
            log.warning("models.reward.path: the reward model's config has no max_position_embeddings, so reward "
                        "inputs are not cut to a context length")
        self.role = role
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

    def session(self):
        """A scoring session for candidates scored again as they grow: CachedScoring when `incremental`, else one
        that scores every call afresh (Rescoring)."""
        if self.incremental and self.incremental_sessions:
            return CachedScoring(self, self.levels, self.share_prompts)
        return Rescoring(self)

    def encode(self, item: Scored) -> list[int]:
        return reward_input(self.tok, item)

    def encode_all(self, items: list[Scored], work: Work) -> tuple[list[list[int]], set[int]]:
        """Every item's reward input, cut to the context where longer (`items.reward_inputs`, recorded in `work`)."""
        return reward_inputs(self.tok, self.max_len, items, work)

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
    def __call__(self, items: list[Scored]) -> Scores:
        work = Work()
        encoded, _ = self.encode_all(items, work)
        return Scores(self.score_encoded([it.group for it in items], encoded, work), work)

    def score_encoded(self, groups: list[int], encoded: list[list[int]], work: Work,
                      counts: list[int] | None = None) -> list[float]:
        """Scores of encoded sequences of prompts `groups` (their forwards recorded in `work`), each prompt's shared
        prefix encoded once per batch when the model allows it, the others whole; a prompt's sequences alike are
        scored once (`counts`: unused)."""
        return once_per_input([(g, tuple(ids)) for g, ids in zip(groups, encoded)], lambda idx: self._score_distinct(
            [groups[i] for i in idx], [encoded[i] for i in idx], work))

    def _score_distinct(self, groups: list[int], encoded: list[list[int]], work: Work) -> list[float]:
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
                work.forward(self.role, torch.tensor([group]), torch.tensor([shared]))
                work.forward(self.role, torch.full((len(batch),), group), lengths_)
                for b, v in zip(batch, scores):
                    out[idx[b]] = v
        lengths = [len(encoded[i]) for i in whole]
        for batch in token_budget_batches(lengths, self.tokens_budget(free, max(lengths, default=1))):
            rows = [whole[b] for b in batch]
            ids, mask = right_padded([encoded[i] for i in rows], self.pad)
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, v in zip(rows, logits[:, 0].float().cpu().tolist()):
                out[i] = v
            work.forward(self.role, torch.tensor([groups[i] for i in rows]), mask.sum(-1))
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
    session = CachedScoring(scorer, share_prompts=True if share else None)
    try:
        got = session.feed(["a", "b"], [0, 0], first, [False, False])
        measured = session.cache_bytes() // max(1, sum(p.size * p.width for p in session.store.parts))
        got += session.feed(["a", "b", "c"], [0, 0, 0], second, [False] * 3)
        if share:
            got += session.feed(["b", "a", "d"], [0, 0, 0], third, [False] * 3)
            if not session.store.prefixes:
                return False
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, NotImplementedError) as err:
        log.info("reward model cannot score incrementally%s: %s", " with a shared prompt" if share else "", err)
        return False
    whole = [scorer.whole_value(s) for s in first + second + (third if share else [])]
    if measured > 0 and not share:
        scorer.kv_bytes_per_token = measured
    return _close(got, whole, model)

