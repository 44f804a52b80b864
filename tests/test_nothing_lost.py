"""Nothing lost, nothing stuck (issue 22, group 3): no command deletes or writes into its own inputs, damaged committed
files are repaired, the manifest keeps its last true state, --out writers take the lease before deciding anything,
clearing deletes the manifest last, leftovers of killed runs are removed, and run folders are never nested."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, job_config, winnow, write_config, write_jsonl
from conftest_runs import cand, row, s3_endpoint, write_run  # noqa: F401 (fixture)
from jobs import build_sft, generate, report
from runfolder.folder import (
    ORPHANS,
    RunFolder,
    clean_leftovers,
    claim_problems,
    nesting_problems,
    settle_checkpoints,
    tally,
)
from runfolder.lease import out_lease_path
from runfolder.manifest import finish_manifest, new_manifest
from runfolder.outputs import OUTPUT_RECORD, check_out, release_out, staged_out
from schemas.config import validate_config
from schemas.rows import empty_cost, error_row, rows_to_table


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _two_runs(tmp_path: Path) -> tuple[str, str]:
    a = write_run(str(tmp_path / "runs" / "a"), [row("p0", [cand("x", 1.0)]), row("p1", [cand("y", 0.5)])], name="a")
    b = write_run(str(tmp_path / "runs" / "b"), [row("p0", [cand("z", 0.7)]), row("p1", [cand("w", 0.2)])], name="b")
    return a, b


# ---------------------------------------------------------------------------------------------------------------
# --out is never an input, and is decided under its lease


@pytest.mark.parametrize("out, extra", [
    ("{a}", ["--overwrite"]),  # the case: the report replaced the run it read
    ("{a}/", ["--overwrite"]),  # another spelling of the same folder
    ("{a}/report", []),  # inside the run
    ("{root}/runs", ["--overwrite"]),  # holds both runs
])
def test_report_and_build_sft_never_write_into_or_replace_an_input_run(tmp_path, capsys, out, extra):
    a, b = _two_runs(tmp_path)
    before = _snapshot(tmp_path / "runs")
    out = out.format(a=a, root=tmp_path)
    for main, args in ((report.main, [a, b]), (build_sft.main, [a, b]), (report.main, [b, "--baseline", a])):
        assert main([*args, "--out", out, *extra]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} " in err and f"input run {a}" in err, err
        assert "a command never writes into or replaces its own input" in err
    assert _snapshot(tmp_path / "runs") == before  # not a byte changed
    assert not list(tmp_path.rglob("*.lease.json")) and not list(tmp_path.rglob("*.tmp-*"))


def test_an_out_inside_an_s3_input_is_refused_however_the_url_is_spelled(s3_endpoint, capsys):  # noqa: F811
    run = write_run("s3://winnow-test/runs/a", [row("p0", [cand("x", 1.0)])], name="a")
    for out in ("s3://winnow-test/runs/a", "s3a://winnow-test/runs/a/", "s3://winnow-test/runs/a/report",
                "s3://winnow-test/runs"):
        assert report.main([run, "--out", out, "--overwrite"]) == 2
        assert "input run s3://winnow-test/runs/a" in capsys.readouterr().err
    import s3fs

    assert s3fs.S3FileSystem().exists("winnow-test/runs/a/manifest.json")
    assert report.main([run, "--out", "s3://winnow-test/runs/a-report"]) == 0  # a prefix that only starts alike


def test_an_out_that_holds_a_run_folder_is_never_replaced(tmp_path, capsys):
    a, _ = _two_runs(tmp_path)
    other = write_run(str(tmp_path / "keep" / "c"), [row("p0", [cand("x", 1.0)])], name="c")
    before = _snapshot(tmp_path / "keep")
    assert report.main([a, "--out", str(tmp_path / "keep"), "--overwrite"]) == 2
    assert f"holds a Winnow run folder ({other})" in capsys.readouterr().err
    assert _snapshot(tmp_path / "keep") == before


HOLD_OUT = """
import sys, time
from runfolder.outputs import check_out
check_out(sys.argv[1], False, [], "winnow report")
print("held", flush=True)
time.sleep(600)
"""


def test_out_is_claimed_under_its_lease_before_its_emptiness_is_decided(tmp_path):
    """The race of the issue: two writers to one --out both found it empty, and the later replaced the earlier. The
    lease is now taken first and kept until the write: a second writer is refused while the first decides and
    writes, and one that comes later finds the first one's files."""
    a, _ = _two_runs(tmp_path)
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", HOLD_OUT, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"  # it has checked --out (empty) and holds it
        second = winnow("report", a, "--out", str(out))
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"--out {out} is being written by another run: winnow report on host" in second.stderr
    assert f"pid {first.pid}" in second.stderr
    assert winnow("report", a, "--out", str(out)).returncode == 0  # free once the holder is gone (killed)
    again = winnow("report", a, "--out", str(out))
    assert again.returncode == 2 and "--out holds an earlier output (written by winnow report); pass --overwrite" in again.stderr
    assert not Path(out_lease_path(str(out))).exists()


def test_a_refused_or_finished_command_gives_the_out_lease_back(tmp_path, capsys):
    a, _ = _two_runs(tmp_path)
    out = tmp_path / "out"
    assert report.main([a, str(tmp_path / "missing"), "--out", str(out)]) == 2  # a bad input after check_out
    capsys.readouterr()
    assert not Path(out_lease_path(str(out))).exists()
    assert report.main([a, "--out", str(out)]) == 0 and build_sft.main([a, "--out", str(tmp_path / "sft")]) == 0
    assert not list(tmp_path.glob("*.lease.json"))


# ---------------------------------------------------------------------------------------------------------------
# Leftovers of killed writers


def test_leftovers_of_killed_out_writers_are_finished_or_removed(tmp_path):
    out = tmp_path / "out"
    t1, t2, t3 = "a" * 12, "b" * 12, "c" * 12
    # killed while writing: a temporary folder alone
    (tmp_path / f"out.tmp-{t1}").mkdir()
    (tmp_path / f"out.tmp-{t1}" / "half.md").write_text("half")
    # killed mid-swap on a local disk: the old folder moved aside, the new one (whole) not yet in place
    (tmp_path / f"out.old-{t2}").mkdir()
    (tmp_path / f"out.old-{t2}" / "report.md").write_text("old")
    (tmp_path / f"out.tmp-{t2}").mkdir()
    (tmp_path / f"out.tmp-{t2}" / "report.md").write_text("new")
    (tmp_path / f"out.tmp-{t2}" / OUTPUT_RECORD).write_text('{"command": "winnow report", "files": ["report.md"]}')
    (tmp_path / "outline.tmp-0123").mkdir()  # not ours: another name
    notes = check_out(str(out), overwrite=True, command="winnow report")
    release_out()
    assert (out / "report.md").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "outline.tmp-0123"]
    assert len(notes) == 2 and any("finished replacing" in n for n in notes)
    # killed after the swap, before deleting the old folder; and a swap cut before the new folder moved in, with
    # no new folder left: the old one is put back
    (tmp_path / f"out.old-{t3}").mkdir()
    check_out(str(out), overwrite=True)
    release_out()
    assert (out / "report.md").read_text() == "new" and not (tmp_path / f"out.old-{t3}").exists()
    os.rename(out, tmp_path / f"out.old-{t3}")
    check_out(str(out), overwrite=True)
    release_out()
    assert (out / "report.md").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir())[0] == "out"


def test_a_killed_writers_lease_file_is_taken_over_and_removed(tmp_path):
    a, _ = _two_runs(tmp_path)
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OUT, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert Path(out_lease_path(str(out))).exists()  # what the kill left
    assert report.main([a, "--out", str(out)]) == 0
    assert not Path(out_lease_path(str(out))).exists()


def test_an_object_store_swap_cut_mid_copy_is_copied_again(s3_endpoint):  # noqa: F811
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.pipe_file("winnow-test/out/report.md", b"old")
    with pytest.raises(KeyboardInterrupt):
        with staged_out("s3://winnow-test/out", "winnow report") as (sfs, tmp):
            sfs.pipe_file(f"{tmp}/report.md", b"new")
            sfs.pipe_file(f"{tmp}/plot.png", b"png")
            original = sfs.copy

            def cut(src, dst, **kw):  # the first object copied, then the kill
                original(src, dst, **kw)
                raise KeyboardInterrupt

            sfs.copy = cut
    fs.invalidate_cache()
    del sfs.copy
    assert [p for p in fs.ls("winnow-test") if ".swap-" in p]  # the mark says a copy was cut
    check_out("s3://winnow-test/out", overwrite=True)
    release_out()
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find("winnow-test")) == [OUTPUT_RECORD, "plot.png", "report.md"]
    assert fs.cat_file("winnow-test/out/report.md") == b"new"


# ---------------------------------------------------------------------------------------------------------------
# A run folder: damaged files, the manifest's last state, clearing, leftovers, nesting


def _write(folder: RunFolder, base: str, ids: list[str]):
    """A committed write as Ray Data names it: candidates/BASE-0.parquet and _checkpoint/BASE.parquet."""
    rows = [{**error_row(i, [{"role": "user", "content": i}], "best_of_n", None), "best_reward": 0.5,
             "cost": {**empty_cost(), "device_seconds": 1.0, "target_tokens": 10}} for i in ids]
    for sub in ("candidates", "_checkpoint"):
        (Path(folder.path) / sub).mkdir(parents=True, exist_ok=True)
    pq.write_table(rows_to_table(rows), Path(folder.path) / "candidates" / f"{base}-0.parquet")
    pq.write_table(rows_to_table(rows).select(["prompt_id"]), Path(folder.path) / "_checkpoint" / f"{base}.parquet")


def _finished_run(tmp_path: Path, ids_per_file: list[list[str]]):
    """A run folder as a finished `winnow generate` leaves it: prompts/, committed rows, manifest succeeded."""
    from pipeline.prompts import INPUT_SCHEMA

    cfg = validate_config(job_config(tmp_path))
    folder = RunFolder(cfg.output.path)
    ids = [i for group in ids_per_file for i in group]
    prompts = Path(folder.path) / "prompts"
    prompts.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"prompt_id": i, "prompt": [{"role": "user", "content": i}],
                                          "concepts": None, "input_error": None, "source_row": n}
                                         for n, i in enumerate(ids)], schema=INPUT_SCHEMA), prompts / "p-0.parquet")
    (prompts / "_COMPLETE.json").write_text(json.dumps({"rows": len(ids)}))
    for n, group in enumerate(ids_per_file):
        _write(folder, f"w_{n:06d}", group)
    finish_manifest(new_manifest(cfg, prompts=len(ids)), folder, cfg, tally(folder), "succeeded")
    return cfg, folder


@pytest.mark.parametrize("damage", ["empty", "truncated", "not parquet", "other rows"])
def test_a_damaged_committed_file_is_moved_aside_and_named_so_its_prompts_are_generated_again(tmp_path, damage):
    _, folder = _finished_run(tmp_path, [["a", "b"], ["c", "d"]])
    victim = Path(folder.path) / "candidates" / "w_000001-0.parquet"
    whole = victim.read_bytes()
    victim.write_bytes({"empty": b"", "truncated": whole[: len(whole) // 2], "not parquet": b"hello"}.get(
        damage, whole))
    if damage == "other rows":
        pq.write_table(pq.read_table(Path(folder.path) / "candidates" / "w_000000-0.parquet"), victim)
    [line] = settle_checkpoints(folder)
    assert line.startswith("candidates/w_000001-0.parquet is damaged (")
    assert f"moved it to {ORPHANS}/damaged/" in line and "generated again" in line
    run = Path(folder.path)
    assert sorted(p.name for p in (run / "candidates").iterdir()) == ["w_000000-0.parquet"]
    assert sorted(p.name for p in (run / "_checkpoint").iterdir()) == ["w_000000.parquet"]
    assert (run / ORPHANS / "damaged" / "w_000001-0.parquet").exists() and (run / ORPHANS / "w_000001.parquet").exists()
    assert sorted(tally(folder).ids) == ["a", "b"]
    assert settle_checkpoints(folder) == []


def test_resume_repairs_a_damaged_file_and_the_manifest_never_says_less_than_it_knows(tmp_path, monkeypatch):
    """The issue's case: a committed candidates file cut to 0 bytes blocked every resume (`<Buffer>`, no file named)
    and the manifest went from succeeded to running with 0 rows. Now the resume moves the file aside, the manifest
    says running with the rows that are really there, and the prompts are written again."""
    from pipeline import job

    cfg, folder = _finished_run(tmp_path, [["a", "b"], ["c", "d"]])
    (Path(folder.path) / "candidates" / "w_000001-0.parquet").write_bytes(b"")
    seen = {}

    def fake_run(config, run_folder, **_):  # Ray's pipeline: writes the prompts not yet written
        seen["manifest"] = json.loads((Path(folder.path) / "manifest.json").read_text())
        _write(run_folder, "w_000002", ["c", "d"])

    monkeypatch.setattr(job, "run", fake_run)
    lines = []
    outcome = job.execute(job.CheckedJob(cfg, folder, "resume"), None, log=lines.append)
    assert (seen["manifest"]["status"], seen["manifest"]["rows"]) == ("running", 2)
    assert any("candidates/w_000001-0.parquet is damaged" in line for line in lines)
    assert outcome.status == "succeeded" and sorted(outcome.tally.ids) == ["a", "b", "c", "d"]
    m = json.loads((Path(folder.path) / "manifest.json").read_text())
    assert (m["status"], m["rows"]) == ("succeeded", 4)


def test_a_resume_that_cannot_count_the_folder_leaves_the_manifest_as_it_was(tmp_path, monkeypatch):
    from pipeline import job

    cfg, folder = _finished_run(tmp_path, [["a", "b"]])
    before = (Path(folder.path) / "manifest.json").read_text()

    def outage(_folder):
        raise OSError("the store does not answer")

    monkeypatch.setattr(job, "tally", outage)
    with pytest.raises(OSError):
        job.execute(job.CheckedJob(cfg, folder, "resume"), None, log=lambda line: None)
    assert (Path(folder.path) / "manifest.json").read_text() == before


def test_a_finished_run_resumed_keeps_saying_succeeded(tmp_path, monkeypatch):
    from pipeline import job

    cfg, folder = _finished_run(tmp_path, [["a", "b"]])
    writes = []
    original = RunFolder.write_manifest
    monkeypatch.setattr(RunFolder, "write_manifest", lambda self, m: (writes.append(m.status), original(self, m)))
    monkeypatch.setattr(job, "run", lambda *a, **kw: pytest.fail("nothing is left to generate"))
    assert job.execute(job.CheckedJob(cfg, folder, "resume"), None, log=lambda line: None).status == "succeeded"
    assert writes == []  # nothing left to do: never rewritten, as running or at all (its times are kept)


def test_clearing_deletes_the_data_first_and_the_manifest_last(tmp_path, monkeypatch):
    cfg, folder = _finished_run(tmp_path, [["a", "b"]])
    (Path(folder.path) / "_inflight").mkdir()
    order = []
    original = folder.fs.rm

    def rm(path, recursive=False):
        order.append(Path(path).name)
        if len(order) == 3:
            raise KeyboardInterrupt  # killed mid-clear
        return original(path, recursive=recursive)

    monkeypatch.setattr(folder.fs, "rm", rm)
    with pytest.raises(KeyboardInterrupt):
        folder.clear()
    assert order[0] == "candidates" and (Path(folder.path) / "manifest.json").exists()
    # a kill mid-clear leaves a Winnow run folder, which --overwrite can still clear
    assert claim_problems(folder, validate_config(job_config(tmp_path, seed=5)), overwrite=True) == ([], "overwrite")
    order.clear()
    monkeypatch.setattr(folder.fs, "rm", lambda path, recursive=False: (order.append(Path(path).name),
                                                                         original(path, recursive=recursive)))
    folder.clear()
    assert order[-2:] == ["_checkpoint", "manifest.json"] and list(Path(folder.path).iterdir()) == []


def test_leftovers_of_killed_runs_are_removed_by_the_next_run(tmp_path):
    _, folder = _finished_run(tmp_path, [["a"]])
    run = Path(folder.path)
    stale = tmp_path / "run.prompts-0123456789ab"
    stale.mkdir()
    (stale / "part.parquet").write_bytes(b"x")
    ours = tmp_path / "run.prompts-aaaaaaaaaaaa"  # this run's own staging
    ours.mkdir()
    not_ours = tmp_path / "run.prompts-bbbbbbbbbbbb"  # somebody's run folder that happens to be named so
    not_ours.mkdir()
    (not_ours / "manifest.json").write_text("{}")
    (run / ".manifest.json.0a1b2c3d.tmp").write_text("{")
    lines = clean_leftovers(folder, keep=str(ours))
    assert len(lines) == 2
    assert not stale.exists() and ours.exists() and not_ours.exists()
    assert not (run / ".manifest.json.0a1b2c3d.tmp").exists() and (run / "manifest.json").exists()


def test_run_folders_are_never_nested_nor_inside_or_around_their_source(tmp_path, capsys, monkeypatch):
    """A run folder created inside another run's prompts/ broke that run's resume (its files were read as
    prompts); the check runs before Ray starts and nothing is written."""
    from pipeline import job

    monkeypatch.setattr(job, "connect", lambda: pytest.fail("Ray must not start for bad input"))
    _finished_run(tmp_path, [["a"]])
    before = _snapshot(tmp_path / "run")
    data = tmp_path / "data"
    data.mkdir()
    src = write_jsonl(data / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    cases = [
        ({"output": {"path": str(tmp_path / "run" / "prompts" / "inner")}},
         f"is inside the run folder {tmp_path / 'run'}; a run folder inside another breaks that run's resume"),
        ({"output": {"path": str(data / "run")}, "data": {"source": str(data)}},
         f"output.path: {data / 'run'} is inside the data source data.source: {data}"),
        ({"output": {"path": str(data)}, "data": {"source": str(src)}},
         f"output.path: {data} holds the data source data.source: {src}"),
        ({"output": {"path": str(tmp_path)}}, f"holds the run folder {tmp_path / 'run'}; run folders are never nested"),
    ]
    for over, needle in cases:
        cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, **over))
        assert generate.main([str(cfg)]) == 2
        err = capsys.readouterr().err
        assert needle in err, err
    assert _snapshot(tmp_path / "run") == before
    assert not (tmp_path / "run" / "prompts" / "inner").exists() and not (data / "run").exists()
    assert nesting_problems(RunFolder(str(tmp_path / "apart")), str(src)) == []
    assert nesting_problems(RunFolder(str(tmp_path / "run")), str(src)) == []  # the run itself: not nested
