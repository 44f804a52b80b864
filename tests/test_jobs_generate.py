"""`winnow generate` end to end on the bundled trio: output, resume exactly once, refusal, per-row errors, crashes."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, job_config, kill_once_committed, winnow, write_config, write_jsonl
from jobs import generate
from schemas.rows import ROW_SCHEMA

pytestmark = pytest.mark.slow

DEMO = [json.loads(line) for line in (Path(__import__("assets").builtin_path("demo-prompts")) / "prompts.jsonl")
        .read_text().splitlines() if line.strip()]


def rows_of(run: Path) -> list[dict]:
    return pads.dataset(str(run / "candidates"), format="parquet").to_table().to_pylist()


def manifest_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def test_quickstart_on_two_local_workers(tmp_path):
    """The shipped quickstart, as a user runs it: its own local Ray, 2 actors, 6 prompts; then again (resume)."""
    run = tmp_path / "quickstart"
    args = ["generate", "configs/quickstart.yaml", "--set", "resources.actors=2", "--set", "data.limit=6",
            "--set", f"output.path={run}"]
    as_users = {"WINNOW_RAY_DASHBOARD": "1"}  # the tests' other runs go without Ray's dashboard (conftest)
    first = winnow(*args, env=as_users)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = rows_of(run)
    assert sorted(r["prompt_id"] for r in rows) == sorted(d["id"] for d in DEMO[:6])
    assert pq.read_schema(next((run / "candidates").glob("*.parquet"))).equals(ROW_SCHEMA)
    m = manifest_of(run)
    for r in rows:
        assert r["error"] is None and r["method"] == "speculative_rejection"
        assert len(r["candidates"]) == m["config"]["method"]["n"]
        assert r["best_text"] == r["candidates"][r["best_index"]]["text"]
        assert (r["run_name"], r["config_hash"]) == ("quickstart", m["config_hash"])  # which run, on every row
    rejected = [c for r in rows for c in r["candidates"] if c["finish_reason"] == "rejected"]
    assert rejected and all(c["reward"] is None for c in rejected)  # Speculative Rejection did cut candidates
    assert (m["status"], m["rows"], m["errors"], m["name"]) == ("succeeded", 6, 0, "quickstart")
    assert m["config"]["resources"]["actors"] == 2 and m["finished_at"] >= m["started_at"]
    device_s = sum(r["cost"]["device_seconds"] for r in rows)
    assert m["cost"]["device_seconds"] == pytest.approx(device_s)
    assert m["cost"]["usd"] == pytest.approx(device_s / 3600 * 2.0)
    table = first.stdout
    assert ("| prompts | errors | mean best reward | generated tokens | candidates | rejected | device-seconds | USD"
            in table)
    generated = sum((r["stats"] or {}).get("generated_tokens") or 0 for r in rows)
    cells = [c.strip() for c in table.split("|---")[-1].splitlines()[1].split("|")[1:-1]]
    assert cells[:6] == ["6", "0", f"{sum(r['best_reward'] for r in rows) / 6:.4f}", str(generated),
                         str(6 * m["config"]["method"]["n"]), str(len(rejected))]
    assert "no candidate was rejected" not in table
    # quiet by default: no Ray Data progress or INFO lines, no model-loading bars, no deprecation warnings, and
    # the driver says it started its own Ray
    assert "winnow generate: started a local Ray (" in first.stdout
    for noise in ("INFO", "Loading weights", "RayDeprecationWarning", "Running Dataset", "joined the Ray cluster",
                  "Token authentication", "progress:"):
        assert noise not in first.stdout + first.stderr, noise

    files = sorted(p.name for p in (run / "candidates").iterdir())
    again = winnow(*args, "--verbose", env={"RAY_ADDRESS": "local", **as_users})  # RAY_ADDRESS=local starts a Ray
    assert again.returncode == 0, again.stderr[-3000:]
    assert "6 already written; nothing left to generate" in again.stdout
    assert "winnow generate: started a local Ray (" in again.stdout and "joined" not in again.stdout
    assert "Started a local Ray instance" in again.stdout + again.stderr  # Ray's INFO line, with --verbose
    assert "View the dashboard at" in again.stdout + again.stderr  # a user's local Ray has its dashboard
    assert sorted(p.name for p in (run / "candidates").iterdir()) == files
    assert manifest_of(run)["rows"] == 6


def test_a_local_ray_goes_without_the_dashboard_only_where_asked(monkeypatch):
    from pipeline.raydata import ray_init_options

    monkeypatch.delenv("WINNOW_RAY_DASHBOARD", raising=False)
    assert "include_dashboard" not in ray_init_options(True)  # Ray's default: the dashboard where it is installed
    for off in ("0", "false", "Off"):
        monkeypatch.setenv("WINNOW_RAY_DASHBOARD", off)
        assert ray_init_options(True)["include_dashboard"] is False
    monkeypatch.setenv("WINNOW_RAY_DASHBOARD", "1")
    assert "include_dashboard" not in ray_init_options(True)
    monkeypatch.setenv("WINNOW_RAY_DASHBOARD", "0")
    assert "include_dashboard" not in ray_init_options(False)  # a cluster joined keeps its own (ray.init refuses it)


def test_changed_config_is_refused_and_overwrite_replaces_it(ray_session, tmp_path, capsys):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, data={"limit": 2}))
    assert generate.main([str(cfg)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    capsys.readouterr()
    assert generate.main([str(cfg), "--set", "method.n=2"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of a different config" in err and "changed: method.n" in err
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
    assert generate.main([str(cfg), "--set", "method.n=2", "--overwrite"]) == 0
    rows = rows_of(tmp_path / "run")
    assert len(rows) == 2 and all(len(r["candidates"]) == 2 for r in rows)
    assert manifest_of(tmp_path / "run")["config"]["method"]["n"] == 2


def test_rows_that_cannot_run_become_error_rows(ray_session, tmp_path):
    long_prompt = "Write a sentence using these concepts: " + " ".join(["dog"] * 400)
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "ok-1", "prompt": DEMO[0]["prompt"], "concepts": DEMO[0]["concepts"]},
        {"id": "empty", "prompt": "   ", "concepts": ["a"]},
        {"id": "ok-1", "prompt": DEMO[1]["prompt"], "concepts": DEMO[1]["concepts"]},
        {"id": "long", "prompt": long_prompt, "concepts": ["dog"]},
        {"id": "no-concepts", "prompt": DEMO[2]["prompt"], "concepts": None},
        {"id": "ok-2", "prompt": DEMO[3]["prompt"], "concepts": DEMO[3]["concepts"]},
    ])
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"source": str(src), "limit": None},
        models={"reward": {"kind": "lexical", "concepts_column": "concepts"}}, method={"name": "best_of_n", "n": 2}))
    assert generate.main([str(cfg)]) == 0
    rows = {r["prompt_id"]: r for r in rows_of(tmp_path / "run")}
    assert sorted(rows) == ["empty", "long", "no-concepts", "ok-1", "ok-1#dup1", "ok-2"]
    assert rows["empty"]["error"] == "empty prompt: every message is blank"
    assert rows["ok-1#dup1"]["error"] == "duplicate prompt_id 'ok-1': first seen at row 0; only that one runs"
    assert rows["ok-1#dup1"]["prompt"][0]["content"] == DEMO[1]["prompt"]
    assert "the target's context is 256 tokens" in rows["long"]["error"]
    assert rows["no-concepts"]["error"] == "concepts column 'concepts' is null"
    for ok in ("ok-1", "ok-2"):
        assert rows[ok]["error"] is None and 0.0 <= rows[ok]["best_reward"] <= 1.0
    assert all(rows[k]["candidates"] == [] for k in ("empty", "long", "no-concepts", "ok-1#dup1"))
    m = manifest_of(tmp_path / "run")
    assert (m["status"], m["rows"], m["errors"], m["prompts"]) == ("succeeded", 6, 4, 6)


def exploding_reward_config(tmp_path):
    return job_config(tmp_path, models={"reward": {"kind": "python", "function": "conftest:exploding_reward"}})


def test_an_engine_failure_fails_the_job_loudly(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", exploding_reward_config(tmp_path))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = winnow("generate", str(cfg), env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("winnow generate: the job failed: RuntimeError: models.reward.function: conftest:exploding_reward raised "
            "RuntimeError: reward service unavailable (at ") in proc.stderr, proc.stderr[-3000:]
    m = manifest_of(tmp_path / "run")
    assert m["status"] == "failed" and "reward service unavailable" in m["error"] and m["finished_at"]


def test_sigkill_then_resume_writes_each_prompt_exactly_once(tmp_path):
    run = tmp_path / "run"
    demo = DEMO[:12]  # a call per prompt: the kill lands after the first
    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"limit": len(demo)}, method={"name": "best_of_n", "n": 8}, generation={"max_new_tokens": 32},
        resources={"actors": 1, "prompts_per_call": 1}))
    kill_once_committed(cfg, run, tmp_path / "first.log", timeout=300)
    written_before = len({r["prompt_id"] for r in rows_of(run)}) if (run / "candidates").exists() else 0
    assert 0 < written_before < len(demo), f"the kill should land mid-run; {written_before} rows were written"
    assert manifest_of(run)["status"] == "running"

    second = winnow("generate", str(cfg))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming 'test'" in second.stdout
    # issue 26: a resume printed Ray's core_worker.cc error about Ray Data's checkpoint filter actor
    # (pipeline.raydata.native_noise_dropped), and every run Ray's token-authentication warning
    for noise in ("core_worker.cc", "CheckpointFilter", "Token authentication", "Traceback"):
        assert noise not in second.stdout + second.stderr, second.stderr[-3000:]
    ids = [r["prompt_id"] for r in rows_of(run)]
    assert collections.Counter(ids) == collections.Counter(d["id"] for d in demo)  # every prompt exactly once
    m = manifest_of(run)
    assert (m["status"], m["rows"], m["prompts"]) == ("succeeded", len(demo), len(demo))


def test_a_write_cut_short_is_rolled_back_and_redone(ray_session, tmp_path):
    """A crash between a data file's write and its checkpoint's commit: the next run deletes it and redoes it."""
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, data={"limit": 4},
                                                         resources={"prompts_per_call": 1}))
    assert generate.main([str(cfg)]) == 0
    run = tmp_path / "run"
    committed = sorted((run / "_checkpoint").glob("*.parquet"))
    victim = committed[0]
    victim_ids = pq.read_table(victim).column("prompt_id").to_pylist()
    data_files = [p for p in (run / "candidates").glob("*.parquet") if p.name.startswith(victim.stem + "-")]
    assert len(data_files) == 1
    victim.rename(victim.with_name(victim.stem + ".pending.parquet"))  # as if killed before the commit
    assert generate.main([str(cfg)]) == 0
    assert not data_files[0].exists()  # the uncommitted data file was deleted...
    ids = [r["prompt_id"] for r in rows_of(run)]
    assert sorted(ids) == sorted(d["id"] for d in DEMO[:4])  # ...and its prompts written again, once
    assert set(victim_ids) <= set(ids)
    assert not list((run / "_checkpoint").glob("*.pending.parquet"))


def test_a_run_folder_written_under_the_old_names_resumes(ray_session, tmp_path, capsys):
    """A run folder of the release before the settings' renames holds its config under the old names
    (`resources.workers`, `prompts_per_batch`, ...). Run again, with the config under either spelling, it resumes
    (the hash is the same: `schemas.compat`): the work left is done, each prompt once."""
    cfg = job_config(tmp_path, data={"limit": 4}, resources={"prompts_per_call": 1})
    assert generate.main([str(write_config(tmp_path / "new.yaml", cfg))]) == 0
    run = tmp_path / "run"
    manifest = manifest_of(run)  # as the release before wrote it
    r = manifest["config"]["resources"]
    for new, old in (("actors", "workers"), ("gpus_per_actor", "gpus_per_worker"),
                     ("cpus_per_actor", "cpus_per_worker"), ("prompts_per_call", "prompts_per_batch")):
        r[old] = r.pop(new)
    manifest["config"]["models"].update(vllm_kv_cache_mb=None, vllm_max_num_seqs=None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    victim = sorted((run / "_checkpoint").glob("*.parquet"))[0]
    victim.rename(victim.with_name(victim.stem + ".pending.parquet"))  # a commit cut short: work left to do
    old = {**cfg, "resources": {"workers": 1, "prompts_per_batch": 1}}
    capsys.readouterr()
    assert generate.main([str(write_config(tmp_path / "old.yaml", old))]) == 0
    out = capsys.readouterr()
    assert "resuming 'test'" in out.out and "3 already written" in out.out, out.out
    assert "winnow: warning: resources.workers is deprecated; use resources.actors" in out.err
    ids = [r["prompt_id"] for r in rows_of(run)]
    assert sorted(ids) == sorted(d["id"] for d in DEMO[:4])  # every prompt once
    manifest = manifest_of(run)
    assert manifest["status"] == "succeeded" and manifest["config"]["resources"]["actors"] == 1


def test_only_rays_known_noise_is_dropped_from_the_drivers_stderr(capfd):
    """`native_noise_dropped` passes every byte written to file descriptor 2 on, in order, but the one line of
    Ray's C++ core it knows (pipeline.raydata._NATIVE_NOISE); with --verbose it filters nothing."""
    from pipeline import raydata

    noise = (b"[2026-11-27 12:15:27,687 E 32599 32599] core_worker.cc:2465: Actor with class name: "
             b"'MapWorker(CheckpointFilter)' and ID: 'b9cb' has constructor arguments in the object store and "
             b"max_restarts > 0. If the arguments go out of scope the actor restart will fail.\n")
    other = b"[2026-11-27 12:15:28,000 E 1 1] core_worker.cc:100: something else went wrong\n"
    raydata.set_verbose(False)
    with raydata.native_noise_dropped():
        os.write(2, b"first " + b"x" * 70000 + b"\n" + noise + other + b"no newline at the end")
    assert capfd.readouterr().err == "first " + "x" * 70000 + "\n" + other.decode() + "no newline at the end"
    raydata.set_verbose(True)
    try:
        with raydata.native_noise_dropped():
            os.write(2, noise)
        assert capfd.readouterr().err == noise.decode()
    finally:
        raydata.set_verbose(False)
