"""The sweep sized to a share of the job: how many prompts it samples and which runs it keeps, decided before any
run, from the prompt set's size.

Nothing has run yet, so costs are counted in candidates started per prompt (`planning.sweep.units`): Best-of-N and
Speculative Rejection at n count n, a single-response method 1, beam search its beams. A prompt's device time is
taken as ``alpha + beta x u`` for a run of u candidates: alpha for its decoding steps, which cost about the same at
any width (a GPU at small widths, or a CPU's per-step overhead with small models), beta for its candidates' work.
Against the job's method at J candidates, such a run costs at most ``max(u, J) / J`` of the job per prompt, whatever
alpha and beta are (Speculative Rejection's cuts only make it cheaper). So a run counts ``max(u, J)`` candidates.
With N prompts and a share s (``--sweep-share``), the sweep may count ``s x N x J``. A sweep of K prompts counts
``K x sum(max(u_r, J))``, plus the warm-up probe's ``PROBE_PROMPTS x PROBE_CALLS`` prompts at J.

The rule (`size_sweep`):

1. Every run, at the largest sample that fits, up to ``--sample``.
2. Below the smallest useful sample (`SMALL_SAMPLE` prompts, or ``--sample`` when it asks for fewer), runs are cut
   instead, the most candidates first. A Best-of-N run drops its largest n and runs at the next (its smaller
   Best-of-k are still estimated from it). The job's own method is never cut. Then the sample grows again as far
   as the kept runs allow.
3. When the job's own method alone (or, where no config is the job's, the cheapest run) does not fit at the
   smallest useful sample, the job is too small to plan (`TooSmall`): nothing is written, and the message gives the
   share that would fit.

The plan says what was cut and what the sweep cost, measured, against the job's and the pick's projected cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planning.sample import SMALL_SAMPLE
from planning.sweep import PROBE_CALLS, PROBE_PROMPTS, SweepRun


class TooSmall(ValueError):
    """Not even the smallest sweep fits the share: the message says so and what would fit."""


@dataclass
class Sizing:
    """What `size_sweep` decided: the sample's size, the runs kept, the configs cut, and the candidates counted."""

    sample: int
    runs: list[SweepRun]
    cut: list[str] = field(default_factory=list)  # labels of the configs cut, in the order cut
    share: float = 0.1
    allowed: float = 0.0  # candidates the share allows: s x N x J
    planned: float = 0.0  # candidates the kept sweep starts, probe included
    job_units: int = 1
    asked: int = 0  # the sample --sample asked for

    def record(self) -> dict:
        return {"share": self.share, "sample": self.sample, "asked": self.asked, "runs": [r.label for r in self.runs],
                "cut": list(self.cut), "allowed_candidates": self.allowed, "planned_candidates": self.planned,
                "job_candidates_per_prompt": self.job_units}


def parse_share(text: str) -> float:
    """``--sweep-share``: a fraction of the job's cost (``0.1``, ``10%``); above 1 lets the sweep cost more than the
    job. ValueError saying what is expected."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"--sweep-share {text!r}: expected a share of the job's cost above 0, e.g. 0.1 or 10%")
    return value


def cost(runs: list[SweepRun], sample: int, job_units: int) -> float:
    """Candidates a sweep of `runs` on `sample` prompts counts (module docstring), the warm-up probe included."""
    if not runs:
        return 0.0
    per_prompt = sum(max(r.units, job_units) for r in runs)
    return sample * per_prompt + PROBE_PROMPTS * PROBE_CALLS * max(min(r.units for r in runs), job_units)


def _largest(runs: list[SweepRun], allowed: float, most: int, job_units: int) -> int:
    """The largest sample (at most `most`) at which `runs` fit `allowed` candidates; 0 when none does."""
    if not runs:
        return 0
    probe = cost(runs, 0, job_units)
    per_prompt = sum(max(r.units, job_units) for r in runs)
    return max(0, min(most, math.floor((allowed - probe) / per_prompt + 1e-9)))


def size_sweep(runs: list[SweepRun], raw: dict, prompts: int, asked: int, share: float, job_units: int,
               own: str | None, floor: int | None = None) -> Sizing:
    """The sample's size and the runs kept (module docstring). `prompts`: N; `asked`: the sample ``--sample``
    asks for; `own`: the label of the config that is the job's own method, cut last; `floor`: the smallest useful
    sample (default `SMALL_SAMPLE`, or `asked` when smaller). TooSmall when nothing fits."""
    allowed = share * prompts * job_units
    floor = min(SMALL_SAMPLE, asked) if floor is None else floor
    kept, cut = list(runs), []
    while cost(kept, floor, job_units) > allowed:
        # the most candidates first, the later of equals first; never the job's own method
        spare = [i for i, r in enumerate(kept) if r.serves[-1][0] != own]
        if not spare or (own is None and len(kept) == 1):
            kept = []
            break
        victim = max(spare, key=lambda i: (kept[i].units, i))
        r = kept[victim]
        cut.append(r.serves[-1][0])
        if r.lowerable:
            kept[victim] = r.lowered(raw)
        else:
            del kept[victim]
    if not kept:
        members = [((k if k is not None else r.units), lbl) for r in runs for lbl, k in r.serves]
        least = next((m for m in members if m[1] == own), None) or min(members)
        counted = (floor + PROBE_PROMPTS * PROBE_CALLS) * max(least[0], job_units)
        need = counted / (prompts * job_units)
        raise TooSmall(
            f"--sweep-share {share:g}: the job is too small to plan: its {prompts} prompt(s), at {job_units} "
            f"candidate(s) each, let the sweep count {allowed:,.0f} candidates, and the smallest sweep ({least[1]} "
            f"on {floor} sampled prompts, with the warm-up probe) counts {counted:,}, {100 * need:.3g}% of the job; "
            f"run the job itself, or plan it anyway with --sweep-share {_up(need)}")
    sample = max(floor, _largest(kept, allowed, asked, job_units))
    return Sizing(sample, kept, cut, share, allowed, cost(kept, sample, job_units), job_units, asked)


def _up(share: float) -> str:
    """A share rounded up to two significant figures, as a user would type it."""
    digits = 1 - math.floor(math.log10(share))
    return f"{math.ceil(round(share * 10 ** digits, 6)) / 10 ** digits:g}"
