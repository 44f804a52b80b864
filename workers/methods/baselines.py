"""Single-response baselines on the target: greedy decoding and nucleus sampling.

Both are a pool of one candidate per prompt with no decisions, sampled by the target alone; the reward, when
configured, only scores the answer.
"""

from __future__ import annotations

from dataclasses import replace

from schemas.methods import Greedy, Nucleus
from workers.methods.common import Context, MethodResult, PromptInput
from workers.methods.rejection import NoDecisions, PoolPlan, run_plan
from workers.methods.samplers import make_sampler
from workers.sampling import Warp


def _answer_is_the_one(r: MethodResult) -> None:
    r.best_index = 0


def _single(ctx: Context) -> PoolPlan:
    return PoolPlan(ctx, 1, 0.0, NoDecisions(), make_sampler(ctx, "target"), _answer_is_the_one)


def greedy_plan(ctx: Context, params: Greedy) -> PoolPlan:
    return _single(replace(ctx, warp=Warp(temperature=0.0)))


def nucleus_plan(ctx: Context, params: Nucleus) -> PoolPlan:
    return _single(replace(ctx, warp=replace(ctx.warp, top_p=params.top_p)))


def greedy(ctx: Context, params: Greedy, prompts: list[PromptInput]) -> list[MethodResult]:
    return run_plan(greedy_plan(ctx, params), prompts)


def nucleus(ctx: Context, params: Nucleus, prompts: list[PromptInput]) -> list[MethodResult]:
    return run_plan(nucleus_plan(ctx, params), prompts)
