"""A prompt's KV cache shared by its candidates, and the attention that reads it once per prompt.

After the prefill, each of a prompt's n candidates needs the prompt's keys and values. Repeating them n times
(`batch_repeat_interleave`) costs n copies of the prompt's cache (574 MB of an 862 MB cache for 64 candidates of a
255-token prompt) and, at every step, attention reads every copy. A `SharedPrefixCache` keeps each prompt's cache
once ([P, H, Lp, D], the *prefix*) and, per sequence, only the columns decoded after it (the *suffix*, in the
in-place storage of `workers.decoding.kvcache.GrowingLayer`). `prefix_attention` computes softmax(q K^T) V over prefix +
suffix in one softmax: the prefix's scores of all of a prompt's sequences come from one matrix product with the
prompt's keys (the candidates' queries stacked), the suffix's from the usual per-sequence product. Sequences are
kept in runs of one prompt (the engine's batches are prompt-major), so a prompt's sequences are a slice.

The function is registered with transformers' AttentionInterface under `ATTENTION` (masks as for sdpa), and is
selected only for the duration of a forward that passes `winnow_prefix=cache` (`shared_forward`); every other
forward of the model runs its own attention. `shares_exactly(model)` checks once per model that decoding with a
shared prefix gives the model's own logits (sdpa attention, plain full-attention layers, no softcap, sliding window
or attention sinks); a model that fails keeps the repeated cache.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from workers.decoding.kvcache import GrowingLayer, cache_kw, new_cache, plain_columns

log = logging.getLogger(__name__)

ATTENTION = "winnow_shared_prefix"
SHARE_MIN_BYTES = 4 * 2**20  # a prompt's repeated cache smaller than this is not worth sharing (`worth_sharing`)
SHARE_GPU_FRACTION = 1 / 256  # of a GPU's memory: on a GPU, repeated copies smaller than this are not worth sharing


class SharedPrefixLayer(GrowingLayer):
    """One layer: the prompts' keys/values once ([P, H, Lp, D]) and each sequence's suffix (GrowingLayer storage)."""

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, owner: SharedPrefixCache):
        super().__init__()
        self.pk, self.pv = prefix_keys, prefix_values
        self.owner = owner
        self.lazy_initialization(prefix_keys, prefix_values)

    def get_seq_length(self) -> int:
        return self.owner.width + self._n


class SharedPrefixCache(DynamicCache):
    """A DynamicCache of `SharedPrefixLayer`s; `group` [B] is each sequence's prompt (an index into the prefix)."""

    def __init__(self, prefilled: DynamicCache, group: torch.Tensor):
        super().__init__()
        self.group = group
        self.width = prefilled.get_seq_length()
        self.layers = [SharedPrefixLayer(layer.keys.contiguous(), layer.values.contiguous(), self)
                       for layer in prefilled.layers]
        self._runs: list[tuple[int, int, int]] | None = None

    @classmethod
    def of_layers(cls, prefix: list[tuple[torch.Tensor, torch.Tensor]], group: torch.Tensor,
                  suffix: list[tuple[torch.Tensor, torch.Tensor]]) -> SharedPrefixCache:
        """A cache over prompts' keys/values `prefix` (per layer, [P, H, Lp, D]) for sequences of prompts `group`
        holding `suffix` (per layer, [B, H, S, D]; empty: no column yet), without copying either: the suffix is
        copied into growing storage at the first update, as a joined cache's is."""
        cache = cls.__new__(cls)
        DynamicCache.__init__(cache)
        cache.group, cache.width, cache._runs = group, int(prefix[0][0].shape[-2]), None
        cache.layers = [SharedPrefixLayer(k, v, cache) for k, v in prefix]
        for layer, (k, v) in zip(cache.layers, suffix):
            layer.keys, layer.values = k, v
        return cache

    def runs(self) -> list[tuple[int, int, int]]:
        """(prompt, first sequence, end) of each run of consecutive sequences of one prompt."""
        if self._runs is None:
            g = self.group.tolist()
            out, start = [], 0
            for i in range(1, len(g) + 1):
                if i == len(g) or g[i] != g[start]:
                    out.append((g[start], start, i))
                    start = i
            self._runs = out
        return self._runs

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.group = self.group[indices.to(self.group.device)]
        self._runs = None
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a shared prefix is not repeated: its sequences are selected")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a shared-prefix cache is not cropped")

    @property
    def prompts(self) -> int:
        return int(self.layers[0].pk.shape[0]) if self.layers else 0

    def extend(self, other: SharedPrefixCache, rows: int) -> tuple[int, int]:
        """Append `other`'s prompts and sequences (freshly prefilled: no column after their prefix) below this
        cache's `rows` sequences. The prefixes are left-padded with zero columns to the wider one's width; `other`'s
        sequences get this cache's suffix columns as zero columns. Returns the zero columns put before this cache's
        columns and before `other`'s prefix; the caller masks them (and `other`'s suffix columns) as holes."""
        if other._n_suffix():
            raise ValueError("only freshly prefilled sequences can join a shared-prefix cache")
        self._drop_ended_prompts()
        width = max(self.width, other.width)
        pad_self, pad_other = width - self.width, width - other.width
        self.group = torch.cat([self.group, other.group + self.prompts])  # other's prompts come after ours
        for a, b in zip(self.layers, other.layers):
            a.pk = torch.cat([_pad_left(a.pk, pad_self), _pad_left(b.pk, pad_other)], 0)
            a.pv = torch.cat([_pad_left(a.pv, pad_self), _pad_left(b.pv, pad_other)], 0)
            a.join(b, rows, other.group.numel())
        self.width = width
        self._runs = None
        return pad_self, pad_other

    def _n_suffix(self) -> int:
        return self.layers[0].get_seq_length() - self.width if self.layers else 0

    def _drop_ended_prompts(self) -> None:
        """Drop the prefixes of prompts none of whose sequences is left (a batch that prompts join while it decodes
        would otherwise hold, and copy at every join, the prefix of every prompt it ever ran)."""
        used = torch.unique(self.group)  # ascending
        if used.numel() == self.prompts:
            return
        remap = torch.full((self.prompts,), -1, dtype=torch.long, device=self.group.device)
        remap[used] = torch.arange(used.numel(), device=self.group.device)
        self.group = remap[self.group]
        for layer in self.layers:
            layer.pk, layer.pv = layer.pk[used.to(layer.pk.device)], layer.pv[used.to(layer.pv.device)]
        self._runs = None

    def drop_suffix(self, columns: int) -> None:
        """Drop the first `columns` columns after the prefix (holes in every sequence: the steps decoded before any
        of its sequences joined), as views of the same storage; its spare columns stay writable."""
        for layer in self.layers:
            if layer._n:
                c = min(columns, layer._n)
                layer._k, layer._v = layer._k[:, :, c:], layer._v[:, :, c:]
                layer._n -= c
                layer._nv -= c

    def drop_left(self, columns: int) -> int:
        """Drop up to `columns` leading prefix columns (holes in every sequence); returns how many were dropped."""
        columns = min(columns, self.width)
        if columns:
            for layer in self.layers:
                layer.pk, layer.pv = layer.pk[:, :, columns:], layer.pv[:, :, columns:]
            self.width -= columns
        return columns


def _pad_left(t: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.cat([t.new_zeros((*t.shape[:2], columns, t.shape[-1])), t], 2) if columns else t


def prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     winnow_prefix: SharedPrefixCache | None = None, **kwargs):
    """Attention over a shared prefix + each sequence's own columns (`key`/`value`: the suffix the layer returned).

    query [B, Hq, q, D]; attention_mask: the sdpa mask over prefix + suffix columns ([B, 1, q, Lp + S] bool, True =
    attend; or additive float; or None = everything, causal within the q new columns). Returns [B, q, Hq, D]."""
    if winnow_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for name in ("softcap", "position_bias", "sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"shared-prefix attention does not implement {name}")
    layer = winnow_prefix.layers[module.layer_idx]
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    rq = (hq // hkv) * q
    lp = winnow_prefix.width
    scale = scaling if scaling is not None else d ** -0.5
    qg = query.reshape(b, hkv, rq, d)  # heads are grouped: query head h reads key head h // (hq // hkv)
    scores = qg.new_empty((b, hkv, rq, lp + key.shape[2]))
    scores[..., lp:] = torch.matmul(qg, key.transpose(-1, -2))
    for p, s, e in winnow_prefix.runs():
        qs = qg[s:e].transpose(0, 1).reshape(hkv, (e - s) * rq, d)
        scores[s:e, :, :, :lp] = torch.matmul(qs, layer.pk[p].transpose(-1, -2)).view(hkv, e - s, rq, lp).transpose(
            0, 1)
    scores.mul_(scale)
    if attention_mask is not None:
        m = attention_mask[:, :, None].expand(b, attention_mask.shape[1], rq // q, q, attention_mask.shape[-1])
        m = m.reshape(b, attention_mask.shape[1], rq, attention_mask.shape[-1])
        if m.dtype == torch.bool:
            scores.masked_fill_(~m, float("-inf"))
        else:
            scores.add_(m)
    elif q > 1:
        cols = scores.shape[-1]
        causal = torch.ones(q, q, dtype=torch.bool, device=scores.device).tril()
        allowed = torch.cat([causal.new_ones(q, cols - q), causal], 1).repeat(rq // q, 1)  # [rq, cols]
        scores.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs[..., lp:], value)  # [B, Hkv, rq, D]
    for p, s, e in winnow_prefix.runs():
        ps = probs[s:e, :, :, :lp].transpose(0, 1).reshape(hkv, (e - s) * rq, lp)
        out[s:e] += torch.matmul(ps, layer.pv[p]).view(hkv, e - s, rq, d).transpose(0, 1)
    return out.view(b, hq, q, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, prefix_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def _attention(model, name: str):
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def shared_forward(model, cache: SharedPrefixCache, **inputs):
    """model(**inputs) with the shared-prefix attention reading `cache`."""
    with _attention(model, ATTENTION):
        return model(**cache_kw(model, cache), winnow_prefix=cache, **inputs)


def worth_sharing(prompt_columns: int, candidates: int, kv_bytes_per_token: int,
                  device: torch.device | None = None) -> bool:
    """Whether a prompt's cache is worth sharing: its copies for the candidates would take SHARE_MIN_BYTES or more,
    and on a GPU also SHARE_GPU_FRACTION of its memory. Below that, the repeated copies are cheap and the
    attention's own kernel (one call) beats the shared-prefix attention's products (about a dozen kernels a layer,
    two more a prompt): on the bundled tiny trio on a CPU, sharing made Best-of-16 about 10% slower, and a GPU at
    these model sizes is launch-bound, its step paced by the kernels it launches, not by the memory they read."""
    if candidates < 2:
        return False
    least = SHARE_MIN_BYTES
    if device is not None and device.type == "cuda":
        least = max(least, int(torch.cuda.get_device_properties(device).total_memory * SHARE_GPU_FRACTION))
    return prompt_columns * candidates * kv_bytes_per_token >= least


def share(model, prefilled: DynamicCache, group: torch.Tensor, kv_bytes_per_token: int
          ) -> SharedPrefixCache | None:
    """The prefilled cache of P prompts as a shared prefix for sequences of prompts `group` [B] (prompt-major), or
    None where it is not worth it (`worth_sharing`) or the model cannot share exactly (`shares_exactly`)."""
    candidates = int(torch.bincount(group).max()) if group.numel() else 0
    if not worth_sharing(prefilled.get_seq_length(), candidates, kv_bytes_per_token, next(model.parameters()).device):
        return None
    if not shares_exactly(model) or not plain_columns(prefilled):
        return None
    return SharedPrefixCache(prefilled, group)


_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shares_exactly(model) -> bool:
    """Whether decoding with a shared prefix gives the model's own logits (checked once per model): two prompts of
    unequal lengths (left padding), two sequences each, two decoding steps, both ways."""
    if model not in _VERDICTS:
        _VERDICTS[model] = _probe(model)
        log.info("target %s its prompt's cache across candidates",
                 "shares" if _VERDICTS[model] else "repeats")
    return _VERDICTS[model]


def probe_inputs(model, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A load-time probe's inputs on `model`'s device, seeded: two prompts of 10 ids, the second left-padded by 3
    (ids, mask), and `steps` tokens for each of their four candidates (two a prompt)."""
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 10), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is left-padded
    return ids, mask, torch.randint(3, vocab, (4, steps), generator=gen).to(device)


@torch.inference_mode()
def _probe(model) -> bool:
    if model.config._attn_implementation != "sdpa":
        return False
    device = next(model.parameters()).device
    ids, mask, steps = probe_inputs(model, 2)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    try:
        outs = []
        for shared in (False, True):
            cache = new_cache(model.config)
            model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(model, cache), use_cache=True)
            group = torch.arange(2, device=device).repeat_interleave(2)
            if shared:
                if not plain_columns(cache):
                    return False
                cache = SharedPrefixCache(cache, group)
            else:
                cache.batch_repeat_interleave(2)
            m = mask.repeat_interleave(2, 0)
            logits = []
            for t in range(2):
                m = torch.cat([m, m.new_ones(4, 1)], 1)
                p = (m.cumsum(-1) - 1)[:, -1:]
                kw = dict(input_ids=steps[:, t:t + 1], attention_mask=m, position_ids=p, use_cache=True)
                out = shared_forward(model, cache, **kw) if shared else model(**cache_kw(model, cache), **kw)
                logits.append(out.logits[:, -1].float())
            outs.append(torch.stack(logits))
    except (NotImplementedError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        log.info("target cannot share its prompt's cache: %s", err)
        return False
    return agrees(outs[0], outs[1], next(model.parameters()).dtype)


def agrees(repeated: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the shared prefix's logits are the repeated cache's up to the model's rounding. In float32, within
    1e-4. In a half precision the logits are themselves rounded to it (bfloat16's spacing is 1/16 at 12.5, the
    tiny target's largest logit), and two attentions that sum in another order differ by that much at any logit; so
    the error is measured over all the logits, as a norm relative to theirs, within two of the dtype's epsilons
    (the tiny target: 0.004 in bfloat16 against 0.016, 0.0006 in float16 against 0.002; each way's error against
    the model in float32 is larger than the two ways' difference)."""
    if dtype == torch.float32:
        return bool(torch.allclose(repeated, shared, atol=1e-4, rtol=1e-4))
    return bool((shared - repeated).norm() <= 2 * torch.finfo(dtype).eps * repeated.norm())
