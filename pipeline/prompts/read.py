"""Reading a source into a Ray Dataset of normalised rows (`normalised_dataset`), and into one table on the driver
for small sets (`load_prompts`)."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pyarrow as pa

from pipeline.prompts.check import (
    READ_ERRORS,
    check_file,
    check_source,
    column_problems,
    first_bad_file,
    shown_path,
    value_types,
)
from pipeline.prompts.normalise import INPUT_SCHEMA, assign_unique_ids, carried, normalise_batch, normalise_row
from pipeline.prompts.source import Source
from pipeline.raydata import data_context, short_error
from schemas.base import InputError
from schemas.config import DataConfig, JobConfig


# Ray Data warns when an operator capped at N tasks at once gets fewer than N blocks (a small source, read as one
# block): a hint to split the input, which is no use for these cheap operators. Only this module's are silenced.
warnings.filterwarnings(
    "ignore",
    message=r"The maximum number of concurrent tasks for '[^']*(normalise_batch|_apply_fix_refs|json_file_rows)",
    category=UserWarning,
)

def unreadable(source: Source, err: BaseException) -> InputError:
    """The InputError for a source whose reader failed: the file (and line) at fault when the driver can find it,
    else the reader's own error."""
    raise_if_not_input(err)
    located = first_bad_file(source)
    if located is not None:
        shown = located if located.startswith(source.spec) else f"{source.spec}: {located}"
        return InputError(f"data.source: {shown}")
    return InputError(f"data.source: {source.spec}: cannot be read: {short_error(err)}")


def python_reader_instead(source: Source, err: BaseException) -> Source:
    """After pyarrow's reader failed on a JSON `source` that the driver had not read (a remote one): the same source
    read line by line when every file is good JSON that pyarrow cannot type (a column mixing integers and strings),
    else the InputError naming the file and line (`unreadable`)."""
    raise_if_not_input(err)
    if source.kind != "json" or source.reader == "python":
        raise unreadable(source, err)
    why, columns = None, []
    for path in source.paths:
        found = check_file(source, path)
        if found.problem:
            raise InputError(f"data.source: {shown_path(source, path)}: {found.problem}")
        why = why or (found.python_reader and f"{shown_path(source, path)}: {found.python_reader}")
        columns += [c for c in (found.columns or (found.schema.names if found.schema else ())) if c not in columns]
    if why is None and not _is_mixed(err):
        raise unreadable(source, err)
    return replace(source, reader="python", why_python=why or short_error(err), columns=tuple(columns))


def _is_mixed(err: BaseException) -> bool:
    """Whether a read error is Ray's or Arrow's way of saying that files or blocks type a column apart."""
    text = str(err)
    return "Unable to merge" in text or "changed from" in text or "incompatible types" in text


def raise_if_not_input(err: BaseException) -> None:
    """Re-raise Ray's own failures (a dead worker or node, a lost object, a timeout) that happen to subclass one of
    READ_ERRORS (TimeoutError is an OSError): they say nothing about the source."""
    from ray.exceptions import RayError, RayTaskError

    if isinstance(err, RayError) and not isinstance(err, RayTaskError):
        raise err


def read_source(source: Source, id_column: str | None = None):
    """The source as a Ray Dataset (lazy; nothing is read until it executes). A CSV's `id_column` is read as strings
    (ids may mix numbers and names). A JSON source of the "python" reader gives one row per file (``bytes``), which
    `json_file_rows` turns into normalised rows."""
    import ray.data
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    if source.kind == "hf_disk":
        import datasets

        try:
            options = None if source.local else source.fs.storage_options
            hf = datasets.load_from_disk(source.paths[0], storage_options=options)
        except (*READ_ERRORS, KeyError) as err:  # a missing or malformed state.json, dataset_info.json or arrow file
            raise InputError(
                f"data.source: {source.spec}: not a readable datasets.save_to_disk folder: {err}"
            ) from None
        if not isinstance(hf, datasets.Dataset):
            raise InputError(f"data.source: {source.spec}: expected one split (a datasets.Dataset)")
        return ray.data.from_arrow(hf.data.table)
    fs_arg = {} if source.local else {"filesystem": PyFileSystem(FSSpecHandler(source.fs))}
    if source.kind == "json" and source.reader == "python":
        return ray.data.read_binary_files(source.paths, **fs_arg)
    if source.kind == "json":
        return ray.data.read_json(source.paths, **fs_arg)
    if source.kind == "csv":
        import pyarrow.csv as pacsv

        types = {id_column: pa.string()} if id_column else {}
        return ray.data.read_csv(source.paths, convert_options=pacsv.ConvertOptions(column_types=types), **fs_arg)
    return ray.data.read_parquet(source.paths, **fs_arg)


PYTHON_ROWS_PER_TABLE = 10_000


def json_file_rows(batch: pa.Table, data: DataConfig, concepts_column: str | None, columns: tuple[str, ...] = ()):
    """The "python" JSON reader (Ray Data batches of one file each, column ``bytes``): each file's rows, line by line
    (or the elements of a one-document array), as normalised rows (`INPUT_SCHEMA`), in order. Values are taken as
    JSON gives them: an id may be an integer on one line and a string on the next (it becomes a string either way),
    a prompt a string on one line and chat messages on the next; a value of the wrong kind makes that row an error
    row, as the Arrow path's per-row checks do."""
    for data_bytes in batch.column("bytes").to_pylist():
        text = data_bytes.decode("utf-8")
        if text.lstrip().startswith("["):
            rows = iter(json.loads(text))
        else:
            rows = (json.loads(line) for line in text.split("\n") if line.strip())  # not splitlines: U+2028 is text
        out = []
        for row in rows:
            out.append(_python_row(row, data, concepts_column, columns))
            if len(out) >= PYTHON_ROWS_PER_TABLE:
                yield pa.Table.from_pylist(out, schema=INPUT_SCHEMA)
                out = []
        if out:
            yield pa.Table.from_pylist(out, schema=INPUT_SCHEMA)


def _python_row(row: dict, data: DataConfig, concepts_column: str | None, columns: tuple[str, ...] = ()) -> dict:
    """`normalise_row` for a row parsed by json, whose values were not typed by a column: an id must be a string
    or an integer, concepts a list of strings, else the row becomes an error row saying so."""
    problem = None
    if data.id_column is not None:
        pid = row.get(data.id_column)
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
            problem = (f"id column {data.id_column!r} holds a {value_types({'v': pid})['v']}; expected a string or an "
                       "integer")
            row = {**row, data.id_column: None}
    if concepts_column is not None:
        concepts = row.get(concepts_column)
        if concepts is not None and not (isinstance(concepts, list) and all(isinstance(c, str) for c in concepts)):
            problem = problem or f"concepts column {concepts_column!r} is not a list of strings"
            row = {**row, concepts_column: None}
    out = normalise_row(row, data, concepts_column, columns)
    if problem is not None:
        out["input_error"] = problem
    out["source_row"] = -1
    return out


READ_CONTEXT = {"preserve_order": True, "use_datasource_v2": False}


def normalised_dataset(config: JobConfig, source: Source):
    """`source` read, checked against the config's columns, cut to `data.limit` and normalised: a lazy Ray Dataset of
    `INPUT_SCHEMA` rows (``source_row`` still -1), one per source row, in source order when it runs under
    ``data_context(**READ_CONTEXT)``. Raises InputError for a missing column or a source without rows, or for a
    file the reader cannot parse when that shows while reading the schema (else it shows when the dataset runs:
    `read_whole` sorts it out). A JSON source that pyarrow's reader refuses here is read line by line
    (`python_reader_instead`) when its lines are good JSON."""
    import ray.data

    if source.kind == "json" and source.reader == "python":
        if source.columns is not None:
            problems = column_problems(pa.schema([(c, pa.null()) for c in source.columns]), config, source.spec)
            if problems:
                raise InputError(problems)
        ds = read_first(read_source(source), source, config.data.limit).map_batches(
            json_file_rows, fn_kwargs={"data": config.data, **carried(config)},
            batch_size=1, batch_format="pyarrow", num_cpus=0, compute=ray.data.TaskPoolStrategy(size=cluster_cpus()),
        )
        return ds.limit(config.data.limit) if config.data.limit is not None else ds
    try:
        ds = read_first(read_source(source, config.data.id_column), source, config.data.limit)  # Parquet footers
        schema = ds.schema(fetch_if_missing=True)  # are read on the driver; JSON and CSV have run by now
    except Exception as err:  # noqa: BLE001 - the reader's own error (ArrowInvalid, ...) re-raised by Ray: bad input
        cause = read_error(err)
        if cause is None:
            raise
        return normalised_dataset(config, python_reader_instead(source, cause))
    if schema is None:
        raise InputError(f"data.source: {source.spec}: holds no rows")
    arrow_schema = schema.base_schema if hasattr(schema, "base_schema") else schema
    if not isinstance(arrow_schema, pa.Schema):
        arrow_schema = pa.schema(list(zip(schema.names, schema.types)))
    problems = column_problems(arrow_schema, config, source.spec)
    if problems:
        raise InputError(problems)
    if config.data.limit is not None:
        ds = ds.limit(config.data.limit)
    return ds.map_batches(
        normalise_batch,
        fn_kwargs={"data": config.data, **carried(config)},
        batch_format="pyarrow",
        num_cpus=0,  # cheap; must not wait behind actors holding every CPU of a small cluster
        # ... but a task asking for no CPU is not held back by the CPUs either: without a cap Ray Data ran 12-15 of
        # these at once on a 2-CPU machine, each in a worker process of its own
        compute=ray.data.TaskPoolStrategy(size=cluster_cpus()),
    )


READ_WHOLE_BYTES = 256 * 2**20  # a source this small is read whole even with data.limit: seconds of reading


def read_first(ds, source: Source, limit: int | None):
    """The read `ds` of `source`, materialized first (every read task run to its end) where Ray Data would otherwise
    stop it early: to learn a JSON or CSV source's schema (it reads one block) or at `data.limit`. An early stop
    force-cancels the read tasks still running, and a cancel that met a task finishing crashed the driver ("Tried
    to complete task that was not pending", Ray 2.60: a `winnow generate` killed by a C++ check before it wrote
    anything). Without a limit the whole source is read anyway; with one, only a source of at most
    `READ_WHOLE_BYTES` is (a larger one is read up to the limit and its cancelled reads are mid-file)."""
    if source.kind == "hf_disk":  # already in memory: no read tasks
        return ds
    if limit is None:  # nothing stops early but a schema read from one block (JSON and CSV; not the line reader)
        known = source.reader == "python" or ds.schema(fetch_if_missing=False) is not None
        return ds if known else ds.materialize()
    return ds.materialize() if source_bytes(source) <= READ_WHOLE_BYTES else ds


def source_bytes(source: Source) -> int:
    """The total size of the source's files."""
    return sum(int(source.fs.size(p) or 0) for p in source.paths)


def read_whole(config: JobConfig, source: Source, run):
    """`run(normalised_dataset(config, source))` (a materialize or a gather), and the source it read. A JSON source
    that pyarrow's reader refuses while running is read again line by line when its lines are good JSON
    (`python_reader_instead`); any other reader error is an InputError naming the file and line (`unreadable`)."""
    try:
        return run(normalised_dataset(config, source)), source
    except Exception as err:  # noqa: BLE001 - sorted below: the reader's errors are bad input, others propagate
        cause = read_error(err)
        if cause is None:
            raise
        if source.kind != "json" or source.reader == "python":
            raise unreadable(source, cause) from None
        source = python_reader_instead(source, cause)
    try:
        return run(normalised_dataset(config, source)), source
    except Exception as err:  # noqa: BLE001 - as above
        cause = read_error(err)
        if cause is None:
            raise
        raise unreadable(source, cause) from None


def read_error(err: BaseException) -> BaseException | None:
    """The reader's own error in what Ray raised (`READ_ERRORS`; Ray's wrapper, `RayTaskError`, cannot always take
    the class of the cause, e.g. UnicodeDecodeError, and then carries it as `cause`), or None for Ray's own failures
    and anything else."""
    from ray.exceptions import RayError, RayTaskError

    seen = err
    for _ in range(8):
        if isinstance(seen, RayError) and not isinstance(seen, RayTaskError):
            return None  # a dead worker, a lost object, a timeout: not the source's fault
        if isinstance(seen, READ_ERRORS):
            return seen
        nxt = getattr(seen, "cause", None) if isinstance(seen, RayTaskError) else None
        seen = nxt if nxt is not None else seen.__cause__
        if seen is None:
            return None
    return None


def cluster_cpus() -> int:
    """The CPUs of the Ray cluster (at least 1): how many of this module's CPU-less tasks run at once, at most."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def load_prompts(config: JobConfig) -> pa.Table:
    """Read `data.source` with Ray Data, keep the first `data.limit` rows, normalise them: an `INPUT_SCHEMA` table,
    gathered on the driver (so the prompt set must fit in its memory; `write_prompts` does the same without
    gathering it, and this function is its reference).

    Needs a connected Ray. Raises InputError for a source that is absent, unreadable, or lacks a named column.
    """
    source = check_source(config)
    with data_context(**READ_CONTEXT):
        parts, source = read_whole(config, source, lambda ds: [
            b for b in ds.iter_batches(batch_format="pyarrow", batch_size=None)])
    table = pa.concat_tables(parts).cast(INPUT_SCHEMA) if parts else INPUT_SCHEMA.empty_table()
    if table.num_rows == 0:
        raise InputError(f"data.source: {source.spec}: holds no rows")
    return assign_unique_ids(table)


