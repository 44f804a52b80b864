"""The engine's decoding step against `generate()`, on this code and on an earlier commit: `python -m
bench.step_lead [--rev c299690]`.

A random-init Llama of 55M parameters with a 32k vocabulary (`bench.engine_scale`'s llama-32k quick shape: hidden
512, 8 layers, GQA 8/2), Best-of-64, 64 new tokens, 2 prompts, one per call, one torch thread, a python reward that
costs nothing (so only decoding is timed): the engine's path (`Runner.run`) against
``model.generate(do_sample=True, top_k=0, num_return_sequences=64, min_new_tokens=64)`` on the same model. Each code
(this checkout, and with ``--rev`` an earlier commit checked out in a temporary git worktree) runs in a process of its
own, the two sides alternating ``--repeats`` times; the figure is the engine's lead, generated tokens per CPU-second
of the engine over generate's (> 1: the engine is cheaper), from the sums of each side's CPU seconds. CPU time of the
process (every thread) is steadier than wall-clock on a shared machine; the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent

# Run inside the code under test (its own packages first on sys.path): argv = CODE MODEL REPEATS.
SIDE = r'''
import json, os, sys, time
code, model, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, code)
os.chdir(code)
import torch
torch.set_num_threads(1)
from pipeline.preflight import resolved
from schemas.config import validate_config
try:
    from workers.actor.runner import Runner
except ImportError:  # the layout of earlier commits
    from workers.runner import Runner
mod = type(sys)("step_lead_reward")
mod.score = lambda prompts, texts: [0.0] * len(texts)
sys.modules["step_lead_reward"] = mod
cfg = {"name": "step-lead", "seed": 0, "data": {"source": "builtin:demo-prompts"},
       "models": {"target": model, "reward": {"kind": "python", "function": "step_lead_reward:score"}},
       "method": {"name": "best_of_n", "n": 64}, "generation": {"max_new_tokens": 64, "temperature": 1.0},
       "output": {"path": "unused"}, "resources": {"prompts_per_call": 1}}
runner = Runner(resolved(validate_config(cfg)))
target = runner.engine.target if hasattr(runner, "engine") else runner.target
words = ["a", "b", "c", "d"]
items = [{"prompt_id": f"p{i}", "prompt": [{"role": "user", "content": " ".join(words[j % 4] * 2 for j in
                                                                                 range(16 + i))}]} for i in range(2)]
runner.run(items[:1])  # the first call pays one-off costs
out = {"engine": [], "generate": []}
for _ in range(repeats):
    c = time.process_time()
    rows = [row for it in items for row in runner.run([it])]
    out["engine"].append([time.process_time() - c, sum(r["stats"]["generated_tokens"] for r in rows)])
    c, tokens = time.process_time(), 0
    with torch.inference_mode():
        for it in items:
            ids = torch.tensor([runner.encode_prompt(it["prompt"])])
            g = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=64,
                                min_new_tokens=64, num_return_sequences=64, pad_token_id=runner.pad_id)
            tokens += (g.shape[1] - ids.shape[1]) * 64
    out["generate"].append([time.process_time() - c, tokens])
print("STEP-LEAD " + json.dumps(out))
'''


def measure(code: Path, model: Path, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-c", SIDE, str(code), str(model), str(repeats)], capture_output=True,
                          text=True, env=env, timeout=7200)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("STEP-LEAD ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{code}: the side failed ({done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(line.removeprefix("STEP-LEAD "))
    cpu = {side: sum(c for c, _ in runs) for side, runs in got.items()}
    tokens = {side: sum(t for _, t in runs) for side, runs in got.items()}
    return {"engine_cpu_s": cpu["engine"], "generate_cpu_s": cpu["generate"],
            "lead": (tokens["engine"] / cpu["engine"]) / (tokens["generate"] / cpu["generate"]), "runs": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default=None, help="also measure this earlier commit (a git worktree of it)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    from bench.engine_scale import SHAPES, build_checkpoints

    out: dict = {"load_before": os.getloadavg(), "codes": {}}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-step-lead-") as tmp:
        model = build_checkpoints(Path(tmp), "llama-32k", SHAPES["quick"]["llama-32k"], draft=False)["target"]
        codes = {"this checkout": ROOT}
        if args.rev:
            tree = Path(tmp) / "rev"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.rev], cwd=ROOT, check=True,
                           capture_output=True)
            codes[args.rev] = tree
        try:
            for name, code in codes.items():
                out["codes"][name] = measure(code, model, args.repeats)
                f = out["codes"][name]
                print(f"{name}: engine {f['engine_cpu_s']:.1f} CPU-s, generate {f['generate_cpu_s']:.1f} CPU-s, "
                      f"lead {f['lead']:.2f}x", flush=True)
        finally:
            if args.rev:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "rev")], cwd=ROOT,
                               capture_output=True)
    out["load_after"] = os.getloadavg()
    print(f"load average {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
