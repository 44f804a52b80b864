"""models.engine and the config hash: the vLLM engine's refusals at validation, and a hash that matches run folders
across releases (fields added later leave it unchanged at their default)."""

import copy

import pytest

from schemas.base import ConfigError
from schemas.compat import NEW_WORK_DEFAULTS, ALIASES, CHANGED_DEFAULTS, LATE_FIELDS
from schemas.config import load_config, validate_config

FIXED = {
    "name": "hashcheck", "seed": 3,
    "data": {"source": "builtin:demo-prompts", "id_column": "id", "limit": 5},
    "models": {"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "builtin:tiny-reward"}},
    # scoring_steps 1: a decision at every step, the work of a config written before the scoring clock existed
    "method": {"name": "speculative_rejection", "n": 8, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 8,
               "scoring_steps": 1},
    "generation": {"max_new_tokens": 32}, "output": {"path": "runs/hashcheck"},
}
DRAFT = {
    "name": "hashcheck2", "data": {"source": "prompts.jsonl"},
    "models": {"target": "builtin:tiny-target", "draft": "builtin:tiny-draft", "reward": {"kind": "lexical"}},
    "method": {"name": "mjsd"}, "output": {"path": "s3://b/runs"},
}


def test_hash_is_the_one_before_models_engine_existed():
    # the literal values were computed at b017f35, before models.engine and models.vllm were added
    assert validate_config(FIXED).hash() == "5227cd85704df4ad"
    assert validate_config(DRAFT).hash() == "b5a114fa432825f2"
    assert load_config("configs/best_of_n.yaml").hash() == "8280c089cd10e245"
    explicit = copy.deepcopy(FIXED)
    explicit["models"]["engine"] = "hf"  # the default written out hashes as the default left out
    explicit["models"]["vllm_max_num_seqs"] = 256
    explicit["models"]["vllm_kv_cache_mb"] = None
    explicit["models"]["kv_cache_mb"] = None
    explicit["method"]["memory_candidates"] = None
    assert validate_config(explicit).hash() == "5227cd85704df4ad"


@pytest.mark.parametrize("models", [{"engine": "vllm"}, {"vllm_kv_cache_mb": 512}, {"kv_cache_mb": 512},
                                    {"vllm_max_num_seqs": 8}])
def test_a_late_field_off_its_default_changes_the_hash(models):
    cfg = copy.deepcopy(FIXED)
    cfg["models"].update(models)
    assert validate_config(cfg).hash() != "5227cd85704df4ad"


def test_kv_cache_mb_is_one_space_for_both_engines_under_either_name():
    cfg = copy.deepcopy(FIXED)
    assert validate_config(cfg).models.kv_space_mb is None
    cfg["models"]["vllm_kv_cache_mb"] = 64  # its earlier name, still read
    assert validate_config(cfg).models.kv_space_mb == 64
    cfg["models"]["kv_cache_mb"] = 64
    assert validate_config(cfg).models.kv_space_mb == 64
    cfg["models"]["kv_cache_mb"] = 32
    with pytest.raises(ConfigError, match="models.vllm_kv_cache_mb: 64 differs from models.kv_cache_mb"):
        validate_config(cfg)


def test_the_pools_kv_space_cap_is_one_setting_under_either_name():
    """method.kv_space_mb, formerly memory_budget_mb: either name caps the memory schedule's space, a run resumes
    under either (the same hash), and the two set apart is an error naming both."""
    sr = {"name": "speculative_rejection", "n": 8}
    cfg = copy.deepcopy(FIXED)
    cfg["method"] = {**sr, "memory_budget_mb": 64}
    old = validate_config(cfg)
    cfg["method"] = {**sr, "kv_space_mb": 64}
    new = validate_config(cfg)
    assert old.method.kv_space_cap_mb() == new.method.kv_space_cap_mb() == 64 and old.hash() == new.hash()
    cfg["method"] = {**sr, "kv_space_mb": 64, "memory_budget_mb": 64}
    assert validate_config(cfg).hash() == old.hash()
    cfg["method"] = {**sr, "kv_space_mb": 32}
    assert validate_config(cfg).hash() != old.hash()
    cfg["method"] = {**sr, "kv_space_mb": 32, "memory_budget_mb": 64}
    with pytest.raises(ConfigError, match="method.memory_budget_mb: 64 differs from method.kv_space_mb"):
        validate_config(cfg)


def test_late_fields_name_real_fields_and_their_defaults():
    """Each late field is a real field whose default (as hashed: a default changed since, CHANGED_DEFAULTS, hashes
    as the one before) is the one LATE_FIELDS gives."""
    python_reward = copy.deepcopy(FIXED)  # the fields of a reward kind FIXED does not use
    python_reward["models"]["reward"] = {"kind": "python", "function": "m:f"}
    dumps = [validate_config(c).model_dump(mode="json") for c in (FIXED, python_reward)]
    for path, default in LATE_FIELDS.items():
        found = []
        for dump in dumps:
            node = dump
            for part in ALIASES.get(path, path).split("."):  # an old name hashes as written: its field is the new one
                node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
            if node is not KeyError:
                found.append(node)
        assert found, f"{path}: not a field of any variant"
        node = found[0]
        if path in NEW_WORK_DEFAULTS:  # a default that changed the work: hashed, unlike the late field's meaning
            section, leaf = path.split(".")[-2:]
            left_out = copy.deepcopy(FIXED)
            left_out[section].pop(leaf, None)
            assert validate_config(left_out).model_dump(mode="json")[section][leaf] == NEW_WORK_DEFAULTS[path]
            assert NEW_WORK_DEFAULTS[path] != default(), path
            continue
        now, before = CHANGED_DEFAULTS.get(path, ((node,), node))
        assert node in now and before == default(), path


def test_a_changed_default_hashes_as_the_old_one_whether_set_or_left_out():
    """resources.prompts_per_batch's default went from 4 to 64 (calls deep enough to keep the width full): a
    config that leaves it out keeps its hash, and so does one that sets either value; another value changes it."""
    for ppb in (4, 64):
        cfg = copy.deepcopy(FIXED)
        cfg["resources"] = {"prompts_per_batch": ppb}
        assert validate_config(cfg).hash() == "5227cd85704df4ad"
    cfg["resources"] = {"prompts_per_batch": 8}
    assert validate_config(cfg).hash() != "5227cd85704df4ad"


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_width_below_n_is_refused_on_both_engines(engine):
    for name in ("max_num_seqs", "vllm_max_num_seqs"):
        cfg = _vllm(method={"name": "best_of_n", "n": 300})
        cfg["models"].update(engine=engine, **{name: 256})
        with pytest.raises(ConfigError) as err:
            validate_config(cfg)
        assert f"models.{name}: 256 is fewer than method.n (300)" in str(err.value)
        cfg["models"].pop(name)
        assert validate_config(cfg).models.width(300) == 300  # the default width grows with n


def _vllm(**over) -> dict:
    cfg = copy.deepcopy(FIXED)
    cfg["models"]["engine"] = "vllm"
    for section, values in over.items():
        cfg[section] = {**cfg.get(section, {}), **values} if section != "method" else values
    return cfg


@pytest.mark.parametrize("method", [{"name": "best_of_n", "n": 4}, {"name": "speculative_rejection"},
                                    {"name": "greedy"}, {"name": "nucleus"}])
def test_engine_vllm_takes_the_candidate_pool_and_single_response_methods(method):
    assert validate_config(_vllm(method=method)).models.engine == "vllm"


@pytest.mark.parametrize("over, says", [
    ({"method": {"name": "mjsd"}, "models": {"draft": "builtin:tiny-draft"}}, "models.engine: 'vllm' runs"),
    ({"method": {"name": "cdsl"}, "models": {"draft": "builtin:tiny-draft"}}, "not method 'cdsl'"),
    ({"method": {"name": "beam"}}, "not method 'beam'"),
    ({"method": {"name": "speculative_decoding"}, "models": {"draft": "builtin:tiny-draft"}},
     "not method 'speculative_decoding'"),
    ({"generation": {"sampler": "speculative"}, "models": {"draft": "builtin:tiny-draft"}},
     "models.engine: 'vllm' samples with the target alone; generation.sampler 'speculative' needs the draft"),
])
def test_engine_vllm_refusals_name_the_field(over, says):
    cfg = _vllm(**{k: v for k, v in over.items() if k != "models"})
    cfg["models"].update(over.get("models", {}))
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert says in str(err.value)
    cfg["models"]["engine"] = "hf"  # the same config on the hf engine is fine
    validate_config(cfg)
