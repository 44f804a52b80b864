"""`winnow generate CONFIG [--set a.b=v]... [--overwrite]`: run a generation job on Ray; resumes by default.

The same entry point runs on a laptop (it starts a local Ray) and on a cluster
(`ray job submit --working-dir . -- python -m jobs.generate CONFIG`, which joins the cluster). Steps:

1. Check the config, the model folders and the run folder (a folder holding another config's run is refused).
2. Read and normalise the prompts with Ray Data (or reuse the run folder's prompts.parquet when resuming).
   Up to here nothing is written: a bad input exits with status 2 and leaves no run folder.
3. Write manifest.json (status running) and prompts.parquet, then run `jobs.pipeline` (an actor pool of
   `resources.workers` draft/target/reward trios; rows stream into candidates/*.parquet, checkpointed).
4. Count what was written, check that every prompt is there exactly once, rewrite the manifest (succeeded or
   failed) and print a summary table. A failed batch (engine crash) exits with status 1.
"""

from __future__ import annotations

import sys
import time

from jobs import config_args
from jobs.errors import EXIT_OK, EXIT_RUNTIME, InputError
from jobs.preflight import model_problems
from jobs.rundir import (
    RunFolder,
    Tally,
    claim_problems,
    exactly_once_problems,
    finish_manifest,
    new_manifest,
    pending_checkpoints,
    tally,
)
from schemas.base import ConfigError
from schemas.config import JobConfig

PROG = "winnow generate"


def summary_table(t: Tally, config: JobConfig, new_rows: int, seconds: float) -> str:
    cost = t.cost_totals(config.cost.usd_per_device_hour)
    reward = t.mean_best_reward()
    tokens = cost.target_tokens + cost.draft_tokens + cost.reward_tokens
    cells = [
        ("prompts", f"{t.rows}"),
        ("errors", f"{t.errors}"),
        ("mean best reward", "n/a" if reward is None else f"{reward:.4f}"),
        ("tokens", f"{tokens}"),
        ("device-seconds", f"{cost.device_seconds:.1f}"),
        ("USD", f"{cost.usd:.6f}"),
    ]
    widths = [max(len(h), len(v)) for h, v in cells]
    head = "| " + " | ".join(h.ljust(w) for (h, _), w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    row = "| " + " | ".join(v.rjust(w) for (_, v), w in zip(cells, widths)) + " |"
    notes = (
        f"{new_rows} row(s) written by this run in {seconds:.0f} s; tokens = target {cost.target_tokens} + "
        f"draft {cost.draft_tokens} + reward {cost.reward_tokens}; USD at "
        f"{config.cost.usd_per_device_hour:g}/device-hour"
    )
    return "\n".join([head, rule, row, notes])


def main(argv: list[str] | None = None) -> int:
    p = config_args.parser(PROG, "Run a generation job on Ray (resumes an interrupted run of the same config).")
    p.add_argument("--overwrite", action="store_true",
                   help="clear output.path first when it holds a run (of any config)")
    try:
        args = config_args.parse(p, argv)
        config = config_args.load(args)
    except (config_args.ArgumentError, ConfigError) as err:
        return config_args.report(PROG, err)

    # 1-2: checks; nothing is written until they all pass.
    folder = RunFolder(config.output.path)
    problems = model_problems(config)
    claim, mode = claim_problems(folder, config, args.overwrite)
    if problems or claim:
        return config_args.report(PROG, InputError(problems + claim))
    from jobs import pipeline
    from jobs.sources import load_prompts, short_error

    try:
        print(f"{PROG}: {pipeline.connect()}", flush=True)
    except (ConnectionError, RuntimeError, ValueError) as err:  # RAY_ADDRESS points nowhere, Ray cannot start
        print(f"{PROG}: cannot connect to or start Ray: {short_error(err)}", file=sys.stderr)
        return EXIT_RUNTIME
    reuse = mode == "resume" and folder.has_prompts()
    prompts = None
    if not reuse:
        try:
            prompts = load_prompts(config)
        except InputError as err:
            return config_args.report(PROG, err)

    # 3: claim the folder and run.
    if mode == "overwrite":
        folder.clear()
    expected = folder.read_prompt_ids() if reuse else prompts.column("prompt_id").to_pylist()
    manifest = new_manifest(config, prompts=len(expected))
    folder.write_manifest(manifest)
    if not reuse:
        folder.write_prompts(prompts)
    written = tally(folder)
    before = written.rows
    done = not exactly_once_problems(expected, written.ids) and not pending_checkpoints(folder)
    verb = "resuming" if mode == "resume" else "starting"
    print(f"{PROG}: {verb} {config.name!r} in {folder.uri}: {len(expected)} prompts, {before} already written"
          + ("; nothing left to generate" if done else ""), flush=True)
    started = time.monotonic()
    try:
        if not done:
            pipeline.run(config, folder)
    except KeyboardInterrupt:
        finish_manifest(manifest, folder, config, tally(folder), "failed", "interrupted")
        print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as err:  # a failed batch: the engine raised, an actor died, a write failed
        message = short_error(err)
        finish_manifest(manifest, folder, config, tally(folder), "failed", message)
        print(f"{PROG}: the job failed: {message}\n{PROG}: rows written so far are kept in {folder.uri}; "
              "run the same command again to resume", file=sys.stderr)
        return EXIT_RUNTIME

    # 4: check and record.
    t = tally(folder)
    problems = exactly_once_problems(expected, t.ids)
    if problems:
        message = "run folder is inconsistent: " + "; ".join(problems)
        finish_manifest(manifest, folder, config, t, "failed", message)
        print(f"{PROG}: {message}", file=sys.stderr)
        return EXIT_RUNTIME
    finish_manifest(manifest, folder, config, t, "succeeded")
    print(summary_table(t, config, t.rows - before, time.monotonic() - started))
    print(f"{PROG}: wrote {folder.uri}/candidates and {folder.uri}/manifest.json")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
