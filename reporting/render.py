"""Assembling the report of runs against a baseline: `report.json`, `report.md` and its PNG plots.

The numbers come from `reporting.stats` (definitions there and in the report's own "Definitions" section); this
module orders them, names the run with the most reward gained per dollar, and writes the files.
"""

from __future__ import annotations

import json
import posixpath

from reporting import plots as report_plots
from reporting.stats import compare, correlation_points, correlations, finite, ok_rows, run_summary, sample_prompt
from runfolder.outputs import staged_out, write_bytes
from runfolder.runs import Run, reward_mismatch, unique_labels

DEFINITIONS = {
    "baseline": "the run given with --baseline; without it, the first RUN_DIR",
    "USD": "device_seconds / 3600 x cost.usd_per_device_hour of the run's own manifest",
    "per prompt": "mean over the run's prompts without an error; totals include errored rows",
    "improvement score": "paper 001 eq. 8, per prompt 100 x (1 - (max_k s(Z_k) - s(Y)) / (max_k s(Z_k) - "
    "min_k s(Z_k))), Z = the baseline's finished (eos/length) candidates of that prompt, Y = the run's best "
    "response; averaged over prompts both runs completed; prompts with max = min are left out and counted",
    "relative compute": "paper 001 eq. 7, T / T_baseline with T = device-seconds: the ratio of summed "
    "device-seconds over the prompts both runs completed; relative_compute_mean_of_ratios is the per-prompt ratio "
    "averaged over prompts",
    "baseline single-sample reward": "per prompt, the mean final reward of the baseline's finished candidates "
    "(the expected reward of one sample with no selection)",
    "reward gain": "the run's best reward minus the baseline single-sample reward, per prompt, averaged",
    "reward gained per USD": "mean reward gain / mean USD per prompt, over the matched prompts; runs are ranked by it",
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
    entries = []
    for label, run in zip(labels, runs):
        entries.append({
            "label": label, "name": run.name, "path": run.uri, "method": run.method,
            "config_hash": run.manifest.config_hash, "status": run.manifest.status,
            **run_summary(run),
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
        "ranking": [e["label"] for e in ranked],
        "winner": ranked[0]["label"] if ranked else None,
        "warnings": [w for w in [reward_mismatch(runs)] if w],
        "definitions": DEFINITIONS,
        "runs": entries,
    })


def _f(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _usd(x) -> str:
    return "n/a" if x is None else f"${x:.4g}"


def headline(report: dict) -> str:
    """The one sentence that answers "which method gave the most reward per dollar"."""
    runs = {e["label"]: e for e in report["runs"]}
    if report["winner"] is None:
        return ("No run has a defined reward gained per USD against the baseline (the baseline has no finished "
                "candidates with rewards on shared prompts, or every price is 0), so no run is named the winner.")
    w = runs[report["winner"]]
    v = w["vs_baseline"]
    text = (f"**{w['label']}** ({w['method']}) gave the most reward per dollar: "
            f"{_f(v['reward_gain_per_usd'])} reward gained per USD over the baseline's single-sample reward "
            f"({_f(v['mean_reward_gain'])} reward gained for {_usd(v['usd_per_prompt_matched'])} per prompt, "
            f"{v['prompts_with_baseline_rewards']} prompts).")
    if len(report["ranking"]) > 1:
        r = runs[report["ranking"][1]]
        text += f" Runner-up: {r['label']} ({r['method']}) with {_f(r['vs_baseline']['reward_gain_per_usd'])}."
    return text


def render_markdown(report: dict, plots: dict[str, str]) -> str:
    """report.md: the winner first, then the ranking, per-run costs, baseline metrics, correlations, plots."""
    runs = {e["label"]: e for e in report["runs"]}
    lines = ["# Winnow report: reward per dollar", "", headline(report), "",
             f"Baseline: **{report['baseline']}** (`{report['baseline_path']}`).", ""]
    for warning in report["warnings"]:
        lines += [f"**Warning:** {warning}.", ""]
    lines += ["## Ranking by reward gained per USD", "",
              "| rank | run | method | prompts matched | mean best reward | baseline single-sample reward | "
              "mean reward gain | USD / prompt | reward gained / USD | USD / unit reward gained |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    unranked = [label for label in runs if label not in report["ranking"]]
    for i, label in enumerate(report["ranking"] + unranked):
        e, v = runs[label], runs[label]["vs_baseline"]
        rank = str(i + 1) if label in report["ranking"] else "-"
        lines.append(f"| {rank} | {label} | {e['method']} | {v['prompts_with_baseline_rewards']} | "
                     f"{_f(v['mean_best_reward_matched'])} | {_f(v['baseline_single_sample_reward'])} | "
                     f"{_f(v['mean_reward_gain'])} | {_usd(v['usd_per_prompt_matched'])} | "
                     f"{_f(v['reward_gain_per_usd'])} | {_usd(v['usd_per_reward_gain'])} |")
    matched = {runs[label]["vs_baseline"]["prompts_with_baseline_rewards"] for label in runs}
    if len(matched) > 1:
        lines += ["", "Note: the runs were matched with the baseline on different numbers of prompts (errors or "
                  "missing prompts), so their rows above average over different prompt sets."]
    lines += ["", "## Runs", "",
              "| run | method | status | prompts | errors | mean best reward (std) | generated tokens / prompt | "
              "target tokens / prompt | draft tokens / prompt | device-s / prompt | USD / device-hour | "
              "USD / prompt | USD total | USD / unit reward (raw) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in runs.items():
        lines.append(
            f"| {label} | {e['method']} | {e['status']} | {e['prompts']} | {e['errors']} | "
            f"{_f(e['mean_best_reward'])} ({_f(e['best_reward']['std'], 3)}) | "
            f"{_f(e['generated_tokens_per_prompt'])} | {_f(e['target_tokens_per_prompt'])} | "
            f"{_f(e['draft_tokens_per_prompt'])} | {_f(e['device_seconds_per_prompt'])} | "
            f"{_usd(e['usd_per_device_hour'])} | {_usd(e['usd_per_prompt'])} | {_usd(e['usd_total'])} | "
            f"{_usd(e['usd_per_reward'])} |")
    lines += ["", "## Against the baseline (paper 001, equations 7 and 8)", "",
              "| run | method | matched prompts | improvement score | prompts scored | left out (max = min) | "
              "relative compute | relative compute (mean of per-prompt ratios) |",
              "|---|---|---|---|---|---|---|---|"]
    for label, e in runs.items():
        v = e["vs_baseline"]
        lines.append(f"| {label} | {e['method']} | {v['matched_prompts']} | {_f(v['improvement_score'])} | "
                     f"{v['improvement_score_prompts']} | {v['improvement_score_excluded_equal_rewards']} | "
                     f"{_f(v['relative_compute'])} | {_f(v['relative_compute_mean_of_ratios'])} |")
    lines += _correlation_section(runs)
    lines += ["", "## Plots", ""]
    for caption, name in plots.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{k}**: {v}." for k, v in report["definitions"].items()]
    lines.append("")
    return "\n".join(lines)


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


def draw_plots(runs: list[Run], report: dict) -> dict[str, tuple[str, bytes]]:
    """caption -> (file name, PNG bytes) for every plot the data allows."""
    entries = report["runs"]
    points = [{"label": e["label"], "method": e["method"],
               "usd_mean": e["usd_prompt_spread"]["mean"], "usd_std": e["usd_prompt_spread"]["std"],
               "reward_mean": e["best_reward"]["mean"], "reward_std": e["best_reward"]["std"]}
              for e in entries if e["best_reward"]["n"] and e["usd_prompt_spread"]["n"]]
    out = {}
    if points:
        out["Reward against compute"] = ("reward_vs_compute.png",
                                         report_plots.reward_vs_compute(points, report["baseline"]))
    series = [(f"{e['label']}\n({e['method']})",
               [r["best_reward"] for r in ok_rows(run).values() if r["best_reward"] is not None])
              for e, run in zip(entries, runs)]
    series = [s for s in series if s[1]]
    if series:
        out["Best reward per prompt, per run"] = ("best_reward_by_run.png",
                                                  report_plots.best_reward_distribution(series))
    for i, (e, run) in enumerate(zip(entries, runs)):
        pid = sample_prompt(run)
        if pid is None or not e["correlation"]["records"]:
            continue
        pts = correlation_points(ok_rows(run)[pid])
        out[f"Partial against final reward: {e['label']}, prompt {pid}"] = (
            f"partial_vs_final_{i}.png",
            report_plots.partial_vs_final(pts, f"{e['label']} ({e['method']}), prompt {pid}"))
        first = [r for r in e["correlation"]["records"] if r["decision"] == 0]
        if first:
            out[f"Correlation at the first decision over prompts: {e['label']}"] = (
                f"correlation_hist_{i}.png",
                report_plots.correlation_histograms(
                    [r["pearson"] for r in first], [r["kendall"] for r in first],
                    f"{e['label']}: partial (first decision) vs final reward, {len(first)} prompts"))
    return out


def write_report(runs: list[Run], base_index: int, out: str) -> dict:
    """Compute, draw and write report.json, report.md and the PNGs to `out` (through a temporary folder)."""
    report = build_report(runs, base_index)
    plots = draw_plots(runs, report)
    report["plots"] = {caption: name for caption, (name, _) in plots.items()}
    markdown = render_markdown(report, report["plots"])
    with staged_out(out) as (fs, tmp):
        for name, png in plots.values():
            write_bytes(fs, posixpath.join(tmp, name), png)
        write_bytes(fs, posixpath.join(tmp, "report.json"),
                    json.dumps(report, indent=2, allow_nan=False).encode("utf-8"))
        write_bytes(fs, posixpath.join(tmp, "report.md"), markdown.encode("utf-8"))
    return report
