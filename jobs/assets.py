"""`winnow assets`: one line per bundled asset, `builtin:NAME`, a tab, its local path."""

from __future__ import annotations

import argparse
import sys

from jobs.errors import EXIT_OK, parse_args

PROG = "winnow assets"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="List the bundled assets (usable as builtin:NAME).")
    status = parse_args(p, argv)
    if isinstance(status, int):
        return status
    import assets

    for name, path in assets.list_builtins().items():
        print(f"builtin:{name}\t{path}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
