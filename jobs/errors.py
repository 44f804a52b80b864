"""Exit statuses of every `winnow` command (SPEC.md): 0 success, 2 bad input, 1 failure at run time."""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2


class InputError(Exception):
    """Bad config, arguments or input files. The message names each offending field or path; nothing was written.

    `problems` holds one line per problem so that every problem can be reported at once.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status when argparse stopped (0 after --help, 2 for bad arguments)."""
    try:
        return parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:
        return EXIT_OK if exc.code in (0, None) else EXIT_BAD_INPUT
