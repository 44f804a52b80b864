"""The prompt dataset of a job: where `data.source` points, reading it into a Ray Dataset, and normalising its rows.

Every row of the source becomes exactly one normalised row (`INPUT_SCHEMA`), in source order:

- ``prompt_id`` (string): the ``data.id_column`` value as a string, or, when that is null, `prompt_hash` of the
  normalised prompt. Unique in the normalised table: a later duplicate keeps its id with a ``#dup<k>`` suffix (see
  `assign_unique_ids`), so resume never confuses it with the first occurrence.
- ``prompt`` (list of {role, content}): a plain string becomes one user turn.
- ``concepts`` (list of strings): only when the reward is lexical, from ``models.reward.concepts_column``.
- ``input_error`` (string): why the row cannot run (null prompt, empty prompt, malformed messages, duplicate id,
  missing concepts), or null. Such rows are written as error rows, never dropped.
- ``source_row`` (int64): the row's position in the source (after ``data.limit``), for messages.

Problems with the source itself (absent, unreadable, a column that does not exist or has the wrong type) raise
`schemas.base.InputError` naming the field and the path, before anything is written.

Two ways to the same rows: `write_prompts` writes them as Parquet files with Ray Data, numbering rows and finding
duplicate ids in Ray tasks, so the driver's memory stays flat however many prompts there are (the job's way);
`load_prompts` gathers them into one table on the driver (small sets; the reference `write_prompts` is tested
against).

The package follows those steps, each module importing only the ones before it: `source` (where data.source
points), `check` (what the driver reads of it cheaply before Ray starts, and the columns), `normalise` (a source row
to a normalised row: pure functions), `read` (into a Ray Dataset of normalised rows, or one table), `write` (the
prompt set at scale). What the rest of Winnow uses is exported here.
"""

from pipeline.prompts.check import READ_ERRORS, check_source, column_problems, first_bad_file
from pipeline.prompts.normalise import INPUT_SCHEMA, assign_unique_ids, normalise_prompt, normalise_row, prompt_hash
from pipeline.prompts.read import load_prompts, raise_if_not_input, source_bytes
from pipeline.prompts.source import Source, resolve_source, source_location
from pipeline.prompts.write import apply_fixes, chunk_plan, find_duplicates, number_and_scatter, write_prompts

__all__ = ["INPUT_SCHEMA", "READ_ERRORS", "Source", "apply_fixes", "assign_unique_ids", "check_source", "chunk_plan",
           "column_problems", "find_duplicates", "first_bad_file", "load_prompts", "normalise_prompt", "normalise_row",
           "number_and_scatter", "prompt_hash", "raise_if_not_input", "resolve_source", "source_bytes",
           "source_location", "write_prompts"]
