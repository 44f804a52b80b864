"""Run folders are compared by their resolved paths: the same run given twice, through a symbolic link or another
spelling, is refused as given twice, as a literal duplicate is."""

from __future__ import annotations

import os

import pytest

from conftest import winnow
from conftest_runs import cand, row, write_run


@pytest.fixture
def runs(tmp_path):
    run = write_run(str(tmp_path / "runs" / "r"), [row("p1", [cand("a", 0.5)]), row("p2", [cand("b", 0.7)])],
                    name="r")
    os.symlink(tmp_path / "runs", tmp_path / "runs_link")
    os.symlink(tmp_path / "runs" / "r", tmp_path / "r_link")
    return run


@pytest.mark.parametrize("command", ["report", "build-sft"])
def test_the_same_run_through_a_link_is_given_twice(tmp_path, runs, command):
    others = [str(tmp_path / "r_link"), str(tmp_path / "runs_link" / "r"), f"{tmp_path}/runs/./r", "runs_link/r/"]
    proc = winnow(command, runs, *others, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for other in others:
        assert f"{other.rstrip('/')}: run folder given twice (as {runs})" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_baseline_that_is_one_of_the_runs_through_a_link_is_that_run(tmp_path, runs):
    other = write_run(str(tmp_path / "runs" / "q"), [row("p1", [cand("a", 0.2)]), row("p2", [cand("b", 0.1)])],
                      name="q")
    proc = winnow("report", runs, other, "--baseline", str(tmp_path / "r_link"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["runs"]) == 2  # the baseline was not added a second time
