"""The CUDA path of the engine: skipped without a CUDA device (CI has none; run `pytest -m gpu` on a GPU machine).

What only a GPU can show: the memory schedule and the memory guard read the device's free memory; bfloat16 decoding
keeps the exactness oracles within bfloat16's tolerance; the shared-prefix probe and the reward's prefix probe pass
at their bfloat16 tolerance; the in-place KV cache stays on the device; the static decoding step ('auto' on a GPU)
is captured in CUDA graphs, replays the eager step's tokens, and keeps the oracles.
"""

from __future__ import annotations

import pytest
import torch

from tests.trio_helpers import config, demo_items, trio_prompts
from workers.accounting.memory import free_memory_bytes
from workers.actor.runner import Runner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _runner(dtype: str, **over) -> Runner:
    return Runner(config(**{"models": {"dtype": dtype}, "resources": {"gpus_per_actor": 1}, **over}))


def test_free_memory_is_the_devices_and_the_memory_schedule_uses_it():
    from schemas.methods import SpeculativeRejection
    from workers.pool.schedules import schedule_space

    device = torch.device("cuda")
    free = free_memory_bytes(device)
    assert 0 < free <= torch.cuda.get_device_properties(device).total_memory
    params = SpeculativeRejection(name="speculative_rejection", n=8, schedule="memory", memory_fraction=0.5)
    budget = schedule_space(params, free)
    assert 0.3 * free < budget <= 0.5 * torch.cuda.get_device_properties(device).total_memory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_best_of_n_on_cuda_matches_generate_greedy_and_shares_the_prompt(dtype):
    from workers.decoding.shared_prefix import shares_exactly

    runner = _runner(dtype, method={"name": "best_of_n", "n": 3}, generation={"temperature": 0, "max_new_tokens": 24})
    assert runner.engine.device.type == "cuda"
    assert shares_exactly(runner.engine.target)  # the probe passes at this dtype's tolerance
    items = demo_items(4)
    rows = runner.run(items)
    prompts = trio_prompts(items)
    agree = 0
    for row, p in zip(rows, prompts):
        ids = torch.tensor([p.ids], device=runner.engine.device)
        out = runner.engine.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=24, pad_token_id=runner.pad_id)
        ref = runner.tokenizer.decode(out[0, len(p.ids):], skip_special_tokens=True).strip()
        agree += all(c["text"] == ref for c in row["candidates"])
    # float32 must agree everywhere; bfloat16 rounding may flip a near-tie in a prompt or two
    assert agree == len(items) if dtype == "float32" else agree >= len(items) - 1


def test_the_kv_cache_grows_on_the_device():
    from workers.decoding.target import TargetSampler
    from workers.decoding.sampling import Warp

    runner = _runner("bfloat16")
    prompts = trio_prompts(demo_items(2))
    engine = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0)
    with torch.inference_mode():
        batch = engine.prefill([p.ids for p in prompts], 8, [p.rng_key for p in prompts], [16, 16])
        for _ in range(8):
            engine.step(batch)
    layer = batch.cache.layers[0]
    assert layer.keys.device.type == "cuda" and layer.keys.dtype == torch.bfloat16


def test_the_engine_runs_without_cudnn_attention():
    _runner("bfloat16")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def _static_run(runner: Runner, capture: bool, step: str = "static") -> tuple[list, int]:
    """A batch on the device that starts two prompts, loses rows, takes two more and decodes on: its tokens, and the
    graphs its static step captured."""
    from workers.decoding.sampling import Warp
    from workers.decoding.target import TargetSampler

    prompts = [p.ids for p in trio_prompts(demo_items(4))]
    s = TargetSampler(runner.engine.target, runner.pad_id, runner.eos_ids, Warp(1.0), 0, step=step, capture=capture)
    with torch.inference_mode():
        b = s.prefill(prompts[:2], 8, [1, 2], [40, 40])
        for _ in range(12):
            s.step(b)
        b.alive[1::3] = False
        b.compact()
        b.extend(s.prefill(prompts[2:], 8, [3, 4], [40, 40], first_group=2), runner.pad_id)
        for _ in range(30):
            s.step(b)
    return b.tokens.tolist(), (s.store.captures if s.store is not None else 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_static_step_is_captured_and_replays_the_eager_static_steps_tokens(dtype):
    runner = _runner(dtype, models={"dtype": dtype, "decode_step": "static"})
    assert runner.engine.decode_step == "static"
    captured, graphs = _static_run(runner, capture=True)
    eager, none = _static_run(runner, capture=False)
    assert graphs >= 2 and none == 0  # the rows changed bucket at the compaction and the join
    assert captured == eager  # a graph replays the eager step's kernels


def test_the_captured_step_gives_the_dynamic_steps_tokens_in_float32():
    runner = _runner("float32")
    assert _static_run(runner, capture=True)[0] == _static_run(runner, capture=False, step="dynamic")[0]


def test_speculative_rejection_with_alpha_zero_is_best_of_n_under_cuda_graphs():
    base = _runner("float32", method={"name": "best_of_n", "n": 8})
    sr = Runner(config(models={"dtype": "float32"}, resources={"gpus_per_worker": 1},
                       method={"name": "speculative_rejection", "n": 8, "alpha": 0.0, "schedule": "fixed",
                               "every_k_tokens": 6}), share=base)
    items = demo_items(6)
    bon_rows, sr_rows = base.run(items), sr.run(items)
    assert any(r["stats"]["rejection_rounds"] > 0 for r in sr_rows)
    assert [[c["text"] for c in r["candidates"]] for r in sr_rows] == \
        [[c["text"] for c in r["candidates"]] for r in bon_rows]
