"""Exit statuses of every `winnow` command (README: Commands): 0 success, 2 bad input, 1 failure at run time,
130 interrupted."""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status when argparse stopped (0 after --help, 2 for bad arguments)."""
    try:
        return parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:
        return EXIT_OK if exc.code in (0, None) else EXIT_BAD_INPUT
