"""The progress display of `winnow generate` (pipeline/progress.py): its figures and their text, the look at the run
folder (new committed files only, a resumed run's rows counted once, S3 too), the thread that never fails the run,
and, through the CLI, lines into a file as the run goes."""

from __future__ import annotations

import io
import re
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import job_config, winnow, write_config
from conftest_runs import s3_endpoint  # noqa: F401 (fixture)
from pipeline.progress import Display, Figures, Watcher, duration, figures_text, look_interval, plain_line, style
from runfolder.folder import RunFolder, tally
from schemas.base import InputError
from schemas.rows import empty_cost, error_row, rows_to_table

BAR_CHARS = re.compile("[\r\u2580-\u259f]")  # a carriage return or a block element (tqdm's bar)


def _rows(ids: list[str], reward: float = 0.5, tokens: int = 10, device_s: float = 1.0) -> list[dict]:
    return [{**error_row(i, [{"role": "user", "content": i}], "best_of_n", None), "best_reward": reward,
             "cost": {**empty_cost(), "device_seconds": device_s, "target_tokens": tokens},
             "stats": {"generated_tokens": tokens}} for i in ids]


def _commit(root: Path, base: str, rows: list[dict]) -> None:
    """A write task's data file, then its checkpoint committed, as Ray Data names them."""
    (root / "candidates").mkdir(parents=True, exist_ok=True)
    (root / "_checkpoint").mkdir(parents=True, exist_ok=True)
    pq.write_table(rows_to_table(rows), root / "candidates" / f"{base}-0.parquet")
    pq.write_table(rows_to_table(rows).select(["prompt_id"]), root / "_checkpoint" / f"{base}.parquet")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _figures(**over) -> Figures:
    base = dict(done=24, total=64, before=0, errors=0, tokens_per_s=312.4, mean_best_reward=0.78125,
                device_seconds=3.14, usd=0.0000174, seconds_left=52.0, elapsed_s=41.0)
    return Figures(**{**base, **over})


# ---------------------------------------------------------------------------------------------------------------
# The text


def test_durations_are_short():
    assert [duration(s) for s in (0, 52.2, 99, 100, 840, 5940, 11520)] == [
        "0 s", "52 s", "99 s", "2 min", "14 min", "99 min", "3.2 h"]


def test_a_plain_line_says_every_figure_without_a_carriage_return_or_a_bar():
    line = plain_line(_figures())
    assert line == ("progress: 24/64 prompts, 312 tokens/s, mean best reward 0.7812, 3.1 device-s, 0.000017 USD, "
                    "52 s left, 41 s elapsed")
    assert not BAR_CHARS.search(line) and "\n" not in line


def test_what_is_not_known_yet_is_a_question_mark_and_a_resume_says_what_came_before():
    first = _figures(done=0, tokens_per_s=None, mean_best_reward=None, device_seconds=0, usd=0, seconds_left=None)
    assert figures_text(first) == "? tokens/s, mean best reward ?, 0.0 device-s, 0.000000 USD, ? left"
    resumed = _figures(done=10, before=8, errors=2, mean_best_reward=None)  # rows, none with a reward
    assert figures_text(resumed).startswith("8 before this run, 2 error(s), 312 tokens/s, mean best reward n/a,")


def test_the_style_is_a_bar_on_a_terminal_and_lines_elsewhere_only_when_asked():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    closed = io.StringIO()
    closed.close()
    assert [style(None, Terminal()), style(True, Terminal()), style(False, Terminal())] == ["bar", "bar", None]
    assert [style(None, io.StringIO()), style(True, io.StringIO()), style(False, io.StringIO())] == [
        None, "lines", None]
    assert style(True, closed) == "lines"  # isatty raises on a closed stream: not a terminal


def test_the_seconds_between_looks_come_from_the_environment_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.delenv("WINNOW_PROGRESS_S", raising=False)
    assert look_interval() is None
    monkeypatch.setenv("WINNOW_PROGRESS_S", "0.5")
    assert look_interval() == 0.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("WINNOW_PROGRESS_S", bad)
        with pytest.raises(InputError, match="WINNOW_PROGRESS_S=.*expected a positive number of seconds"):
            look_interval()


def test_a_bad_look_interval_exits_2_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from jobs import generate

    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path))
    monkeypatch.setenv("WINNOW_PROGRESS_S", "often")
    assert generate.main([str(cfg), "--progress"]) == 2
    assert "WINNOW_PROGRESS_S='often': expected a positive number of seconds" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# The look at the run folder


def test_a_look_reads_only_new_files_counts_a_resumed_runs_rows_once_and_times_from_the_first_commit(tmp_path):
    root = tmp_path / "run"
    _commit(root, "w1_000000", _rows(["a", "b"], reward=1.0, tokens=100, device_s=1.8))  # an earlier run's
    folder = RunFolder(str(root))
    before = tally(folder)
    opened: list[str] = []
    real_open = folder.fs.open
    folder.fs.open = lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
    clock = Clock()
    w = Watcher(folder, before, total=8, usd_per_device_hour=3.6, clock=clock)
    f = w.look()
    assert (f.done, f.before, f.total, f.mean_best_reward) == (2, 2, 8, 1.0)
    assert (f.tokens_per_s, f.seconds_left) == (None, None) and opened == []  # the earlier file is not read again
    assert before.rows == 2 and len(before.files) == 1  # the caller's tally is left as it is

    clock.now += 10
    _commit(root, "w1_000001", _rows(["c", "d"], reward=0.0, tokens=40, device_s=1.8))
    f = w.look()  # this run's first commit: the clock of the rates starts here
    assert (f.done, f.mean_best_reward, f.tokens_per_s, f.seconds_left) == (4, 0.5, None, None)
    assert f.device_seconds == pytest.approx(7.2) and f.usd == pytest.approx(0.0072)  # the earlier rows too
    assert [p.rsplit("/", 1)[1] for p in opened] == ["w1_000001-0.parquet"]

    clock.now += 4
    _commit(root, "w1_000002", _rows(["e", "f"], tokens=30))
    (root / "_checkpoint" / "w1_000003.pending.parquet").write_bytes(b"")  # a write in flight: not counted
    f = w.look()
    assert (f.done, f.tokens_per_s, f.seconds_left, f.elapsed_s) == (6, 60 / 4, 2 / (2 / 4), 14.0)
    assert [p.rsplit("/", 1)[1] for p in opened] == ["w1_000001-0.parquet", "w1_000002-0.parquet"]
    clock.now += 1
    assert w.look().done == 6 and len(opened) == 2  # nothing new: nothing read

    _commit(root, "w1_000003", _rows(["g", "h"]))
    f = w.look()
    assert (f.done, f.seconds_left) == (8, 0.0)
    assert f.done == tally(folder).rows  # the same count as the tally after the run


def test_a_look_at_an_s3_folder_sees_new_commits_and_reads_each_file_once(s3_endpoint):  # noqa: F811 (fixture)
    import s3fs

    folder = RunFolder("s3://winnow-test/runs/progress")
    writer = s3fs.S3FileSystem(skip_instance_cache=True)  # another client, as Ray's write tasks are

    def commit(base: str, ids: list[str]) -> None:
        table = rows_to_table(_rows(ids))
        with writer.open(f"winnow-test/runs/progress/candidates/{base}-0.parquet", "wb") as f:
            pq.write_table(table, f)
        with writer.open(f"winnow-test/runs/progress/_checkpoint/{base}.parquet", "wb") as f:
            pq.write_table(table.select(["prompt_id"]), f)

    commit("w1_000000", ["a"])
    w = Watcher(folder, tally(folder), total=3, usd_per_device_hour=1.0)
    opened: list[str] = []
    real_open = folder.fs.open
    folder.fs.open = lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
    assert w.look().done == 1 and opened == []
    commit("w1_000001", ["b", "c"])
    assert w.look().done == 3 and w.look().done == 3
    assert [p.rsplit("/", 1)[1] for p in opened] == ["w1_000001-0.parquet"]


# ---------------------------------------------------------------------------------------------------------------
# The display's thread


def test_lines_go_as_the_run_goes_and_the_last_one_has_the_final_counts(tmp_path):
    root = tmp_path / "run"
    folder = RunFolder(str(root))
    out = io.StringIO()
    display = Display("lines", out, "winnow generate", every=0.05)
    seen = threading.Event()
    with display.shown(folder, tally(folder), total=4, usd_per_device_hour=1.0):
        _commit(root, "w1_000000", _rows(["a", "b"]))
        for _ in range(200):  # until a look has shown the first commit
            if "2/4 prompts" in out.getvalue():
                seen.set()
                break
            threading.Event().wait(0.02)
        _commit(root, "w1_000001", _rows(["c", "d"]))  # committed just before the run's end: the last look sees it
    lines = out.getvalue().splitlines()
    assert seen.is_set() and lines[0].startswith("winnow generate: progress: 0/4 prompts, ")
    assert lines[-1].startswith("winnow generate: progress: 4/4 prompts, ") and "0 s left" in lines[-1]
    assert not any(BAR_CHARS.search(line) for line in lines)
    assert not [t for t in threading.enumerate() if t.name == "winnow-progress"]  # the thread has ended


def test_a_failed_look_is_said_once_and_never_fails_the_run(tmp_path):
    root = tmp_path / "run"
    folder = RunFolder(str(root))
    out, warnings = io.StringIO(), []
    display = Display("lines", out, "winnow generate", every=0.05, warn=warnings.append)
    with display.shown(folder, tally(folder), total=4, usd_per_device_hour=1.0):
        _commit(root, "w1_000000", _rows(["a", "b"]))
        (root / "candidates" / "w1_000000-0.parquet").write_bytes(b"not parquet")  # damaged under the display
        for _ in range(200):
            if warnings:
                break
            threading.Event().wait(0.02)
        threading.Event().wait(0.2)  # several looks' time: the display has stopped, nothing more is said
    assert len(warnings) == 1
    assert warnings[0].startswith("winnow generate: warning: progress display stopped: the run folder could not "
                                  "be read (DamagedFile: ")
    assert warnings[0].endswith("; the run goes on")
    assert out.getvalue().count("\n") == 1  # the first line only: no look after the failure, no last look either


def test_an_output_that_breaks_is_said_once_and_a_failing_run_keeps_its_own_error(tmp_path):
    class Pipe(io.StringIO):
        """A pipe whose reader goes away after the first line (`winnow generate --progress | head -1`)."""

        def write(self, text):
            if self.getvalue():
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    root = tmp_path / "run"
    folder = RunFolder(str(root))
    warnings = []
    display = Display("lines", Pipe(), "winnow generate", every=0.02, warn=warnings.append)
    with pytest.raises(RuntimeError, match="the engine failed"):  # the run's failure, not the display's
        with display.shown(folder, tally(folder), total=4, usd_per_device_hour=1.0):
            for _ in range(200):
                if warnings:
                    break
                threading.Event().wait(0.02)
            raise RuntimeError("the engine failed")
    assert warnings == ["winnow generate: warning: progress display stopped: the progress could not be written "
                        "(BrokenPipeError: [Errno 32] Broken pipe); the run goes on"]


def test_an_interrupt_stops_the_display_at_once_without_a_last_look(tmp_path):
    root = tmp_path / "run"
    folder = RunFolder(str(root))
    out = io.StringIO()
    display = Display("lines", out, "winnow generate", every=60)
    with pytest.raises(KeyboardInterrupt):
        with display.shown(folder, tally(folder), total=4, usd_per_device_hour=1.0):
            _commit(root, "w1_000000", _rows(["a", "b"]))
            raise KeyboardInterrupt
    # the rows committed meanwhile are not read: the run ends without waiting for a look
    assert len(out.getvalue().splitlines()) == 1 and "0/4 prompts" in out.getvalue()
    assert not [t for t in threading.enumerate() if t.name == "winnow-progress"]


def test_on_a_terminal_the_bar_shows_the_same_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")  # what keeps the workers' bars off must not hide this one
    root = tmp_path / "run"
    _commit(root, "w1_000000", _rows(["a"]))
    folder = RunFolder(str(root))
    out = io.StringIO()
    with Display("bar", out, "winnow generate", every=60).shown(folder, tally(folder), 4, 1.0):
        _commit(root, "w1_000001", _rows(["b", "c", "d"]))
    frames = [f for f in out.getvalue().split("\r") if f.strip()]
    assert re.fullmatch(r" 25%\|.*\| 1/4 prompts \[00:00, 1 before this run, \? tok/s, reward 0\.5000, "
                        r"1\.0 device-s, \$0\.000278, \? left\]", frames[0])
    assert re.fullmatch(r"100%\|.*\| 4/4 prompts \[.*, 4\.0 device-s, \$0\.001111, 0 s left\]", frames[-1].strip())


# ---------------------------------------------------------------------------------------------------------------
# Through the CLI


@pytest.mark.slow
def test_generate_with_progress_into_a_file_prints_prompts_done_as_the_run_goes(tmp_path):
    """The issue's test: `winnow generate --progress` with stdout not a terminal (a pipe) prints plain lines of
    prompts done of the total while the calls commit (12 calls of 2 prompts), then the summary. Without --progress
    such a run prints none (tests/test_jobs_generate.py's quiet run)."""
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"limit": 24}, method={"name": "best_of_n", "n": 4}, generation={"max_new_tokens": 24},
        resources={"actors": 1, "prompts_per_call": 2}))
    done = winnow("generate", str(cfg), "--progress", env={"WINNOW_PROGRESS_S": "0.2"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    lines = [line for line in out.splitlines() if line.startswith("winnow generate: progress: ")]
    counts = [int(re.search(r"progress: (\d+)/24 prompts", line).group(1)) for line in lines]
    summary = out.index("| prompts | errors |")
    assert all(out.index(line) < summary for line in lines)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 24  # the last look has the final count
    assert [c for c in counts if 0 < c < 24], f"no count between 0 and 24 while the run went: {counts}"
    assert not BAR_CHARS.search(out)
    assert re.search(r"\|\s+24 \|\s+0 \|", out[summary:])  # the summary's prompts and errors: the same 24
    assert re.search(r"progress: 24/24 prompts, \d+ tokens/s, mean best reward \d\.\d{4}, ", lines[-1])
