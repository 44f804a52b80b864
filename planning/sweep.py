"""The sweep of a plan: which method configs it projects, which runs measure them, their labels, and the job config
of each run.

By default the plan projects Best-of-N at every power of two up to n0 and at n0, and Speculative Rejection's minimal
config (``n`` and ``alpha: 0.5``, nothing else set) at n0 / 4, n0 / 2 and n0, with n0 the job's own ``method.n``
(16 when its method has none). ``--methods`` replaces it: each item is ``NAME[:KEY=V[,V...]]...``, e.g.
``best_of_n:n=4,8,16`` or ``speculative_rejection:n=8,16:alpha=0.5``; a key with several values is swept over each
(every combination).

Best-of-N configs that differ only in n share one run, at their largest n (`layout`): Best-of-k for a smaller k is
estimated from its candidates (`planning.estimate`). Every other config is a run of its own.

A sweep run is the job's own config with the method set, the data read from the sample file, no `data.limit`, its
run folder under the plan's ``sweep/`` and at most as many actors as the sample has calls. Everything else (models,
generation, seed, cost, the per-actor resources) is the job's, so the sample runs as the full job would. The
warm-up probe (`probe_config`) is the one exception: one actor, calls of a few prompts.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from dataclasses import dataclass

import yaml

from schemas.base import ConfigError, InputError
from schemas.config import JobConfig, validate_config
from schemas.methods import METHOD_NAMES

DEFAULT_N = 16
MINIMAL_ALPHA = 0.5
SHORT = {"best_of_n": "bon", "speculative_rejection": "sr"}
PROBE = "warmup"  # the warm-up probe's run label (`probe_config`)
PROBE_PROMPTS = 2  # prompts per call of the probe
PROBE_CALLS = 3  # its calls, one Ray Data block (`pipeline.job.read_blocks`) that one actor decodes in order: the
# first cold, the others warm
PROBE_MARK = "~warmup"  # the probe's prompt ids: the sampled id, the mark, the call's number


@dataclass(frozen=True)
class SweepRun:
    """One run of the sweep: its label (its folder under ``sweep/``), its method as given, what a prompt of it costs
    before anything runs (`units`: the candidates it starts per prompt), and the configs measured from it:
    (label, k), with k for Best-of-k estimated from its candidates and None for the config it runs itself."""

    label: str
    method: dict
    units: int
    serves: tuple[tuple[str, int | None], ...]

    @property
    def lowerable(self) -> bool:
        """A Best-of-N run that serves a smaller n too: it can run at that n instead."""
        return len(self.serves) > 1

    def lowered(self, raw: dict) -> "SweepRun":
        """This Best-of-N run at its next smaller n: its largest config is cut."""
        serves = self.serves[:-1]
        top = dict(self.method, n=serves[-1][1])
        return SweepRun(serves[-1][0], top, units(raw, top), serves)


def default_methods(job: JobConfig) -> list[dict]:
    """Best-of-N at every power of two up to n0 and at n0, and Speculative Rejection's minimal config at n0 / 4,
    n0 / 2 and n0 (module docstring)."""
    n0 = getattr(job.method, "n", None) or DEFAULT_N
    ks = sorted({2 ** i for i in range(n0.bit_length()) if 2 ** i <= n0} | {n0})
    ns = sorted({max(1, n0 // 4), max(1, n0 // 2), n0})
    return ([{"name": "best_of_n", "n": k} for k in ks]
            + [{"name": "speculative_rejection", "n": n, "alpha": MINIMAL_ALPHA} for n in ns])


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_methods(items: list[str]) -> list[dict]:
    """The method dicts that `--methods` items name (module docstring); InputError naming every bad item."""
    problems, out = [], []
    for item in items:
        name, *params = item.split(":")
        if name not in METHOD_NAMES:
            problems.append(f"--methods {item!r}: unknown method {name!r}; known: {', '.join(METHOD_NAMES)}")
            continue
        keys, grids, bad = [], [], False
        for p in params:
            key, sep, values = p.partition("=")
            if not sep or not key or not values or key == "name":
                problems.append(f"--methods {item!r}: {p!r} is not KEY=V or KEY=V1,V2,... (e.g. n=4,8,16)")
                bad = True
                break
            keys.append(key)
            grids.append([_value(v) for v in values.split(",")])
        if bad:
            continue
        if len(set(keys)) != len(keys):
            problems.append(f"--methods {item!r}: a key is given twice")
            continue
        out += [{"name": name, **dict(zip(keys, combo))} for combo in itertools.product(*grids)]
    if problems:
        raise InputError(problems)
    return out


def label(method: dict) -> str:
    """A run label from a method as given: ``bon-n8``, ``sr-n16``, ``sr-n16-alpha0.3``, ``beam-num_beams4`` (the
    minimal config's alpha is left out)."""
    name = method["name"]
    parts = [SHORT.get(name, name)]
    for key, value in method.items():
        if key == "name" or (name == "speculative_rejection" and key == "alpha" and value == MINIMAL_ALPHA):
            continue
        parts.append(f"{key}{value}")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts))


def sweep_actors(job: JobConfig, sample_prompts: int) -> int:
    """The sweep's actors: the job's `resources.actors` (an elastic pool's most), at most one per call of the
    sample."""
    return max(1, min(job.resources.pool[1], math.ceil(sample_prompts / job.call_prompts(sample_prompts))))


def job_with_method(raw: dict, method: dict, source: str | None = None) -> JobConfig:
    """The job config (`raw`, as the user wrote it) with `method` set: what `winnow generate` runs for the full job.
    ConfigError naming the method's problems (`source`: where the method came from)."""
    cfg = copy.deepcopy(raw)
    cfg["method"] = dict(method)
    try:
        return validate_config(cfg)
    except ConfigError as err:
        where = source or f"method {label(method)}"
        raise ConfigError([f"{where}: {line}" for line in err.problems]) from None


def sweep_config(job: JobConfig, method: dict, sample_file: str, columns: dict, run_folder: str,
                 actors: int) -> dict:
    """The job config of one sweep run (module docstring); `columns` name the sample file's prompt and id columns."""
    cfg = job.model_dump(mode="json")
    cfg["name"] = f"{job.name}-plan-{label(method)}"
    cfg["data"] = {"source": sample_file, "prompt_column": columns["prompt"], "id_column": columns["id"],
                   "limit": None}
    cfg["method"] = dict(method)
    cfg["output"] = {"path": run_folder}
    cfg["resources"] = {**cfg["resources"], "actors": actors}
    return cfg


def units(raw: dict, method: dict) -> int:
    """The candidates (or beams) a prompt of `method` starts: what the sweep's share is sized by, before anything
    runs. Speculative Rejection counts as Best-of-N at its n (its cuts make it cheaper: an upper bound)."""
    return job_with_method(raw, method).method.candidates()


def layout(raw: dict, methods: list[dict]) -> list[SweepRun]:
    """The runs that measure `methods` (module docstring): Best-of-N configs without a stop rule that differ only in
    n share one run at their largest n; every other config is a run of its own. In the order of the methods."""
    groups: dict[str, list[tuple[int, dict]]] = {}
    order: list[tuple[str, object]] = []
    for m in methods:
        full = job_with_method(raw, m).method
        if full.name == "best_of_n" and full.stop_rule() is None:
            key = json.dumps({k: v for k, v in full.model_dump(mode="json").items() if k != "n"}, sort_keys=True)
            if key not in groups:
                order.append(("group", key))
            groups.setdefault(key, []).append((full.n, m))
        else:
            order.append(("one", m))
    out = []
    for kind, item in order:
        if kind == "one":
            out.append(SweepRun(label(item), dict(item), units(raw, item), ((label(item), None),)))
            continue
        members = sorted(groups[item], key=lambda nm: nm[0])
        n_top, top = members[-1]
        out.append(SweepRun(label(top), dict(top, n=n_top), n_top, tuple((label(m), n) for n, m in members)))
    return out


def probe_config(job: JobConfig, method: dict, probe_file: str, columns: dict, run_folder: str) -> dict:
    """The warm-up probe's job config: `method` on the probe's prompts (`probe_rows`), on one actor, in calls of
    `PROBE_PROMPTS` prompts that its one actor decodes one after another."""
    cfg = sweep_config(job, method, probe_file, columns, run_folder, 1)
    cfg["name"] = f"{job.name}-plan-{PROBE}"
    cfg["resources"] = {**cfg["resources"], "prompts_per_call": PROBE_PROMPTS, "feed_calls": False}
    return cfg


def probe_rows(sample_rows: list[dict], id_column: str) -> list[dict]:
    """The probe's prompts: the sample's first `PROBE_PROMPTS`, once per call, each call's under ids of its own
    (``ID~warmupC``), so the calls are alike in size but sample other candidates."""
    first = sample_rows[:PROBE_PROMPTS]
    return [{**r, id_column: f"{r[id_column]}{PROBE_MARK}{c}"} for c in range(PROBE_CALLS) for r in first]


def probe_call(prompt_id: str) -> int | None:
    """The probe call a prompt id of the probe belongs to (`probe_rows`), or None."""
    head, sep, tail = prompt_id.rpartition(PROBE_MARK)
    return int(tail) if sep and tail.isdigit() else None


def check_methods(raw: dict, methods: list[dict]) -> list[str]:
    """Every problem of the swept methods within the job config (each named by its label), and labels that two
    methods share."""
    problems, seen = [], {}
    for method in methods:
        name = label(method)
        try:
            resolved = job_with_method(raw, method).method.model_dump(mode="json")
        except ConfigError as err:
            problems += err.problems
            continue
        if name in seen and seen[name][1] != resolved:
            problems.append(f"--methods: {seen[name][0]} and {method} make one run label {name!r}")
        seen.setdefault(name, (method, resolved))
    return problems


def unique(methods: list[dict]) -> list[dict]:
    """The methods without repeats (the same label), in order."""
    out, seen = [], set()
    for m in methods:
        if label(m) not in seen:
            seen.add(label(m))
            out.append(m)
    return out
