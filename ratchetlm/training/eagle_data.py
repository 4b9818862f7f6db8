"""Chat requests for self-distilling an EAGLE head, built from material on this machine.

Three kinds, like the requests a served instruct model gets:

* *code*: a function taken from the Python standard library's own source (``ast``), with an
  editing or explaining instruction;
* *article*: an article the target model itself wrote about a topic (first pass), then a
  summarizing or question-answering instruction over it (second pass);
* *chat*: open questions from templates over short concept lists.

Nothing is downloaded. The benchmark's own texts (tests/speculative/prompts.py: a bike-lane
article, a ``load_users`` file, hash maps, sleep) are kept out: topics and concepts naming them are
excluded, and code comes from the standard library only.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import textwrap

CODE_MODULES = (
    "textwrap", "shutil", "csv", "statistics", "string", "fnmatch", "calendar", "heapq", "bisect", "difflib",
    "glob", "colorsys", "pprint", "html", "base64", "quopri", "shlex", "ipaddress", "fractions", "filecmp",
    "mimetypes", "netrc", "plistlib", "tabnanny", "tokenize", "uu", "wave", "zipapp", "getopt", "gettext",
    "json.encoder", "json.decoder", "email.utils", "urllib.parse", "http.cookies", "logging.handlers",
    "importlib.util", "os", "posixpath", "random", "tempfile", "locale", "operator", "functools", "inspect",
)
CODE_TASKS = (
    "Add type hints to every function in this Python code. Reply with the full code only.",
    "Add a docstring to every function in this code and return the full code.",
    "Rename the variable `{var}` to `{new}` everywhere in this code and return the full code.",
    "Explain what this Python function does, step by step.",
    "Rewrite this code so it is easier to read. Return the full code.",
    "Find possible bugs in this code and explain them briefly.",
    "Write a short unit test for this function.",
    "Add comments to this code explaining each step. Reply with the code only.",
)
TOPICS = (
    "a new public library opening", "a local football team winning a final", "a heat wave in the south",
    "a museum exhibition of ancient coins", "a company launching an electric truck", "a river cleanup project",
    "a school starting a coding club", "a farmers market moving to a new square", "a new bridge over the harbor",
    "a solar farm built near a village", "a hospital opening a children's wing", "a storm closing the airport",
    "a bakery winning a national prize", "a train line being extended to the suburbs", "a zoo welcoming baby pandas",
    "a city planting ten thousand trees", "a music festival returning after five years", "a water price increase",
    "a university discovering a new beetle species", "a mayor announcing free bus rides for students",
    "a startup building cheaper batteries", "a library lending musical instruments", "a drought affecting farmers",
    "a new recycling system for plastic", "a marathon attracting record runners", "a town fixing old roads",
    "a theater restoring its historic building", "a factory cutting its emissions", "a teenager inventing a robot",
    "a park adding a skate area", "a chess tournament in the capital", "a rise in home prices",
    "a ferry service between two islands", "a campaign against food waste", "a new vaccine center",
    "scientists tracking whales along the coast", "a flood warning for river towns", "a village getting fast internet",
    "a bookstore celebrating its hundredth year", "a new rule on school phone use", "a wind farm at sea",
    "a city hall switching to renewable power", "a volunteer group helping elderly people", "an art prize for students",
    "a port expanding for bigger ships", "a community garden on a rooftop", "a new law on pet adoption",
    "a power outage downtown", "a restaurant serving only local food", "a space agency testing a new rocket",
)
SUMMARY_TASKS = (
    "Summarize this article in three sentences.",
    "Summarize this article in one sentence.",
    "Give the three main points of this article as a list.",
    "What is the main news in this article, and who is involved? Answer using the article's words.",
    "Write a short headline and a two-sentence summary for this article.",
    "What happened, and what happens next? Answer from the article.",
)
CONCEPTS = (
    "a linked list", "recursion", "an API", "a compiler", "machine learning", "photosynthesis", "inflation",
    "a black hole", "gravity", "a database index", "encryption", "the water cycle", "a virus", "democracy",
    "a neural network", "cloud computing", "an operating system", "DNA", "climate change", "supply and demand",
    "a binary search", "a stack", "a queue", "version control", "a function in programming", "an atom",
    "electric current", "a vaccine", "the internet", "a spreadsheet", "a budget", "compound interest",
    "a sorting algorithm", "an ecosystem", "a volcano", "an earthquake", "a sonnet", "a metaphor", "a web browser",
    "a password manager", "object-oriented programming", "a prime number", "probability", "a cell membrane",
)
ACTIVITIES = (
    "learning a new language", "saving money", "staying focused while studying", "writing a good email",
    "preparing for a job interview", "starting to run", "keeping a plant alive", "cooking on a budget",
    "giving a presentation", "organizing a small event", "reading more books", "working from home",
    "learning to code", "traveling on a budget", "taking better photos", "reducing stress",
)
PAIRS = (
    ("a list", "a tuple"), ("weather", "climate"), ("a virus", "a bacterium"), ("RAM", "storage"),
    ("a compiler", "an interpreter"), ("TCP", "UDP"), ("speed", "velocity"), ("a lake", "a sea"),
    ("an array", "a linked list"), ("mitosis", "meiosis"), ("a noun", "a verb"), ("HTTP", "HTTPS"),
)
CHAT_TASKS = (
    "Explain what {c} is in two sentences.",
    "Explain {c} to a ten-year-old.",
    "Give three tips for {a}.",
    "What is the difference between {p} and {q}?",
    "Write a short poem about {c}.",
    "List five facts about {c}.",
    "How do I get better at {a}? Answer briefly.",
)
EXCLUDED_WORDS = ("bike", "cycl", "council", "hash", "sleep", "load_users")


def _functions(module_name: str) -> list[str]:
    try:
        src = inspect.getsource(importlib.import_module(module_name))
    except (ImportError, OSError, TypeError):
        return []
    out = []
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            text = ast.get_source_segment(src, node)
            if text and 5 <= n <= 30 and not any(w in text.lower() for w in EXCLUDED_WORDS):
                out.append(textwrap.dedent(text))
    return out


def _variable(code: str, rng: random.Random) -> str | None:
    names = sorted({n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and len(n.id) > 2
                    and n.id.islower()})
    return rng.choice(names) if names else None


def code_requests(n: int, rng: random.Random) -> list[str]:
    funcs = [f for m in CODE_MODULES for f in _functions(m)]
    rng.shuffle(funcs)
    out = []
    for code in funcs:
        task = rng.choice(CODE_TASKS)
        if "{var}" in task:
            var = _variable(code, rng)
            if var is None:
                continue
            task = task.format(var=var, new=rng.choice(("value", "item", "result", "data", "entry")) + "_new")
        out.append(f"{task}\n\n{code}")
        if len(out) == n:
            break
    return out


def article_requests(n: int, rng: random.Random) -> list[str]:
    topics = [t for t in TOPICS if not any(w in t for w in EXCLUDED_WORDS)]
    return [f"Write a short news article of about six sentences about {topics[i % len(topics)]}."
            + ("" if i < len(topics) else f" Include the name of a person and a number. (Version {i // len(topics)})")
            for i in range(n)]


def summary_requests(articles: list[str], per_article: int, rng: random.Random) -> list[str]:
    out = []
    for a in articles:
        if any(w in a.lower() for w in EXCLUDED_WORDS):
            continue
        for task in rng.sample(SUMMARY_TASKS, per_article):
            out.append(f"{task}\n\n{a}" if rng.random() < 0.5 else f"Article:\n{a}\n\n{task}")
    return out


def chat_requests(n: int, rng: random.Random) -> list[str]:
    """Up to ``n`` distinct questions (the templates allow a few hundred)."""
    out: dict[str, None] = {}
    for _ in range(50 * n):
        if len(out) == n:
            break
        p, q = rng.choice(PAIRS)
        out[rng.choice(CHAT_TASKS).format(c=rng.choice(CONCEPTS), a=rng.choice(ACTIVITIES), p=p, q=q)] = None
    return list(out)
