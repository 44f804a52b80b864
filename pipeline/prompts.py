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
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import fsspec
import pyarrow as pa

import assets
from pipeline.raydata import data_context, short_error
from schemas.base import InputError
from schemas.config import DataConfig, JobConfig
from schemas.rows import MESSAGE, prompt_problem, shown_value, well_formed
from stores.filesystems import bucket_message, filesystem, missing_bucket

# Ray Data warns when an operator capped at N tasks at once gets fewer than N blocks (a small source, read as one
# block): a hint to split the input, which is no use for these cheap operators. Only this module's are silenced.
warnings.filterwarnings(
    "ignore",
    message=r"The maximum number of concurrent tasks for '[^']*(normalise_batch|_apply_fix_refs|json_file_rows)",
    category=UserWarning,
)

# file extension -> Ray Data reader
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

INPUT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("concepts", pa.list_(pa.string())),
        ("input_error", pa.string()),
        ("source_row", pa.int64()),
    ]
)


@dataclass(frozen=True)
class Source:
    """A resolved `data.source`: its reader and the files (or folder) it reads."""

    spec: str  # as written in the config
    kind: str  # json | parquet | csv | hf_disk
    paths: list[str]  # files for json/parquet/csv (with their protocol), the folder for hf_disk
    fs: fsspec.AbstractFileSystem
    # JSON only: "arrow" (pyarrow's reader, which types each column from its first values) or "python" (line by
    # line, for files every line of which is a JSON object but whose columns mix types, e.g. integer and string
    # ids, which pyarrow refuses; and for one-document .json arrays). `check_source` decides.
    reader: str = "arrow"
    why_python: str | None = None
    columns: tuple[str, ...] | None = None  # "python" reader: the columns its files' rows hold (None: not read)

    @property
    def local(self) -> bool:
        return "file" in _protocols(self.fs)


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def source_location(spec: str) -> str:
    """`data.source` as a path or URL: builtin:NAME -> the bundled folder; anything else as given."""
    return _location(spec)


def _location(spec: str) -> str:
    """builtin:NAME -> the bundled folder; anything else as given (a local path or a URL)."""
    try:
        return assets.resolve(spec)
    except KeyError as err:
        raise InputError(f"data.source: {err.args[0]}") from None


def _with_protocol(fs, path: str) -> str:
    return path if "file" in _protocols(fs) else fs.unstrip_protocol(path)


def resolve_source(spec: str) -> Source:
    """Find what `data.source` names and how to read it; InputError naming the path when it cannot be read."""
    where = _location(spec)
    try:
        fs, root = filesystem(where)
        if fs.isfile(root):
            ext = Path(root).suffix.lower()
            if ext not in FORMATS:
                raise InputError(
                    f"data.source: {spec}: unsupported file type {ext or '(none)'!r}; expected one of "
                    f"{', '.join(FORMATS)}"
                )
            return Source(spec, FORMATS[ext], [_with_protocol(fs, root)], fs)
        if not fs.isdir(root):
            bucket = missing_bucket(fs, root)
            raise InputError(f"data.source: {spec}: {bucket_message(bucket) if bucket else 'no such file or folder'}")
        names = {posixpath.basename(p) for p in fs.ls(root, detail=False)}
        if "dataset_dict.json" in names:
            raise InputError(
                f"data.source: {spec}: a datasets DatasetDict with several splits; point data.source at one "
                f"split's folder (e.g. {spec.rstrip('/')}/train)"
            )
        if {"state.json", "dataset_info.json"} <= names:
            return Source(spec, "hf_disk", [_with_protocol(fs, root)], fs)
        files = sorted(
            p for p in fs.find(root)
            if not any(part.startswith((".", "_")) for part in posixpath.relpath(p, root).split("/"))
            and Path(p).suffix.lower() in FORMATS
        )
    except InputError:
        raise
    except (OSError, ValueError, ImportError) as err:
        raise InputError(f"data.source: {spec}: cannot be read: {err}") from None
    if not files:
        raise InputError(
            f"data.source: {spec}: the folder holds no {', '.join(FORMATS)} files and is not a "
            "datasets.save_to_disk folder"
        )
    kinds = sorted({FORMATS[Path(p).suffix.lower()] for p in files})
    if len(kinds) > 1:
        raise InputError(f"data.source: {spec}: the folder mixes file types ({', '.join(kinds)}); keep one type")
    return Source(spec, kinds[0], [_with_protocol(fs, p) for p in files], fs)


# What a reader raises on a file that is not what it claims to be (truncated Parquet, malformed JSON lines, bad
# encoding, a missing file). Ray re-raises a task's exception as an instance of its class too, so these catch the
# readers' errors from remote tasks; anything else (a bug, a dead worker) is not bad input and propagates.
READ_ERRORS = (OSError, ValueError, EOFError, pa.ArrowException)

CHUNK = 1 << 20  # bytes read at a time by the driver's checks


@dataclass
class FileCheck:
    """What the driver found reading one source file: the first fault (`problem`, e.g. "line 3 is not valid JSON
    (...)"), else its Arrow schema, and for JSON whether pyarrow's reader can type it (`python_reader`: every line is
    a JSON object, but a column mixes types, e.g. integer and string ids) with the columns seen."""

    problem: str | None = None
    schema: pa.Schema | None = None
    python_reader: str | None = None  # why the file needs the line-by-line reader, or None
    columns: tuple[str, ...] = ()


def check_file(source: Source, path: str, whole: bool = False) -> FileCheck:
    """Read one file of `source` on the driver, memory-flat: for JSON the encoding and every line (pyarrow's reader
    first; on its error, line by line for the line at fault), for Parquet the footer (and with `whole`, after a
    read failed, every row group). CSV and datasets folders are not read here. An OSError of the store itself
    propagates."""
    import pyarrow.parquet as pq

    if source.kind == "parquet":
        try:
            with source.fs.open(path, "rb") as f:
                parquet = pq.ParquetFile(f)
                for i in range(parquet.num_row_groups if whole else 0):
                    parquet.read_row_group(i)
                return FileCheck(schema=parquet.schema_arrow)
        except (pa.ArrowException, ValueError, EOFError) as err:
            return FileCheck(f"not a readable parquet file ({type(err).__name__}: {str(err).splitlines()[0]})")
    if source.kind == "json":
        return _check_json(source.fs, path)
    return FileCheck()


def _check_json(fs, path: str) -> FileCheck:
    problem = _utf8_problem(fs, path)
    if problem:
        return FileCheck(problem)
    with fs.open(path, "rb") as f:
        head = f.read(CHUNK).lstrip()
    if head.startswith(b"["):  # one JSON document (an array of rows), read whole as Ray's reader does
        return _check_json_document(fs, path)
    import pyarrow.json as pajson

    # pyarrow's streaming reader parses about 32 blocks ahead: 2 MB of 64 KiB blocks, whatever the file's size (a
    # line longer than a block is retried with larger ones)
    block = 1 << 16
    while True:
        try:
            with fs.open(path, "rb") as f:
                reader = pajson.open_json(f, read_options=pajson.ReadOptions(block_size=block, use_threads=False))
                for _ in reader:
                    pass
                return FileCheck(schema=reader.schema)
        except pa.ArrowInvalid as err:
            text = str(err)
            if "straddl" in text and block < (1 << 30):  # a line longer than the block
                block *= 4
                continue
            if "Empty JSON" in text:
                return FileCheck(schema=pa.schema([]))
            return _scan_json_lines(fs, path, text)


def _utf8_problem(fs, path: str) -> str | None:
    """The first line that is not UTF-8 text, read in chunks (pyarrow's JSON reader lets bad bytes through)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = offset = 0
    with fs.open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                line = lines + err.object[: err.start].count(b"\n") + 1
                at = offset + err.start - (len(err.object) - len(chunk))
                return f"line {line} is not UTF-8 text ({err.reason} at byte {at})"
            if not chunk:
                return None
            lines += chunk.count(b"\n")
            offset += len(chunk)


def _row_problem(row, number: int | None = None) -> str | None:
    """Why a parsed JSON row cannot be a row: not an object, or a string holding a lone surrogate (an escape such as
    \\ud800 that is half of a UTF-16 pair: valid JSON syntax, but no Unicode character)."""
    where = f"line {number}" if number is not None else "an element"
    if not isinstance(row, dict):
        return f"{where} is a JSON {type(row).__name__}; expected an object (one row per line)"
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        bad = ord(err.object[err.start])
        return (f"{where} holds a lone surrogate \\u{bad:04x} in a string: half of a UTF-16 pair, "
                "which is no character; fix the text that wrote it (e.g. a string cut between the two halves)")
    return None


def _types(row: dict) -> dict[str, str]:
    return {k: ("null" if v is None else "boolean" if isinstance(v, bool) else "number"
                if isinstance(v, (int, float)) else "string" if isinstance(v, str) else
                "list" if isinstance(v, list) else "object") for k, v in row.items()}


def _scan_json_lines(fs, path: str, arrow_error: str) -> FileCheck:
    """Line by line, after pyarrow's reader refused the file: the first line that is not a JSON object (or holds a
    lone surrogate); when every line is one, the file is read line by line instead, and the column whose values
    mix types (pyarrow types a column from its first values) is named."""
    seen: dict[str, tuple[str, int]] = {}
    mixed = None
    columns: list[str] = []
    with fs.open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                return FileCheck(f"line {number} is not valid JSON ({getattr(err, 'msg', err)}, column "
                                 f"{getattr(err, 'colno', '?')})")
            problem = _row_problem(row, number)
            if problem:
                return FileCheck(problem)
            for key, kind in _types(row).items():
                if key not in seen:
                    columns.append(key)
                    seen[key] = (kind, number)
                elif mixed is None and "null" not in (kind, seen[key][0]) and kind != seen[key][0]:
                    mixed = (f"column {key!r} holds {seen[key][0]}s (line {seen[key][1]}) and {kind}s (line "
                             f"{number})")
                elif seen[key][0] == "null":
                    seen[key] = (kind, number)
    return FileCheck(python_reader=mixed or f"pyarrow's reader refused it ({arrow_error})", columns=tuple(columns))


def _check_json_document(fs, path: str) -> FileCheck:
    """A file that is one JSON document: an array of objects (read whole, as Ray's reader reads it)."""
    with fs.open(path, "rb") as f:
        text = f.read().decode("utf-8")
    try:
        rows = json.loads(text)
    except ValueError as err:
        return FileCheck(f"not valid JSON ({err})")
    if not isinstance(rows, list):
        return FileCheck(f"a JSON {type(rows).__name__}; expected an array of objects, or one object per line")
    columns: list[str] = []
    for i, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            return FileCheck(problem.replace("an element", f"element {i} of the array", 1))
        columns += [k for k in row if k not in columns]
    return FileCheck(python_reader="one JSON document (an array), read whole", columns=tuple(columns))


def first_bad_file(source: Source) -> str | None:
    """Which file of `source` cannot be read, and where (`check_file`, Parquet files whole): ``PATH: problem``, or
    None when every file reads (CSV and datasets folders are not checked here)."""
    for path in source.paths:
        problem = check_file(source, path, whole=True).problem
        if problem:
            return f"{path}: {problem}"
    return None


def check_source(config: JobConfig) -> Source:
    """Before Ray starts: `data.source` resolved (InputError when it is absent or of no known type), and for local
    files every file read on the driver (`check_file`: the first bad line or a cut Parquet footer, named) and the
    config's columns checked against the files' schemas; also decides how JSON is read (`Source.reader`). Remote
    sources are read by Ray, which finds such problems there (`unreadable`)."""
    source = resolve_source(config.data.source)
    if not source.local or source.kind not in ("json", "parquet"):
        return source
    problems, schemas, python_reader, columns = [], [], None, []
    for path in source.paths:
        try:
            found = check_file(source, path)
        except OSError as err:
            raise InputError(f"data.source: {_shown(source, path)}: cannot be read ({err})") from None
        if found.problem:
            problems.append(f"data.source: {_shown(source, path)}: {found.problem}")
        elif found.python_reader:
            python_reader = python_reader or f"{_shown(source, path)}: {found.python_reader}"
        columns += [c for c in (found.columns or (found.schema.names if found.schema else ())) if c not in columns]
        if found.schema is not None:
            schemas.append(found.schema)
    if problems:
        raise InputError(problems)
    if source.kind == "json" and python_reader is None and len(schemas) > 1:
        try:
            pa.unify_schemas(schemas)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:  # files typing a column apart (integers, strings)
            python_reader = f"the files type a column apart ({str(err).splitlines()[0]})"
    if python_reader is not None:
        source = replace(source, reader="python", why_python=python_reader, columns=tuple(columns))
        schema = pa.schema([(c, pa.null()) for c in columns])  # types vary by row: checked row by row
    else:
        schema = _unified(schemas) if schemas else None
    if schema is not None and (schema.names or source.kind == "parquet"):
        problems = column_problems(schema, config, source.spec)
        if problems:
            raise InputError(problems)
    return source


def _unified(schemas: list[pa.Schema]) -> pa.Schema:
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return schemas[0]


def _shown(source: Source, path: str) -> str:
    return path if path.startswith(source.spec) else f"{source.spec}: {path}"


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
            raise InputError(f"data.source: {_shown(source, path)}: {found.problem}")
        why = why or (found.python_reader and f"{_shown(source, path)}: {found.python_reader}")
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


def json_file_rows(batch: pa.Table, data: DataConfig, concepts_column: str | None):
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
            out.append(_python_row(row, data, concepts_column))
            if len(out) >= PYTHON_ROWS_PER_TABLE:
                yield pa.Table.from_pylist(out, schema=INPUT_SCHEMA)
                out = []
        if out:
            yield pa.Table.from_pylist(out, schema=INPUT_SCHEMA)


def _python_row(row: dict, data: DataConfig, concepts_column: str | None) -> dict:
    """`normalise_row` for a row parsed by json, whose values were not typed by a column: an id must be a string
    or an integer, concepts a list of strings, else the row becomes an error row saying so."""
    problem = None
    if data.id_column is not None:
        pid = row.get(data.id_column)
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
            problem = f"id column {data.id_column!r} holds a {_types({'v': pid})['v']}; expected a string or an integer"
            row = {**row, data.id_column: None}
    if concepts_column is not None:
        concepts = row.get(concepts_column)
        if concepts is not None and not (isinstance(concepts, list) and all(isinstance(c, str) for c in concepts)):
            problem = problem or f"concepts column {concepts_column!r} is not a list of strings"
            row = {**row, concepts_column: None}
    out = normalise_row(row, data, concepts_column)
    if problem is not None:
        out["input_error"] = problem
    out["source_row"] = -1
    return out


# ---------------------------------------------------------------------------------------------------------------
# Column checks (on the Arrow schema of the source, before anything runs)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _chat_type(t: pa.DataType) -> bool:
    if not _is_list(t) or not pa.types.is_struct(t.value_type):
        return False
    names = {f.name for f in t.value_type}
    return {"role", "content"} <= names


def column_problems(schema: pa.Schema, config: JobConfig, spec: str) -> list[str]:
    """Every problem with the columns the config names, each naming the field, the column and the source."""
    data: DataConfig = config.data
    names = list(schema.names)
    have = ", ".join(names) or "(none)"
    problems = []

    def check(field: str, column: str, ok, expected: str):
        if column not in names:
            problems.append(f"{field}: column {column!r} is not in {spec} (columns: {have})")
            return
        t = schema.field(column).type
        if not (pa.types.is_null(t) or ok(t)):
            problems.append(f"{field}: column {column!r} of {spec} is {t}; expected {expected}")

    check("data.prompt_column", data.prompt_column, lambda t: _is_string(t) or _chat_type(t),
          "a string or a list of {role, content} messages")
    if data.id_column is not None:
        check("data.id_column", data.id_column,
              lambda t: _is_string(t) or pa.types.is_integer(t), "strings or integers")
    reward = config.models.reward
    if reward is not None and reward.kind == "lexical":
        check("models.reward.concepts_column", reward.concepts_column,
              lambda t: _is_list(t) and (_is_string(t.value_type) or pa.types.is_null(t.value_type)),
              "a list of strings")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Row normalisation (pure functions: testable without Ray)


def prompt_hash(messages) -> str:
    """A stable id for a prompt: sha256 of its messages (or of the value that could not be read as messages) as
    canonical JSON, 16 hex digits."""
    blob = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def normalise_prompt(value) -> tuple[list[dict], str | None]:
    """A prompt value as chat messages (a plain string becomes one user turn), and why it cannot run (or None).
    Messages that fit the `prompt` column are kept even when they cannot run (an unknown role, blank content), so
    that the error row shows them; otherwise the error quotes the value that was wrong."""
    if value is None:
        return [], "prompt is null"
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    elif not isinstance(value, (list, tuple)):
        return [], (f"prompt is a {type(value).__name__} ({shown_value(value)}); expected a string or a list of "
                    "{role, content} messages")
    problem = prompt_problem(value)
    if not well_formed(value):
        return [], problem
    return [{"role": m["role"], "content": m["content"]} for m in value], problem


def normalise_row(row: dict, data: DataConfig, concepts_column: str | None) -> dict:
    """One source row as a normalised row (without `source_row`; `assign_unique_ids` adds it)."""
    value = row.get(data.prompt_column)
    messages, error = normalise_prompt(value)
    if data.id_column is None:  # a prompt that could not be read as messages is named by its value
        pid = prompt_hash(messages if messages or value is None else value)
    else:
        raw = row.get(data.id_column)
        pid = None if raw is None else str(raw)
        if pid is None or not pid.strip():
            error = error or f"id column {data.id_column!r} is empty"
            pid = "<no id>"
    out = {"prompt_id": pid, "prompt": messages, "concepts": None, "input_error": error}
    if concepts_column is not None:
        concepts = row.get(concepts_column)
        if concepts is None:
            out["input_error"] = error or f"concepts column {concepts_column!r} is null"
        elif not concepts:
            out["input_error"] = error or f"concepts column {concepts_column!r} is an empty list"
        else:
            out["concepts"] = [str(c) for c in concepts]
    return out


def normalise_batch(batch: pa.Table, data: DataConfig, concepts_column: str | None) -> pa.Table:
    """A Ray Data batch of source rows -> normalised rows (one per input row, same order)."""
    rows = [normalise_row(r, data, concepts_column) for r in batch.to_pylist()]
    for r in rows:
        r["source_row"] = -1  # set on the driver once the global order is known
    return pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)


def assign_unique_ids(table: pa.Table) -> pa.Table:
    """Number rows in source order and make every prompt_id unique.

    The first occurrence of an id keeps it. A later occurrence becomes an error row whose prompt_id is the id with
    ``#dup1``, ``#dup2``, ... appended (skipping any that the source itself uses), so the checkpoint and the output
    hold each prompt_id once, and a reader can still see which prompt it duplicated.
    """
    ids = table.column("prompt_id").to_pylist()
    errors = table.column("input_error").to_pylist()
    taken = set(ids)
    first: dict[str, int] = {}
    counts: dict[str, int] = {}
    new_ids = []
    for i, pid in enumerate(ids):
        if pid not in first:
            first[pid] = i
            new_ids.append(pid)
            continue
        k = counts.get(pid, 0)
        while True:
            k += 1
            candidate = f"{pid}#dup{k}"
            if candidate not in taken:
                break
        counts[pid] = k
        taken.add(candidate)
        new_ids.append(candidate)
        if errors[i] is None:
            errors[i] = f"duplicate prompt_id {pid!r}: first seen at row {first[pid]}; only that one runs"
    table = table.set_column(table.schema.get_field_index("prompt_id"), "prompt_id", pa.array(new_ids, pa.string()))
    table = table.set_column(table.schema.get_field_index("input_error"), "input_error", pa.array(errors, pa.string()))
    rows = pa.array(range(table.num_rows), pa.int64())
    return table.set_column(table.schema.get_field_index("source_row"), "source_row", rows)


# preserve_order: "the first N rows" and "the first occurrence" follow the source's order. The V1 Parquet reader, as
# in `pipeline.job.run`: the V2 one adds a file-listing task that asks for a whole CPU (and took 15 s to read three
# small files on a loaded 2-core machine, against 0.4 s for V1).
READ_CONTEXT = {"preserve_order": True, "use_datasource_v2": False}


def _concepts_column(config: JobConfig) -> str | None:
    reward = config.models.reward
    return reward.concepts_column if reward is not None and reward.kind == "lexical" else None


def normalised_dataset(config: JobConfig, source: Source):
    """`source` read, checked against the config's columns, cut to `data.limit` and normalised: a lazy Ray Dataset of
    `INPUT_SCHEMA` rows (``source_row`` still -1), one per source row, in source order when it runs under
    ``data_context(**READ_CONTEXT)``. Raises InputError for a missing column or a source without rows, or for a
    file the reader cannot parse when that shows while reading the schema (else it shows when the dataset runs:
    `_read_whole` sorts it out). A JSON source that pyarrow's reader refuses here is read line by line
    (`python_reader_instead`) when its lines are good JSON."""
    import ray.data

    if source.kind == "json" and source.reader == "python":
        if source.columns is not None:
            problems = column_problems(pa.schema([(c, pa.null()) for c in source.columns]), config, source.spec)
            if problems:
                raise InputError(problems)
        ds = read_first(read_source(source), source, config.data.limit).map_batches(
            json_file_rows, fn_kwargs={"data": config.data, "concepts_column": _concepts_column(config)},
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
        fn_kwargs={"data": config.data, "concepts_column": _concepts_column(config)},
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


def _read_whole(config: JobConfig, source: Source, run):
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
        parts, source = _read_whole(config, source, lambda ds: [
            b for b in ds.iter_batches(batch_format="pyarrow", batch_size=None)])
    table = pa.concat_tables(parts).cast(INPUT_SCHEMA) if parts else INPUT_SCHEMA.empty_table()
    if table.num_rows == 0:
        raise InputError(f"data.source: {source.spec}: holds no rows")
    return assign_unique_ids(table)


# ---------------------------------------------------------------------------------------------------------------
# The prompt set at scale: normalised, numbered, made unique and written by Ray tasks; the driver holds object
# references and per-block row counts, never rows.
#
#   read -> limit -> normalise_batch            (Ray Data, in source order; materialized: object store, spills)
#   -> blocks grouped into chunks of consecutive blocks; each chunk's first source_row is the sum of the row counts
#      before it (the counts come from one small task per block)
#   -> number_and_scatter, per chunk           (sets source_row; one record per row, hash-partitioned by id)
#   -> find_duplicates, per partition          (the fixes: new id of every later occurrence, and its first row)
#   -> apply_fixes, write_parquet               (Ray Data over the numbered chunks, in source order)
#
# Why `assign_unique_ids` can be computed per id: the k-th later occurrence of an id X gets ``X#dup<j>`` with j the
# k-th positive integer such that ``X#dup<j>`` is not an id of the source. Ids made for another id Y never collide
# with X's (``#dup`` followed by digits up to the end splits a string in one way only), and X's own grow with k. So
# a partition needs only X's occurrences (their source_rows) and the source ids of the form ``X#dup<j>`` (their j);
# both are sent to X's partition.

CHUNK_ROWS = 100_000  # rows per chunk (and so per written file), at least
ROWS_PER_PARTITION = 1_000_000  # duplicate-finding records per hash partition, at most (roughly 50 bytes each)
RECORDS_PER_PART = 10_000  # records per chunk and partition, at least: Ray keeps results under 100 KB in the
# memory of the process that asked for them (here the driver), so parts are kept well above that size

_DUP_ID = r"(?s)^(?P<base>.*)#dup(?P<k>[1-9][0-9]{0,17})$"  # an id of the form X#dup<j> (j < 10**18)

RECORDS = pa.schema([("key", pa.string()), ("k", pa.int64()), ("row", pa.int64())])
FIXES = pa.schema([("row", pa.int64()), ("prompt_id", pa.string()), ("first", pa.int64())])


def write_prompts(config: JobConfig, dest: str, filesystem=None, *, source: Source | None = None,
                  chunk_rows: int | None = None, partitions: int | None = None) -> int:
    """Read, normalise and write the prompt set as Parquet files under the folder `dest`; the number of rows.

    The rows are `load_prompts`'s, row for row (sorted by ``source_row``; the files also hold them in source order):
    the first `data.limit` rows in source order, numbered, each later duplicate id given its ``#dup<k>`` suffix and
    error. Nothing of the set is gathered on the driver: it is materialized in Ray's object store (which spills to
    disk) and moved between Ray tasks, so the driver's memory does not grow with the prompt set.

    `dest` is a folder as Ray Data takes it (a local absolute path or a URL); `filesystem` a pyarrow filesystem for
    it, or None for a local path; `source` the config's `check_source` when the caller has it. `chunk_rows` (at
    least this many rows per chunk of consecutive blocks, and so per written file; by default `CHUNK_ROWS`, more
    with many partitions) and `partitions` (hash partitions for finding
    duplicates; by default one per million rows, at least one per CPU) are for tests and tuning. Apart from Ray
    Data's read tasks (as in `load_prompts`), every task asks for no CPU, so none waits behind actors holding every
    CPU of a small cluster, and at most one per CPU of the cluster runs at a time.

    Needs a connected Ray. Raises InputError, as `load_prompts` does, for a source that is absent, unreadable
    (naming the file and line when the driver can find it), lacks a named column or holds no rows; these are all
    found while reading, before anything is written under `dest`. Any error while writing leaves whatever was
    written so far under `dest`: removing it is the caller's job (write to a temporary folder, rename when done).
    """
    import ray
    import ray.data

    source = source if source is not None else check_source(config)
    width = cluster_cpus()  # tasks running at once, at most
    remote = {"num_cpus": 0}
    with data_context(**READ_CONTEXT):
        materialized, source = _read_whole(config, source, lambda ds: ds.materialize())
        blocks = materialized.to_arrow_refs()
        del materialized  # the refs keep the blocks; each is dropped once its chunk is numbered
        count = ray.remote(_num_rows).options(**remote)
        counts = ray.get(_bounded([(count, (b,)) for b in blocks], width))
        total = sum(counts)
        if total == 0:
            raise InputError(f"data.source: {source.spec}: holds no rows")

        parts_n = partitions or min(256, max(width, -(-total // ROWS_PER_PARTITION)))
        chunks = chunk_plan(counts, chunk_rows or max(CHUNK_ROWS, RECORDS_PER_PART * parts_n))
        scatter = ray.remote(number_and_scatter).options(num_returns=parts_n + 1, **remote)
        calls = [(scatter, (start, parts_n, *blocks[a:b])) for start, a, b in chunks]
        del blocks
        outs = _bounded(calls, width)
        del calls
        numbered = [o[0] for o in outs]
        find = ray.remote(find_duplicates).options(num_returns=2, **remote)
        found = _bounded([(find, tuple(o[1 + p] for o in outs)) for p in range(parts_n)], width)
        del outs
        sizes = ray.get([n for n, _ in found])
        fixes = [f for (_, f), size in zip(found, sizes) if size]

        width = min(width, len(numbered))
        out = ray.data.from_arrow_refs(numbered)
        del numbered
        if fixes:
            out = out.map_batches(_apply_fix_refs, fn_kwargs={"fixes": fixes}, batch_format="pyarrow",
                                  batch_size=None, num_cpus=0, compute=ray.data.TaskPoolStrategy(size=width))
        out.write_parquet(dest, filesystem=filesystem, ray_remote_args=remote, concurrency=width)
    return total


def _bounded(calls: list, limit: int) -> list:
    """Submit each (remote_function, args) with at most `limit` of them unfinished at any time (their tasks ask
    for no CPU, so Ray itself would start them all at once); the results' ObjectRefs, in order."""
    import ray

    results, running = [], []
    for fn, args in calls:
        if len(running) >= limit:
            _, running = ray.wait(running, num_returns=1, fetch_local=False)
        refs = fn.remote(*args)
        results.append(refs)
        running.append(refs[0] if isinstance(refs, list) else refs)
    return results


def _num_rows(block: pa.Table) -> int:
    return block.num_rows


def chunk_plan(counts: list[int], rows: int) -> list[tuple[int, int, int]]:
    """Consecutive blocks grouped into chunks of at least `rows` rows (the last may have fewer): (first source_row,
    first block, end block) each; empty blocks are left out."""
    out, start, first, size = [], 0, 0, 0
    for i, n in enumerate(counts):
        if size == 0:
            first = i
        size += n
        if size >= rows:
            out.append((start, first, i + 1))
            start, size = start + size, 0
    if size:
        out.append((start, first, len(counts)))
    return out


def number_and_scatter(start: int, partitions: int, *blocks: pa.Table) -> list[pa.Table]:
    """One chunk of normalised rows: the chunk with ``source_row`` set (its first row is `start`), then, per hash
    partition, the records of its ids: (id, null, source_row) for each row, and (X, j, source_row) for each id
    of the form ``X#dup<j>``, sent to X's partition."""
    import zlib

    import numpy as np
    import pyarrow.compute as pc

    table = pa.concat_tables([b for b in blocks if b.num_rows]).cast(INPUT_SCHEMA)
    rows = pa.array(np.arange(start, start + table.num_rows, dtype=np.int64))
    table = table.set_column(table.schema.get_field_index("source_row"), "source_row", rows)
    ids = table.column("prompt_id").combine_chunks()
    dup = pc.extract_regex(ids, _DUP_ID)
    has = pc.is_valid(dup)
    records = pa.concat_tables([
        pa.table([ids, pa.nulls(len(ids), pa.int64()), rows], schema=RECORDS),
        pa.table([pc.filter(pc.struct_field(dup, "base"), has),
                  pc.filter(pc.struct_field(dup, "k"), has).cast(pa.int64()),
                  pc.filter(rows, has)], schema=RECORDS),
    ])
    # a stable hash (the same in every process, unlike hash()) of the key picks the partition
    part = np.fromiter((zlib.crc32(k.encode()) % partitions for k in records.column("key").to_pylist()),
                       dtype=np.int64, count=records.num_rows)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(partitions + 1))
    records = records.take(pa.array(order))
    return [table] + [records.slice(bounds[p], bounds[p + 1] - bounds[p]) for p in range(partitions)]


def find_duplicates(*parts: pa.Table) -> tuple[int, pa.Table]:
    """The records of one hash partition -> how many fixes, and the fixes sorted by row: for each later occurrence
    of an id, its source_row, its new prompt_id and the source_row of the id's first occurrence (as
    `assign_unique_ids`)."""
    import pyarrow.compute as pc

    records = pa.concat_tables(parts) if parts else RECORDS.empty_table()
    seen = records.filter(pc.is_null(records.column("k")))
    counts = seen.group_by("key").aggregate([("row", "count")])
    repeated = counts.filter(pc.greater(counts.column("row_count"), 1)).column("key")
    if len(repeated) == 0:
        return 0, FIXES.empty_table()
    seen = seen.filter(pc.is_in(seen.column("key"), value_set=repeated))
    seen = seen.sort_by([("key", "ascending"), ("row", "ascending")])
    marks = records.filter(pc.and_(pc.is_valid(records.column("k")),
                                   pc.is_in(records.column("key"), value_set=repeated)))
    taken: dict[str, set[int]] = {}
    for key, k in zip(marks.column("key").to_pylist(), marks.column("k").to_pylist()):
        taken.setdefault(key, set()).add(k)
    out_rows, out_ids, out_first = [], [], []
    previous, first, k = None, -1, 0
    for key, row in zip(seen.column("key").to_pylist(), seen.column("row").to_pylist()):
        if key != previous:
            previous, first, k = key, row, 0
            continue
        used = taken.get(key, ())
        k += 1
        while k in used:
            k += 1
        out_rows.append(row)
        out_ids.append(f"{key}#dup{k}")
        out_first.append(first)
    fixes = pa.table([pa.array(out_rows, pa.int64()), pa.array(out_ids, pa.string()),
                      pa.array(out_first, pa.int64())], schema=FIXES)
    return fixes.num_rows, fixes.sort_by("row")


def _apply_fix_refs(batch: pa.Table, fixes: list) -> pa.Table:
    """`apply_fixes` for Ray Data: `fixes` are ObjectRefs of `find_duplicates` tables (read without copying)."""
    import ray

    return apply_fixes(batch, ray.get(fixes))


def apply_fixes(batch: pa.Table, fixes: list[pa.Table]) -> pa.Table:
    """Numbered rows with the duplicate fixes of their rows applied (`fixes`: `find_duplicates` tables, each sorted
    by row; rows of other batches are ignored): the new prompt_id, and the duplicate error unless the row has its
    own, as `assign_unique_ids` words it."""
    import numpy as np

    rows = batch.column("source_row").to_numpy()
    ids = errors = None
    for fix in fixes:
        fix_rows = fix.column("row").to_numpy()
        if not len(fix_rows):
            continue
        at = np.searchsorted(fix_rows, rows)
        hit = np.flatnonzero((at < len(fix_rows)) & (fix_rows[np.minimum(at, len(fix_rows) - 1)] == rows))
        if not len(hit):
            continue
        if ids is None:
            ids = batch.column("prompt_id").to_pylist()
            errors = batch.column("input_error").to_pylist()
        taken = pa.array(at[hit])
        new_ids = fix.column("prompt_id").take(taken).to_pylist()
        firsts = fix.column("first").take(taken).to_pylist()
        for i, new, first in zip(hit.tolist(), new_ids, firsts):
            if errors[i] is None:
                errors[i] = f"duplicate prompt_id {ids[i]!r}: first seen at row {first}; only that one runs"
            ids[i] = new
    if ids is None:
        return batch
    batch = batch.set_column(batch.schema.get_field_index("prompt_id"), "prompt_id", pa.array(ids, pa.string()))
    return batch.set_column(batch.schema.get_field_index("input_error"), "input_error",
                            pa.array(errors, pa.string()))
