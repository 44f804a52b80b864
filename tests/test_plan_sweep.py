"""`winnow plan`'s sweep sized to the job: Best-of-k from one Best-of-n run's candidates (against brute force over
every subset), the device model and the warm-up, the share and its cuts, the verified rate and the cost of a pass
projected, commands that copy-paste, and `winnow report --plan` on runs whose method leaves settings unused."""

from __future__ import annotations

import itertools
import json
import math
import shlex
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, job_config, winnow
from conftest_runs import cand, row, write_run
from planning import estimate
from planning import projection as pj
from planning.budget import TooSmall, parse_share, size_sweep
from planning.render import markdown
from planning.sample import columns
from planning.sweep import SweepRun, layout, probe_rows
from reporting.plancheck import PLAN_FORMAT, differences, terminal_lines
from schemas.config import validate_config
from schemas.rows import rows_to_table

# ---------------------------------------------------------------------------------------------------------------
# Best-of-k from Best-of-n


def _brute_best(rewards: list[float], k: int) -> float:
    subsets = list(itertools.combinations(rewards, k))
    return sum(max(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("rewards", [[0.3, -1.0, 0.7, 0.7, 0.2, 0.9], [1.0, 0.0, 0.0, 1.0, 0.0], [0.5]])
def test_the_expected_best_of_k_is_the_mean_over_every_subset(rewards):
    for k in range(1, len(rewards) + 1):
        assert estimate.expected_best(rewards, k) == pytest.approx(_brute_best(rewards, k))
    assert estimate.expected_best(rewards, 1) == pytest.approx(np.mean(rewards))
    assert estimate.expected_best(rewards, len(rewards)) == pytest.approx(max(rewards))
    assert estimate.expected_best(rewards, len(rewards) + 3) == pytest.approx(max(rewards))  # k capped at n
    assert math.isnan(estimate.expected_best([], 2))
    assert estimate.subset_weights(len(rewards), 1).sum() == pytest.approx(1.0)


def test_pass_at_k_is_the_chance_that_a_subset_holds_a_verified_one():
    for n, c in ((5, 0), (5, 2), (6, 5), (4, 4)):
        flags = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(flags, k))
            assert estimate.pass_at(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert math.isnan(estimate.pass_at(0, 0, 1))


def _bon_row(pid: str, rewards: list[float], tokens: list[int], prompt_tokens: int = 10, seconds: float = 2.0,
             verified: list[bool] | None = None) -> dict:
    cands = [cand(f"{pid}-{i}", r, tokens=t) for i, (r, t) in enumerate(zip(rewards, tokens))]
    for c, v in zip(cands, verified or [None] * len(cands)):
        c["verified"] = v
    out = row(pid, cands, device_seconds=seconds, target_tokens=prompt_tokens + sum(tokens),
              reward_tokens=prompt_tokens + sum(tokens))
    out["stats"].update({"prompt_tokens": prompt_tokens, "decoding_steps": 4.0, "reward_steps": 1.0})
    if verified is not None:
        out["stats"]["best_verified"] = any(verified)
    return out


def test_best_of_k_from_a_best_of_n_run_hand_computed():
    rows = {"p1": _bon_row("p1", [0.1, 0.9, 0.5, 0.3], [10, 20, 30, 40], verified=[False, True, False, False]),
            "p2": _bon_row("p2", [0.4, 0.4, 0.2, 0.8], [5, 5, 5, 5], prompt_tokens=4, seconds=1.0,
                           verified=[False] * 4)}
    flops = (lambda r: 2.0 * (r["cost"]["target_tokens"] + r["cost"]["reward_tokens"]))  # one parameter per token
    work_only = estimate.DeviceModel(0.0, 1.0, "work")
    m = estimate.best_of_k("bon-n2", 2, ["p1", "p2", "p3"], rows, flops, work_only, 0.5, verifier=True)
    assert m.reward[0] == pytest.approx(_brute_best([0.1, 0.9, 0.5, 0.3], 2))
    assert m.reward[1] == pytest.approx(_brute_best([0.4, 0.4, 0.2, 0.8], 2))
    assert math.isnan(m.reward[2]) and m.errors == 1  # p3 has no row: an error that cost nothing
    assert list(m.generated_tokens) == [50.0, 10.0, 0.0]  # half the candidates' tokens
    # each model reads the prompt once, and half its candidates' tokens: p1 10 + 50, twice (target and reward)
    assert list(m.processed_tokens) == [120.0, 2 * (4 + 10), 0.0]
    assert list(m.flops) == [240.0, 56.0, 0.0]
    # device time scaled by work (p1: 120 of 220 tokens), then by the warm-up's removal (0.5)
    assert m.device_seconds[0] == pytest.approx(2.0 * 120 / 220 * 0.5)
    assert m.verified[0] == pytest.approx(0.5) and m.verified[1] == 0.0 and math.isnan(m.verified[2])
    # at k = n the estimate is the run itself
    full = estimate.best_of_k("bon-n4", 4, ["p1"], rows, flops, work_only, 1.0, verifier=False)
    assert full.reward[0] == 0.9 and full.processed_tokens[0] == 220 and full.device_seconds[0] == 2.0
    assert full.verified is None


def test_the_device_model_fits_forwards_and_work_and_bounds_the_ratio():
    a, b = 0.5, 2e-3
    runs = [(a * f + b * w, f, w) for f, w in ((100, 1e4), (80, 3e4), (120, 2e4))]
    model = estimate.fit_device_model(runs)
    assert model.a == pytest.approx(a) and model.b == pytest.approx(b)
    # Best-of-k takes Best-of-n's forwards at a quarter of its work: between 1/4 and 1 of its time
    assert model.ratio(10.0, 250.0, 1000.0) == pytest.approx((5 + 0.5) / (5 + 2))
    assert estimate.fit_device_model(runs[:1]).a == 0.0  # one run: time follows the work
    negative = estimate.fit_device_model([(1.0, 1, 1.0), (3.0, 2, 1.0)])  # a = 2, b = -1: refused
    assert negative.a == 0.0 and "negative" in negative.why
    assert negative.ratio(1.0, 1.0, 4.0) == pytest.approx(0.25)


def test_the_warm_up_is_the_first_calls_time_beyond_the_warm_rate():
    def probe(call: int, seconds: float, tokens: int, error: bool = False) -> dict:
        r = row(f"p~warmup{call}", [cand("a", 0.5, tokens=tokens)], device_seconds=seconds, target_tokens=tokens)
        if error:
            r["error"] = "RuntimeError"
        return r

    # warm calls: 0.2 s per 100 tokens; the first call did 100 tokens in 0.5 s: 0.3 s of warm-up
    got = estimate.warmup_seconds([probe(0, 0.5, 100), probe(1, 0.2, 100), probe(2, 0.4, 200), row("other", [])])
    assert got["seconds"] == pytest.approx(0.3) and [c["call"] for c in got["calls"]] == [0, 1, 2]
    assert estimate.warmup_seconds([probe(0, 0.1, 100), probe(1, 0.2, 100)])["seconds"] == 0.0  # no slower
    assert estimate.warmup_seconds([probe(1, 0.2, 100), probe(2, 0.2, 100)])["seconds"] is None  # no first call
    assert estimate.warmup_seconds([probe(0, 0.5, 100), probe(1, 0.2, 100, error=True)])["seconds"] is None
    ids = [r["prompt_id"] for r in probe_rows([{"prompt_id": "a"}, {"prompt_id": "b"}, {"prompt_id": "c"}],
                                              "prompt_id")]
    assert ids == ["a~warmup0", "b~warmup0", "a~warmup1", "b~warmup1", "a~warmup2", "b~warmup2"]


# ---------------------------------------------------------------------------------------------------------------
# The runs and the share


RAW = {"name": "j", "data": {"source": "builtin:demo-prompts"}, "models": {"target": "builtin:tiny-target",
                                                                           "reward": {"kind": "lexical"}},
       "method": {"name": "best_of_n", "n": 16}, "output": {"path": "runs/j"}}
METHODS = ([{"name": "best_of_n", "n": k} for k in (1, 2, 4, 8, 16)]
           + [{"name": "speculative_rejection", "n": n, "alpha": 0.5} for n in (4, 8, 16)])


def test_best_of_n_configs_share_one_run_at_their_largest_n():
    verified = {**RAW, "models": {"target": "builtin:tiny-target", "reward": {"kind": "logprob"},
                                  "verifier": {"kind": "math"}}}
    runs = layout(verified, METHODS + [{"name": "best_of_n", "n": 4, "stop_after_verified": 1}])
    assert [r.label for r in runs] == ["bon-n16", "sr-n4", "sr-n8", "sr-n16", "bon-n4-stop_after_verified1"]
    assert runs[0].serves == (("bon-n1", 1), ("bon-n2", 2), ("bon-n4", 4), ("bon-n8", 8), ("bon-n16", 16))
    assert runs[0].units == 16 and runs[1].serves == (("sr-n4", None),) and runs[1].units == 4
    assert runs[4].serves == (("bon-n4-stop_after_verified1", None),)  # a stop rule: its own run
    lowered = runs[0].lowered(RAW)
    assert (lowered.label, lowered.units, lowered.serves[-1]) == ("bon-n8", 8, ("bon-n8", 8))


def test_the_sweep_fits_its_share_cutting_the_sample_then_the_costliest_configs():
    # against a job of Best-of-16 each run counts at least 16 candidates per prompt (a step costs about the same at
    # any width): 16 x 4 = 64 per sampled prompt, and the probe 6 x 16
    runs = layout(RAW, METHODS)
    # 10,000 prompts of Best-of-16 at 10%: 16,000 candidates, room for the 64 prompts asked
    got = size_sweep(runs, RAW, 10_000, 64, 0.1, 16, "bon-n16")
    assert got.sample == 64 and got.cut == [] and got.planned == 64 * 64 + 96 <= got.allowed == 16_000
    # 500 prompts: 800 candidates; the sample would shrink below 30, so configs go, the most candidates first:
    # sr-n16 (tied with the job's own bon-n16, which is never cut), sr-n8, sr-n4; then the sample grows back
    got = size_sweep(runs, RAW, 500, 64, 0.1, 16, "bon-n16")
    assert got.cut == ["sr-n16", "sr-n8", "sr-n4"] and [r.label for r in got.runs] == ["bon-n16"]
    assert got.sample == (800 - 96) // 16 == 44 and got.planned <= got.allowed
    # a Best-of-N run above the job's own method drops to the next n, keeping its smaller Best-of-k
    got = size_sweep(runs, RAW, 500, 64, 0.1, 8, "bon-n8")
    assert got.cut == ["sr-n16", "bon-n16", "sr-n8", "sr-n4"] and got.runs[0].label == "bon-n8"
    assert got.runs[0].serves[-1] == ("bon-n8", 8) and got.sample == (400 - 48) // 8
    # asked for fewer than 30: that is the smallest useful sample
    assert size_sweep(runs, RAW, 500, 10, 1.0, 16, "bon-n16").sample == 10
    with pytest.raises(TooSmall) as err:
        size_sweep(runs, RAW, 200, 64, 0.1, 16, "bon-n16")
    text = str(err.value)
    # the job's own method alone: (30 + 6) x 16 = 576 candidates of 200 x 16 = 3,200: 18% of the job
    assert "--sweep-share 0.1: the job is too small to plan: its 200 prompt(s)" in text
    assert "(bon-n16 on 30 sampled prompts, with the warm-up probe) counts 576, 18% of the job" in text
    assert text.endswith("plan it anyway with --sweep-share 0.18")
    assert parse_share("10%") == pytest.approx(0.1) and parse_share("2") == 2.0
    for bad in ("0", "-1", "nan", "ten"):
        with pytest.raises(ValueError, match="--sweep-share"):
            parse_share(bad)


def test_the_sample_carries_the_columns_the_verifier_reads(tmp_path):
    cfg = job_config(tmp_path, models={"target": "builtin:tiny-target", "reward": {"kind": "logprob"},
                                       "verifier": {"kind": "math", "answer_column": "prompt_id"}})
    got = columns(validate_config(cfg))
    assert got["reward"] == ["prompt_id"] and got["id"] == "prompt_key" and got["prompt"] == "prompt"


# ---------------------------------------------------------------------------------------------------------------
# The verified rate and the cost of a pass, projected


def test_the_verified_rate_and_the_usd_per_verified_prompt_are_projected():
    # four sampled prompts: 3,600 device-seconds each ($2 at $2 per hour), two verified, one an error
    m = pj.Measured("x", np.array([1.0, 0.0, 1.0, math.nan]), np.ones(4), np.ones(4), np.full(4, 10.0),
                    np.full(4, 3600.0), 1, np.array([1.0, 0.0, 1.0, math.nan]))
    got = pj.project([m], prompts=100, actors=2, usd_per_device_hour=2.0, fixed_seconds=0.0,
                     warmup_seconds=36.0)[0]["figures"]
    assert got["verified_rate"]["value"] == pytest.approx(2 / 3)
    # the three prompts that ran cost $6 for two verified: $3, plus the full run's warm-up (2 x 36 s = $0.04)
    # over its 50 verified prompts
    assert got["usd_per_verified"]["value"] == pytest.approx(3.0 + 0.04 / 50)
    assert got["flops_per_verified"]["value"] == pytest.approx(15.0)
    low, high = got["usd_per_verified"]["interval"]
    assert low <= got["usd_per_verified"]["value"] and (high is None or high >= low)
    assert got["device_hours"]["value"] == pytest.approx(100 + 72 / 3600)  # the warm-up, once per worker
    none = pj.Measured("y", np.zeros(2), np.ones(2), np.ones(2), None, np.ones(2), 0, np.zeros(2))
    figures = pj.project([none], 10, 1, 2.0, 0.0)[0]["figures"]
    assert figures["verified_rate"]["value"] == 0.0 and figures["usd_per_verified"] is None


# ---------------------------------------------------------------------------------------------------------------
# plan.md's commands, with paths that hold spaces


def _plan(tmp_path: Path, folder: str) -> dict:
    fig = {"value": 1.0, "interval": [0.5, 1.5], "per_prompt": 0.01}
    projection = {name: fig for name in ("mean_best_reward", "generated_tokens", "processed_tokens", "flops",
                                         "device_hours", "usd", "wall_seconds")}
    chars = {"prompts": 10, "mean": 5.0, "min": 1, "median": 5.0, "p95": 9.0, "max": 10}
    return {
        "job": {"name": "j", "actors": 1, "usd_per_device_hour": 2.0, "output": f"{folder}/runs/full it"},
        "dataset": {"prompts": 100, "rows": 100, "input_errors": 0, "source": "p.jsonl", "limit": None},
        "sample": {"prompts": 10, "fraction": 0.1, "seed": 0, "file": "s.jsonl", "sha256": "0" * 64,
                   "prompt_chars": {"dataset": chars, "sample": chars}},
        "question": {"text": "the knee"}, "level": 0.95, "caveats": [], "reward": {"definition": "r"},
        "answer": {"label": "bon-n2", "why": "the knee", "given": {"name": "best_of_n", "n": 2},
                   "config_file": f"{folder}/config.yaml"},
        "configs": [{"label": "bon-n2", "method": {"name": "best_of_n", "n": 2}, "projection": projection,
                     "frontier": {"on_frontier": True}, "best_of_k": 2, "measured_from": "bon-n4"}],
        "frontier": {"order": ["bon-n2"], "knee": "bon-n2", "basis": "compute"},
        "sweep": {"runs": ["bon-n4"], "cut": ["sr-n4"], "sample": 10, "asked": 64, "share": 0.1,
                  "allowed_candidates": 800.0, "planned_candidates": 64.0, "job_candidates_per_prompt": 4,
                  "probe": {"method": {"name": "best_of_n", "n": 4}, "prompts": 2, "calls": 3}},
        "warmup": {"seconds": 0.25, "calls": [{"device_seconds": 1.0, "processed_tokens": 10}],
                   "removed_seconds": [0.25], "full_run_seconds": 0.25},
        "sweep_cost": {"device_seconds": 1.0, "usd": 0.01, "processed_tokens": 10, "flops": None,
                       "fraction_of_full_run_usd": 0.05, "fraction_of_full_run_flops": None, "full_run": "bon-n2",
                       "of_job": {"label": "bon-n4", "fraction_usd": 0.03, "fraction_flops": None}},
        "wall_model": {"fixed_seconds": 1.0, "actors": 1}, "folder": folder,
        "command": "winnow plan 'a b.yaml'",
    }


def test_every_command_plan_md_prints_copy_pastes_with_spaces_in_its_paths(tmp_path):
    folder = str(tmp_path / "my plans" / "it's here")
    md = markdown(_plan(tmp_path, folder))
    block = md.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert shlex.split(block[0]) == ["winnow", "generate", f"{folder}/config.yaml"]
    assert shlex.split(block[1]) == ["winnow", "report", f"{folder}/runs/full it", "--plan", folder, "--out",
                                     "REPORT_DIR"]
    assert "To fit, it cut the sample, from 64 prompts to 10 and the configs sr-n4." in md
    assert "| bon-n2 | best_of_n (from bon-n4) |" in md and "0.250 device-seconds per actor" in md


# ---------------------------------------------------------------------------------------------------------------
# `winnow report --plan`: settings a method does not use, and why a run was not checked


def _yaml(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def test_a_best_of_n_run_is_the_quickstarts_planned_job_though_only_the_quickstart_sets_a_draft():
    quickstart, best_of_n = _yaml("quickstart.yaml"), _yaml("best_of_n.yaml")
    planned_method = validate_config({**quickstart, "method": best_of_n["method"]}).method.model_dump(mode="json")
    other, device = differences({**quickstart, "method": planned_method}, best_of_n)
    assert other == [] and device == []
    # a method that uses the draft (the speculative sampler) still tells the two apart
    sampled = {**best_of_n, "generation": {**best_of_n["generation"], "sampler": "speculative"},
               "models": {**best_of_n["models"], "draft": "builtin:tiny-target"}}
    planned = {**quickstart, "generation": {**quickstart["generation"], "sampler": "speculative"},
               "method": planned_method}
    assert differences(planned, sampled)[0] == ["models.draft"]
    # what the run reads is still compared
    longer = {**best_of_n, "generation": {**best_of_n["generation"], "max_new_tokens": 64}}
    assert differences({**quickstart, "method": planned_method}, longer)[0] == ["generation.max_new_tokens"]


def _quickstart_plan(tmp_path: Path) -> Path:
    quickstart = validate_config(_yaml("quickstart.yaml")).model_dump(mode="json")
    bon = validate_config({**_yaml("quickstart.yaml"), "method": {"name": "best_of_n", "n": 2}})
    fig = (lambda v, lo, hi: {"value": v, "interval": [lo, hi]})
    projection = {"mean_best_reward": fig(0.5, 0.4, 0.6), "generated_tokens": fig(400, 300, 500),
                  "processed_tokens": fig(400, 300, 500), "flops": None, "device_hours": fig(0.01, 0.0, 0.02),
                  "usd": fig(0.02, 0.0, 0.04), "wall_seconds": fig(40, 0, 80)}
    plan = {"format": PLAN_FORMAT, "command": "winnow plan configs/quickstart.yaml",
            "job": {"name": "quickstart", "config": quickstart, "actors": 1, "usd_per_device_hour": 2.0},
            "dataset": {"prompts": 16}, "sample": {"prompts": 16}, "answer": {"label": "bon-n2"}, "level": 0.95,
            "device": None, "device_line": None, "wall_model": {"fixed_seconds": 0.0},
            "configs": [{"label": "bon-n2", "method": bon.method.model_dump(mode="json"), "projection": projection}]}
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder


def _run_of(tmp_path: Path, name: str, config: dict) -> str:
    rows = [row(f"p{i}", [cand("a", 0.5, tokens=10), cand("b", 0.1, tokens=10)], device_seconds=1.0)
            for i in range(16)]
    uri = write_run(str(tmp_path / name), rows, name=name, method_params={"n": 2})
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    manifest["config"] = {**config, "output": {"path": uri}}
    (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))
    return uri


def test_report_plan_checks_a_best_of_n_run_against_the_quickstarts_plan_and_says_why_it_would_not(tmp_path):
    plan = _quickstart_plan(tmp_path)
    bon = {**_yaml("best_of_n.yaml"), "method": {"name": "best_of_n", "n": 2}}
    good = _run_of(tmp_path, "bon", bon)
    other = _run_of(tmp_path, "longer", {**bon, "generation": {**bon["generation"], "max_new_tokens": 64}})
    got = winnow("report", good, other, "--plan", str(plan), "--out", str(tmp_path / "report"))
    assert got.returncode == 0, got.stderr
    assert ("Plan check: bon as bon-n2: 5 of 6 checked figures inside their 95% intervals (outside: wall-clock); "
            "not checked: FLOPs (not projected).") in got.stdout
    # the reason a run was not checked is on the terminal, not only in report.md
    assert ("Plan check: longer as bon-n2: not checked: the run is not the planned job (it differs in "
            "generation.max_new_tokens): its figures are shown, none is checked.") in got.stdout
    block = json.loads((tmp_path / "report" / "report.json").read_text())["plan"]
    assert block["runs"][0]["checked"] == 6 and block["runs"][1]["checked"] == 0
    assert terminal_lines(block)[1].startswith("Plan check: longer as bon-n2: not checked:")


def test_report_plan_checks_the_verified_rate_and_the_usd_per_verified_prompt(tmp_path):
    plan_dir = _quickstart_plan(tmp_path)
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan["verifier"] = True
    # 16 prompts, 4 verified: rate 0.25 inside [0.1, 0.4]; $2 per device-hour, 1 s each: $0.00889 / 4 = $0.00222,
    # outside [$0.005, unbounded]
    plan["configs"][0]["projection"].update({"verified_rate": {"value": 0.3, "interval": [0.1, 0.4]},
                                             "usd_per_verified": {"value": 0.01, "interval": [0.005, None]}})
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    uri = _run_of(tmp_path, "bon", {**_yaml("best_of_n.yaml"), "method": {"name": "best_of_n", "n": 2}})
    for part in (tmp_path / "bon" / "candidates").glob("*.parquet"):  # mark 4 of the 16 answers verified
        rows = pq.read_table(part).to_pylist()
        for r in rows:
            r["stats"]["best_verified"] = int(r["prompt_id"][1:]) < 4
        pq.write_table(rows_to_table(rows), part)
    got = winnow("report", uri, "--plan", str(plan_dir), "--out", str(tmp_path / "report"))
    assert got.returncode == 0, got.stderr
    check = json.loads((tmp_path / "report" / "report.json").read_text())["plan"]["runs"][0]
    figures = {f["figure"]: f for f in check["figures"]}
    assert figures["verified_rate"]["actual"] == 0.25 and figures["verified_rate"]["inside"] is True
    assert figures["usd_per_verified"]["actual"] == pytest.approx(16 / 3600 * 2 / 4)
    assert figures["usd_per_verified"]["inside"] is False
    assert "outside: wall-clock, USD per verified prompt" in got.stdout
