"""A generate job from a validated config to a checked run folder: what `winnow generate` wires together.

1. `check`, before Ray starts: the model folders, the run folder (a folder holding another config's run is refused,
   and so is one inside or around another run folder or the data source) and the data source as far as the driver
   reads it cheaply (`pipeline.prompts.check_source`). Nothing is written; every problem raises
   `schemas.base.InputError` (exit 2).
2. `connect` to Ray; `pipeline.cluster.check_room`: a node must hold one actor, or an autoscaler add one within
   `resources.wait_for_nodes_s` (exit 2 otherwise); then `stage_prompts` unless a resumed folder already holds its
   prompt set: Ray tasks read, normalise and write it beside the run folder (`pipeline.prompts.write_prompts`); a
   bad source exits 2 and the staged files are removed. The run folder is still untouched.
3. `execute`, under the folder's lease: remove what killed runs left (`runfolder.folder.clean_leftovers`), write
   manifest.json (status running) first into a new folder, move the prompt set into ``prompts/``, settle the
   checkpoint commits an earlier run left half done and move damaged data files aside
   (`runfolder.folder.settle_checkpoints`), count what is there (a resumed folder's manifest is rewritten only now,
   as running with those rows, and not at all when nothing is left to do), `run` the Ray Data pipeline, then count
   what was written, check that every prompt is there exactly once and rewrite the manifest (succeeded or failed).

The pipeline (`run`) is

    read_parquet(prompts/) -> [CheckpointFilter] -> map_batches(GenerateBatch, actor pool) -> write_parquet

The prompts are read in blocks of about two calls' prompts (`read_blocks`), each what one actor is handed at a time,
and the pool is `resources.actors` actors or an elastic `{min, max}` (`actor_pool`). Each actor of the pool holds one
`GenerateBatch`, which loads the draft/target/reward trio once (`workers.actor.runner.Runner`) and turns each call's
prompts into output rows, one per prompt, in order; a prompt whose `input_error` is set becomes an error row without
reaching the engine. Exactly once comes from Ray Data's
checkpointing (`ray.data.checkpoint.CheckpointConfig`, keyed on ``prompt_id``): each write task first records its
prompt_ids in ``_checkpoint/<file>.pending.parquet``, then writes its data file, then renames the checkpoint to
``<file>.parquet``. A later run first deletes the data files of pending checkpoints (a write cut short by a crash),
then drops every committed prompt_id right after the read. So a prompt is in candidates/ once if its checkpoint
committed, and is generated again otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

import pyarrow as pa
import ray
import ray.data
from ray.data.checkpoint import CheckpointConfig

from pipeline.preflight import count_model, location_problem, model_problems, resolved, working_dir_problems
from pipeline.prompts import Source, check_source, source_location, write_prompts
from pipeline.raydata import (
    data_context,
    native_noise_dropped,
    own_deprecations,
    quiet_ray_data,
    ray_init_options,
    short_error,
)
from runfolder.folder import (
    INFLIGHT,
    RunFolder,
    Tally,
    as_first_spelled,
    claim_problems,
    clean_leftovers,
    exactly_once_problems,
    nesting_problems,
    pending_checkpoints,
    settle_checkpoints,
    tally,
)
from runfolder.manifest import counted, finish_manifest, new_manifest
from runfolder.parameters import job_parameters
from schemas.base import InputError
from schemas.config import JobConfig, validate_config
from schemas.rows import error_row, rows_to_table


@dataclass
class CheckedJob:
    """A checked job (`check`): its run folder, whether it starts anew, resumes, or replaces the folder's run, and its
    data source as checked before Ray starts (None when the folder's own prompt set is reused). Not `winnow plan`."""

    config: JobConfig
    folder: RunFolder
    mode: str  # new | resume | overwrite
    source: Source | None = None

    @property
    def reuses_prompts(self) -> bool:
        return self.mode == "resume" and self.folder.has_prompts()


@dataclass
class RunEnd:
    """How a run ended (`execute`): its status and error, the folder's tally, the rows it wrote and its seconds."""

    status: str  # succeeded | failed | interrupted
    error: str | None
    tally: Tally
    new_rows: int
    seconds: float


def check(config: JobConfig, overwrite: bool, allow_working_dir: bool = False) -> CheckedJob:
    """Step 1, before Ray starts: every problem with the models, the run folder and the data source at once
    (InputError); nothing is written. The run folder may not sit inside or hold another run folder or the data
    source. The source is read here as far as the driver can do it cheaply (`pipeline.prompts.check_source`: local
    files' encoding, lines, footers and columns), unless the folder's own prompt set will be reused. Under
    `ray job submit`, paths inside Ray's copy of the working directory are refused unless `allow_working_dir`."""
    folder = RunFolder(config.output.path)
    unusable = location_problem("output.path", folder.uri)  # an S3 store that cannot be used: the folder unread
    if unusable is None:
        config = as_first_spelled(folder, config)  # one folder, one run: `runs/a/` resumes what `runs/a` started
    problems = [] if allow_working_dir else working_dir_problems(config)
    problems += model_problems(config)
    claim, mode = claim_problems(folder, config, overwrite) if unusable is None else ([unusable], "new")
    try:
        location = source_location(config.data.source)
    except InputError as err:
        location, claim = None, claim + err.problems
    try:
        claim += nesting_problems(folder, location, config.data.source) if unusable is None else []
    except OSError as err:
        claim.append(f"output.path: {folder.uri}: cannot be read ({err})")
    source = None
    if location is not None and not (mode == "resume" and not claim and folder.has_prompts()):
        try:
            source = check_source(config)
        except InputError as err:
            problems += err.problems
    if problems or claim:
        raise InputError(problems + claim)
    return CheckedJob(config, folder, mode, source)


@dataclass
class StagedPrompts:
    """A whole normalised prompt set written beside the run folder (`stage_prompts`), not yet moved into it."""

    path: str  # in the folder's filesystem
    rows: int


def stage_prompts(checked: CheckedJob) -> StagedPrompts:
    """Step 2: read, normalise and write the prompt set with Ray tasks (`pipeline.prompts.write_prompts`: the driver
    never holds it) to a staging place beside the run folder. A bad source raises InputError and whatever was staged
    is removed, so nothing is left behind; the run folder itself is not touched."""
    path, url = checked.folder.prompts_staging()
    try:
        rows = write_prompts(checked.config, url, checked.folder.arrow_fs(), source=checked.source)
    except BaseException:
        checked.folder.refresh()
        if checked.folder.fs.exists(path):
            checked.folder.fs.rm(path, recursive=True)
        raise
    return StagedPrompts(path, rows)


def execute(checked: CheckedJob, staged: StagedPrompts | None, log: Callable[[str], None] = print,
            watch: Callable[[Tally, int], ContextManager[None]] | None = None) -> RunEnd:
    """Step 3: write, run and check. `staged` is the prompt set from `stage_prompts`, or None when the folder's own
    is reused. Checkpoint commits that an earlier run left half done are settled first
    (`runfolder.folder.settle_checkpoints`, logged), so Ray Data's recovery never deletes a committed data file. A
    KeyboardInterrupt or a failed call ends with status interrupted/failed and the manifest says so; rows written
    so far are kept for the next run. `watch(tally, prompts)`, when given, is a context held around the pipeline
    (the progress display, `pipeline.progress`), given the folder's tally before the run and the prompt count."""
    config, folder = checked.config, checked.folder
    for line in clean_leftovers(folder, keep=staged.path if staged is not None else None):  # under the lease
        log(f"cleanup: {line}")
    if checked.mode == "overwrite":
        folder.clear()
    parameters = job_parameters(resolved(config), count=count_model)  # for the report's compute basis
    manifest = new_manifest(config, prompts=staged.rows if staged is not None else len(folder.read_prompt_ids()),
                            parameters=parameters)
    fresh = checked.mode != "resume"
    if fresh:  # first, so that the folder is a Winnow run folder before anything else is in it
        folder.write_manifest(manifest)
    if staged is not None:
        folder.install_prompts(staged.path, staged.rows)
    expected = folder.read_prompt_ids()
    if folder.fs.exists(folder.join(INFLIGHT)):  # call records of earlier runs' dead actors: this run's only, below
        folder.fs.rm(folder.join(INFLIGHT), recursive=True)
    for line in settle_checkpoints(folder):  # before Ray Data's recovery: a half-done commit must lose nothing
        log(f"checkpoint: {line}")
    written = tally(folder)
    before = written.rows
    done = not exactly_once_problems(expected, written.ids) and not pending_checkpoints(folder)
    if not fresh and not done:  # a resumed run's manifest keeps its last state until the folder has been counted
        manifest = counted(manifest, config, written)
        folder.write_manifest(manifest)
    verb = "resuming" if checked.mode == "resume" else "starting"
    log(f"{verb} {config.name!r} in {folder.uri}: {len(expected)} prompts, {before} already written"
        + ("; nothing left to generate" if done else ""))
    if not fresh and done:  # a finished run run again: its manifest already says so, times included
        kept = folder.read_manifest()
        if kept is not None and kept.status == "succeeded" and counted(kept, config, written) == kept:
            return RunEnd("succeeded", None, written, 0, 0.0)
    started = time.monotonic()

    def ended(status: str, error: str | None = None, t: Tally | None = None) -> RunEnd:
        """Count, rewrite the manifest and say how the run ended. The store may be what failed (an S3 outage): then
        the run fails with that said, and the manifest keeps saying `running`, which the next run resumes from."""
        try:
            t = t if t is not None else tally(folder)
            finish_manifest(manifest, folder, config, t, "failed" if status == "interrupted" else status, error)
        except Exception as err:  # noqa: BLE001 - any failure of the store here is reported, not raised
            why = (f"the run folder could not be counted or its manifest.json rewritten ({short_error(err)}), so "
                   "the manifest still says running; run the same command again once the store answers")
            status = "failed" if status == "succeeded" else status
            error = f"{error}; {why}" if error else why
            t = t if t is not None else Tally()
        return RunEnd(status, error, t, t.rows - before, time.monotonic() - started)

    try:
        if not done:
            with native_noise_dropped(), (watch(written, len(expected)) if watch else contextlib.nullcontext()):
                run(config, folder, prompts=len(expected))
    except KeyboardInterrupt:
        return ended("interrupted", "interrupted")
    except Exception as err:  # a failed call: the engine raised, an actor died (named with its node and call), ...
        from pipeline.faults import describe_failure

        return ended("failed", describe_failure(err, folder))
    t = tally(folder)
    problems = exactly_once_problems(expected, t.ids)
    if problems:
        return ended("failed", "run folder is inconsistent: " + "; ".join(problems), t)
    return ended("succeeded", None, t)


# ---------------------------------------------------------------------------------------------------------------
# The Ray Data pipeline and its actor


def checkpoint_config(folder: RunFolder) -> CheckpointConfig:
    return CheckpointConfig(
        id_column="prompt_id",
        checkpoint_path=folder.url("_checkpoint"),
        delete_checkpoint_on_success=False,  # the next run of the same config must still skip these prompts
        override_filesystem=folder.arrow_fs(),
    )


# A Ray Data task of the actor pool takes one block of prompts and runs its calls one after another on one actor; the
# rows of a block are written, and committed, by one write task. The block is the unit an actor is handed: a prompt set
# read as one block (Ray Data sizes read blocks by bytes, and a few thousand prompts make one) runs on one actor however
# many the pool holds, a node that joins mid-run gets no work, and a kill loses every row of the block in flight. So
# the prompts are read in blocks of about CALLS_PER_BLOCK calls (a call's rows are committed as soon as it ends, as
# before the blocks were set), at most MAX_BLOCKS of them.
CALLS_PER_BLOCK = 1
MAX_BLOCKS = 4096


def read_blocks(prompts: int, prompts_per_call: int) -> int:
    """The blocks the prompt set is read in: each of at least `CALLS_PER_BLOCK` calls' prompts where there are that
    many, at least one block, at most MAX_BLOCKS."""
    return max(1, min(MAX_BLOCKS, prompts // (prompts_per_call * CALLS_PER_BLOCK)))


def run(config: JobConfig, folder: RunFolder, prompts: int | None = None) -> None:
    """Generate every prompt of the folder's prompt set not yet written; raises if any call fails. `prompts`: the
    size of the prompt set (read from the folder when not given), which sets the blocks it is read in."""
    r = config.resources
    if prompts is None:
        prompts = len(folder.read_prompt_ids())
    with data_context(
        checkpoint_config=checkpoint_config(folder),
        # The V2 Parquet reader adds a ListFiles task that always asks for a whole CPU; with an actor pool holding
        # every CPU (2 actors on a 2-core machine) it would never be scheduled. The V1 reader takes num_cpus=0.
        use_datasource_v2=False,
        actor_task_retry_on_errors=r.max_retries > 0,  # a call that raised is retried at most max_retries times
        max_errored_blocks=0,  # a call that still fails fails the job
    ):
        fs = folder.arrow_fs()
        ds = ray.data.read_parquet(folder.prompts_url(), filesystem=fs, num_cpus=0,
                                   override_num_blocks=read_blocks(prompts, config.call_prompts(prompts)))
        with own_deprecations():
            ds = ds.map_batches(
                GenerateBatch,
                fn_constructor_kwargs={"config": resolved(config).model_dump(mode="json"), "run_name": config.name,
                                       "config_hash": config.hash()},
                batch_size=config.call_prompts(prompts),
                batch_format="pyarrow",
                compute=actor_pool(config),
                num_cpus=r.cpus_per_actor,
                num_gpus=r.gpus_per_actor,
                # Ray Data restarts dead actors and retries their calls forever by default; an engine that keeps
                # crashing must fail the job instead. Ray 2.60 has no named parameter for these two: its own docs
                # say `map_batches(..., max_restarts=0)`, i.e. extra keyword arguments gathered as
                # **ray_remote_args, which it deprecates for removal in 2.64. pyproject pins ray below that; the
                # deprecation warning shows with --verbose (`pipeline.raydata.own_deprecations`).
                max_restarts=r.max_retries,
                max_task_retries=r.max_retries,
            )
        ds.write_parquet(folder.url("candidates"), filesystem=fs, ray_remote_args={"num_cpus": 0})


def actor_pool(config: JobConfig) -> ray.data.ActorPoolStrategy:
    """`resources.actors` actors, or an elastic pool of `{min, max}`: Ray Data starts `min` actors and adds one
    while every actor is busy (its upscaling threshold) and the cluster has room, which it reads again as nodes join,
    and lets idle ones go. Either way the actors that fit run and the others wait for a node with room
    (`pipeline.cluster`). Each actor runs two calls at once where their prompts feed one decoding loop
    (`workers.pool.loop`: the next call's prompts take the places of sequences that finish early), one otherwise."""
    least, most = config.resources.pool
    size = {"size": least} if least == most else {"min_size": least, "max_size": most}
    calls = config.concurrent_calls
    if calls == 1:
        return ray.data.ActorPoolStrategy(**size)
    return ray.data.ActorPoolStrategy(**size, max_concurrent_calls_per_actor=calls, enable_true_multi_threading=True)


def connect() -> str:
    """Join the Ray cluster the job was submitted to (RAY_ADDRESS, or a `ray start` cluster on this machine), else
    start a local one; returns a line saying which (a driver that started its own Ray says so, whatever RAY_ADDRESS
    says: ``local`` starts one)."""
    if ray.is_initialized():
        quiet_ray_data()
        return "using the Ray instance already initialised in this process"
    address = os.environ.get("RAY_ADDRESS")
    local = starts_local_ray()
    if "RAY_AUTH_MODE" not in os.environ and local:
        # Ray 2.60 turns token authentication on for a Ray that ray.init starts, and warns that it did at every
        # start unless RAY_AUTH_MODE says so. Turned on here as Ray does it (the variable, and Ray's cached config
        # read again, which the processes it starts and this driver's client then agree on), without the warning;
        # a mode the user set is kept (docs/cluster.md)
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    ray.init(**ray_init_options(local))
    quiet_ray_data()
    resources = ray.cluster_resources()
    size = f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"
    node = getattr(ray._private.worker, "_global_node", None)
    if getattr(node, "head", False):  # this process started the head node: a local Ray of its own
        return f"started a local Ray ({size})"
    where = f"RAY_ADDRESS={address}" if address else ray.get_runtime_context().gcs_address
    return f"joined the Ray cluster at {where} ({size})"


def starts_local_ray() -> bool:
    """Whether `ray.init()` here would start a Ray of its own rather than join one (RAY_ADDRESS, or a `ray start`
    cluster on this machine), by Ray's own rule."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(None) is None
    except (ConnectionError, ValueError):  # an address that does not answer: ray.init says so itself
        return False


class GenerateBatch:
    """The actor's `map_batches` callable: ``GenerateBatch(resolved_config_dict, name, hash)(prompts) -> rows``;
    every row says which run it came from (`run_name`, `config_hash`).

    The Runner marks prompts it cannot run (longer than the context) as error rows and raises when the engine itself
    fails, so the batch, and with it the job, fails loudly."""

    def __init__(self, config: dict, run_name: str, config_hash: str):
        from pipeline.faults import BatchRecorder
        from workers.actor.runner import Runner

        # assets built on the node that uses them (builtin:smollm2-135m-instruct) are resolved here, on this node
        self.config = resolved(validate_config(config), on_node=True)
        r = self.config.resources
        if r.gpus_per_actor == 0:
            # on CPU, the threads of a matmul change its float sums in the last bit, enough to flip a sampled token:
            # the actor computes with the CPUs it reserved, whatever worker process Ray gave it (a reused worker may
            # carry another OMP_NUM_THREADS), so the same config gives the same rows
            import torch

            torch.set_num_threads(max(1, int(r.cpus_per_actor)))
        self.source = {"run_name": run_name, "config_hash": config_hash}  # the user's config's, not the resolved one's
        self.method = self.config.method.name
        reward = self.config.models.reward
        self.with_concepts = reward is not None and reward.kind == "lexical"
        self.with_columns = bool(self.config.reward_columns)
        self.runner = Runner(self.config)
        self.inflight = BatchRecorder.for_this_actor(self.config.output.path)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """One output row per prompt of `batch` (`pipeline.prompts.INPUT_SCHEMA` rows), in order. The batch is
        recorded in the run folder while it runs (`pipeline.faults`), so that a death of this actor names it."""
        with self.inflight.batch(batch.column("prompt_id").to_pylist()):
            return self.generate(batch)

    def generate(self, batch: pa.Table) -> pa.Table:
        prompts = batch.to_pylist()
        out: list[dict | None] = [None] * len(prompts)
        todo: list[int] = []
        for i, p in enumerate(prompts):
            if p["input_error"] is not None:
                out[i] = error_row(p["prompt_id"], p["prompt"], self.method, p["input_error"])
            else:
                todo.append(i)
        if todo:
            inputs = []
            for i in todo:
                item = {"prompt_id": prompts[i]["prompt_id"], "prompt": prompts[i]["prompt"]}
                if self.with_concepts:
                    item["concepts"] = prompts[i]["concepts"]
                if self.with_columns:  # the columns the reward and the verifier read, as the driver carried them
                    item["columns"] = json.loads(prompts[i]["columns"])
                inputs.append(item)
            results = self.runner.run(inputs)
            got = [r.get("prompt_id") if isinstance(r, dict) else None for r in results]
            want = [x["prompt_id"] for x in inputs]
            if got != want:
                raise RuntimeError(
                    f"workers.actor.runner.Runner.run broke its contract: it returned rows for {got} given {want}"
                )
            for i, result in zip(todo, results):
                out[i] = result
        for row in out:
            row.update(self.source)
        return rows_to_table(out)


# ---------------------------------------------------------------------------------------------------------------
# What the command prints


def summary_table(t: Tally, config: JobConfig, new_rows: int, seconds: float) -> str:
    """The run folder's totals as a one-row markdown table, and lines saying what this run added, what the tokens
    are, and (for Speculative Rejection) whether any candidate was cut."""
    cost = t.cost_totals(config.cost.usd_per_device_hour)
    reward = t.mean_best_reward()
    tokens = cost.target_tokens + cost.draft_tokens + cost.reward_tokens
    cells = [
        ("prompts", f"{t.rows}"),
        ("errors", f"{t.errors}"),
        ("mean best reward", "n/a" if reward is None else f"{reward:.4f}"),
        ("generated tokens", f"{t.generated_tokens}"),
        ("candidates", f"{t.candidates}"),
        ("rejected", f"{t.rejected}"),
        ("device-seconds", f"{cost.device_seconds:.1f}"),
        ("USD", f"{cost.usd:.6f}"),
    ]
    widths = [max(len(h), len(v)) for h, v in cells]
    head = "| " + " | ".join(h.ljust(w) for (h, _), w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    row = "| " + " | ".join(v.rjust(w) for (_, v), w in zip(cells, widths)) + " |"
    notes = (
        f"{new_rows} row(s) written by this run in {seconds:.0f} s; generated tokens = stats.generated_tokens summed "
        f"(every candidate's, rejected ones included); all tokens processed = {tokens} (target {cost.target_tokens}"
        f" + draft {cost.draft_tokens} + reward {cost.reward_tokens}, prefill and scoring included); USD at "
        f"{config.cost.usd_per_device_hour:g}/device-hour"
        + (f"; {t.decoding_steps:.0f} decoding steps at a mean width of {t.mean_width():.1f} sequences"
           + (f" and {t.reward_steps:.0f} reward-model forwards" if t.reward_steps else "")
           if t.mean_width() is not None else "")
        + (f"; {t.rows_without_cost} row(s) have no cost and are left out of these totals"
           if t.rows_without_cost else "")
        + (f"; {t.reward_inputs_truncated} reward input(s) were longer than the reward model's context and were "
           "scored on their last tokens (stats.reward_inputs_truncated)" if t.reward_inputs_truncated else "")
    )
    lines = [head, rule, row, notes]
    method = config.method
    if method.name == "speculative_rejection" and t.candidates and not t.rejected:
        why = ("method.alpha is 0" if method.alpha == 0 else
               "no prompt's running candidates reached their KV space: lower method.memory_candidates, or use "
               "schedule: fixed"
               if method.schedule == "memory" else
               "no decision token came before the candidates finished: lower method.every_k_tokens")
        lines.append(f"no candidate was rejected: this run was Best-of-N at Speculative Rejection's price ({why})")
    return "\n".join(lines)
