"""Every float a user gives, in a flag or a config, is refused when it is not a finite number (nan, inf): a threshold
of nan passes or fails every comparison silently (`--min-reward nan` once dropped every candidate as below it).
Config sections refuse them through `schemas.base.Strict` (pydantic's ``allow_inf_nan=False``), flags through
`jobs.config_args.finite_float`."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_config, winnow, write_config
from conftest_runs import cand, row, write_run


def _strict_classes():
    import rounds.config  # noqa: F401 (its sections are Strict too)
    import schemas.config  # noqa: F401
    import schemas.methods  # noqa: F401
    from schemas.base import Strict

    out, todo = [], [Strict]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def _float_fields(cls):
    for name, info in cls.model_fields.items():
        if float in (info.annotation, *typing.get_args(info.annotation)):
            yield name, info


def test_no_config_field_takes_nan_or_inf():
    classes = _strict_classes()
    assert len(classes) > 20  # the job config's sections, the methods and the recipe's sections
    fields = 0
    for cls in classes:
        assert cls.model_config.get("allow_inf_nan") is False, cls.__name__
        for name, info in _float_fields(cls):
            fields += 1
            allowed = [m for m in info.metadata if getattr(m, "allow_inf_nan", None)]
            assert not allowed, f"{cls.__name__}.{name} takes nan or inf: its description must say why"
    assert fields > 20


@pytest.mark.parametrize("key, value", [("generation.temperature", ".nan"), ("cost.usd_per_device_hour", ".inf"),
                                         ("method.alpha", ".nan"), ("resources.cpus_per_actor", "-.inf")])
def test_validate_refuses_a_float_that_is_not_finite(tmp_path, key, value):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, method={"name": "speculative_rejection", "n": 4}))
    proc = winnow("validate", str(cfg), "--schema-only", "--set", f"{key}={value}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{key}: must be a finite number, not nan or inf" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_build_sft_refuses_min_reward_nan_and_writes_nothing(tmp_path):
    run = write_run(str(tmp_path / "r"), [row("p1", [cand("a", 0.5)])])
    for value in ("nan", "-inf", "NaN"):
        proc = winnow("build-sft", run, "--out", str(tmp_path / "sft"), f"--min-reward={value}")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"argument --min-reward: {value!r} is not a finite number" in proc.stderr
        assert not (tmp_path / "sft").exists()
    proc = winnow("build-sft", run, "--out", str(tmp_path / "sft"), "--min-reward", "0.25")
    assert proc.returncode == 0, proc.stderr  # a finite threshold still works


@pytest.mark.parametrize("flag", ["--target-reward", "--budget-usd"])
def test_plan_refuses_a_question_that_is_not_finite(tmp_path, flag):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path))
    proc = winnow("plan", str(cfg), flag, "inf", "--out", str(tmp_path / "plan"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"argument {flag}: 'inf' is not a finite number" in proc.stderr
    assert not (tmp_path / "plan").exists()


def test_a_recipe_with_min_reward_nan_is_refused_before_any_step(tmp_path):
    recipe = {"name": "tiny", "out": str(tmp_path / "ei"), "model": "builtin:tiny-target",
              "reward": {"kind": "lexical"}, "prompts": {"vocabulary": "tiny-world", "train": 8, "heldout": 8},
              "sources": {"bon": {"name": "best_of_n", "n": 2}}, "train": {"cpu_threads": 1}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe) + "sft: {min_reward: .nan}\n")
    proc = winnow("rounds", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sft.min_reward: must be a finite number, not nan or inf (got nan)" in proc.stderr
    assert not (tmp_path / "ei").exists()


def test_every_float_flag_is_finite_float():
    """A float flag added later takes `config_args.finite_float` too: no `type=float` in any command."""
    for path in sorted((ROOT / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "type":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "float"), \
                    f"{path.name}:{node.value.lineno}: type=float; use config_args.finite_float"
    assert Path(ROOT / "jobs" / "config_args.py").read_text().count("def finite_float") == 1
