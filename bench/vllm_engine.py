"""The `vllm` engine against the `hf` engine and against raw vLLM: `python -m bench.vllm_engine` (docs/vllm.md).

Prints (Markdown tables; `--json PATH` also writes every figure):

1. **Best-of-N throughput**, in generated tokens per second (tokens up to and including EOS, or the length limit),
   for each N of ``--ns``, ``--per-call`` prompts per call, on the same checkpoint:
   - *raw vLLM*: ``vllm.LLM.generate`` with ``SamplingParams(n=N, seed=s)`` per prompt, where s is the seed the
     wrapper gives the prompt's candidate 0 (so both sides sample the very same tokens; the bench checks it);
   - *engine vllm*: ``Runner.run`` with models.engine vllm (Best-of-N with the ``lexical`` reward: requests, the
     engine loop, text
     decoding, the rows);
   - *engine hf*: ``Runner.run``, the same method on Winnow's own engine.
   Raw vLLM and the wrapper run on one engine (a ``vllm.LLM`` built with the wrapper's engine settings: engine core
   in process, eager, no chunked prefill, block size 32 on CPU), alternating, in one process; the hf engine in
   another (a vLLM CPU engine pins its process's threads). The wrapper's overhead is printed as raw/wrapper
   tokens-per-second - 1 (wall-clock, best run) and as wrapper/raw CPU seconds per token - 1 (the process's CPU
   time, least of the runs: steadier on a loaded machine); goal: at most 10% at N = 64. The wrapper asks vLLM for
   each sampled token's log-probability (the `logprob` reward and every row's perplexity come from them), which raw
   ``LLM.generate`` does not compute by default: a third side, raw vLLM with the same log-probabilities, splits the
   overhead into what those cost vLLM (``logprobs_cost_cpu``) and what the wrapper adds to the same outputs
   (``wrapper_overhead_cpu_same_outputs``).
   ``--target builtin:tiny-target`` (default) or ``--shape llama-32k|qwen2-152k``: a random-init checkpoint of
   bench/engine_scale.py's realistic shapes (its ``quick`` sizes), whose responses run to the length limit.
2. **Speculative Rejection against Best-of-N** on the tiny trio with the vllm engine and the tiny reward model: a
   Best-of-N sweep and SR settings (``--sr``: ``n:alpha`` the minimal config, memory schedule with its defaults;
   ``n:alpha:K`` the fixed schedule, a decision every K tokens), mean best reward and generated tokens
   (rejected candidates up to their rejection), and SR's tokens against those of the Best-of-N whose reward it
   matches (log-interpolated, as bench/bon_sr.py does). Goal: at most half.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from assets import demo_prompts
from bench.common import BASE, table

ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_MB = 512


def chunks(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


def job(target: str, method: dict, engine: str, max_new_tokens: int, reward: dict | None = None):
    from pipeline.preflight import resolved
    from schemas.config import validate_config

    models = {"target": target, "reward": reward or {"kind": "lexical"}, "engine": engine}
    if engine == "vllm":
        models.update(kv_cache_mb=KV_CACHE_MB, max_num_seqs=max(256, method.get("n", 1)))
    cfg = dict(BASE, models=models, method=method, generation=dict(BASE["generation"], max_new_tokens=max_new_tokens))
    return resolved(validate_config(cfg))


# ---------------------------------------------------------------------------------------------------------------
# One side, in its own process


def timed(fn, repeats: int) -> tuple[dict, object]:
    """The best wall-clock and the least process CPU time (every thread of the process) of `repeats` runs."""
    best, cpu, out = None, None, None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        res = fn()
        wall, spent = time.perf_counter() - t0, time.process_time() - c0
        cpu = spent if cpu is None else min(cpu, spent)
        if best is None or wall < best:
            best, out = wall, res
    return {"wall": best, "cpu": cpu}, out


def side_runner(side: str, target: str, ns: list[int], items: list[dict], per_call: int, max_new_tokens: int,
                repeats: int, threads: int = 1) -> dict:
    """Tokens and best wall seconds of each N on one side; the candidates' token counts, to check that raw vLLM and
    the wrapper sampled the same tokens."""
    out: dict = {}
    if side == "hf":
        import torch

        from workers.actor.runner import Runner

        torch.set_num_threads(threads)
        for n in [4] + ns:  # N = 4: warm-up
            runner = Runner(job(target, {"name": "best_of_n", "n": n}, side, max_new_tokens))
            times, rows = timed(lambda: [r for c in chunks(items, per_call) for r in runner.run(c)], repeats)
            out[n] = {**times, "tokens": sum(r["stats"]["generated_tokens"] for r in rows)}
        return out
    # raw vLLM and the vllm engine on one engine (a vllm.LLM's), alternating
    from vllm import LLM, SamplingParams

    from workers.decoding.sampling import prompt_key
    from workers.actor.runner import Runner
    from workers.engines.vllm import VllmEngine, candidate_seed

    held = {}

    def make_engine(kwargs, stat_loggers):  # the wrapper's own engine settings, in a vllm.LLM
        held["llm"] = LLM(**kwargs)
        return held["llm"].llm_engine

    cfg = job(target, {"name": "best_of_n", "n": 4}, "vllm", max_new_tokens)
    first = Runner(cfg, engine=VllmEngine(cfg, make_engine))
    llm = held["llm"]
    ids = {it["prompt_id"]: first.encode_prompt(it["prompt"]) for it in items}

    def generate(n: int, logprobs: bool = False):
        """LLM.generate; with `logprobs`, each sampled token's log-probability as the wrapper asks for it."""
        extra = {"logprobs": 0, "flat_logprobs": True} if logprobs else {}
        counts = []
        for chunk in chunks(items, per_call):
            params = [SamplingParams(n=n, seed=candidate_seed(0, prompt_key(it["prompt_id"]), 0), temperature=1.0,
                                     top_p=1.0, top_k=0, max_tokens=max_new_tokens, stop_token_ids=first.eos_ids,
                                     detokenize=False, **extra) for it in chunk]
            res = llm.generate([{"prompt_token_ids": ids[it["prompt_id"]]} for it in chunk], params, use_tqdm=False)
            counts += [[len(c.token_ids) for c in sorted(r.outputs, key=lambda c: c.index)] for r in res]
        return counts

    for n in [4] + ns:  # N = 4: warm-up
        runner = Runner(job(target, {"name": "best_of_n", "n": n}, "vllm", max_new_tokens), share=first)
        raw, raw_lp, wrapped = [], [], []
        for _ in range(repeats):
            raw.append(timed(lambda: generate(n), 1))
            raw_lp.append(timed(lambda: generate(n, logprobs=True), 1))
            wrapped.append(timed(lambda: [r for c in chunks(items, per_call) for r in runner.run(c)], 1))
        (rt, counts), (vt, rows) = min(raw, key=lambda x: x[0]["wall"]), min(wrapped, key=lambda x: x[0]["wall"])
        lt, lp_counts = min(raw_lp, key=lambda x: x[0]["wall"])
        rt["cpu"], vt["cpu"] = min(x[0]["cpu"] for x in raw), min(x[0]["cpu"] for x in wrapped)
        lt["cpu"] = min(x[0]["cpu"] for x in raw_lp)
        out[n] = {"raw": {**rt, "tokens": sum(map(sum, counts)), "counts": counts},
                  "raw_lp": {**lt, "tokens": sum(map(sum, lp_counts)), "counts": lp_counts},
                  "vllm": {**vt, "tokens": sum(r["stats"]["generated_tokens"] for r in rows),
                           "counts": [[c["num_tokens"] for c in r["candidates"]] for r in rows]}}
    return out


def sr_side(items: list[dict], per_call: int, max_new_tokens: int, bon_ns: list[int], settings: list[tuple],
            seeds: list[int]) -> dict:
    """The vllm engine's Best-of-N sweep and SR settings with the tiny reward model, per seed."""
    from workers.actor.runner import Runner

    reward = {"kind": "model", "path": "builtin:tiny-reward"}
    first = Runner(job("builtin:tiny-target", {"name": "best_of_n", "n": 4}, "vllm", max_new_tokens, reward))
    out = {}
    methods = [(f"Best-of-{n}", {"name": "best_of_n", "n": n}) for n in bon_ns]
    for n, a, k in settings:
        if k is None:
            methods.append((f"SR n={n} alpha={a} (minimal config)", {"name": "speculative_rejection", "n": n,
                                                                    "alpha": a}))
        else:
            methods.append((f"SR n={n} alpha={a} every {k} tokens", {"name": "speculative_rejection", "n": n,
                                                                     "alpha": a, "schedule": "fixed",
                                                                     "every_k_tokens": k}))
    for label, method in methods:
        per_seed = []
        for seed in seeds:
            cfg = job("builtin:tiny-target", method, "vllm", max_new_tokens, reward).model_copy(update={"seed": seed})
            runner = Runner(cfg, share=first)
            t0 = time.perf_counter()
            rows = [r for chunk in chunks(items, per_call) for r in runner.run(chunk)]
            wall = time.perf_counter() - t0
            best = [r["best_reward"] for r in rows if r["best_reward"] is not None]
            per_seed.append({
                "best_reward": statistics.fmean(best), "tokens": sum(r["stats"]["generated_tokens"] for r in rows),
                "reward_tokens": sum(r["cost"]["reward_tokens"] for r in rows), "wall_s": wall,
                "rounds": statistics.fmean(r["stats"]["rejection_rounds"] for r in rows)})
        out[label] = {k: statistics.fmean(p[k] for p in per_seed) for k in per_seed[0]}
        print(f"  {label}: {out[label]}", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The driver


def run_side(args, side: str, target: str, extra: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "bench.vllm_engine", "--worker", side, "--target", target, "--ns", args.ns,
           "--prompts", str(args.prompts), "--per-call", str(args.per_call), "--max-new-tokens",
           str(args.max_new_tokens), "--repeats", str(args.repeats), "--bon-ns", args.bon_ns, "--sr", args.sr,
           "--seeds", args.seeds, "--hf-threads", str(args.hf_threads), *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench side {side} failed:\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    print(f"  ({side}: {time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    return json.loads(line[len("RESULT "):])


def matched(reward: float, bon: dict[int, dict]) -> tuple[float, int] | None:
    from bench.bon_sr import matched_n

    return matched_n(reward, bon)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32, help="number of demo prompts (from the first)")
    ap.add_argument("--per-call", type=int, default=4, help="prompts per run() call (resources.prompts_per_call)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="runs per throughput figure; wall-clock is the best")
    ap.add_argument("--ns", default="16,64", help="N values of the throughput comparison")
    ap.add_argument("--target", default="builtin:tiny-target", help="checkpoint of the throughput comparison")
    ap.add_argument("--shape", choices=["llama-32k", "qwen2-152k"],
                    help="instead of --target: a random-init checkpoint of bench/engine_scale.py (quick sizes)")
    ap.add_argument("--bon-ns", default="1,2,4,8,16,32,64,128", help="the Best-of-N sweep of section 2")
    ap.add_argument("--sr", default="32:0.5,64:0.5,64:0.5:4,128:0.5:4",
                    help="SR settings: n:alpha (the minimal config) or n:alpha:K (a decision every K tokens)")
    ap.add_argument("--seeds", default="0,1", help="seeds of section 2 (its figures are means over them)")
    ap.add_argument("--sections", default="throughput,sr", help="comma-separated subset of throughput,sr")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--hf-threads", type=int, default=1,
                    help="torch threads of the hf engine (tiny models run fastest on one, as in bench/bon_sr.py); "
                    "vLLM's CPU worker binds its own OpenMP threads, one per core")
    ap.add_argument("--worker", choices=["vllm", "hf", "sr"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ns = [int(n) for n in args.ns.split(",")]
    items = demo_prompts(0, args.prompts)
    settings = [(int(p[0]), float(p[1]), int(p[2]) if len(p) > 2 else None)
                for p in (s.split(":") for s in args.sr.split(","))]
    seeds = [int(s) for s in args.seeds.split(",")]

    if args.worker:  # one side, in this process
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if args.worker == "sr":
            res = sr_side(items, args.per_call, args.max_new_tokens, [int(n) for n in args.bon_ns.split(",")],
                          settings, seeds)
        else:
            res = side_runner(args.worker, args.target, ns, items, args.per_call, args.max_new_tokens, args.repeats,
                              args.hf_threads)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    report: dict = {"args": vars(args)}
    sections = set(args.sections.split(","))
    print(f"# vLLM engine bench: {len(items)} demo prompts, {args.per_call} per call, max_new_tokens "
          f"{args.max_new_tokens}, best of {args.repeats}; CPU, {os.cpu_count()} cores", flush=True)
    if "throughput" in sections:
        target = args.target
        tmp = None
        if args.shape:
            from bench.engine_scale import SHAPES, build_checkpoints

            tmp = tempfile.TemporaryDirectory(prefix="winnow-vllm-bench-")
            target = str(build_checkpoints(Path(tmp.name), args.shape, SHAPES["quick"][args.shape], False)["target"])
        both, hf = run_side(args, "vllm", target), run_side(args, "hf", target)
        sides = {"raw": {n: v["raw"] for n, v in both.items()}, "raw_lp": {n: v["raw_lp"] for n, v in both.items()},
                 "vllm": {n: v["vllm"] for n, v in both.items()}, "hf": hf}
        if tmp is not None:
            tmp.cleanup()
        rows = {}
        for n in ns:
            r, v, h = (sides[s][str(n)] for s in ("raw", "vllm", "hf"))
            tps = {s: sides[s][str(n)]["tokens"] / sides[s][str(n)]["wall"] for s in sides}
            cpu_per_token = {s: sides[s][str(n)]["cpu"] / sides[s][str(n)]["tokens"] for s in ("raw", "raw_lp", "vllm")}
            rows[f"N = {n}"] = {
                "raw_vllm_tok_per_s": tps["raw"], "engine_vllm_tok_per_s": tps["vllm"],
                "engine_hf_tok_per_s": tps["hf"], "wrapper_overhead": tps["raw"] / tps["vllm"] - 1,
                "wrapper_overhead_cpu": cpu_per_token["vllm"] / cpu_per_token["raw"] - 1,
                "logprobs_cost_cpu": cpu_per_token["raw_lp"] / cpu_per_token["raw"] - 1,
                "wrapper_overhead_cpu_same_outputs": cpu_per_token["vllm"] / cpu_per_token["raw_lp"] - 1,
                "vllm_vs_hf": tps["vllm"] / tps["hf"],
                "same_tokens_as_raw": r["counts"] == v["counts"] == sides["raw_lp"][str(n)]["counts"],
                "tokens_vllm": v["tokens"], "tokens_hf": h["tokens"],
            }
        report["throughput"] = rows
        print(table(f"Best-of-N throughput on {args.shape or args.target}: raw vLLM (LLM.generate, n=N) vs engine "
                    "vllm vs engine hf, generated tokens/s", rows,
                    ["raw_vllm_tok_per_s", "engine_vllm_tok_per_s", "engine_hf_tok_per_s", "wrapper_overhead",
                     "wrapper_overhead_cpu", "logprobs_cost_cpu", "wrapper_overhead_cpu_same_outputs", "vllm_vs_hf",
                     "same_tokens_as_raw", "tokens_vllm", "tokens_hf"], first="N"))
    if "sr" in sections:
        res = run_side(args, "sr", "builtin:tiny-target")
        bon = {int(k.split("-")[-1]): v for k, v in res.items() if k.startswith("Best-of-")}
        per_candidate = statistics.fmean(bon[k]["tokens"] / k for k in bon)
        for label, s in res.items():
            if label.startswith("SR"):
                m = matched(s["best_reward"], bon)
                if m is not None:
                    s["matches_bon_n"] = m[0]
                    s["tokens_vs_matched_bon"] = s["tokens"] / (per_candidate * m[0]) if m[0] != float("inf") else None
                    s["bon_above"], s["tokens_vs_bon_above"] = m[1], s["tokens"] / bon[m[1]]["tokens"]
        report["sr"] = res
        print(table(f"Speculative Rejection vs Best-of-N on the vllm engine (tiny trio, tiny reward model; "
                    f"{args.per_call} prompts per call; means over seeds {args.seeds})", res,
                    ["best_reward", "tokens", "reward_tokens", "wall_s", "rounds", "matches_bon_n",
                     "tokens_vs_matched_bon", "bon_above", "tokens_vs_bon_above"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
