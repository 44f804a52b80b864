"""`winnow report` on runs with a verifier: the verified rate, pass@1 and pass@k, and the cost of a pass (cost per
verified prompt) with its bootstrap interval, on hand-made runs; and runs without a verifier left as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest_runs import cand, err_row, row, write_run
from jobs.report import main
from reporting.cost import run_cost
from reporting.render import build_report
from reporting.stats import run_summary
from reporting.verified import ratio_intervals, verified_summary
from runfolder.runs import load_run, verifier_kind
from verified_rows import MATH_REWARD, MATH_VERIFIER, vcand, vrow

PRICE = 36.0  # USD per device-hour: 1 device-second = $0.01
TARGET = 1000  # target parameters: a candidate of 10 tokens costs 2 x 1000 x 10 = 20 kFLOP


def _summary(uri: str) -> dict:
    run = load_run(uri)
    cost = run_cost(run)
    return verified_summary(run, cost, run_summary(run, cost))


@pytest.fixture
def math_run(tmp_path):
    """A math reward (a verifier alone) over p1..p4; p4 errored. Two of the three prompts that ran verified."""
    return write_run(str(tmp_path / "math"), [
        vrow("p1", [vcand("a", 1.0, True), vcand("b", 0.0, False)], device_seconds=1.0),
        vrow("p2", [vcand("a", 0.0, False), vcand("b", 0.0, False)], device_seconds=2.0),
        vrow("p3", [vcand("a", 1.0, True), vcand("b", 1.0, True)], device_seconds=3.0),
        err_row("p4"),
    ], name="math", reward=MATH_REWARD, usd_per_device_hour=PRICE, parameters={"target": TARGET})


def test_which_runs_have_a_verifier(tmp_path, math_run):
    ranked = write_run(str(tmp_path / "ranked"), [vrow("p1", [vcand("a", 0.3, True)])], models=MATH_VERIFIER)
    plain = write_run(str(tmp_path / "plain"), [row("p1", [cand("a", 0.3)])])
    assert [verifier_kind(load_run(u)) for u in (math_run, ranked, plain)] == ["math", "math", None]


def test_hand_computed_cost_of_a_pass(math_run):
    v = _summary(math_run)
    assert (v["prompts_ran"], v["verified_prompts"], v["unjudged_prompts"]) == (3, 2, 0)
    assert (v["judged_candidates"], v["verified_candidates"]) == (6, 3)
    assert v["verified_rate"] == pytest.approx(2 / 3)
    # pass@1 per prompt 1/2, 0, 1; pass@2 per prompt 1, 0, 1
    assert v["pass_at_1"] == pytest.approx(0.5)
    assert v["pass_at_k"] == [{"k": 1, "value": pytest.approx(0.5)}, {"k": 2, "value": pytest.approx(2 / 3)}]
    # the prompts that ran took 1 + 2 + 3 = 6 device-seconds ($0.06) and 3 x 2 x 1000 x 20 tokens = 120 kFLOP;
    # over 2 verified prompts: $0.03, 60 kFLOP and 3 device-seconds per pass (the errored p4 is no prompt that ran)
    c = v["cost_of_a_pass"]
    assert c["no_verified_prompt"] is False
    assert c["usd"] == pytest.approx(0.03)
    assert c["flops"] == pytest.approx(60_000)
    assert c["device_seconds"] == pytest.approx(3.0)
    for unit in ("usd", "flops", "device_seconds"):
        low, high = c[f"{unit}_interval"]
        # a resample of 3 prompts draws only p2, which did not verify, with chance (1/3)^3 = 3.7% > 2.5%
        assert low <= c[unit] and high is None
    # a reward that is the verifier alone (1 or 0) makes cost per unit of reward the cost of a pass
    assert v["cost_per_unit_reward"]["usd"] == pytest.approx(0.03)
    assert v["cost_per_unit_reward"]["flops"] == pytest.approx(60_000)


def test_the_interval_is_the_ratio_over_the_same_prompt_draws():
    # every prompt costs 2 and half verify: every resample with a pass has ratio 2 x P / passes >= 2
    costs = np.array([[2.0] * 8, [4.0] * 8])
    passes = np.array([1.0, 0.0] * 4)
    got = ratio_intervals(costs, passes)
    assert got.shape == (2, 2)
    assert np.allclose(got[1], 2 * got[0])  # the two units share their draws: one ratio, twice the cost
    assert got[0, 0] >= 2.0 and got[0, 0] < 4.0 < got[0, 1]  # the point estimate, 4, lies inside
    assert np.array_equal(got, ratio_intervals(costs, passes))  # a fixed seed: the same every time


def _run_of(tmp_path, name: str, prompts: int) -> str:
    """`prompts` prompts in a repeating pattern of 4: device-seconds 1, 2, 3, 4; the first and third verify."""
    rows = []
    for i in range(prompts):
        ok = i % 4 in (0, 2)
        rows.append(vrow(f"p{i:04d}", [vcand(f"t{i}", 1.0 if ok else 0.0, ok)], device_seconds=1.0 + i % 4))
    return write_run(str(tmp_path / name), rows, name=name, reward=MATH_REWARD, usd_per_device_hour=PRICE,
                     parameters={"target": TARGET})


def test_the_interval_holds_the_point_and_shrinks_with_more_prompts(tmp_path):
    small, large = _summary(_run_of(tmp_path, "small", 16)), _summary(_run_of(tmp_path, "large", 256))
    widths = []
    for v in (small, large):
        c = v["cost_of_a_pass"]
        # (1 + 2 + 3 + 4) device-seconds per 4 prompts, 2 verified: 5 device-seconds, $0.05 per pass
        assert c["device_seconds"] == pytest.approx(5.0) and c["usd"] == pytest.approx(0.05)
        low, high = c["usd_interval"]
        assert low < c["usd"] < high
        lo, hi = v["verified_rate_interval"]
        assert v["verified_rate"] == pytest.approx(0.5) and lo < 0.5 < hi
        widths.append((high - low, hi - lo))
    assert widths[1][0] < widths[0][0] / 2 and widths[1][1] < widths[0][1] / 2  # 16x the prompts: about 1/4


def test_no_verified_prompt_is_said_not_divided(tmp_path, capsys):
    uri = write_run(str(tmp_path / "none"), [
        vrow("p1", [vcand("a", 0.0, False)]), vrow("p2", [vcand("b", 0.0, False), vcand("c", 0.0, False)]),
    ], name="none", reward=MATH_REWARD, usd_per_device_hour=PRICE, parameters={"target": TARGET})
    v = _summary(uri)
    assert v["verified_prompts"] == 0 and v["verified_rate"] == 0.0
    c = v["cost_of_a_pass"]
    assert c["no_verified_prompt"] is True
    assert all(c[u] is None and c[f"{u}_interval"] is None for u in ("usd", "flops", "device_seconds"))
    out = tmp_path / "report"
    assert main([uri, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "none (best_of_n, math verifier): 0 of 2 prompts verified" in said
    assert "cost of a pass: no verified prompt" in said
    md = (out / "report.md").read_text()
    assert "| none | best_of_n | math | 0 / 2 | 0% [0%, 0%] |" in md
    assert md.count("no verified prompt") >= 2  # compute and USD
    report = json.loads((out / "report.json").read_text())  # valid JSON: nothing divided by zero
    assert report["runs"][0]["verified"]["cost_of_a_pass"]["usd"] is None


def test_one_pass_in_many_prompts_leaves_the_interval_unbounded_above(tmp_path):
    rows = [vrow(f"p{i:02d}", [vcand("a", 1.0 if i == 0 else 0.0, i == 0)]) for i in range(20)]
    uri = write_run(str(tmp_path / "rare"), rows, name="rare", reward=MATH_REWARD, usd_per_device_hour=PRICE,
                    parameters={"target": TARGET})
    c = _summary(uri)["cost_of_a_pass"]
    assert c["usd"] == pytest.approx(0.20)  # 20 device-seconds for one pass
    low, high = c["usd_interval"]  # a resample misses the one pass with chance (19/20)^20 = 36%
    assert low <= c["usd"] and high is None


def test_a_method_that_cut_candidates_has_no_pass_at_k(tmp_path):
    uri = write_run(str(tmp_path / "sr"), [
        vrow("p1", [vcand("a", 0.9, True), vcand("b", None, None, "rejected")], cut=True),
        vrow("p2", [vcand("a", 0.2, False), vcand("b", 0.8, True)]),
    ], name="sr", method="speculative_rejection", models=MATH_VERIFIER, parameters={"target": TARGET, "reward": 10})
    v = _summary(uri)
    assert v["pass_at_1"] is None and v["pass_at_k"] is None and v["prompts_without_pass_at_1"] == 1
    assert v["verified_prompts"] == 2  # the verdict of the answers stands


def test_report_shows_the_cost_of_a_pass_beside_cost_per_unit_of_reward(tmp_path, math_run, capsys):
    # a verifier with a reward model as its ranker, and a run without a verifier, scored by the same reward model
    ranked = write_run(str(tmp_path / "ranked"), [
        vrow("p1", [vcand("a", 0.9, False), vcand("b", 0.4, True)], device_seconds=2.0, reward_tokens=20),
        vrow("p2", [vcand("a", 0.5, False)], device_seconds=2.0, reward_tokens=10),
    ], name="ranked", models=MATH_VERIFIER, usd_per_device_hour=PRICE, parameters={"target": TARGET, "reward": 500})
    plain = write_run(str(tmp_path / "plain"), [row("p1", [cand("a", 0.9)]), row("p2", [cand("a", 0.5)])],
                      name="plain", usd_per_device_hour=PRICE, parameters={"target": TARGET, "reward": 500})
    out = tmp_path / "report"
    assert main([plain, ranked, math_run, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    runs = {e["label"]: e for e in report["runs"]}
    assert "verified" not in runs["plain"]
    v = runs["ranked"]["verified"]
    # p1's answer is b (verified, though a has more reward); p2 has none: 1 of 2. Cost: 4 device-seconds = $0.04;
    # FLOPs 2 x (1000 x 30 + 500 x 30) = 90 kFLOP; per pass: $0.04 and 90 kFLOP
    assert (v["verified_prompts"], v["prompts_ran"]) == (1, 2)
    assert v["cost_of_a_pass"]["usd"] == pytest.approx(0.04)
    assert v["cost_of_a_pass"]["flops"] == pytest.approx(90_000)
    # mean best reward (0.4 + 0.5) / 2: cost per unit of reward $0.02 / 0.45
    assert v["cost_per_unit_reward"]["usd"] == pytest.approx(0.02 / 0.45)
    groups = {g["reward_kind"]: g for g in report["groups"]}
    assert groups["model"]["verified_runs"] == ["ranked"] and len(report["groups"]) == 2
    assert "cost of a pass" in report["definitions"]
    md = (out / "report.md").read_text()
    table = md.split("Verified answers")[1].split("\n\n")[2]
    assert "| ranked | best_of_n | math | 1 / 2 | 50% [" in table and "| plain |" not in table
    assert "| 90 kFLOP [" in table and "| $0.04 [" in table and f"| ${0.02 / 0.45:.3g} |" in table
    assert "ranked (best_of_n, math verifier): 1 of 2 prompts verified" in said
    assert "math (best_of_n, math verifier): 2 of 3 prompts verified, 66.7% [" in said
    assert "mean pass@1 0.5; cost of a pass: 60 kFLOP [" in said
    # on the compute basis the terminal gives compute, not measured USD (the same runs, the same words)
    assert "$" not in said.split("Verified answers")[1].split("\n\n")[0]


def test_runs_without_a_verifier_are_unchanged(tmp_path):
    a = write_run(str(tmp_path / "a"), [row("p1", [cand("x", 0.5)]), row("p2", [cand("y", 0.7)])], name="a")
    report = build_report([load_run(a)], 0)
    assert "verified" not in report["runs"][0] and report["groups"][0]["verified_runs"] == []
    assert "cost of a pass" not in report["definitions"]
    out = tmp_path / "report"
    assert main([a, "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Verified answers" not in md and "verified" not in md.lower()


def test_without_compute_a_pass_is_costed_in_device_seconds_and_usd_on_the_terminal(tmp_path, capsys):
    # no parameter counts recorded and no target folder to count: the run has no compute
    uri = write_run(str(tmp_path / "nocount"), [
        vrow("p1", [vcand("a", 1.0, True)], device_seconds=2.0),
        vrow("p2", [vcand("a", 0.0, False)], device_seconds=4.0),
    ], name="nocount", reward=MATH_REWARD, usd_per_device_hour=PRICE, models={"target": str(tmp_path / "gone")})
    out = tmp_path / "report"
    assert main([uri, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    # 6 device-seconds ($0.06) for one pass; the group is ranked by measured USD, so the terminal says USD
    assert "nocount (best_of_n, math verifier): 1 of 2 prompts verified, 50% [" in said
    assert "cost of a pass: $0.06 [" in said and "cost per unit of reward: $0.06" in said
    md = (out / "report.md").read_text()
    row_md = next(line for line in md.splitlines() if line.startswith("| nocount | best_of_n | math |"))
    assert "| 6 device-s [" in row_md and "| $0.06 [" in row_md
    assert "Compute is in device-seconds where a run has no compute" in md
    v = json.loads((out / "report.json").read_text())["runs"][0]["verified"]["cost_of_a_pass"]
    assert v["flops"] is None and v["device_seconds"] == pytest.approx(6.0)
