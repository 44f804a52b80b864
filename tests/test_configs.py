"""Every shipped config validates, names models and data that exist, and docs/config.md's references are current."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.reference import render, render_columns, section_of
from schemas.rows import COST_FIELDS, ROW_SCHEMA, STATS_FIELDS
from pipeline.preflight import model_problems
from pipeline.prompts import resolve_source
from schemas.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_the_shipped_configs_are_there():
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "best_of_n.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    config = load_config(path)
    assert model_problems(config) == []
    resolve_source(config.data.source)  # raises InputError if the data is not there


def test_quickstart_and_best_of_n_compare_like_with_like():
    sr, bon = load_config(ROOT / "configs/quickstart.yaml"), load_config(ROOT / "configs/best_of_n.yaml")
    assert (sr.method.name, bon.method.name) == ("speculative_rejection", "best_of_n")
    assert sr.data == bon.data and sr.method.n == bon.method.n and sr.generation == bon.generation
    assert sr.models.target == bon.models.target and sr.models.reward == bon.models.reward
    assert sr.output.path != bon.output.path


def test_docs_config_reference_is_generated_from_the_schema():
    doc = (ROOT / "docs" / "config.md").read_text()
    assert section_of(doc) == render(), "regenerate it: python -m schemas.reference --write docs/config.md"


def test_docs_output_columns_are_generated_from_the_row_schema():
    doc = (ROOT / "docs" / "config.md").read_text()
    got = section_of(doc, "output-columns")
    assert got == render_columns(), "regenerate it: python -m schemas.reference --write docs/config.md"
    for name in [*ROW_SCHEMA.names, *(f"stats.{s}" for s in STATS_FIELDS), *(f"cost.{c}" for c in COST_FIELDS)]:
        assert f"| `{name}` |" in got, f"{name} has no meaning in schemas.rows"


def test_cluster_yaml_passes_the_ray_cluster_launcher_schema():
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))  # raises on a key or value the launcher would refuse
    assert config["head_node_type"] in config["available_node_types"]
