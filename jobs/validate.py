"""`winnow validate CONFIG [--set a.b=v]...`: print the resolved config as YAML, or every problem at once (exit 2).

Besides the schema, it checks the model folders (`pipeline.preflight`) and the data source as far as the driver
reads it before Ray starts (`pipeline.prompts.check_source`: a local file's encoding, lines, footers and columns; a
remote one's existence), and that an S3 output.path can be used from here (credentials, endpoint, bucket), unless
`--schema-only` (for a config whose paths exist only on the cluster). Rows that a remote source holds are read by Ray
in `winnow generate`.
"""

from __future__ import annotations

import sys

import yaml

from jobs import config_args
from jobs.errors import EXIT_OK
from pipeline.preflight import location_problem, model_problems
from pipeline.prompts import check_source
from schemas.base import ConfigError, InputError

PROG = "winnow validate"


def main(argv: list[str] | None = None) -> int:
    p = config_args.parser(PROG, "Print the resolved job config, or every problem in it at once.")
    p.add_argument("--schema-only", action="store_true",
                   help="check the config's fields only, not its model folders and data source here")
    try:
        args = config_args.parse(p, argv)
        config = config_args.load(args)
        if not args.schema_only:
            problems = [line for line in [location_problem("output.path", config.output.path)] if line]
            problems += model_problems(config)
            try:
                check_source(config)
            except InputError as err:
                problems += err.problems
            if problems:
                raise InputError(problems)
    except (config_args.ArgumentError, ConfigError, InputError) as err:
        return config_args.report(PROG, err)
    print(f"# {args.config}: valid; config hash {config.hash()}")
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
