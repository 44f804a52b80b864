"""The docs read as a manual: a short opening, short sentences, a dated log, and field descriptions without ratios.

The README's opening paragraph says what Winnow is in at most 80 words. Sentences of the prose of README.md and
docs/*.md are short: their median is at most 25 words. History lives in docs/LOG.md, whose entries are dated, newest
first. A config field's description says what the setting does and trades, in words: no measured ratio, no version
history. No Ray starts here.

How a sentence is counted:
1. Prose only: fenced code blocks, tables (lines starting with `|`), HTML comments, headings and generated blocks
   (between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`, or `<!-- NAME:start -->` and `<!-- NAME:end -->`)
   are dropped.
2. A paragraph's lines are joined; a blank line or a new list item starts a new piece.
3. A piece is split after `.`, `?`, `!` or `:` followed by whitespace.
4. A fragment of fewer than 3 words is not a sentence.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from pydantic import BaseModel

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPENING_WORDS = 80
MEDIAN_WORDS = 25

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
GENERATED_START = re.compile(r"^\s*<!--\s*(?:figures:([\w.-]+)|([\w.-]+):start)\s*-->\s*$")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
SPLIT = re.compile(r"(?<=[.?!:])\s+")
RATIO = re.compile(r"\d+(?:\.\d+)?x\b")
HISTORY = re.compile(r"before this version|previous version|used to be|no longer|this round", re.IGNORECASE)
DATED = re.compile(r"^## (\d{4}-\d{2}-\d{2})\b")


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text that are prose: the steps of the module docstring, 1.; '' marks a break."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        generated = GENERATED_START.match(line)
        if fence:  # skip to the closing fence of the same kind
            mark = fence.group(1)
            i += 1
            while i < len(lines) and not re.match(rf"^\s*{re.escape(mark[0])}{{{len(mark)},}}\s*$", lines[i]):
                i += 1
            out.append("")
        elif generated:
            name = generated.group(1) or generated.group(2)
            end = (re.compile(rf"^\s*<!--\s*/figures:{re.escape(name)}\s*-->\s*$") if generated.group(1)
                   else re.compile(rf"^\s*<!--\s*{re.escape(name)}:end\s*-->\s*$"))
            while i < len(lines) and not end.match(lines[i]):
                i += 1
            out.append("")
        elif line.lstrip().startswith("<!--"):
            while i < len(lines) and "-->" not in lines[i]:
                i += 1
            out.append("")
        elif line.lstrip().startswith(("|", "#")) or not line.strip():
            out.append("")
        else:
            out.append(line)
        i += 1
    return out


def sentences(text: str) -> list[str]:
    """The sentences of a Markdown text's prose: steps 2 to 4 of the module docstring."""
    pieces, current = [], []
    for line in prose_lines(text):
        if not line or LIST_ITEM.match(line):
            if current:
                pieces.append(" ".join(current))
            current = [LIST_ITEM.sub("", line)] if line else []
        else:
            current.append(line.strip())
    if current:
        pieces.append(" ".join(current))
    found = (s.strip() for piece in pieces for s in SPLIT.split(piece))
    return [s for s in found if len(s.split()) >= 3]


def opening(readme: str) -> str:
    """The README's opening: the text between the `# Winnow` title and the next heading or `**Contents`."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Winnow"))
    rest = lines[start + 1:]
    end = next((i for i, line in enumerate(rest) if line.startswith(("#", "**Contents"))), len(rest))
    return "\n".join(rest[:end])


def descriptions(model: type[BaseModel], seen: set | None = None) -> dict[str, str]:
    """Every field description of a pydantic model and of the models its fields hold, by `Model.field`."""
    seen = set() if seen is None else seen
    if model in seen:
        return {}
    seen.add(model)
    found = {}
    for name, field in model.model_fields.items():
        found[f"{model.__name__}.{name}"] = field.description or ""
        for inner in nested_models(field.annotation):
            found.update(descriptions(inner, seen))
    return found


def nested_models(annotation) -> list[type[BaseModel]]:
    """The pydantic models named anywhere in a type annotation (unions, lists, dicts, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) or () for m in nested_models(arg)]


def test_the_readme_opens_in_at_most_80_words():
    words = len(opening((ROOT / "README.md").read_text()).split())
    assert 0 < words <= OPENING_WORDS, f"the README's opening paragraph has {words} words (at most {OPENING_WORDS})"


def test_the_median_sentence_is_short():
    lengths = {path.name: [len(s.split()) for s in sentences(path.read_text())] for path in DOCS}
    every = [n for per_page in lengths.values() for n in per_page]
    median = statistics.median(every)
    pages = ", ".join(f"{name} {statistics.median(n):g}" for name, n in sorted(lengths.items()) if n)
    assert median <= MEDIAN_WORDS, (
        f"the median sentence of README.md and docs/*.md is {median:g} words over {len(every)} sentences "
        f"(at most {MEDIAN_WORDS}); by page: {pages}")


def test_the_sentence_counter_counts_prose_only():
    text = ("# Title\n\nOne two three four. Five six seven: eight nine ten\n- item one two\n- item three four five\n"
            "```\ncode code code code\n```\n| a | b c d |\n<!-- figures:x -->\nfigure figure figure\n"
            "<!-- /figures:x -->\n<!-- a comment\nover lines -->\nOk.\n")
    assert sentences(text) == ["One two three four.", "Five six seven:", "eight nine ten", "item one two",
                               "item three four five"]


def test_the_log_is_dated_newest_first():
    path = ROOT / "docs" / "LOG.md"
    assert path.exists(), "docs/LOG.md is missing: history goes to a dated log"
    text = path.read_text()
    assert text.startswith("# Log"), "docs/LOG.md should be headed '# Log'"
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings, "docs/LOG.md has no '## YYYY-MM-DD' entry"
    undated = [h for h in headings if not DATED.match(h)]
    assert not undated, f"docs/LOG.md entries without a leading date YYYY-MM-DD: {undated}"
    dates = [DATED.match(h).group(1) for h in headings]
    assert dates == sorted(dates, reverse=True), f"docs/LOG.md's entries are not newest first: {dates}"


def test_field_descriptions_carry_no_ratio_and_no_history():
    from schemas.config import JobConfig

    found = descriptions(JobConfig)
    import schemas.methods as methods
    for value in vars(methods).values():
        if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == methods.__name__:
            found.update(descriptions(value))
    assert len(found) > 20, f"only {len(found)} field descriptions found: the walk over the models is broken"
    ratios = {k: RATIO.findall(v) for k, v in found.items() if RATIO.search(v)}
    history = {k: HISTORY.findall(v) for k, v in found.items() if HISTORY.search(v)}
    assert not ratios, f"{len(ratios)} field descriptions carry a measured ratio: {ratios}"
    assert not history, f"{len(history)} field descriptions carry a version's history: {history}"


HOOK_MEDIAN_WORDS = 25
HOOK_LONG_WORDS = 40
HOOK_LONG_TOTAL = 60


def hook_lengths(text: str) -> list[int]:
    """Sentence lengths as the project's before-stop hook counts them, page by page.

    Code blocks and HTML comments are dropped; table lines and headings are skipped; a list item's marker is cut;
    every remaining line is joined into one text, which is split after `.`, `!` or `?` followed by whitespace and a
    capital, a backtick, `*` or `[`; a piece of fewer than 3 words is not a sentence.
    """
    md = re.sub(r"```.*?```|<!--.*?-->", " ", text, flags=re.S)
    lines = [re.sub(r"^[-*\d.]+\s+", "", line.strip()) for line in md.splitlines()
             if line.strip() and not line.strip().startswith(("|", "#"))]
    found = re.split(r"(?<=[.!?])\s+(?=[A-Z`*\[])", " ".join(lines))
    return sorted(len(s.split()) for s in found if len(s.split()) >= 3)


def test_the_hook_counts_a_list_item_without_a_period_into_the_next():
    text = ("# Title\n\nOne two three four. Five six seven\n- item one two\n- Item three four.\n```\nA b c d.\n```\n"
            "| A table row here. |\n<!-- A comment here. -->\nSix seven eight!\n")
    assert hook_lengths(text) == [3, 4, 9]


def test_each_page_has_short_sentences_as_the_hook_counts_them():
    pages = [path for path in DOCS if path.name != "LOG.md"]
    figures = {path.name: hook_lengths(path.read_text()) for path in pages}
    medians = {name: statistics.median(n) for name, n in figures.items() if n}
    long = {name: sum(k > HOOK_LONG_WORDS for k in n) for name, n in figures.items()}
    table = ", ".join(f"{name} {medians.get(name, 0):g}/{long[name]}" for name in sorted(figures))
    wordy = sorted(name for name, m in medians.items() if m > HOOK_MEDIAN_WORDS)
    assert not wordy and sum(long.values()) <= HOOK_LONG_TOTAL, (
        f"pages whose median sentence is over {HOOK_MEDIAN_WORDS} words: {wordy}; sentences over {HOOK_LONG_WORDS} "
        f"words: {sum(long.values())} in all (at most {HOOK_LONG_TOTAL}); by page (median/over {HOOK_LONG_WORDS}): "
        f"{table}")
