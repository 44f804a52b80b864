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
    assert fs.exists("winnow-test/runs/one/prompts/_COMPLETE.json")
    assert not fs.glob("winnow-test/runs/one.prompts-*")  # the staged prompt set was moved in
    assert not (tmp_path / "run").exists() and not any(tmp_path.glob("s3*"))

    again = winnow("generate", str(cfg), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "3 already written; nothing left to generate" in again.stdout
    assert sorted(fs.find("winnow-test/runs/one/candidates")) == files


def test_an_s3_resume_with_work_to_do_after_a_cut_commit_succeeds(s3_endpoint, tmp_path):  # noqa: F811 (fixture)
    """Between two runs on S3: one checkpoint's rename cut between its copy and its delete (both names exist), and
    one write lost whole (data file and checkpoint gone). The rerun keeps the first's rows, regenerates the second's,
    and ends succeeded: its final tally reads the store, not the listing s3fs cached before the run."""
    import s3fs

    fs = s3fs.S3FileSystem()
    root = "winnow-test/runs/cut"
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, output={"path": f"s3://{root}"}))
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                      "AWS_ENDPOINT_URL")}
    first = winnow("generate", str(cfg), env=env)
    assert first.returncode == 0, first.stderr[-3000:]

    def rows() -> dict[str, dict]:
        fs.invalidate_cache()
        table = pads.dataset(sorted(fs.find(f"{root}/candidates")), filesystem=fs, format="parquet").to_table()
        ids = table.column("prompt_id").to_pylist()
        assert len(ids) == len(set(ids)), f"a prompt written twice: {sorted(ids)}"
        return {r["prompt_id"]: r for r in table.to_pylist()}

    before = rows()
    committed = sorted(fs.find(f"{root}/_checkpoint"))
    assert len(before) == 4 and len(committed) >= 2 and not any(p.endswith(".pending.parquet") for p in committed)
    cut, redo = (p.rsplit("/", 1)[1][: -len(".parquet")] for p in committed[:2])
    kept = [p for p in fs.find(f"{root}/candidates") if p.rsplit("/", 1)[1].startswith(cut + "-")]
    kept_ids = set(pads.dataset(kept, filesystem=fs, format="parquet").to_table().column("prompt_id").to_pylist())
    fs.copy(f"{root}/_checkpoint/{cut}.parquet", f"{root}/_checkpoint/{cut}.pending.parquet")
    fs.rm([p for p in fs.find(f"{root}/candidates") if p.rsplit("/", 1)[1].startswith(redo + "-")])
    fs.rm(f"{root}/_checkpoint/{redo}.parquet")

    again = winnow("generate", str(cfg), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"_checkpoint/{cut}.parquet is committed but its pending copy" in again.stdout
    fs.invalidate_cache()
    assert set(kept) <= set(fs.find(f"{root}/candidates"))  # the committed data file survived
    assert not [p for p in fs.find(f"{root}/_checkpoint") if p.endswith(".pending.parquet")]
    after = rows()
    assert sorted(after) == sorted(before) and all(after[pid] == before[pid] for pid in kept_ids)
    manifest = json.loads(fs.cat(f"{root}/manifest.json"))
    assert (manifest["status"], manifest["rows"], manifest["errors"]) == ("succeeded", 4, 0)
