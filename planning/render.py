"""A plan as people read it: plan.md, the frontier plot (drawn as `winnow report` draws its frontier) and the
summary `winnow plan` prints."""

from __future__ import annotations

import shlex

from reporting import plots as report_plots
from reporting.plancheck import NAMES, VERIFIED_NAMES, fmt


def _iv(name: str, f: dict | None) -> str:
    if f is None:
        return "n/a"
    high = "unbounded" if f["interval"][1] is None else fmt(name, f["interval"][1])
    return f"{fmt(name, f['value'])} [{fmt(name, f['interval'][0])}, {high}]"


def names(plan: dict) -> dict:
    """The figures a plan shows: the verified ones too when the job has a verifier."""
    return {**NAMES, **VERIFIED_NAMES} if plan.get("verifier") else NAMES


def quoted(*words: str) -> str:
    """A command as a shell reads it back: every word quoted where it needs to be."""
    return " ".join(shlex.quote(str(w)) for w in words)


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
            f"{_iv('wall_seconds', p['wall_seconds'])} on {plan['job']['actors']} actor(s)"
            + (f"; verified rate {_iv('verified_rate', p.get('verified_rate'))}, "
               + (f"{_iv('usd_per_verified', p['usd_per_verified'])} per verified prompt"
                  if p.get("usd_per_verified") else "no verified prompt on the sample (no cost of a pass)")
               if plan.get("verifier") else "")
            + f". Config: `{a['config_file']}`.")


def _measured_by(c: dict) -> str:
    if c.get("best_of_k") is None or c["label"] == c.get("measured_from", c["label"]):
        return c["method"]["name"]
    return f"{c['method']['name']} (from {c['measured_from']})"


def config_table(plan: dict) -> list[str]:
    shown = names(plan)
    head = ["config", "method"] + list(shown.values()) + ["frontier"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in plan["configs"]:
        cells = [c["label"], _measured_by(c)] + [_iv(f, c["projection"].get(f)) for f in shown]
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
              f"device-hour) and wall-clock ({plan['job']['actors']} actor(s)) are for the device the sample ran "
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
    lines += ["", "## The sweep", ""] + sweep_lines(plan)
    lines += ["", "## What the sweep cost", "",
              f"{len(plan['sweep']['runs'])} run(s) and the warm-up probe on the sample: "
              f"{sweep['device_seconds']:.1f} device-seconds, ${sweep['usd']:.4g}, {sweep['processed_tokens']:,} "
              "processed tokens" + (f", {fmt('flops', sweep['flops'])}" if sweep["flops"] is not None else "") + "."]
    for who, share in (("the picked config", _pick_share(sweep)), ("the job's own method", sweep.get("of_job"))):
        if share is not None and share["fraction_usd"] is not None:
            lines[-1] += (f" That is {100 * share['fraction_usd']:.3g}% of the projected USD of the full run of "
                          f"{who}, {share['label']}"
                          + (f" ({100 * share['fraction_flops']:.3g}% of its FLOPs)"
                             if share["fraction_flops"] is not None else "") + ".")
    lines[-1] += f" Its share: at most {100 * plan['sweep']['share']:g}% of the job (--sweep-share)."
    wall = plan["wall_model"]
    lines += ["", "## Run it, then check it", "", "```bash",
              quoted("winnow", "generate", plan["answer"]["config_file"]),
              quoted("winnow", "report", plan["job"]["output"], "--plan", plan["folder"], "--out") + " REPORT_DIR",
              "```", "",
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
              f"start-up, reading, writing; the median over its runs) + device-seconds / {wall['actors']} actors; "
              "it assumes the actors stay busy.",
              "- **Best-of-k from Best-of-n**: the expected best reward of a uniformly drawn k of the n candidates "
              "(sum_i r_(i) C(i-1, k-1) / C(n, k) over the sorted rewards), k/n of their tokens, the prompt's own "
              "tokens once.",
              f"- **command**: `{plan['command']}`.", ""]
    return "\n".join(lines)


def _pick_share(sweep: dict) -> dict | None:
    if sweep["fraction_of_full_run_usd"] is None:
        return None
    return {"label": sweep["full_run"], "fraction_usd": sweep["fraction_of_full_run_usd"],
            "fraction_flops": sweep["fraction_of_full_run_flops"]}


def sweep_lines(plan: dict) -> list[str]:
    """plan.md's section on the sweep: its runs, what each config is measured from, what the share cut, the
    warm-up measured and taken out."""
    s, d = plan["sweep"], plan["dataset"]
    out = [f"Runs on {plan['sample']['prompts']} sampled prompts: {', '.join(s['runs'])}. Best-of-N configs that "
           "differ only in n are estimated from the largest one's candidates (the expected best of every subset of "
           "k), so they need no run of their own."]
    cuts = []
    if s["sample"] < s["asked"]:
        cuts.append(f"the sample, from {s['asked']} prompts to {s['sample']}")
    if s["cut"]:
        cuts.append("the configs " + ", ".join(s["cut"]))
    budget = (f"The share, {100 * s['share']:g}% of the job, allows {s['allowed_candidates']:,.0f} candidates "
              f"({d['prompts']:,} prompts x {s['job_candidates_per_prompt']} x {s['share']:g}). The sweep counts "
              f"{s['planned_candidates']:,.0f}, the probe included: each run at least the job's "
              f"{s['job_candidates_per_prompt']} per prompt, since a decoding step costs about the same at any width "
              "where the device is not full.")
    out += ["", budget + (" To fit, it cut " + " and ".join(cuts) + "." if cuts else " Nothing was cut.")]
    w = plan["warmup"]
    probe = s["probe"]
    if w["seconds"] is not None:
        calls = ", ".join(f"{c['device_seconds']:.3f} s for {c['processed_tokens']:,.0f} tokens" for c in w["calls"])
        out += ["", f"The warm-up: {w['seconds']:.3f} device-seconds per actor, measured by the probe "
                f"({probe['method']['name']}, {probe['prompts']} prompts in each of {probe['calls']} calls on one "
                f"actor: {calls}). It is taken out of each sweep run's device time "
                f"({', '.join(f'{x:.3f} s' for x in w['removed_seconds'])}) and added once per actor of the full run "
                f"({w['full_run_seconds']:.3f} s)."]
    else:
        out += ["", "The warm-up probe measured no warm-up: nothing was taken out of the device time."]
    return out


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
        job = sweep.get("of_job")
        lines += ["", f"The sweep cost ${sweep['usd']:.4g}, {100 * sweep['fraction_of_full_run_usd']:.3g}% of the "
                  f"projected full run of {sweep['full_run']}"
                  + (f" and {100 * job['fraction_usd']:.3g}% of the job's own ({job['label']})"
                     if job is not None and job["fraction_usd"] is not None and job["label"] != sweep["full_run"]
                     else "") + "."]
    lines += ["", f"wrote {plan['folder']}/plan.md, plan.json" + (f", {plan['plot']}" if plan.get("plot") else "")
              + f" and {plan['answer']['config_file']}"]
    return "\n".join(lines).replace("**", "")
