"""Reading finished run folders for `winnow build-sft` and `winnow report`, local or remote, through one fsspec
code path.

A run folder (docs/jobs.md: Run folder, resume and exactly once) is ``RUN/manifest.json`` plus
``RUN/candidates/*.parquet``; it may be a local path, ``s3://bucket/prefix`` or any fsspec URL (``memory://`` in
tests). Parquet files are read as one dataset whatever their names (Ray Data picks its own); with Ray Data's
checkpoint present, only the files whose checkpoint is committed (`runfolder.folder.committed_data_files`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from pydantic import ValidationError

from runfolder.folder import committed_data_files, store
from runfolder.lease import holder_of, lease_path
from runfolder.paths import location_key
from schemas.base import InputError
from schemas.config import VERIFIER_REWARDS
from schemas.manifest import Manifest
from schemas.rows import LATE_CANDIDATE_FIELDS, ROW_SCHEMA, STATS_FIELDS
from stores.filesystems import store_problem

# Columns the tools read; others (new ones the job adds) are ignored.
READ_COLUMNS = ["prompt_id", "prompt", "method", "candidates", "best_index", "best_text", "best_reward", "cost",
                "stats", "error"]


@dataclass
class Run:
    """One run folder: where it is, its manifest, and its rows (one per prompt, deduplicated by prompt_id)."""

    uri: str
    manifest: Manifest
    rows: list[dict]
    superseded_errors: int = 0  # errored rows dropped because the same prompt_id also has a successful row
    status: str = ""  # the manifest's, except "interrupted" for a manifest left "running" by a run that is gone

    def __post_init__(self):
        self.status = self.status or self.manifest.status

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def method(self) -> str:
        return self.manifest.config["method"]["name"]

    @property
    def engine(self) -> str:
        """What generated the target's tokens: `hf` or `vllm` (models.engine; runs from before it existed: hf)."""
        return self.manifest.config["models"].get("engine", "hf")

    @property
    def usd_per_device_hour(self) -> float:
        return float(self.manifest.config["cost"]["usd_per_device_hour"])


def normalise_uri(uri: str) -> str:
    """A user-given path or URL without its trailing slash, so that `a/` and `a` name the same run."""
    return uri.rstrip("/") or uri


def folder_key(uri: str) -> str:
    """One spelling per folder, to tell whether two arguments name one run: a local path absolute with its symbolic
    links resolved (``runs/r``, ``./runs/r/`` and a link to it are one run), a URL as its store spells it
    (`runfolder.paths.location_key`)."""
    return location_key(uri)


def _manifest_problems(uri: str, data: object) -> tuple[Manifest | None, list[str]]:
    where = f"{uri}/manifest.json"
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as err:
        lines = [f"{where}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
        return None, lines
    problems = []
    cfg = manifest.config
    method = cfg.get("method")
    if not isinstance(method, dict) or not isinstance(method.get("name"), str):
        problems.append(f"{where}: config.method.name: missing; the resolved config must name its method")
    cost = cfg.get("cost")
    price = cost.get("usd_per_device_hour") if isinstance(cost, dict) else None
    if not isinstance(price, (int, float)) or isinstance(price, bool) or price < 0:
        problems.append(f"{where}: config.cost.usd_per_device_hour: missing or not a number >= 0 (got {price!r})")
    return manifest, problems


def _candidate_files(fs, path: str) -> list[str]:
    """The data files of a run: with Ray Data's checkpoint (`_checkpoint/`, as `winnow generate` writes) only the
    committed ones, so a run killed mid-write contributes no half-written file; without one (a folder assembled by
    hand) every `.parquet` under candidates/ whose name does not start with `.` or `_`."""
    if fs.isdir(posixpath.join(path, "_checkpoint")):
        return committed_data_files(fs, path)
    folder = posixpath.join(path, "candidates")
    if not fs.isdir(folder):
        return []
    files = []
    for f in sorted(fs.find(folder)):
        base = posixpath.basename(f)
        if base.endswith(".parquet") and not base.startswith((".", "_")):
            files.append(f)
    return files


def _missing_fields(schema: pa.Schema) -> list[str]:
    """Dotted names of the ROW_SCHEMA fields the tools read that `schema` lacks (extra fields are fine)."""

    # read as null where a file lacks them: the candidates' late fields, and any stats field (methods measure
    # different ones, and fields were added over time)
    late = {f"candidates[].{name}" for name in LATE_CANDIDATE_FIELDS} | {f"stats.{name}" for name in STATS_FIELDS}

    def walk(want: pa.DataType, have: pa.DataType, prefix: str) -> list[str]:
        if pa.types.is_list(want) and pa.types.is_list(have):
            return walk(want.value_type, have.value_type, prefix + "[]")
        if pa.types.is_struct(want) and pa.types.is_struct(have):
            names = [have.field(i).name for i in range(have.num_fields)]
            out = []
            for f in want:
                if f.name not in names:
                    if f"{prefix}.{f.name}" not in late:
                        out.append(f"{prefix}.{f.name}")
                else:
                    out += walk(f.type, have.field(f.name).type, f"{prefix}.{f.name}")
            return out
        return []

    out = []
    for name in READ_COLUMNS:
        if name not in schema.names:
            out.append(name)
        else:
            out += walk(ROW_SCHEMA.field(name).type, schema.field(name).type, name)
    return out


def _read_rows(fs, files: list[str], uri: str) -> list[dict]:
    try:
        target = pa.schema([ROW_SCHEMA.field(c) for c in READ_COLUMNS])
        missing = sorted({m for f in files for m in _missing_fields(pq.read_schema(f, filesystem=fs))})
        if missing:
            raise InputError(f"{uri}/candidates: fields {missing} missing; expected schemas.rows.ROW_SCHEMA")
        # read with the whole schema: a field added after a file was written (LATE_CANDIDATE_FIELDS) reads as null,
        # and files of before and after it (a run resumed by a newer Winnow) read as one
        table = pads.dataset(files, filesystem=fs, format="parquet", schema=target).to_table(columns=READ_COLUMNS)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError) as err:
        raise InputError(f"{uri}/candidates: not readable as rows of schemas.rows.ROW_SCHEMA: {err}") from None
    return table.to_pylist()


def _cost_problems(rows: list[dict], uri: str) -> list[str]:
    """Rows that ran (no error) but whose cost or a field of it is null: the report would have to guess their cost,
    so they are refused, naming the first few."""
    bad = [r["prompt_id"] for r in rows
           if r["error"] is None and (r["cost"] is None or any(v is None for v in r["cost"].values()))]
    if not bad:
        return []
    return [f"{uri}/candidates: {len(bad)} row(s) without an error have a null cost (or cost field), e.g. "
            f"prompt_id {bad[:3]}; expected the cost struct of schemas.rows.ROW_SCHEMA"]


def _dedupe(rows: list[dict], uri: str) -> tuple[list[dict], int]:
    """One row per prompt_id. An errored row is superseded by a successful row of the same prompt (a retry);
    two successful rows of one prompt_id in one run break the one-row-per-prompt contract and are refused."""
    by_id: dict[str, dict] = {}
    superseded = 0
    for row in rows:
        pid = row["prompt_id"]
        if pid is None:
            raise InputError(f"{uri}/candidates: a row has a null prompt_id")
        seen = by_id.get(pid)
        if seen is None:
            by_id[pid] = row
        elif seen["error"] is None and row["error"] is None:
            raise InputError(f"{uri}/candidates: prompt_id {pid!r} has two successful rows; expected one per prompt")
        else:
            superseded += 1
            if seen["error"] is not None and row["error"] is None:
                by_id[pid] = row
    return list(by_id.values()), superseded


def load_run(uri: str) -> Run:
    """Read one run folder; raises InputError naming the path if it is missing, empty or malformed."""
    uri = normalise_uri(uri)
    fs, path = store(uri)
    problem = store_problem(fs, path)  # no credentials, an endpoint that does not answer, no bucket: said at once
    if problem:
        raise InputError(f"{uri}: {problem}")
    if not fs.isdir(path):
        raise InputError(f"{uri}: run folder not found")
    manifest_path = posixpath.join(path, "manifest.json")
    if not fs.isfile(manifest_path):
        raise InputError(f"{uri}/manifest.json: not found; is {uri} a run folder?")
    try:
        with fs.open(manifest_path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{uri}/manifest.json: not valid JSON: {err}") from None
    manifest, problems = _manifest_problems(uri, data)
    if problems:
        raise InputError(problems)
    files = _candidate_files(fs, path)
    if not files:
        raise InputError(f"{uri}/candidates: no .parquet files; the run has written no rows")
    rows = _read_rows(fs, files, uri)
    problems = _cost_problems(rows, uri)
    if problems:
        raise InputError(problems)
    rows, superseded = _dedupe(rows, uri)
    status = manifest.status
    if status == "running" and holder_of(fs, lease_path(path)) is None:  # killed or stopped: nobody holds its lease
        status = "interrupted"
    return Run(uri=uri, manifest=manifest, rows=rows, superseded_errors=superseded, status=status)


def load_runs(uris: list[str]) -> list[Run]:
    """Read every run folder, reporting every bad one at once (InputError), and refusing one given twice."""
    problems, runs, seen = [], [], {}
    for uri in uris:
        key = folder_key(uri)
        if key in seen:
            same = "" if normalise_uri(seen[key]) == normalise_uri(uri) else f" (as {normalise_uri(seen[key])})"
            problems.append(f"{normalise_uri(uri)}: run folder given twice{same}")
            continue
        seen[key] = uri
        try:
            runs.append(load_run(uri))
        except InputError as err:
            problems.extend(err.problems)
    if problems:
        raise InputError(problems)
    return runs


def unfinished_warning(run: Run) -> str | None:
    """A line for a run that has not finished (`Run.status` running, interrupted or failed), naming it, its status
    and what to do; None for a succeeded run. The commands that read runs still use its rows written so far."""
    if run.status == "succeeded":
        return None
    error = getattr(run.manifest, "error", None)  # an extra field of the manifest, set when a run failed
    why, fix = {
        "running": ("is still being written by a run", "wait for it to end and read it again"),
        "interrupted": ("was stopped before it finished (its manifest says running and no run holds it)",
                        "run its `winnow generate` command again to finish it"),
    }.get(run.status, (f"did not finish{f' ({error})' if error else ''}",
                       "run its `winnow generate` command again to finish it"))
    return (f"warning: {run.uri} is not finished (status {run.status}): it {why}; only the {len(run.rows)} row(s) "
            f"it has written are used; {fix}")


def unique_labels(runs: list[Run]) -> list[str]:
    """Run names for tables and plots; a name shared by several runs gets ``#2``, ``#3``... in argument order."""
    counts: dict[str, int] = {}
    labels = []
    for run in runs:
        n = counts.get(run.name, 0) + 1
        counts[run.name] = n
        labels.append(run.name if n == 1 else f"{run.name}#{n}")
    return labels


# ---------------------------------------------------------------------------------------------------------------
# Reward definitions: which runs' rewards are on one scale

REWARD_UNITS = {
    "model": "reward model score",
    "process": "process reward (0 to 1)",
    "logprob": "mean log-probability per token",
    "lexical": "fraction of concepts covered",
    "python": "python reward",
    "math": "verified (1) or not (0)",
    "code": "verified (1) or not (0)",
    "none": "no reward",
    "unrecorded": "reward",
}


def _location(spec: object) -> str:
    """A model location as one spelling: a local path normalised (``./a/``, ``a`` are one), a URL or
    ``builtin:NAME`` without a trailing slash."""
    text = str(spec)
    if "://" in text or text.startswith("builtin:"):
        return text.rstrip("/") or text
    return posixpath.normpath(text)


@dataclass(frozen=True)
class RewardDefinition:
    """What a run's rewards measure: `models.reward.kind` and what identifies it (the reward model's path, the python
    function, the lexical concepts column; for `logprob`, the target, whose own log-probability the reward is).
    Two runs' rewards are on one scale only when their definitions are equal."""

    kind: str  # model | process | logprob | lexical | python | math | code | none (no reward) | unrecorded (unknown)
    identity: str  # the path, function, column or target; the reward's JSON for an unknown kind; "" otherwise

    @property
    def text(self) -> str:
        return {
            "model": f"reward model `{self.identity}`",
            "process": f"process reward model {self.identity}",
            "logprob": f"logprob under the target `{self.identity}`",
            "lexical": f"lexical coverage of the `{self.identity}` column",
            "python": f"python reward `{self.identity}`",
            "math": f"math verifier against the `{self.identity}` column",
            "code": f"code verifier with the `{self.identity}` column's tests",
            "none": "no reward",
            "unrecorded": (f"a reward this version does not know ({self.identity})" if self.identity
                           else "a reward the manifest does not record (no config.models)"),
        }[self.kind]

    @property
    def units(self) -> str:
        """What one unit of this reward is, for axis labels."""
        return REWARD_UNITS[self.kind]


def reward_definition(run: Run) -> RewardDefinition:
    """The run's reward definition, from its manifest's config (runs of every Winnow version have it)."""
    models = run.manifest.config.get("models")
    if not isinstance(models, dict):
        return RewardDefinition("unrecorded", "")
    reward = models.get("reward")
    if not isinstance(reward, dict):
        return RewardDefinition("none", "")
    kind = str(reward.get("kind"))
    if kind == "model":
        return RewardDefinition(kind, _location(reward.get("path")))
    if kind == "process":  # the steps' scores and how they aggregate are part of what it measures
        return RewardDefinition(kind, f"`{_location(reward.get('path'))}` ({reward.get('aggregate', 'min')} over "
                                f"its steps of label {reward.get('label', 1)} at {reward.get('step_tag')!r}, steps "
                                f"split on {reward.get('step_separator', chr(10) * 2)!r})")
    if kind == "logprob":
        return RewardDefinition(kind, _location(models.get("target")))
    if kind == "lexical":
        return RewardDefinition(kind, str(reward.get("concepts_column", "concepts")))
    if kind == "python":
        return RewardDefinition(kind, str(reward.get("function")))
    if kind == "math":
        return RewardDefinition(kind, str(reward.get("answer_column", "answer")))
    if kind == "code":
        return RewardDefinition(kind, str(reward.get("tests_column", "tests")))
    return RewardDefinition("unrecorded", json.dumps(reward, sort_keys=True))


def verifier_kind(run: Run) -> str | None:
    """The kind of the run's verifier (`math`, `code` or `python`), or None when it has none: the manifest's
    `models.verifier` (a verifier with `models.reward` as its ranker), or a reward that is a verifier alone
    (`models.reward.kind` math or code). `build-sft` and `report` read verdicts only from runs that have one."""
    models = run.manifest.config.get("models")
    if not isinstance(models, dict):
        return None
    verifier = models.get("verifier")
    if verifier is not None:
        return str(verifier.get("kind")) if isinstance(verifier, dict) else str(verifier)
    reward = models.get("reward")
    kind = reward.get("kind") if isinstance(reward, dict) else None
    return kind if kind in VERIFIER_REWARDS else None


def reward_groups(runs: list[Run]) -> list[tuple[RewardDefinition, list[int]]]:
    """The runs' indices grouped by reward definition, groups in the order of their first run."""
    groups: dict[RewardDefinition, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(reward_definition(run), []).append(i)
    return list(groups.items())


def describe_groups(runs: list[Run], groups: list[tuple[RewardDefinition, list[int]]]) -> list[str]:
    """One line per reward group: its definition and its runs (labels as in `unique_labels`, with their paths)."""
    labels = unique_labels(runs)
    return [f"{d.text}: " + ", ".join(f"{labels[i]} ({runs[i].uri})" for i in members) for d, members in groups]
