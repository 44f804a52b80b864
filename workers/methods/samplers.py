"""The samplers a candidate pool can decode with: the target alone, or speculative (draft + target)."""

from __future__ import annotations

from workers.engine import Engine
from workers.methods.common import Context


def make_sampler(ctx: Context):
    """The engine for `generation.sampler`: 'target' samples token by token from the target."""
    sampler = ctx.config.generation.sampler
    if sampler == "target":
        return Engine(ctx.target, ctx.pad_id, ctx.eos_ids, ctx.warp, ctx.seed, ctx.meter)
    raise ValueError(f"generation.sampler: {sampler!r} is not available")
