"""`winnow score`: given responses scored with a job's reward and judged by its verifier, without generating, so
that a user can check a reward before paying for a run (the reference solutions score 1, wrong ones 0).

1. `read_responses`: RESPONSES is a JSONL file; each line is a JSON object holding the job's data columns (its
   prompt column, the columns its reward and verifier read: `JobConfig.reward_columns`, the lexical reward's
   concepts) and a `response` string. A file that cannot be read, a line that is not an object, a line without a
   string `response`, or a named column that no line holds is bad input (InputError, naming the line or column).
   A prompt that cannot run, or a null reference column, is that line's own problem: its `reason`.
2. `score_file`: the models of the job on this machine (the hf engine, whatever `models.engine` says: scoring needs
   no generation engine), each response scored as a finished candidate of a run would be
   (`workers.actor.runner.Runner.score_responses`).
3. `write_scores`: one JSON line per response, in order (`score`, `verified`, `reason`, `answer`), written to a
   temporary file beside `out` and moved onto it, so that a failure leaves no half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.prompts.normalise import carried, normalise_row
from schemas.base import InputError
from schemas.config import JobConfig

RESPONSE = "response"


@dataclass
class Responses:
    """The lines of a RESPONSES file as input prompts for the Runner (`items`, with `columns`), the responses, and
    the problems of lines that cannot be scored (by index)."""

    items: list[dict]
    responses: list[str]
    problems: dict[int, str]


def read_responses(path: str | Path, config: JobConfig) -> Responses:
    """RESPONSES read and checked against the config's columns (module docstring, step 1)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: responses file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise InputError(f"{path}: cannot be read ({err.strerror or err})") from None
    lines = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 is text
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:
            raise InputError(f"{path}: line {number} is not valid JSON ({err})") from None
        if not isinstance(value, dict):
            raise InputError(f"{path}: line {number} is a JSON {type(value).__name__}; expected an object with the "
                             f"data columns and a {RESPONSE!r}")
        if not isinstance(value.get(RESPONSE), str):
            raise InputError(f"{path}: line {number} has no {RESPONSE!r} string (the response to score)")
        lines.append(value)
    if not lines:
        raise InputError(f"{path}: holds no responses")
    columns = carried(config)
    named = [("data.prompt_column", config.data.prompt_column), *config.reward_column_fields()]
    if columns["concepts_column"] is not None:
        named.append(("models.reward.concepts_column", columns["concepts_column"]))
    seen = set().union(*(line.keys() for line in lines))
    missing = [f"{field}: column {column!r} is in no line of {path} (columns: {', '.join(sorted(seen))})"
               for field, column in named if column not in seen]
    if missing:
        raise InputError(missing)
    items, problems = [], {}
    for i, line in enumerate(lines):
        row = normalise_row(line, config.data, **columns)
        if row["input_error"] is not None:
            problems[i] = row["input_error"]
        item = {"prompt_id": row["prompt_id"], "prompt": row["prompt"], "concepts": row["concepts"],
                "columns": None if row["columns"] is None else json.loads(row["columns"])}
        items.append(item)
    return Responses(items, [line[RESPONSE] for line in lines], problems)


def score_file(config: JobConfig, responses: Responses) -> list[dict]:
    """Every response's {score, verified, reason, answer}, in order (module docstring, step 2)."""
    from pipeline.preflight import resolved
    from workers.actor.runner import Runner

    config = resolved(config, on_node=True)  # this machine holds the models: builtin: names built here if need be
    models = config.models
    reward = models.reward
    if getattr(reward, "engine", "hf") != "hf":
        reward = reward.model_copy(update={"engine": "hf", "kv_cache_mb": None})
    config = config.model_copy(update={"models": models.model_copy(update={"engine": "hf", "reward": reward})})
    todo = [i for i in range(len(responses.items)) if i not in responses.problems]
    out = [{"score": None, "verified": None, "reason": responses.problems.get(i), "answer": None}
           for i in range(len(responses.items))]
    if todo:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the models' loading bars: this command's output is its summary
        runner = Runner(config)
        try:
            scored = runner.score_responses([responses.items[i] for i in todo], [responses.responses[i] for i in todo])
        finally:
            if runner.verifier is not None:
                runner.verifier.close()
        for i, result in zip(todo, scored):
            out[i] = result
    return out


def write_scores(out: str | Path, results: list[dict]) -> None:
    """One JSON line per response, moved onto `out` once whole (module docstring, step 3)."""
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_out(responses: str | Path) -> Path:
    """Where the scores go without --out: beside RESPONSES, `NAME.scores.jsonl`."""
    p = Path(responses)
    return p.with_name(f"{p.name.removesuffix('.jsonl')}.scores.jsonl")


def summary(results: list[dict], config: JobConfig) -> list[str]:
    """Lines for the terminal: how many were scored, the mean score, how many verified, and the reasons."""
    scored = [r["score"] for r in results if r["score"] is not None]
    lines = [f"{len(results)} response(s): {len(scored)} scored"
             + (f", mean score {sum(scored) / len(scored):.4f}" if scored else "")]
    if config.verifier is not None:
        judged = [r for r in results if r["verified"] is not None]
        passed = sum(r["verified"] for r in judged)
        lines.append(f"verified: {passed} of {len(judged)} judged ({config.verifier.kind} verifier)")
    reasons = Counter(r["reason"] for r in results if r["reason"] is not None)
    if reasons:
        lines.append("reasons: " + "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common(8)))
    return lines
