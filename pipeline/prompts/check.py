"""What the driver checks of a source before Ray starts, cheaply: each file's encoding, lines, footer and the
columns the config names (`check_source`); every problem raises `schemas.base.InputError` naming the field and
the path."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pyarrow as pa

from pipeline.prompts.source import Source, resolve_source
from schemas.base import InputError
from schemas.config import DataConfig, JobConfig


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


def value_types(row: dict) -> dict[str, str]:
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
            for key, kind in value_types(row).items():
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
            raise InputError(f"data.source: {shown_path(source, path)}: cannot be read ({err})") from None
        if found.problem:
            problems.append(f"data.source: {shown_path(source, path)}: {found.problem}")
        elif found.python_reader:
            python_reader = python_reader or f"{shown_path(source, path)}: {found.python_reader}"
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
    for field, column in config.reward_column_fields():
        check(field, column, lambda t: True, "")
    return problems


def _unified(schemas: list[pa.Schema]) -> pa.Schema:
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return schemas[0]


def shown_path(source: Source, path: str) -> str:
    return path if path.startswith(source.spec) else f"{source.spec}: {path}"
