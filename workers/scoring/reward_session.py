"""A reward-model session (`CachedScoring`): candidates scored again and again as they grow, each one's reward-model
KV cache kept between calls (in a `workers.scoring.reward_cache.CacheStore`), so that a call feeds the reward model
the tokens its caches do not hold, with the scores of whole scoring.

A call (`CachedScoring.score(keys, items, final)`):
1. renders and tokenises every item afresh, as whole scoring does (`RewardModelScorer.encode_all`); inputs cut to
   the reward model's context are scored whole and not kept (the cut moves);
2. for a key whose cache is held, keeps the leading tokens that its cache holds and that the new encoding starts
   with, holes the rest (the template's end-of-turn tokens, which move as the response grows, and any token whose
   encoding changed), and plans to feed the encoding's remaining tokens; the kept part never reaches past the token
   the classification head reads (the last non-pad one), and an unchanged encoding gets its last score without a
   forward;
3. feeds a prompt's new keys from its shared prefix: every prompt's prefix of the call in one forward (`_seeds`),
   from the template's head that the scorer encoded once; then the tokens some of them share beyond it, once, as
   the branches of a radix tree (`branch_tree`, `_feed_tree`); then each key's own tokens, in the forward of the
   held rows where both fit the memory budget (`RewardModelScorer.tokens_budget`);
4. holds a prompt's prefix once for its candidates where their copies would be worth sharing (`worth_sharing`, the
   decoder's rule), read by the shared-prefix attention; a candidate without a cache later starts from it;
5. feeds items of one prompt with the same encoding (twins) once, each twin taking its lead's score and a copy of
   its row (`_twins`, `_copy_twins`);
6. records every token it fed (a `Work`, handed back with the scores), and keeps the caches within their share of
   the free memory (`CacheStore.trim`).
Keys leave in bulk (`release`); `final` keys (a finished candidate's last score) leave at the next release, and a
batch made only of new final keys is never kept. New tokens are right-aligned in each forward, so every row's last
column is its last token (what the head reads); positions count only real columns, so every score equals the
model's score of the whole encoding (float noise aside).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Hashable, NamedTuple, Sequence

import torch
from transformers import DynamicCache

from workers.accounting.memory import device_free_bytes
from workers.accounting.work import Work
from workers.decoding.kvcache import cache_kw, cache_of
from workers.decoding.shared_prefix import shared_forward, worth_sharing
from workers.scoring.items import Scored, last_real, shared_prefix, token_budget_batches
from workers.scoring.protocol import Scores
from workers.scoring.reward_cache import CACHE_MEMORY_FRACTION, CacheStore, Feed, RowCaches, fork

MAX_LEVELS = 4  # levels of branches below a prompt's shared prefix, a forward each (`branch_tree`)


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


class CachedScoring:
    """A session of a `RewardModelScorer` (`s`): scores candidates again and again as they grow, keeping each one's
    reward-model cache between calls in its store (`store`).

    `levels`: levels of branches below a prompt's shared prefix (a forward each, `branch_tree`): fewer forwards,
    more tokens fed. `share_prompts`: None holds a prompt's prefix once where `_worth_sharing` says; True, every
    prompt's (the load-time probe); False, none (every candidate's cache holds its own copy)."""

    def __init__(self, scorer, levels: int = MAX_LEVELS, share_prompts: bool | None = None):
        self.s, self.levels, self.share_prompts = scorer, levels, share_prompts
        self.store = CacheStore(scorer.model.config, scorer.device)
        self.leaving: set = set()  # keys to drop at the next release (final, or cut to the context)
        self.work = Work()  # what the current call fed, handed back with its scores

    def cache_bytes(self) -> int:
        return self.store.nbytes()

    def held(self) -> list:
        """The keys whose caches are held."""
        return self.store.held()

    @torch.inference_mode()
    def score(self, keys: Sequence[Hashable], items: list[Scored], final: Sequence[bool] | None = None) -> Scores:
        """Scores of items (one per key; a key names one candidate for the session's life), and what the call fed.
        `final`: the items scored for the last time (their keys leave at the next release)."""
        final = list(final) if final is not None else [False] * len(items)
        self.work = work = Work()
        encoded, cut = self.s.encode_all(items, work)
        counts = self.s.counts(items)
        out: list[float] = [0.0] * len(items)
        if cut:
            idx = sorted(cut)
            values = self.s.score_encoded([items[i].group for i in idx], [encoded[i] for i in idx], work,
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
        return Scores([first.setdefault((items[i].group, tuple(encoded[i])), v) for i, v in enumerate(out)], work)

    @torch.inference_mode()
    def release(self, keys: Sequence[Hashable]) -> None:
        """Drop the caches of `keys` and of the keys marked leaving, in bulk (`CacheStore.release`: holes packed,
        the caches held kept under CACHE_MEMORY_FRACTION of the free memory)."""
        gone = set(keys) | self.leaving
        self.leaving = set()
        self.store.release(gone, device_free_bytes(self.s.device))

    # -- one call, token level -------------------------------------------------------------------------------------
    def feed(self, keys: list, groups: list[int], encoded: list[list[int]], final: list[bool],
             counts: list[int] | None = None) -> list[float]:
        """Scores of `encoded` (whole sequences, at most the context long) of prompts `groups`, under `keys`
        (`counts`: the scorer's `counts` of their items)."""
        if len(set(keys)) != len(keys):
            raise ValueError("CachedScoring: each key may be scored once per call")
        free = device_free_bytes(self.s.device)
        out: list[float] = [0.0] * len(keys)
        where = self.store.where()
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
            if p.pre[r] is not None and kept < len(self.store.prefixes[p.pre[r]].ids):
                gone.add(k)
                fresh[groups[i]].append(i)
                continue
            p.plan[r] = Feed(kept, i)
        if gone:
            self.store.drop(gone)
        pending = self._held_pieces(encoded, free)
        self._feed_fresh(keys, groups, encoded, final, fresh, free, out, pending, counts)
        for piece in pending:  # those that no fresh rows' forward took along
            self._forward(piece, encoded, out, counts)
            self.store.parts.append(piece)
        self._copy_twins(keys, final, lead_of, out)
        self.store.trim(free)  # the held rows grew by what they were fed
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
        where = self.store.where()
        copies = []
        for i, lead in lead_of.items():
            out[i] = out[lead]
            if not final[i] and keys[lead] in where:
                copies.append((i, where[keys[lead]]))
        if copies:
            rows, order = fork([src for _, src in copies])
            rows.keys = [keys[copies[k][0]] for k in order]
            self.store.parts.append(rows)

    def _new_tokens(self, p: RowCaches, encoded: list[list[int]]) -> int:
        return max((len(encoded[f.item]) - f.kept for f in p.plan if f is not None), default=0)

    def _fits(self, parts: list[RowCaches], encoded: list[list[int]], free: int | None) -> bool:
        new = max(self._new_tokens(p, encoded) for p in parts)
        rows = sum(p.size for p in parts)
        return rows * new <= self.s.tokens_budget(free, new, max(self.store.columns(p) for p in parts))

    def _held_pieces(self, encoded: list[list[int]], free: int | None) -> list[RowCaches]:
        """The held rows planned this call, taken out of the parts (small caches joined, large ones split, to fit
        the budget), to be fed by the caller: each in a forward of its own, or in the forward of a call's fresh rows
        where both fit (`_feed_tree`): on a device where a forward costs about the same at any width, the
        forwards are what it bills."""
        fed_now = self.store.take_planned()
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
        budget = self.s.tokens_budget(free, max(lengths), self.store.columns(p))
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
            slot = next((slot for slot, x in self.store.prefixes.items() if x.group == g and all(
                encoded[i][: len(x.ids)] == x.ids and last_real(encoded[i], self.s.head_pad) >= len(x.ids)
                for i in idx)), None)
            if slot is not None:  # the prompt's prefix, held since an earlier call for its other rows
                held_prefix[g], shared_of[g] = slot, len(self.store.prefixes[slot].ids)
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
                seeds[g] = (self.store.prefix_row(held_prefix[g]), 0)
            elif seeds[g][0].cache is not None and self._worth_sharing(shared_of[g], len(idx)):
                seeds[g] = (self.store.hold_prefix(*seeds[g]), 0)
        apart = {g for g, (rows, r) in seeds.items() if rows.pre[r] is not None}  # rows hold no copy of the prefix
        items = [i for idx in fresh.values() for i in idx]
        lengths = [len(encoded[i]) - shared_of[groups[i]] for i in items]
        budget = self.s.tokens_budget(free, max(lengths), max(shared_of.values()))
        grown = {id(p): p.nbytes() + p.size * self._new_tokens(p, encoded) * self.s.kv_bytes_per_token
                 for p in pending}  # each held piece's bytes once fed (every row grows by the piece's new columns)
        held = self.store.nbytes() + sum(grown.values())
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
                self.store.warn_over()
                keep = False
            else:
                keep = True
            if not keep and took:  # the held rows it took along stay held (they were before the call)
                rows = rows.take(list(range(took)))
            if keep or took:
                held += rows.nbytes()
                self.store.parts.append(rows)

    def _worth_sharing(self, columns: int, rows: int) -> bool:
        """Whether a prompt's prefix of `columns` tokens is held once for its `rows` fresh candidates rather than
        copied into each one's cache: where the model shares it exactly (`RewardModelScorer.shares_prompt`) and the
        copies would be worth it (`worth_sharing`, the decoder's rule)."""
        if self.share_prompts is not None:
            return self.share_prompts
        return self.s.shares_prompt and worth_sharing(columns, rows, self.s.kv_bytes_per_token, self.s.device)

    def _keepable(self, batches: list[list[int]], shared: list[int], own: list[int], room: float) -> list[list[int]]:
        """`batches` of items (each `shared` columns from its prompt's seed, `own` of its own), the batch that would
        pass `room` bytes of caches split where it passes, so that the rows before the split can be kept and the
        rest are scored without keeping them. A batch's rows are right-aligned: they take at most the most shared
        columns and, for the own ones, as many as the most own ones at each level of the tree and after it."""
        kv, out, levels = self.s.kv_bytes_per_token, [], self.levels + 1
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
            tree, leaves = branch_tree(encoded, idx, shared_of[g], self.s.head_pad, self.levels)
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
        empty = self.store.empty_row()
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
        view, pmask = self.store.prefix_view(p) if any(slot is not None for slot in p.pre) else (None, None)
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
        self.work.forward(self.s.role, torch.tensor([p.groups[r] for r in fed]),
                                 torch.tensor([len(feeds[r]) for r in fed]))
        p.plan = [None] * p.size
