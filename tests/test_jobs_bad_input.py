"""Bad input fails cleanly: exit status 2, a message naming the field, file or column, and no run folder."""

from __future__ import annotations

import pytest

from conftest import job_config, write_config, write_jsonl
from conftest_runs import s3_endpoint  # noqa: F401 (fixture)
from jobs import generate


def run(tmp_path, capsys, cfg: dict | None = None, text: str | None = None, extra: list[str] = ()):
    path = tmp_path / "job.yaml"
    if text is not None:
        path.write_text(text)
    else:
        write_config(path, cfg)
    status = generate.main([str(path), *extra])
    err = capsys.readouterr().err
    return status, err


def assert_clean(tmp_path, status, err, *needles):
    assert status == 2, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    assert not (tmp_path / "run").exists(), "a bad input must leave no run folder"


def test_malformed_yaml(tmp_path, capsys):
    status, err = run(tmp_path, capsys, text="name: x\ndata: {source: [unclosed\n")
    assert_clean(tmp_path, status, err, "job.yaml: malformed YAML at line 3, column 1")


def test_missing_config_file(tmp_path, capsys):
    assert generate.main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: config file not found" in capsys.readouterr().err


def test_unknown_keys_wrong_types_and_ranges_all_at_once(tmp_path, capsys):
    cfg = job_config(tmp_path)
    cfg["resources"] = {"workers": 0, "prompts_per_batch": "four"}  # old names: each problem names the key as written
    cfg["data"]["sorce"] = "x"
    cfg["method"]["n"] = -1
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err, "data.sorce: unknown key", "resources.workers: Input should be greater than "
                 "or equal to 1", "resources.prompts_per_batch: Input should be a valid integer",
                 "method.n: Input should be greater than or equal to 1")


def test_bad_set_override(tmp_path, capsys):
    status, err = run(tmp_path, capsys, job_config(tmp_path), extra=["--set", "method.n"])
    assert_clean(tmp_path, status, err, "--set 'method.n': expected KEY=VALUE")
    status, err = run(tmp_path, capsys, job_config(tmp_path), extra=["--set", "method.n=zero"])
    assert_clean(tmp_path, status, err, "method.n: Input should be a valid integer")


def test_bad_arguments(tmp_path, capsys):
    assert generate.main([]) == 2
    assert "the following arguments are required: CONFIG" in capsys.readouterr().err
    assert generate.main(["a.yaml", "--frobnicate"]) == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_missing_model_folders_are_all_named(tmp_path, capsys):
    no_config = tmp_path / "empty-model"
    no_config.mkdir()
    cfg = job_config(tmp_path, models={"target": str(tmp_path / "absent"), "draft": "builtin:tiny-nope",
                                       "reward": {"kind": "model", "path": str(no_config)}})
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err, f"models.target: {tmp_path / 'absent'} does not exist",
                 "models.draft: unknown builtin asset 'tiny-nope'; known: demo-prompts",
                 f"models.reward.path: {no_config} is not a Hugging Face model folder (no config.json in it)")


def test_unimportable_python_reward(tmp_path, capsys):
    cfg = job_config(tmp_path, models={"reward": {"kind": "python", "function": "no_such_module_x:score"}})
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err, "models.reward.function: cannot import 'no_such_module_x'")


def test_absent_data(ray_session, tmp_path, capsys):
    cfg = job_config(tmp_path, data={"source": str(tmp_path / "prompts.jsonl")})
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err, f"data.source: {tmp_path / 'prompts.jsonl'}: no such file or folder")


def test_unreadable_data(ray_session, tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": ]\n')
    status, err = run(tmp_path, capsys, job_config(tmp_path, data={"source": str(bad)}))
    assert_clean(tmp_path, status, err, f"data.source: {bad}: line 2 is not valid JSON (Expecting value, column 23)")


@pytest.mark.parametrize("data, reward, needle", [
    ({"prompt_column": "question"}, None, "data.prompt_column: column 'question' is not in"),
    ({"id_column": "uid"}, None, "data.id_column: column 'uid' is not in"),
    ({}, {"kind": "lexical", "concepts_column": "keywords"},
     "models.reward.concepts_column: column 'keywords' is not in"),
    ({"prompt_column": "n"}, None, "data.prompt_column: column 'n' of"),
])
def test_missing_or_mistyped_columns(ray_session, tmp_path, capsys, data, reward, needle):
    src = write_jsonl(tmp_path / "prompts.jsonl",
                      [{"id": "a", "prompt": "x", "n": 1, "concepts": ["a"]}, {"id": "b", "prompt": "y", "n": 2,
                                                                                "concepts": ["b"]}])
    cfg = job_config(tmp_path, data={"source": str(src), **data})
    if reward:
        cfg["models"]["reward"] = reward
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err, needle, str(src), "(columns: id, prompt, n, concepts)"
                 if "not in" in needle else "expected a string or a list of {role, content} messages")


def test_bad_data_with_overwrite_leaves_the_old_run_alone(ray_session, tmp_path, capsys):
    from runfolder.folder import RunFolder
    from runfolder.manifest import new_manifest
    from schemas.config import validate_config

    old = tmp_path / "run"
    RunFolder(str(old)).write_manifest(new_manifest(validate_config(job_config(tmp_path, seed=9)), prompts=4))
    before = (old / "manifest.json").read_text()
    cfg = job_config(tmp_path, data={"source": str(tmp_path / "absent.jsonl")})
    status, err = run(tmp_path, capsys, cfg, extra=["--overwrite"])
    assert status == 2 and "data.source" in err
    assert [p.name for p in old.iterdir()] == ["manifest.json"] and (old / "manifest.json").read_text() == before


def test_overwrite_refuses_a_folder_whose_manifest_is_not_winnows(tmp_path, capsys):
    old = tmp_path / "run"
    old.mkdir()
    (old / "manifest.json").write_text("{}")  # some other tool's manifest
    (old / "results.csv").write_text("precious")
    status, err = run(tmp_path, capsys, job_config(tmp_path), extra=["--overwrite"])
    assert status == 2, err
    assert f"output.path: {old}/manifest.json is not a Winnow manifest" in err and "even with --overwrite" in err
    assert "pass --overwrite" not in err
    assert sorted(p.name for p in old.iterdir()) == ["manifest.json", "results.csv"]
    assert (old / "results.csv").read_text() == "precious" and (old / "manifest.json").read_text() == "{}"


def test_a_truncated_parquet_source_exits_2_naming_the_file(ray_session, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": f"p{i}", "prompt": f"Say {i}."} for i in range(20)]), src)
    src.write_bytes(src.read_bytes()[:-40])  # cut short: the footer is gone
    status, err = run(tmp_path, capsys, job_config(tmp_path, data={"source": str(src)}))
    assert_clean(tmp_path, status, err, f"data.source: {src}: not a readable parquet file (ArrowInvalid: ")


def test_an_output_path_under_a_file_exits_2_before_ray_starts(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a folder")
    cfg = job_config(tmp_path, output={"path": str(tmp_path / "taken" / "run")})
    status, err = run(tmp_path, capsys, cfg)
    assert status == 2, err
    assert f"output.path: {tmp_path / 'taken' / 'run'} cannot be created: {tmp_path / 'taken'} is a file" in err
    assert (tmp_path / "taken").read_text() == "not a folder"


SUBMITTED = '{"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}, "metadata": {}}'


def test_under_ray_job_submit_paths_inside_the_working_dir_copy_exit_2(tmp_path, capsys, monkeypatch):
    """As `ray job submit --working-dir .` starts the entry point: inside Ray's unpacked copy, with the job's
    runtime_env in RAY_JOB_CONFIG_JSON_ENV_VAR. A relative output.path or data.source would live in that copy."""
    workdir = tmp_path / "_ray_pkg_0123456789abcdef"
    workdir.mkdir()
    write_jsonl(workdir / "prompts.jsonl", [{"id": "a", "prompt": "hi"}])
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", SUBMITTED)
    cfg = job_config(tmp_path, output={"path": "runs/x"}, data={"source": "prompts.jsonl", "limit": None})
    status, err = run(tmp_path, capsys, cfg)
    assert status == 2, err
    assert f"output.path: 'runs/x' is inside Ray's copy of this job's working directory ({workdir})" in err
    assert "data.source: 'prompts.jsonl' is inside Ray's copy" in err and "--allow-working-dir-paths" in err
    assert not (workdir / "runs").exists()
    inside = job_config(tmp_path, output={"path": str(workdir / "abs")})  # absolute, but still inside the copy
    status, err = run(tmp_path, capsys, inside)
    assert status == 2 and "output.path: " in err and "inside Ray's copy" in err
    from pipeline import job
    from schemas.config import validate_config

    plan = job.check(validate_config(cfg), overwrite=False, allow_working_dir=True)  # the user's opt-in
    assert plan.mode == "new" and plan.folder.uri == str(workdir / "runs" / "x")


def test_paths_outside_the_working_dir_copy_or_not_under_ray_job_submit_pass(tmp_path, monkeypatch):
    from pipeline.preflight import working_dir_problems
    from schemas.config import validate_config

    workdir = tmp_path / "pkg"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    relative = validate_config(job_config(tmp_path, output={"path": "runs/x"}))
    assert working_dir_problems(relative, environ={}) == []  # a laptop run: relative paths are the user's own
    env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": SUBMITTED}
    assert len(working_dir_problems(relative, environ=env)) == 1
    for path in (str(tmp_path / "elsewhere"), "s3://bucket/runs/x", "../outside"):
        ok = validate_config(job_config(tmp_path, output={"path": path}))
        assert working_dir_problems(ok, environ=env) == [], path
    no_dir = {"RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": {}, "metadata": {}}'}  # submitted without one
    assert working_dir_problems(relative, environ=no_dir) == []


def test_a_bad_store_setting_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WINNOW_S3_MAX_ATTEMPTS", "many")
    status, err = run(tmp_path, capsys, job_config(tmp_path, output={"path": "s3://bucket/runs/x"}))
    assert status == 2, err
    assert "output.path: s3://bucket/runs/x: WINNOW_S3_MAX_ATTEMPTS='many': expected a whole number of attempts" in err


# ---------------------------------------------------------------------------------------------------------------
# Issue 22, group 4: the true cause, the file and the line, found before Ray starts where the driver can


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if `winnow generate` gets as far as starting or joining Ray."""
    from pipeline import job

    monkeypatch.setattr(job, "connect", lambda: pytest.fail("bad input must be found before Ray starts"))


@pytest.mark.parametrize("content, problem", [
    (b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "caf\xe9"}\n',
     "line 2 is not UTF-8 text (invalid continuation byte at byte 53)"),
    (b'{"id": "a", "prompt": "x"}\n\n{"id": "b", "prompt": "half \\ud83d of a pair"}\n',
     "line 3 holds a lone surrogate \\ud83d in a string"),
    (b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": ]\n', "line 2 is not valid JSON (Expecting value, column 23)"),
    (b'{"id": "a", "prompt": "x"}\n["b", "y"]\n', "line 2 is a JSON list; expected an object (one row per line)"),
])
def test_a_bad_jsonl_is_named_by_file_and_line_before_ray_starts(tmp_path, capsys, no_ray, content, problem):
    src = tmp_path / "prompts.jsonl"
    src.write_bytes(content)
    status, err = run(tmp_path, capsys, job_config(tmp_path, data={"source": str(src)}))
    assert_clean(tmp_path, status, err, f"data.source: {src}: {problem}")
    assert "Traceback" not in err


def test_missing_columns_and_cut_parquet_are_found_before_ray_starts(tmp_path, capsys, no_ray):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = write_jsonl(tmp_path / "p.jsonl", [{"uid": "a", "question": "x"}])
    status, err = run(tmp_path, capsys, job_config(tmp_path, data={"source": str(src)}))
    assert_clean(tmp_path, status, err, f"data.prompt_column: column 'prompt' is not in {src} (columns: uid, question)",
                 f"data.id_column: column 'id' is not in {src}")
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(pa.table({"id": ["a"], "prompt": ["x"]}), folder / "a.parquet")
    pq.write_table(pa.table({"id": ["b"], "prompt": ["y"]}), folder / "b.parquet")
    (folder / "b.parquet").write_bytes((folder / "b.parquet").read_bytes()[:-30])
    status, err = run(tmp_path, capsys, job_config(tmp_path, data={"source": str(folder)}))
    assert_clean(tmp_path, status, err, f"data.source: {folder / 'b.parquet'}: not a readable parquet file (")


def test_a_missing_s3_bucket_is_named_as_missing(s3_endpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WINNOW_S3_MAX_ATTEMPTS", "1")
    cfg = job_config(tmp_path, output={"path": "s3://no-such-bucket/runs/x"},
                     data={"source": "s3://no-such-bucket-either/prompts.jsonl"},
                     models={"draft": "s3://no-such-bucket/models/draft"})
    status, err = run(tmp_path, capsys, cfg)
    assert status == 2, err
    for field, bucket in (("output.path: s3://no-such-bucket/runs/x", "no-such-bucket"),
                          ("data.source: s3://no-such-bucket-either/prompts.jsonl", "no-such-bucket-either"),
                          ("models.draft: s3://no-such-bucket/models/draft", "no-such-bucket")):
        assert f"{field}: the bucket {bucket!r} does not exist (or these credentials cannot see it)" in err, err
    assert "does not answer" not in err
    from jobs import report
    from conftest_runs import cand, row, write_run

    run_dir = write_run(str(tmp_path / "r"), [row("p0", [cand("a", 1.0)])])
    assert report.main([run_dir, "s3://no-such-bucket/r2", "--out", "s3://no-such-bucket/rep"]) == 2
    err = capsys.readouterr().err
    assert "s3://no-such-bucket/r2: the bucket 'no-such-bucket' does not exist" in err
    assert "--out s3://no-such-bucket/rep: the bucket 'no-such-bucket' does not exist" in err


@pytest.mark.parametrize("function", ["reward_fixtures:async_score", "reward_fixtures:async_object"])
def test_an_async_python_reward_is_refused_before_the_run(tmp_path, capsys, no_ray, function):
    cfg = job_config(tmp_path, models={"reward": {"kind": "python", "function": function}})
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err, f"models.reward.function: {function} is an async function (async def)",
                 "asyncio.run(")


def test_a_config_path_that_is_a_folder(tmp_path, capsys):
    assert generate.main([str(tmp_path)]) == 2
    assert f"{tmp_path}: is a folder, not a config file" in capsys.readouterr().err


def test_cut_weights_and_hub_ids_are_answered_with_the_fix(tmp_path, capsys, no_ray):
    import shutil

    import assets

    target = tmp_path / "target"
    shutil.copytree(assets.builtin_path("tiny-target"), target)
    whole = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    cfg = job_config(tmp_path, models={"target": str(target), "draft": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    status, err = run(tmp_path, capsys, cfg)
    assert_clean(tmp_path, status, err,
                 f"models.target: {target}/model.safetensors is cut short: {len(whole) // 2} bytes where its header "
                 f"describes {len(whole)}; download the model again",
                 "models.draft: HuggingFaceTB/SmolLM2-135M-Instruct is not a folder here; it looks like a Hugging Face "
                 "Hub id", "`hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR`",
                 "set models.draft: DIR")


@pytest.mark.slow
def test_a_bad_line_of_a_remote_source_is_one_clear_line_without_ray_tracebacks(s3_endpoint, tmp_path):  # noqa: F811
    """A remote file is read by Ray (the driver does not download it first); its bad line is still named by file and
    line, and what Ray and its workers log about the failed read (tracebacks, the reader's fallback) is not shown."""
    import s3fs

    from conftest import winnow

    s3fs.S3FileSystem().pipe_file("winnow-test/src/p.jsonl", b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": ]\n')
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, data={"source": "s3://winnow-test/src/p.jsonl"}))
    out = winnow("generate", str(cfg))
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "data.source: s3://winnow-test/src/p.jsonl: line 2 is not valid JSON (Expecting value, column 23)" in text
    for noise in ("Traceback", "Exception occurred", "json.load", "ERROR", "File \""):
        assert noise not in text, text[-3000:]
    assert not (tmp_path / "run").exists()


def test_overwrite_of_a_run_folder_holding_a_users_files_is_refused_and_deletes_nothing(tmp_path, capsys):
    """Issue 26: `winnow generate --overwrite` on a finished run folder into which the user had put notes.txt and
    analysis/ deleted both. It names them now and exits 2; not a byte of the folder changes."""
    from runfolder.folder import RunFolder
    from runfolder.manifest import new_manifest
    from schemas.config import validate_config

    old = tmp_path / "run"
    RunFolder(str(old)).write_manifest(new_manifest(validate_config(job_config(tmp_path, seed=9)), prompts=4))
    (old / "notes.txt").write_text("mine")
    (old / "analysis").mkdir()
    (old / "analysis" / "fig.png").write_bytes(b"png")
    before = {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    status, err = run(tmp_path, capsys, job_config(tmp_path), extra=["--overwrite"])
    assert status == 2, err
    assert "holds what Winnow did not write: analysis/, notes.txt" in err
    assert {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()} == before


LAUGHS = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [
    f"&{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
BILLION_LAUGHS = "name: x\n" + "".join(f"{v[1]}: {v}\n" for v in LAUGHS)


@pytest.mark.parametrize("text, value, why", [
    (BILLION_LAUGHS, "[" + ", ".join(LAUGHS) + "]", "its aliases expand it to more than 100,000 values"),
    ("name: &x [1, *x]\n", "&x [1, *x]", "an alias refers to a value that contains it"),
    ("name: " + "[" * 5000 + "]" * 5000 + "\n", "[" * 5000 + "]" * 5000, "nested too deeply to parse"),
])
def test_a_yaml_that_would_expand_without_bound_is_refused_at_once(tmp_path, text, value, why):
    """Issue 26: nine levels of aliases in a 1 KB file passed the parser and were expanded when the config was
    copied (11 GB in 90 s and growing). Refused now from the parsed node graph, for generate and validate alike;
    the subprocesses' timeout is the bound on time (an expansion would take minutes and gigabytes)."""
    from conftest import winnow

    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert len(text) < 20_000
    for args in (["validate", "--schema-only", str(path)], ["generate", str(path)],
                 ["validate", "--schema-only", "configs/quickstart.yaml", "--set", f"name={value}"]):
        done = winnow(*args, timeout=60)
        assert done.returncode == 2, done.stderr
        assert why in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_a_seed_the_run_cannot_use_exits_2_before_anything_is_written(tmp_path, capsys):
    """Issue 26: a seed of 2^70 was accepted, then failed with OverflowError after the run folder was made."""
    status, err = run(tmp_path, capsys, job_config(tmp_path, seed=2**70))
    assert_clean(tmp_path, status, err, "seed: Input should be less than or equal to 9223372036854775807")
    status, err = run(tmp_path, capsys, job_config(tmp_path, seed=2**32, models={"engine": "vllm"}))
    assert_clean(tmp_path, status, err, "seed: 4294967296 is above 4294967295 (2^32 - 1), the largest seed vLLM takes")
