"""`winnow report RUN... --plan PLAN_DIR`: a plan's projection (`winnow plan`, docs/planning.md) beside what the full
runs spent and earned, and whether each figure fell inside its 95% interval.

A run is matched with the plan's swept config of the same method (``config.method`` as the run's manifest records
it). Its figures: mean best reward (over its prompts without an error), generated tokens (every candidate's),
processed tokens (target + draft + reward), FLOPs (`reporting.cost`), device-hours, USD (at the run's own price) and
wall-clock (the manifest's start to end of the run's latest start, only for a run that succeeded). A figure is
**inside** when its interval's ends hold it (within the report's tolerance). Not every figure is checked:

- a run whose config differs from the plan's job in what it reads or runs (data, models, generation, seed) is not
  the planned job: its figures are shown, none is checked. Settings its method does not use are not compared:
  `models.draft` and `generation.gamma` where neither config's method nor sampler uses a draft, and
  `generation.sampler` where the method samples with the target whatever it says (`unused_keys`);
- device-hours, USD and wall-clock hold only for the device the plan's sample ran on: a run with other per-actor
  resources (`gpus_per_actor`, `cpus_per_actor`, `prompts_per_call`, `feed_calls`) or another engine or dtype has
  them shown, not checked. The accelerator's model is not in a run's manifest, so on GPUs the same resources are
  taken for the same device, and the report says so;
- wall-clock is projected for the run's own `resources.actors` from the plan's model (the sweep's fixed seconds plus
  device-seconds / actors);
- a plan of a job with a verifier also checks the verified rate and the USD per verified prompt (the run's USD of
  the prompts that ran over its verified prompts, `stats.best_verified`).

Each run gets one line on the terminal, with the reason when a figure or the whole run was not checked.
"""

from __future__ import annotations

import datetime as dt
import json
import posixpath

from reporting.frontier import fmt_flops
from reporting.tolerance import at_most
from runfolder.folder import changed_keys, store
from runfolder.runs import Run
from schemas.base import ConfigError, InputError
from schemas.compat import current_plan
from schemas.config import validate_config

PLAN_FORMAT = "winnow-plan/1"
PLAN_FILE = "plan.json"
NAMES = {"mean_best_reward": "mean best reward", "generated_tokens": "generated tokens",
         "processed_tokens": "processed tokens", "flops": "FLOPs", "device_hours": "device-hours", "usd": "USD",
         "wall_seconds": "wall-clock"}
VERIFIED_NAMES = {"verified_rate": "verified rate", "usd_per_verified": "USD per verified prompt"}
ALL_NAMES = {**NAMES, **VERIFIED_NAMES}
DEVICE_FIGURES = ("device_hours", "usd", "wall_seconds", "usd_per_verified")
DEVICE_KEYS = ("resources.gpus_per_actor", "resources.cpus_per_actor", "resources.prompts_per_call",
               "resources.feed_calls", "models.engine", "models.dtype")
FREE_KEYS = ("name", "output.", "method.", "resources.actors", "resources.max_retries",
             "resources.wait_for_nodes_s", "cost.")


def read_plan(uri: str) -> dict:
    """The plan of a plan folder (its plan.json); InputError naming the path when it is not one."""
    uri = uri.rstrip("/") or uri
    fs, path = store(uri, f"--plan {uri}")
    where = posixpath.join(path, PLAN_FILE)
    try:
        plan = json.loads(fs.cat_file(where).decode("utf-8")) if fs.isfile(where) else None
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(f"--plan {uri}/{PLAN_FILE}: not valid JSON: {err}") from None
    if plan is None:
        raise InputError(f"--plan {uri}: no {PLAN_FILE}; give the --out folder of a finished `winnow plan`")
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT or not isinstance(plan.get("configs"), list):
        raise InputError(f"--plan {uri}/{PLAN_FILE}: not a plan ({PLAN_FORMAT})")
    plan = current_plan(plan)
    plan["path"] = uri
    return plan


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    parse = (lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00")))
    return (parse(end) - parse(start)).total_seconds()


def actuals(run: Run, entry: dict) -> dict:
    """What the run spent and earned, from its report entry (`reporting.stats.run_summary`) and its manifest."""
    ok = entry["prompts"] - entry["errors"]

    def total(per_prompt):
        return None if per_prompt is None else per_prompt * ok

    processed = [entry[f"{r}_tokens_per_prompt"] for r in ("target", "draft", "reward")]
    m = run.manifest
    return {
        "mean_best_reward": entry["mean_best_reward"],
        "generated_tokens": total(entry["generated_tokens_per_prompt"]),
        "processed_tokens": None if None in processed else total(sum(processed)),
        "flops": total(entry["flops_per_prompt"]),
        "device_hours": entry["device_seconds_total"] / 3600.0,
        "usd": entry["usd_total"],
        "wall_seconds": _seconds(m.started_at, m.finished_at) if run.status == "succeeded" else None,
        **verified_actuals(run),
    }


def verified_actuals(run: Run) -> dict:
    """The run's verified rate and USD per verified prompt (module docstring); None where it has no verified
    prompt."""
    ran = [r for r in run.rows if r["error"] is None]
    passes = sum((r.get("stats") or {}).get("best_verified") is True for r in ran)
    usd = sum(r["cost"]["device_seconds"] for r in ran) / 3600.0 * run.usd_per_device_hour
    return {"verified_rate": passes / len(ran) if ran else None, "usd_per_verified": usd / passes if passes else None}


def _free(key: str, free: tuple[str, ...]) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in free)


def _get(config: dict, key: str):
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set(config: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def unused_keys(config) -> list[str]:
    """The settings a validated job config holds that its method does not use: `models.draft` and
    `generation.gamma` when neither the method nor its sampler needs a draft, `generation.sampler` when the method
    samples with the target whatever it says."""
    from schemas.methods import Sampling

    out = []
    if config.draft_needed_by is None:
        out += ["models.draft", "generation.gamma"]
        if config.method.sampling(Sampling.of(config.generation)).sampler != config.generation.sampler:
            out.append("generation.sampler")
    return out


def differences(planned: dict, config: dict) -> tuple[list[str], list[str]]:
    """(the keys a run's config differs in from the planned job's beyond the free ones: not the planned job; the
    device keys it differs in). Configs are compared as runs are matched, by `JobConfig.hash` with the free and device
    keys taken from the run (so a default changed since, or a field added with its default, is no difference), and
    by their dumps where a config no longer validates. A key that neither config's method uses (`unused_keys`) is
    no difference."""
    try:
        run_config, planned_config = validate_config(config), validate_config(planned)
        unused = set(unused_keys(run_config)) & set(unused_keys(planned_config))
        run = run_config.model_dump(mode="json")
        aligned = json.loads(json.dumps(planned))
        for key in changed_keys(planned, run):
            if _free(key, FREE_KEYS + DEVICE_KEYS) or key in unused:
                _set(aligned, key, _get(run, key))
        same = validate_config(aligned).hash() == validate_config(run).hash()
        planned = validate_config(planned).model_dump(mode="json")
    except ConfigError:
        run, same, unused = config, None, set()
    beyond = [k for k in changed_keys(planned, run) if not _free(k, FREE_KEYS + DEVICE_KEYS) and k not in unused]
    other = beyond if same is None else ([] if same else beyond or ["(config)"])
    return other, [k for k in DEVICE_KEYS if _get(planned, k) != _get(run, k)]


def _resolved(job: dict, method) -> object:
    """A method as the job config resolves it (its defaults filled in, so a run written before a method field existed
    still matches); the method as it is where it does not validate."""
    try:
        return validate_config({**job, "method": method}).method.model_dump(mode="json")
    except (ConfigError, TypeError):
        return method


def check_run(plan: dict, run: Run, entry: dict) -> dict:
    """One run against the plan: the matched config, what differs, and each figure's projection, interval, actual
    value and verdict (module docstring)."""
    config = run.manifest.config
    method = _resolved(plan["job"]["config"], config.get("method"))
    match = next((c for c in plan["configs"] if _resolved(plan["job"]["config"], c["method"]) == method), None)
    out = {"run": entry["label"], "path": run.uri, "plan_config": None, "figures": [], "notes": []}
    if match is None:
        out["notes"].append("no swept config of the plan has this run's method ("
                            + json.dumps(config.get("method"), sort_keys=True) + "): not checked")
        return out
    out["plan_config"] = match["label"]
    other, device = differences({**plan["job"]["config"], "method": match["method"]}, config)
    if other:
        out["notes"].append("the run is not the planned job (it differs in " + ", ".join(other)
                            + "): its figures are shown, none is checked")
    if device:
        out["notes"].append("the run ran on another device than the plan's sample (" + ", ".join(device)
                            + "): device-hours, USD and wall-clock are not checked")
    elif (plan.get("device") or {}).get("kind") == "gpu":
        out["notes"].append("a run's manifest does not name its GPU model: the same per-actor resources are taken "
                            "for the same device as the plan's sample (" + ", ".join(plan["device"]["accelerators"]
                                                                                    or ["model unknown"]) + ")")
    actors = (config.get("resources") or {}).get("actors", 1)
    actors = actors["max"] if isinstance(actors, dict) else actors  # an elastic pool: at its most
    price = float(config["cost"]["usd_per_device_hour"])
    got = actuals(run, entry)
    wall = plan["wall_model"]
    figures = {**NAMES, **VERIFIED_NAMES} if plan.get("verifier") else NAMES
    for name in figures:
        proj = match["projection"].get(name)
        if proj is not None and name == "usd":  # at the run's own price
            hours = match["projection"]["device_hours"]
            proj = {"value": hours["value"] * price, "interval": [v * price for v in hours["interval"]]}
        if proj is not None and name == "usd_per_verified":  # at the run's own price
            ratio = price / plan["job"]["usd_per_device_hour"] if plan["job"].get("usd_per_device_hour") else 1.0
            proj = {"value": proj["value"] * ratio,
                    "interval": [None if v is None else v * ratio for v in proj["interval"]]}
        if proj is not None and name == "wall_seconds":  # for the run's own actors
            seconds = [v * 3600 for v in (match["projection"]["device_hours"]["value"],
                                          *match["projection"]["device_hours"]["interval"])]
            proj = {"value": wall["fixed_seconds"] + seconds[0] / actors,
                    "interval": [wall["fixed_seconds"] + s / actors for s in seconds[1:]]}
        actual = got[name]
        why = None
        if other:
            why = "not the planned job"
        elif name in DEVICE_FIGURES and device:
            why = "another device"
        elif proj is None:
            why = "not projected"
        elif actual is None:
            why = "the run has no such figure" + (" (it did not succeed)" if name == "wall_seconds" else "")
        inside = None if why else (at_most(proj["interval"][0], actual)
                                   and (proj["interval"][1] is None or at_most(actual, proj["interval"][1])))
        out["figures"].append({"figure": name, "projected": None if proj is None else proj["value"],
                               "interval": None if proj is None else proj["interval"], "actual": actual,
                               "inside": inside, "not_checked": why})
    checked = [f for f in out["figures"] if f["inside"] is not None]
    out["inside"] = sum(1 for f in checked if f["inside"])
    out["checked"] = len(checked)
    out["outside"] = [ALL_NAMES[f["figure"]] for f in checked if not f["inside"]]
    return out


def check(plan: dict, runs: list[Run], entries: list[dict]) -> dict:
    """The report's ``plan`` block: the plan's identity and one check per run (`check_run`)."""
    return {
        "path": plan["path"], "job": plan["job"]["name"], "command": plan.get("command"),
        "prompts": plan["dataset"]["prompts"], "sample": plan["sample"]["prompts"],
        "answer": plan["answer"]["label"], "level": plan.get("level", 0.95),
        "device": plan.get("device_line"), "actors": plan["job"]["actors"],
        "runs": [check_run(plan, run, entry) for run, entry in zip(runs, entries)],
    }


def fmt(name: str, x: float | None) -> str:
    """A figure as the check's table shows it."""
    if x is None:
        return "n/a"
    if name in ("mean_best_reward", "verified_rate"):
        return f"{x:.4f}"
    if name == "usd_per_verified":
        return f"${x:.4g}"
    if name == "flops":
        return fmt_flops(x)
    if name == "usd":
        return f"${x:.4g}"
    if name == "device_hours":
        return f"{x:.4g}"
    if name == "wall_seconds":
        return f"{x:,.0f} s"
    return f"{x:,.0f}"


def markdown_section(block: dict) -> list[str]:
    """report.md's section: one table per run."""
    level = f"{100 * block['level']:g}%"
    lines = ["## The plan checked against the runs", "",
             f"Plan `{block['path']}` of job {block['job']}: {block['prompts']} prompts projected from a sample of "
             f"{block['sample']}, picking **{block['answer']}**"
             + (f"; device time measured on {block['device']}" if block.get("device") else "") + ". Each figure: the "
             f"plan's projection for the whole prompt set with its {level} interval, what the run spent or earned, "
             "and whether it fell inside.", ""]
    for r in block["runs"]:
        what = f"plan config {r['plan_config']}" if r["plan_config"] else "no plan config"
        lines += [f"### {r['run']} ({what})", ""]
        for note in r["notes"]:
            lines += [f"**Note:** {note}.", ""]
        if not r["figures"]:
            continue
        lines += ["| figure | projected | " + level + " interval | run | inside |", "|---|---|---|---|---|"]
        for f in r["figures"]:
            high = None if f["interval"] is None else f["interval"][1]
            iv = "n/a" if f["interval"] is None else f"[{fmt(f['figure'], f['interval'][0])}, " \
                                                      f"{'unbounded' if high is None else fmt(f['figure'], high)}]"
            verdict = f"not checked ({f['not_checked']})" if f["not_checked"] else ("yes" if f["inside"] else "**no**")
            lines.append(f"| {ALL_NAMES[f['figure']]} | {fmt(f['figure'], f['projected'])} | {iv} | "
                         f"{fmt(f['figure'], f['actual'])} | {verdict} |")
        lines += ["", f"{r['inside']} of {r['checked']} checked figures inside their intervals"
                  + (f"; outside: {', '.join(r['outside'])}" if r["outside"] else "") + ".", ""]
    return lines


def terminal_lines(block: dict) -> list[str]:
    """One line per run for the terminal, with why a figure, or the whole run, was not checked."""
    out = []
    for r in block["runs"]:
        if r["plan_config"] is None:
            out.append(f"Plan check: {r['run']}: " + "; ".join(r["notes"]) + ".")
            continue
        if not r["checked"]:
            out.append(f"Plan check: {r['run']} as {r['plan_config']}: not checked: " + "; ".join(r["notes"]) + ".")
            continue
        text = (f"Plan check: {r['run']} as {r['plan_config']}: {r['inside']} of {r['checked']} checked figures "
                f"inside their {100 * block['level']:g}% intervals")
        if r["outside"]:
            text += f" (outside: {', '.join(r['outside'])})"
        skipped: dict[str, list[str]] = {}
        for f in r["figures"]:
            if f["not_checked"]:
                skipped.setdefault(f["not_checked"], []).append(ALL_NAMES[f["figure"]])
        if skipped:
            text += "; not checked: " + "; ".join(f"{', '.join(v)} ({why})" for why, v in skipped.items())
        out.append(text + ".")
    return out
