"""What a plan cannot know, said in its plan.md, plan.json and summary, never left out: a sample that is the whole
set or too small for its intervals, prompts longer or shorter than any sampled one, the device the device time was
measured on, the warm-up taken out of it, Best-of-k estimated from a larger Best-of-N run, a sweep that cost more than
its share, errors on the sample, configs that cut nothing. Pure functions of the plan's records.
"""

from __future__ import annotations

from planning.sample import SMALL_SAMPLE
from reporting.tolerance import greater, less

DEVICE_KEYS = ("kind", "gpus_per_actor", "cpus_per_actor", "engine", "dtype", "accelerators")


def describe_device(d: dict) -> str:
    """One line: what the sweep's actors ran on."""
    if d.get("kind") == "gpu":
        what = f"{d['gpus_per_actor']:g} GPU(s) per actor" + (f" ({', '.join(d['accelerators'])})"
                                                                  if d.get("accelerators") else "")
    else:
        what = f"CPU, {d['cpus_per_actor']:g} core(s) per actor" + (f" ({d['cpu_model']})" if d.get("cpu_model")
                                                                      else "")
    return f"{what}, engine {d['engine']}, dtype {d['dtype']}"


def device_key(d: dict) -> tuple:
    return tuple(str(d.get(k)) for k in DEVICE_KEYS)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2g}%" if whole else "0%"


def length_caveats(chars: dict, prompts: int) -> list[str]:
    """Prompt lengths: the prompt set's mean outside the sample's interval, and prompts beyond the sampled range."""
    out = []
    d, s, iv = chars["dataset"], chars["sample"], chars["sample_mean_interval"]
    if iv is not None and (less(d["mean"], iv[0]) or greater(d["mean"], iv[1])):
        side = "longer" if greater(s["mean"], d["mean"]) else "shorter"
        out.append(f"the sampled prompts are {side} on average ({s['mean']:.1f} characters, 95% interval "
                   f"[{iv[0]:.1f}, {iv[1]:.1f}]) than the prompt set's ({d['mean']:.1f}): processed tokens, FLOPs "
                   "and device time grow with the prompt, so they may be projected "
                   + ("too high" if side == "longer" else "too low"))
    if chars["longer_than_sample"]:
        n = chars["longer_than_sample"]
        out.append(f"{n} of the {prompts} prompts ({_pct(n, prompts)}) are longer than the longest sampled one "
                   f"({s['max']} characters; the longest is {d['max']}): the sample measured nothing that long, so "
                   "their prefill and scoring cost, and whether they fit the target's context, are extrapolated")
    if chars["shorter_than_sample"]:
        n = chars["shorter_than_sample"]
        out.append(f"{n} of the {prompts} prompts ({_pct(n, prompts)}) are shorter than the shortest sampled one "
                   f"({s['min']} characters; the shortest is {d['min']})")
    return out


def sweep_caveats(plan: dict) -> list[str]:
    """The sweep's own: Best-of-k estimated from a larger run, the warm-up, a sweep over its share."""
    out = []
    derived = [c for c in plan["configs"] if c.get("best_of_k") is not None and c["label"] != c["measured_from"]]
    if derived:
        names = ", ".join(c["label"] for c in derived)
        model = plan["device_model"]
        how = ("a device model fitted to the sweep's runs and the probe (seconds per forward and per unit of work)" if
               model["a_seconds_per_forward"] > 0 else "their work alone (" + model["why"] + ")")
        out.append(f"{names}: estimated from the candidates of a larger Best-of-N run (every subset of its "
                   "candidates, not a run of their own): reward and tokens are unbiased, while their device time is "
                   f"scaled from the larger run's by {how}, which may lean either way")
    warm = plan["warmup"]
    if warm["seconds"] is None:
        out.append("the warm-up probe measured no warm-up (a call is missing or errored): each sweep run's first "
                   "calls carry their actors' warm-up, which a full run pays once per actor, so device-hours, USD and "
                   "wall-clock lean high")
    cost, cap = plan["sweep_cost"], plan["sweep"]["share"]
    job = cost.get("of_job")
    if job is not None and job["fraction_usd"] is not None and greater(job["fraction_usd"], cap):
        out.append(f"the sweep cost {100 * job['fraction_usd']:.3g}% of the job's projected USD ({job['label']}), "
                   f"more than its share of {100 * cap:g}%: it was sized by the candidates each config starts, "
                   "before anything ran; a smaller --sample or --sweep-share fits it")
    return out


def caveats(meta: dict, devices: list[dict], projected: list[dict], notes: list[str], no_cut: list[str],
            plan: dict | None = None) -> list[str]:
    """Every caveat of a plan, most important first: `meta` is the sample record (`planning.sample`), `devices` the
    devices the sweep's runs ran on, `projected` the projection (`planning.projection.project`), `notes` what the
    answer could not resolve, `no_cut` the Speculative Rejection runs that rejected nothing; `plan` (plan.json's
    content) adds the sweep's own (`sweep_caveats`)."""
    k, n = meta["sample"]["prompts"], meta["dataset"]["prompts"]
    out = list(notes)
    if k == n:
        out.append("the sample is the whole prompt set: the projection is the measurement, and its intervals are "
                   "the prompt-to-prompt spread of that measurement")
    elif k < SMALL_SAMPLE:
        out.append(f"the sample has {k} prompts, fewer than {SMALL_SAMPLE}: percentile bootstrap intervals from so "
                   f"few prompts cover less than 95%; use --sample {SMALL_SAMPLE} or more")
    out += length_caveats(meta["prompt_chars"], n)
    if devices:
        kinds = {device_key(d) for d in devices}
        if len(kinds) > 1:
            out.append("the sweep's runs ran on different devices (" + "; ".join(
                sorted({describe_device(d) for d in devices})) + "): their device-hours are not comparable")
        d = devices[-1]
        out.append(f"device-hours, USD and wall-clock hold only for the device the sample ran on ({describe_device(d)}"
                   "); on another device only tokens and FLOPs hold")
        load, cpus = d.get("load_average"), d.get("host_cpus")
        if load is not None and cpus and load > cpus:
            out.append(f"the machine was loaded while the sweep ran (load average {load:.1f} on {cpus} cores): "
                       "device-seconds measured under load vary between runs beyond their intervals, which cover "
                       "the prompt-to-prompt spread only")
    for p in projected:
        if p["sample_errors"]:
            out.append(f"{p['label']}: {p['sample_errors']} of the {k} sampled prompts errored; about "
                       f"{p['errors']:.0f} error rows are projected, costed as the sample's were")
    reward_prompts = projected[0]["reward_prompts"] if projected else k
    if reward_prompts < k:
        out.append(f"the mean best rewards are over the {reward_prompts} sampled prompts every config completed")
    errors = meta["dataset"]["input_errors"]
    if errors:
        out.append(f"{errors} of the prompt set's {meta['dataset']['rows']} rows cannot run (an empty prompt, a "
                   "duplicate id, ...): they are error rows that cost nothing, left out of every total")
    for label in no_cut:
        out.append(f"{label} rejected no candidate on the sample: it was Best-of-N at Speculative Rejection's price")
    if plan is not None:
        out += sweep_caveats(plan)
    return out
