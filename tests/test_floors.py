"""The package floors of docs/glossary.md: every import in the project's own modules goes down, never up.

Imports inside functions count too (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# rounds/ (the Expert-Iteration recipe) and planning/ (`winnow plan`) compose the floor-4 packages, below the entry
# points: a floor between them.
FLOORS = {"jobs": 5, "rounds": 4.5, "planning": 4.5, "pipeline": 4, "sftdata": 4, "reporting": 4, "runfolder": 3,
          "workers": 2, "schemas": 1, "lexical": 1, "stores": 1}
# Packages beside the floors, with what they may import.
ASIDE = {"assets": {"assets", "lexical"},
         "bench": {"bench", "assets", "pipeline", "reporting", "runfolder", "schemas", "workers", "lexical", "stores"}}
PROJECT = set(FLOORS) | set(ASIDE)
# Who may import assets: the driver's pipeline resolves builtin: names; `winnow assets` lists them; benches use them.
ASSETS_USERS = {"assets", "pipeline", "jobs", "bench"}


def project_imports(path: Path) -> set[str]:
    """Top-level project packages a module imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the project imports by package name"
            names = [node.module or ""]
        else:
            continue
        out |= {n.split(".")[0] for n in names if n.split(".")[0] in PROJECT}
    return out


def modules():
    for package in sorted(PROJECT):
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


def problems_of(package: str, path: Path) -> list[str]:
    where = path.relative_to(ROOT)
    out = []
    for other in sorted(project_imports(path) - {package}):
        if other == "assets" and package not in ASSETS_USERS:
            out.append(f"{where} imports assets; only {sorted(ASSETS_USERS - {'assets'})} may")
        elif package in ASIDE:
            if other not in ASIDE[package]:
                out.append(f"{where} ({package}) imports {other}")
        elif other in FLOORS and FLOORS[other] >= FLOORS[package]:
            out.append(f"{where} (floor {FLOORS[package]}) imports {other} (floor {FLOORS[other]})")
        elif other in ASIDE and other != "assets":
            out.append(f"{where} imports {other}, which is beside the floors")
    return out


# Rooms of workers/, lowest first: a module imports only from its own room or a lower one (top-level modules of
# workers/ are rooms of their own).
WORKER_ROOMS = {"accounting": 1, "loading": 1, "vllm_runtime": 1, "verifiers": 1, "decoding": 2, "scoring": 3, "candidates": 4,
                "context": 5, "pool": 6, "engines": 7, "methods": 8, "actor": 9}


def worker_room_problems(path: Path) -> list[str]:
    """Imports of a workers/ module that run back up its rooms."""
    parts = path.relative_to(ROOT / "workers").with_suffix("").parts
    if parts[0] == "__init__":
        return []
    room = parts[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] != "workers" or len(bits) < 2:
                continue
            other = bits[1]
            if other != room and WORKER_ROOMS.get(other, 99) >= WORKER_ROOMS.get(room, 0):
                out.append(f"{path.relative_to(ROOT)} ({room}) imports workers.{other}")
    return out


def test_every_import_goes_down():
    problems = [p for package, path in modules() for p in problems_of(package, path)]
    assert problems == []


def test_the_checker_sees_an_import_running_back_up(tmp_path, monkeypatch):
    """The rule can fail: a workers module importing the run folder, a runfolder module importing the pipeline."""
    fake = tmp_path / "workers" / "bad.py"
    fake.parent.mkdir()
    fake.write_text("def f():\n    from runfolder.folder import RunFolder\n    import assets\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert problems_of("workers", fake) == [
        "workers/bad.py imports assets; only ['bench', 'jobs', 'pipeline'] may",
        "workers/bad.py (floor 2) imports runfolder (floor 3)",
    ]


def test_workers_rooms_import_down():
    rooms = {p.name if p.is_dir() else p.stem for p in (ROOT / "workers").iterdir()
             if p.name != "__init__.py" and not p.name.startswith((".", "__"))}
    assert rooms == set(WORKER_ROOMS), f"rooms of workers/ not in WORKER_ROOMS or gone: {rooms ^ set(WORKER_ROOMS)}"
    problems = [p for path in sorted((ROOT / "workers").rglob("*.py")) for p in worker_room_problems(path)]
    assert problems == []


def test_the_rooms_checker_sees_an_import_running_back_up(tmp_path, monkeypatch):
    fake = tmp_path / "workers" / "decoding" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from workers.pool.pool import Pool\nfrom workers.accounting.cost import Meter\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert worker_room_problems(fake) == ["workers/decoding/bad.py (decoding) imports workers.pool"]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_each_floor_package_exists(package):
    assert (ROOT / package / "__init__.py").is_file()


def glossary_table(heading: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each row of the first Markdown table after `heading` in docs/glossary.md."""
    lines = (ROOT / "docs" / "glossary.md").read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:3]]
        table.append((cells[0], cells[1]))
    return table


def test_the_glossary_states_the_floors_and_rooms_this_test_holds():
    """docs/glossary.md is where a newcomer reads the floors: its tables name exactly the packages and rooms here."""
    floors: dict[str, float | str] = {}
    for floor, packages in glossary_table("## Floors"):
        for name in packages.replace("`", "").replace("/", "").split(","):
            floors[name.strip()] = floor if floor == "aside" else float(floor)
    assert floors == {**{k: float(v) for k, v in FLOORS.items()}, **{k: "aside" for k in ASIDE}}
    rooms = set()
    for cell, _ in glossary_table("room by room"):
        rooms |= {n.strip().strip("`").removesuffix("/").removesuffix(".py") for n in cell.split(",")}
    assert rooms == set(WORKER_ROOMS)
