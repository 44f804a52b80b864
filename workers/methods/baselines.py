"""Single-response baselines on the target: greedy decoding and nucleus sampling.

Both are a pool of one candidate per prompt with no decisions, sampled by the target alone; the reward, when
configured, only scores the answer.
"""

from __future__ import annotations

from dataclasses import replace

from schemas.methods import Greedy, Nucleus
from workers.methods.common import Context, MethodResult, PromptInput
from workers.methods.rejection import NoDecisions, run_pool
from workers.methods.samplers import make_sampler
from workers.sampling import Warp


def _single(ctx: Context, prompts: list[PromptInput]) -> list[MethodResult]:
    results = run_pool(ctx, prompts, 1, 0.0, NoDecisions(), make_sampler(ctx, "target"))
    for r in results:
        r.best_index = 0
    return results


def greedy(ctx: Context, params: Greedy, prompts: list[PromptInput]) -> list[MethodResult]:
    return _single(replace(ctx, warp=Warp(temperature=0.0)), prompts)


def nucleus(ctx: Context, params: Nucleus, prompts: list[PromptInput]) -> list[MethodResult]:
    return _single(replace(ctx, warp=replace(ctx.warp, top_p=params.top_p)), prompts)
