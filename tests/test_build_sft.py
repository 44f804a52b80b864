"""`winnow build-sft`: selection rules, cross-run pooling, the output's TRL shape, the card, and bad input."""

from __future__ import annotations

import os
import uuid

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest_runs import cand, err_row, row, s3_endpoint, write_run  # noqa: F401 (s3_endpoint: fixture)
from jobs import cli
from sftdata import write as sft_output
from jobs.build_sft import main
from schemas.rows import rows_to_table


@pytest.fixture
def runs(tmp_path):
    """Two runs over prompts p1..p4. p1's best is in run B; 'same' is a duplicate text in both runs; p3 errored in
    A and is absent from B; p4 has only rejected, truncated and unscored candidates plus one finished one."""
    a = write_run(str(tmp_path / "bon"), [
        row("p1", [cand("a1", 1.0), cand("same", 2.0), cand("a3", 0.5)]),
        row("p2", [cand("b1", 3.0), cand("b2", 4.0, "length"), cand("b3", None, "rejected", partial=[0.2])]),
        err_row("p3"),
        row("p4", [cand("d1", 0.1), cand("d2", 9.0, "rejected"), cand("d3", None), cand("", 8.0)]),
    ], name="bon", method="best_of_n")
    b = write_run(str(tmp_path / "sr"), [
        row("p1", [cand("same", 2.5), cand("b-best", 5.0), cand("c3", -1.0, "rejected")],
            method="speculative_rejection"),
        row("p2", [cand("b1", 3.0), cand("e2", 2.0)], method="speculative_rejection"),
    ], name="sr", method="speculative_rejection")
    return a, b


def build(tmp_path, runs, *flags) -> tuple[int, list[dict], str]:
    out = str(tmp_path / f"out-{uuid.uuid4().hex[:6]}")
    code = main([*runs, "--out", out, *flags])
    rows = pq.read_table(os.path.join(out, "data")).to_pylist() if code == 0 else []
    return code, rows, out


def pick(rows) -> dict[str, list[tuple[str, float]]]:
    out: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        out.setdefault(r["prompt_id"], []).append((r["completion"][0]["content"], r["reward"]))
    return out


def test_best_pools_runs_and_drops_errors_rejected_truncated_unscored(tmp_path, runs):
    code, rows, _ = build(tmp_path, runs)
    assert code == 0
    assert pick(rows) == {"p1": [("b-best", 5.0)], "p2": [("b1", 3.0)], "p4": [("d1", 0.1)]}
    by_id = {r["prompt_id"]: r for r in rows}
    assert by_id["p1"]["source_run"] == "sr" and by_id["p1"]["source_method"] == "speculative_rejection"
    assert by_id["p4"]["source_run"] == "bon"


def test_top_k_sorted_with_duplicates_dropped(tmp_path, runs):
    code, rows, _ = build(tmp_path, runs, "--select", "top-k=3")
    assert code == 0
    got = pick(rows)
    # "same" appears in both runs: kept once, with the higher reward (run sr's 2.5).
    assert got["p1"] == [("b-best", 5.0), ("same", 2.5), ("a1", 1.0)]
    # "b1" is in both runs with reward 3.0: kept once, from the first run given.
    assert got["p2"] == [("b1", 3.0), ("e2", 2.0)]
    same = [r for r in rows if r["completion"][0]["content"] == "same"]
    assert len(same) == 1 and same[0]["source_run"] == "sr"
    b1 = [r for r in rows if r["completion"][0]["content"] == "b1"]
    assert len(b1) == 1 and b1[0]["source_run"] == "bon"


def test_min_reward(tmp_path, runs):
    code, rows, _ = build(tmp_path, runs, "--select", "top-k=5", "--min-reward", "2.5")
    assert code == 0
    assert pick(rows) == {"p1": [("b-best", 5.0), ("same", 2.5)], "p2": [("b1", 3.0)]}


def test_include_flags(tmp_path, runs):
    _, rows, _ = build(tmp_path, runs, "--include-truncated")
    assert pick(rows)["p2"] == [("b2", 4.0)]
    # A rejected candidate is only kept when it has a reward: d2 (9.0) yes, b3 (null) never.
    _, rows, _ = build(tmp_path, runs, "--include-rejected", "--select", "top-k=10")
    got = pick(rows)
    assert ("d2", 9.0) in got["p4"] and ("c3", -1.0) in got["p1"]
    assert all(text != "b3" for text, _ in got["p2"])
    _, rows, _ = build(tmp_path, runs, "--include-rejected", "--include-truncated")
    assert pick(rows) == {"p1": [("b-best", 5.0)], "p2": [("b2", 4.0)], "p4": [("d2", 9.0)]}


def test_trl_prompt_completion_shape_loads_both_ways(tmp_path, runs):
    code, _, out = build(tmp_path, runs, "--select", "top-k=2")
    assert code == 0
    disk = datasets.load_from_disk(os.path.join(out, "hf"))
    parquet = datasets.load_dataset("parquet", data_files=os.path.join(out, "data", "*.parquet"), split="train",
                                    cache_dir=str(tmp_path / "hf-cache"))
    for ds in (disk, parquet):
        assert ds.num_rows == 5
        assert {"prompt", "completion", "prompt_id", "reward", "source_run"} <= set(ds.column_names)
        for ex in ds:
            assert isinstance(ex["prompt"], list) and ex["prompt"]
            assert all(set(m) == {"role", "content"} for m in ex["prompt"])
            assert ex["prompt"][-1]["role"] == "user"
            assert len(ex["completion"]) == 1 and ex["completion"][0]["role"] == "assistant"
            assert isinstance(ex["completion"][0]["content"], str) and ex["completion"][0]["content"]
    assert disk["prompt_id"] == parquet["prompt_id"] == ["p1", "p1", "p2", "p2", "p4"]


def test_dataset_card_records_rule_sources_counts_rewards(tmp_path, runs):
    code, _, out = build(tmp_path, runs, "--select", "top-k=2", "--min-reward", "0")
    assert code == 0
    text = open(os.path.join(out, "README.md")).read()
    front = yaml.safe_load(text.split("---")[1])
    assert front["configs"][0]["data_files"][0]["path"] == "data/train-*.parquet"
    assert "`--select top-k=2` `--min-reward 0`" in text
    assert "| bon | best_of_n | `hash-bon` |" in text and "| sr | speculative_rejection | `hash-sr` |" in text
    assert "- prompts seen: 4 (errored in every run: 1)" in text
    assert "- reward: reward model `rm` (reward model score), the same for every source run" in text
    assert "- prompts kept: 3" in text
    # Seen: p1 3+3, p2 3+2, p4 4 = 15. Dropped: rejected b3 d2 c3; truncated b2; null reward d3; empty text "";
    # duplicates "same" and "b1"; below 0: none (c3 was already rejected); not selected: p1's a1 and a3.
    assert "- candidates seen: 15" in text
    for reason, n in {"rejected": 3, "truncated": 1, "null_reward": 1, "empty_text": 1, "duplicate": 2,
                      "below_min_reward": 0, "not_selected": 2}.items():
        assert f"(`{reason}`) | {n} |" in text, reason
    assert "| 5 | 0.1 | 2.52 | 2.5 | 5 |" in text  # kept rewards 5, 2.5, 3, 2, 0.1


def test_memory_filesystem_round_trip(runs):
    base = f"memory://sft-{uuid.uuid4().hex[:8]}"
    a = write_run(f"{base}/runs/a", [row("p1", [cand("x", 1.0), cand("y", 2.0)])], name="a")
    assert main([a, "--out", f"{base}/out"]) == 0
    ds = datasets.load_from_disk(f"{base}/out/hf")
    assert ds["completion"] == [[{"role": "assistant", "content": "y"}]]
    assert main([a, "--out", f"{base}/out"]) == 2


def test_s3_through_moto(s3_endpoint):
    s3fs = pytest.importorskip("s3fs")
    endpoint = s3_endpoint
    a = write_run("s3://winnow-test/runs/a", [row("p1", [cand("x", 1.0), cand("y", 2.0)])], name="a")
    assert main([a, "--out", "s3://winnow-test/sft"]) == 0
    ds = datasets.load_from_disk("s3://winnow-test/sft/hf", storage_options={"endpoint_url": endpoint})
    assert ds["completion"] == [[{"role": "assistant", "content": "y"}]]
    assert main([a, "--out", "s3://winnow-test/sft"]) == 2
    assert main([a, "--out", "s3://winnow-test/sft", "--overwrite", "--select", "top-k=2"]) == 0
    # (datasets.load_from_disk caches a remote path's download per process, so read the replaced files directly.)
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    with fs.open("winnow-test/sft/data/train-00000-of-00001.parquet", "rb") as f:
        assert pq.read_table(f).column("reward").to_pylist() == [2.0, 1.0]
    assert "`--select top-k=2`" in fs.cat("winnow-test/sft/README.md").decode()
    assert not [p for p in fs.ls("winnow-test") if ".tmp-" in p or ".old-" in p]


# ---------------------------------------------------------------------------------------------------------------
# Bad input: exit 2, a message naming the path or flag, nothing written.


@pytest.mark.parametrize("case", ["missing", "no-manifest", "no-candidates", "bad-select", "bad-manifest"])
def test_bad_input_exit_2_names_path_writes_nothing(tmp_path, runs, capsys, case):
    target = runs[0]
    args = [runs[0], runs[1]]
    if case == "missing":
        target = str(tmp_path / "nope")
        args.append(target)
    elif case == "no-manifest":
        os.remove(os.path.join(runs[1], "manifest.json"))
        target = os.path.join(runs[1], "manifest.json")
    elif case == "no-candidates":
        (tmp_path / "empty" / "candidates").mkdir(parents=True)
        write_run(str(tmp_path / "empty"), [], name="empty")
        target = str(tmp_path / "empty") + "/candidates"
        args.append(str(tmp_path / "empty"))
    elif case == "bad-select":
        args += ["--select", "top-k=0"]
        target = "--select 'top-k=0'"
    elif case == "bad-manifest":
        with open(os.path.join(runs[1], "manifest.json"), "w") as f:
            f.write('{"name": "sr", "config": {"method": {}}, "config_hash": "h"}')
        target = os.path.join(runs[1], "manifest.json")
    out = tmp_path / "out"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert target in err
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_existing_out_refused_unless_overwrite(tmp_path, runs, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main([*runs, "--out", str(out)]) == 2
    assert str(out) in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["keep.txt"]
    # --overwrite replaces only what a winnow command wrote: a user's file is named and kept (issue 26)
    assert main([*runs, "--out", str(out), "--overwrite"]) == 2
    assert "keep.txt" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["keep.txt"]
    empty = tmp_path / "empty-out"
    empty.mkdir()
    assert main([*runs, "--out", str(empty)]) == 0
    assert sorted(os.listdir(empty)) == [".winnow-output.json", "README.md", "data", "hf"]
    assert main([*runs, "--out", str(empty)]) == 2  # its own earlier output: replaced only with --overwrite
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    assert main([*runs, "--out", str(empty), "--overwrite"]) == 0
    (empty / "hf" / "notes.txt").write_text("mine")  # a user's file inside the output
    assert main([*runs, "--out", str(empty), "--overwrite"]) == 2
    assert "hf/notes.txt" in capsys.readouterr().err and (empty / "hf" / "notes.txt").read_text() == "mine"


def test_selection_that_keeps_nothing_is_bad_input(tmp_path, runs, capsys):
    assert main([*runs, "--out", str(tmp_path / "out"), "--min-reward", "100"]) == 2
    err = capsys.readouterr().err
    assert "no candidate passed the selection" in err and runs[0] in err and "below_min_reward=7" in err
    assert not (tmp_path / "out").exists()


def test_winnow_cli_dispatches_build_sft(tmp_path, runs):
    assert cli.main(["build-sft", "--help"]) == 0
    assert cli.main(["build-sft", *runs, "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "hf" / "dataset_info.json").is_file()


def test_extra_fields_tolerated_missing_fields_refused(tmp_path, capsys):
    table = rows_to_table([row("p1", [cand("x", 1.0), cand("y", 2.0)])])
    cands = table.column("candidates").combine_chunks()
    for name, kept in (("extra", None), ("no-reward", "reward")):
        fields = [cands.values.field(i) for i in range(cands.values.type.num_fields)]
        names = [f.name for f in cands.values.type]
        if kept is None:
            fields.append(pa.array(["note"] * len(cands.values)))
            names.append("note")
        else:
            i = names.index(kept)
            del fields[i], names[i]
        values = pa.StructArray.from_arrays(fields, names=names)
        new = table.set_column(3, "candidates", pa.ListArray.from_arrays(cands.offsets, values))
        new = new.append_column("shard", pa.array([7], pa.int64()))
        uri = write_run(str(tmp_path / name), [], name=name)
        os.makedirs(os.path.join(uri, "candidates"), exist_ok=True)
        pq.write_table(new, os.path.join(uri, "candidates", "0.parquet"))
        code = main([uri, "--out", str(tmp_path / f"out-{name}")])
        if kept is None:
            assert code == 0
        else:
            assert code == 2
            assert f"{uri}/candidates: fields ['candidates[].reward'] missing" in capsys.readouterr().err


@pytest.mark.parametrize("other", [{"kind": "logprob"}, {"kind": "lexical"}, {"kind": "model", "path": "rm-2"},
                                   {"kind": "python", "function": "pkg.mod:score"}])
def test_runs_scored_by_different_rewards_are_refused_by_name(tmp_path, runs, capsys, other):
    """Pooling keeps the highest reward per prompt across runs: across two reward scales that picks nothing
    meaningful, so build-sft refuses, naming every run and its reward definition."""
    odd = write_run(str(tmp_path / "odd"), [row("p1", [cand("z", 99.0)])], name="odd", reward=other)
    out = tmp_path / "out"
    assert main([*runs, odd, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the runs are scored by 2 different reward definitions" in err
    assert f"reward model `rm`: bon ({runs[0]}), sr ({runs[1]})" in err
    what = {"logprob": "logprob under the target `builtin:tiny-target`", "lexical": "lexical coverage of the "
            "`concepts` column", "model": "reward model `rm-2`", "python": "python reward `pkg.mod:score`"}
    assert f"{what[other['kind']]}: odd ({odd})" in err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("out")]
    # the same reward model spelled another way is one reward
    same = write_run(str(tmp_path / "same"), [row("p1", [cand("z", 9.0)])], name="same",
                     reward={"kind": "model", "path": "./rm/"})
    assert main([*runs, same, "--out", str(out)]) == 0


def test_same_prompt_id_with_different_prompts_refused(tmp_path, runs, capsys):
    other = write_run(str(tmp_path / "other"), [row("p1", [cand("z", 1.0)], prompt="a different question")],
                      name="other")
    assert main([runs[0], other, "--out", str(tmp_path / "out")]) == 2
    assert "prompt_id 'p1'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_failure_while_writing_leaves_nothing(tmp_path, runs, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(sft_output.datasets.Dataset, "save_to_disk", boom)
    assert main([*runs, "--out", str(tmp_path / "out")]) == 1
    assert "disk full" in capsys.readouterr().err
    assert [p for p in os.listdir(tmp_path) if p.startswith("out")] == []


def test_only_files_with_a_committed_checkpoint_are_read(tmp_path):
    """A run folder with Ray Data's `_checkpoint/` (as `winnow generate` writes) contributes only the data files
    whose checkpoint is committed: a file whose write was cut short (pending checkpoint) is not read."""
    uri = write_run(str(tmp_path / "run"), [row("p1", [cand("kept", 1.0)]), row("p2", [cand("half", 2.0)])],
                    files=2)
    ckpt = tmp_path / "run" / "_checkpoint"
    ckpt.mkdir()
    pq.write_table(pa.table({"prompt_id": ["p1"]}), ckpt / "part-00000.parquet")
    pq.write_table(pa.table({"prompt_id": ["p2"]}), ckpt / "part-00001.pending.parquet")
    code, rows, _ = build(tmp_path, [uri])
    assert code == 0
    assert pick(rows) == {"p1": [("kept", 1.0)]}
