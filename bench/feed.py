"""Continuous batching across actor calls (`workers.pool.loop`) against one call at a time: `python -m bench.feed`.

An actor receives its prompts in calls of `resources.prompts_per_call` prompts. Before the loop took two calls it
decoded one call at a time: the call's sequences that finish early leave, and its last ones run alone until the
longest ends. With the feed the actor takes two calls at once and both feed one decoding loop, so the next call's
prompts take the places of the sequences that finish. Both sides here run on one loaded Runner, the same calls in the
same order:

- **one call at a time** (the default, `resources.feed_calls: false`): each call through `Runner.run` from one
  thread, its prompts joining one decoding batch as memory frees, one call after another, as Ray Data calls the actor;
- **two calls, one loop** (`resources.feed_calls: true`): two threads, each taking the next call's prompts and calling
  `Runner.run`, as Ray Data calls an actor with `max_concurrent_calls_per_actor=2`.

Figures: generated tokens, the process's CPU seconds (`time.process_time`, every thread), wall seconds, engine
steps and the mean number of sequences a step decodes, and the ratio feed / one-at-a-time of tokens per CPU-second
and per wall-second (> 1: the feed is cheaper). The sides alternate (`--repeats` times each; the run with the least
CPU time is shown). The texts and finish reasons of every candidate are checked equal between the sides (draws
are keyed per prompt and candidate, the fixed schedule's clock is per prompt).

Models: the bundled tiny trio (it emits EOS, so rows end at mixed lengths by themselves), and a random-init
Llama-shaped target with a 32k vocabulary and its reward model (`bench.engine_scale`'s builders, built at run time
in a temporary folder). Random weights rarely emit EOS, so there every sequence gets a length limit drawn from its
prompt key and candidate index, uniform in [1, max_new_tokens]: the same on both sides.
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
import time
from pathlib import Path

import torch

from workers.decoding.target import TargetSampler
from bench.common import table
from pipeline.preflight import resolved
from schemas.config import validate_config

CASES = {  # model: list of (label, method, prompts, prompts_per_call, max_new_tokens)
    "tiny": [
        ("best_of_n n=16", {"name": "best_of_n", "n": 16}, 32, 4, 96),
        ("SR n=16 k=8", {"name": "speculative_rejection", "n": 16, "alpha": 0.5, "schedule": "fixed",
                         "every_k_tokens": 8}, 32, 4, 96),
    ],
    "llama-32k": [
        ("best_of_n n=16", {"name": "best_of_n", "n": 16}, 8, 2, 128),
    ],
}


class Steps:
    """Counts TargetSampler.step calls and the sequences each decodes."""

    def __init__(self):
        self.steps = self.rows = 0
        step = TargetSampler.step

        def counted(engine, batch):
            self.steps += 1
            self.rows += int(batch.alive.sum())
            return step(engine, batch)

        TargetSampler.step = counted

    def take(self) -> dict:
        out = {"steps": self.steps, "rows_per_step": self.rows / max(self.steps, 1)}
        self.steps = self.rows = 0
        return out


def mixed_lengths(limit: int):
    """Each sequence's length limit drawn from its prompt key and candidate index, uniform in [1, limit]; returns
    what undoes it."""
    prefill = TargetSampler.prefill

    def limited(engine, *args, **kwargs):
        batch = prefill(engine, *args, **kwargs)
        mix = torch.remainder(batch.rng_key * 7919 + batch.cand * 104729, limit) + 1
        batch.limit = torch.minimum(batch.limit, mix)
        return batch

    TargetSampler.prefill = limited

    def undo():
        TargetSampler.prefill = prefill

    return undo


def one_at_a_time(runner, batches: list[list[dict]]) -> list[dict]:
    rows = []
    for b in batches:  # each call decoded alone: the loop drains before the next call comes
        rows += runner.run(b)
    return rows


def two_calls(runner, batches: list[list[dict]]) -> list[dict]:
    todo: queue.Queue = queue.Queue()
    for i, b in enumerate(batches):
        todo.put((i, b))
    out: dict[int, list[dict]] = {}
    errors: list[BaseException] = []

    def actor_thread():
        while True:
            try:
                i, b = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out[i] = runner.run(b)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)
                return

    threads = [threading.Thread(target=actor_thread) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for i in range(len(batches)) for r in out[i]]


def comparable(rows: list[dict]) -> list:
    return [(r["prompt_id"], [(c["text"], c["finish_reason"]) for c in r["candidates"]]) for r in rows]


def measure(fn, runner, batches, steps: Steps) -> tuple[dict, list[dict]]:
    steps.take()
    c0, w0 = time.process_time(), time.perf_counter()
    rows = fn(runner, batches)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    tokens = sum(r["stats"]["generated_tokens"] for r in rows)
    return {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu,
            "tokens_per_wall_s": tokens / wall, **steps.take(),
            "mean_best_reward": sum(r["best_reward"] for r in rows) / len(rows)}, rows


def configs(model: str, folders: dict | None, method: dict, ppb: int, new_tokens: int, feed: bool):
    raw = {
        "name": "bench-feed", "seed": 0,
        "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
        "models": {"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "builtin:tiny-reward"}}
        if folders is None else {"target": str(folders["target"]),
                                 "reward": {"kind": "model", "path": str(folders["reward"])}},
        "method": method,
        "generation": {"max_new_tokens": new_tokens, "temperature": 1.0},
        "output": {"path": "runs/bench-feed"},
        "resources": {"prompts_per_call": ppb, "feed_calls": feed},
    }
    return resolved(validate_config(raw))


def items_for(model: str, count: int, vocab: int | None) -> list[dict]:
    import random

    import assets

    if model == "tiny":
        return assets.demo_prompts(0, count)
    from bench.engine_scale import prompt_text

    rng = random.Random(0)
    return [{"prompt_id": f"p{i}", "prompt": [{"role": "user", "content": prompt_text(32, vocab, rng)}]}
            for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(CASES), help="tiny and/or llama-32k")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from workers.actor.runner import Runner

    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}; cpus {os.cpu_count()}")
    steps = Steps()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-feed-") as tmp:
        for model in args.models:
            folders, vocab = None, None
            if model != "tiny":
                from bench.engine_scale import SHAPES, build_checkpoints

                shape = SHAPES["quick"][model]
                folders, vocab = build_checkpoints(Path(tmp), model, shape, draft=False), shape[1]
            for label, method, count, ppb, new_tokens in CASES[model]:
                undo = mixed_lengths(new_tokens) if model != "tiny" else None
                alone = Runner(configs(model, folders, method, ppb, new_tokens, feed=False))
                fed = Runner(configs(model, folders, method, ppb, new_tokens, feed=True), share=alone)
                items = items_for(model, count, vocab)
                batches = [items[i: i + ppb] for i in range(0, len(items), ppb)]
                alone.run(batches[0])  # warm-up: one-off costs (allocator, kernels) not counted
                best: dict[str, dict] = {}
                rows_of: dict[str, list] = {}
                for _ in range(args.repeats):
                    for side, fn, runner in (("one call at a time", one_at_a_time, alone),
                                             ("two calls, one loop", two_calls, fed)):
                        fig, rows = measure(fn, runner, batches, steps)
                        rows_of[side] = comparable(rows)
                        if side not in best or fig["cpu_s"] < best[side]["cpu_s"]:
                            best[side] = fig
                same = rows_of["one call at a time"] == rows_of["two calls, one loop"]
                a, b = best["one call at a time"], best["two calls, one loop"]
                key = f"{model} {label} ({count} prompts, {ppb} per batch, {new_tokens} new)"
                results[key] = {**{f"alone {k}": v for k, v in a.items()}, **{f"feed {k}": v for k, v in b.items()},
                                "cpu ratio": b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"],
                                "wall ratio": b["tokens_per_wall_s"] / a["tokens_per_wall_s"], "same texts": same}
                print(f"{key}: feed/alone tokens per CPU-s {results[key]['cpu ratio']:.2f}x, per wall-s "
                      f"{results[key]['wall ratio']:.2f}x; rows per step {a['rows_per_step']:.1f} -> "
                      f"{b['rows_per_step']:.1f}; same texts {same}; load {os.getloadavg()}", flush=True)
                if undo is not None:
                    undo()
    cols = ["alone tokens", "alone cpu_s", "alone rows_per_step", "feed cpu_s", "feed rows_per_step",
            "alone steps", "feed steps", "cpu ratio", "wall ratio", "alone mean_best_reward",
            "feed mean_best_reward", "same texts"]
    print(table("One call at a time vs two calls feeding one loop (ratio > 1: the feed is cheaper)", results, cols,
                first="case"))
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
