"""The samplers a candidate pool can decode with: the target alone, or speculative (draft + target)."""

from __future__ import annotations

from workers.engine import Engine
from workers.methods.common import Context
from workers.speculative import SpeculativeEngine


def make_sampler(ctx: Context):
    """The engine for `generation.sampler`: 'target' samples token by token from the target; 'speculative' lets the
    draft propose `generation.gamma` tokens that the target verifies (the same distribution, fewer target calls).
    The `speculative_decoding` method always samples speculatively, with its own `method.gamma`."""
    method = ctx.config.method
    sampler = ctx.config.generation.sampler
    if method.name == "speculative_decoding":
        sampler, gamma = "speculative", method.gamma
    else:
        gamma = ctx.config.generation.gamma
    if sampler == "target":
        return Engine(ctx.target, ctx.pad_id, ctx.eos_ids, ctx.warp, ctx.seed, ctx.meter)
    if sampler == "speculative":
        if ctx.draft is None:
            raise ValueError("models.draft: required by the speculative sampler")
        return SpeculativeEngine(ctx.target, ctx.draft, gamma, ctx.pad_id, ctx.eos_ids, ctx.warp, ctx.seed, ctx.meter)
    raise ValueError(f"generation.sampler: {sampler!r} is not available")
