"""Every model problem is found from the folder's files before a model loads (`stores.model_folders`,
`pipeline.preflight`): weights, tokenizer, and the head the role needs; exit 2 naming the field and the path."""

from __future__ import annotations

import json

import pytest
import torch

from assets import builtin_path
from conftest import job_config, write_config
from jobs import generate
from pipeline.preflight import model_problems
from schemas.config import validate_config
from stores.model_folders import CAUSAL_LM, REWARD, model_folder_problem, model_folder_problems


def model(tmp_path, name: str, config: dict | str | None, files=("model.safetensors", "tokenizer.json")):
    """A hand-made model folder: config.json (a dict, raw text, or none) and placeholder files."""
    d = tmp_path / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for f in files:
        (d / f).write_text("placeholder")
    return str(d)


CAUSAL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
ONE_LABEL = {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}}


@pytest.mark.parametrize("name, role", [("tiny-target", CAUSAL_LM), ("tiny-draft", CAUSAL_LM),
                                        ("tiny-reward", REWARD)])
def test_the_bundled_trio_passes(name, role):
    assert model_folder_problems(str(builtin_path(name)), "f", role=role) == []


def test_the_bundled_reward_as_target_and_the_target_as_reward_fail():
    reward, target = str(builtin_path("tiny-reward")), str(builtin_path("tiny-target"))
    [p] = model_folder_problems(reward, "models.target", role=CAUSAL_LM)
    assert p.startswith(f"models.target: {reward}: ") and "LlamaForSequenceClassification" in p
    assert "needs a causal language model" in p
    [p] = model_folder_problems(target, "models.reward.path", role=REWARD)
    assert p.startswith(f"models.reward.path: {target}: ") and "LlamaForCausalLM" in p
    assert "needs a sequence classifier with one label" in p


def test_the_config_names_every_problem_with_its_field_before_any_model_loads(tmp_path):
    cfg = validate_config(job_config(tmp_path, models={
        "target": "builtin:tiny-reward", "draft": "builtin:tiny-draft",
        "reward": {"kind": "model", "path": "builtin:tiny-target"}}))
    problems = model_problems(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("models.target: builtin:tiny-reward: ")
    assert problems[1].startswith("models.reward.path: builtin:tiny-target: ")
    assert model_problems(validate_config(job_config(tmp_path))) == []


def test_weights_and_tokenizer_are_required(tmp_path):
    bare = model(tmp_path, "bare", CAUSAL, files=())
    problems = model_folder_problems(bare, "models.draft", role=CAUSAL_LM)
    assert len(problems) == 2
    assert problems[0].startswith(f"models.draft: {bare} holds no weights")
    assert problems[1].startswith(f"models.draft: {bare} holds no tokenizer")
    joined = model_folder_problem(bare, "models.draft", role=CAUSAL_LM)
    assert joined == "; ".join(problems)


@pytest.mark.parametrize("files", [
    ("model.safetensors", "tokenizer.json"),
    ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.model"),
    ("model.safetensors.index.json", "tokenizer_config.json"),
    ("pytorch_model.bin", "vocab.json", "merges.txt"),
    ("pytorch_model.bin.index.json", "vocab.txt"),
])
def test_the_usual_weight_and_tokenizer_layouts_pass(tmp_path, files):
    assert model_folder_problems(model(tmp_path, "m", CAUSAL, files), "models.target", role=CAUSAL_LM) == []


def test_vocab_json_without_merges_is_no_tokenizer(tmp_path):
    m = model(tmp_path, "m", CAUSAL, files=("model.safetensors", "vocab.json"))
    [p] = model_folder_problems(m, "models.target", role=CAUSAL_LM)
    assert "holds no tokenizer" in p


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MistralForCausalLM", "Gemma3ForConditionalGeneration"])
def test_causal_heads(tmp_path, arch):
    assert model_folder_problems(model(tmp_path, "m", {"architectures": [arch]}), "models.target",
                                 role=CAUSAL_LM) == []


@pytest.mark.parametrize("config, ok", [
    (ONE_LABEL, True),
    ({"architectures": ["BertForSequenceClassification"], "num_labels": 1}, True),
    ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}, False),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3}, False),
    ({"architectures": ["LlamaForSequenceClassification"]}, False),  # transformers' default: 2 labels
    ({"architectures": ["LlamaForCausalLM"]}, False),
    ({"architectures": ["BertModel"]}, False),
])
def test_reward_heads(tmp_path, config, ok):
    m = model(tmp_path, "m", config)
    problems = model_folder_problems(m, "models.reward.path", role=REWARD)
    assert (problems == []) == ok, problems
    if not ok:
        assert problems[0].startswith(f"models.reward.path: {m}: config.json")


def test_a_default_label_count_is_said_to_be_transformers_default(tmp_path):
    m = model(tmp_path, "m", {"architectures": ["LlamaForSequenceClassification"]})
    [p] = model_folder_problems(m, "models.reward.path", role=REWARD)
    assert "gives 2 labels (neither num_labels nor id2label is set, and transformers then defaults to 2)" in p
    assert "set num_labels to 1" in p


def test_a_classifier_is_not_a_target_and_a_config_without_architectures_is_unchecked(tmp_path):
    clf = model(tmp_path, "clf", ONE_LABEL)
    [p] = model_folder_problems(clf, "models.target", role=CAUSAL_LM)
    assert p.startswith(f"models.target: {clf}: config.json's architectures are LlamaForSequenceClassification")
    plain = model(tmp_path, "plain", {"model_type": "llama"})
    assert model_folder_problems(plain, "models.target", role=CAUSAL_LM) == []
    assert model_folder_problems(plain, "models.reward.path", role=REWARD) == []
    custom = model(tmp_path, "custom", {"architectures": ["ChatGLMModel"],
                                        "auto_map": {"AutoModelForCausalLM": "modeling_chatglm.Model"}})
    assert model_folder_problems(custom, "models.target", role=CAUSAL_LM) == []


def test_unreadable_configs_and_non_folders(tmp_path):
    bad = model(tmp_path, "bad", "{not json")
    [p] = model_folder_problems(bad, "models.target", role=CAUSAL_LM)
    assert p.startswith(f"models.target: {bad}/config.json is not valid JSON")
    arr = model(tmp_path, "arr", "[1, 2]")
    assert model_folder_problems(arr, "models.target") == [f"models.target: {arr}/config.json is a JSON list; "
                                                           "expected an object"]
    none = model(tmp_path, "none", None)
    assert model_folder_problems(none, "models.target") == [
        f"models.target: {none} is not a Hugging Face model folder (no config.json in it)"]
    f = tmp_path / "file"
    f.write_text("x")
    assert model_folder_problems(str(f), "models.target") == [
        f"models.target: {f} is a file; expected a Hugging Face model folder"]


def test_generate_exits_2_on_a_wrong_head_before_anything_runs(tmp_path, capsys):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, models={"target": "builtin:tiny-reward"}))
    assert generate.main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "models.target: builtin:tiny-reward: config.json's architectures are LlamaForSequenceClassification" in err
    assert not (tmp_path / "run").exists()


def test_the_worker_checks_the_head_again_before_loading():
    """The workers' own check (after an s3:// copy) is the driver's, role included."""
    from workers.loading import ModelPathError, load_causal_lm

    with pytest.raises(ModelPathError, match="models.target"):
        load_causal_lm(str(builtin_path("tiny-reward")), "models.target", torch.device("cpu"), "auto", False)


def test_the_actor_turns_off_cudnn_attention_on_a_gpu_and_leaves_the_cpu_alone(monkeypatch):
    """cuDNN's attention builds a plan for every new key length, i.e. at every decoding step: on an H100 generate()
    took 22-25 ms a step without it and 28-76 ms with it (`python -m bench.gpu --cudnn-ab`)."""
    from workers import loading

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    assert loading.pick_device(0).type == "cpu" and calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading.pick_device(1).type == "cuda" and calls == [False]
