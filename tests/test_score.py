"""`winnow score`: given responses scored with a config's reward and judged by its verifier, without generating
(pipeline/score.py)."""

from __future__ import annotations

import json

from conftest import winnow, write_config


def _job(tmp_path, reward, verifier=None):
    models = {"target": "builtin:tiny-target", "reward": reward}
    if verifier is not None:
        models["verifier"] = verifier
    return write_config(tmp_path / "job.yaml", {
        "name": "score", "data": {"source": "unused.jsonl", "prompt_column": "question"}, "models": models,
        "method": {"name": "best_of_n", "n": 2}, "output": {"path": str(tmp_path / "run")}})


def _lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MATH = [
    {"question": "What is 2+3?", "answer": "5", "response": "2 + 3 = 5, so the answer is \\boxed{5}."},
    {"question": "What is half of one?", "answer": "1/2", "response": "The answer is 0.5."},
    {"question": "What is 7*8?", "answer": 56, "response": "7*8 = 54"},
    {"question": "What is 9-4?", "answer": None, "response": "5"},
    {"question": "What is 3*3?", "answer": 9, "response": "I do not know."},
]


def test_reference_answers_score_one_and_wrong_ones_zero_with_their_reasons(tmp_path):
    cfg = _job(tmp_path, {"kind": "math"})
    got = winnow("score", str(cfg), str(_lines(tmp_path / "r.jsonl", MATH)))
    assert got.returncode == 0, got.stderr
    out = [json.loads(x) for x in (tmp_path / "r.scores.jsonl").read_text().splitlines()]
    assert [(r["score"], r["verified"], r["reason"]) for r in out] == [
        (1.0, True, None), (1.0, True, None), (0.0, False, "wrong answer"),
        (None, None, "reward column 'answer' is null"), (0.0, False, "no answer")]
    assert out[0]["answer"] == "5" and out[2]["answer"] == "54"
    assert "verified: 2 of 4 judged (math verifier)" in got.stdout


def test_a_ranker_beside_the_verifier_gives_the_score_and_the_verifier_the_verdict(tmp_path):
    cfg = _job(tmp_path, {"kind": "logprob"}, {"kind": "math"})
    got = winnow("score", str(cfg), str(_lines(tmp_path / "r.jsonl", MATH[:3])), "--out", str(tmp_path / "o.jsonl"))
    assert got.returncode == 0, got.stderr
    out = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["verified"] for r in out] == [True, True, False]
    assert all(r["score"] < 0 for r in out)  # mean log-probabilities, not verdicts


def test_code_responses_are_run_against_their_tests_in_the_sandbox(tmp_path):
    cfg = _job(tmp_path, {"kind": "code", "timeout_s": 5})
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
    rows = [{"question": "Write add(a, b).", "tests": tests, "response": "```python\ndef add(a, b):\n    return a + b\n```"},
            {"question": "Write add(a, b).", "tests": tests, "response": "def add(a, b):\n    return a - b"},
            {"question": "Write add(a, b).", "tests": tests, "response": "import sys\nsys.exit(0)"}]
    got = winnow("score", str(cfg), str(_lines(tmp_path / "r.jsonl", rows)))
    assert got.returncode == 0, got.stderr
    out = [json.loads(x) for x in (tmp_path / "r.scores.jsonl").read_text().splitlines()]
    assert [r["verified"] for r in out] == [True, False, False]
    assert out[1]["reason"].startswith("test failed") and "add(2, 3) == 5" in out[1]["reason"]
    assert out[2]["reason"].startswith("exited before the tests ended")


def test_a_missing_column_or_a_bad_line_exits_2_naming_it_and_writes_nothing(tmp_path):
    cfg = _job(tmp_path, {"kind": "math"})
    no_answer = _lines(tmp_path / "a.jsonl", [{"question": "q", "response": "1"}])
    got = winnow("score", str(cfg), str(no_answer))
    assert got.returncode == 2 and "models.reward.answer_column: column 'answer' is in no line of" in got.stderr
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"question": "q", "answer": 1, "response": "1"}\n[1, 2]\n')
    got = winnow("score", str(cfg), str(bad))
    assert got.returncode == 2 and "line 2 is a JSON list" in got.stderr
    no_response = _lines(tmp_path / "c.jsonl", [{"question": "q", "answer": 1}])
    got = winnow("score", str(cfg), str(no_response))
    assert got.returncode == 2 and "line 1 has no 'response' string" in got.stderr
    assert "Traceback" not in got.stderr
    assert not list(tmp_path.glob("*.scores.jsonl"))
