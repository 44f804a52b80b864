"""Method name -> function(ctx, prompts) -> list[MethodResult], one result per prompt, in order.

Every method's results carry the quality measures of workers.methods.measures (constraint satisfaction when the row
has concepts, perplexity of the returned response under the target), computed outside the method's cost.
"""

from __future__ import annotations

from workers.methods.baselines import greedy, nucleus
from workers.methods.beam import beam
from workers.methods.cdsl import cdlh, cdlh_appx, cdsl
from workers.methods.measures import with_measures
from workers.methods.mjsd import mjsd
from workers.methods.rejection import best_of_n, speculative_rejection
from workers.methods.speculative import speculative_decoding

METHODS = {
    name: with_measures(fn)
    for name, fn in {
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
    }.items()
}


def get_method(name: str):
    try:
        return METHODS[name]
    except KeyError:
        raise NotImplementedError(f"method.name: {name!r} has no implementation in workers.methods") from None
