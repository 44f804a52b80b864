"""`winnow plan CONFIG [--set a.b=v]... [--target-reward R | --budget-usd B] [--sample K] [--sweep-share S]
[--methods ...] [--basis compute|usd] [--out DIR]`: the bill before it is paid (docs/planning.md).

A sweep on a seeded sample of the job's prompts (Best-of-N and Speculative Rejection's minimal config at a few n,
or the methods given), sized to a share of the job's cost, through `winnow generate`, projected to the whole prompt
set with intervals; it answers the question asked (the cheapest config reaching R, the best reward within B USD, or
the frontier's knee) and writes that config, plan.md and plan.json. The logic is in `planning`; this module parses
the arguments, wires the planner to `winnow generate`'s entry point, Ray's connection and the asset resolver, and
exits: 0 with the plan written, 2 for bad input (the config, the arguments, a sample larger than the prompt set, a
job too small to plan within the sweep's share, a question no swept config answers) with nothing of the plan written,
1 for a failure at run time, 130 when interrupted. The same command continues a plan that stopped, and answers
another question from a finished sweep without running anything.
"""

from __future__ import annotations

import shlex
import sys

from jobs import config_args
from jobs.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME
from jobs.interrupts import interrupts
from schemas.base import ConfigError, InputError

PROG = "winnow plan"


def _parser() -> config_args.Parser:
    p = config_args.parser(PROG, "Plan a job before paying for it: a sweep on a seeded sample of its prompts, "
                           "projected to the whole prompt set with 95% intervals; picks the method and n for a target "
                           "reward or a budget (or the frontier's knee) and writes that config, plan.md and plan.json.")
    question = p.add_mutually_exclusive_group()
    question.add_argument("--target-reward", type=config_args.finite_float, default=None, metavar="R",
                          help="pick the cheapest config whose projected mean best reward reaches R")
    question.add_argument("--budget-usd", type=config_args.finite_float, default=None, metavar="B",
                          help="pick the best projected mean best reward whose cost for the whole prompt set is "
                          "within B USD (cost.usd_per_device_hour)")
    p.add_argument("--sample", default=None, metavar="K",
                   help="prompts in the sample: a number or a fraction of the prompt set (0.05, 5%%); default 64, or "
                   "the prompt set when smaller; the sweep's share may cut it")
    p.add_argument("--sweep-share", default="0.1", metavar="S",
                   help="the most the sweep may cost, as a share of the job (0.1 or 10%%, the default; above 1 lets "
                   "it cost more than the job): the sample, then the configs, are cut to fit; a job too small for "
                   "even the smallest sweep is refused (exit 2)")
    p.add_argument("--methods", nargs="+", default=None, metavar="NAME[:KEY=V[,V...]]",
                   help="the configs to project, e.g. best_of_n:n=4,8,16 speculative_rejection:n=8,16:alpha=0.5 "
                   "(default: Best-of-N at every power of two up to the job's method.n and at it, estimated from one "
                   "run, and Speculative Rejection's minimal config at n/4, n/2 and n)")
    p.add_argument("--basis", choices=("compute", "usd"), default="compute",
                   help="the cost the frontier is drawn on and the cheapest is picked by, as in winnow report: "
                   "compute (default; FLOPs, which do not move with the machine's load) or usd (projected "
                   "device-hours x price); a budget is always in USD")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="the plan's folder (local; default: output.path with -plan appended); the same command "
                   "continues a plan that stopped")
    return p


def _load(args):
    """(raw config with --set applied, JobConfig, Question, SampleSize, methods); ConfigError or InputError."""
    from planning.budget import parse_share
    from planning.projection import Question
    from planning.sample import default_size, parse_size
    from planning.sweep import check_methods, default_methods, parse_methods, unique
    from schemas.compat import deprecated
    from schemas.config import apply_overrides, read_yaml_mapping, validate_config

    raw = apply_overrides(read_yaml_mapping(args.config), args.overrides)
    job = validate_config(raw, args.config)
    for line in deprecated(raw):
        config_args.warn_deprecated(line)
    problems = []
    if args.budget_usd is not None and not args.budget_usd > 0:  # finite: config_args.finite_float
        problems.append(f"--budget-usd {args.budget_usd:g}: must be a number of USD above 0")
    try:
        size = default_size() if args.sample is None else parse_size(args.sample)
    except ValueError as err:
        problems.append(str(err))
        size = None
    try:
        share = parse_share(args.sweep_share)
    except ValueError as err:
        problems.append(str(err))
        share = None
    methods = [] if args.methods else default_methods(job)
    for item in args.methods or []:  # each item on its own: every bad one is named, and the good ones checked
        try:
            methods += parse_methods([item])
        except InputError as err:
            problems += err.problems
    methods = unique(methods)
    problems += check_methods(raw, methods)
    if problems:
        raise InputError(problems)
    if args.target_reward is not None:
        question = Question("target_reward", args.target_reward)
    elif args.budget_usd is not None:
        question = Question("budget_usd", args.budget_usd)
    else:
        question = Question("frontier")
    return raw, job, question, size, methods, share


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = config_args.parse(_parser(), argv)
        raw, job, question, size, methods, share = _load(args)
    except (config_args.ArgumentError, ConfigError, InputError) as err:
        return config_args.report(PROG, err)
    except SystemExit as exc:  # --help
        return EXIT_OK if exc.code in (0, None) else EXIT_BAD_INPUT

    import assets
    from jobs import generate
    from pipeline.job import connect
    from pipeline.raydata import set_verbose, short_error
    from planning.planner import Interrupted, PlanFailed, Planner

    set_verbose(False)  # before Ray starts: its workers inherit the quiet, as under `winnow generate`
    out = args.out if args.out is not None else job.output.path.rstrip("/") + "-plan"
    command = " ".join([PROG, *map(shlex.quote, argv)])
    planner = Planner(raw, job, args.config, out, question, size, methods, command, generate=generate.main,
                      connect=connect, resolve=assets.resolve, log=lambda line: print(line, flush=True),
                      basis=args.basis, share=share)
    try:
        with interrupts():  # SIGTERM (`ray job stop`) ends the plan like Ctrl-C; the same command continues it
            plan = planner.run()
    except InputError as err:
        return config_args.report(PROG, err)
    except PlanFailed as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    except (Interrupted, KeyboardInterrupt):
        print(f"{PROG}: interrupted; run the same command again to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - Ray or the store failed while sampling or projecting: run time
        print(f"{PROG}: failed: {short_error(err)}; run the same command again to continue", file=sys.stderr)
        return EXIT_RUNTIME
    print(plan["summary"])
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
