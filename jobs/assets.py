"""`winnow assets`: one line per asset, `builtin:NAME`, a tab, its local path; an asset built on the node that uses
it (`builtin:smollm2-135m-instruct`) adds a tab and its state here (built, not built yet, or the extra it needs)."""

from __future__ import annotations

import argparse
import sys

from jobs.errors import EXIT_OK, parse_args

PROG = "winnow assets"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="List the assets usable as builtin:NAME.")
    status = parse_args(p, argv)
    if isinstance(status, int):
        return status
    import assets

    for name, path, note in assets.catalog():
        print(f"builtin:{name}\t{path}" + (f"\t{note}" if note else ""))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
