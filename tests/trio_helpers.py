"""Helpers for tests on the bundled trio: configs, demo prompts, and access to the method layer."""

from __future__ import annotations

import copy

import torch

import assets
from pipeline.preflight import resolved
from schemas.config import JobConfig, validate_config
from workers.cost import Meter
from workers.runner import Runner

BASE = {
    "name": "test",
    "seed": 0,
    "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
    "models": {
        "target": "builtin:tiny-target",
        "draft": "builtin:tiny-draft",
        "reward": {"kind": "model", "path": "builtin:tiny-reward"},
    },
    "method": {"name": "best_of_n", "n": 8},
    "generation": {"max_new_tokens": 48, "temperature": 1.0},
    "output": {"path": "runs/test"},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        # a dict naming a variant ("name" of a method, "kind" of a reward) replaces rather than merges
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not ({"name", "kind"} & set(v)):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def config(**over) -> JobConfig:
    """A validated config with its builtin: names resolved, as the driver hands it to the workers."""
    return resolved(validate_config(merge(BASE, over)))


def demo_rows(limit: int | None = None) -> list[dict]:
    return assets.demo_rows(0, limit)


def run_method(runner: Runner, rows: list[dict]):
    """The method's own results (with token ids) for rows, through the runner's preparation."""
    ready, errors = runner.prepare(rows)
    assert not errors, errors
    meter = Meter(len(ready))
    with torch.inference_mode():
        results = runner.method(runner.context_for(meter), [p for _, p in ready])
    return [p for _, p in ready], results, meter


def tokens_of(results) -> list[list[list[int]]]:
    return [[c.tokens for c in r.candidates] for r in results]
