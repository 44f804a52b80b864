"""Ray Data helpers of the pipeline: a scoped DataContext change, the one-line cause of an error Ray re-raised, and
what a run prints (quiet by default).

Quiet (the default of `winnow generate`; `--verbose` turns it off): no Ray Data progress (bars on a terminal, their
logged form otherwise) and none of its INFO lines on the console (they still go to Ray Data's log file under the
session's logs/ray-data), no worker tracebacks Ray Data logs for a failed task (the command says the cause in one
line), no RayDeprecationWarning for the pipeline's own calls, no progress bars of model loading on the workers of a
local Ray and none of Ray Data's warnings there (HF_HUB_DISABLE_PROGRESS_BARS, TQDM_DISABLE, RAY_DATA_LOG_LEVEL=ERROR,
set before the driver starts its Ray, so its workers inherit them; a variable the user set is kept), and Ray's own
INFO lines ("Started a local Ray instance") off. Warnings and errors of Ray and errors of the workers still show.
The command's own progress display counts prompts from the run folder instead (`pipeline.progress`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings

VERBOSE = {"on": False}  # whether Ray's raw output (Ray Data's progress, INFO lines) shows: winnow generate --verbose
# For the workers of a local Ray: no progress bars (transformers' weight loading, tqdm), and Ray Data's own
# warnings off (e.g. its reader's "falling back to json.load" before a bad line the command names itself)
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "RAY_DATA_LOG_LEVEL": "ERROR"}
# Ray Data's console lines that repeat, with a traceback, a failure the command reports itself in one line
_TRACE_LINES = ("Exception occurred in", "An exception was raised from a task of operator",
                "Progress bars disabled", "Full stack trace")


def set_verbose(on: bool) -> None:
    """Choose what a run prints (module docstring); call before Ray starts, so that a local Ray's workers inherit
    the environment that keeps their progress bars off."""
    VERBOSE["on"] = on
    if not on:
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)


def ray_init_options(starts_local: bool) -> dict:
    """Keyword arguments of `ray.init` for the chosen output: Ray's own INFO lines only when verbose; a local Ray
    that this process starts (`starts_local`) goes without Ray's dashboard where WINNOW_RAY_DASHBOARD is 0 (or false,
    no, off): 1 to 4 s less to start on a 2-core machine, and a process less beside the actors. A cluster that this
    process joins keeps its own (ray.init refuses the option there)."""
    options = {} if VERBOSE["on"] else {"logging_level": logging.WARNING}
    if starts_local and os.environ.get("WINNOW_RAY_DASHBOARD", "").strip().lower() in ("0", "false", "no", "off"):
        options["include_dashboard"] = False
    return options


# Lines that Ray's C++ core writes to the driver's stderr and that say nothing a Winnow user can act on: at every
# resumed run, Ray Data creates its checkpoint filter actor with the checkpointed ids in the object store and restarts
# allowed, which the core worker reports as an error (Ray issue 53727: such an actor could not be restarted if its
# arguments were lost; the run would then fail and resume). Dropped while quiet, and only these.
_NATIVE_NOISE = (
    re.compile(rb"core_worker\.cc:\d+: Actor with class name: 'MapWorker\(CheckpointFilter\)'.*max_restarts > 0"),
)


@contextlib.contextmanager
def native_noise_dropped():
    """While quiet, the driver's stderr (file descriptor 2, which Ray's C++ code writes to) goes through a filter
    that drops `_NATIVE_NOISE` lines and passes every other byte on, in order. Use around work that starts no
    process (the descriptor is restored at the end, and the filter's thread ends when the pipe closes)."""
    if VERBOSE["on"]:
        yield
        return
    import sys
    import threading

    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as src:
            pending = b""
            while chunk := src.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not any(p.search(line) for p in _NATIVE_NOISE):
                        os.write(saved, line + b"\n")
            if pending and not any(p.search(pending) for p in _NATIVE_NOISE):
                os.write(saved, pending)

    thread = threading.Thread(target=pump, name="winnow-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the thread passes on what is left, then ends
        thread.join(5)
        if not thread.is_alive():  # else a process started meanwhile holds the pipe: the thread keeps `saved`
            os.close(saved)


class _DropTraces(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(line in record.getMessage() for line in _TRACE_LINES)


def quiet_ray_data() -> None:
    """Apply the chosen output to Ray Data in this process (idempotent; Ray Data may have set up its logging again)."""
    if VERBOSE["on"]:
        return
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console":
            handler.setLevel(logging.WARNING)
            if not any(isinstance(f, _DropTraces) for f in handler.filters):
                handler.addFilter(_DropTraces())


@contextlib.contextmanager
def own_deprecations():
    """Hide RayDeprecationWarning for the pipeline's own Ray calls unless verbose (pyproject pins Ray below
    the version that removes what they use; the notice is for the developers, in the code, not for every run)."""
    with warnings.catch_warnings():
        if not VERBOSE["on"]:
            from ray.util.annotations import RayDeprecationWarning

            warnings.simplefilter("ignore", RayDeprecationWarning)
        yield


@contextlib.contextmanager
def data_context(preserve_order: bool | None = None, **changes):
    """Set DataContext attributes (and `execution_options.preserve_order`) for the block, then restore them; Ray
    Data's output follows `set_verbose`."""
    import ray.data

    quiet_ray_data()
    ctx = ray.data.DataContext.get_current()
    old = {name: getattr(ctx, name) for name in changes}
    old_order = ctx.execution_options.preserve_order
    try:
        for name, value in changes.items():
            setattr(ctx, name, value)
        if preserve_order is not None:
            ctx.execution_options.preserve_order = preserve_order
        yield ctx
    finally:
        for name, value in old.items():
            setattr(ctx, name, value)
        ctx.execution_options.preserve_order = old_order


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*): (.+)$")


def short_error(err: BaseException) -> str:
    """`Type: message` of the root cause of an exception, on one line.

    Ray re-raises a remote failure with the remote traceback in its text (the user's exception first, then Ray's
    wrappers such as ``ray.exceptions.UserCodeException``); the first ``Type: message`` line that is not Ray's own
    names what went wrong.
    """
    for line in str(err).splitlines():
        m = _EXCEPTION_LINE.match(line)
        if m and not line.startswith("ray."):
            return f"{m.group(1)}: {m.group(2).strip()}"
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [t.strip() for t in str(cause).splitlines() if t.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
