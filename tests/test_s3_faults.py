"""S3 faults end to end: `winnow generate` reads its prompts from and writes its run folder to a moto S3 server
through `faulty_proxy.FaultyProxy`, which fails a fraction of the requests (503 SlowDown / ServiceUnavailable,
connections dropped before, after or in the middle of a response) or, in an outage, all of them.

- Transient faults on the read and the write side are retried by the filesystem layer (`stores.filesystems`): the
  run succeeds with every prompt exactly once and the same rows as a clean run straight to moto.
- A sustained outage starting mid-run fails the run (exit 1) without the manifest ever claiming success; once the
  store is back, the same command completes the run exactly once. The failure is said in one line, not a traceback.
- The run folder's lease keeps working when the answer to one of its conditional writes is lost (a retried
  conditional write that did land answers 412: runfolder/lease.py recognises its own write).

``WINNOW_S3_MAX_ATTEMPTS=1 pytest tests/test_s3_faults.py -k transient`` (retries off) fails: the faulty run dies
on the first fault that is not retried.
"""

from __future__ import annotations

import json
import os
import time

import pyarrow.dataset as pads
import pytest
from conftest import job_config, winnow, write_config
from conftest_runs import s3_endpoint  # noqa: F401 (fixture)
from faulty_proxy import FaultyProxy

from runfolder.folder import committed_data_files

pytestmark = pytest.mark.slow

BUCKET = "winnow-test"
PROMPTS = [{"id": f"p{i}", "prompt": f"Write a sentence using these concepts: dog, ball, park, number {i}."}
           for i in range(6)]
SEED = 7  # the proxy's: fixes the sequence of fault decisions on each side
FAULTS = 0.2  # one request in five, on each side. With SEED, the longest streak of faults in the first 400 decisions
# of either side is 4: a client retrying one request at a time (5 attempts by default) always gets through.
LEASE = "_lease.json"
_CLEAN: dict = {}
_OUTAGE: dict = {}


def _is_lease(method: str, target: str) -> bool:
    return LEASE in target.split("?")[0]


def _first_commit(method: str, target: str) -> bool:
    """The copy that commits the first checkpoint (``_checkpoint/F.pending.parquet`` -> ``F.parquet``, on S3 a copy
    then a delete of the pending file)."""
    path = target.split("?")[0]
    return method == "PUT" and "/_checkpoint/" in path and not path.endswith(".pending.parquet")


def _env(endpoint: str) -> dict:
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    return {**env, "AWS_ENDPOINT_URL": endpoint}


def _setup(fs, tmp_path, run: str):
    """The prompts on S3 (once per bucket) and a config reading them and writing s3://BUCKET/runs/RUN."""
    if not fs.exists(f"{BUCKET}/prompts/part-0.jsonl"):
        fs.pipe(f"{BUCKET}/prompts/part-0.jsonl", "".join(json.dumps(r) + "\n" for r in PROMPTS).encode())
    return write_config(tmp_path / f"{run}.yaml", job_config(
        tmp_path, data={"source": f"s3://{BUCKET}/prompts", "limit": None},
        output={"path": f"s3://{BUCKET}/runs/{run}"}))


def _manifest(fs, run: str) -> dict:
    fs.invalidate_cache()
    return json.loads(fs.cat(f"{BUCKET}/runs/{run}/manifest.json"))


def _rows(fs, run: str, committed_only: bool = False) -> dict[str, dict]:
    """prompt_id -> the row's deterministic columns (no timings or cost), asserting each prompt at most once; every
    data file, or only those whose checkpoint is committed (what a resumed run keeps)."""
    fs.invalidate_cache()
    root = f"{BUCKET}/runs/{run}"
    files = committed_data_files(fs, root) if committed_only else sorted(fs.find(f"{root}/candidates"))
    rows = pads.dataset(files, filesystem=fs, format="parquet").to_table().to_pylist() if files else []
    ids = [r["prompt_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"a prompt written more than once: {sorted(ids)}"
    keep = ("prompt_id", "prompt", "method", "best_index", "best_text", "best_reward", "error")
    out = {}
    for r in rows:
        row = {k: r[k] for k in keep}
        row["candidates"] = [(c["text"], c["num_tokens"], c["reward"], c["finish_reason"], c["partial_rewards"])
                             for c in r["candidates"] or []]
        out[r["prompt_id"]] = row
    return out


def _clean_rows(fs, tmp_path) -> dict[str, dict]:
    """The rows of a clean run straight to moto (run once per session; the bucket is emptied between tests)."""
    if "rows" not in _CLEAN:
        cfg = _setup(fs, tmp_path, "clean")
        started = time.monotonic()
        clean = winnow("generate", str(cfg), env=_env(os.environ["AWS_ENDPOINT_URL"]))
        _CLEAN["seconds"] = time.monotonic() - started
        assert clean.returncode == 0, clean.stderr[-3000:]
        _CLEAN["rows"] = _rows(fs, "clean")
        assert sorted(_CLEAN["rows"]) == sorted(r["id"] for r in PROMPTS)
        assert all(r["error"] is None and r["candidates"] for r in _CLEAN["rows"].values())
    return _CLEAN["rows"]


def test_transient_faults_on_reads_and_writes_are_retried(s3_endpoint, tmp_path):  # noqa: F811 (fixture)
    import s3fs

    fs = s3fs.S3FileSystem()
    clean = _clean_rows(fs, tmp_path)
    cfg = _setup(fs, tmp_path, "faulty")
    with FaultyProxy(s3_endpoint, read_fault=FAULTS, write_fault=FAULTS, seed=SEED) as proxy:
        started = time.monotonic()
        run = winnow("generate", str(cfg), env=_env(proxy.url))
        seconds = time.monotonic() - started
        print(f"clean run {_CLEAN['seconds']:.0f} s; faulty run {seconds:.0f} s; {proxy.summary()}")
    assert run.returncode == 0, f"{proxy.summary()}\n{run.stderr[-3000:]}"
    assert proxy.faults("read") > 0 and proxy.faults("write") > 0, proxy.summary()
    assert _rows(fs, "faulty") == clean  # every prompt exactly once, the same rows
    m = _manifest(fs, "faulty")
    assert (m["status"], m["rows"], m["errors"]) == ("succeeded", len(PROMPTS), 0)


OUTAGE_ENV = {
    "WINNOW_S3_MAX_ATTEMPTS": "2",  # fail ~3 s after the outage starts (default 5: ~15 s on 503s; see stores/)
    "WINNOW_LEASE_TTL_S": "4",  # the lease the failed run cannot delete expires before the rerun
}


def _outage_run(fs, tmp_path, run: str = "outage"):
    """Run RUN through the proxy until the first checkpoint commit's copy is done, then through a sustained outage
    (every request answered 503 ServiceUnavailable) until the run ends: one write committed (its pending checkpoint
    left behind, as by a commit cut between copy and delete), the others lost or never started. Once per session."""
    if "proc" not in _OUTAGE:
        cfg = _setup(fs, tmp_path, run)
        with FaultyProxy(os.environ["AWS_ENDPOINT_URL"], seed=SEED, down_kind="unavailable") as proxy:
            proxy.go_down_when(_first_commit)  # mid-run: rows written, more to write
            started = time.monotonic()
            proc = winnow("generate", str(cfg), env={**_env(proxy.url), **OUTAGE_ENV})
            _OUTAGE.update(proc=proc, seconds=time.monotonic() - started, summary=proxy.summary(),
                           down=proxy.down, cfg=cfg, run=run)
        print(f"outage run {_OUTAGE['seconds']:.0f} s, exit {proc.returncode}; {_OUTAGE['summary']}\n"
              f"{proc.stderr[-1500:]}")
    return _OUTAGE


def test_a_sustained_outage_fails_and_the_rerun_completes_exactly_once(s3_endpoint, tmp_path):  # noqa: F811
    import s3fs

    fs = s3fs.S3FileSystem()
    clean = _clean_rows(fs, tmp_path)
    outage = _outage_run(fs, tmp_path)
    failed, run = outage["proc"], outage["run"]
    assert outage["down"], outage["summary"]
    assert failed.returncode == 1, failed.stderr[-3000:]
    m = _manifest(fs, run)  # the outage is over: the store can be read again
    assert m["status"] in ("running", "failed")  # failed where the failure could be recorded; never succeeded
    committed = _rows(fs, run, committed_only=True)
    assert 0 < len(committed) < len(clean), "the outage started mid-run: some rows committed, not all"
    assert all(committed[pid] == clean[pid] for pid in committed)

    started = time.monotonic()
    rerun = winnow("generate", str(outage["cfg"]), env=_env(s3_endpoint))
    print(f"rerun {time.monotonic() - started:.0f} s\n{rerun.stdout[-1500:]}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{len(committed)} already written" in rerun.stdout
    assert "is committed but its pending copy" in rerun.stdout  # the cut commit, settled
    assert _rows(fs, run) == clean  # every prompt exactly once, the same rows
    m = _manifest(fs, run)
    assert (m["status"], m["rows"], m["errors"]) == ("succeeded", len(PROMPTS), 0)


def test_a_sustained_outage_fails_with_a_clear_message(s3_endpoint, tmp_path):  # noqa: F811 (fixture)
    import s3fs

    failed = _outage_run(s3fs.S3FileSystem(), tmp_path)["proc"]
    assert failed.returncode == 1
    # Ray Data logs the failed write task's traceback; the command itself must end on its own one-line reason, not
    # on an exception escaping jobs/generate.py.
    assert 'jobs/generate.py", line' not in failed.stderr, failed.stderr[-3000:]
    assert "winnow generate: the job failed:" in failed.stderr, failed.stderr[-3000:]
    last = [line for line in failed.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("winnow generate:"), failed.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# The run folder's lease (runfolder/lease.py) under lost answers: its conditional writes are retried by the layer
# below, and a retry of a write that did land answers 412. In process, through the proxy (no Ray).


@pytest.fixture
def proxied(s3_endpoint, monkeypatch):  # noqa: F811 (fixture)
    """A FaultyProxy in front of moto, with AWS_ENDPOINT_URL pointing at it for the filesystems made inside."""
    import s3fs

    with FaultyProxy(s3_endpoint, seed=SEED) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3fs.S3FileSystem.clear_instance_cache()  # no filesystem bound to moto directly
        yield proxy
        s3fs.S3FileSystem.clear_instance_cache()  # none bound to the proxy after it


def _lease(run: str):
    from runfolder.lease import Lease, lease_path
    from stores.filesystems import filesystem

    fs, path = filesystem(f"s3://{BUCKET}/runs/{run}")
    return Lease(fs, lease_path(path), "winnow generate", f"output.path: s3://{BUCKET}/runs/{run}")


def test_a_lost_answer_to_the_lease_create_does_not_refuse_the_run(proxied):
    proxied.inject_when(lambda method, target: method == "PUT" and _is_lease(method, target), "lost")
    lease = _lease("lease-create")
    try:
        lease.acquire()  # InputError "... is being written by another run: <this process>" today
    finally:
        lease.release()
    assert proxied.faults("write") == 1, proxied.summary()


def test_a_lost_answer_to_a_lease_renewal_does_not_lose_the_lease(proxied, monkeypatch):
    monkeypatch.setenv("WINNOW_LEASE_TTL_S", "1")  # renewed every 0.25 s
    lease = _lease("lease-renew")
    lease.acquire()
    try:
        proxied.inject_when(lambda method, target: method == "PUT" and _is_lease(method, target), "lost")
        time.sleep(2.5)  # the lost renewal, then renewals for more than the ttl
        assert proxied.faults("write") == 1, proxied.summary()
        assert lease.lost is None, lease.lost
    finally:
        lease.release()
