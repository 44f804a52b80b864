"""Renamed settings (`schemas.compat`): an old name still reads as its new one, with one warning line naming the new
one; an old name and its new one set apart is an error naming both; a config keeps the hash it had under the old
names, so its run folder resumes; and what reads a written config (a manifest, a plan, a recipe's ledger) reads
either spelling."""

import copy
import json

import pytest

from conftest import job_config, winnow, write_config
from test_config_engine import FIXED  # the config whose hash is pinned
from schemas import compat
from schemas.base import ConfigError
from schemas.config import apply_overrides, load_config, validate_config
from schemas.manifest import Manifest
from schemas.methods import SpeculativeRejection

SR = {"name": "speculative_rejection", "n": 8, "scoring_steps": 1}
MODELS = FIXED["models"]

# (sections written with the old names, the same with the new ones, the hash the old names had before the renames)
HASHES = [
    ({"resources": {"workers": 2, "gpus_per_worker": 0.5, "cpus_per_worker": 2, "prompts_per_batch": 8}},
     {"resources": {"actors": 2, "gpus_per_actor": 0.5, "cpus_per_actor": 2, "prompts_per_call": 8}},
     "4f334c28efbec2e1"),
    ({"resources": {"workers": {"min": 1, "max": 3}, "prompts_per_batch": 16, "feed_calls": True}},
     {"resources": {"actors": {"min": 1, "max": 3}, "prompts_per_call": 16, "feed_calls": True}},
     "cf8bff182c749ca3"),
    ({"resources": {"workers": 1, "gpus_per_worker": 0, "cpus_per_worker": 1, "prompts_per_batch": None}},
     {"resources": {"actors": 1, "gpus_per_actor": 0, "cpus_per_actor": 1, "prompts_per_call": None}},
     "5227cd85704df4ad"),
    ({"method": {**SR, "memory_budget_mb": 64}}, {"method": {**SR, "pool_kv_cache_mb": 64}}, "f918d1e5ac3c0c39"),
    ({"method": {**SR, "kv_space_mb": 64}}, {"method": {**SR, "pool_kv_cache_mb": 64}}, "f918d1e5ac3c0c39"),
]


def _with(sections: dict) -> dict:
    cfg = copy.deepcopy(FIXED)
    cfg.update(copy.deepcopy(sections))
    return cfg


@pytest.mark.parametrize("old, new, digest", HASHES)
def test_a_renamed_setting_keeps_its_hash_under_either_name(old, new, digest):
    # the literals were computed before the renames, from configs written with the old names
    assert validate_config(_with(old)).hash() == validate_config(_with(new)).hash() == digest


def test_the_settings_renamed_before_hash_as_they_did_under_the_name_written():
    """models.vllm_kv_cache_mb and vllm_max_num_seqs hashed apart from kv_cache_mb and max_num_seqs: each name keeps
    its own hash (the literals are from before they became aliases)."""
    assert validate_config(_with({"models": {**MODELS, "vllm_kv_cache_mb": 512}})).hash() == "4cfdf4b52de322fa"
    assert validate_config(_with({"models": {**MODELS, "kv_cache_mb": 512}})).hash() == "2ad73cfc644b4011"
    assert validate_config(_with({"models": {**MODELS, "vllm_max_num_seqs": 8}})).hash() == "82488d4ed6553d32"
    assert validate_config(_with({"models": {**MODELS, "max_num_seqs": 8}})).hash() == "8c571ac97b04a15e"
    assert validate_config(_with({"models": {**MODELS, "vllm_max_num_seqs": 256}})).hash() == "5227cd85704df4ad"


@pytest.mark.parametrize("path, digest", [
    ("configs/quickstart.yaml", "9ac9fc8c268745a6"), ("configs/best_of_n.yaml", "8280c089cd10e245"),
    ("configs/smollm2.yaml", "b18c5ddf757068c0"), ("configs/vllm.yaml", "584d8ca271f3320c"),
    ("configs/word-problems.yaml", "f9507f5c5671fea5")])
def test_the_shipped_configs_under_the_new_names_keep_their_hashes(path, digest):
    sr = load_config(path).method.name == "speculative_rejection"
    work = ["method.scoring_steps=1"] if sr else []  # Speculative Rejection's work before the scoring clock
    assert load_config(path, work).hash() == digest  # their hashes when they were written with the old names


def test_each_old_name_reads_as_its_new_one():
    got = validate_config(_with({"resources": {"workers": {"min": 1, "max": 2}, "gpus_per_worker": 0.5,
                                               "cpus_per_worker": 3, "prompts_per_batch": 7},
                                 "models": {**MODELS, "vllm_kv_cache_mb": 64, "vllm_max_num_seqs": 16}}))
    r, m = got.resources, got.models
    assert (r.actors.max, r.gpus_per_actor, r.cpus_per_actor, r.prompts_per_call) == (2, 0.5, 3, 7)
    assert (m.kv_cache_mb, m.max_num_seqs, got.call_prompts()) == (64, 16, 7)
    dump = got.model_dump(mode="json")
    assert "workers" not in dump["resources"] and "vllm_kv_cache_mb" not in dump["models"]
    for old in ("kv_space_mb", "memory_budget_mb"):
        assert validate_config(_with({"method": {**SR, old: 32}})).method.pool_kv_cache_mb == 32
        assert SpeculativeRejection(**SR, **{old: 32}).pool_kv_cache_mb == 32  # a section built in code too


def test_an_old_name_and_its_new_one_set_apart_is_an_error_naming_both():
    with pytest.raises(ConfigError) as err:
        validate_config(_with({"resources": {"workers": 2, "actors": 3, "prompts_per_batch": 4,
                                             "prompts_per_call": 4}}))
    assert err.value.problems == ["resources.workers: 2 differs from resources.actors (3); resources.workers is an "
                                  "old name of resources.actors: set resources.actors alone"]
    with pytest.raises(ConfigError, match="method.kv_space_mb: 64 differs from method.pool_kv_cache_mb"):
        validate_config(_with({"method": {**SR, "kv_space_mb": 64, "pool_kv_cache_mb": 32}}))
    same = validate_config(_with({"resources": {"gpus_per_worker": 1, "gpus_per_actor": 1}}))
    assert same.resources.gpus_per_actor == 1  # equal values: one setting, said twice


def test_a_problem_names_a_renamed_setting_as_the_config_writes_it():
    with pytest.raises(ConfigError) as err:
        validate_config(_with({"resources": {"workers": {"min": 3, "max": 1}, "prompts_per_batch": 0}}))
    assert sorted(err.value.problems) == [
        "resources.prompts_per_batch: Input should be greater than or equal to 1 (got 0)",
        "resources.workers.max: 1 is below resources.workers.min (3)"]
    with pytest.raises(ConfigError) as err:
        validate_config(_with({"resources": {"actors": {"min": 3, "max": 1}}}))
    assert err.value.problems == ["resources.actors.max: 1 is below resources.actors.min (3)"]


def test_an_old_name_is_no_key_of_a_method_without_the_setting():
    with pytest.raises(ConfigError) as err:
        validate_config(_with({"method": {"name": "best_of_n", "n": 4, "memory_budget_mb": 8}}))
    assert err.value.problems[0].startswith("method.memory_budget_mb: ")


def test_a_set_override_replaces_the_setting_under_whichever_name_the_config_holds():
    raw = {"resources": {"actors": {"min": 1, "max": 2}, "gpus_per_worker": 1}}
    assert apply_overrides(raw, ["resources.workers=4"])["resources"] == {"workers": 4, "gpus_per_worker": 1}
    assert apply_overrides(raw, ["resources.gpus_per_actor=0"])["resources"] == {
        "actors": {"min": 1, "max": 2}, "gpus_per_actor": 0}
    assert apply_overrides(raw, ["resources.workers.max=5"])["resources"]["actors"] == {"min": 1, "max": 5}
    assert raw["resources"] == {"actors": {"min": 1, "max": 2}, "gpus_per_worker": 1}  # the given dict is kept


def test_validate_warns_once_per_old_name_and_prints_the_new_names(tmp_path):
    cfg = job_config(tmp_path)
    cfg["resources"] = {"workers": 1, "prompts_per_batch": 2}
    path = write_config(tmp_path / "old.yaml", cfg)
    got = winnow("validate", str(path), "--set", "resources.cpus_per_worker=1")
    assert got.returncode == 0, got.stderr
    assert got.stderr.splitlines() == [
        "winnow: warning: resources.workers is deprecated; use resources.actors",
        "winnow: warning: resources.cpus_per_worker is deprecated; use resources.cpus_per_actor",
        "winnow: warning: resources.prompts_per_batch is deprecated; use resources.prompts_per_call"]
    assert "actors: 1" in got.stdout and "prompts_per_call: 2" in got.stdout and "workers" not in got.stdout
    new = winnow("validate", str(write_config(tmp_path / "new.yaml", job_config(tmp_path))))
    assert new.returncode == 0 and new.stderr == ""
    assert got.stdout.splitlines()[0].split("config hash ")[1] == new.stdout.splitlines()[0].split("config hash ")[1]


def test_old_python_attributes_read_the_new_fields():
    """Code not yet renamed (workers/) reads resources.gpus_per_worker, models.kv_space_mb and the memory
    schedule's cap by their old names."""
    got = validate_config(_with({"resources": {"gpus_per_actor": 0.25, "cpus_per_actor": 2},
                                 "models": {**MODELS, "kv_cache_mb": 96}, "method": {**SR, "pool_kv_cache_mb": 8}}))
    assert (got.resources.gpus_per_worker, got.resources.cpus_per_worker) == (0.25, 2)
    assert got.models.kv_space_mb == 96 and got.method.kv_space_cap_mb() == 8


# ---------------------------------------------------------------------------------------------------------------
# What reads a written config


def old_release(dump: dict) -> dict:
    """A job config's dump as the release before the renames wrote it in a manifest: the old names, and the old
    duplicate names of a setting as null."""
    out = copy.deepcopy(dump)
    r = out["resources"]
    for new, old in (("actors", "workers"), ("gpus_per_actor", "gpus_per_worker"),
                     ("cpus_per_actor", "cpus_per_worker"), ("prompts_per_call", "prompts_per_batch")):
        r[old] = r.pop(new)
    out["models"].update(vllm_kv_cache_mb=None, vllm_max_num_seqs=None)
    if "pool_kv_cache_mb" in out["method"]:
        out["method"]["memory_budget_mb"] = out["method"].pop("pool_kv_cache_mb")
        out["method"]["kv_space_mb"] = None
    return out


def test_a_manifest_of_the_release_before_reads_under_the_new_names(tmp_path):
    dump = validate_config(_with({"method": {**SR, "pool_kv_cache_mb": 16}})).model_dump(mode="json")
    old = old_release(dump)
    assert "workers" in old["resources"] and old["method"]["memory_budget_mb"] == 16
    manifest = Manifest.model_validate({"name": "m", "config": old, "config_hash": "x", "winnow_version": "0",
                                        "started_at": "2024-01-01T00:00:00Z"})
    assert manifest.config == dump
    assert validate_config(old).hash() == validate_config(dump).hash()


def test_an_old_run_folder_resumes_and_a_changed_config_names_the_new_key(tmp_path):
    from runfolder.folder import RunFolder, as_first_spelled, claim_problems
    from runfolder.manifest import new_manifest

    config = validate_config(job_config(tmp_path, resources={"actors": 2}))
    manifest = new_manifest(config, prompts=4).model_dump(mode="json")
    manifest["config"] = old_release(manifest["config"])  # written by the release before, hash and all
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert claim_problems(RunFolder(str(run)), config, overwrite=False) == ([], "resume")
    old_spelling = job_config(tmp_path)
    old_spelling["resources"] = {"workers": 2, "prompts_per_batch": 2}
    old_spelling = validate_config(old_spelling)
    assert claim_problems(RunFolder(str(run)), old_spelling, overwrite=False) == ([], "resume")
    moved = validate_config(job_config(tmp_path, resources={"actors": 2}, output={"path": f"{run}/"}))
    assert as_first_spelled(RunFolder(str(run)), moved).hash() == config.hash()  # only output.path is spelled apart
    problems, mode = claim_problems(RunFolder(str(run)), validate_config(job_config(tmp_path)), overwrite=False)
    assert mode == "resume" and "changed: resources.actors)" in problems[0]


def test_a_plan_of_the_release_before_reads_under_the_new_names():
    plan = {"job": {"config": {"resources": {"workers": 2, "gpus_per_worker": 1}}, "workers": 2, "least_workers": 1},
            "sample": {"prompts": 8, "sweep_workers": 1},
            "wall_model": {"fixed_seconds": 1.0, "workers": 2, "sweep_runs": [{"wall_seconds": 3.0, "workers": 1}]},
            "configs": [{"label": "sr", "method": {**SR, "kv_space_mb": 4}, "given": {**SR, "kv_space_mb": 4}}],
            "device": {"kind": "gpu", "gpus_per_worker": 1, "cpus_per_worker": 1}}
    got = compat.current_plan(plan)
    assert got["job"] == {"config": {"resources": {"actors": 2, "gpus_per_actor": 1}}, "actors": 2, "least_actors": 1}
    assert got["sample"]["sweep_actors"] == 1 and got["wall_model"]["actors"] == 2
    assert got["wall_model"]["sweep_runs"] == [{"wall_seconds": 3.0, "actors": 1}]
    assert got["configs"][0]["method"] == got["configs"][0]["given"] == {**SR, "pool_kv_cache_mb": 4}
    assert got["device"] == {"kind": "gpu", "gpus_per_actor": 1, "cpus_per_actor": 1}
    assert plan["job"]["workers"] == 2  # the plan read is left as it was


def test_a_recipe_step_finished_under_the_old_names_counts_as_finished_with_the_same_settings():
    from rounds.ledger import flat_diff
    from rounds.recipe import current_inputs

    old = {"config": {"resources": {"prompts_per_batch": 8}, "method": {**SR, "kv_space_mb": None,
                                                                        "memory_budget_mb": 4}}}
    new = {"config": {"resources": {"prompts_per_call": 8}, "method": {**SR, "pool_kv_cache_mb": 4}}}
    assert flat_diff(old, new) != []
    assert flat_diff(current_inputs(old), current_inputs(new)) == []


def test_the_reference_lists_each_old_name_under_its_new_key():
    from schemas.reference import render

    text = render()
    row = next(line for line in text.splitlines() if line.startswith("| `resources.actors` |"))
    assert row.endswith("Deprecated old name: `resources.workers` (still read, with a warning). |")
    row = next(line for line in text.splitlines() if line.startswith("| `method.pool_kv_cache_mb` |"))
    assert "Deprecated old names: `method.kv_space_mb`, `method.memory_budget_mb`" in row
    for old in compat.ALIASES:
        assert f"| `{old}` |" not in text  # not a key of its own
