"""The job config: every error at once, each naming its field; the output row schema."""

from __future__ import annotations

import pytest

from schemas.base import ConfigError
from schemas.config import apply_overrides, validate_config
from schemas.rows import ROW_SCHEMA, error_row, rows_to_table

GOOD = {
    "name": "x",
    "data": {"source": "builtin:demo-prompts"},
    "models": {"target": "builtin:tiny-target", "reward": {"kind": "lexical"}},
    "method": {"name": "best_of_n", "n": 4},
    "output": {"path": "runs/x"},
}


def problems(data):
    with pytest.raises(ConfigError) as e:
        validate_config(data)
    return e.value.problems


def test_every_error_is_reported_at_once_with_its_field():
    bad = {**GOOD, "data": {"source": "a", "limitt": 3}, "method": {"name": "speculative_rejection", "alpha": 1.5},
           "generation": {"temperature": -1, "top_p": 0}, "resources": {"actors": 0}}
    got = problems(bad)
    fields = [p.split(":")[0] for p in got]
    assert fields == ["data.limitt", "method.alpha", "generation.temperature", "generation.top_p", "resources.actors"]
    assert "unknown key" in got[0] and "less than 1" in got[1] and "(got 1.5)" in got[1]


def test_method_is_a_discriminated_union():
    assert "unknown value 'bon'" in problems({**GOOD, "method": {"name": "bon"}})[0]
    assert problems({**GOOD, "method": {"name": "greedy", "n": 3}}) == [
        "method.n: 'n' is a field of methods 'best_of_n' and 'speculative_rejection', not 'greedy' (set method.name: "
        "one of them to use it, or remove the key)"]
    assert problems({**GOOD, "method": {"n": 3}})[0].startswith("method: field 'name' is required")
    cfg = validate_config({**GOOD, "method": {"name": "cdsl", "validation": "sampling"},
                           "models": {**GOOD["models"], "draft": "builtin:tiny-draft"}})
    assert cfg.method.lookahead == 3 and cfg.method.validation == "sampling"


def test_unknown_keys_get_close_spellings_and_keys_of_other_variants_name_their_variant():
    bad = {**GOOD, "modles": {}, "data": {"source": "a", "id_colum": "id"},
           "models": {"target": "t", "reward": {"kind": "logprob", "path": "rm", "batch_tokns": 64}},
           "method": {"name": "best_of_n", "alpha": 0.5}, "generation": {"max_tokens": 8}}
    got = problems(bad)
    assert "modles: unknown key; did you mean 'models'?" in got
    assert "data.id_colum: unknown key; did you mean 'id_column'?" in got
    assert "generation.max_tokens: unknown key; did you mean 'max_new_tokens'?" in got
    assert "models.reward.batch_tokns: unknown key; did you mean 'batch_tokens'?" in got
    # spelled right, but a field of another variant: not called misspelt
    assert ("models.reward.path: 'path' is a field of reward kinds 'model' and 'process', not 'logprob' (set "
            "models.reward.kind: one of them to use it, or remove the key)") in got
    assert ("method.alpha: 'alpha' is a field of method 'speculative_rejection', not 'best_of_n' (set method.name: "
            "speculative_rejection to use it, or remove the key)") in got
    assert len(got) == 6
    lexical = problems({**GOOD, "models": {"target": "t", "reward": {"kind": "lexical", "batch_tokens": 64}}})
    assert lexical == ["models.reward.batch_tokens: 'batch_tokens' is a field of reward kinds 'model', 'process' and 'logprob', "
                       "not 'lexical' (set models.reward.kind: one of them to use it, or remove the key)"]
    assert problems({**GOOD, "method": {"name": "best_of"}})[0].endswith("(did you mean 'best_of_n'?)")
    # a key of another variant wins over a near spelling in this one; a near spelling of another variant's key
    assert problems({**GOOD, "method": {"name": "nucleus", "top_k": 3, "alph": 0.5}}) == [
        "method.top_k: 'top_k' is a field of methods 'cdlh', 'cdlh_appx' and 'cdsl', not 'nucleus' (set method.name: "
        "one of them to use it, or remove the key)",
        "method.alph: unknown key; did you mean 'alpha' (a field of method 'speculative_rejection')?"]
    # nothing close and no variant has it: the plain message
    assert problems({**GOOD, "zzz": 1}) == ["zzz: unknown key (not a field of this section; check its spelling)"]


def test_a_config_path_that_is_a_folder_says_so(tmp_path):
    from schemas.config import load_config

    (tmp_path / "a.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert e.value.problems == [f"{tmp_path}: is a folder, not a config file; give the path of a YAML job config "
                                "(it holds a.yaml)"]


def test_cross_field_rules_name_the_field():
    got = problems({**GOOD, "models": {"target": "t"}, "method": {"name": "speculative_rejection"}})
    assert got == ["models.reward: required by method 'speculative_rejection', which ranks candidates by reward"]
    got = problems({**GOOD, "method": {"name": "mjsd"}})
    assert got == ["models.draft: required by method 'mjsd'"]
    got = problems({**GOOD, "generation": {"sampler": "speculative"}})
    assert got == ["models.draft: required by generation.sampler 'speculative'"]
    # the speculative sampler is a candidate pool's: a single-response method ignores it and needs no draft
    assert validate_config({**GOOD, "method": {"name": "greedy"}, "generation": {"sampler": "speculative"}})
    # the interface contract's minimal SR config runs on CPU and on GPU: the budget is measured at run time
    for gpus in (0, 1):
        ok = {**GOOD, "method": {"name": "speculative_rejection", "n": 64, "alpha": 0.5},
              "resources": {"gpus_per_actor": gpus}}
        assert validate_config(ok).method.pool_kv_cache_mb is None


def test_set_overrides_parse_yaml_values_and_name_bad_keys():
    out = apply_overrides(GOOD, ["method.n=32", "data.limit=8", "generation.temperature=0", "models.draft=null"])
    assert out["method"]["n"] == 32 and out["data"]["limit"] == 8 and out["models"]["draft"] is None
    assert GOOD["method"]["n"] == 4  # the input is not modified
    with pytest.raises(ConfigError) as e:
        apply_overrides(GOOD, ["method.n", "name.x=3"])
    assert "expected KEY=VALUE" in e.value.problems[0] and "name is not a section" in e.value.problems[1]


def test_config_hash_is_stable_and_sensitive():
    a, b = validate_config(GOOD), validate_config(dict(GOOD))
    assert a.hash() == b.hash()
    assert a.hash() != validate_config({**GOOD, "seed": 1}).hash()


def test_rows_to_table_has_the_spec_schema_and_refuses_unknown_stats():
    row = error_row("p1", [{"role": "user", "content": "hi"}], "best_of_n", "empty prompt")
    t = rows_to_table([row])
    assert t.schema == ROW_SCHEMA and t.column("error")[0].as_py() == "empty prompt"
    with pytest.raises(KeyError, match="not_a_stat"):
        rows_to_table([{**row, "stats": {"not_a_stat": 1}}])


def test_the_reward_engine_is_a_late_field_and_its_cache_belongs_to_vllm():
    model = {**GOOD, "models": {"target": "builtin:tiny-target",
                                "reward": {"kind": "model", "path": "builtin:tiny-reward"}}}
    plain = validate_config(model)
    assert plain.models.reward.engine == "hf" and plain.models.reward.kv_cache_mb is None
    spelled = {**model, "models": {**model["models"], "reward": {**model["models"]["reward"], "engine": "hf"}}}
    assert validate_config(spelled).hash() == plain.hash()  # the default leaves the run folders' hashes as they were
    on_vllm = {**model, "models": {**model["models"], "reward": {**model["models"]["reward"], "engine": "vllm",
                                                                  "kv_cache_mb": 256}}}
    assert validate_config(on_vllm).hash() != plain.hash()
    on_hf = {**model, "models": {**model["models"], "reward": {**model["models"]["reward"], "kv_cache_mb": 256}}}
    assert problems(on_hf) == ["models.reward.kv_cache_mb: the reward engine's KV cache applies to "
                               "models.reward.engine 'vllm' only"]
    assert any("models.reward.engine" in p for p in problems(
        {**model, "models": {**model["models"], "reward": {**model["models"]["reward"], "engine": "trt"}}}))
