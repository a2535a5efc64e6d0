"""The embedded corpus: simple English generated locally from a seed (no download).

A tiny model needs text with structure it can learn within a few hundred steps, and a
corpus that is not so small it is memorised. This module writes procedurally generated
documents of six kinds, each built from templates over a few hundred words:

* ``story``: a character with a name, an animal kind and adjectives goes to places,
  finds things and meets friends; names and pronouns are re-used consistently
  (a model can learn to copy the name it saw earlier).
* ``counting``: small word-number arithmetic ("Tom has three apples ... Now Tom has
  five apples.").
* ``facts``: a few sentences drawn from a fixed list of true simple facts.
* ``sequence``: days, months, numbers or letters in order ("Tuesday comes after Monday.").
* ``dialogue``: questions and answers between two characters about where things are.
* ``place``: a description of a town with its buildings, colours and counts.

Document ``i`` depends only on ``(seed, i)`` (its own ``random.Random``), so the first
``n`` documents are the same whatever the total number asked for, and the output is
byte-identical on every machine and Python version that keeps ``random.Random``'s
string seeding (CPython's is stable since 3.2).
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterator

GENERATOR_VERSION = 1
"""Bump when the generator's output changes (it is part of the embedded cache key)."""

NAMES = [
    "Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Zoe", "Leo", "Emma", "Jack", "Ruby",
    "Noah", "Ella", "Finn", "Lucy", "Omar", "Nina", "Hugo", "Ivy", "Theo", "Rosa", "Eli",
    "Maya", "Oscar", "Clara", "Felix", "Alice", "Jonas", "Sara", "Pablo", "Grace", "Kai",
    "Hana", "Luca", "Iris", "Adam", "Olive", "Ravi", "Tara",
]
# name -> pronoun; deterministic by position so a name always has the same pronoun.
PRONOUNS = {name: ("he", "him", "his") if i % 2 == 0 else ("she", "her", "her")
            for i, name in enumerate(NAMES)}

ANIMALS = [
    "fox", "rabbit", "bear", "cat", "dog", "mouse", "owl", "duck", "frog", "horse", "lion",
    "tiger", "goat", "sheep", "pig", "cow", "deer", "wolf", "bird", "turtle", "squirrel",
    "hedgehog", "badger", "otter", "penguin", "monkey", "elephant", "giraffe", "zebra", "panda",
]
SIZES = ["little", "small", "big", "tiny", "tall", "short", "huge", "young", "old"]
COLORS = ["red", "blue", "green", "yellow", "brown", "white", "black", "orange", "purple",
          "pink", "grey", "golden", "silver"]
MOODS = ["happy", "sad", "tired", "hungry", "brave", "curious", "scared", "sleepy", "proud",
         "excited", "calm", "angry", "surprised", "lonely", "busy", "kind", "clever", "shy"]
PLACES = [
    "the forest", "the river", "the market", "the garden", "the school", "the park",
    "the beach", "the farm", "the hill", "the lake", "the village", "the library",
    "the bakery", "the mountain", "the meadow", "the station", "the harbor", "the castle",
    "the museum", "the zoo", "the cave", "the island", "the field", "the bridge",
]
THINGS = [
    "ball", "book", "hat", "kite", "box", "cup", "key", "bell", "map", "shoe", "coat",
    "basket", "drum", "flower", "stone", "feather", "lamp", "boat", "clock", "ring", "scarf",
    "bag", "spoon", "brush", "ladder", "rope", "shell", "candle", "letter", "whistle",
]
FOODS = ["apples", "pears", "cookies", "carrots", "eggs", "plums", "nuts", "cakes", "grapes",
         "lemons", "berries", "potatoes", "tomatoes", "oranges", "bananas", "muffins"]
WHERE = ["under the tree", "behind the door", "next to the bed", "on the table",
         "in the box", "near the window", "under the bridge", "in the garden",
         "on the shelf", "behind the house", "in the kitchen", "by the river"]
WALK_VERBS = ["walked", "ran", "went", "hurried", "wandered", "skipped", "hopped", "rode"]
LIKES = ["to sing", "to read", "to swim", "to dance", "to paint", "to climb trees",
         "to play games", "to bake bread", "to look at the stars", "to tell stories",
         "to fly kites", "to plant seeds", "to build towers", "to play the drum"]
TIMES = ["In the morning", "In the afternoon", "In the evening", "At night", "At noon",
         "Later", "After lunch", "Before dinner", "The next day", "On Sunday"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy", "foggy"]

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen",
                "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"]

FACTS = [
    "The sun is hot.", "The moon shines at night.", "Fish live in water.", "Birds can fly.",
    "A cat has four legs.", "A bird has two wings.", "A spider has eight legs.",
    "Snow is cold and white.", "The sky is blue on a clear day.", "Grass is green.",
    "Ice melts when it is warm.", "Water boils when it is very hot.", "Bees make honey.",
    "Cows give milk.", "Hens lay eggs.", "Trees grow from seeds.", "Plants need water and light.",
    "A week has seven days.", "A year has twelve months.", "A day has twenty four hours.",
    "An hour has sixty minutes.", "Two and two make four.", "Three and four make seven.",
    "Five and five make ten.", "A triangle has three sides.", "A square has four sides.",
    "Lemons are sour.", "Honey is sweet.", "Rain falls from clouds.", "Fire is hot.",
    "Owls sleep in the day and hunt at night.", "Frogs can jump and swim.",
    "Elephants are very big animals.", "Mice are very small animals.", "Ducks can swim.",
    "Penguins cannot fly.", "A giraffe has a long neck.", "A zebra has black and white stripes.",
    "The ocean is salty.", "Rivers flow to the sea.", "Mountains are tall.",
    "Winter comes after autumn.", "Spring comes after winter.", "Summer is the warmest season.",
    "Leaves fall in autumn.", "The earth goes around the sun.", "Stars shine at night.",
    "Bread is made from flour.", "Milk is white.", "Carrots grow under the ground.",
]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _cap(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def _count(k: int, plural: str) -> str:
    """``"three apples"``, ``"one apple"``, ``"one berry"``."""
    if k != 1:
        return f"{NUMBER_WORDS[k]} {plural}"
    if plural.endswith("ies"):
        return "one " + plural[:-3] + "y"
    if plural.endswith("oes"):
        return "one " + plural[:-2]
    return "one " + plural[:-1]


def _character(rng: random.Random) -> dict:
    name = rng.choice(NAMES)
    return {"name": name, "pro": PRONOUNS[name], "kind": rng.choice(ANIMALS),
            "size": rng.choice(SIZES), "color": rng.choice(COLORS), "home": rng.choice(PLACES)}


def _story(rng: random.Random) -> str:
    hero = _character(rng)
    friend = _character(rng)
    while friend["name"] == hero["name"]:
        friend = _character(rng)
    n, (he, him, his) = hero["name"], hero["pro"]
    thing, thing_color = rng.choice(THINGS), rng.choice(COLORS)
    s = [
        f"Once upon a time, there was {_a(hero['size'])} {hero['color']} {hero['kind']} "
        f"named {n}.",
        f"{n} lived near {hero['home']}.",
        f"{_cap(he)} liked {rng.choice(LIKES)}.",
        f"One {rng.choice(WEATHER)} day, {n} {rng.choice(WALK_VERBS)} to {rng.choice(PLACES)}.",
    ]
    for _ in range(rng.randint(2, 6)):
        kind = rng.randrange(7)
        if kind == 0:
            s.append(f"There {n} found {_a(thing_color)} {thing} {rng.choice(WHERE)}.")
        elif kind == 1:
            s.append(f"{n} felt {rng.choice(MOODS)}.")
        elif kind == 2:
            s.append(f"{rng.choice(TIMES)}, {n} met {friend['name']} the {friend['kind']}.")
            s.append(f"\"Hello, {friend['name']}!\" said {n}.")
        elif kind == 3:
            k = rng.randint(2, 9)
            s.append(f"{_cap(he)} picked {_count(k, rng.choice(FOODS))} and put them "
                     f"in {his} basket.")
        elif kind == 4:
            s.append(f"{n} gave the {thing} to {friend['name']}, and {friend['name']} was "
                     f"{rng.choice(MOODS)}.")
        elif kind == 5:
            s.append(f"{rng.choice(TIMES)}, {n} {rng.choice(WALK_VERBS)} back to "
                     f"{hero['home']}.")
        else:
            s.append(f"The {friend['kind']} told {him} a story about {rng.choice(PLACES)}.")
    s.append(f"At the end of the day, {n} the {hero['kind']} went to sleep. The end.")
    return " ".join(s)


def _counting(rng: random.Random) -> str:
    s = []
    for _ in range(rng.randint(2, 4)):
        name = rng.choice(NAMES)
        food = rng.choice(FOODS)
        a = rng.randint(1, 10)
        b = rng.randint(1, 10)
        if rng.random() < 0.5:
            giver = rng.choice(NAMES)
            s += [f"{name} has {_count(a, food)}.",
                  f"{giver} gives {name} {_count(b, food).replace(' ', ' more ', 1)}.",
                  f"Now {name} has {_count(a + b, food)}."]
        else:
            a, b = max(a, b) + 1, min(a, b)
            s += [f"{name} has {_count(a, food)}.",
                  f"{_cap(PRONOUNS[name][0])} eats {NUMBER_WORDS[b]} of them.",
                  f"Now {name} has {_count(a - b, food)} left."]
    return " ".join(s)


def _facts(rng: random.Random) -> str:
    return " ".join(rng.sample(FACTS, rng.randint(3, 8)))


def _sequence(rng: random.Random) -> str:
    seq = rng.choice([DAYS, MONTHS, NUMBER_WORDS[1:], LETTERS, ORDINALS])
    start = rng.randrange(len(seq) - 3)
    stop = rng.randint(start + 3, len(seq))
    part = seq[start:stop]
    s = [_cap(", ".join(part)) + "."]
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(1, len(seq))
        if rng.random() < 0.5:
            s.append(f"{_cap(seq[i])} comes after {seq[i - 1]}.")
        else:
            s.append(f"{_cap(seq[i - 1])} comes before {seq[i]}.")
    return " ".join(s)


def _dialogue(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    s = []
    for _ in range(rng.randint(2, 4)):
        thing, where = rng.choice(THINGS), rng.choice(WHERE)
        s.append(f"\"Where is my {thing}?\" asked {a}.")
        s.append(f"\"Your {thing} is {where},\" said {b}.")
        if rng.random() < 0.5:
            s.append(f"{a} looked {where} and found the {thing}.")
        if rng.random() < 0.5:
            s.append(f"\"Thank you, {b},\" said {a}.")
        a, b = b, a
    return " ".join(s)


def _place(rng: random.Random) -> str:
    town = rng.choice(["Oakville", "Rivertown", "Hillside", "Maplewood", "Stonebridge",
                       "Greenfield", "Lakeside", "Fairport", "Brookside", "Pinecrest"])
    buildings = rng.sample(["a school", "a bakery", "a library", "a small park", "a market",
                            "a station", "a museum", "a farm", "a big bridge", "a hospital",
                            "a post office", "a toy shop"], rng.randint(2, 5))
    s = [f"{town} is {_a(rng.choice(SIZES))} town near {rng.choice(PLACES)}.",
         f"In {town} there is {', '.join(buildings[:-1])} and {buildings[-1]}."]
    for _ in range(rng.randint(1, 4)):
        k = rng.randint(2, 12)
        s.append(f"There are {NUMBER_WORDS[k]} {rng.choice(COLORS)} houses on "
                 f"{rng.choice(['the main street', 'the hill', 'the river bank', 'the square'])}.")
    name = rng.choice(NAMES)
    s.append(f"{name} lives in {town} and works at the {rng.choice(buildings)[2:]}.")
    s.append(f"The weather in {town} is often {rng.choice(WEATHER)}.")
    return " ".join(s)


KINDS = [(_story, 0.35), (_counting, 0.15), (_facts, 0.1), (_sequence, 0.1), (_dialogue, 0.15),
         (_place, 0.15)]


def generate_document(seed: int, index: int) -> str:
    """Document ``index`` of the corpus with ``seed``: one to three paragraphs of text."""
    rng = random.Random(f"depthmix-corpus-v{GENERATOR_VERSION}-{seed}-{index}")
    makers, weights = zip(*KINDS)
    paragraphs = [rng.choices(makers, weights)[0](rng) for _ in range(rng.randint(1, 3))]
    return "\n\n".join(paragraphs)


def iter_documents(num_documents: int, seed: int = 0) -> Iterator[str]:
    for i in range(num_documents):
        yield generate_document(seed, i)


def write_corpus(path: str, num_documents: int, seed: int = 0) -> None:
    """Write the corpus as jsonl (``{"text": ...}`` per line), atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for text in iter_documents(num_documents, seed):
            f.write(json.dumps({"text": text}) + "\n")
    os.replace(tmp, path)
