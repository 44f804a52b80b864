"""Measured figures that cannot drift (bench/figures.py): every table of figures in the README and docs/ is what its
bench's file renders to, and the check can fail."""

from __future__ import annotations

from bench import figures


def test_every_table_of_figures_is_its_files_render():
    assert figures.tables(), "no table of figures is marked in the docs"
    assert figures.stale() == []


def test_a_table_that_drifts_from_its_file_is_named(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    name = figures.tables()[0][1]
    doc.write_text(f"text\n<!-- figures:{name} -->\n| a hand-typed | table |\n<!-- /figures:{name} -->\n"
                   "<!-- figures:nothing -->\nx\n<!-- /figures:nothing -->\n")
    monkeypatch.setattr(figures, "DOCS", [doc])
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    assert figures.stale() == [f"doc.md: table {name!r} differs from its render; run python -m bench.figures --write",
                               "doc.md: table 'nothing' has no renderer in bench.figures.RENDER"]
