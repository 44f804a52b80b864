"""Best-of-N and Speculative Rejection on the bundled trio and demo prompts: `python -m bench.bon_sr`.

Prints two comparisons (Markdown tables; `--json PATH` also writes every figure):

1. **Sampling throughput.** Our Best-of-N (``run_pool`` without decision tokens: the batched engine, then the
   final reward) against ``model.generate(do_sample=True, top_k=0, num_return_sequences=N)`` on the tiny target,
   for each N of ``--ns``, in generated tokens per second (tokens up to and including EOS, or the length limit).
   Two shapes, each run the same way on both sides:
   - *one prompt per call*: each call decodes N candidates of one prompt (generate's own unit of work);
   - *batched*: ``--prompts-per-batch`` prompts per call (left-padded for generate), as a job's actor does.
   Our side includes the final scoring with the ``lexical`` reward (pure Python, well under 1% of the time); the
   reward model's cost is in section 2.
2. **Speculative Rejection against Best-of-N** with the tiny reward model: mean best reward, generated tokens
   (every candidate's, rejected ones up to their rejection), wall-clock, paper 001's improvement score (eq. 8)
   and relative compute (eq. 7). The baseline is Best-of-N_min (``--nmin``), as Best-of-120 was the largest that
   fits one 80 GB GPU in the paper. SR runs with its minimal config (``--sr n:alpha``: the memory schedule, each
   prompt given the KV cache of n / 8 candidates at full length), in Best-of-M's memory (``--sr n:alpha:memM``:
   memory_candidates M, e.g. the baseline's), or with a decision every K tokens (``--sr n:alpha:K``). The Best-of-N
   sweep gives the N whose
   reward SR matches (interpolated in log N between the two Best-of-N runs around it), and SR's generated tokens
   against that Best-of-N's (its tokens per candidate x the matched N) and against the next Best-of-N of the sweep.

Paper 001 (Speculative Rejection) is listed in docs/references.md.

Wall-clock is the best of ``--repeats`` runs on ``--threads`` CPU threads (tiny models run fastest on one); the
two sides of a comparison alternate, so that load from other processes affects both alike. One device, so the
relative compute is a ratio of wall-clock (the paper's T x #GPUs for a Best-of-N spread over GPUs); section 2 also
prints each run's process CPU seconds (the least of the repeats) and their ratio to the baseline's (relative_cpu),
which a loaded machine disturbs less than wall-clock (section 2's runs go one after the other).
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
from bench.common import BASE, table
from pipeline.preflight import resolved
from reporting.stats import improvement_score
from schemas.config import validate_config
from workers.accounting.cost import Meter
from workers.decoding.batch import left_pad
from workers.methods import run_method
from workers.actor.runner import Runner


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class Bench:
    def __init__(self, items: list[dict], max_new_tokens: int, repeats: int):
        self.base = dict(BASE, generation=dict(BASE["generation"], max_new_tokens=max_new_tokens))
        self.lexical = Runner(resolved(validate_config(self.base)))
        model_reward = dict(self.base, models=dict(self.base["models"], reward={"kind": "model",
                                                                                "path": "builtin:tiny-reward"}))
        self.scorer = Runner(resolved(validate_config(model_reward))).reward
        self.prompts = [p for _, p in self.lexical.prepare(items)[0]]
        self.repeats = repeats

    def method(self, method: dict, per_call: int, reward: str = "lexical", seed: int = 0) -> dict:
        """One run of a method over the prompts, `per_call` prompts per call: results, meter, wall seconds."""
        params = validate_config(dict(self.base, method=method)).method
        meter = Meter(len(self.prompts))
        ctx = replace(self.lexical.context_for(), seed=seed,
                      reward=self.scorer if reward == "model" else self.lexical.reward)
        results = []
        start, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for batch in chunks(self.prompts, per_call):
                got, work = run_method(ctx, params, batch)
                results += got
                meter.charge(work)
        wall = time.perf_counter() - start
        return {"results": results, "meter": meter, "wall": wall, "cpu": time.process_time() - cpu,
                "tokens": sum(res.stats["generated_tokens"] for res in results)}

    def generate(self, n: int, per_call: int) -> dict:
        """`model.generate` over the prompts, `per_call` prompts (left-padded) and n return sequences per call."""
        r = self.lexical
        limit = self.base["generation"]["max_new_tokens"]
        eos = torch.tensor(r.eos_ids)
        tokens = 0
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in chunks(self.prompts, per_call):
                ids, mask = left_pad([p.ids for p in batch], r.pad_id, r.engine.device)
                out = r.engine.target.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                        top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=limit,
                                        min_new_tokens=0, pad_token_id=r.pad_id, eos_token_id=r.eos_ids)
                new = out[:, ids.shape[1]:].cpu()
                is_eos = torch.isin(new, eos)
                # a sequence's tokens run to its first EOS (included); generate pads the rest of a finished one
                tokens += int(torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1]).sum())
        return {"wall": time.perf_counter() - start, "tokens": tokens}


def best_of(runs: list[dict]) -> dict:
    """The run with the smallest wall-clock, its tokens/s added."""
    best = min(runs, key=lambda o: o["wall"])
    return dict(best, tokens_per_s=best["tokens"] / best["wall"])


def throughput(bench: Bench, ns: list[int], per_batch: int) -> dict:
    out = {}
    for n in ns:
        for label, per_call in (("one prompt per call", 1), (f"{per_batch} prompts per call", per_batch)):
            ours, theirs = [], []
            for _ in range(bench.repeats):
                ours.append(bench.method({"name": "best_of_n", "n": n}, per_call))
                theirs.append(bench.generate(n, per_call))
            o, t = best_of(ours), best_of(theirs)
            out[f"N={n}, {label}"] = {
                "n": n, "prompts_per_call": per_call,
                "ours_tokens": o["tokens"], "ours_s": o["wall"], "ours_tok_per_s": o["tokens_per_s"],
                "generate_tokens": t["tokens"], "generate_s": t["wall"], "generate_tok_per_s": t["tokens_per_s"],
                "ratio": o["tokens_per_s"] / t["tokens_per_s"],
            }
    return out


def run_summary(out: dict) -> dict:
    results = out["results"]
    best = [res.candidates[res.best_index].reward for res in results if res.best_index is not None]
    return {"best_reward": statistics.fmean(best), "tokens": out["tokens"], "wall_s": out["wall"], "cpu_s": out["cpu"],
            "reward_tokens": int(out["meter"].tokens["reward"].sum()),
            "rounds": statistics.fmean(res.stats.get("rejection_rounds", 0) for res in results)}


def finished_rewards(res) -> list[float]:
    return [c.reward for c in res.candidates if c.finish_reason != "rejected" and c.reward is not None]


def improvement(outs: list[dict], base_outs: list[dict]) -> float:
    """Eq. 8 averaged over (seed, prompt) pairs, each against the baseline run of the same seed; prompts whose
    baseline rewards are all equal have no score (the equation divides by their range)."""
    scores = []
    for out, base in zip(outs, base_outs):
        for res, b in zip(out["results"], base["results"]):
            z = finished_rewards(b)
            if res.best_index is not None and z:
                sc = improvement_score(res.candidates[res.best_index].reward, z)
                if sc is not None:
                    scores.append(sc)
    return statistics.fmean(scores)


def matched_n(reward: float, bon: dict[int, dict]) -> tuple[float, int] | None:
    """The N (log-interpolated) whose Best-of-N reward equals `reward`, and the sweep's N at or just above it."""
    ns = sorted(bon)
    for lo, hi in zip(ns, ns[1:]):
        rl, rh = bon[lo]["best_reward"], bon[hi]["best_reward"]
        if rl <= reward <= rh and rh > rl:
            frac = (reward - rl) / (rh - rl)
            return math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo))), hi
    if reward < bon[ns[0]]["best_reward"]:
        return None
    return math.inf, ns[-1]


def sr_vs_bon(bench: Bench, bon_ns: list[int], nmin: int, sr_settings: list[tuple[int, float, str | None]],
              per_batch: int, seeds: list[int]) -> dict:
    """Best-of-N sweep and SR settings, each over `seeds` (figures averaged over seeds, wall-clock the best)."""
    def runs(method: dict) -> tuple[dict, list[dict]]:
        outs, per_seed = [], []
        for seed in seeds:
            best, cpu = None, None
            for _ in range(bench.repeats):
                o = bench.method(method, per_batch, reward="model", seed=seed)
                best = o if best is None or o["wall"] < best["wall"] else best
                cpu = o["cpu"] if cpu is None else min(cpu, o["cpu"])
            best = dict(best, cpu=cpu)
            outs.append(best)
            per_seed.append(run_summary(best))
        s = {k: statistics.fmean(p[k] for p in per_seed) for k in per_seed[0]}
        return s, outs

    rows, bon, bon_outs = {}, {}, {}
    for n in bon_ns:
        bon[n], bon_outs[n] = runs({"name": "best_of_n", "n": n})
    base, base_outs = bon[nmin], bon_outs[nmin]

    def add_baseline(s: dict, outs: list[dict]) -> dict:
        s["improvement_score"] = improvement(outs, base_outs)  # eq. 8
        s["relative_compute"] = s["wall_s"] / base["wall_s"]  # eq. 7
        s["relative_cpu"] = s["cpu_s"] / base["cpu_s"]  # eq. 7 in CPU seconds: steadier on a loaded machine
        return s

    for n in bon_ns:
        rows[f"Best-of-{n}"] = add_baseline(dict(bon[n]), bon_outs[n])
    for n, alpha, how in sr_settings:
        method = {"name": "speculative_rejection", "n": n, "alpha": alpha}
        if how is None:
            label = f"SR n={n} alpha={alpha} (minimal config: memory, Best-of-{max(1, n // 8)}'s space)"
        elif how.startswith("mem"):
            method.update(memory_candidates=int(how[3:]))
            label = f"SR n={n} alpha={alpha}, memory, Best-of-{int(how[3:])}'s space"
        else:
            method.update(schedule="fixed", every_k_tokens=int(how))
            label = f"SR n={n} alpha={alpha}, every {int(how)} tokens"
        s = add_baseline(*runs(method))
        m = matched_n(s["best_reward"], bon)
        if m is not None:
            s["matches_bon_n"] = m[0]
            # Best-of-N's tokens grow linearly in N: its tokens per candidate x the matched N
            per_candidate = statistics.fmean(bon[k]["tokens"] / k for k in bon)
            s["tokens_vs_matched_bon"] = s["tokens"] / (per_candidate * m[0]) if math.isfinite(m[0]) else None
            s["tokens_vs_bon_above"] = s["tokens"] / bon[m[1]]["tokens"]
            s["bon_above"] = m[1]
        rows[label] = s
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32, help="number of demo prompts (from the first)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="runs per figure; wall-clock is the best")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ns", default="16,64", help="N values of the throughput comparison")
    ap.add_argument("--prompts-per-batch", type=int, default=4)
    ap.add_argument("--bon-ns", default="1,2,4,8,16,32,64,128,256", help="the Best-of-N sweep")
    ap.add_argument("--nmin", type=int, default=16, help="Best-of-N_min: the baseline")
    ap.add_argument("--sr", default="32:0.5,64:0.5,128:0.5,64:0.5:mem16,128:0.5:mem16,128:0.5:4,256:0.5:4",
                    help="SR settings, comma-separated: n:alpha (the minimal config), n:alpha:memM (each prompt given "
                    "the KV cache of M candidates at full length) or n:alpha:K (a decision every K tokens)")
    ap.add_argument("--seeds", default="0,1", help="seeds of section 2 (its figures are means over them)")
    ap.add_argument("--sections", default="throughput,sr", help="comma-separated subset of throughput,sr")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    sections = set(args.sections.split(","))
    bench = Bench(demo_prompts(0, args.prompts), args.max_new_tokens, args.repeats)
    report: dict = {"args": vars(args), "torch": torch.__version__}
    print(f"# Best-of-N / Speculative Rejection bench: {len(bench.prompts)} demo prompts, max_new_tokens "
          f"{args.max_new_tokens}, {args.threads} thread(s), best of {args.repeats}")
    bench.method({"name": "best_of_n", "n": 4}, args.prompts_per_batch)  # warm-up (first-call allocations)
    bench.generate(4, args.prompts_per_batch)

    if "throughput" in sections:
        rows = throughput(bench, [int(n) for n in args.ns.split(",")], args.prompts_per_batch)
        report["throughput"] = rows
        print(table("Best-of-N sampling: our engine vs model.generate(num_return_sequences=N), tokens/s", rows,
                    ["ours_tok_per_s", "generate_tok_per_s", "ratio", "ours_tokens", "generate_tokens", "ours_s",
                     "generate_s"], first="shape"))

    if "sr" in sections:
        settings = []
        for item in args.sr.split(","):
            n, alpha, *how = item.split(":")
            settings.append((int(n), float(alpha), how[0] if how else None))
        out = sr_vs_bon(bench, [int(n) for n in args.bon_ns.split(",")], args.nmin, settings,
                        args.prompts_per_batch, [int(s) for s in args.seeds.split(",")])
        report["sr"] = out
        print(table(f"Speculative Rejection vs Best-of-N (tiny reward model; {args.prompts_per_batch} prompts per "
                    f"call; baseline Best-of-{args.nmin}; means over seeds {args.seeds})", out["rows"],
                    ["best_reward", "tokens", "reward_tokens", "wall_s", "cpu_s", "improvement_score",
                     "relative_compute", "relative_cpu", "rounds",
                     "matches_bon_n", "tokens_vs_matched_bon", "bon_above", "tokens_vs_bon_above"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
