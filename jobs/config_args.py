"""Argument parsing shared by the commands that take a job config: ``CONFIG [--set a.b=v]...``."""

from __future__ import annotations

import argparse
import math
import sys

from jobs.errors import EXIT_BAD_INPUT
from schemas.base import ConfigError, InputError
from schemas.config import JobConfig, load_config


class ArgumentError(Exception):
    """Bad command-line arguments (argparse's message, exit status 2)."""


def finite_float(text: str) -> float:
    """The argparse type of every float flag: a finite number; nan, inf and -inf are refused (exit 2), since a
    threshold of nan passes or fails every comparison silently."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (nan, inf and -inf are refused)")
    return value


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so `main()` returns the exit status."""

    def error(self, message):
        raise ArgumentError(f"{self.prog}: error: {message}\n{self.format_usage().strip()}")


def parser(prog: str, description: str) -> Parser:
    p = Parser(prog=prog, description=description)
    p.add_argument("config", metavar="CONFIG", help="job config (YAML)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key by its dotted path, e.g. --set method.alpha=0.7 (repeatable)",
    )
    return p


def parse(p: Parser, argv: list[str] | None) -> argparse.Namespace:
    """Parse argv; `--help` raises SystemExit(0) as usual."""
    return p.parse_args(sys.argv[1:] if argv is None else argv)


def load(args: argparse.Namespace) -> JobConfig:
    """The validated config; ConfigError (every problem at once) otherwise. A setting under its old name reads as
    its new one, with a warning line on stderr (`warn_deprecated`)."""
    return load_config(args.config, args.overrides, warn=warn_deprecated)


def warn_deprecated(line: str) -> None:
    """One warning line on stderr: a setting of the config under its old name (`schemas.compat.deprecated`)."""
    print(f"winnow: warning: {line}", file=sys.stderr)


def report(prog: str, err: Exception) -> int:
    """Print a bad-input error on stderr and return exit status 2."""
    if isinstance(err, (ConfigError, InputError)):
        where = f" ({err.source})" if getattr(err, "source", None) else ""
        print(f"{prog}: {len(err.problems)} problem(s){where}:", file=sys.stderr)
        for line in err.problems:
            print(f"  - {line}", file=sys.stderr)
    else:
        print(str(err), file=sys.stderr)
    return EXIT_BAD_INPUT
