"""Helpers for tests on the bundled trio: configs, demo prompts, and access to the method layer.

`run_trio(method, items, ...)` runs one method on the bundled trio directly, from its own parameters (a dict of
schemas.methods) and the generation settings: the trio is loaded once per session (through the Runner), and no
job config (data source, output path) is needed. `run_method(runner, items)` runs a Runner's configured method.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import torch
from pydantic import TypeAdapter

import assets
from pipeline.preflight import resolved
from schemas.config import GenerationConfig, JobConfig, validate_config
from schemas.methods import Method, Sampling
from workers.accounting.cost import Meter
from workers.actor.runner import Runner
from tests.metered import metered, run_method as method_results
from workers.candidates import PromptInput
from workers.context import Context
from workers.methods.measures import add_measures
from workers.scoring.scorers import LexicalScorer, LogprobScorer

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


def demo_items(limit: int | None = None) -> list[dict]:
    """The first `limit` demo prompts, as the input items a Runner takes (prompt_id, prompt, concepts)."""
    return assets.demo_prompts(0, limit)


def run_method(runner: Runner, items: list[dict]):
    """The configured method's results (with token ids and the quality measures) for items, through the runner's
    preparation: (prompts, results, meter)."""
    ready, errors = runner.prepare(items)
    assert not errors, errors
    prompts = [p for _, p in ready]
    meter = Meter(len(prompts))
    ctx = metered(runner.context_for(), meter)
    with torch.inference_mode():
        results = method_results(ctx, runner.params, prompts)
        add_measures(ctx, prompts, results)
    return prompts, results, meter


@functools.lru_cache(maxsize=None)
def trio() -> Runner:
    """The bundled trio (target, draft, reward model), loaded once per session. Methods must not change it."""
    return Runner(config(method={"name": "speculative_decoding"}))  # a draft method, so that the draft loads


def params_of(method: dict):
    """A method's own parameters (its class of schemas.methods) from a dict such as {"name": "mjsd", "tau": 1}."""
    return TypeAdapter(Method).validate_python(method)


def trio_context(meter: Meter | None = None, generation: dict | None = None, seed: int = 0,
                 reward: str = "model") -> Context:
    """A Context on the bundled trio, with `meter` beside it (`tests.metered`: what its runs charge): generation
    settings over BASE's, `reward` 'model' (the tiny reward model), 'lexical' (concept coverage) or 'logprob' (the
    target's mean token log-probability)."""
    g = GenerationConfig(**merge(BASE["generation"], generation or {}))
    ctx = metered(trio().context_for(), meter)
    rewards = {"model": ctx.reward, "lexical": LexicalScorer(),
               "logprob": LogprobScorer(ctx.target, ctx.pad_id, 8192)}
    return replace(ctx, sampling=Sampling(g.temperature, g.top_p, g.top_k, g.sampler, g.gamma), seed=seed,
                   reward=rewards[reward])


def trio_prompts(items: list[dict], max_new_tokens: int | None = None) -> list[PromptInput]:
    """Input items as the trio's prompts (chat template, RNG key, token limit: BASE's max_new_tokens unless given)."""
    ready, errors = trio().prepare(items, max_new_tokens or BASE["generation"]["max_new_tokens"])
    assert not errors, errors
    return [p for _, p in ready]


def run_trio(method: dict, items: list[dict], generation: dict | None = None, seed: int = 0, reward: str = "model"):
    """Run a method, from its own parameters, on the bundled trio as the Runner would (the method, then the quality
    measures): (prompts, results, meter)."""
    prompts = trio_prompts(items, (generation or {}).get("max_new_tokens"))
    meter = Meter(len(prompts))
    ctx = trio_context(meter, generation, seed, reward)
    with torch.inference_mode():
        results = method_results(ctx, params_of(method), prompts)
        add_measures(ctx, prompts, results)
    return prompts, results, meter


def tokens_of(results) -> list[list[list[int]]]:
    return [[c.tokens for c in r.candidates] for r in results]
