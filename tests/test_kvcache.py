"""The in-place KV cache (workers.decoding.kvcache): the same keys and values as transformers' DynamicLayer under
every operation the engine uses (the module's own column and row operations included), with steps that write in
place instead of copying the cache."""

import random

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tests.trio_helpers import trio
from workers.decoding.kvcache import MIN_HEADROOM, GrowingLayer, cache_kw, drop_left, fork_cache, new_cache, pack


def _cache(layer) -> DynamicCache:
    """A cache of one layer, for the module's cache-level operations."""
    cache = DynamicCache()
    cache.layers = [layer]
    return cache


def _kv(b, t, gen, h=2, d=4):
    return torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)


def _same(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    if b.get_seq_length():
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_growing_layer_equals_dynamic_layer_under_every_operation():
    gen = torch.Generator().manual_seed(0)
    rnd = random.Random(0)
    for trial in range(20):
        ref, new = DynamicLayer(), GrowingLayer()
        rows = rnd.randint(1, 4)
        k, v = _kv(rows, rnd.randint(1, 9), gen)
        assert torch.equal(ref.update(k, v)[0], new.update(k, v)[0])
        for _ in range(40):
            op = rnd.choice(["step", "step", "step", "chunk", "crop", "select", "reorder", "repeat", "trim", "gather",
                             "fork"])
            n = ref.get_seq_length()
            if op in ("step", "chunk"):
                k, v = _kv(rows, 1 if op == "step" else rnd.randint(2, 90), gen)
                rk, rv = ref.update(k, v)
                nk, nv = new.update(k, v)
                assert torch.equal(rk, nk) and torch.equal(rv, nv)
            elif op == "crop" and n > 1:
                c = -rnd.randint(1, n - 1)
                ref.crop(c)
                new.crop(c)
            elif op == "select" and rows > 1:
                idx = torch.tensor(sorted(rnd.sample(range(rows), rnd.randint(1, rows))))
                ref.batch_select_indices(idx)
                new.batch_select_indices(idx)
                rows = idx.numel()
            elif op == "reorder":  # beam search: any order, repeats allowed (copied into fresh storage)
                idx = torch.tensor([rnd.randrange(rows) for _ in range(rows)])
                ref.reorder_cache(idx)
                new.reorder_cache(idx)
            elif op == "repeat" and rows < 8:
                r = rnd.randint(1, 3)
                ref.batch_repeat_interleave(r)
                new.batch_repeat_interleave(r)
                rows *= r
            elif op == "trim" and n > 1:  # Batch.trim_left: leading columns no row needs
                first = rnd.randint(1, n - 1)
                for layer in (ref, new):
                    assert drop_left(_cache(layer), first)
            elif op == "gather" and n > 1:  # the speculative sides' and the reward sessions' pack: holes out
                mask = torch.ones(rows, n, dtype=torch.long)
                for r in range(rows):
                    mask[r, torch.randperm(n, generator=gen)[: rnd.randint(1, n - 1)]] = 0
                packed = [pack(_cache(layer), mask) for layer in (ref, new)]
                assert torch.equal(packed[0], packed[1])
            elif op == "fork":  # a copy of some rows that then writes on its own, the original untouched
                idx = torch.tensor([rnd.randrange(rows) for _ in range(rnd.randint(1, 3))])
                before = (new.keys.clone(), new.values.clone()) if n else None
                twins = [fork_cache(_cache(layer), idx).layers[0] for layer in (ref, new)]
                k, v = _kv(idx.numel(), 1, gen)
                for twin in twins:
                    twin.update(k, v)
                _same(twins[1], twins[0])
                if before is not None:
                    assert torch.equal(new.keys, before[0]) and torch.equal(new.values, before[1])
            _same(new, ref)


def test_steps_write_in_place_and_reallocate_only_with_headroom():
    gen = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    layer.update(*_kv(3, 100, gen))
    reallocations, ptr = 0, layer._k.data_ptr()
    for _ in range(2000):
        layer.update(*_kv(3, 1, gen))
        if layer._k.data_ptr() != ptr:
            reallocations, ptr = reallocations + 1, layer._k.data_ptr()
    assert layer.get_seq_length() == 2100
    # each growth adds a quarter: 100 -> 2100 columns takes about log(21) / log(1.25) ~ 14 reallocations, not 2000
    assert 5 <= reallocations <= 16
    assert layer.capacity <= 2100 + max(MIN_HEADROOM, 2100 // 4)


def test_a_selection_moves_rows_in_place_and_a_crop_copies_nothing():
    gen = torch.Generator().manual_seed(2)
    layer = GrowingLayer()
    layer.update(*_kv(8, 50, gen))
    ptr = layer._k.data_ptr()
    layer.crop(-10)
    assert layer.get_seq_length() == 40 and layer._k.data_ptr() == ptr
    layer.update(*_kv(8, 1, gen))  # writes over the cropped columns, in place
    assert layer._k.data_ptr() == ptr and layer.get_seq_length() == 41
    kept = layer.keys[[0, 5, 7]].clone()
    layer.batch_select_indices(torch.tensor([0, 5, 7]))
    assert layer._k.data_ptr() == ptr and torch.equal(layer.keys, kept)  # row 0 stayed, rows 5 and 7 moved down


def test_new_cache_uses_growing_layers_for_full_attention():
    target = trio().engine.target
    cache = new_cache(target.config)
    assert cache.layers and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    ids = torch.tensor([[5, 6, 7, 8]])
    target(input_ids=ids, **cache_kw(target, cache), use_cache=True)
    assert cache.get_seq_length() == 4 and cache.layers[0].capacity >= 4


def test_the_cache_goes_under_the_keyword_the_forward_takes():
    """transformers renamed forward's `past_key_values` to `cache` (5.2x; the old name warns, and goes in 5.40):
    the keyword a class names wins; a forward that only passes keywords on gets this transformers' own."""
    from transformers import LlamaModel

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Head(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs): ...

    import inspect

    library = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
    marker = object()
    assert cache_kw(New(), marker) == {"cache": marker}
    assert cache_kw(Old(), marker) == {"past_key_values": marker}
    assert cache_kw(Head(), marker) == {library: marker}
