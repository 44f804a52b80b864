"""Reading and normalising prompt datasets (pipeline/prompts/)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, job_config, write_jsonl
from conftest_runs import s3_endpoint  # noqa: F401 (fixture)

from pipeline.prompts import (
    INPUT_SCHEMA,
    apply_fixes,
    assign_unique_ids,
    chunk_plan,
    column_problems,
    find_duplicates,
    load_prompts,
    normalise_prompt,
    normalise_row,
    number_and_scatter,
    prompt_hash,
    resolve_source,
    write_prompts,
)
from schemas.base import InputError
from schemas.config import DataConfig, validate_config

ROWS = [{"id": f"q{i}", "prompt": f"Write about item {i}.", "concepts": ["dog", f"w{i}"]} for i in range(6)]


def config_for(tmp_path, source, **data):
    cfg = job_config(tmp_path, data={"source": str(source), "limit": None, **data})
    return validate_config(cfg)


# -- normalisation (no Ray) ---------------------------------------------------------------------------------------


def test_a_string_prompt_becomes_one_user_turn():
    assert normalise_prompt("hi") == ([{"role": "user", "content": "hi"}], None)


def test_chat_messages_are_kept_and_extra_fields_dropped():
    msgs = [{"role": "system", "content": "be brief", "name": "x"}, {"role": "user", "content": "hi"}]
    assert normalise_prompt(msgs) == ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                      None)


@pytest.mark.parametrize("value, why", [
    (None, "prompt is null"),
    ("", "empty prompt: every message is blank"),
    ("  \n ", "empty prompt: every message is blank"),
    ([], "empty prompt: no messages"),
    ([{"role": "user", "content": " "}], "empty prompt: every message is blank"),
    ([{"role": "user"}], "prompt message 0 is not a {role, content} pair of strings: {'role': 'user'}"),
    (42, "prompt is a int (42); expected a string or a list of {role, content} messages"),
    ([{"role": "wizard", "content": "cast it"}],
     "prompt message 0 has role 'wizard'; chat roles are system, developer, user, assistant, tool"),
])
def test_prompts_that_cannot_run_say_why(value, why):
    assert normalise_prompt(value)[1] == why


def test_an_error_row_keeps_the_prompt_that_was_wrong():
    """Issue 26: error rows stored `prompt: []`, losing the value that was wrong. Messages that fit the column are
    kept; a value that does not is quoted in the error, and names the prompt when ids are hashed."""
    wizard = [{"role": "wizard", "content": "cast it"}]
    assert normalise_prompt(wizard)[0] == wizard
    assert normalise_prompt([{"role": "user", "content": " "}])[0] == [{"role": "user", "content": " "}]
    assert normalise_prompt([{"role": "user", "content": 3}]) == (
        [], "prompt message 0 is not a {role, content} pair of strings: {'role': 'user', 'content': 3}")
    data = DataConfig(source="x.jsonl")
    ids = {normalise_row({"prompt": v}, data, None)["prompt_id"] for v in (42, 43, [{"role": "user"}])}
    assert len(ids) == 3  # not one id for every bad prompt


def test_prompt_hash_is_stable_and_content_addressed():
    a = [{"role": "user", "content": "hi"}]
    assert prompt_hash(a) == prompt_hash([{"content": "hi", "role": "user"}])
    assert prompt_hash(a) != prompt_hash([{"role": "user", "content": "hi!"}])
    assert len(prompt_hash(a)) == 16
    # A plain string and the same text as one user turn are the same prompt.
    data = DataConfig(source="x")
    assert normalise_row({"prompt": "hi"}, data, None)["prompt_id"] == prompt_hash(a)


def test_ids_are_strings_and_missing_ids_are_row_errors():
    data = DataConfig(source="x", id_column="id")
    assert normalise_row({"id": 7, "prompt": "a"}, data, None)["prompt_id"] == "7"
    row = normalise_row({"id": None, "prompt": "a"}, data, None)
    assert row["input_error"] == "id column 'id' is empty"


def test_concepts_are_checked_only_for_the_lexical_reward():
    data = DataConfig(source="x")
    assert normalise_row({"prompt": "a", "concepts": None}, data, None)["input_error"] is None
    assert normalise_row({"prompt": "a", "c": ["x", "y"]}, data, "c")["concepts"] == ["x", "y"]
    assert normalise_row({"prompt": "a", "c": None}, data, "c")["input_error"] == "concepts column 'c' is null"
    assert normalise_row({"prompt": "a", "c": []}, data, "c")["input_error"] == "concepts column 'c' is an empty list"


def _table(ids, errors=None):
    n = len(ids)
    return pa.Table.from_pylist(
        [{"prompt_id": i, "prompt": [{"role": "user", "content": str(k)}], "concepts": None,
          "input_error": (errors or [None] * n)[k], "source_row": -1} for k, i in enumerate(ids)],
        schema=INPUT_SCHEMA,
    )


def test_duplicates_keep_the_first_and_become_error_rows_with_distinct_ids():
    out = assign_unique_ids(_table(["a", "b", "a", "a#dup1", "a"], [None, None, None, None, "empty prompt"]))
    ids = out.column("prompt_id").to_pylist()
    errors = out.column("input_error").to_pylist()
    assert ids == ["a", "b", "a#dup2", "a#dup1", "a#dup3"]
    assert len(set(ids)) == len(ids)
    assert errors[:2] == [None, None] and errors[3] is None
    assert errors[2] == "duplicate prompt_id 'a': first seen at row 0; only that one runs"
    assert errors[4] == "empty prompt"  # a row's own error is kept; its id is still made unique
    assert out.column("source_row").to_pylist() == [0, 1, 2, 3, 4]


def test_chunks_are_consecutive_blocks_numbered_from_the_rows_before_them():
    assert chunk_plan([3, 0, 4, 1, 5, 0], 4) == [(0, 0, 3), (7, 3, 5)]  # 3+0+4 rows, then 1+5(+0)
    assert chunk_plan([0, 2, 0], 1) == [(0, 1, 2)]  # empty blocks starting a chunk are left out
    assert chunk_plan([], 4) == []


@pytest.mark.parametrize("seed", range(40))
def test_duplicates_found_by_partition_match_assign_unique_ids(seed):
    """The scattered algorithm of write_prompts, without Ray: random ids (suffix-like ones among them), random
    blocks (some empty), chunks and partitions give assign_unique_ids's table row for row."""
    rng = random.Random(seed)
    pool = ["a", "b", "a#dup1", "a#dup2", "a#dup1#dup1", "b#dup01", "c#dup", "<no id>", "x#dup3", "7", "7#dup1",
            "a#dup99999999999999999999"]
    n = rng.randint(1, 50)
    ids = [rng.choice(pool) for _ in range(n)]
    table = _table(ids, [rng.choice([None, None, "empty prompt"]) for _ in range(n)])
    cuts = sorted(rng.choices(range(n + 1), k=rng.randint(0, 6)))
    blocks = [table.slice(a, b - a) for a, b in zip([0, *cuts], [*cuts, n])]
    partitions = rng.randint(1, 4)
    plan = chunk_plan([b.num_rows for b in blocks], rng.randint(1, 12))
    outs = [number_and_scatter(start, partitions, *blocks[a:b]) for start, a, b in plan]
    found = [find_duplicates(*(out[1 + p] for out in outs)) for p in range(partitions)]
    assert sum(count for count, _ in found) == len(ids) - len(set(ids))
    got = pa.concat_tables([apply_fixes(out[0], [fixes for _, fixes in found]) for out in outs])
    assert got.equals(assign_unique_ids(table))


# -- resolving data.source (no Ray) -----------------------------------------------------------------------------


def test_resolve_file_folder_and_builtin(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    assert resolve_source(str(f)).kind == "json"
    (tmp_path / "d").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), tmp_path / "d" / "a.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[3:]), tmp_path / "d" / "b.parquet")
    (tmp_path / "d" / "_SUCCESS.parquet").write_text("not data")  # hidden by its leading underscore
    src = resolve_source(str(tmp_path / "d"))
    assert src.kind == "parquet" and [p.rsplit("/", 1)[1] for p in src.paths] == ["a.parquet", "b.parquet"]
    demo = resolve_source("builtin:demo-prompts")
    assert demo.kind == "json" and demo.paths[0].endswith("prompts.jsonl")


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "absent.jsonl", "no such file or folder"),
    (lambda d: (d / "p.txt").write_text("x") and d / "p.txt", "unsupported file type '.txt'"),
    (lambda d: (d / "e").mkdir() or d / "e", "holds no .jsonl, .json, .parquet, .csv files"),
    (lambda d: ((d / "m").mkdir(), (d / "m" / "a.csv").write_text("prompt\nx\n"),
                (d / "m" / "b.jsonl").write_text("{}\n"))[0] or d / "m", "mixes file types (csv, json)"),
    (lambda d: ((d / "dd").mkdir(), (d / "dd" / "dataset_dict.json").write_text("{}"))[0] or d / "dd",
     "DatasetDict with several splits"),
])
def test_unusable_sources_are_refused_by_name(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(InputError) as err:
        resolve_source(str(path))
    assert message in str(err.value) and str(path) in str(err.value) and "data.source" in str(err.value)


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(InputError, match="data.source: unknown builtin asset 'nope'; known: .*demo-prompts"):
        resolve_source("builtin:nope")


def test_column_problems_name_field_column_and_source():
    schema = pa.schema([("text", pa.string()), ("id", pa.float64()), ("concepts", pa.string())])
    cfg = validate_config(job_config(__import__("pathlib").Path("/x"), data={"source": "s.jsonl"},
                                     models={"reward": {"kind": "lexical"}}))
    problems = column_problems(schema, cfg, "s.jsonl")
    assert problems == [
        "data.prompt_column: column 'prompt' is not in s.jsonl (columns: text, id, concepts)",
        "data.id_column: column 'id' of s.jsonl is double; expected strings or integers",
        "models.reward.concepts_column: column 'concepts' of s.jsonl is string; expected a list of strings",
    ]


# -- reading with Ray Data --------------------------------------------------------------------------------------


def _ids(table):
    return table.column("prompt_id").to_pylist()


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet-folder", "save_to_disk"])
def test_every_source_format_reads_to_the_same_prompts(ray_session, tmp_path, fmt):
    flat = [{"id": r["id"], "prompt": r["prompt"]} for r in ROWS]
    if fmt == "jsonl":
        src = write_jsonl(tmp_path / "p.jsonl", flat)
    elif fmt == "json":
        src = tmp_path / "p.json"
        src.write_text(json.dumps(flat))
    elif fmt == "csv":
        src = tmp_path / "p.csv"
        src.write_text("id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in flat))
    elif fmt == "parquet-folder":
        src = tmp_path / "pq"
        src.mkdir()
        pq.write_table(pa.Table.from_pylist(flat[:2]), src / "part-0.parquet")
        pq.write_table(pa.Table.from_pylist(flat[2:]), src / "part-1.parquet")
    else:
        import datasets

        src = tmp_path / "hf"
        datasets.Dataset.from_list(flat).save_to_disk(str(src))
    table = load_prompts(config_for(tmp_path, src))
    assert table.schema == INPUT_SCHEMA
    assert _ids(table) == [r["id"] for r in ROWS]
    assert table.column("prompt").to_pylist()[4] == [{"role": "user", "content": "Write about item 4."}]
    assert table.column("input_error").null_count == len(ROWS)


def test_limit_keeps_the_first_rows_in_source_order(ray_session, tmp_path):
    src = tmp_path / "pq"
    src.mkdir()
    for k in range(3):  # three files, so the order must survive parallel reads
        pq.write_table(pa.Table.from_pylist(ROWS[2 * k: 2 * k + 2]), src / f"part-{k}.parquet")
    assert _ids(load_prompts(config_for(tmp_path, src, limit=3))) == ["q0", "q1", "q2"]


def test_chat_prompts_hashed_ids_and_lexical_concepts(ray_session, tmp_path):
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"u{i}"}],
             "words": ["a", "b"]} for i in range(3)]
    rows.append({"messages": [{"role": "user", "content": "u0"}], "words": None})
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = validate_config(job_config(tmp_path, data={"source": str(src), "prompt_column": "messages",
                                                     "id_column": None, "limit": None},
                                     models={"reward": {"kind": "lexical", "concepts_column": "words"}}))
    table = load_prompts(cfg)
    out = table.to_pylist()
    assert out[0]["prompt_id"] == prompt_hash(rows[0]["messages"])
    assert out[1]["prompt"] == rows[1]["messages"] and out[1]["concepts"] == ["a", "b"]
    assert out[3]["input_error"] == "concepts column 'words' is null"


def test_missing_columns_are_reported_together(ray_session, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"text": "a", "key": "1"}])
    cfg = validate_config(job_config(tmp_path, data={"source": str(src), "id_column": "uid"},
                                     models={"reward": {"kind": "lexical"}}))
    with pytest.raises(InputError) as err:
        load_prompts(cfg)
    assert err.value.problems == [
        f"data.prompt_column: column 'prompt' is not in {src} (columns: text, key)",
        f"data.id_column: column 'uid' is not in {src} (columns: text, key)",
        f"models.reward.concepts_column: column 'concepts' is not in {src} (columns: text, key)",
    ]


def test_malformed_json_is_a_clean_error(ray_session, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(InputError, match=f"data.source: {src}: line 2 is not valid JSON"):
        load_prompts(config_for(tmp_path, src))


def test_a_malformed_jsonl_line_is_named_by_file_and_line(ray_session, tmp_path):
    """Ray's JSON reader reports a position in its own buffer; the driver finds the file's first bad line."""
    folder = tmp_path / "prompts"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS[:3])
    (folder / "b.jsonl").write_text('{"id": "b1", "prompt": "x"}\n\n{"id": "b2", "prompt": "y"}\n'
                                    '{"id": "b3", "prompt": ]\n{"id": "b4", "prompt": "z"}\n')
    with pytest.raises(InputError) as err:
        load_prompts(config_for(tmp_path, folder))
    assert err.value.problems == [(f"data.source: {folder / 'b.jsonl'}: line 4 is not valid JSON "
                                   "(Expecting value, column 24)")]


def test_a_truncated_parquet_source_is_bad_input_naming_the_file(ray_session, tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), folder / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[3:]), folder / "part-1.parquet")
    whole = (folder / "part-1.parquet").read_bytes()
    (folder / "part-1.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(InputError) as err:
        load_prompts(config_for(tmp_path, folder))
    [problem] = err.value.problems
    assert problem.startswith(f"data.source: {folder / 'part-1.parquet'}: not a readable parquet file (")


@pytest.mark.parametrize("text, problem", [
    ('{"a": 1}\n{"a": 2}\n', None),
    ('[{"a": 1},\n {"a": 2}]\n', None),  # one JSON document
    ('{"a": 1}\n\n\n{"a": \n', "line 4 is not valid JSON (Expecting value, column 7)"),
    ('{"a": 1}\n[1, 2]\n', "line 2 is a JSON list; expected an object (one row per line)"),
    ('[{"a": 1},\n {"a": ]', "not valid JSON (Expecting value: line 2 column 8 (char 18))"),
])
def test_the_first_bad_json_line_is_found_without_ray(tmp_path, text, problem):
    from pipeline.prompts import first_bad_file

    src = tmp_path / "p.jsonl"
    src.write_text(text)
    assert first_bad_file(resolve_source(str(src))) == (None if problem is None else f"{src}: {problem}")
    src.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    assert first_bad_file(resolve_source(str(src))) == f"{src}: line 2 is not UTF-8 text (invalid start byte at byte 16)"


def test_only_the_readers_errors_are_bad_input_not_rays_own():
    """A reader's error re-raised by Ray is an instance of its own class too (bad input, exit 2); Ray's own failures
    that subclass OSError (a get timeout) or anything else (a dead actor) propagate as run-time failures."""
    import ray.exceptions

    from pipeline.prompts import READ_ERRORS, raise_if_not_input

    wrapped = ray.exceptions.RayTaskError("read", "traceback", pa.ArrowInvalid("truncated")).as_instanceof_cause()
    assert isinstance(wrapped, READ_ERRORS)
    raise_if_not_input(wrapped)  # bad input: returns
    timeout = ray.exceptions.GetTimeoutError("slow")
    assert isinstance(timeout, READ_ERRORS)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        raise_if_not_input(timeout)
    assert not isinstance(ray.exceptions.ActorDiedError(), READ_ERRORS)


# -- the prompt set written by Ray tasks (write_prompts), against load_prompts as the reference ----------------------

DUPLICATED = [
    {"id": "a", "prompt": "first a"},
    {"id": "e", "prompt": " "},  # an error row, and the first occurrence of 'e'
    {"id": "a", "prompt": "second a"},
    {"id": "b", "prompt": "first b"},
    {"id": "a#dup1", "prompt": "an id of the source that looks like a suffix"},
    {"id": "e", "prompt": "a runnable duplicate of an error row"},
    {"id": "a", "prompt": "third a"},
    {"id": None, "prompt": "no id"},
    {"id": None, "prompt": "no id again"},
    {"id": "b", "prompt": "second b"},
    {"id": "c", "prompt": None},
    {"id": "a", "prompt": "fourth a"},
]


def _written(cfg, dest, **kwargs) -> pa.Table:
    """write_prompts into `dest`, read back; checks the count and that the files hold the rows in source order."""
    n = write_prompts(cfg, str(dest), None, **kwargs)
    table = pq.read_table(dest)  # the files in name order
    assert n == table.num_rows
    assert table.column("source_row").to_pylist() == list(range(n))
    return table.cast(INPUT_SCHEMA)


def _parts(folder, rows, per_file):
    folder.mkdir()
    for k in range(0, len(rows), per_file):  # one Ray Data block per file at least
        write_jsonl(folder / f"part-{k // per_file:02d}.jsonl", rows[k: k + per_file])
    return folder


@pytest.mark.parametrize("limit", [None, 7])
def test_written_prompts_equal_the_gathered_ones_string_ids(ray_session, tmp_path, limit):
    cfg = config_for(tmp_path, _parts(tmp_path / "src", DUPLICATED, 3), limit=limit)
    expected = load_prompts(cfg)
    assert _written(cfg, tmp_path / "many", chunk_rows=2, partitions=3).equals(expected)
    if limit is None:
        assert _written(cfg, tmp_path / "defaults").equals(expected)
        ids = expected.column("prompt_id").to_pylist()
        assert ids[2] == "a#dup2" and ids[6] == "a#dup3" and ids[5] == "e#dup1" and ids[8] == "<no id>#dup1"


def test_written_prompts_equal_the_gathered_ones_int_ids(ray_session, tmp_path):
    src = tmp_path / "pq"
    src.mkdir()
    rows = [{"id": i % 5, "prompt": f"prompt {i}"} for i in range(13)]
    for k in range(0, 13, 4):
        pq.write_table(pa.Table.from_pylist(rows[k: k + 4]), src / f"part-{k:02d}.parquet")
    cfg = config_for(tmp_path, src)
    expected = load_prompts(cfg)
    assert expected.column("prompt_id").to_pylist()[10] == "0#dup2"
    assert _written(cfg, tmp_path / "out", chunk_rows=3, partitions=2).equals(expected)


def test_written_prompts_equal_the_gathered_ones_hashed_ids_chat_and_concepts(ray_session, tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rows = [{"messages": chat, "words": ["a", "b"]}, {"messages": [{"role": "user", "content": "v"}], "words": None},
            {"messages": chat, "words": ["c"]}, {"messages": None, "words": ["d"]}, {"messages": chat, "words": []},
            {"messages": [{"role": "user", "content": "v"}], "words": ["e"]}]
    src = _parts(tmp_path / "src", rows, 2)
    cfg = validate_config(job_config(tmp_path, data={"source": str(src), "prompt_column": "messages",
                                                     "id_column": None, "limit": None},
                                     models={"reward": {"kind": "lexical", "concepts_column": "words"}}))
    expected = load_prompts(cfg)
    assert expected.column("prompt_id").to_pylist()[4] == prompt_hash(chat) + "#dup2"
    assert _written(cfg, tmp_path / "out", chunk_rows=1, partitions=4).equals(expected)


def _empty_parquet(tmp_path):
    src = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), src)
    return src


def _bad_jsonl(tmp_path):
    folder = _parts(tmp_path / "src", [{"id": "a", "prompt": "x"}] * 4, 2)
    (folder / "part-02.jsonl").write_text('{"id": "b1", "prompt": "x"}\n{"id": "b3", "prompt": ]\n')
    return folder


def _truncated_parquet(tmp_path):
    src = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), src)
    src.write_bytes(src.read_bytes()[:200])
    return src


@pytest.mark.parametrize("make, problem", [
    (_bad_jsonl, "data.source: {src}/part-02.jsonl: line 2 is not valid JSON (Expecting value, column 24)"),
    (_truncated_parquet, "data.source: {src}: not a readable parquet file ("),
    (lambda d: write_jsonl(d / "p.jsonl", [{"text": "a", "id": "1"}]),
     "data.prompt_column: column 'prompt' is not in {src} (columns: text, id)"),
    (_empty_parquet, "data.source: {src}: holds no rows"),
])
def test_bad_sources_are_input_errors_before_anything_is_written(ray_session, tmp_path, make, problem):
    src = make(tmp_path)
    cfg = config_for(tmp_path, src)
    for read in (load_prompts, lambda c: write_prompts(c, str(tmp_path / "out"), None)):
        with pytest.raises(InputError) as err:
            read(cfg)
        [got] = err.value.problems
        assert got.startswith(problem.format(src=src))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_scale_bench_prints_and_records_its_figures(tmp_path):
    """bench/prompts_scale.py end to end on a tiny size (its own Ray; its figures are measured by hand)."""
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, "-m", "bench.prompts_scale", "--sizes", "3000", "--rows-per-file", "1000",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Driver peak RSS increase" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["stream 3000"]["rows"] == figures["gather 3000"]["rows"] == 3000
    assert figures["gather 3000"]["same rows"] is True
    assert figures["stream 3000"]["peak_mb"] >= 0 and figures["gather 3000"]["seconds"] > 0


# -- columns that mix types (issue 22): what pyarrow's JSON reader refuses, read line by line ------------------------

MIXED = [{"id": 1, "prompt": "one"}, {"id": "b", "prompt": [{"role": "user", "content": "two"}]},
         {"id": 3, "prompt": "three", "extra": {"nested": True}}, {"id": "1", "prompt": "a repeat of id 1"},
         {"id": 5.5, "prompt": "a float id"}, {"id": None, "prompt": "no id"}, {"id": 7, "prompt": "seven",
                                                                                "extra": "now a string"}]


def test_integer_and_string_ids_mixed_in_one_jsonl_become_strings(ray_session, tmp_path):
    """docs/jobs.md allows integer and string ids; pyarrow types a column from its first values and refused the
    file ("JSONDecodeError: Extra data", from Ray's fallback). Every line is a JSON object, so it is read line by
    line: the ids become strings, a prompt may be a string on one line and messages on the next."""
    from pipeline.prompts import check_source

    src = write_jsonl(tmp_path / "mixed.jsonl", MIXED)
    cfg = config_for(tmp_path, src)
    source = check_source(cfg)
    assert source.reader == "python" and "column 'id' holds numbers (line 1) and strings (line 2)" in source.why_python
    table = load_prompts(cfg)
    rows = table.to_pylist()
    assert [r["prompt_id"] for r in rows] == ["1", "b", "3", "1#dup1", "<no id>", "<no id>#dup1", "7"]
    assert rows[1]["prompt"] == [{"role": "user", "content": "two"}] and rows[1]["input_error"] is None
    assert rows[3]["input_error"] == "duplicate prompt_id '1': first seen at row 0; only that one runs"
    assert rows[4]["input_error"] == "id column 'id' holds a number; expected a string or an integer"
    assert _written(cfg, tmp_path / "out", chunk_rows=2, partitions=2).equals(table)
    assert _ids(load_prompts(config_for(tmp_path, src, limit=2))) == ["1", "b"]


def test_files_that_type_the_id_column_apart_and_csv_ids_mixing_numbers_and_names(ray_session, tmp_path):
    from pipeline.prompts import check_source

    folder = tmp_path / "parts"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"id": 1, "prompt": "x"}, {"id": 2, "prompt": "y"}])
    write_jsonl(folder / "b.jsonl", [{"id": "c", "prompt": "z"}])
    cfg = config_for(tmp_path, folder)
    assert check_source(cfg).reader == "python"
    assert _ids(load_prompts(cfg)) == ["1", "2", "c"]
    csv = tmp_path / "p.csv"
    csv.write_text("id,prompt\n" + "".join(f"{i},prompt {i}\n" for i in range(5)) + "x9,prompt x\n")
    assert _ids(load_prompts(config_for(tmp_path, csv))) == ["0", "1", "2", "3", "4", "x9"]


LOAD_IDS = """
import json, sys
import ray
from pipeline.prompts import load_prompts
from schemas.config import validate_config
ray.init(num_cpus=2, include_dashboard=False)
print(json.dumps(load_prompts(validate_config(json.loads(sys.argv[1]))).column("prompt_id").to_pylist()))
"""


@pytest.mark.slow
def test_a_remote_jsonl_mixing_id_types_is_read_again_line_by_line(s3_endpoint, tmp_path):  # noqa: F811
    """A remote source is not read by the driver before Ray: pyarrow's reader refuses it while Ray reads it, and
    the driver then finds every line good JSON and reads it line by line. (A Ray of its own, started where the
    moto server's address is in the environment, so that its workers reach it.)"""
    import os

    import s3fs

    s3fs.S3FileSystem().pipe_file("winnow-test/mixed.jsonl", "".join(json.dumps(r) + "\n" for r in MIXED).encode())
    cfg = job_config(tmp_path, data={"source": "s3://winnow-test/mixed.jsonl", "limit": None})
    out = subprocess.run([sys.executable, "-c", LOAD_IDS, json.dumps(cfg)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ["1", "b", "3", "1#dup1", "<no id>", "<no id>#dup1", "7"]


def test_the_driver_reads_lines_longer_than_its_reading_blocks(tmp_path):
    from pipeline.prompts import check_source

    long = "word " * 60_000  # a 300 KB prompt: longer than the first blocks the driver's check reads
    src = write_jsonl(tmp_path / "long.jsonl", [{"id": "a", "prompt": long}, {"id": "b", "prompt": "short"}])
    source = check_source(config_for(tmp_path, src))
    assert source.reader == "arrow" and source.columns is None
    src.write_text(src.read_text() + '{"id": "c", "prompt": }\n')
    with pytest.raises(InputError) as err:
        check_source(config_for(tmp_path, src))
    assert err.value.problems == [f"data.source: {src}: line 3 is not valid JSON (Expecting value, column 23)"]


@pytest.mark.parametrize("fmt, limit", [("jsonl", None), ("csv", None), ("jsonl", 3), ("parquet", 3)])
def test_reading_a_source_cancels_no_read_task(ray_session, tmp_path, monkeypatch, fmt, limit):
    """Ray Data learns a JSON or CSV source's schema by reading one block, and stops at data.limit, then force-cancels
    the read tasks still running; a cancel that met a task finishing crashed the driver once ("Tried to complete
    task that was not pending", Ray 2.60). A source read whole anyway (no limit), or small, is read to its end
    first (`read_first`): no task is cancelled."""
    import ray

    rows = [{"id": f"q{i}", "prompt": f"Write about item {i}."} for i in range(500)]
    src = tmp_path / f"p.{fmt}"
    if fmt == "jsonl":
        write_jsonl(src, rows)
    elif fmt == "csv":
        src.write_text("id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), src)
    cancels = []
    real_cancel = ray.cancel

    def recording_cancel(ref, *args, **kwargs):
        cancels.append(kwargs.get("force"))
        return real_cancel(ref, *args, **kwargs)

    monkeypatch.setattr(ray, "cancel", recording_cancel)
    table = load_prompts(config_for(tmp_path, src, limit=limit))
    assert _ids(table) == [r["id"] for r in rows][:limit]
    assert cancels == []
