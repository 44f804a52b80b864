"""The Ray Data pipeline of a generate job: prompts.parquet -> actor pool -> candidates/*.parquet, checkpointed.

    read_parquet(prompts.parquet) -> [CheckpointFilter] -> map_batches(GenerateBatch, actor pool) -> write_parquet

Exactly once comes from Ray Data's checkpointing (`ray.data.checkpoint.CheckpointConfig`, keyed on ``prompt_id``):
each write task first records its prompt_ids in ``_checkpoint/<file>.pending.parquet``, then writes its data file,
then renames the checkpoint to ``<file>.parquet``. A later run first deletes the data files of pending
checkpoints (a write cut short by a crash), then drops every committed prompt_id right after the read. So a prompt
is in candidates/ once if its checkpoint committed, and is generated again otherwise.
"""

from __future__ import annotations

import os

import ray
import ray.data
from ray.data.checkpoint import CheckpointConfig

from pipeline.actor import GenerateBatch
from pipeline.preflight import resolved
from pipeline.raydata import data_context
from runfolder.folder import RunFolder
from schemas.config import JobConfig


def checkpoint_config(folder: RunFolder) -> CheckpointConfig:
    return CheckpointConfig(
        id_column="prompt_id",
        checkpoint_path=folder.url("_checkpoint"),
        delete_checkpoint_on_success=False,  # the next run of the same config must still skip these prompts
        override_filesystem=folder.arrow_fs(),
    )


def run(config: JobConfig, folder: RunFolder) -> None:
    """Generate every prompt of `folder`/prompts.parquet not yet written; raises if any batch fails."""
    r = config.resources
    with data_context(
        checkpoint_config=checkpoint_config(folder),
        # The V2 Parquet reader adds a ListFiles task that always asks for a whole CPU; with an actor pool holding
        # every CPU (2 workers on a 2-core machine) it would never be scheduled. The V1 reader takes num_cpus=0.
        use_datasource_v2=False,
        actor_task_retry_on_errors=r.max_retries > 0,  # a batch that raised is retried at most max_retries times
        max_errored_blocks=0,  # a batch that still fails fails the job
    ):
        fs = folder.arrow_fs()
        ds = ray.data.read_parquet(folder.url("prompts.parquet"), filesystem=fs, num_cpus=0)
        ds = ds.map_batches(
            GenerateBatch,
            fn_constructor_kwargs={"config": resolved(config).model_dump(mode="json")},
            batch_size=r.prompts_per_batch,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=r.workers),
            num_cpus=r.cpus_per_worker,
            num_gpus=r.gpus_per_worker,
            # Ray Data restarts dead actors and retries their batches forever by default; an engine that keeps
            # crashing must fail the job instead. Ray 2.60 has no named parameter for these two (its own docs say
            # `map_batches(..., max_restarts=0)`), so they go in ray_remote_args, which it deprecates for removal
            # in 2.64: pyproject pins ray below that, and the deprecation warning is left visible.
            ray_remote_args={"max_restarts": r.max_retries, "max_task_retries": r.max_retries},
        )
        ds.write_parquet(folder.url("candidates"), filesystem=fs, ray_remote_args={"num_cpus": 0})


def connect() -> str:
    """Join the Ray cluster the job was submitted to (RAY_ADDRESS, or a `ray start` cluster on this machine), else
    start a local one; returns a line saying which."""
    if ray.is_initialized():
        return "using the Ray instance already initialised in this process"
    address = os.environ.get("RAY_ADDRESS")
    ray.init()
    resources = ray.cluster_resources()
    size = f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"
    if address:
        return f"joined the Ray cluster at RAY_ADDRESS={address} ({size})"
    return f"Ray at {ray.get_runtime_context().gcs_address} ({size})"
