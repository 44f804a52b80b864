"""Shared fixtures: one local Ray for the whole session, and helpers to write job configs and prompt files."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

# The `winnow` commands the tests start start local Rays without Ray's dashboard, as the session's own does
# (pipeline.raydata.ray_init_options): 1 to 4 s less for each, and no dashboard beside the actors on 2 cores.
# tests/test_cli.py checks that a run without this variable starts it.
os.environ.setdefault("WINNOW_RAY_DASHBOARD", "0")


@contextlib.contextmanager
def machine_share(alone: bool):
    """Under pytest-xdist (`-n 2`, the README's test command), a test marked `alone` runs with no other test beside
    it, and the others two at a time: the tests that kill nodes and actors of a Ray cluster at a chosen moment wait
    on Ray's health checks, which a second test's load delays (a node-loss test's rerun hung once in four parallel
    runs). A readers-writer lock shared by the workers (flock): `alone` holds it exclusively, the others shared, and
    a turnstile taken first lets an `alone` test in as soon as the test running beside it ends. Taken around a
    test's whole protocol, so that its module's fixtures are set up and torn down under it too."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    import fcntl
    import tempfile

    base = Path(tempfile.gettempdir()) / f"winnow-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with machine_share(item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray (2 CPUs, no dashboard) shared by every test that needs one; its address for subprocesses."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def job_config(tmp_path: Path, **sections) -> dict:
    """A small valid job config (Best-of-4 with the bundled trio, 4 demo prompts) with sections replaced."""
    cfg = {
        "name": "test",
        "seed": 0,
        "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id", "limit": 4},
        "models": {
            "target": "builtin:tiny-target",
            "draft": "builtin:tiny-draft",
            "reward": {"kind": "model", "path": "builtin:tiny-reward"},
        },
        "method": {"name": "best_of_n", "n": 4},
        "generation": {"max_new_tokens": 16},
        "output": {"path": str(tmp_path / "run")},
        "resources": {"actors": 1, "prompts_per_call": 2},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict) and not ({"name", "kind"} & set(value)):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def winnow(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m jobs.cli ARGS...` (the `winnow` console script) in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def exploding_reward(prompts, texts):
    """A `python` reward (`conftest:exploding_reward`) whose service is down: the engine fails on every batch."""
    raise RuntimeError("reward service unavailable")


def committed_batches(run: Path) -> int:
    """Batches Ray Data's checkpoint has committed in run folder `run` (files not pending)."""
    ckpt = run / "_checkpoint"
    return len([p for p in ckpt.glob("*.parquet") if not p.name.endswith(".pending.parquet")]) if ckpt.exists() else 0


def kill_once_committed(cfg: Path, run: Path, log: Path, timeout: float = 400, argv: list[str] | None = None) -> None:
    """Start `winnow generate cfg` (or `python ARGV...`: a command that generates `run`, e.g. `winnow plan`) in its
    own process group, SIGKILL it as soon as a batch of `run` has committed, then every process of its group (the
    local Ray it started, its actors and their engines), so that none of them writes afterwards. Fails, with the
    run's log, if it ended before it was killed."""
    import signal
    import time

    with open(log, "w") as out:
        first = subprocess.Popen([sys.executable, *(argv or ["-m", "jobs.generate", str(cfg)])], cwd=ROOT,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while committed_batches(run) == 0 and first.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert first.poll() is None, \
                f"the first run ended (exit {first.returncode}) before it was killed:\n{log.read_text()[-4000:]}"
            os.kill(first.pid, signal.SIGKILL)
            assert first.wait(30) == -signal.SIGKILL
        finally:
            time.sleep(2)
            try:
                os.killpg(first.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
