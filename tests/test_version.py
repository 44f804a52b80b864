"""`winnow --version` prints Winnow's version, from the installed package's metadata, and exits 0."""

from __future__ import annotations

from importlib import metadata

from conftest import winnow


def test_version_prints_the_installed_version():
    proc = winnow("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"winnow {metadata.version('winnow')}\n"
    assert "--version" in winnow("--help").stdout  # the usage names it
