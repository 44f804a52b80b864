"""What users pay, Speculative Rejection against Best-of-N on a full actor: `python -m bench.bill`.

An actor bills device time. On a device where a decoding step costs about the same at any width (a GPU at these model
sizes), what it bills is its **decoding steps**; where a step's cost grows with its width (a CPU), its **CPU
seconds**; either way the reward model counts. So each side here runs as a job's actor does: every prompt of the
case in one actor call (`Runner.run`), at one width (`models.max_num_seqs`), prompts starting as the width and the
KV space free (`workers.pool.pool.Pool`), and prints, per case:

- **decoding steps** (the actor's batched steps: `stats.decoding_steps` summed) and the mean width; and the
  **reward model's forwards** (`stats.reward_steps` summed): where a forward costs about the same at any width (a
  GPU at these sizes, `--gpus 1`), the reward model bills its forwards as the target bills its steps;
- **FLOPs** of the trio: 2 x parameters x tokens, for the target (prefill and decoding) and the reward model
  (everything it was fed), as `winnow report` counts them (`reporting.cost`);
- **reward tokens per generated token** (generated: every candidate's, rejected ones up to their cut), and beyond
  the prompts: what is left after the least any scorer feeds of them (`reward_prompt_tokens`: each prompt's
  rendering once, the template's head once), which bounds the ratio from below where prompts are long and
  responses short;
- **CPU seconds** of the process (the sides alternate, `--repeats` times, least of each) and wall seconds;
- **the reward matched**: the N whose Best-of-N reaches SR's mean best reward, on Best-of-k's expected reward for
  every k up to n (`best_of_k`, from the Best-of-n run's candidates: the same samples SR's candidates start as),
  and Best-of-N's steps, FLOPs and CPU seconds at that N, linear in N between its runs at n / 4, n / 2 and n:
  SR's figures against Best-of-N's **at the same reward**, and against Best-of-n's. (Until issue 27's last round
  the N came from the three runs' rewards and the costs too were interpolated in log N, which puts more cost on
  Best-of-N between its runs than it has: steps grow in proportion to N.)

Cases (`--cases`):
- ``tiny``: the bundled trio with its reward model, on generated concept prompts of its world
  (`assets.concept_sets`, held out from its training), 48 new tokens (the quickstart's);
- ``smollm2``: SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, the `real` extra) with the `logprob`
  reward (no reward tokens: read from the decoding step), on the bundled real instructions;
- ``smollm2-concepts``: the same on the tiny world's held-out concept prompts ("Write a sentence using these
  concepts: ...", a CommonGen task), of which there are thousands: enough for SmolLM2's prompts to keep the actor
  full, where the 64 real instructions leave Speculative Rejection's last prompts decoding alone at the call's end;
- ``smollm2-rm``: SmolLM2 with a reward model of its own backbone under a seeded head
  (`assets.smollm2.build_seeded_reward`; its scores mean nothing, its cost is a real 135M model's);
- ``smollm2-rm-long``: the same with each instruction repeated to about 512 tokens: a prompt is scored once for its
  candidates, and reward tokens per generated token show what that leaves (the tiny trio's context is 256);
- ``smollm2-rm-long-answers``: the same prompts with 256 new tokens by default (SmolLM2 rambles on them: about
  half its answers reach the limit), where the responses, not the prompts, are most of what the reward model reads;
- ``tiny-prm``, ``smollm2-prm``: the tiny trio's and SmolLM2's cases with a process reward model (`kind: process`)
  on the tiny reward's or SmolLM2's backbone under a seeded two-label head with a ``<step>`` tag (`seeded_prm`; its
  scores mean nothing, its cost is its backbone's), steps split at blank lines.

Each case runs on the engines of `--engines` (hf, vllm; the reward model on transformers) for each n of `--ns`.
`--gpus 1` runs the hf engine on a GPU (wall seconds are then the device's); `--reward-levels K` sets the reward
session's radix-tree levels (a forward each, the reward model's `levels`) to weigh reward forwards against reward
tokens; `--reward-prefix copy` copies every prompt's reward cache into its candidates' (the side that holding it
once, the default, is measured against); `--reward-session whole` scores every decision's candidates whole (the side
a session is measured against; its cases are filed as ``CASE@whole``), and `--reward-session ab` runs Speculative
Rejection alone both ways on one engine, alternating `--repeats` times (``CASE@ab``): the interleaved A/B of the CPU
seconds a session saves. These switches are the reward model's constructor arguments (`RewardModelScorer`:
incremental_sessions, levels, share_prompts), handed to the runners this bench builds (`reward_switches`).
Figures go to stdout as Markdown tables and, with `--json PATH`, to a file (docs/figures/,
from which the docs' tables are rendered). The load average before and after is printed: this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import table, write_json

ROLES = ("target", "draft", "reward")


def concept_items(count: int, seed: int = 0) -> list[dict]:
    """Held-out concept prompts of the tiny world (`assets.concept_sets`): id, prompt, concepts."""
    from assets import concept_sets

    _, heldout = concept_sets.split("tiny-world", 0, count, seed)
    return [{"prompt_id": r["id"], "prompt": [{"role": "user", "content": r["prompt"]}], "concepts": r["concepts"]}
            for r in heldout]


def long_items(items: list[dict], tokens: int, tokenizer) -> list[dict]:
    """`items` with each request repeated until it is about `tokens` tokens long under `tokenizer`."""
    out = []
    for it in items:
        text = it["prompt"][0]["content"]
        unit = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
        long = " ".join([text] * max(1, tokens // unit))
        out.append({**it, "prompt": [{"role": "user", "content": long}]})
    return out


def real_items(count: int) -> list[dict]:
    """The bundled real instructions (`builtin:real-prompts`, no concepts), the first `count`."""
    import assets

    items = [it for it in assets.prompt_items("real-prompts") if not it.get("concepts")]
    if len(items) < count:
        raise SystemExit(f"--prompts {count}: builtin:real-prompts holds {len(items)} instructions")
    return items[:count]


def best_of_k(rows: list[dict], k: int) -> float:
    """Best-of-k's expected mean best reward, from Best-of-n runs' rows (n >= k candidates per prompt): per prompt,
    the expected highest of k of its candidates' rewards drawn without replacement (sum over the sorted rewards
    r_(1) <= ... <= r_(n) of r_(i) C(i - 1, k - 1) / C(n, k)), averaged over the prompts. Exact for Best-of-k under
    the same sampling, with less noise than a run of k candidates (every subset of k counts, not the first)."""
    total = 0.0
    for row in rows:
        rewards = sorted(c["reward"] for c in row["candidates"])
        n = len(rewards)
        total += sum(rewards[i] * math.comb(i, k - 1) for i in range(k - 1, n)) / math.comb(n, k)
    return total / len(rows)


def matched_n(curve: list[float], reward: float) -> float:
    """The N whose Best-of-N reward is `reward`, on `curve` (curve[k - 1]: Best-of-k's), linear between whole N and
    clamped to the curve's ends."""
    if reward <= curve[0]:
        return 1.0
    for k in range(1, len(curve)):
        if curve[k - 1] <= reward <= curve[k]:
            return k + (0.0 if curve[k] == curve[k - 1] else (reward - curve[k - 1]) / (curve[k] - curve[k - 1]))
    return float(len(curve))


def cost_at(ns: list[int], values: list[float], n: float) -> float:
    """A Best-of-N figure (steps, FLOPs, CPU seconds) at N = `n`, linear in N between the runs around it (the first
    or last two runs beyond them): Best-of-N's work grows in proportion to N (the runs' steps do, within a few %)."""
    pts = sorted(zip(ns, values))
    for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
        if n <= n1 or (n1, v1) == pts[-1]:
            return v0 + (n - n0) * (v1 - v0) / (n1 - n0)
    return pts[0][1]


def reward_prompt_tokens(reward_path: str, items: list[dict]) -> int:
    """The least a reward model is fed of the prompts: the template's head once (`template_head`) and the rest of each
    prompt's rendering once (the leading tokens of its encodings with two different responses)."""
    from transformers import AutoTokenizer

    from workers.scoring.items import Scored, reward_input, template_head

    tok = AutoTokenizer.from_pretrained(reward_path)
    head = template_head(tok)
    total = len(head)
    for it in items:
        a, b = (reward_input(tok, Scored(0, it["prompt"], text, [], [])) for text in ("0", "a b"))
        total += len(os.path.commonprefix([a, b])) - len(head)
    return total


class Case:
    """One model set-up: its models, its prompts, and the parameter counts that turn tokens into FLOPs."""

    def __init__(self, name: str, models: dict, items: list[dict], max_new_tokens: int, parameters: dict[str, int]):
        self.name, self.models, self.items, self.max_new_tokens = name, models, items, max_new_tokens
        self.parameters = parameters
        reward = models["reward"]
        self.prompt_tokens = reward_prompt_tokens(reward["path"], items) if reward["kind"] in ("model", "process") \
            else 0

    def config(self, method: dict, engine: str, width: int, out: str, kv_cache_mb: float | None = None,
               gpus: float = 0, dtype: str = "auto"):
        from pipeline.preflight import resolved
        from schemas.config import validate_config

        return resolved(validate_config({
            "name": f"bill-{self.name}", "seed": 0, "data": {"source": "builtin:demo-prompts"},
            "models": {**self.models, "engine": engine, "max_num_seqs": width, "kv_cache_mb": kv_cache_mb,
                       "dtype": dtype},
            "method": method,
            "generation": {"max_new_tokens": self.max_new_tokens, "temperature": 1.0},
            "output": {"path": out},
            "resources": {"prompts_per_call": len(self.items), "gpus_per_actor": gpus},
        }))

    def figures(self, rows: list[dict]) -> dict:
        errors = [r["error"] for r in rows if r["error"] is not None]
        if errors:
            raise SystemExit(f"{self.name}: {len(errors)} error row(s), e.g. {errors[0]}")
        tokens = {r: sum(row["cost"][f"{r}_tokens"] for row in rows) for r in ROLES}
        generated = sum(row["stats"]["generated_tokens"] for row in rows)
        steps = sum(row["stats"]["decoding_steps"] for row in rows)
        reward_forwards = round(sum(row["stats"].get("reward_steps") or 0.0 for row in rows))
        seq_steps = sum(row["stats"]["sequence_steps"] for row in rows)
        # prompt scorings by the reward model's forwards (as the manifest counts them): decisions, and each last
        scorings = sum((row["stats"].get("rejection_rounds") or 0) + 1 for row in rows
                       if row["stats"].get("reward_steps"))
        flops = {r: 2.0 * self.parameters.get(r, 0) * tokens[r] for r in ROLES}
        return {
            "mean_best_reward": sum(r["best_reward"] for r in rows) / len(rows),
            "generated_tokens": generated, "target_tokens": tokens["target"], "reward_tokens": tokens["reward"],
            "reward_per_generated": tokens["reward"] / generated,
            "reward_prompt_tokens": self.prompt_tokens,
            "reward_beyond_prompts_per_generated": (tokens["reward"] - self.prompt_tokens) / generated,
            "decoding_steps": steps, "mean_width": seq_steps / steps, "reward_forwards": reward_forwards,
            "reward_forwards_per_scoring": reward_forwards / scorings if scorings else None,
            "target_gflop": flops["target"] / 1e9, "reward_gflop": flops["reward"] / 1e9,
            "gflop": sum(flops.values()) / 1e9,
        }


def run_side(runner, items: list[dict]) -> tuple[list[dict], float, float]:
    w, c = time.perf_counter(), time.process_time()
    rows = runner.run(items)
    return rows, time.process_time() - c, time.perf_counter() - w


def bench_case(case: Case, engine: str, n: int, width: int, repeats: int, tmp: str,
               kv_cache_mb: float | None = None, gpus: float = 0, dtype: str = "auto",
               switches: dict | None = None, scoring_steps: int | None = None) -> dict:
    """Best-of-N at n / 4, n / 2 and n and Speculative Rejection's minimal config at n (its `scoring_steps` where
    given), on one engine and width, the reward model built with the sessions' `switches`."""
    from workers.actor.runner import Runner

    sides = {f"BoN-{k}": {"name": "best_of_n", "n": k} for k in sorted({max(1, n // 4), max(1, n // 2), n})}
    sides[f"SR-{n}"] = {"name": "speculative_rejection", "n": n, "alpha": 0.5,
                        **({"scoring_steps": scoring_steps} if scoring_steps is not None else {})}
    first = None
    built = {}
    # the engine the sides share is built for the largest n (vLLM's step token budget holds a prompt's candidates)
    for name, method in sorted(sides.items(), key=lambda side: -side[1]["n"]):
        config = case.config(method, engine, width, str(Path(tmp) / "run"), kv_cache_mb, gpus, dtype)
        built[name] = Runner(config, share=first) if first is not None else Runner(config, reward_switches=switches)
        first = first or built[name]
    runners = {name: built[name] for name in sides}  # run in the sides' order
    out: dict[str, dict] = {}
    rows_of: dict[str, list[dict]] = {}
    for _ in range(repeats):  # the sides alternate, so that the machine's load falls on all of them
        for name, runner in runners.items():
            rows, cpu, wall = run_side(runner, case.items)
            rows_of[name] = rows
            fig = case.figures(rows)
            if name in out:
                fig.update(cpu_s=min(cpu, out[name]["cpu_s"]), wall_s=min(wall, out[name]["wall_s"]))
            else:
                fig.update(cpu_s=cpu, wall_s=wall)
            out[name] = fig
            print(f"  {case.name} {engine} n={n} {name}: reward {fig['mean_best_reward']:.4f}, "
                  f"{fig['decoding_steps']:.0f} steps at width {fig['mean_width']:.1f}, "
                  f"{fig['reward_forwards']} reward forwards, {fig['gflop']:.2f} GFLOP, {fig['cpu_s']:.1f} CPU s",
                  flush=True)
    bons = [k for k in out if k.startswith("BoN-")]
    ns = [int(k.split("-")[1]) for k in bons]
    sr, bon_n = out[f"SR-{n}"], out[f"BoN-{n}"]
    curve = [best_of_k(rows_of[f"BoN-{n}"], k) for k in range(1, n + 1)]
    matched = matched_n(curve, sr["mean_best_reward"])
    at = {k: cost_at(ns, [out[b][k] for b in bons], matched) for k in ("decoding_steps", "reward_forwards", "gflop",
                                                                        "cpu_s", "wall_s")}
    at = {k: v for k, v in at.items() if v}
    out["SR / BoN-n"] = {k: sr[k] / bon_n[k] for k in ("decoding_steps", "reward_forwards", "gflop", "target_gflop",
                                                       "cpu_s", "wall_s", "generated_tokens", "reward_tokens")
                         if bon_n[k]}
    out["SR / BoN-n"]["mean_best_reward"] = sr["mean_best_reward"] - bon_n["mean_best_reward"]
    out["SR / BoN at the same reward"] = {"matched_n": matched, **{k: sr[k] / v for k, v in at.items()}}
    out["Best-of-k"] = {"k": list(range(1, n + 1)), "mean_best_reward": curve}
    return out


PRM_TAG = "<step>"


def seeded_prm(out: Path, backbone: Path) -> Path:
    """A process reward model on `backbone` under a seeded two-label head, with PRM_TAG added (built once per run):
    its scores mean nothing, its cost is its backbone's."""
    from assets import smollm2

    return out if out.exists() else smollm2.build_seeded_reward(out, backbone, seed=1, num_labels=2,
                                                                 step_tag=PRM_TAG)


def sessions_ab(case: Case, engine: str, n: int, width: int, repeats: int, tmp: str,
                kv_cache_mb: float | None = None, gpus: float = 0, dtype: str = "auto",
                switches: dict | None = None) -> dict:
    """Speculative Rejection at n, its reward scored whole at every decision and with the reward sessions, on one
    loaded engine (a runner for each side, each with its reward model built with its switch), the two sides
    alternating `repeats` times (least CPU time of each kept): the interleaved A/B of what a session saves in time.
    Each side admits prompts by its own memory plan (the whole side keeps no session caches), which moves no
    prompt's decisions: the rows differ only where float noise in a score moves a cut (said as `same_rows`)."""
    from workers.actor.runner import Runner

    method = {"name": "speculative_rejection", "n": n, "alpha": 0.5}
    config = case.config(method, engine, width, str(Path(tmp) / "run"), kv_cache_mb, gpus, dtype)
    switches = switches or {}
    cached = Runner(config, reward_switches={**switches, "incremental_sessions": True})
    runners = {"whole": Runner(config, engine=cached.engine, reward_switches={**switches,
                                                                             "incremental_sessions": False}),
               "cached": cached}
    out: dict[str, dict] = {}
    kept: dict[str, list] = {}
    for _ in range(repeats):
        for side in ("whole", "cached"):
            rows, cpu, wall = run_side(runners[side], case.items)
            kept[side] = [[(c["text"], c["finish_reason"]) for c in r["candidates"]] for r in rows]
            fig = case.figures(rows)
            fig.update(cpu_s=min(cpu, out.get(side, {}).get("cpu_s", cpu)),
                       wall_s=min(wall, out.get(side, {}).get("wall_s", wall)))
            out[side] = fig
            print(f"  {case.name} {engine} SR-{n} scored {side}: {fig['reward_per_generated']:.2f} reward tokens "
                  f"per generated token, {fig['gflop']:.2f} GFLOP, {cpu:.1f} CPU s", flush=True)
    out["cached / whole"] = {k: out["cached"][k] / out["whole"][k] for k in (
        "cpu_s", "wall_s", "gflop", "reward_gflop", "reward_tokens", "reward_forwards") if out["whole"][k]}
    out["same_rows"] = kept["cached"] == kept["whole"]
    return out


def make_cases(names: list[str], prompts: int, tmp: str, new_tokens: int | None = None) -> list[Case]:
    from runfolder.parameters import count_parameters

    cases = []
    for name in names:
        if name in ("tiny", "tiny-prm"):
            import assets

            target, reward = assets.resolve("builtin:tiny-target"), assets.resolve("builtin:tiny-reward")
            spec = {"kind": "model", "path": reward}
            if name == "tiny-prm":
                spec = {"kind": "process", "path": str(seeded_prm(Path(tmp) / "tiny-prm", Path(reward))),
                        "step_tag": PRM_TAG}
            cases.append(Case(name, {"target": target, "reward": spec}, concept_items(prompts), new_tokens or 48,
                              {"target": count_parameters(target), "reward": count_parameters(spec["path"])}))
        elif name in ("smollm2", "smollm2-concepts", "smollm2-rm", "smollm2-rm-long", "smollm2-rm-long-answers",
                      "smollm2-prm"):
            from assets import smollm2

            target = smollm2.ensure()
            models: dict = {"target": str(target), "reward": {"kind": "logprob"}}
            parameters = {"target": count_parameters(str(target))}
            items = concept_items(prompts) if name == "smollm2-concepts" else real_items(prompts)
            if name == "smollm2-prm":
                reward = seeded_prm(Path(tmp) / "smollm2-prm", target)
                models["reward"] = {"kind": "process", "path": str(reward), "step_tag": PRM_TAG}
                parameters["reward"] = count_parameters(str(reward))
            elif name not in ("smollm2", "smollm2-concepts"):
                reward = Path(tmp) / "smollm2-reward"
                if not reward.exists():
                    smollm2.build_seeded_reward(reward, target)
                models["reward"] = {"kind": "model", "path": str(reward)}
                parameters["reward"] = count_parameters(str(reward))
            if name.startswith("smollm2-rm-long"):
                from transformers import AutoTokenizer

                items = long_items(items, 512, AutoTokenizer.from_pretrained(target))
            default = 256 if name == "smollm2-rm-long-answers" else 64
            cases.append(Case(name, models, items, new_tokens or default, parameters))
        else:
            raise SystemExit(f"--cases: unknown case {name!r}")
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="tiny", help="comma-separated: tiny, tiny-prm, smollm2, smollm2-concepts, "
                    "smollm2-rm, smollm2-rm-long, smollm2-rm-long-answers, smollm2-prm")
    ap.add_argument("--engines", default="hf", help="comma-separated: hf, vllm")
    ap.add_argument("--ns", default="32,128", help="Speculative Rejection's n (Best-of-N runs at n/4, n/2, n)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts, all in one actor call")
    ap.add_argument("--width", type=int, default=256, help="models.max_num_seqs: sequences per decoding step")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating (least CPU time kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (hf engine)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generation.max_new_tokens (default: the case's)")
    ap.add_argument("--kv-cache-mb", type=float, default=None, help="models.kv_cache_mb (default: the engine's)")
    ap.add_argument("--gpus", type=float, default=0, help="resources.gpus_per_actor (1: the hf engine on a GPU, "
                    "where wall seconds are the device's)")
    ap.add_argument("--dtype", default="auto", help="models.dtype")
    ap.add_argument("--reward-levels", type=int, default=None,
                    help="levels of the fresh candidates' radix tree in the reward session (workers.scoring."
                         "reward_session.CachedScoring's levels; a forward each): fewer forwards, more reward tokens")
    ap.add_argument("--reward-prefix", choices=("rule", "copy"), default="rule",
                    help="rule: the reward session holds a prompt's prefix once where its copies would take 4 MiB or "
                         "more (workers.scoring.reward_session.CachedScoring's share_prompts); copy: in every "
                         "candidate's "
                         "cache, as before")
    ap.add_argument("--reward-session", choices=("cached", "whole", "ab"), default="cached",
                    help="cached: a causal reward model or PRM keeps each candidate's cache between decisions; whole: "
                         "every decision scores its candidates whole (workers.scoring.reward_model.RewardModelScorer's "
                         "incremental_sessions), the side a session is measured against; ab: Speculative Rejection "
                         "alone, the two alternating --repeats times on one engine (`sessions_ab`)")
    ap.add_argument("--scoring-steps", type=int, default=None,
                    help="Speculative Rejection's method.scoring_steps (default: its config's default)")
    ap.add_argument("--json", help="also write every figure to this file (its cases are added to those it holds)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    return run_cases(args)


def reward_switches(args: argparse.Namespace) -> dict:
    """The reward model's session switches of the flags (`RewardModelScorer`'s constructor arguments)."""
    switches: dict = {"incremental_sessions": args.reward_session != "whole"}
    if args.reward_levels is not None:
        switches["levels"] = args.reward_levels
    if args.reward_prefix == "copy":
        switches["share_prompts"] = False
    return switches


def run_cases(args: argparse.Namespace) -> int:
    """Every case, engine and n of `args`, printed and filed (`--json`)."""
    device = torch.cuda.get_device_name() if args.gpus and torch.cuda.is_available() else "cpu"
    load = os.getloadavg()
    out: dict = {"prompts": args.prompts, "width": args.width, "threads": args.threads, "load_before": load,
                 "cases": {}}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-bill-") as tmp:
        for case in make_cases(args.cases.split(","), args.prompts, tmp, args.new_tokens):
            for engine in args.engines.split(","):
                for n in (int(x) for x in args.ns.split(",")):
                    width = max(args.width, n)
                    if args.reward_session == "ab":
                        got = sessions_ab(case, engine, n, width, args.repeats, tmp, args.kv_cache_mb, args.gpus,
                                          args.dtype, reward_switches(args))
                        print(table(f"{case.name}, engine {engine}, SR n = {n}, width {width}, {len(case.items)} "
                                    f"prompts, reward scored whole and with sessions, alternating {args.repeats}x",
                                    {k: got[k] for k in ("whole", "cached", "cached / whole")},
                                    ["reward_tokens", "reward_per_generated", "reward_forwards", "gflop", "cpu_s",
                                     "wall_s"], first="side") + f"\nsame rows: {got['same_rows']}", flush=True)
                        got["setup"] = {"prompts": len(case.items), "width": width, "new_tokens": case.max_new_tokens,
                                        "repeats": args.repeats, "load": os.getloadavg(), "threads": args.threads}
                        out["cases"][f"{case.name}@ab {engine} n={n}"] = got
                        continue
                    got = bench_case(case, engine, n, width, args.repeats, tmp, args.kv_cache_mb, args.gpus,
                                     args.dtype, reward_switches(args), args.scoring_steps)
                    shown = {k: v for k, v in got.items() if k != "Best-of-k"}
                    print(table(f"{case.name}, engine {engine}, n = {n}, width {width}, {len(case.items)} prompts",
                                shown, ["mean_best_reward", "decoding_steps", "mean_width", "reward_forwards",
                                        "reward_forwards_per_scoring", "gflop", "reward_gflop",
                                      "reward_per_generated", "generated_tokens", "cpu_s", "wall_s", "matched_n"],
                                first="side"), flush=True)
                    got["setup"] = {"prompts": len(case.items), "width": width, "new_tokens": case.max_new_tokens,
                                    "repeats": args.repeats, "load": os.getloadavg(), "gpus": args.gpus,
                                    "dtype": args.dtype, "device": device, "reward_levels": args.reward_levels,
                                    "reward_prefix": args.reward_prefix, "reward_session": args.reward_session,
                                    "scoring_steps": args.scoring_steps}
                    name = case.name if args.reward_session == "cached" else f"{case.name}@whole"
                    out["cases"][f"{name} {engine} n={n}"] = got
    out["load_after"] = os.getloadavg()
    print(f"\nload average {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}")
    if args.json:
        if Path(args.json).exists():  # one file for every case: a run adds its cases, replacing those of the same name
            out["cases"] = {**json.loads(Path(args.json).read_text())["cases"], **out["cases"]}
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
