"""The progress of a running `winnow generate`: prompts done of the total, generated tokens per second, the mean best
reward and the cost so far, and the time left.

Where the figures come from: the run folder's committed data files, the same source of truth as the final summary
(`runfolder.folder.tally`). A call's rows commit together when its last prompt ends, so the count moves a call
(`resources.prompts_per_call` prompts) at a time. A thread of the driver looks at the folder every few seconds
(`Watcher.look`): it lists the checkpoint and candidates folders (`runfolder.folder.committed_files`) and reads only
the files committed since its last look, and of them only the columns the tally reads (`Tally.add_file`). So a look
at an S3 folder costs a few listings and the new files. The rows a resumed run found are the tally `execute` made
before the run: they are counted in once and never read again.

The rates are this run's own, from its first commit on: prompts and generated tokens committed after it, per second
since it landed. Before a second commit lands they are not known ("?"). The time left is the prompts left at that
rate.

How they are shown (`Display`): a bar (tqdm) on a terminal; one plain line per look elsewhere (a file, a pipe,
`ray job submit`'s logs), with no carriage return and no bar characters. The display never fails the run: a look that
fails is said once as a warning, and the display stops there. It stops with the run: on success after a last look
(its line has the final counts), on a failure or an interrupt at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Callable, TextIO

from runfolder.folder import RunFolder, Tally, committed_files
from schemas.base import InputError

ENV_EVERY_S = "WINNOW_PROGRESS_S"  # seconds between two looks at the run folder
EVERY_S = {"bar": 2.0, "lines": 5.0}  # the default, per style: a bar redraws often; a log gets a line a few seconds
STOP_WAIT_S = 5.0  # how long the end of a run waits for a look in progress (a slow store) before it goes on


@dataclass(frozen=True)
class Figures:
    """What one look saw. Rates and the time left are None while not known."""

    done: int  # prompts written, earlier runs' included
    total: int  # prompts in the prompt set
    before: int  # prompts written before this run
    errors: int  # error rows among `done`
    tokens_per_s: float | None  # generated tokens (stats.generated_tokens) per second, this run's
    mean_best_reward: float | None  # over the rows written with a reward
    device_seconds: float
    usd: float
    seconds_left: float | None
    elapsed_s: float  # since this run's display started


def duration(seconds: float) -> str:
    """A short duration: ``52 s``, ``14 min``, ``3.2 h``."""
    if seconds < 99.5:
        return f"{seconds:.0f} s"
    if seconds < 99.5 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def figures_text(f: Figures, short: bool = False) -> str:
    """The figures after the prompt count, as both styles show them (`short`: the bar's words, which a terminal's
    width must hold)."""
    reward = ("?" if f.done == 0 else "n/a") if f.mean_best_reward is None else f"{f.mean_best_reward:.4f}"
    parts = [
        f"{f.before} before this run" if f.before else None,
        f"{f.errors} error(s)" if f.errors else None,
        ("?" if f.tokens_per_s is None else f"{f.tokens_per_s:.0f}") + (" tok/s" if short else " tokens/s"),
        f"{'reward' if short else 'mean best reward'} {reward}",
        f"{f.device_seconds:.1f} device-s",
        f"${f.usd:.6f}" if short else f"{f.usd:.6f} USD",
        ("? left" if f.seconds_left is None else f"{duration(f.seconds_left)} left"),
    ]
    return ", ".join(p for p in parts if p)


def plain_line(f: Figures) -> str:
    """One look as a plain line (no carriage return, no bar characters)."""
    return f"progress: {f.done}/{f.total} prompts, {figures_text(f)}, {duration(f.elapsed_s)} elapsed"


class Watcher:
    """The run folder's progress, look by look: the tally of the rows written before the run (`before`, as
    `runfolder.folder.tally` counted them) grows by the files committed since, each read once."""

    def __init__(self, folder: RunFolder, before: Tally, total: int, usd_per_device_hour: float,
                 clock: Callable[[], float] = time.monotonic):
        self.folder, self.total, self.usd_per_device_hour, self.clock = folder, total, usd_per_device_hour, clock
        self.tally = replace(before, ids=list(before.ids), best_rewards=list(before.best_rewards),
                             cost=dict(before.cost), files=list(before.files))  # the caller's is left as it is
        self.seen = set(before.files)
        self.before = before.rows
        self.started = clock()
        self.first: tuple[float, int, int] | None = None  # (when, rows, generated tokens) at this run's first commit

    def look(self) -> Figures:
        """List the committed files, count the new ones in, and say the figures. Raises what the store raises."""
        for path in committed_files(self.folder):
            if path not in self.seen:
                self.tally.add_file(self.folder.fs, path)
                self.seen.add(path)
        return self.figures()

    def figures(self) -> Figures:
        """The figures of what has been counted so far, at the clock's time."""
        t, now = self.tally, self.clock()
        if self.first is None and t.rows > self.before:
            self.first = (now, t.rows, t.generated_tokens)
        rate = tokens = None
        if self.first is not None and now > self.first[0] and t.rows > self.first[1]:
            rate = (t.rows - self.first[1]) / (now - self.first[0])
            tokens = (t.generated_tokens - self.first[2]) / (now - self.first[0])
        left = max(self.total - t.rows, 0)
        cost = t.cost_totals(self.usd_per_device_hour)
        return Figures(
            done=t.rows, total=self.total, before=self.before, errors=t.errors, tokens_per_s=tokens,
            mean_best_reward=t.mean_best_reward(), device_seconds=cost.device_seconds, usd=cost.usd,
            seconds_left=0.0 if left == 0 else (left / rate if rate else None), elapsed_s=now - self.started,
        )


def look_interval() -> float | None:
    """`WINNOW_PROGRESS_S`, the seconds between two looks, or None when unset (each style's default). InputError
    when it is not a positive number."""
    raw = os.environ.get(ENV_EVERY_S, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{ENV_EVERY_S}={raw!r}: expected a positive number of seconds between two progress looks; "
                         "unset it for the default")
    return value


def style(asked: bool | None, out: TextIO) -> str | None:
    """How to show progress on `out`: "bar" on a terminal unless refused (`asked` False: --no-progress), "lines"
    elsewhere when asked (--progress), else None (nothing)."""
    if asked is False:
        return None
    try:
        terminal = out.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream: not a terminal
        terminal = False
    if terminal:
        return "bar"
    return "lines" if asked else None


class _Bar:
    """The terminal's bar (tqdm): the prompt count and the figures, redrawn at each look. tqdm cuts the line at the
    terminal's width, so the bar goes without the command's name and says its figures in short words."""

    FORMAT = "{percentage:3.0f}%|{bar}| {n}/{total} prompts [{elapsed}{postfix}]"
    UNSIZED = (160, 24)  # columns and rows, for a terminal that reports no size

    def __init__(self, out: TextIO, prefix: str, first: Figures):
        from tqdm import tqdm

        try:
            width = os.get_terminal_size(out.fileno()).columns
        except (AttributeError, ValueError, OSError):  # no descriptor, or not a terminal's
            width = 0
        # A terminal that reports no width (a pseudo-terminal nobody sized, e.g. `docker exec -t`) would have tqdm
        # cut the line to nothing: a fixed size then. disable=False: TQDM_DISABLE, which keeps the workers' bars
        # off (pipeline.raydata), must not hide this one.
        size = {"dynamic_ncols": True} if width > 0 else {"ncols": self.UNSIZED[0], "nrows": self.UNSIZED[1]}
        self.bar = tqdm(total=first.total, initial=first.done, file=out, bar_format=self.FORMAT,
                        postfix=figures_text(first, short=True), disable=False, leave=True, mininterval=0, **size)

    def show(self, f: Figures) -> None:
        self.bar.n = f.done
        self.bar.set_postfix_str(figures_text(f, short=True), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _Lines:
    """Plain lines, one per look, for a file, a pipe or a job's log."""

    def __init__(self, out: TextIO, prefix: str, first: Figures):
        self.out, self.prefix = out, prefix
        self.show(first)

    def show(self, f: Figures) -> None:
        self.out.write(f"{self.prefix}: {plain_line(f)}\n")
        self.out.flush()

    def close(self) -> None:
        pass


class Display:
    """Shows a run's progress in `how` ("bar" or "lines", from `style`) on `out`, from a thread of its own, every
    `every` seconds (each style's default when None). `warn` takes the one warning line of a look that failed."""

    def __init__(self, how: str, out: TextIO, prefix: str, every: float | None = None,
                 warn: Callable[[str], None] | None = None):
        if how not in EVERY_S:
            raise ValueError(f"unknown progress style {how!r}")
        self.how, self.out, self.prefix = how, out, prefix
        self.every = every if every is not None else EVERY_S[how]
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))

    def _stopped(self, what: str, err: BaseException) -> None:
        """The one warning line of a display that stopped."""
        cause = str(err).splitlines()[0] if str(err).strip() else ""
        self.warn(f"{self.prefix}: warning: progress display stopped: {what} ({type(err).__name__}"
                  f"{': ' + cause if cause else ''}); the run goes on")

    @contextlib.contextmanager
    def shown(self, folder: RunFolder, before: Tally, total: int, usd_per_device_hour: float) -> Iterator[None]:
        """Show the progress of the run inside the block. Steps: draw the figures of the rows written before it;
        start the thread that looks and redraws every `every` seconds; at the block's end stop the thread, and
        after a success take a last look so that the display ends on the final counts."""
        watcher = Watcher(folder, before, total, usd_per_device_hour)
        lock, stop = threading.Lock(), threading.Event()
        state = {"open": False}

        def close(why: tuple[str, BaseException] | None = None) -> None:
            """Close the view, once; with `why`, say why progress stopped (the run goes on)."""
            with lock:
                if not state["open"]:
                    return
                state["open"] = False
                try:
                    view.close()
                except Exception as err:  # noqa: BLE001 - the stream failed (a pipe whose reader has gone)
                    why = why or ("the progress could not be written", err)
            if why is not None:
                self._stopped(*why)

        def step() -> None:
            try:
                figures = watcher.look()
            except Exception as err:  # noqa: BLE001 - any failure to read the folder is said once, never raised
                close(("the run folder could not be read", err))
                return
            with lock:
                if not state["open"]:
                    return
                try:
                    view.show(figures)
                    return
                except Exception as err:  # noqa: BLE001 - e.g. a pipe whose reader has gone (BrokenPipeError)
                    broken = err
            close(("the progress could not be written", broken))

        try:
            view = (_Bar if self.how == "bar" else _Lines)(self.out, self.prefix, watcher.figures())
        except Exception as err:  # noqa: BLE001 - the run goes on without a display
            self._stopped("the progress could not be written", err)
            yield
            return
        state["open"] = True

        def loop() -> None:
            while state["open"] and not stop.wait(self.every):
                step()

        thread = threading.Thread(target=loop, name="winnow-progress", daemon=True)
        thread.start()
        succeeded = False
        try:
            yield
            succeeded = True
        finally:
            stop.set()
            try:
                # a look held up by a slow store is left to end on its own (a daemon thread, whose view is closed
                # below); an interrupted or failed run does not wait for it
                thread.join(STOP_WAIT_S if succeeded else 0.2)
                if succeeded and state["open"] and not thread.is_alive():
                    step()
            finally:
                close()
