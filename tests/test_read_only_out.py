"""An output folder on a read-only filesystem is bad input: `report`, `build-sft`, `plan` and `generate` exit 2
saying it is not writable, with no traceback and nothing written. The read-only filesystem is a read-only bind mount
made by bubblewrap (root passes every permission check, but not a read-only mount); where bubblewrap cannot make
one, the lease's own refusal is checked with the error injected where the file is created."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, job_config, write_config
from conftest_runs import cand, row, write_run


def _read_only_mounts() -> bool:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    probe = subprocess.run([bwrap, "--dev-bind", "/", "/", "--ro-bind", "/tmp", "/tmp", "sh", "-c",
                            "! touch /tmp/.winnow-ro-probe 2>/dev/null"], capture_output=True)
    return probe.returncode == 0


needs_bwrap = pytest.mark.skipif(not _read_only_mounts(), reason="bubblewrap cannot make a read-only mount here")


def read_only(folder, *args: str) -> subprocess.CompletedProcess:
    """`winnow ARGS` with `folder` mounted read-only."""
    return subprocess.run(["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(folder), str(folder), sys.executable,
                           "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@needs_bwrap
@pytest.mark.slow  # a command per folder kind, in a sandbox each
def test_an_out_on_a_read_only_filesystem_exits_2(tmp_path):
    run = write_run(str(tmp_path / "r"), [row("p1", [cand("a", 0.5)])])
    ro = tmp_path / "ro"
    ro.mkdir()
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, output={"path": str(ro / "run")}))
    cases = {"report": [run, "--out", str(ro / "report")], "build-sft": [run, "--out", str(ro / "sft")],
             "plan": [str(cfg), "--sample", "2", "--out", str(ro / "plan")], "generate": [str(cfg)]}
    for command, args in cases.items():
        proc = read_only(ro, command, *args)
        assert proc.returncode == 2, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "is not writable" in proc.stderr and "read-only filesystem" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert list(ro.iterdir()) == []


def test_a_lease_that_cannot_be_created_is_bad_input(tmp_path, monkeypatch):
    from runfolder.lease import Lease, out_lease_path
    from schemas.base import InputError
    from stores.filesystems import filesystem

    real_open = os.open

    def read_only_open(path, flags, *args):
        if str(path).endswith(".lease.json"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only_open)
    out = str(tmp_path / "out")
    lease = Lease(filesystem(out)[0], out_lease_path(out), "winnow report", f"--out {out}")
    with pytest.raises(InputError, match=rf"^--out {out} is not writable: it is on a read-only filesystem"):
        lease.acquire()
    assert not os.path.exists(out_lease_path(out))
