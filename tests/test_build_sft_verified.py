"""`winnow build-sft` on runs with a verifier: verified answers only by default, `--include-unverified`, up to k
distinct verified answers with `--select top-k=K`, `--min-reward` on the ranker's reward, the dataset card's counts,
and runs with and without a verifier given together."""

from __future__ import annotations

import os
import uuid

import pyarrow.parquet as pq
import pytest

from conftest_runs import cand, row, write_run
from jobs.build_sft import main
from verified_rows import MATH_REWARD, MATH_VERIFIER, vcand, vrow


@pytest.fixture
def ranked(tmp_path):
    """A verifier (math) with a reward model as its ranker over p1..p3. p1: the ranker's best (w1) did not verify, two
    others did, one of them twice; p2: nothing verified; p3: one verified, one verified but truncated."""
    return write_run(str(tmp_path / "ranked"), [
        vrow("p1", [vcand("w1", 0.9, False), vcand("v1", 0.6, True), vcand("v2", 0.4, True), vcand("v1", 0.6, True),
                    vcand("w2", 0.3, False)]),
        vrow("p2", [vcand("x1", 0.8, False), vcand("x2", 0.2, False)]),
        vrow("p3", [vcand("y1", 0.1, True), vcand("y2", 0.7, True, "length"), vcand("y3", None, None, "rejected")]),
    ], name="ranked", models=MATH_VERIFIER)


def build(tmp_path, runs, *flags) -> tuple[int, list[dict], str]:
    out = str(tmp_path / f"out-{uuid.uuid4().hex[:6]}")
    code = main([*runs, "--out", out, *flags])
    rows = pq.read_table(os.path.join(out, "data")).to_pylist() if code == 0 else []
    return code, rows, out


def pick(rows) -> dict[str, list[tuple[str, float, bool | None]]]:
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(r["prompt_id"], []).append((r["completion"][0]["content"], r["reward"], r["verified"]))
    return out


def test_only_verified_answers_by_default(tmp_path, ranked, capsys):
    code, rows, out = build(tmp_path, [ranked])
    assert code == 0
    # p1: v1, the verified candidate the ranker likes best, not w1 (more reward, not verified); p2 left out
    assert pick(rows) == {"p1": [("v1", 0.6, True)], "p3": [("y1", 0.1, True)]}
    said = capsys.readouterr().out
    assert "dropped 4 candidate(s): unverified" in said  # w1, w2, x1, x2 (y3 is dropped as rejected first)
    assert "left out 1 prompt(s) as unverified" in said
    card = open(os.path.join(out, "README.md")).read()
    assert "- prompts left out as unverified (no candidate verified): 1" in card
    assert "- examples that did not verify (`--include-unverified`): 0" in card
    assert "| its run has a verifier and the candidate did not verify; see --include-unverified (`unverified`) | 4 |" \
        in card
    assert "only candidates that verified" in card


def test_include_unverified_adds_the_others_after_the_verified(tmp_path, ranked):
    code, rows, out = build(tmp_path, [ranked], "--include-unverified")
    assert code == 0
    # p1 still takes a verified answer first; p2, with none, takes the ranker's best
    assert pick(rows) == {"p1": [("v1", 0.6, True)], "p2": [("x1", 0.8, False)], "p3": [("y1", 0.1, True)]}
    card = open(os.path.join(out, "README.md")).read()
    assert "`--include-unverified`" in card.split("- rule:")[1].split("\n")[0]
    assert "- examples that did not verify (`--include-unverified`): 1" in card
    _, rows, _ = build(tmp_path, [ranked], "--include-unverified", "--select", "top-k=3")
    assert pick(rows)["p1"] == [("v1", 0.6, True), ("v2", 0.4, True), ("w1", 0.9, False)]


def test_top_k_keeps_up_to_k_distinct_verified_answers(tmp_path, ranked):
    code, rows, _ = build(tmp_path, [ranked], "--select", "top-k=3")
    assert code == 0
    got = pick(rows)
    # v1 twice is one answer; w1 and w2 did not verify: two distinct verified answers, though k is 3
    assert got["p1"] == [("v1", 0.6, True), ("v2", 0.4, True)]
    assert "p2" not in got
    _, rows, _ = build(tmp_path, [ranked], "--select", "top-k=3", "--include-truncated")
    assert pick(rows)["p3"] == [("y2", 0.7, True), ("y1", 0.1, True)]


def test_min_reward_applies_to_the_rankers_reward(tmp_path, ranked):
    code, rows, _ = build(tmp_path, [ranked], "--select", "top-k=3", "--min-reward", "0.5")
    assert code == 0
    assert pick(rows) == {"p1": [("v1", 0.6, True)]}  # v2 (0.4) and y1 (0.1) are below; w1 (0.9) did not verify


def test_a_math_reward_keeps_its_verified_answers(tmp_path):
    uri = write_run(str(tmp_path / "math"), [
        vrow("p1", [vcand("a", 0.0, False), vcand("b", 1.0, True)]), vrow("p2", [vcand("c", 0.0, False)]),
    ], name="math", reward=MATH_REWARD)
    code, rows, _ = build(tmp_path, [uri])
    assert code == 0 and pick(rows) == {"p1": [("b", 1.0, True)]}


def test_nothing_verified_exits_2_naming_the_reason(tmp_path, capsys):
    uri = write_run(str(tmp_path / "none"), [vrow("p1", [vcand("a", 0.0, False)])], name="none", reward=MATH_REWARD)
    code, _, out = build(tmp_path, [uri])
    err = capsys.readouterr().err
    assert code == 2 and not os.path.exists(out)
    assert "no candidate passed the selection" in err and "unverified=1" in err


def test_runs_with_and_without_a_verifier_pool_only_with_the_flag(tmp_path, ranked, capsys):
    plain = write_run(str(tmp_path / "plain"), [row("p1", [cand("z", 0.95)]), row("p2", [cand("x1", 0.8)])],
                      name="plain")
    code, _, out = build(tmp_path, [ranked, plain])
    err = capsys.readouterr().err
    assert code == 2 and not os.path.exists(out)
    assert f"runs with a verifier (ranked ({ranked}))" in err and f"runs without one (plain ({plain}))" in err
    assert "--include-unverified" in err
    code, rows, out = build(tmp_path, [ranked, plain], "--include-unverified")
    assert code == 0
    got = pick(rows)
    # p1: the verified v1 before plain's z, which nobody checked (null), though z has more reward
    assert got["p1"] == [("v1", 0.6, True)]
    # p2: the text x1 in both runs is one candidate; the verifier run's copy (not verified) has the same reward
    assert got["p2"] == [("x1", 0.8, False)]
    card = open(os.path.join(out, "README.md")).read()
    assert "- source runs with a verifier: ranked" in card


def test_runs_without_a_verifier_are_unchanged(tmp_path):
    plain = write_run(str(tmp_path / "plain"), [row("p1", [cand("z", 0.95), cand("y", 0.1)])], name="plain")
    code, rows, out = build(tmp_path, [plain], "--select", "top-k=2")
    assert code == 0 and pick(rows) == {"p1": [("z", 0.95, None), ("y", 0.1, None)]}
    card = open(os.path.join(out, "README.md")).read()
    assert "verified: " not in card and "left out as unverified" not in card and "only candidates that verified" \
        not in card
