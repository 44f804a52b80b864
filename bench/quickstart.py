"""The quickstart against Best-of-32 as a user runs them, interleaved: `python -m bench.quickstart`.

Runs `winnow generate configs/quickstart.yaml` (Speculative Rejection, n = 32, its minimal config) and `winnow
generate configs/best_of_n.yaml` (Best-of-32 on the same 16 prompts) through the CLI, one after the other, `--pairs`
times (A B, B A, A B, ...: the machine's load falls on both alike), each into a fresh run folder, and reads each
run's manifest: mean best reward, generated tokens, the tokens each model processed and the FLOPs of the trio
(2 x parameters x tokens, as `winnow report` counts them), decoding steps and mean width, and device-seconds. Prints
the ratios SR / Best-of-32, device-seconds as the ratio of their sums over the pairs, and the summary table the
quickstart printed (the README's first-run output). `--json PATH` writes every figure (docs/figures/quickstart.json,
from which the README's tables are rendered: `python -m bench.figures --write`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import table, write_json

ROOT = Path(__file__).resolve().parent.parent
SIDES = {"sr": "configs/quickstart.yaml", "bon": "configs/best_of_n.yaml"}
ROLES = ("target", "draft", "reward")


def run(config: str, out: Path) -> tuple[dict, str]:
    """One `winnow generate` of `config` into `out`: its manifest and what it printed."""
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "generate", config, "--set", f"output.path={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"winnow generate {config} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "manifest.json").read_text()), done.stdout


def figures(manifest: dict, wall: float) -> dict:
    cost, params = manifest["cost"], manifest["parameters"] or {}
    flops = sum(2.0 * (params.get(r) or 0) * cost[f"{r}_tokens"] for r in ROLES)
    rows = manifest["rows"]
    return {
        "mean_best_reward": manifest.get("mean_best_reward"), "generated_tokens": manifest["generated_tokens"],
        "target_tokens": cost["target_tokens"], "reward_tokens": cost["reward_tokens"],
        "reward_per_generated": cost["reward_tokens"] / manifest["generated_tokens"],
        "gflop_per_prompt": flops / 1e9 / rows, "decoding_steps": manifest["decoding_steps"],
        "mean_width": manifest["mean_width"], "device_s": cost["device_seconds"], "wall_s": wall,
        "candidates": manifest["candidates"], "rejected": manifest["rejected"],
    }


def best_rewards(out: Path) -> dict[str, float]:
    """Each prompt's best reward in a run folder."""
    import pyarrow.dataset as pads

    table = pads.dataset(out / "candidates", format="parquet").to_table(columns=["prompt_id", "best_reward"])
    return dict(zip(table.column("prompt_id").to_pylist(), table.column("best_reward").to_pylist()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2, help="runs of each side, interleaved")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    runs: dict[str, list[dict]] = {"sr": [], "bon": []}
    printed, rewards = {}, {}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-quickstart-") as tmp:
        for i in range(args.pairs):
            for side in (("sr", "bon") if i % 2 == 0 else ("bon", "sr")):
                out = Path(tmp) / f"{side}-{i}"
                t0 = time.perf_counter()
                manifest, stdout = run(SIDES[side], out)
                fig = figures(manifest, time.perf_counter() - t0)
                rewards[side] = best_rewards(out)
                fig["mean_best_reward"] = sum(rewards[side].values()) / len(rewards[side])
                runs[side].append(fig)
                printed.setdefault(side, stdout)
                print(f"  {side} #{i}: {fig['device_s']:.2f} device-s, {fig['decoding_steps']:.0f} steps, "
                      f"reward {fig['mean_best_reward']:.4f}", flush=True)
    sr, bon = runs["sr"][0], runs["bon"][0]  # the same in every pair but the seconds (a run is its config)
    device = {side: sum(f["device_s"] for f in runs[side]) for side in runs}
    ratio = {k: sr[k] / bon[k] for k in ("generated_tokens", "reward_tokens", "gflop_per_prompt", "decoding_steps")}
    ratio["device_s"] = device["sr"] / device["bon"]
    ratio["mean_best_reward"] = sr["mean_best_reward"] - bon["mean_best_reward"]
    # the difference of the two runs' rewards, prompt by prompt, with the report's paired bootstrap interval
    import numpy as np

    from reporting.stats import bootstrap_intervals

    ids = sorted(rewards["sr"])
    diff = np.asarray([[rewards["sr"][i] - rewards["bon"][i] for i in ids]])
    ratio["reward_difference_95"] = [float(v) for v in bootstrap_intervals(diff)[0]]
    out = {"pairs": args.pairs, "load_before": load, "load_after": os.getloadavg(),
           "sr": {**sr, "device_s": device["sr"] / args.pairs}, "bon": {**bon, "device_s": device["bon"] / args.pairs},
           "sr_over_bon": ratio, "device_s_pairs": {s: [f["device_s"] for f in runs[s]] for s in runs},
           "quickstart_summary": [line for line in printed["sr"].splitlines() if line.startswith("|")]}
    cols = ["mean_best_reward", "generated_tokens", "reward_tokens", "reward_per_generated", "gflop_per_prompt",
            "decoding_steps", "mean_width", "device_s"]
    print(table(f"quickstart (SR n=32) vs Best-of-32, {args.pairs} interleaved pairs (device_s: mean)",
                {"SR n=32": out["sr"], "Best-of-32": out["bon"], "SR / Best-of-32": ratio}, cols, first="run"))
    print(f"\nload average {load[0]:.1f} -> {out['load_after'][0]:.1f}\n\nthe quickstart printed:\n{printed['sr']}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
