"""`winnow report`: paper 001's improvement score (eq. 8) and relative compute (eq. 7) on hand-made runs, reward per
USD, the cost-reward frontier and its bootstrap intervals on runs whose frontier is known, the plots' marks,
partial/final reward correlation, the files it writes, and bad input."""

from __future__ import annotations

import io
import json
import os
import uuid

import matplotlib.image as mpimg
import pytest
from PIL import Image

import numpy as np

from conftest_runs import (FRONTIER_PRICE, FRONTIER_SPREAD, cand, err_row, frontier_runs, row,  # noqa: F401
                           s3_endpoint, synthetic_runs, write_run)
from jobs.report import main
from reporting import plots
from reporting.cost import run_cost
from reporting.frontier import Point, frontier, within_intervals
from reporting.render import build_report
from reporting.stats import bootstrap_intervals, compare, correlations, improvement_score, mean_interval, run_summary
from runfolder.runs import load_run
from schemas.base import InputError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_a_row_that_ran_without_a_cost_is_refused_by_name(tmp_path):
    good = row("p1", [cand("a", 0.5)])
    broken = row("p2", [cand("b", 0.4)])
    broken["cost"]["device_seconds"] = None
    uri = write_run(str(tmp_path / "r"), [good, broken])
    with pytest.raises(InputError, match=r"1 row\(s\) without an error have a null cost .*'p2'"):
        load_run(uri)


def test_improvement_score_equation_8():
    z = [0.0, 1.0, 2.0, 4.0]
    assert improvement_score(4.0, z) == 100.0
    assert improvement_score(0.0, z) == 0.0
    assert improvement_score(3.0, z) == pytest.approx(75.0)
    assert improvement_score(5.0, z) == pytest.approx(125.0)  # not clipped
    assert improvement_score(-2.0, z) == pytest.approx(-50.0)
    assert improvement_score(1.0, [1.0, 1.0]) is None  # max = min: undefined


@pytest.fixture
def hand_runs(tmp_path):
    """A baseline and a run over p1..p5 with numbers simple enough to compute by hand (see the test)."""
    base = write_run(str(tmp_path / "base"), [
        row("p1", [cand("a", 0.0), cand("b", 1.0), cand("c", 2.0)], device_seconds=2.0),
        row("p2", [cand("a", 1.0), cand("b", 3.0), cand("r", None, "rejected", partial=[9.0])], device_seconds=4.0),
        row("p3", [cand("a", 1.0), cand("b", 1.0)], device_seconds=2.0),
        err_row("p4"),
        row("p6", [cand("a", 5.0)], device_seconds=1.0),
    ], name="base", usd_per_device_hour=36.0, parameters={"target": 1000})
    run = write_run(str(tmp_path / "run"), [
        row("p1", [cand("x", 1.5)], device_seconds=1.0),
        row("p2", [cand("x", 4.0), cand("y", 0.0, "length")], device_seconds=1.0),
        row("p3", [cand("x", 2.0)], device_seconds=4.0),
        row("p4", [cand("x", 7.0)], device_seconds=1.0),
        row("p5", [cand("x", 9.0)], device_seconds=1.0),
    ], name="run", method="speculative_rejection", usd_per_device_hour=36.0, parameters={"target": 1000})
    return load_run(base), load_run(run)


def _compare(run, base):
    return compare(run, base, run_cost(run), run_cost(base))


def test_run_against_itself_scores_100_and_relative_compute_1(hand_runs):
    base, _ = hand_runs
    v = _compare(base, base)
    assert v["improvement_score"] == pytest.approx(100.0)
    assert v["relative_compute"] == pytest.approx(1.0) and v["relative_flops"] == pytest.approx(1.0)
    assert v["relative_compute_mean_of_ratios"] == pytest.approx(1.0)
    # p3 (rewards 1, 1) and p6 (one candidate) have max = min, so they are left out of the score.
    assert v["improvement_score_prompts"] == 2 and v["improvement_score_excluded_equal_rewards"] == 2


def test_hand_computed_run_against_baseline(hand_runs):
    base, run = hand_runs
    v = _compare(run, base)
    # Matched (no error in both): p1, p2, p3. p4 errored in the baseline, p5 and p6 are in one run only.
    assert v["matched_prompts"] == 3
    # p1: Z = {0,1,2}, Y = 1.5 -> 100(1 - 0.5/2) = 75. p2: Z = {1,3} (the rejected one has no reward), Y = 4
    # -> 100(1 + 1/2) = 150. p3: Z = {1,1} -> left out. Mean (75 + 150) / 2.
    assert v["improvement_score"] == pytest.approx(112.5)
    assert v["improvement_score_excluded_equal_rewards"] == 1
    # Relative compute: (1 + 1 + 4) / (2 + 4 + 2) = 0.75; per-prompt ratios (0.5, 0.25, 2) average to 0.91666.
    assert v["relative_compute"] == pytest.approx(0.75)
    assert v["relative_compute_mean_of_ratios"] == pytest.approx(2.75 / 3)
    # Gains over the baseline's single-sample reward: p1 1.5 - 1 = 0.5, p2 4 - 2 = 2, p3 2 - 1 = 1; mean 7/6.
    assert v["baseline_single_sample_reward"] == pytest.approx((1 + 2 + 1) / 3)
    assert v["mean_reward_gain"] == pytest.approx(3.5 / 3)
    # USD per prompt over p1..p3: mean 2 device-seconds at $36/hour = $0.02.
    assert v["usd_per_prompt_matched"] == pytest.approx(0.02)
    assert v["reward_gain_per_usd"] == pytest.approx((3.5 / 3) / 0.02)
    assert v["usd_per_reward_gain"] == pytest.approx(0.02 / (3.5 / 3))
    # Compute: 2 x 1000 parameters x target tokens (10 per candidate, rejected ones included): the run's p1..p3
    # 10 + 20 + 10, the baseline's 30 + 30 + 20.
    assert v["relative_flops"] == pytest.approx(40 / 80)
    assert v["flops_per_prompt_matched"] == pytest.approx(2000 * 40 / 3)
    assert v["reward_gain_per_tflop"] == pytest.approx((3.5 / 3) / (2000 * 40 / 3) * 1e12)
    assert v["flops_per_reward_gain"] == pytest.approx((2000 * 40 / 3) / (3.5 / 3))


def test_run_summary_costs_and_tokens(hand_runs):
    base, run = hand_runs
    s = run_summary(run, run_cost(run))
    assert (s["prompts"], s["errors"]) == (5, 0)
    assert s["mean_best_reward"] == pytest.approx((1.5 + 4 + 2 + 7 + 9) / 5)
    assert s["device_seconds_per_prompt"] == pytest.approx(8 / 5)
    assert s["usd_per_prompt"] == pytest.approx(8 / 5 / 3600 * 36)
    assert s["generated_tokens_per_prompt"] == pytest.approx(60 / 5)  # 6 candidates of 10 tokens
    assert s["usd_per_reward"] == pytest.approx(s["usd_per_prompt"] / s["mean_best_reward"])
    assert s["flops_per_prompt"] == pytest.approx(2000 * 60 / 5)
    assert s["parameters"] == {"target": 1000, "draft": None, "reward": None} and s["parameters_source"] == "manifest"
    b = run_summary(base, run_cost(base))
    assert (b["prompts"], b["errors"]) == (5, 1)
    assert b["device_seconds_per_prompt"] == pytest.approx(9 / 4)  # errored row not in the per-prompt mean


def test_partial_final_correlation_per_decision(tmp_path):
    cands = [
        cand("a", 1.0, partial=[0.1, 3.0]),
        cand("b", 2.0, partial=[0.2, 2.0]),
        cand("c", 3.0, partial=[0.3, 1.0]),
        cand("d", 4.0, partial=[0.4]),  # finished before the second decision
        cand("r", None, "rejected", partial=[5.0]),  # no final reward: not counted
    ]
    few = [cand("a", 1.0, partial=[1.0]), cand("b", 2.0, partial=[2.0])]  # 2 points: skipped
    run = load_run(write_run(str(tmp_path / "r"), [row("p1", cands), row("p2", few)], name="r", files=1))
    got = correlations(run)
    recs = {(r["prompt_id"], r["decision"]): r for r in got["records"]}
    assert set(recs) == {("p1", 0), ("p1", 1)}
    assert recs[("p1", 0)]["n"] == 4 and recs[("p1", 0)]["pearson"] == pytest.approx(1.0)
    assert recs[("p1", 0)]["kendall"] == pytest.approx(1.0)
    assert recs[("p1", 1)]["n"] == 3 and recs[("p1", 1)]["pearson"] == pytest.approx(-1.0)
    assert recs[("p1", 1)]["kendall"] == pytest.approx(-1.0)
    assert got["skipped"] == 1
    assert [d["decision"] for d in got["by_decision"]] == [0, 1]


def _check_png(data: bytes) -> None:
    assert data[:8] == PNG_SIGNATURE
    with Image.open(io.BytesIO(data)) as im:
        im.verify()
    with Image.open(io.BytesIO(data)) as im:
        assert im.size[0] >= 300 and im.size[1] >= 200
        low, high = im.convert("L").getextrema()
    assert high - low > 100  # something is drawn, not a blank image
    assert mpimg.imread(io.BytesIO(data), format="png").ndim == 3


def test_report_files_frontier_and_plots(tmp_path):
    uris = synthetic_runs(str(tmp_path / "runs"), prompts=12)
    greedy, bon16, bon64, sr = uris
    out = tmp_path / "report"
    assert main([greedy, bon64, sr, "--baseline", bon16, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    labels = [e["label"] for e in report["runs"]]
    assert labels == ["bon-16", "greedy", "bon-64", "sr-64-a0.5"]  # the baseline is prepended
    assert report["baseline"] == "bon-16"
    runs = {e["label"]: e for e in report["runs"]}
    assert runs["bon-16"]["vs_baseline"]["improvement_score"] == pytest.approx(100.0)
    assert runs["bon-16"]["vs_baseline"]["relative_compute"] == pytest.approx(1.0)
    assert runs["sr-64-a0.5"]["errors"] == 1 and runs["sr-64-a0.5"]["vs_baseline"]["matched_prompts"] == 11
    per_tflop = {label: e["vs_baseline"]["reward_gain_per_tflop"] for label, e in runs.items()}
    # reward gained per TFLOP (the compute basis) stays as a column, sorted by it; it names no winner (issue 12)
    assert all(v is not None and v > 0 for v in per_tflop.values())
    assert report["ranking"] == sorted(per_tflop, key=lambda k: -per_tflop[k]) and "winner" not in report
    assert report["groups"][0]["ranked_by"] == "reward_gain_per_tflop" and report["basis"] == "compute"
    # the frontier is over the 11 prompts every run completed (SR errored on p003)
    fr = report["frontier"]
    assert fr["prompts"] == 11 and fr["order"] and not fr["not_placed"]
    assert set(fr["order"]) | set(fr["dominated"]) == set(labels)
    cost = [runs[label]["frontier"]["cost_per_prompt"] for label in fr["order"]]
    reward = [runs[label]["frontier"]["mean_best_reward"] for label in fr["order"]]
    assert cost == sorted(cost) and reward == sorted(reward)  # cheapest first, each step buys reward
    md = (out / "report.md").read_text()
    first = md.split("## Cost-reward frontier")[0]
    assert "**Worth their cost**: the cost-reward frontier by compute" in first
    assert [first.index(f"**{label}**") for label in fr["order"]] == sorted(first.index(f"**{label}**")
                                                                           for label in fr["order"])
    table = md.split("## Reward gained per TFLOP")[1].split("\n\n")[2].splitlines()[2:]
    assert [line.split(" | ")[1] for line in table] == report["ranking"]
    for caption, name in report["plots"].items():
        assert f"![{caption}]({name})" in md
        _check_png((out / name).read_bytes())
    assert {"reward_vs_flops_per_prompt_frontier.png", "improvement_score_vs_relative_compute.png",
            "best_reward_per_prompt_by_run.png"} <= set(report["plots"].values())
    assert any(n.startswith("partial_vs_final_reward_sr-64-a0.5_prompt_") for n in report["plots"].values())
    sr_corr = runs["sr-64-a0.5"]["correlation"]["by_decision"]
    assert sr_corr and -1.0 <= sr_corr[0]["pearson_mean"] <= 1.0
    assert runs["greedy"]["correlation"]["records"] == []  # greedy recorded no partial rewards


def test_default_baseline_is_first_run(tmp_path):
    uris = synthetic_runs(str(tmp_path / "runs"), prompts=4)
    out = tmp_path / "report"
    assert main([uris[2], uris[1], "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["baseline"] == "bon-64" and [e["label"] for e in report["runs"]] == ["bon-64", "bon-16"]
    assert report["runs"][0]["vs_baseline"]["improvement_score"] == pytest.approx(100.0)


def test_baseline_among_runs_in_another_spelling_is_not_added_twice(tmp_path, monkeypatch):
    uris = synthetic_runs(str(tmp_path / "runs"), prompts=4)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report"
    assert main([uris[0], uris[1] + "/", "--baseline", "./runs/bon-16", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [e["label"] for e in report["runs"]] == ["greedy", "bon-16"] and report["baseline"] == "bon-16"
    assert main([uris[0], "./runs/greedy", "--out", str(tmp_path / "twice")]) == 2
    assert not (tmp_path / "twice").exists()


def test_memory_filesystem(tmp_path):
    base = f"memory://report-{uuid.uuid4().hex[:8]}"
    uris = synthetic_runs(f"{base}/runs", prompts=4)
    assert main([*uris, "--out", f"{base}/out"]) == 0
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{base}/out")
    names = sorted(os.path.basename(p) for p in fs.find(path))
    assert "report.md" in names and "report.json" in names and "reward_vs_flops_per_prompt_frontier.png" in names
    _check_png(fs.cat(f"{path}/reward_vs_flops_per_prompt_frontier.png"))


def test_s3_through_moto(s3_endpoint):
    s3fs = pytest.importorskip("s3fs")
    uris = synthetic_runs("s3://winnow-test/runs", prompts=4)
    assert main([uris[1], uris[3], "--out", "s3://winnow-test/report"]) == 0
    fs = s3fs.S3FileSystem()
    report = json.loads(fs.cat("winnow-test/report/report.json"))
    assert report["baseline"] == "bon-16" and report["runs"][1]["path"] == uris[3]
    _check_png(fs.cat("winnow-test/report/best_reward_per_prompt_by_run.png"))


def test_runs_of_different_reward_definitions_get_their_own_frontier_said_on_the_terminal(tmp_path, capsys):
    rows = [row(f"p{i}", [cand("a", 1.0 + i), cand("b", 2.0 + i)]) for i in range(3)]
    a = write_run(str(tmp_path / "a"), rows, name="a")  # reward model `rm`
    b = write_run(str(tmp_path / "b"), rows, name="b", reward={"kind": "model", "path": "./rm/", "batch_tokens": 64})
    c = write_run(str(tmp_path / "c"), rows, name="c", reward={"kind": "logprob"})
    d = write_run(str(tmp_path / "d"), rows, name="d", reward={"kind": "lexical", "concepts_column": "concepts"})
    e = write_run(str(tmp_path / "e"), rows, name="e", reward={"kind": "model", "path": "rm-2"})
    f = write_run(str(tmp_path / "f"), rows, name="f", reward={"kind": "logprob"}, models={"target": "other-target"})
    assert main([a, b, "--out", str(tmp_path / "same")]) == 0  # one path spelled two ways, batch size aside
    same = json.loads((tmp_path / "same" / "report.json").read_text())
    assert len(same["groups"]) == 1 and not any("reward definitions" in n for n in same["notes"])
    capsys.readouterr()
    out = tmp_path / "mixed"
    assert main([c, a, d, b, e, f, "--baseline", a, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    groups = [(g["reward"], g["runs"], g["baseline"]) for g in report["groups"]]
    assert groups == [  # the baseline's group first, then in the order of their first run
        ("reward model `rm`", ["a", "b"], "a"),
        ("logprob under the target `builtin:tiny-target`", ["c"], "c"),
        ("lexical coverage of the `concepts` column", ["d"], "d"),
        ("reward model `rm-2`", ["e"], "e"),
        ("logprob under the target `other-target`", ["f"], "f"),
    ]
    assert report["frontier"] == report["groups"][0]["frontier"] and report["frontier"]["order"] == ["a", "b"]
    assert {tuple(g["frontier"]["order"]) for g in report["groups"][1:]} == {("c",), ("d",), ("e",), ("f",)}
    # said on the terminal, naming every run and its reward definition
    assert "Note: the runs are scored by 5 different reward definitions, whose values cannot be compared" in said
    for line in (f"reward model `rm`: a ({a}), b ({b}) (baseline a)", f"logprob under the target "
                 f"`builtin:tiny-target`: c ({c}) (baseline c)", "lexical coverage of the `concepts` column: d"):
        assert f"\n  - {line}" in said
    assert said.count("Worth their cost") == 5 and "Scored by logprob under the target `other-target`" in said
    md = out.joinpath("report.md").read_text()
    assert "**Note:** the runs are scored by 5 different" in md
    assert f"\n- reward model `rm-2`: e ({e}) (baseline e)" in md
    assert md.count("## Scored by ") == 5 and md.count("### Cost-reward frontier") == 5
    # each run is compared with its own group's baseline: a run against itself scores 100
    runs = {e["label"]: e for e in report["runs"]}
    assert runs["c"]["vs_baseline"]["improvement_score"] == pytest.approx(100.0) and runs["c"]["group"] == 1
    # plots per group, the y axis in the reward's units
    names = set(report["plots"].values())
    assert {"reward_vs_flops_per_prompt_frontier_model.png", "reward_vs_flops_per_prompt_frontier_model-2.png",
            "reward_vs_flops_per_prompt_frontier_logprob.png", "best_reward_per_prompt_by_run_lexical.png"} <= names
    fig = plots.best_reward_distribution_figure([("d", [0.5, 1.0])], report["groups"][2]["reward_units"])
    assert fig.axes[0].get_ylabel() == "best reward of a prompt (fraction of concepts covered)"
    assert [g["reward_units"] for g in report["groups"]] == [
        "reward model score", "mean log-probability per token", "fraction of concepts covered",
        "reward model score", "mean log-probability per token"]


def test_python_rewards_and_no_reward_are_definitions_too(tmp_path):
    from runfolder.runs import reward_definition, reward_groups

    rows = [row("p1", [cand("a", 1.0)])]
    runs = [load_run(write_run(str(tmp_path / n), rows, name=n, reward=r)) for n, r in (
        ("f1", {"kind": "python", "function": "pkg.mod:score"}),
        ("f2", {"kind": "python", "function": "pkg.mod:other"}),
        ("f3", {"kind": "python", "function": "pkg.mod:score"}))]
    assert [members for _, members in reward_groups(runs)] == [[0, 2], [1]]
    assert reward_definition(runs[1]).text == "python reward `pkg.mod:other`"
    assert reward_definition(runs[1]).units == "python reward"


# ---------------------------------------------------------------------------------------------------------------
# Float noise is no verdict (reporting.tolerance), and the same runs give the same verdict on the compute basis.


def test_tolerance_relative_and_absolute():
    from reporting.tolerance import ABS_TOL, REL_TOL, at_least, at_most, greater, less, positive, same

    assert (REL_TOL, ABS_TOL) == (1e-6, 1e-9)
    assert same(-1.68, -1.68 + 8e-8) and not less(-1.68 - 8e-8, -1.68) and not greater(-1.68, -1.68 - 8e-8)
    assert at_most(-1.68, -1.68 - 8e-8) and at_least(-1.68 - 8e-8, -1.68)
    assert less(-1.6801, -1.68) and greater(1.68, 1.6799)  # real differences stay differences
    assert same(1e6, 1e6 + 0.5) and not same(1e6, 1e6 + 2)  # relative: 1e-6 of the larger
    assert same(0.0, 5e-10) and not same(0.0, 2e-9) and not positive(5e-10) and positive(2e-9)  # absolute near 0
    pts = [Point("base", 1.0, -1.68, -1.8, -1.5), Point("noisy", 1.0, -1.68 - 8e-8, -1.8, -1.5)]
    got = frontier(pts)
    assert all(v["on_frontier"] for v in got.values())  # neither dominates: one point within float noise
    assert got["noisy"]["marginal_cost_per_reward"] is None or got["base"]["marginal_cost_per_reward"] is None


def test_float_noise_is_not_below_the_baseline(tmp_path):
    rows = [row(f"p{i}", [cand("a", -1.68 + 0.1 * i), cand("b", -2.0)]) for i in range(4)]
    noisy = [row(f"p{i}", [cand("a", -1.68 + 0.1 * i - 8e-8), cand("b", -2.0)]) for i in range(4)]
    lower = [row(f"p{i}", [cand("a", -1.68 + 0.1 * i - 1e-4), cand("b", -2.0)]) for i in range(4)]
    uris = [write_run(str(tmp_path / n), r, name=n, parameters={"target": 10}, reward={"kind": "logprob"})
            for n, r in (("base", rows), ("noisy", noisy), ("lower", lower))]
    out = tmp_path / "out"
    assert main([*uris, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    runs = {e["label"]: e["frontier"] for e in report["runs"]}
    assert runs["noisy"]["below_baseline"] is False and runs["lower"]["below_baseline"] is True
    assert report["frontier"]["order"] == ["base", "noisy"] and runs["noisy"]["previous"] == "base"
    assert runs["noisy"]["verdict"] == "on the frontier: the same point as base"
    assert report["frontier"]["dominated"] == {"lower": ["base", "noisy"]}
    md = (out / "report.md").read_text()
    assert "below the baseline" not in _line(_head(md), "noisy")
    # a real difference below the 3rd digit is said with the digits that show it
    assert "below the baseline's mean best reward (-1.5301 < -1.53," in runs["lower"]["verdict"]


def _repeat(tmp_path, k: int, scale: dict[str, float]) -> tuple[dict, str, str]:
    out = tmp_path / f"repeat-{k}"
    uris = frontier_runs(str(tmp_path / f"runs-{k}"), scale)
    assert main([uris[n] for n in FRONTIER_ORDER] + ["--out", str(out)]) == 0
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), str(out)


def test_three_repeats_of_five_runs_give_one_verdict_on_the_compute_basis(tmp_path, capsys):
    """The same rows, device-seconds several-fold apart (a shared machine): the compute basis gives the same
    frontier and the same words each time; measured USD does not (which is why it is not the default)."""
    scales = [{"bon": 1.0, "cheap-low": 1.0}, {"bon": 4.0, "tie-a": 0.3, "dominated": 0.2},
              {"cheap-low": 6.0, "tie-b": 0.5, "bon": 0.4}]
    verdicts, heads, said = [], [], []
    for k, scale in enumerate(scales):
        capsys.readouterr()
        report, md, out = _repeat(tmp_path, k, scale)
        verdicts.append((report["frontier"]["order"], report["frontier"]["dominated"], report["ranking"],
                         {e["label"]: e["frontier"]["verdict"] for e in report["runs"]}))
        heads.append(_head(md).split("Baseline: ")[0])  # the baseline's path aside
        said.append(capsys.readouterr().out.split(f"wrote {out}")[0])
    assert verdicts[0] == verdicts[1] == verdicts[2]
    assert heads[0] == heads[1] == heads[2] and said[0] == said[1] == said[2]
    assert verdicts[0][0] == ["cheap-low", "bon", "tie-a", "tie-b"]
    orders = [build_report([load_run(str(tmp_path / f"runs-{k}" / n)) for n in FRONTIER_ORDER], 0, "usd")
              ["frontier"]["order"] for k in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # measured USD moves the verdict


def test_a_run_without_a_gain_is_not_ranked(tmp_path):
    base = [row(f"p{i}", [cand("a", 1.0), cand("b", 0.0)]) for i in range(3)]  # single-sample reward 0.5
    worse = [row(f"p{i}", [cand("a", 0.2)], target_tokens=1) for i in range(3)]  # gains -0.3, very cheap
    better = [row(f"p{i}", [cand("a", 0.9)], target_tokens=100) for i in range(3)]
    uris = [write_run(str(tmp_path / n), r, name=n, parameters={"target": 10})
            for n, r in (("base", base), ("worse", worse), ("better", better))]
    out = tmp_path / "out"
    assert main([*uris, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    runs = {e["label"]: e["vs_baseline"] for e in report["runs"]}
    assert runs["worse"]["mean_reward_gain"] == pytest.approx(-0.3) and runs["worse"]["gains_reward"] is False
    assert runs["worse"]["reward_gain_per_tflop"] is None and runs["worse"]["reward_gain_per_usd"] is None
    assert report["ranking"] == ["base", "better"]  # worse, cheapest by far, is not ranked first for its loss
    table = (out / "report.md").read_text().split("## Reward gained per TFLOP")[1].split("\n## ")[0]
    assert "| - | worse | best_of_n | **below the baseline** |" in table and "| no gain |" in table


# ---------------------------------------------------------------------------------------------------------------
# The compute basis: parameter counts from safetensors headers, per-role FLOPs, and the fallback for older runs.


def test_parameter_counts_from_safetensors_headers(tmp_path):
    import assets
    from runfolder.parameters import NotCounted, count_parameters, job_parameters
    from pipeline.preflight import resolved
    from schemas.config import load_config

    assert count_parameters(assets.resolve("builtin:tiny-target")) == 852352
    counts = job_parameters(resolved(load_config("configs/quickstart.yaml")))
    assert (counts.target, counts.draft, counts.reward, counts.not_counted) == (852352, 131008, 375264, {})
    # a sharded folder: the shards its index names
    import shutil

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for i in (1, 2):
        shutil.copy(assets.resolve(f"builtin:tiny-{'target' if i == 1 else 'draft'}") + "/model.safetensors",
                    sharded / f"model-0000{i}-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert count_parameters(str(sharded)) == 852352 + 131008
    only_bin = tmp_path / "bin"
    only_bin.mkdir()
    (only_bin / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(NotCounted, match="holds no safetensors weights"):
        count_parameters(str(only_bin))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(NotCounted, match="cut short|not JSON"):
        count_parameters(str(broken))


def test_compute_per_role_by_reward_kind(tmp_path):
    from reporting.cost import run_cost

    r = [row("p1", [cand("a", 1.0)], target_tokens=100, draft_tokens=50, reward_tokens=30)]
    params = {"target": 1000, "draft": 100, "reward": 10}
    flops = {}
    for kind, reward in (("model", {"kind": "model", "path": "rm"}), ("logprob", {"kind": "logprob"}),
                         ("lexical", {"kind": "lexical"}), ("python", {"kind": "python", "function": "m:f"})):
        run = load_run(write_run(str(tmp_path / kind), r, name=kind, reward=reward, parameters=params))
        flops[kind] = run_cost(run).flops(run.rows[0])
    base = 1000 * 100 + 100 * 50
    assert flops == {"model": 2 * (base + 10 * 30), "logprob": 2 * (base + 1000 * 30), "lexical": 2 * base,
                     "python": 2 * base}


def test_older_runs_read_counts_from_their_model_folders_or_fall_back_to_measured_usd(tmp_path, capsys):
    rows = [row(f"p{i}", [cand("a", 1.0 + i), cand("b", 0.0)], reward_tokens=20) for i in range(3)]
    cheap = [row(f"p{i}", [cand("a", 1.0 + i)], device_seconds=0.5, reward_tokens=10) for i in range(3)]
    # builtin:tiny-reward exists: counted from the folder; `gone` does not: no compute for that run
    rm = {"kind": "model", "path": "builtin:tiny-reward"}
    found = write_run(str(tmp_path / "found"), rows, name="found", reward=rm)
    lost = write_run(str(tmp_path / "lost"), cheap, name="lost", reward=rm, models={"target": str(tmp_path / "gone")})
    out = tmp_path / "out"
    assert main([found, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    e = report["runs"][0]
    assert e["parameters"] == {"target": 852352, "draft": None, "reward": 375264}
    assert e["parameters_source"] == "model folders" and report["frontier"]["basis"] == "compute"
    assert e["flops_per_prompt"] == pytest.approx(2 * (852352 * 20 + 375264 * 20))
    assert "parameter counts of found were read from the model folders" in capsys.readouterr().out
    out = tmp_path / "out2"
    assert main([found, lost, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["basis"] == "compute" and report["groups"][0]["basis"] == "usd"
    assert report["frontier"]["order"] == ["lost"]  # by measured USD: half the device-seconds
    note = report["groups"][0]["basis_note"]
    assert note.startswith("ranked by measured USD, not compute: lost has no compute (its target processed tokens")
    assert str(tmp_path / "gone") in note
    assert "Note: ranked by measured USD, not compute: lost has no compute" in said
    assert "Worth their cost: the cost-reward frontier by measured USD per prompt" in said
    md = (out / "report.md").read_text()
    assert "Some runs have no compute" in md and "**Note:** ranked by measured USD" in md


# ---------------------------------------------------------------------------------------------------------------
# Bad input: exit 2, a message naming the path, nothing written.


@pytest.mark.parametrize("case", ["missing", "no-manifest", "no-candidates", "missing-baseline", "no-price"])
def test_bad_input_exit_2_names_path_writes_nothing(tmp_path, capsys, case):
    good = write_run(str(tmp_path / "good"), [row("p1", [cand("a", 1.0)])], name="good")
    args, target = [good], None
    if case == "missing":
        target = str(tmp_path / "nope")
        args.append(target)
    elif case == "no-manifest":
        (tmp_path / "bare" / "candidates").mkdir(parents=True)
        args.append(str(tmp_path / "bare"))
        target = str(tmp_path / "bare" / "manifest.json")
    elif case == "no-candidates":
        write_run(str(tmp_path / "empty"), [], name="empty")
        args.append(str(tmp_path / "empty"))
        target = str(tmp_path / "empty") + "/candidates"
    elif case == "missing-baseline":
        target = str(tmp_path / "nobase")
        args += ["--baseline", target]
    elif case == "no-price":
        path = os.path.join(good, "manifest.json")
        data = json.load(open(path))
        del data["config"]["cost"]
        json.dump(data, open(path, "w"))
        target = f"{path}: config.cost.usd_per_device_hour"
    out = tmp_path / "out"
    assert main([*args, "--out", str(out)]) == 2
    assert target in capsys.readouterr().err
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_existing_out_refused_unless_overwrite(tmp_path, capsys):
    good = write_run(str(tmp_path / "good"), [row("p1", [cand("a", 1.0), cand("b", 2.0)])], name="good")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.md").write_text("old")
    assert main([good, "--out", str(out)]) == 2
    assert str(out) in capsys.readouterr().err and os.listdir(out) == ["old.md"]
    # --overwrite replaces only what a winnow command wrote: a user's file is named and kept (issue 26)
    assert main([good, "--out", str(out), "--overwrite"]) == 2
    assert "old.md" in capsys.readouterr().err and os.listdir(out) == ["old.md"]
    (out / "old.md").unlink()
    assert main([good, "--out", str(out)]) == 0
    assert main([good, "--out", str(out)]) == 2
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    assert main([good, "--out", str(out), "--overwrite"]) == 0 and "report.md" in os.listdir(out)


# ---------------------------------------------------------------------------------------------------------------
# The cost-reward frontier (issue 12): dominance, marginal cost, bootstrap intervals, verdicts, plots.


def test_bootstrap_intervals_are_deterministic_paired_and_sized_like_the_standard_error():
    rng = np.random.default_rng(7)
    x = rng.normal(3.0, 2.0, 400)
    a = bootstrap_intervals(np.stack([x, x + 1.0]))
    assert np.array_equal(a, bootstrap_intervals(np.stack([x, x + 1.0])))  # fixed seed: the same every time
    assert a[1] == pytest.approx(a[0] + 1.0)  # paired: the same prompt draws for every run
    lo, hi = a[0]
    assert lo < x.mean() < hi
    assert hi - lo == pytest.approx(2 * 1.96 * x.std() / np.sqrt(x.size), rel=0.15)
    assert mean_interval([0.5, 0.5, 0.5]) == [0.5, 0.5] and mean_interval([2.0]) == [2.0, 2.0]
    assert mean_interval([]) is None


def test_frontier_dominance_marginal_and_ties():
    pts = [Point("cheap", 1.0, 0.4, 0.3, 0.5), Point("mid", 2.0, 1.0, 0.9, 1.1), Point("worse", 3.0, 0.95, 0.85, 1.05),
           Point("top", 4.0, 2.0, 1.9, 2.1), Point("same-cost", 4.0, 1.5, 1.4, 1.6)]
    got = frontier(pts)
    order = sorted((k for k, v in got.items() if v["on_frontier"]), key=lambda k: got[k]["position"])
    assert order == ["cheap", "mid", "top"]
    assert got["worse"]["dominated_by"] == ["mid"] and got["worse"]["dominated_by_within_intervals"] == ["mid"]
    assert got["same-cost"]["dominated_by"] == ["top"]  # the same cost, less reward
    assert got["mid"]["previous"] == "cheap" and got["mid"]["marginal_cost_per_reward"] == pytest.approx(1.0 / 0.6)
    assert got["top"]["marginal_cost_per_reward"] == pytest.approx(2.0 / 1.0)
    assert got["cheap"]["marginal_cost_per_reward"] is None and got["cheap"]["position"] == 1
    # within each other's intervals: each mean inside the other's interval, not just overlapping intervals
    assert within_intervals(Point("a", 1, 1.0, 0.9, 1.1), Point("b", 1, 1.05, 0.95, 1.15))
    assert not within_intervals(Point("a", 1, 1.0, 0.9, 1.1), Point("b", 1, 1.15, 1.05, 1.25))  # overlap only
    # two runs on the very same point: neither dominates, the step between them has no marginal cost
    twin = frontier([Point("x", 1.0, 1.0, 1.0, 1.0), Point("y", 1.0, 1.0, 1.0, 1.0)])
    assert all(v["on_frontier"] for v in twin.values()) and twin["y"]["marginal_cost_per_reward"] is None


FRONTIER_ORDER = ["bon", "tie-b", "dominated", "cheap-low", "tie-a"]


def _frontier_report(tmp_path, *flags, scale=None, out="report"):
    uris = frontier_runs(str(tmp_path / f"runs-{out}"), scale)
    out = tmp_path / out
    assert main([uris[name] for name in FRONTIER_ORDER] + ["--out", str(out), *flags]) == 0
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out


@pytest.fixture
def frontier_report(tmp_path):
    return _frontier_report(tmp_path)


def test_frontier_of_hand_made_runs(frontier_report):
    report, md, _ = frontier_report
    runs = {e["label"]: e["frontier"] for e in report["runs"]}
    fr = report["frontier"]
    assert fr["prompts"] == 10 and fr["order"] == ["cheap-low", "bon", "tie-a", "tie-b"]
    assert fr["dominated"] == {"dominated": ["bon"]} and fr["basis"] == "compute"
    assert fr["baseline_mean_best_reward"] == pytest.approx(1.0)
    assert fr["baseline_single_sample_reward"] == pytest.approx(0.5)
    assert fr["bootstrap"]["seed"] == 0 and fr["bootstrap"]["resamples"] == 2000
    # compute: 100 target tokens per device-second x 2 x 5000 parameters = 1 MFLOP per device-second
    cost = {name: runs[name]["cost_per_prompt"] for name in runs}
    assert cost == pytest.approx({"bon": 2e6, "cheap-low": 1e6, "dominated": 3e6, "tie-a": 4e6, "tie-b": 5e6})
    assert cost == {name: runs[name]["flops_per_prompt"] for name in runs}
    usd = {name: runs[name]["usd_per_prompt"] for name in runs}  # measured, beside
    assert usd == pytest.approx({"bon": 0.02, "cheap-low": 0.01, "dominated": 0.03, "tie-a": 0.04, "tie-b": 0.05})
    assert runs["bon"]["marginal_cost_per_reward"] == pytest.approx(1e6 / 0.6)
    assert runs["tie-a"]["marginal_cost_per_reward"] == pytest.approx(2e6 / 1.0)
    assert runs["tie-b"]["marginal_cost_per_reward"] == pytest.approx(1e6 / 0.01)
    # intervals: the same spread in every run and paired draws, so every interval is the baseline's shifted
    lo, hi = runs["bon"]["interval"]
    assert lo < 1.0 < hi and hi - lo < 0.3
    for name, level in (("cheap-low", 0.4), ("tie-b", 2.01)):
        assert runs[name]["interval"] == pytest.approx([lo - 1.0 + level, hi - 1.0 + level])
    assert runs["tie-b"]["step_within_intervals"] is True and runs["bon"]["step_within_intervals"] is False
    assert runs["tie-a"]["within_intervals_of"] == ["tie-b"] and runs["dominated"]["within_intervals_of"] == []
    assert runs["dominated"]["dominated_by_within_intervals"] == []
    below = {name for name, f in runs.items() if f["below_baseline"]}
    assert below == {"cheap-low", "dominated"}
    assert runs["cheap-low"]["below_baseline_within_intervals"] is False
    # the per-run interval over the run's own prompts (here the same prompts) is the frontier's
    base = next(e for e in report["runs"] if e["label"] == "bon")
    assert base["mean_best_reward_interval"] == pytest.approx([lo, hi])


def _head(md: str) -> str:
    """report.md's headline block: everything before the frontier table."""
    return md.split("## Cost-reward frontier")[0]


def _line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if f"**{name}**" in line)


def test_frontier_headline_and_tables(frontier_report):
    report, md, _ = frontier_report
    head = _head(md)
    assert "Ranked by **compute**" in head and "Measured device-seconds and USD are in the tables" in head
    worth, not_worth = head.split("**Not worth their cost**")
    assert "**Worth their cost**: the cost-reward frontier by compute (FLOPs per prompt), cheapest first" in worth
    names = ("cheap-low", "bon", "tie-a", "tie-b")
    assert [_line(worth, n)[:2] for n in names] == ["1.", "2.", "3.", "4."]
    cheap = _line(worth, "cheap-low")
    assert "**below the baseline's reward** (0.4 < 1)" in cheap and "at 1 MFLOP per prompt" in cheap
    bon = _line(worth, "bon")
    assert "the baseline" in bon and "1.67 MFLOP per extra unit of reward over cheap-low" in bon
    assert ("100 MFLOP per extra unit of reward over tie-a (the two within each other's intervals)"
            in _line(worth, "tie-b"))
    dominated = _line(not_worth, "dominated")
    assert "**dominated** (best_of_n): dominated by bon (33.3% less compute, +0.5 reward)" in dominated
    assert "below the baseline's mean best reward (0.5 < 1)" in dominated
    assert "$" not in head  # no measured number in the verdict: it would move with the machine's load
    # every table that ranks or lists runs says which are below the baseline
    for section in ("## Cost-reward frontier", "## Reward gained per TFLOP", "## Against the baseline"):
        body = md.split(section)[1].split("\n## ")[0]
        rows = {name: next(line for line in body.splitlines() if f" {name} | " in line)
                for name in ("cheap-low", "dominated", "tie-a", "bon")}
        assert "**below the baseline**" in rows["cheap-low"] and "**below the baseline**" in rows["dominated"]
        assert "**below the baseline**" not in rows["tie-a"] and "baseline" in rows["bon"]
    for term in ("reward gained per TFLOP", "within each other's intervals", "compute", "the same",
                 "reward definition"):
        assert f"**{term}" in md.split("## Definitions")[1]


def test_frontier_on_measured_usd(tmp_path, capsys):
    report, md, _ = _frontier_report(tmp_path, "--basis", "usd")
    assert report["basis"] == "usd" and report["frontier"]["basis"] == "usd"
    assert report["frontier"]["order"] == ["cheap-low", "bon", "tie-a", "tie-b"]
    runs = {e["label"]: e["frontier"] for e in report["runs"]}
    assert runs["bon"]["marginal_cost_per_reward"] == pytest.approx(0.01 / 0.6)
    head = _head(md)
    assert "Ranked by **measured USD** (--basis usd)" in head
    assert "$0.0167 per extra unit of reward over cheap-low" in _line(head, "bon")
    assert "dominated by bon (33.3% cheaper, +0.5 reward)" in _line(head.split("**Not worth")[1], "dominated")
    assert "## Reward gained per USD" in md
    assert "Ranked by measured USD" in capsys.readouterr().out


def test_runs_without_completed_prompts_are_not_placed(tmp_path):
    good = [row(f"p{i}", [cand("a", float(i)), cand("b", 0.0)]) for i in range(4)]
    base = write_run(str(tmp_path / "base"), good, name="base")
    broken = write_run(str(tmp_path / "broken"), [err_row(f"p{i}") for i in range(4)], name="broken")
    cheap = write_run(str(tmp_path / "cheap"), [row(f"p{i}", [cand("a", float(i) + 1)], device_seconds=0.5)
                                                 for i in range(1, 4)], name="cheap")
    out = tmp_path / "out"
    assert main([base, broken, cheap, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    fr = report["frontier"]
    assert fr["prompts"] == 3  # p0 is missing from cheap, so the frontier is over p1..p3
    assert fr["order"] == ["cheap"] and fr["dominated"] == {"base": ["cheap"]}
    assert list(fr["not_placed"]) == ["broken"]
    runs = {e["label"]: e["frontier"] for e in report["runs"]}
    assert runs["broken"] == {"placed": False} and runs["base"]["mean_best_reward"] == pytest.approx(2.0)
    md = (out / "report.md").read_text()
    assert "Not placed: broken (no prompt completed" in _head(md)
    assert "| broken | best_of_n | not placed |" in md


def _frontier_points(report: dict, key: str = "cost_per_prompt") -> list[dict]:
    return [{"label": e["label"], "method": e["method"], "cost": e["frontier"][key],
             "reward": e["frontier"]["mean_best_reward"], "low": e["frontier"]["interval"][0],
             "high": e["frontier"]["interval"][1], "on_frontier": e["frontier"]["on_frontier"],
             "is_baseline": e["frontier"]["is_baseline"], "below_baseline": e["frontier"]["below_baseline"]}
            for e in report["runs"]]


def _gids(ax, prefix: str) -> list:
    return [a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


@pytest.mark.parametrize("basis", ["compute", "usd"])
def test_reward_vs_cost_plot_marks(frontier_report, basis):
    report, _, out = frontier_report
    fr = report["frontier"]  # compute and measured USD give this frontier here (conftest_runs.frontier_runs)
    points = _frontier_points(report, "cost_per_prompt" if basis == "compute" else "usd_per_prompt")
    fig = plots.reward_vs_cost_figure(points, fr["order"], fr["baseline_single_sample_reward"],
                                      fr["baseline_mean_best_reward"], FRONTIER_PRICE, fr["prompts"], basis=basis,
                                      reward_units="reward model score")
    ax = fig.axes[0]
    markers = _gids(ax, "run:")
    assert sorted(m.get_gid() for m in markers) == sorted(f"run:{p['label']}" for p in points)
    (line,) = _gids(ax, "frontier")
    by = {p["label"]: p for p in points}
    scale = 1e6 if basis == "compute" else 1.0  # compute is drawn in MFLOP here
    assert np.allclose(line.get_xydata(), [[by[n]["cost"] / scale, by[n]["reward"]] for n in fr["order"]])
    assert len(_gids(ax, "baseline-single-sample")) == 1 and len(_gids(ax, "baseline-reward")) == 1
    iso = _gids(ax, "iso:")
    assert 1 <= len(iso) <= 4 and len(_gids(ax, "iso-label:")) == len(iso)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    # one entry per run, the frontier, both baseline levels, the iso lines and the open-marker key
    assert len(legend) == len(points) + 5
    assert any("cost-reward frontier" in t for t in legend) and any("single-sample" in t for t in legend)
    assert any(t.startswith("dominated (best_of_n): dominated, below baseline") for t in legend)
    assert any(t.startswith(f"equal reward gained per {'MFLOP' if basis == 'compute' else 'USD'}") for t in legend)
    # dominated runs are drawn open, frontier runs filled
    faces = {m.get_gid()[4:]: m.get_markerfacecolor() for m in markers}
    assert faces["dominated"] == "white" and faces["tie-a"] != "white"
    # labels: one per run, none overlapping another, the legend, or leaving the axes
    renderer = fig.canvas.get_renderer()
    labels = _gids(ax, "label:")
    assert len(labels) == len(points)
    boxes = [t.get_window_extent(renderer) for t in labels + _gids(ax, "iso-label:")]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    frame = ax.get_window_extent(renderer)
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
    legend_box = ax.get_legend().get_window_extent(renderer)
    assert not any(b.overlaps(legend_box) for b in boxes)
    # axes with units: the reward's on y; on x MFLOP, or dollars with device-seconds on the top axis
    fig.canvas.draw()
    assert ax.get_ylabel() == "mean best reward (reward model score)"
    if basis == "compute":
        assert ax.get_xlabel().startswith("compute per prompt (MFLOP: 2 x parameters x tokens") and not ax.child_axes
        assert not any(t.get_text().startswith("$") for t in ax.get_xticklabels())
    else:
        assert all(t.get_text().startswith("$") for t in ax.get_xticklabels() if t.get_text())
        assert "USD per prompt" in ax.get_xlabel() and "device-seconds per prompt" in ax.child_axes[0].get_xlabel()
    # the written PNG (the report's basis: compute) is a real image of the expected size
    data = (out / "reward_vs_flops_per_prompt_frontier.png").read_bytes()
    _check_png(data)
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.mode in ("RGB", "RGBA") and im.size[0] > 900 and im.size[1] > 450


def test_labels_stay_inside_the_axes_when_crowded():
    """Twelve runs on nearly one spot with long names: no free place for every label, and still none leaves the
    axes for the legend beside them."""
    base = {"method": "best_of_n", "reward": 0.8, "low": 0.7, "high": 0.9, "on_frontier": False,
            "is_baseline": False, "below_baseline": False}
    points = [{**base, "label": f"a-rather-long-run-name-{i}", "cost": 1e9 * (1 + 0.01 * i),
               "reward": 0.8 + 0.001 * i} for i in range(12)]
    fig = plots.reward_vs_cost_figure(points, [points[-1]["label"]], 0.3, 0.5, basis="compute")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    legend_box = ax.get_legend().get_window_extent(renderer)
    for t in _gids(ax, "label:"):
        b = t.get_window_extent(renderer)
        assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1, t.get_text()
        assert not b.overlaps(legend_box)


def test_runs_on_one_point_keep_both_error_bars_visible():
    p = {"method": "m", "cost": 1e-4, "reward": 0.8, "low": 0.7, "high": 0.9, "on_frontier": True,
         "is_baseline": False, "below_baseline": False}
    points = [{**p, "label": "a"}, {**p, "label": "b", "cost": 1.001e-4}, {**p, "label": "c", "cost": 3e-4,
                                                                          "reward": 0.5, "low": 0.4, "high": 0.6}]
    fig = plots.reward_vs_cost_figure(points, ["a", "b"], 0.3, 0.5)
    ax = fig.axes[0]
    xs = {m.get_gid(): m.get_transform().transform(m.get_xydata())[0][0] for m in _gids(ax, "run:")}
    assert abs(xs["run:a"] - xs["run:b"]) >= 5  # pixels apart, though 0.1% apart in USD
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in _gids(ax, "label:")]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert len(ax.get_legend().get_texts()) == 3 + 6  # with the key to marks drawn apart


def _outside(box, frame) -> bool:
    """box lies wholly outside the axes frame (left, right, above or below it)."""
    return box.x1 <= frame.x0 or box.x0 >= frame.x1 or box.y1 <= frame.y0 or box.y0 >= frame.y1


def test_other_plots_have_a_legend_entry_for_every_mark_and_no_legend_over_the_data(frontier_report):
    report, _, out = frontier_report
    scored = [{"label": e["label"], "method": e["method"], "relative_compute": e["vs_baseline"]["relative_flops"],
               "improvement_score": e["vs_baseline"]["improvement_score"],
               "below_baseline": e["frontier"]["below_baseline"]} for e in report["runs"]]
    fig = plots.improvement_vs_relative_compute_figure(scored, "bon", basis="compute")
    ax = fig.axes[0]
    assert len(_gids(ax, "run:")) == 5 and len(_gids(ax, "label:")) == 5
    assert len(ax.get_legend().get_texts()) == 5 + 3  # runs, score 100, score 0, relative compute 1
    assert "FLOPs per prompt / bon's" in ax.get_xlabel()
    box = plots.best_reward_distribution_figure([("a", [0.0, 1.0, 2.0, 10.0]), ("b", [1.0, 2.0])],
                                                "fraction of concepts covered")
    assert [t.get_text().split(":")[0] for t in box.axes[0].get_legend().get_texts()] == [
        "box", "line", "triangle", "whiskers", "circle"]
    assert box.axes[0].get_ylabel() == "best reward of a prompt (fraction of concepts covered)"
    pvf = plots.partial_vs_final_figure({0: ([0.1, 0.2], [1.0, 2.0]), 1: ([0.3], [2.0])}, "t")
    assert [t.get_text() for t in pvf.axes[0].get_legend().get_texts()] == [
        "decision 0", "highest final reward of the prompt", "decision 1"]
    hist = plots.correlation_histograms_figure([-0.9, 0.1, 0.95], [-0.8, 0.0, 0.9], "t")
    for f in (fig, box, pvf, hist):  # every legend beside or below its axes, never over the marks
        renderer = f.canvas.get_renderer()
        for a in f.axes:
            if a.get_legend() is not None:
                assert _outside(a.get_legend().get_window_extent(renderer), a.get_window_extent(renderer))
    assert set(report["plots"].values()) >= {"reward_vs_flops_per_prompt_frontier.png",
                                              "improvement_score_vs_relative_compute.png",
                                              "best_reward_per_prompt_by_run.png"}
    for name in report["plots"].values():
        _check_png((out / name).read_bytes())


def test_the_report_shows_each_runs_engine_side_by_side(tmp_path):
    rows = [row(f"p{i}", [cand("a", float(i)), cand("b", 1.0)]) for i in range(3)]
    old = write_run(str(tmp_path / "old"), rows, name="old")  # a run from before models.engine: hf
    hf = write_run(str(tmp_path / "hf"), rows, name="hf", engine="hf")
    vllm = write_run(str(tmp_path / "vllm"), rows, name="vllm", engine="vllm")
    out = tmp_path / "out"
    assert main([old, hf, vllm, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [(e["label"], e["engine"]) for e in report["runs"]] == [("old", "hf"), ("hf", "hf"), ("vllm", "vllm")]
    md = (out / "report.md").read_text()
    assert "| run | method | engine | status |" in md
    assert "| hf | best_of_n | hf | succeeded |" in md and "| vllm | best_of_n | vllm | succeeded |" in md


def test_a_speculative_rejection_run_that_cut_nothing_is_said_to_be_best_of_n_at_its_price(tmp_path):
    rows = [row(f"p{i}", [cand("a", 0.5), cand("b", 0.7)], method="speculative_rejection") for i in range(3)]
    cut = [row(f"p{i}", [cand("a", None, "rejected"), cand("b", 0.7)], method="speculative_rejection")
           for i in range(3)]
    uncut = load_run(write_run(str(tmp_path / "uncut"), rows, name="sr-uncut", method="speculative_rejection"))
    ok = load_run(write_run(str(tmp_path / "cut"), cut, name="sr-cut", method="speculative_rejection"))
    notes = build_report([ok, uncut], 0, basis="usd")["notes"]
    assert [n for n in notes if "made no cut" in n] == [
        "sr-uncut: Speculative Rejection made no cut at all (no candidate was rejected): Best-of-N at Speculative "
        "Rejection's price"]
