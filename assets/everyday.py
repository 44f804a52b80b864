"""Everyday English words for CommonGen-like concept sets that a real instruct model can write about
(`assets.concept_sets`, vocabulary ``everyday``).

The words are plain, common and written for this project. Every one inflects regularly in the forms the `lexical`
reward counts (+s, +es, +ed, +ing, +d after a final e, the final-e-dropping -ing, y -> ies/ied), so a sentence that
uses a concept in any ordinary form is credited: no irregular plurals (child, man, leaf, knife), no verbs that double
their last consonant (run, swim, cut, stop) or have an irregular past (ride, throw, catch, sing). Each word sits in
exactly one class, and no word of the list is a counted inflection of another (`check_words`), so a concept set
never holds two words of which one covers the other.
"""

from __future__ import annotations

from lexical import inflections

PEOPLE = [
    "boy", "girl", "farmer", "chef", "teacher", "student", "doctor", "nurse", "baker", "painter", "driver", "pilot",
    "singer", "dancer", "player", "tourist", "waiter", "gardener", "artist", "baby", "friend", "neighbor", "runner",
    "sailor", "soldier", "king", "queen", "clown", "kid", "family", "crowd", "team", "worker", "mechanic", "cowboy",
    "grandmother", "grandfather", "mother", "father", "sister", "brother", "musician", "coach", "swimmer",
]
ANIMALS = [
    "dog", "cat", "horse", "cow", "bird", "duck", "goat", "pig", "rabbit", "frog", "bee", "owl", "squirrel",
    "monkey", "bear", "lion", "tiger", "fox", "chicken", "puppy", "kitten", "turtle", "elephant", "whale", "dolphin",
    "donkey", "parrot", "spider", "snake", "camel", "zebra",
]
OBJECTS = [
    "ball", "book", "bike", "car", "boat", "kite", "cake", "bread", "apple", "cup", "hat", "bag", "door", "window",
    "flower", "tree", "chair", "table", "lamp", "guitar", "drum", "piano", "camera", "umbrella", "bottle", "bucket",
    "basket", "blanket", "pizza", "sandwich", "egg", "carrot", "onion", "tomato", "potato", "pan", "pot", "spoon",
    "fork", "plate", "bowl", "candle", "clock", "phone", "letter", "map", "ticket", "pencil", "rope", "ladder",
    "shovel", "tent", "fence", "flag", "box", "key", "ring", "shoe", "sock", "coat", "jacket", "glove", "toy",
    "truck", "bus", "train", "tractor", "balloon", "cookie", "pie", "soup", "coffee", "milk", "cheese", "banana",
    "orange", "lemon", "rock", "stick", "sand", "snow", "newspaper", "computer", "bench", "mirror", "pillow",
]
PLACES = [
    "park", "beach", "kitchen", "garden", "river", "lake", "forest", "street", "school", "farm", "market", "library",
    "station", "field", "mountain", "hill", "bridge", "road", "city", "village", "pool", "playground", "stage",
    "office", "restaurant", "museum", "airport", "zoo", "island", "yard", "bakery", "hospital", "classroom", "desert",
]
VERBS = [
    "walk", "jump", "climb", "kick", "push", "pull", "carry", "wash", "clean", "paint", "cook", "bake", "watch",
    "open", "fix", "fill", "pick", "chase", "follow", "lift", "visit", "help", "collect", "deliver", "repair", "toss",
    "plant", "water", "pour", "boil", "slice", "mix", "fold", "pack", "load", "play", "dance", "laugh", "smile",
    "rest", "wait", "talk", "shout", "cheer", "race", "skate", "march", "wander", "float", "stretch", "bounce",
    "bark", "fish", "camp", "sail", "surf", "paddle", "hike", "knock", "kiss", "brush", "polish", "decorate",
    "celebrate", "explore", "guard", "greet", "juggle", "listen", "look", "melt", "order", "peel", "print", "rake",
    "roast", "serve", "share", "sketch", "smell", "splash", "spray", "squeeze", "study", "taste", "touch", "type",
    "wave", "whistle", "wipe", "work", "yell", "borrow", "explain", "practice", "drag", "lick",
]
CLASSES = {"people": PEOPLE, "animals": ANIMALS, "objects": OBJECTS, "places": PLACES, "verbs": VERBS}


def check_words() -> None:
    """Raise ValueError unless every word is lower-case letters, listed once (in one class), and no word is a
    counted inflection of another word of the list."""
    words = [w for ws in CLASSES.values() for w in ws]
    bad = [w for w in words if not w.isalpha() or not w.islower()]
    if bad:
        raise ValueError(f"words must be lower-case letters: {bad}")
    seen: dict[str, str] = {}
    for name, ws in CLASSES.items():
        for w in ws:
            if w in seen:
                raise ValueError(f"{w!r} is listed twice: in {seen[w]} and in {name}")
            seen[w] = name
    for w in seen:
        others = [o for o in seen if o != w and o in inflections(w)]
        if others:
            raise ValueError(f"{others} would count as the concept {w!r}")
