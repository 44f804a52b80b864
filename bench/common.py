"""What the benches share: the base job config of the tiny-trio benches, and Markdown tables of figures."""

from __future__ import annotations

import json
from pathlib import Path

# The tiny-trio benches' job config (bench.bon_sr, bench.vllm_engine); each replaces the sections it varies.
BASE = {
    "name": "bench",
    "seed": 0,
    "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
    "models": {"target": "builtin:tiny-target", "reward": {"kind": "lexical"}},
    "method": {"name": "best_of_n", "n": 16},
    "generation": {"max_new_tokens": 48, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
    "output": {"path": "runs/bench"},
}


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def table(title: str, rows: dict[str, dict], cols: list[str], first: str = "method") -> str:
    lines = [f"\n### {title}\n", f"| {first} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, s in rows.items():
        lines.append(f"| {name} | " + " | ".join(fmt(s.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, figures: dict) -> None:
    """A bench's figures to `path` (--json): the file docs/figures/ holds and bench.figures renders the docs from."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")
