"""Varied prompts for self-distillation data (``train.self_distill``), by kind, built from fixed lists (no download).

A kind is one sort of text a drafter meets at decode time. Each kind's prompts come in a fixed order; the first
``n`` are for training data and the last ``VALIDATION_PER_KIND`` are never generated for training, so they
validate the in-distribution setting. Kinds in ``HELDOUT_KINDS`` are never used for training at all: they
measure how a drafter carries over to whole kinds of text it never saw (a story, another programming language,
manual pages). ``manpages`` is a raw-text kind whose prompts are read from this machine's manual pages
(``heldout_manpages``), so it is not in ``prompts_of``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from itertools import product

VALIDATION_PER_KIND = 8
"""Prompts at the back of each training kind kept for in-distribution validation (never generated for training)."""


@dataclass(frozen=True)
class KindPrompt:
    """One prompt of one kind."""

    kind: str
    """The kind of text (a key of ``KINDS``)."""
    id: str
    """Stable id within the kind (``kind-index``)."""
    text: str
    """The user's message (``chat``) or the text the model continues (raw)."""
    chat: bool
    """Wrap ``text`` in the model's chat template as the user's turn (False: continue it as raw text)."""


_TOPICS = [
    "photosynthesis", "compound interest", "the water cycle", "public-key cryptography", "black holes",
    "how vaccines work", "supply and demand", "plate tectonics", "the French Revolution", "machine learning",
    "climate change", "the immune system", "inflation", "how a CPU executes instructions", "DNS",
    "the theory of evolution", "renewable energy", "the stock market", "sleep and memory", "volcanoes",
    "the printing press", "quantum computing", "how airplanes fly", "the Roman Empire", "recycling",
    "version control with git", "the human heart", "electric cars", "the moon's phases", "bees and pollination",
    "how the internet routes packets", "antibiotic resistance", "the Renaissance", "ocean tides", "databases",
]
_CHAT_FORMS = [
    "Explain {t} in simple terms.", "What are the most common misconceptions about {t}?",
    "Give me three key facts about {t}.", "How would you teach {t} to a ten-year-old?",
    "What are the pros and cons of learning about {t} from videos instead of books?",
]
_ADVICE = [
    "How can I sleep better?", "How do I prepare for a job interview?", "What should I pack for a week of hiking?",
    "How can I save money on groceries?", "How do I start learning to play the guitar?",
    "What is a good morning routine?", "How do I write a polite complaint email?", "How can I focus while studying?",
    "How do I keep houseplants alive?", "What are good habits for a new programmer?",
    "How should I plan a birthday party for a child?", "How do I make friends in a new city?",
    "What should I consider before adopting a dog?", "How do I give constructive feedback to a colleague?",
    "How can I reduce stress at work?", "How do I choose a laptop for university?",
]
_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "merges two sorted lists", "finds the largest element of a list",
    "removes duplicates from a list while keeping order", "computes the factorial of n",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit", "flattens a nested list",
    "returns the most frequent element of a list", "computes the greatest common divisor of two numbers",
    "parses a date string in YYYY-MM-DD format", "validates an email address with a regular expression",
    "reads a CSV file and sums one column", "implements binary search", "sorts a list of dictionaries by a key",
    "computes the average of a list of numbers", "groups words by their first letter",
    "implements a simple stack class", "counts vowels in a string", "transposes a matrix",
    "checks whether two strings are anagrams", "generates all permutations of a list",
]
_PY_LIBS = ["collections", "itertools", "re", "json", "pathlib", "datetime", "functools", "dataclasses",
            "argparse", "logging", "numpy", "requests", "pandas", "sqlite3", "asyncio", "unittest"]
_OTHER_LANGS = ["JavaScript", "C", "Java", "Go", "SQL", "Bash", "C++", "TypeScript"]
_PROSE = [
    "Write a short product description for {x}.", "Write a formal email asking for a meeting about {x}.",
    "Write a paragraph for a school essay about {x}.", "Summarize the main arguments for and against {x}.",
    "Write a short news report about a new discovery in {x}.",
]
_PROSE_SUBJECTS = [
    "a reusable water bottle", "remote work", "a city park renovation", "school uniforms", "solar panels",
    "a new coffee shop", "public libraries", "space exploration", "a noise-cancelling headset", "urban gardens",
    "four-day work weeks", "a bicycle sharing program", "online learning", "a smart thermostat", "museum funding",
]
_MATH_ITEMS = ["apples", "pencils", "books", "tickets", "cookies", "marbles", "stickers", "oranges"]
_STORY_SUBJECTS = [
    "a lighthouse keeper who finds a message in a bottle", "a robot learning to paint", "two friends lost in a forest",
    "a dragon afraid of heights", "a girl who can talk to birds", "the last day of summer camp",
    "a detective solving a case of a missing cake", "an astronaut returning home", "a cat who runs a bakery",
    "a time traveler stuck in 1920", "a village where it never rains", "a boy who builds a raft",
]
_RUST_TASKS = _CODE_TASKS[::2] + ["implements a linked list", "reads lines from standard input",
                                  "parses command-line arguments", "spawns two threads and joins them"]
# Second-round kinds (broader data: more subjects, more languages, practical writing; none is a story, Rust or a
# manual page, so the held-out kinds stay unseen).
_SUBJECTS = [
    "coral reefs", "the Silk Road", "nuclear fusion", "credit scores", "the human brain", "earthquakes",
    "the Industrial Revolution", "cloud computing", "honeybees", "jazz music", "the Olympic Games", "glaciers",
    "blood types", "electric guitars", "the Great Wall of China", "solar eclipses", "microplastics", "chess openings",
    "the Amazon rainforest", "compilers", "hurricanes", "the ancient Egyptians", "wind turbines", "coffee roasting",
    "the periodic table", "social media", "deserts", "cryptocurrency", "the Moon landing", "penguins",
    "3D printing", "the Cold War", "rainbows", "operating systems", "bread baking", "the metric system",
    "migratory birds", "open-source software", "the Byzantine Empire", "batteries", "mountain formation",
    "vitamins", "the Mars rovers", "traffic lights", "the Great Depression", "neural networks", "tea", "comets",
    "the postal system", "wildfires", "the violin", "GPS", "the Ottoman Empire", "fermentation", "satellites",
    "insurance", "the Olympic marathon", "noise pollution", "sharks", "spreadsheets",
]
_QUESTION_FORMS = [
    "What is the history of {t}?", "Why does {t} matter today?", "Write a short FAQ about {t}.",
    "List five surprising facts about {t}, with one sentence each.", "Describe how {t} works, step by step.",
    "What would a beginner need to know about {t}?", "Compare {t} today with fifty years ago.",
]
_MORE_LANGS = ["Ruby", "PHP", "Kotlin", "Swift", "C#", "Haskell", "Lua", "Perl", "R", "Scala", "Dart", "Julia"]
_MORE_TASKS = _CODE_TASKS + [
    "counts the lines of a file", "returns the second largest number in a list", "converts a number to binary",
    "capitalizes the first letter of every word", "computes the sum of the digits of a number",
    "checks whether a year is a leap year", "rotates a list by k positions", "zips two lists into pairs",
]
_WRITING = [
    "Write a review of {x}.", "Write a recipe that uses {x}.", "Write a two-minute speech about {x}.",
    "Write a cover letter for a job at a company that makes {x}.", "Write instructions for setting up {x}.",
    "Write the minutes of a team meeting that discussed {x}.", "Write an advertisement for {x}.",
    "Write the opening paragraph of a blog post about {x}.", "Write a letter to a city council about {x}.",
    "Write a checklist for choosing {x}.",
]
_WRITING_SUBJECTS = [
    "a standing desk", "a vegetable garden", "a mechanical keyboard", "a community swimming pool", "a rice cooker",
    "a hiking backpack", "an electric scooter", "a language-learning app", "a home espresso machine", "a tent",
    "a fitness tracker", "a used car", "a bookshelf", "a pair of running shoes", "a board game", "a home printer",
]
_MANPAGES = ["ls", "grep", "tar", "cp", "find", "chmod", "ssh", "sort", "curl", "awk", "sed", "ps"]


def _chat(kind: str, texts: list[str]) -> list[KindPrompt]:
    return [KindPrompt(kind, f"{kind}-{i}", t, True) for i, t in enumerate(texts)]


def _shuffled(items: list[str], seed: int) -> list[str]:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def _math_problems(n: int, seed: int) -> list[str]:
    """Two- and three-step arithmetic word problems with random numbers (GSM8K-like in shape)."""
    rng, out = random.Random(seed), []
    for i in range(n):
        item, a, b, c = rng.choice(_MATH_ITEMS), rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
        form = i % 3
        if form == 0:
            q = (f"Sam has {a} {item}. He buys {b} packs with {c} {item} in each pack. How many {item} does he "
                 "have now?")
        elif form == 1:
            q = (f"A store sells {item} for ${c} each. Maria buys {a} {item} and pays with ${a * c + b * 5}. "
                 "How much change does she get?")
        else:
            q = (f"A class of {a + 10} students shares {b * (a + 10)} {item} equally, then each student gives "
                 f"{min(c, b)} away. How many {item} does each student keep?")
        out.append(q + " Solve it step by step.")
    return out


def _code_continuations() -> list[str]:
    """Beginnings of Python functions the model continues as raw text (no chat)."""
    return [f'def {name}({args}):\n    """{doc}"""\n' for name, args, doc in [
        ("moving_average", "values, window", "Return the moving averages of values over a window."),
        ("word_count", "path", "Count the words of each line of the file at path."),
        ("chunked", "items, size", "Split items into lists of at most size elements."),
        ("parse_config", "text", "Parse 'key = value' lines into a dictionary, skipping comments."),
        ("retry", "func, attempts=3", "Call func until it succeeds, at most attempts times."),
        ("to_snake_case", "name", "Convert a CamelCase name to snake_case."),
        ("histogram", "numbers, bins", "Count how many numbers fall into each of bins equal-width bins."),
        ("deep_merge", "a, b", "Merge dictionary b into a, recursing into nested dictionaries."),
        ("top_k", "scores, k", "Return the k keys of scores with the highest values."),
        ("rle_encode", "text", "Run-length encode a string: 'aaab' -> 'a3b1'."),
        ("is_balanced", "expr", "Check that the brackets of expr are balanced."),
        ("matrix_multiply", "a, b", "Multiply two matrices given as lists of rows."),
        ("read_json_lines", "path", "Read a JSON-lines file into a list of dictionaries."),
        ("cache_result", "func", "Decorator that caches func's results by its arguments."),
        ("levenshtein", "a, b", "Return the edit distance between strings a and b."),
        ("normalize_whitespace", "text", "Collapse runs of whitespace in text to single spaces."),
    ]]


def prompts_of(kind: str) -> list[KindPrompt]:
    """Every prompt of a generated kind, in its fixed order (validation prompts last)."""
    if kind == "chat":
        forms = [f.format(t=t) for t, f in product(_TOPICS, _CHAT_FORMS)]
        return _chat(kind, _shuffled(forms, 1) + _ADVICE)
    if kind == "code_python":
        tasks = [f"Write a Python function that {t}." for t in _CODE_TASKS]
        libs = [f"Show a short example of using Python's {lib} module, with comments." for lib in _PY_LIBS]
        return _chat(kind, _shuffled(tasks + libs, 2))
    if kind == "code_other":
        texts = [f"Write a {lang} function that {t}." for lang, t in product(_OTHER_LANGS, _CODE_TASKS)]
        return _chat(kind, _shuffled(texts, 3))
    if kind == "prose":
        return _chat(kind, _shuffled([f.format(x=x) for f, x in product(_PROSE, _PROSE_SUBJECTS)], 4))
    if kind == "math":
        return _chat(kind, _math_problems(160, 5))
    if kind == "code_continue":
        return [KindPrompt(kind, f"{kind}-{i}", t, False) for i, t in enumerate(_code_continuations())]
    if kind == "questions":
        return _chat(kind, _shuffled([f.format(t=t) for t, f in product(_SUBJECTS, _QUESTION_FORMS)], 6)[:200])
    if kind == "code_more":
        texts = [f"Write a {lang} function that {t}." for lang, t in product(_MORE_LANGS, _MORE_TASKS)]
        return _chat(kind, _shuffled(texts, 7)[:200])
    if kind == "writing":
        return _chat(kind, _shuffled([f.format(x=x) for f, x in product(_WRITING, _WRITING_SUBJECTS)], 8))
    if kind == "stories":
        return _chat(kind, [f"Write a short story about {s}." for s in _STORY_SUBJECTS])
    if kind == "code_rust":
        return _chat(kind, [f"Write a Rust function that {t}." for t in _RUST_TASKS])
    raise KeyError(kind)


TRAIN_KINDS = ("chat", "code_python", "code_other", "prose", "math", "code_continue", "questions", "code_more",
               "writing")
"""Kinds whose model-generated text trains the adapter."""
HELDOUT_KINDS = ("stories", "code_rust", "manpages")
"""Kinds kept out of training entirely: a drafter's carry-over to text it never saw is measured on these."""


def training_prompts(kind: str, n: int | None = None) -> list[KindPrompt]:
    """The first ``n`` prompts of a training kind (all but its validation prompts when ``n`` is None)."""
    pool = prompts_of(kind)[:-VALIDATION_PER_KIND]
    return pool if n is None else pool[:n]


def validation_prompts(kind: str) -> list[KindPrompt]:
    """The back ``VALIDATION_PER_KIND`` prompts of a training kind (never generated for training)."""
    return prompts_of(kind)[-VALIDATION_PER_KIND:]


def heldout_manpages(chars: int = 900) -> list[KindPrompt]:
    """The first ``chars`` characters of a few manual pages rendered as text by ``man`` (empty when this
    machine has no ``man`` or no pages)."""
    if shutil.which("man") is None:
        return []
    out = []
    for name in _MANPAGES:
        run = subprocess.run(["man", "-P", "cat", name], capture_output=True, text=True,
                             env=os.environ | {"MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0"})
        plain = re.sub(".\b", "", run.stdout)  # drop overstrike (bold/underline) sequences
        text = "".join(ch for ch in plain if ch == "\n" or ch >= " ")
        if run.returncode == 0 and len(text) > chars:
            out.append(KindPrompt("manpages", f"manpages-{name}", text[:chars], False))
    return out
