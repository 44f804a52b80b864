"""Checks a job's models on the driver, before Ray starts an actor: every problem at once, each naming its field.

A model is a folder in Hugging Face format (it holds ``config.json``): a local folder, an s3:// (or other fsspec)
prefix, or ``builtin:NAME``. Only existence is checked here; loading stays with the workers.
"""

from __future__ import annotations

import importlib
import posixpath

import fsspec

from schemas.config import JobConfig

BUILTIN = "builtin:"


def model_problem(spec: str, field: str) -> str | None:
    """Why `spec` is not a model folder, or None."""
    if spec.startswith(BUILTIN):
        import assets

        try:
            path = str(assets.builtin_path(spec[len(BUILTIN):]))
        except KeyError as err:
            return f"{field}: {err.args[0]}"
    else:
        path = spec
    try:
        fs, root = fsspec.core.url_to_fs(path)
        if not fs.exists(root):
            return f"{field}: {spec} does not exist"
        if not fs.isfile(posixpath.join(root.rstrip("/"), "config.json")):
            return f"{field}: {spec} is not a Hugging Face model folder (no config.json in it)"
    except (OSError, ValueError, ImportError) as err:
        return f"{field}: {spec} cannot be read ({err})"
    return None


def python_reward_problem(function: str) -> str | None:
    """Why `module:function` cannot be imported and called, or None."""
    module_name, _, attr = function.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is a bad config, reported by name
        return f"models.reward.function: cannot import {module_name!r} ({type(err).__name__}: {err})"
    if not callable(getattr(module, attr, None)):
        return f"models.reward.function: {module_name!r} has no callable {attr!r}"
    return None


def model_problems(config: JobConfig) -> list[str]:
    m = config.models
    checks = [(m.target, "models.target")]
    if m.draft is not None:
        checks.append((m.draft, "models.draft"))
    if m.reward is not None and m.reward.kind == "model":
        checks.append((m.reward.path, "models.reward.path"))
    problems = [p for spec, field in checks if (p := model_problem(spec, field))]
    if m.reward is not None and m.reward.kind == "python":
        problem = python_reward_problem(m.reward.function)
        if problem:
            problems.append(problem)
    return problems
