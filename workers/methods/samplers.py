"""The samplers a candidate pool can decode with: the target alone, or speculative (draft + target)."""

from __future__ import annotations

from workers.engine import Engine
from workers.methods.common import Context
from workers.speculative import SpeculativeEngine


def make_sampler(ctx: Context, kind: str, gamma: int | None = None):
    """The engine of sampler `kind`: 'target' samples token by token from the target; 'speculative' lets the draft
    propose `gamma` tokens that the target verifies (the same distribution, fewer target calls)."""
    if kind == "target":
        return Engine(ctx.target, ctx.pad_id, ctx.eos_ids, ctx.warp, ctx.seed, ctx.meter)
    if kind == "speculative":
        if ctx.draft is None:
            raise ValueError("models.draft: required by the speculative sampler")
        if gamma is None:
            raise ValueError("the speculative sampler needs gamma (draft tokens per verification)")
        return SpeculativeEngine(ctx.target, ctx.draft, gamma, ctx.pad_id, ctx.eos_ids, ctx.warp, ctx.seed, ctx.meter)
    raise ValueError(f"generation.sampler: {kind!r} is not available")


def pool_sampler(ctx: Context):
    """The engine a candidate pool samples with: generation.sampler, with generation.gamma."""
    return make_sampler(ctx, ctx.pool_sampler.kind, ctx.pool_sampler.gamma)
