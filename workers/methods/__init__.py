"""Method name -> function(ctx, params, prompts) -> list[MethodResult], one result per prompt, in order; `params` is
the method's own section of the config (schemas.methods).

The quality measures of workers.methods.measures (constraint satisfaction when the prompt has concepts, perplexity
of the returned response under the target) are not part of a method: the Runner adds them to every result after it
has closed the batch's cost window, so their forward is not billed.
"""

from __future__ import annotations

from workers.methods.baselines import greedy, greedy_plan, nucleus, nucleus_plan
from workers.methods.beam import beam
from workers.methods.cdsl import cdlh, cdlh_appx, cdsl
from workers.methods.mjsd import mjsd
from workers.methods.rejection import best_of_n, best_of_n_plan, speculative_rejection, speculative_rejection_plan
from workers.methods.speculative import speculative_decoding

METHODS = {
    "best_of_n": best_of_n,
    "speculative_rejection": speculative_rejection,
    "greedy": greedy,
    "nucleus": nucleus,
    "beam": beam,
    "speculative_decoding": speculative_decoding,
    "mjsd": mjsd,
    "cdsl": cdsl,
    "cdlh": cdlh,
    "cdlh_appx": cdlh_appx,
}


# The candidate-pool methods as plans (workers.methods.rejection.PoolPlan): what a decoding loop that prompts join
# over many actor calls runs (workers.feed).
POOL_PLANS = {
    "best_of_n": best_of_n_plan,
    "speculative_rejection": speculative_rejection_plan,
    "greedy": greedy_plan,
    "nucleus": nucleus_plan,
}


def get_method(name: str):
    try:
        return METHODS[name]
    except KeyError:
        raise NotImplementedError(f"method.name: {name!r} has no implementation in workers.methods") from None
