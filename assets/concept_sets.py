"""Concept-sentence prompts in two disjoint splits, training and held-out, generated deterministically from a seed:
what a round of Expert Iteration trains on and is judged on (`rounds`, docs/expert-iteration.md).

A prompt asks for one sentence that uses every concept of a set, as CommonGen does (paper 000, section 4.1), and
carries the set as ``concepts`` for the `lexical` reward. Two vocabularies:

- ``everyday``: plain English words (`assets.everyday`) for a real instruct model such as
  ``builtin:smollm2-135m-instruct``, in the wording of ``builtin:real-concepts``: "Write one sentence that uses
  all of these words: dog, kite, beach." A set is a person or an animal, a verb, and an object or a place (3
  concepts) or both (4).
- ``tiny-world``: the bundled tiny trio's world (`assets.world`), in its wording ("Write a sentence using these
  concepts: ..."), drawn as its own demo sets are and never one of the sets the tiny models were trained on
  (``train_concept_sets.txt.gz``), so the held-out split is unseen by the model too.

The splits are disjoint in concept sets (a set is its words in any order, `world.concept_key`): the held-out sets
are drawn first, then the training sets from the same stream, skipping every set drawn before. The same
(vocabulary, sizes, seed) gives the same rows, in the same order, on every machine.
"""

from __future__ import annotations

import gzip
import random

from assets import ASSETS_DIR, everyday, world

VOCABULARIES = ("everyday", "tiny-world")
EVERYDAY_PROMPT = "Write one sentence that uses all of these words:"


def _everyday_set(rng: random.Random) -> list[str]:
    agent = rng.choice(everyday.PEOPLE + everyday.ANIMALS)
    verb = rng.choice(everyday.VERBS)
    shape = rng.choice(["object", "place", "both"])
    concepts = [agent, verb]
    if shape in ("object", "both"):
        concepts.append(rng.choice(everyday.OBJECTS))
    if shape in ("place", "both"):
        concepts.append(rng.choice(everyday.PLACES))
    rng.shuffle(concepts)
    return concepts


def _tiny_trained_sets() -> set[str]:
    """Every concept set the tiny models were trained on (`assets.build`)."""
    with gzip.open(ASSETS_DIR / "train_concept_sets.txt.gz", "rt") as f:
        return {line for line in f.read().splitlines() if line}


def prompt_text(vocabulary: str, concepts: list[str]) -> str:
    if vocabulary == "everyday":
        return f"{EVERYDAY_PROMPT} {', '.join(concepts)}."
    return world.make_prompt(concepts)


def split(vocabulary: str, train: int, heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows), each row ``{"id", "prompt", "concepts"}`` with ids
    ``{vocabulary}-train-0000`` and ``{vocabulary}-heldout-0000`` onwards; no concept set is in both splits, nor twice
    in one. ValueError for an unknown vocabulary or a negative size."""
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"unknown vocabulary {vocabulary!r}; known: {', '.join(VOCABULARIES)}")
    if train < 0 or heldout < 0:
        raise ValueError(f"split sizes must be >= 0; got train={train}, heldout={heldout}")
    rng = random.Random(f"concept-sets/{vocabulary}/{seed}")
    draw = _everyday_set if vocabulary == "everyday" else world.sample_concepts
    skip = _tiny_trained_sets() if vocabulary == "tiny-world" else set()
    seen: set[str] = set()
    sets: list[list[str]] = []
    tries = 0
    while len(sets) < heldout + train:
        tries += 1
        if tries > 100 * (heldout + train) + 10_000:
            raise ValueError(f"the {vocabulary} vocabulary has too few distinct concept sets for {heldout} held-out "
                             f"and {train} training prompts")
        concepts = draw(rng)
        key = world.concept_key(concepts)
        if key in seen or key in skip:
            continue
        seen.add(key)
        sets.append(concepts)

    def rows(part: str, chunk: list[list[str]]) -> list[dict]:
        return [{"id": f"{vocabulary}-{part}-{i:04d}", "prompt": prompt_text(vocabulary, c), "concepts": c}
                for i, c in enumerate(chunk)]

    return rows("train", sets[heldout:]), rows("heldout", sets[:heldout])
