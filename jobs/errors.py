"""Exit statuses of every `winnow` command (SPEC.md): 0 success, 2 bad input, 1 failure at run time."""

from __future__ import annotations

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
