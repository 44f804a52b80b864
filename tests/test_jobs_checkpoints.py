"""A checkpoint commit cut between its copy and its delete (an S3 rename) loses nothing: end to end on a local
folder, the both-present state made by hand (`runfolder.folder.settle_checkpoints`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from conftest import job_config, write_config
from jobs import generate

pytestmark = pytest.mark.slow


def rows_by_id(run: Path) -> dict[str, dict]:
    rows = pads.dataset(str(run / "candidates"), format="parquet").to_table().to_pylist()
    ids = [r["prompt_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"a prompt written twice: {sorted(ids)}"
    return {r["prompt_id"]: r for r in rows}


def test_a_commit_cut_between_copy_and_delete_keeps_its_rows(ray_session, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path))
    assert generate.main([str(cfg)]) == 0
    before = rows_by_id(run)
    assert len(before) == 4
    committed = sorted(p for p in (run / "_checkpoint").glob("*.parquet"))
    assert committed and not any(p.name.endswith(".pending.parquet") for p in committed)
    assert len(committed) >= 2, "expected the 4 prompts in batches of 2 to make two write tasks"
    cut, redo = committed[0], committed[1]
    base = lambda p: p.name[: -len(".parquet")]  # noqa: E731
    kept = sorted(p.name for p in (run / "candidates").iterdir() if p.name.startswith(base(cut) + "-"))
    kept_ids = {r["prompt_id"] for r in _rows(run / "candidates", kept)}
    shutil.copyfile(cut, cut.with_name(base(cut) + ".pending.parquet"))  # the commit's copy done, its delete not
    for p in (run / "candidates").glob(base(redo) + "-*"):  # and one write lost whole, so the rerun has work
        p.unlink()
    redo.unlink()
    capsys.readouterr()

    assert generate.main([str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"_checkpoint/{cut.name} is committed but its pending copy" in out and "kept the data file" in out
    assert set(kept) <= {p.name for p in (run / "candidates").iterdir()}  # the committed data file survived
    assert not list((run / "_checkpoint").glob("*.pending.parquet"))
    after = rows_by_id(run)  # every prompt exactly once
    assert sorted(after) == sorted(before)
    assert kept_ids and all(after[pid] == before[pid] for pid in kept_ids)  # the kept rows, unchanged
    m = json.loads((run / "manifest.json").read_text())
    assert (m["status"], m["rows"], m["errors"]) == ("succeeded", 4, 0)


def _rows(folder: Path, names: list[str]) -> list[dict]:
    return pads.dataset([str(folder / n) for n in names], format="parquet").to_table().to_pylist()
