"""Writing an SFT dataset folder: Parquet shard, `datasets.save_to_disk` folder and a Hugging Face dataset card.

Layout of ``OUT``::

    OUT/README.md                         dataset card (YAML front matter + selection, sources, counts, rewards)
    OUT/data/train-00000-of-00001.parquet  the examples (SFT_SCHEMA); `load_dataset("parquet", data_files=...)`
    OUT/hf/                               `Dataset.save_to_disk`; `datasets.load_from_disk(OUT/hf)`
"""

from __future__ import annotations

import io
import posixpath
import shlex
import statistics

import datasets
import numpy as np
import pyarrow.parquet as pq

from runfolder.outputs import staged_out, write_bytes
from runfolder.runs import Run, unique_labels
from sftdata.select import DROP_REASONS, Selection, SftResult

PARQUET_PATH = "data/train-00000-of-00001.parquet"
HF_DIR = "hf"


def reward_summary(rewards: list[float]) -> dict:
    """min / mean / median / max / count of the kept rewards (None where there are none)."""
    if not rewards:
        return {"count": 0, "min": None, "mean": None, "median": None, "max": None}
    return {
        "count": len(rewards),
        "min": min(rewards),
        "mean": statistics.fmean(rewards),
        "median": statistics.median(rewards),
        "max": max(rewards),
    }


def text_histogram(rewards: list[float], bins: int = 10, width: int = 40) -> list[str]:
    """A histogram of rewards as text lines: ``[lo, hi)  count  ####``."""
    if not rewards:
        return []
    counts, edges = np.histogram(np.asarray(rewards, dtype=float), bins=bins)
    top = max(int(counts.max()), 1)
    lines = []
    for i, c in enumerate(counts):
        bar = "#" * round(width * int(c) / top)
        close = "]" if i == len(counts) - 1 else ")"
        lines.append(f"[{edges[i]:.4g}, {edges[i + 1]:.4g}{close}".ljust(24) + f"{int(c):>6}  {bar}")
    return lines


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def dataset_card(result: SftResult, runs: list[Run], sel: Selection, argv: list[str] | None = None) -> str:
    """The dataset card (README.md): YAML front matter for the Hub, then how the data was selected and from what."""
    rewards = result.table.column("reward").to_pylist()
    summary = reward_summary(rewards)
    n = result.table.num_rows
    size = "n<1K" if n < 1000 else "1K<n<10K" if n < 10_000 else "10K<n<100K" if n < 100_000 else "n>100K"
    lines = [
        "---",
        "pretty_name: Winnow Expert-Iteration SFT data",
        "task_categories:",
        "- text-generation",
        "tags:",
        "- winnow",
        "- sft",
        "- expert-iteration",
        "- best-of-n",
        f"size_categories:\n- {size}",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        "    path: data/train-*.parquet",
        "---",
        "",
        "# Winnow Expert-Iteration SFT data",
        "",
        "Prompt-completion pairs in TRL's conversational form, built by `winnow build-sft` from generation runs.",
        "`prompt` is a list of `{role, content}` chat messages; `completion` is a list with one assistant message.",
        "Each row also has `prompt_id`, `reward` (the completion's final reward in its source run), `source_run`,",
        "`source_method`, `source_config_hash`, `finish_reason` and `verified` (null where the source run has no",
        "verifier).",
        "",
        "Load it with `datasets.load_from_disk(\"<this folder>/hf\")` or",
        "`datasets.load_dataset(\"parquet\", data_files=\"<this folder>/data/*.parquet\")`.",
        "",
        "## Selection",
        "",
        f"- rule: `--select {sel.flag}`"
        + (f" `--min-reward {sel.min_reward:g}`" if sel.min_reward is not None else "")
        + (" `--include-rejected`" if sel.include_rejected else "")
        + (" `--include-truncated`" if sel.include_truncated else "")
        + (" `--include-unverified`" if sel.include_unverified else ""),
        f"- meaning: {sel.describe(verifier=bool(result.verifier_runs))}.",
        f"- reward: {result.reward.text} ({result.reward.units}), the same for every source run (runs scored by "
        "different rewards are refused)",
    ]
    if argv is not None:
        lines.append(f"- command: `{shlex.join(['winnow', 'build-sft', *argv])}`")  # pastes into a shell as is
    lines += ["", "## Source runs", "", "| source_run | method | config hash | status | rows | errors | path |",
              "|---|---|---|---|---|---|---|"]
    for label, run in zip(unique_labels(runs), runs):
        errors = sum(r["error"] is not None for r in run.rows)
        lines.append(f"| {label} | {run.method} | `{run.manifest.config_hash}` | {run.status} | "
                     f"{len(run.rows)} | {errors} | `{run.uri}` |")
    lines += [
        "",
        "## Counts",
        "",
        f"- prompts seen: {result.prompts_seen} (errored in every run: {result.prompts_errored_everywhere})",
        f"- prompts kept: {result.prompts_kept}",
        *([f"- source runs with a verifier: {', '.join(result.verifier_runs)}",
           f"- prompts left out as unverified (no candidate verified): {result.prompts_unverified}",
           f"- examples that did not verify (`--include-unverified`): "
           f"{sum(v is not True for v in result.table.column('verified').to_pylist())}"]
          if result.verifier_runs else []),
        f"- examples (rows): {n}",
        f"- candidates seen: {result.candidates_seen}",
        "",
        "| candidates dropped because | count |",
        "|---|---|",
    ]
    for reason, meaning in DROP_REASONS.items():
        lines.append(f"| {meaning} (`{reason}`) | {result.dropped.get(reason, 0)} |")
    lines += [
        "",
        "## Rewards of the kept examples",
        "",
        "| count | min | mean | median | max |",
        "|---|---|---|---|---|",
        f"| {summary['count']} | {_fmt(summary['min'])} | {_fmt(summary['mean'])} | {_fmt(summary['median'])} "
        f"| {_fmt(summary['max'])} |",
        "",
        "```",
        *text_histogram(rewards),
        "```",
        "",
    ]
    return "\n".join(lines)


def write_sft(result: SftResult, runs: list[Run], sel: Selection, out: str, argv: list[str] | None = None) -> None:
    """Write OUT (see module docstring) through a temporary folder that replaces OUT only when complete."""
    card = dataset_card(result, runs, sel, argv)
    with staged_out(out, "winnow build-sft") as (fs, tmp):
        buf = io.BytesIO()
        pq.write_table(result.table, buf)
        write_bytes(fs, posixpath.join(tmp, PARQUET_PATH), buf.getvalue())
        write_bytes(fs, posixpath.join(tmp, "README.md"), card.encode("utf-8"))
        hf_url = fs.unstrip_protocol(posixpath.join(tmp, HF_DIR))
        dataset = datasets.Dataset(result.table)
        dataset.save_to_disk(hf_url, storage_options=fs.storage_options)
