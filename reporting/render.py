"""Assembling the report of runs against a baseline: `report.json`, `report.md` and its PNG plots.

The numbers come from `reporting.stats`, `reporting.cost`, `reporting.frontier` and, for runs with a verifier,
`reporting.verified` (definitions there and in the report's own "Definitions" section); this module groups the runs
by reward definition (runs whose rewards are on different scales are never ranked together: each group gets its own
frontier and baseline), orders the numbers, writes the headline of each group (the cost-reward frontier, the
dominated runs and what dominates them, and the runs below the baseline's reward) and the lines said on the
terminal, and writes the files. Evaluation runs of models trained by rounds of Expert Iteration are also shown as
series of rounds (`reporting.rounds`).
"""

from __future__ import annotations

import json
import posixpath
import re

from reporting import plancheck
from reporting import plots as report_plots
from reporting import rounds as report_rounds
from reporting.cost import COMPUTE, USD, run_cost
from reporting.frontier import build_frontier, fmt_cost, fmt_pair
from reporting.stats import compare, correlation_points, correlations, finite, ok_rows, run_summary, sample_prompt
from reporting.tolerance import ABS_TOL, REL_TOL
from reporting.verified import verified_summary
from runfolder.outputs import staged_out, write_bytes
from runfolder.runs import Run, describe_groups, reward_groups, unique_labels

BASIS_NAMES = {COMPUTE: "compute (FLOPs per prompt)", USD: "measured USD per prompt"}

DEFINITIONS = {
    "baseline": "the run given with --baseline; without it, the first RUN_DIR. Runs scored by another reward than "
    "the baseline's are compared with the first run given of their own reward",
    "reward definition": "models.reward.kind and what identifies it: the reward model's path (model; process with its "
    "step settings), the target "
    "(logprob: its reward is the target's own log-probability), the concepts column (lexical), the function "
    "(python). Runs with different definitions are never ranked against each other: each definition has its own "
    "frontier, baseline and tables",
    "compute": "FLOPs per prompt, 2 x parameters x tokens processed, summed over the models: target parameters x "
    "cost.target_tokens + draft parameters x cost.draft_tokens + reward-scoring parameters x cost.reward_tokens "
    "(the reward model's for a model reward, the target's for logprob, none for lexical and python); parameters "
    "from the run's manifest, or for older runs from the model folders its config names; it does not move with "
    "the machine's load",
    "USD": "measured: device_seconds / 3600 x cost.usd_per_device_hour of the run's own manifest; it moves with the "
    "machine's load",
    "basis": "the cost the frontier and the rankings use: compute (the default) or measured USD (--basis usd); a "
    "reward group with a run whose compute is unknown is ranked by measured USD, and the report says which runs",
    "the same": f"two numbers a and b are the same when |a - b| <= max({REL_TOL:g} x max(|a|, |b|), {ABS_TOL:g}) "
    "(float noise); every comparison the report states (cheaper, more reward, below the baseline, a gain) is "
    "beyond it",
    "per prompt": "mean over the run's prompts without an error; totals include errored rows",
    "frontier's prompts": "the prompt_ids every run of the reward group with data completed (no error, a best "
    "reward); the frontier's cost per prompt, mean best reward and intervals are over these prompts. A run without "
    "any completed prompt is not placed",
    "dominates": "run A dominates run B when A's cost per prompt is no higher and its mean best reward no lower, and "
    "one of the two strictly better",
    "cost-reward frontier": "the runs no other run dominates, cheapest first: for a reward you need, the cheapest "
    "run that reaches it is on the frontier",
    "marginal cost per unit of reward": "on the frontier, (cost per prompt - the previous point's) / (mean best "
    "reward - the previous point's): what each extra unit of reward costs on that step",
    "95% interval": "percentile bootstrap interval of the mean best reward over prompts: 2,000 resamples of the "
    "frontier's prompts with replacement, numpy default_rng(seed 0), every run resampled with the same prompt draws "
    "(paired); the same runs give the same intervals",
    "within each other's intervals": "two runs are when each one's mean best reward lies inside the other's 95% "
    "interval (ends included): these prompts do not tell their rewards apart, so a step or a domination between "
    "them rests on cost alone",
    "below the baseline": "a run whose mean best reward on the frontier's prompts is lower than the baseline's",
    "improvement score": "paper 001 eq. 8, per prompt 100 x (1 - (max_k s(Z_k) - s(Y)) / (max_k s(Z_k) - "
    "min_k s(Z_k))), Z = the baseline's finished (eos/length) candidates of that prompt, Y = the run's best "
    "response; averaged over prompts both runs completed; prompts with max = min are left out and counted",
    "relative compute": "paper 001 eq. 7, T / T_baseline with T = device-seconds: the ratio of summed "
    "device-seconds over the prompts both runs completed; relative_compute_mean_of_ratios is the per-prompt ratio "
    "averaged over prompts; relative FLOPs is the same ratio of summed compute",
    "baseline single-sample reward": "per prompt, the mean final reward of the baseline's finished candidates "
    "(the expected reward of one sample with no selection)",
    "reward gain": "the run's best reward minus the baseline single-sample reward, per prompt, averaged",
    "reward gained per TFLOP (per USD)": "mean reward gain / mean compute (TFLOPs, 10^12 FLOPs) or measured USD per "
    "prompt, over the prompts matched with the baseline, only where the mean gain is positive: a run that gains "
    "nothing or loses reward is listed unranked. A ratio of averages, so a run cheap enough scores high however "
    "little it gains; read it with the frontier, not as a ranking of worth",
    "FLOPs (USD) per unit reward gained": "the inverse; only where the mean gain is positive",
    "USD per unit reward (raw)": "USD per prompt / mean best reward; only where the mean best reward is positive",
    "correlation": "paper 001 appendix B: per prompt and decision index, Pearson r and Kendall tau-b (scipy) "
    "between partial reward at that decision and final reward, over candidates that have both (rejected "
    "candidates have no final reward and are not included)",
}


# Said only in reports with a run that has a verifier (`reporting.verified`).
VERIFIED_DEFINITIONS = {
    "verifier": "models.verifier (math, code or python), with models.reward as its ranker; or a math or code reward, "
    "a verifier alone (1.0 verified, 0.0 not)",
    "verified prompt": "a prompt that ran (no error) whose answer verified (stats.best_verified). A row that ran "
    "without a verdict counts as not verified",
    "verified rate": "verified prompts / prompts that ran, with its 95% bootstrap interval",
    "mean pass@1, pass@k": "the rows' pass@1 and pass@k (Chen et al. 2021's unbiased estimator from each prompt's "
    "judged candidates) averaged over the prompts that ran, pass@k at the k's every row has; n/a where the method "
    "cut candidates before they were judged (a biased sample)",
    "cost of a pass": "Cost-of-Pass (arXiv 2504.13359): the cost of the prompts that ran / the verified prompts, in "
    "compute (FLOPs; device-seconds where the run has no compute) and measured USD. It equals cost per prompt / "
    "verified rate. With no verified prompt it is infinite, said as \"no verified prompt\"",
    "cost of a pass's 95% interval": "percentile bootstrap of the summed cost / the summed verified prompts over "
    "2,000 resamples of the run's prompts, the same draws as its verified rate's interval; unbounded above where "
    "more than 2.5% of the resamples hold no verified prompt",
}


def order_runs(runs: list[Run], baseline: Run | None) -> tuple[list[Run], int]:
    """The runs of the report and the baseline's index: --baseline is prepended unless it is one of the runs."""
    if baseline is None:
        return runs, 0
    for i, r in enumerate(runs):
        if r is baseline:
            return runs, i
    return [baseline, *runs], 0


def _identity(spec: str) -> str:
    return spec


def build_report(runs: list[Run], base_index: int, basis: str = COMPUTE, resolve=_identity) -> dict:
    """Every number of the report as one JSON-able dict (NaN-free). Runs are grouped by reward definition (the
    baseline's group first); each group is ranked on `basis` (measured USD where a run of it has no compute) against
    its own baseline. `resolve` turns a config's model location into a path (`assets.resolve` for `builtin:`
    names), for runs whose manifest records no parameter counts."""
    if basis not in (COMPUTE, USD):
        raise ValueError(f"basis must be {COMPUTE!r} or {USD!r}; got {basis!r}")
    labels = unique_labels(runs)
    costs = [run_cost(run, resolve) for run in runs]
    grouped = sorted(reward_groups(runs), key=lambda g: base_index not in g[1])  # the baseline's group first
    entries: list[dict] = [{} for _ in runs]
    groups = []
    for n, (definition, members) in enumerate(grouped):
        g_base = base_index if base_index in members else members[0]
        missing = [i for i in members if costs[i].problem is not None]
        g_basis = USD if (basis == COMPUTE and missing) else basis
        note = None
        if g_basis != basis:
            note = ("ranked by measured USD, not compute: " + "; ".join(
                f"{labels[i]} has no compute ({costs[i].problem})" for i in missing))
        block, per_run = build_frontier([runs[i] for i in members], [labels[i] for i in members],
                                        members.index(g_base), [costs[i] for i in members], g_basis)
        for i, fr in zip(members, per_run):
            run = runs[i]
            entries[i] = {
                "label": labels[i], "name": run.name, "path": run.uri, "method": run.method,
                "engine": run.engine, "config_hash": run.manifest.config_hash, "status": run.status,
                "group": n, "reward": definition.text, "reward_kind": definition.kind,
                **run_summary(run, costs[i]),
                "frontier": fr,
                "vs_baseline": compare(run, runs[g_base], costs[i], costs[g_base]),
                "correlation": correlations(run),
            }
            verified = verified_summary(run, costs[i], entries[i])
            if verified is not None:  # only runs with a verifier carry the block
                entries[i]["verified"] = verified
        key = "reward_gain_per_tflop" if g_basis == COMPUTE else "reward_gain_per_usd"
        ranked = sorted((i for i in members if entries[i]["vs_baseline"][key] is not None),
                        key=lambda i: -entries[i]["vs_baseline"][key])
        groups.append({
            "reward": definition.text, "reward_kind": definition.kind, "reward_units": definition.units,
            "runs": [labels[i] for i in members], "baseline": labels[g_base], "baseline_path": runs[g_base].uri,
            "basis": g_basis, "basis_note": note, "frontier": block, "ranked_by": key,
            "ranking": [labels[i] for i in ranked],
            "verified_runs": [labels[i] for i in members if "verified" in entries[i]],
        })
    from_folders = [labels[i] for i, c in enumerate(costs) if c.source == "model folders" and c.problem is None]
    return finite({
        "basis": basis,
        "baseline": labels[base_index],
        "baseline_path": runs[base_index].uri,
        "groups": groups,
        "frontier": groups[0]["frontier"],  # the baseline's group, as in reports before groups
        "ranking": groups[0]["ranking"],
        "notes": _notes(runs, grouped, groups, from_folders),
        "definitions": ({**DEFINITIONS, **VERIFIED_DEFINITIONS} if any(g["verified_runs"] for g in groups)
                        else DEFINITIONS),
        "runs": entries,
        "rounds": report_rounds.build_series(runs, labels),
    })


def _notes(runs: list[Run], grouped: list, groups: list[dict], from_folders: list[str]) -> list[str]:
    """What the reader must know before the numbers: reward groups (one line each, after a newline and "- "), basis
    fallbacks, parameter counts read from model folders. Said on the terminal and at the top of report.md."""
    notes = []
    if len(groups) > 1:
        notes.append(f"the runs are scored by {len(groups)} different reward definitions, whose values cannot be "
                     "compared, so each is ranked on its own frontier against its own baseline:"
                     + "".join(f"\n- {line} (baseline {g['baseline']})"
                               for line, g in zip(describe_groups(runs, grouped), groups)))
    for g in groups:
        if g["basis_note"]:
            notes.append(f"{g['reward']}: {g['basis_note']}" if len(groups) > 1 else g["basis_note"])
    if from_folders:
        notes.append(f"parameter counts of {', '.join(from_folders)} were read from the model folders named in "
                     "their config (their manifests predate recorded counts)")
    uncut = [r.name for r in runs if r.method == "speculative_rejection" and r.rows
             and not any(c.get("finish_reason") == "rejected" for row in r.rows for c in row.get("candidates") or [])]
    if uncut:
        notes.append(f"{', '.join(uncut)}: Speculative Rejection made no cut at all (no candidate was rejected): "
                     "Best-of-N at Speculative Rejection's price")
    return notes


def _f(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _usd(x) -> str:
    return "n/a" if x is None else f"${x:.3g}"


def _count(x) -> str:
    """A parameter count with an SI prefix: 852k, 1.3M, 7.2B; ? when it could not be counted."""
    if x is None:
        return "?"
    for scale, prefix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{prefix}"
    return str(x)


def _interval(fr: dict) -> str:
    lo, hi = fr["interval"]
    return f"{_f(fr['mean_best_reward'], 3)} [{_f(lo, 3)}, {_f(hi, 3)}]"


def _vs_base(fr: dict) -> str:
    """The "vs baseline's reward" cell: baseline, above, or below (said in bold, with the numbers)."""
    if not fr.get("placed") or fr.get("below_baseline") is None:
        return "n/a"
    if fr["is_baseline"]:
        return "baseline"
    if fr["below_baseline"]:
        tie = ", within each other's intervals" if fr["below_baseline_within_intervals"] else ""
        return f"**below the baseline**{tie}"
    return "not below"


def basis_line(report: dict) -> str:
    """Which cost the report ranks by, first thing in report.md and on the terminal."""
    if report["basis"] == COMPUTE:
        text = ("Ranked by **compute**: FLOPs per prompt, 2 x parameters x tokens processed by the target, draft and "
                "reward model, which does not move with the machine's load. Measured device-seconds and USD are in "
                "the tables beside it; they do.")
    else:
        text = ("Ranked by **measured USD** (--basis usd): device-seconds x the runs' price per device-hour, which "
                "on a shared machine moves with its load, and the verdict with it. Compute (FLOPs) is in the tables.")
    fallback = [g for g in report["groups"] if g["basis"] != report["basis"]]
    if fallback:
        text += " Some runs have no compute, so their reward group is ranked by measured USD (below)."
    return text


def headline(report: dict, group: dict) -> str:
    """The block that answers "which runs are worth their cost" for one reward group: the frontier cheapest first,
    with the marginal cost of each step, the dominated runs and what dominates them, and every run below the
    baseline's reward. Only basis costs and rewards: on the compute basis the same runs give the same block."""
    runs = {e["label"]: e for e in report["runs"]}
    fr, basis = group["frontier"], group["basis"]
    if not fr["order"]:
        why = "; ".join(f"{label}: {reason}" for label, reason in fr["not_placed"].items())
        return f"No run could be placed on the cost-reward frontier ({why})."
    base_r = fr["baseline_mean_best_reward"]
    lines = [f"**Worth their cost**: the cost-reward frontier by {BASIS_NAMES[basis]}, cheapest first; mean best "
             f"reward [95% interval] over the {fr['prompts']} prompts every run completed.", ""]
    for k, label in enumerate(fr["order"]):
        e = runs[label]
        f = e["frontier"]
        s = (f"{k + 1}. **{label}** ({e['method']}{', the baseline' if f['is_baseline'] else ''}): {_interval(f)} "
             f"at {fmt_cost(f['cost_per_prompt'], basis)} per prompt")
        if f["marginal_cost_per_reward"] is not None:
            s += f"; {fmt_cost(f['marginal_cost_per_reward'], basis)} per extra unit of reward over {f['previous']}"
            if f["step_within_intervals"]:
                s += " (the two within each other's intervals)"
        elif f["previous"] is not None:
            s += f"; the same point as {f['previous']}"
        if f["below_baseline"]:
            tie = ", within each other's intervals" if f["below_baseline_within_intervals"] else ""
            mine, theirs = fmt_pair(f["mean_best_reward"], base_r)
            s += f"; **below the baseline's reward** ({mine} < {theirs}{tie})"
        lines.append(s + ".")
    if fr["dominated"]:
        lines += ["", "**Not worth their cost** (dominated):", ""]
        for label in fr["dominated"]:
            f = runs[label]["frontier"]
            lines.append(f"- **{label}** ({runs[label]['method']}{', the baseline' if f['is_baseline'] else ''}): "
                         f"{f['verdict']}.")
    else:
        lines += ["", "No run is dominated."]
    if fr["not_placed"]:
        lines += ["", "Not placed: " + "; ".join(f"{label} ({why})" for label, why in fr["not_placed"].items())
                  + "."]
    return "\n".join(lines)


def terminal_summary(report: dict) -> str:
    """What `winnow report` prints: the basis, the notes (reward groups, basis fallbacks) and each group's
    headline, as plain text."""
    parts = [basis_line(report)]
    parts += [f"Note: {n}".replace("\n- ", "\n  - ") + "." for n in report["notes"]]
    for g in report["groups"]:
        if len(report["groups"]) > 1:
            parts.append(f"Scored by {g['reward']} (baseline {g['baseline']}):")
        parts.append(headline(report, g))
        if g["verified_runs"]:
            parts.append("\n".join(verified_lines(report, g)))
    parts += report_rounds.terminal_lines(report["rounds"])
    if report.get("plan"):
        parts.append("\n".join(plancheck.terminal_lines(report["plan"])))
    return "\n\n".join(parts).replace("**", "")


def render_markdown(report: dict, plots: dict[str, str]) -> str:
    """report.md: the basis and notes, then per reward group its frontier, reward gained per cost and the
    comparison with its baseline; then per-run costs, correlations, plots and definitions."""
    runs = {e["label"]: e for e in report["runs"]}
    groups = report["groups"]
    lines = ["# Winnow report: the cost-reward frontier", "", basis_line(report), ""]
    for note in report["notes"]:
        lines += [f"**Note:** {note}.", ""]
    h = "##" if len(groups) == 1 else "###"
    for g in groups:
        if len(groups) > 1:
            lines += [f"## Scored by {g['reward']}", ""]
        lines += [headline(report, g), "",
                  f"Baseline: **{g['baseline']}** (`{g['baseline_path']}`).", ""]
        lines += _frontier_section(report, g, h)
        lines += _verified_section(report, g, h)
        lines += _ranking_section(report, g, h)
        lines += _baseline_section(report, g, h)
        lines.append("")
    lines += report_rounds.markdown_section(report["rounds"])
    if report.get("plan"):
        lines += plancheck.markdown_section(report["plan"])
    lines += ["## Runs", "",
              "| run | method | engine | status | reward | prompts | errors | mean best reward [95% interval] "
              "(std) | generated tokens / prompt | target / draft / reward tokens per prompt | parameters (target / "
              "draft / reward) | compute / prompt | device-s / prompt | USD / device-hour | USD / prompt | "
              "USD total | USD / unit reward (raw) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in runs.items():
        ci = e["mean_best_reward_interval"]
        ci = "" if ci is None else f" [{_f(ci[0], 3)}, {_f(ci[1], 3)}]"
        p = e["parameters"]
        params = " / ".join(_count(p[r]) if (p[r] is not None or r in e["parameters_not_counted"]) else "-"
                            for r in ("target", "draft", "reward"))
        if e["parameters_source"] == "model folders":
            params += " (from model folders)"
        tokens = " / ".join(_f(e[f"{r}_tokens_per_prompt"]) for r in ("target", "draft", "reward"))
        lines.append(
            f"| {label} | {e['method']} | {e['engine']} | {e['status']} | {e['reward']} | {e['prompts']} | "
            f"{e['errors']} | {_f(e['mean_best_reward'])}{ci} ({_f(e['best_reward']['std'], 3)}) | "
            f"{_f(e['generated_tokens_per_prompt'])} | {tokens} | {params} | "
            f"{fmt_cost(e['flops_per_prompt'], COMPUTE)} | {_f(e['device_seconds_per_prompt'])} | "
            f"{_usd(e['usd_per_device_hour'])} | {_usd(e['usd_per_prompt'])} | {_usd(e['usd_total'])} | "
            f"{_usd(e['usd_per_reward'])} |")
    lines += ["", "Intervals here are over each run's own prompts; the frontiers' are over the prompts every run of "
              "the reward group completed. Compute is n/a where a parameter count is missing (see the notes)."]
    lines += _correlation_section(runs)
    lines += ["", "## Plots", ""]
    for caption, name in plots.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{k}**: {v}." for k, v in report["definitions"].items()]
    lines.append("")
    return "\n".join(lines)


def _members(report: dict, group: dict) -> dict:
    runs = {e["label"]: e for e in report["runs"]}
    return {label: runs[label] for label in group["runs"]}


def _frontier_section(report: dict, group: dict, h: str) -> list[str]:
    """The frontier table: frontier runs cheapest first, then the dominated runs by cost, then the runs not placed."""
    runs = _members(report, group)
    fr, basis = group["frontier"], group["basis"]
    lines = [f"{h} Cost-reward frontier", "",
             f"By {BASIS_NAMES[basis]}, over the {fr['prompts']} prompts every run completed; mean best reward with "
             "its 95% bootstrap interval over prompts.", "",
             "| run | method | frontier | compute / prompt | USD / prompt (measured) | device-s / prompt | mean best "
             "reward [95% interval] | marginal cost / unit reward | vs baseline's reward | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    placed = [label for label, e in runs.items() if e["frontier"]["placed"]]
    dominated = sorted((label for label in placed if not runs[label]["frontier"]["on_frontier"]),
                       key=lambda label: runs[label]["frontier"]["cost_per_prompt"])
    for label in fr["order"] + dominated:
        e, f = runs[label], runs[label]["frontier"]
        where = f"yes ({f['position']})" if f["on_frontier"] else "dominated"
        lines.append(f"| {label} | {e['method']} | {where} | {fmt_cost(f['flops_per_prompt'], COMPUTE)} | "
                     f"{_usd(f['usd_per_prompt'])} | {_f(f['device_seconds_per_prompt'])} | {_interval(f)} | "
                     f"{fmt_cost(f['marginal_cost_per_reward'], basis)} | {_vs_base(f)} | {f['verdict']} |")
    for label, why in fr["not_placed"].items():
        lines.append(f"| {label} | {runs[label]['method']} | not placed | n/a | n/a | n/a | n/a | n/a | n/a | {why} |")
    return lines


def _share(x) -> str:
    """A rate as a percentage with 3 significant digits."""
    return "n/a" if x is None else f"{100 * x:.3g}%"


def _rate(v: dict) -> str:
    ci = v["verified_rate_interval"]
    return _share(v["verified_rate"]) + ("" if ci is None else f" [{_share(ci[0])}, {_share(ci[1])}]")


def _pass_at_k(v: dict) -> str:
    return ", ".join(f"@{p['k']} {_f(p['value'], 3)}" for p in v["pass_at_k"]) if v["pass_at_k"] else "n/a"


_PASS_UNITS = {"usd": _usd, "flops": lambda x: fmt_cost(x, COMPUTE), "device_seconds": lambda x: f"{x:.3g} device-s"}


def _pass_cost(v: dict, unit: str) -> str:
    """The cost of a pass in `unit` (usd, flops, device_seconds) with its interval, or "no verified prompt"."""
    c = v["cost_of_a_pass"]
    if c["no_verified_prompt"]:
        return "no verified prompt"
    if c[unit] is None:
        return "n/a"
    fmt = _PASS_UNITS[unit]
    low, high = c[f"{unit}_interval"]
    return f"{fmt(c[unit])} [{fmt(low)}, {'unbounded' if high is None else fmt(high)}]"


def _verified_section(report: dict, group: dict, h: str) -> list[str]:
    """The verified answers of the group's runs with a verifier (none: no section): verified rate, pass@1 and
    pass@k, and the cost of a pass beside the cost per unit of reward."""
    if not group["verified_runs"]:
        return []
    runs = _members(report, group)
    lines = ["", f"{h} Verified answers", "",
             "Runs with a verifier. The verified rate is the share of the prompts that ran whose answer verified. The "
             "**cost of a pass** is their cost per verified prompt (Cost-of-Pass), shown beside the cost per unit of "
             "reward. Intervals are 95% bootstrap intervals over each run's own prompts.", "",
             "| run | method | verifier | verified / ran | verified rate [95% interval] | mean pass@1 | mean pass@k | "
             "compute per verified prompt [95% interval] | USD per verified prompt [95% interval] | compute / unit "
             "reward (raw) | USD / unit reward (raw) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    unjudged, no_compute, uncut = [], False, True
    for label in group["verified_runs"]:
        e = runs[label]
        v = e["verified"]
        compute = _pass_cost(v, "flops" if e["compute_problem"] is None else "device_seconds")
        per = v["cost_per_unit_reward"]
        lines.append(f"| {label} | {e['method']} | {v['verifier']} | {v['verified_prompts']} / {v['prompts_ran']} | "
                     f"{_rate(v)} | {_f(v['pass_at_1'], 3)} | {_pass_at_k(v)} | {compute} | {_pass_cost(v, 'usd')} | "
                     f"{fmt_cost(per['flops'], COMPUTE)} | {_usd(per['usd'])} |")
        if v["unjudged_prompts"]:
            unjudged.append(f"{label} ({v['unjudged_prompts']})")
        no_compute = no_compute or e["compute_problem"] is not None
        uncut = uncut and v["pass_at_1"] is not None
    if no_compute or not uncut or unjudged:
        lines.append("")
    if no_compute:
        lines.append("Compute is in device-seconds where a run has no compute (see the notes).")
    if not uncut:
        lines.append("Mean pass@1 and pass@k are n/a where the method cut candidates before they were judged.")
    if unjudged:
        lines.append("Prompts that ran without a verdict, counted as not verified: " + ", ".join(unjudged) + ".")
    return lines


def verified_lines(report: dict, group: dict) -> list[str]:
    """The verified answers of the group's runs with a verifier, for the terminal: the cost of a pass on the
    group's basis only, as the headline gives costs (on the compute basis the same runs give the same words)."""
    runs = _members(report, group)
    basis = group["basis"]
    unit = "flops" if basis == COMPUTE else "usd"
    lines = [f"Verified answers (the cost of a pass: {'compute' if basis == COMPUTE else 'measured USD'} per "
             "verified prompt [95% interval]):"]
    for label in group["verified_runs"]:
        e = runs[label]
        v = e["verified"]
        s = (f"- {label} ({e['method']}, {v['verifier']} verifier): {v['verified_prompts']} of {v['prompts_ran']} "
             f"prompts verified, {_rate(v)}")
        if v["pass_at_1"] is not None:
            s += f"; mean pass@1 {_f(v['pass_at_1'], 3)}"
        s += f"; cost of a pass: {_pass_cost(v, unit)}"
        per = v["cost_per_unit_reward"][unit]
        if per is not None:
            s += f"; cost per unit of reward: {fmt_cost(per, basis)}"
        lines.append(s)
    return lines


def _ranking_section(report: dict, group: dict, h: str) -> list[str]:
    """Reward gained per unit of the basis, ranked; runs without a gain listed after, unranked."""
    runs = _members(report, group)
    compute = group["basis"] == COMPUTE
    unit = "TFLOP" if compute else "USD"
    lines = ["", f"{h} Reward gained per {unit}", "",
             f"One ratio of averages, sorted by it: the mean gain over the baseline's single-sample reward divided by "
             f"the mean {'compute' if compute else 'measured USD'} per prompt. A run cheap enough scores high however "
             "little it gains, so it is no verdict on its own; the frontier above is. A run without a gain is not "
             "ranked: the ratio of a loss to a cost would put the cheapest loss first.", "",
             "| rank | run | method | vs baseline's reward | prompts matched | mean best reward | "
             f"baseline single-sample reward | mean reward gain | {'compute' if compute else 'USD'} / prompt | "
             f"reward gained / {unit} | {'FLOPs' if compute else 'USD'} / unit reward gained |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    unranked = [label for label in runs if label not in group["ranking"]]
    for i, label in enumerate(group["ranking"] + unranked):
        e, v = runs[label], runs[label]["vs_baseline"]
        rank = str(i + 1) if label in group["ranking"] else "-"
        if compute:
            cost, per, inverse = (fmt_cost(v["flops_per_prompt_matched"], COMPUTE), _f(v["reward_gain_per_tflop"]),
                                  fmt_cost(v["flops_per_reward_gain"], COMPUTE))
        else:
            cost, per, inverse = (_usd(v["usd_per_prompt_matched"]), _f(v["reward_gain_per_usd"]),
                                  _usd(v["usd_per_reward_gain"]))
        if v["gains_reward"] is False:
            per = "no gain"
        lines.append(f"| {rank} | {label} | {e['method']} | {_vs_base(e['frontier'])} | "
                     f"{v['prompts_with_baseline_rewards']} | "
                     f"{_f(v['mean_best_reward_matched'])} | {_f(v['baseline_single_sample_reward'])} | "
                     f"{_f(v['mean_reward_gain'])} | {cost} | {per} | {inverse} |")
    matched = {runs[label]["vs_baseline"]["prompts_with_baseline_rewards"] for label in runs}
    if len(matched) > 1:
        lines += ["", "Note: the runs were matched with the baseline on different numbers of prompts (errors or "
                  "missing prompts), so their rows above average over different prompt sets."]
    return lines


def _baseline_section(report: dict, group: dict, h: str) -> list[str]:
    runs = _members(report, group)
    lines = ["", f"{h} Against the baseline (paper 001, equations 7 and 8)", "",
             "| run | method | vs baseline's reward | matched prompts | improvement score | prompts scored | "
             "left out (max = min) | relative FLOPs | relative compute (device-s) | relative compute (mean of "
             "per-prompt ratios) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in runs.items():
        v = e["vs_baseline"]
        lines.append(f"| {label} | {e['method']} | {_vs_base(e['frontier'])} | {v['matched_prompts']} | "
                     f"{_f(v['improvement_score'])} | {v['improvement_score_prompts']} | "
                     f"{v['improvement_score_excluded_equal_rewards']} | {_f(v['relative_flops'])} | "
                     f"{_f(v['relative_compute'])} | {_f(v['relative_compute_mean_of_ratios'])} |")
    return lines


def _correlation_section(runs: dict) -> list[str]:
    lines = ["", "## Partial against final rewards (paper 001, appendix B)", ""]
    with_data = [(label, e) for label, e in runs.items() if e["correlation"]["by_decision"]]
    if not with_data:
        return lines + ["No run recorded partial rewards on candidates that also have a final reward "
                        "(at least 3 per prompt), so there is no correlation to report."]
    lines += ["| run | decision | prompts | mean candidates | Pearson mean | Pearson median | Kendall mean | "
              "Kendall median |", "|---|---|---|---|---|---|---|---|"]
    for label, e in with_data:
        for d in e["correlation"]["by_decision"]:
            lines.append(f"| {label} | {d['decision']} | {d['prompts']} | {_f(d['mean_candidates'], 3)} | "
                         f"{_f(d['pearson_mean'], 3)} | {_f(d['pearson_median'], 3)} | {_f(d['kendall_mean'], 3)} | "
                         f"{_f(d['kendall_median'], 3)} |")
    return lines


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _group_plots(report: dict, n: int, runs: list[Run], suffix: str, taken: set[str]) -> dict:
    """The plots of reward group `n`: reward against cost (its frontier), improvement score against relative
    compute, best reward per prompt; file names end with `suffix` when the report has several groups."""
    group = report["groups"][n]
    entries = [e for e in report["runs"] if e["group"] == n]
    by_label = {e["label"]: run for e, run in zip(report["runs"], runs)}
    fr, basis, units = group["frontier"], group["basis"], group["reward_units"]
    of = f" ({group['reward']})" if suffix else ""
    out = {}
    placed = [e for e in entries if e["frontier"]["placed"]]
    if placed:
        points = [{"label": e["label"], "method": e["method"], "cost": e["frontier"]["cost_per_prompt"],
                   "reward": e["frontier"]["mean_best_reward"], "low": e["frontier"]["interval"][0],
                   "high": e["frontier"]["interval"][1], "on_frontier": e["frontier"]["on_frontier"],
                   "is_baseline": e["frontier"]["is_baseline"], "below_baseline": e["frontier"]["below_baseline"]}
                  for e in placed]
        prices = {e["frontier"]["usd_per_device_hour"] for e in placed}
        what = "compute" if basis == COMPUTE else "USD"
        name = _unique(f"reward_vs_{'flops' if basis == COMPUTE else 'usd'}_per_prompt_frontier{suffix}.png", taken)
        out[f"Mean best reward against {what} per prompt: the cost-reward frontier{of}"] = (
            name, report_plots.reward_vs_cost(points, fr["order"], fr["baseline_single_sample_reward"],
                                              fr["baseline_mean_best_reward"],
                                              prices.pop() if len(prices) == 1 else None, fr["prompts"],
                                              basis=basis, reward_units=units))
    key = "relative_flops" if basis == COMPUTE else "relative_compute"
    scored = [{"label": e["label"], "method": e["method"], "relative_compute": e["vs_baseline"][key],
               "improvement_score": e["vs_baseline"]["improvement_score"],
               "below_baseline": e["frontier"].get("below_baseline")}
              for e in entries if e["vs_baseline"][key] is not None
              and e["vs_baseline"]["improvement_score"] is not None]
    if scored:
        name = _unique(f"improvement_score_vs_relative_compute{suffix}.png", taken)
        out[f"Improvement score against relative compute (paper 001's view){of}"] = (
            name, report_plots.improvement_vs_relative_compute(scored, group["baseline"], basis=basis))
    series = [(f"{e['label']}\n({e['method']})",
               [r["best_reward"] for r in ok_rows(by_label[e["label"]]).values() if r["best_reward"] is not None])
              for e in entries]
    series = [s for s in series if s[1]]
    if series:
        name = _unique(f"best_reward_per_prompt_by_run{suffix}.png", taken)
        out[f"Best reward per prompt, per run{of}"] = (name, report_plots.best_reward_distribution(series, units))
    return out


def draw_plots(runs: list[Run], report: dict) -> dict[str, tuple[str, bytes]]:
    """caption -> (file name, PNG bytes) for every plot the data allows; file names say what each shows."""
    out: dict[str, tuple[str, bytes]] = {}
    taken: set[str] = set()
    several = len(report["groups"]) > 1
    for n, g in enumerate(report["groups"]):
        out.update(_group_plots(report, n, runs, f"_{_slug(g['reward_kind'])}" if several else "", taken))
    series = report_rounds.plot_series(report["rounds"])
    if series:
        out["Held-out reward and cumulative cost by round (rounds of Expert Iteration)"] = (
            _unique("rounds_reward_and_cumulative_cost.png", taken), report_plots.rounds(series))
    for e, run in zip(report["runs"], runs):
        pid = sample_prompt(run)
        if pid is None or not e["correlation"]["records"]:
            continue
        pts = correlation_points(ok_rows(run)[pid])
        name = _unique(f"partial_vs_final_reward_{_slug(e['label'])}_prompt_{_slug(pid)}.png", taken)
        out[f"Partial against final reward: {e['label']}, prompt {pid}"] = (
            name, report_plots.partial_vs_final(pts, f"{e['label']} ({e['method']}), prompt {pid}"))
        first = [r for r in e["correlation"]["records"] if r["decision"] == 0]
        if first:
            name = _unique(f"partial_final_correlation_histograms_{_slug(e['label'])}.png", taken)
            out[f"Correlation at the first decision over prompts: {e['label']}"] = (
                name, report_plots.correlation_histograms(
                    [r["pearson"] for r in first], [r["kendall"] for r in first],
                    f"{e['label']}: partial (first decision) vs final reward, {len(first)} prompts"))
    return out


def _unique(name: str, taken: set[str]) -> str:
    """name, or name with -2, -3... before .png when two runs' labels make the same file name."""
    stem, k, out = name[:-4], 2, name
    while out in taken:
        out, k = f"{stem}-{k}.png", k + 1
    taken.add(out)
    return out


def write_report(runs: list[Run], base_index: int, out: str, basis: str = COMPUTE, resolve=_identity,
                 plan: dict | None = None) -> dict:
    """Compute, draw and write report.json, report.md and the PNGs to `out` (through a temporary folder); with
    `plan` (`reporting.plancheck.read_plan`), the plan checked against the runs."""
    report = build_report(runs, base_index, basis, resolve)
    if plan is not None:
        report["plan"] = plancheck.check(plan, runs, report["runs"])
    plots = draw_plots(runs, report)
    report["plots"] = {caption: name for caption, (name, _) in plots.items()}
    markdown = render_markdown(report, report["plots"])
    with staged_out(out, "winnow report") as (fs, tmp):
        for name, png in plots.values():
            write_bytes(fs, posixpath.join(tmp, name), png)
        write_bytes(fs, posixpath.join(tmp, "report.json"),
                    json.dumps(report, indent=2, allow_nan=False).encode("utf-8"))
        write_bytes(fs, posixpath.join(tmp, "report.md"), markdown.encode("utf-8"))
    return report
