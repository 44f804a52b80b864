"""Assembling the report of runs against a baseline: `report.json`, `report.md` and its PNG plots.

The numbers come from `reporting.stats` and `reporting.frontier` (definitions there and in the report's own
"Definitions" section); this module orders them, writes the headline (the cost-reward frontier, the dominated runs
and what dominates them, and the runs below the baseline's reward), and writes the files.
"""

from __future__ import annotations

import json
import posixpath
import re

from reporting import plots as report_plots
from reporting.frontier import build_frontier
from reporting.stats import compare, correlation_points, correlations, finite, ok_rows, run_summary, sample_prompt
from runfolder.outputs import staged_out, write_bytes
from runfolder.runs import Run, reward_mismatch, unique_labels

DEFINITIONS = {
    "baseline": "the run given with --baseline; without it, the first RUN_DIR",
    "USD": "device_seconds / 3600 x cost.usd_per_device_hour of the run's own manifest",
    "per prompt": "mean over the run's prompts without an error; totals include errored rows",
    "frontier's prompts": "the prompt_ids every run with data completed (no error, a best reward); the frontier's "
    "USD per prompt, mean best reward and intervals are over these prompts. A run without any completed prompt is "
    "not placed",
    "dominates": "run A dominates run B when A's USD per prompt is no higher and its mean best reward no lower, and "
    "one of the two strictly better",
    "cost-reward frontier": "the runs no other run dominates, cheapest first: for a reward you need, the cheapest "
    "run that reaches it is on the frontier",
    "marginal USD per unit of reward": "on the frontier, (USD per prompt - the previous point's) / (mean best reward "
    "- the previous point's): what each extra unit of reward costs on that step",
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
    "averaged over prompts",
    "baseline single-sample reward": "per prompt, the mean final reward of the baseline's finished candidates "
    "(the expected reward of one sample with no selection)",
    "reward gain": "the run's best reward minus the baseline single-sample reward, per prompt, averaged",
    "reward gained per USD": "mean reward gain / mean USD per prompt, over the prompts matched with the baseline: a "
    "ratio of averages, so a run cheap enough scores high however little it gains; read it with the frontier, "
    "not as a ranking of worth",
    "USD per unit reward gained": "mean USD per prompt / mean reward gain; only where the mean gain is positive",
    "USD per unit reward (raw)": "USD per prompt / mean best reward; only where the mean best reward is positive",
    "correlation": "paper 001 appendix B: per prompt and decision index, Pearson r and Kendall tau-b (scipy) "
    "between partial reward at that decision and final reward, over candidates that have both (rejected "
    "candidates have no final reward and are not included)",
}


def order_runs(runs: list[Run], baseline: Run | None) -> tuple[list[Run], int]:
    """The runs of the report and the baseline's index: --baseline is prepended unless it is one of the runs."""
    if baseline is None:
        return runs, 0
    for i, r in enumerate(runs):
        if r is baseline:
            return runs, i
    return [baseline, *runs], 0


def build_report(runs: list[Run], base_index: int) -> dict:
    """Every number of the report as one JSON-able dict (NaN-free)."""
    labels = unique_labels(runs)
    base = runs[base_index]
    block, per_run = build_frontier(runs, labels, base_index)
    entries = []
    for label, run, fr in zip(labels, runs, per_run):
        entries.append({
            "label": label, "name": run.name, "path": run.uri, "method": run.method,
            "engine": run.engine, "config_hash": run.manifest.config_hash, "status": run.status,
            **run_summary(run),
            "frontier": fr,
            "vs_baseline": compare(run, base),
            "correlation": correlations(run),
        })
    ranked = sorted(
        (e for e in entries if e["vs_baseline"]["reward_gain_per_usd"] is not None),
        key=lambda e: -e["vs_baseline"]["reward_gain_per_usd"],
    )
    return finite({
        "baseline": labels[base_index],
        "baseline_path": base.uri,
        "frontier": block,
        "ranking": [e["label"] for e in ranked],
        "warnings": [w for w in [reward_mismatch(runs)] if w],
        "definitions": DEFINITIONS,
        "runs": entries,
    })


def _f(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _usd(x) -> str:
    return "n/a" if x is None else f"${x:.3g}"


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


def headline(report: dict) -> str:
    """The paragraph that answers "which runs are worth their cost": the frontier cheapest first, with the marginal
    cost of each step, the dominated runs and what dominates them, and every run below the baseline's reward."""
    runs = {e["label"]: e for e in report["runs"]}
    fr = report["frontier"]
    if not fr["order"]:
        why = "; ".join(f"{label}: {reason}" for label, reason in fr["not_placed"].items())
        return f"No run could be placed on the cost-reward frontier ({why})."
    base_r = fr["baseline_mean_best_reward"]
    parts = []
    for label in fr["order"]:
        e = runs[label]
        f = e["frontier"]
        s = (f"**{label}** ({e['method']}{', the baseline' if f['is_baseline'] else ''}) {_interval(f)} for "
             f"{_usd(f['usd_per_prompt'])} per prompt")
        if f["marginal_usd_per_reward"] is not None:
            s += f", {_usd(f['marginal_usd_per_reward'])} per extra unit of reward over {f['previous']}"
            if f["step_within_intervals"]:
                s += " (the two within each other's intervals)"
        elif f["previous"] is not None:
            s += f", the same point as {f['previous']}"
        if f["below_baseline"]:
            tie = ", within each other's intervals" if f["below_baseline_within_intervals"] else ""
            s += f", **below the baseline's reward** ({_f(f['mean_best_reward'], 3)} < {_f(base_r, 3)}{tie})"
        parts.append(s)
    text = (f"**Worth their cost**, the cost-reward frontier (no other run is both cheaper and better; cheapest "
            f"first; mean best reward [95% interval] over the {fr['prompts']} prompts every run completed): "
            + "; then ".join(parts) + ".")
    if fr["dominated"]:
        text += " **Not worth their cost** (dominated): " + "; ".join(
            f"**{label}** ({runs[label]['method']}), {runs[label]['frontier']['verdict']}"
            for label in fr["dominated"]) + "."
    else:
        text += " No run is dominated."
    if fr["not_placed"]:
        text += " Not placed: " + "; ".join(f"{label} ({why})" for label, why in fr["not_placed"].items()) + "."
    return text


def render_markdown(report: dict, plots: dict[str, str]) -> str:
    """report.md: the frontier first, then reward gained per USD, per-run costs, baseline metrics, correlations,
    plots and definitions."""
    runs = {e["label"]: e for e in report["runs"]}
    fr = report["frontier"]
    lines = ["# Winnow report: the cost-reward frontier", "", headline(report), "",
             f"Baseline: **{report['baseline']}** (`{report['baseline_path']}`).", ""]
    for warning in report["warnings"]:
        lines += [f"**Warning:** {warning}.", ""]
    lines += _frontier_section(report)
    lines += ["", "## Reward gained per USD", "",
              "One ratio of averages, sorted by it: the mean gain over the baseline's single-sample reward divided by "
              "the mean USD per prompt. A run cheap enough scores high however little it gains, so it is no verdict "
              "on its own; the frontier above is.", "",
              "| rank | run | method | vs baseline's reward | prompts matched | mean best reward | "
              "baseline single-sample reward | mean reward gain | USD / prompt | reward gained / USD | "
              "USD / unit reward gained |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    unranked = [label for label in runs if label not in report["ranking"]]
    for i, label in enumerate(report["ranking"] + unranked):
        e, v = runs[label], runs[label]["vs_baseline"]
        rank = str(i + 1) if label in report["ranking"] else "-"
        lines.append(f"| {rank} | {label} | {e['method']} | {_vs_base(e['frontier'])} | "
                     f"{v['prompts_with_baseline_rewards']} | "
                     f"{_f(v['mean_best_reward_matched'])} | {_f(v['baseline_single_sample_reward'])} | "
                     f"{_f(v['mean_reward_gain'])} | {_usd(v['usd_per_prompt_matched'])} | "
                     f"{_f(v['reward_gain_per_usd'])} | {_usd(v['usd_per_reward_gain'])} |")
    matched = {runs[label]["vs_baseline"]["prompts_with_baseline_rewards"] for label in runs}
    if len(matched) > 1:
        lines += ["", "Note: the runs were matched with the baseline on different numbers of prompts (errors or "
                  "missing prompts), so their rows above average over different prompt sets."]
    lines += ["", "## Runs", "",
              "| run | method | engine | status | prompts | errors | mean best reward [95% interval] (std) | "
              "generated tokens / prompt | target tokens / prompt | draft tokens / prompt | device-s / prompt | "
              "USD / device-hour | USD / prompt | USD total | USD / unit reward (raw) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in runs.items():
        ci = e["mean_best_reward_interval"]
        ci = "" if ci is None else f" [{_f(ci[0], 3)}, {_f(ci[1], 3)}]"
        lines.append(
            f"| {label} | {e['method']} | {e['engine']} | {e['status']} | {e['prompts']} | {e['errors']} | "
            f"{_f(e['mean_best_reward'])}{ci} ({_f(e['best_reward']['std'], 3)}) | "
            f"{_f(e['generated_tokens_per_prompt'])} | {_f(e['target_tokens_per_prompt'])} | "
            f"{_f(e['draft_tokens_per_prompt'])} | {_f(e['device_seconds_per_prompt'])} | "
            f"{_usd(e['usd_per_device_hour'])} | {_usd(e['usd_per_prompt'])} | {_usd(e['usd_total'])} | "
            f"{_usd(e['usd_per_reward'])} |")
    lines += ["", "Intervals here are over each run's own prompts; the frontier's are over the prompts every run "
              f"completed ({fr['prompts']})."]
    lines += ["", "## Against the baseline (paper 001, equations 7 and 8)", "",
              "| run | method | vs baseline's reward | matched prompts | improvement score | prompts scored | "
              "left out (max = min) | relative compute | relative compute (mean of per-prompt ratios) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for label, e in runs.items():
        v = e["vs_baseline"]
        lines.append(f"| {label} | {e['method']} | {_vs_base(e['frontier'])} | {v['matched_prompts']} | "
                     f"{_f(v['improvement_score'])} | {v['improvement_score_prompts']} | "
                     f"{v['improvement_score_excluded_equal_rewards']} | {_f(v['relative_compute'])} | "
                     f"{_f(v['relative_compute_mean_of_ratios'])} |")
    lines += _correlation_section(runs)
    lines += ["", "## Plots", ""]
    for caption, name in plots.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{k}**: {v}." for k, v in report["definitions"].items()]
    lines.append("")
    return "\n".join(lines)


def _frontier_section(report: dict) -> list[str]:
    """The frontier table: frontier runs cheapest first, then the dominated runs by cost, then the runs not placed."""
    runs = {e["label"]: e for e in report["runs"]}
    fr = report["frontier"]
    lines = ["## Cost-reward frontier", "",
             f"Over the {fr['prompts']} prompts every run completed; mean best reward with its 95% bootstrap "
             "interval over prompts.", "",
             "| run | method | frontier | USD / prompt | device-s / prompt | mean best reward [95% interval] | "
             "marginal USD / unit reward | vs baseline's reward | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    placed = [label for label, e in runs.items() if e["frontier"]["placed"]]
    dominated = sorted((label for label in placed if not runs[label]["frontier"]["on_frontier"]),
                       key=lambda label: runs[label]["frontier"]["usd_per_prompt"])
    for label in fr["order"] + dominated:
        e, f = runs[label], runs[label]["frontier"]
        where = f"yes ({f['position']})" if f["on_frontier"] else "dominated"
        lines.append(f"| {label} | {e['method']} | {where} | {_usd(f['usd_per_prompt'])} | "
                     f"{_f(f['device_seconds_per_prompt'])} | {_interval(f)} | "
                     f"{_usd(f['marginal_usd_per_reward'])} | {_vs_base(f)} | {f['verdict']} |")
    for label, why in fr["not_placed"].items():
        lines.append(f"| {label} | {runs[label]['method']} | not placed | n/a | n/a | n/a | n/a | n/a | {why} |")
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


def draw_plots(runs: list[Run], report: dict) -> dict[str, tuple[str, bytes]]:
    """caption -> (file name, PNG bytes) for every plot the data allows; file names say what each shows."""
    entries = report["runs"]
    fr = report["frontier"]
    out = {}
    placed = [e for e in entries if e["frontier"]["placed"]]
    if placed:
        points = [{"label": e["label"], "method": e["method"], "usd": e["frontier"]["usd_per_prompt"],
                   "reward": e["frontier"]["mean_best_reward"], "low": e["frontier"]["interval"][0],
                   "high": e["frontier"]["interval"][1], "on_frontier": e["frontier"]["on_frontier"],
                   "is_baseline": e["frontier"]["is_baseline"], "below_baseline": e["frontier"]["below_baseline"]}
                  for e in placed]
        prices = {e["frontier"]["usd_per_device_hour"] for e in placed}
        out["Mean best reward against USD per prompt: the cost-reward frontier"] = (
            "reward_vs_usd_per_prompt_frontier.png",
            report_plots.reward_vs_cost(points, fr["order"], fr["baseline_single_sample_reward"],
                                        fr["baseline_mean_best_reward"],
                                        prices.pop() if len(prices) == 1 else None, fr["prompts"]))
    scored = [{"label": e["label"], "method": e["method"],
               "relative_compute": e["vs_baseline"]["relative_compute"],
               "improvement_score": e["vs_baseline"]["improvement_score"],
               "below_baseline": e["frontier"].get("below_baseline")}
              for e in entries if e["vs_baseline"]["relative_compute"] is not None
              and e["vs_baseline"]["improvement_score"] is not None]
    if scored:
        out["Improvement score against relative compute (paper 001's view)"] = (
            "improvement_score_vs_relative_compute.png",
            report_plots.improvement_vs_relative_compute(scored, report["baseline"]))
    series = [(f"{e['label']}\n({e['method']})",
               [r["best_reward"] for r in ok_rows(run).values() if r["best_reward"] is not None])
              for e, run in zip(entries, runs)]
    series = [s for s in series if s[1]]
    if series:
        out["Best reward per prompt, per run"] = ("best_reward_per_prompt_by_run.png",
                                                  report_plots.best_reward_distribution(series))
    taken = {name for name, _ in out.values()}
    for e, run in zip(entries, runs):
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


def write_report(runs: list[Run], base_index: int, out: str) -> dict:
    """Compute, draw and write report.json, report.md and the PNGs to `out` (through a temporary folder)."""
    report = build_report(runs, base_index)
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
