"""`winnow validate CONFIG [--set a.b=v]...`: print the resolved config as YAML, or every problem at once (exit 2).

Besides the schema, it checks that the model folders exist (`pipeline.preflight`), unless `--schema-only` (for a
config whose paths exist only on the cluster). Reading the data needs Ray and is left to `winnow generate`.
"""

from __future__ import annotations

import sys

import yaml

from jobs import config_args
from jobs.errors import EXIT_OK
from pipeline.preflight import model_problems
from schemas.base import ConfigError, InputError

PROG = "winnow validate"


def main(argv: list[str] | None = None) -> int:
    p = config_args.parser(PROG, "Print the resolved job config, or every problem in it at once.")
    p.add_argument("--schema-only", action="store_true",
                   help="check the config's fields only, not whether its model folders exist here")
    try:
        args = config_args.parse(p, argv)
        config = config_args.load(args)
        if not args.schema_only:
            problems = model_problems(config)
            if problems:
                raise InputError(problems)
    except (config_args.ArgumentError, ConfigError, InputError) as err:
        return config_args.report(PROG, err)
    print(f"# {args.config}: valid; config hash {config.hash()}")
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
