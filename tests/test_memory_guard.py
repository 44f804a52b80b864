"""The memory guard of a batch (workers/engines/hf.py): a batch that would not fit is decoded in groups that do,
with the
same tokens; one prompt that cannot fit alone fails the batch with a message before anything is allocated."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import job_config, winnow, write_config
from tests.trio_helpers import config, demo_items
from workers.engines.hf import BatchTooLarge, batch_memory_need
from workers.actor.runner import Runner


def comparable(rows: list[dict]) -> list:
    """What a split must not change: the sampled texts (exactly) and their rewards (up to float noise: the reward
    model scores other batch shapes)."""
    return [(r["prompt_id"], r["best_index"], [(c["text"], pytest.approx(c["reward"], abs=1e-5))
                                               for c in r["candidates"]]) for r in rows]


def test_the_estimate_for_a_7b_llama_shape():
    kv = 2 * 32 * 32 * 128 * 2  # K and V x 32 layers x 32 KV heads x head dim 128 x bfloat16: 512 KiB a token
    need = batch_memory_need(rows=64, prompt_tokens=512, new_tokens=512, kv_bytes_per_token=kv, vocab=32000)
    # 1,024 columns a sequence, held with a quarter of headroom (1,280), in every one of the 64 sequences
    assert need == 64 * 1280 * kv + 64 * (8 * 1024 + 12 * 32000)
    assert 40 < need / 2**30 < 41  # 64 candidates of 1k tokens: 40 GiB of cache at its peak
    shared = batch_memory_need(rows=64, prompt_tokens=512, new_tokens=512, kv_bytes_per_token=kv, vocab=32000,
                               shared_prompt=True)
    # the prompt's 512 columns once, then each sequence's 512 new columns with their headroom (640)
    assert shared == (512 + 64 * 640) * kv + 64 * (8 * 1024 + 12 * 32000)
    assert 20 < shared / 2**30 < 21


def test_a_batch_too_large_for_memory_is_split_with_identical_results():
    cfg = config(method={"name": "best_of_n", "n": 6}, generation={"max_new_tokens": 12},
                 resources={"prompts_per_batch": 3})
    items = demo_items(3)
    whole = Runner(cfg)
    prompts = [p for _, p in whole.prepare(items)[0]]
    assert len(whole.engine.memory_chunks(prompts, whole.params)) == 1  # it fits this machine as one batch
    expected = whole.run(items)
    split = Runner(cfg)
    ready, _ = split.prepare(items)
    # room for one prompt at a time
    split.engine.kv_space_bytes = max(split.engine.memory_need(p, split.params) for _, p in ready) + 1
    assert [len(g) for g in split.engine.memory_chunks([p for _, p in ready], split.params)] == [1, 1, 1]
    got = split.run(items)
    assert comparable(got) == comparable(expected)
    assert all(r["cost"]["target_tokens"] > 0 for r in got)


def test_a_prompt_that_cannot_fit_alone_is_refused_before_it_allocates():
    runner = Runner(config(method={"name": "best_of_n", "n": 65536}, generation={"max_new_tokens": 64}))
    ready, _ = runner.prepare(demo_items(1))
    runner.engine.kv_space_bytes = runner.engine.memory_need(ready[0][1], runner.params) - 1
    with pytest.raises(BatchTooLarge) as err:
        runner.run(demo_items(1))
    message = str(err.value)
    assert message.startswith(f"prompt {ready[0][1].prompt_id!r}: best_of_n would hold about ")
    assert "lower method.n (or num_beams) or generation.max_new_tokens" in message


@pytest.mark.slow
def test_best_of_n_at_the_schema_maximum_fails_loudly_instead_of_exhausting_the_machine(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"limit": 1}, method={"name": "best_of_n", "n": 65536}, generation={"max_new_tokens": 1024}))
    out = winnow("generate", str(cfg))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "best_of_n would hold about" in out.stderr and "GiB" in out.stderr, out.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "best_of_n would hold about" in manifest["error"]


def test_an_actor_that_shares_a_gpu_is_sized_to_its_share(monkeypatch):
    """Issue 29: resources.gpus_per_worker below 1 packs several actors on one GPU; each hf engine takes its share of
    the device's memory less its own models (not the device's whole free memory), each vLLM engine its share of
    vLLM's 0.9, and a share the models alone fill is refused naming the field. Checked without a GPU: torch.cuda's
    readings stand in."""
    from types import SimpleNamespace

    import workers.accounting.memory as memory
    from workers.engines.hf import MEMORY_FRACTION, BatchTooLarge, HfEngine

    gib = 2**30
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "H100")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * gib)  # this actor's models
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 2 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 * gib, 80 * gib))  # other actors hold the rest
    assert memory.share_bytes(cuda, 0.25) == 18 * gib  # a quarter of 80 GiB, less its own 2
    assert memory.share_bytes(cuda, 1.0) is None and memory.share_bytes(torch.device("cpu"), 0.25) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * gib, 80 * gib))
    assert memory.share_bytes(cuda, 0.25) == 10 * gib  # never more than is free

    def engine(share):
        config = SimpleNamespace(models=SimpleNamespace(kv_space_mb=None), resources=SimpleNamespace(
            gpus_per_worker=share))
        return SimpleNamespace(kv_space_bytes=None, config=config, device=cuda)

    assert HfEngine.kv_space(engine(0.25)) == int(10 * gib * MEMORY_FRACTION)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 30 * gib)
    with pytest.raises(BatchTooLarge, match=r"resources.gpus_per_worker: 0.25 of this GPU \(H100, 80.0 GiB\)"):
        HfEngine.kv_space(engine(0.25))
