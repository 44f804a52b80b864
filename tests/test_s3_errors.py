"""An S3 store that cannot be used is bad input, said at once: no credentials, an endpoint that cannot be reached (a
closed port), a bucket that does not exist, a refused listing. Every command says it in one line naming the path,
the cause and the fix, exits 2 without a traceback, writes nothing, and does so within seconds: the retries of
`stores.filesystems` are for a flaky store (tests/test_s3_faults.py), not for an absent one.

The stores are a moto S3 server on localhost (`conftest_runs.s3_endpoint`), a port nothing listens on, a fault proxy
(`faulty_proxy.FaultyProxy`) and a tiny server that refuses every request; no real network.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_config, write_config
from conftest_runs import cand, row, s3_endpoint, write_run  # noqa: F401 (fixture)

BUCKET = "winnow-test"  # the bucket s3_endpoint makes
LIMIT_S = 60  # a command's whole wall time on a loaded 2-core machine, imports included; the store's part is seconds


def closed_port() -> int:
    """A local port nothing listens on: connections to it are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_credentials(endpoint: str, home: Path) -> dict:
    """An environment with an S3 endpoint and no AWS credentials anywhere botocore looks (variables, files, the
    instance metadata service)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(home / "none"), AWS_SHARED_CREDENTIALS_FILE=str(home / "none"))
    return env


def with_credentials(endpoint: str) -> dict:
    """An environment with an S3 endpoint and moto's test credentials (no other AWS settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true")
    return env


def run_cli(*args: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """`winnow ARGS` in a subprocess with exactly the environment `env`; (the process, its wall seconds)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, time.monotonic() - started


def assert_bad_input(proc, seconds: float, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])
    assert seconds < LIMIT_S, f"{seconds:.0f} s"


def s3_job(tmp_path: Path, bucket: str = BUCKET, **over) -> Path:
    """A job config reading its prompts from, its target from and its run folder to `bucket`."""
    cfg = job_config(tmp_path, data={"source": f"s3://{bucket}/prompts", "limit": None},
                     models={"target": f"s3://{bucket}/models/target"}, output={"path": f"s3://{bucket}/runs/one"},
                     **over)
    return write_config(tmp_path / "job.yaml", cfg)


NO_CREDENTIALS = "no usable AWS credentials were found"
FIX = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"


# ---------------------------------------------------------------------------------------------------------------
# Through the CLI: every command, each cause


def test_report_and_build_sft_of_an_s3_run_without_credentials_exit_2_at_once(s3_endpoint, tmp_path):  # noqa: F811
    env = no_credentials(s3_endpoint, tmp_path)
    for command in ("report", "build-sft"):
        proc, seconds = run_cli(command, f"s3://{BUCKET}/runs/r", "--out", str(tmp_path / "out"), env=env)
        assert_bad_input(proc, seconds, f"s3://{BUCKET}/runs/r: {NO_CREDENTIALS}", FIX)
        assert len([line for line in proc.stderr.splitlines() if NO_CREDENTIALS in line]) == 1
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))  # nothing written, no lease


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "generate", "plan"])
def test_a_job_on_s3_without_credentials_exits_2_naming_each_path(s3_endpoint, tmp_path, command):  # noqa: F811
    cfg = s3_job(tmp_path)
    extra = ["--sample", "2", "--out", str(tmp_path / "plan")] if command == "plan" else []
    proc, seconds = run_cli(command, str(cfg), *extra, env=no_credentials(s3_endpoint, tmp_path))
    needles = [f"data.source: s3://{BUCKET}/prompts: {NO_CREDENTIALS}",
               f"models.target: s3://{BUCKET}/models/target: {NO_CREDENTIALS}"]
    if command != "plan":  # a plan writes its sweeps under --out, never to output.path
        needles.append(f"output.path: s3://{BUCKET}/runs/one: {NO_CREDENTIALS}")
    assert_bad_input(proc, seconds, *needles)
    assert "run the same command again" not in proc.stderr  # a plan says bad input as bad input
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]  # nothing written: no run, no plan, no lease


@pytest.mark.slow
def test_a_recipe_whose_model_is_on_s3_without_credentials_exits_2(s3_endpoint, tmp_path):  # noqa: F811
    recipe = {"name": "tiny", "out": str(tmp_path / "ei"), "model": f"s3://{BUCKET}/models/round0",
              "reward": {"kind": "lexical"}, "prompts": {"vocabulary": "tiny-world", "train": 8, "heldout": 8},
              "sources": {"bon": {"name": "best_of_n", "n": 2}}, "train": {"cpu_threads": 1}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc, seconds = run_cli("rounds", str(path), env=no_credentials(s3_endpoint, tmp_path))
    assert_bad_input(proc, seconds, f"model: s3://{BUCKET}/models/round0: {NO_CREDENTIALS}")
    assert not (tmp_path / "ei").exists()


@pytest.mark.parametrize("command", ["generate", "report", "build-sft"])
def test_an_endpoint_that_cannot_be_reached_exits_2_within_seconds(tmp_path, command):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = with_credentials(endpoint)
    if command == "generate":
        args = ["generate", str(s3_job(tmp_path))]
        needles = [f"output.path: s3://{BUCKET}/runs/one: cannot reach the S3 endpoint {endpoint}",
                   f"data.source: s3://{BUCKET}/prompts: cannot reach the S3 endpoint {endpoint}",
                   "check AWS_ENDPOINT_URL"]
    else:
        args = [command, f"s3://{BUCKET}/runs/r", "--out", str(tmp_path / "out")]
        needles = [f"s3://{BUCKET}/runs/r: cannot reach the S3 endpoint {endpoint}", "check AWS_ENDPOINT_URL"]
    proc, seconds = run_cli(*args, env=env)
    assert_bad_input(proc, seconds, *needles)
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_a_bucket_that_does_not_exist_is_named(s3_endpoint, tmp_path):  # noqa: F811
    env = with_credentials(s3_endpoint)
    proc, seconds = run_cli("validate", str(s3_job(tmp_path, bucket="no-such-bucket")), env=env)
    assert_bad_input(proc, seconds, "output.path: s3://no-such-bucket/runs/one: the bucket 'no-such-bucket' does not "
                     "exist", "data.source: s3://no-such-bucket/prompts: the bucket", "aws s3 mb s3://no-such-bucket")
    write_run(str(tmp_path / "r"), [row("p1", [cand("a", 0.5)])])
    proc, seconds = run_cli("build-sft", str(tmp_path / "r"), "--out", "s3://no-such-bucket/sft", env=env)
    assert_bad_input(proc, seconds, "--out s3://no-such-bucket/sft: the bucket 'no-such-bucket' does not exist")


# ---------------------------------------------------------------------------------------------------------------
# The probe itself: what is final at once, what is asked again


def test_a_closed_port_is_answered_at_once_and_remembered(monkeypatch):
    from stores.filesystems import _ABSENT, filesystem, store_problem

    endpoint = f"http://127.0.0.1:{closed_port()}"
    for key, value in with_credentials(endpoint).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("WINNOW_S3_MAX_ATTEMPTS", "5")
    _ABSENT.clear()
    fs, path = filesystem(f"s3://{BUCKET}/a")
    started = time.monotonic()
    first = store_problem(fs, path)
    assert first.startswith(f"cannot reach the S3 endpoint {endpoint} (EndpointConnectionError)")
    assert time.monotonic() - started < 10  # one attempt: botocore's 5 with backoff took ~7 s
    fs2, path2 = filesystem(f"s3://{BUCKET}/b/c")
    started = time.monotonic()
    assert store_problem(fs2, path2) == first  # the same bucket: answered from memory
    assert time.monotonic() - started < 0.05


def test_other_stores_are_not_asked():
    from stores.filesystems import filesystem, store_problem

    assert store_problem(*filesystem("/nowhere/at/all")) is None
    assert store_problem(*filesystem("memory://x/y")) is None


class _Refusing(BaseHTTPRequestHandler):
    """An S3 look-alike that answers every request with one S3 error (class attributes: status, code)."""

    status, code = 403, "AccessDenied"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{self.code}</Code><Message>no</Message>"
                "</Error>").encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("status, code, said, asks", [
    (403, "AccessDenied", "denied these credentials a listing of s3://b (403 AccessDenied); grant them s3:ListBucket",
     1),
    (403, "InvalidAccessKeyId", "refused these AWS credentials (403 InvalidAccessKeyId)", 1),
    (404, "NoSuchBucket", "the bucket 'b' does not exist", 1),
    (503, "SlowDown", "answers 503 SlowDown (the store is failing or overloaded)", 3),
])
def test_each_answer_of_a_store_is_said_with_its_fix(monkeypatch, status, code, said, asks):
    from stores.filesystems import filesystem, store_problem

    seen = []

    class Handler(_Refusing):
        def do_GET(self):
            seen.append(self.path)
            super().do_GET()

    Handler.status, Handler.code = status, code
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for key, value in with_credentials(f"http://127.0.0.1:{server.server_address[1]}").items():
            if key.startswith("AWS_"):
                monkeypatch.setenv(key, value)
        monkeypatch.setenv("WINNOW_S3_MAX_ATTEMPTS", "3")
        problem = store_problem(*filesystem("s3://b/run"))
    finally:
        server.shutdown()
        server.server_close()
    assert problem is not None and said in problem, problem
    assert len(seen) == asks  # only a flaky store's answer is asked again, up to WINNOW_S3_MAX_ATTEMPTS times


def test_a_flaky_store_is_asked_again_and_passes(s3_endpoint, monkeypatch):  # noqa: F811
    from faulty_proxy import FaultyProxy

    from stores.filesystems import filesystem, store_problem

    with FaultyProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        for kind in ("slowdown", "reset"):
            proxy.inject_when(lambda method, target: True, kind)
        assert store_problem(*filesystem(f"s3://{BUCKET}/runs/x")) is None
        assert proxy.faults() == 2
