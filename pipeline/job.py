"""A generate job from a validated config to a checked run folder: the steps `winnow generate` wires together.

1. `check`: the model folders and the run folder (a folder holding another config's run is refused). Nothing is
   written; every problem raises `schemas.base.InputError` (exit 2).
2. `connect` to Ray (`pipeline.run.connect`), then `load_prompts` (`pipeline.prompts`) unless a resumed folder
   already holds prompts.parquet. Still nothing written.
3. `execute`: write manifest.json (status running) and prompts.parquet, run the Ray Data pipeline
   (`pipeline.run.run`: an actor pool of trios; rows stream into candidates/*.parquet, checkpointed), then count
   what was written, check that every prompt is there exactly once and rewrite the manifest (succeeded or failed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from pipeline.preflight import model_problems
from pipeline.raydata import short_error
from runfolder.folder import RunFolder, Tally, claim_problems, exactly_once_problems, pending_checkpoints, tally
from runfolder.manifest import finish_manifest, new_manifest
from schemas.base import InputError
from schemas.config import JobConfig


@dataclass
class Plan:
    """A checked job: its run folder and whether it starts anew, resumes, or replaces the folder's run."""

    config: JobConfig
    folder: RunFolder
    mode: str  # new | resume | overwrite

    @property
    def reuses_prompts(self) -> bool:
        return self.mode == "resume" and self.folder.has_prompts()


@dataclass
class Outcome:
    status: str  # succeeded | failed | interrupted
    error: str | None
    tally: Tally
    new_rows: int
    seconds: float


def check(config: JobConfig, overwrite: bool) -> Plan:
    """Step 1: every problem with the models or the run folder at once (InputError); nothing is written."""
    folder = RunFolder(config.output.path)
    problems = model_problems(config)
    claim, mode = claim_problems(folder, config, overwrite)
    if problems or claim:
        raise InputError(problems + claim)
    return Plan(config, folder, mode)


def execute(plan: Plan, prompts: pa.Table | None, log: Callable[[str], None] = print) -> Outcome:
    """Step 3: write, run and check. `prompts` is the normalised prompt set, or None when the folder's own
    prompts.parquet is reused. A KeyboardInterrupt or a failed batch ends with status interrupted/failed and the
    manifest says so; rows written so far are kept for the next run."""
    from pipeline import run as pipeline

    config, folder = plan.config, plan.folder
    if plan.mode == "overwrite":
        folder.clear()
    expected = folder.read_prompt_ids() if prompts is None else prompts.column("prompt_id").to_pylist()
    manifest = new_manifest(config, prompts=len(expected))
    folder.write_manifest(manifest)
    if prompts is not None:
        folder.write_prompts(prompts)
    written = tally(folder)
    before = written.rows
    done = not exactly_once_problems(expected, written.ids) and not pending_checkpoints(folder)
    verb = "resuming" if plan.mode == "resume" else "starting"
    log(f"{verb} {config.name!r} in {folder.uri}: {len(expected)} prompts, {before} already written"
        + ("; nothing left to generate" if done else ""))
    started = time.monotonic()

    def ended(status: str, error: str | None = None, t: Tally | None = None) -> Outcome:
        t = t if t is not None else tally(folder)
        finish_manifest(manifest, folder, config, t, "failed" if status == "interrupted" else status, error)
        return Outcome(status, error, t, t.rows - before, time.monotonic() - started)

    try:
        if not done:
            pipeline.run(config, folder)
    except KeyboardInterrupt:
        return ended("interrupted", "interrupted")
    except Exception as err:  # a failed batch: the engine raised, an actor died, a write failed
        return ended("failed", short_error(err))
    t = tally(folder)
    problems = exactly_once_problems(expected, t.ids)
    if problems:
        return ended("failed", "run folder is inconsistent: " + "; ".join(problems), t)
    return ended("succeeded", None, t)


def summary_table(t: Tally, config: JobConfig, new_rows: int, seconds: float) -> str:
    """The run folder's totals as a one-row markdown table, and a line saying what this run added."""
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
        + (f"; {t.rows_without_cost} row(s) have no cost and are left out of these totals"
           if t.rows_without_cost else "")
    )
    return "\n".join([head, rule, row, notes])
