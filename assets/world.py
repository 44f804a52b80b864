"""The tiny CommonGen-like world the bundled models are trained on (pure Python, deterministic given a seed).

A task is "Write a sentence using these concepts: c1, c2, c3." with 3-5 concept lemmas (nouns, places, verbs).
A response is 1-3 short sentences from a small grammar, e.g. "The dog kicks a red ball in the park. It is a warm day."

Responses cover the concepts imperfectly, on purpose: each response draws a latent diligence q ~ U(0.1, 1) and keeps
each concept with probability q (otherwise it uses a random substitute of the same word class). Kept concepts are
placed first, so the first clause already shows how diligent the response is. That gives sampled responses a spread
of coverage (Best-of-N has something to pick) and makes the coverage of a prefix predict the coverage of the whole
response (what Speculative Rejection relies on).

Every inflected form used is one that `lexical` accepts (+s, +es, +ed, +ing, +d, e-dropping, y -> ies/ied),
and no word of the world is an inflection of a concept it does not come from; `check_world()` asserts both.
"""

from __future__ import annotations

import dataclasses
import random

from lexical import concept_coverage, inflections

# ---------------------------------------------------------------------------------------------------------------
# Vocabulary. All plurals and verb forms are regular (no consonant doubling, no irregular pasts or plurals).
AGENTS = [
    "dog", "cat", "boy", "girl", "bird", "horse", "cow", "farmer", "teacher", "student", "baby", "player",
    "driver", "chef", "doctor", "artist", "singer", "dancer", "worker", "friend", "kid", "puppy", "rabbit", "duck",
    "monkey", "pilot", "nurse", "baker", "tourist", "pig", "goat", "fox", "bear", "lion", "tiger", "frog",
]
OBJECTS = [
    "ball", "book", "box", "car", "bike", "kite", "cake", "bread", "apple", "cup", "hat", "bag", "boat", "door",
    "window", "flower", "stone", "rope", "guitar", "letter", "dish", "glass", "toy", "basket", "bottle", "bucket",
    "chair", "blanket", "camera", "candle", "carrot", "cookie", "drum", "egg", "fence", "key", "lamp", "map", "net",
    "pencil", "picture", "pizza", "plate", "sandwich", "shoe", "wheel",
]
PLACES = [
    "field", "park", "beach", "street", "river", "garden", "kitchen", "school", "lake", "forest", "road", "bridge",
    "house", "hill", "room", "shop", "yard", "farm", "city", "village", "station", "market", "library", "office",
    "pool", "playground", "mountain",
]
VERBS_I = [  # intransitive
    "walk", "jump", "dance", "laugh", "smile", "rest", "wait", "play", "climb", "work", "talk", "shout", "cry",
    "hurry", "relax", "cheer", "race", "skate", "march", "wander", "float", "stretch", "yawn", "bounce",
]
VERBS_T = [  # transitive
    "kick", "push", "pull", "carry", "wash", "clean", "paint", "cook", "bake", "watch", "open", "fix", "fill",
    "pick", "chase", "follow", "touch", "lift", "visit", "enjoy", "share", "love", "help", "collect", "deliver",
    "repair", "toss", "kiss", "study", "like", "check", "polish",
]
ADJECTIVES = [
    "big", "small", "little", "old", "young", "happy", "red", "blue", "green", "yellow", "brown", "white", "black",
    "tall", "tiny", "quiet", "busy", "lazy", "friendly", "clever", "hungry", "sleepy", "bright", "wooden", "heavy",
    "new", "shiny", "soft", "warm", "cold",
]
ADVERBS = ["slowly", "quickly", "happily", "together", "today", "again", "carefully", "quietly"]
PREPOSITIONS = ["in", "near", "by", "across", "around", "behind", "along", "at"]
WEATHER = ["sunny", "warm", "cold", "quiet", "busy", "windy", "bright", "lovely"]
MOODS = ["happy", "tired", "calm", "busy", "glad", "excited"]
FUNCTION_WORDS = ["the", "a", "two", "some", "and", "is", "are", "was", "were", "it", "day", "everyone",
                  "then", "later", "too", "."]
# words that can start a sentence, capitalised in responses
STARTERS = ["the", "a", "two", "some", "it", "everyone", "then", "later"]

PROMPT_PREFIX = "Write a sentence using these concepts:"
PROMPT_WORDS = ["Write", "a", "sentence", "using", "these", "concepts", ":", ",", "."]

NOUN_ROLES = ("agent", "object", "place")
VERB_ROLES = ("verb_i", "verb_t")
WORDS_BY_ROLE = {"agent": AGENTS, "object": OBJECTS, "place": PLACES, "verb_i": VERBS_I, "verb_t": VERBS_T}
ROLE_OF = {w: role for role, words in WORDS_BY_ROLE.items() for w in words}


# ---------------------------------------------------------------------------------------------------------------
# Regular English morphology (restricted to what lexical accepts)
def _sibilant(w: str) -> bool:
    return w.endswith(("s", "sh", "ch", "x", "z"))


def _cons_y(w: str) -> bool:
    return w.endswith("y") and len(w) > 1 and w[-2] not in "aeiou"


def plural(noun: str) -> str:
    if _sibilant(noun):
        return noun + "es"
    if _cons_y(noun):
        return noun[:-1] + "ies"
    return noun + "s"


def third_person(verb: str) -> str:
    return plural(verb)  # same spelling rules


def present_participle(verb: str) -> str:
    if verb.endswith("e") and not verb.endswith(("ee", "ye", "oe")):
        return verb[:-1] + "ing"
    return verb + "ing"


def past(verb: str) -> str:
    if verb.endswith("e"):
        return verb + "d"
    if _cons_y(verb):
        return verb[:-1] + "ied"
    return verb + "ed"


def surface_forms(lemma: str) -> list[str]:
    """The forms of a concept lemma that responses use (lemma first)."""
    role = ROLE_OF[lemma]
    if role in ("agent", "object"):
        return [lemma, plural(lemma)]
    if role == "place":
        return [lemma]
    return [lemma, third_person(lemma), present_participle(lemma), past(lemma)]


def all_words() -> list[str]:
    """Every word a response or prompt can contain (lower case except PROMPT_WORDS), in a fixed order."""
    out: list[str] = []
    seen: set[str] = set()

    def add(w: str) -> None:
        if w not in seen:
            seen.add(w)
            out.append(w)

    for w in FUNCTION_WORDS + [s.capitalize() for s in STARTERS] + PREPOSITIONS:
        add(w)
    for role in ("agent", "object", "place", "verb_i", "verb_t"):
        for lemma in WORDS_BY_ROLE[role]:
            for f in surface_forms(lemma):
                add(f)
    for w in ADJECTIVES + ADVERBS + WEATHER + MOODS + PROMPT_WORDS:
        add(w)
    return out


def check_world() -> None:
    """Assert the invariants the task relies on (regular inflections, no cross-concept collisions)."""
    lemmas = [w for role in WORDS_BY_ROLE.values() for w in role]
    assert len(set(lemmas)) == len(lemmas), "a lemma is in two classes"
    forms_of = {lemma: set(surface_forms(lemma)) for lemma in lemmas}
    for lemma, forms in forms_of.items():
        assert forms <= inflections(lemma), (lemma, forms - inflections(lemma))
    words = [w.lower() for w in all_words()]
    for lemma in lemmas:
        infl = inflections(lemma)
        for w in words:
            if w in infl:
                assert w in forms_of[lemma], f"{w!r} would count as concept {lemma!r}"


# ---------------------------------------------------------------------------------------------------------------
# Tasks and responses
@dataclasses.dataclass
class Example:
    concepts: list[str]
    prompt: str
    response: str
    q: float  # latent diligence
    included: list[bool]  # per concept
    coverage: float  # lexical.concept_coverage(response, concepts)


def concept_key(concepts: list[str]) -> str:
    """Order-free identity of a concept set (used to hold demo sets out of training)."""
    return " ".join(sorted(c.lower() for c in concepts))


def make_prompt(concepts: list[str]) -> str:
    return f"{PROMPT_PREFIX} {', '.join(concepts)}."


def sample_concepts(rng: random.Random) -> list[str]:
    n = rng.choice([3, 3, 4, 4, 5])
    n_verbs = 1 if n == 3 else rng.choice([1, 2])
    has_place = rng.random() < 0.5
    n_nouns = n - n_verbs - int(has_place)
    concepts = rng.sample(VERBS_I + VERBS_T, n_verbs) + rng.sample(AGENTS + OBJECTS, n_nouns)
    if has_place:
        concepts.append(rng.choice(PLACES))
    rng.shuffle(concepts)
    return concepts


@dataclasses.dataclass
class _Clause:
    agent: str | None = None
    verb: str | None = None
    obj: str | None = None
    place: str | None = None

    def fits(self, role: str) -> bool:
        if role == "agent":
            return self.agent is None
        if role == "place":
            return self.place is None
        if role == "object":
            return self.obj is None and (self.verb is None or ROLE_OF[self.verb] == "verb_t")
        if role == "verb_i":
            return self.verb is None and self.obj is None
        return self.verb is None  # verb_t

    def put(self, word: str, role: str) -> None:
        if role == "agent":
            self.agent = word
        elif role == "place":
            self.place = word
        elif role == "object":
            self.obj = word
        else:
            self.verb = word


def _weighted(rng: random.Random, words: list[str], key: str) -> str:
    """A skewed choice (a clear mode per key) so that greedy decoding has something definite to agree on."""
    k = sum(map(ord, key)) % len(words)
    ordered = words[k:] + words[:k]
    weights = [0.45, 0.25, 0.15] + [0.15 / max(1, len(words) - 3)] * (len(words) - 3)
    return rng.choices(ordered, weights=weights[: len(ordered)])[0]


class _Realiser:
    def __init__(self, rng: random.Random, avoid: set[str]):
        self.rng = rng
        self.avoid = set(avoid)

    def fresh(self, role: str, transitive: bool | None = None) -> str:
        if role == "verb":
            role = "verb_t" if transitive else self.rng.choice(["verb_i", "verb_t"])
        pool = [w for w in WORDS_BY_ROLE[role] if w not in self.avoid]
        w = self.rng.choice(pool)
        self.avoid.add(w)
        return w

    def noun_phrase(self, noun: str, plural_p: float, subject: bool) -> tuple[list[str], bool]:
        rng = self.rng
        is_plural = rng.random() < plural_p
        if is_plural:
            det = rng.choices(["the", "two", "some"], weights=[0.6, 0.25, 0.15])[0]
        else:
            det = rng.choices(["the", "a"], weights=[0.65, 0.35])[0]
        words = [det]
        if rng.random() < 0.3:
            words.append(_weighted(rng, ADJECTIVES, noun))
        words.append(plural(noun) if is_plural else noun)
        return words, is_plural

    def clause(self, c: _Clause, tense: str) -> list[str]:
        rng = self.rng
        if c.agent is None:
            c.agent = self.fresh("agent")
        if c.verb is None:
            c.verb = self.fresh("verb", transitive=True if c.obj is not None else None)
        if ROLE_OF[c.verb] == "verb_t" and c.obj is None:
            c.obj = self.fresh("object")
        if c.place is None and rng.random() < 0.5:
            c.place = self.fresh("place")
        words, pl = self.noun_phrase(c.agent, 0.25, subject=True)
        v = c.verb
        if tense == "present":
            words.append(v if pl else third_person(v))
        elif tense == "progressive":
            words += ["are" if pl else "is", present_participle(v)]
        else:
            words.append(past(v))
        if c.obj is not None:
            words += self.noun_phrase(c.obj, 0.2, subject=False)[0]
        if c.place is not None:
            words += [_weighted(rng, PREPOSITIONS, c.place), "the", c.place]
        if rng.random() < 0.2:
            words.append(rng.choice(ADVERBS))
        return words

    def filler_sentence(self, tense: str) -> list[str]:
        rng = self.rng
        r = rng.random()
        be = "was" if tense == "past" else "is"
        if r < 0.35:
            return ["it", be, "a", _weighted(rng, WEATHER, tense), "day"]
        if r < 0.55:
            return ["everyone", be, _weighted(rng, MOODS, tense)]
        words = self.clause(_Clause(), tense)
        return words + (["too"] if rng.random() < 0.3 else [])


Q_RANGE = (0.1, 1.0)


def sample_response(rng: random.Random, concepts: list[str], q: float | None = None,
                    q_range: tuple[float, float] = Q_RANGE) -> Example:
    if q is None:
        q = rng.uniform(*q_range)
    included = [rng.random() < q for _ in concepts]
    real = _Realiser(rng, avoid=set(concepts))
    kept = [(c, ROLE_OF[c]) for c, inc in zip(concepts, included) if inc]
    subs = [(real.fresh(ROLE_OF[c]), ROLE_OF[c]) for c, inc in zip(concepts, included) if not inc]
    rng.shuffle(kept)
    rng.shuffle(subs)
    clauses: list[_Clause] = []
    for word, role in kept + subs:  # kept concepts first: the first clause shows the diligence
        for cl in clauses:
            if cl.fits(role):
                cl.put(word, role)
                break
        else:
            cl = _Clause()
            cl.put(word, role)
            clauses.append(cl)
    tense = rng.choices(["present", "progressive", "past"], weights=[0.45, 0.3, 0.25])[0]
    bodies = [real.clause(c, tense) for c in clauses]
    # join clauses into sentences ("and"), then maybe add filler sentences, 3 sentences at most
    sentences: list[list[str]] = []
    for i, b in enumerate(bodies):
        must_join = len(sentences) + (len(bodies) - i) > 3
        if sentences and (must_join or (len(sentences[-1]) < 14 and rng.random() < 0.35)):
            sentences[-1] += ["and"] + b
        else:
            sentences.append(b)
    n_extra = rng.choices([0, 1, 2], weights=[0.3, 0.45, 0.25])[0]
    for _ in range(min(n_extra, 3 - len(sentences))):
        s = real.filler_sentence(tense)
        if rng.random() < 0.25 and s[0] not in ("it", "everyone"):
            s = [rng.choice(["then", "later"])] + s
        sentences.append(s)
    text = " ".join(" ".join([s[0].capitalize()] + s[1:]) + " ." for s in sentences)
    response = text.replace(" .", ".")
    cov = concept_coverage(response, concepts)
    assert abs(cov - sum(included) / len(concepts)) < 1e-9, (concepts, included, response)
    return Example(concepts=concepts, prompt=make_prompt(concepts), response=response, q=q,
                   included=included, coverage=cov)


def sample_demo_sets(seed: int, n: int) -> list[list[str]]:
    rng = random.Random(seed)
    out: list[list[str]] = []
    keys: set[str] = set()
    while len(out) < n:
        c = sample_concepts(rng)
        if concept_key(c) not in keys:
            keys.add(concept_key(c))
            out.append(c)
    return out


def sample_training(seed: int, n: int, held_out: set[str], q_range: tuple[float, float] = Q_RANGE) -> list[Example]:
    """n training examples whose concept sets avoid `held_out` (concept_key strings)."""
    rng = random.Random(seed)
    out: list[Example] = []
    while len(out) < n:
        c = sample_concepts(rng)
        if concept_key(c) in held_out:
            continue
        out.append(sample_response(rng, c, q_range=q_range))
    return out
