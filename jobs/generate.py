"""`winnow generate CONFIG [--set a.b=v]... [--overwrite] [--progress | --no-progress] [--verbose]`: run a generation
job on Ray; resumes by default. It shows its progress (`pipeline.progress`): a bar when stdout is a terminal, plain
lines elsewhere with --progress, nothing otherwise. Ray's own output is hidden unless --verbose (`pipeline.raydata`).

Progress goes to stdout, the command's own lines' stream: it stays in order with them and the summary, and a log
captured with `> FILE` or by `ray job submit` holds it; stderr keeps the warnings and errors.

The same entry point runs on a laptop (it starts a local Ray) and on a cluster
(`ray job submit --working-dir . -- python -m jobs.generate CONFIG`, which joins the cluster). The steps are
`pipeline.job`'s: check (exit 2, nothing written), connect and read the prompts (exit 2 for a bad source, nothing
written), then execute; a failed call exits 1 and an interrupt 130, keeping the rows written so far.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import threading
from typing import TYPE_CHECKING

from jobs import config_args
from jobs.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME
from jobs.interrupts import interrupts
from schemas.base import ConfigError, InputError

if TYPE_CHECKING:
    from pipeline.progress import Display

PROG = "winnow generate"


def main(argv: list[str] | None = None) -> int:
    p = config_args.parser(PROG, "Run a generation job on Ray (resumes an interrupted run of the same config).")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in output.path (of any config): its own files are deleted first; a folder "
                        "that holds anything else is refused, and nothing else is deleted")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show prompts done of the total, generated tokens/s, the mean best reward, the cost so far "
                        "(device-seconds, USD) and the time left, read from the run folder as rows commit: a bar "
                        "when stdout is a terminal (the default there; --no-progress turns it off), else a plain "
                        "line every few seconds (WINNOW_PROGRESS_S sets the seconds)")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's raw output: Ray Data's progress and Ray's INFO lines, the model-loading bars of "
                        "the actors and the deprecation warnings of the pipeline's Ray calls (hidden by default)")
    p.add_argument("--allow-working-dir-paths", action="store_true",
                   help="under `ray job submit`, accept an output.path or data.source inside Ray's copy of the "
                        "job's working directory (refused by default: Ray deletes it)")
    try:
        args = config_args.parse(p, argv)
        config = config_args.load(args)
        from pipeline import progress  # reads the run folder (pyarrow): not needed for --help or a bad argument

        how = progress.style(args.progress, sys.stdout)
        display = None if how is None else progress.Display(how, sys.stdout, PROG, every=progress.look_interval())
        from pipeline import job  # imports Ray: only once the arguments and the config are good

        checked = job.check(config, args.overwrite, args.allow_working_dir_paths)
        from runfolder.lease import Lease, lease_path

        lease = Lease(checked.folder.fs, lease_path(checked.folder.path), PROG, f"output.path: {checked.folder.uri}")
        lease.acquire()  # one writer per run folder: a second run exits 2 naming this one
    except (config_args.ArgumentError, ConfigError, InputError) as err:
        return config_args.report(PROG, err)
    except OSError as err:  # the store does not answer (an outage): a run-time failure, nothing written
        print(f"{PROG}: the run folder's store does not answer: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live on the main thread
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: a handler set outside Python
    try:
        if lease.taken_over is not None:
            print(f"{PROG}: {checked.folder.uri} was held by a run that did not end cleanly "
                  f"({lease.taken_over.describe()}); taking it over", flush=True)
        return _run(checked, args.verbose, display)
    except KeyboardInterrupt:  # before the run started (`execute` handles its own): nothing was written
        print(f"{PROG}: interrupted before the run started", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        lease.release()
        if lease.lost:
            print(f"{PROG}: warning: {lease.lost}; another run may have written {checked.folder.uri} meanwhile",
                  file=sys.stderr)
        if lease.release_problem:
            print(f"{PROG}: warning: {lease.release_problem}", file=sys.stderr)


def _run(checked, verbose: bool = False, display: Display | None = None) -> int:
    from pipeline import job
    from pipeline.raydata import set_verbose, short_error

    set_verbose(verbose)
    import ray

    ours = not ray.is_initialized()  # this process connects (a local Ray of its own, or a cluster it joins)
    try:
        print(f"{PROG}: {job.connect()}", flush=True)
    except (ConnectionError, RuntimeError, ValueError) as err:  # RAY_ADDRESS points nowhere, Ray cannot start
        print(f"{PROG}: cannot connect to or start Ray: {short_error(err)}", file=sys.stderr)
        return EXIT_RUNTIME
    # `ray job stop` (and a plain kill) sends SIGTERM: the run ends like Ctrl-C, so the manifest says it did not
    # finish and the lease is given back. Set after ray.init, whose core worker installs its own handler.
    with interrupts():
        return _execute(checked, ours, display)


def _execute(checked, ours: bool, display: Display | None = None) -> int:
    from pipeline import job
    from pipeline.raydata import short_error

    import ray
    from pipeline.cluster import check_room, check_share

    try:  # a node must hold one actor, or an autoscaler add one in time, and its models fit its share of a GPU
        say = lambda line: print(f"{PROG}: {line}", flush=True)  # noqa: E731
        check_room(checked.config, log=say)
        check_share(checked.config, log=say)
    except InputError as err:
        return config_args.report(PROG, err)
    try:
        staged = None if checked.reuses_prompts else job.stage_prompts(checked)
    except InputError as err:
        return config_args.report(PROG, err)
    except Exception as err:  # not the source's fault (a dead Ray worker, a bug): a run-time failure, nothing written
        print(f"{PROG}: failed reading the prompts: {short_error(err)}", file=sys.stderr)
        return EXIT_RUNTIME

    try:
        usd_rate = checked.config.cost.usd_per_device_hour
        watch = None if display is None else (
            lambda before, total: display.shown(checked.folder, before, total, usd_rate))
        outcome = job.execute(checked, staged, log=lambda line: print(f"{PROG}: {line}", flush=True), watch=watch)
    except Exception as err:  # the store failed before the run started (an outage): a run-time failure, said once
        print(f"{PROG}: the job failed before it started: {short_error(err)}\n{PROG}: run the same command again "
              f"once {checked.folder.uri} can be written", file=sys.stderr)
        return EXIT_RUNTIME
    where = checked.folder.uri
    if outcome.status != "succeeded" and ours:
        # the tasks Ray Data abandoned may still hold errors nobody will read, which Ray logs as "Unhandled error"
        # when their references go, from a thread of its own: collected and disconnected here, so that Ray says
        # them now and the command's last words are its own
        gc.collect()
        ray.shutdown()
    if outcome.status == "interrupted":
        print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if outcome.status == "failed":
        print(f"{PROG}: the job failed: {outcome.error}\n{PROG}: rows written so far are kept in {where}; "
              "run the same command again to resume", file=sys.stderr)
        return EXIT_RUNTIME
    print(job.summary_table(outcome.tally, checked.config, outcome.new_rows, outcome.seconds))
    print(f"{PROG}: wrote {where}/candidates and {where}/manifest.json")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
