"""Running a method on the hf engine's loaded models, from its parameters: `run_method(ctx, params, prompts) ->
(results, work)`, one `MethodResult` per prompt, in order, and what running them ran (a `Work`: forwards and tokens
per prompt, for the caller to charge); `params` is the method's own section of the config (a class of
schemas.methods).

A candidate-pool method (the `pool` ability: best_of_n, speculative_rejection, greedy, nucleus,
speculative_decoding) is decoded by `workers.pool` on an `HfDecoder` built from the context as the actor's engine
builds it (its memory model, the context's KV space and width), its prompts admitted by the same rule (the actor
runs them through its decoding loop instead, `workers.pool.loop`). The others are functions of this package, one
entry each in `OWN_LOOP`, each returning its results and its work the same way: beam search, MJSD, CDSL and its
CDLH baselines.

The quality measures of `workers.methods.measures` (constraint satisfaction when the prompt has concepts, perplexity
of the returned response under the target) are not part of a method: they are added after the batch's cost window
has closed, so their forward is not billed.
"""

from __future__ import annotations

from workers.accounting.work import Work
from workers.candidates import MethodResult, PromptInput
from workers.context import Context
from workers.engines.hf import HfDecoder
from workers.methods.beam import beam
from workers.methods.cdsl import cdlh, cdlh_appx, cdsl
from workers.methods.mjsd import mjsd
from workers.pool.pool import Pool, decode

# The methods that decode with a loop of their own (not a candidate pool), by name: fn(ctx, params, prompts) ->
# (list[MethodResult], Work).
OWN_LOOP = {
    "beam": beam,
    "mjsd": mjsd,
    "cdsl": cdsl,
    "cdlh": cdlh,
    "cdlh_appx": cdlh_appx,
}


def run_method(ctx: Context, params, prompts: list[PromptInput]) -> tuple[list[MethodResult], Work]:
    """The method of `params` on `prompts`, decoded as one batch on the hf engine's models in `ctx` (with the
    method's own sampling, `Context.for_method`), and what it ran."""
    ctx = ctx.for_method(params)
    if params.pool:
        return decode(Pool.for_method(ctx, HfDecoder(ctx, params), params), prompts)
    try:
        run = OWN_LOOP[params.name]
    except KeyError:
        raise NotImplementedError(f"method.name: {params.name!r} has no implementation in workers.methods") from None
    return run(ctx, params, prompts)
