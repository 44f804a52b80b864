"""`winnow rounds`, Expert Iteration closed: the concept-set prompts it trains and evaluates on, its config and plan,
the round series in `winnow report` (hand-made runs, no Ray), and on the tiny trio (slow: Ray and TRL) a round
whose held-out reward rises beyond its interval, an empty SFT set, a failed training and kills at the training and
evaluation steps, each continued by the same command."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from assets import concept_sets, everyday, world
from conftest import ROOT
from conftest_runs import row, write_run, cand
from jobs import rounds as rounds_cli
from reporting.render import build_report, render_markdown
from reporting.rounds import LINEAGE_FILE, CostOf, ModelLineage, write_lineage
from rounds.config import validate_recipe
from rounds.recipe import Recipe
from rounds.train import missing_packages
from runfolder.runs import load_runs
from schemas.base import InputError

# ---------------------------------------------------------------------------------------------------------------
# Prompts


@pytest.mark.parametrize("vocabulary", concept_sets.VOCABULARIES)
def test_concept_sets_are_deterministic_and_the_splits_disjoint(vocabulary):
    train, heldout = concept_sets.split(vocabulary, 300, 96, seed=3)
    assert (train, heldout) == concept_sets.split(vocabulary, 300, 96, seed=3)
    assert concept_sets.split(vocabulary, 300, 96, seed=4)[1] != heldout
    assert len(train) == 300 and len(heldout) == 96
    keys = lambda rows: [world.concept_key(r["concepts"]) for r in rows]  # noqa: E731
    assert len(set(keys(train))) == 300 and len(set(keys(heldout))) == 96  # no set twice in a split
    assert not set(keys(train)) & set(keys(heldout))  # and none in both
    assert len({r["id"] for r in train + heldout}) == 396
    for r in train + heldout:
        assert all(c in r["prompt"] for c in r["concepts"]) and 3 <= len(r["concepts"]) <= 5
    # the first held-out sets do not move when the training split grows
    assert concept_sets.split(vocabulary, 10, 96, seed=3)[1] == heldout


def test_everyday_sets_draw_on_the_word_list_and_tiny_sets_avoid_the_models_training_sets():
    train, heldout = concept_sets.split("everyday", 200, 96)
    words = {w for ws in everyday.CLASSES.values() for w in ws}
    assert all(set(r["concepts"]) <= words for r in train + heldout)
    assert heldout[0]["prompt"].startswith("Write one sentence that uses all of these words: ")
    trained = concept_sets._tiny_trained_sets()
    _, tiny_heldout = concept_sets.split("tiny-world", 50, 96)
    assert not {world.concept_key(r["concepts"]) for r in tiny_heldout} & trained


def test_everyday_words_are_checked(monkeypatch):
    everyday.check_words()
    monkeypatch.setattr(everyday, "CLASSES", {**everyday.CLASSES, "verbs": everyday.VERBS + ["walks"]})
    with pytest.raises(ValueError, match=r"\['walks'\] would count as the concept 'walk'"):
        everyday.check_words()
    monkeypatch.setattr(everyday, "CLASSES", {**everyday.CLASSES, "verbs": everyday.VERBS + ["dog"]})
    with pytest.raises(ValueError, match="'dog' is listed twice"):
        everyday.check_words()


# ---------------------------------------------------------------------------------------------------------------
# Config and plan


def recipe_dict(out: Path, **over) -> dict:
    """The tiny trio's recipe: 128 training and 64 held-out tiny-world prompts, Best-of-8 data, a full fine-tune."""
    cfg = {
        "name": "tiny", "out": str(out), "rounds": 1, "model": "builtin:tiny-target", "reward": {"kind": "lexical"},
        "prompts": {"vocabulary": "tiny-world", "train": 128, "heldout": 64},
        "sources": {"bon": {"name": "best_of_n", "n": 8}},
        "job": {"generation": {"max_new_tokens": 48}, "resources": {"prompts_per_call": 8}},
        "train": {"epochs": 5, "learning_rate": 1.0e-3, "cpu_threads": 1},
        "evaluation": {"greedy": False},
    }
    for key, value in over.items():  # these sections are merged, the others replaced
        cfg[key] = {**cfg.get(key, {}), **value} if key in ("prompts", "train", "evaluation", "sft") else value
    return cfg


def write_recipe(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_shipped_recipes_validate_with_every_job_config_they_make():
    from schemas.config import validate_config

    paths = sorted((ROOT / "examples").glob("rounds-*.yaml"))
    assert [p.name for p in paths] == ["rounds-smollm2.yaml", "rounds-tiny.yaml"]
    for path in paths:
        recipe = Recipe(validate_recipe(yaml.safe_load(path.read_text()), str(path)), "test", None, None, None)
        for step in recipe.steps:
            if step.kind == "generate":
                validate_config(step.config)


def test_the_plan_names_every_folder_and_run_by_round(tmp_path):
    cfg = validate_recipe(recipe_dict(tmp_path / "ei", rounds=2, evaluation={"greedy": True},
                                      sources={"bon": {"name": "best_of_n", "n": 8},
                                               "sr": {"name": "speculative_rejection", "n": 8}}))
    recipe = Recipe(cfg, "test", generate=None, concept_sets=None, resolve=None)
    ids = [s.id for s in recipe.steps]
    assert ids[:3] == ["prompts", "round-0/eval-sample", "round-0/eval-greedy"]
    assert ids[3:9] == ["round-1/bon/data", "round-1/bon/sft", "round-1/bon/train", "round-1/bon/eval-sample",
                        "round-1/bon/eval-greedy", "round-1/sr/data"]
    assert len(ids) == 3 + 2 * 2 * 5
    for s in recipe.steps:  # each step writes at the path of its id; a training, its model
        assert s.path == str(tmp_path / "ei" / s.id.replace("/", os.sep)).replace(f"{os.sep}train", f"{os.sep}model")
    data2 = recipe.step("round-2/sr/data")
    assert data2.config["models"]["target"] == str(tmp_path / "ei" / "round-1" / "sr" / "model")  # k-1's model
    assert data2.config["name"] == "tiny-round-2-sr-data" and data2.config["method"]["name"] == "speculative_rejection"
    assert recipe.step("round-0/eval-sample").config["models"]["target"] == "builtin:tiny-target"
    assert recipe.step("round-1/bon/eval-greedy").config["method"] == {"name": "greedy"}
    assert recipe.step("round-1/bon/eval-sample").config["data"]["source"] == str(tmp_path / "ei/prompts/heldout.jsonl")


@pytest.mark.parametrize("change, expected", [
    ({"sources": {}}, "sources: Dictionary should have at least 1 item"),
    ({"evaluation": {"sample": {"name": "best_of_n", "n": 4}}}, "evaluation.sample: Value error, must draw one sample"),
    ({"job": {"name": "x", "models": {"target": "y"}}}, "job: Value error, name, models.target: set by the recipe"),
    ({"prompts": {"train_source": "a.jsonl"}}, "prompts: Value error, give either vocabulary"),
    ({"sft": {"select": "top-3"}}, "sft.select: Value error"),
    ({"colour": 1}, "colour: unknown key"),
    ({"job": {"generation": {"max_new_tokens": 0}}}, "the job config of round-0/eval-sample (and perhaps others): "
                                                      "generation.max_new_tokens: Input should be greater than or "
                                                      "equal to 1"),
    ({"model": "/nowhere/model"}, "model: /nowhere/model"),
    ({"sources": {"b o n": {"name": "best_of_n"}}}, "sources: Value error, source names must be"),
])
def test_bad_recipes_exit_2_naming_the_field_and_write_nothing(tmp_path, capsys, change, expected):
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tmp_path / "ei", **change))
    assert rounds_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert not (tmp_path / "ei").exists()


def test_entry_points():
    proc = subprocess.run([sys.executable, "-m", "jobs.rounds", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: winnow rounds" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "rounds", "missing.yaml"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "missing.yaml: recipe file not found" in proc.stderr


def test_a_folder_that_holds_something_else_is_refused(tmp_path, capsys):
    (tmp_path / "ei").mkdir()
    (tmp_path / "ei" / "notes.txt").write_text("mine")
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tmp_path / "ei"))
    assert rounds_cli.main([str(path)]) == 2
    assert "exists, is not empty and holds no" in capsys.readouterr().err
    assert os.listdir(tmp_path / "ei") == ["notes.txt"]


def test_a_finished_step_made_with_other_settings_is_refused_before_anything_runs(tmp_path, capsys):
    from rounds.ledger import Ledger

    cfg = validate_recipe(recipe_dict(tmp_path / "ei"))
    recipe = Recipe(cfg, "test", None, None, None)
    ledger = Ledger.new(recipe.root, "tiny", cfg.model_dump(mode="json"), "test")
    os.makedirs(recipe.root)
    made = recipe.inputs(recipe.step("prompts"))
    made["prompts"] = {**made["prompts"], "seed": 1}
    del made["prompts"]["id_column"]  # a setting a later version added: no difference
    ledger.finish("prompts", "prompts", made, {}, 0.0)
    ledger.finish("round-1/bon/train", "train", {**recipe.inputs(recipe.step("round-1/bon/train")), "seed": 7}, {}, 0.0)
    before = sorted(os.listdir(recipe.root))
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tmp_path / "ei"))
    assert rounds_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "prompts: finished with other settings than the recipe's now (prompts.seed: 1 -> 0)" in err
    assert "round-1/bon/train: finished with other settings than the recipe's now (seed: 7 -> 0)" in err
    assert "id_column" not in err
    assert sorted(os.listdir(recipe.root)) == before


# ---------------------------------------------------------------------------------------------------------------
# The round series in `winnow report` (hand-made runs and lineages)


def _lineage(tmp_path, source: str, k: int, gen_usd: float, train_usd: float, previous: ModelLineage | None = None):
    folder = tmp_path / "recipe" / f"round-{k}" / source / "model"
    folder.mkdir(parents=True)
    gen = CostOf(device_seconds=gen_usd * 1800, usd=gen_usd, flops=1e12)
    train = CostOf(device_seconds=train_usd * 1800, usd=train_usd, flops=3e12)
    lin = ModelLineage(recipe="toy", recipe_folder=str(tmp_path / "recipe"), source=source,
                       source_method={"name": "best_of_n", "n": 8}, round=k, base_model="builtin:tiny-target",
                       parent_model="builtin:tiny-target", data_runs=["d"], sft="s", examples=10, generation=gen,
                       training=train,
                       cumulative_generation=gen if previous is None else CostOf(
                           device_seconds=previous.cumulative_generation.device_seconds + gen.device_seconds,
                           usd=previous.cumulative_generation.usd + gen_usd, flops=2e12),
                       cumulative_training=train if previous is None else CostOf(
                           device_seconds=previous.cumulative_training.device_seconds + train.device_seconds,
                           usd=previous.cumulative_training.usd + train_usd, flops=6e12))
    write_lineage(str(folder), lin)
    return str(folder), lin


def _eval_run(tmp_path, name: str, target: str, shift: float) -> str:
    rows = [row(f"p{i}", [cand("t", 0.1 * i + shift)], device_seconds=0.5) for i in range(1, 7)]
    return write_run(str(tmp_path / name), rows, name=name, reward={"kind": "lexical"},
                     models={"target": target}, parameters={"target": 1000})


def test_report_shows_evaluation_runs_as_a_series_of_rounds(tmp_path):
    bon1, lin1 = _lineage(tmp_path, "bon", 1, 0.01, 0.02)
    bon2, _ = _lineage(tmp_path, "bon", 2, 0.01, 0.02, previous=lin1)
    sr1, _ = _lineage(tmp_path, "sr", 1, 0.005, 0.02)
    uris = [_eval_run(tmp_path, "r0", "builtin:tiny-target", 0.0), _eval_run(tmp_path, "bon1", bon1, 0.2),
            _eval_run(tmp_path, "bon2", bon2, 0.3), _eval_run(tmp_path, "sr1", sr1, 0.15)]
    report = build_report(load_runs(uris), 0)
    seqs = {s["chain"]["source"]: s for s in report["rounds"]["series"]}
    assert set(seqs) == {"bon", "sr"}
    bon = seqs["bon"]
    assert [p["round"] for p in bon["points"]] == [0, 1, 2] and bon["prompts"] == 6  # round 0 joins both chains
    p0, p1, p2 = bon["points"]
    assert p0["mean_reward"] == pytest.approx(0.35) and p1["mean_reward"] == pytest.approx(0.55)
    assert p1["gain"] == pytest.approx(0.2) and p1["gain_interval"] == pytest.approx([0.2, 0.2])
    assert p1["rises_beyond_interval"] is True and p0["rises_beyond_interval"] is None
    assert p2["cumulative_cost"]["total"]["usd"] == pytest.approx(0.06)
    assert p2["cumulative_cost"]["generation"]["usd"] == pytest.approx(0.02)
    assert p2["gain_per_usd"] == pytest.approx(0.3 / 0.06) and p2["gain_per_usd_of_data"] == pytest.approx(15.0)
    assert p2["marginal_gain_per_usd"] == pytest.approx(0.1 / 0.03)
    assert p1["evaluation_cost"]["device_seconds"] == pytest.approx(3.0)
    (comp,) = report["rounds"]["comparisons"]  # round 1: bon 0.2 / $0.01 = 20, sr 0.15 / $0.005 = 30
    assert (comp["round"], comp["a"], comp["b"]) == (1, "bon", "sr")
    assert comp["usd"]["difference"] == pytest.approx(-10.0) and comp["usd"]["interval"] == pytest.approx([-10, -10])
    assert comp["verdict"] == comp["usd"]["verdict"] == "sr buys more held-out reward per dollar of data"
    # on compute both spent 1 TFLOP of data: sr's 0.15 against bon's 0.2 per TFLOP
    assert comp["compute"]["difference"] == pytest.approx(0.05)
    assert comp["compute"]["verdict"] == "bon buys more held-out reward per TFLOP of data"
    md = render_markdown(report, {})
    assert "## Rounds of Expert Iteration" in md and "0.200 [0.200, 0.200] **rises**" in md
    assert "| 1 | best_of_n | bon vs sr | 6 | bon $0.01, sr $0.005 | bon 20, sr 30 | -10 [-10, -10] |" in md


def test_report_files_carry_the_rounds_and_runs_without_lineage_keep_the_old_report(tmp_path, capsys):
    from jobs.report import main as report_main

    bon1, _ = _lineage(tmp_path, "bon", 1, 0.01, 0.02)
    uris = [_eval_run(tmp_path, "r0", "builtin:tiny-target", 0.0), _eval_run(tmp_path, "bon1", bon1, 0.2)]
    assert report_main([*uris, "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "Rounds, toy/bon" in out and "rises beyond its interval" in out
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [p["round"] for p in data["rounds"]["series"][0]["points"]] == [0, 1]
    assert (tmp_path / "rep" / "rounds_reward_and_cumulative_cost.png").is_file()
    plain = [_eval_run(tmp_path, "a", "builtin:tiny-target", 0.0), _eval_run(tmp_path, "b", "builtin:tiny-target", 0.1)]
    report = build_report(load_runs(plain), 0)
    assert report["rounds"] == {"series": [], "comparisons": [], "notes": []}
    assert "Rounds of Expert Iteration" not in render_markdown(report, {})


def test_the_rounds_plot_draws_every_series_and_each_chain_s_costs(tmp_path):
    from reporting import plots
    from reporting.rounds import build_series, plot_series

    bon1, _ = _lineage(tmp_path, "bon", 1, 0.01, 0.02)
    sr1, _ = _lineage(tmp_path, "sr", 1, 0.005, 0.02)
    runs = load_runs([_eval_run(tmp_path, "r0", "builtin:tiny-target", 0.0), _eval_run(tmp_path, "bon1", bon1, 0.2),
                      _eval_run(tmp_path, "sr1", sr1, 0.15)])
    fig = plots.rounds_figure(plot_series(build_series(runs, [r.name for r in runs])))
    gids = sorted({a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()})
    assert gids == ["cost:toy/bon", "cost:toy/sr", "data-cost:toy/bon", "data-cost:toy/sr",
                    "series:toy/bon, best_of_n", "series:toy/sr, best_of_n"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][:2] == ["toy/bon, best_of_n",
                                                                                  "toy/sr, best_of_n"]


def test_a_damaged_lineage_is_named(tmp_path):
    bon1, _ = _lineage(tmp_path, "bon", 1, 0.01, 0.02)
    Path(bon1, LINEAGE_FILE).write_text("{not json")
    with pytest.raises(InputError, match=f"{LINEAGE_FILE}: not valid JSON"):
        build_report(load_runs([_eval_run(tmp_path, "bon1", bon1, 0.2)]), 0)


# ---------------------------------------------------------------------------------------------------------------
# On the tiny trio: Ray and TRL


def _rows(run: Path) -> list[str]:
    files = [run / "candidates" / f for f in os.listdir(run / "candidates")]
    return [pid for f in files for pid in pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()]


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _ledger(out: Path) -> dict:
    return json.loads((out / "recipe.json").read_text())


def _kill_when(proc: subprocess.Popen, ready, what: str, timeout: float = 600) -> None:
    """SIGKILL the recipe `proc` as soon as `ready()`; fails if it ended first or `timeout` passed."""
    deadline = time.monotonic() + timeout
    try:
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the recipe ended before {what}"
        assert ready(), f"{what}: not within {timeout:g} s"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        time.sleep(1)
        try:  # the Ray processes the killed recipe started
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _committed(run: Path) -> int:
    ckpt = run / "_checkpoint"
    return len([p for p in ckpt.glob("*.parquet") if not p.name.endswith(".pending.parquet")]) if ckpt.exists() else 0


# The end-to-end round trains with TRL: the `train` extra. Skipped where it is missing, unless WINNOW_REQUIRE_TRAIN=1
# (CI sets it): then its absence fails.
MISSING_TRAIN = missing_packages(lora=False)
if MISSING_TRAIN and os.environ.get("WINNOW_REQUIRE_TRAIN") == "1":
    raise RuntimeError(f"WINNOW_REQUIRE_TRAIN=1 but {', '.join(MISSING_TRAIN)} cannot be imported; install the train "
                       "extra: pip install -e '.[train]'")


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING_TRAIN), reason="the train extra (trl) is not installed: pip install -e '.[train]'")
def test_a_round_continues_after_an_empty_sft_set_a_failed_training_and_kills_and_raises_held_out_reward(
        ray_session, tmp_path, capsys, monkeypatch):
    """One round on the tiny trio, stopped four ways, each continued by the same command: an SFT set left empty by
    its filter (exit 2), a training that raises (exit 1), SIGKILL while training, SIGKILL while evaluating; then it
    ends, with every step done once and the held-out reward of one sample above round 0's beyond its interval."""
    out = tmp_path / "ei"
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(out, sft={"min_reward": 2.0}))
    data, model = out / "round-1" / "bon" / "data", out / "round-1" / "bon" / "model"

    # every candidate filtered out: exit 2 naming the filter, nothing trained
    assert rounds_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "round-1/bon/sft: the SFT set is empty" in err
    assert "The filter that removed the last of them is `below_min_reward` (sft.min_reward: 2)" in err
    assert not (out / "round-1" / "bon" / "sft").exists() and not model.exists()
    ledger = _ledger(out)
    assert ledger["status"] == "failed" and set(ledger["steps"]) == {"prompts", "round-0/eval-sample",
                                                                    "round-1/bon/data"}
    data_started = _manifest(data)["started_at"]

    # the fixed config; the training raises: exit 1, the earlier steps kept
    write_recipe(path, recipe_dict(out))

    def broken(*args, **kwargs):
        raise RuntimeError("injected training failure")

    monkeypatch.setattr("rounds.recipe.fine_tune", broken)
    assert rounds_cli.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "round-1/bon/train: training failed: RuntimeError: injected training failure" in err
    assert (out / "round-1" / "bon" / "sft" / "hf").is_dir() and not model.exists()
    assert _ledger(out)["current"]["step"] == "round-1/bon/train"
    monkeypatch.undo()

    cmd = [sys.executable, "-m", "jobs.cli", "rounds", str(path)]
    with open(tmp_path / "first.log", "w") as log:  # killed while training
        first = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _kill_when(first, lambda: bool(list(model.parent.glob("model.tmp-*"))), "training started")
    assert _ledger(out)["current"]["step"] == "round-1/bon/train" and not model.exists()

    evaluation = out / "round-1" / "bon" / "eval-sample"
    with open(tmp_path / "second.log", "w") as log:  # killed while evaluating, after its first commit
        second = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _kill_when(second, lambda: _committed(evaluation) > 0, "the evaluation committed a batch")
    assert "continuing at round-1/bon/train" in (tmp_path / "second.log").read_text()
    assert (model / LINEAGE_FILE).is_file() and not list(model.parent.glob("model.tmp-*"))  # the killed one's gone
    assert _ledger(out)["current"]["step"] == "round-1/bon/eval-sample"

    assert rounds_cli.main([str(path)]) == 0
    assert "continuing at round-1/bon/eval-sample" in capsys.readouterr().out
    ledger = _ledger(out)
    assert ledger["status"] == "succeeded" and ledger["current"] is None and len(ledger["steps"]) == 6
    assert _manifest(data)["started_at"] == data_started  # generated once, reused by every run after
    heldout = [json.loads(line)["id"] for line in (out / "prompts" / "heldout.jsonl").read_text().splitlines()]
    for run in ("round-0/eval-sample", "round-1/bon/eval-sample"):
        assert collections.Counter(_rows(out / run)) == collections.Counter(heldout), run  # each prompt once
    lineage = json.loads((model / LINEAGE_FILE).read_text())
    assert lineage["round"] == 1 and lineage["examples"] == 128 and lineage["training"]["device_seconds"] > 0
    assert lineage["generation"]["usd"] > 0 and lineage["training"]["flops"] > 0

    # held-out reward of one sample rises beyond its interval (measured: 0.30 -> 0.46, gain [0.09, 0.23])
    summary = json.loads((out / "summary.json").read_text())
    (sample,) = summary["series"]
    r0, r1 = sample["points"]
    assert (r0["round"], r1["round"], sample["prompts"]) == (0, 1, 64)
    assert r1["rises_beyond_interval"] and r1["gain_interval"][0] > 0, (r0["mean_reward"], r1["gain_interval"])
    assert "## Held-out reward by round" in (out / "summary.md").read_text()

    # `winnow report` of the evaluation runs shows them as a series of rounds
    from jobs.report import main as report_main

    runs = [str(out / r) for r in ("round-0/eval-sample", "round-1/bon/eval-sample")]
    assert report_main([*runs, "--out", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [p["round"] for p in report["rounds"]["series"][0]["points"]] == [0, 1]


def test_every_recipe_key_is_in_the_docs():
    from pydantic import BaseModel

    from rounds import config

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():  # the leaves: sections are not keys of their own
            sections = [arg for arg in getattr(field.annotation, "__args__", ()) or (field.annotation,)
                        if isinstance(arg, type) and issubclass(arg, BaseModel) and arg.__module__ == config.__name__]
            for section in sections:
                yield from keys(section, f"{prefix}{name}.")
            if not sections:
                yield prefix + name

    doc = (ROOT / "docs" / "expert-iteration.md").read_text()
    assert [k for k in keys(config.RecipeConfig) if f"`{k}`" not in doc] == []
