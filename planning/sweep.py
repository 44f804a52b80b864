"""The sweep of a plan: which method configs run on the sample, their labels, and the job config of each run.

By default the sweep is Best-of-N at three N and Speculative Rejection's minimal config (``n`` and ``alpha: 0.5``,
nothing else set) at the same three n: n0 / 4, n0 / 2 and n0, with n0 the job's own ``method.n`` (16 when its method
has none). ``--methods`` replaces it: each item is ``NAME[:KEY=V[,V...]]...``, e.g. ``best_of_n:n=4,8,16`` or
``speculative_rejection:n=8,16:alpha=0.5``; a key with several values is swept over each (every combination).

A sweep run is the job's own config with the method set, the data read from the sample file, no `data.limit`, its
run folder under the plan's ``sweep/`` and at most as many workers as the sample has batches. Everything else
(models, generation, seed, cost, the per-worker resources) is the job's, so the sample runs as the full job would.
"""

from __future__ import annotations

import copy
import itertools
import math
import re

import yaml

from schemas.base import ConfigError, InputError
from schemas.config import JobConfig, validate_config
from schemas.methods import METHOD_NAMES

DEFAULT_N = 16
MINIMAL_ALPHA = 0.5
SHORT = {"best_of_n": "bon", "speculative_rejection": "sr"}


def default_methods(job: JobConfig) -> list[dict]:
    """Best-of-N and Speculative Rejection's minimal config at n0 / 4, n0 / 2 and n0 (module docstring)."""
    n0 = getattr(job.method, "n", None) or DEFAULT_N
    ns = sorted({max(1, n0 // 4), max(1, n0 // 2), n0})
    return ([{"name": "best_of_n", "n": n} for n in ns]
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


def sweep_workers(job: JobConfig, sample_prompts: int) -> int:
    """The sweep's actors: the job's `resources.workers` (an elastic pool's most), at most one per batch of the
    sample."""
    return max(1, min(job.resources.pool[1], math.ceil(sample_prompts / job.resources.prompts_per_batch)))


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
                 workers: int) -> dict:
    """The job config of one sweep run (module docstring); `columns` name the sample file's prompt and id columns."""
    cfg = job.model_dump(mode="json")
    cfg["name"] = f"{job.name}-plan-{label(method)}"
    cfg["data"] = {"source": sample_file, "prompt_column": columns["prompt"], "id_column": columns["id"],
                   "limit": None}
    cfg["method"] = dict(method)
    cfg["output"] = {"path": run_folder}
    cfg["resources"] = {**cfg["resources"], "workers": workers}
    return cfg


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
