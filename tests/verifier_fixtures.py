"""Python rewards and verifiers for the verifier tests (`models.verifier.function: verifier_fixtures:NAME`)."""

from __future__ import annotations

import time

SEEN: list = []  # what the functions were handed, for the tests to read


def contains_word(prompts, texts, rows):
    """Verified where the response holds the row's `word`."""
    SEEN.append(list(rows))
    return [r["word"] in t for t, r in zip(texts, rows)]


def slow_contains_word(prompts, texts, rows):
    """`contains_word`, its verdicts late: a verdict must count at its step whenever it arrives."""
    time.sleep(0.05)
    return contains_word(prompts, texts, rows)


def length_reward(prompts, texts):
    """A reward of the old signature: f(prompts, texts)."""
    return [float(len(t)) for t in texts]


def rows_reward(prompts, texts, rows):
    """A reward that reads its rows: the row's `weight` times the response's length."""
    SEEN.append(list(rows))
    return [float(r["weight"]) * len(t) for t, r in zip(texts, rows)]


def reward_with_default(prompts, texts, scale=2.0):
    """A third parameter with a default is not `rows`: called as f(prompts, texts)."""
    return [scale for _ in texts]


def hangs(prompts, texts):
    time.sleep(3600)
    return [0.0 for _ in texts]


def not_a_verdict(prompts, texts):
    return [0.5 for _ in texts]
