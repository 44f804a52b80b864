"""Single-response baselines on the target: greedy decoding and nucleus sampling.

Both are a pool of one candidate per prompt with no decisions; the reward, when configured, only scores the answer.
"""

from __future__ import annotations

from dataclasses import replace

from workers.methods.common import Context, MethodResult, PromptInput
from workers.methods.rejection import NoDecisions, run_pool
from workers.sampling import Warp


def _single(ctx: Context, prompts: list[PromptInput]) -> list[MethodResult]:
    results = run_pool(ctx, prompts, 1, 0.0, NoDecisions())
    for r in results:
        r.best_index = 0
    return results


def greedy(ctx: Context, prompts: list[PromptInput]) -> list[MethodResult]:
    return _single(replace(ctx, warp=Warp(temperature=0.0)), prompts)


def nucleus(ctx: Context, prompts: list[PromptInput]) -> list[MethodResult]:
    g = ctx.config.generation
    warp = Warp(temperature=g.temperature, top_k=g.top_k, top_p=ctx.config.method.top_p)
    return _single(replace(ctx, warp=warp), prompts)
