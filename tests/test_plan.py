"""`winnow plan`: the projection arithmetic against hand-computed values, the frontier's knee and the answer, the
sample and sweep specs, every refusal through the CLI (exit 2, nothing written), `winnow report --plan` on hand-made
runs, and on the tiny trio a plan killed mid-sweep, resumed, run in full and checked."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from conftest import job_config, kill_once_committed, winnow, write_config, write_jsonl
from conftest_runs import cand, row, write_run
from planning import projection as pj
from planning.caveats import caveats
from planning.sample import choose, length_summary, lengths_against, parse_size, prompt_chars
from planning.sweep import default_methods, label, parse_methods, sweep_actors
from reporting.frontier import Point, frontier
from reporting.plancheck import PLAN_FORMAT
from reporting.stats import bootstrap_intervals
from schemas.base import InputError
from schemas.config import validate_config

# ---------------------------------------------------------------------------------------------------------------
# The projection arithmetic, by hand


def _measured(label_, reward, generated, processed, flops, seconds, errors=0):
    arr = (lambda xs: None if xs is None else np.array(xs, dtype=float))
    return pj.Measured(label_, arr(reward), arr(generated), arr(processed), arr(flops), arr(seconds), errors)


def test_totals_are_the_sample_mean_times_the_prompt_set_with_the_bootstrap_interval_scaled_alike():
    a = _measured("a", [0.5, 0.7, math.nan, 0.9], [10, 20, 30, 40], [100, 100, 100, 100], [1e9, 2e9, 3e9, 2e9],
                  [1, 1, 2, 4], errors=1)
    b = _measured("b", [0.6, 0.6, 0.6, 0.6], [8, 8, 8, 8], [50, 60, 70, 80], None, [3, 3, 3, 3])
    pa_, pb = pj.project([a, b], prompts=1000, actors=4, usd_per_device_hour=2.0, fixed_seconds=30.0)
    fa, fb = pa_["figures"], pb["figures"]
    # mean best reward over the prompts every config completed (0, 1, 3): a = (0.5 + 0.7 + 0.9) / 3, b = 0.6
    assert fa["mean_best_reward"]["value"] == pytest.approx(0.7)
    assert fb["mean_best_reward"] == {"value": pytest.approx(0.6), "interval": [pytest.approx(0.6)] * 2}
    assert pa_["reward_prompts"] == pb["reward_prompts"] == 3
    # totals: 1000 x the mean over all four sampled prompts
    assert fa["generated_tokens"]["value"] == pytest.approx(25_000) and fa["generated_tokens"]["per_prompt"] == 25
    assert fb["generated_tokens"]["value"] == pytest.approx(8_000)
    assert fb["generated_tokens"]["interval"] == [pytest.approx(8_000)] * 2  # a constant has no spread
    assert fa["processed_tokens"]["interval"] == [pytest.approx(100_000)] * 2
    assert fb["processed_tokens"]["value"] == pytest.approx(65_000)
    assert fa["flops"]["value"] == pytest.approx(2e12) and fb["flops"] is None  # b has no compute
    # device-seconds 1000 x 2 = 2000 s: 0.5556 device-hours, $1.1111 at $2/h, wall 30 + 2000 / 4 = 530 s
    assert fa["device_hours"]["value"] == pytest.approx(2000 / 3600)
    assert fa["usd"]["value"] == pytest.approx(2000 / 3600 * 2)
    assert fa["wall_seconds"]["value"] == pytest.approx(530)
    assert fb["wall_seconds"]["interval"] == [pytest.approx(30 + 3000 / 4)] * 2
    # intervals: 1000 x the report's paired bootstrap interval of the mean (the same draws for every config)
    expected = 1000 * bootstrap_intervals(np.array([[10, 20, 30, 40], [8, 8, 8, 8]], dtype=float))
    assert fa["generated_tokens"]["interval"] == pytest.approx(list(expected[0]))
    seconds = 1000 * bootstrap_intervals(np.array([[1, 1, 2, 4], [3, 3, 3, 3]], dtype=float))[0]
    assert fa["usd"]["interval"] == pytest.approx(list(seconds / 3600 * 2))
    assert fa["wall_seconds"]["interval"] == pytest.approx(list(30 + seconds / 4))
    assert 10_000 <= expected[0][0] < 25_000 < expected[0][1] <= 40_000
    # one of four sampled prompts errored: 250 error rows projected
    assert pa_["sample_errors"] == 1 and pa_["errors"] == pytest.approx(250)


def test_measure_counts_errors_and_missing_rows_as_costing_what_they_were_billed():
    ok = row("p1", [cand("a", 0.4, tokens=5), cand("b", 0.8, tokens=7)], device_seconds=2.0, reward_tokens=3)
    bad = {**row("p2", [cand("c", 0.1)]), "error": "RuntimeError: out of memory", "best_reward": None}
    bad["cost"]["device_seconds"] = 0.5
    m = pj.measure("x", ["p1", "p2", "p3"], {"p1": ok, "p2": bad}, lambda r: 2.0 * r["cost"]["target_tokens"])
    assert m.errors == 2  # p2 errored, p3 has no row
    assert np.isnan(m.reward[1:]).all() and m.reward[0] == 0.8
    assert list(m.generated_tokens) == [12, 10, 0]
    assert list(m.processed_tokens) == [12 + 3, 10, 0]
    assert list(m.flops) == [24.0, 20.0, 0.0]
    assert list(m.device_seconds) == [2.0, 0.5, 0.0]


def test_fixed_seconds_is_the_median_wall_beyond_device_time():
    # (wall, device-seconds, actors): 10 - 8/2 = 6, 20 - 10 = 10, 5 - 100 -> 0
    assert pj.fixed_seconds([(10, 8, 2), (20, 10, 1), (5, 100, 1)]) == 6
    assert pj.fixed_seconds([(10, 8, 2), (20, 10, 1)]) == 8
    assert pj.fixed_seconds([]) == 0.0
    assert pj.wall_seconds(2000, 4, 30) == 530


def test_the_knee_is_farthest_above_the_chord_and_two_points_need_a_resolved_step():
    three = [Point("a", 1, 0.0, -0.1, 0.1), Point("b", 2, 0.8, 0.7, 0.9), Point("c", 4, 1.0, 0.9, 1.1)]
    # scaled: a (0, 0), b (1/3, 0.8), c (1, 1): b is 0.467 above the chord
    assert pj.knee(three, frontier(three)) == "b"
    apart = [Point("a", 1, 0.0, -0.1, 0.1), Point("b", 2, 0.8, 0.7, 0.9)]
    assert pj.knee(apart, frontier(apart)) == "b"
    close = [Point("a", 1, 0.5, 0.3, 0.7), Point("b", 2, 0.6, 0.4, 0.8)]
    assert pj.knee(close, frontier(close)) == "a"  # within each other's intervals: the step is not resolved
    assert pj.knee(three[:1], frontier(three[:1])) == "a" and pj.knee([], {}) is None


def test_the_sample_size_a_question_needs():
    # half-width 0.1, margin 0.05: (0.1 / 0.05)^2 = 4 times the sample
    assert pj.needed_sample(64, [0.4, 0.6], 0.05) == 256
    assert pj.needed_sample(64, [0.4, 0.6], 0.2) == 64  # already resolved: never less than the sample
    assert pj.needed_sample(64, [0.4, 0.6], 0.0) is None


def _projected(label_, reward, low, high, usd, flops=None):
    return {"label": label_, "figures": {"mean_best_reward": {"value": reward, "interval": [low, high]},
                                         "usd": {"value": usd, "interval": [usd * 0.9, usd * 1.1]},
                                         "flops": None if flops is None else {"value": flops}},
            "reward_prompts": 64, "sample_errors": 0, "errors": 0.0}


CONFIGS = [_projected("bon-n4", 0.50, 0.45, 0.55, 10.0), _projected("sr-n8", 0.62, 0.58, 0.66, 14.0),
           _projected("bon-n8", 0.61, 0.57, 0.65, 20.0), _projected("bon-n16", 0.70, 0.66, 0.74, 40.0)]


def test_the_answer_to_each_question():
    got = pj.answer(CONFIGS, pj.Question("target_reward", 0.6), 64)
    assert got["basis"] == "usd"  # a config without compute: USD, as winnow report falls back
    assert got["label"] == "sr-n8" and got["order"] == ["bon-n4", "sr-n8", "bon-n16"]
    assert got["verdicts"]["bon-n8"]["dominated_by"] == ["sr-n8"]
    assert any("too small to say that sr-n8 reaches 0.6" in n and "bon-n16" in n for n in got["notes"])
    assert pj.answer(CONFIGS, pj.Question("target_reward", 0.5), 64)["label"] == "bon-n4"
    assert pj.answer(CONFIGS, pj.Question("target_reward", 0.5), 64)["notes"][0].startswith("the sample is too")
    got = pj.answer(CONFIGS, pj.Question("budget_usd", 25.0), 64)
    assert got["label"] == "sr-n8" and not got["notes"]
    assert pj.answer(CONFIGS, pj.Question("budget_usd", 41.0), 64)["label"] == "bon-n16"
    assert "within $40.5" in pj.answer(CONFIGS, pj.Question("budget_usd", 40.5), 64)["notes"][0]
    # frontier bon-n4 (10, 0.50), sr-n8 (14, 0.62), bon-n16 (40, 0.70): sr-n8 is 0.6 - 0.13 above the chord
    got = pj.answer(CONFIGS, pj.Question("frontier"), 64)
    assert got["label"] == got["knee"] == "sr-n8"
    with pytest.raises(pj.Unanswerable, match=r"--target-reward 0.8: above every .*: 0\.7 \[0\.66, 0\.74\], bon-n16\)"):
        pj.answer(CONFIGS, pj.Question("target_reward", 0.8), 64)
    with pytest.raises(pj.Unanswerable, match=r"--budget-usd 5: below the cheapest .*\(\$10 \[\$9, \$11\], bon-n4\)"):
        pj.answer(CONFIGS, pj.Question("budget_usd", 5.0), 64)


def test_the_compute_basis_ranks_by_flops_and_a_budget_stays_in_usd():
    # by compute sr-n8 is dearer than bon-n8 (the reverse of USD): bon-n8 is then the cheapest reaching 0.6
    configs = [_projected("bon-n4", 0.50, 0.45, 0.55, 10.0, 1e12), _projected("sr-n8", 0.62, 0.58, 0.66, 14.0, 3e12),
               _projected("bon-n8", 0.61, 0.57, 0.65, 20.0, 2e12)]
    got = pj.answer(configs, pj.Question("target_reward", 0.6), 64, "compute")
    assert got["basis"] == "compute" and got["label"] == "bon-n8" and got["order"] == ["bon-n4", "bon-n8", "sr-n8"]
    assert pj.answer(configs, pj.Question("target_reward", 0.6), 64, "usd")["label"] == "sr-n8"
    assert pj.answer(configs, pj.Question("budget_usd", 15.0), 64, "compute")["label"] == "sr-n8"


# ---------------------------------------------------------------------------------------------------------------
# The sample and the sweep's specs


def test_sample_sizes_and_the_seeded_draw():
    assert parse_size("64").of(1000) == 64
    assert parse_size("0.05").of(1000) == 50 and parse_size("5%").of(1001) == 51 and parse_size("1").count == 1
    for bad in ("0", "-3", "1.5", "abc", "0%", ""):
        with pytest.raises(ValueError, match="--sample"):
            parse_size(bad)
    rows = np.arange(100, 200)
    a, b = choose(rows, 10, seed=3), choose(rows, 10, seed=3)
    assert list(a) == list(b) and list(a) == sorted(set(a)) and set(a) <= set(rows)
    assert list(choose(rows, 10, seed=4)) != list(a)
    assert list(choose(rows, 100, seed=0)) == list(rows)


def test_prompt_lengths_and_the_length_caveats():
    t = pa.array([[{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}],
                  [{"role": "user", "content": "x"}], []],
                 pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    assert list(prompt_chars(t)) == [5, 1, 0]
    assert length_summary(np.array([1, 2, 3, 10]))["max"] == 10
    dataset = np.array([10] * 90 + [100] * 10)
    got = lengths_against(dataset, np.array([10] * 10))
    assert got["longer_than_sample"] == 10 and got["shorter_than_sample"] == 0
    meta = {"sample": {"prompts": 10}, "dataset": {"prompts": 100, "rows": 101, "input_errors": 1},
            "prompt_chars": got}
    lines = caveats(meta, [], [], [], [])
    assert any("the sampled prompts are shorter on average (10.0 characters" in c and "too low" in c for c in lines)
    assert any(c.startswith("10 of the 100 prompts (10%) are longer than the longest sampled one") for c in lines)
    assert any("fewer than 30" in c for c in lines) and any("1 of the prompt set's 101 rows" in c for c in lines)
    device = {"kind": "cpu", "cpus_per_actor": 1, "engine": "hf", "dtype": "auto", "load_average": 9.0,
              "host_cpus": 2, "gpus_per_actor": 0, "accelerators": []}
    lines = caveats(meta, [device, {**device, "cpus_per_actor": 2}], [], [], ["sr-n4"])
    assert any("ran on different devices" in c for c in lines)
    assert any(c.startswith("device-hours, USD and wall-clock hold only for the device") for c in lines)
    assert any("load average 9.0 on 2 cores" in c for c in lines)
    assert any(c.startswith("sr-n4 rejected no candidate") for c in lines)


def test_methods_their_labels_and_the_default_sweep(tmp_path):
    got = parse_methods(["best_of_n:n=2,4", "speculative_rejection:n=8:alpha=0.3,0.5"])
    assert got == [{"name": "best_of_n", "n": 2}, {"name": "best_of_n", "n": 4},
                   {"name": "speculative_rejection", "n": 8, "alpha": 0.3},
                   {"name": "speculative_rejection", "n": 8, "alpha": 0.5}]
    assert [label(m) for m in got] == ["bon-n2", "bon-n4", "sr-n8-alpha0.3", "sr-n8"]
    with pytest.raises(InputError) as err:
        parse_methods(["best_of_m:n=2", "best_of_n:n", "best_of_n:n=1:n=2"])
    assert len(err.value.problems) == 3 and "unknown method 'best_of_m'" in err.value.problems[0]
    job = validate_config(job_config(tmp_path, method={"name": "speculative_rejection", "n": 32}))
    assert [label(m) for m in default_methods(job)] == ["bon-n1", "bon-n2", "bon-n4", "bon-n8", "bon-n16", "bon-n32",
                                                        "sr-n8", "sr-n16", "sr-n32"]
    assert sweep_actors(validate_config(job_config(tmp_path, resources={"actors": 8})), 5) == 3  # batches of 2


# ---------------------------------------------------------------------------------------------------------------
# Refusals through the CLI, before anything runs


def _concepts(path: Path, n: int) -> Path:
    from assets import concept_sets

    train, _ = concept_sets.split("tiny-world", n, 0, 0)
    return write_jsonl(path, train)


def _job(tmp_path: Path, prompts: int = 40, **sections) -> dict:
    data = {"source": str(_concepts(tmp_path / "concepts.jsonl", prompts)), "prompt_column": "prompt",
            "id_column": "id", "limit": None}
    base = {"data": data, "method": {"name": "best_of_n", "n": 2}, "generation": {"max_new_tokens": 8},
            "output": {"path": str(tmp_path / "full")}, "models": {"target": "builtin:tiny-target",
                                                                   "reward": {"kind": "model",
                                                                              "path": "builtin:tiny-reward"}}}
    return job_config(tmp_path, **{**base, **sections})


def _left(tmp_path: Path, out: Path) -> list[str]:
    """What a refused plan left: its folder, its lease beside it, its staging folders."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(out.name))


@pytest.mark.parametrize("args, expected", [
    (["--target-reward", "0.5", "--budget-usd", "1"], "not allowed with argument"),
    (["--sample", "0", "--budget-usd", "0", "--methods", "best_of_n:n=0", "beam_search:n=2"],
     ["--sample '0': expected a number of prompts", "--budget-usd 0: must be a number of USD above 0",
      "method bon-n0: method.n", "unknown method 'beam_search'"]),
    (["--sample", "41", "--set", "data.limit=40"], "--sample 41: 41 prompts asked for, but data.limit keeps 40"),
    (["--set", "generation.max_new_tokens=0"], "generation.max_new_tokens"),
    (["--set", "data.source=/nonexistent/prompts.jsonl"], "data.source: /nonexistent/prompts.jsonl"),
])
def test_bad_arguments_exit_2_naming_them_and_write_nothing(tmp_path, args, expected):
    cfg = write_config(tmp_path / "job.yaml", _job(tmp_path))
    out = tmp_path / "plan"
    got = winnow("plan", str(cfg), "--out", str(out), *args)
    assert got.returncode == 2, got.stderr
    for text in [expected] if isinstance(expected, str) else expected:
        assert text in got.stderr
    assert "Traceback" not in got.stderr and _left(tmp_path, out) == []


@pytest.mark.slow  # three `winnow plan` processes, half a minute
def test_a_target_no_reward_of_its_kind_reaches_and_a_folder_of_something_else_are_refused(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", _job(tmp_path, models={
        "target": "builtin:tiny-target", "reward": {"kind": "lexical"}}))
    got = winnow("plan", str(cfg), "--out", str(tmp_path / "plan"), "--target-reward", "1.5")
    assert got.returncode == 2 and "--target-reward 1.5: the lexical reward is at most 1" in got.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    got = winnow("plan", str(cfg), "--out", str(tmp_path / "busy"))
    assert got.returncode == 2 and "holds notes.txt, which no plan writes" in got.stderr
    got = winnow("plan", str(cfg), "--out", str(tmp_path / "full" / "plan"))
    assert got.returncode == 2 and "is inside the job's run folder (output.path)" in got.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "concepts.jsonl", "job.yaml"]


# ---------------------------------------------------------------------------------------------------------------
# `winnow report --plan` on hand-made runs


def _plan_folder(tmp_path: Path, device: dict | None = None) -> Path:
    """A plan.json projecting 100 prompts: best_of_n n=2 with reward 0.5 [0.45, 0.55], 2,000 generated and processed
    tokens [1,900, 2,100], 1 device-hour [0.9, 1.1] at $2, 500 s beyond device time on 1 actor. Written as a plan
    of the release before the settings' renames was (`workers`, `gpus_per_worker`): `winnow report --plan` reads it."""
    job = {"name": "job", "models": {"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "rm"}},
           "method": {"name": "best_of_n", "n": 4}, "output": {"path": "full"},
           "resources": {"workers": 1, "gpus_per_worker": 0}, "cost": {"usd_per_device_hour": 2.0}}
    fig = (lambda v, lo, hi: {"value": v, "interval": [lo, hi]})
    projection = {"mean_best_reward": fig(0.5, 0.45, 0.55), "generated_tokens": fig(2000, 1900, 2100),
                  "processed_tokens": fig(2000, 1900, 2100), "flops": None, "device_hours": fig(1.0, 0.9, 1.1),
                  "usd": fig(2.0, 1.8, 2.2), "wall_seconds": fig(3610, 3250, 3970)}
    plan = {"format": PLAN_FORMAT, "command": "winnow plan job.yaml", "job": {"name": "job", "config": job,
                                                                             "workers": 1},
            "dataset": {"prompts": 100}, "sample": {"prompts": 64}, "answer": {"label": "bon-n2"}, "level": 0.95,
            "device": device, "device_line": None, "wall_model": {"fixed_seconds": 500.0},
            "configs": [{"label": "bon-n2", "method": {"name": "best_of_n", "n": 2}, "projection": projection}]}
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder


def _full_run(tmp_path: Path, reward: float, gpus: float) -> tuple[str, list[dict]]:
    """A Best-of-2 run of 100 prompts, each with best reward `reward`, 20 tokens and 36 device-seconds, on
    `gpus` GPUs per actor; (its path, its rows)."""
    rows = [row(f"p{i}", [cand("a", reward, tokens=10), cand("b", 0.1, tokens=10)], device_seconds=36.0)
            for i in range(100)]
    full = write_run(str(tmp_path / "full"), rows, name="full", method_params={"n": 2})
    manifest = json.loads((tmp_path / "full" / "manifest.json").read_text())
    manifest["config"]["resources"] = {"workers": 1, "gpus_per_worker": gpus}  # as the release before wrote it
    (tmp_path / "full" / "manifest.json").write_text(json.dumps(manifest))
    return full, rows


def test_report_plan_says_which_figures_fell_inside_their_intervals(tmp_path):
    plan = _plan_folder(tmp_path)
    # 100 prompts of Best-of-2: reward 0.6 each (outside), 20 tokens each (2,000: inside), 36 device-seconds each
    full, rows = _full_run(tmp_path, 0.6, gpus=0)
    other = write_run(str(tmp_path / "other"), rows[:10], name="other", method_params={"n": 8})
    got = winnow("report", full, other, "--plan", str(plan), "--out", str(tmp_path / "report"))
    assert got.returncode == 0, got.stderr
    assert "Plan check: full as bon-n2: 4 of 6 checked figures inside their 95% intervals (outside: mean best " \
           "reward, wall-clock); not checked: FLOPs (not projected)." in got.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["plan"]["actors"] == 1  # the plan's `workers`, under its new name
    full_check, other_check = report["plan"]["runs"]
    figures = {f["figure"]: f for f in full_check["figures"]}
    reward = figures["mean_best_reward"]
    assert reward["actual"] == pytest.approx(0.6) and reward["inside"] is False
    assert figures["generated_tokens"]["actual"] == 2000 and figures["generated_tokens"]["inside"] is True
    assert figures["device_hours"]["actual"] == pytest.approx(1.0) and figures["device_hours"]["inside"] is True
    assert figures["usd"]["inside"] is True and figures["flops"]["not_checked"] == "not projected"
    # wall-clock: the manifest's hour against 500 s + 3,600 s / 1 actor, [3,740, 4,460]
    assert figures["wall_seconds"]["actual"] == 3600 and figures["wall_seconds"]["inside"] is False
    assert other_check["plan_config"] is None and "no swept config of the plan has this run's method" in \
        other_check["notes"][0]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## The plan checked against the runs" in md and "| mean best reward | 0.5000 | [0.4500, 0.5500] | " \
                                                           "0.6000 | **no** |" in md


def test_report_plan_does_not_check_device_figures_of_another_device_nor_a_bad_plan(tmp_path):
    plan = _plan_folder(tmp_path)
    full, _ = _full_run(tmp_path, 0.5, gpus=1)
    got = winnow("report", full, "--plan", str(plan), "--out", str(tmp_path / "report"))
    assert got.returncode == 0, got.stderr
    check = json.loads((tmp_path / "report" / "report.json").read_text())["plan"]["runs"][0]
    assert "another device than the plan's sample (resources.gpus_per_actor)" in check["notes"][0]
    assert {f["figure"] for f in check["figures"] if f["not_checked"] == "another device"} == {
        "device_hours", "usd", "wall_seconds"}
    assert check["inside"] == check["checked"] == 3
    got = winnow("report", full, "--plan", str(tmp_path / "nowhere"), "--out", str(tmp_path / "report2"))
    assert got.returncode == 2 and f"--plan {tmp_path / 'nowhere'}: no plan.json" in got.stderr
    assert not (tmp_path / "report2").exists()


# ---------------------------------------------------------------------------------------------------------------
# On the tiny trio: a plan killed mid-sweep and resumed, its refusals once swept, the full run checked


def _ids(run: Path) -> list[str]:
    import pyarrow.parquet as pq

    files = sorted((run / "candidates").glob("*.parquet"))
    return [pid for f in files for pid in pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()]


@pytest.mark.slow
def test_a_plan_killed_mid_sweep_resumes_with_its_sample_and_is_checked_against_the_full_run(ray_session, tmp_path,
                                                                                             capsys):
    from jobs.plan import main as plan_main
    from jobs.report import main as report_main

    cfg = write_config(tmp_path / "job.yaml", _job(tmp_path, prompts=40, resources={"actors": 1,
                                                                                     "prompts_per_call": 2}))
    out = tmp_path / "my plan"  # a space: every command the plan prints must still copy-paste
    args = [str(cfg), "--sample", "8", "--sweep-share", "5", "--methods", "best_of_n:n=1,2",
            "speculative_rejection:n=4", "--out", str(out)]

    # a sample larger than the prompt set: counted with Ray, refused, nothing written
    assert plan_main([str(cfg), "--sample", "41", "--out", str(out)]) == 2
    assert "--sample 41: 41 prompts asked for, but the job's prompt set" in capsys.readouterr().err
    assert _left(tmp_path, out) == []
    # 40 prompts cannot pay for a sweep within the default share: refused before sweeping, nothing written
    assert plan_main([str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--sweep-share 0.1: the job is too small to plan: its 40 prompt(s)" in err and "Traceback" not in err
    assert "plan it anyway with --sweep-share" in err and _left(tmp_path, out) == []

    first_run = out / "sweep" / "warmup"  # killed once the warm-up probe, the first run, has committed a batch
    kill_once_committed(cfg, first_run, tmp_path / "first.log", argv=["-m", "jobs.cli", "plan", *args])
    sample = out / "sample" / "prompts.jsonl"
    drawn = (sample.read_bytes(), sample.stat().st_mtime_ns)
    assert not (out / "plan.json").exists()  # killed mid-sweep (the first run done, or partly done)

    assert plan_main(args) == 0
    printed = capsys.readouterr().out
    assert "reusing the sample" in printed and "Answer: " in printed
    assert (sample.read_bytes(), sample.stat().st_mtime_ns) == drawn  # the same sample, not drawn again
    ids = [json.loads(line)["prompt_id"] for line in sample.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 8
    for name in ("bon-n2", "sr-n4"):
        assert sorted(_ids(out / "sweep" / name)) == sorted(ids), name  # every sampled prompt exactly once
    plan = json.loads((out / "plan.json").read_text())
    assert plan["dataset"]["prompts"] == 40 and plan["sample"]["prompts"] == 8
    assert [c["label"] for c in plan["configs"]] == ["bon-n1", "bon-n2", "sr-n4"]
    assert [c["measured_from"] for c in plan["configs"]] == ["bon-n2", "bon-n2", "sr-n4"]
    assert plan["sweep"]["runs"] == ["bon-n2", "sr-n4"] and plan["sweep"]["cut"] == []
    assert len(plan["warmup"]["calls"]) == 3
    assert plan["answer"]["label"] in ("bon-n1", "bon-n2", "sr-n4") and (out / "config.yaml").is_file()
    # every command plan.md and config.yaml print reads back, paths with spaces whole
    md = (out / "plan.md").read_text()
    block = md.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert shlex.split(block[0]) == ["winnow", "generate", str(out / "config.yaml")]
    assert shlex.split(block[1])[:5] == ["winnow", "report", str(tmp_path / "full"), "--plan", str(out)]
    head = next(line for line in (out / "config.yaml").read_text().splitlines() if line.startswith("# Run it: "))
    assert shlex.split(head[len("# Run it: "):].split("   ")[0]) == ["winnow", "generate", str(out / "config.yaml")]
    assert any("fewer than 30" in c for c in plan["caveats"])
    assert any(c.startswith("device-hours, USD and wall-clock hold only for the device") for c in plan["caveats"])

    # the sweep is finished: a question no swept config answers is refused before anything runs, nothing written
    before = (out / "plan.json").stat().st_mtime_ns
    assert plan_main([*args, "--target-reward", "5"]) == 2
    assert "--target-reward 5: above every swept config's" in capsys.readouterr().err
    assert plan_main([*args, "--budget-usd", "1e-12"]) == 2
    assert "--budget-usd 1e-12: below the cheapest swept config's" in capsys.readouterr().err
    assert (out / "plan.json").stat().st_mtime_ns == before
    # another config aimed at the same plan folder is refused, naming what changed
    assert plan_main([*args, "--set", "generation.max_new_tokens=9"]) == 2
    assert "was made with another config (generation.max_new_tokens" in capsys.readouterr().err

    # the full run of the picked config, checked against the plan
    from jobs.generate import main as generate_main

    assert generate_main([str(out / "config.yaml")]) == 0
    capsys.readouterr()
    assert report_main([str(tmp_path / "full"), "--plan", str(out), "--out", str(tmp_path / "report")]) == 0
    assert "Plan check: " in capsys.readouterr().out
    check = json.loads((tmp_path / "report" / "report.json").read_text())["plan"]["runs"][0]
    assert check["plan_config"] == plan["answer"]["label"] and check["checked"] == 7
    full_ids = set(_ids(tmp_path / "full"))
    assert len(full_ids) == 40 and set(ids) <= full_ids
