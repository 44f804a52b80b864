"""A prompt's cache shared by its candidates (workers.decoding.shared_prefix): the same logits as the repeated cache,
through
selections and left trims, with the prompt's keys and values held once; and a probe that refuses what it cannot
share exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import workers.decoding.shared_prefix as sp
from tests.trio_helpers import demo_items, trio, trio_prompts
from workers.accounting.cost import Meter
from workers.decoding.batch import forward
from workers.decoding.logprobs import token_logprobs
from workers.decoding.target import TargetSampler
from workers.decoding.sampling import Warp


@pytest.fixture(scope="module")
def prompts():
    ps = trio_prompts(demo_items(3))
    assert len({len(p.ids) for p in ps}) > 1  # unequal lengths: left padding inside the shared prefix
    return ps


def _decode(prompts, shared: bool, monkeypatch, forced: list | None = None):
    """Prefill 4 candidates per prompt, decode, drop every candidate of the longest prompt (so the left padding
    of the others can be trimmed) and some others; returns the logits of every step, the final batch and the tokens
    of every step: sampled, or the `forced` ones (another run's tokens: logits that differ in the last float bit, as
    two threads' reductions do, may draw another token, after which the two runs' logits differ by more than any
    tolerance)."""
    runner = trio()
    monkeypatch.setattr(sp, "SHARE_MIN_BYTES", 0)  # the tiny trio's prompts are below the size worth sharing
    if not shared:
        monkeypatch.setattr("workers.decoding.target.share", lambda *a: None)
    engine = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    logits, tokens = [], []
    with torch.inference_mode():
        batch = engine.prefill([p.ids for p in prompts], 4, [p.rng_key for p in prompts], [30] * len(prompts))
        assert isinstance(batch.cache, sp.SharedPrefixCache) == shared
        for step in range(12):
            if step == 4:
                keep = [i for i in range(batch.size) if int(batch.group[i]) != longest and i % 4 != 1]
                width = batch.kv_columns()
                batch.select(torch.tensor(keep))
                assert batch.kv_columns() < width  # the longest prompt's columns were holes for the rest: trimmed
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], 1)
            out = forward(runner.engine.target, "target", batch.pending[:, None], batch.mask, batch.cache, batch.group,
                          engine.work)[:, -1]
            logits.append(out)
            if forced is None:
                engine._sample_into(batch, out)
            else:
                batch.append_pending(forced[step], token_logprobs(out[:, None], forced[step][:, None])[:, 0])
            tokens.append(batch.pending.clone())
    return logits, batch, tokens


def test_shared_prefix_gives_the_repeated_caches_logits_through_selection_and_trim(prompts, monkeypatch):
    shared, sb, tokens = _decode(prompts, True, monkeypatch)
    with monkeypatch.context() as m:
        repeated, rb, _ = _decode(prompts, False, m, forced=tokens)
    for a, b in zip(shared, repeated):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(sb.tokens, rb.tokens)
    # and against the model's own logits of each surviving sequence, recomputed from scratch
    runner = trio()
    with torch.inference_mode():
        for r in range(sb.size):
            seq = prompts[int(sb.group[r])].ids + sb.tokens[r, : int(sb.length[r]) - 1].tolist()
            ref = runner.engine.target(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(shared[-1][r], ref, atol=1e-4, rtol=1e-4)


def test_the_prompts_cache_is_held_once(prompts, monkeypatch):
    monkeypatch.setattr(sp, "SHARE_MIN_BYTES", 0)
    runner = trio()
    engine = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0)
    with torch.inference_mode():
        batch = engine.prefill([p.ids for p in prompts], 16, [p.rng_key for p in prompts], [8] * len(prompts))
        engine.step(batch)
    layer = batch.cache.layers[0]
    assert layer.pk.shape[0] == len(prompts)  # one copy per prompt, not per candidate
    assert layer.keys.shape[0] == 16 * len(prompts) and layer.keys.shape[2] == 1  # per sequence: the new column


def test_the_probe_refuses_what_it_cannot_share_exactly(monkeypatch):
    target = trio().engine.target
    other = copy.deepcopy(target)
    other.config._attn_implementation = "eager"
    assert sp._probe(other) is False
    assert sp._probe(target) is True

    def off_by_a_bit(module, query, key, value, attention_mask, scaling=None, **kw):
        return attention(module, query, key, value, attention_mask, scaling=(scaling or 1.0) * 1.01, **kw)

    attention = sp.prefix_attention
    monkeypatch.setitem(sp.AttentionInterface._global_mapping, sp.ATTENTION, off_by_a_bit)
    assert sp._probe(target) is False


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_in_half_precision_the_probe_passes_at_the_dtypes_rounding_and_refuses_another_prompts_prefix(
        dtype, monkeypatch):
    """On an H100 in bfloat16 the probe refused the tiny target (so no model shared its prompt's cache there): the
    logits of two attentions that sum in another order differ by a bfloat16 step, 1/16 at the largest logit, more
    than the old absolute tolerance. The probe now measures the error over all the logits against the dtype."""
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    target = Runner(config(models={"dtype": dtype})).engine.target
    assert next(target.parameters()).dtype == getattr(torch, dtype)
    assert sp._probe(target) is True

    runs = sp.SharedPrefixCache.runs  # each sequence reads the other prompt's keys and values
    monkeypatch.setattr(sp.SharedPrefixCache, "runs", lambda self: [(1 - p, s, e) for p, s, e in runs(self)])
    assert sp._probe(target) is False


def test_sharing_is_kept_for_caches_worth_it():
    kv = 2 * 8 * 2 * 64 * 4  # the bench's llama-32k shape: 8 KiB a token
    assert sp.worth_sharing(512, 64, kv) and sp.worth_sharing(32, 64, kv)  # 256 MiB and 16 MiB of copies
    assert not sp.worth_sharing(22, 16, 1024)  # 352 KiB: the repeated copies cost less than the extra products
    assert not sp.worth_sharing(4096, 1, kv)  # one candidate has nothing to share
    assert sp.worth_sharing(128, 16, kv, torch.device("cpu"))  # 16 MiB: on a CPU, the memory decides


def test_a_gpu_shares_only_copies_that_take_a_part_of_its_memory(monkeypatch):
    """A GPU at these sizes is paced by the kernels it launches: it repeats a prompt's cache unless the copies would
    take 1/256 of its memory (bench.gpu on an H200: the shared-prefix attention's products slowed its step)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=140 * 2**30))
    kv, gpu = 30 * 2 * 3 * 64 * 2, torch.device("cuda")  # SmolLM2 in bfloat16: 22.5 KiB a token
    assert not sp.worth_sharing(128, 64, kv, gpu)  # 180 MiB of a 140 GiB device
    assert sp.worth_sharing(2048, 64, kv, gpu)  # 2.8 GiB: over 560 MiB
    assert sp.worth_sharing(128, 64, kv, torch.device("cpu"))
    runner = trio()
    engine = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0)
    p = trio_prompts(demo_items(1))[0]
    with torch.inference_mode():
        batch = engine.prefill([p.ids], 16, [p.rng_key], [8])
    assert not isinstance(batch.cache, sp.SharedPrefixCache)  # the tiny trio's prompt repeats


def test_a_batch_that_prompts_join_holds_the_columns_and_prefixes_of_the_prompts_it_runs(monkeypatch):
    """Best-of-4 of 12 prompts at a width of 8 on the hf decoder, the prompts' cache shared: candidates end at
    their own lengths, so prompts join a batch that has decoded for a while. The batch holds the columns of the
    widest prompt and of its oldest sequence's tokens (at most 40), not one column per step it has lived (over 100
    here), and the prefixes of the prompts it runs, not of every prompt it ran; the rows are the repeated cache's."""
    from dataclasses import replace

    from tests.metered import decode
    from tests.trio_helpers import params_of, trio_context
    from workers.engines.hf import HfDecoder
    from workers.pool.pool import Pool

    items = demo_items(12)
    ps = trio_prompts(items, 40)
    bon = params_of({"name": "best_of_n", "n": 4})
    seen = []
    step = TargetSampler.step

    def watched(self, batch):
        if isinstance(batch.cache, sp.SharedPrefixCache):
            seen.append((batch.kv_columns(), batch.cache.prompts, len(set(batch.group.tolist()))))
        return step(self, batch)

    def run():
        ctx = replace(trio_context(Meter(len(ps)), {"max_new_tokens": 40}), width=8)
        with torch.inference_mode():
            return decode(Pool.for_method(ctx, HfDecoder(ctx, bon), bon), ps)

    monkeypatch.setattr(TargetSampler, "step", watched)
    monkeypatch.setattr(sp, "SHARE_MIN_BYTES", 0)
    shared = run()
    assert len(seen) > 100
    widest = max(len(p.ids) for p in ps)
    assert max(columns for columns, _, _ in seen) <= widest + 40
    assert all(prefixes <= running + 2 for _, prefixes, running in seen)  # ended prompts leave at the next join
    monkeypatch.setattr("workers.decoding.target.share", lambda *a: None)
    # the two layouts sum attention in different orders, so a draw that falls within rounding of a boundary of the
    # inverse CDF may take the next token (1 of these 48 candidates with 2 threads on an AVX-512 CPU, none with 1); a
    # prefix read from the wrong columns would change nearly every candidate
    pairs = [(x.tokens, y.tokens) for a, b in zip(shared, run()) for x, y in zip(a.candidates, b.candidates)]
    assert len(pairs) == 48 and sum(x != y for x, y in pairs) <= len(pairs) // 16
