"""What the tests charge, and to which meter. The workers hold no meter: samplers, decoders, scorers and methods hand
back what they ran (a `workers.accounting.work.Work`) and the actor's loop charges it. The tests do the same with a
meter they hold: a context carries it (`MeteredContext.meter`), and these helpers charge it with what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from workers.accounting.cost import Meter
from workers.context import Context
from workers.methods import run_method as method_run
from workers.pool.pool import decode as pool_decode


@dataclass
class MeteredContext(Context):
    """A Context with the meter a test's runs charge (`run_method`, `decode`)."""

    meter: Meter | None = None


def metered(ctx: Context, meter: Meter | None) -> MeteredContext:
    """`ctx` with `meter` beside it."""
    return MeteredContext(**{f.name: getattr(ctx, f.name) for f in fields(Context)}, meter=meter)


def charge(ctx: Context, work) -> None:
    """Charge `work` to the context's meter, where it has one."""
    meter = getattr(ctx, "meter", None)
    if meter is not None:
        meter.charge(work)


def run_method(ctx: Context, params, prompts: list) -> list:
    """`workers.methods.run_method`'s results, its work charged to the context's meter."""
    results, work = method_run(ctx, params, prompts)
    charge(ctx, work)
    return results


def decode(pool, prompts: list) -> list:
    """`workers.pool.pool.decode`'s results, its work charged to the pool's context's meter."""
    results, work = pool_decode(pool, prompts)
    charge(pool.ctx, work)
    return results


def scored(scorer, items: list, meter: Meter | None = None) -> list:
    """A scorer's values of `items`, what it ran charged to `meter` (where given)."""
    values, work = scorer(items)
    if meter is not None:
        meter.charge(work)
    return values


class MeteredSession:
    """A scoring session whose every call's work is charged to `meter` (as a pool's turns are)."""

    def __init__(self, session, meter: Meter):
        self.session, self.meter = session, meter

    def score(self, keys, items, final=None) -> list:
        values, work = self.session.score(keys, items, final)
        self.meter.charge(work)
        return values

    def __getattr__(self, name):
        return getattr(self.session, name)
