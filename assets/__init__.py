"""Bundled assets: a CommonGen-like toy world, three small Hugging Face models trained on it, demo prompts, real
instruction prompts, and SmolLM2-135M-Instruct, a real instruct model built from an optional package.

`builtin:NAME` in a job config resolves through `resolve(spec)`, the one place that knows those names. Two kinds:

- bundled (`BUILTINS`): committed folders and files that travel with the code; the job driver resolves a config's
  names (`pipeline.preflight.resolved`) before any actor sees it, so `workers/` takes plain paths and never imports
  this package. A fresh clone needs no build and no network; `python -m assets.build` rebuilds the tiny models
  deterministically and `python -m assets.measure` re-measures them (see assets/README.md).
- built on the node that uses them (`BUILT`: `builtin:smollm2-135m-instruct`, `assets.smollm2`): converted into a
  cache on first use. The driver only checks that they can be built (`unavailable`: the optional extra they need);
  each actor resolves them on its own node (`pipeline.job.GenerateBatch`), since a driver's cache folder does not
  exist on the other nodes of a cluster.

This module is imported by the driver before Ray starts, so it must stay light: no torch, no transformers.
"""

from __future__ import annotations

import importlib
import json
import pathlib

ASSETS_DIR: pathlib.Path = pathlib.Path(__file__).resolve().parent

BUILTIN = "builtin:"  # the prefix of a bundled asset's name in a job config

# bundled: name -> folder (or file), relative to ASSETS_DIR
BUILTINS: dict[str, str] = {
    "tiny-target": "tiny-target",  # LlamaForCausalLM, ~1M parameters, GQA (4 heads, 2 KV heads)
    "tiny-draft": "tiny-draft",  # LlamaForCausalLM, same tokenizer as tiny-target, ~6x cheaper per token
    "tiny-reward": "tiny-reward",  # LlamaForSequenceClassification (1 label), its own tokenizer and chat template
    "demo-prompts": "demo-prompts",  # prompts.jsonl: id, prompt, concepts (held-out concept sets)
    "real-prompts": "real-prompts",  # 112 real instructions: concepts.jsonl, then instructions.jsonl
    "real-concepts": "real-prompts/concepts.jsonl",  # the 48 concept-sentence prompts alone (id, prompt, concepts)
    "word-problems": "word-problems",  # problems.jsonl: id, prompt, answer (arithmetic, for the math verifier)
}

# built on the node that uses them: name -> its module (ensure, cache_folder, unavailable, status, parameters,
# ROLE), imported when first needed (so that `python -m assets.smollm2` runs it once)
BUILT: dict[str, str] = {"smollm2-135m-instruct": "assets.smollm2"}


def _name(spec: str) -> str:
    return spec[len(BUILTIN):] if spec.startswith(BUILTIN) else spec


def _built(name: str):
    return importlib.import_module(BUILT[name])


def _unknown(name: str) -> KeyError:
    known = ", ".join(sorted([*BUILTINS, *BUILT]))
    return KeyError(f"unknown builtin asset {name!r}; known: {known}")


def list_builtins() -> dict[str, pathlib.Path]:
    """Every bundled asset: name -> absolute path of its folder (or file). Assets built on the node that uses them
    are not in it (`catalog` lists them too)."""
    return {name: ASSETS_DIR / rel for name, rel in BUILTINS.items()}


def catalog() -> list[tuple[str, pathlib.Path, str | None]]:
    """Every asset as `winnow assets` lists it: (name, path on this machine, note): the note is None for a bundled
    asset, else whether it is built here, not built yet, or needs its extra (with the install command)."""
    out: list[tuple[str, pathlib.Path, str | None]] = [(n, p, None) for n, p in list_builtins().items()]
    out += [(name, _built(name).cache_folder(), _built(name).status()) for name in BUILT]
    return out


def builtin_path(name: str) -> pathlib.Path:
    """Absolute path of the bundled asset `name` (a `builtin:` prefix is accepted); KeyError when unknown (or when
    it is built on the node that uses it: `resolve` gives that one's folder)."""
    name = _name(name)
    if name in BUILT:
        raise KeyError(f"builtin:{name} is built on the node that uses it; assets.resolve gives its folder")
    try:
        rel = BUILTINS[name]
    except KeyError:
        raise _unknown(name) from None
    return ASSETS_DIR / rel


def builds_on_node(spec: str) -> bool:
    """Whether `spec` names an asset built on the node that uses it (resolved by the actor, not the driver)."""
    return spec.startswith(BUILTIN) and _name(spec) in BUILT


def unavailable(spec: str) -> str | None:
    """Why the asset `spec` names cannot be built on this machine (its extra is missing: the message has the install
    command), or None. Cheap: nothing is built or loaded."""
    return _built(_name(spec)).unavailable() if builds_on_node(spec) else None


def role(spec: str) -> str | None:
    """What an asset built on the node is (`stores.model_folders.CAUSAL_LM` or `REWARD`); None for other specs."""
    return _built(_name(spec)).ROLE if builds_on_node(spec) else None


def built_parameters(spec: str) -> int:
    """Parameters of the model an asset built on the node names, counted from its source without building it
    (`smollm2.parameters`); KeyError when `spec` names no such asset, `smollm2.AssetUnavailable` when its extra is
    missing."""
    if not builds_on_node(spec):
        raise KeyError(f"{spec} is not an asset built on the node that uses it")
    return _built(_name(spec)).parameters()


def resolve(spec: str) -> str:
    """A model or data location as `workers/` takes it: ``builtin:NAME`` -> the bundled folder's (or file's)
    absolute path, or for an asset built on the node, its folder in this node's cache, built first if need be
    (`smollm2.AssetUnavailable` when its extra is missing); anything else (a local path, an s3:// or other fsspec
    URL) as given. KeyError naming the known assets when NAME is unknown."""
    if not spec.startswith(BUILTIN):
        return spec
    if builds_on_node(spec):
        return str(_built(_name(spec)).ensure())
    return str(builtin_path(spec))


def prompt_items(name: str = "demo-prompts", first: int = 0, count: int | None = None) -> list[dict]:
    """The bundled prompt set `name` (rows `first` to `first + count`, in the order a job reads them) as the driver
    hands prompts to an actor: prompt_id, prompt (one user message) and concepts where the row has them. For tests
    and benches that drive `workers/` without a job."""
    path = builtin_path(name)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    rows = []
    for file in files:
        for line in file.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                item = {"prompt_id": r["id"], "prompt": [{"role": "user", "content": r["prompt"]}]}
                if "concepts" in r:
                    item["concepts"] = r["concepts"]
                rows.append(item)
    return rows[first:] if count is None else rows[first : first + count]


def demo_prompts(first: int = 0, count: int | None = None) -> list[dict]:
    """Demo prompts `first` to `first + count` (`prompt_items` of demo-prompts: every row has concepts)."""
    return prompt_items("demo-prompts", first, count)


__all__ = ["ASSETS_DIR", "BUILT", "BUILTIN", "BUILTINS", "builds_on_node", "builtin_path", "catalog",
           "demo_prompts", "list_builtins", "prompt_items", "resolve", "role", "unavailable"]
