"""`winnow build-sft RUN_DIR... --out DIR`: an Expert-Iteration SFT dataset from generation runs.

The logic is in `sftdata.select` (selection) and `sftdata.write` (files); this module parses arguments and reports.
"""

from __future__ import annotations

import argparse
import sys

from jobs.config_args import finite_float
from jobs.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUNTIME, parse_args
from runfolder.outputs import check_out, release_out
from runfolder.runs import load_runs, unfinished_warning
from schemas.base import InputError
from sftdata.select import DROP_REASONS, Selection, parse_select, select
from sftdata.write import write_sft


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="winnow build-sft",
        description="Pool the candidates of one or more runs per prompt_id and keep the best ones as a "
        "prompt-completion SFT dataset (Parquet + datasets.save_to_disk + dataset card).",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (local or s3://bucket/prefix)")
    p.add_argument("--out", required=True, help="output folder (local or s3://); refused if it holds anything but an "
                   "earlier output of a winnow command, and then unless --overwrite")
    p.add_argument("--select", default="best", help="'best' (default) or 'top-k=K': candidates kept per prompt (from "
                   "runs with a verifier, verified ones: top-k=K keeps up to K distinct verified answers)")
    p.add_argument("--min-reward", type=finite_float, default=None, metavar="R", help="keep only rewards >= R")
    p.add_argument("--include-rejected", action="store_true",
                   help="keep candidates Speculative Rejection stopped early (only those that have a reward)")
    p.add_argument("--include-truncated", action="store_true",
                   help="keep candidates that hit max_new_tokens (finish_reason 'length')")
    p.add_argument("--include-unverified", action="store_true",
                   help="for runs with a verifier, keep candidates that did not verify too, ranked after every "
                   "verified one (by default a prompt without a verified candidate is left out); also lets runs with "
                   "and without a verifier be pooled")
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
    argv = sys.argv[1:] if argv is None else list(argv)  # recorded in the dataset card
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    problems: list[str] = []
    try:
        k = parse_select(args.select)
    except InputError as err:
        problems += err.problems
    try:  # the lease on --out first, then what it holds; never one of the runs read
        for note in check_out(args.out, args.overwrite, args.runs, "winnow build-sft"):
            print(f"winnow build-sft: {note}")
    except InputError as err:
        problems += err.problems
    try:
        runs = load_runs(args.runs)
    except InputError as err:
        problems += err.problems
    try:
        if problems:
            raise InputError(problems)
        for run in runs:
            warning = unfinished_warning(run)
            if warning:
                print(f"winnow build-sft: {warning}", file=sys.stderr)
        sel = Selection(k=k, min_reward=args.min_reward,
                        include_rejected=args.include_rejected, include_truncated=args.include_truncated,
                        include_unverified=args.include_unverified)
        result = select(runs, sel)
        if result.table.num_rows == 0:
            counts = ", ".join(f"{why}={result.dropped[why]}" for why in DROP_REASONS if result.dropped.get(why))
            raise InputError(f"{', '.join(r.uri for r in runs)}: no candidate passed the selection "
                             f"({result.prompts_seen} prompts; dropped: {counts or 'none'})")
    except InputError as err:
        for line in err.problems:
            print(f"winnow build-sft: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        write_sft(result, runs, sel, args.out, argv)
    except InputError as err:  # --out taken by another writer since the check (its lease)
        for line in err.problems:
            print(f"winnow build-sft: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001 - any failure while writing is a run-time failure (exit 1)
        print(f"winnow build-sft: failed writing {args.out}: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    print(f"wrote {result.table.num_rows} examples for {result.prompts_kept} of {result.prompts_seen} prompts "
          f"from {len(runs)} run(s) to {args.out}")
    for reason in DROP_REASONS:
        if result.dropped.get(reason):
            print(f"  dropped {result.dropped[reason]} candidate(s): {reason}")
    if result.prompts_unverified:
        print(f"  left out {result.prompts_unverified} prompt(s) as unverified: no candidate verified")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
