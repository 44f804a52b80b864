"""Prompts read from and a run folder written to s3:// (a moto S3 server on localhost), resumed there too."""

from __future__ import annotations

import json
import os

import pyarrow.dataset as pads
import pytest

from conftest import job_config, winnow, write_config
from conftest_runs import s3_endpoint  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


def test_generate_from_and_to_s3(s3_endpoint, tmp_path):  # noqa: F811 (fixture)
    import s3fs

    fs = s3fs.S3FileSystem()
    rows = [{"id": f"s{i}", "prompt": f"Write a sentence using these concepts: dog, ball, park {i}."}
            for i in range(3)]
    fs.pipe("winnow-test/prompts/part-0.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"source": "s3://winnow-test/prompts", "limit": None},
        output={"path": "s3://winnow-test/runs/one"}))
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                      "AWS_ENDPOINT_URL")}
    first = winnow("generate", str(cfg), env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads(fs.cat("winnow-test/runs/one/manifest.json"))
    assert (manifest["status"], manifest["rows"], manifest["errors"]) == ("succeeded", 3, 0)
    files = sorted(fs.find("winnow-test/runs/one/candidates"))
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table()
    assert sorted(table.column("prompt_id").to_pylist()) == ["s0", "s1", "s2"]
    assert fs.exists("winnow-test/runs/one/prompts.parquet")
    assert not (tmp_path / "run").exists() and not any(tmp_path.glob("s3*"))

    again = winnow("generate", str(cfg), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "3 already written; nothing left to generate" in again.stdout
    assert sorted(fs.find("winnow-test/runs/one/candidates")) == files
