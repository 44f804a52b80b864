"""The prompt set at scale: normalised, numbered, made unique and written by Ray tasks (`write_prompts`); the
driver holds object references and per-block row counts, never rows."""

from __future__ import annotations

import pyarrow as pa

from pipeline.prompts.check import check_source
from pipeline.prompts.normalise import INPUT_SCHEMA
from pipeline.prompts.read import READ_CONTEXT, read_whole, cluster_cpus
from pipeline.prompts.source import Source
from pipeline.raydata import data_context
from schemas.base import InputError
from schemas.config import JobConfig


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
        materialized, source = read_whole(config, source, lambda ds: ds.materialize())
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
