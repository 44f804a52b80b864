"""The lease on a folder Winnow writes (runfolder/lease.py): one writer at a time, on a local disk (flock) and on S3
(conditional writes and a heartbeat), taken over safely from a run that is gone; and what the commands do with it."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from conftest import ROOT, job_config, winnow, write_config
from conftest_runs import cand, row, s3_endpoint, write_run  # noqa: F401 (fixture)
from runfolder.lease import LEASE_FILE, Holder, Lease, holder_of, lease_path, out_lease_path
from runfolder.runs import load_run
from schemas.base import InputError
from stores.filesystems import filesystem

HOLD = """
import sys, time
from runfolder.lease import Lease
from stores.filesystems import filesystem
fs, path = filesystem(sys.argv[1])
lease = Lease(fs, path, "a test holder", sys.argv[1])
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_in_subprocess(lease_file: str) -> subprocess.Popen:
    """Another process holding `lease_file`; returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, lease_file], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_local_lease_refuses_a_second_holder_and_names_the_first(tmp_path):
    folder = tmp_path / "run"
    fs, path = filesystem(str(folder))
    with Lease(fs, lease_path(path), "winnow generate", "output.path: run") as first:
        assert folder.is_dir() and (folder / LEASE_FILE).exists()
        holder = holder_of(fs, lease_path(path))
        assert holder is not None and holder.pid == os.getpid() and holder.token == first.holder.token
        with pytest.raises(InputError) as err:
            Lease(fs, lease_path(path), "winnow generate", "output.path: run").acquire()
        message = str(err.value)
        assert "output.path: run is being written by another run: winnow generate on host" in message
        assert f"pid {os.getpid()}, started {first.holder.started_at}" in message
    assert holder_of(fs, lease_path(path)) is None
    assert not folder.exists()  # the lease made the folder, nothing else was written: it goes again


def test_a_reader_waits_for_a_fresh_holder_to_write_its_name(tmp_path):
    """A run locks the lease file, then writes who it is: a second run reading in between (two runs started
    together, seen in CI) waits for the name instead of saying "another process on host ?"."""
    import fcntl

    path = str(tmp_path / LEASE_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    holder = Holder("winnow generate", "here", 1, "now", "t", 0.0, 1.0)
    writes = threading.Timer(0.3, lambda: os.pwrite(fd, holder.encode(), 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held, the file still empty
        writes.start()
        seen = holder_of(filesystem(path)[0], path)
    finally:
        writes.join()
        os.close(fd)
    assert seen is not None and seen.describe() == holder.describe()


def test_a_local_lease_of_a_killed_process_is_free_at_once_and_taken_over(tmp_path):
    fs, path = filesystem(str(tmp_path / "run"))
    proc = hold_in_subprocess(lease_path(path))
    try:
        held = holder_of(fs, lease_path(path))
        assert held is not None and held.pid == proc.pid and held.command == "a test holder"
        with pytest.raises(InputError, match=f"pid {proc.pid}"):
            Lease(fs, lease_path(path), "winnow generate", "run").acquire()
    finally:
        proc.kill()
        proc.wait()
    assert holder_of(fs, lease_path(path)) is None  # the kernel dropped the lock with the process
    with Lease(fs, lease_path(path), "winnow generate", "run") as lease:
        assert lease.taken_over is not None and lease.taken_over.pid == proc.pid


def test_an_s3_lease_is_exclusive_kept_alive_and_released(s3_endpoint, monkeypatch):  # noqa: F811 (fixture)
    monkeypatch.setenv("WINNOW_LEASE_TTL_S", "1")
    fs, path = filesystem("s3://winnow-test/runs/leased")
    first = Lease(fs, lease_path(path), "winnow generate", "output.path: s3://winnow-test/runs/leased")
    first.acquire()
    try:
        time.sleep(2.5)  # past the ttl: only the heartbeat keeps it
        holder = holder_of(fs, lease_path(path))
        assert holder is not None and holder.token == first.holder.token
        with pytest.raises(InputError, match="is being written by another run: winnow generate on host"):
            Lease(fs, lease_path(path), "winnow generate", "x").acquire()
        assert first.lost is None
    finally:
        first.release()
    assert not fs.exists(lease_path(path)) and holder_of(fs, lease_path(path)) is None


def _abandoned(fs, path: str, age_s: float) -> Holder:
    """A lease left by a killed run: its last heartbeat `age_s` ago."""
    holder = Holder("winnow generate", "gone-host", 4242, "2026-01-01T00:00:00Z", "dead", time.time() - age_s, 1.0)
    fs.pipe_file(lease_path(path), holder.encode())
    return holder


def test_an_expired_s3_lease_is_taken_over_by_exactly_one_of_two_runs(s3_endpoint, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WINNOW_LEASE_TTL_S", "30")
    fs, path = filesystem("s3://winnow-test/runs/abandoned")
    _abandoned(fs, path, age_s=5)  # expired (its ttl was 1 s)
    assert holder_of(fs, lease_path(path)) is None
    takers = [Lease(fs, lease_path(path), "winnow generate", "run") for _ in range(2)]
    outcomes: list = [None, None]
    start = threading.Barrier(2)

    def take(i: int) -> None:
        start.wait()
        try:
            takers[i].acquire()
            outcomes[i] = "held"
        except InputError as err:
            outcomes[i] = str(err)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert outcomes.count("held") == 1, outcomes
        winner = takers[outcomes.index("held")]
        assert winner.taken_over is not None and winner.taken_over.host == "gone-host"
        assert "is being written by another run" in outcomes[1 - outcomes.index("held")]
        assert holder_of(fs, lease_path(path)).token == winner.holder.token
    finally:
        for t in takers:
            t.release()


def test_a_live_s3_lease_is_not_taken_over_and_a_stolen_one_is_reported_lost(s3_endpoint, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WINNOW_LEASE_TTL_S", "1")
    fs, path = filesystem("s3://winnow-test/runs/stolen")
    lease = Lease(fs, lease_path(path), "winnow generate", "run")
    lease.acquire()
    try:
        fs.pipe_file(lease_path(path), Holder("intruder", "h", 1, "t", "other", time.time() + 60, 1.0).encode())
        deadline = time.monotonic() + 10
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lease.lost is not None and "taken over by intruder on host h" in lease.lost
    finally:
        lease.release()
    assert fs.exists(lease_path(path))  # not ours any more: the release leaves it alone


def test_an_expired_lease_on_a_store_without_conditional_writes_is_not_taken_over(tmp_path):
    fs, path = filesystem("memory://winnow-lease-test/run")
    _abandoned(fs, path, age_s=500)
    try:
        with pytest.raises(InputError, match="no conditional writes to take it over safely: once sure that run is "
                                             "gone, delete the file"):
            Lease(fs, lease_path(path), "winnow generate", "run").acquire()
    finally:
        fs.rm(path, recursive=True)


def test_a_manifest_left_running_reads_as_interrupted_unless_the_run_holds_its_lease(tmp_path):
    uri = write_run(str(tmp_path / "r"), [row("p0", [cand("a", 1.0)])])
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    manifest["status"] = "running"
    (tmp_path / "r" / "manifest.json").write_text(json.dumps(manifest))
    assert load_run(uri).status == "interrupted"
    fs, path = filesystem(uri)
    proc = hold_in_subprocess(lease_path(path))
    try:
        assert load_run(uri).status == "running"
    finally:
        proc.kill()
        proc.wait()
    assert load_run(uri).status == "interrupted"


def test_generate_on_a_folder_another_run_holds_exits_2_naming_it(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path))
    fs, path = filesystem(str(tmp_path / "run"))
    proc = hold_in_subprocess(lease_path(path))
    try:
        out = winnow("generate", str(cfg))
    finally:
        proc.kill()
        proc.wait()
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"output.path: {tmp_path / 'run'} is being written by another run: a test holder on host" in out.stderr
    assert f"pid {proc.pid}" in out.stderr
    assert [p.name for p in (tmp_path / "run").iterdir()] == [LEASE_FILE]  # nothing written


def test_build_sft_and_report_refuse_an_out_another_process_writes(tmp_path):
    run = write_run(str(tmp_path / "r"), [row("p0", [cand("a", 1.0)])])
    out = tmp_path / "out"
    proc = hold_in_subprocess(out_lease_path(str(out)))
    try:
        sft = winnow("build-sft", run, "--out", str(out))
        rep = winnow("report", run, "--out", str(out))
    finally:
        proc.kill()
        proc.wait()
    for res in (sft, rep):
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"--out {out} is being written by another run: a test holder on host" in res.stderr
    assert not out.exists()
    assert winnow("build-sft", run, "--out", str(out)).returncode == 0  # free again once the holder is gone
    assert not Path(out_lease_path(str(out))).exists()


def _rows(run: Path) -> list[dict]:
    return pads.dataset(str(run / "candidates"), format="parquet").to_table().to_pylist()


@pytest.mark.slow
def test_two_runs_started_together_on_one_folder_write_each_prompt_once(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path))
    cmd = [sys.executable, "-m", "jobs.generate", str(cfg)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(600), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [(c, e[-1500:]) for c, _, e in results]
    loser = next(err for code, _, err in results if code == 2)
    assert "is being written by another run: winnow generate on host" in loser
    ids = [r["prompt_id"] for r in _rows(tmp_path / "run")]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert not (tmp_path / "run" / LEASE_FILE).exists()


@pytest.mark.slow
def test_sigterm_as_from_ray_job_stop_ends_the_run_as_interrupted_and_it_resumes(tmp_path):
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"limit": 12}, method={"name": "best_of_n", "n": 8}, generation={"max_new_tokens": 32},
        resources={"actors": 1, "prompts_per_call": 1}))
    proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", str(cfg)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "candidates").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        _, err = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the local Ray the driver started
        except ProcessLookupError:
            pass
    assert code == 130, err[-3000:]
    assert "interrupted; run the same command again to resume" in err
    manifest = json.loads((run / "manifest.json").read_text())
    assert (manifest["status"], manifest["error"]) == ("failed", "interrupted")
    assert not (run / LEASE_FILE).exists()
    again = winnow("generate", str(cfg))
    assert again.returncode == 0, again.stderr[-3000:]
    ids = [r["prompt_id"] for r in _rows(run)]
    assert collections.Counter(ids).most_common(1)[0][1] == 1 and len(ids) == json.loads(
        (run / "manifest.json").read_text())["prompts"]
