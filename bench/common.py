"""Formatting shared by the benches: Markdown tables of figures."""

from __future__ import annotations


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
