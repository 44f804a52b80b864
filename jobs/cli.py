"""The `winnow` console script: one subcommand per module of `jobs/`, each also runnable as `python -m jobs.X`."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("jobs.generate", "run a generation job (resumes by default)"),
    "validate": ("jobs.validate", "print the resolved config, or every error at once"),
    "build-sft": ("jobs.build_sft", "build an Expert-Iteration SFT dataset from runs"),
    "report": ("jobs.report", "compare runs by cost per unit of reward: tables and plots"),
    "plan": ("jobs.plan", "sweep a sample, project the whole job's reward, cost and time, pick the config"),
    "rounds": ("jobs.rounds", "rounds of Expert Iteration: generate, build-sft, fine-tune, evaluate (resumable)"),
    "score": ("jobs.score", "score given responses with the config's reward and verifier, without generating"),
    "assets": ("jobs.assets", "list the bundled assets (builtin:NAME, a tab, its path)"),
}


def version() -> str:
    """Winnow's version, from the installed package's metadata (pyproject.toml's in a source tree that was not
    installed, as the manifest records it)."""
    from importlib import metadata

    try:
        return metadata.version("winnow")
    except metadata.PackageNotFoundError:  # `python -m jobs.cli` from a checkout that pip never installed
        from runfolder.manifest import winnow_version

        return winnow_version()


def _usage() -> str:
    lines = ["usage: winnow COMMAND [ARGS]...  |  winnow --version", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `winnow COMMAND --help` for a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"winnow {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"winnow: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
