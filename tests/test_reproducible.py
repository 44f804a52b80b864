"""A run is a function of its config and seed (SPEC: the same config gives the same rows however the prompts were
timed): each actor call decodes on its own (resources.feed_calls off, the default), so a prompt's sequences share
their forwards only with its own call's, whatever Ray's timing; draws are keyed per prompt and candidate.

The same calls, made one after another, from two threads at once, and with delays injected into the decoding steps,
give identical rows, bit for bit: on the bundled trio for every candidate-pool method, and on SmolLM2-135M-Instruct
(the `real` extra) with the logprob reward.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from assets import smollm2
from pipeline.preflight import resolved
from schemas.config import validate_config
from tests.trio_helpers import BASE, config, demo_items, merge
from workers.actor.runner import Runner
from workers.decoding.target import TargetSampler


def exact(rows: list[dict]) -> list:
    """Everything a row says, less the seconds."""
    return [{k: ({c: v for c, v in r[k].items() if not c.endswith("_seconds")} if k == "cost" else r[k]) for k in r}
            for r in rows]


def one_after_another(runner: Runner, calls: list[list[dict]]) -> list[dict]:
    return [row for call in calls for row in runner.run(call)]


def two_threads_with_delays(runner: Runner, calls: list[list[dict]], seed: int) -> list[dict]:
    """Each call from its own thread, two at a time, the second started a random moment after the first, every
    decoding step slowed by a random few milliseconds."""
    rng = random.Random(seed)
    out: dict[int, list[dict]] = {}
    step = TargetSampler.step

    def slow(self, batch):
        time.sleep(rng.random() * 0.004)
        return step(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TargetSampler, "step", slow)
        for i in range(0, len(calls), 2):
            threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, runner.run(calls[k])))
                       for k in range(i, min(i + 2, len(calls)))]
            for t in threads:
                t.start()
                time.sleep(rng.random() * 0.05)
            for t in threads:
                t.join(300)
    return [row for k in range(len(calls)) for row in out[k]]


@pytest.mark.parametrize("method", [
    {"name": "best_of_n", "n": 8},
    {"name": "speculative_rejection", "n": 16, "alpha": 0.5},  # the memory schedule
    {"name": "speculative_rejection", "n": 16, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 4},
    {"name": "nucleus"},
])
def test_the_same_calls_give_the_same_rows_however_they_are_timed(method):
    items = demo_items(8)
    calls = [items[i: i + 2] for i in range(0, 8, 2)]
    cfg = config(method=method, generation={"max_new_tokens": 24}, resources={"prompts_per_batch": 2})
    runner = Runner(cfg)
    want = exact(one_after_another(runner, calls))
    assert exact(two_threads_with_delays(runner, calls, seed=1)) == want
    assert exact(two_threads_with_delays(runner, calls, seed=2)) == want
    assert exact(one_after_another(Runner(cfg, share=runner), calls)) == want
    if method["name"] == "speculative_rejection":
        assert any(r["stats"]["rejection_rounds"] for r in want)


@pytest.mark.slow
@pytest.mark.skipif(smollm2.unavailable() is not None, reason=smollm2.unavailable() or "")
def test_smollm2_gives_the_same_rows_three_times_however_the_calls_are_timed():
    import assets

    raw = merge(BASE, {"models": {"target": "builtin:smollm2-135m-instruct", "reward": {"kind": "logprob"}},
                       "method": {"name": "best_of_n", "n": 8}, "generation": {"max_new_tokens": 24},
                       "resources": {"prompts_per_batch": 2}})
    cfg = resolved(validate_config(raw), on_node=True)
    items = [it for it in assets.prompt_items("real-prompts") if "concepts" not in it][:4]
    calls = [items[:2], items[2:]]
    runner = Runner(cfg)
    first = exact(one_after_another(runner, calls))
    assert exact(two_threads_with_delays(runner, calls, seed=3)) == first
    assert exact(two_threads_with_delays(runner, calls, seed=4)) == first
    assert len({c["text"] for r in first for c in r["candidates"]}) > 4  # sampled, not all one
