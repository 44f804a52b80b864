"""Running a finished run's command again ("nothing left to generate") writes nothing: its manifest keeps its
`started_at` and `finished_at` (docs/jobs.md), so `winnow report --plan` still reads the run's own wall-clock."""

from __future__ import annotations

import json

import pytest

from conftest import job_config, write_config
from jobs import generate

pytestmark = pytest.mark.slow


def test_a_no_op_rerun_leaves_the_manifest_byte_for_byte(ray_session, tmp_path, capsys):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, data={"limit": 2}, method={"name": "best_of_n",
                                                                                               "n": 2}))
    assert generate.main([str(cfg)]) == 0
    manifest = tmp_path / "run" / "manifest.json"
    before, stamp = manifest.read_bytes(), manifest.stat().st_mtime_ns
    first = json.loads(before)
    assert first["status"] == "succeeded" and first["finished_at"] >= first["started_at"]
    capsys.readouterr()
    assert generate.main([str(cfg)]) == 0
    assert "2 already written; nothing left to generate" in capsys.readouterr().out
    assert manifest.read_bytes() == before and manifest.stat().st_mtime_ns == stamp

