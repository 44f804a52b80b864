"""`winnow report` and `winnow build-sft` warn, on stderr, about each run that has not finished (its manifest's
status running, failed, or running with nobody holding it: interrupted), naming the run and its status, and still
use the rows it has written."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import winnow
from runfolder.lease import Lease, lease_path
from stores.filesystems import filesystem
from conftest_runs import cand, row, write_run


def _with_status(run: str, status: str, **extra) -> str:
    path = Path(run) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(status=status, **extra)
    path.write_text(json.dumps(manifest))
    return run


def test_report_and_build_sft_warn_about_each_run_that_did_not_finish(tmp_path):
    rows = [row("p1", [cand("a", 0.5)]), row("p2", [cand("b", 0.7)])]
    done = write_run(str(tmp_path / "done"), rows, name="done")
    killed = _with_status(write_run(str(tmp_path / "killed"), rows[:1], name="killed"), "running")
    failed = _with_status(write_run(str(tmp_path / "failed"), rows, name="failed"), "failed",
                          error="RuntimeError: out of memory")
    live = _with_status(write_run(str(tmp_path / "live"), rows, name="live"), "running")
    with Lease(*filesystem(live)[:1], lease_path(live), "winnow generate", f"output.path: {live}"):
        procs = {command: winnow(command, done, killed, failed, live, "--out", str(tmp_path / command))
                 for command in ("report", "build-sft")}
    for command, proc in procs.items():
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
        assert len(warnings) == 3, proc.stderr
        assert warnings[2].startswith(f"winnow {command}: warning: {live} is not finished (status running): it is "
                                      "still being written by a run")
        assert warnings[0].startswith(f"winnow {command}: warning: {killed} is not finished (status interrupted)")
        assert "only the 1 row(s) it has written are used" in warnings[0]
        assert warnings[1].startswith(f"winnow {command}: warning: {failed} is not finished (status failed)")
        assert "RuntimeError: out of memory" in warnings[1]
        assert done not in proc.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(report["runs"]) == 4  # they are still reported
