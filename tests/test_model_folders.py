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


def _copy(tmp_path, asset: str, name: str, **config) -> str:
    """A copy of a bundled model folder with config.json values replaced."""
    import shutil

    dest = tmp_path / name
    shutil.copytree(builtin_path(asset), dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(dest)


@pytest.mark.parametrize("values, needle", [
    ({"num_attention_heads": 5}, "the model cannot be built from it"),
    ({"hidden_act": "swishy"}, "the model cannot be built from it"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
])
def test_a_config_json_the_model_cannot_be_built_or_run_with_exits_2_before_any_model_loads(tmp_path, capsys, values,
                                                                                            needle):
    """Issue 26: such a folder failed on the actor with 30-55 lines of traceback after the run folder was made."""
    target = _copy(tmp_path, "tiny-target", "target", **values)
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, models={"target": target}))
    assert generate.main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"models.target: {target}/config.json: " in err and needle in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_draft_with_another_tokenizer_or_vocabulary_exits_2_naming_the_draft(tmp_path, capsys):
    """Issue 26: a draft whose tokenizer is not the target's failed with `IndexError: index out of range in self`."""
    import shutil

    other_tok = _copy(tmp_path, "tiny-draft", "draft-tok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path("tiny-reward") / f, other_tok)
    other_vocab = _copy(tmp_path, "tiny-draft", "draft-vocab", vocab_size=600)
    for draft, needle in ((other_tok, "has a tokenizer other than the target's (445 tokens against 506"),
                          (other_vocab, "has a vocabulary of 600 (config.json vocab_size) where the target has 506")):
        for section in ({"method": {"name": "speculative_decoding"}}, {"generation": {"sampler": "speculative"}}):
            cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, models={"draft": draft}, **section))
            assert generate.main([str(cfg)]) == 2
            err = capsys.readouterr().err
            assert f"models.draft: {draft} {needle}" in err, err
    # a config that does not use the draft is not refused for it
    cfg = validate_config(job_config(tmp_path, models={"draft": other_tok}))
    assert model_problems(cfg) == []
    assert not (tmp_path / "run").exists()


def test_the_vllm_engine_without_vllm_installed_exits_2_naming_the_field(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, models={"engine": "vllm"}))
    assert generate.main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "models.engine: 'vllm' needs vLLM, which is not installed here" in err
    assert not (tmp_path / "run").exists()
