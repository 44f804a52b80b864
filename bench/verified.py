"""What a verified answer costs, on a real model: `python -m bench.verified`.

SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, the `real` extra) answers the project's arithmetic word
problems (`builtin:word-problems`) under `configs/word-problems.yaml`: the math verifier, and the response's mean
log-probability as the ranker. Four methods run through the CLI, as a user runs them, each into its own run folder:

- ``greedy``: one response per prompt;
- ``best-of-n``: n samples, the answer the best-ranked verified one;
- ``stop-after-1``: the same, a prompt stopped once one candidate verified (`method.stop_after_verified: 1`);
- ``speculative-rejection``: n candidates, decisions on the ranker's partial scores, the finished ones verified.

Then `winnow report` reads the four runs. Per method the bench prints, and with `--json PATH` writes: verified prompts
and the verified rate with its interval, mean pass@1 (where no candidate was cut), generated tokens, decoding steps,
reward-model forwards (none: the ranker is read while decoding), FLOPs, device-seconds, and the cost of a pass (USD
and FLOPs per verified prompt, with intervals), as the report gives them. Device-seconds are wall time on a shared
CPU: the load average before and after is printed and filed.

Each figure's command is the one printed for its run (`winnow generate configs/word-problems.yaml --set ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "word-problems.yaml"


def methods(n: int) -> dict[str, str]:
    """label -> the method section, as a --set value."""
    return {
        "greedy": "{name: greedy}",
        "best-of-n": f"{{name: best_of_n, n: {n}}}",
        "stop-after-1": f"{{name: best_of_n, n: {n}, stop_after_verified: 1}}",
        "speculative-rejection": f"{{name: speculative_rejection, n: {n}}}",
    }


def winnow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True)


def generate(label: str, method: str, folder: Path, prompts: int, new_tokens: int) -> tuple[Path, list[str]]:
    """One method's run folder, through `winnow generate` (exits on failure, printing its stderr)."""
    run = folder / label
    argv = ["generate", str(CONFIG.relative_to(ROOT)), "--set", f"method={method}", "--set", f"data.limit={prompts}",
            "--set", f"generation.max_new_tokens={new_tokens}"]
    got = winnow(*argv, "--set", f"output.path={run}", "--no-progress")
    if got.returncode != 0:
        sys.exit(f"bench.verified: {label} failed ({got.returncode}):\n{got.stderr[-3000:]}")
    return run, ["winnow", *argv]


def totals(run: Path) -> dict:
    """Generated tokens, decoding steps and reward forwards summed over the run's rows."""
    from runfolder.runs import load_run

    rows = [r for r in load_run(str(run)).rows if r["error"] is None]
    stat = lambda key: sum((r["stats"] or {}).get(key) or 0 for r in rows)  # noqa: E731
    return {"generated_tokens": int(stat("generated_tokens")), "decoding_steps": round(stat("decoding_steps"), 1),
            "reward_forwards": round(stat("reward_steps"), 1),
            "device_seconds": round(sum(r["cost"]["device_seconds"] for r in rows), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.verified", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64, help="word problems (the first P of builtin:word-problems)")
    p.add_argument("--n", type=int, default=8, help="candidates per prompt of the three sampling methods")
    p.add_argument("--new-tokens", type=int, default=96, help="generation.max_new_tokens")
    p.add_argument("--json", help="write the figures here (docs/figures/verified.json renders docs/verifiers.md)")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-verified-") as tmp:
        folder = Path(tmp)
        runs, commands = {}, {}
        for label, method in methods(args.n).items():
            print(f"bench.verified: {label} ...", flush=True)
            runs[label], commands[label] = generate(label, method, folder, args.prompts, args.new_tokens)
        report = folder / "report"
        got = winnow("report", *map(str, runs.values()), "--out", str(report), "--baseline", str(runs["best-of-n"]))
        if got.returncode != 0:
            sys.exit(f"bench.verified: winnow report failed ({got.returncode}):\n{got.stderr[-3000:]}")
        entries = {Path(e["path"]).name: e for e in json.loads((report / "report.json").read_text())["runs"]}
        figures = {}
        for label, run in runs.items():
            e = entries[label]
            v = e["verified"]
            figures[label] = {**totals(run), "prompts": v["prompts_ran"], "verified_prompts": v["verified_prompts"],
                              "verified_rate": v["verified_rate"], "verified_rate_interval": v["verified_rate_interval"],
                              "pass_at_1": v["pass_at_1"], "cost_of_a_pass": v["cost_of_a_pass"],
                              "gflop_per_prompt": None if e["flops_per_prompt"] is None else e["flops_per_prompt"] / 1e9,
                              "command": shlex.join(commands[label])}
    load_after = os.getloadavg()[0]
    out = {"model": "builtin:smollm2-135m-instruct", "data": "builtin:word-problems", "prompts": args.prompts,
           "n": args.n, "max_new_tokens": args.new_tokens, "config": "configs/word-problems.yaml",
           "command": f"python -m bench.verified --prompts {args.prompts} --n {args.n} --new-tokens {args.new_tokens}",
           "machine": f"{os.cpu_count()} CPUs, load average {load_before:.1f} before and {load_after:.1f} after",
           "methods": figures}
    for label, f in figures.items():
        c = f["cost_of_a_pass"]
        print(f"{label:>22}: verified {f['verified_prompts']}/{f['prompts']}, pass@1 {f['pass_at_1']}, "
              f"tokens {f['generated_tokens']}, steps {f['decoding_steps']}, device-s {f['device_seconds']}, "
              f"USD/pass {c['usd']}")
    print(f"machine: {out['machine']}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
