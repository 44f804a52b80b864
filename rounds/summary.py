"""The recipe's summary: ``OUT/summary.md``, ``OUT/summary.json`` and ``OUT/rounds.png``, written at its end.

The numbers are `reporting.rounds`' (what `winnow report` shows for the same evaluation runs): per data source and
evaluation, the held-out reward of each round with its bootstrap interval, the gain over round 0, the costs of the
data and the training, and the gain per USD; then the data sources compared by held-out reward gained per dollar
of data, which answers the recipe's question: which generation method buys more.
"""

from __future__ import annotations

import json
import os
import shlex

from reporting import plots
from reporting.rounds import build_series, comparison_lines, describe_source, plot_series, series_table
from reporting.stats import finite
from runfolder.runs import load_runs, unique_labels


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def answer(block: dict) -> list[str]:
    """The recipe's question answered in words, from the comparisons of the last round each pair reached under a
    one-sample evaluation (greedy where there is none): per USD of data, and per TFLOP of data."""
    comps = block["comparisons"]
    if not comps:
        return ["One data source only (or no round finished): nothing to compare."]
    sample = [c for c in comps if c["evaluation"].startswith("one sample")] or comps
    last = max(c["round"] for c in sample)
    out = []
    for c in (c for c in sample if c["round"] == last):
        if c["usd"] is None:
            out.append(f"Round {last}, {c['a']} against {c['b']} ({c['evaluation']}): {c['verdict']}.")
            continue
        u = c["usd"]
        line = (f"Round {last}, {c['evaluation']}, {c['prompts']} held-out prompts: {c['a']} gained "
                f"{u['a']:.4g} held-out reward per USD of data (${c['a_data']['usd']:.3g} of data), {c['b']} "
                f"{u['b']:.4g} (${c['b_data']['usd']:.3g}); difference {u['difference']:.4g} "
                f"[{u['interval'][0]:.4g}, {u['interval'][1]:.4g}]: **{u['verdict']}**.")
        if c["compute"] is not None:
            f = c["compute"]
            line += (f" On compute, which does not move with the machine's load: {c['a']} {f['a']:.4g} and "
                     f"{c['b']} {f['b']:.4g} per TFLOP of data, difference {f['difference']:.4g} "
                     f"[{f['interval'][0]:.4g}, {f['interval'][1]:.4g}]: **{f['verdict']}**.")
        out.append(line)
    return out


def render(recipe, ledger, block: dict, runs: list[str]) -> str:
    c = recipe.config
    p = c.prompts
    prompts = (f"{p.train} training and {p.heldout} held-out `{p.vocabulary}` concept-set prompts (seed {p.seed}, "
               "disjoint in concept sets)" if p.vocabulary else
               f"training prompts `{p.train_source}`, held-out prompts `{p.heldout_source}`")
    train = c.train
    how = ("a full fine-tune" if train.lora is None else f"LoRA r={train.lora.r}, alpha={train.lora.alpha}")
    lines = [f"# Expert Iteration: {c.name}", "",
             f"Round 0's model `{c.model}`; reward {c.reward.kind}; {prompts}. Each round generates on the training "
             "prompts with the previous round's model, keeps the best candidate per prompt "
             f"(`--select {c.sft.select}`), trains {how} ({train.epochs:g} epoch(s), learning rate "
             f"{train.learning_rate:g}) with TRL's SFTTrainer and evaluates the new model on the held-out prompts.",
             "", "Data sources: " + "; ".join(f"**{name}** = {describe_source(m.model_dump(mode='json'))}"
                                               for name, m in c.sources.items()) + ".", ""]
    lines += ["## Which data source buys more held-out reward per dollar of data?", ""]
    lines += answer(block) + [""]
    lines += comparison_lines(block["comparisons"]) + ([""] if block["comparisons"] else [])
    lines += ["## Held-out reward by round", ""]
    for s in block["series"]:
        lines += series_table(s) + [""]
    for note in block["notes"]:
        lines += [f"**Note:** {note}.", ""]
    if block["series"]:
        lines += ["![Held-out reward and cumulative cost by round](rounds.png)", ""]
    lines += ["## Steps", "", "| step | seconds (wall) | what it made |", "|---|---|---|"]
    for step in recipe.steps:
        record = ledger.done(step.id)
        if record is None:
            continue
        o = record["outputs"]
        what = (o.get("command") or (f"{o['lineage']['training']['method']}, {o['lineage']['examples']} examples -> "
                                     f"`{o['model']}`" if "lineage" in o else "prompt files"))
        lines.append(f"| {step.id} | {record['seconds']:.1f} | {what} |")
    lines += ["", "## Reproduce", "", "```bash", ledger.data.get("command") or "winnow rounds RECIPE.yaml",
              shlex.join(["winnow", "report", *runs, "--out", recipe.at("report")]), "```", "",
              "Definitions: `winnow report`'s (reporting/rounds.py, docs/expert-iteration.md). Costs are measured "
              "device-seconds on the machine that ran the recipe, priced at the runs' cost.usd_per_device_hour.", ""]
    return "\n".join(lines)


def write_summary(recipe, ledger) -> dict:
    """Write the summary files from the recipe's finished evaluation runs; returns the rounds block."""
    paths = [s.path for s in recipe.steps if s.kind == "generate" and s.id.rsplit("/", 1)[-1].startswith("eval-")
             and ledger.done(s.id)]
    runs = load_runs(paths)
    block = finite(build_series(runs, unique_labels(runs)))
    series = plot_series(block)
    if series:
        _write(recipe.at("rounds.png"), plots.rounds(series))
    _write(recipe.at("summary.json"), json.dumps(block, indent=2, allow_nan=False).encode("utf-8"))
    text = render(recipe, ledger, block, paths)
    _write(recipe.at("summary.md"), text.encode("utf-8"))
    recipe.log(f"wrote {recipe.at('summary.md')}, summary.json" + (" and rounds.png" if series else ""))
    return {"block": block, "markdown": text}
