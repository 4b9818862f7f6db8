"""A generated low-entropy corpus for training the tiny WeDLM model.

Every document is one line ``<prompt> <answer>`` where the answer is (almost) fully determined
by the prompt: counting, counting down, counting in steps, multiplication tables, letter runs,
repeated phrases, templated arithmetic word problems. That is the regime where parallel
decoding should commit many tokens per forward. The vocabulary is closed (numbers 0..199,
a few dozen words and letters), so a word-level tokenizer covers it exactly.

``held_out(n, seed)`` gives (prompt, answer) pairs whose prompts never occur in the training
stream (``documents`` skips them), so accuracy is measured on unseen instances.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

MAX_NUM = 199
LETTERS = "abcdefghijklmnopqrstuvwxyz"
COLORS = ("red", "blue", "green", "small", "big", "old", "happy", "quiet")
ANIMALS = ("cat", "dog", "fox", "bird", "cow", "frog", "fish", "bear")
VERBS = ("sees", "likes", "eats", "finds", "jumps over", "sits on")
THINGS = ("mat", "tree", "ball", "box", "hat", "cake", "rock", "bed")
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank")
FRUITS = ("apples", "pears", "plums", "eggs", "books", "coins")


@dataclass(frozen=True)
class Example:
    prompt: str  # ends just before the answer; the answer starts with a space-separated word
    answer: str  # includes the final "." (the model is trained to emit <eos> after it)

    @property
    def text(self) -> str:
        return f"{self.prompt} {self.answer}"


def _nums(xs: list[int]) -> str:
    return " ".join(str(x) for x in xs)


def _count(r: random.Random) -> Example:
    n = r.randint(4, 24)
    a = r.randint(0, MAX_NUM - n)
    return Example(f"count from {a} to {a + n} :", _nums(list(range(a, a + n + 1))) + " .")


def _count_down(r: random.Random) -> Example:
    n = r.randint(4, 20)
    a = r.randint(n, MAX_NUM)
    return Example(f"count down from {a} to {a - n} :", _nums(list(range(a, a - n - 1, -1))) + " .")


def _count_by(r: random.Random) -> Example:
    step = r.randint(2, 9)
    terms = r.randint(4, 12)
    a = r.randint(0, MAX_NUM - step * (terms - 1))
    return Example(f"count by {step} from {a} for {terms} terms :",
                   _nums([a + step * i for i in range(terms)]) + " .")


def _table(r: random.Random) -> Example:
    k = r.randint(2, 19)
    m = r.randint(5, 10)
    return Example(f"table of {k} up to {m} :", _nums([k * i for i in range(1, m + 1)]) + " .")


def _letters(r: random.Random) -> Example:
    i = r.randint(0, 20)
    j = r.randint(i + 3, 25)
    return Example(f"letters from {LETTERS[i]} to {LETTERS[j]} :", " ".join(LETTERS[i : j + 1]) + " .")


def _repeat(r: random.Random) -> Example:
    phrase = f"the {r.choice(COLORS)} {r.choice(ANIMALS)} {r.choice(VERBS)} the {r.choice(THINGS)}"
    k = r.randint(2, 4)
    return Example(f"repeat {k} times : {phrase} ;", " ; ".join([phrase] * k) + " .")


def _word_problem(r: random.Random) -> Example:
    a, b = r.randint(0, 99), r.randint(0, 99)
    n1, n2 = r.sample(NAMES, 2)
    f = r.choice(FRUITS)
    return Example(f"{n1} has {a} {f} and {n2} has {b} {f} . together they have",
                   f"{a + b} {f} . {n1} has {a} and {n2} has {b} .")


def _sum(r: random.Random) -> Example:
    a, b = r.randint(0, 99), r.randint(0, 99)
    op = r.choice("+-")
    if op == "-" and b > a:
        a, b = b, a
    c = a + b if op == "+" else a - b
    return Example(f"{a} {op} {b} =", f"{c} , so {a} {op} {b} is {c} .")


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "count": _count, "count_down": _count_down, "count_by": _count_by, "table": _table,
    "letters": _letters, "repeat": _repeat, "word_problem": _word_problem, "sum": _sum,
}


def vocabulary_words() -> list[str]:
    """Every word any task can produce (the tokenizer's closed vocabulary)."""
    words = {str(i) for i in range(MAX_NUM + 1)} | set(LETTERS)
    words |= {"count", "from", "to", "down", "by", "for", "terms", "table", "of", "up", "letters", "repeat",
              "times", "the", "has", "and", "together", "they", "have", "so", "is",
              ":", ";", ".", ",", "=", "+", "-"}
    for group in (COLORS, ANIMALS, THINGS, NAMES, FRUITS):
        words |= set(group)
    for v in VERBS:
        words |= set(v.split())
    return sorted(words)


def held_out(n: int, seed: int = 12345) -> list[Example]:
    """``n`` evaluation examples, cycling over tasks; their prompts are excluded from training."""
    r = random.Random(seed)
    names = list(TASKS)
    out: list[Example] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"cannot draw {n} distinct held-out prompts from the corpus tasks")
        ex = TASKS[names[attempts % len(names)]](r)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    return out


def documents(seed: int, exclude: set[str]) -> Iterator[str]:
    """An endless stream of training documents (tasks drawn uniformly), skipping held-out prompts."""
    r = random.Random(seed)
    names = list(TASKS)
    while True:
        ex = TASKS[r.choice(names)](r)
        if ex.prompt not in exclude:
            yield ex.text
