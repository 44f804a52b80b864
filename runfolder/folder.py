"""The run folder of `winnow generate` (`output.path`): what is in it, who may write into it, and its manifest.

Layout (local folder or any fsspec URL, e.g. s3://bucket/prefix):

- ``manifest.json``: `schemas.manifest.Manifest`; written first (status ``running``) and rewritten at the end.
- ``prompts/``: the normalised prompt set (`pipeline.prompts.INPUT_SCHEMA`, Parquet files), written once by the first
  run (staged beside the folder by Ray tasks, moved in, then marked whole by ``prompts/_COMPLETE.json``); a resumed
  run reads it instead of the source, so every run of a folder works on the same prompts. A folder written by an
  earlier version holds the set as one file, ``prompts.parquet``, which is still read.
- ``candidates/*.parquet``: output rows (`schemas.rows.ROW_SCHEMA`), written by Ray Data as prompts finish.
- ``_checkpoint/``: Ray Data's checkpoint of written prompt_ids (two-phase: ``*.pending.parquet`` before a data
  file is written, renamed to ``*.parquet`` once it is). A data file counts as written only when its checkpoint
  is committed; a resumed run deletes data files whose checkpoint is still pending, then skips committed ids.
  `settle_checkpoints` runs first, so that a commit cut short on an object store never loses a committed file.
- ``_checkpoint_orphans/``: only after a repair: committed checkpoints whose data files were gone or damaged, moved
  aside (see `settle_checkpoints`) so that their prompts are generated again, the damaged data files in its
  ``damaged/``; kept as a record, never read.

Listings are always read fresh from the store (`RunFolder.refresh`): s3fs caches directory listings per process, and
a listing from before a run would hide the files the run wrote.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from pydantic import ValidationError

from runfolder.lease import LEASE_FILE, held_message, holder_of, lease_path
from runfolder.paths import HOLDS, INSIDE, SAME, local_write_problem, relation
from schemas.base import InputError
from schemas.config import JobConfig
from schemas.manifest import CostTotals, Manifest
from schemas.rows import COST_FIELDS
from stores.filesystems import filesystem, store_problem

PENDING = ".pending.parquet"
PROMPTS_DIR = "prompts"  # the normalised prompt set, Parquet files written by Ray tasks
PROMPTS_DONE = "_COMPLETE.json"  # in prompts/, written last: the set is whole
LEGACY_PROMPTS = "prompts.parquet"  # the single file earlier versions wrote; still read
ORPHANS = "_checkpoint_orphans"
DAMAGED = "damaged"  # in ORPHANS: committed data files that could not be read, moved aside
INFLIGHT = "_inflight"  # records of the calls actors are running (`pipeline.faults`)

# Everything Winnow writes at the top of a run folder, and the files it writes inside each of its folders. Anything
# else was put there by someone else: it is never deleted (`--overwrite` names it and refuses), only left alone.
OWNED: dict[str, re.Pattern | None] = {  # name -> what the folder of that name holds (None: a file)
    "manifest.json": None,
    LEGACY_PROMPTS: None,
    PROMPTS_DIR: re.compile(r"^(?:[^/]+\.parquet|" + re.escape(PROMPTS_DONE) + r")$"),
    "candidates": re.compile(r"^[^/]+\.parquet$"),
    "_checkpoint": re.compile(r"^[^/]+\.parquet$"),
    ORPHANS: re.compile(r"^(?:[^/]+\.parquet|" + re.escape(DAMAGED) + r"/[^/]+)$"),
    INFLIGHT: re.compile(r"^[^/]+\.json$"),
}
_ATOMIC_TMP = re.compile(r"^\.[^/]+\.[0-9a-f]{8}\.tmp$")  # `RunFolder._write_atomic`'s file before its rename


def refresh(fs, path: str) -> None:
    """Forget what `fs` has cached about `path`, its parents and everything under it (s3fs caches listings)."""
    fs.invalidate_cache(path)
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        inner = path.rstrip("/") + "/"
        for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(inner)]:
            cache.pop(key, None)


def store(uri: str, shown: str | None = None):
    """`stores.filesystems.filesystem(uri)`, with a bad store setting (e.g. WINNOW_S3_MAX_ATTEMPTS) as InputError
    naming the path (`shown`: as the user gave it, e.g. "output.path: s3://b/run")."""
    try:
        return filesystem(uri)
    except ValueError as err:
        raise InputError(f"{shown or uri}: {err}") from None


class RunFolder:
    """`output.path` as a filesystem and a path; local paths are made absolute (Ray workers write there too)."""

    def __init__(self, uri: str):
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        self.uri = uri.rstrip("/") or uri
        self.fs, self.path = store(self.uri, f"output.path: {self.uri}")

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

    def refresh(self) -> None:
        """Drop the filesystem's cached listings of the folder, so the next look reads the store itself."""
        refresh(self.fs, self.path)

    def exists(self) -> bool:
        self.refresh()
        return self.fs.exists(self.path)

    def entries(self) -> list[str]:
        """What the folder holds, its lease file (`runfolder.lease`) aside."""
        self.refresh()
        if not self.fs.isdir(self.path):
            return []
        return [p for p in self.fs.ls(self.path, detail=False) if posixpath.basename(p.rstrip("/")) != LEASE_FILE]

    def read_manifest(self) -> Manifest | None:
        """The folder's manifest, or None when it has no manifest.json; InputError when manifest.json is not a
        Winnow manifest (the folder then holds something Winnow did not write, and --overwrite will not clear it)."""
        p = self.join("manifest.json")
        self.refresh()
        if not self.fs.isfile(p):
            return None
        try:
            with self.fs.open(p, "rb") as f:
                return Manifest.model_validate(json.loads(f.read().decode("utf-8")))
        except (ValueError, UnicodeDecodeError, ValidationError) as err:
            raise InputError(
                f"output.path: {self.uri}/manifest.json is not a Winnow manifest ({str(err).splitlines()[0]}), so "
                "the folder is not a Winnow run folder and is never cleared, even with --overwrite; choose another "
                "output.path, or move the folder's files away yourself"
            ) from None

    def has_prompts(self) -> bool:
        """Whether the folder holds its whole prompt set: ``prompts/`` with its completion mark, or the single
        ``prompts.parquet`` file of a folder written by an earlier Winnow."""
        self.refresh()
        return self.fs.isfile(self.join(PROMPTS_DIR, PROMPTS_DONE)) or self.fs.isfile(self.join(LEGACY_PROMPTS))

    def prompts_url(self) -> str:
        """The prompt set as Ray Data reads it (a folder of Parquet files, or the legacy single file)."""
        if self.fs.isfile(self.join(PROMPTS_DIR, PROMPTS_DONE)):
            return self.url(PROMPTS_DIR)
        return self.url(LEGACY_PROMPTS)

    def prompts_staging(self) -> tuple[str, str]:
        """A fresh place for a prompt set being written, beside the folder (not in it, so that a folder being
        replaced with --overwrite is untouched until the new prompts are whole): (path in `fs`, URL for Ray Data)."""
        path = f"{self.path}.prompts-{uuid.uuid4().hex[:12]}"
        return path, (path if self.local else self.fs.unstrip_protocol(path))

    def install_prompts(self, staged: str, rows: int) -> None:
        """Move a whole staged prompt set (`prompts_staging`) to ``prompts/``, replacing what an interrupted install
        left there, and mark it complete last (a rename on a local disk; a copy per file on object stores, where the
        mark is what tells a whole set from a part)."""
        dest = self.join(PROMPTS_DIR)
        self.refresh()
        if self.fs.exists(dest):
            self.fs.rm(dest, recursive=True)
        if self.local:
            os.rename(staged, dest)
        else:
            for src in self.fs.find(staged):
                self.fs.copy(src, dest + src[len(staged):])
            self.fs.rm(staged, recursive=True)
        self.fs.pipe_file(posixpath.join(dest, PROMPTS_DONE), json.dumps({"rows": rows}).encode())
        self.refresh()

    # -- writing ----------------------------------------------------------------------------------------------------

    def foreign(self) -> list[str]:
        """What the folder holds that Winnow did not write (`OWNED`), relative to the folder, folders with a
        trailing slash: a user's notes beside the run, or files put inside its folders."""
        out = []
        for entry in self.entries():
            name = posixpath.basename(entry.rstrip("/"))
            is_dir = self.fs.isdir(entry)
            if name not in OWNED and not (not is_dir and _ATOMIC_TMP.match(name)):
                out.append(name + ("/" if is_dir else ""))
            elif name in OWNED and is_dir != (OWNED[name] is not None):
                out.append(name + ("/" if is_dir else ""))
            elif is_dir:
                inside = OWNED[name]
                for p in self.fs.find(entry, withdirs=False):
                    rel = p[len(entry.rstrip("/")) + 1:]
                    if not inside.match(rel):
                        out.append(f"{name}/{rel}")
        return sorted(out)

    def clear(self) -> None:
        """Delete what Winnow wrote in the folder but its lease (held by the run that clears it), in an order that a
        kill at any point leaves a folder the next command can still take: the data files first (a committed
        checkpoint without its data is regenerated, see `settle_checkpoints`), the checkpoint after everything else,
        and manifest.json last, so the folder is a Winnow run folder (and --overwrite can clear it) until it is
        empty. Nothing else is touched: `claim_problems` refuses --overwrite on a folder that holds anything else
        (`foreign`), and an entry found here that Winnow did not write is left where it is."""
        entries = [e for e in self.entries() if posixpath.basename(e.rstrip("/")) in OWNED
                   or _ATOMIC_TMP.match(posixpath.basename(e.rstrip("/")))]
        names = {posixpath.basename(e.rstrip("/")): e for e in entries}
        first = [names[n] for n in ("candidates",) if n in names]
        last = [names[n] for n in ("_checkpoint", "manifest.json") if n in names]
        middle = [e for e in entries if e not in first and e not in last]
        for entry in first + middle + last:
            inside = OWNED.get(posixpath.basename(entry.rstrip("/")))
            if inside is None or not self.fs.isdir(entry):
                self.fs.rm(entry, recursive=True)
                continue
            base = entry.rstrip("/")
            theirs = [p for p in self.fs.find(base, withdirs=False) if not inside.match(p[len(base) + 1:])]
            if not theirs:
                self.fs.rm(entry, recursive=True)
                continue
            for p in self.fs.find(base, withdirs=False):
                if inside.match(p[len(base) + 1:]):
                    self.fs.rm_file(p)
        self.refresh()

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

    def read_prompt_ids(self) -> list[str]:
        """Every prompt_id of the prompt set, in file order (files whose names start with _ or . are not data)."""
        path = self.join(PROMPTS_DIR) if self.fs.isfile(self.join(PROMPTS_DIR, PROMPTS_DONE)) else self.join(
            LEGACY_PROMPTS)
        return pads.dataset(path, filesystem=self.fs, format="parquet").to_table(
            columns=["prompt_id"]).column("prompt_id").to_pylist()


# ---------------------------------------------------------------------------------------------------------------
# Run folders inside run folders, and what killed runs left behind


def is_run_folder(fs, path: str) -> bool:
    """Whether `path` holds a manifest.json that is a Winnow manifest (`schemas.manifest.Manifest`)."""
    manifest = posixpath.join(path, "manifest.json")
    try:
        if not fs.isfile(manifest):
            return False
        with fs.open(manifest, "rb") as f:
            Manifest.model_validate(json.loads(f.read().decode("utf-8")))
    except (ValueError, UnicodeDecodeError, ValidationError, FileNotFoundError):
        return False
    return True


def holds_run_folder(fs, path: str, below_only: bool = False, maxdepth: int | None = None) -> str | None:
    """The first Winnow run folder at or under `path` (strictly under it with `below_only`; searched `maxdepth`
    levels down, all of it when None), or None."""
    refresh(fs, path)
    if not fs.isdir(path):
        return None
    if not below_only and is_run_folder(fs, path):
        return fs.unstrip_protocol(path) if not _is_local_fs(fs) else path
    found = sorted(p for p in fs.find(path, maxdepth=maxdepth) if posixpath.basename(p) == "manifest.json")
    for manifest in found:
        inner = posixpath.dirname(manifest)
        if inner.rstrip("/") != path.rstrip("/") and is_run_folder(fs, inner):
            return fs.unstrip_protocol(inner) if not _is_local_fs(fs) else inner
    return None


def _is_local_fs(fs) -> bool:
    p = fs.protocol
    return "file" in ((p,) if isinstance(p, str) else p)


def enclosing_run_folder(folder: RunFolder) -> str | None:
    """The Winnow run folder that `folder` sits inside (a parent holding a Winnow manifest.json), or None."""
    path = folder.path
    while True:
        parent = posixpath.dirname(path.rstrip("/"))
        if not parent or parent == path or (not folder.local and "/" not in parent):  # the root, or an S3 bucket
            return None
        path = parent
        refresh(folder.fs, path)
        if is_run_folder(folder.fs, path):
            return path if folder.local else folder.fs.unstrip_protocol(path)


def nesting_problems(folder: RunFolder, source: str | None = None, source_shown: str | None = None) -> list[str]:
    """Why `folder` may not be a run folder here: it sits inside another run folder (a run created inside another
    run's prompts/ breaks that run's resume), it holds one below it, or it is, holds or sits inside the data source
    (`source`, a resolved local path or URL; shown as `source_shown`)."""
    where = f"output.path: {folder.uri}"
    problems = []
    outer = enclosing_run_folder(folder)
    if outer is not None:
        problems.append(f"{where} is inside the run folder {outer}; a run folder inside another breaks that run's "
                        "resume: choose a path outside it")
    # a run folder's own files are searched whole; any other folder (refused anyway when it is not empty, and
    # perhaps as large as a home directory) four levels down
    depth = None if is_run_folder(folder.fs, folder.path) else 4
    inner = holds_run_folder(folder.fs, folder.path, below_only=True, maxdepth=depth)
    if inner is not None:
        problems.append(f"{where} holds the run folder {inner}; run folders are never nested: choose another path")
    if source is not None:
        try:
            how = relation(folder.uri, source)
        except (InputError, ValueError, ImportError):  # a source of a store this machine cannot name: apart
            how = None
        what = {SAME: "is", INSIDE: "is inside", HOLDS: "holds"}.get(how)
        if what:
            problems.append(f"{where} {what} the data source data.source: {source_shown or source}; a run never "
                            "writes into or clears its own input: choose an output.path apart from it")
    return problems


_STAGED = re.compile(r"\.prompts-[0-9a-f]{12}$")
_TMP_MANIFEST = re.compile(r"^\.manifest\.json\.[0-9a-f]{8}\.tmp$")


def clean_leftovers(folder: RunFolder, keep: str | None = None) -> list[str]:
    """Remove what runs of this folder that were killed left behind; one line per thing removed. Call only while
    holding the folder's lease: every such file was made by a holder of that lease, so its maker is gone.

    - ``RUN.prompts-<hex>`` beside the folder: a prompt set staged by a run killed before moving it in (`keep`, the
      staging of this run, is kept). A sibling holding a manifest.json is never touched.
    - ``RUN/.manifest.json.<hex>.tmp``: a manifest write cut between its write and its rename.
    """
    fs = folder.fs
    parent = posixpath.dirname(folder.path)
    base = posixpath.basename(folder.path)
    lines = []
    refresh(fs, parent)
    try:
        siblings = fs.ls(parent, detail=False) if parent else []
    except FileNotFoundError:
        siblings = []
    for p in siblings:
        p = p.rstrip("/")
        name = posixpath.basename(p)
        m = _STAGED.search(name)
        if not m or name[: m.start()] != base or (keep and p == keep.rstrip("/")):
            continue
        if fs.isdir(p) and not fs.isfile(posixpath.join(p, "manifest.json")):
            fs.rm(p, recursive=True)
            lines.append(f"removed {p}, a prompt set staged by a run that was killed before it moved it in")
    if fs.isdir(folder.path):
        for p in fs.ls(folder.path, detail=False):
            if _TMP_MANIFEST.match(posixpath.basename(p.rstrip("/"))):
                fs.rm(p)
                lines.append(f"removed {p}, a manifest write cut short by a kill")
    if lines:
        refresh(fs, parent)
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Who may write into the folder


def as_first_spelled(folder: RunFolder, config: JobConfig) -> JobConfig:
    """`config` with output.path spelled as in the folder's manifest, when that spelling is the only difference.

    output.path is part of the config and so of its hash, but one folder is one run however it is spelled (``runs/a``,
    ``runs/a/``, ``./runs/a``, its absolute path, or after the folder was moved): the folder is found by the path
    given, and the run it holds is resumed under the spelling it started with, so its rows keep one config_hash.
    Anything else (no manifest, not a Winnow manifest, another config) is left to `claim_problems`."""
    try:
        manifest = folder.read_manifest() if folder.exists() else None
    except (InputError, OSError):
        return config
    if manifest is None or manifest.config_hash == config.hash():
        return config
    if changed_keys(manifest.config, config.model_dump(mode="json")) != ["output.path"]:
        return config
    adopted = config.model_copy(update={"output": config.output.model_copy(
        update={"path": manifest.config["output"]["path"]})})
    return adopted if adopted.hash() == manifest.config_hash else config


def claim_problems(folder: RunFolder, config: JobConfig, overwrite: bool) -> tuple[list[str], str]:
    """Whether this config may run into `folder`: (problems, mode) with mode "new", "resume" or "overwrite".

    A folder holding another config's run (a different hash in its manifest) is refused unless `overwrite`. Only a
    Winnow run folder (its manifest.json parses as `schemas.manifest.Manifest`) is ever cleared: a non-empty folder
    without a manifest.json, or whose manifest.json is anything else, is refused even with `overwrite`, since
    clearing it could delete files that Winnow did not write.
    """
    where = f"output.path: {folder.uri}"
    try:
        folder.refresh()
        if folder.fs.isfile(folder.path):
            return [f"{where} is a file; expected a folder"], "new"
        unwritable = write_problem(folder)
        if unwritable:
            return [unwritable], "new"
        holder = holder_of(folder.fs, lease_path(folder.path))
        if holder is not None:
            return [held_message(where, holder, folder.url(LEASE_FILE))], "new"
        entries = folder.entries()
        if not entries:
            return [], "new"
        manifest = folder.read_manifest()  # InputError when manifest.json is not a Winnow manifest, overwrite or not
    except InputError as err:
        return err.problems, "new"
    except OSError as err:
        return [f"{where}: cannot be read ({err})"], "new"
    if overwrite:
        if manifest is None:
            return [
                f"{where} is not empty and holds no manifest.json, so it is not a Winnow run folder; refusing to "
                "clear it even with --overwrite; empty it yourself or choose another output.path"
            ], "overwrite"
        try:
            foreign = folder.foreign()
        except OSError as err:
            return [f"{where}: cannot be read ({err})"], "overwrite"
        if foreign:
            shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
            return [
                f"{where} holds what Winnow did not write: {shown}; --overwrite replaces only a run's own files "
                "and deletes nothing else: move these out of the folder first, or choose another output.path"
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


def write_problem(folder: RunFolder) -> str | None:
    """Why `folder` cannot be created or written into, or None. A local folder (`runfolder.paths.local_write_problem`):
    a file where a parent folder should be, a read-only filesystem, or no write permission on the folder or on its
    nearest existing parent, checked writing nothing. An object store: that it answers a listing of the folder
    (`stores.filesystems.store_problem`: credentials, endpoint, bucket); a write's own permission shows only when a
    write is tried."""
    if not folder.local:
        problem = store_problem(folder.fs, folder.path)
        return f"output.path: {folder.uri}: {problem}" if problem else None
    return local_write_problem(folder.path, f"output.path: {folder.uri}")


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
    generated_tokens: int = 0  # stats.generated_tokens summed: tokens the candidates generated (not prefill, reward)
    candidates: int = 0  # candidates started, over rows
    rejected: int = 0  # candidates whose finish_reason is "rejected" (stopped by a Speculative Rejection cut)
    decoding_steps: float = 0.0  # stats.decoding_steps summed: the decoding steps the run's actors took
    sequence_steps: int = 0  # stats.sequence_steps summed
    reward_steps: float = 0.0  # stats.reward_steps summed: the reward-model forwards the run's actors made
    scorings: int = 0  # prompt scorings by the reward model's forwards: decisions, and each scored prompt's last
    files: list[str] = field(default_factory=list)  # the committed data files counted, in the order read

    def mean_width(self) -> float | None:
        """Sequences per decoding step, over the run's steps (None without steps)."""
        return self.sequence_steps / self.decoding_steps if self.decoding_steps > 0 else None

    def reward_forwards_per_scoring(self) -> float | None:
        """The reward model's forwards per prompt scoring (None without a scoring by its forwards)."""
        return self.reward_steps / self.scorings if self.scorings else None

    def mean_best_reward(self) -> float | None:
        return sum(self.best_rewards) / len(self.best_rewards) if self.best_rewards else None

    def cost_totals(self, usd_per_device_hour: float) -> CostTotals:
        cost = {k: self.cost[k] for k in COST_FIELDS}
        return CostTotals(**cost, usd=cost["device_seconds"] / 3600.0 * usd_per_device_hour,
                          rows_without_cost=self.rows_without_cost)

    def add_file(self, fs, path: str) -> None:
        """Count one committed data file's rows in (`tally`; and the progress display of a running job, which reads
        only the files committed since its last look). DamagedFile when the file cannot be read."""
        try:
            with fs.open(path, "rb") as f:  # file by file: files of older versions may lack newer stats fields
                parquet = pq.ParquetFile(f)
                leaves = [parquet.schema.column(i).path for i in range(len(parquet.schema))]
                reason = [p for p in leaves if p.startswith("candidates.") and p.endswith(".finish_reason")][:1]
                table = parquet.read(columns=["prompt_id", "error", "best_reward", "cost", "stats", *reason])
        except pa.ArrowException as err:
            raise DamagedFile(path, err) from None
        self.files.append(path)
        self.rows += table.num_rows
        self.ids += table.column("prompt_id").to_pylist()
        errors = table.column("error").to_pylist()
        self.errors += sum(e is not None for e in errors)
        self.best_rewards += [r for r, e in zip(table.column("best_reward").to_pylist(), errors)
                              if r is not None and e is None]
        for c in table.column("cost").to_pylist():
            if c is None or any(c.get(k) is None for k in COST_FIELDS):
                self.rows_without_cost += 1  # not summed as 0: the totals say how many rows they leave out
                continue
            for k in COST_FIELDS:
                self.cost[k] += c[k]
        for s in table.column("stats").to_pylist():
            self.reward_inputs_truncated += (s or {}).get("reward_inputs_truncated") or 0  # null: no reward model
            self.generated_tokens += (s or {}).get("generated_tokens") or 0
            self.decoding_steps += (s or {}).get("decoding_steps") or 0.0
            self.sequence_steps += (s or {}).get("sequence_steps") or 0
            self.reward_steps += (s or {}).get("reward_steps") or 0.0
            if (s or {}).get("reward_steps"):  # its decisions, and the scoring of its candidates at their end
                self.scorings += (s.get("rejection_rounds") or 0) + 1
        if "candidates" in table.column_names:  # only the finish_reason of each candidate is read, not its text
            flat = pc.list_flatten(table.column("candidates"))
            self.candidates += len(flat)
            if len(flat):
                self.rejected += pc.sum(pc.equal(pc.struct_field(flat, "finish_reason"), "rejected")).as_py() or 0


def pending_checkpoints(folder: RunFolder) -> list[str]:
    """Checkpoints of writes that a crash cut short (their data files are deleted by the next run). Read fresh."""
    ckpt = folder.join("_checkpoint")
    refresh(folder.fs, ckpt)
    if not folder.fs.isdir(ckpt):
        return []
    return sorted(p for p in folder.fs.ls(ckpt, detail=False) if p.endswith(PENDING))


def committed_files(folder: RunFolder) -> list[str]:
    """Data files under candidates/ whose Ray Data checkpoint is committed (so they were written whole)."""
    return committed_data_files(folder.fs, folder.path)


def _is_data_file_of(name: str, base: str) -> bool:
    """Whether data file `name` was written by the write task whose checkpoint is named `base` (Ray Data names a
    task's files ``<base>.parquet`` or ``<base>-<i>.parquet``)."""
    return name.endswith(".parquet") and (name.startswith(base + "-") or name == base + ".parquet")


def committed_data_files(fs, path: str) -> list[str]:
    """committed_files for a run folder given as a filesystem and a path (listings read fresh from the store)."""
    ckpt, data = posixpath.join(path, "_checkpoint"), posixpath.join(path, "candidates")
    refresh(fs, path)
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
        if any(_is_data_file_of(name, b) for b in bases):
            out.append(p)
    return out


def settle_checkpoints(folder: RunFolder) -> list[str]:
    """Finish or undo the checkpoint commits that an earlier run left half done, before Ray Data's recovery sees
    them; returns one line per file touched (for the log). No data file is ever deleted here.

    Ray Data (2.60, `ray.data.checkpoint`) commits each write task in three steps, and at the start of the next
    run (`CheckpointManager.load_checkpoint` -> `_clean_pending_checkpoints_task`) it deletes every data file whose
    name starts with the base name of a ``*.pending.parquet`` checkpoint, then the pending checkpoints themselves,
    whether or not a committed twin exists; only then does it read the committed checkpoints and skip their ids.
    Where a run can be cut, and what happens next:

    1. Pending checkpoint written, data file not yet (or partly) written: only ``<base>.pending.parquet``. Ray's
       recovery deletes the partial data file and the pending checkpoint; the prompts are generated again. Left
       to Ray.
    2. Data file written, checkpoint not yet renamed: the same state, the same outcome (the whole data file is
       deleted and its prompts generated again; wasted work, nothing lost). Left to Ray.
    3. The rename ``<base>.pending.parquet`` -> ``<base>.parquet``: atomic on a local disk, but on S3 (and other
       object stores) a copy then a delete. Cut between the two, both files exist. Ray's recovery would delete the
       data file (the pending twin matches it) while the committed checkpoint still skips its prompt_ids: those
       prompts would be lost. The commit did complete (the copy is whole: S3 copies are atomic), so here the stale
       pending file alone is removed and the data file is kept: **fixed here**.
    4. Committed checkpoint alone: written. Nothing to do.
    5. Ray's own recovery cut between deleting the data files and deleting the pending checkpoints: a pending
       checkpoint without data files; the next recovery deletes it. Left to Ray.

    And two repairs of committed writes whose data is not what the checkpoint records, which would otherwise be
    skipped forever:

    - a committed checkpoint with no data file of its own (a folder that an earlier Winnow, without step 3's fix,
      damaged): its prompts are in no file. The checkpoint is moved aside to ``_checkpoint_orphans/`` (kept, never
      read), so those prompts are generated again. No write task commits without a data file (Ray writes a
      checkpoint only for a non-empty block, and the block's file before committing);
    - a committed data file that is damaged (cut short, 0 bytes, not Parquet, or holding other prompt_ids than its
      checkpoint; a disk that filled or a copy cut short): the data file goes to ``_checkpoint_orphans/damaged/``
      and its checkpoint to ``_checkpoint_orphans/``, so its prompts are generated again. A read that fails because
      the store does not answer is raised instead, and nothing is moved.

    Nothing is writing while this runs (it runs before the pipeline, under the folder's lease).
    """
    fs = folder.fs
    ckpt, data = folder.join("_checkpoint"), folder.join("candidates")
    refresh(fs, folder.path)
    if not fs.isdir(ckpt):
        return []
    names = {posixpath.basename(p) for p in fs.ls(ckpt, detail=False)}
    lines = []
    for name in sorted(n for n in names if n.endswith(PENDING)):
        twin = name[: -len(PENDING)] + ".parquet"
        if twin in names:
            fs.rm(posixpath.join(ckpt, name))
            names.discard(name)
            lines.append(f"_checkpoint/{twin} is committed but its pending copy {name} was left behind (a commit "
                         "cut between its copy and its delete); removed the stale pending file, kept the data file")
    by_base: dict[str, list[str]] = {}  # data files by the checkpoint base they belong to (`_is_data_file_of`)
    for p in sorted(fs.find(data)) if fs.isdir(data) else []:
        name = posixpath.basename(p)
        stem = name[: -len(".parquet")] if name.endswith(".parquet") else None
        if stem is not None:
            by_base.setdefault(stem, []).append(p)
            head, _, tail = stem.rpartition("-")
            if head and tail.isdigit():
                by_base.setdefault(head, []).append(p)
    for name in sorted(n for n in names if n.endswith(".parquet") and not n.endswith(PENDING)):
        base = name[: -len(".parquet")]
        own = [p for p in by_base.get(base, []) if _is_data_file_of(posixpath.basename(p), base)]
        if not own:
            fs.makedirs(folder.join(ORPHANS), exist_ok=True)
            fs.mv(posixpath.join(ckpt, name), folder.join(ORPHANS, name))
            lines.append(f"_checkpoint/{name} is committed but its data file is gone (deleted by an earlier run's "
                         f"recovery); moved it to {ORPHANS}/ so that its prompts are generated again")
            continue
        damage = _damage(fs, posixpath.join(ckpt, name), own)
        if damage is not None:
            fs.makedirs(folder.join(ORPHANS, DAMAGED), exist_ok=True)
            for p in own:
                fs.mv(p, folder.join(ORPHANS, DAMAGED, posixpath.basename(p)))
            fs.mv(posixpath.join(ckpt, name), folder.join(ORPHANS, name))
            shown = ", ".join(f"candidates/{posixpath.relpath(p, data)}" for p in own)
            lines.append(f"{shown} is damaged ({damage}); moved it to {ORPHANS}/{DAMAGED}/ and its checkpoint "
                         f"_checkpoint/{name} to {ORPHANS}/, so that its prompts are generated again")
    if lines:
        refresh(fs, folder.path)
    return lines


def _damage(fs, checkpoint: str, files: list[str]) -> str | None:
    """Why the data files of a committed checkpoint do not hold exactly its prompt_ids (cut short, empty, not
    Parquet, or other rows), or None. Only the files' own faults count: an error of the store itself (OSError) is
    raised, so that an outage never has good files moved aside."""
    ids: list[str] = []
    for p in files:
        try:
            with fs.open(p, "rb") as f:
                ids += pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()
        except pa.ArrowException as err:  # ArrowInvalid: 0 bytes, no magic bytes, a cut footer or page
            return f"not readable as Parquet: {str(err).splitlines()[0]}"
    try:
        with fs.open(checkpoint, "rb") as f:
            want = pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()
    except pa.ArrowException as err:
        return f"its checkpoint is not readable as Parquet: {str(err).splitlines()[0]}"
    if sorted(ids) != sorted(want):
        return f"it holds {len(ids)} row(s) where its checkpoint records {len(want)} prompt(s)"
    return None


def tally(folder: RunFolder) -> Tally:
    """Count the committed rows of the folder: rows, errors, best rewards, summed cost, reward inputs cut, generated
    tokens, candidates and rejected candidates."""
    t = Tally()
    for path in committed_files(folder):
        t.add_file(folder.fs, path)
    return t


class DamagedFile(RuntimeError):
    """A committed data file that cannot be read (`settle_checkpoints` moves such files aside before a run; this is
    one damaged after that, e.g. while the run was going)."""

    def __init__(self, path: str, err: BaseException):
        self.path = path
        super().__init__(f"{path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}); run the same "
                         f"command again: a damaged data file is moved to {ORPHANS}/{DAMAGED}/ and its prompts are "
                         "generated again")


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
        problems.append(f"{len(unknown)} row(s) for prompt_ids not in the prompt set, e.g. {unknown[:3]}")
    return problems
