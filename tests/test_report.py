"""`winnow report`: paper 001's improvement score (eq. 8) and relative compute (eq. 7) on hand-made runs, reward per
USD, partial/final reward correlation, the files it writes, and bad input."""

from __future__ import annotations

import io
import json
import os
import uuid

import matplotlib.image as mpimg
import pytest
from PIL import Image

from conftest_runs import cand, err_row, row, s3_endpoint, synthetic_runs, write_run  # noqa: F401 (fixture)
from jobs.report import main
from reporting.stats import compare, correlations, improvement_score, run_summary
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
    ], name="base", usd_per_device_hour=36.0)
    run = write_run(str(tmp_path / "run"), [
        row("p1", [cand("x", 1.5)], device_seconds=1.0),
        row("p2", [cand("x", 4.0), cand("y", 0.0, "length")], device_seconds=1.0),
        row("p3", [cand("x", 2.0)], device_seconds=4.0),
        row("p4", [cand("x", 7.0)], device_seconds=1.0),
        row("p5", [cand("x", 9.0)], device_seconds=1.0),
    ], name="run", method="speculative_rejection", usd_per_device_hour=36.0)
    return load_run(base), load_run(run)


def test_run_against_itself_scores_100_and_relative_compute_1(hand_runs):
    base, _ = hand_runs
    v = compare(base, base)
    assert v["improvement_score"] == pytest.approx(100.0)
    assert v["relative_compute"] == pytest.approx(1.0)
    assert v["relative_compute_mean_of_ratios"] == pytest.approx(1.0)
    # p3 (rewards 1, 1) and p6 (one candidate) have max = min, so they are left out of the score.
    assert v["improvement_score_prompts"] == 2 and v["improvement_score_excluded_equal_rewards"] == 2


def test_hand_computed_run_against_baseline(hand_runs):
    base, run = hand_runs
    v = compare(run, base)
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


def test_run_summary_costs_and_tokens(hand_runs):
    base, run = hand_runs
    s = run_summary(run)
    assert (s["prompts"], s["errors"]) == (5, 0)
    assert s["mean_best_reward"] == pytest.approx((1.5 + 4 + 2 + 7 + 9) / 5)
    assert s["device_seconds_per_prompt"] == pytest.approx(8 / 5)
    assert s["usd_per_prompt"] == pytest.approx(8 / 5 / 3600 * 36)
    assert s["generated_tokens_per_prompt"] == pytest.approx(60 / 5)  # 6 candidates of 10 tokens
    assert s["usd_per_reward"] == pytest.approx(s["usd_per_prompt"] / s["mean_best_reward"])
    b = run_summary(base)
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


def test_report_files_winner_and_plots(tmp_path):
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
    per_usd = {label: e["vs_baseline"]["reward_gain_per_usd"] for label, e in runs.items()}
    assert report["ranking"] == sorted(per_usd, key=lambda k: -per_usd[k])
    assert report["winner"] == max(per_usd, key=per_usd.get)
    md = (out / "report.md").read_text()
    first = md.split("\n\n")[1]
    assert first.startswith(f"**{report['winner']}** (") and "most reward per dollar" in first
    table = md.split("## Ranking by reward gained per USD")[1].split("\n\n")[1].splitlines()[2:]
    assert [line.split(" | ")[1] for line in table] == report["ranking"]
    for caption, name in report["plots"].items():
        assert f"![{caption}]({name})" in md
        _check_png((out / name).read_bytes())
    assert {"reward_vs_compute.png", "best_reward_by_run.png"} <= set(report["plots"].values())
    assert any(n.startswith("partial_vs_final_") for n in report["plots"].values())
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
    assert "report.md" in names and "report.json" in names and "reward_vs_compute.png" in names
    _check_png(fs.cat(f"{path}/reward_vs_compute.png"))


def test_s3_through_moto(s3_endpoint):
    s3fs = pytest.importorskip("s3fs")
    uris = synthetic_runs("s3://winnow-test/runs", prompts=4)
    assert main([uris[1], uris[3], "--out", "s3://winnow-test/report"]) == 0
    fs = s3fs.S3FileSystem()
    report = json.loads(fs.cat("winnow-test/report/report.json"))
    assert report["baseline"] == "bon-16" and report["runs"][1]["path"] == uris[3]
    _check_png(fs.cat("winnow-test/report/best_reward_by_run.png"))


def test_warns_when_reward_settings_differ(tmp_path):
    rows = [row("p1", [cand("a", 1.0), cand("b", 2.0)])]
    a = write_run(str(tmp_path / "a"), rows, name="a")
    b = write_run(str(tmp_path / "b"), rows, name="b")
    c = write_run(str(tmp_path / "c"), rows, name="c", reward={"kind": "logprob"})
    assert main([a, b, "--out", str(tmp_path / "same")]) == 0
    assert json.loads((tmp_path / "same" / "report.json").read_text())["warnings"] == []
    assert "**Warning:**" not in (tmp_path / "same" / "report.md").read_text()
    assert main([a, b, c, "--out", str(tmp_path / "mixed")]) == 0
    warnings = json.loads((tmp_path / "mixed" / "report.json").read_text())["warnings"]
    assert len(warnings) == 1 and "a, b: " in warnings[0] and 'c: {"kind": "logprob"}' in warnings[0]
    assert "**Warning:** the runs use different reward settings" in (tmp_path / "mixed" / "report.md").read_text()


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
    assert main([good, "--out", str(out), "--overwrite"]) == 0
    assert "old.md" not in os.listdir(out) and "report.md" in os.listdir(out)
