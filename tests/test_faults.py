"""Actor and node faults in `winnow generate`: an actor killed with SIGKILL mid-batch, with `resources.max_retries` 0
(the run fails loudly, naming the actor, its node and the batch; a rerun completes) and 2 (Ray restarts the actor and
retries the batch; the run succeeds), and the loss of a node of a three-node cluster simulated on this machine
(`ray.cluster_utils.Cluster`). Whatever happens, the final run folder holds every prompt exactly once, with the same
texts, token counts, finish reasons and best candidates as an uninterrupted run of the same config and seed, and the
same rewards up to float32 rounding (see `close`).

How a kill is aimed: every GenerateBatch records the batch it is running in the run folder
(``_inflight/<actor_id>-<n>.json``, `pipeline.faults.BatchRecorder`) with its pid and node; the test waits until one
write has been committed and a batch is in flight, then kills that pid (or that node). The record is also what names
the batch in the error, and the test checks the error against Ray's view of the actor (the actor id in the record is
Ray's runtime context's; the one in the error is Ray's ActorDiedError's).

The actor kills run `winnow generate` in a subprocess that joins the session's Ray (`ray_session`); the uninterrupted
run is done in this process on the same Ray. The cluster runs in a helper process (a Cluster in the pytest process
would clash with the session's Ray) with a private temp dir (``RAY_TMPDIR``, so that no other Ray client on this
machine finds it), which the test shuts down at the end; a run still going when a test fails is killed.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

from conftest import ROOT, job_config, write_config
from pipeline import faults
from runfolder.folder import RunFolder
from tests.ray_clusters import SimulatedCluster

PROMPTS = 24  # an actor runs two batches at once (workers.pool.loop): enough batches start after the first commit
# Slow enough that a batch is still running when the test, polling every 20 ms, sees its record and kills (a batch of
# 2 prompts takes 0.5-1 s on one core, two batches decoding at once: workers.pool.loop), small enough for the file to
# run in a few minutes on 2 cores.
FAULT_JOB = {"data": {"limit": PROMPTS}, "method": {"name": "best_of_n", "n": 16}, "generation": {"max_new_tokens": 64}}
RUN_TIMEOUT = 300

# ---------------------------------------------------------------------------------------------------------------
# Helpers


def fault_config(tmp_path: Path, name: str, max_retries: int) -> Path:
    # feed_calls: an actor runs two batches at once, so a failure names both
    cfg = job_config(tmp_path, **FAULT_JOB, output={"path": str(tmp_path / name)},
                     resources={"actors": 1, "prompts_per_call": 2, "max_retries": max_retries, "feed_calls": True})
    return write_config(tmp_path / f"{name}.yaml", cfg)


def rows_of(run: Path) -> list[dict]:
    return pads.dataset(str(run / "candidates"), format="parquet").to_table().to_pylist()


def manifest_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def committed(run: Path) -> int:
    ckpt = run / "_checkpoint"
    return len([p for p in ckpt.glob("*.parquet") if not p.name.endswith(".pending.parquet")]) if ckpt.exists() else 0


def records(run: Path) -> list[dict]:
    return faults.inflight_records(RunFolder(str(run)))


def close(a, b) -> bool:
    """Rewards agree: equal, or both floats within float32 rounding (a resumed run batches the remaining prompts
    differently, and a padded batch rounds differently in the 7th digit)."""
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def assert_same_rows(run: Path, baseline: dict[str, dict]) -> None:
    """Every prompt exactly once, and each row's deterministic columns as in the uninterrupted run, to what
    docs/jobs.md promises of `resources.feed_calls: true` (these runs feed an actor two calls at once): which prompts
    share a forward depends on how Ray timed the calls, so a sampled token may differ where its draw falls within
    float rounding of a boundary, after which that candidate follows its own path. At most one candidate in 32 may
    differ so; every other candidate, and every row none of whose candidates differ, is as in the baseline."""
    rows = rows_of(run)
    assert collections.Counter(r["prompt_id"] for r in rows) == collections.Counter(list(baseline))  # exactly once
    differ, total = [], 0
    for r in rows:
        want = baseline[r["prompt_id"]]
        pid = r["prompt_id"]
        assert r["error"] == want["error"], pid
        got_c, want_c = r["candidates"], want["candidates"]
        assert len(got_c) == len(want_c), pid
        total += len(got_c)
        moved = False
        for i, (g, w) in enumerate(zip(got_c, want_c)):
            if (g["text"], g["num_tokens"], g["finish_reason"]) != (w["text"], w["num_tokens"], w["finish_reason"]):
                differ.append((pid, i, w["text"], g["text"]))
                moved = True
                continue
            assert close(g["reward"], w["reward"]), (pid, g["reward"], w["reward"])
            assert len(g["partial_rewards"]) == len(w["partial_rewards"]), pid
            assert all(close(x, y) for x, y in zip(g["partial_rewards"], w["partial_rewards"])), pid
        assert r["best_text"] == got_c[r["best_index"]]["text"], pid
        if not moved:
            assert (r["best_index"], r["best_text"]) == (want["best_index"], want["best_text"]), pid
            assert close(r["best_reward"], want["best_reward"]), pid
    assert len(differ) <= total // 32, differ  # not cost: a row's share of its batch's padding and time varies


@pytest.fixture
def session_env(ray_session):
    """Environment for a run that joins the session's Ray (2 CPUs) instead of starting one (which takes seconds and,
    on a loaded machine, can time out)."""
    return {**os.environ, "RAY_ADDRESS": ray_session}


@pytest.fixture
def private_ray(tmp_path):
    """Environment for a process that starts a Ray of its own: a short private RAY_TMPDIR (Ray puts unix sockets
    under it, and its ray_current_cluster file there, where no other Ray client looks), no RAY_ADDRESS."""
    temp = tempfile.mkdtemp(prefix="wf", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": temp, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    yield env
    shutil.rmtree(temp, ignore_errors=True)


class Job:
    """`python -m jobs.generate CONFIG` in its own process group, its stdout and stderr in files."""

    def __init__(self, cfg: Path, env: dict, name: str):
        self.out, self.err = cfg.with_name(f"{name}.out"), cfg.with_name(f"{name}.err")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", str(cfg)], cwd=ROOT, env=env,
                                         stdout=out, stderr=err, start_new_session=True)

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        return self.proc.wait(timeout)

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def kill_group(self) -> None:
        """The driver (and a local Ray it started: same process group), if still there."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


def run_to_end(cfg: Path, env: dict, name: str) -> Job:
    """Run `name` to its end; one still running after RUN_TIMEOUT is killed and the test fails with its output (a
    hang is diagnosed from what the run said, not from the timeout alone)."""
    job = Job(cfg, env, name)
    try:
        job.wait()
    except subprocess.TimeoutExpired:
        job.kill_group()
        pytest.fail(f"{name} still ran after {RUN_TIMEOUT} s; its stdout:\n{job.stdout[-3000:]}\nits stderr:\n"
                    f"{job.stderr[-6000:]}")
    finally:
        if job.proc.poll() is None:
            job.kill_group()
    return job


def batch_in_flight(run: Path, job: Job, deadline_s: float = RUN_TIMEOUT) -> dict:
    """Wait until at least one write is committed and a batch starts; its record, seen within a poll (20 ms) of its
    start, so that the batch is still running when the caller hits it (a record already there may belong to a batch
    about to end: the hit would then land between batches)."""
    deadline = time.monotonic() + deadline_s
    seen: set = set()
    while time.monotonic() < deadline:
        if job.proc.poll() is not None:
            pytest.fail(f"the run ended (exit {job.proc.returncode}) before a batch could be hit:\n{job.stderr[-3000:]}")
        done = committed(run)
        recs = records(run)
        fresh = [r for r in recs if (r.get("pid"), r.get("started_at")) not in seen]
        seen.update((r.get("pid"), r.get("started_at")) for r in recs)
        if done and fresh and len(seen) > len(fresh):  # a batch that started after we began watching
            return fresh[-1]
        time.sleep(0.02)
    pytest.fail("no batch started after a committed write")


def kill_actor(rec: dict) -> None:
    """SIGKILL the recorded actor process, after checking it is a Ray worker."""
    cmdline = Path(f"/proc/{rec['pid']}/cmdline").read_bytes()
    assert cmdline.startswith(b"ray::"), f"pid {rec['pid']} is not a Ray worker: {cmdline[:80]!r}"
    os.kill(rec["pid"], signal.SIGKILL)


def assert_names_the_dead_actor(error: str, rec: dict) -> None:
    """The failure line names the actor, its pid, its node (address and id) and the batches it was running (an actor
    runs two at once where their prompts feed one decoding loop, workers.pool.loop), `rec`'s among them."""
    assert f"actor {rec['actor_id']} " in error, error
    assert f"pid {rec['pid']}" in error, error
    assert f"on node {rec['node_ip']} (node id {rec['node_id']})" in error, error
    plural = "" if rec["prompts"] == 1 else "s"
    assert "while running the call of prompts " in error or "while running the calls of prompts " in error, error
    assert f"{rec['first']}..{rec['last']} ({rec['prompts']} prompt{plural})" in error, error


def assert_names_an_actor_lost_with_its_node(error: str, rec: dict, run: Path) -> None:
    """After a node loss, the actor Ray Data reports may be the one that was running `rec`'s batch, or another of
    the lost node's actors (or one Ray restarted there) that was between batches: which one wins the race depends
    on when Ray declares the node dead. Either way the line names an actor and what happened to it, and batches
    only where records prove them: then the actor is `rec`'s and each named batch is one it left in `_inflight/`
    when its node died (`rec`'s, or, as a node takes a while to die and the actor runs two batches at once, one it
    started after `rec`'s ended), else it says the batch cannot be named."""
    assert error.startswith("actor "), error
    assert " became unreachable (" in error or " died (" in error, error
    if "while running the call of prompts" in error or "while running the calls of prompts" in error:
        assert f"actor {rec['actor_id']} " in error, error
        named = re.findall(r"(\S+\.\.\S+) \(", error.split(" of prompts ", 1)[1])
        left = {f"{r['first']}..{r['last']}" for r in records(run) if r.get("actor_id") == rec["actor_id"]}
        assert named and set(named) <= left, (named, left, error)
    else:
        assert "while running a call that cannot be named" in error, error


@pytest.fixture(scope="module")
def baseline(ray_session, tmp_path_factory) -> dict[str, dict]:
    """The rows of an uninterrupted run of the fault tests' job (same seed), by prompt_id; run in this process on
    the session's Ray (2 CPUs, one 1-CPU actor, like every run here)."""
    from jobs import generate

    tmp = tmp_path_factory.mktemp("baseline")
    assert generate.main([str(fault_config(tmp, "run", 0))]) == 0
    rows = {r["prompt_id"]: r for r in rows_of(tmp / "run")}
    assert len(rows) == PROMPTS and not any(r["error"] for r in rows.values())
    return rows


# ---------------------------------------------------------------------------------------------------------------
# describe_failure on its own (fast)


DIED = """The actor died unexpectedly before finishing this task.
\tclass_name: MapWorker(MapBatches(GenerateBatch))
\tactor_id: dc03fb59fac606a79410bd1501000000
\tpid: 29349
\tnamespace: df3bef11-ad00-4ea7-9a06-c87bea5b0887
\tip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker \
unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was \
killed by the OOM killer due to high memory usage"""  # ray 2.60's ActorDiedError text for a SIGKILLed actor


def ray_data_raises(err: BaseException) -> BaseException:
    """The shape Ray Data 2.60 raises: the actor's error itself, from a bare SystemException."""
    from ray.data.exceptions import SystemException

    try:
        raise err from SystemException()
    except BaseException as raised:
        return raised


def write_record(run: Path, **fields) -> None:
    (run / faults.INFLIGHT).mkdir(parents=True, exist_ok=True)
    rec = {"actor_id": "dc03fb59fac606a79410bd1501000000", "node_id": "8d66" * 14, "node_ip": "192.0.2.2",
           "pid": 29349, "first": "demo-004", "last": "demo-005", "prompts": 2,
           "started_at": "2026-01-01T00:00:00+00:00", **fields}
    (run / faults.INFLIGHT / f"{rec['actor_id']}-{rec['pid']}.json").write_text(json.dumps(rec))


def test_a_dead_actor_is_named_with_its_node_cause_and_batch(tmp_path):
    write_record(tmp_path)
    err = ray_data_raises(RayActorError("dc03fb59fac606a79410bd1501000000", DIED))
    assert faults.describe_failure(err, RunFolder(str(tmp_path))) == (
        "actor dc03fb59fac606a79410bd1501000000 (MapWorker(MapBatches(GenerateBatch)), pid 29349) on node 192.0.2.2 "
        f"(node id {'8d66' * 14}) died (its worker process has died; exit type SYSTEM_ERROR: Worker unexpectedly "
        "exits with a connection error code 2. End of file) while running the call of prompts demo-004..demo-005 "
        "(2 prompts)"
    )


def test_an_unknown_batch_is_said_to_be_unknown(tmp_path):
    write_record(tmp_path, actor_id="another0000000000000000000000000")  # another actor's batch is not this one's
    err = ray_data_raises(RayActorError("dc03fb59fac606a79410bd1501000000", DIED))
    line = faults.describe_failure(err, RunFolder(str(tmp_path)))
    assert line.startswith("actor dc03fb59fac606a79410bd1501000000 (MapWorker(MapBatches(GenerateBatch)), pid 29349) "
                           "on node 192.0.2.2 died (its worker process has died")
    assert line.endswith("while running a call that cannot be named: _inflight/ in the run folder holds no record "
                         "of one (the actor died between calls, or could not write the record)")
    assert "demo-004" not in line


def test_an_unreachable_actor_and_other_errors():
    err = ray_data_raises(ActorUnavailableError("The actor is temporarily unavailable: RpcError: connection refused",
                                                bytes.fromhex("79a46dccb9d04b159f648a8801000000")))
    line = faults.describe_failure(err, None)
    assert line == ("actor 79a46dccb9d04b159f648a8801000000 on a node Ray did not report became unreachable (The "
                    "actor is temporarily unavailable: RpcError: connection refused) while running a call that "
                    "cannot be named (no run folder to read its record from)")
    assert faults.describe_failure(RuntimeError("reward service unavailable"), None) == \
        "RuntimeError: reward service unavailable"  # not an actor's death: pipeline.raydata.short_error, as before


def test_the_record_of_the_process_that_died_names_the_batch(tmp_path):
    """An actor restarted by Ray keeps its id, not its pid: a death is matched to its process's record by pid, and
    an unreachable actor (no pid in Ray's error) to the record of the process on the node Ray reports dead."""
    write_record(tmp_path, pid=111, node_id="lost", first="demo-002", last="demo-003")
    write_record(tmp_path, pid=222, node_id="alive", first="demo-006", last="demo-006", prompts=1,
                 started_at="2026-01-01T00:01:00+00:00")
    folder = RunFolder(str(tmp_path))
    died = ray_data_raises(RayActorError("dc03fb59fac606a79410bd1501000000", DIED.replace("pid: 29349", "pid: 111")))
    line = faults.describe_failure(died, folder)
    assert "(MapWorker(MapBatches(GenerateBatch)), pid 111) on node 192.0.2.2 (node id lost) died" in line
    assert line.endswith("while running the call of prompts demo-002..demo-003 (2 prompts)")
    unreachable = ray_data_raises(ActorUnavailableError("RpcError: connection refused",
                                                        bytes.fromhex("dc03fb59fac606a79410bd1501000000")))
    line = faults.describe_failure(unreachable, folder, dead_nodes={"lost"})
    assert line == ("actor dc03fb59fac606a79410bd1501000000 (pid 111) on node 192.0.2.2 (node id lost) became "
                    "unreachable (RpcError: connection refused) while running the call of prompts demo-002..demo-003 "
                    "(2 prompts)")
    line = faults.describe_failure(unreachable, folder, dead_nodes=set())  # which life cannot be told: both, by pid
    assert line.endswith("while running the calls of prompts demo-002..demo-003 (2 prompts, pid 111); "
                         "demo-006..demo-006 (1 prompt, pid 222)")


def test_a_batch_record_lives_while_its_batch_runs(tmp_path, monkeypatch):
    """Written before the batch, removed after it whether it succeeded or raised; a record left by a process that
    died stays."""
    me = {"actor_id": "aa" * 16, "node_id": "bb" * 28, "node_ip": "10.0.0.7", "pid": 4242, "job_id": "01000000"}
    monkeypatch.setattr(faults, "this_actor", lambda: dict(me))
    run = tmp_path / "run"
    write_record(run, actor_id=me["actor_id"], pid=4141)  # left by the actor's previous process, killed mid-batch
    recorder = faults.BatchRecorder.for_this_actor(str(run))
    with recorder.batch(["p1", "p2", "p3"]):
        left, rec = records(run)
        assert left["pid"] == 4141
        assert (rec["actor_id"], rec["first"], rec["last"], rec["prompts"], rec["pid"]) == (me["actor_id"], "p1", "p3",
                                                                                            3, 4242)
    assert [r["pid"] for r in records(run)] == [4141]
    with pytest.raises(ValueError), recorder.batch(["p4"]):
        raise ValueError("engine failed")
    assert [r["pid"] for r in records(run)] == [4141]


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL of the actor mid-batch


def hit_mid_batch(cfg, run: Path, env: dict, label: str, kill) -> tuple[Job, dict, int]:
    """Start `winnow generate`, wait for a batch in flight, `kill(record)` it, and wait for the run to end:
    (the job, the batch's record, its exit status). The job's process group is ended whatever happens."""
    job = Job(cfg, env, label)
    try:
        rec = batch_in_flight(run, job)
        kill(rec)
        return job, rec, job.wait()
    finally:
        if job.proc.poll() is None:
            job.kill_group()


@pytest.mark.slow
@pytest.mark.alone
def test_actor_killed_without_retries_fails_loudly_and_the_rerun_completes(tmp_path, session_env, baseline):
    cfg = fault_config(tmp_path, "run", max_retries=0)
    run = tmp_path / "run"
    job, rec, status = hit_mid_batch(cfg, run, session_env, "first", kill_actor)
    assert status == 1, job.stderr[-3000:]
    m = manifest_of(run)
    assert m["status"] == "failed"
    assert_names_the_dead_actor(m["error"], rec)
    assert f"winnow generate: the job failed: {m['error']}\n" in job.stderr
    written = len(rows_of(run))
    assert 0 < written < PROMPTS, f"the kill should land mid-run; {written} rows were written"

    again = run_to_end(cfg, session_env, "second")
    assert again.proc.returncode == 0, again.stderr[-3000:]
    assert f"resuming 'test' in {run}: {PROMPTS} prompts, {written} already written" in again.stdout
    assert_same_rows(run, baseline)
    m = manifest_of(run)
    assert (m["status"], m["rows"], m["error"]) == ("succeeded", PROMPTS, None)


@pytest.mark.slow
@pytest.mark.alone
def test_actor_killed_with_retries_is_restarted_and_its_batch_retried(tmp_path, session_env, baseline):
    cfg = fault_config(tmp_path, "run", max_retries=2)
    run = tmp_path / "run"
    job, rec, status = hit_mid_batch(cfg, run, session_env, "only", kill_actor)
    assert status == 0, job.stderr[-3000:]
    # Ray's own account of the retry (2.60's wording): the killed batch was retried on the restarted actor.
    assert "so the task will be retried" in job.stderr + job.stdout
    assert_same_rows(run, baseline)
    m = manifest_of(run)
    assert (m["status"], m["rows"], m["error"]) == ("succeeded", PROMPTS, None)
    # The killed process's records stay (it died mid-batch: `rec`'s, and the other batch it ran at once, if any);
    # the restarted actor's records are all done.
    left = [(r["pid"], r["first"]) for r in records(run)]
    assert (rec["pid"], rec["first"]) in left and {pid for pid, _ in left} == {rec["pid"]} and len(left) <= 2, left


# ---------------------------------------------------------------------------------------------------------------
# Loss of a node



@pytest.mark.slow
@pytest.mark.alone
def test_node_lost_mid_batch_recovers_or_fails_loudly_then_the_rerun_completes(tmp_path, private_ray, baseline):
    cluster = SimulatedCluster(private_ray, tmp_path / "cluster.log", workers=2)
    try:
        env = {**private_ray, "RAY_ADDRESS": cluster.info["address"]}
        cfg = fault_config(tmp_path, "run", max_retries=2)
        run = tmp_path / "run"
        def kill_its_node(rec: dict) -> None:
            assert rec["node_id"] in cluster.info["workers"], (rec, cluster.info)
            assert cluster.ask(f"kill {rec['node_id']}") == {"killed": rec["node_id"]}

        job, rec, status = hit_mid_batch(cfg, run, env, "first", kill_its_node)
        assert "joined the Ray cluster at RAY_ADDRESS=" in job.stdout
        m = manifest_of(run)
        if status == 0:  # Ray restarted the actor on the other worker node and the batch was retried there
            outcome = "recovered in-run"
            assert (m["status"], m["rows"]) == ("succeeded", PROMPTS)
            assert "so the task will be retried" in job.stderr + job.stdout
        else:  # the retries ran out before Ray saw the node was gone: loud, with the actor, its node and the batch
            outcome = "failed loudly, then the rerun completed"
            assert status == 1, job.stderr[-3000:]
            assert m["status"] == "failed"
            assert_names_an_actor_lost_with_its_node(m["error"], rec, run)
            assert f"winnow generate: the job failed: {m['error']}\n" in job.stderr
            again = run_to_end(cfg, env, "second")
            assert again.proc.returncode == 0, again.stderr[-3000:]
            assert "resuming 'test'" in again.stdout
        print(f"node loss with max_retries 2: {outcome}")
        assert_same_rows(run, baseline)
        m = manifest_of(run)
        assert (m["status"], m["rows"], m["error"]) == ("succeeded", PROMPTS, None)
    finally:
        cluster.shutdown()
