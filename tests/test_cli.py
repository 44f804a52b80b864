"""The `winnow` command line: subcommands, module entry points, exit statuses (no Ray needed)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

import assets
from conftest import ROOT, job_config, winnow, write_config
from jobs import assets as assets_cmd
from jobs import validate
from schemas.config import load_config


def test_assets_lists_every_builtin_with_its_path(capsys):
    assert assets_cmd.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = dict(line.split("\t")[:2] for line in lines)  # a third column: the state of a built asset
    assert listed == {f"builtin:{name}": str(path) for name, path, _ in assets.catalog()}
    assert {"builtin:tiny-target", "builtin:tiny-draft", "builtin:tiny-reward", "builtin:demo-prompts"} <= set(listed)
    assert all(Path(listed[f"builtin:{name}"]).exists() for name in assets.list_builtins())


def test_validate_prints_the_resolved_config(capsys):
    assert validate.main(["configs/quickstart.yaml", "--set", "method.alpha=0.25", "--set", "data.limit=2"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    expected = load_config(ROOT / "configs/quickstart.yaml", ["method.alpha=0.25", "data.limit=2"])
    assert resolved == expected.model_dump(mode="json")
    assert f"config hash {expected.hash()}" in out.splitlines()[0]


def test_validate_reports_every_problem_at_once(tmp_path, capsys):
    cfg = job_config(tmp_path, models={"target": str(tmp_path / "nope")})
    cfg["method"]["n"] = 0
    cfg["generation"]["top_p"] = 2
    cfg["colour"] = "blue"
    path = write_config(tmp_path / "bad.yaml", cfg)
    assert validate.main([str(path)]) == 2
    err = capsys.readouterr().err
    for needle in ("method.n: Input should be greater than or equal to 1", "generation.top_p:", "colour: unknown key"):
        assert needle in err
    # The schema is fine once fixed; then the missing model folder is named (unless --schema-only).
    cfg = job_config(tmp_path, models={"target": str(tmp_path / "nope")})
    path = write_config(tmp_path / "bad.yaml", cfg)
    assert validate.main([str(path)]) == 2
    assert f"models.target: {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert validate.main([str(path), "--schema-only"]) == 0
    assert not (tmp_path / "run").exists()


def test_validate_reads_a_local_data_source_as_generate_does_before_ray(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n{"id": "b" "prompt": "y"}\n')
    path = write_config(tmp_path / "job.yaml", job_config(tmp_path, data={"source": str(src)},
                                                           models={"target": str(tmp_path / "nope")}))
    assert validate.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"data.source: {src}: line 2 is not valid JSON (Expecting ',' delimiter, column 12)" in err
    assert f"models.target: {tmp_path / 'nope'} does not exist" in err  # every problem at once
    assert validate.main([str(path), "--schema-only"]) == 0
    probe = "import sys, jobs.validate; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr  # the checks need no Ray, not even its import


@pytest.mark.parametrize("module", ["jobs.generate", "jobs.validate", "jobs.assets"])
def test_module_entry_points(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "usage:" in proc.stdout


def test_dispatcher_routes_subcommands_and_exit_statuses(tmp_path):
    listed = winnow("assets")
    assert listed.returncode == 0 and "builtin:demo-prompts\t" in listed.stdout
    bad = winnow("validate", str(tmp_path / "missing.yaml"))
    assert bad.returncode == 2 and "config file not found" in bad.stderr
    assert winnow("generate").returncode == 2
    assert winnow("frobnicate").returncode == 2


def test_console_script_is_installed():
    try:
        dist = metadata.distribution("winnow")
    except metadata.PackageNotFoundError:
        pytest.skip("winnow is not pip-installed in this environment (CI installs it with pip install -e)")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["winnow"] == "jobs.cli:main"
    exe = Path(sys.executable).with_name("winnow")
    proc = subprocess.run([str(exe), "assets"], capture_output=True, text=True)
    assert proc.returncode == 0 and "builtin:tiny-target\t" in proc.stdout
