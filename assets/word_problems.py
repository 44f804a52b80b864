"""Arithmetic word problems with their answers, written for this project (`builtin:word-problems`): a data set for
verifiable rewards, where a response is right when its final answer equals the row's `answer` (the `math`
verifier, docs/verifiers.md).

Each problem is one of a few templates ("Mia has 12 apples. She buys 7 more. How many apples does Mia have now?")
filled with everyday names, things and small numbers by a seeded generator, so the file is the same on every machine.
One or two steps of addition, subtraction or multiplication; answers are whole numbers from 0 to 200. The prompt
asks for the final answer in the form "The answer is N.", which the math verifier reads (SmolLM2-135M-Instruct gets
about one in five right in one sample).

`python -m assets.word_problems` writes `assets/word-problems/problems.jsonl` (id, prompt, answer); a test checks
that the file is what the generator makes.
"""

from __future__ import annotations

import json
import pathlib
import random

from assets import ASSETS_DIR

PATH: pathlib.Path = ASSETS_DIR / "word-problems" / "problems.jsonl"
COUNT = 256
SEED = 20261201

NAMES = [("Mia", "she"), ("Leo", "he"), ("Ava", "she"), ("Sam", "he"), ("Zoe", "she"), ("Ben", "he"),
         ("Lily", "she"), ("Max", "he"), ("Ella", "she"), ("Tom", "he"), ("Nora", "she"), ("Jack", "he")]
THINGS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "cards", "coins", "flowers",
          "stamps", "balloons", "eggs", "toy cars", "oranges", "buttons"]
INSTRUCTION = "Think step by step, then end with \"The answer is\" and the number."


def _problem(rng: random.Random) -> tuple[str, int]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    He = he.capitalize()
    kind = rng.choice(["add", "sub", "add", "sub", "mul", "two"])
    if kind == "add":
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        text = rng.choice([
            f"{name} has {a} {thing}. {He} buys {b} more. How many {thing} does {name} have now?",
            f"A box holds {a} {thing} and another box holds {b} {thing}. How many {thing} are there in all?",
            f"{name} found {a} {thing} on Monday and {b} {thing} on Tuesday. How many {thing} did {name} find?",
        ])
        return text, a + b
    if kind == "sub":
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        text = rng.choice([
            f"{name} has {a} {thing}. {He} gives {b} of them to a friend. How many {thing} does {name} have left?",
            f"There are {a} {thing} on a table. {name} takes {b} of them. How many {thing} are still on the table?",
            f"{name} had {a} {thing} and lost {b}. How many {thing} does {name} have now?",
        ])
        return text, a - b
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        text = rng.choice([
            f"{name} has {a} bags with {b} {thing} in each bag. How many {thing} does {name} have?",
            f"There are {a} rows of {thing} with {b} {thing} in each row. How many {thing} are there?",
        ])
        return text, a * b
    a, b = rng.randint(5, 40), rng.randint(2, 20)
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {thing}. {He} gets {b} more, then gives away {c}. How many {thing} does {name} have "
            "now?"), a + b - c


def problems(count: int = COUNT, seed: int = SEED) -> list[dict]:
    """`count` problems as rows: id (`wp-000`, ...), prompt (the problem and the instruction), answer (an int)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < count:
        text, answer = _problem(rng)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"id": f"wp-{len(rows):03d}", "prompt": f"{text} {INSTRUCTION}", "answer": answer})
    return rows


def text() -> str:
    """The file's content: one JSON row per line."""
    return "".join(json.dumps(r) + "\n" for r in problems())


if __name__ == "__main__":
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(text())
    print(f"wrote {PATH} ({COUNT} problems)")
