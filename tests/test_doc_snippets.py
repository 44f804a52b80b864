"""The docs' Python snippets run as written on CPU.

Every ```python (or ```py) block of README.md and docs/*.md is collected, so a new block is run without being listed
here. Each runs as a script, in a subprocess, in an empty temporary folder, with no GPU visible
(`CUDA_VISIBLE_DEVICES=""`) and the Hugging Face hub offline: what a user copying it would run, on a machine
without a GPU. A block may be left out only by the line

    <!-- doc-snippet: not run (why) -->

as the last non-blank line before its fence (an HTML comment: invisible on the rendered page); a marker that is not
followed by a Python block is an error (this file fails to collect, naming the marker's line).

- **Alternatives.** A line `# or: EXPRESSION` right after an assignment `NAME = ...` names another way to the same
  value; the block is run a second time with that assignment's right-hand side replaced by EXPRESSION.
- **Files a snippet expects.** A snippet that names a path in `FIXTURES` (e.g. `sft/round-1`) finds it in its folder,
  made the way the docs tell a user to make it: `sft/round-1` is `winnow build-sft`'s output for two run folders in
  the shape `winnow generate` writes (hand-made, as in test_build_sft.py, so no Ray starts). A snippet that reads
  a relative path no fixture makes fails: add the fixture.
- **Extras.** A snippet that imports a package of an optional extra (`trl`, `peft`: the `train` extra) is skipped
  where that package is missing, unless the extra's `WINNOW_REQUIRE_*` variable is 1 (as in test_rounds.py): then it
  fails. A snippet that imports any other package that is not installed fails.
- Snippets that import torch, transformers, TRL, peft or Ray are `slow`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import assets
from conftest import ROOT
from conftest_runs import cand, row, write_run
from jobs.build_sft import main as build_sft

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^\s*<!--\s*doc-snippet:\s*not run\b(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
PYTHON = {"python", "py", "python3"}
# A top-level package a snippet imports -> (the extra that installs it, the variable that makes its absence a failure)
EXTRAS = {"trl": ("train", "WINNOW_REQUIRE_TRAIN"), "peft": ("train", "WINNOW_REQUIRE_TRAIN")}
SLOW = {"torch", "transformers", "trl", "peft", "ray"}
ALTERNATIVE = re.compile(r"^\s*# or: (.+?)\s*$")
ASSIGNMENT = re.compile(r"^(\s*[A-Za-z_][\w.]* = ).+$")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the marker's reason, when marked not run


def python_blocks(text: str, file: str) -> list[Block]:
    """The Python blocks of one Markdown text, with markers; ValueError on a marker not followed by one."""
    lines = text.splitlines()
    blocks, i, last_text = [], 0, None  # last_text: (index, line) of the last non-blank line outside a block
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                if last_text is not None and SKIP.match(last_text[1]):
                    raise ValueError(f"{file}:{last_text[0] + 1}: a doc-snippet marker not followed by a block")
                last_text = (i, lines[i])
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        marker = SKIP.match(last_text[1]) if last_text is not None else None
        if lang.lower() in PYTHON:
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end])
            reason = (marker.group(1).strip(" ()") or "marked not run") if marker else None
            blocks.append(Block(file, i + 1, textwrap.dedent(body) + "\n", reason))
        elif marker:
            raise ValueError(f"{file}:{last_text[0] + 1}: a doc-snippet marker before a {lang or 'plain'} block")
        last_text = None
        i = end + 1
    if last_text is not None and SKIP.match(last_text[1]):
        raise ValueError(f"{file}:{last_text[0] + 1}: a doc-snippet marker not followed by a block")
    return blocks


def variants(code: str) -> list[tuple[str, str]]:
    """(label, code): the block as written, then once per `# or:` alternative of an assignment."""
    lines = code.splitlines()
    out = [("", code)]
    for i in range(1, len(lines)):
        alt, assign = ALTERNATIVE.match(lines[i]), ASSIGNMENT.match(lines[i - 1])
        if alt and assign:
            changed = lines[:i - 1] + [assign.group(1) + alt.group(1)] + lines[i:]
            out.append((f"-or-line{i + 1}", "\n".join(changed) + "\n"))
    return out


def imported(code: str) -> set[str]:
    """Top-level packages the code imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# ---------------------------------------------------------------------------------------------------------------
# Files the snippets expect, made the way the docs tell a user to


def sft_round_1(folder: Path) -> None:
    """`winnow build-sft runs/bon-16 runs/sr-64 --out sft/round-1 --select top-k=2 --min-reward 0.5`
    (docs/sft-and-report.md) on two hand-made runs over four demo prompts."""
    prompts = assets.demo_prompts(count=4)
    bon, sr = [], []
    for k, item in enumerate(prompts):
        words = item["concepts"]
        text = item["prompt"][0]["content"]
        bon.append(row(item["prompt_id"], [cand(f"The {words[0]} and the {words[1]}.", 0.4 + 0.2 * k),
                                           cand(" ".join(words).capitalize() + ".", 0.3 + 0.1 * k),
                                           cand(f"A {words[-1]}", 0.9, "length")], prompt=text))
        sr.append(row(item["prompt_id"], [cand(f"A {words[0]} with a {words[-1]}.", 0.8 + 0.1 * k),
                                          cand("No.", None, "rejected", partial=[0.1])],
                      method="speculative_rejection", prompt=text))
    write_run(str(folder / "runs" / "bon-16"), bon, name="bon-16", method="best_of_n")
    write_run(str(folder / "runs" / "sr-64"), sr, name="sr-64", method="speculative_rejection")
    code = build_sft([str(folder / "runs" / "bon-16"), str(folder / "runs" / "sr-64"),
                      "--out", str(folder / "sft" / "round-1"), "--select", "top-k=2", "--min-reward", "0.5"])
    assert code == 0 and (folder / "sft" / "round-1" / "hf").is_dir()


FIXTURES = {"sft/round-1": sft_round_1}


# ---------------------------------------------------------------------------------------------------------------


def collect() -> list:
    params = []
    for path in DOCS:
        for block in python_blocks(path.read_text(), str(path.relative_to(ROOT))):
            slow = bool(imported(block.code) & SLOW)
            for label, code in variants(block.code):
                marks = [pytest.mark.slow] if slow else []
                if block.skip is not None:
                    marks.append(pytest.mark.skip(reason=f"marked not run in the docs: {block.skip}"))
                params.append(pytest.param(block.file, block.line, code, marks=marks,
                                           id=f"{block.file}:{block.line}{label}"))
    return params


def test_the_docs_python_blocks_are_collected():
    """The extractor sees the docs' blocks (so the run test below cannot pass on none), the markers are well placed,
    and the SFT snippet is run both ways."""
    blocks = [b for path in DOCS for b in python_blocks(path.read_text(), str(path.relative_to(ROOT)))]
    sft = [b for b in blocks if b.file == "docs/sft-and-report.md" and "SFTTrainer(" in b.code]
    assert len(sft) == 1 and sft[0].skip is None
    or_line = next(i for i, ln in enumerate(sft[0].code.splitlines(), 1) if ln.startswith("# or: "))
    assert [label for label, _ in variants(sft[0].code)] == ["", f"-or-line{or_line}"]
    for block in blocks:
        ast.parse(block.code, filename=f"{block.file}:{block.line}")


def test_the_extractor_reads_fences_markers_and_alternatives():
    text = textwrap.dedent("""\
        Intro.

        ```python
        x = 1
        # or: 2
        print(x)
        ```

        <!-- doc-snippet: not run (needs a GPU) -->

        ```py
        import torch
        ```

        - a list item:

          ```python
          y = 3
          ```

        ```bash
        echo no
        ```
        """)
    blocks = python_blocks(text, "t.md")
    assert [(b.line, b.skip) for b in blocks] == [(3, None), (11, "needs a GPU"), (17, None)]
    assert blocks[2].code == "y = 3\n"
    assert variants(blocks[0].code) == [("", "x = 1\n# or: 2\nprint(x)\n"), ("-or-line2", "x = 2\n# or: 2\nprint(x)\n")]
    assert imported(blocks[1].code) == {"torch"}
    with pytest.raises(ValueError, match="t.md:1: a doc-snippet marker before a bash block"):
        python_blocks("<!-- doc-snippet: not run -->\n```bash\nls\n```\n", "t.md")
    with pytest.raises(ValueError, match="not followed by a block"):
        python_blocks("<!-- doc-snippet: not run -->\nText.\n", "t.md")


@pytest.mark.parametrize(("file", "line", "code"), collect())
def test_doc_snippet_runs_as_written_on_cpu(file, line, code, tmp_path):
    for package in sorted(imported(code)):
        if importlib.util.find_spec(package) is not None:
            continue
        if package not in EXTRAS:
            pytest.fail(f"{file}:{line} imports {package}, which is not installed here")
        extra, require = EXTRAS[package]
        if os.environ.get(require) == "1":
            pytest.fail(f"{require}=1 but {package} cannot be imported; install the {extra} extra: "
                        f"pip install -e '.[{extra}]'")
        pytest.skip(f"{file}:{line} needs the {extra} extra ({package}): pip install -e '.[{extra}]'")
    for path, make in FIXTURES.items():
        if path in code:
            make(tmp_path)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (f"{file}:{line} failed (exit {done.returncode}):\n{code}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")
