"""Rounds of Expert Iteration in a report: what each round of training bought on held-out prompts, and at what price.

A model trained by a round of the recipe (`rounds`, docs/expert-iteration.md) carries its **lineage** in its folder,
``MODEL/winnow-round.json`` (`ModelLineage`): which recipe and data source made it, its round, the model it started
from, the data runs and SFT set it was trained on, and what its data and its training cost, for its round and summed
over every round of its chain. An evaluation run (a `winnow generate` run whose `models.target` is such a model)
therefore says which round it measures; an evaluation run of the chain's starting model (`base_model`, which has no
lineage) is its round 0.

Terms:

- A **chain** is the models of one recipe folder and one data source (``sources.NAME``): round k's model was trained
  on data that round k-1's model generated.
- A **series** is the evaluation runs of one chain under one evaluation (the same method, generation settings,
  prompts, seed and reward definition: `evaluation_key`), one per round, round 0 included where it was given. Its
  **prompts** are the prompt_ids every run of it completed (no error, a best reward).
- **held-out reward** of a round: the mean over the series' prompts of the run's best reward (for a one-sample or
  greedy evaluation, the reward of its one response), with the report's paired bootstrap interval
  (`reporting.stats.bootstrap_intervals`: every run of the series resampled with the same prompt draws).
- **gain** of round k: its held-out reward minus round 0's, with the bootstrap interval of the per-prompt
  differences; the round **rises beyond its interval** when that interval lies above 0 (beyond the tolerance).
- **cost** of round k: its data runs' device-seconds, USD (device-seconds x their `cost.usd_per_device_hour`) and
  compute (FLOPs, `reporting.cost`), plus its training's device-seconds (wall time of the training loop x devices)
  and USD at the same price, and its training FLOPs (estimated: 6 x parameters x tokens for a full fine-tune,
  4 x parameters x tokens with LoRA, whose frozen weights need no weight gradient). **Cumulative** cost: rounds
  1..k of the chain. Evaluation runs are measurement, not part of a round's cost; their own cost is shown beside.
- **gain per USD**: gain / cumulative USD (data and training); **gain per USD of data**: gain / cumulative USD of the
  data runs; both only for a positive gain (`reporting.tolerance`). **Marginal gain per USD**: (reward of round k -
  reward of round k-1) / round k's USD.
- **Data sources compared**: two chains with one base model evaluated alike are compared at each round both reached
  by the difference of their gain per USD of data, per prompt (gain of that prompt / cumulative USD of data), with
  its paired bootstrap interval: "buys more held-out reward per dollar of data" only when the interval excludes 0
  (and "neither gains" when no source gains). The same on compute (gain per TFLOP of data), which, unlike
  measured USD, does not move with the machine's load.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from reporting.cost import run_cost
from reporting.stats import bootstrap_intervals, ok_rows
from reporting.tolerance import greater, less, positive
from runfolder.folder import store
from runfolder.runs import Run, reward_definition
from schemas.base import InputError
from schemas.methods import Method

LINEAGE_FILE = "winnow-round.json"
LINEAGE_FORMAT = "winnow-expert-iteration-model/1"


class CostOf(BaseModel):
    """What a part of a round cost: device-seconds, USD at the runs' price, and compute (FLOPs; None when unknown)."""

    model_config = ConfigDict(extra="allow")

    device_seconds: float = 0.0
    usd: float = 0.0
    flops: float | None = None


class ModelLineage(BaseModel):
    """``MODEL/winnow-round.json``: where a model trained by a round of Expert Iteration comes from and what it
    cost. Written by the recipe (`rounds.recipe`) inside the model folder before the folder is renamed into place."""

    model_config = ConfigDict(extra="allow")

    format: str = Field(LINEAGE_FORMAT, description="this record's format and version")
    recipe: str = Field(description="the recipe's name")
    recipe_folder: str = Field(description="the recipe's folder (absolute)")
    source: str = Field(description="the data source (sources.NAME) of the chain")
    source_method: dict = Field(description="the method that generated the chain's data")
    round: int = Field(ge=1, description="the round that trained this model")
    base_model: str = Field(description="round 0's model, as the recipe names it")
    parent_model: str = Field(description="the model this round started from")
    data_runs: list[str] = Field(description="the run folders of this round's data")
    sft: str = Field(description="the SFT dataset folder this round trained on")
    examples: int = Field(description="examples in the SFT set")
    generation: CostOf = Field(description="this round's data runs")
    training: CostOf = Field(description="this round's training (device-seconds measured around the training loop)")
    cumulative_generation: CostOf = Field(description="the data runs of rounds 1..round of this chain")
    cumulative_training: CostOf = Field(description="the training of rounds 1..round of this chain")


def read_lineage(target: str) -> ModelLineage | None:
    """The lineage of the model folder `target` (a config's `models.target`), or None when it has none (a
    `builtin:` name, a folder without the file, a location that cannot be listed). A file that exists but does not
    parse is an InputError naming it."""
    if target.startswith("builtin:"):
        return None
    try:
        fs, path = store(target)
        where = posixpath.join(path, LINEAGE_FILE)
        if not fs.isfile(where):
            return None
        with fs.open(where, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except InputError:
        return None
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{target}/{LINEAGE_FILE}: not valid JSON: {err}") from None
    except OSError:
        return None
    try:
        return ModelLineage.model_validate(data)
    except ValidationError as err:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) + f" ({e['msg']})" for e in err.errors())
        raise InputError(f"{target}/{LINEAGE_FILE}: not a lineage record: {fields}") from None


def write_lineage(folder: str, lineage: ModelLineage) -> None:
    """Write ``folder/winnow-round.json`` (a local folder: the model being saved)."""
    with open(posixpath.join(folder, LINEAGE_FILE), "w") as f:
        f.write(json.dumps(lineage.model_dump(mode="json"), indent=2))


def run_costs(run: Run) -> CostOf:
    """A run's total device-seconds, USD and compute (FLOPs; None where `reporting.cost` has none), over every row."""
    cost = run_cost(run)
    seconds = sum(r["cost"]["device_seconds"] for r in run.rows if r["cost"] is not None)
    flops = None
    if cost.problem is None:
        flops = sum(cost.flops(r) for r in run.rows if r["error"] is None)
    return CostOf(device_seconds=seconds, usd=seconds / 3600.0 * run.usd_per_device_hour, flops=flops)


def add_costs(*parts: CostOf) -> CostOf:
    """The sum of costs; FLOPs None when any part has none."""
    flops = [p.flops for p in parts]
    return CostOf(device_seconds=sum(p.device_seconds for p in parts), usd=sum(p.usd for p in parts),
                  flops=None if any(f is None for f in flops) else float(sum(flops)))


def evaluation_key(run: Run) -> str:
    """What makes two evaluation runs comparable round to round: method, generation settings, prompts (data),
    seed and reward definition, as one string."""
    cfg = run.manifest.config
    d = reward_definition(run)
    return json.dumps({k: cfg.get(k) for k in ("method", "generation", "data", "seed")}
                      | {"reward": [d.kind, d.identity]}, sort_keys=True)


def describe_evaluation(method: dict) -> str:
    """'greedy', 'one sample (best_of_n n=1)' or the method with its parameters."""
    name = method.get("name")
    if name == "greedy":
        return "greedy"
    params = " ".join(f"{k}={v}" for k, v in sorted(method.items()) if k != "name")
    if (name == "best_of_n" and method.get("n") == 1) or name == "nucleus":
        return f"one sample ({name}{' ' + params if params else ''})"
    return f"{name}{' ' + params if params else ''}"


def describe_source(method: dict) -> str:
    """The data source's method with n, alpha and the parameters it sets away from their defaults."""
    name = method.get("name")
    try:
        defaults = TypeAdapter(Method).validate_python({"name": name}).model_dump(mode="json")
    except ValidationError:
        defaults = {}
    shown = [k for k in sorted(method) if k != "name" and (k in ("n", "alpha") or method[k] != defaults.get(k))]
    params = ", ".join(f"{k}={method[k]}" for k in shown)
    return f"{name} ({params})" if params else str(name)


@dataclass
class _Chain:
    key: tuple[str, str]  # (recipe folder, source)
    recipe: str
    source: str
    source_method: dict
    base_model: str


def _target(run: Run) -> str:
    models = run.manifest.config.get("models")
    return str(models.get("target")) if isinstance(models, dict) else ""


def _interval(values: np.ndarray) -> list[list[float]]:
    return [[float(lo), float(hi)] for lo, hi in bootstrap_intervals(values)]


def _per(gain: float | None, usd: float) -> float | None:
    if gain is None or not positive(gain) or usd <= 0:
        return None
    return gain / usd


def _cost_dict(c: CostOf) -> dict:
    return {"device_seconds": c.device_seconds, "usd": c.usd, "flops": c.flops}


def build_series(runs: list[Run], labels: list[str]) -> dict:
    """The report's "rounds" block: every series of the runs (module docstring) with its per-round numbers, the
    data sources compared, and notes on runs left out. Empty `series` when no run evaluates a trained round."""
    lineages = [read_lineage(_target(run)) for run in runs]
    chains: dict[tuple[str, str], _Chain] = {}
    for lin in lineages:
        if lin is not None:
            key = (lin.recipe_folder, lin.source)
            chains.setdefault(key, _Chain(key, lin.recipe, lin.source, lin.source_method, lin.base_model))
    notes: list[str] = []
    members: dict[tuple, dict[int, int]] = {}  # (chain key, evaluation key) -> round -> run index
    for i, (run, lin) in enumerate(zip(runs, lineages)):
        if lin is None:
            continue
        seq = members.setdefault(((lin.recipe_folder, lin.source), evaluation_key(run)), {})
        if lin.round in seq:
            notes.append(f"{labels[i]} evaluates round {lin.round} of {lin.recipe}/{lin.source} as "
                         f"{labels[seq[lin.round]]} does, alike; only the first is in its series")
            continue
        seq[lin.round] = i
    for i, (run, lin) in enumerate(zip(runs, lineages)):  # round 0: runs of a chain's base model, evaluated alike
        if lin is not None:
            continue
        for (ckey, ekey), seq in members.items():
            if chains[ckey].base_model == _target(run) and evaluation_key(run) == ekey and 0 not in seq:
                seq[0] = i
    series = [_series(chains[ckey], seq, runs, labels, lineages) for (ckey, _), seq in members.items()]
    for s in series:
        notes += s.pop("notes")
    return {"series": series, "comparisons": _comparisons(series, runs), "notes": notes}


def _series(chain: _Chain, seq: dict[int, int], runs: list[Run], labels: list[str],
            lineages: list[ModelLineage | None]) -> dict:
    rounds = sorted(seq)
    idx = [seq[k] for k in rounds]
    oks = [ok_rows(runs[i]) for i in idx]
    prompts = sorted(set.intersection(*[{p for p, r in ok.items() if r["best_reward"] is not None} for ok in oks]))
    first = runs[idx[0]]
    method = first.manifest.config.get("method") or {}
    out = {
        "chain": {"recipe": chain.recipe, "recipe_folder": chain.key[0], "source": chain.source,
                  "source_method": chain.source_method, "base_model": chain.base_model},
        "label": f"{chain.recipe}/{chain.source}, {describe_evaluation(method)}",
        "evaluation": describe_evaluation(method), "evaluation_method": method,
        "reward": reward_definition(first).text, "reward_units": reward_definition(first).units,
        "prompts": len(prompts), "has_round_0": rounds[0] == 0, "points": [], "notes": [],
    }
    if not prompts:
        out["notes"].append(f"{out['label']}: no prompt was completed by every run of the series "
                            f"({', '.join(labels[i] for i in idx)}); it has no numbers")
        return out
    values = np.asarray([[oks[j][p]["best_reward"] for p in prompts] for j in range(len(idx))], dtype=float)
    means = values.mean(axis=1)
    intervals = _interval(values)
    gains, gain_iv = [None] * len(idx), [None] * len(idx)
    if rounds[0] == 0:
        diffs = values - values[0]
        gains = [float(g) for g in diffs.mean(axis=1)]
        gain_iv = _interval(diffs)
    zero = CostOf(device_seconds=0.0, usd=0.0, flops=0.0)
    for j, (k, i) in enumerate(zip(rounds, idx)):
        lin = lineages[i]
        gen, train = (lin.generation, lin.training) if lin else (zero, zero)
        cgen, ctrain = (lin.cumulative_generation, lin.cumulative_training) if lin else (zero, zero)
        total, ctotal = add_costs(gen, train), add_costs(cgen, ctrain)
        gain = gains[j]
        rises = None
        if gain_iv[j] is not None and k > 0:
            rises = greater(gain_iv[j][0], 0.0)
        prev = j - 1 if j > 0 and rounds[j - 1] == k - 1 else None
        step = None if prev is None else float(means[j] - means[prev])
        own = run_costs(runs[i])
        out["points"].append({
            "round": k, "label": labels[i], "path": runs[i].uri, "model": _target(runs[i]),
            "mean_reward": float(means[j]), "interval": intervals[j],
            "gain": gain, "gain_interval": gain_iv[j], "rises_beyond_interval": rises,
            "falls_beyond_interval": None if gain_iv[j] is None or k == 0 else less(gain_iv[j][1], 0.0),
            "examples": lin.examples if lin else None,
            "round_cost": {"generation": _cost_dict(gen), "training": _cost_dict(train), "total": _cost_dict(total)},
            "cumulative_cost": {"generation": _cost_dict(cgen), "training": _cost_dict(ctrain),
                                "total": _cost_dict(ctotal)},
            "gain_per_usd": _per(gain, ctotal.usd) if k > 0 else None,
            "gain_per_usd_of_data": _per(gain, cgen.usd) if k > 0 else None,
            "step_from_previous_round": step,
            "marginal_gain_per_usd": _per(step, total.usd),
            "evaluation_cost": _cost_dict(own),
        })
    return out


def _comparisons(series: list[dict], runs: list[Run]) -> list[dict]:
    """Data sources compared (module docstring): pairs of series of one base model, evaluated alike (the same
    evaluation, reward and prompts), at each round both reached beyond 0."""
    out = []
    by_eval: dict[tuple, list[dict]] = {}
    for s in series:
        if not s["has_round_0"] or not s["points"]:
            continue
        key = (s["chain"]["base_model"], s["points"][0]["path"], s["evaluation"], s["reward"])
        by_eval.setdefault(key, []).append(s)
    for group in by_eval.values():
        for a_i in range(len(group)):
            for b_i in range(a_i + 1, len(group)):
                out += _compare_pair(group[a_i], group[b_i], runs)
    return out


def _values(run_path: str, runs: list[Run], prompts: list[str]) -> np.ndarray:
    run = next(r for r in runs if r.uri == run_path)
    ok = ok_rows(run)
    return np.asarray([ok[p]["best_reward"] for p in prompts], dtype=float)


def _verdict(a: str, b: str, per_a: np.ndarray, per_b: np.ndarray, unit: str) -> dict:
    """Mean gain per unit of data cost of each source, their mean difference with its paired bootstrap interval,
    and the verdict (module docstring)."""
    d = per_a - per_b
    lo, hi = bootstrap_intervals(d[None, :])[0]
    out = {"a": float(per_a.mean()), "b": float(per_b.mean()), "difference": float(d.mean()),
           "interval": [float(lo), float(hi)]}
    if not (positive(out["a"]) or positive(out["b"])):
        out["verdict"] = "neither gains held-out reward here: no data source buys any"
    elif greater(lo, 0.0):
        out["verdict"] = f"{a} buys more held-out reward per {unit} of data"
    elif less(hi, 0.0):
        out["verdict"] = f"{b} buys more held-out reward per {unit} of data"
    else:
        out["verdict"] = "not told apart: the interval of the difference holds 0 (these prompts do not say which)"
    return out


def _compare_pair(a: dict, b: dict, runs: list[Run]) -> list[dict]:
    """At each round both series reached: gain per USD of data (measured) and per TFLOP of data (compute, which
    does not move with the machine's load) of each source, compared prompt by prompt."""
    out = []
    base_path = a["points"][0]["path"]
    for pa in a["points"][1:]:
        pb = next((p for p in b["points"] if p["round"] == pa["round"]), None)
        if pb is None:
            continue
        prompts = sorted(set(_ok_ids(runs, pa["path"])) & set(_ok_ids(runs, pb["path"]))
                         & set(_ok_ids(runs, base_path)))
        ga, gb = pa["cumulative_cost"]["generation"], pb["cumulative_cost"]["generation"]
        entry = {"round": pa["round"], "evaluation": a["evaluation"], "a": a["chain"]["source"],
                 "b": b["chain"]["source"], "a_label": a["label"], "b_label": b["label"], "prompts": len(prompts),
                 "a_data": ga, "b_data": gb, "usd": None, "compute": None}
        if prompts:
            base = _values(base_path, runs, prompts)
            gain_a, gain_b = _values(pa["path"], runs, prompts) - base, _values(pb["path"], runs, prompts) - base
            for basis, key, scale, unit in (("usd", "usd", 1.0, "dollar"), ("compute", "flops", 1e12, "TFLOP")):
                cost_a, cost_b = ga[key], gb[key]
                if cost_a and cost_b and cost_a > 0 and cost_b > 0:
                    entry[basis] = _verdict(entry["a"], entry["b"], gain_a / (cost_a / scale),
                                            gain_b / (cost_b / scale), unit)
        entry["verdict"] = (entry["usd"]["verdict"] if entry["usd"] else
                            "not compared: no prompt completed by every run, or a data cost of 0")
        out.append(entry)
    return out


def _ok_ids(runs: list[Run], path: str) -> list[str]:
    run = next(r for r in runs if r.uri == path)
    return [p for p, r in ok_rows(run).items() if r["best_reward"] is not None]


# ---------------------------------------------------------------------------------------------------------------
# Text


def _f(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _usd(x) -> str:
    return "n/a" if x is None else f"${x:.3g}"


def _iv(mean, iv, digits: int = 3) -> str:
    """A mean and its interval: 3 decimals for rewards; `digits` significant figures otherwise."""
    if mean is None:
        return "n/a"
    fmt = (lambda x: f"{x:.3f}") if digits == 3 else (lambda x: f"{x:.{digits}g}")
    return fmt(mean) if iv is None else f"{fmt(mean)} [{fmt(iv[0])}, {fmt(iv[1])}]"


def _flops(x) -> str:
    if x is None:
        return "n/a"
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def series_table(s: dict) -> list[str]:
    """One series as a markdown table: a row per round."""
    lines = [f"**{s['label']}**: data from {describe_source(s['chain']['source_method'])}, starting from "
             f"`{s['chain']['base_model']}`; held-out {s['reward']} over the {s['prompts']} prompts every round "
             "completed, with 95% bootstrap intervals.", "",
             "| round | run | examples | held-out reward [95%] | gain over round 0 [95%] | data device-s | data USD | "
             "data compute | training device-s | training USD | training compute | cumulative USD | gain / USD | "
             "gain / USD of data | marginal gain / USD | evaluation device-s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in s["points"]:
        rc, cc = p["round_cost"], p["cumulative_cost"]
        gain = _iv(p["gain"], p["gain_interval"]) if p["round"] > 0 else "-"
        if p["rises_beyond_interval"]:
            gain += " **rises**"
        elif p["falls_beyond_interval"]:
            gain += " **falls**"
        lines.append(
            f"| {p['round']} | {p['label']} | {p['examples'] if p['examples'] is not None else '-'} | "
            f"{_iv(p['mean_reward'], p['interval'])} | {gain} | {rc['generation']['device_seconds']:.1f} | "
            f"{_usd(rc['generation']['usd'])} | {_flops(rc['generation']['flops'])} | "
            f"{rc['training']['device_seconds']:.1f} | {_usd(rc['training']['usd'])} | "
            f"{_flops(rc['training']['flops'])} | {_usd(cc['total']['usd'])} | {_f(p['gain_per_usd'])} | "
            f"{_f(p['gain_per_usd_of_data'])} | {_f(p['marginal_gain_per_usd'])} | "
            f"{p['evaluation_cost']['device_seconds']:.1f} |")
    return lines


def comparison_lines(comparisons: list[dict]) -> list[str]:
    if not comparisons:
        return []
    lines = ["| round | evaluation | sources | prompts | data USD (each) | gain / USD of data (each) | difference "
             "[95%] | verdict (USD) | gain / TFLOP of data (each) | difference [95%] | verdict (compute) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        cells = []
        for basis in ("usd", "compute"):
            v = c[basis]
            cells += ([f"{c['a']} {_f(v['a'])}, {c['b']} {_f(v['b'])}", _iv(v["difference"], v["interval"], 4),
                       v["verdict"]] if v else ["n/a", "n/a", "not compared"])
        lines.append(f"| {c['round']} | {c['evaluation']} | {c['a']} vs {c['b']} | {c['prompts']} | "
                     f"{c['a']} {_usd(c['a_data']['usd'])}, {c['b']} {_usd(c['b_data']['usd'])} | "
                     + " | ".join(cells) + " |")
    return lines


def markdown_section(block: dict) -> list[str]:
    """The report's "Rounds of Expert Iteration" section; [] when there is no series."""
    if not block["series"]:
        return []
    lines = ["## Rounds of Expert Iteration", "",
             "Evaluation runs of models trained by rounds of Expert Iteration (their folders' winnow-round.json), "
             "as series: round 0 is the starting model. Costs are the rounds' data runs and training; "
             "evaluation runs are measurement and are shown apart. Gains per USD only where the gain is positive.",
             ""]
    for s in block["series"]:
        lines += series_table(s) + [""]
    if block["comparisons"]:
        lines += ["### Data sources compared: held-out reward gained per dollar of data", ""]
        lines += comparison_lines(block["comparisons"]) + [""]
    for note in block["notes"]:
        lines += [f"**Note:** {note}.", ""]
    return lines


def terminal_lines(block: dict) -> list[str]:
    """One line per series for the terminal: its held-out reward round by round and its last round's gain."""
    out = []
    for s in block["series"]:
        if not s["points"]:
            continue
        steps = " -> ".join(f"round {p['round']} {p['mean_reward']:.3f}" for p in s["points"])
        last = s["points"][-1]
        line = f"Rounds, {s['label']}: {steps}"
        if last["gain"] is not None and last["round"] > 0:
            verdict = ("rises beyond its interval" if last["rises_beyond_interval"] else
                       "falls beyond its interval" if last["falls_beyond_interval"] else "within its interval")
            line += (f"; gain {_iv(last['gain'], last['gain_interval'])}, {verdict}, for "
                     f"{_usd(last['cumulative_cost']['total']['usd'])} of data and training")
        out.append(line)
    return out


def plot_series(block: dict) -> list[dict]:
    """The series as the rounds plot takes them (`reporting.plots.rounds`)."""
    return [{"label": s["label"], "chain": f"{s['chain']['recipe']}/{s['chain']['source']}",
             "evaluation": s["evaluation"], "reward_units": s["reward_units"],
             "rounds": [p["round"] for p in s["points"]], "reward": [p["mean_reward"] for p in s["points"]],
             "low": [p["interval"][0] for p in s["points"]], "high": [p["interval"][1] for p in s["points"]],
             "cumulative_usd": [p["cumulative_cost"]["total"]["usd"] for p in s["points"]],
             "cumulative_data_usd": [p["cumulative_cost"]["generation"]["usd"] for p in s["points"]]}
            for s in block["series"] if s["points"]]
