"""The run folder: who may write into it, what counts as written, the manifest (runfolder/)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from conftest import job_config
from conftest_runs import s3_endpoint  # noqa: F401 (fixture)
from runfolder.folder import (
    RunFolder,
    as_first_spelled,
    changed_keys,
    claim_problems,
    committed_files,
    exactly_once_problems,
    pending_checkpoints,
    settle_checkpoints,
    tally,
)
from runfolder.manifest import finish_manifest, new_manifest
from schemas.config import validate_config
from schemas.manifest import Manifest
from schemas.rows import empty_cost, error_row, rows_to_table


def config(tmp_path, **over):
    return validate_config(job_config(tmp_path, **over))


def test_new_empty_and_same_config_folders_are_claimed(tmp_path):
    cfg = config(tmp_path)
    folder = RunFolder(cfg.output.path)
    assert claim_problems(folder, cfg, overwrite=False) == ([], "new")
    (tmp_path / "run").mkdir()
    assert claim_problems(folder, cfg, overwrite=False) == ([], "new")
    folder.write_manifest(new_manifest(cfg, prompts=4))
    assert claim_problems(folder, cfg, overwrite=False) == ([], "resume")
    assert claim_problems(folder, cfg, overwrite=True) == ([], "overwrite")


def test_a_different_config_is_refused_naming_what_changed(tmp_path):
    cfg = config(tmp_path)
    folder = RunFolder(cfg.output.path)
    folder.write_manifest(new_manifest(cfg, prompts=4))
    other = config(tmp_path, method={"name": "best_of_n", "n": 8}, seed=3)
    problems, _ = claim_problems(folder, other, overwrite=False)
    assert len(problems) == 1
    assert f"output.path: {folder.uri} holds a run of a different config" in problems[0]
    assert "changed: method.n, seed" in problems[0] and "--overwrite" in problems[0]


def test_folders_that_are_not_run_folders_are_never_cleared(tmp_path):
    cfg = config(tmp_path)
    folder = RunFolder(cfg.output.path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        problems, _ = claim_problems(folder, cfg, overwrite=overwrite)
        assert len(problems) == 1 and "holds no manifest.json" in problems[0]
    (tmp_path / "run" / "manifest.json").write_text("{not json")
    problems, _ = claim_problems(folder, cfg, overwrite=False)
    assert "manifest.json is not a Winnow manifest" in problems[0]
    (tmp_path / "file").write_text("x")
    assert "is a file" in claim_problems(RunFolder(str(tmp_path / "file")), cfg, False)[0][0]


def test_one_folder_is_one_run_however_output_path_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = config(tmp_path, output={"path": "run"})  # relative, as the first run spelled it
    RunFolder(first.output.path).write_manifest(new_manifest(first, prompts=4))
    for spelling in ("run/", "./run", str(tmp_path / "run"), str(tmp_path / "run") + "/"):
        again = config(tmp_path, output={"path": spelling})
        folder = RunFolder(again.output.path)
        adopted = as_first_spelled(folder, again)
        assert adopted.output.path == "run" and adopted.hash() == first.hash(), spelling
        assert claim_problems(folder, adopted, overwrite=False) == ([], "resume")
    other = config(tmp_path, output={"path": "run/"}, seed=3)  # another config too: not the same run
    assert as_first_spelled(RunFolder("run/"), other) is other
    problems, _ = claim_problems(RunFolder("run/"), other, overwrite=False)
    assert "changed: output.path, seed" in problems[0]


def test_changed_keys_are_dotted():
    assert changed_keys({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 1, "c": 3}, "e": 1}) == ["a.c", "d", "e"]


def _write(folder: RunFolder, base: str, ids: list[str], committed: bool):
    """A data file as Ray Data names it, with its checkpoint committed or still pending."""
    rows = [error_row(i, [{"role": "user", "content": i}], "best_of_n", "x") if i.startswith("e") else
            {**error_row(i, [{"role": "user", "content": i}], "best_of_n", None), "best_reward": 0.5,
             "cost": {**empty_cost(), "device_seconds": 1.0, "target_tokens": 10}}
            for i in ids]
    (Path(folder.path) / "candidates").mkdir(parents=True, exist_ok=True)
    (Path(folder.path) / "_checkpoint").mkdir(parents=True, exist_ok=True)
    pq.write_table(rows_to_table(rows), Path(folder.path) / "candidates" / f"{base}-0.parquet")
    suffix = ".parquet" if committed else ".pending.parquet"
    pq.write_table(rows_to_table(rows).select(["prompt_id"]), Path(folder.path) / "_checkpoint" / f"{base}{suffix}")


def test_only_rows_with_a_committed_checkpoint_count(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b"], committed=True)
    _write(folder, "w1_000001", ["e1"], committed=True)
    _write(folder, "w1_000002", ["c"], committed=False)  # cut short by a crash: not written
    assert [p.rsplit("/", 1)[1] for p in committed_files(folder)] == ["w1_000000-0.parquet", "w1_000001-0.parquet"]
    assert [p.rsplit("/", 1)[1] for p in pending_checkpoints(folder)] == ["w1_000002.pending.parquet"]
    t = tally(folder)
    assert (t.rows, t.errors, sorted(t.ids)) == (3, 1, ["a", "b", "e1"])
    assert t.mean_best_reward() == 0.5
    cost = t.cost_totals(usd_per_device_hour=3.6)
    assert cost.device_seconds == 2.0 and cost.target_tokens == 20 and abs(cost.usd - 0.002) < 1e-12


def test_a_row_without_cost_is_left_out_of_the_totals_and_counted(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b"], committed=True)
    data = Path(folder.path) / "candidates" / "w1_000000-0.parquet"
    rows = pq.read_table(data).to_pylist()
    rows[1]["cost"]["device_seconds"] = None  # a file Winnow did not write: no device time for "b"
    pq.write_table(rows_to_table(rows), data)
    t = tally(folder)
    cost = t.cost_totals(usd_per_device_hour=3.6)
    assert t.rows == 2 and t.rows_without_cost == 1
    assert cost.device_seconds == 1.0 and cost.target_tokens == 10 and cost.rows_without_cost == 1


def test_the_tally_sums_the_reward_inputs_that_were_cut(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b", "e1"], committed=True)
    data = Path(folder.path) / "candidates" / "w1_000000-0.parquet"
    rows = pq.read_table(data).to_pylist()
    rows[0]["stats"]["reward_inputs_truncated"] = 3
    rows[1]["stats"]["reward_inputs_truncated"] = 1  # the error row's stays null
    pq.write_table(rows_to_table(rows), data)
    assert tally(folder).reward_inputs_truncated == 4


def test_exactly_once_problems():
    assert exactly_once_problems(["a", "b"], ["b", "a"]) == []
    problems = exactly_once_problems(["a", "b", "c"], ["a", "a", "b", "z"])
    assert problems == [
        "1 prompt_id(s) written more than once, e.g. ['a']",
        "1 prompt(s) not written, e.g. ['c']",
        "1 row(s) for prompt_ids not in the prompt set, e.g. ['z']",
    ]


def test_manifest_lifecycle(tmp_path):
    cfg = config(tmp_path)
    folder = RunFolder(cfg.output.path)
    m = new_manifest(cfg, prompts=4)
    folder.write_manifest(m)
    on_disk = Manifest.model_validate(json.loads((tmp_path / "run" / "manifest.json").read_text()))
    assert on_disk.status == "running" and on_disk.config_hash == cfg.hash() and on_disk.finished_at is None
    assert on_disk.config == cfg.model_dump(mode="json") and "ray" in on_disk.packages
    _write(folder, "w_000000", ["a", "e1"], committed=True)
    finish_manifest(m, folder, cfg, tally(folder), "failed", "boom")
    done = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (done["status"], done["rows"], done["errors"], done["error"]) == ("failed", 2, 1, "boom")
    assert done["cost"]["usd"] == 1.0 / 3600 * cfg.cost.usd_per_device_hour
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")] == []


def test_overwrite_clears_only_a_folder_whose_manifest_is_a_winnow_manifest(tmp_path):
    cfg = config(tmp_path)
    folder = RunFolder(cfg.output.path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    for text in ("{not json", json.dumps({"name": "someone else's tool", "version": 3}), "[]"):
        (run / "manifest.json").write_text(text)
        for overwrite in (False, True):
            problems, _ = claim_problems(folder, cfg, overwrite=overwrite)
            assert len(problems) == 1, problems
            assert f"{folder.uri}/manifest.json is not a Winnow manifest" in problems[0]
            assert "even with --overwrite" in problems[0]
            assert "pass --overwrite" not in problems[0]  # never recommended for a folder Winnow did not write
    assert (run / "notes.txt").read_text() == "mine"
    folder.write_manifest(new_manifest(config(tmp_path, seed=7), prompts=1))  # a Winnow run of another config
    problems, _ = claim_problems(folder, cfg, overwrite=True)  # but the user's notes are still there
    assert "holds what Winnow did not write: notes.txt" in problems[0]
    (run / "notes.txt").unlink()
    assert claim_problems(folder, cfg, overwrite=True) == ([], "overwrite")
    problems, _ = claim_problems(folder, cfg, overwrite=False)
    assert "pass --overwrite to replace it" in problems[0]


def test_overwrite_replaces_only_what_a_run_wrote(tmp_path):
    """Issue 26: a finished run folder into which the user put notes and an analysis folder lost both to
    --overwrite. Now --overwrite names what Winnow did not write and refuses; `clear` never deletes it."""
    cfg = config(tmp_path)
    folder = RunFolder(cfg.output.path)
    run = tmp_path / "run"
    folder.write_manifest(new_manifest(config(tmp_path, seed=7), prompts=1))
    _write(folder, "w1_000000", ["a"], committed=True)
    (run / "prompts").mkdir()
    (run / "prompts" / "part-0.parquet").write_bytes(b"x")
    (run / "prompts" / "_COMPLETE.json").write_text("{}")
    assert folder.foreign() == []
    assert claim_problems(folder, cfg, overwrite=True) == ([], "overwrite")
    (run / "notes.txt").write_text("mine")
    (run / "analysis").mkdir()
    (run / "analysis" / "plot.png").write_bytes(b"png")
    (run / "candidates" / "README").write_text("mine too")
    (run / "manifest.json.bak").write_text("{}")
    assert folder.foreign() == ["analysis/", "candidates/README", "manifest.json.bak", "notes.txt"]
    problems, mode = claim_problems(folder, cfg, overwrite=True)
    assert mode == "overwrite" and len(problems) == 1
    assert "holds what Winnow did not write: analysis/, candidates/README, manifest.json.bak, notes.txt" in problems[0]
    assert "deletes nothing else" in problems[0]
    folder.clear()  # even when asked: only Winnow's own entries go
    assert sorted(p.name for p in run.iterdir()) == ["analysis", "candidates", "manifest.json.bak", "notes.txt"]
    assert (run / "notes.txt").read_text() == "mine" and (run / "candidates" / "README").exists()


def _names(folder: RunFolder, sub: str) -> list[str]:
    d = Path(folder.path) / sub
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_settle_keeps_the_data_of_a_commit_cut_between_its_copy_and_its_delete(tmp_path):
    """On S3 the checkpoint's rename is a copy then a delete; cut between them, both names exist. The commit
    completed: the stale pending file goes, the data file stays, and the folder counts the rows once."""
    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b"], committed=True)
    _write(folder, "w1_000001", ["c"], committed=True)
    _write(folder, "w1_000002", ["d"], committed=False)  # a genuinely pending write: left to Ray Data
    ckpt = Path(folder.path) / "_checkpoint"
    (ckpt / "w1_000001.pending.parquet").write_bytes((ckpt / "w1_000001.parquet").read_bytes())
    assert len(pending_checkpoints(folder)) == 2

    lines = settle_checkpoints(folder)
    assert len(lines) == 1 and "w1_000001.pending.parquet" in lines[0] and "kept the data file" in lines[0]
    assert _names(folder, "_checkpoint") == ["w1_000000.parquet", "w1_000001.parquet", "w1_000002.pending.parquet"]
    assert _names(folder, "candidates") == ["w1_000000-0.parquet", "w1_000001-0.parquet", "w1_000002-0.parquet"]
    assert [p.rsplit("/", 1)[1] for p in pending_checkpoints(folder)] == ["w1_000002.pending.parquet"]
    assert sorted(tally(folder).ids) == ["a", "b", "c"]
    assert settle_checkpoints(folder) == []  # settled: a second pass touches nothing


def test_settle_moves_aside_a_committed_checkpoint_whose_data_is_gone(tmp_path):
    """A folder damaged before the fix: the committed checkpoint's data file was deleted by Ray Data's recovery, so
    its prompts would be skipped forever. The checkpoint is moved aside (kept) so they are generated again."""
    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b"], committed=True)
    _write(folder, "w1_000001", ["c"], committed=True)
    (Path(folder.path) / "candidates" / "w1_000001-0.parquet").unlink()
    lines = settle_checkpoints(folder)
    assert len(lines) == 1 and "w1_000001.parquet" in lines[0] and "generated again" in lines[0]
    assert _names(folder, "_checkpoint") == ["w1_000000.parquet"]
    assert _names(folder, "_checkpoint_orphans") == ["w1_000001.parquet"]
    assert _names(folder, "candidates") == ["w1_000000-0.parquet"]
    assert settle_checkpoints(folder) == []


def test_listings_are_read_fresh_from_the_store(s3_endpoint):  # noqa: F811 (fixture)
    """s3fs caches listings per process; the tally after a run must see the files the run wrote (here: another
    client, as Ray's write tasks are), not the listing cached before it."""
    import s3fs

    folder = RunFolder("s3://winnow-test/runs/fresh")
    writer = s3fs.S3FileSystem(skip_instance_cache=True)
    writer.pipe("winnow-test/runs/fresh/manifest.json", b"{}")
    writer.pipe("winnow-test/runs/fresh/_checkpoint/w1_000000.parquet", b"x")
    writer.pipe("winnow-test/runs/fresh/candidates/w1_000000-0.parquet", b"x")
    assert len(committed_files(folder)) == 1 and pending_checkpoints(folder) == []  # listings now cached
    for sub in ("_checkpoint", "candidates"):
        folder.fs.ls(folder.join(sub))  # cached by s3fs from here on
    writer.pipe("winnow-test/runs/fresh/_checkpoint/w1_000001.parquet", b"x")
    writer.pipe("winnow-test/runs/fresh/candidates/w1_000001-0.parquet", b"x")
    writer.pipe("winnow-test/runs/fresh/_checkpoint/w1_000002.pending.parquet", b"x")
    assert [p.rsplit("/", 1)[1] for p in committed_files(folder)] == ["w1_000000-0.parquet", "w1_000001-0.parquet"]
    assert [p.rsplit("/", 1)[1] for p in pending_checkpoints(folder)] == ["w1_000002.pending.parquet"]


def test_an_output_path_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    (tmp_path / "a-file").write_text("x")
    under_file = RunFolder(str(tmp_path / "a-file" / "runs" / "one"))
    problems, _ = claim_problems(under_file, cfg, overwrite=False)
    assert problems == [f"output.path: {under_file.uri} cannot be created: {tmp_path / 'a-file'} is a file, not a "
                        "folder"]
    assert (tmp_path / "a-file").read_text() == "x"

    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    inside = RunFolder(str(locked / "run"))  # tests run as root here, so the permission is denied by stand-in
    problems, _ = claim_problems(inside, cfg, overwrite=True)
    assert problems == [f"output.path: {inside.uri} is not writable: its nearest existing parent {locked} does not "
                        "permit this user to write into it"]
    problems, _ = claim_problems(RunFolder(str(locked)), cfg, overwrite=False)
    assert problems == [f"output.path: {locked} is not writable: the folder does not permit this user to write "
                        "into it"]
    assert claim_problems(RunFolder(str(tmp_path / "fine" / "run")), cfg, False) == ([], "new")


def test_the_prompt_set_is_whole_only_once_marked_and_a_legacy_single_file_is_still_read(tmp_path):
    import pyarrow as pa

    folder = RunFolder(str(tmp_path / "run"))
    table = pa.table({"prompt_id": ["a", "b", "c"]})
    staged, _ = folder.prompts_staging()
    Path(staged).mkdir()
    pq.write_table(table.slice(0, 2), f"{staged}/0.parquet")
    pq.write_table(table.slice(2), f"{staged}/1.parquet")
    (tmp_path / "run" / "prompts").mkdir(parents=True)  # a part left by an interrupted install
    pq.write_table(table.slice(0, 1), str(tmp_path / "run" / "prompts" / "0.parquet"))
    assert not folder.has_prompts()
    folder.install_prompts(staged, 3)
    assert folder.has_prompts() and folder.read_prompt_ids() == ["a", "b", "c"]
    assert folder.prompts_url() == str(tmp_path / "run" / "prompts") and not Path(staged).exists()
    legacy = RunFolder(str(tmp_path / "old"))
    (tmp_path / "old").mkdir()
    pq.write_table(table, str(tmp_path / "old" / "prompts.parquet"))
    assert legacy.has_prompts() and legacy.read_prompt_ids() == ["a", "b", "c"]
    assert legacy.prompts_url() == str(tmp_path / "old" / "prompts.parquet")


def test_the_tally_counts_generated_tokens_candidates_and_rejections_and_the_summary_shows_them(tmp_path):
    from pipeline.job import summary_table

    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b"], committed=True)
    data = Path(folder.path) / "candidates" / "w1_000000-0.parquet"
    rows = pq.read_table(data).to_pylist()
    cand = {"text": "t", "num_tokens": 5, "reward": 0.5, "finish_reason": "eos", "partial_rewards": []}
    rows[0]["candidates"] = [cand, {**cand, "finish_reason": "rejected", "reward": None}, cand]
    rows[0]["stats"]["generated_tokens"] = 15
    rows[1]["candidates"] = [cand]
    rows[1]["stats"]["generated_tokens"] = 5
    pq.write_table(rows_to_table(rows), data)
    t = tally(folder)
    assert (t.generated_tokens, t.candidates, t.rejected) == (20, 4, 1)
    sr = config(tmp_path, method={"name": "speculative_rejection", "n": 4, "alpha": 0.5})
    table = summary_table(t, sr, new_rows=2, seconds=1.0)
    head, _, cells, notes = table.splitlines()
    assert [h.strip() for h in head.split("|")[1:-1]] == [
        "prompts", "errors", "mean best reward", "generated tokens", "candidates", "rejected", "device-seconds", "USD"]
    assert [c.strip() for c in cells.split("|")[1:-1]][3:6] == ["20", "4", "1"]
    assert "all tokens processed = 20 (target 20 + draft 0 + reward 0" in notes
    rows[0]["candidates"][1]["finish_reason"] = "length"
    pq.write_table(rows_to_table(rows), data)
    table = summary_table(tally(folder), sr, new_rows=0, seconds=1.0)
    assert table.splitlines()[-1] == (
        "no candidate was rejected: this run was Best-of-N at Speculative Rejection's price (no prompt's running "
        "candidates reached their KV space: lower method.memory_candidates, or use schedule: fixed)")
    bon = config(tmp_path, method={"name": "best_of_n", "n": 4})
    assert "no candidate was rejected" not in summary_table(tally(folder), bon, new_rows=0, seconds=1.0)
    # and the manifest says it too
    from runfolder.manifest import counted, new_manifest

    assert counted(new_manifest(sr, prompts=2), sr, tally(folder)).no_cut is True
    assert counted(new_manifest(sr, prompts=2), sr, t).no_cut is False
    assert counted(new_manifest(bon, prompts=2), bon, t).no_cut is None


def test_the_manifest_counts_the_reward_forwards_per_prompt_scoring(tmp_path):
    """A prompt scored by the reward model's forwards counts its decisions and its last scoring: two forwards over
    four scorings are half a forward each."""
    from runfolder.manifest import counted, new_manifest

    folder = RunFolder(str(tmp_path / "run"))
    _write(folder, "w1_000000", ["a", "b", "c"], committed=True)
    data = Path(folder.path) / "candidates" / "w1_000000-0.parquet"
    rows = pq.read_table(data).to_pylist()
    rows[0]["stats"].update(reward_steps=1.0, rejection_rounds=2)  # 3 scorings
    rows[1]["stats"].update(reward_steps=1.0, rejection_rounds=0)  # 1
    rows[2]["stats"].update(reward_steps=None, rejection_rounds=1)  # no reward model's forward: not counted
    pq.write_table(rows_to_table(rows), data)
    t = tally(folder)
    assert (t.scorings, t.reward_steps) == (4, 2.0)
    sr = config(tmp_path, method={"name": "speculative_rejection", "n": 4, "alpha": 0.5})
    assert counted(new_manifest(sr, prompts=3), sr, t).reward_forwards_per_scoring == 0.5
    rows = [{**r, "stats": {**r["stats"], "reward_steps": None}} for r in rows]
    pq.write_table(rows_to_table(rows), data)
    assert counted(new_manifest(sr, prompts=3), sr, tally(folder)).reward_forwards_per_scoring is None
