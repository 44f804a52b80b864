"""`winnow assets`: one line per bundled asset, `builtin:NAME`, a tab, its local path."""

from __future__ import annotations

import argparse
import sys

from jobs.errors import EXIT_BAD_INPUT, EXIT_OK

PROG = "winnow assets"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="List the bundled assets (usable as builtin:NAME).")
    try:
        p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # --help exits 0, a bad argument 2
        return EXIT_OK if exit_.code == 0 else EXIT_BAD_INPUT
    import assets

    for name, path in assets.list_builtins().items():
        print(f"builtin:{name}\t{path}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
