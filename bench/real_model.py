"""Paper 001's Table 2 on a real model: Best-of-N and Speculative Rejection on SmolLM2-135M-Instruct
(`builtin:smollm2-135m-instruct`, the `real` extra: docs/real-model.md), with the `logprob` reward (the response's
mean token log-probability under SmolLM2 itself, paper 001 section 5.3) on the bundled real instructions.

    python -m bench.real_model                       # both engines, logprob and lexical, generate(); about an hour
    python -m bench.real_model --engines hf --skip-lexical --skip-generate --prompts 8   # a quick look

Every side runs through the job's own `Runner` (the actor's path: engine, reward, pool, rows), `--per-call` prompts
per call, one call after another. For each engine (`--engines`):

- **Table 2, logprob reward**: Best-of-N for each N of `--bon`, Speculative Rejection with the minimal config
  (`n`, alpha 0.5: the memory schedule with its default space) for each n of `--sr`, and with a fixed schedule
  (a decision every `--every` tokens) at the largest n. Reported as the paper does: perplexity (exp of minus the
  mean best reward) and the speedup against the largest Best-of-N, in CPU seconds of this process (the vLLM engine
  runs in it) and in generated tokens; "matches" is the Best-of-N (log-interpolated in N) whose mean best reward
  equals the row's.
- **the lexical reward** (fraction of the concepts covered) on the bundled concept prompts: the same sweep.
- **the engine against `generate(num_return_sequences=N)`** on SmolLM2 (hf engine, `--generate` N's): generated tokens
  per CPU-second of Best-of-N through the Runner against HF's generate on the same prompts, one prompt at a time.

CPU seconds are `time.process_time` of this process (every thread), which a shared machine disturbs less than wall
time; the load average is printed with each figure. Generated tokens and rewards are fixed by the seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from bench.bon_sr import matched_n
from bench.common import table

TARGET = "builtin:smollm2-135m-instruct"


def job(engine: str, method: dict, reward: dict, source: str, max_new_tokens: int, per_call: int, seed: int = 0):
    """The resolved config of one side (resolved as the actor resolves it, building the asset on this machine)."""
    from pipeline.preflight import resolved
    from schemas.config import validate_config

    models = {"target": TARGET, "reward": reward, "engine": engine}
    if engine == "vllm":
        models["max_num_seqs"] = max(256, method.get("n", 1))
    raw = {"name": "bench-real", "seed": seed, "data": {"source": source, "id_column": "id"}, "models": models,
           "method": method, "generation": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
           "output": {"path": "runs/bench-real"}, "resources": {"prompts_per_call": per_call}}
    return resolved(validate_config(raw), on_node=True)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(runner, items: list[dict], per_call: int) -> dict:
    """Every item through `runner`, `per_call` at a time: summary figures of its rows."""
    c0, w0 = time.process_time(), time.perf_counter()
    rows = [r for i in range(0, len(items), per_call) for r in runner.run(items[i : i + per_call])]
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    bad = [r["error"] for r in rows if r["error"]]
    if bad:
        raise RuntimeError(f"rows with errors: {bad[:3]}")
    best = [r["best_reward"] for r in rows]
    return {
        "mean_best_reward": statistics.fmean(best),
        "generated_tokens": sum(r["stats"]["generated_tokens"] for r in rows),
        "reward_tokens": sum(r["cost"]["reward_tokens"] for r in rows),
        "rejection_rounds": statistics.fmean(r["stats"]["rejection_rounds"] for r in rows),
        "rejected": sum(c["finish_reason"] == "rejected" for r in rows for c in r["candidates"]),
        "cpu_s": cpu, "wall_s": wall, "load": load(),
    }


def sweep(engine: str, reward: dict, source: str, items: list[dict], args) -> dict[str, dict]:
    """Best-of-N for each N, Speculative Rejection (minimal config) for each n and with a fixed schedule, on one
    engine; the first runner loads the models and the others share them."""
    from workers.actor.runner import Runner

    sides = [(f"Best-of-{n}", {"name": "best_of_n", "n": n}) for n in args.bon]
    sides += [(f"SR n={n}, alpha 0.5 (minimal config)", {"name": "speculative_rejection", "n": n, "alpha": 0.5})
              for n in args.sr]
    top = max(args.sr)
    sides.append((f"SR n={top}, alpha 0.5, every {args.every} tokens",
                  {"name": "speculative_rejection", "n": top, "alpha": 0.5, "schedule": "fixed",
                   "every_k_tokens": args.every}))
    first = None
    out: dict[str, dict] = {}
    for label, method in sides:
        cfg = job(engine, method, reward, source, args.max_new_tokens, args.per_call)
        runner = Runner(cfg) if first is None else Runner(cfg, share=first)
        first = first or runner
        if len(out) == 0:  # warm-up: one-off costs (allocator, kernels) not counted
            runner.run(items[: args.per_call])
        out[label] = run(runner, items, args.per_call)
        print(f"  {engine} {label}: {out[label]}", file=sys.stderr, flush=True)
    return out


def paper_form(rows: dict[str, dict], bon: list[int], logprob: bool) -> dict[str, dict]:
    """Perplexity (logprob) or mean reward, and the speedups against the largest Best-of-N."""
    largest = rows[f"Best-of-{max(bon)}"]
    curve = {n: {"best_reward": rows[f"Best-of-{n}"]["mean_best_reward"]} for n in bon}
    out = {}
    for label, s in rows.items():
        r = dict(s)
        if logprob:
            r["perplexity"] = math.exp(-s["mean_best_reward"])
        r["speedup_cpu"] = largest["cpu_s"] / s["cpu_s"]
        r["speedup_tokens"] = largest["generated_tokens"] / s["generated_tokens"]
        top = curve[max(bon)]["best_reward"]
        reward = top if abs(s["mean_best_reward"] - top) <= 1e-9 else s["mean_best_reward"]  # float noise is a tie
        m = matched_n(reward, curve)
        r["matches"] = "below BoN-%d" % min(bon) if m is None else (
            f"above BoN-{max(bon)}" if math.isinf(m[0]) else f"BoN-{m[0]:.0f}")
        out[label] = r
    return out


def engine_vs_generate(items: list[dict], ns: list[int], max_new_tokens: int) -> dict[str, dict]:
    """Best-of-N through the Runner (hf engine, logprob reward: no reward forward) against HF's
    generate(num_return_sequences=N), one prompt at a time: generated tokens per CPU-second."""
    import torch

    from workers.actor.runner import Runner

    out = {}
    first = None
    for n in ns:
        cfg = job("hf", {"name": "best_of_n", "n": n}, {"kind": "logprob"}, "builtin:real-prompts", max_new_tokens, 1)
        runner = Runner(cfg) if first is None else Runner(cfg, share=first)
        first = first or runner
        ours = run(runner, items, 1)
        model, eos = runner.engine.target, torch.tensor(runner.eos_ids)
        c0, tokens = time.process_time(), 0
        with torch.inference_mode():
            for item in items:
                ids = torch.tensor([runner.encode_prompt(item["prompt"])])
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                                     max_new_tokens=max_new_tokens, pad_token_id=runner.pad_id,
                                     eos_token_id=runner.eos_ids)
                new = gen[:, ids.shape[1]:]
                is_eos = torch.isin(new, eos)
                tokens += int(torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1]).sum())
        cpu = time.process_time() - c0
        out[f"N = {n}"] = {"engine_tokens": ours["generated_tokens"], "engine_cpu_s": ours["cpu_s"],
                           "engine_tok_per_cpu_s": ours["generated_tokens"] / ours["cpu_s"],
                           "generate_tokens": tokens, "generate_cpu_s": cpu, "generate_tok_per_cpu_s": tokens / cpu,
                           "ratio": (ours["generated_tokens"] / ours["cpu_s"]) / (tokens / cpu), "load": load()}
        print(f"  generate N={n}: {out[f'N = {n}']}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_model", description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--prompts", type=int, default=16, help="instructions (logprob) and concept prompts (lexical)")
    p.add_argument("--per-call", type=int, default=4, help="prompts per Runner.run call (prompts_per_call)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--bon", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--sr", type=int, nargs="+", default=[32, 64])
    p.add_argument("--every", type=int, default=16, help="tokens between decisions of the fixed schedule")
    p.add_argument("--generate", type=int, nargs="+", default=[16, 64], help="N of the engine vs generate()")
    p.add_argument("--generate-prompts", type=int, default=2)
    p.add_argument("--skip-lexical", action="store_true")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the hf engine")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)

    import torch

    import assets

    torch.set_num_threads(args.threads)
    instructions = [it for it in assets.prompt_items("real-prompts") if "concepts" not in it][: args.prompts]
    concepts = assets.prompt_items("real-concepts")[: args.prompts]
    figures: dict = {}
    cols = ["perplexity", "mean_best_reward", "generated_tokens", "cpu_s", "speedup_cpu", "speedup_tokens",
            "matches", "rejection_rounds", "reward_tokens"]
    lex_cols = ["mean_best_reward", "generated_tokens", "cpu_s", "speedup_cpu", "speedup_tokens", "matches",
                "rejection_rounds"]
    for engine in args.engines:  # hf first: the vLLM engine pins this process's threads
        rows = paper_form(sweep(engine, {"kind": "logprob"}, "builtin:real-prompts", instructions, args), args.bon,
                          True)
        figures[f"{engine} logprob"] = rows
        print(table(f"Paper 001's Table 2 on SmolLM2-135M-Instruct, engine {engine}: logprob reward, "
                    f"{len(instructions)} real instructions, {args.max_new_tokens} new tokens, speedups against "
                    f"Best-of-{max(args.bon)}", rows, cols), flush=True)
        if not args.skip_lexical:
            rows = paper_form(sweep(engine, {"kind": "lexical"}, "builtin:real-concepts", concepts, args), args.bon,
                              False)
            figures[f"{engine} lexical"] = rows
            print(table(f"SmolLM2-135M-Instruct, engine {engine}: lexical reward (concept coverage), "
                        f"{len(concepts)} concept prompts", rows, lex_cols), flush=True)
        if engine == "hf" and not args.skip_generate:
            rows = engine_vs_generate(instructions[: args.generate_prompts], args.generate, args.max_new_tokens)
            figures["engine vs generate"] = rows
            print(table("Best-of-N on SmolLM2: the engine (Runner, hf) against generate(num_return_sequences=N), "
                        "generated tokens per CPU-second", rows,
                        ["engine_tok_per_cpu_s", "generate_tok_per_cpu_s", "ratio", "engine_tokens",
                         "generate_tokens"], first="N"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
