"""The plan's sample: a seeded random draw of the job's prompts, as the job itself would read them, written once as a
prompt file that every sweep run reads.

The whole prompt set is read, normalised and numbered as `winnow generate` does (`pipeline.prompts.write_prompts`:
`data.source`, `data.limit`, the prompt, id and concepts columns, duplicate ids), into a staging folder beside the
plan's folder, by Ray tasks (the driver never holds it). From it the driver counts the prompts (the rows that can
run: no ``input_error``; the others are error rows that cost nothing), reads each prompt's length in characters,
and draws the sample: ``numpy.random.default_rng(seed).choice`` of K of the runnable rows without replacement, seed
the config's, K sized to the sweep's share of the job (`planning.budget`). The sample is written as
``sample/prompts.jsonl`` (``prompt_id``, the chat messages and, for the lexical reward, the concepts; the columns
the reward and the verifier read, under their own names), then ``sample/sample.json`` (what it was drawn from,
the counts, the lengths, the sweep's size and cuts), last, as the mark that the sample is whole; the staging folder
is removed. A plan that is run again reuses the sample when ``sample.json`` says it was drawn from the same inputs,
so a killed plan resumes with the same prompts.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import posixpath
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from reporting.stats import mean_interval
from schemas.base import InputError
from schemas.config import JobConfig

SAMPLE_DIR = "sample"
PROMPTS_FILE = "prompts.jsonl"
META_FILE = "sample.json"
FORMAT = "winnow-plan-sample/1"
STAGING = ".sample-staging-"  # suffix of the staging folder beside the plan's folder
SMALL_SAMPLE = 30  # fewer prompts than this: percentile bootstrap intervals cover less than they say


@dataclass(frozen=True)
class SampleSize:
    """`--sample`: a number of prompts, or a fraction of the prompt set; `at_most` for the default, which a smaller
    prompt set caps instead of refusing."""

    text: str
    count: int | None = None
    fraction: float | None = None
    at_most: bool = False

    def of(self, prompts: int) -> int:
        """The sample's size for a prompt set of `prompts`."""
        if self.count is not None:
            return min(self.count, prompts) if self.at_most else self.count
        return max(1, math.ceil(self.fraction * prompts))


DEFAULT_SAMPLE = 64


def default_size() -> SampleSize:
    """The sample when ``--sample`` is not given: 64 prompts, or the whole prompt set when it holds fewer."""
    return SampleSize(str(DEFAULT_SAMPLE), count=DEFAULT_SAMPLE, at_most=True)


def parse_size(text: str) -> SampleSize:
    """``64`` (prompts), ``0.05`` or ``5%`` (a fraction of the prompt set); ValueError saying what is expected."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100.0
        elif raw.isdigit():
            count = int(raw)
            if count < 1:
                raise ValueError
            return SampleSize(raw, count=count)
        else:
            value = float(raw)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise ValueError(f"--sample {text!r}: expected a number of prompts (e.g. 64) or a fraction of the prompt set "
                         "in (0, 1] (e.g. 0.05 or 5%)")
    return SampleSize(raw, fraction=value)


def concepts_column(config: JobConfig) -> str | None:
    reward = config.models.reward
    return reward.concepts_column if reward is not None and reward.kind == "lexical" else None


def columns(config: JobConfig) -> dict:
    """The sample file's columns: the prompt (chat messages), the id and, for the lexical reward, the concepts; the
    concepts and the columns the reward and the verifier read (`JobConfig.reward_columns`) keep the config's own
    names (the reward's definition names them), and the prompt and id columns are named apart from them."""
    concepts = concepts_column(config)
    taken = {concepts, *config.reward_columns}
    prompt = next(c for c in ("prompt", "prompt_messages", "prompt_messages_") if c not in taken)
    ident = next(c for c in ("prompt_id", "prompt_key", "prompt_key_") if c not in taken)
    return {"prompt": prompt, "id": ident, "concepts": concepts, "reward": list(config.reward_columns)}


def inputs(config: JobConfig, size: SampleSize, location: str, share: float) -> dict:
    """What a sample is drawn from: a sample on disk is reused only when these are unchanged (`location`: the
    source as one spelling, `runfolder.paths.location_key`; `share`: the sweep's share of the job, which sized it)."""
    return {"data": config.data.model_dump(mode="json"), "location": location,
            "concepts_column": concepts_column(config), "reward_columns": list(config.reward_columns),
            "seed": config.seed, "sample": size.text, "sweep_share": share}


def choose(rows: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k of `rows` (source row numbers), drawn without replacement by ``default_rng(seed)``, sorted."""
    picked = np.random.default_rng(seed).choice(len(rows), size=k, replace=False)
    return np.sort(np.asarray(rows)[picked])


def prompt_chars(prompts: pa.Array) -> np.ndarray:
    """Characters of each prompt (its messages' contents summed), from a list<struct<role, content>> array."""
    if isinstance(prompts, pa.ChunkedArray):
        prompts = prompts.combine_chunks()
    flat = pc.list_flatten(prompts)
    lengths = pc.fill_null(pc.utf8_length(pc.struct_field(flat, "content")), 0).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(prompts).to_numpy(zero_copy_only=False)
    return np.bincount(parents, weights=lengths, minlength=len(prompts)).astype(np.int64)


def length_summary(chars: np.ndarray) -> dict:
    """count, mean, min, median, 95th percentile and max of prompt lengths in characters."""
    a = np.asarray(chars, dtype=float)
    return {"prompts": int(a.size), "mean": float(a.mean()), "min": int(a.min()), "median": float(np.median(a)),
            "p95": float(np.percentile(a, 95)), "max": int(a.max())}


def lengths_against(dataset: np.ndarray, sample: np.ndarray) -> dict:
    """How the dataset's prompt lengths stand to the sample's: the sample's mean with its bootstrap interval, and
    the dataset's prompts longer than the longest sampled one or shorter than the shortest."""
    return {"dataset": length_summary(dataset), "sample": length_summary(sample),
            "sample_mean_interval": mean_interval([float(x) for x in sample]),
            "longer_than_sample": int((dataset > sample.max()).sum()),
            "shorter_than_sample": int((dataset < sample.min()).sum())}


def sha256(fs, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(fs, path: str, data: bytes) -> None:
    """Write `path` whole or not at all: a file beside it, then a move."""
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def read_meta(fs, out: str) -> dict | None:
    """The plan's ``sample/sample.json``, or None when the sample has not been drawn whole; ValueError when the file
    is not one."""
    path = posixpath.join(out, SAMPLE_DIR, META_FILE)
    if not fs.isfile(path):
        return None
    with fs.open(path, "rb") as f:
        data = json.loads(f.read().decode("utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a plan's sample record ({FORMAT})")
    return data


def too_large(size: SampleSize, k: int, prompts: int, rows: int) -> str:
    """The refusal of a sample larger than the prompt set."""
    cannot = f", {rows - prompts} of its {rows} rows cannot run" if rows != prompts else ""
    return (f"--sample {size.text}: {k} prompts asked for, but the job's prompt set (data.source, data.limit) holds "
            f"{prompts} that can run{cannot}; give --sample {prompts} or fewer")


def draw(config: JobConfig, size: SampleSize, fs, out: str, staging: str, staging_url: str, arrow_fs, source,
         location: str, source_bytes: int | None, share: float, fit) -> dict:
    """Read the whole prompt set into `staging` (Ray tasks), count it, size the sample and draw it, and write it under
    `out` (module docstring); returns the sample record (``sample.json``). `fit(prompts, asked)` gives the sample's
    size and the sweep's record (`planning.budget`), or raises InputError when the job is too small to plan.
    InputError, with nothing written under `out`, for a bad source, a sample larger than the prompt set or a job too
    small to plan. `staging` is left for the caller to remove."""
    from pipeline.prompts import write_prompts

    rows = write_prompts(config, staging_url, arrow_fs, source=source)
    ds = pads.dataset(staging, format="parquet", filesystem=fs)
    runnable = pc.field("input_error").is_null()
    ok = ds.to_table(columns=["source_row"], filter=runnable).column("source_row").to_numpy()
    asked = size.of(len(ok))
    if asked > len(ok):
        raise InputError(too_large(size, asked, len(ok), rows))
    k, sweep = fit(len(ok), asked)
    chosen = choose(ok, k, config.seed)
    lengths, numbers = [], []
    for batch in ds.to_batches(columns=["source_row", "prompt"], filter=runnable):
        lengths.append(prompt_chars(batch.column("prompt")))
        numbers.append(batch.column("source_row").to_numpy())
    lengths, numbers = np.concatenate(lengths), np.concatenate(numbers)
    in_sample = np.isin(numbers, chosen)
    cols = columns(config)
    wanted = (["source_row", "prompt_id", "prompt"] + (["concepts"] if cols["concepts"] else [])
              + (["columns"] if cols["reward"] else []))
    table = ds.to_table(columns=wanted, filter=runnable & pc.field("source_row").isin(pa.array(chosen)))
    table = table.sort_by("source_row")
    lines = []
    for r in table.to_pylist():
        item = {cols["id"]: r["prompt_id"], cols["prompt"]: r["prompt"]}
        if cols["concepts"]:
            item[cols["concepts"]] = r["concepts"]
        if cols["reward"]:
            item.update({c: v for c, v in json.loads(r["columns"]).items() if c in cols["reward"]})
        lines.append(json.dumps(item, ensure_ascii=False) + "\n")
    path = posixpath.join(out, SAMPLE_DIR, PROMPTS_FILE)
    write_atomic(fs, path, "".join(lines).encode("utf-8"))
    meta = {
        "format": FORMAT,
        "inputs": inputs(config, size, location, share),
        "source_bytes": source_bytes,
        "drawn_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "file": path,
        "columns": cols,
        "sha256": sha256(fs, path),
        "dataset": {"rows": rows, "prompts": int(len(ok)), "input_errors": int(rows - len(ok))},
        "sample": {"prompts": k, "fraction": k / len(ok), "seed": config.seed},
        "prompt_chars": lengths_against(lengths, lengths[in_sample]),
        "sweep": sweep,
    }
    write_atomic(fs, posixpath.join(out, SAMPLE_DIR, META_FILE), json.dumps(meta, indent=2).encode("utf-8"))
    return meta
