"""The config hash matches run folders across releases: fields added later leave it unchanged at their default."""

import copy

import pytest

from schemas.config import LATE_FIELDS, load_config, validate_config

FIXED = {
    "name": "hashcheck", "seed": 3,
    "data": {"source": "builtin:demo-prompts", "id_column": "id", "limit": 5},
    "models": {"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "builtin:tiny-reward"}},
    "method": {"name": "speculative_rejection", "n": 8, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 8},
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
    explicit["models"]["vllm"] = {"max_num_seqs": 256}
    assert validate_config(explicit).hash() == "5227cd85704df4ad"


@pytest.mark.parametrize("models", [{"engine": "vllm"}, {"vllm": {"kv_cache_mb": 512}}, {"vllm": {"max_num_seqs": 8}}])
def test_a_late_field_off_its_default_changes_the_hash(models):
    cfg = copy.deepcopy(FIXED)
    cfg["models"].update(models)
    assert validate_config(cfg).hash() != "5227cd85704df4ad"


def test_late_fields_name_real_fields_and_their_defaults():
    dump = validate_config(FIXED).model_dump(mode="json")
    for path, default in LATE_FIELDS.items():
        node = dump
        for part in path.split("."):
            node = node[part]
        assert node == default(), path
