"""Whether a location is a Hugging Face model folder for its role, checked from its files without loading anything.

The one check of a model folder: the driver runs it on every model of a config before Ray starts
(`pipeline.preflight`), and the workers run it again just before loading (`workers.actor.loading`), where an s3:// model
has become a local copy. Locations are plain paths or fsspec URLs; `builtin:` names are resolved before this layer.
Stays free of torch and transformers (config.json is read with json, files are listed with fsspec), so the driver's
checks are quick.

A model folder holds

- ``config.json``, a JSON object;
- weights: ``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
  ``pytorch_model.bin.index.json``, or ``*.safetensors`` shards;
- a tokenizer: ``tokenizer.json``, ``tokenizer.model``, ``tokenizer_config.json``, ``vocab.json`` with
  ``merges.txt``, ``vocab.txt``, ``spiece.model`` or ``sentencepiece.bpe.model``;
- the head its role needs, read from config.json's ``architectures``: for `CAUSAL_LM` (models.target,
  models.draft) a ``*ForCausalLM``, ``*LMHeadModel`` or ``*ForConditionalGeneration``; for `REWARD`
  (models.reward.path of a `model` reward) a ``*ForSequenceClassification`` with one label (the size of ``id2label``, else
  ``num_labels``; with neither, transformers' `PretrainedConfig` defaults to 2 labels, which the reward loader refuses,
  so it is refused here); for `PROCESS_REWARD` (a `process` reward) a ``*ForTokenClassification`` or
  ``*ForSequenceClassification`` with any number of labels. A config whose ``auto_map`` names the role's Auto class (``AutoModelForCausalLM``,
  ``AutoModelForSequenceClassification``, ``AutoModelForTokenClassification``; custom code) passes the class check. A config without ``architectures``
  (or an ``auto_map`` entry) is accepted with the head unchecked: nothing short of loading it would say which head
  it has.
"""

from __future__ import annotations

import json
import posixpath

from stores.filesystems import filesystem, store_problem

CAUSAL_LM = "causal_lm"  # models.target, models.draft
REWARD = "reward"  # models.reward.path of a `model` reward
PROCESS_REWARD = "process_reward"  # models.reward.path of a `process` reward

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
REWARD_HEAD = "ForSequenceClassification"
PROCESS_HEADS = ("ForTokenClassification", "ForSequenceClassification")
AUTO_CLASS = {CAUSAL_LM: "AutoModelForCausalLM", REWARD: "AutoModelForSequenceClassification",
              PROCESS_REWARD: "AutoModelForTokenClassification"}
NEEDS = {CAUSAL_LM: "a causal language model (architectures *ForCausalLM, *LMHeadModel or *ForConditionalGeneration)",
         REWARD: "a sequence classifier with one label (architectures *ForSequenceClassification, num_labels 1)",
         PROCESS_REWARD: "a token classifier (architectures *ForTokenClassification, or a *ForSequenceClassification "
                         "head read at every token)"}


def model_folder_problem(location: str, field: str, shown: str | None = None, role: str | None = None) -> str | None:
    """Why `location` is not a model folder for `role` (`CAUSAL_LM`, `REWARD`, or None: head unchecked), every
    problem joined in one message, or None. See `model_folder_problems`."""
    problems = model_folder_problems(location, field, shown, role)
    return "; ".join(problems) if problems else None


def model_folder_problems(location: str, field: str, shown: str | None = None, role: str | None = None) -> list[str]:
    """Every reason `location` is not a Hugging Face model folder for `role`; each message names `field` and the
    location (`shown`: as the user wrote it, e.g. its ``builtin:`` name, when it differs from `location`)."""
    shown = shown or location
    where = f"{field}: {shown}"
    try:
        fs, root = filesystem(location)
        unusable = store_problem(fs, root)  # S3 without credentials, an endpoint that does not answer, no bucket
        if unusable:
            return [f"{where}: {unusable}"]
        if not fs.exists(root):
            return [f"{where} does not exist"]
        if not fs.isdir(root):
            return [f"{where} is a file; expected a Hugging Face model folder"]
        names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
        if "config.json" not in names:
            return [f"{where} is not a Hugging Face model folder (no config.json in it)"]
        with fs.open(posixpath.join(root, "config.json"), "rb") as f:
            raw = f.read()
    except (OSError, ValueError, ImportError) as err:
        return [f"{where} cannot be read ({err})"]
    try:
        config = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        return [f"{where}/config.json is not valid JSON ({err})"]
    if not isinstance(config, dict):
        return [f"{where}/config.json is a JSON {type(config).__name__}; expected an object"]
    problems = []
    if not (any(n in names for n in WEIGHT_FILES) or any(n.endswith(".safetensors") for n in names)):
        problems.append(f"{where} holds no weights (expected model.safetensors, *.safetensors shards, "
                        "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json)")
    if not (any(n in names for n in TOKENIZER_FILES) or {"vocab.json", "merges.txt"} <= names):
        problems.append(f"{where} holds no tokenizer (expected tokenizer.json, tokenizer.model, "
                        "tokenizer_config.json, or vocab.json with merges.txt)")
    if role is not None:
        problem = head_problem(config, role)
        if problem:
            problems.append(f"{where}: {problem}")
    return problems


def head_problem(config: dict, role: str) -> str | None:
    """Why a model with this config.json cannot play `role`, or None (also when config.json does not say)."""
    if role not in NEEDS:
        raise ValueError(f"unknown model role {role!r}; expected one of {', '.join(NEEDS)}")
    archs = config.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    custom = AUTO_CLASS[role] in auto_map
    if not archs and not custom:
        return None  # config.json does not say which head: unchecked
    needs = NEEDS[role]
    if role == CAUSAL_LM:
        if custom or any(a.endswith(CAUSAL_HEADS) for a in archs):
            return None
        return f"config.json's architectures are {', '.join(archs)}; {field_role(role)} needs {needs}"
    if role == PROCESS_REWARD:
        if custom or any(a.endswith(PROCESS_HEADS) for a in archs):
            return None  # any number of labels: models.reward.label is checked against it when the PRM loads
        return f"config.json's architectures are {', '.join(archs)}; {field_role(role)} needs {needs}"
    if not custom and not any(a.endswith(REWARD_HEAD) for a in archs):
        return f"config.json's architectures are {', '.join(archs)}; {field_role(role)} needs {needs}"
    labels, source = label_count(config)
    if labels != 1:
        return (f"config.json gives {labels} labels ({source}); {field_role(role)} needs {needs}: set "
                "num_labels to 1 (a regression head whose one logit is the reward)")
    return None


def field_role(role: str) -> str:
    return {CAUSAL_LM: "a target or draft model", REWARD: "a reward model", PROCESS_REWARD: "a process reward model"}[role]


def label_count(config: dict) -> tuple[int, str]:
    """The number of labels transformers would give this config, and where it comes from: `PretrainedConfig` takes
    the size of ``id2label`` when it is set (over a ``num_labels`` beside it), else ``num_labels``, else 2."""
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"]), "id2label"
    if isinstance(config.get("num_labels"), int):
        return config["num_labels"], "num_labels"
    return 2, "neither num_labels nor id2label is set, and transformers then defaults to 2"
