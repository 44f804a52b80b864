"""Every command Winnow prints for a user to run is quoted for a shell: a path holding spaces or quotes pastes back
as one argument. The dataset card of build-sft, and the steps and summary of `winnow rounds`."""

from __future__ import annotations

import shlex

from conftest import winnow
from conftest_runs import cand, row, write_run

AWKWARD = "it's a dir"  # a space and a quote


def test_the_dataset_cards_command_runs_as_printed(tmp_path):
    run = write_run(str(tmp_path / AWKWARD / "run one"), [row("p1", [cand("a", 0.5)]), row("p2", [cand("b", 0.7)])])
    out = str(tmp_path / AWKWARD / "sft out")
    proc = winnow("build-sft", run, "--out", out, "--min-reward", "0.1", "--select", "top-k=1")
    assert proc.returncode == 0, proc.stderr
    card = (tmp_path / AWKWARD / "sft out" / "README.md").read_text()
    line = next(line for line in card.splitlines() if line.startswith("- command: `"))
    command = line[len("- command: `"):-1]
    args = shlex.split(command)
    assert args == ["winnow", "build-sft", run, "--out", out, "--min-reward", "0.1", "--select", "top-k=1"]
    again = winnow(*args[1:], "--overwrite")  # the command as printed, run again
    assert again.returncode == 0, again.stderr


def test_the_commands_of_a_recipe_are_quoted(tmp_path):
    from rounds.config import validate_recipe
    from rounds.recipe import Recipe, generate_command
    from rounds.summary import render

    out = tmp_path / AWKWARD / "recipe"
    cfg = validate_recipe({"name": "tiny", "out": str(out), "model": "builtin:tiny-target",
                           "reward": {"kind": "lexical"}, "sources": {"bon": {"name": "best_of_n", "n": 2}}})
    recipe = Recipe(cfg, "winnow rounds 'my recipe.yaml'", None, None, None, log=lambda line: None)
    step = recipe.step("round-1/bon/data")
    assert shlex.split(generate_command(step)) == ["winnow", "generate", step.yaml_path]

    write_run(step.path, [row("p1", [cand("a", 0.5)]), row("p2", [cand("b", 0.7)])],
              reward={"kind": "lexical", "concepts_column": "concepts"})
    made = recipe._sft(recipe.step("round-1/bon/sft"))
    args = shlex.split(made["command"])
    assert args[:3] == ["winnow", "build-sft", step.path] and args[3:5] == ["--out", str(out / "round-1/bon/sft")]

    class Ledger:
        data = {"command": recipe.command}

        def done(self, step_id):
            return None

    runs = [str(out / "round-0" / "eval-sample"), str(out / "round-1" / "bon" / "eval-sample")]
    summary = render(recipe, Ledger(), {"series": [], "comparisons": [], "notes": []}, runs)
    reproduce = summary.split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert shlex.split(reproduce[1]) == ["winnow", "report", *runs, "--out", str(out / "report")]
