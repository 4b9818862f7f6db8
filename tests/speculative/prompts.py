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
