"""The lock that runs a test marked `alone` with no other test beside it under pytest-xdist (conftest.machine_share),
taken here by this process and by a second one, as two xdist workers of one run take it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from conftest import ROOT, machine_share

HOLD = """
import sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import machine_share
with machine_share(alone=sys.argv[1] == "alone"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    Path(sys.argv[3]).write_text("done")  # still holding it
"""


def holder(kind: str, seconds: float, done, env: dict) -> subprocess.Popen:
    """A process that holds the lock (`kind`: alone or shared) for `seconds`, then writes `done` and lets it go."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, kind, str(seconds), str(done)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_tests_share_the_machine_two_at_a_time_and_an_alone_one_waits_for_the_other(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)  # a run of its own
    env = dict(os.environ)

    other = holder("shared", 5, tmp_path / "shared-done", env)
    with machine_share(alone=False):
        assert not (tmp_path / "shared-done").exists()  # held beside the other test's
    with machine_share(alone=True):
        assert (tmp_path / "shared-done").exists()  # only once the other test let it go
    assert other.wait(30) == 0

    other = holder("alone", 1, tmp_path / "alone-done", env)
    with machine_share(alone=False):
        assert (tmp_path / "alone-done").exists()  # not beside an alone test
    assert other.wait(30) == 0


def test_without_xdist_the_lock_is_not_taken(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    with machine_share(alone=True), machine_share(alone=True):  # would wait for itself if it were taken
        pass
