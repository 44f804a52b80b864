"""The manifest of a run folder (`schemas.manifest.Manifest`): what ran, with which code and packages, and how it
ended. Written with status ``running`` before the first row and rewritten at the end."""

from __future__ import annotations

import datetime as dt
import subprocess
from importlib import metadata
from pathlib import Path

from runfolder.folder import RunFolder, Tally
from schemas.config import JobConfig
from schemas.manifest import Manifest, ParameterCounts

PACKAGES = ("torch", "transformers", "tokenizers", "ray", "pyarrow", "datasets", "pydantic", "numpy")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def winnow_version() -> str:
    try:
        return metadata.version("winnow")
    except metadata.PackageNotFoundError:  # running from a source tree that was not pip-installed (ray job submit)
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, ValueError):
            return "unknown"


def git_commit() -> str | None:
    """The commit of the code's checkout, with ``-dirty`` when it has uncommitted changes; None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def new_manifest(config: JobConfig, prompts: int, parameters: ParameterCounts | None = None) -> Manifest:
    """The manifest a run writes before its first row; `parameters`: its models' parameter counts
    (`runfolder.parameters.job_parameters`)."""
    return Manifest(
        name=config.name,
        config=config.model_dump(mode="json"),
        config_hash=config.hash(),
        winnow_version=winnow_version(),
        packages=package_versions(),
        git_commit=git_commit(),
        status="running",
        started_at=now(),
        prompts=prompts,
        parameters=parameters,
    )


def counted(manifest: Manifest, config: JobConfig, t: Tally, **changes) -> Manifest:
    """The manifest with the folder's tallies (`t`: rows, errors, cost, reward inputs cut) and `changes`."""
    data = manifest.model_dump()
    sr = config.method.name == "speculative_rejection"
    data.update(rows=t.rows, errors=t.errors, cost=t.cost_totals(config.cost.usd_per_device_hour),
                reward_inputs_truncated=t.reward_inputs_truncated, generated_tokens=t.generated_tokens,
                candidates=t.candidates, rejected=t.rejected, decoding_steps=round(t.decoding_steps, 3),
                reward_steps=round(t.reward_steps, 3),
                mean_width=round(t.mean_width(), 3) if t.mean_width() is not None else None,
                reward_forwards_per_scoring=round(t.reward_forwards_per_scoring(), 4)
                if t.reward_forwards_per_scoring() is not None else None,
                no_cut=(t.rejected == 0 and t.candidates > 0) if sr else None, **changes)
    return Manifest.model_validate(data)


def finish_manifest(manifest: Manifest, folder: RunFolder, config: JobConfig, t: Tally, status: str,
                    error: str | None = None) -> Manifest:
    """Rewrite the manifest with the end time, the status and the folder's tallies (`t`)."""
    out = counted(manifest, config, t, status=status, finished_at=now(), error=error)
    folder.write_manifest(out)
    return out
