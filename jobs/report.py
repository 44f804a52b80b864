"""`winnow report RUN_DIR... --out DIR [--baseline RUN_DIR] [--plan PLAN_DIR]`: which runs are worth their cost.

Writes report.md (the cost-reward frontier first, tables, plots), report.json (every number) and PNG plots. The
metrics and their definitions are in `reporting.stats` (improvement score, relative compute, reward gained per USD,
bootstrap intervals), `reporting.cost` (the compute and measured-USD bases), `reporting.tolerance` and
`reporting.frontier` (the frontier, dominance, marginal cost), `reporting.verified` (for runs with a verifier: the
verified rate, pass@k and the cost of a pass); the files are assembled in `reporting.render`, which
ranks runs of different reward definitions apart. Without --baseline the first RUN_DIR is the baseline. With --plan,
each run is checked against a `winnow plan`'s projection (`reporting.plancheck`).
"""

from __future__ import annotations

import argparse
import sys

import assets
from jobs.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUNTIME, parse_args
from reporting.cost import BASES, COMPUTE
from reporting.plancheck import read_plan
from reporting.render import order_runs, terminal_summary, write_report
from runfolder.outputs import check_out, release_out
from runfolder.runs import folder_key, load_run, load_runs, unfinished_warning
from schemas.base import InputError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="winnow report",
        description="Compare runs by cost and reward: the cost-reward frontier (the runs no other run beats on both "
        "USD per prompt and mean best reward) with the marginal cost of reward, and against a baseline by paper "
        "001's improvement score and relative compute. Writes report.md, report.json and PNG plots to --out.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (local or s3://bucket/prefix)")
    p.add_argument("--out", required=True, help="report folder (local or s3://); refused if it holds anything but an "
                   "earlier output of a winnow command, and then unless --overwrite")
    p.add_argument("--baseline", default=None, metavar="RUN_DIR",
                   help="the run others are compared with (default: the first RUN_DIR); added to the report if "
                   "it is not one of the RUN_DIRs")
    p.add_argument("--basis", choices=BASES, default=COMPUTE,
                   help="the cost runs are ranked by: compute (default; FLOPs from tokens and parameter counts, the "
                   "same for the same runs every time) or usd (measured device-seconds x price, which moves with "
                   "the machine's load)")
    p.add_argument("--plan", default=None, metavar="PLAN_DIR",
                   help="a `winnow plan` folder: put its projection beside what each run spent and earned, and say "
                   "whether each figure fell inside its interval")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out that holds an earlier output of a winnow command (only that: a folder "
                   "holding anything else is refused, and nothing is deleted)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        release_out()  # the --out lease check_out took


def _main(argv: list[str] | None) -> int:
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    problems: list[str] = []
    try:  # the lease on --out first, then what it holds; never one of the runs read
        for note in check_out(args.out, args.overwrite, [*args.runs, *([args.baseline] if args.baseline else [])],
                              "winnow report"):
            print(f"winnow report: {note}")
    except InputError as err:
        problems += err.problems
    runs, baseline = [], None
    try:
        runs = load_runs(args.runs)
    except InputError as err:
        problems += err.problems
    keys = [folder_key(u) for u in args.runs]
    in_runs = args.baseline is not None and folder_key(args.baseline) in keys
    if args.baseline is not None and not in_runs:
        try:
            baseline = load_run(args.baseline)
        except InputError as err:
            problems += [f"--baseline {line}" for line in err.problems]
    plan = None
    if args.plan is not None:
        try:
            plan = read_plan(args.plan)
        except InputError as err:
            problems += err.problems
    if problems:
        for line in problems:
            print(f"winnow report: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if in_runs:
        baseline = runs[keys.index(folder_key(args.baseline))]
    for run in [*runs, *([baseline] if baseline is not None and not in_runs else [])]:
        warning = unfinished_warning(run)
        if warning:
            print(f"winnow report: {warning}", file=sys.stderr)
    ordered, base_index = order_runs(runs, baseline)
    try:
        report = write_report(ordered, base_index, args.out, args.basis, resolve=assets.resolve, plan=plan)
    except InputError as err:  # --out taken by another writer since the check (its lease)
        for line in err.problems:
            print(f"winnow report: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001 - any failure while computing or writing is a run-time failure (exit 1)
        print(f"winnow report: failed writing {args.out}: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    print(terminal_summary(report))
    print(f"wrote {args.out}/report.md, report.json and {len(report['plots'])} plot(s)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
