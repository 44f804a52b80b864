"""Draft/target methods on the bundled trio and demo prompts: `python -m bench.draft_target`.

Prints four comparisons (Markdown tables; `--json PATH` also writes every figure):
1. speculative decoding vs the target's own greedy decoding (temperature 0): wall-clock, target calls per token;
2. MJSD vs speculative decoding (temperature 0): tokens per target call, perplexity under the target, wall-clock;
3. CDSL, CDLH, CDLH-appx and greedy with the lexical reward (concept coverage): speedup over CDLH in paper 000's
   P units, P = c x draft calls per token + target calls per token, with c = the draft/target cost ratio measured
   with greedy decoding (target tokens/s over draft tokens/s, section 4.3); wall-clock; hard and soft constraint
   satisfaction;
4. Speculative Rejection with the speculative sampler vs the target sampler (reward: the tiny reward model).

Calls are counted per sequence (a forward over k candidate sequences of one prompt counts k calls), which is how the
papers count them; the batched forwards a run hands back, charged to a Meter, are shown beside them ("fwd/token").
Wall-clock is the best of `--repeats` runs, on `--threads` CPU threads (tiny models run fastest on one).
Prompts: the demo prompts `--first` to `--first + --prompts`; CDSL's thresholds were tuned on demo prompts 0-15
(see docs/draft-target.md), so the default reports on prompts 16-31. Papers 000 (CDSL) and 002 (MJSD) are listed
in docs/references.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace

import torch

from assets import demo_prompts
from bench.common import table
from pipeline.preflight import resolved
from schemas.config import validate_config
from workers.accounting.cost import Meter
from workers.methods import run_method
from workers.methods.measures import add_measures
from workers.actor.runner import Runner

BASE = {
    "name": "bench",
    "seed": 0,
    "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
    "models": {"target": "builtin:tiny-target", "draft": "builtin:tiny-draft", "reward": {"kind": "lexical"}},
    "method": {"name": "speculative_decoding"},  # a draft method, so that the runner loads the draft
    "generation": {"max_new_tokens": 48, "temperature": 0.0},
    "output": {"path": "runs/bench"},
}


class Bench:
    def __init__(self, items: list[dict], max_new_tokens: int, repeats: int):
        base = dict(BASE, generation={"max_new_tokens": max_new_tokens, "temperature": 0.0})
        self.lexical = Runner(resolved(validate_config(base)))
        model_reward = dict(base, models=dict(base["models"], reward={"kind": "model", "path": "builtin:tiny-reward"}))
        self.scorer = Runner(resolved(validate_config(model_reward))).reward
        self.prompts = [p for _, p in self.lexical.prepare(items)[0]]
        self.base, self.repeats = base, repeats

    def run(self, method: dict, generation: dict | None = None, reward: str = "lexical", target=None) -> dict:
        """Run a method `repeats` times on the prompts; its results (last run), cost, and best wall-clock."""
        gen = dict(self.base["generation"], **(generation or {}))
        cfg = validate_config(dict(self.base, method=method, generation=gen))
        r = Runner(resolved(cfg), share=self.lexical)  # the method's own sampling, on the loaded trio
        best = math.inf
        for _ in range(self.repeats):
            meter = Meter(len(self.prompts))
            ctx = replace(r.context_for(), reward=r.reward if reward == "lexical" else self.scorer)
            if target is not None:
                ctx = replace(ctx, target=target)
            start = time.perf_counter()
            with torch.inference_mode():  # the method alone: its quality measures are added after the timing
                results, work = run_method(ctx, cfg.method, self.prompts)
            best = min(best, time.perf_counter() - start)
            meter.charge(work)
        add_measures(ctx, self.prompts, results)
        return {"results": results, "meter": meter, "wall": best}


def summary(out: dict, c: float | None = None) -> dict:
    """Figures over all prompts: sums of tokens and calls, means of the quality measures."""
    results, meter = out["results"], out["meter"]
    tokens = sum(r.stats["generated_tokens"] for r in results)
    best = [r.candidates[r.best_index] for r in results]

    def calls(key: str) -> float | None:
        per = [r.stats.get(key) for r in results]
        if any(v is None for v in per):
            return None
        return sum(v * r.stats["generated_tokens"] for v, r in zip(per, results)) / tokens

    def mean(key: str) -> float | None:
        vals = [r.stats.get(key) for r in results if r.stats.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    target_fwd = float(meter.forwards["target"].sum()) / tokens
    draft_fwd = float(meter.forwards["draft"].sum()) / tokens
    s = {
        "tokens": tokens,
        "wall_s": out["wall"],
        "tokens_per_s": tokens / out["wall"],
        # methods without a tally decode token by token with the target alone: one call per sequence and token
        "target_calls_per_token": calls("target_calls_per_token") or 1.0,
        "draft_calls_per_token": calls("draft_calls_per_token") or 0.0,
        "target_fwd_per_token": target_fwd,
        "draft_fwd_per_token": draft_fwd,
        "acceptance_rate": mean("acceptance_rate"),
        "tokens_per_target_call": mean("mean_accepted_tokens"),
        "perplexity": mean("perplexity"),
        "hard_constraint": mean("hard_constraint"),
        "soft_constraint": mean("soft_constraint"),
        "best_reward": statistics.fmean([b.reward for b in best if b.reward is not None] or [math.nan]),
    }
    if c is not None:
        s["P"] = c * s["draft_calls_per_token"] + s["target_calls_per_token"]
        s["P_fwd"] = c * draft_fwd + target_fwd
    states = [r.stats.get("state_counts") for r in results if r.stats.get("state_counts")]
    if states:
        s["state_counts"] = [sum(col) for col in zip(*states)]
    return s


def tune_cdsl(bench: Bench, c: float, d: int = 3, k: int = 3) -> dict:
    """Paper 000, Appendix C: every (a_t, r_t, b) of its CommonGen search space at d = 3, k = 3 (the paper's); the 10
    fastest in P units, then the most satisfying (soft, then hard) among them."""
    cdlh = summary(bench.run({"name": "cdlh", "lookahead": d, "top_k": k}), c)
    grid = []
    for a_t in (0.3, 0.6, 0.9):
        for r_t in (0.3, 0.5, 0.6, 0.9):
            for b in (0, 1, 2):
                s = summary(bench.run({"name": "cdsl", "lookahead": d, "top_k": k, "accept_threshold": a_t,
                                       "reward_threshold": r_t, "b": b}), c)
                grid.append({"a_t": a_t, "r_t": r_t, "b": b, "speedup_P": cdlh["P"] / s["P"], "P": s["P"],
                             "soft": s["soft_constraint"], "hard": s["hard_constraint"]})
    fastest = sorted(grid, key=lambda g: -g["speedup_P"])[:10]
    pick = max(fastest, key=lambda g: (g["soft"], g["hard"], g["speedup_P"]))
    rows = {f"a_t={g['a_t']} r_t={g['r_t']} b={g['b']}": g for g in sorted(grid, key=lambda g: -g["speedup_P"])}
    print(table(f"CDSL grid (d={d}, k={k}); CDLH: soft {cdlh['soft_constraint']:.3f}, hard "
                f"{cdlh['hard_constraint']:.3f}, P {cdlh['P']:.2f}", rows, ["speedup_P", "P", "soft", "hard"]))
    print(f"\nCDSL pick (paper's rule: the 10 fastest, then the most satisfying): {pick}")
    return {"grid": grid, "pick": pick, "cdlh": cdlh}


def tune_mjsd(bench: Bench) -> dict:
    """MJSD's gamma, num_beams and tau: the most tokens per target call among the settings that beat speculative
    decoding (at its default gamma) on both of paper 002's figures, a lower perplexity and at least 1.4x its tokens
    per target call."""
    from schemas.methods import SpeculativeDecoding

    sd = summary(bench.run({"name": "speculative_decoding", "gamma": SpeculativeDecoding.model_fields["gamma"]
                            .default}))
    grid = []
    for gamma in (4, 6, 8, 10, 12):
        for beams in (4, 8):
            for tau in (0.1, 0.5, 0.9, 0.99):
                s = summary(bench.run({"name": "mjsd", "gamma": gamma, "num_beams": beams, "tau": tau}))
                grid.append({"gamma": gamma, "num_beams": beams, "tau": tau, "perplexity": s["perplexity"],
                             "vs_sd_tokens_per_call": s["tokens_per_target_call"] / sd["tokens_per_target_call"]})
    both = [g for g in grid if g["vs_sd_tokens_per_call"] >= 1.4 and g["perplexity"] < sd["perplexity"]]
    pick = max(both, key=lambda g: (g["vs_sd_tokens_per_call"], -g["perplexity"])) if both else None
    rows = {f"gamma={g['gamma']} beams={g['num_beams']} tau={g['tau']}": g for g in grid}
    print(table(f"MJSD grid; speculative decoding: perplexity {sd['perplexity']:.4f}, tokens per target call "
                f"{sd['tokens_per_target_call']:.3f}", rows, ["vs_sd_tokens_per_call", "perplexity"]))
    print(f"\nMJSD pick (most tokens per target call with a lower perplexity and >= 1.4x): {pick}")
    return {"grid": grid, "pick": pick, "sd": sd}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=16, help="first demo prompt")
    ap.add_argument("--prompts", type=int, default=16, help="number of demo prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="runs per method; wall-clock is the best")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sections", default="sd,mjsd,cdsl,sr",
                    help="comma-separated subset of sd,mjsd,cdsl,sr,tune (tune: the grids that chose CDSL's and MJSD's "
                    "defaults; run it on the tuning prompts: --first 0 --sections tune)")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    bench = Bench(demo_prompts(args.first, args.prompts), args.max_new_tokens, args.repeats)
    report: dict = {"args": vars(args)}
    print(f"# Draft/target bench: {len(bench.prompts)} demo prompts from #{args.first}, max_new_tokens "
          f"{args.max_new_tokens}, {args.threads} thread(s), best of {args.repeats}")

    # c: the draft/target cost ratio with greedy decoding (paper 000, section 4.3); the two models alternate, and
    # each keeps its best run, so that load from other processes affects both alike
    greedy_t = greedy_d = None
    for _ in range(max(5, 2 * args.repeats)):
        t = summary(bench.run({"name": "greedy"}))
        d = summary(bench.run({"name": "greedy"}, target=bench.lexical.engine.draft))
        greedy_t = t if greedy_t is None or t["wall_s"] < greedy_t["wall_s"] else greedy_t
        greedy_d = d if greedy_d is None or d["wall_s"] < greedy_d["wall_s"] else greedy_d
    c = greedy_t["tokens_per_s"] / greedy_d["tokens_per_s"]
    report["c"] = c
    print(f"\nc = target tokens/s / draft tokens/s (greedy) = {greedy_t['tokens_per_s']:.1f} / "
          f"{greedy_d['tokens_per_s']:.1f} = {c:.3f}")

    if "sd" in sections:
        rows = {"greedy (target)": greedy_t}
        for gamma in (2, 4, 6):
            rows[f"speculative gamma={gamma}"] = summary(bench.run({"name": "speculative_decoding", "gamma": gamma}))
        for s in rows.values():
            s["speedup_wall"] = greedy_t["wall_s"] / s["wall_s"]
        report["sd"] = rows
        print(table("Speculative decoding vs the target's greedy decoding (temperature 0; identical tokens)", rows,
                    ["wall_s", "speedup_wall", "target_calls_per_token", "draft_calls_per_token",
                     "tokens_per_target_call", "acceptance_rate"]))

    if "mjsd" in sections:
        from schemas.methods import MJSD, SpeculativeDecoding

        g_sd = SpeculativeDecoding.model_fields["gamma"].default
        g_mjsd = MJSD.model_fields["gamma"].default
        sd = summary(bench.run({"name": "speculative_decoding", "gamma": g_sd}))
        rows = {
            "greedy (target)": greedy_t,
            f"speculative decoding (gamma={g_sd}, default)": sd,
            f"speculative decoding (gamma={g_mjsd})": summary(bench.run({"name": "speculative_decoding",
                                                                         "gamma": g_mjsd})),
            "mjsd (defaults: gamma={gamma}, beams={num_beams}, tau={tau})".format(
                **{k: MJSD.model_fields[k].default for k in ("gamma", "num_beams", "tau")}):
                summary(bench.run({"name": "mjsd"})),
            "mjsd (paper: gamma=4, beams=8, tau=0.1)": summary(bench.run({"name": "mjsd", "gamma": 4,
                                                                          "num_beams": 8, "tau": 0.1})),
            "mjsd tau=1 (= greedy)": summary(bench.run({"name": "mjsd", "tau": 1.0})),
        }
        for s in rows.values():
            s["vs_sd_tokens_per_call"] = (s["tokens_per_target_call"] or 1.0) / sd["tokens_per_target_call"]
        report["mjsd"] = rows
        print(table("MJSD vs speculative decoding (temperature 0)", rows,
                    ["tokens_per_target_call", "vs_sd_tokens_per_call", "perplexity", "wall_s",
                     "acceptance_rate", "draft_calls_per_token"]))

    if "cdsl" in sections:
        rows = {
            "greedy": summary(bench.run({"name": "greedy"}), c),
            "beam (3)": summary(bench.run({"name": "beam", "num_beams": 3}), c),
            "cdlh": summary(bench.run({"name": "cdlh"}), c),
            "cdlh_appx": summary(bench.run({"name": "cdlh_appx"}), c),
            "cdsl (defaults)": summary(bench.run({"name": "cdsl"}), c),
            "cdsl (a_t=0.6, r_t=0.3, b=1)": summary(bench.run({"name": "cdsl", "accept_threshold": 0.6,
                                                               "reward_threshold": 0.3, "b": 1}), c),
            "cdsl (sampling validation, T=1)": summary(
                bench.run({"name": "cdsl", "validation": "sampling"}, {"temperature": 1.0}), c),
        }
        base = rows["cdlh"]
        for s in rows.values():
            s["speedup_P"] = base["P"] / s["P"]
            s["speedup_P_fwd"] = base["P_fwd"] / s["P_fwd"]
            s["speedup_wall"] = base["wall_s"] / s["wall_s"]
        report["cdsl"] = rows
        print(table("CDSL and its baselines (lexical reward: concept coverage)", rows,
                    ["speedup_P", "P", "target_calls_per_token", "draft_calls_per_token", "speedup_P_fwd",
                     "speedup_wall", "wall_s", "hard_constraint", "soft_constraint", "state_counts"]))

    if "sr" in sections:
        rows = {}
        for sampler in ("target", "speculative"):
            method = {"name": "speculative_rejection", "n": 16, "alpha": 0.5, "schedule": "fixed",
                      "every_k_tokens": 8}
            rows[f"SR, {sampler} sampler"] = summary(
                bench.run(method, {"temperature": 1.0, "sampler": sampler}, reward="model"))
        base = rows["SR, target sampler"]
        for s in rows.values():
            s["speedup_wall"] = base["wall_s"] / s["wall_s"]
        report["sr"] = rows
        print(table("Speculative Rejection (n=16, alpha=0.5, every 8 tokens; reward model), by sampler", rows,
                    ["wall_s", "speedup_wall", "target_fwd_per_token", "target_calls_per_token",
                     "draft_calls_per_token", "acceptance_rate", "best_reward", "perplexity"]))

    if "tune" in sections:
        report["tune"] = {"cdsl": tune_cdsl(bench, c), "mjsd": tune_mjsd(bench)}

    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=lambda o: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
