"""`winnow rounds` checks the whole recipe, every stage, before any step runs, and says every problem at once
(docs/expert-iteration.md): a broken section of the recipe does not hide the problems of the job configs it makes,
of its models or of its prompts."""

from __future__ import annotations

import yaml

from conftest import winnow


def recipe(out, **over) -> dict:
    cfg = {"name": "tiny", "out": str(out), "rounds": 1, "model": "builtin:tiny-target",
           "reward": {"kind": "lexical"}, "prompts": {"vocabulary": "tiny-world", "train": 8, "heldout": 8},
           "sources": {"bon": {"name": "best_of_n", "n": 2}}, "train": {"cpu_threads": 1},
           "evaluation": {"greedy": False}}
    cfg.update(over)
    return cfg


def test_problems_in_every_stage_are_said_in_one_attempt(tmp_path):
    cfg = recipe(tmp_path / "ei", model=str(tmp_path / "nowhere"),  # the models
                 sft={"min_reward": float("nan")},  # the recipe's own sections
                 job={"generation": {"max_new_tokens": 0}},  # the job config of every step
                 prompts={"vocabulary": None, "train_source": str(tmp_path / "train.jsonl"),  # the prompts
                          "heldout_source": str(tmp_path / "heldout.jsonl")})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = winnow("rounds", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "sft.min_reward: must be a finite number, not nan or inf (got nan)" in err
    assert "generation.max_new_tokens: Input should be greater than or equal to 1" in err
    assert f"model: {tmp_path / 'nowhere'} does not exist" in err
    assert f"prompts.heldout_source: {tmp_path / 'heldout.jsonl'}: no such file or folder" in err
    assert f"prompts.train_source: {tmp_path / 'train.jsonl'}: no such file or folder" in err
    assert "5 problem(s)" in err and "Traceback" not in err
    assert not (tmp_path / "ei").exists()


def test_a_broken_section_is_left_out_of_the_later_checks(tmp_path):
    """A section that broke a rule is replaced by a stand-in to check the rest; the stand-in's own checks (its
    model, its folder) are never said as the user's."""
    cfg = recipe(tmp_path / "ei", prompts={"vocabulary": None, "train_source": str(tmp_path / "train.jsonl"),
                                           "heldout_source": str(tmp_path / "heldout.jsonl")})
    cfg.update(out={"not": "a folder"}, model=["not", "a", "path"])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = winnow("rounds", str(path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert [line.split(":")[0] for line in lines] == ["  - out", "  - model", "  - prompts.heldout_source",
                                                      "  - prompts.train_source"], proc.stderr
    assert list(tmp_path.iterdir()) == [path]
