"""The run folder of `winnow generate` (`output.path`): what is in it, who may write into it, and its manifest.

Layout (local folder or any fsspec URL, e.g. s3://bucket/prefix):

- ``manifest.json``: `schemas.manifest.Manifest`; written first (status ``running``) and rewritten at the end.
- ``prompts.parquet``: the normalised prompt set (`pipeline.prompts.INPUT_SCHEMA`), written once by the first run; a
  resumed run reads it instead of the source, so every run of a folder works on the same prompts.
- ``candidates/*.parquet``: output rows (`schemas.rows.ROW_SCHEMA`), written by Ray Data as prompts finish.
- ``_checkpoint/``: Ray Data's checkpoint of written prompt_ids (two-phase: ``*.pending.parquet`` before a data
  file is written, renamed to ``*.parquet`` once it is). A data file counts as written only when its checkpoint
  is committed; a resumed run deletes data files whose checkpoint is still pending, then skips committed ids.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import uuid
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from schemas.base import InputError
from schemas.config import JobConfig
from schemas.manifest import CostTotals, Manifest
from schemas.rows import COST_FIELDS

PENDING = ".pending.parquet"


class RunFolder:
    """`output.path` as a filesystem and a path; local paths are made absolute (Ray workers write there too)."""

    def __init__(self, uri: str):
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        self.uri = uri.rstrip("/") or uri
        self.fs, self.path = fsspec.core.url_to_fs(self.uri)
        self.path = self.path.rstrip("/") or self.path

    @property
    def local(self) -> bool:
        p = self.fs.protocol
        return "file" in ((p,) if isinstance(p, str) else p)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def url(self, *parts: str) -> str:
        """A path inside the folder as Ray Data takes it: local absolute path, or a URL with its protocol."""
        inner = self.join(*parts)
        return inner if self.local else self.fs.unstrip_protocol(inner)

    def arrow_fs(self):
        """The pyarrow filesystem for Ray Data (None for local paths, which Ray resolves itself)."""
        if self.local:
            return None
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        return PyFileSystem(FSSpecHandler(self.fs))

    # -- state ----------------------------------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def entries(self) -> list[str]:
        return self.fs.ls(self.path, detail=False) if self.fs.isdir(self.path) else []

    def read_manifest(self) -> Manifest | None:
        p = self.join("manifest.json")
        if not self.fs.isfile(p):
            return None
        try:
            with self.fs.open(p, "rb") as f:
                return Manifest.model_validate(json.loads(f.read().decode("utf-8")))
        except (ValueError, UnicodeDecodeError, ValidationError) as err:
            raise InputError(
                f"output.path: {self.uri}/manifest.json is not a Winnow manifest ({str(err).splitlines()[0]}); "
                "pass --overwrite to replace the run, or choose another output.path"
            ) from None

    def has_prompts(self) -> bool:
        return self.fs.isfile(self.join("prompts.parquet"))

    # -- writing ----------------------------------------------------------------------------------------------------

    def clear(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def _write_atomic(self, name: str, data: bytes) -> None:
        """Write a file in one piece: a temporary sibling renamed into place (one PUT on object stores)."""
        self.fs.makedirs(self.path, exist_ok=True)
        final = self.join(name)
        if not self.local:
            self.fs.pipe_file(final, data)
            return
        tmp = self.join(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)

    def write_manifest(self, manifest: Manifest) -> None:
        self._write_atomic("manifest.json", json.dumps(manifest.model_dump(mode="json"), indent=2).encode())

    def write_prompts(self, table: pa.Table) -> None:
        buf = io.BytesIO()
        pq.write_table(table, buf)
        self._write_atomic("prompts.parquet", buf.getvalue())

    def read_prompt_ids(self) -> list[str]:
        with self.fs.open(self.join("prompts.parquet"), "rb") as f:
            return pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()


# ---------------------------------------------------------------------------------------------------------------
# Who may write into the folder


def claim_problems(folder: RunFolder, config: JobConfig, overwrite: bool) -> tuple[list[str], str]:
    """Whether this config may run into `folder`: (problems, mode) with mode "new", "resume" or "overwrite".

    A folder holding another config's run (a different hash in its manifest) is refused unless `overwrite`. A
    non-empty folder without a manifest is not a run folder and is refused even with `overwrite`: clearing it could
    delete files that Winnow did not write.
    """
    where = f"output.path: {folder.uri}"
    try:
        if folder.fs.isfile(folder.path):
            return [f"{where} is a file; expected a folder"], "new"
        entries = folder.entries()
        if not entries:
            return [], "new"
        manifest = folder.read_manifest() if not overwrite else None
    except InputError as err:
        return err.problems, "new"
    except OSError as err:
        return [f"{where}: cannot be read ({err})"], "new"
    if overwrite:
        if not folder.fs.isfile(folder.join("manifest.json")):
            return [
                f"{where} is not empty and holds no manifest.json, so it is not a Winnow run folder; refusing to "
                "clear it even with --overwrite; empty it yourself or choose another output.path"
            ], "overwrite"
        return [], "overwrite"
    if manifest is None:
        return [
            f"{where} is not empty and holds no manifest.json (not a Winnow run folder); choose another output.path"
        ], "new"
    if manifest.config_hash != config.hash():
        changed = changed_keys(manifest.config, config.model_dump(mode="json"))
        return [
            f"{where} holds a run of a different config (hash {manifest.config_hash}, this config "
            f"{config.hash()}; changed: {', '.join(changed) or 'unknown'}); pass --overwrite to replace it, or "
            "choose another output.path"
        ], "resume"
    return [], "resume"


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dumps."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, name + ".")
        elif a != b:
            out.append(name)
    return out


# ---------------------------------------------------------------------------------------------------------------
# What has been written


@dataclass
class Tally:
    rows: int = 0
    errors: int = 0
    ids: list[str] = field(default_factory=list)
    best_rewards: list[float] = field(default_factory=list)
    cost: dict = field(default_factory=lambda: {k: 0 for k in COST_FIELDS})
    rows_without_cost: int = 0  # rows whose cost (or a field of it) is null; left out of `cost`
    reward_inputs_truncated: int = 0  # stats.reward_inputs_truncated summed over rows

    def mean_best_reward(self) -> float | None:
        return sum(self.best_rewards) / len(self.best_rewards) if self.best_rewards else None

    def cost_totals(self, usd_per_device_hour: float) -> CostTotals:
        cost = {k: self.cost[k] for k in COST_FIELDS}
        return CostTotals(**cost, usd=cost["device_seconds"] / 3600.0 * usd_per_device_hour,
                          rows_without_cost=self.rows_without_cost)


def pending_checkpoints(folder: RunFolder) -> list[str]:
    """Checkpoints of writes that a crash cut short (their data files are deleted by the next run)."""
    ckpt = folder.join("_checkpoint")
    if not folder.fs.isdir(ckpt):
        return []
    return [p for p in folder.fs.ls(ckpt, detail=False) if p.endswith(PENDING)]


def committed_files(folder: RunFolder) -> list[str]:
    """Data files under candidates/ whose Ray Data checkpoint is committed (so they were written whole)."""
    return committed_data_files(folder.fs, folder.path)


def committed_data_files(fs, path: str) -> list[str]:
    """committed_files for a run folder given as a filesystem and a path."""
    ckpt, data = posixpath.join(path, "_checkpoint"), posixpath.join(path, "candidates")
    if not fs.isdir(data) or not fs.isdir(ckpt):
        return []
    bases = [
        posixpath.basename(p)[: -len(".parquet")]
        for p in fs.ls(ckpt, detail=False)
        if p.endswith(".parquet") and not p.endswith(PENDING)
    ]
    out = []
    for p in sorted(fs.find(data)):
        name = posixpath.basename(p)
        if name.endswith(".parquet") and any(name.startswith(b + "-") or name == b + ".parquet" for b in bases):
            out.append(p)
    return out


def tally(folder: RunFolder) -> Tally:
    """Count the committed rows of the folder: rows, errors, best rewards, summed cost, reward inputs cut."""
    t = Tally()
    for path in committed_files(folder):
        with folder.fs.open(path, "rb") as f:  # file by file: files of older versions may lack newer stats fields
            table = pq.read_table(f, columns=["prompt_id", "error", "best_reward", "cost", "stats"])
        t.rows += table.num_rows
        t.ids += table.column("prompt_id").to_pylist()
        errors = table.column("error").to_pylist()
        t.errors += sum(e is not None for e in errors)
        t.best_rewards += [r for r, e in zip(table.column("best_reward").to_pylist(), errors)
                           if r is not None and e is None]
        for c in table.column("cost").to_pylist():
            if c is None or any(c.get(k) is None for k in COST_FIELDS):
                t.rows_without_cost += 1  # not summed as 0: the totals say how many rows they leave out
                continue
            for k in COST_FIELDS:
                t.cost[k] += c[k]
        for s in table.column("stats").to_pylist():
            t.reward_inputs_truncated += (s or {}).get("reward_inputs_truncated") or 0  # null: no reward model
    return t


def exactly_once_problems(expected: list[str], written: list[str]) -> list[str]:
    """Differences between the prompt set and the written rows: duplicates, missing and unknown prompt_ids."""
    problems = []
    seen: set[str] = set()
    dups = sorted({p for p in written if p in seen or seen.add(p)})
    if dups:
        problems.append(f"{len(dups)} prompt_id(s) written more than once, e.g. {dups[:3]}")
    missing = sorted(set(expected) - seen)
    if missing:
        problems.append(f"{len(missing)} prompt(s) not written, e.g. {missing[:3]}")
    unknown = sorted(seen - set(expected))
    if unknown:
        problems.append(f"{len(unknown)} row(s) for prompt_ids not in prompts.parquet, e.g. {unknown[:3]}")
    return problems
