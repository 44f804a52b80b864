"""The target's decoding step in static shapes (workers/decoding/static_step.py, models.decode_step) held to the
dynamic step on the CPU (float32): the same tokens, greedy and sampled, through joins, compaction and dropped leading
columns; and every oracle under it (greedy = generate(), Speculative Rejection with alpha 0 = Best-of-N, the same
config the same rows). Its CUDA graphs are tested in tests/test_gpu.py."""

from __future__ import annotations

import functools

import pytest
import torch

from schemas.base import ConfigError
from schemas.config import validate_config
from tests.trio_helpers import BASE, config, demo_items, merge, trio, trio_prompts
from workers.accounting.work import Work
from workers.actor.runner import Runner
from workers.decoding.batch import forward
from workers.decoding.sampling import Warp
from workers.decoding.static_step import COLUMN_STEP, StaticCache, column_bucket, row_bucket, steps_exactly
from workers.decoding.target import TargetSampler
from workers.engines.hf import HfDecoder, MemoryModel, decode_step


@functools.lru_cache(maxsize=None)
def runner(step: str) -> Runner:
    """The tiny target and reward model with models.decode_step `step` (its own copy of the models)."""
    return Runner(config(models={"decode_step": step}, method={"name": "best_of_n", "n": 8}))


def rows_of(step: str, method: dict, items: list[dict], generation: dict | None = None) -> list[dict]:
    base = runner(step)
    over = {"models": {"decode_step": step}, "method": method}
    if generation:
        over["generation"] = generation
    return Runner(config(**over), share=base).run(items)


def texts(rows: list[dict]) -> list[list[tuple[str, str]]]:
    return [[(c["text"], c["finish_reason"]) for c in r["candidates"]] for r in rows]


def test_buckets_round_up_and_pad_by_an_eighth_at_most():
    assert [row_bucket(r) for r in (1, 2, 7, 16, 17, 20, 21, 33, 100, 256, 257)] == \
        [1, 2, 7, 16, 18, 20, 22, 36, 104, 256, 288]
    for r in range(1, 700):
        b = row_bucket(r)
        assert b >= r and b - r <= max(0, r // 8)
        assert row_bucket(b) == b  # a bucket is its own bucket: a batch that stays there keeps its graph
    assert [column_bucket(c) for c in (1, 64, 65, 200)] == [COLUMN_STEP, COLUMN_STEP, 2 * COLUMN_STEP, 256]


def test_the_tiny_target_runs_its_step_static_and_an_eager_model_does_not():
    assert steps_exactly(trio().engine.target)
    from transformers import LlamaConfig, LlamaForCausalLM

    eager = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, attn_implementation="eager"))
    assert not steps_exactly(eager)
    with pytest.raises(ValueError, match="models.decode_step: 'static'"):
        decode_step("static", torch.device("cpu"), eager)
    assert decode_step("dynamic", torch.device("cpu"), eager) == "dynamic"


def test_decode_step_is_a_config_field_with_a_clear_error():
    assert config().models.decode_step == "dynamic"
    assert config(models={"decode_step": "static"}).models.decode_step == "static"
    with pytest.raises(ConfigError, match="decode_step"):
        validate_config(merge(BASE, {"models": {"decode_step": "graphs"}}))


def _sampler_run(step: str, warp: Warp) -> tuple[list, list, torch.Tensor]:
    """A batch that starts two prompts, loses rows, takes two more prompts (one long: its leading columns outlive
    it), loses the long one, and decodes on: its tokens, its log-probabilities and the last step's logits."""
    r = trio()
    prompts = [p.ids for p in trio_prompts(demo_items(3))]
    long = (prompts[2] * 8)[: 3 * COLUMN_STEP]
    s = TargetSampler(r.engine.target, r.pad_id, r.eos_ids, warp, 0, step=step)
    with torch.inference_mode():
        b = s.prefill(prompts[:2], 4, [11, 12], [60, 60])
        for _ in range(6):
            s.step(b)
        b.alive[1] = b.alive[6] = False
        b.compact()
        b.extend(s.prefill([long, prompts[2]], 3, [13, 14], [60, 60], first_group=2), r.pad_id)
        for _ in range(4):
            s.step(b)
        b.alive[:6] = False
        b.alive[6:9] = False  # the long prompt's rows: the holes before the others' columns lead every row now
        b.compact()
        for _ in range(5):
            s.step(b)
        if step == "static":
            assert isinstance(b.cache, StaticCache) and b.cache.rows == b.size == 3
            assert b.kv_columns() == b.cache.columns < 3 * COLUMN_STEP  # the leading holes were dropped
        b.mask = torch.cat([b.mask, b.mask.new_ones(b.size, 1)], 1)
        logits = forward(r.engine.target, "target", b.pending[:, None], b.mask, b.cache, b.group, Work())
    return b.tokens.tolist(), b.logprob.tolist(), logits


@pytest.mark.parametrize("warp", [Warp(0.0), Warp(1.0), Warp(0.8, top_k=20, top_p=0.9)], ids=str)
def test_static_step_gives_the_dynamic_steps_tokens_through_joins_drops_and_shifts(warp):
    tokens_d, logprob_d, logits_d = _sampler_run("dynamic", warp)
    tokens_s, logprob_s, logits_s = _sampler_run("static", warp)
    assert tokens_s == tokens_d
    assert logprob_s == pytest.approx(logprob_d, abs=1e-4)
    assert torch.allclose(logits_s, logits_d, atol=1e-4, rtol=1e-4)


def test_a_static_store_is_reused_by_the_next_batch_once_empty():
    r = trio()
    prompts = [p.ids for p in trio_prompts(demo_items(2))]
    s = TargetSampler(r.engine.target, r.pad_id, r.eos_ids, Warp(1.0), 0, step="static")
    with torch.inference_mode():
        first = s.prefill(prompts[:1], 2, [1], [8])
        s.step(first)
        store = first.cache
        first.alive[:] = False
        first.compact()
        second = s.prefill(prompts[1:], 2, [2], [8])
        s.step(second)
        assert second.cache is store  # the first batch holds no row: its storage (and graphs) serve the next
        third = s.prefill(prompts[:1], 2, [3], [8])
        s.step(third)
        assert third.cache is not store  # the second batch still holds rows in it


def test_a_static_decoders_memory_model_counts_the_padding_rows():
    r = runner("static")
    ctx = r.context_for()
    static, dynamic = HfDecoder(ctx, r.params, "static"), HfDecoder(ctx, r.params, "dynamic")
    assert static.sampler.static and not dynamic.sampler.static
    prompt = trio_prompts(demo_items(1))[0]
    assert static.need(prompt, 8) == dynamic.need(prompt, 8) + dynamic.need(prompt, 8) // 8
    assert isinstance(dynamic.memory, MemoryModel) and not dynamic.memory.static


@pytest.mark.parametrize("method", [{"name": "best_of_n", "n": 8},
                                    {"name": "speculative_rejection", "n": 8, "alpha": 0.5, "every_k_tokens": 8,
                                     "schedule": "fixed"}], ids=["best_of_n", "speculative_rejection"])
def test_static_rows_are_the_dynamic_rows(method):
    items = demo_items(6)
    static, dynamic = rows_of("static", method, items), rows_of("dynamic", method, items)
    assert texts(static) == texts(dynamic)
    for s, d in zip(static, dynamic):
        assert s["best_index"] == d["best_index"]
        assert s["stats"]["decoding_steps"] == d["stats"]["decoding_steps"]


def test_static_greedy_equals_generate():
    r = runner("static")
    items = demo_items(4)
    rows = rows_of("static", {"name": "best_of_n", "n": 3}, items, {"temperature": 0, "max_new_tokens": 40})
    for row, p in zip(rows, trio_prompts(items)):
        ids = torch.tensor([p.ids])
        ref = r.engine.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                       eos_token_id=r.eos_ids, pad_token_id=r.pad_id)[0, len(p.ids):]
        want = r.tokenizer.decode(ref, skip_special_tokens=True).strip()
        assert len(ref) > 3 and all(c["text"] == want for c in row["candidates"])


def test_static_speculative_rejection_with_alpha_zero_is_best_of_n():
    items = demo_items(6)
    bon = rows_of("static", {"name": "best_of_n", "n": 8}, items)
    sr = rows_of("static", {"name": "speculative_rejection", "n": 8, "alpha": 0.0, "schedule": "fixed",
                            "every_k_tokens": 6}, items)
    assert any(r["stats"]["rejection_rounds"] > 0 for r in sr), "the schedule never decided: the test proves nothing"
    assert texts(sr) == texts(bon)
    assert [r["best_index"] for r in sr] == [r["best_index"] for r in bon]


def test_static_same_config_same_rows():
    items = demo_items(4)
    method = {"name": "speculative_rejection", "n": 8, "alpha": 0.5}
    assert texts(rows_of("static", method, items)) == texts(rows_of("static", method, items))
