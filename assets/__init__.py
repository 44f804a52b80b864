"""Bundled tiny assets: a CommonGen-like toy world, three small Hugging Face models trained on it, demo prompts.

`builtin:NAME` in a job config resolves through `resolve(spec)`, the one place that knows those names; the job driver
resolves a config's names (`pipeline.preflight.resolved`) before any worker sees it, so the workers take plain
paths and never import this package. The folders are committed, so a fresh clone
needs no build and no network; `python -m assets.build` rebuilds them deterministically and
`python -m assets.measure` re-measures them (see assets/README.md).

This module is imported by the driver before Ray starts, so it must stay light: no torch, no transformers.
"""

from __future__ import annotations

import json
import pathlib

ASSETS_DIR: pathlib.Path = pathlib.Path(__file__).resolve().parent

BUILTIN = "builtin:"  # the prefix of a bundled asset's name in a job config

# name -> folder, relative to ASSETS_DIR
BUILTINS: dict[str, str] = {
    "tiny-target": "tiny-target",  # LlamaForCausalLM, ~1M parameters, GQA (4 heads, 2 KV heads)
    "tiny-draft": "tiny-draft",  # LlamaForCausalLM, same tokenizer as tiny-target, ~6x cheaper per token
    "tiny-reward": "tiny-reward",  # LlamaForSequenceClassification (1 label), its own tokenizer and chat template
    "demo-prompts": "demo-prompts",  # prompts.jsonl: id, prompt, concepts (held-out concept sets)
}


def list_builtins() -> dict[str, pathlib.Path]:
    """Every bundled asset: name -> absolute path of its folder."""
    return {name: ASSETS_DIR / rel for name, rel in BUILTINS.items()}


def builtin_path(name: str) -> pathlib.Path:
    """Absolute path of the bundled asset `name` (a `builtin:` prefix is accepted); KeyError when unknown."""
    if name.startswith(BUILTIN):
        name = name[len(BUILTIN):]
    try:
        rel = BUILTINS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTINS))
        raise KeyError(f"unknown builtin asset {name!r}; known: {known}") from None
    return ASSETS_DIR / rel


def resolve(spec: str) -> str:
    """A model or data location as the workers take it: ``builtin:NAME`` -> the bundled folder's absolute path;
    anything else (a local path, an s3:// or other fsspec URL) as given. KeyError naming the known assets when NAME
    is unknown."""
    return str(builtin_path(spec)) if spec.startswith(BUILTIN) else spec


def demo_prompts(first: int = 0, count: int | None = None) -> list[dict]:
    """Demo prompts `first` to `first + count` as the driver hands them to a worker: prompt_id, prompt (one user
    message) and concepts. For tests and benches that drive the workers without a job."""
    rows = []
    for line in (builtin_path("demo-prompts") / "prompts.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows.append({"prompt_id": r["id"], "prompt": [{"role": "user", "content": r["prompt"]}],
                         "concepts": r["concepts"]})
    return rows[first:] if count is None else rows[first : first + count]


__all__ = ["ASSETS_DIR", "BUILTIN", "BUILTINS", "builtin_path", "demo_prompts", "list_builtins", "resolve"]
