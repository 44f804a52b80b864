"""Verifiers in the job: each row's reference reaching the reward, the verdicts settled into rows (the best-ranked
verified answer, pass@k), the stop rule, and a python reward's rows and time limit (docs/verifiers.md)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from concurrent.futures import Future

import pytest
import verifier_fixtures
from trio_helpers import config, demo_items

from pipeline.prompts.normalise import normalise_row
from schemas.base import ConfigError
from schemas.config import DataConfig, validate_config
from tests.metered import scored
from workers.actor.runner import Runner
from workers.candidates import Candidate, settle_verdicts
from workers.scoring.items import Scored
from workers.scoring.scorers import PythonScorer
from workers.verifiers.user_function import PythonVerifier, takes_rows
from workers.verifiers.verdict import Verdict, pass_at_k, pass_at_ks


# -- pass@k and the settling of verdicts ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 1), (5, 2), (6, 6), (7, 3)])
def test_pass_at_k_is_the_chance_that_a_random_k_subset_holds_a_verified_sample(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        want = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(want)
    assert pass_at_ks(8) == [1, 2, 4, 8] and pass_at_ks(6) == [1, 2, 4, 6] and pass_at_ks(1) == [1]


def _cands(rewards, reasons=None):
    return [Candidate([1], reason or "eos", reward=r) for r, reason in zip(rewards, reasons or [None] * len(rewards))]


def test_the_answer_is_the_best_ranked_verified_candidate():
    cands = _cands([0.9, 0.5, 0.7, 0.1])
    verdicts = {0: Verdict(False, "wrong answer", "3"), 1: Verdict(True, None, "4"), 2: Verdict(True, None, "4"),
                3: Verdict(False, "no answer")}
    best, stats = settle_verdicts(cands, verdicts, as_reward=False)
    assert best == 2  # 0.9 is the ranker's best, but it did not verify
    assert stats["best_verified"] is True and stats["verified_candidates"] == 2 and stats["judged_candidates"] == 4
    assert stats["pass_at_1"] == 0.5 and stats["pass_at_k"][-1] == {"k": 4, "value": 1.0}
    assert (cands[0].verified, cands[0].answer, cands[0].verifier_reason) == (False, "3", "wrong answer")
    assert (cands[2].verified, cands[2].verifier_reason) == (True, None)


def test_with_none_verified_the_answer_is_the_rankers_best_and_the_row_says_so():
    cands = _cands([0.2, 0.8])
    best, stats = settle_verdicts(cands, {0: Verdict(False, "wrong answer"), 1: Verdict(False, "timeout")}, False)
    assert best == 1 and stats["best_verified"] is False and stats["verified_candidates"] == 0
    assert stats["pass_at_1"] == 0.0


def test_a_verifier_as_the_reward_gives_one_or_zero_and_picks_a_verified_candidate():
    cands = _cands([None, None, None])
    best, stats = settle_verdicts(cands, {0: Verdict(False, "x"), 1: Verdict(True), 2: Verdict(True)}, True)
    assert [c.reward for c in cands] == [0.0, 1.0, 1.0] and best == 1 and stats["best_verified"] is True


def test_pass_at_k_is_left_out_where_candidates_were_cut():
    cands = _cands([0.1, None, 0.3], [None, "rejected", None])
    best, stats = settle_verdicts(cands, {0: Verdict(True), 2: Verdict(False, "x")}, False)
    assert best == 0 and stats["pass_at_1"] is None and stats["pass_at_k"] is None
    assert stats["judged_candidates"] == 2 and cands[1].verified is None


def test_a_method_that_does_not_rank_keeps_its_own_answer():
    cands = _cands([None, None])
    best, stats = settle_verdicts(cands, {0: Verdict(False, "x"), 1: Verdict(True)}, False, own_best=0, ranks=False)
    assert best == 0 and stats["best_verified"] is False


# -- the config ----------------------------------------------------------------------------------------------------

BASE = {"name": "t", "data": {"source": "x.jsonl"}, "models": {"target": "t", "reward": {"kind": "math"}},
        "method": {"name": "best_of_n", "n": 4}, "output": {"path": "runs/x"}}


def _problems(**over):
    cfg = {**BASE, **over}
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    return err.value.problems


def test_a_verifier_cannot_decide_on_partial_responses_nor_stand_twice_nor_stop_without_being_there():
    assert "kind 'math' is a verifier, which cannot score a partial response" in \
        _problems(method={"name": "speculative_rejection", "n": 8})[0]
    assert "kind 'math' is a verifier, which cannot score a partial response" in _problems(method={"name": "cdlh"})[0]
    assert _problems(models={"target": "t", "reward": {"kind": "math"}, "verifier": {"kind": "code"}})[0].startswith(
        "models.verifier: the reward is a verifier already (kind 'math')")
    assert _problems(models={"target": "t", "reward": {"kind": "logprob"}},
                     method={"name": "best_of_n", "n": 4, "stop_after_verified": 1}) == [
        "method.stop_after_verified: needs a verifier (models.verifier, or a math or code reward)"]
    assert _problems(method={"name": "best_of_n", "n": 4, "stop_after_verified": 5}) == [
        "method.stop_after_verified: 5 is more than method.n (4)"]


def test_the_columns_that_travel_are_the_rewards_and_the_verifiers_once_each():
    cfg = validate_config({**BASE, "models": {"target": "t", "reward": {"kind": "python", "function": "m:f",
                                                                        "columns": ["a", "b"]},
                                              "verifier": {"kind": "code", "tests_column": "a"}}})
    assert cfg.reward_columns == ["a", "b"]
    assert cfg.reward_column_fields() == [("models.reward.columns", "a"), ("models.reward.columns", "b"),
                                          ("models.verifier.tests_column", "a")]
    assert validate_config(BASE).reward_columns == ["answer"] and validate_config(BASE).verifier.kind == "math"


def test_new_fields_at_their_defaults_keep_a_configs_hash():
    plain = {**BASE, "models": {"target": "t", "reward": {"kind": "python", "function": "m:f"}}}
    spelled = {**plain, "models": {"target": "t", "verifier": None,
                                   "reward": {"kind": "python", "function": "m:f", "columns": [], "timeout_s": 120}},
               "method": {"name": "best_of_n", "n": 4, "stop_after_verified": None, "verdict_lag_steps": 8}}
    assert validate_config(plain).hash() == validate_config(spelled).hash() == "2bf251b4d95a49e0"  # its hash before these fields existed


# -- columns from the data -----------------------------------------------------------------------------------------

def test_a_rows_reward_columns_travel_as_json_and_a_null_one_makes_an_error_row_naming_it():
    data = DataConfig(source="x")
    row = normalise_row({"prompt": "2+2?", "answer": 4, "tests": ["assert f(1) == 2"]}, data, None,
                        ("answer", "tests"))
    assert row["columns"] == '{"answer": 4, "tests": ["assert f(1) == 2"]}' and row["input_error"] is None
    bad = normalise_row({"prompt": "2+2?", "answer": None}, data, None, ("answer",))
    assert bad["input_error"] == "reward column 'answer' is null" and bad["columns"] is None
    assert normalise_row({"prompt": "2+2?"}, data, None, ("answer",))["input_error"] == \
        "reward column 'answer' is null"
    assert normalise_row({"prompt": "2+2?"}, data, None)["columns"] is None


# -- a python reward's rows and its time limit ---------------------------------------------------------------------

def _items(texts, rows=None):
    return [Scored(0, [{"role": "user", "content": "q"}], t, [1], [2], row=None if rows is None else rows[i])
            for i, t in enumerate(texts)]


def test_a_python_reward_is_handed_the_rows_by_its_signature():
    assert not takes_rows(verifier_fixtures.length_reward) and takes_rows(verifier_fixtures.rows_reward)
    assert not takes_rows(verifier_fixtures.reward_with_default)
    assert scored(PythonScorer("verifier_fixtures:length_reward"), _items(["ab", "abc"])) == [2.0, 3.0]
    verifier_fixtures.SEEN.clear()
    got = scored(PythonScorer("verifier_fixtures:rows_reward", columns=["weight"]),
                 _items(["ab", "abc"], [{"weight": 2}, {"weight": 10}]))
    assert got == [4.0, 30.0] and verifier_fixtures.SEEN == [[{"weight": 2}, {"weight": 10}]]
    assert scored(PythonScorer("verifier_fixtures:reward_with_default"), _items(["a"])) == [2.0]
    with pytest.raises(ValueError, match=r"models.reward.function: verifier_fixtures:rows_reward takes rows \(a third "
                                         r"parameter\), but models.reward.columns names no dataset column"):
        PythonScorer("verifier_fixtures:rows_reward")


def test_a_python_reward_that_hangs_fails_at_its_time_limit_naming_it():
    scorer = PythonScorer("verifier_fixtures:hangs", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^models.reward.function: verifier_fixtures:hangs did not return within "
                                           r"0.5 s \(1 texts; models.reward.timeout_s\)"):
        scorer(_items(["a"]))
    assert time.monotonic() - started < 5


def test_a_process_whose_python_reward_hung_still_exits():
    """The hung call's thread cannot be stopped; it must not hold the process at exit (a thread pool's would)."""
    program = ("from workers.verifiers.user_function import UserFunction\n"
               "fn = UserFunction('verifier_fixtures:hangs', 'models.reward.function', 0.2, [])\n"
               "try:\n    fn([[]], ['a'], [{}])\nexcept RuntimeError as err:\n    print(err)\n")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "did not return within 0.2 s" in done.stdout, done


def test_a_python_verifier_judges_beside_the_caller_and_refuses_what_is_not_a_verdict():
    v = PythonVerifier("verifier_fixtures:contains_word", 5.0, ["word"])
    futures = [v.submit(t, {"word": "cat"}, [{"role": "user", "content": "q"}]) for t in ("a cat", "a dog")]
    assert all(isinstance(f, Future) for f in futures)
    assert [f.result() for f in futures] == [Verdict(True), Verdict(False, "rejected by the function")]
    bad = PythonVerifier("verifier_fixtures:not_a_verdict", 5.0, [])
    with pytest.raises(RuntimeError, match="a verifier returns True or False for each text"):
        bad.submit("x", {}).result()
    v.close()
    bad.close()


# -- verdicts in the pool, on the tiny trio ------------------------------------------------------------------------

def _rows(method: dict, function: str = "verifier_fixtures:contains_word", limit: int = 4) -> list[dict]:
    items = demo_items(limit)
    for it in items:
        it["columns"] = {"word": "the"}
    cfg = config(models={"target": "builtin:tiny-target", "reward": {"kind": "logprob"},
                         "verifier": {"kind": "python", "function": function, "columns": ["word"]}},
                 method=method, generation={"max_new_tokens": 32})
    return Runner(cfg).run(items)


@pytest.fixture(scope="module")
def best_of_8():
    return _rows({"name": "best_of_n", "n": 8})


def test_best_of_n_with_a_verifier_answers_with_a_verified_candidate_and_counts_them(best_of_8):
    assert any(not c["verified"] for row in best_of_8 for c in row["candidates"])  # the check is not vacuous
    for row in best_of_8:
        cands = row["candidates"]
        verified = [i for i, c in enumerate(cands) if c["verified"]]
        st = row["stats"]
        assert st["judged_candidates"] == 8 and st["verified_candidates"] == len(verified)
        assert st["pass_at_1"] == pytest.approx(len(verified) / 8)
        assert all(("the" in c["text"]) == c["verified"] for c in cands)
        if verified:
            assert st["best_verified"] and row["best_index"] == max(verified, key=lambda i: (cands[i]["reward"], -i))
        else:
            assert st["best_verified"] is False


def test_stopping_once_one_verified_keeps_the_verified_prompts_for_fewer_tokens(best_of_8):
    stopped = _rows({"name": "best_of_n", "n": 8, "stop_after_verified": 1, "verdict_lag_steps": 0})
    assert [r["stats"]["best_verified"] for r in stopped] == [r["stats"]["best_verified"] for r in best_of_8]
    assert sum(r["stats"]["generated_tokens"] for r in stopped) < sum(r["stats"]["generated_tokens"] for r in best_of_8)
    for row, full in zip(stopped, best_of_8):
        assert row["stats"]["pass_at_1"] is None or all(c["finish_reason"] != "rejected" for c in row["candidates"])
        for c, f in zip(row["candidates"], full["candidates"]):  # a sample does not depend on who else was cut
            assert f["text"].startswith(c["text"]) or c["finish_reason"] == "rejected"
            if c["finish_reason"] != "rejected":
                assert c["text"] == f["text"] and c["verified"] == f["verified"]


def test_the_stop_rule_counts_a_verdict_at_its_step_however_late_it_arrives():
    method = {"name": "best_of_n", "n": 8, "stop_after_verified": 1, "verdict_lag_steps": 2}
    fast = _rows(method)
    slow = _rows(method, "verifier_fixtures:slow_contains_word")
    strip = lambda rows: [[(c["text"], c["finish_reason"], c["verified"]) for c in r["candidates"]] for r in rows]
    assert strip(fast) == strip(slow)
    assert any(c["finish_reason"] == "rejected" for r in fast for c in r["candidates"])


def test_speculative_rejection_ranks_partials_and_verifies_the_finished_ones():
    rows = _rows({"name": "speculative_rejection", "n": 8})
    for row in rows:
        cands = row["candidates"]
        assert any(c["finish_reason"] == "rejected" for c in cands)
        assert all((c["verified"] is None) == (c["finish_reason"] == "rejected") for c in cands)
        assert row["stats"]["pass_at_1"] is None  # a cut sample is not a fair one
        assert row["stats"]["judged_candidates"] == sum(c["finish_reason"] != "rejected" for c in cands)


@pytest.mark.parametrize("method", [{"name": "greedy"}, {"name": "beam", "num_beams": 2}])
def test_a_single_answer_method_keeps_its_answer_and_says_whether_it_verified(method):
    for row in _rows(method):
        best = row["candidates"][row["best_index"]]
        assert row["stats"]["best_verified"] == best["verified"] == ("the" in best["text"])


def test_the_word_problems_are_what_their_generator_writes_and_their_answers_are_right():
    from assets import word_problems

    assert word_problems.PATH.read_text() == word_problems.text(), "regenerate: python -m assets.word_problems"
    rows = word_problems.problems()
    assert len(rows) == word_problems.COUNT == len({r["prompt"] for r in rows})
    for r in rows:  # each answer is what its numbers make: recomputed from the text
        words = r["prompt"].replace("?", " ").replace(".", " ").split()
        nums = [int(w) for w in words if w.isdigit()]
        text = r["prompt"]
        if "gives away" in text:
            want = nums[0] + nums[1] - nums[2]
        elif "in each" in text:
            want = nums[0] * nums[1]
        elif any(k in text for k in ("gives", "takes", "lost")):
            want = nums[0] - nums[1]
        else:
            want = nums[0] + nums[1]
        assert r["answer"] == want and 0 <= want <= 200, r


# -- through the CLI: the columns reach the actors, a missing one is refused before anything loads -----------------

def _column_job(tmp_path, reward: dict, rows: list[dict], verifier: dict | None = None) -> "Path":
    from conftest import job_config, write_config, write_jsonl

    src = write_jsonl(tmp_path / "p.jsonl", rows)
    models = {"target": "builtin:tiny-target", "reward": reward, **({"verifier": verifier} if verifier else {})}
    return write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"source": str(src), "limit": None}, models=models, method={"name": "best_of_n", "n": 2}))


def test_a_missing_reference_column_exits_2_naming_it_before_any_model_loads(tmp_path):
    from conftest import winnow

    cfg = _column_job(tmp_path, {"kind": "logprob"}, [{"id": "a", "prompt": "Add 2 and 3.", "solution": 5}],
                      {"kind": "math"})  # answer_column: answer, which the data lacks
    for command in ("validate", "generate"):
        got = winnow(command, str(cfg))
        assert got.returncode == 2, got.stderr
        assert "models.verifier.answer_column: column 'answer' is not in" in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_python_reward_that_takes_rows_gets_its_rows_columns_in_the_actor(tmp_path):
    import os

    from conftest import ROOT, winnow
    from runfolder.runs import load_run

    cfg = _column_job(tmp_path, {"kind": "python", "function": "verifier_fixtures:rows_reward", "columns": ["weight"]},
                      [{"id": "a", "prompt": "Write about a dog.", "weight": 2, "other": "x"},
                       {"id": "b", "prompt": "Write about a cat.", "weight": 10},
                       {"id": "c", "prompt": "Write about a cow.", "weight": None}])
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    got = winnow("generate", str(cfg), env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    rows = {r["prompt_id"]: r for r in load_run(str(tmp_path / "run")).rows}
    for pid, weight in (("a", 2), ("b", 10)):  # rows_reward: weight x the response's length
        assert all(c["reward"] == weight * len(c["text"]) for c in rows[pid]["candidates"])
    assert rows["c"]["error"] == "reward column 'weight' is null" and rows["c"]["candidates"] == []
