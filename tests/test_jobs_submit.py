"""The cluster path: a Ray head on loopback started here, `ray job submit --working-dir . -- python -m jobs.generate`.

The head gets its own temp dir (so no other Ray client on this machine discovers it) and free ports; it runs with
`--block` in its own process group, which the test kills at the end (not `ray stop`, which would stop every Ray on
the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head():
    """A single-node Ray cluster on 127.0.0.1 with the dashboard (job server); yields its dashboard URL."""
    gcs, dash, client, agent_http, agent_grpc, env_agent, metrics = free_ports(7)
    temp = tempfile.mkdtemp(prefix="wjs", dir="/tmp")  # short: Ray puts unix sockets under it
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_USAGE_STATS_ENABLED": "0",
           # Ray's token authentication, with a token of this test's own for the head and the `ray job` client.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    env.pop("RAY_ADDRESS", None)
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
         "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
         f"--metrics-export-port={metrics}", f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                    break
            except urllib.error.HTTPError:  # it answered (401 when Ray's token authentication is on): it is up
                break
            except OSError:
                pass
            if head.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"the Ray head did not start:\n{(Path(temp) / 'head.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url, env
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        time.sleep(1)
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of the head's process group is still alive
        except ProcessLookupError:
            pass
        head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_the_generate_entry_point(ray_head, tmp_path):
    url, env = ray_head
    out = tmp_path / "submitted"
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", url, "--working-dir", ".", "--",
         "python", "-m", "jobs.generate", "configs/quickstart.yaml", "--set", "data.limit=3", "--set", "method.n=4",
         "--set", "generation.max_new_tokens=16", "--set", f"output.path={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "succeeded" in text, text[-4000:]
    assert "winnow generate: joined the Ray cluster at RAY_ADDRESS=" in text, text[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["rows"], manifest["errors"]) == ("succeeded", 3, 0)
    rows = pads.dataset(str(out / "candidates"), format="parquet").to_table().to_pylist()
    assert sorted(r["prompt_id"] for r in rows) == ["demo-000", "demo-001", "demo-002"]
    assert all(len(r["candidates"]) == 4 and r["best_text"] is not None for r in rows)

    # A relative output.path would be written inside Ray's unpacked copy of the working directory: refused (exit 2)
    relative = subprocess.run(
        [RAY, "job", "submit", "--address", url, "--working-dir", ".", "--",
         "python", "-m", "jobs.generate", "configs/quickstart.yaml", "--set", "output.path=runs/submitted"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    text = relative.stdout + relative.stderr
    assert relative.returncode != 0, text[-4000:]
    assert "output.path: 'runs/submitted' is inside Ray's copy of this job's working directory" in text, text[-4000:]
    assert "--allow-working-dir-paths" in text
