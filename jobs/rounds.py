"""`winnow rounds RECIPE [--set a.b=v]...`: rounds of Expert Iteration, resumable (docs/expert-iteration.md).

The logic is in `rounds.recipe`; this module parses the arguments, wires the recipe to `winnow generate`'s entry
point, the bundled concept sets and the asset resolver, and exits: 0 when every step is done (the summary is
printed), 2 for bad input (the recipe config, a model, a finished step whose settings changed, an empty SFT set)
with nothing of that step written, 1 for a failure at run time, 130 when interrupted. Run the same command again to
continue a recipe that stopped.
"""

from __future__ import annotations

import shlex
import sys

from jobs import config_args
from jobs.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME
from jobs.interrupts import interrupts
from schemas.base import ConfigError, InputError

PROG = "winnow rounds"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = config_args.Parser(prog=PROG, description="Rounds of Expert Iteration: generate with the round's model, "
                           "build the SFT set, fine-tune with TRL, evaluate on held-out prompts; resumes a recipe "
                           "folder where it stopped.")
    p.add_argument("config", metavar="RECIPE", help="recipe config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key by its dotted path, e.g. --set rounds=2 (repeatable)")
    try:
        args = config_args.parse(p, argv)
        from rounds.config import read_recipe

        checked = read_recipe(args.config, args.overrides)  # its problems are said with every later check's
        for line in checked.deprecated:
            config_args.warn_deprecated(line)
    except (config_args.ArgumentError, ConfigError, InputError) as err:
        return config_args.report(PROG, err)
    except SystemExit as exc:  # --help
        return EXIT_OK if exc.code in (0, None) else EXIT_BAD_INPUT

    import assets
    from assets import concept_sets
    from jobs import generate
    from rounds.recipe import Interrupted, Recipe, StepFailed

    command = " ".join([PROG, *map(shlex.quote, argv)])
    recipe = Recipe(checked.config, command, generate=generate.main, concept_sets=concept_sets.split,
                    resolve=assets.resolve, log=lambda line: print(line, flush=True), problems=checked.problems,
                    broken=checked.broken)
    try:
        with interrupts():  # SIGTERM ends the recipe like Ctrl-C: its manifest says where it stopped
            summary = recipe.run()
    except InputError as err:
        return config_args.report(PROG, err)
    except StepFailed as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    except Interrupted as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the recipe's first step
        print(f"{PROG}: interrupted; run the same command again to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary["markdown"])
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
