"""The target's decoding step in static shapes against the dynamic step, on the CPU: `python -m bench.static_step`.

`models.decode_step` picks the step. On a GPU the static step is captured in CUDA graphs (`bench.gpu_check` measures
it there); on the CPU nothing is captured, and what is left is the static step's shapes: fixed storage, a prepared 4D
mask, and attention over a bucket's spare rows and columns. This bench measures whether that is faster on the CPU.

Each case runs one method through the job's own path (`Runner.run`, every prompt in one actor call) on two runners
that differ only in models.decode_step, each with its own copy of the models. The sides alternate `--repeats` times;
the least CPU seconds of the process (`time.process_time`, every thread) of each side are kept, with the wall
seconds and the load average before and after. The rows of both sides are compared (texts and finish reasons).

Cases (`--cases`):
- ``tiny-bon``: the bundled tiny trio, Best-of-16 on 32 demo prompts, 48 new tokens (prompts join as rows end);
- ``tiny-sr``: the same with Speculative Rejection (n = 16, alpha 0.5): rows dropped at every decision;
- ``smollm2-shape``: a random-init Llama of SmolLM2-135M's shape (`bench.gpu`'s), Best-of-16 on 2 prompts of 128
  random words, 64 new tokens (random weights emit no EOS: every row runs to the limit).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import BASE, table, write_json

CASES = ("tiny-bon", "tiny-sr", "smollm2-shape")


def case_setup(name: str, tmp: Path) -> tuple[dict, list[dict]]:
    """(config dict, items) of a case."""
    import assets

    if name in ("tiny-bon", "tiny-sr"):
        method = {"name": "best_of_n", "n": 16} if name == "tiny-bon" else \
            {"name": "speculative_rejection", "n": 16, "alpha": 0.5}
        raw = {**BASE, "models": {"target": "builtin:tiny-target",
                                  "reward": {"kind": "model", "path": "builtin:tiny-reward"}},
               "method": method, "resources": {"prompts_per_batch": 32}}
        return raw, assets.demo_prompts(0, 32)
    if name == "smollm2-shape":
        from bench.engine_scale import build_checkpoints, prompt_text
        from bench.gpu import SMOLLM2

        folders = build_checkpoints(tmp, "smollm2-shape", SMOLLM2, draft=False)
        rng = random.Random(0)
        items = [{"prompt_id": f"p{i}", "prompt": [{"role": "user", "content": prompt_text(128, SMOLLM2[1], rng)}]}
                 for i in range(2)]
        raw = {**BASE, "models": {"target": str(folders["target"]), "reward": {"kind": "logprob"}},
               "method": {"name": "best_of_n", "n": 16},
               "generation": {**BASE["generation"], "max_new_tokens": 64}}
        return raw, items
    raise SystemExit(f"--cases: unknown case {name!r} (one of {', '.join(CASES)})")


def run_case(name: str, repeats: int, tmp: Path) -> dict:
    from pipeline.preflight import resolved
    from schemas.config import validate_config
    from workers.actor.runner import Runner

    raw, items = case_setup(name, tmp)
    runners = {step: Runner(resolved(validate_config({**raw, "models": {**raw["models"], "decode_step": step}})))
               for step in ("dynamic", "static")}
    out: dict = {}
    rows_of: dict = {}
    for _ in range(repeats):
        for step, runner in runners.items():
            w, c = time.perf_counter(), time.process_time()
            rows = runner.run(items)
            cpu, wall = time.process_time() - c, time.perf_counter() - w
            errors = [r["error"] for r in rows if r["error"] is not None]
            if errors:
                raise SystemExit(f"{name} {step}: {len(errors)} error row(s), e.g. {errors[0]}")
            rows_of[step] = [[(c["text"], c["finish_reason"]) for c in r["candidates"]] for r in rows]
            tokens = sum(r["stats"]["generated_tokens"] for r in rows)
            got = out.setdefault(step, {"cpu_s": cpu, "wall_s": wall, "runs_cpu_s": []})
            got.update(cpu_s=min(cpu, got["cpu_s"]), wall_s=min(wall, got["wall_s"]), tokens=tokens,
                       steps=sum(r["stats"]["decoding_steps"] for r in rows))
            got["runs_cpu_s"].append(cpu)
            print(f"  {name} {step}: {tokens} tokens, {cpu:.2f} CPU s, {wall:.2f} s", flush=True)
    for got in out.values():
        got["tok_per_cpu_s"] = got["tokens"] / got["cpu_s"]
    out["static / dynamic"] = {"cpu_s": out["static"]["cpu_s"] / out["dynamic"]["cpu_s"],
                               "wall_s": out["static"]["wall_s"] / out["dynamic"]["wall_s"]}
    out["same_rows"] = rows_of["static"] == rows_of["dynamic"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (least CPU time kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict = {"threads": args.threads, "repeats": args.repeats, "load_before": os.getloadavg(),
                 "torch": torch.__version__, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-static-") as tmp:
        for name in args.cases.split(","):
            out["cases"][name] = run_case(name, args.repeats, Path(tmp))
    out["load_after"] = os.getloadavg()
    print(table(f"static step / dynamic step on the CPU, {args.threads} thread(s), least of {args.repeats}", {
        name: {"dynamic CPU s": c["dynamic"]["cpu_s"], "static CPU s": c["static"]["cpu_s"],
               "static / dynamic": c["static / dynamic"]["cpu_s"], "same rows": c["same_rows"]}
        for name, c in out["cases"].items()}, ["dynamic CPU s", "static CPU s", "static / dynamic", "same rows"],
        first="case"))
    print(f"\nload average {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
