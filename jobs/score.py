"""`winnow score CONFIG RESPONSES [--out FILE] [--set a.b=v]...`: score given responses with the config's reward and
verifier, without generating (`pipeline.score`). Exit 0 when responses fail verification (that is an answer); 2 for
a bad config, a bad RESPONSES file or a missing column; 1 when the reward fails at run time."""

from __future__ import annotations

import sys
from pathlib import Path

from jobs import config_args
from jobs.errors import EXIT_OK, EXIT_RUNTIME
from pipeline.preflight import model_problems
from pipeline.score import default_out, read_responses, score_file, summary, write_scores
from schemas.base import ConfigError, InputError

PROG = "winnow score"


def main(argv: list[str] | None = None) -> int:
    p = config_args.parser(PROG, "Score given responses with the job's reward and verifier, without generating: one "
                           "JSON line per response (score, verified, reason).")
    p.add_argument("responses", metavar="RESPONSES", help="JSONL: per line the data columns the reward reads (the "
                   "prompt, the reference) and a 'response' string")
    p.add_argument("--out", metavar="FILE", help="where the JSON lines go (default: RESPONSES.scores.jsonl beside it)")
    try:
        args = config_args.parse(p, argv)
        config = config_args.load(args)
        out = Path(args.out) if args.out else default_out(args.responses)
        problems = model_problems(config)
        if not out.parent.is_dir():
            problems.append(f"--out {out}: its folder does not exist")
        elif not _writable(out.parent):
            problems.append(f"--out {out}: its folder is not writable")
        if problems:
            raise InputError(problems)
        responses = read_responses(args.responses, config)
    except (config_args.ArgumentError, ConfigError, InputError) as err:
        return config_args.report(PROG, err)
    try:
        results = score_file(config, responses)
    except (RuntimeError, ValueError) as err:  # the reward or the verifier failed: named by its own message
        print(f"{PROG}: scoring failed: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    write_scores(out, results)
    for line in summary(results, config):
        print(f"{PROG}: {line}")
    print(f"{PROG}: wrote {out}")
    return EXIT_OK


def _writable(folder: Path) -> bool:
    import os

    return os.access(folder, os.W_OK)


if __name__ == "__main__":
    sys.exit(main())
