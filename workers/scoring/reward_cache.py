"""The reward-model caches a session keeps between its calls (`CacheStore`), and the rows they are made of.

A session (`workers.scoring.reward_session.CachedScoring`) scores candidates again and again as they grow; what it
keeps of them between calls lives here, apart from how a call feeds them.

1. A candidate's cache is a row of a `RowCaches`: its tokens, its cache columns (holes masked 0), its state (its
   score). Rows that one forward serves share one cache; a store holds several such parts.
2. A prompt's prefix may be held once for its candidates (`Prefix`): their rows then hold only their own columns and
   name the prefix's slot (`RowCaches.pre`), read by the shared-prefix attention (`CacheStore.prefix_view`).
3. Rows are copied into new parts by `fork` (a row repeated for many candidates is broadcast), taken out of a part
   by `RowCaches.take` and stacked by `RowCaches.stack`.
4. Keys leave in bulk (`CacheStore.release`): their rows are selected out, parts whose holes pass PACK_FRACTION are
   packed, and the store stays within CACHE_MEMORY_FRACTION of the free memory (`trim`): the last parts are dropped,
   and their candidates start from their prompt again at their next call.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Hashable, NamedTuple, Sequence

import torch
from transformers import DynamicCache

from workers.decoding.kvcache import cache_kw, cache_of, fork_cache, layers_of, pack, stack_caches
from workers.decoding.shared_prefix import SharedPrefixCache

log = logging.getLogger(__name__)

CACHE_MEMORY_FRACTION = 0.25  # of the device's free memory (a session's own caches counted as free), for the caches
# a session keeps between calls; rows past it are dropped and scored from their prompt again at their next call
PACK_FRACTION = 0.5  # a part whose holes pass this fraction of its columns is packed at a release


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


class CacheStore:
    """The caches a session holds between calls: parts of candidates' rows (`parts`) and the prompts' prefixes held
    once for their rows (`prefixes`, by slot), on the reward model's device."""

    def __init__(self, config, device: torch.device):
        self.config, self.device = config, device  # the reward model's, for empty rows
        self.parts: list[RowCaches] = []
        self.prefixes: dict[int, Prefix] = {}  # slot -> a prompt's prefix its rows share (`RowCaches.pre`)
        self.next_slot = 0
        self.stacked: tuple[tuple, list] | None = None  # the last forward's prefixes stacked (slots, layers)
        self.warned = False

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts) + sum(x.nbytes() for x in self.prefixes.values())

    def held(self) -> list:
        """The keys whose caches are held."""
        return [k for p in self.parts for k in p.keys]

    def where(self) -> dict:
        """Each held key's part and row there."""
        return {k: (p, r) for p in self.parts for r, k in enumerate(p.keys)}

    def drop(self, keys: set) -> None:
        """Take the rows of `keys` out of their parts (a part left empty goes)."""
        parts = []
        for q in self.parts:
            stay = [r for r, k in enumerate(q.keys) if k not in keys]
            parts += [q] if len(stay) == q.size else [q.take(stay)] if stay else []
        self.parts = parts

    def release(self, keys: Sequence[Hashable], free: int | None) -> None:
        """Drop the caches of `keys` in bulk; pack the parts whose holes pass PACK_FRACTION; keep the caches within
        CACHE_MEMORY_FRACTION of `free` bytes (`trim`); forget the prefixes no row reads."""
        gone = set(keys)
        parts = []
        for p in self.parts:
            stay = [r for r, k in enumerate(p.keys) if k not in gone]
            if not stay:
                continue
            if len(stay) < p.size:
                p = p.take(stay)
            if p.width and float(p.mask.sum()) < (1 - PACK_FRACTION) * p.size * p.width:
                p.mask = pack(p.cache, p.mask)
            parts.append(p)
        self.parts = parts
        self.trim(free)
        used = {slot for p in self.parts for slot in p.pre}
        self.prefixes = {slot: x for slot, x in self.prefixes.items() if slot in used}
        self.stacked = None

    def trim(self, free: int | None) -> None:
        """Drop the last parts while those held pass CACHE_MEMORY_FRACTION of `free` bytes (the store's own counted
        as free): their rows start from their prompt again at their next call."""
        if free is None:
            return
        held = self.nbytes()
        allowed = (free + held) * CACHE_MEMORY_FRACTION
        if held > allowed:  # first the holes out (joins and stacks right-align rows of unequal widths)
            for p in self.parts:
                p.mask = pack(p.cache, p.mask)
            held = self.nbytes()
        while self.parts and held > allowed:
            held -= self.parts.pop().nbytes()
            self.warn_over()

    def warn_over(self) -> None:
        if not self.warned:
            self.warned = True
            log.info("reward caches over %.0f%% of the free memory: some candidates are scored from their prompt "
                     "again", 100 * CACHE_MEMORY_FRACTION)

    def take_planned(self) -> list[RowCaches]:
        """The rows that have a plan this call, taken out of their parts: the parts whose every row is planned, and
        the planned rows of the others (their other rows wait apart, unfed)."""
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
        return fed_now

    def columns(self, p: RowCaches) -> int:
        """The most columns a row of p attends to before its new tokens: its cache's and its shared prefix's."""
        return p.width + max((len(self.prefixes[slot].ids) for slot in p.pre if slot is not None), default=0)

    def hold_prefix(self, rows: RowCaches, r: int) -> RowCaches:
        """Row r of `rows` (a seed: a prompt's prefix) held once in the store's prefixes; returns the row that its
        candidates fork from, which holds no column."""
        real = rows.mask[r].bool()
        layers = [(k[r: r + 1][:, :, real].contiguous(), v[r: r + 1][:, :, real].contiguous())
                  for k, v in layers_of(rows.cache)]
        if int(real.sum()) != len(rows.ids[r]):
            raise RuntimeError("CacheStore: a seed's cache does not hold its tokens")
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.prefixes[slot] = Prefix(rows.groups[r], list(rows.ids[r]), layers, rows.scores[r])
        return self.prefix_row(slot)

    def prefix_row(self, slot: int) -> RowCaches:
        x = self.prefixes[slot]
        return RowCaches(self.config, None, torch.zeros((1, 0), dtype=torch.long, device=self.device),
                         [None], [x.group], [list(x.ids)], [x.state], [slot])

    def empty_row(self) -> RowCaches:
        """A row holding nothing, of no prompt (a seed that starts from scratch)."""
        return RowCaches(self.config, None, torch.zeros((1, 0), dtype=torch.long, device=self.device),
                         [None], [0], [[]], [None])

    def prefix_view(self, p: RowCaches) -> tuple[SharedPrefixCache, torch.Tensor]:
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
