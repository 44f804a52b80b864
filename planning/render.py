"""A plan as people read it: plan.md, the frontier plot (drawn as `winnow report` draws its frontier) and the
summary `winnow plan` prints."""

from __future__ import annotations

from reporting import plots as report_plots
from reporting.plancheck import NAMES, fmt


def _iv(name: str, f: dict | None) -> str:
    if f is None:
        return "n/a"
    return f"{fmt(name, f['value'])} [{fmt(name, f['interval'][0])}, {fmt(name, f['interval'][1])}]"


def _verdict(c: dict, plan: dict) -> str:
    v = c["frontier"]
    if v is None:
        return "not placed (no reward)"
    tags = []
    if c["label"] == plan["answer"]["label"]:
        tags.append("**picked**")
    if v["on_frontier"]:
        tags.append("frontier" + (", knee" if c["label"] == plan["frontier"]["knee"] else ""))
    else:
        tags.append("dominated by " + ", ".join(v["dominated_by"]))
    return "; ".join(tags)


def answer_line(plan: dict) -> str:
    """The answer in one sentence: the pick, its projected reward, cost, time and where its config is."""
    a = plan["answer"]
    c = next(c for c in plan["configs"] if c["label"] == a["label"])
    p = c["projection"]
    n = plan["dataset"]["prompts"]
    return (f"**{a['label']}** ({c['method']['name']}, " + ", ".join(f"{k} = {v}" for k, v in a["given"].items()
                                                                      if k != "name")
            + f"): {a['why']}. For the {n:,} prompts: mean best reward {_iv('mean_best_reward', p['mean_best_reward'])}"
            f", {_iv('usd', p['usd'])}, {_iv('device_hours', p['device_hours'])} device-hours, wall-clock "
            f"{_iv('wall_seconds', p['wall_seconds'])} on {plan['job']['workers']} worker(s). Config: "
            f"`{a['config_file']}`.")


def config_table(plan: dict) -> list[str]:
    head = ["config", "method"] + list(NAMES.values()) + ["frontier"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in plan["configs"]:
        cells = [c["label"], c["method"]["name"]] + [_iv(f, c["projection"][f]) for f in NAMES]
        lines.append("| " + " | ".join(cells + [_verdict(c, plan)]) + " |")
    return lines


def markdown(plan: dict) -> str:
    """plan.md: the answer, what the plan cannot know, every config's projection, the sample, the sweep's cost, the
    plot, how to run and check it, and the definitions."""
    d, s, level = plan["dataset"], plan["sample"], f"{100 * plan['level']:g}%"
    sweep = plan["sweep_cost"]
    lines = [f"# Winnow plan: {plan['job']['name']} on {d['prompts']:,} prompts", "",
             f"Question: {plan['question']['text']}.", "", "Answer: " + answer_line(plan), ""]
    if plan["caveats"]:
        lines += ["## What this plan cannot know", ""] + [f"- {c}." for c in plan["caveats"]] + [""]
    lines += ["## Projection for the whole prompt set", "",
              f"Every figure is for all {d['prompts']:,} prompts that can run, with its {level} interval over the "
              f"{s['prompts']} sampled prompts; device-hours, USD (${plan['job']['usd_per_device_hour']:g} per "
              f"device-hour) and wall-clock ({plan['job']['workers']} worker(s)) are for the device the sample ran "
              "on. Reward: " + plan["reward"]["definition"] + ".", ""]
    lines += config_table(plan)
    knee = plan["frontier"]["knee"]
    what = "compute (FLOPs)" if plan["frontier"]["basis"] == "compute" else "USD"
    lines += ["", f"The frontier ({what} against mean best reward; no config is cheaper and better): "
              f"{', '.join(plan['frontier']['order'])}; its knee: {knee}.", ""]
    if plan.get("plot"):
        lines += [f"![Mean best reward against {what} per prompt: the frontier of the swept configs]"
                  f"({plan['plot']})", ""]
    chars = s["prompt_chars"]
    lines += ["## The sample", "",
              f"{s['prompts']} of {d['prompts']:,} prompts ({100 * s['fraction']:.3g}%), drawn with seed {s['seed']} "
              f"from `{d['source']}`" + (f" (data.limit {d['limit']})" if d["limit"] else "")
              + f": `{s['file']}` (sha256 {s['sha256'][:16]}...). The prompt set has {d['rows']:,} rows, "
              f"{d['input_errors']} of which cannot run.", "",
              "| prompt length (characters) | mean | min | median | 95th percentile | max |",
              "|---|---|---|---|---|---|"]
    for who in ("dataset", "sample"):
        c = chars[who]
        lines.append(f"| {who} ({c['prompts']:,}) | {c['mean']:.1f} | {c['min']} | {c['median']:.0f} | "
                     f"{c['p95']:.0f} | {c['max']} |")
    lines += ["", "## What the sweep cost", "",
              f"{len(plan['configs'])} runs on the sample: {sweep['device_seconds']:.1f} device-seconds, "
              f"${sweep['usd']:.4g}, {sweep['processed_tokens']:,} processed tokens"
              + (f", {fmt('flops', sweep['flops'])}" if sweep["flops"] is not None else "") + "."]
    if sweep["fraction_of_full_run_usd"] is not None:
        lines[-1] += (f" That is {100 * sweep['fraction_of_full_run_usd']:.3g}% of the projected USD of the full run "
                      f"of {sweep['full_run']}"
                      + (f" ({100 * sweep['fraction_of_full_run_flops']:.3g}% of its FLOPs)"
                         if sweep["fraction_of_full_run_flops"] is not None else "") + ".")
    wall = plan["wall_model"]
    lines += ["", "## Run it, then check it", "", "```bash",
              f"winnow generate {plan['answer']['config_file']}",
              f"winnow report {plan['job']['output']} --plan {plan['folder']} --out REPORT_DIR", "```", "",
              "The check puts this projection beside what the run spent and earned, and says whether each figure "
              "fell inside its interval.", "", "## Definitions", "",
              f"- **projection**: a figure's total for the prompt set is its mean over the sampled prompts times "
              f"{d['prompts']:,}; its interval is that times the {level} percentile bootstrap interval of the mean "
              "(2,000 resamples of the sampled prompts, numpy default_rng(0), every config resampled with the same "
              "draws), which covers the prompt-to-prompt spread, not run-to-run noise in device time.",
              "- **mean best reward**: over the sampled prompts every config completed, as `winnow report`'s "
              "frontier has it.",
              "- **processed tokens**: target + draft + reward tokens, prefill and scoring included; **FLOPs**: "
              "2 x parameters x tokens processed, per model (`winnow report`'s compute).",
              f"- **wall-clock**: {wall['fixed_seconds']:.1f} s (what the sweep's runs took beyond their device time: "
              f"start-up, reading, writing; the median over its runs) + device-seconds / {wall['workers']} workers; "
              "it assumes the workers stay busy.",
              f"- **command**: `{plan['command']}`.", ""]
    return "\n".join(lines)


def plot(plan: dict) -> bytes | None:
    """The frontier of the swept configs, as `winnow report` draws it: compute or USD per prompt (the plan's basis;
    the projection's per-prompt mean) against mean best reward with its interval; None without a placed config."""
    basis = plan["frontier"]["basis"]
    pts = []
    for c in plan["configs"]:
        r, v = c["projection"]["mean_best_reward"], c["frontier"]
        if r is None or v is None:
            continue
        cost = c["projection"]["flops" if basis == "compute" else "usd"]["per_prompt"]
        pts.append({"label": c["label"], "method": c["method"]["name"], "cost": cost,
                    "reward": r["value"], "low": r["interval"][0], "high": r["interval"][1],
                    "on_frontier": v["on_frontier"], "is_baseline": False, "below_baseline": False})
    if not pts:
        return None
    prompts = plan["configs"][0]["reward_prompts"]
    return report_plots.reward_vs_cost(pts, plan["frontier"]["order"], None, None,
                                       plan["job"]["usd_per_device_hour"], prompts, basis=basis,
                                       reward_units=plan["reward"]["units"])


def summary(plan: dict) -> str:
    """What `winnow plan` prints at the end: the answer, the configs, what it cannot know, the files."""
    lines = ["Answer: " + answer_line(plan), ""]
    lines += config_table(plan)
    if plan["caveats"]:
        lines += ["", "What this plan cannot know:"] + [f"- {c}." for c in plan["caveats"]]
    sweep = plan["sweep_cost"]
    if sweep["fraction_of_full_run_usd"] is not None:
        lines += ["", f"The sweep cost ${sweep['usd']:.4g}, {100 * sweep['fraction_of_full_run_usd']:.3g}% of the "
                  f"projected full run of {sweep['full_run']}."]
    lines += ["", f"wrote {plan['folder']}/plan.md, plan.json" + (f", {plan['plot']}" if plan.get("plot") else "")
              + f" and {plan['answer']['config_file']}"]
    return "\n".join(lines).replace("**", "")
