"""Concept coverage for CommonGen-style lexical constraints (the `lexical` reward; paper 000, section 4.1).

A concept counts as covered when a word of the text is the concept itself or one of its regular inflections:
+s, +es, +ed, +ing, +d (for a final e), and the final-e-dropping forms (make -> making). Matching is
case-insensitive on whole words.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z]+")


def inflections(concept: str) -> set[str]:
    c = concept.strip().lower()
    forms = {c, c + "s", c + "es", c + "ed", c + "ing"}
    if c.endswith("e"):
        forms |= {c + "d", c[:-1] + "ing", c[:-1] + "ed"}
    if c.endswith("y") and len(c) > 1 and c[-2] not in "aeiou":
        forms |= {c[:-1] + "ies", c[:-1] + "ied"}
    return forms


def covered(text: str, concepts: list[str]) -> list[bool]:
    """For each concept, whether the text contains it (or a regular inflection of it) as a whole word."""
    words = set(_WORD.findall(text.lower()))
    return [bool(inflections(c) & words) for c in concepts]


def concept_coverage(text: str, concepts: list[str]) -> float:
    """Fraction of concepts covered; 0.0 when there are no concepts."""
    if not concepts:
        return 0.0
    hits = covered(text, concepts)
    return sum(hits) / len(hits)
