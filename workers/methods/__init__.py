"""Method name -> function(ctx, prompts) -> list[MethodResult], one result per prompt, in order."""

from __future__ import annotations

from workers.methods.baselines import greedy, nucleus
from workers.methods.rejection import best_of_n, speculative_rejection

METHODS = {
    "best_of_n": best_of_n,
    "speculative_rejection": speculative_rejection,
    "greedy": greedy,
    "nucleus": nucleus,
}


def get_method(name: str):
    try:
        return METHODS[name]
    except KeyError:
        raise NotImplementedError(f"method.name: {name!r} has no implementation in workers.methods") from None
