"""Prompts for the speculative tests and benchmark: code editing, summarization, chat, QA."""

CODE = (
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
    "# Rewrite both functions above with type hints and docstrings.\n"
)
CODE2 = "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n"
CODE3 = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
SUMMARY = (
    "Article: The city council voted on Monday to expand the bike lane network. The council said "
    "the bike lane network will connect the river park to the train station. Cyclists welcomed the "
    "vote.\nSummary: The city council"
)
SUMMARY2 = (
    "Text: Water boils at 100 degrees Celsius at sea level. At higher altitude, water boils at a "
    "lower temperature because the air pressure is lower.\nIn one sentence, water boils"
)
PROMPTS = [
    CODE,
    CODE2,
    CODE3,
    SUMMARY,
    SUMMARY2,
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, there was a little fox who",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Q: What is 2 + 2?\nA:",
]

# Benchmark prompts (benchmarks/bench_speculative.py): chat-formatted requests the way a user
# sends them — edit a 20-line function file, summarize a 6-sentence article. Chosen before
# measuring and not tuned to the result.
_CODE_FILE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result


def emails(users):
    return [user["email"] for user in users]
'''
_ARTICLE = (
    "The city council voted on Monday to expand the bike lane network across the northern districts. "
    "According to the council, the new bike lanes will connect the river park to the central train station "
    "and to three schools. The project will cost 4 million dollars and construction will start in the spring. "
    "Council member Ana Ruiz said the bike lanes will make the roads safer for children who cycle to school. "
    "Local shop owners were worried that the bike lanes would remove parking spaces, but the council said "
    "that most parking spaces will stay. Cyclists welcomed the vote and said they hope the network will grow "
    "further."
)


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


CODE_EDITS = [
    _chat("Add type hints to every function in this Python code. Reply with the full code only.\n\n" + _CODE_FILE),
    _chat("Rename the variable `users` to `people` everywhere in this code and return the full code.\n\n"
          + _CODE_FILE),
]
SUMMARIES = [
    _chat("Summarize this article in three sentences.\n\n" + _ARTICLE),
    _chat("Article:\n" + _ARTICLE + "\n\nWhat did the council decide, and why? Answer using the article's words."),
]
CHATS = [
    _chat("Explain what a hash map is in two sentences."),
    _chat("Give me three tips for better sleep."),
]
