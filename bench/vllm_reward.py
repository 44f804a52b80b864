"""The reward model on vLLM against transformers, under Speculative Rejection on SmolLM2: `python -m bench.vllm_reward`.

SmolLM2-135M-Instruct decodes (`builtin:smollm2-135m-instruct`, the `real` extra; on the vllm engine, or the hf engine
with `--target-engine hf`) and a reward model
of its backbone under a seeded scalar head (`assets.smollm2.build_seeded_reward`: its scores mean nothing, and they
are the same function under both reward engines) scores Speculative Rejection's decisions and final rewards:
once with `models.reward.engine: hf` (transformers, the session that keeps each candidate's cache and feeds exactly
what it added) and once with `vllm` (a pooling engine with prefix caching, in whole KV blocks of 32 tokens on the
CPU), on the same real instructions, `--per-call` prompts per Runner call. Figures per side: reward tokens (what each
computed; and, once, the tokens of the whole inputs given to vLLM, what re-scoring whole responses at every decision
would feed), the scoring's own CPU and wall seconds (the pool's scoring calls, timed), the process's CPU seconds (vLLM
runs in it) and wall seconds; and whether the rows are the same (candidates, answer, best reward within 1e-3).

The sides run once each, transformers first: once vLLM's CPU worker exists it pins the process's threads (with the
target on vLLM it exists for both). The load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import table


class Timed:
    """Wall and CPU seconds spent in the candidate pool's scoring calls (`Pool._score`), while inside `with`."""

    def __enter__(self) -> "Timed":
        from workers.pool.pool import Pool

        self.wall = self.cpu = 0.0
        self.score = score = Pool._score
        timer = self

        def timed(pool, *a, **kw):
            w, c = time.perf_counter(), time.process_time()
            try:
                return score(pool, *a, **kw)
            finally:
                timer.wall += time.perf_counter() - w
                timer.cpu += time.process_time() - c

        Pool._score = timed
        return self

    def __exit__(self, *exc) -> None:
        from workers.pool.pool import Pool

        Pool._score = self.score

    def take(self) -> tuple[float, float]:
        out = (self.wall, self.cpu)
        self.wall = self.cpu = 0.0
        return out


class Fed:
    """Tokens of the whole reward inputs given to the vLLM reward engine (`VllmRewardScorer.inputs`) while inside
    `with`: what re-scoring whole responses would feed at every decision, before vLLM's prefix cache."""

    def __enter__(self) -> "Fed":
        from workers.scoring.vllm_reward import VllmRewardScorer

        self.tokens = 0
        self.inputs = inputs = VllmRewardScorer.inputs
        fed = self

        def counted(scorer, *a, **kw):
            got = inputs(scorer, *a, **kw)
            fed.tokens += sum(len(ids) for ids in got)
            return got

        VllmRewardScorer.inputs = counted
        return self

    def __exit__(self, *exc) -> None:
        from workers.scoring.vllm_reward import VllmRewardScorer

        VllmRewardScorer.inputs = self.inputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="bundled real instructions")
    ap.add_argument("--per-call", type=int, default=4)
    ap.add_argument("--n", type=int, default=16, help="Speculative Rejection's n")
    ap.add_argument("--every", type=int, default=16, help="tokens between decisions (fixed schedule)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--target-engine", choices=["vllm", "hf"], default="vllm",
                    help="what decodes SmolLM2 (models.engine), the same on both sides")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the hf engine")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    import assets
    from assets import smollm2
    from pipeline.preflight import resolved
    from schemas.config import validate_config
    from workers.actor.runner import Runner

    torch.set_num_threads(args.threads)
    items = assets.prompt_items("real-prompts")[: args.prompts]
    out: dict = {"target_engine": args.target_engine, "prompts": len(items), "n": args.n, "every_k_tokens": args.every,
                 "max_new_tokens": args.max_new_tokens, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-vllm-reward-") as tmp, Timed() as timer, Fed() as fed:
        target = smollm2.ensure()
        reward = smollm2.build_seeded_reward(Path(tmp) / "reward", target)
        rows: dict[str, list[dict]] = {}
        for engine in ("hf", "vllm"):
            config = resolved(validate_config({
                "name": "bench-vllm-reward", "seed": 0,
                "data": {"source": "builtin:real-prompts"},
                "models": {"target": str(target), "engine": args.target_engine,
                           "reward": {"kind": "model", "path": str(reward), "engine": engine}},
                "method": {"name": "speculative_rejection", "n": args.n, "alpha": 0.5, "schedule": "fixed",
                           "every_k_tokens": args.every},
                "generation": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
                "output": {"path": str(Path(tmp) / "run")},
            }))
            runner = Runner(config)  # loading is not timed
            timer.take()
            w, c = time.perf_counter(), time.process_time()
            got = []
            for i in range(0, len(items), args.per_call):
                got += runner.run(items[i: i + args.per_call])
            wall, cpu = time.perf_counter() - w, time.process_time() - c
            score_wall, score_cpu = timer.take()
            assert all(r["error"] is None for r in got), [r["error"] for r in got]
            rows[engine] = got
            generated = sum(c["num_tokens"] for r in got for c in r["candidates"])
            out[engine] = {"reward_tokens": sum(r["cost"]["reward_tokens"] for r in got),
                           "generated_tokens": generated,
                           "scoring_wall_s": score_wall, "scoring_cpu_s": score_cpu, "wall_s": wall, "cpu_s": cpu,
                           "rejection_rounds": sum(r["stats"]["rejection_rounds"] for r in got),
                           "mean_best_reward": sum(r["best_reward"] for r in got) / len(got)}
            out[engine]["reward_per_generated"] = out[engine]["reward_tokens"] / generated
            print(f"{engine}: {out[engine]}", flush=True)
        # the whole inputs of every decision and final score (the same candidates on both sides, when the rows are)
        out["whole_rescoring"] = {"reward_tokens": fed.tokens, "generated_tokens": out["vllm"]["generated_tokens"],
                                  "reward_per_generated": fed.tokens / out["vllm"]["generated_tokens"]}
    same = all([c["text"] for c in a["candidates"]] == [c["text"] for c in b["candidates"]]
               and a["best_index"] == b["best_index"]
               and abs(a["best_reward"] - b["best_reward"]) <= 1e-3 * max(1.0, abs(b["best_reward"]))
               for a, b in zip(rows["vllm"], rows["hf"]))
    out["same_rows"] = same
    out["load_after"] = os.getloadavg()
    hf, vl = out["hf"], out["vllm"]
    print(f"\nSmolLM2 on the {args.target_engine} engine, SR n={args.n} alpha 0.5, a decision every {args.every} tokens, {len(items)} instructions, "
          f"{args.max_new_tokens} new tokens; load average {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}")
    print(table("reward engine: transformers vs vLLM", {
        "hf (transformers session)": hf, "vllm (pooling, prefix cache)": vl,
        "vllm / hf": {k: vl[k] / hf[k] for k in ("reward_tokens", "scoring_wall_s", "scoring_cpu_s", "wall_s",
                                                  "cpu_s") if hf[k]}},
        ["reward_tokens", "scoring_wall_s", "scoring_cpu_s", "wall_s", "cpu_s", "rejection_rounds",
         "mean_best_reward"], first="side"))
    whole = out["whole_rescoring"]
    print(table("reward tokens per generated token", {
        "whole responses re-scored at every decision": whole, "hf (transformers session)": hf,
        "vllm (pooling, prefix cache)": vl}, ["reward_tokens", "generated_tokens", "reward_per_generated"],
        first="scoring"))
    print(f"\nvLLM's prefix cache fed {vl['reward_tokens'] / whole['reward_tokens']:.2f} of the whole inputs' tokens")
    print(f"\nthe same rows on both (candidates, answer, best reward within 1e-3): {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
